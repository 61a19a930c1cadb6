//! The row-grouped copy of a model's weights kept in the cache (`<cache>/grouped/`), end to end:
//! the first run keeps it, later runs map it without writing, a damaged or stale copy is rebuilt
//! and never read, `kiln cache list` counts it, `kiln cache clean --stale` removes the copy of
//! a model that is gone and keeps the others, `kiln cache clean --all` removes it, and every
//! run prints what the same model prints read row-major (`--ram-budget` never groups).

#[path = "common/cli.rs"]
mod cli;
use cli::kiln;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// The llama fixture's MLP width, and the one this test gives it: whole groups of 16 rows, so
/// its gate and up projections are grouped.
const FIXTURE_MLP: usize = 136;
const GROUPED_MLP: usize = 144;

/// Greedy text for a fixed prompt; stderr must hold no warning.
fn generate(cache: &Path, model: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        model.to_str().unwrap(),
        "-p",
        "Once upon a time",
        "--max-tokens",
        "12",
    ];
    args.extend_from_slice(&["--temperature", "0"]);
    args.extend_from_slice(extra);
    let o = kiln(cache, &args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("warning"), "{err}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The llama fixture with its MLP widened to [`GROUPED_MLP`] (new values from `seed`, the rest
/// as the fixture has them), written as a model folder in `dir`.
fn widened_llama(dir: &Path, seed: u32) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama");
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    let config = std::fs::read_to_string(fixture.join("config.json")).unwrap();
    let config = config.replace(
        &format!("\"intermediate_size\": {FIXTURE_MLP}"),
        &format!("\"intermediate_size\": {GROUPED_MLP}"),
    );
    std::fs::write(dir.join("config.json"), config).unwrap();
    let bytes = std::fs::read(fixture.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let (mut out_header, mut data) = (Map::new(), Vec::new());
    let mut state = seed.wrapping_mul(2654435761).max(1);
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let mut shape: Vec<usize> = serde_json::from_value(info["shape"].clone()).unwrap();
        let offsets: Vec<usize> = serde_json::from_value(info["data_offsets"].clone()).unwrap();
        let start = data.len();
        if shape.contains(&FIXTURE_MLP) {
            assert_eq!(info["dtype"], "BF16", "{name}");
            shape
                .iter_mut()
                .filter(|d| **d == FIXTURE_MLP)
                .for_each(|d| *d = GROUPED_MLP);
            for _ in 0..shape.iter().product::<usize>() {
                // xorshift values in about ±0.2, as bf16.
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let v = (state as f32 / u32::MAX as f32 - 0.5) * 0.4;
                data.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
            }
        } else {
            data.extend_from_slice(&bytes[8 + n + offsets[0]..8 + n + offsets[1]]);
        }
        let mut entry = info.as_object().unwrap().clone();
        entry.insert("shape".into(), serde_json::json!(shape));
        entry.insert("data_offsets".into(), serde_json::json!([start, data.len()]));
        out_header.insert(name.clone(), Value::Object(entry));
    }
    let mut head = serde_json::to_vec(&out_header).unwrap();
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut file = (head.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&head);
    file.extend_from_slice(&data);
    // A new file, as a converter writes one: a new inode and modification time.
    let path = dir.join("model.safetensors");
    let _ = std::fs::remove_file(&path);
    std::fs::write(path, file).unwrap();
}

fn copies(cache: &Path) -> Vec<PathBuf> {
    match std::fs::read_dir(cache.join("grouped")) {
        Ok(d) => d.map(|e| e.unwrap().path()).collect(),
        Err(_) => Vec::new(),
    }
}

#[test]
fn the_grouped_copy_is_kept_mapped_rebuilt_and_cleaned() {
    let (model, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    widened_llama(model.path(), 1);
    let row_major = generate(cache.path(), model.path(), &["--ram-budget", "1G"]);
    assert!(copies(cache.path()).is_empty(), "--ram-budget groups nothing");

    let first = generate(cache.path(), model.path(), &[]);
    assert_eq!(first, row_major, "grouped weights give the row-major output");
    let kept = copies(cache.path());
    assert_eq!(kept.len(), 1, "{kept:?}");
    let meta = |p: &Path| {
        let m = std::fs::metadata(p).unwrap();
        (m.len(), m.modified().unwrap(), std::os::unix::fs::MetadataExt::ino(&m))
    };
    let written = meta(&kept[0]);
    assert_eq!(generate(cache.path(), model.path(), &[]), first);
    assert_eq!(meta(&kept[0]), written, "a later run maps the copy, writes nothing");

    // Truncated: rebuilt whole, the output unchanged.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&kept[0])
        .unwrap()
        .set_len(written.0 / 2)
        .unwrap();
    assert_eq!(generate(cache.path(), model.path(), &[]), first);
    assert_eq!(std::fs::metadata(&kept[0]).unwrap().len(), written.0);

    // The model file replaced with other MLP weights: the stale copy is replaced, never read.
    widened_llama(model.path(), 2);
    let fresh_cache = tempfile::tempdir().unwrap();
    let changed = generate(fresh_cache.path(), model.path(), &[]);
    assert_ne!(changed, first, "the new weights change the output");
    assert_eq!(generate(cache.path(), model.path(), &[]), changed);
    assert_eq!(copies(cache.path()), kept, "replaced under the same name");

    let o = kiln(cache.path(), &["cache", "list"]);
    let listed = String::from_utf8_lossy(&o.stdout);
    assert!(listed.contains("in 1 row-grouped weight copies"), "{listed}");
    assert!(!listed.contains("stale"), "{listed}");

    // A second model, then deleted: its copy is listed stale and `--stale` removes it alone.
    let other = tempfile::tempdir().unwrap();
    widened_llama(other.path(), 3);
    generate(cache.path(), other.path(), &[]);
    assert_eq!(copies(cache.path()).len(), 2);
    drop(other);
    let o = kiln(cache.path(), &["cache", "list"]);
    let listed = String::from_utf8_lossy(&o.stdout);
    assert!(listed.contains("in 2 row-grouped weight copies"), "{listed}");
    assert!(listed.contains("1 of them"), "{listed}");
    // The JSON list holds the libraries and both copies, the deleted model's marked stale.
    let o = kiln(cache.path(), &["cache", "list", "--json"]);
    let items: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    let of_kind = |k: &str| items.iter().filter(|i| i["kind"] == k).collect::<Vec<_>>();
    assert!(!of_kind("library").is_empty(), "{items:?}");
    let listed_copies = of_kind("grouped_copy");
    assert_eq!(listed_copies.len(), 2, "{items:?}");
    assert!(listed_copies.iter().all(|c| c["bytes"].as_u64() > Some(0)), "{items:?}");
    let stale: Vec<_> = listed_copies.iter().filter(|c| c["stale"] == true).collect();
    assert_eq!(stale.len(), 1, "{items:?}");
    assert_ne!(
        stale[0]["path"],
        kept[0].display().to_string(),
        "the live copy is not stale"
    );
    let o = kiln(cache.path(), &["cache", "clean", "--stale", "--all"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("one of a KEY, --stale or --all"));
    let o = kiln(cache.path(), &["cache", "clean", "--stale"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("removed 1 stale"));
    assert_eq!(copies(cache.path()), kept, "the live model's copy kept");
    assert_eq!(generate(cache.path(), model.path(), &[]), changed);

    let o = kiln(cache.path(), &["cache", "clean", "--all"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(copies(cache.path()).is_empty());
}
