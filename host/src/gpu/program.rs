//! Programs of the `gpu` interface (from `wisp:llm@0.4.0`): a model's recipe as a list of ops
//! over values named by index, made once and run over batches of sequences (see the `program`
//! resource of `wit/gpu.wit` for the exact semantics).
//!
//! [`check`] turns the guest's ops into a [`Program`] whose every operand, shape and kind has
//! been checked, so that a run only has to check its batch ([`Program::check_batch`]). [`run`]
//! then executes it op by op: products, cache writes and attention on the [`Backend`] (its
//! `matmul`, `write_cache` and `attention_cached`), the other ops here in f32, each value freed
//! after its last reader. That is the reading of the contract every native backend shares;
//! a backend that records whole programs on its device takes over from it.

use super::{Activation, AttentionShape, Backend, BufferId, Format, GpuError, MAX_HEAD_DIM, Rotation};

/// Ops in one program, at most.
pub const MAX_OPS: usize = 65536;
/// Cache indices of one program, at most.
pub const MAX_CACHES: u32 = 1024;
/// Sequences in one run, at most.
pub const MAX_SEQUENCES: usize = 4096;
/// The largest `k` of a `top-k` op.
pub const MAX_TOP_K: u32 = 1024;
/// The widest value (2^31).
const MAX_WIDTH: u32 = 1 << 31;

/// How exactly a product or an attention op is computed (the WIT `precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// f32 products and sums.
    #[default]
    Exact,
    /// f16/bf16 inputs, f32 sums: within 2^-6 of the norm of a sum's terms.
    Fast,
}

/// One op, operands by value index (the WIT `op`; see `wit/gpu.wit`). Each variant's fields are
/// those of the WIT record of the same name, indices as `usize`.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    /// Token rows of `width` from the run's next input.
    Input { width: u32 },
    /// `x @ W^T`, `W` the program's weight of index `weight`.
    Matmul { x: usize, weight: usize, precision: Precision },
    /// `v / sqrt(mean(v^2) + eps) * (w + offset)` over each run of `group` values.
    RmsNorm { x: usize, weight: Option<usize>, offset: f32, group: u32, eps: f32 },
    /// `a + b`.
    Add(usize, usize),
    /// `a * b`.
    Mul(usize, usize),
    /// `x + b` on every row.
    Bias { x: usize, weight: usize },
    /// `x * by`.
    Scale { x: usize, by: f32 },
    /// `act(gate) * up`.
    Gated { gate: usize, up: usize, act: Activation },
    /// A rotary embedding of each head of `x` by the rows of `table`.
    Rotate { x: usize, table: usize, head_dim: u32, rotation: Rotation },
    /// Each sequence's rows of `k` and `v` to its cache `cache`.
    CacheWrite { k: usize, v: usize, cache: u32 },
    /// Causal grouped-query attention of each sequence's rows of `q` over its cache `cache`.
    Attention { q: usize, cache: u32, n_head: u32, n_head_kv: u32, head_dim: u32, window: u32, scale: f32, precision: Precision },
    /// The last token row of each sequence.
    LastRows(usize),
    /// Returns a value.
    Output(usize),
    /// Returns the top `k` of each row of a value.
    TopK { x: usize, k: u32 },
}

impl Op {
    /// The values the op reads.
    fn operands(&self) -> Vec<usize> {
        match *self {
            Op::Input { .. } => vec![],
            Op::Matmul { x, .. } | Op::RmsNorm { x, .. } | Op::Bias { x, .. } | Op::Scale { x, .. } => vec![x],
            Op::LastRows(x) | Op::Output(x) | Op::TopK { x, .. } => vec![x],
            Op::Add(a, b) | Op::Mul(a, b) => vec![a, b],
            Op::Gated { gate, up, .. } => vec![gate, up],
            Op::Rotate { x, table, .. } => vec![x, table],
            Op::CacheWrite { k, v, .. } => vec![k, v],
            Op::Attention { q, .. } => vec![q],
        }
    }
}

/// Which rows a value has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// One for each row of the batch.
    Token,
    /// One for each sequence.
    Sequence,
}

/// The shape of a value: its kind of rows and its width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Token or sequence rows.
    pub rows: Rows,
    /// Values a row.
    pub width: u32,
}

/// A weight a program names, as [`super::GpuCtx`] resolved it when the program was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightRef {
    /// The rep of its handle: a run checks that it still names this weight.
    pub rep: u32,
    /// The backend's buffer.
    pub id: BufferId,
    /// `n_out`.
    pub rows: u32,
    /// `n_in`.
    pub cols: u32,
    /// Its upload format.
    pub format: Format,
}

/// What a program's ops ask of the caches of one cache index.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CacheUse {
    /// The width of its rows (every op using the index agrees).
    pub width: Option<u32>,
    /// Whether an op writes it.
    pub written: bool,
    /// The windows of the attention ops reading it (0: none).
    pub windows: Vec<u32>,
}

/// A checked program: every operand names an earlier value, every shape chains.
#[derive(Debug, Clone)]
pub struct Program {
    /// The ops, as the guest sent them.
    pub ops: Vec<Op>,
    /// The weights the ops name by index.
    pub weights: Vec<WeightRef>,
    /// The value of each op (`None` for the ops that make none).
    pub shapes: Vec<Option<Shape>>,
    /// The widths of the `input` ops, in order.
    pub inputs: Vec<u32>,
    /// What the ops ask of each cache index.
    pub caches: Vec<CacheUse>,
    /// The index of the last op reading each value (the op itself where none does).
    pub last_use: Vec<usize>,
}

/// One sequence of a run, its caches resolved: `(id, slots, width)` for each cache index.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceRun {
    /// Token rows, at least 1.
    pub rows: u32,
    /// The position of the first.
    pub start: u32,
    /// `(id, slots, width)` of the cache of each cache index.
    pub caches: Vec<(BufferId, u32, u32)>,
}

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

/// Checks `ops` over `weights` with `caches` cache indices. The error says which op breaks
/// which rule.
pub fn check(ops: Vec<Op>, weights: Vec<WeightRef>, caches: u32) -> Result<Program, String> {
    if ops.is_empty() || ops.len() > MAX_OPS {
        return Err(format!("{} ops: a program has 1 to {MAX_OPS}", ops.len()));
    }
    if caches > MAX_CACHES {
        return Err(format!("{caches} cache indices: a program has at most {MAX_CACHES}"));
    }
    let mut p = Program {
        shapes: Vec::with_capacity(ops.len()),
        inputs: Vec::new(),
        caches: vec![CacheUse::default(); caches as usize],
        last_use: (0..ops.len()).collect(),
        weights,
        ops: Vec::new(),
    };
    let mut outputs = 0;
    for (i, op) in ops.iter().enumerate() {
        let shape = p.shape_of(i, op).map_err(|why| format!("op {i} ({}): {why}", name(op)))?;
        for a in op.operands() {
            p.last_use[a] = i;
        }
        if matches!(op, Op::Output(_) | Op::TopK { .. }) {
            outputs += 1;
        }
        p.shapes.push(shape);
    }
    if outputs == 0 {
        return Err("the program outputs nothing: it has no `output` or `top-k` op".into());
    }
    p.ops = ops;
    Ok(p)
}

/// The op's WIT name, for errors.
fn name(op: &Op) -> &'static str {
    match op {
        Op::Input { .. } => "input",
        Op::Matmul { .. } => "matmul",
        Op::RmsNorm { .. } => "rms-norm",
        Op::Add(..) => "add",
        Op::Mul(..) => "mul",
        Op::Bias { .. } => "bias",
        Op::Scale { .. } => "scale",
        Op::Gated { .. } => "gated",
        Op::Rotate { .. } => "rotate",
        Op::CacheWrite { .. } => "cache-write",
        Op::Attention { .. } => "attention",
        Op::LastRows(_) => "last-rows",
        Op::Output(_) => "output",
        Op::TopK { .. } => "top-k",
    }
}

impl Program {
    /// The value of operand `a` of op `i`.
    fn value(&self, i: usize, a: usize) -> Result<Shape, String> {
        if a >= i {
            return Err(format!("reads value {a}, which no earlier op made"));
        }
        self.shapes[a].ok_or_else(|| format!("reads value {a}, but op {a} ({}) makes none", name(&self.op_at(a))))
    }

    /// Op `a` while the program is being checked (`ops` is filled at the end).
    fn op_at(&self, a: usize) -> Op {
        self.ops.get(a).copied().unwrap_or(Op::Output(a))
    }

    /// A token-row operand.
    fn tokens(&self, i: usize, a: usize) -> Result<Shape, String> {
        let s = self.value(i, a)?;
        if s.rows != Rows::Token {
            return Err(format!("value {a} has sequence rows; the op needs token rows"));
        }
        Ok(s)
    }

    /// The weight of index `w`, `[rows, cols]` where given, an `f32` vector with `vector`.
    fn weight(&self, w: usize, rows: Option<u32>, cols: u32, vector: bool) -> Result<WeightRef, String> {
        let r = *self.weights.get(w).ok_or_else(|| format!("weight {w} of {}", self.weights.len()))?;
        if vector && r.format != Format::F32 {
            return Err(format!("weight {w} is {}; a vector must be f32", r.format.name()));
        }
        if rows.is_some_and(|n| n != r.rows) || r.cols != cols {
            let want = rows.map_or("n".to_string(), |n| n.to_string());
            return Err(format!("weight {w} is [{}, {}]; the op needs [{want}, {cols}]", r.rows, r.cols));
        }
        Ok(r)
    }

    /// Records that an op uses cache `c` with rows of `width`.
    fn use_cache(&mut self, c: u32, width: u32) -> Result<&mut CacheUse, String> {
        let n = self.caches.len();
        let u = self.caches.get_mut(c as usize).ok_or_else(|| format!("cache {c} of {n}"))?;
        match u.width {
            Some(w) if w != width => return Err(format!("cache {c} holds rows of {w}, this op's are {width}")),
            _ => u.width = Some(width),
        }
        Ok(u)
    }

    /// The shape of op `i`'s value, or why the op breaks the contract.
    fn shape_of(&mut self, i: usize, op: &Op) -> Result<Option<Shape>, String> {
        let same = |a: Shape, b: Shape| {
            if a == b { Ok(Some(a)) } else { Err(format!("operands of different shapes: {a:?} and {b:?}")) }
        };
        Ok(match *op {
            Op::Input { width } => {
                if width == 0 || width > MAX_WIDTH {
                    return Err(format!("width {width} is outside 1..={MAX_WIDTH}"));
                }
                self.inputs.push(width);
                Some(Shape { rows: Rows::Token, width })
            }
            Op::Matmul { x, weight, .. } => {
                let s = self.value(i, x)?;
                let w = self.weight(weight, None, s.width, false)?;
                Some(Shape { rows: s.rows, width: w.rows })
            }
            Op::RmsNorm { x, weight, group, .. } => {
                let s = self.value(i, x)?;
                if group == 0 || s.width % group != 0 {
                    return Err(format!("group {group} does not divide the width {}", s.width));
                }
                if let Some(w) = weight {
                    self.weight(w, Some(1), group, true)?;
                }
                Some(s)
            }
            Op::Add(a, b) | Op::Mul(a, b) => same(self.value(i, a)?, self.value(i, b)?)?,
            Op::Bias { x, weight } => {
                let s = self.value(i, x)?;
                self.weight(weight, Some(1), s.width, true)?;
                Some(s)
            }
            Op::Scale { x, .. } => Some(self.value(i, x)?),
            Op::Gated { gate, up, .. } => same(self.value(i, gate)?, self.value(i, up)?)?,
            Op::Rotate { x, table, head_dim, .. } => {
                let s = self.tokens(i, x)?;
                let t = self.tokens(i, table)?;
                if head_dim < 2 || head_dim % 2 != 0 || head_dim > MAX_HEAD_DIM || s.width % head_dim != 0 {
                    return Err(format!("head-dim {head_dim} is not even within 2..={MAX_HEAD_DIM} or does not divide the width {}", s.width));
                }
                if t.width % 2 != 0 || t.width > head_dim {
                    return Err(format!("a table of width {} for heads of {head_dim}: it must be even and at most a head", t.width));
                }
                Some(s)
            }
            Op::CacheWrite { k, v, cache } => {
                let (ks, vs) = (self.tokens(i, k)?, self.tokens(i, v)?);
                if ks != vs {
                    return Err(format!("keys of width {} and values of width {}", ks.width, vs.width));
                }
                self.use_cache(cache, ks.width)?.written = true;
                None
            }
            Op::Attention { q, cache, n_head, n_head_kv, head_dim, window, .. } => {
                let s = self.tokens(i, q)?;
                if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
                    return Err(format!("{n_head} query heads cannot share {n_head_kv} key/value heads"));
                }
                if head_dim == 0 || head_dim > MAX_HEAD_DIM {
                    return Err(format!("head-dim {head_dim} is outside 1..={MAX_HEAD_DIM}"));
                }
                if s.width as u64 != n_head as u64 * head_dim as u64 {
                    return Err(format!("q has width {}, {n_head} heads of {head_dim} need {}", s.width, n_head as u64 * head_dim as u64));
                }
                let width = n_head_kv.checked_mul(head_dim).ok_or("the key width overflows")?;
                let u = self.use_cache(cache, width)?;
                if !u.windows.contains(&window) {
                    u.windows.push(window);
                }
                Some(s)
            }
            Op::LastRows(x) => {
                let s = self.tokens(i, x)?;
                Some(Shape { rows: Rows::Sequence, width: s.width })
            }
            Op::Output(x) => {
                self.value(i, x)?;
                None
            }
            Op::TopK { x, k } => {
                let s = self.value(i, x)?;
                if k == 0 || k > MAX_TOP_K || k > s.width {
                    return Err(format!("k {k} is outside 1..={} for rows of {}", MAX_TOP_K.min(s.width), s.width));
                }
                None
            }
        })
    }

    /// Checks a run's inputs and batch against the program: the error says what does not fit.
    /// `live` says whether a weight's rep still names its id; `max_elems` is the device's limit
    /// of values in one list.
    pub fn check_batch(
        &self,
        inputs: &[Vec<f32>],
        batch: &[SequenceRun],
        live: impl Fn(&WeightRef) -> bool,
        max_elems: u64,
    ) -> Result<(), GpuError> {
        let invalid = |m: String| Err(GpuError::InvalidArgument(m));
        if let Some((i, _)) = self.weights.iter().enumerate().find(|(_, w)| !live(w)) {
            return invalid(format!("weight {i} of the program was dropped"));
        }
        if batch.is_empty() || batch.len() > MAX_SEQUENCES {
            return invalid(format!("a batch of {} sequences: 1 to {MAX_SEQUENCES}", batch.len()));
        }
        let mut rows = 0u64;
        let mut seen = std::collections::HashSet::new();
        for (s, q) in batch.iter().enumerate() {
            if q.rows == 0 || q.start.checked_add(q.rows).is_none() {
                return invalid(format!("sequence {s}: {} rows from position {}", q.rows, q.start));
            }
            if q.caches.len() != self.caches.len() {
                return invalid(format!("sequence {s} brings {} caches; the program has {} cache indices", q.caches.len(), self.caches.len()));
            }
            for (c, (&(id, slots, width), u)) in q.caches.iter().zip(&self.caches).enumerate() {
                if !seen.insert(id) {
                    return invalid(format!("sequence {s}: cache {c} appears twice in the batch"));
                }
                if u.width.is_some_and(|w| w != width) {
                    return invalid(format!("sequence {s}: cache {c} has rows of {width}; the program's are {}", u.width.unwrap_or(0)));
                }
                let mut span = if u.written { q.rows as u64 } else { 0 };
                for &w in &u.windows {
                    span = span.max(q.start as u64 + q.rows as u64 - first_key(q.start, w) as u64);
                }
                if span > slots as u64 {
                    return invalid(format!("sequence {s}: {span} positions of cache {c} do not fit its {slots} slots"));
                }
            }
            rows += q.rows as u64;
        }
        if inputs.len() != self.inputs.len() {
            return invalid(format!("{} inputs for {} input ops", inputs.len(), self.inputs.len()));
        }
        for (j, (x, &w)) in inputs.iter().zip(&self.inputs).enumerate() {
            if x.len() as u64 != rows * w as u64 {
                return invalid(format!("input {j} has {} values; {rows} rows of {w} need {}", x.len(), rows * w as u64));
            }
        }
        for (i, s) in self.shapes.iter().enumerate() {
            let Some(s) = s else { continue };
            let n = s.width as u64 * if s.rows == Rows::Token { rows } else { batch.len() as u64 };
            if n > max_elems {
                return Err(GpuError::OutOfMemory(format!("value {i} of {n} values exceeds the device's limit of {max_elems}")));
            }
        }
        Ok(())
    }
}

/// The first position a query at `p` sees with `window` (0: none).
pub fn first_key(p: u32, window: u32) -> u32 {
    if window == 0 { 0 } else { (p + 1).saturating_sub(window) }
}

/// Runs a checked program over a checked batch (see [`Program::check_batch`]) on `backend`.
/// `vectors` holds the values of the program's vector weights (`f32` weights of one row) by
/// weight index, and nothing for the others.
pub fn run(
    p: &Program,
    backend: &mut dyn Backend,
    vectors: &[&[f32]],
    mut inputs: Vec<Vec<f32>>,
    batch: &[SequenceRun],
) -> Result<Vec<Output>, GpuError> {
    let total: u32 = batch.iter().map(|q| q.rows).sum();
    let mut values: Vec<Vec<f32>> = vec![Vec::new(); p.ops.len()];
    let mut outputs = Vec::new();
    let mut next_input = 0;
    for (i, op) in p.ops.iter().enumerate() {
        let rows_of = |a: usize| match p.shapes[a].map(|s| s.rows) {
            Some(Rows::Sequence) => batch.len() as u32,
            _ => total,
        };
        let width = |a: usize| p.shapes[a].map_or(0, |s| s.width) as usize;
        let made = match *op {
            Op::Input { .. } => {
                next_input += 1;
                Some(std::mem::take(&mut inputs[next_input - 1]))
            }
            Op::Matmul { x, weight, .. } => {
                let w = &p.weights[weight];
                backend.matmul(&values[x], rows_of(x), w.cols, &[w.id])?.pop()
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
            Op::Gated { gate, up, act } => Some(values[gate].iter().zip(&values[up]).map(|(&g, &u)| act.apply(g) * u).collect()),
            Op::Rotate { x, table, head_dim, rotation } => {
                let mut y = values[x].clone();
                rotate(&mut y, width(x), &values[table], width(table), head_dim as usize, rotation);
                Some(y)
            }
            Op::CacheWrite { k, v, cache } => {
                let w = width(k);
                let mut at = 0;
                for q in batch {
                    let (id, _, _) = q.caches[cache as usize];
                    let n = q.rows as usize * w;
                    backend.write_cache(id, q.start, &values[k][at..at + n], &values[v][at..at + n])?;
                    at += n;
                }
                None
            }
            Op::Attention { q: qv, cache, n_head, n_head_kv, head_dim, window, scale, .. } => {
                let w = width(qv);
                let mut out = Vec::with_capacity(values[qv].len());
                let mut at = 0;
                for q in batch {
                    let (id, _, _) = q.caches[cache as usize];
                    let first = first_key(q.start, window);
                    let shape = AttentionShape {
                        t: q.rows,
                        n_keys: q.start + q.rows - first,
                        n_head,
                        n_head_kv,
                        head_dim,
                        window,
                        scale,
                    };
                    let n = q.rows as usize * w;
                    out.extend(backend.attention_cached(&values[qv][at..at + n], &[], &[], 0, id, first, &shape)?);
                    at += n;
                }
                Some(out)
            }
            Op::LastRows(x) => {
                let w = width(x);
                let mut out = Vec::with_capacity(batch.len() * w);
                let mut end = 0;
                for q in batch {
                    end += q.rows as usize * w;
                    out.extend_from_slice(&values[x][end - w..end]);
                }
                Some(out)
            }
            Op::Output(x) => {
                let v = if p.last_use[x] == i { std::mem::take(&mut values[x]) } else { values[x].clone() };
                outputs.push(Output::Rows(v));
                None
            }
            Op::TopK { x, k } => {
                outputs.push(top_k(&values[x], width(x), k as usize));
                None
            }
        };
        if let Some(v) = made {
            values[i] = v;
        }
        for a in op.operands() {
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
        let k = 1.0 / (ms + eps as f64).sqrt();
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
/// the wgpu host's `top_k_chunks` writes them): one pass a row, a candidate entering the `k`
/// kept (in order) only where it ranks above the last of them.
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

    fn w(rep: u32, rows: u32, cols: u32) -> WeightRef {
        WeightRef { rep, id: rep as u64, rows, cols, format: Format::F32 }
    }

    #[test]
    fn operands_must_name_earlier_values_that_exist() {
        let e = check(vec![Op::Input { width: 4 }, Op::Output(1)], vec![], 0).unwrap_err();
        assert!(e.contains("op 1 (output): reads value 1"), "{e}");
        let e = check(vec![Op::Input { width: 4 }, Op::Output(0), Op::Output(1)], vec![], 0).unwrap_err();
        assert!(e.contains("op 1 (output) makes none"), "{e}");
    }

    #[test]
    fn shapes_must_chain() {
        let ops = vec![Op::Input { width: 4 }, Op::Matmul { x: 0, weight: 0, precision: Precision::Exact }, Op::Output(1)];
        assert!(check(ops.clone(), vec![w(1, 8, 4)], 0).is_ok());
        let e = check(ops, vec![w(1, 8, 5)], 0).unwrap_err();
        assert!(e.contains("[8, 5]"), "{e}");
        let e = check(vec![Op::Input { width: 4 }, Op::LastRows(0), Op::Add(0, 1), Op::Output(2)], vec![], 0).unwrap_err();
        assert!(e.contains("different shapes"), "{e}");
        let e = check(vec![Op::Input { width: 4 }, Op::LastRows(0), Op::LastRows(1), Op::Output(2)], vec![], 0).unwrap_err();
        assert!(e.contains("token rows"), "{e}");
    }

    #[test]
    fn top_k_orders_by_value_then_index_with_nan_last() {
        let x = [1.0, f32::NAN, 3.0, 3.0, -1.0, 2.0];
        let Output::Top { values, indices } = top_k(&x, 6, 4) else { unreachable!() };
        assert_eq!(indices, [2, 3, 5, 0]);
        assert_eq!(values, [3.0, 3.0, 2.0, 1.0]);
        let Output::Top { indices, .. } = top_k(&x, 6, 6) else { unreachable!() };
        assert_eq!(indices, [2, 3, 5, 0, 4, 1]);
    }
}
