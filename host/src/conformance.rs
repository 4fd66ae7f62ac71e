//! The conformance kit of the `gpu` interface, embedded, and its runner.
//!
//! The kit is a second component (`tests/conformance`, world `conformance` in
//! `wit/conformance.wit`): it imports `wisp:llm/gpu`, exercises every part of the contract
//! (each upload format against its own decoding, batches, chunked writes, handle lifetimes,
//! budgets, hostile calls) and returns one [`CaseResult`] per case. The same bytes
//! ([`COMPONENT`]) run against any host: [`run`] checks wisp's own [`GpuCtx`] with any
//! [`Backend`](crate::Backend), [`run_with`] any other implementation of the interface linked
//! into wasmtime, and `wisp conformance --write-component` hands the file to other runtimes.
//!
//! ```no_run
//! use wisp::{CpuBackend, GpuCtx, conformance};
//! # fn main() -> anyhow::Result<()> {
//! let gpu = GpuCtx::new(Box::new(CpuBackend::new()), conformance::budget());
//! let results = conformance::run(gpu, 42)?;
//! for r in results.iter().filter(|r| r.failed()) {
//!     eprintln!("{}: {}", r.name, r.message);
//! }
//! # Ok(()) }
//! ```

use crate::bindings::conformance::Conformance;
use crate::gpu::{self, Budget, GpuCtx};
use anyhow::{Context, Result, anyhow};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, Store, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::{ResourceTable, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

/// The kit's component (wasm32-wasip2), built with this crate.
pub const COMPONENT: &[u8] = include_bytes!(env!("WISP_CONFORMANCE_WASM"));

/// Largest linear memory of the kit.
const KIT_MEMORY: usize = 1 << 30;

/// The outcome of one case.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CaseResult {
    /// e.g. "matmul-q4x32", "hostile-write-rows".
    pub name: String,
    /// The host did what the contract says.
    pub passed: bool,
    /// The case could not run on this host (no device, a budget too large to fill); `message`
    /// says why. Neither a pass nor a failure.
    pub skipped: bool,
    /// Largest error of a compared product, as a fraction of the norm of its terms.
    pub max_error: f64,
    /// Wall-clock time of the case, in microseconds.
    pub micros: u64,
    /// What was checked, or what went wrong.
    pub message: String,
}

impl CaseResult {
    /// Whether the host broke the contract: neither passed nor skipped.
    pub fn failed(&self) -> bool {
        !self.passed && !self.skipped
    }
}

/// A budget the kit can exhaust quickly: 64 MiB and 4096 handles (the `budget-bytes` case is
/// skipped above 256 MiB).
pub fn budget() -> Budget {
    Budget { bytes: 64 << 20, ..Budget::default() }
}

/// Store data of a kit instance: WASI (the kit reads the clock and may write to stderr, nothing
/// else) and the host of the `gpu` interface.
pub struct KitState<T> {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: StoreLimits,
    /// The implementation of `wisp:llm/gpu` under test.
    pub gpu: T,
}

impl<T: Send + 'static> WasiView for KitState<T> {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// The engine and the compiled kit, made once per process.
fn compiled() -> Result<&'static (Engine, Component)> {
    static KIT: OnceLock<(Engine, Component)> = OnceLock::new();
    if let Some(k) = KIT.get() {
        return Ok(k);
    }
    let mut config = Config::new();
    config.wasm_component_model(true);
    let engine = Engine::new(&config)?;
    let component = Component::new(&engine, COMPONENT)
        .map_err(|e| anyhow::Error::from(e).context("compiling the conformance kit"))?;
    Ok(KIT.get_or_init(|| (engine, component)))
}

/// Runs the kit against wisp's `gpu` host: `gpu`'s backend with `gpu`'s budget (give it one the
/// kit can fill, such as [`budget`]). After the kit's cases, `host-usage-after-kit` checks that
/// the host holds no device memory once every weight of the kit is dropped.
pub fn run(gpu: GpuCtx, seed: u64) -> Result<Vec<CaseResult>> {
    let (mut results, gpu) = run_with(gpu, |l| gpu::add_to_linker(l, |s: &mut KitState<GpuCtx>| &mut s.gpu), seed)?;
    let (bytes, handles) = gpu.usage();
    results.push(CaseResult {
        name: "host-usage-after-kit".into(),
        passed: bytes == 0 && handles == 0,
        skipped: false,
        max_error: 0.0,
        micros: 0,
        message: if bytes == 0 && handles == 0 {
            "the host holds no weights once the kit's are dropped".into()
        } else {
            format!("the host still holds {bytes} bytes in {handles} weights after the kit dropped all of its own")
        },
    });
    Ok(results)
}

/// Runs the kit against any implementation of `wisp:llm/gpu`: `link` adds it to the linker,
/// reading its state from [`KitState::gpu`] (for example with the `add_to_linker` that
/// wasmtime's `bindgen!` generates for the interface). Returns the results and the state.
pub fn run_with<T: Send + 'static>(
    gpu: T,
    link: impl FnOnce(&mut Linker<KitState<T>>) -> Result<()>,
    seed: u64,
) -> Result<(Vec<CaseResult>, T)> {
    let (engine, component) = compiled()?;
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    link(&mut linker).context("linking the gpu interface for the conformance kit")?;
    let state = KitState {
        wasi: WasiCtxBuilder::new().inherit_stderr().build(),
        table: ResourceTable::new(),
        limits: StoreLimitsBuilder::new().memory_size(KIT_MEMORY).build(),
        gpu,
    };
    let mut store = Store::new(engine, state);
    store.limiter(|s| &mut s.limits);
    let kit = Conformance::instantiate(&mut store, component, &linker)
        .map_err(|e| anyhow::Error::from(e).context("instantiating the conformance kit"))?;
    // A panic in the host under test is a finding, not a reason to take the caller down.
    let results = match catch_unwind(AssertUnwindSafe(|| kit.call_run_suite(&mut store, seed))) {
        Ok(r) => r.map_err(|e| anyhow!("the conformance kit trapped: {e:#}"))?,
        Err(p) => {
            let why = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
            return Err(anyhow!(
                "the host panicked during the conformance kit: {}",
                why.unwrap_or_else(|| "(no message)".into())
            ));
        }
    };
    let results = results
        .into_iter()
        .map(|r| CaseResult {
            name: r.name,
            passed: r.passed,
            skipped: r.skipped,
            max_error: r.max_error,
            micros: r.micros,
            message: r.message,
        })
        .collect();
    Ok((results, store.into_data().gpu))
}
