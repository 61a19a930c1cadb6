//! End-to-end runs of the `kiln` binary on the committed fixture models: JSON output, the
//! compile cache (hits never touch MLIR, corrupt entries are rebuilt, concurrent compiles both
//! succeed), `--emit-mlir`/`--emit-asm`, and one clear error per kind of bad input.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn kiln(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_CACHE_DIR", cache)
        .env_remove("KILN_PROFILE")
        .output()
        .expect("kiln runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn run_json(cache: &Path, model: &Path, prompt: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "run",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--json",
        "--threads",
        "2",
    ];
    args.extend_from_slice(extra);
    let o = kiln(cache, &args);
    assert!(o.status.success(), "kiln run failed: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is one JSON object ({e}): {}",
            String::from_utf8_lossy(&o.stdout)
        )
    })
}

/// Folders under the cache root that are entries (32-hex-digit names).
fn entries(cache: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(cache) else {
        return vec![];
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir() && p.file_name().unwrap().to_str().unwrap().len() == 32)
        .collect();
    v.sort();
    v
}

/// Anything under the cache root other than finished entries and lock files.
fn leftovers(cache: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(cache) else {
        return vec![];
    };
    rd.filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

#[test]
fn second_run_is_a_cache_hit_without_mlir() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("qwen3");
    let first = run_json(cache.path(), &model, "Hello there", &[]);
    for field in [
        "prompt_token_ids",
        "token_ids",
        "text",
        "prefill_tok_s",
        "decode_tok_s",
        "compile_s",
        "cache_hit",
    ] {
        assert!(first.get(field).is_some(), "--json lacks {field}");
    }
    assert_eq!(first["cache_hit"], false);
    assert!(first["compile_s"].as_f64().unwrap() > 0.0);
    assert!(first["mlir_contexts"].as_u64().unwrap() > 0, "a miss compiles");

    let second = run_json(cache.path(), &model, "Hello there", &[]);
    assert_eq!(second["cache_hit"], true);
    assert_eq!(second["compile_s"].as_f64().unwrap(), 0.0);
    assert_eq!(
        second["mlir_contexts"], 0,
        "a cache hit must not create any MLIR context"
    );
    assert_eq!(first["token_ids"], second["token_ids"]);
    assert_eq!(entries(cache.path()).len(), 1);
}

#[test]
fn corrupt_or_truncated_library_is_detected_and_rebuilt() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("llama");
    let reference = run_json(cache.path(), &model, "The weather", &[]);
    let entry = entries(cache.path()).pop().unwrap();
    let lib = entry.join("libkiln.so");
    let len = std::fs::metadata(&lib).unwrap().len();

    // Truncated.
    let bytes = std::fs::read(&lib).unwrap();
    std::fs::write(&lib, &bytes[..bytes.len() / 3]).unwrap();
    let o = kiln(
        cache.path(),
        &[
            "run",
            model.to_str().unwrap(),
            "--prompt",
            "The weather",
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("corrupt"),
        "the rebuild is reported: {}",
        stderr(&o)
    );
    let rebuilt: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(rebuilt["cache_hit"], false);
    assert_eq!(rebuilt["token_ids"], reference["token_ids"]);

    // Same size, garbage content.
    std::fs::write(&lib, vec![0x5au8; len as usize]).unwrap();
    let again = run_json(cache.path(), &model, "The weather", &[]);
    assert_eq!(again["cache_hit"], false);
    assert_eq!(again["token_ids"], reference["token_ids"]);

    // Missing meta.json.
    std::fs::remove_file(entry.join("meta.json")).unwrap();
    let again = run_json(cache.path(), &model, "The weather", &[]);
    assert_eq!(again["cache_hit"], false);
    assert!(
        leftovers(cache.path()).is_empty(),
        "no staging or trash left: {:?}",
        leftovers(cache.path())
    );
}

#[test]
fn two_processes_compiling_the_same_model_both_succeed() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("mistral");
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["compile", model.to_str().unwrap(), "--json"])
            .env("KILN_CACHE_DIR", cache.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(a.status.success(), "{}", stderr(&a));
    assert!(b.status.success(), "{}", stderr(&b));
    let ja: Value = serde_json::from_slice(&a.stdout).unwrap();
    let jb: Value = serde_json::from_slice(&b.stdout).unwrap();
    assert_eq!(ja["cache_key"], jb["cache_key"]);
    // Exactly one of them compiled; the other waited for the lock and found the entry.
    assert_eq!(
        [ja["cache_hit"].as_bool().unwrap(), jb["cache_hit"].as_bool().unwrap()]
            .iter()
            .filter(|h| **h)
            .count(),
        1
    );
    assert_eq!(entries(cache.path()).len(), 1);
    let run = run_json(cache.path(), &model, "Once upon a time", &[]);
    assert_eq!(run["cache_hit"], true);
}

#[test]
fn emit_mlir_and_asm_show_the_baked_constants() {
    let cache = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let (mlir, asm) = (out.path().join("mlir"), out.path().join("asm"));
    let model = fixture("qwen2");
    let o = kiln(
        cache.path(),
        &[
            "compile",
            model.to_str().unwrap(),
            "--emit-mlir",
            mlir.to_str().unwrap(),
            "--emit-asm",
            asm.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let mlir_files: Vec<_> = std::fs::read_dir(&mlir).unwrap().map(|e| e.unwrap().path()).collect();
    let asm_files: Vec<_> = std::fs::read_dir(&asm).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(mlir_files.len() >= 10 && mlir_files.len() == asm_files.len());
    // The tied output head (final norm folded in): vocabulary x hidden, in bf16, as a static shape.
    let head = mlir_files
        .iter()
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("kiln_matmul_n1003_k64_bf16_rms_decode")
        })
        .expect("the output-head kernel's MLIR");
    let text = std::fs::read_to_string(head).unwrap();
    assert!(
        text.contains("memref<1003x64xbf16>"),
        "dimensions are constants in the MLIR"
    );
    assert!(
        asm_files
            .iter()
            .any(|p| std::fs::read_to_string(p).unwrap().contains("vfmadd")),
        "FMA code for the host"
    );

    // Asking again on a cache hit still writes the dumps.
    let again = out.path().join("again");
    let o = kiln(
        cache.path(),
        &[
            "compile",
            model.to_str().unwrap(),
            "--emit-mlir",
            again.to_str().unwrap(),
        ],
    );
    assert!(o.status.success());
    assert_eq!(std::fs::read_dir(&again).unwrap().count(), mlir_files.len());
}

#[test]
fn info_and_cache_commands() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("llama");
    let o = kiln(cache.path(), &["info", model.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let info: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(info["cache_state"], "not compiled");
    assert_eq!(info["spec"]["dims"]["hidden_size"], 64);
    assert!(info["parameters"].as_u64().unwrap() > 100_000);
    // Untied: both embedding and head are read per token... only one embedding row.
    assert!(info["weight_bytes_per_token"].as_u64().unwrap() < 2 * info["parameters"].as_u64().unwrap());
    let key = info["cache_key"].as_str().unwrap().to_string();
    assert!(!cache.path().join(&key).exists(), "info creates nothing");

    run_json(cache.path(), &model, "hi", &[]);
    let o = kiln(cache.path(), &["info", model.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("compiled ("));
    let o = kiln(cache.path(), &["cache", "list"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains(&key));
    let o = kiln(cache.path(), &["clean-cache", &key[..8]]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(entries(cache.path()).is_empty());
    run_json(cache.path(), &model, "hi", &[]);
    let o = kiln(cache.path(), &["cache", "clean", "--all"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(entries(cache.path()).is_empty());
}

/// `kiln probe` measures every thread count from one to the physical cores, prints the result
/// as one JSON object, and stores the same object next to the cache (where `kiln bench` reads
/// the machine's ceilings); nothing else is left behind.
#[test]
fn probe_reports_and_stores_every_thread_count() {
    let cache = tempfile::tempdir().unwrap();
    let o = kiln(cache.path(), &["probe", "--passes", "1", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let printed: Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON object");
    let reads = printed["read_gb_s"].as_array().expect("read_gb_s");
    let fmas = printed["fma_gflop_s"].as_array().expect("fma_gflop_s");
    assert!(!reads.is_empty() && reads.len() == fmas.len(), "{printed}");
    for (i, (r, f)) in reads.iter().zip(fmas).enumerate() {
        assert_eq!(r["threads"], i + 1, "thread counts 1, 2, ...: {printed}");
        assert_eq!(f["threads"], i + 1);
        assert!(r["best"].as_f64().unwrap() > 0.0 && f["best"].as_f64().unwrap() > 0.0);
        assert!(r["best"].as_f64() >= r["median"].as_f64(), "best is the largest pass");
    }
    assert!(
        printed["buffer_bytes"].as_u64().unwrap() >= 1 << 30,
        "reads come from memory"
    );
    let stored: Vec<PathBuf> = std::fs::read_dir(cache.path().join("probe"))
        .expect("probe folder")
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(stored.len(), 1, "{stored:?}");
    let saved: Value = serde_json::from_slice(&std::fs::read(&stored[0]).unwrap()).unwrap();
    assert_eq!(saved, printed, "the stored result is the printed one");
    assert!(leftovers(cache.path()).is_empty(), "{:?}", leftovers(cache.path()));
}

/// A copy of a fixture in a temp folder, to break.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

/// Checks the error contract on a finished run: non-zero exit, one line on stderr containing
/// every `needle`, no panic.
fn assert_one_line_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success");
    assert!(!err.contains("panicked"), "panic: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("compiling")).collect();
    assert_eq!(lines.len(), 1, "one line of error: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "error should mention {n:?}: {err}");
    }
}

/// Runs `kiln run` on a broken model and checks the error contract: non-zero exit, one line on
/// stderr containing every `needle`, no panic, no cache entry.
fn expect_error(model: &Path, cache: &Path, extra: &[&str], needles: &[&str]) {
    let mut args = vec!["run", model.to_str().unwrap(), "--prompt", "hello", "--max-tokens", "4"];
    args.extend_from_slice(extra);
    let o = kiln(cache, &args);
    assert_one_line_error(&o, needles);
    assert!(
        entries(cache).is_empty() || extra.contains(&"--ctx"),
        "no cache entry for a bad model"
    );
    assert!(
        leftovers(cache).is_empty(),
        "nothing half-written: {:?}",
        leftovers(cache)
    );
}

#[test]
fn missing_and_malformed_config() {
    let cache = tempfile::tempdir().unwrap();
    let missing = tempfile::tempdir().unwrap().path().join("nope");
    expect_error(&missing, cache.path(), &[], &["nope", "folder", "GGUF file"]);
    // A mistyped GGUF path is told it names no GGUF file.
    let gguf = tempfile::tempdir().unwrap().path().join("model-Q4_K_M.gguf");
    expect_error(&gguf, cache.path(), &[], &["model-Q4_K_M.gguf", "expected a GGUF file"]);

    let m = copy_fixture("llama");
    std::fs::remove_file(m.path().join("config.json")).unwrap();
    expect_error(m.path(), cache.path(), &[], &["config.json"]);

    let m = copy_fixture("llama");
    std::fs::write(
        m.path().join("config.json"),
        "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64,",
    )
    .unwrap();
    expect_error(m.path(), cache.path(), &[], &["config.json", "line"]);

    let m = copy_fixture("llama");
    let text = std::fs::read_to_string(m.path().join("config.json"))
        .unwrap()
        .replace("LlamaForCausalLM", "BloomForCausalLM");
    let text = text.replace("\"model_type\": \"llama\"", "\"model_type\": \"bloom\"");
    std::fs::write(m.path().join("config.json"), text).unwrap();
    expect_error(m.path(), cache.path(), &[], &["config.json", "BloomForCausalLM"]);
}

/// Rewrites the fixture's safetensors with `edit` applied to its tensor list.
fn rewrite_tensors(dir: &Path, edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

#[test]
fn bad_tensors() {
    let cache = tempfile::tempdir().unwrap();
    let name = "model.layers.1.mlp.up_proj.weight";

    let m = copy_fixture("llama");
    rewrite_tensors(m.path(), |t| t.retain(|(n, ..)| n != name));
    expect_error(m.path(), cache.path(), &[], &[name, "model.safetensors"]);

    let m = copy_fixture("llama");
    rewrite_tensors(m.path(), |t| {
        let e = t.iter_mut().find(|(n, ..)| n == name).unwrap();
        e.2 = vec![68, 128]; // 136 x 64 reshaped: same bytes, wrong shape
    });
    expect_error(m.path(), cache.path(), &[], &[name, "[68, 128]", "[136, 64]"]);

    let m = copy_fixture("llama");
    rewrite_tensors(m.path(), |t| {
        let e = t.iter_mut().find(|(n, ..)| n == name).unwrap();
        e.1 = safetensors::Dtype::I16;
    });
    expect_error(m.path(), cache.path(), &[], &[name, "I16"]);

    let m = copy_fixture("llama");
    let path = m.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    expect_error(m.path(), cache.path(), &[], &["model.safetensors", "truncated"]);
}

/// `kiln run MODEL` from the folder `cwd`; fails the test unless it exits within 30 s (a blocking
/// read of a FIFO never would, so the child is killed instead of hanging the suite).
fn run_within_30s(cache: &Path, cwd: &Path, model: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["run", model, "--prompt", "hello", "--max-tokens", "2"])
        .current_dir(cwd)
        .env("KILN_CACHE_DIR", cache)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("KILN_PROFILE")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kiln starts");
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(30) {
            child.kill().unwrap();
            panic!("kiln run {model} blocked for 30 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// A FIFO, a device or a symlink loop as the model (or as one of its files) is named as what it
/// is, quickly, and never read.
#[test]
fn special_files_as_the_model() {
    use kiln_testkit::special_files::{mkfifo, symlink_loop};
    let cache = tempfile::tempdir().unwrap();
    let base = tempfile::tempdir().unwrap();
    let fifo = base.path().join("model");
    mkfifo(&fifo);
    let o = run_within_30s(cache.path(), base.path(), fifo.to_str().unwrap());
    assert_one_line_error(
        &o,
        &[fifo.to_str().unwrap(), "is a FIFO (named pipe), not a regular file"],
    );
    let o = run_within_30s(cache.path(), base.path(), "/dev/zero");
    assert_one_line_error(&o, &["/dev/zero is a character device, not a regular file"]);

    let m = copy_fixture("llama");
    let tokenizer = m.path().join("tokenizer.json");
    std::fs::remove_file(&tokenizer).unwrap();
    mkfifo(&tokenizer);
    let o = run_within_30s(cache.path(), base.path(), m.path().to_str().unwrap());
    assert_one_line_error(&o, &[tokenizer.to_str().unwrap(), "is a FIFO"]);

    // Relative and shaped like a hub id (`org/name`): still a local path, not a download.
    std::fs::create_dir(base.path().join("models")).unwrap();
    symlink_loop(&base.path().join("models/looped"));
    let o = run_within_30s(cache.path(), base.path(), "models/looped");
    assert_one_line_error(&o, &["models/looped is a symlink loop"]);
    assert!(entries(cache.path()).is_empty());
}

/// Two tensors of a safetensors file whose `data_offsets` overlap: the model would load and
/// run on another tensor's bytes. Refused, naming both.
#[test]
fn overlapping_tensors_are_refused() {
    let cache = tempfile::tempdir().unwrap();
    let m = copy_fixture("llama");
    let path = m.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let (k, v) = (
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
    );
    header[k]["data_offsets"] = header[v]["data_offsets"].clone();
    let mut text = header.to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text.as_bytes());
    out.extend(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    expect_error(m.path(), cache.path(), &[], &["model.safetensors", k, v, "overlap"]);
}

#[test]
fn prompt_longer_than_the_context() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("qwen2");
    let long = "words and more words ".repeat(200);
    // Longer than the model's 512 positions.
    let o = kiln(
        cache.path(),
        &["run", model.to_str().unwrap(), "--prompt", &long, "--max-tokens", "4"],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("tokens") && err.contains("context") && !err.contains("panicked"),
        "{err}"
    );
    // And against a smaller --ctx.
    expect_error(&model, cache.path(), &["--ctx", "2"], &["context", "--ctx"]);
    // --ctx beyond the model's limit.
    expect_error(&model, cache.path(), &["--ctx", "100000"], &["max_position_embeddings"]);
}

#[test]
fn unknown_or_unsupported_target_cpu() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("qwen2");
    expect_error(
        &model,
        cache.path(),
        &["--target-cpu", "haswell"],
        &["--target-cpu", "unknown target CPU `haswell`", "x86-64-v3"],
    );
    let host = kiln_core::HostCpu::detect();
    if host.x86_level("x86-64-v4").is_err() && host.arch == "x86_64" {
        // A level above this CPU's: the library could not run here.
        expect_error(&model, cache.path(), &["--target-cpu", "x86-64-v4"], &["lacks avx512"]);
    }
}

#[test]
fn unwritable_cache_folder() {
    let base = tempfile::tempdir().unwrap();
    // A cache path below a regular file can be created by nobody, root included.
    let file = base.path().join("not-a-folder");
    std::fs::write(&file, "x").unwrap();
    let cache = file.join("cache");
    let o = kiln(
        &cache,
        &[
            "run",
            fixture("llama").to_str().unwrap(),
            "--prompt",
            "hello",
            "--max-tokens",
            "2",
        ],
    );
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(
        err.starts_with("error: ") && err.lines().count() == 1 && !err.contains("panicked"),
        "{err}"
    );
    assert!(err.contains(cache.to_str().unwrap()), "names the folder: {err}");
}

/// `kiln run --json --max-tokens 6` on `model` with `extra` flags and no sampling flag of its
/// own.
fn run_sampled(cache: &Path, model: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "run",
        model.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "6",
        "--json",
        "--threads",
        "2",
    ];
    args.extend_from_slice(extra);
    let o = kiln(cache, &args);
    assert!(o.status.success(), "kiln run failed: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn close(v: &Value, expected: f64) -> bool {
    v.as_f64().is_some_and(|x| (x - expected).abs() < 1e-6)
}

/// Proves that the sampling a model's generation_config.json states is what a run without
/// flags uses (the tokens equal those of the same values given as flags), that each flag wins
/// key by key, that `do_sample: false` is greedy, that a malformed value is one line naming
/// the file and key, and that a GGUF file keeps llama.cpp's defaults; `run --json` shows the
/// values used and where each came from.
#[test]
fn sampling_defaults_come_from_generation_config() {
    let cache = tempfile::tempdir().unwrap();
    let tuned = copy_fixture("qwen2");
    let gen_path = tuned.path().join("generation_config.json");
    std::fs::write(
        &gen_path,
        r#"{"bos_token_id": 1000, "eos_token_id": 1000, "do_sample": true, "temperature": 0.7,
            "top_p": 0.8, "top_k": 20, "min_p": 0.02, "repetition_penalty": 1.05}"#,
    )
    .unwrap();
    let from_file = run_sampled(cache.path(), tuned.path(), &["--seed", "3"]);
    let s = &from_file["sampling"];
    for (key, value) in [
        ("temperature", 0.7),
        ("top_p", 0.8),
        ("top_k", 20.0),
        ("min_p", 0.02),
        ("repetition_penalty", 1.05),
    ] {
        assert!(close(&s[key], value), "{key}: {s}");
        assert_eq!(s["from"][key], "generation_config.json", "{s}");
    }
    assert_eq!(s["greedy"], false);
    assert_eq!(s["seed"], 3);
    // The same values as flags, on the fixture (whose file says do_sample: false), give the
    // same tokens: the file's values are used, not only shown.
    let as_flags = run_sampled(
        cache.path(),
        &fixture("qwen2"),
        &[
            "--seed",
            "3",
            "--temperature",
            "0.7",
            "--top-p",
            "0.8",
            "--top-k",
            "20",
            "--min-p",
            "0.02",
            "--repetition-penalty",
            "1.05",
        ],
    );
    assert_eq!(as_flags["token_ids"], from_file["token_ids"]);
    assert!(
        as_flags["sampling"]["from"]
            .as_object()
            .unwrap()
            .values()
            .all(|v| v == "flag")
    );

    // Flags win key by key.
    let mixed = run_sampled(cache.path(), tuned.path(), &["--temperature", "0", "--top-k", "5"]);
    let s = &mixed["sampling"];
    assert!(close(&s["temperature"], 0.0) && close(&s["top_k"], 5.0), "{s}");
    assert_eq!(s["from"]["temperature"], "flag");
    assert_eq!(s["from"]["top_k"], "flag");
    assert!(close(&s["top_p"], 0.8), "{s}");
    assert_eq!(s["from"]["top_p"], "generation_config.json");
    assert_eq!(s["greedy"], true);

    // do_sample: false (the fixture's own file) is greedy: the tokens of --temperature 0.
    let greedy = run_sampled(cache.path(), &fixture("qwen2"), &[]);
    assert!(close(&greedy["sampling"]["temperature"], 0.0));
    assert_eq!(greedy["sampling"]["from"]["temperature"], "generation_config.json");
    assert_eq!(greedy["sampling"]["from"]["top_k"], "default");
    let argmax = run_sampled(cache.path(), &fixture("qwen2"), &["--temperature", "0"]);
    assert_eq!(greedy["token_ids"], argmax["token_ids"]);

    // A malformed value: one line naming the file and the key.
    std::fs::write(&gen_path, r#"{"eos_token_id": 1000, "top_p": "high"}"#).unwrap();
    let o = kiln(
        cache.path(),
        &[
            "run",
            tuned.path().to_str().unwrap(),
            "--prompt",
            "x",
            "--max-tokens",
            "1",
        ],
    );
    assert_one_line_error(&o, &["generation_config.json", "\"top_p\"", "must be a number"]);

    // GGUF has no generation_config.json: llama.cpp's defaults.
    let gguf = fixture("gguf").join("qwen2-bf16.gguf");
    let s = run_sampled(cache.path(), &gguf, &[])["sampling"].clone();
    assert!(close(&s["temperature"], 0.8) && close(&s["top_k"], 40.0), "{s}");
    assert!(close(&s["top_p"], 0.95) && close(&s["min_p"], 0.05), "{s}");
    assert!(s["from"].as_object().unwrap().values().all(|v| v == "default"), "{s}");
}
