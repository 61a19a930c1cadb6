//! [`Layout::HeadParts`] in safetensors checkpoints (Qwen3.5's `q_proj`: each head's query
//! rows, then its gate rows): [`SafetensorsWeights`] exposes the rows part-major, all queries
//! then all gates, through `weight_ptr` and `read_range` alike, for matrices and vectors.

use super::*;
use crate::head_parts_reference::{HEADS, PARTS, ROWS, part_major};
use kiln_core::spec::{Role, Tensor};
use safetensors::tensor::TensorView as StView;

/// `(name, storage type, columns)` of each test tensor: a bf16 and an f32 matrix, and an f32
/// bias (a vector: a row is one element).
const TENSORS: [(&str, DType, usize); 3] = [
    ("model.layers.0.self_attn.q_proj.weight", DType::BF16, 6),
    ("model.layers.0.self_attn.o_proj.weight", DType::F32, 5),
    ("model.layers.0.self_attn.q_proj.bias", DType::F32, 1),
];

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::BF16 => safetensors::Dtype::BF16,
        _ => safetensors::Dtype::F32,
    }
}

/// A checkpoint folder holding [`TENSORS`] (distinct bytes throughout), opened, and a spec
/// (taken from the llama fixture, weights replaced) reading them with `layout`.
fn model(dir: &Path, layout: Layout) -> (Weights, ModelSpec) {
    let mut weights = Vec::new();
    let mut data = Vec::new();
    for (i, (name, dtype, cols)) in TENSORS.into_iter().enumerate() {
        let shape = if cols == 1 { vec![ROWS] } else { vec![ROWS, cols] };
        let len = dtype.bytes_for(ROWS * cols);
        data.push((
            name,
            dtype,
            shape.clone(),
            (0..len).map(|b| (b * 7 + 31 * i) as u8).collect::<Vec<u8>>(),
        ));
        let role = if cols == 1 { Role::Vector } else { Role::Matrix };
        weights.push(Tensor {
            name: name.to_string(),
            shape,
            dtype,
            layout,
            role,
            layer: Some(0),
            row_groups: None,
            group_pair: None,
        });
    }
    let views: Vec<(&str, StView)> = data
        .iter()
        .map(|(n, d, s, b)| (*n, StView::new(st_dtype(*d), s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/llama");
    let base = model::load(&fixture).unwrap().spec;
    (Weights::open(dir).unwrap(), ModelSpec { weights, ..base })
}

/// Invariant: a `HeadParts` tensor (a bf16 or f32 matrix, or an f32 vector whose rows are
/// elements) is exposed by `weight_ptr` with its rows part-major, every head's query rows
/// then every head's gate rows; `read_range` over the whole tensor and whole-row and
/// row-cutting ranges returns those same bytes without making the copy (made lazily by
/// `weight_ptr`, then served by later reads).
#[test]
fn head_parts_are_read_part_major_by_weight_ptr_and_read_range() {
    let dir = tempfile::tempdir().unwrap();
    let (weights, spec) = model(
        dir.path(),
        Layout::HeadParts {
            heads: HEADS,
            parts: PARTS,
        },
    );
    let raws: Vec<Vec<u8>> = spec
        .weights
        .iter()
        .map(|t| weights.lookup(&t.name).unwrap().data.to_vec())
        .collect();
    let w = SafetensorsWeights::bind(weights, &spec).unwrap();
    let reads: Vec<_> = spec
        .weight_ids()
        .map(|(id, t)| pread::check::read(&w, id, t.bytes(), t.shape[0]))
        .collect();
    assert_eq!(w.copies_made(), 0, "read_range made a copy");
    for (((id, t), reads), raw) in spec.weight_ids().zip(&reads).zip(&raws) {
        let expected = part_major(raw);
        assert_ne!(&expected, raw, "{}", t.name);
        let exposed = pread::check::exposed(&w, id, t.bytes());
        assert_eq!(exposed, expected, "{}", t.name);
        pread::check::same(reads, &expected, &t.name);
        // From the copy now: the same bytes.
        let again = pread::check::read(&w, id, t.bytes(), t.shape[0]);
        pread::check::same(&again, &expected, &t.name);
    }
    assert_eq!(w.copies_made(), spec.weights.len());
}

/// Invariant: a `HeadParts` tensor whose rows do not split into its heads and parts is refused
/// when the weights are bound, naming the file, the tensor and the split it needed.
#[test]
fn head_parts_that_do_not_divide_are_refused_at_bind() {
    let dir = tempfile::tempdir().unwrap();
    let (weights, spec) = model(dir.path(), Layout::HeadParts { heads: 5, parts: 2 });
    let Err(e) = SafetensorsWeights::bind(weights, &spec) else {
        panic!("bound 24 rows as 5 heads x 2 parts");
    };
    let file = dir.path().join("model.safetensors");
    assert_eq!(
        e.to_string(),
        format!(
            "{}: tensor model.layers.0.self_attn.q_proj.weight has 24 rows, not a multiple of 5 heads x 2 parts",
            file.display()
        )
    );
}
