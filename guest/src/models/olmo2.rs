//! OLMo 2 (Hugging Face's `Olmo2ForCausalLM`), as llama.cpp's `olmo2`.
//!
//! A decoder whose norms come after each block rather than before it, and whose queries and
//! keys are RMS-normed across all their heads at once:
//! - `x = x + post_attn_norm(wo(attn(rope(q_norm(wq x)), rope(k_norm(wk x)), wv x)))`, the
//!   q/k norms over the whole `n_head * head_dim` (`n_head_kv * head_dim`) row;
//! - `x = x + post_ffn_norm(down(silu(gate(x)) * up(x)))`; logits `= output(rms_norm(x))`;
//! - RoPE rotates the two halves of each head (NEOX), base `rope.freq_base` (10000 when
//!   missing); grouped-query attention, queries scaled by `1/sqrt(head_dim)`;
//! - `output.weight` is its own tensor;
//! - OLMo 3 (also `olmo2`, with `attention.sliding_window`): the layers that
//!   `attention.sliding_window_pattern` marks (a flag a layer, or a number `n`: those with
//!   `l % n < n - 1`; 4 where missing) attend over the window, turned without the file's
//!   rotation scaling (llama.cpp: no YaRN there); the others over everything, with it.

use super::attention::Heads;
use super::rope;
use super::{ArchConfig, Hparams, Linear, LoadError, Registered, sliding_layers, vector};
use crate::gguf::Gguf;
use crate::kernels::Act;
use crate::program::{Builder, CheckError, Program, Rotation, Tensor, Tensors, WeightId};
use crate::source::Source;

/// Hyperparameters from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct Config {
    pub hp: Hparams,
    /// OLMo 3's window, and whether each layer slides (none without a window).
    pub window: Option<usize>,
    pub sliding: Vec<bool>,
}

impl Config {
    pub fn from_gguf(g: &Gguf) -> Result<Config, LoadError> {
        let hp = Hparams::from_gguf(g, "olmo2", 10_000.0)?;
        let window = g.get_u64("olmo2.attention.sliding_window")?.filter(|&w| w > 0).map(|w| w.min(super::MAX_CONTEXT) as usize);
        let sliding = match window {
            None => vec![false; hp.n_layer],
            Some(_) => sliding_layers(g, "olmo2", hp.n_layer, 4)?,
        };
        Ok(Config { hp, window, sliding })
    }
}

pub struct Layer {
    /// `[n_head * head_dim, n_embd]`
    pub wq: Linear,
    /// `[n_head_kv * head_dim, n_embd]`
    pub wk: Linear,
    /// `[n_head_kv * head_dim, n_embd]`
    pub wv: Linear,
    /// `[n_head * head_dim]`
    pub q_norm: Vec<f32>,
    /// `[n_head_kv * head_dim]`
    pub k_norm: Vec<f32>,
    /// `[n_embd, n_head * head_dim]`
    pub wo: Linear,
    /// `[n_embd]`
    pub post_attn_norm: Vec<f32>,
    /// `[n_ff, n_embd]`
    pub gate: Linear,
    /// `[n_ff, n_embd]`
    pub up: Linear,
    /// `[n_embd, n_ff]`
    pub down: Linear,
    /// `[n_embd]`
    pub post_ffn_norm: Vec<f32>,
}

/// Immutable after load.
pub struct Weights {
    /// `[n_vocab, n_embd]`
    pub embd: Linear,
    /// `[n_vocab, n_embd]`
    pub output: Linear,
    /// `[n_embd]`
    pub output_norm: Vec<f32>,
    pub layers: Vec<Layer>,
}

/// The weights of a layer as the recipe names them: `layer * PARTS + part`; the model's own
/// after the last layer's.
const WQ: u32 = 0;
const WK: u32 = 1;
const WV: u32 = 2;
const Q_NORM: u32 = 3;
const K_NORM: u32 = 4;
const WO: u32 = 5;
const POST_ATTN_NORM: u32 = 6;
const GATE: u32 = 7;
const UP: u32 = 8;
const DOWN: u32 = 9;
const POST_FFN_NORM: u32 = 10;
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
                _ => Tensor::Matrix(&self.output),
            };
        };
        match part {
            WQ => Tensor::Matrix(&layer.wq),
            WK => Tensor::Matrix(&layer.wk),
            WV => Tensor::Matrix(&layer.wv),
            Q_NORM => Tensor::Vector(&layer.q_norm),
            K_NORM => Tensor::Vector(&layer.k_norm),
            WO => Tensor::Matrix(&layer.wo),
            POST_ATTN_NORM => Tensor::Vector(&layer.post_attn_norm),
            GATE => Tensor::Matrix(&layer.gate),
            UP => Tensor::Matrix(&layer.up),
            DOWN => Tensor::Matrix(&layer.down),
            _ => Tensor::Vector(&layer.post_ffn_norm),
        }
    }
}

impl ArchConfig for Config {
    type Weights = Weights;

    fn hparams(&self) -> &Hparams {
        &self.hp
    }

    fn load(&self, g: &Gguf, file: &dyn Source) -> Result<Weights, LoadError> {
        let h = &self.hp;
        let (e, hd, n_ff) = (h.n_embd, h.head_dim, h.n_ff);
        let (nq, nkv) = (h.n_head * hd, h.n_head_kv * hd);
        let mut layers = Vec::with_capacity(h.n_layer);
        for l in 0..h.n_layer {
            let name = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                wq: Linear::load(g, file, &name("attn_q"), nq, e)?,
                wk: Linear::load(g, file, &name("attn_k"), nkv, e)?,
                wv: Linear::load(g, file, &name("attn_v"), nkv, e)?,
                q_norm: vector(g, file, &name("attn_q_norm"), nq)?,
                k_norm: vector(g, file, &name("attn_k_norm"), nkv)?,
                wo: Linear::load(g, file, &name("attn_output"), e, nq)?,
                post_attn_norm: vector(g, file, &name("post_attention_norm"), e)?,
                gate: Linear::load(g, file, &name("ffn_gate"), n_ff, e)?,
                up: Linear::load(g, file, &name("ffn_up"), n_ff, e)?,
                down: Linear::load(g, file, &name("ffn_down"), e, n_ff)?,
                post_ffn_norm: vector(g, file, &name("post_ffw_norm"), e)?,
            });
        }
        Ok(Weights {
            embd: Linear::load(g, file, "token_embd.weight", h.n_vocab, e)?,
            output: Linear::load(g, file, "output.weight", h.n_vocab, e)?,
            output_norm: vector(g, file, "output_norm.weight", e)?,
            layers,
        })
    }

    /// OLMo 2 (and 3) as a program. Inputs: the tokens' embeddings `[t, n_embd]`, the rotation
    /// table `[t, rope_dim]` (OLMo 3: the global layers', then the sliding ones'); output: the
    /// logits of each sequence's last token. Each layer `l` writes cache `l`.
    fn recipe(&self, w: &Weights) -> Result<Program, CheckError> {
        let h = &self.hp;
        let (e, hd, eps) = (h.n_embd, h.head_dim, h.eps);
        let (nq, nkv) = (h.n_head * hd, h.n_head_kv * hd);
        let heads = Heads { n_head: h.n_head, n_head_kv: h.n_head_kv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), softcap: 0.0 };
        let mut p = Builder::new(w);
        let mut x = p.input(e);
        let global = p.input(h.rope_dim);
        let local = if self.window.is_some() { p.input(h.rope_dim) } else { global };
        for l in 0..h.n_layer {
            let id = |part| weight(l, part);
            let (table, window) = if self.sliding[l] { (local, self.window.unwrap_or(0)) } else { (global, 0) };

            // Attention: x = x + post_attn_norm(wo(attn(q, k, v))), the queries and keys normed
            // across their heads, then turned; (q, k, v) = W x
            let (q, k, v) = (p.matmul(x, id(WQ)), p.matmul(x, id(WK)), p.matmul(x, id(WV)));
            let q = p.rms_norm(q, Some(id(Q_NORM)), nq, eps);
            let q = p.rotate(q, table, hd, Rotation::Halves);
            let k = p.rms_norm(k, Some(id(K_NORM)), nkv, eps);
            let k = p.rotate(k, table, hd, Rotation::Halves);
            p.cache_write(k, v, l);
            let a = p.attention(q, l, heads, window);
            let o = p.matmul(a, id(WO));
            let o = p.norm(o, id(POST_ATTN_NORM), eps);
            x = p.add(x, o);

            // FFN: x = x + post_ffn_norm(down(silu(gate(x)) * up(x)))
            let (g, u) = (p.matmul(x, id(GATE)), p.matmul(x, id(UP)));
            let f = p.gated(g, u, Act::Silu);
            let f = p.matmul(f, id(DOWN));
            let f = p.norm(f, id(POST_FFN_NORM), eps);
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
        v.push(&mut w.output);
        v
    }

    /// The global layers' rotation (the file's scaling), then OLMo 3's sliding layers' (none).
    fn freqs(&self, _w: &Weights) -> Vec<rope::Freqs> {
        let global = self.hp.freqs(None);
        match self.window {
            None => vec![global],
            Some(_) => vec![global, rope::Freqs::new(self.hp.rope_base, 1.0)],
        }
    }

    fn window(&self, layer: usize) -> Option<usize> {
        self.window.filter(|_| self.sliding[layer])
    }
}

/// The registry's line (`models::REGISTRY`).
pub const ARCH: Registered = Registered { names: &["olmo2"], config: |g, _| Ok(Box::new(Config::from_gguf(g)?)) };
