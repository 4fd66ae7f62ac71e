//! Rotary position embeddings (RoPE, Su et al. 2021): per batch, a table of cosines and sines
//! for each position and frequency, then a rotation of every query and key head.

/// Which elements of a head rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// `(x[j], x[j + half])`: GPT-NeoX, Gemma, Qwen2 (llama.cpp's `ROPE_TYPE_NEOX`).
    Neox,
    /// `(x[2j], x[2j + 1])`: Llama as converted to GGUF (llama.cpp's `ROPE_TYPE_NORM`).
    Norm,
}

/// The frequencies of one kind of layer: `theta(p, j) = p / scale * base^(-2j / dim) / factor[j]`.
#[derive(Debug, Clone)]
pub struct Freqs {
    pub base: f64,
    /// Linear position scaling (`rope.scaling.factor`); 1 is none.
    pub scale: f64,
    /// Per-frequency divisors (`rope_freqs.weight`, Llama 3's long-context scaling), `[dim / 2]`.
    pub factors: Option<Vec<f32>>,
}

/// `cos, sin: [batch, dim / 2]` for the positions of one batch.
pub struct Table {
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// `base^(-2j / dim)` of the last fill, `[dim / 2]`: one `powf` a frequency, not one a
    /// (position, frequency) pair.
    freq: Vec<f64>,
    dim: usize,
}

impl Table {
    pub fn new(batch: usize, dim: usize) -> Table {
        Table { cos: vec![0.0; batch * dim / 2], sin: vec![0.0; batch * dim / 2], freq: vec![0.0; dim / 2], dim }
    }

    pub fn bytes(&self) -> usize {
        4 * (self.cos.len() + self.sin.len()) + 8 * self.freq.len()
    }

    /// Fills the rows of positions `pos..pos + t`.
    pub fn fill(&mut self, f: &Freqs, pos: usize, t: usize) {
        let (dim, half) = (self.dim, self.dim / 2);
        for (j, freq) in self.freq.iter_mut().enumerate() {
            *freq = f.base.powf(-2.0 * j as f64 / dim as f64);
        }
        for i in 0..t {
            let p = (pos + i) as f64 / f.scale;
            for j in 0..half {
                let mut theta = p * self.freq[j];
                if let Some(factors) = &f.factors {
                    theta /= factors[j] as f64;
                }
                self.cos[i * half + j] = theta.cos() as f32;
                self.sin[i * half + j] = theta.sin() as f32;
            }
        }
    }

    /// Rotates one head (`[dim]`) of the batch's `i`-th token.
    pub fn rotate(&self, style: Style, i: usize, x: &mut [f32]) {
        let half = self.dim / 2;
        let (cos, sin) = (&self.cos[i * half..(i + 1) * half], &self.sin[i * half..(i + 1) * half]);
        match style {
            Style::Neox => {
                let (a, b) = x.split_at_mut(half);
                for j in 0..half {
                    let (x0, x1) = (a[j], b[j]);
                    a[j] = x0 * cos[j] - x1 * sin[j];
                    b[j] = x0 * sin[j] + x1 * cos[j];
                }
            }
            Style::Norm => {
                for (j, pair) in x.chunks_exact_mut(2).enumerate() {
                    let (x0, x1) = (pair[0], pair[1]);
                    pair[0] = x0 * cos[j] - x1 * sin[j];
                    pair[1] = x0 * sin[j] + x1 * cos[j];
                }
            }
        }
    }
}
