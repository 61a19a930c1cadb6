//! End-to-end tests of GGUF repositories on the hub and of the models on disk: the built `kiln`
//! binary with `HF_ENDPOINT` pointed at a fake hub on 127.0.0.1 (`kiln_testkit::fake_hub`)
//! serving the GGUF fixtures of `tests/fixtures/gguf`: `kiln run org/repo:QUANT`, split files,
//! `kiln pull`, `kiln list`, `kiln rm`, online and with `HF_HUB_OFFLINE=1`.

use kiln_testkit::fake_hub::{FakeFile, FakeHub, FakeRepo};
use kiln_testkit::gguf_split::{part_names, split_gguf};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

/// One compile cache for the whole test binary, so each fixture is compiled once.
fn shared_cache() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp cache")).path()
}

/// A fake hub with `kiln-test/tiny-GGUF` (Q8_0 and Q4_0 quants of the llama fixture, a
/// projector, a README) and `kiln-test/split-GGUF` (the Q8_0 split in three parts).
fn gguf_hub() -> FakeHub {
    let hub = FakeHub::start();
    let q8 = std::fs::read(fixture("llama-q8_0.gguf")).unwrap();
    let files = vec![
        FakeFile::new("README.md", "# tiny", false),
        FakeFile::new("tiny-llama-Q8_0.gguf", q8.clone(), true),
        FakeFile::new(
            "tiny-llama-Q4_0.gguf",
            std::fs::read(fixture("llama-q4_0.gguf")).unwrap(),
            true,
        ),
        FakeFile::new("mmproj-tiny-llama-F16.gguf", vec![7u8; 300], true),
    ];
    hub.add_repo(
        "kiln-test/tiny-GGUF",
        FakeRepo::default().commit(&["main"], COMMIT, files),
    );
    let parts = split_gguf(&q8, 8, false);
    assert!(parts.len() >= 3);
    let split: Vec<FakeFile> = part_names("tiny-llama-Q8_0", parts.len())
        .iter()
        .zip(parts)
        .map(|(n, data)| FakeFile::new(n, data, true))
        .collect();
    hub.add_repo(
        "kiln-test/split-GGUF",
        FakeRepo::default().commit(&["main"], COMMIT, split),
    );
    hub
}

/// The places a run of `kiln` uses, all temporary: the Hugging Face home, Kiln's models
/// folder, and the compile cache (shared by default).
struct Env {
    hf: tempfile::TempDir,
    models: tempfile::TempDir,
    cache: PathBuf,
}

impl Env {
    fn new() -> Env {
        Env {
            hf: tempfile::tempdir().unwrap(),
            models: tempfile::tempdir().unwrap(),
            cache: shared_cache().to_path_buf(),
        }
    }

    fn snapshot(&self, repo: &str) -> PathBuf {
        self.hf
            .path()
            .join("hub")
            .join(format!("models--{}", repo.replace('/', "--")))
            .join("snapshots")
            .join(COMMIT)
    }

    /// `kiln ARGS` against `hub`, with extra environment `env`.
    fn kiln(&self, hub: &FakeHub, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
        cmd.args(args)
            .env("KILN_CACHE_DIR", &self.cache)
            .env("KILN_MODELS_DIR", self.models.path())
            .env("HF_ENDPOINT", &hub.url)
            .env("HF_HOME", self.hf.path())
            .stdin(Stdio::null());
        for var in [
            "HF_TOKEN",
            "HUGGING_FACE_HUB_TOKEN",
            "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "HF_HUB_CACHE",
            "HUGGINGFACE_HUB_CACHE",
            "HF_HUB_DISABLE_PROGRESS_BARS",
            "KILN_PROFILE",
        ] {
            cmd.env_remove(var);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    }
}

const OFFLINE: [(&str, &str); 1] = [("HF_HUB_OFFLINE", "1")];

fn run_args(model: &str) -> Vec<&str> {
    vec![
        "run",
        model,
        "--prompt",
        "Hello there",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--json",
        "--threads",
        "2",
    ]
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "kiln failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn json_of(o: &Output) -> Value {
    serde_json::from_str(&stdout(o)).unwrap()
}

/// The error contract: non-zero exit, one `error:` line naming every needle, no panic.
fn expect_error(o: &Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        !o.status.success(),
        "expected a failure; stdout: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "one error line: {err}");
    for n in needles {
        assert!(lines[0].contains(n), "{n:?} not in {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// `kiln run` of the fixture file itself: what the hub runs must equal.
fn reference() -> &'static Value {
    static REF: OnceLock<Value> = OnceLock::new();
    REF.get_or_init(|| {
        let env = Env::new();
        let hub = FakeHub::start();
        json_of(&env.kiln(&hub, &run_args(fixture("llama-q8_0.gguf").to_str().unwrap()), &[]))
    })
}

#[test]
fn run_a_gguf_quant_from_the_hub() {
    let hub = gguf_hub();
    let env = Env::new();
    let out = json_of(&env.kiln(&hub, &run_args("kiln-test/tiny-GGUF:q8_0"), &[]));
    assert_eq!(out["token_ids"], reference()["token_ids"]);
    let file = env.snapshot("kiln-test/tiny-GGUF").join("tiny-llama-Q8_0.gguf");
    assert_eq!(out["model_dir"], file.display().to_string());
    // Only the file asked for was downloaded.
    let cdn: Vec<_> = hub
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/cdn/"))
        .collect();
    assert_eq!(cdn.len(), 1);
    assert_eq!(
        std::fs::read_dir(env.snapshot("kiln-test/tiny-GGUF")).unwrap().count(),
        1
    );

    // Cached: offline, without a single request.
    let n = hub.request_count();
    let out = json_of(&env.kiln(&hub, &run_args("kiln-test/tiny-GGUF:Q8_0"), &OFFLINE));
    assert_eq!(out["token_ids"], reference()["token_ids"]);
    assert_eq!(hub.request_count(), n);
    // The same file named as org/repo/FILE.gguf.
    let out = json_of(&env.kiln(&hub, &run_args("kiln-test/tiny-GGUF/tiny-llama-Q8_0.gguf"), &OFFLINE));
    assert_eq!(out["token_ids"], reference()["token_ids"]);
    assert_eq!(out["model_dir"], file.display().to_string());
    assert_eq!(hub.request_count(), n);

    // A split model runs as the file it was split from (same spec, same library).
    let out = json_of(&env.kiln(&hub, &run_args("kiln-test/split-GGUF:Q8_0"), &[]));
    assert_eq!(out["token_ids"], reference()["token_ids"]);
    assert_eq!(out["cache_hit"], true);
    let first = env
        .snapshot("kiln-test/split-GGUF")
        .join("tiny-llama-Q8_0-00001-of-00003.gguf");
    assert_eq!(out["model_dir"], first.display().to_string());
}

#[test]
fn gguf_hub_errors_are_one_line() {
    let hub = gguf_hub();
    let env = Env::new();
    let e = expect_error(
        &env.kiln(&hub, &run_args("kiln-test/tiny-GGUF:Q5_K_M"), &[]),
        &[
            "kiln-test/tiny-GGUF",
            "Q5_K_M",
            "tiny-llama-Q4_0.gguf",
            "tiny-llama-Q8_0.gguf",
        ],
    );
    assert!(!e.contains("mmproj"), "{e}");
    // Q4 is not Q4_0.
    expect_error(
        &env.kiln(&hub, &run_args("kiln-test/tiny-GGUF:Q4"), &[]),
        &["quant Q4;"],
    );
    expect_error(
        &env.kiln(&hub, &run_args("kiln-test/tiny-GGUF:Q4-0"), &[]),
        &["not a Hugging Face model id"],
    );
    // Nothing cached, offline.
    expect_error(
        &env.kiln(&hub, &run_args("kiln-test/tiny-GGUF:Q4_0"), &OFFLINE),
        &["kiln-test/tiny-GGUF:Q4_0", "HF_HUB_OFFLINE"],
    );
    assert!(
        !env.snapshot("kiln-test/tiny-GGUF")
            .join("tiny-llama-Q4_0.gguf")
            .exists()
    );
}

/// `kiln pull` downloads, prints the path, says which file a plain id took, and offline
/// reports the cached copy; `kiln list` shows each model with size and compiled state;
/// `kiln rm` removes one, and refuses what it does not have.
#[test]
fn pull_list_and_rm() {
    let hub = gguf_hub();
    let mut env = Env::new();
    let own_cache = tempfile::tempdir().unwrap();
    env.cache = own_cache.path().to_path_buf();
    let snap = env.snapshot("kiln-test/tiny-GGUF");

    // A plain id of a GGUF-only repository: the default quant (no Q4_K_M here: Q8_0), named.
    let o = env.kiln(&hub, &["pull", "kiln-test/tiny-GGUF"], &[]);
    assert_eq!(
        stdout(&o).trim(),
        snap.join("tiny-llama-Q8_0.gguf").display().to_string()
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("note:") && err.contains("tiny-llama-Q8_0.gguf"), "{err}");
    let o = env.kiln(
        &hub,
        &["pull", "kiln-test/tiny-GGUF/tiny-llama-Q4_0.gguf", "--quiet"],
        &[],
    );
    assert_eq!(
        stdout(&o).trim(),
        snap.join("tiny-llama-Q4_0.gguf").display().to_string()
    );
    assert!(o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
    // Pulled again: the hub is asked for the commit, nothing is downloaded; offline, nothing.
    let n = hub.request_count();
    stdout(&env.kiln(&hub, &["pull", "kiln-test/tiny-GGUF:Q4_0"], &[]));
    assert!(hub.requests()[n..].iter().all(|r| r.path.starts_with("/api/")));
    let n = hub.request_count();
    let o = env.kiln(&hub, &["pull", "kiln-test/tiny-GGUF:Q4_0"], &OFFLINE);
    assert_eq!(
        stdout(&o).trim(),
        snap.join("tiny-llama-Q4_0.gguf").display().to_string()
    );
    expect_error(
        &env.kiln(&hub, &["pull", "kiln-test/split-GGUF:Q8_0"], &OFFLINE),
        &["HF_HUB_OFFLINE"],
    );
    assert_eq!(hub.request_count(), n);
    expect_error(&env.kiln(&hub, &["pull", "."], &[]), &["local path"]);

    // A cut download is resumed (in-process, with Range); a corrupt one fails its sha256 and
    // leaves no file and no ref.
    let parts = split_gguf(&std::fs::read(fixture("llama-q8_0.gguf")).unwrap(), 8, false);
    let etag = |data: &[u8]| FakeFile::new("x", data.to_vec(), true).etag();
    hub.cut(&etag(&parts[0]), 4000, 1);
    hub.corrupt(&etag(&parts[1]));
    let o = env.kiln(&hub, &["pull", "kiln-test/split-GGUF:Q8_0"], &[]);
    expect_error(&o, &["corrupt", "sha256"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("resuming"));
    assert!(hub.requests().iter().any(|r| r.header("range") == Some("bytes=4000-")));
    let split_repo = env.hf.path().join("hub/models--kiln-test--split-GGUF");
    assert!(!split_repo.join("refs/main").exists());
    assert!(split_repo.join("blobs").join(etag(&parts[0])).is_file());
    assert!(!split_repo.join("blobs").join(etag(&parts[1])).exists());
    assert!(
        !split_repo
            .join("blobs")
            .join(format!("{}.incomplete", etag(&parts[1])))
            .exists()
    );

    // A safetensors repository: the snapshot folder.
    let mut st = Vec::new();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        let data = std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/qwen2")
                .join(f),
        )
        .unwrap();
        st.push(FakeFile::new(f, data, f.ends_with(".safetensors")));
    }
    hub.add_repo(
        "kiln-test/qwen2-tiny",
        FakeRepo::default().commit(&["main", "v1"], COMMIT, st),
    );
    let o = env.kiln(&hub, &["pull", "kiln-test/qwen2-tiny@v1"], &[]);
    assert_eq!(
        stdout(&o).trim(),
        env.snapshot("kiln-test/qwen2-tiny").display().to_string()
    );

    // A model in Kiln's models folder too.
    let local = env.models.path().join("tiny.Q5_0.gguf");
    std::fs::copy(fixture("llama-q5_0.gguf"), &local).unwrap();
    // Compile the Q8_0 only.
    json_of(&env.kiln(&hub, &run_args("kiln-test/tiny-GGUF:Q8_0"), &OFFLINE));

    let list = |env: &Env, extra: &[(&str, &str)]| -> Vec<Value> {
        let v = json_of(&env.kiln(&hub, &["list", "--json"], extra));
        v.as_array().unwrap().clone()
    };
    let n = hub.request_count();
    let rows = list(&env, &OFFLINE);
    assert_eq!(hub.request_count(), n, "list never asks the hub");
    let ids: Vec<&str> = rows.iter().map(|r| r["id"].as_str().unwrap()).collect();
    let local_id = local.display().to_string();
    let st_id = "kiln-test/qwen2-tiny@v1";
    // The split model's download failed before its ref was written: listed by commit.
    let split_id = format!("kiln-test/split-GGUF:Q8_0@{COMMIT}");
    let expected = [
        st_id,
        &split_id,
        "kiln-test/tiny-GGUF:Q4_0",
        "kiln-test/tiny-GGUF:Q8_0",
        &local_id,
    ];
    assert_eq!(ids, expected);
    assert_eq!(rows[0]["format"], "safetensors");
    assert_eq!(rows[0]["compiled"], false);
    assert_eq!(rows[0]["revision"], "v1");
    assert_eq!(rows[1]["complete"], false);
    assert_eq!(rows[1]["compiled"], Value::Null);
    assert_eq!(rows[1]["problem"], "incomplete download");
    let all = rows.clone();
    let rows = &rows[2..];
    let size = |f: &str| std::fs::metadata(fixture(f)).unwrap().len();
    assert_eq!(rows[0]["bytes"], size("llama-q4_0.gguf"));
    assert_eq!(rows[1]["bytes"], size("llama-q8_0.gguf"));
    assert_eq!(rows[2]["bytes"], size("llama-q5_0.gguf"));
    let compiled: Vec<&Value> = rows.iter().map(|r| &r["compiled"]).collect();
    assert_eq!(compiled, [&Value::Bool(false), &Value::Bool(true), &Value::Bool(false)]);
    assert_eq!(rows[1]["quant"], "Q8_0");
    assert_eq!(rows[2]["quant"], "Q5_0");
    assert_eq!(rows[1]["revision"], "main");
    assert_eq!(rows[2]["source"], "models-folder");
    assert_eq!(all, list(&env, &[]));
    let table = stdout(&env.kiln(&hub, &["list"], &OFFLINE));
    let q8_line = table
        .lines()
        .find(|l| l.starts_with("kiln-test/tiny-GGUF:Q8_0 "))
        .unwrap();
    assert!(q8_line.contains("main") && q8_line.ends_with("yes"), "{table}");
    assert!(table.lines().next().unwrap().starts_with("ID"), "{table}");
    assert!(table.lines().last().unwrap().starts_with("5 models"), "{table}");

    // rm: offline works the same; what is not there is one clear error line.
    let o = env.kiln(&hub, &["rm", "kiln-test/tiny-GGUF:Q4_0"], &OFFLINE);
    assert!(
        stdout(&o).starts_with("removed kiln-test/tiny-GGUF:Q4_0: 1 files, 1 blobs"),
        "{}",
        stdout(&o)
    );
    assert!(!snap.join("tiny-llama-Q4_0.gguf").exists());
    expect_error(
        &env.kiln(&hub, &["rm", "kiln-test/tiny-GGUF:Q4_0"], &[]),
        &[
            "kiln-test/tiny-GGUF:Q4_0",
            "is not in the Hugging Face cache",
            "kiln list",
        ],
    );
    expect_error(
        &env.kiln(&hub, &["rm", "kiln-test/never"], &[]),
        &["kiln-test/never", "not in"],
    );
    expect_error(&env.kiln(&hub, &["rm", "not an id"], &[]), &["neither", "kiln list"]);
    let outside = tempfile::NamedTempFile::new().unwrap();
    expect_error(
        &env.kiln(&hub, &["rm", outside.path().to_str().unwrap()], &[]),
        &["in neither"],
    );
    assert!(outside.path().exists());
    let o = env.kiln(&hub, &["rm", "tiny.Q5_0.gguf"], &[]);
    assert!(stdout(&o).starts_with(&format!("removed {}", local.display())));
    assert!(!local.exists());
    let o = env.kiln(&hub, &["rm", "kiln-test/tiny-GGUF"], &[]);
    assert!(
        stdout(&o).contains("models--kiln-test--tiny-GGUF is gone"),
        "{}",
        stdout(&o)
    );
    assert!(!env.hf.path().join("hub/models--kiln-test--tiny-GGUF").exists());
    stdout(&env.kiln(&hub, &["rm", st_id], &[]));
    stdout(&env.kiln(&hub, &["rm", &split_id], &[]));
    let o = env.kiln(&hub, &["list"], &[]);
    assert!(
        stdout(&o).starts_with("no models in the Hugging Face cache"),
        "{}",
        stdout(&o)
    );
    assert_eq!(hub.request_count(), n, "rm never asks the hub");
}
