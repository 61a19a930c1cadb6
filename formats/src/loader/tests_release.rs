//! [`WeightSource::release`] of safetensors weights: the pages of tensors read in place from
//! the map leave the process, their values do not change, and a tensor the source copied
//! (rows reordered) keeps its copy.

use super::*;
use crate::head_parts_reference::{HEADS, PARTS, ROWS, part_major};
use kiln_core::spec::{Role, Tensor};
use safetensors::tensor::TensorView as StView;

/// Columns of the test matrices: 24 rows of 64 Ki f32 (6 MiB), so a whole aligned 2 MiB span
/// lies inside each wherever the file puts it.
pub(crate) const COLS: usize = 1 << 16;

/// `(name, layout)` of each matrix, stored one after the other.
fn tensors() -> [(&'static str, Layout); 2] {
    [
        ("model.layers.0.mlp.down_proj.weight", Layout::Plain),
        (
            "model.layers.0.self_attn.q_proj.weight",
            Layout::HeadParts {
                heads: HEADS,
                parts: PARTS,
            },
        ),
    ]
}

/// The `ROWS x COLS` f32 test matrix `name`, stored with `layout`.
pub(crate) fn matrix(name: &str, layout: Layout) -> Tensor {
    Tensor {
        name: name.to_string(),
        shape: vec![ROWS, COLS],
        dtype: DType::F32,
        layout,
        role: Role::Matrix,
        layer: Some(0),
        row_groups: None,
        group_pair: None,
    }
}

/// The bytes of test matrix `i`: a pattern that differs from one matrix and one page to the
/// next.
pub(crate) fn pattern(i: usize) -> Vec<u8> {
    (0..ROWS * COLS * 4)
        .map(|b| (b * 7 + 31 * i + b / 4096) as u8)
        .collect()
}

/// This process's resident bytes of the mapping holding `addr` (`Rss` in `/proc/self/smaps`).
fn mapping_rss(addr: usize) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((lo, hi)) = range.split_once('-')
            && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            inside = (lo..hi).contains(&addr);
        } else if inside && let Some(kb) = line.strip_prefix("Rss:") {
            return kb.trim().trim_end_matches(" kB").trim().parse::<usize>().unwrap() * 1024;
        }
    }
    panic!("no mapping holds {addr:#x}")
}

/// Invariant: `release` drops the mapped pages of a tensor read in place (the mapping's
/// resident bytes fall by what it reports, at least 2 MiB here) while every value still reads
/// the same (from the page cache); a tensor whose rows the source reorders into a copy is left
/// out, and its copy keeps its values.
#[test]
fn released_tensors_leave_the_process_and_keep_their_values() {
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<Vec<u8>> = (0..2).map(pattern).collect();
    let views: Vec<(&str, StView)> = tensors()
        .iter()
        .zip(&data)
        .map(|((n, _), b)| (*n, StView::new(safetensors::Dtype::F32, vec![ROWS, COLS], b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    let weights: Vec<Tensor> = tensors()
        .into_iter()
        .map(|(name, layout)| matrix(name, layout))
        .collect();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/llama");
    let spec = ModelSpec {
        weights,
        ..model::load(&fixture).unwrap().spec
    };
    let w = SafetensorsWeights::bind(Weights::open(dir.path()).unwrap(), &spec).unwrap();
    check_release(&w, &spec, [data[0].clone(), part_major(&data[1])]);
}

/// Reads both tensors of `spec` from `w` (a plain one read in place, a reordered one copied),
/// releases them, and checks that the mapping's resident bytes fell by what `release`
/// reports (at least 2 MiB, at most the plain tensor) and that both still read `want`.
pub(crate) fn check_release(w: &dyn WeightSource, spec: &ModelSpec, want: [Vec<u8>; 2]) {
    let ids: Vec<WeightId> = spec.weight_ids().map(|(id, _)| id).collect();
    let read = |id: WeightId| {
        let ptr = w.weight_ptr(id).unwrap();
        // SAFETY: the pointer is to the tensor's `ROWS * COLS` f32, alive as long as `w`.
        unsafe { std::slice::from_raw_parts(ptr, ROWS * COLS * 4) }.to_vec()
    };
    // Both resident: the plain one read through the map, the reordered one copied.
    for (id, want) in ids.iter().zip(&want) {
        assert!(read(*id) == *want);
    }
    let mapped = w.weight_ptr(ids[0]).unwrap() as usize;
    let before = mapping_rss(mapped);
    let released = w.release(&ids);
    let after = mapping_rss(mapped);
    assert!(released >= 2 << 20, "released {released} bytes");
    assert!(released <= ROWS * COLS * 4, "released {released} bytes of one tensor");
    assert_eq!(before - after, released, "resident {before} -> {after}");
    for (id, want) in ids.iter().zip(&want) {
        assert!(read(*id) == *want, "{} changed", spec.weight(*id).name);
    }
}
