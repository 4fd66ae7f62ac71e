//! wisp's guest: an LLM inference engine as a WebAssembly component.
//!
//! It parses GGUF (`gguf`) read from memory or a file (`source`), tokenizes (`tokenizer`), converts weights (`quant`), runs the
//! transformer (`models`) on its own CPU kernels (`kernels`), decides which products go to the
//! host's GPU (`dispatch`) and sends it weights in its upload formats (`upload`), samples
//! (`sampler`) under a constraint if asked (`constraint`), embeds texts (`embedding`), and renders
//! chat templates (`chat`).
//! `component` is the WIT glue.

pub mod chat;
pub mod constraint;
pub mod dispatch;
pub mod embedding;
pub mod engine;
pub mod gguf;
pub mod kernels;
pub mod models;
pub mod program;
pub mod quant;
pub mod sampler;
pub mod session;
pub mod source;
pub mod tokenizer;
pub mod upload;

#[cfg(target_arch = "wasm32")]
mod component;

#[cfg(target_arch = "wasm32")]
mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "inference-preinit",
    });

    use crate::component::Component;
    export!(Component with_types_in self);
}
