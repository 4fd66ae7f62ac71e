//! `attention`: grouped heads, windows, heads of every width up to the contract's 512, one
//! query and a prefill-sized batch, held to the kit's exact attention; and the shapes and
//! lengths a hostile guest can send. A host may not offer attention at all (`unavailable`):
//! both cases skip then.

use super::{Check, Ctx, Kind, describe, fail, refused, skip};
use crate::bindings::wisp::llm::gpu::{self, AttentionShape, Error};
use crate::reference::{Attention, compare_attention};
use crate::rng::Rng;

fn wit(s: &Attention) -> AttentionShape {
    AttentionShape {
        t: s.t,
        n_keys: s.n_keys,
        n_head: s.n_head,
        n_head_kv: s.n_head_kv,
        head_dim: s.head_dim,
        window: s.window,
        scale: s.scale,
    }
}

/// Random queries, keys and values for `s`.
fn inputs(rng: &mut Rng, s: &Attention) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (q, k) = s.lens();
    (rng.vector(q), rng.vector(k), rng.vector(k))
}

/// A host without attention says so with `unavailable`: the cases skip. Any other error on a
/// valid call fails.
fn call(s: &Attention, q: &[f32], k: &[f32], v: &[f32]) -> Check<Vec<f32>> {
    match gpu::attention(q, k, v, wit(s)) {
        Ok(out) => Ok(out),
        Err(Error::Unavailable(m)) => skip(format!("the host does not offer attention (allowed): {m}")),
        Err(e) => fail(format!("attention {s:?} failed: {}", describe(&e))),
    }
}

/// Shapes like real models' (Gemma 3's 4 query heads of 256 on one key/value head with a
/// sliding window, Qwen2's 14 of 64 on 2), the widest and the narrowest heads, a query that
/// sees one key, and random ones; each against the exact attention.
pub fn matches(ctx: &mut Ctx) -> Check<String> {
    let r = &mut ctx.rng;
    let mut shapes = vec![
        Attention { t: 64, n_keys: 160 + r.range(0, 200), n_head: 4, n_head_kv: 1, head_dim: 256, window: 150, scale: 0.0625 },
        Attention { t: 1, n_keys: r.range(1, 300), n_head: 4, n_head_kv: 1, head_dim: 256, window: 0, scale: 0.0625 },
        Attention { t: r.range(2, 9), n_keys: 70, n_head: 14, n_head_kv: 2, head_dim: 64, window: 0, scale: 0.125 },
        Attention { t: 2, n_keys: 9, n_head: 2, n_head_kv: 2, head_dim: 512, window: 0, scale: 0.05 },
        Attention { t: 3, n_keys: 3, n_head: 3, n_head_kv: 1, head_dim: 1, window: 1, scale: 2.0 },
    ];
    for _ in 0..4 {
        let t = r.range(1, 30);
        let n_head_kv = r.range(1, 4);
        let head_dim = r.range(1, 320);
        shapes.push(Attention {
            t,
            n_keys: t + r.range(0, 140),
            n_head: n_head_kv * r.range(1, 4),
            n_head_kv,
            head_dim,
            window: if r.range(0, 1) == 0 { 0 } else { r.range(1, 90) },
            scale: r.uniform(1.0, 4.0) / (head_dim as f32).sqrt(),
        });
    }
    for s in &shapes {
        let (q, k, v) = inputs(&mut ctx.rng, s);
        let out = call(s, &q, &k, &v)?;
        match compare_attention(&out, &q, &k, &v, s) {
            Ok(e) => ctx.max_error = ctx.max_error.max(e),
            Err(m) => {
                ctx.max_error = ctx.max_error.max(m.max_error);
                return fail(format!("attention {s:?}: {}", m.message));
            }
        }
    }
    Ok(format!("{} shapes, windows and grouped heads, head-dim 1 to 512", shapes.len()))
}

/// Shapes outside the contract and lists that do not match the shape: `invalid-argument`; lists
/// past `max-activation-elements` (where the kit can send one): `out-of-memory`. Nothing changes.
pub fn hostile(ctx: &mut Ctx) -> Check<String> {
    let ok = Attention { t: 2, n_keys: 3, n_head: 2, n_head_kv: 1, head_dim: 4, window: 0, scale: 0.5 };
    let (q, k, v) = inputs(&mut ctx.rng, &ok);
    // A host without attention is skipped here too.
    call(&ok, &q, &k, &v)?;
    let with = |f: fn(&mut Attention)| {
        let mut s = ok;
        f(&mut s);
        s
    };
    let bad = [
        ("no query", with(|s| s.t = 0)),
        ("fewer keys than queries", with(|s| s.n_keys = 1)),
        ("no key/value head", with(|s| s.n_head_kv = 0)),
        ("query heads that do not group", with(|s| (s.n_head, s.n_head_kv) = (3, 2))),
        ("head-dim 0", with(|s| s.head_dim = 0)),
        ("head-dim 513", with(|s| s.head_dim = 513)),
        ("sizes that overflow 64 bits", with(|s| (s.t, s.n_keys, s.n_head, s.head_dim) = (u32::MAX, u32::MAX, u32::MAX, 512))),
        ("more keys than k holds", with(|s| s.n_keys = 4)),
        ("more queries than q holds", with(|s| s.t = 3)),
    ];
    for (what, s) in &bad {
        refused(&format!("attention with {what} ({s:?})"), &[Kind::InvalidArgument], || {
            gpu::attention(&q, &k, &v, wit(s))
        })?;
    }
    refused("attention with a v shorter than k", &[Kind::InvalidArgument], || {
        gpu::attention(&q, &k, &v[1..], wit(&ok))
    })?;
    let mut checked = bad.len() + 1;
    let max = ctx.device.max_activation_elements;
    if max < 1 << 22 {
        // One key/value head of one dimension, one key past the limit.
        let n = max as u32 + 1;
        let s = Attention { t: 1, n_keys: n, n_head: 1, n_head_kv: 1, head_dim: 1, window: 0, scale: 1.0 };
        let kv = vec![0.5f32; n as usize];
        refused(&format!("attention over {n} keys (max-activation-elements {max})"), &[Kind::OutOfMemory], || {
            gpu::attention(&[1.0], &kv, &kv, wit(&s))
        })?;
        checked += 1;
    }
    Ok(format!("{checked} hostile attention calls refused with the documented error"))
}

/// A `kv-cache`, or a skip where the host does not offer one.
fn create_cache(slots: u32, width: u32) -> Check<gpu::KvCache> {
    match gpu::create_kv_cache(slots, width) {
        Ok(c) => Ok(c),
        Err(Error::Unavailable(m)) => skip(format!("the host does not offer kv-caches (allowed): {m}")),
        Err(e) => fail(format!("create-kv-cache of {slots} slots of {width} failed: {}", describe(&e))),
    }
}

/// A session's worth of `attention-cached` calls on one cache: a prefill batch, decode steps,
/// a rewind whose batch wraps the ring, a sliding window, a batch after the wrap; each against
/// the exact attention over the kit's own copy of the ring. The cache costs its bytes and a
/// handle, and dropping it gives them back.
pub fn cached(ctx: &mut Ctx) -> Check<String> {
    let (n_head, n_head_kv, head_dim, slots) = (4u32, 2u32, 24u32, 40u32);
    let width = (n_head_kv * head_dim) as usize;
    let before = super::budget()?;
    let cache = create_cache(slots, width as u32)?;
    let during = super::budget()?;
    let bytes = 8 * slots as u64 * width as u64;
    if during != (before.0 - bytes, before.1 - 1) || cache.slots() != slots || cache.width() != width as u32 {
        return fail(format!(
            "a kv-cache of {slots} x {width}: budget {before:?} -> {during:?} (want {bytes} bytes and a handle less), \
             slots {}, width {}",
            cache.slots(),
            cache.width()
        ));
    }
    // The kit's copy of the ring, as position p % slots.
    let mut ring_k = vec![0f32; slots as usize * width];
    let mut ring_v = ring_k.clone();
    // (position of the first query, queries, window)
    let steps = [(0u32, 12u32, 0u32), (12, 1, 0), (13, 1, 0), (14, 1, 0), (17, 20, 16), (37, 10, 16), (47, 1, 16)];
    for (pos, t, window) in steps {
        let first = if window == 0 { 0 } else { (pos + 1).saturating_sub(window) };
        let s = Attention { t, n_keys: pos + t - first, n_head, n_head_kv, head_dim, window, scale: 0.2 };
        let (q_len, _) = s.lens();
        let q = ctx.rng.vector(q_len);
        let (k_new, v_new) = (ctx.rng.vector(t as usize * width), ctx.rng.vector(t as usize * width));
        for r in 0..t as usize {
            let at = ((pos as usize + r) % slots as usize) * width;
            ring_k[at..at + width].copy_from_slice(&k_new[r * width..(r + 1) * width]);
            ring_v[at..at + width].copy_from_slice(&v_new[r * width..(r + 1) * width]);
        }
        let what = format!("attention-cached at position {pos}, {t} queries, window {window}");
        let out = gpu::attention_cached(&q, &k_new, &v_new, pos, &cache, first, wit(&s))
            .or_else(|e| fail(format!("{what}: {}", describe(&e))))?;
        let rows = |ring: &[f32]| -> Vec<f32> {
            (first..pos + t).flat_map(|p| ring[(p as usize % slots as usize) * width..][..width].to_vec()).collect()
        };
        match compare_attention(&out, &q, &rows(&ring_k), &rows(&ring_v), &s) {
            Ok(e) => ctx.max_error = ctx.max_error.max(e),
            Err(m) => {
                ctx.max_error = ctx.max_error.max(m.max_error);
                return fail(format!("{what}: {}", m.message));
            }
        }
    }
    drop(cache);
    let after = super::budget()?;
    if after != before {
        return fail(format!("dropping the kv-cache left the budget at {after:?}, not {before:?}"));
    }
    Ok(format!("{} calls on a ring of {slots} x {width}: prefill, decode, a rewind that wraps, a window", steps.len()))
}

/// Caches of no size, and `attention-cached` calls that do not fit their cache: the documented
/// error, nothing changed.
pub fn cached_hostile(ctx: &mut Ctx) -> Check<String> {
    let cache = create_cache(8, 6)?;
    let ok = Attention { t: 1, n_keys: 3, n_head: 2, n_head_kv: 1, head_dim: 6, window: 0, scale: 0.5 };
    let q = ctx.rng.vector(12);
    let row = ctx.rng.vector(6);
    gpu::attention_cached(&q, &row, &row, 2, &cache, 0, wit(&ok))
        .or_else(|e| fail(format!("a valid attention-cached failed: {}", describe(&e))))?;
    let inv = &[Kind::InvalidArgument];
    refused("create-kv-cache of 0 slots", inv, || gpu::create_kv_cache(0, 6))?;
    refused("create-kv-cache of width 0", inv, || gpu::create_kv_cache(8, 0))?;
    refused("create-kv-cache of u32::MAX x u32::MAX", &[Kind::InvalidArgument, Kind::OutOfMemory], || {
        gpu::create_kv_cache(u32::MAX, u32::MAX)
    })?;
    let with = |f: fn(&mut Attention)| {
        let mut s = ok;
        f(&mut s);
        s
    };
    let long = ctx.rng.vector(9 * 6);
    let cases: [(&str, &[f32], &[f32], &[f32], Attention); 6] = [
        ("more keys than slots", &q, &row, &row, with(|s| (s.n_keys, s.t) = (9, 1))),
        ("heads wider than the cache", &q[..2], &row, &row, with(|s| (s.head_dim, s.n_head) = (1, 2))),
        ("a partial new row", &q, &row[..5], &row[..5], ok),
        ("fewer new values than keys", &q, &row, &row[..0], ok),
        ("more new rows than slots", &q, &long, &long, ok),
        ("a q of the wrong length", &q[..11], &row, &row, ok),
    ];
    for (what, q, k, v, s) in cases {
        refused(&format!("attention-cached with {what}"), inv, || gpu::attention_cached(q, k, v, 2, &cache, 0, wit(&s)))?;
    }
    Ok(format!("{} hostile kv-cache calls refused with the documented error", cases.len() + 3))
}
