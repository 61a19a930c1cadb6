//! Prefill attention in tiles of rows (`emit/attention/tiles.rs`): every row of a tiled call
//! is bitwise the row attended alone (one-row decode items), and near an f64 reference, over
//! long contexts that cross many chunks of keys, rows of two sequences in one tile (their own
//! slots and positions, some shorter than a unit of key blocks), f32 and f16 caches, narrow
//! and wide heads, at every vector width the host has.

use super::{Rng, TestLib, assert_close, f32_to_f16, ptr, row_info};
use kiln_core::dequant::f16_to_f32;
use kiln_core::{CompileOptions, DType, F32Bits, HostCpu, Kernel};

const HEADS: usize = 6;
const KV: usize = 2;
const CTX: usize = 700;
/// 40 rows: tiles of 16, 16 and 8, times two KV heads, are enough items to tile on 2 threads.
const ROWS: usize = 40;

fn attention(head_dim: usize, kv: DType, softcap: Option<f32>, max_rows: usize) -> Kernel {
    Kernel::Attention {
        heads: HEADS,
        kv_heads: KV,
        head_dim,
        window: None,
        scale: F32Bits::new(1.0 / (head_dim as f32).sqrt()),
        softcap: softcap.map(F32Bits::new),
        ctx: CTX,
        max_rows,
        kv,
    }
}

/// Row `r`'s (slot, position): rows 0..26 continue a long sequence in slot 1 (positions
/// 640..665, far past many chunks), rows 26..40 start one in slot 0 (positions 0..13, some
/// before the first whole unit of keys).
fn place(r: usize) -> (usize, usize) {
    if r < 26 { (1, 640 + r) } else { (0, r - 26) }
}

/// A cache of two slots in `kv`'s storage, and the f32 values it holds.
fn cache(rng: &mut Rng, kv: DType, hd: usize) -> (Vec<u8>, Vec<f32>) {
    let values = rng.vec(2 * KV * CTX * hd);
    match kv {
        DType::F16 => {
            let bits: Vec<u16> = values.iter().map(|&v| f32_to_f16(v)).collect();
            let held = bits.iter().map(|&b| f16_to_f32(b)).collect();
            (bits.iter().flat_map(|b| b.to_le_bytes()).collect(), held)
        }
        _ => (values.iter().flat_map(|v| v.to_le_bytes()).collect(), values),
    }
}

#[allow(clippy::too_many_arguments)]
fn reference(q: &[f32], k: &[f32], v: &[f32], r: usize, h: usize, hd: usize, softcap: Option<f32>) -> Vec<f64> {
    let (slot, p) = place(r);
    let kv_row = |j: usize| ((slot * KV + h / (HEADS / KV)) * CTX + j) * hd;
    let qs = &q[(r * HEADS + h) * hd..][..hd];
    let scale = (1.0 / (hd as f32).sqrt()) as f64;
    let scores: Vec<f64> = (0..=p)
        .map(|j| {
            let s = qs
                .iter()
                .zip(&k[kv_row(j)..][..hd])
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                * scale;
            softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
        })
        .collect();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum();
    (0..hd)
        .map(|d| (0..=p).zip(&e).map(|(j, w)| w * v[kv_row(j) + d] as f64).sum::<f64>() / z)
        .collect()
}

#[test]
fn tiled_prefill_rows_equal_rows_attended_alone() {
    let host = HostCpu::detect().f32_lanes();
    for lanes in [16, 8, 4].into_iter().filter(|&l| l <= host) {
        let cases = [
            (64, DType::F32, None),
            (64, DType::F16, Some(20.0)),
            (256, DType::F32, None),
        ];
        let kernels: Vec<Kernel> = cases
            .iter()
            .flat_map(|&(hd, kv, cap)| [attention(hd, kv, cap, 64), attention(hd, kv, cap, 1)])
            .collect();
        let lib = TestLib::build(&kernels, &CompileOptions::new(64, lanes), None);
        let mut rng = Rng(0x711e + lanes as u64);
        for (hd, kv, cap) in cases {
            let what = format!("attention hd {hd} {kv} cap {cap:?}, {lanes} lanes");
            let (mut kc, k) = cache(&mut rng, kv, hd);
            let (mut vc, v) = cache(&mut rng, kv, hd);
            let mut q: Vec<f32> = rng.vec(ROWS * HEADS * hd).iter().map(|x| x * 4.0).collect();
            let mut out = vec![0f32; ROWS * HEADS * hd];
            let mut info: Vec<i32> = (0..ROWS)
                .flat_map(|r| {
                    let (slot, p) = place(r);
                    row_info(1, slot, p, p + 1)
                })
                .collect();
            let tiled = attention(hd, kv, cap, 64);
            let args = [ptr(&mut q), ptr(&mut kc), ptr(&mut vc), ptr(&mut out), ptr(&mut info)];
            lib.call(&tiled, &args, ROWS, 2);
            let width = HEADS * hd;
            for r in 0..ROWS {
                for h in 0..HEADS {
                    let want = reference(&q, &k, &v, r, h, hd, cap);
                    assert_close(&out[r * width + h * hd..][..hd], &want, 2e-5, &what);
                }
                let mut q1 = q[r * width..][..width].to_vec();
                let mut out1 = vec![0f32; width];
                let (slot, p) = place(r);
                let mut info1 = row_info(1, slot, p, p + 1);
                let alone = attention(hd, kv, cap, 1);
                let args = [
                    ptr(&mut q1),
                    ptr(&mut kc),
                    ptr(&mut vc),
                    ptr(&mut out1),
                    ptr(&mut info1),
                ];
                lib.call(&alone, &args, 1, 2);
                assert!(
                    out1 == out[r * width..][..width],
                    "{what}: row {r} (slot {slot}, position {p}) alone differs from the tiled call"
                );
            }
        }
    }
}

/// Timing: one thread's share of a one-row decode step's attention (one KV head of two, its
/// query heads against `KILN_ATT_POS + 1` keys), over `KILN_ATT_LAYERS` layers' caches in turn
/// so the keys come from memory as in a model:
/// `KILN_ATT_HEADS=14 KILN_ATT_DIM=64 KILN_ATT_POS=3999 cargo test -p kiln-compiler --release --
/// --ignored attention_speed --nocapture`.
#[test]
#[ignore = "timing only: cargo test -p kiln-compiler --release -- --ignored attention_speed --nocapture"]
fn attention_speed() {
    let var = |name: &str, default: usize| super::env_usize(name).unwrap_or(default);
    let (heads, kv_heads, hd) = (var("KILN_ATT_HEADS", 14), 2, var("KILN_ATT_DIM", 64));
    let pos = var("KILN_ATT_POS", 3999);
    let layers = var("KILN_ATT_LAYERS", 24);
    let ctx = (pos + 1).next_multiple_of(64);
    let kv = match std::env::var("KILN_ATT_KV").as_deref() {
        Ok("f32") => DType::F32,
        _ => DType::F16,
    };
    let kernel = Kernel::Attention {
        heads,
        kv_heads,
        head_dim: hd,
        window: None,
        scale: F32Bits::new(1.0 / (hd as f32).sqrt()),
        softcap: None,
        ctx,
        max_rows: kiln_core::kernel::DECODE_ROWS,
        kv,
    };
    let lanes = HostCpu::detect().f32_lanes();
    let lib = TestLib::build(std::slice::from_ref(&kernel), &CompileOptions::new(64, lanes), None);
    let mut rng = Rng(7);
    let bytes = kv_heads * ctx * hd * kv.size();
    let mut caches: Vec<(Vec<u8>, Vec<u8>)> = (0..layers)
        .map(|_| {
            let fill = |rng: &mut Rng| -> Vec<u8> {
                let v = rng.vec(bytes / kv.size());
                match kv {
                    DType::F16 => v.iter().flat_map(|&x| f32_to_f16(x).to_le_bytes()).collect(),
                    _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                }
            };
            (fill(&mut rng), fill(&mut rng))
        })
        .collect();
    let mut q = rng.vec(heads * hd);
    let mut out = vec![0f32; heads * hd];
    let mut info = row_info(1, 0, pos, pos + 1);
    let f = lib.get(&kernel);
    let mut per_step = Vec::new();
    for _ in 0..40 {
        let t = std::time::Instant::now();
        for (kc, vc) in &mut caches {
            let mut work = [0u64; kiln_core::abi::WORK_COUNTER_BYTES / 8];
            let p = super::slots(
                &[
                    ptr(&mut q),
                    kc.as_mut_ptr(),
                    vc.as_mut_ptr(),
                    ptr(&mut out),
                    ptr(&mut info),
                ],
                work.as_mut_ptr() as *mut u8,
            );
            // SAFETY: the buffers match the kernel's shapes; thread 0 of 2 writes its heads.
            unsafe { kiln_core::abi::invoke(*f, p, 1, 0, kv_heads as i64) };
        }
        per_step.push(t.elapsed().as_secs_f64() / layers as f64);
    }
    per_step.sort_by(f64::total_cmp);
    let flops = 4.0 * (heads / kv_heads * hd * (pos + 1)) as f64;
    let (best, median) = (per_step[0], per_step[per_step.len() / 2]);
    println!(
        "attention h{heads} kv{kv_heads} d{hd} {kv}, {} keys, one thread's KV head per layer: best {:.1} us ({:.1} GFLOP/s), median {:.1} us",
        pos + 1,
        best * 1e6,
        flops / best / 1e9,
        median * 1e6
    );
}
