//! `wisp conformance`: the conformance kit of the `gpu` interface against one of this host's
//! devices, as a table (or JSON); exit code 3 when a case fails.

use super::DeviceArg;
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use wisp::conformance::{self, CaseResult};
use wisp::{Budget, CpuBackend, GpuCtx, WgpuBackend};

#[derive(Args)]
pub struct ConformanceArgs {
    /// The implementation of the `gpu` interface to check (WISP_ADAPTER=name picks a wgpu adapter).
    #[arg(long, value_enum, default_value_t = DeviceArg::Wgpu)]
    device: DeviceArg,
    /// Seed of the random shapes and values: the same seed makes the same calls [default: fresh, printed]
    #[arg(long)]
    seed: Option<u64>,
    /// Device memory the kit may use, in MiB (the budget-bytes case fills it; above 256 it is skipped).
    #[arg(long, default_value_t = 64, value_name = "MIB")]
    gpu_budget: u64,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Print what each case checked, not only the failures and skips.
    #[arg(short, long)]
    verbose: bool,
    /// Write the kit's component (wasm32-wasip2, world `wisp:llm/conformance`) to this file and
    /// exit, to run it in another host.
    #[arg(long, value_name = "PATH")]
    write_component: Option<PathBuf>,
}

/// Cases failed (exit code 3).
#[derive(Debug)]
pub struct Failed(pub Vec<String>);

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "conformance failed: {}", self.0.join(", "))
    }
}

impl std::error::Error for Failed {}

fn verdict(r: &CaseResult) -> &'static str {
    if r.passed {
        "pass"
    } else if r.skipped {
        "skip"
    } else {
        "FAIL"
    }
}

pub fn conformance(a: ConformanceArgs) -> Result<()> {
    if let Some(path) = &a.write_component {
        std::fs::write(path, conformance::COMPONENT).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote the conformance kit ({} bytes) to {}", conformance::COMPONENT.len(), path.display());
        return Ok(());
    }
    let budget = Budget { bytes: a.gpu_budget << 20, ..Budget::default() };
    let gpu = match a.device {
        DeviceArg::None => GpuCtx::none(),
        DeviceArg::Cpu => GpuCtx::new(Box::new(CpuBackend::new()), budget),
        DeviceArg::Wgpu => match WgpuBackend::new()? {
            Some(b) => GpuCtx::new(Box::new(b), budget),
            None => {
                eprintln!("wisp: no wgpu adapter found: the device cases are skipped");
                GpuCtx::none()
            }
        },
    };
    let device = gpu.device().map(|d| format!("{} ({}, {})", d.name, d.backend, d.device_type));
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    let results = conformance::run(gpu, seed)?;
    let failed: Vec<String> = results.iter().filter(|r| r.failed()).map(|r| r.name.clone()).collect();
    let count = |f: fn(&CaseResult) -> bool| results.iter().filter(|r| f(r)).count();
    let (passed, skipped) = (count(|r| r.passed), count(|r| r.skipped));
    if a.json {
        let v = serde_json::json!({
            "device": device, "seed": seed, "passed": passed, "failed": failed.len(), "skipped": skipped,
            "cases": results,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("device: {}", device.as_deref().unwrap_or("none"));
        println!("seed:   {seed} (--seed {seed} repeats these calls)\n");
        println!("{:<28} {:<6} {:>10} {:>10}", "case", "result", "max error", "time");
        for r in &results {
            let err = if r.max_error > 0.0 { format!("{:.2e}", r.max_error) } else { "-".into() };
            let time = format!("{:.1} ms", r.micros as f64 / 1e3);
            println!("{:<28} {:<6} {err:>10} {time:>10}", r.name, verdict(r));
        }
        println!("\n{passed} passed, {} failed, {skipped} skipped", failed.len());
        let notes: Vec<_> = results.iter().filter(|r| a.verbose || !r.passed).collect();
        if !notes.is_empty() {
            println!();
        }
        for r in notes {
            println!("{} {}: {}", verdict(r), r.name, r.message);
        }
    }
    if failed.is_empty() { Ok(()) } else { Err(Failed(failed).into()) }
}
