//! Embeddings of texts (`model.embed`): the model's hidden states after its last norm, one
//! row a token, pooled over a text's tokens and L2-normalized, as llama.cpp's `--embedding`
//! computes them for a decoder (`llama-server --pooling mean|last|cls`).
//!
//! The program is the model's recipe without its head: `last-rows` taken out, and the output
//! the input of the head product (the last norm's rows), so that every architecture that has a
//! recipe has embeddings, on the guest's CPU and on a device that runs the model's program.

use crate::dispatch::{self, Dispatch};
use crate::engine::{Error, Model, PassParts, can_allocate};
use crate::models::{self, Recipe, State, Want};
use crate::program::cpu::{self, Values};
use crate::program::{Op, Program, compact};
use crate::session::{self, BATCH, DEVICE_BATCH, STEP_ROWS};

/// How a text's token rows become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Their mean (llama-server's default).
    Mean,
    /// The last token's row (a decoder's whole text is seen there).
    Last,
    /// The first token's row (BERT's `[CLS]`).
    Cls,
}

/// Texts one call embeds at most.
pub const MAX_INPUTS: usize = 2048;
/// Texts under way at once on the guest's CPU (each holds its keys and values).
const MAX_OPEN: usize = 64;

/// The model's program `p` ending at its hidden states: the rows `last-rows` would have picked
/// from go on through the same ops for every token, and the output is what the first product
/// after `last-rows` (the head) reads. An error names what the program lacks.
pub fn hidden_program(p: &Program) -> Result<Program, String> {
    let mut picks = p.ops.iter().enumerate().filter_map(|(i, op)| if let Op::LastRows(x) = *op { Some((i, x)) } else { None });
    let (Some((k, rows)), None) = (picks.next(), picks.next()) else {
        return Err("its program does not pick one last row a sequence".into());
    };
    let Some(head) = p.ops[k + 1..].iter().position(|op| matches!(op, Op::Matmul { .. })).map(|j| k + 1 + j) else {
        return Err("its program has no head product after its last rows".into());
    };
    let Op::Matmul { x: hidden, .. } = p.ops[head] else { unreachable!() };
    // The ops up to the head, reading the token rows where they read the last ones; the head
    // and what follows it give way to one output.
    let mut ops: Vec<Op> = p.ops[..head].iter().map(|op| op.map_values(|v| if v == k { rows } else { v })).collect();
    ops.push(Op::Output(if hidden == k { rows } else { hidden }));
    wisp_ops::check(compact(&ops), p.weights.clone(), p.caches.len() as u32).map_err(|e| format!("its hidden states do not make a program: {e}"))
}

/// `v / |v|` (a zero vector stays zero), as llama.cpp's Euclidean normalization.
pub fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    if norm > 0.0 {
        for x in v.iter_mut() {
            *x = (f64::from(*x) / norm) as f32;
        }
    }
}

impl Model {
    /// The recipe of the model's hidden states, made at the first call, and placed on the
    /// device where the model's own program is there.
    fn embedding(&self) -> Result<&Recipe, Error> {
        let made = self.embedding.get_or_init(|| {
            let program = hidden_program(&self.recipe.program)?;
            let mut recipe = Recipe::new(program, self.recipe.freqs.clone());
            if let (Some(gpu), Some(_)) = (&self.gpu, &self.recipe.device) {
                let layers = self.arch.hparams().n_layer;
                recipe.device = dispatch::place_program(gpu, &recipe.program, self.arch.tensors(), layers, false);
            }
            Ok(recipe)
        });
        made.as_ref().map_err(|why| Error::Unsupported(format!("embeddings of this model: {why}")))
    }

    /// One L2-normalized vector for each text of `inputs` (token ids), its rows pooled by
    /// `pooling`; `fast` as a session's precision. On the guest's CPU the texts share passes
    /// (each weight read once a pass for all of them, as a batched step's sessions); where the
    /// model's program is on the device, each text runs alone, in passes of a prompt's batch,
    /// there where the policy sends it. A text's vector is the one it has alone either way.
    /// `invalid-argument` for no texts, more than [`MAX_INPUTS`], an empty one or a token past
    /// the vocabulary; `context-full` for one past the training context; `out-of-memory` where
    /// a text's keys and values do not fit.
    pub fn embed(&self, inputs: &[Vec<u32>], pooling: Pooling, fast: bool) -> Result<Vec<Vec<f32>>, Error> {
        if inputs.is_empty() || inputs.len() > MAX_INPUTS {
            return Err(Error::InvalidArgument(format!("{} texts to embed: 1 to {MAX_INPUTS} are taken", inputs.len())));
        }
        let n_vocab = self.n_vocab();
        for (i, tokens) in inputs.iter().enumerate() {
            if tokens.is_empty() {
                return Err(Error::InvalidArgument(format!("text {i} to embed has no tokens")));
            }
            if tokens.len() > self.n_ctx_train() {
                return Err(Error::ContextFull(format!("text {i} to embed has {} tokens, past the model's context of {}", tokens.len(), self.n_ctx_train())));
            }
            if let Some(bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
                return Err(Error::InvalidArgument(format!("text {i}: token id {bad} is not below the vocabulary size {n_vocab}")));
            }
        }
        let recipe = self.embedding()?;
        if recipe.device.is_none() && !self.on_device() {
            return self.embed_together(recipe, inputs, pooling, fast);
        }
        inputs.iter().map(|tokens| self.embed_one(recipe, tokens, pooling, fast)).collect()
    }

    /// The texts on the guest's CPU, in passes of at most `STEP_ROWS` rows over several of
    /// them (each text's at most its batch), as `session::step` runs sessions: the products
    /// through one dispatcher, each text's attention over its own caches.
    fn embed_together(&self, recipe: &Recipe, inputs: &[Vec<u32>], pooling: Pooling, fast: bool) -> Result<Vec<Vec<f32>>, Error> {
        let (p, plan) = (&recipe.program, &recipe.plan);
        let width = p.width(p.outputs[0]);
        let kv = self.arch.hparams().kv_bytes_per_token();
        let parts = PassParts { weights: self.arch.tensors(), recipe, embd: self.arch.embd(), freqs: &recipe.freqs };
        let hd = self.arch.hparams().head_dim;
        let mut products = Dispatch::new(self.gpu.clone());
        products.fast = fast;
        let mut pools = vec![Pool::new(pooling, width); inputs.len()];
        // The texts under way, in order: (index, its state and dispatcher, rows done).
        let mut open: Vec<(usize, State, Dispatch, usize)> = Vec::new();
        let mut next = 0;
        let mut vals = Values::new(p, plan, STEP_ROWS, MAX_OPEN);
        let mut scores: Vec<f32> = Vec::new();
        loop {
            // Texts join while the pass has room for their first rows.
            let mut room = STEP_ROWS - open.iter().map(|(i, st, _, done)| (inputs[*i].len() - done).min(st.batch)).sum::<usize>().min(STEP_ROWS);
            while next < inputs.len() && room > 0 && open.len() < MAX_OPEN {
                let n = inputs[next].len();
                // A text's keys and values (and as much again for its pass) must fit beside
                // those of the texts under way: else it waits for them, or, alone, is refused.
                let need = n.saturating_mul(kv);
                if !can_allocate(need.saturating_mul(2)) {
                    if open.is_empty() {
                        return Err(Error::OutOfMemory(format!("a text of {n} tokens needs {} MiB of keys and values", need >> 20)));
                    }
                    break;
                }
                let st = State::new(self.arch.as_ref(), recipe, n, BATCH.min(n), false, false);
                room = room.saturating_sub(n.min(st.batch));
                open.push((next, st, Dispatch::new(self.gpu.clone()), 0));
                next += 1;
            }
            if open.is_empty() {
                break;
            }
            let mut left = STEP_ROWS;
            let take: Vec<usize> = open
                .iter()
                .map(|(i, st, _, done)| {
                    let n = (inputs[*i].len() - done).min(st.batch).min(left);
                    left -= n;
                    n
                })
                .collect();
            let rows = STEP_ROWS - left;
            let widest = open.iter().zip(&take).map(|((_, _, _, done), n)| done + n).max().unwrap_or(0);
            if scores.len() < widest {
                scores.resize(widest, 0.0);
            }
            let mut failed = None;
            {
                let (mut seqs, mut tokens, mut own) = (Vec::new(), Vec::new(), Vec::new());
                for ((i, st, d, done), &n) in open.iter_mut().zip(&take).filter(|(_, n)| **n > 0) {
                    let (caches, tables) = st.pass_parts();
                    tokens.push(session::Rows { tokens: &inputs[*i][*done..*done + n], pos: *done, tables });
                    seqs.push(cpu::Seq { t: n, pos: *done, outputs: true, caches, d: own.len() + 1 });
                    own.push(d);
                }
                let mut input = |i: usize, out: &mut [f32]| {
                    if let Err(e) = session::pass_input(&parts, hd, &mut tokens, i, out) {
                        failed.get_or_insert(e);
                    }
                };
                let mut ds: Vec<&mut Dispatch> = std::iter::once(&mut products).chain(own).collect();
                cpu::run(p, plan, parts.weights, &mut ds, &mut vals, &mut scores, &mut seqs, &mut input);
            }
            if let Some(e) = failed {
                return Err(e.into());
            }
            let out = vals.get(p, plan, p.outputs[0], rows);
            let mut at = 0;
            for ((i, _, _, done), &n) in open.iter_mut().zip(&take) {
                for (r, row) in out[at * width..(at + n) * width].chunks_exact(width).enumerate() {
                    pools[*i].add(*done + r, inputs[*i].len(), row);
                }
                at += n;
                *done += n;
            }
            open.retain(|(i, _, _, done)| *done < inputs[*i].len());
        }
        Ok(pools.into_iter().zip(inputs).map(|(pool, t)| pool.finish(t.len())).collect())
    }

    fn embed_one(&self, recipe: &Recipe, tokens: &[u32], pooling: Pooling, fast: bool) -> Result<Vec<f32>, Error> {
        let n = tokens.len();
        let need = n.saturating_mul(self.arch.hparams().kv_bytes_per_token());
        if !self.on_device() && !can_allocate(need) {
            return Err(Error::OutOfMemory(format!("a text of {n} tokens needs {} MiB of keys and values", need >> 20)));
        }
        let width = recipe.program.width(recipe.program.outputs[0]);
        let batch = if self.gpu_weights > 0 { DEVICE_BATCH } else { BATCH }.min(n);
        let mut state = State::new(self.arch.as_ref(), recipe, n, batch, self.on_device(), false);
        let mut d = Dispatch::new(self.gpu.clone());
        d.fast = fast;
        let mut pool = Pool::new(pooling, width);
        let (mut rows, mut done) = (Vec::with_capacity(batch * width), 0);
        while done < n {
            let t = (n - done).min(batch);
            rows.clear();
            if !models::forward(self.arch.as_ref(), recipe, &mut state, &mut d, &tokens[done..done + t], done, Want::Rows(&mut rows))? {
                if done == 0 {
                    return Err(Error::Io("the device did not run the text's first pass".into()));
                }
                // The device kept keys the guest's rings lack: the text runs again, here.
                pool = Pool::new(pooling, width);
                done = 0;
                continue;
            }
            for (r, row) in rows.chunks_exact(width).enumerate() {
                pool.add(done + r, n, row);
            }
            done += t;
        }
        Ok(pool.finish(n))
    }
}

/// A text's vector as its rows arrive, in order.
#[derive(Clone)]
struct Pool {
    pooling: Pooling,
    /// The rows' sum (mean), in f64 so that a long text's order of sums does not show.
    sum: Vec<f64>,
    /// The row kept (last, cls).
    row: Vec<f32>,
}

impl Pool {
    fn new(pooling: Pooling, width: usize) -> Pool {
        Pool { pooling, sum: vec![0.0; if pooling == Pooling::Mean { width } else { 0 }], row: vec![0.0; width] }
    }

    /// Row `at` of a text of `n` rows.
    fn add(&mut self, at: usize, n: usize, row: &[f32]) {
        match self.pooling {
            Pooling::Mean => self.sum.iter_mut().zip(row).for_each(|(s, &x)| *s += f64::from(x)),
            Pooling::Cls if at == 0 => self.row.copy_from_slice(row),
            Pooling::Last if at + 1 == n => self.row.copy_from_slice(row),
            _ => {}
        }
    }

    /// The vector of a text of `n` rows, normalized.
    fn finish(mut self, n: usize) -> Vec<f32> {
        if self.pooling == Pooling::Mean {
            self.row = self.sum.iter().map(|s| (s / n as f64) as f32).collect();
        }
        normalize(&mut self.row);
        self.row
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Format, Precision, ProgramWeight, Rows, WeightId};

    /// A norm weight `[4]` and a head `[8, 4]`.
    fn weights() -> Vec<ProgramWeight> {
        vec![
            ProgramWeight { id: WeightId(0), dims: (1, 4), format: Some(Format::F32) },
            ProgramWeight { id: WeightId(1), dims: (8, 4), format: Some(Format::F32) },
        ]
    }

    #[test]
    fn the_hidden_program_is_the_recipe_to_its_head_over_every_token() {
        let head = |x| Op::Matmul { x, weight: 1, precision: Precision::Exact };
        let norm = |x| Op::RmsNorm { x, weight: Some(0), offset: 0.0, group: 4, eps: 1e-6 };
        let ops = vec![Op::Input { width: 4 }, Op::Scale { x: 0, by: 2.0 }, Op::LastRows(1), norm(2), head(3), Op::Softcap { x: 4, cap: 30.0 }, Op::Output(5)];
        let p = wisp_ops::check(ops, weights(), 0).unwrap();
        let h = hidden_program(&p).unwrap();
        assert_eq!(h.ops, vec![Op::Input { width: 4 }, Op::Scale { x: 0, by: 2.0 }, norm(1), Op::Output(2)]);
        assert_eq!((h.rows(h.outputs[0]), h.width(h.outputs[0])), (Rows::Token, 4));
        // The last rows read straight by the head.
        let p = wisp_ops::check(vec![Op::Input { width: 4 }, Op::LastRows(0), head(1), Op::Output(2)], weights(), 0).unwrap();
        assert_eq!(hidden_program(&p).unwrap().ops, vec![Op::Input { width: 4 }, Op::Output(0)]);
        // No last rows, or no head after them: no embeddings.
        let p = wisp_ops::check(vec![Op::Input { width: 4 }, head(0), Op::Output(1)], weights(), 0).unwrap();
        assert!(hidden_program(&p).unwrap_err().contains("last row"));
        let p = wisp_ops::check(vec![Op::Input { width: 4 }, Op::LastRows(0), norm(1), Op::Output(2)], weights(), 0).unwrap();
        assert!(hidden_program(&p).unwrap_err().contains("head"));
    }

    #[test]
    fn a_zero_vector_stays_zero_and_others_get_unit_length() {
        let mut z = vec![0.0; 4];
        normalize(&mut z);
        assert_eq!(z, vec![0.0; 4]);
        let mut v = vec![3.0, 4.0];
        normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
    }
}
