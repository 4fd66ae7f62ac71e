//! Recording a run on the wgpu device: the bind groups, dispatches, attentions and copies of a
//! program's run (`programs`) in order, recorded into command buffers (a new one at each
//! `Submit`, so that the device starts on the first ops while the host records the rest), one
//! readback at the end. The buffers and bind groups kept across runs live here too: a decode
//! step binds what the one before it bound.

use super::attention::{Pipelines, Plan};
use super::{
    Dispatch, Kernel, PARAMS_BYTES, Params, WORKGROUP, WgpuBackend, X_PLAIN, align_up, binding,
    push_scopes,
};
use std::collections::HashMap;

use crate::gpu::program::Precision;
use crate::gpu::{BufferId, Format, GpuError};

/// Buffers kept across runs, grown when a run needs more.
#[derive(Default)]
pub(super) struct Buffers {
    /// The planes of partial sums of products split over k, and the readback's staging.
    pub(super) parts: Option<wgpu::Buffer>,
    pub(super) staging: Option<wgpu::Buffer>,
    /// The product of one part of a weight held in parts, before its columns are placed.
    pub(super) split: Option<wgpu::Buffer>,
    params: Option<wgpu::Buffer>,
    attn_params: Option<wgpu::Buffer>,
    /// The tables of a run's batched cache writes and attentions (`scatter_rows`,
    /// `attend_rows`).
    pub(super) tables: Option<wgpu::Buffer>,
    /// Bind groups of earlier runs, by what they bind: a decode step binds what the one
    /// before it bound (H200: making a 270M model's 288 anew cost ~1 ms a step).
    groups: HashMap<BindKey, wgpu::BindGroup>,
    attention: HashMap<AttentionKey, (wgpu::BindGroup, Pipelines)>,
    /// A program's values, one buffer a slot (see `programs`).
    pub(super) slots: Vec<Option<wgpu::Buffer>>,
}

/// What an attention bind group binds: parameters, queries, keys, values, outputs and rings
/// (buffer, offset, bytes; the rings the placeholder where there are none).
type AttentionKey = [(wgpu::Buffer, u64, u64); 6];

/// What a bind group of `matmul.wgsl`'s layout binds: parameters, weights, scales, x and y.
type BindKey = (
    wgpu::Buffer,
    (wgpu::Buffer, u64, u64),
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
    pub(super) weights: (wgpu::Buffer, u64, u64),
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
    /// For `attend_rows`: its table of rings (buffer, offset, bytes); keys and values are then
    /// the cache's whole arena.
    pub(super) rings: Option<(wgpu::Buffer, u64, u64)>,
}

/// What the command buffer does, in order.
pub(super) enum Command {
    /// Dispatches `dispatches[range]` of `matmul.wgsl`.
    Kernels(std::ops::Range<usize>),
    /// The run's attention of index `i`.
    Attention(usize),
    /// `bytes` from one buffer to another: (source, offset), (destination, offset).
    Copy(wgpu::Buffer, u64, wgpu::Buffer, u64, u64),
    /// Submits what is recorded so far: the device starts on the first ops while the rest
    /// are recorded.
    Submit,
}

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

/// WISP_PROFILE=1: each kernel of a recorded run in a compute pass of its own, timed.
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
            "run profile, us: {total:.0} in kernels: {}",
            parts.join(", ")
        );
    }
}

/// A compute pass of a recorded run, untimed.
fn plain_pass(encoder: &mut wgpu::CommandEncoder) -> wgpu::ComputePass<'static> {
    encoder
        .begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("run"),
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
    /// Adds weight `id`'s product over `input` (buffer, offset, bytes; rows of `x_quads` quads,
    /// read as `x_act` says: X_ACT in the shader) into `output` (buffer, offset, bytes): its
    /// bind group and its dispatches as `matmul` plans them, at `precision`, split over k where
    /// it has few tiles: then its planes of partial sums go to `parts` and `sum_planes` adds
    /// them into `output` right after. A weight held in parts runs part by part, each into
    /// `split`, its columns then placed in `output` (`place_columns`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn product_into(
        &self,
        rec: &mut Recording,
        (id, precision): (BufferId, Precision),
        input: (&wgpu::Buffer, u64, u64),
        output: (&wgpu::Buffer, u64, u64),
        t: u32,
        x_quads: u32,
        (parts, split): (&wgpu::Buffer, &wgpu::Buffer),
        x_act: u32,
    ) -> Result<(), GpuError> {
        let w = self
            .weights
            .get(&id)
            .ok_or_else(|| GpuError::InvalidArgument(format!("no weight {id}")))?;
        if !w.parts.is_empty() {
            let max_dim = self.limits.max_compute_workgroups_per_dimension.max(1);
            for &(part, first) in &w.parts {
                let rows = self.weights.get(&part).ok_or_else(|| GpuError::InvalidArgument(format!("no part {part} of weight {id}")))?.n_out;
                let bytes = t as u64 * rows as u64 * 4;
                self.product_into(rec, (part, precision), input, (split, 0, bytes), t, x_quads, (parts, split), x_act)?;
                let place = rec.bind(Bind {
                    weights: entire(&self.placeholder),
                    scales: entire(&self.placeholder),
                    x: (split.clone(), 0, align_up(bytes, 16)),
                    y: (output.0.clone(), output.1, output.2),
                });
                let params = Params { n_in: rows, n_out: w.n_out, t, row_quads: 0, scale_row: 0, row_base: first, t_base: 0, x_stride: 0 };
                rec.rows(max_dim, Kernel::PlaceColumns, place, params, rows.div_ceil(WORKGROUP));
            }
            return Ok(());
        }
        let n = self.k_splits(w, t, precision);
        let bytes = output.2 * n as u64;
        let y = if n > 1 { (parts.clone(), 0, align_up(bytes, 16)) } else { (output.0.clone(), output.1, bytes) };
        let bind = rec.bind(Bind {
            weights: entire(&w.data),
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
        if n > 1 {
            // Bound as weights too, unread: a binding of at least 16 bytes, only ever read.
            let sum = rec.bind(Bind {
                weights: entire(&y.0),
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
        Ok(())
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
        let m = &mut self.recorded;
        let pb = Self::ensure(
            &self.device,
            &mut m.params,
            params.len() as u64,
            cap,
            uniform,
            "run params",
        );
        let apb = Self::ensure(
            &self.device,
            &mut m.attn_params,
            attn_params.len() as u64,
            cap,
            uniform,
            "run attention params",
        );
        self.queue.write_buffer(&pb, 0, &params);
        self.queue.write_buffer(&apb, 0, &attn_params);
        let m = &mut self.recorded;
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
                    label: Some("run"),
                    layout: &self.bind_layout,
                    entries: &[
                        wgpu::BindGroupEntry {
                            binding: 0,
                            resource: binding(&pb, 0, PARAMS_BYTES),
                        },
                        wgpu::BindGroupEntry {
                            binding: 1,
                            resource: binding(&b.weights.0, b.weights.1, b.weights.2),
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
            let (k, k_at, v, v_at, kv_bytes) = match a.rings {
                // The arena whole (one buffer for keys and values).
                Some(_) => (c.k.clone(), 0, c.v.clone(), 0, c.k.size()),
                None => (c.k.clone(), c.k_at, c.v.clone(), c.v_at, c.half()),
            };
            let key = [
                (apb.clone(), 0, 0),
                (a.q.0.clone(), a.q.1, p.q_bytes),
                (k.clone(), k_at, kv_bytes),
                (v.clone(), v_at, kv_bytes),
                (a.out.0.clone(), a.out.1, p.out_bytes),
                a.rings.clone().unwrap_or_else(|| (self.placeholder.clone(), 0, 0)),
            ];
            if let Some(g) = self.recorded.attention.get(&key) {
                attention_groups.push(g.clone());
                continue;
            }
            let made = self.attention_group(p, &apb, (&a.q.0, a.q.1), ((&k, k_at), (&v, v_at), kv_bytes), (&a.out.0, a.out.1), a.rings.as_ref())?;
            let m = &mut self.recorded;
            if m.attention.len() >= MAX_CACHED_GROUPS {
                m.attention.clear();
            }
            m.attention.insert(key, made.clone());
            attention_groups.push(made);
        }

        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("run"),
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
                                label: Some("run"),
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
            self.results_back = Some(std::time::Instant::now());
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
                label: Some("run profile"),
                ty: wgpu::QueryType::Timestamp,
                count,
            }),
            resolve: buffer(
                "run profile",
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            ),
            read: buffer(
                "run profile readback",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            count,
            period_ns: timer.period_ns as f64,
            names: Vec::new(),
        })
    }
}
