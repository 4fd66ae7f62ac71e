//! A model's recipe as a program of ops: the op core's ops (`wisp_ops`, the WIT `op` of
//! `wisp:llm/gpu`), over values named by index. Each architecture builds its program once, at
//! load (`models::<arch>::recipe`), with a [`Builder`], which the op core checks; the guest's
//! CPU runs it with its own kernels ([`cpu`]), so that an architecture is written once: its
//! config, its weights and its recipe.
//!
//! A value is a matrix of f32 of one of two kinds of rows, as in the WIT: token rows (one for
//! each token of the batch) and sequence rows (one for each sequence: the last token's, after
//! `last_rows`).

pub mod cpu;

use crate::kernels::Act;
use crate::models::attention::Heads;
use crate::models::{Linear, WeightData};
use std::collections::HashMap;
pub use wisp_ops::{CheckError, Format, Op, Precision, Rotation, Rows, compact};

/// A value: the index of the op that made it.
pub type Value = usize;

/// A weight of the model, in the architecture's own numbering (its [`Tensors`] resolves it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
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

/// A weight of a program: the model's weight `id` and what the op core's checks read of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProgramWeight {
    pub id: WeightId,
    /// `[n_out, n_in]`; `[1, n]` for a vector.
    pub dims: (u32, u32),
    /// F32 for vectors and f32 matrices; `None` for the quantized ones (their upload format is
    /// chosen where they are uploaded).
    pub format: Option<Format>,
}

impl wisp_ops::Weight for ProgramWeight {
    fn dims(&self) -> (u32, u32) {
        self.dims
    }

    fn format(&self) -> Option<Format> {
        self.format
    }
}

/// A model's program: the op core's, its weights the model's.
pub type Program = wisp_ops::Program<ProgramWeight>;

/// Builds a [`Program`] op by op; each method returns the value its op makes. The products
/// and attention are `exact`: a device program takes the model's precision where it is placed.
pub struct Builder<'a> {
    ops: Vec<Op>,
    /// The width of each op's value (0 for the ops that make none), for the methods that take
    /// it from their operand.
    widths: Vec<usize>,
    weights: Vec<ProgramWeight>,
    /// The index in `weights` of each weight named so far.
    index: HashMap<WeightId, usize>,
    /// One more than the largest cache index named.
    caches: u32,
    tensors: &'a dyn Tensors,
}

/// `u32` of a size that the op core checks anyway: one past `u32` becomes `u32::MAX`, which no
/// check admits where it matters.
fn n(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

impl<'a> Builder<'a> {
    pub fn new(tensors: &'a dyn Tensors) -> Builder<'a> {
        Builder { ops: Vec::new(), widths: Vec::new(), weights: Vec::new(), index: HashMap::new(), caches: 0, tensors }
    }

    fn push(&mut self, op: Op, width: usize) -> Value {
        self.ops.push(op);
        self.widths.push(width);
        self.ops.len() - 1
    }

    /// The program's index of the model's weight `id`, named now if it was not yet.
    fn weight(&mut self, id: WeightId) -> usize {
        if let Some(&i) = self.index.get(&id) {
            return i;
        }
        let (dims, format) = match self.tensors.tensor(id) {
            Tensor::Matrix(m) => ((n(m.n_out), n(m.n_in)), matches!(m.w, WeightData::F32(_)).then_some(Format::F32)),
            Tensor::Vector(v) => ((1, n(v.len())), Some(Format::F32)),
        };
        self.weights.push(ProgramWeight { id, dims, format });
        self.index.insert(id, self.weights.len() - 1);
        self.weights.len() - 1
    }

    pub fn input(&mut self, width: usize) -> Value {
        self.push(Op::Input { width: n(width) }, width)
    }

    pub fn matmul(&mut self, x: Value, w: WeightId) -> Value {
        let weight = self.weight(w);
        let n_out = self.weights[weight].dims.0 as usize;
        self.push(Op::Matmul { x, weight, precision: Precision::Exact }, n_out)
    }

    /// An RMS norm of each run of `group` values, with the weight `w` where given.
    pub fn rms_norm(&mut self, x: Value, w: Option<WeightId>, group: usize, eps: f32) -> Value {
        let weight = w.map(|w| self.weight(w));
        self.push(Op::RmsNorm { x, weight, offset: 0.0, group: n(group), eps }, self.widths[x])
    }

    /// An RMS norm of whole rows.
    pub fn norm(&mut self, x: Value, w: WeightId, eps: f32) -> Value {
        self.rms_norm(x, Some(w), self.widths[x], eps)
    }

    pub fn add(&mut self, a: Value, b: Value) -> Value {
        self.push(Op::Add(a, b), self.widths[a])
    }

    pub fn mul(&mut self, a: Value, b: Value) -> Value {
        self.push(Op::Mul(a, b), self.widths[a])
    }

    pub fn bias(&mut self, x: Value, w: WeightId) -> Value {
        let weight = self.weight(w);
        self.push(Op::Bias { x, weight }, self.widths[x])
    }

    /// `x + b` where the model has the bias `b`, else `x`.
    pub fn bias_if(&mut self, x: Value, w: Option<WeightId>) -> Value {
        match w {
            Some(w) => self.bias(x, w),
            None => x,
        }
    }

    pub fn scale(&mut self, x: Value, by: f32) -> Value {
        self.push(Op::Scale { x, by }, self.widths[x])
    }

    pub fn softcap(&mut self, x: Value, cap: f32) -> Value {
        self.push(Op::Softcap { x, cap }, self.widths[x])
    }

    pub fn gated(&mut self, gate: Value, up: Value, act: Act) -> Value {
        self.push(Op::Gated { gate, up, act }, self.widths[gate])
    }

    pub fn rotate(&mut self, x: Value, table: Value, head_dim: usize, rotation: Rotation) -> Value {
        self.push(Op::Rotate { x, table, head_dim: n(head_dim), rotation }, self.widths[x])
    }

    pub fn cache_write(&mut self, k: Value, v: Value, cache: usize) {
        self.caches = self.caches.max(n(cache).saturating_add(1));
        self.push(Op::CacheWrite { k, v, cache: n(cache) }, 0);
    }

    pub fn attention(&mut self, q: Value, cache: usize, heads: Heads, window: usize) -> Value {
        self.caches = self.caches.max(n(cache).saturating_add(1));
        let op = Op::Attention {
            q,
            cache: n(cache),
            n_head: n(heads.n_head),
            n_head_kv: n(heads.n_head_kv),
            head_dim: n(heads.head_dim),
            window: n(window),
            scale: heads.scale,
            softcap: heads.softcap,
            precision: Precision::Exact,
        };
        self.push(op, self.widths[q])
    }

    pub fn last_rows(&mut self, x: Value) -> Value {
        self.push(Op::LastRows(x), self.widths[x])
    }

    pub fn output(&mut self, x: Value) {
        self.push(Op::Output(x), 0);
    }

    /// The program, checked by the op core: a recipe whose shapes do not chain (a file whose
    /// tensors disagree with its metadata in a way the loader did not catch) is an error here,
    /// not a wrong answer later.
    pub fn finish(self) -> Result<Program, CheckError> {
        wisp_ops::check(self.ops, self.weights, self.caches)
    }
}

/// The attention heads of an `attention` op.
pub fn heads_of(n_head: u32, n_head_kv: u32, head_dim: u32, scale: f32, softcap: f32) -> Heads {
    Heads { n_head: n_head as usize, n_head_kv: n_head_kv as usize, head_dim: head_dim as usize, scale, softcap }
}
