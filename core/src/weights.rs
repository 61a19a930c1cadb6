//! The weight tensors a [`ModelSpec`] needs: their identity, expected shape and storage type.
//!
//! Front ends (safetensors today, GGUF later) map their own tensor names onto [`WeightId`], and
//! every tensor is checked against [`weight_list`] before anything is compiled.

use crate::dtype::DType;
use crate::model::ModelSpec;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A tensor inside one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LayerWeight {
    AttnNorm,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    OBias,
    QNorm,
    KNorm,
    MlpNorm,
    Gate,
    Up,
    Down,
}

/// A weight tensor of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WeightId {
    Embed,
    FinalNorm,
    /// Absent from the list when embeddings are tied: the head then reads `Embed`.
    LmHead,
    Layer(usize, LayerWeight),
}

impl WeightId {
    /// The tensor's name in Hugging Face safetensors files.
    pub fn hf_name(self) -> String {
        match self {
            WeightId::Embed => "model.embed_tokens.weight".into(),
            WeightId::FinalNorm => "model.norm.weight".into(),
            WeightId::LmHead => "lm_head.weight".into(),
            WeightId::Layer(i, w) => {
                let suffix = match w {
                    LayerWeight::AttnNorm => "input_layernorm.weight",
                    LayerWeight::Q => "self_attn.q_proj.weight",
                    LayerWeight::K => "self_attn.k_proj.weight",
                    LayerWeight::V => "self_attn.v_proj.weight",
                    LayerWeight::O => "self_attn.o_proj.weight",
                    LayerWeight::QBias => "self_attn.q_proj.bias",
                    LayerWeight::KBias => "self_attn.k_proj.bias",
                    LayerWeight::VBias => "self_attn.v_proj.bias",
                    LayerWeight::OBias => "self_attn.o_proj.bias",
                    LayerWeight::QNorm => "self_attn.q_norm.weight",
                    LayerWeight::KNorm => "self_attn.k_norm.weight",
                    LayerWeight::MlpNorm => "post_attention_layernorm.weight",
                    LayerWeight::Gate => "mlp.gate_proj.weight",
                    LayerWeight::Up => "mlp.up_proj.weight",
                    LayerWeight::Down => "mlp.down_proj.weight",
                };
                format!("model.layers.{i}.{suffix}")
            }
        }
    }
}

impl fmt::Display for WeightId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hf_name())
    }
}

/// One required tensor: identity, shape (outermost first) and the storage type recorded in the
/// spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightReq {
    pub id: WeightId,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl WeightReq {
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.dtype.bytes_for(self.elems())
    }
}

/// Every tensor the model reads, in file order of a typical checkpoint.
pub fn weight_list(spec: &ModelSpec) -> Vec<WeightReq> {
    let h = spec.hidden_size;
    let mut out = vec![WeightReq {
        id: WeightId::Embed,
        shape: vec![spec.vocab_size, h],
        dtype: spec.embed_dtype,
    }];
    for (i, layer) in spec.layers.iter().enumerate() {
        let d = &layer.dtypes;
        let w = |lw, shape: Vec<usize>, dtype| WeightReq {
            id: WeightId::Layer(i, lw),
            shape,
            dtype,
        };
        out.push(w(LayerWeight::AttnNorm, vec![h], d.attn_norm));
        out.push(w(LayerWeight::Q, vec![spec.q_dim(), h], d.q));
        out.push(w(LayerWeight::K, vec![spec.kv_dim(), h], d.k));
        out.push(w(LayerWeight::V, vec![spec.kv_dim(), h], d.v));
        out.push(w(LayerWeight::O, vec![h, spec.q_dim()], d.o));
        let optional = [
            (LayerWeight::QBias, spec.q_dim(), d.q_bias),
            (LayerWeight::KBias, spec.kv_dim(), d.k_bias),
            (LayerWeight::VBias, spec.kv_dim(), d.v_bias),
            (LayerWeight::OBias, h, d.o_bias),
            (LayerWeight::QNorm, spec.head_dim, d.q_norm),
            (LayerWeight::KNorm, spec.head_dim, d.k_norm),
        ];
        for (lw, len, dtype) in optional {
            if let Some(dtype) = dtype {
                out.push(w(lw, vec![len], dtype));
            }
        }
        out.push(w(LayerWeight::MlpNorm, vec![h], d.mlp_norm));
        out.push(w(LayerWeight::Gate, vec![spec.intermediate_size, h], d.gate));
        out.push(w(LayerWeight::Up, vec![spec.intermediate_size, h], d.up));
        out.push(w(LayerWeight::Down, vec![h, spec.intermediate_size], d.down));
    }
    out.push(WeightReq {
        id: WeightId::FinalNorm,
        shape: vec![h],
        dtype: spec.final_norm_dtype,
    });
    if !spec.tie_word_embeddings {
        out.push(WeightReq {
            id: WeightId::LmHead,
            shape: vec![spec.vocab_size, h],
            dtype: spec.lm_head_dtype,
        });
    }
    out
}

/// Whether a spec of this shape expects the given layer tensor at all.
pub fn layer_has(spec: &ModelSpec, layer: usize, lw: LayerWeight) -> bool {
    let d = &spec.layers[layer].dtypes;
    match lw {
        LayerWeight::QBias => d.q_bias.is_some(),
        LayerWeight::KBias => d.k_bias.is_some(),
        LayerWeight::VBias => d.v_bias.is_some(),
        LayerWeight::OBias => d.o_bias.is_some(),
        LayerWeight::QNorm => d.q_norm.is_some(),
        LayerWeight::KNorm => d.k_norm.is_some(),
        _ => true,
    }
}
