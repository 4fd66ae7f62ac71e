//! Chat templates: a conversation rendered to prompt text by the model's own Jinja template
//! (`tokenizer.chat_template`), as Hugging Face's `apply_chat_template` does it (minijinja with
//! `trim_blocks` and `lstrip_blocks`, Python string methods, `raise_exception`, `bos_token`,
//! `eos_token`). A file without a template gets the built-in template of its family when its
//! vocabulary names the family's turn markers (Gemma's `<start_of_turn>`, ChatML's
//! `<|im_start|>`, Llama 3's `<|start_header_id|>`), and says so (`Origin::Builtin`); a host can
//! set another (`set-chat-template`).

use crate::engine::Error;
use crate::gguf::Gguf;
use crate::tokenizer::Tokenizer;
use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, ErrorKind, Value, context};

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
        let messages: Vec<Value> =
            messages.iter().map(|(role, content)| context! { role => role, content => content }).collect();
        let mut out = Capped { text: Vec::new(), over: false };
        template
            .render_captured_to(
                context! {
                    messages => messages,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => &self.bos_token,
                    eos_token => &self.eos_token,
                },
                &mut out,
            )
            .map_err(|e| match out.over {
                true => Error::InvalidArgument(format!("the chat template's text is over the limit of {MAX_RENDERED_BYTES} bytes")),
                false => Error::InvalidArgument(format!("the chat template failed: {e}")),
            })?;
        String::from_utf8(out.text).map_err(|_| Error::InvalidArgument("the chat template's text is not UTF-8".into()))
    }
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

/// Hugging Face's environment: `trim_blocks`, `lstrip_blocks`, Python string methods,
/// `raise_exception`.
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
    env
}
