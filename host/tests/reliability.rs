//! The host survives what a guest or the user does: a runaway call, a guest out of memory, a
//! component of another world, Ctrl-C. After each, the host keeps serving.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use wisp::{EngineError, GpuCtx, GpuMode, Options, Wisp};

/// The default model, fetched once for all tests of this binary.
fn model() -> PathBuf {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).expect("fetching the default model")).clone()
}

/// A second, valid request on the same runtime succeeds.
fn still_serves(wisp: &Wisp, path: &Path) {
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent()).unwrap();
    let m = inst.open_model(path, GpuMode::Off).unwrap().unwrap();
    let ids = inst.tokenize(m, "The capital of France is", true, false).unwrap().unwrap();
    assert_eq!(ids, [2, 818, 5279, 529, 7001, 563]);
}

#[test]
fn a_guest_call_past_its_time_limit_is_interrupted() {
    let path = model();
    let wisp = Wisp::new(Options { call_timeout: Some(Duration::from_millis(30)), ..Options::default() }).unwrap();
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent()).unwrap();
    let start = Instant::now();
    let err = inst.open_model(&path, GpuMode::Off).expect_err("loading takes far longer than 30 ms");
    assert!(start.elapsed() < Duration::from_secs(5), "interrupted promptly: {:?}", start.elapsed());
    let trap = err.chain().find_map(|c| c.downcast_ref::<wasmtime::Trap>());
    assert_eq!(trap, Some(&wasmtime::Trap::Interrupt), "{err:?}");
    // A fresh instance on a runtime without the limit works.
    still_serves(&Wisp::new(Options::default()).unwrap(), &path);
}

#[test]
fn a_model_too_large_for_the_guest_memory_is_a_typed_error() {
    let path = model();
    let wisp = Wisp::new(Options { max_memory: 96 << 20, ..Options::default() }).unwrap();
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent()).unwrap();
    match inst.open_model(&path, GpuMode::Off).unwrap() {
        Err(EngineError::OutOfMemory(m)) => assert!(m.contains("does not fit"), "{m}"),
        other => panic!("expected out-of-memory, got {other:?}"),
    }
    // The same instance keeps serving what fits: a tiny GGUF is refused for its content.
    match inst.open_model_bytes(b"GGUF\x03\x00\x00\x00", GpuMode::Off).unwrap() {
        Err(EngineError::InvalidModel(m)) => assert!(m.contains("truncated"), "{m}"),
        other => panic!("expected invalid-model, got {other:?}"),
    }
    still_serves(&Wisp::new(Options::default()).unwrap(), &path);
}

#[test]
fn a_component_of_another_world_is_refused_clearly() {
    // An empty component: it exports no `wisp:llm/engine`.
    let empty = b"\0asm\x0d\x00\x01\x00";
    let wisp = Wisp::with_component(empty, Options { cache_dir: None, ..Options::default() }).unwrap();
    let err = match wisp.instantiate(GpuCtx::none(), None) {
        Ok(_) => panic!("an empty component instantiated"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("wisp:llm/engine"), "{err}");
    // And one that is not a component at all.
    let err = Wisp::with_component(b"not wasm", Options { cache_dir: None, ..Options::default() }).err().unwrap();
    assert!(format!("{err:#}").contains("compiling the guest component"), "{err:#}");
}

#[test]
fn ctrl_c_stops_generation_and_keeps_the_output() {
    let path = model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_wisp"))
        .args(["run", "--gpu", "off", "-n", "400", "--model"])
        .arg(&path)
        .arg("Once upon a time")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    // Wait for the prompt and a few generated tokens.
    while seen.len() < "Once upon a time".len() + 12 {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "wisp ended before generating");
        seen.extend_from_slice(&buf[..n]);
    }
    let status = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    stdout.read_to_end(&mut seen).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&seen);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(text.starts_with("Once upon a time"), "{text}");
    assert!(err.contains("[interrupted]"), "{err}");
    assert!(err.contains("decode:"), "stats are still printed: {err}");
    assert!(out.status.success(), "{:?} {err}", out.status);
}
