//! Model architectures and what they share: hyperparameters and weight loading from GGUF,
//! linear layers, the per-session scratch, the KV cache and attention (`attention`), rotary
//! embeddings (`rope`). One file per architecture, each implementing [`Architecture`] and
//! registered in one line of [`arch::REGISTRY`].

pub mod arch;
pub mod attention;
pub mod rope;

/// Declares the architectures: each is a file of `models/` (implementing [`Architecture`]) and
/// its name here, which makes its module and its line of [`REGISTRY`] (its `ARCH`).
macro_rules! architectures {
    ($($arch:ident),* $(,)?) => {
        $(pub mod $arch;)*
        /// Every architecture the engine runs, as `architectures!` lists them.
        pub const REGISTRY: &[Registered] = &[$($arch::ARCH),*];
    };
}

architectures!(gemma3, qwen2, phi3, qwen3, olmo2);

pub use arch::{ArchConfig, Architecture, Configured, Registered, State, forward};
pub use attention::LayerCache;

use crate::dispatch::{DeviceProgram, Dispatch, Pass};
use crate::program::cpu::{self, Plan, Values};
use crate::program::{Op, Program, Rows, Tensors};
use crate::gguf::{Gguf, TensorType};
use crate::quant::{self, QMatrix};
use crate::source::Source;
use crate::upload::Format;
use std::fmt;
use std::rc::Rc;

/// Why a model could not be built from a GGUF file.
#[derive(Debug)]
pub enum LoadError {
    /// Missing or inconsistent metadata or tensors.
    Invalid(String),
    /// Well-formed but not implemented here.
    Unsupported(String),
    /// The file could not be read.
    Io(String),
    /// The weights do not fit in guest memory.
    OutOfMemory(String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Invalid(m) | LoadError::Unsupported(m) | LoadError::Io(m) | LoadError::OutOfMemory(m) => f.write_str(m),
        }
    }
}

pub fn invalid<T>(m: impl Into<String>) -> Result<T, LoadError> {
    Err(LoadError::Invalid(m.into()))
}

impl From<crate::program::CheckError> for LoadError {
    /// A recipe the op core refuses: the file's tensors and metadata disagree in a way the
    /// loader did not catch.
    fn from(e: crate::program::CheckError) -> Self {
        LoadError::Invalid(format!("the model's program does not check: {e}"))
    }
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

/// The type of tensor `name` and where its data lies (`offset`, `n_bytes` in the file),
/// checked to be `shape` (GGUF order: `[n_in, n_out]` for a matrix).
fn tensor_data(g: &Gguf, name: &str, shape: &[u64]) -> Result<(TensorType, u64, u64), LoadError> {
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
    Ok((t.kind, t.offset, t.n_bytes))
}

/// A 1-D tensor (norm weights) as f32.
pub fn vector(g: &Gguf, file: &dyn Source, name: &str, n: usize) -> Result<Vec<f32>, LoadError> {
    let (kind, offset, n_bytes) = tensor_data(g, name, &[n as u64])?;
    let data = file.read(offset, n_bytes as usize)?;
    let mut out = vec![0f32; n];
    quant::dequantize(kind, &data, &mut out);
    Ok(out)
}

fn out_of_memory(name: &str, bytes: usize) -> LoadError {
    LoadError::OutOfMemory(format!("tensor {name}: {bytes} bytes of weights do not fit in guest memory"))
}

/// The weights of a linear layer: as the CPU kernels want them, or held elsewhere.
pub enum WeightData {
    Q(QMatrix),
    F32(Vec<f32>),
    /// On the device alone, in this upload format (`Linear::gpu` its id): the guest holds
    /// none of it, and only the model's program on the device reads it.
    Device(Format),
    /// Rows read from the file as they are needed: the embedding of a model whose weights are
    /// on the device (a lookup reads a token's row).
    File(FileRows),
}

/// The rows of a tensor in a file the guest keeps open: `row_bytes` each from `offset`, of
/// GGUF type `kind`.
pub struct FileRows {
    pub source: Rc<dyn Source>,
    pub kind: TensorType,
    pub offset: u64,
    pub row_bytes: usize,
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
        file: &dyn Source,
        name: &str,
        n_out: usize,
        n_in: usize,
    ) -> Result<Linear, LoadError> {
        Linear::load_rows(g, file, name, n_out, n_in, 0..n_out)
    }

    /// Rows `rows` of the tensor `name` (`[n_out, n_in]`): one part of a fused tensor, such as
    /// the queries of Phi-3's `attn_qkv`. Read and converted a piece of rows at a time, into
    /// weights allocated once.
    pub fn load_rows(
        g: &Gguf,
        file: &dyn Source,
        name: &str,
        n_out: usize,
        n_in: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Linear, LoadError> {
        let (kind, offset, n_bytes) = tensor_data(g, name, &[n_in as u64, n_out as u64])?;
        if n_in % quant::QK != 0 {
            return Err(LoadError::Unsupported(format!(
                "tensor {name}: width {n_in} is not a multiple of 32"
            )));
        }
        // GGUF stores whole rows of whole blocks.
        let (block, block_bytes) = kind.block();
        let row = n_in / block as usize * block_bytes as usize;
        if rows.is_empty() || (rows.end * row) as u64 > n_bytes {
            return invalid(format!("tensor {name} has no rows {rows:?}"));
        }
        let part = (rows.len() != n_out).then(|| format!("{name}[{}..{}]", rows.start, rows.end));
        let mut w = match file.device() {
            // The device holds it; the guest keeps nothing of it (the embedding, its rows in
            // the file for lookups).
            Some(device) => device.load(name, (kind, offset, row), n_in, rows)?,
            None => Linear::read_here(file, name, (kind, offset, row), n_in, rows)?,
        };
        if let Some(part) = part {
            w.name = part;
        }
        Ok(w)
    }

    /// Rows `rows` of the tensor `name` (`kind`, rows of `row` bytes from `offset` in `file`,
    /// checked to lie in it), `n_in` wide, into guest memory as the CPU kernels read them.
    pub fn read_here(
        file: &dyn Source,
        name: &str,
        (kind, offset, row): (TensorType, u64, usize),
        n_in: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Linear, LoadError> {
        let n_part = rows.len();
        let per_piece = (file.piece_bytes() / row.max(1)).max(1);
        let mut pieces = (rows.start..rows.end).step_by(per_piece).map(|start| start..(start + per_piece).min(rows.end));
        let read = |r: &std::ops::Range<usize>| file.read(offset + (r.start * row) as u64, r.len() * row);
        let w = if quant::qmatrix_layout(kind).is_some() {
            let convert = |piece: std::ops::Range<usize>| match QMatrix::from_blocks(kind, &read(&piece)?, piece.len(), n_in) {
                Some(q) => Ok(q),
                None => invalid(format!("tensor {name}: type {} has no block layout", kind.name())),
            };
            // `rows` is not empty (checked above): the first piece is there, and the whole
            // matrix is reserved past it.
            let mut all = convert(pieces.next().unwrap_or(rows.clone()))?;
            all.reserve_rows(n_part - all.n_out).map_err(|bytes| out_of_memory(name, bytes))?;
            for piece in pieces {
                all.append(convert(piece)?);
            }
            WeightData::Q(all)
        } else {
            let mut w = Vec::new();
            w.try_reserve_exact(n_part * n_in).map_err(|_| out_of_memory(name, 4 * n_part * n_in))?;
            w.resize(n_part * n_in, 0f32);
            for piece in pieces {
                let data = read(&piece)?;
                let at = (piece.start - rows.start) * n_in;
                quant::dequantize(kind, &data, &mut w[at..at + piece.len() * n_in]);
            }
            WeightData::F32(w)
        };
        Ok(Linear { name: name.to_string(), n_out: n_part, n_in, w, kind, gpu: None })
    }

    /// Row `r` of `W` as f32 (the embedding lookup), read from the file for rows kept there.
    /// A weight on the device alone has no row here: an error (the loader keeps the embedding
    /// where the guest reads it).
    pub fn row(&self, r: usize, out: &mut [f32]) -> Result<(), LoadError> {
        match &self.w {
            WeightData::Q(q) => q.row_f32(r, out),
            WeightData::F32(w) => out.copy_from_slice(&w[r * self.n_in..(r + 1) * self.n_in]),
            WeightData::File(f) => {
                let bytes = f.source.read(f.offset + (r * f.row_bytes) as u64, f.row_bytes)?;
                quant::dequantize(f.kind, &bytes, out);
            }
            WeightData::Device(_) => return Err(LoadError::Invalid(format!("{}: its rows are on the device alone", self.name))),
        }
        Ok(())
    }

    pub fn flops(&self, t: usize) -> u64 {
        2 * (t * self.n_out * self.n_in) as u64
    }

    /// Bytes of the weight as the CPU kernels read it.
    pub fn bytes(&self) -> usize {
        match &self.w {
            WeightData::Q(q) => q.bytes(),
            WeightData::F32(w) => 4 * w.len(),
            WeightData::Device(_) | WeightData::File(_) => 0,
        }
    }
}

/// A 1-D tensor as f32, or `None` when the file does not have it.
pub fn optional_vector(g: &Gguf, file: &dyn Source, name: &str, n: usize) -> Result<Option<Vec<f32>>, LoadError> {
    match g.tensor(name) {
        Some(_) => vector(g, file, name, n).map(Some),
        None => Ok(None),
    }
}

/// The rotation's per-frequency divisors in tensor `name` (`[n]`, n = rope_dim / 2), where the
/// file has it: Llama 3's `rope_freqs`, Phi-3.5's `rope_factors_long` / `_short`. Each must be
/// finite and positive.
pub fn rope_factors(g: &Gguf, file: &dyn Source, name: &str, n: usize) -> Result<Option<Vec<f64>>, LoadError> {
    let factors = optional_vector(g, file, name, n)?;
    match factors.iter().flatten().find(|v| !(v.is_finite() && **v > 0.0)) {
        Some(bad) => invalid(format!("{name} holds the factor {bad}")),
        None => Ok(factors.map(|f| f.into_iter().map(f64::from).collect())),
    }
}

/// Which of `n_layer` layers attend over a sliding window, as llama.cpp's `load_swa_pattern`
/// reads `{arch}.attention.sliding_window_pattern`: a flag a layer, or a number `n` (the layers
/// with `l % n < n - 1`; 0: all of them), `default` where missing.
pub fn sliding_layers(g: &Gguf, arch: &str, n_layer: usize, default: u64) -> Result<Vec<bool>, LoadError> {
    let key = format!("{arch}.attention.sliding_window_pattern");
    if let Ok(Some(crate::gguf::Array::Bool(flags))) = g.get_array(&key) {
        if flags.len() != n_layer {
            return invalid(format!("{key} has {} flags for {n_layer} layers", flags.len()));
        }
        return Ok(flags.clone());
    }
    let n = g.get_u64(&key)?.unwrap_or(default) as usize;
    Ok((0..n_layer).map(|l| n == 0 || l % n < n - 1).collect())
}

/// YaRN's rotation scaling (Peng et al. 2023; `rope.scaling.type = "yarn"`), as ggml's
/// `rope_yarn` and llama.cpp's context read it: frequency `j` interpolated (divided by `factor`)
/// below the band `[low, high]` of frequencies, extrapolated (kept) above it, blended linearly
/// within; the cosines and sines times `1 + 0.1 ln(factor)` (over the same with
/// `yarn_log_multiplier`, where the file has one).
#[derive(Debug, Clone, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.factor`, at least 1.
    pub factor: f64,
    /// `rope.scaling.original_context_length` (the training context where missing).
    pub original_context: usize,
    /// `rope.scaling.yarn_beta_fast` (32) and `_slow` (1): the band's ends, in turns over the
    /// original context.
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// `rope.scaling.yarn_ext_factor` (1): how much of the blend is extrapolation.
    pub ext_factor: f64,
    /// `rope.scaling.yarn_log_multiplier` (0: none).
    pub log_mul: f64,
}

impl Yarn {
    /// YaRN on frequencies `f` of `dim` rotated values (their factors, if any, divide first).
    pub fn apply(&self, f: &mut rope::Freqs, dim: usize) {
        let (n, interp) = (dim as f64, 1.0 / self.factor);
        // The frequency that turns `beta` times over the original context.
        let corr = |beta: f64| n * (self.original_context as f64 / (beta * 2.0 * core::f64::consts::PI)).ln() / (2.0 * f.base.ln());
        let low = corr(self.beta_fast).floor().max(0.0);
        let high = corr(self.beta_slow).ceil().min(n - 1.0);
        let divisors = (0..dim / 2)
            .map(|j| {
                let y = (j as f64 - low) / (high - low).max(0.001);
                let ramp = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
                f.factors.as_ref().map_or(1.0, |v| v[j]) / (interp * (1.0 - ramp) + ramp)
            })
            .collect();
        f.factors = Some(divisors);
        if self.ext_factor != 0.0 {
            let mscale = |m: f64| if self.factor <= 1.0 { 1.0 } else { 0.1 * m * self.factor.ln() + 1.0 };
            f.mscale *= if self.log_mul != 0.0 { mscale(1.0) / mscale(self.log_mul) } else { mscale(1.0) };
        }
    }
}

/// The hyperparameters every decoder-only transformer here has, read from the keys
/// `{arch}.*` of the GGUF metadata and checked against the caps above.
#[derive(Debug, Clone)]
pub struct Hparams {
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Values of each query and key head that the rotation turns, the first ones: the head
    /// size, or fewer (`rope.dimension_count`).
    pub rope_dim: usize,
    pub n_ctx_train: usize,
    pub eps: f32,
    pub rope_base: f64,
    /// Linear position scaling (`rope.scaling.factor` of `linear`); 1 is none.
    pub rope_scale: f64,
    /// YaRN's scaling, where the file asks for it.
    pub yarn: Option<Yarn>,
}

impl Hparams {
    /// `rope_base` is the architecture's default for a missing `rope.freq_base`.
    pub fn from_gguf(g: &Gguf, arch: &str, rope_base: f64) -> Result<Hparams, LoadError> {
        let key = |k: &str| format!("{arch}.{k}");
        // Mixtral-style files name the `llama` architecture (Mistral 3's MoE ones `mistral3`):
        // their experts say so here, before a missing `ffn_gate` would.
        if let Some(n) = g.get_u64(&key("expert_count"))?.filter(|&n| n > 0) {
            return Err(LoadError::Unsupported(format!("a mixture of experts ({arch}.expert_count = {n})")));
        }
        let n_embd = required_u64(g, &key("embedding_length"), MAX_WIDTH)? as usize;
        let n_layer = required_u64(g, &key("block_count"), MAX_LAYERS)? as usize;
        let n_ff = required_u64(g, &key("feed_forward_length"), MAX_WIDTH * 8)? as usize;
        let n_head = required_u64(g, &key("attention.head_count"), MAX_HEADS)? as usize;
        let n_head_kv = match g.get_u64(&key("attention.head_count_kv"))? {
            None => n_head,
            Some(v) if v == 0 || !(n_head as u64).is_multiple_of(v) => {
                return invalid(format!(
                    "attention.head_count_kv = {v} does not divide head_count = {n_head}"
                ));
            }
            Some(v) => v as usize,
        };
        let head_dim = match g.get_u64(&key("attention.key_length"))? {
            Some(v) if v > 0 && v <= MAX_WIDTH && v % 2 == 0 => v as usize,
            Some(v) => return invalid(format!("attention.key_length {v} is not a usable head size")),
            None if n_embd % n_head == 0 && (n_embd / n_head) % 2 == 0 => n_embd / n_head,
            None => {
                return invalid(format!(
                    "attention.head_count {n_head} does not divide embedding_length {n_embd} \
                     into heads of even size, and attention.key_length is missing"
                ));
            }
        };
        // Bounds every product of widths the session computes, in 32 bits too.
        if n_head * head_dim > MAX_WIDTH as usize {
            return invalid(format!(
                "attention width {n_head} heads x {head_dim} exceeds the cap of {MAX_WIDTH}"
            ));
        }
        if let Some(v) = g.get_u64(&key("attention.value_length"))? {
            if v != head_dim as u64 {
                return Err(LoadError::Unsupported(format!(
                    "value_length {v} differs from key_length {head_dim}"
                )));
            }
        }
        // Partial rotation (Phi-4-mini: 96 of 128): the first `rope_dim` values of each head turn.
        let rope_dim = match g.get_u64(&key("rope.dimension_count"))? {
            None => head_dim,
            Some(v) if v >= 2 && v % 2 == 0 && v <= head_dim as u64 => v as usize,
            Some(v) => {
                return invalid(format!(
                    "rope.dimension_count {v} is not an even count of at most the head size {head_dim}"
                ));
            }
        };
        let n_ctx_train = match g.get_u64(&key("context_length"))? {
            Some(v) if v > 0 => v.min(MAX_CONTEXT) as usize,
            _ => 8192,
        };
        let eps = g.get_f64(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6) as f32;
        let rope_base = g.get_f64(&key("rope.freq_base"))?.unwrap_or(rope_base);
        let factor = g.get_f64(&key("rope.scaling.factor"))?.unwrap_or(1.0);
        let (rope_scale, yarn) = match g.get_str(&key("rope.scaling.type"))? {
            None | Some("none") => (1.0, None),
            Some("linear") => (factor, None),
            Some("yarn") => {
                let read = |k: &str, default: f64| -> Result<f64, LoadError> {
                    match g.get_f64(&key(k))?.unwrap_or(default) {
                        v if v.is_finite() && (0.0..1e6).contains(&v) => Ok(v),
                        v => invalid(format!("{arch}.{k} = {v} is not a usable YaRN parameter")),
                    }
                };
                let original_context = match g.get_u64(&key("rope.scaling.original_context_length"))? {
                    Some(v) if v > 0 => v.min(MAX_CONTEXT) as usize,
                    _ => n_ctx_train,
                };
                let yarn = Yarn {
                    factor: read("rope.scaling.factor", 1.0)?,
                    original_context,
                    beta_fast: read("rope.scaling.yarn_beta_fast", 32.0)?,
                    beta_slow: read("rope.scaling.yarn_beta_slow", 1.0)?,
                    ext_factor: read("rope.scaling.yarn_ext_factor", 1.0)?,
                    log_mul: read("rope.scaling.yarn_log_multiplier", 0.0)?,
                };
                if !(yarn.factor >= 1.0 && yarn.beta_fast > 0.0 && yarn.beta_slow > 0.0) {
                    return invalid(format!("implausible YaRN scaling: {yarn:?}"));
                }
                (1.0, Some(yarn))
            }
            Some(other) => {
                return Err(LoadError::Unsupported(format!("rope scaling {other:?}")));
            }
        };
        let token_embd = g.tensor("token_embd.weight");
        let n_vocab = match token_embd.map(|t| t.dims.as_slice()) {
            Some([e, v]) if *e == n_embd as u64 && *v > 0 && *v <= u32::MAX as u64 / 2 => {
                *v as usize
            }
            Some(d) => {
                return invalid(format!(
                    "token_embd.weight has shape {d:?}, expected [{n_embd}, n_vocab]"
                ));
            }
            None => return invalid("tensor token_embd.weight is missing"),
        };
        if !(eps > 0.0 && eps < 1.0) || !(rope_base > 1.0) || !(rope_scale >= 1.0) {
            return invalid(format!(
                "implausible hyperparameters: eps {eps}, rope base {rope_base}, rope scale {rope_scale}"
            ));
        }
        Ok(Hparams {
            n_vocab,
            n_embd,
            n_layer,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            rope_dim,
            n_ctx_train,
            eps,
            rope_base,
            rope_scale,
            yarn,
        })
    }

    /// The rotation's frequencies: the file's base, its linear or YaRN scaling, the
    /// per-frequency divisors `factors` (`[rope_dim / 2]`) where the file has them.
    pub fn freqs(&self, factors: Option<Vec<f64>>) -> rope::Freqs {
        let mut f = rope::Freqs { factors, ..rope::Freqs::new(self.rope_base, self.rope_scale) };
        if let Some(y) = &self.yarn {
            y.apply(&mut f, self.rope_dim);
        }
        f
    }

    /// Bytes of KV cache per token of context (f32 keys and values, every layer).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.n_layer * 2 * 4 * self.n_head_kv * self.head_dim
    }
}

/// A session's scratch for batches of up to `batch` tokens, allocated once.
pub struct Scratch {
    /// `[n_ctx]`: attention scores of one query head.
    pub scores: Vec<f32>,
    /// `[n_vocab]`: logits after the last token (empty in a state that gives none).
    pub logits: Vec<f32>,
}

impl Scratch {
    pub fn new(n_ctx: usize, n_logits: usize) -> Scratch {
        Scratch {
            scores: vec![0.0; n_ctx],
            logits: vec![0.0; n_logits],
        }
    }

    pub fn bytes(&self) -> usize {
        let n = self.scores.len() + self.logits.len();
        4 * n
    }
}

/// `x[i, :] = embd[tokens[i], :]`, `x: [t, n_embd]`. Fails only where the rows are read from
/// the file (a model whose weights are on the device) and the file no longer reads.
pub fn embed(embd: &Linear, tokens: &[u32], x: &mut [f32]) -> Result<(), LoadError> {
    for (row, &tok) in x.chunks_exact_mut(embd.n_in).zip(tokens) {
        embd.row(tok as usize, row)?;
    }
    Ok(())
}

/// A model's recipe, made at load: the program ([`Architecture::recipe`]), where its values live
/// on the guest's CPU, and its copy on the device where there is one.
#[derive(Default)]
pub struct Recipe {
    pub program: Program,
    pub plan: Plan,
    pub device: Option<DeviceProgram>,
    /// The floating-point operations of the products of one token row through every layer
    /// (the products of token rows: all but the output projection, which reads the sequences'
    /// last rows).
    row_flops: u64,
    /// The rotations of its tables (its inputs after the embeddings), in order: fixed for the
    /// model, read by every pass.
    pub freqs: Vec<rope::Freqs>,
}

impl Recipe {
    pub fn new(program: Program, freqs: Vec<rope::Freqs>) -> Recipe {
        let plan = Plan::new(&program);
        let row_flops = program
            .ops
            .iter()
            .filter_map(|op| match *op {
                Op::Matmul { x, weight, .. } if program.rows(x) == Rows::Token => {
                    let (n_out, n_in) = program.weights[weight].dims;
                    Some(2 * n_out as u64 * n_in as u64)
                }
                _ => None,
            })
            .sum();
        Recipe { program, plan, device: None, row_flops, freqs }
    }

    /// The products of a pass of `t` token rows through every layer, in floating-point
    /// operations (the output projection apart).
    pub fn flops(&self, t: usize) -> u64 {
        self.row_flops * t as u64
    }
}

/// What a session holds for its passes through the recipe.
pub struct PassState<'a> {
    pub caches: &'a mut [LayerCache],
    /// Made at the first pass on the CPU, for runs of `batch` rows.
    pub values: &'a mut Option<Values>,
    pub batch: usize,
    pub buf: &'a mut Scratch,
}

/// A pass of `tokens` (at positions `pos..`) through a model's recipe: the model's program on
/// the device as one run, where the device has it and the dispatcher sends the batch there (see
/// `Dispatch::run_program`), else the guest's CPU. The recipe's inputs are the tokens'
/// embeddings (rows of `embd`) and the rotation `tables`, in order; the logits, when wanted
/// (`Want::Logits`), go to `buf.logits` (through the program's head product where the device
/// does not hold it), or, for a greedy step the device ran in its `top` form, its token to
/// `Dispatch::top` (`buf.logits` then stale); a recipe whose output has token rows (the
/// embedding's, `embedding::hidden_program`) appends them to `Want::Rows`. `Ok(false)`, with nothing run, as `<arch>::forward` says; an
/// error where the device alone holds the weights and did not run the pass (see
/// `Dispatch::held_on_device`), or the embedding's rows no longer read from the file.
#[allow(clippy::too_many_arguments)]
pub fn recipe_pass(
    w: &dyn Tensors,
    r: &Recipe,
    (embd, tables): (&Linear, &[&rope::Table]),
    st: PassState<'_>,
    d: &mut Dispatch,
    h: &Hparams,
    flops: u64,
    (tokens, pos, mut want): (&[u32], usize, Want<'_>),
) -> Result<bool, LoadError> {
    let t = tokens.len();
    let want_logits = matches!(want, Want::Logits);
    if let Some(prog) = &r.device {
        let mut inputs = vec![vec![0.0; t * h.n_embd]];
        embed(embd, tokens, &mut inputs[0])?;
        inputs.extend(tables.iter().map(|table| table.rows(t)));
        let head = prog.head.map(|id| w.matrix(id));
        let out_len = match &want {
            Want::Rows(_) => t * r.program.width(r.program.outputs[0]),
            _ => head.map_or(h.n_vocab, |m| m.n_in),
        };
        let kv = h.n_head_kv * h.head_dim;
        if let Some(pass) = d.run_program(prog, &inputs, (t, pos), st.caches, kv, flops, out_len) {
            if let (Pass::Rows(out), Want::Rows(rows)) = (&pass, &mut want) {
                rows.extend_from_slice(out);
                return Ok(true);
            }
            match (pass, want_logits, head) {
                (Pass::Top(token), ..) => d.top = Some(token),
                (Pass::Rows(out), true, Some(m)) => {
                    let start = std::time::Instant::now();
                    d.matmul(&out, 1, &mut [(m, &mut st.buf.logits)]);
                    d.counters.output_ns += start.elapsed().as_nanos() as u64;
                }
                (Pass::Rows(out), true, None) => st.buf.logits.copy_from_slice(&out),
                (Pass::Rows(_), false, _) => {}
            }
            return Ok(true);
        }
    }
    if !d.ring_holds(pos) {
        return Ok(false);
    }
    if let Some(e) = d.held_on_device() {
        return Err(e);
    }
    // The embedding is in guest memory here (the CPU holds the weights): its rows read.
    let mut failed = None;
    let mut input = |i: usize, out: &mut [f32]| match i {
        0 => {
            if let Err(e) = embed(embd, tokens, out) {
                failed.get_or_insert(e);
            }
        }
        i => tables[i - 1].write_rows(t, out),
    };
    let mut seq = [cpu::Seq { t, pos, outputs: !matches!(want, Want::Nothing), caches: st.caches, d: 0 }];
    let values = st.values.get_or_insert_with(|| Values::new(&r.program, &r.plan, st.batch, 1));
    cpu::run(&r.program, &r.plan, w, &mut [d], values, &mut st.buf.scores, &mut seq, &mut input);
    if let Some(e) = failed {
        return Err(e);
    }
    match want {
        Want::Logits => st.buf.logits.copy_from_slice(values.get(&r.program, &r.plan, r.program.outputs[0], 1)),
        Want::Rows(rows) => rows.extend_from_slice(values.get(&r.program, &r.plan, r.program.outputs[0], t)),
        Want::Nothing => {}
    }
    Ok(true)
}

/// What a pass through a recipe ([`recipe_pass`]) gives back.
pub enum Want<'a> {
    /// Only the keys and values (a prompt's rows before its last).
    Nothing,
    /// The logits after the last token.
    Logits,
    /// Every token row of the program's output, appended here (a recipe whose output has
    /// token rows).
    Rows(&'a mut Vec<f32>),
}
