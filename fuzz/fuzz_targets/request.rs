//! The server's request parsing (`wisp-api`, shared by `wisp serve` and the wasi:http
//! component) on structured JSON bodies (`arbitrary` trees over the API's own field names and
//! values) and raw bytes: a body is either a request within every limit or a 4xx error with a
//! message; an accepted request's reply then streams arbitrary pieces of text and never sends
//! one of its stop sequences, nor more tokens than its budget.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};
use wisp_api::{Finish, MAX_CONSTRAINT_BYTES, MAX_MESSAGES, MAX_STOP_BYTES, MAX_STOPS, MAX_TOKEN_IDS, Prompt, Reply};

const KEYS: &[&str] = &[
    "model", "messages", "role", "content", "type", "text", "prompt", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "seed",
    "stop", "stream", "stream_options", "include_usage", "n", "logprobs", "top_logprobs", "echo", "best_of",
    "suffix", "tools", "response_format", "json_schema", "schema", "name", "grammar", "regex", "properties",
];
const WORDS: &[&str] = &[
    "system", "user", "assistant", "developer", "tool", "text", "json_object", "json_schema", "image_url",
    "object", "string", "integer", "wisp", "",
];

#[derive(Arbitrary, Debug)]
enum J {
    Null,
    Bool(bool),
    Int(i64),
    Small(u8),
    Float(f64),
    Word(u8),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(Key, J)>),
}

#[derive(Arbitrary, Debug)]
enum Key {
    Known(u8),
    Raw(String),
}

impl Key {
    fn text(&self) -> String {
        match self {
            Key::Known(i) => KEYS[*i as usize % KEYS.len()].to_string(),
            Key::Raw(s) => s.clone(),
        }
    }
}

impl J {
    fn value(&self) -> Value {
        match self {
            J::Null => Value::Null,
            J::Bool(b) => Value::Bool(*b),
            J::Int(i) => (*i).into(),
            J::Small(i) => (*i).into(),
            J::Float(f) => serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number),
            J::Word(i) => WORDS[*i as usize % WORDS.len()].into(),
            J::Str(s) => s.clone().into(),
            J::Arr(v) => Value::Array(v.iter().map(J::value).collect()),
            J::Obj(v) => Value::Object(v.iter().map(|(k, j)| (k.text(), j.value())).collect::<Map<_, _>>()),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Body {
    Object(Vec<(Key, J)>),
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Case {
    chat: bool,
    body: Body,
    /// The reply's pieces: mostly fragments of its stop sequences `(stop, from, len)`.
    pieces: Vec<Result<(u8, u8, u8), Vec<u8>>>,
    budget: u8,
}

fuzz_target!(|c: Case| {
    let bytes = match &c.body {
        Body::Object(fields) => {
            let v = Value::Object(fields.iter().map(|(k, j)| (k.text(), j.value())).collect());
            serde_json::to_vec(&v).unwrap_or_default()
        }
        Body::Raw(b) => b.clone(),
    };
    let parsed = if c.chat { wisp_api::chat_request(&bytes) } else { wisp_api::completion_request(&bytes) };
    let g = match parsed {
        Ok(g) => g,
        Err(e) => {
            assert!((400..500).contains(&e.status), "status {} for a bad request", e.status);
            assert!(!e.message.is_empty());
            let _ = e.body().to_string();
            return;
        }
    };
    assert!(g.stop.len() <= MAX_STOPS && g.stop.iter().all(|s| s.len() <= MAX_STOP_BYTES), "stops {:?}", g.stop);
    match &g.prompt {
        Prompt::Chat(m) => assert!(!m.is_empty() && m.len() <= MAX_MESSAGES),
        Prompt::Tokens(t) => assert!(!t.is_empty() && t.len() <= MAX_TOKEN_IDS),
        Prompt::Text(_) => {}
    }
    if let Some((_, constraint)) = &g.constraint {
        let text = match constraint {
            wisp_api::Constraint::JsonSchema(s) | wisp_api::Constraint::Regex(s) | wisp_api::Constraint::Lark(s) => s,
        };
        assert!(text.len() <= MAX_CONSTRAINT_BYTES);
    }
    let s = g.sampling;
    assert!((0.0..=2.0).contains(&s.temperature) && (0.0..=1.0).contains(&s.top_p) && (0.0..=1.0).contains(&s.min_p));

    // The reply: its text never holds a stop sequence, and it ends by the budget.
    let budget = c.budget as u32 % 32 + 1;
    let mut reply = Reply::new(3, budget, g.stop.clone());
    let mut sent = String::new();
    let mut end = None;
    for p in c.pieces.iter().take(64) {
        let piece: Vec<u8> = match p {
            Ok((i, from, len)) if !g.stop.is_empty() => {
                let s = g.stop[*i as usize % g.stop.len()].as_bytes();
                let from = (*from as usize).min(s.len());
                s[from..(from + *len as usize).min(s.len())].to_vec()
            }
            Ok(_) => Vec::new(),
            Err(b) => b.clone(),
        };
        let a = reply.step(&piece, false, false);
        sent.push_str(&a.text);
        if let Some((finish, usage)) = a.end {
            assert!(usage.completion_tokens <= budget);
            assert!(finish == Finish::Stop || usage.completion_tokens == budget, "{finish:?} after {} of {budget}", usage.completion_tokens);
            end = Some(finish);
            break;
        }
    }
    if end.is_none() {
        sent.push_str(&reply.step(b"", true, false).text);
    }
    for stop in g.stop.iter().filter(|s| !s.is_empty()) {
        assert!(!sent.contains(stop.as_str()), "the reply sent its stop {stop:?}: {sent:?}");
    }
});
