//! wasm simd128 kernels (standard SIMD only: results are the same on every host).
//! Each mirrors a function of `scalar.rs` and is tested against it.

use super::{QActs, RowScratch};
use crate::quant::{Group, QK, QMatrix, Scales, Values, f16_to_f32, fifth_bytes_per_row};
use core::arch::wasm32::*;

#[inline(always)]
pub(super) fn hsum(v: v128) -> f32 {
    f32x4_extract_lane::<0>(v)
        + f32x4_extract_lane::<1>(v)
        + f32x4_extract_lane::<2>(v)
        + f32x4_extract_lane::<3>(v)
}

/// `[sum(a), sum(b), sum(c), sum(d)]` of f32 lanes, as `hsum4_i32` does for i32.
#[inline(always)]
fn hsum4_f32(a: v128, b: v128, c: v128, d: v128) -> [f32; 4] {
    let ab = f32x4_add(i32x4_shuffle::<0, 4, 1, 5>(a, b), i32x4_shuffle::<2, 6, 3, 7>(a, b));
    let cd = f32x4_add(i32x4_shuffle::<0, 4, 1, 5>(c, d), i32x4_shuffle::<2, 6, 3, 7>(c, d));
    let s = f32x4_add(i32x4_shuffle::<0, 1, 4, 5>(ab, cd), i32x4_shuffle::<2, 3, 6, 7>(ab, cd));
    [f32x4_extract_lane::<0>(s), f32x4_extract_lane::<1>(s), f32x4_extract_lane::<2>(s), f32x4_extract_lane::<3>(s)]
}

/// `[sum(a), sum(b), sum(c), sum(d)]`: four horizontal sums at once.
#[inline(always)]
pub(super) fn hsum4_i32(a: v128, b: v128, c: v128, d: v128) -> v128 {
    let ab = i32x4_add(i32x4_shuffle::<0, 4, 1, 5>(a, b), i32x4_shuffle::<2, 6, 3, 7>(a, b));
    let cd = i32x4_add(i32x4_shuffle::<0, 4, 1, 5>(c, d), i32x4_shuffle::<2, 6, 3, 7>(c, d));
    i32x4_add(i32x4_shuffle::<0, 1, 4, 5>(ab, cd), i32x4_shuffle::<2, 3, 6, 7>(ab, cd))
}

/// A place the kernels store sums to as they make them. Cranelift places a pure instruction
/// just before its first use: in an unrolled loop whose sums are first used at its end, it
/// makes them all after all the loop's loads, which then spill. A volatile store of each sum as
/// it is made (a store stays where it is written) keeps its instructions there.
pub(super) struct Sink(core::cell::UnsafeCell<v128>);

impl Sink {
    pub(super) fn new() -> Sink {
        Sink(core::cell::UnsafeCell::new(i8x16_splat(0)))
    }

    /// `v`, stored first.
    #[inline(always)]
    pub(super) fn made(&self, v: v128) -> v128 {
        // SAFETY: the cell is this sink's own, and nothing reads it.
        unsafe { core::ptr::write_volatile(self.0.get(), v) };
        v
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

/// 16 bytes from any address, loaded where written (see `load_here`): the weights' loads.
#[inline(always)]
pub(super) unsafe fn load_weights(p: *const u8) -> v128 {
    #[derive(Clone, Copy)]
    #[repr(C, packed)]
    struct Unaligned(v128);
    unsafe { core::ptr::read_volatile(p as *const Unaligned).0 }
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

/// The weights of one row as the kernels read them: pointers into a `QMatrix` (or into a
/// `RowScratch` holding the row unpacked), already offset to the row.
#[derive(Clone, Copy)]
pub(super) struct Row {
    /// `Values::I8`: `[n_in]`
    pub(super) q: *const i8,
    /// `Values::Nibbles`: `[n_in / 2]`, and the row's fifth bits (null without)
    pub(super) nib: *const u8,
    pub(super) fifth: *const u8,
    /// splat of the nibble offset
    pub(super) offset: v128,
    /// `Scales::F32` / `Scales::F16`: `[n_in / group]`
    pub(super) d32: *const f32,
    pub(super) d16: *const u16,
    /// `[n_in / 32]`, null without mins
    pub(super) m: *const f32,
}

/// Value storage of a `Row`, as a const parameter of the kernels.
pub(super) const I8: u8 = 0;
pub(super) const NIB: u8 = 1;
pub(super) const NIB5: u8 = 2;

impl Row {
    /// Row 0 of `w`, in place (`at` steps to the others). Its value storage is `storage(w)`.
    pub(super) fn first(w: &QMatrix) -> Row {
        use core::ptr::null;
        let mut row = Row { q: null(), nib: null(), fifth: null(), offset: i8x16_splat(0), d32: null(), d16: null(), m: null() };
        match &w.values {
            Values::I8(q) => row.q = q.as_ptr(),
            Values::Nibbles { nib, fifth, offset } => {
                row.nib = nib.as_ptr();
                if !fifth.is_empty() {
                    row.fifth = fifth.as_ptr();
                }
                row.offset = i8x16_splat(*offset);
            }
        }
        match &w.d {
            Scales::F32(d) => row.d32 = d.as_ptr(),
            Scales::F16(d) => row.d16 = d.as_ptr(),
        }
        if !w.m.is_empty() {
            row.m = w.m.as_ptr();
        }
        row
    }

    /// Row `r` of the matrix whose row 0 is `self` (`n` columns, scales in groups of `g`).
    #[inline(always)]
    pub(super) fn at(self, r: usize, n: usize, g: usize) -> Row {
        Row {
            q: self.q.wrapping_add(r * n),
            nib: self.nib.wrapping_add(r * n / 2),
            fifth: self.fifth.wrapping_add(r * fifth_bytes_per_row(n)),
            d32: self.d32.wrapping_add(r * n / g),
            d16: self.d16.wrapping_add(r * n / g),
            m: self.m.wrapping_add(r * n / QK),
            ..self
        }
    }

    /// The row unpacked into `s` (i8 values, f32 scales), with its mins in place.
    fn unpacked(s: &RowScratch, packed: Row) -> Row {
        Row { q: s.q.as_ptr(), d32: s.d.as_ptr(), d16: core::ptr::null(), ..packed }
    }
}

pub(super) fn storage(w: &QMatrix) -> u8 {
    match &w.values {
        Values::I8(_) => I8,
        Values::Nibbles { fifth, .. } if fifth.is_empty() => NIB,
        Values::Nibbles { .. } => NIB5,
    }
}

/// Bit `i` (0..8) of every byte of `v` moved to bit 4; other bits arbitrary.
#[inline(always)]
fn bit_to_4(v: v128, i: u32) -> v128 {
    // 16-bit shifts move each byte's bits within the byte for the bits kept (bit 4 of each
    // byte comes from bit `i` of the same byte for every `i` in 0..8).
    if i <= 4 { i16x8_shl(v, 4 - i) } else { u16x8_shr(v, i - 4) }
}

/// The i8 values of block `b` of `row` as `(elements 0..16, elements 16..32)`. For `NIB5`,
/// `plane` is the row's 16 bytes of fifth bits for blocks `b / 4 * 4..`, and `k = b % 4`.
#[inline(always)]
pub(super) unsafe fn block_i8<const V: u8>(row: Row, b: usize, plane: v128, k: u32) -> (v128, v128) {
    unsafe {
        if V == I8 {
            let q = row.q.add(QK * b) as *const u8;
            return (load_weights(q), load_weights(q.add(16)));
        }
        let (lo, hi) = block_unsigned::<V>(row, b, plane, k);
        (i8x16_sub(lo, row.offset), i8x16_sub(hi, row.offset))
    }
}

/// The nibbles (and fifth bits) of block `b` of a `NIB` or `NIB5` row as unsigned values
/// before their offset, `(elements 0..16, elements 16..32)`; `plane` and `k` as for `block_i8`.
#[inline(always)]
pub(super) unsafe fn block_unsigned<const V: u8>(row: Row, b: usize, plane: v128, k: u32) -> (v128, v128) {
    unsafe {
        let v = load_weights(row.nib.add(16 * b));
        let low4 = u8x16_splat(0x0F);
        let mut lo = v128_and(v, low4);
        let mut hi = v128_and(u16x8_shr(v, 4), low4);
        if V == NIB5 {
            let bit4 = u8x16_splat(0x10);
            lo = v128_or(lo, v128_and(bit_to_4(plane, 2 * k), bit4));
            hi = v128_or(hi, v128_and(bit_to_4(plane, 2 * k + 1), bit4));
        }
        (lo, hi)
    }
}

/// The fifth-bit plane for blocks `b / 4 * 4..` of `row` (zero unless `NIB5`).
#[inline(always)]
pub(super) unsafe fn plane<const V: u8>(row: Row, b: usize) -> v128 {
    unsafe { if V == NIB5 { v128_load(row.fifth.add(b / 4 * 16) as *const v128) } else { i8x16_splat(0) } }
}

/// An i8 block `(lo, hi)` widened to four i16x8.
#[inline(always)]
fn widen((lo, hi): (v128, v128)) -> [v128; 4] {
    [i16x8_extend_low_i8x16(lo), i16x8_extend_high_i8x16(lo), i16x8_extend_low_i8x16(hi), i16x8_extend_high_i8x16(hi)]
}

/// Four f16 (the low 64 bits of `h`) as f32x4, exactly, for finite values: the exponent and
/// mantissa moved into f32 position and rescaled by 2^(127 - 15), which also makes f16
/// subnormals normal.
#[inline(always)]
fn f16x4_to_f32(h: v128) -> v128 {
    let h = u32x4_extend_low_u16x8(h);
    let sign = i32x4_shl(v128_and(h, u32x4_splat(0x8000)), 16);
    let magnitude = i32x4_shl(v128_and(h, u32x4_splat(0x7FFF)), 13);
    v128_or(f32x4_mul(magnitude, f32x4_splat(f32::from_bits((127 + 112) << 23))), sign)
}

/// Scales `i..i + 4` of a G32 row.
#[inline(always)]
pub(super) unsafe fn scales4<const F16: bool>(row: Row, i: usize) -> v128 {
    unsafe {
        if F16 { f16x4_to_f32(v128_load64_zero(row.d16.add(i) as *const u64)) } else { v128_load(row.d32.add(i) as *const v128) }
    }
}

/// Scale `i` of a row.
#[inline(always)]
pub(super) unsafe fn scale<const F16: bool>(row: Row, i: usize) -> f32 {
    unsafe { if F16 { f16_to_f32(*row.d16.add(i)) } else { *row.d32.add(i) } }
}

// The kernels below are unrolled by hand, without arrays indexed in loops: LLVM leaves such
// small loops rolled for wasm32, and their arrays then live in linear memory (a store and a
// load per value, and an epoch check per iteration under wasmtime) instead of in registers.

/// `row` (G32, any storage) against one token row `tok` of `x`, reading the packed weights
/// directly (the decode kernel: its time is the time to read the row from memory). Blocks go
/// four at a time: their integer sums are reduced together and scaled with one vector
/// multiply.
#[inline(always)]
unsafe fn dot_row_g32<const V: u8, const F16: bool, const MINS: bool>(row: Row, n: usize, x: &QActs, tok: usize) -> f32 {
    let nb = n / QK;
    unsafe {
        let xq = x.q.as_ptr().add(tok * n);
        let xs = x.s.as_ptr().add(tok * nb);
        let mut acc = f32x4_splat(0.0);
        // Each block's sums stored as they are made (see `Sink`).
        let sink = Sink::new();
        let mut b = 0;
        while b + 4 <= nb {
            let bits = plane::<V>(row, b);
            let p0 = sink.made(products32(&widen(block_i8::<V>(row, b, bits, 0)), xq.add(QK * b)));
            let p1 = sink.made(products32(&widen(block_i8::<V>(row, b + 1, bits, 1)), xq.add(QK * (b + 1))));
            let p2 = sink.made(products32(&widen(block_i8::<V>(row, b + 2, bits, 2)), xq.add(QK * (b + 2))));
            let p3 = sink.made(products32(&widen(block_i8::<V>(row, b + 3, bits, 3)), xq.add(QK * (b + 3))));
            let sums = f32x4_convert_i32x4(hsum4_i32(p0, p1, p2, p3));
            let scale = f32x4_mul(scales4::<F16>(row, b), v128_load(xs.add(b) as *const v128));
            acc = f32x4_add(acc, f32x4_mul(sums, scale));
            b += 4;
        }
        tail_g32::<V, F16, MINS>(row, n, x, tok, b, hsum(acc))
    }
}

/// `sum(m[b] * sums[b])` over a row's blocks, in block order from -0.0: the mins' term of a
/// token's product (`dot_row_x4` sums four tokens' the same way, lane by lane).
#[inline(always)]
fn mins_dot(m: &[f32], sums: &[f32]) -> f32 {
    m.iter().zip(sums).fold(-0.0, |acc, (m, s)| acc + m * s)
}

/// The end of `dot_row_g32` from block `b` on, `out` the sum of the blocks before: the last
/// blocks of a row whose block count is not a multiple of 4, then the mins.
#[inline(always)]
unsafe fn tail_g32<const V: u8, const F16: bool, const MINS: bool>(row: Row, n: usize, x: &QActs, tok: usize, mut b: usize, mut out: f32) -> f32 {
    let nb = n / QK;
    unsafe {
        let xq = x.q.as_ptr().add(tok * n);
        let xs = x.s.as_ptr().add(tok * nb);
        while b < nb {
            let p = products32(&widen(block_i8::<V>(row, b, plane::<V>(row, b), (b % 4) as u32)), xq.add(QK * b));
            out += hsum(f32x4_convert_i32x4(p)) * scale::<F16>(row, b) * *xs.add(b);
            b += 1;
        }
        if MINS {
            out -= mins_dot(core::slice::from_raw_parts(row.m, nb), &x.sum[tok * nb..(tok + 1) * nb]);
        }
        out
    }
}

/// `row` (G16: i8 values, f32 scales) against one token row `tok` of `x`.
#[inline(always)]
unsafe fn dot_row_g16<const MINS: bool>(row: Row, n: usize, x: &QActs, tok: usize) -> f32 {
    let nb = n / QK;
    unsafe {
        let xq = x.q.as_ptr().add(tok * n);
        let xs = x.s.as_ptr().add(tok * nb);
        let block = |b: usize| (widen(block_i8::<I8>(row, b, i8x16_splat(0), 0)), xq.add(QK * b));
        let d = row.d32;
        let mut acc = f32x4_splat(0.0);
        let mut b = 0;
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
        tail_g16::<MINS>(row, n, x, tok, b, hsum(acc))
    }
}

/// The end of `dot_row_g16` from block `b` on, as `tail_g32` is of `dot_row_g32`.
#[inline(always)]
unsafe fn tail_g16<const MINS: bool>(row: Row, n: usize, x: &QActs, tok: usize, mut b: usize, mut out: f32) -> f32 {
    let nb = n / QK;
    unsafe {
        let xq = x.q.as_ptr().add(tok * n);
        let xs = x.s.as_ptr().add(tok * nb);
        let d = row.d32;
        while b < nb {
            let a = widen(block_i8::<I8>(row, b, i8x16_splat(0), 0));
            let (lo, hi) = products(&a, xq.add(QK * b));
            let (lo, hi) = (hsum(f32x4_convert_i32x4(lo)), hsum(f32x4_convert_i32x4(hi)));
            out += (lo * *d.add(2 * b) + hi * *d.add(2 * b + 1)) * *xs.add(b);
            b += 1;
        }
        if MINS {
            out -= mins_dot(core::slice::from_raw_parts(row.m, nb), &x.sum[tok * nb..(tok + 1) * nb]);
        }
        out
    }
}

/// `row` (i8 values, f32 scales) against the 4 token rows `tok..tok + 4` of `x`, one token a
/// lane: each block is widened once for the four tokens, and the four tokens' block sums are
/// reduced and scaled together. Each token's output is the very value the one-token kernel
/// (`dot_row_g32::<I8, false, MINS>`, `dot_row_g16::<MINS>`) gives it: the same block sums,
/// scaled alike, added into four accumulators by block modulo 4 and those summed in the order
/// of its `hsum`, then the same tail. A token's products so do not depend on the tokens beside
/// it in a batch.
#[inline(always)]
unsafe fn dot_row_x4<const G16: bool, const MINS: bool>(row: Row, n: usize, x: &QActs, tok: usize) -> [f32; 4] {
    let nb = n / QK;
    unsafe {
        let xq = x.q.as_ptr().add(tok * n);
        let s4 = x.s4.as_ptr().add(tok / 4 * nb * 4);
        // Each token's sums stored as they are made (see `Sink`).
        let sink = Sink::new();
        let made = |v: v128| sink.made(v);
        // Block `b`'s term of the four tokens.
        let term = |b: usize| {
            let a = widen(block_i8::<I8>(row, b, i8x16_splat(0), 0));
            let x0 = xq.add(QK * b);
            let xs4 = v128_load(s4.add(4 * b) as *const v128);
            match G16 {
                false => {
                    let sums = hsum4_i32(
                        made(products32(&a, x0)),
                        made(products32(&a, x0.add(n))),
                        made(products32(&a, x0.add(2 * n))),
                        made(products32(&a, x0.add(3 * n))),
                    );
                    let d = f32x4_splat(*row.d32.add(b));
                    f32x4_mul(f32x4_convert_i32x4(sums), f32x4_mul(d, xs4))
                }
                true => {
                    let made2 = |(lo, hi): (v128, v128)| (made(lo), made(hi));
                    let (l0, h0) = made2(products(&a, x0));
                    let (l1, h1) = made2(products(&a, x0.add(n)));
                    let (l2, h2) = made2(products(&a, x0.add(2 * n)));
                    let (l3, h3) = made2(products(&a, x0.add(3 * n)));
                    let s_lo = f32x4_convert_i32x4(hsum4_i32(l0, l1, l2, l3));
                    let s_hi = f32x4_convert_i32x4(hsum4_i32(h0, h1, h2, h3));
                    let d0 = f32x4_splat(*row.d32.add(2 * b));
                    let d1 = f32x4_splat(*row.d32.add(2 * b + 1));
                    let p = f32x4_add(f32x4_mul(s_lo, d0), f32x4_mul(s_hi, d1));
                    f32x4_mul(p, xs4)
                }
            }
        };
        // The mins' products of the four tokens, summed as `mins_dot` sums one token's.
        let sum4 = x.sum4.as_ptr().add(tok / 4 * nb * 4);
        let mut mins = f32x4_splat(-0.0);
        let mut min = |b: usize| {
            if MINS {
                mins = f32x4_add(mins, f32x4_mul(f32x4_splat(*row.m.add(b)), v128_load(sum4.add(4 * b) as *const v128)));
            }
        };
        let zero = f32x4_splat(0.0);
        let (mut acc0, mut acc1, mut acc2, mut acc3) = (zero, zero, zero, zero);
        // One block a turn, its term into `acc0`, then the accumulators turned by one: block
        // `b`'s term goes to the accumulator of `b % 4`, and after a multiple of 4 blocks
        // each is back in its place.
        let b = nb / 4 * 4;
        for b in 0..b {
            acc0 = f32x4_add(acc0, term(b));
            (acc0, acc1, acc2, acc3) = (acc1, acc2, acc3, acc0);
            min(b);
        }
        for b in b..nb {
            min(b);
        }
        let out = f32x4_add(f32x4_add(f32x4_add(acc0, acc1), acc2), acc3);
        let tail = |k: usize, out: f32| match G16 {
            true => tail_g16::<false>(row, n, x, tok + k, b, out),
            false => tail_g32::<I8, false, false>(row, n, x, tok + k, b, out),
        };
        let out = [
            tail(0, f32x4_extract_lane::<0>(out)),
            tail(1, f32x4_extract_lane::<1>(out)),
            tail(2, f32x4_extract_lane::<2>(out)),
            tail(3, f32x4_extract_lane::<3>(out)),
        ];
        if !MINS {
            return out;
        }
        [
            out[0] - f32x4_extract_lane::<0>(mins),
            out[1] - f32x4_extract_lane::<1>(mins),
            out[2] - f32x4_extract_lane::<2>(mins),
            out[3] - f32x4_extract_lane::<3>(mins),
        ]
    }
}

/// Unpacks a G32 `row` into `s`: i8 values and f32 scales, the layout the 4-token kernel
/// reads (once per row, for all the token groups).
#[inline(always)]
unsafe fn unpack_row<const V: u8, const F16: bool>(row: Row, n: usize, s: &mut RowScratch) {
    let nb = n / QK;
    s.q.resize(n, 0);
    s.d.resize(nb, 0.0);
    unsafe {
        let q = s.q.as_mut_ptr();
        let store = |b: usize, (lo, hi): (v128, v128)| {
            v128_store(q.add(QK * b) as *mut v128, lo);
            v128_store(q.add(QK * b + 16) as *mut v128, hi);
        };
        let mut b = 0;
        while b + 4 <= nb {
            let bits = plane::<V>(row, b);
            store(b, block_i8::<V>(row, b, bits, 0));
            store(b + 1, block_i8::<V>(row, b + 1, bits, 1));
            store(b + 2, block_i8::<V>(row, b + 2, bits, 2));
            store(b + 3, block_i8::<V>(row, b + 3, bits, 3));
            v128_store(s.d.as_mut_ptr().add(b) as *mut v128, scales4::<F16>(row, b));
            b += 4;
        }
        while b < nb {
            store(b, block_i8::<V>(row, b, plane::<V>(row, b), (b % 4) as u32));
            s.d[b] = scale::<F16>(row, b);
            b += 1;
        }
    }
}

/// `matmul_q` for one storage of the weight.
#[inline(always)]
unsafe fn matmul_rows<const V: u8, const F16: bool, const G16: bool, const MINS: bool>(
    w: &QMatrix,
    x: &QActs,
    scratch: &mut RowScratch,
    y: &mut [f32],
) {
    let (n, n_out) = (w.n_in, w.n_out);
    let groups = x.t / 4;
    let first = Row::first(w);
    let group = w.group as usize;
    if groups == 0 {
        // Decode: every weight byte is read once, from memory. Rows go from `STREAMS` parts
        // of the matrix in turn, so that the hardware prefetcher follows that many sequential
        // streams at once: with one stream it keeps too few bytes in flight (the output
        // projection took 1.6x as long here).
        const STREAMS: usize = 4;
        let part = n_out / STREAMS;
        let one = |r: usize, y: &mut [f32]| {
            let row = first.at(r, n, group);
            for tok in 0..x.t {
                // SAFETY: row `r` and token `tok` are in bounds (see `matmul_q`).
                y[tok * n_out + r] = unsafe {
                    match G16 {
                        true => dot_row_g16::<MINS>(row, n, x, tok),
                        false => dot_row_g32::<V, F16, MINS>(row, n, x, tok),
                    }
                };
            }
        };
        for i in 0..part {
            for c in 0..STREAMS {
                one(c * part + i, y);
            }
        }
        for r in STREAMS * part..n_out {
            one(r, y);
        }
        return;
    }
    // The 4-token kernel reads i8 values and f32 scales: packed rows are unpacked once for
    // all the token groups.
    let unpack = V != I8 || F16;
    for r in 0..n_out {
        unsafe {
            let packed = first.at(r, n, group);
            let row = if unpack {
                unpack_row::<V, F16>(packed, n, scratch);
                Row::unpacked(scratch, packed)
            } else {
                packed
            };
            for g in 0..groups {
                let v = dot_row_x4::<G16, MINS>(row, n, x, 4 * g);
                y[(4 * g) * n_out + r] = v[0];
                y[(4 * g + 1) * n_out + r] = v[1];
                y[(4 * g + 2) * n_out + r] = v[2];
                y[(4 * g + 3) * n_out + r] = v[3];
            }
            for tok in 4 * groups..x.t {
                y[tok * n_out + r] = match (G16, unpack) {
                    (true, _) => dot_row_g16::<MINS>(row, n, x, tok),
                    (false, true) => dot_row_g32::<I8, false, MINS>(row, n, x, tok),
                    (false, false) => dot_row_g32::<V, F16, MINS>(row, n, x, tok),
                };
            }
        }
    }
}

/// Whether `w`'s values, scales and mins have the lengths its shape says: what the kernels'
/// row and block indexing relies on (`matmul_q` and `int8::matmul_q8` assert it).
pub(super) fn layout_holds(w: &QMatrix) -> bool {
    let (n, g) = (w.n_in, w.group as usize);
    let values = match &w.values {
        Values::I8(q) => q.len() == w.n_out * n,
        Values::Nibbles { nib, fifth, .. } => {
            nib.len() == w.n_out * n / 2 && (fifth.is_empty() || fifth.len() == w.n_out * fifth_bytes_per_row(n))
        }
    };
    let scales = match &w.d {
        Scales::F32(d) => d.len() == w.n_out * n / g,
        Scales::F16(d) => d.len() == w.n_out * n / g,
    };
    values && scales && (w.m.is_empty() || w.m.len() == w.n_out * n / QK)
}

/// `y[t, n_out] = x[t, n_in] @ W^T`. Rows outermost, so each weight row is read once from
/// memory while the (smaller) activations stay in cache; tokens in groups of 4.
pub fn matmul_q(w: &QMatrix, x: &QActs, scratch: &mut RowScratch, y: &mut [f32]) {
    let (n, nb) = (w.n_in, w.n_in / QK);
    assert!(x.n == n && n % QK == 0 && y.len() == x.t * w.n_out && layout_holds(w));
    assert!(x.q.len() >= x.t * x.n && x.s.len() >= x.t * nb && x.sum.len() >= x.t * nb);
    assert!(x.s4.len() >= x.t / 4 * nb * 4 && x.sum4.len() >= x.t / 4 * nb * 4);
    let f16 = matches!(w.d, Scales::F16(_));
    let mins = !w.m.is_empty();
    // SAFETY: the asserts above bound every row, block and token index the kernels read.
    unsafe {
        match (w.group, storage(w), f16, mins) {
            (Group::G16, I8, false, false) => matmul_rows::<I8, false, true, false>(w, x, scratch, y),
            (Group::G16, I8, false, true) => matmul_rows::<I8, false, true, true>(w, x, scratch, y),
            (Group::G16, ..) => unreachable!("G16 weights are stored as i8 values with f32 scales (`QMatrix::from_blocks`)"),
            (Group::G32, I8, false, false) => matmul_rows::<I8, false, false, false>(w, x, scratch, y),
            (Group::G32, I8, false, true) => matmul_rows::<I8, false, false, true>(w, x, scratch, y),
            (Group::G32, I8, true, false) => matmul_rows::<I8, true, false, false>(w, x, scratch, y),
            (Group::G32, I8, true, true) => matmul_rows::<I8, true, false, true>(w, x, scratch, y),
            (Group::G32, NIB, false, false) => matmul_rows::<NIB, false, false, false>(w, x, scratch, y),
            (Group::G32, NIB, false, true) => matmul_rows::<NIB, false, false, true>(w, x, scratch, y),
            (Group::G32, NIB, true, false) => matmul_rows::<NIB, true, false, false>(w, x, scratch, y),
            (Group::G32, NIB, true, true) => matmul_rows::<NIB, true, false, true>(w, x, scratch, y),
            (Group::G32, _, false, false) => matmul_rows::<NIB5, false, false, false>(w, x, scratch, y),
            (Group::G32, _, false, true) => matmul_rows::<NIB5, false, false, true>(w, x, scratch, y),
            (Group::G32, _, true, false) => matmul_rows::<NIB5, true, false, false>(w, x, scratch, y),
            (Group::G32, _, true, true) => matmul_rows::<NIB5, true, false, true>(w, x, scratch, y),
        }
    }
}

/// The largest value, NaNs skipped: `pmax(m, x)` keeps `m` unless `m < x`, which a NaN never is.
pub fn max_value(v: &[f32]) -> f32 {
    let n = v.len();
    let mut acc = [f32x4_splat(f32::NEG_INFINITY); 4];
    let mut i = 0;
    // SAFETY: every load is of 4 floats below `n`.
    unsafe {
        let p = v.as_ptr();
        while i + 16 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = f32x4_pmax(*a, v128_load(p.add(i + 4 * k) as *const v128));
            }
            i += 16;
        }
    }
    let m = f32x4_pmax(f32x4_pmax(acc[0], acc[1]), f32x4_pmax(acc[2], acc[3]));
    let lanes = [f32x4_extract_lane::<0>(m), f32x4_extract_lane::<1>(m), f32x4_extract_lane::<2>(m), f32x4_extract_lane::<3>(m)];
    lanes.into_iter().chain(v[i..].iter().copied()).fold(f32::NEG_INFINITY, |m, x| if x > m { x } else { m })
}

/// `exp(x - max)` four at a time (`exp4`), NaNs masked to 0, summed in two f64x2 accumulators
/// (an f32 sum of 262,144 terms would lose ~1e-3).
pub fn sum_exp(v: &[f32], max: f32) -> f64 {
    let n = v.len();
    let vmax = f32x4_splat(max);
    let (mut lo, mut hi) = (f64x2_splat(0.0), f64x2_splat(0.0));
    let mut i = 0;
    // SAFETY: every load is of 4 floats below `n`.
    unsafe {
        let p = v.as_ptr();
        while i + 4 <= n {
            let x = v128_load(p.add(i) as *const v128);
            let e = v128_and(exp4(f32x4_sub(x, vmax)), f32x4_eq(x, x));
            lo = f64x2_add(lo, f64x2_promote_low_f32x4(e));
            hi = f64x2_add(hi, f64x2_promote_low_f32x4(i32x4_shuffle::<2, 3, 0, 1>(e, e)));
            i += 4;
        }
    }
    let s = f64x2_add(lo, hi);
    let tail: f64 = v[i..].iter().filter(|x| !x.is_nan()).map(|&x| (x - max).exp() as f64).sum();
    f64x2_extract_lane::<0>(s) + f64x2_extract_lane::<1>(s) + tail
}

/// `x[i] *= k * w[i]`: four vectors a step (the same products as `scalar::scale_mul`).
pub fn scale_mul(x: &mut [f32], w: &[f32], k: f32) {
    let n = x.len().min(w.len());
    let kv = f32x4_splat(k);
    let mut i = 0;
    // SAFETY: every load and store is of 4 floats below `n`.
    unsafe {
        let (px, pw) = (x.as_mut_ptr(), w.as_ptr());
        while i + 16 <= n {
            for o in [0, 4, 8, 12] {
                let (a, b) = (px.add(i + o) as *mut v128, pw.add(i + o) as *const v128);
                v128_store(a, f32x4_mul(v128_load(a), f32x4_mul(kv, v128_load(b))));
            }
            i += 16;
        }
    }
    for (v, w) in x[i..n].iter_mut().zip(&w[i..n]) {
        *v *= k * w;
    }
}

/// `x[i] += y[i]`, four vectors a step.
pub fn add(x: &mut [f32], y: &[f32]) {
    let n = x.len().min(y.len());
    let mut i = 0;
    // SAFETY: every load and store is of 4 floats below `n`.
    unsafe {
        let (px, py) = (x.as_mut_ptr(), y.as_ptr());
        while i + 16 <= n {
            for o in [0, 4, 8, 12] {
                let (a, b) = (px.add(i + o) as *mut v128, py.add(i + o) as *const v128);
                v128_store(a, f32x4_add(v128_load(a), v128_load(b)));
            }
            i += 16;
        }
    }
    for (v, y) in x[i..n].iter_mut().zip(&y[i..n]) {
        *v += y;
    }
}

/// Pairs rotated by their angles, two vectors of each a step (the same products and sums as
/// `scalar::rotate_pairs`).
pub fn rotate_pairs(a: &mut [f32], b: &mut [f32], cos: &[f32], sin: &[f32]) {
    let n = a.len().min(b.len()).min(cos.len()).min(sin.len());
    let mut i = 0;
    // SAFETY: every load and store is of 4 floats below `n`.
    unsafe {
        let (pa, pb, pc, ps) = (a.as_mut_ptr(), b.as_mut_ptr(), cos.as_ptr(), sin.as_ptr());
        while i + 8 <= n {
            for o in [0, 4] {
                let (va, vb) = (pa.add(i + o) as *mut v128, pb.add(i + o) as *mut v128);
                let (x0, x1) = (v128_load(va), v128_load(vb));
                let (c, s) = (v128_load(pc.add(i + o) as *const v128), v128_load(ps.add(i + o) as *const v128));
                v128_store(va, f32x4_sub(f32x4_mul(x0, c), f32x4_mul(x1, s)));
                v128_store(vb, f32x4_add(f32x4_mul(x0, s), f32x4_mul(x1, c)));
            }
            i += 8;
        }
    }
    for j in i..n {
        let (x0, x1) = (a[j], b[j]);
        a[j] = x0 * cos[j] - x1 * sin[j];
        b[j] = x0 * sin[j] + x1 * cos[j];
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [f32x4_splat(0.0); 4];
    let mut i = 0;
    // SAFETY: every load is of 4 floats below `n`.
    unsafe {
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let load = |p: *const f32, i: usize| v128_load(p.add(i) as *const v128);
        // Four independent sums, so that the adds' latency is not the bound.
        while i + 16 <= n {
            acc[0] = f32x4_add(acc[0], f32x4_mul(load(pa, i), load(pb, i)));
            acc[1] = f32x4_add(acc[1], f32x4_mul(load(pa, i + 4), load(pb, i + 4)));
            acc[2] = f32x4_add(acc[2], f32x4_mul(load(pa, i + 8), load(pb, i + 8)));
            acc[3] = f32x4_add(acc[3], f32x4_mul(load(pa, i + 12), load(pb, i + 12)));
            i += 16;
        }
        while i + 4 <= n {
            acc[0] = f32x4_add(acc[0], f32x4_mul(load(pa, i), load(pb, i)));
            i += 4;
        }
    }
    let mut s = hsum(f32x4_add(f32x4_add(acc[0], acc[1]), f32x4_add(acc[2], acc[3])));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// See `kernels::dot_rows` (which checks the bounds). Four rows at a time: each load of the query
/// serves four rows, and the four sums come out of one transposition.
pub fn dot_rows(q: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    let n = q.len();
    let n4 = n & !3;
    let mut j = 0;
    while j + 4 <= out.len() {
        let mut acc = [f32x4_splat(0.0); 4];
        // SAFETY: the loads read `q[i..i + 4]` and `rows[(j + r) * stride + i..][..4]` for
        // `i + 4 <= n` and `j + r < out.len()`: inside `rows` by the caller's check that it holds
        // `out.len()` rows of `n` elements, `stride` apart.
        unsafe {
            let (pq, pr) = (q.as_ptr(), rows.as_ptr().add(j * stride));
            let mut i = 0;
            while i < n4 {
                let x = v128_load(pq.add(i) as *const v128);
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = f32x4_add(*a, f32x4_mul(x, v128_load(pr.add(r * stride + i) as *const v128)));
                }
                i += 4;
            }
        }
        let [a, b, c, d] = acc;
        let sums = hsum4_f32(a, b, c, d);
        for (r, o) in out[j..j + 4].iter_mut().enumerate() {
            let row = &rows[(j + r) * stride..(j + r) * stride + n];
            let tail: f32 = q[n4..].iter().zip(&row[n4..]).map(|(x, y)| x * y).sum();
            *o = scale * (sums[r] + tail);
        }
        j += 4;
    }
    for (k, o) in out[j..].iter_mut().enumerate() {
        let at = (j + k) * stride;
        *o = scale * dot(q, &rows[at..at + n]);
    }
}

/// See `kernels::weighted_sum`. Sixteen outputs at a time are accumulated in registers over
/// all the rows, then stored once.
pub fn weighted_sum(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let n = out.len();
    let mut c = 0;
    if !w.is_empty() {
        assert!(rows.len() >= (w.len() - 1) * stride + n);
        // SAFETY: the loads read `rows[j * stride + c..][..16]` for `j < w.len()` and
        // `c + 16 <= n`, inside `rows` by the assert; the stores are of `out[c..c + 16]`.
        unsafe {
            while c + 16 <= n {
                let o = out.as_mut_ptr().add(c) as *mut v128;
                let mut acc = [v128_load(o), v128_load(o.add(1)), v128_load(o.add(2)), v128_load(o.add(3))];
                let mut p = rows.as_ptr().add(c);
                for &wj in w {
                    let s = f32x4_splat(wj);
                    let r = p as *const v128;
                    acc[0] = f32x4_add(acc[0], f32x4_mul(s, v128_load(r)));
                    acc[1] = f32x4_add(acc[1], f32x4_mul(s, v128_load(r.add(1))));
                    acc[2] = f32x4_add(acc[2], f32x4_mul(s, v128_load(r.add(2))));
                    acc[3] = f32x4_add(acc[3], f32x4_mul(s, v128_load(r.add(3))));
                    p = p.wrapping_add(stride);
                }
                for (k, a) in acc.into_iter().enumerate() {
                    v128_store(o.add(k), a);
                }
                c += 16;
            }
        }
    }
    for (j, &wj) in w.iter().enumerate() {
        for (o, r) in out[c..].iter_mut().zip(&rows[j * stride + c..]) {
            *o += wj * r;
        }
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

/// See `scalar::quantize_block8`: the same `q`, scale and half-block sums.
pub fn quantize_block8(x: &[f32], q: &mut [i8]) -> (f32, [i32; 2]) {
    assert!(x.len() == 32 && q.len() == 32);
    // SAFETY: eight loads of 4 floats from `x` and two stores of 16 i8 to `q`, both of 32.
    unsafe {
        let v: [v128; 8] = core::array::from_fn(|i| v128_load(x.as_ptr().add(4 * i) as *const v128));
        // `pmax` keeps its first operand when the second is NaN, as `f32::max` does.
        let mut m = f32x4_abs(v[0]);
        for &vi in &v[1..] {
            m = f32x4_pmax(m, f32x4_abs(vi));
        }
        let m = f32x4_pmax(m, i32x4_shuffle::<2, 3, 0, 1>(m, m));
        let m = f32x4_pmax(m, i32x4_shuffle::<1, 0, 3, 2>(m, m));
        let scale = f32x4_extract_lane::<0>(m) / 127.0;
        let inv = f32x4_splat(if scale > 0.0 && scale.is_finite() { 1.0 / scale } else { 0.0 });
        let quant = |v: v128| i32x4_trunc_sat_f32x4(f32x4_nearest(f32x4_mul(v, inv)));
        let mut sums = [0i32; 2];
        for (h, sum) in sums.iter_mut().enumerate() {
            let lo = i16x8_narrow_i32x4(quant(v[4 * h]), quant(v[4 * h + 1]));
            let hi = i16x8_narrow_i32x4(quant(v[4 * h + 2]), quant(v[4 * h + 3]));
            let bytes = i8x16_narrow_i16x8(lo, hi);
            v128_store(q.as_mut_ptr().add(16 * h) as *mut v128, bytes);
            let s = i32x4_extadd_pairwise_i16x8(i16x8_add(lo, hi));
            *sum = i32x4_extract_lane::<0>(s) + i32x4_extract_lane::<1>(s) + i32x4_extract_lane::<2>(s) + i32x4_extract_lane::<3>(s);
        }
        (scale, sums)
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

