//! The op core of wisp: everything below the WIT `op` of `wisp:llm/gpu`, defined once for the
//! guest and every host.
//!
//! - [`Op`]: the op set of a program (a model's recipe as a list of ops over values named by
//!   index), with the parameters each op takes ([`Activation`], [`Rotation`], [`Precision`]).
//! - [`check`]: turns ops into a [`Program`] whose every operand, shape, weight and cache use has
//!   been checked, or a typed [`CheckError`] naming the op and the rule it breaks; a run then
//!   checks only its batch ([`Program::check_batch`]).
//! - [`Format`]: the upload formats of weights and their byte layouts.
//! - [`reference`]: the f32 reference interpreter over a small trait of primitives
//!   ([`reference::Primitives`]: products, cache writes, attention) that an executor implements;
//!   the element-wise ops, rotations, norms and top-k are computed there, in f32.
//!
//! See `wit/gpu.wit` for the exact semantics of each op; this crate is its executable reading.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

mod format;
mod op;
mod program;
pub mod reference;

pub use format::Format;
pub use op::{Activation, Op, Operands, Precision, Rotation, softcap};
pub use program::{
    BatchError, CacheUse, CheckError, MAX_CACHES, MAX_HEAD_DIM, MAX_OPS, MAX_SEQUENCES, MAX_TOP_K, MAX_WIDTH, Program,
    Rows, Rule, SequenceRun, Shape, Weight, WeightShape, check, compact, first_key,
};
pub use reference::{AttentionShape, Output};
