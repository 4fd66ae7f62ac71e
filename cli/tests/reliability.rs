//! The host survives what a guest or the user does: hostile model files and prompts (through
//! the real guest), a runaway call (a guest that loops, recurses or allocates forever,
//! `tests/runaway`), a guest out of memory, a component of another world or WIT version,
//! Ctrl-C. After each, the host keeps serving: a valid request succeeds.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use wisp::{EngineError, GpuCtx, GpuMode, Limit, Options, Sampling, Wisp};

/// The default model, fetched once for all tests of this binary.
fn model() -> PathBuf {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).expect("fetching the default model")).clone()
}

/// A new instance of `wisp` with the model at `path` open, CPU only.
fn open(wisp: &Wisp, path: &Path) -> (wisp::Instance, wisp::Model) {
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent()).unwrap();
    let m = inst.open_model(path, GpuMode::Off).unwrap().unwrap();
    (inst, m)
}

/// A second, valid request on the same runtime succeeds.
fn still_serves(wisp: &Wisp, path: &Path) {
    let (mut inst, m) = open(wisp, path);
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
        Err(EngineError::Unsupported(m)) => assert!(m.contains("only spins, recurses or grows"), "{m}"),
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
fn a_guest_that_allocates_without_bound_ends_at_the_memory_limit() {
    let wisp = runaway(Options { max_memory: 64 << 20, ..Options::default() });
    let mut inst = wisp.instantiate(GpuCtx::none(), None).unwrap();
    let err = inst.open_model_bytes(b"grow", GpuMode::Off).expect_err("the allocations have no end");
    let (trap, msg) = trap_of(&err);
    // The guest's allocator aborts when the memory cannot grow: a trap, not an error value.
    assert!(trap.is_some(), "{err:?}");
    assert_eq!(err.downcast_ref::<Limit>(), Some(&Limit::Memory(64 << 20)), "{err:?}");
    assert!(msg.contains("the guest ran out of memory (its limit is 64 MiB)"), "{msg}");
    assert!(msg.contains("this instance can no longer be used"), "{msg}");
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
        ("grow.gguf", ["--max-memory", "64"], "the guest ran out of memory (its limit is 64 MiB)"),
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
        Err(EngineError::OutOfMemory(m)) => assert!(m.contains("MiB of guest memory"), "{m}"),
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
    // A sparse file of 5 GiB: a header naming one f32 tensor of 5 GiB, then zeros. More than a
    // wasm32 guest can address at all (the guest reads a file a piece at a time: it is the
    // weights that cannot fit, and it says so before reading them).
    let dir = std::env::temp_dir().join(format!("wisp-huge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("huge.gguf");
    let header = gguf(3, 1, 1, &[kv(b"general.architecture", 8, &gstr(b"gemma3")), tensor(b"token_embd.weight", 2, &[640, 1 << 21], 0, 0)]);
    let f = std::fs::File::create(&path).unwrap();
    std::io::Write::write_all(&mut &f, &header).unwrap();
    f.set_len((header.len() as u64).div_ceil(32) * 32 + 4 * 640 * (1 << 21)).unwrap();
    let wisp = Wisp::new(Options::default()).unwrap();
    let mut inst = wisp.instantiate(GpuCtx::none(), Some(&dir)).unwrap();
    let outcome = inst.open_model(&path, GpuMode::Off).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    match outcome {
        Err(EngineError::OutOfMemory(m)) => assert!(m.contains("need about 5120 MiB of guest memory"), "{m}"),
        other => panic!("expected out-of-memory, got {other:?}"),
    }
    // The same instance keeps serving: a tiny GGUF is refused for its content, and the default
    // model loads and answers.
    match inst.open_model_bytes(b"GGUF\x03\x00\x00\x00", GpuMode::Off).unwrap() {
        Err(EngineError::InvalidModel(m)) => assert!(m.contains("truncated"), "{m}"),
        other => panic!("expected invalid-model, got {other:?}"),
    }
    answers(&mut inst, &std::fs::read(model()).unwrap());
}

/// The instance opens the default model from `bytes` and answers a prompt as it should.
fn answers(inst: &mut wisp::Instance, bytes: &[u8]) {
    let m = inst.open_model_bytes(bytes, GpuMode::Off).unwrap().unwrap();
    let prompt = inst.tokenize(m, "The capital of France is", true, false).unwrap().unwrap();
    assert_eq!(prompt, [2, 818, 5279, 529, 7001, 563]);
    let s = inst.new_session(m, 16).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    let step = inst.next(s, &Sampling::default()).unwrap().unwrap();
    assert_eq!(String::from_utf8_lossy(&step.piece), " the", "greedy continuation of {prompt:?}");
    inst.drop_session(s).unwrap();
    inst.drop_model(m).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Hostile model files and prompts through the real guest (RELIABILITY 1-14 and 16; the parser's
// and the loader's every case is in guest/tests/gguf_hostile.rs, natively): each is the typed
// error with its message, and the same instance then loads the default model and answers.

fn le32(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn le64(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// A GGUF string: u64 length, then the bytes.
fn gstr(s: &[u8]) -> Vec<u8> {
    [le64(s.len() as u64), s.to_vec()].concat()
}

/// A GGUF file: header, key/values and tensor infos as given, then `tail`.
fn gguf(version: u32, n_tensors: u64, n_kv: u64, body: &[Vec<u8>]) -> Vec<u8> {
    [b"GGUF".to_vec(), le32(version), le64(n_tensors), le64(n_kv), body.concat()].concat()
}

/// One key/value entry: key, value type, value bytes.
fn kv(key: &[u8], ty: u32, value: &[u8]) -> Vec<u8> {
    [gstr(key), le32(ty), value.to_vec()].concat()
}

/// One tensor info: name, n_dims, dims, type, offset.
fn tensor(name: &[u8], n_dims: u32, dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    [gstr(name), le32(n_dims), dims.iter().flat_map(|d| d.to_le_bytes()).collect(), le32(ty), le64(offset)].concat()
}

/// The default model with one key's value (of the same size) replaced: `ty` and `value`.
fn with_value(file: &[u8], key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let needle = gstr(key.as_bytes());
    let at = file.windows(needle.len()).position(|w| w == needle).unwrap_or_else(|| panic!("no key {key}")) + needle.len();
    let mut out = file.to_vec();
    out[at..at + 4].copy_from_slice(&ty.to_le_bytes());
    out[at + 4..at + 4 + value.len()].copy_from_slice(value);
    out
}

/// The default model with the first occurrence of `from` replaced by `to` (of the same length).
fn with_bytes(file: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = file.windows(from.len()).position(|w| w == from).unwrap_or_else(|| panic!("no {from:?}"));
    let mut out = file.to_vec();
    out[at..at + to.len()].copy_from_slice(to);
    out
}

fn message(e: &EngineError) -> &str {
    match e {
        EngineError::InvalidModel(m)
        | EngineError::Unsupported(m)
        | EngineError::Io(m)
        | EngineError::InvalidArgument(m)
        | EngineError::ContextFull(m)
        | EngineError::OutOfMemory(m)
        | EngineError::InvalidConstraint(m) => m,
    }
}

#[test]
fn hostile_model_files_are_typed_errors_and_the_instance_keeps_serving() {
    const U32: u32 = 4;
    const F32: u32 = 6;
    const STRING: u32 = 8;
    const ARRAY: u32 = 9;
    let invalid = |m: &str| EngineError::InvalidModel(m.to_string());
    let real = std::fs::read(model()).unwrap();
    let aligned = kv(b"general.alignment", U32, &le32(32));
    let cases: Vec<(&str, Vec<u8>, EngineError)> = vec![
        ("1: empty", Vec::new(), invalid("file of 0 bytes is too short to be GGUF")),
        ("1: truncated", b"GGUF\x03\x00\x00\x00\x01".to_vec(), invalid("truncated: tensor count")),
        ("1: bad magic", b"PK\x03\x04 a zip file, not a model".to_vec(), invalid("bad magic")),
        ("2: version 1", gguf(1, 0, 0, &[]), invalid("unsupported GGUF version 1")),
        ("2: version u32::MAX", gguf(u32::MAX, 0, 0, &[]), invalid("unsupported GGUF version 4294967295")),
        ("3: 2^63 tensors", gguf(3, 1 << 63, 0, &[]), invalid("tensor count 9223372036854775808 cannot fit")),
        ("3: 2^32 keys", gguf(3, 0, 1 << 32, &[vec![0; 64]]), invalid("metadata count 4294967296 cannot fit")),
        (
            "4: key length u64::MAX",
            gguf(3, 0, 1, &[le64(u64::MAX), b"general.name".to_vec()]),
            invalid("metadata key length 18446744073709551615 exceeds"),
        ),
        (
            "4: string past the end",
            gguf(3, 0, 1, &[kv(b"general.name", STRING, &[le64(500), b"short".to_vec()].concat())]),
            invalid("truncated: general.name needs 500 bytes, 5 left"),
        ),
        (
            "5: key not UTF-8",
            gguf(3, 0, 1, &[kv(b"general.\xFFname", U32, &le32(1))]),
            invalid("metadata key is not valid UTF-8"),
        ),
        ("6: empty key", gguf(3, 0, 1, &[kv(b"", U32, &le32(1))]), invalid("empty metadata key")),
        (
            "6: duplicate key",
            gguf(3, 0, 2, &[kv(b"a", U32, &le32(1)), kv(b"a", U32, &le32(2))]),
            invalid("duplicate key \"a\""),
        ),
        (
            "6: tensor name of 64 bytes",
            gguf(3, 1, 0, &[tensor(&[b'n'; 64], 1, &[4], 0, 0), vec![0; 64]]),
            invalid("tensor name of 64 bytes exceeds 63"),
        ),
        (
            "7: array of 2^62",
            gguf(3, 0, 1, &[kv(b"k", ARRAY, &[le32(0), le64(1 << 62), vec![0; 64]].concat())]),
            invalid("array length 4611686018427387904 cannot fit"),
        ),
        (
            "8: nested array",
            gguf(3, 0, 1, &[kv(b"k", ARRAY, &[le32(ARRAY), le64(1), le32(ARRAY), le64(1)].concat())]),
            invalid("k: nested arrays are not supported"),
        ),
        ("8: value type 13", gguf(3, 0, 1, &[kv(b"k", 13, &[0; 16])]), invalid("k: unknown value type 13")),
        (
            "9: alignment as a string",
            gguf(3, 0, 1, &[kv(b"general.alignment", STRING, &gstr(b"32"))]),
            invalid("general.alignment has type string, not u32"),
        ),
        (
            "9: block_count as f32",
            with_value(&real, "gemma3.block_count", F32, &18f32.to_le_bytes()),
            invalid("gemma3.block_count is f32"),
        ),
        (
            "10: alignment 0",
            gguf(3, 0, 1, &[kv(b"general.alignment", U32, &le32(0))]),
            invalid("general.alignment 0 is not a power of two"),
        ),
        (
            "11: n_dims 5",
            gguf(3, 1, 1, &[aligned.clone(), tensor(b"t", 5, &[1; 5], 0, 0)]),
            invalid("tensor \"t\": n_dims 5 is not in 1..=4"),
        ),
        (
            "11: a dimension of 0",
            gguf(3, 1, 0, &[tensor(b"t", 2, &[4, 0], 0, 0)]),
            invalid("tensor \"t\": a dimension is 0"),
        ),
        (
            "11: dimensions whose product overflows",
            gguf(3, 1, 0, &[tensor(b"t", 2, &[1 << 32, 1 << 32], 0, 0)]),
            invalid("element count overflows"),
        ),
        (
            "12: tensor type 4",
            gguf(3, 1, 0, &[tensor(b"t", 1, &[256], 4, 0)]),
            invalid("tensor \"t\": unknown tensor type 4"),
        ),
        (
            "12: first dimension not a multiple of the block",
            gguf(3, 1, 0, &[tensor(b"t", 2, &[100, 4], 12, 0)]),
            invalid("first dimension 100 is not a multiple of Q4_K's block of 256"),
        ),
        (
            "13: offset past the end",
            gguf(3, 1, 0, &[tensor(b"t", 1, &[16], 0, 1 << 40), vec![0; 64]]),
            invalid("lies past the end"),
        ),
        (
            "13: overlapping tensors",
            gguf(3, 2, 0, &[tensor(b"a", 1, &[16], 0, 0), tensor(b"b", 1, &[16], 0, 32), vec![0; 160]]),
            invalid("tensor \"b\" overlaps tensor \"a\""),
        ),
        (
            "13: tensor data out of order",
            gguf(3, 2, 0, &[tensor(b"a", 1, &[16], 0, 64), tensor(b"b", 1, &[16], 0, 0), vec![0; 160]]),
            invalid("tensor \"b\" at offset 0 comes before tensor \"a\" at offset 64"),
        ),
        (
            "14: block_count above the cap",
            with_value(&real, "gemma3.block_count", U32, &le32(100_000)),
            invalid("gemma3.block_count = 100000 exceeds the cap"),
        ),
        (
            "14: head count 0",
            with_value(&real, "gemma3.attention.head_count", U32, &le32(0)),
            invalid("gemma3.attention.head_count is 0"),
        ),
        (
            "14: special token id past the vocabulary",
            with_value(&real, "tokenizer.ggml.bos_token_id", U32, &le32(262_144)),
            invalid("tokenizer.ggml.bos_token_id = 262144 is not below the vocabulary size 262144"),
        ),
        (
            "14: a required tensor missing",
            with_bytes(&real, &gstr(b"output_norm.weight"), &gstr(b"output_norm.weighx")),
            invalid("tensor output_norm.weight is missing"),
        ),
    ];
    let path = model();
    let wisp = Wisp::new(Options::default()).unwrap();
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent()).unwrap();
    for (what, bytes, want) in &cases {
        let got = match inst.open_model_bytes(bytes, GpuMode::Off).unwrap() {
            Ok(_) => panic!("{what}: the model opened"),
            Err(e) => e,
        };
        assert!(
            std::mem::discriminant(&got) == std::mem::discriminant(want) && message(&got).contains(message(want)),
            "{what}: want {want:?}, got {got:?}"
        );
    }
    // The same instance keeps serving.
    answers(&mut inst, &real);
    drop(cases);
    still_serves(&wisp, &path);
}

#[test]
fn hostile_prompts_are_typed_errors_and_the_session_keeps_serving() {
    let path = model();
    let wisp = Wisp::new(Options::default()).unwrap();
    let (mut inst, m) = open(&wisp, &path);
    let s = inst.new_session(m, 16).unwrap().unwrap();
    let vocab = "is not below the vocabulary size 262144";
    let invalid = |r: wisp::Outcome<()>, want: &str, what: &str| match r.unwrap() {
        Err(EngineError::InvalidArgument(m)) if m.contains(want) => {}
        other => panic!("{what}: want invalid-argument saying {want:?}, got {other:?}"),
    };
    // Nothing fed yet: no logits, no next token.
    invalid(inst.logits(s).map(|r| r.map(drop)), "no token has been fed", "logits of an empty session");
    invalid(inst.next(s, &Sampling::default()).map(|r| r.map(drop)), "no token has been fed", "next of an empty session");
    // An empty prompt, and token ids given directly that are past the vocabulary.
    assert_eq!(inst.tokenize(m, "", false, false).unwrap().unwrap(), Vec::<u32>::new());
    invalid(inst.feed(s, &[]), "no tokens to feed", "an empty prompt");
    invalid(inst.feed(s, &[262_144]), &format!("token id 262144 {vocab}"), "the vocabulary size as an id");
    invalid(inst.feed(s, &[2, 818, u32::MAX]), &format!("token id 4294967295 {vocab}"), "u32::MAX among valid ids");
    invalid(inst.detokenize(m, &[818, 262_144], false).map(|r| r.map(drop)), &format!("token id 262144 {vocab}"), "detokenize");
    invalid(inst.token_piece(m, u32::MAX, true).map(|r| r.map(drop)), &format!("token id 4294967295 {vocab}"), "token-piece");
    // A prompt longer than the context, and a context longer than the model's.
    match inst.feed(s, &[2; 17]).unwrap() {
        Err(EngineError::ContextFull(m)) => assert!(m.contains("0 tokens in context + 17 new exceed the capacity of 16"), "{m}"),
        other => panic!("a prompt of 17 tokens in a context of 16: want context-full, got {other:?}"),
    }
    match inst.new_session(m, 32_769).unwrap() {
        Err(EngineError::InvalidArgument(m)) => assert!(m.contains("context of 32769 tokens exceeds the model's 32768"), "{m}"),
        other => panic!("a context of 32769 tokens: want invalid-argument, got {:?}", other.map(drop)),
    }
    // Bad sampling settings.
    let nan = Sampling { temperature: f32::NAN, ..Sampling::default() };
    inst.feed(s, &[2]).unwrap().unwrap();
    invalid(inst.next(s, &nan).map(|r| r.map(drop)), "invalid sampling settings", "a NaN temperature");
    // None of it changed the session: the prompt continues as it should.
    assert_eq!(inst.position(s).unwrap(), 1);
    inst.reset(s).unwrap();
    let prompt = inst.tokenize(m, "The capital of France is", true, false).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    let step = inst.next(s, &Sampling::default()).unwrap().unwrap();
    assert_eq!(String::from_utf8_lossy(&step.piece), " the");
    // The context fills exactly, then is full.
    inst.feed(s, &[818; 9]).unwrap().unwrap();
    match inst.next(s, &Sampling::default()).unwrap() {
        Err(EngineError::ContextFull(m)) => assert!(m.contains("the context of 16 tokens is full"), "{m}"),
        other => panic!("next in a full context: want context-full, got {:?}", other.map(drop)),
    }
}

#[test]
fn a_model_path_that_is_not_a_regular_file_is_an_io_error() {
    let dir = std::env::temp_dir().join(format!("wisp-not-a-file-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let fifo = dir.join("model.gguf");
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let wisp = Wisp::new(Options { call_timeout: Some(Duration::from_secs(20)), ..Options::default() }).unwrap();
    let mut inst = wisp.instantiate(GpuCtx::none(), Some(&dir)).unwrap();
    for path in [fifo.clone(), dir.join("sub")] {
        let start = Instant::now();
        match inst.open_model(&path, GpuMode::Off).unwrap() {
            Err(EngineError::Io(m)) => assert!(m.contains(&format!("{} is not a regular file", path.display())), "{m}"),
            other => panic!("{}: want io, got {:?}", path.display(), other.map(drop)),
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{}: took {:?}", path.display(), start.elapsed());
    }
    match inst.open_model(&dir.join("missing.gguf"), GpuMode::Off).unwrap() {
        Err(EngineError::Io(m)) => assert!(m.contains("missing.gguf"), "{m}"),
        other => panic!("a missing file: want io, got {:?}", other.map(drop)),
    }
    std::fs::remove_dir_all(&dir).ok();
    // The same instance keeps serving.
    answers(&mut inst, &std::fs::read(model()).unwrap());
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
    still_serves(&Wisp::new(Options::default()).unwrap(), &model());
}

/// The real guest with every `wisp:llm/<interface>@0.11.0` renamed to `@{version}` (six
/// characters, so that the binary stays valid): a component built for another version of the
/// WIT package.
fn guest_of_version(version: &[u8; 6]) -> Vec<u8> {
    let mut bytes = wisp::GUEST_WASM.to_vec();
    let mut n = 0;
    for iface in [&b"wisp:llm/gpu@0.11.0"[..], b"wisp:llm/engine@0.11.0"] {
        let mut to = iface.to_vec();
        let at = to.len() - 6;
        to[at..].copy_from_slice(version);
        let mut i = 0;
        while let Some(p) = bytes[i..].windows(iface.len()).position(|w| w == iface) {
            bytes[i + p..i + p + iface.len()].copy_from_slice(&to);
            i += p + iface.len();
            n += 1;
        }
    }
    assert!(n >= 2, "the guest names its interfaces {n} times");
    bytes
}

#[test]
fn a_component_built_for_another_wit_version_is_refused_clearly() {
    // A guest of an earlier version (0.5: the calls programs replaced) names it.
    let wisp = Wisp::with_component(&guest_of_version(b"0.8.10"), Options { cache_dir: None, ..Options::default() }).unwrap();
    let err = match wisp.instantiate(GpuCtx::none(), None) {
        Ok(_) => panic!("a component of wisp:llm@0.8.10 instantiated"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("built for wisp:llm@0.8.10"), "{err}");
    assert!(err.contains("this host implements wisp:llm@0.11.0"), "{err}");
    // The CLI says so in one line.
    let dir = std::env::temp_dir().join(format!("wisp-version-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let component = dir.join("guest-1.0.wasm");
    std::fs::write(&component, guest_of_version(b"1.10.0")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_wisp"))
        .env("WISP_COMPONENT", &component)
        .args(["run", "--gpu", "off", "--model"])
        .arg(model())
        .arg("hello")
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(lines[0].starts_with("wisp: error:") && lines[0].contains("built for wisp:llm@1.10.0"), "{stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    // The right version still serves, on the same host.
    still_serves(&Wisp::new(Options::default()).unwrap(), &model());
}

#[test]
fn ctrl_c_stops_generation_and_keeps_the_output() {
    let path = model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_wisp"))
        .args(["run", "--gpu", "off", "--temp", "0", "-n", "400", "--model"])
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

/// RELIABILITY 36 through the embedding API: a bad constraint is `InvalidConstraint` and leaves
/// the session as it was; a dead end appends nothing; `reset` and `None` lift a constraint.
#[test]
fn constraints_through_the_api_fail_typed_and_lift_cleanly() {
    use wisp::Constraint;
    let path = model();
    let wisp = Wisp::new(Options::default()).unwrap();
    let (mut inst, m) = open(&wisp, &path);
    let s = inst.new_session(m, 64).unwrap().unwrap();
    let prompt = inst.tokenize(m, "Is the sky blue? Answer:", true, false).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    let bad = [
        Constraint::JsonSchema("{\"type\": \"integer\", \"minimum\": 5, \"maximum\": 3}".into()),
        Constraint::JsonSchema("not json".into()),
        Constraint::Regex("(".into()),
        Constraint::Lark("start: missing".into()),
        Constraint::Regex("a".repeat(256 * 1024 + 1)),
    ];
    for c in &bad {
        match inst.constrain(s, Some(c)).unwrap() {
            Err(EngineError::InvalidConstraint(m)) => assert!(m.contains("does not compile") || m.contains("not JSON") || m.contains("over the limit"), "{m}"),
            other => panic!("{c:?}: {other:?}"),
        }
    }
    // The failed constraints left none: the session generates as it would have.
    let free = inst.next(s, &Sampling::default()).unwrap().unwrap();
    inst.reset(s).unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    inst.constrain(s, Some(&Constraint::Regex(" (yes|no)".into()))).unwrap().unwrap();
    let mut text = Vec::new();
    loop {
        let step = inst.next(s, &Sampling::default()).unwrap().unwrap();
        if step.end_of_generation {
            assert!(!step.dead_end);
            break;
        }
        text.extend(step.piece);
        assert!(text.len() <= 4, "{}", String::from_utf8_lossy(&text));
    }
    assert!(text == b" yes" || text == b" no", "{}", String::from_utf8_lossy(&text));
    // A dead end appends nothing.
    let before = inst.position(s).unwrap();
    inst.constrain(s, Some(&Constraint::Regex("[^\\s\\S]".into()))).unwrap().unwrap();
    let step = inst.next(s, &Sampling::default()).unwrap().unwrap();
    assert!(step.dead_end && step.end_of_generation && step.piece.is_empty(), "{step:?}");
    assert_eq!(inst.position(s).unwrap(), before);
    // `None` lifts it: the same first token as unconstrained.
    inst.constrain(s, None).unwrap().unwrap();
    inst.reset(s).unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    assert_eq!(inst.next(s, &Sampling::default()).unwrap().unwrap().token, free.token);
    // And `reset` lifts it too.
    inst.constrain(s, Some(&Constraint::Regex("[^\\s\\S]".into()))).unwrap().unwrap();
    inst.reset(s).unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    assert_eq!(inst.next(s, &Sampling::default()).unwrap().unwrap().token, free.token);
}
