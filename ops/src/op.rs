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

/// `cap * tanh(x / cap)`, in f32, as every executor computes it (the WGSL `softcap` and the
/// browser's reading are this one): `tanh(y)` as `(1 - e) / (1 + e)`, `e = e^(-2|y|)` (an `exp`
/// of a number never positive: no input overflows), and below `|y| = 1/8`, where `1 - e` would
/// cancel, its series to `y^7` (within 2e-9 of `tanh` there).
pub fn softcap(x: f32, cap: f32) -> f32 {
    let y = x / cap;
    let t = if y.abs() < 0.125 {
        let y2 = y * y;
        y * (1.0 - y2 * (1.0 / 3.0 - y2 * (2.0 / 15.0 - y2 * (17.0 / 315.0))))
    } else {
        let e = libm::expf(-2.0 * y.abs());
        ((1.0 - e) / (1.0 + e)).copysign(y)
    };
    cap * t
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
    /// `cap * tanh(x / cap)` (Gemma 2's final logit soft-capping): `x` squeezed into
    /// `(-cap, cap)`, nearly unchanged where small.
    Softcap {
        /// The rows.
        x: usize,
        /// The bound, positive.
        cap: f32,
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
        /// Caps each scaled product `s` as `softcap * tanh(s / softcap)` before the softmax
        /// (Gemma 2's attention soft-capping); 0 for none.
        softcap: f32,
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
            Op::Matmul { x, .. } | Op::RmsNorm { x, .. } | Op::Bias { x, .. } | Op::Scale { x, .. } | Op::Softcap { x, .. } => Operands::of(&[x]),
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
            Op::Matmul { x, .. } | Op::RmsNorm { x, .. } | Op::Bias { x, .. } | Op::Scale { x, .. } | Op::Softcap { x, .. } => *x = f(*x),
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
            Op::Softcap { .. } => "softcap",
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

    /// The f32 reading is tanh's within a few f32 roundings everywhere, on both sides of the
    /// switch to the series, odd, bounded by the cap, and NaN for NaN.
    #[test]
    fn softcap_is_cap_tanh() {
        for i in -4000..=4000 {
            let x = i as f32 * 0.0371;
            let (cap, want) = (30.0f32, 30.0 * libm::tanh(x as f64 / 30.0));
            let got = softcap(x, cap);
            assert!((got as f64 - want).abs() <= 4e-7 * want.abs().max(1e-3), "{x}: {got} against {want}");
            assert_eq!(softcap(-x, cap), -got);
        }
        assert_eq!(softcap(f32::INFINITY, 50.0), 50.0);
        assert_eq!(softcap(f32::MAX, 50.0), 50.0);
        assert_eq!(softcap(-1e30, 50.0), -50.0);
        assert!(softcap(f32::NAN, 50.0).is_nan());
    }

    extern crate std;

    #[test]
    fn operands_and_their_map_agree() {
        let ops = [
            Op::Input { width: 4 },
            Op::Add(3, 5),
            Op::Rotate { x: 1, table: 2, head_dim: 4, rotation: Rotation::Pairs },
            Op::Attention { q: 7, cache: 0, n_head: 1, n_head_kv: 1, head_dim: 4, window: 0, scale: 1.0, softcap: 0.0, precision: Precision::Exact },
        ];
        for op in ops {
            let mapped = op.map_values(|v| v + 10);
            let want: std::vec::Vec<usize> = op.operands().as_slice().iter().map(|v| v + 10).collect();
            assert_eq!(mapped.operands().as_slice(), &want[..], "{op:?}");
        }
    }
}
