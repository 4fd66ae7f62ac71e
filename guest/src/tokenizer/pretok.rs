//! Pre-tokenizers of byte-level BPE vocabularies: the regexes llama.cpp selects by
//! `tokenizer.ggml.pre`, splitting text into the words that BPE then merges within.
//!
//! Every pattern ends in `\s+(?!\S)|\s+`, a lookahead the `regex` crate (linear time, no
//! backtracking) does not have. It is written out by hand: the pattern here ends in `\s+`, and a
//! whitespace match of more than one character that is followed by more text gives back its
//! last character, as `\s+(?!\S)` would — the same rule as llama.cpp's own splitters for these
//! patterns (`unicode_regex_split_custom_llama3`, `_gpt2`). In the Llama 3 and Qwen2 patterns a
//! run with a line break is the `\s*[\r\n]+` branch's, and keeps its last character.
//!
//! llama.cpp runs a list of patterns one after another, each within the pieces of the last:
//! SmolLM's (StarCoder's) first cuts out every digit alone, then GPT-2's pattern splits the text
//! between them, so that a space before a digit stays a word of its own.

use regex::Regex;
use std::sync::OnceLock;

/// The pre-tokenizers implemented, by `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pre {
    /// `qwen2` (and `deepseek-r1-qwen`): digits one at a time.
    Qwen2,
    /// `llama-bpe` (and `llama3`, `llama-v3`, `smaug-bpe`): digits in groups of up to three.
    Llama3,
    /// `gpt2` (and `mpt`, `olmo`, `jais`, `trillion`): GPT-2's pattern.
    Gpt2,
    /// `smollm` (and `starcoder`, `refact`, `command-r`, `codeshell`, `exaone`, `minerva`):
    /// every digit alone, then GPT-2's pattern between them.
    DigitsThenGpt2,
}

/// GPT-2's pattern, less its final lookahead branch: lower-case contractions, a space joined to
/// the letters, digits or other characters after it.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

const CONTRACTIONS: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";
const REST: &str = r"[^\r\n\p{L}\p{N}]?\p{L}+|DIGITS| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";

impl Pre {
    pub fn from_name(name: &str) -> Option<Pre> {
        match name {
            "qwen2" | "deepseek-r1-qwen" => Some(Pre::Qwen2),
            "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" => Some(Pre::Llama3),
            "gpt2" | "mpt" | "olmo" | "jais" | "trillion" => Some(Pre::Gpt2),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => Some(Pre::DigitsThenGpt2),
            _ => None,
        }
    }

    /// The pattern, less its final lookahead branch (see the module comment).
    fn pattern(self) -> String {
        let digits = match self {
            Pre::Qwen2 => r"\p{N}",
            Pre::Llama3 => r"\p{N}{1,3}",
            Pre::Gpt2 | Pre::DigitsThenGpt2 => return GPT2.to_string(),
        };
        format!("{CONTRACTIONS}|{}", REST.replace("DIGITS", digits))
    }

    /// The splitter: its pattern compiled once a process (a Unicode pattern takes
    /// milliseconds), then shared (a `Regex` clone shares its program).
    pub fn splitter(self) -> Result<Splitter, String> {
        static QWEN2: OnceLock<Result<Regex, String>> = OnceLock::new();
        static LLAMA3: OnceLock<Result<Regex, String>> = OnceLock::new();
        static GPT2: OnceLock<Result<Regex, String>> = OnceLock::new();
        let cell = match self {
            Pre::Qwen2 => &QWEN2,
            Pre::Llama3 => &LLAMA3,
            Pre::Gpt2 | Pre::DigitsThenGpt2 => &GPT2,
        };
        let re = cell.get_or_init(|| Regex::new(&self.pattern()).map_err(|e| format!("pre-tokenizer {self:?}: {e}"))).clone()?;
        let gpt2 = matches!(self, Pre::Gpt2 | Pre::DigitsThenGpt2);
        Ok(Splitter { re, digits_first: self == Pre::DigitsThenGpt2, breaks_give_back: gpt2 })
    }
}

/// A pre-tokenizer, ready to split text.
#[derive(Debug, Clone)]
pub struct Splitter {
    re: Regex,
    /// Every digit is a word of its own, and the pattern runs between them.
    digits_first: bool,
    /// A whitespace run with a line break gives back its last character too (GPT-2's pattern
    /// has no branch of its own for line breaks).
    breaks_give_back: bool,
}

impl Splitter {
    /// Calls `f` with each word of `text`, in order; the words cover the text exactly.
    pub fn split<'a>(&self, text: &'a str, mut f: impl FnMut(&'a str)) {
        if !self.digits_first {
            return split(&self.re, self.breaks_give_back, text, f);
        }
        let mut start = 0;
        for (i, c) in text.char_indices().filter(|(_, c)| c.is_numeric()) {
            split(&self.re, self.breaks_give_back, &text[start..i], &mut f);
            f(&text[i..i + c.len_utf8()]);
            start = i + c.len_utf8();
        }
        split(&self.re, self.breaks_give_back, &text[start..], f);
    }
}

/// Calls `f` with each word of `text` by `re` (a pattern ending in `\s+`, its lookahead
/// written out: see the module comment), in order; the words cover the text exactly.
fn split<'a>(re: &Regex, breaks_give_back: bool, text: &'a str, mut f: impl FnMut(&'a str)) {
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
            && (breaks_give_back || !word.contains(['\r', '\n']))
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
        let s = pre.splitter().expect("the pattern compiles");
        let mut v = Vec::new();
        s.split(text, |w| v.push(w));
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

    /// As llama.cpp's GPT-2 and SmolLM splitters cut them (`unicode_regex_split`).
    #[test]
    fn gpt2_and_smollm_keep_a_space_with_its_word_and_smollm_cuts_every_digit() {
        assert_eq!(words(Pre::Gpt2, "Hello world, it's 2024!"), ["Hello", " world", ",", " it", "'s", " 2024", "!"]);
        assert_eq!(words(Pre::DigitsThenGpt2, "Hello world, it's 2024!"), ["Hello", " world", ",", " it", "'s", " ", "2", "0", "2", "4", "!"]);
        assert_eq!(words(Pre::Gpt2, "He'LL  go\n\n  x"), ["He", "'", "LL", " ", " go", "\n\n ", " x"]);
        assert_eq!(words(Pre::DigitsThenGpt2, "x=12 \u{0663}y"), ["x", "=", "1", "2", " ", "\u{0663}", "y"]);
        assert_eq!(words(Pre::DigitsThenGpt2, "a   "), ["a", "   "]);
    }

    #[test]
    fn contractions_and_unicode() {
        assert_eq!(words(Pre::Qwen2, "He'LL go"), ["He", "'LL", " go"]);
        assert_eq!(words(Pre::Qwen2, "Größe — 大小 ✓\n"), ["Größe", " —", " 大小", " ✓\n"]);
    }
}
