//! Unit tests of the cache, including races between threads and between processes.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;
use sha2::{Digest, Sha256};
use tempfile::TempDir;

use crate::cache::root_from_env;
use crate::*;

const LIB: &str = "libkiln.so";

/// Error type of the test builders: keeps builder errors apart from cache errors.
#[derive(Debug)]
enum TestError {
    Cache(CacheError),
    Builder(String),
}

impl From<CacheError> for TestError {
    fn from(err: CacheError) -> TestError {
        TestError::Cache(err)
    }
}

fn key(n: u32) -> Key {
    Key::from_parts(&[("test", &n.to_string())])
}

/// Deterministic library contents that differ per seed.
fn library_bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn new_cache() -> (TempDir, Cache) {
    let tmp = tempfile::tempdir().unwrap();
    let cache = Cache::open(tmp.path().join("cache")).unwrap();
    (tmp, cache)
}

/// `get_or_build` with a builder that counts its calls and writes `bytes` as the library.
fn build(cache: &Cache, key: &Key, calls: &AtomicUsize, bytes: &[u8]) -> Outcome {
    cache
        .get_or_build(key, |dir| -> Result<BuildOutput, TestError> {
            calls.fetch_add(1, Ordering::SeqCst);
            fs::write(dir.join(LIB), bytes).map_err(|err| TestError::Builder(err.to_string()))?;
            Ok(BuildOutput::new(LIB, json!({ "model": "tiny", "kernels": ["matmul"] })))
        })
        .unwrap()
}

/// Sorted names in a folder.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|child| child.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Staging and trash folders in the cache folder.
fn leftovers(cache: &Cache) -> Vec<String> {
    names(cache.root())
        .into_iter()
        .filter(|name| name.starts_with(".staging-") || name.starts_with(".trash-"))
        .collect()
}

fn sha256_hex(bytes: &[u8]) -> String {
    crate::key::to_hex(&Sha256::digest(bytes))
}

/// Sets a file's or folder's modification time, to fake an old leftover.
fn set_mtime(path: &Path, time: SystemTime) {
    File::options()
        .read(true)
        .open(path)
        .unwrap()
        .set_modified(time)
        .unwrap();
}

fn append_line(path: &Path, line: &str) {
    let mut file = OpenOptions::new().create(true).append(true).open(path).unwrap();
    file.write_all(format!("{line}\n").as_bytes()).unwrap();
}

// ----- keys -----

#[test]
fn key_text_is_32_lowercase_hex_digits_and_parses_back() {
    let key = Key::from_parts(&[("spec", "{}"), ("cpu", "x86_64")]);
    let text = key.to_string();
    assert_eq!(text.len(), KEY_HEX_LEN);
    assert!(
        text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "{text}"
    );
    assert_eq!(Key::parse(&text).unwrap(), key);
    assert_eq!(Key::parse(&text.to_uppercase()).unwrap(), key);
    assert_eq!(text.parse::<Key>().unwrap(), key);
    assert_eq!(format!("{key:?}"), format!("Key({text})"));
    assert_eq!(key.as_bytes().len(), 16);
}

#[test]
fn key_matches_an_independent_implementation_of_the_encoding() {
    // Computed with Python's hashlib over the documented encoding, so a change of encoding
    // (which would orphan every existing cache entry) is a deliberate act.
    let key = Key::from_parts(&[
        ("spec", r#"{"d_model":64}"#),
        ("kiln_version", "0.1.0"),
        ("cpu", "x86_64"),
    ]);
    assert_eq!(key.to_string(), "adf3c284151688be6b45f9837e39146f");
    assert_eq!(Key::from_parts(&[]).to_string(), "d34b133288a1dab222d3e685300b6be4");
}

#[test]
fn key_encoding_is_unambiguous() {
    let k = |parts: &[(&str, &str)]| Key::from_parts(parts);
    assert_ne!(k(&[("a", "bc")]), k(&[("ab", "c")]));
    assert_ne!(k(&[("a", "")]), k(&[("", "a")]));
    assert_ne!(k(&[]), k(&[("", "")]));
    assert_ne!(k(&[("a", "b"), ("c", "d")]), k(&[("a", "bcd")]));
    assert_ne!(k(&[("a", "b"), ("a", "b")]), k(&[("a", "b")]));
    // Length prefixes rather than separators: a value containing what a separator would be.
    assert_ne!(k(&[("a", "b\0c\0d")]), k(&[("a", "b"), ("c", "d")]));
    assert_ne!(k(&[("spec", "1")]), k(&[("spec", "2")]));
    assert_ne!(k(&[("spec", "1")]), k(&[("cpu", "1")]));
}

#[test]
fn key_ignores_the_order_of_parts() {
    let forward = Key::from_parts(&[("spec", "s"), ("cpu", "c"), ("llvm_version", "22")]);
    let backward = Key::from_parts(&[("llvm_version", "22"), ("cpu", "c"), ("spec", "s")]);
    assert_eq!(forward, backward);
}

#[test]
fn key_parse_rejects_anything_but_32_hex_digits() {
    let good = key(1).to_string();
    for bad in [
        String::new(),
        good[..31].to_owned(),
        format!("{good}0"),
        format!("{good}{good}"),
        format!("{}g", &good[..31]),
        format!(" {}", &good[..31]),
        format!("{}é", &good[..30]),
        "../../../../etc/passwd/aaaaaaaaa".to_owned(),
    ] {
        let err = Key::parse(&bad).unwrap_err();
        assert!(matches!(err, CacheError::InvalidKey { .. }), "{bad:?}: {err}");
        assert!(err.to_string().contains("32 hexadecimal digits"), "{err}");
    }
}

#[test]
fn key_serializes_as_its_text() {
    let key = key(7);
    let text = serde_json::to_string(&key).unwrap();
    assert_eq!(text, format!("\"{key}\""));
    assert_eq!(serde_json::from_str::<Key>(&text).unwrap(), key);
    assert!(serde_json::from_str::<Key>("\"zz\"").is_err());
}

// ----- locating and opening the cache folder -----

#[test]
fn root_follows_kiln_then_xdg_then_home() {
    let os = |text: &'static str| Some(OsStr::new(text));
    assert_eq!(
        root_from_env(os("/k"), os("/xdg"), os("/home/u")).unwrap(),
        PathBuf::from("/k")
    );
    assert_eq!(
        root_from_env(os(""), os("/xdg"), os("/home/u")).unwrap(),
        Path::new("/xdg/kiln")
    );
    assert_eq!(root_from_env(None, os("/xdg"), None).unwrap(), Path::new("/xdg/kiln"));
    assert_eq!(
        root_from_env(None, os(""), os("/home/u")).unwrap(),
        Path::new("/home/u/.cache/kiln")
    );
    // The XDG specification says relative paths are invalid and must be ignored.
    assert_eq!(
        root_from_env(None, os("relative"), os("/home/u")).unwrap(),
        Path::new("/home/u/.cache/kiln")
    );
    // KILN_CACHE_DIR is taken as given, even relative: the user asked for it explicitly.
    assert_eq!(root_from_env(os("rel/dir"), None, None).unwrap(), Path::new("rel/dir"));
    for (kiln, xdg, home) in [(None, None, None), (os(""), os(""), os("")), (None, os("rel"), None)] {
        let err = root_from_env(kiln, xdg, home).unwrap_err();
        assert!(matches!(err, CacheError::NoCacheDir), "{err}");
        assert!(err.to_string().contains("KILN_CACHE_DIR"), "{err}");
    }
}

#[test]
fn default_root_reads_the_environment() {
    // Only reads the process environment; whatever it holds, the answer agrees with the pure
    // function.
    let expected = root_from_env(
        std::env::var_os("KILN_CACHE_DIR").as_deref(),
        std::env::var_os("XDG_CACHE_HOME").as_deref(),
        std::env::var_os("HOME").as_deref(),
    );
    match (Cache::default_root(), expected) {
        (Ok(actual), Ok(expected)) => assert_eq!(actual, expected),
        (Err(_), Err(_)) => {}
        (actual, expected) => panic!("{actual:?} != {expected:?}"),
    }
}

#[test]
fn open_creates_missing_folders_and_leaves_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("a/b/kiln");
    let cache = Cache::open(&root).unwrap();
    assert_eq!(cache.root(), root);
    assert!(root.is_dir());
    assert!(names(&root).is_empty(), "{:?}", names(&root));
    // Opening again is fine.
    Cache::open(&root).unwrap();
}

#[test]
fn open_and_build_report_a_folder_that_cannot_be_created_or_written() {
    let tmp = tempfile::tempdir().unwrap();

    // A path below a regular file cannot be created, even by root.
    let file = tmp.path().join("file");
    fs::write(&file, b"not a folder").unwrap();
    let below_file = file.join("cache");
    let err = Cache::open(&below_file).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, CacheError::CreateRoot { .. }), "{message}");
    assert!(message.contains(&below_file.display().to_string()), "{message}");
    assert!(message.starts_with("cannot create cache folder"), "{message}");
    assert!(err.io_error().is_some());
    assert!(!message.contains('\n'));

    // A path taken by a file.
    let err = Cache::open(&file).unwrap_err();
    assert!(matches!(err, CacheError::RootNotAFolder { .. }), "{err}");
    assert!(err.to_string().contains(&file.display().to_string()), "{err}");

    // Permissions, where they are enforced (not when the tests run as root).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let read_only = tmp.path().join("read-only");
        fs::create_dir(&read_only).unwrap();
        fs::set_permissions(&read_only, fs::Permissions::from_mode(0o555)).unwrap();
        let enforced = File::create(read_only.join("probe")).is_err();
        if enforced {
            // Opening is fine (hits need no write); building is what fails, before the builder.
            let cache = Cache::open(&read_only).unwrap();
            let result = cache.get_or_build(&key(1), |_| -> Result<_, TestError> {
                panic!("the builder must not run when the cache folder is not writable")
            });
            let Err(TestError::Cache(err)) = result else {
                panic!("{result:?}")
            };
            let message = err.to_string();
            assert!(matches!(err, CacheError::NotWritable { .. }), "{message}");
            assert!(
                message.starts_with(&format!("cache folder {} is not writable (", read_only.display())),
                "{message}"
            );
            assert!(message.contains("Permission denied"), "{message}");
            assert!(message.contains(&key(1).to_string()), "{message}");
            assert_eq!(err.io_error().unwrap().kind(), std::io::ErrorKind::PermissionDenied);
            assert!(names(&read_only).is_empty(), "{:?}", names(&read_only));

            let inside = read_only.join("cache");
            let err = Cache::open(&inside).unwrap_err();
            let message = err.to_string();
            assert!(matches!(err, CacheError::CreateRoot { .. }), "{message}");
            assert!(message.contains(&inside.display().to_string()), "{message}");
            assert!(message.contains("Permission denied"), "{message}");

            // get_or_build on such a folder fails cleanly instead of panicking.
            let result = Cache::at(&inside).get_or_build(&key(1), |_| -> Result<_, TestError> {
                panic!("the builder must not run when the cache folder is unusable")
            });
            assert!(matches!(result, Err(TestError::Cache(_))), "{result:?}");
        }
        fs::set_permissions(&read_only, fs::Permissions::from_mode(0o755)).unwrap();
    }
}

// ----- building and hits -----

#[test]
fn miss_builds_then_hits_without_calling_the_builder() {
    let (_tmp, cache) = new_cache();
    let calls = AtomicUsize::new(0);
    let key = key(1);
    let bytes = library_bytes(1, 10_000);

    assert_eq!(cache.lookup(&key).unwrap(), Lookup::Missing);
    let built = build(&cache, &key, &calls, &bytes);
    assert_eq!(built.status, Status::Built);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(built.entry.key, key);
    assert_eq!(built.entry.dir, cache.root().join(key.to_string()));
    assert_eq!(built.entry.library_path, built.entry.dir.join(LIB));
    assert_eq!(fs::read(&built.entry.library_path).unwrap(), bytes);

    for _ in 0..3 {
        let hit = build(&cache, &key, &calls, b"never written");
        assert_eq!(hit.status, Status::Hit);
        assert_eq!(hit.entry, built.entry);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(cache.lookup(&key).unwrap(), Lookup::Hit(Box::new(built.entry)));

    // Another key is another entry.
    let other = build(&cache, &crate::tests::key(2), &calls, &library_bytes(2, 10));
    assert_eq!(other.status, Status::Built);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(leftovers(&cache).is_empty(), "{:?}", leftovers(&cache));
}

#[test]
fn meta_json_records_the_library_and_the_builders_info() {
    let (_tmp, cache) = new_cache();
    let key = key(3);
    let bytes = library_bytes(3, 4096);
    let before = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let outcome = cache
        .get_or_build(&key, |dir| -> Result<BuildOutput, TestError> {
            fs::write(dir.join(LIB), &bytes).unwrap();
            fs::write(dir.join("build.log"), b"extra files are kept").unwrap();
            thread::sleep(Duration::from_millis(20));
            Ok(BuildOutput::new(LIB, json!({ "model": "/m/tiny.gguf", "llvm": "22" })))
        })
        .unwrap();
    let meta = &outcome.entry.meta;
    assert_eq!(meta.key, key);
    assert_eq!(meta.library, LIB);
    assert_eq!(meta.library_bytes, 4096);
    assert_eq!(meta.library_sha256, sha256_hex(&bytes));
    assert!(meta.created_unix >= before);
    assert!(meta.build_seconds >= 0.02, "{}", meta.build_seconds);
    assert_eq!(meta.kiln_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(meta.info, json!({ "model": "/m/tiny.gguf", "llvm": "22" }));

    let dir = &outcome.entry.dir;
    assert_eq!(names(dir), ["build.log", LIB, META_FILE]);
    let text = fs::read_to_string(dir.join(META_FILE)).unwrap();
    assert!(text.contains("\n  \"library_sha256\": "), "not pretty JSON:\n{text}");
    let parsed: Meta = serde_json::from_str(&text).unwrap();
    assert_eq!(&parsed, meta);
}

#[test]
fn lookup_creates_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("never-created");
    let cache = Cache::at(&root);
    assert_eq!(cache.lookup(&key(1)).unwrap(), Lookup::Missing);
    assert!(cache.list().unwrap().is_empty());
    assert!(!root.exists());

    let (_tmp, cache) = new_cache();
    build(&cache, &key(1), &AtomicUsize::new(0), b"lib");
    let before = names(cache.root());
    assert_eq!(cache.lookup(&key(2)).unwrap(), Lookup::Missing);
    assert!(matches!(cache.lookup(&key(1)).unwrap(), Lookup::Hit(_)));
    fs::remove_file(cache.entry_dir(&key(1)).join(LIB)).unwrap();
    assert!(matches!(cache.lookup(&key(1)).unwrap(), Lookup::Corrupt(_)));
    assert_eq!(names(cache.root()), before);
}

#[test]
fn empty_library_is_a_valid_entry() {
    let (_tmp, cache) = new_cache();
    let calls = AtomicUsize::new(0);
    assert_eq!(build(&cache, &key(1), &calls, b"").status, Status::Built);
    assert_eq!(build(&cache, &key(1), &calls, b"").status, Status::Hit);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

// ----- damaged entries -----

/// Builds an entry, damages it with `damage`, and checks that both `lookup` and `get_or_build`
/// notice, with a reason containing every string in `expected`, and that the rebuild is clean.
fn assert_detected_and_rebuilt(damage: impl FnOnce(&Entry), expected: &[&str]) {
    let (_tmp, cache) = new_cache();
    let calls = AtomicUsize::new(0);
    let key = key(10);
    let bytes = library_bytes(10, 64 * 1024);
    let entry = build(&cache, &key, &calls, &bytes).entry;
    damage(&entry);

    let Lookup::Corrupt(reason) = cache.lookup(&key).unwrap() else {
        panic!("damage not detected by lookup")
    };
    for part in expected {
        assert!(reason.contains(part), "reason {reason:?} lacks {part:?}");
    }
    assert!(!reason.contains('\n'), "{reason}");

    let outcome = build(&cache, &key, &calls, &bytes);
    assert_eq!(outcome.status, Status::Rebuilt { reason: reason.clone() });
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(fs::read(&outcome.entry.library_path).unwrap(), bytes);
    assert!(matches!(cache.lookup(&key).unwrap(), Lookup::Hit(_)));
    assert_eq!(build(&cache, &key, &calls, &bytes).status, Status::Hit);
    assert!(leftovers(&cache).is_empty(), "{:?}", leftovers(&cache));
}

#[test]
fn truncated_library_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| {
            let file = OpenOptions::new().write(true).open(&entry.library_path).unwrap();
            file.set_len(1000).unwrap();
        },
        &[&format!("{LIB} has 1000 bytes"), "65536", "truncated"],
    );
}

#[test]
fn garbage_library_of_the_same_size_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| fs::write(&entry.library_path, vec![0xAB; 64 * 1024]).unwrap(),
        &[LIB, "SHA-256", &entry_sha(10)],
    );
}

/// The SHA-256 recorded for the library built by `assert_detected_and_rebuilt`.
fn entry_sha(seed: u8) -> String {
    sha256_hex(&library_bytes(seed, 64 * 1024))
}

#[test]
fn library_with_appended_garbage_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| {
            let mut file = OpenOptions::new().append(true).open(&entry.library_path).unwrap();
            file.write_all(b"junk").unwrap();
        },
        &[LIB, "65540 bytes"],
    );
}

#[test]
fn missing_library_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| fs::remove_file(&entry.library_path).unwrap(),
        &[LIB, "is missing"],
    );
}

#[test]
fn missing_meta_json_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| fs::remove_file(entry.dir.join(META_FILE)).unwrap(),
        &[META_FILE, "is missing"],
    );
}

#[test]
fn unparseable_meta_json_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| fs::write(entry.dir.join(META_FILE), b"{\"key\": tru").unwrap(),
        &[META_FILE, "cannot be parsed"],
    );
}

#[test]
fn empty_meta_json_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| fs::write(entry.dir.join(META_FILE), b"").unwrap(),
        &[META_FILE, "cannot be parsed"],
    );
}

#[test]
fn meta_json_of_another_key_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| {
            let mut meta = entry.meta.clone();
            meta.key = key(11);
            fs::write(entry.dir.join(META_FILE), serde_json::to_vec(&meta).unwrap()).unwrap();
        },
        &[META_FILE, "is for key", &key(11).to_string()],
    );
}

#[test]
fn meta_json_naming_a_path_outside_the_entry_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| {
            let mut meta = entry.meta.clone();
            meta.library = "../../etc/passwd".to_owned();
            fs::write(entry.dir.join(META_FILE), serde_json::to_vec(&meta).unwrap()).unwrap();
        },
        &[META_FILE, "not a plain file name"],
    );
}

#[test]
fn library_replaced_by_a_folder_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| {
            fs::remove_file(&entry.library_path).unwrap();
            fs::create_dir(&entry.library_path).unwrap();
        },
        &[LIB, "not a regular file"],
    );
}

#[test]
fn entry_replaced_by_a_file_is_rebuilt() {
    assert_detected_and_rebuilt(
        |entry| {
            fs::remove_dir_all(&entry.dir).unwrap();
            fs::write(&entry.dir, b"oops").unwrap();
        },
        &[&entry_dir_name(10), "is not a folder"],
    );
}

fn entry_dir_name(n: u32) -> String {
    key(n).to_string()
}

// ----- failing builders -----

#[test]
fn builder_error_leaves_no_entry_and_no_staging_folder() {
    let (_tmp, cache) = new_cache();
    let key = key(20);
    let mut staging_seen = PathBuf::new();
    let result = cache.get_or_build(&key, |dir| -> Result<BuildOutput, TestError> {
        staging_seen = dir.to_owned();
        assert!(dir.is_dir());
        assert!(names(dir).is_empty());
        fs::write(dir.join(LIB), b"half a libr").unwrap();
        Err(TestError::Builder("mlir-opt failed".to_owned()))
    });
    match result {
        Err(TestError::Builder(message)) => assert_eq!(message, "mlir-opt failed"),
        other => panic!("expected the builder's error, got {other:?}"),
    }
    let staging_name = staging_seen.file_name().unwrap().to_string_lossy().into_owned();
    assert!(staging_name.starts_with(&format!(".staging-{key}-{}-", std::process::id())));
    assert!(!staging_seen.exists());
    assert!(!cache.entry_dir(&key).exists());
    assert!(leftovers(&cache).is_empty(), "{:?}", leftovers(&cache));
    assert_eq!(cache.lookup(&key).unwrap(), Lookup::Missing);

    // The lock was released: the next attempt builds.
    let calls = AtomicUsize::new(0);
    assert_eq!(build(&cache, &key, &calls, b"lib").status, Status::Built);
}

#[test]
fn builder_panic_leaves_no_entry_and_no_staging_folder() {
    let (_tmp, cache) = new_cache();
    let key = key(21);
    let result = catch_unwind(AssertUnwindSafe(|| {
        cache.get_or_build(&key, |dir| -> Result<BuildOutput, TestError> {
            fs::write(dir.join(LIB), b"half").unwrap();
            panic!("builder panicked on purpose");
        })
    }));
    assert!(result.is_err());
    assert!(!cache.entry_dir(&key).exists());
    assert!(leftovers(&cache).is_empty(), "{:?}", leftovers(&cache));
    assert_eq!(cache.lookup(&key).unwrap(), Lookup::Missing);

    let calls = AtomicUsize::new(0);
    assert_eq!(build(&cache, &key, &calls, b"lib").status, Status::Built);
}

#[test]
fn builder_output_naming_no_plain_file_is_rejected() {
    let (_tmp, cache) = new_cache();
    let key = key(22);
    for name in ["", ".", "..", "a/b", "/abs/libkiln.so", "../libkiln.so", META_FILE] {
        let result = cache.get_or_build(&key, |dir| -> Result<BuildOutput, TestError> {
            fs::write(dir.join(LIB), b"lib").unwrap();
            Ok(BuildOutput::new(name, json!(null)))
        });
        match result {
            Err(TestError::Cache(err @ CacheError::BadLibraryName { .. })) => {
                assert!(err.to_string().contains(&format!("{name:?}")), "{err}");
            }
            other => panic!("{name:?}: expected BadLibraryName, got {other:?}"),
        }
    }

    // A library the builder did not write.
    let result = cache.get_or_build(&key, |_| -> Result<BuildOutput, TestError> {
        Ok(BuildOutput::new("absent.so", json!(null)))
    });
    match result {
        Err(TestError::Cache(err @ CacheError::Io { .. })) => {
            let message = err.to_string();
            assert!(
                message.contains("absent.so") && message.contains(".staging-"),
                "{message}"
            );
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }

    // A folder where the library should be.
    let result = cache.get_or_build(&key, |dir| -> Result<BuildOutput, TestError> {
        fs::create_dir(dir.join(LIB)).unwrap();
        Ok(BuildOutput::new(LIB, json!(null)))
    });
    assert!(
        matches!(result, Err(TestError::Cache(CacheError::LibraryNotAFile { .. }))),
        "{result:?}"
    );

    assert!(!cache.entry_dir(&key).exists());
    assert!(leftovers(&cache).is_empty(), "{:?}", leftovers(&cache));
}

// ----- concurrency -----

#[test]
fn threads_building_the_same_key_run_the_builder_once() {
    let (_tmp, cache) = new_cache();
    let key = key(30);
    let calls = Arc::new(AtomicUsize::new(0));
    let threads = 4;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (cache, calls, barrier) = (cache.clone(), calls.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                cache
                    .get_or_build(&key, |dir| -> Result<BuildOutput, TestError> {
                        calls.fetch_add(1, Ordering::SeqCst);
                        thread::sleep(Duration::from_millis(200));
                        fs::write(dir.join(LIB), library_bytes(30, 100_000)).unwrap();
                        Ok(BuildOutput::new(LIB, json!("threads")))
                    })
                    .unwrap()
            })
        })
        .collect();
    let outcomes: Vec<Outcome> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let built = outcomes.iter().filter(|o| o.status == Status::Built).count();
    let hits = outcomes.iter().filter(|o| o.status == Status::Hit).count();
    assert_eq!((built, hits), (1, threads - 1));
    for outcome in &outcomes {
        assert_eq!(outcome.entry, outcomes[0].entry);
        assert_eq!(
            fs::read(&outcome.entry.library_path).unwrap(),
            library_bytes(30, 100_000)
        );
    }
    assert!(leftovers(&cache).is_empty());
}

/// Environment variable that turns [`child_process_builder`] into a builder in a child process.
const CHILD_ROOT_VAR: &str = "KILN_CACHE_TEST_CHILD_ROOT";

fn shared_key() -> Key {
    Key::from_parts(&[("test", "two processes")])
}

/// Not a test on its own: does nothing unless [`two_processes_building_the_same_key_run_the_builder_once`]
/// runs this binary with [`CHILD_ROOT_VAR`] set, in which case it builds the shared key there and
/// records what happened next to the cache folder.
#[test]
fn child_process_builder() {
    let Some(root) = std::env::var_os(CHILD_ROOT_VAR) else {
        return;
    };
    let root = PathBuf::from(root);
    let log = root.parent().unwrap().join("events.log");
    let cache = Cache::open(&root).unwrap();
    let outcome = cache
        .get_or_build(&shared_key(), |dir| -> Result<BuildOutput, TestError> {
            append_line(&log, "build");
            // Widen the race: the other process must arrive while this one builds.
            thread::sleep(Duration::from_millis(500));
            fs::write(dir.join(LIB), library_bytes(40, 200_000)).unwrap();
            Ok(BuildOutput::new(LIB, json!({ "pid": std::process::id() })))
        })
        .unwrap();
    assert_eq!(
        fs::read(&outcome.entry.library_path).unwrap(),
        library_bytes(40, 200_000)
    );
    assert!(matches!(cache.lookup(&shared_key()).unwrap(), Lookup::Hit(_)));
    append_line(&log, &format!("status {:?}", outcome.status));
}

#[test]
fn two_processes_building_the_same_key_run_the_builder_once() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("cache");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&exe)
                .args(["--exact", "tests::child_process_builder", "--nocapture"])
                .args(["--test-threads", "1"])
                .env(CHILD_ROOT_VAR, &root)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "child failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let events = fs::read_to_string(tmp.path().join("events.log")).unwrap();
    let mut lines: Vec<&str> = events.lines().collect();
    lines.sort();
    assert_eq!(lines, ["build", "status Built", "status Hit"], "{events}");

    let cache = Cache::at(&root);
    assert!(matches!(cache.lookup(&shared_key()).unwrap(), Lookup::Hit(_)));
    assert!(leftovers(&cache).is_empty(), "{:?}", leftovers(&cache));
}

// ----- listing and removal -----

/// Two keys whose text starts with the same digit, and that digit.
fn keys_sharing_a_first_digit() -> (Key, Key, String) {
    let first = key(100);
    let digit = first.to_string()[..1].to_owned();
    let second = (101..)
        .map(key)
        .find(|key| key.to_string().starts_with(&digit))
        .expect("one in 16 keys shares the digit");
    (first, second, digit)
}

/// The shortest prefix of `key` that `other` does not share.
fn distinguishing_prefix(key: &Key, other: &Key) -> String {
    let (a, b) = (key.to_string(), other.to_string());
    let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    a[..=common].to_owned()
}

#[test]
fn list_reports_valid_and_damaged_entries() {
    let (_tmp, cache) = new_cache();
    let calls = AtomicUsize::new(0);
    let good = build(&cache, &key(50), &calls, &library_bytes(50, 3000)).entry;
    let bad = build(&cache, &key(51), &calls, &library_bytes(51, 2000)).entry;
    fs::write(&bad.library_path, b"short").unwrap();
    let no_meta = build(&cache, &key(52), &calls, b"x").entry;
    fs::remove_file(no_meta.dir.join(META_FILE)).unwrap();
    // Not entries: leftovers, locks and foreign files.
    fs::create_dir(cache.root().join(format!(".staging-{}-1-1", key(53)))).unwrap();
    fs::create_dir(cache.root().join(".trash-whatever")).unwrap();
    fs::write(cache.root().join("README"), b"hi").unwrap();
    fs::create_dir(cache.root().join(key(54).to_string().to_uppercase())).unwrap();

    let list = cache.list().unwrap();
    let mut expected_keys = vec![key(50), key(51), key(52)];
    expected_keys.sort();
    assert_eq!(list.iter().map(|info| info.key).collect::<Vec<_>>(), expected_keys);

    let find = |key: Key| list.iter().find(|info| info.key == key).unwrap();
    let info = find(key(50));
    assert!(info.is_valid());
    assert_eq!(info.dir, good.dir);
    assert_eq!(info.meta.as_ref(), Some(&good.meta));
    assert_eq!(info.created_unix(), Some(good.meta.created_unix));
    assert_eq!(info.info(), Some(&good.meta.info));
    let meta_len = fs::metadata(good.dir.join(META_FILE)).unwrap().len();
    assert_eq!(info.bytes_on_disk, 3000 + meta_len);

    let info = find(key(51));
    assert!(!info.is_valid());
    assert!(info.problem.as_ref().unwrap().contains("5 bytes"), "{:?}", info.problem);
    assert_eq!(
        info.meta.as_ref(),
        Some(&bad.meta),
        "meta is kept when only the library is bad"
    );

    let info = find(key(52));
    assert!(info.problem.as_ref().unwrap().contains(META_FILE), "{:?}", info.problem);
    assert_eq!(info.meta, None);
    assert_eq!(info.created_unix(), None);
}

#[test]
fn remove_accepts_a_unique_prefix_and_refuses_ambiguous_ones() {
    let (_tmp, cache) = new_cache();
    let calls = AtomicUsize::new(0);
    let (first, second, digit) = keys_sharing_a_first_digit();
    build(&cache, &first, &calls, &library_bytes(1, 5000));
    build(&cache, &second, &calls, b"second");

    // Ambiguous: nothing is removed and both candidates are named.
    let err = cache.remove(&digit).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, CacheError::Ambiguous { ref matches, .. } if matches.len() == 2));
    assert!(message.contains(&first.to_string()) && message.contains(&second.to_string()));
    assert!(message.contains("2 entries") && !message.contains('\n'), "{message}");
    assert_eq!(cache.list().unwrap().len(), 2);

    // Invalid prefixes.
    for bad in ["", "xyz", "../", &format!("{first}0")] {
        let err = cache.remove(bad).unwrap_err();
        assert!(matches!(err, CacheError::InvalidPrefix { .. }), "{bad:?}: {err}");
    }

    // No match.
    let absent = (0..16)
        .map(|d| format!("{d:x}"))
        .find(|d| !first.to_string().starts_with(d) && !second.to_string().starts_with(d))
        .unwrap();
    let err = cache.remove(&absent).unwrap_err();
    assert!(matches!(err, CacheError::NoMatch { .. }), "{err}");
    assert!(err.to_string().contains(&cache.root().display().to_string()), "{err}");

    // A unique prefix, in upper case.
    let prefix = distinguishing_prefix(&first, &second).to_uppercase();
    let removed = cache.remove(&prefix).unwrap();
    assert_eq!(removed.key, first);
    assert!(removed.bytes_on_disk > 5000);
    assert_eq!(cache.lookup(&first).unwrap(), Lookup::Missing);
    assert!(matches!(cache.lookup(&second).unwrap(), Lookup::Hit(_)));

    // The full key, now unambiguous; a damaged entry can be removed too.
    fs::remove_file(cache.entry_dir(&second).join(META_FILE)).unwrap();
    assert_eq!(cache.remove(&second.to_string()).unwrap().key, second);
    assert!(cache.list().unwrap().is_empty());
    assert!(leftovers(&cache).is_empty());
    #[cfg(unix)]
    assert!(names(cache.root()).is_empty(), "{:?}", names(cache.root()));
}

#[test]
fn remove_waits_for_a_build_of_the_same_key() {
    let (_tmp, cache) = new_cache();
    let key = key(60);
    build(&cache, &key, &AtomicUsize::new(0), b"lib");
    let lock = cache.lock_exclusive(&key).unwrap();
    let (sender, receiver) = mpsc::channel();
    let remover = {
        let cache = cache.clone();
        thread::spawn(move || {
            let started = Instant::now();
            let removed = cache.remove(&key.to_string());
            sender.send(()).unwrap();
            (removed, started.elapsed())
        })
    };
    // While the lock is held, the entry stays.
    assert!(receiver.recv_timeout(Duration::from_millis(300)).is_err());
    assert!(matches!(cache.lookup(&key).unwrap(), Lookup::Hit(_)));
    drop(lock);
    let (removed, waited) = remover.join().unwrap();
    assert_eq!(removed.unwrap().key, key);
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert_eq!(cache.lookup(&key).unwrap(), Lookup::Missing);
}

#[test]
fn clean_all_removes_entries_leftovers_and_idle_locks_but_not_live_builds() {
    let (_tmp, cache) = new_cache();
    let calls = AtomicUsize::new(0);
    build(&cache, &key(70), &calls, &library_bytes(70, 1000));
    build(&cache, &key(71), &calls, b"damaged soon");
    fs::remove_file(cache.entry_dir(&key(71)).join(LIB)).unwrap();
    let root = cache.root().to_owned();

    // Leftovers of a crashed build (its key's lock is free), a crashed removal and a probe.
    let crashed = root.join(format!(".staging-{}-999-1", key(72)));
    fs::create_dir(&crashed).unwrap();
    fs::write(crashed.join(LIB), b"partial").unwrap();
    fs::write(root.join(format!("{}.lock", key(72))), b"").unwrap();
    fs::create_dir_all(root.join(".trash-x/deep/er")).unwrap();
    fs::write(root.join(".probe-1-1"), b"").unwrap();
    fs::create_dir(root.join(".staging-mangled")).unwrap();
    // A build in progress: its key's lock is held.
    let live_key = key(73);
    let live_lock = cache.lock_exclusive(&live_key).unwrap();
    let live = root.join(format!(".staging-{live_key}-1-1"));
    fs::create_dir(&live).unwrap();
    // Not the cache's.
    fs::write(root.join("notes.txt"), b"mine").unwrap();

    let report = cache.clean_all().unwrap();
    let mut removed = report.entries_removed.clone();
    removed.sort();
    let mut expected = vec![key(70), key(71)];
    expected.sort();
    assert_eq!(removed, expected);
    assert_eq!(report.stale_removed, 4, "{report:?}");
    assert_eq!(report.in_progress, std::slice::from_ref(&live));
    assert!(report.bytes_freed >= 1000 + 7);
    let mut remaining = vec![
        format!("{live_key}.lock"),
        live.file_name().unwrap().to_string_lossy().into_owned(),
        "notes.txt".to_owned(),
    ];
    if cfg!(unix) {
        assert_eq!(report.locks_removed, 3, "{report:?}");
    } else {
        remaining.extend([key(70), key(71), key(72)].map(|key| format!("{key}.lock")));
    }
    remaining.sort();
    assert_eq!(names(&root), remaining);

    // Once the build is over, its leftovers go too.
    drop(live_lock);
    let report = cache.clean_all().unwrap();
    assert_eq!(report.stale_removed, 1);
    assert!(report.in_progress.is_empty());
    #[cfg(unix)]
    assert_eq!(names(&root), ["notes.txt"]);

    // And the cache still works.
    assert_eq!(build(&cache, &key(70), &calls, b"again").status, Status::Built);
}

#[test]
fn clean_all_on_a_missing_folder_does_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = Cache::at(tmp.path().join("absent"));
    assert_eq!(cache.clean_all().unwrap(), CleanReport::default());
    assert!(!cache.root().exists());
}

#[test]
fn get_or_build_removes_old_leftovers_only() {
    let (_tmp, cache) = new_cache();
    let root = cache.root().to_owned();
    let two_hours_ago = SystemTime::now() - Duration::from_secs(2 * 60 * 60);

    let old_staging = root.join(format!(".staging-{}-999-1", key(80)));
    fs::create_dir(&old_staging).unwrap();
    fs::write(old_staging.join(LIB), b"partial").unwrap();
    set_mtime(&old_staging, two_hours_ago);
    let old_trash = root.join(format!(".trash-{}-999-1", key(81)));
    fs::create_dir(&old_trash).unwrap();
    set_mtime(&old_trash, two_hours_ago);
    // Old, but its build is still running.
    let live_lock = cache.lock_exclusive(&key(82)).unwrap();
    let old_live = root.join(format!(".staging-{}-999-1", key(82)));
    fs::create_dir(&old_live).unwrap();
    set_mtime(&old_live, two_hours_ago);
    // Recent: may belong to a process that is still busy.
    let recent_trash = root.join(format!(".trash-{}-999-2", key(83)));
    fs::create_dir(&recent_trash).unwrap();

    build(&cache, &key(84), &AtomicUsize::new(0), b"lib");
    assert!(!old_staging.exists());
    assert!(!old_trash.exists());
    assert!(old_live.exists());
    assert!(recent_trash.exists());
    // Leftovers are never mistaken for entries.
    assert_eq!(cache.list().unwrap().len(), 1);
    drop(live_lock);
}

// ----- cost and messages -----

#[test]
fn warm_hit_on_a_few_megabytes_is_fast() {
    let (_tmp, cache) = new_cache();
    let key = key(90);
    let calls = AtomicUsize::new(0);
    build(&cache, &key, &calls, &library_bytes(90, 4 << 20));
    // Best of three, so a busy test machine does not make this flaky.
    let fastest = (0..3)
        .map(|_| {
            let started = Instant::now();
            assert_eq!(build(&cache, &key, &calls, b"").status, Status::Hit);
            started.elapsed()
        })
        .min()
        .unwrap();
    assert!(fastest < Duration::from_millis(200), "warm hit took {fastest:?}");
}

#[test]
fn error_messages_are_single_lines_naming_what_is_wrong() {
    let (_tmp, cache) = new_cache();
    let errors = [
        CacheError::NoCacheDir,
        Key::parse("nope").unwrap_err(),
        cache.remove("0").unwrap_err(),
        CacheError::BadLibraryName {
            key: key(1),
            name: "a\nb".to_owned(),
        },
        CacheError::Io {
            what: "cannot read",
            path: PathBuf::from("/x/y"),
            err: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        },
    ];
    for err in errors {
        let message = err.to_string();
        assert!(!message.is_empty() && !message.contains('\n'), "{message:?}");
        // No OS error is hidden in a source chain that printers would repeat.
        assert!(std::error::Error::source(&err).is_none(), "{message}");
    }
}

/// `clean_all` also empties the tokenizer-table, page-cache-mark and grouped-copy folders,
/// counting their bytes as freed.
#[test]
fn clean_all_removes_the_tokenizer_tables_and_page_cache_marks() {
    let (_tmp, cache) = new_cache();
    let grouped = cache.root().join(crate::GROUPED_COPIES);
    fs::create_dir_all(&grouped).unwrap();
    fs::write(grouped.join("0123.grp"), vec![1u8; 3000]).unwrap();
    let tables = cache.root().join(crate::TOKENIZER_TABLES);
    fs::create_dir_all(&tables).unwrap();
    fs::write(tables.join("0123.bpe"), vec![7u8; 5000]).unwrap();
    let marks = cache.root().join(crate::PAGE_CACHE_MARKS);
    fs::create_dir_all(&marks).unwrap();
    fs::write(marks.join("0123"), b"").unwrap();
    let report = cache.clean_all().unwrap();
    assert!(!tables.exists() && !marks.exists() && !grouped.exists());
    assert!(report.bytes_freed >= 8000, "{report:?}");
}
