//! Pre-tokenizers of byte-level BPE vocabularies: every `tokenizer.ggml.pre` that llama.cpp's
//! vocabulary loader knows, splitting text into the words that BPE then merges within, as
//! llama.cpp's `unicode_regex_split` splits them (tests/pretok holds the two to each other).
//!
//! llama.cpp runs a list of patterns one after another, each within the pieces of the last; the
//! text a pattern leaves between two matches is a piece too. A pattern is run one of three ways,
//! and each way has quirks that decide the words, so each step here says which:
//!
//! - `Text`: the patterns llama.cpp has handwritten splitters for (GPT-2's, Llama 3's, Qwen2's,
//!   Qwen3.5's, Kimi K2's), which read Unicode categories of the text itself.
//! - `Collapsed`: a pattern with `\p{..}` goes to `std::regex` over a collapsed text, where each
//!   non-ASCII character stands as one byte for its category (a letter, a number, ...; Unicode
//!   whitespace as `\v`; any other as 0xD0) and `\p{L}` reads `[\xD2A-Za-z]`. So `[^a-z]`
//!   matches every non-ASCII letter, and Tekken's "upper case" and "lower case" letters are the
//!   same outside ASCII. Here the collapsed bytes are the characters U+00D0 to U+00D5.
//! - `Wide`: a pattern without `\p{..}` goes to `std::wregex` over the characters, Unicode
//!   whitespace read as `\v` (so `　` in a class matches nothing).
//!
//! The `regex` crate (linear time, no backtracking) has no lookaround; the lookarounds are
//! written out by hand. Most patterns end in `\s+(?!\S)|\s+`: here the pattern ends in `\s+`,
//! and a whitespace match of more than one character that is followed by more text gives back
//! its last character (`Tail::GiveBack`). Where the pattern has a `\s*[\r\n]+` branch before it,
//! a whitespace run with a line break is that branch's, and keeps its last character. Jais 2's
//! cascade `\s{512}(?!\S)|...|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}` is `Tail::Cascade`; Tekken's
//! `((?=[\p{L}])([^a-z]))` is the class `[\p{L}&&[^a-z]]`; SuperBPE's `(?=(\d{3})+(?!\d))` and
//! the digit groups of AFMoE and Tiny Aya are steps of their own, as in llama.cpp.
//!
//! Names llama.cpp knows that are left out: `gemma4`, `granite-embed-multi-311m`, `sarvam-moe`
//! and `whitespace` (raw UTF-8 pieces, not GPT-2 bytes: not byte-level BPE).

use regex::Regex;
use std::borrow::Cow;
use std::sync::OnceLock;

/// The pre-tokenizers, each a list of llama.cpp's patterns; the names of each are in
/// `from_name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pre {
    /// `default`: punctuation runs, GPT-2's pattern, numbers, then three ASCII digits.
    Default,
    /// `llama-bpe` and its kin: digits in groups of up to three; a word that is a token is
    /// taken whole; BOS by default.
    Llama3,
    /// Llama 3's pattern without Llama 3's flags: `dbrx`, `smaug-bpe`, `chatglm-bpe`, `glm4`.
    Llama3Pattern,
    /// `jais-2`: Llama 3's pattern with a cascade of whitespace runs.
    Jais2,
    /// `deepseek-llm`: line breaks, Latin and Greek words, punctuation, CJK runs, numbers.
    DeepseekLlm,
    /// `deepseek-coder`: line breaks, words, punctuation, CJK runs, every digit alone.
    DeepseekCoder,
    /// `deepseek-v3` (and `hunyuan-dense`, `joyai-llm`, `hy_v4`): digits in threes, CJK
    /// runs, then words with their marks.
    Deepseek3,
    /// `spark2_5`: DeepSeek V3's, each line break alone, then every digit alone.
    Spark25,
    /// `youtu`: Hangul, CJK punctuation, Bopomofo and CJK runs, then GPT-4o-like words.
    Youtu,
    /// `falcon`: punctuation runs, GPT-2's pattern, then three ASCII digits.
    Falcon,
    /// `smollm` and its kin: every digit alone, then GPT-2's pattern between them.
    DigitsThenGpt2,
    /// `gpt-2` and its kin: GPT-2's pattern.
    Gpt2,
    /// `qwen2` and its kin: digits one at a time.
    Qwen2,
    /// `qwen35`: Qwen2's, with combining marks in words.
    Qwen35,
    /// `bloom`, `poro-chat`, `gpt3-finnish`: runs between spaces and sentence punctuation.
    Bloom,
    /// `viking`: Bloom's, then every digit alone.
    Viking,
    /// `tekken`: cased words, every digit alone.
    Tekken,
    /// `chameleon`: sentinels, image tokens, tabs and space pairs, digits, punctuation, GPT-2.
    Chameleon,
    /// `gpt-4o` (and `llama4`, `kanana2`, `talkie`, `minimax-m2`): cased words with their
    /// contractions, digits in groups of up to three.
    Gpt4o,
    /// `granite-embed-multi-97m`: GPT-4o's, with combining marks in words.
    GraniteEmbMulti,
    /// `tiny_aya`, `cohere2moe`: digit groups of three from the right, then GPT-4o's words.
    TinyAya,
    /// `kimi-k2`: Han runs, words without Han, digits in groups of up to three.
    KimiK2,
    /// `superbpe`: only numbers are cut out, in groups of three ASCII digits from the right.
    SuperBpe,
    /// `bailingmoe` (and `bailingmoe2`, `llada-moe`): Qwen2's, contractions in any case.
    BailingMoe,
    /// `seed-coder`: Qwen2's, no line breaks after punctuation.
    SeedCoder,
    /// `ufakzeka`: Qwen2's without contractions.
    Ufakzeka,
    /// `afmoe`: digit groups of three from the right, Asian script runs, then DeepSeek V3's
    /// words.
    Afmoe,
    /// `laguna`: lines and runs of line breaks, then Qwen2's pattern.
    Laguna,
    /// `exaone-moe`: words joined by single spaces, every digit alone.
    ExaoneMoe,
    /// `minicpm5`: digits in groups of up to three, then Qwen2's pattern with whole numbers.
    MiniCpm5,
}

/// Whether llama.cpp takes a word that is itself a token whole, before any merge, for the
/// `tokenizer.ggml.pre` name (its loader's `ignore_merges`): by name, since `glm4` and `glm5`
/// do and `chatglm-bpe`, of the same pattern, does not.
pub fn ignores_merges(name: &str) -> bool {
    matches!(Pre::from_name(name), Some(Pre::Llama3 | Pre::Youtu | Pre::Tekken | Pre::GraniteEmbMulti | Pre::MiniCpm5))
        || matches!(name, "glm4" | "glm5")
}

impl Pre {
    /// The pre-tokenizer of a `tokenizer.ggml.pre` name, as llama.cpp's `llama_vocab::load`
    /// maps them (and `gpt2`, `minerva`, spellings wisp has taken before); `None` for a name
    /// llama.cpp does not know, or whose vocabulary is not byte-level.
    pub fn from_name(name: &str) -> Option<Pre> {
        Some(match name {
            "default" => Pre::Default,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
            | "jina-v5-nano" => Pre::Llama3,
            "dbrx" | "smaug-bpe" | "chatglm-bpe" | "glm4" | "glm5" => Pre::Llama3Pattern,
            "jais-2" => Pre::Jais2,
            "deepseek-llm" => Pre::DeepseekLlm,
            "deepseek-coder" => Pre::DeepseekCoder,
            "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => Pre::Deepseek3,
            "spark2_5" => Pre::Spark25,
            "youtu" => Pre::Youtu,
            "falcon" => Pre::Falcon,
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
            | "mellum2" | "minerva" => Pre::DigitsThenGpt2,
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0"
            | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "mpt" | "olmo"
            | "jais" | "trillion" | "granite-docling" | "exaone4" | "gpt2" => Pre::Gpt2,
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
            | "solar-open" | "grok-2" => Pre::Qwen2,
            "qwen35" => Pre::Qwen35,
            "bloom" | "poro-chat" | "gpt3-finnish" => Pre::Bloom,
            "viking" => Pre::Viking,
            "tekken" => Pre::Tekken,
            "chameleon" => Pre::Chameleon,
            "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => Pre::Gpt4o,
            "granite-embed-multi-97m" => Pre::GraniteEmbMulti,
            "tiny_aya" | "cohere2moe" => Pre::TinyAya,
            "kimi-k2" => Pre::KimiK2,
            "superbpe" => Pre::SuperBpe,
            "bailingmoe" | "bailingmoe2" | "llada-moe" => Pre::BailingMoe,
            "seed-coder" => Pre::SeedCoder,
            "ufakzeka" => Pre::Ufakzeka,
            "afmoe" => Pre::Afmoe,
            "laguna" => Pre::Laguna,
            "exaone-moe" => Pre::ExaoneMoe,
            "minicpm5" => Pre::MiniCpm5,
            _ => return None,
        })
    }

    /// llama.cpp's patterns, in order, less their lookarounds (see the module comment).
    fn steps(self) -> &'static [Step] {
        use Step::{Collapsed as C, DigitGroups, Newlines, Text as T, Thousands, Wide as W};
        use Tail::{Cascade, GiveBack, GiveBackNoBreaks as NoBreaks, Whole};
        match self {
            Pre::Default => &[C(PUNCT_DEFAULT, Whole), T(GPT2, GiveBack), C(r"\p{N}+", Whole), W("[0-9][0-9][0-9]")],
            Pre::Llama3 | Pre::Llama3Pattern => &[T(LLAMA3, NoBreaks)],
            Pre::Jais2 => &[C(LLAMA3, Cascade)],
            Pre::DeepseekLlm => &[
                W("[\r\n]"),
                W(DEEPSEEK_LLM_WORDS),
                W(DEEPSEEK_LLM_PUNCT),
                W(r"\s+$"),
                W(DEEPSEEK_CJK),
                C(r"\p{N}+", Whole),
            ],
            Pre::DeepseekCoder => &[
                W("[\r\n]"),
                C(r"\s?\p{L}+", Whole),
                C(r"\s?\p{P}+", Whole),
                W(DEEPSEEK_CJK),
                C(r"\p{N}", Whole),
            ],
            Pre::Deepseek3 => &[C(r"\p{N}{1,3}", Whole), W(CJK_KANA), C(DEEPSEEK3, NoBreaks)],
            Pre::Spark25 => &[C(r"\p{N}{1,3}", Whole), W(CJK_KANA), C(SPARK25, GiveBack), C(r"\p{N}", Whole)],
            Pre::Youtu => &[W(YOUTU_ASIAN), C(YOUTU, NoBreaks)],
            Pre::Falcon => &[C(PUNCT_FALCON, Whole), T(GPT2, GiveBack), W("[0-9][0-9][0-9]")],
            Pre::DigitsThenGpt2 => &[C(r"\p{N}", Whole), T(GPT2, GiveBack)],
            Pre::Gpt2 => &[T(GPT2, GiveBack)],
            Pre::Qwen2 => &[T(QWEN2, NoBreaks)],
            Pre::Qwen35 => &[T(QWEN35, NoBreaks)],
            Pre::Bloom => &[W(BLOOM)],
            Pre::Viking => &[W(BLOOM), C(r"\p{N}", Whole)],
            Pre::Tekken => &[C(TEKKEN, NoBreaks)],
            Pre::Chameleon => &[
                W("<sentinel:[0-9]+>"),
                W("(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z"),
                W("([\t\n]|    |  )"),
                C(r"\p{N}", Whole),
                C(r"[\p{P}!-/:-@\[-`{-\~]", Whole),
                T(GPT2, GiveBack),
            ],
            Pre::Gpt4o => &[C(GPT4O, NoBreaks)],
            Pre::GraniteEmbMulti => &[C(GRANITE_EMB_MULTI, NoBreaks)],
            Pre::TinyAya => &[DigitGroups, C(TINY_AYA, NoBreaks)],
            Pre::KimiK2 => &[T(KIMI_K2, NoBreaks)],
            Pre::SuperBpe => &[C(r"\p{N}+", Whole), Thousands],
            Pre::BailingMoe => &[C(BAILINGMOE, NoBreaks)],
            Pre::SeedCoder => &[C(SEED_CODER, NoBreaks)],
            Pre::Ufakzeka => &[C(UFAKZEKA, NoBreaks)],
            Pre::Afmoe => &[DigitGroups, W(AFMOE_ASIAN), C(DEEPSEEK3, NoBreaks)],
            Pre::Laguna => &[Newlines, T(QWEN2, NoBreaks)],
            Pre::ExaoneMoe => &[C(EXAONE_MOE, NoBreaks)],
            Pre::MiniCpm5 => &[C(r"\p{N}{1,3}", Whole), C(MINICPM5, NoBreaks)],
        }
    }

    /// The splitter: its patterns compiled once a process (a Unicode pattern takes
    /// milliseconds), then shared (a `Regex` clone shares its program).
    pub fn splitter(self) -> Result<Splitter, String> {
        static CACHE: [OnceLock<Result<Splitter, String>>; PRES] = [const { OnceLock::new() }; PRES];
        CACHE[self as usize].get_or_init(|| self.compile()).clone()
    }

    fn compile(self) -> Result<Splitter, String> {
        let steps = self.steps().iter().map(|s| s.compile().map_err(|e| format!("pre-tokenizer {self:?}: {e}")));
        Ok(Splitter { steps: steps.collect::<Result<_, _>>()? })
    }
}

/// How many `Pre` there are.
const PRES: usize = Pre::MiniCpm5 as usize + 1;

/// Contractions in either case, as llama.cpp spells `(?i:'s|'t|'re|'ve|'m|'ll|'d)`.
macro_rules! contractions {
    () => {
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    };
}

/// GPT-2's pattern: lower-case contractions, a space joined to the letters, digits or other
/// characters after it.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";
const LLAMA3: &str =
    concat!(contractions!(), r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+");
const QWEN2: &str =
    concat!(contractions!(), r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+");
const QWEN35: &str = concat!(
    contractions!(),
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+"
);
const MINICPM5: &str =
    concat!(contractions!(), r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+");
const SEED_CODER: &str =
    concat!(contractions!(), r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+");
const UFAKZEKA: &str = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";
const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+";
const EXAONE_MOE: &str = concat!(
    contractions!(),
    r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+"
);
/// Tekken's `((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+`, a letter not `a-z` then letters
/// not `A-Z`, as classes.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{L}&&[^a-z]]*[\p{L}&&[^A-Z]]+|[^\r\n\p{L}\p{N}]?[\p{L}&&[^a-z]]+[\p{L}&&[^A-Z]]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+";
const GPT4O: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{L}&&[^a-z]]*[\p{L}&&[^A-Z]]+",
    contractions!(),
    r"?|[^\r\n\p{L}\p{N}]?[\p{L}&&[^a-z]]+[\p{L}&&[^A-Z]]*",
    contractions!(),
    r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+"
);
const GRANITE_EMB_MULTI: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}&&[^a-z]]*[\p{L}\p{M}&&[^A-Z]]+",
    contractions!(),
    r"?|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}&&[^a-z]]+[\p{L}\p{M}&&[^A-Z]]*",
    contractions!(),
    r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+"
);
const TINY_AYA: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    contractions!(),
    r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    contractions!(),
    r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+"
);
const YOUTU: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    contractions!(),
    r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    contractions!(),
    r"?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+"
);
const DEEPSEEK3: &str = r"[!-/:-@\[-`{-\~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+";
const SPARK25: &str = r"[!-/:-@\[-`{-\~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+";
/// Kimi K2's pattern: Han runs, then words of letters other than Han (llama.cpp's
/// `unicode_cpt_is_han` ranges).
const KIMI_K2: &str = concat!(
    r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{L}--[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}]]+",
    contractions!(),
    r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+"
);
const PUNCT_DEFAULT: &str = r"[\p{P}\$\+<=>\^\~\|]+";
const PUNCT_FALCON: &str = r"[\p{P}\$\+<=>\^\~\|`]+";
const BLOOM: &str = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+";
const CJK_KANA: &str = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+";
const DEEPSEEK_CJK: &str = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+";
const DEEPSEEK_LLM_PUNCT: &str = r"\s?[!-/:-\~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+";
/// DeepSeek LLM's letters: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and other cased scripts.
const DEEPSEEK_LLM_WORDS: &str = r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+";
const YOUTU_ASIAN: &str = r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+";
const AFMOE_ASIAN: &str = r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{8C48}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}\x{FF65}-\x{FF9F}\x{2F00}-\x{2FDF}\x{E40}-\x{E7F}\x{E80}-\x{EFF}\x{1780}-\x{17FF}\x{1000}-\x{109F}\x{AA60}-\x{AA7F}\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+";

/// One of llama.cpp's patterns, and how llama.cpp runs it (see the module comment).
#[derive(Clone, Copy)]
enum Step {
    /// A pattern of a handwritten splitter, on the text itself.
    Text(&'static str, Tail),
    /// A pattern with `\p{..}`, on the collapsed text.
    Collapsed(&'static str, Tail),
    /// A pattern without `\p{..}`, on the text with Unicode whitespace read as `\v`.
    Wide(&'static str),
    /// AFMoE's digits (llama.cpp's `unicode_regex_split_custom_afmoe`): a run of numbers in
    /// threes from the right. The text before a run joins its first group, as llama.cpp cuts it.
    DigitGroups,
    /// `[^\n]+|[\n]+`.
    Newlines,
    /// SuperBPE's `(?=(\d{3})+(?!\d))`: a cut before every ASCII digit followed by a multiple
    /// of three of them.
    Thousands,
}

/// What becomes of a whitespace match: the lookaheads that end the patterns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tail {
    /// No lookahead.
    Whole,
    /// `\s+(?!\S)|\s+`: gives back its last character when more text follows.
    GiveBack,
    /// The same after a `\s*[\r\n]+` branch, which a run with a line break is matched by.
    GiveBackNoBreaks,
    /// Jais 2's `\s{512}(?!\S)|\s{256}(?!\S)|...|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}`.
    Cascade,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum View {
    Text,
    Collapsed,
    Wide,
}

#[derive(Debug, Clone)]
enum Compiled {
    Regex(Regex, View, Tail),
    DigitGroups,
    Newlines,
    Thousands,
}

impl Step {
    fn compile(self) -> Result<Compiled, regex::Error> {
        Ok(match self {
            Step::Text(p, tail) => Compiled::Regex(Regex::new(p)?, View::Text, tail),
            Step::Collapsed(p, tail) => Compiled::Regex(Regex::new(&collapse_pattern(p))?, View::Collapsed, tail),
            Step::Wide(p) => Compiled::Regex(Regex::new(p)?, View::Wide, Tail::Whole),
            Step::DigitGroups => Compiled::DigitGroups,
            Step::Newlines => Compiled::Newlines,
            Step::Thousands => Compiled::Thousands,
        })
    }
}

/// The collapsed characters, U+00D0 + llama.cpp's category byte less 0xD0.
const OTHER: char = '\u{D0}';
const NUMBER: char = '\u{D1}';
const LETTER: char = '\u{D2}';
const PUNCTUATION: char = '\u{D3}';
const MARK: char = '\u{D4}';
const SYMBOL: char = '\u{D5}';

/// What `\p{..}` reads in the collapsed text: the category's character and its ASCII members,
/// as llama.cpp's `k_ucat_map`.
fn category_class(name: &str) -> Option<&'static str> {
    Some(match name {
        "N" => r"\x{D1}0-9",
        "L" | "Lu" | "Ll" | "Lt" | "Lm" | "Lo" => r"\x{D2}A-Za-z",
        "P" => r"\x{D3}!-#%-*,-/:-;?-@\[-\]_\{\}",
        "M" => r"\x{D4}",
        "S" => r"\x{D5}\$\+<->\^`\|\~",
        _ => return None,
    })
}

/// A pattern for the collapsed text, as llama.cpp rewrites one: each `\p{..}` becomes its
/// category class (in brackets outside a class).
fn collapse_pattern(p: &str) -> String {
    let mut out = String::with_capacity(p.len() * 2);
    let mut depth = 0usize;
    let mut rest = p;
    while let Some(c) = rest.chars().next() {
        let category = rest
            .strip_prefix(r"\p{")
            .and_then(|after| after.split_once('}'))
            .and_then(|(name, tail)| Some((category_class(name)?, tail)));
        if let Some((class, tail)) = category {
            if depth == 0 {
                out.push('[');
            }
            out.push_str(class);
            if depth == 0 {
                out.push(']');
            }
            rest = tail;
            continue;
        }
        if c == '\\' {
            // An escape: copy it and the character it escapes.
            let n = rest.chars().nth(1).map_or(0, char::len_utf8);
            out.push_str(&rest[..1 + n]);
            rest = &rest[1 + n..];
            continue;
        }
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            _ => {}
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// A pre-tokenizer, ready to split text.
#[derive(Debug, Clone)]
pub struct Splitter {
    steps: Vec<Compiled>,
}

/// The text as one of the views reads it, and where each of its characters starts.
struct Viewed<'t> {
    s: Cow<'t, str>,
    /// The byte offset in `s` of each character of the text, and `s.len()`.
    starts: Vec<usize>,
}

impl<'t> Viewed<'t> {
    fn new(text: &'t str, view: View) -> Viewed<'t> {
        let s = match view {
            View::Text => Cow::Borrowed(text),
            View::Collapsed => Cow::Owned(collapse_text(text)),
            View::Wide => Cow::Owned(text.chars().map(|c| if !c.is_ascii() && c.is_whitespace() { '\u{b}' } else { c }).collect()),
        };
        let mut starts: Vec<usize> = s.char_indices().map(|(i, _)| i).collect();
        starts.push(s.len());
        Viewed { s, starts }
    }

    /// The character index of byte offset `b` (a character boundary).
    fn char_at(&self, b: usize) -> usize {
        self.starts.partition_point(|&s| s < b)
    }
}

/// The collapsed text: ASCII as it is, Unicode whitespace as `\v`, any other character as its
/// category's character.
fn collapse_text(text: &str) -> String {
    static CATEGORIES: OnceLock<Option<Regex>> = OnceLock::new();
    let re = CATEGORIES.get_or_init(|| Regex::new(r"(\p{N}+)|(\p{L}+)|(\p{P}+)|(\p{M}+)|(\p{S}+)").ok());
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    let other = |s: &str, out: &mut String| {
        for c in s.chars() {
            out.push(if c.is_ascii() { c } else if c.is_whitespace() { '\u{b}' } else { OTHER });
        }
    };
    if let Some(re) = re {
        for caps in re.captures_iter(text) {
            let Some(m) = caps.get(0) else { continue };
            other(&text[at..m.start()], &mut out);
            let cat = [NUMBER, LETTER, PUNCTUATION, MARK, SYMBOL]
                .into_iter()
                .enumerate()
                .find_map(|(i, c)| caps.get(i + 1).map(|_| c))
                .unwrap_or(OTHER);
            out.extend(m.as_str().chars().map(|c| if c.is_ascii() { c } else { cat }));
            at = m.end();
        }
    }
    other(&text[at..], &mut out);
    out
}

impl Splitter {
    /// Calls `f` with each word of `text`, in order; the words cover the text exactly.
    pub fn split<'a>(&self, text: &'a str, mut f: impl FnMut(&'a str)) {
        if let [Compiled::Regex(re, View::Text, tail)] = self.steps.as_slice() {
            let mut at = 0;
            return words(re, *tail, text, |end| {
                f(&text[at..end]);
                at = end;
            });
        }
        let mut views: [Option<Viewed>; 3] = [None, None, None];
        let n = text.chars().count();
        // The end of each piece, in characters.
        let mut ends = vec![n];
        for step in &self.steps {
            let mut next = Vec::with_capacity(ends.len() * 2);
            let mut start = 0;
            match step {
                Compiled::Regex(re, view, tail) => {
                    let v = views[*view as usize].get_or_insert_with(|| Viewed::new(text, *view));
                    for &end in &ends {
                        let (b0, b1) = (v.starts[start], v.starts[end]);
                        words(re, *tail, &v.s[b0..b1], |e| next.push(v.char_at(b0 + e)));
                        start = end;
                    }
                }
                Compiled::DigitGroups | Compiled::Newlines | Compiled::Thousands => {
                    let chars: Vec<char> = text.chars().collect();
                    for &end in &ends {
                        let piece = &chars[start..end];
                        let mut cut = |e: usize| next.push(start + e);
                        match step {
                            Compiled::DigitGroups => digit_groups(piece, &mut cut),
                            Compiled::Newlines => newlines(piece, &mut cut),
                            _ => thousands(piece, &mut cut),
                        }
                        start = end;
                    }
                }
            }
            next.dedup();
            ends = next;
        }
        let v = views[View::Text as usize].get_or_insert_with(|| Viewed::new(text, View::Text));
        let mut start = 0;
        for end in ends {
            if end > start {
                f(&text[v.starts[start]..v.starts[end]]);
            }
            start = end;
        }
    }
}

/// Calls `cut` with the end of each word of `text` by `re` (a pattern whose lookahead `tail`
/// says: see the module comment), in order; the text between two matches is a word too, and
/// the last end is `text.len()`.
fn words(re: &Regex, tail: Tail, text: &str, mut cut: impl FnMut(usize)) {
    let mut at = 0;
    while at < text.len() {
        let Some(m) = re.find_at(text, at) else { break };
        if m.start() > at {
            cut(m.start());
        }
        if m.is_empty() {
            // No pattern here matches nothing; were one to, the next character is a word.
            let c = text[m.start()..].chars().next().map_or(1, char::len_utf8);
            at = m.start() + c;
            cut(at);
            continue;
        }
        let end = m.start() + keep(tail, m.as_str(), m.end() == text.len());
        cut(end);
        at = end;
    }
    if at < text.len() {
        cut(text.len());
    }
}

/// How much of the match `word` a lookahead `tail` keeps; `last`: nothing follows it.
fn keep(tail: Tail, word: &str, last: bool) -> usize {
    if tail == Tail::Whole || !word.chars().all(char::is_whitespace) {
        return word.len();
    }
    let breaks = word.contains(['\r', '\n']);
    let n = word.chars().count();
    let chars = |k: usize| word.char_indices().nth(k).map_or(word.len(), |(i, _)| i);
    match tail {
        Tail::GiveBackNoBreaks | Tail::Cascade if breaks => word.len(),
        Tail::GiveBack | Tail::GiveBackNoBreaks if n > 1 && !last => chars(n - 1),
        Tail::Cascade => {
            // `\s{k}(?!\S)` holds where more whitespace follows the k, or nothing does.
            let fits = |k: usize| n > k || (n == k && last);
            let k = [512, 256, 128, 64, 32, 16, 8, 4, 2, 1].into_iter().find(|&k| fits(k)).unwrap_or(1);
            chars(k)
        }
        _ => word.len(),
    }
}

/// `Step::DigitGroups` on `piece`: calls `cut` with each end.
fn digit_groups(piece: &[char], cut: &mut impl FnMut(usize)) {
    let mut pos = 0;
    let mut last = 0;
    let mut emit = |e: usize, cut: &mut dyn FnMut(usize)| {
        if e > last {
            cut(e);
            last = e;
        }
    };
    while pos < piece.len() {
        if !piece[pos].is_numeric() {
            pos += 1;
            continue;
        }
        let first = pos;
        while pos < piece.len() && piece[pos].is_numeric() {
            pos += 1;
        }
        // llama.cpp cuts the first one or two digits off where the run is not a multiple of
        // three; where it is, the text before the run joins the first group.
        let mut at = first + (pos - first) % 3;
        if at > first {
            emit(at, cut);
        }
        while at < pos {
            at += 3;
            emit(at, cut);
        }
    }
    emit(piece.len(), cut);
}

/// `[^\n]+|[\n]+` on `piece`: calls `cut` with each end.
fn newlines(piece: &[char], cut: &mut impl FnMut(usize)) {
    for i in 1..=piece.len() {
        if i == piece.len() || (piece[i] == '\n') != (piece[i - 1] == '\n') {
            cut(i);
        }
    }
}

/// `Step::Thousands` on `piece`: calls `cut` with each end.
fn thousands(piece: &[char], cut: &mut impl FnMut(usize)) {
    let mut run_end = piece.len();
    let mut cuts = Vec::new();
    for i in (0..piece.len()).rev() {
        if !piece[i].is_ascii_digit() {
            run_end = i;
        } else if i > 0 && (run_end - i).is_multiple_of(3) {
            cuts.push(i);
        }
    }
    for &c in cuts.iter().rev() {
        cut(c);
    }
    if !piece.is_empty() {
        cut(piece.len());
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

    /// llama.cpp's quirks, as tests/pretok records them.
    #[test]
    fn collapsed_patterns_read_every_non_ascii_letter_as_both_cases() {
        // Tekken's upper-then-lower words: `É` counts as lower case too, so `ÉCOLE` cuts after it.
        assert_eq!(words(Pre::Tekken, "HelloWorld ÉCOLE"), ["Hello", "World", " É", "COLE"]);
        assert_eq!(words(Pre::Gpt4o, "DON'T stop"), ["DON'T", " stop"]);
    }

    #[test]
    fn digit_groups_from_the_right_take_the_text_before_them() {
        assert_eq!(words(Pre::TinyAya, "x 1234567"), ["x", " ", "1", "234", "567"]);
        assert_eq!(words(Pre::SuperBpe, "ab 1234567 cd"), ["ab ", "1", "234", "567", " cd"]);
    }

    #[test]
    fn cascade_and_line_patterns() {
        assert_eq!(words(Pre::Jais2, "a     b"), ["a", "    ", " b"]);
        assert_eq!(words(Pre::Laguna, "a\n\nb c"), ["a", "\n\n", "b", " c"]);
        assert_eq!(words(Pre::Bloom, "Hi, you... ok"), ["Hi", ",", " you", "...", " ok"]);
    }
}
