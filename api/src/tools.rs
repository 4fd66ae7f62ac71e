//! Tool calls: a request's `tools` and `tool_choice` read and checked, the grammar that makes
//! a model's calls parse and validate (llguidance's Lark, with each tool's parameters as a
//! `%json` schema), and the calls read back out of the text the model wrote.
//!
//! The calls are written in the syntax the model's chat template uses ([`ToolSyntax`]: the
//! engine's `render-chat` says which). With `tool_choice: "required"` or a named function the
//! constraint holds from the first token; with `"auto"` the model writes freely until it opens
//! a call (the syntax's trigger), and from there the constraint holds (a lazy grammar): the
//! caller rewinds the session to where the call began ([`Reply`](crate::Reply) says where) and
//! constrains it with [`Tools::grammar`], so a call, once started, always parses and validates.

use crate::ApiError;
use serde_json::{Value, json};

/// The most tools a request may carry.
pub const MAX_TOOLS: usize = 128;
/// The longest function name (OpenAI's limit).
pub const MAX_NAME: usize = 64;

/// How a model writes its calls (the engine's `tool-syntax`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>` blocks after any text.
    Hermes,
    /// The whole reply is one `{"name": NAME, "parameters": {...}}`.
    Llama3Json,
}

/// Which calls a reply must make (`tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// No call: the tools are still shown to the model (OpenAI's `none`).
    None,
    /// The model decides; a call, once opened, is constrained.
    Auto,
    /// At least one call, from the first token.
    Required,
    /// A call of this function, from the first token.
    Named(String),
}

/// A request's tools, as checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// OpenAI's list as the template gets it (`[{"type": "function", "function": {...}}]`).
    pub list: Vec<Value>,
    pub choice: Choice,
    /// More than one call in a reply (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

/// One call read out of a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The arguments as compact JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

impl Call {
    /// The call as OpenAI's `tool_calls` lists it; `index` for a streamed delta.
    pub fn json(&self, index: Option<usize>) -> Value {
        let mut v = json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}});
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

impl Tools {
    /// `tools`, `tool_choice` and `parallel_tool_calls` of a request; `None` where it has no
    /// tools (then a `tool_choice` other than `none` or `auto` is refused, as OpenAI does).
    pub fn read(tools: Option<&Vec<Value>>, choice: Option<&Value>, parallel: Option<bool>) -> Result<Option<Tools>, ApiError> {
        let list = tools.cloned().unwrap_or_default();
        let choice = match choice {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s == "none" => Some(Choice::None),
            Some(Value::String(s)) if s == "auto" => Some(Choice::Auto),
            Some(Value::String(s)) if s == "required" => Some(Choice::Required),
            Some(v) => match v["function"]["name"].as_str().filter(|_| v.get("type").is_none_or(|t| t == "function")) {
                Some(name) => Some(Choice::Named(name.to_string())),
                None => {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        "tool_choice is \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ));
                }
            },
        };
        if list.is_empty() {
            return match choice {
                None | Some(Choice::None | Choice::Auto) => Ok(None),
                Some(_) => Err(ApiError::invalid_param("tool_choice", "tool_choice needs tools")),
            };
        }
        if list.len() > MAX_TOOLS {
            return Err(ApiError::invalid_param("tools", format!("{} tools; at most {MAX_TOOLS}", list.len())));
        }
        let mut names: Vec<&str> = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let param = format!("tools[{i}]");
            if t.get("type").is_some_and(|k| k != "function") {
                return Err(ApiError::invalid_param(&param, "a tool's type is \"function\""));
            }
            let f = &t["function"];
            let Some(name) = f["name"].as_str() else {
                return Err(ApiError::invalid_param(&format!("{param}.function.name"), "a tool needs function.name"));
            };
            let valid = !name.is_empty() && name.len() <= MAX_NAME && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid {
                return Err(ApiError::invalid_param(
                    &format!("{param}.function.name"),
                    format!("a function's name is 1 to {MAX_NAME} of a-z, A-Z, 0-9, _ and -, not {:?}", name.chars().take(80).collect::<String>()),
                ));
            }
            if names.contains(&name) {
                return Err(ApiError::invalid_param(&format!("{param}.function.name"), format!("two tools are named {name:?}")));
            }
            names.push(name);
            if f.get("parameters").is_some_and(|p| !(p.is_object() || p.is_null())) {
                return Err(ApiError::invalid_param(&format!("{param}.function.parameters"), "a function's parameters are a JSON schema object"));
            }
        }
        if let Some(Choice::Named(name)) = &choice
            && !names.contains(&name.as_str())
        {
            return Err(ApiError::invalid_param("tool_choice", format!("tool_choice names {name:?}, which is not among the tools")));
        }
        let tools = Tools { list, choice: choice.unwrap_or(Choice::Auto), parallel: parallel.unwrap_or(true) };
        let len = tools.grammar(ToolSyntax::Hermes).len();
        if len > crate::MAX_CONSTRAINT_BYTES {
            return Err(ApiError::invalid_param(
                "tools",
                format!("the grammar of the tools' calls is {len} bytes, over the limit of {}", crate::MAX_CONSTRAINT_BYTES),
            ));
        }
        Ok(Some(tools))
    }

    /// Whether the reply is constrained to calls from its first token.
    pub fn forced(&self) -> bool {
        matches!(self.choice, Choice::Required | Choice::Named(_))
    }

    /// The tools a call may name: all, or the one `tool_choice` names.
    fn callable(&self) -> impl Iterator<Item = (&str, Value)> {
        self.list.iter().filter_map(move |t| {
            let name = t["function"]["name"].as_str()?;
            let named = match &self.choice {
                Choice::Named(n) => n == name,
                _ => true,
            };
            let params = t["function"].get("parameters").filter(|p| p.is_object()).cloned();
            named.then(|| (name, params.unwrap_or_else(|| json!({"type": "object", "properties": {}}))))
        })
    }

    /// The Lark grammar of a reply that is calls, from the call's opening on: in `syntax`, each
    /// call one of the tools (a JSON object with its name and arguments that validate against
    /// its parameters), one call or, with `parallel` (Hermes only), one or more.
    pub fn grammar(&self, syntax: ToolSyntax) -> String {
        let key = match syntax {
            ToolSyntax::Hermes => "arguments",
            ToolSyntax::Llama3Json => "parameters",
        };
        let mut rules = String::new();
        let mut alternatives = Vec::new();
        for (i, (name, mut params)) in self.callable().enumerate() {
            let mut schema = json!({
                "type": "object",
                "properties": {"name": {"const": name}},
                "required": ["name", key],
                "additionalProperties": false,
            });
            // The parameters' definitions go to the root of the call's schema, where their
            // references (`#/$defs/...`, as pydantic writes them) point.
            for defs in ["$defs", "definitions"] {
                if let Some(d) = params.as_object_mut().and_then(|p| p.remove(defs)) {
                    schema[defs] = d;
                }
            }
            schema["properties"][key] = params;
            rules.push_str(&format!("tool_{i}: %json {schema}\n"));
            alternatives.push(format!("tool_{i}"));
        }
        let body = alternatives.join(" | ");
        match syntax {
            ToolSyntax::Hermes => {
                let more = if self.parallel { " (\"\\n\" call)*" } else { "" };
                format!("start: call{more}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: {body}\n{rules}")
            }
            ToolSyntax::Llama3Json => format!("start: {body}\n{rules}"),
        }
    }
}

/// The text that opens a call anywhere in a reply in `syntax` under `tool_choice: "auto"`:
/// Hermes' `<tool_call>`. (A reply may also open with a call: [`opens_with_call`].)
pub fn trigger(syntax: ToolSyntax) -> Option<&'static str> {
    match syntax {
        ToolSyntax::Hermes => Some("<tool_call>"),
        ToolSyntax::Llama3Json => None,
    }
}

/// The longest start of a reply held back to learn whether it opens with a call.
pub const MAX_LEAD: usize = 64 + MAX_NAME;

/// Whether a reply whose text so far is `text` opens with a call of one of `names`, as
/// llama.cpp's lazy grammars read one (white space aside): `{"name": "NAME"`, bare or, in the
/// Hermes syntax, inside a code fence (```` ```json ````), as small models write their calls.
/// `Some(true)`: it does, `Some(false)`: it cannot, `None`: not known yet.
pub fn opens_with_call(syntax: ToolSyntax, names: &[String], text: &str) -> Option<bool> {
    let fences: &[&str] = match syntax {
        ToolSyntax::Hermes => &["", "```json", "```xml", "```"],
        ToolSyntax::Llama3Json => &[""],
    };
    let bare: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let mut undecided = false;
    for fence in fences {
        for name in names {
            let opening = format!("{fence}{{\"name\":\"{name}\"");
            if bare.starts_with(&opening) {
                return Some(true);
            }
            undecided |= opening.starts_with(&bare);
        }
    }
    if undecided && text.len() <= MAX_LEAD { None } else { Some(false) }
}

impl Tools {
    /// The names a call may name.
    pub fn names(&self) -> Vec<String> {
        self.callable().map(|(name, _)| name.to_string()).collect()
    }
}

/// The calls in the text of a reply's calls (from the first call's opening on), each with a new
/// id; `None` where the text is not calls (a reply cut short by its token budget).
pub fn parse_calls(text: &str, syntax: ToolSyntax, ids: &mut impl FnMut() -> String) -> Option<Vec<Call>> {
    let read = |json: &str, key: &str, ids: &mut dyn FnMut() -> String| -> Option<Call> {
        let v: Value = serde_json::from_str(json.trim()).ok()?;
        let name = v["name"].as_str()?.to_string();
        let arguments = v.get(key)?.to_string();
        Some(Call { id: ids(), name, arguments })
    };
    match syntax {
        ToolSyntax::Llama3Json => Some(vec![read(text, "parameters", ids)?]),
        ToolSyntax::Hermes => {
            let mut calls = Vec::new();
            let mut rest = text.trim_start();
            while !rest.is_empty() {
                let body = rest.strip_prefix("<tool_call>")?;
                let end = body.find("</tool_call>")?;
                calls.push(read(&body[..end], "arguments", ids)?);
                rest = body[end + "</tool_call>".len()..].trim_start();
            }
            (!calls.is_empty()).then_some(calls)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: &str, parallel: bool) -> Tools {
        let list = vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "now"}}),
        ];
        let choice: Value = serde_json::from_str(choice).unwrap();
        Tools::read(Some(&list), Some(&choice), Some(parallel)).unwrap().unwrap()
    }

    #[test]
    fn tools_and_tool_choice_are_read_and_checked() {
        assert_eq!(tools("\"auto\"", true).choice, Choice::Auto);
        assert_eq!(tools(r#"{"type": "function", "function": {"name": "now"}}"#, true).choice, Choice::Named("now".into()));
        assert!(tools("\"required\"", true).forced() && !tools("\"none\"", true).forced());
        assert_eq!(Tools::read(None, None, None), Ok(None));
        assert_eq!(Tools::read(Some(&vec![]), Some(&json!("auto")), None), Ok(None));
        let f = |name: &str| json!({"type": "function", "function": {"name": name}});
        let bad: Vec<(Vec<Value>, Value, &str)> = vec![
            (vec![], json!("required"), "tool_choice"),
            (vec![f("a")], json!("sometimes"), "tool_choice"),
            (vec![f("a")], json!({"type": "function", "function": {"name": "b"}}), "tool_choice"),
            (vec![f("a b")], json!("auto"), "tools[0].function.name"),
            (vec![f(&"x".repeat(65))], json!("auto"), "tools[0].function.name"),
            (vec![f("a"), f("a")], json!("auto"), "tools[1].function.name"),
            (vec![json!({"type": "function"})], json!("auto"), "tools[0].function.name"),
            (vec![json!({"type": "retrieval", "function": {"name": "a"}})], json!("auto"), "tools[0]"),
            (vec![json!({"type": "function", "function": {"name": "a", "parameters": 3}})], json!("auto"), "tools[0].function.parameters"),
            ((0..=MAX_TOOLS).map(|i| f(&format!("t{i}"))).collect(), json!("auto"), "tools"),
            (vec![json!({"type": "function", "function": {"name": "a", "parameters": {"description": "x".repeat(crate::MAX_CONSTRAINT_BYTES)}}})], json!("auto"), "tools"),
        ];
        for (list, choice, param) in bad {
            let e = Tools::read(Some(&list), Some(&choice), None).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{e:?}");
        }
    }

    #[test]
    fn the_grammar_names_each_callable_tool_with_its_parameters() {
        let g = tools("\"required\"", true).grammar(ToolSyntax::Hermes);
        assert!(g.starts_with("start: call (\"\\n\" call)*\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: tool_0 | tool_1\n"), "{g}");
        assert!(g.contains(r#"tool_0: %json {"type":"object","properties":{"name":{"const":"get_weather"},"arguments":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}"#), "{g}");
        assert!(g.contains(r#""name":{"const":"now"},"arguments":{"type":"object","properties":{}}"#), "{g}");
        // Definitions move to the root, where `#/$defs/...` points.
        let list = vec![json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}})];
        let g = Tools::read(Some(&list), None, None).unwrap().unwrap().grammar(ToolSyntax::Hermes);
        assert!(g.contains(r##""arguments":{"type":"object","properties":{"p":{"$ref":"#/$defs/P"}}}},"required":["name","arguments"],"additionalProperties":false,"$defs":{"P":{"type":"integer"}}}"##), "{g}");
        let one = tools(r#"{"type": "function", "function": {"name": "now"}}"#, false).grammar(ToolSyntax::Llama3Json);
        assert!(one.starts_with("start: tool_0\ntool_0: %json ") && one.contains(r#""parameters":{"#) && !one.contains("get_weather"), "{one}");
    }

    #[test]
    fn calls_are_read_back_with_compact_arguments() {
        let mut n = 0;
        let mut ids = || {
            n += 1;
            format!("call_{n}")
        };
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"now\",\"arguments\":{}}\n</tool_call>";
        let calls = parse_calls(text, ToolSyntax::Hermes, &mut ids).unwrap();
        assert_eq!(calls[0], Call { id: "call_1".into(), name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() });
        assert_eq!((calls[1].name.as_str(), calls[1].arguments.as_str()), ("now", "{}"));
        assert_eq!(calls[1].json(Some(1))["function"]["arguments"], "{}");
        let llama = parse_calls(r#"{"name": "now", "parameters": {"tz": "UTC"}}"#, ToolSyntax::Llama3Json, &mut ids).unwrap();
        assert_eq!(llama[0].arguments, r#"{"tz":"UTC"}"#);
        // Cut short: no calls.
        assert_eq!(parse_calls("<tool_call>\n{\"name\": \"now\", \"argu", ToolSyntax::Hermes, &mut ids), None);
        assert_eq!(parse_calls("", ToolSyntax::Hermes, &mut ids), None);
        let names = ["w".to_string(), "now".to_string()];
        let opens = |s, t| opens_with_call(s, &names, t);
        assert_eq!((opens(ToolSyntax::Llama3Json, "  \n"), opens(ToolSyntax::Llama3Json, " {\"name\": \"now\""), opens(ToolSyntax::Llama3Json, "Sure")), (None, Some(true), Some(false)));
        assert_eq!(opens(ToolSyntax::Hermes, "```json\n{\n  \"name\": \"w\""), Some(true));
        assert_eq!((opens(ToolSyntax::Hermes, "```"), opens(ToolSyntax::Hermes, "{ \"na"), opens(ToolSyntax::Hermes, "{\"name\": \"n")), (None, None, None));
        // Another name, another fence, other text: no call.
        assert_eq!(opens(ToolSyntax::Hermes, "{\"name\": \"say_hello\""), Some(false));
        assert_eq!((opens(ToolSyntax::Hermes, "```python"), opens(ToolSyntax::Hermes, "{\"x\"")), (Some(false), Some(false)));
        assert_eq!(tools("\"auto\"", true).names(), ["get_weather", "now"]);
        assert_eq!(trigger(ToolSyntax::Hermes), Some("<tool_call>"));
    }
}
