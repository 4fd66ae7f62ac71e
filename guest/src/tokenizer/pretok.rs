//! Pre-tokenizers of byte-level BPE vocabularies: the regexes llama.cpp selects by
//! `tokenizer.ggml.pre`, splitting text into the words that BPE then merges within.
//!
//! Both patterns end in `\s+(?!\S)|\s+`, a lookahead the `regex` crate (linear time, no
//! backtracking) does not have. It is written out by hand: the pattern here ends in `\s+`, and a
//! whitespace match that is followed by more text and has no line break (the `\s*[\r\n]+`
//! branch takes those) gives back its last character, as `\s+(?!\S)` would — the same rule as
//! llama.cpp's own splitter for these patterns (`unicode_regex_split_custom_llama3`).

use regex::Regex;
use std::sync::OnceLock;

/// The pre-tokenizers implemented, by `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pre {
    /// `qwen2` (and `deepseek-r1-qwen`): digits one at a time.
    Qwen2,
    /// `llama-bpe` (and `llama3`, `llama-v3`, `smaug-bpe`): digits in groups of up to three.
    Llama3,
}

const CONTRACTIONS: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";
const REST: &str = r"[^\r\n\p{L}\p{N}]?\p{L}+|DIGITS| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";

impl Pre {
    pub fn from_name(name: &str) -> Option<Pre> {
        match name {
            "qwen2" | "deepseek-r1-qwen" => Some(Pre::Qwen2),
            "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" => Some(Pre::Llama3),
            _ => None,
        }
    }

    /// The pattern, less its final lookahead branch (see the module comment).
    fn pattern(self) -> String {
        let digits = match self {
            Pre::Qwen2 => r"\p{N}",
            Pre::Llama3 => r"\p{N}{1,3}",
        };
        format!("{CONTRACTIONS}|{}", REST.replace("DIGITS", digits))
    }

    /// The compiled pattern: compiled once a process (a Unicode pattern takes milliseconds),
    /// then shared (a `Regex` clone shares its program).
    pub fn regex(self) -> Result<Regex, String> {
        static QWEN2: OnceLock<Result<Regex, String>> = OnceLock::new();
        static LLAMA3: OnceLock<Result<Regex, String>> = OnceLock::new();
        let cell = match self {
            Pre::Qwen2 => &QWEN2,
            Pre::Llama3 => &LLAMA3,
        };
        cell.get_or_init(|| Regex::new(&self.pattern()).map_err(|e| format!("pre-tokenizer {self:?}: {e}"))).clone()
    }
}

/// Calls `f` with each word of `text`, in order; the words cover the text exactly.
pub fn split<'a>(re: &Regex, text: &'a str, mut f: impl FnMut(&'a str)) {
    let mut at = 0;
    while at < text.len() {
        let Some(m) = re.find_at(text, at) else {
            f(&text[at..]);
            return;
        };
        if m.start() > at {
            f(&text[at..m.start()]);
        }
        let word = m.as_str();
        let mut end = m.end();
        // `\s+(?!\S)`: whitespace followed by more text leaves its last character to the next
        // word (`\s*[\r\n]+` matches whitespace runs with line breaks first).
        if end < text.len()
            && word.chars().all(char::is_whitespace)
            && !word.contains(['\r', '\n'])
            && word.chars().nth(1).is_some()
        {
            end -= word.chars().next_back().map_or(0, char::len_utf8);
        }
        f(&text[m.start()..end]);
        at = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: Pre, text: &str) -> Vec<&str> {
        let re = pre.regex().expect("the pattern compiles");
        let mut v = Vec::new();
        split(&re, text, |w| v.push(w));
        v
    }

    #[test]
    fn whitespace_before_a_word_goes_with_the_word() {
        assert_eq!(words(Pre::Qwen2, "a   b"), ["a", "  ", " b"]);
        assert_eq!(words(Pre::Qwen2, "a \tb"), ["a", " ", "\tb"]);
        assert_eq!(words(Pre::Qwen2, "a   "), ["a", "   "]);
        assert_eq!(words(Pre::Qwen2, "x  \n  y"), ["x", "  \n", " ", " y"]);
        assert_eq!(words(Pre::Qwen2, "int main(void) {"), ["int", " main", "(void", ")", " {"]);
    }

    #[test]
    fn digits_split_as_the_pattern_says() {
        assert_eq!(words(Pre::Qwen2, "x=12345"), ["x", "=", "1", "2", "3", "4", "5"]);
        assert_eq!(words(Pre::Llama3, "x=12345"), ["x", "=", "123", "45"]);
    }

    #[test]
    fn contractions_and_unicode() {
        assert_eq!(words(Pre::Qwen2, "He'LL go"), ["He", "'LL", " go"]);
        assert_eq!(words(Pre::Qwen2, "Größe — 大小 ✓\n"), ["Größe", " —", " 大小", " ✓\n"]);
    }
}
