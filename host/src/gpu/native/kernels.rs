//! The native device's products, a weight's rows with rows of x, in each upload format: the
//! plain reading of each (`scalar`, which also runs where no vector unit below is found) and
//! x86-64 AVX2 + FMA versions chosen at run time ([`Isa::detect`]), whose `fast` products use
//! `vpdpbusd` where the CPU has AVX-VNNI or AVX-512 VNNI (the same integers summed, the same
//! bits), and with AVX-512 its 32 vector registers for larger tiles.
//!
//! Two ways of summing, as the WIT `precision` names them:
//! - `exact`: each weight decoded to f32 as the contract reads it (`d * q - m`), then f32
//!   products and sums. A row's result depends on its x row and the weight alone, never on the
//!   other rows of the batch: the order of its sums is fixed (eight lanes over the row, then
//!   their sum in one order; for a weight of interleaved rows four sums, [`scalar::exact_group`]),
//!   whichever rows share a pass.
//! - `fast`: each x row quantized per block of the weight's format to int8 (`sx * qx`, `qx` in
//!   -127..=127, as llama.cpp's `q8_0` activations), integer products within a block, f32 across
//!   blocks: `sum_b dw_b sx_b (qw . qx)_b - sum_b m_b sx_b (sum qx)_b`.
//!
//! A weight is written in its upload format (the f32 scales split out of their interleaving:
//! `d` and, for `q4x32`, `m` apart) and, once written, takes a form of its own where it has one
//! ([`Stored::compacted`]): Q4_K's, Q6_K's, five-bit and Q8_0's values with their rows
//! interleaved eight at a time ([`GROUP`]), each 32-bit lane of a vector four values of one
//! row, so that `vpdpbusd` sums a block of 32 with eight rows at once and a block's scaling is
//! done once for the eight ([`Groups`]).

use super::super::{Activation, Format};

/// A weight as the native device holds it: `[n_out, n_in]`, rows in order.
pub enum Stored {
    /// f32 values.
    F32(Vec<f32>),
    /// bfloat16 values (the high halves of f32).
    Bf16(Vec<u16>),
    /// Signed bytes, one f32 scale per `block` (16 or 32) elements.
    Q8 { block: usize, q: Vec<i8>, d: Vec<f32> },
    /// Unsigned nibbles (element `2j` in byte `j`'s low half), `d` and `m` per 32 elements.
    Q4 { q: Vec<u8>, d: Vec<f32>, m: Vec<f32> },
    /// A `q8x32` weight whose every value lies in -16..=15 (what GGUF's Q5_0 and Q4_0 make),
    /// kept in five bits, as Q5_0 keeps it (0.75 bytes a value against `q8x32`'s 1.125): `u =
    /// q + 16`, `d` per 32 values: `w = d * (u - 16)`, the same weight in either form.
    ///
    /// Rows in groups of [`GROUP`] as [`Stored::Q4K`]'s: `u`'s low four bits in `q` as its
    /// nibbles; its fifth in `h`, 32 bytes a group's block of 32 (at `(g * nb + b) * 32`):
    /// byte `4l + e`'s bit `4 half + k` that of row `8g + l`'s value `32b + 16 half + 4k + e`;
    /// `d` at `(g * nb + b) * 8 + l`.
    Q5 { rows: usize, q: Vec<u8>, h: Vec<u8>, d: Vec<f32> },
    /// A `q8x32` weight of other values, its rows in groups of [`GROUP`] as [`Stored::Q4K`]'s:
    /// `u = q + 128` (unsigned, for `vpdpbusd`) in `q`, 256 bytes a group's block of 32 (at
    /// `(g * nb + b) * 256`): byte `32k + 4l + e` row `8g + l`'s value `32b + 4k + e`; `d` at
    /// `(g * nb + b) * 8 + l`: `w = d * (u - 128)`, the same weight.
    Q8G { rows: usize, q: Vec<u8>, d: Vec<f32> },
    /// A `q4x32` weight of other scales (Q4_1's, or Q4_K's in rows that are not whole
    /// superblocks), its nibbles as [`Stored::Q4K`]'s, its `d` and `m` at `(g * nb + b) * 8 +
    /// l`: the same weight.
    Q4G { rows: usize, q: Vec<u8>, d: Vec<f32>, m: Vec<f32> },
    /// A `q4x32` weight whose scales and mins are GGUF Q4_K's: per superblock of [`SUPER`]
    /// values (eight blocks, rows a whole number of them) an f32 `d` and `dmin`, per block of 32
    /// six-bit integers `sc` and `mn`, `d_b = d * sc_b` and `m_b = dmin * mn_b` in f32: the very
    /// scales uploaded (checked when the form is taken, [`Stored::compacted`]). 0.59 bytes a
    /// value against [`Stored::Q4`]'s 0.75, as llama.cpp reads Q4_K.
    ///
    /// Its rows go in groups of [`GROUP`] (the last padded with zero rows), each group's values
    /// interleaved so that one 256-bit vector holds four values of each of its eight rows: a
    /// `fast` product sums a block of all eight rows in eight 32-bit lanes, one instruction for
    /// 32 products, and scales the block once for the eight (ggml's repacked Q4_K reads its
    /// weights alike). Per group and block of 32 (group `g`, block `b`, at `(g * nb + b) *
    /// 128`), 128 bytes: byte `32k + 4l + e` holds row `8g + l`'s values `32b + 4k + e` in its
    /// low half and `32b + 16 + 4k + e` in its high half. `sc` and `mn` at `(g * nb + b) * 8 +
    /// l`, `d` and `dmin` at `(g * nsb + s) * 8 + l` (superblock `s` of `nsb` a row).
    Q4K { rows: usize, q: Vec<u8>, sc: Vec<u8>, mn: Vec<u8>, d: Vec<f32>, dmin: Vec<f32> },
    /// A `q8x16` weight of GGUF Q6_K's values and scales: every value in -32..=31, kept as `u
    /// = q + 32` in six bits, and per superblock of [`SUPER`] values an f32 `d` and per 16 a
    /// signed byte `sc`, `d_b = d * sc_b` in f32 the very scale uploaded (checked when the form
    /// is taken). 0.83 bytes a value against `q8x16`'s 1.25.
    ///
    /// Rows in groups of [`GROUP`] as [`Stored::Q4K`]'s: `u`'s low four bits in `q` as its
    /// nibbles; its top two in `h`, 64 bytes a group's block of 32 (at `(g * nb + b) * 64`):
    /// byte `32 half + 4l + e`'s bits `2k, 2k + 1` those of row `8g + l`'s value `32b + 16 half
    /// + 4k + e`. `sc` 16 bytes a group's block (at `(g * nb + b) * 16`): its first block of
    /// 16's eight rows, then its second's; `d` at `(g * nsb + s) * 8 + l`.
    Q6K { rows: usize, q: Vec<u8>, h: Vec<u8>, sc: Vec<i8>, d: Vec<f32> },
}

/// Values a superblock of [`Stored::Q4K`] (GGUF's K-quants' 256): eight blocks of 32.
pub const SUPER: usize = 256;

/// Rows of a [`Stored::Q4K`] or [`Stored::Q6K`] weight interleaved together (the lanes of a
/// 256-bit vector).
pub const GROUP: usize = 8;

/// The forms of interleaved rows, as [`Groups::form`] names them: [`Stored::Q4K`].
pub const K4: u8 = 0;
/// [`Stored::Q6K`].
pub const K6: u8 = 1;
/// [`Stored::Q5`].
pub const F5: u8 = 2;
/// [`Stored::Q8G`].
pub const E8: u8 = 3;
/// [`Stored::Q4G`].
pub const F4: u8 = 4;

/// The nibbles of `rows` rows of `n_in` (each byte two values, the first in its low half) in
/// the layout of [`Stored::Q4K`]'s, the last group padded with zeros; `None` where memory is
/// short.
fn group_nibbles(q: &[u8], n_in: usize, rows: usize) -> Option<Vec<u8>> {
    let len = rows.div_ceil(GROUP) * GROUP * n_in / 2;
    let mut nibbles = Vec::new();
    nibbles.try_reserve_exact(len).ok()?;
    huge_pages(nibbles.as_mut_ptr(), len);
    nibbles.resize(len, 0u8);
    for (r, row) in q.chunks_exact(n_in / 2).enumerate() {
        for (b, src) in row.chunks_exact(16).enumerate() {
            // The block's values `4k + e` and `16 + 4k + e`, one byte ([`q4k_slot`]).
            let at = q4k_slot(r, 32 * b, n_in).0;
            let v = |i: usize| (src[i / 2] >> (4 * (i % 2))) & 0xF;
            for k in 0..4 {
                for e in 0..4 {
                    nibbles[at + 32 * k + e] = v(4 * k + e) | v(16 + 4 * k + e) << 4;
                }
            }
        }
    }
    Some(nibbles)
}

/// A value a block (`nb` a row, `rows` rows) in the groups' order: block `b` of row `8g + l`
/// at `(g * nb + b) * 8 + l`, the last group padded with zeros.
fn group_blocks(v: &[f32], nb: usize, rows: usize) -> Option<Vec<f32>> {
    let mut out = Vec::new();
    out.try_reserve_exact(rows.div_ceil(GROUP) * GROUP * nb).ok()?;
    out.resize(rows.div_ceil(GROUP) * GROUP * nb, 0f32);
    for (r, row) in v.chunks_exact(nb).enumerate() {
        for (b, &x) in row.iter().enumerate() {
            out[group_block(r, b, nb)] = x;
        }
    }
    Some(out)
}

/// Q4_K's integer scales and mins of a `q4x32` weight's `d` and `m` (`rows` rows of `n_in`, a
/// whole number of superblocks) in [`Stored::Q4K`]'s order, where every superblock's are an
/// f32 times six-bit integers, bit for bit ([`k_scales`]).
#[allow(clippy::type_complexity)]
fn k4_scales(d: &[f32], m: &[f32], n_in: usize, rows: usize) -> Option<(Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>)> {
    let (nb, nsb) = (n_in / 32, n_in / SUPER);
    let padded = rows.div_ceil(GROUP) * GROUP;
    let (mut sc, mut mn) = (Vec::new(), Vec::new());
    let (mut ds, mut mins) = (Vec::new(), Vec::new());
    sc.try_reserve_exact(padded * nb).ok()?;
    mn.try_reserve_exact(padded * nb).ok()?;
    ds.try_reserve_exact(padded * nsb).ok()?;
    mins.try_reserve_exact(padded * nsb).ok()?;
    sc.resize(padded * nb, 0u8);
    mn.resize(padded * nb, 0u8);
    ds.resize(padded * nsb, 0f32);
    mins.resize(padded * nsb, 0f32);
    for (r, (dr, mr)) in d.chunks_exact(nb).zip(m.chunks_exact(nb)).enumerate() {
        for (s, (dv, mv)) in dr.chunks_exact(8).zip(mr.chunks_exact(8)).enumerate() {
            let (a, ka) = k_scales::<8>(dv, 0..=63)?;
            let (b, kb) = k_scales::<8>(mv, 0..=63)?;
            ds[group_block(r, s, nsb)] = a;
            mins[group_block(r, s, nsb)] = b;
            for k in 0..8 {
                sc[group_block(r, 8 * s + k, nb)] = ka[k] as u8;
                mn[group_block(r, 8 * s + k, nb)] = kb[k] as u8;
            }
        }
    }
    Some((sc, mn, ds, mins))
}

/// A weight of interleaved rows ([`Stored::Q4K`], [`Stored::Q6K`], [`Stored::Q5`]), whole:
/// its nibbles; Q4_K's integers and superblock scales, or Q6_K's top bits, signed bytes and
/// superblock scales, or the five-bit form's fifth bits and block scales (the others empty).
#[derive(Clone, Copy)]
pub struct Groups<'a> {
    form: u8,
    q: &'a [u8],
    h: &'a [u8],
    sc: &'a [u8],
    mn: &'a [u8],
    sc6: &'a [i8],
    d: &'a [f32],
    dmin: &'a [f32],
}

impl<'a> Groups<'a> {
    /// `w`'s parts where it is a weight of interleaved rows.
    pub fn of(w: &'a Stored) -> Option<Groups<'a>> {
        let none = Groups { form: K4, q: &[], h: &[], sc: &[], mn: &[], sc6: &[], d: &[], dmin: &[] };
        match w {
            Stored::Q4K { q, sc, mn, d, dmin, .. } => Some(Groups { q, sc, mn, d, dmin, ..none }),
            Stored::Q6K { q, h, sc, d, .. } => Some(Groups { form: K6, q, h, sc6: sc, d, ..none }),
            Stored::Q5 { q, h, d, .. } => Some(Groups { form: F5, q, h, d, ..none }),
            Stored::Q8G { q, d, .. } => Some(Groups { form: E8, q, d, ..none }),
            Stored::Q4G { q, d, m, .. } => Some(Groups { form: F4, q, d, dmin: m, ..none }),
            _ => None,
        }
    }

    /// Which form: [`K4`], [`K6`], [`F5`], [`E8`] or [`F4`].
    pub fn form(&self) -> u8 {
        self.form
    }
}

/// Value `i` of row `r` (rows of `n_in`) in a weight of interleaved rows: its group's block
/// (`g * nb + b`, row `8g + l`, `i = 32b + 16 half + 4k + e`), its lane `l`, and where it lies
/// in the block: `half`, `k`, `e`.
struct Slot {
    block: usize,
    l: usize,
    half: usize,
    k: usize,
    e: usize,
}

#[inline(always)]
fn slot(r: usize, i: usize, n_in: usize) -> Slot {
    let j = i % 32;
    Slot { block: (r / GROUP) * (n_in / 32) + i / 32, l: r % GROUP, half: j / 16, k: j % 16 / 4, e: j % 4 }
}

/// Where row `r`'s value of block `b` (of `nb` a row) lies in a weight of interleaved rows'
/// values a block (scales, mins): `(g * nb + b) * 8 + l`.
#[inline(always)]
fn group_block(r: usize, b: usize, nb: usize) -> usize {
    ((r / GROUP) * nb + b) * GROUP + r % GROUP
}

/// Where value `i` of row `r` (rows of `n_in`) lies in the nibbles of a weight of interleaved
/// rows: the byte, and the shift of its half (0 or 4).
#[inline(always)]
fn q4k_slot(r: usize, i: usize, n_in: usize) -> (usize, u32) {
    let s = slot(r, i, n_in);
    (s.block * 128 + 32 * s.k + 4 * s.l + s.e, 4 * s.half as u32)
}

/// Where value `i` of row `r`'s top two bits lie in a [`Stored::Q6K`] weight's `h`: the byte,
/// and the shift.
#[inline(always)]
fn q6k_top(r: usize, i: usize, n_in: usize) -> (usize, u32) {
    let s = slot(r, i, n_in);
    (s.block * 64 + 32 * s.half + 4 * s.l + s.e, 2 * s.k as u32)
}

/// Where value `i` of row `r`'s fifth bit lies in a [`Stored::Q5`] weight's `h`: the byte, and
/// the bit.
#[inline(always)]
fn q5_top(r: usize, i: usize, n_in: usize) -> (usize, u32) {
    let s = slot(r, i, n_in);
    (s.block * 32 + 4 * s.l + s.e, (4 * s.half + s.k) as u32)
}

/// The f32 `s` and the integers `k` in `ints` with `s * k_b == v_b`, bit for bit, for each of
/// a superblock's block scales `v` (`None` where there are none): Q4_K's eight six-bit ones
/// (`0..=63`) or Q6_K's sixteen signed bytes (`-128..=127`). llama.cpp quantizes the scale of
/// largest magnitude to the range's end of largest magnitude (63, -128), so `s` is tried as
/// that scale over it first, then over each other integer. With no negative integers, the
/// largest scale is the one taken (a negative one could not fit).
fn k_scales<const N: usize>(v: &[f32], ints: core::ops::RangeInclusive<i32>) -> Option<(f32, [i32; N])> {
    let (lo, hi) = (*ints.start(), *ints.end());
    let top = if lo < 0 { v.iter().copied().fold(0f32, |a, b| if b.abs() > a.abs() { b } else { a }) } else { v.iter().copied().fold(0f32, f32::max) };
    let fits = |s: f32, k: &mut [i32; N]| {
        v.iter().zip(k.iter_mut()).all(|(&b, o)| {
            let f = if s != 0.0 { b / s } else { 0.0 };
            // `as i32` saturates (a NaN gives 0): the check refuses what does not fit.
            *o = (f + 0.5f32.copysign(f)) as i32;
            ints.contains(o) && (s * *o as f32).to_bits() == b.to_bits()
        })
    };
    let mut k = [0i32; N];
    if top == 0.0 {
        return fits(0.0, &mut k).then_some((0.0, k));
    }
    let far = if -lo > hi { lo } else { hi };
    let others = (1..=hi).rev().chain((lo..=-1).rev()).filter(|&c| c != far);
    core::iter::once(far).chain(others).map(|c| top / c as f32).find(|&s| fits(s, &mut k)).map(|s| (s, k))
}

/// Elements of a block of activations quantized together in `fast` (the weight's block).
pub fn block_of(format: Format) -> usize {
    match format {
        Format::Q8x16 => 16,
        _ => 32,
    }
}

impl Stored {
    /// A zeroed weight of `n` elements in `format`, or `None` where memory is short.
    pub fn zeroed(format: Format, n: usize) -> Option<Stored> {
        fn zeros<T: Clone + Default>(n: usize) -> Option<Vec<T>> {
            let mut v: Vec<T> = Vec::new();
            v.try_reserve_exact(n).ok()?;
            huge_pages(v.as_mut_ptr().cast(), n * size_of::<T>());
            v.resize(n, T::default());
            Some(v)
        }
        Some(match format {
            Format::F32 => Stored::F32(zeros(n)?),
            Format::Bf16 => Stored::Bf16(zeros(n)?),
            Format::Q8x32 | Format::Q8x16 => {
                let block = block_of(format);
                Stored::Q8 { block, q: zeros(n)?, d: zeros(n / block)? }
            }
            Format::Q4x32 => Stored::Q4 { q: zeros(n / 2)?, d: zeros(n / 32)?, m: zeros(n / 32)? },
        })
    }

    /// Writes rows starting at element `at` (a row's first) from their upload bytes and scales.
    /// The caller checked that they fit (`GpuCtx::write_rows`).
    pub fn write(&mut self, at: usize, data: &[u8], scales: &[f32]) {
        match self {
            Stored::F32(w) => {
                for (o, c) in w[at..].iter_mut().zip(data.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Stored::Bf16(w) => {
                for (o, c) in w[at..].iter_mut().zip(data.chunks_exact(2)) {
                    *o = u16::from_le_bytes([c[0], c[1]]);
                }
            }
            Stored::Q8 { block, q, d } => {
                for (o, &b) in q[at..].iter_mut().zip(data) {
                    *o = b as i8;
                }
                d[at / *block..][..scales.len()].copy_from_slice(scales);
            }
            Stored::Q4 { q, d, m } => {
                q[at / 2..][..data.len()].copy_from_slice(data);
                for (i, dm) in scales.chunks_exact(2).enumerate() {
                    d[at / 32 + i] = dm[0];
                    m[at / 32 + i] = dm[1];
                }
            }
            Stored::Q5 { .. } | Stored::Q4K { .. } | Stored::Q6K { .. } | Stored::Q8G { .. } | Stored::Q4G { .. } => unreachable!("a compacted weight is written in its upload format (`expanded` first)"),
        }
    }

    /// The weight (rows of `n_in`) in a form of its own, rows interleaved, where it has one: a
    /// `q8x32` weight in five bits where every value fits ([`Stored::Q5`]), else as its bytes
    /// ([`Stored::Q8G`]); a `q4x32` one with Q4_K's integer scales where every superblock's
    /// scales and mins are an f32 times six-bit integers ([`Stored::Q4K`]), else with its own
    /// ([`Stored::Q4G`]); a `q8x16` one in six bits where its values and scales are Q6_K's
    /// ([`Stored::Q6K`]); `None` where it has none (or memory is short).
    pub fn compacted(&mut self, n_in: usize) -> Option<Stored> {
        if let Stored::Q4 { q, d, m } = self {
            let nb = n_in / 32;
            let rows = d.len() / nb;
            let nibbles = group_nibbles(q, n_in, rows)?;
            if n_in.is_multiple_of(SUPER)
                && let Some((sc, mn, ds, mins)) = k4_scales(d, m, n_in, rows)
            {
                return Some(Stored::Q4K { rows, q: nibbles, sc, mn, d: ds, dmin: mins });
            }
            return Some(Stored::Q4G { rows, q: nibbles, d: group_blocks(d, nb, rows)?, m: group_blocks(m, nb, rows)? });
        }
        if let Stored::Q8 { block: 16, q, d } = self {
            return Self::six_bits(q, d, n_in);
        }
        let Stored::Q8 { block: 32, q, d } = self else { return None };
        if q.iter().any(|&v| !(-16..=15).contains(&v)) {
            return Self::bytes(q, d, n_in);
        }
        let nb = n_in / 32;
        let rows = q.len() / n_in;
        let padded = rows.div_ceil(GROUP) * GROUP;
        let (mut nibbles, mut h, mut ds) = (Vec::new(), Vec::new(), Vec::new());
        nibbles.try_reserve_exact(padded * n_in / 2).ok()?;
        h.try_reserve_exact(padded * n_in / 8).ok()?;
        ds.try_reserve_exact(padded * nb).ok()?;
        huge_pages(nibbles.as_mut_ptr(), padded * n_in / 2);
        nibbles.resize(padded * n_in / 2, 0u8);
        h.resize(padded * n_in / 8, 0u8);
        ds.resize(padded * nb, 0f32);
        for (r, (row, dr)) in q.chunks_exact(n_in).zip(d.chunks_exact(nb)).enumerate() {
            for (b, values) in row.chunks_exact(32).enumerate() {
                ds[group_block(r, b, nb)] = dr[b];
                let u = |i: usize| (values[i] + 16) as u8;
                let (at, top) = (q4k_slot(r, 32 * b, n_in).0, q5_top(r, 32 * b, n_in).0);
                for k in 0..4 {
                    for e in 0..4 {
                        let (a, c) = (u(4 * k + e), u(16 + 4 * k + e));
                        nibbles[at + 32 * k + e] = (a & 0xF) | (c & 0xF) << 4;
                        h[top + e] |= (a >> 4) << k | (c >> 4) << (4 + k);
                    }
                }
            }
        }
        Some(Stored::Q5 { rows, q: nibbles, h, d: ds })
    }

    /// A `q8x32` weight ([`Stored::Q8`]'s `q` and `d`, rows of `n_in`) as [`Stored::Q8G`].
    fn bytes(q: &[i8], d: &[f32], n_in: usize) -> Option<Stored> {
        let nb = n_in / 32;
        let rows = q.len() / n_in;
        let padded = rows.div_ceil(GROUP) * GROUP;
        let (mut u, mut ds) = (Vec::new(), Vec::new());
        u.try_reserve_exact(padded * n_in).ok()?;
        ds.try_reserve_exact(padded * nb).ok()?;
        huge_pages(u.as_mut_ptr(), padded * n_in);
        u.resize(padded * n_in, 128u8);
        ds.resize(padded * nb, 0f32);
        for (r, (row, dr)) in q.chunks_exact(n_in).zip(d.chunks_exact(nb)).enumerate() {
            for (b, values) in row.chunks_exact(32).enumerate() {
                ds[group_block(r, b, nb)] = dr[b];
                let at = slot(r, 32 * b, n_in).block * 256 + 4 * (r % GROUP);
                for (k, four) in values.chunks_exact(4).enumerate() {
                    for (e, &v) in four.iter().enumerate() {
                        u[at + 32 * k + e] = (v as u8) ^ 0x80;
                    }
                }
            }
        }
        Some(Stored::Q8G { rows, q: u, d: ds })
    }

    /// Value `i` of row `r` of a [`Stored::Q8G`] weight (`q`), and its block's scale.
    fn q8g_at(&self, r: usize, i: usize, n_in: usize) -> (i8, f32) {
        let Stored::Q8G { q, d, .. } = self else { unreachable!("q8g_at of another form") };
        let s = slot(r, i, n_in);
        let at = s.block * 256 + 32 * (4 * s.half + s.k) + 4 * s.l + s.e;
        ((q[at] ^ 0x80) as i8, d[s.block * GROUP + s.l])
    }

    /// A `q8x16` weight ([`Stored::Q8`]'s `q` and `d`, rows of `n_in`) as [`Stored::Q6K`], where
    /// its rows are whole superblocks, its values six bits and its scales Q6_K's.
    fn six_bits(q: &[i8], d: &[f32], n_in: usize) -> Option<Stored> {
        if !n_in.is_multiple_of(SUPER) || q.iter().any(|&v| !(-32..=31).contains(&v)) {
            return None;
        }
        let (nb, nsb) = (n_in / 32, n_in / SUPER);
        let rows = q.len() / n_in;
        let padded = rows.div_ceil(GROUP) * GROUP;
        let (mut sc, mut ds, mut nibbles, mut h) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        sc.try_reserve_exact(padded * nb * 2).ok()?;
        ds.try_reserve_exact(padded * nsb).ok()?;
        nibbles.try_reserve_exact(padded * n_in / 2).ok()?;
        h.try_reserve_exact(padded * n_in / 4).ok()?;
        huge_pages(nibbles.as_mut_ptr(), padded * n_in / 2);
        sc.resize(padded * nb * 2, 0i8);
        ds.resize(padded * nsb, 0f32);
        nibbles.resize(padded * n_in / 2, 0u8);
        h.resize(padded * n_in / 4, 0u8);
        for (r, (row, dr)) in q.chunks_exact(n_in).zip(d.chunks_exact(n_in / 16)).enumerate() {
            let (g, l) = (r / GROUP, r % GROUP);
            for (sb, v) in dr.chunks_exact(16).enumerate() {
                let (s, k) = k_scales::<16>(v, -128..=127)?;
                ds[group_block(r, sb, nsb)] = s;
                for (j, &kj) in k.iter().enumerate() {
                    // Block of 16 `16sb + j`: block of 32 `8sb + j / 2`, its half `j % 2`.
                    sc[(g * nb + 8 * sb + j / 2) * 16 + 8 * (j % 2) + l] = kj as i8;
                }
            }
            for (b, values) in row.chunks_exact(32).enumerate() {
                let u = |i: usize| (values[i] + 32) as u8;
                let (at, top) = (q4k_slot(r, 32 * b, n_in).0, q6k_top(r, 32 * b, n_in).0);
                for k in 0..4 {
                    for e in 0..4 {
                        let (a, c) = (u(4 * k + e), u(16 + 4 * k + e));
                        nibbles[at + 32 * k + e] = (a & 0xF) | (c & 0xF) << 4;
                        h[top + e] |= (a >> 4) << (2 * k);
                        h[top + 32 + e] |= (c >> 4) << (2 * k);
                    }
                }
            }
        }
        Some(Stored::Q6K { rows, q: nibbles, h, sc, d: ds })
    }

    /// Value `i` of row `r` of a [`Stored::Q6K`] weight (`q`, -32..=31).
    fn q6_value(&self, r: usize, i: usize, n_in: usize) -> i8 {
        let Stored::Q6K { q, h, .. } = self else { unreachable!("q6_value of another form") };
        let (at, shift) = q4k_slot(r, i, n_in);
        let (top, tshift) = q6k_top(r, i, n_in);
        (((q[at] >> shift) & 0xF) | ((h[top] >> tshift) & 3) << 4) as i8 - 32
    }

    /// Row `r`'s block of 16 `b` (of `nb` a row) scale, of a [`Stored::Q6K`] weight.
    #[inline(always)]
    fn q6_scale(&self, r: usize, b: usize, nb: usize) -> f32 {
        let Stored::Q6K { sc, d, .. } = self else { unreachable!("q6_scale of another form") };
        let (g, l) = (r / GROUP, r % GROUP);
        d[group_block(r, b / 16, nb / 16)] * sc[(g * (nb / 2) + b / 2) * 16 + 8 * (b % 2) + l] as f32
    }

    /// A compacted weight back in its upload format, to be written: [`Stored::Q5`] in `q8x32`,
    /// [`Stored::Q4K`] in `q4x32` (its nibbles moved out of `self`); `None` for another form.
    pub fn expanded(&mut self, n_in: usize) -> Option<Stored> {
        if let Stored::Q4K { rows, .. } | Stored::Q4G { rows, .. } = *self {
            let nb = n_in / 32;
            let (mut d, mut m) = (vec![0f32; rows * nb], vec![0f32; rows * nb]);
            let mut q = vec![0u8; rows * n_in / 2];
            for r in 0..rows {
                for b in 0..nb {
                    (d[r * nb + b], m[r * nb + b]) = self.q4_scale(r, b, nb);
                }
                for i in 0..n_in {
                    q[(r * n_in + i) / 2] |= self.q4_value(r, i, n_in) << (4 * (i % 2));
                }
            }
            return Some(Stored::Q4 { q, d, m });
        }
        if let Stored::Q6K { rows, .. } = *self {
            let nb = n_in / 16;
            let mut d = vec![0f32; rows * nb];
            let mut q = vec![0i8; rows * n_in];
            for (r, row) in q.chunks_exact_mut(n_in).enumerate() {
                for b in 0..nb {
                    d[r * nb + b] = self.q6_scale(r, b, nb);
                }
                for (i, v) in row.iter_mut().enumerate() {
                    *v = self.q6_value(r, i, n_in);
                }
            }
            return Some(Stored::Q8 { block: 16, q, d });
        }
        if let Stored::Q8G { rows, .. } = *self {
            let nb = n_in / 32;
            let (mut q, mut d) = (vec![0i8; rows * n_in], vec![0f32; rows * nb]);
            for (r, row) in q.chunks_exact_mut(n_in).enumerate() {
                for (i, v) in row.iter_mut().enumerate() {
                    (*v, d[r * nb + i / 32]) = self.q8g_at(r, i, n_in);
                }
            }
            return Some(Stored::Q8 { block: 32, q, d });
        }
        let Stored::Q5 { rows, .. } = *self else { return None };
        let nb = n_in / 32;
        let mut d = vec![0f32; rows * nb];
        let mut q = vec![0i8; rows * n_in];
        for (r, row) in q.chunks_exact_mut(n_in).enumerate() {
            for b in 0..nb {
                d[r * nb + b] = self.q5_scale(r, b, nb);
            }
            for (i, v) in row.iter_mut().enumerate() {
                *v = self.q5_value(r, i, n_in);
            }
        }
        Some(Stored::Q8 { block: 32, q, d })
    }

    /// Value `i` of row `r` of a [`Stored::Q5`] weight (`q`, -16..=15).
    fn q5_value(&self, r: usize, i: usize, n_in: usize) -> i8 {
        let Stored::Q5 { q, h, .. } = self else { unreachable!("q5_value of another form") };
        let (at, shift) = q4k_slot(r, i, n_in);
        let (top, bit) = q5_top(r, i, n_in);
        (((q[at] >> shift) & 0xF) | ((h[top] >> bit) & 1) << 4) as i8 - 16
    }

    /// Row `r`'s block `b`'s (of `nb` a row) scale, of a [`Stored::Q5`] weight.
    #[inline(always)]
    fn q5_scale(&self, r: usize, b: usize, nb: usize) -> f32 {
        let Stored::Q5 { d, .. } = self else { unreachable!("q5_scale of another form") };
        d[group_block(r, b, nb)]
    }

    /// Row `r`'s block `b`'s (of `nb` a row) `d` and `m`, of a weight of nibbles without fifth
    /// bits ([`Stored::Q4`], [`Stored::Q4K`]).
    #[inline(always)]
    pub fn q4_scale(&self, r: usize, b: usize, nb: usize) -> (f32, f32) {
        match self {
            Stored::Q4 { d, m, .. } => (d[r * nb + b], m[r * nb + b]),
            Stored::Q4G { d, m, .. } => (d[group_block(r, b, nb)], m[group_block(r, b, nb)]),
            Stored::Q4K { sc, mn, d, dmin, .. } => {
                let (at, sat) = (group_block(r, b, nb), group_block(r, b / 8, nb / 8));
                (d[sat] * sc[at] as f32, dmin[sat] * mn[at] as f32)
            }
            _ => unreachable!("q4_scale of a weight without mins"),
        }
    }

    /// Value `i` of row `r` (0..=15), of a weight of nibbles without fifth bits.
    #[inline(always)]
    pub fn q4_value(&self, r: usize, i: usize, n_in: usize) -> u8 {
        match self {
            Stored::Q4 { q, .. } => (q[(r * n_in + i) / 2] >> (4 * (i % 2))) & 0xF,
            Stored::Q4K { q, .. } | Stored::Q4G { q, .. } => {
                let (at, shift) = q4k_slot(r, i, n_in);
                (q[at] >> shift) & 0xF
            }
            _ => unreachable!("q4_value of a weight without mins"),
        }
    }

    /// Row `o` (of `n_in` elements) decoded to f32 into `out`, as the contract reads it.
    pub fn decode_row(&self, o: usize, n_in: usize, out: &mut [f32]) {
        let out = &mut out[..n_in];
        match self {
            Stored::F32(w) => out.copy_from_slice(&w[o * n_in..][..n_in]),
            Stored::Bf16(w) => {
                for (x, &b) in out.iter_mut().zip(&w[o * n_in..][..n_in]) {
                    *x = f32::from_bits((b as u32) << 16);
                }
            }
            Stored::Q8 { block, q, d } => {
                let (q, d) = (&q[o * n_in..][..n_in], &d[o * n_in / *block..][..n_in / *block]);
                for ((x, &q), i) in out.iter_mut().zip(q).zip(0..) {
                    *x = d[i / *block] * q as f32;
                }
            }
            Stored::Q4 { .. } | Stored::Q4K { .. } | Stored::Q4G { .. } => {
                for (i, x) in out.iter_mut().enumerate() {
                    let (d, m) = self.q4_scale(o, i / 32, n_in / 32);
                    *x = d * self.q4_value(o, i, n_in) as f32 - m;
                }
            }
            Stored::Q5 { .. } => {
                for (i, x) in out.iter_mut().enumerate() {
                    *x = self.q5_scale(o, i / 32, n_in / 32) * self.q5_value(o, i, n_in) as f32;
                }
            }
            Stored::Q8G { .. } => {
                for (i, x) in out.iter_mut().enumerate() {
                    let (v, d) = self.q8g_at(o, i, n_in);
                    *x = d * v as f32;
                }
            }
            Stored::Q6K { .. } => {
                for (i, x) in out.iter_mut().enumerate() {
                    *x = self.q6_scale(o, i / 16, n_in / 16) * self.q6_value(o, i, n_in) as f32;
                }
            }
        }
    }

    /// How a `fast` product quantizes x for this weight: the block, and whether in the
    /// `q4x32` layout; `None` for the float forms (their `fast` is `exact`).
    pub fn x_layout(&self) -> Option<(usize, bool)> {
        match self {
            Stored::F32(_) | Stored::Bf16(_) => None,
            Stored::Q8 { block, .. } => Some((*block, false)),
            Stored::Q4 { .. } => Some((32, true)),
            Stored::Q4K { .. } | Stored::Q4G { .. } | Stored::Q5 { .. } | Stored::Q8G { .. } => Some((32, false)),
            Stored::Q6K { .. } => Some((16, false)),
        }
    }
}

/// Bytes ahead of a one-row kernel's reading that it asks the memory for (a decode step streams
/// each weight from memory once): 512 to 4096 measured alike here.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 1024;

/// Rows of x an `exact` product's inner loops take at once (each weight row decoded once for
/// them, held in the cache while the weight's rows sweep them).
pub const X_TILE: usize = 32;

/// Weight rows a `fast` product's vector kernel sweeps with the same rows of x (held in the L1
/// cache with them).
pub const FAST_BLOCK: usize = 16;

/// Asks the kernel to back `len` bytes from `ptr` with transparent huge pages where it can (a
/// hint; nothing changes where it cannot). A product streams its weight from memory, and with
/// 4 KiB pages a large weight misses the TLB every few rows, which costs most in a virtual
/// machine: measured here, a decode step's output projection (262144 x 640, q8x32) streams
/// at ~7 GB/s on 4 KiB pages.
fn huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + len) / HUGE * HUGE;
        if end > start {
            // SAFETY: `madvise` only advises on pages of this process's own allocation
            // (`start..end` lies inside `ptr..ptr + len`, whole 2 MiB pages); it reads and
            // writes no memory, and its failure is harmless (the hint is dropped).
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// The vector unit the kernels use, found at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust (what the compiler makes of it for the baseline target).
    Scalar,
    /// x86-64 AVX2 with FMA.
    Avx2,
    /// AVX2 with FMA, and AVX-VNNI for `fast` products: `vpdpbusd` multiplies a block's bytes
    /// and sums each four into 32 bits in one instruction where AVX2 takes two (`vpmaddubsw`,
    /// `vpmaddwd`), or four for a weight of nibbles. The 256-bit (VEX) form: Intel's CPUs from
    /// Alder Lake and Sapphire Rapids, AMD's from Zen 5.
    Avx2Vnni,
    /// AVX2 with FMA, and AVX-512 (F, BW, VL) with VNNI: `vpdpbusd`'s EVEX form on the same
    /// 256-bit vectors (also where AVX-VNNI is missing: AMD's Zen 4, Intel's Ice Lake), and
    /// AVX-512's 32 registers and byte masks in the kernels.
    Avx512Vnni,
}

impl Isa {
    /// The best this CPU offers of those the kernels know.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            use std::arch::is_x86_feature_detected as has;
            // AVX-512 first where a CPU has both (Sapphire Rapids): the same products, and its
            // registers and masks besides.
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
                return Isa::Avx512Vnni;
            }
            if has!("avxvnni") {
                return Isa::Avx2Vnni;
            }
            return Isa::Avx2;
        }
        Isa::Scalar
    }

    /// Whether the AVX2 + FMA kernels run (every `Isa` but `Scalar`).
    pub fn avx2(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::Avx2Vnni | Isa::Avx512Vnni)
    }

    /// Its name, as `wisp info` prints it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx2Vnni => "avx2+fma+avx-vnni",
            Isa::Avx512Vnni => "avx2+fma+avx512-vnni",
        }
    }
}

/// Rows of x quantized for `fast` products with a weight of one format: per row, int8 values
/// in the layout the format's kernel reads, a scale per block, and per block the scale times
/// the sum of its values (the `m` term of `q4x32`).
pub struct Quantized {
    /// Values a block.
    pub block: usize,
    /// `[t, n_in]`. In the `q4x32` layout (for weights of nibbles), each pair of blocks of 32,
    /// A and B, reorders as A's even elements, B's even, A's odd, B's odd (a lone last block
    /// as its even, then its odd elements), the order in which a weight's nibbles unpack; else
    /// the row's order.
    pub q: Vec<i8>,
    /// `[t, n_in / block]`.
    pub s: Vec<f32>,
    /// `[t, n_in / block]`: `s * sum(q)` of each block.
    pub c: Vec<f32>,
    /// `[t, n_in / block / 2 * 8]`: for each pair of blocks A, B, `[s_A x4, s_B x4]` (the
    /// scales as the vector kernels of the formats with two blocks a 256-bit step read them).
    pub pairs: Vec<f32>,
}

/// Where element `i` of a row goes in the `q4x32` layout of [`Quantized::q`] (n_in elements,
/// a multiple of 32).
pub fn q4_slot(i: usize, n_in: usize) -> usize {
    let (b, j) = (i / 32, i % 32);
    let (even, odd) = q4_bases(b, n_in / 32);
    if j % 2 == 0 { even + j / 2 } else { odd + j / 2 }
}

/// Where block `b`'s even and odd elements start in the `q4x32` layout (of `nb` blocks a row).
fn q4_bases(b: usize, nb: usize) -> (usize, usize) {
    if b / 2 * 2 + 1 < nb {
        // A pair: [A even, B even, A odd, B odd].
        let base = b / 2 * 64 + (b % 2) * 16;
        (base, base + 32)
    } else {
        (b * 32, b * 32 + 16)
    }
}

/// `v` rounded to the nearest integer, halves away from zero (without a call to `roundf`,
/// which the baseline x86-64 target has no instruction for).
#[inline(always)]
fn round_i8(v: f32) -> i8 {
    (v + 0.5f32.copysign(v)) as i32 as i8
}

/// Quantizes `t` rows of `n_in` values for a `fast` product: blocks of `block`, in the `q4x32`
/// layout with `q4` (see [`Stored::x_layout`]). Each block's scale and values are the same
/// bytes with every `isa` (the vector form rounds as [`round_i8`] does, a NaN to 0).
pub fn quantize(isa: Isa, x: &[f32], n_in: usize, (block, q4): (usize, bool)) -> Quantized {
    #[inline(always)]
    fn body<const WIDE: bool>(x: &[f32], n_in: usize, block: usize, q4: bool) -> Quantized {
        let t = x.len() / n_in;
        let nb = n_in / block;
        let mut q = vec![0i8; x.len()];
        let (mut s, mut c) = (vec![0f32; t * nb], vec![0f32; t * nb]);
        let mut pairs = vec![0f32; t * (nb / 2) * 8];
        for (r, row) in x.chunks_exact(n_in).enumerate() {
            let qr = &mut q[r * n_in..][..n_in];
            for (b, v) in row.chunks_exact(block).enumerate() {
                let mut qs = [0i8; 32];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `WIDE` only where the CPU has AVX2 and FMA (`quantize` checks).
                let (d, sum) = if WIDE { unsafe { avx2::quantize_block(v, &mut qs) } } else { quantize_block(v, &mut qs) };
                #[cfg(not(target_arch = "x86_64"))]
                let (d, sum) = quantize_block(v, &mut qs);
                if q4 {
                    let (even, odd) = q4_bases(b, nb);
                    for j in 0..16 {
                        qr[even + j] = qs[2 * j];
                        qr[odd + j] = qs[2 * j + 1];
                    }
                } else {
                    qr[b * block..][..block].copy_from_slice(&qs[..block]);
                }
                s[r * nb + b] = d;
                c[r * nb + b] = d * sum as f32;
            }
            for (p, o) in pairs[r * (nb / 2) * 8..][..(nb / 2) * 8].chunks_exact_mut(8).enumerate() {
                o[..4].fill(s[r * nb + 2 * p]);
                o[4..].fill(s[r * nb + 2 * p + 1]);
            }
        }
        Quantized { block, q, s, c, pairs }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn wide(x: &[f32], n_in: usize, block: usize, q4: bool) -> Quantized {
        body::<true>(x, n_in, block, q4)
    }
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: every `Isa` but `Scalar` is only chosen where the CPU has AVX2 and FMA.
        return unsafe { wide(x, n_in, block, q4) };
    }
    let _ = isa;
    body::<false>(x, n_in, block, q4)
}

/// One block of x (16 or 32 values) quantized into `out`: its scale `amax / 127` and the sum
/// of its values.
fn quantize_block(v: &[f32], out: &mut [i8; 32]) -> (f32, i32) {
    let amax = v.iter().fold(0f32, |a, &x| a.max(x.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (o, &x) in out.iter_mut().zip(v) {
        *o = round_i8(x * inv);
    }
    (d, out[..v.len()].iter().map(|&v| v as i32).sum())
}

/// Reorders `t` rows of `n_in` values into the `q4x32` layout (for `exact` products with such
/// a weight, whose kernel decodes a block's even elements, then its odd ones); `None` for the
/// formats that read x in order.
pub fn reorder_q4(x: &[f32], n_in: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (row, o) in x.chunks_exact(n_in).zip(out.chunks_exact_mut(n_in)) {
        for (i, &v) in row.iter().enumerate() {
            o[q4_slot(i, n_in)] = v;
        }
    }
    out
}

/// `out = act(gate) * up`, value by value: the op core's formula (`g / (1 + e^-a)`), with
/// `e^x` in eight lanes on AVX2 ([`avx2::exp`], within 2 ulp of `expf`).
pub fn gated(isa: Isa, act: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: `Isa::Avx2` and `Avx2Vnni` are only chosen where the CPU has AVX2 and FMA.
        done = unsafe { avx2::gated(act, gate, up, out) };
    }
    let _ = isa;
    for ((o, &g), &u) in out[done..].iter_mut().zip(&gate[done..]).zip(&up[done..]) {
        *o = act.apply(g) * u;
    }
}

/// The plain kernels: the reading every vector kernel is tested against.
pub mod scalar {
    use super::{Quantized, Stored, q4_slot};

    /// `fast`: row `o` of the weight against row `r` of `x`.
    pub fn fast(w: &Stored, o: usize, n_in: usize, x: &Quantized, r: usize) -> f32 {
        let nb = n_in / x.block;
        let (xq, s, c) = (&x.q[r * n_in..][..n_in], &x.s[r * nb..][..nb], &x.c[r * nb..][..nb]);
        match w {
            Stored::Q8 { block, q, d } => {
                let (q, d) = (&q[o * n_in..][..n_in], &d[o * nb..][..nb]);
                let mut y = 0f32;
                for b in 0..nb {
                    let dot: i32 = (0..*block).map(|j| q[b * block + j] as i32 * xq[b * block + j] as i32).sum();
                    y += d[b] * s[b] * dot as f32;
                }
                y
            }
            Stored::Q4 { q, .. } => {
                let q = &q[o * n_in / 2..][..n_in / 2];
                let (mut y, mut min) = (0f32, 0f32);
                for b in 0..nb {
                    let dot: i32 = (0..32)
                        .map(|j| {
                            let i = b * 32 + j;
                            ((q[i / 2] >> (4 * (i % 2))) & 0xF) as i32 * xq[q4_slot(i, n_in)] as i32
                        })
                        .sum();
                    let (d, m) = w.q4_scale(o, b, nb);
                    y += d * s[b] * dot as f32;
                    min += m * c[b];
                }
                y - min
            }
            Stored::Q4K { .. } | Stored::Q4G { .. } => {
                // x in order; per block the integer sum scaled, then the min's term taken off,
                // each in one rounding (the vector kernel's fused steps).
                let mut y = 0f32;
                for b in 0..nb {
                    let dot: i32 = (0..32).map(|j| w.q4_value(o, b * 32 + j, n_in) as i32 * xq[b * 32 + j] as i32).sum();
                    let (d, m) = w.q4_scale(o, b, nb);
                    y = (dot as f32).mul_add(d * s[b], y);
                    y = (-m).mul_add(c[b], y);
                }
                y
            }
            Stored::Q8G { .. } => {
                // x in order; per block the integer sum of `u = q + 128` scaled, then the
                // 128's term, `128 d_b c_b`, taken off, each in one rounding (the vector
                // kernel's).
                let mut y = 0f32;
                for b in 0..nb {
                    let dot: i32 = (0..32).map(|j| (w.q8g_at(o, b * 32 + j, n_in).0 as i32 + 128) * xq[b * 32 + j] as i32).sum();
                    let d = w.q8g_at(o, b * 32, n_in).1;
                    y = (dot as f32).mul_add(d * s[b], y);
                    y = (-(d * 128.0)).mul_add(c[b], y);
                }
                y
            }
            Stored::Q5 { .. } => {
                // x in order; per block the integer sum of `u = q + 16` scaled, then the 16's
                // term, `16 d_b c_b`, taken off, each in one rounding (the vector kernel's).
                let mut y = 0f32;
                for b in 0..nb {
                    let dot: i32 = (0..32).map(|j| (w.q5_value(o, b * 32 + j, n_in) as i32 + 16) * xq[b * 32 + j] as i32).sum();
                    let d = w.q5_scale(o, b, nb);
                    y = (dot as f32).mul_add(d * s[b], y);
                    y = (-(d * 16.0)).mul_add(c[b], y);
                }
                y
            }
            Stored::Q6K { .. } => {
                // x in order, blocks of 16; per block of 32 its halves' integer sums of `u = q
                // + 32` scaled, then the 32's term, `32 d_b c_b`, taken off for each, each in
                // one rounding (the vector kernel's fused steps).
                let mut y = 0f32;
                for b in (0..nb).step_by(2) {
                    let dot = |b: usize| (0..16).map(|j| (w.q6_value(o, b * 16 + j, n_in) as i32 + 32) * xq[b * 16 + j] as i32).sum::<i32>() as f32;
                    let (da, db) = (w.q6_scale(o, b, nb), w.q6_scale(o, b + 1, nb));
                    y = dot(b).mul_add(da * s[b], y);
                    y = dot(b + 1).mul_add(db * s[b + 1], y);
                    y = (-(da * 32.0)).mul_add(c[b], y);
                    y = (-(db * 32.0)).mul_add(c[b + 1], y);
                }
                y
            }
            Stored::F32(_) | Stored::Bf16(_) => unreachable!("f32 and bf16 weights take the exact kernel"),
        }
    }

    /// `exact`: f32 products of a decoded row `w` (in the layout of `x`) with `x`, summed in
    /// eight lanes, then the lanes in order, then the tail.
    pub fn exact(w: &[f32], x: &[f32]) -> f32 {
        let mut lanes = [0f32; 8];
        let whole = w.len() / 8 * 8;
        for (wc, xc) in w[..whole].chunks_exact(8).zip(x[..whole].chunks_exact(8)) {
            for l in 0..8 {
                lanes[l] = wc[l].mul_add(xc[l], lanes[l]);
            }
        }
        let mut y = sum8(&lanes);
        for (a, b) in w[whole..].iter().zip(&x[whole..]) {
            y = a.mul_add(*b, y);
        }
        y
    }

    /// `exact` for row `o` of a weight of interleaved rows ([`Stored::Q4K`], [`Stored::Q6K`],
    /// [`Stored::Q5`], [`Stored::Q8G`]) against `x` (in order): each value decoded as the contract reads it (`d
    /// * u - m`, `d * q`), summed in
    /// four lanes, lane `e` the values `4k + e` and `16 + 4k + e` of each block of 32 (`k` in
    /// 0..4), block by block in the order `4k + e` then `16 + 4k + e` for each `k`; then `(l0
    /// + l1) + (l2 + l3)`. The vector kernel's order: a row's lane of its group's vectors.
    pub fn exact_group(w: &Stored, o: usize, n_in: usize, x: &[f32]) -> f32 {
        let nb = n_in / 32;
        let mut acc = [0f32; 4];
        for b in 0..nb {
            for k in 0..4 {
                for half in 0..2 {
                    for (e, a) in acc.iter_mut().enumerate() {
                        let i = 32 * b + 16 * half + 4 * k + e;
                        let v = match w {
                            Stored::Q6K { .. } => w.q6_scale(o, 2 * b + half, 2 * nb) * w.q6_value(o, i, n_in) as f32,
                            Stored::Q5 { .. } => w.q5_scale(o, b, nb) * w.q5_value(o, i, n_in) as f32,
                            Stored::Q8G { .. } => {
                                let (v, d) = w.q8g_at(o, i, n_in);
                                d * v as f32
                            }
                            _ => {
                                let (d, m) = w.q4_scale(o, b, nb);
                                d * w.q4_value(o, i, n_in) as f32 - m
                            }
                        };
                        *a = v.mul_add(x[i], *a);
                    }
                }
            }
        }
        (acc[0] + acc[1]) + (acc[2] + acc[3])
    }

    /// The eight lanes' sum, in the order the vector kernels sum them.
    pub fn sum8(l: &[f32; 8]) -> f32 {
        let q = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
        let p = [q[0] + q[2], q[1] + q[3]];
        p[0] + p[1]
    }

    /// Decodes row `o` for the exact kernel, in the layout of x for its format.
    pub fn decode(w: &Stored, o: usize, n_in: usize, out: &mut [f32]) {
        match w {
            Stored::Q4 { .. } => {
                let mut plain = vec![0f32; n_in];
                w.decode_row(o, n_in, &mut plain);
                for (i, v) in plain.into_iter().enumerate() {
                    out[q4_slot(i, n_in)] = v;
                }
            }
            _ => w.decode_row(o, n_in, out),
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! AVX2 + FMA. Every function here needs both: callers check [`super::Isa::detect`].
    //! Loads are unaligned, from slices whose bounds are checked where they are cut.
    use super::{E8, F4, F5, Groups, K6, Quantized, Stored};
    use std::arch::x86_64::*;

    /// `e^x` in each lane: `2^n e^r`, `n` the nearest integer to `x / ln 2` and `|r| <= ln 2 /
    /// 2`, `e^r` by its degree-6 Taylor polynomial (within 2 ulp of `expf`); `x` clamped to
    /// `[-87.3, 88.7]` (0 and infinity beyond, as `expf`'s underflow and overflow give, within
    /// what an f32 activation needs).
    #[target_feature(enable = "avx2,fma")]
    pub fn exp(x: __m256) -> __m256 {
        let x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.7)), _mm256_set1_ps(-87.3));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(core::f32::consts::LOG2_E)));
        // r = x - n ln 2, ln 2 in two parts so that n ln 2's rounding does not reach r.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        // 2^n: n + 127 in the exponent's bits (n is in -126..=128 after the clamp; 128 only
        // at the top, where x rounds to 88.7 / ln 2 = 127.97: n = 128 would overflow, so the
        // clamp keeps x below it).
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }

    /// [`super::gated`]'s vector part: whole runs of eight; returns how many it did.
    #[target_feature(enable = "avx2,fma")]
    pub fn gated(act: super::Activation, gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
        let n = gate.len().min(up.len()).min(out.len()) / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for k in (0..n).step_by(8) {
            let g = load_f32(&gate[k..]);
            let a = match act {
                super::Activation::GeluTanh => {
                    // In `Activation::apply`'s order: ((0.044715 g) g) g, then g + that.
                    let c = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715), g), g), g);
                    _mm256_mul_ps(_mm256_set1_ps(1.595_769_1), _mm256_add_ps(g, c))
                }
                super::Activation::Silu => g,
            };
            let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), a));
            let y = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), load_f32(&up[k..]));
            let o = &mut out[k..k + 8];
            // SAFETY: `o` holds 8 f32 (cut above); the store is unaligned.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), y) };
        }
        n
    }

    /// The sum of a vector's lanes, in [`super::scalar::sum8`]'s order.
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps::<1>(p, p)))
    }

    #[target_feature(enable = "avx2,fma")]
    fn load_u8(s: &[u8]) -> __m256i {
        let s = &s[..32];
        // SAFETY: `s` holds 32 bytes (cut above); the load is unaligned.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    #[target_feature(enable = "avx2,fma")]
    fn load_f32(s: &[f32]) -> __m256 {
        let s = &s[..8];
        // SAFETY: `s` holds 8 f32 (cut above); the load is unaligned.
        unsafe { _mm256_loadu_ps(s.as_ptr()) }
    }

    /// [`super::quantize_block`] in eight lanes: the same scale, bytes and sum (a NaN, which
    /// `as i32` makes 0, made 0 before the conversion, which would give `i32::MIN`).
    #[target_feature(enable = "avx2,fma")]
    pub fn quantize_block(v: &[f32], out: &mut [i8; 32]) -> (f32, i32) {
        let n = v.len() / 8;
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let mut xs = [_mm256_setzero_ps(); 4];
        let mut m = _mm256_setzero_ps();
        for (c, x) in xs.iter_mut().enumerate().take(n) {
            *x = load_f32(&v[8 * c..]);
            // `max` gives its second operand where either is NaN: a NaN value is passed over,
            // as `f32::max` passes it.
            m = _mm256_max_ps(_mm256_and_ps(*x, abs), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
        let d = amax / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let (sign, half) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(0.5));
        let mut sum = _mm256_setzero_si256();
        let mut ints = [0i32; 32];
        for c in 0..n {
            let y = _mm256_mul_ps(xs[c], inv);
            let y = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(y, y), y);
            let r = _mm256_cvttps_epi32(_mm256_add_ps(y, _mm256_or_ps(_mm256_and_ps(y, sign), half)));
            sum = _mm256_add_epi32(sum, r);
            let at = &mut ints[8 * c..][..8];
            // SAFETY: `at` holds 8 i32 (cut above); the store is unaligned.
            unsafe { _mm256_storeu_si256(at.as_mut_ptr().cast(), r) };
        }
        for (o, &i) in out.iter_mut().zip(&ints[..8 * n]) {
            *o = i as i8;
        }
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256::<1>(sum));
        let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b01_00_11_10>(s4));
        (d, _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<0b10_11_00_01>(s2))))
    }

    /// How a `fast` kernel sums each four products of bytes into 32 bits: AVX2's pairs in 16
    /// bits (`vpmaddubsw`), then `vpmaddwd`.
    pub const PAIRS: u8 = 0;
    /// AVX-VNNI's `vpdpbusd` (VEX).
    pub const AVX_VNNI: u8 = 1;
    /// AVX-512 VNNI's `vpdpbusd` on 256-bit vectors (EVEX, with AVX-512 VL); with it the
    /// kernels may use AVX-512 BW.
    pub const AVX512_VNNI: u8 = 2;

    /// `acc` plus, per 32-bit lane, the sum of the four products of `a`'s unsigned bytes with
    /// `b`'s signed ones, summed the `DOT` way. With [`PAIRS`] each pair's sum must fit i16
    /// (no saturation; the callers' operands keep it inside): then every way gives the same
    /// integers.
    ///
    /// # Safety
    /// The CPU has AVX2, and the features `DOT` names.
    #[inline(always)]
    unsafe fn dot<const DOT: u8>(acc: __m256i, a: __m256i, b: __m256i, ones: __m256i) -> __m256i {
        // SAFETY: the caller's promise.
        unsafe {
            match DOT {
                PAIRS => _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones)),
                AVX_VNNI => _mm256_dpbusd_avx_epi32(acc, a, b),
                _ => _mm256_dpbusd_epi32(acc, a, b),
            }
        }
    }

    /// Group `g`'s block of 32 `b` (of `nb` a row) of a weight of interleaved rows, its
    /// eight rows' scales: for a [`Stored::Q4K`] weight `d` and `m` ([`Stored::q4_scale`]'s
    /// products), for a [`Stored::Q6K`] one its two blocks of 16's ([`Stored::q6_scale`]'s),
    /// for a [`Stored::Q5`] one `d` and `16 d`, for a [`Stored::Q8G`] one `d` and `128 d`, for
    /// a [`Stored::Q4G`] one its `d` and `m`.
    ///
    /// # Safety
    /// The CPU has AVX2; group `g` and block `b` are the weight's, of the form `FORM` says.
    #[inline(always)]
    unsafe fn group_scales<const FORM: u8>(k: &Groups<'_>, g: usize, b: usize, nb: usize) -> (__m256, __m256) {
        // SAFETY: the caller's promise: for `F5`, `E8` and `F4` `(g * nb + b) * 8 + 8 <= d.len()`
        // (and `dmin`'s for `F4`); for `K6`
        // `(g * nb + b) * 16 + 16 <= sc6.len()`; for `K4` `(g * nb + b) * 8 + 8 <= sc.len()`
        // (and `mn`'s); for both `(g * nb / 8 + b / 8) * 8 + 8 <= d.len()` (and `dmin`'s for
        // `K4`).
        unsafe {
            if FORM == F4 {
                let at = (g * nb + b) * super::GROUP;
                return (_mm256_loadu_ps(k.d.as_ptr().add(at)), _mm256_loadu_ps(k.dmin.as_ptr().add(at)));
            }
            if FORM == F5 || FORM == E8 {
                let d = _mm256_loadu_ps(k.d.as_ptr().add((g * nb + b) * super::GROUP));
                return (d, _mm256_mul_ps(d, _mm256_set1_ps(if FORM == F5 { 16.0 } else { 128.0 })));
            }
            let sat = (g * (nb / 8) + b / 8) * super::GROUP;
            let ds = _mm256_loadu_ps(k.d.as_ptr().add(sat));
            if FORM == K6 {
                let at = k.sc6.as_ptr().add((g * nb + b) * 16);
                let ints = |p: *const i8| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())));
                (_mm256_mul_ps(ds, ints(at)), _mm256_mul_ps(ds, ints(at.add(8))))
            } else {
                let at = (g * nb + b) * super::GROUP;
                let ints = |v: &[u8]| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(v.as_ptr().add(at).cast())));
                (_mm256_mul_ps(ds, ints(k.sc)), _mm256_mul_ps(_mm256_loadu_ps(k.dmin.as_ptr().add(sat)), ints(k.mn)))
            }
        }
    }

    /// Group `g`'s block of 32 `b` of a weight of interleaved rows, unpacked: four vectors of
    /// its values `4k + e` (lane `l` row `8g + l`, byte `e` of the lane), four of `16 + 4k +
    /// e`: nibbles, with `K6` each value's top two bits added (`u`, 0..=63), with `F5` its
    /// fifth (`u`, 0..=31); with `E8` whole bytes (`u`, 0..=255).
    ///
    /// # Safety
    /// The CPU has AVX2; group `g` and block `b` are the weight's, of the form `FORM` says.
    #[inline(always)]
    unsafe fn group_values<const FORM: u8>(k: &Groups<'_>, g: usize, b: usize, nb: usize) -> ([__m256i; 4], [__m256i; 4]) {
        // SAFETY: the caller's promise: `(g * nb + b) * 128 + 128 <= q.len()` (`256` for
        // `E8`), and `(g * nb + b) * 64 + 64 <= h.len()` with `K6`, `(g * nb + b) * 32 + 32`
        // with `F5`.
        unsafe {
            if FORM == E8 {
                let p = k.q.as_ptr().add((g * nb + b) * 256);
                let lo = std::array::from_fn(|c| _mm256_loadu_si256(p.add(32 * c).cast()));
                let hi = std::array::from_fn(|c| _mm256_loadu_si256(p.add(128 + 32 * c).cast()));
                return (lo, hi);
            }
            let low = _mm256_set1_epi8(0x0F);
            let p = k.q.as_ptr().add((g * nb + b) * 128);
            let (mut lo, mut hi) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
            for c in 0..4 {
                let v = _mm256_loadu_si256(p.add(32 * c).cast());
                lo[c] = _mm256_and_si256(v, low);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
            }
            if FORM == F5 {
                // Bits `c` and `4 + c` of each byte of `h` to bit 4 of `lo[c]`'s and `hi[c]`'s
                // (bits shifted in from the 16-bit lane's other byte fall outside it).
                let (fifth, t) = (_mm256_set1_epi8(0x10), _mm256_loadu_si256(k.h.as_ptr().add((g * nb + b) * 32).cast()));
                let up = [_mm256_slli_epi16::<4>(t), _mm256_slli_epi16::<3>(t), _mm256_slli_epi16::<2>(t), _mm256_slli_epi16::<1>(t)];
                let down = [t, _mm256_srli_epi16::<1>(t), _mm256_srli_epi16::<2>(t), _mm256_srli_epi16::<3>(t)];
                for c in 0..4 {
                    lo[c] = _mm256_or_si256(lo[c], _mm256_and_si256(up[c], fifth));
                    hi[c] = _mm256_or_si256(hi[c], _mm256_and_si256(down[c], fifth));
                }
            }
            if FORM == K6 {
                // Bits `2c, 2c + 1` of each byte of `h` to bits 4 and 5 (bits shifted in from
                // the 16-bit lane's other byte fall outside them).
                let top = _mm256_set1_epi8(0x30);
                let hp = k.h.as_ptr().add((g * nb + b) * 64);
                for (half, v) in [&mut lo, &mut hi].into_iter().enumerate() {
                    let t = _mm256_loadu_si256(hp.add(32 * half).cast());
                    let bits = [_mm256_slli_epi16::<4>(t), _mm256_slli_epi16::<2>(t), t, _mm256_srli_epi16::<2>(t)];
                    for c in 0..4 {
                        v[c] = _mm256_or_si256(v[c], _mm256_and_si256(bits[c], top));
                    }
                }
            }
            (lo, hi)
        }
    }

    /// [`dot`] of unsigned bytes `a` of any value (a [`Stored::Q8G`] weight's) with signed
    /// bytes `b`: AVX2's pairs of products in 16 bits could saturate, so with [`PAIRS`] each
    /// byte's nibbles are summed apart, `lo + 16 hi` (the same integers).
    ///
    /// # Safety
    /// As [`dot`]'s.
    #[inline(always)]
    unsafe fn dot_bytes<const DOT: u8>(acc: __m256i, a: __m256i, b: __m256i, ones: __m256i) -> __m256i {
        // SAFETY: the caller's promise.
        unsafe {
            if DOT == PAIRS {
                let low = _mm256_set1_epi8(0x0F);
                let lo = dot::<DOT>(_mm256_setzero_si256(), _mm256_and_si256(a, low), b, ones);
                let hi = dot::<DOT>(_mm256_setzero_si256(), _mm256_and_si256(_mm256_srli_epi16::<4>(a), low), b, ones);
                _mm256_add_epi32(acc, _mm256_add_epi32(lo, _mm256_slli_epi32::<4>(hi)))
            } else {
                dot::<DOT>(acc, a, b, ones)
            }
        }
    }

    /// A block's two scales `[a x4, b x4]`.
    #[target_feature(enable = "avx2,fma")]
    fn pair(a: f32, b: f32) -> __m256 {
        _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a))
    }

    /// `fast` for `R` rows of x (from `r0`) against the `W` rows of a q8 weight from `o`
    /// (`B16`: a scale per 16 elements, else per 32): `out[j * R + i]` for weight row `o + j`
    /// and x row `r0 + i`. Bytes past the last whole 32 (a q8x16 row of an odd number of
    /// blocks) go to the scalar kernel's arithmetic.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA, and the features `DOT` names ([`dot`]): only inlined into
    /// the `#[target_feature]` entries [`fast_rows`], [`fast_rows_vnni`] and
    /// [`fast_rows_avx512`], which say so.
    #[inline(always)]
    unsafe fn q8<const W: usize, const R: usize, const B16: bool, const DOT: u8>(
        q: &[i8],
        d: &[f32],
        o: usize,
        n_in: usize,
        x: &Quantized,
        r0: usize,
        out: &mut [f32],
    ) {
        let block = if B16 { 16 } else { 32 };
        let nb = n_in / block;
        let chunks = n_in / 32;
        let (mut wq, mut wd): ([&[i8]; W], [&[f32]; W]) = ([&[]; W], [&[]; W]);
        for j in 0..W {
            wq[j] = &q[(o + j) * n_in..][..n_in];
            wd[j] = &d[(o + j) * nb..][..nb];
        }
        let (mut xq, mut xs, mut xp): ([&[i8]; R], [&[f32]; R], [&[f32]; R]) = ([&[]; R], [&[]; R], [&[]; R]);
        for i in 0..R {
            xq[i] = &x.q[(r0 + i) * n_in..][..n_in];
            xs[i] = &x.s[(r0 + i) * nb..][..nb];
            if B16 {
                xp[i] = &x.pairs[(r0 + i) * (nb / 2) * 8..][..chunks * 8];
            }
        }
        // SAFETY: the CPU has AVX2 (the caller's promise).
        let mut acc = unsafe { [[_mm256_setzero_ps(); R]; W] };
        // SAFETY: as above.
        let ones = unsafe { _mm256_set1_epi16(1) };
        // SAFETY: chunk `k < n_in / 32` reads bytes `32k..32k + 32` of each `wq[j]` and `xq[i]`
        // (rows of `n_in`), scales `k` (< nb) or `2k, 2k + 1` (< nb with 16-element blocks) of
        // each `wd[j]`, `k` of each `xs[i]`, and `8k..8k + 8` of each `xp[i]` (cut to `8 *
        // chunks`).
        unsafe {
            for k in 0..chunks {
                let mut xv = [_mm256_setzero_si256(); R];
                let mut s = [_mm256_setzero_ps(); R];
                for i in 0..R {
                    xv[i] = _mm256_loadu_si256(xq[i].as_ptr().add(32 * k).cast());
                    s[i] = if B16 { _mm256_loadu_ps(xp[i].as_ptr().add(8 * k)) } else { _mm256_set1_ps(*xs[i].get_unchecked(k)) };
                }
                for j in 0..W {
                    if W > 1 && k % 2 == 0 {
                        // The same line of the rows `W` on (the next call's): a decode step
                        // streams its weights from memory faster with them asked for ahead.
                        _mm_prefetch::<_MM_HINT_T0>(wq[j].as_ptr().wrapping_add(32 * k + 2 * W * n_in).cast());
                    } else if W == 1 && k % 2 == 0 {
                        // One row at a time (a decode step): the line `AHEAD` on in the
                        // weight's bytes, this row's or the next's.
                        _mm_prefetch::<_MM_HINT_T0>(wq[j].as_ptr().wrapping_add(32 * k + super::AHEAD).cast());
                    }
                    let w = _mm256_loadu_si256(wq[j].as_ptr().add(32 * k).cast());
                    let wa = _mm256_sign_epi8(w, w);
                    let ws = if B16 { pair(*wd[j].get_unchecked(2 * k), *wd[j].get_unchecked(2 * k + 1)) } else { _mm256_set1_ps(*wd[j].get_unchecked(k)) };
                    for i in 0..R {
                        // |w| * (x with w's sign), each four summed: with AVX2 in pairs first,
                        // at most 128 * 127 * 2 a pair, inside i16 (no saturation: the same
                        // sums as VNNI's 32-bit ones).
                        let xs = _mm256_sign_epi8(xv[i], w);
                        let sums = dot::<DOT>(_mm256_setzero_si256(), wa, xs, ones);
                        let dot = _mm256_cvtepi32_ps(sums);
                        acc[j][i] = _mm256_fmadd_ps(_mm256_mul_ps(ws, s[i]), dot, acc[j][i]);
                    }
                }
            }
        }
        for j in 0..W {
            for i in 0..R {
                // SAFETY: the CPU has AVX2 and FMA (the caller's promise).
                let mut y = unsafe { hsum(acc[j][i]) };
                for b in chunks * 32 / block..nb {
                    let dot: i32 = wq[j][b * block..][..block].iter().zip(&xq[i][b * block..][..block]).map(|(&a, &b)| a as i32 * b as i32).sum();
                    y += wd[j][b] * xs[i][b] * dot as f32;
                }
                out[j * R + i] = y;
            }
        }
    }

    /// Rows `r0..r0 + R` of quantized x (rows of `n_in`): their values, and their scales as
    /// the kernels of two blocks a step read them ([`Quantized::pairs`]).
    #[inline(always)]
    fn x_rows<const R: usize>(x: &Quantized, r0: usize, n_in: usize) -> ([&[i8]; R], [&[f32]; R]) {
        let per = x.pairs.len() / (x.q.len() / n_in).max(1);
        (std::array::from_fn(|i| &x.q[(r0 + i) * n_in..][..n_in]), std::array::from_fn(|i| &x.pairs[(r0 + i) * per..][..per]))
    }

    /// Rows `xq` of x's values 64 at a time: step `p`'s `[even, odd]` halves (x's `q4x32`
    /// layout) and its scales `xs[i][at..at + 8]`.
    ///
    /// # Safety
    /// The CPU has AVX2; each `xq[i]` holds bytes `64p..64p + 64` and `xs[i]` values `at..at +
    /// 8`.
    #[inline(always)]
    unsafe fn x_step<const R: usize>(xq: &[&[i8]; R], xs: &[&[f32]; R], p: usize, at: usize) -> ([__m256i; R], [__m256i; R], [__m256; R]) {
        // SAFETY: the caller's promise.
        unsafe {
            let (mut xa, mut xb, mut s) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R], [_mm256_setzero_ps(); R]);
            for i in 0..R {
                xa[i] = _mm256_loadu_si256(xq[i].as_ptr().add(64 * p).cast());
                xb[i] = _mm256_loadu_si256(xq[i].as_ptr().add(64 * p + 32).cast());
                s[i] = _mm256_loadu_ps(xs[i].as_ptr().add(at));
            }
            (xa, xb, s)
        }
    }

    /// Asks the memory for a weight stream's bytes ahead of byte `at` of a row (its reading
    /// now, rows of `row_bytes`): with `W` rows a call the line two calls on, as `q8` does;
    /// with one (a decode step's single stream) `far` bytes on, where `now`.
    ///
    /// # Safety
    /// The CPU has SSE (a prefetch reads nothing and faults on no address).
    #[inline(always)]
    unsafe fn ahead<const W: usize>(row: &[u8], at: usize, row_bytes: usize, now: bool, far: usize) {
        // SAFETY: the caller's promise; `wrapping_add` makes no reference past the row.
        unsafe {
            if W > 1 {
                _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().wrapping_add(at + 2 * W * row_bytes).cast());
            } else if now {
                _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().wrapping_add(at + far).cast());
            }
        }
    }

    /// The low and high nibbles of a weight row's bytes `32p..32p + 32`: `[A even, B even]`
    /// and `[A odd, B odd]` of its pair of blocks, in x's `q4x32` layout.
    ///
    /// # Safety
    /// The CPU has AVX2; `q` holds bytes `32p..32p + 32`.
    #[inline(always)]
    unsafe fn nibble_halves(q: &[u8], p: usize) -> (__m256i, __m256i) {
        // SAFETY: the caller's promise.
        unsafe {
            let low = _mm256_set1_epi8(0x0F);
            let w = _mm256_loadu_si256(q.as_ptr().add(32 * p).cast());
            (_mm256_and_si256(w, low), _mm256_and_si256(_mm256_srli_epi16::<4>(w), low))
        }
    }

    /// The products of a step's unsigned weight values `lo`, `hi` (each below 64) with x's
    /// halves `xa`, `xb`, each four summed into a 32-bit lane, the `DOT` way. With AVX2's pairs
    /// at most 63 * 127 * 2 a pair of bytes, twice: inside i16 (no saturation: the same sums
    /// as VNNI's 32-bit ones).
    ///
    /// # Safety
    /// As [`dot`]'s.
    #[inline(always)]
    unsafe fn step_sums<const DOT: u8>(lo: __m256i, hi: __m256i, xa: __m256i, xb: __m256i, ones: __m256i) -> __m256i {
        // SAFETY: the caller's promise.
        unsafe {
            if DOT == PAIRS {
                _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)), ones)
            } else {
                dot::<DOT>(dot::<DOT>(_mm256_setzero_si256(), lo, xa, ones), hi, xb, ones)
            }
        }
    }

    /// `fast` for `R` rows of x against the `W` rows of a [`Stored::Q4`] weight from `o` (x in
    /// the q4x32 layout): `out[j * R + i]`, `w = d u - m`, the mins' term, `sum_b m_b s_b (sum
    /// of the block's x values)`, taken off through x's block sums.
    ///
    /// # Safety
    /// As [`q8`]'s.
    #[inline(always)]
    unsafe fn nibbles<const W: usize, const R: usize, const DOT: u8>(
        (q, d, m): (&[u8], &[f32], &[f32]),
        o: usize,
        n_in: usize,
        x: &Quantized,
        r0: usize,
        out: &mut [f32],
    ) {
        let nb = n_in / 32;
        let pairs = nb / 2;
        let (mut wq, mut wd, mut wm): ([&[u8]; W], [&[f32]; W], [&[f32]; W]) = ([&[]; W], [&[]; W], [&[]; W]);
        for j in 0..W {
            wq[j] = &q[(o + j) * n_in / 2..][..n_in / 2];
            wd[j] = &d[(o + j) * nb..][..nb];
            wm[j] = &m[(o + j) * nb..][..nb];
        }
        let (xq, xp) = x_rows::<R>(x, r0, n_in);
        // SAFETY: the CPU has AVX2 (the caller's promise).
        let (mut acc, ones) = unsafe { ([[_mm256_setzero_ps(); R]; W], _mm256_set1_epi16(1)) };
        // SAFETY: pair `p < nb / 2` reads bytes `32p..32p + 32` of each `wq[j]` (n_in / 2
        // bytes), bytes `64p..64p + 64` of each `xq[i]`
        // (n_in), scales `2p, 2p + 1` (< nb) of each `wd[j]` and `8p..8p + 8` of each `xp[i]`
        // (cut to `8 * pairs`).
        unsafe {
            for p in 0..pairs {
                let (xa, xb, s) = x_step(&xq, &xp, p, 8 * p);
                for j in 0..W {
                    ahead::<W>(wq[j], 32 * p, n_in / 2, p.is_multiple_of(2), super::AHEAD);
                    let (lo, hi) = nibble_halves(wq[j], p);
                    let ws = pair(*wd[j].get_unchecked(2 * p), *wd[j].get_unchecked(2 * p + 1));
                    for i in 0..R {
                        let dot = _mm256_cvtepi32_ps(step_sums::<DOT>(lo, hi, xa[i], xb[i], ones));
                        acc[j][i] = _mm256_fmadd_ps(_mm256_mul_ps(ws, s[i]), dot, acc[j][i]);
                    }
                }
            }
        }
        for j in 0..W {
            for i in 0..R {
                let r = r0 + i;
                // SAFETY: the CPU has AVX2 and FMA (the caller's promise).
                let mut y = unsafe { hsum(acc[j][i]) };
                let (d, m) = (wd[j], wm[j]);
                if nb % 2 == 1 {
                    // The lone last block: its even values, then its odd ones.
                    let b = nb - 1;
                    let xq = &xq[i][b * 32..][..32];
                    let dot: i32 = wq[j][b * 16..][..16].iter().enumerate().map(|(k, &v)| (v & 0xF) as i32 * xq[k] as i32 + (v >> 4) as i32 * xq[16 + k] as i32).sum();
                    y += d[b] * x.s[r * nb + b] * dot as f32;
                }
                let c = &x.c[r * nb..][..nb];
                // SAFETY: the CPU has AVX2 and FMA (the caller's promise); the loads are cut.
                let mut min = unsafe {
                    let mut mins = _mm256_setzero_ps();
                    for k in 0..nb / 8 {
                        mins = _mm256_fmadd_ps(load_f32(&m[k * 8..]), load_f32(&c[k * 8..]), mins);
                    }
                    hsum(mins)
                };
                for b in nb / 8 * 8..nb {
                    min += m[b] * c[b];
                }
                out[j * R + i] = y - min;
            }
        }
    }

    /// Asks the memory for group `g`'s block `b` (of `nb` a row) of a weight of interleaved
    /// rows some way ahead ([`super::AHEAD`] of its values' bytes, in proportion of its other
    /// bits'), for a decode step, which streams each weight once.
    ///
    /// # Safety
    /// The CPU has SSE (a prefetch reads nothing and faults on no address; `wrapping_add` makes
    /// no reference past the weight).
    #[inline(always)]
    unsafe fn group_ahead<const FORM: u8>(k: &Groups<'_>, g: usize, b: usize, nb: usize) {
        // SAFETY: the caller's promise.
        unsafe {
            let bytes = if FORM == E8 { 256 } else { 128 };
            let p = k.q.as_ptr().wrapping_add((g * nb + b) * bytes + super::AHEAD);
            for line in (0..bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line).cast());
            }
            if FORM == K6 {
                _mm_prefetch::<_MM_HINT_T0>(k.h.as_ptr().wrapping_add((g * nb + b) * 64 + super::AHEAD / 2).cast());
            } else if FORM == F5 && b.is_multiple_of(2) {
                _mm_prefetch::<_MM_HINT_T0>(k.h.as_ptr().wrapping_add((g * nb + b) * 32 + super::AHEAD / 4).cast());
            }
        }
    }

    /// A group kernel's results `y` (`y[8i + l]` for x row `xr.start + i` and weight row `8g +
    /// l`) into `out[r * width + o - rows.start]`, the rows of `rows` only (a last group's
    /// padding dropped).
    #[inline(always)]
    fn group_out(y: &[f32], g: usize, xr: core::ops::Range<usize>, rows: &core::ops::Range<usize>, out: &mut [f32], width: usize) {
        for l in 0..super::GROUP {
            let o = g * super::GROUP + l;
            if o < rows.end {
                for (i, r) in xr.clone().enumerate() {
                    out[r * width + o - rows.start] = y[8 * i + l];
                }
            }
        }
    }

    /// `fast` for `R` rows of x (in order) against group `g` of a weight of interleaved rows
    /// (of the form `FORM`): `out[8i + l]` for x row `r0 + i` and
    /// weight row `8g + l`. Per block of 32, the four values of each row in a 32-bit lane
    /// against x's four broadcast, eight instructions for the block's 32 products with all
    /// eight rows; then the sums scaled and the offsets' terms taken off, each in one rounding
    /// ([`super::scalar::fast`]'s order): Q4_K's block `d_b s_b` and its min's `m_b c_b`;
    /// Q6_K's two blocks of 16 each `d_b s_b` (x quantized per 16), then each `32 d_b c_b`;
    /// the five-bit form's `d_b s_b`, then `16 d_b c_b`; the bytes' `d_b s_b`, then `128 d_b
    /// c_b`.
    ///
    /// # Safety
    /// As [`q8`]'s; `g` is a group of the weight, of the form `FORM` says; `r0 + R` rows of x
    /// at most.
    #[inline(always)]
    unsafe fn fast_group<const R: usize, const FORM: u8, const DOT: u8>(k: Groups<'_>, g: usize, n_in: usize, x: &Quantized, r0: usize, out: &mut [f32]) {
        let nb = n_in / 32;
        let nbx = if FORM == K6 { 2 * nb } else { nb };
        let xq: [&[i8]; R] = std::array::from_fn(|i| &x.q[(r0 + i) * n_in..][..n_in]);
        let xs: [&[f32]; R] = std::array::from_fn(|i| &x.s[(r0 + i) * nbx..][..nbx]);
        let xc: [&[f32]; R] = std::array::from_fn(|i| &x.c[(r0 + i) * nbx..][..nbx]);
        // SAFETY: block `b < nb` reads bytes `32b..32b + 32` of each `xq[i]` (n_in), values
        // `b` (or `2b, 2b + 1` with `K6`) of each `xs[i]` and `xc[i]` (cut to their blocks),
        // and group `g`'s block `b` of the weight (the caller's promise); `out` holds `8R`
        // values (each store cut); a prefetch reads nothing (`wrapping_add`).
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                if R == 1 {
                    group_ahead::<FORM>(&k, g, b, nb);
                }
                let (lo, hi) = group_values::<FORM>(&k, g, b, nb);
                let (wa, wb) = group_scales::<FORM>(&k, g, b, nb);
                let thirty_two = _mm256_set1_ps(32.0);
                let (wa32, wb32) = (_mm256_mul_ps(wa, thirty_two), _mm256_mul_ps(wb, thirty_two));
                for i in 0..R {
                    let xp = xq[i].as_ptr().add(32 * b).cast::<i32>();
                    let (mut a0, mut a1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    for c in 0..4 {
                        let (xa, xb) = (_mm256_set1_epi32(xp.add(c).read_unaligned()), _mm256_set1_epi32(xp.add(4 + c).read_unaligned()));
                        if FORM == E8 {
                            a0 = dot_bytes::<DOT>(a0, lo[c], xa, ones);
                            a1 = dot_bytes::<DOT>(a1, hi[c], xb, ones);
                        } else {
                            a0 = dot::<DOT>(a0, lo[c], xa, ones);
                            a1 = dot::<DOT>(a1, hi[c], xb, ones);
                        }
                    }
                    let v = |s: &[f32], j: usize| _mm256_set1_ps(*s.get_unchecked(j));
                    if FORM == K6 {
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), _mm256_mul_ps(wa, v(xs[i], 2 * b)), acc[i]);
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), _mm256_mul_ps(wb, v(xs[i], 2 * b + 1)), acc[i]);
                        acc[i] = _mm256_fnmadd_ps(wa32, v(xc[i], 2 * b), acc[i]);
                        acc[i] = _mm256_fnmadd_ps(wb32, v(xc[i], 2 * b + 1), acc[i]);
                    } else {
                        // Q4_K's min, or the five-bit form's 16 d, or the bytes' 128 d, in `wb`.
                        let f = _mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1));
                        acc[i] = _mm256_fmadd_ps(f, _mm256_mul_ps(wa, v(xs[i], b)), acc[i]);
                        acc[i] = _mm256_fnmadd_ps(wb, v(xc[i], b), acc[i]);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out[8 * i..][..8].as_mut_ptr(), *a);
            }
        }
    }

    /// `fast` for weight rows `rows` (from a multiple of [`super::GROUP`]) of a weight of
    /// interleaved rows against every row of x: `out[r * width + o - rows.start]`. Two groups
    /// at a time (held in the cache) against x's rows, up to eight at a time.
    ///
    /// # Safety
    /// As [`q8`]'s; the weight of the form `FORM` says.
    #[inline(always)]
    unsafe fn fast_groups<const FORM: u8, const DOT: u8>(k: Groups<'_>, rows: core::ops::Range<usize>, n_in: usize, x: &Quantized, t: usize, out: &mut [f32], width: usize) {
        let mut y = [0f32; 64];
        let groups = rows.start / super::GROUP..rows.end.div_ceil(super::GROUP);
        let mut g0 = groups.start;
        while g0 < groups.end {
            let g1 = (g0 + 2).min(groups.end);
            let mut r = 0;
            while r < t {
                // Eight rows of x at once where AVX-512's registers hold them (Q4_K at 128
                // rows 124 GMAC/s a core of a Zen 4 against four's 115).
                let n = match t - r {
                    n if n >= 8 && DOT == AVX512_VNNI => 8,
                    n if n >= 4 => 4,
                    n if n >= 2 => 2,
                    _ => 1,
                };
                for g in g0..g1 {
                    // SAFETY: the caller's promise; `g` is one of the weight's groups and `r + n
                    // <= t`.
                    unsafe {
                        match n {
                            8 => fast_group::<8, FORM, DOT>(k, g, n_in, x, r, &mut y),
                            4 => fast_group::<4, FORM, DOT>(k, g, n_in, x, r, &mut y),
                            2 => fast_group::<2, FORM, DOT>(k, g, n_in, x, r, &mut y),
                            _ => fast_group::<1, FORM, DOT>(k, g, n_in, x, r, &mut y),
                        }
                    }
                    group_out(&y, g, r..r + n, &rows, out, width);
                }
                r += n;
            }
            g0 = g1;
        }
    }

    /// `exact` for `R` rows of x (in order) against group `g` of a weight of interleaved rows
    /// (of the form `FORM`): `out[8i + l]`,
    /// [`super::scalar::exact_group`]'s sums (each lane a row): the block's values of one
    /// position `e` of the lanes' four picked out together (`vpshufb`), decoded, and
    /// multiplied with x's value broadcast.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `g` is a group of the weight, of the form `FORM` says; each
    /// `x[i]` holds `n_in` values.
    #[inline(always)]
    unsafe fn exact_group<const R: usize, const FORM: u8>(k: Groups<'_>, g: usize, n_in: usize, x: [&[f32]; R], out: &mut [f32]) {
        let nb = n_in / 32;
        let x: [&[f32]; R] = std::array::from_fn(|i| &x[i][..n_in]);
        // SAFETY: block `b < nb` reads values `32b..32b + 32` of each `x[i]` (cut to n_in),
        // and group `g`'s block `b` of the weight (the caller's promise); `out` holds `8R`
        // values (each store cut); a prefetch reads nothing (`wrapping_add`).
        unsafe {
            // Byte `e` of each 32-bit lane, zero-extended (`vpshufb` picks within each half).
            let pick: [__m256i; 4] = std::array::from_fn(|e| {
                let e = e as i8;
                let (a, b, c, d) = (e, 4 + e, 8 + e, 12 + e);
                _mm256_setr_epi8(a, -1, -1, -1, b, -1, -1, -1, c, -1, -1, -1, d, -1, -1, -1, a, -1, -1, -1, b, -1, -1, -1, c, -1, -1, -1, d, -1, -1, -1)
            });
            let (thirty_two, sixteen) = (_mm256_set1_ps(32.0), _mm256_set1_ps(16.0));
            let mut acc = [[_mm256_setzero_ps(); 4]; R];
            for b in 0..nb {
                if R == 1 {
                    group_ahead::<FORM>(&k, g, b, nb);
                }
                let (lo, hi) = group_values::<FORM>(&k, g, b, nb);
                let (wa, wb) = group_scales::<FORM>(&k, g, b, nb);
                for c in 0..4 {
                    for (half, u) in [lo[c], hi[c]].into_iter().enumerate() {
                        for e in 0..4 {
                            let f = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(u, pick[e]));
                            // As the contract reads them: `d * q` (q = u - 32, u - 16), `d * u - m`.
                            let w = match FORM {
                                K6 => _mm256_mul_ps(if half == 0 { wa } else { wb }, _mm256_sub_ps(f, thirty_two)),
                                F5 => _mm256_mul_ps(wa, _mm256_sub_ps(f, sixteen)),
                                E8 => _mm256_mul_ps(wa, _mm256_sub_ps(f, _mm256_set1_ps(128.0))),
                                _ => _mm256_sub_ps(_mm256_mul_ps(wa, f), wb),
                            };
                            let at = 32 * b + 16 * half + 4 * c + e;
                            for i in 0..R {
                                acc[i][e] = _mm256_fmadd_ps(w, _mm256_set1_ps(*x[i].get_unchecked(at)), acc[i][e]);
                            }
                        }
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let y = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
                _mm256_storeu_ps(out[8 * i..][..8].as_mut_ptr(), y);
            }
        }
    }

    /// `exact` for weight rows `rows` (from a multiple of [`super::GROUP`]) of a weight of
    /// interleaved rows against the `t` rows of x (in order): `out[r * width + o -
    /// rows.start]`. x in tiles of [`super::X_TILE`] rows (held in the cache), each against
    /// every group, up to `MAX_R` rows at a time.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA (and AVX-512 F and VL where `MAX_R` is 4); the weight of the
    /// form `FORM` says.
    #[inline(always)]
    unsafe fn exact_groups_with<const MAX_R: usize, const FORM: u8>(k: Groups<'_>, rows: core::ops::Range<usize>, n_in: usize, x: &[f32], t: usize, out: &mut [f32], width: usize) {
        let mut y = [0f32; 32];
        let groups = rows.start / super::GROUP..rows.end.div_ceil(super::GROUP);
        let xr = |i: usize| &x[i * n_in..][..n_in];
        for t0 in (0..t).step_by(super::X_TILE) {
            let t1 = (t0 + super::X_TILE).min(t);
            for g in groups.clone() {
                let mut r = t0;
                while r < t1 {
                    let n = match t1 - r {
                        n if n >= 4 && MAX_R >= 4 => 4,
                        n if n >= 2 => 2,
                        _ => 1,
                    };
                    // SAFETY: the caller's promise; `g` is one of the weight's groups.
                    unsafe {
                        match n {
                            4 => exact_group::<4, FORM>(k, g, n_in, [xr(r), xr(r + 1), xr(r + 2), xr(r + 3)], &mut y),
                            2 => exact_group::<2, FORM>(k, g, n_in, [xr(r), xr(r + 1)], &mut y),
                            _ => exact_group::<1, FORM>(k, g, n_in, [xr(r)], &mut y),
                        }
                    }
                    group_out(&y, g, r..r + n, &rows, out, width);
                    r += n;
                }
            }
        }
    }

    /// [`exact_groups_with`] for AVX2 + FMA: two rows of x at a time.
    #[target_feature(enable = "avx2,fma")]
    pub fn exact_groups(k: Groups<'_>, rows: core::ops::Range<usize>, n_in: usize, x: &[f32], t: usize, out: &mut [f32], width: usize) {
        // SAFETY: this function's features are the body's; `form` says the form.
        unsafe {
            match k.form() {
                K6 => exact_groups_with::<2, K6>(k, rows, n_in, x, t, out, width),
                F5 => exact_groups_with::<2, F5>(k, rows, n_in, x, t, out, width),
                E8 => exact_groups_with::<2, E8>(k, rows, n_in, x, t, out, width),
                F4 => exact_groups_with::<2, F4>(k, rows, n_in, x, t, out, width),
                _ => exact_groups_with::<2, { super::K4 }>(k, rows, n_in, x, t, out, width),
            }
        }
    }

    /// [`exact_groups_with`] with AVX-512 VL's 32 registers: four rows of x at a time (the
    /// same sums, the same bits).
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    pub fn exact_groups_avx512(k: Groups<'_>, rows: core::ops::Range<usize>, n_in: usize, x: &[f32], t: usize, out: &mut [f32], width: usize) {
        // SAFETY: this function's features include the body's; `form` says the form.
        unsafe {
            match k.form() {
                K6 => exact_groups_with::<4, K6>(k, rows, n_in, x, t, out, width),
                F5 => exact_groups_with::<4, F5>(k, rows, n_in, x, t, out, width),
                E8 => exact_groups_with::<4, E8>(k, rows, n_in, x, t, out, width),
                F4 => exact_groups_with::<4, F4>(k, rows, n_in, x, t, out, width),
                _ => exact_groups_with::<4, { super::K4 }>(k, rows, n_in, x, t, out, width),
            }
        }
    }

    /// One call of a kernel: `W` weight rows from `o` against `R` rows of x from `r`.
    ///
    /// # Safety
    /// As [`q8`]'s.
    #[inline(always)]
    unsafe fn fast_tile<const W: usize, const R: usize, const DOT: u8>(w: &Stored, o: usize, n_in: usize, x: &Quantized, r: usize, y: &mut [f32]) {
        // SAFETY: the caller's promise, passed on.
        unsafe {
            match w {
                Stored::Q8 { block: 16, q, d } => q8::<W, R, true, DOT>(q, d, o, n_in, x, r, y),
                Stored::Q8 { q, d, .. } => q8::<W, R, false, DOT>(q, d, o, n_in, x, r, y),
                Stored::Q4 { q, d, m } => nibbles::<W, R, DOT>((q, d, m), o, n_in, x, r, y),
                Stored::Q4K { .. } | Stored::Q6K { .. } | Stored::Q5 { .. } | Stored::Q8G { .. } | Stored::Q4G { .. } => unreachable!("a weight of interleaved rows takes `fast_groups`"),
                Stored::F32(_) | Stored::Bf16(_) => unreachable!("f32 and bf16 weights take the exact kernel"),
            }
        }
    }

    /// `fast` for weight rows `rows` against every row of x ([`fast_rows_with`]).
    #[target_feature(enable = "avx2,fma")]
    pub fn fast_rows(w: &Stored, rows: core::ops::Range<usize>, n_in: usize, x: &Quantized, t: usize, out: &mut [f32], width: usize) {
        // SAFETY: this function's features are the kernels'.
        unsafe { fast_rows_with::<PAIRS>(w, rows, n_in, x, t, out, width) }
    }

    /// [`fast_rows`] with AVX-VNNI's products: the same integer sums, the same bits.
    #[target_feature(enable = "avx2,fma,avxvnni")]
    pub fn fast_rows_vnni(w: &Stored, rows: core::ops::Range<usize>, n_in: usize, x: &Quantized, t: usize, out: &mut [f32], width: usize) {
        // SAFETY: this function's features are the kernels' with `AVX_VNNI`.
        unsafe { fast_rows_with::<AVX_VNNI>(w, rows, n_in, x, t, out, width) }
    }

    /// [`fast_rows`] with AVX-512 VNNI's products on 256-bit vectors (the EVEX form, for CPUs
    /// with AVX-512 and no AVX-VNNI, such as AMD's Zen 4), and a five-bit weight's fifth bits
    /// as AVX-512 BW masks: the same integer sums, the same bits.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub fn fast_rows_avx512(w: &Stored, rows: core::ops::Range<usize>, n_in: usize, x: &Quantized, t: usize, out: &mut [f32], width: usize) {
        // SAFETY: this function's features are the kernels' with `AVX512_VNNI`.
        unsafe { fast_rows_with::<AVX512_VNNI>(w, rows, n_in, x, t, out, width) }
    }

    /// `fast` for weight rows `rows` against every row of x: `out[r * width + o - rows.start]`.
    /// A few rows of x (a decode step): one weight row at a time against each. More: four
    /// rows of x at a time against each weight row of a block of [`super::FAST_BLOCK`], both
    /// held in the L1 cache while the block sweeps them.
    ///
    /// # Safety
    /// As [`q8`]'s.
    #[inline(always)]
    unsafe fn fast_rows_with<const DOT: u8>(w: &Stored, rows: core::ops::Range<usize>, n_in: usize, x: &Quantized, t: usize, out: &mut [f32], width: usize) {
        // SAFETY: the caller's promise, passed on to the kernels.
        unsafe {
            if let Some(k) = Groups::of(w) {
                return match k.form() {
                    K6 => fast_groups::<K6, DOT>(k, rows, n_in, x, t, out, width),
                    F5 => fast_groups::<F5, DOT>(k, rows, n_in, x, t, out, width),
                    E8 => fast_groups::<E8, DOT>(k, rows, n_in, x, t, out, width),
                    F4 => fast_groups::<F4, DOT>(k, rows, n_in, x, t, out, width),
                    _ => fast_groups::<{ super::K4 }, DOT>(k, rows, n_in, x, t, out, width),
                };
            }
            let mut y = [0f32; 16];
            let first = rows.start;
            if t < 4 {
                // One weight row at a time against every row of x: a single stream through
                // memory, the weight read once whatever `t`. Four rows a call (four streams,
                // each read 32 bytes at a time) decoded Gemma 3 270M at 36 tok/s on one core of
                // a Zen 4 against 55 this way.
                for o in rows.clone() {
                    match t {
                        1 => fast_tile::<1, 1, DOT>(w, o, n_in, x, 0, &mut y),
                        2 => fast_tile::<1, 2, DOT>(w, o, n_in, x, 0, &mut y),
                        _ => fast_tile::<1, 3, DOT>(w, o, n_in, x, 0, &mut y),
                    }
                    for r in 0..t {
                        out[r * width + o - first] = y[r];
                    }
                }
                return;
            }
            let mut block = rows.start;
            while block < rows.end {
                let end = (block + super::FAST_BLOCK).min(rows.end);
                let mut r = 0;
                while r < t {
                    let n = if t - r >= 4 { 4 } else { 1 };
                    let mut o = block;
                    while o < end {
                        // Two q8x32 weight rows a call where there are two (each row of x read once
                        // for both: 24 -> 28 GMAC/s a core here); a weight of nibbles one (its
                        // unpacking, or q8x16's pairs of scales, take the registers a second row
                        // would: 34 -> 28 with two), except with AVX-512's 32 registers (five
                        // bits 40 -> 43, q4x32 44 -> 46 on a Zen 4).
                        let two = match w {
                            Stored::Q8 { block: 32, .. } => true,
                            Stored::Q4 { .. } => DOT == AVX512_VNNI,
                            _ => false,
                        };
                        let nw = if end - o >= 2 && two { 2 } else { 1 };
                        match (nw, n) {
                            (2, 4) => fast_tile::<2, 4, DOT>(w, o, n_in, x, r, &mut y),
                            (2, _) => fast_tile::<2, 1, DOT>(w, o, n_in, x, r, &mut y),
                            (_, 4) => fast_tile::<1, 4, DOT>(w, o, n_in, x, r, &mut y),
                            _ => fast_tile::<1, 1, DOT>(w, o, n_in, x, r, &mut y),
                        }
                        for j in 0..nw {
                            for i in 0..n {
                                out[(r + i) * width + o + j - first] = y[j * n + i];
                            }
                        }
                        o += nw;
                    }
                    r += n;
                }
                block = end;
            }
        }
    }

    /// `exact` for `W` weight rows from `o` against one row of x, each weight decoded as it
    /// is read (x in its format's layout): `out[j]` for row `o + j`. Each sum is
    /// [`exact`]'s for the decoded rows: the same bits.
    #[target_feature(enable = "avx2,fma")]
    pub fn exact_fused<const W: usize>(w: &Stored, o: usize, n_in: usize, x: &[f32], out: &mut [f32]) {
        let x = &x[..n_in];
        let mut acc = [_mm256_setzero_ps(); W];
        let whole = n_in / 8;
        match w {
            Stored::Q8 { block, q, d } => {
                let nb = n_in / block;
                let mut rows: [(&[i8], &[f32]); W] = [(&[], &[]); W];
                for (j, r) in rows.iter_mut().enumerate() {
                    *r = (&q[(o + j) * n_in..][..n_in], &d[(o + j) * nb..][..nb]);
                }
                // SAFETY: step `k < n_in / 8` reads elements `8k..8k + 8` of x and of each
                // row's bytes (n_in), and scale `8k / block` (< nb) of its scales.
                unsafe {
                    for k in 0..whole {
                        let xv = _mm256_loadu_ps(x.as_ptr().add(8 * k));
                        for j in 0..W {
                            if k % 8 == 0 {
                                // As in `q8`: the line two calls on.
                                _mm_prefetch::<_MM_HINT_T0>(rows[j].0.as_ptr().wrapping_add(8 * k + 2 * W * n_in).cast());
                            }
                            let v = _mm_loadl_epi64(rows[j].0.as_ptr().add(8 * k).cast());
                            let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                            let wv = _mm256_mul_ps(_mm256_set1_ps(*rows[j].1.get_unchecked(8 * k / block)), f);
                            acc[j] = _mm256_fmadd_ps(wv, xv, acc[j]);
                        }
                    }
                }
            }
            Stored::Q4 { q, d, m } => {
                let nb = n_in / 32;
                let mut rows: [(&[u8], &[f32], &[f32]); W] = [(&[], &[], &[]); W];
                for (j, r) in rows.iter_mut().enumerate() {
                    *r = (&q[(o + j) * n_in / 2..][..n_in / 2], &d[(o + j) * nb..][..nb], &m[(o + j) * nb..][..nb]);
                }
                let pairs = nb / 2;
                let low = _mm_set1_epi8(0x0F);
                // SAFETY: pair `p < nb / 2` reads bytes `32p..32p + 32` of each row (n_in / 2),
                // elements `64p..64p + 64` of x, and scales `2p, 2p + 1` (< nb).
                unsafe {
                    for p in 0..pairs {
                        let mut xv = [_mm256_setzero_ps(); 8];
                        for (c, v) in xv.iter_mut().enumerate() {
                            *v = _mm256_loadu_ps(x.as_ptr().add(64 * p + 8 * c));
                        }
                        for j in 0..W {
                            let (q, d, m) = rows[j];
                            _mm_prefetch::<_MM_HINT_T0>(q.as_ptr().wrapping_add(32 * p + W * n_in).cast());
                            let bytes = [_mm_loadu_si128(q.as_ptr().add(32 * p).cast()), _mm_loadu_si128(q.as_ptr().add(32 * p + 16).cast())];
                            // x's order: A even, B even, A odd, B odd, 8 at a time.
                            for c in 0..8 {
                                let (half, odd, part) = (c / 2 % 2, c / 4, c % 2);
                                let v = if odd == 0 { _mm_and_si128(bytes[half], low) } else { _mm_and_si128(_mm_srli_epi16::<4>(bytes[half]), low) };
                                let v = if part == 0 { v } else { _mm_srli_si128::<8>(v) };
                                let b = 2 * p + half;
                                let f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                                let wv = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(*d.get_unchecked(b)), f), _mm256_set1_ps(*m.get_unchecked(b)));
                                acc[j] = _mm256_fmadd_ps(wv, xv[c], acc[j]);
                            }
                        }
                    }
                }
                if nb % 2 == 1 {
                    // The lone last block, in the scratch path's way.
                    let mut row = [0f32; 32];
                    for j in 0..W {
                        let (q, d, m) = rows[j];
                        let b = nb - 1;
                        for (i, &v) in q[b * 16..][..16].iter().enumerate() {
                            row[i] = d[b] * (v & 0xF) as f32 - m[b];
                            row[16 + i] = d[b] * (v >> 4) as f32 - m[b];
                        }
                        for c in 0..4 {
                            acc[j] = _mm256_fmadd_ps(load_f32(&row[8 * c..]), load_f32(&x[b * 32 + 8 * c..]), acc[j]);
                        }
                    }
                }
            }
            Stored::F32(_) | Stored::Bf16(_) | Stored::Q4K { .. } | Stored::Q6K { .. } | Stored::Q5 { .. } | Stored::Q8G { .. } | Stored::Q4G { .. } => unreachable!("f32 and bf16 rows take the decoded path, interleaved ones `exact_groups`"),
        }
        for j in 0..W {
            out[j] = hsum(acc[j]);
        }
    }

    /// Decodes row `o` of a weight into `out` (`n_in` f32, in x's layout for its format).
    #[target_feature(enable = "avx2,fma")]
    pub fn decode(w: &Stored, o: usize, n_in: usize, out: &mut [f32]) {
        let out = &mut out[..n_in];
        match w {
            Stored::Q4 { q, d, m } => {
                let nb = n_in / 32;
                let (d, m) = (&d[o * nb..][..nb], &m[o * nb..][..nb]);
                let q = &q[o * n_in / 2..][..n_in / 2];
                let pairs = nb / 2;
                let low = _mm256_set1_epi8(0x0F);
                for p in 0..pairs {
                    let w = load_u8(&q[p * 32..]);
                    // [A even, B even] and [A odd, B odd], as x's layout has them.
                    let halves = [_mm256_and_si256(w, low), _mm256_and_si256(_mm256_srli_epi16::<4>(w), low)];
                    for (h, v) in halves.into_iter().enumerate() {
                        for part in 0..4 {
                            let bytes = match part {
                                0 => _mm256_castsi256_si128(v),
                                1 => _mm_srli_si128::<8>(_mm256_castsi256_si128(v)),
                                2 => _mm256_extracti128_si256::<1>(v),
                                _ => _mm_srli_si128::<8>(_mm256_extracti128_si256::<1>(v)),
                            };
                            let b = 2 * p + part / 2;
                            let f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
                            let val = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(d[b]), f), _mm256_set1_ps(m[b]));
                            let at = &mut out[p * 64 + h * 32 + part * 8..][..8];
                            // SAFETY: `at` holds 8 f32 (cut above); the store is unaligned.
                            unsafe { _mm256_storeu_ps(at.as_mut_ptr(), val) };
                        }
                    }
                }
                if nb % 2 == 1 {
                    let b = nb - 1;
                    for (j, &v) in q[b * 16..][..16].iter().enumerate() {
                        out[b * 32 + j] = d[b] * (v & 0xF) as f32 - m[b];
                        out[b * 32 + 16 + j] = d[b] * (v >> 4) as f32 - m[b];
                    }
                }
            }
            Stored::Q8 { block, q, d } => {
                let nb = n_in / block;
                let (q, d) = (&q[o * n_in..][..n_in], &d[o * nb..][..nb]);
                for k in 0..n_in / 8 {
                    let bytes = &q[k * 8..][..8];
                    // SAFETY: `bytes` holds 8 bytes (cut above); the load is unaligned.
                    let v = unsafe { _mm_loadl_epi64(bytes.as_ptr().cast()) };
                    let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                    let val = _mm256_mul_ps(_mm256_set1_ps(d[k * 8 / block]), f);
                    let at = &mut out[k * 8..][..8];
                    // SAFETY: as above.
                    unsafe { _mm256_storeu_ps(at.as_mut_ptr(), val) };
                }
            }
            Stored::Bf16(v) => {
                let v = &v[o * n_in..][..n_in];
                for k in 0..n_in / 8 {
                    let h = &v[k * 8..][..8];
                    // SAFETY: `h` holds 8 u16 (cut above); the load is unaligned.
                    let x = unsafe { _mm_loadu_si128(h.as_ptr().cast()) };
                    let f = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(x)));
                    let at = &mut out[k * 8..][..8];
                    // SAFETY: as above.
                    unsafe { _mm256_storeu_ps(at.as_mut_ptr(), f) };
                }
                for i in n_in / 8 * 8..n_in {
                    out[i] = f32::from_bits((v[i] as u32) << 16);
                }
            }
            Stored::F32(v) => out.copy_from_slice(&v[o * n_in..][..n_in]),
            Stored::Q4K { .. } | Stored::Q6K { .. } | Stored::Q5 { .. } | Stored::Q8G { .. } | Stored::Q4G { .. } => w.decode_row(o, n_in, out),
        }
    }

    /// `exact` for `W` decoded weight rows (`w[j]`, in x's layout) against `R` rows of x
    /// (`x[i]`): `out[j * R + i]`. Each pair's sum is [`super::scalar::exact`]'s: one lane
    /// vector over the row, then its lanes, then the tail.
    #[target_feature(enable = "avx2,fma")]
    pub fn exact<const W: usize, const R: usize>(w: [&[f32]; W], x: [&[f32]; R], out: &mut [f32]) {
        // SAFETY: this function's features are the body's.
        unsafe { exact_body(w, x, out) }
    }

    /// [`exact`] compiled with AVX-512 VL, whose 32 vector registers hold a larger tile (the
    /// same 256-bit vectors and sums: the same bits).
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    pub fn exact_avx512<const W: usize, const R: usize>(w: [&[f32]; W], x: [&[f32]; R], out: &mut [f32]) {
        // SAFETY: this function's features include the body's.
        unsafe { exact_body(w, x, out) }
    }

    /// [`exact`]'s body.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA: only inlined into [`exact`] and [`exact_avx512`].
    #[inline(always)]
    unsafe fn exact_body<const W: usize, const R: usize>(w: [&[f32]; W], x: [&[f32]; R], out: &mut [f32]) {
        // SAFETY: the CPU has AVX2 and FMA (the caller's promise); the loads are cut.
        unsafe {
            let n = w[0].len();
            let mut acc = [[_mm256_setzero_ps(); R]; W];
            for k in 0..n / 8 {
                let mut xv = [_mm256_setzero_ps(); R];
                for i in 0..R {
                    xv[i] = load_f32(&x[i][k * 8..]);
                }
                for j in 0..W {
                    let wv = load_f32(&w[j][k * 8..]);
                    for i in 0..R {
                        acc[j][i] = _mm256_fmadd_ps(wv, xv[i], acc[j][i]);
                    }
                }
            }
            for j in 0..W {
                for i in 0..R {
                    let mut y = hsum(acc[j][i]);
                    for e in n / 8 * 8..n {
                        y = w[j][e].mul_add(x[i][e], y);
                    }
                    out[j * R + i] = y;
                }
            }
        }
    }
}
