//! The README's two commands build the dependencies once: `cargo build --release` (the first) and
//! `cargo test --release` (the second) must resolve every dependency with the same features, or
//! the second compiles wasmtime, wgpu and their dependencies again (cargo resolves features per
//! selection of packages, dev-dependencies included).

use std::process::Command;

/// `cargo tree` over the default members: each package with its features, one per line, sorted.
fn tree(edges: &str) -> Vec<String> {
    tree_of(&[], edges)
}

/// `cargo tree` of the packages `select` (`-p NAME`, ...; the default members when empty), as
/// [`tree`].
fn tree_of(select: &[&str], edges: &str) -> Vec<String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(wisp_tests::root())
        .args(["tree", "--locked", "--prefix", "none", "--format", "{p} [{f}]", "--edges", edges])
        .args(select)
        .output()
        .expect("running cargo tree");
    assert!(out.status.success(), "cargo tree failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim_end_matches(" (*)").to_string())
        .filter(|l| !l.is_empty())
        .collect();
    lines.sort();
    lines.dedup();
    lines
}

#[test]
fn build_and_test_resolve_the_same_features() {
    let build = tree("normal,build");
    let test = tree("normal,build,dev");
    assert!(build.iter().any(|l| l.starts_with("wasmtime v")), "the tree lacks wasmtime: {build:?}");
    // The default members are the crates with native code: the library, the CLI and these tests.
    for member in ["wisp v", "wisp-cli v", "wisp-tests v"] {
        assert!(build.iter().any(|l| l.starts_with(member)), "{member:?} is not a default member");
    }
    let only_build: Vec<_> = build.iter().filter(|l| !test.contains(l)).collect();
    let only_test: Vec<_> = test.iter().filter(|l| !build.contains(l)).collect();
    assert!(
        only_build.is_empty() && only_test.is_empty(),
        "`cargo test --release` would compile these again with other features (or add them):\n\
         only in the build: {only_build:#?}\nonly in the tests: {only_test:#?}"
    );
}

/// An embedder of the library builds no server and no command line: the `wisp` crate (the
/// wasmtime embedding, the gpu interface and its backends) leaves axum, hyper, clap and
/// prometheus-client to `wisp-cli`.
#[test]
fn the_library_builds_no_server_and_no_command_line() {
    let lib = tree_of(&["-p", "wisp"], "normal");
    assert!(lib.iter().any(|l| l.starts_with("wasmtime v")), "the library's tree lacks wasmtime: {lib:?}");
    let named = |l: &String, c: &str| l.starts_with(&format!("{c} v"));
    for server in ["axum", "hyper", "clap", "prometheus-client", "wisp-api"] {
        assert!(!lib.iter().any(|l| named(l, server)), "the library pulls in {server}");
    }
    let cli = tree_of(&["-p", "wisp-cli"], "normal");
    for needed in ["axum", "hyper", "clap", "prometheus-client", "wisp"] {
        assert!(cli.iter().any(|l| named(l, needed)), "wisp-cli lacks {needed}");
    }
}
