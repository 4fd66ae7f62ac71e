//! `wisp conformance`: what a host implementer runs, in one command. First the conformance kit of
//! the `gpu` interface against one of this host's devices; then the engine-level golden check
//! (teacher forcing over `tests/golden/gemma3-270m.json`, the thresholds of its README) with the
//! default model, the guest's matrix products on that same device. One table (or JSON); exit code
//! 3 when a kit case or a golden case fails.

use super::{DeviceArg, model_path, threads};
use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Instant;
use wisp::conformance::{self, CaseResult};
use wisp::golden::{self, Outcome};
use wisp::{Budget, GpuCtx, GpuMode, LoadOptions, Options, Wisp};

/// The golden file of the default model, from the workspace this binary was built in (when not
/// found under the current directory).
const GOLDEN: &str = "tests/golden/gemma3-270m.json";

#[derive(Args)]
pub struct ConformanceArgs {
    /// The implementation of the `gpu` interface to check (WISP_ADAPTER=name picks a wgpu adapter).
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    device: DeviceArg,
    /// Seed of the random shapes and values: the same seed makes the same calls [default: fresh, printed]
    #[arg(long)]
    seed: Option<u64>,
    /// Threads of the native device (`--device native`), 1 to 1024 [default: one a physical core]
    #[arg(long, short = 't', default_value_t = 0, value_name = "N", hide_default_value = true, value_parser = threads)]
    threads: usize,
    /// Device memory the kit may use, in MiB (the budget-bytes case fills it; above 256 it is skipped).
    #[arg(long, default_value_t = 64, value_name = "MIB")]
    gpu_budget: u64,
    /// Golden file of the engine-level check [default: tests/golden/gemma3-270m.json]
    #[arg(long, value_name = "PATH", conflicts_with = "no_golden")]
    golden: Option<PathBuf>,
    /// Only these golden cases (comma-separated names) [default: every case of the file]
    #[arg(long, value_name = "NAMES", value_delimiter = ',', conflicts_with = "no_golden")]
    golden_cases: Vec<String>,
    /// GGUF model of the golden check, or a known model's name [default: Gemma 3 270M Q4_K_M, fetched if missing]
    #[arg(short, long, conflicts_with = "no_golden")]
    model: Option<PathBuf>,
    /// How exactly the golden check's model computes its products (the kit checks both).
    #[arg(long, value_enum, default_value_t = super::PrecisionArg::Exact, conflicts_with = "no_golden")]
    precision: super::PrecisionArg,
    /// Run the golden cases as one batch (`model.step`), every case's session in the same
    /// forward passes.
    #[arg(long, conflicts_with = "no_golden")]
    batched: bool,
    /// Run only the gpu kit, not the golden check.
    #[arg(long)]
    no_golden: bool,
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

/// The device `--device` names, with `budget`; none when wgpu finds no adapter (`say`: say so).
fn device(arg: DeviceArg, budget: Budget, threads: usize, say: bool) -> Result<GpuCtx> {
    Ok(match arg.open(budget, threads)? {
        Some(ctx) => ctx,
        None => {
            if say {
                eprintln!("wisp: no wgpu adapter found: the device cases are skipped, the golden check runs on the guest's CPU");
            }
            GpuCtx::none()
        }
    })
}

fn describe_device(gpu: &GpuCtx) -> Option<String> {
    gpu.device().map(|d| format!("{} ({}, {})", d.name, d.backend, d.device_type))
}

pub fn conformance(a: ConformanceArgs) -> Result<()> {
    if let Some(path) = &a.write_component {
        std::fs::write(path, conformance::COMPONENT).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote the conformance kit ({} bytes) to {}", conformance::COMPONENT.len(), path.display());
        return Ok(());
    }
    // The golden file is read first: a wrong path fails at once, not after the kit.
    let cases = if a.no_golden { None } else { Some(golden_cases(&a)?) };

    let gpu = device(a.device, Budget { bytes: a.gpu_budget << 20, ..Budget::default() }, a.threads, true)?;
    let device = describe_device(&gpu);
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    let results = conformance::run(gpu, seed)?;
    let mut failed: Vec<String> = results.iter().filter(|r| r.failed()).map(|r| r.name.clone()).collect();
    let count = |f: fn(&CaseResult) -> bool| results.iter().filter(|r| f(r)).count();
    let (passed, skipped) = (count(|r| r.passed), count(|r| r.skipped));
    if !a.json {
        print_kit(&results, device.as_deref(), seed, a.verbose);
    }

    let golden = match cases {
        None => None,
        Some((path, cases)) => {
            if !a.json {
                println!("\ngolden check: {} ({} cases{}), teacher forcing, GPU on", path.display(), cases.len(), if a.batched { ", one batch" } else { "" });
            }
            let g = run_golden(&a, &path, &cases);
            if let Ok(g) = &g {
                failed.extend(g.outcomes.iter().filter(|(o, _)| !o.pass()).map(|(o, _)| format!("golden {}", o.name)));
            }
            Some(g)
        }
    };

    if a.json {
        let golden_json = match &golden {
            None => Value::Null,
            Some(Ok(g)) => g.to_json(),
            Some(Err(e)) => json!({ "error": format!("{e:#}") }),
        };
        let v = json!({
            "device": device, "seed": seed, "passed": passed, "failed": results.iter().filter(|r| r.failed()).count(),
            "skipped": skipped, "cases": results, "golden": golden_json,
            "pass": failed.is_empty() && !matches!(golden, Some(Err(_))),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if let Some(Ok(g)) = &golden {
        let bad = g.outcomes.iter().filter(|(o, _)| !o.pass()).count();
        println!("\n{} passed, {bad} failed", g.outcomes.len() - bad);
    }
    if let Some(Err(e)) = golden {
        return Err(e.context("the golden check could not run"));
    }
    if failed.is_empty() { Ok(()) } else { Err(Failed(failed).into()) }
}

fn print_kit(results: &[CaseResult], device: Option<&str>, seed: u64, verbose: bool) {
    let count = |f: fn(&CaseResult) -> bool| results.iter().filter(|r| f(r)).count();
    println!("device: {}", device.unwrap_or("none"));
    println!("seed:   {seed} (--seed {seed} repeats these calls)\n");
    println!("{:<28} {:<6} {:>10} {:>10}", "case", "result", "max error", "time");
    for r in results {
        let err = if r.max_error > 0.0 { format!("{:.2e}", r.max_error) } else { "-".into() };
        let time = format!("{:.1} ms", r.micros as f64 / 1e3);
        println!("{:<28} {:<6} {err:>10} {time:>10}", r.name, verdict(r));
    }
    println!("\n{} passed, {} failed, {} skipped", count(|r| r.passed), count(CaseResult::failed), count(|r| r.skipped));
    let notes: Vec<_> = results.iter().filter(|r| verbose || !r.passed).collect();
    if !notes.is_empty() {
        println!();
    }
    for r in notes {
        println!("{} {}: {}", verdict(r), r.name, r.message);
    }
}

/// The golden file (`--golden`, else the default model's under the current directory, else in
/// the workspace this binary was built from) and its cases that `--golden-cases` names.
fn golden_cases(a: &ConformanceArgs) -> Result<(PathBuf, Vec<golden::Case>)> {
    let path = match &a.golden {
        Some(p) => p.clone(),
        None => {
            let built = Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(|root| root.join(GOLDEN));
            match [Some(PathBuf::from(GOLDEN)), built].into_iter().flatten().find(|p| p.exists()) {
                Some(p) => p,
                None => bail!("no golden file at {GOLDEN}: name one with --golden PATH, or skip the check with --no-golden"),
            }
        }
    };
    let all = golden::load(&path)?;
    for name in &a.golden_cases {
        if !all.iter().any(|c| &c.name == name) {
            let names: Vec<_> = all.iter().map(|c| c.name.as_str()).collect();
            bail!("{} has no case {name:?}; its cases: {}", path.display(), names.join(", "));
        }
    }
    let cases: Vec<_> = all.into_iter().filter(|c| a.golden_cases.is_empty() || a.golden_cases.contains(&c.name)).collect();
    if cases.is_empty() {
        bail!("{} has no cases", path.display());
    }
    Ok((path, cases))
}

/// What the golden check measured: the file, the model, the device the guest used, and each
/// case's outcome with its time in seconds.
struct Golden {
    file: PathBuf,
    model: PathBuf,
    device: Option<String>,
    gpu_weights: u32,
    precision: super::PrecisionArg,
    outcomes: Vec<(Outcome, f64)>,
}

impl Golden {
    fn to_json(&self) -> Value {
        let cases: Vec<Value> = self
            .outcomes
            .iter()
            .map(|(o, s)| {
                json!({
                    "name": o.name, "steps": o.top.len(), "judged": o.judged,
                    "argmax_checked": o.argmax_checked, "argmax_mismatches": o.argmax_mismatches,
                    "max_top5_diff": o.max_top5_diff, "rmse": o.rmse, "pass": o.pass(), "seconds": s,
                })
            })
            .collect();
        let failed = self.outcomes.iter().filter(|(o, _)| !o.pass()).count();
        json!({
            "file": self.file, "model": self.model, "device": self.device, "gpu_weights": self.gpu_weights,
            "precision": format!("{:?}", self.precision).to_lowercase(),
            "thresholds": {"margin": golden::MARGIN, "top5": golden::TOP5_TOLERANCE, "rmse": golden::RMSE_TOLERANCE},
            "passed": self.outcomes.len() - failed, "failed": failed, "cases": cases,
        })
    }
}

/// Teacher forcing over `cases` with the model on the device `--device` names (a fresh one, with
/// the default budget: the model's weights must fit), the GPU mode on: every matrix product the
/// guest can send goes to that device. Prints each case as it ends, unless `--json`.
fn run_golden(a: &ConformanceArgs, file: &Path, cases: &[golden::Case]) -> Result<Golden> {
    let model = model_path(a.model.as_deref())?;
    let gpu = device(a.device, Budget::default(), a.threads, false)?;
    let device = describe_device(&gpu);
    let mut inst = Wisp::new(Options::default())?.instantiate(gpu, model.parent())?;
    let m = inst
        .open_model(&model, LoadOptions { gpu: GpuMode::On, precision: a.precision.into() })?
        .map_err(anyhow::Error::new)
        .with_context(|| format!("cannot load {}", model.display()))?;
    let gpu_weights = inst.model_info(m)?.gpu_weights;
    if !a.json {
        println!("model:  {}", model.display());
        println!("device: {}, {gpu_weights} weights on it, {:?} precision\n", device.as_deref().unwrap_or("none (the guest's CPU)"), a.precision);
        println!("{:<12} {:>5} {:>8} {:>15} {:>8} {:<6} {:>8}", "case", "steps", "argmax", "max|top5 diff|", "rmse", "result", "time");
    }
    let mut outcomes = Vec::new();
    if a.batched {
        // One batch: the time is the whole batch's, on each case's line.
        let start = Instant::now();
        let all = golden::run_cases_together(&mut inst, m, cases, 5).context("the golden cases as one batch")?;
        let secs = start.elapsed().as_secs_f64();
        for o in all {
            if !a.json {
                print_golden(&o, secs);
            }
            outcomes.push((o, secs));
        }
    }
    for case in cases.iter().filter(|_| !a.batched) {
        let start = Instant::now();
        let o = golden::run_case(&mut inst, m, case, 5).with_context(|| format!("golden case {}", case.name))?;
        let secs = start.elapsed().as_secs_f64();
        if !a.json {
            print_golden(&o, secs);
        }
        outcomes.push((o, secs));
    }
    Ok(Golden { file: file.to_path_buf(), model, device, gpu_weights, precision: a.precision, outcomes })
}

fn print_golden(o: &Outcome, secs: f64) {
    let argmax = format!("{}/{}", o.argmax_checked - o.argmax_mismatches.len(), o.argmax_checked);
    let rmse = o.rmse.map_or("-".to_string(), |v| format!("{v:.4}"));
    let verdict = if !o.judged { "-" } else if o.pass() { "pass" } else { "FAIL" };
    let time = format!("{secs:.1} s");
    println!("{:<12} {:>5} {argmax:>8} {:>15.4} {rmse:>8} {verdict:<6} {time:>8}", o.name, o.top.len(), o.max_top5_diff);
    if !o.argmax_mismatches.is_empty() {
        println!("{:<12} argmax differs from the reference at steps {:?}", "", o.argmax_mismatches);
    }
}
