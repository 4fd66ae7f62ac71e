//! Where each batch of matrix products runs: the guest's CPU kernels or the host's device.
//!
//! Products are grouped by input (q/k/v, gate/up), so a batch is one `gpu.matmul` call or one
//! quantization of the input for the CPU kernels. The policy (`Mode::Auto`) compares estimates:
//! device time = round trip + bytes moved / bandwidth + FLOPs / device rate, CPU time =
//! FLOPs / CPU rate, with every rate measured on this machine (a calibration at load, then a
//! running average of what actually ran). A device error falls back to the CPU for that batch;
//! a lost device is never asked again. Either way the tokens are the same.
//!
//! The parts: `device` is the host boundary (the `gpu` imports as a trait), `policy` the choice
//! and the rates it rests on, `caches` the mirror of what the device's `kv-cache`s hold, and
//! `placement` what goes to the device at load. The upload formats are `crate::upload`'s.

mod caches;
mod device;
mod placement;
mod policy;

pub use crate::upload::Format;
pub use device::{AttentionShape, Device, DeviceError, DeviceLimits, DeviceOutput, DeviceSequence};
pub use placement::{DeviceProgram, place, place_program};
pub use policy::{Gpu, Rates, calibrate};

use crate::kernels::{self, QActs, QActs8, RowScratch};
use crate::models::attention::{Heads, LayerCache, attend};
use crate::models::{Linear, LoadError, WeightData};
use caches::DeviceCache;
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

impl Counters {
    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &Counters) {
        let Counters { cpu_matmuls, cpu_flops, gpu_calls, gpu_flops, gpu_ns, gpu_fallbacks, cpu_ns, cpu_bytes, attention_ns, gpu_attention_calls, output_ns } = *o;
        self.cpu_matmuls += cpu_matmuls;
        self.cpu_flops += cpu_flops;
        self.gpu_calls += gpu_calls;
        self.gpu_flops += gpu_flops;
        self.gpu_ns += gpu_ns;
        self.gpu_fallbacks += gpu_fallbacks;
        self.cpu_ns += cpu_ns;
        self.cpu_bytes += cpu_bytes;
        self.attention_ns += attention_ns;
        self.gpu_attention_calls += gpu_attention_calls;
        self.output_ns += output_ns;
    }
}

/// The `gpu-mode` of the WIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Off,
    Auto,
    On,
}

/// Per-session dispatcher: scratch for the quantized input, counters, and the model's device.
#[derive(Default)]
pub struct Dispatch {
    acts: QActs,
    /// The same activations in int8, for the weights whose products are `fast`.
    acts8: QActs8,
    rows: RowScratch,
    /// A batch's keys and values in order of position, as `attention_cached` sends them.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// Each layer's `kv-cache` on the device, made at its first device attention.
    caches: Vec<Option<DeviceCache>>,
    /// A cache could not be made for this session (out of memory): the CPU attends.
    no_caches: bool,
    /// The first position whose keys and values only the device holds (the model's program ran
    /// there without returning them): the guest's own rings lack them from there on.
    device_only_from: Option<usize>,
    pub counters: Counters,
    pub gpu: Option<Rc<Gpu>>,
    /// The session's next step is greedy (the largest logit wins, nothing changes the logits
    /// first): a one-row pass on the device may read back the top logit alone.
    pub greedy: bool,
    /// The token such a pass found (its logits were not read back).
    pub top: Option<u32>,
    /// `precision: fast`: the CPU products take int8 activations where the weight's format
    /// allows (`kernels::takes_int8`); else i16 ones, within f32 rounding of exact math.
    pub fast: bool,
    /// The device's answer to this session's last failed run of the model's program or cache
    /// request (what [`Dispatch::held_on_device`] reports).
    fault: Option<DeviceError>,
}

/// What a pass of the model's program on the device gave.
pub enum Pass {
    /// The rows of its output (the logits, or the head product's input).
    Rows(Vec<f32>),
    /// The token of the largest logit (a greedy step: see [`Dispatch::greedy`]).
    Top(u32),
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

    /// Attention on the device over the layer's `kv-cache`, if the policy sends it there and
    /// the device answers; `false` when the CPU must do it. Only the keys and values the
    /// device does not hold yet go with the call (one row a decode step).
    #[allow(clippy::too_many_arguments)]
    fn device_attend(&mut self, layer: usize, cache: &LayerCache, h: Heads, q: &[f32], pos: usize, t: usize, out: &mut [f32]) -> bool {
        let Some(gpu) = self.gpu.clone() else { return false };
        if !gpu.usable() || gpu.no_attention.get() || gpu.no_kv_cache.get() || self.no_caches {
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
        // Positions the device needs that it does not hold: from where its copy ends (what
        // lies at or past `pos` is stale: a rewind), else all of `first..`.
        let from_given = |device: Option<DeviceCache>| match device {
            Some(c) if c.lo <= first && first <= c.hi.min(pos) => c.hi.min(pos),
            _ => first,
        };
        // The policy first (a cache it may never use is not made).
        let known = self.caches.get(layer).copied().flatten();
        let rows = pos + t - from_given(known);
        let bytes = 4 * (2 * q.len() + 2 * rows * kv) as u64;
        if !gpu.wants_attention(t, attention_flops(cache, h, pos, t), bytes) {
            return false;
        }
        let Some(device) = self.device_cache(&gpu, layer, cache.cap, kv) else { return false };
        let from = from_given(Some(device));
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
            softcap: h.softcap,
        };
        let answer = gpu.device.attention_cached(q, keys, values, from as u32, device.id, first as u32, &shape);
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
                if gpu.failed(other.err(), "attention", Some(&gpu.no_kv_cache)) {
                    self.counters.gpu_fallbacks += 1;
                }
            }
        }
        false
    }

    /// The model's program `prog` on the device over a batch of `t` rows at `pos` (`inputs` as
    /// its recipe says), this session's `kv-cache`s as its caches (one a layer, as many rows as
    /// the guest's rings `caches`). Returns the rows of the program's first output (the
    /// logits, `out_len` values), or `None`, with nothing changed, where the batch runs on the
    /// CPU. The new keys and values stay on the device alone (a 512-token prefill of Gemma's
    /// would read back 20 MB): the guest's rings lack them from `pos` on, and if the device
    /// fails later, the session runs its history again on its own ([`Dispatch::ring_holds`]).
    /// Once they lack rows, the device runs every batch it can, whatever the policy says. A
    /// greedy step of one row runs the program's `top` form where it has one: [`Pass::Top`].
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
    ) -> Option<Pass> {
        let bytes = 4 * inputs.iter().map(Vec::len).sum::<usize>() as u64;
        if !self.program_wanted(prog, caches, t, flops, bytes) {
            return None;
        }
        let ids = self.program_caches(prog, (t, pos), caches, kv)?;
        let top = self.greedy && t == 1;
        let mut one = [Member { d: self, t, pos, caches, ids, flops }];
        run_together(prog, inputs, &mut one, out_len, top).and_then(|mut passes| passes.pop())
    }

    /// Whether a run of the model's program `prog` over `t` rows of this session (`flops`,
    /// `bytes` of inputs; `t` the rows of every session of a batched run) may go to the device:
    /// the device takes programs and caches, and the policy sends the rows there or the
    /// session's rings lack keys the device alone holds.
    pub fn program_wanted(&self, prog: &DeviceProgram, caches: &[LayerCache], t: usize, flops: u64, bytes: u64) -> bool {
        let Some(gpu) = &self.gpu else { return false };
        let offered = gpu.usable() && !gpu.no_programs.get() && !gpu.no_kv_cache.get() && !self.no_caches && prog.caches == caches.len();
        offered && (self.device_only_from.is_some() || gpu.wants(t, flops, bytes))
    }

    /// This session's `kv-cache`s for a run of the model's program `prog` over `t` rows at
    /// `pos` (made now where there are none yet): `None` where the device has none to give or
    /// they do not hold the keys those rows see.
    pub fn program_caches(&mut self, prog: &DeviceProgram, (t, pos): (usize, usize), caches: &[LayerCache], kv: usize) -> Option<Vec<usize>> {
        let gpu = self.gpu.clone()?;
        if prog.caches != caches.len() || t == 0 {
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
        Some(ids)
    }

    /// Where the device alone holds the model's weights (`Gpu::owns`), why a pass that did
    /// not run there cannot run on the guest's CPU either: the device's failure, as the
    /// session's error. A lost device takes the sessions' keys and values with it: the model
    /// must be loaded again. `None` where the guest holds the weights.
    pub fn held_on_device(&self) -> Option<LoadError> {
        let gpu = self.gpu.as_ref().filter(|g| g.owns)?;
        let held = "the device that holds the model's weights";
        Some(match (gpu.lost.borrow().as_ref(), &self.fault) {
            (Some(why), _) => LoadError::Io(format!("{held} was lost ({why}): load the model again")),
            (None, Some(DeviceError::OutOfMemory(why))) => LoadError::OutOfMemory(format!("{held} has no room for this pass: {why}")),
            _ if self.no_caches => LoadError::OutOfMemory(format!("{held} has no room for this session's keys and values")),
            (None, Some(DeviceError::InvalidArgument(why) | DeviceError::Unavailable(why))) => {
                LoadError::Io(format!("{held} did not run the pass: {why}"))
            }
            _ if gpu.no_programs.get() || gpu.no_kv_cache.get() => LoadError::Io(format!("{held} no longer runs programs over kv-caches")),
            _ => LoadError::Io(format!("{held} did not run the pass")),
        })
    }

    /// The products on the guest's CPU kernels; returns the time they took.
    fn cpu(&mut self, x: &[f32], t: usize, n_in: usize, jobs: &mut [(&Linear, &mut [f32])]) -> Duration {
        let start = Instant::now();
        let fast = self.fast;
        let int8 = |w: &Linear| fast && matches!(&w.w, WeightData::Q(q) if kernels::takes_int8(q));
        let (wide, narrow) = jobs.iter().fold((false, false), |(wide, narrow), (w, _)| {
            (wide || (matches!(w.w, WeightData::Q(_)) && !int8(w)), narrow || int8(w))
        });
        if wide {
            self.acts.quantize(x, t, n_in);
        }
        if narrow {
            self.acts8.quantize(x, t, n_in);
        }
        for (w, y) in jobs.iter_mut() {
            let y = &mut y[..t * w.n_out];
            match &w.w {
                WeightData::Q(q) if int8(w) => kernels::matmul_q8(q, &self.acts8, &mut self.rows, y),
                WeightData::Q(q) => kernels::matmul_q(q, &self.acts, &mut self.rows, y),
                WeightData::F32(f) => kernels::matmul_f32(f, w.n_out, w.n_in, x, t, y),
                // Never here: a weight the guest does not hold is on the device, and a model
                // with such weights runs on the device or fails (`held_on_device`).
                WeightData::Device(_) | WeightData::File(_) => y.fill(f32::NAN),
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

/// One session's sequence in a run of the model's program (see [`run_together`]): its
/// dispatcher, its `t` rows at `pos`, its rings, its device caches
/// ([`Dispatch::program_caches`]) and the FLOPs of its rows.
pub struct Member<'a> {
    pub d: &'a mut Dispatch,
    pub t: usize,
    pub pos: usize,
    pub caches: &'a [LayerCache],
    pub ids: Vec<usize>,
    pub flops: u64,
}

/// The model's program `prog` on the device over the sequences of `members` in one run (all
/// sessions of one model, each with its own caches; the caller asked [`Dispatch::program_wanted`]):
/// `inputs` holds their rows one member after another. Returns each member's [`Pass`] (its
/// last row's output, `out_len` values, or with `top`, where the program has that form, its
/// largest logit), as [`Dispatch::run_program`] does for one session; `None`, with nothing
/// changed, where the device failed (each member's device caches then forgotten). Each member
/// counts the run's time.
pub fn run_together(prog: &DeviceProgram, inputs: &[Vec<f32>], members: &mut [Member<'_>], out_len: usize, top: bool) -> Option<Vec<Pass>> {
    let gpu = members.first()?.d.gpu.clone()?;
    let top = prog.top.filter(|_| top);
    let start = Instant::now();
    let answer = {
        let batch: Vec<DeviceSequence<'_>> =
            members.iter().map(|m| DeviceSequence { rows: m.t as u32, start: m.pos as u32, caches: &m.ids }).collect();
        gpu.device.run_program(top.unwrap_or(prog.id), inputs, &batch)
    };
    let n = members.len();
    let (passes, error) = match answer {
        Ok(mut outs) => {
            let passes = match outs.first_mut() {
                Some(DeviceOutput::Rows(rows)) if top.is_none() && rows.len() == n * out_len => {
                    let rows = std::mem::take(rows);
                    Some(if n == 1 { vec![Pass::Rows(rows)] } else { rows.chunks_exact(out_len).map(|r| Pass::Rows(r.to_vec())).collect() })
                }
                Some(DeviceOutput::Top { indices, .. }) if top.is_some() && indices.len() == n && indices.iter().all(|&i| (i as usize) < out_len) => {
                    Some(indices.iter().map(|&i| Pass::Top(i)).collect())
                }
                _ => None,
            };
            (passes, None)
        }
        Err(e) => {
            for m in members.iter_mut() {
                m.d.fault = Some(e.clone());
            }
            (None, Some(e))
        }
    };
    match passes {
        Some(passes) => {
            for m in members.iter_mut() {
                m.d.ran_whole_pass((m.pos, m.t), m.caches, m.flops, start);
            }
            Some(passes)
        }
        None => {
            let counted = gpu.failed(error, "a program's outputs", Some(&gpu.no_programs));
            for m in members.iter_mut() {
                m.d.forget_device_caches();
                if counted {
                    m.d.counters.gpu_fallbacks += 1;
                }
            }
            None
        }
    }
}
