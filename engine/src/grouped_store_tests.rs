//! The grouped copy kept in the cache: used only while it is exactly the copy of these weights,
//! rebuilt otherwise, and never a reason for a run to fail.

use super::*;
use crate::grouped::GroupedWeights;
use crate::grouped::tests::grouped_spec;
use kiln_core::grouped::pack;
use std::sync::Arc;

/// Weights in memory that say which files they come from.
struct FromFiles {
    bytes: Vec<Vec<u8>>,
    origin: Option<(String, String)>,
}

impl WeightSource for FromFiles {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        Ok(self.bytes[id.0 as usize].as_ptr())
    }
    fn origin(&self) -> Option<(String, String)> {
        self.origin.clone()
    }
}

fn source(spec: &ModelSpec, seed: usize, state: &str) -> Arc<FromFiles> {
    let bytes = spec
        .weights
        .iter()
        .enumerate()
        .map(|(w, t)| (0..t.bytes()).map(|i| (i * 31 + w * 7 + seed) as u8).collect())
        .collect();
    Arc::new(FromFiles {
        bytes,
        origin: Some(("/models/m/model.safetensors\n".into(), state.into())),
    })
}

/// A fresh folder under the system's temporary one.
fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-grouped-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Opens `source` through the store in `dir`: (mapped from the cache, notes, including the
/// background write's); checks every grouped tensor holds the packed bytes of `source`'s.
fn open(spec: &ModelSpec, source: &Arc<FromFiles>, dir: &Path) -> (bool, Vec<String>) {
    let w = GroupedWeights::wrap(spec, source.clone(), 2, Some(dir)).expect("wrapped");
    for (id, t) in spec.weight_ids() {
        let Some(order) = t.row_groups else { continue };
        let original = &source.bytes[id.0 as usize];
        let mut want = vec![0u8; original.len()];
        pack(order, &[original], &mut want, t.row_bytes() / 2);
        let got = crate::grouped::tests::own_groups(w.weights.weight_ptr(id).expect("a pointer"), t);
        assert_eq!(got, want, "{}", t.name);
    }
    // The copy is written in the background: wait for it, as the engine does when dropped.
    let mut notes = w.notes;
    notes.extend(w.writing.and_then(|pending| pending.wait()));
    (w.from_cache, notes)
}

fn stored_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

/// The first start packs and keeps the copy (one file, no temporary left); the next maps it.
#[test]
fn the_first_start_keeps_the_copy_and_the_next_maps_it() {
    let spec = grouped_spec();
    let dir = folder("keep");
    let src = source(&spec, 0, "1 2 3");
    assert_eq!(open(&spec, &src, &dir), (false, vec![]));
    let files = stored_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(files[0].extension().unwrap(), "grp");
    let layout = Layout::of(&spec);
    assert_eq!(
        std::fs::metadata(&files[0]).unwrap().len(),
        (DATA_START + layout.len) as u64
    );
    assert_eq!(open(&spec, &src, &dir), (true, vec![]));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A changed file (new size, time or inode) replaces the copy under the same name; a copy
/// made for another state of the files is never read.
#[test]
fn a_changed_source_rebuilds_the_copy_in_place() {
    let spec = grouped_spec();
    let dir = folder("changed");
    assert!(!open(&spec, &source(&spec, 0, "1 2 3"), &dir).0);
    let name = stored_files(&dir);
    // New bytes, as a rewritten file holds them (`open` checks every tensor).
    assert!(!open(&spec, &source(&spec, 5, "1 2 4"), &dir).0, "new state");
    assert!(open(&spec, &source(&spec, 5, "1 2 4"), &dir).0);
    assert_eq!(stored_files(&dir), name, "replaced, not added");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A truncated copy, or one whose header names other weights, is rebuilt, not mapped.
#[test]
fn a_damaged_copy_is_rebuilt() {
    let spec = grouped_spec();
    let dir = folder("damaged");
    let src = source(&spec, 0, "7");
    open(&spec, &src, &dir);
    let file = stored_files(&dir).remove(0);
    let full = std::fs::metadata(&file).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(full - 4096).unwrap();
    assert!(!open(&spec, &src, &dir).0, "truncated");
    assert!(open(&spec, &src, &dir).0, "rewritten whole");
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.write_all_at(&[0xff; 4], 20).unwrap();
    assert!(!open(&spec, &src, &dir).0, "another digest");
    assert!(open(&spec, &src, &dir).0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A folder that cannot be written (a file stands in its place) costs a note, not the run;
/// a source with no origin is never stored.
#[test]
fn an_unwritable_folder_or_an_unknown_origin_keeps_nothing() {
    let spec = grouped_spec();
    let dir = folder("unwritable");
    std::fs::write(&dir, b"not a folder").unwrap();
    let (mapped, notes) = open(&spec, &source(&spec, 0, "1"), &dir);
    assert!(!mapped);
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].contains("not kept in the cache"), "{notes:?}");
    std::fs::remove_file(&dir).unwrap();
    let dir = folder("unknown");
    let mut anonymous = source(&spec, 0, "1");
    Arc::get_mut(&mut anonymous).unwrap().origin = None;
    assert_eq!(open(&spec, &anonymous, &dir), (false, vec![]));
    assert!(!dir.exists());
}

/// A temporary copy left by a process that no longer runs is removed by the next write; one
/// of a running process (pid 1, always there) is left alone.
#[test]
fn abandoned_temporary_copies_are_removed() {
    let spec = grouped_spec();
    let dir = folder("abandoned");
    let src = source(&spec, 0, "1");
    open(&spec, &src, &dir);
    let stored = stored_files(&dir).remove(0);
    // No process has pid u32::MAX - 1 (Linux pids stay below 2^22).
    let dead = stored.with_extension(format!("tmp-{}", u32::MAX - 1));
    let alive = stored.with_extension("tmp-1");
    std::fs::write(&dead, b"half a copy").unwrap();
    std::fs::write(&alive, b"being written").unwrap();
    // A changed source writes again.
    assert!(!open(&spec, &source(&spec, 1, "2"), &dir).0);
    assert!(!dead.exists(), "abandoned copy removed");
    assert!(alive.exists(), "a running writer's copy kept");
    assert!(stored.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Weights that say they come from the real file at `path` (as the loaders' sources do).
fn source_of_file(spec: &ModelSpec, seed: usize, path: &Path) -> Arc<FromFiles> {
    let mut s = source(spec, seed, "");
    let file = File::open(path).unwrap();
    Arc::get_mut(&mut s).unwrap().origin = crate::origin::of_files([(path, &file)]);
    s
}

/// A write removes the copies whose weight files were changed or removed since, and keeps
/// those of models still there; `stale_copies` names the same files beforehand.
#[test]
fn copies_of_gone_or_changed_files_are_removed_by_the_next_write() {
    let spec = grouped_spec();
    let dir = folder("stale");
    let models = folder("stale-models");
    std::fs::create_dir_all(&models).unwrap();
    let file = |name: &str, bytes: &[u8]| {
        let path = models.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let (a, b, c) = (file("a", b"a"), file("b", b"b"), file("c", b"c"));
    open(&spec, &source_of_file(&spec, 0, &a), &dir);
    open(&spec, &source_of_file(&spec, 1, &b), &dir);
    let both = stored_files(&dir);
    assert_eq!(both.len(), 2, "two models, two copies");
    assert!(stale_copies(&dir).is_empty(), "both models unchanged");
    std::fs::write(&a, b"a, rewritten").unwrap();
    let a_copy: Vec<PathBuf> = stale_copies(&dir).into_iter().map(|(p, _)| p).collect();
    assert_eq!(a_copy.len(), 1);
    assert!(
        open(&spec, &source_of_file(&spec, 1, &b), &dir).0,
        "b's copy still serves"
    );
    assert!(a_copy[0].exists(), "mapping a copy writes nothing, so removes nothing");
    open(&spec, &source_of_file(&spec, 2, &c), &dir);
    assert!(!a_copy[0].exists(), "the next write removed a's copy");
    assert_eq!(stored_files(&dir).len(), 2, "b's and c's copies kept");
    std::fs::remove_file(&b).unwrap();
    assert_eq!(stale_copies(&dir).len(), 1, "b is gone");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&models).unwrap();
}

/// Files in the folder that are not copies, and copies in an older format, are stale; a copy
/// in a newer format belongs to the build that wrote it; other files are not looked at.
#[test]
fn foreign_files_and_older_formats_are_stale_newer_formats_are_not() {
    let dir = folder("formats");
    std::fs::create_dir_all(&dir).unwrap();
    let with_version = |v: u32| {
        let mut h = MAGIC.to_vec();
        h.extend_from_slice(&v.to_le_bytes());
        h.resize(FIXED_HEADER, 0);
        h
    };
    std::fs::write(dir.join("garbage.grp"), b"not a copy").unwrap();
    std::fs::write(dir.join("old.grp"), with_version(VERSION - 1)).unwrap();
    std::fs::write(dir.join("new.grp"), with_version(VERSION + 1)).unwrap();
    std::fs::write(dir.join("notes.txt"), b"kept").unwrap();
    let mut stale: Vec<String> = stale_copies(&dir)
        .into_iter()
        .map(|(p, _)| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    stale.sort();
    assert_eq!(stale, ["garbage.grp", "old.grp"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A write that fails after it began (here its folder vanished: the rename fails; a full disk
/// fails the same way) reports the copy's path and leaves no temporary file behind.
#[test]
fn a_write_that_fails_after_it_began_reports_and_leaves_nothing() {
    let spec = grouped_spec();
    let dir = folder("vanished");
    let layout = Layout::of(&spec);
    let src = source(&spec, 0, "1");
    let store = Store::locate(&dir, &spec, &layout, src.as_ref()).expect("an origin");
    let writer = store.begin(layout.len).expect("begun").expect("a writable folder");
    assert_eq!(stored_files(&dir).len(), 1, "the temporary file");
    std::fs::remove_dir_all(&dir).unwrap();
    let err = writer
        .finish(&vec![0u8; layout.len])
        .expect_err("no folder to rename into");
    assert!(err.contains(".grp"), "{err}");
    assert!(!dir.exists());
}
