//! `--precision q8` matmul tiles: quantised weight rows against activation rows rounded to 8
//! bits (`quant8.rs`), for decode and prefill alike.

use super::MatMul;
use super::decode::{Tile, prefetch_blocks};
use crate::emit::quant8::{Acts, CodeBlock, GROUP};
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;

/// f32 lanes of the accumulators: one per i32 sum of `vpmaddwd`.
const LANES: usize = 8;

/// Weight rows a one-row decode walks together (one accumulator each): four over the
/// 32-element formats, two over the k-quants, whose 256-element blocks keep more state per row
/// (`quant_speed`, one thread, x86-64-v3 code, 2-core Zen 5, Gweights/s, 4 → 2 rows: q6_k
/// 28.4 → 32.9, q4_k 36.1 → 36.5, q5_k 29.6 → 30.8; q4_0 35.2 → 30.6, q8_0 37.7 → 36.6).
pub(super) fn q8_cols(dtype: DType) -> usize {
    if let Some(r) = super::exp_var("KILN_EXP_ROWS") {
        return r;
    }
    if dtype.block_elems() == 32 { 4 } else { 2 }
}

/// Blocks per loop step: enough that a step reads a cache line of each weight row (one
/// prefetch per line instead of several per line for the 18- to 34-byte blocks).
fn blocks_per_step(dtype: DType, blocks: usize) -> usize {
    [4, 2, 1]
        .into_iter()
        .find(|&u| (u - 1) * dtype.block_bytes() < 64 && blocks.is_multiple_of(u))
        .unwrap_or(1)
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// The tile's outputs: for each block of each weight row (in address order, prefetched as
    /// exact decode prefetches), its offset terms, then group by group its codes, folded into
    /// every activation row of the tile as `fma(Σ c·q, D·d, acc)`.
    pub(super) fn q8_rows(&self, b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, t: Tile<'c, '_>, acts: &Acts<'c, '_>) {
        let blocks = self.k / dtype.block_elems();
        let unroll = blocks_per_step(dtype, blocks);
        let (rows, cols, inits) = t.start(b, LANES, t.ncols);
        let ncols = t.ncols;
        let row_bytes = dtype.bytes_for(self.k);
        let span = unroll * dtype.block_bytes();
        let (zero, hi, step) = (b.idx(0), b.idx(blocks), b.idx(unroll));
        let acc = b.for_range(zero, hi, step, &inits, |b, kb, acc| {
            let mut acc = acc;
            prefetch_blocks(
                b,
                w,
                &cols,
                b.muli(kb, b.idx(dtype.block_bytes())),
                span,
                row_bytes,
                t.end,
            );
            for u in 0..unroll {
                let blk = b.addi(kb, b.idx(u));
                for (c, &col) in cols.iter().enumerate() {
                    let mut block = CodeBlock::new(b, w, dtype, col, blk);
                    let groups = block.groups();
                    for (i, &r) in rows.iter().enumerate() {
                        acc[i * ncols + c] = block.offset_terms(acc[i * ncols + c], acts, r, blk);
                    }
                    // One row: its `D·d` for the whole block in one multiply. Several: per group,
                    // so that no row's products stay live across the block.
                    let one_row = (rows.len() == 1).then(|| block.row_scales(acts, rows[0], blk));
                    for g in 0..groups {
                        let codes = block.codes(g);
                        let ag = b.addi(b.muli(blk, b.idx(groups)), b.idx(g));
                        let k0 = b.muli(ag, b.idx(GROUP));
                        // One row: the group's `D·d`, made. Several: its `D`, times each row's `d`.
                        let scale = match one_row {
                            Some(s) => block.pick(s, g),
                            None => block.group_scale(g),
                        };
                        for (i, &r) in rows.iter().enumerate() {
                            let q = b.load_bytes(acts.q, &[r, k0], GROUP);
                            let sums = b.sitofp(block.dot(codes, q, acts.vnni));
                            let dd = match one_row {
                                Some(_) => scale,
                                None => b.mulf(scale, b.broadcast(b.load_f32(acts.d, &[r, ag], 1), LANES)),
                            };
                            acc[i * ncols + c] = b.fma(sums, dd, acc[i * ncols + c]);
                        }
                    }
                }
            }
            acc
        });
        self.finish_tile(b, &acc, &rows, &cols);
    }
}
