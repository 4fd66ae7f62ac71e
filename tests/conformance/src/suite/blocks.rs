//! `blocks`: decoder blocks of both kinds the contract names (Gemma 3's, with head norms, norms
//! after attention and the feed-forward block, a sliding window and two rotation tables; Qwen2's,
//! with biases, rotations of adjacent pairs and SiLU), over several calls that continue one
//! another through the blocks' caches (a batch, single tokens, a batch that wraps a ring),
//! held to the kit's own blocks in f64; and the calls a hostile guest can make. A host may not
//! offer `blocks` (`unavailable`): both cases skip then.

use super::{Check, Ctx, Kind, describe, fail, refused, skip, upload};
use crate::bindings::wisp::llm::gpu::{
    self, Activation, Block, BlocksOutput, BlocksShape, Error, KvCache, Rotation, Weight as Handle,
};
use crate::reference::{Decoded, Format, Weight};
use crate::rng::Rng;

/// How far a host's value may lie from the kit's, as a fraction of the root mean square of the
/// row it belongs to (a residual row, or a block's key or value row): f32 rounding through a
/// few products, norms and a softmax stays far below it; a missing step, a wrong pairing or a
/// key read from the wrong row does not.
const TOLERANCE: f64 = 2e-3;

/// A vector as the kit keeps it, and its upload.
struct Vector {
    v: Vec<f64>,
    handle: Handle,
}

/// A matrix as the kit keeps it, and its upload.
struct Matrix {
    d: Decoded,
    handle: Handle,
}

/// One block: its weights, its cache on the host and the kit's copy of that ring.
struct RefBlock {
    attn_norm: Vector,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    q_bias: Option<Vector>,
    k_bias: Option<Vector>,
    v_bias: Option<Vector>,
    q_norm: Option<Vector>,
    k_norm: Option<Vector>,
    wo: Matrix,
    o_bias: Option<Vector>,
    post_attn_norm: Option<Vector>,
    ffn_norm: Vector,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    post_ffn_norm: Option<Vector>,
    cache: KvCache,
    slots: usize,
    window: u32,
    rope: u32,
    /// The ring as the kit expects it: `[slots][nkv]` keys and values.
    keys: Vec<Vec<f64>>,
    values: Vec<Vec<f64>>,
}

/// What the blocks of a configuration share.
#[derive(Clone, Copy)]
struct Config {
    n_embd: u32,
    n_ff: u32,
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    eps: f32,
    gemma: bool,
}

impl Config {
    fn shape(&self) -> BlocksShape {
        BlocksShape {
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            eps: self.eps,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            act: if self.gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            rotation: if self.gemma {
                Rotation::Halves
            } else {
                Rotation::Pairs
            },
        }
    }

    fn nq(&self) -> usize {
        (self.n_head * self.head_dim) as usize
    }

    fn nkv(&self) -> usize {
        (self.n_head_kv * self.head_dim) as usize
    }
}

fn vector(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Check<Vector> {
    let v: Vec<f32> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
    let w = Weight {
        format: Format::F32,
        n_out: 1,
        n_in: n as u32,
        data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        scales: Vec::new(),
    };
    Ok(Vector {
        v: v.iter().map(|&x| x as f64).collect(),
        handle: upload(&w)?,
    })
}

/// A matrix in `format`; `small` ones (the query and key products of a block without head
/// norms) are f32 of small values, so that the softmax stays far from one-hot.
fn matrix(rng: &mut Rng, format: Format, n_out: u32, n_in: u32, small: bool) -> Check<Matrix> {
    let w = if small {
        let data = (0..n_out * n_in)
            .flat_map(|_| rng.uniform(-0.05, 0.05).to_le_bytes())
            .collect();
        Weight {
            format: Format::F32,
            n_out,
            n_in,
            data,
            scales: Vec::new(),
        }
    } else {
        Weight::random(format, n_out, n_in, rng)
    };
    Ok(Matrix {
        d: w.decode(),
        handle: upload(&w)?,
    })
}

fn create_cache(slots: usize, width: usize) -> Check<KvCache> {
    match gpu::create_kv_cache(slots as u32, width as u32) {
        Ok(c) => Ok(c),
        Err(Error::Unavailable(m)) => skip(format!(
            "the host does not offer kv-caches, so no blocks (allowed): {m}"
        )),
        Err(e) => fail(format!(
            "create-kv-cache({slots}, {width}) failed: {}",
            describe(&e)
        )),
    }
}

impl RefBlock {
    /// A block of `c`'s kind, its matrices in formats from `Format::ALL` starting at `first`.
    fn random(
        rng: &mut Rng,
        c: &Config,
        first: usize,
        window: u32,
        rope: u32,
        slots: usize,
    ) -> Check<RefBlock> {
        let (e, ff, nq, nkv, hd) = (
            c.n_embd,
            c.n_ff,
            c.nq() as u32,
            c.nkv() as u32,
            c.head_dim as usize,
        );
        let f = |i: usize| Format::ALL[(first + i) % Format::ALL.len()];
        let g = c.gemma;
        let opt = |rng: &mut Rng, on: bool, n: usize, lo: f32, hi: f32| {
            if on {
                vector(rng, n, lo, hi).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(RefBlock {
            attn_norm: vector(rng, e as usize, 0.5, 1.5)?,
            wq: matrix(rng, f(0), nq, e, !g)?,
            wk: matrix(rng, f(1), nkv, e, !g)?,
            wv: matrix(rng, f(2), nkv, e, false)?,
            q_bias: opt(rng, !g, nq as usize, -0.5, 0.5)?,
            k_bias: opt(rng, !g, nkv as usize, -0.5, 0.5)?,
            v_bias: opt(rng, !g, nkv as usize, -0.5, 0.5)?,
            q_norm: opt(rng, g, hd, 0.5, 1.5)?,
            k_norm: opt(rng, g, hd, 0.5, 1.5)?,
            wo: matrix(rng, f(3), e, nq, false)?,
            o_bias: opt(rng, !g, e as usize, -0.5, 0.5)?,
            post_attn_norm: opt(rng, g, e as usize, 0.5, 1.5)?,
            ffn_norm: vector(rng, e as usize, 0.5, 1.5)?,
            gate: matrix(rng, f(4), ff, e, false)?,
            up: matrix(rng, f(5), ff, e, false)?,
            down: matrix(rng, f(6), e, ff, false)?,
            post_ffn_norm: opt(rng, g, e as usize, 0.5, 1.5)?,
            cache: create_cache(slots, nkv as usize)?,
            slots,
            window,
            rope,
            keys: vec![vec![0.0; nkv as usize]; slots],
            values: vec![vec![0.0; nkv as usize]; slots],
        })
    }

    fn wit(&self) -> Block<'_> {
        fn o(v: &Option<Vector>) -> Option<&Handle> {
            v.as_ref().map(|v| &v.handle)
        }
        Block {
            attn_norm: &self.attn_norm.handle,
            wq: &self.wq.handle,
            wk: &self.wk.handle,
            wv: &self.wv.handle,
            q_bias: o(&self.q_bias),
            k_bias: o(&self.k_bias),
            v_bias: o(&self.v_bias),
            q_norm: o(&self.q_norm),
            k_norm: o(&self.k_norm),
            wo: &self.wo.handle,
            o_bias: o(&self.o_bias),
            post_attn_norm: o(&self.post_attn_norm),
            ffn_norm: &self.ffn_norm.handle,
            gate: &self.gate.handle,
            up: &self.up.handle,
            down: &self.down.handle,
            post_ffn_norm: o(&self.post_ffn_norm),
            cache: &self.cache,
            window: self.window,
            rope: self.rope,
        }
    }

    /// The block over `x` (rows of positions `pos..`) from the contract's words in f64, the
    /// kit's ring updated; returns the rows' keys and values.
    fn run(
        &mut self,
        c: &Config,
        x: &mut [Vec<f64>],
        pos: usize,
        tables: &[Vec<f32>],
    ) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
        let (hd, eps) = (c.head_dim as usize, c.eps as f64);
        let group = (c.n_head / c.n_head_kv) as usize;
        let table = &tables[self.rope as usize];
        let mut qs = Vec::new();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for (i, row) in x.iter().enumerate() {
            let h = norm(row, &self.attn_norm.v, eps);
            let mut q = add(product(&self.wq.d, &h), &self.q_bias);
            let mut k = add(product(&self.wk.d, &h), &self.k_bias);
            let v = add(product(&self.wv.d, &h), &self.v_bias);
            for (m, n) in [(&mut q, &self.q_norm), (&mut k, &self.k_norm)] {
                for head in m.chunks_exact_mut(hd) {
                    if let Some(n) = n {
                        head.copy_from_slice(&norm(head, &n.v, eps));
                    }
                    rotate(head, &table[i * hd..(i + 1) * hd], !c.gemma);
                }
            }
            let slot = (pos + i) % self.slots;
            (self.keys[slot], self.values[slot]) = (k.clone(), v.clone());
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (i, row) in x.iter_mut().enumerate() {
            let p = pos + i;
            let first = if self.window == 0 {
                0
            } else {
                (p + 1).saturating_sub(self.window as usize)
            };
            let mut a = vec![0f64; c.nq()];
            for h in 0..c.n_head as usize {
                let (qh, g) = (&qs[i][h * hd..(h + 1) * hd], h / group * hd);
                let scores: Vec<f64> = (first..=p)
                    .map(|j| {
                        qh.iter()
                            .zip(&self.keys[j % self.slots][g..g + hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let top = scores.iter().fold(f64::MIN, |m, &s| m.max(s));
                let e: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                let total: f64 = e.iter().sum();
                for (j, w) in (first..=p).zip(&e) {
                    for (d, out) in a[h * hd..(h + 1) * hd].iter_mut().enumerate() {
                        *out += w / total * self.values[j % self.slots][g + d];
                    }
                }
            }
            let o = add(product(&self.wo.d, &a), &self.o_bias);
            add_to(
                row,
                &self
                    .post_attn_norm
                    .as_ref()
                    .map_or(o.clone(), |n| norm(&o, &n.v, eps)),
            );
            let h = norm(row, &self.ffn_norm.v, eps);
            let (gv, uv) = (product(&self.gate.d, &h), product(&self.up.d, &h));
            let act: Vec<f64> = gv.iter().zip(&uv).map(|(&g, &u)| if c.gemma { gelu(g) } else { g / (1.0 + (-g).exp()) } * u).collect();
            let f = product(&self.down.d, &act);
            add_to(
                row,
                &self
                    .post_ffn_norm
                    .as_ref()
                    .map_or(f.clone(), |n| norm(&f, &n.v, eps)),
            );
        }
        (ks, vs)
    }
}

fn gelu(g: f64) -> f64 {
    0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
}

fn norm(v: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let k = 1.0 / (v.iter().map(|a| a * a).sum::<f64>() / v.len() as f64 + eps).sqrt();
    v.iter().zip(w).map(|(a, w)| a * k * w).collect()
}

fn product(w: &Decoded, x: &[f64]) -> Vec<f64> {
    w.w.chunks_exact(w.n_in)
        .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn add(mut v: Vec<f64>, bias: &Option<Vector>) -> Vec<f64> {
    if let Some(b) = bias {
        add_to(&mut v, &b.v);
    }
    v
}

fn add_to(v: &mut [f64], w: &[f64]) {
    v.iter_mut().zip(w).for_each(|(a, b)| *a += b);
}

/// Turns a head by one row of a table (cosines, then sines), the halves or adjacent pairs.
fn rotate(head: &mut [f64], row: &[f32], pairs: bool) {
    let half = head.len() / 2;
    for j in 0..half {
        let (a, b) = if pairs {
            (2 * j, 2 * j + 1)
        } else {
            (j, j + half)
        };
        let (c, s) = (row[j] as f64, row[half + j] as f64);
        let (x, y) = (head[a], head[b]);
        (head[a], head[b]) = (x * c - y * s, x * s + y * c);
    }
}

/// A rotation table of `t` rows from position `pos`, base `base`, as a guest computes one.
fn table(t: usize, pos: usize, hd: usize, base: f64) -> Vec<f32> {
    let half = hd / 2;
    let mut out = Vec::with_capacity(t * hd);
    for i in 0..t {
        let angles: Vec<f64> = (0..half)
            .map(|j| (pos + i) as f64 * base.powf(-2.0 * j as f64 / hd as f64))
            .collect();
        out.extend(angles.iter().map(|a| a.cos() as f32));
        out.extend(angles.iter().map(|a| a.sin() as f32));
    }
    out
}

/// Compares a host's rows with the kit's, each value within TOLERANCE of its row's root mean
/// square; returns the largest such error.
fn compare(what: &str, got: &[f32], want: &[Vec<f64>]) -> Result<f64, String> {
    let n = want.first().map_or(0, Vec::len);
    if got.len() != want.len() * n {
        return Err(format!(
            "{what}: {} values where the kit has {} rows of {n}",
            got.len(),
            want.len()
        ));
    }
    let mut worst = 0f64;
    for (r, (g, w)) in got.chunks_exact(n.max(1)).zip(want).enumerate() {
        let rms = (w.iter().map(|a| a * a).sum::<f64>() / n as f64)
            .sqrt()
            .max(1e-30);
        for (j, (&g, &w)) in g.iter().zip(w).enumerate() {
            let err = (g as f64 - w).abs() / rms;
            if !(err <= TOLERANCE) {
                return Err(format!(
                    "{what}: row {r}, value {j} is {g} where the kit has {w:.7} (error {err:.2e} of the row's rms)"
                ));
            }
            worst = worst.max(err);
        }
    }
    Ok(worst)
}

/// One `blocks` call and the kit's own, compared: the residual rows and every block's keys and
/// values (with `kv`; without, there must be none).
fn step(
    ctx: &mut Ctx,
    c: &Config,
    blocks: &mut [RefBlock],
    (t, pos, kv): (usize, usize, bool),
    bases: &[f64],
) -> Check<String> {
    let e = c.n_embd as usize;
    let x = ctx.rng.vector(t * e);
    let tables: Vec<Vec<f32>> = bases
        .iter()
        .map(|&b| table(t, pos, c.head_dim as usize, b))
        .collect();
    let kind = if c.gemma { "gemma-like" } else { "qwen-like" };
    let what = format!("blocks ({kind}) t {t} at {pos}, return-kv {kv}");
    let call: Vec<Block> = blocks.iter().map(RefBlock::wit).collect();
    let out: BlocksOutput =
        match gpu::blocks(&x, t as u32, pos as u32, &call, c.shape(), &tables, kv) {
            Ok(o) => o,
            Err(Error::Unavailable(m)) => {
                return skip(format!("the host does not offer blocks (allowed): {m}"));
            }
            Err(err) => return fail(format!("{what} failed: {}", describe(&err))),
        };
    let mut rows: Vec<Vec<f64>> = x
        .chunks_exact(e)
        .map(|r| r.iter().map(|&v| v as f64).collect())
        .collect();
    let nkv = c.nkv();
    let mut worst = 0f64;
    if !kv && !(out.keys.is_empty() && out.values.is_empty()) {
        let (k, v) = (out.keys.len(), out.values.len());
        return fail(format!(
            "{what}: {k} keys and {v} values came back, none asked for"
        ));
    }
    for (l, b) in blocks.iter_mut().enumerate() {
        let (ks, vs) = b.run(c, &mut rows, pos, &tables);
        if !kv {
            continue;
        }
        let at = l * t * nkv..(l + 1) * t * nkv;
        let (Some(k), Some(v)) = (out.keys.get(at.clone()), out.values.get(at)) else {
            return fail(format!(
                "{what}: {} keys and {} values for {} blocks of {t} rows of {nkv}",
                out.keys.len(),
                out.values.len(),
                blocks.len()
            ));
        };
        worst = worst.max(compare(&format!("{what}: block {l}'s keys"), k, &ks).or_else(fail)?);
        worst = worst.max(compare(&format!("{what}: block {l}'s values"), v, &vs).or_else(fail)?);
    }
    worst = worst.max(compare(&format!("{what}: x"), &out.x, &rows).or_else(fail)?);
    ctx.max_error = ctx.max_error.max(worst);
    Ok(what)
}

/// Gemma-like blocks (one sliding over a ring that wraps, one global) and a Qwen-like one, each
/// over a batch and then single tokens and a batch that continue it.
pub fn matches(ctx: &mut Ctx) -> Check<String> {
    let mut done = Vec::new();
    let gemma = Config {
        n_embd: 64,
        n_ff: 96,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        eps: 1e-6,
        gemma: true,
    };
    let mut blocks = vec![
        RefBlock::random(&mut ctx.rng, &gemma, 0, 4, 0, 7)?,
        RefBlock::random(&mut ctx.rng, &gemma, 3, 0, 1, 16)?,
    ];
    for call in [(5, 0, true), (1, 5, false), (3, 6, true), (1, 9, true)] {
        done.push(step(ctx, &gemma, &mut blocks, call, &[1e4, 1e6])?);
    }
    let qwen = Config {
        n_embd: 64,
        n_ff: 64,
        n_head: 4,
        n_head_kv: 1,
        head_dim: 16,
        eps: 1e-5,
        gemma: false,
    };
    let mut blocks = vec![RefBlock::random(&mut ctx.rng, &qwen, 2, 0, 0, 8)?];
    for call in [(4, 0, false), (1, 4, true), (2, 5, true)] {
        done.push(step(ctx, &qwen, &mut blocks, call, &[1e4])?);
    }
    Ok(done.join("; "))
}

/// `w` changed by `f`.
fn with<'a>(mut w: Block<'a>, f: impl FnOnce(&mut Block<'a>)) -> Block<'a> {
    f(&mut w);
    w
}

/// Calls that break the contract: `invalid-argument`, and the blocks still run afterwards.
pub fn hostile(ctx: &mut Ctx) -> Check<String> {
    let c = Config {
        n_embd: 32,
        n_ff: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 8,
        eps: 1e-6,
        gemma: true,
    };
    let b = RefBlock::random(&mut ctx.rng, &c, 0, 0, 0, 4)?;
    let other = RefBlock::random(&mut ctx.rng, &c, 1, 0, 0, 4)?;
    let x = ctx.rng.vector(2 * 32);
    let tables = vec![table(2, 0, 8, 1e4)];
    match gpu::blocks(&x, 2, 0, &[b.wit()], c.shape(), &tables, true) {
        Ok(_) => {}
        Err(Error::Unavailable(m)) => {
            return skip(format!("the host does not offer blocks (allowed): {m}"));
        }
        Err(e) => return fail(format!("a valid blocks call failed: {}", describe(&e))),
    }
    let inv = &[Kind::InvalidArgument];
    let q8 = upload(&Weight::random(Format::Q8x32, 1, 32, &mut ctx.rng))?;
    let short = upload(&Weight::random(Format::F32, 1, 31, &mut ctx.rng))?;
    let short_table = [tables[0][..15].to_vec()];
    let cases: Vec<(
        &str,
        Vec<Block<'_>>,
        &[f32],
        u32,
        u32,
        BlocksShape,
        &[Vec<f32>],
    )> = vec![
        ("no blocks", vec![], &x, 2, 0, c.shape(), &tables),
        ("t = 0", vec![b.wit()], &[], 0, 0, c.shape(), &tables),
        (
            "an x shorter than t * n-embd",
            vec![b.wit()],
            &x[..63],
            2,
            0,
            c.shape(),
            &tables,
        ),
        (
            "a q8x32 vector",
            vec![with(b.wit(), |w| w.attn_norm = &q8)],
            &x,
            2,
            0,
            c.shape(),
            &tables,
        ),
        (
            "a norm of the wrong width",
            vec![with(b.wit(), |w| w.ffn_norm = &short)],
            &x,
            2,
            0,
            c.shape(),
            &tables,
        ),
        (
            "a vector as wq",
            vec![with(b.wit(), |w| w.wq = &b.attn_norm.handle)],
            &x,
            2,
            0,
            c.shape(),
            &tables,
        ),
        (
            "gate and up swapped with down",
            vec![with(b.wit(), |w| {
                (w.gate, w.down) = (&b.down.handle, &b.gate.handle)
            })],
            &x,
            2,
            0,
            c.shape(),
            &tables,
        ),
        (
            "a table index past the tables",
            vec![with(b.wit(), |w| w.rope = 1)],
            &x,
            2,
            0,
            c.shape(),
            &tables,
        ),
        (
            "a short table",
            vec![b.wit()],
            &x,
            2,
            0,
            c.shape(),
            &short_table,
        ),
        (
            "an odd head",
            vec![b.wit()],
            &x,
            2,
            0,
            BlocksShape {
                head_dim: 7,
                ..c.shape()
            },
            &tables,
        ),
        (
            "heads that do not group",
            vec![b.wit()],
            &x,
            2,
            0,
            BlocksShape {
                n_head_kv: 3,
                ..c.shape()
            },
            &tables,
        ),
        (
            "more keys than the cache's slots",
            vec![b.wit()],
            &x,
            2,
            3,
            c.shape(),
            &tables,
        ),
        (
            "a second block whose wo is [nkv, n-embd]",
            vec![b.wit(), with(other.wit(), |w| w.wo = &other.wk.handle)],
            &x,
            2,
            0,
            c.shape(),
            &tables,
        ),
    ];
    let n = cases.len();
    for (what, blocks, x, t, pos, shape, tables) in cases {
        refused(&format!("blocks with {what}"), inv, || {
            gpu::blocks(x, t, pos, &blocks, shape, tables, true)
        })?;
    }
    gpu::blocks(&x, 2, 2, &[b.wit()], c.shape(), &tables, false).or_else(|e| {
        fail(format!(
            "a valid blocks call after the refusals failed: {}",
            describe(&e)
        ))
    })?;
    Ok(format!(
        "{n} hostile blocks calls refused with invalid-argument"
    ))
}
