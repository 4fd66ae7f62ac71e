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

/// `[sum(a), sum(b), sum(c), sum(d)]`: four horizontal sums at once.
#[inline(always)]
fn hsum4_i32(a: v128, b: v128, c: v128, d: v128) -> v128 {
    let ab = i32x4_add(i32x4_shuffle::<0, 4, 1, 5>(a, b), i32x4_shuffle::<2, 6, 3, 7>(a, b));
    let cd = i32x4_add(i32x4_shuffle::<0, 4, 1, 5>(c, d), i32x4_shuffle::<2, 6, 3, 7>(c, d));
    i32x4_add(i32x4_shuffle::<0, 1, 4, 5>(ab, cd), i32x4_shuffle::<2, 3, 6, 7>(ab, cd))
}

/// The 32 weights of one block widened to i16.
#[inline(always)]
unsafe fn widen(q: *const i8) -> [v128; 4] {
    unsafe {
        let w0 = v128_load(q as *const v128);
        let w1 = v128_load(q.add(16) as *const v128);
        [
            i16x8_extend_low_i8x16(w0),
            i16x8_extend_high_i8x16(w0),
            i16x8_extend_low_i8x16(w1),
            i16x8_extend_high_i8x16(w1),
        ]
    }
}

/// A load that stays where it is written. LLVM otherwise hoists every load of an unrolled
/// block to its top; Cranelift keeps the order of loads, so all of them would be live at once
/// and spill. In source order each is used right after it is made. `p` must be 16-byte aligned
/// (activations live in `AlignedI16`, and the kernels read them from multiples of 8 values).
#[inline(always)]
unsafe fn load_here(p: *const i16) -> v128 {
    debug_assert!((p as usize).is_multiple_of(16));
    unsafe { core::ptr::read_volatile(p as *const v128) }
}

/// Integer products of one block against 32 i16 activations: the sums of elements 0..16 and
/// 16..32, each as i32x4 partial sums.
#[inline(always)]
unsafe fn products(a: &[v128; 4], x: *const i16) -> (v128, v128) {
    unsafe {
        let lo = i32x4_add(i32x4_dot_i16x8(a[0], load_here(x)), i32x4_dot_i16x8(a[1], load_here(x.add(8))));
        let hi = i32x4_add(i32x4_dot_i16x8(a[2], load_here(x.add(16))), i32x4_dot_i16x8(a[3], load_here(x.add(24))));
        (lo, hi)
    }
}

/// The integer products of one block against 32 i16 activations, all 32 summed as i32x4
/// partial sums.
#[inline(always)]
unsafe fn products32(a: &[v128; 4], x: *const i16) -> v128 {
    unsafe {
        let (lo, hi) = products(a, x);
        i32x4_add(lo, hi)
    }
}

// The kernels below are unrolled by hand, without arrays indexed in loops: LLVM leaves such
// small loops rolled for wasm32, and their arrays then live in linear memory (a store and a
// load per value, and an epoch check per iteration under wasmtime) instead of in registers.

/// Row `r` of `w` against one token row `tok` of `x`. Blocks go four at a time: their integer
/// sums are reduced together and scaled with one vector multiply.
#[inline(always)]
unsafe fn dot_row(w: &QMatrix, r: usize, x: &QActs, tok: usize) -> f32 {
    let n = w.n_in;
    let nb = n / QK;
    unsafe {
        let q = w.q.as_ptr().add(r * n);
        let xq = x.q.as_ptr().add(tok * n);
        let xs = x.s.as_ptr().add(tok * nb);
        let block = |b: usize| (widen(q.add(QK * b)), xq.add(QK * b));
        let mut acc = f32x4_splat(0.0);
        let mut b = 0;
        match w.group {
            Group::G32 => {
                let d = w.d.as_ptr().add(r * nb);
                while b + 4 <= nb {
                    let (a0, x0) = block(b);
                    let p0 = products32(&a0, x0);
                    let (a1, x1) = block(b + 1);
                    let p1 = products32(&a1, x1);
                    let (a2, x2) = block(b + 2);
                    let p2 = products32(&a2, x2);
                    let (a3, x3) = block(b + 3);
                    let p3 = products32(&a3, x3);
                    let sums = f32x4_convert_i32x4(hsum4_i32(p0, p1, p2, p3));
                    let scale = f32x4_mul(v128_load(d.add(b) as *const v128), v128_load(xs.add(b) as *const v128));
                    acc = f32x4_add(acc, f32x4_mul(sums, scale));
                    b += 4;
                }
            }
            Group::G16 => {
                let d = w.d.as_ptr().add(2 * r * nb);
                while b + 4 <= nb {
                    let (a0, x0) = block(b);
                    let (l0, h0) = products(&a0, x0);
                    let (a1, x1) = block(b + 1);
                    let (l1, h1) = products(&a1, x1);
                    let (a2, x2) = block(b + 2);
                    let (l2, h2) = products(&a2, x2);
                    let (a3, x3) = block(b + 3);
                    let (l3, h3) = products(&a3, x3);
                    let s_lo = f32x4_convert_i32x4(hsum4_i32(l0, l1, l2, l3));
                    let s_hi = f32x4_convert_i32x4(hsum4_i32(h0, h1, h2, h3));
                    let d0 = v128_load(d.add(2 * b) as *const v128);
                    let d1 = v128_load(d.add(2 * b + 4) as *const v128);
                    let d_lo = i32x4_shuffle::<0, 2, 4, 6>(d0, d1);
                    let d_hi = i32x4_shuffle::<1, 3, 5, 7>(d0, d1);
                    let xs4 = v128_load(xs.add(b) as *const v128);
                    let p = f32x4_add(f32x4_mul(s_lo, d_lo), f32x4_mul(s_hi, d_hi));
                    acc = f32x4_add(acc, f32x4_mul(p, xs4));
                    b += 4;
                }
            }
        }
        let mut out = hsum(acc);
        // The last blocks of a row whose block count is not a multiple of 4.
        let g = w.group as usize;
        while b < nb {
            let (lo, hi) = products(&widen(q.add(QK * b)), xq.add(QK * b));
            let (lo, hi) = (hsum(f32x4_convert_i32x4(lo)), hsum(f32x4_convert_i32x4(hi)));
            let xs = *xs.add(b);
            out += match g {
                32 => (lo + hi) * *w.d.get_unchecked(r * nb + b) * xs,
                _ => (lo * *w.d.get_unchecked(2 * (r * nb + b)) + hi * *w.d.get_unchecked(2 * (r * nb + b) + 1)) * xs,
            };
            b += 1;
        }
        if !w.m.is_empty() {
            out -= super::scalar::dot(&w.m[r * nb..(r + 1) * nb], &x.sum[tok * nb..(tok + 1) * nb]);
        }
        out
    }
}

/// Row `r` of `w` against the 4 token rows of group `g` of `x` (tokens `4g..4g + 4`): each
/// block is widened once for the four tokens, and the four tokens' block sums are reduced and
/// scaled together. Returns the four outputs.
#[inline(always)]
unsafe fn dot_row_x4<const G16: bool, const MINS: bool>(w: &QMatrix, r: usize, x: &QActs, g: usize) -> v128 {
    let n = w.n_in;
    let nb = n / QK;
    unsafe {
        let q = w.q.as_ptr().add(r * n);
        let xq = x.q.as_ptr().add(4 * g * n);
        let s4 = x.s4.as_ptr().add(g * nb * 4);
        let mut acc = f32x4_splat(0.0);
        for b in 0..nb {
            let a = widen(q.add(QK * b));
            let x0 = xq.add(QK * b);
            let xs4 = v128_load(s4.add(4 * b) as *const v128);
            match G16 {
                false => {
                    let sums = hsum4_i32(
                        products32(&a, x0),
                        products32(&a, x0.add(n)),
                        products32(&a, x0.add(2 * n)),
                        products32(&a, x0.add(3 * n)),
                    );
                    let d = f32x4_splat(*w.d.get_unchecked(r * nb + b));
                    acc = f32x4_add(acc, f32x4_mul(f32x4_convert_i32x4(sums), f32x4_mul(d, xs4)));
                }
                true => {
                    let (l0, h0) = products(&a, x0);
                    let (l1, h1) = products(&a, x0.add(n));
                    let (l2, h2) = products(&a, x0.add(2 * n));
                    let (l3, h3) = products(&a, x0.add(3 * n));
                    let s_lo = f32x4_convert_i32x4(hsum4_i32(l0, l1, l2, l3));
                    let s_hi = f32x4_convert_i32x4(hsum4_i32(h0, h1, h2, h3));
                    let d0 = f32x4_splat(*w.d.get_unchecked(2 * (r * nb + b)));
                    let d1 = f32x4_splat(*w.d.get_unchecked(2 * (r * nb + b) + 1));
                    let p = f32x4_add(f32x4_mul(s_lo, d0), f32x4_mul(s_hi, d1));
                    acc = f32x4_add(acc, f32x4_mul(p, xs4));
                }
            }
            if MINS {
                let m = f32x4_splat(*w.m.get_unchecked(r * nb + b));
                acc = f32x4_sub(acc, f32x4_mul(m, v128_load(x.sum4.as_ptr().add((g * nb + b) * 4) as *const v128)));
            }
        }
        acc
    }
}

/// `y[t, n_out] = x[t, n_in] @ W^T`. Rows outermost, so each weight row is read once from
/// memory while the (smaller) activations stay in cache; tokens in groups of 4.
pub fn matmul_q(w: &QMatrix, x: &QActs, y: &mut [f32]) {
    let nb = w.n_in / QK;
    assert!(x.n == w.n_in && w.n_in % QK == 0 && y.len() == x.t * w.n_out);
    assert!(w.q.len() == w.n_out * w.n_in && w.d.len() == w.n_out * w.n_in / w.group as usize);
    assert!(w.m.is_empty() || w.m.len() == w.n_out * nb);
    assert!(x.q.len() >= x.t * x.n && x.s.len() >= x.t * nb && x.sum.len() >= x.t * nb);
    assert!(x.s4.len() >= x.t / 4 * nb * 4 && x.sum4.len() >= x.t / 4 * nb * 4);
    let n_out = w.n_out;
    let groups = x.t / 4;
    for r in 0..n_out {
        // SAFETY: the asserts above bound every row, block and token index the kernels read.
        unsafe {
            for g in 0..groups {
                let v = match (w.group, w.m.is_empty()) {
                    (Group::G32, true) => dot_row_x4::<false, false>(w, r, x, g),
                    (Group::G32, false) => dot_row_x4::<false, true>(w, r, x, g),
                    (Group::G16, true) => dot_row_x4::<true, false>(w, r, x, g),
                    (Group::G16, false) => dot_row_x4::<true, true>(w, r, x, g),
                };
                y[(4 * g) * n_out + r] = f32x4_extract_lane::<0>(v);
                y[(4 * g + 1) * n_out + r] = f32x4_extract_lane::<1>(v);
                y[(4 * g + 2) * n_out + r] = f32x4_extract_lane::<2>(v);
                y[(4 * g + 3) * n_out + r] = f32x4_extract_lane::<3>(v);
            }
            for tok in 4 * groups..x.t {
                y[tok * n_out + r] = dot_row(w, r, x, tok);
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

/// See `scalar::quantize_block`; the same `q` and scale, the sum in another order.
pub fn quantize_block(x: &[f32], q: &mut [i16]) -> (f32, f32) {
    assert!(x.len() == 32 && q.len() == 32);
    // SAFETY: eight loads of 4 floats from `x` and four stores of 8 i16 to `q`, both of 32.
    unsafe {
        let v: [v128; 8] = core::array::from_fn(|i| v128_load(x.as_ptr().add(4 * i) as *const v128));
        // `pmax` keeps its first operand when the second is NaN, as `f32::max` does.
        let mut m = f32x4_abs(v[0]);
        let mut sum = v[0];
        for &vi in &v[1..] {
            m = f32x4_pmax(m, f32x4_abs(vi));
            sum = f32x4_add(sum, vi);
        }
        let m = f32x4_pmax(m, i32x4_shuffle::<2, 3, 0, 1>(m, m));
        let m = f32x4_pmax(m, i32x4_shuffle::<1, 0, 3, 2>(m, m));
        let amax = f32x4_extract_lane::<0>(m);
        let scale = amax / 32767.0;
        let inv = f32x4_splat(if scale > 0.0 && scale.is_finite() { 1.0 / scale } else { 0.0 });
        let quant = |v: v128| i32x4_trunc_sat_f32x4(f32x4_nearest(f32x4_mul(v, inv)));
        for i in 0..4 {
            let pair = i16x8_narrow_i32x4(quant(v[2 * i]), quant(v[2 * i + 1]));
            v128_store(q.as_mut_ptr().add(8 * i) as *mut v128, pair);
        }
        (scale, hsum(sum))
    }
}

/// `e^x` for four lanes: Cody-Waite reduction by ln 2 and a degree-7 polynomial (Cephes'
/// `expf` coefficients), within 2 ulp of the exact value; inputs are clamped to
/// [-87.3, 88.7], so the result is finite and normal.
#[inline(always)]
fn exp4(x: v128) -> v128 {
    let x = f32x4_pmin(f32x4_pmax(x, f32x4_splat(-87.3)), f32x4_splat(88.7));
    let n = f32x4_nearest(f32x4_mul(x, f32x4_splat(core::f32::consts::LOG2_E)));
    let r = f32x4_sub(x, f32x4_mul(n, f32x4_splat(0.693_359_4)));
    let r = f32x4_sub(r, f32x4_mul(n, f32x4_splat(-2.121_944_4e-4)));
    let mut p = f32x4_splat(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = f32x4_add(f32x4_mul(p, r), f32x4_splat(c));
    }
    let p = f32x4_add(f32x4_add(f32x4_mul(f32x4_mul(p, r), r), r), f32x4_splat(1.0));
    let pow2 = i32x4_shl(i32x4_add(i32x4_trunc_sat_f32x4(n), i32x4_splat(127)), 23);
    f32x4_mul(p, pow2)
}

/// See `scalar::gate`: `act(g) = g / (1 + e^(-a(g)))` with `a(g) = 2 sqrt(2/pi) (g + 0.044715
/// g^3)` for the tanh GELU (`0.5 g (1 + tanh(a/2))` rewritten) and `a(g) = g` for SiLU.
pub fn gate(act: super::Act, g: &mut [f32], u: &[f32]) {
    let n = g.len().min(u.len());
    let mut i = 0;
    // SAFETY: every load and store is of 4 floats below `n`.
    unsafe {
        while i + 4 <= n {
            let pg = g.as_mut_ptr().add(i) as *mut v128;
            let x = v128_load(pg);
            let a = match act {
                super::Act::GeluTanh => {
                    let x3 = f32x4_mul(f32x4_mul(x, x), x);
                    let inner = f32x4_add(x, f32x4_mul(f32x4_splat(0.044715), x3));
                    f32x4_mul(f32x4_splat(2.0 * 0.797_884_6), inner)
                }
                super::Act::Silu => x,
            };
            let act = f32x4_div(x, f32x4_add(f32x4_splat(1.0), exp4(f32x4_neg(a))));
            v128_store(pg, f32x4_mul(act, v128_load(u.as_ptr().add(i) as *const v128)));
            i += 4;
        }
    }
    super::scalar::gate(act, &mut g[i..n], &u[i..n]);
}

/// See `scalar::softmax`: the same maximum, `e^x` four lanes at a time (`exp4`).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let n = x.len();
    let vmax = f32x4_splat(max);
    let mut vsum = f32x4_splat(0.0);
    let mut i = 0;
    // SAFETY: every load and store is of 4 floats below `n`.
    unsafe {
        while i + 4 <= n {
            let p = x.as_mut_ptr().add(i) as *mut v128;
            let e = exp4(f32x4_sub(v128_load(p), vmax));
            v128_store(p, e);
            vsum = f32x4_add(vsum, e);
            i += 4;
        }
    }
    let mut sum = hsum(vsum);
    for v in &mut x[i..] {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = f32x4_splat(1.0 / sum);
    let mut i = 0;
    // SAFETY: as above.
    unsafe {
        while i + 4 <= n {
            let p = x.as_mut_ptr().add(i) as *mut v128;
            v128_store(p, f32x4_mul(v128_load(p), inv));
            i += 4;
        }
    }
    let inv = 1.0 / sum;
    for v in &mut x[i..] {
        *v *= inv;
    }
}
