//! What every architecture is to the engine: a trait that each file of `models/` implements
//! ([`ArchConfig`]: its metadata, weights, recipe, rotations and windows; loaded, an
//! [`Architecture`], and [`Configured`] for the step before its weights are read), its name in
//! `models`' list of architectures (`architectures!`, which makes [`super::REGISTRY`], looked up
//! by the GGUF's `general.architecture`), and the one per-session [`State`] and pass
//! ([`forward`]) they all share. Adding an architecture is its file and its name in that list.

use super::attention::LayerCache;
use super::rope;
use super::{Hparams, Linear, LoadError, PassState, REGISTRY, Recipe, Scratch, Want, recipe_pass};
use crate::dispatch::Dispatch;
use crate::gguf::Gguf;
use crate::program::cpu::Values;
use crate::program::{CheckError, Program, Tensors};
use crate::source::Source;

/// A model of one architecture, as loaded: its hyperparameters, its weights as its recipe names
/// them, and its recipe.
pub trait Architecture {
    /// The hyperparameters every decoder here has.
    fn hparams(&self) -> &Hparams;
    /// The weights, as the recipe names them.
    fn tensors(&self) -> &dyn Tensors;
    /// The model as a program of the op core's ops (made once, at load). Its inputs: the
    /// tokens' embeddings (rows of [`Architecture::embd`]), then one rotation table for each of
    /// [`Architecture::freqs`], in order; its output: the logits of each sequence's last token.
    /// Layer `l` writes and reads cache `l`.
    fn recipe(&self) -> Result<Program, CheckError>;
    /// The embedding the recipe's first input is read from: `[n_vocab, n_embd]`.
    fn embd(&self) -> &Linear;
    /// The rotations of the recipe's tables, in its order of inputs (read once, at load: the
    /// recipe keeps them).
    fn freqs(&self) -> Vec<rope::Freqs>;
    /// The sliding window of layer `l` (keys a query sees, its own among them), if it has one.
    fn window(&self, layer: usize) -> Option<usize>;
    /// Every matrix, the output projection last, for placing them on a device.
    fn linears_mut(&mut self) -> Vec<&mut Linear>;
}

/// What an architecture's file defines: its metadata (`Self`, read from the GGUF before the
/// weights) and, from it, its weights, its recipe, its rotations and windows. Loaded, it is an
/// [`Architecture`] to the engine.
pub trait ArchConfig: Sized + 'static {
    /// The weights, immutable after load, as the recipe names them.
    type Weights: Tensors + 'static;
    /// The hyperparameters every decoder here has.
    fn hparams(&self) -> &Hparams;
    /// Reads the weights.
    fn load(&self, g: &Gguf, file: &dyn Source) -> Result<Self::Weights, LoadError>;
    /// See [`Architecture::recipe`].
    fn recipe(&self, w: &Self::Weights) -> Result<Program, CheckError>;
    /// See [`Architecture::embd`].
    fn embd(w: &Self::Weights) -> &Linear;
    /// See [`Architecture::linears_mut`].
    fn linears_mut(w: &mut Self::Weights) -> Vec<&mut Linear>;
    /// See [`Architecture::freqs`]: by default one table, of the file's base and scale.
    fn freqs(&self, _w: &Self::Weights) -> Vec<rope::Freqs> {
        let h = self.hparams();
        vec![h.freqs(None)]
    }
    /// See [`Architecture::window`]: by default none.
    fn window(&self, _layer: usize) -> Option<usize> {
        None
    }
}

/// A model of an [`ArchConfig`]: its metadata and its weights.
struct Loaded<F: ArchConfig> {
    config: F,
    weights: F::Weights,
}

impl<F: ArchConfig> Configured for F {
    fn hparams(&self) -> &Hparams {
        ArchConfig::hparams(self)
    }

    fn load(self: Box<Self>, g: &Gguf, file: &dyn Source) -> Result<Box<dyn Architecture>, LoadError> {
        let weights = ArchConfig::load(&*self, g, file)?;
        Ok(Box::new(Loaded { config: *self, weights }))
    }
}

impl<F: ArchConfig> Architecture for Loaded<F> {
    fn hparams(&self) -> &Hparams {
        self.config.hparams()
    }

    fn tensors(&self) -> &dyn Tensors {
        &self.weights
    }

    fn recipe(&self) -> Result<Program, CheckError> {
        self.config.recipe(&self.weights)
    }

    fn embd(&self) -> &Linear {
        F::embd(&self.weights)
    }

    fn freqs(&self) -> Vec<rope::Freqs> {
        self.config.freqs(&self.weights)
    }

    fn window(&self, layer: usize) -> Option<usize> {
        self.config.window(layer)
    }

    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        F::linears_mut(&mut self.weights)
    }
}

/// An architecture's metadata, read before its weights (the engine then frees the metadata so
/// that the weights can take its place in the guest's memory). Every [`ArchConfig`] is one.
pub trait Configured {
    /// The hyperparameters, checked against the vocabulary before anything is loaded.
    fn hparams(&self) -> &Hparams;
    /// Reads the weights.
    fn load(self: Box<Self>, g: &Gguf, file: &dyn Source) -> Result<Box<dyn Architecture>, LoadError>;
}

/// An architecture the engine runs.
pub struct Registered {
    /// The `general.architecture` values it answers to.
    pub names: &'static [&'static str],
    /// Reads its metadata; the name is the file's `general.architecture`.
    pub config: fn(&Gguf, &str) -> Result<Box<dyn Configured>, LoadError>,
}

/// The architecture `name` is registered as, if any.
pub fn find(name: &str) -> Option<&'static Registered> {
    REGISTRY.iter().find(|r| r.names.contains(&name))
}

/// Per-session state, allocated once: a cache for each layer, scratch, the program's values on
/// the CPU and the rotation tables, for batches of up to `batch` tokens.
pub struct State {
    pub n_ctx: usize,
    pub batch: usize,
    pub cache: Vec<LayerCache>,
    pub buf: Scratch,
    /// The program's values on the CPU, made by the session's first pass of its own there
    /// (sessions advanced by batched steps use the model's).
    values: Option<Values>,
    /// The rotation tables of the batch, one for each of the recipe's (batched steps fill them
    /// too).
    pub tables: Vec<rope::Table>,
}

impl State {
    /// With `device_caches`, the keys and values live on the device alone (the model's weights
    /// are there): the layers' rings keep their shape and no storage. Without `logits`, no room
    /// for them (a state whose passes give rows, as an embedding's).
    pub fn new(a: &dyn Architecture, r: &Recipe, n_ctx: usize, batch: usize, device_caches: bool, logits: bool) -> State {
        let h = a.hparams();
        let kv = if device_caches { 0 } else { h.n_head_kv * h.head_dim };
        State {
            n_ctx,
            batch,
            cache: (0..h.n_layer).map(|l| LayerCache::new(n_ctx, a.window(l), batch, kv)).collect(),
            buf: Scratch::new(n_ctx, if logits { h.n_vocab } else { 0 }),
            values: None,
            tables: r.freqs.iter().map(|_| rope::Table::new(batch, h.rope_dim)).collect(),
        }
    }

    /// The caches and the logits, apart.
    pub fn parts(&mut self) -> (&mut [LayerCache], &mut [f32]) {
        (&mut self.cache, &mut self.buf.logits)
    }

    /// The caches and the rotation tables, apart (a batched pass fills the tables).
    pub fn pass_parts(&mut self) -> (&mut [LayerCache], Vec<&mut rope::Table>) {
        (&mut self.cache, self.tables.iter_mut().collect())
    }

    /// Bytes this state holds (caches, scratch, values, tables).
    pub fn bytes(&self) -> usize {
        self.cache.iter().map(LayerCache::bytes).sum::<usize>()
            + self.buf.bytes()
            + self.values.as_ref().map_or(0, Values::bytes)
            + self.tables.iter().map(rope::Table::bytes).sum::<usize>()
    }
}

/// Runs `tokens` (at most `s.batch`, at positions `pos..`) through the model, appending their
/// keys and values to the caches, and gives what `want` asks: the last token's logits (in
/// `s.buf.logits`) or the output's rows.
/// The caller checks that the tokens are in the vocabulary and fit in the context. `Ok(false)`,
/// with nothing run, when the device holds keys the guest's cache lacks and the batch cannot
/// run there: the caller runs its history again from position 0 (see `Dispatch::ring_holds`).
/// An error where the device alone holds the weights and failed (see [`recipe_pass`]).
pub fn forward(a: &dyn Architecture, r: &Recipe, s: &mut State, d: &mut Dispatch, tokens: &[u32], pos: usize, want: Want<'_>) -> Result<bool, LoadError> {
    let t = tokens.len();
    debug_assert!(t > 0 && t <= s.batch && pos + t <= s.n_ctx);
    for (table, freqs) in s.tables.iter_mut().zip(&r.freqs) {
        table.fill(freqs, pos, t);
    }
    let tables: Vec<&rope::Table> = s.tables.iter().collect();
    let st = PassState { caches: &mut s.cache, values: &mut s.values, buf: &mut s.buf, batch: s.batch };
    recipe_pass(a.tensors(), r, (a.embd(), &tables), st, d, a.hparams(), r.flops(t), (tokens, pos, want))
}
