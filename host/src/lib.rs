//! wisp's native host: runs the wisp inference component under wasmtime and gives it a GPU.
//!
//! ```no_run
//! use wisp::{GpuCtx, GpuMode, Options, Sampling, Wisp};
//! # fn main() -> anyhow::Result<()> {
//! let path = std::path::Path::new("/models/gemma-3-270m-q4_k_m.gguf");
//! let wisp = Wisp::new(Options::default())?;
//! let mut inst = wisp.instantiate(GpuCtx::none(), path.parent())?;
//! let model = inst.open_model(path, GpuMode::Off)??;
//! let tokens = inst.tokenize(model, "The capital of France is", true, false)??;
//! let session = inst.new_session(model, 64)??;
//! inst.feed(session, &tokens)??;
//! for _ in 0..8 {
//!     let step = inst.next(session, &Sampling::default())??;
//!     print!("{}", String::from_utf8_lossy(&step.piece));
//! }
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

pub mod bake;
mod bindings;
pub mod conformance;
pub mod fetch;
pub mod golden;
pub mod gpu;
mod preinit;
mod runtime;

pub use gpu::{
    Activation, AttentionShape, Backend, BufferId, Budget, CpuBackend, Device, Format, Gemm,
    GpuCtx, GpuError, MAX_HEAD_DIM, NativeBackend, NoDevice, Rotation, WgpuBackend, add_to_linker,
    program::Precision,
};
pub use runtime::{
    Advance, ChatTemplate, Constraint, EngineError, GUEST_RELAXED_WASM, GUEST_WASM, GpuMode, HostState, Instance, Limit, LoadOptions, Model, ModelInfo, Options, Outcome, Sampling, Session,
    Logprobs, Pooling, Stats, Step, ToolSyntax, Wisp, native_guest,
};
