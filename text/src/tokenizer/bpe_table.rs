//! A BPE model in flat tables: what the `tokenizers` crate's `BPE` does, built in a fraction
//! of the time.
//!
//! The crate's model keeps its vocabulary as a hash map of owned strings, its reverse as a
//! second one, and its merges as a map built by looking up every merge's three strings in the
//! first: for a 151k-token vocabulary (Qwen, Llama 3) about 0.1 s of a warm start whose other
//! parts take a few milliseconds. Here all token texts share one byte buffer; the vocabulary
//! is an open-addressing index of entries into it and an id-indexed array; the merges are an
//! open-addressing table keyed by the pair of ids. Nothing is allocated per token.
//!
//! Encoding follows `tokenizers::models::bpe::BPE` step for step (`merge_word`, `merge_all`,
//! `word_to_tokens`, `ignore_merges`, byte fallback, unknown tokens fused or not), so ids
//! and offsets are the same; it serialises to the same JSON (`tests::fast_reader_builds_the
//! _same_tokenizer` compares the two). A configuration it does not implement (dropout above
//! zero, a non-empty continuing-subword prefix or end-of-word suffix; empty ones, as Qwen's
//! file has, change nothing) or a vocabulary it could not
//! round-trip (two texts with one id) is declined by [`TableBuilder::finish`], and the caller
//! uses the crate's model.

use serde::ser::{Serialize, SerializeMap, SerializeStruct, Serializer};
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap};
use std::path::{Path, PathBuf};
use tokenizers::Token;

/// The options of a BPE model section, as `tokenizer.json` names them.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct BpeOptions {
    pub dropout: Option<f32>,
    pub unk_token: Option<String>,
    pub continuing_subword_prefix: Option<String>,
    pub end_of_word_suffix: Option<String>,
    pub fuse_unk: Option<bool>,
    pub byte_fallback: Option<bool>,
    pub ignore_merges: Option<bool>,
}

/// One vocabulary text: `len` bytes at `start` of [`BpeTable::text`], and its id.
#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) start: u32,
    pub(super) len: u32,
    pub(super) id: u32,
}

/// One merge: the pair of ids, its rank (its index in the merge list) and the id of the
/// merged text. `rank == u32::MAX` marks an empty slot.
#[derive(Clone, Copy)]
pub(super) struct MergeSlot {
    pub(super) left: u32,
    pub(super) right: u32,
    pub(super) rank: u32,
    pub(super) new_id: u32,
}

const EMPTY_MERGE: MergeSlot = MergeSlot {
    left: 0,
    right: 0,
    rank: u32::MAX,
    new_id: 0,
};
pub(super) const NO_ENTRY: u32 = u32::MAX;

/// The BPE model; see the module documentation.
#[derive(Clone)]
pub struct BpeTable {
    pub(super) text: Vec<u8>,
    pub(super) entries: Vec<Entry>,
    /// Open addressing on the text hash: entry index + 1, 0 for an empty slot.
    pub(super) slots: Vec<u32>,
    /// Entry index of each id, [`NO_ENTRY`] for a hole.
    pub(super) by_id: Vec<u32>,
    pub(super) merges: Vec<MergeSlot>,
    /// The id of `<0xXX>` for each byte, for byte fallback.
    byte_ids: Vec<Option<u32>>,
    pub(super) options: BpeOptions,
}

/// A hash of a token text; the index is taken from its high bits.
fn text_hash(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = (bytes.len() as u64).wrapping_mul(K);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let word = u64::from_le_bytes(c.try_into().expect("an 8-byte chunk"));
        h = (h.rotate_left(23) ^ word).wrapping_mul(K);
    }
    let mut tail = [0u8; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    h = (h.rotate_left(23) ^ u64::from_le_bytes(tail)).wrapping_mul(K);
    h ^ (h >> 29)
}

fn pair_hash(left: u32, right: u32) -> u64 {
    ((u64::from(left) << 32) | u64::from(right)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A power-of-two table size holding `n` items at most two thirds full.
fn table_size(n: usize) -> usize {
    (n.max(4) * 3 / 2).next_power_of_two()
}

impl BpeTable {
    /// The table of these parts (checked by the caller), with its byte-fallback ids.
    pub(super) fn from_tables(
        text: Vec<u8>,
        entries: Vec<Entry>,
        slots: Vec<u32>,
        by_id: Vec<u32>,
        merges: Vec<MergeSlot>,
        options: BpeOptions,
    ) -> BpeTable {
        let mut table = BpeTable {
            text,
            entries,
            slots,
            by_id,
            merges,
            byte_ids: Vec::new(),
            options,
        };
        table.byte_ids = (0..=255u8)
            .map(|b| table.id_of(format!("<{b:#04X}>").as_bytes()))
            .collect();
        table
    }

    fn entry_text(&self, e: Entry) -> &str {
        // Every entry was appended from a `&str`, or checked when read from a file.
        std::str::from_utf8(self.entry_bytes(e)).unwrap_or_default()
    }

    fn entry_bytes(&self, e: Entry) -> &[u8] {
        let end = e.start as usize + e.len as usize;
        self.text.get(e.start as usize..end).unwrap_or_default()
    }

    /// The entry index of `text`, if it is in the vocabulary.
    fn find(&self, text: &[u8]) -> Option<usize> {
        let (mask, shift) = (self.slots.len() - 1, 64 - self.slots.len().trailing_zeros());
        let mut i = (text_hash(text) >> shift) as usize;
        loop {
            let slot = self.slots[i];
            if slot == 0 {
                return None;
            }
            let e = self.entries[slot as usize - 1];
            if self.entry_bytes(e) == text {
                return Some(slot as usize - 1);
            }
            i = (i + 1) & mask;
        }
    }

    fn id_of(&self, text: &[u8]) -> Option<u32> {
        self.find(text).map(|e| self.entries[e].id)
    }

    fn text_of(&self, id: u32) -> Option<&str> {
        let e = *self.by_id.get(id as usize)?;
        (e != NO_ENTRY).then(|| self.entry_text(self.entries[e as usize]))
    }

    /// The rank and merged id of the pair `(left, right)`.
    fn merge_of(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        let mask = self.merges.len() - 1;
        let shift = 64 - self.merges.len().trailing_zeros();
        let mut i = (pair_hash(left, right) >> shift) as usize;
        loop {
            let m = self.merges[i];
            if m.rank == u32::MAX {
                return None;
            }
            if m.left == left && m.right == right {
                return Some((m.rank, m.new_id));
            }
            i = (i + 1) & mask;
        }
    }

    /// The merges by rank, as the crate serialises them.
    fn merges_by_rank(&self) -> Vec<MergeSlot> {
        let mut merges: Vec<MergeSlot> = self.merges.iter().copied().filter(|m| m.rank != u32::MAX).collect();
        merges.sort_unstable_by_key(|m| m.rank);
        merges
    }

    fn unk_id(&self, unk: &str) -> tokenizers::Result<u32> {
        self.id_of(unk.as_bytes())
            .ok_or_else(|| format!("Unk token `{unk}` not found in the vocabulary").into())
    }

    /// The symbols of one pre-token before merging: `(id, byte length)` per character, with
    /// byte fallback and unknown tokens as the crate's `merge_word` does them.
    fn initial_symbols(&self, word: &str) -> tokenizers::Result<Vec<(u32, usize)>> {
        let mut symbols = Vec::with_capacity(word.len());
        let mut unk: Option<(u32, usize)> = None;
        for (i, c) in word.char_indices() {
            let s = &word.as_bytes()[i..i + c.len_utf8()];
            if let Some(id) = self.id_of(s) {
                if let Some(u) = unk.take() {
                    symbols.push(u);
                }
                symbols.push((id, s.len()));
                continue;
            }
            if self.options.byte_fallback == Some(true) {
                let bytes: Option<Vec<u32>> = s.iter().map(|&b| self.byte_ids[b as usize]).collect();
                if let Some(bytes) = bytes {
                    symbols.extend(bytes.into_iter().map(|id| (id, 1)));
                    continue;
                }
            }
            if let Some(unk_token) = &self.options.unk_token {
                unk = match (unk, self.options.fuse_unk == Some(true)) {
                    (Some((id, len)), true) => Some((id, len + s.len())),
                    (Some(previous), false) => {
                        symbols.push(previous);
                        Some((self.unk_id(unk_token)?, s.len()))
                    }
                    (None, _) => Some((self.unk_id(unk_token)?, s.len())),
                };
            }
        }
        symbols.extend(unk);
        Ok(symbols)
    }
}

/// A symbol of a word being merged, linked to its neighbours (the crate's `Symbol`).
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    len: usize,
}

const NONE: usize = usize::MAX;

/// A candidate merge at `pos`; the heap pops the lowest rank, then the leftmost position.
#[derive(PartialEq, Eq)]
struct Candidate {
    rank: u32,
    pos: usize,
    new_id: u32,
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.rank, self.pos).cmp(&(other.rank, other.pos))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl BpeTable {
    /// Applies the merges to `symbols` lowest rank first (the crate's `Word::merge_all`).
    fn merge_all(&self, symbols: &mut Vec<Symbol>) {
        let mut queue: BinaryHeap<Reverse<Candidate>> = BinaryHeap::with_capacity(symbols.len());
        let candidate = |pos: usize, left: u32, right: u32| {
            self.merge_of(left, right)
                .map(|(rank, new_id)| Reverse(Candidate { rank, pos, new_id }))
        };
        queue.extend(
            symbols
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| candidate(i, w[0].id, w[1].id)),
        );
        while let Some(Reverse(top)) = queue.pop() {
            let here = symbols[top.pos];
            if here.len == 0 || here.next == NONE {
                continue;
            }
            let right = symbols[here.next];
            // An entry made stale by an earlier merge no longer names this pair's result.
            if self.merge_of(here.id, right.id).is_none_or(|(_, id)| id != top.new_id) {
                continue;
            }
            let merged = Symbol {
                id: top.new_id,
                prev: here.prev,
                next: right.next,
                len: here.len + right.len,
            };
            symbols[top.pos] = merged;
            symbols[here.next].len = 0;
            if merged.next != NONE {
                symbols[merged.next].prev = top.pos;
            }
            if merged.prev != NONE {
                queue.extend(candidate(merged.prev, symbols[merged.prev].id, merged.id));
            }
            if merged.next != NONE {
                queue.extend(candidate(top.pos, merged.id, symbols[merged.next].id));
            }
        }
        symbols.retain(|s| s.len != 0);
    }
}

impl tokenizers::Model for BpeTable {
    type Trainer = tokenizers::models::TrainerWrapper;

    fn tokenize(&self, sequence: &str) -> tokenizers::Result<Vec<Token>> {
        if sequence.is_empty() {
            return Ok(Vec::new());
        }
        if self.options.ignore_merges == Some(true)
            && let Some(id) = self.id_of(sequence.as_bytes())
        {
            return Ok(vec![Token::new(id, sequence.to_string(), (0, sequence.len()))]);
        }
        let initial = self.initial_symbols(sequence)?;
        let last = initial.len().saturating_sub(1);
        let mut symbols: Vec<Symbol> = initial
            .into_iter()
            .enumerate()
            .map(|(i, (id, len))| Symbol {
                id,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i == last { NONE } else { i + 1 },
                len,
            })
            .collect();
        self.merge_all(&mut symbols);
        let mut start = 0;
        let mut tokens = Vec::with_capacity(symbols.len());
        for s in symbols {
            let text = self.text_of(s.id).unwrap_or_default().to_string();
            tokens.push(Token::new(s.id, text, (start, start + s.len)));
            start += s.len;
        }
        Ok(tokens)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.id_of(token.as_bytes())
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.text_of(id).map(str::to_string)
    }

    fn get_vocab(&self) -> HashMap<String, u32> {
        self.entries
            .iter()
            .map(|&e| (self.entry_text(e).to_string(), e.id))
            .collect()
    }

    fn get_vocab_size(&self) -> usize {
        self.entries.len()
    }

    /// Writes `vocab.json` and `merges.txt`, as the crate's BPE does.
    fn save(&self, folder: &Path, prefix: Option<&str>) -> tokenizers::Result<Vec<PathBuf>> {
        let name = |file: &str| folder.join(prefix.map_or(file.to_string(), |p| format!("{p}-{file}")));
        let vocab_path = name("vocab.json");
        std::fs::write(&vocab_path, serde_json::to_string(&OrderedVocab(self))?)?;
        let mut lines = String::from("#version: 0.2\n");
        for m in self.merges_by_rank() {
            let (a, b) = (self.text_of(m.left), self.text_of(m.right));
            lines.push_str(&format!("{} {}\n", a.unwrap_or_default(), b.unwrap_or_default()));
        }
        let merges_path = name("merges.txt");
        std::fs::write(&merges_path, lines)?;
        Ok(vec![vocab_path, merges_path])
    }

    fn get_trainer(&self) -> Self::Trainer {
        tokenizers::models::TrainerWrapper::BpeTrainer(Default::default())
    }
}

/// The vocabulary as a JSON object in id order (the crate's `OrderedVocabIter`).
struct OrderedVocab<'a>(&'a BpeTable);

impl Serialize for OrderedVocab<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let t = self.0;
        let mut map = s.serialize_map(None)?;
        for id in 0..t.by_id.len() as u32 {
            if let Some(text) = t.text_of(id) {
                map.serialize_entry(text, &id)?;
            }
        }
        map.end()
    }
}

/// The same JSON as the crate's `BPE`: options first, then vocabulary and merges.
impl Serialize for BpeTable {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let o = &self.options;
        let mut model = s.serialize_struct("BPE", 8)?;
        model.serialize_field("type", "BPE")?;
        model.serialize_field("dropout", &o.dropout)?;
        model.serialize_field("unk_token", &o.unk_token)?;
        model.serialize_field("continuing_subword_prefix", &o.continuing_subword_prefix)?;
        model.serialize_field("end_of_word_suffix", &o.end_of_word_suffix)?;
        model.serialize_field("fuse_unk", &o.fuse_unk.unwrap_or(false))?;
        model.serialize_field("byte_fallback", &o.byte_fallback.unwrap_or(false))?;
        model.serialize_field("ignore_merges", &o.ignore_merges.unwrap_or(false))?;
        let merges: Vec<(&str, &str)> = self
            .merges_by_rank()
            .into_iter()
            .map(|m| {
                (
                    self.text_of(m.left).unwrap_or_default(),
                    self.text_of(m.right).unwrap_or_default(),
                )
            })
            .collect();
        model.serialize_field("vocab", &OrderedVocab(self))?;
        model.serialize_field("merges", &merges)?;
        model.end()
    }
}

/// Collects a vocabulary and merge list (in any order) and builds a [`BpeTable`].
#[derive(Default)]
pub struct TableBuilder {
    text: Vec<u8>,
    entries: Vec<Entry>,
    slots: Vec<u32>,
    /// Merge texts, `a` then `b`, and the (end of a, end of b) offsets of each merge.
    merge_text: Vec<u8>,
    merge_ends: Vec<(u32, u32)>,
    pub has_vocab: bool,
    pub has_merges: bool,
}

impl TableBuilder {
    /// A builder sized for about `tokens` vocabulary entries and `merges` merges.
    pub fn with_capacity(tokens: usize, merges: usize) -> Self {
        let size = table_size(tokens);
        TableBuilder {
            text: Vec::with_capacity(tokens * 8),
            entries: Vec::with_capacity(tokens),
            slots: vec![0; size],
            merge_text: Vec::with_capacity(merges * 10),
            merge_ends: Vec::with_capacity(merges),
            ..Default::default()
        }
    }

    /// Adds `text` with `id`; a text already there takes the new id (as a JSON object read
    /// into a map does).
    pub fn add_token(&mut self, text: &str, id: u32) {
        if 3 * (self.entries.len() + 1) > 2 * self.slots.len() {
            self.grow();
        }
        let bytes = text.as_bytes();
        let (mask, shift) = (self.slots.len() - 1, 64 - self.slots.len().trailing_zeros());
        let mut i = (text_hash(bytes) >> shift) as usize;
        loop {
            let slot = self.slots[i];
            if slot == 0 {
                self.entries.push(Entry {
                    start: self.text.len() as u32,
                    len: bytes.len() as u32,
                    id,
                });
                self.text.extend_from_slice(bytes);
                self.slots[i] = self.entries.len() as u32;
                return;
            }
            let e = &mut self.entries[slot as usize - 1];
            if &self.text[e.start as usize..(e.start + e.len) as usize] == bytes {
                e.id = id;
                return;
            }
            i = (i + 1) & mask;
        }
    }

    /// Doubles the index and re-inserts every entry.
    fn grow(&mut self) {
        let size = (2 * self.slots.len()).max(8);
        let shift = 64 - size.trailing_zeros();
        let mut slots = vec![0u32; size];
        for (n, e) in self.entries.iter().enumerate() {
            let bytes = &self.text[e.start as usize..(e.start + e.len) as usize];
            let mut i = (text_hash(bytes) >> shift) as usize;
            while slots[i] != 0 {
                i = (i + 1) & (size - 1);
            }
            slots[i] = n as u32 + 1;
        }
        self.slots = slots;
    }

    /// Adds the next merge, `a` + `b`.
    pub fn add_merge(&mut self, a: &str, b: &str) {
        self.merge_text.extend_from_slice(a.as_bytes());
        let end_a = self.merge_text.len() as u32;
        self.merge_text.extend_from_slice(b.as_bytes());
        self.merge_ends.push((end_a, self.merge_text.len() as u32));
    }

    /// The table, or `None` where the crate's model must be used instead (see the module
    /// documentation) or would refuse the input (a merge naming a text not in the
    /// vocabulary), so that the caller's fallback gives the crate's own error.
    pub fn finish(self, options: BpeOptions) -> Option<BpeTable> {
        let unsupported = options.dropout.is_some_and(|p| p != 0.0)
            || options
                .continuing_subword_prefix
                .as_ref()
                .is_some_and(|p| !p.is_empty())
            || options.end_of_word_suffix.as_ref().is_some_and(|s| !s.is_empty());
        if unsupported || self.text.len() > u32::MAX as usize / 2 {
            return None;
        }
        let max_id = self.entries.iter().map(|e| e.id).max().map_or(0, |m| m as usize + 1);
        let mut by_id = vec![NO_ENTRY; max_id];
        for (n, e) in self.entries.iter().enumerate() {
            if by_id[e.id as usize] != NO_ENTRY {
                return None;
            }
            by_id[e.id as usize] = n as u32;
        }
        let size = table_size(self.merge_ends.len());
        let slots = if self.slots.is_empty() { vec![0; 8] } else { self.slots };
        let mut table = BpeTable::from_tables(self.text, self.entries, slots, by_id, vec![EMPTY_MERGE; size], options);
        let mut joined = Vec::new();
        let mut start = 0usize;
        for (rank, &(end_a, end_b)) in self.merge_ends.iter().enumerate() {
            let (a, b) = (
                &self.merge_text[start..end_a as usize],
                &self.merge_text[end_a as usize..end_b as usize],
            );
            start = end_b as usize;
            joined.clear();
            joined.extend_from_slice(a);
            joined.extend_from_slice(b);
            let ids = (table.id_of(a)?, table.id_of(b)?, table.id_of(&joined)?);
            table.insert_merge(ids.0, ids.1, rank as u32, ids.2);
        }
        Some(table)
    }
}

impl BpeTable {
    /// Inserts a merge; a pair already there takes the later rank (as the crate's map does).
    fn insert_merge(&mut self, left: u32, right: u32, rank: u32, new_id: u32) {
        let mask = self.merges.len() - 1;
        let shift = 64 - self.merges.len().trailing_zeros();
        let mut i = (pair_hash(left, right) >> shift) as usize;
        loop {
            let m = &mut self.merges[i];
            if m.rank == u32::MAX || (m.left == left && m.right == right) {
                *m = MergeSlot {
                    left,
                    right,
                    rank,
                    new_id,
                };
                return;
            }
            i = (i + 1) & mask;
        }
    }
}
