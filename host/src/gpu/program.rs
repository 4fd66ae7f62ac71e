//! Programs of the `gpu` interface (from `wisp:llm@0.4.0`): a model's recipe as a list of ops
//! over values named by index, made once and run over batches of sequences (see the `program`
//! resource of `wit/gpu.wit` for the exact semantics).
//!
//! The op set, its checks and the f32 reference interpreter are the op core's (`wisp-ops`,
//! shared with the guest and the browser); this module names them for the host: the weights
//! a program holds ([`WeightRef`]: a `GpuCtx` handle resolved to a backend's buffer), and
//! [`run`], the op-by-op reading of a program over a [`Backend`]'s products, caches and
//! attention that every native backend shares; a backend that records whole programs on its
//! device takes over from it.

use super::{AttentionShape, Backend, BufferId, Format, GpuError};

pub use wisp_ops::reference::{rms_norm, rotate, top_k, top_of};
pub use wisp_ops::{
    BatchError, CacheUse, CheckError, MAX_CACHES, MAX_OPS, MAX_SEQUENCES, MAX_TOP_K, Op, Output, Precision, Rows, SequenceRun, Shape,
    first_key,
};

/// A checked program over the host's weights.
pub type Program = wisp_ops::Program<WeightRef>;

/// A weight a program names, as [`super::GpuCtx`] resolved it when the program was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightRef {
    /// The rep of its handle: a run checks that it still names this weight.
    pub rep: u32,
    /// The backend's buffer.
    pub id: BufferId,
    /// `n_out`.
    pub rows: u32,
    /// `n_in`.
    pub cols: u32,
    /// Its upload format.
    pub format: Format,
}

impl wisp_ops::Weight for WeightRef {
    fn dims(&self) -> (u32, u32) {
        (self.rows, self.cols)
    }

    fn format(&self) -> Option<Format> {
        Some(self.format)
    }
}

/// Checks `ops` over `weights` with `caches` cache indices (the op core's [`wisp_ops::check`]).
pub fn check(ops: Vec<Op>, weights: Vec<WeightRef>, caches: u32) -> Result<Program, CheckError> {
    wisp_ops::check(ops, weights, caches)
}

impl From<BatchError> for GpuError {
    fn from(e: BatchError) -> Self {
        match e {
            BatchError::Invalid(m) => GpuError::InvalidArgument(m),
            BatchError::TooLarge(m) => GpuError::OutOfMemory(m),
        }
    }
}

/// A [`Backend`] as the reference interpreter's primitives.
struct OnBackend<'a>(&'a mut dyn Backend);

impl wisp_ops::reference::Primitives<WeightRef> for OnBackend<'_> {
    type Error = GpuError;

    fn matmul(&mut self, w: &WeightRef, x: &[f32], rows: u32, precision: Precision) -> Result<Vec<f32>, GpuError> {
        self.0.matmul_op(w.id, x, rows, w.cols, precision)
    }

    fn matmuls(&mut self, ws: &[&WeightRef], x: &[f32], rows: u32, precision: Precision) -> Result<Vec<Vec<f32>>, GpuError> {
        let ids: Vec<BufferId> = ws.iter().map(|w| w.id).collect();
        let n_in = ws.first().map_or(0, |w| w.cols);
        self.0.matmul_ops(&ids, x, rows, n_in, precision)
    }

    fn write_cache(&mut self, cache: u64, first: u32, k: &[f32], v: &[f32]) -> Result<(), GpuError> {
        self.0.write_cache(cache, first, k, v)
    }

    fn attention(&mut self, cache: u64, first_key: u32, q: &[f32], shape: &AttentionShape) -> Result<Vec<f32>, GpuError> {
        self.0.attention_cached(q, &[], &[], 0, cache, first_key, shape)
    }

    fn gated(&mut self, act: wisp_ops::Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
        self.0.gated(act, gate, up)
    }
}

/// Runs a checked program over a checked batch (see [`wisp_ops::Program::check_batch`]) on `backend`, op
/// by op (the op core's reference interpreter). `vectors` holds the values of the program's
/// vector weights (`f32` weights of one row) by weight index, and nothing for the others.
pub fn run(p: &Program, backend: &mut dyn Backend, vectors: &[&[f32]], inputs: Vec<Vec<f32>>, batch: &[SequenceRun]) -> Result<Vec<Output>, GpuError> {
    wisp_ops::reference::run(p, &mut OnBackend(backend), vectors, inputs, batch)
}
