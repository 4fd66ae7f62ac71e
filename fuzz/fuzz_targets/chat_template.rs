//! Chat templates from hostile GGUF metadata (`tokenizer.chat_template`) and from hosts
//! (`set-chat-template`), rendered over a few conversations: a template either fails with an
//! error or renders, in bounded time and memory (minijinja's fuel and recursion limits, the cap
//! on a rendering's text; run with -timeout and -rss_limit_mb), never a panic. The input is the
//! template's source, so that real templates seed the corpus.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use wisp_fuzz::{Meta, gguf, small_tokenizer};
use wisp_guest::chat::Template;
use wisp_guest::gguf::Gguf;
use wisp_guest::tokenizer::Tokenizer;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(small_tokenizer)
}

fn conversations() -> Vec<(Vec<(String, String)>, bool)> {
    let m = |pairs: &[(&str, &str)]| pairs.iter().map(|(r, c)| (r.to_string(), c.to_string())).collect::<Vec<_>>();
    vec![
        (m(&[("user", "Hi")]), true),
        (m(&[("system", "Be brief."), ("user", "2+2?"), ("assistant", "4"), ("user", "{{ and %}")]), false),
        (Vec::new(), true),
    ]
}

fuzz_target!(|data: &[u8]| {
    let Ok(source) = std::str::from_utf8(data) else { return };
    let from_host = Template::named_or_source(source, tokenizer()).ok();
    let bytes = gguf(&[("tokenizer.chat_template", Meta::Str(source.to_string()))]);
    let g = match Gguf::parse(&bytes) {
        Ok(g) => g,
        Err(e) => panic!("the writer's GGUF does not parse: {e}"),
    };
    let from_file = match Template::from_gguf(&g, tokenizer()) {
        Ok(Some(t)) => Some(t),
        Ok(None) => panic!("a file with a template has none"),
        Err(_) => None,
    };
    for template in from_host.iter().chain(&from_file) {
        for (messages, add_generation_prompt) in conversations() {
            let _ = template.render(&messages, add_generation_prompt);
        }
    }
});
