//! A loaded model: parsed header, tokenizer, architecture and weights. Independent of the
//! component bindings, so that it is tested natively too.

use crate::chat;
use crate::constraint::Grammars;
use crate::dispatch::{self, Device, DeviceLimits, Gpu, Mode};
use crate::gguf::{Gguf, GgufError};
use crate::models::{Architecture, Hparams, Linear, LoadError, Recipe, arch, rope};
use crate::program::Tensors;
use crate::quant::QMatrix;
use crate::source::Source;
use crate::tokenizer::Tokenizer;
use crate::session::StepScratch;
use crate::upload::Streaming;
use std::cell::{OnceCell, RefCell};
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;

/// An engine failure, mapped one to one onto the WIT `error` variant.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    InvalidModel(String),
    Unsupported(String),
    Io(String),
    InvalidArgument(String),
    ContextFull(String),
    OutOfMemory(String),
    InvalidConstraint(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidModel(m) => write!(f, "invalid model: {m}"),
            Error::Unsupported(m) => write!(f, "unsupported: {m}"),
            Error::Io(m) => write!(f, "i/o: {m}"),
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::ContextFull(m) => write!(f, "context full: {m}"),
            Error::OutOfMemory(m) => write!(f, "out of memory: {m}"),
            Error::InvalidConstraint(m) => write!(f, "invalid constraint: {m}"),
        }
    }
}

impl From<GgufError> for Error {
    fn from(e: GgufError) -> Self {
        Error::InvalidModel(e.to_string())
    }
}

impl From<LoadError> for Error {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::Invalid(m) => Error::InvalidModel(m),
            LoadError::Unsupported(m) => Error::Unsupported(m),
            LoadError::Io(m) => Error::Io(m),
            LoadError::OutOfMemory(m) => Error::OutOfMemory(m),
        }
    }
}

/// What a pass of a model's recipe on the guest's CPU reads: its weights, its recipe, the
/// embedding of its first input, and the rotations of its tables (its other inputs, in order).
pub struct PassParts<'a> {
    pub weights: &'a dyn Tensors,
    pub recipe: &'a Recipe,
    pub embd: &'a Linear,
    pub freqs: &'a [rope::Freqs],
}

/// What `info` reports, gathered at load.
pub struct Summary {
    pub architecture: String,
    pub name: String,
    pub n_params: u64,
    pub n_layers: u32,
    pub n_embd: u32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
    pub file_bytes: u64,
    /// (name, type, dims, bytes)
    pub tensors: Vec<(String, &'static str, Vec<u64>, u64)>,
    pub metadata: Vec<(String, String)>,
}

pub struct Model {
    /// The architecture's model (`models::REGISTRY`).
    pub arch: Box<dyn Architecture>,
    /// Its recipe, made at load, and its copy on the device where there is one.
    pub recipe: Recipe,
    pub tokenizer: Arc<Tokenizer>,
    pub summary: Summary,
    /// The host's device, when the mode allows it and the host has one.
    pub gpu: Option<Rc<Gpu>>,
    /// Weights resident on the device.
    pub gpu_weights: usize,
    /// The chat template (the file's, or a built-in one for a known family), if any.
    pub chat_template: Option<chat::Template>,
    /// The vocabulary as the constraint compiler sees it, built on the first constraint.
    grammars: OnceCell<Result<Grammars, String>>,
    /// What batched steps of its sessions keep between them (`session::step`).
    pub step_scratch: RefCell<StepScratch>,
    /// The recipe of its hidden states (`embedding`), made by the first embedding.
    pub(crate) embedding: OnceCell<Result<Recipe, String>>,
}

/// The device a model may use, as the component hands it over.
pub struct DeviceOffer {
    pub mode: Mode,
    pub device: Box<dyn Device>,
    pub limits: DeviceLimits,
    /// The weights live on the device alone even where the guest could hold them (else only
    /// a model past the guest's memory does).
    pub weights_on_device: bool,
}

/// Whether `device` makes a `kv-cache` (a one-slot probe, freed again): where it does not, the
/// model's program cannot run there over a session's keys and values, and the guest keeps the
/// weights.
fn runs_programs_over_caches(device: &dyn Device) -> bool {
    match device.create_kv_cache(1, 8) {
        Ok(id) => {
            device.free_kv_cache(id);
            true
        }
        Err(_) => false,
    }
}

/// Whether `n` bytes can be allocated now, without aborting when they cannot.
pub fn can_allocate(n: usize) -> bool {
    let mut v: Vec<u8> = Vec::new();
    v.try_reserve_exact(n).is_ok()
}

impl Model {
    /// What a pass of the recipe on the guest's CPU reads.
    pub fn pass_parts(&self) -> PassParts<'_> {
        PassParts { weights: self.arch.tensors(), recipe: &self.recipe, embd: self.arch.embd(), freqs: &self.recipe.freqs }
    }

    /// Builds a model from a whole GGUF file, CPU only.
    pub fn load(file: &[u8]) -> Result<Model, Error> {
        Model::load_with(file, None)
    }

    /// Builds a model from a whole GGUF file and places its weights on `offer`'s device as
    /// its mode wants.
    pub fn load_with(file: &[u8], offer: Option<DeviceOffer>) -> Result<Model, Error> {
        Model::load_from(Gguf::parse(file)?, &file, offer)
    }

    /// Builds a model from the GGUF file `file` whose header is `g` (`Source::header`),
    /// reading its tensors a piece at a time.
    pub fn load_from(mut g: Gguf, file: &dyn Source, offer: Option<DeviceOffer>) -> Result<Model, Error> {
        let architecture = g
            .get_str("general.architecture")
            .map_err(Error::InvalidModel)?
            .ok_or_else(|| Error::InvalidModel("general.architecture is missing".into()))?
            .to_string();
        // The converted weights take what their block layouts take, and four bytes a value
        // (f32) for float formats: refuse early, with a message, what cannot fit rather than
        // trap half way. (The test allocation stays in the guest's memory, which never shrinks,
        // and the weights then fill it: it must not be larger than they are.)
        let n_params: u64 = g.tensors.iter().map(|t| t.n_elements).sum();
        let need = g
            .tensors
            .iter()
            .map(|t| {
                let n_in = t.dims.first().copied().unwrap_or(1).max(1);
                usize::try_from(n_in)
                    .ok()
                    .and_then(|n_in| QMatrix::converted_bytes(t.kind, usize::try_from(t.n_elements / n_in as u64).ok()?, n_in))
                    .unwrap_or(t.n_elements.saturating_mul(4))
            })
            .fold(0, u64::saturating_add);
        // A model the guest cannot hold lives on the device, where one is offered (or where the
        // offer asks for it): its matrices go there as they are read, the guest keeping none.
        // With `On`, a device that can hold every matrix and runs programs over kv-caches holds
        // them alone too: the whole model runs there, and a copy in the guest would only cap
        // the model's size and the guest's memory.
        let offer = offer.filter(|o| o.mode != Mode::Off);
        let guest = || format!("the model's {n_params} parameters need about {} MiB of guest memory", need >> 20);
        let fits = || need <= usize::MAX as u64 && can_allocate(need as usize);
        let (on_device, largest) = g
            .tensors
            .iter()
            .filter_map(|t| match t.dims.as_slice() {
                [n_in, n_out] => Some(crate::upload::device_sizes(t.kind, *n_out, *n_in)),
                _ => None,
            })
            .fold((0u64, 0u64), |(sum, max), (data, scales)| (sum.saturating_add(data).saturating_add(scales), max.max(data).max(scales)));
        // Chosen before the guest's room is tried: trying it grows the guest's memory (which
        // never shrinks) to the weights' size.
        let chosen = offer.as_ref().is_some_and(|o| {
            o.mode == Mode::On
                && !o.weights_on_device
                && on_device <= o.limits.budget_bytes
                && largest <= o.limits.max_weight_bytes
                && runs_programs_over_caches(o.device.as_ref())
        });
        let forced = !chosen
            && match &offer {
                Some(o) => o.weights_on_device || !fits(),
                None if fits() => false,
                None => return Err(Error::OutOfMemory(format!("{}, past its limit, and no device is offered to hold them", guest()))),
            };
        if let Some(o) = offer.as_ref().filter(|_| forced) {
            if on_device > o.limits.budget_bytes {
                let why = if o.weights_on_device { "the weights go to the device".to_string() } else { format!("{}, past its limit", guest()) };
                return Err(Error::OutOfMemory(format!(
                    "{why}, and they need about {} MiB on the device, past its budget of {} MiB",
                    on_device >> 20,
                    o.limits.budget_bytes >> 20
                )));
            }
        }
        let owns = forced || chosen;
        let tokenizer = Tokenizer::from_gguf(&g).map_err(|m| {
            if m.starts_with("unsupported") { Error::Unsupported(m) } else { Error::InvalidModel(m) }
        })?;
        let check_vocab = |hp: &Hparams| {
            if hp.n_vocab == tokenizer.n_vocab() {
                return Ok(());
            }
            Err(Error::InvalidModel(format!(
                "the embedding has {} rows, the vocabulary {} tokens",
                hp.n_vocab,
                tokenizer.n_vocab()
            )))
        };
        // What the model needs of the metadata is read before its weights; the metadata (a
        // large vocabulary's arrays take tens of MB) is then freed for the weights to take its
        // place in the guest's memory, which never shrinks.
        let registered = arch::find(&architecture).ok_or_else(|| Error::Unsupported(format!("architecture {architecture:?}")))?;
        let config = (registered.config)(&g, &architecture)?;
        // A second reading, for the guest's own copy where the device refuses what it chose
        // to hold (the metadata is gone by then).
        let spare = if chosen { Some((registered.config)(&g, &architecture)?) } else { None };
        check_vocab(config.hparams())?;
        let chat_template = chat::Template::from_gguf(&g, &tokenizer).map_err(Error::InvalidModel)?;
        let name = g.get_str("general.name").ok().flatten().unwrap_or_default().to_string();
        let metadata = g.metadata.iter().map(|(k, v)| (k.clone(), v.render(8))).collect();
        g.forget_metadata();
        let mut gpu = offer.map(|o| Rc::new(Gpu::new(o.device, o.mode, o.limits, owns)));
        let streaming = gpu.as_ref().filter(|_| owns).map(|gpu| {
            let tied = g.tensor("output.weight").is_none();
            Streaming::new(file, gpu.device.as_ref(), tied, gpu.limits.max_weight_bytes)
        });
        // What went to the device is freed again where the load fails after it.
        let loaded = Model::load_weights(config, &g, streaming.as_ref().map_or(file, |s| s as &dyn Source), gpu.clone());
        let refused = streaming.as_ref().is_some_and(|s| s.device_refused());
        if loaded.is_err() {
            if let Some(s) = &streaming {
                s.release();
            }
        }
        drop(streaming);
        // The device, chosen to hold the weights alone, refused them or their program: the
        // guest reads them again and keeps its own copy, as `On` did before (the device still
        // runs what it takes). A bad file fails as it would have.
        let loaded = match (loaded, spare) {
            (Err(e), Some(config)) if (refused || matches!(e, Error::Unsupported(_))) && fits() => match gpu.take().map(Rc::try_unwrap) {
                Some(Ok(o)) => {
                    gpu = Some(Rc::new(Gpu::new(o.device, o.mode, o.limits, false)));
                    Model::load_weights(config, &g, file, gpu.clone())
                }
                _ => Err(e),
            },
            (loaded, _) => loaded,
        };
        let (arch, recipe, gpu_weights) = loaded?;
        let tokenizer = Arc::new(tokenizer);
        let summary = Summary {
            name,
            architecture,
            n_params,
            n_layers: arch.hparams().n_layer as u32,
            n_embd: arch.hparams().n_embd as u32,
            n_vocab: arch.hparams().n_vocab as u32,
            n_ctx_train: arch.hparams().n_ctx_train as u32,
            file_bytes: file.len(),
            tensors: g.tensors.iter().map(|t| (t.name.clone(), t.kind.name(), t.dims.clone(), t.n_bytes)).collect(),
            metadata,
        };
        Ok(Model { arch, recipe, tokenizer, summary, gpu, gpu_weights, chat_template, grammars: OnceCell::new(), step_scratch: Default::default(), embedding: OnceCell::new() })
    }

    /// Reads the weights of the architecture `config` from `file` (the device's where the
    /// weights live there alone, `Gpu::owns`), makes the recipe and places what goes on `gpu`.
    /// Returns the model's architecture, its recipe and how many matrices the device holds.
    fn load_weights(config: Box<dyn arch::Configured>, g: &Gguf, file: &dyn Source, gpu: Option<Rc<Gpu>>) -> Result<(Box<dyn Architecture>, Recipe, usize), Error> {
        let owns = gpu.as_ref().is_some_and(|g| g.owns);
        let mut arch = config.load(g, file)?;
        let mut recipe = Recipe::new(arch.recipe().map_err(LoadError::from)?, arch.freqs());
        let gpu_weights = match &gpu {
            Some(_) if owns => arch.linears_mut().iter().filter(|w| w.gpu.is_some()).count(),
            Some(gpu) => dispatch::place(gpu, &mut arch.linears_mut()),
            None => 0,
        };
        // The device's whole-model path, where it holds every product: the model's program.
        if let Some(gpu) = gpu.as_ref().filter(|_| gpu_weights > 0) {
            recipe.device = dispatch::place_program(gpu, &recipe.program, arch.tensors(), arch.hparams().n_layer, true);
        }
        if owns && recipe.device.as_ref().is_none_or(|p| p.head.is_some()) {
            return Err(Error::Unsupported("the device holds the model's weights but does not run its program".into()));
        }
        Ok((arch, recipe, gpu_weights))
    }

    /// The constraint compiler of this model's vocabulary (`unsupported` without an
    /// end-of-generation token).
    pub fn grammars(&self) -> Result<&Grammars, Error> {
        self.grammars.get_or_init(|| Grammars::new(&self.tokenizer)).as_ref().map_err(|m| Error::Unsupported(m.clone()))
    }

    /// Whether the device alone holds the model's weights (the guest could not): its sessions'
    /// keys and values live there too, and a pass the device does not run fails.
    pub fn on_device(&self) -> bool {
        self.gpu.as_ref().is_some_and(|g| g.owns)
    }

    pub fn n_vocab(&self) -> usize {
        self.tokenizer.n_vocab()
    }

    pub fn n_ctx_train(&self) -> usize {
        self.summary.n_ctx_train as usize
    }
}
