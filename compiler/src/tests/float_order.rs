//! Float-weight matmuls (quad order for bf16 and f16, `emit/matmul/quad.rs`; the dot-product
//! form for f32): every output of a prefill call is
//! bit for bit the output decode computes for that row, alone or in a batched step, for every
//! float weight type and vector width, with shapes that exercise each edge of the emitted
//! code: `n` neither a multiple of a vector's outputs nor of a prefill block (padded rows),
//! `k` long enough to be split into chunks (accumulators parked between them), row counts
//! that leave a partial row tile; and every output within rounding of an f64 reference.

use super::{Rng, TestLib, assert_close, ptr, weights};
use kiln_core::{CompileOptions, DType, HostCpu, Kernel};
use std::sync::OnceLock;

/// Prefill rows per block: one full 4-row tile and more, and a remainder.
const ROWS: usize = 13;
/// (n, k): `n % 4 != 0` and `n` past one prefill block (16 outputs with AVX-512); `k` of
/// several weight-panel chunks; short, narrow cases; `k` a multiple of the vector but not of
/// two (bf16 rows then transpose after widening, not before).
const SHAPES: [(usize, usize); 5] = [(29, 4160), (5, 96), (52, 1024), (7, 80), (9, 48)];
const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn widths() -> Vec<usize> {
    let host = HostCpu::detect().f32_lanes();
    [16, 8, 4].into_iter().filter(|&l| l <= host).collect()
}

fn matmul(n: usize, k: usize, wdtype: DType, max_rows: usize) -> Kernel {
    Kernel::MatMul {
        n,
        k,
        wdtype,
        bias: Some(DType::F32),
        accumulate: true,
        norm: None,
        act: None,
        softcap: None,
        max_rows,
        grouped: false,
        paired: false,
    }
}

fn suite() -> Vec<Kernel> {
    let mut ks = Vec::new();
    for (n, k) in SHAPES {
        for dt in DTYPES {
            ks.push(matmul(n, k, dt, ROWS));
            ks.push(matmul(n, k, dt, kiln_core::graph::DECODE_ROWS));
        }
    }
    ks
}

fn lib(lanes: usize) -> &'static TestLib {
    static LIBS: [OnceLock<TestLib>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = [16, 8, 4].iter().position(|&l| l == lanes).expect("a tested width");
    LIBS[slot].get_or_init(|| TestLib::build(&suite(), &CompileOptions::new(ROWS, lanes), None))
}

#[test]
fn float_matmuls_decode_equals_prefill_bit_for_bit() {
    let decode_rows = kiln_core::graph::DECODE_ROWS;
    for lanes in widths() {
        let lib = lib(lanes);
        let mut rng = Rng(0xf10a7 + lanes as u64);
        for (n, k) in SHAPES {
            for dt in DTYPES {
                let what = format!("{dt} n {n} k {k}, {lanes} lanes");
                let mut x = rng.vec(ROWS * k);
                let (mut w, wv) = weights(&mut rng, n * k, dt);
                let (mut bias, bv) = weights(&mut rng, n, DType::F32);
                let y0 = rng.vec(ROWS * n);
                let mut y = y0.clone();
                let pre = matmul(n, k, dt, ROWS);
                lib.call(&pre, &[ptr(&mut x), ptr(&mut w), ptr(&mut y), ptr(&mut bias)], ROWS, 2);
                let want: Vec<f64> = (0..ROWS * n)
                    .map(|i| {
                        let (r, j) = (i / n, i % n);
                        let dot: f64 = (0..k).map(|c| x[r * k + c] as f64 * wv[j * k + c] as f64).sum();
                        y0[i] as f64 + dot + bv[j] as f64
                    })
                    .collect();
                // f32 sums of `k / 4` products per phase: rounding grows with `k`.
                assert_close(&y, &want, 1e-5 * (k as f64 / 640.0).max(1.0), &what);
                let dec = matmul(n, k, dt, decode_rows);
                // One row at a time, then batched steps of 5 rows (a 4-row tile and one more).
                for (r0, m) in (0..ROWS).map(|r| (r, 1)).chain([(0, 5), (5, 5)]) {
                    let mut xr = x[r0 * k..(r0 + m) * k].to_vec();
                    xr.resize(decode_rows * k, 0.0);
                    let mut yr = y0[r0 * n..(r0 + m) * n].to_vec();
                    yr.resize(decode_rows * n, 0.0);
                    lib.call(&dec, &[ptr(&mut xr), ptr(&mut w), ptr(&mut yr), ptr(&mut bias)], m, 3);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&yr[..m * n]),
                        bits(&y[r0 * n..(r0 + m) * n]),
                        "{what}: decode of rows {r0}..{} = prefill",
                        r0 + m
                    );
                }
            }
        }
    }
}
