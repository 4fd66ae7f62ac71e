//! A real Llama-architecture GGUF as a new user brings it: SmolLM2-135M-Instruct in Q4_1 with
//! the `smollm` pre-tokenizer (`wisp fetch smollm2-135m`). `tests/smollm2/reference.py` gives
//! its references: Hugging Face's `tokenizers` with SmolLM2's pre-tokenizer for the token ids,
//! and a float64 numpy forward over the `gguf` package's dequantized weights for the logits;
//! wisp must match both, on the guest's CPU, the CPU reference device, the native device and
//! wgpu. Without python3
//! and those packages the test skips locally and fails under `CI=true` (`.ci/run` installs
//! them).

use std::path::{Path, PathBuf};
use wisp::{CpuBackend, GpuCtx, GpuMode, NativeBackend};
use wisp_tests::{open, python, smollm_model, wgpu_backend};

/// wisp against the float64 forward, as (top-5 difference, rmse) over logits of magnitude ~20:
/// the devices compute in f32 from the file's exact weights; the guest's CPU path multiplies
/// them with activations rounded to 16 bits.
const DEVICE_BOUNDS: (f32, f64) = (5e-4, 1e-4);
const CPU_BOUNDS: (f32, f64) = (0.02, 0.01);

/// The references for `model`, in a directory of their own, or `None` (after saying why)
/// without Python's packages.
fn references(model: &Path) -> Option<PathBuf> {
    let out = std::env::temp_dir().join(format!("wisp-smollm2-{}", std::process::id()));
    python("smollm2/reference.py", &[model.as_os_str(), out.as_os_str()], "gguf, numpy and tokenizers").then_some(out)
}

#[test]
fn smollm2_tokenizes_as_its_own_tokenizer_and_matches_its_float64_forward_on_every_path() {
    let model = smollm_model();
    let Some(refs) = references(model) else { return };

    let (mut inst, m) = open(model, GpuCtx::none(), GpuMode::Off);
    let info = inst.model_info(m).unwrap();
    assert_eq!((info.architecture.as_str(), info.tokenizer.as_str()), ("llama", "gpt2"));
    assert_eq!((info.n_layers, info.n_embd, info.n_vocab), (30, 576, 49152));
    let texts: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(refs.join("tokens.json")).unwrap()).unwrap();
    for t in texts.as_array().unwrap() {
        let text = t["text"].as_str().unwrap();
        let want: Vec<u32> = t["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = inst.tokenize(m, text, false, true).unwrap().unwrap();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(inst.detokenize(m, &got, true).unwrap().unwrap(), text, "{text:?} back from its tokens");
    }
    drop(inst);

    let cases = wisp::golden::load(&refs.join("smollm2.json")).unwrap();
    let mut paths: Vec<(&str, GpuCtx, GpuMode, (f32, f64))> = vec![
        ("the guest's CPU", GpuCtx::none(), GpuMode::Off, CPU_BOUNDS),
        ("the CPU reference device", GpuCtx::new(Box::new(CpuBackend::new()), Default::default()), GpuMode::On, DEVICE_BOUNDS),
        ("the native device", GpuCtx::new(Box::new(NativeBackend::new(2).expect("two worker threads")), Default::default()), GpuMode::On, DEVICE_BOUNDS),
    ];
    if let Some(b) = wgpu_backend() {
        paths.push(("wgpu", GpuCtx::new(Box::new(b), Default::default()), GpuMode::On, DEVICE_BOUNDS));
    }
    for (name, gpu, mode, (top5, rmse)) in paths {
        let (mut inst, m) = open(model, gpu, mode);
        // Every product on the device where one is offered: 7 a layer (30 layers) and the
        // output (tied to the Q8_0 embedding).
        let on_device = inst.model_info(m).unwrap().gpu_weights;
        assert_eq!(on_device, if mode == GpuMode::Off { 0 } else { 211 }, "{name}");
        let r = wisp::golden::run_case(&mut inst, m, &cases[0], 5).unwrap();
        eprintln!("{name}: max top5 diff {:.2e}, rmse {:?}", r.max_top5_diff, r.rmse);
        assert!(r.pass() && r.argmax_checked > 0 && r.argmax_mismatches.is_empty(), "{name}: {r:?}");
        assert!(r.max_top5_diff <= top5, "{name}: top-5 difference {} past {top5}", r.max_top5_diff);
        let got = r.rmse.expect("the reference has the prompt's logits");
        assert!(got <= rmse, "{name}: rmse {got} past {rmse}");
    }
    let _ = std::fs::remove_dir_all(refs);
}
