//! `wisp serve` driven by real clients on loopback: the `openai` Python package (unmodified),
//! schemathesis against `/openapi.json`, raw sockets for the hostile cases, and a bounded load
//! test (`tests/serve/*.py`, pytest). Missing Python packages skip locally and fail under
//! `CI=true` (`.ci/run` installs them).

mod pytest;

#[test]
fn the_server_passes_its_client_suite() {
    let suite = "the server's client suite";
    if !pytest::python_has("openai, httpx, pytest, schemathesis, jsonschema", suite) {
        return;
    }
    let model = wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).expect("fetching the default model");
    let bin = env!("CARGO_BIN_EXE_wisp");
    pytest::run(suite, "tests/serve", false, &[("WISP_BIN", bin.as_ref()), ("WISP_MODEL", model.as_ref())]);
}
