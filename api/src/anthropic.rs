//! Anthropic's Messages API (`POST /v1/messages`) over the same generations: a request is
//! translated into the chat completion it asks for (system prompt, text, `tool_use` and
//! `tool_result` blocks, tools, `tool_choice`, `stop_sequences`) and read by [`chat_request`],
//! so every check and limit is the chat's; the reply is written back as a message (text and
//! `tool_use` blocks, `stop_reason`) or as Anthropic's stream of events.

use crate::{ApiError, Call, Finish, Generation, Usage, chat_request, fresh_seed};
use serde_json::{Map, Value, json};

/// The fields of a chat completion and of the Messages API that name the same thing, for
/// errors: the chat's name, the message's.
const RENAMED: [(&str, &str); 4] = [("stop", "stop_sequences"), ("max_tokens", "max_tokens"), ("tool_choice", "tool_choice"), ("tools", "tools")];

/// A Messages API request as the generation it asks for.
pub fn messages_request(bytes: &[u8]) -> Result<Generation, ApiError> {
    let body: Value = crate::parse(bytes)?;
    let chat = to_chat(&body)?;
    chat_request(chat.to_string().as_bytes()).map_err(|mut e| {
        if let Some(p) = &e.param
            && let Some((_, ours)) = RENAMED.iter().find(|(chat, _)| p == chat)
        {
            e.param = Some(ours.to_string());
        }
        e
    })
}

/// The chat completion request a Messages API request asks for.
fn to_chat(body: &Value) -> Result<Value, ApiError> {
    let Some(obj) = body.as_object() else { return Err(ApiError::invalid("the body is a JSON object")) };
    let max_tokens = obj.get("max_tokens").filter(|v| !v.is_null()).ok_or_else(|| ApiError::invalid_param("max_tokens", "max_tokens is required"))?;
    if obj.get("thinking").is_some_and(|t| t["type"] == "enabled") {
        return Err(ApiError::invalid_param("thinking", "extended thinking is not supported"));
    }
    let mut messages = Vec::new();
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => messages.push(json!({"role": "system", "content": text_of(blocks, "system")?})),
        Some(_) => return Err(ApiError::invalid_param("system", "system is text or a list of text blocks")),
    }
    let Some(list) = obj.get("messages").and_then(Value::as_array) else {
        return Err(ApiError::invalid_param("messages", "messages is a list"));
    };
    for (i, m) in list.iter().enumerate() {
        let param = format!("messages[{i}]");
        let role = m["role"].as_str().filter(|r| *r == "user" || *r == "assistant");
        let Some(role) = role else { return Err(ApiError::invalid_param(&format!("{param}.role"), "a message's role is user or assistant")) };
        let blocks = match &m["content"] {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            _ => return Err(ApiError::invalid_param(&format!("{param}.content"), "content is text or a list of blocks")),
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        let mut results = Vec::new();
        for (k, b) in blocks.iter().enumerate() {
            let at = format!("{param}.content[{k}]");
            match (b["type"].as_str(), role) {
                (Some("text"), _) => text.push_str(b["text"].as_str().ok_or_else(|| ApiError::invalid_param(&at, "a text block needs text"))?),
                (Some("tool_use"), "assistant") => {
                    let (Some(id), Some(name)) = (b["id"].as_str(), b["name"].as_str()) else {
                        return Err(ApiError::invalid_param(&at, "a tool_use block needs an id and a name"));
                    };
                    let input = match &b["input"] {
                        Value::Null => json!({}),
                        v @ Value::Object(_) => v.clone(),
                        _ => return Err(ApiError::invalid_param(&format!("{at}.input"), "a tool_use's input is an object")),
                    };
                    calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
                }
                (Some("tool_result"), "user") => {
                    let id = b["tool_use_id"].as_str().ok_or_else(|| ApiError::invalid_param(&at, "a tool_result block needs tool_use_id"))?;
                    let content = match &b["content"] {
                        Value::Null => String::new(),
                        Value::String(s) => s.clone(),
                        Value::Array(parts) => text_of(parts, &at)?,
                        _ => return Err(ApiError::invalid_param(&at, "a tool_result's content is text or text blocks")),
                    };
                    let failed = match &b["is_error"] {
                        Value::Null => false,
                        Value::Bool(e) => *e,
                        _ => return Err(ApiError::invalid_param(&format!("{at}.is_error"), "is_error is true or false")),
                    };
                    let content = if failed { format!("Error: {content}") } else { content };
                    results.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                (kind, _) => {
                    return Err(ApiError::invalid_param(&at, format!("a {role}'s content block of type {kind:?} is not supported (text, and tool_use or tool_result)")));
                }
            }
        }
        messages.extend(results);
        match role {
            "assistant" if !calls.is_empty() => {
                messages.push(json!({"role": "assistant", "content": if text.is_empty() { Value::Null } else { json!(text) }, "tool_calls": calls}))
            }
            _ if text.is_empty() && blocks.iter().any(|b| b["type"] == "tool_result") => {}
            _ => messages.push(json!({"role": role, "content": text})),
        }
    }
    let mut chat = Map::new();
    chat.insert("model".into(), obj.get("model").cloned().unwrap_or(Value::Null));
    chat.insert("messages".into(), Value::Array(messages));
    chat.insert("max_tokens".into(), max_tokens.clone());
    for key in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = obj.get(key) {
            chat.insert(key.into(), v.clone());
        }
    }
    if let Some(stops) = obj.get("stop_sequences").filter(|v| !v.is_null()) {
        chat.insert("stop".into(), stops.clone());
    }
    if let Some(tools) = obj.get("tools").filter(|v| !v.is_null()) {
        let Some(tools) = tools.as_array() else { return Err(ApiError::invalid_param("tools", "tools is a list")) };
        let mut list = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            if !(t["description"].is_string() || t["description"].is_null()) {
                return Err(ApiError::invalid_param(&format!("tools[{i}].description"), "a tool's description is text"));
            }
            list.push(json!({"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}));
        }
        let tools = list;
        chat.insert("tools".into(), Value::Array(tools));
    }
    if let Some(choice) = obj.get("tool_choice").filter(|v| !v.is_null()) {
        let openai = match choice["type"].as_str() {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => json!({"type": "function", "function": {"name": choice["name"]}}),
            _ => return Err(ApiError::invalid_param("tool_choice", "tool_choice's type is auto, any, tool or none")),
        };
        chat.insert("tool_choice".into(), openai);
        match &choice["disable_parallel_tool_use"] {
            Value::Null | Value::Bool(false) => {}
            Value::Bool(true) => {
                chat.insert("parallel_tool_calls".into(), json!(false));
            }
            _ => return Err(ApiError::invalid_param("tool_choice.disable_parallel_tool_use", "disable_parallel_tool_use is true or false")),
        }
    }
    Ok(Value::Object(chat))
}

/// The text of a list of text blocks.
fn text_of(blocks: &[Value], param: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for b in blocks {
        match (b["type"].as_str(), b["text"].as_str()) {
            (Some("text"), Some(t)) => text.push_str(t),
            _ => return Err(ApiError::invalid_param(param, "only text blocks are supported here")),
        }
    }
    Ok(text)
}

/// An [`ApiError`] in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(e: &ApiError) -> Value {
    let kind = match e.status {
        400 | 405 | 408 | 413 => "invalid_request_error",
        401 => "authentication_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        504 => "timeout_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

/// One reply as a message: its identity, and its blocks and events.
#[derive(Debug, Clone)]
pub struct MessageHead {
    pub id: String,
    pub model: String,
    /// The request's stop sequences, which `stop_sequence` names.
    pub stops: Vec<String>,
}

impl MessageHead {
    pub fn new(model: &str, stops: Vec<String>) -> MessageHead {
        MessageHead { id: format!("msg_{:016x}", fresh_seed()), model: model.to_string(), stops }
    }

    /// `stop_reason` and `stop_sequence` of `finish`.
    fn stop(&self, finish: Finish) -> (&'static str, Value) {
        match finish {
            Finish::Stop | Finish::Constraint => ("end_turn", Value::Null),
            Finish::StopSequence(i) => ("stop_sequence", self.stops.get(i).map_or(Value::Null, |s| json!(s))),
            Finish::Length => ("max_tokens", Value::Null),
            Finish::ToolCalls => ("tool_use", Value::Null),
        }
    }

    fn usage(u: Usage) -> Value {
        json!({"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens, "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0})
    }

    /// The whole message of a reply that was not streamed.
    pub fn response(&self, text: &str, calls: &[Call], finish: Finish, usage: Usage) -> Value {
        let mut content = Vec::new();
        if !text.is_empty() || calls.is_empty() {
            content.push(json!({"type": "text", "text": text}));
        }
        content.extend(calls.iter().map(tool_use));
        let (reason, sequence) = self.stop(finish);
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": MessageHead::usage(usage),
        })
    }

    /// `message_start`: the message without content yet.
    pub fn start_event(&self, usage: Usage) -> (&'static str, Value) {
        let message = json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": MessageHead::usage(Usage { completion_tokens: 0, ..usage }),
        });
        ("message_start", json!({"type": "message_start", "message": message}))
    }

    /// The events of a block of text at `index`: its start (`open`), a delta.
    pub fn text_events(index: usize, text: &str, open: bool) -> Vec<(&'static str, Value)> {
        let mut events = Vec::new();
        if open {
            events.push(("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}})));
        }
        events.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}})));
        events
    }

    /// The events of a `tool_use` block at `index`, whole: start, its input as one delta, stop.
    pub fn call_events(index: usize, call: &Call) -> Vec<(&'static str, Value)> {
        let block = json!({"type": "tool_use", "id": call.id, "name": call.name, "input": {}});
        vec![
            ("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": block})),
            ("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": call.arguments}})),
            MessageHead::block_stop(index),
        ]
    }

    /// `content_block_stop` of the block at `index`.
    pub fn block_stop(index: usize) -> (&'static str, Value) {
        ("content_block_stop", json!({"type": "content_block_stop", "index": index}))
    }

    /// `message_delta` (the stop reason, the output's count) and `message_stop`.
    pub fn end_events(&self, finish: Finish, usage: Usage) -> Vec<(&'static str, Value)> {
        let (reason, sequence) = self.stop(finish);
        vec![
            ("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": {"output_tokens": usage.completion_tokens}})),
            ("message_stop", json!({"type": "message_stop"})),
        ]
    }
}

/// A call as a `tool_use` block (its input the arguments' value).
fn tool_use(call: &Call) -> Value {
    let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Prompt, ToolSyntax};

    #[test]
    fn a_message_request_is_the_chat_it_asks_for() {
        let body = br#"{"model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "tu1", "name": "w", "input": {"city": "Oslo"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": [{"type": "text", "text": "cold"}]}, {"type": "text", "text": "Thanks"}]}],
            "tools": [{"name": "w", "description": "weather", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 5, "stream": true}"#;
        let g = messages_request(body).unwrap();
        let Prompt::Chat(chat) = &g.prompt else { panic!() };
        let roles: Vec<&str> = chat.messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(chat.messages[2]["tool_calls"][0]["function"]["arguments"], r#"{"city":"Oslo"}"#);
        assert_eq!(chat.messages[3]["content"], "cold");
        let tools = chat.tools.as_ref().unwrap();
        assert_eq!((tools.forced(), tools.parallel), (true, false));
        assert_eq!((g.max_tokens, g.sampling.top_k, g.stream, g.stop.clone()), (Some(50), 5, true, vec!["END".to_string()]));
        let bad: &[(&[u8], &str)] = &[
            (br#"{"model": "m", "messages": []}"#, "max_tokens"),
            (br#"{"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}"#, "messages[0].role"),
            (br#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}"#, "messages[0].content[0]"),
            (br#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["a","b","c","d","e"]}"#, "stop_sequences"),
            (br#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}}"#, "tool_choice"),
        ];
        for (body, param) in bad {
            let e = messages_request(body).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(*param)), "{e:?}");
        }
        assert_eq!(error_body(&ApiError::unauthorized())["error"]["type"], "authentication_error");
        let _ = ToolSyntax::Hermes;
    }

    #[test]
    fn a_reply_is_a_message_with_its_stop_reason() {
        let h = MessageHead::new("m", vec!["END".into()]);
        let usage = Usage { prompt_tokens: 4, completion_tokens: 2, cached_tokens: 0 };
        let r = h.response("hi", &[], Finish::StopSequence(0), usage);
        assert_eq!((r["stop_reason"].as_str(), r["stop_sequence"].as_str()), (Some("stop_sequence"), Some("END")));
        assert_eq!(r["content"], json!([{"type": "text", "text": "hi"}]));
        assert_eq!(r["usage"]["output_tokens"], 2);
        let call = Call { id: "toolu_1".into(), name: "w".into(), arguments: r#"{"city":"Oslo"}"#.into() };
        let r = h.response("", std::slice::from_ref(&call), Finish::ToolCalls, usage);
        assert_eq!(r["content"], json!([{"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}}]));
        assert_eq!(r["stop_reason"], "tool_use");
        assert_eq!(h.response("x", &[], Finish::Length, usage)["stop_reason"], "max_tokens");
        let events = MessageHead::call_events(1, &call);
        assert_eq!(events[1].1["delta"]["partial_json"], r#"{"city":"Oslo"}"#);
        assert_eq!(h.end_events(Finish::Stop, usage)[0].1["delta"]["stop_reason"], "end_turn");
    }
}
