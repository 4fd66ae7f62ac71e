//! Shared helpers of wisp's conformance and end-to-end tests.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use wisp::gpu::program::{Output, Program, SequenceRun};
use wisp::{Activation, AttentionShape, Backend, BufferId, Device, Format, GpuError, Precision};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is inside the workspace").to_path_buf()
}

/// The default model, fetched once per test binary.
pub fn model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).expect("fetching the default model"))
}

/// The golden cases of the default model.
pub fn golden_cases() -> Vec<wisp::golden::Case> {
    wisp::golden::load(&root().join("tests/golden/gemma3-270m.json")).expect("reading the golden file")
}

/// The second family's model (Qwen2.5-Coder-0.5B-Instruct, `qwen2`), fetched once per test
/// binary.
pub fn qwen_model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::QWEN25_CODER_05B, false).expect("fetching the Qwen2.5-Coder model"))
}

/// The golden cases of the Qwen2.5-Coder model.
pub fn qwen_golden_cases() -> Vec<wisp::golden::Case> {
    wisp::golden::load(&root().join("tests/golden/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b.json"))
        .expect("reading the Qwen golden file")
}

/// A real Llama-architecture model (SmolLM2-135M-Instruct, Q4_1, the `smollm` pre-tokenizer),
/// fetched once per test binary.
pub fn smollm_model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::SMOLLM2_135M, false).expect("fetching the SmolLM2 model"))
}

/// Runs the Python script `tests/{script}` with `args`; `false` (after saying why) where it
/// fails outside CI, for want of python3 or the packages `needs` names (pip), so that the test
/// skips; under `CI=true`, which installs them (`.ci/run`), a failure.
pub fn python(script: &str, args: &[&std::ffi::OsStr], needs: &str) -> bool {
    let run = std::process::Command::new("python3").arg(root().join("tests").join(script)).args(args).output();
    let why = match run {
        Ok(o) if o.status.success() => return true,
        Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
        Err(e) => e.to_string(),
    };
    assert!(!hardware_required(), "tests/{script} needs python3 with {needs} (pip), and CI=true requires them: {why}");
    eprintln!("skipping: {why}");
    false
}

/// Whether a missing device must fail the test (under CI) rather than skip it.
pub fn hardware_required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The wgpu backend on this machine's adapter, or `None` (after saying why) when there is none
/// and the test may skip. Under `CI=true` a missing adapter panics.
pub fn wgpu_backend() -> Option<wisp::WgpuBackend> {
    match wisp::WgpuBackend::new() {
        Ok(Some(b)) => {
            if let Some(d) = wisp::Backend::device(&b) {
                eprintln!("adapter: {} ({})", d.name, d.backend);
            }
            Some(b)
        }
        other => {
            let why = match other {
                Err(e) => format!("wgpu failed: {e:#}"),
                _ => "no wgpu adapter".to_string(),
            };
            assert!(!hardware_required(), "{why}, and CI=true requires one (install mesa-vulkan-drivers)");
            eprintln!("skipping: {why}");
            None
        }
    }
}

/// A guest instance with `path` open, offered `gpu` and run in `mode`.
pub fn open(path: &Path, gpu: wisp::GpuCtx, mode: impl Into<wisp::LoadOptions>) -> (wisp::Instance, wisp::Model) {
    let wisp = wisp::Wisp::new(wisp::Options::default()).expect("the runtime");
    let mut inst = wisp.instantiate(gpu, path.parent()).expect("an instance");
    let m = inst.open_model(path, mode).expect("no trap").expect("the model opens");
    (inst, m)
}

/// Runs golden case `case` by teacher forcing, prints its figures after `label`, and asserts it
/// has references and passes the golden thresholds (`tests/golden/README.md`).
pub fn golden_passes(inst: &mut wisp::Instance, m: wisp::Model, case: &wisp::golden::Case, label: &str) -> wisp::golden::Outcome {
    let r = wisp::golden::run_case(inst, m, case, 5).unwrap();
    eprintln!(
        "{label}{}: argmax {}/{}, max top5 diff {:.4}, rmse {:.4}",
        r.name,
        r.argmax_checked - r.argmax_mismatches.len(),
        r.argmax_checked,
        r.max_top5_diff,
        r.rmse.unwrap_or(f64::NAN)
    );
    assert!(r.judged && r.rmse.is_some(), "{label}{}: the case has references", r.name);
    assert!(r.pass(), "{label}{} fails the golden thresholds: {r:?}", r.name);
    r
}

/// A device that works until it is lost, as a driver reset loses one: `inner` until the
/// `healthy`-th whole pass (a program's run) or until `lost` is set, then `device-lost` for
/// every call.
pub struct Losable {
    pub inner: Box<dyn Backend>,
    /// Whole passes to run before the loss (`usize::MAX`: the test sets `lost` instead).
    pub healthy: usize,
    pub lost: Arc<AtomicBool>,
}

impl Losable {
    /// `inner`, lost when the test sets the flag it returns.
    pub fn new(inner: Box<dyn Backend>) -> (Losable, Arc<AtomicBool>) {
        let lost = Arc::new(AtomicBool::new(false));
        (Losable { inner, healthy: usize::MAX, lost: lost.clone() }, lost)
    }

    fn live(&self) -> Result<(), GpuError> {
        match self.lost.load(Ordering::SeqCst) {
            true => Err(GpuError::DeviceLost("simulated loss mid-session".into())),
            false => Ok(()),
        }
    }

    /// Counts a whole pass: the device is lost once `healthy` have run.
    fn pass(&mut self) -> Result<(), GpuError> {
        if self.healthy == 0 {
            self.lost.store(true, Ordering::SeqCst);
        }
        self.live()?;
        self.healthy = self.healthy.saturating_sub(1);
        Ok(())
    }
}

impl Backend for Losable {
    fn device(&self) -> Option<Device> {
        self.inner.device()
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        self.live()?;
        self.inner.create(f, n_out, n_in)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.live()?;
        self.inner.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.live()?;
        self.inner.matmul(x, t, n_in, jobs)
    }
    fn matmul_op(&mut self, id: BufferId, x: &[f32], t: u32, n_in: u32, precision: Precision) -> Result<Vec<f32>, GpuError> {
        self.live()?;
        self.inner.matmul_op(id, x, t, n_in, precision)
    }
    fn matmul_ops(&mut self, ids: &[BufferId], x: &[f32], t: u32, n_in: u32, precision: Precision) -> Result<Vec<Vec<f32>>, GpuError> {
        self.live()?;
        self.inner.matmul_ops(ids, x, t, n_in, precision)
    }
    fn gated(&mut self, act: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
        self.inner.gated(act, gate, up)
    }
    fn free(&mut self, id: BufferId) {
        self.inner.free(id)
    }
    fn create_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        self.live()?;
        self.inner.create_cache(slots, width)
    }
    fn free_cache(&mut self, id: BufferId) {
        self.inner.free_cache(id)
    }
    fn write_cache(&mut self, id: BufferId, first: u32, k: &[f32], v: &[f32]) -> Result<(), GpuError> {
        self.live()?;
        self.inner.write_cache(id, first, k, v)
    }
    fn attention_cached(&mut self, q: &[f32], k: &[f32], v: &[f32], first_new: u32, cache: BufferId, first_key: u32, shape: &AttentionShape) -> Result<Vec<f32>, GpuError> {
        self.live()?;
        self.inner.attention_cached(q, k, v, first_new, cache, first_key, shape)
    }
    fn run_program(&mut self, p: &Program, inputs: &[Vec<f32>], batch: &[SequenceRun]) -> Option<Result<Vec<Output>, GpuError>> {
        if let Err(e) = self.pass() {
            return Some(Err(e));
        }
        // A backend that interprets programs does so over this one (`None`): its calls are
        // counted too.
        self.inner.run_program(p, inputs, batch)
    }
}
