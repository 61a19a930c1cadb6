//! Rotary position embeddings as configs describe them: a base, a scaling variant, and how many
//! dimensions of each head rotate. [`Rope::rotary`] turns one into the frequency tables a kernel
//! bakes in ([`Rotary`]).
//!
//! Frequencies are computed step by step in f32 exactly as `transformers` does, so the angles
//! the kernel forms (`pos * inv_freq`, in f32) match the reference bit for bit wherever `powf`
//! agrees.

use crate::ops::{F32Bits, LongFreqs, Pairing, Rotary};
use serde::{Deserialize, Serialize};

/// How rotary frequencies are derived from the base (Hugging Face's `rope_type`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// `rope_type = "default"`.
    None,
    /// `rope_type = "linear"`: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// `rope_type = "llama3"` (Llama 3.1 and later): low frequencies divided by `factor`,
    /// high ones kept, the band between smoothly interpolated.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// `rope_type = "longrope"` (Phi-3 128k, Phi-3.5): each frequency divided by a per-pair
    /// factor, `short_factor` while the sequence fits `original_max_position_embeddings`,
    /// `long_factor` beyond; cos and sin are multiplied by `attention_factor`.
    #[serde(rename = "longrope")]
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// The `rope_type` name.
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::None => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::LongRope { .. } => "longrope",
        }
    }
}

/// A rotary position embedding: base `theta`, scaling, and the rotated dimensions per head.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

impl Rope {
    /// The `dims / 2` inverse frequencies of the default (or, with LongRoPE, the short)
    /// table.
    pub fn inv_freq(&self, dims: usize) -> Vec<f32> {
        let base = self.base_inv_freq(dims, None);
        match &self.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => {
                let f = *factor as f32;
                base.into_iter().map(|v| v / f).collect()
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => llama3(
                base,
                *factor as f32,
                *low_freq_factor as f32,
                *high_freq_factor as f32,
                *original_max_position_embeddings as f32,
            ),
            RopeScaling::LongRope { short_factor, .. } => self.base_inv_freq(dims, Some(short_factor)),
        }
    }

    /// `1 / (ext[i] * base^(2i / dims))` in f32, as `transformers` forms it (`ext` = 1 without
    /// per-pair factors).
    fn base_inv_freq(&self, dims: usize, ext: Option<&[f64]>) -> Vec<f32> {
        let d = dims as f32;
        let base = self.theta as f32;
        (0..dims / 2)
            .map(|i| {
                let p = base.powf((2 * i) as f32 / d);
                match ext {
                    Some(e) => 1.0f32 / (e.get(i).copied().unwrap_or(1.0) as f32 * p),
                    None => 1.0f32 / p,
                }
            })
            .collect()
    }

    /// The kernel's tables for rotating the first `dims` dimensions of each head.
    pub fn rotary(&self, dims: usize, pairing: Pairing) -> Rotary {
        let mut r = Rotary::new(dims, pairing, &self.inv_freq(dims));
        if let RopeScaling::LongRope {
            long_factor,
            original_max_position_embeddings,
            attention_factor,
            ..
        } = &self.scaling
        {
            let long = self.base_inv_freq(dims, Some(long_factor));
            r.long = Some(LongFreqs {
                inv_freq: long.iter().map(|f| f.to_bits()).collect(),
                original: *original_max_position_embeddings,
            });
            let f = *attention_factor as f32;
            r.mscale = (f != 1.0).then(|| F32Bits::new(f));
        }
        r
    }
}

/// Llama 3.1's smooth frequency scaling, in f32 as `transformers` computes it.
fn llama3(mut inv: Vec<f32>, factor: f32, lo: f32, hi: f32, old: f32) -> Vec<f32> {
    let low_wavelen = old / lo;
    let high_wavelen = old / hi;
    for v in inv.iter_mut() {
        let wavelen = 2.0 * std::f32::consts::PI / *v;
        let scaled = if wavelen > low_wavelen { *v / factor } else { *v };
        // HF: `~(wavelen < high) * ~(wavelen > low)`; wavelengths are finite and positive.
        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
        *v = if medium {
            let smooth = (old / wavelen - lo) / (hi - lo);
            (1.0 - smooth) * scaled / factor + smooth * scaled
        } else {
            scaled
        };
    }
    inv
}

/// LongRoPE's default attention factor: `sqrt(1 + ln(factor) / ln(original))` with
/// `factor = max_position_embeddings / original`, or 1 when the context is not extended.
pub fn longrope_attention_factor(max_position_embeddings: usize, original: usize) -> f64 {
    let factor = max_position_embeddings as f64 / original as f64;
    if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / (original as f64).ln()).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_inv_freq_matches_closed_form() {
        let rope = Rope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        };
        let inv = rope.inv_freq(64);
        assert_eq!(inv.len(), 32);
        assert_eq!(inv[0], 1.0);
        let expect = 1.0 / 10000f64.powf(62.0 / 64.0);
        assert!(((inv[31] as f64) - expect).abs() / expect < 1e-6);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let base = Rope {
            theta: 500000.0,
            scaling: RopeScaling::None,
        }
        .inv_freq(128);
        let scaled = Rope {
            theta: 500000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
        }
        .inv_freq(128);
        assert_eq!(scaled[0], base[0]);
        assert!((scaled[63] - base[63] / 8.0).abs() <= f32::EPSILON * base[63]);
    }

    /// LongRoPE divides each default frequency by its factor (short table by default, long
    /// table for long sequences) and scales cos/sin by the attention factor; with partial
    /// rotary the tables cover only the rotated dimensions.
    #[test]
    fn longrope_tables_divide_by_their_factors() {
        let short: Vec<f64> = (0..8).map(|i| 1.0 + i as f64 * 0.25).collect();
        let long: Vec<f64> = (0..8).map(|i| 2.0 + i as f64).collect();
        let rope = Rope {
            theta: 10000.0,
            scaling: RopeScaling::LongRope {
                short_factor: short.clone(),
                long_factor: long.clone(),
                original_max_position_embeddings: 4096,
                attention_factor: longrope_attention_factor(131072, 4096),
            },
        };
        let plain = Rope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        }
        .inv_freq(16);
        let r = rope.rotary(16, Pairing::Half);
        let l = r.long.as_ref().unwrap();
        assert_eq!(l.original, 4096);
        for i in 0..8 {
            let s = f32::from_bits(r.inv_freq[i]);
            let lg = f32::from_bits(l.inv_freq[i]);
            assert!((s * short[i] as f32 - plain[i]).abs() <= 2.0 * f32::EPSILON * plain[i]);
            assert!((lg * long[i] as f32 - plain[i]).abs() <= 2.0 * f32::EPSILON * plain[i]);
        }
        // Phi-3-mini-128k: sqrt(1 + ln(32) / ln(4096)) = 1.1902380714238083.
        assert!((r.mscale.unwrap().get() - 1.190_238_1).abs() < 1e-6);
        assert_eq!(longrope_attention_factor(4096, 4096), 1.0);
    }
}
