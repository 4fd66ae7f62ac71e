//! The guest's own tests, built for wasm32-wasip2 (so its simd128 kernels are the ones tested
//! against their scalar references) and run under wasmtime: its library's unit tests and
//! `guest/tests/gguf_hostile.rs`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::process::Command;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Config, Engine, Store, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

struct State {
    wasi: WasiCtx,
    table: ResourceTable,
    gpu: wisp::GpuCtx,
    limits: StoreLimits,
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// A build of the guest: the portable one (.cargo/config.toml's flags) or the one with relaxed
/// SIMD too, as `host/build.rs` builds them.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Build {
    Portable,
    Relaxed,
}

/// Builds the guest's tests for wasm32-wasip2 (its library's unit tests and its integration
/// tests) and returns the test components' paths by name (`wisp_guest`, `gguf_hostile`). Each
/// build is made once per test binary: the tests below share its cargo run.
fn guest_tests(build: Build) -> &'static HashMap<String, PathBuf> {
    static PORTABLE: OnceLock<HashMap<String, PathBuf>> = OnceLock::new();
    static RELAXED: OnceLock<HashMap<String, PathBuf>> = OnceLock::new();
    let cell = match build {
        Build::Portable => &PORTABLE,
        Build::Relaxed => &RELAXED,
    };
    cell.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let target_dir = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .map(|p| if p.is_absolute() { p } else { root.join(p) })
            .unwrap_or_else(|| root.join("target"))
            // The directory where the build script built the guest: its dependencies, built for
            // the same target with the same features, are reused.
            .join(match build {
                Build::Portable => "guest",
                Build::Relaxed => "guest-relaxed",
            });
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(root).env_remove("CARGO_ENCODED_RUSTFLAGS").env_remove("RUSTFLAGS");
        match build {
            // The build script's packages, so that cargo resolves the same features.
            Build::Portable => cmd.args(["test", "--release", "--locked", "-p", "wisp-guest", "-p", "wisp-conformance", "-p", "wisp-runaway", "-p", "wisp-http", "-p", "wisp-virt", "--tests"]),
            // Its library's tests alone (the kernels'), not the integration tests too.
            Build::Relaxed => cmd.args(["test", "--release", "--locked", "-p", "wisp-guest", "--lib"]).env("RUSTFLAGS", env!("WISP_GUEST_RELAXED_RUSTFLAGS")),
        };
        let out = cmd
            .args(["--no-run", "--target", "wasm32-wasip2", "--message-format=json"])
            .arg("--target-dir")
            .arg(&target_dir)
            .output()
            .expect("running cargo");
        assert!(out.status.success(), "building the guest tests failed:\n{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["profile"]["test"] == true && v["package_id"].as_str().is_some_and(|p| p.contains("wisp-guest")))
            .filter_map(|v| Some((v["target"]["name"].as_str()?.to_string(), PathBuf::from(v["executable"].as_str()?))))
            .collect()
    })
}

/// Runs one of the guest's test components under wasmtime (WASI, and the `gpu` import with no
/// device) and fails if any of its tests fails.
fn run_guest_tests(build: Build, name: &str, filter: &[&str]) {
    let tests = guest_tests(build);
    let wasm = tests.get(name).unwrap_or_else(|| panic!("cargo built no test component {name} ({build:?}): {tests:?}"));
    let mut config = Config::new();
    config.wasm_component_model(true);
    let engine = Engine::new(&config).unwrap();
    let component = Component::from_file(&engine, wasm).unwrap();
    let mut linker = Linker::new(&engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).unwrap();
    // The test binary links the whole guest library, its `gpu` import included.
    wisp::add_to_linker(&mut linker, |s: &mut State| &mut s.gpu).unwrap();
    let wasi = WasiCtxBuilder::new()
        .inherit_stdout()
        .inherit_stderr()
        // Uncaptured: a failing guest test aborts (wasm has no unwinding), which would lose
        // captured output, its panic message and the seed it printed among it.
        .args(&[name, "--test-threads=1", "--nocapture"])
        .args(filter)
        // More arguments for the guest's test harness, e.g. `--ignored kernel_bench`.
        .args(&std::env::var("WISP_GUEST_TEST_ARGS").unwrap_or_default().split_whitespace().collect::<Vec<_>>())
        .build();
    // A memory limit, as every host sets one: an allocation past it is refused (the hostile
    // cases ask for `isize::MAX` bytes, which a 32-bit memory could otherwise grant).
    let limits = StoreLimitsBuilder::new().memory_size(1536 << 20).build();
    let mut store = Store::new(&engine, State { wasi, table: ResourceTable::new(), gpu: wisp::GpuCtx::none(), limits });
    store.limiter(|s| &mut s.limits);
    let command = wasmtime_wasi::p2::bindings::sync::Command::instantiate(&mut store, &component, &linker).unwrap();
    let result = command.wasi_cli_run().call_run(&mut store);
    match result {
        Ok(Ok(())) => {}
        Ok(Err(())) => panic!("the guest's tests ({name}) failed on wasm32"),
        Err(e) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
            Some(code) if code.0 == 0 => {}
            _ => panic!("the guest's tests ({name}) failed on wasm32: {e:?}"),
        },
    }
}

#[test]
fn guest_unit_tests_pass_on_wasm32_with_simd128() {
    run_guest_tests(Build::Portable, "wisp_guest", &[]);
}

/// The kernels again in the guest built with relaxed SIMD (the native host's): its int8
/// products (relaxed SIMD's byte dot products) equal the scalar definition bit for bit, as the
/// portable build's do.
#[test]
fn guest_kernel_tests_pass_on_wasm32_with_relaxed_simd() {
    run_guest_tests(Build::Relaxed, "wisp_guest", &["kernels::"]);
}

/// The GGUF parser and loader on hostile files (RELIABILITY items 1-14), with the allocation
/// bound its counting allocator measures.
#[test]
fn gguf_hostile_cases_pass_on_wasm32() {
    run_guest_tests(Build::Portable, "gguf_hostile", &[]);
}
