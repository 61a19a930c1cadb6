//! Hub resolution against a fake hub on 127.0.0.1 (see `fake_hub.rs`); nothing here uses
//! the network or `~/.cache/huggingface`.

use kiln_testkit::fake_hub::{FakeFile, FakeHub, FakeRepo, Request, sha256_hex};

/// Options for a fake hub and the cache `cache`: no token, no progress bars.
trait FakeHubOptions {
    fn opts(&self, cache: &Path) -> HubOptions;
}

impl FakeHubOptions for FakeHub {
    fn opts(&self, cache: &Path) -> HubOptions {
        HubOptions {
            endpoint: Some(self.url.clone()),
            token: None,
            cache_dir: Some(cache.to_path_buf()),
            offline: false,
            quiet: true,
        }
    }
}
use super::*;
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

const SHA_A: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f901234567";
const SHA_B: &str = "b0b1b2b3b4b5b6b7b8b9babbbcbdbebf00112233";

fn weights(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// The files Kiln takes from a small repo (config tagged with `tag`).
fn wanted_files(tag: &str) -> Vec<FakeFile> {
    vec![
        FakeFile::new(
            "config.json",
            format!("{{\"model_type\":\"llama\",\"tag\":\"{tag}\"}}"),
            false,
        ),
        FakeFile::new("generation_config.json", "{\"eos_token_id\": 2}", false),
        FakeFile::new("tokenizer.json", "{\"version\":\"1.0\"}", false),
        FakeFile::new("tokenizer_config.json", "{}", false),
        FakeFile::new("chat_template.jinja", "{{ messages }}", false),
        FakeFile::new("model.safetensors", weights(300_000, 7), true),
    ]
}

/// Files Kiln must not download.
fn unwanted_files() -> Vec<FakeFile> {
    vec![
        FakeFile::new(".gitattributes", "*.safetensors filter=lfs", false),
        FakeFile::new("README.md", "# tiny", false),
        FakeFile::new("pytorch_model.bin", weights(1000, 1), true),
        FakeFile::new("model.gguf", weights(1000, 2), true),
        FakeFile::new("onnx/model.onnx", weights(1000, 3), true),
        FakeFile::new("original/consolidated.pth", weights(1000, 4), true),
    ]
}

fn tiny_repo(tag: &str) -> Vec<FakeFile> {
    let mut f = wanted_files(tag);
    f.extend(unwanted_files());
    f
}

fn no_retries() -> Tuning {
    Tuning {
        retries: 0,
        backoff_ms: 0,
    }
}

/// An endpoint nothing listens on.
fn dead_endpoint() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

fn setup(files: Vec<FakeFile>) -> (FakeHub, tempfile::TempDir, PathBuf) {
    let hub = FakeHub::start();
    hub.add_repo("acme/tiny", FakeRepo::default().commit(&["main"], SHA_A, files));
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    (hub, tmp, cache)
}

fn names(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

fn new_requests(hub: &FakeHub, since: usize) -> Vec<Request> {
    hub.requests()[since..].to_vec()
}

/// Checks `snap/<file>` is a relative symlink into `blobs/` holding `data`.
fn assert_linked(snap: &Path, f: &FakeFile) {
    let link = snap.join(&f.name);
    let meta = fs::symlink_metadata(&link).unwrap();
    assert!(meta.file_type().is_symlink(), "{} is not a symlink", f.name);
    let depth = f.name.matches('/').count();
    assert_eq!(
        fs::read_link(&link).unwrap(),
        PathBuf::from(format!("{}../../blobs/{}", "../".repeat(depth), f.etag()))
    );
    assert_eq!(fs::read(&link).unwrap(), f.data, "{}", f.name);
}

#[test]
fn first_download_lays_out_the_cache_like_huggingface_hub() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    let snap = resolve("acme/tiny", &hub.opts(&cache)).unwrap();

    let repo_dir = cache.join("models--acme--tiny");
    assert_eq!(snap, repo_dir.join("snapshots").join(SHA_A));
    assert_eq!(
        names(&repo_dir),
        ["blobs", "refs", "snapshots"].map(String::from).into()
    );
    assert_eq!(fs::read_to_string(repo_dir.join("refs/main")).unwrap(), SHA_A);
    assert_eq!(names(&repo_dir.join("refs")), ["main".to_string()].into());
    assert_eq!(names(&repo_dir.join("snapshots")), [SHA_A.to_string()].into());

    let wanted = wanted_files("a");
    for f in &wanted {
        assert_linked(&snap, f);
        let blob = repo_dir.join("blobs").join(f.etag());
        assert!(fs::symlink_metadata(&blob).unwrap().file_type().is_file());
    }
    assert_eq!(
        names(&snap),
        wanted.iter().map(|f| f.name.clone()).collect::<BTreeSet<_>>()
    );
    // Exactly one blob per file, nothing left half-written.
    assert_eq!(
        names(&repo_dir.join("blobs")),
        wanted.iter().map(|f| f.etag()).collect::<BTreeSet<_>>()
    );
    assert!(cache.join("CACHEDIR.TAG").is_file());
    assert!(
        cache
            .join(".locks/models--acme--tiny")
            .join(format!("{}.lock", wanted[5].etag()))
            .is_file()
    );

    let reqs = hub.requests();
    assert_eq!(reqs[0].method, "GET");
    assert_eq!(reqs[0].path, "/api/models/acme/tiny/revision/main");
    for r in &reqs {
        for f in unwanted_files() {
            assert!(!r.path.contains(&f.name), "{} was requested", r.path);
        }
        assert!(r.header("user-agent").unwrap().starts_with("kiln/"));
        assert_eq!(r.header("authorization"), None);
    }
    // Files are asked for by commit, never by branch.
    assert!(
        reqs.iter()
            .filter(|r| r.path.contains("/resolve/"))
            .all(|r| r.path.starts_with(&format!("/acme/tiny/resolve/{SHA_A}/")))
    );
    // The LFS file came from the "CDN" the hub redirected to, in one GET.
    let cdn: Vec<_> = reqs.iter().filter(|r| r.path.starts_with("/cdn/")).collect();
    assert_eq!(cdn.len(), 1);
    assert_eq!(cdn[0].method, "GET");
    assert_eq!(cdn[0].header("range"), None);
}

#[test]
fn a_cached_model_is_resolved_without_any_request() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    let opts = hub.opts(&cache);
    let first = resolve("acme/tiny", &opts).unwrap();
    let n = hub.request_count();
    assert_eq!(resolve("acme/tiny", &opts).unwrap(), first);
    assert_eq!(resolve("acme/tiny@main", &opts).unwrap(), first);
    assert_eq!(cached("acme/tiny", &opts).unwrap(), Some(first.clone()));
    assert_eq!(hub.request_count(), n, "{:?}", new_requests(&hub, n));

    // fetch asks the hub for the commit, finds every file in place and downloads nothing.
    assert_eq!(fetch("acme/tiny", &opts).unwrap(), first);
    let reqs = new_requests(&hub, n);
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert!(reqs[0].path.starts_with("/api/models/acme/tiny/revision/main"));
}

#[test]
fn fetch_follows_a_moved_branch_and_shares_unchanged_blobs() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    let opts = hub.opts(&cache);
    let a = resolve("acme/tiny", &opts).unwrap();
    hub.add_repo(
        "acme/tiny",
        FakeRepo::default()
            .commit(&[], SHA_A, tiny_repo("a"))
            .commit(&["main"], SHA_B, tiny_repo("b")),
    );
    // resolve keeps to the cache...
    assert_eq!(resolve("acme/tiny", &opts).unwrap(), a);
    // ...fetch moves to the new commit, downloading only the changed config.
    let n = hub.request_count();
    let b = fetch("acme/tiny", &opts).unwrap();
    let repo_dir = cache.join("models--acme--tiny");
    assert_eq!(b, repo_dir.join("snapshots").join(SHA_B));
    assert_eq!(fs::read_to_string(repo_dir.join("refs/main")).unwrap(), SHA_B);
    for f in wanted_files("b") {
        assert_linked(&b, &f);
    }
    let gets: Vec<_> = new_requests(&hub, n)
        .into_iter()
        .filter(|r| r.method == "GET")
        .map(|r| r.path)
        .collect();
    assert_eq!(
        gets,
        [
            "/api/models/acme/tiny/revision/main".to_string(),
            format!("/acme/tiny/resolve/{SHA_B}/config.json")
        ]
    );
    // The old snapshot is still there, by commit.
    assert_eq!(resolve(&format!("acme/tiny@{SHA_A}"), &opts).unwrap(), a);
}

#[test]
fn a_revision_pins_a_tag_or_a_commit() {
    let hub = FakeHub::start();
    hub.add_repo(
        "acme/tiny",
        FakeRepo::default()
            .commit(&["main"], SHA_A, tiny_repo("a"))
            .commit(&["v1"], SHA_B, tiny_repo("b")),
    );
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let opts = hub.opts(&cache);
    let repo_dir = cache.join("models--acme--tiny");

    let v1 = resolve("acme/tiny@v1", &opts).unwrap();
    assert_eq!(v1, repo_dir.join("snapshots").join(SHA_B));
    assert_eq!(fs::read_to_string(repo_dir.join("refs/v1")).unwrap(), SHA_B);
    assert!(!repo_dir.join("refs/main").exists());
    assert_linked(&v1, &wanted_files("b")[0]);
    assert!(
        hub.requests()
            .iter()
            .any(|r| r.path == "/api/models/acme/tiny/revision/v1")
    );

    // A full commit hash needs no ref.
    let a = resolve(&format!("acme/tiny@{SHA_A}"), &opts).unwrap();
    assert_eq!(a, repo_dir.join("snapshots").join(SHA_A));
    assert_eq!(names(&repo_dir.join("refs")), ["v1".to_string()].into());
    assert_linked(&a, &wanted_files("a")[0]);

    // Both are found offline; main, never downloaded by name, is not.
    let offline = HubOptions {
        offline: true,
        endpoint: Some(dead_endpoint()),
        ..opts.clone()
    };
    assert_eq!(resolve("acme/tiny@v1", &offline).unwrap(), v1);
    assert_eq!(resolve(&format!("acme/tiny@{SHA_A}"), &offline).unwrap(), a);
    assert!(matches!(resolve("acme/tiny", &offline), Err(HubError::Offline { .. })));
}

#[test]
fn offline_hit_and_miss() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    let snap = resolve("acme/tiny", &hub.opts(&cache)).unwrap();
    let n = hub.request_count();
    let offline = HubOptions {
        offline: true,
        ..hub.opts(&cache)
    };
    assert_eq!(resolve("acme/tiny", &offline).unwrap(), snap);
    assert_eq!(fetch("acme/tiny", &offline).unwrap(), snap);
    assert_eq!(hub.request_count(), n);

    let e = resolve("acme/other", &offline).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "model acme/other is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set; \
             run once online or download it with huggingface-cli",
            cache.display()
        )
    );
    assert!(
        resolve("acme/tiny@v2", &offline)
            .unwrap_err()
            .to_string()
            .contains("acme/tiny@v2")
    );

    // A snapshot missing its weights is not taken for a model.
    fs::remove_file(snap.join("model.safetensors")).unwrap();
    let e = resolve("acme/tiny", &offline).unwrap_err();
    assert!(matches!(e, HubError::OfflinePartial { .. }), "{e}");
    assert!(e.to_string().contains("model.safetensors is missing"), "{e}");
    assert_eq!(hub.request_count(), n);

    // Online, the missing file is downloaded again (its blob is still there: no body fetched).
    let again = resolve("acme/tiny", &hub.opts(&cache)).unwrap();
    assert_eq!(again, snap);
    assert_linked(&snap, &wanted_files("a")[5]);
    assert!(!new_requests(&hub, n).iter().any(|r| r.path.starts_with("/cdn/")));
}

#[test]
fn an_unreachable_hub_falls_back_to_the_cache() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    let snap = resolve("acme/tiny", &hub.opts(&cache)).unwrap();
    let dead = HubOptions {
        endpoint: Some(dead_endpoint()),
        ..hub.opts(&cache)
    };
    assert_eq!(resolve("acme/tiny", &dead).unwrap(), snap);
    // fetch has to ask the hub, fails to, and warns and uses the cache.
    assert_eq!(fetch("acme/tiny", &dead).unwrap(), snap);
    // Nothing cached: the network error is the answer.
    let e = resolve("acme/other", &dead).unwrap_err();
    assert!(matches!(e, HubError::Network { .. }), "{e}");
    let endpoint = dead.endpoint.clone().unwrap();
    assert!(
        e.to_string().starts_with(&format!(
            "cannot reach {endpoint}/api/models/acme/other/revision/main: "
        )),
        "{e}"
    );
}

#[test]
fn a_cut_download_is_resumed_by_the_next_run() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    let opts = hub.opts(&cache);
    let model = wanted_files("a").pop().unwrap();
    let etag = model.etag();
    assert_eq!(etag, sha256_hex(&model.data));
    hub.cut(&etag, 100_000, 1);

    let e = resolve_with("acme/tiny", &opts, &no_retries()).unwrap_err();
    assert!(matches!(e, HubError::Network { .. }), "{e}");
    assert!(e.to_string().contains("100000 of 300000 bytes"), "{e}");
    let repo_dir = cache.join("models--acme--tiny");
    let blobs = repo_dir.join("blobs");
    let incomplete = blobs.join(format!("{etag}.incomplete"));
    assert_eq!(fs::metadata(&incomplete).unwrap().len(), 100_000);
    assert_eq!(fs::read(&incomplete).unwrap(), model.data[..100_000]);
    assert!(!blobs.join(&etag).exists());
    let snap = repo_dir.join("snapshots").join(SHA_A);
    assert!(fs::symlink_metadata(snap.join("model.safetensors")).is_err());
    assert!(!repo_dir.join("refs/main").exists());
    // Not a model yet, online or offline.
    assert_eq!(cached("acme/tiny", &opts).unwrap(), None);

    let n = hub.request_count();
    let got = resolve_with("acme/tiny", &opts, &no_retries()).unwrap();
    assert_eq!(got, snap);
    let cdn: Vec<_> = new_requests(&hub, n)
        .into_iter()
        .filter(|r| r.path.starts_with("/cdn/"))
        .collect();
    assert_eq!(cdn.len(), 1);
    assert_eq!(cdn[0].header("range"), Some("bytes=100000-"));
    // Small files were not fetched again.
    assert!(!new_requests(&hub, n).iter().any(|r| r.path.ends_with("config.json")));
    assert_eq!(sha256_hex(&fs::read(snap.join("model.safetensors")).unwrap()), etag);
    assert!(!incomplete.exists());
    assert_eq!(fs::read_to_string(repo_dir.join("refs/main")).unwrap(), SHA_A);
}

#[test]
fn a_cut_download_is_resumed_in_process() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    let model = wanted_files("a").pop().unwrap();
    hub.cut(&model.etag(), 64_000, 2);
    let tuning = Tuning {
        retries: 3,
        backoff_ms: 1,
    };
    let snap = resolve_with("acme/tiny", &hub.opts(&cache), &tuning).unwrap();
    assert_linked(&snap, &model);
    let ranges: Vec<_> = hub
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/cdn/"))
        .map(|r| r.header("range").map(str::to_string))
        .collect();
    assert_eq!(
        ranges,
        [
            None,
            Some("bytes=64000-".to_string()),
            Some("bytes=128000-".to_string())
        ]
    );
}

#[test]
fn a_corrupt_download_is_rejected() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    let model = wanted_files("a").pop().unwrap();
    hub.corrupt(&model.etag());
    let e = resolve("acme/tiny", &hub.opts(&cache)).unwrap_err();
    assert!(matches!(e, HubError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    let blobs = cache.join("models--acme--tiny/blobs");
    assert!(!blobs.join(model.etag()).exists());
    assert!(!blobs.join(format!("{}.incomplete", model.etag())).exists());
}

#[test]
fn a_gated_model_needs_the_token() {
    let hub = FakeHub::start();
    hub.add_repo(
        "acme/gated",
        FakeRepo::default()
            .commit(&["main"], SHA_A, tiny_repo("a"))
            .gated("hf_secret"),
    );
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let opts = hub.opts(&cache);

    let e = resolve("acme/gated", &opts).unwrap_err();
    assert!(matches!(e, HubError::Unauthorized { status: 401, .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("acme/gated") && msg.contains("set HF_TOKEN"), "{msg}");

    let wrong = HubOptions {
        token: Some("hf_wrong".into()),
        ..opts.clone()
    };
    let msg = resolve("acme/gated", &wrong).unwrap_err().to_string();
    assert!(msg.contains("the token in HF_TOKEN does not give access"), "{msg}");

    let right = HubOptions {
        token: Some("hf_secret".into()),
        ..opts.clone()
    };
    let n = hub.request_count();
    let snap = resolve("acme/gated", &right).unwrap();
    for f in wanted_files("a") {
        assert_linked(&snap, &f);
    }
    let reqs = new_requests(&hub, n);
    assert!(reqs.len() > 6);
    for r in &reqs {
        // The token goes to the hub, never to the CDN.
        let expected = (!r.path.starts_with("/cdn/")).then_some("Bearer hf_secret");
        assert_eq!(r.header("authorization"), expected, "{}", r.path);
    }
}

#[test]
fn a_cdn_on_the_hub_origin_works_too() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    hub.cdn_on_hub_origin();
    let opts = HubOptions {
        token: Some("hf_tok".into()),
        ..hub.opts(&cache)
    };
    let snap = resolve("acme/tiny", &opts).unwrap();
    for f in wanted_files("a") {
        assert_linked(&snap, &f);
    }
    // HEAD stops at the redirect that names the linked file; the blob is fetched once.
    let cdn: Vec<_> = hub
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/cdn/"))
        .collect();
    assert_eq!(cdn.len(), 1);
    assert_eq!(cdn[0].method, "GET");
    assert_eq!(cdn[0].header("authorization"), Some("Bearer hf_tok"));
}

#[test]
fn hub_errors_are_one_clear_line() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    hub.add_repo(
        "acme/pytorch",
        FakeRepo::default().commit(
            &["main"],
            SHA_A,
            vec![
                FakeFile::new("config.json", "{}", false),
                FakeFile::new("tokenizer.json", "{}", false),
                FakeFile::new("pytorch_model.bin", weights(100, 0), true),
            ],
        ),
    );
    hub.add_repo(
        "acme/notok",
        FakeRepo::default().commit(
            &["main"],
            SHA_A,
            vec![
                FakeFile::new("config.json", "{}", false),
                FakeFile::new("model.safetensors", weights(100, 0), true),
            ],
        ),
    );
    let opts = hub.opts(&cache);

    let e = resolve("acme/missing", &opts).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "model acme/missing not found on {} (check the name, or set HF_TOKEN for \
             private/gated models)",
            hub.url
        )
    );

    let e = resolve("acme/tiny@nope", &opts).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("revision 'nope' of model acme/tiny not found on {}", hub.url)
    );

    let n = hub.request_count();
    let e = resolve("acme/pytorch", &opts).unwrap_err();
    assert!(matches!(e, HubError::NoSafetensors { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "model acme/pytorch has no safetensors weights (model.safetensors or \
         model.safetensors.index.json) and no GGUF model files (it has pytorch_model.bin); \
         Kiln loads safetensors or GGUF"
    );
    // Decided from the file list alone: nothing downloaded.
    assert_eq!(hub.request_count(), n + 1);
    assert!(!cache.join("models--acme--pytorch/snapshots").exists());

    let e = resolve("acme/notok", &opts).unwrap_err();
    assert_eq!(
        e.to_string(),
        "model acme/notok has no tokenizer.json, which Kiln needs"
    );

    let e = resolve("not a model", &opts).unwrap_err();
    assert!(matches!(e, HubError::InvalidSpec { .. }), "{e}");

    for e in [
        resolve("acme/missing", &opts).unwrap_err(),
        resolve(
            "acme/other",
            &HubOptions {
                offline: true,
                ..opts.clone()
            },
        )
        .unwrap_err(),
    ] {
        assert!(!e.to_string().contains('\n'));
    }
}

#[test]
fn sharded_weights_follow_the_index() {
    let shard1 = FakeFile::new("model-00001-of-00002.safetensors", weights(120_000, 1), true);
    let shard2 = FakeFile::new("model-00002-of-00002.safetensors", weights(80_000, 2), true);
    let index = FakeFile::new(
        "model.safetensors.index.json",
        format!(
            "{{\"metadata\":{{\"total_size\":200000}},\"weight_map\":{{\
             \"a.weight\":\"{0}\",\"b.weight\":\"{1}\",\"c.weight\":\"{0}\"}}}}",
            shard1.name, shard2.name
        ),
        false,
    );
    let mut files: Vec<FakeFile> = wanted_files("a")
        .into_iter()
        .filter(|f| f.name != "model.safetensors")
        .collect();
    files.extend([
        index.clone(),
        shard1.clone(),
        shard2.clone(),
        FakeFile::new("consolidated.safetensors", weights(1000, 9), true),
    ]);
    let (hub, _tmp, cache) = setup(files);
    let snap = resolve("acme/tiny", &hub.opts(&cache)).unwrap();
    for f in [&index, &shard1, &shard2] {
        assert_linked(&snap, f);
    }
    assert!(!snap.join("consolidated.safetensors").exists());
    assert!(!hub.requests().iter().any(|r| r.path.contains("consolidated")));
    let n = hub.request_count();
    assert_eq!(resolve("acme/tiny", &hub.opts(&cache)).unwrap(), snap);
    assert_eq!(hub.request_count(), n);

    // A missing shard makes the cached snapshot incomplete; resolve fetches it again.
    fs::remove_file(snap.join(&shard2.name)).unwrap();
    assert_eq!(cached("acme/tiny", &hub.opts(&cache)).unwrap(), None);
    assert_eq!(resolve("acme/tiny", &hub.opts(&cache)).unwrap(), snap);
    assert_linked(&snap, &shard2);
}

#[test]
fn the_endpoint_option_is_honoured() {
    let (hub, _tmp, cache) = setup(tiny_repo("a"));
    let opts = HubOptions {
        endpoint: Some(format!("{}/", hub.url)),
        ..hub.opts(&cache)
    };
    assert_eq!(opts.endpoint(), hub.url);
    resolve("acme/tiny", &opts).unwrap();
    assert!(hub.request_count() > 0);
    assert!(hub.requests().iter().all(|r| !r.path.starts_with("//")));
    assert_eq!(HubOptions::default().endpoint(), "https://huggingface.co");
}

#[test]
fn options_from_the_environment() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("hf");
    fs::create_dir_all(&home).unwrap();
    fs::write(home.join("token"), "hf_from_file\n").unwrap();
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        let home = home.clone();
        move |k: &str| {
            if k == "HF_HOME" {
                return Some(home.display().to_string());
            }
            pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        }
    };
    let o = HubOptions::from_lookup(env(&[]));
    assert_eq!(o.endpoint, None);
    assert_eq!(o.token.as_deref(), Some("hf_from_file"));
    assert_eq!(o.cache_dir, Some(home.join("hub")));
    assert!(!o.offline && !o.quiet);
    assert_eq!(o.endpoint(), DEFAULT_ENDPOINT);

    let o = HubOptions::from_lookup(env(&[
        ("HF_ENDPOINT", "http://mirror.local:8080/"),
        ("HF_TOKEN", " hf_env \n"),
        ("HF_HUB_CACHE", "/data/hub"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "true"),
    ]));
    assert_eq!(o.endpoint.as_deref(), Some("http://mirror.local:8080"));
    assert_eq!(o.token.as_deref(), Some("hf_env"));
    assert_eq!(o.cache_dir, Some(PathBuf::from("/data/hub")));
    assert!(o.offline && o.quiet);

    let o = HubOptions::from_lookup(env(&[("HF_HUB_OFFLINE", "0"), ("TRANSFORMERS_OFFLINE", "yes")]));
    assert!(o.offline);
    let o = HubOptions::from_lookup(|k| match k {
        "HOME" => Some("/home/u".into()),
        _ => None,
    });
    assert_eq!(o.cache_dir, Some(PathBuf::from("/home/u/.cache/huggingface/hub")));
    assert_eq!(o.token, None);
    let o = HubOptions::from_lookup(|k| match k {
        "HOME" => Some("/home/u".into()),
        "XDG_CACHE_HOME" => Some("/xdg".into()),
        "HUGGINGFACE_HUB_CACHE" => Some("~/legacy".into()),
        _ => None,
    });
    assert_eq!(o.cache_dir, Some(PathBuf::from("/home/u/legacy")));
}

#[test]
fn hub_ids() {
    for ok in [
        "Qwen/Qwen2.5-0.5B-Instruct",
        "meta-llama/Llama-3.2-1B",
        "a/b",
        "org_1/name.v2",
        "acme/tiny@main",
        "acme/tiny@v1.0",
        "acme/tiny@refs/pr/1",
        "acme/tiny@0a1b2c3d4e5f60718293a4b5c6d7e8f901234567",
    ] {
        assert!(is_hub_id(ok), "{ok}");
    }
    for bad in [
        "tiny",
        "a/b/c",
        "/abs/path",
        "./rel",
        "../up/x",
        "-a/b",
        "a/b-",
        "a./b",
        "a/.b",
        "a--x/b",
        "a/b..c",
        "a/b.git",
        "a/b c",
        "a/bé",
        "a/b@",
        "a/b@../x",
        "a/b@x//y",
        "a/b@/x",
        "a/b@x y",
        "",
    ] {
        assert!(!is_hub_id(bad), "{bad}");
    }
    assert!(!is_hub_id(&format!("a/{}", "x".repeat(97))));
    // An existing folder is never a hub id.
    let tmp = tempfile::tempdir().unwrap();
    fs::create_dir_all(tmp.path().join("org/name")).unwrap();
    let cwd_relative = tmp.path().join("org/name");
    assert!(!is_hub_id(cwd_relative.to_str().unwrap()));

    let s = HubSpec::parse("acme/tiny@refs/pr/1").unwrap();
    assert_eq!(s.repo_id, "acme/tiny");
    assert_eq!(s.revision, "refs/pr/1");
    assert_eq!(s.folder_name(), "models--acme--tiny");
    assert_eq!(s.to_string(), "acme/tiny@refs/pr/1");
    let s = HubSpec::parse("acme/tiny").unwrap();
    assert_eq!(s.revision, "main");
    assert_eq!(s.to_string(), "acme/tiny");
    assert!(!s.is_commit());
}

#[test]
fn a_revision_with_a_slash_is_quoted_and_nested_under_refs() {
    let hub = FakeHub::start();
    hub.add_repo(
        "acme/tiny",
        FakeRepo::default().commit(&["refs/pr/1"], SHA_B, tiny_repo("b")),
    );
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let snap = resolve("acme/tiny@refs/pr/1", &hub.opts(&cache)).unwrap();
    assert!(snap.ends_with(SHA_B));
    assert_eq!(hub.requests()[0].path, "/api/models/acme/tiny/revision/refs%2Fpr%2F1");
    let repo_dir = cache.join("models--acme--tiny");
    assert_eq!(fs::read_to_string(repo_dir.join("refs/refs/pr/1")).unwrap(), SHA_B);
}

/// The committed Qwen2 test model, served as a hub repo, downloads into a folder Kiln loads.
#[test]
fn the_fixture_model_round_trips_through_the_hub() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen2");
    let mut files = Vec::new();
    for name in names(&dir) {
        let data = fs::read(dir.join(&name)).unwrap();
        files.push(FakeFile::new(&name, data, name.ends_with(".safetensors")));
    }
    let hub = FakeHub::start();
    hub.add_repo("Qwen/tiny-qwen2", FakeRepo::default().commit(&["main"], SHA_A, files));
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let snap = resolve("Qwen/tiny-qwen2", &hub.opts(&cache)).unwrap();
    assert_eq!(
        names(&snap),
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
        .map(String::from)
        .into()
    );
    for name in names(&snap) {
        assert_eq!(fs::read(snap.join(&name)).unwrap(), fs::read(dir.join(&name)).unwrap());
    }
    let model = crate::model::load(&snap).unwrap();
    assert_eq!(model.dir, snap);
    kiln_text::tokenizer::Tokenizer::from_dir(&snap).unwrap();
}

/// With Python's `huggingface_hub` installed: a model Kiln downloads is found by Python
/// offline, and one Python downloads (from the fake hub) is found by Kiln offline.
#[test]
#[ignore = "needs python3 with huggingface_hub (pip install -r scripts/requirements-golden.txt)"]
fn the_cache_is_shared_with_python_huggingface_hub() {
    let python_ok = std::process::Command::new("python3")
        .args(["-c", "import huggingface_hub"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(python_ok, "python3 with huggingface_hub is installed");
    let (hub, tmp, cache) = setup(tiny_repo("a"));
    let python = |cache: &Path, offline: bool, script: &str| {
        let out = std::process::Command::new("python3")
            .args(["-c", script])
            .env("HF_HUB_CACHE", cache)
            .env("HF_HOME", tmp.path().join("py-home"))
            .env("HF_ENDPOINT", &hub.url)
            .env("HF_HUB_OFFLINE", if offline { "1" } else { "0" })
            .env("HF_HUB_DISABLE_TELEMETRY", "1")
            .env("HF_HUB_DISABLE_UPDATE_CHECK", "1")
            .env("HF_HUB_DISABLE_XET", "1")
            .env("HF_HUB_DISABLE_PROGRESS_BARS", "1")
            .env_remove("HF_TOKEN")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "python failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let wanted: Vec<String> = wanted_files("a").into_iter().map(|f| f.name).collect();
    let list = format!("{wanted:?}");

    // Kiln downloads, Python reads offline.
    let snap = resolve("acme/tiny", &hub.opts(&cache)).unwrap();
    let out = python(
        &cache,
        true,
        &format!(
            "from huggingface_hub import hf_hub_download, snapshot_download\n\
             for f in {list}:\n    print(hf_hub_download('acme/tiny', f))\n\
             print(snapshot_download('acme/tiny'))\n"
        ),
    );
    let lines: Vec<&str> = out.lines().collect();
    for (line, f) in lines.iter().zip(&wanted) {
        assert_eq!(Path::new(line), snap.join(f));
    }
    assert_eq!(Path::new(lines[wanted.len()]), snap);

    // Python downloads, Kiln reads offline.
    let py_cache = tmp.path().join("py-hub");
    let n = hub.request_count();
    let out = python(
        &py_cache,
        false,
        &format!(
            "from huggingface_hub import hf_hub_download\n\
             for f in {list}:\n    print(hf_hub_download('acme/tiny', f))\n"
        ),
    );
    assert!(hub.request_count() > n, "python did not use the fake hub");
    let offline = HubOptions {
        offline: true,
        ..hub.opts(&py_cache)
    };
    let py_snap = resolve("acme/tiny", &offline).unwrap();
    assert_eq!(py_snap, py_cache.join("models--acme--tiny/snapshots").join(SHA_A));
    assert_eq!(Path::new(out.lines().next().unwrap()), py_snap.join("config.json"));
    for f in wanted_files("a") {
        assert_linked(&py_snap, &f);
    }
}
