//! Structured output: the tokens a generation may take, under a JSON schema, a regular
//! expression or a Lark grammar, computed by llguidance at each step.
//!
//! A model builds its llguidance environment (the vocabulary as a token trie, and the parser
//! factory with its precomputed token slices) once, on the first constraint a session asks for;
//! each constraint is compiled once into a `TokenParser` that the session advances token by
//! token.
//! Compilation and every step run under llguidance's fuel and size limits, so a hostile
//! constraint ends in an error, not a hang.

use crate::tokenizer::Tokenizer;
use llguidance::TokenParser;
use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::ParserFactory;
use std::sync::Arc;

/// The longest constraint text accepted, in bytes.
pub const MAX_BYTES: usize = 256 * 1024;

/// What a generation must spell (the WIT `constraint`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Spec {
    JsonSchema(String),
    Regex(String),
    Lark(String),
}

impl Spec {
    fn text(&self) -> &str {
        match self {
            Spec::JsonSchema(s) | Spec::Regex(s) | Spec::Lark(s) => s,
        }
    }

    /// The grammar llguidance compiles. A JSON schema without its own `x-guidance` options is
    /// written compactly: no whitespace between JSON tokens, so a model cannot pad its output
    /// with newlines until the token limit.
    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        match self {
            Spec::JsonSchema(s) => {
                let mut schema: serde_json::Value =
                    serde_json::from_str(s).map_err(|e| format!("the JSON schema is not JSON: {e}"))?;
                if let Some(obj) = schema.as_object_mut() {
                    obj.entry("x-guidance").or_insert_with(|| serde_json::json!({ "whitespace_flexible": false }));
                }
                bound_numbers(&mut schema);
                Ok(TopLevelGrammar::from_json_schema(schema))
            }
            Spec::Regex(s) => Ok(TopLevelGrammar::from_regex(s)),
            Spec::Lark(s) => Ok(TopLevelGrammar::from_lark(json_in_lark(s))),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Spec::JsonSchema(_) => "JSON schema",
            Spec::Regex(_) => "regular expression",
            Spec::Lark(_) => "Lark grammar",
        }
    }
}

/// A Lark grammar whose `%json { ... }` schemas are read as a `json-schema` constraint's
/// schema is: written compactly unless its `x-guidance` says otherwise, numbers bounded. A
/// `%json` not followed by a JSON object is left for llguidance to report.
fn json_in_lark(lark: &str) -> String {
    const TAG: &str = "%json";
    let mut out = String::with_capacity(lark.len());
    let mut rest = lark;
    while let Some(at) = rest.find(TAG) {
        let (before, after) = rest.split_at(at + TAG.len());
        out.push_str(before);
        rest = after;
        let body = rest.trim_start();
        if !body.starts_with('{') {
            continue;
        }
        let mut values = serde_json::Deserializer::from_str(body).into_iter::<serde_json::Value>();
        let Some(Ok(mut schema)) = values.next() else { continue };
        let used = values.byte_offset();
        if let Some(obj) = schema.as_object_mut() {
            obj.entry("x-guidance").or_insert_with(|| serde_json::json!({ "whitespace_flexible": false }));
        }
        bound_numbers(&mut schema);
        out.push(' ');
        out.push_str(&schema.to_string());
        rest = &body[used..];
    }
    out.push_str(rest);
    out
}

/// The largest magnitude of a number that a JSON schema leaves unbounded: 2^53 - 1, the
/// integers a double (and so JavaScript, and most JSON readers) holds exactly.
const NUMBER_BOUND: i64 = (1 << 53) - 1;

/// The smallest step of a number whose schema gives none: at most 10 digits after the point
/// (llguidance reads a `multipleOf` by scaling by ten, exact to 10^-10).
const NUMBER_STEP: f64 = 1e-10;

/// Bounds the numbers of a schema as llama.cpp's JSON-schema grammars do, so that a model cannot
/// write digits until the token limit: an integer or number without a bound on a side is held
/// to `NUMBER_BOUND` there, and a number without a `multipleOf` to 10 digits after the point.
/// Keywords whose values are data, not schemas (`const`, `enum`, `default`, `examples`), are
/// left as they are.
fn bound_numbers(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(obj) => {
            let is = |obj: &serde_json::Map<String, Value>, kind: &str| match obj.get("type") {
                Some(Value::String(t)) => t == kind,
                Some(Value::Array(ts)) => ts.iter().any(|t| t == kind),
                _ => false,
            };
            let (integer, number) = (is(obj, "integer"), is(obj, "number"));
            if integer || number {
                if !obj.contains_key("minimum") && !obj.contains_key("exclusiveMinimum") {
                    obj.insert("minimum".into(), (-NUMBER_BOUND).into());
                }
                if !obj.contains_key("maximum") && !obj.contains_key("exclusiveMaximum") {
                    obj.insert("maximum".into(), NUMBER_BOUND.into());
                }
            }
            if number && !integer && !obj.contains_key("multipleOf") {
                obj.insert("multipleOf".into(), NUMBER_STEP.into());
            }
            for (k, child) in obj.iter_mut() {
                match k.as_str() {
                    "const" | "enum" | "default" | "examples" | "x-guidance" => {}
                    // Maps of names to schemas: a property may be called `const`.
                    "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                        if let Value::Object(map) = child {
                            map.values_mut().for_each(bound_numbers);
                        }
                    }
                    _ => bound_numbers(child),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(bound_numbers),
        _ => {}
    }
}

/// The vocabulary as llguidance sees it: each token's bytes, control tokens marked as special
/// (llguidance's 0xFF prefix) so that no grammar text matches them.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode(text, false, false),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }

    /// wisp's tokenizers add a space prefix to some texts: llguidance forces no tokens.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// A model's llguidance environment, built on the first constraint.
pub struct Grammars {
    factory: ParserFactory,
    /// The end-of-generation tokens: allowed where the constraint is complete.
    end: Vec<u32>,
}

impl Grammars {
    /// The environment of `tokenizer`'s vocabulary. `unsupported` text when the model has no
    /// end-of-generation token (a constraint could never end).
    pub fn new(tokenizer: &Arc<Tokenizer>) -> Result<Grammars, String> {
        let n = tokenizer.n_vocab();
        let end: Vec<u32> = (0..n as u32).filter(|&t| tokenizer.is_eog(t)).collect();
        let Some(&eos) = end.first() else {
            return Err("the model has no end-of-sequence or end-of-turn token to end a constrained generation".into());
        };
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|t| {
                if tokenizer.is_control(t) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_text(t).unwrap_or_default().as_bytes());
                    w
                } else {
                    tokenizer.piece(t, false)
                }
            })
            .collect();
        let mut info = TokRxInfo::new(n as u32, eos);
        info.tok_bos = tokenizer.bos;
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&end);
        let env: TokEnv = Arc::new(Env { trie, tokenizer: Arc::clone(tokenizer) });
        let caps = InferenceCapabilities { ff_tokens: false, conditional_ff_tokens: false, backtrack: false, fork: false };
        let mut factory = ParserFactory::new(&env, caps, &llguidance::earley::SlicedBiasComputer::general_slices())
            .map_err(|e| format!("building the grammar environment: {e}"))?;
        factory.quiet();
        Ok(Grammars { factory, end })
    }

    /// Compiles `spec`: the text of the error names the problem.
    pub fn compile(&self, spec: &Spec) -> Result<Constraint, String> {
        let len = spec.text().len();
        if len > MAX_BYTES {
            return Err(format!("the {} is {len} bytes, over the limit of {MAX_BYTES}", spec.kind()));
        }
        let grammar = spec.grammar()?;
        let mut parser =
            self.factory.create_parser(grammar).map_err(|e| format!("the {} does not compile: {e}", spec.kind()))?;
        parser.start_without_prompt();
        // The first step's tokens, computed here: a grammar too complex to take a step fails
        // now, before a token is generated.
        let first = match parser.compute_mask() {
            Ok(mask) => Some(mask),
            Err(_) if parser.stop_reason() == StopReason::NoExtensionBias => None,
            Err(e) => return Err(format!("the {} is too complex: {e}", spec.kind())),
        };
        Ok(Constraint { parser, first: Some(first), end: self.end.clone(), masked: Vec::new(), failed: None })
    }
}

/// A compiled constraint and where it stands in its generation.
pub struct Constraint {
    parser: TokenParser,
    /// The first step's tokens (`None`: none, a dead end), until the first step takes them.
    first: Option<Option<SimpleVob>>,
    end: Vec<u32>,
    masked: Vec<f32>,
    /// Why the constraint failed at an earlier step: it stays failed.
    failed: Option<String>,
}

/// What a constraint allows at a step.
pub enum Allowed<'a> {
    /// The logits with every token the constraint rules out at minus infinity.
    Logits(&'a [f32]),
    /// No token at all: a dead end.
    None,
}

impl Constraint {
    fn fail(&mut self, e: impl std::fmt::Display) -> String {
        let why = format!("the constraint failed: {e}");
        self.failed = Some(why.clone());
        why
    }

    /// Masks `logits` by the tokens allowed next: the constraint's, or only the
    /// end-of-generation tokens once it is complete.
    pub fn allowed(&mut self, logits: &[f32]) -> Result<Allowed<'_>, String> {
        if let Some(why) = &self.failed {
            return Err(why.clone());
        }
        self.masked.clear();
        self.masked.resize(logits.len(), f32::NEG_INFINITY);
        let mask = match self.first.take() {
            Some(Some(mask)) => mask,
            Some(None) => return Ok(Allowed::None),
            None if self.parser.stopped() => {
                for &t in &self.end {
                    if let (Some(m), Some(&l)) = (self.masked.get_mut(t as usize), logits.get(t as usize)) {
                        *m = l;
                    }
                }
                return Ok(Allowed::Logits(&self.masked));
            }
            None => match self.parser.compute_mask() {
                Ok(mask) => mask,
                // No token extends the output and it is not complete: llguidance's dead end.
                Err(_) if self.parser.stop_reason() == StopReason::NoExtensionBias => return Ok(Allowed::None),
                Err(e) => return Err(self.fail(e)),
            },
        };
        mask.iter_set_entries(|t| {
            if let (Some(m), Some(&l)) = (self.masked.get_mut(t), logits.get(t)) {
                *m = l;
            }
        });
        Ok(Allowed::Logits(&self.masked))
    }

    /// Advances past `token`, which `allowed` admitted.
    pub fn consume(&mut self, token: u32) -> Result<(), String> {
        if self.parser.stopped() {
            // Complete: only an end was allowed, and nothing follows it.
            return Ok(());
        }
        match self.parser.consume_token(token).and_then(|_| self.parser.check_stop()) {
            Ok(_) => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_in_a_lark_grammar_is_read_as_a_json_schema_constraint() {
        let lark = "start: \"<\" call \">\"\ncall: %json {\"type\": \"object\", \"properties\": {\"n\": {\"type\": \"integer\"}}}\nx: %json{\"type\":\"number\", \"x-guidance\": {\"whitespace_flexible\": true}} | \"%json\"";
        let out = json_in_lark(lark);
        assert!(out.starts_with("start: \"<\" call \">\"\ncall: %json {\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"integer\",\"minimum\":-9007199254740991,\"maximum\":9007199254740991}},\"x-guidance\":{\"whitespace_flexible\":false}}\n"), "{out}");
        // A schema's own options stay; a `%json` that is no schema is left as it is.
        assert!(out.contains("\"x-guidance\":{\"whitespace_flexible\":true}") && out.ends_with(" | \"%json\""), "{out}");
        assert_eq!(json_in_lark("start: %json [1]"), "start: %json [1]");
    }
}
