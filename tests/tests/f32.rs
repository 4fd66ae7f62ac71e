//! A real model past wasm32's 4 GiB: Qwen2.5-Coder-1.5B-Instruct with every tensor dequantized
//! to F32 (6.6 GiB; `tests/f32/make.py` makes it once from the Q4_K_M file, `wisp fetch
//! qwen2.5-coder-1.5b`, into wisp's cache). The guest cannot hold its weights: they go to the
//! native device as they are read, and it generates, greedy, the text the Q4_K_M file gives on
//! the guest's own CPU (the same values, summed in another order), with the guest's memory
//! under 512 MiB. Without python3 and the `gguf` package the test skips locally and fails
//! under `CI=true` (`.ci/run` installs them).

use std::path::PathBuf;
use wisp::{Budget, GpuCtx, GpuMode, Instance, Model, NativeBackend, Options, Sampling, Wisp};
use wisp_tests::{open, python};

/// The F32 file, made from the Q4_K_M one where the cache does not hold it yet; `None` (after
/// saying why) where it cannot be made outside CI.
fn f32_model(q4: &std::path::Path) -> Option<PathBuf> {
    let out = wisp::fetch::cache_dir().expect("wisp's cache").join("qwen2.5-coder-1.5b-instruct-f32.gguf");
    if out.exists() {
        return Some(out);
    }
    python("f32/make.py", &[q4.as_os_str(), out.as_os_str()], "gguf and numpy").then_some(out)
}

/// 12 greedy tokens after a prompt.
fn generate(inst: &mut Instance, m: Model) -> Vec<u32> {
    let prompt = inst.tokenize(m, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", true, false).unwrap().unwrap();
    let s = inst.new_session(m, 64).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    (0..12).map(|_| inst.next(s, &Sampling::default()).unwrap().unwrap().token).collect()
}

#[test]
fn the_real_1_5b_in_f32_runs_on_the_native_device_in_under_512_mib_of_guest_memory() {
    let q4 = wisp::fetch::ensure(&wisp::fetch::QWEN25_CODER_15B, false).expect("fetching Qwen2.5-Coder-1.5B");
    let Some(f32) = f32_model(&q4) else { return };
    assert!(std::fs::metadata(&f32).unwrap().len() > 6 << 30, "the F32 file is past 6 GiB");

    let (mut guest, m) = open(&q4, GpuCtx::none(), GpuMode::Off);
    let want = generate(&mut guest, m);
    drop(guest);

    let wisp = Wisp::new(Options::default()).expect("the runtime");
    let native = NativeBackend::new(2).expect("the native device");
    let mut inst = wisp.instantiate(GpuCtx::new(Box::new(native), Budget::default()), f32.parent()).expect("an instance");
    let m = inst.open_model(&f32, GpuMode::Auto).expect("no trap").expect("the F32 model opens on the device");
    let got = generate(&mut inst, m);
    println!("{:?}", inst.detokenize(m, &got, true).unwrap().unwrap());
    assert_eq!(got, want, "the F32 file's greedy tokens against the Q4_K_M file's on the guest's CPU");
    let peak = inst.memory_bytes();
    println!("guest memory {} MiB at most for a file of {} MiB", peak >> 20, std::fs::metadata(&f32).unwrap().len() >> 20);
    assert!(peak < 512 << 20, "the guest grew to {} MiB", peak >> 20);
}
