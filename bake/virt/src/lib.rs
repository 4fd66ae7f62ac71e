//! The virtualizing half of `wisp bake`: a component that exports what the pre-initialized
//! guest imports beyond the `wasi:http/proxy` world, so that `wac` composes the two into a
//! component that imports nothing else and runs on any proxy host (`wasmtime serve`, say).
//!
//! The guest is baked after `preload`: its model is already in memory, and every later
//! `model.open` of that model is answered from there. At run time it opens no file, reads no
//! environment and has no terminal, and a proxy host has no GPU to give it. So each stub denies,
//! in the way the guest already handles:
//! - `cli`: no environment, no arguments, no working directory, no terminals; `exit` traps.
//! - `filesystem`: no preopened directories, so no descriptor can ever exist.
//! - `gpu`: no device; the guest runs on its CPU kernels, with the same tokens.
//! - `random`: `insecure-seed` is the one interface with a real answer, from `wasi:random/random`
//!   of the proxy world.
//!
//! The component imports only `wasi:random/random`, `wasi:cli/stderr` (for a panic's message)
//! and what the exported interfaces `use` (`wasi:io`, `wasi:clocks/wall-clock`), all of them in
//! the proxy world. That is why it is `no_std` on wasm, with `runtime` giving what std would:
//! Rust's std there links wasi-libc, whose stderr and `getenv` import `wasi:cli/environment`,
//! `exit` and the terminals. Natively (`cargo check --workspace`) it keeps std, and its
//! bindings are inert.

#![cfg_attr(target_arch = "wasm32", no_std)]

extern crate alloc;

mod cli;
mod filesystem;
mod gpu;
mod random;
#[cfg(target_arch = "wasm32")]
mod runtime;

/// The generated bindings of `wit/world.wit`; the other modules implement its exports.
mod bindings {
    wit_bindgen::generate!({
        path: ["../../wit", "wit"],
        world: "wisp:virt/virt",
        // The WASI interfaces' bindings too (wit-bindgen would otherwise ask which crate has
        // them): the exports must be generated here, and the few imports come along.
        generate_all,
    });

    use super::Virt;
    export!(Virt with_types_in self);
}

/// The component: every exported interface is implemented on it.
struct Virt;

/// The type of every resource this component exports: no value of it can be made, because no
/// function returns one (there are no directories, terminals or devices to hand out). Each of
/// its methods is therefore `match *self {}`.
enum Never {}
