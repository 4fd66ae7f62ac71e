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
/// `scores` is scratch of at least `pos + t` elements.
pub fn attend(cache: &LayerCache, h: Heads, q: &[f32], pos: usize, t: usize, scores: &mut [f32], out: &mut [f32]) {
    let hd = h.head_dim;
    let (nq, nkv) = (h.n_head * hd, h.n_head_kv * hd);
    let group = h.n_head / h.n_head_kv;
    for i in 0..t {
        let p = pos + i;
        // Keys at positions first..=p: all of them, or the last `window` for sliding layers.
        let first = cache.window.map_or(0, |win| (p + 1).saturating_sub(win));
        let n_keys = p + 1 - first;
        for head in 0..h.n_head {
            let kvh = head / group;
            let q = &q[i * nq + head * hd..i * nq + (head + 1) * hd];
            let scores = &mut scores[..n_keys];
            for (j, sc) in scores.iter_mut().enumerate() {
                let slot = (first + j) % cache.cap;
                *sc = dot(q, &cache.k[slot * nkv + kvh * hd..slot * nkv + (kvh + 1) * hd]) * h.scale;
            }
            softmax(scores);
            let out = &mut out[i * nq + head * hd..i * nq + (head + 1) * hd];
            out.fill(0.0);
            for (j, &p) in scores.iter().enumerate() {
                let slot = (first + j) % cache.cap;
                axpy(p, &cache.v[slot * nkv + kvh * hd..slot * nkv + (kvh + 1) * hd], out);
            }
        }
    }
}
