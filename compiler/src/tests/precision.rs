//! `--precision bf16`: matmuls and the fused gate/up over bf16 weights round each activation
//! to bf16 and sum pairs of products with `vdpbf16ps`. Checked against an f64 reference over
//! the bf16-rounded activations, and decode against prefill bit for bit (the same quad-order
//! chains per output), over shapes that reach each edge of the packed prefill: `n` not a
//! multiple of a vector's 4 outputs nor of a 16-output block, `k` split into panel chunks
//! (accumulators parked between them), a partial row tile. Runs only where the host has
//! AVX512-BF16.

use super::{Rng, TestLib, assert_close, ptr, weights};
use kiln_core::dequant::{bf16_to_f32, f32_to_bf16};
use kiln_core::{Act, CompileOptions, DType, HostCpu, Kernel, Precision};

const N: usize = 40;
const K: usize = 96;
const ROWS: usize = 10;
/// (n, k) of the matmul checks: the gate/up shape; a `k` of three panel chunks (2048 with 16
/// outputs per block); fewer outputs than one block.
const SHAPES: [(usize, usize); 3] = [(N, K), (29, 4160), (7, 64)];
/// A prefill block long enough that its rows rounded to bf16 (`HEAP_ROWS x 4160 x 2` bytes)
/// pass the stack's share and go to the heap: the same numbers.
const HEAP_ROWS: usize = 520;

fn matmul(max_rows: usize) -> Kernel {
    matmul_nk(N, K, max_rows)
}

fn matmul_nk(n: usize, k: usize, max_rows: usize) -> Kernel {
    super::plain_matmul(n, k, DType::BF16, max_rows, false)
}

fn bf16_options() -> CompileOptions {
    CompileOptions {
        precision: Precision::Bf16,
        ..CompileOptions::new(ROWS, 16)
    }
}

fn host_has_bf16() -> bool {
    let host = HostCpu::detect();
    host.features.iter().any(|f| f == "avx512_bf16") && host.f32_lanes() >= 16
}

fn rounded(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| bf16_to_f32(f32_to_bf16(v)) as f64).collect()
}

#[test]
fn bf16_pairs_match_the_rounded_reference_and_decode_equals_prefill() {
    if !host_has_bf16() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    let options = bf16_options();
    let decode_rows = kiln_core::kernel::DECODE_ROWS;
    let kernels: Vec<Kernel> = SHAPES
        .iter()
        .flat_map(|&(n, k)| [matmul_nk(n, k, ROWS), matmul_nk(n, k, decode_rows)])
        .chain([matmul_nk(SHAPES[1].0, SHAPES[1].1, HEAP_ROWS)])
        .collect();
    let lib = TestLib::build(&kernels, &options, None);
    let mut rng = Rng(0xbf16);
    for (n, k) in SHAPES {
        let (prefill, decode) = (matmul_nk(n, k, ROWS), matmul_nk(n, k, decode_rows));
        let mut x = rng.vec(ROWS * k);
        let (mut wb, wv) = weights(&mut rng, n * k, DType::BF16);
        let mut y_prefill = vec![0f32; ROWS * n];
        lib.call(&prefill, &[ptr(&mut x), ptr(&mut wb), ptr(&mut y_prefill)], ROWS, 2);
        let xr = rounded(&x);
        let want: Vec<f64> = (0..ROWS)
            .flat_map(|r| {
                let (xr, wv) = (&xr, &wv);
                (0..n).map(move |j| (0..k).map(|i| xr[r * k + i] * wv[j * k + i] as f64).sum())
            })
            .collect();
        // f32 sums of `k / 8` pairs per phase: rounding grows with `k`.
        let tol = 1e-5 * (k as f64 / 96.0).sqrt();
        assert_close(&y_prefill, &want, tol, &format!("bf16 pairs prefill, n {n} k {k}"));
        // Exact f32 products would differ: the activations really are rounded.
        let exact: f64 = (0..k).map(|i| x[i] as f64 * wv[i] as f64).sum();
        assert!(
            (exact - y_prefill[0] as f64).abs() > 1e-7,
            "n {n} k {k}: activations were not rounded"
        );
        if (n, k) == SHAPES[1] {
            let mut xs = x.clone();
            xs.resize(HEAP_ROWS * k, 0.0);
            let mut y = vec![0f32; HEAP_ROWS * n];
            let long = matmul_nk(n, k, HEAP_ROWS);
            lib.call(&long, &[ptr(&mut xs), ptr(&mut wb), ptr(&mut y)], ROWS, 2);
            assert_eq!(&y[..ROWS * n], &y_prefill[..], "n {n} k {k}: rounded rows on the heap");
        }
        // Decode, one row at a time and in batches, gives prefill's bits.
        for rows in [1, 3, 8] {
            for r0 in (0..ROWS - rows + 1).step_by(rows) {
                let mut xs = x[r0 * k..(r0 + rows) * k].to_vec();
                xs.resize(decode_rows * k, 0.0);
                let mut y = vec![0f32; decode_rows * n];
                lib.call(&decode, &[ptr(&mut xs), ptr(&mut wb), ptr(&mut y)], rows, 2);
                assert_eq!(
                    &y[..rows * n],
                    &y_prefill[r0 * n..(r0 + rows) * n],
                    "n {n} k {k}: decode of {rows} rows at {r0}"
                );
            }
        }
    }
}

#[test]
fn gate_up_in_bf16_pairs_equals_the_two_matmuls() {
    if !host_has_bf16() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    let options = bf16_options();
    let gate_up = Kernel::GateUp {
        n: N,
        k: K,
        gate_dtype: DType::BF16,
        up_dtype: DType::BF16,
        norm: None,
        act: Act::Silu,
        max_rows: 1,
        grouped: false,
        paired: false,
    };
    let lib = TestLib::build(&[gate_up.clone(), matmul(1)], &options, None);
    let mut rng = Rng(0x6a7e);
    let mut x = rng.vec(K);
    let (mut wg, _) = weights(&mut rng, N * K, DType::BF16);
    let (mut wu, _) = weights(&mut rng, N * K, DType::BF16);
    let (mut g, mut u) = (vec![0f32; N], vec![0f32; N]);
    lib.call(
        &gate_up,
        &[ptr(&mut x), ptr(&mut wg), ptr(&mut g), ptr(&mut wu), ptr(&mut u)],
        1,
        2,
    );
    let (mut g0, mut u0) = (vec![0f32; N], vec![0f32; N]);
    lib.call(&matmul(1), &[ptr(&mut x), ptr(&mut wg), ptr(&mut g0)], 1, 2);
    lib.call(&matmul(1), &[ptr(&mut x), ptr(&mut wu), ptr(&mut u0)], 1, 2);
    assert_eq!(u, u0, "up projection");
    // The gate holds act(gate) * up.
    for i in 0..N {
        let silu = g0[i] / (1.0 + (-g0[i]).exp());
        assert!(
            (g[i] - silu * u0[i]).abs() <= 1e-5 * (1.0 + g[i].abs()),
            "gate {i}: {} vs {}",
            g[i],
            silu * u0[i]
        );
    }
}
