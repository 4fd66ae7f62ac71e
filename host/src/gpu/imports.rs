//! The `wisp:llm/gpu` imports as a guest calls them: the WIT's types turned into the op core's
//! and [`GpuCtx`]'s (every op through one conversion, `From<wit::Op>`), and the results and
//! errors turned back. Nothing else in the crate names the generated `gpu` types, so that
//! `bindings` reads the handle types from here and the device side (`GpuCtx`, the backends)
//! never reads `bindings`.

use super::program::{self, Op};
use super::{Activation, Format, GpuCtx, GpuError, KvCacheHandle, ProgramHandle, Rotation, WeightHandle};
use crate::bindings::wisp::llm::gpu as wit;
use wasmtime::component::{HasData, Linker, Resource};

impl GpuCtx {
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

impl From<wit::Activation> for Activation {
    fn from(a: wit::Activation) -> Self {
        match a {
            wit::Activation::GeluTanh => Activation::GeluTanh,
            wit::Activation::Silu => Activation::Silu,
        }
    }
}

impl From<wit::Rotation> for Rotation {
    fn from(r: wit::Rotation) -> Self {
        match r {
            wit::Rotation::Halves => Rotation::Halves,
            wit::Rotation::Pairs => Rotation::Pairs,
        }
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

impl From<wit::Op> for Op {
    fn from(op: wit::Op) -> Self {
        let ix = |v: u32| v as usize;
        match op {
            wit::Op::Input(width) => Op::Input { width },
            wit::Op::Matmul(m) => Op::Matmul { x: ix(m.x), weight: ix(m.weight), precision: m.precision.into() },
            wit::Op::RmsNorm(n) => Op::RmsNorm { x: ix(n.x), weight: n.weight.map(ix), offset: n.offset, group: n.group, eps: n.eps },
            wit::Op::Add((a, b)) => Op::Add(ix(a), ix(b)),
            wit::Op::Mul((a, b)) => Op::Mul(ix(a), ix(b)),
            wit::Op::Bias(b) => Op::Bias { x: ix(b.x), weight: ix(b.weight) },
            wit::Op::Scale(s) => Op::Scale { x: ix(s.x), by: s.by },
            wit::Op::Softcap(s) => Op::Softcap { x: ix(s.x), cap: s.cap },
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
                softcap: a.softcap,
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
