//! The repository's pytest suites (`tests/serve/`, `tests/bake/`), run from the cargo suite
//! against real clients: a missing Python package skips locally and fails under `CI=true`
//! (`.ci/run` installs them); a skipped test fails the run.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("cli/ is inside the workspace").to_path_buf()
}

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Whether python3 imports `modules` (comma-separated); if not, says why `suite` is skipped,
/// and fails under `CI=true`.
pub fn python_has(modules: &str, suite: &str) -> bool {
    let probe = Command::new("python3").args(["-c", &format!("import {modules}")]).output();
    if probe.as_ref().is_ok_and(|o| o.status.success()) {
        return true;
    }
    let why = match &probe {
        Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
        Err(e) => e.to_string(),
    };
    assert!(!ci(), "{suite} needs python3 with {modules} (pip), and CI=true requires it: {why}");
    eprintln!("skipping: {why}");
    false
}

/// Runs pytest on the repository's `folder` with `env` set (and `-s` when `show_output`) and
/// fails if a test fails or is skipped.
pub fn run(suite: &str, folder: &str, show_output: bool, env: &[(&str, &OsStr)]) {
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]);
    if show_output {
        cmd.arg("-s");
    }
    cmd.arg(folder).current_dir(root());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("running pytest");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success(), "{suite} failed");
    let summary = text.lines().rev().find(|l| l.contains(" passed")).unwrap_or_default();
    assert!(!summary.contains("skipped"), "a test of {suite} was skipped: {summary}");
}
