//! Architectures added in the guest alone, each held to its own float64 forward: Phi-3 (fused
//! products, a sliding window on every layer; Phi-3.5's long-rope, Phi-4-mini's partial
//! rotation), Gemma 2 (soft-capping), Qwen3 (per-head q/k norms), Granite (multipliers),
//! SmolLM3 (no rotation in every fourth layer), Mistral 3 (YaRN, attention temperature) and OLMo 2
//! (post-norms, q/k norms across heads) and 3 (sliding layers);
//! and every GGUF tensor type, each in a tiny Llama whose every product uses it. `tests/arch/<arch>.py` writes a tiny GGUF with
//! random weights (the `gguf` package) and its golden file from a float64 numpy forward
//! (`tests/arch/tiny.py` holds what they share); wisp must match it on the guest's CPU path, on
//! the host's CPU reference device and on wgpu (lavapipe here). Without python3 and those
//! packages the test skips locally and fails under `CI=true` (`.ci/run` installs them).

use std::path::PathBuf;
use wisp::{CpuBackend, GpuCtx, GpuMode, NativeBackend};
use wisp_tests::{open, python, wgpu_backend};

/// wisp against exact arithmetic on logits of magnitude ~5, as (top-5 difference, rmse): the
/// devices compute in f32; the guest's CPU path multiplies quantized weights with activations
/// rounded to 16 bits.
const DEVICE_BOUNDS: (f32, f64) = (1e-4, 1e-5);
const CPU_BOUNDS: (f32, f64) = (2e-3, 5e-4);
/// The same for the tiny Llamas of each format, wider (256) and with larger logits (up to ~6).
const CPU_BOUNDS_FORMATS: (f32, f64) = (3e-3, 1e-3);

/// The model `tiny-{stem}.gguf` and golden file that `tests/arch/{script}.py OUT args..`
/// writes, and the one number `effect` it reports, or `None` (after saying why) without
/// Python's packages.
fn generated(script: &str, stem: &str, args: &[&str], effect: &str) -> Option<(PathBuf, PathBuf, f64)> {
    let out = std::env::temp_dir().join(format!("wisp-arch-{stem}-{}", std::process::id()));
    let mut all = vec![out.as_os_str()];
    all.extend(args.iter().map(std::ffi::OsStr::new));
    if !python(&format!("arch/{script}.py"), &all, "gguf and numpy") {
        return None;
    }
    let golden = out.join(format!("tiny-{stem}.json"));
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&golden).unwrap()).unwrap();
    Some((out.join(format!("tiny-{stem}.gguf")), golden, meta[effect].as_f64().unwrap()))
}

/// Holds the tiny model of `arch` to its float64 forward on the guest's CPU, the CPU reference
/// device, the native device and wgpu, with `products` matrices on a device; `effect` is how far the logits move
/// without the architecture's quirk (which the reference reports), far past wisp's error.
fn matches_its_float64_forward(arch: &str, effect_name: &str, products: u32) {
    holds_to_its_float64_forward(generated(arch, arch, &[], effect_name), arch, effect_name, products, CPU_BOUNDS)
}

/// As `matches_its_float64_forward`, for the model `generated` made (`None`: skipped).
fn holds_to_its_float64_forward(made: Option<(PathBuf, PathBuf, f64)>, arch: &str, effect_name: &str, products: u32, cpu: (f32, f64)) {
    let Some((model, golden, effect)) = made else { return };
    let cases = wisp::golden::load(&golden).unwrap();
    let mut paths: Vec<(&str, GpuCtx, GpuMode, (f32, f64))> = vec![
        ("the guest's CPU", GpuCtx::none(), GpuMode::Off, cpu),
        ("the CPU reference device", GpuCtx::new(Box::new(CpuBackend::new()), Default::default()), GpuMode::On, DEVICE_BOUNDS),
        ("the native device", GpuCtx::new(Box::new(NativeBackend::new(2).expect("two worker threads")), Default::default()), GpuMode::On, DEVICE_BOUNDS),
    ];
    if let Some(b) = wgpu_backend() {
        paths.push(("wgpu", GpuCtx::new(Box::new(b), Default::default()), GpuMode::On, DEVICE_BOUNDS));
    }
    for (name, gpu, mode, (top5, rmse)) in paths {
        let (mut inst, m) = open(&model, gpu, mode);
        let on_device = inst.model_info(m).unwrap().gpu_weights;
        assert_eq!(on_device, if mode == GpuMode::Off { 0 } else { products }, "{arch} on {name}");
        let r = wisp::golden::run_case(&mut inst, m, &cases[0], 5).unwrap();
        eprintln!("{arch} on {name}: max top5 diff {:.2e}, rmse {:?}", r.max_top5_diff, r.rmse);
        assert!(r.pass() && r.argmax_checked > 0 && r.argmax_mismatches.is_empty(), "{arch} on {name}: {r:?}");
        assert!(r.max_top5_diff <= top5, "{arch} on {name}: top-5 difference {} past {top5}", r.max_top5_diff);
        let got = r.rmse.expect("the golden file has the prompt's logits");
        assert!(got <= rmse, "{arch} on {name}: rmse {got} past {rmse}");
        assert!(effect > 100.0 * got.max(rmse), "{arch} on {name}: {effect_name} is only {effect}");
    }
    let _ = std::fs::remove_dir_all(model.parent().unwrap());
}

/// Every product on the device where one is offered: 7 a layer (3 layers) and the output. The
/// window is why the logits are what they are: without it they are far off.
#[test]
fn a_tiny_phi3_matches_its_float64_forward_on_every_path() {
    matches_its_float64_forward("phi3", "window_effect_rmse", 22);
}

/// Phi-3.5's long-rope: the frequencies divided by `rope_factors_long` (the model's context is
/// past its original one), the cosines and sines times `rope.scaling.attn_factor`. With the
/// short factors, or none, the logits are far off.
#[test]
fn a_tiny_phi3_with_long_rope_matches_its_float64_forward_on_every_path() {
    let made = generated("phi3", "phi3-longrope", &["longrope"], "long_rope_effect_rmse");
    holds_to_its_float64_forward(made, "phi3 with long-rope", "long_rope_effect_rmse", 22, CPU_BOUNDS);
}

/// Gemma 2: soft-capped attention scores and logits (a new op and an attention parameter of the
/// op core, on every host), no q/k norms, a sliding window on every other layer, the output
/// tied to the embedding. Every product on the device where one is offered: 7 a layer (4 layers)
/// and the output. Without either cap the logits are far off.
#[test]
fn a_tiny_gemma2_matches_its_float64_forward_on_every_path() {
    matches_its_float64_forward("gemma2", "softcap_effect_rmse", 29);
}

/// Phi-4-mini's shape: a partial rotation (the first three quarters of each head turn, as its
/// `rope.dimension_count` 96 of 128), long-rope factors of that many frequencies, the output tied
/// to the embedding (the output product is the embedding's: 22 on the device). Turning whole
/// heads, the logits are far off.
#[test]
fn a_tiny_phi4_mini_with_a_partial_rotation_matches_its_float64_forward_on_every_path() {
    let made = generated("phi3", "phi4mini", &["phi4mini"], "partial_rotation_effect_rmse");
    holds_to_its_float64_forward(made, "phi4-mini", "partial_rotation_effect_rmse", 22, CPU_BOUNDS);
}

/// Qwen3, added as its file and its name in the guest's list of architectures: per-head q/k
/// norms, grouped-query attention, a head size past `n_embd / n_head`. Every product on the
/// device where one is offered: 7 a layer (3 layers) and the output. Without the head norms the
/// logits are far off.
#[test]
fn a_tiny_qwen3_matches_its_float64_forward_on_every_path() {
    matches_its_float64_forward("qwen3", "head_norm_effect_rmse", 22);
}

/// Granite: Llama's block with its four multipliers (the embedding, each block's output, the
/// attention scores, the logits), far from 1. Every product on the device where one is offered:
/// 7 a layer (4 layers) and the output. Without the multipliers the logits are far off.
#[test]
fn a_tiny_granite_matches_its_float64_forward_on_every_path() {
    let made = generated("llama_family", "granite", &["granite"], "quirk_effect_rmse");
    holds_to_its_float64_forward(made, "granite", "quirk_effect_rmse", 29, CPU_BOUNDS);
}

/// SmolLM3: Llama's block, its fourth layer's queries and keys not turned. Every product on the
/// device where one is offered: 7 a layer (4 layers) and the output. Turned, the logits are far
/// off.
#[test]
fn a_tiny_smollm3_matches_its_float64_forward_on_every_path() {
    let made = generated("llama_family", "smollm3", &["smollm3"], "quirk_effect_rmse");
    holds_to_its_float64_forward(made, "smollm3", "quirk_effect_rmse", 29, CPU_BOUNDS);
}

/// Mistral 3: Llama's block with YaRN's rotation scaling (a blend of interpolated and kept
/// frequencies, the cosines and sines scaled) and Llama 4's attention temperature (the queries
/// of positions past the original context scaled, through a table of their own). Every product
/// on the device where one is offered: 7 a layer (4 layers) and the output. Without YaRN, or
/// without the temperature, the logits are far off.
#[test]
fn a_tiny_mistral3_matches_its_float64_forward_on_every_path() {
    let made = generated("llama_family", "mistral3", &["mistral3"], "quirk_effect_rmse");
    holds_to_its_float64_forward(made, "mistral3", "quirk_effect_rmse", 29, CPU_BOUNDS);
}

/// OLMo 2: norms after each block, the queries' and keys' norms across all their heads. Every
/// product on the device where one is offered: 7 a layer (3 layers) and the output. Normed head
/// by head (Qwen3's reading), the logits are far off.
#[test]
fn a_tiny_olmo2_matches_its_float64_forward_on_every_path() {
    matches_its_float64_forward("olmo2", "head_norm_effect_rmse", 22);
}

/// OLMo 3 (`olmo2` files with a window): the layers its pattern marks (as a flag a layer) slide
/// and turn plainly, the others attend over everything with YaRN's rotation. Every product on
/// the device where one is offered: 7 a layer (3 layers) and the output. Without the window, or
/// without YaRN on the global layer, the logits are far off.
#[test]
fn a_tiny_olmo3_matches_its_float64_forward_on_every_path() {
    let made = generated("olmo2", "olmo3", &["olmo3"], "olmo3_effect_rmse");
    holds_to_its_float64_forward(made, "olmo3", "olmo3_effect_rmse", 22, CPU_BOUNDS);
}

/// A tiny Llama whose every product (7 a layer, 2 layers, and the output) is stored in GGUF type
/// `kind`, held to the float64 forward of `gguf`'s dequantization of its blocks on every path
/// (tests/arch/formats.py). A reading of each block's elements in the wrong order would move
/// the logits far past wisp's error.
fn a_tiny_llama_in(kind: &str) {
    let made = generated("formats", kind, &[kind], "misread_effect_rmse");
    holds_to_its_float64_forward(made, &format!("llama in {kind}"), "misread_effect_rmse", 15, CPU_BOUNDS_FORMATS);
}

macro_rules! every_format {
    ($($test:ident: $kind:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                a_tiny_llama_in($kind);
            }
        )*
    };
}

every_format! {
    a_tiny_llama_in_f32_matches_its_float64_forward: "F32",
    a_tiny_llama_in_f16_matches_its_float64_forward: "F16",
    a_tiny_llama_in_bf16_matches_its_float64_forward: "BF16",
    a_tiny_llama_in_q4_0_matches_its_float64_forward: "Q4_0",
    a_tiny_llama_in_q4_1_matches_its_float64_forward: "Q4_1",
    a_tiny_llama_in_q5_0_matches_its_float64_forward: "Q5_0",
    a_tiny_llama_in_q5_1_matches_its_float64_forward: "Q5_1",
    a_tiny_llama_in_q8_0_matches_its_float64_forward: "Q8_0",
    a_tiny_llama_in_q2_k_matches_its_float64_forward: "Q2_K",
    a_tiny_llama_in_q3_k_matches_its_float64_forward: "Q3_K",
    a_tiny_llama_in_q4_k_matches_its_float64_forward: "Q4_K",
    a_tiny_llama_in_q5_k_matches_its_float64_forward: "Q5_K",
    a_tiny_llama_in_q6_k_matches_its_float64_forward: "Q6_K",
    a_tiny_llama_in_iq4_nl_matches_its_float64_forward: "IQ4_NL",
    a_tiny_llama_in_iq4_xs_matches_its_float64_forward: "IQ4_XS",
}
