//! Shared helpers of wisp's conformance and end-to-end tests.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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
