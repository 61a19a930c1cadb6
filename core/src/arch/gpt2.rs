//! GPT-2 (`GPT2LMHeadModel`), as `transformers` 5 defines it: learned absolute positions added
//! to the token embedding, pre-norm blocks with LayerNorm (weight and bias), one fused `c_attn`
//! projection split into q, k and v, no rotary embedding, a GELU MLP, a final LayerNorm and a
//! head tied to the token embedding.
//!
//! Hugging Face checkpoints store every projection as a `Conv1D`, `[in, out]`: those tensors are
//! [`Layout::Transposed`] and put into `[out, in]` once, at load. The q, k and v projections are
//! row views (`Builder::rows`) of the fused `c_attn` weight and bias. Checkpoints saved without the
//! `transformer.` prefix (the published `gpt2`) are found by the safetensors front end.
//!
//! Config keys are GPT-2's own (`n_embd`, `n_layer`, `n_head`, `n_positions`, `n_inner`,
//! `layer_norm_epsilon`, `activation_function`). `scale_attn_weights: false` drops the
//! `1/sqrt(head_dim)` score scale, `scale_attn_by_inverse_layer_idx` divides layer `l`'s scale by
//! `l + 1`; `reorder_and_upcast_attn` only changes the order of an f32 computation Kiln does in
//! f32 anyway, and is accepted.
//!
//! GGUF files (`gpt2`) come from llama.cpp's converter, which un-transposes the `Conv1D` weights
//! (so every tensor is plain) and names them `token_embd`, `position_embd`, `blk.N.attn_norm`,
//! `attn_qkv`, `attn_output`, `ffn_norm`, `ffn_up`, `ffn_down`, `output_norm` and (untied only)
//! `output`. llama.cpp always scales scores by `1/sqrt(head_dim)`, and so does Kiln for GGUF.

use super::Architecture;
use super::builder::{Attend, Builder, norm};
use super::common;
use super::params::{ArchError, Cfg, Key};
use crate::graph::OpKind;
use crate::ops::{Act, F32Bits, NormKind};
use crate::spec::{Dims, Layout, ModelSpec, Role, WeightId};

/// GPT-2's own config keys (llama.cpp's names on the GGUF side).
mod gkeys {
    use super::Key;
    pub const HIDDEN: Key = Key::new("n_embd", "embedding_length");
    pub const LAYERS: Key = Key::new("n_layer", "block_count");
    pub const HEADS: Key = Key::new("n_head", "attention.head_count");
    pub const POSITIONS: Key = Key::new("n_positions", "context_length");
    pub const INNER: Key = Key::new("n_inner", "feed_forward_length");
    pub const EPS: Key = Key::new("layer_norm_epsilon", "attention.layer_norm_epsilon");
    pub const ACT: Key = Key::hf("activation_function");
    pub const SCALE: Key = Key::hf("scale_attn_weights");
    pub const INVERSE_LAYER: Key = Key::hf("scale_attn_by_inverse_layer_idx");
    pub const REORDER: Key = Key::hf("reorder_and_upcast_attn");
}

pub fn build(p: &dyn super::Params, arch: &Architecture) -> Result<ModelSpec, ArchError> {
    let c = Cfg::new(p);
    let d = &arch.defaults;
    let hidden = common::hidden(c, gkeys::HIDDEN)?;
    let layers = common::layers(c, gkeys::LAYERS)?;
    let vocab = common::vocab(c, "token_embd.weight", hidden)?;
    let heads = c.dim(gkeys::HEADS)?;
    if heads > 0 && !hidden.is_multiple_of(heads) {
        return Err(c.config_error(format!(
            "{} ({hidden}) is not a multiple of {} ({heads})",
            c.name(gkeys::HIDDEN),
            c.name(gkeys::HEADS)
        )));
    }
    let h = common::heads(c, d, hidden, gkeys::HEADS)?;
    if h.heads * h.head_dim != hidden || h.kv_heads != h.heads {
        return Err(c.unsupported(format!(
            "{} heads of {} ({} key/value heads) that do not split {} = {hidden} evenly",
            h.heads,
            h.head_dim,
            h.kv_heads,
            c.name(gkeys::HIDDEN)
        )));
    }
    let inner = inner(c, hidden)?;
    let max_positions = common::max_positions(c, d, gkeys::POSITIONS)?;
    let eps = common::eps(c, gkeys::EPS, 1e-5)?;
    let act = common::activation(c, gkeys::ACT, "gelu_new")?;
    let tied = common::tied(c, d, "output.weight")?;
    let scales = scales(c, layers, h.head_dim)?;

    let mut b = Builder::new(
        arch.name,
        Dims {
            hidden_size: hidden,
            intermediate_size: inner,
            num_layers: layers,
            num_heads: h.heads,
            num_kv_heads: h.kv_heads,
            head_dim: h.head_dim,
            vocab_size: vocab,
            max_position_embeddings: max_positions,
        },
        c.format(),
    );
    let name = b.name("transformer.wte.weight", "token_embd.weight");
    let wte = b.matrix(name, vocab, hidden);
    let name = b.name("transformer.wpe.weight", "position_embd.weight");
    let wpe = b.matrix(name, max_positions, hidden);
    let (tokens, x) = (b.tokens(), b.residual());
    b.op(OpKind::Embed {
        tokens,
        table: wte,
        out: x,
        scale: None,
        positions: Some(wpe),
    });
    for (l, scale) in scales.into_iter().enumerate() {
        b.layer(l);
        let attend = Attend {
            heads: h.heads,
            kv_heads: h.kv_heads,
            head_dim: h.head_dim,
            rotary: None,
            qk_norm: None,
            window: None,
            scale,
            softcap: None,
        };
        block(&mut b, inner, eps, act, &attend);
    }
    b.head();
    let (w, bias) = layer_norm(&mut b, "transformer.ln_f", "output_norm");
    let head = if tied {
        wte
    } else {
        let name = b.name("lm_head.weight", "output.weight");
        b.matrix(name, vocab, hidden)
    };
    let (xn, logits) = (b.buffer("xn", hidden), b.logits());
    b.norm(x, xn, norm(NormKind::Layer, eps, w, Some(bias)), false);
    let head = b.whole(head);
    b.linear(xn, head, None, logits, false);
    b.finish()
}

/// `n_inner` (null: `4 * n_embd`); GGUF `feed_forward_length`, required.
fn inner(c: Cfg, hidden: usize) -> Result<usize, ArchError> {
    match c.usize(gkeys::INNER, super::params::MAX_DIM)? {
        Some(v) => c.positive_dim(gkeys::INNER, v),
        None if c.is_gguf() => Err(c.missing(gkeys::INNER)),
        None => Ok(4 * hidden),
    }
}

/// Each layer's score scale: `head_dim^-0.5` (1 with `scale_attn_weights: false`), divided by
/// `layer + 1` with `scale_attn_by_inverse_layer_idx`, computed in f64 and rounded to f32 as
/// `transformers` multiplies an f32 tensor by the Python float.
fn scales(c: Cfg, layers: usize, head_dim: usize) -> Result<Vec<F32Bits>, ArchError> {
    let scaled = c.bool(gkeys::SCALE)?.unwrap_or(true);
    let inverse_layer = c.bool(gkeys::INVERSE_LAYER)?.unwrap_or(false);
    c.bool(gkeys::REORDER)?; // accepted either way, but must be a bool
    let base = if scaled { (head_dim as f64).powf(-0.5) } else { 1.0 };
    Ok((0..layers)
        .map(|l| {
            let s = if inverse_layer { base / (l + 1) as f64 } else { base };
            F32Bits::new(s as f32)
        })
        .collect())
}

/// A LayerNorm's weight and bias, `hf.{weight,bias}` or `gguf.{weight,bias}`.
fn layer_norm(b: &mut Builder, hf: &str, gguf: &str) -> (WeightId, WeightId) {
    let hidden = b.dims().hidden_size;
    let w = b.name(format!("{hf}.weight"), format!("{gguf}.weight"));
    let w = b.vector(w, hidden);
    let bias = b.name(format!("{hf}.bias"), format!("{gguf}.bias"));
    (w, b.vector(bias, hidden))
}

/// A projection `[out, inp]` and its bias: a `Conv1D` (stored transposed) in a Hugging Face
/// checkpoint, plain in GGUF.
fn conv1d(b: &mut Builder, hf: &str, gguf: &str, out: usize, inp: usize) -> (WeightId, WeightId) {
    let layout = match b.format() {
        super::Format::HuggingFace => Layout::Transposed,
        super::Format::Gguf => Layout::Plain,
    };
    let w = b.name(format!("{hf}.weight"), format!("{gguf}.weight"));
    let w = b.tensor_with(w, &[out, inp], Role::Matrix, layout);
    let bias = b.name(format!("{hf}.bias"), format!("{gguf}.bias"));
    (w, b.vector(bias, out))
}

/// One block: `x += c_proj(attn(split(c_attn(ln_1(x)))))`, then `x += mlp(ln_2(x))`.
fn block(b: &mut Builder, inner: usize, eps: f32, act: Act, attend: &Attend) {
    let l = b.current_layer().expect("inside a layer");
    let hidden = b.dims().hidden_size;
    let hf = |s: &str| format!("transformer.h.{l}.{s}");
    let gg = |s: &str| format!("blk.{l}.{s}");
    let (ln1, ln1_b) = layer_norm(b, &hf("ln_1"), &gg("attn_norm"));
    let (qkv, qkv_b) = conv1d(b, &hf("attn.c_attn"), &gg("attn_qkv"), 3 * hidden, hidden);
    let (wo, wo_b) = conv1d(b, &hf("attn.c_proj"), &gg("attn_output"), hidden, hidden);
    let (ln2, ln2_b) = layer_norm(b, &hf("ln_2"), &gg("ffn_norm"));
    let (up, up_b) = conv1d(b, &hf("mlp.c_fc"), &gg("ffn_up"), inner, hidden);
    let (down, down_b) = conv1d(b, &hf("mlp.c_proj"), &gg("ffn_down"), hidden, inner);

    let x = b.residual();
    let xn = b.buffer("xn", hidden);
    let (q, k, v) = (b.buffer("q", hidden), b.buffer("k", hidden), b.buffer("v", hidden));
    let attn = b.buffer("attn", hidden);
    b.norm(x, xn, norm(NormKind::Layer, eps, ln1, Some(ln1_b)), false);
    for (i, out) in [q, k, v].into_iter().enumerate() {
        let (w, bias) = (b.rows(qkv, i * hidden, hidden), b.rows(qkv_b, i * hidden, hidden));
        b.linear(xn, w, Some(bias), out, false);
    }
    b.attend(attend, q, k, v, attn);
    let (wo, wo_b) = (b.whole(wo), b.whole(wo_b));
    b.linear(attn, wo, Some(wo_b), x, true);
    b.norm(x, xn, norm(NormKind::Layer, eps, ln2, Some(ln2_b)), false);
    let h = b.buffer("ffn", inner);
    let (up, up_b) = (b.whole(up), b.whole(up_b));
    b.linear_act(xn, up, Some(up_b), h, act);
    let (down, down_b) = (b.whole(down), b.whole(down_b));
    b.linear(h, down, Some(down_b), x, true);
}
