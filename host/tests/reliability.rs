//! The host survives what a guest or the user does: a runaway call (a guest that loops or
//! recurses forever, `tests/runaway`), a guest out of memory, a component of another world,
//! Ctrl-C. After each, the host keeps serving.

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

/// The runaway guest (`tests/runaway`): `model.from-bytes` spins on `spin`, recurses without
/// bound on `recurse`, and answers anything else with `unsupported`.
fn runaway(options: Options) -> Wisp {
    let bytes = std::fs::read(env!("WISP_RUNAWAY_WASM")).expect("the runaway guest is built with the host");
    Wisp::with_component(&bytes, Options { cache_dir: None, ..options }).unwrap()
}

/// The trap in an error's chain, and the error's one-line message.
fn trap_of(err: &anyhow::Error) -> (Option<wasmtime::Trap>, String) {
    (err.chain().find_map(|c| c.downcast_ref::<wasmtime::Trap>()).copied(), err.to_string())
}

/// A fresh instance of the same runtime answers, and so does the real guest.
fn runaway_runtime_still_serves(wisp: &Wisp) {
    let mut inst = wisp.instantiate(GpuCtx::none(), None).unwrap();
    match inst.open_model_bytes(b"hello", GpuMode::Off).unwrap() {
        Err(EngineError::Unsupported(m)) => assert!(m.contains("only spins or recurses"), "{m}"),
        other => panic!("expected the fixture's unsupported, got {other:?}"),
    }
    still_serves(&Wisp::new(Options::default()).unwrap(), &model());
}

#[test]
fn a_guest_that_loops_forever_ends_at_the_time_limit() {
    let wisp = runaway(Options { call_timeout: Some(Duration::from_millis(200)), ..Options::default() });
    let mut inst = wisp.instantiate(GpuCtx::none(), None).unwrap();
    let start = Instant::now();
    let err = inst.open_model_bytes(b"spin", GpuMode::Off).expect_err("the guest never returns");
    let elapsed = start.elapsed();
    // The limit counts in epoch ticks of 10 ms: the call may end up to a tick early.
    assert!(elapsed >= Duration::from_millis(180) && elapsed < Duration::from_secs(5), "ended after {elapsed:?}");
    let (trap, msg) = trap_of(&err);
    assert_eq!(trap, Some(wasmtime::Trap::Interrupt), "{err:?}");
    assert!(msg.contains("ran past its time limit of 200ms"), "{msg}");
    // The trapped instance refuses further calls with an error, not a crash.
    assert!(inst.open_model_bytes(b"hello", GpuMode::Off).is_err());
    runaway_runtime_still_serves(&wisp);
}

#[test]
fn a_guest_that_recurses_forever_ends_at_the_stack_limit() {
    let wisp = runaway(Options { max_stack: 256 << 10, ..Options::default() });
    let mut inst = wisp.instantiate(GpuCtx::none(), None).unwrap();
    let err = inst.open_model_bytes(b"recurse", GpuMode::Off).expect_err("the recursion has no end");
    let (trap, msg) = trap_of(&err);
    assert_eq!(trap, Some(wasmtime::Trap::StackOverflow), "{err:?}");
    assert!(msg.contains("ran out of stack (its limit is 256 KiB)"), "{msg}");
    assert!(inst.open_model_bytes(b"hello", GpuMode::Off).is_err());
    runaway_runtime_still_serves(&wisp);
}

#[test]
fn the_cli_names_the_limit_that_ended_a_runaway_guest() {
    let dir = std::env::temp_dir().join(format!("wisp-runaway-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (file, flags, expected) in [
        ("spin.gguf", ["--timeout", "1"], "the guest call ran past its time limit of 1s"),
        ("recurse.gguf", ["--max-stack", "128"], "the guest ran out of stack (its limit is 128 KiB)"),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, b"GGUF").unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_wisp"))
            .env("WISP_COMPONENT", env!("WISP_RUNAWAY_WASM"))
            .args(["run", "--gpu", "off", "--device", "none"])
            .args(flags)
            .arg("--model")
            .arg(&path)
            .arg("hello")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("wisp: error:")).collect();
        assert_eq!(lines.len(), 1, "one error line: {err}");
        assert!(lines[0].contains(expected), "{err}");
        assert!(lines[0].contains(flags[0]), "the message names the flag: {err}");
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(out.stdout.is_empty(), "nothing on stdout: {}", String::from_utf8_lossy(&out.stdout));
    }
    std::fs::remove_dir_all(&dir).ok();
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
fn a_model_file_larger_than_wasm32_memory_is_a_typed_error() {
    // A sparse file of 5 GiB behind a GGUF magic: more than a wasm32 guest can address at all.
    let dir = std::env::temp_dir().join(format!("wisp-huge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("huge.gguf");
    let f = std::fs::File::create(&path).unwrap();
    std::io::Write::write_all(&mut &f, b"GGUF\x03\x00\x00\x00").unwrap();
    f.set_len(5 << 30).unwrap();
    let wisp = Wisp::new(Options::default()).unwrap();
    let mut inst = wisp.instantiate(GpuCtx::none(), Some(&dir)).unwrap();
    let outcome = inst.open_model(&path, GpuMode::Off).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    match outcome {
        Err(EngineError::OutOfMemory(m)) => assert!(m.contains("5368709120 bytes does not fit"), "{m}"),
        other => panic!("expected out-of-memory, got {other:?}"),
    }
    // The same instance keeps serving.
    match inst.open_model_bytes(b"GGUF\x03\x00\x00\x00", GpuMode::Off).unwrap() {
        Err(EngineError::InvalidModel(m)) => assert!(m.contains("truncated"), "{m}"),
        other => panic!("expected invalid-model, got {other:?}"),
    }
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
