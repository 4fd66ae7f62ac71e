//! The browser host (`web/`): the same guest `.wasm` in headless Chromium with WebGPU and JSPI,
//! held to the golden thresholds with the GPU on and off (`web/test/browser.test.mjs`), and the
//! conformance kit of the `gpu` interface against the browser's WebGPU host, which must pass,
//! and against deliberately broken ones, which must fail (`web/test/conformance.test.mjs`).
//! The package's API (`web/test/package.test.mjs`) must stream the native host's greedy texts,
//! which this test computes and hands over in `WISP_NATIVE_TEXTS`, and give the library's
//! embeddings of `tests/embeddings/texts.json`, to the bit.
//! The npm test skips what it cannot run locally and fails under `CI=true`.

use serde_json::{Value, json};
use std::path::Path;
use std::process::Command;
use wisp::conformance;
use wisp::{CpuBackend, GpuCtx, GpuMode, Pooling, Sampling};
use wisp_tests::{hardware_required, model, open, qwen_model, root};

/// The native host's greedy reply, on the CPU, to a chat (`messages`, through the model's
/// template, as `wisp serve` renders it) or to a text `prompt`: `{ text, finish, prompt_tokens,
/// steps }`, counted as the servers count them (the end-of-turn token is a step).
fn greedy(path: &Path, messages: Option<&[(String, String)]>, prompt: &str, max_tokens: u32) -> Value {
    let (mut inst, m) = open(path, GpuCtx::none(), GpuMode::Off);
    let tokens = match messages {
        Some(messages) => {
            let text = inst.apply_chat_template(m, messages, true).unwrap().unwrap();
            let mut tokens = inst.tokenize(m, &text, true, true).unwrap().unwrap();
            wisp_api::drop_doubled_bos(&mut tokens, inst.model_info(m).unwrap().bos);
            tokens
        }
        None => inst.tokenize(m, prompt, true, false).unwrap().unwrap(),
    };
    let s = inst.new_session(m, tokens.len() as u32 + max_tokens).unwrap().unwrap();
    inst.feed(s, &tokens).unwrap().unwrap();
    let (mut bytes, mut steps, mut finish) = (Vec::new(), 0, "length");
    while steps < max_tokens {
        let step = inst.next(s, &Sampling::default()).unwrap().unwrap();
        steps += 1;
        if step.end_of_generation {
            finish = "stop";
            break;
        }
        bytes.extend(step.piece);
    }
    json!({"text": String::from_utf8_lossy(&bytes), "finish": finish, "prompt_tokens": tokens.len(), "steps": steps})
}

/// The library's embeddings (mean pooling, the CPU) of the shared texts, with the tokens they
/// came to.
fn native_embeddings(path: &Path) -> Value {
    let texts: Vec<String> = serde_json::from_str(&std::fs::read_to_string(root().join("tests/embeddings/texts.json")).unwrap()).unwrap();
    let (mut inst, m) = open(path, GpuCtx::none(), GpuMode::Off);
    let tokens: Vec<Vec<u32>> = texts.iter().map(|t| inst.tokenize(m, t, true, false).unwrap().unwrap()).collect();
    let vectors = inst.embed(m, &tokens, Pooling::Mean).unwrap().unwrap();
    let prompt_tokens: usize = tokens.iter().map(Vec::len).sum();
    json!({"model": path.file_name().unwrap().to_string_lossy(), "texts": texts, "vectors": vectors, "prompt_tokens": prompt_tokens})
}

/// What the browser's API must give: a Qwen chat and a Gemma text completion, greedy, and the
/// Qwen's embeddings.
fn native_texts() -> Value {
    let messages = [
        ("system".to_string(), "You are a concise assistant.".to_string()),
        ("user".to_string(), "Write a Python function that returns the square of a number.".to_string()),
    ];
    let mut chat = greedy(qwen_model(), Some(&messages), "", 40);
    chat["model"] = json!(qwen_model().file_name().unwrap().to_string_lossy());
    chat["max_tokens"] = json!(40);
    chat["messages"] = messages.iter().map(|(role, content)| json!({"role": role, "content": content})).collect();
    let prompt = "Once upon a time, in a small village,";
    let mut completion = greedy(model(), None, prompt, 16);
    completion["prompt"] = json!(prompt);
    completion["max_tokens"] = json!(16);
    json!({"chat": chat, "completion": completion, "embeddings": native_embeddings(qwen_model())})
}

/// The seed of the kit in the browser (and of the native run it is compared with).
const KIT_SEED: u64 = 1;

#[test]
fn the_browser_host_passes_its_suite() {
    let web = root().join("web");
    if Command::new("npm").arg("--version").output().is_err() {
        assert!(!hardware_required(), "npm is missing, and CI=true requires the browser test");
        eprintln!("skipping: npm is not installed");
        return;
    }
    // The page serves the default model from wisp's cache.
    model();
    if !web.join("node_modules/.package-lock.json").exists() {
        let ok = Command::new("npm").args(["ci", "--no-audit", "--no-fund"]).current_dir(&web).status().unwrap();
        assert!(ok.success(), "npm ci failed in web/");
    }
    // The cases of the native kit, which the browser run must match one for one.
    let native = conformance::run(GpuCtx::new(Box::new(CpuBackend::new()), conformance::budget()), KIT_SEED).unwrap();
    let names: Vec<&str> = native.iter().map(|r| r.name.as_str()).collect();
    let out = Command::new("npm")
        .arg("test")
        .env("WISP_KIT_CASES", names.join(","))
        .env("KIT_SEED", KIT_SEED.to_string())
        .env("WISP_NATIVE_TEXTS", native_texts().to_string())
        .current_dir(&web)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success(), "the browser suite failed");
    // `npm test` ran both files, the kit's included.
    for test in [
        "golden teacher forcing with the GPU off",
        "every case of the kit passes on the browser host's WebGPU device",
        "a deliberately broken browser host fails the kit: perturbed-products",
        "generate follows a JSON schema, a regex and a grammar; a bad one is a typed error",
        "a streamed chat completion equals the native host's greedy text (Qwen2.5-Coder-0.5B-Instruct)",
        "cancelling mid-stream stops the generation; the engine goes on",
        "embeddings through the API are the library's, to the bit (Qwen2.5-Coder-0.5B-Instruct)",
        "a reload loads the model from the browser cache, with no request for the weights",
        "the main thread stays free while a 512-token prompt is prefilled",
        "the fallbacks: no JSPI or no WebGPU gives a notice and the CPU; the GPU in the worker",
        "the model goes to WebGPU a piece at a time: the guest's memory stays below the model's size",
        "npm pack of web/ installs into an empty project whose one-file page streams a completion",
    ] {
        assert!(text.contains(test), "`npm test` did not run \"{test}\"");
    }
    if hardware_required() {
        assert!(!text.contains("# SKIP"), "a browser test was skipped under CI=true");
    }
}
