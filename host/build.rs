//! Builds the guest component (wasm32-wasip2) so that `cargo build` at the top level yields a
//! `wisp` binary that carries its guest: the CLI needs no path to find it. The conformance kit
//! (`tests/conformance`, a second component) is built by the same invocation and embedded too. The
//! runaway guest of the reliability tests (`tests/runaway`) is built with them but not embedded:
//! only the tests read it.
//!
//! The guest is built by a nested cargo in its own target directory (`<target>/guest`), so it
//! never contends for the outer build's lock; cargo's own incremental checks make a rebuild with
//! no guest change cost well under a second.

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// The wasm32 packages, built in one invocation: the guest, the conformance kit, the runaway
/// guest of the reliability tests, and `wisp bake`'s HTTP front and stubs.
/// `host/tests/guest_on_wasm.rs` selects the same ones, so that the guest's tests reuse the
/// guest's dependencies as built here (cargo resolves features per selection).
const GUEST_PACKAGES: [&str; 5] = ["wisp-guest", "wisp-conformance", "wisp-runaway", "wisp-http", "wisp-virt"];

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest.parent().expect("host/ is inside the workspace").to_path_buf();
    for p in [
        "guest/src",
        "guest/Cargo.toml",
        "tests/conformance/src",
        "tests/conformance/Cargo.toml",
        "tests/runaway/src",
        "tests/runaway/Cargo.toml",
        "api/src",
        "api/Cargo.toml",
        "bake/http/src",
        "bake/http/Cargo.toml",
        "bake/virt/src",
        "bake/virt/wit",
        "bake/virt/Cargo.toml",
        "wit",
        ".cargo/config.toml",
        "Cargo.lock",
        // The workspace's release profile (the guest's per-package debug info).
        "Cargo.toml",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    println!("cargo:rerun-if-env-changed=WISP_GUEST_PROFILE");
    println!("cargo:rerun-if-env-changed=WISP_GUEST_TARGET_DIR");

    // WISP_GUEST_TARGET_DIR: a target directory where the guests are built already (by
    // `fuzz/run.sh`: cargo fuzz's nightly toolchain has no wasm32-wasip2 target); they are
    // embedded from there, not built.
    if let Some(dir) = env::var_os("WISP_GUEST_TARGET_DIR") {
        embed(&PathBuf::from(dir));
        return;
    }
    let target_dir = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| if p.is_absolute() { p } else { root.join(p) })
        .unwrap_or_else(|| root.join("target"))
        .join("guest");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .args(["build", "--release", "--locked"])
        .args(GUEST_PACKAGES.iter().flat_map(|p| ["-p", p]))
        .args(["--target", "wasm32-wasip2"])
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer build's flags are for the host target; the guest's come from .cargo/config.toml.
    for var in ["CARGO_ENCODED_RUSTFLAGS", "RUSTFLAGS", "CARGO_BUILD_TARGET", "CARGO_TARGET_DIR"] {
        cmd.env_remove(var);
    }
    let status = cmd.status().expect("could not run cargo to build the guest");
    if !status.success() {
        panic!(
            "building the guest component failed (is the target installed? \
             `rustup target add wasm32-wasip2`)"
        );
    }
    embed(&target_dir);
}

/// Embeds the guests built in `target_dir` (copied into OUT_DIR, named by environment variables).
fn embed(target_dir: &std::path::Path) {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    for (file, var) in [
        ("wisp_guest.wasm", "WISP_GUEST_WASM"),
        ("wisp_conformance.wasm", "WISP_CONFORMANCE_WASM"),
        ("wisp_http.wasm", "WISP_HTTP_WASM"),
        ("wisp_virt.wasm", "WISP_VIRT_WASM"),
    ] {
        let wasm = target_dir.join("wasm32-wasip2/release").join(file);
        let out = out_dir.join(file);
        std::fs::copy(&wasm, &out)
            .unwrap_or_else(|e| panic!("copying {} to {}: {e}", wasm.display(), out.display()));
        println!("cargo:rustc-env={var}={}", out.display());
    }
    // The reliability tests' runaway guest (tests/runaway) is not embedded: the tests read it.
    let runaway = target_dir.join("wasm32-wasip2/release/wisp_runaway.wasm");
    println!("cargo:rustc-env=WISP_RUNAWAY_WASM={}", runaway.display());
}
