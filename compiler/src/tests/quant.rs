//! Kernels over GGML-quantised weights against the runtime's reference dequantisers
//! (`core/src/dequant.rs`, bit-exact with ggml and gguf-py):
//!
//! * the embedding kernel, which only dequantises, reproduces the reference bit for bit on
//!   random blocks (every finite f16 scale, subnormals included) and on the gguf-py fixtures;
//! * matmuls (decode and prefill, bias and accumulate variants, several row and thread counts,
//!   a remainder column block, and a `k` long enough to be processed in chunks) match an f64
//!   reference computed from the reference-dequantised weights;
//! * decode and prefill give bitwise-identical outputs for the same row.
//!
//! Every test runs at the host's vector width and at the narrower ones (8 and 4 lanes), which
//! take the portable conversion path instead of AVX-512's table lookups.

use super::{Rng, TestLib, f32_to_f16, ptr};
use kiln_core::abi::WORK_COUNTER_BYTES;
use kiln_core::kernel::DECODE_ROWS;
use kiln_core::{CompileOptions, DType, HostCpu, Kernel};
use std::sync::OnceLock;

use kiln_core::dequant;

const QUANTS: [DType; 10] = [
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

/// Prefill rows of the test kernels.
const ROWS: usize = 12;
/// Rows of the embedding tables.
const VOCAB: usize = 7;
/// A row long enough that prefill dequantises it into the scratch in several chunks.
const LONG_K: usize = 11008;

/// Byte offsets of the f16 fields (scales and mins) in each block type.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q6K => &[208],
        _ => unreachable!(),
    }
}

/// Vector widths to test: the host's and every narrower one down to 4.
pub(super) fn widths() -> Vec<usize> {
    let host = HostCpu::detect().f32_lanes();
    [16, 8, 4].into_iter().filter(|&l| l <= host).collect()
}

impl Rng {
    fn u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.u64() >> 32) as u8).collect()
    }
}

/// `blocks` random blocks of `dtype`. Quant bytes are uniform; each f16 field is either any
/// finite half (`wide`: subnormals and the largest values included) or a small one, so that
/// dot products stay well conditioned.
pub(super) fn random_blocks(rng: &mut Rng, dtype: DType, blocks: usize, wide: bool) -> Vec<u8> {
    let bb = dtype.block_bytes();
    let mut data = rng.bytes(blocks * bb);
    for blk in data.chunks_exact_mut(bb) {
        for &off in f16_fields(dtype) {
            let h = if wide {
                loop {
                    let h = (rng.u64() >> 20) as u16;
                    if h & 0x7c00 != 0x7c00 {
                        break h;
                    }
                }
            } else {
                f32_to_f16((rng.f() * 1024.0).round() / 1024.0 / 16.0)
            };
            blk[off..off + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    data
}

/// A library of `kernels` written with `lanes`-wide vectors.
fn build(kernels: &[Kernel], lanes: usize) -> TestLib {
    let options = CompileOptions::new(ROWS, lanes);
    TestLib::build(kernels, &options, None)
}

/// The shapes exercised per format: `(n, k, bias, accumulate)`.
fn matmul_shapes(dtype: DType, lanes: usize, host: bool) -> Vec<(usize, usize, bool, bool)> {
    let be = dtype.block_elems();
    // 3 blocks (no unrolling) and 8 blocks (unrolled decode loop) of the legacy types; 2 and 3
    // super-blocks of the K-quants. n = 20 and 13 leave remainders of the 6-column tile.
    let mut shapes = vec![
        (20, if be == 32 { 96 } else { 512 }, true, false),
        (13, if be == 32 { 256 } else { 768 }, false, true),
    ];
    if host && lanes >= 8 {
        shapes.push((7, LONG_K, false, false));
    }
    shapes
}

/// Every kernel of the suite for one vector width.
fn suite(lanes: usize) -> Vec<Kernel> {
    let host = lanes == HostCpu::detect().f32_lanes();
    let mut out = Vec::new();
    for dtype in QUANTS {
        for max_rows in [4, 1] {
            out.push(Kernel::Embed {
                vocab: VOCAB,
                hidden: 2 * dtype.block_elems(),
                dtype,
                scale: None,
                positions: None,
                max_rows,
                grouped: None,
            });
        }
        for (n, k, bias, accumulate) in matmul_shapes(dtype, lanes, host) {
            // Prefill, a batched decode step, one-row decode.
            for max_rows in [ROWS, DECODE_ROWS, 1] {
                let bias = bias.then_some(DType::F32);
                out.push(Kernel::MatMul {
                    n,
                    k,
                    wdtype: dtype,
                    bias,
                    accumulate,
                    norm: None,
                    act: None,
                    softcap: None,
                    max_rows,
                    grouped: false,
                    paired: false,
                });
            }
        }
    }
    out
}

/// One library per vector width, compiled once per test binary.
fn lib(lanes: usize) -> &'static TestLib {
    static LIBS: [OnceLock<TestLib>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = match lanes {
        16 => 0,
        8 => 1,
        _ => 2,
    };
    LIBS[slot].get_or_init(|| build(&suite(lanes), lanes))
}

pub(super) fn reference(dtype: DType, data: &[u8]) -> Vec<f32> {
    dequant::dequantize(dtype, data).expect("whole blocks")
}

/// Dequantises `table` (rows of `hidden` values) with the embedding kernel, every row once.
fn embed_all(lib: &TestLib, dtype: DType, hidden: usize, table: &mut [u8], rows: usize) -> Vec<f32> {
    let vocab = table.len() / dtype.bytes_for(hidden);
    let k = Kernel::Embed {
        vocab,
        hidden,
        dtype,
        scale: None,
        positions: None,
        max_rows: rows,
        grouped: None,
    };
    let mut out = Vec::new();
    for first in (0..vocab).step_by(rows) {
        let n = rows.min(vocab - first);
        let mut tokens: Vec<i32> = (0..rows).map(|i| (first + i.min(n - 1)) as i32).collect();
        let mut x = vec![f32::NAN; rows * hidden];
        lib.call(&k, &[ptr(&mut tokens), table.as_mut_ptr(), ptr(&mut x)], n, 2);
        out.extend_from_slice(&x[..n * hidden]);
    }
    out
}

pub(super) fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
        assert!(
            same,
            "{what}[{i}]: got {g} ({:#010x}), want {w} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

#[test]
fn embed_dequantises_bit_for_bit() {
    for lanes in widths() {
        let lib = lib(lanes);
        let mut rng = Rng(0x5eed_0000 + lanes as u64);
        for dtype in QUANTS {
            let hidden = 2 * dtype.block_elems();
            let mut table = random_blocks(&mut rng, dtype, 2 * VOCAB, true);
            let want = reference(dtype, &table);
            for rows in [4, 1] {
                let got = embed_all(lib, dtype, hidden, &mut table, rows);
                assert_bits(&got, &want, &format!("{dtype} embed, {lanes} lanes, {rows} rows"));
            }
        }
    }
}

#[test]
fn embed_matches_gguf_py_fixtures() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/gguf/dequant");
    for lanes in widths() {
        let lib = lib(lanes);
        for dtype in QUANTS {
            let path = dir.join(format!("{}.blocks", dtype.name()));
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let want: Vec<f32> = std::fs::read(dir.join(format!("{}.f32", dtype.name())))
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let blocks = data.len() / dtype.block_bytes();
            assert!(
                blocks >= 8 && blocks.is_multiple_of(2),
                "{dtype}: {blocks} fixture blocks"
            );
            let mut got = Vec::new();
            // The suite's embedding kernels have VOCAB rows of two blocks: feed the fixture
            // VOCAB rows at a time, padding the last table with zero bytes.
            let (row_bytes, row_elems) = (2 * dtype.block_bytes(), 2 * dtype.block_elems());
            for chunk in data.chunks(VOCAB * row_bytes) {
                let mut table = chunk.to_vec();
                table.resize(VOCAB * row_bytes, 0);
                let vals = embed_all(lib, dtype, row_elems, &mut table, 4);
                got.extend_from_slice(&vals[..chunk.len() / row_bytes * row_elems]);
            }
            assert_bits(&got, &want, &format!("{dtype} gguf-py fixture, {lanes} lanes"));
        }
    }
}

#[test]
fn quantised_matmuls_prefill_and_decode() {
    for lanes in widths() {
        let lib = lib(lanes);
        let host = lanes == HostCpu::detect().f32_lanes();
        let mut rng = Rng(0xfeed_0000 + lanes as u64);
        for dtype in QUANTS {
            for (n, k, bias, accumulate) in matmul_shapes(dtype, lanes, host) {
                let bias_t = bias.then_some(DType::F32);
                let kernel = |max_rows| Kernel::MatMul {
                    n,
                    k,
                    wdtype: dtype,
                    bias: bias_t,
                    accumulate,
                    norm: None,
                    act: None,
                    softcap: None,
                    max_rows,
                    grouped: false,
                    paired: false,
                };
                let (prefill, decode, batched) = (kernel(ROWS), kernel(1), kernel(DECODE_ROWS));
                let mut w = random_blocks(&mut rng, dtype, n * k / dtype.block_elems(), false);
                let wv = reference(dtype, &w);
                let mut bv = rng.vec(n);
                let x = rng.vec(ROWS * k);
                let y0 = rng.vec(ROWS * n);
                let what = |kind: &str, rows: usize, nth: usize| {
                    format!("{dtype} n{n} k{k} {kind}: {lanes} lanes, {rows} rows, {nth} threads")
                };
                for (rows, nth) in [(ROWS, 1), (5, 2), (1, 3)] {
                    // f64 sums, and the scale of their f32 rounding error: a few units of
                    // roundoff of the sum of the terms' magnitudes (the partial sums of a long
                    // f32 chain grow with k).
                    let (want, tol): (Vec<f64>, Vec<f64>) = (0..rows * n)
                        .map(|i| {
                            let (r, j) = (i / n, i % n);
                            let terms = (0..k).map(|c| x[r * k + c] as f64 * wv[j * k + c] as f64);
                            let (mut s, mut mag) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
                            if bias {
                                s += bv[j] as f64;
                                mag += (bv[j] as f64).abs();
                            }
                            if accumulate {
                                s += y0[i] as f64;
                                mag += (y0[i] as f64).abs();
                            }
                            (s, 4.0 * f32::EPSILON as f64 / 2.0 * mag + 1e-30)
                        })
                        .unzip();
                    let mut xs = x.clone();
                    let mut y = y0.clone();
                    let mut ptrs = vec![ptr(&mut xs), w.as_mut_ptr(), ptr(&mut y)];
                    if bias {
                        ptrs.push(ptr(&mut bv));
                    }
                    lib.call(&prefill, &ptrs, rows, nth);
                    for (i, ((g, w), t)) in y.iter().zip(&want).zip(&tol).enumerate() {
                        let err = (*g as f64 - w).abs();
                        assert!(
                            err <= *t,
                            "{}[{i}]: got {g}, want {w} (|err| {err:e} > {t:e})",
                            what("prefill", rows, nth)
                        );
                    }
                    assert_eq!(
                        &y[rows * n..],
                        &y0[rows * n..],
                        "{}: rows past `rows` untouched",
                        what("prefill", rows, nth)
                    );

                    // Decode, one row at a time, must agree with prefill bit for bit.
                    for r in 0..rows {
                        let mut xr = x[r * k..(r + 1) * k].to_vec();
                        let mut yr = y0[r * n..(r + 1) * n].to_vec();
                        let mut ptrs = vec![ptr(&mut xr), w.as_mut_ptr(), ptr(&mut yr)];
                        if bias {
                            ptrs.push(ptr(&mut bv));
                        }
                        lib.call(&decode, &ptrs, 1, nth);
                        assert_bits(
                            &yr,
                            &y[r * n..(r + 1) * n],
                            &format!("{} row {r}: decode = prefill", what("decode", rows, nth)),
                        );
                    }
                    // A batched decode step (several rows folded into each weight vector read)
                    // must agree with prefill bit for bit too.
                    let rows_b = rows.min(DECODE_ROWS);
                    let mut xb = x[..DECODE_ROWS * k].to_vec();
                    let mut yb = y0[..DECODE_ROWS * n].to_vec();
                    let mut ptrs = vec![ptr(&mut xb), w.as_mut_ptr(), ptr(&mut yb)];
                    if bias {
                        ptrs.push(ptr(&mut bv));
                    }
                    lib.call(&batched, &ptrs, rows_b, nth);
                    assert_bits(
                        &yb[..rows_b * n],
                        &y[..rows_b * n],
                        &format!("{}: batched decode = prefill", what("batched", rows_b, nth)),
                    );
                    assert_eq!(
                        &yb[rows_b * n..],
                        &y0[rows_b * n..DECODE_ROWS * n],
                        "rows past `rows` untouched"
                    );
                }
            }
        }
    }
}

#[test]
fn model_kernels_accepts_quantised_matrices_only() {
    let options = CompileOptions::new(ROWS, 8);
    let set = |s: &mut kiln_core::ModelSpec, name: &str, dtype| {
        let id = s.weight_named(name).expect("a tensor of the test spec");
        s.weights[id.0 as usize].dtype = dtype;
    };
    let mut s = super::spec(false, None);
    set(&mut s, "embed", DType::Q8_0);
    set(&mut s, "0.q", DType::Q4_0);
    set(&mut s, "1.gate", DType::Q5_1);
    let kernels = crate::model_kernels(&s, &options).expect("quantised matrices with whole blocks compile");
    assert!(
        kernels
            .iter()
            .any(|k| matches!(k, Kernel::Embed { dtype: DType::Q8_0, .. }))
    );
    assert!(
        kernels.iter().any(|k| matches!(
            k,
            Kernel::MatMul {
                wdtype: DType::Q8_0,
                max_rows: DECODE_ROWS,
                ..
            }
        )),
        "tied head"
    );

    let mut bad = s.clone();
    set(&mut bad, "0.k", DType::Q4K); // rows of 64 values, super-blocks of 256
    let err = crate::model_kernels(&bad, &options).unwrap_err().to_string();
    assert!(
        err.contains("0.k") && err.contains("not a whole number of 256-value blocks"),
        "{err}"
    );

    let mut bad = s.clone();
    set(&mut bad, "1.mlp_norm", DType::Q8_0);
    let err = crate::model_kernels(&bad, &options).unwrap_err().to_string();
    assert!(
        err.contains("1.mlp_norm") && err.contains("not for norms or biases"),
        "{err}"
    );
}

/// Decode and prefill throughput per format on one thread (`cargo test -p kiln-compiler --
/// --ignored quant_speed --nocapture`). `KILN_QUANT_LANES=8` measures the AVX2 code (built
/// for x86-64-v3 on an AVX-512 host);
/// `KILN_QUANT_ASM=dir` also writes each kernel's MLIR and assembly; `KILN_QUANT_PRECISION=q8`
/// measures `--precision q8` (or `bf16`); `KILN_QUANT_N`, `KILN_QUANT_K` and
/// `KILN_QUANT_TYPES=bf16,q4_0` pick a model's shape and the formats; `KILN_QUANT_THREADS` the
/// threads; `KILN_QUANT_MAXROWS` the prefill kernel's block rows (64) and `KILN_QUANT_ROWS` the
/// rows a prefill call runs (as many).
#[test]
#[ignore = "timing only: cargo test -p kiln-compiler -- --ignored quant_speed --nocapture"]
fn quant_speed() {
    let host = HostCpu::detect().f32_lanes();
    let lanes = super::env_usize("KILN_QUANT_LANES").unwrap_or(host).min(host);
    let var = |name: &str, default: usize| super::env_usize(name).unwrap_or(default);
    let (n, k, rows) = (
        var("KILN_QUANT_N", 1024),
        var("KILN_QUANT_K", 2048),
        var("KILN_QUANT_MAXROWS", 64),
    );
    let call_rows = var("KILN_QUANT_ROWS", rows);
    let threads = var("KILN_QUANT_THREADS", 1);
    let mut types = vec![DType::BF16, DType::F32];
    types.extend(QUANTS);
    if let Ok(list) = std::env::var("KILN_QUANT_TYPES") {
        let wanted: Vec<String> = list.split(',').map(str::to_string).collect();
        types.retain(|t| wanted.contains(&t.to_string()));
    }
    let kernels: Vec<Kernel> = [1, rows]
        .into_iter()
        .flat_map(|max_rows| {
            types
                .iter()
                .map(move |&wdtype| super::plain_matmul(n, k, wdtype, max_rows, false))
        })
        .collect();
    // 8 lanes measure what an AVX2 machine runs: its instruction set and its 16 registers.
    // `KILN_QUANT_PRECISION=q8` measures `--precision q8`.
    let precision = std::env::var("KILN_QUANT_PRECISION")
        .map(|p| kiln_core::Precision::parse(&p).expect("KILN_QUANT_PRECISION"))
        .unwrap_or_default();
    let options = CompileOptions {
        target_cpu: (lanes == 8 && host == 16).then(|| "x86-64-v3".to_string()),
        precision,
        ..CompileOptions::new(rows, lanes)
    };
    let asm = std::env::var_os("KILN_QUANT_ASM").map(std::path::PathBuf::from);
    let lib = TestLib::build(&kernels, &options, asm.as_deref());
    let mut rng = Rng(3);
    println!("{lanes} lanes, {threads} thread(s), n {n}, k {k}: decode (1 row) | prefill ({rows} rows)");
    for dtype in types {
        let mut w: Vec<u8> = match dtype {
            DType::F32 => rng.vec(n * k).iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::BF16 => rng
                .vec(n * k)
                .iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect(),
            q => random_blocks(&mut rng, q, n * k / q.block_elems(), false),
        };
        let mut line = format!("{dtype:>5}:");
        for max_rows in [1, rows] {
            let kernel = super::plain_matmul(n, k, dtype, max_rows, false);
            let mut x = rng.vec(max_rows * k);
            let mut y = vec![0f32; max_rows * n];
            let ptrs = [ptr(&mut x), w.as_mut_ptr(), ptr(&mut y)];
            let runs = if max_rows == 1 { 1 } else { call_rows };
            // The fastest of many calls: other processes only ever slow a call down.
            let s = (0..if max_rows == 1 { 500 } else { 20 })
                .map(|_| {
                    let t = std::time::Instant::now();
                    lib.call(&kernel, &ptrs, runs, threads);
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            let gw = (n * k) as f64 / s / 1e9;
            line += &if max_rows == 1 {
                format!(
                    " {:7.1} us {:6.2} Gweights/s {:6.2} GB/s |",
                    s * 1e6,
                    gw,
                    w.len() as f64 / s / 1e9
                )
            } else {
                format!(" {:7.2} ms {:6.1} GFLOP/s", s * 1e3, 2.0 * gw * runs as f64)
            };
        }
        println!("{line}");
    }
}

/// Tuning: the decode stream rate of each emitter configuration over a 384 MiB matrix on two
/// threads, next to the read probe on the same buffer, configurations interleaved round by
/// round so that machine noise hits them alike:
/// `KILN_SWEEP="ROWS:NEAR_BYTES[:FAR_BYTES[:dot|dlN]],..." KILN_SWEEP_DTYPE=bf16|q8_0|q4_0|q4_1|q4_k|q6_k
/// KILN_QUANT_K=896 cargo test -p kiln-compiler --release -- --ignored decode_sweep --nocapture`
/// (`KILN_SWEEP_PRECISION=bf16|q8` measures that mode).
///
/// The matrix lies in 2 MiB pages (`KILN_SWEEP_SMALL_PAGES=1`: 4 KiB ones, the probe then reads
/// ~15-25 % slower on a Zen 5 EPYC); `KILN_SWEEP_MAX_ROWS=8` measures the batched-decode
/// kernels a model gets on a one-row call; `KILN_SWEEP_THRASH_MIB=N` reads N MiB of other
/// memory before every kernel call, as a model's other matrices do between two calls of one.
/// Measured with it (2-core Zen 5, q6_k, k 2048, 54 MiB, q8 mode): the kernel's rate fell from
/// ~70 to ~42 GB/s, the probe's after it from ~85 to ~63.
#[test]
#[ignore = "timing only: a parameter sweep driven by KILN_SWEEP (see above)"]
fn decode_sweep() {
    let lanes = super::env_usize("KILN_SWEEP_LANES").unwrap_or(HostCpu::detect().f32_lanes());
    let k: usize = super::env_usize("KILN_QUANT_K").unwrap_or(896);
    let dtype = match std::env::var("KILN_SWEEP_DTYPE").as_deref() {
        Ok("q8_0") => DType::Q8_0,
        Ok("q4_0") => DType::Q4_0,
        Ok("q4_1") => DType::Q4_1,
        Ok("q4_k") => DType::Q4K,
        Ok("q6_k") => DType::Q6K,
        _ => DType::BF16,
    };
    let configs: Vec<(String, String)> = std::env::var("KILN_SWEEP")
        .unwrap_or("1:0".into())
        .split(',')
        .map(|c| {
            let (r, p) = c.split_once(':').unwrap();
            (r.to_string(), p.to_string())
        })
        .collect();
    // `KILN_SWEEP_MIB` (default 384): a matrix that fits the last-level cache measures the
    // kernels' own rate, as a machine with faster memory would see it.
    let mib: usize = super::env_usize("KILN_SWEEP_MIB").unwrap_or(384);
    let n = (mib << 20) / dtype.bytes_for(k) / 64 * 64;
    let kernel = super::plain_matmul(
        n,
        k,
        dtype,
        // `KILN_SWEEP_MAX_ROWS=8` measures the batched-decode kernels the engine builds, on a
        // one-row call as a single sequence's decode makes.
        super::env_usize("KILN_SWEEP_MAX_ROWS").unwrap_or(1),
        // Row-major; a config's `g` field reads the same bytes as row groups (the rate does
        // not depend on their values).
        false,
    );
    let probe = Kernel::ProbeRead {
        elems: n * dtype.bytes_for(k) / 4,
    };
    let probe_lib = build(std::slice::from_ref(&probe), lanes);
    let options = CompileOptions {
        precision: std::env::var("KILN_SWEEP_PRECISION")
            .map(|p| kiln_core::Precision::parse(&p).expect("KILN_SWEEP_PRECISION"))
            .unwrap_or_default(),
        ..CompileOptions::new(ROWS, lanes)
    };
    let libs: Vec<(TestLib, Kernel)> = configs
        .iter()
        .map(|(r, p)| {
            let mut grouped = false;
            // SAFETY: test-only; no other thread reads the environment while we compile.
            unsafe {
                let mut fields = p.split(':');
                let near = fields.next().unwrap_or("0");
                let far = fields.next().unwrap_or("0");
                std::env::set_var("KILN_EXP_FROWS", r);
                std::env::set_var("KILN_EXP_ROWS", r);
                std::env::set_var("KILN_EXP_PF", near);
                std::env::set_var("KILN_EXP_PF_FAR", far);
                // A fourth field picks the float order: `dot` (the dot-product form), `dlN`
                // (quad order, decode at N lanes), `g` (quad order over the row-grouped
                // layout, `kiln_core::grouped`: compare it with row-major rows in one run),
                // else quad order at the kernel's width.
                std::env::remove_var("KILN_EXP_NOQUAD");
                std::env::remove_var("KILN_EXP_QDLANES");
                match fields.next() {
                    Some("dot") => std::env::set_var("KILN_EXP_NOQUAD", "1"),
                    Some(dl) if dl.starts_with("dl") => std::env::set_var("KILN_EXP_QDLANES", &dl[2..]),
                    Some("g") => grouped = true,
                    _ => {}
                }
            }
            let mut kernel = kernel.clone();
            if let Kernel::MatMul { grouped: g, .. } = &mut kernel {
                *g = grouped;
            }
            (TestLib::build(std::slice::from_ref(&kernel), &options, None), kernel)
        })
        .collect();
    let mut rng = Rng(5);
    let w: Vec<u8> = match dtype {
        DType::BF16 => rng
            .vec(n * k)
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        q => random_blocks(&mut rng, q, n * k / q.block_elems(), false),
    };
    // The weights in 2 MiB pages, as the engine's probe buffer and most of a model's page cache
    // are: on small pages the probe itself read 60-73 GB/s where the engine's read 82-86.
    let mut w = HugeCopy::of(&w);
    let Kernel::MatMul { max_rows, .. } = kernel else {
        unreachable!()
    };
    let mut x = rng.vec(k * max_rows);
    let mut y = vec![0f32; n * max_rows];
    let ptrs = [ptr(&mut x) as usize, w.as_mut_ptr() as usize, ptr(&mut y) as usize];
    let rounds: usize = super::env_usize("KILN_SWEEP_ROUNDS").unwrap_or(15);
    let thrash: Option<Vec<u8>> =
        super::env_usize("KILN_SWEEP_THRASH_MIB").map(|m| (0..m << 20).map(|i| i as u8).collect());
    let mut times = vec![Vec::new(); libs.len()];
    let mut probe_times = Vec::new();
    let mut sums = vec![0f32; 64 * 16];
    let sums_addr = ptr(&mut sums) as usize;
    for _ in 0..rounds {
        let t = std::time::Instant::now();
        std::thread::scope(|s| {
            for tid in 0..2i64 {
                let (probe, probe_lib) = (&probe, &probe_lib);
                s.spawn(move || {
                    let f = probe_lib.get(probe);
                    let a = super::slots(&[ptrs[1] as *mut u8, sums_addr as *mut u8], std::ptr::null_mut());
                    // SAFETY: the weight buffer holds `elems` f32; `sums` 64 x 16 f32.
                    unsafe { kiln_core::abi::invoke(*f, a, 1, tid, 2) };
                });
            }
        });
        probe_times.push(t.elapsed().as_secs_f64());
        for (i, (lib, kernel)) in libs.iter().enumerate() {
            if let Some(t) = &thrash {
                let half = t.len() / 2;
                let (a, c) = t.split_at(half);
                let sums: u64 = std::thread::scope(|s| {
                    let h: Vec<_> = [a, c]
                        .into_iter()
                        .map(|part| s.spawn(move || part.iter().step_by(8).map(|&v| v as u64).sum::<u64>()))
                        .collect();
                    h.into_iter().map(|h| h.join().unwrap()).sum()
                });
                std::hint::black_box(sums);
            }
            let mut work = [0u64; WORK_COUNTER_BYTES / 8];
            let work_addr = work.as_mut_ptr() as usize;
            let t = std::time::Instant::now();
            std::thread::scope(|s| {
                for tid in 0..2i64 {
                    s.spawn(move || {
                        let f = lib.get(kernel);
                        let p = |i: usize| ptrs[i] as *mut u8;
                        let a = super::slots(&[p(0), p(1), p(2)], work_addr as *mut u8);
                        // SAFETY: buffers match the kernel's shapes; threads write disjoint outputs.
                        unsafe { kiln_core::abi::invoke(*f, a, 1, tid, 2) };
                    });
                }
            });
            times[i].push(t.elapsed().as_secs_f64());
        }
    }
    // Each round's rate as a share of that round's probe: the machine's bandwidth changes
    // between phases of a run, and a share of the probe measured beside it does not.
    let shares: Vec<Vec<f64>> = times
        .iter()
        .map(|t| {
            let mut s: Vec<f64> = t.iter().zip(&probe_times).map(|(t, p)| p / t).collect();
            s.sort_by(f64::total_cmp);
            s
        })
        .collect();
    probe_times.sort_by(f64::total_cmp);
    let gb = |s: f64| w.len() as f64 / s / 1e9;
    println!(
        "read probe on the same buffer: best {:5.1} GB/s  median {:5.1} GB/s",
        gb(probe_times[0]),
        gb(probe_times[probe_times.len() / 2])
    );
    for (((r, p), t), share) in configs.iter().zip(&mut times).zip(&shares) {
        t.sort_by(f64::total_cmp);
        let gb = |s: f64| w.len() as f64 / s / 1e9;
        println!(
            "{dtype} k {k} R {r:>2} PF {p:>5}: best {:5.1} GB/s  median {:5.1} GB/s  {:3.0} % of the probe (median of rounds)",
            gb(t[0]),
            gb(t[t.len() / 2]),
            100.0 * share[share.len() / 2]
        );
    }
}

/// A copy of a byte buffer in memory aligned to 2 MiB and advised for transparent huge pages.
struct HugeCopy {
    ptr: *mut u8,
    layout: std::alloc::Layout,
    len: usize,
}

impl HugeCopy {
    const PAGE: usize = 2 << 20;

    fn of(bytes: &[u8]) -> HugeCopy {
        let size = bytes.len().next_multiple_of(Self::PAGE);
        let layout = std::alloc::Layout::from_size_align(size, Self::PAGE).expect("layout");
        // SAFETY: a non-zero layout; the advice covers exactly the block just allocated (whole
        // 2 MiB pages), and the copy writes `bytes.len()` bytes into it.
        let ptr = unsafe {
            let ptr = std::alloc::alloc(layout);
            assert!(!ptr.is_null(), "allocating {size} bytes");
            if std::env::var_os("KILN_SWEEP_SMALL_PAGES").is_none() {
                libc::madvise(ptr.cast(), size, libc::MADV_HUGEPAGE);
            }
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len());
            ptr
        };
        HugeCopy {
            ptr,
            layout,
            len: bytes.len(),
        }
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HugeCopy {
    fn drop(&mut self) {
        // SAFETY: allocated in `of` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}
