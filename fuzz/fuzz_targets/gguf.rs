//! The GGUF reader and the model loader on arbitrary bytes: errors, never panics, and no
//! allocation beyond what the input can justify (libFuzzer's -rss_limit_mb catches that).
#![no_main]

use libfuzzer_sys::fuzz_target;
use wisp_guest::engine::Model;
use wisp_guest::gguf::Gguf;

fuzz_target!(|data: &[u8]| {
    if Gguf::parse(data).is_ok() {
        let _ = Model::load(data);
    }
});
