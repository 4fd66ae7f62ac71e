//! Both tokenizers (SentencePiece and byte-level BPE) built from hostile vocabularies (texts,
//! scores, types, merges, special ids and flags in a GGUF's metadata), then run on arbitrary
//! text: a vocabulary is either refused with an error or gives ids inside it, and every id
//! decodes (to its piece, its text, or nothing) without a panic.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use wisp_fuzz::{Meta, gguf};
use wisp_guest::gguf::Gguf;
use wisp_guest::tokenizer::Tokenizer;

#[derive(Arbitrary, Debug)]
struct Vocab {
    bpe: bool,
    pre: u8,
    tokens: Vec<(String, f32, i8)>,
    /// Merges as pairs of token indices (mostly) or raw text.
    merges: Vec<Result<(u16, u16), String>>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unk: Option<u32>,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    add_space_prefix: Option<bool>,
    /// Each token's text with a byte token `<0xNN>` for every byte, as real vocabularies have.
    byte_tokens: bool,
    text: String,
    add_special: bool,
    parse_special: bool,
}

/// One name of each kind of splitter (tests/pretok holds every name to llama.cpp's).
const PRES: [&str; 16] = [
    "qwen2", "llama-bpe", "default", "deepseek-r1-qwen", "gpt-4o", "smollm", "deepseek-llm", "deepseek-coder", "tekken",
    "jais-2", "superbpe", "chameleon", "afmoe", "bloom", "kimi-k2", "tiny_aya",
];

fuzz_target!(|v: Vocab| {
    let mut tokens: Vec<String> = v.tokens.iter().take(4096).map(|t| t.0.clone()).collect();
    let mut scores: Vec<f32> = v.tokens.iter().take(4096).map(|t| t.1).collect();
    let mut types: Vec<i32> = v.tokens.iter().take(4096).map(|t| t.2 as i32).collect();
    if v.byte_tokens {
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            scores.push(0.0);
            types.push(6);
        }
    }
    let merges: Vec<String> = v
        .merges
        .iter()
        .take(4096)
        .map(|m| match m {
            Ok((a, b)) if !tokens.is_empty() => {
                format!("{} {}", tokens[*a as usize % tokens.len()], tokens[*b as usize % tokens.len()])
            }
            Ok(_) => String::new(),
            Err(s) => s.clone(),
        })
        .collect();
    let mut entries = vec![
        ("tokenizer.ggml.model", Meta::Str(if v.bpe { "gpt2" } else { "llama" }.into())),
        ("tokenizer.ggml.pre", Meta::Str(PRES[v.pre as usize % PRES.len()].into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.scores", Meta::F32s(scores)),
        ("tokenizer.ggml.token_type", Meta::I32s(types)),
        ("tokenizer.ggml.merges", Meta::Strs(merges)),
    ];
    for (key, id) in [
        ("tokenizer.ggml.bos_token_id", v.bos),
        ("tokenizer.ggml.eos_token_id", v.eos),
        ("tokenizer.ggml.eot_token_id", v.eot),
        ("tokenizer.ggml.unknown_token_id", v.unk),
    ] {
        if let Some(id) = id {
            entries.push((key, Meta::U32(id)));
        }
    }
    for (key, flag) in [
        ("tokenizer.ggml.add_bos_token", v.add_bos),
        ("tokenizer.ggml.add_eos_token", v.add_eos),
        ("tokenizer.ggml.add_space_prefix", v.add_space_prefix),
    ] {
        if let Some(b) = flag {
            entries.push((key, Meta::Bool(b)));
        }
    }
    let bytes = gguf(&entries);
    let g = match Gguf::parse(&bytes) {
        Ok(g) => g,
        Err(e) => panic!("the writer's GGUF does not parse: {e}"),
    };
    let Ok(t) = Tokenizer::from_gguf(&g) else { return };
    let text: String = v.text.chars().take(2048).collect();
    let ids = t.encode(&text, v.add_special, v.parse_special);
    let n = t.n_vocab();
    assert!(ids.iter().all(|&id| (id as usize) < n), "an id outside the vocabulary of {n}: {ids:?}");
    let _ = t.decode(&ids, false);
    let _ = t.decode(&ids, true);
    for &id in ids.iter().take(64) {
        let _ = t.piece(id, true);
        let _ = t.token_text(id);
    }
    // Ids the vocabulary does not have decode to nothing, never a panic.
    let _ = t.decode(&[n as u32, u32::MAX], true);
});
