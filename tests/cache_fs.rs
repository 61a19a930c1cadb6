//! End-to-end runs of `kiln compile` against cache folders that misbehave: a linker that exits 0
//! with a truncated library, a cache file system that fills up, and a read-only cache. The two
//! that need a mount (a tiny tmpfs, a read-only bind mount) do it in a user namespace with
//! `unshare -rm`, so they run as any user the kernel lets create one, and are ignored by
//! default; the unit tests in `cache/` cover the same invariants without mounts.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, SystemTime};

const KILN: &str = env!("CARGO_BIN_EXE_kiln");

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn kiln(cache: &Path, args: &[&str]) -> Output {
    Command::new(KILN)
        .args(args)
        .env("KILN_CACHE_DIR", cache)
        .env_remove("KILN_PROFILE")
        .env_remove("KILN_LINKER")
        .output()
        .expect("kiln runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Checks the error contract of a failed build: non-zero exit, one line starting `error: `,
/// no panic, and containing every needle.
fn assert_one_error_line(o: &Output, needles: &[&str]) -> String {
    let err = text(&o.stderr);
    assert!(!o.status.success(), "expected a failure: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    for needle in needles {
        assert!(err.contains(needle), "error should mention {needle:?}: {err}");
    }
    err
}

/// A `KILN_LINKER` that runs `link` (shell code; `$out` is the library, `$first` the first
/// object, `$@` the driver's arguments) and exits 0 whatever it produced.
fn lying_linker(dir: &Path, link: &str) -> PathBuf {
    let script = dir.join("lying-cc");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nout=\nprev=\nfirst=\nfor a in \"$@\"; do\n\
             [ \"$prev\" = -o ] && out=$a\ncase $a in *.o) [ -z \"$first\" ] && first=$a;; esac\nprev=$a\ndone\n\
             {link}\nexit 0\n"
        ),
    )
    .unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    script
}

/// Compiles the llama fixture with a linker that runs `link` and claims success, and checks the
/// error contract: one line containing every needle, and no entry or staging folder.
fn compile_with_lying_linker(cache: &Path, link: &str, needles: &[&str]) {
    let scripts = tempfile::tempdir().unwrap();
    let o = Command::new(KILN)
        .args(["compile", fixture("llama").to_str().unwrap()])
        .env("KILN_CACHE_DIR", cache)
        .env("KILN_LINKER", lying_linker(scripts.path(), link))
        .output()
        .unwrap();
    let mut needles = needles.to_vec();
    needles.push(cache.to_str().unwrap());
    assert_one_error_line(&o, &needles);
    let left: Vec<String> = names(cache).into_iter().filter(|n| !n.ends_with(".lock")).collect();
    assert!(left.is_empty(), "no entry and no staging folder: {left:?}");
}

/// The ENOSPC report without a full disk: the linker's success is not trusted. A library cut
/// short (as GNU ld 2.40 leaves it when its last write fails), a file that is not a shared
/// object, and one that loads but lacks the kernels are all refused without an entry, and the
/// next compile with an honest linker builds a good one.
#[test]
fn libraries_a_linker_wrongly_reports_as_linked_are_not_published() {
    let base = tempfile::tempdir().unwrap();
    let cache = base.path().join("cache");
    let model = fixture("llama");
    compile_with_lying_linker(
        &cache,
        "cc \"$@\" && truncate -s -592 \"$out\"",
        &["the linker exited 0 but wrote", "its write was cut short"],
    );
    compile_with_lying_linker(
        &cache,
        "echo 'not a library' > \"$out\"",
        &["built library", "libkiln.so is not an ELF file (14 bytes"],
    );
    // Only the first object, the ABI-version function: it loads, but the kernels are missing.
    compile_with_lying_linker(
        &cache,
        "cc -shared -o \"$out\" \"$first\"",
        &["fails its load check: it lacks symbol kiln_"],
    );

    let o = kiln(&cache, &["compile", model.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["cache_hit"], false);
    let o = kiln(&cache, &["cache", "list"]);
    assert!(text(&o.stdout).contains("[ok]"), "{}", text(&o.stdout));
}

/// Modification times of `paths`.
fn mtimes(paths: &[PathBuf]) -> Vec<SystemTime> {
    paths
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().modified().unwrap())
        .collect()
}

/// A hit through the CLI writes nothing in the cache folder: no lock file appears (one was
/// deleted, as in a cache copied from elsewhere) and no modification time changes. Holds for
/// root too, where a read-only folder could not show it. The first run of a model writes its
/// tokenizer's table file once (see ARCHITECTURE.md, Cache); a run that finds both the library
/// and that file writes nothing either.
#[test]
fn a_cache_hit_writes_nothing_in_the_cache_folder() {
    let base = tempfile::tempdir().unwrap();
    let cache = base.path().join("cache");
    let model = fixture("llama");
    let o = kiln(&cache, &["compile", model.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    let key = report["cache_key"].as_str().unwrap();
    let run = ["run", model.to_str().unwrap(), "--prompt", "hi", "--max-tokens", "2"];
    assert!(kiln(&cache, &run).status.success());
    std::fs::remove_file(cache.join(format!("{key}.lock"))).unwrap();
    let entry = cache.join(key);
    let tables = cache.join("tokenizers");
    let table_files: Vec<PathBuf> = std::fs::read_dir(&tables).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(table_files.len(), 1, "{table_files:?}");
    let mut paths = vec![cache.clone(), entry.join("libkiln.so"), entry.join("meta.json"), entry];
    paths.extend([tables].into_iter().chain(table_files));
    let past = SystemTime::now() - Duration::from_secs(3600);
    for path in &paths {
        std::fs::File::open(path).unwrap().set_modified(past).unwrap();
    }
    let (before, times) = (names(&cache), mtimes(&paths));

    let o = kiln(&cache, &["compile", model.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["cache_hit"], true);
    let o = kiln(
        &cache,
        &["run", model.to_str().unwrap(), "--prompt", "hi", "--max-tokens", "2"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(names(&cache), before);
    assert_eq!(mtimes(&paths), times);
}

/// Runs `script` with `sh` in a new user and mount namespace (`unshare -rm`), with `$K` the kiln
/// binary and `$M` the llama fixture; panics with the reason if the namespace cannot be made.
fn in_namespace(script: &str, vars: &[(&str, &Path)]) -> Output {
    let probe = Command::new("unshare").args(["-rm", "true"]).output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!("unshare -rm fails here: {}", text(&o.stderr).trim()),
        Err(e) => panic!("unshare cannot run: {e}"),
    }
    let mut cmd = Command::new("unshare");
    cmd.args(["-rm", "sh", "-c", script])
        .env("K", KILN)
        .env("M", fixture("llama"))
        .env_remove("KILN_LINKER");
    for (name, path) in vars {
        cmd.env(name, path);
    }
    cmd.output().unwrap()
}

/// The reported failure, on a real full disk: with the cache on a tmpfs of every size from 2x to
/// 3x the library (where objects and library stop fitting), each compile either publishes a
/// library identical to one built with room to spare, or fails with one line naming the cache
/// folder and "no space left on device", leaving no entry and no staging folder.
#[test]
#[ignore = "needs unshare -rm (root, or unprivileged user namespaces) to mount a small tmpfs; run with --ignored"]
fn a_full_cache_file_system_never_publishes_a_bad_library() {
    let base = tempfile::tempdir().unwrap();
    let roomy = base.path().join("roomy");
    let o = kiln(&roomy, &["compile", fixture("llama").to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let reference: Value = serde_json::from_slice(&o.stdout).unwrap();
    let good = std::fs::read(reference["library"].as_str().unwrap()).unwrap();

    let (dir, listing) = (base.path().join("tiny"), base.path().join("listing"));
    std::fs::create_dir(&dir).unwrap();
    let kib = good.len() / 1024;
    let mut failures = 0;
    for size in (2 * kib..=3 * kib).step_by(4) {
        // The tmpfs exists only in the namespace: the library and the folder's names are copied
        // out before it goes.
        let script = format!(
            "mount -t tmpfs -o size={size}k tmpfs \"$D\" || exit 90\n\
             KILN_CACHE_DIR=\"$D\" \"$K\" compile \"$M\" --json; rc=$?\n\
             ls -a \"$D\" > \"$L\"; cp \"$D\"/*/libkiln.so \"$L.so\" 2>/dev/null; exit $rc"
        );
        let o = in_namespace(&script, &[("D", &dir), ("L", &listing)]);
        assert_ne!(o.status.code(), Some(90), "mount failed: {}", text(&o.stderr));
        let names = std::fs::read_to_string(&listing).unwrap();
        let library = listing.with_extension("so");
        if o.status.success() {
            assert_eq!(
                std::fs::read(&library).unwrap(),
                good,
                "{size} KiB: the published library"
            );
            std::fs::remove_file(&library).unwrap();
            continue;
        }
        failures += 1;
        let folder = dir.to_str().unwrap();
        let err = assert_one_error_line(&o, &[&format!("cache folder {folder} has no space left on device")]);
        eprintln!("{size} KiB: {err}");
        assert!(!library.exists(), "{size} KiB: no library published");
        for name in names.lines() {
            assert!(
                matches!(name, "." | "..") || name.ends_with(".lock"),
                "{size} KiB left {name}"
            );
        }
    }
    assert!(
        failures > 0,
        "no size between {} and {} KiB was too small",
        2 * kib,
        3 * kib
    );
}

/// The reported failure: a cache on a read-only mount serves what it holds (compile and run),
/// and a model it lacks fails with one line naming the folder and saying building needs it
/// writable.
#[test]
#[ignore = "needs unshare -rm (root, or unprivileged user namespaces) for a read-only bind mount; run with --ignored"]
fn a_read_only_cache_mount_serves_hits_and_refuses_builds() {
    let base = tempfile::tempdir().unwrap();
    let cache = base.path().join("cache");
    let o = kiln(&cache, &["compile", fixture("llama").to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let before = names(&cache);
    let read_only = "mount --bind \"$D\" \"$D\" && mount -o remount,bind,ro \"$D\" || exit 90\n\
                     touch \"$D/x\" 2>/dev/null && exit 91\n";
    let vars = [("D", cache.as_path()), ("Q", &fixture("qwen3"))];

    let o = in_namespace(
        &format!("{read_only}KILN_CACHE_DIR=\"$D\" exec \"$K\" compile \"$M\" --json"),
        &vars,
    );
    assert!(o.status.success(), "a hit: {}", text(&o.stderr));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["cache_hit"], true);

    let run = "KILN_CACHE_DIR=\"$D\" exec \"$K\" run \"$M\" --prompt hi --max-tokens 2";
    let o = in_namespace(&format!("{read_only}{run}"), &vars);
    assert!(o.status.success(), "a run from the hit: {}", text(&o.stderr));

    let o = in_namespace(
        &format!("{read_only}KILN_CACHE_DIR=\"$D\" exec \"$K\" compile \"$Q\""),
        &vars,
    );
    let expected = format!(
        "error: cache folder {} is not writable (Read-only file system",
        cache.display()
    );
    let err = assert_one_error_line(&o, &[&expected, "building it needs a writable cache folder"]);
    assert!(err.starts_with(&expected), "{err}");
    assert_eq!(names(&cache), before);
}
