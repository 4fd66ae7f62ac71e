//! What the fuzz targets share: a GGUF writer for metadata (a vocabulary, a chat template) and
//! a small vocabulary built with it, so that targets that need a tokenizer do not need a model.

use wisp_guest::gguf::Gguf;
use wisp_guest::tokenizer::Tokenizer;

/// A metadata value of a GGUF file.
pub enum Meta {
    Str(String),
    U32(u32),
    Bool(bool),
    Strs(Vec<String>),
    F32s(Vec<f32>),
    I32s(Vec<i32>),
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A GGUF (version 3) of `entries` and no tensors.
pub fn gguf(entries: &[(&str, Meta)]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (key, value) in entries {
        string(&mut out, key);
        let array = |out: &mut Vec<u8>, ty: u32, n: usize| {
            out.extend_from_slice(&9u32.to_le_bytes());
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(n as u64).to_le_bytes());
        };
        match value {
            Meta::Str(s) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                string(&mut out, s);
            }
            Meta::U32(v) => {
                out.extend_from_slice(&4u32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            Meta::Bool(b) => {
                out.extend_from_slice(&7u32.to_le_bytes());
                out.push(*b as u8);
            }
            Meta::Strs(v) => {
                array(&mut out, 8, v.len());
                v.iter().for_each(|s| string(&mut out, s));
            }
            Meta::F32s(v) => {
                array(&mut out, 6, v.len());
                v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            }
            Meta::I32s(v) => {
                array(&mut out, 5, v.len());
                v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            }
        }
    }
    out
}

/// The entries of a small SentencePiece vocabulary: `<unk>`, `<s>`, `</s>` (the end of
/// sequence), `<end_of_turn>` (control), the 256 byte tokens, and a few words.
pub fn small_vocabulary() -> Vec<(&'static str, Meta)> {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>", "<end_of_turn>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for w in ["\u{2581}the", "\u{2581}a", "\u{2581}", "e", "t", "ab", "{\"", "\":", "\u{2581}\"", "12", "true"] {
        tokens.push(w.to_string());
        types.push(1);
    }
    let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
    vec![
        ("tokenizer.ggml.model", Meta::Str("llama".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.scores", Meta::F32s(scores)),
        ("tokenizer.ggml.token_type", Meta::I32s(types)),
        ("tokenizer.ggml.unknown_token_id", Meta::U32(0)),
        ("tokenizer.ggml.bos_token_id", Meta::U32(1)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(2)),
    ]
}

/// The tokenizer of [`small_vocabulary`].
pub fn small_tokenizer() -> Tokenizer {
    let bytes = gguf(&small_vocabulary());
    match Gguf::parse(&bytes).map_err(|e| e.to_string()).and_then(|g| Tokenizer::from_gguf(&g)) {
        Ok(t) => t,
        Err(e) => panic!("the small vocabulary: {e}"),
    }
}
