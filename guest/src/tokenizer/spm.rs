//! SentencePiece-style tokenization as llama.cpp's `llm_tokenizer_spm`: start from UTF-8
//! characters, repeatedly merge the adjacent pair whose merged text is the vocabulary token with
//! the highest score (ties: leftmost), then emit each symbol's token, re-splitting symbols that
//! are not tokens into the pairs they were merged from, and finally into byte tokens.

use super::Tokenizer;
use std::collections::{BinaryHeap, HashMap};

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Highest score first; on a tie the leftmost pair.
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

struct Session<'a> {
    tok: &'a Tokenizer,
    text: &'a str,
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Bigram>,
    /// Merged text -> the pair of symbols it came from, for re-splitting.
    rev_merge: HashMap<&'a str, (usize, usize)>,
}

impl<'a> Session<'a> {
    fn try_add_bigram(&mut self, left: Option<usize>, right: Option<usize>) {
        let (Some(left), Some(right)) = (left, right) else { return };
        let (l, r) = (self.symbols[left], self.symbols[right]);
        let text = &self.text[l.start..r.start + r.len];
        let Some(id) = self.tok.lookup(text) else { return };
        self.queue.push(Bigram {
            score: self.tok.scores[id as usize],
            left,
            right,
            len: text.len(),
        });
        self.rev_merge.insert(text, (left, right));
    }

    fn resegment(&self, i: usize, out: &mut Vec<u32>) {
        let s = self.symbols[i];
        let text = &self.text[s.start..s.start + s.len];
        if let Some(id) = self.tok.lookup(text) {
            out.push(id);
            return;
        }
        match self.rev_merge.get(text) {
            Some(&(l, r)) => {
                self.resegment(l, out);
                self.resegment(r, out);
            }
            None => {
                for &b in text.as_bytes() {
                    match self.tok.byte_tokens[b as usize] {
                        Some(id) => out.push(id),
                        None => out.extend(self.tok.unk),
                    }
                }
            }
        }
    }
}

/// Appends the tokens of `text` (spaces already escaped as `▁`) to `out`.
pub(super) fn encode(tok: &Tokenizer, text: &str, out: &mut Vec<u32>) {
    if text.is_empty() {
        return;
    }
    let mut symbols = Vec::with_capacity(text.len());
    for (i, (start, ch)) in text.char_indices().enumerate() {
        let end = start + ch.len_utf8();
        symbols.push(Symbol {
            start,
            len: ch.len_utf8(),
            prev: i.checked_sub(1),
            next: if end == text.len() { None } else { Some(i + 1) },
        });
    }
    let mut s = Session { tok, text, symbols, queue: BinaryHeap::new(), rev_merge: HashMap::new() };
    for i in 1..s.symbols.len() {
        s.try_add_bigram(Some(i - 1), Some(i));
    }
    while let Some(b) = s.queue.pop() {
        let (l, r) = (s.symbols[b.left], s.symbols[b.right]);
        // Skip pairs whose symbols have changed since the pair was queued.
        if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
            continue;
        }
        s.symbols[b.left].len += r.len;
        s.symbols[b.right].len = 0;
        s.symbols[b.left].next = r.next;
        if let Some(n) = r.next {
            s.symbols[n].prev = Some(b.left);
        }
        s.try_add_bigram(l.prev, Some(b.left));
        s.try_add_bigram(Some(b.left), r.next);
    }
    let mut i = Some(0);
    while let Some(at) = i {
        s.resegment(at, out);
        i = s.symbols[at].next;
    }
}
