//! Causal grouped-query attention over a per-layer KV cache, shared by every architecture.

use crate::kernels::{dot_rows, softmax, weighted_sum};

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
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Heads {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Applied to each query-key product (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Caps each scaled product as `softcap * tanh(s / softcap)` (Gemma 2); 0 for none.
    pub softcap: f32,
}

/// `out[i] = softmax(cap(q[i] . K^T * scale)) @ V` (`cap` the soft cap, where there is one) for the `t` queries `q: [t, n_head * head_dim]` at
/// positions `pos..pos + t`, each over the keys at positions `..=its own` in `cache` (the last
/// `window` of them on sliding layers). The cache holds every one of those positions already.
/// `scores` is scratch of at least `pos + t` elements.
///
/// Each head's keys and values are read as rows of the cache (at most two runs of slots, the
/// ring wrapping once): scores by `dot_rows`, outputs accumulated in registers by
/// `weighted_sum`. The query heads that share a key/value head read it while it is in cache.
pub fn attend(cache: &LayerCache, h: Heads, q: &[f32], pos: usize, t: usize, scores: &mut [f32], out: &mut [f32]) {
    let hd = h.head_dim;
    let (nq, nkv) = (h.n_head * hd, h.n_head_kv * hd);
    let group = h.n_head / h.n_head_kv;
    for i in 0..t {
        let p = pos + i;
        // Keys at positions first..=p: all of them, or the last `window` for sliding layers.
        let first = cache.window.map_or(0, |win| (p + 1).saturating_sub(win));
        let n_keys = p + 1 - first;
        let scores = &mut scores[..n_keys];
        // The slots of those positions: `start..` up to the end of the ring, then `0..`.
        let start = first % cache.cap;
        let runs = [(start, 0, n_keys.min(cache.cap - start)), (0, cache.cap - start, n_keys.saturating_sub(cache.cap - start))];
        for head in 0..h.n_head {
            let kv = head / group * hd;
            let qh = &q[i * nq + head * hd..i * nq + (head + 1) * hd];
            for &(slot, j, n) in runs.iter().filter(|r| r.2 > 0) {
                dot_rows(qh, &cache.k[slot * nkv + kv..], nkv, h.scale, &mut scores[j..j + n]);
            }
            if h.softcap > 0.0 {
                scores.iter_mut().for_each(|s| *s = wisp_ops::softcap(*s, h.softcap));
            }
            softmax(scores);
            let o = &mut out[i * nq + head * hd..i * nq + (head + 1) * hd];
            o.fill(0.0);
            for &(slot, j, n) in runs.iter().filter(|r| r.2 > 0) {
                weighted_sum(&scores[j..j + n], &cache.v[slot * nkv + kv..], nkv, o);
            }
        }
    }
}
