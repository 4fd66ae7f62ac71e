//! OpenAI's Responses API (`POST /v1/responses`) over the same generations: a request (text or
//! items in, `instructions`, function tools, `text.format`, `previous_response_id`) is
//! translated into the chat completion it asks for and read by [`chat_request`], so every
//! check and limit is the chat's; the reply is written back as a response object (a message
//! item with its text, `function_call` items) or as the API's stream of typed events.
//!
//! A response's conversation (its input, its output, and those of the responses before it) is
//! what a later request's `previous_response_id` continues; the server keeps them
//! ([`Conversation`]), and its prompt cache reuses the keys and values of their tokens.

use crate::{ApiError, Call, Finish, Generation, Usage, chat_request, fresh_seed};
use serde_json::{Map, Value, json};

/// A response's conversation: the chat messages of its inputs and outputs, in order (the
/// `instructions` apart: they are not carried to the next response, as OpenAI's are not).
pub type Conversation = Vec<Value>;

/// A Responses API request as the generation it asks for, the conversation so far (its
/// previous response's, then its input), and the echo of its settings for the response
/// object. `previous` finds a stored response's conversation by id.
pub fn responses_request(bytes: &[u8], previous: impl FnOnce(&str) -> Option<Conversation>) -> Result<(Generation, Conversation, Value), ApiError> {
    let body: Value = crate::parse(bytes)?;
    let Some(obj) = body.as_object() else { return Err(ApiError::invalid("the body is a JSON object")) };
    let mut conversation = match obj.get("previous_response_id").filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(Value::String(id)) => previous(id).ok_or_else(|| {
            ApiError::invalid_param("previous_response_id", format!("no response {id:?} is kept here (the server keeps the most recent ones)"))
        })?,
        Some(_) => return Err(ApiError::invalid_param("previous_response_id", "previous_response_id is a response's id")),
    };
    match obj.get("input") {
        Some(Value::String(s)) => conversation.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                input_item(item, &format!("input[{i}]"), &mut conversation)?;
            }
        }
        _ => return Err(ApiError::invalid_param("input", "input is text or a list of items")),
    }
    let mut messages = Vec::new();
    match obj.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(ApiError::invalid_param("instructions", "instructions is text")),
    }
    messages.extend(conversation.iter().cloned());
    let mut chat = Map::new();
    chat.insert("model".into(), obj.get("model").cloned().unwrap_or(Value::Null));
    chat.insert("messages".into(), Value::Array(messages));
    for key in ["temperature", "top_p", "stream", "parallel_tool_calls"] {
        if let Some(v) = obj.get(key) {
            chat.insert(key.into(), v.clone());
        }
    }
    if let Some(v) = obj.get("max_output_tokens") {
        chat.insert("max_tokens".into(), v.clone());
    }
    if let Some(tools) = obj.get("tools").filter(|v| !v.is_null()) {
        let Some(tools) = tools.as_array() else { return Err(ApiError::invalid_param("tools", "tools is a list")) };
        let mut list = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            if t["type"] != "function" {
                return Err(ApiError::invalid_param(&format!("tools[{i}].type"), "only function tools are offered"));
            }
            if !(t["description"].is_string() || t["description"].is_null()) || !(t["strict"].is_boolean() || t["strict"].is_null()) {
                return Err(ApiError::invalid_param(&format!("tools[{i}]"), "a tool's description is text and its strict true or false"));
            }
            list.push(json!({"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["parameters"]}}));
        }
        chat.insert("tools".into(), Value::Array(list));
    }
    if let Some(choice) = obj.get("tool_choice").filter(|v| !v.is_null()) {
        let openai = match choice {
            Value::String(_) => choice.clone(),
            _ if choice["type"] == "function" => json!({"type": "function", "function": {"name": choice["name"]}}),
            _ => return Err(ApiError::invalid_param("tool_choice", "tool_choice is auto, required, none or a function")),
        };
        chat.insert("tool_choice".into(), openai);
    }
    let text = obj.get("text").filter(|t| !t.is_null());
    if text.is_some_and(|t| !t.is_object()) {
        return Err(ApiError::invalid_param("text", "text is an object ({\"format\": ...})"));
    }
    if let Some(format) = text.map(|t| &t["format"]).filter(|f| !f.is_null()) {
        if !format.is_object() || !(format["strict"].is_boolean() || format["strict"].is_null()) {
            return Err(ApiError::invalid_param("text.format", "text.format is an object ({\"type\": ...}), its strict true or false"));
        }
        let openai = match format["type"].as_str() {
            Some("text") => json!({"type": "text"}),
            Some("json_object") => json!({"type": "json_object"}),
            Some("json_schema") => json!({"type": "json_schema", "json_schema": {"name": format["name"], "schema": format["schema"]}}),
            _ => return Err(ApiError::invalid_param("text.format", "text.format's type is text, json_object or json_schema")),
        };
        chat.insert("response_format".into(), openai);
    }
    let generation = chat_request(Value::Object(chat).to_string().as_bytes()).map_err(|mut e| {
        if e.param.as_deref() == Some("max_tokens") {
            e.param = Some("max_output_tokens".into());
        } else if e.param.as_deref() == Some("response_format") {
            e.param = Some("text.format".into());
        }
        e
    })?;
    let echo = json!({
        "instructions": obj.get("instructions").cloned().unwrap_or(Value::Null),
        "max_output_tokens": obj.get("max_output_tokens").cloned().unwrap_or(Value::Null),
        "previous_response_id": obj.get("previous_response_id").cloned().unwrap_or(Value::Null),
        "temperature": obj.get("temperature").cloned().unwrap_or(json!(1.0)),
        "top_p": obj.get("top_p").cloned().unwrap_or(json!(1.0)),
        "tools": obj.get("tools").cloned().filter(|t| t.is_array()).unwrap_or(json!([])),
        "tool_choice": obj.get("tool_choice").cloned().unwrap_or(json!("auto")),
        "parallel_tool_calls": obj.get("parallel_tool_calls").cloned().unwrap_or(json!(true)),
        "text": obj.get("text").cloned().unwrap_or(json!({"format": {"type": "text"}})),
        "metadata": obj.get("metadata").cloned().unwrap_or(json!({})),
    });
    Ok((generation, conversation, echo))
}

/// One input item as chat messages: a message (`role`, `content` as text or parts), a
/// `function_call` (an assistant's call, joined to the assistant message before it), or a
/// `function_call_output` (the call's result).
fn input_item(item: &Value, param: &str, out: &mut Conversation) -> Result<(), ApiError> {
    let kind = item["type"].as_str().unwrap_or("message");
    match kind {
        "message" => {
            let role = match item["role"].as_str() {
                Some(r @ ("user" | "assistant" | "system")) => r,
                Some("developer") => "system",
                _ => return Err(ApiError::invalid_param(&format!("{param}.role"), "a message's role is user, assistant, system or developer")),
            };
            let text = match &item["content"] {
                Value::String(s) => s.clone(),
                Value::Array(parts) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p["type"].as_str(), p["text"].as_str()) {
                            (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                            (t, _) => return Err(ApiError::invalid_param(&format!("{param}.content"), format!("content parts of type {t:?} are not supported (input_text, output_text)"))),
                        }
                    }
                    text
                }
                _ => return Err(ApiError::invalid_param(&format!("{param}.content"), "content is text or a list of parts")),
            };
            out.push(json!({"role": role, "content": text}));
        }
        "function_call" => {
            let (Some(call_id), Some(name)) = (item["call_id"].as_str(), item["name"].as_str()) else {
                return Err(ApiError::invalid_param(param, "a function_call needs call_id and name"));
            };
            let arguments = match &item["arguments"] {
                Value::Null => "{}",
                Value::String(a) => a,
                _ => return Err(ApiError::invalid_param(&format!("{param}.arguments"), "a function_call's arguments are JSON text")),
            };
            let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}});
            match out.last_mut() {
                Some(last) if last["role"] == "assistant" && last["tool_calls"].is_array() => {
                    if let Some(calls) = last["tool_calls"].as_array_mut() {
                        calls.push(call);
                    }
                }
                Some(last) if last["role"] == "assistant" => last["tool_calls"] = json!([call]),
                _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let Some(call_id) = item["call_id"].as_str() else { return Err(ApiError::invalid_param(param, "a function_call_output needs call_id")) };
            let Some(output) = item["output"].as_str().map(str::to_string) else {
                return Err(ApiError::invalid_param(&format!("{param}.output"), "a function_call_output's output is text"));
            };
            out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
        }
        other => return Err(ApiError::invalid_param(&format!("{param}.type"), format!("input items of type {other:?} are not supported"))),
    }
    Ok(())
}

/// One reply as a response object: its identity, the request's settings it echoes, and its
/// output items and stream events.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub echo: Value,
    message_id: String,
    sequence: u64,
}

impl ResponseHead {
    pub fn new(model: &str, echo: Value) -> ResponseHead {
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let (id, message_id) = (format!("resp_{:016x}", fresh_seed()), format!("msg_{:016x}", fresh_seed()));
        ResponseHead { id, created, model: model.to_string(), echo, message_id, sequence: 0 }
    }

    /// The response object: `status` `in_progress` (no output, no usage yet), `completed`, or
    /// `incomplete` (cut by `max_output_tokens` or the context).
    pub fn object(&self, text: &str, calls: &[Call], end: Option<(Finish, Usage)>) -> Value {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "in_progress", "error": null, "incomplete_details": null, "output": [], "usage": null,
        });
        if let (Some(echo), Some(obj)) = (self.echo.as_object(), r.as_object_mut()) {
            obj.extend(echo.clone());
        }
        if let Some((finish, usage)) = end {
            let mut output = Vec::new();
            if !text.is_empty() || calls.is_empty() {
                output.push(self.message_item(text, "completed"));
            }
            output.extend(calls.iter().map(|c| function_call_item(c, "completed")));
            r["output"] = Value::Array(output);
            r["status"] = json!("completed");
            if finish == Finish::Length {
                r["status"] = json!("incomplete");
                r["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            r["usage"] = json!({
                "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            });
        }
        r
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" { json!([]) } else { json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]) };
        json!({"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content})
    }

    /// The conversation after this response: `before` and its output as chat messages.
    pub fn conversation(before: Conversation, text: &str, calls: &[Call]) -> Conversation {
        let mut c = before;
        let mut message = json!({"role": "assistant", "content": text});
        if !calls.is_empty() {
            message["tool_calls"] = calls.iter().map(|c| c.json(None)).collect();
        }
        c.push(message);
        c
    }

    /// The next event, numbered.
    fn event(&mut self, kind: &'static str, mut body: Value) -> (&'static str, Value) {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        (kind, body)
    }

    /// `response.created` and `response.in_progress`.
    pub fn start_events(&mut self) -> Vec<(&'static str, Value)> {
        let r = self.object("", &[], None);
        vec![self.event("response.created", json!({"response": r.clone()})), self.event("response.in_progress", json!({"response": r}))]
    }

    /// The message item and its text part opened (before the first text).
    pub fn open_text_events(&mut self) -> Vec<(&'static str, Value)> {
        let item = self.message_item("", "in_progress");
        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        let id = self.message_id.clone();
        vec![
            self.event("response.output_item.added", json!({"output_index": 0, "item": item})),
            self.event("response.content_part.added", json!({"output_index": 0, "item_id": id, "content_index": 0, "part": part})),
        ]
    }

    /// A piece of the message's text.
    pub fn text_event(&mut self, delta: &str) -> (&'static str, Value) {
        let id = self.message_id.clone();
        self.event("response.output_text.delta", json!({"output_index": 0, "item_id": id, "content_index": 0, "delta": delta, "logprobs": []}))
    }

    /// The message item closed with its whole `text`.
    pub fn close_text_events(&mut self, text: &str) -> Vec<(&'static str, Value)> {
        let id = self.message_id.clone();
        let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
        let item = self.message_item(text, "completed");
        vec![
            self.event("response.output_text.done", json!({"output_index": 0, "item_id": id, "content_index": 0, "text": text, "logprobs": []})),
            self.event("response.content_part.done", json!({"output_index": 0, "item_id": id, "content_index": 0, "part": part})),
            self.event("response.output_item.done", json!({"output_index": 0, "item": item})),
        ]
    }

    /// A `function_call` item at `index`, whole: added, its arguments, done.
    pub fn call_events(&mut self, index: usize, call: &Call) -> Vec<(&'static str, Value)> {
        let mut added = function_call_item(call, "in_progress");
        added["arguments"] = json!("");
        let id = added["id"].clone();
        vec![
            self.event("response.output_item.added", json!({"output_index": index, "item": added})),
            self.event("response.function_call_arguments.delta", json!({"output_index": index, "item_id": id, "delta": call.arguments})),
            self.event("response.function_call_arguments.done", json!({"output_index": index, "item_id": id, "name": call.name, "arguments": call.arguments})),
            self.event("response.output_item.done", json!({"output_index": index, "item": function_call_item(call, "completed")})),
        ]
    }

    /// `response.completed` (or `response.incomplete`) with the whole response.
    pub fn end_event(&mut self, text: &str, calls: &[Call], finish: Finish, usage: Usage) -> (&'static str, Value) {
        let r = self.object(text, calls, Some((finish, usage)));
        let kind = if r["status"] == "incomplete" { "response.incomplete" } else { "response.completed" };
        self.event(kind, json!({"response": r}))
    }

    /// An error after the stream began.
    pub fn error_event(&mut self, e: &ApiError) -> (&'static str, Value) {
        self.event("error", json!({"code": e.code, "message": e.message, "param": e.param}))
    }
}

/// A call as a `function_call` output item.
fn function_call_item(call: &Call, status: &str) -> Value {
    json!({"id": format!("fc_{}", call.id), "type": "function_call", "status": status, "call_id": call.id, "name": call.name, "arguments": call.arguments})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Prompt;

    #[test]
    fn a_responses_request_is_the_chat_it_asks_for() {
        let body = br#"{"model": "m", "instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "cold"}],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}], "max_output_tokens": 20,
            "text": {"format": {"type": "text"}}, "previous_response_id": "resp_1"}"#;
        let earlier = vec![json!({"role": "user", "content": "Hi"}), json!({"role": "assistant", "content": "Hello"})];
        let (g, conversation, echo) = responses_request(body, |id| (id == "resp_1").then(|| earlier.clone())).unwrap();
        let Prompt::Chat(chat) = &g.prompt else { panic!() };
        let roles: Vec<&str> = chat.messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user", "assistant", "tool"]);
        assert_eq!(chat.messages[4]["tool_calls"][0]["id"], "c1");
        assert_eq!(conversation.len(), 5);
        assert_eq!((g.max_tokens, echo["instructions"].as_str()), (Some(20), Some("Be brief.")));
        assert!(chat.tools.is_some());
        let missing = responses_request(br#"{"model": "m", "input": "x", "previous_response_id": "gone"}"#, |_| None).unwrap_err();
        assert_eq!(missing.param.as_deref(), Some("previous_response_id"));
        let bad = responses_request(br#"{"model": "m", "input": "x", "max_output_tokens": 0}"#, |_| None).unwrap_err();
        assert_eq!(bad.param.as_deref(), Some("max_output_tokens"));
        let bad = responses_request(br#"{"model": "m", "input": "x", "tools": [{"type": "web_search"}]}"#, |_| None).unwrap_err();
        assert_eq!(bad.param.as_deref(), Some("tools[0].type"));
        let (g, ..) = responses_request(br#"{"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}}}"#, |_| None).unwrap();
        assert!(g.constraint.is_some());
    }

    #[test]
    fn a_reply_is_a_response_object_and_its_events() {
        let mut h = ResponseHead::new("m", json!({"instructions": null}));
        let usage = Usage { prompt_tokens: 3, completion_tokens: 2, cached_tokens: 0 };
        let r = h.object("hi", &[], Some((Finish::Stop, usage)));
        assert_eq!((r["object"].as_str(), r["status"].as_str()), (Some("response"), Some("completed")));
        assert_eq!(r["output"][0]["content"][0], json!({"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}));
        assert_eq!(r["usage"]["total_tokens"], 5);
        assert_eq!(h.object("h", &[], Some((Finish::Length, usage)))["incomplete_details"]["reason"], "max_output_tokens");
        let call = Call { id: "call_1".into(), name: "w".into(), arguments: "{}".into() };
        let r = h.object("", std::slice::from_ref(&call), Some((Finish::ToolCalls, usage)));
        assert_eq!(r["output"], json!([{"id": "fc_call_1", "type": "function_call", "status": "completed", "call_id": "call_1", "name": "w", "arguments": "{}"}]));
        let events: Vec<&str> = [h.start_events(), h.open_text_events(), vec![h.text_event("hi")], h.close_text_events("hi"), h.call_events(1, &call), vec![h.end_event("hi", &[call], Finish::ToolCalls, usage)]]
            .concat()
            .iter()
            .map(|(k, v)| {
                assert_eq!(v["type"], *k);
                *k
            })
            .collect();
        assert_eq!(events[0], "response.created");
        assert_eq!(events.last(), Some(&"response.completed"));
        let conversation = ResponseHead::conversation(vec![], "", &[Call { id: "c".into(), name: "w".into(), arguments: "{}".into() }]);
        assert_eq!(conversation[0]["tool_calls"][0]["function"]["name"], "w");
    }
}
