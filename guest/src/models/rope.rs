//! Rotary position embeddings (RoPE, Su et al. 2021): per batch, a table of cosines and sines
//! for each position and frequency, then a rotation of every query and key head.

use crate::kernels::rotate_pairs;

/// Which elements of a head rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// `(x[j], x[j + half])`: GPT-NeoX, Gemma, Qwen2 (llama.cpp's `ROPE_TYPE_NEOX`).
    Neox,
    /// `(x[2j], x[2j + 1])`: Llama as converted to GGUF (llama.cpp's `ROPE_TYPE_NORM`).
    Norm,
}

/// The frequencies of one kind of layer: `theta(p, j) = p / scale * base^(-2j / dim) / factor[j]`,
/// the table holding `m(p) * cos(theta)` and `m(p) * sin(theta)`, `m(p)` = `mscale` (times the
/// temperature of position `p` where there is one).
#[derive(Debug, Clone, PartialEq)]
pub struct Freqs {
    pub base: f64,
    /// Linear position scaling (`rope.scaling.factor`); 1 is none.
    pub scale: f64,
    /// Per-frequency divisors (`rope_freqs.weight`, Llama 3's long-context scaling; Phi-3.5's
    /// `rope_factors_long` / `_short`; YaRN's blend of interpolation and extrapolation), `[dim / 2]`.
    pub factors: Option<Vec<f64>>,
    /// The cosines' and sines' factor (Phi-3.5's `rope.scaling.attn_factor`, YaRN's magnitude
    /// correction, ggml's `mscale`); 1 is none.
    pub mscale: f64,
    /// Llama 4's attention temperature (Mistral 3's queries), where there is one.
    pub temperature: Option<Temperature>,
}

/// Position `p`'s rows also times `1 + beta ln(floor(p / floor) + 1)`: 1 below `floor`, then
/// slowly more (llama.cpp's `attn_temp`, with no offset), for a table that turns queries alone.
#[derive(Debug, Clone, PartialEq)]
pub struct Temperature {
    pub beta: f64,
    /// Positive.
    pub floor: usize,
}

impl Temperature {
    /// The factor of position `p`.
    pub fn at(&self, p: usize) -> f64 {
        1.0 + self.beta * ((p / self.floor) as f64 + 1.0).ln()
    }
}

impl Freqs {
    /// Base `base` and linear scale `scale`, with no factors.
    pub fn new(base: f64, scale: f64) -> Freqs {
        Freqs { base, scale, factors: None, mscale: 1.0, temperature: None }
    }
}

/// Positions between angles computed afresh with `cos` and `sin` (the multiples of `ANCHOR`);
/// the positions in between turn the previous position's angles by one position's step (angle
/// addition in f64: after 63 steps within ~1e-14 of the exact values, far below an f32's
/// rounding). A wasm `cos` and `sin` a (position, frequency) pair had been ~15% of the guest's
/// own work in a prefill (a throwaway probe, Gemma, batches of 64). A position's row is so the
/// same whatever batch it comes in (a batch that starts between anchors steps from the anchor
/// before it).
const ANCHOR: usize = 64;

/// `cos, sin: [batch, dim / 2]` for the positions of one batch. A table filled again with the
/// same frequencies keeps their steps, and a fill that starts where the last one ended turns
/// the last row's angles once (a decode step's row: one turn a frequency, not an anchor's
/// `cos` and `sin` and up to 63 turns); the rows are the same bits either way.
pub struct Table {
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// `base^(-2j / dim)` of the frequencies last filled (`of`), `[dim / 2]`: one `powf` a
    /// frequency, not one a (position, frequency) pair.
    freq: Vec<f64>,
    /// `(cos, sin)` of one position's step of each frequency, and of the last row filled.
    step: Vec<(f64, f64)>,
    at: Vec<(f64, f64)>,
    dim: usize,
    /// The frequencies `freq` and `step` are of, and the position after the last row filled
    /// (whose angles `at` holds).
    of: Option<Freqs>,
    next: Option<usize>,
}

impl Table {
    pub fn new(batch: usize, dim: usize) -> Table {
        let half = dim / 2;
        Table {
            cos: vec![0.0; batch * half],
            sin: vec![0.0; batch * half],
            freq: vec![0.0; half],
            step: vec![(1.0, 0.0); half],
            at: vec![(1.0, 0.0); half],
            dim,
            of: None,
            next: None,
        }
    }

    pub fn bytes(&self) -> usize {
        4 * (self.cos.len() + self.sin.len()) + 8 * self.freq.len() + 16 * (self.step.len() + self.at.len())
    }

    /// Fills the rows of positions `pos..pos + t`.
    pub fn fill(&mut self, f: &Freqs, pos: usize, t: usize) {
        let (dim, half) = (self.dim, self.dim / 2);
        let factor = |j: usize| f.factors.as_ref().map_or(1.0, |factors| factors[j]);
        if self.of.as_ref() != Some(f) {
            for (j, freq) in self.freq.iter_mut().enumerate() {
                *freq = f.base.powf(-2.0 * j as f64 / dim as f64);
            }
            for (j, step) in self.step.iter_mut().enumerate() {
                let theta = self.freq[j] / f.scale / factor(j);
                *step = (theta.cos(), theta.sin());
            }
            self.of = Some(f.clone());
            self.next = None;
        }
        // The last row filled is the one before `pos`: its angles turn once into `pos`'s.
        let goes_on = self.next == Some(pos);
        let turn = |at: &mut [(f64, f64)], step: &[(f64, f64)]| {
            for (at, &(dc, ds)) in at.iter_mut().zip(step) {
                let (c, s) = *at;
                *at = (c * dc - s * ds, s * dc + c * ds);
            }
        };
        for i in 0..t {
            let p = pos + i;
            if (i == 0 && !goes_on) || p.is_multiple_of(ANCHOR) {
                let anchor = p - p % ANCHOR;
                let a = anchor as f64 / f.scale;
                for (j, at) in self.at.iter_mut().enumerate() {
                    let theta = a * self.freq[j] / factor(j);
                    *at = (theta.cos(), theta.sin());
                }
                for _ in anchor..p {
                    turn(&mut self.at, &self.step);
                }
            } else {
                turn(&mut self.at, &self.step);
            }
            let row = i * half..(i + 1) * half;
            let m = f.mscale * f.temperature.as_ref().map_or(1.0, |t| t.at(p));
            for ((c, s), &(ac, as_)) in self.cos[row.clone()].iter_mut().zip(&mut self.sin[row]).zip(&self.at) {
                (*c, *s) = ((ac * m) as f32, (as_ * m) as f32);
            }
        }
        self.next = (t > 0).then_some(pos + t).or(self.next);
    }

    /// The first `t` rows as a program's `rotate` takes its table: each row's cosines, then
    /// its sines.
    pub fn rows(&self, t: usize) -> Vec<f32> {
        let half = self.dim / 2;
        let mut out = Vec::with_capacity(t * self.dim);
        for i in 0..t {
            out.extend_from_slice(&self.cos[i * half..(i + 1) * half]);
            out.extend_from_slice(&self.sin[i * half..(i + 1) * half]);
        }
        out
    }

    /// The first `t` rows, as `rows` gives them, into `out` (`t * dim` values).
    pub fn write_rows(&self, t: usize, out: &mut [f32]) {
        let half = self.dim / 2;
        for (i, row) in out.chunks_exact_mut(self.dim).take(t).enumerate() {
            row[..half].copy_from_slice(&self.cos[i * half..(i + 1) * half]);
            row[half..].copy_from_slice(&self.sin[i * half..(i + 1) * half]);
        }
    }

    /// Rotates one head (`[dim]`) of the batch's `i`-th token.
    pub fn rotate(&self, style: Style, i: usize, x: &mut [f32]) {
        let half = self.dim / 2;
        let (cos, sin) = (&self.cos[i * half..(i + 1) * half], &self.sin[i * half..(i + 1) * half]);
        match style {
            Style::Neox => {
                let (a, b) = x.split_at_mut(half);
                rotate_pairs(a, b, cos, sin);
            }
            Style::Norm => {
                for (j, pair) in x.chunks_exact_mut(2).enumerate() {
                    let (x0, x1) = (pair[0], pair[1]);
                    pair[0] = x0 * cos[j] - x1 * sin[j];
                    pair[1] = x0 * sin[j] + x1 * cos[j];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row of a long batch, anchored or turned from the row before, holds the cosines and
    /// sines of its angles computed afresh, to within an f32's rounding; with linear scaling
    /// and per-frequency factors too, and times a magnitude and a temperature that grows past
    /// its floor (100: rows 7..307 cross it thrice).
    #[test]
    fn turned_rows_match_fresh_angles() {
        let (dim, t) = (256, 300);
        let factors: Vec<f64> = (0..dim / 2).map(|j| 1.0 + (j % 7) as f64 * 0.5).collect();
        for (f, pos) in [
            (Freqs::new(1e6, 1.0), 30_000),
            (Freqs { factors: Some(factors.clone()), ..Freqs::new(1e4, 8.0) }, 7),
            (Freqs { factors: Some(factors), mscale: 1.1, temperature: Some(Temperature { beta: 0.1, floor: 100 }), ..Freqs::new(1e4, 1.0) }, 7),
        ] {
            let mut table = Table::new(t, dim);
            table.fill(&f, pos, t);
            for i in 0..t {
                for j in 0..dim / 2 {
                    let factor = f.factors.as_ref().map_or(1.0, |x| x[j]);
                    let theta = (pos + i) as f64 / f.scale * f.base.powf(-2.0 * j as f64 / dim as f64) / factor;
                    let m = f.mscale * f.temperature.as_ref().map_or(1.0, |t| 1.0 + t.beta * (((pos + i) / t.floor) as f64 + 1.0).ln());
                    let (c, s) = (table.cos[i * dim / 2 + j], table.sin[i * dim / 2 + j]);
                    assert!((c as f64 - m * theta.cos()).abs() < 2e-7, "cos row {i} freq {j}: {c} vs {}", m * theta.cos());
                    assert!((s as f64 - m * theta.sin()).abs() < 2e-7, "sin row {i} freq {j}: {s} vs {}", m * theta.sin());
                }
            }
        }
    }

    /// A position's row does not depend on the batch it comes in: from batches that start
    /// before it, at it, between anchors or on one, of any length, bit for bit the row of a
    /// batch of one at that position (so that a session's logits do not depend on how its
    /// tokens were batched).
    #[test]
    fn a_position_reads_the_same_in_any_batch() {
        let factors: Vec<f64> = (0..32).map(|j| 1.0 + (j % 5) as f64 * 0.25).collect();
        for f in [Freqs::new(1e4, 1.0), Freqs { factors: Some(factors), mscale: 1.25, ..Freqs::new(1e6, 4.0) }] {
            let mut one = Table::new(1, 64);
            for (start, t) in [(1000usize, 128usize), (0, 200), (63, 2), (64, 65), (5, 130), (1023, 1)] {
                let mut batch = Table::new(t, 64);
                batch.fill(&f, start, t);
                for i in 0..t {
                    one.fill(&f, start + i, 1);
                    for j in 0..32 {
                        let p = start + i;
                        assert_eq!(batch.cos[i * 32 + j].to_bits(), one.cos[j].to_bits(), "cos at {p} (batch from {start}) freq {j}");
                        assert_eq!(batch.sin[i * 32 + j].to_bits(), one.sin[j].to_bits(), "sin at {p} (batch from {start}) freq {j}");
                    }
                }
                // The f64 angles the rows round (an f32 rounding hides most differences).
                assert_eq!(batch.at, one.at, "angles at {} (batch from {start})", start + t - 1);
            }
        }
    }

    /// A table filled again where its last fill ended (decode, one row a step) turns its last
    /// angles on, and gives the bits of a table filled afresh; so after a fill elsewhere (a
    /// truncated session), with other frequencies, and across anchors, in batches of any length.
    #[test]
    fn a_table_that_goes_on_reads_as_a_fresh_one() {
        let a = Freqs::new(1e4, 1.0);
        let b = Freqs { factors: Some((0..32).map(|j| 1.0 + j as f64 * 0.125).collect()), ..Freqs::new(1e6, 2.0) };
        let mut kept = Table::new(70, 64);
        let fills: [(&Freqs, usize, usize); 12] =
            [(&a, 0, 5), (&a, 5, 1), (&a, 6, 60), (&a, 66, 1), (&a, 67, 1), (&b, 68, 1), (&b, 69, 3), (&a, 72, 1), (&a, 10, 1), (&a, 11, 70), (&a, 81, 0), (&a, 81, 1)];
        for (f, pos, t) in fills {
            kept.fill(f, pos, t);
            let mut fresh = Table::new(t, 64);
            fresh.fill(f, pos, t);
            let bits = |v: &[f32]| v[..t * 32].iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&kept.cos), bits(&fresh.cos), "cos of {t} rows from {pos}");
            assert_eq!(bits(&kept.sin), bits(&fresh.sin), "sin of {t} rows from {pos}");
            if t > 0 {
                assert_eq!(kept.at, fresh.at, "angles at {}", pos + t - 1);
            }
        }
    }

    /// A decode step's tables (one row each) for 64 sessions of a Gemma-like model (two kinds
    /// of layer, heads of 256), by hand: `WISP_GUEST_TEST_ARGS="--ignored rope_bench"`.
    #[test]
    #[ignore]
    fn rope_bench() {
        let freqs = [Freqs::new(1e4, 1.0), Freqs::new(1e6, 1.0)];
        // Tables made afresh for each row (as batched passes made them), and kept by each
        // session (as they are now): the next position's row turns the last one's angles.
        let mut kept: Vec<Table> = (0..128).map(|_| Table::new(1, 256)).collect();
        for (best, fresh) in [(f64::INFINITY, true), (f64::INFINITY, false)].iter_mut() {
            for round in 0..5 {
                let start = std::time::Instant::now();
                for s in 0..64usize {
                    for (k, f) in freqs.iter().enumerate() {
                        let mut made;
                        let table = match fresh {
                            true => {
                                made = Table::new(1, 256);
                                &mut made
                            }
                            false => &mut kept[2 * s + k],
                        };
                        table.fill(f, 130 + 7 * s + round, 1);
                        std::hint::black_box(&table.cos);
                    }
                }
                *best = best.min(start.elapsed().as_secs_f64());
            }
            println!("64 sessions' decode tables, {}: {:.0} us", if *fresh { "made afresh" } else { "kept" }, *best * 1e6);
        }
    }
}
