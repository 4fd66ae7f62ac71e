//! The host side of the `wisp:llm/gpu` interface.
//!
//! [`GpuCtx`] owns what a guest instance has on the device: its weight handles, its budget, and
//! a [`Backend`] that does the device work. Everything a guest sends is checked here, before a
//! backend sees it, so that backends only deal with well-formed requests and a hostile guest gets
//! a typed error: a forged or stale handle, mismatched lengths, shapes that overflow, sizes past
//! the device's limits or the instance's budget. Nothing a guest sends can trap or panic the host.

mod cpu;
pub mod program;
mod wgpu;

pub use self::wgpu::{Gemm, WgpuBackend};
pub use cpu::CpuBackend;

use crate::bindings::wisp::llm::gpu as wit;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use wasmtime::component::{HasData, Linker, Resource};

/// A weight layout of the WIT `weight-format` (see `wit/gpu.wit` for the exact bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// Plain little-endian f32, 4 bytes an element, no scales.
    F32,
    /// bfloat16 (the high half of an f32), 2 bytes an element, no scales. Exact for GGUF BF16.
    Bf16,
    /// A signed byte `q` an element and one f32 scale `d` per 32 elements of a row: `w = d * q`.
    /// Exact for Q8_0 and Q5_0.
    Q8x32,
    /// As [`Format::Q8x32`] with a scale per 16 elements. Exact for Q6_K.
    Q8x16,
    /// Two unsigned 4-bit `q` a byte (low nibble first) and two f32 `[d, m]` per 32 elements of a
    /// row: `w = d * q - m`. Exact for Q4_K and Q4_0.
    Q4x32,
}

impl Format {
    /// Elements per scale block (1 for the float formats).
    pub fn block(self) -> u64 {
        match self {
            Format::F32 | Format::Bf16 => 1,
            Format::Q8x32 | Format::Q4x32 => 32,
            Format::Q8x16 => 16,
        }
    }

    /// Bytes of `data` for `n` elements (`n` a multiple of the block).
    pub fn data_bytes(self, n: u64) -> Option<u64> {
        match self {
            Format::F32 => n.checked_mul(4),
            Format::Bf16 => n.checked_mul(2),
            Format::Q8x32 | Format::Q8x16 => Some(n),
            Format::Q4x32 => Some(n / 2),
        }
    }

    /// Number of f32 in `scales` for `n` elements.
    pub fn scale_count(self, n: u64) -> u64 {
        match self {
            Format::F32 | Format::Bf16 => 0,
            Format::Q8x32 => n / 32,
            Format::Q8x16 => n / 16,
            Format::Q4x32 => n / 16,
        }
    }

    /// The format's WIT name (`"f32"`, `"q4x32"`, ...), as error messages and `wisp bench`
    /// print it.
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Bf16 => "bf16",
            Format::Q8x32 => "q8x32",
            Format::Q8x16 => "q8x16",
            Format::Q4x32 => "q4x32",
        }
    }

    /// Every format, in the order of the WIT `weight-format` enum.
    pub const ALL: [Format; 5] = [Format::F32, Format::Bf16, Format::Q8x32, Format::Q8x16, Format::Q4x32];
}

impl From<wit::WeightFormat> for Format {
    fn from(f: wit::WeightFormat) -> Self {
        match f {
            wit::WeightFormat::F32 => Format::F32,
            wit::WeightFormat::Bf16 => Format::Bf16,
            wit::WeightFormat::Q8x32 => Format::Q8x32,
            wit::WeightFormat::Q8x16 => Format::Q8x16,
            wit::WeightFormat::Q4x32 => Format::Q4x32,
        }
    }
}

impl From<Format> for wit::WeightFormat {
    fn from(f: Format) -> Self {
        match f {
            Format::F32 => wit::WeightFormat::F32,
            Format::Bf16 => wit::WeightFormat::Bf16,
            Format::Q8x32 => wit::WeightFormat::Q8x32,
            Format::Q8x16 => wit::WeightFormat::Q8x16,
            Format::Q4x32 => wit::WeightFormat::Q4x32,
        }
    }
}

/// A failure of a `gpu` call, as the guest sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
///
/// Each variant carries a human-readable reason. None of them is a trap: the guest gets the
/// matching WIT `error` and carries on with its own CPU kernels.
pub enum GpuError {
    /// There is no device, or the device refused the work for a reason other than memory.
    Unavailable(String),
    /// The call breaks the contract: a forged or stale handle, a shape, a length or a format that
    /// does not fit. Nothing was changed on the device.
    InvalidArgument(String),
    /// The device's limits, its memory, or the instance's [`Budget`] would be exceeded.
    OutOfMemory(String),
    /// The device was lost; every later call of this [`GpuCtx`] fails with this too.
    DeviceLost(String),
}

impl std::fmt::Display for GpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuError::Unavailable(m) => write!(f, "unavailable: {m}"),
            GpuError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            GpuError::OutOfMemory(m) => write!(f, "out of memory: {m}"),
            GpuError::DeviceLost(m) => write!(f, "device lost: {m}"),
        }
    }
}

impl std::error::Error for GpuError {}

impl From<GpuError> for wit::Error {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::Unavailable(m) => wit::Error::Unavailable(m),
            GpuError::InvalidArgument(m) => wit::Error::InvalidArgument(m),
            GpuError::OutOfMemory(m) => wit::Error::OutOfMemory(m),
            GpuError::DeviceLost(m) => wit::Error::DeviceLost(m),
        }
    }
}

/// What a backend's device is and what it accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct Device {
    /// The adapter's name, e.g. "NVIDIA H200" or "llvmpipe (LLVM 15.0.6, 256 bits)".
    pub name: String,
    /// The graphics API under it: "vulkan", "metal", "dx12", "gl", "webgpu" or "cpu".
    pub backend: String,
    /// "discrete-gpu", "integrated-gpu", "virtual-gpu", "cpu" or "other".
    pub device_type: String,
    /// Largest single weight buffer, in bytes of its format's data.
    pub max_weight_bytes: u64,
    /// Largest input or output of one job, in f32 elements.
    pub max_activation_elements: u64,
}

/// The activation of a `gated` op (the WIT `activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))`, the tanh approximation of GELU.
    GeluTanh,
    /// `g / (1 + e^-g)`.
    Silu,
}

impl Activation {
    /// The activation of one value, in f32, as the shaders compute it: `g / (1 + e^-a)` with
    /// `a = 2 sqrt(2 / pi) (g + 0.044715 g^3)` for GELU (its tanh form rewritten) and `a = g`
    /// for SiLU.
    pub fn apply(self, g: f32) -> f32 {
        let a = match self {
            Activation::GeluTanh => 1.595_769_1 * (g + 0.044715 * g * g * g),
            Activation::Silu => g,
        };
        g / (1.0 + (-a).exp())
    }
}

impl From<wit::Activation> for Activation {
    fn from(a: wit::Activation) -> Self {
        match a {
            wit::Activation::GeluTanh => Activation::GeluTanh,
            wit::Activation::Silu => Activation::Silu,
        }
    }
}

/// The shape of an attention over a `kv-cache` ([`Backend::attention_cached`], with which a
/// program's `attention` op runs op by op).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Queries.
    pub t: u32,
    /// Keys and values; the last `t` are the queries' own positions.
    pub n_keys: u32,
    /// Query heads, a multiple of `n_head_kv`.
    pub n_head: u32,
    /// Key/value heads.
    pub n_head_kv: u32,
    /// Width of every head, 1 to [`MAX_HEAD_DIM`].
    pub head_dim: u32,
    /// Query `i` sees only the last `window` keys up to its own; 0 for no window.
    pub window: u32,
    /// Multiplies each query-key product before the softmax.
    pub scale: f32,
}

/// The widest head an `attention` op accepts.
pub const MAX_HEAD_DIM: u32 = 512;

impl AttentionShape {
    /// The keys query `i` sees: its own position and those before, the last `window` of them
    /// where there is a window.
    pub fn keys_of(&self, i: u32) -> std::ops::Range<usize> {
        let last = (self.n_keys - self.t + i) as usize;
        let first = if self.window == 0 { 0 } else { (last + 1).saturating_sub(self.window as usize) };
        first..last + 1
    }

    /// Values in `q` (and in the output), and in `k` (and `v`), or `None` if they overflow.
    pub fn lens(&self) -> Option<(u64, u64)> {
        let q = (self.t as u64).checked_mul(self.n_head as u64)?.checked_mul(self.head_dim as u64)?;
        let k = (self.n_keys as u64).checked_mul(self.n_head_kv as u64)?.checked_mul(self.head_dim as u64)?;
        Some((q, k))
    }
}

/// How a rotary embedding pairs a head's values (the WIT `rotation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rotation {
    /// `(h[j], h[j + head_dim / 2])`.
    Halves,
    /// `(h[2j], h[2j + 1])`.
    Pairs,
}

impl From<wit::Rotation> for Rotation {
    fn from(r: wit::Rotation) -> Self {
        match r {
            wit::Rotation::Halves => Rotation::Halves,
            wit::Rotation::Pairs => Rotation::Pairs,
        }
    }
}

/// Identifies a weight inside a backend.
pub type BufferId = u64;

/// The device work behind the `gpu` interface. Arguments are already checked by [`GpuCtx`]:
/// shapes are non-zero and consistent, lengths match, sizes are within [`Device`]'s limits.
pub trait Backend: Send {
    /// The device, or `None` when there is none.
    fn device(&self) -> Option<Device>;
    /// Reserves a zeroed weight `[n_out, n_in]`.
    fn create(&mut self, format: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError>;
    /// Writes whole rows `first_row..` of a weight.
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError>;
    /// `y_j[t, n_out_j] = x[t, n_in] @ W_j^T` for each job.
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError>;
    /// Frees a weight. Never fails: a lost device has nothing left to free.
    fn free(&mut self, id: BufferId);
    /// Reserves a zeroed `kv-cache` of `slots` rows of `width` values (keys and values alike).
    /// A backend without kv-caches keeps this default, `unavailable`.
    fn create_cache(&mut self, _slots: u32, _width: u32) -> Result<BufferId, GpuError> {
        Err(GpuError::Unavailable("this host does not offer kv-caches".into()))
    }
    /// Frees a `kv-cache`. Never fails.
    fn free_cache(&mut self, _id: BufferId) {}
    /// Writes the whole rows `k` and `v` (as many of each, at most the cache's slots) at the
    /// rows of positions `first..` of a `kv-cache` (position `p` in row `p % slots`). Checked by
    /// [`GpuCtx`] already. A backend without kv-caches keeps this default, `unavailable`.
    fn write_cache(&mut self, _id: BufferId, _first: u32, _k: &[f32], _v: &[f32]) -> Result<(), GpuError> {
        Err(GpuError::Unavailable("this host does not offer kv-caches".into()))
    }
    /// Causal grouped-query attention of `q` over a `kv-cache` (a program's `attention` op, run
    /// op by op, as `wit/gpu.wit` reads it): writes the whole rows `k_new`, `v_new` (possibly
    /// none) at the rows of positions `first_new..`, then attends over the `shape.n_keys` rows
    /// of positions `first_key..`, position `p` in row `p % slots`. Returns `[t, n_head *
    /// head_dim]`. Checked by [`program::Program::check_batch`] already.
    #[allow(clippy::too_many_arguments)]
    fn attention_cached(
        &mut self,
        _q: &[f32],
        _k_new: &[f32],
        _v_new: &[f32],
        _first_new: u32,
        _cache: BufferId,
        _first_key: u32,
        _shape: &AttentionShape,
    ) -> Result<Vec<f32>, GpuError> {
        Err(GpuError::Unavailable("this host does not offer kv-caches".into()))
    }
    /// Makes ready what running `p` will need (pipelines, say): called once, when the program
    /// is made, so that its first run does not wait for them. The default has nothing to do.
    fn prepare_program(&mut self, _p: &program::Program) -> Result<(), GpuError> {
        Ok(())
    }
    /// Runs a checked program over a checked batch (see [`program::Program::check_batch`]) in
    /// its own way, where the backend can; `None` where it cannot (the default), and
    /// [`program::run`] interprets it op by op with the calls above.
    fn run_program(
        &mut self,
        _p: &program::Program,
        _inputs: &[Vec<f32>],
        _batch: &[program::SequenceRun],
    ) -> Option<Result<Vec<program::Output>, GpuError>> {
        None
    }
    /// The device time of the last `matmul`'s dispatches alone, in nanoseconds (timestamp
    /// queries around its compute pass), where the device can tell and
    /// [`Backend::set_kernel_repeats`] asked for it; `None` otherwise.
    fn last_kernel_ns(&self) -> Option<u64> {
        None
    }
    /// For benchmarks: time each `matmul`'s dispatches and run them `n` times over (the same
    /// outputs each time; with `n > 1`, after one untimed run), so that
    /// [`Backend::last_kernel_ns`], the time of one run, is the steady rate of back-to-back
    /// kernels and not the first one's wait for its input. 0, the default, runs them once,
    /// untimed: the queries cost a call's round trip ~20 us on the H200. Ignored where nothing
    /// measures kernels.
    fn set_kernel_repeats(&mut self, _n: u32) {}
}

/// A backend with no device: `available` is `none`, every call is `unavailable`.
pub struct NoDevice;

impl Backend for NoDevice {
    fn device(&self) -> Option<Device> {
        None
    }
    fn create(&mut self, _: Format, _: u32, _: u32) -> Result<BufferId, GpuError> {
        Err(GpuError::Unavailable("this host has no GPU".into()))
    }
    fn write_rows(&mut self, _: BufferId, _: u32, _: &[u8], _: &[f32]) -> Result<(), GpuError> {
        Err(GpuError::Unavailable("this host has no GPU".into()))
    }
    fn matmul(&mut self, _: &[f32], _: u32, _: u32, _: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        Err(GpuError::Unavailable("this host has no GPU".into()))
    }
    fn free(&mut self, _: BufferId) {}
}

/// Per-instance limits on device use.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Bytes of weight data (plus scales) an instance may hold on the device.
    pub bytes: u64,
    /// Weight handles an instance may hold.
    pub handles: u32,
    /// Jobs in one `matmul` call.
    pub jobs: u32,
}

impl Default for Budget {
    fn default() -> Self {
        Budget { bytes: 8 << 30, handles: 4096, jobs: 64 }
    }
}

/// The host-side state of one weight handle.
#[derive(Debug)]
pub struct WeightHandle {
    id: BufferId,
    format: Format,
    rows: u32,
    cols: u32,
    bytes: u64,
    /// A copy of the values of an `f32` weight of one row (a norm's weights, a bias), which
    /// programs apply on the host; empty for the others.
    vector: Vec<f32>,
}

/// The host-side state of one `program` handle.
#[derive(Debug)]
pub struct ProgramHandle {
    program: program::Program,
}

/// The host-side state of one `kv-cache` handle.
#[derive(Debug)]
pub struct KvCacheHandle {
    id: BufferId,
    slots: u32,
    width: u32,
    bytes: u64,
}

/// The rep of the next weight handle. Unique across every `GpuCtx` of the process (until it
/// wraps after 2^32 handles), so that a released handle, or one of another instance, never
/// names a live weight: it is an `invalid-argument`, not someone else's weight.
static NEXT_REP: AtomicU32 = AtomicU32::new(1);

/// Owned GPU context of one guest instance: the backend, its handles and budget.
pub struct GpuCtx {
    backend: Box<dyn Backend>,
    device: Option<Device>,
    /// Live weights by the rep of their handle.
    weights: HashMap<u32, WeightHandle>,
    /// Live `kv-cache`s by the rep of their handle (reps are unique across the three maps).
    caches: HashMap<u32, KvCacheHandle>,
    /// Live programs by the rep of their handle.
    programs: HashMap<u32, ProgramHandle>,
    budget: Budget,
    used_bytes: u64,
    used_handles: u32,
    lost: Option<String>,
}

fn invalid<T>(m: impl Into<String>) -> Result<T, GpuError> {
    Err(GpuError::InvalidArgument(m.into()))
}

impl GpuCtx {
    /// A context doing its device work on `backend`, holding the guest to `budget`. The backend's
    /// [`Device`] is read once, here.
    pub fn new(backend: Box<dyn Backend>, budget: Budget) -> GpuCtx {
        let device = backend.device();
        GpuCtx {
            backend,
            device,
            weights: HashMap::new(),
            caches: HashMap::new(),
            programs: HashMap::new(),
            budget,
            used_bytes: 0,
            used_handles: 0,
            lost: None,
        }
    }

    /// A context with no device.
    pub fn none() -> GpuCtx {
        GpuCtx::new(Box::new(NoDevice), Budget::default())
    }

    /// The backend's device, or `None` for a context without one. Still `Some` after the device
    /// is lost (the guest's `available` says `none` then).
    pub fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    /// Bytes and handles currently held on the device.
    pub fn usage(&self) -> (u64, u32) {
        (self.used_bytes, self.used_handles)
    }

    /// The weight a guest's handle names, if it is a live weight of this instance.
    fn weight(&self, w: &Resource<WeightHandle>) -> Option<&WeightHandle> {
        self.weights.get(&w.rep())
    }

    fn ready(&self) -> Result<&Device, GpuError> {
        if let Some(why) = &self.lost {
            return Err(GpuError::DeviceLost(why.clone()));
        }
        self.device.as_ref().ok_or_else(|| GpuError::Unavailable("this host has no GPU".into()))
    }

    /// Records a device loss reported by the backend: every later call fails the same way.
    fn track<T>(&mut self, r: Result<T, GpuError>) -> Result<T, GpuError> {
        if let Err(GpuError::DeviceLost(why)) = &r {
            self.lost = Some(why.clone());
        }
        r
    }

    /// A rep for a new handle that names no live weight or cache (the counter may have wrapped).
    fn fresh_rep(&self) -> Option<u32> {
        (0..64)
            .map(|_| NEXT_REP.fetch_add(1, Ordering::Relaxed))
            .find(|r| *r != 0 && !self.weights.contains_key(r) && !self.caches.contains_key(r) && !self.programs.contains_key(r))
    }

    /// Checks that `bytes` more fit the instance's budget of bytes and handles.
    fn budget_allows(&self, bytes: u64) -> Result<(), GpuError> {
        if self.used_handles >= self.budget.handles {
            return Err(GpuError::OutOfMemory(format!("this instance holds its budget of {} handles", self.budget.handles)));
        }
        if self.used_bytes.saturating_add(bytes) > self.budget.bytes {
            return Err(GpuError::OutOfMemory(format!(
                "{bytes} more bytes exceed this instance's budget ({} of {} used)",
                self.used_bytes, self.budget.bytes
            )));
        }
        Ok(())
    }

    /// Reserves a zeroed `kv-cache` of `slots` rows of `width` f32 (keys and values alike) and
    /// returns its handle.
    ///
    /// Errors: `InvalidArgument` for a zero size or one that overflows `u64`; `OutOfMemory`
    /// past the device's `max_weight_bytes` (either half), the instance's [`Budget`], or the
    /// backend's memory; `Unavailable` where the backend has none, or `DeviceLost`.
    pub fn create_kv_cache(&mut self, slots: u32, width: u32) -> Result<Resource<KvCacheHandle>, GpuError> {
        let device = self.ready()?;
        if slots == 0 || width == 0 {
            return invalid(format!("empty kv-cache of {slots} slots of {width} values"));
        }
        let half = (slots as u64 * width as u64).checked_mul(4).ok_or_else(|| GpuError::InvalidArgument("kv-cache size overflows".into()))?;
        if half > device.max_weight_bytes {
            return Err(GpuError::OutOfMemory(format!(
                "a kv-cache of {half} bytes a half exceeds the device's limit of {}",
                device.max_weight_bytes
            )));
        }
        self.budget_allows(2 * half)?;
        let r = self.backend.create_cache(slots, width);
        let id = self.track(r)?;
        let Some(rep) = self.fresh_rep() else {
            self.backend.free_cache(id);
            return Err(GpuError::OutOfMemory("no free handle".into()));
        };
        self.caches.insert(rep, KvCacheHandle { id, slots, width, bytes: 2 * half });
        self.used_bytes += 2 * half;
        self.used_handles += 1;
        Ok(Resource::new_own(rep))
    }

    /// Frees a `kv-cache`'s device memory and returns it to the budget; a handle that is not a
    /// live cache of this context is ignored.
    pub fn release_cache(&mut self, c: Resource<KvCacheHandle>) {
        if let Some(h) = self.caches.remove(&c.rep()) {
            self.backend.free_cache(h.id);
            self.used_bytes -= h.bytes;
            self.used_handles -= 1;
        }
    }

    /// Reserves a zeroed weight `W[n_out, n_in]` of `format`, to be filled by
    /// [`write_rows`](GpuCtx::write_rows), and returns its handle.
    ///
    /// Errors: `InvalidArgument` for an empty shape, an `n_in` that is not a multiple of the
    /// format's [block](Format::block) or a size that overflows `u64`; `OutOfMemory` past the
    /// device's `max_weight_bytes` or the instance's [`Budget`] of bytes or handles, or when the
    /// backend is out of memory; `Unavailable` or `DeviceLost` when there is no usable device.
    pub fn allocate(&mut self, format: Format, n_out: u32, n_in: u32) -> Result<Resource<WeightHandle>, GpuError> {
        let device = self.ready()?;
        if n_out == 0 || n_in == 0 {
            return invalid(format!("empty weight [{n_out}, {n_in}]"));
        }
        if n_in as u64 % format.block() != 0 {
            return invalid(format!("n-in {n_in} is not a multiple of {}'s block of {}", format.name(), format.block()));
        }
        let n = n_out as u64 * n_in as u64;
        let data = format.data_bytes(n).ok_or_else(|| GpuError::InvalidArgument("weight size overflows".into()))?;
        let bytes = data
            .checked_add(4 * format.scale_count(n))
            .ok_or_else(|| GpuError::InvalidArgument("weight size overflows".into()))?;
        if data > device.max_weight_bytes {
            return Err(GpuError::OutOfMemory(format!(
                "a weight of {data} bytes exceeds the device's limit of {}",
                device.max_weight_bytes
            )));
        }
        self.budget_allows(bytes)?;
        let r = self.backend.create(format, n_out, n_in);
        let id = self.track(r)?;
        // A rep still in use here (the counter wrapped) is skipped.
        let Some(rep) = self.fresh_rep() else {
            self.backend.free(id);
            return Err(GpuError::OutOfMemory("no free handle".into()));
        };
        let vector = if format == Format::F32 && n_out == 1 { vec![0.0; n_in as usize] } else { Vec::new() };
        self.weights.insert(rep, WeightHandle { id, format, rows: n_out, cols: n_in, bytes, vector });
        self.used_bytes += bytes;
        self.used_handles += 1;
        Ok(Resource::new_own(rep))
    }

    /// Fills rows `first_row..first_row + rows` of `w`, where `rows` follows from `data`'s length
    /// (bytes in `w`'s format) and must match `scales`' length.
    ///
    /// Errors: `InvalidArgument` when `w` is not a live handle of this context, when `data` is
    /// empty or not whole rows, when `scales` does not hold the scales of those rows, or when the
    /// rows run past the weight's end; `Unavailable` or `DeviceLost` as for
    /// [`allocate`](GpuCtx::allocate).
    pub fn write_rows(&mut self, w: &Resource<WeightHandle>, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.ready()?;
        let h = self.weight(w).ok_or_else(|| GpuError::InvalidArgument("not a live weight handle of this instance".into()))?;
        let row_data = h.format.data_bytes(h.cols as u64).unwrap_or(u64::MAX);
        let row_scales = h.format.scale_count(h.cols as u64);
        if data.is_empty() || data.len() as u64 % row_data != 0 {
            return invalid(format!("{} bytes of data is not a whole number of {row_data}-byte rows", data.len()));
        }
        let rows = data.len() as u64 / row_data;
        if scales.len() as u64 != rows * row_scales {
            return invalid(format!("{rows} rows of {} need {} scales, got {}", h.format.name(), rows * row_scales, scales.len()));
        }
        if first_row as u64 + rows > h.rows as u64 {
            return invalid(format!("rows {first_row}..{} are past the weight's {} rows", first_row as u64 + rows, h.rows));
        }
        let id = h.id;
        let r = self.backend.write_rows(id, first_row, data, scales);
        self.track(r)?;
        if let Some(h) = self.weights.get_mut(&w.rep()).filter(|h| !h.vector.is_empty()) {
            for (v, b) in h.vector.iter_mut().zip(data.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Ok(())
    }

    /// Uploads a whole weight `W[n_out, n_in]`: [`allocate`](GpuCtx::allocate) and one
    /// [`write_rows`](GpuCtx::write_rows) of every row. The lengths of `data` (bytes) and `scales`
    /// (f32 values) are checked against the shape before anything is reserved; a weight whose
    /// write fails is released, so that a failed upload holds nothing.
    ///
    /// Errors: those of `allocate` and `write_rows`.
    pub fn upload(&mut self, format: Format, n_out: u32, n_in: u32, data: &[u8], scales: &[f32]) -> Result<Resource<WeightHandle>, GpuError> {
        // Check the lengths before reserving anything.
        let n = n_out as u64 * n_in as u64;
        if let Some(want) = format.data_bytes(n) {
            if data.len() as u64 != want || scales.len() as u64 != format.scale_count(n) {
                return invalid(format!(
                    "a {} weight [{n_out}, {n_in}] needs {want} bytes and {} scales, got {} and {}",
                    format.name(),
                    format.scale_count(n),
                    data.len(),
                    scales.len()
                ));
            }
        }
        let w = self.allocate(format, n_out, n_in)?;
        if let Err(e) = self.write_rows(&w, 0, data, scales) {
            self.release(w);
            return Err(e);
        }
        Ok(w)
    }

    /// `y_j[t, n_out_j] = x[t, n_in] @ W_j^T` for each job `W_j`: one output per job, in order,
    /// each `t * n_out_j` f32 values, row-major. `x` holds `t * n_in` f32 values, row-major.
    /// Not a call of the WIT (a guest's products are ops of its programs): the backend's
    /// products alone, checked as the WIT checks a program's, for `wisp bench` and the tests
    /// of the kernels.
    ///
    /// Errors: `InvalidArgument` for an empty input, an `x` of the wrong length, no jobs, more
    /// jobs than the [`Budget`] allows, or a job that is not a live handle of this context or
    /// does not have `n_in` columns; `OutOfMemory` when the input or an output exceeds the
    /// device's `max_activation_elements`, or the backend runs out of memory; `Unavailable` or
    /// `DeviceLost` when there is no usable device.
    pub fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[Resource<WeightHandle>]) -> Result<Vec<Vec<f32>>, GpuError> {
        let device = self.ready()?;
        let max_elems = device.max_activation_elements;
        if t == 0 || n_in == 0 {
            return invalid(format!("empty input [{t}, {n_in}]"));
        }
        if x.len() as u64 != t as u64 * n_in as u64 {
            return invalid(format!("x has {} values, t * n-in is {}", x.len(), t as u64 * n_in as u64));
        }
        if jobs.is_empty() {
            return invalid("no jobs");
        }
        if jobs.len() > self.budget.jobs as usize {
            return invalid(format!("{} jobs exceed the limit of {} per call", jobs.len(), self.budget.jobs));
        }
        if x.len() as u64 > max_elems {
            return Err(GpuError::OutOfMemory(format!("an input of {} values exceeds the device's limit of {max_elems}", x.len())));
        }
        let mut ids = Vec::with_capacity(jobs.len());
        for (i, j) in jobs.iter().enumerate() {
            let h = self
                .weight(j)
                .ok_or_else(|| GpuError::InvalidArgument(format!("job {i}: not a live weight handle of this instance")))?;
            if h.cols != n_in {
                return invalid(format!("job {i}: the weight has {} columns, n-in is {n_in}", h.cols));
            }
            if t as u64 * h.rows as u64 > max_elems {
                return Err(GpuError::OutOfMemory(format!(
                    "job {i}: an output of {} values exceeds the device's limit of {max_elems}",
                    t as u64 * h.rows as u64
                )));
            }
            ids.push(h.id);
        }
        let r = self.backend.matmul(x, t, n_in, &ids);
        self.track(r)
    }

    /// Makes a program of `ops` over `weights` with `caches` cache indices (see
    /// [`program::check`] and `wit/gpu.wit`) and returns its handle.
    ///
    /// Errors: `InvalidArgument` for a handle that is not a live weight of this context, more
    /// weights than the [`Budget`]'s handles, or ops that [`program::check`] refuses;
    /// `OutOfMemory` past the budget of handles; `Unavailable` or `DeviceLost` when there is no
    /// usable device.
    pub fn create_program(
        &mut self,
        weights: &[Resource<WeightHandle>],
        caches: u32,
        ops: Vec<program::Op>,
    ) -> Result<Resource<ProgramHandle>, GpuError> {
        self.ready()?;
        if weights.len() > self.budget.handles as usize {
            return invalid(format!("{} weights exceed the limit of {} a program", weights.len(), self.budget.handles));
        }
        let mut refs = Vec::with_capacity(weights.len());
        for (i, w) in weights.iter().enumerate() {
            let h = self.weight(w).ok_or_else(|| GpuError::InvalidArgument(format!("weight {i}: not a live weight handle of this instance")))?;
            refs.push(program::WeightRef { rep: w.rep(), id: h.id, rows: h.rows, cols: h.cols, format: h.format });
        }
        let program = program::check(ops, refs, caches).map_err(GpuError::InvalidArgument)?;
        self.budget_allows(0)?;
        let r = self.backend.prepare_program(&program);
        self.track(r)?;
        let rep = self.fresh_rep().ok_or_else(|| GpuError::OutOfMemory("no free handle".into()))?;
        self.programs.insert(rep, ProgramHandle { program });
        self.used_handles += 1;
        Ok(Resource::new_own(rep))
    }

    /// Runs a program over `batch`, each sequence with its rows, start position and caches, and
    /// `inputs`, one list for each `input` op; returns one [`program::Output`] for each
    /// `output` and `top-k` op, in order.
    ///
    /// Errors: `InvalidArgument` for a handle that is not a live program of this context, or a
    /// batch that [`program::Program::check_batch`] refuses (nothing is written then);
    /// `OutOfMemory` when a value exceeds the device's `max_activation_elements`; the
    /// backend's errors; `Unavailable` or `DeviceLost` when there is no usable device.
    pub fn run_program(
        &mut self,
        p: &Resource<ProgramHandle>,
        inputs: Vec<Vec<f32>>,
        batch: &[(u32, u32, &[Resource<KvCacheHandle>])],
    ) -> Result<Vec<program::Output>, GpuError> {
        let max_elems = self.ready()?.max_activation_elements;
        let program = &self.programs.get(&p.rep()).ok_or_else(|| GpuError::InvalidArgument("not a live program handle of this instance".into()))?.program;
        let mut runs = Vec::with_capacity(batch.len().min(program::MAX_SEQUENCES + 1));
        for (s, &(rows, start, caches)) in batch.iter().take(program::MAX_SEQUENCES + 1).enumerate() {
            let mut resolved = Vec::with_capacity(caches.len().min(program::MAX_CACHES as usize + 1));
            for (c, h) in caches.iter().take(program::MAX_CACHES as usize + 1).enumerate() {
                let k = self.caches.get(&h.rep()).ok_or_else(|| GpuError::InvalidArgument(format!("sequence {s}: cache {c} is not a live kv-cache handle of this instance")))?;
                resolved.push((k.id, k.slots, k.width));
            }
            runs.push(program::SequenceRun { rows, start, caches: resolved });
        }
        if batch.len() > program::MAX_SEQUENCES {
            return invalid(format!("a batch of {} sequences: 1 to {}", batch.len(), program::MAX_SEQUENCES));
        }
        let weights = &self.weights;
        let live = |w: &program::WeightRef| weights.get(&w.rep).is_some_and(|h| h.id == w.id);
        program.check_batch(&inputs, &runs, live, max_elems)?;
        let vectors: Vec<&[f32]> = program.weights.iter().map(|w| weights.get(&w.rep).map_or(&[][..], |h| &h.vector[..])).collect();
        let r = match self.backend.run_program(program, &inputs, &runs) {
            Some(r) => r,
            None => program::run(program, &mut *self.backend, &vectors, inputs, &runs),
        };
        self.track(r)
    }

    /// Forgets a program and returns its handle to the budget; a handle that is not a live
    /// program of this context is ignored.
    pub fn release_program(&mut self, p: Resource<ProgramHandle>) {
        if self.programs.remove(&p.rep()).is_some() {
            self.used_handles -= 1;
        }
    }

    /// The device time of the last successful `matmul`'s kernels alone, in nanoseconds, where
    /// the backend can measure it (wgpu with timestamp queries); for benchmarks.
    pub fn last_kernel_ns(&self) -> Option<u64> {
        self.backend.last_kernel_ns()
    }

    /// See [`Backend::set_kernel_repeats`]; for benchmarks.
    pub fn set_kernel_repeats(&mut self, n: u32) {
        self.backend.set_kernel_repeats(n)
    }

    /// Frees a handle's device memory and returns it to the budget. A handle that is not a live
    /// weight of this context (already released, or another instance's) is ignored.
    pub fn release(&mut self, w: Resource<WeightHandle>) {
        if let Some(h) = self.weights.remove(&w.rep()) {
            self.backend.free(h.id);
            self.used_bytes -= h.bytes;
            self.used_handles -= 1;
        }
    }

    fn info(&self) -> Option<wit::DeviceInfo> {
        let d = self.device.as_ref()?;
        Some(wit::DeviceInfo {
            name: d.name.clone(),
            backend: d.backend.clone(),
            device_type: d.device_type.clone(),
            max_weight_bytes: d.max_weight_bytes,
            max_activation_elements: d.max_activation_elements,
            budget_bytes: self.budget.bytes - self.used_bytes,
            budget_handles: self.budget.handles - self.used_handles,
        })
    }
}

impl wit::Host for GpuCtx {
    fn available(&mut self) -> wasmtime::Result<Option<wit::DeviceInfo>> {
        Ok(if self.lost.is_some() { None } else { self.info() })
    }

    fn upload(
        &mut self,
        format: wit::WeightFormat,
        n_out: u32,
        n_in: u32,
        data: Vec<u8>,
        scales: Vec<f32>,
    ) -> wasmtime::Result<Result<Resource<WeightHandle>, wit::Error>> {
        Ok(GpuCtx::upload(self, format.into(), n_out, n_in, &data, &scales).map_err(Into::into))
    }

    fn allocate(&mut self, format: wit::WeightFormat, n_out: u32, n_in: u32) -> wasmtime::Result<Result<Resource<WeightHandle>, wit::Error>> {
        Ok(GpuCtx::allocate(self, format.into(), n_out, n_in).map_err(Into::into))
    }

    fn create_kv_cache(&mut self, slots: u32, width: u32) -> wasmtime::Result<Result<Resource<KvCacheHandle>, wit::Error>> {
        Ok(GpuCtx::create_kv_cache(self, slots, width).map_err(Into::into))
    }

    fn create_program(
        &mut self,
        weights: Vec<Resource<WeightHandle>>,
        caches: u32,
        ops: Vec<wit::Op>,
    ) -> wasmtime::Result<Result<Resource<ProgramHandle>, wit::Error>> {
        let ops = ops.into_iter().map(Into::into).collect();
        Ok(GpuCtx::create_program(self, &weights, caches, ops).map_err(Into::into))
    }
}

impl wit::HostWeight for GpuCtx {
    fn write_rows(
        &mut self,
        w: Resource<WeightHandle>,
        first_row: u32,
        data: Vec<u8>,
        scales: Vec<f32>,
    ) -> wasmtime::Result<Result<(), wit::Error>> {
        Ok(GpuCtx::write_rows(self, &w, first_row, &data, &scales).map_err(Into::into))
    }

    fn rows(&mut self, w: Resource<WeightHandle>) -> wasmtime::Result<u32> {
        Ok(self.weight(&w).map(|h| h.rows).unwrap_or(0))
    }

    fn cols(&mut self, w: Resource<WeightHandle>) -> wasmtime::Result<u32> {
        Ok(self.weight(&w).map(|h| h.cols).unwrap_or(0))
    }

    fn format(&mut self, w: Resource<WeightHandle>) -> wasmtime::Result<wit::WeightFormat> {
        Ok(self.weight(&w).map(|h| h.format).unwrap_or(Format::F32).into())
    }

    fn drop(&mut self, w: Resource<WeightHandle>) -> wasmtime::Result<()> {
        self.release(w);
        Ok(())
    }
}

impl wit::HostKvCache for GpuCtx {
    fn slots(&mut self, c: Resource<KvCacheHandle>) -> wasmtime::Result<u32> {
        Ok(self.caches.get(&c.rep()).map(|h| h.slots).unwrap_or(0))
    }

    fn width(&mut self, c: Resource<KvCacheHandle>) -> wasmtime::Result<u32> {
        Ok(self.caches.get(&c.rep()).map(|h| h.width).unwrap_or(0))
    }

    fn drop(&mut self, c: Resource<KvCacheHandle>) -> wasmtime::Result<()> {
        self.release_cache(c);
        Ok(())
    }
}

impl From<wit::Precision> for program::Precision {
    fn from(p: wit::Precision) -> Self {
        match p {
            wit::Precision::Exact => program::Precision::Exact,
            wit::Precision::Fast => program::Precision::Fast,
        }
    }
}

impl From<wit::Op> for program::Op {
    fn from(op: wit::Op) -> Self {
        use program::Op;
        let ix = |v: u32| v as usize;
        match op {
            wit::Op::Input(width) => Op::Input { width },
            wit::Op::Matmul(m) => Op::Matmul { x: ix(m.x), weight: ix(m.weight), precision: m.precision.into() },
            wit::Op::RmsNorm(n) => Op::RmsNorm { x: ix(n.x), weight: n.weight.map(ix), offset: n.offset, group: n.group, eps: n.eps },
            wit::Op::Add((a, b)) => Op::Add(ix(a), ix(b)),
            wit::Op::Mul((a, b)) => Op::Mul(ix(a), ix(b)),
            wit::Op::Bias(b) => Op::Bias { x: ix(b.x), weight: ix(b.weight) },
            wit::Op::Scale(s) => Op::Scale { x: ix(s.x), by: s.by },
            wit::Op::Gated(g) => Op::Gated { gate: ix(g.gate), up: ix(g.up), act: g.act.into() },
            wit::Op::Rotate(r) => Op::Rotate { x: ix(r.x), table: ix(r.table), head_dim: r.head_dim, rotation: r.rotation.into() },
            wit::Op::CacheWrite(c) => Op::CacheWrite { k: ix(c.k), v: ix(c.v), cache: c.cache },
            wit::Op::Attention(a) => Op::Attention {
                q: ix(a.q),
                cache: a.cache,
                n_head: a.n_head,
                n_head_kv: a.n_head_kv,
                head_dim: a.head_dim,
                window: a.window,
                scale: a.scale,
                precision: a.precision.into(),
            },
            wit::Op::LastRows(x) => Op::LastRows(ix(x)),
            wit::Op::Output(x) => Op::Output(ix(x)),
            wit::Op::TopK(t) => Op::TopK { x: ix(t.x), k: t.k },
        }
    }
}

impl wit::HostProgram for GpuCtx {
    fn run(
        &mut self,
        p: Resource<ProgramHandle>,
        inputs: Vec<Vec<f32>>,
        batch: Vec<wit::Sequence>,
    ) -> wasmtime::Result<Result<Vec<wit::Output>, wit::Error>> {
        let batch: Vec<_> = batch.iter().map(|s| (s.rows, s.start, &s.caches[..])).collect();
        let out = GpuCtx::run_program(self, &p, inputs, &batch).map(|outputs| {
            outputs
                .into_iter()
                .map(|o| match o {
                    program::Output::Rows(v) => wit::Output::Rows(v),
                    program::Output::Top { values, indices } => wit::Output::Top(wit::TopRows { values, indices }),
                })
                .collect()
        });
        Ok(out.map_err(Into::into))
    }

    fn ops(&mut self, p: Resource<ProgramHandle>) -> wasmtime::Result<u32> {
        Ok(self.programs.get(&p.rep()).map_or(0, |h| h.program.ops.len() as u32))
    }

    fn drop(&mut self, p: Resource<ProgramHandle>) -> wasmtime::Result<()> {
        self.release_program(p);
        Ok(())
    }
}

struct GpuData;

impl HasData for GpuData {
    type Data<'a> = &'a mut GpuCtx;
}

/// Adds wisp's `gpu` interface to a linker whose store data holds a [`GpuCtx`]. This is all an
/// embedder needs to give the wisp component (or any component importing `wisp:llm/gpu`) a GPU.
pub fn add_to_linker<T: 'static>(linker: &mut Linker<T>, get: fn(&mut T) -> &mut GpuCtx) -> anyhow::Result<()> {
    wit::add_to_linker::<T, GpuData>(linker, get)?;
    Ok(())
}
