//! The kit's own reading of the upload formats of `wit/gpu.wit`: random weights in each
//! format, their decoding in f64, the reference product, and the comparison of a host's
//! answer against it; and the activations of `gated` ops.
//!
//! Tolerance: every output `y[t, n]` must satisfy
//! `|y - y_ref| <= tolerance(n_in) * ||(m[n, k] * x[t, k])_k||_2`, where `y_ref` is the exact
//! (f64) product of the decoded weights, `m[n, k]` is the magnitude of the decoded element
//! (`|d * q| + |m|` for q4x32, whose subtraction may cancel; `|w|` otherwise), and
//! `tolerance(n_in) = 1e-6 * max(sqrt(n_in), 4)`. That admits f32 decoding and f32 sums in any
//! order (their error grows about as `2^-24 * sqrt(n_in)` of that norm) and refuses f16-class
//! arithmetic (about `5e-4` of it) and any wrong decoding. Where the reference is NaN or
//! infinite, the host's value must be NaN or infinite too.

use crate::rng::Rng;

/// An upload format (the WIT `weight-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F32,
    Bf16,
    Q8x32,
    Q8x16,
    Q4x32,
}

impl Format {
    pub const ALL: [Format; 5] = [Format::F32, Format::Bf16, Format::Q8x32, Format::Q8x16, Format::Q4x32];

    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Bf16 => "bf16",
            Format::Q8x32 => "q8x32",
            Format::Q8x16 => "q8x16",
            Format::Q4x32 => "q4x32",
        }
    }

    /// Elements per scale block; `n-in` must be a multiple of it.
    pub fn block(self) -> u32 {
        match self {
            Format::F32 | Format::Bf16 => 1,
            Format::Q8x32 | Format::Q4x32 => 32,
            Format::Q8x16 => 16,
        }
    }

    /// Bytes of `data` a row of `n_in` elements takes.
    pub fn row_bytes(self, n_in: u32) -> usize {
        let n = n_in as usize;
        match self {
            Format::F32 => 4 * n,
            Format::Bf16 => 2 * n,
            Format::Q8x32 | Format::Q8x16 => n,
            Format::Q4x32 => n / 2,
        }
    }

    /// f32 values of `scales` a row of `n_in` elements takes.
    pub fn row_scales(self, n_in: u32) -> usize {
        let n = n_in as usize;
        match self {
            Format::F32 | Format::Bf16 => 0,
            Format::Q8x32 => n / 32,
            Format::Q8x16 | Format::Q4x32 => n / 16,
        }
    }
}

/// A weight matrix `W[n_out, n_in]` in an upload format: the bytes and scales sent to the host.
#[derive(Clone, Debug)]
pub struct Weight {
    pub format: Format,
    pub n_out: u32,
    pub n_in: u32,
    pub data: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Weight {
    /// A weight of random values that span each format: every q8 and q4 code, scales of both
    /// signs, bf16 and f32 values of several magnitudes. `n_in` must be a multiple of the block.
    pub fn random(format: Format, n_out: u32, n_in: u32, rng: &mut Rng) -> Weight {
        let n = n_out as usize * n_in as usize;
        let (data, scales) = match format {
            Format::F32 => {
                let data = (0..n).flat_map(|_| (rng.uniform(-1.0, 1.0) * magnitude(rng)).to_le_bytes()).collect();
                (data, Vec::new())
            }
            Format::Bf16 => {
                let data = (0..n)
                    .flat_map(|_| (((rng.uniform(-1.0, 1.0) * magnitude(rng)).to_bits() >> 16) as u16).to_le_bytes())
                    .collect();
                (data, Vec::new())
            }
            Format::Q8x32 | Format::Q8x16 => {
                let data = (0..n).map(|_| rng.next_u64() as u8).collect();
                let blocks = n / format.block() as usize;
                (data, (0..blocks).map(|_| rng.uniform(-0.02, 0.02)).collect())
            }
            Format::Q4x32 => {
                let data = (0..n / 2).map(|_| rng.next_u64() as u8).collect();
                let scales = (0..n / 32).flat_map(|_| [rng.uniform(0.0, 0.05), rng.uniform(-0.2, 0.4)]).collect();
                (data, scales)
            }
        };
        Weight { format, n_out, n_in, data, scales }
    }

    /// Rows `first..first + count` as `write-rows` takes them.
    pub fn rows(&self, first: u32, count: u32) -> (&[u8], &[f32]) {
        let (rb, rs) = (self.format.row_bytes(self.n_in), self.format.row_scales(self.n_in));
        let (a, b) = (first as usize, (first + count) as usize);
        (&self.data[a * rb..b * rb], &self.scales[a * rs..b * rs])
    }

    /// The decoded elements, row-major, with the magnitude that bounds each one's rounding.
    pub fn decode(&self) -> Decoded {
        let n = self.n_out as usize * self.n_in as usize;
        let mut w = Vec::with_capacity(n);
        let mut mag = Vec::with_capacity(n);
        for i in 0..n {
            let (v, m) = match self.format {
                Format::F32 => {
                    let b = &self.data[4 * i..4 * i + 4];
                    let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64;
                    (v, v.abs())
                }
                Format::Bf16 => {
                    let bits = u16::from_le_bytes([self.data[2 * i], self.data[2 * i + 1]]);
                    let v = f32::from_bits((bits as u32) << 16) as f64;
                    (v, v.abs())
                }
                Format::Q8x32 | Format::Q8x16 => {
                    let v = self.scales[i / self.format.block() as usize] as f64 * self.data[i] as i8 as f64;
                    (v, v.abs())
                }
                Format::Q4x32 => {
                    let q = ((self.data[i / 2] >> (4 * (i % 2))) & 0xF) as f64;
                    let (d, m) = (self.scales[2 * (i / 32)] as f64, self.scales[2 * (i / 32) + 1] as f64);
                    (d * q - m, (d * q).abs() + m.abs())
                }
            };
            w.push(v);
            mag.push(m);
        }
        Decoded { n_out: self.n_out as usize, n_in: self.n_in as usize, w, mag }
    }
}

/// A spread of magnitudes, so that float formats are checked beyond `[-1, 1]`.
fn magnitude(rng: &mut Rng) -> f32 {
    [0.01, 0.1, 1.0, 1.0, 1.0, 8.0][rng.range(0, 5) as usize]
}

/// A weight's decoded elements `w[n_out, n_in]` and their magnitudes (see the module's tolerance).
#[derive(Clone, Debug)]
pub struct Decoded {
    pub n_out: usize,
    pub n_in: usize,
    pub w: Vec<f64>,
    pub mag: Vec<f64>,
}

impl Decoded {
    /// All-zero rows `[n_out, n_in]`: a weight allocated and never written.
    pub fn zeros(n_out: u32, n_in: u32) -> Decoded {
        let n = n_out as usize * n_in as usize;
        Decoded { n_out: n_out as usize, n_in: n_in as usize, w: vec![0.0; n], mag: vec![0.0; n] }
    }

    /// Rows `first..first + count` copied from `other` (of the same shape).
    pub fn copy_rows(&mut self, other: &Decoded, first: usize, count: usize) {
        let r = first * self.n_in..(first + count) * self.n_in;
        self.w[r.clone()].copy_from_slice(&other.w[r.clone()]);
        self.mag[r.clone()].copy_from_slice(&other.mag[r]);
    }
}

/// `1e-6 * max(sqrt(n_in), 4)`: see the module's documentation.
pub fn tolerance(n_in: usize) -> f64 {
    1e-6 * (n_in as f64).sqrt().max(4.0)
}

/// How a host's output compares with the reference.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Comparison {
    /// The largest finite error, as a fraction of the norm of the terms.
    pub max_error: f64,
    /// The first output out of tolerance: `(t, n, got, want, error)`.
    pub worst: Option<(usize, usize, f32, f64, f64)>,
}

/// A product out of tolerance: what is wrong, and the largest finite error seen in it.
#[derive(Debug)]
pub struct Mismatch {
    /// The length, or the first output out of tolerance.
    pub message: String,
    /// As [`Comparison::max_error`], over the outputs compared.
    pub max_error: f64,
}

/// Compares `y[t, n_out]` from a host with `x[t, n_in] @ W^T` computed exactly. `Err` says what
/// is wrong: the length, or the first output out of tolerance.
pub fn compare(y: &[f32], x: &[f32], t: usize, w: &Decoded) -> Result<Comparison, Mismatch> {
    let (n_out, n_in) = (w.n_out, w.n_in);
    if y.len() != t * n_out {
        let message = format!("the output has {} values; t * n-out is {}", y.len(), t * n_out);
        return Err(Mismatch { message, max_error: 0.0 });
    }
    let tol = tolerance(n_in);
    let mut c = Comparison::default();
    for ti in 0..t {
        let xr = &x[ti * n_in..(ti + 1) * n_in];
        for n in 0..n_out {
            let (wr, mr) = (&w.w[n * n_in..(n + 1) * n_in], &w.mag[n * n_in..(n + 1) * n_in]);
            let mut want = 0.0f64;
            let mut norm2 = 0.0f64;
            for k in 0..n_in {
                let xk = xr[k] as f64;
                want += wr[k] * xk;
                let term = mr[k] * xk.abs();
                norm2 += term * term;
            }
            let got = y[ti * n_out + n];
            let bad = if !want.is_finite() {
                got.is_finite().then_some(f64::INFINITY)
            } else if !got.is_finite() {
                Some(f64::INFINITY)
            } else {
                let norm = norm2.sqrt();
                let diff = (got as f64 - want).abs();
                let err = if norm > 0.0 {
                    diff / norm
                } else if diff == 0.0 {
                    0.0
                } else {
                    f64::INFINITY
                };
                if err.is_finite() {
                    c.max_error = c.max_error.max(err);
                }
                (err > tol).then_some(err)
            };
            if let (Some(err), None) = (bad, &c.worst) {
                c.worst = Some((ti, n, got, want, err));
            }
        }
    }
    match c.worst {
        Some((ti, n, got, want, err)) => Err(Mismatch {
            message: format!(
                "y[{ti}, {n}] is {got:e} where the reference is {want:.7e} (error {err:.2e} of the terms' norm, tolerance {tol:.1e})"
            ),
            max_error: c.max_error,
        }),
        None => Ok(c),
    }
}

/// The activation of a gated feed-forward block, as the WIT `activation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    GeluTanh,
    Silu,
}

impl Act {
    /// The activation in f64, from the contract's words.
    pub fn apply(self, g: f64) -> f64 {
        match self {
            Act::GeluTanh => 0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh()),
            Act::Silu => g / (1.0 + (-g).exp()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The product in f32, the plain way a host would compute it.
    fn host_f32(x: &[f32], t: usize, w: &Decoded) -> Vec<f32> {
        let mut y = vec![0f32; t * w.n_out];
        for ti in 0..t {
            for n in 0..w.n_out {
                y[ti * w.n_out + n] = (0..w.n_in).map(|k| w.w[n * w.n_in + k] as f32 * x[ti * w.n_in + k]).sum();
            }
        }
        y
    }

    #[test]
    fn an_f32_host_passes_and_an_f16_host_fails() {
        let mut rng = Rng::for_case(1, "reference");
        for f in Format::ALL {
            let w = Weight::random(f, 37, 512, &mut rng);
            assert_eq!(w.data.len(), 37 * f.row_bytes(512));
            assert_eq!(w.scales.len(), 37 * f.row_scales(512));
            let d = w.decode();
            let x = rng.vector(3 * 512);
            let y = host_f32(&x, 3, &d);
            let c = compare(&y, &x, 3, &d).unwrap_or_else(|e| panic!("{}: {}", f.name(), e.message));
            assert!(c.max_error < tolerance(512) / 4.0, "{}: {c:?}", f.name());
            // Rounding every product to f16 precision (11 bits) must be caught.
            let y16: Vec<f32> = (0..3)
                .flat_map(|ti| {
                    let (d, x) = (&d, &x);
                    (0..37).map(move |n| {
                        (0..512)
                            .map(|k| {
                                let p = d.w[n * 512 + k] as f32 * x[ti * 512 + k];
                                f32::from_bits(p.to_bits() & !0x1fff)
                            })
                            .sum::<f32>()
                    })
                })
                .collect();
            let m = compare(&y16, &x, 3, &d).expect_err(f.name());
            // The failure says how far off the products were.
            assert!(m.max_error > tolerance(512), "{}: {}", f.name(), m.max_error);
        }
    }

    #[test]
    fn a_wrong_length_or_a_lost_nan_is_an_error() {
        let mut rng = Rng::for_case(2, "reference");
        let w = Weight::random(Format::F32, 4, 8, &mut rng);
        let d = w.decode();
        let mut x = rng.vector(8);
        let y = host_f32(&x, 1, &d);
        assert!(compare(&y[..3], &x, 1, &d).unwrap_err().message.contains("3 values"));
        x[2] = f32::NAN;
        assert!(compare(&y, &x, 1, &d).is_err(), "finite outputs for a NaN input");
        assert!(compare(&host_f32(&x, 1, &d), &x, 1, &d).is_ok());
    }

    #[test]
    fn q4_decodes_low_nibble_first() {
        let w = Weight { format: Format::Q4x32, n_out: 1, n_in: 32, data: vec![0x21; 16], scales: vec![0.5, 0.25] };
        let d = w.decode();
        assert_eq!(d.w[0], 0.5 * 1.0 - 0.25);
        assert_eq!(d.w[1], 0.5 * 2.0 - 0.25);
    }
}
