//! GGUF block formats: their layouts, a scalar dequantization for each, and the lossless
//! conversion to the engine's own weight layout (`QMatrix`: small integer values with one scale
//! per group of 16 or 32 and, for formats with mins, one f32 min per 32). The values keep the
//! file's width (8 bits, or 4 bits plus a bit plane for the fifth bit) and the file's f16
//! scales stay f16: decode reads every weight from memory once per token.
//!
//! Every format the engine reads converts to `QMatrix` exactly: the CPU kernels and the GPU
//! upload formats (see `wit/gpu.wit`) then compute with the very values the scalar
//! dequantization gives. Layouts follow ggml's `ggml-common.h`.

use crate::gguf::TensorType;
use half::{bf16, f16};

pub const QK: usize = 32;
pub const QK_K: usize = 256;

pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Q8_0: `d: f16, qs: [i8; 32]`, `w = d * q`.
pub const Q8_0_BYTES: usize = 34;
/// Q5_0: `d: f16, qh: u32 (the fifth bits), qs: [u8; 16]` (low nibbles: elements 0..16, high
/// nibbles: 16..32), `w = d * (q - 16)`.
pub const Q5_0_BYTES: usize = 22;
/// Q4_0: `d: f16, qs: [u8; 16]` (low nibbles 0..16, high 16..32), `w = d * (q - 8)`.
pub const Q4_0_BYTES: usize = 18;
/// Q4_1: `d: f16, m: f16, qs: [u8; 16]` (low nibbles 0..16, high 16..32), `w = d * q + m`.
pub const Q4_1_BYTES: usize = 20;
/// Q4_K: `d: f16, dmin: f16, scales: [u8; 12]` (eight 6-bit scales and mins),
/// `qs: [u8; 128]`; for each 64-element chunk, low nibbles hold its first 32 elements and high
/// nibbles the next 32. `w = d * sc * q - dmin * m`.
pub const Q4_K_BYTES: usize = 144;
/// Q6_K: `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`, `w = d * scale * (q - 32)`
/// with one scale per 16 elements.
pub const Q6_K_BYTES: usize = 210;
/// Q5_1: `d: f16, m: f16, qh: u32 (the fifth bits), qs: [u8; 16]` (as Q5_0), `w = d * q + m`.
pub const Q5_1_BYTES: usize = 24;
/// Q2_K: `scales: [u8; 16]` (a 4-bit scale low, a 4-bit min high, per 16 elements),
/// `qs: [u8; 64]` (2-bit values), `d: f16, dmin: f16`; `w = d * sc * q - dmin * m`.
pub const Q2_K_BYTES: usize = 84;
/// Q3_K: `hmask: [u8; 32]` (the third bits), `qs: [u8; 64]` (the low two), `scales: [u8; 12]`
/// (sixteen 6-bit scales), `d: f16`; `w = d * (sc - 32) * q`, `q` in -4..=3.
pub const Q3_K_BYTES: usize = 110;
/// Q5_K: Q4_K's `d, dmin, scales` then `qh: [u8; 32]` (the fifth bits) and `qs: [u8; 128]`.
pub const Q5_K_BYTES: usize = 176;
/// IQ4_NL: `d: f16, qs: [u8; 16]` (as Q4_0), `w = d * IQ4_VALUES[nibble]`.
pub const IQ4_NL_BYTES: usize = 18;
/// IQ4_XS: `d: f16, scales_h: u16, scales_l: [u8; 4]` (eight 6-bit scales), `qs: [u8; 128]`
/// (IQ4_NL's nibbles, a block of 32 after another); `w = d * (sc - 32) * IQ4_VALUES[nibble]`.
pub const IQ4_XS_BYTES: usize = 136;
/// The sixteen values IQ4_NL's and IQ4_XS's nibbles index (ggml's `kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

const _: () = assert!(Q8_0_BYTES == 2 + QK);
const _: () = assert!(Q5_0_BYTES == 2 + 4 + QK / 2);
const _: () = assert!(Q4_0_BYTES == 2 + QK / 2);
const _: () = assert!(Q4_1_BYTES == 2 + 2 + QK / 2);
const _: () = assert!(Q4_K_BYTES == 2 + 2 + 12 + QK_K / 2);
const _: () = assert!(Q6_K_BYTES == QK_K / 2 + QK_K / 4 + QK_K / 16 + 2);
const _: () = assert!(Q5_1_BYTES == 2 + 2 + 4 + QK / 2);
const _: () = assert!(Q2_K_BYTES == QK_K / 16 + QK_K / 4 + 2 + 2);
const _: () = assert!(Q3_K_BYTES == QK_K / 8 + QK_K / 4 + 12 + 2);
const _: () = assert!(Q5_K_BYTES == 2 + 2 + 12 + QK_K / 8 + QK_K / 2);
const _: () = assert!(IQ4_NL_BYTES == 2 + QK / 2);
const _: () = assert!(IQ4_XS_BYTES == 2 + 2 + QK_K / 64 + QK_K / 2);

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block.
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Calls `f(element, q, scale_group, scale, min)` for every element of one block, with the
/// block's integer value `q`, the index of its scale group inside the block and the group's
/// scale and min (`w = scale * q - min`).
pub(crate) fn for_each_in_block(kind: TensorType, b: &[u8], mut f: impl FnMut(usize, i8, f32, f32)) {
    match kind {
        TensorType::Q8_0 => {
            let d = f16_at(b, 0);
            for i in 0..QK {
                f(i, b[2 + i] as i8, d, 0.0);
            }
        }
        TensorType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..];
            for i in 0..QK / 2 {
                let lo = (qs[i] & 0xF) | ((((qh >> i) & 1) as u8) << 4);
                let hi = (qs[i] >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4);
                f(i, lo as i8 - 16, d, 0.0);
                f(i + 16, hi as i8 - 16, d, 0.0);
            }
        }
        TensorType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..];
            for i in 0..QK / 2 {
                f(i, (qs[i] & 0xF) as i8 - 8, d, 0.0);
                f(i + 16, (qs[i] >> 4) as i8 - 8, d, 0.0);
            }
        }
        TensorType::Q4_1 => {
            // `w = d * q + m`, as `d * q - (-m)`: the same value (negation is exact).
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qs = &b[4..];
            for i in 0..QK / 2 {
                f(i, (qs[i] & 0xF) as i8, d, -m);
                f(i + 16, (qs[i] >> 4) as i8, d, -m);
            }
        }
        TensorType::Q4K => {
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let scales = &b[4..16];
            let qs = &b[16..];
            for chunk in 0..4 {
                let (s0, m0) = scale_min_k4(2 * chunk, scales);
                let (s1, m1) = scale_min_k4(2 * chunk + 1, scales);
                let q = &qs[32 * chunk..32 * chunk + 32];
                for l in 0..32 {
                    f(64 * chunk + l, (q[l] & 0xF) as i8, d * s0 as f32, dmin * m0 as f32);
                    f(64 * chunk + 32 + l, (q[l] >> 4) as i8, d * s1 as f32, dmin * m1 as f32);
                }
            }
        }
        TensorType::Q6K => {
            let ql = &b[0..128];
            let qh = &b[128..192];
            let sc = &b[192..208];
            let d = f16_at(b, 208);
            for half in 0..2 {
                let ql = &ql[64 * half..];
                let qh = &qh[32 * half..];
                let sc = &sc[8 * half..];
                let y = 128 * half;
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                    f(y + l, q1, d * sc[is] as i8 as f32, 0.0);
                    f(y + l + 32, q2, d * sc[is + 2] as i8 as f32, 0.0);
                    f(y + l + 64, q3, d * sc[is + 4] as i8 as f32, 0.0);
                    f(y + l + 96, q4, d * sc[is + 6] as i8 as f32, 0.0);
                }
            }
        }
        TensorType::Q5_1 => {
            // `w = d * q + m`, as `d * q - (-m)` (Q4_1's reading, with Q5_0's fifth bits).
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..];
            for i in 0..QK / 2 {
                let lo = (qs[i] & 0xF) | ((((qh >> i) & 1) as u8) << 4);
                let hi = (qs[i] >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4);
                f(i, lo as i8, d, -m);
                f(i + 16, hi as i8, d, -m);
            }
        }
        TensorType::Q2K => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            // Each half of 128 elements reads 32 bytes of `qs` four times, two bits further
            // each time: 16 elements from the first 16 bytes, then 16 from the next.
            for half in 0..2 {
                let q = &qs[32 * half..][..32];
                for shift in 0..4 {
                    for part in 0..2 {
                        let sub = 8 * half + 2 * shift + part;
                        let (s, m) = (d * (sc[sub] & 0xF) as f32, dmin * (sc[sub] >> 4) as f32);
                        for l in 0..16 {
                            f(16 * sub + l, ((q[16 * part + l] >> (2 * shift)) & 3) as i8, s, m);
                        }
                    }
                }
            }
        }
        TensorType::Q3K => {
            let (hmask, qs, d) = (&b[0..32], &b[32..96], f16_at(b, 108));
            let scales = q3_k_scales(&b[96..108]);
            for half in 0..2 {
                let q = &qs[32 * half..][..32];
                for shift in 0..4 {
                    // The third bit of element `l` of this part lies in bit `4 * half + shift`
                    // of `hmask[l]`: set, the value is the low two bits; clear, four less.
                    let bit = 4 * half + shift;
                    for part in 0..2 {
                        let sub = 8 * half + 2 * shift + part;
                        let s = d * (scales[sub] as i32 - 32) as f32;
                        for l in 0..16 {
                            let k = 16 * part + l;
                            let low = ((q[k] >> (2 * shift)) & 3) as i8;
                            f(16 * sub + l, low - if (hmask[k] >> bit) & 1 == 1 { 0 } else { 4 }, s, 0.0);
                        }
                    }
                }
            }
        }
        TensorType::Q5K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..]);
            for chunk in 0..4 {
                let (s0, m0) = scale_min_k4(2 * chunk, scales);
                let (s1, m1) = scale_min_k4(2 * chunk + 1, scales);
                let q = &qs[32 * chunk..32 * chunk + 32];
                for l in 0..32 {
                    let lo = (q[l] & 0xF) | (((qh[l] >> (2 * chunk)) & 1) << 4);
                    let hi = (q[l] >> 4) | (((qh[l] >> (2 * chunk + 1)) & 1) << 4);
                    f(64 * chunk + l, lo as i8, d * s0 as f32, dmin * m0 as f32);
                    f(64 * chunk + 32 + l, hi as i8, d * s1 as f32, dmin * m1 as f32);
                }
            }
        }
        TensorType::IQ4NL => {
            let d = f16_at(b, 0);
            let qs = &b[2..];
            for i in 0..QK / 2 {
                f(i, IQ4_VALUES[(qs[i] & 0xF) as usize], d, 0.0);
                f(i + 16, IQ4_VALUES[(qs[i] >> 4) as usize], d, 0.0);
            }
        }
        TensorType::IQ4XS => {
            let d = f16_at(b, 0);
            let high = u16::from_le_bytes([b[2], b[3]]);
            let (low, qs) = (&b[4..8], &b[8..]);
            for sub in 0..8 {
                let sc = ((low[sub / 2] >> (4 * (sub % 2))) & 0xF) | ((((high >> (2 * sub)) & 3) as u8) << 4);
                let s = d * (sc as i32 - 32) as f32;
                let q = &qs[16 * sub..][..16];
                for i in 0..QK / 2 {
                    f(32 * sub + i, IQ4_VALUES[(q[i] & 0xF) as usize], s, 0.0);
                    f(32 * sub + i + 16, IQ4_VALUES[(q[i] >> 4) as usize], s, 0.0);
                }
            }
        }
        _ => unreachable!("for_each_in_block called for {kind:?}"),
    }
}

/// Q3_K's sixteen 6-bit scales (0..64; the value is `sc - 32`): the low four bits of scale `j`
/// in byte `j % 8` (low nibble for `j < 8`), the high two in byte `8 + j % 4`, bits
/// `2 * (j / 4)`.
fn q3_k_scales(s: &[u8]) -> [u8; 16] {
    core::array::from_fn(|j| ((s[j % 8] >> (4 * (j / 8))) & 0xF) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4))
}

/// Whether the engine can compute with tensors of this type.
pub fn supported(kind: TensorType) -> bool {
    use TensorType::*;
    matches!(kind, F32 | F16 | BF16 | Q8_0 | Q5_0 | Q5_1 | Q4_0 | Q4_1 | Q2K | Q3K | Q4K | Q5K | Q6K | IQ4NL | IQ4XS)
}

/// Scalar reference: the f32 values of `n` elements of a tensor of type `kind` in `data`.
/// `n` must be a multiple of the type's block and `data` hold exactly those blocks.
pub fn dequantize(kind: TensorType, data: &[u8], out: &mut [f32]) {
    let (block, bytes) = kind.block();
    let (block, bytes) = (block as usize, bytes as usize);
    debug_assert_eq!(out.len() / block * bytes, data.len());
    match kind {
        TensorType::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        TensorType::F16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        TensorType::BF16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        _ => {
            for (ob, b) in out.chunks_exact_mut(block).zip(data.chunks_exact(bytes)) {
                for_each_in_block(kind, b, |i, q, s, m| ob[i] = s * q as f32 - m);
            }
        }
    }
}

/// Elements per scale in a `QMatrix`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    G16 = 16,
    G32 = 32,
}

/// How a `QMatrix` stores its integer values. Decode reads every weight once per token from
/// memory, so the values keep the file's own width where the kernels can unpack it cheaply.
pub enum Values {
    /// One i8 per value, `[n_out, n_in]`.
    I8(Vec<i8>),
    /// Four bits per value (`[n_out, n_in / 2]` bytes): in each block of 32, byte `j` holds
    /// element `j` in its low nibble and element `16 + j` in its high nibble. The value is
    /// `nibble + 16 * fifth - offset`, with the fifth bits in `fifth` (empty for 4-bit formats).
    /// `fifth` has [`fifth_bytes_per_row`] bytes per row: the blocks of a row in fours, 16 bytes
    /// for each four, where bit `2k` of byte `j` is the fifth bit of element `j` of block `k`
    /// of the four and bit `2k + 1` that of element `16 + j`.
    Nibbles { nib: Vec<u8>, fifth: Vec<u8>, offset: i8 },
}

/// Scales of a `QMatrix`, one per group: f32, or the file's own f16 where every one is finite.
pub enum Scales {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

/// Bytes of fifth bits per row of `n_in` elements in `Values::Nibbles`.
pub fn fifth_bytes_per_row(n_in: usize) -> usize {
    (n_in / QK).div_ceil(4) * 16
}

/// An f16 as f32 (exact for every f16).
pub fn f16_to_f32(h: u16) -> f32 {
    f16::from_bits(h).to_f32()
}

/// A weight matrix `W[n_out, n_in]` as small integers with scales:
/// `w[r, c] = d[r, c / group] * q[r, c] - m[r, c / 32]` (`m` only for formats with mins).
pub struct QMatrix {
    pub n_out: usize,
    pub n_in: usize,
    pub group: Group,
    /// `q`, `[n_out, n_in]`
    pub values: Values,
    /// `d`, `[n_out, n_in / group]`
    pub d: Scales,
    /// `[n_out, n_in / 32]`, empty when the format has no mins.
    pub m: Vec<f32>,
    /// Some value is -128 (Q8_0's values are -127..=127 as ggml writes them): the int8
    /// products, which take each value's magnitude as a 7-bit number, leave such a matrix to
    /// the exact ones (`kernels::takes_int8`).
    pub i8_min: bool,
}

/// The group of scales a block format converts to, and whether it carries mins. `None` for the
/// float types and for Q2_K, whose mins come one per 16 elements (a `QMatrix` has one per 32):
/// the guest widens those to f32, exactly.
pub fn qmatrix_layout(kind: TensorType) -> Option<(Group, bool)> {
    use TensorType::*;
    match kind {
        Q8_0 | Q5_0 | Q4_0 | IQ4NL | IQ4XS => Some((Group::G32, false)),
        Q6K | Q3K => Some((Group::G16, false)),
        Q4K | Q4_1 | Q5K | Q5_1 => Some((Group::G32, true)),
        _ => None,
    }
}

/// The file's f16 scales, kept as f16 where every one is finite (the kernels widen them
/// exactly), else widened to f32 here.
fn file_scales(raw: Vec<u16>) -> Scales {
    if raw.iter().all(|h| h & 0x7C00 != 0x7C00) {
        Scales::F16(raw)
    } else {
        Scales::F32(raw.into_iter().map(f16_to_f32).collect())
    }
}

impl QMatrix {
    /// Converts the blocks of a `[n_out, n_in]` tensor, losslessly. `None` for types without a
    /// block layout here (float types).
    pub fn from_blocks(kind: TensorType, data: &[u8], n_out: usize, n_in: usize) -> Option<Self> {
        let (group, has_min) = qmatrix_layout(kind)?;
        let (block, bytes) = kind.block();
        let (block, bytes) = (block as usize, bytes as usize);
        let n = n_out * n_in;
        let blocks = data.chunks_exact(bytes).take(n / block);
        let d16 = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
        let (values, d, m) = match kind {
            TensorType::Q8_0 => {
                let mut q = Vec::with_capacity(n);
                let mut d = Vec::with_capacity(n / QK);
                for b in blocks {
                    d.push(d16(b));
                    q.extend(b[2..].iter().map(|&v| v as i8));
                }
                (Values::I8(q), file_scales(d), Vec::new())
            }
            // The file's nibble order is the engine's: byte `j` holds elements `j` and `16 + j`.
            TensorType::Q4_0 => {
                let mut nib = Vec::with_capacity(n / 2);
                let mut d = Vec::with_capacity(n / QK);
                for b in blocks {
                    d.push(d16(b));
                    nib.extend_from_slice(&b[2..]);
                }
                (Values::Nibbles { nib, fifth: Vec::new(), offset: 8 }, file_scales(d), Vec::new())
            }
            TensorType::Q5_0 => {
                let (nb, fifth_row) = (n_in / QK, fifth_bytes_per_row(n_in));
                let mut nib = Vec::with_capacity(n / 2);
                let mut fifth = vec![0u8; n_out * fifth_row];
                let mut d = Vec::with_capacity(n / QK);
                for (i, b) in blocks.enumerate() {
                    d.push(d16(b));
                    nib.extend_from_slice(&b[6..]);
                    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                    let (r, k) = (i / nb, i % nb);
                    let plane = &mut fifth[r * fifth_row + k / 4 * 16..][..16];
                    let shift = 2 * (k % 4);
                    for (j, byte) in plane.iter_mut().enumerate() {
                        *byte |= ((((qh >> j) & 1) | (((qh >> (16 + j)) & 1) << 1)) as u8) << shift;
                    }
                }
                (Values::Nibbles { nib, fifth, offset: 16 }, file_scales(d), Vec::new())
            }
            // Q4_K's layout (4-bit values with no offset, f32 scales and mins): `m` holds
            // `-min` of the file, `w = d * q - m`; the file's order of nibbles is the engine's.
            TensorType::Q4_1 => {
                let mut nib = Vec::with_capacity(n / 2);
                let mut d = Vec::with_capacity(n / QK);
                let mut m = Vec::with_capacity(n / QK);
                for b in blocks {
                    d.push(f16_at(b, 0));
                    m.push(-f16_at(b, 2));
                    nib.extend_from_slice(&b[4..]);
                }
                (Values::Nibbles { nib, fifth: Vec::new(), offset: 0 }, Scales::F32(d), m)
            }
            // Five-bit values 0..32 with mins: nibbles and Q5_0's plane of fifth bits, f32
            // scales and mins as the reading gives them.
            TensorType::Q5_1 | TensorType::Q5K => {
                let (nb, fifth_row) = (n_in / QK, fifth_bytes_per_row(n_in));
                let mut nib = vec![0u8; n / 2];
                let mut fifth = vec![0u8; n_out * fifth_row];
                let mut d = vec![0f32; n / QK];
                let mut m = vec![0f32; n / QK];
                for (bi, b) in blocks.enumerate() {
                    let base = bi * block;
                    for_each_in_block(kind, b, |i, q, s, mv| {
                        let e = base + i;
                        let (k, j) = (e / QK, e % QK);
                        nib[k * 16 + j % 16] |= (q as u8 & 0xF) << (4 * (j / 16));
                        let (r, kr) = (k / nb, k % nb);
                        fifth[r * fifth_row + kr / 4 * 16 + j % 16] |= ((q as u8 >> 4) & 1) << (2 * (kr % 4) + j / 16);
                        d[k] = s;
                        m[k] = mv;
                    });
                }
                (Values::Nibbles { nib, fifth, offset: 0 }, Scales::F32(d), m)
            }
            TensorType::Q4K => {
                let mut nib = Vec::with_capacity(n / 2);
                let mut d = Vec::with_capacity(n / QK);
                let mut m = Vec::with_capacity(n / QK);
                for b in blocks {
                    let (scale, min) = (f16_at(b, 0), f16_at(b, 2));
                    for chunk in 0..4 {
                        // Low nibbles: the chunk's first 32 elements; high nibbles: the next 32.
                        let q = &b[16 + 32 * chunk..][..32];
                        nib.extend((0..16).map(|j| (q[j] & 0xF) | (q[16 + j] << 4)));
                        nib.extend((0..16).map(|j| (q[j] >> 4) | (q[16 + j] & 0xF0)));
                        for sub in [2 * chunk, 2 * chunk + 1] {
                            let (sc, mn) = scale_min_k4(sub, &b[4..16]);
                            d.push(scale * sc as f32);
                            m.push(min * mn as f32);
                        }
                    }
                }
                (Values::Nibbles { nib, fifth: Vec::new(), offset: 0 }, Scales::F32(d), m)
            }
            _ => {
                let g = group as usize;
                let mut q = vec![0i8; n];
                let mut d = vec![0f32; n / g];
                let mut m = if has_min { vec![0f32; n / QK] } else { Vec::new() };
                for (bi, b) in blocks.enumerate() {
                    let base = bi * block;
                    for_each_in_block(kind, b, |i, qv, s, mv| {
                        q[base + i] = qv;
                        d[(base + i) / g] = s;
                        if has_min {
                            m[(base + i) / QK] = mv;
                        }
                    });
                }
                (Values::I8(q), Scales::F32(d), m)
            }
        };
        let i8_min = matches!(&values, Values::I8(q) if q.contains(&i8::MIN));
        Some(QMatrix { n_out, n_in, group, values, d, m, i8_min })
    }

    /// The integer value at row `r`, column `c`.
    pub fn value(&self, r: usize, c: usize) -> i8 {
        let n = self.n_in;
        match &self.values {
            Values::I8(q) => q[r * n + c],
            Values::Nibbles { nib, fifth, offset } => {
                let (b, j) = (c / QK, c % QK);
                let byte = nib[(r * n + c) / QK * 16 + j % 16];
                let mut u = (byte >> (4 * (j / 16))) & 0xF;
                if !fifth.is_empty() {
                    let bits = fifth[r * fifth_bytes_per_row(n) + b / 4 * 16 + j % 16];
                    u |= ((bits >> (2 * (b % 4) + j / 16)) & 1) << 4;
                }
                (u as i16 - *offset as i16) as i8
            }
        }
    }

    /// Scale `i` of the whole matrix (`d` flattened: row `r`, group `k` is `r * n_in / group + k`).
    pub fn scale(&self, i: usize) -> f32 {
        match &self.d {
            Scales::F32(d) => d[i],
            Scales::F16(d) => f16_to_f32(d[i]),
        }
    }

    /// The integer values of row `r` (`out` of `n_in`).
    pub fn row_values(&self, r: usize, out: &mut [i8]) {
        for (c, o) in out.iter_mut().enumerate().take(self.n_in) {
            *o = self.value(r, c);
        }
    }

    /// The scales of row `r` (`out` of `n_in / group`).
    pub fn row_scales(&self, r: usize, out: &mut [f32]) {
        let k = self.n_in / self.group as usize;
        for (i, o) in out.iter_mut().enumerate().take(k) {
            *o = self.scale(r * k + i);
        }
    }

    /// Row `r` as f32 (for tests and the embedding lookup: a batched step's 64 rows, each
    /// value `scale * value - min`), a group's scale read once; 8-bit values read in place.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let (n, g) = (self.n_in, self.group as usize);
        let out = &mut out[..n];
        // `n` is a multiple of 32 (and so of the group): row `r`'s groups start at `r * n / g`.
        let first = r * n / g;
        for (k, group) in out.chunks_exact_mut(g).enumerate() {
            let d = self.scale(first + k);
            match &self.values {
                Values::I8(q) => {
                    for (o, &v) in group.iter_mut().zip(&q[r * n + k * g..r * n + (k + 1) * g]) {
                        *o = d * v as f32;
                    }
                }
                Values::Nibbles { .. } => {
                    for (j, o) in group.iter_mut().enumerate() {
                        *o = d * self.value(r, k * g + j) as f32;
                    }
                }
            }
        }
        if !self.m.is_empty() {
            for (block, &m) in out.chunks_exact_mut(QK).zip(&self.m[r * n / QK..]) {
                for o in block {
                    *o -= m;
                }
            }
        }
    }

    /// Bytes the kernels read for the whole matrix.
    pub fn bytes(&self) -> usize {
        let values = match &self.values {
            Values::I8(q) => q.len(),
            Values::Nibbles { nib, fifth, .. } => nib.len() + fifth.len(),
        };
        let scales = match &self.d {
            Scales::F32(d) => 4 * d.len(),
            Scales::F16(d) => 2 * d.len(),
        };
        values + scales + 4 * self.m.len()
    }

    /// Bytes a `[n_out, n_in]` tensor of `kind` takes once converted (`None` for types without
    /// a block layout here): f16 scales counted as the file has them.
    pub fn converted_bytes(kind: TensorType, n_out: usize, n_in: usize) -> Option<u64> {
        let (group, has_min) = qmatrix_layout(kind)?;
        let n = n_out as u64 * n_in as u64;
        let groups = n / group as u64;
        let (values, scales) = match kind {
            TensorType::Q8_0 => (n, 2 * groups),
            TensorType::Q4_0 => (n / 2, 2 * groups),
            TensorType::Q5_0 => (n / 2 + n_out as u64 * fifth_bytes_per_row(n_in) as u64, 2 * groups),
            TensorType::Q5_1 | TensorType::Q5K => (n / 2 + n_out as u64 * fifth_bytes_per_row(n_in) as u64, 4 * groups),
            TensorType::Q4K | TensorType::Q4_1 => (n / 2, 4 * groups),
            _ => (n, 4 * groups),
        };
        Some(values + scales + if has_min { 4 * (n / QK as u64) } else { 0 })
    }

    /// Makes room for `rows` more rows of this matrix's layout, so that appending them does not
    /// move it (a moved matrix is briefly held twice). `Err` with the bytes that did not fit.
    pub fn reserve_rows(&mut self, rows: usize) -> Result<(), usize> {
        let n = rows * self.n_in;
        let fits = |r: Result<(), std::collections::TryReserveError>, bytes: usize| r.map_err(|_| bytes);
        match &mut self.values {
            Values::I8(q) => fits(q.try_reserve_exact(n), n)?,
            Values::Nibbles { nib, fifth, .. } => {
                fits(nib.try_reserve_exact(n / 2), n / 2)?;
                if !fifth.is_empty() {
                    let f = rows * fifth_bytes_per_row(self.n_in);
                    fits(fifth.try_reserve_exact(f), f)?;
                }
            }
        }
        let groups = n / self.group as usize;
        match &mut self.d {
            Scales::F32(d) => fits(d.try_reserve_exact(groups), 4 * groups)?,
            Scales::F16(d) => fits(d.try_reserve_exact(groups), 2 * groups)?,
        }
        if !self.m.is_empty() {
            fits(self.m.try_reserve_exact(n / QK), 4 * (n / QK))?;
        }
        Ok(())
    }

    /// Appends the rows of `other`, converted from the same kind of tensor with the same width.
    /// Where one side's scales are f32 (the file had a non-finite f16), both become f32.
    pub fn append(&mut self, other: QMatrix) {
        debug_assert!(self.n_in == other.n_in && self.group as usize == other.group as usize);
        match (&mut self.values, other.values) {
            (Values::I8(q), Values::I8(more)) => q.extend_from_slice(&more),
            (Values::Nibbles { nib, fifth, .. }, Values::Nibbles { nib: more, fifth: more_fifth, .. }) => {
                nib.extend_from_slice(&more);
                fifth.extend_from_slice(&more_fifth);
            }
            _ => debug_assert!(false, "appending rows of another value storage"),
        }
        let widen = |d: &[u16]| d.iter().map(|&h| f16_to_f32(h)).collect::<Vec<f32>>();
        match (&mut self.d, other.d) {
            (Scales::F32(d), Scales::F32(more)) => d.extend_from_slice(&more),
            (Scales::F16(d), Scales::F16(more)) => d.extend_from_slice(&more),
            (Scales::F32(d), Scales::F16(more)) => d.extend(widen(&more)),
            (Scales::F16(d), Scales::F32(more)) => {
                let mut all = widen(d);
                all.extend_from_slice(&more);
                self.d = Scales::F32(all);
            }
        }
        self.m.extend_from_slice(&other.m);
        self.i8_min |= other.i8_min;
        self.n_out += other.n_out;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tiny deterministic generator for test data (xorshift64*).
    pub struct Rng(pub u64);
    impl Rng {
        pub fn next_u64(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545F4914F6CDD1D)
        }
        pub fn byte(&mut self) -> u8 {
            (self.next_u64() >> 56) as u8
        }
        /// Uniform in [-1, 1).
        pub fn f32(&mut self) -> f32 {
            ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        pub fn f16_bytes(&mut self, scale: f32) -> [u8; 2] {
            f16::from_f32(self.f32() * scale).to_bits().to_le_bytes()
        }
    }

    /// Every block type the engine reads.
    pub const BLOCK_KINDS: [TensorType; 12] = {
        use TensorType::*;
        [Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, Q2K, Q3K, Q4K, Q5K, Q6K, IQ4NL, IQ4XS]
    };

    /// Random but valid blocks of `kind` for `n` elements (finite f16 scales).
    pub fn random_blocks(kind: TensorType, n: usize, rng: &mut Rng) -> Vec<u8> {
        let (block, bytes) = kind.block();
        let blocks = n / block as usize;
        let mut out = Vec::with_capacity(blocks * bytes as usize);
        for _ in 0..blocks {
            let start = out.len();
            for _ in 0..bytes {
                out.push(rng.byte());
            }
            let b = &mut out[start..];
            match kind {
                TensorType::Q8_0 | TensorType::Q5_0 | TensorType::Q4_0 | TensorType::IQ4NL => {
                    b[0..2].copy_from_slice(&rng.f16_bytes(0.05))
                }
                TensorType::IQ4XS => b[0..2].copy_from_slice(&rng.f16_bytes(0.001)),
                TensorType::Q4K | TensorType::Q4_1 | TensorType::Q5K | TensorType::Q5_1 => {
                    b[0..2].copy_from_slice(&rng.f16_bytes(0.01));
                    b[2..4].copy_from_slice(&rng.f16_bytes(0.01));
                }
                TensorType::Q2K => {
                    b[80..82].copy_from_slice(&rng.f16_bytes(0.01));
                    b[82..84].copy_from_slice(&rng.f16_bytes(0.01));
                }
                TensorType::Q3K => b[108..110].copy_from_slice(&rng.f16_bytes(0.005)),
                TensorType::Q6K => b[208..210].copy_from_slice(&rng.f16_bytes(0.005)),
                TensorType::F16 => {
                    for c in b.chunks_exact_mut(2) {
                        c.copy_from_slice(&rng.f16_bytes(1.0));
                    }
                }
                TensorType::BF16 => {
                    for c in b.chunks_exact_mut(2) {
                        c.copy_from_slice(&bf16::from_f32(rng.f32()).to_bits().to_le_bytes());
                    }
                }
                TensorType::F32 => b.copy_from_slice(&rng.f32().to_le_bytes()),
                _ => unreachable!(),
            }
        }
        out
    }

    #[test]
    fn qmatrix_is_lossless() {
        let mut rng = Rng(0x9E3779B97F4A7C15);
        for kind in BLOCK_KINDS.into_iter().filter(|&k| qmatrix_layout(k).is_some()) {
            let (n_out, n_in) = (3, 512);
            let data = random_blocks(kind, n_out * n_in, &mut rng);
            let mut want = vec![0f32; n_out * n_in];
            dequantize(kind, &data, &mut want);
            let qm = QMatrix::from_blocks(kind, &data, n_out, n_in).unwrap();
            let mut row = vec![0f32; n_in];
            for r in 0..n_out {
                qm.row_f32(r, &mut row);
                assert_eq!(&row[..], &want[r * n_in..(r + 1) * n_in], "{kind:?} row {r}");
            }
        }
    }

    /// Every tensor type the engine reads, against the `gguf` package's own dequantization of
    /// the same blocks (tests/formats/make.py wrote both: moderate scales, then a block of raw
    /// bytes whose scales may be infinite or NaN), bit for bit; a NaN where gguf has a NaN.
    /// And the `QMatrix` of each block type, row by row, the same values.
    #[test]
    fn dequantize_is_ggufs_bit_for_bit() {
        let file = include_bytes!("../../tests/formats/formats.gguf");
        let g = crate::gguf::Gguf::parse(file).unwrap();
        let data = |t: &crate::gguf::TensorInfo| &file[t.offset as usize..][..t.n_bytes as usize];
        let mut seen = Vec::new();
        for t in g.tensors.iter().filter(|t| !t.name.ends_with(".f32")) {
            assert!(supported(t.kind), "{}", t.name);
            let want = g.tensor(&format!("{}.f32", t.name)).unwrap();
            let want: Vec<f32> = data(want).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let n = t.n_elements as usize;
            let mut got = vec![0f32; n];
            dequantize(t.kind, data(t), &mut got);
            let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(same(*a, *b), "{} element {i}: {a:e} ({:#x}), gguf {b:e} ({:#x})", t.name, a.to_bits(), b.to_bits());
            }
            if let Some(q) = QMatrix::from_blocks(t.kind, data(t), n / 256, 256) {
                let mut row = vec![0f32; 256];
                for r in 0..n / 256 {
                    q.row_f32(r, &mut row);
                    for (c, (a, b)) in row.iter().zip(&want[256 * r..]).enumerate() {
                        assert!(same(*a, *b), "{} as a QMatrix ({r}, {c}): {a:e}, gguf {b:e}", t.name);
                    }
                }
            }
            seen.push(t.kind);
        }
        use TensorType::*;
        for kind in [F32, F16, BF16].into_iter().chain(BLOCK_KINDS) {
            assert!(seen.contains(&kind), "tests/formats/formats.gguf has no {kind:?}");
        }
    }

    #[test]
    fn storage_keeps_the_file_widths() {
        let mut rng = Rng(0x51);
        let (n_out, n_in) = (5, 768);
        let mut storage = |kind| {
            let qm = QMatrix::from_blocks(kind, &random_blocks(kind, n_out * n_in, &mut rng), n_out, n_in).unwrap();
            let values = match &qm.values {
                Values::I8(_) => "i8".to_string(),
                Values::Nibbles { fifth, offset, .. } => format!("nibbles{} -{offset}", if fifth.is_empty() { "" } else { "+fifth" }),
            };
            (values, matches!(qm.d, Scales::F16(_)), qm.bytes())
        };
        // Bytes: values, fifth bits (16 per four blocks of a row), scales, mins.
        let (n, blocks) = (n_out * n_in, n_out * n_in / 32);
        assert_eq!(storage(TensorType::Q8_0), ("i8".into(), true, n + 2 * blocks));
        assert_eq!(storage(TensorType::Q5_0), ("nibbles+fifth -16".into(), true, n / 2 + n_out * 96 + 2 * blocks));
        assert_eq!(storage(TensorType::Q4_0), ("nibbles -8".into(), true, n / 2 + 2 * blocks));
        assert_eq!(storage(TensorType::Q4_1), ("nibbles -0".into(), false, n / 2 + 8 * blocks));
        assert_eq!(storage(TensorType::Q4K), ("nibbles -0".into(), false, n / 2 + 8 * blocks));
        assert_eq!(storage(TensorType::Q6K), ("i8".into(), false, n + 8 * blocks));
        assert_eq!(storage(TensorType::Q5_1), ("nibbles+fifth -0".into(), false, n / 2 + n_out * 96 + 8 * blocks));
        assert_eq!(storage(TensorType::Q5K), ("nibbles+fifth -0".into(), false, n / 2 + n_out * 96 + 8 * blocks));
        assert_eq!(storage(TensorType::Q3K), ("i8".into(), false, n + 8 * blocks));
        assert_eq!(storage(TensorType::IQ4NL), ("i8".into(), false, n + 4 * blocks));
        assert_eq!(storage(TensorType::IQ4XS), ("i8".into(), false, n + 4 * blocks));
    }

    /// Every value, scale and min of `a` and `b`, which must be the same matrix.
    fn same_matrix(a: &QMatrix, b: &QMatrix, what: &str) {
        assert_eq!((a.n_out, a.n_in, a.bytes(), a.m.len()), (b.n_out, b.n_in, b.bytes(), b.m.len()), "{what}");
        for r in 0..a.n_out {
            for c in 0..a.n_in {
                assert_eq!(a.value(r, c), b.value(r, c), "{what}: value ({r}, {c})");
            }
        }
        for i in 0..a.n_out * a.n_in / a.group as usize {
            assert_eq!(a.scale(i).to_bits(), b.scale(i).to_bits(), "{what}: scale {i}");
        }
        assert!(a.m.iter().zip(&b.m).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}: mins");
    }

    #[test]
    fn a_matrix_converted_in_pieces_of_rows_is_the_whole_one() {
        let mut rng = Rng(0xA11CE);
        let (n_out, n_in) = (7, 768);
        for kind in BLOCK_KINDS.into_iter().filter(|&k| qmatrix_layout(k).is_some()) {
            let data = random_blocks(kind, n_out * n_in, &mut rng);
            let whole = QMatrix::from_blocks(kind, &data, n_out, n_in).unwrap();
            assert_eq!(QMatrix::converted_bytes(kind, n_out, n_in), Some(whole.bytes() as u64), "{kind:?}");
            let row = data.len() / n_out;
            for rows in [1, 2, 3, 7] {
                let mut pieces = (0..n_out).step_by(rows).map(|r| {
                    let end = (r + rows).min(n_out);
                    QMatrix::from_blocks(kind, &data[r * row..end * row], end - r, n_in).unwrap()
                });
                let mut all = pieces.next().unwrap();
                all.reserve_rows(n_out - all.n_out).unwrap();
                pieces.for_each(|p| all.append(p));
                same_matrix(&all, &whole, &format!("{kind:?} in pieces of {rows} rows"));
            }
        }
        // A piece whose scales had to be f32 (a non-finite f16) makes the whole f32, either side.
        let data = random_blocks(TensorType::Q8_0, 4 * 64, &mut rng);
        let row = data.len() / 4;
        for bad_row in [0, 3] {
            let mut data = data.clone();
            data[bad_row * row..][..2].copy_from_slice(&f16::INFINITY.to_bits().to_le_bytes());
            let whole = QMatrix::from_blocks(TensorType::Q8_0, &data, 4, 64).unwrap();
            let mut all = QMatrix::from_blocks(TensorType::Q8_0, &data[..2 * row], 2, 64).unwrap();
            all.append(QMatrix::from_blocks(TensorType::Q8_0, &data[2 * row..], 2, 64).unwrap());
            assert!(matches!(all.d, Scales::F32(_)));
            same_matrix(&all, &whole, &format!("an infinite scale in row {bad_row}"));
        }
    }

    #[test]
    fn a_non_finite_scale_keeps_f32_scales() {
        let mut rng = Rng(0x77);
        let mut data = random_blocks(TensorType::Q5_0, 2 * 64, &mut rng);
        data[22..24].copy_from_slice(&f16::INFINITY.to_bits().to_le_bytes());
        let qm = QMatrix::from_blocks(TensorType::Q5_0, &data, 2, 64).unwrap();
        assert!(matches!(qm.d, Scales::F32(_)));
        let mut want = vec![0f32; 128];
        dequantize(TensorType::Q5_0, &data, &mut want);
        let mut row = vec![0f32; 64];
        for r in 0..2 {
            qm.row_f32(r, &mut row);
            for (a, b) in row.iter().zip(&want[64 * r..64 * r + 64]) {
                assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "row {r}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn q8_0_layout() {
        // d = 0.5, q = 0..32 - 16.
        let mut b = f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut out = [0f32; 32];
        dequantize(TensorType::Q8_0, &b, &mut out);
        for (i, v) in out.iter().enumerate() {
            assert_eq!(*v, 0.5 * (i as f32 - 16.0));
        }
    }

    #[test]
    fn q4_k_scale_min_unpacking() {
        // Sub-blocks 4..8 take their high bits from the top two bits of bytes 0..8.
        let s = [0xC1, 0x42, 0x03, 0x04, 0x85, 0x06, 0x07, 0x08, 0x9A, 0xBC, 0xDE, 0xF0];
        assert_eq!(scale_min_k4(0, &s), (0x01, 0x05));
        assert_eq!(scale_min_k4(4, &s), (0xA | (3 << 4), 0x9 | (2 << 4)));
        assert_eq!(scale_min_k4(5, &s), (0xC | (1 << 4), 0xB));
    }
}
