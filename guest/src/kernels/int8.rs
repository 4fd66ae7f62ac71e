//! wasm SIMD kernels of the `fast` products: int8 activations (`QActs8`) against the weights'
//! values as 7-bit unsigned numbers (nibbles before their offset, Q6_K's values plus 32, Q8_0's
//! magnitudes with their signs moved onto the activations; the four-row kernel takes Q8_0's
//! values widened to i16 against the activations' i16 copies), so that 16 byte products are one
//! relaxed-SIMD instruction where the guest is built with `relaxed-simd`, and a few standard
//! ones where not. Both give the same bits: every product and sum is an exact integer (no lane
//! saturates), and the f32 steps after them are the same. Each kernel mirrors
//! `scalar::dot_q8` and is tested against it.

use super::simd128::{I8, NIB, NIB5, Row, Sink, block_unsigned, hsum, hsum4_i32, layout_holds, load_weights, plane, scale, scales4, storage};
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
/// `I8` row as they are stored (Q8_0's signed ones).
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
unsafe fn terms4<const V: u8, const F16: bool, const MINS: bool>(row: Row, b: usize, sums: v128, x: &QActs8, tok: usize, offset: Offset) -> v128 {
    let nb = x.n / QK;
    unsafe {
        let qs = v128_load(x.qsum.as_ptr().add(tok * nb + b) as *const v128);
        let xs = v128_load(x.s.as_ptr().add(tok * nb + b) as *const v128);
        // Q8_0's values are taken as they are: no offset.
        let isum = if V == I8 { sums } else { i32x4_sub(sums, times_offset(qs, offset)) };
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
        // Each block's sum stored as it is made (see `Sink`).
        let sink = Sink::new();
        let made = |p: v128| sink.made(p);
        let mut b = 0;
        while b + 4 <= nb {
            let bits = plane::<V>(row, b);
            let p0 = made(block_sum::<V>(acts(xq.add(QK * b)), block::<V>(row, b, bits, 0)));
            let p1 = made(block_sum::<V>(acts(xq.add(QK * (b + 1))), block::<V>(row, b + 1, bits, 1)));
            let p2 = made(block_sum::<V>(acts(xq.add(QK * (b + 2))), block::<V>(row, b + 2, bits, 2)));
            let p3 = made(block_sum::<V>(acts(xq.add(QK * (b + 3))), block::<V>(row, b + 3, bits, 3)));
            acc = f32x4_add(acc, terms4::<V, F16, MINS>(row, b, hsum4_i32(p0, p1, p2, p3), x, tok, off));
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
    // The blocks of each full four into four partial sums (lanes), as `dot_row_g32` sums them.
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

/// The four rows a `tile` takes at turn `i` of `by_four_rows`, as indices: row `i` of each
/// quarter of the matrix, so that the reads run through four long stretches of memory in step
/// (the hardware prefetches them; four adjacent rows are four streams of one row each, too short
/// for it); then the rows past the quarters, the last row again in place of rows past the end.
#[inline(always)]
fn rows4(n_out: usize, i: usize) -> [usize; 4] {
    let part = n_out / 4;
    match i < part {
        true => [i, part + i, 2 * part + i, 3 * part + i],
        false => [0, 1, 2, 3].map(|k| (4 * part + k).min(n_out - 1)),
    }
}

/// Unpacks four rows of a matrix of `n` columns into `s` for `tile`, block by block, each
/// block's four rows one after another: the unsigned values (`q`: 32 bytes a row; Q8_0's values
/// stay where they are, `tile` widens them as it loads them), the f32 scales (`d`: four a block,
/// or G16's eight: the four rows' first halves, then their second halves) and the mins (`m`,
/// four a block).
#[inline(always)]
unsafe fn unpack4<const V: u8, const F16: bool, const G16: bool, const MINS: bool>(n: usize, rows: [Row; 4], s: &mut RowScratch) {
    let nb = n / QK;
    let in_place = V == I8 && !G16;
    if !in_place {
        s.q.resize(4 * n, 0);
    }
    s.d.resize(if G16 { 8 * nb } else { 4 * nb }, 0.0);
    s.m.resize(if MINS { 4 * nb } else { 0 }, 0.0);
    let (q, d, m) = (s.q.as_mut_ptr(), s.d.as_mut_ptr(), s.m.as_mut_ptr());
    // SAFETY: block `b`'s four rows are at `4 * QK * b` of `q`, its scales at `4 * b` /
    // `8 * b` of `d` and its mins at `4 * b` of `m`, all within the lengths set above; `rows`
    // are rows of the matrix, read at blocks below `nb`.
    unsafe {
        let store = |b: usize, k: usize, (lo, hi): (v128, v128)| {
            let p = q.add(4 * QK * b + QK * k) as *mut v128;
            v128_store(p, lo);
            v128_store(p.add(1), hi);
        };
        // Four rows' four values (lanes) as four blocks' (or G16's two blocks' halves) four
        // rows, stored at `p`.
        let transposed = |p: *mut f32, [a, b, c, e]: [v128; 4]| {
            let (ab_lo, ab_hi) = (i32x4_shuffle::<0, 4, 1, 5>(a, b), i32x4_shuffle::<2, 6, 3, 7>(a, b));
            let (ce_lo, ce_hi) = (i32x4_shuffle::<0, 4, 1, 5>(c, e), i32x4_shuffle::<2, 6, 3, 7>(c, e));
            let p = p as *mut v128;
            v128_store(p, i32x4_shuffle::<0, 1, 4, 5>(ab_lo, ce_lo));
            v128_store(p.add(1), i32x4_shuffle::<2, 3, 6, 7>(ab_lo, ce_lo));
            v128_store(p.add(2), i32x4_shuffle::<0, 1, 4, 5>(ab_hi, ce_hi));
            v128_store(p.add(3), i32x4_shuffle::<2, 3, 6, 7>(ab_hi, ce_hi));
        };
        // Blocks in fours, each one's place in its four a constant (the fifth bits' shifts).
        for four in (0..nb).step_by(4) {
            let count = (nb - four).min(4);
            // (Q8_0's values stay in place: only its scales are moved.)
            for (k, &row) in rows.iter().enumerate().take(if in_place { 0 } else { 4 }) {
                let bits = plane::<V>(row, four);
                for j in 0..count {
                    let b = four + j;
                    store(b, k, match (G16, j) {
                        (true, _) => block_q6(row, b),
                        (false, 0) => block_unsigned::<V>(row, b, bits, 0),
                        (false, 1) => block_unsigned::<V>(row, b, bits, 1),
                        (false, 2) => block_unsigned::<V>(row, b, bits, 2),
                        (false, _) => block_unsigned::<V>(row, b, bits, 3),
                    });
                }
            }
            if count < 4 {
                for (k, &row) in rows.iter().enumerate() {
                    for b in four..nb {
                        if G16 {
                            *d.add(8 * b + k) = *row.d32.add(2 * b);
                            *d.add(8 * b + 4 + k) = *row.d32.add(2 * b + 1);
                        } else {
                            *d.add(4 * b + k) = scale::<F16>(row, b);
                        }
                        if MINS {
                            *m.add(4 * b + k) = *row.m.add(b);
                        }
                    }
                }
                continue;
            }
            if G16 {
                transposed(d.add(8 * four), rows.map(|row| v128_load(row.d32.add(2 * four) as *const v128)));
                transposed(d.add(8 * four + 16), rows.map(|row| v128_load(row.d32.add(2 * four + 4) as *const v128)));
            } else {
                transposed(d.add(4 * four), rows.map(|row| scales4::<F16>(row, four)));
            }
            if MINS {
                transposed(m.add(4 * four), rows.map(|row| v128_load(row.m.add(four) as *const v128)));
            }
        }
    }
}

/// Where `tile` reads one block: the token's activations and sums, and the four rows' values,
/// scales and mins (`unpack4`'s layout), each `step`ped block by block.
#[derive(Clone, Copy)]
struct At {
    xq: *const i8,
    x16: *const i16,
    qsum: *const i32,
    qsum16: *const i32,
    xs: *const f32,
    q: *const u8,
    /// Q8_0: the four rows' values in place.
    w: [*const i8; 4],
    d: *const f32,
    m: *const f32,
}

impl At {
    /// `k` blocks on (`G16`: eight scales a block). Every pointer read stays within its buffer
    /// or one past its end. The rows' own pointers `w` are read for Q8_0 alone (`V` is `I8`,
    /// not `G16`), and only then stepped: with `add`, whose constant offsets LLVM folds into
    /// the loads' offset immediates (`wrapping_add` left an address addition before each load).
    #[inline(always)]
    unsafe fn step<const V: u8, const G16: bool>(self, k: usize) -> At {
        unsafe {
            At {
                xq: self.xq.add(QK * k),
                x16: self.x16.add(QK * k),
                qsum: self.qsum.add(k),
                qsum16: self.qsum16.add(2 * k),
                xs: self.xs.add(k),
                q: self.q.add(4 * QK * k),
                w: match V == I8 && !G16 {
                    true => self.w.map(|w| w.add(QK * k)),
                    false => self.w,
                },
                d: self.d.add(if G16 { 8 * k } else { 4 * k }),
                // Never read without mins (`m` is then an empty buffer's pointer).
                m: self.m.wrapping_add(4 * k),
            }
        }
    }
}

/// The term of the block at `at` for the four rows, one row a lane (see `tile`); `sink` takes
/// Q8_0's row sums as they are made.
#[inline(always)]
unsafe fn tile_term<const V: u8, const G16: bool, const MINS: bool>(at: At, offset: i32, sink: &Sink) -> v128 {
    unsafe {
        let s_b = f32x4_splat(*at.xs);
        if G16 {
            let (a_lo, a_hi) = acts(at.xq);
            let lo = |k: usize| sum16(a_lo, load_weights(at.q.add(QK * k)));
            let hi = |k: usize| sum16(a_hi, load_weights(at.q.add(QK * k + 16)));
            let s_lo = i32x4_sub(hsum4_i32(lo(0), lo(1), lo(2), lo(3)), i32x4_splat(32 * *at.qsum16));
            let s_hi = i32x4_sub(hsum4_i32(hi(0), hi(1), hi(2), hi(3)), i32x4_splat(32 * *at.qsum16.add(1)));
            let p = f32x4_add(
                f32x4_mul(f32x4_convert_i32x4(s_lo), v128_load(at.d as *const v128)),
                f32x4_mul(f32x4_convert_i32x4(s_hi), v128_load(at.d.add(4) as *const v128)),
            );
            return f32x4_mul(p, s_b);
        }
        let sums = match V == I8 {
            // Q8_0: the activations' i16 copies against the rows' values, widened as loaded.
            true => {
                let a = at.x16;
                let (a0, a1, a2, a3) = (acts16(a), acts16(a.add(8)), acts16(a.add(16)), acts16(a.add(24)));
                let row = |k: usize| {
                    let w = at.w[k];
                    let lo = i32x4_add(i32x4_dot_i16x8(a0, i16x8_load_extend_i8x8(w)), i32x4_dot_i16x8(a1, i16x8_load_extend_i8x8(w.add(8))));
                    let hi = i32x4_add(i32x4_dot_i16x8(a2, i16x8_load_extend_i8x8(w.add(16))), i32x4_dot_i16x8(a3, i16x8_load_extend_i8x8(w.add(24))));
                    sink.made(i32x4_add(lo, hi))
                };
                hsum4_i32(row(0), row(1), row(2), row(3))
            }
            false => {
                let a = acts(at.xq);
                let row = |k: usize| sum32(a, (load_weights(at.q.add(QK * k)), load_weights(at.q.add(QK * k + 16))));
                hsum4_i32(row(0), row(1), row(2), row(3))
            }
        };
        let qs = *at.qsum;
        // Q8_0's values are taken as they are: no offset.
        let isum = if V == I8 { sums } else { i32x4_sub(sums, i32x4_splat(qs * offset)) };
        let mut t = f32x4_mul(f32x4_convert_i32x4(isum), v128_load(at.d as *const v128));
        if MINS {
            t = f32x4_sub(t, f32x4_mul(v128_load(at.m as *const v128), f32x4_splat(qs as f32)));
        }
        f32x4_mul(t, s_b)
    }
}

/// The four rows `unpack4` left in `s` against token row `tok` of `x`, one row a lane. Each
/// lane is the very value `dot_row_g32` / `dot_row_g16` give its row: the same block terms
/// (four rows' integer sums at once, then the same f32 steps lane by lane), added into four
/// accumulators by block modulo 4, summed in `hsum`'s order, then the last blocks one by one.
/// The activations of a block are loaded once for the four rows, and each block's f32 steps
/// are made once for them.
#[inline(always)]
unsafe fn tile<const V: u8, const G16: bool, const MINS: bool>(s: &RowScratch, rows: [Row; 4], n: usize, x: &QActs8, tok: usize, offset: i32) -> v128 {
    let nb = n / QK;
    unsafe {
        let mut at = At {
            xq: x.q.as_ptr().add(tok * n),
            x16: x.q16.as_ptr().add(tok * n),
            qsum: x.qsum.as_ptr().add(tok * nb),
            qsum16: x.qsum16.as_ptr().add(tok * 2 * nb),
            xs: x.s.as_ptr().add(tok * nb),
            q: s.q.as_ptr() as *const u8,
            w: rows.map(|row| row.q),
            d: s.d.as_ptr(),
            m: s.m.as_ptr(),
        };
        let zero = f32x4_splat(0.0);
        let (mut acc0, mut acc1, mut acc2, mut acc3) = (zero, zero, zero, zero);
        // Four blocks a turn, each block's sum stored as it is made (see `Sink`).
        let sink = Sink::new();
        let term = |at: At| tile_term::<V, G16, MINS>(at, offset, &sink);
        for _ in 0..nb / 4 {
            acc0 = sink.made(f32x4_add(acc0, term(at)));
            acc1 = sink.made(f32x4_add(acc1, term(at.step::<V, G16>(1))));
            acc2 = sink.made(f32x4_add(acc2, term(at.step::<V, G16>(2))));
            acc3 = sink.made(f32x4_add(acc3, term(at.step::<V, G16>(3))));
            at = at.step::<V, G16>(4);
        }
        let mut out = f32x4_add(f32x4_add(f32x4_add(acc0, acc1), acc2), acc3);
        for _ in 0..nb % 4 {
            out = f32x4_add(out, term(at));
            at = at.step::<V, G16>(1);
        }
        out
    }
}

/// `matmul_q8` for one layout of the weight. Its two ways are functions of their own, so that
/// Cranelift allocates registers for each one's loops alone (inlined together, the decode
/// loops ran slower for changes to the other's).
#[inline(always)]
unsafe fn matmul_rows<const V: u8, const F16: bool, const G16: bool, const MINS: bool>(
    w: &QMatrix,
    x: &QActs8,
    scratch: &mut RowScratch,
    y: &mut [f32],
    offset: i32,
) {
    unsafe {
        match x.t < 4 {
            true => by_row::<V, F16, G16, MINS>(w, x, y, offset),
            false => by_four_rows::<V, F16, G16, MINS>(w, x, scratch, y, offset),
        }
    }
}

/// Decode: each row read from the packed weights, rows from `STREAMS` parts of the matrix in
/// turn (see `simd128::matmul_rows`). Unpacking four rows for `tile` costs more than it saves
/// for so few tokens.
#[inline(never)]
unsafe fn by_row<const V: u8, const F16: bool, const G16: bool, const MINS: bool>(w: &QMatrix, x: &QActs8, y: &mut [f32], offset: i32) {
    let (n, n_out) = (w.n_in, w.n_out);
    let first = Row::first(w);
    let group = w.group as usize;
    const STREAMS: usize = 4;
    let part = n_out / STREAMS;
    let rows = (0..part).flat_map(|i| (0..STREAMS).map(move |c| c * part + i)).chain(STREAMS * part..n_out);
    for r in rows {
        let row = first.at(r, n, group);
        for tok in 0..x.t {
            // SAFETY: row `r` and token `tok` are in bounds (see `matmul_q8`).
            y[tok * n_out + r] = unsafe {
                match G16 {
                    true => dot_row_g16(row, n, x, tok),
                    false => dot_row_g32::<V, F16, MINS>(row, n, x, tok, offset),
                }
            };
        }
    }
}

/// Four rows at a time (`rows4`), unpacked once for all the tokens (`unpack4`, `tile`).
#[inline(never)]
unsafe fn by_four_rows<const V: u8, const F16: bool, const G16: bool, const MINS: bool>(
    w: &QMatrix,
    x: &QActs8,
    scratch: &mut RowScratch,
    y: &mut [f32],
    offset: i32,
) {
    let (n, n_out) = (w.n_in, w.n_out);
    let first = Row::first(w);
    for i in 0..n_out.div_ceil(4) {
        let r = rows4(n_out, i);
        let rows = r.map(|r| first.at(r, n, w.group as usize));
        // SAFETY: `rows` and every token are in bounds (see `matmul_q8`).
        unsafe {
            unpack4::<V, F16, G16, MINS>(n, rows, scratch);
            for tok in 0..x.t {
                let v = tile::<V, G16, MINS>(scratch, rows, n, x, tok, offset);
                // Lane by lane (a row past the end repeats the last one, the same value).
                let y = &mut y[tok * n_out..(tok + 1) * n_out];
                y[r[0]] = f32x4_extract_lane::<0>(v);
                y[r[1]] = f32x4_extract_lane::<1>(v);
                y[r[2]] = f32x4_extract_lane::<2>(v);
                y[r[3]] = f32x4_extract_lane::<3>(v);
            }
        }
    }
}

/// See `super::matmul_q8`.
pub fn matmul_q8(w: &QMatrix, x: &QActs8, scratch: &mut RowScratch, y: &mut [f32]) {
    let (n, nb) = (w.n_in, w.n_in / QK);
    assert!(super::takes_int8(w) && x.n == n && n % QK == 0 && y.len() == x.t * w.n_out && layout_holds(w));
    assert!(x.q.len() >= x.t * n && x.s.len() >= x.t * nb && x.qsum.len() >= x.t * nb && x.qsum16.len() >= 2 * x.t * nb);
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
