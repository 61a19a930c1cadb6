//! The Llama family: Llama, Mistral, Qwen2 and Qwen3 (pre-norm RMSNorm blocks, rotate-half
//! RoPE, grouped-query attention, gated MLP), as `transformers` 5 defines each.
//!
//! | | q/k/v bias | o bias | MLP bias | q/k norm | sliding window |
//! |---|---|---|---|---|---|
//! | Llama | `attention_bias` | `attention_bias` | `mlp_bias` | | |
//! | Mistral | | | | | `sliding_window` (default 4096) on every layer |
//! | Qwen2 | always | | | | with `use_sliding_window`: `layer_types`, else layers from `max_window_layers` |
//! | Qwen3 | `attention_bias` | `attention_bias` | | always | as Qwen2 |
//!
//! GGUF files (`llama`, `qwen2`, `qwen3`) say which biases and norms exist by their tensors;
//! llama.cpp ignores their sliding-window keys for these architectures, and so does Kiln. The q
//! and k rows of `llama` files are permuted by llama.cpp's converter and put back at load.

use super::builder::{Attend, Builder, norm};
use super::common::{self, Heads};
use super::params::{ArchError, Cfg, Format, Key, MAX_POSITIONS, Params, keys};
use super::rope_cfg;
use super::{Architecture, Defaults};
use crate::graph::{OpKind, QkNormOp};
use crate::ops::{F32Bits, NormKind, Pairing};
use crate::spec::{Layout, ModelSpec, Role, WeightId};

/// Which optional parts a layer has.
struct Parts {
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool,
    qk_norm: bool,
}

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
    let eps = common::eps(c, keys::RMS_EPS, 1e-6)?;
    let act = common::activation(c, keys::ACT, "silu")?;
    let tied = common::tied(c, d, "output.weight")?;
    let parts = parts(c, arch.name)?;
    let (rope, dims) = rope(c, d, &h, max_positions)?;
    let windows = windows(c, arch.name, layers, max_positions)?;

    let mut b = Builder::new(
        arch.name,
        common::dims(hidden, intermediate, layers, &h, vocab, max_positions),
        c.format(),
    );
    let rotary = rope.rotary(dims, Pairing::Half);
    b.set_rope(rope);
    let embed = b.embed_tokens("model.embed_tokens.weight", "token_embd.weight", None);
    let permuted = c.is_gguf() && arch.name == "llama";
    for (l, window) in windows.into_iter().enumerate() {
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
        layer(&mut b, &h, intermediate, &parts, permuted, eps, act, attend);
    }
    b.norm_and_head(NormKind::Rms, eps, embed, tied, None);
    b.finish()
}

/// One decoder layer: tensors in checkpoint order, then its operations.
#[allow(clippy::too_many_arguments)]
fn layer(
    b: &mut Builder,
    h: &Heads,
    intermediate: usize,
    parts: &Parts,
    permuted: bool,
    eps: f32,
    act: crate::ops::Act,
    mut attend: Attend,
) {
    let l = b.current_layer().expect("inside a layer");
    let hidden = b.dims().hidden_size;
    let (q_dim, kv_dim) = (h.heads * h.head_dim, h.kv_heads * h.head_dim);
    let hf = |s: &str| format!("model.layers.{l}.{s}");
    let gg = |s: &str| format!("blk.{l}.{s}");
    let t = |b: &mut Builder, hf_name: &str, gguf_name: &str, shape: &[usize], role: Role, layout: Layout| {
        let name = b.name(hf(hf_name), gg(gguf_name));
        b.tensor_with(name, shape, role, layout)
    };
    let (pq, pk) = if permuted {
        (
            Layout::RopePermuted { heads: h.heads },
            Layout::RopePermuted { heads: h.kv_heads },
        )
    } else {
        (Layout::Plain, Layout::Plain)
    };
    let (m, v, plain) = (Role::Matrix, Role::Vector, Layout::Plain);
    let attn_norm = t(b, "input_layernorm.weight", "attn_norm.weight", &[hidden], v, plain);
    let wq = t(b, "self_attn.q_proj.weight", "attn_q.weight", &[q_dim, hidden], m, pq);
    let wk = t(b, "self_attn.k_proj.weight", "attn_k.weight", &[kv_dim, hidden], m, pk);
    let wv = t(
        b,
        "self_attn.v_proj.weight",
        "attn_v.weight",
        &[kv_dim, hidden],
        m,
        plain,
    );
    let wo = t(
        b,
        "self_attn.o_proj.weight",
        "attn_output.weight",
        &[hidden, q_dim],
        m,
        plain,
    );
    let opt = |b: &mut Builder, on: bool, hf_name: &str, gguf_name: &str, len: usize, layout: Layout| {
        on.then(|| t(b, hf_name, gguf_name, &[len], v, layout))
    };
    let bq = opt(b, parts.qkv_bias, "self_attn.q_proj.bias", "attn_q.bias", q_dim, pq);
    let bk = opt(b, parts.qkv_bias, "self_attn.k_proj.bias", "attn_k.bias", kv_dim, pk);
    let bv = opt(b, parts.qkv_bias, "self_attn.v_proj.bias", "attn_v.bias", kv_dim, plain);
    let bo = opt(
        b,
        parts.o_bias,
        "self_attn.o_proj.bias",
        "attn_output.bias",
        hidden,
        plain,
    );
    let qn = opt(
        b,
        parts.qk_norm,
        "self_attn.q_norm.weight",
        "attn_q_norm.weight",
        h.head_dim,
        plain,
    );
    let kn = opt(
        b,
        parts.qk_norm,
        "self_attn.k_norm.weight",
        "attn_k_norm.weight",
        h.head_dim,
        plain,
    );
    let mlp_norm = t(
        b,
        "post_attention_layernorm.weight",
        "ffn_norm.weight",
        &[hidden],
        v,
        plain,
    );
    let wg = t(
        b,
        "mlp.gate_proj.weight",
        "ffn_gate.weight",
        &[intermediate, hidden],
        m,
        plain,
    );
    let wu = t(
        b,
        "mlp.up_proj.weight",
        "ffn_up.weight",
        &[intermediate, hidden],
        m,
        plain,
    );
    let wd = t(
        b,
        "mlp.down_proj.weight",
        "ffn_down.weight",
        &[hidden, intermediate],
        m,
        plain,
    );
    let bg = opt(
        b,
        parts.mlp_bias,
        "mlp.gate_proj.bias",
        "ffn_gate.bias",
        intermediate,
        plain,
    );
    let bu = opt(
        b,
        parts.mlp_bias,
        "mlp.up_proj.bias",
        "ffn_up.bias",
        intermediate,
        plain,
    );
    let bd = opt(b, parts.mlp_bias, "mlp.down_proj.bias", "ffn_down.bias", hidden, plain);

    if let (Some(q), Some(k)) = (qn, kn) {
        attend.qk_norm = Some(QkNormOp {
            kind: NormKind::Rms,
            eps: F32Bits::new(eps),
            q,
            k,
        });
    }
    let x = b.residual();
    let xn = b.buffer("xn", hidden);
    let (q, k, vb) = (b.buffer("q", q_dim), b.buffer("k", kv_dim), b.buffer("v", kv_dim));
    let attn = b.buffer("attn", q_dim);
    let whole = |b: &Builder, id: Option<WeightId>| id.map(|i| b.whole(i));
    b.norm(x, xn, norm(NormKind::Rms, eps, attn_norm, None), false);
    for (w, bias, out) in [(wq, bq, q), (wk, bk, k), (wv, bv, vb)] {
        let (w, bias) = (b.whole(w), whole(b, bias));
        b.linear(xn, w, bias, out, false);
    }
    b.attend(&attend, q, k, vb, attn);
    let (wo, bo) = (b.whole(wo), whole(b, bo));
    b.linear(attn, wo, bo, x, true);
    b.norm(x, xn, norm(NormKind::Rms, eps, mlp_norm, None), false);
    let (gate, up) = (b.buffer("gate", intermediate), b.buffer("up", intermediate));
    for (w, bias, out) in [(wg, bg, gate), (wu, bu, up)] {
        let (w, bias) = (b.whole(w), whole(b, bias));
        b.linear(xn, w, bias, out, false);
    }
    b.op(OpKind::GatedAct { gate, up, act });
    let (wd, bd) = (b.whole(wd), whole(b, bd));
    b.linear(gate, wd, bd, x, true);
}

/// Biases and norms each variant has (a GGUF file says so by its tensors).
fn parts(c: Cfg, arch: &str) -> Result<Parts, ArchError> {
    if c.is_gguf() {
        let has = |n: &str| common::has_tensor(c, &format!("blk.0.{n}"));
        return Ok(Parts {
            qkv_bias: arch == "qwen2" || has("attn_q.bias"),
            o_bias: has("attn_output.bias"),
            mlp_bias: has("ffn_up.bias"),
            qk_norm: arch == "qwen3" || has("attn_q_norm.weight"),
        });
    }
    let attention_bias = c.bool(Key::hf("attention_bias"))?.unwrap_or(false);
    Ok(match arch {
        "llama" => Parts {
            qkv_bias: attention_bias,
            o_bias: attention_bias,
            mlp_bias: c.bool(Key::hf("mlp_bias"))?.unwrap_or(false),
            qk_norm: false,
        },
        "mistral" => Parts {
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
        },
        "qwen2" => Parts {
            qkv_bias: true,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
        },
        _ => Parts {
            qkv_bias: attention_bias,
            o_bias: attention_bias,
            mlp_bias: false,
            qk_norm: true,
        },
    })
}

/// The RoPE and its rotated dimensions (the whole head in this family).
fn rope(c: Cfg, d: &Defaults, h: &Heads, max_positions: usize) -> Result<(crate::rope::Rope, usize), ArchError> {
    let theta = d.rope_theta;
    let rope = match c.format() {
        Format::HuggingFace => {
            let (rope, partial) = rope_cfg::hf_rope(c, max_positions, theta)?;
            if let Some(f) = partial.or(c.positive(keys::PARTIAL_ROTARY)?)
                && f != 1.0
            {
                return Err(c.unsupported(format!(
                    "partial_rotary_factor {f} (this architecture rotates whole heads)"
                )));
            }
            rope
        }
        Format::Gguf => {
            if let Some(v) = c.usize(keys::ROPE_DIMS, usize::MAX)?
                && v != h.head_dim
            {
                return Err(c.unsupported(format!(
                    "partial rotary embedding ({} = {v}, head size {})",
                    c.name(keys::ROPE_DIMS),
                    h.head_dim
                )));
            }
            rope_cfg::gguf_rope(c, h.head_dim, max_positions, theta)?
        }
    };
    rope_cfg::check_factors(c, &rope, h.head_dim)?;
    Ok((rope, h.head_dim))
}

/// `sliding_window`, with the class default (4096) when absent and no window when null.
fn window_field(c: Cfg) -> Result<Option<usize>, ArchError> {
    let key = keys::SLIDING_WINDOW;
    if !c.present(key) {
        return Ok(Some(4096));
    }
    match c.usize(key, MAX_POSITIONS)? {
        Some(0) => Err(c.invalid(key, "must be greater than 0, got 0".into())),
        other => Ok(other),
    }
}

/// Per-layer sliding windows of a Hugging Face config, as `transformers` 5 decides them (see
/// the module table); GGUF files get none.
fn windows(c: Cfg, arch: &str, layers: usize, max_positions: usize) -> Result<Vec<Option<usize>>, ArchError> {
    let windows = match (c.format(), arch) {
        (Format::Gguf, _) | (_, "llama") => vec![None; layers],
        (_, "mistral") => vec![window_field(c)?; layers],
        _ => {
            let window = if c.bool(Key::hf("use_sliding_window"))?.unwrap_or(false) {
                window_field(c)?
            } else {
                None
            };
            let types_key = Key::hf("layer_types");
            match c.strings(types_key)? {
                Some(types) => {
                    if types.len() != layers {
                        return Err(c.invalid(
                            types_key,
                            format!(
                                "has {} entries, expected one per layer (num_hidden_layers = {layers})",
                                types.len()
                            ),
                        ));
                    }
                    let mut out = Vec::with_capacity(layers);
                    for (i, t) in types.iter().enumerate() {
                        match t.as_str() {
                            "full_attention" => out.push(None),
                            "sliding_attention" if window.is_some() => out.push(window),
                            "sliding_attention" => {
                                return Err(c.config_error(format!(
                                    "layer_types[{i}] is \"sliding_attention\" but no sliding window is set \
                                     (use_sliding_window is false or sliding_window is null)"
                                )));
                            }
                            other => {
                                return Err(c.unsupported(format!(
                                    "layer type \"{other}\" (layer_types[{i}]; supported: full_attention, \
                                     sliding_attention)"
                                )));
                            }
                        }
                    }
                    out
                }
                None => {
                    let first = c.usize(Key::hf("max_window_layers"), usize::MAX)?.unwrap_or(28);
                    (0..layers).map(|i| if i >= first { window } else { None }).collect()
                }
            }
        }
    };
    Ok(windows
        .into_iter()
        .map(|w| common::effective_window(w, max_positions))
        .collect())
}
