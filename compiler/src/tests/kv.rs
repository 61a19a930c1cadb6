//! KV caches stored as f16 or bf16 (`--kv-dtype`): `rope_kv` writes each key and value
//! rounded to the nearest value of the narrow type, and `attention` reads the narrow caches
//! as the f32 values they hold (checked against an f64 reference over exactly those values),
//! in prefill and decode forms and at every vector width the host has.

use super::{Rng, TestLib, assert_close, f32_to_f16, ptr, row_info};
use kiln_core::dequant::{bf16_to_f32, f16_to_f32, f32_to_bf16};
use kiln_core::{CompileOptions, DType, F32Bits, HostCpu, Kernel};

const HEADS: usize = 4;
const KV: usize = 2;
const HD: usize = 32;
const CTX: usize = 40;
const ROWS: usize = 6;

fn rope_kv(kv: DType, max_rows: usize) -> Kernel {
    Kernel::RopeKv {
        heads: HEADS,
        kv_heads: KV,
        head_dim: HD,
        rotary: None,
        qk_norm: None,
        ctx: CTX,
        max_rows,
        kv,
    }
}

fn attention(kv: DType, max_rows: usize) -> Kernel {
    Kernel::Attention {
        heads: HEADS,
        kv_heads: KV,
        head_dim: HD,
        window: None,
        scale: F32Bits::new(1.0 / (HD as f32).sqrt()),
        softcap: None,
        ctx: CTX,
        max_rows,
        kv,
    }
}

fn widen(kv: DType, bits: u16) -> f32 {
    match kv {
        DType::F16 => f16_to_f32(bits),
        _ => bf16_to_f32(bits),
    }
}

/// Whether `bits` (of type `kv`) is a nearest value of that type to `x`: no closer than its
/// neighbours one unit in the last place away.
fn is_nearest(kv: DType, x: f32, bits: u16) -> bool {
    let got = widen(kv, bits) as f64;
    let err = (x as f64 - got).abs();
    [bits.wrapping_add(1), bits.wrapping_sub(1)]
        .iter()
        .all(|&n| err <= (x as f64 - widen(kv, n) as f64).abs())
}

fn lib(kv: DType, lanes: usize) -> TestLib {
    let options = CompileOptions::new(ROWS, lanes);
    let kernels = [rope_kv(kv, ROWS), rope_kv(kv, 1), attention(kv, ROWS), attention(kv, 1)];
    TestLib::build(&kernels, &options, None)
}

fn widths() -> Vec<usize> {
    [16, 8, 4]
        .into_iter()
        .filter(|&l| l <= HostCpu::detect().f32_lanes())
        .collect()
}

#[test]
fn narrow_caches_are_written_rounded_and_read_exactly() {
    for kv in [DType::F16, DType::BF16] {
        for lanes in widths() {
            let lib = lib(kv, lanes);
            let mut rng = Rng(kv as u64 * 31 + lanes as u64);
            for max_rows in [ROWS, 1] {
                let (rows, pos) = (max_rows, 9);
                // rope_kv without rotary: the caches get k and v as they are, rounded.
                let mut q = rng.vec(max_rows * HEADS * HD);
                let mut k = rng.vec(max_rows * KV * HD);
                let mut v = rng.vec(max_rows * KV * HD);
                let (k0, v0) = (k.clone(), v.clone());
                let mut kc = vec![0u16; 2 * KV * CTX * HD];
                let mut vc = vec![0u16; 2 * KV * CTX * HD];
                let mut info = row_info(rows, 1, pos, pos + rows);
                let ptrs = [
                    ptr(&mut q),
                    ptr(&mut k),
                    ptr(&mut v),
                    ptr(&mut kc),
                    ptr(&mut vc),
                    ptr(&mut info),
                ];
                lib.call(&rope_kv(kv, max_rows), &ptrs, rows, 2);
                for r in 0..rows {
                    for h in 0..KV {
                        let c0 = ((KV + h) * CTX + pos + r) * HD;
                        let s = (r * KV + h) * HD;
                        for i in 0..HD {
                            for (x, c) in [(k0[s + i], kc[c0 + i]), (v0[s + i], vc[c0 + i])] {
                                assert!(is_nearest(kv, x, c), "{kv} lanes {lanes}: {x} stored as {c:#06x}");
                                if kv == DType::BF16 {
                                    assert_eq!(c, f32_to_bf16(x), "bf16 rounds to nearest even");
                                }
                            }
                        }
                    }
                }

                // attention over random narrow caches: the f32 values they hold, exactly.
                let bits = |rng: &mut Rng, n: usize| -> Vec<u16> {
                    rng.vec(n)
                        .into_iter()
                        .map(|x| match kv {
                            // Values with 10 fraction bits: f16 holds them exactly.
                            DType::F16 => f32_to_f16((x * 1024.0).round() / 1024.0),
                            _ => f32_to_bf16(x),
                        })
                        .collect()
                };
                let mut kc = bits(&mut rng, 2 * KV * CTX * HD);
                let mut vc = bits(&mut rng, 2 * KV * CTX * HD);
                let mut out = vec![0f32; max_rows * HEADS * HD];
                let mut info = row_info(rows, 1, pos, pos + rows);
                let ptrs = [ptr(&mut q), ptr(&mut kc), ptr(&mut vc), ptr(&mut out), ptr(&mut info)];
                lib.call(&attention(kv, max_rows), &ptrs, rows, 2);
                let scale = 1.0 / (HD as f64).sqrt();
                for r in 0..rows {
                    let p = pos + r;
                    for h in 0..HEADS {
                        let g = KV + h / (HEADS / KV);
                        let qs = &q[(r * HEADS + h) * HD..][..HD];
                        let at = |c: &[u16], j: usize, i: usize| widen(kv, c[(g * CTX + j) * HD + i]) as f64;
                        let scores: Vec<f64> = (0..=p)
                            .map(|j| (0..HD).map(|i| qs[i] as f64 * at(&kc, j, i)).sum::<f64>() * scale)
                            .collect();
                        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                        let z: f64 = e.iter().sum();
                        let want: Vec<f64> = (0..HD)
                            .map(|i| (0..=p).zip(&e).map(|(j, w)| w / z * at(&vc, j, i)).sum())
                            .collect();
                        assert_close(&out[(r * HEADS + h) * HD..][..HD], &want, 1e-5, "narrow attention");
                    }
                }
            }
        }
    }
}
