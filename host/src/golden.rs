//! Golden references and the teacher-forcing check (the format and thresholds of
//! `tests/golden/README.md`): any host that runs the wisp component can hold it to them.

use crate::runtime::{Advance, EngineError, Instance, Model};
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The smallest margin between the reference's first and second logit at which our argmax must
/// be the reference's (below it, a near-tie may flip on harmless numeric differences).
pub const MARGIN: f32 = 0.25;
/// Largest absolute difference allowed on each of the reference's top-5 logits, at every step.
pub const TOP5_TOLERANCE: f32 = 1.5;
/// Largest root-mean-square difference over the full logits after the prompt alone.
pub const RMSE_TOLERANCE: f64 = 0.6;

/// The reference after one step: its top-5 `(id, logit)` and the margin of its first logit.
#[derive(Debug, Clone)]
pub struct RefStep {
    /// The reference's five largest logits as `(token id, logit)`, largest first.
    pub top5: Vec<(u32, f32)>,
    /// The reference's first logit minus its second; 0 when the file gives none. Our argmax is
    /// only judged where this is at least [`MARGIN`].
    pub margin: f32,
}

/// One golden case.
#[derive(Debug, Clone)]
pub struct Case {
    /// The case's name, e.g. "long-gpl"; also names its logits file.
    pub name: String,
    /// The prompt's text (empty when the file omits it). Teacher forcing feeds `prompt_tokens`;
    /// the text is for tokenizer tests.
    pub prompt: String,
    /// The prompt's ids as the reference tokenizer (llama.cpp's) gives them, special tokens such
    /// as BOS included.
    pub prompt_tokens: Vec<u32>,
    /// The reference's greedy continuation, fed one token a step after the prompt.
    pub continuation: Vec<u32>,
    /// Empty when the file carries no reference steps.
    pub steps: Vec<RefStep>,
    /// The reference's full logits after the prompt, when `logits/NAME.logits.f32` exists.
    pub logits: Option<PathBuf>,
}

fn ids(v: &Value, what: &str) -> Result<Vec<u32>> {
    v.as_array()
        .with_context(|| format!("{what} is not an array"))?
        .iter()
        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()).with_context(|| format!("{what} holds a non-id")))
        .collect()
}

/// Reads a golden file (JSON with a `cases` array); reference logits are looked up in `logits/`
/// beside it. Errors when the file cannot be read or parsed, or a case lacks a name, holds ids
/// that are not `u32`, or a malformed `top5` entry.
pub fn load(path: &Path) -> Result<Vec<Case>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let golden: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let dir = path.parent().unwrap_or(Path::new(".")).join("logits");
    let mut cases = Vec::new();
    for case in golden["cases"].as_array().context("the golden file has no `cases` array")? {
        let name = case["name"].as_str().context("a case has no name")?.to_string();
        let mut steps = Vec::new();
        for s in case["steps"].as_array().into_iter().flatten() {
            let mut top5 = Vec::new();
            for pair in s["top5"].as_array().into_iter().flatten() {
                let id = pair[0].as_u64().and_then(|v| u32::try_from(v).ok()).context("top5 id")?;
                top5.push((id, pair[1].as_f64().context("top5 logit")? as f32));
            }
            steps.push(RefStep { top5, margin: s["margin"].as_f64().unwrap_or(0.0) as f32 });
        }
        let logits = dir.join(format!("{name}.logits.f32"));
        cases.push(Case {
            prompt: case["prompt"].as_str().unwrap_or_default().to_string(),
            prompt_tokens: ids(&case["prompt_tokens"], "prompt_tokens")?,
            continuation: ids(&case["continuation"], "continuation")?,
            steps,
            logits: logits.exists().then_some(logits),
            name,
        });
    }
    Ok(cases)
}

fn read_logits(path: &Path) -> Result<Vec<f32>> {
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// What teacher forcing measured on one case.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The [`Case::name`] this outcome is of.
    pub name: String,
    /// Per step, the engine's top-k `(id, logit)`.
    pub top: Vec<Vec<(u32, f32)>>,
    /// The full logits after the prompt alone.
    pub prompt_logits: Vec<f32>,
    /// Whether the case had reference steps to judge by.
    pub judged: bool,
    /// Steps whose reference margin reached [`MARGIN`], so that our argmax was compared.
    pub argmax_checked: usize,
    /// The steps (indices into the continuation) whose argmax differed from the reference's.
    pub argmax_mismatches: Vec<usize>,
    /// Largest absolute difference on any reference top-5 logit over all steps; infinite when
    /// one of ours was NaN. Compared with [`TOP5_TOLERANCE`].
    pub max_top5_diff: f32,
    /// Root-mean-square difference over the full logits after the prompt, when the case has a
    /// reference logits file. Compared with [`RMSE_TOLERANCE`].
    pub rmse: Option<f64>,
}

impl Outcome {
    /// Whether the thresholds hold (a case without references passes).
    pub fn pass(&self) -> bool {
        !self.judged
            || (self.argmax_mismatches.is_empty()
                && self.max_top5_diff <= TOP5_TOLERANCE
                && self.rmse.is_none_or(|r| r <= RMSE_TOLERANCE))
    }
}

/// The largest value's index (first on ties; NaN never wins).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] || v[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The `k` largest `(id, logit)`, largest first.
pub fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.clamp(1, order.len().max(1)).min(order.len());
    if k == 0 {
        return Vec::new();
    }
    let by = |x: &u32, y: &u32| logits[*y as usize].total_cmp(&logits[*x as usize]).then(x.cmp(y));
    order.select_nth_unstable_by(k - 1, by);
    order.truncate(k);
    order.sort_unstable_by(by);
    order.iter().map(|&id| (id, logits[id as usize])).collect()
}

fn engine<T>(r: Result<T, EngineError>) -> Result<T> {
    r.map_err(anyhow::Error::new)
}

/// Feeds `prompt_tokens + continuation` one step at a time and compares each step's logits with
/// the reference. A typed engine error is returned as the error (it fails the case).
pub fn run_case(inst: &mut Instance, model: Model, case: &Case, k: usize) -> Result<Outcome> {
    let session = engine(inst.new_session(model, case_context(case))?)?;
    engine(inst.feed(session, &case.prompt_tokens)?)?;
    let mut out = Outcome::of(case);
    for (i, &next) in case.continuation.iter().enumerate() {
        let logits = engine(inst.logits(session)?)?;
        out.observe(case, i, logits, k)?;
        engine(inst.feed(session, &[next])?)?;
    }
    inst.drop_session(session)?;
    Ok(out)
}

/// [`run_case`] for every case at once, as one batch (`model.step`): each case's session
/// brings its prompt to the first step and its next teacher-forced token to each step after,
/// leaving when its continuation ends. A session's logits are those it has alone where the
/// host's device is batch-invariant (the guest's CPU, the CPU reference), so the outcomes are
/// [`run_case`]'s; on a GPU they may differ within its rounding. An entry's error fails the run.
pub fn run_cases_together(inst: &mut Instance, model: Model, cases: &[Case], k: usize) -> Result<Vec<Outcome>> {
    let mut sessions = Vec::with_capacity(cases.len());
    for case in cases {
        sessions.push(engine(inst.new_session(model, case_context(case))?)?);
    }
    let mut outcomes: Vec<Outcome> = cases.iter().map(Outcome::of).collect();
    let longest = cases.iter().map(|c| c.continuation.len()).max().unwrap_or(0);
    for i in 0..=longest {
        // Step `i` brings each case still going its prompt (i = 0) or its token `i - 1`.
        let going: Vec<usize> = (0..cases.len()).filter(|&c| i <= cases[c].continuation.len() && (i > 0 || !cases[c].continuation.is_empty())).collect();
        let fed: Vec<Vec<u32>> =
            going.iter().map(|&c| if i == 0 { cases[c].prompt_tokens.clone() } else { vec![cases[c].continuation[i - 1]] }).collect();
        let work: Vec<Advance<'_>> = going.iter().zip(&fed).map(|(&c, tokens)| Advance { session: sessions[c], tokens, sample: None }).collect();
        for (&c, r) in going.iter().zip(engine(inst.step(model, &work)?)?) {
            engine(r).with_context(|| format!("case {} at step {i}", cases[c].name))?;
        }
        for &c in &going {
            if i < cases[c].continuation.len() {
                let logits = engine(inst.logits(sessions[c])?)?;
                outcomes[c].observe(&cases[c], i, logits, k)?;
            }
        }
    }
    for s in sessions {
        inst.drop_session(s)?;
    }
    Ok(outcomes)
}

/// A session's room for a case: its prompt, its continuation and one more.
fn case_context(case: &Case) -> u32 {
    (case.prompt_tokens.len() + case.continuation.len() + 1) as u32
}

impl Outcome {
    /// Nothing measured yet, of `case`.
    fn of(case: &Case) -> Outcome {
        Outcome {
            name: case.name.clone(),
            top: Vec::new(),
            prompt_logits: Vec::new(),
            judged: !case.steps.is_empty(),
            argmax_checked: 0,
            argmax_mismatches: Vec::new(),
            max_top5_diff: 0.0,
            rmse: None,
        }
    }

    /// Judges the logits of step `i` (after the prompt and `i` tokens of the continuation)
    /// against the reference's, keeping their top `k`.
    fn observe(&mut self, case: &Case, i: usize, logits: Vec<f32>, k: usize) -> Result<()> {
        let next = case.continuation[i];
        if i == 0 {
            if let Some(path) = &case.logits {
                let reference = read_logits(path)?;
                if reference.len() != logits.len() {
                    bail!("{}: the reference has {} logits, the model {}", case.name, reference.len(), logits.len());
                }
                let se: f64 = logits.iter().zip(&reference).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
                self.rmse = Some((se / logits.len() as f64).sqrt());
            }
        }
        self.top.push(top_k(&logits, k));
        if let Some(step) = case.steps.get(i) {
            if step.margin >= MARGIN {
                self.argmax_checked += 1;
                if argmax(&logits) != next {
                    self.argmax_mismatches.push(i);
                }
            }
            for &(id, want) in &step.top5 {
                let got = *logits.get(id as usize).context("a reference id is past the vocabulary")?;
                let diff = (got - want).abs();
                self.max_top5_diff = if diff.is_nan() { f32::INFINITY } else { self.max_top5_diff.max(diff) };
            }
        }
        if i == 0 {
            self.prompt_logits = logits;
        }
        Ok(())
    }
}
