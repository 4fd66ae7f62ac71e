//! Chat templates: a conversation rendered to prompt text by the model's own Jinja template
//! (`tokenizer.chat_template`), as llama.cpp's `--jinja` renders it (common/chat.cpp, whose
//! engine follows Hugging Face's `apply_chat_template`): minijinja with `trim_blocks` and
//! `lstrip_blocks`, Python string methods, `raise_exception`, `strftime_now`; the variables
//! `bos_token`, `eos_token`, `enable_thinking` (true), `date_string` and `datetime` (today),
//! `add_generation_prompt` (defined only when true), no `tools`; and, for a model's own template,
//! a leading system message folded into the next one where the template never reads a system
//! message's content (Gemma 2's raises on one). A template a host sets renders as written: one
//! that refuses a system message fails the call. tests/tests/chat_jinja.rs holds the renderings
//! to llama.cpp's, recorded.
//!
//! A file without a template gets the built-in template of its family when its vocabulary names
//! the family's turn markers (Gemma's `<start_of_turn>`, ChatML's `<|im_start|>`, Llama 3's
//! `<|start_header_id|>`), and says so (`Origin::Builtin`); a host can set another
//! (`set-chat-template`).

use crate::engine::Error;
use crate::gguf::Gguf;
use crate::tokenizer::Tokenizer;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Enumerator, Object, Serde};
use minijinja::{Environment, ErrorKind, Template as Compiled, Value, context};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Gemma's template (text-only), for Gemma files that do not carry one.
const GEMMA: &str = "{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
";

/// ChatML (Qwen, many fine-tunes): `<|im_start|>role\ncontent<|im_end|>\n`.
const CHATML: &str = "{%- for message in messages -%}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\n' }}
{%- endif -%}
";

/// Llama 3's template (text-only).
const LLAMA3: &str = "{{ bos_token }}
{%- for message in messages -%}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim) + '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif -%}
";

/// The built-in templates: name, the control token that marks a vocabulary of that family, source.
const BUILTINS: &[(&str, &str, &str)] =
    &[("gemma", "<start_of_turn>", GEMMA), ("chatml", "<|im_start|>", CHATML), ("llama3", "<|start_header_id|>", LLAMA3)];

/// The longest template source `set-chat-template` takes.
pub const MAX_SOURCE_BYTES: usize = 1 << 20;

/// Where a model's template comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The file's `tokenizer.chat_template`.
    File,
    /// A built-in template, by name: the file has none, or a host chose it.
    Builtin(&'static str),
    /// A Jinja template a host gave.
    Custom,
}

/// A model's chat template and the special-token texts it may refer to.
#[derive(Debug, Clone)]
pub struct Template {
    pub source: String,
    pub origin: Origin,
    pub bos_token: String,
    pub eos_token: String,
}

impl Template {
    /// The file's template, or the built-in one of the family its vocabulary marks.
    pub fn from_gguf(g: &Gguf, tok: &Tokenizer) -> Result<Option<Template>, String> {
        let (source, origin) = match g.get_str("tokenizer.chat_template")? {
            Some(s) => (s.to_string(), Origin::File),
            None => match BUILTINS.iter().find(|(_, marker, _)| tok.token_id(marker).is_some()) {
                Some((name, _, source)) => (source.to_string(), Origin::Builtin(name)),
                None => return Ok(None),
            },
        };
        Ok(Some(Template::new(source, origin, tok)))
    }

    /// A built-in template by name (`chatml`, `gemma`, `llama3`), or a Jinja template's source
    /// (told apart by its `{{` or `{%`), checked to compile.
    pub fn named_or_source(spec: &str, tok: &Tokenizer) -> Result<Template, Error> {
        if spec.len() > MAX_SOURCE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "a chat template of {} bytes is longer than the limit of {MAX_SOURCE_BYTES}",
                spec.len()
            )));
        }
        if spec.contains("{{") || spec.contains("{%") {
            let t = Template::new(spec.to_string(), Origin::Custom, tok);
            environment().template_from_str(&t.source).map_err(|e| Error::InvalidArgument(format!("the chat template does not compile: {e}")))?;
            return Ok(t);
        }
        match BUILTINS.iter().find(|(name, _, _)| *name == spec.trim()) {
            Some((name, _, source)) => Ok(Template::new(source.to_string(), Origin::Builtin(name), tok)),
            None => {
                let names: Vec<&str> = BUILTINS.iter().map(|b| b.0).collect();
                Err(Error::InvalidArgument(format!(
                    "unknown chat template {:?}: the built-in ones are {}, or give a Jinja template's source",
                    spec.chars().take(64).collect::<String>(),
                    names.join(", ")
                )))
            }
        }
    }

    fn new(source: String, origin: Origin, tok: &Tokenizer) -> Template {
        let text = |id: Option<u32>| id.and_then(|id| tok.token_text(id)).unwrap_or_default().to_string();
        Template { source, origin, bos_token: text(tok.bos), eos_token: text(tok.eos) }
    }

    /// Renders `(role, content)` messages; with `add_generation_prompt`, ends with the opening
    /// of the assistant's turn.
    pub fn render(&self, messages: &[(String, String)], add_generation_prompt: bool) -> Result<String, Error> {
        let messages: Vec<Json> = messages.iter().map(|(role, content)| serde_json::json!({"role": role, "content": content})).collect();
        self.with_compiled(|template| self.render_with(template, messages, None, add_generation_prompt))
    }

    /// Renders a conversation given as JSON in OpenAI's chat shape, `{"messages": [...],
    /// "tools": [...]}` (the WIT `render-chat`), and says how the model will write its calls.
    /// Where the template renders no tools or writes its calls in a syntax this engine does not
    /// read, the tools, calls and results are written as text in the [`ToolSyntax::Hermes`]
    /// syntax ([`hermes_text`]).
    pub fn render_conversation(&self, conversation: &str, add_generation_prompt: bool) -> Result<(String, ToolSyntax), Error> {
        let (messages, tools) = conversation_from_json(conversation)?;
        let syntax = tool_syntax(&self.source);
        self.with_compiled(|template| {
            if tools.is_empty() {
                let text = self.render_with(template, messages, None, add_generation_prompt)?;
                return Ok((text, syntax.unwrap_or(ToolSyntax::Hermes)));
            }
            if let Some(syntax) = syntax.filter(|_| self.renders_tools(template)) {
                let text = self.render_with(template, messages, Some(tools), add_generation_prompt)?;
                return Ok((text, syntax));
            }
            let text = self.render_with(template, hermes_text(messages, &tools), None, add_generation_prompt)?;
            Ok((text, ToolSyntax::Hermes))
        })
    }

    /// `f` of the compiled template.
    fn with_compiled<R>(&self, f: impl FnOnce(&Compiled<'_, '_>) -> Result<R, Error>) -> Result<R, Error> {
        let env = environment();
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| Error::InvalidModel(format!("the chat template does not compile: {e}")))?;
        f(&template)
    }

    /// The rendering of `messages` (JSON objects) and `tools` (given to the template as `tools`
    /// where some), with a model's leading system message folded into the next message where
    /// the template never reads it.
    fn render_with(&self, template: &Compiled, mut messages: Vec<Json>, tools: Option<Vec<Json>>, add_generation_prompt: bool) -> Result<String, Error> {
        let first_is_system = messages.first().is_some_and(|m| m["role"] == "system");
        if first_is_system && self.origin != Origin::Custom && !self.reads_system_content(template) {
            // llama.cpp's `system_message_not_supported`: the system text opens the next message.
            let system = messages.remove(0);
            let system = system["content"].as_str().unwrap_or_default().to_string();
            if let Some(next) = messages.first_mut() {
                let content = next["content"].as_str().unwrap_or_default();
                next["content"] = Json::String(format!("{system}\n{content}"));
            }
        }
        let mut vars = self.variables(Value::from(Serde(&messages)), add_generation_prompt);
        if let Some(tools) = tools {
            vars = context! { tools => Value::from(Serde(&tools)), ..vars };
        }
        let mut out = Capped { text: Vec::new(), over: false };
        template.render_captured_to(vars, &mut out).map_err(|e| match out.over {
            true => Error::InvalidArgument(format!("the chat template's text is over the limit of {MAX_RENDERED_BYTES} bytes")),
            false => Error::InvalidArgument(format!("the chat template failed: {e}")),
        })?;
        String::from_utf8(out.text).map_err(|_| Error::InvalidArgument("the chat template's text is not UTF-8".into()))
    }

    /// Whether the template writes the tools it is given (llama.cpp's capability probe asks the
    /// same: a tool's name in the text).
    fn renders_tools(&self, template: &Compiled) -> bool {
        const NAME: &str = "wisp_probe_tool_name";
        let tool = serde_json::json!({"type": "function", "function": {"name": NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}}});
        let messages = vec![serde_json::json!({"role": "user", "content": "Hi"})];
        self.render_with(template, messages, Some(vec![tool]), true).is_ok_and(|t| t.contains(NAME))
    }

    /// The variables of a rendering, as llama.cpp's `common_chat_template_direct_apply` sets
    /// them: `add_generation_prompt` only when true, `tools` never.
    fn variables(&self, messages: Value, add_generation_prompt: bool) -> Value {
        let now = unix_now();
        let base = context! {
            messages => messages,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            enable_thinking => true,
            date_string => strftime("%d %b %Y", now),
            datetime => strftime("%b %d %Y", now),
        };
        match add_generation_prompt {
            true => context! { add_generation_prompt => true, ..base },
            false => base,
        }
    }

    /// Whether the template reads a system message's content, as llama.cpp's capability probe
    /// (common/jinja/caps.cpp) asks it of a system and a user message; a failing rendering
    /// still counts what it read.
    fn reads_system_content(&self, template: &Compiled) -> bool {
        let read = Arc::new(AtomicBool::new(false));
        let system = Value::from_object(Probe { role: "system", content: "System message", read: Some(read.clone()) });
        let user = Value::from_object(Probe { role: "user", content: "User message", read: None });
        let mut sink = Capped { text: Vec::new(), over: false };
        let _ = template.render_captured_to(self.variables(Value::from(vec![system, user]), false), &mut sink);
        read.load(Ordering::Relaxed)
    }
}

/// JSON as serde reads it.
type Json = serde_json::Value;

/// How a model writes its calls of tools (the WIT `tool-syntax`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call.
    Hermes,
    /// The whole reply is `{"name": ..., "parameters": {...}}`.
    Llama3Json,
}

/// The syntax a template writes its calls in, where it is one this engine reads: Hermes'
/// `<tool_call>` blocks (Qwen2.5), or Llama 3.x's `"parameters"` object.
fn tool_syntax(source: &str) -> Option<ToolSyntax> {
    if source.contains("<tool_call>") {
        Some(ToolSyntax::Hermes)
    } else if source.contains("\"parameters\"") && source.contains("<|start_header_id|>") {
        Some(ToolSyntax::Llama3Json)
    } else {
        None
    }
}

/// The most messages and tools a conversation given as JSON may hold.
pub const MAX_MESSAGES: usize = 4096;
pub const MAX_TOOLS: usize = 1024;

/// A conversation's messages and tools from its JSON (`render-chat`), checked: each message an
/// object with a string `role` and a `content` that is text (null or absent: empty; a list of
/// text parts is joined); a call's `arguments` given as JSON text become the value it spells.
fn conversation_from_json(conversation: &str) -> Result<(Vec<Json>, Vec<Json>), Error> {
    let bad = |why: String| Error::InvalidArgument(format!("the conversation: {why}"));
    let mut v: Json = serde_json::from_str(conversation).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Some(obj) = v.as_object_mut() else { return Err(bad("not a JSON object".into())) };
    let mut messages = match obj.remove("messages") {
        Some(Json::Array(m)) => m,
        _ => return Err(bad("no \"messages\" list".into())),
    };
    let tools = match obj.remove("tools") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(t)) => t,
        Some(_) => return Err(bad("\"tools\" is not a list".into())),
    };
    if messages.len() > MAX_MESSAGES || tools.len() > MAX_TOOLS {
        return Err(bad(format!("more than {MAX_MESSAGES} messages or {MAX_TOOLS} tools")));
    }
    for (i, t) in tools.iter().enumerate() {
        if !t["function"]["name"].is_string() {
            return Err(bad(format!("tools[{i}] has no function.name")));
        }
    }
    for (i, m) in messages.iter_mut().enumerate() {
        let Some(m) = m.as_object_mut() else { return Err(bad(format!("messages[{i}] is not an object"))) };
        if !m.get("role").is_some_and(Json::is_string) {
            return Err(bad(format!("messages[{i}] has no role")));
        }
        match m.get("content") {
            // No content (an assistant's calls alone) is empty text, as llama.cpp gives it: a
            // template may look inside it (Qwen3's `'</think>' in message.content`).
            None | Some(Json::Null) => {
                m.insert("content".into(), Json::String(String::new()));
            }
            Some(Json::String(_)) => {}
            Some(Json::Array(parts)) => {
                let text: Option<String> = parts.iter().map(|p| p["text"].as_str()).collect();
                let text = text.ok_or_else(|| bad(format!("messages[{i}].content has a part without text")))?;
                m.insert("content".into(), Json::String(text));
            }
            Some(_) => return Err(bad(format!("messages[{i}].content is not text"))),
        }
        if let Some(calls) = m.get_mut("tool_calls") {
            let Some(calls) = calls.as_array_mut() else { return Err(bad(format!("messages[{i}].tool_calls is not a list"))) };
            for call in calls {
                let f = &mut call["function"];
                if !f["name"].is_string() {
                    return Err(bad(format!("messages[{i}].tool_calls has a call without function.name")));
                }
                if let Some(args) = f["arguments"].as_str()
                    && let Ok(value) = serde_json::from_str::<Json>(args)
                {
                    f["arguments"] = value;
                }
            }
        }
    }
    Ok((messages, tools))
}

/// The conversation with its tools written as text, for a template that renders none: the
/// tools described in the system message (one is opened where there is none), each call of an
/// assistant's as a `<tool_call>` block after its text, and the results of tools (one after
/// another) as one user message of `<tool_response>` blocks.
pub fn hermes_text(messages: Vec<Json>, tools: &[Json]) -> Vec<Json> {
    let mut described = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        described.push('\n');
        described.push_str(&t.to_string());
    }
    described.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \
         \"arguments\": <args-json-object>}\n</tool_call>",
    );
    let mut out: Vec<Json> = Vec::with_capacity(messages.len() + 1);
    match messages.first() {
        Some(m) if m["role"] == "system" => {}
        _ => out.push(serde_json::json!({"role": "system", "content": ""})),
    }
    for mut m in messages {
        let role = m["role"].as_str().unwrap_or_default().to_string();
        let content = m["content"].as_str().unwrap_or_default().to_string();
        match role.as_str() {
            "system" if out.is_empty() => {
                let text = if content.is_empty() { described.clone() } else { format!("{content}\n\n{described}") };
                out.push(serde_json::json!({"role": "system", "content": text}));
            }
            "assistant" if m.get("tool_calls").is_some() => {
                let mut text = content;
                for call in m["tool_calls"].as_array().into_iter().flatten() {
                    let f = &call["function"];
                    let call = serde_json::json!({"name": f["name"], "arguments": f["arguments"]});
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                out.push(serde_json::json!({"role": "assistant", "content": text}));
            }
            "tool" => {
                let block = format!("<tool_response>\n{content}\n</tool_response>");
                match out.last_mut() {
                    Some(last) if last["role"] == "user" && last.get("wisp_tool_results").is_some() => {
                        let joined = format!("{}\n{block}", last["content"].as_str().unwrap_or_default());
                        last["content"] = Json::String(joined);
                    }
                    _ => out.push(serde_json::json!({"role": "user", "content": block, "wisp_tool_results": true})),
                }
            }
            _ => {
                if let Some(obj) = m.as_object_mut() {
                    obj.remove("tool_calls");
                }
                out.push(m);
            }
        }
    }
    if out[0]["content"] == "" {
        out[0]["content"] = Json::String(described);
    }
    for m in &mut out {
        if let Some(obj) = m.as_object_mut() {
            obj.remove("wisp_tool_results");
        }
    }
    out
}

/// A message of the capability probe: says (`read`) when its content is looked at.
#[derive(Debug)]
struct Probe {
    role: &'static str,
    content: &'static str,
    read: Option<Arc<AtomicBool>>,
}

impl Object for Probe {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(Value::from(self.role)),
            "content" => {
                if let Some(read) = &self.read {
                    read.store(true, Ordering::Relaxed);
                }
                Some(Value::from(self.content))
            }
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

/// Seconds since the Unix epoch by the wall clock (0 where there is none).
fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// C's `strftime` of a UTC time for the conversions chat templates use (`%Y %y %m %d %e %j %H %I
/// %M %S %p %a %A %b %B %Z %z %%`); any other is kept as written. UTC where llama.cpp takes
/// the local time zone: a component has none.
fn strftime(format: &str, unix: i64) -> String {
    const DAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
    const MONTHS: [&str; 12] =
        ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    let (days, secs) = (unix.div_euclid(86_400), unix.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let weekday = (days + 4).rem_euclid(7) as usize;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        let text = match spec {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:2}"),
            'j' => format!("{yday:03}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{:02}", (hour + 11) % 12 + 1),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'a' => DAYS[weekday][..3].to_string(),
            'A' => DAYS[weekday].to_string(),
            'b' | 'h' => MONTHS[month as usize - 1][..3].to_string(),
            'B' => MONTHS[month as usize - 1].to_string(),
            'Z' => "UTC".to_string(),
            'z' => "+0000".to_string(),
            '%' => "%".to_string(),
            other => format!("%{other}"),
        };
        out.push_str(&text);
    }
    out
}

/// The proleptic Gregorian (year, month, day) of a day count from 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// The day count from 1970-01-01 of a proleptic Gregorian date (the inverse of
/// [`civil_from_days`]).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The longest text a chat template may render (a prompt far past any model's context).
pub const MAX_RENDERED_BYTES: usize = 16 << 20;

/// The instructions a template may run for one rendering (minijinja's fuel): a conversation
/// of thousands of messages takes a few hundred thousand; a template that loops without end
/// fails instead.
pub const FUEL: u64 = 20_000_000;

/// A rendering's text, refusing to grow past [`MAX_RENDERED_BYTES`].
struct Capped {
    text: Vec<u8>,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > MAX_RENDERED_BYTES {
            self.over = true;
            return Err(std::io::Error::other("over the limit"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// llama.cpp's (and Hugging Face's) environment: `trim_blocks`, `lstrip_blocks`, Python string
/// methods, `raise_exception`, `strftime_now`.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    match SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build() {
        Ok(syntax) => env.set_syntax(syntax),
        Err(_) => unreachable!("the default delimiters are valid"),
    }
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<Value, minijinja::Error> {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |format: String| strftime(&format, unix_now()));
    env.add_filter("tojson", tojson);
    env
}

/// Hugging Face's `tojson` (Python's `json.dumps` with `ensure_ascii=False`): `", "` between
/// items and `": "` after keys, or with `indent`, each item on its own line; no HTML escaping
/// (minijinja's own `tojson` writes compact, HTML-safe JSON, which no model was trained on).
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let failed = |e: serde_json::Error| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string());
    let mut json = serde_json::to_value(&value).map_err(failed)?;
    if sort_keys == Some(true) {
        sort(&mut json);
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PyFormatter { indent, level: 0, has_value: false });
    serde::Serialize::serialize(&json, &mut ser).map_err(failed)?;
    Ok(Value::from_safe_string(String::from_utf8_lossy(&out).into_owned()))
}

/// Every object's keys in order, at every depth (`sort_keys=True`).
fn sort(v: &mut Json) {
    match v {
        Json::Object(map) => {
            let mut entries: Vec<(String, Json)> = std::mem::take(map).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut v) in entries {
                sort(&mut v);
                map.insert(k, v);
            }
        }
        Json::Array(items) => items.iter_mut().for_each(sort),
        _ => {}
    }
}

/// Python's `json.dumps` layout (see [`tojson`]).
struct PyFormatter {
    indent: Option<usize>,
    level: usize,
    has_value: bool,
}

impl PyFormatter {
    fn item<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }

    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(n) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..n * self.level {
                w.write_all(b" ")?;
            }
        }
        Ok(())
    }

    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, c: &[u8]) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(c)
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"[")
    }

    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }

    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.item(w, first)
    }

    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"{")
    }

    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.item(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }

    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_dates_as_c_does() {
        // 2024-07-26 13:05:09 UTC, a Friday, the 208th day of a leap year.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%B %d, %Y", t), "July 26, 2024");
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S %a %A %j %I%p %y %e %%%Q", t), "2024-07-26 13:05:09 Fri Friday 208 01PM 24 26 %%Q");
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime("%Y-%m-%d", -86_400), "1969-12-31");
        for days in [-1_000_000, -1, 0, 59, 10_956, 20_000, 1_000_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn a_file_template_that_never_reads_the_system_message_gets_it_in_the_next() {
        let file = |source: &str| Template { source: source.into(), origin: Origin::File, bos_token: "".into(), eos_token: "".into() };
        let msgs = |pairs: &[(&str, &str)]| pairs.iter().map(|(r, c)| (r.to_string(), c.to_string())).collect::<Vec<_>>();
        let two = msgs(&[("system", "Be brief."), ("user", "Hi")]);
        let ignores = file("{% for m in messages %}[{{ m.role }}] {{ m.content if m.role != 'system' }}{% endfor %}");
        assert_eq!(ignores.render(&two, false).unwrap(), "[user] Be brief.\nHi");
        assert_eq!(ignores.render(&msgs(&[("system", "Be brief.")]), false).unwrap(), "");
        let reads = file("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}");
        assert_eq!(reads.render(&two, false).unwrap(), "[system] Be brief.[user] Hi");
        let raises = file("{% if messages[0].role == 'system' %}{{ raise_exception('no') }}{% endif %}ok");
        assert_eq!(raises.render(&two, false).unwrap(), "ok");
        // A host's own template renders as written.
        let custom = Template { origin: Origin::Custom, ..raises };
        assert!(matches!(custom.render(&two, false), Err(Error::InvalidArgument(e)) if e.contains("no")));
    }

    fn template(source: &str) -> Template {
        Template { source: source.into(), origin: Origin::File, bos_token: "<s>".into(), eos_token: "</s>".into() }
    }

    /// A conversation with a tool, a call of it (its arguments as JSON text) and its result.
    const CONVERSATION: &str = r#"{"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}],
      "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}"#;

    #[test]
    fn a_template_that_takes_tools_renders_them_and_says_its_syntax() {
        let qwen = template(include_str!("../../tests/chat/templates/Qwen-Qwen2.5-7B-Instruct.jinja"));
        let (text, syntax) = qwen.render_conversation(CONVERSATION, true).unwrap();
        assert_eq!(syntax, ToolSyntax::Hermes);
        assert!(text.contains("<tools>") && text.contains("\"name\": \"get_weather\""), "{text}");
        // The call's arguments are the object their text spells, not a string.
        assert!(text.contains("\"arguments\": {\"city\": \"Paris\"}"), "{text}");
        assert!(text.contains(r#"{"type": "function", "function": {"name": "get_weather""#), "{text}");
        assert!(text.contains("<tool_response>\n18 C\n</tool_response>"), "{text}");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
        let llama = template(include_str!("../../tests/chat/templates/meta-llama-Llama-3.1-8B-Instruct.jinja"));
        let one_result = CONVERSATION.replace(r#",
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}"#, "");
        let (text, syntax) = llama.render_conversation(&one_result, true).unwrap();
        assert_eq!(syntax, ToolSyntax::Llama3Json);
        assert!(text.contains("get_weather") && text.contains("\"parameters\": {\"city\": \"Paris\"}"), "{text}");
        // Without tools: the text `render` gives, and the template's syntax.
        let plain = r#"{"messages": [{"role": "user", "content": "Hi"}]}"#;
        let (text, syntax) = qwen.render_conversation(plain, true).unwrap();
        assert_eq!(text, qwen.render(&[("user".into(), "Hi".into())], true).unwrap());
        assert_eq!(syntax, ToolSyntax::Hermes);
    }

    #[test]
    fn a_template_without_tools_gets_them_as_text() {
        let gemma = Template { origin: Origin::Builtin("gemma"), ..template(GEMMA) };
        let (text, syntax) = gemma.render_conversation(CONVERSATION, true).unwrap();
        assert_eq!(syntax, ToolSyntax::Hermes);
        // Gemma reads no system turn of its own: the description opens the first user turn;
        // the results of the two tools are one user turn, so the roles still alternate.
        assert!(text.starts_with("<s><start_of_turn>user\nBe brief.\n\n# Tools"), "{text}");
        assert!(text.contains("\"name\":\"get_weather\""), "{text}");
        assert!(text.contains("<start_of_turn>model\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call><end_of_turn>"), "{text}");
        assert!(text.contains("<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response><end_of_turn>"), "{text}");
        assert!(text.ends_with("<start_of_turn>model\n"), "{text}");
    }

    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let env = environment();
        let v = serde_json::json!({"b": [1, 2.5, "é<"], "a": {}, "c": []});
        let render = |src: &str| env.render_str(src, context! { v => Value::from(Serde(&v)) }).unwrap();
        assert_eq!(render("{{ v | tojson }}"), r#"{"b": [1, 2.5, "é<"], "a": {}, "c": []}"#);
        assert_eq!(render("{{ v | tojson(sort_keys=true) }}"), r#"{"a": {}, "b": [1, 2.5, "é<"], "c": []}"#);
        assert_eq!(render("{{ v | tojson(indent=2) }}"), "{\n  \"b\": [\n    1,\n    2.5,\n    \"é<\"\n  ],\n  \"a\": {},\n  \"c\": []\n}");
        assert_eq!(render(r#"{{ 'x"y' | tojson }}"#), r#""x\"y""#);
    }

    #[test]
    fn a_conversation_that_is_not_one_is_refused() {
        let qwen = template(CHATML);
        for bad in ["[]", "{}", r#"{"messages": [1]}"#, r#"{"messages": [{"content": "x"}]}"#, r#"{"messages": [], "tools": {}}"#,
            r#"{"messages": [{"role": "user", "content": 3}]}"#, r#"{"messages": [], "tools": [{"type": "function"}]}"#, "not json"] {
            assert!(matches!(qwen.render_conversation(bad, true), Err(Error::InvalidArgument(_))), "{bad}");
        }
    }
}
