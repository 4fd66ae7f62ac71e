//! The browser host (`web/`): the same guest `.wasm` in headless Chromium with WebGPU and JSPI,
//! held to the golden thresholds with the GPU on and off (`web/test/browser.test.mjs`), and the
//! conformance kit of the `gpu` interface against the browser's WebGPU host, which must pass,
//! and against deliberately broken ones, which must fail (`web/test/conformance.test.mjs`).
//! The npm test skips what it cannot run locally and fails under `CI=true`.

use std::process::Command;
use wisp::conformance;
use wisp::{CpuBackend, GpuCtx};
use wisp_tests::{hardware_required, model, root};

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
    ] {
        assert!(text.contains(test), "`npm test` did not run \"{test}\"");
    }
    if hardware_required() {
        assert!(!text.contains("# SKIP"), "a browser test was skipped under CI=true");
    }
}
