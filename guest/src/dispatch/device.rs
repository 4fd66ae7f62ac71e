//! The host boundary: what the guest asks of the `gpu` imports, as a trait ([`Device`]), their
//! errors, limits and the records the calls take and give. Products and attention for a model
//! on the guest's CPU are programs of one op each in the glue (`component`).
//!
//! Separate from the policy so that the policy can be tested against a fake device, and so
//! that a change to the WIT's calls touches this file and the glue (`component`) alone.

use crate::program::Op;
use crate::upload::Format;

/// A device failure (the WIT `gpu.error`).
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceError {
    Unavailable(String),
    InvalidArgument(String),
    OutOfMemory(String),
    Lost(String),
}

/// What the host says of its device.
#[derive(Debug, Clone)]
pub struct DeviceLimits {
    pub name: String,
    pub max_weight_bytes: u64,
    pub max_activation_elements: u64,
    pub budget_bytes: u64,
    pub budget_handles: u32,
}

/// The host's `gpu` imports, behind a trait so the policy is testable without a host.
pub trait Device {
    fn allocate(&self, format: Format, n_out: u32, n_in: u32) -> Result<usize, DeviceError>;
    fn write_rows(&self, id: usize, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), DeviceError>;
    /// `x[t, n_in] @ W^T` for each job `W`: one output per job, each `[t, n_out]`.
    fn matmul(&self, x: &[f32], t: u32, n_in: u32, jobs: &[usize]) -> Result<Vec<Vec<f32>>, DeviceError>;
    /// Releases a weight's device memory.
    fn free(&self, id: usize);
    /// A `kv-cache` of `slots` rows of `width` values on the device (the WIT
    /// `create-kv-cache`). A device without it says `Unavailable`.
    fn create_kv_cache(&self, _slots: u32, _width: u32) -> Result<usize, DeviceError> {
        Err(DeviceError::Unavailable("no kv-cache on this device".into()))
    }
    /// Releases a `kv-cache`.
    fn free_kv_cache(&self, _id: usize) {}
    /// Attention of the `shape.t` queries `q` over a `kv-cache` after writing `k_new`, `v_new`
    /// at positions `first_new..` (the last `shape.t` rows are the queries' own), the keys of
    /// positions `first_key..` (the window of the first query); `[t, n_head * head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn attention_cached(
        &self,
        _q: &[f32],
        _k_new: &[f32],
        _v_new: &[f32],
        _first_new: u32,
        _cache: usize,
        _first_key: u32,
        _shape: &AttentionShape,
    ) -> Result<Vec<f32>, DeviceError> {
        Err(DeviceError::Unavailable("no kv-cache on this device".into()))
    }
    /// A program of `ops` (the WIT `create-program`) over the device weights `weights`, which
    /// the ops' weight ids index, with `caches` cache indices. A device without programs says
    /// `Unavailable`.
    fn create_program(&self, _weights: &[usize], _caches: u32, _ops: &[Op]) -> Result<usize, DeviceError> {
        Err(DeviceError::Unavailable("no programs on this device".into()))
    }
    /// Runs a program over a batch (the WIT `program.run`): what each `output` and `top-k` op
    /// returns.
    fn run_program(&self, _id: usize, _inputs: &[Vec<f32>], _batch: &[DeviceSequence<'_>]) -> Result<Vec<DeviceOutput>, DeviceError> {
        Err(DeviceError::Unavailable("no programs on this device".into()))
    }
}

/// What a program run returns for one `output` or `top-k` op (the WIT `output`): the op
/// core's.
pub type DeviceOutput = wisp_ops::Output;

/// One sequence of a program run: `rows` rows from position `start`, and the device kv-cache
/// of each of the program's cache indices.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSequence<'a> {
    pub rows: u32,
    pub start: u32,
    pub caches: &'a [usize],
}

/// The shape of an attention: `t` queries over `n_keys` keys, the last `t` the queries' own
/// (the op core's).
pub use wisp_ops::AttentionShape;
