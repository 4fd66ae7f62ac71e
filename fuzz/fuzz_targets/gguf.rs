//! The GGUF reader and the model loader on arbitrary bytes: errors, never panics, and no
//! allocation beyond what the input can justify (libFuzzer's -rss_limit_mb catches that).
//!
//! Every input is parsed; only those that parse and whose tensors hold at most
//! [`MAX_LOAD_ELEMENTS`] values are loaded, so that an input's cost is its parse plus, for the
//! few that get that far, converting kilobytes of weights (the seeds, `seeds/gguf.py`, are
//! complete models of ~15 KB). The loader's refusals of large models are the unit tests'
//! (`guest/tests/gguf_hostile.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use wisp_guest::engine::Model;
use wisp_guest::gguf::Gguf;

/// The most tensor values an input may declare and still be loaded.
const MAX_LOAD_ELEMENTS: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::parse(data) else { return };
    let elements = g.tensors.iter().map(|t| t.n_elements).fold(0u64, u64::saturating_add);
    if elements <= MAX_LOAD_ELEMENTS {
        let _ = Model::load(data);
    }
});
