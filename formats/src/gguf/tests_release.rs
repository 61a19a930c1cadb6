//! [`WeightSource::release`] of GGUF weights: the pages of tensors read in place from the map
//! leave the process, their values do not change, and a tensor the source reorders into a
//! copy is left out.

use super::tests::Writer;
use super::*;
use crate::head_parts_reference::{HEADS, PARTS, ROWS, part_major};
use crate::loader::tests_release::mapping_rss;
use kiln_core::spec::{Layout, Role, Tensor};
use kiln_core::{DType, ModelSpec, WeightId};
use kiln_engine::engine::WeightSource;
use std::path::Path;

/// Columns of the f32 test matrices: 24 rows of 64 Ki (6 MiB each).
const COLS: usize = 1 << 16;

/// Invariant: `release` drops the mapped pages of a tensor read in place from the GGUF map
/// (the mapping's resident bytes fall by what it reports, at least 2 MiB) and leaves out one
/// whose rows were reordered into a copy; every value reads the same afterwards.
#[test]
fn released_tensors_leave_the_process_and_keep_their_values() {
    let dir = tempfile::tempdir().unwrap();
    let layouts = [
        ("blk.0.ffn_down.weight", Layout::Plain),
        (
            "blk.0.attn_q.weight",
            Layout::HeadParts {
                heads: HEADS,
                parts: PARTS,
            },
        ),
    ];
    let mut w = Writer::new(3);
    let (mut data, mut raws, mut weights): (Vec<u8>, Vec<Vec<u8>>, Vec<Tensor>) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (name, layout)) in layouts.into_iter().enumerate() {
        w = w.tensor(name, &[COLS as u64, ROWS as u64], 0, data.len() as u64);
        let raw: Vec<u8> = (0..ROWS * COLS * 4)
            .map(|b| (b * 7 + 31 * i + b / 4096) as u8)
            .collect();
        data.extend(&raw);
        raws.push(raw);
        weights.push(Tensor {
            name: name.to_string(),
            shape: vec![ROWS, COLS],
            dtype: DType::F32,
            layout,
            role: Role::Matrix,
            layer: Some(0),
            row_groups: None,
            group_pair: None,
        });
    }
    let mut bytes = w.finish();
    bytes.extend(data);
    let path = dir.path().join("release.gguf");
    std::fs::write(&path, bytes).unwrap();
    let base = load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/gguf/tiny-llama.gguf"))
        .unwrap()
        .spec;
    let spec = ModelSpec { weights, ..base };
    let w = GgufWeights::from_files(split::open_model(&path).unwrap(), &spec).unwrap();
    let ids: Vec<WeightId> = spec.weight_ids().map(|(id, _)| id).collect();
    let want = [raws[0].clone(), part_major(&raws[1])];
    let read = |id: WeightId| {
        let ptr = w.weight_ptr(id).unwrap();
        // SAFETY: the pointer is to the tensor's `ROWS * COLS` f32, alive as long as `w`.
        unsafe { std::slice::from_raw_parts(ptr, ROWS * COLS * 4) }.to_vec()
    };
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
