//! A Hugging Face model folder where something is not the regular file it should be (a FIFO, a
//! device, a directory, a symlink loop), and safetensors files whose tensors share bytes.
//!
//! Invariants: every such case is one error naming the path and what it is (never "does not
//! exist" for something that is there), nothing blocks on a FIFO (each load runs under
//! [`within`]), and overlapping `data_offsets` are refused naming both tensors.

use crate::loader::{self, LoadOptions};
use kiln_testkit::special_files::{mkfifo, symlink_loop, within};
use serde_json::{Value, json};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tempfile::TempDir;

/// A copy of the repository's tiny Qwen2 model (config, weights, tokenizer files).
fn qwen2() -> TempDir {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen2");
    let dir = tempfile::tempdir().unwrap();
    for e in fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

/// The error of `loader::load(path)` (config, weights and tokenizer), which must come within
/// 10 s: a FIFO opened for a blocking read would never return.
fn load_err(path: &Path) -> String {
    let p = path.to_path_buf();
    let (result, _) = within(
        Duration::from_secs(10),
        &format!("loading {}", path.display()),
        move || loader::load(&p, &LoadOptions::default()).map(|m| m.architecture),
    );
    let e = match result {
        Ok(arch) => panic!("loading {} should fail, read a {arch} model", path.display()),
        Err(e) => e.to_string(),
    };
    assert_eq!(e.lines().count(), 1, "one line: {e}");
    e
}

/// Replaces `name` in `dir` by a FIFO.
fn fifo_at(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let _ = fs::remove_file(&p);
    mkfifo(&p);
    p
}

/// Replaces `name` in `dir` by an empty directory.
fn dir_at(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let _ = fs::remove_file(&p);
    fs::create_dir(&p).unwrap();
    p
}

/// Replaces `name` in `dir` by a symlink to itself.
fn loop_at(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let _ = fs::remove_file(&p);
    symlink_loop(&p);
    p
}

const FIFO: &str = "is a FIFO (named pipe), not a regular file";
const DIR: &str = "is a directory, not a regular file";
const LOOP: &str = "is a symlink loop (too many levels of symbolic links)";

#[test]
fn model_path_that_is_a_fifo_device_or_loop_is_named_not_missing() {
    let base = tempfile::tempdir().unwrap();
    let expected =
        "not a regular file or folder (expected a Hugging Face model folder, its config.json or a GGUF file)";
    let fifo = fifo_at(base.path(), "model");
    assert_eq!(
        load_err(&fifo),
        format!("{} is a FIFO (named pipe), {expected}", fifo.display())
    );
    // Named like a GGUF file, or given straight to the safetensors front end: the same answer.
    let fifo_gguf = fifo_at(base.path(), "model.gguf");
    assert_eq!(
        load_err(&fifo_gguf),
        format!("{} is a FIFO (named pipe), {expected}", fifo_gguf.display())
    );
    let e = super::load(&fifo).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{} is a FIFO", fifo.display())), "{e}");
    for dev in ["/dev/zero", "/dev/null", "/dev/urandom"] {
        assert_eq!(
            load_err(Path::new(dev)),
            format!("{dev} is a character device, {expected}")
        );
    }
    let looped = loop_at(base.path(), "looped");
    assert_eq!(load_err(&looped), format!("{} {LOOP}", looped.display()));
    // What is really absent is still reported as absent.
    let missing = base.path().join("missing");
    assert!(load_err(&missing).starts_with(&format!("{} does not exist", missing.display())));
}

#[test]
fn config_json_that_is_a_fifo_directory_or_loop() {
    let m = qwen2();
    let p = fifo_at(m.path(), "config.json");
    assert_eq!(load_err(m.path()), format!("{} {FIFO}", p.display()));
    // Given directly as the model path, it is not a model file at all.
    assert!(load_err(&p).contains("is a FIFO (named pipe), not a regular file or folder"));
    let p = dir_at(m.path(), "config.json");
    assert_eq!(load_err(m.path()), format!("{} {DIR}", p.display()));
    fs::remove_dir(&p).unwrap();
    let p = loop_at(m.path(), "config.json");
    assert_eq!(load_err(m.path()), format!("{} {LOOP}", p.display()));
}

/// The optional files are skipped when absent, but one that is there and is not a regular file
/// is an error, read by neither the config reader nor the tokenizer.
#[test]
fn tokenizer_and_generation_files_that_are_fifos_or_directories() {
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ] {
        let m = qwen2();
        let p = fifo_at(m.path(), name);
        assert_eq!(load_err(m.path()), format!("{} {FIFO}", p.display()), "{name}");
        let m = qwen2();
        let p = dir_at(m.path(), name);
        assert_eq!(load_err(m.path()), format!("{} {DIR}", p.display()), "{name}");
    }
    // The config reader alone (no tokenizer) refuses a FIFO generation_config.json too.
    let m = qwen2();
    let p = fifo_at(m.path(), "generation_config.json");
    let dir = m.path().to_path_buf();
    let (r, _) = within(Duration::from_secs(10), "model::load", move || {
        super::load(&dir).map(|_| ()).map_err(|e| e.to_string())
    });
    assert_eq!(r.unwrap_err(), format!("{} {FIFO}", p.display()));
}

/// Writes a sharded checkpoint of the fixture: the index and two shards, tensors alternating.
fn sharded(m: &TempDir) -> [PathBuf; 2] {
    let single = m.path().join("model.safetensors");
    let bytes = fs::read(&single).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    let mut weight_map = serde_json::Map::new();
    let mut parts: [Vec<(String, safetensors::tensor::TensorView)>; 2] = [Vec::new(), Vec::new()];
    for (i, (name, view)) in st.tensors().into_iter().enumerate() {
        weight_map.insert(name.clone(), json!(names[i % 2]));
        parts[i % 2].push((name, view));
    }
    for (file, part) in names.iter().zip(parts) {
        safetensors::serialize_to_file(part, None, &m.path().join(file)).unwrap();
    }
    fs::remove_file(&single).unwrap();
    let index = json!({"metadata": {}, "weight_map": weight_map});
    fs::write(m.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    names.map(|n| m.path().join(n))
}

#[test]
fn weight_files_and_shards_that_are_fifos_directories_or_loops() {
    let m = qwen2();
    let p = fifo_at(m.path(), "model.safetensors");
    assert_eq!(load_err(m.path()), format!("{} {FIFO}", p.display()));
    let p = loop_at(m.path(), "model.safetensors");
    assert_eq!(load_err(m.path()), format!("{} {LOOP}", p.display()));

    let m = qwen2();
    let [_, second] = sharded(&m);
    assert!(super::load(m.path()).is_ok(), "the sharded copy loads");
    let index = m.path().join("model.safetensors.index.json");
    let shard = second.file_name().unwrap().to_str().unwrap();
    let says = |what: &str| {
        format!(
            "{}: names shard {shard}, but {} {what}",
            index.display(),
            second.display()
        )
    };
    fifo_at(m.path(), shard);
    assert_eq!(load_err(m.path()), says(FIFO));
    loop_at(m.path(), shard);
    assert_eq!(load_err(m.path()), says(LOOP));
    dir_at(m.path(), shard);
    assert_eq!(load_err(m.path()), says(DIR));
    fs::remove_dir(&second).unwrap();
    assert_eq!(load_err(m.path()), says("does not exist"));

    let p = fifo_at(m.path(), "model.safetensors.index.json");
    assert_eq!(load_err(m.path()), format!("{} {FIFO}", p.display()));
}

/// Rewrites the header of the safetensors file `path` with `edit`, keeping the data as it is
/// (offsets are relative to the data section, which only moves).
fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(header.as_object_mut().unwrap());
    let mut text = header.to_string();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text.as_bytes());
    out.extend(&bytes[8 + n..]);
    fs::write(path, out).unwrap();
}

fn offsets(header: &serde_json::Map<String, Value>, name: &str) -> Value {
    header[name]["data_offsets"].clone()
}

#[test]
fn overlapping_data_offsets_are_refused_naming_both_tensors() {
    let k = "model.layers.0.self_attn.k_proj.weight";
    let v = "model.layers.0.self_attn.v_proj.weight";
    // k reads v's bytes (same shape and type): before this check the model loaded and ran.
    let m = qwen2();
    let st = m.path().join("model.safetensors");
    let mut at = Value::Null;
    edit_header(&st, |h| {
        at = offsets(h, v);
        h.get_mut(k).unwrap()["data_offsets"] = at.clone();
    });
    let (s, e) = (at[0].as_u64().unwrap(), at[1].as_u64().unwrap());
    assert_eq!(
        load_err(m.path()),
        format!(
            "{}: tensors {k} (data_offsets [{s}, {e}]) and {v} (data_offsets [{s}, {e}]) overlap",
            st.display()
        )
    );

    // A tensor of another type, unused by the model, inside the embedding table.
    let m = qwen2();
    let st = m.path().join("model.safetensors");
    edit_header(&st, |h| {
        h.insert(
            "extra.f32".into(),
            json!({"dtype": "F32", "shape": [16], "data_offsets": [1000, 1064]}),
        );
    });
    let e = load_err(m.path());
    assert!(
        e.ends_with("tensors model.embed_tokens.weight (data_offsets [0, 128384]) and extra.f32 (data_offsets [1000, 1064]) overlap"),
        "{e}"
    );

    // Partial overlap by one element in a file of two tensors; adjacent and empty ones pass.
    let m = qwen2();
    let st = m.path().join("model.safetensors");
    let partial = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[14,22]}}"#;
    fs::write(&st, raw(partial, &[0; 24])).unwrap();
    assert_eq!(
        load_err(m.path()),
        format!(
            "{}: tensors a (data_offsets [0, 16]) and b (data_offsets [14, 22]) overlap",
            st.display()
        )
    );
    let fine = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[16,24]},"z":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}}"#;
    fs::write(&st, raw(fine, &[0; 24])).unwrap();
    let e = load_err(m.path());
    assert!(
        e.contains("not found"),
        "no overlap, so the model's first tensor is missing: {e}"
    );
}

/// Raw safetensors bytes: length prefix, header text as given, data.
fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}
