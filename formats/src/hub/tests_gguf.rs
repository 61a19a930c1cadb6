//! GGUF repositories and the cache's model list/removal, against the fake hub on 127.0.0.1
//! (see `kiln_testkit::fake_hub`); nothing here uses the network or `~/.cache/huggingface`.

use super::*;
use kiln_testkit::fake_hub::{FakeFile, FakeHub, FakeRepo, sha256_hex};
use kiln_testkit::gguf_split::{part_names, split_gguf};
use std::fs;

const SHA_A: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f901234567";
const SHA_B: &str = "b0b1b2b3b4b5b6b7b8b9babbbcbdbebf00112233";

fn opts(hub: &FakeHub, cache: &Path) -> HubOptions {
    HubOptions {
        endpoint: Some(hub.url.clone()),
        token: None,
        cache_dir: Some(cache.to_path_buf()),
        offline: false,
        quiet: true,
    }
}

fn offline(o: &HubOptions) -> HubOptions {
    HubOptions {
        offline: true,
        ..o.clone()
    }
}

fn fixture(name: &str) -> Vec<u8> {
    fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/gguf")
            .join(name),
    )
    .unwrap()
}

/// Distinct bytes standing in for a GGUF file the test never loads.
fn blob(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(13) ^ seed).collect()
}

/// A GGUF-only repository: three quants of one model, a split Q6_K model, a projector and a
/// README.
fn gguf_repo() -> Vec<FakeFile> {
    let mut files = vec![
        FakeFile::new("README.md", "# tiny", false),
        FakeFile::new("tiny-Q4_K_M.gguf", fixture("llama-q4_0.gguf"), true),
        FakeFile::new("tiny-Q4_K_S.gguf", blob(3000, 1), true),
        FakeFile::new("tiny-Q8_0.gguf", fixture("llama-q8_0.gguf"), true),
        FakeFile::new("mmproj-tiny-F16.gguf", blob(2000, 2), true),
    ];
    let parts = split_gguf(&fixture("llama-q8_0.gguf"), 8, false);
    for (name, data) in part_names("split/tiny-Q6_K", parts.len()).iter().zip(parts) {
        files.push(FakeFile::new(name, data, true));
    }
    files
}

fn setup(repo: &str, files: Vec<FakeFile>) -> (FakeHub, tempfile::TempDir, PathBuf) {
    let hub = FakeHub::start();
    hub.add_repo(repo, FakeRepo::default().commit(&["main"], SHA_A, files));
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    (hub, tmp, cache)
}

fn since(hub: &FakeHub, n: usize) -> Vec<String> {
    hub.requests()[n..]
        .iter()
        .map(|r| format!("{} {}", r.method, r.path))
        .collect()
}

#[test]
fn hub_ids_name_a_quant_or_a_file() {
    let s = HubSpec::parse("acme/tiny:q8_0").unwrap();
    assert_eq!((s.repo_id.as_str(), s.revision.as_str()), ("acme/tiny", "main"));
    assert_eq!(s.select, Select::Quant("q8_0".into()));
    assert_eq!(s.to_string(), "acme/tiny:q8_0");
    for (id, rev) in [("acme/tiny:Q8_0@v1", "v1"), ("acme/tiny@v1:Q8_0", "v1")] {
        let s = HubSpec::parse(id).unwrap();
        assert_eq!((s.revision.as_str(), &s.select), (rev, &Select::Quant("Q8_0".into())));
        assert_eq!(s.to_string(), "acme/tiny:Q8_0@v1");
    }
    let s = HubSpec::parse("acme/tiny/sub/x-Q4_0.GGUF@refs/pr/2").unwrap();
    assert_eq!(s.select, Select::File("sub/x-Q4_0.GGUF".into()));
    assert_eq!(s.revision, "refs/pr/2");
    assert_eq!(s.to_string(), "acme/tiny/sub/x-Q4_0.GGUF@refs/pr/2");
    assert_eq!(s.repo_only().to_string(), "acme/tiny@refs/pr/2");
    for bad in [
        "acme/tiny:",
        "acme/tiny:Q4-K",
        "acme/tiny:Q4@v1:Q8",
        "acme/tiny/x.bin",
        "acme/tiny/../x.gguf",
        "acme/tiny//x.gguf",
        "acme/tiny/x.gguf:Q4_0",
        "acme/tiny/mmproj.gguf",
    ] {
        let e = HubSpec::parse(bad).unwrap_err().to_string();
        assert!(e.starts_with(&format!("'{bad}' is not a Hugging Face model id")), "{e}");
        assert!(!is_hub_id(bad), "{bad}");
    }
    assert!(is_hub_id("acme/tiny:Q4_K_M") && is_hub_id("acme/tiny/a.gguf"));
}

/// `org/repo:QUANT` downloads that one file (as LFS, verified), returns its path, and is
/// then answered from the cache, offline too.
#[test]
fn a_quant_downloads_only_its_file() {
    let (hub, _tmp, cache) = setup("acme/tiny-GGUF", gguf_repo());
    let o = opts(&hub, &cache);
    let path = resolve("acme/tiny-GGUF:q8_0", &o).unwrap();
    let snap = cache.join("models--acme--tiny-GGUF/snapshots").join(SHA_A);
    assert_eq!(path, snap.join("tiny-Q8_0.gguf"));
    assert_eq!(fs::read(&path).unwrap(), fixture("llama-q8_0.gguf"));
    assert!(fs::symlink_metadata(&path).unwrap().file_type().is_symlink());
    assert_eq!(gguf::snapshot_files(&snap), ["tiny-Q8_0.gguf"]);
    let gets: Vec<String> = since(&hub, 0).into_iter().filter(|r| r.starts_with("GET")).collect();
    assert_eq!(gets.len(), 2, "{gets:?}");
    assert!(gets[1].starts_with(&format!("GET /cdn/{}", sha256_hex(&fixture("llama-q8_0.gguf")))));

    // Cached: no request, online or offline; pull asks for the commit and downloads nothing.
    let n = hub.request_count();
    assert_eq!(resolve("acme/tiny-GGUF:Q8_0", &o).unwrap(), path);
    assert_eq!(resolve("acme/tiny-GGUF:Q8_0", &offline(&o)).unwrap(), path);
    assert_eq!(fetch("acme/tiny-GGUF:Q8_0", &offline(&o)).unwrap(), path);
    assert_eq!(hub.request_count(), n);
    assert_eq!(fetch("acme/tiny-GGUF:Q8_0", &o).unwrap(), path);
    assert_eq!(since(&hub, n), ["GET /api/models/acme/tiny-GGUF/revision/main"]);

    // Another quant is not in the cache: offline it is an error, online a download.
    let e = resolve("acme/tiny-GGUF:Q4_K_M", &offline(&o)).unwrap_err();
    assert!(matches!(e, HubError::Offline { .. }), "{e}");
    assert!(e.to_string().contains("acme/tiny-GGUF:Q4_K_M"), "{e}");
    let q4 = resolve("acme/tiny-GGUF:Q4_K_M", &o).unwrap();
    assert_eq!(q4, snap.join("tiny-Q4_K_M.gguf"));
    // A file by name, here already cached.
    let n = hub.request_count();
    assert_eq!(resolve("acme/tiny-GGUF/tiny-Q8_0.gguf", &o).unwrap(), path);
    assert_eq!(hub.request_count(), n);
}

/// A split model comes whole (every part verified and linked) and resolves to its first
/// part, which loads as the file it was split from.
#[test]
fn a_split_quant_downloads_every_part_and_loads() {
    let (hub, _tmp, cache) = setup("acme/tiny-GGUF", gguf_repo());
    let o = opts(&hub, &cache);
    let parts: Vec<FakeFile> = gguf_repo()
        .into_iter()
        .filter(|f| f.name.starts_with("split/"))
        .collect();
    assert!(parts.len() >= 3);
    // The second part is cut once: the error keeps the partial blob, the next run resumes it.
    hub.cut(&parts[1].etag(), 5000, 1);
    let tuning = Tuning {
        retries: 0,
        backoff_ms: 0,
    };
    let e = resolve_with("acme/tiny-GGUF:Q6_K", &o, &tuning).unwrap_err();
    assert!(matches!(e, HubError::Network { .. }), "{e}");
    assert_eq!(cached("acme/tiny-GGUF:Q6_K", &o).unwrap(), None);
    let first = resolve_with("acme/tiny-GGUF:Q6_K", &o, &tuning).unwrap();
    let snap = cache.join("models--acme--tiny-GGUF/snapshots").join(SHA_A);
    assert_eq!(first, snap.join(&parts[0].name));
    for p in &parts {
        assert_eq!(fs::read(snap.join(&p.name)).unwrap(), p.data, "{}", p.name);
    }
    assert!(hub.requests().iter().any(|r| r.header("range") == Some("bytes=5000-")));
    let split = crate::gguf::load(&first).unwrap();
    assert_eq!(split.parts.len(), parts.len());
    let whole_file = cache.parent().unwrap().join("whole.gguf");
    fs::write(&whole_file, fixture("llama-q8_0.gguf")).unwrap();
    assert_eq!(split.spec, crate::gguf::load(&whole_file).unwrap().spec);

    // A part gone from the cache: offline, the id is partly cached; online it comes back.
    fs::remove_file(snap.join(&parts[2].name)).unwrap();
    let e = resolve("acme/tiny-GGUF:Q6_K", &offline(&o)).unwrap_err();
    assert!(matches!(e, HubError::OfflinePartial { .. }), "{e}");
    assert!(e.to_string().contains(&format!("{} is missing", parts[2].name)), "{e}");
    assert_eq!(resolve("acme/tiny-GGUF:Q6_K", &o).unwrap(), first);
}

#[test]
fn gguf_errors_are_one_clear_line_and_download_nothing() {
    let mut files = gguf_repo();
    files.push(FakeFile::new("other/tiny-Q8_0.gguf", blob(100, 3), true));
    // A split model with a part missing from the repository.
    files.push(FakeFile::new("broken-Q2_K-00001-of-00002.gguf", blob(100, 4), true));
    files.push(FakeFile::new("tiny-Q4_K_S.bin", blob(100, 5), true));
    let (hub, _tmp, cache) = setup("acme/tiny-GGUF", files);
    let o = opts(&hub, &cache);
    let cases = [
        (
            "acme/tiny-GGUF:Q5_K_M",
            "model acme/tiny-GGUF has no GGUF file for quant Q5_K_M; its GGUF files: ",
        ),
        (
            "acme/tiny-GGUF:Q8_0@main",
            "quant Q8_0 matches several GGUF files of model acme/tiny-GGUF: other/tiny-Q8_0.gguf, \
             tiny-Q8_0.gguf; name one as acme/tiny-GGUF/FILE",
        ),
        (
            "acme/tiny-GGUF/nope.gguf",
            "model acme/tiny-GGUF has no GGUF file nope.gguf; its GGUF files: ",
        ),
        (
            "acme/tiny-GGUF:Q2_K",
            "model acme/tiny-GGUF:Q2_K has no broken-Q2_K-00002-of-00002.gguf (a part of the split \
             model broken-Q2_K-00001-of-00002.gguf), which Kiln needs",
        ),
    ];
    for (id, start) in cases {
        let e = resolve(id, &o).unwrap_err().to_string();
        assert!(e.starts_with(start), "{id}: {e}");
        assert!(!e.contains('\n'));
    }
    // Decided from the file list alone.
    assert!(hub.requests().iter().all(|r| r.path.starts_with("/api/")));
    assert!(!cache.join("models--acme--tiny-GGUF/refs").exists());
}

/// A plain id takes safetensors when the repository has them, else llama.cpp's default GGUF.
#[test]
fn a_plain_id_of_a_gguf_repository_takes_the_default_quant() {
    let (hub, _tmp, cache) = setup("acme/tiny-GGUF", gguf_repo());
    let o = opts(&hub, &cache);
    let path = resolve("acme/tiny-GGUF", &o).unwrap();
    let snap = cache.join("models--acme--tiny-GGUF/snapshots").join(SHA_A);
    assert_eq!(path, snap.join("tiny-Q4_K_M.gguf"));
    assert_eq!(gguf::snapshot_files(&snap), ["tiny-Q4_K_M.gguf"]);
    // Only the hub knows the repository has no safetensors: one request, nothing fetched.
    let n = hub.request_count();
    assert_eq!(resolve("acme/tiny-GGUF", &o).unwrap(), path);
    assert_eq!(since(&hub, n), ["GET /api/models/acme/tiny-GGUF/revision/main"]);
    // Offline, the cached default is used without a request.
    let n = hub.request_count();
    assert_eq!(resolve("acme/tiny-GGUF", &offline(&o)).unwrap(), path);
    assert_eq!(hub.request_count(), n);

    // A repository with both: a plain id is the safetensors model, a quant the GGUF file.
    let mut both = vec![
        FakeFile::new("config.json", "{}", false),
        FakeFile::new("tokenizer.json", "{}", false),
        FakeFile::new("model.safetensors", blob(500, 6), true),
    ];
    both.extend(gguf_repo());
    hub.add_repo("acme/both", FakeRepo::default().commit(&["main"], SHA_B, both));
    let snap = resolve("acme/both", &o).unwrap();
    assert!(snap.is_dir() && snap.join("model.safetensors").is_file());
    assert!(!gguf::snapshot_files(&snap).iter().any(|f| f.ends_with(".gguf")));
    let q8 = resolve("acme/both:Q8_0", &o).unwrap();
    assert_eq!(q8, snap.join("tiny-Q8_0.gguf"));
    assert_eq!(resolve("acme/both", &offline(&o)).unwrap(), snap);
}

/// The list shows each model once with its id, size and state; removing one takes its blobs
/// unless another snapshot uses them, and the repository folder with the last snapshot.
#[test]
fn cached_models_are_listed_and_removed() {
    let (hub, _tmp, cache) = setup("acme/tiny-GGUF", gguf_repo());
    let o = opts(&hub, &cache);
    assert_eq!(store::list(&cache).unwrap(), []);
    resolve("acme/tiny-GGUF:Q8_0", &o).unwrap();
    resolve("acme/tiny-GGUF:Q6_K", &o).unwrap();
    let repo = gguf_repo();
    let size = |prefix: &str| -> u64 {
        repo.iter()
            .filter(|f| f.name.starts_with(prefix))
            .map(|f| f.data.len() as u64)
            .sum()
    };
    let rows = store::list(&cache).unwrap();
    let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["acme/tiny-GGUF:Q6_K", "acme/tiny-GGUF:Q8_0"]);
    assert_eq!(rows[0].bytes, size("split/"));
    assert_eq!(rows[1].bytes, size("tiny-Q8_0"));
    assert!(
        rows.iter()
            .all(|r| r.complete && r.format == "gguf" && r.refs == ["main"])
    );
    assert_eq!(rows[1].quant.as_deref(), Some("Q8_0"));
    assert_eq!(rows[1].path, resolve("acme/tiny-GGUF:Q8_0", &o).unwrap());

    // A second commit sharing the Q8_0 blob, pinned by a tag.
    let mut v2 = gguf_repo();
    v2[1] = FakeFile::new("tiny-Q4_K_M.gguf", blob(4000, 9), true);
    hub.add_repo(
        "acme/tiny-GGUF",
        FakeRepo::default()
            .commit(&["main"], SHA_A, gguf_repo())
            .commit(&["v2"], SHA_B, v2),
    );
    resolve("acme/tiny-GGUF:Q8_0@v2", &o).unwrap();
    let ids: Vec<String> = store::list(&cache).unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(
        ids,
        ["acme/tiny-GGUF:Q6_K", "acme/tiny-GGUF:Q8_0", "acme/tiny-GGUF:Q8_0@v2"]
    );

    // Removing the Q8_0 of main keeps its blob (v2 uses it) and the Q6_K.
    let q8_blob = cache
        .join("models--acme--tiny-GGUF/blobs")
        .join(sha256_hex(&fixture("llama-q8_0.gguf")));
    let r = store::remove(&cache, &HubSpec::parse("acme/tiny-GGUF:Q8_0").unwrap()).unwrap();
    assert_eq!((r.files, r.blobs, r.bytes, r.repo_removed), (1, 0, 0, false));
    assert!(q8_blob.is_file());
    let e = store::remove(&cache, &HubSpec::parse("acme/tiny-GGUF:Q8_0").unwrap()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "model acme/tiny-GGUF:Q8_0 is not in the Hugging Face cache ({})",
            cache.display()
        )
    );
    // The whole main snapshot: its split parts go, and the ref.
    let r = store::remove(&cache, &HubSpec::parse("acme/tiny-GGUF").unwrap()).unwrap();
    assert_eq!(
        (r.files, r.bytes, r.repo_removed),
        (
            repo.iter().filter(|f| f.name.starts_with("split/")).count(),
            size("split/"),
            false
        )
    );
    let repo_dir = cache.join("models--acme--tiny-GGUF");
    assert!(!repo_dir.join("snapshots").join(SHA_A).exists());
    assert!(!repo_dir.join("refs/main").exists());
    assert!(repo_dir.join("refs/v2").is_file());
    // The last snapshot: the repository folder and its locks go.
    let r = store::remove(&cache, &HubSpec::parse("acme/tiny-GGUF@v2").unwrap()).unwrap();
    assert_eq!((r.blobs, r.bytes, r.repo_removed), (1, size("tiny-Q8_0"), true));
    assert!(!repo_dir.exists());
    assert!(!cache.join(".locks/models--acme--tiny-GGUF").exists());
    assert_eq!(store::list(&cache).unwrap(), []);
    let e = store::remove(&cache, &HubSpec::parse("acme/tiny-GGUF").unwrap()).unwrap_err();
    assert!(matches!(e, HubError::NotCached { .. }), "{e}");
}

/// Safetensors snapshots are listed by repository, with `@rev` when `main` does not point at
/// them, and an interrupted download shows as incomplete.
#[test]
fn safetensors_snapshots_are_listed_with_their_state() {
    let files = vec![
        FakeFile::new("config.json", "{}", false),
        FakeFile::new("tokenizer.json", "{}", false),
        FakeFile::new("model.safetensors", blob(200_000, 1), true),
        FakeFile::new("README.md", "# x", false),
    ];
    let hub = FakeHub::start();
    hub.add_repo("acme/st", FakeRepo::default().commit(&["v1"], SHA_A, files.clone()));
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let o = opts(&hub, &cache);
    resolve("acme/st@v1", &o).unwrap();
    let rows = store::list(&cache).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].id, "acme/st@v1");
    assert_eq!((rows[0].format, rows[0].complete), ("safetensors", true));
    // config.json and tokenizer.json hold the same bytes: one blob.
    assert_eq!(rows[0].bytes, 200_000 + 2);
    assert_eq!(rows[0].path, cache.join("models--acme--st/snapshots").join(SHA_A));

    hub.add_repo("acme/cut", FakeRepo::default().commit(&["main"], SHA_B, files.clone()));
    hub.cut(&files[2].etag(), 1000, 1);
    let tuning = Tuning {
        retries: 0,
        backoff_ms: 0,
    };
    resolve_with("acme/cut", &o, &tuning).unwrap_err();
    let rows = store::list(&cache).unwrap();
    let cut = rows.iter().find(|r| r.repo_id == "acme/cut").unwrap();
    assert_eq!(cut.id, format!("acme/cut@{SHA_B}"));
    assert!(!cut.complete);
    // Removing it takes the partial download too.
    let r = store::remove(&cache, &HubSpec::parse(&format!("acme/cut@{SHA_B}")).unwrap()).unwrap();
    assert!(r.repo_removed);
    assert!(!cache.join("models--acme--cut").exists());
}
