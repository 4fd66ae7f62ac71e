//! What agent clients need from `wisp serve`, driven by real clients on loopback against
//! Qwen2.5-Coder-0.5B-Instruct (`tests/agents/*.py`, pytest): tool calls auto, required and
//! named through the `openai` package (streamed and not, results fed back; the 1.5B answering
//! from a result), over 30 tool
//! schemas whose calls validate on the CPU path and on the device, log-probabilities, several
//! choices, hostile tools, the Responses API, Anthropic's Messages API through the `anthropic`
//! package, and an agent loop of `openai-agents` calling a Python function.
//! Missing Python packages skip locally and fail under `CI=true` (`.ci/run` installs them).

mod pytest;

#[test]
fn agent_clients_get_tool_calls_logprobs_and_choices() {
    let suite = "the agent suite";
    if !pytest::python_has("openai, httpx, pytest, jsonschema, agents, anthropic", suite) {
        return;
    }
    let model = wisp::fetch::ensure(&wisp::fetch::QWEN25_CODER_05B, false).expect("fetching Qwen2.5-Coder-0.5B-Instruct");
    // Fetched once into the cache, as the 1.5B's own suite (tests/tests/qwen15.rs) does.
    let big = wisp::fetch::ensure(&wisp::fetch::QWEN25_CODER_15B, false).expect("fetching Qwen2.5-Coder-1.5B-Instruct");
    let bin = env!("CARGO_BIN_EXE_wisp");
    let env = [("WISP_BIN", bin.as_ref()), ("WISP_MODEL", model.as_ref()), ("WISP_MODEL_15", big.as_ref())];
    pytest::run(suite, "tests/agents", false, &env);
}
