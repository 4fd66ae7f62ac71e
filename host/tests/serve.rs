//! `wisp serve` driven by real clients on loopback: the `openai` Python package (unmodified),
//! schemathesis against `/openapi.json`, raw sockets for the hostile cases, and a bounded load
//! test (`tests/serve/*.py`, pytest). Missing Python packages skip locally and fail under
//! `CI=true` (`.ci/run` installs them).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("host/ is inside the workspace").to_path_buf()
}

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

#[test]
fn the_server_passes_its_client_suite() {
    let probe = Command::new("python3").args(["-c", "import openai, httpx, pytest, schemathesis, jsonschema"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        let why = match &probe {
            Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
            Err(e) => e.to_string(),
        };
        assert!(!ci(), "the server's client suite needs python3 with openai, pytest, schemathesis and jsonschema (pip), and CI=true requires it: {why}");
        eprintln!("skipping: {why}");
        return;
    }
    let model = wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).expect("fetching the default model");
    let out = Command::new("python3")
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/serve"])
        .env("WISP_BIN", env!("CARGO_BIN_EXE_wisp"))
        .env("WISP_MODEL", &model)
        .current_dir(root())
        .output()
        .expect("running pytest");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success(), "the server's client suite failed");
    let summary = text.lines().rev().find(|l| l.contains(" passed")).unwrap_or_default();
    assert!(!summary.contains("skipped"), "a server test was skipped: {summary}");
}
