//! The OpenAI-shaped wire format of wisp's servers: request bodies read and checked into a
//! [`Generation`], a generation's tokens turned into the reply's text ([`Reply`]), response
//! bodies and stream chunks, errors in OpenAI's shape. Nothing here knows about HTTP servers,
//! threads or the engine's bindings, so that both fronts share it: `wisp serve` (native, axum)
//! and the `wasi:http` component of `wisp bake` (wasm32-wasip2), each mapping the engine's
//! types to the plain ones here.

mod text;
pub mod anthropic;
pub mod embeddings;
pub mod responses;
pub mod tools;

pub use text::{Released, StopMatcher, Utf8Stream};
pub use tools::{Call, Choice, ToolSyntax, Tools};

use serde::Deserialize;
use serde_json::{Value, json};

/// The most messages a chat request may carry.
pub const MAX_MESSAGES: usize = 4096;
/// The most stop sequences a request may give (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// The longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// The most token ids a prompt or a `/detokenize` request may carry.
pub const MAX_TOKEN_IDS: usize = 1 << 20;
/// The longest JSON schema or grammar a request may carry, in bytes (the guest's own cap).
pub const MAX_CONSTRAINT_BYTES: usize = 256 * 1024;

/// A failed request, as OpenAI's API reports one: an HTTP status and
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, message: message.into(), param: None, code: None }
    }

    /// 400: the request is malformed or a value is out of range.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { param: Some(param.to_string()), ..ApiError::invalid(message) }
    }

    /// 401: no or a wrong API key.
    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(401, "authentication_error", "missing or wrong API key (Authorization: Bearer KEY)")
        }
    }

    /// 404: no such path or model.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(404, "not_found_error", message)
    }

    /// 404 for a model this server does not serve.
    pub fn unknown_model(name: &str, served: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::not_found(format!("the model {name:?} does not exist; this server serves {served:?}"))
        }
    }

    /// 405: the path exists, the method does not.
    pub fn method_not_allowed() -> ApiError {
        ApiError::new(405, "invalid_request_error", "method not allowed on this path")
    }

    /// An error the engine returned: 400 when the request is at fault (an argument, the
    /// context, a constraint, something the model does not support), else 500.
    pub fn engine(requests_fault: bool, message: impl Into<String>) -> ApiError {
        match requests_fault {
            true => ApiError::invalid(message),
            false => ApiError::internal(message),
        }
    }

    /// 413: the body is past the cap.
    pub fn too_large(cap: usize) -> ApiError {
        ApiError::new(413, "invalid_request_error", format!("the request body is larger than {cap} bytes"))
    }

    /// 429: the queue is full.
    pub fn queue_full(queued: usize) -> ApiError {
        ApiError {
            code: Some("queue_full"),
            ..ApiError::new(429, "rate_limit_error", format!("the server is busy ({queued} requests queued); retry later"))
        }
    }

    /// 503: the server is stopping.
    pub fn shutting_down() -> ApiError {
        ApiError::new(503, "server_error", "the server is shutting down")
    }

    /// 408: the client did not send its request in time.
    pub fn request_timeout() -> ApiError {
        ApiError::new(408, "invalid_request_error", "the request body did not arrive in time")
    }

    /// 504: the request ran past its time limit.
    pub fn timed_out(limit: std::time::Duration) -> ApiError {
        ApiError {
            code: Some("timeout"),
            ..ApiError::new(504, "timeout_error", format!("the request ran past its time limit of {} s", limit.as_secs()))
        }
    }

    /// 500: the engine failed.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(500, "server_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// Parses `bytes` as `T`, naming the field at fault in the error (`messages[1].content: invalid
/// type ...`).
pub fn parse<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, ApiError> {
    // serde reads a struct from a JSON array too (its fields in order): every body is an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        return Err(ApiError::invalid("invalid request: the body is a JSON array, not an object"));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            // Text that is not JSON names no field (OpenAI's `param` is null there).
            return ApiError::invalid(format!("malformed JSON: {inner}"));
        }
        match path.as_str() {
            "." | "" => ApiError::invalid(format!("invalid request: {inner}")),
            p => ApiError::invalid_param(p, format!("invalid request: {p}: {inner}")),
        }
    })?;
    Ok(value)
}

/// How each token is picked: the engine's `sampling` record, field for field.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// 1 is off.
    pub repeat_penalty: f32,
    pub repeat_last_n: u32,
    pub seed: u64,
}

impl Default for Sampling {
    /// The engine's defaults (greedy).
    fn default() -> Self {
        Sampling { temperature: 0.0, top_k: 40, top_p: 0.95, min_p: 0.05, repeat_penalty: 1.0, repeat_last_n: 64, seed: 0 }
    }
}

/// What a generation must spell: the engine's `constraint` variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    JsonSchema(String),
    Regex(String),
    Lark(String),
}

/// A chat's messages (JSON objects in OpenAI's shape: `role`, `content`, an assistant's
/// `tool_calls`, a tool result's `tool_call_id`) and the tools its reply may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Chat {
    pub messages: Vec<Value>,
    pub tools: Option<Tools>,
}

impl Chat {
    /// The conversation as the engine's `render-chat` takes it.
    pub fn conversation(&self) -> String {
        let tools = self.tools.as_ref().map_or(Value::Null, |t| Value::Array(t.list.clone()));
        json!({"messages": self.messages, "tools": tools}).to_string()
    }
}

/// What the prompt is.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A conversation, rendered with the model's chat template.
    Chat(Chat),
    /// Text, tokenized with the model's BOS.
    Text(String),
    /// Token ids, fed as they are.
    Tokens(Vec<u32>),
}

/// A checked request to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub model: String,
    pub prompt: Prompt,
    /// Tokens to generate at most; `None` runs to the end of generation or of the context.
    pub max_tokens: Option<u32>,
    pub sampling: Sampling,
    /// Generation ends before the first of these (which is not returned).
    pub stop: Vec<String>,
    pub stream: bool,
    /// A streamed response ends with a chunk of usage counts.
    pub include_usage: bool,
    /// What the output must spell, and the field that asked for it (`response_format`,
    /// `json_schema`, `grammar`, `regex`), which an error names.
    pub constraint: Option<(&'static str, Constraint)>,
    /// Report each token's log-probability and those of this many most likely tokens
    /// (`logprobs` and `top_logprobs`; a text completion's `logprobs` count).
    pub logprobs: Option<u32>,
    /// Choices to generate (`n`), each its own sample of the same prompt.
    pub n: u32,
}

/// `stop`: one string or a list.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// The fields that chat and text completions share. Unknown fields are ignored, as OpenAI's
/// newer fields are by older servers; known ones wisp does not offer are refused when set.
#[derive(Deserialize)]
struct Common {
    model: String,
    #[serde(default)]
    max_tokens: Option<Integer>,
    #[serde(default)]
    max_completion_tokens: Option<Integer>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<Integer>,
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    repeat_penalty: Option<f64>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    seed: Option<Integer>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<Integer>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    top_logprobs: Option<Value>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    best_of: Option<Integer>,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    /// OpenAI's fields that change what is generated and that wisp does not offer: refused
    /// when set (ignoring them would answer another question than the one asked).
    #[serde(default)]
    logit_bias: Option<Value>,
    #[serde(default)]
    functions: Option<Vec<Value>>,
    #[serde(default)]
    function_call: Option<Value>,
    #[serde(default)]
    modalities: Option<Vec<Value>>,
    #[serde(default)]
    audio: Option<Value>,
    #[serde(default)]
    response_format: Option<Value>,
    /// llama.cpp's extension: a JSON schema as an object.
    #[serde(default)]
    json_schema: Option<Value>,
    /// wisp's extension: a grammar in llguidance's Lark dialect.
    #[serde(default)]
    grammar: Option<String>,
    /// wisp's extension: a regular expression the whole output matches.
    #[serde(default)]
    regex: Option<String>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    /// An assistant's calls.
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallIn>>,
    /// A tool result's call.
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

#[derive(Deserialize)]
struct ToolCallIn {
    #[serde(default)]
    id: Option<String>,
    function: FunctionIn,
}

#[derive(Deserialize)]
struct FunctionIn {
    name: String,
    /// JSON text, as OpenAI sends it (an object is taken too).
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: PromptField,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<TokenId>),
}

/// A chat completion request (`POST /v1/chat/completions`).
pub fn chat_request(bytes: &[u8]) -> Result<Generation, ApiError> {
    let body: ChatBody = parse(bytes)?;
    if body.messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "messages must hold at least one message"));
    }
    if body.messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid_param("messages", format!("more than {MAX_MESSAGES} messages")));
    }
    let mut messages = Vec::with_capacity(body.messages.len());
    for (i, m) in body.messages.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "user" | "assistant" | "tool" => m.role,
            "developer" => "system".to_string(),
            other => {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!("role {other:?} is not supported (system, developer, user, assistant, tool)"),
                ));
            }
        };
        let content = match m.content {
            None => None,
            Some(Content::Text(t)) => Some(t),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid_param(
                                &format!("messages[{i}].content"),
                                format!("content parts of type {kind:?} are not supported (only \"text\", with its text)"),
                            ));
                        }
                    }
                }
                Some(text)
            }
        };
        let mut message = json!({"role": role, "content": content.clone().unwrap_or_default()});
        if let Some(calls) = m.tool_calls.filter(|c| !c.is_empty()) {
            if role != "assistant" {
                return Err(ApiError::invalid_param(&format!("messages[{i}].tool_calls"), "only an assistant's message has tool_calls"));
            }
            let calls: Vec<Value> = calls
                .into_iter()
                .enumerate()
                .map(|(k, c)| {
                    let arguments = match c.function.arguments {
                        None | Some(Value::Null) => "{}".to_string(),
                        Some(Value::String(s)) => s,
                        Some(v) => v.to_string(),
                    };
                    let id = c.id.unwrap_or_else(|| format!("call_{i}_{k}"));
                    json!({"id": id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}})
                })
                .collect();
            message["content"] = content.map_or(Value::Null, Value::String);
            message["tool_calls"] = Value::Array(calls);
        } else if content.is_none() && role != "assistant" {
            return Err(ApiError::invalid_param(&format!("messages[{i}].content"), format!("a {role} message needs content")));
        }
        if role == "tool" {
            if let Some(id) = m.tool_call_id {
                message["tool_call_id"] = json!(id);
            }
            if let Some(name) = m.name {
                message["name"] = json!(name);
            }
        }
        messages.push(message);
    }
    let common: Common = parse(bytes)?;
    let tools = Tools::read(common.tools.as_ref(), common.tool_choice.as_ref(), common.parallel_tool_calls)?;
    if tools.is_some() && constraint(&common)?.is_some() {
        return Err(ApiError::invalid_param("tools", "tools and a response_format, json_schema, grammar or regex cannot be asked together"));
    }
    // Chat's logprobs is a flag, with top_logprobs alternatives.
    let logprobs = match (&common.logprobs, &common.top_logprobs) {
        (None | Some(Value::Null | Value::Bool(false)), None | Some(Value::Null)) => None,
        (None | Some(Value::Null | Value::Bool(false)), Some(_)) => {
            return Err(ApiError::invalid_param("top_logprobs", "top_logprobs needs logprobs: true"));
        }
        (Some(Value::Bool(true)), top) => Some(count("top_logprobs", top.as_ref(), MAX_TOP_LOGPROBS)?),
        (Some(_), _) => return Err(ApiError::invalid_param("logprobs", "logprobs is true or false")),
    };
    generation(common, Prompt::Chat(Chat { messages, tools }), logprobs)
}

/// The most alternatives a token's log-probabilities list: chat's `top_logprobs` and a text
/// completion's `logprobs` (OpenAI allows 20 and 5).
pub const MAX_TOP_LOGPROBS: u32 = 20;
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;
/// The most choices a request may ask for (`n`).
pub const MAX_CHOICES: u32 = 8;

/// An integer field in `0..=max` (null: 0).
fn count(name: &str, v: Option<&Value>, max: u32) -> Result<u32, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(0),
        Some(v) => match v.as_f64() {
            Some(x) if x.fract() == 0.0 && (0.0..=max as f64).contains(&x) => Ok(x as u32),
            _ => Err(ApiError::invalid_param(name, format!("{name} is an integer from 0 to {max}"))),
        },
    }
}

/// A text completion request (`POST /v1/completions`).
pub fn completion_request(bytes: &[u8]) -> Result<Generation, ApiError> {
    let body: CompletionBody = parse(bytes)?;
    let prompt = match body.prompt {
        PromptField::Text(t) => Prompt::Text(t),
        PromptField::Texts(mut t) if t.len() == 1 => Prompt::Text(t.remove(0)),
        PromptField::Texts(_) => return Err(ApiError::invalid_param("prompt", "a list of prompts must hold exactly one")),
        PromptField::Tokens(t) if t.is_empty() => return Err(ApiError::invalid_param("prompt", "the prompt has no tokens")),
        PromptField::Tokens(t) if t.len() > MAX_TOKEN_IDS => {
            return Err(ApiError::invalid_param("prompt", format!("more than {MAX_TOKEN_IDS} tokens")));
        }
        PromptField::Tokens(t) => Prompt::Tokens(t.into_iter().map(|t| t.0).collect()),
    };
    let common: Common = parse(bytes)?;
    refuse(&[("echo", common.echo == Some(true)), ("suffix", common.suffix.is_some())])?;
    if common.best_of.is_some_and(|b| b.0 != 1) {
        return Err(ApiError::invalid_param("best_of", "best_of must be 1"));
    }
    if common.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::invalid_param("tools", "tools are for chat completions"));
    }
    if common.top_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid_param("top_logprobs", "a text completion's alternatives are its logprobs count"));
    }
    // A text completion's logprobs is a count (null: none).
    let logprobs = match &common.logprobs {
        None | Some(Value::Null) => None,
        Some(v) => Some(count("logprobs", Some(v), MAX_COMPLETION_LOGPROBS)?),
    };
    generation(common, prompt, logprobs)
}

/// A 400 naming the first of `fields` (name, whether the request set it) that is set: fields
/// of OpenAI's API that wisp does not offer.
fn refuse(fields: &[(&str, bool)]) -> Result<(), ApiError> {
    match fields.iter().find(|(_, set)| *set) {
        Some((name, _)) => Err(ApiError::invalid_param(name, format!("{name} is not supported"))),
        None => Ok(()),
    }
}

fn range(name: &str, v: Option<f64>, lo: f64, hi: f64, default: f32) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(x as f32),
        Some(x) => Err(ApiError::invalid_param(name, format!("{name} must be between {lo} and {hi}, not {x}"))),
    }
}

fn generation(c: Common, prompt: Prompt, logprobs: Option<u32>) -> Result<Generation, ApiError> {
    let n = match c.n.map(|n| n.0) {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as u32,
        Some(n) => return Err(ApiError::invalid_param("n", format!("n is from 1 to {MAX_CHOICES}, not {n}"))),
    };
    let none = |v: &Value| v.is_null() || v.as_object().is_some_and(|o| o.is_empty());
    refuse(&[
        ("logit_bias", c.logit_bias.as_ref().is_some_and(|v| !none(v))),
        ("functions", c.functions.as_ref().is_some_and(|f| !f.is_empty())),
        ("function_call", c.function_call.as_ref().is_some_and(|v| !(v.is_null() || v == "none"))),
        ("modalities", c.modalities.as_ref().is_some_and(|m| m.iter().any(|v| v != "text"))),
        ("audio", c.audio.as_ref().is_some_and(|v| !v.is_null())),
    ])?;
    let constraint = constraint(&c)?;
    // OpenAI's penalties are additive on logits; wisp's sampler has llama.cpp's multiplicative
    // repeat_penalty instead. Zero (OpenAI's default) is accepted, anything else refused.
    for (name, v) in [("presence_penalty", c.presence_penalty), ("frequency_penalty", c.frequency_penalty)] {
        let v = range(name, v, -2.0, 2.0, 0.0)?;
        if v != 0.0 {
            return Err(ApiError::invalid_param(name, format!("{name} is not supported (use repeat_penalty)")));
        }
    }
    let mut max_tokens = None;
    // Both are checked; the newer name wins where both are given.
    for (name, v) in [("max_tokens", c.max_tokens), ("max_completion_tokens", c.max_completion_tokens)] {
        match v.map(|n| n.0) {
            None => {}
            Some(n) if (1..=i32::MAX as i64).contains(&n) => max_tokens = Some(n as u32),
            Some(n) => return Err(ApiError::invalid_param(name, format!("{name} must be between 1 and {}, not {n}", i32::MAX))),
        }
    }
    let default = Sampling::default();
    let temperature = range("temperature", c.temperature, 0.0, 2.0, 1.0)?;
    let top_p = range("top_p", c.top_p, 0.0, 1.0, 1.0)?;
    let min_p = range("min_p", c.min_p, 0.0, 1.0, 0.0)?;
    let repeat_penalty = range("repeat_penalty", c.repeat_penalty, 0.01, 10.0, 1.0)?;
    let top_k = match c.top_k.map(|k| k.0) {
        None => 0,
        Some(k) if (0..=u32::MAX as i64).contains(&k) => k as u32,
        Some(k) => return Err(ApiError::invalid_param("top_k", format!("top_k must be 0 or more, not {k}"))),
    };
    // Without a seed, each request draws its own (the same seed gives the same text).
    let seed = match c.seed {
        Some(Integer(s)) => s as u64,
        None => fresh_seed(),
    };
    let stop = match c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::invalid_param("stop", format!("at most {MAX_STOPS} stop sequences")));
    }
    if let Some(s) = stop.iter().find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        let why = if s.is_empty() { "a stop sequence is empty".to_string() } else { format!("a stop sequence is longer than {MAX_STOP_BYTES} bytes") };
        return Err(ApiError::invalid_param("stop", why));
    }
    let stream = c.stream.unwrap_or(false);
    let include_usage = stream && c.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    Ok(Generation {
        model: c.model,
        prompt,
        max_tokens,
        sampling: Sampling { temperature, top_k, top_p, min_p, repeat_penalty, seed, ..default },
        stop,
        stream,
        include_usage,
        constraint,
        logprobs,
        n,
    })
}

/// The constraint a request asks for: OpenAI's `response_format` (`json_object`, `json_schema`
/// with its `schema`; llama.cpp's `json_object` with a `schema` too), llama.cpp's `json_schema`,
/// or wisp's `grammar` (Lark) and `regex`; at most one of them.
fn constraint(c: &Common) -> Result<Option<(&'static str, Constraint)>, ApiError> {
    let schema_text = |param: &str, schema: &Value| -> Result<Constraint, ApiError> {
        if !(schema.is_object() || schema.is_boolean()) {
            return Err(ApiError::invalid_param(param, format!("{param}: a JSON schema is an object")));
        }
        Ok(Constraint::JsonSchema(schema.to_string()))
    };
    let mut found: Vec<(&'static str, Constraint)> = Vec::new();
    if let Some(f) = c.response_format.as_ref().filter(|f| !f.is_null()) {
        let param = "response_format";
        let kind = f.get("type").and_then(Value::as_str);
        let any_object = || Constraint::JsonSchema(r#"{"type":"object"}"#.to_string());
        match kind {
            Some("text") => {}
            Some("json_object") => match f.get("schema").filter(|s| !s.is_null()) {
                Some(s) => found.push((param, schema_text("response_format.schema", s)?)),
                None => found.push((param, any_object())),
            },
            Some("json_schema") => {
                let Some(js) = f.get("json_schema").filter(|j| j.is_object()) else {
                    return Err(ApiError::invalid_param(
                        "response_format.json_schema",
                        "response_format of type json_schema needs a json_schema object ({\"name\": ..., \"schema\": {...}})",
                    ));
                };
                if js.get("name").is_some_and(|n| !n.is_string()) {
                    return Err(ApiError::invalid_param("response_format.json_schema.name", "the name is a string"));
                }
                match js.get("schema").filter(|s| !s.is_null()) {
                    Some(s) => found.push((param, schema_text("response_format.json_schema.schema", s)?)),
                    // No schema: any JSON value.
                    None => found.push((param, Constraint::JsonSchema("{}".to_string()))),
                }
            }
            _ => {
                return Err(ApiError::invalid_param(
                    param,
                    "response_format's type is one of \"text\", \"json_object\" and \"json_schema\"",
                ));
            }
        }
    }
    if let Some(s) = c.json_schema.as_ref().filter(|s| !s.is_null()) {
        found.push(("json_schema", schema_text("json_schema", s)?));
    }
    if let Some(g) = &c.grammar {
        found.push(("grammar", Constraint::Lark(g.clone())));
    }
    if let Some(r) = &c.regex {
        found.push(("regex", Constraint::Regex(r.clone())));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(p, _)| *p).collect();
        return Err(ApiError::invalid_param(names[1], format!("one constraint at most, not {}", names.join(" and "))));
    }
    let Some((param, constraint)) = found.pop() else { return Ok(None) };
    let len = match &constraint {
        Constraint::JsonSchema(t) | Constraint::Lark(t) | Constraint::Regex(t) => t.len(),
    };
    if len > MAX_CONSTRAINT_BYTES {
        return Err(ApiError::invalid_param(
            param,
            format!("the constraint is {len} bytes, over the limit of {MAX_CONSTRAINT_BYTES}"),
        ));
    }
    Ok(Some((param, constraint)))
}

pub(crate) fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model's end of generation.
    Stop,
    /// The request's stop sequence of this index (OpenAI's `stop` too).
    StopSequence(usize),
    /// `max_tokens`, or the end of the context.
    Length,
    /// The request's constraint admitted no further token, not even an end (a dead end of its
    /// grammar): the output ends where it stood and may not parse. wisp's own value.
    Constraint,
    /// The reply is calls of tools (`message.tool_calls`).
    ToolCalls,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop | Finish::StopSequence(_) => "stop",
            Finish::Length => "length",
            Finish::Constraint => "constraint",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens whose keys and values came from an earlier request's session (a shared
    /// prefix), OpenAI's `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u32,
}

impl Usage {
    pub fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// One choice of a response, whole.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub text: String,
    pub finish: Finish,
    pub calls: Vec<Call>,
    /// Its tokens' log-probabilities, where the request asked for them.
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// One generated token's log-probability and its most likely alternatives'.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (lossy where its bytes are not UTF-8 alone).
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// `(text, bytes, logprob)`, most likely first.
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// Chat or text completion: the two response shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Text,
}

/// The identity every chunk of one response repeats.
#[derive(Debug, Clone)]
pub struct Head {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Head {
    pub fn new(kind: Kind, model: &str) -> Head {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
        };
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Head { kind, id: format!("{prefix}-{:x}{:08x}", now.as_nanos(), fresh_seed() as u32), created: now.as_secs(), model: model.to_string() }
    }

    /// The whole response of a request that was not streamed, of one choice.
    pub fn response(&self, text: &str, finish: Finish, usage: Usage) -> Value {
        self.response_of(&[Answer { text: text.to_string(), finish, calls: Vec::new(), logprobs: None }], usage)
    }

    /// The whole response of a request that was not streamed: its choices, in order.
    pub fn response_of(&self, answers: &[Answer], usage: Usage) -> Value {
        let choices: Vec<Value> = answers
            .iter()
            .enumerate()
            .map(|(index, a)| {
                let logprobs = a.logprobs.as_deref().map_or(Value::Null, |l| self.logprobs_json(l, 0));
                match self.kind {
                    Kind::Chat => {
                        let mut message = json!({"role": "assistant", "content": a.text});
                        if !a.calls.is_empty() {
                            message["content"] = if a.text.is_empty() { Value::Null } else { json!(a.text) };
                            message["tool_calls"] = a.calls.iter().map(|c| c.json(None)).collect();
                        }
                        json!({"index": index, "message": message, "finish_reason": a.finish.as_str(), "logprobs": logprobs})
                    }
                    Kind::Text => json!({"index": index, "text": a.text, "finish_reason": a.finish.as_str(), "logprobs": logprobs}),
                }
            })
            .collect();
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "choices": choices, "usage": usage.json(),
        })
    }

    /// Tokens' log-probabilities as the response's kind reports them: chat's `{"content": [...]}`,
    /// the text completion's `tokens`, `token_logprobs`, `top_logprobs` and `text_offset` (from
    /// `offset`, the bytes of the choice's text before them).
    pub fn logprobs_json(&self, tokens: &[TokenLogprob], offset: usize) -> Value {
        match self.kind {
            Kind::Chat => {
                let entry = |text: &str, bytes: &[u8], logprob: f32| json!({"token": text, "logprob": logprob, "bytes": bytes});
                let content: Vec<Value> = tokens
                    .iter()
                    .map(|t| {
                        let mut e = entry(&t.token, &t.bytes, t.logprob);
                        e["top_logprobs"] = t.top.iter().map(|(text, bytes, lp)| entry(text, bytes, *lp)).collect();
                        e
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Kind::Text => {
                let mut at = offset;
                let mut offsets = Vec::with_capacity(tokens.len());
                for t in tokens {
                    offsets.push(at);
                    at += t.token.len();
                }
                json!({
                    "tokens": tokens.iter().map(|t| &t.token).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": tokens.iter().map(|t| t.top.iter().map(|(text, _, lp)| (text.clone(), json!(lp))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    fn chunk_with(&self, choices: Value, usage: Option<Value>) -> Value {
        let mut v = json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    /// The first chunk of a streamed chat (the role), or `None` for text completions.
    pub fn opening_chunk(&self) -> Option<Value> {
        self.opening_chunk_of(0)
    }

    /// The first chunk of choice `index` of a streamed chat.
    pub fn opening_chunk_of(&self, index: usize) -> Option<Value> {
        (self.kind == Kind::Chat).then(|| {
            self.chunk_with(json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": null, "logprobs": null}]), None)
        })
    }

    /// A chunk carrying text.
    pub fn text_chunk(&self, text: &str) -> Value {
        self.text_chunk_of(0, text, None)
    }

    /// A chunk carrying text of choice `index`, with its tokens' log-probabilities (already in
    /// the response's shape: [`Head::logprobs_json`]) where asked for.
    pub fn text_chunk_of(&self, index: usize, text: &str, logprobs: Option<Value>) -> Value {
        let logprobs = logprobs.unwrap_or(Value::Null);
        let choice = match self.kind {
            Kind::Chat => json!({"index": index, "delta": {"content": text}, "finish_reason": null, "logprobs": logprobs}),
            Kind::Text => json!({"index": index, "text": text, "finish_reason": null, "logprobs": logprobs}),
        };
        self.chunk_with(json!([choice]), None)
    }

    /// A chunk carrying the calls of choice `index` (each whole, as one delta).
    pub fn calls_chunk_of(&self, index: usize, calls: &[Call]) -> Value {
        let calls: Vec<Value> = calls.iter().enumerate().map(|(i, c)| c.json(Some(i))).collect();
        self.chunk_with(json!([{"index": index, "delta": {"tool_calls": calls}, "finish_reason": null, "logprobs": null}]), None)
    }

    /// The chunk that says why the generation ended.
    pub fn finish_chunk(&self, finish: Finish) -> Value {
        self.finish_chunk_of(0, finish)
    }

    /// The chunk that says why choice `index` ended.
    pub fn finish_chunk_of(&self, index: usize, finish: Finish) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({"index": index, "delta": {}, "finish_reason": finish.as_str(), "logprobs": null}),
            Kind::Text => json!({"index": index, "text": "", "finish_reason": finish.as_str(), "logprobs": null}),
        };
        self.chunk_with(json!([choice]), None)
    }

    /// The last chunk when the client asked for usage: no choices, the counts.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        self.chunk_with(json!([]), Some(usage.json()))
    }
}

/// A rendered chat that begins with BOS (the template writes it) tokenized with BOS added (the
/// tokenizer adds it): keep one, as llama.cpp does.
pub fn drop_doubled_bos(tokens: &mut Vec<u32>, bos: Option<u32>) {
    if tokens.len() >= 2 && Some(tokens[0]) == bos && tokens[1] == tokens[0] {
        tokens.remove(0);
    }
}

/// The session a prompt of `prompt_len` tokens needs for a request that may generate
/// `max_tokens` (`None`: to the end of the context) in a context of `ctx` tokens at most:
/// `(n_ctx, budget)`, the session's context and the tokens it may generate. A prompt that
/// leaves no room is refused.
pub fn session_size(prompt_len: usize, max_tokens: Option<u32>, ctx: u32) -> Result<(u32, u32), ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::invalid_param("prompt", "the prompt has no tokens"));
    }
    if prompt_len >= ctx as usize {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid_param("messages", format!("the prompt is {prompt_len} tokens, and a request's context holds {ctx}"))
        });
    }
    let wanted = max_tokens.map_or(u64::MAX, u64::from);
    let n_ctx = (prompt_len as u64).saturating_add(wanted).min(ctx as u64) as u32;
    Ok((n_ctx, n_ctx - prompt_len as u32))
}

/// A generation after its prompt: each step's token turned into the text a client may be sent
/// (whole characters, nothing of a stop sequence), until the end and why. With tools, the
/// calls the reply makes are kept out of its text and read at the end ([`Reply::calling`]).
pub struct Reply {
    prompt_tokens: u32,
    cached_tokens: u32,
    budget: u32,
    generated: u32,
    utf8: Utf8Stream,
    stops: StopMatcher,
    /// Bytes of text released so far.
    released: usize,
    /// Where each generated token's text ends, in bytes of the reply's text.
    ends: Vec<usize>,
    calls: Option<Calls>,
}

/// A reply's calls: how they are written, and their text once one is open.
struct Calls {
    syntax: ToolSyntax,
    /// The tools a call may name.
    names: Vec<String>,
    /// The reply's text while it is not known whether it opens with a call
    /// ([`tools::opens_with_call`]); `None` once it is.
    lead: Option<String>,
    /// The calls' text since the first opened; `None` while the model may still write text.
    text: Option<String>,
}

/// What one step added to a [`Reply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advance {
    /// Text to send now (may be empty).
    pub text: String,
    /// The generation ended, why, and its counts.
    pub end: Option<(Finish, Usage)>,
    /// The model opened a call of a tool (under `tool_choice: "auto"`): the session keeps this
    /// many of its generated tokens, the rest are taken back, and the call is written again
    /// under the grammar of calls ([`Tools::grammar`]).
    pub call_opened: Option<u32>,
    /// The calls the reply made (at its end, with [`Finish::ToolCalls`]).
    pub calls: Vec<Call>,
}

impl Advance {
    fn text(text: String, end: Option<(Finish, Usage)>) -> Advance {
        Advance { text, end, call_opened: None, calls: Vec::new() }
    }
}

impl Reply {
    /// A reply to a prompt of `prompt_tokens` tokens that may generate `budget` tokens and ends
    /// before the first of `stop`.
    pub fn new(prompt_tokens: u32, budget: u32, stop: Vec<String>) -> Reply {
        Reply {
            prompt_tokens,
            cached_tokens: 0,
            budget,
            generated: 0,
            utf8: Utf8Stream::default(),
            stops: StopMatcher::new(stop),
            released: 0,
            ends: Vec::new(),
            calls: None,
        }
    }

    /// The same reply, `cached` of whose prompt tokens came from an earlier request's session.
    pub fn cached(self, cached: u32) -> Reply {
        Reply { cached_tokens: cached, ..self }
    }

    /// The same reply, whose calls of `tools` are written in `syntax`: from the first token
    /// when the tools force a call (the session is constrained to calls from the start), else
    /// from where the model opens one ([`Advance::call_opened`]).
    pub fn calling(mut self, syntax: ToolSyntax, tools: &Tools) -> Reply {
        let forced = tools.forced();
        if !forced && let Some(trigger) = tools::trigger(syntax) {
            self.stops.watch(trigger);
        }
        self.calls = Some(Calls { syntax, names: tools.names(), lead: (!forced).then(String::new), text: forced.then(String::new) });
        self
    }

    /// The counts so far.
    pub fn usage(&self) -> Usage {
        Usage { prompt_tokens: self.prompt_tokens, completion_tokens: self.generated, cached_tokens: self.cached_tokens }
    }

    /// Takes the engine's step: the token's `piece`, whether it ends generation, and whether
    /// the constraint admitted no token at all (`dead_end`: nothing was generated).
    pub fn step(&mut self, piece: &[u8], end_of_generation: bool, dead_end: bool) -> Advance {
        if dead_end {
            return self.finish(String::new(), Finish::Constraint);
        }
        self.generated += 1;
        if end_of_generation {
            return self.finish(String::new(), Finish::Stop);
        }
        let mut text = self.utf8.push(piece);
        let before = self.ends.last().copied().unwrap_or(0);
        self.ends.push(before + text.len());
        if let Some(Calls { text: Some(calls), .. }) = &mut self.calls {
            calls.push_str(&text);
            return match self.generated >= self.budget {
                true => self.finish(String::new(), Finish::Length),
                false => Advance::text(String::new(), None),
            };
        }
        if let Some(c) = self.calls.as_mut()
            && let Some(lead) = &mut c.lead
        {
            // Whether the reply opens with a call: its start held until that is known.
            lead.push_str(&text);
            match tools::opens_with_call(c.syntax, &c.names, lead) {
                None => {
                    return match self.generated >= self.budget {
                        true => self.finish(String::new(), Finish::Length),
                        false => Advance::text(String::new(), None),
                    };
                }
                Some(true) => {
                    let at = self.released + (lead.len() - lead.trim_start().len());
                    return self.open_call(String::new(), at);
                }
                Some(false) => {
                    text = std::mem::take(lead);
                    c.lead = None;
                    if c.syntax == ToolSyntax::Llama3Json {
                        self.calls = None;
                    }
                }
            }
        }
        let released = self.stops.push(&text);
        self.released += released.text.len();
        if released.stopped && released.watched {
            let at = self.released;
            return self.open_call(released.text, at);
        }
        if released.stopped {
            return Advance::text(released.text, Some((Finish::StopSequence(released.index), self.usage())));
        }
        if self.generated >= self.budget {
            return self.finish(released.text, Finish::Length);
        }
        Advance::text(released.text, None)
    }

    /// A call opens at byte `at` of the reply's text: the tokens whose text ends by then are
    /// kept, and what follows is the calls' text.
    fn open_call(&mut self, text: String, at: usize) -> Advance {
        let keep = self.ends.iter().take_while(|&&end| end <= at).count();
        self.ends.truncate(keep);
        self.generated = keep as u32;
        if let Some(c) = &mut self.calls {
            c.text = Some(String::new());
        }
        self.stops.clear();
        Advance { text, end: None, call_opened: Some(keep as u32), calls: Vec::new() }
    }

    /// The end: `text`, then what was held back; the calls read where the reply made some.
    fn finish(&mut self, mut text: String, why: Finish) -> Advance {
        let tail = self.utf8.finish();
        if let Some(Calls { text: Some(calls), syntax, .. }) = self.calls.take() {
            let all = calls + &tail;
            let mut n = 0;
            let mut ids = || {
                n += 1;
                format!("call_{:08x}{n}", fresh_seed() as u32)
            };
            return match (why, tools::parse_calls(&all, syntax, &mut ids)) {
                (Finish::Stop, Some(calls)) => Advance { text, end: Some((Finish::ToolCalls, self.usage())), call_opened: None, calls },
                // Cut short (or no call at all): the text as the model wrote it.
                _ => Advance::text(text + &all, Some((why, self.usage()))),
            };
        }
        if let Some(lead) = self.calls.take().and_then(|c| c.lead) {
            text.push_str(&lead);
        }
        let released = self.stops.push(&tail);
        text.push_str(&released.text);
        let why = match released.stopped && !released.watched {
            true => Finish::StopSequence(released.index),
            false => {
                text.push_str(&self.stops.finish());
                why
            }
        };
        Advance::text(text, Some((why, self.usage())))
    }
}

/// The one model of a server, as `/v1/models` lists it.
pub fn model_object(id: &str, created: u64) -> Value {
    json!({"id": id, "object": "model", "created": created, "owned_by": "wisp"})
}

/// One server-sent event carrying `data` (a JSON value, or `[DONE]`).
pub fn sse_event(data: &str) -> String {
    format!("data: {data}\n\n")
}

/// `POST /tokenize`, as llama.cpp's server has it.
#[derive(Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    #[serde(default)]
    pub add_special: bool,
    #[serde(default)]
    pub parse_special: bool,
    #[serde(default)]
    pub with_pieces: bool,
}

/// `POST /detokenize`.
#[derive(Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<TokenId>,
}

/// A JSON integer, also when written as a number with a zero fraction (`5.0`), as JSON Schema
/// counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Integer(pub i64);

/// A token id: an [`Integer`] in `0..2^32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenId(pub u32);

struct IntegerVisitor;

impl serde::de::Visitor<'_> for IntegerVisitor {
    type Value = Integer;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an integer")
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Integer, E> {
        Ok(Integer(v))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Integer, E> {
        i64::try_from(v).map(Integer).map_err(|_| E::custom(format!("{v} is out of range")))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Integer, E> {
        // Past 2^53 a float no longer says which integer it was (JSON integers past i64's
        // range arrive here too): refused rather than rounded.
        if v.fract() == 0.0 && v.abs() <= (1u64 << 53) as f64 {
            Ok(Integer(v as i64))
        } else {
            Err(E::custom(format!("{v} is not an integer in range")))
        }
    }
}

impl<'de> Deserialize<'de> for Integer {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Integer, D::Error> {
        d.deserialize_any(IntegerVisitor)
    }
}

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TokenId, D::Error> {
        let Integer(v) = Integer::deserialize(d)?;
        u32::try_from(v).map(TokenId).map_err(|_| serde::de::Error::custom(format!("token id {v} is out of range")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reply to `pieces` (the last one ends generation when `eog`), as the text sent and
    /// the end.
    fn reply(budget: u32, stop: &[&str], pieces: &[&[u8]], eog: bool) -> (String, Option<(Finish, Usage)>) {
        let mut r = Reply::new(7, budget, stop.iter().map(|s| s.to_string()).collect());
        let mut text = String::new();
        for (i, p) in pieces.iter().enumerate() {
            let a = r.step(p, eog && i + 1 == pieces.len(), false);
            text.push_str(&a.text);
            if a.end.is_some() {
                return (text, a.end);
            }
        }
        (text, None)
    }

    #[test]
    fn a_reply_ends_at_its_stop_its_budget_or_the_models_end() {
        let usage = |n| Usage { prompt_tokens: 7, completion_tokens: n, cached_tokens: 0 };
        // A stop sequence split over pieces: nothing of it is sent.
        assert_eq!(reply(10, &["X", "END"], &[b"ab", b"cE", b"N", b"Dzz"], false), ("abc".into(), Some((Finish::StopSequence(1), usage(4)))));
        // The budget: what was held back in case it began a stop sequence is sent at the end.
        assert_eq!(reply(3, &["xyz"], &[b"a", b"b", b"x"], false), ("abx".into(), Some((Finish::Length, usage(3)))));
        // A character split over pieces waits for its end; the end of generation counts as a token.
        assert_eq!(reply(10, &[], &["\u{e9}".as_bytes()[..1].as_ref(), &"\u{e9}".as_bytes()[1..], b""], true), ("\u{e9}".into(), Some((Finish::Stop, usage(3)))));
        // A dead end of a constraint adds no token.
        let mut r = Reply::new(7, 10, Vec::new());
        assert_eq!(r.step(b"a", false, false).text, "a");
        assert_eq!(r.step(b"", true, true), Advance::text(String::new(), Some((Finish::Constraint, usage(1)))));
    }

    #[test]
    fn a_session_holds_the_prompt_and_what_may_follow() {
        assert_eq!(session_size(10, Some(5), 100), Ok((15, 5)));
        assert_eq!(session_size(10, None, 100), Ok((100, 90)));
        assert_eq!(session_size(10, Some(500), 100), Ok((100, 90)));
        assert_eq!(session_size(0, None, 100).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(session_size(100, None, 100).unwrap_err().code, Some("context_length_exceeded"));
    }

    #[test]
    fn a_chat_request_with_every_setting_reads_into_a_generation() {
        let body = br#"{"model": "m", "messages": [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}],
            "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 10, "min_p": 0.1, "seed": 3,
            "stop": ["\n", "END"], "stream": true, "stream_options": {"include_usage": true},
            "presence_penalty": 0, "user": "ignored", "logit_bias": {}, "functions": [], "function_call": "none",
            "modalities": ["text"], "audio": null, "service_tier": "auto"}"#;
        let g = chat_request(body).unwrap();
        let messages = vec![json!({"role": "system", "content": "Be brief."}), json!({"role": "user", "content": "Hi!"})];
        assert_eq!(g.prompt, Prompt::Chat(Chat { messages, tools: None }));
        assert_eq!((g.n, g.logprobs), (1, None));
        assert_eq!((g.max_tokens, g.sampling.top_k, g.sampling.seed, g.stream, g.include_usage), (Some(5), 10, 3, true, true));
        assert_eq!((g.sampling.temperature, g.sampling.top_p, g.sampling.min_p), (0.5, 0.9, 0.1));
        assert_eq!(g.stop, vec!["\n".to_string(), "END".to_string()]);
    }

    #[test]
    fn bad_requests_are_400_naming_the_field() {
        let cases: &[(&[u8], &str)] = &[
            (b"{", "malformed JSON"),
            (b"{not json", "malformed JSON"),
            (b"[]", "invalid request"),
            (br#"["m", [{"role": "user", "content": "x"}]]"#, "invalid request"),
            (br#"{"messages": [{"role": "user", "content": "x"}]}"#, "model"),
            (br#"{"model": "m"}"#, "messages"),
            (br#"{"model": "m", "messages": []}"#, "messages"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": 3}]}"#, "messages[0].content"),
            (br#"{"model": "m", "messages": [{"role": "robot", "content": "x"}]}"#, "messages[0].role"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}"#, "max_tokens"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}"#, "max_tokens"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5}"#, "temperature"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": -1}"#, "top_p"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9}"#, "n"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}"#, "n"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}"#, "top_logprobs"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#, "top_logprobs"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 3}"#, "logprobs"),
            (br#"{"model": "m", "messages": [{"role": "user"}]}"#, "messages[0].content"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}"#, "messages[0].tool_calls"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}}"#, "tools"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}"#, "presence_penalty"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}"#, "stop"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ""}"#, "stop"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": -9223372036854775809}"#, "seed"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}"#, "max_tokens"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2147483648}"#, "max_tokens"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0, "max_completion_tokens": 5}"#, "max_tokens"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"651": 100}}"#, "logit_bias"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": 3}"#, "logit_bias"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}"#, "functions"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "function_call": "auto"}"#, "function_call"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}"#, "modalities"),
            (br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "audio": {"voice": "alloy"}}"#, "audio"),
        ];
        for (body, field) in cases {
            let e = chat_request(body).unwrap_err();
            assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(body));
            let named = e.param.as_deref() == Some(*field) || e.message.contains(field);
            assert!(named, "{} -> {e:?} does not name {field}", String::from_utf8_lossy(body));
            assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        }
        // JSON that does not parse names no field (serde's path there is `?`).
        for body in [&b"{not json"[..], b"{", b"{\"model\": }"] {
            assert_eq!(chat_request(body).unwrap_err().param, None, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn constraints_come_from_response_format_json_schema_grammar_or_regex() {
        let chat = |extra: &str| chat_request(format!(r#"{{"model": "m", "messages": [{{"role": "user", "content": "x"}}]{extra}}}"#).as_bytes());
        let schema = |g: Generation| match g.constraint {
            Some((param, Constraint::JsonSchema(s))) => (param, serde_json::from_str::<Value>(&s).unwrap()),
            other => panic!("{other:?}"),
        };
        assert_eq!(chat("").unwrap().constraint, None);
        assert_eq!(chat(r#", "response_format": {"type": "text"}"#).unwrap().constraint, None);
        assert_eq!(schema(chat(r#", "response_format": {"type": "json_object"}"#).unwrap()), ("response_format", json!({"type": "object"})));
        let g = chat(r#", "response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": true, "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}}"#);
        let (param, s) = schema(g.unwrap());
        assert_eq!(param, "response_format");
        // The client's order of properties is kept.
        assert_eq!(s["properties"].as_object().unwrap().keys().collect::<Vec<_>>(), ["b", "a"]);
        assert_eq!(schema(chat(r#", "response_format": {"type": "json_schema", "json_schema": {"name": "any"}}"#).unwrap()).1, json!({}));
        assert_eq!(schema(chat(r#", "response_format": {"type": "json_object", "schema": {"type": "array"}}"#).unwrap()).1, json!({"type": "array"}));
        assert_eq!(schema(chat(r#", "json_schema": {"type": "string"}"#).unwrap()), ("json_schema", json!({"type": "string"})));
        let g = completion_request(br#"{"model": "m", "prompt": "x", "grammar": "start: \"a\""}"#).unwrap();
        assert_eq!(g.constraint, Some(("grammar", Constraint::Lark("start: \"a\"".into()))));
        let g = completion_request(br#"{"model": "m", "prompt": "x", "regex": "[0-9]+"}"#).unwrap();
        assert_eq!(g.constraint, Some(("regex", Constraint::Regex("[0-9]+".into()))));
        let bad: &[(&str, &str)] = &[
            (r#", "response_format": {"type": "xml"}"#, "response_format"),
            (r#", "response_format": {"type": "json_schema"}"#, "response_format.json_schema"),
            (r#", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}"#, "response_format.json_schema.schema"),
            (r#", "response_format": {"type": "json_schema", "json_schema": {"name": 3}}"#, "response_format.json_schema.name"),
            (r#", "json_schema": "x""#, "json_schema"),
            (r#", "regex": "a", "json_schema": {}"#, "regex"),
        ];
        for (extra, param) in bad {
            let e = chat(extra).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(*param)), "{extra}: {e:?}");
        }
        let big = format!(r#", "regex": "{}""#, "a".repeat(MAX_CONSTRAINT_BYTES + 1));
        let e = chat(&big).unwrap_err();
        assert!(e.param.as_deref() == Some("regex") && e.message.contains("over the limit"), "{e:?}");
    }

    #[test]
    fn tokenize_and_detokenize_bodies_are_objects() {
        for body in [&b"[[]]"[..], b" [[1, 2]]", b"[\"text\"]"] {
            let Err(e) = parse::<DetokenizeRequest>(body) else { panic!("{body:?} read as a detokenize request") };
            assert!(e.status == 400 && e.message.contains("not an object"), "{e:?}");
            assert!(parse::<TokenizeRequest>(body).is_err());
        }
        assert!(parse::<DetokenizeRequest>(br#"{"tokens": [1, 2]}"#).is_ok());
    }

    #[test]
    fn completion_prompts_are_text_one_text_or_tokens() {
        let g = completion_request(br#"{"model": "m", "prompt": ["Hello"]}"#).unwrap();
        assert_eq!(g.prompt, Prompt::Text("Hello".into()));
        let g = completion_request(br#"{"model": "m", "prompt": [1, 2.0, 3], "max_tokens": 4.0}"#).unwrap();
        assert_eq!(g.max_tokens, Some(4));
        assert_eq!(g.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(completion_request(br#"{"model": "m", "prompt": ["a", "b"]}"#).unwrap_err().status, 400);
        assert_eq!(completion_request(br#"{"model": "m", "prompt": []}"#).unwrap_err().status, 400);
        assert_eq!(completion_request(br#"{"model": "m", "prompt": "x", "echo": true}"#).unwrap_err().status, 400);
    }

    #[test]
    fn tool_calls_and_results_and_logprobs_read_into_a_chat() {
        let body = br#"{"model": "m", "messages": [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "cold"}],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}], "tool_choice": "required",
            "parallel_tool_calls": false, "logprobs": true, "top_logprobs": 3, "n": 2}"#;
        let g = chat_request(body).unwrap();
        let Prompt::Chat(chat) = &g.prompt else { panic!() };
        assert_eq!(chat.messages[1]["content"], Value::Null);
        assert_eq!(chat.messages[1]["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(chat.messages[2], json!({"role": "tool", "content": "cold", "tool_call_id": "c1"}));
        let tools = chat.tools.as_ref().unwrap();
        assert_eq!((&tools.choice, tools.parallel), (&Choice::Required, false));
        assert_eq!((g.logprobs, g.n), (Some(3), 2));
        let conv: Value = serde_json::from_str(&chat.conversation()).unwrap();
        assert_eq!(conv["tools"][0]["function"]["name"], "w");
        let text = completion_request(br#"{"model": "m", "prompt": "x", "logprobs": 2}"#).unwrap();
        assert_eq!(text.logprobs, Some(2));
        for bad in [&br#"{"model": "m", "prompt": "x", "logprobs": 6}"#[..], br#"{"model": "m", "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}"#] {
            assert_eq!(completion_request(bad).unwrap_err().status, 400);
        }
    }

    /// A reply under tools, fed `pieces` (the last ends generation when `eog`).
    /// Tools `w` and `now`, a call forced or not.
    fn tools(forced: bool) -> Tools {
        let list = vec![json!({"type": "function", "function": {"name": "w"}}), json!({"type": "function", "function": {"name": "now"}})];
        Tools::read(Some(&list), Some(&json!(if forced { "required" } else { "auto" })), None).unwrap().unwrap()
    }

    fn calling(syntax: ToolSyntax, forced: bool, budget: u32, pieces: &[&str], eog: bool) -> Vec<Advance> {
        let mut r = Reply::new(5, budget, vec!["STOP".into()]).calling(syntax, &tools(forced));
        let mut out = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            let a = r.step(p.as_bytes(), eog && i + 1 == pieces.len(), false);
            let end = a.end.is_some();
            out.push(a);
            if end {
                break;
            }
        }
        out
    }

    #[test]
    fn a_reply_that_opens_a_call_is_rewound_to_it_and_read_as_calls() {
        // Auto: text, then the call's opening (split over tokens): the tokens before it are
        // kept, the call's text is never sent, and the end reads the call.
        let steps = calling(ToolSyntax::Hermes, false, 100, &["Let me", " check.", "<tool", "_call>"], false);
        // A reply that opens with a bare call (in a code fence) is a call too.
        let fenced = calling(ToolSyntax::Hermes, false, 100, &["\n", "```", "json\n", "{\"", "name", "\": \"", "w\""], false);
        assert_eq!(fenced.iter().map(|a| a.text.as_str()).collect::<String>(), "");
        assert_eq!(fenced[6].call_opened, Some(1));
        // Another name is text.
        let other = calling(ToolSyntax::Hermes, false, 100, &["{\"name\": \"hi\"", "}"], false);
        assert_eq!(other.iter().map(|a| a.text.as_str()).collect::<String>(), "{\"name\": \"hi\"}");
        assert_eq!(steps.iter().map(|a| a.text.as_str()).collect::<String>(), "Let me check.");
        assert_eq!(steps[3].call_opened, Some(2));
        let mut r = Reply::new(5, 100, vec![]).calling(ToolSyntax::Hermes, &tools(false));
        r.step(b"Hi", false, false);
        assert_eq!(r.step(b"<tool_call>", false, false).call_opened, Some(1));
        for p in ["<tool_call>", "\n{\"name\": \"w\", \"arguments\": {}}", "\n</tool_call>"] {
            assert_eq!(r.step(p.as_bytes(), false, false).text, "");
        }
        let end = r.step(b"", true, false);
        assert_eq!(end.end.unwrap().0, Finish::ToolCalls);
        assert_eq!((end.calls[0].name.as_str(), end.calls[0].arguments.as_str()), ("w", "{}"));
        assert_eq!(end.end.unwrap().1.completion_tokens, 5);
        // Forced: calls from the first token; cut short by the budget, the text as written.
        let cut = calling(ToolSyntax::Hermes, true, 2, &["<tool_call>", "\n{"], false);
        assert_eq!((cut[1].text.as_str(), cut[1].end.unwrap().0), ("<tool_call>\n{", Finish::Length));
        // A stop sequence still ends a reply that opened no call.
        let stopped = calling(ToolSyntax::Hermes, false, 100, &["a STOP b"], false);
        assert_eq!((stopped[0].text.as_str(), stopped[0].end.unwrap().0), ("a ", Finish::StopSequence(0)));
        // Llama 3: a reply that opens with `{` is a call; one that does not is text.
        let json = calling(ToolSyntax::Llama3Json, false, 100, &[" ", "{\"name\": \"w\"", ", \"parameters\": {}}"], false);
        assert_eq!(json[1].call_opened, Some(1));
        let text = calling(ToolSyntax::Llama3Json, false, 100, &[" ", "Hello", "!"], true);
        assert_eq!(text.iter().map(|a| a.text.as_str()).collect::<String>(), " Hello");
        assert_eq!(text[2].end.unwrap().0, Finish::Stop);
    }

    #[test]
    fn responses_and_chunks_have_openai_shapes() {
        let h = Head::new(Kind::Chat, "m");
        let r = h.response("hi", Finish::Length, Usage { prompt_tokens: 3, completion_tokens: 2, cached_tokens: 1 });
        assert_eq!(r["object"], "chat.completion");
        assert_eq!(r["choices"][0]["message"]["content"], "hi");
        assert_eq!(r["choices"][0]["finish_reason"], "length");
        assert_eq!(r["usage"]["total_tokens"], 5);
        assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
        assert_eq!(h.text_chunk("x")["choices"][0]["delta"]["content"], "x");
        assert_eq!(h.usage_chunk(Usage::default())["choices"], json!([]));
        let t = Head::new(Kind::Text, "m");
        assert!(t.opening_chunk().is_none());
        assert_eq!(t.finish_chunk(Finish::Stop)["choices"][0]["finish_reason"], "stop");
        assert!(t.id.starts_with("cmpl-") && h.id.starts_with("chatcmpl-"));
        let call = Call { id: "call_1".into(), name: "w".into(), arguments: "{}".into() };
        let lp = TokenLogprob { token: "hi".into(), bytes: b"hi".to_vec(), logprob: -0.5, top: vec![("hi".into(), b"hi".to_vec(), -0.5), ("yo".into(), b"yo".to_vec(), -1.5)] };
        let answers = [
            Answer { text: String::new(), finish: Finish::ToolCalls, calls: vec![call.clone()], logprobs: None },
            Answer { text: "hi".into(), finish: Finish::Stop, calls: vec![], logprobs: Some(vec![lp.clone()]) },
        ];
        let r = h.response_of(&answers, Usage::default());
        assert_eq!(r["choices"][0]["message"], json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}));
        assert_eq!(r["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(r["choices"][1]["index"], 1);
        assert_eq!(r["choices"][1]["logprobs"]["content"][0]["top_logprobs"][1], json!({"token": "yo", "logprob": -1.5, "bytes": [121, 111]}));
        assert_eq!(h.calls_chunk_of(0, &[call])["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
        let text = t.logprobs_json(&[lp.clone(), lp], 3);
        assert_eq!(text["text_offset"], json!([3, 5]));
        assert_eq!(text["top_logprobs"][0], json!({"hi": -0.5, "yo": -1.5}));
    }
}
