//! Causal grouped-query attention over a per-layer KV cache, shared by every architecture.

use crate::kernels::{axpy, dot, softmax};

/// Keys and values of one layer: a ring of `cap` positions. Global layers have room for the
/// whole context; sliding-window layers for the window plus one batch, so that a batch's own
/// keys never overwrite keys its earlier queries still see.
pub struct LayerCache {
    /// `[cap, kv_dim]`
    pub k: Vec<f32>,
    /// `[cap, kv_dim]`
    pub v: Vec<f32>,
    pub cap: usize,
    pub window: Option<usize>,
}

impl LayerCache {
    pub fn new(n_ctx: usize, window: Option<usize>, batch: usize, kv_dim: usize) -> Self {
        let cap = match window {
            Some(w) => n_ctx.min(w + batch),
            None => n_ctx,
        };
        LayerCache { k: vec![0.0; cap * kv_dim], v: vec![0.0; cap * kv_dim], cap, window }
    }

    pub fn bytes(&self) -> usize {
        4 * (self.k.len() + self.v.len())
    }

    /// Stores the key and value rows (`[kv_dim]` each) of position `p`.
    pub fn store(&mut self, p: usize, k: &[f32], v: &[f32]) {
        let n = k.len();
        let slot = p % self.cap;
        self.k[slot * n..(slot + 1) * n].copy_from_slice(k);
        self.v[slot * n..(slot + 1) * n].copy_from_slice(v);
    }
}

/// The shape of attention: `n_head` query heads share `n_head_kv` key/value heads.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Applied to each query-key product (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
}

/// `out[i] = softmax(q[i] . K^T * scale) @ V` for the `t` queries `q: [t, n_head * head_dim]` at
/// positions `pos..pos + t`, each over the keys at positions `..=its own` in `cache` (the last
/// `window` of them on sliding layers). The cache holds every one of those positions already.
/// `scores` is scratch of at least `n_head / n_head_kv * (pos + t)` elements.
///
/// The query heads that share a key/value head are done together: each key and value row is
/// read once for all of them.
pub fn attend(cache: &LayerCache, h: Heads, q: &[f32], pos: usize, t: usize, scores: &mut [f32], out: &mut [f32]) {
    let hd = h.head_dim;
    let (nq, nkv) = (h.n_head * hd, h.n_head_kv * hd);
    let group = h.n_head / h.n_head_kv;
    for i in 0..t {
        let p = pos + i;
        // Keys at positions first..=p: all of them, or the last `window` for sliding layers.
        let first = cache.window.map_or(0, |win| (p + 1).saturating_sub(win));
        let n_keys = p + 1 - first;
        let scores = &mut scores[..group * n_keys];
        for kvh in 0..h.n_head_kv {
            // `[group, hd]` queries and outputs of the heads of this key/value head.
            let qs = &q[i * nq + kvh * group * hd..i * nq + (kvh + 1) * group * hd];
            let outs = &mut out[i * nq + kvh * group * hd..i * nq + (kvh + 1) * group * hd];
            let mut slot = first % cache.cap;
            for j in 0..n_keys {
                let k = &cache.k[slot * nkv + kvh * hd..slot * nkv + (kvh + 1) * hd];
                for (g, qh) in qs.chunks_exact(hd).enumerate() {
                    scores[g * n_keys + j] = dot(qh, k) * h.scale;
                }
                slot = if slot + 1 == cache.cap { 0 } else { slot + 1 };
            }
            for s in scores.chunks_exact_mut(n_keys) {
                softmax(s);
            }
            outs.fill(0.0);
            let mut slot = first % cache.cap;
            for j in 0..n_keys {
                let v = &cache.v[slot * nkv + kvh * hd..slot * nkv + (kvh + 1) * hd];
                for (g, o) in outs.chunks_exact_mut(hd).enumerate() {
                    axpy(scores[g * n_keys + j], v, o);
                }
                slot = if slot + 1 == cache.cap { 0 } else { slot + 1 };
            }
        }
    }
}
