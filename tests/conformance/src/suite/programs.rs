//! Programs (from `wisp:llm@0.4.0`): every op against the kit's own float64 reading of it on
//! fresh random shapes, in both precisions; attention over caches written across runs; programs
//! of several ops over batches of sequences of different lengths and positions, each sequence's
//! rows equal to its run alone; and the hostile programs and batches a guest can send, each
//! refused with `invalid-argument` (or `out-of-memory`) and nothing changed.
//!
//! Values are compared with the reference row by row, relative to the root mean square of the
//! reference row: `|y - y_ref| <= bound * max(rms(row_ref), 1e-3)`, the bound 2^-13 for
//! `exact` and 2^-4 for `fast` (a chain of a few ops, each within its own bound; int8 inputs,
//! which `fast` allows, move a product of one block of 32 by up to ~2^-5 of its row's rms).

use super::{Check, Ctx, Kind, describe, fail, refused, skip, upload};
use crate::bindings::wisp::llm::gpu::{
    self, Activation, Error, AttentionOp, BiasOp, CacheWriteOp, GatedOp, KvCache, MatmulOp, NormOp, Op, Output, Precision,
    Program, RotateOp, Rotation, ScaleOp, Sequence, SoftcapOp, TopKOp, Weight as Handle,
};
use crate::reference::{Act, Decoded, Format, Weight};
use crate::rng::Rng;
use std::collections::HashMap;

const EXACT: f64 = 1.0 / 8192.0;
const FAST: f64 = 1.0 / 16.0;

/// One sequence of a run as the reference sees it: its rows and first position.
#[derive(Clone, Copy, Debug)]
struct Seq {
    rows: u32,
    start: u32,
}

/// The kit's reference caches: for each sequence, for each cache index, the rows written by
/// position (an unwritten row reads as zero).
type RefCaches = Vec<Vec<HashMap<u32, (Vec<f64>, Vec<f64>)>>>;

/// What a reference run makes: each `output` as rows of f64, each `top-k` as the reference
/// values of the whole row (to check the host's choice against).
enum RefOut {
    Rows(Vec<f64>, usize),
    Top(Vec<f64>, usize, u32),
}

fn act(a: Activation) -> Act {
    match a {
        Activation::GeluTanh => Act::GeluTanh,
        Activation::Silu => Act::Silu,
    }
}

/// The reference run of `ops` over `weights` (decoded), `inputs` and `batch`, with `caches`.
fn reference(ops: &[Op], weights: &[Decoded], inputs: &[Vec<f32>], batch: &[Seq], caches: &mut RefCaches) -> Vec<RefOut> {
    let total: usize = batch.iter().map(|s| s.rows as usize).sum();
    let mut vals: Vec<(Vec<f64>, usize, bool)> = Vec::new(); // values, width, sequence rows
    let mut outs = Vec::new();
    let mut next_input = 0;
    for op in ops {
        let v = |i: u32| &vals[i as usize];
        let made: (Vec<f64>, usize, bool) = match *op {
            Op::Input(w) => {
                next_input += 1;
                (inputs[next_input - 1].iter().map(|&a| a as f64).collect(), w as usize, false)
            }
            Op::Matmul(MatmulOp { x, weight, .. }) => {
                let (xv, n_in, seq) = v(x);
                let w = &weights[weight as usize];
                let rows = xv.len() / n_in;
                let mut y = vec![0.0; rows * w.n_out];
                for r in 0..rows {
                    for o in 0..w.n_out {
                        y[r * w.n_out + o] = (0..*n_in).map(|k| xv[r * n_in + k] * w.w[o * w.n_in + k]).sum();
                    }
                }
                (y, w.n_out, *seq)
            }
            Op::RmsNorm(NormOp { x, weight, offset, group, eps }) => {
                let (xv, width, seq) = v(x);
                let g = group as usize;
                let mut y = xv.clone();
                for (gi, run) in y.chunks_exact_mut(g).enumerate() {
                    let _ = gi;
                    let ms = run.iter().map(|a| a * a).sum::<f64>() / g as f64;
                    let k = 1.0 / (ms + eps as f64).sqrt();
                    for (j, a) in run.iter_mut().enumerate() {
                        let m = weight.map_or(1.0, |w| weights[w as usize].w[j] + offset as f64);
                        *a *= k * m;
                    }
                }
                (y, *width, *seq)
            }
            Op::Add((a, b)) => (v(a).0.iter().zip(&v(b).0).map(|(a, b)| a + b).collect(), v(a).1, v(a).2),
            Op::Mul((a, b)) => (v(a).0.iter().zip(&v(b).0).map(|(a, b)| a * b).collect(), v(a).1, v(a).2),
            Op::Bias(BiasOp { x, weight }) => {
                let (xv, width, seq) = v(x);
                let b = &weights[weight as usize].w;
                (xv.iter().enumerate().map(|(i, a)| a + b[i % width]).collect(), *width, *seq)
            }
            Op::Scale(ScaleOp { x, by }) => (v(x).0.iter().map(|a| a * by as f64).collect(), v(x).1, v(x).2),
            Op::Softcap(SoftcapOp { x, cap }) => (v(x).0.iter().map(|a| cap as f64 * (a / cap as f64).tanh()).collect(), v(x).1, v(x).2),
            Op::Gated(GatedOp { gate, up, act: a }) => {
                let y = v(gate).0.iter().zip(&v(up).0).map(|(g, u)| act(a).apply(*g) * u).collect();
                (y, v(gate).1, v(gate).2)
            }
            Op::Rotate(RotateOp { x, table, head_dim, rotation }) => {
                let (xv, width, seq) = v(x);
                let (tv, tw, _) = v(table);
                let (hd, half) = (head_dim as usize, tw / 2);
                let mut y = xv.clone();
                for r in 0..xv.len() / width {
                    let cs = &tv[r * tw..(r + 1) * tw];
                    for h in 0..width / hd {
                        let head = &mut y[r * width + h * hd..r * width + (h + 1) * hd];
                        for j in 0..half {
                            let (a, b) = match rotation {
                                Rotation::Halves => (j, j + half),
                                Rotation::Pairs => (2 * j, 2 * j + 1),
                            };
                            let (c, s, p, q) = (cs[j], cs[half + j], head[a], head[b]);
                            head[a] = p * c - q * s;
                            head[b] = p * s + q * c;
                        }
                    }
                }
                (y, *width, *seq)
            }
            Op::CacheWrite(CacheWriteOp { k, v: vv, cache }) => {
                let (kv, width, _) = v(k);
                let vvals = &v(vv).0;
                let mut at = 0;
                for (s, q) in batch.iter().enumerate() {
                    for r in 0..q.rows {
                        let row = (at + r as usize) * width;
                        let entry = (kv[row..row + width].to_vec(), vvals[row..row + width].to_vec());
                        caches[s][cache as usize].insert(q.start + r, entry);
                    }
                    at += q.rows as usize;
                }
                (Vec::new(), 0, false)
            }
            Op::Attention(AttentionOp { q, cache, n_head, n_head_kv, head_dim, window, scale, softcap, .. }) => {
                let (qv, width, _) = v(q);
                let (hd, group) = (head_dim as usize, (n_head / n_head_kv) as usize);
                let mut y = vec![0.0; qv.len()];
                let mut at = 0;
                for (s, sq) in batch.iter().enumerate() {
                    let ring = &caches[s][cache as usize];
                    for r in 0..sq.rows as usize {
                        let p = sq.start + r as u32;
                        let first = if window == 0 { 0 } else { (p + 1).saturating_sub(window) };
                        let zero = (vec![0.0; n_head_kv as usize * hd], vec![0.0; n_head_kv as usize * hd]);
                        let keys: Vec<&(Vec<f64>, Vec<f64>)> = (first..=p).map(|j| ring.get(&j).unwrap_or(&zero)).collect();
                        let keys: Vec<(Vec<f64>, Vec<f64>)> = keys.into_iter().cloned().collect();
                        for h in 0..n_head as usize {
                            let qh = &qv[(at + r) * width + h * hd..][..hd];
                            let g = h / group * hd;
                            let capped = |s: f64| if softcap > 0.0 { softcap as f64 * (s / softcap as f64).tanh() } else { s };
                            let scores: Vec<f64> = keys.iter().map(|(k, _)| capped(scale as f64 * (0..hd).map(|d| qh[d] * k[g + d]).sum::<f64>())).collect();
                            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                            let sum: f64 = e.iter().sum();
                            for d in 0..hd {
                                y[(at + r) * width + h * hd + d] = keys.iter().zip(&e).map(|((_, v), w)| w * v[g + d]).sum::<f64>() / sum;
                            }
                        }
                    }
                    at += sq.rows as usize;
                }
                (y, *width, false)
            }
            Op::LastRows(x) => {
                let (xv, width, _) = v(x);
                let mut y = Vec::new();
                let mut end = 0;
                for q in batch {
                    end += q.rows as usize;
                    y.extend_from_slice(&xv[(end - 1) * width..end * width]);
                }
                (y, *width, true)
            }
            Op::Output(x) => {
                outs.push(RefOut::Rows(v(x).0.clone(), v(x).1));
                (Vec::new(), 0, false)
            }
            Op::TopK(TopKOp { x, k }) => {
                outs.push(RefOut::Top(v(x).0.clone(), v(x).1, k));
                (Vec::new(), 0, false)
            }
        };
        vals.push(made);
    }
    let _ = total;
    outs
}

/// Holds a run's outputs to the reference's: rows within `bound` of each reference row's root
/// mean square; a top's indices distinct, each within the row, its values those of the row it
/// names (within the bound), largest first, none below the reference's `k`-th by more than the
/// bound. Returns the largest error seen.
fn compare(what: &str, got: &[Output], want: &[RefOut], bound: f64) -> Check<f64> {
    if got.len() != want.len() {
        return fail(format!("{what}: the run returned {} outputs; the program has {}", got.len(), want.len()));
    }
    let mut worst = 0f64;
    for (o, (g, w)) in got.iter().zip(want).enumerate() {
        match (g, w) {
            (Output::Rows(y), RefOut::Rows(r, width)) => {
                if y.len() != r.len() {
                    return fail(format!("{what}: output {o} has {} values; the reference {}", y.len(), r.len()));
                }
                for (row, (yr, rr)) in y.chunks(*width).zip(r.chunks(*width)).enumerate() {
                    let rms = (rr.iter().map(|a| a * a).sum::<f64>() / *width as f64).sqrt().max(1e-3);
                    for (c, (&a, &b)) in yr.iter().zip(rr).enumerate() {
                        let e = (a as f64 - b).abs() / rms;
                        if !(e <= bound) {
                            return fail(format!(
                                "{what}: output {o}, row {row}, column {c} is {a} where the reference is {b} \
                                 (error {e:.3e} of the row's rms {rms:.3e}; tolerance {bound:.3e})"
                            ));
                        }
                        worst = worst.max(e);
                    }
                }
            }
            (Output::Top(t), RefOut::Top(r, width, k)) => {
                let (k, width) = (*k as usize, *width);
                let rows = r.len() / width;
                if t.values.len() != rows * k || t.indices.len() != rows * k {
                    return fail(format!("{what}: top {o} has {} values and {} indices; {rows} rows of k {k} need {}", t.values.len(), t.indices.len(), rows * k));
                }
                for row in 0..rows {
                    let rr = &r[row * width..(row + 1) * width];
                    let rms = (rr.iter().map(|a| a * a).sum::<f64>() / width as f64).sqrt().max(1e-3);
                    let mut sorted: Vec<f64> = rr.to_vec();
                    sorted.sort_by(|a, b| b.total_cmp(a));
                    let kth = sorted[k - 1];
                    let (vals, ids) = (&t.values[row * k..(row + 1) * k], &t.indices[row * k..(row + 1) * k]);
                    let mut seen = std::collections::HashSet::new();
                    for (j, (&v, &i)) in vals.iter().zip(ids).enumerate() {
                        if i as usize >= width || !seen.insert(i) {
                            return fail(format!("{what}: top {o}, row {row} names column {i} twice or past the row's {width}"));
                        }
                        let e = (v as f64 - rr[i as usize]).abs() / rms;
                        if !(e <= bound) || rr[i as usize] < kth - bound * rms {
                            return fail(format!(
                                "{what}: top {o}, row {row}, place {j}: column {i} with {v}; the reference there is {} \
                                 and its {k}-th largest {kth}",
                                rr[i as usize]
                            ));
                        }
                        if j > 0 && v > vals[j - 1] {
                            return fail(format!("{what}: top {o}, row {row}: {v} after {}, not largest first", vals[j - 1]));
                        }
                        worst = worst.max(e);
                    }
                }
            }
            _ => return fail(format!("{what}: output {o} is of the wrong kind (rows for a top-k, or the reverse)")),
        }
    }
    Ok(worst)
}

/// A run that must succeed.
fn run(what: &str, p: &Program, inputs: &[Vec<f32>], batch: &[Sequence<'_>]) -> Check<Vec<Output>> {
    p.run(inputs, batch).or_else(|e| fail(format!("{what}: run failed: {}", describe(&e))))
}

/// A program that must be made. (Programs are the interface's only way to compute since 0.6:
/// a host with a device that answers `unavailable` fails.)
fn create(what: &str, weights: &[&Handle], caches: u32, ops: &[Op]) -> Check<Program> {
    gpu::create_program(weights, caches, ops).or_else(|e| fail(format!("{what}: create-program failed: {}", describe(&e))))
}

/// A `kv-cache` that must be made; a host without kv-caches (`unavailable`, allowed) skips the
/// case.
fn cache(slots: u32, width: u32) -> Check<KvCache> {
    gpu::create_kv_cache(slots, width).or_else(|e| match e {
        Error::Unavailable(m) => skip(format!("the host does not offer kv-caches: {m}")),
        e => fail(format!("create-kv-cache of {slots} slots of {width} failed: {}", describe(&e))),
    })
}

/// Random sequences: 1 to `n` of them, each of 1 to `max_rows` rows from a random start.
fn random_batch(rng: &mut Rng, n: u32, max_rows: u32) -> Vec<Seq> {
    (0..rng.range(1, n)).map(|_| Seq { rows: rng.range(1, max_rows), start: rng.range(0, 40) }).collect()
}

fn seqs<'a>(batch: &[Seq], caches: &'a [Vec<KvCache>]) -> Vec<Sequence<'a>> {
    batch.iter().zip(caches).map(|(s, c)| Sequence { rows: s.rows, start: s.start, caches: c.iter().collect() }).collect()
}

fn rows(batch: &[Seq]) -> usize {
    batch.iter().map(|s| s.rows as usize).sum()
}

/// An f32 vector weight `[1, n]`.
fn vector(rng: &mut Rng, n: u32) -> Weight {
    Weight::random(Format::F32, 1, n, rng)
}

/// Runs one program of no caches on a random batch and holds it to the reference.
fn check_program(ctx: &mut Ctx, what: &str, weights: &[Weight], ops: &[Op], widths: &[u32], bound: f64) -> Check {
    let batch = random_batch(&mut ctx.rng, 3, 5);
    check_program_over(ctx, what, weights, ops, widths, bound, batch)
}

/// [`check_program`] over the given batch.
fn check_program_over(ctx: &mut Ctx, what: &str, weights: &[Weight], ops: &[Op], widths: &[u32], bound: f64, batch: Vec<Seq>) -> Check {
    let handles: Vec<Handle> = weights.iter().map(upload).collect::<Check<_>>()?;
    let decoded: Vec<Decoded> = weights.iter().map(|w| w.decode()).collect();
    let p = create(what, &handles.iter().collect::<Vec<_>>(), 0, ops)?;
    let inputs: Vec<Vec<f32>> = widths.iter().map(|&w| ctx.rng.vector(rows(&batch) * w as usize)).collect();
    let none: Vec<Vec<KvCache>> = batch.iter().map(|_| Vec::new()).collect();
    let got = run(what, &p, &inputs, &seqs(&batch, &none))?;
    let want = reference(ops, &decoded, &inputs, &batch, &mut vec![Vec::new(); batch.len()]);
    let e = compare(&format!("{what} over {batch:?}"), &got, &want, bound)?;
    ctx.max_error = ctx.max_error.max(e);
    Ok(())
}

fn mm(x: u32, weight: u32, precision: Precision) -> Op {
    Op::Matmul(MatmulOp { x, weight, precision })
}

/// Each op alone (with an `input` before it and an `output` after), on random shapes and both
/// precisions.
pub fn ops(ctx: &mut Ctx) -> Check<String> {
    let mut n = 0;
    for f in Format::ALL {
        for precision in [Precision::Exact, Precision::Fast] {
            let (n_out, n_in) = (ctx.rng.range(1, 70), f.block() * ctx.rng.range(1, 6));
            let w = Weight::random(f, n_out, n_in, &mut ctx.rng);
            let bound = if precision == Precision::Exact { EXACT } else { FAST };
            let ops = [Op::Input(n_in), mm(0, 0, precision), Op::Output(1)];
            check_program(ctx, &format!("matmul of {} [{n_out}, {n_in}], {precision:?}", f.name()), &[w], &ops, &[n_in], bound)?;
            n += 1;
        }
    }
    // Products of one input side by side (a host may run them as one), their values read by
    // ops of two operands, by a product of their gated pair (a host may fuse the two) and by
    // outputs, at one row and over a random batch.
    for precision in [Precision::Exact, Precision::Fast] {
        let f = Format::ALL[ctx.rng.range(0, Format::ALL.len() as u32 - 1) as usize];
        let (k, m, n_in, j) = (ctx.rng.range(1, 70), 32 * ctx.rng.range(1, 3), f.block() * ctx.rng.range(1, 4), ctx.rng.range(1, 40));
        let mut ws = [k, m, m].map(|n_out| Weight::random(f, n_out, n_in, &mut ctx.rng)).to_vec();
        ws.push(Weight::random(Format::Q8x32, j, m, &mut ctx.rng));
        let act = if precision == Precision::Exact { Activation::Silu } else { Activation::GeluTanh };
        let bound = if precision == Precision::Exact { EXACT } else { FAST };
        // Three products, their values read by outputs and a gated op (up before gate).
        let three = [
            Op::Input(n_in),
            mm(0, 0, precision),
            mm(0, 1, precision),
            mm(0, 2, precision),
            Op::Gated(GatedOp { gate: 3, up: 2, act }),
            Op::Output(4),
            Op::Output(1),
            Op::Output(3),
        ];
        // Gate and up read by their gated op alone, which the down product alone reads.
        let ffn = [
            Op::Input(n_in),
            mm(0, 1, precision),
            mm(0, 2, precision),
            Op::Gated(GatedOp { gate: 1, up: 2, act }),
            mm(3, 3, precision),
            Op::Output(4),
        ];
        for (what, ops) in [(format!("three products of {} [{k}|{m}|{m}, {n_in}] of one input", f.name()), &three[..]), (format!("a feed-forward block of {} [{m}, {n_in}] and q8x32 [{j}, {m}]", f.name()), &ffn[..])] {
            let what = format!("{what}, {precision:?}");
            check_program_over(ctx, &what, &ws, ops, &[n_in], bound, vec![Seq { rows: 1, start: 0 }])?;
            check_program(ctx, &what, &ws, ops, &[n_in], bound)?;
            n += 2;
        }
    }
    for _ in 0..3 {
        let heads = ctx.rng.range(1, 4);
        let hd = 2 * ctx.rng.range(1, 40);
        let width = heads * hd;
        let r = &mut ctx.rng;
        let (g, wg, wr) = (vector(r, hd), vector(r, width), vector(r, width));
        let eps = [1e-6f32, 1e-5, 0.5][r.range(0, 2) as usize];
        let cases: Vec<(String, Vec<Weight>, Vec<Op>, Vec<u32>)> = vec![
            ("rms-norm of rows with a weight".into(), vec![wr.clone()], vec![Op::Input(width), Op::RmsNorm(NormOp { x: 0, weight: Some(0), offset: 0.0, group: width, eps }), Op::Output(1)], vec![width]),
            ("rms-norm of heads with a weight + 1".into(), vec![g.clone()], vec![Op::Input(width), Op::RmsNorm(NormOp { x: 0, weight: Some(0), offset: 1.0, group: hd, eps }), Op::Output(1)], vec![width]),
            ("rms-norm without a weight".into(), vec![], vec![Op::Input(width), Op::RmsNorm(NormOp { x: 0, weight: None, offset: 0.0, group: hd, eps }), Op::Output(1)], vec![width]),
            ("add".into(), vec![], vec![Op::Input(width), Op::Input(width), Op::Add((0, 1)), Op::Output(2)], vec![width, width]),
            ("mul".into(), vec![], vec![Op::Input(width), Op::Input(width), Op::Mul((0, 1)), Op::Output(2)], vec![width, width]),
            ("bias".into(), vec![wg.clone()], vec![Op::Input(width), Op::Bias(BiasOp { x: 0, weight: 0 }), Op::Output(1)], vec![width]),
            ("scale".into(), vec![], vec![Op::Input(width), Op::Scale(ScaleOp { x: 0, by: r.uniform(-30.0, 30.0) }), Op::Output(1)], vec![width]),
            ("softcap".into(), vec![], vec![Op::Input(width), Op::Softcap(SoftcapOp { x: 0, cap: r.uniform(0.25, 2.0) }), Op::Output(1)], vec![width]),
            ("gated gelu-tanh".into(), vec![], vec![Op::Input(width), Op::Input(width), Op::Gated(GatedOp { gate: 0, up: 1, act: Activation::GeluTanh }), Op::Output(2)], vec![width, width]),
            ("gated silu".into(), vec![], vec![Op::Input(width), Op::Input(width), Op::Gated(GatedOp { gate: 0, up: 1, act: Activation::Silu }), Op::Output(2)], vec![width, width]),
            ("last-rows".into(), vec![], vec![Op::Input(width), Op::LastRows(0), Op::Output(1)], vec![width]),
        ];
        for (what, weights, ops, widths) in cases {
            check_program(ctx, &format!("{what}, rows of {width}"), &weights, &ops, &widths, EXACT)?;
            n += 1;
        }
        for rotation in [Rotation::Halves, Rotation::Pairs] {
            let rot = 2 * ctx.rng.range(1, hd / 2);
            let ops = [Op::Input(width), Op::Input(rot), Op::Rotate(RotateOp { x: 0, table: 1, head_dim: hd, rotation }), Op::Output(2)];
            check_program(ctx, &format!("rotate {rotation:?} of {heads} heads of {hd}, {rot} turned"), &[], &ops, &[width, rot], EXACT)?;
            n += 1;
            // A head normed, then turned by its own values (a host fusing a norm with the
            // rotation after it must not fuse this one).
            let own = [Op::Input(hd), Op::RmsNorm(NormOp { x: 0, weight: None, offset: 0.0, group: hd, eps }), Op::Rotate(RotateOp { x: 1, table: 1, head_dim: hd, rotation }), Op::Output(2)];
            check_program(ctx, &format!("a head of {hd} normed, then turned {rotation:?} by its own values"), &[], &own, &[hd], EXACT)?;
            n += 1;
        }
    }
    Ok(format!("{n} programs of one op each: products of every format in both precisions, products of one input side by side, norms, sums, gates, rotations, last rows"))
}

/// `top-k` of inputs with ties, both zeros, infinities and NaN: exactly the documented order,
/// for rows narrow and wide (a vocabulary's: hosts may take the top in pieces), k of 1 (a greedy
/// choice), small and large, and a row of NaN alone.
pub fn top_k(ctx: &mut Ctx) -> Check<String> {
    let mut cases = Vec::new();
    for (widths, ks) in [((8, 300), (1, 1)), ((1000, 9000), (1, 1)), ((8, 300), (1, 50)), ((1000, 9000), (1, 64)), ((2048, 5000), (200, 1024))] {
        let width = ctx.rng.range(widths.0, widths.1);
        let k = ctx.rng.range(ks.0, ks.1.min(width));
        top_k_case(ctx, width, k)?;
        cases.push(format!("{k} of {width}"));
    }
    Ok(format!("top {} of rows with ties, zeros of both signs, infinities and NaN, in the documented order", cases.join(", ")))
}

fn top_k_case(ctx: &mut Ctx, width: u32, k: u32) -> Check<()> {
    let p = create("top-k", &[], 0, &[Op::Input(width), Op::TopK(TopKOp { x: 0, k })])?;
    let rows = 4;
    let batch = [Seq { rows, start: 0 }];
    // Values from a few levels, so that ties are common, and in each row NaN, both zeros and
    // both infinities; the last row NaN alone.
    let mut x: Vec<f32> = (0..rows * width).map(|_| ctx.rng.range(0, 9) as f32 - 4.0).collect();
    for r in 0..rows - 1 {
        for v in [f32::NAN, f32::NAN, -0.0, 0.0, f32::INFINITY, f32::NEG_INFINITY] {
            x[(r * width + ctx.rng.range(0, width - 1)) as usize] = v;
        }
    }
    x[((rows - 1) * width) as usize..].fill(f32::NAN);
    let got = run("top-k", &p, &[x.clone()], &seqs(&batch, &[Vec::new()]))?;
    let Some(Output::Top(t)) = got.first() else { return fail("top-k returned no top") };
    if t.indices.len() != (rows * k) as usize || t.values.len() != t.indices.len() {
        return fail(format!("top-k {k} of {rows} rows: {} indices and {} values", t.indices.len(), t.values.len()));
    }
    for r in 0..rows as usize {
        let row = &x[r * width as usize..(r + 1) * width as usize];
        let mut order: Vec<u32> = (0..width).filter(|&i| !row[i as usize].is_nan()).collect();
        order.sort_by(|a, b| row[*b as usize].partial_cmp(&row[*a as usize]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(b)));
        order.extend((0..width).filter(|&i| row[i as usize].is_nan()));
        let want = &order[..k as usize];
        let ids = &t.indices[r * k as usize..(r + 1) * k as usize];
        if ids != want {
            let first = ids.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            return fail(format!("top-k {k} of row {r} of {width}: index {first} is {}; the documented order gives {}", ids[first], want[first]));
        }
        let values = &t.values[r * k as usize..(r + 1) * k as usize];
        if let Some(j) = (0..k as usize).find(|&j| values[j].to_bits() != row[want[j] as usize].to_bits() && !(values[j].is_nan() && row[want[j] as usize].is_nan())) {
            return fail(format!("top-k {k} of row {r} of {width}: value {j} is {}, column {}'s is {}", values[j], want[j], row[want[j] as usize]));
        }
    }
    Ok(())
}

/// `cache-write` and `attention` over two runs (a prompt chunk, then single rows), grouped
/// heads and windows, both precisions.
pub fn attention(ctx: &mut Ctx) -> Check<String> {
    let mut n = 0;
    for precision in [Precision::Exact, Precision::Fast] {
        for _ in 0..2 {
            let r = &mut ctx.rng;
            let n_head_kv = r.range(1, 3);
            let n_head = n_head_kv * r.range(1, 3);
            let hd = r.range(1, 80);
            let window = if r.range(0, 1) == 0 { 0 } else { r.range(1, 20) };
            let scale = 1.0 / (hd as f32).sqrt();
            // Half the time capped (Gemma 2's attention soft-capping), tight enough to bite.
            let softcap = if r.range(0, 1) == 0 { 0.0 } else { r.uniform(0.1, 1.0) };
            let (nq, nkv) = (n_head * hd, n_head_kv * hd);
            let ops = [
                Op::Input(nq),
                Op::Input(nkv),
                Op::Input(nkv),
                Op::CacheWrite(CacheWriteOp { k: 1, v: 2, cache: 0 }),
                Op::Attention(AttentionOp { q: 0, cache: 0, n_head, n_head_kv, head_dim: hd, window, scale, softcap, precision }),
                Op::Output(4),
            ];
            let p = create("attention", &[], 1, &ops)?;
            let bound = if precision == Precision::Exact { EXACT } else { FAST };
            let mut batch = random_batch(r, 3, 12);
            let slots = 64;
            let caches: Vec<Vec<KvCache>> = batch.iter().map(|_| cache(slots, nkv).map(|c| vec![c])).collect::<Check<_>>()?;
            let mut refc: RefCaches = batch.iter().map(|_| vec![HashMap::new()]).collect();
            for step in 0..3 {
                let t = rows(&batch);
                let inputs = vec![r.vector(t * nq as usize), r.vector(t * nkv as usize), r.vector(t * nkv as usize)];
                let what = format!("attention {n_head}/{n_head_kv} heads of {hd}, window {window}, soft cap {softcap}, {precision:?}, step {step} over {batch:?}");
                let got = run(&what, &p, &inputs, &seqs(&batch, &caches))?;
                let want = reference(&ops, &[], &inputs, &batch, &mut refc);
                ctx.max_error = ctx.max_error.max(compare(&what, &got, &want, bound)?);
                for s in &mut batch {
                    s.start += s.rows;
                    s.rows = 1;
                }
                n += 1;
            }
        }
    }
    Ok(format!("{n} runs of cache writes and attention: a prompt chunk, then decode rows reading what earlier runs wrote"))
}

/// A two-block decoder as a program (norms with and without weights, biases, head norms,
/// rotation, cache writes, attention with a window, gated feed-forward, residual sums, the
/// last rows, a product to a vocabulary, its rows and their top 5), run over a batch of
/// sequences of different lengths and positions, then decode steps; each run held to the
/// reference, and each sequence's rows equal to a run of that sequence alone.
pub fn decoder(ctx: &mut Ctx) -> Check<String> {
    let r = &mut ctx.rng;
    let (n_head, n_head_kv, hd) = (4u32, 2u32, 16u32);
    let (e, nq, nkv, ff, vocab) = (64u32, n_head * hd, n_head_kv * hd, 96u32, 200u32);
    let mut weights = Vec::new();
    let mut w = |wt: Weight| {
        weights.push(wt);
        weights.len() as u32 - 1
    };
    let mut ops = vec![Op::Input(e), Op::Input(hd)]; // x, rotation table
    let mut x = 0u32;
    let push = |ops: &mut Vec<Op>, op: Op| {
        ops.push(op);
        ops.len() as u32 - 1
    };
    for layer in 0..2u32 {
        let (fmt_a, fmt_b) = if layer == 0 { (Format::Q4x32, Format::Q8x32) } else { (Format::Q8x16, Format::Bf16) };
        let an = w(vector(r, e));
        let (wq, wk, wv) = (w(Weight::random(fmt_a, nq, e, r)), w(Weight::random(fmt_a, nkv, e, r)), w(Weight::random(fmt_b, nkv, e, r)));
        let (qb, qn, kn) = (w(vector(r, nq)), w(vector(r, hd)), w(vector(r, hd)));
        let wo = w(Weight::random(fmt_b, e, nq, r));
        let fnorm = w(vector(r, e));
        let (gate, up, down) = (w(Weight::random(fmt_a, ff, e, r)), w(Weight::random(fmt_b, ff, e, r)), w(Weight::random(fmt_a, e, ff, r)));
        let h = push(&mut ops, Op::RmsNorm(NormOp { x, weight: Some(an), offset: 1.0, group: e, eps: 1e-6 }));
        let q = push(&mut ops, mm(h, wq, Precision::Exact));
        let q = push(&mut ops, Op::Bias(BiasOp { x: q, weight: qb }));
        let q = push(&mut ops, Op::RmsNorm(NormOp { x: q, weight: Some(qn), offset: 0.0, group: hd, eps: 1e-6 }));
        let q = push(&mut ops, Op::Rotate(RotateOp { x: q, table: 1, head_dim: hd, rotation: Rotation::Halves }));
        let k = push(&mut ops, mm(h, wk, Precision::Exact));
        let k = push(&mut ops, Op::RmsNorm(NormOp { x: k, weight: Some(kn), offset: 0.0, group: hd, eps: 1e-6 }));
        let k = push(&mut ops, Op::Rotate(RotateOp { x: k, table: 1, head_dim: hd, rotation: Rotation::Halves }));
        let v = push(&mut ops, mm(h, wv, Precision::Exact));
        push(&mut ops, Op::CacheWrite(CacheWriteOp { k, v, cache: layer }));
        let window = if layer == 0 { 5 } else { 0 };
        let a = push(&mut ops, Op::Attention(AttentionOp { q, cache: layer, n_head, n_head_kv, head_dim: hd, window, scale: 0.25, softcap: 0.0, precision: Precision::Exact }));
        let o = push(&mut ops, mm(a, wo, Precision::Exact));
        // The second layer norms the product before the residual add (as Gemma 3 does).
        let o = match layer {
            1 => {
                let pn = w(vector(r, e));
                push(&mut ops, Op::RmsNorm(NormOp { x: o, weight: Some(pn), offset: 0.0, group: e, eps: 1e-6 }))
            }
            _ => o,
        };
        x = push(&mut ops, Op::Add((x, o)));
        let h = push(&mut ops, Op::RmsNorm(NormOp { x, weight: Some(fnorm), offset: 0.0, group: e, eps: 1e-6 }));
        let g = push(&mut ops, mm(h, gate, Precision::Exact));
        let u = push(&mut ops, mm(h, up, Precision::Exact));
        let gu = push(&mut ops, Op::Gated(GatedOp { gate: g, up: u, act: if layer == 0 { Activation::GeluTanh } else { Activation::Silu } }));
        let d = push(&mut ops, mm(gu, down, Precision::Exact));
        x = push(&mut ops, Op::Add((x, d)));
    }
    let out_w = w(Weight::random(Format::Q8x32, vocab, e, r));
    let last = push(&mut ops, Op::LastRows(x));
    let last = push(&mut ops, Op::RmsNorm(NormOp { x: last, weight: None, offset: 0.0, group: e, eps: 1e-6 }));
    let logits = push(&mut ops, mm(last, out_w, Precision::Exact));
    push(&mut ops, Op::Output(logits));
    push(&mut ops, Op::TopK(TopKOp { x: logits, k: 5 }));

    let handles: Vec<Handle> = weights.iter().map(upload).collect::<Check<_>>()?;
    let decoded: Vec<Decoded> = weights.iter().map(|w| w.decode()).collect();
    let refs: Vec<&Handle> = handles.iter().collect();
    let p = create("a two-block decoder", &refs, 2, &ops)?;
    if p.ops() != ops.len() as u32 {
        return fail(format!("the program says it has {} ops; it was made of {}", p.ops(), ops.len()));
    }
    let mut batch = vec![Seq { rows: 7, start: 0 }, Seq { rows: 1, start: 0 }, Seq { rows: 4, start: 0 }];
    let new_caches = || -> Check<Vec<Vec<KvCache>>> {
        batch.iter().map(|_| (0..2).map(|_| cache(32, nkv)).collect::<Check<Vec<_>>>()).collect::<Check<_>>()
    };
    let caches = new_caches()?;
    let alone = new_caches()?;
    let mut refc: RefCaches = batch.iter().map(|_| vec![HashMap::new(), HashMap::new()]).collect();
    let table = |r: &mut Rng, s: &Seq| -> Vec<f32> {
        (0..s.rows).flat_map(|i| {
            let p = (s.start + i) as f32;
            let angles: Vec<f32> = (0..hd / 2).map(|j| p * r.uniform(0.5, 1.0) / (1 + j) as f32).collect();
            angles.iter().map(|a| a.cos()).chain(angles.iter().map(|a| a.sin())).collect::<Vec<_>>()
        }).collect()
    };
    for step in 0..3 {
        let xs: Vec<Vec<f32>> = batch.iter().map(|s| r.vector((s.rows * e) as usize)).collect();
        let tables: Vec<Vec<f32>> = batch.iter().map(|s| table(r, s)).collect();
        let inputs = vec![xs.concat(), tables.concat()];
        let what = format!("the two-block decoder, step {step} over {batch:?}");
        let got = run(&what, &p, &inputs, &seqs(&batch, &caches))?;
        let want = reference(&ops, &decoded, &inputs, &batch, &mut refc);
        ctx.max_error = ctx.max_error.max(compare(&what, &got, &want, EXACT)?);
        // Each sequence alone, on caches of its own that saw the same rows.
        let Some(Output::Rows(all)) = got.first() else {
            return fail(format!("{what}: the outputs are not rows then a top"));
        };
        for (s, q) in batch.iter().enumerate() {
            let one = [Sequence { rows: q.rows, start: q.start, caches: alone[s].iter().collect() }];
            let solo = run(&format!("{what}, sequence {s} alone"), &p, &[xs[s].clone(), tables[s].clone()], &one)?;
            let Some(Output::Rows(y)) = solo.first() else {
                return fail(format!("{what}, sequence {s} alone: the outputs are not rows then a top"));
            };
            let mine = &all[s * vocab as usize..(s + 1) * vocab as usize];
            let rms = (mine.iter().map(|a| (a * a) as f64).sum::<f64>() / vocab as f64).sqrt().max(1e-3);
            if let Some((c, (a, b))) = y.iter().zip(mine).enumerate().find(|(_, (a, b))| !((**a as f64 - **b as f64).abs() <= EXACT * rms)) {
                return fail(format!("{what}: sequence {s} alone gives {a} at column {c}; in the batch {b}"));
            }
        }
        for q in &mut batch {
            q.start += q.rows;
            q.rows = 1 + (q.start % 2);
        }
    }
    Ok(format!("{} ops over {} weights and 2 caches: 3 runs over a batch of 3 sequences, each also alone", ops.len(), weights.len()))
}

/// Programs that break the contract: each `create-program` refused with `invalid-argument`,
/// nothing held after.
pub fn hostile_programs(ctx: &mut Ctx) -> Check<String> {
    let w = Weight::random(Format::F32, 8, 4, &mut ctx.rng);
    let v = vector(&mut ctx.rng, 4);
    let (hw, hv) = (upload(&w)?, upload(&v)?);
    let weights = [&hw, &hv];
    let invalid = &[Kind::InvalidArgument];
    let cases: Vec<(&str, u32, Vec<Op>)> = vec![
        ("an operand past the program", 0, vec![Op::Input(4), Op::Output(7)]),
        ("an operand of a later op", 0, vec![Op::Input(4), Op::Add((0, 2)), Op::Input(4), Op::Output(1)]),
        ("an op reading itself", 0, vec![Op::Input(4), Op::Scale(ScaleOp { x: 1, by: 1.0 }), Op::Output(1)]),
        ("an op reading what an output made (nothing)", 0, vec![Op::Input(4), Op::Output(0), Op::Output(1)]),
        ("a weight index out of range", 0, vec![Op::Input(4), mm(0, 2, Precision::Exact), Op::Output(1)]),
        ("a product whose width is not the weight's columns", 0, vec![Op::Input(5), mm(0, 0, Precision::Exact), Op::Output(1)]),
        ("a bias that is not an f32 vector of the width", 0, vec![Op::Input(4), Op::Bias(BiasOp { x: 0, weight: 0 }), Op::Output(1)]),
        ("a norm group that does not divide the width", 0, vec![Op::Input(4), Op::RmsNorm(NormOp { x: 0, weight: None, offset: 0.0, group: 3, eps: 1e-6 }), Op::Output(1)]),
        ("a norm group of 0", 0, vec![Op::Input(4), Op::RmsNorm(NormOp { x: 0, weight: None, offset: 0.0, group: 0, eps: 1e-6 }), Op::Output(1)]),
        ("operands of different widths", 0, vec![Op::Input(4), Op::Input(8), Op::Add((0, 1)), Op::Output(2)]),
        ("operands of different kinds of rows", 0, vec![Op::Input(4), Op::LastRows(0), Op::Mul((0, 1)), Op::Output(2)]),
        ("a rotation of sequence rows", 0, vec![Op::Input(4), Op::Input(4), Op::LastRows(0), Op::Rotate(RotateOp { x: 2, table: 1, head_dim: 4, rotation: Rotation::Halves }), Op::Output(3)]),
        ("a rotation table wider than a head", 0, vec![Op::Input(4), Op::Input(6), Op::Rotate(RotateOp { x: 0, table: 1, head_dim: 4, rotation: Rotation::Pairs }), Op::Output(2)]),
        ("an odd head", 0, vec![Op::Input(6), Op::Input(2), Op::Rotate(RotateOp { x: 0, table: 1, head_dim: 3, rotation: Rotation::Pairs }), Op::Output(2)]),
        ("a cache index out of range", 1, vec![Op::Input(4), Op::CacheWrite(CacheWriteOp { k: 0, v: 0, cache: 1 }), Op::Output(0)]),
        ("a cache read with another width than it is written", 1, vec![Op::Input(4), Op::CacheWrite(CacheWriteOp { k: 0, v: 0, cache: 0 }), Op::Input(8), Op::Attention(AttentionOp { q: 2, cache: 0, n_head: 1, n_head_kv: 1, head_dim: 8, window: 0, scale: 1.0, softcap: 0.0, precision: Precision::Exact }), Op::Output(3)]),
        ("heads that do not group", 1, vec![Op::Input(12), Op::Attention(AttentionOp { q: 0, cache: 0, n_head: 3, n_head_kv: 2, head_dim: 4, window: 0, scale: 1.0, softcap: 0.0, precision: Precision::Exact }), Op::Output(1)]),
        ("a head past 512", 1, vec![Op::Input(1026), Op::Attention(AttentionOp { q: 0, cache: 0, n_head: 1, n_head_kv: 1, head_dim: 1026, window: 0, scale: 1.0, softcap: 0.0, precision: Precision::Exact }), Op::Output(1)]),
        ("a k of 0", 0, vec![Op::Input(4), Op::TopK(TopKOp { x: 0, k: 0 })]),
        ("a k past the row", 0, vec![Op::Input(4), Op::TopK(TopKOp { x: 0, k: 5 })]),
        ("an input of width 0", 0, vec![Op::Input(0), Op::Output(0)]),
        ("no output", 0, vec![Op::Input(4), Op::Scale(ScaleOp { x: 0, by: 2.0 })]),
        ("a soft cap of 0", 0, vec![Op::Input(4), Op::Softcap(SoftcapOp { x: 0, cap: 0.0 }), Op::Output(1)]),
        ("a soft cap of NaN", 0, vec![Op::Input(4), Op::Softcap(SoftcapOp { x: 0, cap: f32::NAN }), Op::Output(1)]),
        ("an attention soft cap below 0", 1, vec![Op::Input(4), Op::CacheWrite(CacheWriteOp { k: 0, v: 0, cache: 0 }), Op::Attention(AttentionOp { q: 0, cache: 0, n_head: 1, n_head_kv: 1, head_dim: 4, window: 0, scale: 1.0, softcap: -1.0, precision: Precision::Exact }), Op::Output(2)]),
        ("an infinite attention soft cap", 1, vec![Op::Input(4), Op::CacheWrite(CacheWriteOp { k: 0, v: 0, cache: 0 }), Op::Attention(AttentionOp { q: 0, cache: 0, n_head: 1, n_head_kv: 1, head_dim: 4, window: 0, scale: 1.0, softcap: f32::INFINITY, precision: Precision::Exact }), Op::Output(2)]),
        ("no ops", 0, vec![]),
        ("more caches than 1024", 1025, vec![Op::Input(4), Op::Output(0)]),
    ];
    for (what, caches, ops) in &cases {
        refused(&format!("a program with {what}"), invalid, || gpu::create_program(&weights, *caches, ops))?;
    }
    let mut huge = vec![Op::Input(4)];
    huge.extend((0..100_000).map(|i| Op::Scale(ScaleOp { x: i, by: 1.0 })));
    huge.push(Op::Output(100_000));
    refused("a program of 10^5 ops", invalid, || gpu::create_program(&weights, 0, &huge))?;
    let n = cases.len() + 1;
    // Still serving: a valid program of the same weights runs.
    let p = create("a valid program after the refusals", &weights, 0, &[Op::Input(4), mm(0, 0, Precision::Exact), Op::Output(1)])?;
    let x = ctx.rng.vector(8);
    let got = run("a valid program after the refusals", &p, &[x.clone()], &[Sequence { rows: 2, start: 0, caches: vec![] }])?;
    let want = reference(&[Op::Input(4), mm(0, 0, Precision::Exact), Op::Output(1)], &[w.decode()], &[x], &[Seq { rows: 2, start: 0 }], &mut vec![Vec::new()]);
    ctx.max_error = ctx.max_error.max(compare("a valid program after the refusals", &got, &want, EXACT)?);
    Ok(format!("{n} programs refused with invalid-argument, the budget unchanged; a valid one runs after"))
}

/// Runs that break the contract: each refused with `invalid-argument` (nothing written: a
/// valid run after reads the caches as the valid runs left them), and a run after a weight of
/// the program was dropped.
pub fn hostile_runs(ctx: &mut Ctx) -> Check<String> {
    let (hd, width) = (4u32, 8u32);
    let w = Weight::random(Format::F32, width, width, &mut ctx.rng);
    let hw = upload(&w)?;
    let ops = [
        Op::Input(width),
        Op::CacheWrite(CacheWriteOp { k: 0, v: 0, cache: 0 }),
        Op::Attention(AttentionOp { q: 0, cache: 0, n_head: 2, n_head_kv: 2, head_dim: hd, window: 0, scale: 0.5, softcap: 0.0, precision: Precision::Exact }),
        mm(2, 0, Precision::Exact),
        Op::Output(3),
    ];
    let p = create("a program for hostile runs", &[&hw], 1, &ops)?;
    let (a, b, narrow, small) = (cache(16, width)?, cache(16, width)?, cache(16, width / 2)?, cache(2, width)?);
    fn seq(rows: u32, start: u32, caches: Vec<&KvCache>) -> Sequence<'_> {
        Sequence { rows, start, caches }
    }
    let x = |n: usize| vec![0.5f32; n * width as usize];
    let invalid = &[Kind::InvalidArgument];
    let cases: Vec<(&str, Vec<Vec<f32>>, Vec<Sequence<'_>>)> = vec![
        ("no sequences", vec![x(0)], vec![]),
        ("no inputs", vec![], vec![seq(1, 0, vec![&a])]),
        ("two inputs for one input op", vec![x(1), x(1)], vec![seq(1, 0, vec![&a])]),
        ("rows that do not add up to the input", vec![x(3)], vec![seq(1, 0, vec![&a]), seq(1, 0, vec![&b])]),
        ("a sequence of no rows", vec![x(1)], vec![seq(0, 0, vec![&a]), seq(1, 0, vec![&b])]),
        ("positions past 2^32", vec![x(2)], vec![seq(2, u32::MAX, vec![&a])]),
        ("no cache for the cache index", vec![x(1)], vec![seq(1, 0, vec![])]),
        ("two caches for one cache index", vec![x(1)], vec![seq(1, 0, vec![&a, &b])]),
        ("one cache in two sequences", vec![x(2)], vec![seq(1, 0, vec![&a]), seq(1, 0, vec![&a])]),
        ("a cache of another width", vec![x(1)], vec![seq(1, 0, vec![&narrow])]),
        ("more rows than the cache's slots", vec![x(3)], vec![seq(3, 0, vec![&small])]),
        ("keys that do not fit the cache's slots", vec![x(1)], vec![seq(1, 5, vec![&small])]),
    ];
    for (what, inputs, batch) in &cases {
        refused(&format!("a run with {what}"), invalid, || p.run(inputs, batch))?;
    }
    // Nothing was written: a run at position 0 of `a` over 2 rows sees only its own rows.
    let xs = ctx.rng.vector(2 * width as usize);
    let got = run("a valid run after the refusals", &p, &[xs.clone()], &[seq(2, 0, vec![&a])])?;
    let want = reference(&ops, &[w.decode()], &[xs], &[Seq { rows: 2, start: 0 }], &mut vec![vec![HashMap::new()]]);
    ctx.max_error = ctx.max_error.max(compare("a valid run after the refusals", &got, &want, EXACT)?);
    drop(hw);
    refused("a run after a weight of the program was dropped", invalid, || p.run(&[x(1)], &[seq(1, 2, vec![&a])]))?;
    Ok(format!("{} runs refused with invalid-argument, the budget unchanged; a valid run after reads only what valid runs wrote", cases.len() + 1))
}

/// Programs count as handles: making one takes a handle, dropping it gives it back; the
/// handle budget bounds how many a guest holds.
pub fn lifetimes(ctx: &mut Ctx) -> Check<String> {
    let before = super::budget()?;
    let p = create("a program", &[], 0, &[Op::Input(4), Op::Output(0)])?;
    let held = super::budget()?;
    if held != (before.0, before.1 - 1) {
        return fail(format!("with a program held the budget (bytes, handles) is {held:?}; before it was {before:?}"));
    }
    let x = ctx.rng.vector(4);
    let got = run("a program that outputs its input", &p, &[x.clone()], &[Sequence { rows: 1, start: 3, caches: vec![] }])?;
    if !matches!(got.as_slice(), [Output::Rows(y)] if *y == x) {
        return fail("a program of an input and its output did not return the input unchanged");
    }
    drop(p);
    let after = super::budget()?;
    if after != before {
        return fail(format!("after dropping the program the budget is {after:?}; before it was {before:?}"));
    }
    Ok("a program takes one handle and gives it back when dropped; an input comes back as it went".into())
}
