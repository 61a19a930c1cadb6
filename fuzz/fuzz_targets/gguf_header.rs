//! Coverage-guided fuzzing of the GGUF front end: header parser, model mapping and tokenizer
//! metadata. Any panic, out-of-bounds read or runaway allocation is a bug. See `fuzz/README.md`.

#![no_main]

use kiln_formats::gguf::{GgufHeader, model, tokenizer};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    let Ok(header) = GgufHeader::parse(data, path) else {
        return;
    };
    // Every tensor the parser accepted lies inside the input.
    for t in &header.tensors {
        assert!(t.start + t.size <= data.len() as u64);
    }
    let _ = model::spec_from_header(&header, data, path);
    if let Ok(vocab) = tokenizer::vocab_from_header(&header, path)
        && vocab.tokens.len() < 4096
    {
        let _ = tokenizer::tokenizer_json(&vocab, path);
    }
});
