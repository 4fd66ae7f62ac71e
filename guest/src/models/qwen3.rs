//! Qwen3 (dense; Qwen3 technical report, Hugging Face's `Qwen3ForCausalLM`), as llama.cpp's
//! `qwen3`.
//!
//! The pre-norm decoder block of Qwen2 without its biases, and each head of the queries and the
//! keys RMS-normed before it is turned:
//! - `x = x + wo(attn(rope(q_norm(wq h)), rope(k_norm(wk h)), wv h))`, `h = rms_norm(x)`, the
//!   head norms over each head's `head_dim` values with weights of `[head_dim]`;
//! - `x = x + down(silu(gate(h)) * up(h))`, `h = rms_norm(x)`; logits `= output(rms_norm(x))`;
//! - RoPE rotates the two halves of each head (NEOX), base `rope.freq_base` (1e6 when missing),
//!   linear `rope.scaling.factor` where the file has one; grouped-query attention, queries
//!   scaled by `1/sqrt(head_dim)`, where `head_dim` (`attention.key_length`, 128 in the released
//!   models) need not be `n_embd / n_head`; no sliding window;
//! - the output projection is `output.weight`, or tied to `token_embd.weight` when absent.

use super::attention::Heads;
use super::{ArchConfig, Hparams, Linear, LoadError, Registered, vector};
use crate::gguf::Gguf;
use crate::kernels::Act;
use crate::program::{Builder, CheckError, Program, Rotation, Tensor, Tensors, WeightId};
use crate::source::Source;

/// Hyperparameters from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct Config {
    pub hp: Hparams,
}

impl Config {
    pub fn from_gguf(g: &Gguf) -> Result<Config, LoadError> {
        Ok(Config { hp: Hparams::from_gguf(g, "qwen3", 1e6)? })
    }
}

pub struct Layer {
    /// `[n_embd]`
    pub attn_norm: Vec<f32>,
    /// `[n_head * head_dim, n_embd]`
    pub wq: Linear,
    /// `[n_head_kv * head_dim, n_embd]`
    pub wk: Linear,
    /// `[n_head_kv * head_dim, n_embd]`
    pub wv: Linear,
    /// `[head_dim]`
    pub q_norm: Vec<f32>,
    /// `[head_dim]`
    pub k_norm: Vec<f32>,
    /// `[n_embd, n_head * head_dim]`
    pub wo: Linear,
    /// `[n_embd]`
    pub ffn_norm: Vec<f32>,
    /// `[n_ff, n_embd]`
    pub gate: Linear,
    /// `[n_ff, n_embd]`
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
}

/// The weights of a layer as the recipe names them: `layer * PARTS + part`; the model's own
/// after the last layer's.
const ATTN_NORM: u32 = 0;
const WQ: u32 = 1;
const WK: u32 = 2;
const WV: u32 = 3;
const Q_NORM: u32 = 4;
const K_NORM: u32 = 5;
const WO: u32 = 6;
const FFN_NORM: u32 = 7;
const GATE: u32 = 8;
const UP: u32 = 9;
const DOWN: u32 = 10;
const PARTS: u32 = 11;
/// After the layers: the final norm and the output projection.
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
            Q_NORM => Tensor::Vector(&layer.q_norm),
            K_NORM => Tensor::Vector(&layer.k_norm),
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
            layers.push(Layer {
                attn_norm: vector(g, file, &name("attn_norm"), e)?,
                wq: Linear::load(g, file, &name("attn_q"), nq, e)?,
                wk: Linear::load(g, file, &name("attn_k"), nkv, e)?,
                wv: Linear::load(g, file, &name("attn_v"), nkv, e)?,
                q_norm: vector(g, file, &name("attn_q_norm"), hd)?,
                k_norm: vector(g, file, &name("attn_k_norm"), hd)?,
                wo: Linear::load(g, file, &name("attn_output"), e, nq)?,
                ffn_norm: vector(g, file, &name("ffn_norm"), e)?,
                gate: Linear::load(g, file, &name("ffn_gate"), n_ff, e)?,
                up: Linear::load(g, file, &name("ffn_up"), n_ff, e)?,
                down: Linear::load(g, file, &name("ffn_down"), e, n_ff)?,
            });
        }
        let output = match g.tensor("output.weight") {
            Some(_) => Some(Linear::load(g, file, "output.weight", h.n_vocab, e)?),
            None => None,
        };
        Ok(Weights {
            embd: Linear::load(g, file, "token_embd.weight", h.n_vocab, e)?,
            output,
            output_norm: vector(g, file, "output_norm.weight", e)?,
            layers,
        })
    }

    /// Qwen3 as a program. Inputs: the tokens' embeddings `[t, n_embd]`, the rotation table
    /// `[t, head_dim]`; output: the logits of each sequence's last token. Each layer `l` writes
    /// cache `l`.
    fn recipe(&self, w: &Weights) -> Result<Program, CheckError> {
        let c = self;
        let h = &c.hp;
        let (e, hd, eps) = (h.n_embd, h.head_dim, h.eps);
        let heads = Heads { n_head: h.n_head, n_head_kv: h.n_head_kv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), softcap: 0.0 };
        let mut p = Builder::new(w);
        let mut x = p.input(e);
        let table = p.input(h.rope_dim);
        for l in 0..h.n_layer {
            let id = |part| weight(l, part);

            // Attention: x = x + wo(attn(q, k, v)), each head of q and k normed and turned,
            // (q, k, v) = W attn_norm(x)
            let hn = p.norm(x, id(ATTN_NORM), eps);
            let (q, k, v) = (p.matmul(hn, id(WQ)), p.matmul(hn, id(WK)), p.matmul(hn, id(WV)));
            let q = p.rms_norm(q, Some(id(Q_NORM)), hd, eps);
            let q = p.rotate(q, table, hd, Rotation::Halves);
            let k = p.rms_norm(k, Some(id(K_NORM)), hd, eps);
            let k = p.rotate(k, table, hd, Rotation::Halves);
            p.cache_write(k, v, l);
            let a = p.attention(q, l, heads, 0);
            let o = p.matmul(a, id(WO));
            x = p.add(x, o);

            // FFN: x = x + down(silu(gate(h)) * up(h)), h = ffn_norm(x)
            let hn = p.norm(x, id(FFN_NORM), eps);
            let (g, u) = (p.matmul(hn, id(GATE)), p.matmul(hn, id(UP)));
            let f = p.gated(g, u, Act::Silu);
            let f = p.matmul(f, id(DOWN));
            x = p.add(x, f);
        }
        // logits = output(output_norm(x)) of the last token
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
}

/// The registry's line (`models::REGISTRY`).
pub const ARCH: Registered = Registered { names: &["qwen3"], config: |g, _| Ok(Box::new(Config::from_gguf(g)?)) };
