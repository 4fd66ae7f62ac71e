//! CPU kernels. Each has a plain scalar version (`scalar`), the reference; on wasm32 with
//! simd128 the hot ones run a SIMD version (`simd128`), tested against the scalar one.
//!
//! Matrix products use integer dot products: the activations of each row are quantized to i16
//! with one f32 scale per block of 32 (`QActs`, relative error below 2^-15 per element), the
//! weights are `QMatrix` values widened to i16 in registers, and `i32x4.dot_i16x8_s` sums exact
//! integer products before one f32 multiply per group. This keeps every golden logit within
//! ~1e-3 of f32 math.

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub mod int8;
pub mod scalar;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub mod simd128;

use crate::quant::{Group, QMatrix, Values};

/// 16 bytes on a 16-byte boundary: the unit of [`Aligned`].
#[derive(Clone, Copy, Default)]
#[repr(C, align(16))]
struct Lanes([u8; 16]);

/// The integer types an [`Aligned`] holds: any bit pattern is a value, alignment at most 16.
pub trait Lane: Copy + Default {}
impl Lane for i8 {}
impl Lane for i16 {}

/// A growable `[T]` whose start is 16-byte aligned, so that the SIMD kernels may load any
/// 16 bytes from a multiple-of-16-bytes index as one aligned `v128`.
#[derive(Default)]
pub struct Aligned<T: Lane> {
    lanes: Vec<Lanes>,
    len: usize,
    _values: core::marker::PhantomData<T>,
}

/// The i16 activations of the exact products.
pub type AlignedI16 = Aligned<i16>;

impl<T: Lane> Aligned<T> {
    /// Sets the length to `len`; new values are 0.
    pub fn resize(&mut self, len: usize) {
        self.lanes.resize((len * size_of::<T>()).div_ceil(16), Lanes::default());
        self.len = len;
    }
}

impl<T: Lane> core::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `lanes` holds at least `len * size_of::<T>()` bytes, contiguous (`Lanes` is
        // `repr(C)` around `[u8; 16]`), 16-byte aligned; `T: Lane` is an integer type, valid
        // for any bits, whose alignment divides 16.
        unsafe { core::slice::from_raw_parts(self.lanes.as_ptr() as *const T, self.len) }
    }
}

impl<T: Lane> core::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` is the only access.
        unsafe { core::slice::from_raw_parts_mut(self.lanes.as_mut_ptr() as *mut T, self.len) }
    }
}

/// Activations `x[t, n]` quantized for the integer kernels: per block of 32 elements,
/// `x ≈ s * q` with `q: i16` and `s = max|x| / 32767`.
#[derive(Default)]
pub struct QActs {
    pub t: usize,
    pub n: usize,
    /// `[t, n]`, 16-byte aligned.
    pub q: AlignedI16,
    /// `[t, n / 32]`
    pub s: Vec<f32>,
    /// `[t, n / 32]`: the exact sum of each block, for weight formats with mins.
    pub sum: Vec<f32>,
    /// `s` and `sum` regrouped for kernels that run 4 tokens at once: `[t / 4, n / 32, 4]`,
    /// the 4 tokens of a group side by side.
    pub s4: Vec<f32>,
    pub sum4: Vec<f32>,
}

impl QActs {
    /// Quantizes `x[t, n]` (`n` a multiple of 32) into `self`, reusing its buffers.
    pub fn quantize(&mut self, x: &[f32], t: usize, n: usize) {
        debug_assert_eq!(x.len(), t * n);
        debug_assert_eq!(n % 32, 0);
        self.t = t;
        self.n = n;
        self.q.resize(t * n);
        self.s.resize(t * n / 32, 0.0);
        self.sum.resize(t * n / 32, 0.0);
        for ((xb, qb), (s, sum)) in x
            .chunks_exact(32)
            .zip(self.q.chunks_exact_mut(32))
            .zip(self.s.iter_mut().zip(self.sum.iter_mut()))
        {
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            let (scale, total) = simd128::quantize_block(xb, qb);
            #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
            let (scale, total) = scalar::quantize_block(xb, qb);
            *s = scale;
            *sum = total;
        }
        regroup(&self.s, t, &mut self.s4);
        regroup(&self.sum, t, &mut self.sum4);
    }
}

/// `one[t, k]` regrouped for the kernels that run 4 tokens at once: `four[t / 4, k, 4]`, the
/// 4 tokens of a group side by side (the last `t % 4` tokens left out).
fn regroup<T: Copy + Default>(one: &[T], t: usize, four: &mut Vec<T>) {
    let k = one.len() / t.max(1);
    four.resize(t / 4 * k * 4, T::default());
    for (g, group) in four.chunks_exact_mut(k * 4).enumerate() {
        for (b, lanes) in group.chunks_exact_mut(4).enumerate() {
            for (i, v) in lanes.iter_mut().enumerate() {
                *v = one[(4 * g + i) * k + b];
            }
        }
    }
}

/// Activations `x[t, n]` quantized to int8 for the `fast` products (`matmul_q8`): per block of
/// 32 elements, `x ≈ s * q` with `q: i8` in -127..=127 and `s = max|x| / 127`, as llama.cpp's
/// `q8_0` activations. With each block come the sums of its `q`, exact integers: the kernels
/// take the weights as unsigned values and subtract their offset times these.
#[derive(Default)]
pub struct QActs8 {
    pub t: usize,
    pub n: usize,
    /// `[t, n]`, 16-byte aligned.
    pub q: Aligned<i8>,
    /// `q` widened to i16, `[t, n]`, 16-byte aligned: the four-row kernel's Q8_0 products take
    /// them (their values are signed 8-bit too, and products of i16 cost it no sign moves).
    pub q16: Aligned<i16>,
    /// `[t, n / 32]`
    pub s: Vec<f32>,
    /// `[t, n / 32]`: the sum of each block's `q`.
    pub qsum: Vec<i32>,
    /// `[t, n / 16]`: the sum of each half block's `q` (for weights with a scale per 16).
    pub qsum16: Vec<i32>,
}

impl QActs8 {
    /// Quantizes `x[t, n]` (`n` a multiple of 32) into `self`, reusing its buffers.
    pub fn quantize(&mut self, x: &[f32], t: usize, n: usize) {
        debug_assert_eq!(x.len(), t * n);
        debug_assert_eq!(n % 32, 0);
        self.t = t;
        self.n = n;
        self.q.resize(t * n);
        self.s.resize(t * n / 32, 0.0);
        self.qsum16.resize(t * n / 16, 0);
        for ((xb, qb), (s, sums)) in x
            .chunks_exact(32)
            .zip(self.q.chunks_exact_mut(32))
            .zip(self.s.iter_mut().zip(self.qsum16.chunks_exact_mut(2)))
        {
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            let (scale, halves) = simd128::quantize_block8(xb, qb);
            #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
            let (scale, halves) = scalar::quantize_block8(xb, qb);
            *s = scale;
            sums.copy_from_slice(&halves);
        }
        self.q16.resize(t * n);
        for (w, &v) in self.q16.iter_mut().zip(self.q.iter()) {
            *w = v as i16;
        }
        self.qsum.clear();
        self.qsum.extend(self.qsum16.chunks_exact(2).map(|h| h[0] + h[1]));
    }
}

/// Weight rows unpacked: the kernels that reuse rows across several tokens unpack packed rows
/// (4-bit values, f16 scales) here once. The exact kernels unpack one row to i8 values and f32
/// scales (`q`, `d`); `matmul_q8` four rows at a time (`int8::unpack4`).
#[derive(Default)]
pub struct RowScratch {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    /// The int8 kernels' four rows' mins.
    pub m: Vec<f32>,
}

/// `y[t, n_out] = x[t, n_in] @ W[n_out, n_in]^T` for a quantized weight; `x` given as `QActs`.
pub fn matmul_q(w: &QMatrix, x: &QActs, scratch: &mut RowScratch, y: &mut [f32]) {
    debug_assert_eq!(x.n, w.n_in);
    debug_assert_eq!(y.len(), x.t * w.n_out);
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    simd128::matmul_q(w, x, scratch, y);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::matmul_q(w, x, scratch, y);
}

/// Whether `matmul_q8` (int8 activations) takes `w`: every format, its values taken as 7-bit
/// unsigned numbers against the activations' bytes. 4- and 5-bit nibbles and Q6_K's values
/// (-32..=31, the one format with a scale per 16) plus an offset below 64; Q8_0's values as
/// their magnitudes, their signs moved onto the activations, unless one is -128 (whose
/// magnitude needs 8 bits; ggml never writes it).
pub fn takes_int8(w: &QMatrix) -> bool {
    match (&w.values, w.group) {
        // Offsets 0 or a power of two (the formats' 0, 8 and 16): the kernels shift, not multiply.
        (Values::Nibbles { offset, .. }, Group::G32) => *offset == 0 || (*offset > 0 && (*offset as u8).is_power_of_two()),
        (Values::I8(_), Group::G16) => w.m.is_empty(),
        (Values::I8(_), Group::G32) => w.m.is_empty() && !w.i8_min,
        _ => false,
    }
}

/// What `matmul_q8` adds to `w`'s values to take them unsigned (see `takes_int8`; 0 for
/// Q8_0's, whose signs go onto the activations).
pub fn unsigned_offset(w: &QMatrix) -> i32 {
    match (&w.values, w.group) {
        (Values::Nibbles { offset, .. }, _) => *offset as i32,
        (Values::I8(_), Group::G16) => 32,
        (Values::I8(_), Group::G32) => 0,
    }
}

/// `y[t, n_out] = x[t, n_in] @ W[n_out, n_in]^T` with int8 activations (`precision: fast`):
/// the exact integer products of `w`'s values and `x`'s, scaled in f32, the same bits on every
/// host. `w` must be one `takes_int8` accepts.
pub fn matmul_q8(w: &QMatrix, x: &QActs8, scratch: &mut RowScratch, y: &mut [f32]) {
    debug_assert_eq!(x.n, w.n_in);
    debug_assert_eq!(y.len(), x.t * w.n_out);
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    int8::matmul_q8(w, x, scratch, y);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::matmul_q8(w, x, scratch, y);
}

/// `y[t, n_out] = x[t, n_in] @ W[n_out, n_in]^T` for an f32 weight.
pub fn matmul_f32(w: &[f32], n_out: usize, n_in: usize, x: &[f32], t: usize, y: &mut [f32]) {
    debug_assert_eq!(w.len(), n_out * n_in);
    debug_assert_eq!(x.len(), t * n_in);
    debug_assert_eq!(y.len(), t * n_out);
    for (xr, yr) in x.chunks_exact(n_in).zip(y.chunks_exact_mut(n_out)) {
        for (o, wr) in yr.iter_mut().zip(w.chunks_exact(n_in)) {
            *o = dot(wr, xr);
        }
    }
}

/// `sum(a[i] * b[i])`
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    return simd128::dot(a, b);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    return scalar::dot(a, b);
}

/// `out[j] = scale * (q . rows[j])` for `out.len()` rows of `q.len()` elements that start
/// `stride` apart in `rows` (one head's keys in a KV cache).
pub fn dot_rows(q: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    assert!(out.is_empty() || rows.len() >= (out.len() - 1) * stride + q.len());
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    simd128::dot_rows(q, rows, stride, scale, out);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::dot_rows(q, rows, stride, scale, out);
}

/// `out += sum_j w[j] * rows[j]` for `w.len()` rows of `out.len()` elements that start `stride`
/// apart in `rows` (one head's values in a KV cache, weighted by its attention).
pub fn weighted_sum(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    assert!(w.is_empty() || rows.len() >= (w.len() - 1) * stride + out.len());
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    simd128::weighted_sum(w, rows, stride, out);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::weighted_sum(w, rows, stride, out);
}

/// The activation of a gated feed-forward block: the op core's (`GeluTanh` for Gemma, `Silu`
/// for Qwen2, Llama and Phi-3).
pub use wisp_ops::Activation as Act;

/// The activation of one value (the scalar definition the guest's kernels hold to; the SIMD
/// ones are tested against it).
#[inline]
pub fn activate(act: Act, x: f32) -> f32 {
    match act {
        Act::GeluTanh => gelu_tanh(x),
        Act::Silu => x / (1.0 + (-x).exp()),
    }
}

/// `g[i] = act(g[i]) * u[i]`: the gate of a feed-forward block, in place.
pub fn gate(act: Act, g: &mut [f32], u: &[f32]) {
    debug_assert_eq!(g.len(), u.len());
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    simd128::gate(act, g, u);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::gate(act, g, u);
}

/// `x = x / sqrt(mean(x^2) + eps) * w`, in place.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let ss = dot(x, x) / x.len() as f32;
    let k = 1.0 / (ss + eps).sqrt();
    scale_mul(x, w, k);
}

/// The index of the first largest value of `v`, NaNs skipped; 0 when no value exceeds minus
/// infinity. (Greedy sampling over a vocabulary of 262,144 logits each decode step.)
pub fn argmax(v: &[f32]) -> usize {
    let m = max_value(v);
    if m == f32::NEG_INFINITY {
        return 0;
    }
    v.iter().position(|&x| x == m).unwrap_or(0)
}

/// The largest value of `v`, NaNs skipped (minus infinity when there is none).
pub fn max_value(v: &[f32]) -> f32 {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    return simd128::max_value(v);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    return scalar::max_value(v);
}

/// `sum(exp(v[i] - max))` over the values that are not NaN, summed in f64 (the mass of a
/// softmax at temperature 1; `max` at least every value). Each term an f32 exponential (SIMD on
/// wasm32: within a few ulp of `f32::exp`).
pub fn sum_exp(v: &[f32], max: f32) -> f64 {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    return simd128::sum_exp(v, max);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    return scalar::sum_exp(v, max);
}

/// `x[i] *= k * w[i]` over the shorter of the two, in place (the last step of `rms_norm`).
pub fn scale_mul(x: &mut [f32], w: &[f32], k: f32) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    simd128::scale_mul(x, w, k);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::scale_mul(x, w, k);
}

/// `x[i] += y[i]` over the shorter of the two (a residual connection).
pub fn add(x: &mut [f32], y: &[f32]) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    simd128::add(x, y);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::add(x, y);
}

/// `(a[j], b[j]) = (a[j] cos[j] - b[j] sin[j], a[j] sin[j] + b[j] cos[j])`: pairs rotated by
/// their angles (RoPE), over the shortest of the four.
pub fn rotate_pairs(a: &mut [f32], b: &mut [f32], cos: &[f32], sin: &[f32]) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    simd128::rotate_pairs(a, b, cos, sin);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::rotate_pairs(a, b, cos, sin);
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// `x[i] = exp(x[i] - max) / sum`, in place.
pub fn softmax(x: &mut [f32]) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    return simd128::softmax(x);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::softmax(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::TensorType;
    use crate::quant::tests::{Rng, random_blocks};
    use crate::quant::{self, QMatrix};

    /// The block types the engine keeps as a `QMatrix` (all but Q2_K, widened to f32).
    const LAYOUT_KINDS: [TensorType; 11] = {
        use TensorType::*;
        [Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, Q3K, Q4K, Q5K, Q6K, IQ4NL, IQ4XS]
    };

    /// A fresh seed per run, printed so that a failure can be replayed.
    fn seed() -> u64 {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(1);
        let s = (t as u64) | 1;
        println!("seed {s:#x}");
        s
    }

    /// Random activations with a few outliers, as transformer activations have.
    fn activations(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|i| rng.f32() * if i % 97 == 5 { 40.0 } else { 1.0 }).collect()
    }

    /// `x` (`t` rows) quantized, and its product with `q`.
    fn product(q: &QMatrix, x: &[f32], t: usize) -> (QActs, Vec<f32>) {
        let mut acts = QActs::default();
        acts.quantize(x, t, q.n_in);
        let mut y = vec![0f32; t * q.n_out];
        matmul_q(q, &acts, &mut RowScratch::default(), &mut y);
        (acts, y)
    }

    /// The quantized product against the f64 product of the dequantized weights, within the
    /// error the i16 activations allow (half a step of each block's scale) plus f32 rounding.
    #[test]
    fn matmul_q_matches_the_dequantized_reference() {
        let mut rng = Rng(seed());
        for kind in LAYOUT_KINDS {
            let (block, _) = kind.block();
            for &t in &[1usize, 3, 4, 5, 9] {
                let blocks = 1 + (rng.next_u64() % 3) as usize;
                let n_in = block as usize * blocks * if block == 32 { 1 + (rng.next_u64() % 7) as usize } else { 1 };
                let n_out = 1 + (rng.next_u64() % 9) as usize;
                let data = random_blocks(kind, n_out * n_in, &mut rng);
                let q = QMatrix::from_blocks(kind, &data, n_out, n_in).unwrap();
                let mut w = vec![0f32; n_out * n_in];
                quant::dequantize(kind, &data, &mut w);
                let x = activations(&mut rng, t * n_in);
                let (acts, y) = product(&q, &x, t);
                for tok in 0..t {
                    let xr = &x[tok * n_in..(tok + 1) * n_in];
                    for r in 0..n_out {
                        let wr = &w[r * n_in..(r + 1) * n_in];
                        let exact: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let magnitude: f64 = wr.iter().zip(xr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                        let quant_err: f64 = (0..n_in / 32)
                            .map(|b| {
                                let amax = xr[32 * b..32 * b + 32].iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                                let wsum: f64 = wr[32 * b..32 * b + 32].iter().map(|v| v.abs() as f64).sum();
                                wsum * amax / 65534.0
                            })
                            .sum();
                        let tol = 1.01 * quant_err + 1e-5 * magnitude + 1e-6;
                        let got = y[tok * n_out + r] as f64;
                        assert!(
                            (got - exact).abs() <= tol,
                            "{kind:?} t={t} [{n_out}, {n_in}] token {tok} row {r}: {got} vs {exact} (tol {tol})"
                        );
                    }
                }
                // The file's f16 scales widened in the kernels give the very products of the
                // same scales stored as f32.
                if let quant::Scales::F16(d) = &q.d {
                    let mut wide = QMatrix::from_blocks(kind, &data, n_out, n_in).unwrap();
                    wide.d = quant::Scales::F32(d.iter().map(|&h| quant::f16_to_f32(h)).collect());
                    let mut y32 = vec![0f32; t * n_out];
                    matmul_q(&wide, &acts, &mut RowScratch::default(), &mut y32);
                    assert!(y.iter().zip(&y32).all(|(a, b)| a.to_bits() == b.to_bits()), "{kind:?} t={t}: f16 vs f32 scales");
                }
                // The dispatched kernel (SIMD on wasm32) agrees with the scalar reference up to
                // f32 rounding, which both make in their own order: relative to the sum of the
                // magnitudes of the terms (an output can be far smaller than its terms).
                let mut reference = vec![0f32; t * n_out];
                scalar::matmul_q(&q, &acts, &mut RowScratch::default(), &mut reference);
                for tok in 0..t {
                    for r in 0..n_out {
                        let magnitude: f64 = (0..n_in)
                            .map(|i| {
                                let x = acts.q[tok * n_in + i] as f64 * acts.s[tok * n_in / 32 + i / 32] as f64;
                                (w[r * n_in + i] as f64 * x).abs()
                            })
                            .sum();
                        let (a, b) = (y[tok * n_out + r], reference[tok * n_out + r]);
                        let tol = 1e-5 * magnitude + 1e-6;
                        assert!(
                            ((a - b) as f64).abs() <= tol,
                            "{kind:?} t={t} token {tok} row {r}: simd {a} vs scalar {b} (tol {tol})"
                        );
                    }
                }
            }
        }
    }

    /// A token's products do not depend on the tokens beside it (batch invariance): each row of
    /// a product over `t` tokens, whichever kernel ran it (one token, or four at once), equals
    /// bit for bit the product of that token alone, for every weight format and storage.
    #[test]
    fn a_tokens_products_do_not_depend_on_its_batch() {
        let mut rng = Rng(seed());
        for kind in LAYOUT_KINDS {
            let (block, _) = kind.block();
            // Block counts with and without a remainder of the kernels' groups of four blocks.
            for blocks in [1usize, 4, 5, 8, 11] {
                let n_in = 32 * blocks.max(block as usize / 32);
                let n_in = n_in.div_ceil(block as usize) * block as usize;
                let n_out = 1 + (rng.next_u64() % 6) as usize;
                let data = random_blocks(kind, n_out * n_in, &mut rng);
                let q = QMatrix::from_blocks(kind, &data, n_out, n_in).unwrap();
                for t in [2usize, 4, 5, 8, 9, 13] {
                    let x = activations(&mut rng, t * n_in);
                    let (_, y) = product(&q, &x, t);
                    for tok in 0..t {
                        let (_, y1) = product(&q, &x[tok * n_in..(tok + 1) * n_in], 1);
                        let row = &y[tok * n_out..(tok + 1) * n_out];
                        assert!(
                            row.iter().zip(&y1).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{kind:?} [{n_out}, {n_in}] token {tok} of {t}: {row:?} in the batch, {y1:?} alone"
                        );
                    }
                }
            }
        }
    }

    /// The elementwise kernels (SIMD on wasm32) give the scalar reference's very values: the
    /// same products and sums, element by element, over lengths with and without a remainder.
    #[test]
    fn elementwise_kernels_equal_the_scalar_reference() {
        let mut rng = Rng(seed());
        for n in [0usize, 1, 3, 4, 7, 8, 15, 16, 17, 33, 256, 640, 1001] {
            let x: Vec<f32> = (0..n).map(|_| rng.f32() * 3.0).collect();
            let y: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            let (c, s): (Vec<f32>, Vec<f32>) = (0..n).map(|i| ((i as f32).cos(), (i as f32).sin())).unzip();
            let k = 0.37 + rng.f32();
            let (mut got, mut want) = (x.clone(), x.clone());
            scale_mul(&mut got, &y, k);
            scalar::scale_mul(&mut want, &y, k);
            assert_eq!(got, want, "scale_mul n={n}");
            let (mut got, mut want) = (x.clone(), x.clone());
            add(&mut got, &y);
            scalar::add(&mut want, &y);
            assert_eq!(got, want, "add n={n}");
            let (mut ga, mut gb, mut wa, mut wb) = (x.clone(), y.clone(), x.clone(), y.clone());
            rotate_pairs(&mut ga, &mut gb, &c, &s);
            scalar::rotate_pairs(&mut wa, &mut wb, &c, &s);
            assert_eq!((ga, gb), (wa, wb), "rotate_pairs n={n}");
            if n > 0 {
                let mut once = x.clone();
                scalar::rotate_pairs(&mut once, &mut y.clone(), &c, &s);
                let i = n - 1;
                assert_eq!(once[i], x[i] * c[i] - y[i] * s[i], "rotate_pairs n={n}: the definition");
            }
        }
    }

    /// `argmax` (its maximum by SIMD on wasm32) is the first index of the largest value, NaNs
    /// skipped, as a plain scan finds it: with ties, NaNs, infinities and signed zeros.
    #[test]
    fn argmax_is_the_first_largest() {
        let scan = |v: &[f32]| {
            let (mut best, mut best_v) = (0, f32::NEG_INFINITY);
            for (i, &x) in v.iter().enumerate() {
                if x > best_v {
                    (best, best_v) = (i, x);
                }
            }
            best
        };
        let mut rng = Rng(seed());
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 3.0];
        for n in [0usize, 1, 2, 5, 15, 16, 17, 33, 100, 1000, 262_144] {
            for round in 0..4 {
                let v: Vec<f32> = (0..n)
                    .map(|_| match rng.next_u64() % 8 {
                        0 if round > 0 => specials[(rng.next_u64() % specials.len() as u64) as usize],
                        1 if round > 1 => 3.0,
                        _ => rng.f32() * if round == 3 { -1.0 } else { 1.0 },
                    })
                    .collect();
                assert_eq!(argmax(&v), scan(&v), "n={n} round {round}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NAN]), 0);
        assert_eq!(argmax(&[f32::NAN, -1.0, 2.0, 2.0]), 2);
    }

    /// `sum_exp` (SIMD exponentials on wasm32) is the f64 sum of `exp(x - max)` over the values
    /// that are not NaN, within 1e-6 of it; minus infinity adds (next to) nothing.
    #[test]
    fn sum_exp_matches_the_f64_sum() {
        let mut rng = Rng(seed());
        for n in [0usize, 1, 3, 4, 5, 17, 1000, 262_144] {
            let mut v: Vec<f32> = (0..n).map(|_| rng.f32() * 20.0 - 10.0).collect();
            for i in (0..n).step_by(97) {
                v[i] = if i % 2 == 0 { f32::NAN } else { f32::NEG_INFINITY };
            }
            let max = max_value(&v);
            let exact: f64 = v.iter().filter(|x| !x.is_nan()).map(|&x| ((x - max) as f64).exp()).sum();
            let got = sum_exp(&v, max);
            assert!((got - exact).abs() <= 1e-6 * exact + 1e-30, "n={n}: {got} vs {exact}");
        }
    }

    #[test]
    fn dot_matches_the_exact_sum() {
        let mut rng = Rng(seed());
        for n in [0usize, 1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 256, 1000] {
            let a: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - exact).abs() <= 1e-5 * (1.0 + n as f64), "dot n={n}");
        }
    }

    /// The attention kernels against their definitions in f64, on strided rows (a KV cache's
    /// rows hold every key/value head).
    #[test]
    fn dot_rows_and_weighted_sum_match_their_definitions() {
        let mut rng = Rng(seed());
        for (n, rows, stride) in [(256usize, 7usize, 512usize), (64, 1, 64), (36, 5, 40), (3, 4, 3), (256, 0, 256)] {
            let data: Vec<f32> = (0..rows.max(1) * stride + n).map(|_| rng.f32()).collect();
            let q: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            let mut scores = vec![0f32; rows];
            dot_rows(&q, &data, stride, 0.5, &mut scores);
            for (j, s) in scores.iter().enumerate() {
                let exact: f64 = (0..n).map(|i| q[i] as f64 * data[j * stride + i] as f64).sum::<f64>() * 0.5;
                assert!((*s as f64 - exact).abs() <= 1e-5 * (1.0 + n as f64), "dot_rows n={n} row {j}");
            }
            let start: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            let mut out = start.clone();
            weighted_sum(&scores, &data, stride, &mut out);
            for i in 0..n {
                let exact = start[i] as f64 + (0..rows).map(|j| scores[j] as f64 * data[j * stride + i] as f64).sum::<f64>();
                assert!((out[i] as f64 - exact).abs() <= 1e-5 * (1.0 + rows as f64), "weighted_sum n={n} element {i}");
            }
        }
    }

    #[test]
    fn the_gates_match_their_scalar_definitions() {
        let mut rng = Rng(seed());
        // Ordinary values, the tails where e^x clamps, and the lengths with a scalar remainder.
        for n in [0usize, 1, 5, 64, 1001] {
            let g: Vec<f32> = (0..n).map(|i| rng.f32() * if i % 7 == 0 { 60.0 } else { 4.0 }).collect();
            let u: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            for act in [Act::GeluTanh, Act::Silu] {
                let mut y = g.clone();
                gate(act, &mut y, &u);
                for i in 0..n {
                    let x = g[i] as f64;
                    let exact = match act {
                        Act::GeluTanh => 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()),
                        Act::Silu => x / (1.0 + (-x).exp()),
                    } * u[i] as f64;
                    let err = (y[i] as f64 - exact).abs();
                    assert!(err <= 1e-6 * (1.0 + exact.abs()), "{act:?} g={} u={}: {} vs {exact}", g[i], u[i], y[i]);
                }
            }
        }
    }

    #[test]
    fn softmax_matches_the_scalar_reference() {
        let mut rng = Rng(seed());
        for n in [1usize, 3, 4, 17, 512] {
            let x: Vec<f32> = (0..n).map(|_| rng.f32() * 30.0).collect();
            let (mut a, mut b) = (x.clone(), x.clone());
            softmax(&mut a);
            scalar::softmax(&mut b);
            for (a, b) in a.iter().zip(&b) {
                assert!((a - b).abs() <= 1e-6 * (b.abs() + 1e-30) + 1e-7, "n={n}: {a} vs {b}");
            }
            assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-5, "n={n}");
        }
    }

    /// `x` (`t` rows) quantized to int8, and its `fast` product with `q`.
    fn product8(q: &QMatrix, x: &[f32], t: usize) -> (QActs8, Vec<f32>) {
        let mut acts = QActs8::default();
        acts.quantize(x, t, q.n_in);
        let mut y = vec![0f32; t * q.n_out];
        matmul_q8(q, &acts, &mut RowScratch::default(), &mut y);
        (acts, y)
    }

    /// Random blocks of `kind` as ggml writes them: Q8_0 values in -127..=127.
    pub(super) fn ggml_blocks(kind: TensorType, n: usize, rng: &mut Rng) -> Vec<u8> {
        let mut data = random_blocks(kind, n, rng);
        if kind == TensorType::Q8_0 {
            for block in data.chunks_exact_mut(34) {
                block[2..].iter_mut().filter(|v| **v == 0x80).for_each(|v| *v = 0x81);
            }
        }
        data
    }

    /// The formats the int8 products take (all of them).
    const INT8_KINDS: [TensorType; 11] = LAYOUT_KINDS;

    #[test]
    fn the_int8_products_take_every_format_but_a_q8_0_with_a_minus_128() {
        let mut rng = Rng(seed());
        for kind in INT8_KINDS {
            let n_in = kind.block().0 as usize;
            let q = QMatrix::from_blocks(kind, &ggml_blocks(kind, 2 * n_in, &mut rng), 2, n_in).unwrap();
            assert!(takes_int8(&q), "{kind:?}");
            // Every value, taken unsigned (Q8_0's: its magnitude), is at most 127, and below 64
            // where the kernels add two lanes of products in i16.
            let offset = unsigned_offset(&q);
            let values: Vec<i32> = (0..n_in).map(|c| q.value(1, c) as i32 + offset).map(|v| if offset == 0 { v.abs() } else { v }).collect();
            let bound = if offset == 0 && matches!(q.values, quant::Values::I8(_)) { 128 } else { 64 };
            assert!(values.iter().all(|v| (0..bound).contains(v)), "{kind:?} {offset}: {values:?}");
        }
        // A Q8_0 block with a -128 (which ggml never writes) stays on the exact products.
        let mut block = random_blocks(TensorType::Q8_0, 32, &mut rng);
        block[2 + 5] = 0x80;
        let q = QMatrix::from_blocks(TensorType::Q8_0, &block, 1, 32).unwrap();
        assert!(q.i8_min && !takes_int8(&q));
    }

    /// The int8 products, as `matmul_q8` runs them (SIMD on wasm32, relaxed or not), equal the
    /// scalar definition (`scalar::dot_q8`) bit for bit; and the definition is the product of
    /// the dequantized weights with the int8 activations, up to f32 rounding, and within the
    /// int8 activations' half step of the product with the activations themselves.
    #[test]
    fn matmul_q8_is_its_scalar_definition() {
        let mut rng = Rng(seed());
        for kind in INT8_KINDS {
            let (block, _) = kind.block();
            for &t in &[1usize, 3, 4, 5, 8, 9] {
                let blocks = 1 + (rng.next_u64() % 3) as usize;
                let n_in = block as usize * blocks * if block == 32 { 1 + (rng.next_u64() % 11) as usize } else { 1 };
                let n_out = 1 + (rng.next_u64() % 9) as usize;
                let data = ggml_blocks(kind, n_out * n_in, &mut rng);
                let q = QMatrix::from_blocks(kind, &data, n_out, n_in).unwrap();
                let mut w = vec![0f32; n_out * n_in];
                quant::dequantize(kind, &data, &mut w);
                let x = activations(&mut rng, t * n_in);
                let (acts, y) = product8(&q, &x, t);
                let mut reference = vec![0f32; t * n_out];
                scalar::matmul_q8(&q, &acts, &mut RowScratch::default(), &mut reference);
                for (i, (a, b)) in y.iter().zip(&reference).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{kind:?} t={t} [{n_out}, {n_in}] output {i}: {a} vs the definition's {b}");
                }
                for tok in 0..t {
                    let xr = &x[tok * n_in..(tok + 1) * n_in];
                    let xq: Vec<f64> = (0..n_in).map(|i| acts.q[tok * n_in + i] as f64 * acts.s[tok * n_in / 32 + i / 32] as f64).collect();
                    for r in 0..n_out {
                        let wr = &w[r * n_in..(r + 1) * n_in];
                        let on_int8: f64 = wr.iter().zip(&xq).map(|(a, b)| *a as f64 * b).sum();
                        let exact: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let magnitude: f64 = wr.iter().zip(&xq).map(|(a, b)| (*a as f64 * b).abs()).sum();
                        let half_steps: f64 = (0..n_in / 32)
                            .map(|b| {
                                let wsum: f64 = wr[32 * b..32 * b + 32].iter().map(|v| v.abs() as f64).sum();
                                wsum * acts.s[tok * n_in / 32 + b] as f64 / 2.0
                            })
                            .sum();
                        let got = y[tok * n_out + r] as f64;
                        let tol = 1e-5 * magnitude + 1e-6;
                        assert!((got - on_int8).abs() <= tol, "{kind:?} t={t} token {tok} row {r}: {got} vs {on_int8} (tol {tol})");
                        assert!((got - exact).abs() <= 1.01 * half_steps + tol, "{kind:?} t={t} token {tok} row {r}: {got} vs exact {exact}");
                    }
                }
            }
        }
    }

    /// As `a_tokens_products_do_not_depend_on_its_batch`, for the int8 products.
    #[test]
    fn a_tokens_int8_products_do_not_depend_on_its_batch() {
        let mut rng = Rng(seed());
        for kind in INT8_KINDS {
            let (block, _) = kind.block();
            for blocks in [1usize, 4, 5, 8, 11] {
                let n_in = (32 * blocks.max(block as usize / 32)).div_ceil(block as usize) * block as usize;
                let n_out = 1 + (rng.next_u64() % 6) as usize;
                let q = QMatrix::from_blocks(kind, &ggml_blocks(kind, n_out * n_in, &mut rng), n_out, n_in).unwrap();
                for t in [2usize, 4, 5, 8, 9, 13] {
                    let x = activations(&mut rng, t * n_in);
                    let (_, y) = product8(&q, &x, t);
                    for tok in 0..t {
                        let (_, y1) = product8(&q, &x[tok * n_in..(tok + 1) * n_in], 1);
                        let row = &y[tok * n_out..(tok + 1) * n_out];
                        assert!(
                            row.iter().zip(&y1).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{kind:?} [{n_out}, {n_in}] token {tok} of {t}: {row:?} in the batch, {y1:?} alone"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn quantize8_matches_the_scalar_reference() {
        let mut rng = Rng(seed());
        let mut x = activations(&mut rng, 32 * 40);
        // A zero block, a block with a NaN and one with an infinity.
        x[..32].fill(0.0);
        x[40] = f32::NAN;
        x[70] = f32::INFINITY;
        let mut acts = QActs8::default();
        acts.quantize(&x, 5, 32 * 8);
        assert_eq!(acts.q.as_ptr() as usize % 16, 0);
        for b in 0..40 {
            let mut q = [0i8; 32];
            let (s, halves) = scalar::quantize_block8(&x[32 * b..32 * b + 32], &mut q);
            assert_eq!(&acts.q[32 * b..32 * b + 32], &q, "block {b}");
            assert_eq!(acts.s[b].to_bits(), s.to_bits(), "block {b}");
            assert_eq!(&acts.qsum16[2 * b..2 * b + 2], &halves, "block {b}");
            assert_eq!(acts.qsum[b], halves[0] + halves[1], "block {b}");
            assert!(!q.contains(&i8::MIN), "block {b}: {q:?}");
            for (i, v) in x[32 * b..32 * b + 32].iter().enumerate() {
                assert!(!v.is_finite() || !s.is_finite() || (q[i] as f32 * s - v).abs() <= 0.51 * s, "block {b} element {i}");
            }
        }
        assert!(acts.q16.iter().zip(acts.q.iter()).all(|(w, &v)| *w == v as i16) && acts.q16.len() == acts.q.len());
        assert_eq!(acts.q16.as_ptr() as usize % 16, 0);
    }

    #[test]
    fn quantize_matches_the_scalar_reference() {
        let mut rng = Rng(seed());
        let mut x = activations(&mut rng, 32 * 40);
        // A zero block, a block with a NaN and one with an infinity.
        x[..32].fill(0.0);
        x[40] = f32::NAN;
        x[70] = f32::INFINITY;
        for b in 0..40 {
            let xb = &x[32 * b..32 * b + 32];
            let (mut q1, mut q2) = ([0i16; 32], [0i16; 32]);
            let (s1, sum1) = scalar::quantize_block(xb, &mut q1);
            let mut acts = QActs::default();
            acts.quantize(xb, 1, 32);
            q2.copy_from_slice(&acts.q);
            assert_eq!(q1, q2, "block {b}");
            assert_eq!(s1.to_bits(), acts.s[0].to_bits(), "block {b}");
            let sum2 = acts.sum[0];
            assert!(sum1 == sum2 || (sum1 - sum2).abs() <= 1e-5 * (1.0 + sum1.abs()) || (sum1.is_nan() && sum2.is_nan()), "block {b}: {sum1} vs {sum2}");
        }
    }

    #[test]
    fn quantized_activations_are_within_half_a_step() {
        let mut rng = Rng(seed());
        let x = activations(&mut rng, 4 * 64 + 3 * 64);
        let mut a = QActs::default();
        a.quantize(&x, 7, 64);
        // The SIMD kernels load the values as aligned v128.
        assert_eq!(a.q.as_ptr() as usize % 16, 0);
        for (i, v) in x.iter().enumerate() {
            let s = a.s[i / 32];
            // Half a step, plus the f32 rounding of `v / s` (a few thousandths of a step).
            assert!((a.q[i] as f32 * s - v).abs() <= 0.51 * s, "element {i}");
        }
        // The regrouped scales of 4-token groups hold the same values.
        assert_eq!(a.s4[(0 * 2 + 1) * 4 + 2], a.s[2 * 2 + 1]);
        assert_eq!(a.sum4[(0 * 2 + 1) * 4 + 3], a.sum[3 * 2 + 1]);
    }
}

/// Kernel benchmarks, run inside the guest on wasm32 under wasmtime (ignored by default):
/// `WISP_GUEST_TEST_ARGS="--ignored kernel_bench" cargo test --release -p wisp --test guest_on_wasm`
/// (and `attention_bench` likewise; see BENCHMARKS.md). The shapes are Gemma 3 270M's.
#[cfg(test)]
mod bench {
    use super::*;
    use crate::gguf::TensorType;
    use crate::quant::QMatrix;
    use super::tests::ggml_blocks;
    use crate::quant::tests::{Rng, random_blocks};
    use std::time::Instant;

    /// The seconds one call of `f` takes: the best of 3 timings of `reps` calls.
    fn best_of_3(reps: usize, f: &mut dyn FnMut()) -> f64 {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let start = Instant::now();
            for _ in 0..reps {
                f();
            }
            best = best.min(start.elapsed().as_secs_f64() / reps as f64);
        }
        best
    }

    /// The formats the benchmarks time (Gemma 3 270M Q4_K_M's).
    const KINDS: [TensorType; 4] = [TensorType::Q8_0, TensorType::Q5_0, TensorType::Q4K, TensorType::Q6K];

    /// The attention kernels of one layer's query token, where the time goes: 4 query heads over
    /// one key/value head of 256 (Gemma 3 270M), `n` keys. By hand, like `kernel_bench`.
    #[test]
    #[ignore]
    fn attention_bench() {
        let hd = 256;
        println!("{:>6} {:>12} {:>12} {:>12} {:>10}", "keys", "dot_rows us", "softmax us", "wsum us", "GFLOP/s");
        let mut rng = Rng(0x9E3779B97F4A7C15);
        for n in [128usize, 512, 2048] {
            let k: Vec<f32> = (0..n * hd).map(|_| rng.f32()).collect();
            let v: Vec<f32> = (0..n * hd).map(|_| rng.f32()).collect();
            let q: Vec<f32> = (0..4 * hd).map(|_| rng.f32()).collect();
            let mut scores = vec![0f32; n];
            let mut out = vec![0f32; hd];
            let reps = (4_000_000 / n).max(10);
            let time = |f: &mut dyn FnMut()| best_of_3(reps, f);
            let d = time(&mut || {
                for h in 0..4 {
                    dot_rows(&q[h * hd..(h + 1) * hd], &k, hd, 0.0625, &mut scores);
                }
            });
            let s = time(&mut || {
                for _ in 0..4 {
                    softmax(&mut scores);
                }
            });
            let w = time(&mut || {
                for _ in 0..4 {
                    weighted_sum(&scores, &v, hd, &mut out);
                }
            });
            let gflops = 2.0 * 2.0 * 4.0 * (n * hd) as f64 / (d + s + w) / 1e9;
            println!("{n:>6} {:>12.1} {:>12.1} {:>12.1} {gflops:>10.2}", d * 1e6, s * 1e6, w * 1e6);
        }
    }

    #[test]
    #[ignore]
    fn kernel_bench() {
        products_bench(false, &[1, 64], 1);
        // The memory's own rate here: a plain read of 256 MB, 64 bytes a step.
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        {
            use core::arch::wasm32::*;
            let buf = vec![1u8; 256 << 20];
            let mut best = f64::INFINITY;
            let mut total = i32x4_splat(0);
            for _ in 0..3 {
                let start = Instant::now();
                let (mut a, mut b, mut c, mut d) = (i32x4_splat(0), i32x4_splat(0), i32x4_splat(0), i32x4_splat(0));
                for chunk in buf.chunks_exact(64) {
                    // SAFETY: four 16-byte loads inside a 64-byte chunk.
                    unsafe {
                        let p = chunk.as_ptr() as *const v128;
                        a = i32x4_add(a, v128_load(p));
                        b = i32x4_add(b, v128_load(p.add(1)));
                        c = i32x4_add(c, v128_load(p.add(2)));
                        d = i32x4_add(d, v128_load(p.add(3)));
                    }
                }
                total = i32x4_add(total, i32x4_add(i32x4_add(a, b), i32x4_add(c, d)));
                best = best.min(start.elapsed().as_secs_f64());
            }
            println!("plain read of 256 MB: {:.2} GB/s ({})", buf.len() as f64 / best / 1e9, i32x4_extract_lane::<0>(total));
        }
        // As decode reads them: many weights in turn, each read once from memory (64 MB of
        // file-format weights per kind, far beyond the L2 cache).
        let mut rng = Rng(0x2545F4914F6CDD1D);
        let mut scratch = RowScratch::default();
        for kind in KINDS {
            let (n_out, n_in) = (2048, 640);
            let (block, bytes) = kind.block();
            let count = (64 << 20) / (n_out * n_in / block as usize * bytes as usize);
            let ws: Vec<QMatrix> = (0..count)
                .map(|_| QMatrix::from_blocks(kind, &random_blocks(kind, n_out * n_in, &mut rng), n_out, n_in).unwrap())
                .collect();
            let x: Vec<f32> = (0..n_in).map(|i| ((i * 13) % 17) as f32 - 8.0).collect();
            let mut acts = QActs::default();
            acts.quantize(&x, 1, n_in);
            let mut y = vec![0f32; n_out];
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let start = Instant::now();
                for w in &ws {
                    matmul_q(w, &acts, &mut scratch, &mut y);
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            let bytes: usize = ws.iter().map(QMatrix::bytes).sum();
            let gflops = 2.0 * (count * n_out * n_in) as f64 / best / 1e9;
            let name = format!("{count} x [2048, 640] {}", kind.name());
            println!("{name:<28} {:>5} {:>10.3} {gflops:>10.1} {:>10.2}", 1, best * 1e3, bytes as f64 / best / 1e9);
        }
    }

    /// The `fast` products (`matmul_q8`, int8 activations) by number of tokens: decode is 1, a
    /// batched step of N sessions N, a prompt 64 or more. The same shapes as `kernel_bench`.
    #[test]
    #[ignore]
    fn kernel_bench8() {
        products_bench(true, &[1, 4, 8, 16, 64], 16);
    }

    /// The products of `kernel_bench` (`fast`: `kernel_bench8`) for each token count of `ts`
    /// (the output projection's up to `output_t`): the best of 3 timings of enough repeats.
    fn products_bench(fast: bool, ts: &[usize], output_t: usize) {
        println!("{:<28} {:>5} {:>10} {:>10} {:>10}", "weight", "t", "ms", "GFLOP/s", "weight GB/s");
        let shapes = [("[2048, 640]", 2048, 640), ("[640, 2048]", 640, 2048), ("output [262144, 640]", 262144, 640)];
        let mut rng = Rng(0x2545F4914F6CDD1D);
        let mut scratch = RowScratch::default();
        for (shape, n_out, n_in) in shapes {
            for kind in KINDS {
                let (block, _) = kind.block();
                if (n_out > 100_000 && kind != TensorType::Q8_0) || n_in % block as usize != 0 {
                    continue;
                }
                let w = QMatrix::from_blocks(kind, &ggml_blocks(kind, n_out * n_in, &mut rng), n_out, n_in).unwrap();
                assert!(!fast || takes_int8(&w));
                for &t in ts.iter().filter(|&&t| n_out < 100_000 || t <= output_t) {
                    let x: Vec<f32> = (0..t * n_in).map(|i| ((i * 13) % 17) as f32 - 8.0).collect();
                    let (mut acts, mut acts8) = (QActs::default(), QActs8::default());
                    match fast {
                        true => acts8.quantize(&x, t, n_in),
                        false => acts.quantize(&x, t, n_in),
                    }
                    let mut y = vec![0f32; t * n_out];
                    let mut product = || match fast {
                        true => matmul_q8(&w, &acts8, &mut scratch, &mut y),
                        false => matmul_q(&w, &acts, &mut scratch, &mut y),
                    };
                    product();
                    let reps = (2e9 / (2.0 * (t * n_out * n_in) as f64)).clamp(2.0, 200.0) as usize;
                    let best = best_of_3(reps, &mut product);
                    let gflops = 2.0 * (t * n_out * n_in) as f64 / best / 1e9;
                    let gbs = w.bytes() as f64 / best / 1e9;
                    let name = format!("{shape} {}", kind.name());
                    println!("{name:<28} {t:>5} {:>10.3} {gflops:>10.1} {gbs:>10.2}", best * 1e3);
                }
            }
        }
    }
}
