//! Programs on the wgpu device: a whole run of a program (every op, every sequence of its
//! batch) in one recording, one readback of its outputs.
//!
//! Each value lives in a slot, a buffer kept across runs (grown as needed); a value takes the
//! first slot whose last value has had its last reader, so a model's run needs a few slots
//! however many layers it has, and a decode step binds what the step before it bound (its bind
//! groups come from the cache `record` keeps). The inputs go up first, each to a slot of its
//! own. Products are the kernels `plan` picks (`product_into`); attention is `attention.wgsl`
//! over each sequence's cache; the other ops are the small kernels at the end of
//! `shaders/matmul.wgsl` (cache writes and last rows are `copy_rows`). Outputs are copied to
//! one staging buffer. A `top-k` is each chunk's top on the device (`top_k_chunks`), of which
//! the host takes the row's (a decode step reads back 2 KB, not the vocabulary's 1 MB); where
//! that would read back more than the row, the host takes it from the row.
//!
//! Fusions (the host's business, not the contract's): an rms-norm with the add or the rotation
//! that alone reads it, and a norm, the add after it and the norm of that sum (a block's norm
//! after a product, its residual add and the norm before the next product: their weights
//! joined on the device), each as one `rms_norm_runs`; at one row, consecutive products of one
//! input (q, k and v; gate and up) as one product over a joint weight (their rows stacked on
//! the device when the program is made, each product's first row at a bindable offset: device
//! memory for a copy of those weights, outside the guest's budget; WISP_JOINTS=0 turns it off,
//! and the joined norm weights with it), and a gated op of a joint's gate and up that only the
//! next product reads, as that product reading act(gate) * up as its x (X_ACT).
//!
//! [`WgpuBackend::records`] says which runs this covers: products over rows of whole steps of
//! 8 values, and queries of every sequence of a batch at an offset the device can bind. The
//! rest is interpreted op by op (`program::run`).

use super::record::{AttentionBind, Bind, Buffers, Command, Recording, entire, whole};
use super::{Kernel, Params, WORKGROUP, Weight, WgpuBackend, X_PLAIN, align_up, push_scopes, x_act};
use crate::gpu::program::{self, Op, Output, Program, Rows, SequenceRun};
use crate::gpu::{Activation, AttentionShape, BufferId, Format, GpuError, Rotation};
use std::collections::HashMap;
use std::ops::Range;

/// Dispatches a command buffer holds before it is submitted, at the next op's boundary: the
/// device starts on the first ops while the host records the rest. The first is submitted
/// sooner: until then the device waits.
const SUBMIT_DISPATCHES: usize = 48;
const SUBMIT_FIRST: usize = 8;

/// `elementwise_rows`'s op codes (OP_* in the shader).
const OP_ADD: u32 = 0;
const OP_MUL: u32 = 1;
const OP_SCALE: u32 = 2;
const OP_BIAS: u32 = 3;
const OP_GELU_TANH: u32 = 4;
const OP_SILU: u32 = 5;
const OP_SOFTCAP: u32 = 6;

/// `rms_norm_runs`'s flags (NORM_OP_* in the shader).
const NORM_OP_WEIGHT: u32 = 1;
const NORM_OP_ADD: u32 = 2;
const NORM_OP_ROTATE: u32 = 4;
const NORM_OP_PAIRS: u32 = 8;
const NORM_OP_NEXT: u32 = 16;

/// The constants above under their names in the shader (for `layout_checks`).
#[cfg(test)]
pub(super) const SHADER_CONSTANTS: &[(&str, u64)] = &[
    ("OP_ADD", OP_ADD as u64),
    ("OP_MUL", OP_MUL as u64),
    ("OP_SCALE", OP_SCALE as u64),
    ("OP_BIAS", OP_BIAS as u64),
    ("OP_GELU_TANH", OP_GELU_TANH as u64),
    ("OP_SILU", OP_SILU as u64),
    ("OP_SOFTCAP", OP_SOFTCAP as u64),
    ("NORM_OP_WEIGHT", NORM_OP_WEIGHT as u64),
    ("NORM_OP_ADD", NORM_OP_ADD as u64),
    ("NORM_OP_ROTATE", NORM_OP_ROTATE as u64),
    ("NORM_OP_PAIRS", NORM_OP_PAIRS as u64),
    ("NORM_OP_NEXT", NORM_OP_NEXT as u64),
];

/// Where a run's values live: the slot of each value and the bytes of each slot.
struct Layout {
    /// The slot of each op's value (`usize::MAX` for ops that make none).
    slot: Vec<usize>,
    /// The byte of its slot where each value starts (0 but for the products of a joint).
    offset: Vec<u64>,
    /// Bytes of each slot, a multiple of 16.
    bytes: Vec<u64>,
}

/// An output of a run in the staging buffer.
#[derive(Clone, Copy)]
struct Readback {
    /// Its first byte there.
    at: u64,
    /// Its values.
    values: u64,
    /// What they are.
    top: Top,
}

/// What a [`Readback`] holds.
#[derive(Clone, Copy)]
enum Top {
    /// The rows of an `output`.
    No,
    /// The rows of a `top-k`'s x, of `width` values, whose top `k` the host takes.
    Rows { k: u32, width: u32 },
    /// A `top-k`'s candidates, `per_row` (value, column) pairs a row, as `top_k_chunks`
    /// writes them (see [`device_top`]).
    Candidates { k: u32, per_row: u32 },
}

/// The rows of the run whose buffers a program's making sizes ([`WgpuBackend::size_buffers`]):
/// the largest pass of a prompt the guest sends (its DEVICE_BATCH).
const PREPARED_ROWS: u32 = 512;
/// The most bytes of outputs a program's sizing provides for.
const PREPARED_READBACK: u64 = 16 << 20;

/// `top_k_chunks`'s chunk of a row (TOP_CHUNK in the shader).
pub(super) const TOP_CHUNK: u32 = 1024;

/// The candidates `top_k_chunks` writes a row for a top `k` of rows of `width`, where the
/// device takes them: rows whose columns are exact as f32s (at most 2^24), and fewer values
/// back than the row's (else the row comes back and the host takes its top).
fn device_top(k: u32, width: u32) -> Option<u32> {
    let per_row = 2 * width.div_ceil(TOP_CHUNK) as u64 * k.min(TOP_CHUNK) as u64;
    (width <= 1 << 24 && per_row < width as u64).then_some(per_row as u32)
}

/// How the recorder fuses an op with the one after it (the host's business, not the
/// contract's): the op's value is read by that next op alone, and one kernel makes both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fuse {
    /// Recorded as it is.
    No,
    /// An rms-norm whose value the next op (an add) adds to `other`: `rms_norm_runs` with
    /// NORM_OP_ADD.
    Add { other: usize },
    /// An rms-norm of heads that the next op turns by `table`: `rms_norm_runs` with
    /// NORM_OP_ROTATE.
    Rotate { table: usize, rotation: Rotation },
    /// An rms-norm of rows whose value the next op adds to `other`, and whose sum the op after
    /// that norms by the program's weight `weight` (the same eps, neither with an offset): a
    /// block's norm after a product, its residual add and the next norm before a product, as
    /// one `rms_norm_runs` with NORM_OP_ADD and NORM_OP_NEXT, which writes the sum and, beside
    /// it in the sum's slot, its norm.
    AddNorm { other: usize, weight: usize },
    /// The add of an [`Fuse::AddNorm`], recorded by the op before it (as is the norm after it).
    Within,
}

/// What each op fuses with the next (see [`Fuse`]).
fn fusions(p: &Program) -> Vec<Fuse> {
    let mut fuse = vec![Fuse::No; p.ops.len()];
    let width = |a: usize| p.shapes[a].map_or(0, |s| s.width);
    let mut i = 0;
    while i + 1 < p.ops.len() {
        let Op::RmsNorm { weight, offset, group, eps, .. } = p.ops[i] else {
            i += 1;
            continue;
        };
        if p.last_use[i] != i + 1 {
            i += 1;
            continue;
        }
        fuse[i] = match p.ops[i + 1] {
            Op::Add(a, b) if (a == i) != (b == i) => {
                let other = if a == i { b } else { a };
                let whole = weight.is_some() && offset == 0.0 && group == width(i);
                match p.ops.get(i + 2) {
                    Some(&Op::RmsNorm { x, weight: Some(next), offset: 0.0, group: g, eps: e }) if whole && x == i + 1 && g == group && e == eps => {
                        Fuse::AddNorm { other, weight: next }
                    }
                    _ => Fuse::Add { other },
                }
            }
            // Not by the norm's own value: the fused kernel never makes that.
            Op::Rotate { x, table, head_dim, rotation } if x == i && table != i && head_dim == group => Fuse::Rotate { table, rotation },
            _ => Fuse::No,
        };
        i += match fuse[i] {
            Fuse::No => 1,
            Fuse::AddNorm { .. } => {
                fuse[i + 1] = Fuse::Within;
                3
            }
            _ => 2,
        };
    }
    fuse
}

/// Gives each value a slot: the inputs first (they are written before anything runs, so each
/// keeps its own until its last reader), then each other value, in order, the first slot whose
/// values have all been read by the op before it (before the first op of a fused pair, for the
/// value the pair makes). `size` is each value's bytes. A value `share` names as `(first,
/// offset)` lives in `first`'s slot at that offset (the products of a joint; `size(first)` is
/// the joint's bytes), which stays busy until its last value's last reader. `last_use` is the
/// last op reading each value (the program's, or later where the recording reads it later).
fn layout(p: &Program, fuse: &[Fuse], share: &[Option<(usize, u64)>], last_use: &[usize], size: impl Fn(usize) -> u64) -> Layout {
    let n = p.ops.len();
    let mut slot = vec![usize::MAX; n];
    let mut offset = vec![0u64; n];
    // Each slot's bytes and the last op reading the value it holds.
    let mut slots: Vec<(u64, usize)> = Vec::new();
    let inputs = (0..n).filter(|&i| matches!(p.ops[i], Op::Input { .. }));
    let others = (0..n).filter(|&i| p.shapes[i].is_some() && !matches!(p.ops[i], Op::Input { .. }));
    let born = |i: usize| if i > 0 && fuse[i - 1] != Fuse::No { i - 1 } else { i };
    for (born, i) in inputs.map(|i| (0, i)).chain(others.map(|i| (born(i), i))) {
        if let Some((first, at)) = share.get(i).copied().flatten().filter(|&(f, _)| f != i) {
            let s = slot[first];
            if let Some(held) = slots.get_mut(s) {
                held.1 = held.1.max(last_use[i]);
                (slot[i], offset[i]) = (s, at);
                continue;
            }
        }
        let bytes = align_up(size(i).max(16), 16);
        let busy_until = last_use[i];
        match slots.iter().position(|&(_, until)| until < born) {
            Some(s) => {
                slots[s] = (slots[s].0.max(bytes), busy_until);
                slot[i] = s;
            }
            None => {
                slots.push((bytes, busy_until));
                slot[i] = slots.len() - 1;
            }
        }
    }
    Layout { slot, offset, bytes: slots.into_iter().map(|(b, _)| b).collect() }
}

/// Runs of two or more consecutive products of one input, in one format and at one precision
/// (q, k and v; gate and up). At one row of x, the recorder runs each such run as one product
/// over a joint weight: the products' rows stacked, each one's first row where its output
/// starts at an offset the device can bind (`joint_rows`).
fn joint_runs(p: &Program) -> Vec<Range<usize>> {
    let product = |i: usize| match p.ops.get(i) {
        Some(&Op::Matmul { x, weight, precision }) => p.weights.get(weight).map(|w| (x, w.format, w.cols, precision)),
        _ => None,
    };
    let mut runs = Vec::new();
    let mut i = 0;
    while i < p.ops.len() {
        let Some(first) = product(i) else {
            i += 1;
            continue;
        };
        let mut j = i + 1;
        while product(j) == Some(first) {
            j += 1;
        }
        if j - i >= 2 {
            runs.push(i..j);
        }
        i = j;
    }
    runs
}

/// The weights of the products `run`.
fn joint_ids(p: &Program, run: Range<usize>) -> Vec<BufferId> {
    run.filter_map(|i| match p.ops[i] {
        Op::Matmul { weight, .. } => p.weights.get(weight).map(|w| w.id),
        _ => None,
    })
    .collect()
}

/// The first row of each of the products of `rows` rows in a joint weight (each one's first
/// output at a multiple of `align` values), and the joint's rows.
fn joint_rows(rows: &[u32], align: u32) -> (Vec<u32>, u64) {
    let (mut firsts, mut end) = (Vec::with_capacity(rows.len()), 0u64);
    for &r in rows {
        let first = end.div_ceil(align.max(1) as u64) * align.max(1) as u64;
        firsts.push(first as u32);
        end = first + r as u64;
    }
    (firsts, end)
}

impl WgpuBackend {
    /// The joint weight of the weights `ids` (see [`joint_runs`]) and the first row of each
    /// there: made on first use, by copies on the device, and kept until one of them is
    /// written or freed. `None` where they differ in format or columns, or the joint would not
    /// fit one binding, or making it failed (the products then run one by one).
    pub(super) fn joint(&mut self, ids: &[BufferId]) -> Option<(BufferId, Vec<u32>)> {
        if let Some(j) = self.joints.get(ids) {
            return Some(j.clone());
        }
        if !self.join {
            return None;
        }
        let ws: Vec<&Weight> = ids.iter().map(|id| self.weights.get(id)).collect::<Option<_>>()?;
        let w0 = *ws.first()?;
        if ws.iter().any(|w| w.format != w0.format || w.n_in != w0.n_in || !w.parts.is_empty()) {
            return None;
        }
        let align = self.x_align();
        let (firsts, rows) = joint_rows(&ws.iter().map(|w| w.n_out).collect::<Vec<_>>(), align);
        let (row_data, row_scales) = (w0.row_quads as u64 * 16, w0.scale_row as u64 * 4);
        let max = self.max_binding;
        if rows > u32::MAX as u64 || rows * row_data > max || rows * row_scales > max {
            return None;
        }
        // The joint weights together take at most the bytes of the weights the guest holds:
        // however a guest combines its weights in programs, they at most double its memory.
        let bytes = |w: &Weight| w.data.size() + w.scales.as_ref().map_or(0, |s| s.size());
        let joints: Vec<BufferId> = self.joints.values().map(|(id, _)| *id).collect();
        let (mut held, mut joined) = (0u64, rows * (row_data + row_scales));
        for (id, w) in &self.weights {
            *(if joints.contains(id) { &mut joined } else { &mut held }) += bytes(w);
        }
        if joined > held {
            return None;
        }
        let scopes = push_scopes(&self.device);
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let make = |label, bytes| {
            self.device.create_buffer(&wgpu::BufferDescriptor { label: Some(label), size: bytes, usage, mapped_at_creation: false })
        };
        // The rows between two products stay zero (buffers start zeroed): outputs never read.
        let data = make("joint weights", rows * row_data);
        let scales = w0.scales.as_ref().map(|_| make("joint scales", rows * row_scales));
        let mut encoder = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("joint weights") });
        for (w, &first) in ws.iter().zip(&firsts) {
            encoder.copy_buffer_to_buffer(&w.data, 0, &data, first as u64 * row_data, w.n_out as u64 * row_data);
            if let (Some(from), Some(to)) = (&w.scales, &scales) {
                encoder.copy_buffer_to_buffer(from, 0, to, first as u64 * row_scales, w.n_out as u64 * row_scales);
            }
        }
        self.queue.submit([encoder.finish()]);
        let joint = Weight { n_out: rows as u32, data, scales, parts: Vec::new(), ..*w0 };
        self.finish(scopes).ok()?;
        let id = self.next;
        self.next += 1;
        self.weights.insert(id, joint);
        self.joints.insert(ids.to_vec(), (id, firsts.clone()));
        Some((id, firsts))
    }

    /// The values a product's first output is aligned to in a joint weight: where a binding
    /// may start, and where a product reading a gated pair with X_ACT looks for up (X_ALIGN).
    pub(super) fn x_align(&self) -> u32 {
        self.limits.min_storage_buffer_offset_alignment.max(16) / 4
    }

    /// Forgets the joint weights made from weight `id` (written or freed).
    pub(super) fn forget_joints(&mut self, id: BufferId) {
        if self.joints.is_empty() {
            return;
        }
        let stale: Vec<Vec<BufferId>> = self.joints.keys().filter(|ids| ids.contains(&id)).cloned().collect();
        if stale.is_empty() {
            return;
        }
        for ids in stale {
            if let Some((joint, _)) = self.joints.remove(&ids) {
                self.weights.remove(&joint);
            }
        }
        self.recorded.forget_groups();
    }

    /// Whether [`Self::run_recorded`] runs `p` over `batch`: every product's x has rows of
    /// whole steps (a multiple of 8 values), every weight is here, each row and each run of a
    /// norm fits the device's workgroup counts, and each sequence's queries start where the
    /// device can bind them.
    pub(super) fn records(&self, p: &Program, batch: &[SequenceRun]) -> bool {
        let max_dim = self.limits.max_compute_workgroups_per_dimension.max(1) as u64;
        let align = self.limits.min_storage_buffer_offset_alignment.max(4) as u64;
        let width = |a: usize| p.shapes[a].map_or(0, |s| s.width) as u64;
        if p.weights.iter().any(|w| !self.weights.contains_key(&w.id)) {
            return false;
        }
        p.ops.iter().enumerate().all(|(i, op)| {
            let fits = width(i).div_ceil(WORKGROUP as u64) <= max_dim;
            fits && match *op {
                Op::Matmul { x, .. } => width(x).is_multiple_of(8),
                Op::RmsNorm { x, group, .. } => width(x) / group as u64 <= max_dim,
                Op::Attention { q, .. } => {
                    let mut at = 0u64;
                    batch.iter().all(|s| {
                        let aligned = (4 * at * width(q)).is_multiple_of(align);
                        at += s.rows as u64;
                        aligned
                    })
                }
                _ => true,
            }
        })
    }

    /// Builds the pipelines a run of `p` can use, so that its first run does not wait for
    /// them: the products' kernels for every size of batch `matmul` picks among, the small
    /// kernels and attention's.
    pub(super) fn prepare(&mut self, p: &Program) -> Result<(), GpuError> {
        let mut wanted = vec![
            (Kernel::ElementwiseRows, Format::F32),
            (Kernel::RmsNormRuns, Format::F32),
            (Kernel::RotateRows, Format::F32),
            (Kernel::CopyRows, Format::F32),
            (Kernel::ScatterRows, Format::F32),
            (Kernel::SumPlanes, Format::F32),
            (Kernel::PlaceColumns, Format::F32),
            (Kernel::TopKChunks, Format::F32),
        ];
        for op in &p.ops {
            if let Op::Matmul { weight, precision, .. } = *op {
                let w = &p.weights[weight];
                for t in [1, super::GEMM_MIN_T, super::TILE + 1, super::WIDE_MIN_T, super::LARGE_T] {
                    let (kernel, _, _) = self.kernel_for(t, w.rows, w.format, precision);
                    if !wanted.contains(&(kernel, w.format)) {
                        wanted.push((kernel, w.format));
                    }
                }
            }
        }
        for (kernel, format) in wanted {
            self.pipeline(kernel, format, X_PLAIN)?;
        }
        for run in joint_runs(p) {
            self.joint(&joint_ids(p, run));
        }
        for (i, fuse) in fusions(p).into_iter().enumerate() {
            if let (Fuse::AddNorm { weight, .. }, Op::RmsNorm { weight: Some(first), .. }) = (fuse, p.ops[i]) {
                self.joint(&[p.weights[first].id, p.weights[weight].id]);
            }
        }
        // A product reading a gated pair as its x (at one row: see `run_recorded`).
        for (op, next) in p.ops.iter().zip(p.ops.iter().skip(1)) {
            if let (&Op::Gated { act, .. }, &Op::Matmul { weight, precision, .. }) = (op, next) {
                let w = &p.weights[weight];
                let (kernel, _, _) = self.kernel_for(1, w.rows, w.format, precision);
                self.pipeline(kernel, w.format, x_act(act))?;
            }
        }
        if p.ops.iter().any(|op| matches!(op, Op::Attention { .. })) {
            self.attention_pipeline()?;
        }
        self.size_buffers(p);
        Ok(())
    }

    /// Runs a checked program over a checked batch (see [`Self::records`]) in one recording.
    pub(super) fn run_recorded(
        &mut self,
        p: &Program,
        inputs: &[Vec<f32>],
        batch: &[SequenceRun],
    ) -> Result<Vec<Output>, GpuError> {
        self.recorded_run(p, Some(inputs), batch)
    }

    /// Makes the buffers a run of `p` over one sequence of PREPARED_ROWS rows needs, as that
    /// run would (nothing recorded, no cache touched): a process's first prompt then finds
    /// them made (H200: making them took 18-23 ms of its first 512-token pass, as long as
    /// the pass itself). Best effort: a program too large for it is sized by its first run.
    fn size_buffers(&mut self, p: &Program) {
        // Not for a program that reads back every row (a vocabulary's logits for each of 512
        // rows would be 512 MB): sized by its first run, as it uses it.
        let read_back: u64 = p.ops.iter().map(|op| match *op {
            Op::Output(x) | Op::TopK { x, .. } => p.shapes[x].map_or(0, |s| 4 * s.width as u64 * if s.rows == Rows::Sequence { 1 } else { PREPARED_ROWS as u64 }),
            _ => 0,
        }).sum();
        if read_back > PREPARED_READBACK {
            return;
        }
        let caches: Vec<_> = p.caches.iter().map(|c| (0, PREPARED_ROWS, c.width.unwrap_or(0))).collect();
        let batch = [SequenceRun { rows: PREPARED_ROWS, start: 0, caches }];
        // Only what a run of those rows may ask for: each value within the device's limit
        // (as `check_batch` holds a run's), whatever the guest's program.
        let max_elems = self.info.max_activation_elements;
        let rows = |s: &program::Shape| if s.rows == Rows::Token { PREPARED_ROWS as u64 } else { 1 };
        let within = p.shapes.iter().flatten().all(|s| s.width as u64 * rows(s) <= max_elems);
        if within && self.records(p, &batch) {
            let _ = self.recorded_run(p, None, &batch);
        }
    }

    /// [`Self::run_recorded`], or with no inputs [`Self::size_buffers`]'s sizing alone.
    fn recorded_run(
        &mut self,
        p: &Program,
        inputs: Option<&[Vec<f32>]>,
        batch: &[SequenceRun],
    ) -> Result<Vec<Output>, GpuError> {
        self.last_kernel_ns = None;
        self.live()?;
        let planning = std::time::Instant::now();
        let total: u32 = batch.iter().map(|q| q.rows).sum();
        let rows_of = |a: usize| match p.shapes[a].map(|s| s.rows) {
            Some(Rows::Sequence) => batch.len() as u32,
            _ => total,
        };
        let width = |a: usize| p.shapes[a].map_or(0, |s| s.width);
        let bytes_of = |a: usize| 4 * rows_of(a) as u64 * width(a) as u64;
        let max = self.max_binding;

        // The sequences whose caches of an index share an arena, for each cache index where
        // two or more do: then each group's cache writes and attention run over a table of its
        // rows, one dispatch (and a merge) a group (`scatter_rows`, `attend_rows`).
        let mut grouped: HashMap<u32, Vec<Vec<usize>>> = HashMap::new();
        if batch.len() > 1 {
            for op in &p.ops {
                if let Op::CacheWrite { cache, .. } | Op::Attention { cache, .. } = *op {
                    grouped.entry(cache).or_insert_with(|| self.arena_groups(batch, cache));
                }
            }
            grouped.retain(|_, g| g.iter().any(|g| g.len() > 1));
        }
        // Each sequence's first row in the batch.
        let first_row: Vec<u32> = batch.iter().scan(0, |at, q| Some(std::mem::replace(at, *at + q.rows))).collect();
        // Attention's plans first: their partial sums follow the outputs in the value's slot
        // (each sequence's after its own outputs, overwritten by the next sequence's outputs
        // once read: the dispatches run in order; a table's after all the outputs).
        let mut plans: Vec<Vec<Planned>> = Vec::new();
        let mut extra = vec![0u64; p.ops.len()];
        for (i, op) in p.ops.iter().enumerate() {
            let Op::Attention { q: qv, cache, n_head, n_head_kv, head_dim, window, scale, softcap, .. } = *op else { continue };
            let w = width(qv) as u64;
            let (mut end, mut list) = (0u64, Vec::with_capacity(batch.len()));
            match grouped.get(&cache) {
                Some(groups) => {
                    for g in groups {
                        let entries = g.iter().map(|&s| batch[s].rows).sum();
                        let alone = |s: usize| alone_shape(&batch[s], window, AttentionShape { t: 0, n_keys: 0, n_head, n_head_kv, head_dim, window, scale, softcap });
                        let n_keys = g.iter().map(|&s| alone(s).n_keys).max().unwrap_or(1);
                        let splits = g.iter().map(|&s| super::attention::splits_for(&alone(s)).0).max().unwrap_or(1);
                        let shape = AttentionShape { t: entries, n_keys, n_head, n_head_kv, head_dim, window, scale, softcap };
                        let plan = self.attention_plan(total as u64 * w, &shape, 0, 1, total, Some(splits))?;
                        end = end.max(plan.out_bytes);
                        list.push(Planned { plan, seqs: g.clone() });
                    }
                }
                None => {
                    for (s, q) in batch.iter().enumerate() {
                        let (_, slots, _) = q.caches[cache as usize];
                        let first = program::first_key(q.start, window);
                        let shape = AttentionShape { t: q.rows, n_keys: q.start + q.rows - first, n_head, n_head_kv, head_dim, window, scale, softcap };
                        let plan = self.attention_plan(q.rows as u64 * w, &shape, first % slots, slots, q.rows, None)?;
                        end = end.max(4 * first_row[s] as u64 * w + plan.out_bytes);
                        list.push(Planned { plan, seqs: vec![s] });
                    }
                }
            }
            extra[i] = end - bytes_of(i);
            plans.push(list);
        }
        let mut fuse = fusions(p);
        let mut share: Vec<Option<(usize, u64)>> = vec![None; p.ops.len()];
        // The two weights of each norm-add-norm side by side in a joint weight (the second
        // from the element `beside` says), its second norm's value beside the sum in the sum's
        // slot, at an offset the device can bind; the plain pair where the joint is not made.
        let bind_align = self.x_align() as u64 * 4;
        let mut beside: Vec<Option<(BufferId, u32)>> = vec![None; p.ops.len()];
        for i in 0..p.ops.len() {
            let (Fuse::AddNorm { other, weight }, Op::RmsNorm { weight: Some(first), .. }) = (fuse[i], p.ops[i]) else { continue };
            match self.joint(&[p.weights[first].id, p.weights[weight].id]) {
                Some((id, firsts)) => {
                    let row = self.weights.get(&id).map_or(0, |w| 4 * w.row_quads);
                    beside[i] = Some((id, firsts[1] * row));
                    let at = align_up(bytes_of(i + 1), bind_align);
                    share[i + 2] = Some((i + 1, at));
                    extra[i + 1] = at + bytes_of(i + 2) - bytes_of(i + 1);
                }
                None => (fuse[i], fuse[i + 1]) = (Fuse::Add { other }, Fuse::No),
            }
        }
        // Products of one input at one row run as one product over their joint weight, each
        // one's value at its offset in the joint's slot.
        let mut joint_made: Vec<Option<(BufferId, u64)>> = vec![None; p.ops.len()];
        for run in joint_runs(p) {
            let Op::Matmul { x, .. } = p.ops[run.start] else { continue };
            if rows_of(x) != 1 {
                continue;
            }
            let Some((id, firsts)) = self.joint(&joint_ids(p, run.clone())) else { continue };
            let rows = self.weights.get(&id).map_or(0, |w| w.n_out as u64);
            joint_made[run.start] = Some((id, 4 * rows));
            for (i, first) in run.clone().zip(firsts) {
                share[i] = Some((run.start, 4 * first as u64));
            }
        }
        // A gated op of two consecutive products of a joint (up where X_ACT looks for it)
        // whose value only the next op, a product, reads: that product reads act(gate) * up as
        // its x (X_ACT), and the gated op is not recorded.
        let x_align = self.x_align() as u64;
        let mut gated_into: Vec<Option<(usize, usize, u32)>> = vec![None; p.ops.len()];
        for (i, op) in p.ops.iter().enumerate() {
            let Op::Gated { gate, up, act } = *op else { continue };
            let (Some((fg, og)), Some((fu, ou))) = (share[gate], share[up]) else { continue };
            let read_by_product = matches!(p.ops.get(i + 1), Some(&Op::Matmul { x, .. }) if x == i);
            if fg == fu && ou == og + 4 * align_up(width(gate) as u64, x_align) && read_by_product && p.last_use[i] == i + 1 && share[i + 1].is_none() {
                gated_into[i + 1] = Some((gate, up, x_act(act)));
            }
        }
        // The gate and up of such a pair are read by that product.
        let mut last_use = p.last_use.clone();
        for (d, g) in gated_into.iter().enumerate() {
            if let Some((gate, up, _)) = *g {
                last_use[gate] = last_use[gate].max(d);
                last_use[up] = last_use[up].max(d);
            }
        }
        let lay = layout(p, &fuse, &share, &last_use, |i| joint_made[i].map_or(bytes_of(i) + extra[i], |(_, bytes)| bytes));
        // The partial sums of products split over k, and the products of the parts of weights
        // held in parts (each part's product there before its columns are placed).
        let mut parts_bytes = 16;
        let mut split_bytes = 16;
        for op in &p.ops {
            if let Op::Matmul { x, weight, precision } = *op {
                let w = self.weights.get(&p.weights[weight].id).ok_or_else(|| GpuError::InvalidArgument(format!("no weight {weight}")))?;
                let pieces: Vec<&Weight> = match w.parts.as_slice() {
                    [] => vec![w],
                    parts => parts.iter().filter_map(|(id, _)| self.weights.get(id)).collect(),
                };
                for piece in pieces {
                    let n = self.k_splits(piece, rows_of(x), precision) as u64;
                    if n > 1 {
                        parts_bytes = parts_bytes.max(align_up(n * 4 * rows_of(x) as u64 * piece.n_out as u64, 16));
                    }
                    if !w.parts.is_empty() {
                        split_bytes = split_bytes.max(align_up(4 * rows_of(x) as u64 * piece.n_out as u64, 16));
                    }
                }
            }
        }
        // A top-k's candidates are written to the partial sums' buffer, then copied.
        let read_bytes = |op: &Op| match *op {
            Op::TopK { x, k } => match device_top(k, width(x)) {
                Some(per_row) => (4 * per_row as u64 * rows_of(x) as u64, Top::Candidates { k, per_row }),
                None => (bytes_of(x), Top::Rows { k, width: width(x) }),
            },
            Op::Output(x) => (bytes_of(x), Top::No),
            _ => (0, Top::No),
        };
        for op in &p.ops {
            if let (bytes, Top::Candidates { .. }) = read_bytes(op) {
                parts_bytes = parts_bytes.max(align_up(bytes, 16));
            }
        }
        let out_bytes: u64 = p.ops.iter().map(|op| read_bytes(op).0).sum();
        if lay.bytes.iter().chain([&parts_bytes, &split_bytes, &out_bytes]).any(|&b| b > max) {
            return Err(GpuError::OutOfMemory(format!("a run of {total} rows needs buffers past the device's limit of {max} bytes")));
        }

        let scopes = push_scopes(&self.device);
        let cap = self.limits.max_buffer_size;
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        let m = &mut self.recorded;
        m.slots.resize(m.slots.len().max(lay.bytes.len()), None);
        let slots: Vec<wgpu::Buffer> = lay
            .bytes
            .iter()
            .enumerate()
            .map(|(s, &b)| Self::ensure(&self.device, &mut m.slots[s], b, cap, usage, "program values"))
            .collect();
        let parts_usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
        let parts = Self::ensure(&self.device, &mut m.parts, parts_bytes, cap, parts_usage, "partial sums");
        let split = Self::ensure(&self.device, &mut m.split, split_bytes, cap, wgpu::BufferUsages::STORAGE, "products of parts");
        let read = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        let staging = Self::ensure(&self.device, &mut m.staging, out_bytes, cap, read, "run staging");
        let Some(inputs) = inputs else {
            return self.finish(scopes).map(|_| Vec::new());
        };
        let input_ops = p.ops.iter().enumerate().filter(|(_, op)| matches!(op, Op::Input { .. }));
        for ((i, _), x) in input_ops.zip(inputs) {
            self.queue.write_buffer(&slots[lay.slot[i]], 0, bytemuck::cast_slice(x));
        }
        self.finish(scopes).inspect_err(|_| self.recorded = Buffers::default())?;

        // The tables of the grouped cache writes and attentions, by op, in order.
        let align = self.limits.min_storage_buffer_offset_alignment.max(16) as u64;
        let mut tables: Vec<u8> = Vec::new();
        let mut table_at: Vec<Vec<(u64, u64)>> = vec![Vec::new(); p.ops.len()];
        for (i, op) in p.ops.iter().enumerate() {
            if let Op::LastRows(x) = *op
                && batch.len() > 1
            {
                // (the sequence's row, none, its last token row, 0).
                let from = align_up(tables.len() as u64, align);
                tables.resize(from as usize, 0);
                for (s, q) in batch.iter().enumerate() {
                    let entry = [s as u32 * width(x), u32::MAX, first_row[s] + q.rows - 1, 0];
                    tables.extend_from_slice(bytemuck::cast_slice(&entry));
                }
                table_at[i].push((from, tables.len() as u64 - from));
                continue;
            }
            let (Op::CacheWrite { k: row_of, cache, .. } | Op::Attention { q: row_of, cache, .. }) = *op else { continue };
            let Some(groups) = grouped.get(&cache) else { continue };
            let shape = match *op {
                Op::Attention { n_head, n_head_kv, head_dim, window, scale, softcap, .. } => Some(AttentionShape { t: 0, n_keys: 0, n_head, n_head_kv, head_dim, window, scale, softcap }),
                _ => None,
            };
            for g in groups {
                let from = align_up(tables.len() as u64, align);
                tables.resize(from as usize, 0);
                for &s in g {
                    let q = &batch[s];
                    let (id, slots, _) = q.caches[cache as usize];
                    let c = self.attn.caches.get(&id).ok_or_else(|| GpuError::InvalidArgument(format!("no kv-cache {id}")))?;
                    let (k_at, v_at) = ((c.k_at / 4) as u32, (c.v_at / 4) as u32);
                    let w = width(row_of);
                    for j in 0..q.rows {
                        let row = first_row[s] + j;
                        match shape {
                            // (last key, first slot, slots, row), (keys at, values at, split
                            // length, 0): the sequence's own splits, as alone.
                            Some(shape) => {
                                let first = program::first_key(q.start, shape.window);
                                let split_len = super::attention::splits_for(&alone_shape(q, shape.window, shape)).1;
                                let entry = [q.start + j - first, first % slots, slots, row, k_at, v_at, split_len, 0];
                                tables.extend_from_slice(bytemuck::cast_slice(&entry));
                            }
                            // (key row at, value row at, row, 0).
                            None => {
                                let ring = (q.start + j) % slots * w;
                                tables.extend_from_slice(bytemuck::cast_slice(&[k_at + ring, v_at + ring, row, 0]));
                            }
                        }
                    }
                }
                table_at[i].push((from, tables.len() as u64 - from));
            }
        }
        let table = if tables.is_empty() {
            None
        } else {
            let scopes = push_scopes(&self.device);
            let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
            let b = Self::ensure(&self.device, &mut self.recorded.tables, tables.len() as u64, self.limits.max_buffer_size, usage, "run tables");
            self.queue.write_buffer(&b, 0, &tables);
            self.finish(scopes).inspect_err(|_| self.recorded = Buffers::default())?;
            Some(b)
        };

        let value = |a: usize| &slots[lay.slot[a]];
        let at = |a: usize| lay.offset[a];
        let bound = |a: usize| (value(a).clone(), at(a), value(a).size() - at(a));
        let placeholder = self.placeholder.clone();
        let vector = |w: usize| -> Result<wgpu::Buffer, GpuError> {
            self.weights
                .get(&p.weights[w].id)
                .map(|w| w.data.clone())
                .ok_or_else(|| GpuError::InvalidArgument(format!("no weight {w}")))
        };
        let max_dim = self.limits.max_compute_workgroups_per_dimension.max(1);
        let mut rec = Recording::default();
        let mut attention: Vec<AttentionBind> = Vec::new();
        let mut plans = plans.into_iter();
        let mut outputs: Vec<Readback> = Vec::new();
        let mut out_at = 0u64;
        // The first dispatch not yet in a command, and the first not yet submitted.
        let (mut open, mut submitted) = (0, 0);
        for (i, op) in p.ops.iter().enumerate() {
            if i > 0 && fuse[i - 1] != Fuse::No {
                continue;
            }
            // The value the op's kernel writes: the next op's, where they are fused.
            let made = if fuse[i] == Fuse::No { i } else { i + 1 };
            let t = rows_of(i);
            // A small kernel from x (and b from `scales`, a vector from `weights`) into op i's
            // value, `groups_x` workgroups a row.
            let small = |rec: &mut Recording, kernel, (x, scales, weights): (usize, Option<usize>, Option<wgpu::Buffer>), params: Params, groups_x| {
                let bind = rec.bind(Bind {
                    weights: entire(&weights.unwrap_or_else(|| placeholder.clone())),
                    scales: scales.map_or_else(|| entire(&placeholder), bound),
                    x: bound(x),
                    y: bound(made),
                });
                rec.rows(max_dim, kernel, bind, params, groups_x);
            };
            let rows_params = |n_out: u32| Params { n_in: 0, n_out, t, row_quads: 0, scale_row: 0, row_base: 0, t_base: 0, x_stride: 0 };
            let elementwise = |code: u32, by: f32| Params { row_base: code, x_stride: by.to_bits(), ..rows_params(width(i)) };
            let groups = width(i).div_ceil(WORKGROUP);
            match *op {
                Op::Input { .. } => {}
                Op::Matmul { x, weight, precision } => {
                    let (input, x_act) = match gated_into[i] {
                        Some((gate, _, act)) => ((value(gate), at(gate), value(gate).size() - at(gate)), act),
                        None => ((value(x), at(x), bytes_of(x)), X_PLAIN),
                    };
                    let (id, bytes) = match (share[i], joint_made[i]) {
                        // Made by the first product of its joint.
                        (Some((first, _)), _) if first != i => continue,
                        (_, Some(joint)) => joint,
                        _ => (p.weights[weight].id, bytes_of(i)),
                    };
                    self.product_into(&mut rec, (id, precision), input, (value(i), at(i), bytes), t, width(x) / 4, (&parts, &split), x_act)?;
                }
                Op::RmsNorm { x, weight, offset, group, eps } => {
                    let (mut weights, mut flags, offset) = match weight {
                        Some(w) => (Some(vector(w)?), NORM_OP_WEIGHT, offset),
                        None => (None, 0, 1.0),
                    };
                    // The operand from `scales`, row_quads and x_stride (see the shader).
                    let (b, row_quads, x_stride) = match fuse[i] {
                        Fuse::No | Fuse::Within => (None, 0, offset.to_bits()),
                        Fuse::Add { other } => {
                            flags |= NORM_OP_ADD;
                            (Some(other), 0, offset.to_bits())
                        }
                        Fuse::AddNorm { other, .. } => {
                            let (joint, second) = beside[i].ok_or_else(|| GpuError::InvalidArgument("no joint of a norm's weights".into()))?;
                            weights = self.weights.get(&joint).map(|w| w.data.clone());
                            flags |= NORM_OP_ADD | NORM_OP_NEXT;
                            (Some(other), ((at(i + 2) - at(i + 1)) / 4) as u32, second)
                        }
                        Fuse::Rotate { table, rotation } => {
                            flags |= NORM_OP_ROTATE | if rotation == Rotation::Pairs { NORM_OP_PAIRS } else { 0 };
                            (Some(table), width(table), offset.to_bits())
                        }
                    };
                    let params = Params { n_in: group, row_quads, scale_row: flags, row_base: eps.to_bits(), x_stride, ..rows_params(width(i)) };
                    small(&mut rec, Kernel::RmsNormRuns, (x, b, weights), params, width(i) / group);
                }
                Op::Add(a, b) => small(&mut rec, Kernel::ElementwiseRows, (a, Some(b), None), elementwise(OP_ADD, 0.0), groups),
                Op::Mul(a, b) => small(&mut rec, Kernel::ElementwiseRows, (a, Some(b), None), elementwise(OP_MUL, 0.0), groups),
                Op::Scale { x, by } => small(&mut rec, Kernel::ElementwiseRows, (x, None, None), elementwise(OP_SCALE, by), groups),
                Op::Softcap { x, cap } => small(&mut rec, Kernel::ElementwiseRows, (x, None, None), elementwise(OP_SOFTCAP, cap), groups),
                Op::Bias { x, weight } => small(&mut rec, Kernel::ElementwiseRows, (x, None, Some(vector(weight)?)), elementwise(OP_BIAS, 0.0), groups),
                // Read by the next product as it reads its x.
                Op::Gated { .. } if gated_into.get(i + 1).is_some_and(|g| g.is_some()) => {}
                Op::Gated { gate, up, act } => {
                    let code = match act {
                        Activation::GeluTanh => OP_GELU_TANH,
                        Activation::Silu => OP_SILU,
                    };
                    small(&mut rec, Kernel::ElementwiseRows, (gate, Some(up), None), elementwise(code, 0.0), groups);
                }
                Op::Rotate { x, table, head_dim, rotation } => {
                    let pairs = u32::from(rotation == Rotation::Pairs);
                    let params = Params { n_in: width(table), row_quads: head_dim, scale_row: pairs, ..rows_params(width(i)) };
                    small(&mut rec, Kernel::RotateRows, (x, Some(table), None), params, groups);
                }
                Op::CacheWrite { k, v, cache } => {
                    let w = width(k);
                    let groups = w.div_ceil(WORKGROUP);
                    // Each group of sequences whose caches share an arena in one dispatch over
                    // its table; each other sequence alone.
                    let mut tables = table_at[i].iter();
                    let alone: Vec<Vec<usize>> = (0..batch.len()).map(|s| vec![s]).collect();
                    for g in grouped.get(&cache).unwrap_or(&alone) {
                        let entries = tables.next();
                        let (id, slots, _) = batch[g[0]].caches[cache as usize];
                        let c = self.attn.caches.get(&id).ok_or_else(|| GpuError::InvalidArgument(format!("no kv-cache {id}")))?;
                        if let (Some(&(from, bytes)), Some(table), true) = (entries, &table, c.joint()) {
                            let bind = rec.bind(Bind { weights: (table.clone(), from, bytes), scales: bound(v), x: bound(k), y: entire(&c.k) });
                            let params = Params { n_out: w, t: (bytes / 16) as u32, ..rows_params(w) };
                            rec.rows(max_dim, Kernel::ScatterRows, bind, params, groups);
                            continue;
                        }
                        // A group of one.
                        let q = &batch[g[0]];
                        let params = Params { n_out: w, t: q.rows, row_quads: first_row[g[0]], scale_row: q.start % slots, x_stride: slots, ..rows_params(w) };
                        if c.joint() {
                            // Keys from x, values from `scales` to the cache's from n_in: one
                            // dispatch.
                            let bind = rec.bind(Bind { weights: entire(&placeholder), scales: bound(v), x: bound(k), y: (c.k.clone(), c.k_at, c.span()) });
                            let v_from = u32::try_from((c.v_at - c.k_at) / 4).map_err(|_| GpuError::OutOfMemory(format!("a kv-cache of {} bytes", c.span())))?;
                            rec.rows(max_dim, Kernel::CopyRows, bind, Params { n_in: v_from, ..params }, groups);
                        } else {
                            for (from, to) in [(k, &c.k), (v, &c.v)] {
                                let bind = rec.bind(Bind { weights: entire(&placeholder), scales: entire(&placeholder), x: bound(from), y: entire(to) });
                                rec.rows(max_dim, Kernel::CopyRows, bind, params, groups);
                            }
                        }
                    }
                }
                Op::Attention { q: qv, cache, .. } => {
                    rec.close_kernels(open);
                    let w = width(qv) as u64;
                    let mut tables = table_at[i].iter();
                    for Planned { plan, seqs } in plans.next().into_iter().flatten() {
                        let (id, _, _) = batch[seqs[0]].caches[cache as usize];
                        rec.commands.push(Command::Attention(attention.len()));
                        let (q, out, rings) = match tables.next() {
                            // Every row of the value bound; the table's rows read.
                            Some(&(from, bytes)) => {
                                let table = table.clone().ok_or_else(|| GpuError::InvalidArgument("no table".into()))?;
                                ((value(qv).clone(), at(qv)), (value(i).clone(), 0), Some((table, from, bytes)))
                            }
                            None => {
                                let row = first_row[seqs[0]] as u64;
                                ((value(qv).clone(), at(qv) + 4 * row * w), (value(i).clone(), 4 * row * w), None)
                            }
                        };
                        attention.push(AttentionBind { plan, cache: id, q, out, rings });
                    }
                    open = rec.dispatches.len();
                }
                Op::LastRows(x) if !table_at[i].is_empty() => {
                    let w = width(x);
                    let (from, bytes) = table_at[i][0];
                    let table = table.clone().ok_or_else(|| GpuError::InvalidArgument("no table".into()))?;
                    let bind = rec.bind(Bind { weights: (table, from, bytes), scales: entire(&placeholder), x: bound(x), y: bound(made) });
                    rec.rows(max_dim, Kernel::ScatterRows, bind, Params { n_out: w, t: batch.len() as u32, ..rows_params(w) }, w.div_ceil(WORKGROUP));
                }
                Op::LastRows(x) => {
                    let w = width(x);
                    let mut end = 0;
                    for (s, q) in batch.iter().enumerate() {
                        end += q.rows;
                        let params = Params { t: 1, row_quads: end - 1, scale_row: s as u32, x_stride: u32::MAX, ..rows_params(w) };
                        small(&mut rec, Kernel::CopyRows, (x, None, None), params, w.div_ceil(WORKGROUP));
                    }
                }
                Op::Output(x) | Op::TopK { x, .. } => {
                    let (n, top) = read_bytes(op);
                    let from = match top {
                        Top::Candidates { k, .. } => {
                            let bind = rec.bind(Bind { weights: entire(&placeholder), scales: entire(&placeholder), x: bound(x), y: whole(&parts, n) });
                            let params = Params { n_out: width(x), t: rows_of(x), row_quads: k, ..rows_params(0) };
                            rec.rows(max_dim, Kernel::TopKChunks, bind, params, width(x).div_ceil(TOP_CHUNK));
                            (&parts, 0)
                        }
                        _ => (value(x), at(x)),
                    };
                    rec.close_kernels(open);
                    open = rec.dispatches.len();
                    rec.commands.push(Command::Copy(from.0.clone(), from.1, staging.clone(), out_at, n));
                    outputs.push(Readback { at: out_at, values: n / 4, top });
                    out_at += n;
                }
            }
            let batch = if submitted == 0 { SUBMIT_FIRST } else { SUBMIT_DISPATCHES };
            if rec.dispatches.len() - submitted >= batch && i + 1 < p.ops.len() {
                rec.close_kernels(open);
                open = rec.dispatches.len();
                submitted = open;
                rec.commands.push(Command::Submit);
            }
        }
        rec.close_kernels(open);
        if self.host_times {
            let between = self.results_back.map_or_else(String::new, |t| {
                format!(", {} us after the last run's results came back", (planning - t).as_micros())
            });
            eprintln!(
                "program run: {} ops over {total} rows planned in {} us{between}",
                p.ops.len(),
                planning.elapsed().as_micros()
            );
        }
        let read = |view: &[u8]| {
            outputs
                .iter()
                .map(|&Readback { at, values, top }| {
                    let v = bytemuck::pod_collect_to_vec::<u8, f32>(&view[at as usize..(at + 4 * values) as usize]);
                    match top {
                        Top::No => Output::Rows(v),
                        Top::Rows { k, width } => program::top_k(&v, width as usize, k as usize),
                        Top::Candidates { k, per_row } => {
                            // Pairs of (value, column as f32; -1 for none).
                            let rows = v.chunks_exact(per_row as usize).map(|row| {
                                row.chunks_exact(2).filter(|c| c[1] >= 0.0).map(|c| (c[0], c[1] as u32))
                            });
                            program::top_of(rows, k as usize)
                        }
                    }
                })
                .collect()
        };
        let host_times = self.host_times;
        self.record(rec, &attention, (&staging, out_bytes), read).inspect_err(|e| {
            if host_times {
                eprintln!("program run failed: {e}");
            }
            self.recorded = Buffers::default();
        })
    }
}

/// The shape of `q`'s attention alone (`s`'s heads and scale).
fn alone_shape(q: &SequenceRun, window: u32, s: AttentionShape) -> AttentionShape {
    AttentionShape { t: q.rows, n_keys: q.start + q.rows - program::first_key(q.start, window), ..s }
}

/// An attention's dispatches over the rows of `seqs` (one sequence: its own rows; more: a
/// table's, `attend_rows`).
struct Planned {
    plan: super::attention::Plan,
    seqs: Vec<usize>,
}

impl WgpuBackend {
    /// The sequences of `batch` grouped by the arena their cache of index `cache` is in, in
    /// order of their first; a cache of its own buffers (or none) alone.
    fn arena_groups(&self, batch: &[SequenceRun], cache: u32) -> Vec<Vec<usize>> {
        let mut groups: Vec<(Option<wgpu::Buffer>, Vec<usize>)> = Vec::new();
        for (s, q) in batch.iter().enumerate() {
            let arena = q.caches.get(cache as usize).and_then(|(id, _, _)| self.attn.caches.get(id)).filter(|c| c.joint()).map(|c| c.k.clone());
            match groups.iter_mut().find(|(a, _)| a.is_some() && *a == arena) {
                Some((_, g)) => g.push(s),
                None => groups.push((arena, vec![s])),
            }
        }
        groups.into_iter().map(|(_, g)| g).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::program::{WeightRef, check};

    #[test]
    fn values_share_slots_only_once_read_and_inputs_keep_theirs() {
        let w = WeightRef { rep: 1, id: 1, rows: 8, cols: 8, format: Format::F32 };
        let ops = vec![
            Op::Input { width: 8 },
            Op::Scale { x: 0, by: 2.0 },
            Op::Scale { x: 1, by: 2.0 },
            Op::Scale { x: 2, by: 2.0 },
            Op::Input { width: 8 },
            Op::Add(3, 4),
            Op::Matmul { x: 5, weight: 0, precision: program::Precision::Exact },
            Op::Output(6),
        ];
        let p = check(ops, vec![w], 0).unwrap();
        let lay = layout(&p, &fusions(&p), &[], &p.last_use, |i| if i == 6 { 64 } else { 32 });
        let s = &lay.slot;
        // The inputs: slots of their own, the second not taken by values made before it.
        assert_ne!(s[0], s[4]);
        assert!([1, 2, 3].iter().all(|&v| s[v] != s[4]));
        // Each value beside its operand; a slot again once its value is read.
        assert_ne!(s[1], s[0]);
        assert_ne!(s[2], s[1]);
        assert_eq!(s[3], s[1]);
        assert!(s[5] != s[3] && s[5] != s[4]);
        assert_eq!(s[7], usize::MAX);
        assert_eq!(lay.bytes[s[6]], 64);
    }

    #[test]
    fn a_fused_pair_writes_beside_what_its_first_op_reads() {
        let ops = vec![
            Op::Input { width: 8 },
            Op::Input { width: 8 },
            Op::RmsNorm { x: 0, weight: None, offset: 0.0, group: 8, eps: 1e-6 },
            Op::Add(1, 2),
            Op::RmsNorm { x: 3, weight: None, offset: 0.0, group: 8, eps: 1e-6 },
            Op::Rotate { x: 4, table: 1, head_dim: 8, rotation: Rotation::Pairs },
            Op::RmsNorm { x: 5, weight: None, offset: 0.0, group: 8, eps: 1e-6 },
            Op::Add(6, 6),
            Op::Output(7),
        ];
        let p = check(ops, vec![], 0).unwrap();
        let fuse = fusions(&p);
        assert_eq!(fuse[2], Fuse::Add { other: 1 });
        assert_eq!(fuse[4], Fuse::Rotate { table: 1, rotation: Rotation::Pairs });
        // Both operands of the add are the norm's: nothing to add it to.
        assert_eq!(fuse[6], Fuse::No);
        // A rotation by the norm's own value: the fused kernel would read a value never made.
        let own = vec![
            Op::Input { width: 8 },
            Op::RmsNorm { x: 0, weight: None, offset: 0.0, group: 8, eps: 1e-6 },
            Op::Rotate { x: 1, table: 1, head_dim: 8, rotation: Rotation::Halves },
            Op::Output(2),
        ];
        assert_eq!(fusions(&check(own, vec![], 0).unwrap())[1], Fuse::No);
        let s = layout(&p, &fuse, &[], &p.last_use, |_| 32).slot;
        // Input 0 is read by the norm alone, yet the add's value (the pair's) is not put there.
        assert!(s[3] != s[0] && s[3] != s[1]);
        assert_ne!(s[5], s[3]);
    }

    #[test]
    fn a_norm_the_add_after_it_and_the_norm_of_the_sum_fuse_as_one() {
        let v = |rep, id| WeightRef { rep, id, rows: 1, cols: 8, format: Format::F32 };
        let norm = |x, weight| Op::RmsNorm { x, weight, offset: 0.0, group: 8, eps: 1e-6 };
        let ops = vec![
            Op::Input { width: 8 },
            Op::Input { width: 8 },
            norm(0, Some(0)),
            Op::Add(1, 2),
            norm(3, Some(1)),
            // The sum read again (the residual), beside its norm.
            Op::Add(3, 4),
            // A first norm without a weight: the pair alone.
            norm(5, None),
            Op::Add(5, 6),
            norm(7, Some(1)),
            Op::Output(8),
        ];
        let p = check(ops, vec![v(1, 1), v(2, 2)], 0).unwrap();
        let fuse = fusions(&p);
        assert_eq!(fuse[2], Fuse::AddNorm { other: 1, weight: 1 });
        assert_eq!(&fuse[3..6], &[Fuse::Within, Fuse::No, Fuse::No]);
        assert_eq!(fuse[6], Fuse::Add { other: 5 });
        assert_eq!(&fuse[7..], &[Fuse::No, Fuse::No, Fuse::No]);
        // Another eps in the second norm: the pair alone.
        let mut ops = p.ops.clone();
        ops[4] = Op::RmsNorm { x: 3, weight: Some(1), offset: 0.0, group: 8, eps: 1e-5 };
        assert_eq!(fusions(&check(ops, vec![v(1, 1), v(2, 2)], 0).unwrap())[2], Fuse::Add { other: 1 });
    }

    #[test]
    fn products_of_one_input_share_a_joint_slot_until_their_last_reader() {
        let w = |id, rows| WeightRef { rep: 1, id, rows, cols: 8, format: Format::Q8x32 };
        let f32w = WeightRef { rep: 1, id: 9, rows: 8, cols: 8, format: Format::F32 };
        let mm = |x, weight| Op::Matmul { x, weight, precision: program::Precision::Exact };
        let ops = vec![
            Op::Input { width: 8 },
            mm(0, 0),
            mm(0, 1),
            mm(0, 2),
            // Another format: not in the run.
            mm(0, 3),
            Op::Add(2, 3),
            Op::Mul(1, 5),
            Op::Scale { x: 6, by: 2.0 },
            Op::Output(7),
        ];
        let p = check(ops, vec![w(1, 8), w(2, 8), w(3, 8), f32w], 0).unwrap();
        assert_eq!(joint_runs(&p), vec![1..4]);
        assert_eq!(joint_ids(&p, 1..4), vec![1, 2, 3]);
        // Each product's first output at a multiple of the alignment (in values).
        assert_eq!(joint_rows(&[8, 8, 8], 64), (vec![0, 64, 128], 136));
        assert_eq!(joint_rows(&[1024, 256, 256], 64), (vec![0, 1024, 1280], 1536));
        assert_eq!(joint_rows(&[3, 5], 4), (vec![0, 4], 9));
        let share = [None, Some((1, 0)), Some((1, 256)), Some((1, 512)), None, None, None, None, None];
        let lay = layout(&p, &fusions(&p), &share, &p.last_use, |i| if i == 1 { 768 } else { 32 });
        let s = &lay.slot;
        assert!(s[1] == s[2] && s[2] == s[3] && s[0] != s[1]);
        assert_eq!((lay.offset[1], lay.offset[2], lay.offset[3]), (0, 256, 512));
        assert_eq!(lay.bytes[s[1]], 768);
        // Value 1 is read last by op 6: nothing made up to there takes the joint's slot.
        assert!(s[4] != s[1] && s[5] != s[1] && s[6] != s[1]);
    }
}
