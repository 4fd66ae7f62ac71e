//! wisp's conformance kit: a WebAssembly component that imports `wisp:llm/gpu` and checks a
//! host's implementation of it, case by case (world `conformance` in `wit/conformance.wit`).
//!
//! The kit brings its own reading of every upload format (`reference`) and holds the host's
//! products to it with a stated tolerance; it makes the hostile calls a guest can make through
//! the ABI and expects the documented error variant of each. The same bytes run against the
//! native host (`wisp conformance`), any wasmtime embedding, and the browser host.

pub mod reference;
pub mod rng;

#[cfg(target_arch = "wasm32")]
mod suite;

#[cfg(target_arch = "wasm32")]
mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "conformance",
    });

    use crate::suite::Kit;
    export!(Kit with_types_in self);
}
