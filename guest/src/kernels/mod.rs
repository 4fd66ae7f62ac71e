//! CPU kernels. Each has a plain scalar version (`scalar`), the reference; on wasm32 with
//! simd128 the hot ones run a SIMD version (`simd128`), tested against the scalar one.
//!
//! Matrix products use integer dot products: the activations of each row are quantized to i16
//! with one f32 scale per block of 32 (`QActs`, relative error below 2^-15 per element), the
//! weights are `QMatrix` i8 values, and `i32x4.dot_i16x8_s` sums exact integer products before
//! one f32 multiply per group. This keeps every golden logit within ~1e-3 of f32 math.

pub mod scalar;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub mod simd128;

use crate::quant::QMatrix;

/// Activations `x[t, n]` quantized for the integer kernels: per block of 32 elements,
/// `x ≈ s * q` with `q: i16` and `s = max|x| / 32767`.
#[derive(Default)]
pub struct QActs {
    pub t: usize,
    pub n: usize,
    /// `[t, n]`
    pub q: Vec<i16>,
    /// `[t, n / 32]`
    pub s: Vec<f32>,
    /// `[t, n / 32]`: the exact sum of each block, for weight formats with mins.
    pub sum: Vec<f32>,
}

impl QActs {
    /// Quantizes `x[t, n]` (`n` a multiple of 32) into `self`, reusing its buffers.
    pub fn quantize(&mut self, x: &[f32], t: usize, n: usize) {
        debug_assert_eq!(x.len(), t * n);
        debug_assert_eq!(n % 32, 0);
        self.t = t;
        self.n = n;
        self.q.resize(t * n, 0);
        self.s.resize(t * n / 32, 0.0);
        self.sum.resize(t * n / 32, 0.0);
        for ((xb, qb), (s, sum)) in x
            .chunks_exact(32)
            .zip(self.q.chunks_exact_mut(32))
            .zip(self.s.iter_mut().zip(self.sum.iter_mut()))
        {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 32767.0;
            let inv = if scale > 0.0 && scale.is_finite() { 1.0 / scale } else { 0.0 };
            for (q, v) in qb.iter_mut().zip(xb) {
                *q = (v * inv).round() as i16;
            }
            *s = scale;
            *sum = xb.iter().sum();
        }
    }
}

/// `y[t, n_out] = x[t, n_in] @ W[n_out, n_in]^T` for a quantized weight; `x` given as `QActs`.
pub fn matmul_q(w: &QMatrix, x: &QActs, y: &mut [f32]) {
    debug_assert_eq!(x.n, w.n_in);
    debug_assert_eq!(y.len(), x.t * w.n_out);
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    simd128::matmul_q(w, x, y);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    scalar::matmul_q(w, x, y);
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

/// `y[i] += a * x[i]`
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    return simd128::axpy(a, x, y);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    return scalar::axpy(a, x, y);
}

/// `x = x / sqrt(mean(x^2) + eps) * w`, in place.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let ss = dot(x, x) / x.len() as f32;
    let k = 1.0 / (ss + eps).sqrt();
    for (v, w) in x.iter_mut().zip(w) {
        *v *= k * w;
    }
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// `x[i] = exp(x[i] - max) / sum`, in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}
