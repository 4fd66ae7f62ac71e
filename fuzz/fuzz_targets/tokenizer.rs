//! The SentencePiece tokenizer of the default model on arbitrary text: no panic, every id in
//! the vocabulary, and decoding gives the text back (byte fallback makes it lossless; Gemma
//! adds no space prefix; a literal U+2581 comes back as a space). Needs the model: `WISP_FUZZ_MODEL` or ~/.cache/wisp/.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use wisp_guest::gguf::Gguf;
use wisp_guest::tokenizer::Tokenizer;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let path = std::env::var("WISP_FUZZ_MODEL").unwrap_or_else(|_| {
            format!("{}/.cache/wisp/gemma-3-270m-q4_k_m.gguf", std::env::var("HOME").unwrap_or_default())
        });
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
        Tokenizer::from_gguf(&Gguf::parse(&bytes).expect("a valid model")).expect("a tokenizer")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let t = tokenizer();
    let ids = t.encode(text, false, false);
    assert!(ids.iter().all(|&id| (id as usize) < t.n_vocab()));
    // Spaces travel as U+2581 inside SentencePiece tokens, so a literal U+2581 comes back as a
    // space (as in llama.cpp); everything else comes back byte for byte.
    assert_eq!(t.decode(&ids, false), text.replace('\u{2581}', " "), "round trip of {text:?}: {ids:?}");
});
