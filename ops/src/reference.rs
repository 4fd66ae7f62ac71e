//! The f32 reference interpreter: a checked program run op by op over a checked batch, the
//! products, cache writes and attention through an executor's [`Primitives`], every other op
//! here in f32, each value freed after its last reader. It is the reading of the contract that
//! every executor shares; one that records whole programs on its device takes over from it.

use crate::op::{Activation, Op, Precision, Rotation, softcap};
use crate::program::{Program, Rows, SequenceRun, Weight, first_key};
use alloc::vec;
use alloc::vec::Vec;

/// What a run returns for an `output` or `top-k` op.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// The value of an `output` op, row-major.
    Rows(Vec<f32>),
    /// The top `k` of each row, row after row.
    Top {
        /// Largest first.
        values: Vec<f32>,
        /// Their columns.
        indices: Vec<u32>,
    },
}

/// The shape of one sequence's attention over its cache ([`Primitives::attention`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Queries.
    pub t: u32,
    /// Keys and values; the last `t` are the queries' own positions.
    pub n_keys: u32,
    /// Query heads, a multiple of `n_head_kv`.
    pub n_head: u32,
    /// Key/value heads.
    pub n_head_kv: u32,
    /// Width of every head, 1 to [`crate::MAX_HEAD_DIM`].
    pub head_dim: u32,
    /// Query `i` sees only the last `window` keys up to its own; 0 for no window.
    pub window: u32,
    /// Multiplies each query-key product before the softmax.
    pub scale: f32,
    /// Caps each scaled product as [`crate::op::softcap`] does; 0 for none.
    pub softcap: f32,
}

impl AttentionShape {
    /// The keys query `i` sees: its own position and those before, the last `window` of them
    /// where there is a window.
    pub fn keys_of(&self, i: u32) -> core::ops::Range<usize> {
        let last = (self.n_keys - self.t + i) as usize;
        let first = if self.window == 0 { 0 } else { (last + 1).saturating_sub(self.window as usize) };
        first..last + 1
    }

    /// The score of a query-key product `dot`: scaled, then capped where the op caps.
    pub fn score(&self, dot: f32) -> f32 {
        let s = dot * self.scale;
        if self.softcap > 0.0 { softcap(s, self.softcap) } else { s }
    }

    /// Values in `q` (and in the output), and in `k` (and `v`), or `None` if they overflow.
    pub fn lens(&self) -> Option<(u64, u64)> {
        let q = (self.t as u64).checked_mul(self.n_head as u64)?.checked_mul(self.head_dim as u64)?;
        let k = (self.n_keys as u64).checked_mul(self.n_head_kv as u64)?.checked_mul(self.head_dim as u64)?;
        Some((q, k))
    }
}

/// The work of a program that lives on an executor's device: products with its weights, and
/// its key/value caches. Arguments are already checked ([`crate::check`],
/// [`Program::check_batch`]).
pub trait Primitives<W> {
    /// The executor's error.
    type Error;
    /// `y[rows, n_out] = x[rows, n_in] @ W^T`, `W[n_out, n_in]` the weight `w`, summed as
    /// `precision` allows (an executor with one way of summing may ignore it).
    fn matmul(&mut self, w: &W, x: &[f32], rows: u32, precision: Precision) -> Result<Vec<f32>, Self::Error>;
    /// The products of several weights with the same `x` (the program's consecutive products
    /// of one value: a layer's query, key and value, or gate and up), each as [`Primitives::matmul`]
    /// gives it, in order. The default runs them one by one; an executor may run them together
    /// (one parallel region for all, where each is a fork and join of its own).
    fn matmuls(&mut self, ws: &[&W], x: &[f32], rows: u32, precision: Precision) -> Result<Vec<Vec<f32>>, Self::Error> {
        ws.iter().map(|w| self.matmul(w, x, rows, precision)).collect()
    }
    /// Rows of keys `k` and values `v` to cache `cache` (the executor's id) at positions
    /// `first..`.
    fn write_cache(&mut self, cache: u64, first: u32, k: &[f32], v: &[f32]) -> Result<(), Self::Error>;
    /// Attention of the queries `q` over cache `cache`'s positions `first_key..` (the last
    /// `shape.t` of them the queries' own).
    fn attention(&mut self, cache: u64, first_key: u32, q: &[f32], shape: &AttentionShape) -> Result<Vec<f32>, Self::Error>;
    /// `act(gate) * up`, value by value (a `gated` op). The default is [`Activation::apply`]'s
    /// f32 reading of each; an executor may compute it its own way within f32 rounding of it.
    fn gated(&mut self, act: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
        gate.iter().zip(up).map(|(&g, &u)| act.apply(g) * u).collect()
    }
}

/// Runs a checked program over a checked batch (see [`Program::check_batch`]). `vectors` holds
/// the values of the program's vector weights (f32 weights of one row) by weight index, and
/// nothing for the others.
pub fn run<W: Weight, P: Primitives<W>>(
    p: &Program<W>,
    prims: &mut P,
    vectors: &[&[f32]],
    mut inputs: Vec<Vec<f32>>,
    batch: &[SequenceRun],
) -> Result<Vec<Output>, P::Error> {
    let total: u32 = batch.iter().map(|q| q.rows).sum();
    let mut values: Vec<Vec<f32>> = vec![Vec::new(); p.ops.len()];
    let mut outputs = Vec::new();
    let mut next_input = 0;
    // Ops before this one were products made with a group before them.
    let mut grouped = 0;
    for (i, op) in p.ops.iter().enumerate() {
        let rows_of = |a: usize| if p.rows(a) == Rows::Sequence { batch.len() as u32 } else { total };
        let made = match *op {
            Op::Input { .. } => {
                next_input += 1;
                Some(core::mem::take(&mut inputs[next_input - 1]))
            }
            Op::Matmul { .. } if i < grouped => None,
            Op::Matmul { x, weight, precision } => {
                // This product and the ones right after it of the same value, in one call.
                let ws: Vec<&W> = p.ops[i..]
                    .iter()
                    .map_while(|o| match *o {
                        Op::Matmul { x: x2, weight, precision: p2 } if x2 == x && p2 == precision => Some(&p.weights[weight]),
                        _ => None,
                    })
                    .collect();
                if ws.len() < 2 {
                    Some(prims.matmul(&p.weights[weight], &values[x], rows_of(x), precision)?)
                } else {
                    let mut ys = prims.matmuls(&ws, &values[x], rows_of(x), precision)?.into_iter();
                    let first = ys.next();
                    for (k, y) in ys.enumerate() {
                        values[i + 1 + k] = y;
                    }
                    grouped = i + ws.len();
                    first
                }
            }
            Op::RmsNorm { x, weight, offset, group, eps } => {
                let mut y = values[x].clone();
                let ones = vec![0.0; group as usize];
                let (w, offset) = match weight {
                    Some(w) => (vectors[w], offset),
                    None => (&ones[..], 1.0),
                };
                rms_norm(&mut y, w, offset, eps);
                Some(y)
            }
            Op::Add(a, b) => Some(values[a].iter().zip(&values[b]).map(|(a, b)| a + b).collect()),
            Op::Mul(a, b) => Some(values[a].iter().zip(&values[b]).map(|(a, b)| a * b).collect()),
            Op::Bias { x, weight } => {
                let b = vectors[weight];
                let mut y = values[x].clone();
                for row in y.chunks_exact_mut(b.len()) {
                    row.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                }
                Some(y)
            }
            Op::Scale { x, by } => Some(values[x].iter().map(|a| a * by).collect()),
            Op::Softcap { x, cap } => Some(values[x].iter().map(|&a| softcap(a, cap)).collect()),
            Op::Gated { gate, up, act } => Some(prims.gated(act, &values[gate], &values[up])),
            Op::Rotate { x, table, head_dim, rotation } => {
                let mut y = values[x].clone();
                rotate(&mut y, p.width(x), &values[table], p.width(table), head_dim as usize, rotation);
                Some(y)
            }
            Op::CacheWrite { k, v, cache } => {
                let w = p.width(k);
                let mut at = 0;
                for q in batch {
                    let (id, _, _) = q.caches[cache as usize];
                    let n = q.rows as usize * w;
                    prims.write_cache(id, q.start, &values[k][at..at + n], &values[v][at..at + n])?;
                    at += n;
                }
                None
            }
            Op::Attention { q: qv, cache, n_head, n_head_kv, head_dim, window, scale, softcap, .. } => {
                let w = p.width(qv);
                let mut out = Vec::with_capacity(values[qv].len());
                let mut at = 0;
                for q in batch {
                    let (id, _, _) = q.caches[cache as usize];
                    let first = first_key(q.start, window);
                    let shape = AttentionShape { t: q.rows, n_keys: q.start + q.rows - first, n_head, n_head_kv, head_dim, window, scale, softcap };
                    let n = q.rows as usize * w;
                    out.extend(prims.attention(id, first, &values[qv][at..at + n], &shape)?);
                    at += n;
                }
                Some(out)
            }
            Op::LastRows(x) => {
                let w = p.width(x);
                let mut out = Vec::with_capacity(batch.len() * w);
                let mut end = 0;
                for q in batch {
                    end += q.rows as usize * w;
                    out.extend_from_slice(&values[x][end - w..end]);
                }
                Some(out)
            }
            Op::Output(x) => {
                let v = if p.last_use[x] == i { core::mem::take(&mut values[x]) } else { values[x].clone() };
                outputs.push(Output::Rows(v));
                None
            }
            Op::TopK { x, k } => {
                outputs.push(top_k(&values[x], p.width(x), k as usize));
                None
            }
        };
        if let Some(v) = made {
            values[i] = v;
        }
        for &a in &op.operands() {
            if p.last_use[a] == i {
                values[a] = Vec::new();
            }
        }
    }
    Ok(outputs)
}

/// `v <- v / sqrt(mean(v^2) + eps) * (w + offset)` for each run of `w.len()` values, the mean
/// in f64.
pub fn rms_norm(v: &mut [f32], w: &[f32], offset: f32, eps: f32) {
    for run in v.chunks_exact_mut(w.len()) {
        let ms = run.iter().map(|&a| a as f64 * a as f64).sum::<f64>() / w.len() as f64;
        let k = 1.0 / libm::sqrt(ms + eps as f64);
        for (a, &g) in run.iter_mut().zip(w) {
            *a = (*a as f64 * k) as f32 * (g + offset);
        }
    }
}

/// Turns the first `table_width` values of each head (of `head_dim`) of each row of `v` (rows
/// of `width`) by the matching row of `table`: its cosines, then its sines.
pub fn rotate(v: &mut [f32], width: usize, table: &[f32], table_width: usize, head_dim: usize, rotation: Rotation) {
    let half = table_width / 2;
    for (row, cs) in v.chunks_exact_mut(width).zip(table.chunks_exact(table_width.max(1))) {
        for head in row.chunks_exact_mut(head_dim) {
            for j in 0..half {
                let (a, b) = match rotation {
                    Rotation::Halves => (j, j + half),
                    Rotation::Pairs => (2 * j, 2 * j + 1),
                };
                let (c, s) = (cs[j], cs[half + j]);
                let (x, y) = (head[a], head[b]);
                head[a] = x * c - y * s;
                head[b] = x * s + y * c;
            }
        }
    }
}

/// The top `k` of each row of `x` (rows of `width`): largest first, lower index first among
/// equals, NaN below every number.
pub fn top_k(x: &[f32], width: usize, k: usize) -> Output {
    let rows = x.chunks_exact(width.max(1)).map(|row| row.iter().copied().zip(0u32..));
    top_of(rows, k)
}

/// The top `k` of each row from candidates of the row (value, column) that come, among equal
/// values, by column (a row's values in order, or its chunks' tops one chunk after another, as
/// a device's chunked top-k writes them): one pass a row, a candidate entering the `k` kept (in
/// order) only where it ranks above the last of them.
pub fn top_of<R: Iterator<Item = (f32, u32)>>(rows: impl Iterator<Item = R>, k: usize) -> Output {
    let (mut values, mut indices) = (Vec::new(), Vec::new());
    // Whether value `a` ranks above `b`, a candidate before it.
    let above = |a: f32, b: f32| !a.is_nan() && (b.is_nan() || a > b);
    let mut kept: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for row in rows {
        kept.clear();
        for (v, i) in row {
            if kept.len() == k && !kept.last().is_some_and(|&(last, _)| above(v, last)) {
                continue;
            }
            let at = kept.partition_point(|&(w, _)| !above(v, w));
            kept.insert(at, (v, i));
            kept.truncate(k);
        }
        values.extend(kept.iter().map(|&(v, _)| v));
        indices.extend(kept.iter().map(|&(_, i)| i));
    }
    Output::Top { values, indices }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{WeightShape, check};
    use crate::Format;

    #[test]
    fn top_k_orders_by_value_then_index_with_nan_last() {
        let x = [1.0, f32::NAN, 3.0, 3.0, -1.0, 2.0];
        let Output::Top { values, indices } = top_k(&x, 6, 4) else { unreachable!() };
        assert_eq!(indices, [2, 3, 5, 0]);
        assert_eq!(values, [3.0, 3.0, 2.0, 1.0]);
        let Output::Top { indices, .. } = top_k(&x, 6, 6) else { unreachable!() };
        assert_eq!(indices, [2, 3, 5, 0, 4, 1]);
    }

    /// Dense f32 products and caches of the test's own, in f64 where it sums.
    struct Plain {
        matrices: Vec<Vec<f32>>,
        caches: Vec<(Vec<f32>, Vec<f32>)>,
    }

    impl Primitives<WeightShape> for Plain {
        type Error = ();
        fn matmul(&mut self, w: &WeightShape, x: &[f32], rows: u32, _: Precision) -> Result<Vec<f32>, ()> {
            let m = &self.matrices[0];
            let (n_out, n_in) = (w.rows as usize, w.cols as usize);
            Ok((0..rows as usize * n_out).map(|i| (0..n_in).map(|j| x[i / n_out * n_in + j] as f64 * m[i % n_out * n_in + j] as f64).sum::<f64>() as f32).collect())
        }
        fn write_cache(&mut self, cache: u64, first: u32, k: &[f32], v: &[f32]) -> Result<(), ()> {
            let (ks, vs) = &mut self.caches[cache as usize];
            let at = first as usize * 2;
            ks[at..at + k.len()].copy_from_slice(k);
            vs[at..at + v.len()].copy_from_slice(v);
            Ok(())
        }
        fn attention(&mut self, cache: u64, first_key: u32, q: &[f32], s: &AttentionShape) -> Result<Vec<f32>, ()> {
            // One head of 2: softmax over the keys each query sees.
            let (ks, vs) = &self.caches[cache as usize];
            let mut out = Vec::new();
            for i in 0..s.t {
                let keys = s.keys_of(i);
                let scores: Vec<f64> = keys.clone().map(|j| {
                    let at = (first_key as usize + j) * 2;
                    (q[i as usize * 2] * ks[at] + q[i as usize * 2 + 1] * ks[at + 1]) as f64 * s.scale as f64
                }).collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| libm::exp(s - max)).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..2 {
                    out.push(keys.clone().zip(&e).map(|(j, e)| e / sum * vs[(first_key as usize + j) * 2 + d] as f64).sum::<f64>() as f32);
                }
            }
            Ok(out)
        }
    }

    #[test]
    fn the_interpreter_runs_each_op_of_a_small_recipe() {
        // x -> norm -> [k = v = x W^T] -> cache -> attention -> gated with x -> top-1 and rows.
        let ops = vec![
            Op::Input { width: 2 },
            Op::RmsNorm { x: 0, weight: None, offset: 0.0, group: 2, eps: 0.0 },
            Op::Matmul { x: 1, weight: 0, precision: Precision::Exact },
            Op::CacheWrite { k: 2, v: 2, cache: 0 },
            Op::Attention { q: 1, cache: 0, n_head: 1, n_head_kv: 1, head_dim: 2, window: 0, scale: 1.0, softcap: 0.0, precision: Precision::Exact },
            Op::Gated { gate: 4, up: 0, act: Activation::Silu },
            Op::LastRows(5),
            Op::Output(6),
            Op::TopK { x: 6, k: 1 },
        ];
        let p = check(ops, vec![WeightShape { rows: 2, cols: 2, format: Some(Format::F32) }], 1).unwrap();
        let mut prims = Plain { matrices: vec![vec![1.0, 0.0, 0.0, 1.0]], caches: vec![(vec![0.0; 8], vec![0.0; 8])] };
        let x = vec![3.0, 4.0, -1.0, 0.0];
        let batch = [SequenceRun { rows: 2, start: 0, caches: vec![(0, 4, 2)] }];
        p.check_batch(&[x.clone()], &batch, |_| true, 1 << 20).unwrap();
        let out = run(&p, &mut prims, &[&[]], vec![x], &batch).unwrap();
        // Row 1 of the norm, its attention over both rows' keys (the norm's rows: W is I).
        let norm = |r: [f64; 2]| {
            let k = 1.0 / ((r[0] * r[0] + r[1] * r[1]) / 2.0).sqrt();
            [r[0] * k, r[1] * k]
        };
        let n = [norm([3.0, 4.0]), norm([-1.0, 0.0])];
        let s: Vec<f64> = n.iter().map(|k| n[1][0] * k[0] + n[1][1] * k[1]).collect();
        let e: Vec<f64> = s.iter().map(|&s| libm::exp(s)).collect();
        let a: Vec<f64> = (0..2).map(|d| (e[0] * n[0][d] + e[1] * n[1][d]) / (e[0] + e[1])).collect();
        let silu = |g: f64| g / (1.0 + libm::exp(-g));
        let want = [silu(a[0]) * -1.0, silu(a[1]) * 0.0];
        let Output::Rows(rows) = &out[0] else { panic!("{out:?}") };
        for (got, want) in rows.iter().zip(want) {
            assert!((*got as f64 - want).abs() < 1e-6, "{rows:?} against {want:?}");
        }
        let Output::Top { indices, .. } = &out[1] else { panic!("{out:?}") };
        assert_eq!(indices, &[if rows[0] >= rows[1] { 0 } else { 1 }]);
    }

    /// Products that give each weight's row count as every value, and record how they were
    /// asked for.
    struct Counting {
        groups: Vec<usize>,
    }

    impl Primitives<WeightShape> for Counting {
        type Error = ();
        fn matmul(&mut self, w: &WeightShape, _: &[f32], rows: u32, _: Precision) -> Result<Vec<f32>, ()> {
            self.groups.push(1);
            Ok(vec![w.rows as f32; (rows * w.rows) as usize])
        }
        fn matmuls(&mut self, ws: &[&WeightShape], x: &[f32], rows: u32, precision: Precision) -> Result<Vec<Vec<f32>>, ()> {
            let ys = ws.iter().map(|w| self.matmul(w, x, rows, precision)).collect();
            self.groups.truncate(self.groups.len() - ws.len());
            self.groups.push(ws.len());
            ys
        }
        fn write_cache(&mut self, _: u64, _: u32, _: &[f32], _: &[f32]) -> Result<(), ()> {
            Ok(())
        }
        fn attention(&mut self, _: u64, _: u32, _: &[f32], _: &AttentionShape) -> Result<Vec<f32>, ()> {
            Err(())
        }
    }

    #[test]
    fn consecutive_products_of_one_value_are_one_call_and_each_keeps_its_place() {
        // x W0, x W1, x W2 in a row (one call of three), then y W1 of another value alone, and
        // an exact product of x after a fast one (another call).
        let fast = Precision::Fast;
        let ops = vec![
            Op::Input { width: 4 },
            Op::Matmul { x: 0, weight: 0, precision: fast },
            Op::Matmul { x: 0, weight: 1, precision: fast },
            Op::Matmul { x: 0, weight: 2, precision: fast },
            Op::Matmul { x: 1, weight: 3, precision: fast },
            Op::Matmul { x: 0, weight: 1, precision: Precision::Exact },
            Op::Output(1),
            Op::Output(2),
            Op::Output(3),
            Op::Output(4),
            Op::Output(5),
        ];
        let shape = |rows, cols| WeightShape { rows, cols, format: Some(Format::F32) };
        let p = check(ops, vec![shape(2, 4), shape(3, 4), shape(5, 4), shape(1, 2)], 0).unwrap();
        let mut prims = Counting { groups: Vec::new() };
        let batch = [SequenceRun { rows: 2, start: 0, caches: vec![] }];
        let out = run(&p, &mut prims, &[], vec![vec![0.5; 8]], &batch).unwrap();
        assert_eq!(prims.groups, [3, 1, 1]);
        let widths: Vec<Vec<f32>> = out.iter().map(|o| match o {
            Output::Rows(v) => v.clone(),
            other => panic!("{other:?}"),
        }).collect();
        assert_eq!(widths, [vec![2.0; 4], vec![3.0; 6], vec![5.0; 10], vec![1.0; 2], vec![3.0; 6]]);
    }
}
