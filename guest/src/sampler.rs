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
        }
    }

    /// Why these settings cannot be used, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        let ok = self.temperature.is_finite()
            && (0.0..=1.0).contains(&self.top_p)
            && (0.0..=1.0).contains(&self.min_p)
            && self.repeat_penalty.is_finite()
            && self.repeat_penalty > 0.0;
        if ok { Ok(()) } else { Err(format!("invalid sampling settings {self:?}")) }
    }
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
        let penalized = p.repeat_penalty != 1.0 && p.repeat_last_n > 0;
        if p.temperature <= 0.0 && !penalized {
            return argmax(logits);
        }
        self.logits.clear();
        self.logits.extend_from_slice(logits);
        if penalized {
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
        if p.temperature <= 0.0 {
            return argmax(&self.logits);
        }

        let c = &mut self.candidates;
        c.clear();
        c.extend(self.logits.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| (i as u32, l)));
        if c.is_empty() {
            return 0;
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && (p.top_k as usize) < c.len() {
            c.select_nth_unstable_by(p.top_k as usize - 1, by_logit);
            c.truncate(p.top_k as usize);
        }
        c.sort_unstable_by(by_logit);
        // Probabilities at temperature 1 for top-p and min-p, as llama.cpp's chain computes them
        // before the temperature step.
        let max = c[0].1;
        let probs: Vec<f64> = c.iter().map(|&(_, l)| ((l - max) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
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

/// The index of the largest value; the first on ties; NaNs never win.
pub fn argmax(v: &[f32]) -> u32 {
    crate::kernels::argmax(v) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

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
