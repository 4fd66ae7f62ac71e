//! The host side of the `wisp:llm/gpu` interface.
//!
//! [`GpuCtx`] owns what a guest instance has on the device: its weight handles, its budget, and
//! a [`Backend`] that does the device work. Everything a guest sends is checked here, before a
//! backend sees it, so that backends only deal with well-formed requests and a hostile guest gets
//! a typed error: a forged or stale handle, mismatched lengths, shapes that overflow, sizes past
//! the device's limits or the instance's budget. Nothing a guest sends can trap or panic the host.

mod cpu;
mod imports;
pub mod native;
pub mod program;
mod wgpu;

pub use self::wgpu::{Gemm, WgpuBackend};
pub use cpu::CpuBackend;
pub use native::NativeBackend;

pub use imports::add_to_linker;
pub use wisp_ops::{Activation, AttentionShape, Format, MAX_HEAD_DIM, Precision, Rotation};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use wasmtime::component::Resource;

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
    /// `y[t, n_out] = x[t, n_in] @ W^T` for one weight, summed as `precision` allows (a
    /// program's `matmul` op, run op by op). The default is [`Backend::matmul`], one way of
    /// summing for both.
    fn matmul_op(&mut self, id: BufferId, x: &[f32], t: u32, n_in: u32, _precision: Precision) -> Result<Vec<f32>, GpuError> {
        let mut out = self.matmul(x, t, n_in, &[id])?;
        out.pop().ok_or_else(|| GpuError::DeviceLost("a product returned nothing".into()))
    }
    /// [`Backend::matmul_op`] of each weight `ids` with the same `x` (of `n_in` values a row),
    /// in order: a program's consecutive products of one value. The default runs them one by
    /// one.
    fn matmul_ops(&mut self, ids: &[BufferId], x: &[f32], t: u32, n_in: u32, precision: Precision) -> Result<Vec<Vec<f32>>, GpuError> {
        ids.iter().map(|&id| self.matmul_op(id, x, t, n_in, precision)).collect()
    }
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
    /// head_dim]`. Checked by [`wisp_ops::Program::check_batch`] already.
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
    /// `act(gate) * up`, value by value (a program's `gated` op, run op by op). The default is
    /// the op core's f32 reading ([`Activation::apply`]).
    fn gated(&mut self, act: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
        gate.iter().zip(up).map(|(&g, &u)| act.apply(g) * u).collect()
    }
    /// Makes ready what running `p` will need (pipelines, say): called once, when the program
    /// is made, so that its first run does not wait for them. The default has nothing to do.
    fn prepare_program(&mut self, _p: &program::Program) -> Result<(), GpuError> {
        Ok(())
    }
    /// Runs a checked program over a checked batch (see [`wisp_ops::Program::check_batch`]) in
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
        let program = program::check(ops, refs, caches).map_err(|e| GpuError::InvalidArgument(e.to_string()))?;
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
    /// batch that [`wisp_ops::Program::check_batch`] refuses (nothing is written then);
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
}
