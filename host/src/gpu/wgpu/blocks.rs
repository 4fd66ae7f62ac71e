//! `blocks` on the wgpu device: every decoder block of a call in one command buffer, one
//! submission and one readback. Only `x` and the rotation tables go up; the residual stream,
//! the block's intermediate rows and its keys and values stay on the device between the steps,
//! and `x` with every block's new keys and values comes back.
//!
//! The products are `matmul`'s kernels (chosen by `plan` for `t` as a call of its own would
//! be; `down` computes the activation step as it reads its x, X_ACT in the shader), attention
//! `attention-cached`'s over the block's `kv-cache`; the norms, biases and rotations are the
//! small kernels at the end of `shaders/matmul.wgsl` (a norm, the residual add after it and
//! the next norm in one, `norm_pair_rows`). The new keys and values reach the cache's ring by
//! buffer copies, between compute passes.

use super::attention::{Pipelines, Plan};
use super::{
    Dispatch, Kernel, PARAMS_BYTES, Params, WORKGROUP, WgpuBackend, X_PLAIN, align_up, binding,
    push_scopes, x_act,
};
use std::collections::HashMap;

use crate::gpu::program::Precision;
use crate::gpu::{Block, BlocksOutput, BlocksShape, BufferId, Format, GpuError, Rotation};

/// `norm_rows` and `norm_pair_rows` flags (NORM_NONE, PAIR_KEEP in the shader).
pub(super) const NORM_NONE: u32 = 4;
pub(super) const PAIR_KEEP: u32 = 8;

/// Buffers kept across `blocks` calls, grown when a call needs more.
#[derive(Default)]
pub(super) struct Buffers {
    /// The residual stream `[t, n_embd]` and a normed copy of it (in one buffer, so that
    /// `norm_pair_rows` writes both), the queries, attention's output (and partial sums), a
    /// product's output `[t, n_embd]`, the gate and up outputs (`down` reads them as its
    /// activations), and the keys and values of every block; `o` holds a plane of partial sums
    /// for each run of k of the `wo` and `down` products split over k, `parts` those of the
    /// others.
    x: Option<wgpu::Buffer>,
    q: Option<wgpu::Buffer>,
    a: Option<wgpu::Buffer>,
    o: Option<wgpu::Buffer>,
    mid: Option<wgpu::Buffer>,
    pub(super) parts: Option<wgpu::Buffer>,
    kv: Option<wgpu::Buffer>,
    tables: Option<wgpu::Buffer>,
    pub(super) staging: Option<wgpu::Buffer>,
    params: Option<wgpu::Buffer>,
    attn_params: Option<wgpu::Buffer>,
    /// Bind groups of earlier calls, by what they bind: a decode step binds what the one
    /// before it bound (H200: making Gemma's 288 anew cost ~1 ms a step).
    groups: HashMap<BindKey, wgpu::BindGroup>,
    attention: HashMap<AttentionKey, (wgpu::BindGroup, Pipelines)>,
    /// A program's values, one buffer a slot (see `programs`).
    pub(super) slots: Vec<Option<wgpu::Buffer>>,
}

/// What an attention bind group binds: parameters, queries, keys, values and outputs (buffer,
/// offset, bytes).
type AttentionKey = [(wgpu::Buffer, u64, u64); 5];

/// What a bind group of `matmul.wgsl`'s layout binds: parameters, weights, scales, x and y.
type BindKey = (
    wgpu::Buffer,
    wgpu::Buffer,
    (wgpu::Buffer, u64, u64),
    (wgpu::Buffer, u64, u64),
    (wgpu::Buffer, u64, u64),
);

/// Bind groups kept at most: past it, the cache starts again (it also keeps what it binds
/// alive, so it is emptied whenever a weight or a cache is freed).
const MAX_CACHED_GROUPS: usize = 4096;

impl Buffers {
    /// Forgets the cached bind groups (and so the buffers only they hold).
    pub(super) fn forget_groups(&mut self) {
        self.groups.clear();
        self.attention.clear();
    }
}

/// A bind group of `matmul.wgsl`'s layout: weights, scales, x and y (buffer, offset, bytes).
#[derive(Clone)]
pub(super) struct Bind {
    pub(super) weights: wgpu::Buffer,
    pub(super) scales: (wgpu::Buffer, u64, u64),
    pub(super) x: (wgpu::Buffer, u64, u64),
    pub(super) y: (wgpu::Buffer, u64, u64),
}

/// An attention of a recording: its plan, its cache, and where its queries and its outputs
/// (with the partial sums after them) are bound from.
pub(super) struct AttentionBind {
    pub(super) plan: Plan,
    pub(super) cache: BufferId,
    /// The queries' buffer and byte offset (`plan.q_bytes` bound).
    pub(super) q: (wgpu::Buffer, u64),
    /// The outputs' buffer and byte offset (`plan.out_bytes` bound).
    pub(super) out: (wgpu::Buffer, u64),
}

/// What the command buffer does, in order.
pub(super) enum Command {
    /// Dispatches `dispatches[range]` of `matmul.wgsl`.
    Kernels(std::ops::Range<usize>),
    /// Block `b`'s attention.
    Attention(usize),
    /// `bytes` from one buffer to another: (source, offset), (destination, offset).
    Copy(wgpu::Buffer, u64, wgpu::Buffer, u64, u64),
    /// Submits what is recorded so far: the device starts on the first blocks while the rest
    /// are recorded.
    Submit,
}

/// Blocks a command buffer holds (the last may hold fewer): the device starts on the first
/// ones while the host records the rest (H200, Gemma: a decode step of 288 dispatches 5.2 ->
/// 4.6 ms; a 512-token prefill, bound by the device, the same).
const SUBMIT_BLOCKS: usize = 3;

/// The commands of one call, with the bind groups and dispatches they use.
#[derive(Default)]
pub(super) struct Recording {
    pub(super) binds: Vec<Bind>,
    pub(super) dispatches: Vec<Dispatch>,
    /// The pipeline of each dispatch besides its kernel: its bind's weight format and how it
    /// reads x (X_ACT).
    pub(super) formats: Vec<(Format, u32)>,
    pub(super) commands: Vec<Command>,
}

/// Where a product split over k (see `WgpuBackend::plan`) leaves its planes of partial sums.
#[derive(Clone, Copy)]
pub(super) enum Planes<'a> {
    /// In this buffer, added into the output by `sum_planes` right after.
    Summed(&'a wgpu::Buffer),
    /// In the output itself, from its offset on, for the next step to add as it reads them.
    Kept,
}

impl Recording {
    /// Dispatches of a kernel of one workgroup row a row of `params.t` (split where there are
    /// more than `max_dim`), `groups_x` workgroups a row.
    pub(super) fn rows(&mut self, max_dim: u32, kernel: Kernel, bind: usize, params: Params, groups_x: u32) {
        let mut r0 = 0;
        while r0 < params.t {
            let rows = (params.t - r0).min(max_dim);
            self.dispatches.push(Dispatch {
                job: bind,
                kernel,
                params: Params {
                    t_base: r0,
                    ..params
                },
                groups: (groups_x, rows, 1),
            });
            self.formats.push((Format::F32, X_PLAIN));
            r0 += rows;
        }
    }

    /// Adds a bind group; returns its index.
    pub(super) fn bind(&mut self, b: Bind) -> usize {
        self.binds.push(b);
        self.binds.len() - 1
    }

    /// Opens (or continues) a run of kernel dispatches ending at the current one.
    pub(super) fn close_kernels(&mut self, from: usize) {
        let to = self.dispatches.len();
        if to > from {
            match self.commands.last_mut() {
                Some(Command::Kernels(r)) if r.end == from => r.end = to,
                _ => self.commands.push(Command::Kernels(from..to)),
            }
        }
    }
}

/// WISP_PROFILE=1: each kernel of a `blocks` call in a compute pass of its own, timed.
struct Profile {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
    count: u32,
    period_ns: f64,
    /// The kernel of each timed pass.
    names: Vec<&'static str>,
}

impl Profile {
    /// A pass for one kernel, timed while the query set lasts.
    fn pass(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        name: &'static str,
    ) -> wgpu::ComputePass<'static> {
        let at = 2 * self.names.len() as u32;
        let timed = at + 2 <= self.count;
        if timed {
            self.names.push(name);
        }
        let timestamp_writes = timed.then_some(wgpu::ComputePassTimestampWrites {
            query_set: &self.queries,
            beginning_of_pass_write_index: Some(at),
            end_of_pass_write_index: Some(at + 1),
        });
        encoder
            .begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(name),
                timestamp_writes,
            })
            .forget_lifetime()
    }

    fn resolve(&self, encoder: &mut wgpu::CommandEncoder) {
        let n = 2 * self.names.len() as u32;
        if n > 0 {
            encoder.resolve_query_set(&self.queries, 0..n, &self.resolve, 0);
            encoder.copy_buffer_to_buffer(&self.resolve, 0, &self.read, 0, 8 * n as u64);
        }
    }

    /// Prints the device time of each kernel, summed over the call, to stderr.
    fn print(&self, ticks: &[u64]) {
        let mut sums: Vec<(&str, u32, f64)> = Vec::new();
        for (name, pair) in self.names.iter().zip(ticks.chunks_exact(2)) {
            let us = pair[1].saturating_sub(pair[0]) as f64 * self.period_ns / 1e3;
            match sums.iter_mut().find(|s| s.0 == *name) {
                Some(s) => (s.1, s.2) = (s.1 + 1, s.2 + us),
                None => sums.push((name, 1, us)),
            }
        }
        let total: f64 = sums.iter().map(|s| s.2).sum();
        let parts: Vec<String> = sums
            .iter()
            .map(|(name, n, us)| format!("{name} {n}x {us:.0}"))
            .collect();
        eprintln!(
            "blocks profile, us: {total:.0} in kernels: {}",
            parts.join(", ")
        );
    }
}

/// A compute pass of `blocks`, untimed.
fn plain_pass(encoder: &mut wgpu::CommandEncoder) -> wgpu::ComputePass<'static> {
    encoder
        .begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("blocks"),
            timestamp_writes: None,
        })
        .forget_lifetime()
}

pub(super) fn whole(b: &wgpu::Buffer, bytes: u64) -> (wgpu::Buffer, u64, u64) {
    (b.clone(), 0, bytes)
}

/// All of `b`, bound.
pub(super) fn entire(b: &wgpu::Buffer) -> (wgpu::Buffer, u64, u64) {
    (b.clone(), 0, b.size())
}

impl WgpuBackend {
    /// See [`crate::gpu::Backend::blocks`]; the arguments are checked by `GpuCtx` already.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_blocks(
        &mut self,
        x: &[f32],
        t: u32,
        pos: u32,
        blocks: &[Block],
        s: &BlocksShape,
        rope: &[Vec<f32>],
        return_kv: bool,
    ) -> Result<BlocksOutput, GpuError> {
        self.last_kernel_ns = None;
        self.live()?;
        let (e, ff, hd) = (s.n_embd as u64, s.n_ff as u64, s.head_dim as u64);
        let (nq, nkv) = (s.n_head as u64 * hd, s.n_head_kv as u64 * hd);
        // Rows feed the products as their x: whole steps of 8 values, no padding.
        if [e, nq, ff].iter().any(|w| w % 8 != 0) {
            return Err(GpuError::Unavailable(format!(
                "blocks of widths {e}, {nq} and {ff} (this host runs them where each is a multiple of 8)"
            )));
        }
        let t64 = t as u64;
        let storage_align = self.limits.min_storage_buffer_offset_alignment.max(4) as u64;
        let x_bytes = 4 * t64 * e;
        // The normed copy of x, after x in the same buffer.
        let h_at = align_up(x_bytes, storage_align);
        let q_bytes = 4 * t64 * nq;
        let part = 4 * t64 * ff;
        let up_at = align_up(part, storage_align);
        let mid_bytes = align_up(up_at + part, 16);
        // Each block's keys, then each block's values, a whole aligned run each.
        let kv_run = align_up(4 * t64 * nkv, storage_align);
        let kv_bytes = 2 * blocks.len() as u64 * kv_run;
        let table_run = align_up(4 * t64 * hd, storage_align);
        let tables_bytes = align_up(table_run * rope.len().max(1) as u64, 16);
        // Attention's plans (and so its output's size) first: they check the shapes.
        let mut plans = Vec::with_capacity(blocks.len());
        for b in blocks {
            let c = self
                .attn
                .caches
                .get(&b.cache)
                .ok_or_else(|| GpuError::InvalidArgument(format!("no kv-cache {}", b.cache)))?;
            let first = b.first_key(pos);
            let shape = s.attention(t, pos + t - first, b.window);
            plans.push(self.attention_plan(t64 * nq, &shape, first % c.slots, c.slots)?);
        }
        let a_bytes = plans.iter().map(|p| p.out_bytes).max().unwrap_or(q_bytes);
        // The planes of the products split over k: `wo`'s and `down`'s in `o`, the others'
        // in `parts`.
        let splits = |id: BufferId| {
            self.weights
                .get(&id)
                .map_or(1, |w| self.k_splits(w, t, Precision::Exact) as u64)
        };
        let (mut o_planes, mut parts_bytes) = (1, 16);
        for b in blocks {
            o_planes = o_planes.max(splits(b.wo)).max(splits(b.down));
            let kv = 4 * t64 * nkv;
            for (id, bytes) in [
                (b.wq, q_bytes),
                (b.wk, kv),
                (b.wv, kv),
                (b.gate, part),
                (b.up, part),
            ] {
                if splits(id) > 1 {
                    parts_bytes = parts_bytes.max(align_up(splits(id) * bytes, 16));
                }
            }
        }
        let o_bytes = o_planes * x_bytes;
        let max = self.info.max_weight_bytes;
        if [
            h_at + x_bytes,
            q_bytes,
            a_bytes,
            mid_bytes,
            kv_bytes,
            tables_bytes,
            o_bytes,
            parts_bytes,
        ]
        .iter()
        .any(|&b| b > max)
        {
            return Err(GpuError::OutOfMemory(format!(
                "blocks over [{t}, {e}] need buffers past the device's limit"
            )));
        }

        let scopes = push_scopes(&self.device);
        let cap = self.limits.max_buffer_size;
        let storage = wgpu::BufferUsages::STORAGE;
        let (copy_src, copy_dst) = (wgpu::BufferUsages::COPY_SRC, wgpu::BufferUsages::COPY_DST);
        let device = &self.device;
        let m = &mut self.block_buffers;
        let xb = Self::ensure(
            device,
            &mut m.x,
            h_at + x_bytes,
            cap,
            storage | copy_src | copy_dst,
            "blocks x and normed x",
        );
        let qb = Self::ensure(device, &mut m.q, q_bytes, cap, storage, "blocks q");
        let ab = Self::ensure(device, &mut m.a, a_bytes, cap, storage, "blocks attention");
        let ob = Self::ensure(device, &mut m.o, o_bytes, cap, storage, "blocks output");
        let parts = Self::ensure(
            device,
            &mut m.parts,
            parts_bytes,
            cap,
            storage,
            "blocks partial sums",
        );
        let mid = Self::ensure(
            device,
            &mut m.mid,
            mid_bytes,
            cap,
            storage,
            "blocks gate and up",
        );
        let kvb = Self::ensure(
            device,
            &mut m.kv,
            kv_bytes,
            cap,
            storage | copy_src,
            "blocks keys and values",
        );
        let tables = Self::ensure(
            device,
            &mut m.tables,
            tables_bytes,
            cap,
            storage | copy_dst,
            "blocks rotations",
        );
        let read = wgpu::BufferUsages::MAP_READ | copy_dst;
        // The keys and values are read back only when asked for.
        let back = if return_kv { kv_bytes } else { 0 };
        let staging = Self::ensure(
            device,
            &mut m.staging,
            x_bytes + back,
            cap,
            read,
            "blocks staging",
        );
        self.queue.write_buffer(&xb, 0, bytemuck::cast_slice(x));
        for (i, table) in rope.iter().enumerate() {
            self.queue
                .write_buffer(&tables, i as u64 * table_run, bytemuck::cast_slice(table));
        }
        self.finish(scopes)
            .inspect_err(|_| self.block_buffers = Buffers::default())?;

        let mut rec = Recording::default();
        let placeholder = self.placeholder.clone();
        let vector = |id: BufferId| -> Result<wgpu::Buffer, GpuError> {
            self.weights
                .get(&id)
                .map(|w| w.data.clone())
                .ok_or_else(|| GpuError::InvalidArgument(format!("no weight {id}")))
        };
        // A norm's weights; None (no norm): the tables, bound but never read.
        let norm_weights = |id: Option<BufferId>| id.map_or_else(|| Ok(tables.clone()), vector);
        let max_dim = self.limits.max_compute_workgroups_per_dimension.max(1);
        let small =
            |rec: &mut Recording, kernel: Kernel, bind: usize, params: Params, groups_x: u32| {
                rec.rows(max_dim, kernel, bind, params, groups_x)
            };
        let eps = s.eps.to_bits();
        // The x (and weights) of a kernel that reads none: the tables, never written by a kernel.
        let unread = whole(&tables, 16);
        // norm_rows over the `t` rows of the residual stream: x += norm(input) * w (input: buffer,
        // bytes of a plane, planes summed); `w` None: x += input.
        let norm = |rec: &mut Recording,
                    w: Option<BufferId>,
                    (input, bytes, planes): (&wgpu::Buffer, u64, u32)|
         -> Result<(), GpuError> {
            let flags = if w.is_none() { NORM_NONE } else { 0 };
            let bind = rec.bind(Bind {
                weights: norm_weights(w)?,
                scales: entire(&placeholder),
                x: whole(input, bytes * planes as u64),
                y: whole(&xb, x_bytes),
            });
            let params = Params {
                n_in: e as u32,
                n_out: e as u32,
                t,
                row_quads: e as u32,
                scale_row: flags,
                row_base: eps,
                t_base: 0,
                x_stride: planes,
            };
            small(rec, Kernel::NormRows, bind, params, 1);
            Ok(())
        };
        let bias = |rec: &mut Recording,
                    b: Option<BufferId>,
                    y: (&wgpu::Buffer, u64, u64),
                    n: u64|
         -> Result<(), GpuError> {
            if let Some(id) = b {
                let bind = rec.bind(Bind {
                    weights: vector(id)?,
                    scales: entire(&placeholder),
                    x: unread.clone(),
                    y: (y.0.clone(), y.1, y.2),
                });
                let params = Params {
                    n_in: n as u32,
                    n_out: n as u32,
                    t,
                    row_quads: 0,
                    scale_row: 0,
                    row_base: 0,
                    t_base: 0,
                    x_stride: 0,
                };
                small(
                    rec,
                    Kernel::BiasRows,
                    bind,
                    params,
                    (n as u32).div_ceil(WORKGROUP),
                );
            }
            Ok(())
        };
        // Each head of `y` turned by table `table`, first given its bias where there is one,
        // then normed by `norm` where there is one: the bias and the rotation in one kernel
        // (`rope_rows`) where there is no norm, the norm and the rotation (`norm_rope_rows`)
        // where there is.
        let turn = |rec: &mut Recording,
                    bias_id: Option<BufferId>,
                    norm: Option<BufferId>,
                    table: u64,
                    y: (&wgpu::Buffer, u64, u64),
                    heads: u64|
         -> Result<(), GpuError> {
            if norm.is_some() {
                bias(rec, bias_id, y, heads * hd)?;
            }
            let x = (
                tables.clone(),
                table * table_run,
                align_up(4 * t64 * hd, 16),
            );
            // The head norm's weights, or else the bias's (rope_rows adds it where row_quads
            // is 1).
            let (weights, with_bias) = match (norm, bias_id) {
                (Some(id), _) => (vector(id)?, false),
                (None, Some(id)) => (vector(id)?, true),
                (None, None) => (tables.clone(), false),
            };
            let bind = rec.bind(Bind {
                weights,
                scales: entire(&placeholder),
                x,
                y: (y.0.clone(), y.1, y.2),
            });
            let pairs = u32::from(s.rotation == Rotation::Pairs);
            let params = Params {
                n_in: hd as u32,
                n_out: heads as u32,
                t,
                row_quads: u32::from(with_bias),
                scale_row: pairs,
                row_base: eps,
                t_base: 0,
                x_stride: 0,
            };
            match norm {
                Some(_) => small(rec, Kernel::NormRopeRows, bind, params, heads as u32),
                None => small(
                    rec,
                    Kernel::RopeRows,
                    bind,
                    params,
                    ((heads * hd / 2) as u32).div_ceil(WORKGROUP),
                ),
            }
            Ok(())
        };

        // norm_pair_rows: x += norm(input) * first (first None: x += input; input None: x as
        // it is), then h = norm(x) * second.
        let norm_pair = |rec: &mut Recording,
                         first: Option<BufferId>,
                         second: BufferId,
                         input: Option<(&wgpu::Buffer, u64, u32)>|
         -> Result<(), GpuError> {
            let mut flags = if first.is_none() { NORM_NONE } else { 0 };
            if input.is_none() {
                flags |= PAIR_KEEP;
            }
            let bind = rec.bind(Bind {
                weights: norm_weights(first)?,
                scales: entire(&vector(second)?),
                x: input.map_or_else(
                    || unread.clone(),
                    |(b, bytes, planes)| whole(b, bytes * planes as u64),
                ),
                y: whole(&xb, h_at + x_bytes),
            });
            let params = Params {
                n_in: e as u32,
                n_out: e as u32,
                t,
                row_quads: (h_at / 4) as u32,
                scale_row: flags,
                row_base: eps,
                t_base: 0,
                x_stride: input.map_or(1, |i| i.2),
            };
            small(rec, Kernel::NormPairRows, bind, params, 1);
            Ok(())
        };
        let h_in = (&xb, h_at, x_bytes);

        for (l, b) in blocks.iter().enumerate() {
            let from = rec.dispatches.len();
            let (k_at, v_at) = (l as u64 * kv_run, (blocks.len() + l) as u64 * kv_run);
            let (k_out, v_out) = ((&kvb, k_at, 4 * t64 * nkv), (&kvb, v_at, 4 * t64 * nkv));
            // h = norm(x) (the block before made it, but for the first); q, k, v = h W^T +
            // bias; head norms; rotations.
            if l == 0 {
                norm_pair(&mut rec, None, b.attn_norm, None)?;
            }
            let summed = Planes::Summed(&parts);
            for (id, out) in [(b.wq, (&qb, 0, q_bytes)), (b.wk, k_out), (b.wv, v_out)] {
                self.product_into(&mut rec, (id, Precision::Exact), h_in, out, t, (e / 4) as u32, summed, X_PLAIN)?;
            }
            bias(&mut rec, b.v_bias, v_out, nkv)?;
            let q_out = (&qb, 0, q_bytes);
            let table = b.rope as u64;
            turn(&mut rec, b.q_bias, b.q_norm, table, q_out, s.n_head as u64)?;
            turn(
                &mut rec,
                b.k_bias,
                b.k_norm,
                table,
                k_out,
                s.n_head_kv as u64,
            )?;
            rec.close_kernels(from);
            // The new rows into the cache's ring (two runs where it wraps), then attention.
            let c = &self.attn.caches[&b.cache];
            let (slots, row) = (c.slots as u64, 4 * nkv);
            let start = pos as u64 % slots;
            let head = t64.min(slots - start);
            for (src, dst) in [(k_at, &c.k), (v_at, &c.v)] {
                rec.commands.push(Command::Copy(
                    kvb.clone(),
                    src,
                    dst.clone(),
                    start * row,
                    head * row,
                ));
                if head < t64 {
                    rec.commands.push(Command::Copy(
                        kvb.clone(),
                        src + head * row,
                        dst.clone(),
                        0,
                        (t64 - head) * row,
                    ));
                }
            }
            rec.commands.push(Command::Attention(l));
            // x += norm(a wo^T + bias); h = norm(x); x += norm(ffn(h)); h = the next block's
            // norm(x).
            let from = rec.dispatches.len();
            let planes = self.product_into(
                &mut rec,
                (b.wo, Precision::Exact),
                (&ab, 0, q_bytes),
                (&ob, 0, x_bytes),
                t,
                (nq / 4) as u32,
                Planes::Kept,
                X_PLAIN,
            )?;
            bias(&mut rec, b.o_bias, (&ob, 0, x_bytes), e)?;
            let o = (&ob, x_bytes, planes);
            norm_pair(&mut rec, b.post_attn_norm, b.ffn_norm, Some(o))?;
            self.product_into(
                &mut rec,
                (b.gate, Precision::Exact),
                h_in,
                (&mid, 0, part),
                t,
                (e / 4) as u32,
                summed,
                X_PLAIN,
            )?;
            self.product_into(
                &mut rec,
                (b.up, Precision::Exact),
                h_in,
                (&mid, up_at, part),
                t,
                (e / 4) as u32,
                summed,
                X_PLAIN,
            )?;
            // down reads act(gate) * up as its x (X_ACT).
            let planes = self.product_into(
                &mut rec,
                (b.down, Precision::Exact),
                (&mid, 0, mid_bytes),
                (&ob, 0, x_bytes),
                t,
                (ff / 4) as u32,
                Planes::Kept,
                x_act(s.act),
            )?;
            let o = (&ob, x_bytes, planes);
            match blocks.get(l + 1) {
                Some(next) => norm_pair(&mut rec, b.post_ffn_norm, next.attn_norm, Some(o))?,
                None => norm(&mut rec, b.post_ffn_norm, o)?,
            }
            rec.close_kernels(from);
            if (l + 1) % SUBMIT_BLOCKS == 0 && l + 1 < blocks.len() {
                rec.commands.push(Command::Submit);
            }
        }
        rec.commands
            .push(Command::Copy(xb.clone(), 0, staging.clone(), 0, x_bytes));
        if return_kv {
            rec.commands.push(Command::Copy(
                kvb.clone(),
                0,
                staging.clone(),
                x_bytes,
                kv_bytes,
            ));
        }
        let (n, run) = (blocks.len() as u64, (4 * t64 * nkv) as usize);
        let read = |view: &[u8]| {
            let floats = |at: u64, len: usize| {
                bytemuck::pod_collect_to_vec::<u8, f32>(&view[at as usize..at as usize + len])
            };
            let rows = |first: u64| {
                let mut all =
                    Vec::with_capacity(if return_kv { blocks.len() * run / 4 } else { 0 });
                for l in (first..first + n).filter(|_| return_kv) {
                    all.extend_from_slice(&floats(x_bytes + l * kv_run, run));
                }
                all
            };
            BlocksOutput {
                x: floats(0, x_bytes as usize),
                keys: rows(0),
                values: rows(n),
            }
        };
        let attention = plans
            .into_iter()
            .zip(blocks)
            .map(|(plan, b)| AttentionBind { plan, cache: b.cache, q: (qb.clone(), 0), out: (ab.clone(), 0) })
            .collect::<Vec<_>>();
        self.record(rec, &attention, (&staging, x_bytes + back), read)
            .inspect_err(|_| self.block_buffers = Buffers::default())
    }

    /// Adds weight `id`'s product over `input` (buffer, offset, bytes; rows of `x_quads` quads,
    /// read as `x_act` says: X_ACT in the shader) into `output` (buffer, offset, bytes): its
    /// bind group and its dispatches as `matmul` plans them, split over k where it has few
    /// tiles, its planes of partial sums left as `planes` says, at `precision`. Returns the
    /// planes left in `output` (1 where there is one sum).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn product_into(
        &self,
        rec: &mut Recording,
        (id, precision): (BufferId, Precision),
        input: (&wgpu::Buffer, u64, u64),
        output: (&wgpu::Buffer, u64, u64),
        t: u32,
        x_quads: u32,
        planes: Planes,
        x_act: u32,
    ) -> Result<u32, GpuError> {
        let w = self
            .weights
            .get(&id)
            .ok_or_else(|| GpuError::InvalidArgument(format!("no weight {id}")))?;
        let n = self.k_splits(w, t, precision);
        let bytes = output.2 * n as u64;
        let y = match planes {
            Planes::Summed(parts) if n > 1 => (parts.clone(), 0, align_up(bytes, 16)),
            _ => (output.0.clone(), output.1, bytes),
        };
        let bind = rec.bind(Bind {
            weights: w.data.clone(),
            scales: entire(w.scales.as_ref().unwrap_or(&self.placeholder)),
            x: (input.0.clone(), input.1, input.2),
            y: y.clone(),
        });
        let from = rec.dispatches.len();
        self.plan(bind, w, t, x_quads, precision, true, &mut rec.dispatches);
        rec.formats.extend(std::iter::repeat_n(
            (w.format, x_act),
            rec.dispatches.len() - from,
        ));
        let Planes::Summed(_) = planes else {
            return Ok(n);
        };
        if n > 1 {
            // Bound as weights too, unread: a binding of at least 16 bytes, only ever read.
            let sum = rec.bind(Bind {
                weights: y.0.clone(),
                scales: entire(&self.placeholder),
                x: y,
                y: (output.0.clone(), output.1, output.2),
            });
            let params = Params {
                n_in: w.n_out,
                n_out: w.n_out,
                t,
                row_quads: w.n_out,
                scale_row: 0,
                row_base: 0,
                t_base: 0,
                x_stride: n,
            };
            let max_dim = self.limits.max_compute_workgroups_per_dimension.max(1);
            let groups_x = w.n_out.div_ceil(WORKGROUP);
            rec.rows(max_dim, Kernel::SumPlanes, sum, params, groups_x);
        }
        Ok(1)
    }

    /// Records `rec` in one command buffer (compute passes between the copies; a new one at
    /// each `Submit`), submits it, and gives the staging buffer's first `bytes` to `read`.
    /// `Command::Attention(i)` records `attention[i]`.
    pub(super) fn record<R>(
        &mut self,
        rec: Recording,
        attention: &[AttentionBind],
        (staging, bytes): (&wgpu::Buffer, u64),
        read: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, GpuError> {
        let started = std::time::Instant::now();
        let uniform_align = self.limits.min_uniform_buffer_offset_alignment.max(4) as u64;
        let stride = align_up(PARAMS_BYTES, uniform_align);
        let mut pipelines = std::collections::HashMap::new();
        for (d, &(format, x_act)) in rec.dispatches.iter().zip(&rec.formats) {
            if let std::collections::hash_map::Entry::Vacant(v) =
                pipelines.entry((d.kernel, format, x_act))
            {
                v.insert(self.pipeline(d.kernel, format, x_act)?);
            }
        }
        let mut params = vec![0u8; (stride * rec.dispatches.len() as u64) as usize];
        for (i, d) in rec.dispatches.iter().enumerate() {
            let at = i * stride as usize;
            params[at..at + PARAMS_BYTES as usize].copy_from_slice(bytemuck::bytes_of(&d.params));
        }
        let mut attn_params = Vec::new();
        let mut attn_at = Vec::with_capacity(attention.len());
        for a in attention {
            attn_at.push(attn_params.len() as u64);
            attn_params.extend_from_slice(&a.plan.params);
        }

        let scopes = push_scopes(&self.device);
        let cap = self.limits.max_buffer_size;
        let uniform = wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST;
        let m = &mut self.block_buffers;
        let pb = Self::ensure(
            &self.device,
            &mut m.params,
            params.len() as u64,
            cap,
            uniform,
            "blocks params",
        );
        let apb = Self::ensure(
            &self.device,
            &mut m.attn_params,
            attn_params.len() as u64,
            cap,
            uniform,
            "blocks attention params",
        );
        self.queue.write_buffer(&pb, 0, &params);
        self.queue.write_buffer(&apb, 0, &attn_params);
        let m = &mut self.block_buffers;
        if m.groups.len() + rec.binds.len() > MAX_CACHED_GROUPS {
            m.groups.clear();
        }
        let mut groups = Vec::with_capacity(rec.binds.len());
        for b in &rec.binds {
            let key = (
                pb.clone(),
                b.weights.clone(),
                b.scales.clone(),
                b.x.clone(),
                b.y.clone(),
            );
            let group = m.groups.entry(key).or_insert_with(|| {
                self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("blocks"),
                    layout: &self.bind_layout,
                    entries: &[
                        wgpu::BindGroupEntry {
                            binding: 0,
                            resource: binding(&pb, 0, PARAMS_BYTES),
                        },
                        wgpu::BindGroupEntry {
                            binding: 1,
                            resource: b.weights.as_entire_binding(),
                        },
                        wgpu::BindGroupEntry {
                            binding: 2,
                            resource: binding(&b.scales.0, b.scales.1, b.scales.2),
                        },
                        wgpu::BindGroupEntry {
                            binding: 3,
                            resource: binding(&b.x.0, b.x.1, b.x.2),
                        },
                        wgpu::BindGroupEntry {
                            binding: 4,
                            resource: binding(&b.y.0, b.y.1, b.y.2),
                        },
                    ],
                })
            });
            groups.push(group.clone());
        }
        let mut attention_groups: Vec<(wgpu::BindGroup, Pipelines)> = Vec::with_capacity(attention.len());
        for a in attention {
            let p = &a.plan;
            let c = self
                .attn
                .caches
                .get(&a.cache)
                .ok_or_else(|| GpuError::InvalidArgument(format!("no kv-cache {}", a.cache)))?;
            let (k, v, kv_bytes) = (
                c.k.clone(),
                c.v.clone(),
                4 * c.slots as u64 * c.width as u64,
            );
            let key = [
                (apb.clone(), 0, 0),
                (a.q.0.clone(), a.q.1, p.q_bytes),
                (k.clone(), 0, kv_bytes),
                (v.clone(), 0, kv_bytes),
                (a.out.0.clone(), a.out.1, p.out_bytes),
            ];
            if let Some(g) = self.block_buffers.attention.get(&key) {
                attention_groups.push(g.clone());
                continue;
            }
            let made = self.attention_group(p, &apb, (&a.q.0, a.q.1), (&k, &v, kv_bytes), (&a.out.0, a.out.1))?;
            let m = &mut self.block_buffers;
            if m.attention.len() >= MAX_CACHED_GROUPS {
                m.attention.clear();
            }
            m.attention.insert(key, made.clone());
            attention_groups.push(made);
        }

        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("blocks"),
            });
        let mut profile = self.profile_start(&rec);
        let mut pass: Option<wgpu::ComputePass<'static>> = None;
        for c in &rec.commands {
            match c {
                Command::Copy(src, from, dst, to, n) => {
                    drop(pass.take());
                    encoder.copy_buffer_to_buffer(src, *from, dst, *to, *n);
                }
                Command::Submit => {
                    drop(pass.take());
                    let next =
                        self.device
                            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                                label: Some("blocks"),
                            });
                    self.queue
                        .submit([std::mem::replace(&mut encoder, next).finish()]);
                }
                Command::Kernels(range) => {
                    for i in range.clone() {
                        if let Some(prof) = &mut profile {
                            drop(pass.take());
                            let name = rec.dispatches[i].kernel.entry();
                            pass = Some(prof.pass(&mut encoder, name));
                        }
                        let p = pass.get_or_insert_with(|| plain_pass(&mut encoder));
                        let d = &rec.dispatches[i];
                        let Some(pipeline) =
                            pipelines.get(&(d.kernel, rec.formats[i].0, rec.formats[i].1))
                        else {
                            return Err(GpuError::Unavailable(format!(
                                "no pipeline for {:?}",
                                d.kernel
                            )));
                        };
                        p.set_pipeline(pipeline);
                        p.set_bind_group(0, &groups[d.job], &[(i as u64 * stride) as u32]);
                        p.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
                    }
                }
                Command::Attention(l) => {
                    if let Some(prof) = &mut profile {
                        drop(pass.take());
                        pass = Some(prof.pass(&mut encoder, "attention"));
                    }
                    let p = pass.get_or_insert_with(|| plain_pass(&mut encoder));
                    let (group, pipelines) = &attention_groups[*l];
                    attention[*l].plan.record(p, pipelines, group, attn_at[*l]);
                }
            }
        }
        drop(pass);
        if let Some(prof) = &profile {
            prof.resolve(&mut encoder);
        }
        self.queue.submit([encoder.finish()]);
        let recorded = started.elapsed();
        let result = self.read_back(staging, bytes, read);
        if self.host_times {
            let back = started.elapsed() - recorded;
            eprintln!(
                "recorded call: {} dispatches, {} attentions, {} commands; recorded in {} us, read back {} us later",
                rec.dispatches.len(),
                attention.len(),
                rec.commands.len(),
                recorded.as_micros(),
                back.as_micros()
            );
        }
        if let Some(prof) = profile {
            let ticks = self.read_back(&prof.read, 8 * prof.names.len() as u64 * 2, |view| {
                bytemuck::pod_collect_to_vec::<u8, u64>(view)
            });
            if let Ok(ticks) = ticks {
                prof.print(&ticks);
            }
        }
        self.finish(scopes).and(result)
    }

    /// With WISP_PROFILE=1 and timestamp queries: a query set for every dispatch and every
    /// attention of `rec`.
    fn profile_start(&self, rec: &Recording) -> Option<Profile> {
        let timer = self.timer.as_ref().filter(|_| self.profile)?;
        let attentions = rec
            .commands
            .iter()
            .filter(|c| matches!(c, Command::Attention(_)))
            .count();
        let count = (2 * (rec.dispatches.len() + attentions)).min(4096) as u32;
        let bytes = 8 * count as u64;
        let buffer = |label, usage| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        Some(Profile {
            queries: self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("blocks profile"),
                ty: wgpu::QueryType::Timestamp,
                count,
            }),
            resolve: buffer(
                "blocks profile",
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            ),
            read: buffer(
                "blocks profile readback",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            count,
            period_ns: timer.period_ns as f64,
            names: Vec::new(),
        })
    }
}
