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
use minijinja::value::{Enumerator, Object};
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
        let env = environment();
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| Error::InvalidModel(format!("the chat template does not compile: {e}")))?;
        let mut messages: Vec<(String, String)> = messages.to_vec();
        let first_is_system = messages.first().is_some_and(|(role, _)| role == "system");
        if first_is_system && self.origin != Origin::Custom && !self.reads_system_content(&template) {
            // llama.cpp's `system_message_not_supported`: the system text opens the next message.
            let (_, system) = messages.remove(0);
            if let Some((_, next)) = messages.first_mut() {
                *next = format!("{system}\n{next}");
            }
        }
        let messages: Vec<Value> =
            messages.iter().map(|(role, content)| context! { role => role, content => content }).collect();
        let mut out = Capped { text: Vec::new(), over: false };
        template
            .render_captured_to(self.variables(Value::from(messages), add_generation_prompt), &mut out)
            .map_err(|e| match out.over {
                true => Error::InvalidArgument(format!("the chat template's text is over the limit of {MAX_RENDERED_BYTES} bytes")),
                false => Error::InvalidArgument(format!("the chat template failed: {e}")),
            })?;
        String::from_utf8(out.text).map_err(|_| Error::InvalidArgument("the chat template's text is not UTF-8".into()))
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
    env
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
}
