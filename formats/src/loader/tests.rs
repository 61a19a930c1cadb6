//! Unit tests of the loader: weights as the kernels read them, by `weight_ptr` and `read_range`.

use super::*;
use kiln_core::spec::Role;
use safetensors::tensor::TensorView as StView;

/// A GPT-2 checkpoint named as the published `gpt2` names it (no `transformer.` prefix),
/// every tensor f32 holding its element indices: the spec's `transformer.*` names must find
/// them, and each `Conv1D` weight must reach the kernels transposed into `[out, in]`.
#[test]
fn gpt2_conv1d_weights_are_found_unprefixed_and_transposed_at_load() {
    let config = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"], "n_embd": 16, "n_layer": 1, "n_head": 2,
        "n_positions": 8, "vocab_size": 32, "n_inner": 24
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let layout = model::ModelConfig::from_file(&dir.path().join("config.json"))
        .unwrap()
        .layout;
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = layout
        .weights
        .iter()
        .map(|t| {
            let shape = t.stored_shape();
            let n: usize = shape.iter().product();
            let bytes = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
            let name = t.name.strip_prefix("transformer.").unwrap_or(&t.name).to_string();
            (name, shape, bytes)
        })
        .collect();
    let views: Vec<(&str, StView)> = data
        .iter()
        .map(|(n, s, b)| (n.as_str(), StView::new(safetensors::Dtype::F32, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();

    let loaded = model::load(dir.path()).unwrap();
    let spec = loaded.spec.clone();
    let weights = SafetensorsWeights::bind(loaded.weights, &spec).unwrap();
    let mut transposed_seen = 0;
    for (id, t) in spec.weight_ids().filter(|(_, t)| t.role == Role::Matrix) {
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let ptr = weights.weight_ptr(id).unwrap() as *const f32;
        // SAFETY: the pointer is to `rows * cols` f32 values owned by `weights`, alive here.
        let got = unsafe { std::slice::from_raw_parts(ptr, rows * cols) };
        for (r, c) in [(0, 1), (1, 0), (rows - 1, cols - 1), (rows / 2, cols / 3)] {
            let stored = match t.layout {
                Layout::Transposed => c * rows + r, // stored [cols, rows]
                _ => r * cols + c,
            };
            assert_eq!(got[r * cols + c], stored as f32, "{} [{r}, {c}]", t.name);
        }
        transposed_seen += (t.layout == Layout::Transposed) as usize;
    }
    // c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj.
    assert_eq!(transposed_seen, 4);
    assert_eq!(
        spec.weight(spec.weight_named("transformer.h.0.mlp.c_fc.weight").unwrap())
            .shape,
        [24, 16]
    );
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

/// `read_range` of every weight of `w` over each of `check::ranges`, all before any
/// `weight_ptr`; then asserts each read equals the bytes `weight_ptr` exposes.
fn reads_match_weight_ptr(w: &dyn WeightSource, spec: &ModelSpec, what: &str) {
    let reads: Vec<_> = spec
        .weight_ids()
        .map(|(id, t)| pread::check::read(w, id, t.bytes(), t.shape[0]))
        .collect();
    for ((id, t), reads) in spec.weight_ids().zip(&reads) {
        let exposed = pread::check::exposed(w, id, t.bytes());
        pread::check::same(reads, &exposed, &format!("{what}: {}", t.name));
    }
}

/// Invariant: for safetensors checkpoints, plain tensors (llama, GPT-2's embeddings and
/// norms) and GPT-2's transposed `Conv1D` weights, `read_range` over the whole tensor and
/// over whole-row and row-cutting sub-ranges returns exactly the bytes `weight_ptr`
/// exposes; reading makes no transposed copy, `weight_ptr` makes them on demand.
#[test]
fn safetensors_read_range_equals_weight_ptr_without_copying() {
    for (name, transposed) in [("llama", 0), ("gpt2", 4)] {
        let loaded = model::load(&fixture(name)).unwrap();
        let spec = loaded.spec.clone();
        let w = SafetensorsWeights::bind(loaded.weights, &spec).unwrap();
        let kinds = spec.weights.iter().filter(|t| t.layout == Layout::Transposed).count();
        assert_eq!(kinds, transposed * spec.num_layers(), "{name}");
        let reads: Vec<_> = spec
            .weight_ids()
            .map(|(id, t)| pread::check::read(&w, id, t.bytes(), t.shape[0]))
            .collect();
        assert_eq!(w.copies_made(), 0, "{name}: read_range made a copy");
        for ((id, t), reads) in spec.weight_ids().zip(&reads) {
            let exposed = pread::check::exposed(&w, id, t.bytes());
            pread::check::same(reads, &exposed, &format!("{name}: {}", t.name));
        }
        assert_eq!(w.copies_made(), kinds, "{name}");
        // Once the copies exist, reads (now from them) still agree.
        reads_match_weight_ptr(&w, &spec, name);
    }
}

/// Invariant: with `--dequantize`, converted tensors (q/k among them) are read from their
/// converted buffers and the others from the GGUF file, both equal to what `weight_ptr`
/// exposes; a range past a converted tensor is an error naming it.
#[test]
fn dequantized_read_range_equals_weight_ptr() {
    let path = fixture("gguf/llama-q8_0.gguf");
    let opts = LoadOptions {
        dequantize: Some(DType::F32),
        page_in: false,
        page_cache_marks: None,
        tokenizer_cache: None,
        grouping_lanes: None,
    };
    let m = load(&path, &opts).unwrap();
    assert!(!m.converted.is_empty());
    assert!(
        m.spec
            .weights
            .iter()
            .any(|t| !m.converted.iter().any(|(id, _)| m.spec.weight(*id).name == t.name))
    );
    reads_match_weight_ptr(m.weights.as_ref(), &m.spec, "dequantized");
    let (id, _) = m.converted[0];
    let len = m.spec.weight(id).bytes();
    let e = m.weights.read_range(id, len, &mut [0; 4]).unwrap_err();
    assert!(
        e.starts_with(&format!("{}: tensor {}", path.display(), m.spec.weight(id).name)),
        "{e}"
    );
}
