//! [`WeightSource::release`] of GGUF weights: the pages of tensors read in place from the map
//! leave the process, their values do not change, and a tensor the source reorders into a
//! copy is left out.

use super::tests::Writer;
use super::*;
use crate::head_parts_reference::{HEADS, PARTS, ROWS, part_major};
use crate::loader::tests_release::{COLS, check_release, matrix, pattern};
use kiln_core::ModelSpec;
use kiln_core::spec::{Layout, Tensor};
use std::path::Path;

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
        let raw = pattern(i);
        data.extend(&raw);
        raws.push(raw);
        weights.push(matrix(name, layout));
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
    check_release(&w, &spec, [raws[0].clone(), part_major(&raws[1])]);
}
