//! `attention` on the wgpu device: `shaders/attention.wgsl`, one workgroup a (head, query).
//!
//! Queries, keys and values are written into buffers kept across calls (grown as needed), the
//! queries split over dispatches so that none exceeds the device's workgroup count or the
//! multiply-add budget of a dispatch, and the output read back through one staging buffer.

use super::{WgpuBackend, binding, push_scopes};
use crate::gpu::{AttentionShape, BufferId, GpuError};

const SHADER: &str = include_str!("../../../../shaders/attention.wgsl");

/// Workgroups a call should give the device at least, where its keys allow (a decode step has
/// a few heads of one query: without splitting the keys, a few workgroups, each walking them
/// all).
const TARGET_WORKGROUPS: u64 = 1024;
/// The most splits of a query's keys: at most WG (64) in the shader, whose merge reads one
/// split's maximum and sum an invocation.
const MAX_SPLITS: u64 = 64;
const _: () = assert!(MAX_SPLITS <= 64);
/// The unit of a split, in keys. A quarter of the keys a workgroup scores at once (WG in the
/// shader): a decode step's cost is each workgroup's serial walk over its run, not the
/// invocations left idle (H200: a decode call at 128 keys 157 -> 101 us against runs of 64).
const SPLIT_KEYS: u64 = 16;

/// `(splits, split_len)`: each query's keys in runs of whole units of SPLIT_KEYS, enough of
/// them that the call has about TARGET_WORKGROUPS workgroups. One run (no merge) for
/// prefill-sized batches.
pub(crate) fn splits_for(s: &AttentionShape) -> (u32, u32) {
    let keys = s.n_keys as u64;
    let chunks = keys.div_ceil(SPLIT_KEYS).max(1);
    let want = (TARGET_WORKGROUPS / (s.t as u64 * s.n_head as u64).max(1)).clamp(1, MAX_SPLITS);
    let splits = want.min(chunks);
    let split_len = chunks.div_ceil(splits) * SPLIT_KEYS;
    (keys.div_ceil(split_len).max(1) as u32, split_len.min(u32::MAX as u64) as u32)
}

/// `Shape` in the shader.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Params {
    t: u32,
    n_keys: u32,
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    window: u32,
    scale: f32,
    query_base: u32,
    first_slot: u32,
    slots: u32,
    splits: u32,
    split_len: u32,
    softcap: f32,
    // To 64 bytes, a uniform struct's size in WGSL (a multiple of 16).
    pad0: u32,
    pad1: u32,
    pad2: u32,
}
pub(super) const PARAMS_BYTES: u64 = size_of::<Params>() as u64;

/// A `kv-cache`: keys and values, `[slots, width]` f32 each, from byte `k_at` of `k` and
/// `v_at` of `v`. Where both fit one binding they are one range of an [`Arena`] (`v` is `k`),
/// so that a program's cache write is one dispatch and the caches of a batch's sequences are
/// read by one attention; else two buffers of their own.
pub(super) struct Cache {
    pub(super) slots: u32,
    pub(super) width: u32,
    pub(super) k: wgpu::Buffer,
    pub(super) k_at: u64,
    pub(super) v: wgpu::Buffer,
    pub(super) v_at: u64,
}

impl Cache {
    /// The bytes of the keys (and of the values).
    pub(super) fn half(&self) -> u64 {
        4 * self.slots as u64 * self.width as u64
    }

    /// Whether keys and values are one buffer's (an arena's).
    pub(super) fn joint(&self) -> bool {
        self.k == self.v
    }

    /// The bytes from the keys' first to the values' last.
    pub(super) fn span(&self) -> u64 {
        self.v_at + self.half() - self.k_at
    }
}

/// An arena's first size: a first session's caches share one (it grows as more come).
const ARENA_MIN_BYTES: u64 = 32 << 20;

/// A buffer of kv-caches, each a range of it, one binding whole: a program's batch of
/// sequences whose caches share an arena writes them with one dispatch a layer and attends
/// with one (`attend_rows`).
pub(super) struct Arena {
    pub(super) buffer: wgpu::Buffer,
    free: Ranges,
}

/// The ranges of `size` bytes no cache holds, (offset, bytes), in order of offset, none
/// adjacent.
struct Ranges {
    size: u64,
    free: Vec<(u64, u64)>,
}

impl Ranges {
    fn new(size: u64) -> Ranges {
        Ranges { size, free: vec![(0, size)] }
    }

    /// The offset of a range of `bytes`, the first that fits.
    fn take(&mut self, bytes: u64) -> Option<u64> {
        let i = self.free.iter().position(|&(_, len)| len >= bytes)?;
        let (at, len) = self.free[i];
        if len == bytes {
            self.free.remove(i);
        } else {
            self.free[i] = (at + bytes, len - bytes);
        }
        Some(at)
    }

    /// Gives back the range at `at` of `bytes`, joined with its free neighbours.
    fn give(&mut self, at: u64, bytes: u64) {
        let i = self.free.partition_point(|&(a, _)| a < at);
        self.free.insert(i, (at, bytes));
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free.remove(i + 1).1;
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free.remove(i).1;
        }
    }

    /// Makes it `size` bytes long, the new bytes free.
    fn grow(&mut self, size: u64) {
        let old = std::mem::replace(&mut self.size, size);
        self.give(old, size - old);
    }

    /// Whether no range is taken.
    fn is_empty(&self) -> bool {
        self.free == [(0, self.size)]
    }
}

/// Keys and values bound: (buffer, byte offset) of each, and the bytes of each.
pub(super) type KvBound<'a> = ((&'a wgpu::Buffer, u64), (&'a wgpu::Buffer, u64), u64);

/// The pipeline (built on first use), the buffers kept across calls, and the `kv-cache`s.
#[derive(Default)]
pub(super) struct Attention {
    /// The layouts and pipelines.
    pipeline: Option<AttentionPipelines>,
    pub(super) caches: std::collections::HashMap<BufferId, Cache>,
    /// The arenas the joint caches are ranges of.
    arenas: Vec<Arena>,
    q: Option<wgpu::Buffer>,
    out: Option<wgpu::Buffer>,
    staging: Option<wgpu::Buffer>,
    params: Option<wgpu::Buffer>,
}

impl WgpuBackend {
    pub(super) fn attention_pipeline(&mut self) -> Result<AttentionPipelines, GpuError> {
        if let Some(p) = &self.attn.pipeline {
            return Ok(p.clone());
        }
        let scopes = push_scopes(&self.device);
        let entry = |binding: u32, ty: wgpu::BufferBindingType, dynamic: bool| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer { ty, has_dynamic_offset: dynamic, min_binding_size: None },
            count: None,
        };
        let read = wgpu::BufferBindingType::Storage { read_only: true };
        let entries = [
            entry(0, wgpu::BufferBindingType::Uniform, true),
            entry(1, read, false),
            entry(2, read, false),
            entry(3, read, false),
            entry(4, wgpu::BufferBindingType::Storage { read_only: false }, false),
            entry(5, read, false),
        ];
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("attention.wgsl"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
        // `attend` and `attend_merge` bind 0-4; `attend_rows` and its merge the rings too.
        let pipelines = |bindings: &[wgpu::BindGroupLayoutEntry], names: [&str; 2]| {
            let layout = self.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some("attention"), entries: bindings });
            let pipeline_layout = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("attention"),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
            let entry = |name| {
                self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(name),
                    layout: Some(&pipeline_layout),
                    module: &module,
                    entry_point: Some(name),
                    compilation_options: wgpu::PipelineCompilationOptions::default(),
                    cache: None,
                })
            };
            (layout, Pipelines { attend: entry(names[0]), merge: entry(names[1]) })
        };
        let one = pipelines(&entries[..5], ["attend", "attend_merge"]);
        let rows = pipelines(&entries, ["attend_rows", "attend_rows_merge"]);
        self.finish(scopes)?;
        let made = AttentionPipelines { one, rows };
        self.attn.pipeline = Some(made.clone());
        Ok(made)
    }

    /// Reserves a zeroed `kv-cache` (see [`crate::gpu::Backend::create_cache`]).
    pub(super) fn create_kv_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        self.live()?;
        let bytes = 4 * slots as u64 * width as u64;
        if bytes == 0 || bytes > self.max_binding {
            return Err(GpuError::OutOfMemory(format!("a kv-cache half of {bytes} bytes does not fit the device")));
        }
        let align = self.limits.min_storage_buffer_offset_alignment.max(4) as u64;
        let v_from = super::align_up(bytes, align);
        let span = super::align_up(v_from + bytes, align);
        let joint = self.joint_caches && span <= self.max_binding;
        let scopes = push_scopes(&self.device);
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let make = |label, size| self.device.create_buffer(&wgpu::BufferDescriptor { label: Some(label), size, usage, mapped_at_creation: false });
        let cache = if joint {
            let (kv, at) = self.arena_range(span);
            Cache { slots, width, k: kv.clone(), k_at: at, v: kv, v_at: at + v_from }
        } else {
            Cache { slots, width, k: make("kv-cache keys", bytes), k_at: 0, v: make("kv-cache values", bytes), v_at: 0 }
        };
        self.finish(scopes)?;
        let id = self.next;
        self.next += 1;
        self.attn.caches.insert(id, cache);
        Ok(id)
    }

    /// A zeroed range of `bytes` of an arena: its buffer and offset. Where none has room the
    /// last grows (to twice its size, or as much as it needs, within a binding: a new buffer,
    /// the caches copied to the same offsets there), so that a batch's caches share one; past a
    /// binding, a new arena.
    fn arena_range(&mut self, bytes: u64) -> (wgpu::Buffer, u64) {
        for a in self.attn.arenas.iter_mut() {
            if let Some(at) = a.free.take(bytes) {
                // A range given back holds an earlier cache's rows.
                let mut encoder = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("kv-cache clear") });
                encoder.clear_buffer(&a.buffer, at, Some(bytes));
                self.queue.submit([encoder.finish()]);
                return (a.buffer.clone(), at);
            }
        }
        let max = self.max_binding;
        let make = |size| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kv-cache arena"),
                size,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        };
        if let Some(last) = self.attn.arenas.last_mut() {
            let old = last.buffer.size();
            let size = (2 * old).max(old + bytes).min(max);
            if size >= old + bytes {
                let grown = make(size);
                let mut encoder = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("kv-cache arena grown") });
                encoder.copy_buffer_to_buffer(&last.buffer, 0, &grown, 0, old);
                self.queue.submit([encoder.finish()]);
                let was = std::mem::replace(&mut last.buffer, grown.clone());
                last.free.grow(size);
                let at = last.free.take(bytes).unwrap_or_default();
                for c in self.attn.caches.values_mut() {
                    if c.k == was {
                        (c.k, c.v) = (grown.clone(), grown.clone());
                    }
                }
                // Bind groups of the old buffer would keep it.
                self.recorded.forget_groups();
                return (grown, at);
            }
        }
        let size = ARENA_MIN_BYTES.min(max).max(bytes);
        let buffer = make(size);
        let mut free = Ranges::new(size);
        let at = free.take(bytes).unwrap_or_default();
        self.attn.arenas.push(Arena { buffer: buffer.clone(), free });
        (buffer, at)
    }

    /// Frees kv-cache `id`: its range goes back to its arena, an arena no cache holds goes.
    pub(super) fn free_kv_cache(&mut self, id: BufferId) {
        let Some(c) = self.attn.caches.remove(&id) else { return };
        if !c.joint() {
            return;
        }
        let bytes = super::align_up(c.span(), self.limits.min_storage_buffer_offset_alignment.max(4) as u64);
        let arenas = &mut self.attn.arenas;
        if let Some(i) = arenas.iter().position(|a| a.buffer == c.k) {
            arenas[i].free.give(c.k_at, bytes);
            if arenas[i].free.is_empty() {
                arenas.remove(i);
            }
        }
    }

    /// The arenas' sizes, in bytes.
    pub fn arena_sizes(&self) -> Vec<u64> {
        self.attn.arenas.iter().map(|a| a.buffer.size()).collect()
    }

    /// See [`crate::gpu::Backend::attention_cached`]: the new rows written into the ring (in
    /// at most two runs, where it wraps), then attention over the ring.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_attention_cached(
        &mut self,
        q: &[f32],
        k_new: &[f32],
        v_new: &[f32],
        first_new: u32,
        cache: BufferId,
        first_key: u32,
        s: &AttentionShape,
    ) -> Result<Vec<f32>, GpuError> {
        self.last_kernel_ns = None;
        self.live()?;
        let Some(c) = self.attn.caches.get(&cache) else {
            return Err(GpuError::InvalidArgument(format!("no kv-cache {cache}")));
        };
        let (slots, width) = (c.slots as u64, c.width as usize);
        let rows = k_new.len() / width.max(1);
        if k_new.len() != v_new.len() || rows as u64 > slots || s.n_keys as u64 > slots {
            return Err(GpuError::InvalidArgument(format!("{rows} new rows or {} keys do not fit {slots} slots", s.n_keys)));
        }
        let (kb, k_at, vb, v_at, bytes) = (c.k.clone(), c.k_at, c.v.clone(), c.v_at, c.half());
        self.write_rows_of_cache(cache, first_new, k_new, v_new)?;
        self.attend_over(q, ((&kb, k_at), (&vb, v_at), bytes), s, (first_key as u64 % slots) as u32, slots as u32)
    }

    /// See [`crate::gpu::Backend::write_cache`]: whole rows of keys and values written into
    /// the ring at the rows of positions `first..`, in at most two runs (where it wraps).
    pub(super) fn write_rows_of_cache(&mut self, cache: BufferId, first: u32, k_new: &[f32], v_new: &[f32]) -> Result<(), GpuError> {
        self.live()?;
        let Some(c) = self.attn.caches.get(&cache) else {
            return Err(GpuError::InvalidArgument(format!("no kv-cache {cache}")));
        };
        let (slots, width) = (c.slots as u64, c.width as usize);
        let rows = k_new.len() / width.max(1);
        if k_new.len() != v_new.len() || k_new.len() % width.max(1) != 0 || rows as u64 > slots {
            return Err(GpuError::InvalidArgument(format!("{} and {} values are not the same whole rows of {width}, at most {slots}", k_new.len(), v_new.len())));
        }
        if rows == 0 {
            return Ok(());
        }
        let (kb, k_at, vb, v_at) = (c.k.clone(), c.k_at, c.v.clone(), c.v_at);
        let scopes = push_scopes(&self.device);
        let start = (first as u64 % slots) as usize;
        let head = rows.min(slots as usize - start);
        for (buf, base, data) in [(&kb, k_at, k_new), (&vb, v_at, v_new)] {
            let (a, b) = data.split_at(head * width);
            if !a.is_empty() {
                self.queue.write_buffer(buf, base + (start * width * 4) as u64, bytemuck::cast_slice(a));
            }
            if !b.is_empty() {
                self.queue.write_buffer(buf, base, bytemuck::cast_slice(b));
            }
        }
        self.finish(scopes)
    }

    fn drop_attention_buffers(&mut self) {
        let kept = std::mem::take(&mut self.attn);
        self.attn = Attention { pipeline: kept.pipeline, caches: kept.caches, arenas: kept.arenas, ..Attention::default() };
    }

    /// The dispatches of attention of shape `s` over a ring of `slots` rows whose key 0 is row
    /// `first_slot`, `q_len` query values: split so that no dispatch exceeds the device's
    /// workgroup count or the multiply-add budget.
    ///
    /// Of `attend_rows` (`first_slot` and `slots` unused): `s.t` its entries (rows of the
    /// batch), `q_len` the values of the `out_rows` rows of the queries and outputs bound (its
    /// entries' partials after them), `splits` the most of its entries' (each entry's own
    /// runs in its ring's entry).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_plan(&self, q_len: u64, s: &AttentionShape, first_slot: u32, slots: u32, out_rows: u32, splits: Option<u32>) -> Result<Plan, GpuError> {
        let max = self.max_binding;
        let q_bytes = 4 * q_len;
        if q_len == 0 || q_bytes > max {
            return Err(GpuError::InvalidArgument(format!("{q_len} queries do not fit the device ({max} bytes a buffer)")));
        }
        let groups = self.limits.max_compute_workgroups_per_dimension.max(1);
        if s.n_head > groups {
            return Err(GpuError::OutOfMemory(format!("{} heads exceed the device's {groups} workgroups", s.n_head)));
        }
        // Queries a dispatch: within the workgroup count of a dimension and the budget.
        let macs = (2 * s.n_head as u64).saturating_mul(s.n_keys as u64).saturating_mul(s.head_dim as u64);
        let per_dispatch = (self.dispatch_macs / macs.max(1)).clamp(1, groups as u64) as u32;
        let dispatches = s.t.div_ceil(per_dispatch);
        let (splits, split_len) = match splits {
            Some(n) => (n, 0),
            None => splits_for(s),
        };
        // The outputs, then (with splits) each (query, head, split)'s partial: m, l, values.
        let partial_bytes = 4 * s.t as u64 * s.n_head as u64 * (splits as u64) * (s.head_dim as u64 + 2);
        let out_bytes = q_bytes + if splits > 1 { partial_bytes } else { 0 };
        if out_bytes > max {
            return Err(GpuError::OutOfMemory(format!("attention's partial sums of {out_bytes} bytes do not fit the device")));
        }
        let stride = super::align_up(PARAMS_BYTES, self.limits.min_uniform_buffer_offset_alignment.max(4) as u64);
        let params: Vec<u8> = (0..dispatches)
            .flat_map(|d| {
                let p = Params {
                    t: out_rows,
                    n_keys: s.n_keys,
                    n_head: s.n_head,
                    n_head_kv: s.n_head_kv,
                    head_dim: s.head_dim,
                    window: s.window,
                    scale: s.scale,
                    query_base: d * per_dispatch,
                    first_slot,
                    slots,
                    splits,
                    split_len,
                    softcap: s.softcap,
                    pad0: 0,
                    pad1: 0,
                    pad2: 0,
                };
                let mut bytes = bytemuck::bytes_of(&p).to_vec();
                bytes.resize(stride as usize, 0);
                bytes
            })
            .collect();
        Ok(Plan { params, stride, per_dispatch, dispatches, splits, t: s.t, n_head: s.n_head, q_bytes, out_bytes })
    }

    /// The pipelines of attention and a bind group of its buffers: the plan's parameters in
    /// `params` (from byte 0 of the binding), queries (buffer and offset), keys, values (`kv`:
    /// buffers and offsets, and the bytes bound of each), outputs (buffer and offset), and for
    /// `attend_rows` the rings (buffer, offset, bytes).
    pub(super) fn attention_group(
        &mut self,
        plan: &Plan,
        params: &wgpu::Buffer,
        (q, q_at): (&wgpu::Buffer, u64),
        kv: KvBound,
        (out, out_at): (&wgpu::Buffer, u64),
        rings: Option<&(wgpu::Buffer, u64, u64)>,
    ) -> Result<(wgpu::BindGroup, Pipelines), GpuError> {
        let made = self.attention_pipeline()?;
        let ((kb, k_at), (vb, v_at), kv_bytes) = kv;
        let mut entries = vec![
            wgpu::BindGroupEntry { binding: 0, resource: binding(params, 0, PARAMS_BYTES) },
            wgpu::BindGroupEntry { binding: 1, resource: binding(q, q_at, plan.q_bytes) },
            wgpu::BindGroupEntry { binding: 2, resource: binding(kb, k_at, kv_bytes) },
            wgpu::BindGroupEntry { binding: 3, resource: binding(vb, v_at, kv_bytes) },
            wgpu::BindGroupEntry { binding: 4, resource: binding(out, out_at, plan.out_bytes) },
        ];
        let (layout, pipelines) = match rings {
            Some((b, at, bytes)) => {
                entries.push(wgpu::BindGroupEntry { binding: 5, resource: binding(b, *at, *bytes) });
                made.rows
            }
            None => made.one,
        };
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor { label: Some("attention"), layout: &layout, entries: &entries });
        Ok((group, pipelines))
    }

    /// The attention kernel over `q` and keys and values in `kv` (see [`KvBound`]): key `j`
    /// in row `(first_slot + j) % slots`.
    fn attend_over(
        &mut self,
        q: &[f32],
        kv: KvBound,
        s: &AttentionShape,
        first_slot: u32,
        slots: u32,
    ) -> Result<Vec<f32>, GpuError> {
        let plan = self.attention_plan(q.len() as u64, s, first_slot, slots, s.t, None)?;
        let scopes = push_scopes(&self.device);
        let cap = self.limits.max_buffer_size;
        let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let device = &self.device;
        let a = &mut self.attn;
        let qb = Self::ensure(device, &mut a.q, plan.q_bytes, cap, storage, "attention q");
        let out_usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
        let out = Self::ensure(device, &mut a.out, plan.out_bytes, cap, out_usage, "attention out");
        let read_usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        let staging = Self::ensure(device, &mut a.staging, plan.q_bytes, cap, read_usage, "attention staging");
        let uniform = wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST;
        let pb = Self::ensure(device, &mut a.params, plan.params.len() as u64, cap, uniform, "attention params");
        self.queue.write_buffer(&qb, 0, bytemuck::cast_slice(q));
        self.queue.write_buffer(&pb, 0, &plan.params);
        let (group, pipelines) = self.attention_group(&plan, &pb, (&qb, 0), kv, (&out, 0), None)?;
        let mut encoder =
            self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("attention") });
        {
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("attention"), timestamp_writes: None });
            plan.record(&mut pass, &pipelines, &group, 0);
        }
        encoder.copy_buffer_to_buffer(&out, 0, &staging, 0, plan.q_bytes);
        self.queue.submit([encoder.finish()]);
        let result = self.read_back(&staging, plan.q_bytes, |view| bytemuck::pod_collect_to_vec::<u8, f32>(view));
        match self.finish(scopes).and(result) {
            Ok(out) => Ok(out),
            Err(e) => {
                // Start the next call from fresh buffers: these may be left mapped or invalid.
                self.drop_attention_buffers();
                Err(e)
            }
        }
    }
}

/// The layout and pipelines of one query a workgroup row (`attend`) and of a table's rows
/// (`attend_rows`).
#[derive(Clone)]
pub(super) struct AttentionPipelines {
    one: (wgpu::BindGroupLayout, Pipelines),
    rows: (wgpu::BindGroupLayout, Pipelines),
}

/// `attend` and `attend_merge`, or `attend_rows` and `attend_rows_merge`.
#[derive(Clone)]
pub(super) struct Pipelines {
    attend: wgpu::ComputePipeline,
    merge: wgpu::ComputePipeline,
}

/// The dispatches of one attention: their parameters (a `stride` each, for dynamic offsets)
/// and workgroup counts.
pub(super) struct Plan {
    pub(super) params: Vec<u8>,
    stride: u64,
    per_dispatch: u32,
    dispatches: u32,
    splits: u32,
    t: u32,
    n_head: u32,
    /// Bytes of the queries (and outputs), and of everything the kernels write.
    pub(super) q_bytes: u64,
    pub(super) out_bytes: u64,
}

impl Plan {
    /// Records the dispatches in `pass`, the parameters at `params_at` bytes into the group's
    /// parameter binding's buffer.
    pub(super) fn record(&self, pass: &mut wgpu::ComputePass<'_>, p: &Pipelines, group: &wgpu::BindGroup, params_at: u64) {
        let stages = [(&p.attend, self.splits), (&p.merge, 1)];
        for (pipeline, z) in stages.into_iter().take(if self.splits > 1 { 2 } else { 1 }) {
            pass.set_pipeline(pipeline);
            for d in 0..self.dispatches {
                let queries = self.per_dispatch.min(self.t - d * self.per_dispatch);
                pass.set_bind_group(0, group, &[(params_at + d as u64 * self.stride) as u32]);
                pass.dispatch_workgroups(self.n_head, queries, z);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(t: u32, n_keys: u32, n_head: u32) -> AttentionShape {
        AttentionShape { t, n_keys, n_head, n_head_kv: 1, head_dim: 256, window: 0, scale: 1.0, softcap: 0.0 }
    }

    /// Prefill batches run whole; a decode step's keys split into runs of whole units, at
    /// most MAX_SPLITS, that together cover every key once.
    /// Ranges are taken first fit and given back joined with their free neighbours, so that
    /// an arena whose caches are all freed is whole again, whatever the order.
    #[test]
    fn an_arenas_ranges_are_taken_first_fit_and_joined_when_given_back() {
        let mut r = Ranges::new(100);
        let taken: Vec<u64> = [10, 20, 30, 40].iter().map(|&b| r.take(b).unwrap()).collect();
        assert_eq!(taken, [0, 10, 30, 60]);
        assert_eq!(r.take(1), None);
        r.give(10, 20);
        r.give(60, 40);
        assert_eq!(r.take(25), Some(60), "the first range that fits");
        assert_eq!(r.take(20), Some(10));
        for (at, bytes) in [(30, 30), (0, 10), (60, 25), (10, 20)] {
            assert!(!r.is_empty());
            r.give(at, bytes);
        }
        assert!(r.is_empty(), "{:?}", r.free);
        assert_eq!(r.take(90), Some(0));
        r.grow(200);
        assert_eq!(r.free, [(90, 110)], "the new bytes joined with the free end");
        assert_eq!(r.take(110), Some(90));
    }

    #[test]
    fn splits_cover_the_keys_in_whole_chunks() {
        assert_eq!(splits_for(&shape(512, 512, 4)), (1, 512));
        assert_eq!(splits_for(&shape(64, 200, 4)), (4, 64));
        assert_eq!(splits_for(&shape(1, 576, 4)), (36, 16));
        assert_eq!(splits_for(&shape(1, 2048, 4)), (64, 32));
        assert_eq!(splits_for(&shape(1, 1, 4)), (1, 16));
        assert_eq!(splits_for(&shape(1, 100_000, 1)), (64, 1568));
        for (t, n_keys, n_head) in [(1, 130, 14), (3, 4097, 8), (700, 700, 1), (1, 64, 1024)] {
            let (splits, len) = splits_for(&shape(t, n_keys, n_head));
            assert!(len % 16 == 0 && splits as u64 <= MAX_SPLITS, "{t} {n_keys} {n_head}: {splits} x {len}");
            assert!((splits - 1) * len < n_keys && splits * len >= n_keys, "{t} {n_keys} {n_head}: {splits} x {len}");
        }
    }
}
