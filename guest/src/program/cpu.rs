//! A program on the guest's own CPU, with its simd128 kernels: one sequence at a time, its
//! caches the session's [`LayerCache`]s.
//!
//! Values live in a few buffers allocated once per session ([`Values`]): a [`Plan`] made once
//! per program gives each value a buffer that no value live at the same time holds, so a run
//! allocates no activations. Consecutive products of one input go to the dispatcher in one
//! call (one quantization of the input, one device round trip where the policy sends them
//! there); attention goes through it too (`Dispatch::attend`).

use super::{Op, Program, Rotation, Rows, Tensors, Value};
use crate::dispatch::Dispatch;
use crate::kernels::{self, rms_norm, rotate_pairs};
use crate::models::LayerCache;

/// Which buffer holds each value, and how wide each buffer's rows must be.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// The buffer of each value (`usize::MAX` for the ops that make none).
    buffer: Vec<usize>,
    /// For each buffer, the widest token-row value and the widest sequence-row value it holds.
    widths: Vec<(usize, usize)>,
}

impl Plan {
    /// Gives each value a buffer: a free one, freed after the value's last reader (so a value
    /// never shares a buffer with the operands of the op that makes it). A value no op reads
    /// keeps its buffer, so that the products of one call never share one.
    pub fn new(p: &Program) -> Plan {
        let mut buffer = vec![usize::MAX; p.ops.len()];
        let mut widths: Vec<(usize, usize)> = Vec::new();
        let mut free: Vec<usize> = Vec::new();
        for (i, op) in p.ops.iter().enumerate() {
            let (width, rows) = p.shapes[i];
            if width > 0 {
                let b = free.pop().unwrap_or_else(|| {
                    widths.push((0, 0));
                    widths.len() - 1
                });
                let w = &mut widths[b];
                match rows {
                    Rows::Token => w.0 = w.0.max(width),
                    Rows::Sequence => w.1 = w.1.max(width),
                }
                buffer[i] = b;
            }
            let (vals, k) = op.operands();
            for (j, &a) in vals[..k].iter().enumerate() {
                // Once per value, also where an op reads it twice.
                if p.last_use[a] == i && !vals[..j].contains(&a) {
                    free.push(buffer[a]);
                }
            }
        }
        Plan { buffer, widths }
    }
}

/// A session's buffers for one program: batches of up to `batch` token rows.
pub struct Values {
    bufs: Vec<Vec<f32>>,
    /// All ones, for norms without a weight.
    ones: Vec<f32>,
    batch: usize,
}

impl Values {
    pub fn new(p: &Program, plan: &Plan, batch: usize) -> Values {
        let bufs = plan.widths.iter().map(|&(tw, sw)| vec![0.0; (batch * tw).max(sw)]).collect();
        let widest_norm = p.ops.iter().map(|op| if let Op::RmsNorm { group, w: None, .. } = op { *group } else { 0 }).max();
        Values { bufs, ones: vec![1.0; widest_norm.unwrap_or(0)], batch }
    }

    pub fn bytes(&self) -> usize {
        4 * (self.bufs.iter().map(Vec::len).sum::<usize>() + self.ones.len())
    }

    /// The value `v` of the last run: `rows * width` values.
    pub fn get(&self, p: &Program, plan: &Plan, v: Value, rows: usize) -> &[f32] {
        &self.bufs[plan.buffer[v]][..rows * p.shapes[v].0]
    }
}

/// One run: `t` token rows at positions `pos..`.
pub struct Run<'a> {
    pub t: usize,
    pub pos: usize,
    /// Whether the outputs are wanted; without, only the ops the caches need run.
    pub outputs: bool,
    /// Fills input `i` (`t` rows of its width).
    pub input: &'a mut dyn FnMut(usize, &mut [f32]),
}

/// Runs `p` on the CPU (products and attention through `d`), writing each `cache-write` to
/// `caches[cache]`. `scores` is attention's scratch (`pos + t` values at least).
#[allow(clippy::too_many_arguments)]
pub fn run(
    p: &Program,
    plan: &Plan,
    w: &dyn Tensors,
    d: &mut Dispatch,
    caches: &mut [LayerCache],
    vals: &mut Values,
    scores: &mut [f32],
    r: Run<'_>,
) {
    let (t, pos) = (r.t, r.pos);
    debug_assert!(t <= vals.batch);
    let rows = |v: Value| if p.shapes[v].1 == Rows::Sequence { 1 } else { t };
    let n = |v: Value| rows(v) * p.shapes[v].0;
    let mut next_input = 0;
    let mut i = 0;
    while i < p.ops.len() {
        if !r.outputs && !p.feeds_caches[i] {
            i += 1;
            continue;
        }
        let out = plan.buffer[i];
        // The op's output, taken out of its buffer while the operands are read.
        let mut y = if out == usize::MAX { Vec::new() } else { std::mem::take(&mut vals.bufs[out]) };
        let b = &vals.bufs;
        let src = |v: Value| &b[plan.buffer[v]][..n(v)];
        match p.ops[i] {
            Op::Input { .. } => {
                (r.input)(next_input, &mut y[..n(i)]);
                next_input += 1;
            }
            Op::Matmul { x, .. } => {
                // This product and the next ones of the same input, in one call.
                let mut end = i + 1;
                while end < p.ops.len() && matches!(p.ops[end], Op::Matmul { x: x2, .. } if x2 == x) && (r.outputs || p.feeds_caches[end]) {
                    end += 1;
                }
                let mut outs: Vec<Vec<f32>> = (i + 1..end).map(|j| std::mem::take(&mut vals.bufs[plan.buffer[j]])).collect();
                let b = &vals.bufs;
                let xs = &b[plan.buffer[x]][..n(x)];
                let mut jobs: Vec<_> = (i..end)
                    .zip(std::iter::once(&mut y).chain(outs.iter_mut()))
                    .map(|(j, buf)| match p.ops[j] {
                        Op::Matmul { w: id, .. } => (w.matrix(id), &mut buf[..]),
                        _ => unreachable!(),
                    })
                    .collect();
                // The products that feed only the outputs (the output projection) count apart.
                let start = std::time::Instant::now();
                d.matmul(xs, rows(x), &mut jobs);
                if !p.feeds_caches[i] {
                    d.counters.output_ns += start.elapsed().as_nanos() as u64;
                }
                drop(jobs);
                for (j, buf) in (i + 1..end).zip(outs) {
                    vals.bufs[plan.buffer[j]] = buf;
                }
                vals.bufs[out] = y;
                i = end;
                continue;
            }
            Op::RmsNorm { x, w: id, group, eps } => {
                let y = &mut y[..n(x)];
                y.copy_from_slice(src(x));
                let g = match id {
                    Some(id) => w.vector(id),
                    None => &vals.ones[..group],
                };
                for run in y.chunks_exact_mut(group) {
                    rms_norm(run, g, eps);
                }
            }
            Op::Add(a, c) => {
                let y = &mut y[..n(a)];
                y.copy_from_slice(src(a));
                kernels::add(y, src(c));
            }
            Op::Mul(a, c) => {
                for ((o, x), z) in y.iter_mut().zip(src(a)).zip(src(c)) {
                    *o = x * z;
                }
            }
            Op::Bias { x, w: id } => {
                let y = &mut y[..n(x)];
                y.copy_from_slice(src(x));
                let bias = w.vector(id);
                for row in y.chunks_exact_mut(bias.len()) {
                    kernels::add(row, bias);
                }
            }
            Op::Scale { x, by } => {
                for (o, v) in y.iter_mut().zip(src(x)) {
                    *o = v * by;
                }
            }
            Op::Gated { gate, up, act } => {
                let y = &mut y[..n(gate)];
                y.copy_from_slice(src(gate));
                kernels::gate(act, y, src(up));
            }
            Op::Rotate { x, table, head_dim, rotation } => {
                let (width, tw) = (p.shapes[x].0, p.shapes[table].0);
                let y = &mut y[..n(x)];
                y.copy_from_slice(src(x));
                rotate(y, width, src(table), tw, head_dim, rotation);
            }
            Op::CacheWrite { k, v, cache } => {
                let width = p.shapes[k].0;
                let (ks, vs) = (src(k), src(v));
                for row in 0..t {
                    let at = row * width..(row + 1) * width;
                    caches[cache].store(pos + row, &ks[at.clone()], &vs[at]);
                }
            }
            Op::Attention { q, cache, heads, window } => {
                debug_assert_eq!(caches[cache].window.unwrap_or(0), window);
                d.attend(cache, &caches[cache], heads, src(q), pos, t, scores, &mut y[..n(q)]);
            }
            Op::LastRows(x) => {
                let width = p.shapes[x].0;
                y[..width].copy_from_slice(&src(x)[(t - 1) * width..t * width]);
            }
            Op::Output(_) | Op::TopK { .. } => {}
        }
        if out != usize::MAX {
            vals.bufs[out] = y;
        }
        i += 1;
    }
}

/// Turns the first `table_width` values of each head (of `head_dim`) of each row of `v` (rows
/// of `width`) by the matching row of `table`: its cosines, then its sines.
fn rotate(v: &mut [f32], width: usize, table: &[f32], table_width: usize, head_dim: usize, rotation: Rotation) {
    let half = table_width / 2;
    for (row, cs) in v.chunks_exact_mut(width).zip(table.chunks_exact(table_width)) {
        let (cos, sin) = cs.split_at(half);
        for head in row.chunks_exact_mut(head_dim) {
            match rotation {
                Rotation::Halves => {
                    let (a, b) = head[..table_width].split_at_mut(half);
                    rotate_pairs(a, b, cos, sin);
                }
                Rotation::Pairs => {
                    for (j, pair) in head[..table_width].chunks_exact_mut(2).enumerate() {
                        let (x0, x1) = (pair[0], pair[1]);
                        pair[0] = x0 * cos[j] - x1 * sin[j];
                        pair[1] = x0 * sin[j] + x1 * cos[j];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::TensorType;
    use crate::kernels::Act;
    use crate::models::attention::Heads;
    use crate::models::{Linear, WeightData};
    use crate::program::{Builder, Tensor, WeightId};

    /// Weights `[n, n]` (ids 0, 1, 2) and a vector `[n]` (id 3), all f32.
    struct Toy {
        m: Vec<Linear>,
        v: Vec<f32>,
    }

    impl Tensors for Toy {
        fn tensor(&self, id: WeightId) -> Tensor<'_> {
            match id.0 {
                3 => Tensor::Vector(&self.v),
                i => Tensor::Matrix(&self.m[i as usize]),
            }
        }
    }

    fn toy(n: usize) -> Toy {
        let m = (0..3)
            .map(|i| {
                let w = (0..n * n).map(|j| ((j * 7 + i * 3) % 11) as f32 / 11.0 - 0.5).collect();
                Linear { name: format!("w{i}"), n_out: n, n_in: n, w: WeightData::F32(w), kind: TensorType::F32, gpu: None }
            })
            .collect();
        Toy { m, v: (0..n).map(|j| 1.0 + j as f32 / n as f32).collect() }
    }

    /// Two decoder-like layers: products of one input grouped, norms, a gate, a cache, the
    /// last row.
    fn program(w: &Toy, n: usize) -> Program {
        let mut p = Builder::new(w);
        let mut x = p.input(n);
        let table = p.input(n / 2);
        for l in 0..2 {
            let h = p.norm(x, WeightId(3), 1e-6);
            let (q, k, v) = (p.matmul(h, WeightId(0)), p.matmul(h, WeightId(1)), p.matmul(h, WeightId(2)));
            let q = p.rotate(q, table, n / 2, Rotation::Halves);
            p.cache_write(k, v, l);
            let a = p.attention(q, l, Heads { n_head: 2, n_head_kv: 2, head_dim: n / 2, scale: 0.5 }, 0);
            let g = p.gated(a, h, Act::Silu);
            x = p.add(x, g);
        }
        let last = p.last_rows(x);
        let y = p.rms_norm(last, None, n, 1e-6);
        p.output(y);
        p.finish()
    }

    #[test]
    fn no_value_shares_a_buffer_with_one_live_beside_it() {
        let w = toy(8);
        let p = program(&w, 8);
        let plan = Plan::new(&p);
        for i in 0..p.ops.len() {
            let Some(&b) = plan.buffer.get(i).filter(|&&b| b != usize::MAX) else { continue };
            for j in 0..i {
                let live = p.last_use[j] >= i;
                assert!(!(live && plan.buffer[j] == b), "value {i} ({:?}) takes the buffer of live value {j}", p.ops[i]);
            }
        }
        assert!(plan.widths.len() < p.ops.len() / 2, "{} buffers for {} ops", plan.widths.len(), p.ops.len());
    }

    /// The same rows give the same output whether they come in one run or token by token.
    #[test]
    fn a_batch_and_its_tokens_one_by_one_agree() {
        let n = 8;
        let w = toy(n);
        let p = program(&w, n);
        let plan = Plan::new(&p);
        let t = 5;
        let xs: Vec<f32> = (0..t * n).map(|i| ((i * 13) % 17) as f32 / 17.0 - 0.4).collect();
        let tables: Vec<f32> = (0..t).flat_map(|i| {
            let a: Vec<f32> = (0..n / 4).map(|j| (i * (j + 1)) as f32 * 0.3).collect();
            a.iter().map(|a| a.cos()).chain(a.iter().map(|a| a.sin())).collect::<Vec<_>>()
        }).collect();
        let mut outs = Vec::new();
        for chunk in [t, 1] {
            let mut d = Dispatch::new(None);
            let mut caches: Vec<LayerCache> = (0..2).map(|_| LayerCache::new(16, None, t, n)).collect();
            let mut vals = Values::new(&p, &plan, t);
            let mut scores = vec![0.0; 16];
            for start in (0..t).step_by(chunk) {
                let rows = chunk.min(t - start);
                let mut input = |i: usize, out: &mut [f32]| match i {
                    0 => out.copy_from_slice(&xs[start * n..(start + rows) * n]),
                    _ => out.copy_from_slice(&tables[start * n / 2..(start + rows) * n / 2]),
                };
                let r = Run { t: rows, pos: start, outputs: start + rows == t, input: &mut input };
                run(&p, &plan, &w, &mut d, &mut caches, &mut vals, &mut scores, r);
            }
            outs.push(vals.get(&p, &plan, p.outputs[0], 1).to_vec());
        }
        for (a, b) in outs[0].iter().zip(&outs[1]) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{:?} vs {:?}", outs[0], outs[1]);
        }
        assert!(outs[0].iter().any(|v| *v != 0.0));
    }
}
