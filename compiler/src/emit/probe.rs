//! Machine probes, emitted by the same compiler as the model kernels so that the ceilings they
//! measure are the ones Kiln's own code can reach: sequential read bandwidth (how decode streams
//! weights) and register-resident FMA throughput (what bounds prefill).

use super::{Dyn, thread_range};
use crate::ir::Kb;
use kiln_core::Kernel;
use melior::ir::Value;

/// Independent accumulators in the read loop: enough loads in flight to cover memory latency.
const READ_STREAMS: usize = 8;

pub fn emit_probe_read<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, lanes: usize) {
    let Kernel::ProbeRead { elems } = kernel else {
        unreachable!()
    };
    let (buf, sums) = (p[0], p[1]);
    let step = lanes * READ_STREAMS;
    let total = b.idx(elems / step * step);
    let (start, end) = thread_range(b, total, d, step);
    let inits: Vec<Value> = (0..READ_STREAMS).map(|_| b.zero_like(lanes)).collect();
    let step_c = b.idx(step);
    let acc = b.for_range(start, end, step_c, &inits, |b, i, acc| {
        (0..READ_STREAMS)
            .map(|s| {
                let v = b.load_f32(buf, &[b.addi(i, b.idx(s * lanes))], lanes);
                b.addf_fast(acc[s], v)
            })
            .collect()
    });
    let mut sum = acc[0];
    for &a in &acc[1..] {
        sum = b.addf_fast(sum, a);
    }
    store_checksum(b, sums, d.tid, sum, lanes);
}

pub fn emit_probe_fma<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, lanes: usize) {
    let Kernel::ProbeFma { chains } = kernel else {
        unreachable!()
    };
    let sums = p[0];
    // Values chosen so the chains neither overflow nor collapse to a constant the optimiser
    // could fold: x <- x * 0.999 + 0.001 converges towards 1.
    let a = b.f32_splat(0.999, lanes);
    let c = b.f32_splat(0.001, lanes);
    let inits: Vec<Value> = (0..*chains).map(|i| b.f32_splat(i as f32 * 0.01, lanes)).collect();
    let (lo, one) = (b.idx(0), b.idx(1));
    let acc = b.for_range(lo, d.rows, one, &inits, |b, _, acc| {
        acc.iter().map(|&x| b.fma(x, a, c)).collect()
    });
    let mut sum = acc[0];
    for &x in &acc[1..] {
        sum = b.addf_fast(sum, x);
    }
    store_checksum(b, sums, d.tid, sum, lanes);
}

/// Writes a result vector to `sums[tid, 0..lanes]` so the loop cannot be removed.
fn store_checksum<'c>(b: Kb<'c, '_>, sums: Value<'c, '_>, tid: Value<'c, '_>, v: Value<'c, '_>, lanes: usize) {
    let slot = b.minui(tid, b.idx(63));
    let zero = b.idx(0);
    debug_assert!(lanes <= 16);
    b.store(v, sums, &[slot, zero]);
}
