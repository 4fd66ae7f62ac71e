//! The op set of a program (the WIT `op`): one enum for the guest that builds programs and for
//! every host that checks and runs them.

/// How exactly a product or an attention op is computed (the WIT `precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// f32 products and sums.
    #[default]
    Exact,
    /// f16/bf16 (or int8) inputs, f32 sums: within 2^-6 of the norm of a sum's terms.
    Fast,
}

/// The activation of a `gated` op (the WIT `activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))`, the tanh approximation of GELU
    /// (Gemma).
    GeluTanh,
    /// `g / (1 + e^-g)` (Qwen2, Llama, Phi-3).
    Silu,
}

impl Activation {
    /// The activation of one value, in f32, as the shaders compute it: `g / (1 + e^-a)` with
    /// `a = 2 sqrt(2 / pi) (g + 0.044715 g^3)` for GELU (its tanh form rewritten) and `a = g`
    /// for SiLU.
    pub fn apply(self, g: f32) -> f32 {
        let a = match self {
            Activation::GeluTanh => 1.595_769_1 * (g + 0.044715 * g * g * g),
            Activation::Silu => g,
        };
        g / (1.0 + libm::expf(-a))
    }
}

/// How a rotary embedding pairs a head's values (the WIT `rotation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rotation {
    /// `(h[j], h[j + r / 2])`: GPT-NeoX, Gemma, Qwen2.
    Halves,
    /// `(h[2j], h[2j + 1])`: Llama as converted to GGUF.
    Pairs,
}

/// One op, operands by value index (the index of the op that made the value), weights by index
/// into the program's weights (the WIT `op`; see `wit/gpu.wit`). Each variant's fields are those
/// of the WIT record of the same name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    /// Token rows of `width` from the run's next input.
    Input {
        /// Values a row.
        width: u32,
    },
    /// `x @ W^T`, `W[n_out, n_in]` the program's weight of index `weight`.
    Matmul {
        /// Rows of `n_in`.
        x: usize,
        /// The weight's index.
        weight: usize,
        /// How exactly the products are summed.
        precision: Precision,
    },
    /// `v / sqrt(mean(v^2) + eps) * (w + offset)` over each run of `group` values (`w + offset`
    /// all ones without a weight).
    RmsNorm {
        /// The rows normed.
        x: usize,
        /// An f32 vector of `group` values, if any.
        weight: Option<usize>,
        /// Added to each weight (1 for Gemma's norms as stored in some files; 0 otherwise).
        offset: f32,
        /// Values normed together: the width, or a head's.
        group: u32,
        /// Added to the mean square.
        eps: f32,
    },
    /// `a + b`.
    Add(usize, usize),
    /// `a * b`.
    Mul(usize, usize),
    /// `x + b` on every row.
    Bias {
        /// The rows.
        x: usize,
        /// An f32 vector of the rows' width.
        weight: usize,
    },
    /// `x * by`.
    Scale {
        /// The rows.
        x: usize,
        /// The factor.
        by: f32,
    },
    /// `act(gate) * up`.
    Gated {
        /// Rows the activation takes.
        gate: usize,
        /// Rows of the same shape.
        up: usize,
        /// The activation.
        act: Activation,
    },
    /// Turns the first `table`-width values of each head of `x` by the rows of `table`: its
    /// cosines, then its sines.
    Rotate {
        /// Token rows, heads of `head_dim` each.
        x: usize,
        /// Token rows of `2 * pairs`: cosines, then sines.
        table: usize,
        /// A head's width, even.
        head_dim: u32,
        /// Which values turn together.
        rotation: Rotation,
    },
    /// Each sequence's rows of `k` and `v` to its cache `cache`, at their positions.
    CacheWrite {
        /// Key rows.
        k: usize,
        /// Value rows, the same shape.
        v: usize,
        /// The cache index.
        cache: u32,
    },
    /// Causal grouped-query attention of each sequence's rows of `q` over its cache `cache`,
    /// the last `window` keys of each query where `window` is not 0.
    Attention {
        /// Token rows of `n_head * head_dim`.
        q: usize,
        /// The cache index.
        cache: u32,
        /// Query heads, a multiple of `n_head_kv`.
        n_head: u32,
        /// Key/value heads.
        n_head_kv: u32,
        /// A head's width.
        head_dim: u32,
        /// Keys a query sees, its own included; 0 for all.
        window: u32,
        /// Multiplies each query-key product before the softmax.
        scale: f32,
        /// How exactly the products are summed.
        precision: Precision,
    },
    /// The last token row of each sequence.
    LastRows(usize),
    /// The run returns the value.
    Output(usize),
    /// The run returns the `k` largest values of each row of `x` and their columns, largest
    /// first (of equal values the lower column first, NaN below every number).
    TopK {
        /// The rows.
        x: usize,
        /// How many of each row.
        k: u32,
    },
}

/// The values an op reads: at most two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operands {
    values: [usize; 2],
    len: usize,
}

impl Operands {
    fn of(values: &[usize]) -> Operands {
        let mut o = Operands { values: [0; 2], len: values.len() };
        o.values[..values.len()].copy_from_slice(values);
        o
    }

    /// The values, in the op's order (an op that reads a value twice lists it twice).
    pub fn as_slice(&self) -> &[usize] {
        &self.values[..self.len]
    }
}

impl<'a> IntoIterator for &'a Operands {
    type Item = &'a usize;
    type IntoIter = core::slice::Iter<'a, usize>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

impl Op {
    /// The values the op reads.
    pub fn operands(&self) -> Operands {
        match *self {
            Op::Input { .. } => Operands::of(&[]),
            Op::Matmul { x, .. } | Op::RmsNorm { x, .. } | Op::Bias { x, .. } | Op::Scale { x, .. } => Operands::of(&[x]),
            Op::LastRows(x) | Op::Output(x) | Op::TopK { x, .. } | Op::Attention { q: x, .. } => Operands::of(&[x]),
            Op::Add(a, b) | Op::Mul(a, b) | Op::Gated { gate: a, up: b, .. } => Operands::of(&[a, b]),
            Op::Rotate { x, table, .. } => Operands::of(&[x, table]),
            Op::CacheWrite { k, v, .. } => Operands::of(&[k, v]),
        }
    }

    /// The op with each value it reads replaced by `f` of it.
    pub fn map_values(&self, f: impl Fn(usize) -> usize) -> Op {
        let mut op = *self;
        match &mut op {
            Op::Input { .. } => {}
            Op::Matmul { x, .. } | Op::RmsNorm { x, .. } | Op::Bias { x, .. } | Op::Scale { x, .. } => *x = f(*x),
            Op::LastRows(x) | Op::Output(x) | Op::TopK { x, .. } | Op::Attention { q: x, .. } => *x = f(*x),
            Op::Add(a, b) | Op::Mul(a, b) | Op::Gated { gate: a, up: b, .. } => (*a, *b) = (f(*a), f(*b)),
            Op::Rotate { x, table, .. } => (*x, *table) = (f(*x), f(*table)),
            Op::CacheWrite { k, v, .. } => (*k, *v) = (f(*k), f(*v)),
        }
        op
    }

    /// The op with each weight it names replaced by `f` of it.
    pub fn map_weights(&self, f: impl Fn(usize) -> usize) -> Op {
        let mut op = *self;
        match &mut op {
            Op::Matmul { weight, .. } | Op::Bias { weight, .. } | Op::RmsNorm { weight: Some(weight), .. } => *weight = f(*weight),
            _ => {}
        }
        op
    }

    /// The weight the op names, if any.
    pub fn weight(&self) -> Option<usize> {
        match *self {
            Op::Matmul { weight, .. } | Op::Bias { weight, .. } | Op::RmsNorm { weight: Some(weight), .. } => Some(weight),
            _ => None,
        }
    }

    /// Whether the run returns something for the op (`output`, `top-k`).
    pub fn is_output(&self) -> bool {
        matches!(self, Op::Output(_) | Op::TopK { .. })
    }

    /// The op's WIT name (`"rms-norm"`, `"top-k"`, ...), for errors.
    pub fn name(&self) -> &'static str {
        match self {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    extern crate std;

    #[test]
    fn operands_and_their_map_agree() {
        let ops = [
            Op::Input { width: 4 },
            Op::Add(3, 5),
            Op::Rotate { x: 1, table: 2, head_dim: 4, rotation: Rotation::Pairs },
            Op::Attention { q: 7, cache: 0, n_head: 1, n_head_kv: 1, head_dim: 4, window: 0, scale: 1.0, precision: Precision::Exact },
        ];
        for op in ops {
            let mapped = op.map_values(|v| v + 10);
            let want: std::vec::Vec<usize> = op.operands().as_slice().iter().map(|v| v + 10).collect();
            assert_eq!(mapped.operands().as_slice(), &want[..], "{op:?}");
        }
    }
}
