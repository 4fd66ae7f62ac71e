//! A lint as a test: no `unwrap`, `expect` or `panic!` in the engine's or the host's code
//! outside tests, where a file, a guest or a device could reach it. (`unreachable!` stays
//! allowed for invariants the code itself establishes.)

use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_unwrap_expect_or_panic_outside_tests() {
    let root = wisp_tests::root();
    let mut files = Vec::new();
    for dir in ["guest/src", "host/src"] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 10, "found {} files", files.len());
    let mut found = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in text.lines().enumerate() {
            // Test modules sit at the end of a file (or a file is one: `#![cfg(test)]`).
            if ["#[cfg(test)]", "#![cfg(test)]"].iter().any(|a| line.trim_start().starts_with(a)) {
                break;
            }
            let code = line.split("//").next().unwrap_or_default();
            if [".unwrap()", ".expect(", "panic!("].iter().any(|p| code.contains(p)) {
                found.push(format!("{}:{}: {}", f.strip_prefix(&root).unwrap().display(), i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "panicking calls on reachable paths:\n{}", found.join("\n"));
}
