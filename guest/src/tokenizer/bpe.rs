//! Byte-level BPE (GPT-2 style, `tokenizer.ggml.model = gpt2`) as llama.cpp's
//! `llm_tokenizer_bpe`: the text is split into words by the pre-tokenizer that
//! `tokenizer.ggml.pre` names (`pretok.rs`); each word's bytes become printable characters
//! (GPT-2's byte-to-unicode table); then the adjacent pair with the lowest merge rank
//! (`tokenizer.ggml.merges`; ties: leftmost) is merged until no pair has a rank, and each
//! resulting symbol is looked up in the vocabulary.

use super::Tokenizer;
use super::pretok::{self, Pre};
use std::collections::{BinaryHeap, HashMap};

/// GPT-2's reversible map from bytes to characters: printable Latin-1 bytes map to themselves,
/// the others to U+0100 and on, in byte order.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(cp).unwrap_or('\u{FFFD}');
    }
    table
}

/// The merge table and pre-tokenizer of one vocabulary.
pub struct Bpe {
    /// `"left right"` (the GGUF merge text) -> rank; the first of duplicates wins.
    ranks: HashMap<String, u32>,
    pre: pretok::Splitter,
    /// Take a word that is itself a token whole, before merging (Llama 3 and the others
    /// `pretok::ignores_merges` names).
    ignore_merges: bool,
    byte_char: [char; 256],
    char_byte: HashMap<char, u8>,
}

impl Bpe {
    pub fn new(merges: &[String], pre: Pre, ignore_merges: bool) -> Result<Bpe, String> {
        let mut ranks = HashMap::with_capacity(merges.len());
        for (i, m) in merges.iter().enumerate() {
            ranks.entry(m.clone()).or_insert(i as u32);
        }
        let byte_char = byte_chars();
        let char_byte = byte_char.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        Ok(Bpe { ranks, pre: pre.splitter()?, ignore_merges, byte_char, char_byte })
    }

    /// The bytes a token's text stands for; characters outside the table stand for themselves.
    pub fn decode(&self, text: &str, out: &mut Vec<u8>) {
        let mut buf = [0u8; 4];
        for c in text.chars() {
            match self.char_byte.get(&c) {
                Some(&b) => out.push(b),
                None => out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes()),
            }
        }
    }

    /// Appends the tokens of `text` (no special tokens in it) to `out`.
    pub fn encode(&self, tok: &Tokenizer, text: &str, out: &mut Vec<u32>) {
        let mut word = String::new();
        let mut session = Session { bpe: self, tok, symbols: Vec::new(), queue: BinaryHeap::new(), key: String::new() };
        self.pre.split(text, |piece| {
            word.clear();
            word.extend(piece.bytes().map(|b| self.byte_char[b as usize]));
            session.word(&word, out);
        });
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

#[derive(PartialEq, Eq)]
struct Bigram {
    rank: u32,
    left: usize,
    right: usize,
    len: usize,
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // A max-heap: the lowest rank first; on a tie the leftmost pair.
        other.rank.cmp(&self.rank).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// Scratch reused across the words of one text.
struct Session<'a> {
    bpe: &'a Bpe,
    tok: &'a Tokenizer,
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Bigram>,
    key: String,
}

impl Session<'_> {
    fn add_bigram(&mut self, word: &str, left: Option<usize>, right: Option<usize>) {
        let (Some(left), Some(right)) = (left, right) else { return };
        let (l, r) = (self.symbols[left], self.symbols[right]);
        self.key.clear();
        self.key.push_str(&word[l.start..l.start + l.len]);
        self.key.push(' ');
        self.key.push_str(&word[r.start..r.start + r.len]);
        if let Some(&rank) = self.bpe.ranks.get(self.key.as_str()) {
            self.queue.push(Bigram { rank, left, right, len: l.len + r.len });
        }
    }

    /// Tokens of one pre-tokenized word (already mapped to byte characters).
    fn word(&mut self, word: &str, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if self.bpe.ignore_merges
            && let Some(id) = self.tok.token_id(word)
        {
            out.push(id);
            return;
        }
        self.symbols.clear();
        self.queue.clear();
        for (i, (start, ch)) in word.char_indices().enumerate() {
            let len = ch.len_utf8();
            self.symbols.push(Symbol {
                start,
                len,
                prev: i.checked_sub(1),
                next: if start + len == word.len() { None } else { Some(i + 1) },
            });
        }
        for i in 1..self.symbols.len() {
            self.add_bigram(word, Some(i - 1), Some(i));
        }
        while let Some(b) = self.queue.pop() {
            let (l, r) = (self.symbols[b.left], self.symbols[b.right]);
            // Skip pairs whose symbols have changed since the pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            self.symbols[b.left].len += r.len;
            self.symbols[b.right].len = 0;
            self.symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                self.symbols[n].prev = Some(b.left);
            }
            self.add_bigram(word, l.prev, Some(b.left));
            self.add_bigram(word, Some(b.left), r.next);
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = self.symbols[i];
            let text = &word[s.start..s.start + s.len];
            match self.tok.token_id(text) {
                Some(id) => out.push(id),
                // As llama.cpp: a symbol that is not a token falls back to its single bytes
                // that are tokens by themselves.
                None => {
                    let mut buf = [0u8; 4];
                    for &b in text.as_bytes().iter().filter(|b| b.is_ascii()) {
                        out.extend(self.tok.token_id((b as char).encode_utf8(&mut buf)));
                    }
                }
            }
            at = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(t[b'\n' as usize], '\u{10A}'); // Ċ
        assert_eq!(t[0], '\u{100}');
        assert_eq!(t[0xAD], '\u{143}');
        let mut seen: Vec<char> = t.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256, "the map is one to one");
    }
}
