//! The `wisp` CLI run as a user runs it, on the real default model.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The default model, fetched once for all tests of this binary.
fn model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).expect("fetching the default model"))
}

/// The second family's model (Qwen2.5-Coder-0.5B-Instruct), fetched once.
fn qwen_model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::QWEN25_CODER_05B, false).expect("fetching the Qwen model"))
}

fn wisp(args: &[&str]) -> Output {
    wisp_env(args, &[], &[])
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn golden() -> Value {
    let text = std::fs::read_to_string(root().join("tests/golden/gemma3-270m.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn tokenize_gives_llama_cpp_ids_for_every_golden_case() {
    let m = model().to_str().unwrap();
    for case in golden()["cases"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let o = wisp(&["tokenize", "--model", m, "--json", prompt]);
        assert!(o.status.success(), "{}", stderr(&o));
        let got: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        assert_eq!(got, case["prompt_tokens"], "case {}", case["name"]);
    }
}

#[test]
fn tokenize_prints_pieces_without_json() {
    let o = wisp(&["tokenize", "--model", model().to_str().unwrap(), "Hello world"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.lines().count() >= 3, "{out}");
    assert!(out.contains("\"<bos>\"") && out.contains("\" world\""), "{out}");
}

#[test]
fn eval_meets_the_golden_thresholds_on_the_cpu() {
    let golden = root().join("tests/golden/gemma3-270m.json");
    let m = model().to_str().unwrap();
    let o = wisp(&["eval", "--model", m, "--gpu", "off", "--golden", golden.to_str().unwrap(), "--json"]);
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stderr(&o)));
    for c in v["cases"].as_array().unwrap() {
        assert_eq!(c["pass"], true, "case failed: {c}");
        assert!(c["max_top5_diff"].as_f64().unwrap() <= 1.5);
        assert!(c["rmse"].as_f64().unwrap() <= 0.6);
        assert_eq!(c["steps"].as_array().unwrap()[0]["top"].as_array().unwrap().len(), 5);
    }
    assert_eq!(v["cases"].as_array().unwrap().len(), 7, "every case ran, long-gpl included");
    assert!(o.status.success(), "{}", stderr(&o));
    // As one batch: the same report, step for step (the CPU path is batch-invariant).
    let b = wisp(&["eval", "--model", m, "--gpu", "off", "--golden", golden.to_str().unwrap(), "--json", "--batched"]);
    let vb: Value = serde_json::from_str(stdout(&b).trim()).unwrap_or_else(|e| panic!("{e}: {}", stderr(&b)));
    assert_eq!(vb, v, "the cases as one batch");
    assert!(b.status.success(), "{}", stderr(&b));
}

#[test]
fn eval_fails_with_exit_3_when_the_reference_disagrees() {
    // A golden file whose continuation is wrong at a step with a large margin.
    let dir = tempdir("eval-fail");
    let mut g = golden();
    let case = &mut g["cases"][0];
    case["continuation"][0] = Value::from(12345);
    case["steps"][0]["top5"][0] = serde_json::json!([12345, 40.0]);
    let path = dir.join("bad.json");
    std::fs::write(&path, serde_json::to_string(&serde_json::json!({"cases": [case.clone()]})).unwrap()).unwrap();
    let o = wisp(&["eval", "--model", model().to_str().unwrap(), "--gpu", "off", "--golden", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}\n{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("FAIL"), "{}", stdout(&o));
}

#[test]
fn run_streams_a_sensible_continuation() {
    let o = wisp(&["run", "--temp", "0", "--model", model().to_str().unwrap(), "-n", "8", "The capital of France is"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("The capital of France is the capital of"), "{out}");
    assert!(stderr(&o).contains("decode:"), "{}", stderr(&o));
}

#[test]
fn run_with_sampling_is_reproducible_by_seed() {
    let m = model().to_str().unwrap();
    let args = ["run", "--model", m, "-n", "12", "--temp", "0.9", "--seed", "7", "Once upon a time"];
    let a = wisp(&args);
    let b = wisp(&args);
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(stdout(&a), stdout(&b));
}

#[test]
fn embed_prints_the_librarys_vectors_and_their_similarities() {
    let m = model().to_str().unwrap();
    let texts = ["A cat sat on the mat.", "Stocks fell sharply."];
    let o = wisp(&["embed", "--model", m, "--gpu", "off", "--pooling", "last", "--json", texts[0], texts[1]]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let got: Vec<Vec<f32>> = v["data"].as_array().unwrap().iter().map(|d| d["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect();
    // The library's, to the bit.
    let w = wisp::Wisp::new(wisp::Options::default()).unwrap();
    let mut inst = w.instantiate(wisp::GpuCtx::none(), model().parent()).unwrap();
    let mm = inst.open_model(model(), wisp::GpuMode::Off).unwrap().unwrap();
    let tokens: Vec<Vec<u32>> = texts.iter().map(|t| inst.tokenize(mm, t, true, false).unwrap().unwrap()).collect();
    assert_eq!(got, inst.embed(mm, &tokens, wisp::Pooling::Last).unwrap().unwrap());
    assert_eq!(v["usage"]["prompt_tokens"], tokens.iter().map(Vec::len).sum::<usize>());
    // One text a line from stdin, and the similarities as text.
    let mut child = Command::new(env!("CARGO_BIN_EXE_wisp"))
        .args(["embed", "--model", m, "--gpu", "off", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), format!("{}\n\n{}\n", texts[0], texts[1]).as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("cosine similarity (mean pooling)") && out.contains(" 1.000") && out.lines().count() == 6, "{out}");
    let o = wisp(&["embed", "--model", m, "--pooling", "max", "x"]);
    assert!(!o.status.success() && stderr(&o).contains("max"), "{}", stderr(&o));
}

#[test]
fn info_reports_the_model() {
    let o = wisp(&["info", "--model", model().to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["architecture"], "gemma3");
    assert_eq!(v["n_vocab"], 262144);
    assert_eq!(v["n_layers"], 18);
    assert_eq!(v["file_bytes"], 253113024);
    let types: Vec<&str> = v["tensor_types"].as_array().unwrap().iter().map(|t| t["type"].as_str().unwrap()).collect();
    for t in ["F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"] {
        assert!(types.contains(&t), "{types:?}");
    }
    let text = wisp(&["info", "--model", model().to_str().unwrap()]);
    assert!(stdout(&text).contains("architecture: gemma3"), "{}", stdout(&text));
}

/// The device `wisp info` reports the model placed on: `(name, backend)`, or `None`.
fn info_device(args: &[&str], env: &[(&str, &std::ffi::OsStr)], remove: &[&str]) -> Option<(String, String)> {
    let m = model();
    let mut all = vec!["info", "--model", m.to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    let o = wisp_env(&all, env, remove);
    assert!(o.status.success(), "{all:?}: {}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let d = &v["device"];
    d["name"].as_str().map(|n| (n.to_string(), d["backend"].as_str().unwrap_or_default().to_string()))
}

#[test]
fn the_default_device_is_the_native_cpu_where_wgpu_finds_no_gpu() {
    let wgpu = info_device(&["--device", "wgpu"], &[], &["WISP_ADAPTER"]);
    let auto = info_device(&[], &[], &["WISP_ADAPTER"]).expect("a device by default");
    // Mesa's software rasterizers (lavapipe's llvmpipe, softpipe) are CPU adapters.
    let software = wgpu.as_ref().is_none_or(|(name, _)| name.contains("llvmpipe") || name.contains("softpipe"));
    if software {
        assert_eq!(auto.1, "native", "wgpu offers {wgpu:?}: the default should be the native device, not {auto:?}");
        assert!(auto.0.starts_with("native CPU ("), "{auto:?}");
        if let Some((name, backend)) = &wgpu {
            // Named, the software adapter is what the default takes.
            let named = info_device(&[], &[("WISP_ADAPTER", std::ffi::OsStr::new("llvmpipe"))], &[]);
            assert_eq!(named.as_ref().map(|d| &d.1), Some(backend), "WISP_ADAPTER=llvmpipe: {named:?}, not {name}");
        }
    } else {
        assert_eq!(Some(&auto), wgpu.as_ref(), "a GPU adapter is the default device");
    }
}

#[test]
fn bench_prints_speeds() {
    let o = wisp(&[
        "bench", "--model", model().to_str().unwrap(), "--runs", "1", "--prompt-tokens", "16", "--decode-tokens", "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    for key in ["prefill_tok_s", "decode_tok_s", "load_s"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key} in {v}");
    }
    assert_eq!(v["prompt_tokens"], 16);
}

#[test]
fn fetch_prints_the_cached_model() {
    let path = model();
    let o = wisp(&["fetch"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(Path::new(stdout(&o).trim()), path);
    let o = wisp(&["fetch", "no-such-model"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("unknown model"), "{}", stderr(&o));
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wisp-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn bad_model_paths_fail_with_one_line() {
    let dir = tempdir("bad");
    let not_gguf = dir.join("notes.gguf");
    std::fs::write(&not_gguf, b"this is not a model file at all").unwrap();
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let missing = dir.join("missing.gguf");
    // A pipe: reading it would block until someone writes.
    let fifo = dir.join("pipe.gguf");
    let _ = std::fs::remove_file(&fifo);
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let mut cases = vec![
        (missing.clone(), 1, format!("cannot open model {}", missing.display())),
        (dir.clone(), 1, format!("{} is a directory, not a GGUF file", dir.display())),
        (fifo.clone(), 1, format!("{} is not a regular file", fifo.display())),
        // A device: reading it would never end.
        (PathBuf::from("/dev/zero"), 1, "/dev/zero is not a regular file".to_string()),
        (not_gguf.clone(), 2, "bad magic".to_string()),
        (empty.clone(), 2, "file of 0 bytes is too short to be GGUF".to_string()),
    ];
    // A file without read permission (root reads it anyway: then there is nothing to test).
    let unreadable = dir.join("secret.gguf");
    std::fs::write(&unreadable, b"GGUF").unwrap();
    std::fs::set_permissions(&unreadable, std::os::unix::fs::PermissionsExt::from_mode(0o000)).unwrap();
    if std::fs::File::open(&unreadable).is_err() {
        cases.push((unreadable.clone(), 1, format!("cannot open model {}", unreadable.display())));
    }
    for (path, code, needle) in cases {
        let start = std::time::Instant::now();
        let o = wisp(&["run", "--gpu", "off", "--model", path.to_str().unwrap(), "hi"]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(code), "{}: {err}", path.display());
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(err.starts_with("wisp: error: ") && err.contains(&needle), "{}: want {needle:?}: {err}", path.display());
        assert!(stdout(&o).is_empty(), "{}: {}", path.display(), stdout(&o));
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "{}: took {:?}", path.display(), start.elapsed());
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bake_refuses_what_it_cannot_bake_in_one_line() {
    let dir = tempdir("bake");
    let not_gguf = dir.join("notes.gguf");
    std::fs::write(&not_gguf, b"this is not a model file at all").unwrap();
    let out = dir.join("notes.http.wasm");
    let nowhere = dir.join("no/such/dir/x.http.wasm");
    let cases = [
        (not_gguf.clone(), out.clone(), format!("cannot bake {}", not_gguf.display()), "bad magic".to_string()),
        (dir.join("missing.gguf"), out.clone(), "cannot open model".to_string(), "missing.gguf".to_string()),
        // Said before the model is read, not after the bake.
        (not_gguf.clone(), nowhere.clone(), format!("cannot write {}", nowhere.display()), "is not a directory".to_string()),
    ];
    for (model, output, a, b) in cases {
        let o = wisp(&["bake", "--model", model.to_str().unwrap(), "-o", output.to_str().unwrap()]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(err.starts_with("wisp: error: ") && err.contains(&a) && err.contains(&b), "want {a:?} and {b:?}: {err}");
        assert!(!output.exists(), "{} was written", output.display());
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn help_has_examples_for_every_subcommand() {
    for sub in ["run", "eval", "bench", "tokenize", "info", "fetch", "chat", "conformance", "serve", "bake"] {
        let o = wisp(&[sub, "--help"]);
        assert!(o.status.success());
        assert!(stdout(&o).contains("Examples:"), "{sub}: {}", stdout(&o));
    }
    let o = wisp(&["--help"]);
    for sub in ["run", "eval", "bench", "tokenize", "info", "fetch", "chat", "conformance", "serve", "bake"] {
        assert!(stdout(&o).contains(sub));
    }
    // Every command that runs a model takes the precision of its products.
    for sub in ["run", "eval", "bench", "info", "chat", "conformance", "serve"] {
        let o = wisp(&[sub, "--help"]);
        assert!(stdout(&o).contains("--precision <PRECISION>") && stdout(&o).contains("fast"), "{sub}: {}", stdout(&o));
    }
    let o = wisp(&["run", "--precision", "sloppy", "hello"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("'sloppy'") && stderr(&o).contains("exact, fast"), "{}", stderr(&o));
}

#[test]
fn chat_answers_one_message_with_the_models_template() {
    let m = qwen_model().to_str().unwrap();
    let system = "You are a helpful assistant.";
    let o = wisp(&["chat", "--temp", "0", "--model", m, "--gpu", "off", "--system", system, "-n", "24", "What does HTTP status 404 mean?"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The greedy reply of the golden `chat` case, whose prompt is this conversation rendered.
    let out = stdout(&o);
    assert!(out.starts_with("HTTP status 404 typically indicates that the requested resource"), "{out}");
    assert!(stderr(&o).contains("stopped after 24 tokens"), "{}", stderr(&o));
}

#[test]
fn chat_stops_at_the_end_of_the_turn() {
    let m = qwen_model().to_str().unwrap();
    let o = wisp(&["chat", "--temp", "0", "--model", m, "--gpu", "off", "-n", "64", "Reply with the single word: yes"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).to_lowercase().contains("yes"), "{}", stdout(&o));
    assert!(!stderr(&o).contains("stopped after"), "{}", stderr(&o));
    assert!(!stdout(&o).contains("<|im_end|>"), "{}", stdout(&o));
}

#[test]
fn chat_reads_a_conversation_from_stdin() {
    use std::io::Write;
    let m = qwen_model().to_str().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_wisp"))
        .args(["chat", "--temp", "0", "--model", m, "--gpu", "off", "-n", "48", "--stats"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let input = "My name is Ada. Reply with one short sentence.\nWhat is my name? Reply with the name only.\n/reset\nReply with the single word: yes\n";
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let replies: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(replies.len() >= 3, "{out}");
    // The second turn sees the first (the cache carries over: only the new turn is fed).
    assert!(out.contains("Ada"), "{out}");
    let err = stderr(&o);
    let turns: Vec<&str> = err.lines().filter(|l| l.starts_with("[prompt ")).collect();
    assert_eq!(turns.len(), 3, "{err}");
    let fed = |l: &str| l.split_whitespace().nth(1).and_then(|n| n.parse::<u32>().ok()).unwrap();
    assert!(fed(turns[1]) < fed(turns[0]), "the second turn feeds only what is new: {err}");
}

#[test]
fn conformance_passes_on_the_cpu_reference_and_skips_without_a_device() {
    let o = wisp(&["conformance", "--device", "cpu", "--seed", "1", "--json", "--no-golden"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!((v["failed"].as_u64(), v["skipped"].as_u64()), (Some(0), Some(0)), "{v}");
    assert!(v["passed"].as_u64().unwrap() > 25, "{v}");
    assert_eq!((&v["golden"], &v["pass"]), (&Value::Null, &Value::Bool(true)), "--no-golden: {v}");
    let o = wisp(&["conformance", "--device", "none", "--no-golden"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("skip matmul-q4x32: no device"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("golden check"), "{}", stdout(&o));
}

/// The native CPU device: the whole kit with no failure and no skip, then every golden case
/// in both precisions (`fast`: its int8 activations within the golden thresholds).
#[test]
fn conformance_passes_on_the_native_device_in_both_precisions() {
    model();
    for precision in ["exact", "fast"] {
        let o = wisp(&["conformance", "--device", "native", "--threads", "2", "--seed", "1", "--json", "--precision", precision]);
        assert!(o.status.success(), "{precision}: {}{}", stdout(&o), stderr(&o));
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!((v["failed"].as_u64(), v["skipped"].as_u64()), (Some(0), Some(0)), "{v}");
        let g = &v["golden"];
        assert_eq!(g["precision"], precision, "{g}");
        assert!(g["device"].as_str().unwrap().starts_with("native CPU ("), "{g}");
        assert!(g["gpu_weights"].as_u64().unwrap() > 0, "the guest put no weight on the device: {g}");
        assert_eq!((g["failed"].as_u64(), &v["pass"]), (Some(0), &Value::Bool(true)), "{v}");
        assert!(g["passed"].as_u64().unwrap() >= 7, "{g}");
    }
}

#[test]
fn conformance_runs_the_golden_check_after_the_kit_on_the_same_device() {
    model();
    let o = wisp(&["conformance", "--device", "cpu", "--seed", "1", "--golden-cases", "capital,unicode"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    // The kit's table, then the golden check's, through the CPU reference device.
    let kit = out.find("host-usage-after-kit").expect("the kit's table");
    let golden = out.find("golden check: ").expect("the golden table");
    assert!(kit < golden, "{out}");
    assert!(out.contains("device: wisp CPU reference (cpu, cpu), "), "{out}");
    for case in ["capital", "unicode"] {
        let line = out.lines().find(|l| l.starts_with(case)).unwrap_or_else(|| panic!("no line for {case}: {out}"));
        assert!(line.contains(" pass "), "{line}");
    }
    assert!(out.trim_end().ends_with("2 passed, 0 failed"), "{out}");

    // `fast` held to the same thresholds (the CPU reference computes it exactly).
    let o = wisp(&["conformance", "--device", "cpu", "--seed", "1", "--json", "--golden-cases", "unicode", "--precision", "fast"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let g = &v["golden"];
    assert_eq!(g["precision"], "fast", "{g}");
    assert_eq!((g["passed"].as_u64(), g["failed"].as_u64(), &v["pass"]), (Some(1), Some(0), &Value::Bool(true)), "{v}");
    assert!(g["gpu_weights"].as_u64().unwrap() > 0, "the guest put no weight on the device: {g}");
    assert!(g["device"].as_str().unwrap().starts_with("wisp CPU reference"), "{g}");
    let case = &g["cases"][0];
    assert_eq!((case["name"].as_str(), case["pass"].as_bool(), case["steps"].as_u64()), (Some("unicode"), Some(true), Some(16)), "{case}");
    assert!(case["rmse"].as_f64().unwrap() <= 0.6 && case["max_top5_diff"].as_f64().unwrap() <= 1.5, "{case}");

    // On the guest's CPU (no device) `fast` is its int8 products: within the golden thresholds,
    // and not exact (`exact` is there within ~3e-4 of the reference).
    for (precision, lo, hi) in [("fast", 0.01, 0.6), ("exact", 0.0, 0.005)] {
        let o = wisp(&["conformance", "--device", "none", "--json", "--golden-cases", "unicode,code", "--precision", precision]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        let g = &v["golden"];
        assert_eq!((g["precision"].as_str(), g["passed"].as_u64(), g["failed"].as_u64()), (Some(precision), Some(2), Some(0)), "{g}");
        for case in g["cases"].as_array().unwrap() {
            let rmse = case["rmse"].as_f64().unwrap();
            assert!(lo < rmse && rmse <= hi, "{precision}: {case}");
        }
    }
}

#[test]
fn conformance_fails_with_exit_code_3_when_a_golden_case_fails() {
    model();
    // The `unicode` case with every reference top-5 logit moved by 5: the engine is right, the
    // reference is not, and the check must say so.
    let mut g = golden();
    let cases = g["cases"].as_array_mut().unwrap();
    cases.retain(|c| c["name"] == "unicode");
    for step in cases[0]["steps"].as_array_mut().unwrap() {
        for pair in step["top5"].as_array_mut().unwrap() {
            pair[1] = Value::from(pair[1].as_f64().unwrap() + 5.0);
        }
    }
    let dir = tempdir("golden-off");
    let file = dir.join("off.json");
    std::fs::write(&file, serde_json::to_string(&g).unwrap()).unwrap();
    let o = wisp(&["conformance", "--device", "cpu", "--seed", "1", "--golden", file.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).lines().any(|l| l.starts_with("unicode") && l.contains(" FAIL ")), "{}", stdout(&o));
    assert!(stderr(&o).contains("conformance failed: golden unicode"), "{}", stderr(&o));
    // The kit itself passed: 28 cases, none failed.
    assert!(stdout(&o).contains(" passed, 0 failed, 0 skipped"), "{}", stdout(&o));
    let o = wisp(&["conformance", "--device", "cpu", "--golden-cases", "no-such-case"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("has no case \"no-such-case\"; its cases: capital, story"), "{}", stderr(&o));
}

/// A JSON schema written to a file of the test's own directory.
fn schema_file(name: &str, schema: &Value) -> PathBuf {
    let path = tempdir(name).join("schema.json");
    std::fs::write(&path, schema.to_string()).unwrap();
    path
}

#[test]
fn run_and_chat_follow_a_json_schema() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "job": {"enum": ["engineer", "doctor", "artist"]}
        },
        "required": ["name", "age", "job"],
        "additionalProperties": false
    });
    let file = schema_file("json-schema", &schema);
    let m = model().to_str().unwrap();
    let prompt = "Describe Alice, a 30 year old engineer, as JSON:";
    let o = wisp(&["run", "--temp", "0", "--model", m, "--json-schema", file.to_str().unwrap(), "-n", "64", prompt]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let v: Value = serde_json::from_str(out.strip_prefix(prompt).unwrap().trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(v["name"].is_string() && v["age"].as_u64().is_some_and(|a| a <= 150), "{v}");
    assert!(["engineer", "doctor", "artist"].contains(&v["job"].as_str().unwrap()), "{v}");
    // The properties in the schema's order, written compactly.
    assert!(out.contains("{\"name\":\""), "{out}");
    // A chat reply too.
    let o = wisp(&["chat", "--temp", "0", "--model", m, "--json-schema", file.to_str().unwrap(), "-n", "64", "Describe Bob, a doctor aged 52."]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));
    assert!(v["age"].is_u64() && v["job"].is_string(), "{v}");
}

#[test]
fn run_follows_a_regex_and_a_lark_grammar() {
    let m = model().to_str().unwrap();
    let o = wisp(&["run", "--temp", "0", "--model", m, "--regex", "[0-9]{3}-[0-9]{4}", "-n", "20", "Her phone number is"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let number = out.strip_prefix("Her phone number is").unwrap().trim_end();
    assert!(number.len() == 8 && number.as_bytes()[3] == b'-', "{out}");
    assert!(number.chars().filter(|c| c.is_ascii_digit()).count() == 7, "{out}");
    let grammar = tempdir("lark").join("answer.lark");
    std::fs::write(&grammar, "start: ANSWER \" because \" REASON \".\"\nANSWER: \"yes\" | \"no\"\nREASON: /[a-z ]{1,40}/\n").unwrap();
    let o = wisp(&["chat", "--temp", "0", "--model", m, "--grammar", grammar.to_str().unwrap(), "-n", "40", "Is water wet?"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let reply = out.trim_end();
    assert!(reply.starts_with("yes because ") || reply.starts_with("no because "), "{out}");
    assert!(reply.ends_with('.'), "{out}");
}

/// RELIABILITY 36 through the CLI: every bad constraint is one line on stderr and exit code 2;
/// a dead end ends the output with a notice and exit code 0.
#[test]
fn bad_constraints_fail_with_one_line() {
    let m = model().to_str().unwrap();
    let big: Vec<String> = (0..3000).map(|i| format!("{}{i}", "x".repeat(100))).collect();
    let cases: Vec<(&str, Value, &str)> = vec![
        ("unsatisfiable", serde_json::json!({"type": "integer", "minimum": 5, "maximum": 3}), "does not compile"),
        ("unknown-type", serde_json::json!({"type": "nonsense"}), "does not compile"),
        ("too-big", serde_json::json!({"enum": big}), "over the limit of 262144"),
    ];
    for (name, schema, words) in cases {
        let file = schema_file(name, &schema);
        let o = wisp(&["run", "--temp", "0", "--model", m, "--json-schema", file.to_str().unwrap(), "-n", "4", "Hi"]);
        let err = stderr(&o);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        assert_eq!(lines.len(), 1, "{name}: {err}");
        assert!(lines[0].starts_with("wisp: error: invalid constraint:") && lines[0].contains(words), "{name}: {err}");
    }
    let not_json = tempdir("not-json").join("schema.json");
    std::fs::write(&not_json, "{\"type\": ").unwrap();
    let o = wisp(&["run", "--temp", "0", "--model", m, "--json-schema", not_json.to_str().unwrap(), "Hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("not JSON"), "{}", stderr(&o));
    let o = wisp(&["run", "--temp", "0", "--model", m, "--regex", "(unclosed", "Hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("regular expression does not compile"), "{}", stderr(&o));
    // A grammar that a step cannot follow (a lexer past its limits): an error, not a hang.
    let start = std::time::Instant::now();
    let o = wisp(&["run", "--temp", "0", "--model", m, "--regex", "(\\w+\\s?){1000}", "-n", "32", "Hello"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("invalid constraint"), "{}", stderr(&o));
    assert!(start.elapsed().as_secs() < 60);
    // A missing file, and two constraints at once.
    let o = wisp(&["run", "--temp", "0", "--model", m, "--grammar", "/no/such/file.lark", "Hi"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot read /no/such/file.lark"), "{}", stderr(&o));
    let o = wisp(&["run", "--temp", "0", "--model", m, "--regex", "a", "--grammar", "x.lark", "Hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot be used with"), "{}", stderr(&o));
    // No text matches: the generation ends at once, saying why.
    let o = wisp(&["run", "--temp", "0", "--model", m, "--regex", "[^\\s\\S]", "-n", "8", "Hello"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim_end(), "Hello");
    assert!(stderr(&o).contains("the constraint admits no further token"), "{}", stderr(&o));
}

#[test]
fn bench_times_decoding_under_a_constraint() {
    let file = schema_file("bench", &serde_json::json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}}));
    let o = wisp(&[
        "bench", "--model", model().to_str().unwrap(), "--runs", "1", "--prompt-tokens", "8", "--decode-tokens", "8",
        "--json-schema", file.to_str().unwrap(), "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let c = &v["constrained"];
    for key in ["ms_per_token", "unconstrained_ms_per_token", "ratio", "first_compile_ms"] {
        assert!(c[key].as_f64().is_some_and(|x| x > 0.0), "{key} in {c}");
    }
    assert!(c["compiles"].as_u64().is_some_and(|n| n >= 1), "{c}");
}

/// `wisp` with extra environment variables.
fn wisp_env(args: &[&str], env: &[(&str, &std::ffi::OsStr)], remove: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wisp"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    for k in remove {
        cmd.env_remove(k);
    }
    cmd.output().expect("running wisp")
}

/// The seed a run printed with its statistics.
fn printed_seed(o: &Output) -> String {
    let err = stderr(o);
    err.rsplit("| seed ").next().map(|s| s.trim().to_string()).filter(|s| s.parse::<u64>().is_ok()).unwrap_or_else(|| panic!("no seed in {err}"))
}

#[test]
fn run_samples_as_llama_cpp_by_default_and_says_so() {
    let help = stdout(&wisp(&["run", "--help"]));
    for default in ["--temp <TEMPERATURE>", "[default: 0.8]", "[default: 40]", "[default: 0.95]", "[default: 0.05]", "--temp 0 is greedy"] {
        assert!(help.contains(default), "{default:?} in {help}");
    }
    let chat_help = stdout(&wisp(&["chat", "--help"]));
    assert!(chat_help.contains("[default: 0.8]"), "{chat_help}");
    // Two runs without a seed sample with different random seeds; the printed seed repeats a run.
    let m = model().to_str().unwrap();
    let args = ["run", "--model", m, "--gpu", "off", "-n", "24", "Once upon a time"];
    let (a, b) = (wisp(&args), wisp(&args));
    assert!(a.status.success() && b.status.success(), "{}", stderr(&a));
    assert_ne!(printed_seed(&a), printed_seed(&b), "{}\n{}", stderr(&a), stderr(&b));
    let seed = printed_seed(&a);
    let again = wisp(&["run", "--model", m, "--gpu", "off", "-n", "24", "--seed", &seed, "Once upon a time"]);
    assert_eq!(stdout(&again), stdout(&a), "the printed seed repeats the run");
    // Sampling is not greedy: across a few seeds, some text differs from the greedy one.
    let greedy = stdout(&wisp(&["run", "--model", m, "--gpu", "off", "-n", "24", "--temp", "0", "Once upon a time"]));
    let sampled: Vec<String> = ["1", "2", "3"]
        .iter()
        .map(|s| stdout(&wisp(&["run", "--model", m, "--gpu", "off", "-n", "24", "--seed", s, "Once upon a time"])))
        .collect();
    assert!(sampled.iter().any(|t| *t != greedy), "{greedy:?} {sampled:?}");
}

#[test]
fn run_reads_the_prompt_from_a_file_or_standard_input() {
    use std::io::Write;
    let m = model().to_str().unwrap();
    let base = ["run", "--model", m, "--gpu", "off", "--temp", "0", "-n", "8"];
    let expected = stdout(&wisp(&[&base[..], &["The capital of France is"]].concat()));
    assert!(expected.starts_with("The capital of France is the capital of"), "{expected}");
    let dir = tempdir("prompt-file");
    // An editor's final newline is not part of the prompt.
    let file = dir.join("prompt.txt");
    std::fs::write(&file, "The capital of France is\n").unwrap();
    for flag in ["-f", "--file"] {
        let o = wisp(&[&base[..], &[flag, file.to_str().unwrap()]].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(stdout(&o), expected);
    }
    for stdin_args in [&["-"][..], &["-f", "-"][..]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_wisp"))
            .args([&base[..], stdin_args].concat())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(b"The capital of France is\n").unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "{stdin_args:?}: {}", stderr(&o));
        assert_eq!(stdout(&o), expected, "{stdin_args:?}");
    }
    // Only the continuation.
    let o = wisp(&[&base[..], &["--no-display-prompt", "-f", file.to_str().unwrap()]].concat());
    assert_eq!(stdout(&o), expected.strip_prefix("The capital of France is").unwrap());
    // Errors: an empty file, a missing one, a prompt and a file at once, neither.
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "\n").unwrap();
    let missing = dir.join("missing.txt");
    for (args, code, needle) in [
        (vec!["-f", empty.to_str().unwrap()], 1, format!("the prompt from {} is empty", empty.display())),
        (vec!["-f", missing.to_str().unwrap()], 1, format!("cannot read the prompt from {}", missing.display())),
        (vec!["-f", file.to_str().unwrap(), "Hello"], 2, "cannot be used with".to_string()),
        (vec![], 2, "required".to_string()),
    ] {
        let o = wisp(&[&base[..], &args[..]].concat());
        assert_eq!(o.status.code(), Some(code), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(&needle), "{args:?}: want {needle:?}: {}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{args:?}: {}", stdout(&o));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The entries of a cache directory, hidden scratch directories included.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn fetch_into_an_empty_cache_prints_only_the_path() {
    let cache = tempdir("fetch-empty");
    let o = wisp_env(&["fetch", "gemma3-270m"], &[("WISP_CACHE", cache.as_os_str())], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let path = cache.join(wisp::fetch::GEMMA3_270M.file);
    assert_eq!(stdout(&o), format!("{}\n", path.display()), "stderr: {}", stderr(&o));
    // pip's own lines stay out of both streams; wisp says what it fetched, on stderr.
    assert!(!stderr(&o).contains("Collecting") && !stderr(&o).contains("Successfully installed"), "{}", stderr(&o));
    assert!(stderr(&o).contains("sha256 ok"), "{}", stderr(&o));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), wisp::fetch::GEMMA3_270M.bytes);
    // The file and its checksum marker, no scratch directory left behind.
    assert_eq!(entries(&cache), [wisp::fetch::GEMMA3_270M.file.to_string(), format!("{}.sha256", wisp::fetch::GEMMA3_270M.file)]);
    // Cached: the path again, at once.
    let o = wisp_env(&["fetch"], &[("WISP_CACHE", cache.as_os_str())], &[]);
    assert_eq!(stdout(&o), format!("{}\n", path.display()));
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    std::fs::remove_dir_all(&cache).ok();
}

#[test]
fn run_without_the_model_writes_only_text_to_stdout() {
    let args = ["run", "--gpu", "off", "--temp", "0", "-n", "8", "The capital of France is"];
    let cached = wisp(&["run", "--model", model().to_str().unwrap(), "--gpu", "off", "--temp", "0", "-n", "8", "The capital of France is"]);
    let cache = tempdir("run-empty");
    let o = wisp_env(&args, &[("WISP_CACHE", cache.as_os_str())], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), stdout(&cached), "stderr: {}", stderr(&o));
    assert!(stdout(&o).starts_with("The capital of France is the capital of"), "{}", stdout(&o));
    std::fs::remove_dir_all(&cache).ok();
}

/// Without pip, python3 or a network, fetching fails with one line that says which, writes
/// nothing to stdout and leaves nothing in the cache.
#[test]
fn fetch_failures_are_one_line() {
    let check = |name: &str, o: &Output, cache: &Path, needle: &str| {
        let err = stderr(o);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(o.status.code(), Some(1), "{name}: {err}");
        assert_eq!(lines.len(), 1, "{name}: one line: {err}");
        assert!(lines[0].starts_with("wisp: error: ") && lines[0].contains(needle), "{name}: want {needle:?}: {err}");
        assert!(stdout(o).is_empty(), "{name}: {}", stdout(o));
        assert!(entries(cache).is_empty(), "{name}: left {:?}", entries(cache));
    };
    // No network: an index nobody listens on (and no local wheels, no cached responses).
    let cache = tempdir("fetch-offline");
    let start = std::time::Instant::now();
    let o = wisp_env(
        &["fetch"],
        &[
            ("WISP_CACHE", cache.as_os_str()),
            ("PIP_INDEX_URL", "http://127.0.0.1:9/simple".as_ref()),
            ("PIP_NO_CACHE_DIR", "1".as_ref()),
            ("PIP_RETRIES", "1".as_ref()),
            ("PIP_CONFIG_FILE", "/dev/null".as_ref()),
        ],
        &["PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"],
    );
    check("offline", &o, &cache, "the package index is unreachable (no network?)");
    assert!(start.elapsed().as_secs() < 120, "took {:?}", start.elapsed());
    // A Python without pip (a virtual environment made without it).
    let venv = tempdir("venv-without-pip");
    let made = Command::new("python3").args(["-m", "venv", "--without-pip"]).arg(&venv).status().expect("python3");
    assert!(made.success(), "python3 -m venv --without-pip failed");
    let path = format!("{}:{}", venv.join("bin").display(), std::env::var("PATH").unwrap_or_default());
    let o = wisp_env(&["fetch"], &[("WISP_CACHE", cache.as_os_str()), ("PATH", path.as_ref())], &[]);
    check("no pip", &o, &cache, "needs pip, and this Python 3 has none");
    // No python3 at all.
    let empty_bin = tempdir("no-python");
    let o = wisp_env(&["fetch"], &[("WISP_CACHE", cache.as_os_str()), ("PATH", empty_bin.as_os_str())], &[]);
    check("no python3", &o, &cache, "`python3` is not on the PATH");
    for d in [cache, venv, empty_bin] {
        std::fs::remove_dir_all(&d).ok();
    }
}

#[test]
fn chat_without_a_model_uses_an_instruction_model_and_names_a_built_in_template() {
    // The default chat model is the instruction-tuned Qwen (fetched by then: the same cache).
    qwen_model();
    let o = wisp(&["chat", "--gpu", "off", "--temp", "0", "-n", "16", "Reply with the single word: yes"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).to_lowercase().contains("yes"), "{}", stdout(&o));
    assert!(!stderr(&o).contains("chat template"), "{}", stderr(&o));
    // A base model without a template: one line names the built-in template used.
    let m = model().to_str().unwrap();
    let o = wisp(&["chat", "--model", m, "--gpu", "off", "--temp", "0", "-n", "4", "Hi"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let notices: Vec<&str> = err.lines().filter(|l| l.contains("chat template")).collect();
    assert_eq!(notices.len(), 1, "{err}");
    assert!(notices[0].contains("has no chat template of its own: using the built-in `gemma` template"), "{}", notices[0]);
    // --chat-template by name or file: no notice, the template shown with --show-prompt.
    let dir = tempdir("chat-template");
    let file = dir.join("plain.jinja");
    std::fs::write(&file, "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:").unwrap();
    for (template, rendered) in [("chatml", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), (file.to_str().unwrap(), "user: Hi\nassistant:")] {
        let o = wisp(&["chat", "--model", m, "--gpu", "off", "--temp", "0", "-n", "2", "--chat-template", template, "--show-prompt", "Hi"]);
        assert!(o.status.success(), "{template}: {}", stderr(&o));
        assert!(stderr(&o).contains(rendered), "{template}: {}", stderr(&o));
        assert!(!stderr(&o).contains("has no chat template"), "{template}: {}", stderr(&o));
    }
    // A wrong name or a missing file: one line, exit codes 2 and 1.
    let o = wisp(&["chat", "--model", m, "--gpu", "off", "--chat-template", "alpaca", "Hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("unknown chat template \"alpaca\""), "{}", stderr(&o));
    assert_eq!(stderr(&o).trim().lines().count(), 1, "{}", stderr(&o));
    let o = wisp(&["chat", "--model", m, "--gpu", "off", "--chat-template", "/no/such/template.jinja", "Hi"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot read the chat template /no/such/template.jinja"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// A reply to `message` from `wisp serve --model name` (greedy, `max_tokens`), through
/// `/v1/chat/completions` on loopback, read with a plain HTTP/1.1 exchange.
fn served_reply(name: &str, message: &str, max_tokens: u32) -> String {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = Command::new(env!("CARGO_BIN_EXE_wisp"))
        .args(["serve", "--model", name, "--gpu", "off", "--port", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let exchange = |request: &str| -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.write_all(request.as_bytes()).ok()?;
        let mut response = String::new();
        s.read_to_string(&mut response).ok()?;
        Some(response)
    };
    let ready = (0..600).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(200));
        exchange("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    });
    // The name the server serves the model by (as a client reads it from /v1/models).
    let models = ready.then(|| exchange("GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")).flatten().unwrap_or_default();
    let models: Value = models.split_once("\r\n\r\n").and_then(|(_, j)| serde_json::from_str(j).ok()).unwrap_or_default();
    let served = models["data"][0]["id"].as_str().unwrap_or(name).to_string();
    let body = serde_json::json!({
        "model": served,
        "messages": [{"role": "user", "content": message}],
        "temperature": 0,
        "max_tokens": max_tokens,
    })
    .to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let response = ready.then(|| exchange(&request)).flatten();
    let _ = server.kill();
    let _ = server.wait();
    let response = response.unwrap_or_else(|| panic!("wisp serve --model {name} did not answer"));
    let (head, json) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{response}");
    let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

/// The real Llama-architecture file and the real 1.5B chat with their files' own templates, in
/// `wisp chat` and in `wisp serve` alike: the rendered prompt is the template's (SmolLM2's
/// supplies its own system message; Qwen's its own), and the server's greedy reply is the
/// command's, word for word.
#[test]
fn real_models_chat_with_their_own_templates_in_chat_and_serve() {
    let cases = [
        ("smollm2-135m", "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"),
        ("qwen2.5-coder-1.5b", "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"),
    ];
    let message = "What is the capital of France? Answer in one sentence.";
    for (name, system) in cases {
        let o = wisp(&["chat", "--temp", "0", "--model", name, "--gpu", "off", "-n", "24", "--show-prompt", message]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let prompt = format!("{system}<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n");
        assert!(stderr(&o).contains(&prompt), "{name}: the prompt is not its template's: {}", stderr(&o));
        let reply = stdout(&o);
        assert!(reply.contains("Paris"), "{name}: {reply}");
        assert_eq!(served_reply(name, message, 24).trim(), reply.trim(), "{name}: wisp serve and wisp chat differ");
    }
}
