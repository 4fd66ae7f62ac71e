//! Generated bindings of the `inference` world. Private: the crate re-exports a curated API.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "inference",
    imports: { default: trappable },
    with: {
        "wisp:llm/gpu.weight": crate::gpu::WeightHandle,
        "wisp:llm/gpu.kv-cache": crate::gpu::KvCacheHandle,
        "wisp:llm/gpu.program": crate::gpu::ProgramHandle,
    },
});

/// The `conformance` world (the kit in `tests/conformance`): its `gpu` import is the one above,
/// so that [`crate::GpuCtx`] serves both worlds.
pub mod conformance {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "conformance",
        with: {
            "wisp:llm/gpu": crate::bindings::wisp::llm::gpu,
        },
    });
}
