//! Forward steps over several sequences at once: `kiln serve`'s continuous batching.
//!
//! A step runs one forward pass over the pending tokens of several sequences, each in its own
//! KV slot: one token of each sequence that is decoding and chunks of prompts being prefilled,
//! side by side in one block, so every weight is read once for all of them. Up to
//! `DECODE_ROWS` rows run the decode kernels, more the prefill kernels; both compute each row
//! with the same instructions, so a row's result never depends on the rows beside it. The
//! head then runs on the rows whose logits were asked for: gathered to the front of the block
//! and computed `DECODE_ROWS` at a time by the batched head, or, when only the block's last
//! row is wanted, by the one-row head reading it in place.

use super::{Engine, EngineError};
use kiln_core::graph::{self, RowInfo};

/// One sequence's share of an [`Engine::step`]: `tokens` continue `slot` from its position.
#[derive(Clone, Copy, Debug)]
pub struct StepPart<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
    /// The end of this sequence's current forward call: the whole prompt's end while a prompt
    /// is prefilled in parts, the position after the token when decoding (LongRoPE picks its
    /// table by it, as `transformers` does per call).
    pub seq_end: usize,
    /// Return the logits after the part's last token.
    pub logits: bool,
}

impl Engine {
    /// One decode step for several sequences at once: `(slot, token)` per row, each slot at
    /// most once. Returns the logits of each row, row after row (`steps.len() * vocab`
    /// values); a row's logits are bitwise those a step of its sequence alone gives.
    pub fn decode_batch(&mut self, steps: &[(usize, u32)]) -> Result<&[f32], EngineError> {
        let tokens: Vec<[u32; 1]> = steps.iter().map(|&(_, t)| [t]).collect();
        let parts: Vec<StepPart> = steps
            .iter()
            .zip(&tokens)
            .map(|(&(slot, _), t)| StepPart {
                slot,
                tokens: t,
                seq_end: self.positions.get(slot).map_or(0, |p| p + 1),
                logits: true,
            })
            .collect();
        let block = self.bufs.block_rows;
        if parts.len() <= block {
            return self.step(&parts);
        }
        let mut all = Vec::with_capacity(parts.len() * self.spec.dims.vocab_size);
        for chunk in parts.chunks(block) {
            all.extend_from_slice(self.step(chunk)?);
        }
        self.batch_logits = all;
        Ok(&self.batch_logits)
    }

    /// Runs every part's tokens as one forward pass (at most the prefill block's rows in all,
    /// each slot at most once) and returns the logits of the parts that asked for them, in
    /// order (`vocab` values each).
    pub fn step(&mut self, parts: &[StepPart]) -> Result<&[f32], EngineError> {
        let rows: usize = parts.iter().map(|p| p.tokens.len()).sum();
        if rows == 0 {
            return Err(EngineError::Empty);
        }
        if rows > self.bufs.block_rows {
            return Err(EngineError::StepTooLarge {
                rows,
                max: self.bufs.block_rows,
            });
        }
        for (i, p) in parts.iter().enumerate() {
            if !p.tokens.is_empty() {
                self.check(p.slot, p.tokens)?;
            }
            if parts[..i].iter().any(|q| q.slot == p.slot) {
                return Err(EngineError::DuplicateSlot { slot: p.slot });
            }
        }
        let mut tokens = Vec::with_capacity(rows);
        let mut info = Vec::with_capacity(rows);
        let mut wanted = Vec::new();
        for p in parts.iter().filter(|p| !p.tokens.is_empty()) {
            let pos = self.positions[p.slot];
            let seq_end = p.seq_end.max(pos + p.tokens.len());
            for (j, &t) in p.tokens.iter().enumerate() {
                tokens.push(t);
                info.push(RowInfo {
                    position: (pos + j) as u32,
                    slot: p.slot as u32,
                    seq_end: seq_end as u32,
                });
            }
            if p.logits {
                wanted.push(tokens.len() - 1);
            }
        }
        self.load_tokens(&tokens);
        self.write_rows(&info);
        let pos0 = info[0].position as usize;
        let decode = rows <= graph::DECODE_ROWS;
        self.run_block(decode, &tokens, pos0, !wanted.is_empty())?;
        for p in parts {
            self.positions[p.slot] += p.tokens.len();
        }
        self.heads(&wanted, rows, pos0, decode)
    }

    /// The head on rows `wanted` (ascending) of the block of `rows` rows just computed.
    fn heads(&mut self, wanted: &[usize], rows: usize, pos0: usize, decode: bool) -> Result<&[f32], EngineError> {
        let vocab = self.spec.dims.vocab_size;
        if wanted.is_empty() {
            return Ok(&[]);
        }
        if wanted == [rows - 1] {
            self.run_head(decode, pos0, rows)?;
            return Ok(self.logits());
        }
        if self.head_by_rows() {
            // The head streams in chunks: each wanted row through the one-row head.
            let mut all = Vec::with_capacity(wanted.len() * vocab);
            for &r in wanted {
                self.run_head(decode, pos0, r + 1)?;
                all.extend_from_slice(self.logits());
            }
            self.batch_logits = all;
            return Ok(&self.batch_logits);
        }
        let chunks = wanted.len().div_ceil(graph::DECODE_ROWS);
        let mut all = Vec::new();
        for chunk in wanted.chunks(graph::DECODE_ROWS) {
            // Row `chunk[j]` to row `j` of every buffer the head reads: `chunk[j] >= j`, and
            // earlier chunks only wrote rows below the rows later ones read.
            for (j, &r) in chunk.iter().enumerate() {
                if r != j {
                    for &b in &self.head_inputs {
                        let row = self.bufs.row_bytes(b);
                        self.bufs.get_mut(b).copy_within(r * row, j * row, row);
                    }
                }
            }
            let batch_head = self.batch_head.as_mut().expect("checked by head_by_rows");
            batch_head.run(&self.pool, chunk.len(), pos0, chunk.len());
            if chunks > 1 {
                all.extend_from_slice(self.bufs.get(self.std.logits).f32s(chunk.len() * vocab));
            }
        }
        if chunks == 1 {
            return Ok(self.bufs.get(self.std.logits).f32s(wanted.len() * vocab));
        }
        self.batch_logits = all;
        Ok(&self.batch_logits)
    }
}
