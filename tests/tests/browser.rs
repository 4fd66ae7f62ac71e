//! The browser host (`web/`): the same guest `.wasm` in headless Chromium with WebGPU and JSPI,
//! held to the golden thresholds with the GPU on and off (see `web/test/browser.test.mjs`).
//! The npm test skips what it cannot run locally and fails under `CI=true`.

use std::process::Command;
use wisp_tests::{hardware_required, model, root};

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
    let out = Command::new("npm").arg("test").current_dir(&web).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success(), "the browser suite failed");
}
