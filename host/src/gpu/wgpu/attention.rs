//! `attention` on the wgpu device: `shaders/attention.wgsl`, one workgroup a (head, query).
//!
//! Queries, keys and values are written into buffers kept across calls (grown as needed), the
//! queries split over dispatches so that none exceeds the device's workgroup count or the
//! multiply-add budget of a dispatch, and the output read back through one staging buffer.

use super::{WgpuBackend, binding, push_scopes};
use crate::gpu::{AttentionShape, GpuError};

const SHADER: &str = include_str!("../../../../shaders/attention.wgsl");

/// `Shape` in the shader.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    t: u32,
    n_keys: u32,
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    window: u32,
    scale: f32,
    query_base: u32,
}
const PARAMS_BYTES: u64 = size_of::<Params>() as u64;

/// The pipeline (built on first use) and the buffers kept across calls.
#[derive(Default)]
pub(super) struct Attention {
    pipeline: Option<(wgpu::BindGroupLayout, wgpu::ComputePipeline)>,
    q: Option<wgpu::Buffer>,
    k: Option<wgpu::Buffer>,
    v: Option<wgpu::Buffer>,
    out: Option<wgpu::Buffer>,
    staging: Option<wgpu::Buffer>,
    params: Option<wgpu::Buffer>,
}

impl WgpuBackend {
    fn attention_pipeline(&mut self) -> Result<(wgpu::BindGroupLayout, wgpu::ComputePipeline), GpuError> {
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
        let layout = self.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("attention"),
            entries: &[
                entry(0, wgpu::BufferBindingType::Uniform, true),
                entry(1, read, false),
                entry(2, read, false),
                entry(3, read, false),
                entry(4, wgpu::BufferBindingType::Storage { read_only: false }, false),
            ],
        });
        let pipeline_layout = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("attention"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("attention.wgsl"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("attention"),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some("attend"),
            compilation_options: wgpu::PipelineCompilationOptions::default(),
            cache: None,
        });
        self.finish(scopes)?;
        self.attn.pipeline = Some((layout.clone(), pipeline.clone()));
        Ok((layout, pipeline))
    }

    /// See [`crate::gpu::Backend::attention`]; the shape is checked by `GpuCtx` already.
    pub(super) fn run_attention(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        s: &AttentionShape,
    ) -> Result<Vec<f32>, GpuError> {
        self.last_kernel_ns = None;
        self.live()?;
        let max = self.info.max_weight_bytes;
        let (q_bytes, k_bytes) = (4 * q.len() as u64, 4 * k.len() as u64);
        if q.is_empty() || k.is_empty() || k.len() != v.len() || q_bytes.max(k_bytes) > max {
            return Err(GpuError::InvalidArgument(format!(
                "{} queries and {} keys do not fit the device ({max} bytes a buffer)",
                q.len(),
                k.len()
            )));
        }
        let groups = self.limits.max_compute_workgroups_per_dimension.max(1);
        if s.n_head > groups {
            return Err(GpuError::OutOfMemory(format!("{} heads exceed the device's {groups} workgroups", s.n_head)));
        }
        let (layout, pipeline) = self.attention_pipeline()?;

        // Queries a dispatch: within the workgroup count of a dimension and the budget.
        let macs = (2 * s.n_head as u64).saturating_mul(s.n_keys as u64).saturating_mul(s.head_dim as u64);
        let per_dispatch = (self.dispatch_macs / macs.max(1)).clamp(1, groups as u64) as u32;
        let dispatches = s.t.div_ceil(per_dispatch);
        let stride = super::align_up(PARAMS_BYTES, self.limits.min_uniform_buffer_offset_alignment.max(4) as u64);
        let params: Vec<u8> = (0..dispatches)
            .flat_map(|d| {
                let p = Params {
                    t: s.t,
                    n_keys: s.n_keys,
                    n_head: s.n_head,
                    n_head_kv: s.n_head_kv,
                    head_dim: s.head_dim,
                    window: s.window,
                    scale: s.scale,
                    query_base: d * per_dispatch,
                };
                let mut bytes = bytemuck::bytes_of(&p).to_vec();
                bytes.resize(stride as usize, 0);
                bytes
            })
            .collect();

        let scopes = push_scopes(&self.device);
        let cap = self.limits.max_buffer_size;
        let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let device = &self.device;
        let a = &mut self.attn;
        let qb = Self::ensure(device, &mut a.q, q_bytes, cap, storage, "attention q");
        let kb = Self::ensure(device, &mut a.k, k_bytes, cap, storage, "attention k");
        let vb = Self::ensure(device, &mut a.v, k_bytes, cap, storage, "attention v");
        let out_usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
        let out = Self::ensure(device, &mut a.out, q_bytes, cap, out_usage, "attention out");
        let read_usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        let staging = Self::ensure(device, &mut a.staging, q_bytes, cap, read_usage, "attention staging");
        let uniform = wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST;
        let pb = Self::ensure(device, &mut a.params, params.len() as u64, cap, uniform, "attention params");
        self.queue.write_buffer(&qb, 0, bytemuck::cast_slice(q));
        self.queue.write_buffer(&kb, 0, bytemuck::cast_slice(k));
        self.queue.write_buffer(&vb, 0, bytemuck::cast_slice(v));
        self.queue.write_buffer(&pb, 0, &params);
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("attention"),
            layout: &layout,
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: binding(&pb, 0, PARAMS_BYTES) },
                wgpu::BindGroupEntry { binding: 1, resource: binding(&qb, 0, q_bytes) },
                wgpu::BindGroupEntry { binding: 2, resource: binding(&kb, 0, k_bytes) },
                wgpu::BindGroupEntry { binding: 3, resource: binding(&vb, 0, k_bytes) },
                wgpu::BindGroupEntry { binding: 4, resource: binding(&out, 0, q_bytes) },
            ],
        });
        let mut encoder =
            self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("attention") });
        {
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("attention"), timestamp_writes: None });
            pass.set_pipeline(&pipeline);
            for d in 0..dispatches {
                let queries = per_dispatch.min(s.t - d * per_dispatch);
                pass.set_bind_group(0, &group, &[(d as u64 * stride) as u32]);
                pass.dispatch_workgroups(s.n_head, queries, 1);
            }
        }
        encoder.copy_buffer_to_buffer(&out, 0, &staging, 0, q_bytes);
        self.queue.submit([encoder.finish()]);
        let result = self.read_back(&staging, q_bytes, |view| bytemuck::pod_collect_to_vec::<u8, f32>(view));
        match self.finish(scopes).and(result) {
            Ok(out) => Ok(out),
            Err(e) => {
                // Start the next call from fresh buffers: these may be left mapped or invalid.
                self.attn = Attention { pipeline: self.attn.pipeline.take(), ..Attention::default() };
                Err(e)
            }
        }
    }
}
