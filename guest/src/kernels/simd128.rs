//! wasm simd128 kernels (standard SIMD only: results are the same on every host).
//! Each mirrors a function of `scalar.rs` and is tested against it.

use super::QActs;
use crate::quant::{Group, QK, QMatrix};
use core::arch::wasm32::*;

#[inline(always)]
fn hsum(v: v128) -> f32 {
    f32x4_extract_lane::<0>(v)
        + f32x4_extract_lane::<1>(v)
        + f32x4_extract_lane::<2>(v)
        + f32x4_extract_lane::<3>(v)
}

/// Row `r` of `w` against `N` consecutive token rows of `x` starting at `tok`.
/// The weights of each block are widened once and used for all `N` tokens.
#[inline(always)]
unsafe fn dot_rows<const N: usize>(w: &QMatrix, r: usize, x: &QActs, tok: usize) -> [f32; N] {
    let n = w.n_in;
    let nb = n / QK;
    let mut acc = [f32x4_splat(0.0); N];
    unsafe {
        let q = w.q.as_ptr().add(r * n);
        for b in 0..nb {
            let w0 = v128_load(q.add(QK * b) as *const v128);
            let w1 = v128_load(q.add(QK * b + 16) as *const v128);
            let a0 = i16x8_extend_low_i8x16(w0);
            let a1 = i16x8_extend_high_i8x16(w0);
            let a2 = i16x8_extend_low_i8x16(w1);
            let a3 = i16x8_extend_high_i8x16(w1);
            for (i, acc) in acc.iter_mut().enumerate() {
                let row = tok + i;
                let xp = x.q.as_ptr().add(row * n + QK * b);
                let xs = *x.s.get_unchecked(row * nb + b);
                let lo = i32x4_add(
                    i32x4_dot_i16x8(a0, v128_load(xp as *const v128)),
                    i32x4_dot_i16x8(a1, v128_load(xp.add(8) as *const v128)),
                );
                let hi = i32x4_add(
                    i32x4_dot_i16x8(a2, v128_load(xp.add(16) as *const v128)),
                    i32x4_dot_i16x8(a3, v128_load(xp.add(24) as *const v128)),
                );
                match w.group {
                    Group::G32 => {
                        let d = *w.d.get_unchecked(r * nb + b) * xs;
                        let p = f32x4_convert_i32x4(i32x4_add(lo, hi));
                        *acc = f32x4_add(*acc, f32x4_mul(p, f32x4_splat(d)));
                    }
                    Group::G16 => {
                        let d0 = *w.d.get_unchecked(2 * (r * nb + b)) * xs;
                        let d1 = *w.d.get_unchecked(2 * (r * nb + b) + 1) * xs;
                        let p = f32x4_add(
                            f32x4_mul(f32x4_convert_i32x4(lo), f32x4_splat(d0)),
                            f32x4_mul(f32x4_convert_i32x4(hi), f32x4_splat(d1)),
                        );
                        *acc = f32x4_add(*acc, p);
                    }
                }
            }
        }
    }
    let mut out = [0f32; N];
    for i in 0..N {
        out[i] = hsum(acc[i]);
        if !w.m.is_empty() {
            let m = &w.m[r * nb..(r + 1) * nb];
            let s = &x.sum[(tok + i) * nb..(tok + i + 1) * nb];
            out[i] -= m.iter().zip(s).map(|(m, s)| m * s).sum::<f32>();
        }
    }
    out
}

/// `y[t, n_out] = x[t, n_in] @ W^T`. Rows outermost, so each weight row is read once from
/// memory and the (smaller) activations are re-read from cache.
pub fn matmul_q(w: &QMatrix, x: &QActs, y: &mut [f32]) {
    assert!(x.n == w.n_in && w.n_in % QK == 0 && y.len() == x.t * w.n_out);
    assert!(w.q.len() == w.n_out * w.n_in && x.q.len() >= x.t * x.n);
    let n_out = w.n_out;
    for r in 0..n_out {
        let mut tok = 0;
        // SAFETY: the asserts above bound every row and block index the kernel reads.
        unsafe {
            while tok + 4 <= x.t {
                let v = dot_rows::<4>(w, r, x, tok);
                for (i, v) in v.into_iter().enumerate() {
                    y[(tok + i) * n_out + r] = v;
                }
                tok += 4;
            }
            while tok < x.t {
                y[tok * n_out + r] = dot_rows::<1>(w, r, x, tok)[0];
                tok += 1;
            }
        }
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc0 = f32x4_splat(0.0);
    let mut acc1 = f32x4_splat(0.0);
    let mut i = 0;
    // SAFETY: every load is of 4 floats below `n`.
    unsafe {
        while i + 8 <= n {
            let pa = a.as_ptr().add(i) as *const v128;
            let pb = b.as_ptr().add(i) as *const v128;
            acc0 = f32x4_add(acc0, f32x4_mul(v128_load(pa), v128_load(pb)));
            acc1 = f32x4_add(acc1, f32x4_mul(v128_load(pa.add(1)), v128_load(pb.add(1))));
            i += 8;
        }
    }
    let mut s = hsum(f32x4_add(acc0, acc1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let va = f32x4_splat(a);
    let mut i = 0;
    // SAFETY: every load and store is of 4 floats below `n`.
    unsafe {
        while i + 4 <= n {
            let px = x.as_ptr().add(i) as *const v128;
            let py = y.as_mut_ptr().add(i) as *mut v128;
            v128_store(py, f32x4_add(v128_load(py), f32x4_mul(va, v128_load(px))));
            i += 4;
        }
    }
    while i < n {
        y[i] += a * x[i];
        i += 1;
    }
}
