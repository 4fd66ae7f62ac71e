//! Gemma 3 (text), as in the Gemma 3 technical report and Hugging Face's `Gemma3ForCausalLM`,
//! and Gemma 2 (`Gemma2ForCausalLM`), the same block with the differences listed last.
//!
//! Quirks, all read from the GGUF metadata where the file has them:
//! - the token embedding is scaled by `sqrt(n_embd)` and tied to the output projection
//!   (unless the file has `output.weight`);
//! - RMSNorm everywhere (the GGUF norm weights already include Gemma's `1 +`), with extra norms
//!   after attention and after the FFN, and per-head RMSNorm of queries and keys;
//! - the FFN is `down(gelu_tanh(gate(x)) * up(x))`;
//! - layers with `l % 6 != 5` (or as `attention.sliding_window_pattern` says) attend over a
//!   sliding window of `attention.sliding_window` (512) keys with RoPE base
//!   `rope.freq_base_swa` (10000); the others are global with the file's `rope.freq_base` (and
//!   its rotation scaling, if any);
//! - RoPE rotates the two halves of each head (NEOX); queries are scaled by `1/sqrt(head_dim)`,
//!   in the 27B (62 layers) by `1/sqrt(n_embd / n_head)` (its `query_pre_attn_scalar`, by
//!   llama.cpp's rule); the logits soft-capped where the file has `final_logit_softcapping`;
//! - grouped-query attention: `head_count_kv` key/value heads shared by `head_count` queries.
//!
//! Gemma 2 (`gemma2`), as llama.cpp's `gemma2`: no q/k norms; every other layer (the even ones,
//! or as the pattern says) slides over `attention.sliding_window` (4096) keys, with the file's
//! `rope.freq_base` (10000; `rope.freq_base_swa` where it has one); each attention score `s` (queries already scaled) is soft-capped as
//! `c tanh(s / c)`, `c` = `attn_logit_softcapping` (50), and the logits likewise with
//! `final_logit_softcapping` (30); queries are scaled by `1/sqrt(n_embd / n_head)` in the 27B
//! (46 layers; its `query_pre_attn_scalar`), else `1/sqrt(head_dim)`.

use super::attention::Heads;
use super::rope;
use super::{ArchConfig, Hparams, Linear, LoadError, Registered, invalid, vector};
use crate::gguf::Gguf;
use crate::source::Source;
use crate::kernels::Act;
use crate::program::{Builder, CheckError, Program, Rotation, Tensor, Tensors, WeightId};

/// Gemma 3's rotation base of its sliding layers where the file does not say.
const SWA_ROPE_BASE: f64 = 10_000.0;

/// The two generations this file runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Gemma2,
    Gemma3,
}

/// Hyperparameters from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct Config {
    pub family: Family,
    pub hp: Hparams,
    /// Keys seen by sliding-window layers, and which layers slide.
    pub window: usize,
    pub sliding: Vec<bool>,
    /// The sliding layers' rotation base.
    pub swa_base: f64,
    /// Gemma 2's soft caps of the attention scores and of the logits (0: none).
    pub attn_softcap: f32,
    pub final_softcap: f32,
    /// Multiplies the queries' products with the keys.
    pub query_scale: f32,
}

impl Config {
    pub fn from_gguf(g: &Gguf, family: Family) -> Result<Config, LoadError> {
        let arch = match family {
            Family::Gemma2 => "gemma2",
            Family::Gemma3 => "gemma3",
        };
        let hp = Hparams::from_gguf(g, arch, if family == Family::Gemma2 { 10_000.0 } else { 1e6 })?;
        // A window as long as the longest context is no window: larger ones are clamped.
        let window = g
            .get_u64(&format!("{arch}.attention.sliding_window"))?
            .unwrap_or(if family == Family::Gemma2 { 4096 } else { 512 })
            .min(super::MAX_CONTEXT) as usize;
        if window == 0 {
            return invalid(format!("implausible hyperparameters: window {window}"));
        }
        let cap = |key: &str, default: f64| -> Result<f32, LoadError> {
            let key = format!("{arch}.{key}");
            match g.get_f64(&key)?.unwrap_or(default) {
                c if c.is_finite() && c > 0.0 && c < 1e6 => Ok(c as f32),
                c => invalid(format!("{key} = {c} is not a usable soft cap")),
            }
        };
        let (attn_softcap, final_softcap) = match family {
            Family::Gemma2 => (cap("attn_logit_softcapping", 50.0)?, cap("final_logit_softcapping", 30.0)?),
            // Gemma 3 caps its logits only where its file says so (none of Google's do).
            Family::Gemma3 => match g.get_f64("gemma3.final_logit_softcapping")? {
                None => (0.0, 0.0),
                Some(c) if c == 0.0 => (0.0, 0.0),
                Some(_) => (0.0, cap("final_logit_softcapping", 0.0)?),
            },
        };
        // The 27B's queries are scaled by its `query_pre_attn_scalar`, n_embd / n_head, not by
        // its head size; the file does not say so (llama.cpp tells the 27B by its layers).
        let query_scale = match (family, hp.n_layer) {
            (Family::Gemma2, 46) | (Family::Gemma3, 62) => 1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt(),
            _ => 1.0 / (hp.head_dim as f32).sqrt(),
        };
        let sliding = super::sliding_layers(g, arch, hp.n_layer, if family == Family::Gemma2 { 2 } else { 6 })?;
        let swa_base = match g.get_f64(&format!("{arch}.rope.freq_base_swa"))? {
            Some(b) if b.is_finite() && b > 1.0 => b,
            Some(b) => return invalid(format!("{arch}.rope.freq_base_swa = {b} is not a usable base")),
            None if family == Family::Gemma2 => hp.rope_base,
            None => SWA_ROPE_BASE,
        };
        Ok(Config { family, hp, window, sliding, swa_base, attn_softcap, final_softcap, query_scale })
    }

    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding[layer]
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
    /// `[head_dim]` (Gemma 2: empty, no norm)
    pub q_norm: Vec<f32>,
    /// `[head_dim]` (Gemma 2: empty, no norm)
    pub k_norm: Vec<f32>,
    /// `[n_embd, n_head * head_dim]`
    pub wo: Linear,
    /// `[n_embd]`
    pub post_attn_norm: Vec<f32>,
    /// `[n_embd]`
    pub ffn_norm: Vec<f32>,
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
const POST_ATTN_NORM: u32 = 7;
const FFN_NORM: u32 = 8;
const GATE: u32 = 9;
const UP: u32 = 10;
const DOWN: u32 = 11;
const POST_FFN_NORM: u32 = 12;
const PARTS: u32 = 13;
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
            POST_ATTN_NORM => Tensor::Vector(&layer.post_attn_norm),
            FFN_NORM => Tensor::Vector(&layer.ffn_norm),
            GATE => Tensor::Matrix(&layer.gate),
            UP => Tensor::Matrix(&layer.up),
            DOWN => Tensor::Matrix(&layer.down),
            _ => Tensor::Vector(&layer.post_ffn_norm),
        }
    }
}

/// The rotations of the recipe's tables: the sliding layers' (Gemma 3's without the file's
/// scaling, Gemma 2's with its linear one), then the global ones' (the file's base and scaling),
/// where they differ; one table where they do not.
pub fn freqs(c: &Config) -> Vec<rope::Freqs> {
    let global = c.hp.freqs(None);
    let local = match c.family {
        Family::Gemma2 => rope::Freqs::new(c.swa_base, c.hp.rope_scale),
        Family::Gemma3 => rope::Freqs::new(c.swa_base, 1.0),
    };
    if local == global { vec![global] } else { vec![local, global] }
}

impl ArchConfig for Config {
    type Weights = Weights;

    fn hparams(&self) -> &Hparams {
        &self.hp
    }

    fn load(&self, g: &Gguf, file: &dyn Source) -> Result<Weights, LoadError> {
        let c = &self.hp;
        let (e, hd) = (c.n_embd, c.head_dim);
        let (nq, nkv) = (c.n_head * hd, c.n_head_kv * hd);
        let mut layers = Vec::with_capacity(c.n_layer);
        let head_norm = |name: &str| match self.family {
            Family::Gemma2 => Ok(Vec::new()),
            Family::Gemma3 => vector(g, file, name, hd),
        };
        for l in 0..c.n_layer {
            let name = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(g, file, &name("attn_norm"), e)?,
                wq: Linear::load(g, file, &name("attn_q"), nq, e)?,
                wk: Linear::load(g, file, &name("attn_k"), nkv, e)?,
                wv: Linear::load(g, file, &name("attn_v"), nkv, e)?,
                q_norm: head_norm(&name("attn_q_norm"))?,
                k_norm: head_norm(&name("attn_k_norm"))?,
                wo: Linear::load(g, file, &name("attn_output"), e, nq)?,
                post_attn_norm: vector(g, file, &name("post_attention_norm"), e)?,
                ffn_norm: vector(g, file, &name("ffn_norm"), e)?,
                gate: Linear::load(g, file, &name("ffn_gate"), c.n_ff, e)?,
                up: Linear::load(g, file, &name("ffn_up"), c.n_ff, e)?,
                down: Linear::load(g, file, &name("ffn_down"), e, c.n_ff)?,
                post_ffn_norm: vector(g, file, &name("post_ffw_norm"), e)?,
            });
        }
        let output = match g.tensor("output.weight") {
            Some(_) => Some(Linear::load(g, file, "output.weight", c.n_vocab, e)?),
            None => None,
        };
        let w = Weights {
            embd: Linear::load(g, file, "token_embd.weight", c.n_vocab, e)?,
            output,
            output_norm: vector(g, file, "output_norm.weight", e)?,
            layers,
        };
        Ok(w)
    }

    /// Gemma 3 (or 2) as a program. Inputs: the tokens' embeddings `[t, n_embd]`, the rotation
    /// tables of the sliding and of the global layers `[t, rope_dim]` (Gemma 2: one for both);
    /// output: the logits of each sequence's last token. Each layer `l` writes cache `l`.
    fn recipe(&self, w: &Weights) -> Result<Program, CheckError> {
        let c = self;
        let h = &c.hp;
        let (e, hd, eps) = (h.n_embd, h.head_dim, h.eps);
        let heads = Heads { n_head: h.n_head, n_head_kv: h.n_head_kv, head_dim: hd, scale: c.query_scale, softcap: c.attn_softcap };
        let gemma3 = c.family == Family::Gemma3;
        let mut p = Builder::new(w);
        let x = p.input(e);
        let local = p.input(h.rope_dim);
        let global = if freqs(c).len() == 2 { p.input(h.rope_dim) } else { local };
        // x = embd[token] * sqrt(n_embd)
        let mut x = p.scale(x, (e as f32).sqrt());
        for l in 0..h.n_layer {
            let id = |part| weight(l, part);
            let (table, window) = if c.is_sliding(l) { (local, c.window) } else { (global, 0) };

            // Attention: x = x + post_attn_norm(wo(attn(q, k, v))), each head of q and k normed
            // and turned, (q, k, v) = W attn_norm(x)
            let hn = p.norm(x, id(ATTN_NORM), eps);
            let (q, k, v) = (p.matmul(hn, id(WQ)), p.matmul(hn, id(WK)), p.matmul(hn, id(WV)));
            let (q, k) = if gemma3 { (p.rms_norm(q, Some(id(Q_NORM)), hd, eps), p.rms_norm(k, Some(id(K_NORM)), hd, eps)) } else { (q, k) };
            let q = p.rotate(q, table, hd, Rotation::Halves);
            let k = p.rotate(k, table, hd, Rotation::Halves);
            p.cache_write(k, v, l);
            let a = p.attention(q, l, heads, window);
            let o = p.matmul(a, id(WO));
            let o = p.norm(o, id(POST_ATTN_NORM), eps);
            x = p.add(x, o);

            // FFN: x = x + post_ffn_norm(down(gelu(gate(h)) * up(h))), h = ffn_norm(x)
            let hn = p.norm(x, id(FFN_NORM), eps);
            let (g, u) = (p.matmul(hn, id(GATE)), p.matmul(hn, id(UP)));
            let f = p.gated(g, u, Act::GeluTanh);
            let f = p.matmul(f, id(DOWN));
            let f = p.norm(f, id(POST_FFN_NORM), eps);
            x = p.add(x, f);
        }
        // logits = output(output_norm(x)) of the last token
        let last = p.last_rows(x);
        let last = p.norm(last, weight(h.n_layer, OUTPUT_NORM), eps);
        let mut logits = p.matmul(last, weight(h.n_layer, OUTPUT));
        if c.final_softcap > 0.0 {
            logits = p.softcap(logits, c.final_softcap);
        }
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

    fn freqs(&self, _w: &Weights) -> Vec<rope::Freqs> {
        freqs(self)
    }

    fn window(&self, layer: usize) -> Option<usize> {
        self.is_sliding(layer).then_some(self.window)
    }
}

/// The registry's line (`models::REGISTRY`).
pub const ARCH: Registered = Registered {
    names: &["gemma3", "gemma2"],
    config: |g, name| {
        let family = if name == "gemma2" { Family::Gemma2 } else { Family::Gemma3 };
        Ok(Box::new(Config::from_gguf(g, family)?))
    },
};
