//! Pre-initialization of the guest (wasmtime-wizer): the guest loads a model through its
//! `preload` export (world `inference-preinit`), and its memory is snapshotted into a new
//! component whose instances start with the model loaded. Compiled by wasmtime, that memory
//! image is mapped copy-on-write into each instance: the weights are in memory once, however
//! many instances run.

use crate::gpu::GpuCtx;
use crate::runtime::HostState;
use anyhow::{Context, Result, bail};
use std::path::Path;
use wasmtime::component::{Linker, Val};
use wasmtime::{Config, Engine, Store};

/// `component` (of the `inference-preinit` world) with the model at `guest_path` loaded, as a
/// new component. `dir` is the host directory the guest sees as the model's directory.
pub(crate) fn preinitialize(component: &[u8], dir: &Path, guest_path: &str) -> Result<Vec<u8>> {
    let mut config = Config::new();
    config.wasm_component_model(true);
    let engine = Engine::new(&config)?;
    let mut linker = Linker::<HostState>::new(&engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    crate::gpu::add_to_linker(&mut linker, HostState::gpu)?;
    // The guest's own memory cap does not apply to loading: the model must fit in wasm32's.
    let mut store = Store::new(&engine, HostState::new(GpuCtx::none(), Some(dir), usize::MAX)?);
    // The snapshot reads the guest's memory through a list returned to the host, larger than
    // the default cap on what one call may hand over (128 MiB). This is our own guest, once.
    store.set_hostcall_fuel(usize::MAX);
    let mut wizer = wasmtime_wizer::Wizer::new();
    wizer.init_func(format!("preload({})", wave_string(guest_path)));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (bytes, results) = runtime
        .block_on(wizer.run_component(&mut store, component, async |store, c| linker.instantiate_async(store, c).await))
        .map_err(anyhow::Error::from)
        .context("running the guest's preload")?;
    match results.first() {
        Some(Val::Result(Ok(_))) => Ok(bytes),
        Some(Val::Result(Err(Some(e)))) => match e.as_ref() {
            Val::String(why) => bail!("the guest could not load {guest_path}: {why}"),
            other => bail!("the guest's preload failed with {other:?}"),
        },
        other => bail!("the guest's preload returned {other:?}"),
    }
}

/// `s` as a WAVE string literal (how wizer reads the arguments of the init call).
fn wave_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn wave_strings_escape_quotes_backslashes_and_controls() {
        assert_eq!(super::wave_string("/model/a.gguf"), "\"/model/a.gguf\"");
        assert_eq!(super::wave_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u{a}\"");
    }
}
