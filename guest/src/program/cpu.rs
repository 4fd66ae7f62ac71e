//! A program on the guest's own CPU, with its simd128 kernels, over a batch of sequences: each
//! sequence's caches are its session's [`LayerCache`]s, and the products take every token row
//! of the batch at once (each weight read once a run). A row's values do not depend on the
//! rows beside it (the kernels are batch-invariant), so a sequence's outputs are those of a run
//! of it alone.
//!
//! Values live in a few buffers allocated once per session ([`Values`]): a [`Plan`] made once
//! per program gives each value a buffer that no value live at the same time holds, so a run
//! allocates no activations. Consecutive products of one input go to the dispatcher in one
//! call (one quantization of the input, one device round trip where the policy sends them
//! there); attention goes through it too (`Dispatch::attend`).

use super::{Op, Program, Rotation, Rows, Tensors, Value, heads_of};
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
            let (width, rows) = (p.width(i), p.rows(i));
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
            let vals = op.operands();
            let vals = vals.as_slice();
            for (j, &a) in vals.iter().enumerate() {
                // Once per value, also where an op reads it twice; never a value the run
                // returns (read after the run).
                if p.last_use[a] == i && !vals[..j].contains(&a) && !p.outputs.contains(&a) {
                    free.push(buffer[a]);
                }
            }
        }
        Plan { buffer, widths }
    }
}

/// Buffers for one program: runs of up to `batch` token rows and `seqs` sequences.
pub struct Values {
    bufs: Vec<Vec<f32>>,
    /// All ones, for norms without a weight.
    ones: Vec<f32>,
    batch: usize,
    seqs: usize,
}

impl Values {
    pub fn new(p: &Program, plan: &Plan, batch: usize, seqs: usize) -> Values {
        let bufs = plan.widths.iter().map(|&(tw, sw)| vec![0.0; (batch * tw).max(seqs * sw)]).collect();
        let widest_norm = p.ops.iter().map(|op| if let Op::RmsNorm { group, weight: None, .. } = op { *group as usize } else { 0 }).max();
        Values { bufs, ones: vec![1.0; widest_norm.unwrap_or(0)], batch, seqs }
    }

    /// The token rows and sequences of the largest run that fits.
    pub fn capacity(&self) -> (usize, usize) {
        (self.batch, self.seqs)
    }

    /// Whether runs of `batch` token rows and `seqs` sequences fit.
    pub fn holds(&self, batch: usize, seqs: usize) -> bool {
        batch <= self.batch && seqs <= self.seqs
    }

    pub fn bytes(&self) -> usize {
        4 * (self.bufs.iter().map(Vec::len).sum::<usize>() + self.ones.len())
    }

    /// The value `v` of the last run: `rows * width` values.
    pub fn get(&self, p: &Program, plan: &Plan, v: Value, rows: usize) -> &[f32] {
        &self.bufs[plan.buffer[v]][..rows * p.width(v)]
    }
}

/// One sequence of a run: `t` token rows at positions `pos..`.
pub struct Seq<'a> {
    pub t: usize,
    pub pos: usize,
    /// Whether the run's outputs hold a row for it (the ops after `last-rows` see the
    /// sequences that want one, in order).
    pub outputs: bool,
    /// Its caches, written by the `cache-write` ops and read by `attention`.
    pub caches: &'a mut [LayerCache],
    /// The dispatcher its attention goes through (an index into the run's).
    pub d: usize,
}

/// Runs `p` on the CPU over `seqs`, their token rows one after the other: products through
/// `ds[0]`, each sequence's attention through its own dispatcher, each `cache-write` to its
/// caches. Without any sequence wanting outputs, only the ops the caches need run. `input`
/// fills input `i` (all the token rows of its width); `scores` is attention's scratch (`pos + t`
/// values at least for every sequence).
pub fn run(p: &Program, plan: &Plan, w: &dyn Tensors, ds: &mut [&mut Dispatch], vals: &mut Values, scores: &mut [f32], seqs: &mut [Seq<'_>], input: &mut dyn FnMut(usize, &mut [f32])) {
    let t: usize = seqs.iter().map(|s| s.t).sum();
    let n_out = seqs.iter().filter(|s| s.outputs).count();
    let outputs = n_out > 0;
    debug_assert!(vals.holds(t, n_out));
    let rows = |v: Value| if p.rows(v) == Rows::Sequence { n_out } else { t };
    let n = |v: Value| rows(v) * p.width(v);
    let mut next_input = 0;
    let mut i = 0;
    while i < p.ops.len() {
        if !outputs && !p.feeds_caches[i] {
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
                input(next_input, &mut y[..n(i)]);
                next_input += 1;
            }
            Op::Matmul { x, .. } => {
                // This product and the next ones of the same input, in one call.
                let mut end = i + 1;
                while end < p.ops.len() && matches!(p.ops[end], Op::Matmul { x: x2, .. } if x2 == x) && (outputs || p.feeds_caches[end]) {
                    end += 1;
                }
                let mut outs: Vec<Vec<f32>> = (i + 1..end).map(|j| std::mem::take(&mut vals.bufs[plan.buffer[j]])).collect();
                let b = &vals.bufs;
                let xs = &b[plan.buffer[x]][..n(x)];
                let mut jobs: Vec<_> = (i..end)
                    .zip(std::iter::once(&mut y).chain(outs.iter_mut()))
                    .map(|(j, buf)| match p.ops[j] {
                        Op::Matmul { weight, .. } => (w.matrix(p.weights[weight].id), &mut buf[..]),
                        _ => unreachable!(),
                    })
                    .collect();
                // The products that feed only the outputs (the output projection) count apart.
                let start = std::time::Instant::now();
                ds[0].matmul(xs, rows(x), &mut jobs);
                if !p.feeds_caches[i] {
                    ds[0].counters.output_ns += start.elapsed().as_nanos() as u64;
                }
                drop(jobs);
                for (j, buf) in (i + 1..end).zip(outs) {
                    vals.bufs[plan.buffer[j]] = buf;
                }
                vals.bufs[out] = y;
                i = end;
                continue;
            }
            Op::RmsNorm { x, weight, offset, group, eps } => {
                // The guest's recipes fold any offset into their norm weights.
                debug_assert_eq!(offset, 0.0);
                let (y, group) = (&mut y[..n(x)], group as usize);
                y.copy_from_slice(src(x));
                let g = match weight {
                    Some(i) => w.vector(p.weights[i].id),
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
            Op::Bias { x, weight } => {
                let y = &mut y[..n(x)];
                y.copy_from_slice(src(x));
                let bias = w.vector(p.weights[weight].id);
                for row in y.chunks_exact_mut(bias.len()) {
                    kernels::add(row, bias);
                }
            }
            Op::Scale { x, by } => {
                for (o, v) in y.iter_mut().zip(src(x)) {
                    *o = v * by;
                }
            }
            Op::Softcap { x, cap } => {
                for (o, &v) in y.iter_mut().zip(src(x)) {
                    *o = wisp_ops::softcap(v, cap);
                }
            }
            Op::Gated { gate, up, act } => {
                let y = &mut y[..n(gate)];
                y.copy_from_slice(src(gate));
                kernels::gate(act, y, src(up));
            }
            Op::Rotate { x, table, head_dim, rotation } => {
                let (width, tw) = (p.width(x), p.width(table));
                let y = &mut y[..n(x)];
                y.copy_from_slice(src(x));
                rotate(y, width, src(table), tw, head_dim as usize, rotation);
            }
            Op::CacheWrite { k, v, cache } => {
                let (width, cache) = (p.width(k), cache as usize);
                let (ks, vs) = (src(k), src(v));
                let mut first = 0;
                for s in seqs.iter_mut() {
                    for row in 0..s.t {
                        let at = (first + row) * width..(first + row + 1) * width;
                        s.caches[cache].store(s.pos + row, &ks[at.clone()], &vs[at]);
                    }
                    first += s.t;
                }
            }
            Op::Attention { q, cache, n_head, n_head_kv, head_dim, window, scale, softcap, .. } => {
                let (heads, cache, window) = (heads_of(n_head, n_head_kv, head_dim, scale, softcap), cache as usize, window as usize);
                let width = p.width(q);
                let (qs, mut first) = (src(q), 0);
                for s in seqs.iter() {
                    debug_assert_eq!(s.caches[cache].window.unwrap_or(0), window);
                    let at = first * width..(first + s.t) * width;
                    ds[s.d].attend(cache, &s.caches[cache], heads, &qs[at.clone()], s.pos, s.t, scores, &mut y[at]);
                    first += s.t;
                }
            }
            Op::LastRows(x) => {
                let width = p.width(x);
                let (xs, mut first, mut row) = (src(x), 0, 0);
                for s in seqs.iter() {
                    first += s.t;
                    if s.outputs {
                        y[row * width..(row + 1) * width].copy_from_slice(&xs[(first - 1) * width..first * width]);
                        row += 1;
                    }
                }
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

    /// The same shapes with Q8_0 weights (the batch-invariant integer kernels).
    fn toy_q8(n: usize) -> Toy {
        let mut rng = crate::quant::tests::Rng(0x5eed);
        let m = (0..3)
            .map(|i| {
                let data = crate::quant::tests::random_blocks(TensorType::Q8_0, n * n, &mut rng);
                let q = crate::quant::QMatrix::from_blocks(TensorType::Q8_0, &data, n, n).unwrap();
                Linear { name: format!("w{i}"), n_out: n, n_in: n, w: WeightData::Q(q), kind: TensorType::Q8_0, gpu: None }
            })
            .collect();
        Toy { m, v: (0..n).map(|j| 1.0 + j as f32 / n as f32).collect() }
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
            let a = p.attention(q, l, Heads { n_head: 2, n_head_kv: 2, head_dim: n / 2, scale: 0.5, softcap: 0.0 }, 0);
            let g = p.gated(a, h, Act::Silu);
            x = p.add(x, g);
        }
        let last = p.last_rows(x);
        let y = p.rms_norm(last, None, n, 1e-6);
        p.output(y);
        p.finish().unwrap()
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

    /// Runs `p` over sequences given as `(first token row in xs, rows, position)`, each with
    /// its own caches and dispatcher, in one run; returns each sequence's output row (all want
    /// one).
    fn run_seqs(p: &Program, w: &Toy, n: usize, xs: &[f32], tables: &[f32], seqs: &[(usize, usize, usize)], caches: &mut [Vec<LayerCache>]) -> Vec<Vec<f32>> {
        let plan = Plan::new(p);
        let t: usize = seqs.iter().map(|s| s.1).sum();
        let mut vals = Values::new(p, &plan, t, seqs.len());
        let mut scores = vec![0.0; 64];
        let mut main = Dispatch::new(None);
        let mut own: Vec<Dispatch> = seqs.iter().map(|_| Dispatch::new(None)).collect();
        let mut ds: Vec<&mut Dispatch> = std::iter::once(&mut main).chain(own.iter_mut()).collect();
        let mut run_seqs: Vec<Seq<'_>> = seqs
            .iter()
            .zip(caches.iter_mut())
            .enumerate()
            .map(|(i, (&(_, t, pos), c))| Seq { t, pos, outputs: true, caches: c, d: i + 1 })
            .collect();
        let mut input = |i: usize, out: &mut [f32]| {
            let width = if i == 0 { n } else { n / 2 };
            let src = if i == 0 { xs } else { tables };
            let mut at = 0;
            for &(first, t, _) in seqs {
                out[at * width..(at + t) * width].copy_from_slice(&src[first * width..(first + t) * width]);
                at += t;
            }
        };
        run(p, &plan, w, &mut ds, &mut vals, &mut scores, &mut run_seqs, &mut input);
        let out = vals.get(p, &plan, p.outputs[0], seqs.len());
        out.chunks_exact(n).map(<[f32]>::to_vec).collect()
    }

    /// A sequence's output does not depend on how its tokens are split into runs, nor on the
    /// sequences that share its runs: bit for bit, with f32 and with quantized weights.
    #[test]
    fn a_sequence_alone_and_in_a_batch_agree_bit_for_bit() {
        for quantized in [false, true] {
            let n = 64;
            let w = if quantized { toy_q8(n) } else { toy(n) };
            let p = program(&w, n);
            // Three sequences' tokens and rotation rows, at positions 0.., one after the other.
            let lens = [5usize, 9, 3];
            let total: usize = lens.iter().sum();
            let xs: Vec<f32> = (0..total * n).map(|i| ((i * 13) % 17) as f32 / 17.0 - 0.4).collect();
            let tables: Vec<f32> = (0..total).flat_map(|i| {
                let a: Vec<f32> = (0..n / 4).map(|j| ((i % 9) * (j + 1)) as f32 * 0.3).collect();
                a.iter().map(|a| a.cos()).chain(a.iter().map(|a| a.sin())).collect::<Vec<_>>()
            }).collect();
            let starts: Vec<usize> = lens.iter().scan(0, |at, &l| { let s = *at; *at += l; Some(s) }).collect();
            let fresh = || -> Vec<Vec<LayerCache>> { (0..3).map(|_| (0..2).map(|_| LayerCache::new(16, None, 16, n)).collect()).collect() };
            // Each alone, all its tokens in one run.
            let mut alone = Vec::new();
            for s in 0..3 {
                let mut c = fresh();
                alone.push(run_seqs(&p, &w, n, &xs, &tables, &[(starts[s], lens[s], 0)], &mut c[s..s + 1]).remove(0));
            }
            // All three in each run, their tokens in chunks of different sizes.
            let mut c = fresh();
            let mut done = [0usize; 3];
            let chunk = [2usize, 4, 3];
            let mut last = vec![Vec::new(); 3];
            while (0..3).any(|s| done[s] < lens[s]) {
                let live: Vec<usize> = (0..3).filter(|&s| done[s] < lens[s]).collect();
                let seqs: Vec<(usize, usize, usize)> = live.iter().map(|&s| (starts[s] + done[s], chunk[s].min(lens[s] - done[s]), done[s])).collect();
                let mut cs: Vec<Vec<LayerCache>> = live.iter().map(|&s| std::mem::take(&mut c[s])).collect();
                let outs = run_seqs(&p, &w, n, &xs, &tables, &seqs, &mut cs);
                for ((&s, out), cache) in live.iter().zip(outs).zip(cs) {
                    c[s] = cache;
                    done[s] += chunk[s].min(lens[s] - done[s]);
                    last[s] = out;
                }
            }
            for s in 0..3 {
                assert!(alone[s].iter().any(|v| *v != 0.0));
                let same = alone[s].iter().zip(&last[s]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "quantized {quantized}, sequence {s}: {:?} alone, {:?} in the batch", alone[s], last[s]);
            }
        }
    }
}
