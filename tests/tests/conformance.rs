//! The conformance kit (`tests/conformance`) against each host: it passes on the CPU reference
//! backend and on wgpu, reports its device cases as skipped without a device, and fails, naming
//! the case and the call, on hosts that are broken on purpose: one that decodes a format wrongly,
//! one whose products ignore their inputs, one whose attention ignores the window, one whose
//! cache writes land a row off, and one that accepts calls it must refuse.

use std::collections::{HashMap, HashSet};
use wasmtime::component::{HasSelf, Resource};
use wisp::conformance::{self, CaseResult, KitState};
use wisp::gpu::{KvCacheHandle, ProgramHandle, WeightHandle, program};
use wisp::{Activation, AttentionShape, Backend, Budget, BufferId, CpuBackend, Device, Format, GpuCtx, GpuError, Precision, Rotation};
use wisp_tests::wgpu_backend;

/// The seed of a run: `WISP_TEST_SEED`, else fresh, printed either way.
fn seed() -> u64 {
    let seed = std::env::var("WISP_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    eprintln!("seed {seed} (WISP_TEST_SEED={seed} repeats this run)");
    seed
}

fn table(results: &[CaseResult]) -> String {
    results
        .iter()
        .map(|r| {
            let verdict = if r.passed {
                "pass"
            } else if r.skipped {
                "skip"
            } else {
                "FAIL"
            };
            format!("{:<28} {verdict} {:>9.2e} {:>9} us  {}", r.name, r.max_error, r.micros, r.message)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn failed(results: &[CaseResult]) -> Vec<&str> {
    results.iter().filter(|r| r.failed()).map(|r| r.name.as_str()).collect()
}

fn case<'a>(results: &'a [CaseResult], name: &str) -> &'a CaseResult {
    results.iter().find(|r| r.name == name).unwrap_or_else(|| panic!("no case {name}:\n{}", table(results)))
}

#[track_caller]
fn assert_all_pass(results: &[CaseResult]) {
    eprintln!("{}", table(results));
    assert!(results.len() > 25, "only {} cases ran", results.len());
    assert!(failed(results).is_empty(), "failed: {:?}\n{}", failed(results), table(results));
    let skipped: Vec<_> = results.iter().filter(|r| r.skipped).map(|r| &r.name).collect();
    assert!(skipped.is_empty(), "skipped with a device: {skipped:?}\n{}", table(results));
}

#[test]
fn the_kit_passes_on_the_cpu_reference_backend() {
    let results = conformance::run(GpuCtx::new(Box::new(CpuBackend::new()), conformance::budget()), seed()).unwrap();
    assert_all_pass(&results);
}

#[test]
fn the_kit_passes_on_wgpu() {
    let Some(backend) = wgpu_backend() else { return };
    let results = conformance::run(GpuCtx::new(Box::new(backend), conformance::budget()), seed()).unwrap();
    eprintln!("on {}", case(&results, "device-info").message);
    assert_all_pass(&results);
}

#[test]
fn without_a_device_the_device_cases_are_skipped_not_passed() {
    let results = conformance::run(GpuCtx::none(), seed()).unwrap();
    eprintln!("{}", table(&results));
    assert!(failed(&results).is_empty(), "{}", table(&results));
    assert!(case(&results, "no-device").passed);
    let m = case(&results, "matmul-q4x32");
    assert!(m.skipped && !m.passed && m.message.contains("no device"), "{m:?}");
    assert!(results.iter().filter(|r| r.skipped).count() > 20);
}

#[test]
fn a_byte_budget_too_large_to_fill_is_a_skip() {
    let results = conformance::run(GpuCtx::new(Box::new(CpuBackend::new()), Budget::default()), seed()).unwrap();
    let b = case(&results, "budget-bytes");
    assert!(b.skipped && b.message.contains("smaller budget"), "{b:?}");
    assert!(failed(&results).is_empty(), "{}", table(&results));
}

/// A backend that reads q4x32 nibbles the wrong way round (high nibble first).
struct SwappedNibbles {
    inner: CpuBackend,
    q4: HashSet<BufferId>,
}

impl Backend for SwappedNibbles {
    fn device(&self) -> Option<Device> {
        self.inner.device()
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        let id = self.inner.create(f, n_out, n_in)?;
        if f == Format::Q4x32 {
            self.q4.insert(id);
        }
        Ok(id)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        if self.q4.contains(&id) {
            let swapped: Vec<u8> = data.iter().map(|b| b.rotate_left(4)).collect();
            return self.inner.write_rows(id, first_row, &swapped, scales);
        }
        self.inner.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.inner.matmul(x, t, n_in, jobs)
    }
    fn free(&mut self, id: BufferId) {
        self.q4.remove(&id);
        self.inner.free(id)
    }
}

#[test]
fn a_host_that_decodes_one_format_wrongly_fails_that_formats_cases() {
    let broken = SwappedNibbles { inner: CpuBackend::new(), q4: HashSet::new() };
    let results = conformance::run(GpuCtx::new(Box::new(broken), conformance::budget()), seed()).unwrap();
    eprintln!("{}", table(&results));
    let q4 = case(&results, "matmul-q4x32");
    assert!(q4.failed(), "{q4:?}");
    assert!(q4.message.contains("q4x32 [") && q4.message.contains("where the reference is"), "{}", q4.message);
    for name in ["matmul-f32", "matmul-bf16", "matmul-q8x32", "matmul-q8x16", "hostile-upload-lengths"] {
        assert!(case(&results, name).passed, "{name} should pass:\n{}", table(&results));
    }
    assert!(failed(&results).contains(&"matmul-batch"), "the batch holds a q4x32 product");
    // It keeps the trait's default kv-caches, `unavailable`: allowed, so a skip.
    for name in ["hostile-kv-cache", "program-attention", "program-decoder", "hostile-program-runs"] {
        let a = case(&results, name);
        assert!(a.skipped && a.message.contains("does not offer kv-caches"), "{a:?}");
    }
}

/// A backend right in all but one thing: its attention ignores the window (every query sees
/// every key of the call, from the first its sequence's first row sees).
struct IgnoresWindow {
    inner: CpuBackend,
}

impl Backend for IgnoresWindow {
    fn device(&self) -> Option<Device> {
        self.inner.device()
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        self.inner.create(f, n_out, n_in)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.inner.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.inner.matmul(x, t, n_in, jobs)
    }
    fn free(&mut self, id: BufferId) {
        self.inner.free(id)
    }
    fn create_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        self.inner.create_cache(slots, width)
    }
    fn free_cache(&mut self, id: BufferId) {
        self.inner.free_cache(id)
    }
    fn write_cache(&mut self, id: BufferId, first: u32, k: &[f32], v: &[f32]) -> Result<(), GpuError> {
        self.inner.write_cache(id, first, k, v)
    }
    #[allow(clippy::too_many_arguments)]
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
        self.inner.attention_cached(q, k_new, v_new, first_new, cache, first_key, &AttentionShape { window: 0, ..*shape })
    }
}

#[test]
fn a_host_whose_attention_ignores_the_window_fails_the_program_cases_with_windows() {
    let broken = IgnoresWindow { inner: CpuBackend::new() };
    let results = conformance::run(GpuCtx::new(Box::new(broken), conformance::budget()), seed()).unwrap();
    eprintln!("{}", table(&results));
    // The decoder's first run holds a sequence of 7 rows under a window of 5: always caught.
    // program-attention draws its windows and batches, and fails where one matters.
    let f = failed(&results);
    assert!(f.contains(&"program-decoder"), "{}", table(&results));
    assert!(f.iter().all(|n| ["program-decoder", "program-attention"].contains(n)), "{f:?}\n{}", table(&results));
    let d = case(&results, "program-decoder");
    assert!(d.message.contains("where the reference is"), "{}", d.message);
    for name in ["program-ops", "hostile-program-runs", "hostile-kv-cache"] {
        assert!(case(&results, name).passed, "{name} should pass:\n{}", table(&results));
    }
}

/// A backend right in all but one thing: its cache writes land one position later than asked.
struct ShiftedCacheWrites {
    inner: CpuBackend,
}

impl Backend for ShiftedCacheWrites {
    fn device(&self) -> Option<Device> {
        self.inner.device()
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        self.inner.create(f, n_out, n_in)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.inner.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.inner.matmul(x, t, n_in, jobs)
    }
    fn free(&mut self, id: BufferId) {
        self.inner.free(id)
    }
    fn create_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        self.inner.create_cache(slots, width)
    }
    fn free_cache(&mut self, id: BufferId) {
        self.inner.free_cache(id)
    }
    fn write_cache(&mut self, id: BufferId, first: u32, k: &[f32], v: &[f32]) -> Result<(), GpuError> {
        self.inner.write_cache(id, first + 1, k, v)
    }
    #[allow(clippy::too_many_arguments)]
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
        self.inner.attention_cached(q, k_new, v_new, first_new, cache, first_key, shape)
    }
}

#[test]
fn a_host_whose_program_cache_writes_are_one_row_off_fails_the_program_cases_that_attend() {
    let broken = ShiftedCacheWrites { inner: CpuBackend::new() };
    let results = conformance::run(GpuCtx::new(Box::new(broken), conformance::budget()), seed()).unwrap();
    eprintln!("{}", table(&results));
    let f = failed(&results);
    for name in ["program-attention", "program-decoder", "hostile-program-runs"] {
        assert!(f.contains(&name), "{name} should fail:\n{}", table(&results));
    }
    let a = case(&results, "program-attention");
    assert!(a.message.contains("where the reference is"), "{}", a.message);
    for name in ["program-ops", "program-top-k", "hostile-programs", "hostile-kv-cache"] {
        assert!(case(&results, name).passed, "{name} should pass:\n{}", table(&results));
    }
}

/// A backend whose matmul ignores its inputs: zeros of the right shape. (`program::run`, which
/// interprets the kit's programs on the CPU backend, computes each product with it.)
struct IgnoresInputs {
    inner: CpuBackend,
    rows: HashMap<BufferId, u32>,
}

impl Backend for IgnoresInputs {
    fn device(&self) -> Option<Device> {
        self.inner.device()
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        let id = self.inner.create(f, n_out, n_in)?;
        self.rows.insert(id, n_out);
        Ok(id)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.inner.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, _: &[f32], t: u32, _: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        Ok(jobs.iter().map(|id| vec![0.0; t as usize * self.rows.get(id).copied().unwrap_or(0) as usize]).collect())
    }
    fn free(&mut self, id: BufferId) {
        self.rows.remove(&id);
        self.inner.free(id)
    }
}

#[test]
fn a_host_whose_products_ignore_their_inputs_fails_every_product_case() {
    let broken = IgnoresInputs { inner: CpuBackend::new(), rows: HashMap::new() };
    let results = conformance::run(GpuCtx::new(Box::new(broken), conformance::budget()), seed()).unwrap();
    eprintln!("{}", table(&results));
    let f = failed(&results);
    for name in [
        "matmul-f32",
        "matmul-bf16",
        "matmul-q8x32",
        "matmul-q8x16",
        "matmul-q4x32",
        "matmul-batch",
        "write-rows-chunked",
        "nan-inf-input",
        "nan-inf-weights",
    ] {
        assert!(f.contains(&name), "{name} should fail:\n{}", table(&results));
    }
    let m = case(&results, "matmul-f32");
    assert!(m.message.starts_with("f32 [") && m.message.contains("is 0e0 where the reference is"), "{}", m.message);
    // What the backend cannot get wrong, GpuCtx checks: the refusals still pass.
    for name in ["hostile-upload-lengths", "hostile-x-length", "limit-weight-bytes", "weight-accessors"] {
        assert!(case(&results, name).passed, "{name} should pass:\n{}", table(&results));
    }
}

/// The `gpu` interface generated here, for a host that is not wisp's `GpuCtx`.
mod other_host {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "conformance",
        with: {
            "wisp:llm/gpu.weight": ::wisp::gpu::WeightHandle,
            "wisp:llm/gpu.kv-cache": ::wisp::gpu::KvCacheHandle,
            "wisp:llm/gpu.program": ::wisp::gpu::ProgramHandle,
        },
    });
}

use other_host::wisp::llm::gpu as wit;

/// A host that fits what it gets to what it expects instead of refusing it: `data`, `scales`
/// and a run's inputs padded or cut to the shape's length, a kv-cache of no size made of one, a
/// program that returns nothing made to return its last value. Device work goes to a `GpuCtx`
/// over the CPU backend.
struct Lenient {
    inner: GpuCtx,
    budget: Budget,
    shapes: HashMap<u32, (wit::WeightFormat, u32, u32)>,
    /// Each live kv-cache's slots and width.
    caches: HashMap<u32, (u32, u32)>,
    /// Each live program's input widths and ops.
    programs: HashMap<u32, (Vec<u32>, u32)>,
}

fn format(f: wit::WeightFormat) -> Format {
    match f {
        wit::WeightFormat::F32 => Format::F32,
        wit::WeightFormat::Bf16 => Format::Bf16,
        wit::WeightFormat::Q8x32 => Format::Q8x32,
        wit::WeightFormat::Q8x16 => Format::Q8x16,
        wit::WeightFormat::Q4x32 => Format::Q4x32,
    }
}

fn error(e: GpuError) -> wit::Error {
    match e {
        GpuError::Unavailable(m) => wit::Error::Unavailable(m),
        GpuError::InvalidArgument(m) => wit::Error::InvalidArgument(m),
        GpuError::OutOfMemory(m) => wit::Error::OutOfMemory(m),
        GpuError::DeviceLost(m) => wit::Error::DeviceLost(m),
    }
}

fn precision(p: wit::Precision) -> Precision {
    match p {
        wit::Precision::Exact => Precision::Exact,
        wit::Precision::Fast => Precision::Fast,
    }
}

/// The WIT `op` as `GpuCtx` takes it.
fn op(o: wit::Op) -> program::Op {
    use program::Op;
    let ix = |v: u32| v as usize;
    match o {
        wit::Op::Input(width) => Op::Input { width },
        wit::Op::Matmul(m) => Op::Matmul { x: ix(m.x), weight: ix(m.weight), precision: precision(m.precision) },
        wit::Op::RmsNorm(n) => Op::RmsNorm { x: ix(n.x), weight: n.weight.map(ix), offset: n.offset, group: n.group, eps: n.eps },
        wit::Op::Add((a, b)) => Op::Add(ix(a), ix(b)),
        wit::Op::Mul((a, b)) => Op::Mul(ix(a), ix(b)),
        wit::Op::Bias(b) => Op::Bias { x: ix(b.x), weight: ix(b.weight) },
        wit::Op::Scale(s) => Op::Scale { x: ix(s.x), by: s.by },
        wit::Op::Softcap(s) => Op::Softcap { x: ix(s.x), cap: s.cap },
        wit::Op::Gated(g) => {
            let act = match g.act {
                wit::Activation::GeluTanh => Activation::GeluTanh,
                wit::Activation::Silu => Activation::Silu,
            };
            Op::Gated { gate: ix(g.gate), up: ix(g.up), act }
        }
        wit::Op::Rotate(r) => {
            let rotation = match r.rotation {
                wit::Rotation::Halves => Rotation::Halves,
                wit::Rotation::Pairs => Rotation::Pairs,
            };
            Op::Rotate { x: ix(r.x), table: ix(r.table), head_dim: r.head_dim, rotation }
        }
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
            precision: precision(a.precision),
        },
        wit::Op::LastRows(x) => Op::LastRows(ix(x)),
        wit::Op::Output(x) => Op::Output(ix(x)),
        wit::Op::TopK(t) => Op::TopK { x: ix(t.x), k: t.k },
    }
}

/// Lengths the lenient host pads or cuts to (larger ones it passes on as they are).
const FIT_LIMIT: u64 = 1 << 24;

impl wit::Host for Lenient {
    fn available(&mut self) -> Option<wit::DeviceInfo> {
        let d = self.inner.device()?;
        let (bytes, handles) = self.inner.usage();
        Some(wit::DeviceInfo {
            name: format!("lenient {}", d.name),
            backend: d.backend.clone(),
            device_type: d.device_type.clone(),
            max_weight_bytes: d.max_weight_bytes,
            max_activation_elements: d.max_activation_elements,
            budget_bytes: self.budget.bytes - bytes,
            budget_handles: self.budget.handles - handles,
        })
    }

    fn upload(
        &mut self,
        f: wit::WeightFormat,
        n_out: u32,
        n_in: u32,
        mut data: Vec<u8>,
        mut scales: Vec<f32>,
    ) -> Result<Resource<WeightHandle>, wit::Error> {
        let n = n_out as u64 * n_in as u64;
        if let Some(want) = format(f).data_bytes(n).filter(|&w| w <= FIT_LIMIT && n.is_multiple_of(format(f).block())) {
            data.resize(want as usize, 0);
            scales.resize(format(f).scale_count(n) as usize, 0.0);
        }
        let w = self.inner.upload(format(f), n_out, n_in, &data, &scales).map_err(error)?;
        self.shapes.insert(w.rep(), (f, n_out, n_in));
        Ok(w)
    }

    fn allocate(&mut self, f: wit::WeightFormat, n_out: u32, n_in: u32) -> Result<Resource<WeightHandle>, wit::Error> {
        let w = self.inner.allocate(format(f), n_out, n_in).map_err(error)?;
        self.shapes.insert(w.rep(), (f, n_out, n_in));
        Ok(w)
    }

    fn create_kv_cache(&mut self, slots: u32, width: u32) -> Result<Resource<KvCacheHandle>, wit::Error> {
        let (slots, width) = (slots.max(1), width.max(1));
        let c = self.inner.create_kv_cache(slots, width).map_err(error)?;
        self.caches.insert(c.rep(), (slots, width));
        Ok(c)
    }

    fn create_program(
        &mut self,
        weights: Vec<Resource<WeightHandle>>,
        caches: u32,
        mut ops: Vec<wit::Op>,
    ) -> Result<Resource<ProgramHandle>, wit::Error> {
        if !ops.is_empty() && !ops.iter().any(|o| matches!(o, wit::Op::Output(_) | wit::Op::TopK(_))) {
            ops.push(wit::Op::Output(ops.len() as u32 - 1));
        }
        let inputs = ops.iter().filter_map(|o| if let wit::Op::Input(w) = o { Some(*w) } else { None }).collect();
        let n = ops.len() as u32;
        let p = self.inner.create_program(&weights, caches, ops.into_iter().map(op).collect()).map_err(error)?;
        self.programs.insert(p.rep(), (inputs, n));
        Ok(p)
    }
}

impl wit::HostProgram for Lenient {
    fn run(&mut self, p: Resource<ProgramHandle>, mut inputs: Vec<Vec<f32>>, batch: Vec<wit::Sequence>) -> Result<Vec<wit::Output>, wit::Error> {
        let rows: u64 = batch.iter().map(|s| s.rows as u64).sum();
        if let Some((widths, _)) = self.programs.get(&p.rep()) {
            for (x, &w) in inputs.iter_mut().zip(widths) {
                let want = rows * w as u64;
                if want <= FIT_LIMIT {
                    x.resize(want as usize, 0.0);
                }
            }
        }
        let batch: Vec<_> = batch.iter().map(|s| (s.rows, s.start, &s.caches[..])).collect();
        let outputs = self.inner.run_program(&p, inputs, &batch).map_err(error)?;
        Ok(outputs
            .into_iter()
            .map(|o| match o {
                program::Output::Rows(v) => wit::Output::Rows(v),
                program::Output::Top { values, indices } => wit::Output::Top(wit::TopRows { values, indices }),
            })
            .collect())
    }
    fn ops(&mut self, p: Resource<ProgramHandle>) -> u32 {
        self.programs.get(&p.rep()).map_or(0, |s| s.1)
    }
    fn drop(&mut self, p: Resource<ProgramHandle>) -> wasmtime::Result<()> {
        self.programs.remove(&p.rep());
        self.inner.release_program(p);
        Ok(())
    }
}

impl wit::HostKvCache for Lenient {
    fn slots(&mut self, c: Resource<KvCacheHandle>) -> u32 {
        self.caches.get(&c.rep()).map_or(0, |s| s.0)
    }
    fn width(&mut self, c: Resource<KvCacheHandle>) -> u32 {
        self.caches.get(&c.rep()).map_or(0, |s| s.1)
    }
    fn drop(&mut self, c: Resource<KvCacheHandle>) -> wasmtime::Result<()> {
        self.caches.remove(&c.rep());
        self.inner.release_cache(c);
        Ok(())
    }
}

impl wit::HostWeight for Lenient {
    fn write_rows(
        &mut self,
        w: Resource<WeightHandle>,
        first_row: u32,
        data: Vec<u8>,
        scales: Vec<f32>,
    ) -> Result<(), wit::Error> {
        self.inner.write_rows(&w, first_row, &data, &scales).map_err(error)
    }
    fn rows(&mut self, w: Resource<WeightHandle>) -> u32 {
        self.shapes.get(&w.rep()).map_or(0, |s| s.1)
    }
    fn cols(&mut self, w: Resource<WeightHandle>) -> u32 {
        self.shapes.get(&w.rep()).map_or(0, |s| s.2)
    }
    fn format(&mut self, w: Resource<WeightHandle>) -> wit::WeightFormat {
        self.shapes.get(&w.rep()).map_or(wit::WeightFormat::F32, |s| s.0)
    }
    fn drop(&mut self, w: Resource<WeightHandle>) -> wasmtime::Result<()> {
        self.shapes.remove(&w.rep());
        self.inner.release(w);
        Ok(())
    }
}

#[test]
fn a_host_that_accepts_what_it_must_refuse_fails_the_hostile_cases() {
    let budget = conformance::budget();
    let inner = GpuCtx::new(Box::new(CpuBackend::new()), budget);
    let host = Lenient { inner, budget, shapes: HashMap::new(), caches: HashMap::new(), programs: HashMap::new() };
    let link = |l: &mut wasmtime::component::Linker<KitState<Lenient>>| {
        wit::add_to_linker::<_, HasSelf<Lenient>>(l, |s: &mut KitState<Lenient>| &mut s.gpu)?;
        Ok(())
    };
    let (results, host) = conformance::run_with(host, link, seed()).unwrap();
    eprintln!("{}", table(&results));
    assert!(case(&results, "device-info").message.starts_with("lenient "));
    let f = failed(&results);
    for name in ["hostile-upload-lengths", "hostile-x-length", "hostile-no-outputs", "hostile-kv-cache", "hostile-programs", "hostile-program-runs"] {
        assert!(f.contains(&name), "{name} should fail:\n{}", table(&results));
    }
    let u = case(&results, "hostile-upload-lengths");
    assert!(u.message.contains("was accepted; want invalid-argument"), "{}", u.message);
    let x = case(&results, "hostile-x-length");
    assert!(x.message.starts_with("a run of a product of n-in 32 over 3 rows with 95 values of x was accepted"), "{}", x.message);
    let o = case(&results, "hostile-no-outputs");
    assert!(o.message.starts_with("create-program of an input alone was accepted"), "{}", o.message);
    let k = case(&results, "hostile-kv-cache");
    assert!(k.message.starts_with("create-kv-cache of 0 slots of 6 was accepted"), "{}", k.message);
    // Its products and programs are right: only the refusals fail.
    for name in ["matmul-f32", "matmul-q4x32", "matmul-batch", "handle-lifetimes", "hostile-write-rows", "program-ops", "program-attention", "program-decoder"] {
        assert!(case(&results, name).passed, "{name} should pass:\n{}", table(&results));
    }
    assert_eq!(host.inner.usage(), (0, 0), "the kit dropped every weight, cache and program it was given");
}
