//! Programs: ops checked once, when a program is made ([`check`]), so that a run checks only its
//! batch ([`Program::check_batch`]).
//!
//! A value is a matrix of f32 of one of two kinds of rows: token rows (one for each token row
//! of the batch) and sequence rows (one for each sequence: its last token's, after
//! `last-rows`). Every rule here is one of `wit/gpu.wit`'s; the errors say which op breaks which
//! rule ([`CheckError`]).

use crate::format::Format;
use crate::op::Op;
use alloc::collections::BTreeSet;
use alloc::format;
use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;
use core::fmt;

/// Ops in one program, at most.
pub const MAX_OPS: usize = 65536;
/// Cache indices of one program, at most.
pub const MAX_CACHES: u32 = 1024;
/// Sequences in one run, at most.
pub const MAX_SEQUENCES: usize = 4096;
/// The largest `k` of a `top-k` op.
pub const MAX_TOP_K: u32 = 1024;
/// The widest value (2^31).
pub const MAX_WIDTH: u32 = 1 << 31;
/// The widest head an `attention` or `rotate` op accepts.
pub const MAX_HEAD_DIM: u32 = 512;

/// Which rows a value has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// One for each token row of the batch.
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

/// What the checks need of a weight a program names.
pub trait Weight {
    /// `[rows, cols]`: `[n_out, n_in]` of a matrix, `[1, n]` of a vector.
    fn dims(&self) -> (u32, u32);
    /// Its upload format, where it has one (`None`: a guest's weight in a format that no upload
    /// format holds, which only the guest's own kernels read).
    fn format(&self) -> Option<Format>;
}

/// A weight as the checks see it: its dimensions and format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightShape {
    /// `n_out` (1 for a vector).
    pub rows: u32,
    /// `n_in`.
    pub cols: u32,
    /// See [`Weight::format`].
    pub format: Option<Format>,
}

impl Weight for WeightShape {
    fn dims(&self) -> (u32, u32) {
        (self.rows, self.cols)
    }

    fn format(&self) -> Option<Format> {
        self.format
    }
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

/// A checked program: every operand names an earlier value, every shape chains, every weight
/// fits its op and every cache index is used with one width.
#[derive(Debug, Clone)]
pub struct Program<W> {
    /// The ops, as made.
    pub ops: Vec<Op>,
    /// The weights the ops name by index.
    pub weights: Vec<W>,
    /// The value of each op (`None` for the ops that make none).
    pub shapes: Vec<Option<Shape>>,
    /// The `input` ops, in order.
    pub inputs: Vec<usize>,
    /// The values the `output` and `top-k` ops return, in order.
    pub outputs: Vec<usize>,
    /// What the ops ask of each cache index.
    pub caches: Vec<CacheUse>,
    /// The index of the last op reading each value (the op itself where none does).
    pub last_use: Vec<usize>,
    /// Whether each op is needed to fill the caches: a run that wants no outputs needs those
    /// alone.
    pub feeds_caches: Vec<bool>,
}

impl<W> Default for Program<W> {
    /// A program of no ops, a placeholder until one is made (it runs nothing: [`check`] makes
    /// none without an output).
    fn default() -> Self {
        Program {
            ops: Vec::new(),
            weights: Vec::new(),
            shapes: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            caches: Vec::new(),
            last_use: Vec::new(),
            feeds_caches: Vec::new(),
        }
    }
}

impl<W> Program<W> {
    /// The width of value `v` (0 for an op that makes none).
    pub fn width(&self, v: usize) -> usize {
        self.shapes[v].map_or(0, |s| s.width as usize)
    }

    /// The kind of rows of value `v` (token rows for an op that makes none).
    pub fn rows(&self, v: usize) -> Rows {
        self.shapes[v].map_or(Rows::Token, |s| s.rows)
    }

    /// The widths of the `input` ops, in order.
    pub fn input_widths(&self) -> impl Iterator<Item = u32> + '_ {
        self.inputs.iter().map(|&i| self.shapes[i].map_or(0, |s| s.width))
    }
}

/// A rule of the contract that an op (or the whole program) breaks.
#[derive(Debug, Clone, PartialEq)]
pub enum Rule {
    /// A program has 1 to [`MAX_OPS`] ops.
    OpCount(usize),
    /// A program has at most [`MAX_CACHES`] cache indices.
    CacheCount(u32),
    /// A program outputs something.
    NoOutput,
    /// An operand names a later value (or the op itself).
    NotYetMade(usize),
    /// An operand names an op that makes no value.
    MakesNone {
        /// The value read.
        value: usize,
        /// The name of the op that made nothing.
        maker: &'static str,
    },
    /// The op needs token rows.
    NeedsTokenRows(usize),
    /// The weight index is past the program's weights.
    NoWeight {
        /// The index.
        index: usize,
        /// The program's weights.
        count: usize,
    },
    /// A vector (norm weight, bias) must be f32.
    VectorNotF32 {
        /// The weight's index.
        index: usize,
        /// Its format's name.
        format: &'static str,
    },
    /// The weight's dimensions do not fit the op.
    WeightDims {
        /// The weight's index.
        index: usize,
        /// Its dimensions.
        dims: (u32, u32),
        /// The rows the op needs (any where `None`).
        rows: Option<u32>,
        /// The columns the op needs.
        cols: u32,
    },
    /// The cache index is past the program's.
    NoCache {
        /// The index.
        index: u32,
        /// The program's cache indices.
        count: usize,
    },
    /// Two ops use one cache index with rows of two widths.
    CacheWidth {
        /// The index.
        cache: u32,
        /// The width an earlier op set.
        holds: u32,
        /// This op's.
        wants: u32,
    },
    /// An input is 1 to [`MAX_WIDTH`] wide.
    Width(u32),
    /// A norm's group divides the width.
    Group {
        /// The group.
        group: u32,
        /// The width.
        width: u32,
    },
    /// The two operands have different shapes.
    DifferentShapes(Shape, Shape),
    /// A rotation's head width is even, 2 to [`MAX_HEAD_DIM`], and divides the width.
    RotateHeadDim {
        /// The head width.
        head_dim: u32,
        /// The rows' width.
        width: u32,
    },
    /// A rotation table's width is even and at most a head.
    Table {
        /// The table's width.
        width: u32,
        /// The head width.
        head_dim: u32,
    },
    /// Keys and values of one width.
    KeysValues(u32, u32),
    /// Query heads share key/value heads evenly.
    Heads {
        /// Query heads.
        n_head: u32,
        /// Key/value heads.
        n_head_kv: u32,
    },
    /// An attention's head is 1 to [`MAX_HEAD_DIM`] wide.
    HeadDim(u32),
    /// The queries' width is the heads'.
    QueryWidth {
        /// The width of `q`.
        width: u32,
        /// Query heads.
        n_head: u32,
        /// Head width.
        head_dim: u32,
    },
    /// The key width overflows u32.
    KeyWidth,
    /// A soft cap is a finite positive number (an attention's may be 0, for none).
    Softcap(f32),
    /// `k` is 1 to [`MAX_TOP_K`] and at most the width.
    TopK {
        /// The `k`.
        k: u32,
        /// The rows' width.
        width: u32,
    },
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Rule::OpCount(n) => write!(f, "{n} ops: a program has 1 to {MAX_OPS}"),
            Rule::CacheCount(n) => write!(f, "{n} cache indices: a program has at most {MAX_CACHES}"),
            Rule::NoOutput => write!(f, "the program outputs nothing: it has no `output` or `top-k` op"),
            Rule::NotYetMade(a) => write!(f, "reads value {a}, which no earlier op made"),
            Rule::MakesNone { value, maker } => write!(f, "reads value {value}, but op {value} ({maker}) makes none"),
            Rule::NeedsTokenRows(a) => write!(f, "value {a} has sequence rows; the op needs token rows"),
            Rule::NoWeight { index, count } => write!(f, "weight {index} of {count}"),
            Rule::VectorNotF32 { index, format } => write!(f, "weight {index} is {format}; a vector must be f32"),
            Rule::WeightDims { index, dims, rows, cols } => {
                write!(f, "weight {index} is [{}, {}]; the op needs [", dims.0, dims.1)?;
                match rows {
                    Some(n) => write!(f, "{n}, {cols}]"),
                    None => write!(f, "n, {cols}]"),
                }
            }
            Rule::NoCache { index, count } => write!(f, "cache {index} of {count}"),
            Rule::CacheWidth { cache, holds, wants } => write!(f, "cache {cache} holds rows of {holds}, this op's are {wants}"),
            Rule::Width(w) => write!(f, "width {w} is outside 1..={MAX_WIDTH}"),
            Rule::Group { group, width } => write!(f, "group {group} does not divide the width {width}"),
            Rule::DifferentShapes(a, b) => write!(f, "operands of different shapes: {a:?} and {b:?}"),
            Rule::RotateHeadDim { head_dim, width } => {
                write!(f, "head-dim {head_dim} is not even within 2..={MAX_HEAD_DIM} or does not divide the width {width}")
            }
            Rule::Table { width, head_dim } => {
                write!(f, "a table of width {width} for heads of {head_dim}: it must be even and at most a head")
            }
            Rule::KeysValues(k, v) => write!(f, "keys of width {k} and values of width {v}"),
            Rule::Heads { n_head, n_head_kv } => write!(f, "{n_head} query heads cannot share {n_head_kv} key/value heads"),
            Rule::HeadDim(d) => write!(f, "head-dim {d} is outside 1..={MAX_HEAD_DIM}"),
            Rule::QueryWidth { width, n_head, head_dim } => {
                write!(f, "q has width {width}, {n_head} heads of {head_dim} need {}", n_head as u64 * head_dim as u64)
            }
            Rule::KeyWidth => write!(f, "the key width overflows"),
            Rule::Softcap(cap) => write!(f, "soft cap {cap} is not a finite positive number"),
            Rule::TopK { k, width } => write!(f, "k {k} is outside 1..={} for rows of {width}", MAX_TOP_K.min(width)),
        }
    }
}

/// Why ops do not make a program: the op (its index and WIT name) and the rule it breaks, or the
/// rule the whole program breaks.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckError {
    /// The op's index and name, where one op breaks the rule.
    pub op: Option<(usize, &'static str)>,
    /// The rule.
    pub rule: Rule,
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.op {
            Some((i, name)) => write!(f, "op {i} ({name}): {}", self.rule),
            None => write!(f, "{}", self.rule),
        }
    }
}

impl core::error::Error for CheckError {}

/// Checks `ops` over `weights` with `caches` cache indices.
pub fn check<W: Weight>(ops: Vec<Op>, weights: Vec<W>, caches: u32) -> Result<Program<W>, CheckError> {
    let whole = |rule| CheckError { op: None, rule };
    if ops.is_empty() || ops.len() > MAX_OPS {
        return Err(whole(Rule::OpCount(ops.len())));
    }
    if caches > MAX_CACHES {
        return Err(whole(Rule::CacheCount(caches)));
    }
    let n = ops.len();
    let mut c = Checker { shapes: Vec::with_capacity(n), ops: &ops, weights: &weights, caches: vec![CacheUse::default(); caches as usize] };
    let (mut inputs, mut outputs) = (Vec::new(), Vec::new());
    let mut last_use: Vec<usize> = (0..n).collect();
    for (i, op) in ops.iter().enumerate() {
        let shape = c.shape_of(i, op).map_err(|rule| CheckError { op: Some((i, op.name())), rule })?;
        for &a in &op.operands() {
            last_use[a] = i;
        }
        match *op {
            Op::Input { .. } => inputs.push(i),
            Op::Output(x) | Op::TopK { x, .. } => outputs.push(x),
            _ => {}
        }
        c.shapes.push(shape);
    }
    if outputs.is_empty() {
        return Err(whole(Rule::NoOutput));
    }
    let mut feeds_caches = vec![false; n];
    for i in (0..n).rev() {
        if matches!(ops[i], Op::CacheWrite { .. }) || feeds_caches[i] {
            feeds_caches[i] = true;
            for &a in &ops[i].operands() {
                feeds_caches[a] = true;
            }
        }
    }
    let (shapes, caches) = (c.shapes, c.caches);
    Ok(Program { ops, weights, shapes, inputs, outputs, caches, last_use, feeds_caches })
}

/// The state of [`check`] while it walks the ops.
struct Checker<'a, W> {
    ops: &'a [Op],
    weights: &'a [W],
    shapes: Vec<Option<Shape>>,
    caches: Vec<CacheUse>,
}

impl<W: Weight> Checker<'_, W> {
    /// The value of operand `a` of op `i`.
    fn value(&self, i: usize, a: usize) -> Result<Shape, Rule> {
        if a >= i {
            return Err(Rule::NotYetMade(a));
        }
        self.shapes[a].ok_or(Rule::MakesNone { value: a, maker: self.ops[a].name() })
    }

    /// A token-row operand.
    fn tokens(&self, i: usize, a: usize) -> Result<Shape, Rule> {
        let s = self.value(i, a)?;
        if s.rows != Rows::Token {
            return Err(Rule::NeedsTokenRows(a));
        }
        Ok(s)
    }

    /// The weight of index `w`, `[rows, cols]` where `rows` is given, an f32 vector with
    /// `vector`.
    fn weight(&self, w: usize, rows: Option<u32>, cols: u32, vector: bool) -> Result<(u32, u32), Rule> {
        let r = self.weights.get(w).ok_or(Rule::NoWeight { index: w, count: self.weights.len() })?;
        let format = r.format();
        if vector && format != Some(Format::F32) {
            return Err(Rule::VectorNotF32 { index: w, format: format.map_or("in a guest-only format", Format::name) });
        }
        let dims = r.dims();
        if rows.is_some_and(|n| n != dims.0) || dims.1 != cols {
            return Err(Rule::WeightDims { index: w, dims, rows, cols });
        }
        Ok(dims)
    }

    /// Records that an op uses cache `c` with rows of `width`.
    fn use_cache(&mut self, c: u32, width: u32) -> Result<&mut CacheUse, Rule> {
        let count = self.caches.len();
        let u = self.caches.get_mut(c as usize).ok_or(Rule::NoCache { index: c, count })?;
        match u.width {
            Some(holds) if holds != width => return Err(Rule::CacheWidth { cache: c, holds, wants: width }),
            _ => u.width = Some(width),
        }
        Ok(u)
    }

    /// The shape of op `i`'s value, or the rule the op breaks.
    fn shape_of(&mut self, i: usize, op: &Op) -> Result<Option<Shape>, Rule> {
        let same = |a: Shape, b: Shape| if a == b { Ok(Some(a)) } else { Err(Rule::DifferentShapes(a, b)) };
        Ok(match *op {
            Op::Input { width } => {
                if width == 0 || width > MAX_WIDTH {
                    return Err(Rule::Width(width));
                }
                Some(Shape { rows: Rows::Token, width })
            }
            Op::Matmul { x, weight, .. } => {
                let s = self.value(i, x)?;
                let (rows, _) = self.weight(weight, None, s.width, false)?;
                Some(Shape { rows: s.rows, width: rows })
            }
            Op::RmsNorm { x, weight, group, .. } => {
                let s = self.value(i, x)?;
                if group == 0 || s.width % group != 0 {
                    return Err(Rule::Group { group, width: s.width });
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
            Op::Softcap { x, cap } => {
                let s = self.value(i, x)?;
                if !(cap.is_finite() && cap > 0.0) {
                    return Err(Rule::Softcap(cap));
                }
                Some(s)
            }
            Op::Gated { gate, up, .. } => same(self.value(i, gate)?, self.value(i, up)?)?,
            Op::Rotate { x, table, head_dim, .. } => {
                let s = self.tokens(i, x)?;
                let t = self.tokens(i, table)?;
                if head_dim < 2 || head_dim % 2 != 0 || head_dim > MAX_HEAD_DIM || s.width % head_dim != 0 {
                    return Err(Rule::RotateHeadDim { head_dim, width: s.width });
                }
                if t.width % 2 != 0 || t.width > head_dim {
                    return Err(Rule::Table { width: t.width, head_dim });
                }
                Some(s)
            }
            Op::CacheWrite { k, v, cache } => {
                let (ks, vs) = (self.tokens(i, k)?, self.tokens(i, v)?);
                if ks != vs {
                    return Err(Rule::KeysValues(ks.width, vs.width));
                }
                self.use_cache(cache, ks.width)?.written = true;
                None
            }
            Op::Attention { q, cache, n_head, n_head_kv, head_dim, window, softcap, .. } => {
                let s = self.tokens(i, q)?;
                if !(softcap.is_finite() && softcap >= 0.0) {
                    return Err(Rule::Softcap(softcap));
                }
                if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
                    return Err(Rule::Heads { n_head, n_head_kv });
                }
                if head_dim == 0 || head_dim > MAX_HEAD_DIM {
                    return Err(Rule::HeadDim(head_dim));
                }
                if s.width as u64 != n_head as u64 * head_dim as u64 {
                    return Err(Rule::QueryWidth { width: s.width, n_head, head_dim });
                }
                let width = n_head_kv.checked_mul(head_dim).ok_or(Rule::KeyWidth)?;
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
                    return Err(Rule::TopK { k, width: s.width });
                }
                None
            }
        })
    }
}

/// `ops` less those that no `output`, `top-k`, `cache-write` or `input` needs, renumbered (the
/// inputs stay, so that a run's inputs are the same).
pub fn compact(ops: &[Op]) -> Vec<Op> {
    let mut needed: Vec<bool> = ops.iter().map(|op| op.is_output() || matches!(op, Op::CacheWrite { .. } | Op::Input { .. })).collect();
    for i in (0..ops.len()).rev() {
        if needed[i] {
            for &a in &ops[i].operands() {
                if let Some(n) = needed.get_mut(a) {
                    *n = true;
                }
            }
        }
    }
    let mut index = vec![usize::MAX; ops.len()];
    let mut out = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate().filter(|(i, _)| needed[*i]) {
        index[i] = out.len();
        out.push(op.map_values(|v| index.get(v).copied().unwrap_or(usize::MAX)));
    }
    out
}

/// One sequence of a run, its caches resolved by the executor: `(id, slots, width)` for each
/// cache index.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceRun {
    /// Token rows, at least 1.
    pub rows: u32,
    /// The position of the first.
    pub start: u32,
    /// `(id, slots, width)` of the cache of each cache index, the id the executor's.
    pub caches: Vec<(u64, u32, u32)>,
}

/// Why a run's inputs and batch do not fit its program.
#[derive(Debug, Clone, PartialEq)]
pub enum BatchError {
    /// The batch or the inputs break the contract (nothing is written).
    Invalid(String),
    /// A value of the run would exceed the device's limit of values in one list.
    TooLarge(String),
}

impl fmt::Display for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatchError::Invalid(m) | BatchError::TooLarge(m) => f.write_str(m),
        }
    }
}

impl<W> Program<W> {
    /// Checks a run's inputs and batch against the program: the error says what does not fit.
    /// `live` says whether each weight is still there; `max_elems` is the device's limit of
    /// values in one list.
    pub fn check_batch(&self, inputs: &[Vec<f32>], batch: &[SequenceRun], live: impl Fn(&W) -> bool, max_elems: u64) -> Result<(), BatchError> {
        let invalid = |m: String| Err(BatchError::Invalid(m));
        if let Some((i, _)) = self.weights.iter().enumerate().find(|(_, w)| !live(w)) {
            return invalid(format!("weight {i} of the program was dropped"));
        }
        if batch.is_empty() || batch.len() > MAX_SEQUENCES {
            return invalid(format!("a batch of {} sequences: 1 to {MAX_SEQUENCES}", batch.len()));
        }
        let mut rows = 0u64;
        let mut seen = BTreeSet::new();
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
                if let Some(w) = u.width.filter(|&w| w != width) {
                    return invalid(format!("sequence {s}: cache {c} has rows of {width}; the program's are {w}"));
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
        for (j, (x, w)) in inputs.iter().zip(self.input_widths()).enumerate() {
            if x.len() as u64 != rows * w as u64 {
                return invalid(format!("input {j} has {} values; {rows} rows of {w} need {}", x.len(), rows * w as u64));
            }
        }
        for (i, s) in self.shapes.iter().enumerate() {
            let Some(s) = s else { continue };
            let n = s.width as u64 * if s.rows == Rows::Token { rows } else { batch.len() as u64 };
            if n > max_elems {
                return Err(BatchError::TooLarge(format!("value {i} of {n} values exceeds the device's limit of {max_elems}")));
            }
        }
        Ok(())
    }
}

/// The first position a query at `p` sees with `window` (0: none).
pub fn first_key(p: u32, window: u32) -> u32 {
    if window == 0 { 0 } else { (p + 1).saturating_sub(window) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::Precision;
    use alloc::string::ToString;

    fn w(rows: u32, cols: u32) -> WeightShape {
        WeightShape { rows, cols, format: Some(Format::F32) }
    }

    fn err(ops: Vec<Op>, weights: Vec<WeightShape>, caches: u32) -> String {
        check(ops, weights, caches).unwrap_err().to_string()
    }

    #[test]
    fn operands_must_name_earlier_values_that_exist() {
        let e = err(vec![Op::Input { width: 4 }, Op::Output(1)], vec![], 0);
        assert!(e.contains("op 1 (output): reads value 1"), "{e}");
        let e = err(vec![Op::Input { width: 4 }, Op::Output(0), Op::Output(1)], vec![], 0);
        assert!(e.contains("op 1 (output) makes none"), "{e}");
    }

    #[test]
    fn shapes_must_chain() {
        let ops = vec![Op::Input { width: 4 }, Op::Matmul { x: 0, weight: 0, precision: Precision::Exact }, Op::Output(1)];
        let p = check(ops.clone(), vec![w(8, 4)], 0).unwrap();
        assert_eq!(p.shapes[1], Some(Shape { rows: Rows::Token, width: 8 }));
        assert_eq!((p.inputs.clone(), p.outputs.clone(), p.last_use.clone()), (vec![0], vec![1], vec![1, 2, 2]));
        let e = err(ops, vec![w(8, 5)], 0);
        assert!(e.contains("[8, 5]"), "{e}");
        let e = err(vec![Op::Input { width: 4 }, Op::LastRows(0), Op::Add(0, 1), Op::Output(2)], vec![], 0);
        assert!(e.contains("different shapes"), "{e}");
        let e = err(vec![Op::Input { width: 4 }, Op::LastRows(0), Op::LastRows(1), Op::Output(2)], vec![], 0);
        assert!(e.contains("token rows"), "{e}");
    }

    #[test]
    fn vectors_must_be_f32_rows_of_one() {
        let ops = vec![Op::Input { width: 4 }, Op::Bias { x: 0, weight: 0 }, Op::Output(1)];
        assert!(check(ops.clone(), vec![w(1, 4)], 0).is_ok());
        let e = check(ops.clone(), vec![WeightShape { rows: 1, cols: 4, format: Some(Format::Q8x32) }], 0).unwrap_err();
        assert_eq!(e.rule, Rule::VectorNotF32 { index: 0, format: "q8x32" });
        let e = check(ops, vec![w(2, 4)], 0).unwrap_err();
        assert_eq!(e.op, Some((1, "bias")));
    }

    #[test]
    fn a_cache_index_has_one_width_and_only_cache_feeding_ops_feed_caches() {
        let ops = vec![
            Op::Input { width: 8 },
            Op::Scale { x: 0, by: 2.0 },
            Op::CacheWrite { k: 1, v: 1, cache: 0 },
            Op::Attention { q: 0, cache: 0, n_head: 2, n_head_kv: 1, head_dim: 4, window: 0, scale: 1.0, softcap: 0.0, precision: Precision::Exact },
            Op::Output(3),
        ];
        let e = err(ops.clone(), vec![], 1);
        assert!(e.contains("cache 0 holds rows of 8, this op's are 4"), "{e}");
        let mut fits = ops;
        fits[3] = Op::Attention { q: 0, cache: 0, n_head: 2, n_head_kv: 2, head_dim: 4, window: 3, scale: 1.0, softcap: 0.0, precision: Precision::Exact };
        let p = check::<WeightShape>(fits, vec![], 1).unwrap();
        assert_eq!(p.caches[0], CacheUse { width: Some(8), written: true, windows: vec![3] });
        assert_eq!(p.feeds_caches, vec![true, true, true, false, false]);
    }

    #[test]
    fn soft_caps_are_finite_and_positive() {
        let capped = |cap| vec![Op::Input { width: 4 }, Op::Softcap { x: 0, cap }, Op::Output(1)];
        assert!(check::<WeightShape>(capped(30.0), vec![], 0).is_ok());
        for cap in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let e = check::<WeightShape>(capped(cap), vec![], 0).unwrap_err();
            assert_eq!((e.op, e.rule.to_string()), (Some((1, "softcap")), format!("soft cap {cap} is not a finite positive number")));
        }
        let attention = |softcap| {
            let a = Op::Attention { q: 0, cache: 0, n_head: 1, n_head_kv: 1, head_dim: 4, window: 0, scale: 1.0, softcap, precision: Precision::Exact };
            vec![Op::Input { width: 4 }, Op::CacheWrite { k: 0, v: 0, cache: 0 }, a, Op::Output(2)]
        };
        assert!(check::<WeightShape>(attention(0.0), vec![], 1).is_ok());
        assert!(check::<WeightShape>(attention(50.0), vec![], 1).is_ok());
        for cap in [-1.0, f32::NAN, f32::INFINITY] {
            let e = check::<WeightShape>(attention(cap), vec![], 1).unwrap_err();
            assert!(matches!(e.rule, Rule::Softcap(c) if c.to_bits() == cap.to_bits()), "{e}");
        }
    }

    #[test]
    fn a_batch_must_fit_its_caches_and_inputs() {
        let ops = vec![Op::Input { width: 2 }, Op::CacheWrite { k: 0, v: 0, cache: 0 }, Op::LastRows(0), Op::Output(2)];
        let p = check(ops, vec![w(1, 1)], 1).unwrap();
        let seq = |rows, caches| SequenceRun { rows, start: 0, caches };
        let ok = p.check_batch(&[vec![0.0; 6]], &[seq(1, vec![(1, 4, 2)]), seq(2, vec![(2, 4, 2)])], |_| true, 1 << 20);
        assert_eq!(ok, Ok(()));
        let twice = p.check_batch(&[vec![0.0; 4]], &[seq(1, vec![(1, 4, 2)]), seq(1, vec![(1, 4, 2)])], |_| true, 1 << 20);
        assert!(matches!(twice, Err(BatchError::Invalid(m)) if m.contains("appears twice")));
        let short = p.check_batch(&[vec![0.0; 5]], &[seq(3, vec![(1, 4, 2)])], |_| true, 1 << 20);
        assert!(matches!(short, Err(BatchError::Invalid(m)) if m.contains("input 0 has 5 values")));
        let full = p.check_batch(&[vec![0.0; 10]], &[seq(5, vec![(1, 4, 2)])], |_| true, 1 << 20);
        assert!(matches!(full, Err(BatchError::Invalid(m)) if m.contains("do not fit its 4 slots")));
        let dropped = p.check_batch(&[vec![0.0; 2]], &[seq(1, vec![(1, 4, 2)])], |_| false, 1 << 20);
        assert!(matches!(dropped, Err(BatchError::Invalid(m)) if m.contains("dropped")));
        let large = p.check_batch(&[vec![0.0; 2]], &[seq(1, vec![(1, 4, 2)])], |_| true, 1);
        assert!(matches!(large, Err(BatchError::TooLarge(_))));
    }

    #[test]
    fn compact_keeps_what_outputs_and_caches_need() {
        let ops = vec![
            Op::Input { width: 4 },
            Op::Scale { x: 0, by: 3.0 },
            Op::Scale { x: 0, by: 5.0 },
            Op::Output(2),
        ];
        assert_eq!(compact(&ops), vec![Op::Input { width: 4 }, Op::Scale { x: 0, by: 5.0 }, Op::Output(1)]);
    }
}
