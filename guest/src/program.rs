//! A model's recipe as a program of ops: the ops of `wisp:llm/gpu`'s `op` (wit/gpu.wit, from
//! 0.4), over values named by index. Each architecture builds its program once, at load
//! (`models::<arch>::recipe`), with a [`Builder`]; the guest's CPU runs it with its own kernels
//! ([`cpu`]), so that an architecture is written once: its config, its weights and its recipe.
//!
//! A value is a matrix of f32 of one of two kinds of rows, as in the WIT: token rows (one for
//! each token of the batch) and sequence rows (one for each sequence: the last token's, after
//! `last_rows`).

pub mod cpu;

use crate::kernels::Act;
use crate::models::Linear;
use crate::models::attention::Heads;

/// A value: the index of the op that made it.
pub type Value = usize;

/// A weight of the model, in the architecture's own numbering (its [`Tensors`] resolves it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WeightId(pub u32);

/// What a [`WeightId`] names: a matrix `W[n_out, n_in]`, or a vector (norm weights, a bias).
pub enum Tensor<'a> {
    Matrix(&'a Linear),
    Vector(&'a [f32]),
}

/// The weights of a model, as its program names them.
pub trait Tensors {
    /// The weight `id` names. A recipe only names weights its model has.
    fn tensor(&self, id: WeightId) -> Tensor<'_>;

    fn matrix(&self, id: WeightId) -> &Linear {
        match self.tensor(id) {
            Tensor::Matrix(m) => m,
            Tensor::Vector(_) => unreachable!("weight {id:?} is a vector where the recipe wants a matrix"),
        }
    }

    fn vector(&self, id: WeightId) -> &[f32] {
        match self.tensor(id) {
            Tensor::Vector(v) => v,
            Tensor::Matrix(_) => unreachable!("weight {id:?} is a matrix where the recipe wants a vector"),
        }
    }
}

/// Which values of a head a rotation turns together (the WIT `rotation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotation {
    /// `(h[j], h[j + r / 2])`: GPT-NeoX, Gemma, Qwen2.
    Halves,
    /// `(h[2j], h[2j + 1])`: Llama as converted to GGUF.
    Pairs,
}

/// One op (the WIT `op`; see wit/gpu.wit for the exact semantics of each).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    /// Token rows of `width` from the run's next input.
    Input { width: usize },
    /// `x @ W^T`.
    Matmul { x: Value, w: WeightId },
    /// `v / sqrt(mean(v^2) + eps) * w` over each run of `group` values (`w` all ones when
    /// `None`).
    RmsNorm { x: Value, w: Option<WeightId>, group: usize, eps: f32 },
    Add(Value, Value),
    Mul(Value, Value),
    /// `x + b` on every row.
    Bias { x: Value, w: WeightId },
    Scale { x: Value, by: f32 },
    /// `act(gate) * up`.
    Gated { gate: Value, up: Value, act: Act },
    /// Turns the first `table`-width values of each head of `x` by the rows of `table`.
    Rotate { x: Value, table: Value, head_dim: usize, rotation: Rotation },
    /// Each row of `k` and `v` to cache `cache` at its position.
    CacheWrite { k: Value, v: Value, cache: usize },
    /// Causal grouped-query attention of `q` over cache `cache`, the last `window` keys of
    /// each query where `window` is not 0.
    Attention { q: Value, cache: usize, heads: Heads, window: usize },
    /// The last token row of each sequence.
    LastRows(Value),
    /// The run returns the value.
    Output(Value),
    /// The run returns the `k` largest values of each row of `x` and their columns, largest
    /// first (of equal values the lower column first): a device program's reading of its
    /// logits where a step needs no more (a greedy one: the largest).
    TopK { x: Value, k: u32 },
}

impl Op {
    /// The op with each value it reads replaced by `f` of it.
    pub fn map_values(&self, f: impl Fn(Value) -> Value) -> Op {
        match *self {
            Op::Input { width } => Op::Input { width },
            Op::Matmul { x, w } => Op::Matmul { x: f(x), w },
            Op::RmsNorm { x, w, group, eps } => Op::RmsNorm { x: f(x), w, group, eps },
            Op::Add(a, b) => Op::Add(f(a), f(b)),
            Op::Mul(a, b) => Op::Mul(f(a), f(b)),
            Op::Bias { x, w } => Op::Bias { x: f(x), w },
            Op::Scale { x, by } => Op::Scale { x: f(x), by },
            Op::Gated { gate, up, act } => Op::Gated { gate: f(gate), up: f(up), act },
            Op::Rotate { x, table, head_dim, rotation } => Op::Rotate { x: f(x), table: f(table), head_dim, rotation },
            Op::CacheWrite { k, v, cache } => Op::CacheWrite { k: f(k), v: f(v), cache },
            Op::Attention { q, cache, heads, window } => Op::Attention { q: f(q), cache, heads, window },
            Op::LastRows(x) => Op::LastRows(f(x)),
            Op::Output(x) => Op::Output(f(x)),
            Op::TopK { x, k } => Op::TopK { x: f(x), k },
        }
    }

    /// The values the op reads.
    pub fn operands(&self) -> ([Value; 2], usize) {
        match *self {
            Op::Input { .. } => ([0, 0], 0),
            Op::Matmul { x, .. } | Op::RmsNorm { x, .. } | Op::Bias { x, .. } | Op::Scale { x, .. } => ([x, 0], 1),
            Op::LastRows(x) | Op::Output(x) | Op::TopK { x, .. } | Op::Attention { q: x, .. } => ([x, 0], 1),
            Op::Add(a, b) | Op::Mul(a, b) | Op::Gated { gate: a, up: b, .. } => ([a, b], 2),
            Op::Rotate { x, table, .. } => ([x, table], 2),
            Op::CacheWrite { k, v, .. } => ([k, v], 2),
        }
    }
}

/// `ops` less those that no `output`, `cache-write` or `input` needs, renumbered (the inputs
/// stay, so that a run's inputs are the same).
pub fn compact(ops: &[Op]) -> Vec<Op> {
    let mut needed: Vec<bool> = ops.iter().map(|op| matches!(op, Op::Output(_) | Op::TopK { .. } | Op::CacheWrite { .. } | Op::Input { .. })).collect();
    for i in (0..ops.len()).rev() {
        if needed[i] {
            let (vals, k) = ops[i].operands();
            for &a in &vals[..k] {
                needed[a] = true;
            }
        }
    }
    let mut index = vec![usize::MAX; ops.len()];
    let mut out = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate().filter(|(i, _)| needed[*i]) {
        index[i] = out.len();
        out.push(op.map_values(|v| index[v]));
    }
    out
}

/// The kind of a value's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    Token,
    Sequence,
}

/// A model's program: its ops, the shape of each value, and what a run needs of them.
#[derive(Debug, Clone, Default)]
pub struct Program {
    pub ops: Vec<Op>,
    /// `(width, rows)` of each op's value; width 0 for the ops that make none.
    pub shapes: Vec<(usize, Rows)>,
    /// The `input` ops, in order.
    pub inputs: Vec<Value>,
    /// The values of the `output` ops, in order.
    pub outputs: Vec<Value>,
    /// The last op reading each value (`usize::MAX` for outputs, read after the run).
    pub last_use: Vec<usize>,
    /// Whether each op is needed to fill the caches: a run that wants no outputs runs those
    /// alone.
    pub feeds_caches: Vec<bool>,
}

/// Builds a [`Program`] op by op; each method returns the value its op makes.
pub struct Builder<'a> {
    ops: Vec<Op>,
    shapes: Vec<(usize, Rows)>,
    tensors: &'a dyn Tensors,
}

impl<'a> Builder<'a> {
    pub fn new(tensors: &'a dyn Tensors) -> Builder<'a> {
        Builder { ops: Vec::new(), shapes: Vec::new(), tensors }
    }

    fn push(&mut self, op: Op, shape: (usize, Rows)) -> Value {
        self.ops.push(op);
        self.shapes.push(shape);
        self.ops.len() - 1
    }

    fn shape(&self, v: Value) -> (usize, Rows) {
        self.shapes[v]
    }

    pub fn input(&mut self, width: usize) -> Value {
        self.push(Op::Input { width }, (width, Rows::Token))
    }

    pub fn matmul(&mut self, x: Value, w: WeightId) -> Value {
        let m = self.tensors.matrix(w);
        debug_assert_eq!(m.n_in, self.shape(x).0, "{}", m.name);
        let rows = self.shape(x).1;
        self.push(Op::Matmul { x, w }, (m.n_out, rows))
    }

    /// An RMS norm of each run of `group` values, with the weight `w` where given.
    pub fn rms_norm(&mut self, x: Value, w: Option<WeightId>, group: usize, eps: f32) -> Value {
        debug_assert!(w.is_none_or(|w| self.tensors.vector(w).len() == group));
        self.push(Op::RmsNorm { x, w, group, eps }, self.shape(x))
    }

    /// An RMS norm of whole rows.
    pub fn norm(&mut self, x: Value, w: WeightId, eps: f32) -> Value {
        self.rms_norm(x, Some(w), self.shape(x).0, eps)
    }

    pub fn add(&mut self, a: Value, b: Value) -> Value {
        debug_assert_eq!(self.shape(a), self.shape(b));
        self.push(Op::Add(a, b), self.shape(a))
    }

    pub fn mul(&mut self, a: Value, b: Value) -> Value {
        debug_assert_eq!(self.shape(a), self.shape(b));
        self.push(Op::Mul(a, b), self.shape(a))
    }

    pub fn bias(&mut self, x: Value, w: WeightId) -> Value {
        debug_assert_eq!(self.tensors.vector(w).len(), self.shape(x).0);
        self.push(Op::Bias { x, w }, self.shape(x))
    }

    /// `x + b` where the model has the bias `b`, else `x`.
    pub fn bias_if(&mut self, x: Value, w: Option<WeightId>) -> Value {
        match w {
            Some(w) => self.bias(x, w),
            None => x,
        }
    }

    pub fn scale(&mut self, x: Value, by: f32) -> Value {
        self.push(Op::Scale { x, by }, self.shape(x))
    }

    pub fn gated(&mut self, gate: Value, up: Value, act: Act) -> Value {
        debug_assert_eq!(self.shape(gate), self.shape(up));
        self.push(Op::Gated { gate, up, act }, self.shape(gate))
    }

    pub fn rotate(&mut self, x: Value, table: Value, head_dim: usize, rotation: Rotation) -> Value {
        debug_assert!(self.shape(table).0 <= head_dim && self.shape(x).0 % head_dim == 0);
        self.push(Op::Rotate { x, table, head_dim, rotation }, self.shape(x))
    }

    pub fn cache_write(&mut self, k: Value, v: Value, cache: usize) {
        self.push(Op::CacheWrite { k, v, cache }, (0, Rows::Token));
    }

    pub fn attention(&mut self, q: Value, cache: usize, heads: Heads, window: usize) -> Value {
        debug_assert_eq!(self.shape(q).0, heads.n_head * heads.head_dim);
        self.push(Op::Attention { q, cache, heads, window }, self.shape(q))
    }

    pub fn last_rows(&mut self, x: Value) -> Value {
        self.push(Op::LastRows(x), (self.shape(x).0, Rows::Sequence))
    }

    pub fn output(&mut self, x: Value) {
        self.push(Op::Output(x), (0, Rows::Token));
    }

    /// The program, with what a run needs to know of its values.
    pub fn finish(self) -> Program {
        let n = self.ops.len();
        let mut last_use: Vec<usize> = (0..n).collect();
        let mut outputs = Vec::new();
        let mut inputs = Vec::new();
        for (i, op) in self.ops.iter().enumerate() {
            let (vals, k) = op.operands();
            for &a in &vals[..k] {
                last_use[a] = i;
            }
            match op {
                Op::Output(x) | Op::TopK { x, .. } => outputs.push(*x),
                Op::Input { .. } => inputs.push(i),
                _ => {}
            }
        }
        for &o in &outputs {
            last_use[o] = usize::MAX;
        }
        let mut feeds_caches = vec![false; n];
        for i in (0..n).rev() {
            if matches!(self.ops[i], Op::CacheWrite { .. }) || feeds_caches[i] {
                feeds_caches[i] = true;
                let (vals, k) = self.ops[i].operands();
                for &a in &vals[..k] {
                    feeds_caches[a] = true;
                }
            }
        }
        Program { ops: self.ops, shapes: self.shapes, inputs, outputs, last_use, feeds_caches }
    }
}
