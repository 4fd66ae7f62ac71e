//! Embeddings of texts (`model.embed`): the model's hidden states after its last norm, one
//! row a token, pooled over a text's tokens and L2-normalized, as llama.cpp's `--embedding`
//! computes them for a decoder (`llama-server --pooling mean|last|cls`).
//!
//! The program is the model's recipe without its head: `last-rows` taken out, and the output
//! the input of the head product (the last norm's rows), so that every architecture that has a
//! recipe has embeddings, on the guest's CPU and on a device that runs the model's program.

use crate::dispatch::{self, Dispatch};
use crate::engine::{Error, Model, can_allocate};
use crate::models::{self, Recipe, State, Want};
use crate::program::{Op, Program, compact};
use crate::session::{BATCH, DEVICE_BATCH};

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

    /// The width of an embedding: the hidden states'.
    pub fn embedding_width(&self) -> Result<usize, Error> {
        let r = self.embedding()?;
        Ok(r.program.width(r.program.outputs[0]))
    }

    /// One L2-normalized vector for each text of `inputs` (token ids), its rows pooled by
    /// `pooling`; `fast` as a session's precision. Each text runs alone, in passes of a
    /// prompt's batch, on the device where the model's program is there and the policy sends
    /// it. `invalid-argument` for no texts, more than [`MAX_INPUTS`], an empty one, one past
    /// the training context or a token past the vocabulary; `out-of-memory` where a text's
    /// keys and values do not fit.
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
        inputs.iter().map(|tokens| self.embed_one(recipe, tokens, pooling, fast)).collect()
    }

    fn embed_one(&self, recipe: &Recipe, tokens: &[u32], pooling: Pooling, fast: bool) -> Result<Vec<f32>, Error> {
        let n = tokens.len();
        let need = n.saturating_mul(self.arch.hparams().kv_bytes_per_token());
        if !self.on_device() && !can_allocate(need) {
            return Err(Error::OutOfMemory(format!("a text of {n} tokens needs {} MiB of keys and values", need >> 20)));
        }
        let width = recipe.program.width(recipe.program.outputs[0]);
        let batch = if self.gpu_weights > 0 { DEVICE_BATCH } else { BATCH }.min(n);
        let mut state = State::new(self.arch.as_ref(), recipe, n, batch, self.on_device());
        let mut d = Dispatch::new(self.gpu.clone());
        d.fast = fast;
        let (mut sum, mut pooled) = (vec![0f64; width], vec![0f32; width]);
        let (mut rows, mut done) = (Vec::with_capacity(batch * width), 0);
        while done < n {
            let t = (n - done).min(batch);
            rows.clear();
            if !models::forward(self.arch.as_ref(), recipe, &mut state, &mut d, &tokens[done..done + t], done, Want::Rows(&mut rows))? {
                if done == 0 {
                    return Err(Error::Io("the device did not run the text's first pass".into()));
                }
                // The device kept keys the guest's rings lack: the text runs again, here.
                sum.fill(0.0);
                done = 0;
                continue;
            }
            for (r, row) in rows.chunks_exact(width).enumerate() {
                let at = done + r;
                match pooling {
                    Pooling::Mean => sum.iter_mut().zip(row).for_each(|(s, &x)| *s += f64::from(x)),
                    Pooling::Cls if at == 0 => pooled.copy_from_slice(row),
                    Pooling::Last if at == n - 1 => pooled.copy_from_slice(row),
                    _ => {}
                }
            }
            done += t;
        }
        if pooling == Pooling::Mean {
            pooled = sum.iter().map(|s| (s / n as f64) as f32).collect();
        }
        normalize(&mut pooled);
        Ok(pooled)
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
