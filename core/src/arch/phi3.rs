//! Phi-3 (Phi-3 mini and medium, Phi-3.5-mini, Phi-4-mini): Llama's pre-norm RMSNorm
//! block with fused projections, as `transformers` 5's `modeling_phi3.py` defines it.
//!
//! * `qkv_proj` is one `[q_dim + 2 * kv_dim, hidden]` matrix and `gate_up_proj` one
//!   `[2 * intermediate, hidden]` matrix (gate rows first, then up, as `chunk(2)` splits it).
//!   Kiln reads the q, k, v, gate and up projections as row views of them (no copy), so decode
//!   still fuses gate and up into one `gate_up` kernel.
//! * RoPE is rotate-half over the first `int(head_dim * partial_rotary_factor)` dimensions
//!   (Phi-4-mini: 0.75), with `rope_scaling` either absent or LongRoPE (`longrope`; older
//!   configs say `su`, and `Phi3Config` also reads `yarn` as `longrope`). Other types are
//!   refused, as `Phi3Config` refuses them. `original_max_position_embeddings` is the class
//!   attribute (top-level field, default 4096), which `transformers` copies over the dict's value
//!   (except for `su`); the attention factor (mscale) is the dict's `attention_factor`, else
//!   `sqrt(1 + ln(f) / ln(original))` with `f` = `factor` or `max_position_embeddings /
//!   original` (1 when `f <= 1`), multiplied into cos and sin.
//! * LongRoPE switches tables per forward call: a call whose last position is past `original`
//!   rotates its rows with the long factors, earlier calls used the short ones. Kiln does what
//!   `transformers` does with a KV cache when a sequence crosses the boundary while decoding:
//!   keys already cached keep their short-factor rotation and new rows use the long factors.
//!   (`Phi3ForCausalLM.generate` instead drops its cache once, at the crossing, and recomputes
//!   the whole sequence with the long factors; llama.cpp picks one table for the whole context
//!   by its size, `n_ctx > original` meaning long factors throughout.)
//! * `sliding_window` (Phi-3-mini-4k: 2047; null for none) applies to every layer, each query
//!   seeing itself and the `window - 1` positions before it, as `transformers` 5 masks it.
//!   GGUF files carry it as `phi3.attention.sliding_window` (0: none, as for Phi-4). llama.cpp
//!   currently ignores it for `phi3` (a logged "Phi SWA is currently disabled"); Kiln applies it,
//!   so a GGUF file computes what the model was trained with and `transformers` computes, which
//!   differs from llama.cpp only for sequences longer than the window.
//!
//! GGUF (`phi3`): `blk.N.attn_qkv` and `blk.N.ffn_up` (gate and up stacked, as the Hugging Face
//! tensors), or separate `attn_q`/`attn_k`/`attn_v` (llama.cpp accepts both); the rotated
//! dimensions are `phi3.rope.dimension_count`; LongRoPE's tables are `rope_factors_long.weight` /
//! `rope_factors_short.weight` with `rope.scaling.original_context_length` and
//! `rope.scaling.attn_factor` (read by [`rope_cfg::gguf_rope`]).

use super::builder::{Attend, Builder, norm};
use super::common::{self, Heads};
use super::params::{ArchError, Cfg, Format, MAX_POSITIONS, Params, keys};
use super::rope_cfg::{self, HfRopeRules};
use super::{Architecture, Defaults};
use crate::graph::OpKind;
use crate::ops::{Act, NormKind, Pairing};
use crate::rope::{Rope, RopeScaling};
use crate::spec::{ModelSpec, Role, WeightRef};

/// `Phi3Config`'s RoPE standardisation (see the module documentation).
const RULES: HfRopeRules = HfRopeRules {
    class_original: Some(4096),
    longrope_aliases: &["yarn"],
};

pub fn build(p: &dyn Params, arch: &Architecture) -> Result<ModelSpec, ArchError> {
    let c = Cfg::new(p);
    let d = &arch.defaults;
    let common::Shape {
        hidden,
        intermediate,
        layers,
        vocab,
        heads: h,
        max_positions,
    } = common::shape(c, d)?;
    let eps = common::eps(c, keys::RMS_EPS, 1e-5)?;
    let act = common::activation(c, keys::ACT, "silu")?;
    let tied = common::tied(c, d, "output.weight")?;
    let (rope, dims) = rope(c, d, &h, max_positions)?;
    let window = window(c, max_positions)?;
    let fused_qkv = !c.is_gguf() || common::has_tensor(c, "blk.0.attn_qkv.weight");

    let mut b = Builder::new(
        arch.name,
        common::dims(hidden, intermediate, layers, &h, vocab, max_positions),
        c.format(),
    );
    let rotary = rope.rotary(dims, Pairing::Half);
    b.set_rope(rope);
    let embed = b.embed_tokens("model.embed_tokens.weight", "token_embd.weight", None);
    for l in 0..layers {
        b.layer(l);
        let attend = Attend {
            heads: h.heads,
            kv_heads: h.kv_heads,
            head_dim: h.head_dim,
            rotary: Some(rotary.clone()),
            qk_norm: None,
            window,
            scale: Attend::default_scale(h.head_dim),
            softcap: None,
        };
        layer(&mut b, &h, intermediate, fused_qkv, eps, act, &attend);
    }
    b.norm_and_head(NormKind::Rms, eps, embed, tied, None);
    b.finish()
}

/// One decoder layer: tensors in checkpoint order, then its operations.
fn layer(b: &mut Builder, h: &Heads, intermediate: usize, fused_qkv: bool, eps: f32, act: Act, attend: &Attend) {
    let l = b.current_layer().expect("inside a layer");
    let hidden = b.dims().hidden_size;
    let (q_dim, kv_dim) = (h.heads * h.head_dim, h.kv_heads * h.head_dim);
    let t = |b: &mut Builder, hf: &str, gguf: &str, shape: &[usize], role: Role| {
        let name = b.name(format!("model.layers.{l}.{hf}"), format!("blk.{l}.{gguf}"));
        b.tensor(name, shape, role)
    };
    let (m, v) = (Role::Matrix, Role::Vector);
    let attn_norm = t(b, "input_layernorm.weight", "attn_norm.weight", &[hidden], v);
    // q, k and v as views: of the fused matrix, or (GGUF only) of three separate ones.
    let qkv: [WeightRef; 3] = if fused_qkv {
        let w = t(
            b,
            "self_attn.qkv_proj.weight",
            "attn_qkv.weight",
            &[q_dim + 2 * kv_dim, hidden],
            m,
        );
        [
            b.rows(w, 0, q_dim),
            b.rows(w, q_dim, kv_dim),
            b.rows(w, q_dim + kv_dim, kv_dim),
        ]
    } else {
        let wq = t(b, "", "attn_q.weight", &[q_dim, hidden], m);
        let wk = t(b, "", "attn_k.weight", &[kv_dim, hidden], m);
        let wv = t(b, "", "attn_v.weight", &[kv_dim, hidden], m);
        [b.whole(wq), b.whole(wk), b.whole(wv)]
    };
    let wo = t(b, "self_attn.o_proj.weight", "attn_output.weight", &[hidden, q_dim], m);
    let mlp_norm = t(b, "post_attention_layernorm.weight", "ffn_norm.weight", &[hidden], v);
    let gate_up = t(
        b,
        "mlp.gate_up_proj.weight",
        "ffn_up.weight",
        &[2 * intermediate, hidden],
        m,
    );
    let wd = t(b, "mlp.down_proj.weight", "ffn_down.weight", &[hidden, intermediate], m);

    let x = b.residual();
    let xn = b.buffer("xn", hidden);
    let (q, k, vb) = (b.buffer("q", q_dim), b.buffer("k", kv_dim), b.buffer("v", kv_dim));
    let attn = b.buffer("attn", q_dim);
    b.norm(x, xn, norm(NormKind::Rms, eps, attn_norm, None), false);
    for (w, out) in qkv.into_iter().zip([q, k, vb]) {
        b.linear(xn, w, None, out, false);
    }
    b.attend(attend, q, k, vb, attn);
    let wo = b.whole(wo);
    b.linear(attn, wo, None, x, true);
    b.norm(x, xn, norm(NormKind::Rms, eps, mlp_norm, None), false);
    let (gate, up) = (b.buffer("gate", intermediate), b.buffer("up", intermediate));
    let (wg, wu) = (
        b.rows(gate_up, 0, intermediate),
        b.rows(gate_up, intermediate, intermediate),
    );
    b.linear(xn, wg, None, gate, false);
    b.linear(xn, wu, None, up, false);
    b.op(OpKind::GatedAct { gate, up, act });
    let wd = b.whole(wd);
    b.linear(gate, wd, None, x, true);
}

/// The RoPE and its rotated dimensions per head.
fn rope(c: Cfg, d: &Defaults, h: &Heads, max_positions: usize) -> Result<(Rope, usize), ArchError> {
    let (rope, dims) = match c.format() {
        Format::HuggingFace => {
            let (rope, partial) = rope_cfg::hf_rope_with(c, max_positions, d.rope_theta, &RULES)?;
            if !matches!(rope.scaling, RopeScaling::None | RopeScaling::LongRope { .. }) {
                return Err(c.unsupported(format!(
                    "rope_type '{}' for Phi-3 (Phi3Config accepts: default, longrope, su, yarn as longrope)",
                    rope.scaling.name()
                )));
            }
            let key = keys::PARTIAL_ROTARY;
            let factor = partial.or(c.positive(key)?).unwrap_or(1.0);
            if factor > 1.0 {
                return Err(c.invalid(key, format!("is {factor}, expected at most 1")));
            }
            // `int(head_dim * partial_rotary_factor)`, as transformers computes it.
            (rope, (h.head_dim as f64 * factor) as usize)
        }
        Format::Gguf => {
            let dims = c.usize(keys::ROPE_DIMS, h.head_dim)?.unwrap_or(h.head_dim);
            let rope = rope_cfg::gguf_rope(c, dims, max_positions, d.rope_theta)?;
            (rope, dims)
        }
    };
    if dims == 0 || !dims.is_multiple_of(2) {
        return Err(c.unsupported(format!(
            "{} rotary dimensions per head (head size {}): Kiln rotates an even, non-zero number",
            dims, h.head_dim
        )));
    }
    rope_cfg::check_factors(c, &rope, dims)?;
    Ok((rope, dims))
}

/// `sliding_window` of every layer: none when absent or null (GGUF: 0), as `Phi3Config`.
fn window(c: Cfg, max_positions: usize) -> Result<Option<usize>, ArchError> {
    let key = keys::SLIDING_WINDOW;
    let w = match c.usize(key, MAX_POSITIONS)? {
        Some(0) if c.is_gguf() => None,
        Some(0) => return Err(c.invalid(key, "must be greater than 0, got 0".into())),
        other => other,
    };
    Ok(common::effective_window(w, max_positions))
}
