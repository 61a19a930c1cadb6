//! Gemma 2 and Gemma 3 (text), as `transformers` 5 defines them (`modeling_gemma2.py`,
//! `modeling_gemma3.py`) and llama.cpp reads their GGUF files (`gemma2`, `gemma3`).
//!
//! Both are pre-norm decoders with *sandwich* norms: the attention output and the MLP output
//! are each normalised again before they are added to the residual stream (a norm op that
//! accumulates into the residual). Every norm is Gemma's `(1 + w)` RMSNorm; llama.cpp's
//! converter stores `1 + w` (added in f32, as `transformers` forms it) in GGUF files, so there
//! they are plain RMSNorms of the stored weight. The embedding is scaled by `sqrt(hidden)`
//! rounded to f32, the MLP is GeGLU (tanh GELU), and attention scores are scaled by
//! `query_pre_attn_scalar^-0.5` (GGUF: llama.cpp's rule, `head_dim^-0.5`, or `(hidden /
//! heads)^-0.5` for the 27B shapes). Layers alternate between sliding-window and full
//! attention (`layer_types`; older configs: Gemma 2 every other layer from layer 0, Gemma 3
//! `sliding_window_pattern`, default 6: five sliding, one full).
//!
//! | | attention soft cap | final soft cap | q/k norm | RoPE |
//! |---|---|---|---|---|
//! | Gemma 2 | `attn_logit_softcapping` (50) | `final_logit_softcapping` (30) | | one for all layers |
//! | Gemma 3 | none (a value is refused) | `final_logit_softcapping` (none) | `(1 + w)` per head | sliding layers `rope_local_base_freq` (10000, unscaled); full layers `rope_theta` (1e6) + `rope_scaling` |
//!
//! Gemma 3's RoPE may also come as `rope_parameters` keyed by layer type (`full_attention`,
//! `sliding_attention`), as `transformers` 5 writes it. `transformers` does not apply
//! `attn_logit_softcapping` in Gemma 3 (and llama.cpp's converter refuses it), so a config
//! that sets it is refused rather than half-followed.

use super::builder::{Attend, Builder, norm};
use super::common::{self, Heads};
use super::params::{ArchError, Cfg, Format, Key, MAX_POSITIONS, Params, keys};
use super::rope_cfg;
use super::{Architecture, Defaults};
use crate::graph::{OpKind, QkNormOp};
use crate::ops::{Act, F32Bits, NormKind, Pairing, Rotary};
use crate::rope::{Rope, RopeScaling};
use crate::spec::{ModelSpec, Role, WeightId};

const QUERY_SCALAR: Key = Key::hf("query_pre_attn_scalar");
const ATTN_CAP: Key = Key::new("attn_logit_softcapping", "attn_logit_softcapping");
const FINAL_CAP: Key = Key::new("final_logit_softcapping", "final_logit_softcapping");
const ACT: Key = Key::hf("hidden_activation");
const PATTERN: Key = Key::new("sliding_window_pattern", "attention.sliding_window_pattern");
const LOCAL_BASE: Key = Key::new("rope_local_base_freq", "rope.freq_base_swa");

/// What differs between the two generations.
#[derive(Clone, Copy, PartialEq)]
enum Version {
    Two,
    Three,
}

/// Everything a layer needs besides its index.
struct Layer {
    heads: Heads,
    intermediate: usize,
    eps: f32,
    kind: NormKind,
    act: Act,
    qk_norm: bool,
    scale: F32Bits,
    softcap: Option<F32Bits>,
}

pub fn build(p: &dyn Params, arch: &Architecture) -> Result<ModelSpec, ArchError> {
    let c = Cfg::new(p);
    let d = &arch.defaults;
    let version = if arch.name == "gemma2" {
        Version::Two
    } else {
        Version::Three
    };
    refuse_unsupported(c, version)?;
    let common::Shape {
        hidden,
        intermediate,
        layers,
        vocab,
        heads: h,
        max_positions,
    } = common::shape(c, d)?;
    let eps = common::eps(c, keys::RMS_EPS, 1e-6)?;
    let act = if c.is_gguf() {
        Act::GeluTanh // llama.cpp's GELU is the tanh approximation
    } else {
        common::activation(c, ACT, "gelu_pytorch_tanh")?
    };
    // llama.cpp's gemma2 always reads the embedding as the head.
    let tied = (c.is_gguf() && version == Version::Two) || common::tied(c, d, "output.weight")?;
    let mut sliding = sliding_layers(c, version, layers)?;
    let window = if sliding.contains(&true) {
        window(c, version, max_positions)?
    } else {
        None
    };
    if c.is_gguf() && version == Version::Three && window.is_none() {
        // llama.cpp's non-SWA Gemma 3 graph gives every layer the full layers' RoPE.
        sliding = vec![false; layers];
    }
    let (full_rope, local_rope) = ropes(c, version, d, &h, max_positions)?;
    let (attn_cap, final_cap) = softcaps(c, version)?;
    let layer = Layer {
        heads: h,
        intermediate,
        eps,
        // GGUF files hold `1 + w` already.
        kind: if c.is_gguf() {
            NormKind::Rms
        } else {
            NormKind::RmsPlusOne
        },
        act,
        qk_norm: version == Version::Three,
        scale: score_scale(c, version, hidden, &h, layers)?,
        softcap: attn_cap,
    };

    let mut b = Builder::new(
        arch.name,
        common::dims(hidden, intermediate, layers, &h, vocab, max_positions),
        c.format(),
    );
    let full = full_rope.rotary(h.head_dim, Pairing::Half);
    let local = local_rope.rotary(h.head_dim, Pairing::Half);
    b.set_rope(full_rope);
    // `transformers`: `torch.tensor(hidden_size ** 0.5)`, an f32 of the f64 root.
    let scale = F32Bits::new((hidden as f64).sqrt() as f32);
    let embed = b.embed_tokens("model.embed_tokens.weight", "token_embd.weight", Some(scale));
    for (l, &slides) in sliding.iter().enumerate() {
        b.layer(l);
        let (rotary, w) = if slides {
            (local.clone(), window)
        } else {
            (full.clone(), None)
        };
        decoder_layer(&mut b, &layer, rotary, w);
    }
    b.norm_and_head(layer.kind, layer.eps, embed, tied, final_cap);
    b.finish()
}

/// One decoder layer: tensors in checkpoint order, then its operations.
fn decoder_layer(b: &mut Builder, p: &Layer, rotary: Rotary, window: Option<usize>) {
    let l = b.current_layer().expect("inside a layer");
    let hidden = b.dims().hidden_size;
    let h = &p.heads;
    let (q_dim, kv_dim, ff) = (h.heads * h.head_dim, h.kv_heads * h.head_dim, p.intermediate);
    let t = |b: &mut Builder, hf: &str, gguf: &str, shape: &[usize]| -> WeightId {
        let name = b.name(format!("model.layers.{l}.{hf}"), format!("blk.{l}.{gguf}"));
        let role = if shape.len() == 1 { Role::Vector } else { Role::Matrix };
        b.tensor(name, shape, role)
    };
    let attn_norm = t(b, "input_layernorm.weight", "attn_norm.weight", &[hidden]);
    let wq = t(b, "self_attn.q_proj.weight", "attn_q.weight", &[q_dim, hidden]);
    let wk = t(b, "self_attn.k_proj.weight", "attn_k.weight", &[kv_dim, hidden]);
    let wv = t(b, "self_attn.v_proj.weight", "attn_v.weight", &[kv_dim, hidden]);
    let wo = t(b, "self_attn.o_proj.weight", "attn_output.weight", &[hidden, q_dim]);
    let qk = p.qk_norm.then(|| {
        let q = t(b, "self_attn.q_norm.weight", "attn_q_norm.weight", &[h.head_dim]);
        let k = t(b, "self_attn.k_norm.weight", "attn_k_norm.weight", &[h.head_dim]);
        QkNormOp {
            kind: p.kind,
            eps: F32Bits::new(p.eps),
            q,
            k,
        }
    });
    let post_attn = t(
        b,
        "post_attention_layernorm.weight",
        "post_attention_norm.weight",
        &[hidden],
    );
    let pre_ffn = t(b, "pre_feedforward_layernorm.weight", "ffn_norm.weight", &[hidden]);
    let post_ffn = t(
        b,
        "post_feedforward_layernorm.weight",
        "post_ffw_norm.weight",
        &[hidden],
    );
    let wg = t(b, "mlp.gate_proj.weight", "ffn_gate.weight", &[ff, hidden]);
    let wu = t(b, "mlp.up_proj.weight", "ffn_up.weight", &[ff, hidden]);
    let wd = t(b, "mlp.down_proj.weight", "ffn_down.weight", &[hidden, ff]);

    let attend = Attend {
        heads: h.heads,
        kv_heads: h.kv_heads,
        head_dim: h.head_dim,
        rotary: Some(rotary),
        qk_norm: qk,
        window,
        scale: p.scale,
        softcap: p.softcap,
    };
    let x = b.residual();
    let xn = b.buffer("xn", hidden);
    // The sublayer output before its post-norm (attention output, then MLP output).
    let y = b.buffer("y", hidden);
    let (q, k, v) = (b.buffer("q", q_dim), b.buffer("k", kv_dim), b.buffer("v", kv_dim));
    let attn = b.buffer("attn", q_dim);
    let n = |w| norm(p.kind, p.eps, w, None);
    b.norm(x, xn, n(attn_norm), false);
    for (w, out) in [(wq, q), (wk, k), (wv, v)] {
        let w = b.whole(w);
        b.linear(xn, w, None, out, false);
    }
    b.attend(&attend, q, k, v, attn);
    let wo = b.whole(wo);
    b.linear(attn, wo, None, y, false);
    b.norm(y, x, n(post_attn), true);
    b.norm(x, xn, n(pre_ffn), false);
    let (gate, up) = (b.buffer("gate", ff), b.buffer("up", ff));
    for (w, out) in [(wg, gate), (wu, up)] {
        let w = b.whole(w);
        b.linear(xn, w, None, out, false);
    }
    b.op(OpKind::GatedAct { gate, up, act: p.act });
    let wd = b.whole(wd);
    b.linear(gate, wd, None, y, false);
    b.norm(y, x, n(post_ffn), true);
}

/// Options of the configs that no published Gemma sets and Kiln does not implement.
fn refuse_unsupported(c: Cfg, version: Version) -> Result<(), ArchError> {
    if c.is_gguf() {
        return Ok(());
    }
    if c.bool(Key::hf("attention_bias"))?.unwrap_or(false) {
        return Err(c.unsupported("attention_bias true (Gemma's projections have no biases)".into()));
    }
    if c.bool(Key::hf("use_bidirectional_attention"))?.unwrap_or(false) {
        return Err(c.unsupported("use_bidirectional_attention true (Kiln runs causal decoders)".into()));
    }
    if version == Version::Three
        && let Some(cap) = c.f64(ATTN_CAP)?
    {
        return Err(c.unsupported(format!(
            "attn_logit_softcapping {cap} in a Gemma 3 config (transformers ignores it there and \
             llama.cpp refuses it; only null is supported)"
        )));
    }
    Ok(())
}

/// Which layers slide: `layer_types` if given, else the generation's pattern (Gemma 2: every
/// other layer from layer 0; Gemma 3: `sliding_window_pattern`, default 6, every layer but
/// each 6th). GGUF: llama.cpp's `attention.sliding_window_pattern` period with the same
/// defaults (Gemma 3 without a sliding window: none).
fn sliding_layers(c: Cfg, version: Version, layers: usize) -> Result<Vec<bool>, ArchError> {
    let kinds = [("full_attention", false), ("sliding_attention", true)];
    if !c.is_gguf()
        && let Some(sliding) = common::layer_types(c, layers, &kinds)?
    {
        return Ok(sliding);
    }
    let default = if version == Version::Two { 2 } else { 6 };
    let period = match version {
        // transformers reads `sliding_window_pattern` only for Gemma 3.
        Version::Two if !c.is_gguf() => default,
        _ => c.usize(PATTERN, MAX_POSITIONS)?.unwrap_or(default),
    };
    // llama.cpp's `set_swa_pattern`: period 0 slides everywhere.
    Ok((0..layers).map(|i| period == 0 || i % period < period - 1).collect())
}

/// The sliding window of the sliding layers (`None`: they attend to everything).
fn window(c: Cfg, version: Version, max_positions: usize) -> Result<Option<usize>, ArchError> {
    let key = keys::SLIDING_WINDOW;
    let w = match c.usize(key, MAX_POSITIONS)? {
        Some(0) if c.is_gguf() => None,
        Some(0) => return Err(c.invalid(key, "must be greater than 0, got 0".into())),
        Some(w) => Some(w),
        // A null window in a Hugging Face config would make transformers build no mask.
        None if c.present(key) => {
            return Err(c.unsupported("sliding_window null with sliding_attention layers".into()));
        }
        // llama.cpp: Gemma 2 defaults to 4096; Gemma 3 without the key has no sliding layers.
        None if c.is_gguf() && version == Version::Three => None,
        None => Some(4096),
    };
    Ok(common::effective_window(w, max_positions))
}

/// The attention and final soft caps. Hugging Face: null means none, absent the class default
/// (Gemma 2: 50 and 30; Gemma 3: none). GGUF: llama.cpp's defaults (Gemma 2: 50 and 30; Gemma 3
/// no attention cap, a final one only when the key is present and not 0).
fn softcaps(c: Cfg, version: Version) -> Result<(Option<F32Bits>, Option<F32Bits>), ArchError> {
    let cap = |key: Key, default: Option<f64>| -> Result<Option<F32Bits>, ArchError> {
        let v = if c.present(key) {
            match c.f64(key)? {
                Some(v) if c.is_gguf() && v == 0.0 => None,
                Some(_) => c.positive(key)?,
                None => None,
            }
        } else {
            default
        };
        Ok(v.map(|v| F32Bits::new(v as f32)))
    };
    Ok(match version {
        Version::Two => (cap(ATTN_CAP, Some(50.0))?, cap(FINAL_CAP, Some(30.0))?),
        Version::Three => (None, cap(FINAL_CAP, None)?),
    })
}

/// The attention score scale. Hugging Face: `query_pre_attn_scalar ** -0.5` (default 256).
/// GGUF: llama.cpp's `f_attention_scale`, `1 / sqrt(head_dim)`, except for the 27B shapes
/// (46 Gemma 2 layers, 62 Gemma 3 layers): `1 / sqrt(hidden / heads)`.
fn score_scale(c: Cfg, version: Version, hidden: usize, h: &Heads, layers: usize) -> Result<F32Bits, ArchError> {
    if c.is_gguf() {
        let big = layers == if version == Version::Two { 46 } else { 62 };
        let d = if big { hidden / h.heads } else { h.head_dim };
        return Ok(F32Bits::new(1.0f32 / (d as f32).sqrt()));
    }
    let s = c.positive(QUERY_SCALAR)?.unwrap_or(256.0);
    Ok(F32Bits::new(s.powf(-0.5) as f32))
}

/// The RoPE of the full-attention layers and of the sliding ones (rotating whole heads).
fn ropes(c: Cfg, version: Version, d: &Defaults, h: &Heads, max_positions: usize) -> Result<(Rope, Rope), ArchError> {
    let (full, local) = match (c.format(), version) {
        (Format::HuggingFace, Version::Two) => {
            let (rope, partial) = rope_cfg::hf_rope(c, max_positions, d.rope_theta)?;
            check_partial(c, partial)?;
            (rope.clone(), rope)
        }
        (Format::HuggingFace, Version::Three) => gemma3_hf_ropes(c, d, max_positions)?,
        (Format::Gguf, _) => {
            if let Some(v) = c.usize(keys::ROPE_DIMS, usize::MAX)?
                && v != h.head_dim
            {
                return Err(c.unsupported(format!(
                    "partial rotary embedding ({} = {v}, head size {})",
                    c.name(keys::ROPE_DIMS),
                    h.head_dim
                )));
            }
            let full = rope_cfg::gguf_rope(c, h.head_dim, max_positions, 10000.0)?;
            // llama.cpp: Gemma 2's sliding layers share the full layers' base (unless the file
            // says otherwise) and scaling; Gemma 3's use 10000 (or the key) unscaled.
            let local = match version {
                Version::Two => Rope {
                    theta: c.positive(LOCAL_BASE)?.unwrap_or(full.theta),
                    scaling: full.scaling.clone(),
                },
                Version::Three => Rope {
                    theta: c.positive(LOCAL_BASE)?.unwrap_or(10000.0),
                    scaling: RopeScaling::None,
                },
            };
            (full, local)
        }
    };
    for r in [&full, &local] {
        rope_cfg::check_factors(c, r, h.head_dim)?;
    }
    Ok((full, local))
}

fn check_partial(c: Cfg, partial: Option<f64>) -> Result<(), ArchError> {
    match partial.or(c.positive(keys::PARTIAL_ROTARY)?) {
        Some(f) if f != 1.0 => Err(c.unsupported(format!("partial_rotary_factor {f} (Gemma rotates whole heads)"))),
        _ => Ok(()),
    }
}

/// Gemma 3's two RoPEs from a Hugging Face config, as `Gemma3TextConfig` reads them:
/// `rope_parameters` keyed by layer type (each dict's `rope_theta`, else the top-level
/// `rope_theta` / `rope_local_base_freq`), or the older form: `rope_theta` (default 1e6) with
/// `rope_scaling` for the full layers, `rope_local_base_freq` (default 10000) unscaled for the
/// sliding ones.
fn gemma3_hf_ropes(c: Cfg, d: &Defaults, max_positions: usize) -> Result<(Rope, Rope), ArchError> {
    let top = c.positive(keys::ROPE_THETA)?;
    let local_top = c.positive(LOCAL_BASE)?;
    let plain = |theta: f64| Rope {
        theta,
        scaling: RopeScaling::None,
    };
    let dict_rope = |p: &dyn Params, top: Option<f64>, default: f64| -> Result<Rope, ArchError> {
        let (rope, partial) = rope_cfg::hf_rope_dict(c, p, top, max_positions, default)?;
        check_partial(c, partial)?;
        Ok(rope)
    };
    let scaling = c.p.object("rope_scaling")?;
    if let Some(params) = c.p.object("rope_parameters")? {
        let sub = |name: &'static str| params.key(Key::hf(name)).unwrap_or_default();
        let (full_key, local_key) = (sub("full_attention"), sub("sliding_attention"));
        if !params.present(&full_key) && !params.present(&local_key) {
            return Err(c.unsupported(
                "rope_parameters not keyed by layer type (Gemma 3 needs full_attention and \
                 sliding_attention entries)"
                    .into(),
            ));
        }
        if scaling.is_some() {
            return Err(c.unsupported("rope_scaling together with per-layer-type rope_parameters".into()));
        }
        let full = match params.object(&full_key)? {
            Some(p) => dict_rope(&*p, top, d.rope_theta)?,
            None => plain(top.unwrap_or(d.rope_theta)),
        };
        let local = match params.object(&local_key)? {
            Some(p) => dict_rope(&*p, local_top, 10000.0)?,
            None => plain(local_top.unwrap_or(10000.0)),
        };
        return Ok((full, local));
    }
    let full = match scaling {
        Some(p) => dict_rope(&*p, top, d.rope_theta)?,
        None => plain(top.unwrap_or(d.rope_theta)),
    };
    Ok((full, plain(local_top.unwrap_or(10000.0))))
}
