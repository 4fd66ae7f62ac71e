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
        "ops/src",
        "ops/Cargo.toml",
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
        // The portable guest stands in for the relaxed-SIMD one (the same results).
        embed(&PathBuf::from(&dir));
        embed_relaxed(&PathBuf::from(dir));
        println!("cargo:rustc-env=WISP_GUEST_RELAXED_RUSTFLAGS={}", relaxed_rustflags(&root));
        return;
    }
    let target_dir = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| if p.is_absolute() { p } else { root.join(p) })
        .unwrap_or_else(|| root.join("target"))
        .join("guest");
    let status = guest_build(&root, &target_dir, &GUEST_PACKAGES).status().expect("could not run cargo to build the guest");
    if !status.success() {
        panic!(
            "building the guest component failed (is the target installed? \
             `rustup target add wasm32-wasip2`)"
        );
    }
    // The guest again with relaxed SIMD enabled, in a target directory of its own (other
    // flags): its `fast` products use relaxed SIMD's byte dot products, with results equal to
    // the portable build's bit for bit (see guest/src/kernels/int8.rs). The native host runs
    // it; the portable one is what other hosts (the browser package, `wisp bake`) carry.
    let relaxed_dir = target_dir.with_file_name("guest-relaxed");
    let mut cmd = guest_build(&root, &relaxed_dir, &["wisp-guest"]);
    // RUSTFLAGS replaces .cargo/config.toml's flags for the target: the same ones, plus.
    let flags = relaxed_rustflags(&root);
    cmd.env("RUSTFLAGS", &flags);
    // The guest's tests build it the same way (host/tests/guest_on_wasm.rs).
    println!("cargo:rustc-env=WISP_GUEST_RELAXED_RUSTFLAGS={flags}");
    let status = cmd.status().expect("could not run cargo to build the guest");
    if !status.success() {
        panic!("building the guest component with relaxed SIMD failed");
    }
    embed(&target_dir);
    embed_relaxed(&relaxed_dir);
}

/// A release build of `packages` for wasm32-wasip2 in `target_dir`, by a nested cargo. The
/// outer build's flags are for the host target; the guest's come from .cargo/config.toml.
fn guest_build(root: &std::path::Path, target_dir: &std::path::Path, packages: &[&str]) -> Command {
    let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root)
        .args(["build", "--release", "--locked"])
        .args(packages.iter().flat_map(|p| ["-p", p]))
        .args(["--target", "wasm32-wasip2"])
        .arg("--target-dir")
        .arg(target_dir);
    for var in ["CARGO_ENCODED_RUSTFLAGS", "RUSTFLAGS", "CARGO_BUILD_TARGET", "CARGO_TARGET_DIR"] {
        cmd.env_remove(var);
    }
    cmd
}

/// The flags of the relaxed-SIMD guest: .cargo/config.toml's rustflags for wasm32-wasip2 (the
/// `rustflags = [...]` line of that file), plus relaxed SIMD.
fn relaxed_rustflags(root: &std::path::Path) -> String {
    let config = std::fs::read_to_string(root.join(".cargo/config.toml")).expect("reading .cargo/config.toml");
    let line = config.lines().find(|l| l.trim_start().starts_with("rustflags")).expect("a rustflags line in .cargo/config.toml");
    let flags: Vec<&str> = line.split('"').skip(1).step_by(2).collect();
    format!("{} -C target-feature=+relaxed-simd", flags.join(" "))
}

/// Embeds the relaxed-SIMD guest built in `target_dir` (`WISP_GUEST_RELAXED_WASM`).
fn embed_relaxed(target_dir: &std::path::Path) {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    let wasm = target_dir.join("wasm32-wasip2/release/wisp_guest.wasm");
    let out = out_dir.join("wisp_guest_relaxed.wasm");
    std::fs::copy(&wasm, &out).unwrap_or_else(|e| panic!("copying {} to {}: {e}", wasm.display(), out.display()));
    println!("cargo:rustc-env=WISP_GUEST_RELAXED_WASM={}", out.display());
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
    // The reliability tests' runaway guest (tests/runaway) is not embedded: the tests read it,
    // the CLI's through this package's `links` metadata (`DEP_WISP_RUNAWAY_WASM`, cli/build.rs).
    let runaway = target_dir.join("wasm32-wasip2/release/wisp_runaway.wasm");
    println!("cargo:rustc-env=WISP_RUNAWAY_WASM={}", runaway.display());
    println!("cargo::metadata=runaway_wasm={}", runaway.display());
}
