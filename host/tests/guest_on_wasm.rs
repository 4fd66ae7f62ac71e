//! The guest's own unit tests, built for wasm32-wasip2 (so its simd128 kernels are the ones
//! tested against their scalar references) and run under wasmtime.

use std::path::{Path, PathBuf};
use std::process::Command;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Config, Engine, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

struct State {
    wasi: WasiCtx,
    table: ResourceTable,
    gpu: wisp::GpuCtx,
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// Builds the guest's library tests for wasm32-wasip2 and returns the test component's path.
fn build_guest_tests() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| if p.is_absolute() { p } else { root.join(p) })
        .unwrap_or_else(|| root.join("target"))
        .join("guest-tests");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root)
        .args(["test", "--release", "--locked", "-p", "wisp-guest", "--lib", "--no-run"])
        .args(["--target", "wasm32-wasip2", "--message-format=json"])
        .arg("--target-dir")
        .arg(&target_dir)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .output()
        .expect("running cargo");
    assert!(out.status.success(), "building the guest tests failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["profile"]["test"] == true)
        .find_map(|v| v["executable"].as_str().map(PathBuf::from))
        .expect("cargo reported no test executable")
}

#[test]
fn guest_unit_tests_pass_on_wasm32_with_simd128() {
    let wasm = build_guest_tests();
    let mut config = Config::new();
    config.wasm_component_model(true);
    let engine = Engine::new(&config).unwrap();
    let component = Component::from_file(&engine, &wasm).unwrap();
    let mut linker = Linker::new(&engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).unwrap();
    // The test binary links the whole guest library, its `gpu` import included.
    wisp::add_to_linker(&mut linker, |s: &mut State| &mut s.gpu).unwrap();
    let wasi = WasiCtxBuilder::new()
        .inherit_stdout()
        .inherit_stderr()
        // Uncaptured: a failing guest test aborts (wasm has no unwinding), which would lose
        // captured output, its panic message and the seed it printed among it.
        .args(&["guest-tests", "--test-threads=1", "--nocapture"])
        // More arguments for the guest's test harness, e.g. `--ignored kernel_bench`.
        .args(&std::env::var("WISP_GUEST_TEST_ARGS").unwrap_or_default().split_whitespace().collect::<Vec<_>>())
        .build();
    let mut store = Store::new(&engine, State { wasi, table: ResourceTable::new(), gpu: wisp::GpuCtx::none() });
    let command = wasmtime_wasi::p2::bindings::sync::Command::instantiate(&mut store, &component, &linker).unwrap();
    let result = command.wasi_cli_run().call_run(&mut store);
    match result {
        Ok(Ok(())) => {}
        Ok(Err(())) => panic!("the guest's tests failed on wasm32"),
        Err(e) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
            Some(code) if code.0 == 0 => {}
            _ => panic!("the guest's tests failed on wasm32: {e:?}"),
        },
    }
}
