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
