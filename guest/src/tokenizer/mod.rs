//! Tokenizers from GGUF metadata, giving llama.cpp's token ids.
//!
//! Shared by every model type: the vocabulary, token types, special tokens, and the partition
//! of a text into special-token fragments and raw-text fragments (llama.cpp's
//! `tokenizer_st_partition`): user-defined tokens are always cut out of the text, control tokens
//! only when `parse_special` is set; longer tokens are cut first. Raw fragments then go to the
//! model's own algorithm (`spm.rs` for `tokenizer.ggml.model = llama`, `bpe.rs` with the
//! pre-tokenizer of `pretok.rs` for `gpt2`).

mod bpe;
mod pretok;
mod spm;

use crate::gguf::{Array, Gguf};
use std::collections::HashMap;

/// GGUF token types (`tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_id(id: i64) -> Self {
        match id {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

/// Which algorithm turns raw text into tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// SentencePiece-style: merges by score, `▁` for spaces, byte fallback.
    Spm,
    /// GPT-2-style byte-level BPE: merges by rank over a pre-tokenizer's words.
    Bpe,
}

pub struct Tokenizer {
    pub kind: Kind,
    pub model_name: String,
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<TokenType>,
    by_text: HashMap<String, u32>,
    /// Control, user-defined and unknown tokens, longest text first.
    specials: Vec<u32>,
    byte_tokens: [Option<u32>; 256],
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    add_space_prefix: bool,
    /// Merges and pre-tokenizer, for `Kind::Bpe`.
    bpe: Option<bpe::Bpe>,
    /// Tokens that end a generation.
    eog: Vec<u32>,
}

/// Why a tokenizer could not be built from the metadata.
pub type Error = String;

fn special_id(g: &Gguf, key: &str, n_vocab: usize) -> Result<Option<u32>, Error> {
    match g.get_u64(key)? {
        None => Ok(None),
        Some(id) if id < n_vocab as u64 => Ok(Some(id as u32)),
        // llama.cpp treats -1 (as u32::MAX) as "none".
        Some(id) if id == u32::MAX as u64 => Ok(None),
        Some(id) => Err(format!("{key} = {id} is not below the vocabulary size {n_vocab}")),
    }
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, Error> {
        let model = g.get_str("tokenizer.ggml.model")?.ok_or("tokenizer.ggml.model is missing")?;
        let kind = match model {
            "llama" => Kind::Spm,
            "gpt2" => Kind::Bpe,
            other => return Err(format!("unsupported tokenizer model {other:?}")),
        };
        let pre = g.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
        let tokens = match g.get_array("tokenizer.ggml.tokens")? {
            Some(Array::String(v)) if !v.is_empty() => v.clone(),
            _ => return Err("tokenizer.ggml.tokens is missing or not a list of strings".into()),
        };
        let n = tokens.len();
        if n > u32::MAX as usize / 2 {
            return Err(format!("vocabulary of {n} tokens is too large"));
        }
        let scores = match g.get_array("tokenizer.ggml.scores")? {
            Some(Array::F32(v)) if v.len() == n => v.clone(),
            None => vec![0.0; n],
            Some(a) => {
                return Err(format!("tokenizer.ggml.scores has {} entries, not {n} f32", a.len()));
            }
        };
        let types = match g.get_array("tokenizer.ggml.token_type")? {
            Some(a) if a.len() == n => (0..n)
                .map(|i| a.int_at(i).map(TokenType::from_id))
                .collect::<Option<Vec<_>>>()
                .ok_or("tokenizer.ggml.token_type is not a list of integers")?,
            None => vec![TokenType::Normal; n],
            Some(a) => {
                return Err(format!("tokenizer.ggml.token_type has {} entries, not {n}", a.len()));
            }
        };
        let mut by_text = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            // On duplicate texts the last id wins, as in llama.cpp.
            by_text.insert(t.clone(), i as u32);
        }
        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                matches!(
                    types[i as usize],
                    TokenType::Control | TokenType::UserDefined | TokenType::Unknown
                ) && !tokens[i as usize].is_empty()
            })
            .collect();
        // Longest first; equal lengths keep id order (a stable sort, as llama.cpp's list is
        // built in id order).
        specials.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = by_text.get(&format!("<0x{b:02X}>")).copied();
        }
        let bos = special_id(g, "tokenizer.ggml.bos_token_id", n)?;
        let eos = special_id(g, "tokenizer.ggml.eos_token_id", n)?;
        let unk = special_id(g, "tokenizer.ggml.unknown_token_id", n)?;
        let eot = special_id(g, "tokenizer.ggml.eot_token_id", n)?;
        let bpe = match kind {
            Kind::Spm => None,
            Kind::Bpe => {
                let ignore_merges = pretok::ignores_merges(pre);
                let pre = pretok::Pre::from_name(pre)
                    .ok_or_else(|| format!("unsupported BPE pre-tokenizer tokenizer.ggml.pre = {pre:?}"))?;
                let merges = match g.get_array("tokenizer.ggml.merges")? {
                    Some(Array::String(v)) => v,
                    _ => return Err("tokenizer.ggml.merges is missing or not a list of strings".into()),
                };
                Some(bpe::Bpe::new(merges, pre, ignore_merges)?)
            }
        };
        // As llama.cpp: SentencePiece and Llama 3 vocabularies add BOS unless the file says not.
        let bos_default = kind == Kind::Spm || pretok::Pre::from_name(pre) == Some(pretok::Pre::Llama3);
        let add_bos = g.get_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(bos_default);
        let add_eos = g.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let add_space_prefix = g.get_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        let mut eog: Vec<u32> = eos.into_iter().chain(eot).collect();
        // As llama.cpp: control tokens that by their text end a turn (or a fill-in-the-middle
        // answer) also end a generation.
        for name in [
            "<end_of_turn>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|im_end|>",
            "<|end|>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ] {
            if let Some(&id) = by_text.get(name) {
                if types[id as usize] == TokenType::Control && !eog.contains(&id) {
                    eog.push(id);
                }
            }
        }
        Ok(Tokenizer {
            kind,
            model_name: model.to_string(),
            tokens,
            scores,
            types,
            by_text,
            specials,
            byte_tokens,
            bos,
            eos,
            unk,
            add_bos,
            add_eos,
            add_space_prefix,
            bpe,
            eog,
        })
    }

    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Whether a token is a control, unknown or unused one: text never spells it.
    pub fn is_control(&self, id: u32) -> bool {
        matches!(
            self.types.get(id as usize),
            Some(TokenType::Control | TokenType::Unknown | TokenType::Unused)
        )
    }

    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(|s| s.as_str())
    }

    /// Text to ids, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut prev_special = true;
        for frag in self.partition(text, parse_special) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Raw(s) => {
                    match self.kind {
                        Kind::Spm => {
                            let mut t = String::with_capacity(s.len() + 3);
                            if self.add_space_prefix && prev_special {
                                t.push(' ');
                            }
                            t.push_str(s);
                            spm::encode(self, &t.replace(' ', "\u{2581}"), &mut out);
                        }
                        Kind::Bpe => {
                            if let Some(bpe) = &self.bpe {
                                bpe.encode(self, s, &mut out);
                            }
                        }
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Splits `text` at special tokens (longest first), as llama.cpp does before tokenizing.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut frags = vec![Fragment::Raw(text)];
        for &id in &self.specials {
            let ty = self.types[id as usize];
            if !parse_special && matches!(ty, TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            if !frags.iter().any(|f| matches!(f, Fragment::Raw(s) if s.contains(pat))) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Raw(mut s) => {
                        while let Some(at) = s.find(pat) {
                            if at > 0 {
                                next.push(Fragment::Raw(&s[..at]));
                            }
                            next.push(Fragment::Token(id));
                            s = &s[at + pat.len()..];
                        }
                        if !s.is_empty() {
                            next.push(Fragment::Raw(s));
                        }
                    }
                    token => next.push(token),
                }
            }
            frags = next;
        }
        frags
    }

    /// The bytes of one token, as llama.cpp's `token_to_piece`.
    pub fn piece(&self, id: u32, special: bool) -> Vec<u8> {
        let Some(text) = self.tokens.get(id as usize) else { return Vec::new() };
        match self.types[id as usize] {
            TokenType::Normal => match &self.bpe {
                Some(bpe) => {
                    let mut out = Vec::with_capacity(text.len());
                    bpe.decode(text, &mut out);
                    out
                }
                None => text.replace('\u{2581}', " ").into_bytes(),
            },
            TokenType::Byte => match self.byte_tokens.iter().position(|&b| b == Some(id)) {
                Some(b) => vec![b as u8],
                None => Vec::new(),
            },
            TokenType::UserDefined => text.as_bytes().to_vec(),
            TokenType::Control | TokenType::Unknown | TokenType::Unused => {
                if special { text.as_bytes().to_vec() } else { Vec::new() }
            }
        }
    }

    /// Ids to text; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.piece(id, special)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn lookup(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }

    /// The id of the token whose text is `text` (the last one, if several are).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.lookup(text)
    }
}

enum Fragment<'a> {
    Raw(&'a str),
    Token(u32),
}
