//! The examples run as a user runs them (cargo builds them with the tests).

use std::path::PathBuf;
use std::process::Command;

fn example(name: &str) -> PathBuf {
    // target/<profile>/deps/<this test> -> target/<profile>/examples/<name>
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap().join("examples");
    dir.join(name)
}

fn run(name: &str) -> String {
    run_with(name, &["The capital of France is"])
}

fn run_with(name: &str, prompts: &[&str]) -> String {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let model = MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).unwrap());
    let out = Command::new(example(name))
        .arg(&model)
        .args(prompts)
        .output()
        .unwrap_or_else(|e| panic!("running example {name}: {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The sessions served together each get the completion their prompt gets alone (`embed`'s
/// greedy tokens, of which `batch` prints the first 24).
#[test]
fn batch_example_serves_each_prompt_as_alone() {
    let prompts = ["The capital of France is", "Water boils at", "My favourite colour is"];
    let out = run_with("batch", &prompts);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), prompts.len(), "{out}");
    for (p, line) in prompts.iter().zip(lines) {
        assert!(line.starts_with(p) && line.len() > p.len() + 10, "{line}");
        let alone = run_with("embed", &[p]);
        let alone = alone.split("\n[").next().unwrap().replace('\n', " ");
        assert!(alone.starts_with(line), "together: {line:?}\nalone: {alone:?}");
    }
}

#[test]
fn embed_example_is_short_and_generates() {
    let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/embed.rs")).unwrap();
    assert!(src.lines().count() < 60, "examples/embed.rs has {} lines", src.lines().count());
    let out = run("embed");
    assert!(out.starts_with("The capital of France is the capital of"), "{out}");
}

#[test]
fn a_custom_gpu_implementation_gives_the_same_tokens() {
    let out = run("custom_gpu");
    assert!(out.starts_with("The capital of France is the capital of"), "{out}");
    let counts = out.lines().last().unwrap();
    assert!(!counts.contains(" 0 device calls"), "{counts}");
}
