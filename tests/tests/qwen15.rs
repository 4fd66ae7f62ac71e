//! A real model at the size people run on a laptop: Qwen2.5-Coder-1.5B-Instruct, the official
//! Q4_K_M file (`wisp fetch qwen2.5-coder-1.5b`), held to a float64 reference of this project's
//! own (`tests/qwen15/reference.py`: Hugging Face's `tokenizers` with Qwen2's pre-tokenizer for
//! the ids, a numpy forward over the `gguf` package's dequantized weights for the logits) by
//! teacher forcing within the golden thresholds of `tests/golden/README.md`, on every path in
//! both precisions: the guest's CPU, the native device, wgpu, and the CPU reference device (which
//! computes every precision exactly; one case there, it is slow). Without python3 and those
//! packages the test skips locally and fails under `CI=true` (`.ci/run` installs them).

use std::path::PathBuf;
use wisp::golden::{self, Case};
use wisp::{Budget, CpuBackend, GpuCtx, GpuMode, LoadOptions, NativeBackend, Precision};
use wisp_tests::{golden_passes, open, python, wgpu_backend};

/// The references for the 1.5B, in a directory of their own, or `None` (after saying why)
/// without Python's packages. Made once per test binary (about 3 minutes on two cores).
fn references() -> Option<&'static (PathBuf, Vec<Case>)> {
    static REFS: std::sync::OnceLock<Option<(PathBuf, Vec<Case>)>> = std::sync::OnceLock::new();
    REFS.get_or_init(|| {
        let model = wisp::fetch::ensure(&wisp::fetch::QWEN25_CODER_15B, false).expect("fetching Qwen2.5-Coder-1.5B");
        let out = std::env::temp_dir().join(format!("wisp-qwen15-{}", std::process::id()));
        python("qwen15/reference.py", &[model.as_os_str(), out.as_os_str()], "gguf, numpy and tokenizers")
            .then(|| (model, golden::load(&out.join("qwen15.json")).expect("the reference's golden file")))
    })
    .as_ref()
}

/// Runs `cases` with the model opened on `gpu` in `precision` (`mode` on or off), and asserts
/// each passes the golden thresholds; `resident` is how many matrices must be on the device.
fn holds(name: &str, gpu: GpuCtx, mode: GpuMode, precision: Precision, cases: &[Case], resident: impl Fn(u32) -> bool) {
    let (model, _) = references().expect("references made");
    let (mut inst, m) = open(model, gpu, LoadOptions { gpu: mode, precision });
    let on_device = inst.model_info(m).unwrap().gpu_weights;
    assert!(resident(on_device), "{name} {precision:?}: {on_device} weights on the device");
    for case in cases {
        let r = golden_passes(&mut inst, m, case, &format!("{name} {precision:?} "));
        assert!(r.argmax_checked > 0, "{name}: {} checks no argmax", r.name);
    }
}

/// 28 layers x 7 matrices and the output projection.
const MATRICES: u32 = 28 * 7 + 1;

#[test]
fn the_tokenizer_gives_its_own_tokenizers_ids() {
    let Some((model, cases)) = references() else { return };
    let (mut inst, m) = open(model, GpuCtx::none(), GpuMode::Off);
    let info = inst.model_info(m).unwrap();
    assert_eq!((info.architecture.as_str(), info.n_layers, info.n_embd, info.n_vocab), ("qwen2", 28, 1536, 151936));
    for case in cases {
        let ids = inst.tokenize(m, &case.prompt, true, true).unwrap().unwrap();
        assert_eq!(ids, case.prompt_tokens, "case {}", case.name);
    }
}

#[test]
fn the_golden_thresholds_hold_on_the_guests_cpu_in_both_precisions() {
    let Some((_, cases)) = references() else { return };
    for precision in [Precision::Exact, Precision::Fast] {
        holds("the guest's CPU", GpuCtx::none(), GpuMode::Off, precision, cases, |n| n == 0);
    }
}

#[test]
fn the_golden_thresholds_hold_on_the_native_device_in_both_precisions() {
    let Some((_, cases)) = references() else { return };
    for precision in [Precision::Exact, Precision::Fast] {
        let native = GpuCtx::new(Box::new(NativeBackend::new(2).expect("two worker threads")), Budget::default());
        holds("the native device", native, GpuMode::On, precision, cases, |n| n == MATRICES);
    }
}

#[test]
fn the_golden_thresholds_hold_on_wgpu_in_both_precisions() {
    let Some((_, cases)) = references() else { return };
    for precision in [Precision::Exact, Precision::Fast] {
        let Some(backend) = wgpu_backend() else { return };
        // A software adapter's binding may be too small for the output projection, which then
        // stays with the guest; every layer's matrices are on the device.
        holds("wgpu", GpuCtx::new(Box::new(backend), Budget::default()), GpuMode::On, precision, cases, |n| n >= MATRICES - 1);
    }
}

#[test]
fn the_golden_thresholds_hold_on_the_cpu_reference_device() {
    let Some((_, cases)) = references() else { return };
    let code: Vec<Case> = cases.iter().filter(|c| c.name == "code").cloned().collect();
    holds("the CPU reference device", GpuCtx::new(Box::new(CpuBackend::new()), Budget::default()), GpuMode::On, Precision::Exact, &code, |n| n == MATRICES);
}
