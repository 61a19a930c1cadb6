//! `--precision bf16`: matmuls and the fused gate/up over bf16 weights round each activation
//! to bf16 and sum pairs of products with `vdpbf16ps`. Checked against an f64 reference over
//! the bf16-rounded activations, and decode against prefill bit for bit (the same chain per
//! output). Runs only where the host has AVX512-BF16.

use super::{Rng, TestLib, assert_close, ptr, weights};
use kiln_core::dequant::{bf16_to_f32, f32_to_bf16};
use kiln_core::{Act, CompileOptions, DType, HostCpu, Kernel, Precision};

const N: usize = 40;
const K: usize = 96;
const ROWS: usize = 10;

fn matmul(max_rows: usize) -> Kernel {
    Kernel::MatMul {
        n: N,
        k: K,
        wdtype: DType::BF16,
        bias: None,
        accumulate: false,
        norm: None,
        act: None,
        softcap: None,
        max_rows,
    }
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
    let (prefill, decode) = (matmul(ROWS), matmul(kiln_core::kernel::DECODE_ROWS));
    let lib = TestLib::build(&[prefill.clone(), decode.clone()], &options, None);
    let mut rng = Rng(0xbf16);
    let mut x = rng.vec(ROWS * K);
    let (mut wb, wv) = weights(&mut rng, N * K, DType::BF16);
    let mut y_prefill = vec![0f32; ROWS * N];
    lib.call(&prefill, &[ptr(&mut x), ptr(&mut wb), ptr(&mut y_prefill)], ROWS, 2);
    let xr = rounded(&x);
    let want: Vec<f64> = (0..ROWS)
        .flat_map(|r| {
            let (xr, wv) = (&xr, &wv);
            (0..N).map(move |j| (0..K).map(|i| xr[r * K + i] * wv[j * K + i] as f64).sum())
        })
        .collect();
    assert_close(&y_prefill, &want, 1e-5, "bf16 pairs prefill");
    // Exact f32 products would differ: the activations really are rounded.
    let exact: f64 = (0..K).map(|i| x[i] as f64 * wv[i] as f64).sum();
    assert!(
        (exact - y_prefill[0] as f64).abs() > 1e-7,
        "activations were not rounded"
    );
    // Decode, one row at a time and in batches, gives prefill's bits.
    for rows in [1, 3, 8] {
        for r0 in (0..ROWS - rows + 1).step_by(rows) {
            let mut xs = x[r0 * K..(r0 + rows) * K].to_vec();
            xs.resize(kiln_core::kernel::DECODE_ROWS * K, 0.0);
            let mut y = vec![0f32; kiln_core::kernel::DECODE_ROWS * N];
            lib.call(&decode, &[ptr(&mut xs), ptr(&mut wb), ptr(&mut y)], rows, 2);
            assert_eq!(
                &y[..rows * N],
                &y_prefill[r0 * N..(r0 + rows) * N],
                "decode of {rows} rows at {r0}"
            );
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
