//! Phi-3 on its published configurations (Phi-3-mini-4k-instruct, Phi-3.5-mini-instruct's 128k
//! LongRoPE form), its fused projections read as views, and its refusals.

use super::{ArchError, HfConfig};
use crate::graph::tests::spec_of;
use crate::graph::{Arg, OpKind, block_graph};
use crate::ops::Rotary;
use crate::rope::RopeScaling;
use crate::spec::ModelSpec;
use serde_json::{Value, json};

/// microsoft/Phi-3-mini-4k-instruct's config.json (the fields that matter).
fn phi3_mini_4k() -> Value {
    json!({
        "architectures": ["Phi3ForCausalLM"], "attention_bias": false, "bos_token_id": 1,
        "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
        "pad_token_id": 32000, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": false, "vocab_size": 32064
    })
}

/// Phi-3.5-mini-instruct's published long factors (48, one per rotated pair of 96 dimensions).
const LONG: [f64; 48] = [
    1.0800000429153442,
    1.1100000143051147,
    1.1399999856948853,
    1.340000033378601,
    1.5899999141693115,
    1.600000023841858,
    1.6200000047683716,
    2.620000123977661,
    3.2300000190734863,
    3.2300000190734863,
    4.789999961853027,
    7.400000095367432,
    7.700000286102295,
    9.09000015258789,
    12.199999809265137,
    17.670000076293945,
    24.46000099182129,
    28.57000160217285,
    30.420001983642578,
    30.840002059936523,
    32.590003967285156,
    32.93000411987305,
    42.320003509521484,
    44.96000289916992,
    50.340003967285156,
    50.45000457763672,
    57.55000305175781,
    57.93000411987305,
    58.21000289916992,
    60.1400032043457,
    62.61000442504883,
    62.62000274658203,
    62.71000289916992,
    63.1400032043457,
    63.1400032043457,
    63.77000427246094,
    63.93000411987305,
    63.96000289916992,
    63.970001220703125,
    64.02999877929688,
    64.06999969482422,
    64.08000183105469,
    64.12000274658203,
    64.41000366210938,
    64.4800033569336,
    64.51000213623047,
    64.52999877929688,
    64.83999633789062,
];

/// Phi-3.5-mini-instruct's published short factors.
const SHORT: [f64; 48] = [
    1.0,
    1.0199999809265137,
    1.0299999713897705,
    1.0299999713897705,
    1.0499999523162842,
    1.0499999523162842,
    1.0499999523162842,
    1.0499999523162842,
    1.0499999523162842,
    1.0699999332427979,
    1.0999999046325684,
    1.1099998950958252,
    1.1599998474121094,
    1.1599998474121094,
    1.1699998378753662,
    1.2899998426437378,
    1.339999794960022,
    1.679999828338623,
    1.7899998426437378,
    1.8199998140335083,
    1.8499997854232788,
    1.8799997568130493,
    1.9099997282028198,
    1.9399996995925903,
    1.9899996519088745,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0799996852874756,
    2.0899996757507324,
    2.189999580383301,
    2.2199995517730713,
    2.5899994373321533,
    2.729999542236328,
    2.749999523162842,
    2.8399994373321533,
];

/// microsoft/Phi-3.5-mini-instruct's config.json: the 128k LongRoPE form Phi-3-mini-128k shares
/// (`original_max_position_embeddings` 4096 at the top level, 131072 positions, 48-entry lists).
fn phi35_mini_128k() -> Value {
    let mut c = phi3_mini_4k();
    let m = c.as_object_mut().unwrap();
    m.insert("max_position_embeddings".into(), json!(131072));
    m.insert("sliding_window".into(), json!(262144));
    m.insert(
        "rope_scaling".into(),
        json!({"long_factor": &LONG[..], "short_factor": &SHORT[..], "type": "longrope"}),
    );
    c
}

fn with(mut c: Value, key: &str, v: Value) -> Value {
    c.as_object_mut().unwrap().insert(key.into(), v);
    c
}

fn build(config: &Value) -> Result<ModelSpec, ArchError> {
    let arch = super::by_hf_name("Phi3ForCausalLM").unwrap();
    super::build(arch, &HfConfig::new(config.as_object().unwrap()))
}

fn err(config: Value) -> String {
    format!("{:?}", build(&config).expect_err("refused"))
}

/// The rotary embedding of the first layer.
fn rotary(s: &ModelSpec) -> Rotary {
    s.ops
        .iter()
        .find_map(|o| match &o.kind {
            OpKind::RopeKv { rotary, .. } => rotary.clone(),
            _ => None,
        })
        .expect("a rotary embedding")
}

/// Phi-3-mini-4k: dimensions, six tensors per layer (fused qkv and gate_up), the published
/// parameter count (3,821,079,552, as transformers' `from_config` on the meta device counts
/// it), the 2047-position window on every layer, and whole-head rotation without scaling.
#[test]
fn phi3_mini_4k_dims_tensors_and_window() {
    let s = spec_of(phi3_mini_4k());
    let d = &s.dims;
    assert_eq!(
        (d.hidden_size, d.num_layers, d.num_heads, d.num_kv_heads),
        (3072, 32, 32, 32)
    );
    assert_eq!((d.head_dim, d.intermediate_size, d.vocab_size), (96, 8192, 32064));
    assert_eq!(d.max_position_embeddings, 4096);
    assert!(!s.tied_embeddings());
    assert_eq!(s.weights.len(), 32 * 6 + 3);
    assert_eq!(s.param_count(), 3_821_079_552);
    let qkv = s
        .weights
        .iter()
        .find(|t| t.name == "model.layers.0.self_attn.qkv_proj.weight");
    assert_eq!(qkv.unwrap().shape, vec![3 * 3072, 3072]);
    assert!(s.attention_windows().iter().all(|&w| w == Some(2047)));
    let r = rotary(&s);
    assert_eq!((r.dims, r.long.is_none(), r.mscale), (96, true, None));
    assert_eq!(s.rope.as_ref().unwrap().scaling, RopeScaling::None);
}

/// q, k and v read consecutive row ranges of `qkv_proj`, gate and up the two halves of
/// `gate_up_proj` (gate first, as `chunk(2)` splits it).
#[test]
fn fused_projections_are_row_views() {
    let s = spec_of(phi3_mini_4k());
    let views: Vec<(String, usize, usize)> = s
        .ops
        .iter()
        .filter(|o| o.layer == Some(0))
        .filter_map(|o| match &o.kind {
            OpKind::Linear { w, .. } => Some((s.weight(w.id).name.clone(), w.row0, w.rows)),
            _ => None,
        })
        .collect();
    let (qkv, gu) = (
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
    );
    let expect = [
        (qkv, 0, 3072),
        (qkv, 3072, 3072),
        (qkv, 6144, 3072),
        ("model.layers.0.self_attn.o_proj.weight", 0, 3072),
        (gu, 0, 8192),
        (gu, 8192, 8192),
        ("model.layers.0.mlp.down_proj.weight", 0, 3072),
    ];
    let got: Vec<(&str, usize, usize)> = views.iter().map(|(n, a, b)| (n.as_str(), *a, *b)).collect();
    assert_eq!(got, expect);
}

/// Decode still fuses the two halves of `gate_up_proj` into one `gate_up` kernel per layer,
/// reading the gate and up views of the one tensor.
#[test]
fn decode_fuses_the_views_of_gate_up_proj() {
    let s = spec_of(phi3_mini_4k());
    let g = block_graph(&s, 1);
    let fused: Vec<_> = g.steps.iter().filter(|st| st.kernel.family() == "gate_up").collect();
    assert_eq!(fused.len(), 32);
    let rows: Vec<(usize, usize)> = fused[0]
        .args
        .iter()
        .filter_map(|a| match a {
            Arg::Weight(w) => Some((w.row0, w.rows)),
            _ => None,
        })
        .collect();
    assert_eq!(&rows[..2], &[(0, 8192), (8192, 8192)]);
}

/// The 128k form: LongRoPE with the published factor lists, original context 4096 from the top
/// level, long frequencies `base_inv_freq / long_factor` used past 4096 positions, and mscale
/// `sqrt(1 + ln(131072 / 4096) / ln(4096))` = 1.1902380714238083 (what transformers'
/// `_compute_longrope_parameters` returns); the 262144 window never excludes anything.
#[test]
fn phi3_128k_longrope_tables_and_mscale() {
    let s = spec_of(phi35_mini_128k());
    let Some(RopeScaling::LongRope {
        original_max_position_embeddings,
        attention_factor,
        ..
    }) = s.rope.as_ref().map(|r| r.scaling.clone())
    else {
        panic!("LongRoPE expected")
    };
    assert_eq!(original_max_position_embeddings, 4096);
    assert_eq!(attention_factor, 1.1902380714238083);
    let r = rotary(&s);
    let long = r.long.as_ref().expect("long frequencies");
    assert_eq!((r.dims, long.original), (96, 4096));
    assert_eq!(r.mscale.unwrap().get(), 1.1902380714238083f64 as f32);
    for i in [0, 17, 47] {
        let base = 1.0f32 / 10000f32.powf((2 * i) as f32 / 96.0);
        let (short, long) = (f32::from_bits(r.inv_freq[i]), f32::from_bits(long.inv_freq[i]));
        assert!((short * SHORT[i] as f32 - base).abs() <= 2.0 * f32::EPSILON * base);
        assert!((long * LONG[i] as f32 - base).abs() <= 2.0 * f32::EPSILON * base);
    }
    assert!(s.attention_windows().iter().all(|w| w.is_none()));
}

/// Phi-4-mini's partial rotary (0.75 of a 128 head: 96 dimensions, 48 factors per list); the
/// top-level field and the dict's field are both read.
#[test]
fn partial_rotary_factor_rotates_the_first_dims() {
    let c = with(phi35_mini_128k(), "hidden_size", json!(4096));
    let c = with(c, "partial_rotary_factor", json!(0.75));
    let s = build(&c).unwrap();
    assert_eq!((s.dims.head_dim, rotary(&s).dims), (128, 96));
    let mut c = with(phi3_mini_4k(), "hidden_size", json!(4096));
    c["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5});
    assert_eq!(rotary(&build(&c).unwrap()).dims, 64);
}

/// `original_max_position_embeddings` as Phi3Config standardises it: absent at the top level,
/// the class default 4096 wins over the dict's value for "longrope", the dict's wins for "su";
/// "yarn" is read as LongRoPE.
#[test]
fn original_context_follows_phi3config() {
    let original = |c: &Value| match build(c).unwrap().rope.unwrap().scaling {
        RopeScaling::LongRope {
            original_max_position_embeddings,
            ..
        } => original_max_position_embeddings,
        other => panic!("{other:?}"),
    };
    let mut c = phi35_mini_128k();
    c.as_object_mut().unwrap().remove("original_max_position_embeddings");
    c["rope_scaling"]["original_max_position_embeddings"] = json!(2048);
    assert_eq!(original(&c), 4096);
    c["rope_scaling"]["type"] = json!("su");
    assert_eq!(original(&c), 2048);
    c["rope_scaling"]["type"] = json!("yarn");
    assert_eq!(original(&c), 4096);
    let mut c = phi35_mini_128k();
    c["original_max_position_embeddings"] = json!(8192);
    assert_eq!(original(&c), 8192);
}

/// What Kiln does not implement, or what cannot be a Phi-3 model, is one error naming the field.
#[test]
fn refusals_name_the_field() {
    let mut c = phi3_mini_4k();
    c["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    assert!(err(c).contains("rope_type 'linear'"));
    let mut c = phi3_mini_4k();
    c["rope_scaling"] = json!({"type": "dynamic", "factor": 2.0});
    assert!(err(c).contains("rope_type 'dynamic'"));
    let mut c = phi35_mini_128k();
    c["rope_scaling"]["short_factor"] = json!([1.0, 1.0]);
    assert!(err(c).contains("short_factor has 2 factors, expected 48"));
    let c = with(phi3_mini_4k(), "partial_rotary_factor", json!(1.5));
    assert!(err(c).contains("partial_rotary_factor"));
    let c = with(phi3_mini_4k(), "sliding_window", json!(0));
    assert!(err(c).contains("sliding_window"));
    let c = with(phi3_mini_4k(), "hidden_act", json!("relu2"));
    assert!(err(c).contains("hidden_act 'relu2'"));
    let mut c = phi35_mini_128k();
    c["rope_scaling"].as_object_mut().unwrap().remove("long_factor");
    assert!(err(c).contains("rope_scaling.long_factor"));
}
