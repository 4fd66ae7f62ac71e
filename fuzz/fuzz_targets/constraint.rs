//! Client-supplied JSON schemas, regular expressions and Lark grammars (the first byte picks
//! which, the rest is its text) compiled against a vocabulary, then walked a few steps by tokens
//! they allow: each is refused with an error (over the size cap, not compiling, too complex) or
//! yields masks, in bounded time (llguidance's lexer fuel and item limits), never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};
use wisp_fuzz::small_tokenizer;
use wisp_guest::constraint::{Allowed, Grammars, Spec};

fn grammars() -> &'static (Grammars, usize) {
    static G: OnceLock<(Grammars, usize)> = OnceLock::new();
    G.get_or_init(|| {
        let t = Arc::new(small_tokenizer());
        let n = t.n_vocab();
        match Grammars::new(&t) {
            Ok(g) => (g, n),
            Err(e) => panic!("the small vocabulary's grammars: {e}"),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, text)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(text) else { return };
    let (grammars, n) = grammars();
    let spec = match kind % 3 {
        0 => Spec::JsonSchema(text.to_string()),
        1 => Spec::Regex(text.to_string()),
        _ => Spec::Lark(text.to_string()),
    };
    let Ok(mut constraint) = grammars.compile(&spec) else { return };
    let logits = vec![0.0f32; *n];
    // A few steps, each taking one of the allowed tokens (spread over them by the step).
    for step in 0..8usize {
        let allowed: Vec<u32> = match constraint.allowed(&logits) {
            Ok(Allowed::Logits(masked)) => {
                assert_eq!(masked.len(), *n);
                (0..*n as u32).filter(|&t| masked[t as usize].is_finite()).collect()
            }
            Ok(Allowed::None) | Err(_) => return,
        };
        if allowed.is_empty() || constraint.consume(allowed[(step * 7919 + kind as usize) % allowed.len()]).is_err() {
            return;
        }
    }
});
