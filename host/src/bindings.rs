//! Generated bindings of the `inference` world. Private: the crate re-exports a curated API.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "inference",
    imports: { default: trappable },
    with: {
        "wisp:llm/gpu.weight": crate::gpu::WeightHandle,
    },
});
