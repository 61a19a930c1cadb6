//! Built BPE tables kept on disk, so that a warm start reads a tokenizer instead of building
//! it: for Qwen's 151k-token `tokenizer.json` the build (parse, index, resolve 151k merges)
//! takes ~70 ms of a start that is otherwise ~0.1 s; reading the table back takes a few.
//!
//! An entry is one file, `<folder>/<key>.bpe` (the CLI's folder is `<cache root>/tokenizers`,
//! emptied by `kiln cache clean --all`), written to a temporary name and
//! renamed into place (a reader never sees half a file). The key is a SHA-256 of the table
//! format's version, the source file's canonical path, size, modification time and inode, and
//! a caller's salt, and of the source code of the table, its reader and this module: editing
//! or replacing the source, or a Kiln whose tables differ, gives a new key. The file holds the
//! tokenizer's other sections (as JSON), the model's options and the tables, and ends with a
//! checksum of everything before it. A file that is short, altered, or from another format
//! version is ignored and rewritten; every index read from it is range-checked before use
//! ([`read`]), so no file content can make a lookup panic or loop.

use serde_json::Value;
use sha2::{Digest, Sha256};
use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::bpe_table::{BpeOptions, BpeTable, Entry, MergeSlot, NO_ENTRY};

const MAGIC: &[u8; 8] = b"KILNBPE\0";
/// Bump when the layout or the meaning of any table changes.
const FORMAT_VERSION: u32 = 1;

/// A folder of table files.
#[derive(Clone, Debug)]
pub struct TableCache {
    dir: PathBuf,
}

/// What a table file holds besides the table: the tokenizer's other top-level sections.
pub type Rest = Vec<(String, Value)>;

impl TableCache {
    /// The table files in `dir` (created when the first one is written).
    pub fn in_folder(dir: impl Into<PathBuf>) -> TableCache {
        TableCache { dir: dir.into() }
    }

    /// The entry path for `source` (the file the tokenizer is read from) and `salt`; `None`
    /// when `source` cannot be stated.
    pub fn entry(&self, source: &Path, salt: &str) -> Option<PathBuf> {
        let canonical = fs::canonicalize(source).ok()?;
        let meta = fs::metadata(&canonical).ok()?;
        let mut h = Sha256::new();
        h.update(FORMAT_VERSION.to_le_bytes());
        h.update(canonical.as_os_str().as_encoded_bytes());
        h.update([0]);
        for n in [
            meta.len(),
            meta.mtime() as u64,
            meta.mtime_nsec() as u64,
            meta.ino(),
            meta.dev(),
        ] {
            h.update(n.to_le_bytes());
        }
        h.update(salt.as_bytes());
        // The code that builds and stores tables: a change to it retires every entry.
        for source in [
            include_str!("bpe_table.rs"),
            include_str!("fast.rs"),
            include_str!("table_cache.rs"),
        ] {
            h.update(source.as_bytes());
        }
        let key: String = h.finalize()[..16].iter().map(|b| format!("{b:02x}")).collect();
        Some(self.dir.join(format!("{key}.bpe")))
    }
}

/// The table and other sections stored at `path`, `None` if absent or not a valid entry.
pub fn load(path: &Path) -> Option<(BpeTable, Rest)> {
    read(&fs::read(path).ok()?)
}

/// Writes the entry; failures are ignored (the cache only saves time), leaving no file.
pub fn store(path: &Path, table: &BpeTable, rest: &Rest) {
    let Some(dir) = path.parent() else { return };
    let Ok(bytes) = write(table, rest) else { return };
    let tmp = dir.join(format!(".{}.{}.tmp", std::process::id(), unique()));
    let written = fs::create_dir_all(dir).is_ok()
        && fs::File::create(&tmp).and_then(|mut f| f.write_all(&bytes)).is_ok()
        && fs::rename(&tmp, path).is_ok();
    if !written {
        let _ = fs::remove_file(&tmp);
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// A 64-bit checksum of `bytes` (not cryptographic: it catches damage, not tampering). Four
/// independent lanes, so that a 9 MB file takes well under a millisecond.
fn checksum(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mix = |h: u64, w: u64| {
        let h = (h ^ w).wrapping_mul(K);
        h ^ (h >> 31)
    };
    let mut lanes = [K, K ^ 1, K ^ 2, K ^ 3];
    let mut blocks = bytes.chunks_exact(32);
    for b in &mut blocks {
        for (lane, w) in lanes.iter_mut().zip(b.chunks_exact(8)) {
            *lane = mix(*lane, u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
    }
    let mut h = lanes.iter().fold(bytes.len() as u64, |h, &lane| mix(h, lane));
    for &b in blocks.remainder() {
        h = mix(h, u64::from(b));
    }
    h
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// A count of records, then each record's words.
fn put_records<const W: usize>(out: &mut Vec<u8>, records: impl ExactSizeIterator<Item = [u32; W]>) {
    out.extend_from_slice(&(records.len() as u64).to_le_bytes());
    for r in records {
        for w in r {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
}

/// The file's bytes.
fn write(t: &BpeTable, rest: &Rest) -> serde_json::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(t.text.len() + 4 * (3 * t.entries.len() + t.slots.len() + t.by_id.len()));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    put_bytes(&mut out, &serde_json::to_vec(rest)?);
    put_bytes(&mut out, &serde_json::to_vec(&t.options)?);
    put_bytes(&mut out, &t.text);
    put_records(&mut out, t.entries.iter().map(|e| [e.start, e.len, e.id]));
    put_records(&mut out, t.slots.iter().map(|&s| [s]));
    put_records(&mut out, t.by_id.iter().map(|&e| [e]));
    put_records(&mut out, t.merges.iter().map(|m| [m.left, m.right, m.rank, m.new_id]));
    let sum = checksum(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    Ok(out)
}

/// Reads sections in order from a file's bytes.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }

    fn len(&mut self) -> Option<usize> {
        usize::try_from(u64::from_le_bytes(self.take(8)?.try_into().ok()?)).ok()
    }

    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.len()?;
        self.take(n)
    }

    /// A section of `width`-word records, each made into a `T` by `make`.
    fn records<T, const W: usize>(&mut self, make: impl Fn([u32; W]) -> T) -> Option<Vec<T>> {
        let n = self.len()?;
        let bytes = self.take(n.checked_mul(4 * W)?)?;
        Some(
            bytes
                .chunks_exact(4 * W)
                .map(|c| {
                    make(std::array::from_fn(|i| {
                        u32::from_le_bytes(c[4 * i..4 * i + 4].try_into().expect("4 bytes"))
                    }))
                })
                .collect(),
        )
    }
}

/// The table and sections of a file's bytes, `None` unless every check holds: magic, version,
/// checksum, sizes, and every index in range, with at least one empty slot in each index.
fn read(file: &[u8]) -> Option<(BpeTable, Rest)> {
    let (body, sum) = file.split_at_checked(file.len().checked_sub(8)?)?;
    if checksum(body) != u64::from_le_bytes(sum.try_into().ok()?) {
        return None;
    }
    let mut r = Reader(body);
    if r.take(8)? != MAGIC || r.take(4)? != FORMAT_VERSION.to_le_bytes() {
        return None;
    }
    let rest: Rest = serde_json::from_slice(r.bytes()?).ok()?;
    let options: BpeOptions = serde_json::from_slice(r.bytes()?).ok()?;
    let text = String::from_utf8(r.bytes()?.to_vec()).ok()?.into_bytes();
    let entries = r.records(|[start, len, id]| Entry { start, len, id })?;
    let slots = r.records(|[s]| s)?;
    let by_id = r.records(|[e]| e)?;
    let merges = r.records(|[left, right, rank, new_id]| MergeSlot {
        left,
        right,
        rank,
        new_id,
    })?;
    if !r.0.is_empty() {
        return None;
    }
    let n = entries.len();
    // The text is UTF-8 as a whole, so an entry is UTF-8 when it starts and ends on
    // character boundaries.
    let in_text = |e: &Entry| {
        let (start, end) = (e.start as usize, e.start as usize + e.len as usize);
        end <= text.len() && is_boundary(&text, start) && is_boundary(&text, end)
    };
    let valid = entries.iter().all(|e| in_text(e) && by_id.get(e.id as usize).is_some())
        && slots.len().is_power_of_two()
        && slots.iter().all(|&s| s as usize <= n)
        && slots.iter().filter(|&&s| s != 0).count() == n
        && n < slots.len()
        && by_id.iter().all(|&e| e == NO_ENTRY || (e as usize) < n)
        && merges.len().is_power_of_two()
        && merges.iter().any(|m| m.rank == u32::MAX);
    valid.then(|| {
        (
            BpeTable::from_tables(text, entries, slots, by_id, merges, options),
            rest,
        )
    })
}

/// Whether byte `i` of the UTF-8 `text` starts a character (or is its end).
fn is_boundary(text: &[u8], i: usize) -> bool {
    text.get(i).is_none_or(|&b| (b as i8) >= -0x40)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::bpe_table::TableBuilder;
    use tokenizers::Model;

    fn table() -> BpeTable {
        let mut b = TableBuilder::with_capacity(4, 2);
        for (i, t) in ["a", "b", "ab", "é", "abé"].iter().enumerate() {
            b.add_token(t, i as u32);
        }
        b.add_merge("a", "b");
        b.add_merge("ab", "é");
        b.finish(BpeOptions::default()).unwrap()
    }

    /// A written entry reads back as the same table and sections.
    #[test]
    fn an_entry_round_trips() {
        let rest: Rest = vec![("decoder".into(), serde_json::json!({"type": "ByteLevel"}))];
        let bytes = write(&table(), &rest).unwrap();
        let (back, rest_back) = read(&bytes).unwrap();
        assert_eq!(rest_back, rest);
        assert_eq!(
            serde_json::to_string(&back).unwrap(),
            serde_json::to_string(&table()).unwrap()
        );
        let ids: Vec<u32> = back.tokenize("abéa").unwrap().iter().map(|t| t.id).collect();
        assert_eq!(ids, [4, 0]);
    }

    /// Every single-byte change, every truncation and a wrong version are rejected, never
    /// read as another table (nor a panic).
    #[test]
    fn damaged_entries_are_rejected() {
        let bytes = write(&table(), &Vec::new()).unwrap();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(read(&bad).is_none(), "byte {i} flipped");
            assert!(read(&bytes[..i]).is_none(), "cut at {i}");
        }
        let mut other_version = bytes[..bytes.len() - 8].to_vec();
        other_version[8] += 1;
        let sum = checksum(&other_version);
        other_version.extend_from_slice(&sum.to_le_bytes());
        assert!(read(&other_version).is_none());
    }

    /// The key changes with the source's content (its size or time) and with the salt.
    #[test]
    fn the_key_follows_the_source_and_salt() {
        let dir = std::env::temp_dir().join(format!("kiln-table-key-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let src = dir.join("tokenizer.json");
        fs::write(&src, "{}").unwrap();
        let cache = TableCache::in_folder(dir.join("tables"));
        let first = cache.entry(&src, "").unwrap();
        assert_eq!(cache.entry(&src, "").unwrap(), first);
        assert_ne!(cache.entry(&src, "gguf").unwrap(), first);
        fs::write(&src, "{ }").unwrap();
        assert_ne!(cache.entry(&src, "").unwrap(), first);
        store(&first, &table(), &Vec::new());
        assert!(load(&first).is_some());
        let leftovers = fs::read_dir(first.parent().unwrap()).unwrap().count();
        assert_eq!(leftovers, 1, "only the entry, no temporary file");
        fs::remove_dir_all(&dir).unwrap();
    }
}
