//! The kernel attributes the general graph added, each against a plain f64 reference of the
//! formula its doc states (the reference's order of operations is what the golden models
//! check end to end): LayerNorm and Gemma's `(1 + w)` RMSNorm, as steps (also accumulating)
//! and folded into decode matmuls; GELU (tanh and erf) as a gated activation and as a matmul
//! epilogue; soft caps; the embedding's scale and learned positions; `add`; rotary embeddings
//! on part of a head, with GPT-J pairs, LongRoPE tables and a cos/sin factor; attention with
//! its own scale and a soft cap. Each runs at every vector width the host has (16, 8, 4 lanes).
//! Decode and prefill forms of the same computation must agree bit for bit.

use super::{Rng, TestLib, assert_close, ptr, weights};
use kiln_core::kernel::{PositionTable, QkNorm};
use kiln_core::ops::LongFreqs;
use kiln_core::{Act, CompileOptions, DType, F32Bits, HostCpu, Kernel, NormKind, NormShape, Pairing, Rotary};
use std::sync::OnceLock;

const ROWS: usize = 4;
/// A width that is not a power of two: vectors narrow to a divisor (16, 8 or 4 lanes).
const DIM: usize = 80;
const N: usize = 24;
const HEADS: usize = 4;
const KV: usize = 2;
const HD: usize = 16;
const CTX: usize = 48;
const VOCAB: usize = 9;
const EPS: f32 = 1e-5;

fn widths() -> Vec<usize> {
    let host = HostCpu::detect().f32_lanes();
    [16, 8, 4].into_iter().filter(|&l| l <= host).collect()
}

fn shape(kind: NormKind) -> NormShape {
    NormShape {
        kind,
        eps: F32Bits::new(EPS),
        wdtype: DType::BF16,
        bias: (kind == NormKind::Layer).then_some(DType::F32),
    }
}

const KINDS: [NormKind; 3] = [NormKind::Rms, NormKind::RmsPlusOne, NormKind::Layer];
const ACTS: [Act; 4] = [Act::Silu, Act::GeluTanh, Act::GeluErf, Act::Sigmoid];

fn matmul(
    norm: Option<NormShape>,
    act: Option<Act>,
    softcap: Option<f32>,
    accumulate: bool,
    max_rows: usize,
) -> Kernel {
    Kernel::MatMul {
        n: N,
        k: DIM,
        wdtype: DType::BF16,
        bias: Some(DType::F32),
        accumulate,
        norm,
        act,
        softcap: softcap.map(F32Bits::new),
        max_rows,
        grouped: false,
        paired: false,
    }
}

fn rotary(dims: usize, pairing: Pairing, long: bool, mscale: Option<f32>) -> Rotary {
    let short: Vec<f32> = (0..dims / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / dims as f32))
        .collect();
    let mut r = Rotary::new(dims, pairing, &short);
    if long {
        let long: Vec<u32> = short.iter().map(|f| (f / 3.0).to_bits()).collect();
        r.long = Some(LongFreqs {
            inv_freq: long,
            original: 20,
        });
    }
    r.mscale = mscale.map(F32Bits::new);
    r
}

fn rope(rotary: Option<Rotary>, qk: Option<NormKind>, max_rows: usize) -> Kernel {
    Kernel::RopeKv {
        heads: HEADS,
        kv_heads: KV,
        head_dim: HD,
        rotary,
        qk_norm: qk.map(|kind| QkNorm {
            kind,
            q_dtype: DType::F32,
            k_dtype: DType::F32,
            eps: F32Bits::new(EPS),
        }),
        ctx: CTX,
        max_rows,
        kv: DType::F32,
    }
}

/// Heads too wide to group (Qwen3.5's and Gemma's 256): one head per item at every width.
const WIDE_HD: usize = 256;

fn attention(scale: f32, softcap: Option<f32>, window: Option<usize>, head_dim: usize) -> Kernel {
    Kernel::Attention {
        heads: HEADS,
        kv_heads: KV,
        head_dim,
        window,
        scale: F32Bits::new(scale),
        softcap: softcap.map(F32Bits::new),
        ctx: CTX,
        max_rows: ROWS,
        kv: DType::F32,
    }
}

fn embed() -> Kernel {
    Kernel::Embed {
        vocab: VOCAB,
        hidden: DIM,
        dtype: DType::BF16,
        scale: Some(F32Bits::new((DIM as f64).sqrt() as f32)),
        positions: Some(PositionTable {
            rows: CTX,
            dtype: DType::BF16,
        }),
        max_rows: ROWS,
        grouped: None,
    }
}

/// Every kernel the tests below call.
fn suite() -> Vec<Kernel> {
    let mut out = Vec::new();
    for kind in KINDS {
        for accumulate in [false, true] {
            out.push(Kernel::Norm {
                dim: DIM,
                norm: shape(kind),
                accumulate,
                max_rows: ROWS,
            });
        }
        out.push(matmul(Some(shape(kind)), None, None, false, 1));
    }
    for act in ACTS {
        out.push(Kernel::GatedAct {
            act,
            dim: DIM,
            max_rows: ROWS,
        });
        for max_rows in [ROWS, 1] {
            out.push(matmul(None, Some(act), None, true, max_rows));
        }
        out.push(Kernel::GateUp {
            n: N,
            k: DIM,
            gate_dtype: DType::BF16,
            up_dtype: DType::BF16,
            norm: Some(shape(NormKind::Layer)),
            act,
            max_rows: 1,
            grouped: false,
            paired: false,
        });
    }
    out.push(matmul(None, None, Some(3.0), false, ROWS));
    out.push(matmul(None, None, None, false, ROWS));
    out.push(Kernel::Add {
        dim: DIM,
        max_rows: ROWS,
    });
    out.push(embed());
    out.extend(rope_variants());
    for hd in [HD, WIDE_HD] {
        out.push(attention(0.3, Some(2.0), None, hd));
        out.push(attention(0.3, None, Some(5), hd));
    }
    out
}

fn rope_variants() -> Vec<Kernel> {
    vec![
        rope(Some(rotary(8, Pairing::Half, false, None)), None, ROWS),
        rope(Some(rotary(HD, Pairing::Adjacent, false, None)), None, ROWS),
        rope(
            Some(rotary(HD, Pairing::Half, true, Some(1.25))),
            Some(NormKind::RmsPlusOne),
            ROWS,
        ),
        rope(None, None, ROWS),
    ]
}

fn lib(lanes: usize) -> &'static TestLib {
    static LIBS: [OnceLock<TestLib>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = [16, 8, 4].iter().position(|&l| l == lanes).expect("a tested width");
    LIBS[slot].get_or_init(|| {
        let options = CompileOptions::new(ROWS, lanes);
        TestLib::build(&suite(), &options, None)
    })
}

/// `norm(x)` of one row in f64, as [`NormKind`] documents it.
fn norm_ref(kind: NormKind, x: &[f32], w: &[f32], b: &[f32]) -> Vec<f64> {
    let n = x.len() as f64;
    let xs: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    match kind {
        NormKind::Rms | NormKind::RmsPlusOne => {
            let inv = 1.0 / (xs.iter().map(|v| v * v).sum::<f64>() / n + EPS as f64).sqrt();
            let g = |i: usize| {
                if kind == NormKind::Rms {
                    w[i] as f64
                } else {
                    1.0 + w[i] as f64
                }
            };
            xs.iter().enumerate().map(|(i, v)| v * inv * g(i)).collect()
        }
        NormKind::Layer => {
            let mean = xs.iter().sum::<f64>() / n;
            let var = xs.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            let inv = 1.0 / (var + EPS as f64).sqrt();
            xs.iter()
                .enumerate()
                .map(|(i, v)| (v - mean) * inv * w[i] as f64 + b[i] as f64)
                .collect()
        }
    }
}

/// `erf` in f64 by its Taylor series (converges everywhere; |x| is clamped to 5, where erf is
/// 1 to 1e-11).
fn erf(x: f64) -> f64 {
    let x = x.clamp(-5.0, 5.0);
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

fn act_ref(act: Act, v: f64) -> f64 {
    match act {
        Act::Silu => v / (1.0 + (-v).exp()),
        Act::GeluTanh => 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh()),
        Act::GeluErf => 0.5 * v * (1.0 + erf(v / 2f64.sqrt())),
        Act::Sigmoid => 1.0 / (1.0 + (-v).exp()),
    }
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[test]
fn norms_as_steps_and_accumulating() {
    for lanes in widths() {
        let lib = lib(lanes);
        let mut rng = Rng(0x0a11 + lanes as u64);
        for kind in KINDS {
            for accumulate in [false, true] {
                let k = Kernel::Norm {
                    dim: DIM,
                    norm: shape(kind),
                    accumulate,
                    max_rows: ROWS,
                };
                let mut x: Vec<f32> = rng.vec(ROWS * DIM).iter().map(|v| v * 3.0 + 0.5).collect();
                let (mut wb, wv) = weights(&mut rng, DIM, DType::BF16);
                let (mut bb, bv) = weights(&mut rng, DIM, DType::F32);
                let y0 = rng.vec(ROWS * DIM);
                let mut y = y0.clone();
                let mut ptrs = vec![ptr(&mut x), ptr(&mut wb), ptr(&mut y)];
                if kind == NormKind::Layer {
                    ptrs.push(ptr(&mut bb));
                }
                lib.call(&k, &ptrs, 3, 2);
                let mut want = Vec::new();
                for r in 0..3 {
                    let n = norm_ref(kind, &x[r * DIM..(r + 1) * DIM], &wv, &bv);
                    want.extend(
                        n.iter()
                            .enumerate()
                            .map(|(i, v)| v + if accumulate { y0[r * DIM + i] as f64 } else { 0.0 }),
                    );
                }
                assert_close(
                    &y[..3 * DIM],
                    &want,
                    2e-6,
                    &format!("{kind:?} norm, accumulate {accumulate}, {lanes} lanes"),
                );
            }
        }
    }
}

/// A decode matmul with a folded norm equals the norm step followed by the plain matmul, bit
/// for bit, and both equal the f64 reference.
#[test]
fn folded_norms_equal_the_norm_step_then_the_matmul() {
    for lanes in widths() {
        let lib = lib(lanes);
        let mut rng = Rng(0xf01d + lanes as u64);
        for kind in KINDS {
            let mut x: Vec<f32> = rng.vec(DIM).iter().map(|v| v * 2.0 - 0.25).collect();
            let (mut nw, nwv) = weights(&mut rng, DIM, DType::BF16);
            let (mut nb, nbv) = weights(&mut rng, DIM, DType::F32);
            let (mut w, wv) = weights(&mut rng, N * DIM, DType::BF16);
            let (mut bias, biasv) = weights(&mut rng, N, DType::F32);
            let mut folded = vec![0f32; N];
            let fold = matmul(Some(shape(kind)), None, None, false, 1);
            let mut ptrs = vec![ptr(&mut x), ptr(&mut w), ptr(&mut folded), ptr(&mut bias), ptr(&mut nw)];
            if kind == NormKind::Layer {
                ptrs.push(ptr(&mut nb));
            }
            lib.call(&fold, &ptrs, 1, 3);
            // The unfused pair: the norm step (prefill kernel, one row), then a plain matmul.
            let norm = Kernel::Norm {
                dim: DIM,
                norm: shape(kind),
                accumulate: false,
                max_rows: ROWS,
            };
            let mut xin = vec![0f32; ROWS * DIM];
            xin[..DIM].copy_from_slice(&x);
            let mut xn = vec![0f32; ROWS * DIM];
            let mut ptrs = vec![ptr(&mut xin), ptr(&mut nw), ptr(&mut xn)];
            if kind == NormKind::Layer {
                ptrs.push(ptr(&mut nb));
            }
            lib.call(&norm, &ptrs, 1, 1);
            let mut plain = vec![0f32; ROWS * N];
            let mm = matmul(None, None, None, false, ROWS);
            lib.call(&mm, &[ptr(&mut xn), ptr(&mut w), ptr(&mut plain), ptr(&mut bias)], 1, 2);
            assert_eq!(
                folded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                plain[..N].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{kind:?}, {lanes} lanes: folded = step + matmul"
            );
            let xr = norm_ref(kind, &x, &nwv, &nbv);
            let want: Vec<f64> = (0..N)
                .map(|j| (0..DIM).map(|i| xr[i] * wv[j * DIM + i] as f64).sum::<f64>() + biasv[j] as f64)
                .collect();
            assert_close(&folded, &want, 1e-5, &format!("{kind:?} folded matmul, {lanes} lanes"));
        }
    }
}

#[test]
fn activations_gated_and_as_matmul_epilogues() {
    for lanes in widths() {
        let lib = lib(lanes);
        let mut rng = Rng(0xac7 + lanes as u64);
        for act in ACTS {
            let k = Kernel::GatedAct {
                act,
                dim: DIM,
                max_rows: ROWS,
            };
            let mut g: Vec<f32> = rng.vec(ROWS * DIM).iter().map(|v| v * 6.0).collect();
            let mut u = rng.vec(ROWS * DIM);
            let g0 = g.clone();
            lib.call(&k, &[ptr(&mut g), ptr(&mut u)], 3, 2);
            let want: Vec<f64> = (0..3 * DIM).map(|i| act_ref(act, g0[i] as f64) * u[i] as f64).collect();
            assert_close(&g[..3 * DIM], &want, 3e-6, &format!("{act:?} gated, {lanes} lanes"));

            // out += act(x @ w^T + b), prefill and decode rows bit for bit alike.
            let mut x: Vec<f32> = rng.vec(ROWS * DIM).iter().map(|v| v * 0.5).collect();
            let (mut w, wv) = weights(&mut rng, N * DIM, DType::BF16);
            let (mut b, bv) = weights(&mut rng, N, DType::F32);
            let y0 = rng.vec(ROWS * N);
            let mut y = y0.clone();
            let pre = matmul(None, Some(act), None, true, ROWS);
            lib.call(&pre, &[ptr(&mut x), ptr(&mut w), ptr(&mut y), ptr(&mut b)], ROWS, 2);
            for r in 0..ROWS {
                let want: Vec<f64> = (0..N)
                    .map(|j| {
                        let s: f64 = (0..DIM)
                            .map(|i| x[r * DIM + i] as f64 * wv[j * DIM + i] as f64)
                            .sum::<f64>();
                        y0[r * N + j] as f64 + act_ref(act, s + bv[j] as f64)
                    })
                    .collect();
                assert_close(
                    &y[r * N..(r + 1) * N],
                    &want,
                    3e-6,
                    &format!("{act:?} epilogue, {lanes} lanes"),
                );
                let mut xr = x[r * DIM..(r + 1) * DIM].to_vec();
                let mut yr = y0[r * N..(r + 1) * N].to_vec();
                let dec = matmul(None, Some(act), None, true, 1);
                lib.call(&dec, &[ptr(&mut xr), ptr(&mut w), ptr(&mut yr), ptr(&mut b)], 1, 3);
                assert_eq!(&yr, &y[r * N..(r + 1) * N], "{act:?}, {lanes} lanes: decode = prefill");
            }
        }
    }
}

/// Decode's `gate_up` (LayerNorm folded, each activation) computes exactly what prefill's norm,
/// two matmuls and gated activation do.
#[test]
fn gate_up_equals_its_unfused_steps() {
    for lanes in widths() {
        let lib = lib(lanes);
        let mut rng = Rng(0x6a7e + lanes as u64);
        for act in ACTS {
            let mut x: Vec<f32> = rng.vec(DIM).iter().map(|v| v * 2.0).collect();
            let (mut nw, _) = weights(&mut rng, DIM, DType::BF16);
            let (mut nb, _) = weights(&mut rng, DIM, DType::F32);
            let (mut wg, _) = weights(&mut rng, N * DIM, DType::BF16);
            let (mut wu, _) = weights(&mut rng, N * DIM, DType::BF16);
            let (mut g, mut u) = (vec![0f32; N], vec![0f32; N]);
            let fused = Kernel::GateUp {
                n: N,
                k: DIM,
                gate_dtype: DType::BF16,
                up_dtype: DType::BF16,
                norm: Some(shape(NormKind::Layer)),
                act,
                max_rows: 1,
                grouped: false,
                paired: false,
            };
            let ptrs = [
                ptr(&mut x),
                ptr(&mut wg),
                ptr(&mut g),
                ptr(&mut wu),
                ptr(&mut u),
                ptr(&mut nw),
                ptr(&mut nb),
            ];
            lib.call(&fused, &ptrs, 1, 2);

            let norm = Kernel::Norm {
                dim: DIM,
                norm: shape(NormKind::Layer),
                accumulate: false,
                max_rows: ROWS,
            };
            let mut xin = vec![0f32; ROWS * DIM];
            xin[..DIM].copy_from_slice(&x);
            let mut xn = vec![0f32; ROWS * DIM];
            lib.call(&norm, &[ptr(&mut xin), ptr(&mut nw), ptr(&mut xn), ptr(&mut nb)], 1, 1);
            // Plain matmuls without bias: the suite's plain matmul has one, so zero it.
            let mut zero = vec![0f32; N];
            let (mut g2, mut u2) = (vec![0f32; ROWS * N], vec![0f32; ROWS * N]);
            let mm = matmul(None, None, None, false, ROWS);
            lib.call(&mm, &[ptr(&mut xn), ptr(&mut wg), ptr(&mut g2), ptr(&mut zero)], 1, 2);
            lib.call(&mm, &[ptr(&mut xn), ptr(&mut wu), ptr(&mut u2), ptr(&mut zero)], 1, 2);
            let ga = Kernel::GatedAct {
                act,
                dim: DIM,
                max_rows: ROWS,
            };
            // The gated kernel works on whole rows of DIM; lay the N outputs into one row.
            let (mut gr, mut ur) = (vec![0f32; ROWS * DIM], vec![0f32; ROWS * DIM]);
            gr[..N].copy_from_slice(&g2[..N]);
            ur[..N].copy_from_slice(&u2[..N]);
            lib.call(&ga, &[ptr(&mut gr), ptr(&mut ur)], 1, 1);
            assert_eq!(
                &g,
                &gr[..N],
                "{act:?}, {lanes} lanes: gate_up = norm, matmuls, gated act"
            );
            assert_eq!(&u, &u2[..N], "{act:?}, {lanes} lanes: up output");
        }
    }
}

#[test]
fn final_logit_soft_cap() {
    for lanes in widths() {
        let lib = lib(lanes);
        let mut rng = Rng(0xcab + lanes as u64);
        let mut x: Vec<f32> = rng.vec(ROWS * DIM).iter().map(|v| v * 4.0).collect();
        let (mut w, wv) = weights(&mut rng, N * DIM, DType::BF16);
        let (mut b, bv) = weights(&mut rng, N, DType::F32);
        let mut y = vec![0f32; ROWS * N];
        let k = matmul(None, None, Some(3.0), false, ROWS);
        lib.call(&k, &[ptr(&mut x), ptr(&mut w), ptr(&mut y), ptr(&mut b)], 2, 2);
        let want: Vec<f64> = (0..2 * N)
            .map(|rj| {
                let (r, j) = (rj / N, rj % N);
                let s: f64 = (0..DIM)
                    .map(|i| x[r * DIM + i] as f64 * wv[j * DIM + i] as f64)
                    .sum::<f64>()
                    + bv[j] as f64;
                3.0 * (s / 3.0).tanh()
            })
            .collect();
        assert!(want.iter().any(|v| v.abs() > 2.5), "the cap is exercised");
        assert_close(&y[..2 * N], &want, 3e-6, &format!("soft cap, {lanes} lanes"));
    }
}

#[test]
fn embedding_scale_and_learned_positions_and_add() {
    for lanes in widths() {
        let lib = lib(lanes);
        let mut rng = Rng(0xe3b + lanes as u64);
        let mut tokens: Vec<i32> = vec![3, 0, 8, 5];
        let (mut table, tv) = weights(&mut rng, VOCAB * DIM, DType::BF16);
        let (mut pos, pv) = weights(&mut rng, CTX * DIM, DType::BF16);
        let mut x = vec![0f32; ROWS * DIM];
        let p0 = 7;
        let mut info = super::row_info(ROWS, 0, p0, p0 + ROWS);
        lib.call(
            &embed(),
            &[
                ptr(&mut tokens),
                ptr(&mut table),
                ptr(&mut x),
                ptr(&mut pos),
                ptr(&mut info),
            ],
            ROWS,
            2,
        );
        let scale = (DIM as f64).sqrt() as f32;
        for r in 0..ROWS {
            let t = tokens[r] as usize;
            for i in 0..DIM {
                // f32 operations in the reference's order: scale the row, then add the position.
                let want = tv[t * DIM + i] * scale + pv[(p0 + r) * DIM + i];
                assert_eq!(x[r * DIM + i], want, "row {r} col {i}, {lanes} lanes");
            }
        }
        let mut a = rng.vec(ROWS * DIM);
        let mut b = rng.vec(ROWS * DIM);
        let a0 = a.clone();
        lib.call(
            &Kernel::Add {
                dim: DIM,
                max_rows: ROWS,
            },
            &[ptr(&mut a), ptr(&mut b)],
            3,
            2,
        );
        for i in 0..ROWS * DIM {
            let want = if i < 3 * DIM { a0[i] + b[i] } else { a0[i] };
            assert_eq!(a[i], want, "add [{i}], {lanes} lanes");
        }
    }
}

/// Reference rotation of one head (f64 arithmetic on the kernel's f32 angle), after the head's
/// optional norm; `long` is whether this call uses the long table.
fn rotate_ref(x: &mut [f64], pos: usize, r: &Rotary, norm: Option<(NormKind, &[f32])>, long: bool) {
    if let Some((kind, w)) = norm {
        let xs: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let n = norm_ref(kind, &xs, w, &[]);
        x.copy_from_slice(&n);
    }
    let table = match (&r.long, long) {
        (Some(l), true) => &l.inv_freq,
        _ => &r.inv_freq,
    };
    let m = r.mscale.map_or(1.0, |m| m.get() as f64);
    let half = r.dims / 2;
    for (i, &bits) in table.iter().enumerate().take(half) {
        let a = (pos as f32 * f32::from_bits(bits)) as f64;
        let (i1, i2) = match r.pairing {
            Pairing::Half => (i, i + half),
            Pairing::Adjacent => (2 * i, 2 * i + 1),
        };
        let (x1, x2) = (x[i1], x[i2]);
        x[i1] = x1 * a.cos() * m - x2 * a.sin() * m;
        x[i2] = x2 * a.cos() * m + x1 * a.sin() * m;
    }
}

#[test]
fn rope_variants_partial_gptj_longrope_and_none() {
    for lanes in widths() {
        let lib = lib(lanes);
        for k in rope_variants() {
            let Kernel::RopeKv {
                ref rotary,
                ref qk_norm,
                ..
            } = k
            else {
                unreachable!()
            };
            // LongRoPE: a sequence ending before and one ending after the pretraining context.
            let ends: &[i32] = if rotary.as_ref().is_some_and(|r| r.long.is_some()) {
                &[12, 30]
            } else {
                &[0]
            };
            for &end in ends {
                let mut rng = Rng(0x7012 + lanes as u64);
                let (rows, pos) = (3, 9);
                let mut q = rng.vec(ROWS * HEADS * HD);
                let mut kk = rng.vec(ROWS * KV * HD);
                let mut v = rng.vec(ROWS * KV * HD);
                let (mut kc, mut vc) = (vec![0f32; CTX * KV * HD], vec![0f32; CTX * KV * HD]);
                let (mut qn, qnv) = weights(&mut rng, HD, DType::F32);
                let (mut kn, knv) = weights(&mut rng, HD, DType::F32);
                let mut info = super::row_info(ROWS, 0, pos, end as usize);
                let (q0, k0) = (q.clone(), kk.clone());
                let mut ptrs = vec![ptr(&mut q), ptr(&mut kk), ptr(&mut v), ptr(&mut kc), ptr(&mut vc)];
                if qk_norm.is_some() {
                    ptrs.extend([ptr(&mut qn), ptr(&mut kn)]);
                }
                ptrs.push(ptr(&mut info));
                lib.call(&k, &ptrs, rows, 2);
                let long = end > 20;
                let check = |got: &[f32], src: &[f32], heads: usize, w: &[f32], what: &str| {
                    for r in 0..rows {
                        for h in 0..heads {
                            let s = (r * heads + h) * HD;
                            let mut want = f64s(&src[s..s + HD]);
                            if let Some(rot) = rotary {
                                rotate_ref(&mut want, pos + r, rot, qk_norm.as_ref().map(|n| (n.kind, w)), long);
                            }
                            assert_close(
                                &got[s..s + HD],
                                &want,
                                3e-6,
                                &format!("{what} {k:?} end {end}, {lanes} lanes"),
                            );
                        }
                    }
                };
                check(&q, &q0, HEADS, &qnv, "q");
                check(&kk, &k0, KV, &knv, "k");
                for r in 0..rows {
                    for h in 0..KV {
                        let (s, c0) = ((r * KV + h) * HD, (h * CTX + pos + r) * HD);
                        assert_eq!(&kc[c0..c0 + HD], &kk[s..s + HD], "k cache");
                        assert_eq!(&vc[c0..c0 + HD], &v[s..s + HD], "v cache");
                    }
                }
            }
        }
    }
}

/// Invariant: attention matches an f64 reference (scale, soft cap, window) at every width,
/// for narrow heads and wide ones, and a row attended alone (too few rows to group heads: one
/// head per item) is bitwise the same row of a call that groups them.
#[test]
fn attention_scale_soft_cap_and_window() {
    for lanes in widths() {
        let lib = lib(lanes);
        let mut rng = Rng(0xa77 + lanes as u64);
        for (hd, softcap, window) in [HD, WIDE_HD]
            .into_iter()
            .flat_map(|hd| [(hd, Some(2.0f32), None), (hd, None, Some(5usize))])
        {
            let k = attention(0.3, softcap, window, hd);
            let (rows, pos) = (ROWS, 11);
            let mut q: Vec<f32> = rng.vec(ROWS * HEADS * hd).iter().map(|v| v * 3.0).collect();
            let mut kc: Vec<f32> = rng.vec(CTX * KV * hd);
            let mut vc = rng.vec(CTX * KV * hd);
            let mut out = vec![0f32; ROWS * HEADS * hd];
            let mut info = super::row_info(ROWS, 0, pos, pos + ROWS);
            lib.call(
                &k,
                &[ptr(&mut q), ptr(&mut kc), ptr(&mut vc), ptr(&mut out), ptr(&mut info)],
                rows,
                2,
            );
            let what = format!("attention hd {hd} cap {softcap:?} window {window:?}, {lanes} lanes");
            for r in 0..rows {
                for h in 0..HEADS {
                    let kvh = h / (HEADS / KV);
                    let last = pos + r;
                    let first = window.map_or(0, |w| (last + 1).saturating_sub(w));
                    let qs = &q[(r * HEADS + h) * hd..][..hd];
                    let scores: Vec<f64> = (first..=last)
                        .map(|p| {
                            let kr = &kc[(kvh * CTX + p) * hd..][..hd];
                            let s = qs.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * 0.3f32 as f64;
                            softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let want: Vec<f64> = (0..hd)
                        .map(|d| {
                            (first..=last)
                                .zip(&e)
                                .map(|(p, w)| w * vc[(kvh * CTX + p) * hd + d] as f64)
                                .sum::<f64>()
                                / z
                        })
                        .collect();
                    let got = &out[(r * HEADS + h) * hd..][..hd];
                    assert_close(got, &want, 3e-6, &what);
                }
                // The row alone: too few rows to group heads, so one head per item.
                let width = HEADS * hd;
                let mut q1 = q[r * width..][..width].to_vec();
                let mut out1 = vec![0f32; width];
                let mut info1 = super::row_info(1, 0, pos + r, pos + ROWS);
                lib.call(
                    &k,
                    &[
                        ptr(&mut q1),
                        ptr(&mut kc),
                        ptr(&mut vc),
                        ptr(&mut out1),
                        ptr(&mut info1),
                    ],
                    1,
                    2,
                );
                assert!(
                    out1 == out[r * width..][..width],
                    "{what}: row {r} alone differs from the grouped call"
                );
            }
        }
    }
}
