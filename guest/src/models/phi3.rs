//! Phi-3 (Phi-3 technical report; Hugging Face's `Phi3ForCausalLM`), as llama.cpp's `phi3`.
//!
//! The pre-norm decoder block of Llama with its products fused in the file:
//! - `attn_qkv` holds the query, key and value projections one after another (rows
//!   `[nq | nkv | nkv]`), `ffn_up` the gate and the up projections (`[n_ff | n_ff]`); they are
//!   split at load, so the recipe sees three products and two (files with the separate
//!   tensors `attn_q`, `attn_k`, `attn_v` and `ffn_gate` load as they are);
//! - `x = x + wo(attn(rope(q), rope(k), v))`, `h = rms_norm(x)`, then
//!   `x = x + down(silu(gate(h)) * up(h))`; logits `= output(rms_norm(x))`;
//! - RoPE rotates the two halves of each head (NEOX), base `rope.freq_base` (10000 when
//!   missing); queries scaled by `1/sqrt(head_dim)`; grouped-query attention;
//! - Phi-3.5 and Phi-3 128k (long-rope): the frequencies divided by `rope_factors_long` where
//!   the model's context (`context_length`) is past the one it was trained at first
//!   (`rope.scaling.original_context_length`), else by `rope_factors_short`, the cosines and
//!   sines times `rope.scaling.attn_factor`: llama.cpp's choice at its default context (the
//!   model's), made here once for every session;
//! - every layer attends over a sliding window of `attention.sliding_window` keys where the
//!   file has one (Phi-3 mini 4k: 2047), as llama.cpp's `phi3` does;
//! - no biases; the output projection is `output.weight`, or tied to the embedding.

use super::attention::Heads;
use super::rope;
use super::{ArchConfig, Hparams, Linear, LoadError, Registered, rope_factors, vector};
use crate::gguf::Gguf;
use crate::source::Source;
use crate::kernels::Act;
use crate::program::{Builder, CheckError, Program, Rotation, Tensor, Tensors, WeightId};

/// Hyperparameters from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct Config {
    pub hp: Hparams,
    /// Keys a query sees (its own among them) on every layer; `None`: all of them.
    pub window: Option<usize>,
    /// The long-rope factors to read: `rope_factors_long` (past the original context) or
    /// `rope_factors_short`.
    pub long: bool,
    /// `rope.scaling.attn_factor` (1 where missing).
    pub attn_factor: f64,
}

impl Config {
    pub fn from_gguf(g: &Gguf) -> Result<Config, LoadError> {
        let hp = Hparams::from_gguf(g, "phi3", 10_000.0)?;
        let window = match g.get_u64("phi3.attention.sliding_window")? {
            None | Some(0) => None,
            Some(w) => Some(w.min(super::MAX_CONTEXT) as usize),
        };
        let context = g.get_u64("phi3.context_length")?;
        let long = match (context, g.get_u64("phi3.rope.scaling.original_context_length")?) {
            (Some(c), Some(original)) => c > original,
            _ => false,
        };
        let attn_factor = match g.get_f64("phi3.rope.scaling.attn_factor")? {
            None => 1.0,
            Some(f) if f.is_finite() && f > 0.0 && f < 16.0 => f,
            Some(f) => return super::invalid(format!("phi3.rope.scaling.attn_factor = {f} is not a usable factor")),
        };
        Ok(Config { hp, window, long, attn_factor })
    }
}

pub struct Layer {
    /// `[n_embd]`
    pub attn_norm: Vec<f32>,
    /// `[n_head * head_dim, n_embd]`, `[n_head_kv * head_dim, n_embd]` twice
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    /// `[n_embd, n_head * head_dim]`
    pub wo: Linear,
    /// `[n_embd]`
    pub ffn_norm: Vec<f32>,
    /// `[n_ff, n_embd]` each
    pub gate: Linear,
    pub up: Linear,
    /// `[n_embd, n_ff]`
    pub down: Linear,
}

/// Immutable after load.
pub struct Weights {
    /// `[n_vocab, n_embd]`
    pub embd: Linear,
    /// `[n_vocab, n_embd]`, `None` when tied to `embd`.
    pub output: Option<Linear>,
    /// `[n_embd]`
    pub output_norm: Vec<f32>,
    pub layers: Vec<Layer>,
    pub rope: rope::Freqs,
}

/// The weights of a layer as the recipe names them: `layer * PARTS + part`; the model's own
/// after the last layer's.
const ATTN_NORM: u32 = 0;
const WQ: u32 = 1;
const WK: u32 = 2;
const WV: u32 = 3;
const WO: u32 = 4;
const FFN_NORM: u32 = 5;
const GATE: u32 = 6;
const UP: u32 = 7;
const DOWN: u32 = 8;
const PARTS: u32 = 9;
const OUTPUT_NORM: u32 = 0;
const OUTPUT: u32 = 1;

fn weight(layer: usize, part: u32) -> WeightId {
    WeightId(layer as u32 * PARTS + part)
}

impl Tensors for Weights {
    fn tensor(&self, id: WeightId) -> Tensor<'_> {
        let (l, part) = ((id.0 / PARTS) as usize, id.0 % PARTS);
        let Some(layer) = self.layers.get(l) else {
            return match part {
                OUTPUT_NORM => Tensor::Vector(&self.output_norm),
                _ => Tensor::Matrix(self.output.as_ref().unwrap_or(&self.embd)),
            };
        };
        match part {
            ATTN_NORM => Tensor::Vector(&layer.attn_norm),
            WQ => Tensor::Matrix(&layer.wq),
            WK => Tensor::Matrix(&layer.wk),
            WV => Tensor::Matrix(&layer.wv),
            WO => Tensor::Matrix(&layer.wo),
            FFN_NORM => Tensor::Vector(&layer.ffn_norm),
            GATE => Tensor::Matrix(&layer.gate),
            UP => Tensor::Matrix(&layer.up),
            _ => Tensor::Matrix(&layer.down),
        }
    }
}

impl ArchConfig for Config {
    type Weights = Weights;

    fn hparams(&self) -> &Hparams {
        &self.hp
    }

    fn load(&self, g: &Gguf, file: &dyn Source) -> Result<Weights, LoadError> {
        let c = self;
        let h = &c.hp;
        let (e, hd, n_ff) = (h.n_embd, h.head_dim, h.n_ff);
        let (nq, nkv) = (h.n_head * hd, h.n_head_kv * hd);
        let mut layers = Vec::with_capacity(h.n_layer);
        for l in 0..h.n_layer {
            let name = |s: &str| format!("blk.{l}.{s}.weight");
            let (wq, wk, wv) = if g.tensor(&name("attn_qkv")).is_some() {
                let (qkv, rows) = (name("attn_qkv"), nq + 2 * nkv);
                (
                    Linear::load_rows(g, file, &qkv, rows, e, 0..nq)?,
                    Linear::load_rows(g, file, &qkv, rows, e, nq..nq + nkv)?,
                    Linear::load_rows(g, file, &qkv, rows, e, nq + nkv..rows)?,
                )
            } else {
                (
                    Linear::load(g, file, &name("attn_q"), nq, e)?,
                    Linear::load(g, file, &name("attn_k"), nkv, e)?,
                    Linear::load(g, file, &name("attn_v"), nkv, e)?,
                )
            };
            let (gate, up) = if g.tensor(&name("ffn_gate")).is_some() {
                (Linear::load(g, file, &name("ffn_gate"), n_ff, e)?, Linear::load(g, file, &name("ffn_up"), n_ff, e)?)
            } else {
                let fused = name("ffn_up");
                (
                    Linear::load_rows(g, file, &fused, 2 * n_ff, e, 0..n_ff)?,
                    Linear::load_rows(g, file, &fused, 2 * n_ff, e, n_ff..2 * n_ff)?,
                )
            };
            layers.push(Layer {
                attn_norm: vector(g, file, &name("attn_norm"), e)?,
                wq,
                wk,
                wv,
                wo: Linear::load(g, file, &name("attn_output"), e, nq)?,
                ffn_norm: vector(g, file, &name("ffn_norm"), e)?,
                gate,
                up,
                down: Linear::load(g, file, &name("ffn_down"), e, n_ff)?,
            });
        }
        let output = match g.tensor("output.weight") {
            Some(_) => Some(Linear::load(g, file, "output.weight", h.n_vocab, e)?),
            None => None,
        };
        let name = if self.long { "rope_factors_long.weight" } else { "rope_factors_short.weight" };
        let rope = h.freqs(rope_factors(g, file, name, h.rope_dim / 2)?);
        let w = Weights {
            embd: Linear::load(g, file, "token_embd.weight", h.n_vocab, e)?,
            output,
            output_norm: vector(g, file, "output_norm.weight", e)?,
            layers,
            rope: rope::Freqs { mscale: self.attn_factor * rope.mscale, ..rope },
        };
        Ok(w)
    }

    /// Phi-3 as a program. Inputs: the tokens' embeddings `[t, n_embd]`, the rotation table
    /// `[t, head_dim]`; output: the logits of each sequence's last token. Layer `l` writes cache
    /// `l`.
    fn recipe(&self, w: &Weights) -> Result<Program, CheckError> {
        let c = self;
        let h = &c.hp;
        let (e, hd, eps) = (h.n_embd, h.head_dim, h.eps);
        let heads = Heads { n_head: h.n_head, n_head_kv: h.n_head_kv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), softcap: 0.0 };
        let window = c.window.unwrap_or(0);
        let mut p = Builder::new(w);
        let mut x = p.input(e);
        let table = p.input(h.rope_dim);
        for l in 0..h.n_layer {
            let id = |part| weight(l, part);
            // Attention: x = x + wo(attn(rope(q), rope(k), v)), (q, k, v) = W attn_norm(x)
            let hn = p.norm(x, id(ATTN_NORM), eps);
            let (q, k, v) = (p.matmul(hn, id(WQ)), p.matmul(hn, id(WK)), p.matmul(hn, id(WV)));
            let q = p.rotate(q, table, hd, Rotation::Halves);
            let k = p.rotate(k, table, hd, Rotation::Halves);
            p.cache_write(k, v, l);
            let a = p.attention(q, l, heads, window);
            let o = p.matmul(a, id(WO));
            x = p.add(x, o);
            // FFN: x = x + down(silu(gate(h)) * up(h)), h = ffn_norm(x)
            let hn = p.norm(x, id(FFN_NORM), eps);
            let (g, u) = (p.matmul(hn, id(GATE)), p.matmul(hn, id(UP)));
            let f = p.gated(g, u, Act::Silu);
            let f = p.matmul(f, id(DOWN));
            x = p.add(x, f);
        }
        let last = p.last_rows(x);
        let last = p.norm(last, weight(h.n_layer, OUTPUT_NORM), eps);
        let logits = p.matmul(last, weight(h.n_layer, OUTPUT));
        p.output(logits);
        p.finish()
    }

    fn embd(w: &Weights) -> &Linear {
        &w.embd
    }

    fn linears_mut(w: &mut Weights) -> Vec<&mut Linear> {
        let mut v: Vec<&mut Linear> = Vec::new();
        for l in &mut w.layers {
            v.extend([&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo, &mut l.gate, &mut l.up, &mut l.down]);
        }
        v.push(w.output.as_mut().unwrap_or(&mut w.embd));
        v
    }

    fn freqs(&self, w: &Weights) -> Vec<rope::Freqs> {
        vec![w.rope.clone()]
    }

    fn window(&self, _layer: usize) -> Option<usize> {
        self.window
    }
}

/// The registry's line (`models::REGISTRY`).
pub const ARCH: Registered = Registered { names: &["phi3"], config: |g, _| Ok(Box::new(Config::from_gguf(g)?)) };
