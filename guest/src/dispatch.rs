//! Where each batch of matrix products runs: the guest's CPU kernels or the host's device.
//!
//! Products are grouped by input (q/k/v, gate/up), so a batch is one `gpu.matmul` call or one
//! quantization of the input for the CPU kernels. The policy (`Mode::Auto`) compares estimates:
//! device time = round trip + bytes moved / bandwidth + FLOPs / device rate, CPU time =
//! FLOPs / CPU rate, with every rate measured on this machine (a calibration at load, then a
//! running average of what actually ran). A device error falls back to the CPU for that batch;
//! a lost device is never asked again. Either way the tokens are the same.

use crate::kernels::{self, Act, QActs, RowScratch};
use crate::models::attention::{Heads, LayerCache, attend};
use crate::models::{Linear, WeightData};
use crate::program::{Op, Program, Tensor, Tensors, WeightId};
use std::collections::HashMap;
use crate::quant::{Group, QMatrix, Values};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Counters of what ran where.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    pub cpu_matmuls: u64,
    pub cpu_flops: u64,
    pub gpu_calls: u64,
    pub gpu_flops: u64,
    pub gpu_ns: u64,
    pub gpu_fallbacks: u64,
    /// Time in CPU products and the weight bytes they read.
    pub cpu_ns: u64,
    pub cpu_bytes: u64,
    /// Time in attention (wherever it ran), and in the output projection (counted by the
    /// models).
    pub attention_ns: u64,
    /// Attention batches the host's device computed.
    pub gpu_attention_calls: u64,
    pub output_ns: u64,
}

/// The `gpu-mode` of the WIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Off,
    Auto,
    On,
}

/// A device failure (the WIT `gpu.error`).
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceError {
    Unavailable(String),
    InvalidArgument(String),
    OutOfMemory(String),
    Lost(String),
}

/// The upload formats of the WIT `weight-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    F32,
    Q8x32,
    Q8x16,
    Q4x32,
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
    /// One output per job, each `[t, n_out]`.
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
    /// Attention over a `kv-cache` after writing `k_new`, `v_new` at positions `first_new..`
    /// (the WIT `attention-cached`).
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
    /// The model's decoder blocks over `x[t, n_embd]` at positions `pos..` (the WIT `blocks`),
    /// their new keys and values too with `return_kv`. A device without it says `Unavailable`.
    #[allow(clippy::too_many_arguments)]
    fn blocks(
        &self,
        _x: &[f32],
        _t: u32,
        _pos: u32,
        _blocks: &[DeviceBlock],
        _shape: &BlocksShape,
        _rope: &[Vec<f32>],
        _return_kv: bool,
    ) -> Result<BlocksOut, DeviceError> {
        Err(DeviceError::Unavailable("no blocks on this device".into()))
    }
    /// Causal attention over the keys and values sent (the WIT `attention`); `[t, n_head *
    /// head_dim]`. A device without it says `Unavailable`.
    fn attention(&self, _q: &[f32], _k: &[f32], _v: &[f32], _shape: &AttentionShape) -> Result<Vec<f32>, DeviceError> {
        Err(DeviceError::Unavailable("no attention on this device".into()))
    }
    /// A program of `ops` (the WIT `create-program`) over the device weights `weights`, which
    /// the ops' weight ids index, with `caches` cache indices. A device without programs says
    /// `Unavailable`.
    fn create_program(&self, _weights: &[usize], _caches: u32, _ops: &[Op]) -> Result<usize, DeviceError> {
        Err(DeviceError::Unavailable("no programs on this device".into()))
    }
    /// Runs a program over a batch (the WIT `program.run`): the rows of each `output` op.
    fn run_program(&self, _id: usize, _inputs: &[Vec<f32>], _batch: &[DeviceSequence<'_>]) -> Result<Vec<Vec<f32>>, DeviceError> {
        Err(DeviceError::Unavailable("no programs on this device".into()))
    }
}

/// One sequence of a program run: `rows` rows from position `start`, and the device kv-cache
/// of each of the program's cache indices.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSequence<'a> {
    pub rows: u32,
    pub start: u32,
    pub caches: &'a [usize],
}

/// A model's program on the device: its id, the caches each run brings, and the product of
/// its output that stays with the guest (`head`: its weight is not on the device), if any.
#[derive(Debug, Clone)]
pub struct DeviceProgram {
    id: usize,
    caches: usize,
    pub head: Option<WeightId>,
}

/// Places a model's program on the device: its matrices must be there already (each
/// `Linear::gpu`), but for a product that makes its output (the output projection past a
/// device's binding limit): that one stays with the guest, and the program outputs its input.
/// Its vectors are uploaded now (and freed again if the program is not made). `None` where
/// another matrix is not on the device, or the device does not make the program.
pub fn place_program(gpu: &Gpu, p: &Program, w: &dyn Tensors, caches: usize) -> Option<DeviceProgram> {
    let mut head = None;
    let mut all = p.ops.clone();
    for op in all.iter_mut() {
        if let (Op::Output(v), None) = (*op, head) {
            if let Op::Matmul { x, w: id } = p.ops[v] {
                if w.matrix(id).gpu.is_none() {
                    *op = Op::Output(x);
                    head = Some(id);
                }
            }
        }
    }
    let mut index: HashMap<WeightId, u32> = HashMap::new();
    let (mut ids, mut vectors) = (Vec::new(), Vec::new());
    let mut ops = Vec::with_capacity(p.ops.len());
    let mut placed = true;
    for op in &crate::program::compact(&all) {
        let mut local = |id: WeightId| -> Option<WeightId> {
            if let Some(&i) = index.get(&id) {
                return Some(WeightId(i));
            }
            let device = match w.tensor(id) {
                Tensor::Matrix(m) => m.gpu?,
                Tensor::Vector(v) => {
                    let d = upload_vector(gpu.device.as_ref(), v).ok()?;
                    vectors.push(d);
                    d
                }
            };
            ids.push(device);
            index.insert(id, ids.len() as u32 - 1);
            Some(WeightId(ids.len() as u32 - 1))
        };
        let mapped = match *op {
            Op::Matmul { x, w } => local(w).map(|w| Op::Matmul { x, w }),
            Op::RmsNorm { x, w: Some(n), group, eps } => local(n).map(|n| Op::RmsNorm { x, w: Some(n), group, eps }),
            Op::Bias { x, w } => local(w).map(|w| Op::Bias { x, w }),
            other => Some(other),
        };
        match mapped {
            Some(op) => ops.push(op),
            None => {
                placed = false;
                break;
            }
        }
    }
    let made = if placed { gpu.device.create_program(&ids, caches as u32, &ops).ok() } else { None };
    if made.is_none() {
        for v in vectors {
            gpu.device.free(v);
        }
    }
    Some(DeviceProgram { id: made?, caches, head })
}

/// One decoder block's device ids for `blocks` (the WIT `block` less its cache): matrices are
/// uploaded weights, vectors f32 weights of one row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockIds {
    pub attn_norm: usize,
    pub wq: usize,
    pub wk: usize,
    pub wv: usize,
    pub q_bias: Option<usize>,
    pub k_bias: Option<usize>,
    pub v_bias: Option<usize>,
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    pub wo: usize,
    pub o_bias: Option<usize>,
    pub post_attn_norm: Option<usize>,
    pub ffn_norm: usize,
    pub gate: usize,
    pub up: usize,
    pub down: usize,
    pub post_ffn_norm: Option<usize>,
}

/// A block of a `blocks` call: its ids, its `kv-cache`, window (0: none) and rotation table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceBlock {
    pub ids: BlockIds,
    pub cache: usize,
    pub window: u32,
    pub rope: u32,
}

/// The WIT `blocks-shape`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlocksShape {
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub eps: f32,
    pub scale: f32,
    pub act: Act,
    /// The rotation pairs `(h[2j], h[2j + 1])`, not the halves `(h[j], h[j + head_dim / 2])`.
    pub pairs: bool,
}

/// The WIT `blocks-output`.
#[derive(Debug, Clone, Default)]
pub struct BlocksOut {
    pub x: Vec<f32>,
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

/// The WIT `attention-shape`: `t` queries over `n_keys` keys, the last `t` the queries' own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    pub t: u32,
    pub n_keys: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    /// 0: no window.
    pub window: u32,
    pub scale: f32,
}

/// Bytes per `write-rows` call: large weights go up in slices of rows, so no single list
/// crossing the component boundary is large.
const UPLOAD_SLICE_BYTES: usize = 8 << 20;

/// A weight as `(format, data, scales)` for `rows` rows starting at `first`, exactly the values
/// the CPU kernels use.
fn encode_rows(w: &Linear, first: usize, rows: usize) -> (Format, Vec<u8>, Vec<f32>) {
    let n = w.n_in;
    match &w.w {
        WeightData::F32(f) => {
            let data = f[first * n..(first + rows) * n].iter().flat_map(|v| v.to_le_bytes()).collect();
            (Format::F32, data, Vec::new())
        }
        WeightData::Q(q) => encode_q(q, first, rows),
    }
}

fn encode_q(q: &QMatrix, first: usize, rows: usize) -> (Format, Vec<u8>, Vec<f32>) {
    let n = q.n_in;
    let g = q.group as usize;
    let mut values = vec![0i8; rows * n];
    let mut scales = vec![0f32; rows * n / g];
    for (i, r) in (first..first + rows).enumerate() {
        q.row_values(r, &mut values[i * n..(i + 1) * n]);
        q.row_scales(r, &mut scales[i * n / g..(i + 1) * n / g]);
    }
    if q.m.is_empty() {
        let format = if q.group == Group::G16 { Format::Q8x16 } else { Format::Q8x32 };
        (format, values.iter().map(|&v| v as u8).collect(), scales)
    } else {
        // Formats with mins have 4-bit values 0..=15 (Q4_K): pack two a byte, low nibble first.
        let data = values.chunks_exact(2).map(|p| (p[0] as u8 & 0xF) | ((p[1] as u8 & 0xF) << 4)).collect();
        let mins = &q.m[first * n / 32..(first + rows) * n / 32];
        (Format::Q4x32, data, scales.iter().zip(mins).flat_map(|(&d, &m)| [d, m]).collect())
    }
}

/// Whether a weight can go to the device in an upload format.
fn uploadable(w: &Linear) -> bool {
    match &w.w {
        WeightData::F32(_) => true,
        WeightData::Q(q) => match &q.values {
            _ if q.m.is_empty() => true,
            // Q4_K: 4-bit values with no offset, 0..=15 by construction.
            Values::Nibbles { fifth, offset: 0, .. } => q.group == Group::G32 && fifth.is_empty(),
            _ => q.group == Group::G32 && (0..q.n_out).all(|r| (0..q.n_in).all(|c| (0..16).contains(&q.value(r, c)))),
        },
    }
}

/// Uploads one weight, a slice of rows at a time. Returns its device id.
pub fn upload(dev: &dyn Device, w: &Linear) -> Result<usize, DeviceError> {
    let (format, _, _) = encode_rows(w, 0, 0);
    let id = dev.allocate(format, w.n_out as u32, w.n_in as u32)?;
    let row_bytes = match format {
        Format::F32 => 4 * w.n_in,
        Format::Q4x32 => w.n_in / 2,
        _ => w.n_in,
    };
    let rows_per_slice = (UPLOAD_SLICE_BYTES / row_bytes.max(1)).max(1);
    let mut first = 0;
    while first < w.n_out {
        let rows = rows_per_slice.min(w.n_out - first);
        let (_, data, scales) = encode_rows(w, first, rows);
        dev.write_rows(id, first as u32, &data, &scales)?;
        first += rows;
    }
    Ok(id)
}

/// Uploads a vector (a norm weight, a bias) as an f32 weight of one row. Returns its device id.
pub fn upload_vector(dev: &dyn Device, v: &[f32]) -> Result<usize, DeviceError> {
    let id = dev.allocate(Format::F32, 1, v.len() as u32)?;
    let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    if let Err(e) = dev.write_rows(id, 0, &data, &[]) {
        dev.free(id);
        return Err(e);
    }
    Ok(id)
}

/// The vectors of a block, in the order [`block_ids`] takes them: `attn_norm`, `q_bias`,
/// `k_bias`, `v_bias`, `q_norm`, `k_norm`, `o_bias`, `post_attn_norm`, `ffn_norm`,
/// `post_ffn_norm`.
pub type BlockVectors<'a> = [Option<&'a [f32]>; 10];

/// A decoder block's ids for `blocks`, its vectors uploaded now: `None` when one of its
/// matrices (`wq`, `wk`, `wv`, `wo`, `gate`, `up`, `down`) is not on the device, a norm before
/// attention or the feed-forward block is missing, or a vector cannot be uploaded (those
/// uploaded are freed again).
pub fn block_ids(gpu: &Gpu, m: [&Linear; 7], vectors: BlockVectors<'_>) -> Option<BlockIds> {
    let [Some(wq), Some(wk), Some(wv), Some(wo), Some(gate), Some(up), Some(down)] = m.map(|w| w.gpu) else { return None };
    let mut ids = [None; 10];
    for (i, v) in vectors.iter().enumerate() {
        if let Some(v) = v {
            match upload_vector(gpu.device.as_ref(), v) {
                Ok(id) => ids[i] = Some(id),
                Err(e) => {
                    ids.iter().flatten().for_each(|&id| gpu.device.free(id));
                    if let DeviceError::Lost(why) = e {
                        *gpu.lost.borrow_mut() = Some(why);
                    }
                    return None;
                }
            }
        }
    }
    let [attn_norm, q_bias, k_bias, v_bias, q_norm, k_norm, o_bias, post_attn_norm, ffn_norm, post_ffn_norm] = ids;
    let (Some(attn_norm), Some(ffn_norm)) = (attn_norm, ffn_norm) else {
        ids.iter().flatten().for_each(|&id| gpu.device.free(id));
        return None;
    };
    Some(BlockIds {
        attn_norm,
        wq,
        wk,
        wv,
        q_bias,
        k_bias,
        v_bias,
        q_norm,
        k_norm,
        wo,
        o_bias,
        post_attn_norm,
        ffn_norm,
        gate,
        up,
        down,
        post_ffn_norm,
    })
}

/// Frees the vectors [`block_ids`] uploaded.
pub fn free_block_vectors(gpu: &Gpu, b: &BlockIds) {
    let vectors = [b.attn_norm, b.ffn_norm].into_iter().map(Some);
    let optional = [b.q_bias, b.k_bias, b.v_bias, b.q_norm, b.k_norm, b.o_bias, b.post_attn_norm, b.post_ffn_norm];
    vectors.chain(optional).flatten().for_each(|id| gpu.device.free(id));
}

/// Every layer's [`block_ids`] (`layers` gives each one's matrices and vectors), or `None`
/// (and nothing left uploaded) if one layer cannot have them. Only where the mode sends work
/// to the device and the layers' matrices are there.
pub fn place_blocks<'a>(gpu: &Gpu, layers: impl Iterator<Item = ([&'a Linear; 7], BlockVectors<'a>)>) -> Option<Vec<BlockIds>> {
    if !gpu.usable() {
        return None;
    }
    let mut all = Vec::new();
    for (m, v) in layers {
        match block_ids(gpu, m, v) {
            Some(b) => all.push(b),
            None => {
                all.iter().for_each(|b| free_block_vectors(gpu, b));
                return None;
            }
        }
    }
    Some(all)
}

/// Measured speeds, in FLOP/s and seconds, for the policy.
#[derive(Debug, Clone, Copy)]
pub struct Rates {
    /// Round trip of a tiny device call.
    pub gpu_latency: f64,
    /// Device FLOP/s on a large batch, and its bytes/s for moving activations.
    pub gpu_flops: f64,
    pub gpu_bytes: f64,
    /// CPU FLOP/s at t = 1 and on batches.
    pub cpu_flops_1: f64,
    pub cpu_flops_n: f64,
}

/// The model's device: its uploaded weights' ids live in each `Linear::gpu`.
pub struct Gpu {
    pub device: Box<dyn Device>,
    pub mode: Mode,
    pub limits: DeviceLimits,
    pub rates: Cell<Option<Rates>>,
    /// Why the device is no longer used, once it was lost.
    pub lost: RefCell<Option<String>>,
    /// The host answered `attention` with `unavailable`: attention stays on the CPU.
    pub no_attention: Cell<bool>,
    /// The host answered `create-kv-cache` or `attention-cached` with `unavailable`: device
    /// attention sends its keys and values with each call.
    pub no_kv_cache: Cell<bool>,
    /// The host answered `blocks` with `unavailable`: layers go call by call.
    pub no_blocks: Cell<bool>,
    /// The host answered a program's run with `unavailable`: batches go call by call.
    pub no_programs: Cell<bool>,
    /// The CPU's attention FLOP/s, a running average of what ran (none ran yet: `None`).
    pub cpu_attention: Cell<Option<f64>>,
    /// Seconds of a decode step's attention on the device over its `kv-cache`, a running
    /// average (none ran yet: `None`).
    pub device_attention: Cell<Option<f64>>,
}

impl Gpu {
    fn usable(&self) -> bool {
        self.mode != Mode::Off && self.lost.borrow().is_none()
    }

    /// The policy: should this batch run on the device?
    fn wants(&self, t: usize, flops: u64, bytes: u64) -> bool {
        match self.mode {
            Mode::Off => false,
            Mode::On => true,
            Mode::Auto => match self.rates.get() {
                None => false,
                Some(r) => {
                    let gpu = r.gpu_latency + bytes as f64 / r.gpu_bytes + flops as f64 / r.gpu_flops;
                    let cpu = flops as f64 / if t == 1 { r.cpu_flops_1 } else { r.cpu_flops_n };
                    gpu < cpu
                }
            },
        }
    }

    /// The policy for an attention batch: the device's estimate as for products, the CPU's
    /// from its own measured attention rate (with none yet, the CPU runs it and is measured).
    /// With `On`, batches of queries (prefill) go to the device. A single query (a decode step)
    /// goes there only if the device keeps the layer's keys and values (`cached`; without, each
    /// call would send the whole cache for one query's arithmetic: on an H200 decode at 512
    /// keys ran at half the speed that way), and then, in either mode, to whichever has been
    /// faster: the device's measured time a call against the CPU's measured rate for these
    /// keys (the CPU is measured first, then the device once). On an H200 a call costs ~0.1
    /// ms (~0.3 before its keys were split in runs of 16), the CPU's attention at 128 keys ~0.08
    /// and at 576 ~0.5.
    fn wants_attention(&self, t: usize, cached: bool, flops: u64, bytes: u64) -> bool {
        if self.mode != Mode::Off && t == 1 && cached {
            return match (self.cpu_attention.get(), self.device_attention.get()) {
                (Some(cpu), Some(device)) => device < flops as f64 / cpu,
                (Some(_), None) => true,
                (None, _) => false,
            };
        }
        match self.mode {
            Mode::Off => false,
            Mode::On => t > 1,
            Mode::Auto => match (self.rates.get(), self.cpu_attention.get()) {
                (Some(r), Some(cpu)) => {
                    r.gpu_latency + bytes as f64 / r.gpu_bytes + flops as f64 / r.gpu_flops < flops as f64 / cpu
                }
                _ => false,
            },
        }
    }

    /// Folds the measured time of a decode step's attention on the device into the estimate.
    fn observe_device_attention(&self, secs: f64) {
        self.device_attention.set(Some(self.device_attention.get().map_or(secs, |d| 0.8 * d + 0.2 * secs)));
    }

    /// Folds a measured CPU attention rate into the estimate.
    fn observe_cpu_attention(&self, flops: u64, secs: f64) {
        if secs > 0.0 {
            let rate = flops as f64 / secs;
            self.cpu_attention.set(Some(self.cpu_attention.get().map_or(rate, |r| 0.9 * r + 0.1 * rate)));
        }
    }

    /// Takes note of a failed call (`e`, or `None` for an answer of the wrong shape, `what`):
    /// a loss, or a wrong shape, is remembered and the device not asked again; `unavailable`
    /// from a call the host need not offer sets `not_offered` instead. Returns whether the work
    /// falls back to the CPU as a failure (counted), not as a call the host does not have.
    fn failed(&self, e: Option<DeviceError>, what: &str, not_offered: Option<&Cell<bool>>) -> bool {
        match (e, not_offered) {
            (None, _) => *self.lost.borrow_mut() = Some(format!("the device returned {what} of the wrong shape")),
            (Some(DeviceError::Lost(why)), _) => *self.lost.borrow_mut() = Some(why),
            (Some(DeviceError::Unavailable(_)), Some(flag)) => {
                flag.set(true);
                return false;
            }
            (Some(_), _) => {}
        }
        true
    }

    /// Folds a measured CPU rate into the estimate (a running average).
    fn observe_cpu(&self, t: usize, flops: u64, secs: f64) {
        if let (Some(mut r), true) = (self.rates.get(), secs > 0.0) {
            let rate = flops as f64 / secs;
            let slot = if t == 1 { &mut r.cpu_flops_1 } else { &mut r.cpu_flops_n };
            *slot = 0.9 * *slot + 0.1 * rate;
            self.rates.set(Some(r));
        }
    }
}

/// A layer's keys and values on the device: a `kv-cache` of as many rows as the guest's ring,
/// position `p` in row `p % slots` in both, holding positions `lo..hi` (the last `slots` of
/// them).
#[derive(Debug, Clone, Copy)]
struct DeviceCache {
    id: usize,
    lo: usize,
    hi: usize,
}

/// Per-session dispatcher: scratch for the quantized input, counters, and the model's device.
#[derive(Default)]
pub struct Dispatch {
    acts: QActs,
    rows: RowScratch,
    /// A batch's keys and values in order of position, as `attention` sends them.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// Each layer's `kv-cache` on the device, made at its first device attention.
    caches: Vec<Option<DeviceCache>>,
    /// A cache could not be made for this session (out of memory): attention sends its keys.
    no_caches: bool,
    /// The first position whose keys and values only the device holds (`blocks` ran there
    /// without returning them): the guest's own rings lack them from there on.
    device_only_from: Option<usize>,
    pub counters: Counters,
    pub gpu: Option<Rc<Gpu>>,
}

impl Drop for Dispatch {
    /// The session's `kv-cache`s go with it.
    fn drop(&mut self) {
        if let Some(gpu) = &self.gpu {
            for c in self.caches.iter().flatten() {
                gpu.device.free_kv_cache(c.id);
            }
        }
    }
}

impl Dispatch {
    pub fn new(gpu: Option<Rc<Gpu>>) -> Dispatch {
        let mut d = Dispatch::default();
        d.gpu = gpu;
        d
    }

    /// For each `(W, y)` in `jobs`: `y[t, n_out] = x[t, n_in] @ W^T`. Every `W` has `n_in`
    /// columns.
    pub fn matmul(&mut self, x: &[f32], t: usize, jobs: &mut [(&Linear, &mut [f32])]) {
        let Some(n_in) = jobs.first().map(|(w, _)| w.n_in) else { return };
        debug_assert!(jobs.iter().all(|(w, y)| w.n_in == n_in && y.len() >= t * w.n_out));
        let x = &x[..t * n_in];
        let flops: u64 = jobs.iter().map(|(w, _)| w.flops(t)).sum();
        if let Some(gpu) = self.gpu.clone() {
            let ids: Option<Vec<usize>> = jobs.iter().map(|(w, _)| w.gpu).collect();
            let bytes = 4 * (x.len() + jobs.iter().map(|(w, _)| t * w.n_out).sum::<usize>()) as u64;
            let max = gpu.limits.max_activation_elements;
            let fits = x.len() as u64 <= max && jobs.iter().all(|(w, _)| (t * w.n_out) as u64 <= max);
            if let Some(ids) = ids.filter(|_| fits && gpu.usable() && gpu.wants(t, flops, bytes)) {
                let start = Instant::now();
                match gpu.device.matmul(x, t as u32, n_in as u32, &ids) {
                    Ok(outs) if outs.len() == jobs.len() && outs.iter().zip(jobs.iter()).all(|(o, (w, _))| o.len() == t * w.n_out) => {
                        for (o, (_, y)) in outs.iter().zip(jobs.iter_mut()) {
                            y[..o.len()].copy_from_slice(o);
                        }
                        self.counters.gpu_calls += 1;
                        self.counters.gpu_flops += flops;
                        self.counters.gpu_ns += start.elapsed().as_nanos() as u64;
                        return;
                    }
                    other => {
                        gpu.failed(other.err(), "outputs", None);
                    }
                }
                self.counters.gpu_fallbacks += 1;
            }
            let took = self.cpu(x, t, n_in, jobs);
            gpu.observe_cpu(t, flops, took.as_secs_f64());
            return;
        }
        self.cpu(x, t, n_in, jobs);
    }

    /// Causal attention of the `t` queries `q` at positions `pos..` over `cache` (see
    /// [`attend`]), on the device where the policy sends it, else on the CPU. Counts its time.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &mut self,
        layer: usize,
        cache: &LayerCache,
        h: Heads,
        q: &[f32],
        pos: usize,
        t: usize,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let start = Instant::now();
        if self.device_attend(layer, cache, h, q, pos, t, out) {
            self.counters.gpu_attention_calls += 1;
            if let (Some(gpu), 1) = (&self.gpu, t) {
                gpu.observe_device_attention(start.elapsed().as_secs_f64());
            }
        } else {
            attend(cache, h, q, pos, t, scores, out);
            if let Some(gpu) = &self.gpu {
                gpu.observe_cpu_attention(attention_flops(cache, h, pos, t), start.elapsed().as_secs_f64());
            }
        }
        self.counters.attention_ns += start.elapsed().as_nanos() as u64;
    }

    /// Layer `layer`'s `kv-cache` on the device, made now if there is none yet (`None` where
    /// the device has none to give).
    fn device_cache(&mut self, gpu: &Gpu, layer: usize, slots: usize, width: usize) -> Option<DeviceCache> {
        if gpu.no_kv_cache.get() || self.no_caches {
            return None;
        }
        if self.caches.len() <= layer {
            self.caches.resize(layer + 1, None);
        }
        if let Some(c) = self.caches[layer] {
            return Some(c);
        }
        match gpu.device.create_kv_cache(slots as u32, width as u32) {
            Ok(id) => {
                let c = DeviceCache { id, lo: 0, hi: 0 };
                self.caches[layer] = Some(c);
                Some(c)
            }
            // A failed call: the layer's work runs on the CPU instead (a fallback).
            Err(DeviceError::Lost(why)) => {
                *gpu.lost.borrow_mut() = Some(why);
                self.counters.gpu_fallbacks += 1;
                None
            }
            // Not offered: no session asks again. No room: this session does not.
            Err(DeviceError::Unavailable(_)) => {
                gpu.no_kv_cache.set(true);
                None
            }
            Err(_) => {
                self.no_caches = true;
                self.counters.gpu_fallbacks += 1;
                None
            }
        }
    }

    /// Attention on the device, if the policy sends it there and the device answers; `false`
    /// when the CPU must do it. With a `kv-cache` for the layer, only the keys and values the
    /// device does not hold yet go with the call (one row a decode step).
    #[allow(clippy::too_many_arguments)]
    fn device_attend(&mut self, layer: usize, cache: &LayerCache, h: Heads, q: &[f32], pos: usize, t: usize, out: &mut [f32]) -> bool {
        let Some(gpu) = self.gpu.clone() else { return false };
        if !gpu.usable() || gpu.no_attention.get() {
            return false;
        }
        // The keys of the batch's first query to its last: the last `window` before the first
        // query, and the batch's own.
        let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let n_keys = pos + t - first;
        let kv = h.n_head_kv * h.head_dim;
        let q = &q[..t * h.n_head * h.head_dim];
        let max = gpu.limits.max_activation_elements;
        if (q.len().max(n_keys * kv)) as u64 > max {
            return false;
        }
        // Positions the device needs that it does not hold: all of `first..` without a cache,
        // else from where its copy ends (what lies at or past `pos` is stale: a rewind).
        let from_given = |device: Option<DeviceCache>| match device {
            Some(c) if c.lo <= first && first <= c.hi.min(pos) => c.hi.min(pos),
            _ => first,
        };
        // The policy first (a cache it may never use is not made), with the cache this layer
        // has or can have.
        let cacheable = !gpu.no_kv_cache.get() && !self.no_caches;
        let known = self.caches.get(layer).copied().flatten();
        let rows = pos + t - if cacheable { from_given(known) } else { first };
        let bytes = 4 * (2 * q.len() + 2 * rows * kv) as u64;
        if !gpu.wants_attention(t, cacheable, attention_flops(cache, h, pos, t), bytes) {
            return false;
        }
        let device = if cacheable { self.device_cache(&gpu, layer, cache.cap, kv) } else { None };
        if cacheable && device.is_none() && t == 1 {
            // The choice counted on a cache that could not be made: the guest attends.
            return false;
        }
        let from = from_given(device);
        let rows = pos + t - from;
        let (keys, values) = (&mut self.keys, &mut self.values);
        for buf in [&mut *keys, &mut *values] {
            buf.clear();
            if buf.try_reserve(rows * kv).is_err() {
                return false;
            }
        }
        // The ring's slots of those positions: `start..` to its end, then from its start.
        let start = from % cache.cap;
        let head = (cache.cap - start).min(rows);
        for (buf, src) in [(&mut *keys, &cache.k), (&mut *values, &cache.v)] {
            buf.extend_from_slice(&src[start * kv..(start + head) * kv]);
            buf.extend_from_slice(&src[..(rows - head) * kv]);
        }
        let shape = AttentionShape {
            t: t as u32,
            n_keys: n_keys as u32,
            n_head: h.n_head as u32,
            n_head_kv: h.n_head_kv as u32,
            head_dim: h.head_dim as u32,
            window: cache.window.unwrap_or(0) as u32,
            scale: h.scale,
        };
        let answer = match device {
            Some(c) => gpu.device.attention_cached(q, keys, values, from as u32, c.id, first as u32, &shape),
            None => gpu.device.attention(q, keys, values, &shape),
        };
        // The device's copy now ends at the batch, back to `first` or further (a continuation),
        // less what the ring overwrote; after a failure it is unknown: nothing.
        if let Some(c) = self.caches.get_mut(layer).and_then(Option::as_mut) {
            let ok = matches!(&answer, Ok(o) if o.len() == q.len());
            let kept = if from == first { first } else { c.lo };
            (c.lo, c.hi) = if ok { (kept.max((pos + t).saturating_sub(cache.cap)), pos + t) } else { (0, 0) };
        }
        match answer {
            Ok(o) if o.len() == q.len() => {
                out[..o.len()].copy_from_slice(&o);
                return true;
            }
            other => {
                let not_offered = if device.is_some() { &gpu.no_kv_cache } else { &gpu.no_attention };
                if gpu.failed(other.err(), "attention", Some(not_offered)) {
                    self.counters.gpu_fallbacks += 1;
                }
            }
        }
        false
    }

    /// Every decoder block in one device call (the WIT `blocks`), where the policy sends the
    /// batch's products (`flops` of them) to the device and the device holds every layer's keys
    /// before `pos`: `x` (`[t, n_embd]`, exactly) at positions `pos..` through all of `blocks`
    /// (each layer's ids and rotation table). `rope` makes the rotation tables (`t * head_dim`
    /// values each). The new keys and values stay on the device alone (a 512-token prefill of
    /// Gemma's would read back 20 MB): the guest's rings lack them from `pos` on, and if the
    /// device fails later, the session runs its history again on its own ([`Dispatch::ring_holds`]).
    /// Once they lack rows, the device runs every batch it can, whatever the policy says.
    /// `false`, with nothing changed, when the layers must go one by one.
    #[allow(clippy::too_many_arguments)]
    pub fn blocks(
        &mut self,
        x: &mut [f32],
        t: usize,
        pos: usize,
        blocks: &[(BlockIds, u32)],
        caches: &mut [LayerCache],
        shape: BlocksShape,
        flops: u64,
        rope: impl FnOnce() -> Vec<Vec<f32>>,
    ) -> bool {
        let Some(gpu) = self.gpu.clone() else { return false };
        if !gpu.usable() || gpu.no_blocks.get() || gpu.no_kv_cache.get() || self.no_caches || blocks.len() != caches.len() {
            return false;
        }
        let e = x.len() / t.max(1);
        let kv = (shape.n_head_kv * shape.head_dim) as usize;
        if self.device_only_from.is_none() && !gpu.wants(t, flops, 8 * (t * e) as u64) {
            return false;
        }
        // Each layer's device cache must hold the keys before the batch that its queries see.
        let mut call = Vec::with_capacity(blocks.len());
        for (l, (&(ids, table), cache)) in blocks.iter().zip(caches.iter()).enumerate() {
            let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let Some(c) = self.device_cache(&gpu, l, cache.cap, kv) else { return false };
            if !(c.lo <= first && pos <= c.hi) {
                return false;
            }
            let window = cache.window.unwrap_or(0) as u32;
            call.push(DeviceBlock { ids, cache: c.id, window, rope: table });
        }
        let start = Instant::now();
        let answer = gpu.device.blocks(&x[..t * e], t as u32, pos as u32, &call, &shape, &rope(), false);
        match answer {
            Ok(out) if out.x.len() == t * e && out.keys.is_empty() && out.values.is_empty() => {
                x[..t * e].copy_from_slice(&out.x);
                self.ran_whole_pass((pos, t), &caches[..blocks.len()], flops, start);
                true
            }
            other => {
                self.forget_device_caches();
                if gpu.failed(other.err(), "blocks", Some(&gpu.no_blocks)) {
                    self.counters.gpu_fallbacks += 1;
                }
                false
            }
        }
    }

    /// The model's program `prog` on the device over a batch of `t` rows at `pos` (`inputs` as
    /// its recipe says), this session's `kv-cache`s as its caches (one a layer, as many rows as
    /// the guest's rings `caches`). Returns the rows of the program's first output (the
    /// logits, `out_len` values), or `None`, with nothing changed, where the batch runs on the
    /// CPU. As with [`Dispatch::blocks`], the keys and values stay on the device alone.
    #[allow(clippy::too_many_arguments)]
    pub fn run_program(
        &mut self,
        prog: &DeviceProgram,
        inputs: &[Vec<f32>],
        (t, pos): (usize, usize),
        caches: &[LayerCache],
        kv: usize,
        flops: u64,
        out_len: usize,
    ) -> Option<Vec<f32>> {
        let gpu = self.gpu.clone()?;
        if !gpu.usable() || gpu.no_programs.get() || gpu.no_kv_cache.get() || self.no_caches || prog.caches != caches.len() {
            return None;
        }
        let bytes = 4 * inputs.iter().map(Vec::len).sum::<usize>() as u64;
        if self.device_only_from.is_none() && !gpu.wants(t, flops, bytes) {
            return None;
        }
        let mut ids = Vec::with_capacity(caches.len());
        for (l, cache) in caches.iter().enumerate() {
            let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let c = self.device_cache(&gpu, l, cache.cap, kv)?;
            if !(c.lo <= first && pos <= c.hi) {
                return None;
            }
            ids.push(c.id);
        }
        let start = Instant::now();
        let batch = [DeviceSequence { rows: t as u32, start: pos as u32, caches: &ids }];
        match gpu.device.run_program(prog.id, inputs, &batch) {
            Ok(mut outs) if outs.first().is_some_and(|o| o.len() == out_len) => {
                self.ran_whole_pass((pos, t), caches, flops, start);
                Some(outs.swap_remove(0))
            }
            other => {
                self.forget_device_caches();
                if gpu.failed(other.err(), "a program's outputs", Some(&gpu.no_programs)) {
                    self.counters.gpu_fallbacks += 1;
                }
                None
            }
        }
    }

    /// Takes note of a whole pass of `t` rows at `pos` that ran on the device (`blocks` or the
    /// model's program), over the layers of `caches`: their keys and values are on the device
    /// alone from `pos` on (see [`Dispatch::ring_holds`]).
    fn ran_whole_pass(&mut self, (pos, t): (usize, usize), caches: &[LayerCache], flops: u64, start: Instant) {
        self.device_only_from = Some(self.device_only_from.map_or(pos, |p| p.min(pos)));
        for (c, ring) in self.caches.iter_mut().zip(caches) {
            if let Some(c) = c {
                c.lo = c.lo.max((pos + t).saturating_sub(ring.cap));
                c.hi = pos + t;
            }
        }
        self.counters.gpu_calls += 1;
        self.counters.gpu_flops += flops;
        self.counters.gpu_ns += start.elapsed().as_nanos() as u64;
        self.counters.gpu_attention_calls += caches.len() as u64;
    }

    /// After a failed whole pass, what the device's caches hold is unknown.
    fn forget_device_caches(&mut self) {
        for c in self.caches.iter_mut().flatten() {
            (c.lo, c.hi) = (0, 0);
        }
    }

    /// Whether the guest's rings hold every key and value before `pos`, so that the batch at
    /// `pos` can run layer by layer; `false` when the device alone holds some (see
    /// [`Dispatch::blocks`]): the session must run its history again from position 0. A batch
    /// that runs here from `pos` rewrites the rings from there on.
    pub fn ring_holds(&mut self, pos: usize) -> bool {
        match self.device_only_from {
            Some(p) if p < pos => false,
            _ => {
                self.device_only_from = None;
                true
            }
        }
    }

    /// The products on the guest's CPU kernels; returns the time they took.
    fn cpu(&mut self, x: &[f32], t: usize, n_in: usize, jobs: &mut [(&Linear, &mut [f32])]) -> Duration {
        let start = Instant::now();
        if jobs.iter().any(|(w, _)| matches!(w.w, WeightData::Q(_))) {
            self.acts.quantize(x, t, n_in);
        }
        for (w, y) in jobs.iter_mut() {
            let y = &mut y[..t * w.n_out];
            match &w.w {
                WeightData::Q(q) => kernels::matmul_q(q, &self.acts, &mut self.rows, y),
                WeightData::F32(f) => kernels::matmul_f32(f, w.n_out, w.n_in, x, t, y),
            }
            self.counters.cpu_matmuls += 1;
            self.counters.cpu_flops += w.flops(t);
            self.counters.cpu_bytes += w.bytes() as u64;
        }
        let took = start.elapsed();
        self.counters.cpu_ns += took.as_nanos() as u64;
        took
    }
}

/// Floating-point operations of a batch's attention: a product with the query and a
/// multiply-add of the values, per key each query sees, per head.
fn attention_flops(cache: &LayerCache, h: Heads, pos: usize, t: usize) -> u64 {
    let keys: usize = (pos..pos + t).map(|p| cache.window.map_or(p + 1, |w| (p + 1).min(w))).sum();
    4 * (keys * h.n_head * h.head_dim) as u64
}

/// Times `f` a few times and keeps the fastest, in seconds.
fn fastest(runs: usize, mut f: impl FnMut() -> bool) -> Option<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let start = Instant::now();
        if !f() {
            return None;
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    Some(best)
}

/// Measures the device and the CPU on one of the model's own weights (`probe`, already
/// uploaded): round trip at t = 1, throughput at a prefill-sized batch, CPU at both.
pub fn calibrate(gpu: &Gpu, probe: &Linear) -> Option<Rates> {
    let id = probe.gpu?;
    let (n_in, n_out) = (probe.n_in, probe.n_out);
    let big_t = 64;
    let x: Vec<f32> = (0..big_t * n_in).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
    let dev = &gpu.device;
    let latency = fastest(3, || dev.matmul(&x[..n_in], 1, n_in as u32, &[id]).is_ok())?;
    let batch = fastest(2, || dev.matmul(&x, big_t as u32, n_in as u32, &[id]).is_ok())?;
    let flops = 2.0 * (big_t * n_in * n_out) as f64;
    let bytes = 4.0 * (big_t * (n_in + n_out)) as f64;
    let work = (batch - latency).max(1e-7);
    let mut d = Dispatch::default();
    let mut y = vec![0f32; big_t * n_out];
    let cpu_1 = fastest(3, || {
        d.cpu(&x[..n_in], 1, n_in, &mut [(probe, &mut y[..n_out])]);
        true
    })?;
    let cpu_n = fastest(2, || {
        d.cpu(&x, big_t, n_in, &mut [(probe, &mut y)]);
        true
    })?;
    Some(Rates {
        gpu_latency: latency,
        // Bandwidth and arithmetic share the time beyond the round trip; charge it all to both
        // so neither is overestimated.
        gpu_flops: flops / work,
        gpu_bytes: bytes / work,
        cpu_flops_1: 2.0 * (n_in * n_out) as f64 / cpu_1,
        cpu_flops_n: flops / cpu_n,
    })
}

/// Uploads the model's weights as the mode wants: every one with `On`; with `Auto`, one probe
/// first, then the rest only if the measured device beats the CPU at a prefill-sized batch.
/// Returns how many are resident. Errors stop the uploads; what is resident stays in use.
pub fn place(gpu: &Gpu, linears: &mut [&mut Linear]) -> usize {
    if gpu.mode == Mode::Off || linears.is_empty() {
        return 0;
    }
    let mut resident = 0;
    let mut budget = gpu.limits.budget_bytes;
    let mut handles = gpu.limits.budget_handles;
    let try_upload = |w: &mut Linear, budget: &mut u64, handles: &mut u32| -> bool {
        let (_, data, scales) = encode_rows(w, 0, 1);
        let bytes = (data.len() + 4 * scales.len()) as u64 * w.n_out as u64;
        if !uploadable(w) || bytes > *budget || *handles == 0 || data.len() as u64 * w.n_out as u64 > gpu.limits.max_weight_bytes {
            return false;
        }
        match upload(gpu.device.as_ref(), w) {
            Ok(id) => {
                w.gpu = Some(id);
                *budget -= bytes;
                *handles -= 1;
                true
            }
            Err(DeviceError::Lost(why)) => {
                *gpu.lost.borrow_mut() = Some(why);
                false
            }
            Err(_) => false,
        }
    };
    if gpu.mode == Mode::Auto {
        // The largest layer weight (not the output projection) is the probe.
        let n = linears.len().saturating_sub(1).max(1);
        let Some(probe) = (0..n).max_by_key(|&i| linears[i].n_out * linears[i].n_in) else { return 0 };
        if !try_upload(linears[probe], &mut budget, &mut handles) {
            return 0;
        }
        resident += 1;
        let rates = calibrate(gpu, linears[probe]);
        gpu.rates.set(rates);
        let worth = rates.is_some_and(|r| {
            let flops = 2.0 * 64.0 * (linears[probe].n_in * linears[probe].n_out) as f64;
            r.gpu_latency + flops / r.gpu_flops < flops / r.cpu_flops_n
        });
        if !worth {
            // The CPU wins even on batches: keep nothing on the device, and attend here too.
            gpu.no_attention.set(true);
            if let Some(id) = linears[probe].gpu.take() {
                gpu.device.free(id);
            }
            return 0;
        }
    }
    for w in linears.iter_mut() {
        if w.gpu.is_some() {
            continue;
        }
        if gpu.lost.borrow().is_some() {
            break;
        }
        if try_upload(w, &mut budget, &mut handles) {
            resident += 1;
        }
    }
    resident
}
