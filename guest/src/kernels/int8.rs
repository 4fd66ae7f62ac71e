//! wasm SIMD kernels of the `fast` products: int8 activations (`QActs8`) against the weights'
//! values as 7-bit unsigned numbers (nibbles before their offset, Q6_K's values plus 32, Q8_0's
//! magnitudes with their signs moved onto the activations), so that 16 byte products are one
//! relaxed-SIMD instruction where the guest is built with `relaxed-simd`, and a few standard
//! ones where not. Both give the same bits: every product and sum is an exact integer (no lane
//! saturates), and the f32 steps after them are the same. Each kernel mirrors
//! `scalar::dot_q8` and is tested against it.

use super::simd128::{I8, NIB, NIB5, Row, block_unsigned, hsum, hsum4_i32, layout_holds, load_weights, plane, scale, scales4, storage};
use super::{QActs8, RowScratch};
use crate::quant::{Group, QK, QMatrix, Scales};
use core::arch::wasm32::*;

/// The 16 products `a[i] u[i]` (`a` and `u` in -127..=127, `u` not negative) as i32x4 partial
/// sums. With relaxed SIMD, byte products summed in pairs (no i16 lane saturates: each is
/// within ±32,258, and `u` is a 7-bit number, as the instruction's result on every engine
/// needs); without, widened to i16 and summed in pairs as i32. The lanes differ between the
/// two, their total does not, and the kernels only ever use the total of each block's lanes.
#[inline(always)]
fn sum16(a: v128, u: v128) -> v128 {
    #[cfg(target_feature = "relaxed-simd")]
    return i32x4_extadd_pairwise_i16x8(i16x8_relaxed_dot_i8x16_i7x16(a, u));
    // Not `i16x8.extmul`: LLVM knows `u` is not negative, and its rewrites of a product of a
    // sign-extended `a` and a zero-extended `u` gave wrong products (the one-token Q6_K kernel
    // and a tail of Q5_0 blocks, on rustc 1.95). `i32x4.dot_i16x8_s` of the widened values
    // leaves it nothing to rewrite.
    #[cfg(not(target_feature = "relaxed-simd"))]
    i32x4_add(
        i32x4_dot_i16x8(i16x8_extend_low_i8x16(a), i16x8_extend_low_i8x16(u)),
        i32x4_dot_i16x8(i16x8_extend_high_i8x16(a), i16x8_extend_high_i8x16(u)),
    )
}

/// The 32 products of one block as i32x4 partial sums (lanes as `sum16`'s), `u` below 64.
#[inline(always)]
fn sum32((a_lo, a_hi): (v128, v128), (u_lo, u_hi): (v128, v128)) -> v128 {
    // Two blocks' halves summed in i16 before widening: within i16 (each lane within ±16,002).
    #[cfg(target_feature = "relaxed-simd")]
    return i32x4_extadd_pairwise_i16x8(i16x8_add(i16x8_relaxed_dot_i8x16_i7x16(a_lo, u_lo), i16x8_relaxed_dot_i8x16_i7x16(a_hi, u_hi)));
    #[cfg(not(target_feature = "relaxed-simd"))]
    i32x4_add(sum16(a_lo, u_lo), sum16(a_hi, u_hi))
}

/// `a` with the signs of `w`'s values: `-a[i]` where `w[i] < 0` (`neg` is `w < 0`, lane by lane).
#[inline(always)]
fn flip(a: v128, neg: v128) -> v128 {
    i8x16_sub(v128_xor(a, neg), neg)
}

/// The products of one block of Q8_0's signed values `w` (none -128) and activations `a`:
/// each value's sign moved onto its activation, its magnitude the unsigned operand. The halves
/// are widened apart (a lane of pair products reaches ±32,258).
#[inline(always)]
fn sum32_signed((a_lo, a_hi): (v128, v128), (w_lo, w_hi): (v128, v128)) -> v128 {
    let zero = i8x16_splat(0);
    let half = |a: v128, w: v128| sum16(flip(a, i8x16_lt(w, zero)), i8x16_abs(w));
    i32x4_add(half(a_lo, w_lo), half(a_hi, w_hi))
}

/// One block's products for a row of storage `V`: Q8_0's signed values (`I8`) or unsigned ones.
#[inline(always)]
fn block_sum<const V: u8>(a: (v128, v128), w: (v128, v128)) -> v128 {
    if V == I8 { sum32_signed(a, w) } else { sum32(a, w) }
}

/// The sum of an i32x4's lanes (exact: a block's products fit i32).
#[inline(always)]
fn lanes(v: v128) -> i32 {
    i32x4_extract_lane::<0>(v) + i32x4_extract_lane::<1>(v) + i32x4_extract_lane::<2>(v) + i32x4_extract_lane::<3>(v)
}

/// 32 activations from `p` (16-byte aligned), loaded where written (see `simd128::load_here`).
#[inline(always)]
unsafe fn acts(p: *const i8) -> (v128, v128) {
    debug_assert!((p as usize).is_multiple_of(16));
    unsafe { (core::ptr::read_volatile(p as *const v128), core::ptr::read_volatile(p.add(16) as *const v128)) }
}

/// 8 i16 activations from `p` (16-byte aligned), loaded where written.
#[inline(always)]
unsafe fn acts16(p: *const i16) -> v128 {
    debug_assert!((p as usize).is_multiple_of(16));
    unsafe { core::ptr::read_volatile(p as *const v128) }
}

/// Q6_K's values (-32..=31, i8) of block `b` as unsigned ones, plus 32.
#[inline(always)]
unsafe fn block_q6(row: Row, b: usize) -> (v128, v128) {
    unsafe {
        let q = row.q.add(QK * b) as *const u8;
        let k = i8x16_splat(32);
        (i8x16_add(load_weights(q), k), i8x16_add(load_weights(q.add(16)), k))
    }
}

/// The unsigned values of block `b` of a packed G32 row (`NIB`, `NIB5`), or the values of an
/// `I8` row as they are stored (Q8_0's signed ones, or a row `unpack_row` made).
#[inline(always)]
unsafe fn block<const V: u8>(row: Row, b: usize, plane: v128, k: u32) -> (v128, v128) {
    unsafe {
        if V == I8 {
            let q = row.q.add(QK * b) as *const u8;
            return (load_weights(q), load_weights(q.add(16)));
        }
        block_unsigned::<V>(row, b, plane, k)
    }
}

/// `offset` (`Offset`) times `qs`.
#[inline(always)]
fn times_offset(qs: v128, offset: Offset) -> v128 {
    v128_and(i32x4_shl(qs, offset.shift), offset.mask)
}

/// An offset of the weights' unsigned values, 0 or a power of two (`unsigned_offset`), as a
/// shift and a mask: no vector multiply on the kernels' paths.
#[derive(Clone, Copy)]
struct Offset {
    shift: u32,
    mask: v128,
}

impl Offset {
    fn new(offset: i32) -> Offset {
        debug_assert!(offset == 0 || (offset as u32).is_power_of_two());
        Offset { shift: (offset as u32).trailing_zeros() % 32, mask: i32x4_splat(if offset == 0 { 0 } else { -1 }) }
    }
}

/// The term of four G32 blocks `b..b + 4` (lanes) of one token: `((isum * d) - m * qsum) * s`,
/// `isum` the block's integer product less `offset * qsum` (no mins: `(isum * d) * s`).
#[inline(always)]
unsafe fn terms4<const F16: bool, const MINS: bool>(row: Row, b: usize, sums: v128, x: &QActs8, tok: usize, offset: Offset) -> v128 {
    let nb = x.n / QK;
    unsafe {
        let qs = v128_load(x.qsum.as_ptr().add(tok * nb + b) as *const v128);
        let xs = v128_load(x.s.as_ptr().add(tok * nb + b) as *const v128);
        let isum = i32x4_sub(sums, times_offset(qs, offset));
        let mut t = f32x4_mul(f32x4_convert_i32x4(isum), scales4::<F16>(row, b));
        if MINS {
            t = f32x4_sub(t, f32x4_mul(v128_load(row.m.add(b) as *const v128), f32x4_convert_i32x4(qs)));
        }
        f32x4_mul(t, xs)
    }
}

/// `row` (G32, `NIB` or `NIB5`) against one token row `tok` of `x`, reading the packed weights.
/// Blocks go four at a time into four lanes, which are summed at the end, then the last
/// blocks one by one (`tail_g32`).
#[inline(always)]
unsafe fn dot_row_g32<const V: u8, const F16: bool, const MINS: bool>(row: Row, n: usize, x: &QActs8, tok: usize, offset: i32) -> f32 {
    let nb = n / QK;
    let off = Offset::new(offset);
    unsafe {
        let xq = x.q.as_ptr().add(tok * n);
        let mut acc = f32x4_splat(0.0);
        let mut b = 0;
        while b + 4 <= nb {
            let bits = plane::<V>(row, b);
            let p0 = block_sum::<V>(acts(xq.add(QK * b)), block::<V>(row, b, bits, 0));
            let p1 = block_sum::<V>(acts(xq.add(QK * (b + 1))), block::<V>(row, b + 1, bits, 1));
            let p2 = block_sum::<V>(acts(xq.add(QK * (b + 2))), block::<V>(row, b + 2, bits, 2));
            let p3 = block_sum::<V>(acts(xq.add(QK * (b + 3))), block::<V>(row, b + 3, bits, 3));
            acc = f32x4_add(acc, terms4::<F16, MINS>(row, b, hsum4_i32(p0, p1, p2, p3), x, tok, off));
            b += 4;
        }
        tail_g32::<V, F16, MINS>(row, n, x, tok, b, hsum(acc), offset)
    }
}

/// The end of `dot_row_g32` from block `b` on (`out` the sum before): each block's term as
/// `terms4` makes it, added in block order.
#[inline(always)]
unsafe fn tail_g32<const V: u8, const F16: bool, const MINS: bool>(row: Row, n: usize, x: &QActs8, tok: usize, mut b: usize, mut out: f32, offset: i32) -> f32 {
    let nb = n / QK;
    unsafe {
        let xq = x.q.as_ptr().add(tok * n);
        while b < nb {
            // The block's place in its four as a constant: its fifth bits' shifts are then
            // constants too.
            let bits = plane::<V>(row, b);
            let u = match b % 4 {
                0 => block::<V>(row, b, bits, 0),
                1 => block::<V>(row, b, bits, 1),
                2 => block::<V>(row, b, bits, 2),
                _ => block::<V>(row, b, bits, 3),
            };
            let p = block_sum::<V>(acts(xq.add(QK * b)), u);
            let qs = *x.qsum.get_unchecked(tok * nb + b);
            let mut t = (lanes(p) - qs * offset) as f32 * scale::<F16>(row, b);
            if MINS {
                t -= *row.m.add(b) * qs as f32;
            }
            out += t * *x.s.get_unchecked(tok * nb + b);
            b += 1;
        }
        out
    }
}

/// `row` (G16: Q6_K's i8 values, f32 scales) against one token row `tok` of `x`: per block
/// `((s_lo * d_lo) + (s_hi * d_hi)) * s`, `s_lo` and `s_hi` its halves' integer products.
#[inline(always)]
unsafe fn dot_row_g16(row: Row, n: usize, x: &QActs8, tok: usize) -> f32 {
    let nb = n / QK;
    let full = nb / 4 * 4;
    // The blocks of each full four into four partial sums (lanes), as `dot_row_x4` sums them.
    let mut parts = [0f32; 4];
    for b in 0..full {
        // SAFETY: as for `tail_g16`.
        parts[b % 4] += unsafe { term_g16(row, n, x, tok, b) };
    }
    unsafe { tail_g16(row, n, x, tok, full, ((parts[0] + parts[1]) + parts[2]) + parts[3]) }
}

/// Block `b`'s term of `dot_row_g16`.
#[inline(always)]
unsafe fn term_g16(row: Row, n: usize, x: &QActs8, tok: usize, b: usize) -> f32 {
    let nb = n / QK;
    unsafe {
        let (a_lo, a_hi) = acts(x.q.as_ptr().add(tok * n + QK * b));
        let (u_lo, u_hi) = block_q6(row, b);
        let q16 = x.qsum16.as_ptr().add(tok * 2 * nb + 2 * b);
        let s_lo = lanes(sum16(a_lo, u_lo)) - 32 * *q16;
        let s_hi = lanes(sum16(a_hi, u_hi)) - 32 * *q16.add(1);
        (s_lo as f32 * *row.d32.add(2 * b) + s_hi as f32 * *row.d32.add(2 * b + 1)) * *x.s.as_ptr().add(tok * nb + b)
    }
}

/// The end of `dot_row_g16` from block `b` on, as `tail_g32` is of `dot_row_g32`.
#[inline(always)]
unsafe fn tail_g16(row: Row, n: usize, x: &QActs8, tok: usize, mut b: usize, mut out: f32) -> f32 {
    while b < n / QK {
        // SAFETY: block `b` of row and token are in bounds (see `matmul_q8`).
        out += unsafe { term_g16(row, n, x, tok, b) };
        b += 1;
    }
    out
}

/// `row` against the 4 token rows `tok..tok + 4` of `x`, one token a lane: `unpacked` holds
/// the row's unsigned values (`unpack_row`) and f32 scales, read once for the four tokens.
/// Each token's output is the very value `dot_row_g32` / `dot_row_g16` give it alone: the
/// same block terms, added into four accumulators by block modulo 4 and summed in `hsum`'s
/// order, then the same tail on the packed row. A token's products so do not depend on the
/// tokens beside it in a batch.
#[inline(always)]
unsafe fn dot_row_x4<const V: u8, const F16: bool, const G16: bool, const MINS: bool>(
    packed: Row,
    unpacked: Row,
    n: usize,
    x: &QActs8,
    tok: usize,
    offset: i32,
) -> [f32; 4] {
    let nb = n / QK;
    let off = Offset::new(offset);
    unsafe {
        let xq = x.q.as_ptr().add(tok * n);
        let s4 = x.s4.as_ptr().add(tok / 4 * nb * 4);
        let qsum4 = x.qsum4.as_ptr().add(tok / 4 * nb * 4);
        let qsum16_4 = x.qsum16_4.as_ptr().add(tok / 4 * 2 * nb * 4);
        let term = |b: usize| {
            let u = block::<I8>(unpacked, b, i8x16_splat(0), 0);
            let x0 = xq.add(QK * b);
            let xs4 = v128_load(s4.add(4 * b) as *const v128);
            if G16 {
                let half = |k: usize| {
                    let (a_lo, a_hi) = acts(x0.add(k * n));
                    (sum16(a_lo, u.0), sum16(a_hi, u.1))
                };
                let (l0, h0) = half(0);
                let (l1, h1) = half(1);
                let (l2, h2) = half(2);
                let (l3, h3) = half(3);
                let q16 = qsum16_4.add(8 * b);
                let k = i32x4_splat(32);
                let s_lo = i32x4_sub(hsum4_i32(l0, l1, l2, l3), i32x4_mul(v128_load(q16 as *const v128), k));
                let s_hi = i32x4_sub(hsum4_i32(h0, h1, h2, h3), i32x4_mul(v128_load(q16.add(4) as *const v128), k));
                let d0 = f32x4_splat(*unpacked.d32.add(2 * b));
                let d1 = f32x4_splat(*unpacked.d32.add(2 * b + 1));
                let p = f32x4_add(f32x4_mul(f32x4_convert_i32x4(s_lo), d0), f32x4_mul(f32x4_convert_i32x4(s_hi), d1));
                return f32x4_mul(p, xs4);
            }
            let sums = match V == I8 {
                // Q8_0: its values widened once for the four tokens, against the activations'
                // i16 copies (`QActs8::q16`): the same integer products as `sum32_signed`'s,
                // with no sign moved per token.
                true => {
                    let w = [i16x8_extend_low_i8x16(u.0), i16x8_extend_high_i8x16(u.0), i16x8_extend_low_i8x16(u.1), i16x8_extend_high_i8x16(u.1)];
                    let x16 = x.q16.as_ptr().add(tok * n + QK * b);
                    let prod = |x: *const i16| {
                        let lo = i32x4_add(i32x4_dot_i16x8(w[0], acts16(x)), i32x4_dot_i16x8(w[1], acts16(x.add(8))));
                        let hi = i32x4_add(i32x4_dot_i16x8(w[2], acts16(x.add(16))), i32x4_dot_i16x8(w[3], acts16(x.add(24))));
                        i32x4_add(lo, hi)
                    };
                    hsum4_i32(prod(x16), prod(x16.add(n)), prod(x16.add(2 * n)), prod(x16.add(3 * n)))
                }
                false => hsum4_i32(sum32(acts(x0), u), sum32(acts(x0.add(n)), u), sum32(acts(x0.add(2 * n)), u), sum32(acts(x0.add(3 * n)), u)),
            };
            let qs = v128_load(qsum4.add(4 * b) as *const v128);
            let isum = i32x4_sub(sums, times_offset(qs, off));
            let mut t = f32x4_mul(f32x4_convert_i32x4(isum), f32x4_splat(*unpacked.d32.add(b)));
            if MINS {
                t = f32x4_sub(t, f32x4_mul(f32x4_splat(*packed.m.add(b)), f32x4_convert_i32x4(qs)));
            }
            f32x4_mul(t, xs4)
        };
        let zero = f32x4_splat(0.0);
        let (mut acc0, mut acc1, mut acc2, mut acc3) = (zero, zero, zero, zero);
        // Block `b`'s term goes to the accumulator of `b % 4` (see `simd128::dot_row_x4`).
        let full = nb / 4 * 4;
        for b in 0..full {
            acc0 = f32x4_add(acc0, term(b));
            (acc0, acc1, acc2, acc3) = (acc1, acc2, acc3, acc0);
        }
        let out = f32x4_add(f32x4_add(f32x4_add(acc0, acc1), acc2), acc3);
        let tail = |k: usize, out: f32| match G16 {
            true => tail_g16(packed, n, x, tok + k, full, out),
            false => tail_g32::<V, F16, MINS>(packed, n, x, tok + k, full, out, offset),
        };
        [
            tail(0, f32x4_extract_lane::<0>(out)),
            tail(1, f32x4_extract_lane::<1>(out)),
            tail(2, f32x4_extract_lane::<2>(out)),
            tail(3, f32x4_extract_lane::<3>(out)),
        ]
    }
}

/// Unpacks `row` into `s`: unsigned values (nibbles before their offset, Q6_K's plus 32; Q8_0's
/// as they are) and f32 scales, the layout the 4-token kernel reads.
#[inline(always)]
unsafe fn unpack_row<const V: u8, const F16: bool, const G16: bool>(row: Row, n: usize, s: &mut RowScratch) {
    let nb = n / QK;
    let g = if G16 { 2 * nb } else { nb };
    s.q.resize(n, 0);
    s.d.resize(g, 0.0);
    unsafe {
        let q = s.q.as_mut_ptr();
        let store = |b: usize, (lo, hi): (v128, v128)| {
            v128_store(q.add(QK * b) as *mut v128, lo);
            v128_store(q.add(QK * b + 16) as *mut v128, hi);
        };
        // Blocks in fours, each one's place in its four a constant (the fifth bits' shifts).
        for four in (0..nb).step_by(4) {
            let bits = plane::<V>(row, four);
            for k in 0..(nb - four).min(4) {
                let b = four + k;
                store(b, match (G16, k) {
                    (true, _) => block_q6(row, b),
                    (false, _) if V == I8 => block::<I8>(row, b, bits, 0),
                    (false, 0) => block_unsigned::<V>(row, b, bits, 0),
                    (false, 1) => block_unsigned::<V>(row, b, bits, 1),
                    (false, 2) => block_unsigned::<V>(row, b, bits, 2),
                    (false, _) => block_unsigned::<V>(row, b, bits, 3),
                });
            }
        }
        let d = s.d.as_mut_ptr();
        let mut i = 0;
        while !G16 && i + 4 <= g {
            v128_store(d.add(i) as *mut v128, scales4::<F16>(row, i));
            i += 4;
        }
        while i < g {
            *d.add(i) = if G16 { *row.d32.add(i) } else { scale::<F16>(row, i) };
            i += 1;
        }
    }
}

/// `matmul_q8` for one layout of the weight.
#[inline(always)]
unsafe fn matmul_rows<const V: u8, const F16: bool, const G16: bool, const MINS: bool>(
    w: &QMatrix,
    x: &QActs8,
    scratch: &mut RowScratch,
    y: &mut [f32],
    offset: i32,
) {
    let (n, n_out) = (w.n_in, w.n_out);
    let first = Row::first(w);
    let group = w.group as usize;
    // SAFETY (all calls below): row `r` and token `tok` are in bounds (see `matmul_q8`).
    let one = |row: Row, tok: usize| unsafe {
        match G16 {
            true => dot_row_g16(row, n, x, tok),
            false => dot_row_g32::<V, F16, MINS>(row, n, x, tok, offset),
        }
    };
    let groups = x.t / 4;
    if groups == 0 {
        // Decode: rows from `STREAMS` parts of the matrix in turn (see `simd128::matmul_rows`).
        const STREAMS: usize = 4;
        let part = n_out / STREAMS;
        let rows = (0..part).flat_map(|i| (0..STREAMS).map(move |c| c * part + i)).chain(STREAMS * part..n_out);
        for r in rows {
            let row = first.at(r, n, group);
            for tok in 0..x.t {
                y[tok * n_out + r] = one(row, tok);
            }
        }
        return;
    }
    for r in 0..n_out {
        let packed = first.at(r, n, group);
        unsafe {
            unpack_row::<V, F16, G16>(packed, n, scratch);
            let unpacked = Row { q: scratch.q.as_ptr(), d32: scratch.d.as_ptr(), d16: core::ptr::null(), ..packed };
            for g in 0..groups {
                let v = dot_row_x4::<V, F16, G16, MINS>(packed, unpacked, n, x, 4 * g, offset);
                for (k, v) in v.into_iter().enumerate() {
                    y[(4 * g + k) * n_out + r] = v;
                }
            }
        }
        for tok in 4 * groups..x.t {
            y[tok * n_out + r] = one(packed, tok);
        }
    }
}

/// See `super::matmul_q8`.
pub fn matmul_q8(w: &QMatrix, x: &QActs8, scratch: &mut RowScratch, y: &mut [f32]) {
    let (n, nb) = (w.n_in, w.n_in / QK);
    assert!(super::takes_int8(w) && x.n == n && n % QK == 0 && y.len() == x.t * w.n_out && layout_holds(w));
    assert!(x.q.len() >= x.t * n && x.s.len() >= x.t * nb && x.qsum.len() >= x.t * nb && x.qsum16.len() >= 2 * x.t * nb);
    assert!(x.s4.len() >= x.t / 4 * nb * 4 && x.qsum4.len() >= x.t / 4 * nb * 4 && x.qsum16_4.len() >= x.t / 4 * 2 * nb * 4);
    let f16 = matches!(w.d, Scales::F16(_));
    let mins = !w.m.is_empty();
    let offset = super::unsigned_offset(w);
    // SAFETY: the asserts above bound every row, block and token index the kernels read.
    unsafe {
        match (w.group, storage(w), f16, mins) {
            (Group::G16, ..) => matmul_rows::<I8, false, true, false>(w, x, scratch, y, offset),
            (_, I8, false, false) => matmul_rows::<I8, false, false, false>(w, x, scratch, y, offset),
            (_, I8, false, true) => matmul_rows::<I8, false, false, true>(w, x, scratch, y, offset),
            (_, I8, true, false) => matmul_rows::<I8, true, false, false>(w, x, scratch, y, offset),
            (_, I8, true, true) => matmul_rows::<I8, true, false, true>(w, x, scratch, y, offset),
            (_, NIB, false, false) => matmul_rows::<NIB, false, false, false>(w, x, scratch, y, offset),
            (_, NIB, false, true) => matmul_rows::<NIB, false, false, true>(w, x, scratch, y, offset),
            (_, NIB, true, false) => matmul_rows::<NIB, true, false, false>(w, x, scratch, y, offset),
            (_, NIB, true, true) => matmul_rows::<NIB, true, false, true>(w, x, scratch, y, offset),
            (_, _, false, false) => matmul_rows::<NIB5, false, false, false>(w, x, scratch, y, offset),
            (_, _, false, true) => matmul_rows::<NIB5, false, false, true>(w, x, scratch, y, offset),
            (_, _, true, false) => matmul_rows::<NIB5, true, false, false>(w, x, scratch, y, offset),
            (_, _, true, true) => matmul_rows::<NIB5, true, false, true>(w, x, scratch, y, offset),
        }
    }
}
