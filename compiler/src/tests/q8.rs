//! `--precision q8`: matmuls over GGML block weights with the activations rounded to 8 bits
//! with one scale per 32 elements, or per 256 for the k-quants (`emit/quant8.rs`). Checked
//! against an f64 reference that rounds the activations by the mode's rule independently
//! (`q = round_ties_even(x · 127 / max|x|)`, value `q · max|x| / 127`, over each span) and
//! multiplies them by the reference-dequantised weights; decode, a batched decode step and
//! prefill agree bit for bit; the fused gate/up equals the two matmuls, also where its two
//! formats round the activations with different spans.

use super::quant::{assert_bits, random_blocks, reference, widths};
use super::{Rng, TestLib, ptr};
use kiln_core::kernel::DECODE_ROWS;
use kiln_core::{Act, CompileOptions, DType, Kernel, Precision};

const ROWS: usize = 12;

const FORMATS: [DType; 10] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
];

fn options(lanes: usize) -> CompileOptions {
    CompileOptions {
        precision: Precision::Q8,
        ..CompileOptions::new(ROWS, lanes)
    }
}

fn matmul(dtype: DType, n: usize, k: usize, bias: bool, accumulate: bool, max_rows: usize) -> Kernel {
    Kernel::MatMul {
        n,
        k,
        wdtype: dtype,
        bias: bias.then_some(DType::F32),
        accumulate,
        norm: None,
        act: None,
        softcap: None,
        max_rows,
        grouped: false,
        paired: false,
    }
}

/// `(n, k, bias, accumulate)`: 3 and 8 blocks of the 32-element formats (a step of one and of
/// several blocks), 2 and 3 super-blocks of the k-quants; n leaves remainders of every tile.
fn shapes(dtype: DType) -> [(usize, usize, bool, bool); 2] {
    if dtype.block_elems() == 32 {
        [(20, 96, true, false), (13, 256, false, true)]
    } else {
        [(20, 512, true, false), (13, 768, false, true)]
    }
}

/// Activation elements sharing one scale over `dtype`'s weights: a k-quant's 256-element
/// super-block, else 32 (stated here from the format, apart from the emitter's `span`).
fn span(dtype: DType) -> usize {
    match dtype {
        DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => 256,
        _ => 32,
    }
}

/// The mode's rounding of one row, written independently of the emitter: per `span` elements,
/// the f32 scale `max|x| / 127` and codes rounded to nearest even; returns the rounded values.
fn rounded_row(x: &[f32], span: usize) -> Vec<f64> {
    x.chunks_exact(span)
        .flat_map(|g| {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            g.iter()
                .map(move |&v| (v * inv).round_ties_even() as f64 * d as f64)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `Σ w·â` in f64 per output, with an error scale: a few f32 roundings of the terms' sizes,
/// where a term's size allows for the code and offset parts the kernel sums separately (each
/// as large as the largest weight of its 16-element window).
fn reference_rows(x: &[f32], w: &[f32], rows: usize, n: usize, k: usize, span: usize) -> Vec<(f64, f64)> {
    let window: Vec<f64> = w
        .chunks_exact(16)
        .map(|c| c.iter().fold(0f64, |m, v| m.max(v.abs() as f64)))
        .collect();
    (0..rows)
        .flat_map(|r| {
            let xr = rounded_row(&x[r * k..(r + 1) * k], span);
            let window = &window;
            (0..n).map(move |j| {
                let (mut s, mut mag) = (0.0, 0.0);
                for c in 0..k {
                    let wv = w[j * k + c] as f64;
                    s += wv * xr[c];
                    mag += (wv.abs() + 2.0 * window[(j * k + c) / 16]) * xr[c].abs();
                }
                (s, 8.0 * f32::EPSILON as f64 * mag + 1e-30)
            })
        })
        .collect()
}

#[test]
fn q8_matmuls_match_the_rounded_reference_and_decode_equals_prefill() {
    for lanes in widths().into_iter().filter(|&l| l >= 8) {
        let mut kernels = Vec::new();
        for dtype in FORMATS {
            for (n, k, bias, acc) in shapes(dtype) {
                for max_rows in [ROWS, DECODE_ROWS, 1] {
                    kernels.push(matmul(dtype, n, k, bias, acc, max_rows));
                }
            }
        }
        let lib = TestLib::build(&kernels, &options(lanes), None);
        let mut rng = Rng(0x9800 + lanes as u64);
        for dtype in FORMATS {
            for (n, k, bias, accumulate) in shapes(dtype) {
                let what = format!("{dtype} n{n} k{k}, {lanes} lanes");
                let mut w = random_blocks(&mut rng, dtype, n * k / dtype.block_elems(), false);
                let wv = reference(dtype, &w);
                let mut bv = rng.vec(n);
                // An all-zero span (scale 0, codes 0), and one whose first group alone is zero.
                let span = span(dtype);
                let mut x = rng.vec(ROWS * k);
                x[..span].fill(0.0);
                x[k..k + 32].fill(0.0);
                let y0 = rng.vec(ROWS * n);
                let want = reference_rows(&x, &wv, ROWS, n, k, span);
                let mut y = y0.clone();
                let mut ptrs = vec![ptr(&mut x), w.as_mut_ptr(), ptr(&mut y)];
                if bias {
                    ptrs.push(ptr(&mut bv));
                }
                lib.call(&matmul(dtype, n, k, bias, accumulate, ROWS), &ptrs, ROWS, 2);
                for (i, (&g, &(s, tol))) in y.iter().zip(&want).enumerate() {
                    let extra = if bias { bv[i % n] as f64 } else { 0.0 } + if accumulate { y0[i] as f64 } else { 0.0 };
                    let err = (g as f64 - (s + extra)).abs();
                    let tol = tol + 2.0 * f32::EPSILON as f64 * (s.abs() + extra.abs());
                    assert!(
                        err <= tol,
                        "{what} prefill [{i}]: got {g}, want {} (|err| {err:e} > {tol:e})",
                        s + extra
                    );
                }
                // Decode one row at a time, and a batched step, bit for bit as prefill.
                for r in 0..ROWS {
                    let mut xr = x[r * k..(r + 1) * k].to_vec();
                    let mut yr = y0[r * n..(r + 1) * n].to_vec();
                    let mut ptrs = vec![ptr(&mut xr), w.as_mut_ptr(), ptr(&mut yr)];
                    if bias {
                        ptrs.push(ptr(&mut bv));
                    }
                    lib.call(&matmul(dtype, n, k, bias, accumulate, 1), &ptrs, 1, 3);
                    assert_bits(
                        &yr,
                        &y[r * n..(r + 1) * n],
                        &format!("{what} row {r}: decode = prefill"),
                    );
                }
                let rows_b = 5;
                let mut xb = x[..DECODE_ROWS * k].to_vec();
                let mut yb = y0[..DECODE_ROWS * n].to_vec();
                let mut ptrs = vec![ptr(&mut xb), w.as_mut_ptr(), ptr(&mut yb)];
                if bias {
                    ptrs.push(ptr(&mut bv));
                }
                lib.call(&matmul(dtype, n, k, bias, accumulate, DECODE_ROWS), &ptrs, rows_b, 2);
                assert_bits(
                    &yb[..rows_b * n],
                    &y[..rows_b * n],
                    &format!("{what}: batched = prefill"),
                );
                assert_eq!(
                    &yb[rows_b * n..],
                    &y0[rows_b * n..DECODE_ROWS * n],
                    "{what}: rows past `rows` untouched"
                );
            }
        }
    }
}

#[test]
fn q8_gate_up_equals_the_two_matmuls() {
    let (n, k) = (24, 512);
    for (gate_dtype, up_dtype) in [
        (DType::Q4K, DType::Q4K),
        (DType::Q4_0, DType::Q6K),
        (DType::Q3K, DType::Q8_0),
    ] {
        let gate_up = Kernel::GateUp {
            n,
            k,
            gate_dtype,
            up_dtype,
            norm: None,
            act: Act::Silu,
            max_rows: 1,
            grouped: false,
            paired: false,
        };
        let (mg, mu) = (
            matmul(gate_dtype, n, k, false, false, 1),
            matmul(up_dtype, n, k, false, false, 1),
        );
        let mut kernels = vec![gate_up.clone(), mg.clone(), mu.clone()];
        kernels.dedup();
        let lib = TestLib::build(&kernels, &options(8), None);
        let mut rng = Rng(0x6a7e);
        let mut x = rng.vec(k);
        let mut wg = random_blocks(&mut rng, gate_dtype, n * k / gate_dtype.block_elems(), false);
        let mut wu = random_blocks(&mut rng, up_dtype, n * k / up_dtype.block_elems(), false);
        let (mut g, mut u) = (vec![0f32; n], vec![0f32; n]);
        lib.call(
            &gate_up,
            &[ptr(&mut x), wg.as_mut_ptr(), ptr(&mut g), wu.as_mut_ptr(), ptr(&mut u)],
            1,
            2,
        );
        let (mut g0, mut u0) = (vec![0f32; n], vec![0f32; n]);
        lib.call(&mg, &[ptr(&mut x), wg.as_mut_ptr(), ptr(&mut g0)], 1, 2);
        lib.call(&mu, &[ptr(&mut x), wu.as_mut_ptr(), ptr(&mut u0)], 1, 2);
        assert_bits(&u, &u0, &format!("{gate_dtype}/{up_dtype}: up projection"));
        for i in 0..n {
            let silu = g0[i] / (1.0 + (-g0[i]).exp());
            assert!(
                (g[i] - silu * u0[i]).abs() <= 1e-5 * (1.0 + g[i].abs()),
                "{gate_dtype}/{up_dtype} gate {i}: {} vs {}",
                g[i],
                silu * u0[i]
            );
        }
    }
}

/// Calls whose rounded rows exceed the stack budget (`max_rows · k` past 1 MiB: long prefill
/// blocks over wide rows, which overflowed a worker's 16 MiB stack at `--prefill-block 2048`)
/// keep them on the heap and still compute what one-row decode does, bit for bit; every
/// format family's layouts are allocated there (q4_k's word pairs and stage, q4_0's octets
/// and pairs, q6_k's stage).
#[test]
fn q8_rows_past_the_stack_budget_live_on_the_heap() {
    // 526 rows: 65 tiles of 8, then one of 4 (staged) and one of 2 (reading the weights).
    let (n, k, rows) = (6, 2048, 526);
    for dtype in [DType::Q4K, DType::Q6K, DType::Q4_0] {
        let (prefill, decode) = (
            matmul(dtype, n, k, false, false, rows),
            matmul(dtype, n, k, false, false, 1),
        );
        let lib = TestLib::build(&[prefill.clone(), decode.clone()], &options(8), None);
        let mut rng = Rng(0x4ea9);
        let mut w = random_blocks(&mut rng, dtype, n * k / dtype.block_elems(), false);
        let mut x = rng.vec(rows * k);
        let mut y = vec![0f32; rows * n];
        lib.call(&prefill, &[ptr(&mut x), w.as_mut_ptr(), ptr(&mut y)], rows, 2);
        for r in [0, 7, 8, 263, 520, 523, rows - 1] {
            let mut xr = x[r * k..(r + 1) * k].to_vec();
            let mut yr = vec![0f32; n];
            lib.call(&decode, &[ptr(&mut xr), w.as_mut_ptr(), ptr(&mut yr)], 1, 2);
            assert_bits(&yr, &y[r * n..(r + 1) * n], &format!("{dtype} row {r} of {rows}"));
        }
    }
}

/// The staged tiles add two groups' `vpmaddubsw` pair sums in i16 before their `vpmaddwd`:
/// the largest possible sums (q6_k's largest codes, `c + 32 = 63`, against activations that
/// all round to 127) must neither wrap nor saturate there, so prefill (staged) stays bitwise
/// equal to one-row decode (one group at a time) and to the reference.
#[test]
fn q8_paired_k_quant_sums_hold_the_largest_codes() {
    let (n, k) = (16, 512);
    let dtype = DType::Q6K;
    for lanes in widths().into_iter().filter(|&l| l >= 8) {
        let kernels = [
            matmul(dtype, n, k, false, false, ROWS),
            matmul(dtype, n, k, false, false, 1),
        ];
        let lib = TestLib::build(&kernels, &options(lanes), None);
        let mut rng = Rng(0x6c6 + lanes as u64);
        let mut w = random_blocks(&mut rng, dtype, n * k / dtype.block_elems(), false);
        // Each 210-byte block: ql (128) and qh (64) all ones (every code 63), 16 scales of
        // 127, then d = 1.0 (f16).
        for block in w.chunks_mut(dtype.block_bytes()) {
            block[..192].fill(0xff);
            block[192..208].fill(127);
            block[208..210].copy_from_slice(&0x3c00u16.to_le_bytes());
        }
        let wv = reference(dtype, &w);
        let mut x = vec![1.0f32; ROWS * k];
        let want = reference_rows(&x, &wv, ROWS, n, k, span(dtype));
        let mut y = vec![0f32; ROWS * n];
        lib.call(&kernels[0], &[ptr(&mut x), w.as_mut_ptr(), ptr(&mut y)], ROWS, 2);
        for (i, (&g, &(s, tol))) in y.iter().zip(&want).enumerate() {
            let tol = tol + 2.0 * f32::EPSILON as f64 * s.abs();
            assert!((g as f64 - s).abs() <= tol, "{lanes} lanes [{i}]: got {g}, want {s}");
        }
        let mut xr = x[..k].to_vec();
        let mut yr = vec![0f32; n];
        lib.call(&kernels[1], &[ptr(&mut xr), w.as_mut_ptr(), ptr(&mut yr)], 1, 1);
        assert_bits(&yr, &y[..n], &format!("{lanes} lanes: decode = prefill"));
    }
}

/// Prefill tiles of sixteen rows (`q8_layouts::Sixteens`: 512-bit `vpdpbusd` over the rows'
/// 4-code chunks, on AVX512-VNNI hosts) compute what one-row decode does, bit for bit, for
/// every format they take (q8_0's signed codes against the rows' `q + 128`); 40 rows run two
/// sixteens, then an octet. Where the host has
/// AVX512-VNNI the kernel must contain the 512-bit `vpdpbusd` (so the check covers that
/// path); elsewhere the same rows run octets and one-row code, checked the same way.
#[test]
fn q8_sixteens_equal_one_row_decode() {
    let (n, k, rows) = (7, 512, 40);
    let lanes = *widths().first().expect("a vector width");
    let opts = options(lanes);
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1] {
        let (prefill, decode) = (
            matmul(dtype, n, k, false, false, rows),
            matmul(dtype, n, k, false, false, 1),
        );
        let dump = tempfile::tempdir().unwrap();
        let lib = TestLib::build(&[prefill.clone(), decode.clone()], &opts, Some(dump.path()));
        let wide = std::fs::read_dir(dump.path())
            .unwrap()
            .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap_or_default())
            .any(|text| text.contains("llvm.x86.avx512.vpdpbusd.512"));
        assert_eq!(wide, crate::emit::quant8::vnni512(&opts), "{dtype}: sixteens emitted");
        let mut rng = Rng(0x5160 + dtype as u64);
        let mut w = random_blocks(&mut rng, dtype, n * k / dtype.block_elems(), false);
        let mut x = rng.vec(rows * k);
        let mut y = vec![0f32; rows * n];
        lib.call(&prefill, &[ptr(&mut x), w.as_mut_ptr(), ptr(&mut y)], rows, 2);
        for r in 0..rows {
            let mut xr = x[r * k..(r + 1) * k].to_vec();
            let mut yr = vec![0f32; n];
            lib.call(&decode, &[ptr(&mut xr), w.as_mut_ptr(), ptr(&mut yr)], 1, 2);
            assert_bits(
                &yr,
                &y[r * n..(r + 1) * n],
                &format!("{dtype} row {r} of {rows}, {lanes} lanes"),
            );
        }
    }
}

/// The rows after a call's full octets (`q8_blocks.rs`, `q8_octet_rest`: quads of the partial
/// octet, whose lanes past the call's last row repeat it) compute what one-row decode does,
/// bit for bit, for every count of rows left (1 to 7, after none, one or more full octets or a
/// sixteen), and leave the outputs of rows past the call's untouched; `max_rows` of 15 makes
/// the partial octet the buffer's last, so a read past the call's rows would leave it.
#[test]
fn q8_rows_after_the_full_octets_equal_one_row_decode() {
    let (n, k, max_rows) = (5, 256, 15);
    for lanes in widths().into_iter().filter(|&l| l >= 8) {
        let opts = options(lanes);
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1] {
            let (prefill, decode) = (
                matmul(dtype, n, k, false, true, max_rows),
                matmul(dtype, n, k, false, true, 1),
            );
            let lib = TestLib::build(&[prefill.clone(), decode.clone()], &opts, None);
            let mut rng = Rng(0x0c7e + dtype as u64 + lanes as u64);
            let mut w = random_blocks(&mut rng, dtype, n * k / dtype.block_elems(), false);
            let mut x = rng.vec(max_rows * k);
            let y0 = rng.vec(max_rows * n);
            for rows in [1, 3, 4, 5, 7, 9, 12, 13, 15] {
                let mut y = y0.clone();
                lib.call(&prefill, &[ptr(&mut x), w.as_mut_ptr(), ptr(&mut y)], rows, 2);
                for r in 0..rows {
                    let mut xr = x[r * k..(r + 1) * k].to_vec();
                    let mut yr = y0[r * n..(r + 1) * n].to_vec();
                    lib.call(&decode, &[ptr(&mut xr), w.as_mut_ptr(), ptr(&mut yr)], 1, 2);
                    let what = format!("{dtype} row {r} of {rows}, {lanes} lanes");
                    assert_bits(&yr, &y[r * n..(r + 1) * n], &what);
                }
                assert_eq!(
                    &y[rows * n..],
                    &y0[rows * n..],
                    "{dtype}, {rows} rows: rows past the call's untouched"
                );
            }
        }
    }
}
