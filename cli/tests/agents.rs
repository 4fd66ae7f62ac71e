//! What agent clients need from `wisp serve`, driven by real clients on loopback against
//! Qwen2.5-Coder-0.5B-Instruct (`tests/agents/*.py`, pytest): tool calls auto, required and
//! named through the `openai` package (streamed and not, results fed back; the 1.5B answering
//! from a result), over 30 tool
//! schemas whose calls validate on the CPU path and on the device, log-probabilities, several
//! choices, hostile tools, the Responses API, Anthropic's Messages API through the `anthropic`
//! package, an agent loop of `openai-agents` calling a Python function, and embeddings through
//! the `openai` package, the library's vectors to the bit (which this test computes and hands
//! over in `WISP_LIBRARY_EMBEDDINGS`, a file).
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
    let library = std::env::temp_dir().join(format!("wisp-library-embeddings-{}.json", std::process::id()));
    std::fs::write(&library, library_embeddings(&model).to_string()).unwrap();
    let env = [("WISP_BIN", bin.as_ref()), ("WISP_MODEL", model.as_ref()), ("WISP_MODEL_15", big.as_ref()), ("WISP_LIBRARY_EMBEDDINGS", library.as_os_str())];
    pytest::run(suite, "tests/agents", false, &env);
    let _ = std::fs::remove_file(library);
}

/// The library's embeddings of `tests/embeddings/texts.json` on the CPU, each pooling:
/// `{"texts": [...], "tokens": [[...]], "mean": [[...]], "last": ..., "cls": ...}`.
fn library_embeddings(model: &std::path::Path) -> serde_json::Value {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let texts: Vec<String> = serde_json::from_str(&std::fs::read_to_string(root.join("tests/embeddings/texts.json")).unwrap()).unwrap();
    let wisp = wisp::Wisp::new(wisp::Options::default()).unwrap();
    let mut inst = wisp.instantiate(wisp::GpuCtx::none(), model.parent()).unwrap();
    let m = inst.open_model(model, wisp::GpuMode::Off).unwrap().unwrap();
    let tokens: Vec<Vec<u32>> = texts.iter().map(|t| inst.tokenize(m, t, true, false).unwrap().unwrap()).collect();
    let mut out = serde_json::json!({"texts": texts, "tokens": tokens});
    for (pooling, name) in [(wisp::Pooling::Mean, "mean"), (wisp::Pooling::Last, "last"), (wisp::Pooling::Cls, "cls")] {
        out[name] = serde_json::json!(inst.embed(m, &tokens, pooling).unwrap().unwrap());
    }
    out
}
