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
    Command::new(env!("CARGO_BIN_EXE_wisp")).args(args).output().expect("running wisp")
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
    let o = wisp(&["run", "--model", model().to_str().unwrap(), "-n", "8", "The capital of France is"]);
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
fn help_has_examples_for_every_subcommand() {
    for sub in ["run", "eval", "bench", "tokenize", "info", "fetch", "chat", "conformance"] {
        let o = wisp(&[sub, "--help"]);
        assert!(o.status.success());
        assert!(stdout(&o).contains("Examples:"), "{sub}: {}", stdout(&o));
    }
    let o = wisp(&["--help"]);
    for sub in ["run", "eval", "bench", "tokenize", "info", "fetch", "chat", "conformance"] {
        assert!(stdout(&o).contains(sub));
    }
}

#[test]
fn chat_answers_one_message_with_the_models_template() {
    let m = qwen_model().to_str().unwrap();
    let system = "You are a helpful assistant.";
    let o = wisp(&["chat", "--model", m, "--gpu", "off", "--system", system, "-n", "24", "What does HTTP status 404 mean?"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The greedy reply of the golden `chat` case, whose prompt is this conversation rendered.
    let out = stdout(&o);
    assert!(out.starts_with("HTTP status 404 typically indicates that the requested resource"), "{out}");
    assert!(stderr(&o).contains("stopped after 24 tokens"), "{}", stderr(&o));
}

#[test]
fn chat_stops_at_the_end_of_the_turn() {
    let m = qwen_model().to_str().unwrap();
    let o = wisp(&["chat", "--model", m, "--gpu", "off", "-n", "64", "Reply with the single word: yes"]);
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
        .args(["chat", "--model", m, "--gpu", "off", "-n", "48", "--stats"])
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

    let o = wisp(&["conformance", "--device", "cpu", "--seed", "1", "--json", "--golden-cases", "unicode"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let g = &v["golden"];
    assert_eq!((g["passed"].as_u64(), g["failed"].as_u64(), &v["pass"]), (Some(1), Some(0), &Value::Bool(true)), "{v}");
    assert!(g["gpu_weights"].as_u64().unwrap() > 0, "the guest put no weight on the device: {g}");
    assert!(g["device"].as_str().unwrap().starts_with("wisp CPU reference"), "{g}");
    let case = &g["cases"][0];
    assert_eq!((case["name"].as_str(), case["pass"].as_bool(), case["steps"].as_u64()), (Some("unicode"), Some(true), Some(16)), "{case}");
    assert!(case["rmse"].as_f64().unwrap() <= 0.6 && case["max_top5_diff"].as_f64().unwrap() <= 1.5, "{case}");
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
    let o = wisp(&["run", "--model", m, "--json-schema", file.to_str().unwrap(), "-n", "64", prompt]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let v: Value = serde_json::from_str(out.strip_prefix(prompt).unwrap().trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(v["name"].is_string() && v["age"].as_u64().is_some_and(|a| a <= 150), "{v}");
    assert!(["engineer", "doctor", "artist"].contains(&v["job"].as_str().unwrap()), "{v}");
    // The properties in the schema's order, written compactly.
    assert!(out.contains("{\"name\":\""), "{out}");
    // A chat reply too.
    let o = wisp(&["chat", "--model", m, "--json-schema", file.to_str().unwrap(), "-n", "64", "Describe Bob, a doctor aged 52."]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));
    assert!(v["age"].is_u64() && v["job"].is_string(), "{v}");
}

#[test]
fn run_follows_a_regex_and_a_lark_grammar() {
    let m = model().to_str().unwrap();
    let o = wisp(&["run", "--model", m, "--regex", "[0-9]{3}-[0-9]{4}", "-n", "20", "Her phone number is"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let number = out.strip_prefix("Her phone number is").unwrap().trim_end();
    assert!(number.len() == 8 && number.as_bytes()[3] == b'-', "{out}");
    assert!(number.chars().filter(|c| c.is_ascii_digit()).count() == 7, "{out}");
    let grammar = tempdir("lark").join("answer.lark");
    std::fs::write(&grammar, "start: ANSWER \" because \" REASON \".\"\nANSWER: \"yes\" | \"no\"\nREASON: /[a-z ]{1,40}/\n").unwrap();
    let o = wisp(&["chat", "--model", m, "--grammar", grammar.to_str().unwrap(), "-n", "40", "Is water wet?"]);
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
        let o = wisp(&["run", "--model", m, "--json-schema", file.to_str().unwrap(), "-n", "4", "Hi"]);
        let err = stderr(&o);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        assert_eq!(lines.len(), 1, "{name}: {err}");
        assert!(lines[0].starts_with("wisp: error: invalid constraint:") && lines[0].contains(words), "{name}: {err}");
    }
    let not_json = tempdir("not-json").join("schema.json");
    std::fs::write(&not_json, "{\"type\": ").unwrap();
    let o = wisp(&["run", "--model", m, "--json-schema", not_json.to_str().unwrap(), "Hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("not JSON"), "{}", stderr(&o));
    let o = wisp(&["run", "--model", m, "--regex", "(unclosed", "Hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("regular expression does not compile"), "{}", stderr(&o));
    // A grammar that a step cannot follow (a lexer past its limits): an error, not a hang.
    let start = std::time::Instant::now();
    let o = wisp(&["run", "--model", m, "--regex", "(\\w+\\s?){1000}", "-n", "32", "Hello"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("invalid constraint"), "{}", stderr(&o));
    assert!(start.elapsed().as_secs() < 60);
    // A missing file, and two constraints at once.
    let o = wisp(&["run", "--model", m, "--grammar", "/no/such/file.lark", "Hi"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot read /no/such/file.lark"), "{}", stderr(&o));
    let o = wisp(&["run", "--model", m, "--regex", "a", "--grammar", "x.lark", "Hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot be used with"), "{}", stderr(&o));
    // No text matches: the generation ends at once, saying why.
    let o = wisp(&["run", "--model", m, "--regex", "[^\\s\\S]", "-n", "8", "Hello"]);
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
