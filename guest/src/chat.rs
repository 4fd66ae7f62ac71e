//! Chat templates: a conversation rendered to prompt text by the model's own Jinja template
//! (`tokenizer.chat_template`), as Hugging Face's `apply_chat_template` does it (minijinja with
//! `trim_blocks` and `lstrip_blocks`, Python string methods, `raise_exception`, `bos_token`,
//! `eos_token`). A Gemma file without a template gets Gemma's own, built in.

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

/// A model's chat template and the special-token texts it may refer to.
#[derive(Debug, Clone)]
pub struct Template {
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
}

impl Template {
    /// The file's template, or a built-in one for a family that is known without one.
    pub fn from_gguf(g: &Gguf, tok: &Tokenizer) -> Result<Option<Template>, String> {
        let source = match g.get_str("tokenizer.chat_template")? {
            Some(s) => s.to_string(),
            None if tok.token_id("<start_of_turn>").is_some() => GEMMA.to_string(),
            None => return Ok(None),
        };
        let text = |id: Option<u32>| id.and_then(|id| tok.token_text(id)).unwrap_or_default().to_string();
        Ok(Some(Template { source, bos_token: text(tok.bos), eos_token: text(tok.eos) }))
    }

    /// Renders `(role, content)` messages; with `add_generation_prompt`, ends with the opening
    /// of the assistant's turn.
    pub fn render(&self, messages: &[(String, String)], add_generation_prompt: bool) -> Result<String, Error> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.map_err(|e| Error::InvalidModel(format!("chat template syntax: {e}")))?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| Error::InvalidModel(format!("the chat template does not compile: {e}")))?;
        let messages: Vec<Value> =
            messages.iter().map(|(role, content)| context! { role => role, content => content }).collect();
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| Error::InvalidArgument(format!("the chat template failed: {e}")))
    }
}
