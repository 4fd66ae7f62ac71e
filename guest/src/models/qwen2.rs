//! Qwen2 (Qwen2 technical report; Hugging Face's `Qwen2ForCausalLM`) and Llama (Llama 2 and 3,
//! `LlamaForCausalLM`), with Granite (`GraniteForCausalLM`), SmolLM3 (`SmolLM3ForCausalLM`) and
//! Mistral 3 (Ministral 3's text model): the same pre-norm decoder block, told apart by the GGUF
//! architecture.
//!
//! `x = x + wo(attn(rope(wq h + bq), rope(wk h + bk), wv h + bv))`, `h = rms_norm(x)`, then
//! `x = x + down(silu(gate(h)) * up(h))`, `h = rms_norm(x)`; logits `= output(rms_norm(x))`.
//!
//! Quirks, all read from the GGUF file where it has them:
//! - Qwen2 has biases on q, k and v (optional here for both: loaded when the file has them);
//! - RoPE: Qwen2 rotates the two halves of each head (NEOX), Llama adjacent pairs (the GGUF
//!   converter permutes Llama's q/k rows for it); base `rope.freq_base` (10000 when missing),
//!   linear `rope.scaling.factor`, and Llama 3's per-frequency divisors `rope_freqs.weight`;
//! - grouped-query attention, queries scaled by `1/sqrt(head_dim)`, no sliding window;
//! - the output projection is `output.weight`, or tied to `token_embd.weight` when absent;
//!   the embedding is not scaled;
//! - Granite (llama.cpp's `granite`) scales by four numbers of its file: the embedding by
//!   `embedding_scale`, each block's output (attention's, the FFN's) by `residual_scale` before
//!   it is added, the logits by `1 / logit_scale`, and the attention scores by
//!   `attention.scale` in place of `1/sqrt(head_dim)`; `rope.scaling.finetuned = false` turns
//!   the rotation off;
//! - SmolLM3 (llama.cpp's `smollm3`) turns no queries or keys in every fourth layer (3, 7, ..);
//! - Mistral 3 (llama.cpp's `mistral3`): Llama with YaRN's rotation scaling (any of these files
//!   may have it: `Hparams::freqs`) and Llama 4's attention temperature: with
//!   `attention.temperature_scale` = `b`, the queries of position `p` are also scaled by
//!   `1 + b ln(floor(p / n) + 1)`, `n` the original context (`rope.scaling.original_context_length`),
//!   through a rotation table of their own.

use super::attention::Heads;
use super::rope::{self, Style};
use super::{ArchConfig, Hparams, Linear, LoadError, Registered, optional_vector, rope_factors, vector};
use crate::gguf::Gguf;
use crate::source::Source;
use crate::kernels::Act;
use crate::program::{Builder, CheckError, Program, Rotation, Tensor, Tensors, Value, WeightId};

/// The architectures this file runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Qwen2,
    Llama,
    Granite,
    SmolLM3,
    Mistral3,
}

impl Family {
    pub fn from_name(arch: &str) -> Option<Family> {
        match arch {
            "qwen2" => Some(Family::Qwen2),
            "llama" => Some(Family::Llama),
            "granite" => Some(Family::Granite),
            "smollm3" => Some(Family::SmolLM3),
            "mistral3" => Some(Family::Mistral3),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::Qwen2 => "qwen2",
            Family::Llama => "llama",
            Family::Granite => "granite",
            Family::SmolLM3 => "smollm3",
            Family::Mistral3 => "mistral3",
        }
    }
}

/// Granite's multipliers (1 where a model has none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Multipliers {
    /// The embedding's rows are scaled by it.
    pub embedding: f32,
    /// Attention's and the FFN's outputs are scaled by it before they are added.
    pub residual: f32,
    /// The logits are divided by it.
    pub logits: f32,
    /// The attention scores' scale, `1/sqrt(head_dim)` where `None`.
    pub attention: Option<f32>,
}

impl Multipliers {
    const NONE: Multipliers = Multipliers { embedding: 1.0, residual: 1.0, logits: 1.0, attention: None };

    /// Granite's, from `granite.*_scale`: `logit_scale` required (as llama.cpp requires it), the
    /// others 1 (or the usual attention scale) when missing or 0.
    fn granite(g: &Gguf) -> Result<Multipliers, LoadError> {
        let read = |key: &str| -> Result<Option<f32>, LoadError> {
            match g.get_f64(&format!("granite.{key}"))? {
                None => Ok(None),
                Some(v) if v == 0.0 => Ok(None),
                Some(v) if v.is_finite() && v > 0.0 && v < 1e6 => Ok(Some(v as f32)),
                Some(v) => super::invalid(format!("granite.{key} = {v} is not a usable scale")),
            }
        };
        let Some(logits) = read("logit_scale")? else {
            return super::invalid("granite.logit_scale is missing");
        };
        Ok(Multipliers {
            embedding: read("embedding_scale")?.unwrap_or(1.0),
            residual: read("residual_scale")?.unwrap_or(1.0),
            logits,
            attention: read("attention.scale")?,
        })
    }
}

/// Hyperparameters from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct Config {
    pub family: Family,
    pub hp: Hparams,
    pub rope_style: Style,
    pub scales: Multipliers,
    /// Layers whose queries and keys are not turned: `l + 1` a multiple of it (SmolLM3: 4).
    pub no_rope_every: Option<usize>,
    /// Whether any layer turns its queries and keys (Granite's `rope.scaling.finetuned`).
    pub rope: bool,
    /// Mistral 3's attention temperature: the queries turn by a table of their own, scaled.
    pub temperature: Option<rope::Temperature>,
}

impl Config {
    pub fn from_gguf(g: &Gguf, family: Family) -> Result<Config, LoadError> {
        let hp = Hparams::from_gguf(g, family.name(), 10_000.0)?;
        let rope_style = match family {
            Family::Qwen2 => Style::Neox,
            Family::Llama | Family::Granite | Family::SmolLM3 | Family::Mistral3 => Style::Norm,
        };
        let (scales, rope) = match family {
            Family::Granite => (Multipliers::granite(g)?, g.get_bool("granite.rope.scaling.finetuned")?.unwrap_or(true)),
            _ => (Multipliers::NONE, true),
        };
        let no_rope_every = (family == Family::SmolLM3).then_some(4);
        let temperature = match (family, g.get_f64("mistral3.attention.temperature_scale")?) {
            (Family::Mistral3, Some(beta)) if beta != 0.0 => {
                if !(beta.is_finite() && beta.abs() < 1e3) {
                    return super::invalid(format!("mistral3.attention.temperature_scale = {beta} is not a usable scale"));
                }
                if hp.rope_dim != hp.head_dim {
                    return Err(LoadError::Unsupported("an attention temperature with a partial rotation".into()));
                }
                let floor = match g.get_u64("mistral3.rope.scaling.original_context_length")? {
                    Some(n) if n > 0 => n.min(super::MAX_CONTEXT) as usize,
                    _ => hp.n_ctx_train,
                };
                Some(rope::Temperature { beta, floor })
            }
            _ => None,
        };
        Ok(Config { family, hp, rope_style, scales, no_rope_every, rope, temperature })
    }

    /// Whether layer `l` turns its queries and keys.
    fn turns(&self, l: usize) -> bool {
        self.rope && self.no_rope_every.is_none_or(|n| !(l + 1).is_multiple_of(n))
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
    /// `[n_head * head_dim]`, `[n_head_kv * head_dim]`, `[n_head_kv * head_dim]`
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// `[n_embd, n_head * head_dim]`
    pub wo: Linear,
    /// `[n_embd]`
    pub bo: Option<Vec<f32>>,
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
    /// RoPE frequencies, with the file's `rope_freqs.weight` (`[head_dim / 2]`) if it has one.
    pub rope: rope::Freqs,
}

/// The weights of a layer as the recipe names them: `layer * PARTS + part`; the model's own
/// after the last layer's.
const ATTN_NORM: u32 = 0;
const WQ: u32 = 1;
const WK: u32 = 2;
const WV: u32 = 3;
const BQ: u32 = 4;
const BK: u32 = 5;
const BV: u32 = 6;
const WO: u32 = 7;
const BO: u32 = 8;
const FFN_NORM: u32 = 9;
const GATE: u32 = 10;
const UP: u32 = 11;
const DOWN: u32 = 12;
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
            BQ => bias(&layer.bq),
            BK => bias(&layer.bk),
            BV => bias(&layer.bv),
            WO => Tensor::Matrix(&layer.wo),
            BO => bias(&layer.bo),
            FFN_NORM => Tensor::Vector(&layer.ffn_norm),
            GATE => Tensor::Matrix(&layer.gate),
            UP => Tensor::Matrix(&layer.up),
            _ => Tensor::Matrix(&layer.down),
        }
    }
}

/// `x` scaled by one of Granite's multipliers, or `x` itself where it is 1.
fn times(p: &mut Builder<'_>, x: Value, by: f32) -> Value {
    if by == 1.0 { x } else { p.scale(x, by) }
}

/// A bias the recipe names (it names only those the file has).
fn bias(b: &Option<Vec<f32>>) -> Tensor<'_> {
    Tensor::Vector(b.as_deref().unwrap_or_default())
}

impl ArchConfig for Config {
    type Weights = Weights;

    fn hparams(&self) -> &Hparams {
        &self.hp
    }

    fn load(&self, g: &Gguf, file: &dyn Source) -> Result<Weights, LoadError> {
        let c = self;
        let h = &c.hp;
        let (e, hd) = (h.n_embd, h.head_dim);
        let (nq, nkv) = (h.n_head * hd, h.n_head_kv * hd);
        let mut layers = Vec::with_capacity(h.n_layer);
        for l in 0..h.n_layer {
            let name = |s: &str| format!("blk.{l}.{s}.weight");
            let bias = |s: &str, n: usize| optional_vector(g, file, &format!("blk.{l}.{s}.bias"), n);
            layers.push(Layer {
                attn_norm: vector(g, file, &name("attn_norm"), e)?,
                wq: Linear::load(g, file, &name("attn_q"), nq, e)?,
                wk: Linear::load(g, file, &name("attn_k"), nkv, e)?,
                wv: Linear::load(g, file, &name("attn_v"), nkv, e)?,
                bq: bias("attn_q", nq)?,
                bk: bias("attn_k", nkv)?,
                bv: bias("attn_v", nkv)?,
                wo: Linear::load(g, file, &name("attn_output"), e, nq)?,
                bo: bias("attn_output", e)?,
                ffn_norm: vector(g, file, &name("ffn_norm"), e)?,
                gate: Linear::load(g, file, &name("ffn_gate"), h.n_ff, e)?,
                up: Linear::load(g, file, &name("ffn_up"), h.n_ff, e)?,
                down: Linear::load(g, file, &name("ffn_down"), e, h.n_ff)?,
            });
        }
        let output = match g.tensor("output.weight") {
            Some(_) => Some(Linear::load(g, file, "output.weight", h.n_vocab, e)?),
            None => None,
        };
        let factors = rope_factors(g, file, "rope_freqs.weight", h.rope_dim / 2)?;
        let w = Weights {
            embd: Linear::load(g, file, "token_embd.weight", h.n_vocab, e)?,
            output,
            output_norm: vector(g, file, "output_norm.weight", e)?,
            layers,
            rope: h.freqs(factors),
        };
        Ok(w)
    }

    /// Qwen2, Llama, Granite, SmolLM3 and Mistral 3 as a program. Inputs: the tokens' embeddings
    /// `[t, n_embd]`, the rotation table `[t, rope_dim]` (and the queries' own, with Mistral 3's
    /// temperature); output: the logits of each sequence's
    /// last token. Each layer `l` writes cache `l`.
    fn recipe(&self, w: &Weights) -> Result<Program, CheckError> {
        let c = self;
        let h = &c.hp;
        let (e, hd, eps, s) = (h.n_embd, h.head_dim, h.eps, c.scales);
        let scale = s.attention.unwrap_or(1.0 / (hd as f32).sqrt());
        let heads = Heads { n_head: h.n_head, n_head_kv: h.n_head_kv, head_dim: hd, scale, softcap: 0.0 };
        let rotation = match c.rope_style {
            Style::Neox => Rotation::Halves,
            Style::Norm => Rotation::Pairs,
        };
        let mut p = Builder::new(w);
        let x = p.input(e);
        let mut x = times(&mut p, x, s.embedding);
        let table = p.input(h.rope_dim);
        let q_table = if c.temperature.is_some() { p.input(h.rope_dim) } else { table };
        for (l, layer) in w.layers.iter().enumerate() {
            let id = |part| weight(l, part);
            let has = |b: &Option<Vec<f32>>, part| b.as_ref().map(|_| id(part));

            // Attention: x = x + wo(attn(rope(q), rope(k), v)) + bo, (q, k, v) = W h + b,
            // h = attn_norm(x)
            let hn = p.norm(x, id(ATTN_NORM), eps);
            let (q, k, v) = (p.matmul(hn, id(WQ)), p.matmul(hn, id(WK)), p.matmul(hn, id(WV)));
            let q = p.bias_if(q, has(&layer.bq, BQ));
            let k = p.bias_if(k, has(&layer.bk, BK));
            let v = p.bias_if(v, has(&layer.bv, BV));
            let (q, k) = match c.turns(l) {
                true => (p.rotate(q, q_table, hd, rotation), p.rotate(k, table, hd, rotation)),
                false => (q, k),
            };
            p.cache_write(k, v, l);
            let a = p.attention(q, l, heads, 0);
            let o = p.matmul(a, id(WO));
            let o = p.bias_if(o, has(&layer.bo, BO));
            let o = times(&mut p, o, s.residual);
            x = p.add(x, o);

            // FFN: x = x + down(silu(gate(h)) * up(h)), h = ffn_norm(x)
            let hn = p.norm(x, id(FFN_NORM), eps);
            let (g, u) = (p.matmul(hn, id(GATE)), p.matmul(hn, id(UP)));
            let f = p.gated(g, u, Act::Silu);
            let f = p.matmul(f, id(DOWN));
            let f = times(&mut p, f, s.residual);
            x = p.add(x, f);
        }
        // logits = output(output_norm(x)) of the last token
        let last = p.last_rows(x);
        let last = p.norm(last, weight(h.n_layer, OUTPUT_NORM), eps);
        let logits = p.matmul(last, weight(h.n_layer, OUTPUT));
        let logits = times(&mut p, logits, 1.0 / s.logits);
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
        let queries = self.temperature.as_ref().map(|t| rope::Freqs { temperature: Some(t.clone()), ..w.rope.clone() });
        [Some(w.rope.clone()), queries].into_iter().flatten().collect()
    }
}

/// The registry's line (`models::REGISTRY`): Qwen2, Llama, Granite, SmolLM3 and Mistral 3.
pub const ARCH: Registered = Registered {
    names: &["qwen2", "llama", "granite", "smollm3", "mistral3"],
    config: |g, name| match Family::from_name(name) {
        Some(family) => Ok(Box::new(Config::from_gguf(g, family)?)),
        None => Err(LoadError::Unsupported(format!("architecture {name:?}"))),
    },
};
