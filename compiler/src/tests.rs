//! Each kernel family compiled for a small shape, loaded and checked against a plain Rust
//! reference (f64 accumulation) on random data, for prefill (several rows, several threads) and
//! decode shapes, with bf16, f16 and f32 weights.

use crate::{CompileRequest, compile, kernel_list};
use kiln_core::abi::{KernelFn, PTR_ARGS, WORK_COUNTER_ARG, WORK_COUNTER_BYTES};
use kiln_core::arch::{Attend, Builder, Format};
use kiln_core::graph::{Norm, OpKind, QkNormOp};
use kiln_core::{
    Act, CompileOptions, DType, Dims, F32Bits, HostCpu, Kernel, ModelSpec, NormKind, Pairing, Rope, RopeScaling,
};
use std::sync::OnceLock;

mod attention_tiles;
mod float_order;
mod grouped;
mod kv;
mod ops;
mod precision;
mod q8;
mod quant;
mod recurrent;

/// A matmul over `wdtype` weights with nothing around it: no bias, norm, activation, soft cap
/// or accumulation.
fn plain_matmul(n: usize, k: usize, wdtype: DType, max_rows: usize, grouped: bool) -> Kernel {
    Kernel::MatMul {
        n,
        k,
        wdtype,
        bias: None,
        accumulate: false,
        norm: None,
        act: None,
        softcap: None,
        max_rows,
        grouped,
        paired: false,
    }
}

const H: usize = 64;
const I: usize = 136;
const HEADS: usize = 4;
const KV: usize = 2;
const D: usize = 16;
const VOCAB: usize = 100;
const CTX: usize = 64;
const ROWS: usize = 12;

/// A two-layer Llama-style model built op by op, with what varies between the layers chosen
/// to give a varied kernel set: layer 0 bf16 with q/k/v biases (q's in f32), layer 1 f32 with
/// f16 q/k/v, an f32 output-projection bias and a sliding window; tied bf16 embeddings.
fn spec(qk_norm: bool, window: Option<usize>) -> ModelSpec {
    let dims = Dims {
        hidden_size: H,
        intermediate_size: I,
        num_layers: 2,
        num_heads: HEADS,
        num_kv_heads: KV,
        head_dim: D,
        vocab_size: VOCAB,
        max_position_embeddings: CTX,
    };
    let mut b = Builder::new("test", dims, Format::HuggingFace);
    let embed = b.matrix("embed".into(), VOCAB, H);
    let (tokens, x) = (b.tokens(), b.residual());
    b.op(OpKind::Embed {
        tokens,
        table: embed,
        out: x,
        scale: None,
        positions: None,
    });
    let rotary = Rope {
        theta: 10000.0,
        scaling: RopeScaling::None,
    }
    .rotary(D, Pairing::Half);
    let rms = |w| Norm {
        kind: NormKind::Rms,
        eps: F32Bits::new(1e-6),
        weight: w,
        bias: None,
    };
    for l in 0..2 {
        b.layer(l);
        let v = |b: &mut Builder, n: &str, len| Some(b.vector(format!("{l}.{n}"), len));
        let attn_norm = b.vector(format!("{l}.attn_norm"), H);
        let w: Vec<_> = [
            ("q", HEADS * D, H),
            ("k", KV * D, H),
            ("v", KV * D, H),
            ("o", H, HEADS * D),
        ]
        .iter()
        .map(|&(n, r, c)| b.matrix(format!("{l}.{n}"), r, c))
        .collect();
        let qkv_bias: Vec<_> = if l == 0 {
            vec![
                v(&mut b, "bq", HEADS * D),
                v(&mut b, "bk", KV * D),
                v(&mut b, "bv", KV * D),
            ]
        } else {
            vec![None, None, None]
        };
        let o_bias = if l == 1 { v(&mut b, "bo", H) } else { None };
        let qk = qk_norm.then(|| QkNormOp {
            kind: NormKind::Rms,
            eps: F32Bits::new(1e-6),
            q: b.vector(format!("{l}.qn"), D),
            k: b.vector(format!("{l}.kn"), D),
        });
        let mlp_norm = b.vector(format!("{l}.mlp_norm"), H);
        let (wg, wu, wd) = (
            b.matrix(format!("{l}.gate"), I, H),
            b.matrix(format!("{l}.up"), I, H),
            b.matrix(format!("{l}.down"), H, I),
        );
        let xn = b.buffer("xn", H);
        let bufs = [b.buffer("q", HEADS * D), b.buffer("k", KV * D), b.buffer("v", KV * D)];
        let attn = b.buffer("attn", HEADS * D);
        b.norm(x, xn, rms(attn_norm), false);
        for i in 0..3 {
            let (wi, bi) = (b.whole(w[i]), qkv_bias[i].map(|id| b.whole(id)));
            b.linear(xn, wi, bi, bufs[i], false);
        }
        let attend = Attend {
            heads: HEADS,
            kv_heads: KV,
            head_dim: D,
            rotary: Some(rotary.clone()),
            qk_norm: qk,
            window: if l == 1 { window } else { None },
            scale: Attend::default_scale(D),
            softcap: None,
        };
        b.attend(&attend, bufs[0], bufs[1], bufs[2], attn);
        let (wo, bo) = (b.whole(w[3]), o_bias.map(|id| b.whole(id)));
        b.linear(attn, wo, bo, x, true);
        b.norm(x, xn, rms(mlp_norm), false);
        let (gate, up) = (b.buffer("gate", I), b.buffer("up", I));
        let (wg, wu, wd) = (b.whole(wg), b.whole(wu), b.whole(wd));
        b.linear(xn, wg, None, gate, false);
        b.linear(xn, wu, None, up, false);
        b.op(OpKind::GatedAct {
            gate,
            up,
            act: Act::Silu,
        });
        b.linear(gate, wd, None, x, true);
    }
    b.head();
    let final_norm = b.vector("norm".into(), H);
    let (xn, logits) = (b.buffer("xn", H), b.logits());
    b.norm(x, xn, rms(final_norm), false);
    let head = b.whole(embed);
    b.linear(xn, head, None, logits, false);
    let mut spec = b.finish().expect("a valid test spec");
    for t in &mut spec.weights {
        t.dtype = match (t.layer, t.name.rsplit('.').next()) {
            (None, Some("norm")) | (Some(_), Some("bq" | "bo")) => DType::F32,
            (Some(1), Some("q" | "k" | "v")) => DType::F16,
            (Some(1), _) => DType::F32,
            _ => DType::BF16,
        };
    }
    spec
}

/// A library compiled from a list of kernels into a temporary folder, and loaded.
struct TestLib {
    _dir: tempfile::TempDir,
    lib: libloading::Library,
}

impl TestLib {
    /// Compiles `kernels` with `options`; with `dump`, each kernel's MLIR and assembly are
    /// written there too.
    fn build(kernels: &[Kernel], options: &CompileOptions, dump: Option<&std::path::Path>) -> TestLib {
        let dir = tempfile::tempdir().unwrap();
        let report = compile(&CompileRequest {
            kernels,
            options,
            out_dir: dir.path(),
            library_name: "libtest.so",
            emit_mlir: dump,
            emit_asm: dump,
            threads: None,
            progress: None,
        })
        .expect("test kernels compile");
        // SAFETY: the library was just produced by the compiler and exports the ABI.
        let lib = unsafe { libloading::Library::new(&report.library) }.expect("library loads");
        TestLib { _dir: dir, lib }
    }

    /// The kernel's exported function.
    fn get(&self, k: &Kernel) -> libloading::Symbol<'_, KernelFn> {
        // SAFETY: every kernel symbol has the ABI signature `KernelFn`.
        unsafe { self.lib.get(k.symbol().as_bytes()) }.expect("symbol exported")
    }

    /// Calls a kernel once per thread id, in turn (threads only partition the work).
    fn call(&self, k: &Kernel, ptrs: &[*mut u8], rows: usize, nth: usize) {
        // The call's work counter, shared by its threads and zero when the call starts.
        let mut work = [0u64; WORK_COUNTER_BYTES / 8];
        let p = slots(ptrs, work.as_mut_ptr() as *mut u8);
        let f = self.get(k);
        for tid in 0..nth {
            // SAFETY: ABI signature; the buffers match the kernel's shapes.
            unsafe { kiln_core::abi::invoke(*f, p, rows as i64, tid as i64, nth as i64) };
        }
    }
}

/// A `row_info` buffer for `rows` rows: row `r` of `slot` at position `pos + r`, in a forward
/// call ending at `seq_end`.
fn row_info(rows: usize, slot: usize, pos: usize, seq_end: usize) -> Vec<i32> {
    (0..rows)
        .flat_map(|r| {
            kiln_core::graph::RowInfo {
                position: (pos + r) as u32,
                slot: slot as u32,
                seq_end: seq_end as u32,
            }
            .encode()
        })
        .collect()
}

/// The ABI's pointer slots: `ptrs` first, `work` in the work counter's slot, the rest null.
fn slots(ptrs: &[*mut u8], work: *mut u8) -> [*mut u8; PTR_ARGS] {
    let mut a = [std::ptr::null_mut(); PTR_ARGS];
    a[..ptrs.len()].copy_from_slice(ptrs);
    a[WORK_COUNTER_ARG] = work;
    a
}

struct Compiled {
    lib: TestLib,
    kernels: Vec<Kernel>,
}

/// Compiles each test spec once per test binary.
fn compiled(qk_norm: bool) -> &'static Compiled {
    static PLAIN: OnceLock<Compiled> = OnceLock::new();
    static QK: OnceLock<Compiled> = OnceLock::new();
    let cell = if qk_norm { &QK } else { &PLAIN };
    cell.get_or_init(|| {
        let spec = spec(qk_norm, Some(5));
        let options = CompileOptions::new(ROWS, HostCpu::detect().f32_lanes());
        let kernels = kernel_list(&spec, &options);
        Compiled {
            lib: TestLib::build(&kernels, &options, None),
            kernels,
        }
    })
}

impl Compiled {
    fn find(&self, pred: impl Fn(&Kernel) -> bool) -> Kernel {
        self.kernels
            .iter()
            .find(|k| pred(k))
            .cloned()
            .expect("kernel in the set")
    }
    fn call(&self, k: &Kernel, ptrs: &[*mut u8], rows: usize, nth: usize) {
        self.lib.call(k, ptrs, rows, nth)
    }
}

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// Weights stored as `dtype` bytes, and the exact f32 values they hold.
fn weights(rng: &mut Rng, n: usize, dtype: DType) -> (Vec<u8>, Vec<f32>) {
    let vals = rng.vec(n);
    match dtype {
        DType::F32 => (vals.iter().flat_map(|v| v.to_le_bytes()).collect(), vals),
        DType::BF16 => {
            let bits: Vec<u16> = vals.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            (
                bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
                bits.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect(),
            )
        }
        DType::F16 => {
            // Values in [-1, 1) with 10 mantissa bits survive f16 exactly after this rounding.
            let exact: Vec<f32> = vals.iter().map(|v| (v * 1024.0).round() / 1024.0).collect();
            let bytes = exact.iter().flat_map(|v| f32_to_f16(*v).to_le_bytes()).collect();
            (bytes, exact)
        }
        q => unimplemented!("{q}: quantised weights are tested by their own kernel tests"),
    }
}

fn f32_to_f16(v: f32) -> u16 {
    if v == 0.0 {
        return if v.is_sign_negative() { 0x8000 } else { 0 };
    }
    let bits = v.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    let mant = bits & 0x7f_ffff;
    if exp <= 0 {
        // Subnormal f16: value = mant16 * 2^-24.
        let m = ((v.abs() * (1u32 << 24) as f32).round()) as u16;
        return sign | m;
    }
    sign | ((exp as u16) << 10) | ((mant >> 13) as u16)
}

/// A numeric knob of the timing tests (`KILN_QUANT_K=2048` ...): `None` when unset or not a
/// number.
fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn ptr<T>(v: &mut [T]) -> *mut u8 {
    v.as_mut_ptr() as *mut u8
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (*g as f64 - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w} (|err| {err:e})"
        );
    }
}

#[test]
fn matmul_all_dtypes_prefill_and_decode() {
    let c = compiled(false);
    let mut rng = Rng(0x1234_5678);
    let matmuls: Vec<Kernel> = c
        .kernels
        .iter()
        .filter(|k| matches!(k, Kernel::MatMul { .. }))
        .cloned()
        .collect();
    assert!(matmuls.len() >= 6, "expected several matmul variants");
    let mut seen = std::collections::HashSet::new();
    for k in &matmuls {
        let Kernel::MatMul {
            n,
            k: kk,
            wdtype,
            bias,
            accumulate,
            norm,
            max_rows,
            ..
        } = *k
        else {
            unreachable!()
        };
        seen.insert(wdtype);
        for (rows, nth) in [(max_rows, 1), (max_rows.min(3), 2), (1, 3)] {
            if rows > max_rows {
                continue;
            }
            let mut x = rng.vec(max_rows * kk);
            let (mut wb, wv) = weights(&mut rng, n * kk, wdtype);
            let (mut bb, bv) = weights(&mut rng, n, bias.unwrap_or(DType::F32));
            let y0 = rng.vec(max_rows * n);
            let mut y = y0.clone();
            let mut ptrs = vec![ptr(&mut x), ptr(&mut wb), ptr(&mut y)];
            if bias.is_some() {
                ptrs.push(ptr(&mut bb));
            }
            // A folded norm: the kernel multiplies by the RMSNorm of x, not x itself.
            let (mut nb, nv) = weights(&mut rng, kk, norm.map_or(DType::F32, |nm| nm.wdtype));
            if norm.is_some() {
                ptrs.push(ptr(&mut nb));
            }
            let xs: Vec<f64> = match norm {
                Some(nm) => (0..rows)
                    .flat_map(|r| rms_normed(&x[r * kk..(r + 1) * kk], &nv, nm.eps.get()))
                    .collect(),
                None => x.iter().map(|&v| v as f64).collect(),
            };
            c.call(k, &ptrs, rows, nth);
            let mut want = Vec::new();
            for r in 0..rows {
                for j in 0..n {
                    let mut s: f64 = (0..kk).map(|i| xs[r * kk + i] * wv[j * kk + i] as f64).sum();
                    if bias.is_some() {
                        s += bv[j] as f64;
                    }
                    if accumulate {
                        s += y0[r * n + j] as f64;
                    }
                    want.push(s);
                }
            }
            assert_close(&y[..rows * n], &want, 1e-5, &k.symbol());
            assert_eq!(
                &y[rows * n..],
                &y0[rows * n..],
                "{}: rows past `rows` must be untouched",
                k.symbol()
            );
        }
    }
    assert_eq!(seen.len(), 3, "bf16, f16 and f32 weights all exercised");
}

/// `w * (x / sqrt(mean(x^2) + eps))` in f64.
fn rms_normed(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(&v, &g)| g as f64 * (v as f64 * inv)).collect()
}

#[test]
fn decode_gate_up_normalises_projects_and_activates() {
    let c = compiled(false);
    let mut rng = Rng(0x9a7e);
    let gate_ups: Vec<Kernel> = c
        .kernels
        .iter()
        .filter(|k| matches!(k, Kernel::GateUp { .. }))
        .cloned()
        .collect();
    assert!(!gate_ups.is_empty(), "the decode graph uses gate_up kernels");
    for k in &gate_ups {
        let Kernel::GateUp {
            n,
            k: kk,
            gate_dtype,
            up_dtype,
            norm: Some(nm),
            ..
        } = *k
        else {
            panic!("decode gate_up kernels fold the MLP norm: {k:?}")
        };
        for nth in [1, 2, 3] {
            let mut x = rng.vec(kk);
            let (mut wg, wgv) = weights(&mut rng, n * kk, gate_dtype);
            let (mut wu, wuv) = weights(&mut rng, n * kk, up_dtype);
            let (mut wn, wnv) = weights(&mut rng, kk, nm.wdtype);
            let mut g = vec![f32::NAN; n];
            let mut u = vec![f32::NAN; n];
            let ptrs = [
                ptr(&mut x),
                ptr(&mut wg),
                ptr(&mut g),
                ptr(&mut wu),
                ptr(&mut u),
                ptr(&mut wn),
            ];
            c.call(k, &ptrs, 1, nth);
            let xn = rms_normed(&x, &wnv, nm.eps.get());
            let want: Vec<f64> = (0..n)
                .map(|j| {
                    let dot = |w: &[f32]| (0..kk).map(|i| xn[i] * w[j * kk + i] as f64).sum::<f64>();
                    let (gs, us) = (dot(&wgv), dot(&wuv));
                    gs / (1.0 + (-gs).exp()) * us
                })
                .collect();
            assert_close(&g, &want, 1e-5, &format!("{} on {nth} threads", k.symbol()));
        }
    }
}

#[test]
fn rmsnorm_embed_and_silu() {
    let c = compiled(false);
    let mut rng = Rng(42);
    // Decode has no norm or activation steps of its own (they are folded into its matmuls and
    // `gate_up`, tested above), so those two are checked at the prefill block size only.
    for max_rows in [ROWS, kiln_core::kernel::DECODE_ROWS] {
        let rows = max_rows.min(5);
        let folded = kiln_core::kernel::is_decode(max_rows);
        assert_eq!(
            folded,
            !c.kernels
                .iter()
                .any(|k| matches!(k, Kernel::Norm { max_rows: m, .. } | Kernel::GatedAct { max_rows: m, .. } if *m == max_rows))
        );
        if !folded {
            let k = c.find(|k| matches!(k, Kernel::Norm { dim, norm, max_rows: m, .. } if norm.wdtype == DType::BF16 && *dim == H && *m == max_rows));
            let mut x = rng.vec(max_rows * H);
            let (mut wb, wv) = weights(&mut rng, H, DType::BF16);
            let mut y = vec![0f32; max_rows * H];
            c.call(&k, &[ptr(&mut x), ptr(&mut wb), ptr(&mut y)], rows, 2);
            let mut want = Vec::new();
            for r in 0..rows {
                let row = &x[r * H..(r + 1) * H];
                let ms: f64 = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / H as f64;
                let inv = 1.0 / (ms + 1e-6).sqrt();
                want.extend(row.iter().zip(&wv).map(|(v, w)| *v as f64 * inv * *w as f64));
            }
            assert_close(&y[..rows * H], &want, 1e-5, "rmsnorm");
        }

        let k = c.find(|k| matches!(k, Kernel::Embed { max_rows: m, .. } if *m == max_rows));
        let mut tokens: Vec<i32> = (0..max_rows as i32).map(|i| (i * 37 + 5) % VOCAB as i32).collect();
        let (mut table, tv) = weights(&mut rng, VOCAB * H, DType::BF16);
        let mut out = vec![0f32; max_rows * H];
        c.call(&k, &[ptr(&mut tokens), ptr(&mut table), ptr(&mut out)], rows, 2);
        for r in 0..rows {
            let t = tokens[r] as usize;
            assert_eq!(&out[r * H..(r + 1) * H], &tv[t * H..(t + 1) * H]);
        }

        if folded {
            continue;
        }
        let k = c.find(|k| matches!(k, Kernel::GatedAct { max_rows: m, .. } if *m == max_rows));
        let mut g = rng.vec(max_rows * I).iter().map(|v| v * 6.0).collect::<Vec<_>>();
        let mut u = rng.vec(max_rows * I);
        let g0 = g.clone();
        c.call(&k, &[ptr(&mut g), ptr(&mut u)], rows, 2);
        let want: Vec<f64> = (0..rows * I)
            .map(|i| g0[i] as f64 / (1.0 + (-(g0[i] as f64)).exp()) * u[i] as f64)
            .collect();
        assert_close(&g[..rows * I], &want, 1e-6, "silu_mul");
    }
}

/// Reference RoPE (rotate-half) of one head in place, after an optional RMSNorm.
fn rope_ref(x: &mut [f64], pos: usize, norm: Option<&[f32]>) {
    if let Some(w) = norm {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / D as f64;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        for (v, w) in x.iter_mut().zip(w) {
            *v = *v * inv * *w as f64;
        }
    }
    let inv_freq = Rope {
        theta: 10000.0,
        scaling: RopeScaling::None,
    }
    .inv_freq(D);
    for i in 0..D / 2 {
        let a = (pos as f32 * inv_freq[i]) as f64;
        let (x1, x2) = (x[i], x[i + D / 2]);
        x[i] = x1 * a.cos() - x2 * a.sin();
        x[i + D / 2] = x2 * a.cos() + x1 * a.sin();
    }
}

#[test]
fn rope_kv_with_and_without_qk_norm() {
    for qk in [false, true] {
        let c = compiled(qk);
        let mut rng = Rng(7);
        for max_rows in [ROWS, kiln_core::kernel::DECODE_ROWS] {
            let k = c.find(|k| matches!(k, Kernel::RopeKv { max_rows: m, .. } if *m == max_rows));
            let (rows, pos) = (max_rows.min(6), 9);
            let mut q = rng.vec(max_rows * HEADS * D);
            let mut kk = rng.vec(max_rows * KV * D);
            let mut v = rng.vec(max_rows * KV * D);
            // Two slots' caches; the rows belong to slot 1.
            let mut kc = vec![0f32; 2 * CTX * KV * D];
            let mut vc = vec![0f32; 2 * CTX * KV * D];
            let (mut qn, qnv) = weights(&mut rng, D, DType::BF16);
            let (mut kn, knv) = weights(&mut rng, D, DType::BF16);
            let (q0, k0) = (q.clone(), kk.clone());
            let mut info = row_info(rows, 1, pos, pos + rows);
            let mut ptrs = vec![ptr(&mut q), ptr(&mut kk), ptr(&mut v), ptr(&mut kc), ptr(&mut vc)];
            if qk {
                ptrs.push(ptr(&mut qn));
                ptrs.push(ptr(&mut kn));
            }
            ptrs.push(ptr(&mut info));
            c.call(&k, &ptrs, rows, 3);
            for r in 0..rows {
                for h in 0..HEADS {
                    let s = r * HEADS * D + h * D;
                    let mut want: Vec<f64> = q0[s..s + D].iter().map(|v| *v as f64).collect();
                    rope_ref(&mut want, pos + r, qk.then_some(&qnv[..]));
                    assert_close(&q[s..s + D], &want, 2e-6, "rope q");
                }
                for h in 0..KV {
                    let s = r * KV * D + h * D;
                    let mut want: Vec<f64> = k0[s..s + D].iter().map(|v| *v as f64).collect();
                    rope_ref(&mut want, pos + r, qk.then_some(&knv[..]));
                    assert_close(&kk[s..s + D], &want, 2e-6, "rope k");
                    // The caches are slot-major, then head-major: [slots, kv_heads, ctx, head_dim].
                    let c0 = ((KV + h) * CTX + pos + r) * D;
                    assert_eq!(&kc[c0..c0 + D], &kk[s..s + D], "k cache row");
                    assert_eq!(&vc[c0..c0 + D], &v[s..s + D], "v cache row");
                }
            }
            assert!(kc[..CTX * KV * D].iter().all(|&x| x == 0.0), "slot 0 untouched");
        }
    }
}

#[test]
fn attention_causal_gqa_and_sliding_window() {
    let c = compiled(false);
    let mut rng = Rng(99);
    for window in [None, Some(5)] {
        for max_rows in [ROWS, kiln_core::kernel::DECODE_ROWS] {
            let k = c.find(
                |k| matches!(k, Kernel::Attention { max_rows: m, window: w, .. } if *m == max_rows && *w == window),
            );
            let (rows, pos) = (max_rows.min(7), 11);
            let mut q = rng.vec(max_rows * HEADS * D);
            // Two slots' caches. Rows of one call may belong to different sequences (a batched
            // decode step): row r is in slot r % 2 at position pos + 2r.
            let mut kc = rng.vec(2 * CTX * KV * D);
            let mut vc = rng.vec(2 * CTX * KV * D);
            let mut out = vec![0f32; max_rows * HEADS * D];
            let place = |r: usize| (r % 2, pos + 2 * r);
            let mut info: Vec<i32> = (0..max_rows)
                .flat_map(|r| {
                    let (slot, p) = place(r);
                    row_info(1, slot, p, p + 1)
                })
                .collect();
            c.call(
                &k,
                &[ptr(&mut q), ptr(&mut kc), ptr(&mut vc), ptr(&mut out), ptr(&mut info)],
                rows,
                2,
            );
            let scale = 1.0 / (D as f64).sqrt();
            for r in 0..rows {
                let (slot, p) = place(r);
                let g0 = slot * KV;
                let first = window.map(|w| (p + 1).saturating_sub(w)).unwrap_or(0);
                for h in 0..HEADS {
                    let g = h / (HEADS / KV);
                    let qs = &q[r * HEADS * D + h * D..][..D];
                    let scores: Vec<f64> = (first..=p)
                        .map(|j| {
                            (0..D)
                                .map(|i| qs[i] as f64 * kc[((g0 + g) * CTX + j) * D + i] as f64)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let want: Vec<f64> = (0..D)
                        .map(|i| {
                            (first..=p)
                                .zip(&e)
                                .map(|(j, w)| w / z * vc[((g0 + g) * CTX + j) * D + i] as f64)
                                .sum()
                        })
                        .collect();
                    assert_close(&out[r * HEADS * D + h * D..][..D], &want, 1e-5, "attention");
                }
            }
        }
    }
}

/// Decode and prefill matmuls large enough that the dynamic part of the work split (see
/// `emit::split_work`) hands out many chunks, called by real threads at once that share one
/// work counter: every output is written, exactly as one thread computes it alone, and it is
/// the dot product it should be.
#[test]
fn matmul_work_split_under_concurrency() {
    let lanes = HostCpu::detect().f32_lanes();
    // 4099 rows of 512 bytes: a 2 MiB matrix whose dynamic quarter spans several 256 KiB
    // chunks, with an odd remainder of rows at the end; 1003 prefill columns are 167 blocks of
    // 6 and a remainder.
    let kernels = [
        Kernel::MatMul {
            n: 4099,
            k: 256,
            wdtype: DType::BF16,
            bias: None,
            accumulate: false,
            norm: None,
            act: None,
            softcap: None,
            max_rows: 1,
            grouped: false,
            paired: false,
        },
        Kernel::MatMul {
            n: 1003,
            k: 64,
            wdtype: DType::BF16,
            bias: Some(DType::F32),
            accumulate: true,
            norm: None,
            act: None,
            softcap: None,
            max_rows: ROWS,
            grouped: false,
            paired: false,
        },
    ];
    let options = CompileOptions::new(ROWS, lanes);
    let lib = TestLib::build(&kernels, &options, None);
    let mut rng = Rng(0x5eed);
    for kernel in &kernels {
        let Kernel::MatMul {
            n,
            k,
            bias,
            accumulate,
            norm: None,
            max_rows,
            ..
        } = *kernel
        else {
            unreachable!()
        };
        let rows = max_rows.min(5);
        let mut x = rng.vec(max_rows * k);
        let (mut wb, wv) = weights(&mut rng, n * k, DType::BF16);
        let (mut bb, bv) = weights(&mut rng, n, DType::F32);
        let y0 = rng.vec(max_rows * n);
        let f = lib.get(kernel);
        let inputs = [ptr(&mut x) as usize, ptr(&mut wb) as usize, ptr(&mut bb) as usize];
        let run = |nth: usize| -> Vec<f32> {
            let mut y = y0.clone();
            let mut work = [0u64; WORK_COUNTER_BYTES / 8];
            let addrs = [inputs[0], inputs[1], ptr(&mut y) as usize, inputs[2]];
            let work_addr = work.as_mut_ptr() as usize;
            let f = &f;
            std::thread::scope(|s| {
                for tid in 0..nth {
                    s.spawn(move || {
                        let p = |i: usize| addrs[i] as *mut u8;
                        let bias_ptr = if bias.is_some() { p(3) } else { std::ptr::null_mut() };
                        let a = slots(&[p(0), p(1), p(2), bias_ptr], work_addr as *mut u8);
                        // SAFETY: ABI signature; buffers sized for the kernel; threads write
                        // disjoint outputs (the split hands each output to one thread).
                        unsafe { kiln_core::abi::invoke(**f, a, rows as i64, tid as i64, nth as i64) };
                    });
                }
            });
            y
        };
        let alone = run(1);
        for r in 0..rows {
            for j in 0..n {
                let mut s: f64 = (0..k).map(|i| x[r * k + i] as f64 * wv[j * k + i] as f64).sum();
                if bias.is_some() {
                    s += bv[j] as f64;
                }
                if accumulate {
                    s += y0[r * n + j] as f64;
                }
                let got = alone[r * n + j] as f64;
                assert!(
                    (got - s).abs() <= 1e-4 * (1.0 + s.abs()),
                    "{} [{r}, {j}]: {got} vs {s}",
                    kernel.symbol()
                );
            }
        }
        for nth in [2, 3, 4] {
            for _ in 0..5 {
                assert!(
                    run(nth) == alone,
                    "{} on {nth} threads differs from one thread",
                    kernel.symbol()
                );
            }
        }
    }
}
