//! Reading a rotary embedding's base and scaling from either format.

use super::params::{ArchError, Cfg, Key, Params, keys};
use crate::rope::{Rope, RopeScaling, longrope_attention_factor};

/// Scaling types [`hf_rope_dict`] implements, for messages.
const HF_TYPES: &str = "default, linear, llama3, longrope";

/// RoPE as `transformers` 5 standardises a single (not per-layer-type) configuration: a
/// non-empty legacy `rope_scaling` wins over `rope_parameters`; `rope_theta` comes from that
/// dict, else the top level, else `default_theta`. Returns the RoPE and the dict's
/// `partial_rotary_factor`, if it has one.
pub fn hf_rope(c: Cfg, max_positions: usize, default_theta: f64) -> Result<(Rope, Option<f64>), ArchError> {
    hf_rope_with(c, max_positions, default_theta, &HfRopeRules::default())
}

/// Where a config class standardises its RoPE dict differently from the common rules.
#[derive(Clone, Copy, Debug, Default)]
pub struct HfRopeRules {
    /// The class's `original_max_position_embeddings` attribute (Phi-3: 4096). `transformers`
    /// copies the attribute (the top-level field, else this default) over the dict's value for
    /// "longrope" (and the types read as it), but not for "su", which it renames only after
    /// that copy: there the dict's value wins.
    pub class_original: Option<usize>,
    /// Further `rope_type`s read as "longrope" (Phi-3: "yarn"); "su" always is.
    pub longrope_aliases: &'static [&'static str],
}

/// [`hf_rope`] with a config class's own [`HfRopeRules`].
pub fn hf_rope_with(
    c: Cfg,
    max_positions: usize,
    default_theta: f64,
    rules: &HfRopeRules,
) -> Result<(Rope, Option<f64>), ArchError> {
    let dict = rope_dict(c)?;
    let top_theta = c.positive(keys::ROPE_THETA)?;
    let Some(p) = dict else {
        return Ok((
            Rope {
                theta: top_theta.unwrap_or(default_theta),
                scaling: RopeScaling::None,
            },
            None,
        ));
    };
    if p.present(&prefixed(&*p, "full_attention")) || p.present(&prefixed(&*p, "sliding_attention")) {
        return Err(c.unsupported(format!(
            "{} given per layer type (one RoPE for all layers is supported)",
            prefixed(&*p, "").trim_end_matches('.')
        )));
    }
    hf_rope_dict_with(c, &*p, top_theta, max_positions, default_theta, rules)
}

/// The dict of RoPE parameters: `rope_scaling`, else `rope_parameters`.
pub fn rope_dict<'a>(c: Cfg<'a>) -> Result<Option<Box<dyn Params + 'a>>, ArchError> {
    match c.p.object("rope_scaling")? {
        Some(p) => Ok(Some(p)),
        None => c.p.object("rope_parameters"),
    }
}

/// A key of a nested dict, with the dict's prefix.
fn prefixed(p: &dyn Params, name: &'static str) -> String {
    p.key(Key::hf(name)).unwrap_or_default()
}

/// One RoPE parameter dict: `rope_theta` (else `top_theta`, else `default_theta`), the type
/// from `rope_type`, else `type`, else "default", and the type's own fields. LongRoPE's and
/// Llama 3's `original_max_position_embeddings` come from the top level first (as Phi-3 saves
/// it), else the dict, else `max_positions`.
pub fn hf_rope_dict(
    c: Cfg,
    p: &dyn Params,
    top_theta: Option<f64>,
    max_positions: usize,
    default_theta: f64,
) -> Result<(Rope, Option<f64>), ArchError> {
    hf_rope_dict_with(c, p, top_theta, max_positions, default_theta, &HfRopeRules::default())
}

/// [`hf_rope_dict`] with a config class's own [`HfRopeRules`].
pub fn hf_rope_dict_with(
    c: Cfg,
    p: &dyn Params,
    top_theta: Option<f64>,
    max_positions: usize,
    default_theta: f64,
    rules: &HfRopeRules,
) -> Result<(Rope, Option<f64>), ArchError> {
    let d = Cfg::new(p);
    let theta = d.positive(keys::ROPE_THETA)?.or(top_theta).unwrap_or(default_theta);
    let partial = d.positive(keys::PARTIAL_ROTARY)?;
    let mut rope_type = match d.str(Key::hf("rope_type"))? {
        Some(t) => t,
        None => d.str(Key::hf("type"))?.unwrap_or_else(|| "default".into()),
    };
    let su = rope_type == "su";
    if rules.longrope_aliases.contains(&rope_type.as_str()) {
        rope_type = "longrope".into();
    }
    let original = || -> Result<f64, ArchError> {
        let key = Key::hf("original_max_position_embeddings");
        let (top, dict) = (c.positive(key)?, d.positive(key)?);
        Ok(match rules.class_original {
            None => top.or(dict).unwrap_or(max_positions as f64),
            Some(class) if su => dict.or(top).unwrap_or(class as f64),
            Some(class) => top.unwrap_or(class as f64),
        })
    };
    let factor = Key::hf("factor");
    let scaling = match rope_type.as_str() {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: d.req_positive(factor)?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: d.req_positive(factor)?,
            low_freq_factor: d.req_positive(Key::hf("low_freq_factor"))?,
            high_freq_factor: d.req_positive(Key::hf("high_freq_factor"))?,
            original_max_position_embeddings: original()?,
        },
        "longrope" | "su" => {
            let list = |name: &'static str| -> Result<Vec<f64>, ArchError> {
                let key = Key::hf(name);
                let v = d.floats(key)?.ok_or_else(|| d.missing(key))?;
                if v.iter().any(|&x| x <= 0.0) {
                    return Err(d.invalid(key, "must hold positive factors".into()));
                }
                Ok(v)
            };
            let original = original()?.round() as usize;
            let attention_factor = match d.positive(Key::hf("attention_factor"))? {
                Some(a) => a,
                None => match d.positive(factor)? {
                    Some(f) if f > 1.0 => (1.0 + f.ln() / (original as f64).ln()).sqrt(),
                    Some(_) => 1.0,
                    None => longrope_attention_factor(max_positions, original),
                },
            };
            RopeScaling::LongRope {
                short_factor: list("short_factor")?,
                long_factor: list("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            }
        }
        other => {
            return Err(c.unsupported(format!("rope_type '{other}' (supported: {HF_TYPES})")));
        }
    };
    Ok((Rope { theta, scaling }, partial))
}

/// Checks that LongRoPE's factor lists hold one factor per rotated pair.
pub fn check_factors(c: Cfg, rope: &Rope, dims: usize) -> Result<(), ArchError> {
    if let RopeScaling::LongRope {
        short_factor,
        long_factor,
        ..
    } = &rope.scaling
    {
        for (name, v) in [("short_factor", short_factor), ("long_factor", long_factor)] {
            if v.len() != dims / 2 {
                return Err(c.config_error(format!(
                    "rope {name} has {} factors, expected {} (one per rotated pair of the {dims} rotary dimensions)",
                    v.len(),
                    dims / 2
                )));
            }
        }
    }
    Ok(())
}

/// RoPE of a GGUF file: base `{a}.rope.freq_base` (else `default_theta`); scaling from
/// `{a}.rope.scaling.type` + `.factor` (or the older `{a}.rope.scale_linear`); a
/// `rope_freqs.weight` tensor recognised as Llama 3 scaling; `rope_factors_long.weight` and
/// `rope_factors_short.weight` as LongRoPE (with `{a}.rope.scaling.original_context_length`
/// and `{a}.rope.scaling.attn_factor`).
pub fn gguf_rope(c: Cfg, dims: usize, max_positions: usize, default_theta: f64) -> Result<Rope, ArchError> {
    let theta = match c.f64(keys::ROPE_THETA)? {
        Some(t) if !(t.is_finite() && t > 0.0) => {
            return Err(c.config_error(format!("{} ({t}) must be a positive number", c.name(keys::ROPE_THETA))));
        }
        Some(t) => t,
        None => default_theta,
    };
    let type_key = Key::gguf("rope.scaling.type");
    let factor_key = Key::gguf("rope.scaling.factor");
    let linear_key = Key::gguf("rope.scale_linear");
    let original_key = Key::gguf("rope.scaling.original_context_length");
    let linear = |key: Key, f: f64| -> Result<RopeScaling, ArchError> {
        if f <= 0.0 {
            return Err(c.invalid(key, format!("is {f}, expected a positive factor")));
        }
        Ok(RopeScaling::Linear { factor: f })
    };
    let mut scaling = match c.str(type_key)?.as_deref() {
        None | Some("none") => match c.f64(linear_key)? {
            Some(f) if f != 1.0 => linear(linear_key, f)?,
            _ => RopeScaling::None,
        },
        Some("linear") => {
            let f = match c.f64(factor_key)? {
                Some(f) => f,
                None => c.f64(linear_key)?.ok_or_else(|| c.missing(factor_key))?,
            };
            linear(factor_key, f)?
        }
        Some("longrope") => RopeScaling::None, // the factor tensors below say how
        Some(other) => {
            return Err(c.unsupported(format!(
                "rope scaling type \"{other}\" in {} (supported: none, linear, longrope)",
                c.name(type_key)
            )));
        }
    };
    let unsupported = |what: String| c.unsupported(what);
    if let Some(factors) = c.p.tensor_f32s("rope_freqs.weight")? {
        let what =
            || "rope_freqs.weight tensor (per-frequency RoPE factors) that does not match Llama 3 scaling".to_string();
        if factors.len() != dims / 2 {
            return Err(unsupported(what()));
        }
        if factors.iter().any(|&f| f != 1.0) {
            if scaling != RopeScaling::None {
                return Err(unsupported(
                    "rope_freqs.weight together with linear rope scaling".into(),
                ));
            }
            let original = c.f64(original_key)?.unwrap_or(8192.0);
            scaling = fit_llama3(&factors, theta, dims, original).ok_or_else(|| unsupported(what()))?;
        }
    }
    let long = c.p.tensor_f32s("rope_factors_long.weight")?;
    let short = c.p.tensor_f32s("rope_factors_short.weight")?;
    if let (Some(long), Some(short)) = (long, short) {
        let original = match c.usize(original_key, super::params::MAX_POSITIONS)? {
            Some(o) => o,
            None => return Err(c.missing(original_key)),
        };
        let attention_factor = match c.f64(Key::gguf("rope.scaling.attn_factor"))? {
            Some(a) if a > 0.0 => a,
            _ => longrope_attention_factor(max_positions, original),
        };
        scaling = RopeScaling::LongRope {
            short_factor: short.iter().map(|&f| f as f64).collect(),
            long_factor: long.iter().map(|&f| f as f64).collect(),
            original_max_position_embeddings: original,
            attention_factor,
        };
    }
    Ok(Rope { theta, scaling })
}

/// The Llama 3 parameters that reproduce `factors` (what `convert_hf_to_gguf.py` writes as
/// `rope_freqs.weight`: the divisor of each inverse frequency), trying the published
/// low/high frequency factors (1, 4) and the file's original context length.
pub fn fit_llama3(factors: &[f32], theta: f64, head_dim: usize, original: f64) -> Option<RopeScaling> {
    let factor = factors.iter().fold(0f32, |m, &f| m.max(f)) as f64;
    let (low, high) = (1.0f64, 4.0f64);
    let low_wavelen = original / low;
    let high_wavelen = original / high;
    for (i, &got) in factors.iter().enumerate() {
        let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
        let wavelen = 2.0 * std::f64::consts::PI / freq;
        let expect = if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor
        } else {
            let smooth = (original / wavelen - low) / (high - low);
            1.0 / ((1.0 - smooth) / factor + smooth)
        };
        if ((got as f64) - expect).abs() > 1e-4 * expect {
            return None;
        }
    }
    Some(RopeScaling::Llama3 {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: original,
    })
}
