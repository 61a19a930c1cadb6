//! Phi-1, Phi-1.5 and Phi-2 (`PhiForCausalLM`), as `transformers` 5 defines them: one
//! LayerNorm (weight and bias) per block feeding attention and the MLP in parallel,
//! `x = x + attn(ln(x)) + mlp(ln(x))`; a partial rotary embedding (rotate-half pairs on the first
//! `int(head_dim * partial_rotary_factor)` dimensions of each head, the rest passed through);
//! biases on q, k, v, `dense`, `fc1`, `fc2` and the head; a GELU MLP; a final LayerNorm; an
//! untied head.
//!
//! The parallel block is listed as `ln`, q/k/v, `fc1`, `fc2 (+= x)`, attention, `dense (+= x)`:
//! every reader of the norm's output comes before the first write to `x`, so decode still folds
//! the norm into the four matmuls reading it (`graph/lower.rs` folds only while the norm's input
//! is unchanged), and the MLP's down projection shares a phase with the rotary embedding. The
//! residual sums in the order `(x + mlp) + attn` rather than `(attn + mlp) + x`: a rounding
//! difference only.
//!
//! `partial_rotary_factor` is read from the RoPE dict, else the top level, else 0.5 (the class's
//! default). `qk_layernorm: true` (not in any published checkpoint) is refused.
//!
//! GGUF files (`phi2`): llama.cpp's converter writes `blk.N.attn_q/k/v` for `PhiForCausalLM`
//! checkpoints and older files hold a fused `blk.N.attn_qkv` (read through row views); either is
//! accepted by presence. The rotated dimensions are `rope.dimension_count`.

use super::builder::{Attend, Builder, norm};
use super::common::{self, Heads};
use super::params::{ArchError, Cfg, Format, Key, keys};
use super::rope_cfg;
use super::{Architecture, Defaults};
use crate::ops::{Act, NormKind, Pairing};
use crate::rope::Rope;
use crate::spec::{ModelSpec, WeightId, WeightRef};

pub fn build(p: &dyn super::Params, arch: &Architecture) -> Result<ModelSpec, ArchError> {
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
    let eps = common::eps(c, keys::LN_EPS, 1e-5)?;
    let act = common::activation(c, keys::ACT, "gelu_new")?;
    let tied = common::tied(c, d, "output.weight")?;
    let qk_layernorm = Key::hf("qk_layernorm");
    if c.bool(qk_layernorm)? == Some(true) {
        return Err(
            c.unsupported("qk_layernorm true (per-head LayerNorm of q and k, in no published Phi checkpoint)".into())
        );
    }
    let (rope, dims) = rope(c, d, &h, max_positions)?;
    let fused_qkv = common::has_tensor(c, "blk.0.attn_qkv.weight");

    let mut b = Builder::new(
        arch.name,
        common::dims(hidden, intermediate, layers, &h, vocab, max_positions),
        c.format(),
    );
    let rotary = rope.rotary(dims, Pairing::Half);
    b.set_rope(rope);
    let embed = b.embed_tokens("model.embed_tokens.weight", "token_embd.weight", None);
    let x = b.residual();
    for l in 0..layers {
        b.layer(l);
        let attend = Attend {
            heads: h.heads,
            kv_heads: h.kv_heads,
            head_dim: h.head_dim,
            rotary: Some(rotary.clone()),
            qk_norm: None,
            window: None,
            scale: Attend::default_scale(h.head_dim),
            softcap: None,
        };
        block(&mut b, &h, intermediate, eps, act, &attend, fused_qkv);
    }
    b.head();
    let (w, bias) = pair(&mut b, "model.final_layernorm", "output_norm", hidden);
    let head = if tied {
        embed
    } else {
        let name = b.name("lm_head.weight", "output.weight");
        b.matrix(name, vocab, hidden)
    };
    let name = b.name("lm_head.bias", "output.bias");
    let head_bias = b.vector(name, vocab);
    let (xn, logits) = (b.buffer("xn", hidden), b.logits());
    b.norm(x, xn, norm(NormKind::Layer, eps, w, Some(bias)), false);
    let (head, head_bias) = (b.whole(head), b.whole(head_bias));
    b.linear(xn, head, Some(head_bias), logits, false);
    b.finish()
}

/// The rotary embedding and its rotated dimensions per head.
fn rope(c: Cfg, d: &Defaults, h: &Heads, max_positions: usize) -> Result<(Rope, usize), ArchError> {
    let (rope, dims) = match c.format() {
        Format::HuggingFace => {
            let (rope, partial) = rope_cfg::hf_rope(c, max_positions, d.rope_theta)?;
            let factor = match partial {
                Some(f) => f,
                None => c.positive(keys::PARTIAL_ROTARY)?.unwrap_or(0.5),
            };
            // `int(head_dim * partial_rotary_factor)`, as `transformers` truncates it.
            let dims = (h.head_dim as f64 * factor) as usize;
            if !rotatable(dims, h.head_dim) {
                return Err(c.unsupported(format!(
                    "partial_rotary_factor {factor} (rotates {dims} of the {} dimensions of a head; \
                     supported: an even number from 2 to the head size)",
                    h.head_dim
                )));
            }
            (rope, dims)
        }
        Format::Gguf => {
            let dims = c.usize(keys::ROPE_DIMS, usize::MAX)?.unwrap_or(h.head_dim);
            if !rotatable(dims, h.head_dim) {
                return Err(c.unsupported(format!(
                    "{} = {dims} (supported: an even number from 2 to the head size {})",
                    c.name(keys::ROPE_DIMS),
                    h.head_dim
                )));
            }
            (rope_cfg::gguf_rope(c, dims, max_positions, d.rope_theta)?, dims)
        }
    };
    rope_cfg::check_factors(c, &rope, dims)?;
    Ok((rope, dims))
}

/// Whether `dims` dimensions of a head of `head_dim` can be rotated (in pairs).
fn rotatable(dims: usize, head_dim: usize) -> bool {
    dims >= 2 && dims.is_multiple_of(2) && dims <= head_dim
}

/// A weight and bias `hf.{weight,bias}` / `gguf.{weight,bias}`, the weight `[rows, cols]`
/// (`cols = 0`: a vector of `rows`).
fn tensors(b: &mut Builder, hf: &str, gguf: &str, rows: usize, cols: usize) -> (WeightId, WeightId) {
    let w = b.name(format!("{hf}.weight"), format!("{gguf}.weight"));
    let w = if cols == 0 {
        b.vector(w, rows)
    } else {
        b.matrix(w, rows, cols)
    };
    let bias = b.name(format!("{hf}.bias"), format!("{gguf}.bias"));
    (w, b.vector(bias, rows))
}

/// A LayerNorm's weight and bias.
fn pair(b: &mut Builder, hf: &str, gguf: &str, len: usize) -> (WeightId, WeightId) {
    tensors(b, hf, gguf, len, 0)
}

/// The q, k and v projections with their biases: separate tensors, or row views of GGUF's
/// fused `attn_qkv`.
fn qkv(b: &mut Builder, h: &Heads, fused: bool) -> [(WeightRef, WeightRef); 3] {
    let l = b.current_layer().expect("inside a layer");
    let hidden = b.dims().hidden_size;
    let (q_dim, kv_dim) = (h.heads * h.head_dim, h.kv_heads * h.head_dim);
    if fused {
        let (w, bias) = tensors(b, "", &format!("blk.{l}.attn_qkv"), q_dim + 2 * kv_dim, hidden);
        let view = |b: &Builder, row0: usize, rows: usize| (b.rows(w, row0, rows), b.rows(bias, row0, rows));
        return [
            view(b, 0, q_dim),
            view(b, q_dim, kv_dim),
            view(b, q_dim + kv_dim, kv_dim),
        ];
    }
    [("q", q_dim), ("k", kv_dim), ("v", kv_dim)].map(|(p, rows)| {
        let hf = format!("model.layers.{l}.self_attn.{p}_proj");
        let (w, bias) = tensors(b, &hf, &format!("blk.{l}.attn_{p}"), rows, hidden);
        (b.whole(w), b.whole(bias))
    })
}

/// One parallel block: `x += fc2(act(fc1(ln(x))))`, then `x += dense(attn(ln(x)))`, both from
/// the same normalised row.
#[allow(clippy::too_many_arguments)]
fn block(b: &mut Builder, h: &Heads, intermediate: usize, eps: f32, act: Act, attend: &Attend, fused: bool) {
    let l = b.current_layer().expect("inside a layer");
    let hidden = b.dims().hidden_size;
    let (q_dim, kv_dim) = (h.heads * h.head_dim, h.kv_heads * h.head_dim);
    let hf = |s: &str| format!("model.layers.{l}.{s}");
    let gg = |s: &str| format!("blk.{l}.{s}");
    let (ln, ln_b) = pair(b, &hf("input_layernorm"), &gg("attn_norm"), hidden);
    let projections = qkv(b, h, fused);
    let (wo, wo_b) = tensors(b, &hf("self_attn.dense"), &gg("attn_output"), hidden, q_dim);
    let (up, up_b) = tensors(b, &hf("mlp.fc1"), &gg("ffn_up"), intermediate, hidden);
    let (down, down_b) = tensors(b, &hf("mlp.fc2"), &gg("ffn_down"), hidden, intermediate);

    let x = b.residual();
    let xn = b.buffer("xn", hidden);
    let (q, k, v) = (b.buffer("q", q_dim), b.buffer("k", kv_dim), b.buffer("v", kv_dim));
    let (attn, ffn) = (b.buffer("attn", q_dim), b.buffer("ffn", intermediate));
    b.norm(x, xn, norm(NormKind::Layer, eps, ln, Some(ln_b)), false);
    for ((w, bias), out) in projections.into_iter().zip([q, k, v]) {
        b.linear(xn, w, Some(bias), out, false);
    }
    let (up, up_b) = (b.whole(up), b.whole(up_b));
    b.linear_act(xn, up, Some(up_b), ffn, act);
    let (down, down_b) = (b.whole(down), b.whole(down_b));
    b.linear(ffn, down, Some(down_b), x, true);
    b.attend(attend, q, k, v, attn);
    let (wo, wo_b) = (b.whole(wo), b.whole(wo_b));
    b.linear(attn, wo, Some(wo_b), x, true);
}
