//! Qwen3.5 (text), as `transformers` 5 defines it (`modeling_qwen3_5.py`) and llama.cpp reads
//! its GGUF files (`qwen35`): a hybrid of Gated DeltaNet layers (linear attention with a
//! recurrent state) and full-attention layers, `layer_types` (else every
//! `full_attention_interval`-th layer, default 4, is full attention).
//!
//! Every RMSNorm of the model (layer norms, final norm, q/k norms) scales by `1 + w`; llama.cpp's
//! converter stores `1 + w`, so in GGUF files they are plain RMSNorms. The gated norm inside a
//! DeltaNet layer scales by plain `w` in both.
//!
//! A **DeltaNet layer**: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` of the normed
//! input; the causal depthwise convolution (`linear_conv_kernel_dim` taps, state kept across
//! calls) with SiLU over the q/k/v projection; the delta rule ([`crate::graph::DeltaNet`]);
//! the gated RMSNorm with `z`; `out_proj` added to the residual. A **full-attention layer**:
//! `q_proj` yields each head's query and output gate (stored interleaved per head, read as
//! two row views after [`Layout::HeadParts`] puts all queries first); `(1 + w)` q/k norms;
//! rotary embedding of the first `partial_rotary_factor` of each head (the text-only case of
//! Qwen3.5's multimodal RoPE, where the three position grids coincide and it is plain RoPE);
//! attention; `attn * sigmoid(gate)`; `o_proj`. Both are followed by the gated MLP.
//!
//! Checkpoints of `Qwen3_5ForConditionalGeneration` hold the language model under
//! `text_config` and `model.language_model.*`; their vision tower is not read.

use super::builder::{Attend, Builder, norm};
use super::common::{self, Heads};
use super::params::{ArchError, Cfg, Key, MAX_DIM, Params, keys};
use super::rope_cfg;
use super::{Architecture, Defaults};
use crate::graph::{DeltaNet, OpKind, QkNormOp};
use crate::ops::{Act, DecayForm, F32Bits, HeadOrder, NormKind, Pairing, Rotary};
use crate::spec::{Layout, ModelSpec, Role, WeightId};

const CONV: Key = Key::new("linear_conv_kernel_dim", "ssm.conv_kernel");
const K_DIM: Key = Key::new("linear_key_head_dim", "ssm.state_size");
const K_HEADS: Key = Key::new("linear_num_key_heads", "ssm.group_count");
const V_HEADS: Key = Key::new("linear_num_value_heads", "ssm.time_step_rank");
const V_DIM: Key = Key::hf("linear_value_head_dim");
const V_WIDTH: Key = Key::gguf("ssm.inner_size");
const INTERVAL: Key = Key::new("full_attention_interval", "full_attention_interval");
/// llama.cpp's per-block flags (true: a DeltaNet layer), written when `layer_types` is given.
const RECURRENT: Key = Key::gguf("attention.recurrent_layers");
/// Multi-token-prediction blocks llama.cpp's converter appends after the model's own layers
/// (counted in `block_count`); Kiln does not read them.
const NEXTN: Key = Key::gguf("nextn_predict_layers");

/// The Gated DeltaNet layers' shape.
#[derive(Clone, Copy, Debug)]
struct Linear {
    conv: usize,
    k_heads: usize,
    v_heads: usize,
    k_dim: usize,
    v_dim: usize,
}

impl Linear {
    fn key_width(&self) -> usize {
        self.k_heads * self.k_dim
    }
    fn value_width(&self) -> usize {
        self.v_heads * self.v_dim
    }
    fn conv_width(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }
}

/// What every layer shares.
struct Shared {
    heads: Heads,
    linear: Linear,
    intermediate: usize,
    eps: f32,
    /// The `(1 + w)` norms: plain RMSNorms of the stored `1 + w` in GGUF files.
    kind: NormKind,
    act: Act,
    rotary: Rotary,
    /// Hugging Face tensor names' prefix of the language model (`model.` or
    /// `model.language_model.`).
    prefix: &'static str,
}

pub fn build(p: &dyn Params, arch: &Architecture) -> Result<ModelSpec, ArchError> {
    let top = Cfg::new(p);
    // `Qwen3_5ForConditionalGeneration`: the language model's own config.
    let text = if top.is_gguf() { None } else { p.object("text_config")? };
    let (c, prefix) = match &text {
        Some(t) => (Cfg::new(&**t), "model.language_model."),
        None => (top, "model."),
    };
    build_text(c, top, prefix, &arch.defaults, arch.name)
}

fn build_text(c: Cfg, top: Cfg, prefix: &'static str, d: &Defaults, name: &str) -> Result<ModelSpec, ArchError> {
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
    let tied = if c.is_gguf() {
        common::tied(c, d, "output.weight")?
    } else {
        // A multimodal checkpoint may say it at the top level only.
        c.bool(keys::TIE)?.or(top.bool(keys::TIE)?).unwrap_or(d.tie)
    };
    let full = full_layers(c, layers)?;
    // GGUF: without the multi-token-prediction blocks.
    let layers = full.len();
    let linear = linear_shape(c)?;
    let (rope, dims) = rope(c, d, &h, max_positions)?;
    let shared = Shared {
        heads: h,
        linear,
        intermediate,
        eps,
        kind: if c.is_gguf() {
            NormKind::Rms
        } else {
            NormKind::RmsPlusOne
        },
        act,
        rotary: rope.rotary(dims, Pairing::Half),
        prefix,
    };
    let mut b = Builder::new(
        name,
        common::dims(hidden, intermediate, layers, &h, vocab, max_positions),
        c.format(),
    );
    b.set_rope(rope);
    let embed_name = b.name(format!("{prefix}embed_tokens.weight"), "token_embd.weight");
    let embed = embed(&mut b, embed_name);
    for (l, &is_full) in full.iter().enumerate() {
        b.layer(l);
        if is_full {
            attention_layer(&mut b, &shared);
        } else {
            delta_net_layer(&mut b, &shared);
        }
        mlp(&mut b, &shared);
    }
    head(&mut b, &shared, embed, tied);
    b.finish()
}

/// Which layers are full attention: `layer_types`, else every `full_attention_interval`-th.
/// GGUF (as llama.cpp reads it): the layers are `block_count` less `nextn_predict_layers`, and
/// `attention.recurrent_layers`, one flag per block, says which are DeltaNet layers, else the
/// interval does.
fn full_layers(c: Cfg, layers: usize) -> Result<Vec<bool>, ArchError> {
    let layers = if c.is_gguf() {
        let nextn = c.usize(NEXTN, MAX_DIM)?.unwrap_or(0);
        if nextn >= layers {
            return Err(c.config_error(format!(
                "{} ({nextn}) leaves none of the {} ({layers}) blocks to the model",
                c.name(NEXTN),
                c.name(keys::LAYERS)
            )));
        }
        if let Some(flags) = c.floats(RECURRENT)? {
            if flags.len() != layers {
                return Err(c.invalid(
                    RECURRENT,
                    format!(
                        "has {} entries, expected one per block ({} = {layers})",
                        flags.len(),
                        c.name(keys::LAYERS)
                    ),
                ));
            }
            return Ok(flags[..layers - nextn].iter().map(|&f| f == 0.0).collect());
        }
        layers - nextn
    } else {
        layers
    };
    let kinds = [("linear_attention", false), ("full_attention", true)];
    if let Some(full) = common::layer_types(c, layers, &kinds)? {
        return Ok(full);
    }
    let interval = c.usize(INTERVAL, MAX_DIM)?.unwrap_or(4);
    if interval == 0 {
        return Err(c.invalid(INTERVAL, "must be at least 1, got 0".into()));
    }
    Ok((0..layers).map(|i| (i + 1) % interval == 0).collect())
}

/// The DeltaNet heads and convolution. GGUF gives the value width, not the value head size.
fn linear_shape(c: Cfg) -> Result<Linear, ArchError> {
    let (conv, k_heads, v_heads, k_dim) = if c.is_gguf() {
        (c.dim(CONV)?, c.dim(K_HEADS)?, c.dim(V_HEADS)?, c.dim(K_DIM)?)
    } else {
        let get =
            |key: Key, default: usize| -> Result<usize, ArchError> { Ok(c.usize(key, MAX_DIM)?.unwrap_or(default)) };
        (get(CONV, 4)?, get(K_HEADS, 16)?, get(V_HEADS, 32)?, get(K_DIM, 128)?)
    };
    for (key, v) in [(CONV, conv), (K_HEADS, k_heads), (V_HEADS, v_heads), (K_DIM, k_dim)] {
        c.positive_dim(key, v)?;
    }
    let v_dim = if c.is_gguf() {
        let width = c.dim(V_WIDTH)?;
        if !width.is_multiple_of(v_heads) || width == 0 {
            return Err(c.config_error(format!(
                "{} ({width}) is not a positive multiple of {} ({v_heads})",
                c.name(V_WIDTH),
                c.name(V_HEADS)
            )));
        }
        width / v_heads
    } else {
        let v = c.usize(V_DIM, MAX_DIM)?.unwrap_or(128);
        c.positive_dim(V_DIM, v)?
    };
    if conv < 2 {
        return Err(c.invalid(CONV, format!("must be at least 2, got {conv}")));
    }
    if !v_heads.is_multiple_of(k_heads) {
        return Err(c.config_error(format!(
            "{} ({v_heads}) must be a multiple of {} ({k_heads})",
            c.name(V_HEADS),
            c.name(K_HEADS)
        )));
    }
    Ok(Linear {
        conv,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
    })
}

/// The RoPE of the full-attention layers and its rotated dimensions per head.
fn rope(c: Cfg, d: &Defaults, h: &Heads, max_positions: usize) -> Result<(crate::rope::Rope, usize), ArchError> {
    let (rope, dims) = if c.is_gguf() {
        let dims = c.usize(keys::ROPE_DIMS, MAX_DIM)?.unwrap_or(h.head_dim / 4);
        (rope_cfg::gguf_rope(c, dims, max_positions, d.rope_theta)?, dims)
    } else {
        let (rope, partial) = rope_cfg::hf_rope(c, max_positions, d.rope_theta)?;
        let factor = partial.or(c.positive(keys::PARTIAL_ROTARY)?).unwrap_or(0.25);
        ((rope), (h.head_dim as f64 * factor) as usize)
    };
    if dims == 0 || dims % 2 != 0 || dims > h.head_dim {
        return Err(c.config_error(format!(
            "{dims} rotated dimensions per head of {}: expected an even number, at most the head size",
            h.head_dim
        )));
    }
    rope_cfg::check_factors(c, &rope, dims)?;
    Ok((rope, dims))
}

/// The token table and the embed step.
fn embed(b: &mut Builder, name: String) -> WeightId {
    let (vocab, hidden) = (b.dims().vocab_size, b.dims().hidden_size);
    let table = b.matrix(name, vocab, hidden);
    let (tokens, out) = (b.tokens(), b.residual());
    b.op(OpKind::Embed {
        tokens,
        table,
        out,
        scale: None,
        positions: None,
    });
    table
}

/// A tensor of the current layer named `hf` under the prefix, or `blk.{l}.gguf`.
fn tensor(b: &mut Builder, s: &Shared, hf: &str, gguf: &str, shape: &[usize], layout: Layout) -> WeightId {
    let l = b.current_layer().expect("inside a layer");
    let name = b.name(format!("{}layers.{l}.{hf}", s.prefix), format!("blk.{l}.{gguf}"));
    let role = if shape.len() == 1 { Role::Vector } else { Role::Matrix };
    b.tensor_with(name, shape, role, layout)
}

fn delta_net_layer(b: &mut Builder, s: &Shared) {
    let hidden = b.dims().hidden_size;
    let n = s.linear;
    let (conv_w, value_w) = (n.conv_width(), n.value_width());
    let plain = Layout::Plain;
    let gguf = b.format() == super::Format::Gguf;
    let attn_norm = tensor(b, s, "input_layernorm.weight", "attn_norm.weight", &[hidden], plain);
    let w_qkv = tensor(
        b,
        s,
        "linear_attn.in_proj_qkv.weight",
        "attn_qkv.weight",
        &[conv_w, hidden],
        plain,
    );
    let w_z = tensor(
        b,
        s,
        "linear_attn.in_proj_z.weight",
        "attn_gate.weight",
        &[value_w, hidden],
        plain,
    );
    let w_b = tensor(
        b,
        s,
        "linear_attn.in_proj_b.weight",
        "ssm_beta.weight",
        &[n.v_heads, hidden],
        plain,
    );
    let w_a = tensor(
        b,
        s,
        "linear_attn.in_proj_a.weight",
        "ssm_alpha.weight",
        &[n.v_heads, hidden],
        plain,
    );
    // Hugging Face: `[channels, 1, taps]`; llama.cpp squeezes it to `[channels, taps]`.
    let conv_shape: &[usize] = if gguf { &[conv_w, n.conv] } else { &[conv_w, 1, n.conv] };
    let l = b.current_layer().expect("inside a layer");
    let conv_name = b.name(
        format!("{}layers.{l}.linear_attn.conv1d.weight", s.prefix),
        format!("blk.{l}.ssm_conv1d.weight"),
    );
    let conv = b.tensor(conv_name, conv_shape, Role::Vector);
    let dt_bias = tensor(b, s, "linear_attn.dt_bias", "ssm_dt.bias", &[n.v_heads], plain);
    let a_param = tensor(b, s, "linear_attn.A_log", "ssm_a", &[n.v_heads], plain);
    let gated_norm = tensor(b, s, "linear_attn.norm.weight", "ssm_norm.weight", &[n.v_dim], plain);
    let w_out = tensor(
        b,
        s,
        "linear_attn.out_proj.weight",
        "ssm_out.weight",
        &[hidden, value_w],
        plain,
    );
    let mlp_norm = tensor(
        b,
        s,
        "post_attention_layernorm.weight",
        "post_attention_norm.weight",
        &[hidden],
        plain,
    );

    let x = b.residual();
    let xn = b.buffer("xn", hidden);
    let qkv = b.buffer("dn_qkv", conv_w);
    let qkv_conv = b.buffer("dn_qkv_conv", conv_w);
    let z = b.buffer("dn_z", value_w);
    let (beta_in, a_in) = (b.buffer("dn_b", n.v_heads), b.buffer("dn_a", n.v_heads));
    let core = b.buffer("dn_out", value_w);
    let conv_state = b.state(&format!("layers.{l}.conv_state"), (n.conv - 1) * conv_w);
    let state = b.state(&format!("layers.{l}.delta_state"), n.v_heads * n.k_dim * n.v_dim);

    b.norm(x, xn, norm(s.kind, s.eps, attn_norm, None), false);
    for (w, out) in [(w_qkv, qkv), (w_z, z), (w_b, beta_in), (w_a, a_in)] {
        let w = b.whole(w);
        b.linear(xn, w, None, out, false);
    }
    b.op(OpKind::CausalConv {
        x: qkv,
        out: qkv_conv,
        weight: conv,
        state: conv_state,
        kernel: n.conv,
    });
    b.op(OpKind::DeltaNet(DeltaNet {
        qkv: qkv_conv,
        a: a_in,
        b: beta_in,
        out: core,
        a_param,
        dt_bias,
        state,
        k_heads: n.k_heads,
        v_heads: n.v_heads,
        k_dim: n.k_dim,
        v_dim: n.v_dim,
        decay: if gguf { DecayForm::Negated } else { DecayForm::Log },
        order: if gguf { HeadOrder::Tiled } else { HeadOrder::Grouped },
    }));
    b.op(OpKind::GatedNorm {
        x: core,
        gate: z,
        weight: gated_norm,
        eps: F32Bits::new(s.eps),
        dim: n.v_dim,
    });
    let w_out = b.whole(w_out);
    b.linear(core, w_out, None, x, true);
    b.norm(x, xn, norm(s.kind, s.eps, mlp_norm, None), false);
}

fn attention_layer(b: &mut Builder, s: &Shared) {
    let hidden = b.dims().hidden_size;
    let h = &s.heads;
    let (q_dim, kv_dim) = (h.heads * h.head_dim, h.kv_heads * h.head_dim);
    let (m, plain) = (
        Layout::HeadParts {
            heads: h.heads,
            parts: 2,
        },
        Layout::Plain,
    );
    let attn_norm = tensor(b, s, "input_layernorm.weight", "attn_norm.weight", &[hidden], plain);
    let wq = tensor(
        b,
        s,
        "self_attn.q_proj.weight",
        "attn_q.weight",
        &[2 * q_dim, hidden],
        m,
    );
    let wk = tensor(
        b,
        s,
        "self_attn.k_proj.weight",
        "attn_k.weight",
        &[kv_dim, hidden],
        plain,
    );
    let wv = tensor(
        b,
        s,
        "self_attn.v_proj.weight",
        "attn_v.weight",
        &[kv_dim, hidden],
        plain,
    );
    let wo = tensor(
        b,
        s,
        "self_attn.o_proj.weight",
        "attn_output.weight",
        &[hidden, q_dim],
        plain,
    );
    let qn = tensor(
        b,
        s,
        "self_attn.q_norm.weight",
        "attn_q_norm.weight",
        &[h.head_dim],
        plain,
    );
    let kn = tensor(
        b,
        s,
        "self_attn.k_norm.weight",
        "attn_k_norm.weight",
        &[h.head_dim],
        plain,
    );
    let mlp_norm = tensor(
        b,
        s,
        "post_attention_layernorm.weight",
        "post_attention_norm.weight",
        &[hidden],
        plain,
    );

    let attend = Attend {
        heads: h.heads,
        kv_heads: h.kv_heads,
        head_dim: h.head_dim,
        rotary: Some(s.rotary.clone()),
        qk_norm: Some(QkNormOp {
            kind: s.kind,
            eps: F32Bits::new(s.eps),
            q: qn,
            k: kn,
        }),
        window: None,
        scale: Attend::default_scale(h.head_dim),
        softcap: None,
    };
    let x = b.residual();
    let xn = b.buffer("xn", hidden);
    let (q, k, v) = (b.buffer("q", q_dim), b.buffer("k", kv_dim), b.buffer("v", kv_dim));
    let gate = b.buffer("attn_gate", q_dim);
    let attn = b.buffer("attn", q_dim);
    b.norm(x, xn, norm(s.kind, s.eps, attn_norm, None), false);
    let (wq_rows, wg_rows) = (b.rows(wq, 0, q_dim), b.rows(wq, q_dim, q_dim));
    b.linear(xn, wq_rows, None, q, false);
    b.linear(xn, wg_rows, None, gate, false);
    for (w, out) in [(wk, k), (wv, v)] {
        let w = b.whole(w);
        b.linear(xn, w, None, out, false);
    }
    b.attend(&attend, q, k, v, attn);
    // `attn * sigmoid(gate)`, into the gate buffer.
    b.op(OpKind::GatedAct {
        gate,
        up: attn,
        act: Act::Sigmoid,
    });
    let wo = b.whole(wo);
    b.linear(gate, wo, None, x, true);
    b.norm(x, xn, norm(s.kind, s.eps, mlp_norm, None), false);
}

/// The gated MLP of every layer, reading the post-attention norm's output.
fn mlp(b: &mut Builder, s: &Shared) {
    let hidden = b.dims().hidden_size;
    let ff = s.intermediate;
    let plain = Layout::Plain;
    let wg = tensor(b, s, "mlp.gate_proj.weight", "ffn_gate.weight", &[ff, hidden], plain);
    let wu = tensor(b, s, "mlp.up_proj.weight", "ffn_up.weight", &[ff, hidden], plain);
    let wd = tensor(b, s, "mlp.down_proj.weight", "ffn_down.weight", &[hidden, ff], plain);
    let (x, xn) = (b.residual(), b.buffer("xn", hidden));
    let (gate, up) = (b.buffer("gate", ff), b.buffer("up", ff));
    for (w, out) in [(wg, gate), (wu, up)] {
        let w = b.whole(w);
        b.linear(xn, w, None, out, false);
    }
    b.op(OpKind::GatedAct { gate, up, act: s.act });
    let wd = b.whole(wd);
    b.linear(gate, wd, None, x, true);
}

/// The final `(1 + w)` norm and the output head (`lm_head`, or the embedding when tied).
fn head(b: &mut Builder, s: &Shared, embed: WeightId, tied: bool) {
    let (hidden, vocab) = (b.dims().hidden_size, b.dims().vocab_size);
    b.head();
    let norm_name = b.name(format!("{}norm.weight", s.prefix), "output_norm.weight");
    let final_norm = b.vector(norm_name, hidden);
    let head = if tied {
        embed
    } else {
        let name = b.name("lm_head.weight", "output.weight");
        b.matrix(name, vocab, hidden)
    };
    let (x, xn, logits) = (b.residual(), b.buffer("xn", hidden), b.logits());
    b.norm(x, xn, norm(s.kind, s.eps, final_norm, None), false);
    let w = b.whole(head);
    b.linear(xn, w, None, logits, false);
}
