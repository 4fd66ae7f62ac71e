//! Gemma 3 (text), as in the Gemma 3 technical report and Hugging Face's `Gemma3ForCausalLM`.
//!
//! Quirks, all read from the GGUF metadata where the file has them:
//! - the token embedding is scaled by `sqrt(n_embd)` and tied to the output projection
//!   (unless the file has `output.weight`);
//! - RMSNorm everywhere (the GGUF norm weights already include Gemma's `1 +`), with extra norms
//!   after attention and after the FFN, and per-head RMSNorm of queries and keys;
//! - the FFN is `down(gelu_tanh(gate(x)) * up(x))`;
//! - layers with `l % 6 != 5` attend over a sliding window of `attention.sliding_window` (512)
//!   keys with RoPE base 10000; the others are global with the file's `rope.freq_base` (and its
//!   linear `rope.scaling.factor`, if any);
//! - RoPE rotates the two halves of each head (NEOX); queries are scaled by `1/sqrt(head_dim)`;
//! - grouped-query attention: `head_count_kv` key/value heads shared by `head_count` queries.

use super::{LayerCache, Linear, LoadError, invalid, required_u64, vector};
use crate::dispatch::Dispatch;
use crate::gguf::Gguf;
use crate::kernels::{axpy, dot, gelu_tanh, rms_norm, softmax};

/// Layers with `l % SWA_PATTERN == SWA_PATTERN - 1` are global; the others slide.
const SWA_PATTERN: usize = 6;
const SWA_ROPE_BASE: f64 = 10_000.0;

/// Hyperparameters from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct Config {
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ctx_train: usize,
    pub eps: f32,
    pub rope_base: f64,
    pub rope_scale: f64,
    pub window: usize,
}

impl Config {
    pub fn from_gguf(g: &Gguf) -> Result<Config, LoadError> {
        let key = |k: &str| format!("gemma3.{k}");
        let n_embd = required_u64(g, &key("embedding_length"), super::MAX_WIDTH)? as usize;
        let n_layer = required_u64(g, &key("block_count"), super::MAX_LAYERS)? as usize;
        let n_ff = required_u64(g, &key("feed_forward_length"), super::MAX_WIDTH * 8)? as usize;
        let n_head = required_u64(g, &key("attention.head_count"), super::MAX_HEADS)? as usize;
        let n_head_kv = match g.get_u64(&key("attention.head_count_kv"))? {
            None => n_head,
            Some(v) if v == 0 || !(n_head as u64).is_multiple_of(v) => {
                return invalid(format!(
                    "attention.head_count_kv = {v} does not divide head_count = {n_head}"
                ));
            }
            Some(v) => v as usize,
        };
        let head_dim = match g.get_u64(&key("attention.key_length"))? {
            Some(v) if v > 0 && v <= super::MAX_WIDTH && v % 2 == 0 => v as usize,
            Some(v) => return invalid(format!("attention.key_length {v} is not a usable head size")),
            None if n_embd % n_head == 0 && (n_embd / n_head) % 2 == 0 => n_embd / n_head,
            None => {
                return invalid(format!(
                    "attention.head_count {n_head} does not divide embedding_length {n_embd} \
                     into heads of even size, and attention.key_length is missing"
                ));
            }
        };
        // Bounds every product of widths the session computes, in 32 bits too.
        if n_head * head_dim > super::MAX_WIDTH as usize {
            return invalid(format!(
                "attention width {n_head} heads x {head_dim} exceeds the cap of {}",
                super::MAX_WIDTH
            ));
        }
        if let Some(v) = g.get_u64(&key("attention.value_length"))? {
            if v != head_dim as u64 {
                return Err(LoadError::Unsupported(format!(
                    "value_length {v} differs from key_length {head_dim}"
                )));
            }
        }
        let n_ctx_train = match g.get_u64(&key("context_length"))? {
            Some(v) if v > 0 => v.min(super::MAX_CONTEXT) as usize,
            _ => 8192,
        };
        let eps = g.get_f64(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6) as f32;
        let rope_base = g.get_f64(&key("rope.freq_base"))?.unwrap_or(1e6);
        let rope_scale = match g.get_str(&key("rope.scaling.type"))? {
            None | Some("none") => 1.0,
            Some("linear") => g.get_f64(&key("rope.scaling.factor"))?.unwrap_or(1.0),
            Some(other) => {
                return Err(LoadError::Unsupported(format!("rope scaling {other:?}")));
            }
        };
        // A window as long as the longest context is no window: larger ones are clamped.
        let window =
            g.get_u64(&key("attention.sliding_window"))?.unwrap_or(512).min(super::MAX_CONTEXT)
                as usize;
        let token_embd = g.tensor("token_embd.weight");
        let n_vocab = match token_embd.map(|t| t.dims.as_slice()) {
            Some([e, v]) if *e == n_embd as u64 && *v > 0 && *v <= u32::MAX as u64 / 2 => {
                *v as usize
            }
            Some(d) => {
                return invalid(format!(
                    "token_embd.weight has shape {d:?}, expected [{n_embd}, n_vocab]"
                ));
            }
            None => return invalid("tensor token_embd.weight is missing"),
        };
        if !(eps > 0.0 && eps < 1.0) || !(rope_base > 1.0) || !(rope_scale >= 1.0) || window == 0 {
            return invalid(format!(
                "implausible hyperparameters: eps {eps}, rope base {rope_base}, \
                 rope scale {rope_scale}, window {window}"
            ));
        }
        Ok(Config {
            n_vocab,
            n_embd,
            n_layer,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_ctx_train,
            eps,
            rope_base,
            rope_scale,
            window,
        })
    }

    pub fn is_sliding(&self, layer: usize) -> bool {
        layer % SWA_PATTERN != SWA_PATTERN - 1
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

impl Weights {
    pub fn load(c: &Config, g: &Gguf, file: &[u8]) -> Result<Weights, LoadError> {
        let (e, hd) = (c.n_embd, c.head_dim);
        let (nq, nkv) = (c.n_head * hd, c.n_head_kv * hd);
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let name = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(g, file, &name("attn_norm"), e)?,
                wq: Linear::load(g, file, &name("attn_q"), nq, e)?,
                wk: Linear::load(g, file, &name("attn_k"), nkv, e)?,
                wv: Linear::load(g, file, &name("attn_v"), nkv, e)?,
                q_norm: vector(g, file, &name("attn_q_norm"), hd)?,
                k_norm: vector(g, file, &name("attn_k_norm"), hd)?,
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
        Ok(Weights {
            embd: Linear::load(g, file, "token_embd.weight", c.n_vocab, e)?,
            output,
            output_norm: vector(g, file, "output_norm.weight", e)?,
            layers,
        })
    }

    /// Every linear layer, the output projection last, for placing them on a device.
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v: Vec<&mut Linear> = Vec::new();
        for l in &mut self.layers {
            v.extend([&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo, &mut l.gate, &mut l.up, &mut l.down]);
        }
        v.push(self.output.as_mut().unwrap_or(&mut self.embd));
        v
    }
}

/// Per-session state, allocated once: KV cache and scratch for batches of up to `batch` tokens.
pub struct State {
    pub n_ctx: usize,
    pub batch: usize,
    pub cache: Vec<LayerCache>,
    /// `[batch, n_embd]`: the residual stream.
    x: Vec<f32>,
    /// `[batch, n_embd]`
    xb: Vec<f32>,
    /// `[batch, n_head * head_dim]`
    q: Vec<f32>,
    /// `[batch, n_head_kv * head_dim]`
    k: Vec<f32>,
    /// `[batch, n_head_kv * head_dim]`
    v: Vec<f32>,
    /// `[batch, n_head * head_dim]`
    att: Vec<f32>,
    /// `[batch, n_ff]`
    gate: Vec<f32>,
    /// `[batch, n_ff]`
    up: Vec<f32>,
    /// `[n_ctx]`: attention scores of one head.
    scores: Vec<f32>,
    /// `[batch, head_dim / 2]` cosines and sines, for sliding and global layers.
    rope_local: (Vec<f32>, Vec<f32>),
    rope_global: (Vec<f32>, Vec<f32>),
    /// `[n_vocab]`: logits after the last token.
    pub logits: Vec<f32>,
}

impl State {
    pub fn new(c: &Config, n_ctx: usize, batch: usize) -> State {
        let kv = c.n_head_kv * c.head_dim;
        let cache = (0..c.n_layer)
            .map(|l| LayerCache::new(n_ctx, c.is_sliding(l).then_some(c.window), batch, kv))
            .collect();
        let half = c.head_dim / 2;
        State {
            n_ctx,
            batch,
            cache,
            x: vec![0.0; batch * c.n_embd],
            xb: vec![0.0; batch * c.n_embd],
            q: vec![0.0; batch * c.n_head * c.head_dim],
            k: vec![0.0; batch * kv],
            v: vec![0.0; batch * kv],
            att: vec![0.0; batch * c.n_head * c.head_dim],
            gate: vec![0.0; batch * c.n_ff],
            up: vec![0.0; batch * c.n_ff],
            scores: vec![0.0; n_ctx],
            rope_local: (vec![0.0; batch * half], vec![0.0; batch * half]),
            rope_global: (vec![0.0; batch * half], vec![0.0; batch * half]),
            logits: vec![0.0; c.n_vocab],
        }
    }

    /// Bytes this state holds (KV cache and scratch).
    pub fn bytes(&self) -> usize {
        let scratch = self.x.len() + self.xb.len() + self.q.len() + self.k.len() + self.v.len()
            + self.att.len() + self.gate.len() + self.up.len() + self.scores.len()
            + 4 * self.rope_local.0.len() + self.logits.len();
        self.cache.iter().map(LayerCache::bytes).sum::<usize>() + 4 * scratch
    }
}

/// Fills `cos, sin: [t, half]` for positions `pos..pos + t`.
fn rope_table(base: f64, scale: f64, dim: usize, pos: usize, t: usize, cs: &mut (Vec<f32>, Vec<f32>)) {
    let half = dim / 2;
    for i in 0..t {
        let p = (pos + i) as f64 / scale;
        for j in 0..half {
            let theta = p * base.powf(-2.0 * j as f64 / dim as f64);
            cs.0[i * half + j] = theta.cos() as f32;
            cs.1[i * half + j] = theta.sin() as f32;
        }
    }
}

/// NEOX rotation of one head: pairs `(x[j], x[j + half])`.
fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    let (a, b) = x.split_at_mut(half);
    for j in 0..half {
        let (x0, x1) = (a[j], b[j]);
        a[j] = x0 * cos[j] - x1 * sin[j];
        b[j] = x0 * sin[j] + x1 * cos[j];
    }
}

/// Runs `tokens` (at most `s.batch`, at positions `pos..`) through the model, appending their
/// keys and values to the cache; with `want_logits`, fills `s.logits` for the last token.
/// The caller checks that the tokens are in the vocabulary and fit in the context.
pub fn forward(
    c: &Config,
    w: &Weights,
    s: &mut State,
    d: &mut Dispatch,
    tokens: &[u32],
    pos: usize,
    want_logits: bool,
) {
    let t = tokens.len();
    debug_assert!(t > 0 && t <= s.batch && pos + t <= s.n_ctx);
    let (e, hd, half) = (c.n_embd, c.head_dim, c.head_dim / 2);
    let (nq, nkv) = (c.n_head * hd, c.n_head_kv * hd);
    let group = c.n_head / c.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();

    // x = embd[token] * sqrt(n_embd)
    let embd_scale = (e as f32).sqrt();
    for (i, &tok) in tokens.iter().enumerate() {
        let row = &mut s.x[i * e..(i + 1) * e];
        w.embd.row(tok as usize, row);
        row.iter_mut().for_each(|v| *v *= embd_scale);
    }
    rope_table(SWA_ROPE_BASE, 1.0, hd, pos, t, &mut s.rope_local);
    rope_table(c.rope_base, c.rope_scale, hd, pos, t, &mut s.rope_global);

    for (l, layer) in w.layers.iter().enumerate() {
        let cache = &mut s.cache[l];
        let (cos, sin) = if c.is_sliding(l) { &s.rope_local } else { &s.rope_global };

        // Attention: x = x + post_attn_norm(attn(attn_norm(x)))
        s.xb[..t * e].copy_from_slice(&s.x[..t * e]);
        for row in s.xb[..t * e].chunks_exact_mut(e) {
            rms_norm(row, &layer.attn_norm, c.eps);
        }
        d.matmul(
            &s.xb,
            t,
            &mut [(&layer.wq, &mut s.q), (&layer.wk, &mut s.k), (&layer.wv, &mut s.v)],
        );
        for i in 0..t {
            let (cs, sn) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
            for head in s.q[i * nq..(i + 1) * nq].chunks_exact_mut(hd) {
                rms_norm(head, &layer.q_norm, c.eps);
                rope(head, cs, sn);
            }
            for head in s.k[i * nkv..(i + 1) * nkv].chunks_exact_mut(hd) {
                rms_norm(head, &layer.k_norm, c.eps);
                rope(head, cs, sn);
            }
            let slot = (pos + i) % cache.cap;
            cache.k[slot * nkv..(slot + 1) * nkv].copy_from_slice(&s.k[i * nkv..(i + 1) * nkv]);
            cache.v[slot * nkv..(slot + 1) * nkv].copy_from_slice(&s.v[i * nkv..(i + 1) * nkv]);
        }
        for i in 0..t {
            let p = pos + i;
            // Keys at positions first..=p: all of them, or the last `window` for sliding layers.
            let first = cache.window.map_or(0, |win| (p + 1).saturating_sub(win));
            let n_keys = p + 1 - first;
            for h in 0..c.n_head {
                let kvh = h / group;
                let q = &s.q[i * nq + h * hd..i * nq + (h + 1) * hd];
                let scores = &mut s.scores[..n_keys];
                for (j, sc) in scores.iter_mut().enumerate() {
                    let slot = (first + j) % cache.cap;
                    *sc = dot(q, &cache.k[slot * nkv + kvh * hd..slot * nkv + (kvh + 1) * hd]) * scale;
                }
                softmax(scores);
                let out = &mut s.att[i * nq + h * hd..i * nq + (h + 1) * hd];
                out.fill(0.0);
                for (j, &p) in scores.iter().enumerate() {
                    let slot = (first + j) % cache.cap;
                    axpy(p, &cache.v[slot * nkv + kvh * hd..slot * nkv + (kvh + 1) * hd], out);
                }
            }
        }
        d.matmul(&s.att, t, &mut [(&layer.wo, &mut s.xb)]);
        for (x, o) in s.x[..t * e].chunks_exact_mut(e).zip(s.xb.chunks_exact_mut(e)) {
            rms_norm(o, &layer.post_attn_norm, c.eps);
            x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);
        }

        // FFN: x = x + post_ffn_norm(down(gelu(gate(h)) * up(h))), h = ffn_norm(x)
        s.xb[..t * e].copy_from_slice(&s.x[..t * e]);
        for row in s.xb[..t * e].chunks_exact_mut(e) {
            rms_norm(row, &layer.ffn_norm, c.eps);
        }
        d.matmul(&s.xb, t, &mut [(&layer.gate, &mut s.gate), (&layer.up, &mut s.up)]);
        for (g, u) in s.gate[..t * c.n_ff].iter_mut().zip(&s.up[..t * c.n_ff]) {
            *g = gelu_tanh(*g) * u;
        }
        d.matmul(&s.gate, t, &mut [(&layer.down, &mut s.xb)]);
        for (x, o) in s.x[..t * e].chunks_exact_mut(e).zip(s.xb.chunks_exact_mut(e)) {
            rms_norm(o, &layer.post_ffn_norm, c.eps);
            x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);
        }
    }

    if want_logits {
        let last = &mut s.xb[..e];
        last.copy_from_slice(&s.x[(t - 1) * e..t * e]);
        rms_norm(last, &w.output_norm, c.eps);
        let output = w.output.as_ref().unwrap_or(&w.embd);
        d.matmul(&s.xb[..e], 1, &mut [(output, &mut s.logits)]);
    }
}
