//! `wisp eval`: teacher forcing over a golden file, judged by the thresholds of
//! `tests/golden/README.md`.

use super::{ModelArgs, engine, load};
use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// Where the reference's argmax must be ours.
pub const MARGIN: f32 = 0.25;
/// Largest difference allowed on each of the reference's top-5 logits.
pub const TOP5_TOLERANCE: f32 = 1.5;
/// Largest root-mean-square difference over the full logits after the prompt.
pub const RMSE_TOLERANCE: f64 = 0.6;

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

fn ids(v: &Value, what: &str) -> Result<Vec<u32>> {
    v.as_array()
        .with_context(|| format!("{what} is not an array"))?
        .iter()
        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()).with_context(|| format!("{what} holds a non-id")))
        .collect()
}

fn read_logits(path: &Path) -> Result<Option<Vec<f32>>> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// What one case measured.
struct CaseResult {
    name: String,
    steps: Vec<Vec<(u32, f32)>>,
    judged: bool,
    argmax_checked: usize,
    argmax_mismatches: Vec<usize>,
    max_top5_diff: f32,
    rmse: Option<f64>,
}

impl CaseResult {
    fn pass(&self) -> bool {
        self.argmax_mismatches.is_empty()
            && self.max_top5_diff <= TOP5_TOLERANCE
            && self.rmse.is_none_or(|r| r <= RMSE_TOLERANCE)
    }
}

pub fn eval(a: EvalArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.golden).with_context(|| format!("reading {}", a.golden.display()))?;
    let golden: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", a.golden.display()))?;
    let cases = golden["cases"].as_array().context("the golden file has no `cases` array")?;
    let logits_dir = a.golden.parent().unwrap_or(Path::new(".")).join("logits");
    if let Some(d) = &a.dump_logits {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let mut loaded = load(&a.model)?;
    let (inst, model) = (&mut loaded.inst, loaded.model);
    let mut results = Vec::new();
    for case in cases {
        let name = case["name"].as_str().context("a case has no name")?.to_string();
        if !a.cases.is_empty() && !a.cases.contains(&name) {
            continue;
        }
        let prompt = ids(&case["prompt_tokens"], "prompt_tokens")?;
        let cont = ids(&case["continuation"], "continuation")?;
        let refs = case["steps"].as_array();
        let n_ctx = (prompt.len() + cont.len() + 1) as u32;
        let session = engine(inst.new_session(model, n_ctx)?)?;
        engine(inst.feed(session, &prompt)?)?;
        let mut r = CaseResult {
            name: name.clone(),
            steps: Vec::new(),
            judged: refs.is_some(),
            argmax_checked: 0,
            argmax_mismatches: Vec::new(),
            max_top5_diff: 0.0,
            rmse: None,
        };
        for (i, &next) in cont.iter().enumerate() {
            let logits = engine(inst.logits(session)?)?;
            if i == 0 {
                if let Some(d) = &a.dump_logits {
                    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
                    std::fs::write(d.join(format!("{name}.logits.f32")), bytes)?;
                }
                if let Some(reference) = read_logits(&logits_dir.join(format!("{name}.logits.f32")))? {
                    if reference.len() != logits.len() {
                        bail!("{name}: reference has {} logits, the model {}", reference.len(), logits.len());
                    }
                    let se: f64 = logits.iter().zip(&reference).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
                    r.rmse = Some((se / logits.len() as f64).sqrt());
                }
            }
            let mut order: Vec<u32> = (0..logits.len() as u32).collect();
            let k = (a.top as usize).clamp(1, order.len());
            let by = |x: &u32, y: &u32| logits[*y as usize].total_cmp(&logits[*x as usize]).then(x.cmp(y));
            order.select_nth_unstable_by(k - 1, by);
            order.truncate(k);
            order.sort_unstable_by(by);
            r.steps.push(order.iter().map(|&id| (id, logits[id as usize])).collect());
            if let Some(step) = refs.and_then(|s| s.get(i)) {
                let margin = step["margin"].as_f64().unwrap_or(0.0) as f32;
                let argmax = wisp_argmax(&logits);
                if margin >= MARGIN {
                    r.argmax_checked += 1;
                    if argmax != next {
                        r.argmax_mismatches.push(i);
                    }
                }
                for pair in step["top5"].as_array().into_iter().flatten() {
                    let id = pair[0].as_u64().context("top5 id")? as usize;
                    let want = pair[1].as_f64().context("top5 logit")? as f32;
                    let got = *logits.get(id).context("top5 id past the vocabulary")?;
                    r.max_top5_diff = r.max_top5_diff.max((got - want).abs());
                }
            }
            engine(inst.feed(session, &[next])?)?;
        }
        inst.drop_session(session)?;
        if !a.json {
            print_case(&r);
        }
        results.push(r);
    }
    if results.is_empty() {
        bail!("no case matched");
    }
    let failed: Vec<String> = results.iter().filter(|r| r.judged && !r.pass()).map(|r| r.name.clone()).collect();
    if a.json {
        let cases: Vec<Value> = results
            .iter()
            .map(|r| {
                json!({
                    "name": r.name,
                    "steps": r.steps.iter().map(|s| json!({"top": s.iter().map(|(i, l)| json!([i, l])).collect::<Vec<_>>()})).collect::<Vec<_>>(),
                    "judged": r.judged,
                    "argmax_checked": r.argmax_checked,
                    "argmax_mismatches": r.argmax_mismatches,
                    "max_top5_diff": r.max_top5_diff,
                    "rmse": r.rmse,
                    "pass": !r.judged || r.pass(),
                })
            })
            .collect();
        println!("{}", json!({"cases": cases, "pass": failed.is_empty()}));
    }
    if failed.is_empty() { Ok(()) } else { Err(Failed(failed).into()) }
}

fn wisp_argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn print_case(r: &CaseResult) {
    let rmse = r.rmse.map_or("-".to_string(), |v| format!("{v:.4}"));
    let verdict = if !r.judged { "-" } else if r.pass() { "pass" } else { "FAIL" };
    println!(
        "{:<12} steps {:>3}  argmax {:>2}/{:<2} agree  max|top5 diff| {:.4}  rmse {}  {}",
        r.name,
        r.steps.len(),
        r.argmax_checked - r.argmax_mismatches.len(),
        r.argmax_checked,
        r.max_top5_diff,
        rmse,
        verdict
    );
    if !r.argmax_mismatches.is_empty() {
        println!("             argmax differs at steps {:?}", r.argmax_mismatches);
    }
    if let Some(first) = r.steps.first() {
        let top: Vec<String> = first.iter().map(|(i, l)| format!("{i}:{l:.3}")).collect();
        println!("             top after prompt: {}", top.join(" "));
    }
}
