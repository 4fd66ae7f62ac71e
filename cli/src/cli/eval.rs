//! `wisp eval`: teacher forcing over a golden file, judged by the thresholds of
//! `tests/golden/README.md` (see `wisp::golden`).

use super::{ModelArgs, load};
use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};
use std::path::PathBuf;
use wisp::golden::{self, Outcome};

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Golden file (JSON with `cases`, each with `prompt_tokens` and `continuation`).
    #[arg(long)]
    golden: PathBuf,
    /// Report the engine's top K logits per step.
    #[arg(long, default_value_t = 5)]
    top: u32,
    /// Write the full logits after each prompt as DIR/NAME.logits.f32.
    #[arg(long, value_name = "DIR")]
    dump_logits: Option<PathBuf>,
    /// Only the cases with these names (comma-separated).
    #[arg(long, value_delimiter = ',')]
    cases: Vec<String>,
    /// Run the cases as one batch (`model.step`): every case's session advances in the same
    /// forward passes, joining with its prompt and leaving when its continuation ends.
    #[arg(long)]
    batched: bool,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
}

/// A golden case failed its thresholds (exit code 3).
#[derive(Debug)]
pub struct Failed(pub Vec<String>);

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "golden check failed for: {}", self.0.join(", "))
    }
}

impl std::error::Error for Failed {}

pub fn eval(a: EvalArgs) -> Result<()> {
    let cases: Vec<_> =
        golden::load(&a.golden)?.into_iter().filter(|c| a.cases.is_empty() || a.cases.contains(&c.name)).collect();
    if cases.is_empty() {
        bail!("no case of {} matched", a.golden.display());
    }
    if let Some(d) = &a.dump_logits {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let mut loaded = load(&a.model)?;
    let outcomes = if a.batched {
        golden::run_cases_together(&mut loaded.inst, loaded.model, &cases, a.top as usize).context("the cases as one batch")?
    } else {
        let mut each = Vec::new();
        for case in &cases {
            each.push(golden::run_case(&mut loaded.inst, loaded.model, case, a.top as usize).with_context(|| format!("case {}", case.name))?);
        }
        each
    };
    let mut results = Vec::new();
    for (case, r) in cases.iter().zip(outcomes) {
        if let Some(d) = &a.dump_logits {
            let bytes: Vec<u8> = r.prompt_logits.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(d.join(format!("{}.logits.f32", case.name)), bytes)?;
        }
        if !a.json {
            print_case(&r);
        }
        results.push(r);
    }
    let failed: Vec<String> = results.iter().filter(|r| !r.pass()).map(|r| r.name.clone()).collect();
    if a.json {
        let cases: Vec<Value> = results
            .iter()
            .map(|r| {
                json!({
                    "name": r.name,
                    "steps": r.top.iter().map(|s| json!({"top": s.iter().map(|(i, l)| json!([i, l])).collect::<Vec<_>>()})).collect::<Vec<_>>(),
                    "judged": r.judged,
                    "argmax_checked": r.argmax_checked,
                    "argmax_mismatches": r.argmax_mismatches,
                    "max_top5_diff": r.max_top5_diff,
                    "rmse": r.rmse,
                    "pass": r.pass(),
                })
            })
            .collect();
        println!("{}", json!({"cases": cases, "pass": failed.is_empty()}));
    } else if failed.is_empty() {
        println!("all {} cases pass", results.len());
    }
    if failed.is_empty() { Ok(()) } else { Err(Failed(failed).into()) }
}

fn print_case(r: &Outcome) {
    let rmse = r.rmse.map_or("-".to_string(), |v| format!("{v:.4}"));
    let verdict = if !r.judged { "-" } else if r.pass() { "pass" } else { "FAIL" };
    println!(
        "{:<12} steps {:>3}  argmax {:>2}/{:<2} agree  max|top5 diff| {:.4}  rmse {}  {}",
        r.name,
        r.top.len(),
        r.argmax_checked - r.argmax_mismatches.len(),
        r.argmax_checked,
        r.max_top5_diff,
        rmse,
        verdict
    );
    if !r.argmax_mismatches.is_empty() {
        println!("             argmax differs at steps {:?}", r.argmax_mismatches);
    }
    if let Some(first) = r.top.first() {
        let top: Vec<String> = first.iter().map(|(i, l)| format!("{i}:{l:.3}")).collect();
        println!("             top after prompt: {}", top.join(" "));
    }
}
