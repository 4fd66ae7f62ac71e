//! The upload formats of weights (the WIT `weight-format`): the bytes a guest sends for a matrix
//! `W[n_out, n_in]`, row by row, and the f32 scales beside them.

/// A weight layout of the WIT `weight-format` (see `wit/gpu.wit` for the exact bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// Plain little-endian f32, 4 bytes an element, no scales.
    F32,
    /// bfloat16 (the high half of an f32), 2 bytes an element, no scales. Exact for GGUF BF16.
    Bf16,
    /// A signed byte `q` an element and one f32 scale `d` per 32 elements of a row: `w = d * q`.
    /// Exact for Q8_0 and Q5_0.
    Q8x32,
    /// As [`Format::Q8x32`] with a scale per 16 elements. Exact for Q6_K.
    Q8x16,
    /// Two unsigned 4-bit `q` a byte (low nibble first) and two f32 `[d, m]` per 32 elements of a
    /// row: `w = d * q - m`. Exact for Q4_K and Q4_0.
    Q4x32,
}

impl Format {
    /// Every format, in the order of the WIT `weight-format` enum.
    pub const ALL: [Format; 5] = [Format::F32, Format::Bf16, Format::Q8x32, Format::Q8x16, Format::Q4x32];

    /// Elements per scale block (1 for the float formats).
    pub fn block(self) -> u64 {
        match self {
            Format::F32 | Format::Bf16 => 1,
            Format::Q8x32 | Format::Q4x32 => 32,
            Format::Q8x16 => 16,
        }
    }

    /// Bytes of `data` for `n` elements (`n` a multiple of the block), `None` on overflow.
    pub fn data_bytes(self, n: u64) -> Option<u64> {
        match self {
            Format::F32 => n.checked_mul(4),
            Format::Bf16 => n.checked_mul(2),
            Format::Q8x32 | Format::Q8x16 => Some(n),
            Format::Q4x32 => Some(n / 2),
        }
    }

    /// Number of f32 in `scales` for `n` elements (`n` a multiple of the block).
    pub fn scale_count(self, n: u64) -> u64 {
        match self {
            Format::F32 | Format::Bf16 => 0,
            Format::Q8x32 => n / 32,
            Format::Q8x16 => n / 16,
            // `[d, m]` per block of 32.
            Format::Q4x32 => n / 16,
        }
    }

    /// The format's WIT name (`"f32"`, `"q4x32"`, ...), as error messages and `wisp bench`
    /// print it.
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Bf16 => "bf16",
            Format::Q8x32 => "q8x32",
            Format::Q8x16 => "q8x16",
            Format::Q4x32 => "q4x32",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_of_each_format_has_whole_blocks_of_bytes_and_scales() {
        for f in Format::ALL {
            let n = 64;
            assert_eq!(n % f.block(), 0);
            let bytes = f.data_bytes(n).unwrap();
            let per_element = match f {
                Format::F32 => 4.0,
                Format::Bf16 => 2.0,
                Format::Q8x32 | Format::Q8x16 => 1.0,
                Format::Q4x32 => 0.5,
            };
            assert_eq!(bytes as f64, per_element * n as f64, "{}", f.name());
            let scales_per_block = if f == Format::Q4x32 { 2 } else { 1 };
            let expected = if f.block() == 1 { 0 } else { scales_per_block * n / f.block() };
            assert_eq!(f.scale_count(n), expected, "{}", f.name());
        }
        assert_eq!(Format::F32.data_bytes(u64::MAX), None);
    }
}
