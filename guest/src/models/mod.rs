//! Model architectures and what they share: weight loading from GGUF, linear layers, the KV
//! cache. One file per architecture.

pub mod gemma3;

use crate::gguf::{Gguf, TensorType};
use crate::quant::{self, QMatrix};
use std::fmt;

/// Why a model could not be built from a GGUF file.
#[derive(Debug)]
pub enum LoadError {
    /// Missing or inconsistent metadata or tensors.
    Invalid(String),
    /// Well-formed but not implemented here.
    Unsupported(String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Invalid(m) | LoadError::Unsupported(m) => f.write_str(m),
        }
    }
}

pub fn invalid<T>(m: impl Into<String>) -> Result<T, LoadError> {
    Err(LoadError::Invalid(m.into()))
}

impl From<String> for LoadError {
    fn from(m: String) -> Self {
        LoadError::Invalid(m)
    }
}

/// Caps on hyperparameters: a file beyond them is refused before anything is allocated.
pub const MAX_LAYERS: u64 = 512;
pub const MAX_WIDTH: u64 = 1 << 16;
pub const MAX_HEADS: u64 = 1024;
pub const MAX_CONTEXT: u64 = 1 << 20;

/// Reads a required unsigned metadata key, checked against `1..=max`.
pub fn required_u64(g: &Gguf, key: &str, max: u64) -> Result<u64, LoadError> {
    match g.get_u64(key)? {
        None => invalid(format!("metadata {key} is missing")),
        Some(0) => invalid(format!("metadata {key} is 0")),
        Some(v) if v > max => invalid(format!("metadata {key} = {v} exceeds the cap of {max}")),
        Some(v) => Ok(v),
    }
}

/// The tensor data of `name`, checked to be `[n_out, n_in]` (GGUF order `[n_in, n_out]`).
fn tensor_data<'a>(
    g: &'a Gguf,
    file: &'a [u8],
    name: &str,
    shape: &[u64],
) -> Result<(TensorType, &'a [u8]), LoadError> {
    let Some(t) = g.tensor(name) else { return invalid(format!("tensor {name} is missing")) };
    if t.dims != shape {
        return invalid(format!(
            "tensor {name} has shape {:?}, the metadata implies {shape:?}",
            t.dims
        ));
    }
    if !quant::supported(t.kind) {
        return Err(LoadError::Unsupported(format!(
            "tensor {name} has type {}, which this engine does not compute with",
            t.kind.name()
        )));
    }
    // `Gguf::parse` checked that the data lies inside the file.
    Ok((t.kind, &file[t.offset as usize..(t.offset + t.n_bytes) as usize]))
}

/// A 1-D tensor (norm weights) as f32.
pub fn vector(g: &Gguf, file: &[u8], name: &str, n: usize) -> Result<Vec<f32>, LoadError> {
    let (kind, data) = tensor_data(g, file, name, &[n as u64])?;
    let mut out = vec![0f32; n];
    quant::dequantize(kind, data, &mut out);
    Ok(out)
}

/// The weights of a linear layer as the CPU kernels want them.
pub enum WeightData {
    Q(QMatrix),
    F32(Vec<f32>),
}

/// A linear layer `y = x @ W^T`, `W: [n_out, n_in]`.
pub struct Linear {
    pub name: String,
    pub n_out: usize,
    pub n_in: usize,
    pub w: WeightData,
    /// The GGUF type it was stored as.
    pub kind: TensorType,
    /// Index of the weight's device copy in the dispatcher, once uploaded.
    pub gpu: Option<usize>,
}

impl Linear {
    pub fn load(
        g: &Gguf,
        file: &[u8],
        name: &str,
        n_out: usize,
        n_in: usize,
    ) -> Result<Linear, LoadError> {
        let (kind, data) = tensor_data(g, file, name, &[n_in as u64, n_out as u64])?;
        let w = match QMatrix::from_blocks(kind, data, n_out, n_in) {
            Some(q) => WeightData::Q(q),
            None => {
                let mut w = vec![0f32; n_out * n_in];
                quant::dequantize(kind, data, &mut w);
                WeightData::F32(w)
            }
        };
        if n_in % quant::QK != 0 {
            return Err(LoadError::Unsupported(format!(
                "tensor {name}: width {n_in} is not a multiple of 32"
            )));
        }
        Ok(Linear { name: name.to_string(), n_out, n_in, w, kind, gpu: None })
    }

    /// Row `r` of `W` as f32 (the embedding lookup of tied embeddings).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        match &self.w {
            WeightData::Q(q) => q.row_f32(r, out),
            WeightData::F32(w) => out.copy_from_slice(&w[r * self.n_in..(r + 1) * self.n_in]),
        }
    }

    pub fn flops(&self, t: usize) -> u64 {
        2 * (t * self.n_out * self.n_in) as u64
    }
}

/// Keys and values of one layer: a ring of `cap` positions. Global layers have room for the
/// whole context; sliding-window layers for the window plus one batch, so that a batch's own
/// keys never overwrite keys its earlier queries still see.
pub struct LayerCache {
    /// `[cap, kv_dim]`
    pub k: Vec<f32>,
    /// `[cap, kv_dim]`
    pub v: Vec<f32>,
    pub cap: usize,
    pub window: Option<usize>,
}

impl LayerCache {
    pub fn new(n_ctx: usize, window: Option<usize>, batch: usize, kv_dim: usize) -> Self {
        let cap = match window {
            Some(w) => n_ctx.min(w + batch),
            None => n_ctx,
        };
        LayerCache { k: vec![0.0; cap * kv_dim], v: vec![0.0; cap * kv_dim], cap, window }
    }

    pub fn bytes(&self) -> usize {
        4 * (self.k.len() + self.v.len())
    }
}
