//! The `gpu` interface on a real device, through wgpu (Vulkan, Metal, DX12 or GL).
//!
//! Device and queue are made once; the pipelines of `shaders/matmul.wgsl` are built on first
//! use, one per kernel and format, and cached. Weights live in persistent storage buffers, in
//! their upload format (the shader decodes them). A `matmul` writes `x` once, records every job's
//! dispatches in one command buffer, copies all outputs to one staging buffer and maps it once;
//! the input, output, staging and parameter buffers are kept and grown across calls.
//!
//! Every wgpu call runs inside error scopes, and an uncaptured-error handler replaces wgpu's
//! default (which panics), so that a validation or out-of-memory error becomes a [`GpuError`].
//! A lost device (reported by wgpu's device-lost callback, or [`WgpuBackend::simulate_device_loss`])
//! makes every later call return [`GpuError::DeviceLost`].

mod attention;
mod layout_checks;
mod programs;
mod record;

use super::program::{self, Precision};
use super::{Activation, AttentionShape, Backend, BufferId, Device, Format, GpuError};
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

const SHADER: &str = include_str!("../../../shaders/matmul.wgsl");
/// `gemm_coop`, built after matmul.wgsl (whose bindings and decoders it uses) on adapters that
/// offer cooperative matrices (see [`offers_coop`]).
const COOP_SHADER: &str = include_str!("../../../shaders/matmul_coop.wgsl");
/// `gemm_large`, built after matmul.wgsl (whose bindings and decoders it uses) where the adapter
/// offers its workgroup memory.
const LARGE_SHADER: &str = include_str!("../../../shaders/matmul_large.wgsl");
/// Workgroup memory of `gemm_large`: two buffers of 16 columns of 128 + 256 rows, f32.
const LARGE_WORKGROUP_BYTES: u32 = 2 * 16 * 384 * 4;
/// Rows of x of one workgroup's output tile in `gemm_large` (its rows of W: WIDE_TILE).
const LARGE_T: u32 = 256;
/// Workgroups (tiles of 128 x 256) from which GPUs run `gemm_large` rather than `gemm_wide`:
/// it runs one workgroup a multiprocessor, so below ~2 waves of a large GPU (the H200 has 132)
/// `gemm_wide`'s twice as many tiles keep more of it busy (H200, [4096, 4096]: t = 512, 64
/// tiles, 18 TFLOP/s against 30; t = 4096, 512 tiles, 36-38 against 30).
const LARGE_MIN_GROUPS: u64 = 256;
/// Workgroup memory of `gemm_coop`: two buffers of 128 x 40 f16 for x and for W, and
/// 8 x 16 x 16 f32.
const COOP_WORKGROUP_BYTES: u32 = 4 * 10240 + 4 * 2048;

/// Invocations in a workgroup (`WG` in the shader).
const WORKGROUP: u32 = 64;
/// Rows of `x` at which `gemm` (4 rows of x per invocation) takes over from `gemv`.
const GEMM_MIN_T: u32 = 4;
/// Weight rows an invocation of `gemm` computes (8 in the shader).
const GEMM_ROWS: u32 = 8;
/// On GPUs products of at most TILE rows of x whose `gemm_tiled` tiles would be fewer than this
/// run `gemv` a row of x instead (each row's weights read again, from the cache; each row's
/// sums those of the row alone): a few tiles leave most of a large GPU idle (the H200 has 132
/// multiprocessors; a 270M model's decode products at 4 to 64 rows had 10 to 32 tiles, each
/// walking all of k). A product of more tiles (a vocabulary's output) stays on `gemm_tiled`,
/// whose tiles read each weight once for 64 rows. Measured on the H200 (Gemma 3 270M, 64
/// sequences' decode step, kernels alone): the rows' products 4.0 ms this way and 0.8 ms the
/// output's; all on `gemm_tiled` 7.9 ms; all on `gemv` 9.6 ms; all on a `gemv` of four rows a
/// workgroup (each weight read once for them) 7.0 ms.
const GEMV_BELOW_TILES: u64 = 132;
/// Rows of W, and rows of x, of one workgroup's output tile in `gemm_tiled` (TILE) and in
/// `gemm_wide` (WT).
const TILE: u32 = 64;
const WIDE_TILE: u32 = 128;
/// Rows of x from which GPUs run `gemm_wide`: below, most of its 128-row tiles would be empty.
const WIDE_MIN_T: u32 = 128;
/// Workgroups from which a `gemm_wide` or `gemm_coop` product is not split over k (recorded
/// runs only): ~2 a multiprocessor of a large GPU (the H200 has 132). Fewer tiles than that
/// (a 270M model's output and down products at t = 512: 20) leave most of it idle; split, each tile's run of k
/// is shared by up to MAX_SPLITS workgroups, each at least MIN_SPLIT_COLUMNS long, and the
/// partial sums are added afterwards.
const SPLIT_GROUPS: u64 = 256;
const MAX_SPLITS: u64 = 8;
const MIN_SPLIT_COLUMNS: u64 = 128;
/// Columns of one step of `gemm_wide` (WK in the shader) and of `gemm_coop` (CK).
const WIDE_STEP: u64 = 16;
const COOP_STEP: u64 = 32;
/// Multiply-adds one dispatch may cover, so that no single dispatch runs for long on a slow
/// device (a watchdog may take a device that does): on CPU devices (~1-10 GFLOP/s, so ~0.1 s),
/// and on GPUs, where a small dispatch leaves most of the chip idle and each dispatch waits for
/// the last to drain (~1.4 s at 100 GFLOP/s; a 4096^3 product is one dispatch).
const DISPATCH_MACS: u64 = 1 << 28;
const GPU_DISPATCH_MACS: u64 = 1 << 36;
/// Bytes of one `queue.write_buffer` of weights: bounds wgpu's staging memory during uploads.
const WRITE_CHUNK: usize = 64 << 20;
/// How long a readback polls before it blocks, on GPUs (see [`WgpuBackend::spin_for`]). CPU
/// devices always block: their work runs on the threads a spin would take.
const SPIN_WAIT: Duration = Duration::from_millis(1);
/// Size of `Params` in the shader.
const PARAMS_BYTES: u64 = 32;

/// Weight rows an invocation of `gemv` computes: blocks of 4 (GEMV_BLOCKS in the shader), two
/// for q4x32, where sharing each x load among eight rows pays (measured on the H200 at
/// [16384, 16384]: 2.4-2.5 TB/s against 2.1 with one block; the q8 formats lose ~3-8% with two,
/// f32 and bf16 are even).
fn gemv_blocks(format: Format) -> u32 {
    match format {
        Format::Q4x32 => 2,
        Format::F32 | Format::Bf16 | Format::Q8x32 | Format::Q8x16 => 1,
    }
}

fn gemv_rows(format: Format) -> u32 {
    4 * gemv_blocks(format)
}

/// The kernel of products of t >= 4 (t < 4 runs `gemv`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gemm {
    /// `gemm`: register-blocked, no workgroup memory, no barrier (CPU devices).
    Blocked,
    /// `gemm_tiled`: 64 x 64 tiles through workgroup memory.
    Tiled,
    /// `gemm_wide`: 128 x 128 tiles, 8 x 8 an invocation, double-buffered.
    Wide,
    /// `gemm_coop`: 128 x 128 tiles on cooperative matrices (f16 inputs, f32 sums), where the
    /// adapter offers them.
    Coop,
    /// `gemm_large`: 128 x 256 tiles, 8 x 16 an invocation, double-buffered, where the adapter
    /// offers 48 KiB of workgroup memory.
    Large,
    /// `gemm_tiled` below WIDE_MIN_T rows of x, from there `gemm_wide` (`gemm_large` for
    /// products of at least LARGE_MIN_GROUPS of its tiles, where it can run), or `gemm_coop`
    /// for `fast` products where the adapter offers cooperative matrices (GPUs).
    BySize,
}

impl Gemm {
    /// CPU devices: lane-by-lane loads and barriers are what cost there.
    pub const CPU: Gemm = Gemm::Blocked;
    /// GPUs: workgroup memory and barriers are cheap, arithmetic per load is what counts.
    pub const GPU: Gemm = Gemm::BySize;
}

/// The shader's entry points.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kernel {
    Gemv,
    Gemm,
    GemmTiled,
    GemmWide,
    GemmCoop,
    GemmLarge,
    SumPlanes,
    PlaceColumns,
    ElementwiseRows,
    RmsNormRuns,
    RotateRows,
    CopyRows,
    ScatterRows,
    TopKChunks,
}

impl Kernel {
    fn entry(self) -> &'static str {
        match self {
            Kernel::Gemv => "gemv",
            Kernel::Gemm => "gemm",
            Kernel::GemmTiled => "gemm_tiled",
            Kernel::GemmWide => "gemm_wide",
            Kernel::GemmCoop => "gemm_coop",
            Kernel::GemmLarge => "gemm_large",
            Kernel::SumPlanes => "sum_planes",
            Kernel::PlaceColumns => "place_columns",
            Kernel::ElementwiseRows => "elementwise_rows",
            Kernel::RmsNormRuns => "rms_norm_runs",
            Kernel::RotateRows => "rotate_rows",
            Kernel::CopyRows => "copy_rows",
            Kernel::ScatterRows => "scatter_rows",
            Kernel::TopKChunks => "top_k_chunks",
        }
    }
}

/// The most parts a weight past one binding is held in (`Weight::parts`): the device's
/// `max-weight-bytes` is that many bindings.
const MAX_WEIGHT_PARTS: u64 = 64;

/// X_ACT in the shader: products read x as it is.
const X_PLAIN: u32 = 0;

/// X_ACT in the shader for a product that reads a gated op's gate and up outputs as
/// act(gate) * up.
fn x_act(act: Activation) -> u32 {
    match act {
        Activation::GeluTanh => 1,
        Activation::Silu => 2,
    }
}

/// FORMAT in the shader.
fn format_id(format: Format) -> f64 {
    match format {
        Format::F32 => 0.0,
        Format::Bf16 => 1.0,
        Format::Q8x32 => 2.0,
        Format::Q8x16 => 3.0,
        Format::Q4x32 => 4.0,
    }
}

/// `Params` in the shader.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_in: u32,
    n_out: u32,
    t: u32,
    row_quads: u32,
    scale_row: u32,
    row_base: u32,
    t_base: u32,
    x_stride: u32,
}
const _: () = assert!(size_of::<Params>() as u64 == PARAMS_BYTES);

struct Weight {
    format: Format,
    n_out: u32,
    n_in: u32,
    /// Bytes of one row in the upload format.
    row_bytes: u64,
    /// 16-byte quads of one row on the device: `row_bytes` rounded up to a whole shader step
    /// (only f32 and bf16 rows can need padding).
    row_quads: u32,
    scale_row: u32,
    data: wgpu::Buffer,
    /// `None` for the float formats, which bind the placeholder.
    scales: Option<wgpu::Buffer>,
    /// A weight past one binding: its rows in parts, each a weight of its own (`weights`) of
    /// the rows from the one named; `data` is then the placeholder. Empty: one part, this.
    parts: Vec<(BufferId, u32)>,
}

/// One dispatch of a `matmul`: its job, kernel, parameters and workgroup counts.
struct Dispatch {
    job: usize,
    kernel: Kernel,
    params: Params,
    /// Workgroups in x, y and z (z: the runs of k of a product split over k).
    groups: (u32, u32, u32),
}

/// One bind group of a submission: a weight's product (or `ffn`'s activation step) with the
/// buffers it reads and writes.
struct Step {
    /// Picks the pipeline with the dispatch's kernel.
    format: Format,
    weights: wgpu::Buffer,
    scales: wgpu::Buffer,
    /// x: the buffer and the bytes bound.
    input: (wgpu::Buffer, u64),
    /// y: the buffer, the byte offset and the bytes bound.
    output: (wgpu::Buffer, u64, u64),
}

/// Buffers reused across `matmul` calls, grown when a call needs more.
#[derive(Default)]
struct Scratch {
    input: Option<wgpu::Buffer>,
    output: Option<wgpu::Buffer>,
    staging: Option<wgpu::Buffer>,
    params: Option<wgpu::Buffer>,
}

/// What wgpu's callbacks report, shared with them.
#[derive(Default)]
struct Events {
    lost: Mutex<Option<String>>,
    uncaptured: Mutex<Option<String>>,
}

impl Events {
    fn lost(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_lost(&self, why: String) {
        let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
        if lost.is_none() {
            *lost = Some(why);
        }
    }

    fn take_uncaptured(&self) -> Option<String> {
        self.uncaptured.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The error scopes around one piece of device work (innermost last).
struct Scopes {
    scopes: Vec<wgpu::ErrorScopeGuard>,
}

/// A `gpu` backend on a wgpu device.
pub struct WgpuBackend {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: Device,
    limits: wgpu::Limits,
    /// The most bytes one storage binding (a weight's part, a value, a cache) may span.
    max_binding: u64,
    events: Arc<Events>,
    /// Invocations sharing a row in `gemv` on this device (1 on CPU devices, 32 on GPUs): the
    /// base from which [`Self::gemv_lanes`] picks LANES_K for each format.
    lanes_k: u32,
    /// [`Self::set_gemv_lanes`]'s choice, for every format.
    lanes_set: Option<u32>,
    /// Whether a readback spins before it blocks (GPUs; see [`Self::spin_for`]).
    spin_wait: bool,
    /// WISP_PROFILE=1, where the adapter offers timestamp queries: each recorded run times
    /// every kernel in a pass of its own and prints the sums by kernel (a diagnostic: the
    /// passes' boundaries slow the call).
    profile: bool,
    /// WISP_TIMES=1: each recorded run of a program prints to stderr how long
    /// the host took to record it and how long after that its results came back (a diagnostic
    /// of where a decode step's time goes: the host or the device).
    host_times: bool,
    /// With `host_times`: when the last recorded run's results came back, so the next run says
    /// how long the guest (and the call into the host) took between the two.
    results_back: Option<std::time::Instant>,
    /// Multiply-adds a dispatch may cover on this device.
    dispatch_macs: u64,
    /// The kernel of t >= 4.
    gemm: Gemm,
    /// Whether the device has cooperative matrices on (`gemm_coop` can run).
    coop: bool,
    /// matmul.wgsl with `gemm_coop`, where `coop`.
    coop_module: Option<wgpu::ShaderModule>,
    /// matmul.wgsl with `gemm_large`.
    large_module: Option<wgpu::ShaderModule>,
    module: Option<wgpu::ShaderModule>,
    bind_layout: wgpu::BindGroupLayout,
    pipeline_layout: wgpu::PipelineLayout,
    pipelines: HashMap<(Kernel, Format, u32), wgpu::ComputePipeline>,
    placeholder: wgpu::Buffer,
    weights: HashMap<BufferId, Weight>,
    next: BufferId,
    /// Joint weights (`programs`): the rows of products that share an input stacked in one
    /// weight, by the ids of those products' weights, with each one's first row there.
    joints: HashMap<Vec<BufferId>, (BufferId, Vec<u32>)>,
    /// Whether programs' products of one input are joined (WISP_JOINTS=0: not, to compare).
    join: bool,
    /// Whether a kv-cache keeps its keys and values in one buffer where both fit one binding
    /// (see `attention::Cache`); off only in tests, for the other way.
    joint_caches: bool,
    scratch: Scratch,
    /// The `attention` pipeline and its buffers.
    attn: attention::Attention,
    /// The buffers and bind groups of recorded runs.
    recorded: record::Buffers,
    /// Where the adapter offers timestamp queries: two timestamps around each call's compute
    /// pass, resolved into `resolve`, and nanoseconds per tick.
    timer: Option<Timer>,
    last_kernel_ns: Option<u64>,
    /// Times each call's dispatches are recorded and timed (see
    /// [`Backend::set_kernel_repeats`]); 0: once, untimed.
    repeats: u32,
    /// Whether the driver bounds storage accesses itself (Vulkan, D3D12), so that the shaders
    /// can be built without naga's bounds checks.
    native_bounds_checks: bool,
}

struct Timer {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    period_ns: f32,
}

/// Whether `gemm_coop` can run on the adapter: cooperative matrices of 16 x 16 x 16 with f16
/// inputs and f32 sums, f16 in shaders, subgroups of exactly 32 (the kernel gives each 32
/// invocations their own matrices) and its workgroup memory.
fn offers_coop(adapter: &wgpu::Adapter) -> bool {
    let wanted = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16;
    let info = adapter.get_info();
    adapter.features().contains(wanted)
        && info.subgroup_min_size == 32
        && info.subgroup_max_size == 32
        && adapter.limits().max_compute_workgroup_storage_size >= COOP_WORKGROUP_BYTES
        && adapter.cooperative_matrix_properties().iter().any(|p| {
            (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
                && p.ab_type == wgpu::CooperativeScalarType::F16
                && p.cr_type == wgpu::CooperativeScalarType::F32
        })
}

fn backend_name(b: wgpu::Backend) -> &'static str {
    match b {
        wgpu::Backend::Vulkan => "vulkan",
        wgpu::Backend::Metal => "metal",
        wgpu::Backend::Dx12 => "dx12",
        wgpu::Backend::Gl => "gl",
        wgpu::Backend::BrowserWebGpu => "webgpu",
        wgpu::Backend::Noop => "other",
    }
}

fn device_type_name(t: wgpu::DeviceType) -> &'static str {
    match t {
        wgpu::DeviceType::DiscreteGpu => "discrete-gpu",
        wgpu::DeviceType::IntegratedGpu => "integrated-gpu",
        wgpu::DeviceType::VirtualGpu => "virtual-gpu",
        wgpu::DeviceType::Cpu => "cpu",
        wgpu::DeviceType::Other => "other",
    }
}

/// Lower is preferred: a real GPU first, a CPU implementation last; Vulkan before GL.
fn rank(info: &wgpu::AdapterInfo) -> (u8, u8) {
    let kind = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    };
    let api = match info.backend {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        _ => 1,
    };
    (kind, api)
}

/// Whether an adapter can run the shader at all.
fn usable(adapter: &wgpu::Adapter) -> bool {
    let caps = adapter.get_downlevel_capabilities();
    let limits = adapter.limits();
    caps.flags.contains(wgpu::DownlevelFlags::COMPUTE_SHADERS)
        && limits.max_storage_buffers_per_shader_stage >= 4
        && limits.max_compute_invocations_per_workgroup >= WORKGROUP
        && limits.max_compute_workgroup_size_x >= WORKGROUP
}

fn align_up(n: u64, a: u64) -> u64 {
    n.div_ceil(a) * a
}

fn wgpu_error(e: wgpu::Error) -> GpuError {
    match e {
        wgpu::Error::OutOfMemory { .. } => GpuError::OutOfMemory("the device is out of memory".into()),
        other => GpuError::Unavailable(format!("the device refused the work: {other}")),
    }
}

impl WgpuBackend {
    /// Opens the preferred adapter: a GPU if there is one, else any adapter (Mesa's lavapipe or
    /// llvmpipe). Vulkan, Metal and DX12 adapters come first; GL is only looked at when none of
    /// those will do. `WISP_ADAPTER`, when set, picks the preferred usable adapter whose name
    /// contains it (case-insensitive), and is an error when none does. `Ok(None)` when there is
    /// no usable adapter.
    pub fn new() -> Result<Option<WgpuBackend>> {
        let wanted = std::env::var("WISP_ADAPTER").ok().filter(|s| !s.is_empty()).map(|s| s.to_lowercase());
        let mut seen = Vec::new();
        for backends in [wgpu::Backends::PRIMARY, wgpu::Backends::SECONDARY] {
            let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
                backends,
                ..wgpu::InstanceDescriptor::new_without_display_handle()
            });
            let adapters: Vec<wgpu::Adapter> =
                pollster::block_on(instance.enumerate_adapters(backends)).into_iter().filter(usable).collect();
            seen.extend(
                adapters.iter().map(|a| format!("{} ({})", a.get_info().name, backend_name(a.get_info().backend))),
            );
            let chosen = adapters
                .iter()
                .filter(|a| wanted.as_ref().is_none_or(|w| a.get_info().name.to_lowercase().contains(w)))
                .min_by_key(|a| rank(&a.get_info()));
            if let Some(adapter) = chosen {
                return Self::open(adapter.clone()).map(Some);
            }
        }
        match wanted {
            Some(w) => bail!("WISP_ADAPTER={w:?} matches none of the adapters: [{}]", seen.join(", ")),
            None => Ok(None),
        }
    }

    fn open(adapter: wgpu::Adapter) -> Result<WgpuBackend> {
        let ainfo = adapter.get_info();
        // The adapter's own limits: the defaults would cap a storage binding at 128 MiB.
        let limits = adapter.limits();
        // Cooperative matrices take f16 inputs: below the accuracy of `exact` products, so they
        // serve `fast` ones only (`kernel_for`). WISP_COOP=0 keeps them off (to compare).
        let coop = offers_coop(&adapter) && !std::env::var("WISP_COOP").is_ok_and(|v| v == "0");
        let mut required_features = adapter.features() & wgpu::Features::TIMESTAMP_QUERY;
        let mut experimental_features = wgpu::ExperimentalFeatures::disabled();
        if coop {
            required_features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16;
            // SAFETY: the only experimental feature asked for is cooperative matrices, used by
            // `gemm_coop` alone, with the one configuration `offers_coop` found on the adapter
            // (wgpu does not check a shader's matrices against the adapter's), subgroups of
            // the size it assumes, in uniform control flow, and with indices bound by `let`
            // (naga 30 panics on inline ones).
            experimental_features = unsafe { wgpu::ExperimentalFeatures::enabled() };
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("wisp"),
            required_features,
            required_limits: limits.clone(),
            experimental_features,
            ..Default::default()
        }))
        .with_context(|| format!("opening {} ({})", ainfo.name, backend_name(ainfo.backend)))?;

        let events = Arc::new(Events::default());
        let e = events.clone();
        device.on_uncaptured_error(Arc::new(move |err: wgpu::Error| {
            *e.uncaptured.lock().unwrap_or_else(|p| p.into_inner()) = Some(err.to_string());
        }));
        let e = events.clone();
        device.set_device_lost_callback(move |reason, message| {
            e.set_lost(format!("{reason:?}: {message}"));
        });

        let storage = |binding: u32, read_only: bool, min: u64| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: wgpu::BufferSize::new(min),
            },
            count: None,
        };
        let scopes = push_scopes(&device);
        let bind_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("matmul"),
            entries: &[
                wgpu::BindGroupLayoutEntry {
                    binding: 0,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: true,
                        min_binding_size: wgpu::BufferSize::new(PARAMS_BYTES),
                    },
                    count: None,
                },
                storage(1, true, 16),
                storage(2, true, 4),
                storage(3, true, 16),
                storage(4, false, 4),
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("matmul"),
            bind_group_layouts: &[Some(&bind_layout)],
            immediate_size: 0,
        });
        let placeholder = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("placeholder"),
            // Bound as scales, or as the weights (16 bytes at least) of a kernel reading none.
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        pop_scopes(scopes).map_err(|e| anyhow::anyhow!("setting up {}: {e}", ainfo.name))?;

        let max_binding = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size) & !3;
        let info = Device {
            name: ainfo.name.clone(),
            backend: backend_name(ainfo.backend).into(),
            device_type: device_type_name(ainfo.device_type).into(),
            // A weight past one binding is held in parts (`Weight::parts`).
            max_weight_bytes: max_binding.saturating_mul(MAX_WEIGHT_PARTS),
            max_activation_elements: max_binding / 4,
        };
        // A CPU device runs an invocation per SIMD lane: one row each is best there, and keeps
        // the barrier out. A GPU shares a row among a warp's worth, for coalesced reads.
        let lanes_k = if ainfo.device_type == wgpu::DeviceType::Cpu { 1 } else { 32 };
        let timer = device.features().contains(wgpu::Features::TIMESTAMP_QUERY).then(|| Timer {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("matmul pass"),
                ty: wgpu::QueryType::Timestamp,
                count: 2,
            }),
            resolve: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamps"),
                size: 16,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            period_ns: queue.get_timestamp_period(),
        });
        Ok(WgpuBackend {
            device,
            queue,
            info,
            limits,
            max_binding,
            events,
            lanes_k,
            lanes_set: None,
            spin_wait: ainfo.device_type != wgpu::DeviceType::Cpu,
            profile: std::env::var("WISP_PROFILE").is_ok_and(|v| v == "1"),
            host_times: std::env::var("WISP_TIMES").is_ok_and(|v| v == "1"),
            results_back: None,
            gemm: if ainfo.device_type == wgpu::DeviceType::Cpu { Gemm::CPU } else { Gemm::GPU },
            coop,
            coop_module: None,
            large_module: None,
            dispatch_macs: if ainfo.device_type == wgpu::DeviceType::Cpu { DISPATCH_MACS } else { GPU_DISPATCH_MACS },
            module: None,
            bind_layout,
            pipeline_layout,
            pipelines: HashMap::new(),
            placeholder,
            weights: HashMap::new(),
            next: 0,
            joints: HashMap::new(),
            join: !std::env::var("WISP_JOINTS").is_ok_and(|v| v == "0"),
            joint_caches: true,
            scratch: Scratch::default(),
            attn: attention::Attention::default(),
            recorded: record::Buffers::default(),
            timer,
            last_kernel_ns: None,
            repeats: 0,
            native_bounds_checks: matches!(ainfo.backend, wgpu::Backend::Vulkan | wgpu::Backend::Dx12),
        })
    }

    /// The adapter's name, backend and type, e.g. "llvmpipe (LLVM 15.0.6, 256 bits) (vulkan, cpu)".
    pub fn describe(&self) -> String {
        format!("{} ({}, {})", self.info.name, self.info.backend, self.info.device_type)
    }

    /// How many invocations of the small-t kernel share one weight row (LANES_K in the shader):
    /// a power of two from 1 to 64, for every format. Otherwise it is 1 on CPU devices and 32 on
    /// GPUs, 64 for q4x32; this overrides it, so that either path can be tested (or tuned) on
    /// any device.
    pub fn set_gemv_lanes(&mut self, lanes: u32) -> Result<(), GpuError> {
        if !lanes.is_power_of_two() || lanes > WORKGROUP {
            return Err(GpuError::InvalidArgument(format!(
                "{lanes} lanes a row: not a power of two up to {WORKGROUP}"
            )));
        }
        if self.lanes_set != Some(lanes) {
            self.lanes_set = Some(lanes);
            self.pipelines.retain(|(kernel, _, _), _| *kernel != Kernel::Gemv);
        }
        Ok(())
    }

    /// Invocations sharing a row in `gemv` for weights in `format`: [`Self::set_gemv_lanes`]'s
    /// choice, else 1 on CPU devices and 32 on GPUs, 64 for q4x32 (whose row holds half the
    /// steps of a q8 row, and which runs two blocks of rows: 2.4-2.5 TB/s on the H200 against
    /// 1.8-1.9 with 32 lanes).
    fn gemv_lanes(&self, format: Format) -> u32 {
        match self.lanes_set {
            Some(lanes) => lanes,
            None if format == Format::Q4x32 && self.lanes_k > 1 => 2 * self.lanes_k,
            None => self.lanes_k,
        }
    }

    /// The kernel of products of t >= 4. `new` picks [`Gemm::CPU`] on CPU devices and
    /// [`Gemm::GPU`] elsewhere; this overrides it, so that every path can be tested (or
    /// measured) on any device. [`Gemm::Coop`] is refused where the adapter offers no
    /// cooperative matrices, [`Gemm::Large`] where it offers too little workgroup memory.
    pub fn set_gemm(&mut self, gemm: Gemm) -> Result<(), GpuError> {
        if gemm == Gemm::Coop && !self.coop {
            return Err(GpuError::InvalidArgument(format!("{} offers no cooperative matrices", self.info.name)));
        }
        if gemm == Gemm::Large && !self.has_large() {
            let bytes = self.limits.max_compute_workgroup_storage_size;
            return Err(GpuError::InvalidArgument(format!(
                "{} offers {bytes} bytes of workgroup memory, gemm_large needs {LARGE_WORKGROUP_BYTES}",
                self.info.name
            )));
        }
        self.gemm = gemm;
        Ok(())
    }

    /// Whether the kv-caches made from now on keep keys and values in one buffer where both
    /// fit one binding (the default: a program's cache write is then one dispatch) or in two,
    /// so that both ways can be tested on any device.
    pub fn set_joint_caches(&mut self, on: bool) {
        self.joint_caches = on;
    }

    /// Whether a readback polls for up to a millisecond before it blocks: `new` picks it on
    /// GPUs and not on CPU devices; this overrides it, so that both ways can be tested (or
    /// measured) on any device.
    pub fn set_spin_wait(&mut self, on: bool) {
        self.spin_wait = on;
    }

    /// Whether `fast` products of t >= 128 run on cooperative matrices here (f16 inputs, f32
    /// sums): where the adapter offers them, unless WISP_COOP=0.
    pub fn has_coop(&self) -> bool {
        self.coop
    }

    /// Whether `gemm_large` can run here: the adapter offers its workgroup memory (GPUs
    /// with 48 KiB; not lavapipe, which offers 32).
    pub fn has_large(&self) -> bool {
        self.limits.max_compute_workgroup_storage_size >= LARGE_WORKGROUP_BYTES
    }

    /// The kernel of a product of `t` rows of x by `n_out` rows of weights in `format` at
    /// `precision`, and the rows of W and of x one workgroup of it covers. Cooperative matrices
    /// (f16 inputs) serve `fast` products only, unless [`Gemm::Coop`] is set.
    fn kernel_for(&self, t: u32, n_out: u32, format: Format, precision: Precision) -> (Kernel, u32, u32) {
        if t < GEMM_MIN_T {
            return (Kernel::Gemv, gemv_rows(format) * WORKGROUP / self.gemv_lanes(format), 1);
        }
        let large_groups = (n_out as u64).div_ceil(WIDE_TILE as u64) * (t as u64).div_ceil(LARGE_T as u64);
        match self.gemm {
            Gemm::BySize if t <= TILE && (n_out as u64).div_ceil(TILE as u64) < GEMV_BELOW_TILES => {
                (Kernel::Gemv, gemv_rows(format) * WORKGROUP / self.gemv_lanes(format), 1)
            }
            Gemm::Coop => (Kernel::GemmCoop, WIDE_TILE, WIDE_TILE),
            Gemm::BySize if t >= WIDE_MIN_T && self.coop && precision == Precision::Fast => {
                (Kernel::GemmCoop, WIDE_TILE, WIDE_TILE)
            }
            Gemm::Wide => (Kernel::GemmWide, WIDE_TILE, WIDE_TILE),
            Gemm::Large => (Kernel::GemmLarge, WIDE_TILE, LARGE_T),
            Gemm::BySize if t >= WIDE_MIN_T && large_groups >= LARGE_MIN_GROUPS && self.has_large() => {
                (Kernel::GemmLarge, WIDE_TILE, LARGE_T)
            }
            Gemm::BySize if t >= WIDE_MIN_T => (Kernel::GemmWide, WIDE_TILE, WIDE_TILE),
            Gemm::Tiled | Gemm::BySize => (Kernel::GemmTiled, TILE, TILE),
            Gemm::Blocked => (Kernel::Gemm, GEMM_ROWS * WORKGROUP, 4),
        }
    }

    /// Makes the device lost, as a driver reset would: the device is destroyed and every later
    /// call returns [`GpuError::DeviceLost`]. For tests.
    pub fn simulate_device_loss(&mut self) {
        self.device.destroy();
        // Destruction is reported through the device-lost callback on the next poll.
        let _ = self.poll();
        self.events.set_lost("simulated device loss".into());
        self.scratch = Scratch::default();
    }

    fn live(&self) -> Result<(), GpuError> {
        match self.events.lost() {
            Some(why) => Err(GpuError::DeviceLost(why)),
            None => Ok(()),
        }
    }

    /// Ends a piece of work: its scopes' errors, a loss in the meantime, or an uncaptured error.
    fn finish(&self, scopes: Scopes) -> Result<(), GpuError> {
        let scoped = pop_scopes(scopes);
        self.live()?;
        scoped?;
        match self.events.take_uncaptured() {
            Some(m) => Err(GpuError::Unavailable(format!("the device refused the work: {m}"))),
            None => Ok(()),
        }
    }

    /// Waits for the queue. wgpu panics on a device error here (a device lost mid-wait): that
    /// panic is caught and becomes an error.
    fn poll(&self) -> Result<(), GpuError> {
        self.poll_as(wgpu::PollType::wait_indefinitely())
    }

    fn poll_as(&self, how: wgpu::PollType) -> Result<(), GpuError> {
        let device = &self.device;
        match catch_unwind(AssertUnwindSafe(|| device.poll(how))) {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(GpuError::Unavailable(format!("waiting for the device: {e}"))),
            Err(_) => {
                self.events.set_lost("the device failed while it was waited for".into());
                Err(GpuError::DeviceLost(self.events.lost().unwrap_or_default()))
            }
        }
    }

    /// The pipeline of `kernel` for weights in `format`, reading x as `x_act` says (X_ACT in
    /// the shader: [`X_PLAIN`], or [`x_act`]'s gated reads).
    fn pipeline(&mut self, kernel: Kernel, format: Format, x_act: u32) -> Result<wgpu::ComputePipeline, GpuError> {
        if let Some(p) = self.pipelines.get(&(kernel, format, x_act)) {
            return Ok(p.clone());
        }
        let scopes = push_scopes(&self.device);
        let (slot, label, source) = match kernel {
            Kernel::GemmCoop => (
                &mut self.coop_module,
                "matmul_coop.wgsl",
                format!("enable f16;\nenable wgpu_cooperative_matrix;\n{SHADER}\n{COOP_SHADER}").into(),
            ),
            Kernel::GemmLarge => {
                (&mut self.large_module, "matmul_large.wgsl", format!("{SHADER}\n{LARGE_SHADER}").into())
            }
            _ => (&mut self.module, "matmul.wgsl", SHADER.into()),
        };
        let module = match slot {
            Some(m) => m.clone(),
            None => {
                let desc =
                    wgpu::ShaderModuleDescriptor { label: Some(label), source: wgpu::ShaderSource::Wgsl(source) };
                let m = if self.native_bounds_checks {
                    // SAFETY: without naga's checks, the driver's own robust buffer access
                    // (Vulkan's robustBufferAccess, D3D12's bounds-checked views) still confines
                    // every storage access to its binding, whatever shape a guest asks for. The
                    // workgroup arrays have no such guard: every index into them is in range by
                    // construction (tile offsets times constant strides, `min`-clamped rows),
                    // every loop has a bound, and no division is by a value that can be zero.
                    // This buys ~30% on `gemm_coop` and ~10% on `gemm_wide` (H200).
                    unsafe { self.device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
                } else {
                    self.device.create_shader_module(desc)
                };
                *slot = Some(m.clone());
                m
            }
        };
        let constants = [
            ("FORMAT", format_id(format)),
            ("LANES_K", self.gemv_lanes(format) as f64),
            ("GEMV_BLOCKS", gemv_blocks(format) as f64),
            ("X_ACT", x_act as f64),
            ("X_ALIGN", (self.limits.min_storage_buffer_offset_alignment.max(16) / 4) as f64),
        ];
        let label = format!("matmul {} {}", kernel.entry(), format.name());
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&label),
            layout: Some(&self.pipeline_layout),
            module: &module,
            entry_point: Some(kernel.entry()),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        if let Err(e) = self.finish(scopes) {
            // A module that failed to build is not kept either.
            match kernel {
                Kernel::GemmCoop => self.coop_module = None,
                Kernel::GemmLarge => self.large_module = None,
                _ => self.module = None,
            }
            return Err(e);
        }
        self.pipelines.insert((kernel, format, x_act), pipeline.clone());
        Ok(pipeline)
    }

    /// A buffer of at least `size` bytes in `slot`, grown (to a power of two, within `cap`) when
    /// it is smaller.
    fn ensure(
        device: &wgpu::Device,
        slot: &mut Option<wgpu::Buffer>,
        size: u64,
        cap: u64,
        usage: wgpu::BufferUsages,
        label: &str,
    ) -> wgpu::Buffer {
        if let Some(b) = slot
            && b.size() >= size
        {
            return b.clone();
        }
        let grown = size.checked_next_power_of_two().unwrap_or(size).min(cap).max(size);
        let b = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: grown,
            usage,
            mapped_at_creation: false,
        });
        *slot = Some(b.clone());
        b
    }

    /// The dispatches of one job (its kernel from [`Self::kernel_for`]), split so that no
    /// dispatch exceeds the device's workgroups per dimension or its multiply-add budget.
    /// With `may_split`, a `gemm_wide` or `gemm_coop` product of few tiles is split over k (see
    /// [`SPLIT_GROUPS`]): it writes that many planes of partial sums, `t * n_out` values each,
    /// for the caller to add. Returns the planes (1: not split).
    #[allow(clippy::too_many_arguments)]
    fn plan(&self, job: usize, w: &Weight, t: u32, x_quads: u32, precision: Precision, may_split: bool, out: &mut Vec<Dispatch>) -> u32 {
        let (kernel, rows_per_group, t_per_group) = self.kernel_for(t, w.n_out, w.format, precision);
        let max_dim = self.limits.max_compute_workgroups_per_dimension.max(1) as u64;
        let gx_total = (w.n_out as u64).div_ceil(rows_per_group as u64);
        let gy_total = (t as u64).div_ceil(t_per_group as u64);
        let splits = if may_split { self.k_splits(w, t, precision) as u64 } else { 1 };
        let macs_per_group = rows_per_group as u64 * t_per_group as u64 * (w.n_in as u64).div_ceil(splits);
        let groups_budget = (self.dispatch_macs / macs_per_group / splits).max(1);
        let gx = gx_total.min(max_dim).min(groups_budget).max(1);
        let gy = gy_total.min(max_dim).min((groups_budget / gx).max(1));
        let base = Params {
            n_in: w.n_in,
            n_out: w.n_out,
            t,
            row_quads: w.row_quads,
            scale_row: w.scale_row,
            row_base: 0,
            t_base: 0,
            x_stride: x_quads,
        };
        let mut y0 = 0;
        while y0 < gy_total {
            let ny = gy.min(gy_total - y0);
            let mut x0 = 0;
            while x0 < gx_total {
                let nx = gx.min(gx_total - x0);
                let params = Params {
                    row_base: (x0 * rows_per_group as u64) as u32,
                    t_base: (y0 * t_per_group as u64) as u32,
                    ..base
                };
                out.push(Dispatch { job, kernel, params, groups: (nx as u32, ny as u32, splits as u32) });
                x0 += nx;
            }
            y0 += ny;
        }
        splits as u32
    }

    /// The runs of k `plan` splits a product of `t` rows by `w` into where it may (1: none).
    fn k_splits(&self, w: &Weight, t: u32, precision: Precision) -> u32 {
        let (kernel, rows_per_group, t_per_group) = self.kernel_for(t, w.n_out, w.format, precision);
        let step = match kernel {
            Kernel::GemmWide => WIDE_STEP,
            Kernel::GemmCoop => COOP_STEP,
            _ => return 1,
        };
        let groups = (w.n_out as u64).div_ceil(rows_per_group as u64) * (t as u64).div_ceil(t_per_group as u64);
        let by_groups = SPLIT_GROUPS.div_ceil(groups);
        let by_steps = (w.n_in as u64).div_ceil(step) / (MIN_SPLIT_COLUMNS / step);
        let max_dim = self.limits.max_compute_workgroups_per_dimension as u64;
        by_groups.min(by_steps).min(MAX_SPLITS).min(max_dim).max(1) as u32
    }

    /// Runs `jobs` (all of whose outputs fit one output buffer) over the input already written
    /// to the input buffer: one submission, one readback.
    fn run_batch(&mut self, x_bytes: u64, x_quads: u32, t: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        let storage_align = self.limits.min_storage_buffer_offset_alignment.max(4) as u64;
        let mut offsets = Vec::with_capacity(jobs.len());
        let mut out_bytes = 0u64;
        for id in jobs {
            let w = self.weights.get(id).ok_or_else(|| GpuError::InvalidArgument(format!("no weight {id}")))?;
            out_bytes = align_up(out_bytes, storage_align);
            offsets.push((out_bytes, t as u64 * w.n_out as u64));
            out_bytes += t as u64 * w.n_out as u64 * 4;
        }
        let scopes = push_scopes(&self.device);
        let cap = self.limits.max_buffer_size;
        let s = &mut self.scratch;
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
        let output = Self::ensure(&self.device, &mut s.output, out_bytes, cap, usage, "output");
        let input = s.input.clone();
        self.finish(scopes).inspect_err(|_| self.scratch = Scratch::default())?;
        let Some(input) = input else { return Err(GpuError::Unavailable("no input buffer".into())) };
        let mut steps = Vec::with_capacity(jobs.len());
        let mut dispatches = Vec::new();
        for (j, (id, &(offset, len))) in jobs.iter().zip(&offsets).enumerate() {
            let step = self.product(*id, (&input, x_bytes), (&output, offset, len * 4))?;
            let w = &self.weights[id];
            self.plan(j, w, t, x_quads, Precision::Exact, false, &mut dispatches);
            steps.push(step);
        }
        self.submit(&steps, &dispatches, &output, &offsets)
    }

    /// Writes `x[t, n_in]` to the input buffer, each row padded with zeros to `x_elems`.
    fn write_input(&mut self, x: &[f32], t: u32, n_in: u32, x_elems: u64) -> Result<(), GpuError> {
        let scopes = push_scopes(&self.device);
        let cap = self.limits.max_buffer_size;
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let input = Self::ensure(&self.device, &mut self.scratch.input, t as u64 * x_elems * 4, cap, usage, "input");
        if x_elems == n_in as u64 {
            self.queue.write_buffer(&input, 0, bytemuck::cast_slice(x));
        } else {
            let mut padded = vec![0f32; (t as u64 * x_elems) as usize];
            for (dst, row) in padded.chunks_exact_mut(x_elems as usize).zip(x.chunks_exact(n_in as usize)) {
                dst[..row.len()].copy_from_slice(row);
            }
            self.queue.write_buffer(&input, 0, bytemuck::cast_slice(&padded));
        }
        self.finish(scopes).inspect_err(|_| self.scratch = Scratch::default())
    }

    /// The step of weight `id`'s product, reading x from `input` and writing to `output`.
    fn product(&self, id: BufferId, input: (&wgpu::Buffer, u64), output: (&wgpu::Buffer, u64, u64)) -> Result<Step, GpuError> {
        let w = self.weights.get(&id).ok_or_else(|| GpuError::InvalidArgument(format!("no weight {id}")))?;
        Ok(Step {
            format: w.format,
            weights: w.data.clone(),
            scales: w.scales.clone().unwrap_or_else(|| self.placeholder.clone()),
            input: (input.0.clone(), input.1),
            output: (output.0.clone(), output.1, output.2),
        })
    }

    /// Records `dispatches` (each of step `d.job`'s bind group) in one compute pass, copies
    /// `output` to the staging buffer, submits, and reads back `(byte offset, values)` of each
    /// of `reads`. One submission, one readback.
    fn submit(
        &mut self,
        steps: &[Step],
        dispatches: &[Dispatch],
        output: &wgpu::Buffer,
        reads: &[(u64, u64)],
    ) -> Result<Vec<Vec<f32>>, GpuError> {
        let uniform_align = self.limits.min_uniform_buffer_offset_alignment.max(4) as u64;
        let params_stride = align_up(PARAMS_BYTES, uniform_align);
        let out_bytes = reads.iter().map(|&(o, n)| o + 4 * n).max().unwrap_or(0);
        let mut pipelines = HashMap::new();
        for d in dispatches {
            let format = steps[d.job].format;
            if let std::collections::hash_map::Entry::Vacant(e) = pipelines.entry((d.kernel, format)) {
                e.insert(self.pipeline(d.kernel, format, X_PLAIN)?);
            }
        }

        let scopes = push_scopes(&self.device);
        let cap = self.limits.max_buffer_size;
        let device = &self.device;
        let s = &mut self.scratch;
        // The staging buffer takes the outputs, then the two timestamps (8-byte aligned) when
        // the call is timed.
        let timer = self.timer.as_ref().filter(|_| self.repeats > 0);
        let stamps_at = align_up(out_bytes, 8);
        let staging_bytes = if timer.is_some() { stamps_at + 16 } else { out_bytes };
        let staging = Self::ensure(
            device,
            &mut s.staging,
            staging_bytes,
            cap,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            "staging",
        );
        let params_bytes = params_stride * dispatches.len() as u64;
        if params_bytes > u32::MAX as u64 {
            return Err(GpuError::OutOfMemory(format!("{} dispatches are too many for one call", dispatches.len())));
        }
        let params_buf = Self::ensure(
            device,
            &mut s.params,
            params_bytes,
            cap,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            "params",
        );

        let mut params = vec![0u8; params_bytes as usize];
        for (i, d) in dispatches.iter().enumerate() {
            let at = i * params_stride as usize;
            params[at..at + PARAMS_BYTES as usize].copy_from_slice(bytemuck::bytes_of(&d.params));
        }
        self.queue.write_buffer(&params_buf, 0, &params);

        let groups: Vec<wgpu::BindGroup> = steps
            .iter()
            .map(|st| {
                self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("matmul"),
                    layout: &self.bind_layout,
                    entries: &[
                        wgpu::BindGroupEntry { binding: 0, resource: binding(&params_buf, 0, PARAMS_BYTES) },
                        wgpu::BindGroupEntry { binding: 1, resource: st.weights.as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 2, resource: st.scales.as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 3, resource: binding(&st.input.0, 0, st.input.1) },
                        wgpu::BindGroupEntry { binding: 4, resource: binding(&st.output.0, st.output.1, st.output.2) },
                    ],
                })
            })
            .collect();

        let mut encoder = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("matmul") });
        // Timed with repeats (benchmarks), an untimed pass first, so that the timed one does not
        // start by waiting for the input's upload.
        let passes: &[(u32, bool)] = match self.repeats {
            0 => &[(1, false)],
            1 => &[(1, true)],
            n => &[(1, false), (n, true)],
        };
        for &(times, timed) in passes {
            let timestamp_writes = timer.filter(|_| timed).map(|t| wgpu::ComputePassTimestampWrites {
                query_set: &t.queries,
                beginning_of_pass_write_index: Some(0),
                end_of_pass_write_index: Some(1),
            });
            let mut pass =
                encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("matmul"), timestamp_writes });
            for _ in 0..times {
                for (i, d) in dispatches.iter().enumerate() {
                    let format = steps[d.job].format;
                    let Some(pipeline) = pipelines.get(&(d.kernel, format)) else {
                        return Err(GpuError::Unavailable(format!("no pipeline for {:?} {}", d.kernel, format.name())));
                    };
                    pass.set_pipeline(pipeline);
                    pass.set_bind_group(0, &groups[d.job], &[(i as u64 * params_stride) as u32]);
                    pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
                }
            }
        }
        encoder.copy_buffer_to_buffer(output, 0, &staging, 0, out_bytes);
        if let Some(t) = timer {
            encoder.resolve_query_set(&t.queries, 0..2, &t.resolve, 0);
            encoder.copy_buffer_to_buffer(&t.resolve, 0, &staging, stamps_at, 16);
        }
        self.queue.submit([encoder.finish()]);

        let result = self.read_back(&staging, staging_bytes, |view| {
            let outs = reads
                .iter()
                .map(|&(o, n)| bytemuck::pod_collect_to_vec::<u8, f32>(&view[o as usize..(o + n * 4) as usize]))
                .collect::<Vec<_>>();
            let stamps = timer.map(|t| {
                let at = stamps_at as usize;
                let tick = |i: usize| u64::from_le_bytes(view[at + 8 * i..at + 8 * i + 8].try_into().unwrap_or([0; 8]));
                (tick(1).saturating_sub(tick(0)) as f64 * t.period_ns as f64 / self.repeats as f64) as u64
            });
            (outs, stamps)
        });
        let finished = self.finish(scopes);
        match (finished, result) {
            (Ok(()), Ok((outs, kernel_ns))) => {
                self.last_kernel_ns = kernel_ns;
                Ok(outs)
            }
            (Err(e), _) | (Ok(()), Err(e)) => {
                // Start the next call from fresh buffers: these may be left mapped or invalid.
                self.scratch = Scratch::default();
                Err(e)
            }
        }
    }
}

impl WgpuBackend {
    /// Polls without blocking for up to [`SPIN_WAIT`] until `rx` has the mapping's outcome.
    /// A blocking wait sleeps in the driver and wakes 40-60 us after the GPU is done (H200: a
    /// small product's round trip 112-147 us blocking, 70-85 spinning); most calls of a decode
    /// step finish within the spin. `None` when they do not, or when a poll fails (the
    /// blocking wait that follows reports it).
    fn spin_for<T>(&self, rx: &mpsc::Receiver<T>) -> Option<T> {
        let start = Instant::now();
        while start.elapsed() < SPIN_WAIT {
            self.poll_as(wgpu::PollType::Poll).ok()?;
            if let Ok(r) = rx.try_recv() {
                return Some(r);
            }
            std::hint::spin_loop();
        }
        None
    }

    /// Maps the first `bytes` of `staging` (work copying into it is submitted), waits for the
    /// device, and gives them to `read`.
    fn read_back<R>(&self, staging: &wgpu::Buffer, bytes: u64, read: impl FnOnce(&[u8]) -> R) -> Result<R, GpuError> {
        let (tx, rx) = mpsc::channel();
        let slice = staging.slice(0..bytes);
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let early = if self.spin_wait { self.spin_for(&rx) } else { None };
        let waited = if early.is_some() { Ok(()) } else { self.poll() };
        let mapped = match early.map_or_else(|| rx.try_recv(), Ok) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(GpuError::Unavailable(format!("reading the result back: {e}"))),
            Err(_) => Err(GpuError::Unavailable("reading the result back: the mapping never completed".into())),
        };
        let result = waited.and(mapped).and_then(|()| {
            let view =
                slice.get_mapped_range().map_err(|e| GpuError::Unavailable(format!("reading the result back: {e}")))?;
            Ok(read(&view))
        });
        staging.unmap();
        result
    }
}

fn binding(buffer: &wgpu::Buffer, offset: u64, size: u64) -> wgpu::BindingResource<'_> {
    wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer, offset, size: wgpu::BufferSize::new(size) })
}

fn push_scopes(device: &wgpu::Device) -> Scopes {
    Scopes {
        scopes: vec![
            device.push_error_scope(wgpu::ErrorFilter::Internal),
            device.push_error_scope(wgpu::ErrorFilter::OutOfMemory),
            device.push_error_scope(wgpu::ErrorFilter::Validation),
        ],
    }
}

/// Pops the scopes, innermost first; the first error they caught.
fn pop_scopes(mut scopes: Scopes) -> Result<(), GpuError> {
    let mut first = None;
    while let Some(s) = scopes.scopes.pop() {
        if let Some(e) = pollster::block_on(s.pop()) {
            first.get_or_insert(e);
        }
    }
    match first {
        Some(e) => Err(wgpu_error(e)),
        None => Ok(()),
    }
}

impl Backend for WgpuBackend {
    fn last_kernel_ns(&self) -> Option<u64> {
        self.last_kernel_ns
    }

    fn set_kernel_repeats(&mut self, n: u32) {
        self.repeats = n;
    }

    fn device(&self) -> Option<Device> {
        match self.events.lost() {
            Some(_) => None,
            None => Some(self.info.clone()),
        }
    }

    fn create(&mut self, format: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        self.live()?;
        let row_bytes = format
            .data_bytes(n_in as u64)
            .ok_or_else(|| GpuError::InvalidArgument(format!("a row of {n_in} {} values overflows", format.name())))?;
        // A row is a whole number of shader steps: 8 elements for f32 and bf16 (32 and 16
        // bytes), a multiple of 16 bytes already for the block formats.
        let step = if format == Format::F32 { 32 } else { 16 };
        let row_quads = row_bytes.div_ceil(step) * step / 16;
        let scale_row = format.scale_count(n_in as u64);
        // Checked: [2^30, u32::MAX] f32 values are 2^64 bytes, which would wrap to an empty buffer.
        let data_bytes = (row_quads * 16).checked_mul(n_out as u64);
        let scale_bytes = (scale_row * 4).checked_mul(n_out as u64);
        // Past one binding, the rows go in parts of what one binding holds (at most
        // MAX_WEIGHT_PARTS of them: the device's `max_weight_bytes`).
        let per_part = self.max_binding / (row_quads * 16).max(scale_row * 4).max(1);
        let max = if per_part > 0 { self.info.max_weight_bytes } else { self.max_binding };
        let (Some(data_bytes), Some(scale_bytes)) =
            (data_bytes.filter(|&b| b <= max), scale_bytes.filter(|&b| b <= max))
        else {
            let needs = data_bytes.map_or("more than 2^64".to_string(), |b| b.to_string());
            return Err(GpuError::OutOfMemory(format!(
                "a {} weight [{n_out}, {n_in}] needs a buffer of {needs} bytes; the device's limit is {max}",
                format.name()
            )));
        };
        if row_quads > u32::MAX as u64 || scale_row > u32::MAX as u64 {
            return Err(GpuError::OutOfMemory(format!(
                "a {} weight [{n_out}, {n_in}] has rows longer than the device can address; the device's limit is \
                 {max} bytes",
                format.name()
            )));
        }
        if data_bytes.max(scale_bytes) > self.max_binding {
            return self.create_parts(format, n_out, n_in, per_part as u32);
        }
        let scopes = push_scopes(&self.device);
        // COPY_SRC: a program's joint weights are copied from weights (`programs`).
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
        let data = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("weights"),
            size: data_bytes,
            usage,
            mapped_at_creation: false,
        });
        let scales = (scale_bytes > 0).then(|| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("scales"),
                size: scale_bytes,
                usage,
                mapped_at_creation: false,
            })
        });
        self.finish(scopes)?;
        let id = self.next;
        self.next += 1;
        self.weights.insert(
            id,
            Weight {
                format,
                n_out,
                n_in,
                row_bytes,
                row_quads: row_quads as u32,
                scale_row: scale_row as u32,
                data,
                scales,
                parts: Vec::new(),
            },
        );
        Ok(id)
    }

    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.live()?;
        self.forget_joints(id);
        let w = self.weights.get(&id).ok_or_else(|| GpuError::InvalidArgument(format!("no weight {id}")))?;
        let row_bytes = w.row_bytes as usize;
        let stride = w.row_quads as usize * 16;
        let scale_stride = w.scale_row as usize * 4;
        // Checked by `GpuCtx` already; checked again so that no caller can make this panic.
        let rows = data.len() / row_bytes.max(1);
        if rows == 0
            || data.len() != rows * row_bytes
            || scales.len() != rows * w.scale_row as usize
            || first_row as u64 + rows as u64 > w.n_out as u64
        {
            return Err(GpuError::InvalidArgument(format!(
                "{} bytes and {} scales at row {first_row} are not whole rows of a [{}, {}] {} weight",
                data.len(),
                scales.len(),
                w.n_out,
                w.n_in,
                w.format.name()
            )));
        }
        if !w.parts.is_empty() {
            return self.write_parts(id, first_row, data, scales);
        }
        let scopes = push_scopes(&self.device);
        // Rows at most WRITE_CHUNK bytes at a time (at least one row).
        let rows_per_chunk = (WRITE_CHUNK / stride.max(1)).max(1);
        let mut padded = Vec::new();
        let mut r = 0;
        while r < rows {
            let n = rows_per_chunk.min(rows - r);
            let src = &data[r * row_bytes..(r + n) * row_bytes];
            let bytes = if stride == row_bytes {
                src
            } else {
                // Rows that are not whole quads (f32, bf16) are padded with zeros.
                padded.clear();
                padded.resize(n * stride, 0);
                for (dst, row) in padded.chunks_exact_mut(stride).zip(src.chunks_exact(row_bytes)) {
                    dst[..row_bytes].copy_from_slice(row);
                }
                &padded[..]
            };
            let offset = (first_row as u64 + r as u64) * stride as u64;
            self.queue.write_buffer(&w.data, offset, bytes);
            if let Some(sb) = &w.scales {
                let per_row = w.scale_row as usize;
                let s = &scales[r * per_row..(r + n) * per_row];
                self.queue.write_buffer(
                    sb,
                    (first_row as u64 + r as u64) * scale_stride as u64,
                    bytemuck::cast_slice(s),
                );
            }
            r += n;
        }
        // Flush the writes (and free wgpu's staging memory) before returning.
        self.queue.submit(std::iter::empty());
        let waited = self.poll();
        self.finish(scopes)?;
        waited
    }

    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.last_kernel_ns = None;
        self.live()?;
        if t == 0 || n_in == 0 || x.len() as u64 != t as u64 * n_in as u64 || jobs.is_empty() {
            return Err(GpuError::InvalidArgument(format!("x of {} values is not [{t}, {n_in}], or no jobs", x.len())));
        }
        // Rows of x padded with zeros to whole shader steps of 8 (only f32 and bf16 weights can
        // have such an n_in).
        let x_elems = (n_in as u64).div_ceil(8) * 8;
        let x_quads = (x_elems / 4) as u32;
        let x_bytes = t as u64 * x_elems * 4;
        let max = self.max_binding;
        if x_bytes > max {
            return Err(GpuError::OutOfMemory(format!("an input of {} values exceeds the device's limit", x.len())));
        }
        // Group the jobs so that each group's outputs fit one buffer (almost always one group).
        let storage_align = self.limits.min_storage_buffer_offset_alignment.max(4) as u64;
        let mut batches: Vec<&[BufferId]> = Vec::new();
        let mut start = 0;
        let mut bytes = 0u64;
        for (i, id) in jobs.iter().enumerate() {
            let w = self.weights.get(id).ok_or_else(|| GpuError::InvalidArgument(format!("no weight {id}")))?;
            if w.n_in != n_in {
                return Err(GpuError::InvalidArgument(format!(
                    "job {i}: the weight has {} columns, n-in is {n_in}",
                    w.n_in
                )));
            }
            let len = t as u64 * w.n_out as u64 * 4;
            if len > max {
                return Err(GpuError::OutOfMemory(format!(
                    "job {i}: an output of {len} bytes exceeds the device's limit"
                )));
            }
            let at = align_up(bytes, storage_align);
            if i > start && at + len > self.limits.max_buffer_size {
                batches.push(&jobs[start..i]);
                start = i;
                bytes = len;
            } else {
                bytes = at + len;
            }
        }
        batches.push(&jobs[start..]);

        if jobs.iter().any(|id| self.weights.get(id).is_some_and(|w| !w.parts.is_empty())) {
            return self.matmul_parts(x, t, n_in, jobs);
        }
        self.write_input(x, t, n_in, x_elems)?;
        let mut outs = Vec::with_capacity(jobs.len());
        let mut kernel_ns = Some(0);
        for batch in batches {
            outs.extend(self.run_batch(x_bytes, x_quads, t, batch)?);
            kernel_ns = kernel_ns.zip(self.last_kernel_ns).map(|(a, b)| a + b);
        }
        self.last_kernel_ns = kernel_ns;
        Ok(outs)
    }

    fn free(&mut self, id: BufferId) {
        // Dropping the buffers frees them once no submitted work uses them (and no cached
        // bind group holds them).
        if let Some(w) = self.weights.remove(&id) {
            for (part, _) in w.parts {
                self.weights.remove(&part);
            }
        }
        self.forget_joints(id);
        self.recorded.forget_groups();
    }

    fn create_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        self.create_kv_cache(slots, width)
    }

    fn free_cache(&mut self, id: BufferId) {
        self.free_kv_cache(id);
        self.recorded.forget_groups();
    }

    fn write_cache(&mut self, id: BufferId, first: u32, k: &[f32], v: &[f32]) -> Result<(), GpuError> {
        self.write_rows_of_cache(id, first, k, v)
    }

    fn attention_cached(
        &mut self,
        q: &[f32],
        k_new: &[f32],
        v_new: &[f32],
        first_new: u32,
        cache: BufferId,
        first_key: u32,
        shape: &AttentionShape,
    ) -> Result<Vec<f32>, GpuError> {
        self.run_attention_cached(q, k_new, v_new, first_new, cache, first_key, shape)
    }

    fn prepare_program(&mut self, p: &program::Program) -> Result<(), GpuError> {
        self.prepare(p)
    }

    fn run_program(
        &mut self,
        p: &program::Program,
        inputs: &[Vec<f32>],
        batch: &[program::SequenceRun],
    ) -> Option<Result<Vec<program::Output>, GpuError>> {
        self.records(p, batch).then(|| self.run_recorded(p, inputs, batch))
    }
}

/// Weights past one binding (`Weight::parts`).
impl WgpuBackend {
    /// Caps what one binding may span at `bytes` (and the weights the device takes at 64 of
    /// them): a device with a small binding, for tests. Weights made after it past the cap are
    /// held in parts.
    pub fn cap_binding(&mut self, bytes: u64) {
        self.max_binding = self.max_binding.min(bytes & !3);
        self.info.max_weight_bytes = self.max_binding.saturating_mul(MAX_WEIGHT_PARTS);
        self.info.max_activation_elements = self.max_binding / 4;
    }

    /// A weight `[n_out, n_in]` of `per_part` rows a part (the last holds the rest): one
    /// weight of each part, and the weight that names them. Nothing is left where one fails.
    fn create_parts(&mut self, format: Format, n_out: u32, n_in: u32, per_part: u32) -> Result<BufferId, GpuError> {
        let mut parts = Vec::new();
        let mut first = 0;
        while first < n_out {
            let rows = per_part.min(n_out - first);
            match self.create(format, rows, n_in) {
                Ok(id) => parts.push((id, first)),
                Err(e) => {
                    for (id, _) in parts {
                        self.weights.remove(&id);
                    }
                    return Err(e);
                }
            }
            first += rows;
        }
        let w = &self.weights[&parts[0].0];
        let whole = Weight { n_out, data: self.placeholder.clone(), scales: None, parts, ..*w };
        let id = self.next;
        self.next += 1;
        self.weights.insert(id, whole);
        Ok(id)
    }

    /// `write_rows` of a weight held in parts (whole rows within it, checked): each part's
    /// share of the rows.
    fn write_parts(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        let w = &self.weights[&id];
        let (row_bytes, scale_row) = (w.row_bytes as usize, w.scale_row as usize);
        let rows = data.len() / row_bytes.max(1);
        let end = first_row as usize + rows;
        let (parts, n_out) = (w.parts.clone(), w.n_out);
        for (i, &(part, start)) in parts.iter().enumerate() {
            let stop = parts.get(i + 1).map_or(n_out, |p| p.1) as usize;
            let (lo, hi) = ((start as usize).max(first_row as usize), stop.min(end));
            if lo >= hi {
                continue;
            }
            let (a, b) = (lo - first_row as usize, hi - first_row as usize);
            let (d, sc) = (&data[a * row_bytes..b * row_bytes], &scales[a * scale_row..b * scale_row]);
            self.write_rows(part, (lo - start as usize) as u32, d, sc)?;
        }
        Ok(())
    }

    /// `matmul` where a job is held in parts: each part's product, its columns placed in the
    /// job's output.
    fn matmul_parts(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        let mut outs = Vec::with_capacity(jobs.len());
        for id in jobs {
            let w = self.weights.get(id).ok_or_else(|| GpuError::InvalidArgument(format!("no weight {id}")))?;
            if w.parts.is_empty() {
                outs.extend(self.matmul(x, t, n_in, &[*id])?);
                continue;
            }
            let (n_out, parts) = (w.n_out as usize, w.parts.clone());
            let ids: Vec<BufferId> = parts.iter().map(|p| p.0).collect();
            let got = self.matmul(x, t, n_in, &ids)?;
            let mut y = vec![0f32; t as usize * n_out];
            for (&(_, first), part) in parts.iter().zip(&got) {
                let rows = part.len() / t as usize;
                for (r, row) in part.chunks_exact(rows).enumerate() {
                    y[r * n_out + first as usize..][..rows].copy_from_slice(row);
                }
            }
            outs.push(y);
        }
        Ok(outs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backend on the preferred adapter; `None` (a skip) without one, except under `CI=true`.
    fn backend(test: &str) -> Option<WgpuBackend> {
        match WgpuBackend::new() {
            Ok(Some(b)) => {
                println!("{test}: adapter {}", b.describe());
                Some(b)
            }
            Ok(None) if std::env::var("CI").is_ok_and(|v| v == "true") => {
                panic!("{test}: no wgpu adapter, and CI=true")
            }
            Ok(None) => {
                println!("{test}: skipped: no wgpu adapter (install mesa-vulkan-drivers for lavapipe)");
                None
            }
            Err(e) => panic!("{test}: opening the adapter failed: {e:#}"),
        }
    }

    /// Where the adapter offers timestamp queries and a benchmark asks, a product reports the
    /// device time of its kernels: more than nothing, less than the whole call; a failed call
    /// reports none, and neither does a call by default (untimed).
    #[test]
    fn kernel_time_is_measured_where_the_device_can_tell() {
        let Some(mut b) = backend("kernel_time_is_measured_where_the_device_can_tell") else { return };
        let (n_out, n_in, t) = (256u32, 512u32, 8u32);
        let id = b.create(Format::F32, n_out, n_in).unwrap();
        let data: Vec<u8> = (0..n_out * n_in).flat_map(|i| ((i % 7) as f32 * 0.1).to_le_bytes()).collect();
        b.write_rows(id, 0, &data, &[]).unwrap();
        let x = vec![0.5f32; (t * n_in) as usize];
        b.matmul(&x, t, n_in, &[id]).unwrap();
        assert_eq!(b.last_kernel_ns(), None, "a call is untimed by default");
        b.set_kernel_repeats(1);
        let start = std::time::Instant::now();
        b.matmul(&x, t, n_in, &[id]).unwrap();
        let wall = start.elapsed().as_nanos() as u64;
        match (b.timer.is_some(), b.last_kernel_ns()) {
            (true, Some(ns)) => assert!(ns > 0 && ns <= wall, "kernel {ns} ns, whole call {wall} ns"),
            (false, None) => println!("the adapter offers no timestamp queries"),
            (offered, got) => panic!("timestamp queries offered: {offered}, kernel time: {got:?}"),
        }
        assert!(b.matmul(&x, t, n_in + 32, &[id]).is_err());
        assert_eq!(b.last_kernel_ns(), None);
    }

    /// Kernel repeats (benchmarks) run the same dispatches again into the same outputs: the
    /// results do not change, and the time is of one run.
    #[test]
    fn kernel_repeats_leave_the_outputs_alone() {
        let Some(mut b) = backend("kernel_repeats_leave_the_outputs_alone") else { return };
        let (n_out, n_in, t) = (300u32, 256u32, 5u32);
        let id = b.create(Format::Q8x32, n_out, n_in).unwrap();
        let data: Vec<u8> = (0..n_out * n_in).map(|i| (i * 37 % 251) as u8).collect();
        let scales: Vec<f32> = (0..n_out * n_in / 32).map(|i| 0.01 + (i % 5) as f32 * 0.001).collect();
        b.write_rows(id, 0, &data, &scales).unwrap();
        let x: Vec<f32> = (0..t * n_in).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
        let once = b.matmul(&x, t, n_in, &[id]).unwrap();
        b.set_kernel_repeats(4);
        let again = b.matmul(&x, t, n_in, &[id]).unwrap();
        assert_eq!(once, again);
        assert_eq!(b.last_kernel_ns().is_some(), b.timer.is_some());
        b.set_kernel_repeats(1);
        assert_eq!(b.matmul(&x, t, n_in, &[id]).unwrap(), once);
        assert_eq!(b.last_kernel_ns().is_some(), b.timer.is_some());
        b.set_kernel_repeats(0);
        assert_eq!(b.matmul(&x, t, n_in, &[id]).unwrap(), once);
        assert_eq!(b.last_kernel_ns(), None);
    }

    /// An attention whose queries exceed a dispatch's budget runs as several dispatches (each
    /// its own `query_base`), with the same outputs as one.
    #[test]
    fn attention_split_over_dispatches_equals_one() {
        let Some(mut b) = backend("attention_split_over_dispatches_equals_one") else { return };
        let s = AttentionShape { t: 9, n_keys: 80, n_head: 4, n_head_kv: 2, head_dim: 40, window: 30, scale: 0.3, softcap: 0.0 };
        let (q_len, k_len) = s.lens().unwrap();
        let wave = |n: u64, f: f32| (0..n).map(|i| (i as f32 * f).sin()).collect::<Vec<f32>>();
        let (q, k, v) = (wave(q_len, 0.37), wave(k_len, 0.11), wave(k_len, 0.23));
        let cache = b.create_cache(s.n_keys, s.n_head_kv * s.head_dim).unwrap();
        b.write_cache(cache, 0, &k, &v).unwrap();
        let whole = b.attention_cached(&q, &[], &[], 0, cache, 0, &s).unwrap();
        // Two queries a dispatch: five dispatches.
        b.dispatch_macs = 2 * 2 * s.n_head as u64 * s.n_keys as u64 * s.head_dim as u64;
        let split = b.attention_cached(&q, &[], &[], 0, cache, 0, &s).unwrap();
        assert_eq!(whole, split);
        let want = super::super::cpu::attention_reference(&q, &k, &v, &s);
        assert!(whole.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-4), "{whole:?} vs {want:?}");
    }

    /// Joint weights (programs' products of one input) are made once per set of weights, are
    /// forgotten when one of them is written or freed, and together never take more device
    /// memory than the weights they are made of.
    #[test]
    fn joint_weights_stay_within_the_weights_they_copy() {
        let Some(mut b) = backend("joint_weights_stay_within_the_weights_they_copy") else { return };
        let ids: Vec<BufferId> = (0..3).map(|_| b.create(Format::Q8x32, 40, 64).unwrap()).collect();
        let (joint, firsts) = b.joint(&ids[..2]).expect("a joint of two");
        let align = b.x_align();
        assert_eq!(firsts, vec![0, 40u32.div_ceil(align) * align]);
        assert_eq!(b.joint(&ids[..2]).map(|j| j.0), Some(joint), "made once");
        // Another joint of two would take more than the three weights hold together.
        assert!(b.joint(&ids[1..]).is_none());
        // Writing a weight forgets the joints made from it, and so makes room.
        let row = vec![0u8; Format::Q8x32.data_bytes(64).unwrap() as usize];
        b.write_rows(ids[0], 0, &row, &[1.0; 2]).unwrap();
        assert!(!b.weights.contains_key(&joint) && b.joints.is_empty());
        assert!(b.joint(&ids[1..]).is_some());
        b.free(ids[2]);
        assert!(b.joints.is_empty());
    }

    /// Cooperative matrices (f16 inputs) serve `fast` products of at least WIDE_MIN_T rows
    /// where the adapter offers them, and never an `exact` one.
    #[test]
    fn only_fast_products_run_on_cooperative_matrices() {
        let Some(mut b) = backend("only_fast_products_run_on_cooperative_matrices") else { return };
        b.set_gemm(Gemm::GPU).unwrap();
        // Plans only: as offered here, then as if cooperative matrices were offered.
        for coop in [b.coop, true] {
            b.coop = coop;
            for t in [1, GEMM_MIN_T, WIDE_MIN_T, 4096] {
                for format in Format::ALL {
                    assert!(b.kernel_for(t, 4096, format, Precision::Exact).0 != Kernel::GemmCoop, "exact, t = {t}");
                    let fast = b.kernel_for(t, 4096, format, Precision::Fast).0;
                    assert_eq!(fast == Kernel::GemmCoop, coop && t >= WIDE_MIN_T, "fast, t = {t}, coop {coop}");
                }
            }
        }
    }

    /// RELIABILITY 23: every product is split into dispatches of at most the device's budget
    /// multiply-adds (or one workgroup, when a single one is larger), within the device's
    /// workgroup counts, that together cover every (row, t) tile of the output exactly once;
    /// split over k (`blocks`), only `gemm_wide` and `gemm_coop`, in at most MAX_SPLITS runs.
    #[test]
    fn no_dispatch_runs_longer_than_its_budget() {
        let Some(mut b) = backend("no_dispatch_runs_longer_than_its_budget") else { return };
        let max_dim = b.limits.max_compute_workgroups_per_dimension as u64;
        // Plans only, nothing is dispatched: as if the adapter offered `gemm_large`'s workgroup
        // memory, so that its plans are checked everywhere.
        let wg_bytes = &mut b.limits.max_compute_workgroup_storage_size;
        *wg_bytes = (*wg_bytes).max(LARGE_WORKGROUP_BYTES);
        let gemms =
            [(1, Gemm::CPU), (32, Gemm::CPU), (1, Gemm::GPU), (32, Gemm::Tiled), (4, Gemm::Wide), (8, Gemm::Large)];
        for (lanes, gemm) in gemms {
            b.set_gemv_lanes(lanes).unwrap();
            b.set_gemm(gemm).unwrap();
            for (format, n_out, n_in, t, min_dispatches) in [
                (Format::Q4x32, 262_144, 640, 1, 1),
                (Format::Q4x32, 262_144, 640, 64, 40),
                (Format::Q8x32, 4173, 16_384, 5, 2),
                (Format::Q8x32, 2048, 2048, 512, 8),
                (Format::F32, 700, 2048, 301, 2),
                (Format::F32, 3, 8, 2, 1),
                (Format::Q8x16, 1, 1 << 20, 64, 1),
                // 32 x 16 = 512 tiles of `gemm_large`: what Gemm::GPU runs it on.
                (Format::Q4x32, 4096, 4096, 4096, 1),
            ] {
                for split in [false, true] {
                    let what = format!("{} [{n_out}, {n_in}] t={t} lanes={lanes} {gemm:?} split {split}", format.name());
                    let id = b.create(format, n_out, n_in).unwrap();
                    let mut plan = Vec::new();
                    let w = &b.weights[&id];
                    let planes = b.plan(0, w, t, n_in.div_ceil(8) * 2, Precision::Exact, split, &mut plan);
                    let z = if split { b.k_splits(w, t, Precision::Exact) } else { 1 };
                    let kernel = b.kernel_for(t, n_out, format, Precision::Exact).0;
                    assert_eq!(planes, z, "{what}: planes");
                    let splittable = matches!(kernel, Kernel::GemmWide | Kernel::GemmCoop);
                    assert!(z as u64 <= MAX_SPLITS && (z == 1 || splittable), "{what}: {z} runs of k");
                    let large_groups = n_out.div_ceil(WIDE_TILE) as u64 * t.div_ceil(LARGE_T) as u64;
                    let few_tiles = (n_out as u64).div_ceil(TILE as u64) < GEMV_BELOW_TILES;
                    let gemv = t < GEMM_MIN_T || (gemm == Gemm::BySize && t <= TILE && few_tiles);
                    let (rows_per_group, t_per_group) = match (gemv, gemm) {
                        (true, _) => (gemv_rows(format) * WORKGROUP / lanes, 1),
                        (false, Gemm::BySize) if t >= WIDE_MIN_T && large_groups >= LARGE_MIN_GROUPS => {
                            (WIDE_TILE, LARGE_T)
                        }
                        (false, Gemm::Large) => (WIDE_TILE, LARGE_T),
                        (false, Gemm::BySize) if t >= WIDE_MIN_T => (WIDE_TILE, WIDE_TILE),
                        (false, Gemm::Tiled | Gemm::BySize) => (TILE, TILE),
                        (false, Gemm::Wide | Gemm::Coop) => (WIDE_TILE, WIDE_TILE),
                        (false, Gemm::Blocked) => (GEMM_ROWS * WORKGROUP, 4),
                    };
                    assert!(plan.iter().all(|d| d.kernel == kernel), "{what}: one kernel a job");
                    let macs_per_group = rows_per_group as u64 * t_per_group as u64 * (n_in as u64).div_ceil(z as u64);
                    let (gx, gy) =
                        ((n_out as u64).div_ceil(rows_per_group as u64), (t as u64).div_ceil(t_per_group as u64));
                    let mut covered = vec![0u8; (gx * gy) as usize];
                    for d in &plan {
                        let (nx, ny) = (d.groups.0 as u64, d.groups.1 as u64);
                        assert!(nx >= 1 && ny >= 1 && nx <= max_dim && ny <= max_dim, "{what}: groups {:?}", d.groups);
                        assert_eq!(d.groups.2, z, "{what}: workgroups in z");
                        let macs = nx * ny * z as u64 * macs_per_group;
                        assert!(
                            macs <= b.dispatch_macs.max(z as u64 * macs_per_group),
                            "{what}: a dispatch of {macs} multiply-adds"
                        );
                        let (x0, y0) = (d.params.row_base / rows_per_group, d.params.t_base / t_per_group);
                        for x in x0 as u64..x0 as u64 + nx {
                            for y in y0 as u64..y0 as u64 + ny {
                                covered[(y * gx + x) as usize] += 1;
                            }
                        }
                    }
                    assert!(covered.iter().all(|&c| c == 1), "{what}: tiles not covered exactly once");
                    assert!(plan.len() >= min_dispatches, "{what}: {} dispatches", plan.len());
                    b.free(id);
                }
            }
        }
    }

    /// RELIABILITY 19: wgpu's default uncaptured-error handler panics; the backend's turns an
    /// error outside any scope into the next call's `unavailable`, and the backend keeps working.
    #[test]
    fn an_uncaptured_wgpu_error_is_an_error_not_a_panic() {
        let Some(mut b) = backend("an_uncaptured_wgpu_error_is_an_error_not_a_panic") else { return };
        // A buffer past the device's limit, created outside any error scope: a validation error.
        let _ = b.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("too large"),
            size: b.limits.max_buffer_size.saturating_add(1 << 20),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        match b.finish(push_scopes(&b.device)) {
            Err(GpuError::Unavailable(m)) => assert!(m.contains("the device refused the work"), "{m}"),
            other => panic!("want unavailable, got {other:?}"),
        }
        // Reported once; then the backend works.
        let id = b.create(Format::F32, 2, 8).unwrap();
        b.write_rows(id, 0, bytemuck::cast_slice(&[1f32; 16]), &[]).unwrap();
        assert_eq!(b.matmul(&[1.0; 8], 1, 8, &[id]).unwrap(), vec![vec![8.0, 8.0]]);
    }
}
