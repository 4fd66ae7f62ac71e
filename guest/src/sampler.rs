//! Picks the next token from logits, as llama.cpp's default chain: repetition penalty, then
//! greedy argmax (temperature 0), or top-k, top-p, min-p, temperature and a seeded draw.

/// Sampling settings (the `sampling` record of the WIT).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: u32,
    pub seed: u64,
    /// Report the step's log-probabilities, with those of this many most likely tokens.
    pub logprobs: Option<u32>,
}

impl Params {
    pub fn greedy() -> Params {
        Params {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
            logprobs: None,
        }
    }

    /// Why these settings cannot be used, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        let ok = self.temperature.is_finite()
            && (0.0..=1.0).contains(&self.top_p)
            && (0.0..=1.0).contains(&self.min_p)
            && self.repeat_penalty.is_finite()
            && self.repeat_penalty > 0.0
            && self.logprobs.is_none_or(|k| k <= MAX_TOP_LOGPROBS);
        if ok { Ok(()) } else { Err(format!("invalid sampling settings {self:?}")) }
    }
}

/// The most alternatives a step's log-probabilities list (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The log-probabilities of `token` and of the `k` most likely tokens (most likely first, equals
/// by id) under the softmax of `logits`, in f64 and rounded once.
pub fn logprobs(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    let lp = |l: f32| (l as f64 - log_z) as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (id, &l) in logits.iter().enumerate() {
        // Kept sorted, largest first; an equal logit keeps the smaller id first.
        if top.len() == k && top.last().is_none_or(|&(_, m)| l <= m) {
            continue;
        }
        let at = top.partition_point(|&(_, m)| m >= l);
        top.insert(at, (id as u32, l));
        top.truncate(k);
    }
    let picked = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| lp(l));
    (picked, top.into_iter().map(|(id, l)| (id, lp(l))).collect())
}

/// A small seeded generator (SplitMix64): the same seed gives the same tokens on every host.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Per-session sampler state: its generator and scratch.
pub struct Sampler {
    rng: Rng,
    seed: Option<u64>,
    logits: Vec<f32>,
    candidates: Vec<(u32, f32)>,
}

impl Default for Sampler {
    fn default() -> Self {
        Sampler { rng: Rng::new(0), seed: None, logits: Vec::new(), candidates: Vec::new() }
    }
}

impl Sampler {
    /// The next token given `logits` and the tokens seen so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32], p: &Params) -> u32 {
        if self.seed != Some(p.seed) {
            self.seed = Some(p.seed);
            self.rng = Rng::new(p.seed);
        }
        // The logits are copied only when a penalty changes them.
        let penalized = p.repeat_penalty != 1.0 && p.repeat_last_n > 0;
        if penalized {
            self.logits.clear();
            self.logits.extend_from_slice(logits);
            let recent = &history[history.len().saturating_sub(p.repeat_last_n as usize)..];
            let mut seen: Vec<u32> = recent.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &id in &seen {
                if let Some(l) = self.logits.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / p.repeat_penalty } else { *l * p.repeat_penalty };
                }
            }
        }
        let logits = if penalized { &self.logits[..] } else { logits };
        if p.temperature <= 0.0 {
            return argmax(logits);
        }

        let c = &mut self.candidates;
        // Without a top-k, the candidates a top-p or min-p cut keeps, and the mass of them all.
        let mass = if p.top_k == 0 && (p.top_p < 1.0 || p.min_p > 0.0) {
            nucleus(logits, p.top_p, p.min_p, c)
        } else {
            top_candidates(logits, p.top_k as usize, c);
            None
        };
        if c.is_empty() {
            return 0;
        }
        // Probabilities at temperature 1 for top-p and min-p, as llama.cpp's chain computes them
        // before the temperature step.
        let max = c[0].1;
        let probs: Vec<f64> = c.iter().map(|&(_, l)| ((l - max) as f64).exp()).collect();
        let total: f64 = mass.unwrap_or_else(|| probs.iter().sum());
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, pr) in probs.iter().enumerate() {
                cum += pr / total;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            // probs[0] is the largest: exp(0) = 1.
            let n = probs[..keep].iter().take_while(|&&pr| pr >= p.min_p as f64).count();
            keep = n.max(1);
        }
        c.truncate(keep);
        let weights: Vec<f64> =
            c.iter().map(|&(_, l)| (((l - max) / p.temperature) as f64).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut r = self.rng.uniform() * total;
        for (i, w) in weights.iter().enumerate() {
            if r < *w {
                return c[i].0;
            }
            r -= w;
        }
        c[c.len() - 1].0
    }
}

/// The order of candidates: larger logits first, then smaller ids.
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// `c` = the `k` best `(id, logit)` of `logits` in `by_logit` order (all of them for `k` 0),
/// NaNs and minus infinities left out. One pass that keeps at most `2k` candidates: when full, the best `k` stay and
/// the worst of them becomes the bar a later logit must pass (a later equal logit has a larger
/// id: it ranks below). Not a list of the whole vocabulary selected down (262,144 pairs each
/// step: ~5 ms a token in wasm).
fn top_candidates(logits: &[f32], k: usize, c: &mut Vec<(u32, f32)>) {
    c.clear();
    let cap = if k > 0 { (2 * k).max(64) } else { usize::MAX };
    let mut bar: Option<f32> = None;
    for (i, &l) in logits.iter().enumerate() {
        // NaN has no rank, and minus infinity no probability (a constraint's masked tokens).
        if l.is_nan() || l == f32::NEG_INFINITY || bar.is_some_and(|b| l <= b) {
            continue;
        }
        c.push((i as u32, l));
        if c.len() >= cap {
            c.select_nth_unstable_by(k - 1, by_logit);
            c.truncate(k);
            bar = c.last().map(|&(_, l)| l);
        }
    }
    if k > 0 && k < c.len() {
        c.select_nth_unstable_by(k - 1, by_logit);
        c.truncate(k);
    }
    c.sort_unstable_by(by_logit);
}

/// Without a top-k: `c` = the best candidates in `by_logit` order, enough of them that the top-p
/// cut (the mass of all the logits' probabilities at temperature 1 reached) or the min-p cut
/// (a probability below `min_p` of the largest) falls among them, and the mass of all; `None`
/// when the largest logit is not finite (then `c` holds every candidate, and the mass is theirs
/// to sum). Found by `top_candidates` for 256, 2048, ... until the cut is inside: one pass or
/// two for a model's logits, where sorting all 262,144 cost ~10 ms a token in wasm. The mass
/// sums f32 exponentials (`kernels::sum_exp`, within ~1e-6 of the f64 sum).
fn nucleus(logits: &[f32], top_p: f32, min_p: f32, c: &mut Vec<(u32, f32)>) -> Option<f64> {
    let max = crate::kernels::max_value(logits);
    if !max.is_finite() {
        top_candidates(logits, 0, c);
        return None;
    }
    let total = crate::kernels::sum_exp(logits, max);
    let mut k = 256usize;
    loop {
        top_candidates(logits, k, c);
        if c.len() < k {
            return Some(total);
        }
        // The same sums as the cut in `sample`, so that the cut it makes is among these.
        let mut cum = 0.0;
        for &(_, l) in c.iter() {
            let pr = ((l - max) as f64).exp();
            if min_p > 0.0 && pr < min_p as f64 {
                return Some(total);
            }
            cum += pr / total;
            if top_p < 1.0 && cum >= top_p as f64 {
                return Some(total);
            }
        }
        k = k.saturating_mul(8);
    }
}

/// The index of the largest value; the first on ties; NaNs never win.
pub fn argmax(v: &[f32]) -> u32 {
    crate::kernels::argmax(v) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_of_the_logits() {
        let logits = [1.0f32, 3.0, 3.0, -1.0, 2.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let want = |l: f32| (l as f64 - z.ln()) as f32;
        let (picked, top) = logprobs(&logits, 4, 3);
        assert_eq!(picked, want(2.0));
        // Most likely first, equals by id.
        assert_eq!(top, vec![(1, want(3.0)), (2, want(3.0)), (4, want(2.0))]);
        assert_eq!(logprobs(&logits, 0, 0).1, vec![]);
        assert_eq!(logprobs(&logits, 3, 9).1.len(), 5);
        // Large logits do not overflow.
        let (p, _) = logprobs(&[1e30, 0.0], 0, 1);
        assert_eq!(p, 0.0);
        let mut params = Params::greedy();
        params.logprobs = Some(MAX_TOP_LOGPROBS + 1);
        assert!(params.check().is_err());
    }

    #[test]
    fn greedy_is_argmax_with_penalty() {
        let logits = [1.0, 3.0, 2.0, -1.0];
        let mut s = Sampler::default();
        assert_eq!(s.sample(&logits, &[], &Params::greedy()), 1);
        let p = Params { repeat_penalty: 2.0, ..Params::greedy() };
        // 3.0 / 2 = 1.5 < 2.0
        assert_eq!(s.sample(&logits, &[1], &p), 2);
    }

    #[test]
    fn same_seed_same_draws_and_top_k_bounds() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = Params { temperature: 1.0, top_k: 5, seed: 42, ..Params::greedy() };
        let draw = |p: &Params| {
            let mut s = Sampler::default();
            (0..50).map(|_| s.sample(&logits, &[], p)).collect::<Vec<_>>()
        };
        let a = draw(&p);
        assert_eq!(a, draw(&p));
        assert_ne!(a, draw(&Params { seed: 43, ..p }));
        // The top 5 logits are the value 1.8 (i % 7 == 6): ids 6, 13, 20, 27, 34.
        assert!(a.iter().all(|&id| id % 7 == 6 && id <= 34), "{a:?}");
    }

    /// The one-pass selection gives what sorting every non-NaN logit and keeping the first `k`
    /// gives: with ties across compactions, NaNs, infinities, and fewer finite logits than `k`.
    #[test]
    fn top_candidates_equal_a_full_sort() {
        let mut rng = crate::quant::tests::Rng(0x5eed_1234_9876_0001);
        for n in [0usize, 1, 5, 63, 64, 65, 200, 1000, 5000] {
            for k in [0usize, 1, 2, 5, 40, 64, 100, 10_000] {
                for round in 0..3 {
                    let logits: Vec<f32> = (0..n)
                        .map(|_| match (round, rng.next_u64() % 10) {
                            (1, 0) => f32::NAN,
                            (1, 1) => f32::NEG_INFINITY,
                            (1, 2) => f32::INFINITY,
                            (2, r) if r < 8 => (r % 3) as f32,
                            _ => rng.f32() * 8.0,
                        })
                        .collect();
                    let mut want: Vec<(u32, f32)> =
                        logits.iter().enumerate().filter(|(_, l)| !l.is_nan() && **l != f32::NEG_INFINITY).map(|(i, &l)| (i as u32, l)).collect();
                    want.sort_by(by_logit);
                    if k > 0 {
                        want.truncate(k);
                    }
                    let mut got = Vec::new();
                    top_candidates(&logits, k, &mut got);
                    let bits = |v: &[(u32, f32)]| v.iter().map(|&(i, l)| (i, l.to_bits())).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "n={n} k={k} round {round}");
                }
            }
        }
    }

    /// Without a top-k, the candidates `nucleus` gathers are the first of a full sort and hold
    /// the top-p or min-p cut, and the mass is the f64 sum of every probability within 1e-6;
    /// from peaked logits (a model's) to flat ones (the search grows to all of them).
    #[test]
    fn nucleus_holds_the_cut() {
        let mut rng = crate::quant::tests::Rng(0x5eed_1234_9876_0002);
        for (n, spread) in [(5usize, 1.0f32), (300, 4.0), (20_000, 12.0), (20_000, 0.01), (262_144, 20.0)] {
            let logits: Vec<f32> = (0..n).map(|_| rng.f32() * spread + if rng.next_u64() % 500 == 0 { 15.0 } else { 0.0 }).collect();
            let mut sorted: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            sorted.sort_by(by_logit);
            let max = sorted[0].1;
            let exact: f64 = sorted.iter().map(|&(_, l)| ((l - max) as f64).exp()).sum();
            for (top_p, min_p) in [(0.95f32, 0.0f32), (0.5, 0.0), (1.0, 0.05), (0.9, 0.1), (0.999_999, 0.0)] {
                let mut c = Vec::new();
                let total = nucleus(&logits, top_p, min_p, &mut c).expect("finite logits");
                assert!((total - exact).abs() <= 1e-6 * exact, "n={n}: mass {total} vs {exact}");
                assert_eq!(c[..], sorted[..c.len()], "n={n} top_p={top_p} min_p={min_p}: not a prefix");
                if c.len() < n {
                    let mut cum = 0.0;
                    let inside = c.iter().any(|&(_, l)| {
                        let pr = ((l - max) as f64).exp();
                        cum += pr / total;
                        (min_p > 0.0 && pr < min_p as f64) || (top_p < 1.0 && cum >= top_p as f64)
                    });
                    assert!(inside, "n={n} top_p={top_p} min_p={min_p}: the cut is past {} candidates", c.len());
                }
            }
        }
    }

    /// Sampling without a top-k draws what sorting every logit draws, for peaked logits far from
    /// a borderline cut (the mass differs from a sorted f64 sum in the last bits only).
    #[test]
    fn no_top_k_draws_as_a_full_sort() {
        let mut rng = crate::quant::tests::Rng(0x5eed_1234_9876_0003);
        let logits: Vec<f32> = (0..50_000).map(|i| rng.f32() * 6.0 + if i % 997 == 0 { 12.0 } else { 0.0 }).collect();
        for (top_p, min_p) in [(0.95f32, 0.05f32), (0.8, 0.0), (1.0, 0.1)] {
            let p = Params { temperature: 0.8, top_k: 0, top_p, min_p, seed: 7, ..Params::greedy() };
            let mut s = Sampler::default();
            let got: Vec<u32> = (0..40).map(|_| s.sample(&logits, &[], &p)).collect();
            // The reference: every candidate sorted, the mass summed over them, then the same cuts
            // and draw.
            let mut rng = Rng::new(7);
            let mut sorted: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            sorted.sort_by(by_logit);
            let max = sorted[0].1;
            let probs: Vec<f64> = sorted.iter().map(|&(_, l)| ((l - max) as f64).exp()).collect();
            let total: f64 = probs.iter().sum();
            let mut keep = sorted.len();
            if top_p < 1.0 {
                let mut cum = 0.0;
                keep = probs.iter().position(|pr| {
                    cum += pr / total;
                    cum >= top_p as f64
                }).map_or(keep, |i| i + 1);
            }
            if min_p > 0.0 {
                keep = probs[..keep].iter().take_while(|&&pr| pr >= min_p as f64).count().max(1);
            }
            let kept = &sorted[..keep];
            let weights: Vec<f64> = kept.iter().map(|&(_, l)| (((l - max) / 0.8) as f64).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let want: Vec<u32> = (0..40)
                .map(|_| {
                    let mut r = rng.uniform() * sum;
                    for (i, w) in weights.iter().enumerate() {
                        if r < *w {
                            return kept[i].0;
                        }
                        r -= w;
                    }
                    kept[keep - 1].0
                })
                .collect();
            assert_eq!(got, want, "top_p={top_p} min_p={min_p}");
        }
    }

    #[test]
    fn tokens_at_minus_infinity_are_never_drawn() {
        // A constraint's mask: two tokens allowed among 1,000.
        let mut logits = vec![f32::NEG_INFINITY; 1000];
        logits[17] = -3.0;
        logits[600] = -3.5;
        for (top_k, top_p, min_p) in [(40, 1.0, 0.0), (0, 1.0, 0.0), (0, 0.999, 0.0), (0, 1.0, 0.01), (2, 1.0, 0.0)] {
            for seed in 0..200 {
                let p = Params { temperature: 1.5, top_k, top_p, min_p, seed, ..Params::greedy() };
                let t = Sampler::default().sample(&logits, &[], &p);
                assert!(t == 17 || t == 600, "{p:?} drew {t}");
            }
        }
    }

    #[test]
    fn min_p_and_top_p_keep_the_best() {
        let logits = [10.0, 0.0, 0.0, 0.0];
        let p = Params { temperature: 1.0, min_p: 0.1, seed: 1, ..Params::greedy() };
        let mut s = Sampler::default();
        assert!((0..20).all(|_| s.sample(&logits, &[], &p) == 0));
        let p = Params { temperature: 1.0, top_p: 0.5, seed: 1, ..Params::greedy() };
        assert!((0..20).all(|_| s.sample(&logits, &[], &p) == 0));
    }
}
