//! Reference dequantisers: one function per storage type, turning one block of GGML bytes into
//! its 32 (or 256, for the K-quants) f32 values, exactly as ggml's `dequantize_row_*`
//! (`ggml/src/ggml-quants.c`) does: the same bit layout and the same f32 operations in the same
//! order (`d * q + m`, never fused), so the results equal the reference bit for bit (ggml built
//! with FMA contraction can differ in the last bit of the affine types; `gguf-py`'s numpy
//! implementation, which the tests compare against, never fuses).
//!
//! These are the ground truth for the compiler's quantised kernels and back `--dequantize`;
//! they are written for clarity, not speed.
//!
//! Block layouts (all little-endian; `f16` is IEEE binary16; K-quant super-blocks are 256
//! values; "sub-block" is a group of 16 or 32 values sharing a scale):
//!
//! | type | bytes | layout |
//! |---|---|---|
//! | q8_0 | 34 | `d: f16, qs: [i8; 32]`; `y[j] = qs[j] * d` |
//! | q4_0 | 18 | `d: f16, qs: [u8; 16]`; `y[j] = ((qs[j] & 15) - 8) * d`, `y[j + 16] = ((qs[j] >> 4) - 8) * d` |
//! | q4_1 | 20 | `d: f16, m: f16, qs: [u8; 16]`; `y[j] = (qs[j] & 15) * d + m`, `y[j + 16] = (qs[j] >> 4) * d + m` |
//! | q5_0 | 22 | `d: f16, qh: u32, qs: [u8; 16]`; 5th bit of `y[j]` is bit `j` of `qh`, of `y[j + 16]` bit `j + 16`; value `- 16`, times `d` |
//! | q5_1 | 24 | `d: f16, m: f16, qh: u32, qs: [u8; 16]`; as q5_0 without the `- 16`, `* d + m` |
//! | q2_k | 84 | `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`; 16 sub-blocks of 16; scale `d * (sc & 15)`, min `dmin * (sc >> 4)` |
//! | q3_k | 110 | `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`; 16 sub-blocks of 16, 6-bit signed scales (`- 32`); a clear hmask bit subtracts 4 |
//! | q4_k | 144 | `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`; 8 sub-blocks of 32, 6-bit scale and min each (`get_scale_min_k4`) |
//! | q5_k | 176 | `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`; as q4_k plus a 5th bit from `qh` |
//! | q6_k | 210 | `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`; 16 sub-blocks of 16, value `(4 low bits | 2 high bits << 4) - 32` |
//!
//! The order within a K-quant super-block (which nibble / bit plane holds which element) is the
//! one of the loops below, copied from ggml; see each function.

use crate::DType;

/// Values per K-quant super-block.
pub const QK_K: usize = 256;
/// Values per block of the legacy types (q4_0 ... q8_0).
pub const QK: usize = 32;

/// IEEE binary16 to f32, exactly (subnormals, infinities and NaN payloads included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mant = (h & 0x3ff) as u32;
    let bits = match exp {
        0 if mant == 0 => sign,
        0 => {
            // Subnormal: value = mant * 2^-24; normalise it.
            let shift = mant.leading_zeros() - 21; // bring the top set bit to position 10
            let mant = (mant << shift) & 0x3ff;
            let exp = 127 - 15 + 1 - shift;
            sign | (exp << 23) | (mant << 13)
        }
        0x1f => sign | 0x7f80_0000 | (mant << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (mant << 13),
    };
    f32::from_bits(bits)
}

/// bfloat16 to f32 (exact: the top half of the f32).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 to bfloat16 as ggml's `ggml_compute_fp32_to_bf16`: round to nearest, ties to even; NaN
/// stays NaN (quietened).
pub fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// q8_0: `d: f16` then 32 signed bytes.
pub fn dequantize_q8_0(b: &[u8; 34]) -> [f32; QK] {
    let d = f16_at(b, 0);
    std::array::from_fn(|j| (b[2 + j] as i8) as f32 * d)
}

/// q4_0: `d: f16` then 16 bytes; low nibbles are elements 0..16, high nibbles 16..32.
pub fn dequantize_q4_0(b: &[u8; 18]) -> [f32; QK] {
    let d = f16_at(b, 0);
    let qs = &b[2..];
    let mut y = [0f32; QK];
    for j in 0..QK / 2 {
        let x0 = (qs[j] & 0x0f) as i32 - 8;
        let x1 = (qs[j] >> 4) as i32 - 8;
        y[j] = x0 as f32 * d;
        y[j + QK / 2] = x1 as f32 * d;
    }
    y
}

/// q4_1: `d: f16, m: f16` then 16 bytes of nibbles as in q4_0; `y = q * d + m`.
pub fn dequantize_q4_1(b: &[u8; 20]) -> [f32; QK] {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..];
    let mut y = [0f32; QK];
    for j in 0..QK / 2 {
        let x0 = (qs[j] & 0x0f) as i32;
        let x1 = (qs[j] >> 4) as i32;
        y[j] = x0 as f32 * d + m;
        y[j + QK / 2] = x1 as f32 * d + m;
    }
    y
}

/// q5_0: `d: f16, qh: u32 (LE)` then 16 bytes of nibbles; bit `j` of `qh` is the 5th bit of
/// element `j` (and bit `j + 16` of element `j + 16`); values are offset by 16.
pub fn dequantize_q5_0(b: &[u8; 22]) -> [f32; QK] {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..];
    let mut y = [0f32; QK];
    for j in 0..QK / 2 {
        let xh_0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh_1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = ((qs[j] & 0x0f) | xh_0) as i32 - 16;
        let x1 = ((qs[j] >> 4) | xh_1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + QK / 2] = x1 as f32 * d;
    }
    y
}

/// q5_1: `d: f16, m: f16, qh: u32 (LE)` then 16 bytes; as q5_0 without the offset, `* d + m`.
pub fn dequantize_q5_1(b: &[u8; 24]) -> [f32; QK] {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..];
    let mut y = [0f32; QK];
    for j in 0..QK / 2 {
        let xh_0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh_1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = ((qs[j] & 0x0f) | xh_0) as i32;
        let x1 = ((qs[j] >> 4) | xh_1) as i32;
        y[j] = x0 as f32 * d + m;
        y[j + QK / 2] = x1 as f32 * d + m;
    }
    y
}

/// q2_k: `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`. Two halves of 128 values, each
/// reading 32 bytes of `qs` at four 2-bit shifts; per shift, 16 values from `qs[0..16]` then 16
/// from `qs[16..32]`, each group with its own scale byte (`d * (sc & 15)`, min
/// `dmin * (sc >> 4)` subtracted).
pub fn dequantize_q2_k(b: &[u8; 84]) -> [f32; QK_K] {
    let scales = &b[0..16];
    let d = f16_at(b, 80);
    let min = f16_at(b, 82);
    let mut y = [0f32; QK_K];
    let mut out = 0;
    let mut is = 0;
    for n in 0..2 {
        let q = &b[16 + 32 * n..16 + 32 * (n + 1)];
        for shift in [0u32, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0xf) as f32;
                let ml = min * (sc >> 4) as f32;
                for l in 0..16 {
                    let v = ((q[l + 16 * half] >> shift) & 3) as i8;
                    y[out] = dl * v as f32 - ml;
                    out += 1;
                }
            }
        }
    }
    y
}

/// q3_k: `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`. The 16 6-bit scales are
/// unpacked from 12 bytes as ggml does (low 4 bits from bytes 0..8, high 2 bits from bytes
/// 8..12) and offset by 32. Values: 2 bits from `qs` (same order as q2_k), minus 4 where the
/// corresponding `hmask` bit (bit plane `m` advancing with each shift) is clear.
pub fn dequantize_q3_k(b: &[u8; 110]) -> [f32; QK_K] {
    let hm = &b[0..32];
    let d_all = f16_at(b, 108);
    let scales = q3_k_scales(b[96..108].try_into().expect("12 bytes"));
    let mut y = [0f32; QK_K];
    let mut out = 0;
    let mut is = 0;
    let mut m: u8 = 1;
    for n in 0..2 {
        let q = &b[32 + 32 * n..32 + 32 * (n + 1)];
        for shift in [0u32, 2, 4, 6] {
            for half in 0..2 {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let idx = l + 16 * half;
                    let low = ((q[idx] >> shift) & 3) as i8 as i32;
                    let high = if hm[idx] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - high) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
    y
}

/// The 16 unsigned 6-bit scales of a q3_k block (before the `- 32`), as ggml's `kmask` dance.
fn q3_k_scales(raw: [u8; 12]) -> [u8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let word = |i: usize| u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut out = [0u8; 16];
    for (i, w) in aux.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// ggml's `get_scale_min_k4`: scale and min `j` (0..8) of a q4_k/q5_k block from its 12 scale
/// bytes. Entries 0..4 are the low 6 bits of bytes `j` and `j + 4`; entries 4..8 take their low
/// 4 bits from byte `j + 4` and their high 2 bits from the top bits of bytes `j - 4` and `j`.
pub fn get_scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// q4_k: `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`. Four chunks of 64 values, each
/// from 32 bytes of `qs`: 32 low nibbles (scale/min `2c`), then 32 high nibbles (`2c + 1`);
/// `y = d * sc * q - dmin * m`.
pub fn dequantize_q4_k(b: &[u8; 144]) -> [f32; QK_K] {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales: &[u8; 12] = b[4..16].try_into().expect("12 bytes");
    let mut y = [0f32; QK_K];
    for c in 0..4 {
        let q = &b[16 + 32 * c..16 + 32 * (c + 1)];
        let (sc, m) = get_scale_min_k4(2 * c, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = get_scale_min_k4(2 * c + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for l in 0..32 {
            y[64 * c + l] = d1 * (q[l] & 0xf) as f32 - m1;
            y[64 * c + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
    y
}

/// q5_k: `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`. As q4_k, with a
/// 5th bit (+16) from `qh[l]`: bit `2c` for the low-nibble half of chunk `c`, bit `2c + 1` for
/// the high-nibble half.
pub fn dequantize_q5_k(b: &[u8; 176]) -> [f32; QK_K] {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales: &[u8; 12] = b[4..16].try_into().expect("12 bytes");
    let qh = &b[16..48];
    let mut y = [0f32; QK_K];
    for c in 0..4 {
        let ql = &b[48 + 32 * c..48 + 32 * (c + 1)];
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let (sc, m) = get_scale_min_k4(2 * c, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = get_scale_min_k4(2 * c + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * c + l] = d1 * ((ql[l] & 0xf) as i32 + h1) as f32 - m1;
            y[64 * c + 32 + l] = d2 * ((ql[l] >> 4) as i32 + h2) as f32 - m2;
        }
    }
    y
}

/// q6_k: `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`. Two halves of 128 values,
/// each from 64 bytes of `ql`, 32 of `qh` and 8 scales; within a half, element `l + 32k`
/// (`k` = 0..4, `l` = 0..32) takes the low (k = 0, 1) or high (k = 2, 3) nibble of
/// `ql[l + 32 (k & 1)]` and bits `2k..2k+2` of `qh[l]`, minus 32, times `d * scales[l / 16 + 2k]`.
pub fn dequantize_q6_k(b: &[u8; 210]) -> [f32; QK_K] {
    let d = f16_at(b, 208);
    let mut y = [0f32; QK_K];
    for n in 0..2 {
        let ql = &b[64 * n..64 * (n + 1)];
        let qh = &b[128 + 32 * n..128 + 32 * (n + 1)];
        let sc = &b[192 + 8 * n..192 + 8 * (n + 1)];
        let yy = &mut y[128 * n..128 * (n + 1)];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            yy[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            yy[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            yy[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            yy[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
    y
}

/// `data` is not a whole number of blocks, or does not match the output length.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{data_len} bytes of {dtype} do not hold exactly {out_len} values")]
pub struct LengthMismatch {
    pub dtype: DType,
    pub data_len: usize,
    pub out_len: usize,
}

/// Dequantises consecutive blocks of `dtype` (or plain f32/f16/bf16 values) from `data` into
/// `out`, which must hold exactly the number of values `data` encodes.
pub fn dequantize_into(dtype: DType, data: &[u8], out: &mut [f32]) -> Result<(), LengthMismatch> {
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    if !data.len().is_multiple_of(bb) || data.len() / bb * be != out.len() {
        return Err(LengthMismatch {
            dtype,
            data_len: data.len(),
            out_len: out.len(),
        });
    }
    macro_rules! blocks {
        ($f:ident) => {
            for (block, y) in data.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
                y.copy_from_slice(&$f(block.try_into().expect("block of the type's size")));
            }
        };
    }
    match dtype {
        DType::F32 => {
            for (c, y) in data.chunks_exact(4).zip(out.iter_mut()) {
                *y = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (c, y) in data.chunks_exact(2).zip(out.iter_mut()) {
                *y = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        DType::BF16 => {
            for (c, y) in data.chunks_exact(2).zip(out.iter_mut()) {
                *y = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        DType::Q8_0 => blocks!(dequantize_q8_0),
        DType::Q4_0 => blocks!(dequantize_q4_0),
        DType::Q4_1 => blocks!(dequantize_q4_1),
        DType::Q5_0 => blocks!(dequantize_q5_0),
        DType::Q5_1 => blocks!(dequantize_q5_1),
        DType::Q2K => blocks!(dequantize_q2_k),
        DType::Q3K => blocks!(dequantize_q3_k),
        DType::Q4K => blocks!(dequantize_q4_k),
        DType::Q5K => blocks!(dequantize_q5_k),
        DType::Q6K => blocks!(dequantize_q6_k),
    }
    Ok(())
}

/// Dequantises all of `data` (a whole number of blocks of `dtype`).
pub fn dequantize(dtype: DType, data: &[u8]) -> Result<Vec<f32>, LengthMismatch> {
    let n = data.len() / dtype.block_bytes() * dtype.block_elems();
    let mut out = vec![0f32; n];
    dequantize_into(dtype, data, &mut out)?;
    Ok(out)
}
