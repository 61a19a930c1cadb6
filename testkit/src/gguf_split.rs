//! Splits a GGUF file the way llama.cpp's `gguf-split --split` does, for tests of split-model
//! loading and download: part `i` of `n` is a complete GGUF file holding a run of the tensors
//! (data padded to 32 bytes, offsets relative to its own data section); the first part keeps
//! all the metadata, every part gets `split.no` (u16, from 0), `split.count` (u16) and
//! `split.tensors.count` (i32, the total), appended after the other keys. With `empty_first`
//! the first part holds metadata only (`--no-tensor-first-split`).
//!
//! Self-contained (no Kiln parser): the metadata are copied as raw bytes, only walked to find
//! their end. Files with a `general.alignment` other than 32 are not supported.

/// The names llama.cpp gives the parts: `prefix-00001-of-00003.gguf`, ...
pub fn part_names(prefix: &str, count: usize) -> Vec<String> {
    (1..=count)
        .map(|i| format!("{prefix}-{i:05}-of-{count:05}.gguf"))
        .collect()
}

/// `bytes` (a whole GGUF file) split into parts of at most `tensors_per_part` tensors.
pub fn split_gguf(bytes: &[u8], tensors_per_part: usize, empty_first: bool) -> Vec<Vec<u8>> {
    let mut r = Cursor { b: bytes, pos: 0 };
    assert_eq!(r.take(4), b"GGUF", "not a GGUF file");
    let version = r.u32();
    let n_tensors = r.u64() as usize;
    let n_kv = r.u64();
    let kv_start = r.pos;
    for _ in 0..n_kv {
        let key = r.string();
        let ty = r.u32();
        if key == "general.alignment" {
            assert_eq!((ty, r.u32()), (4, 32), "only 32-byte alignment is supported");
        } else {
            r.skip_value(ty);
        }
    }
    let kvs = &bytes[kv_start..r.pos];
    let mut tensors = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string();
        let dims: Vec<u64> = (0..r.u32()).map(|_| r.u64()).collect();
        let ty = r.u32();
        let offset = r.u64() as usize;
        tensors.push(Tensor { name, dims, ty, offset });
    }
    let data_start = r.pos.next_multiple_of(32);
    // Each tensor's bytes, padded: up to the next tensor's data (or the end of the file).
    let mut starts: Vec<usize> = tensors.iter().map(|t| t.offset).collect();
    starts.sort_unstable();
    let data_len = bytes.len() - data_start;
    let padded = |offset: usize| {
        let next = starts.iter().find(|&&s| s > offset).copied().unwrap_or(data_len);
        (next - offset).next_multiple_of(32)
    };

    let mut groups: Vec<&[Tensor]> = tensors.chunks(tensors_per_part.max(1)).collect();
    if empty_first {
        groups.insert(0, &[]);
    }
    let count = groups.len();
    let mut parts = Vec::with_capacity(count);
    for (no, group) in groups.into_iter().enumerate() {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(version.to_le_bytes());
        out.extend((group.len() as u64).to_le_bytes());
        let own_kvs = if no == 0 { n_kv } else { 0 };
        out.extend((own_kvs + 3).to_le_bytes());
        if no == 0 {
            out.extend(kvs);
        }
        kv(&mut out, "split.no", 2, &(no as u16).to_le_bytes());
        kv(&mut out, "split.count", 2, &(count as u16).to_le_bytes());
        kv(&mut out, "split.tensors.count", 5, &(n_tensors as i32).to_le_bytes());
        let mut offset = 0usize;
        let mut data = Vec::new();
        for t in group {
            string(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            let len = padded(t.offset);
            let from = data_start + t.offset;
            let avail = (bytes.len() - from).min(len);
            data.extend(&bytes[from..from + avail]);
            data.resize(data.len() + len - avail, 0);
            offset += len;
        }
        out.resize(out.len().next_multiple_of(32), 0);
        out.extend(data);
        parts.push(out);
    }
    parts
}

/// One tensor-table entry of the source file.
struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    /// Offset in the source's data section.
    offset: usize,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn kv(out: &mut Vec<u8>, key: &str, ty: u32, value: &[u8]) {
    string(out, key);
    out.extend(ty.to_le_bytes());
    out.extend(value);
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        s
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }

    fn string(&mut self) -> String {
        let n = self.u64() as usize;
        String::from_utf8(self.take(n).to_vec()).unwrap()
    }

    /// Skips one metadata value of GGUF type `ty`.
    fn skip_value(&mut self, ty: u32) {
        match ty {
            0 | 1 | 7 => self.pos += 1,
            2 | 3 => self.pos += 2,
            4..=6 => self.pos += 4,
            10..=12 => self.pos += 8,
            8 => {
                self.string();
            }
            9 => {
                let elem = self.u32();
                for _ in 0..self.u64() {
                    self.skip_value(elem);
                }
            }
            _ => panic!("unknown GGUF value type {ty}"),
        }
    }
}
