//! `wisp bake`: the component it writes imports the `wasi:http/proxy` world and nothing more,
//! and `wasmtime serve` (wasmtime-cli 48, installed with `cargo install` into the cache outside
//! the clone when missing) serves it to the `openai` Python package with `wisp serve`'s texts
//! (`tests/bake/test_bake.py`, pytest). A missing tool or package fails under `CI=true`.

mod pytest;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The wasmtime-cli release `wasmtime serve` comes from: the wasmtime this host embeds.
const WASMTIME_CLI: &str = "48.0.8";

/// `wasmtime` of wasmtime-cli `WASMTIME_CLI`: `WISP_WASMTIME`, else the tools cache
/// (`~/.cache/wisp/tools`, or `$WISP_CACHE/tools`), installed there by `cargo install` when
/// missing (about 10 minutes on two cores, once per machine).
fn wasmtime() -> PathBuf {
    if let Some(p) = std::env::var_os("WISP_WASMTIME") {
        return PathBuf::from(p);
    }
    let cache = match std::env::var_os("WISP_CACHE") {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/wisp"),
    };
    let tools = cache.join("tools");
    let bin = tools.join("bin/wasmtime");
    let version = |bin: &Path| Command::new(bin).arg("--version").output().ok().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    if version(&bin).is_some_and(|v| v.contains(WASMTIME_CLI)) {
        return bin;
    }
    eprintln!("installing wasmtime-cli {WASMTIME_CLI} into {} (cargo install, once)", tools.display());
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["install", "--locked", "--quiet", "--force", &format!("wasmtime-cli@{WASMTIME_CLI}"), "--root"])
        .arg(&tools)
        // Its own temporary build directory, removed when it is done: not this build's, whose
        // lock the running `cargo test` holds.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .status()
        .expect("running cargo install");
    assert!(status.success(), "cargo install wasmtime-cli@{WASMTIME_CLI} failed");
    let v = version(&bin);
    assert!(v.as_ref().is_some_and(|v| v.contains(WASMTIME_CLI)), "{} --version says {v:?}", bin.display());
    bin
}

#[test]
fn a_baked_model_serves_the_openai_api_under_wasmtime_serve() {
    let suite = "the bake suite";
    if !pytest::python_has("openai, httpx, pytest, anthropic", suite) {
        return;
    }
    let model = wisp::fetch::ensure(&wisp::fetch::QWEN25_CODER_05B, false).expect("fetching Qwen2.5-Coder-0.5B-Instruct");
    let dir = std::env::temp_dir().join(format!("wisp-bake-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let baked = dir.join("qwen.http.wasm");
    let out = Command::new(env!("CARGO_BIN_EXE_wisp")).arg("bake").arg("--model").arg(&model).arg("-o").arg(&baked).output().unwrap();
    assert!(out.status.success(), "wisp bake failed: {}", String::from_utf8_lossy(&out.stderr));

    // The proxy world and nothing more: no file system, sockets, environment or wisp:llm.
    let bytes = std::fs::read(&baked).unwrap();
    let (imports, exports) = wisp::bake::imports_and_exports(&bytes).unwrap();
    for forbidden in ["wasi:filesystem", "wasi:sockets", "wasi:cli/environment", "wasi:cli/exit", "wisp:llm"] {
        assert!(!imports.iter().any(|i| i.starts_with(forbidden)), "the baked component imports {forbidden}: {imports:?}");
    }
    assert!(imports.iter().all(|i| wisp::bake::in_proxy_world(i)), "imports outside wasi:http/proxy: {imports:?}");
    assert!(imports.iter().any(|i| i.starts_with("wasi:http/types@0.2.")), "{imports:?}");
    assert!(
        exports.len() == 1 && exports[0].starts_with("wasi:http/incoming-handler@0.2."),
        "the baked component exports {exports:?}"
    );

    // Dense: the snapshot holds the converted weights end to end (the GGUF read a piece at a
    // time, no hole where it was held whole), so runtimes with default settings map it
    // copy-on-write rather than writing it into every instance.
    let image = wisp::bake::memory_image(&bytes).unwrap().expect("the baked guest has a memory image");
    assert!(
        image.mapped_by_default() && image.span_bytes < image.data_bytes + image.data_bytes / 8,
        "the memory image holds {} bytes over {}",
        image.data_bytes,
        image.span_bytes
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("(dense: runtimes map it"), "{}", String::from_utf8_lossy(&out.stderr));

    let wasmtime = wasmtime();
    let env = [
        ("WISP_BIN", env!("CARGO_BIN_EXE_wisp").as_ref()),
        ("WISP_WASMTIME", wasmtime.as_os_str()),
        ("WISP_BAKED", baked.as_os_str()),
        ("WISP_MODEL", model.as_os_str()),
    ];
    pytest::run(suite, "tests/bake", true, &env);
    let _ = std::fs::remove_dir_all(&dir);
}
