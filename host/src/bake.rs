//! `wisp bake`: one self-contained `wasi:http/proxy` component that serves a model with the
//! OpenAI-compatible API of `wisp serve`, for platforms that run and scale such components
//! (`wasmtime serve`, Spin, wasmCloud).
//!
//! Made of three components of this build, composed with wac (`wac-graph`):
//! - the guest (`wisp_guest.wasm`, the engine every host runs), pre-initialized with the model
//!   loaded (wasmtime-wizer, see `preinit`): every instance the platform starts begins with the
//!   weights in its memory image, mapped copy-on-write where the runtime can;
//! - the HTTP front (`bake/http`), which imports the engine and exports
//!   `wasi:http/incoming-handler`;
//! - the provider of what the guest imports beyond the proxy world (`bake/virt`): a `gpu` with
//!   no device, and WASI's file system, environment, exit, terminals and insecure seed, all
//!   empty or refused (the pre-initialized guest reads no file).
//!
//! What the composition still imports is the proxy world's (`wasi:io`, `wasi:clocks`,
//! `wasi:random/random`, `wasi:cli/std*`, `wasi:http`); [`bake`] checks it.

use anyhow::{Context, Result, bail};
use std::path::Path;
use wac_graph::types::Package;
use wac_graph::{CompositionGraph, EncodeOptions, PackageId};

/// The HTTP front component (`bake/http`), built with the guest.
pub const HTTP_WASM: &[u8] = include_bytes!(env!("WISP_HTTP_WASM"));
/// The provider of the guest's imports outside the proxy world (`bake/virt`).
pub const VIRT_WASM: &[u8] = include_bytes!(env!("WISP_VIRT_WASM"));

/// The interfaces a `wasi:http/proxy` component may import (any 0.2 version).
pub const PROXY_IMPORTS: [&str; 11] = [
    "wasi:io/error",
    "wasi:io/poll",
    "wasi:io/streams",
    "wasi:clocks/monotonic-clock",
    "wasi:clocks/wall-clock",
    "wasi:random/random",
    "wasi:cli/stdout",
    "wasi:cli/stderr",
    "wasi:cli/stdin",
    "wasi:http/types",
    "wasi:http/outgoing-handler",
];

/// The model at `model` baked into a `wasi:http/proxy` component serving it: the guest
/// pre-initialized with it, composed with the HTTP front and the stubs. Instances of the result
/// read no file: the GGUF is parsed and its weights laid out here, once.
pub fn bake(model: &Path) -> Result<Vec<u8>> {
    let guest = crate::runtime::Wisp::preinitialized_guest(model)?;
    compose(&guest).context("composing the baked component")
}

/// `guest` (pre-initialized) composed with the front and the stubs.
fn compose(guest: &[u8]) -> Result<Vec<u8>> {
    let mut graph = CompositionGraph::new();
    let mut register = |name: &str, bytes: &[u8]| -> Result<PackageId> {
        let package = Package::from_bytes(name, None, bytes.to_vec(), graph.types_mut())
            .with_context(|| format!("reading the {name} component"))?;
        Ok(graph.register_package(package)?)
    };
    let virt = register("wisp:virt", VIRT_WASM)?;
    let guest = register("wisp:guest", guest)?;
    let front = register("wisp:http", HTTP_WASM)?;
    let (v, g, f) = (graph.instantiate(virt), graph.instantiate(guest), graph.instantiate(front));
    // Each import is taken from the first of `from` that exports it (by name, any 0.2 version
    // of a WASI interface); what none exports stays an import of the composition.
    let wire = |graph: &mut CompositionGraph, to: (PackageId, wac_graph::NodeId), from: &[(PackageId, wac_graph::NodeId)]| -> Result<()> {
        let imports: Vec<String> = graph.types()[graph[to.0].ty()].imports.keys().cloned().collect();
        for import in imports {
            let source = from.iter().find_map(|&(p, node)| {
                let exports = &graph.types()[graph[p].ty()].exports;
                let name = exports.keys().find(|e| wac_graph::types::are_semver_compatible(e, &import))?;
                Some((node, name.clone()))
            });
            if let Some((node, name)) = source {
                let export = graph.alias_instance_export(node, &name)?;
                graph.set_instantiation_argument(to.1, &import, export).with_context(|| format!("wiring {import}"))?;
            }
        }
        Ok(())
    };
    wire(&mut graph, (guest, g), &[(virt, v)])?;
    wire(&mut graph, (front, f), &[(guest, g), (virt, v)])?;
    let exports: Vec<String> = graph.types()[graph[front].ty()].exports.keys().cloned().collect();
    for name in exports {
        let export = graph.alias_instance_export(f, &name)?;
        graph.export(export, &name)?;
    }
    let bytes = graph.encode(EncodeOptions::default())?;
    let outside: Vec<String> = imports_and_exports(&bytes)?.0.into_iter().filter(|i| !in_proxy_world(i)).collect();
    if !outside.is_empty() {
        bail!("the composition imports {} outside the wasi:http/proxy world", outside.join(", "));
    }
    Ok(bytes)
}

/// Whether `import` (`ns:pkg/iface@version`) is one of the proxy world's.
pub fn in_proxy_world(import: &str) -> bool {
    let (name, version) = import.split_once('@').unwrap_or((import, ""));
    PROXY_IMPORTS.contains(&name) && version.starts_with("0.2.")
}

/// The names a component imports, and those it exports.
pub fn imports_and_exports(component: &[u8]) -> Result<(Vec<String>, Vec<String>)> {
    let mut types = wac_graph::types::Types::default();
    let package = Package::from_bytes("component", None, component.to_vec(), &mut types)?;
    let world = &types[package.ty()];
    Ok((world.imports.keys().cloned().collect(), world.exports.keys().cloned().collect()))
}

/// The memory image a runtime builds for a component's largest initialized memory (the baked
/// guest's): the bytes its active data segments hold, and the range of addresses they span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryImage {
    /// Bytes of data.
    pub data_bytes: u64,
    /// From the lowest address a segment writes to the end of the highest.
    pub span_bytes: u64,
}

impl MemoryImage {
    /// Whether wasmtime, with its default settings (`wasmtime serve`, wasmCloud, Spin), lays the
    /// data out as one image that each instance maps copy-on-write: the span under twice the
    /// data, or under the 16 MiB it always allows (`memory-guaranteed-dense-image-size`).
    /// Otherwise every instance writes the segments into its own memory.
    pub fn mapped_by_default(&self) -> bool {
        self.span_bytes < self.data_bytes.saturating_mul(2) || self.span_bytes < 16 << 20
    }
}

/// The largest memory image of `component`'s core modules (by data), if any has data.
pub fn memory_image(component: &[u8]) -> Result<Option<MemoryImage>> {
    use wasmparser::{ConstExpr, DataKind, Operator, Parser, Payload};
    let offset = |e: &ConstExpr| -> Result<u64> {
        let mut ops = e.get_operators_reader();
        match ops.read()? {
            Operator::I32Const { value } => Ok(u64::from(value as u32)),
            Operator::I64Const { value } => Ok(value as u64),
            other => bail!("a data segment's offset is {other:?}, not a constant"),
        }
    };
    let mut best: Option<MemoryImage> = None;
    // `parse_all` walks nested components and core modules alike: each data section is one
    // core module's.
    for payload in Parser::new(0).parse_all(component) {
        let Payload::DataSection(reader) = payload? else { continue };
        let (mut data, mut lo, mut hi) = (0u64, u64::MAX, 0u64);
        for segment in reader {
            let segment = segment?;
            if let DataKind::Active { offset_expr, .. } = segment.kind
                && !segment.data.is_empty()
            {
                let start = offset(&offset_expr)?;
                let len = segment.data.len() as u64;
                data += len;
                lo = lo.min(start);
                hi = hi.max(start + len);
            }
        }
        if data > best.map_or(0, |b| b.data_bytes) {
            best = Some(MemoryImage { data_bytes: data, span_bytes: hi - lo });
        }
    }
    Ok(best)
}
