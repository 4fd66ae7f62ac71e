//! Scalar reference kernels: the definition the SIMD versions are tested against, and the
//! kernels of targets without simd128.

use super::{QActs, QActs8, RowScratch};
use crate::quant::{QK, QMatrix};

/// One output of `matmul_q`: row `r` of `w`, given as its values `q` and scales `d`
/// (`QMatrix::row_values`, `row_scales`), against row `tok` of `x`.
pub fn dot_q(w: &QMatrix, r: usize, q: &[i8], d: &[f32], x: &QActs, tok: usize) -> f32 {
    let n = w.n_in;
    let g = w.group as usize;
    let xq = &x.q[tok * n..(tok + 1) * n];
    let xs = &x.s[tok * n / QK..(tok + 1) * n / QK];
    let mut acc = 0f32;
    for c in 0..n / g {
        let isum: i32 = (c * g..(c + 1) * g).map(|i| q[i] as i32 * xq[i] as i32).sum();
        acc += isum as f32 * (d[c] * xs[c * g / QK]);
    }
    if !w.m.is_empty() {
        let m = &w.m[r * n / QK..(r + 1) * n / QK];
        let xsum = &x.sum[tok * n / QK..(tok + 1) * n / QK];
        acc -= m.iter().zip(xsum).map(|(m, s)| m * s).sum::<f32>();
    }
    acc
}

/// `y[t, n_out] = x[t, n_in] @ W^T`
pub fn matmul_q(w: &QMatrix, x: &QActs, scratch: &mut RowScratch, y: &mut [f32]) {
    each_output(w, x.t, scratch, y, |r, q, d, tok| dot_q(w, r, q, d, x, tok));
}

/// `y[tok, r] = dot(r, values, scales, tok)` for every row `r` of `w` and token `tok` of `t`,
/// each row's values and scales unpacked into `scratch` once.
fn each_output(w: &QMatrix, t: usize, scratch: &mut RowScratch, y: &mut [f32], dot: impl Fn(usize, &[i8], &[f32], usize) -> f32) {
    scratch.q.resize(w.n_in, 0);
    scratch.d.resize(w.n_in / w.group as usize, 0.0);
    for r in 0..w.n_out {
        w.row_values(r, &mut scratch.q);
        w.row_scales(r, &mut scratch.d);
        for tok in 0..t {
            y[tok * w.n_out + r] = dot(r, &scratch.q, &scratch.d, tok);
        }
    }
}

/// One output of `matmul_q8`: row `r` of `w` (values `q`, scales `d`) against row `tok` of
/// `x`. Per block the exact integer product `isum` (and for a scale per 16, one per half),
/// then in f32 `((isum * d) - m * qsum) * s` (without mins `(isum * d) * s`; per 16
/// `((isum_lo * d_lo) + (isum_hi * d_hi)) * s`); the blocks of each full four summed into four
/// partial sums by block modulo 4, those added in order, then the last blocks one by one.
pub fn dot_q8(w: &QMatrix, r: usize, q: &[i8], d: &[f32], x: &QActs8, tok: usize) -> f32 {
    let n = w.n_in;
    let nb = n / QK;
    let xq = &x.q[tok * n..(tok + 1) * n];
    let isum = |lo: usize, hi: usize| (lo..hi).map(|i| q[i] as i32 * xq[i] as i32).sum::<i32>();
    let term = |b: usize| {
        let s = x.s[tok * nb + b];
        if w.group == crate::quant::Group::G16 {
            let (lo, hi) = (isum(QK * b, QK * b + 16) as f32, isum(QK * b + 16, QK * b + 32) as f32);
            return (lo * d[2 * b] + hi * d[2 * b + 1]) * s;
        }
        let t = isum(QK * b, QK * (b + 1)) as f32 * d[b];
        match w.m.is_empty() {
            true => t * s,
            false => (t - w.m[r * nb + b] * x.qsum[tok * nb + b] as f32) * s,
        }
    };
    let full = nb / 4 * 4;
    let mut parts = [0f32; 4];
    for b in 0..full {
        parts[b % 4] += term(b);
    }
    let mut out = ((parts[0] + parts[1]) + parts[2]) + parts[3];
    for b in full..nb {
        out += term(b);
    }
    out
}

/// `y[t, n_out] = x[t, n_in] @ W^T`, int8 activations.
pub fn matmul_q8(w: &QMatrix, x: &QActs8, scratch: &mut RowScratch, y: &mut [f32]) {
    each_output(w, x.t, scratch, y, |r, q, d, tok| dot_q8(w, r, q, d, x, tok));
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// The largest value, NaNs skipped (minus infinity when there is none).
pub fn max_value(v: &[f32]) -> f32 {
    v.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

pub fn sum_exp(v: &[f32], max: f32) -> f64 {
    v.iter().filter(|x| !x.is_nan()).map(|&x| (x - max).exp() as f64).sum()
}

pub fn scale_mul(x: &mut [f32], w: &[f32], k: f32) {
    for (v, w) in x.iter_mut().zip(w) {
        *v *= k * w;
    }
}

pub fn add(x: &mut [f32], y: &[f32]) {
    for (v, y) in x.iter_mut().zip(y) {
        *v += y;
    }
}

pub fn rotate_pairs(a: &mut [f32], b: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (((a, b), c), s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
        let (x0, x1) = (*a, *b);
        *a = x0 * c - x1 * s;
        *b = x0 * s + x1 * c;
    }
}

pub fn dot_rows(q: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = scale * dot(q, &rows[j * stride..j * stride + q.len()]);
    }
}

pub fn weighted_sum(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    for (j, &wj) in w.iter().enumerate() {
        for (o, r) in out.iter_mut().zip(&rows[j * stride..]) {
            *o += wj * r;
        }
    }
}

/// Quantizes one block of 32 activations into `q` (`x ≈ scale * q`, rounding half to even) and
/// returns `(scale, sum of x)`. NaN elements are skipped by the maximum and quantize to 0.
pub fn quantize_block(x: &[f32], q: &mut [i16]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 32767.0;
    let inv = if scale > 0.0 && scale.is_finite() { 1.0 / scale } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * inv).round_ties_even() as i16;
    }
    (scale, x.iter().sum())
}

/// Quantizes one block of 32 activations to int8 (`x ≈ scale * q`, `scale = max|x| / 127`,
/// rounding half to even; NaN elements skipped by the maximum and quantized to 0) and returns
/// `(scale, [sum of q[..16], sum of q[16..]])`.
pub fn quantize_block8(x: &[f32], q: &mut [i8]) -> (f32, [i32; 2]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale > 0.0 && scale.is_finite() { 1.0 / scale } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = ((v * inv).round_ties_even() as i32).clamp(-128, 127) as i8;
    }
    let half = |h: &[i8]| h.iter().map(|&v| v as i32).sum();
    (scale, [half(&q[..16]), half(&q[16..32])])
}

/// `g[i] = act(g[i]) * u[i]`, `act` the tanh GELU or SiLU.
pub fn gate(act: super::Act, g: &mut [f32], u: &[f32]) {
    for (g, u) in g.iter_mut().zip(u) {
        *g = super::activate(act, *g) * u;
    }
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
