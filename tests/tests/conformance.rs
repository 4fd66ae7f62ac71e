//! The conformance kit (`tests/conformance`) against each host: it passes on the CPU reference
//! backend and on wgpu, reports its device cases as skipped without a device, and fails, naming
//! the case and the call, on hosts that are broken on purpose: one that decodes a format wrongly,
//! one whose matmul ignores its inputs, and one that accepts calls it must refuse.

use std::collections::{HashMap, HashSet};
use wasmtime::component::{HasSelf, Resource};
use wisp::conformance::{self, CaseResult, KitState};
use wisp::gpu::{KvCacheHandle, ProgramHandle, WeightHandle};
use wisp::{Activation, AttentionShape, Backend, Budget, BufferId, CpuBackend, Device, Format, GpuCtx, GpuError};
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
    assert!(failed(&results).contains(&"matmul-batch"), "the batch holds a q4x32 job");
    // It keeps the trait's default attention, ffn and kv-caches, `unavailable`: allowed, so a skip.
    for (name, what) in [
        ("attention", "attention"),
        ("hostile-attention", "attention"),
        ("ffn", "ffn"),
        ("hostile-ffn", "ffn"),
        ("kv-cache", "kv-caches"),
        ("hostile-kv-cache", "kv-caches"),
        ("blocks", "kv-caches"),
        ("hostile-blocks", "kv-caches"),
    ] {
        let a = case(&results, name);
        assert!(a.skipped && a.message.contains(&format!("does not offer {what}")), "{a:?}");
    }
}

/// A backend right in all but one thing: its attention ignores the window (every query sees
/// every key before it), or its ffn applies the other activation (SiLU for GELU and back).
struct Tampered {
    inner: CpuBackend,
    no_window: bool,
    other_activation: bool,
}

impl Tampered {
    fn new(no_window: bool, other_activation: bool) -> Box<Tampered> {
        Box::new(Tampered { inner: CpuBackend::new(), no_window, other_activation })
    }
}

impl Backend for Tampered {
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
    fn attention(&mut self, q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape) -> Result<Vec<f32>, GpuError> {
        let window = if self.no_window { 0 } else { s.window };
        self.inner.attention(q, k, v, &AttentionShape { window, ..*s })
    }
    fn ffn(&mut self, x: &[f32], t: u32, n_in: u32, w: [BufferId; 3], act: Activation) -> Result<Vec<f32>, GpuError> {
        let act = match (self.other_activation, act) {
            (false, a) => a,
            (true, Activation::Silu) => Activation::GeluTanh,
            (true, Activation::GeluTanh) => Activation::Silu,
        };
        self.inner.ffn(x, t, n_in, w, act)
    }
}

#[test]
fn a_host_whose_ffn_applies_the_other_activation_fails_the_ffn_case() {
    let results = conformance::run(GpuCtx::new(Tampered::new(false, true), conformance::budget()), seed()).unwrap();
    eprintln!("{}", table(&results));
    assert_eq!(failed(&results), ["ffn"]);
    let f = case(&results, "ffn");
    assert!(f.message.starts_with("ffn t 1,") && f.message.contains("where the reference is"), "{}", f.message);
    assert!(case(&results, "hostile-ffn").passed);
}

#[test]
fn a_host_whose_attention_ignores_the_window_fails_the_attention_case() {
    let results = conformance::run(GpuCtx::new(Tampered::new(true, false), conformance::budget()), seed()).unwrap();
    eprintln!("{}", table(&results));
    assert_eq!(failed(&results), ["attention"]);
    let a = case(&results, "attention");
    assert!(a.message.contains("window: ") && a.message.contains("where the exact value is"), "{}", a.message);
    assert!(case(&results, "hostile-attention").passed);
}

/// A backend right in all but one thing: its cache writes land one position later than asked
/// (the calls of 0.3 write through `attention_cached`, which stays right).
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
    for name in ["program-ops", "program-top-k", "hostile-programs", "kv-cache"] {
        assert!(case(&results, name).passed, "{name} should pass:\n{}", table(&results));
    }
}

/// A backend whose matmul ignores its inputs: zeros of the right shape.
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
fn a_host_whose_matmul_ignores_its_inputs_fails_every_product_case() {
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
/// and `x` padded or cut to the shape's length, an empty job list answered with no outputs.
/// Device work goes to a `GpuCtx` over the CPU backend.
struct Lenient {
    inner: GpuCtx,
    budget: Budget,
    shapes: HashMap<u32, (wit::WeightFormat, u32, u32)>,
    /// Each live kv-cache's slots and width.
    caches: HashMap<u32, (u32, u32)>,
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

fn shape_of(s: wit::AttentionShape) -> AttentionShape {
    AttentionShape {
        t: s.t,
        n_keys: s.n_keys,
        n_head: s.n_head,
        n_head_kv: s.n_head_kv,
        head_dim: s.head_dim,
        window: s.window,
        scale: s.scale,
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

    fn matmul(
        &mut self,
        mut x: Vec<f32>,
        t: u32,
        n_in: u32,
        jobs: Vec<Resource<WeightHandle>>,
    ) -> Result<Vec<Vec<f32>>, wit::Error> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let want = t as u64 * n_in as u64;
        if want <= FIT_LIMIT {
            x.resize(want as usize, 0.0);
        }
        self.inner.matmul(&x, t, n_in, &jobs).map_err(error)
    }

    fn create_program(&mut self, _: Vec<Resource<WeightHandle>>, _: u32, _: Vec<wit::Op>) -> Result<Resource<ProgramHandle>, wit::Error> {
        Err(wit::Error::Unavailable("the lenient host does not offer programs".into()))
    }

    fn ffn(
        &mut self,
        mut x: Vec<f32>,
        t: u32,
        n_in: u32,
        gate: Resource<WeightHandle>,
        up: Resource<WeightHandle>,
        down: Resource<WeightHandle>,
        act: wit::Activation,
    ) -> Result<Vec<f32>, wit::Error> {
        let want = t as u64 * n_in as u64;
        if want <= FIT_LIMIT {
            x.resize(want as usize, 0.0);
        }
        let act = match act {
            wit::Activation::GeluTanh => Activation::GeluTanh,
            wit::Activation::Silu => Activation::Silu,
        };
        self.inner.ffn(&x, t, n_in, [&gate, &up, &down], act).map_err(error)
    }

    fn blocks(
        &mut self,
        _x: Vec<f32>,
        _t: u32,
        _pos: u32,
        _blocks: Vec<wit::Block>,
        _shape: wit::BlocksShape,
        _rope: Vec<Vec<f32>>,
        _return_kv: bool,
    ) -> Result<wit::BlocksOutput, wit::Error> {
        Err(wit::Error::Unavailable("the lenient host does not offer blocks".into()))
    }

    fn create_kv_cache(&mut self, slots: u32, width: u32) -> Result<Resource<KvCacheHandle>, wit::Error> {
        let c = self.inner.create_kv_cache(slots, width).map_err(error)?;
        self.caches.insert(c.rep(), (slots, width));
        Ok(c)
    }

    fn attention_cached(
        &mut self,
        mut q: Vec<f32>,
        k_new: Vec<f32>,
        v_new: Vec<f32>,
        first_new: u32,
        cache: Resource<KvCacheHandle>,
        first_key: u32,
        shape: wit::AttentionShape,
    ) -> Result<Vec<f32>, wit::Error> {
        let s = shape_of(shape);
        if let Some((q_len, _)) = s.lens().filter(|&(q, _)| q <= FIT_LIMIT) {
            q.resize(q_len as usize, 0.0);
        }
        self.inner.attention_cached(&q, &k_new, &v_new, first_new, &cache, first_key, &s).map_err(error)
    }

    fn attention(
        &mut self,
        mut q: Vec<f32>,
        mut k: Vec<f32>,
        mut v: Vec<f32>,
        shape: wit::AttentionShape,
    ) -> Result<Vec<f32>, wit::Error> {
        let s = shape_of(shape);
        if let Some((q_len, k_len)) = s.lens().filter(|&(q, k)| q.max(k) <= FIT_LIMIT) {
            q.resize(q_len as usize, 0.0);
            k.resize(k_len as usize, 0.0);
            v.resize(k_len as usize, 0.0);
        }
        self.inner.attention(&q, &k, &v, &s).map_err(error)
    }
}

/// Programs it does not offer (allowed: `unavailable`), so no program handle is ever made.
impl wit::HostProgram for Lenient {
    fn run(&mut self, _: Resource<ProgramHandle>, _: Vec<Vec<f32>>, _: Vec<wit::Sequence>) -> Result<Vec<wit::Output>, wit::Error> {
        Err(wit::Error::Unavailable("the lenient host does not offer programs".into()))
    }
    fn ops(&mut self, _: Resource<ProgramHandle>) -> u32 {
        0
    }
    fn drop(&mut self, _: Resource<ProgramHandle>) -> wasmtime::Result<()> {
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
    let host = Lenient { inner: GpuCtx::new(Box::new(CpuBackend::new()), budget), budget, shapes: HashMap::new(), caches: HashMap::new() };
    let link = |l: &mut wasmtime::component::Linker<KitState<Lenient>>| {
        wit::add_to_linker::<_, HasSelf<Lenient>>(l, |s: &mut KitState<Lenient>| &mut s.gpu)?;
        Ok(())
    };
    let (results, host) = conformance::run_with(host, link, seed()).unwrap();
    eprintln!("{}", table(&results));
    assert!(case(&results, "device-info").message.starts_with("lenient "));
    let f = failed(&results);
    for name in ["hostile-upload-lengths", "hostile-x-length", "hostile-empty-jobs", "hostile-attention", "hostile-ffn", "hostile-kv-cache"] {
        assert!(f.contains(&name), "{name} should fail:\n{}", table(&results));
    }
    let u = case(&results, "hostile-upload-lengths");
    assert!(u.message.contains("was accepted; want invalid-argument"), "{}", u.message);
    assert!(case(&results, "hostile-empty-jobs").message.contains("matmul with no jobs was accepted"));
    // Its products are right: only the refusals fail.
    for name in ["matmul-f32", "matmul-q4x32", "matmul-batch", "handle-lifetimes", "hostile-write-rows", "attention", "ffn", "kv-cache"] {
        assert!(case(&results, name).passed, "{name} should pass:\n{}", table(&results));
    }
    assert_eq!(host.inner.usage(), (0, 0), "the kit dropped every weight it accepted");
}
