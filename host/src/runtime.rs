//! The embedding API: load the wisp component into wasmtime, open models, drive sessions.

use crate::bindings::Inference;
use crate::bindings::exports::wisp::llm::engine as wit;
use crate::gpu::program::Precision;
use crate::gpu::{self, GpuCtx};
use anyhow::{Context, Result};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use wasmtime::component::{Component, Linker, ResourceAny};
use wasmtime::{Config, Engine, ResourceLimiter, Store};
use wasmtime_wasi::{FsPerms, ResourceTable, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

/// The guest component built with this crate, portable: standard wasm SIMD only (the same
/// bytes the browser host runs and `wisp bake` composes).
pub const GUEST_WASM: &[u8] = include_bytes!(env!("WISP_GUEST_WASM"));

/// The same guest built with relaxed SIMD too: its `fast` products (int8 activations) take
/// relaxed SIMD's byte dot products, with results equal to [`GUEST_WASM`]'s bit for bit (no
/// product or sum of theirs rounds or saturates), faster where the engine lowers them to a few
/// instructions (wasmtime on x86-64 and aarch64).
pub const GUEST_RELAXED_WASM: &[u8] = include_bytes!(env!("WISP_GUEST_RELAXED_WASM"));

/// The guest this host runs: [`GUEST_RELAXED_WASM`] where wasmtime compiles relaxed SIMD for
/// this CPU's architecture, unless `WISP_PORTABLE_GUEST=1` asks for [`GUEST_WASM`] (to compare
/// the two).
pub fn native_guest() -> &'static [u8] {
    let portable = std::env::var("WISP_PORTABLE_GUEST").is_ok_and(|v| v == "1");
    if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) && !portable { GUEST_RELAXED_WASM } else { GUEST_WASM }
}

/// The resolution of the per-call time limit.
const EPOCH_TICK: std::time::Duration = std::time::Duration::from_millis(10);

/// The version of the WIT package `wisp:llm` (`wit/`) that this host implements.
const WIT_VERSION: &str = "0.11.0";

/// Where the guest sees the directory of the model it opens.
const GUEST_MODEL_DIR: &str = "/model";

/// A typed engine failure, as the guest reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// The file is not a model the engine can read: a malformed or truncated GGUF, a missing
    /// tensor or key, a shape that does not add up.
    InvalidModel(String),
    /// A well-formed model the engine does not run: another architecture, a tensor type without
    /// kernels.
    Unsupported(String),
    /// The guest could not read the file (outside the preopened directory, missing, unreadable).
    Io(String),
    /// A call's argument is out of range: an unknown token id, `k` of zero, a bad sampling value.
    InvalidArgument(String),
    /// The session has no room for the tokens fed; `reset` it or open a larger one.
    ContextFull(String),
    /// The guest's memory (see [`Options::max_memory`]) cannot hold what was asked.
    OutOfMemory(String),
    /// A [`Constraint`] that does not compile, is longer than 256 KiB or exceeds the compiler's
    /// limits (at [`Instance::constrain`], or at a step of [`Instance::next`]).
    InvalidConstraint(String),
}

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineError::InvalidModel(m) => write!(f, "invalid model: {m}"),
            EngineError::Unsupported(m) => write!(f, "unsupported: {m}"),
            EngineError::Io(m) => write!(f, "cannot read: {m}"),
            EngineError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            EngineError::ContextFull(m) => write!(f, "context full: {m}"),
            EngineError::OutOfMemory(m) => write!(f, "out of memory: {m}"),
            EngineError::InvalidConstraint(m) => write!(f, "invalid constraint: {m}"),
        }
    }
}

impl std::error::Error for EngineError {}

impl From<wit::Error> for EngineError {
    fn from(e: wit::Error) -> Self {
        match e {
            wit::Error::InvalidModel(m) => EngineError::InvalidModel(m),
            wit::Error::Unsupported(m) => EngineError::Unsupported(m),
            wit::Error::Io(m) => EngineError::Io(m),
            wit::Error::InvalidArgument(m) => EngineError::InvalidArgument(m),
            wit::Error::ContextFull(m) => EngineError::ContextFull(m),
            wit::Error::OutOfMemory(m) => EngineError::OutOfMemory(m),
            wit::Error::InvalidConstraint(m) => EngineError::InvalidConstraint(m),
        }
    }
}

/// Where the guest runs its matrix products (the WIT `gpu-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuMode {
    /// Every product on the guest's CPU kernels.
    Off,
    /// The guest measures the device at load and sends it the products it runs faster there.
    #[default]
    Auto,
    /// Every product the device can hold goes to it (the rest stays on the CPU).
    On,
}

/// How a model is opened (the WIT `load-options`). A [`GpuMode`] alone converts into it, with
/// [`Precision::Exact`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOptions {
    /// Where the guest runs its products.
    pub gpu: GpuMode,
    /// How exactly products and attention are computed: [`Precision::Exact`] (the default)
    /// keeps f32 exactness on every path; [`Precision::Fast`] lets a path round products' inputs,
    /// held to the golden thresholds instead: the guest's CPU quantizes activations to int8 (the
    /// same bits on every host), wgpu rounds them to f16 where the adapter offers cooperative
    /// matrices. A path with nothing faster computes it exactly.
    pub precision: Precision,
}

impl From<GpuMode> for LoadOptions {
    fn from(gpu: GpuMode) -> Self {
        LoadOptions { gpu, precision: Precision::Exact }
    }
}

/// Sampling settings (the WIT `sampling` record). The default is greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Divides the logits before sampling; 0 is greedy (the most likely token, no randomness).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens below `min_p` times the top probability; 0 keeps all.
    pub min_p: f32,
    /// Divides positive logits (multiplies negative ones) of recently seen tokens; 1 is off.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: u32,
    /// Seed of the session's random generator, applied on the first `next` and whenever it
    /// changes: the same seed and settings give the same tokens.
    pub seed: u64,
    /// `Some(k)`: the step reports the picked token's log-probability and those of the `k`
    /// (at most 20) most likely tokens ([`Step::logprobs`]), in the model's own distribution
    /// (before the penalty, the temperature, the other settings and any constraint).
    pub logprobs: Option<u32>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling { temperature: 0.0, top_k: 40, top_p: 0.95, min_p: 0.05, repeat_penalty: 1.0, repeat_last_n: 64, seed: 0, logprobs: None }
    }
}

/// A step's log-probabilities ([`Sampling::logprobs`]), natural logarithms.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    /// The picked token's.
    pub logprob: f32,
    /// The most likely tokens' `(token, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// How a model writes its calls of tools ([`Instance::render_chat`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks after any text.
    Hermes,
    /// The whole reply is one `{"name": ..., "parameters": {...}}`.
    Llama3Json,
}

/// How [`Instance::embed`] makes one vector of a text's token rows, as llama.cpp's
/// `--pooling` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooling {
    /// The mean of the rows (llama-server's default).
    #[default]
    Mean,
    /// The last token's row.
    Last,
    /// The first token's row (BERT's `[CLS]`).
    Cls,
}

impl std::str::FromStr for Pooling {
    type Err = String;

    fn from_str(s: &str) -> Result<Pooling, String> {
        match s {
            "mean" => Ok(Pooling::Mean),
            "last" => Ok(Pooling::Last),
            "cls" => Ok(Pooling::Cls),
            other => Err(format!("unknown pooling {other:?}: mean, last or cls")),
        }
    }
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The sampled token's id.
    pub token: u32,
    /// The token's bytes (may end inside a UTF-8 sequence).
    pub piece: Vec<u8>,
    /// The token ends generation (end of sequence, end of turn); its piece is empty.
    pub end_of_generation: bool,
    /// The session's constraint admitted no token (a dead end): nothing was appended, `token`
    /// is the end-of-sequence id, and `end_of_generation` is set.
    pub dead_end: bool,
    /// What [`Sampling::logprobs`] asked for.
    pub logprobs: Option<Logprobs>,
}

/// What a generation must spell (the WIT `constraint`), compiled inside the guest by
/// llguidance: see [`Instance::constrain`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// A JSON schema as JSON text; `{"type": "object"}` asks for any object. Written compactly
    /// unless the schema's `x-guidance` options say otherwise.
    JsonSchema(String),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark dialect; its `start` rule is the output.
    Lark(String),
}

/// What a model is (the WIT `model-info`).
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// `general.architecture`, e.g. "gemma3" or "qwen2".
    pub architecture: String,
    /// `general.name`, or empty.
    pub name: String,
    /// Parameters, counted over all tensors.
    pub n_params: u64,
    /// Transformer blocks.
    pub n_layers: u32,
    /// Width of the residual stream.
    pub n_embd: u32,
    /// Tokens in the vocabulary.
    pub n_vocab: u32,
    /// The context length the model was trained for.
    pub n_ctx_train: u32,
    /// Bytes of the GGUF file.
    pub file_bytes: u64,
    /// The tokenizer model, e.g. "llama" (SentencePiece) or "gpt2" (byte-level BPE).
    pub tokenizer: String,
    /// The beginning-of-sequence token, if the model has one.
    pub bos: Option<u32>,
    /// The end-of-sequence token, if the model has one.
    pub eos: Option<u32>,
    /// Every tensor in file order, as (name, type, shape, bytes).
    pub tensors: Vec<(String, String, Vec<u64>, u64)>,
    /// Metadata key/value pairs, values rendered as text; long arrays are summarised.
    pub metadata: Vec<(String, String)>,
    /// (name, backend) of the device the guest saw at load, if any.
    pub device: Option<(String, String)>,
    /// Weights resident on the device.
    pub gpu_weights: u32,
    /// The chat template [`Instance::apply_chat_template`] uses and where it comes from; `None`
    /// when the model has none.
    pub chat_template: Option<ChatTemplate>,
}

/// Where a model's chat template comes from (the WIT `chat-template`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// The file's own, `tokenizer.chat_template`.
    File,
    /// A built-in template, by name (`chatml`, `gemma`, `llama3`): the file has none and its
    /// vocabulary marks that family, or [`Instance::set_chat_template`] chose it. A base model
    /// may not have been trained on it: say which one is used.
    Builtin(String),
    /// A Jinja template given to [`Instance::set_chat_template`].
    Custom,
}

/// Counters of a session (the WIT `stats`).
pub type Stats = wit::Stats;

/// Options of a [`Wisp`] runtime and its instances.
#[derive(Debug, Clone)]
pub struct Options {
    /// Largest linear memory of a guest instance, in bytes.
    pub max_memory: usize,
    /// Longest a single guest call may run (wall clock) before it is interrupted; `None` for
    /// no limit. Host calls (GPU work) are not interruptible and are bounded on their own.
    pub call_timeout: Option<std::time::Duration>,
    /// Largest wasm stack of a guest call, in bytes.
    pub max_stack: usize,
    /// Directory for compiled components (skips recompiling the guest on each start).
    pub cache_dir: Option<PathBuf>,
    /// Per-instance device budget.
    pub budget: gpu::Budget,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_memory: 4 << 30,
            call_timeout: Some(std::time::Duration::from_secs(600)),
            max_stack: 2 << 20,
            cache_dir: crate::fetch::cache_dir().ok().map(|d| d.join("compiled")),
            budget: gpu::Budget::default(),
        }
    }
}

/// The limit of [`Options`] that ended a guest call. It is in the error chain of the trap
/// (`err.downcast_ref::<Limit>()`), and its sentence is in the error's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// [`Options::call_timeout`]: the call ran past it.
    Time(std::time::Duration),
    /// [`Options::max_stack`], in bytes: the guest overflowed its stack.
    Stack(usize),
    /// [`Options::max_memory`], in bytes: the guest's memory could not grow past it, and the
    /// guest trapped (a Rust guest aborts when an allocation fails).
    Memory(usize),
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Time(t) => write!(f, "the guest call ran past its time limit of {t:?}"),
            Limit::Stack(b) => write!(f, "the guest ran out of stack (its limit is {} KiB)", b >> 10),
            Limit::Memory(b) => write!(f, "the guest ran out of memory (its limit is {} MiB)", b >> 20),
        }
    }
}

/// The store's memory limit, which remembers when it refused a guest's growth (so that the trap
/// that usually follows can say why).
struct MemoryLimit {
    max: usize,
    /// The guest's linear memory, in bytes, after its last growth (it never shrinks).
    size: usize,
    /// The size a refused growth asked for, since the current call began.
    refused: Option<usize>,
}

impl ResourceLimiter for MemoryLimit {
    fn memory_growing(&mut self, _current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let allow = desired <= self.max && maximum.is_none_or(|m| desired <= m);
        if allow {
            self.size = self.size.max(desired);
        } else {
            self.refused = Some(desired);
        }
        Ok(allow)
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        // The host could not map the memory: to the guest, the same as a refusal.
        self.refused.get_or_insert(self.max);
        Ok(())
    }

    fn table_growing(&mut self, _current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(maximum.is_none_or(|m| desired <= m))
    }
}

/// Store data of one guest instance.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    gpu: GpuCtx,
    limits: MemoryLimit,
}

impl HostState {
    /// The store data of an instance offered `gpu`, seeing `model_dir` (read-only) and
    /// stderr, its memory capped at `max_memory` bytes.
    pub(crate) fn new(gpu: GpuCtx, model_dir: Option<&Path>, max_memory: usize) -> Result<HostState> {
        let mut wasi = WasiCtxBuilder::new();
        wasi.inherit_stderr();
        if let Some(dir) = model_dir {
            wasi.preopened_dir(dir, GUEST_MODEL_DIR, FsPerms::ReadOnly)
                .map_err(|e| anyhow::Error::from(e).context(format!("opening {}", dir.display())))?;
        }
        let limits = MemoryLimit { max: max_memory, size: 0, refused: None };
        Ok(HostState { wasi: wasi.build(), table: ResourceTable::new(), gpu, limits })
    }

    /// The instance's `gpu` context (what [`gpu::add_to_linker`] is given).
    pub(crate) fn gpu(&mut self) -> &mut GpuCtx {
        &mut self.gpu
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// A wasmtime engine with the wisp component compiled and linked: cheap to instantiate.
pub struct Wisp {
    engine: Engine,
    component: Component,
    linker: Linker<HostState>,
    options: Options,
}

fn compile(engine: &Engine, bytes: &[u8], cache: Option<&Path>) -> Result<Component> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    compile_keyed(engine, "wisp", h.finish(), cache, || Ok(bytes.to_vec()))
}

/// The component `make` gives, compiled, or read from the cache under `key` (which must say
/// everything `make`'s bytes depend on). Its file is `{name}-{hash}.cwasm`; writing one first
/// removes the other files of that `name` (a pre-initialized guest's file is as large as its
/// model: one is kept per model), or for plain `wisp` all but the `KEEP_BUILDS - 1` used last.
fn compile_keyed(
    engine: &Engine,
    name: &str,
    key: u64,
    cache: Option<&Path>,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Component> {
    let Some(dir) = cache else { return Component::new(engine, make()?).map_err(Into::into) };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    engine.precompile_compatibility_hash().hash(&mut h);
    // Settings the compatibility hash leaves out: how memory images are made.
    "dense images up to 4 GiB".hash(&mut h);
    env!("CARGO_PKG_VERSION").hash(&mut h);
    let path = dir.join(format!("{name}-{:016x}.cwasm", h.finish()));
    if path.exists() {
        // SAFETY: the file was written by `Component::serialize` of this very build (its name
        // hashes the component, the engine's settings and this crate's version) into wisp's own
        // cache directory; a file that fails wasmtime's own header checks is recompiled.
        if let Ok(c) = unsafe { Component::deserialize_file(engine, &path) } {
            // Used now: the pruning below keeps the builds used last.
            let _ = std::fs::File::options().write(true).open(&path).and_then(|f| f.set_modified(std::time::SystemTime::now()));
            return Ok(c);
        }
    }
    let component = Component::new(engine, make()?)?;
    if let Ok(bytes) = component.serialize() {
        let _ = std::fs::create_dir_all(dir);
        // Room for this file first: a pre-initialized guest's file is as large as its model (one
        // is kept per model); plain `wisp` keeps the builds used last.
        prune(dir, name, if name == "wisp" { KEEP_BUILDS - 1 } else { 0 });
        // A name of this call's own: threads of one process (tests, a server's instances) may
        // compile the same build at once, and one writing over another's file while that one
        // maps it would fault (SIGBUS); each renames a whole file of its own into place.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, &path).is_ok() {
            // Read back, so that a large memory image is mapped from the file rather than held
            // in this process's own memory.
            // SAFETY: as above: written just now, by this build.
            if let Ok(c) = unsafe { Component::deserialize_file(engine, &path) } {
                return Ok(c);
            }
        }
    }
    Ok(component)
}

/// How many builds' compiled guests the cache keeps (`prune`): a few, so that builds used side
/// by side (an upgrade and the version before it, two builds compared) each start without
/// compiling, and the directory stops growing by one file (~12 MB) a build.
const KEEP_BUILDS: usize = 4;

/// Removes from `dir` the compiled files of `name` (`{name}-{16 hex digits}.cwasm`, as
/// `compile_keyed` names them) but the `keep` used last (by modification time, which a cache
/// hit sets); other files stay (for plain `wisp`, the pre-initialized guests' among them).
fn prune(dir: &Path, name: &str, keep: usize) {
    let ours = |n: &str| {
        n.strip_prefix(name)
            .and_then(|r| r.strip_prefix('-'))
            .and_then(|r| r.strip_suffix(".cwasm"))
            .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| ours(&e.file_name().to_string_lossy()))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    files.sort_by_key(|f| std::cmp::Reverse(f.0));
    for (_, path) in files.into_iter().skip(keep) {
        let _ = std::fs::remove_file(path);
    }
}

/// The engine every instance of a runtime shares (with its epoch ticker when calls have a time
/// limit) and a linker with WASI and the `gpu` interface.
fn engine_and_linker(options: &Options) -> Result<(Engine, Linker<HostState>)> {
    let mut config = Config::new();
    config.wasm_component_model(true);
    config.max_wasm_stack(options.max_stack);
    config.epoch_interruption(options.call_timeout.is_some());
    // A pre-initialized guest's memory image (the model's weights, with the gaps its loading
    // left) is mapped copy-on-write into each instance however sparse it is, never copied:
    // up to the whole of wasm32's 4 GiB.
    config.memory_guaranteed_dense_image_size(4 << 30);
    // For profiling the guest with `perf`: WISP_PERFMAP=1 writes /tmp/perf-PID.map, which
    // names the compiled guest functions in `perf report`.
    if std::env::var_os("WISP_PERFMAP").is_some_and(|v| v == "1") {
        config.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    let engine = Engine::new(&config)?;
    if options.call_timeout.is_some() {
        // One tick every EPOCH_TICK; the thread ends with the engine.
        let weak = engine.weak();
        std::thread::spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(EPOCH_TICK);
            }
        });
    }
    let mut linker = Linker::new(&engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    gpu::add_to_linker(&mut linker, |s: &mut HostState| &mut s.gpu)?;
    Ok((engine, linker))
}

/// `path` relative to `dir`, the directory the host preopens as [`GUEST_MODEL_DIR`] (or its
/// file name, when it is elsewhere).
fn relative<'a>(dir: &Path, path: &'a Path) -> Result<&'a Path> {
    path.strip_prefix(dir).ok().or_else(|| path.file_name().map(Path::new)).context("model path has no file name")
}

/// Where the guest sees the file at `rel` inside the preopened directory.
fn guest_path(rel: &Path) -> Result<String> {
    Ok(format!("{GUEST_MODEL_DIR}/{}", rel.to_str().context("model path is not UTF-8")?))
}

impl Wisp {
    /// The runtime with wisp's own guest component, or with the component file named by the
    /// environment variable `WISP_COMPONENT` when it is set (for developing the guest).
    pub fn new(options: Options) -> Result<Wisp> {
        match std::env::var_os("WISP_COMPONENT") {
            Some(path) => {
                let bytes = std::fs::read(&path)
                    .with_context(|| format!("reading WISP_COMPONENT={}", Path::new(&path).display()))?;
                Wisp::with_component(&bytes, options)
            }
            None => Wisp::with_component(native_guest(), options),
        }
    }

    /// The runtime with wisp's guest pre-initialized with the model at `model` loaded (with the
    /// GPU off): every instance starts with the model in its memory, its pages shared with the
    /// others until written, and `open_model` of that path (with [`GpuMode::Off`], or without
    /// a device) returns at once. The pre-initialized component is compiled once and cached
    /// (with the options' `cache_dir`) under the guest's and the file's identity (path, size,
    /// modification time).
    pub fn preloaded(model: &Path, options: Options) -> Result<Wisp> {
        let meta = std::fs::metadata(model).with_context(|| format!("reading {}", model.display()))?;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        native_guest().hash(&mut h);
        (model, meta.len(), meta.modified().ok()).hash(&mut h);
        "preloaded".hash(&mut h);
        let (engine, linker) = engine_and_linker(&options)?;
        let dir = model.parent().context("the model path has no directory")?;
        let guest_path = guest_path(relative(dir, model)?)?;
        let make = || crate::preinit::preinitialize(native_guest(), dir, &guest_path);
        let stem = model.file_stem().map(|s| s.to_string_lossy().replace(|c: char| !c.is_ascii_alphanumeric() && c != '.', "_"));
        let name = format!("wisp-preloaded-{}", stem.unwrap_or_default());
        let component = compile_keyed(&engine, &name, h.finish(), options.cache_dir.as_deref(), make)
            .context("pre-initializing the guest")?;
        Ok(Wisp { engine, component, linker, options })
    }

    /// wisp's guest pre-initialized with the model at `model` loaded (with the GPU off), as a
    /// component: its `preloaded-model` export names the path its engine opens at once.
    pub(crate) fn preinitialized_guest(model: &Path) -> Result<Vec<u8>> {
        let dir = model.parent().context("the model path has no directory")?;
        let guest_path = guest_path(relative(dir, model)?)?;
        crate::preinit::preinitialize(GUEST_WASM, dir, &guest_path)
    }

    /// The runtime with another build of a component of the `inference` world.
    pub fn with_component(bytes: &[u8], options: Options) -> Result<Wisp> {
        let (engine, linker) = engine_and_linker(&options)?;
        let component = compile(&engine, bytes, options.cache_dir.as_deref()).context("compiling the guest component")?;
        Ok(Wisp { engine, component, linker, options })
    }

    /// A fresh guest instance. `model_dir`, if given, is preopened read-only: the only part of
    /// the host's file system the guest can see.
    pub fn instantiate(&self, gpu: GpuCtx, model_dir: Option<&Path>) -> Result<Instance> {
        let state = HostState::new(gpu, model_dir, self.options.max_memory)?;
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        let deadline = self.options.call_timeout.map(|t| (t.as_millis() / EPOCH_TICK.as_millis()).max(1) as u64);
        if let Some(ticks) = deadline {
            store.set_epoch_deadline(ticks);
        }
        let api = Inference::instantiate(&mut store, &self.component, &self.linker).map_err(|e| {
            let what = match self.other_wit_version() {
                Some(v) => format!(
                    "instantiating the guest: the component was built for wisp:llm@{v}, and this host implements \
                     wisp:llm@{WIT_VERSION}"
                ),
                None => "instantiating the guest".to_string(),
            };
            anyhow::Error::from(e).context(what)
        })?;
        Ok(Instance {
            store,
            api,
            model_dir: model_dir.map(Path::to_path_buf),
            deadline,
            call_timeout: self.options.call_timeout,
            max_stack: self.options.max_stack,
            max_memory: self.options.max_memory,
        })
    }

    /// The version of the `wisp:llm` package that the component imports or exports, when it is
    /// not the one this host implements.
    fn other_wit_version(&self) -> Option<String> {
        let ty = self.component.component_type();
        let names = ty.imports(&self.engine).map(|(n, _)| n).chain(ty.exports(&self.engine).map(|(n, _)| n));
        names
            .filter_map(|n| n.strip_prefix("wisp:llm/")?.split_once('@').map(|(_, v)| v.to_string()))
            .find(|v| v != WIT_VERSION)
    }

    /// The options this runtime was built with.
    pub fn options(&self) -> &Options {
        &self.options
    }
}

/// One session's part of a batched step ([`Instance::step`]).
#[derive(Debug, Clone, Copy)]
pub struct Advance<'a> {
    /// The session, of the step's model.
    pub session: Session,
    /// Appended before the pass, as [`Instance::feed`] appends them (a prompt's next chunk);
    /// may be empty.
    pub tokens: &'a [u32],
    /// Samples the session's next token after the pass, as [`Instance::next`] does; `None`
    /// only takes in the tokens.
    pub sample: Option<Sampling>,
}

fn wit_sampling(s: &Sampling) -> wit::Sampling {
    let Sampling { temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, logprobs } = *s;
    wit::Sampling { temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, logprobs }
}

fn step(s: wit::Step) -> Step {
    let logprobs = s.logprobs.map(|l| Logprobs { logprob: l.logprob, top: l.top });
    Step { token: s.token, piece: s.piece, end_of_generation: s.end_of_generation, dead_end: s.dead_end, logprobs }
}

/// A loaded model inside an [`Instance`].
#[derive(Debug, Clone, Copy)]
pub struct Model(ResourceAny);

/// A session (KV cache) inside an [`Instance`].
#[derive(Debug, Clone, Copy)]
pub struct Session(ResourceAny);

/// One guest instance: its store, its models and sessions.
pub struct Instance {
    store: Store<HostState>,
    api: Inference,
    model_dir: Option<PathBuf>,
    /// Epoch ticks each guest call may run.
    deadline: Option<u64>,
    /// The limits the calls run under, for the messages of the traps they cause.
    call_timeout: Option<std::time::Duration>,
    max_stack: usize,
    max_memory: usize,
}

/// Engine calls return `Ok(Err(e))` for a typed engine error and `Err` for a trap.
pub type Outcome<T> = Result<Result<T, EngineError>>;

fn wit_options(o: LoadOptions) -> wit::LoadOptions {
    let gpu = match o.gpu {
        GpuMode::Off => wit::GpuMode::Off,
        GpuMode::Auto => wit::GpuMode::Auto,
        GpuMode::On => wit::GpuMode::On,
    };
    let precision = match o.precision {
        Precision::Exact => crate::bindings::wisp::llm::gpu::Precision::Exact,
        Precision::Fast => crate::bindings::wisp::llm::gpu::Precision::Fast,
    };
    wit::LoadOptions { gpu, precision }
}

impl Instance {
    /// One guest call: restarts the time limit, runs `f`, and turns a trap into an error that
    /// says which limit ended the call (a [`Limit`] in its chain, when one did). The
    /// [`wasmtime::Trap`] stays in the error's chain.
    fn call<T>(&mut self, f: impl FnOnce(&mut Store<HostState>, &Inference) -> wasmtime::Result<T>) -> Result<T> {
        if let Some(ticks) = self.deadline {
            self.store.set_epoch_deadline(ticks);
        }
        self.store.data_mut().limits.refused = None;
        let r = f(&mut self.store, &self.api);
        let memory_refused = self.store.data().limits.refused.is_some();
        r.map_err(|e| {
            let e = anyhow::Error::from(e);
            let Some(trap) = e.downcast_ref::<wasmtime::Trap>().copied() else { return e };
            let limit = match trap {
                wasmtime::Trap::Interrupt => self.call_timeout.map(Limit::Time),
                wasmtime::Trap::StackOverflow => Some(Limit::Stack(self.max_stack)),
                _ if memory_refused => Some(Limit::Memory(self.max_memory)),
                _ => None,
            };
            let why = match (limit, trap) {
                (Some(l), wasmtime::Trap::Interrupt | wasmtime::Trap::StackOverflow) => l.to_string(),
                (Some(l), other) => format!("{l}, and trapped: {other}"),
                (None, wasmtime::Trap::Interrupt) => "the guest call was interrupted".to_string(),
                (None, other) => format!("the guest trapped: {other}"),
            };
            let e = match limit {
                Some(l) => e.context(l),
                None => e,
            };
            e.context(format!("{why}; this instance can no longer be used, instantiate a new one"))
        })
    }

    /// Opens a model file inside the instance's model directory. A path that is there but is
    /// not a regular file (a directory, a pipe, a device) is [`EngineError::Io`]: the guest's
    /// read of a pipe would block, and of a device might never end.
    /// `options` is a [`LoadOptions`] or a [`GpuMode`] alone (exact precision).
    pub fn open_model(&mut self, path: &Path, options: impl Into<LoadOptions>) -> Outcome<Model> {
        let dir = self.model_dir.as_deref().context("this instance has no model directory")?;
        let rel = relative(dir, path)?;
        if std::fs::metadata(dir.join(rel)).is_ok_and(|m| !m.is_file()) {
            return Ok(Err(EngineError::Io(format!("{} is not a regular file", path.display()))));
        }
        let guest_path = guest_path(rel)?;
        let options = wit_options(options.into());
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_open(st, &guest_path, options))?;
        Ok(r.map(Model).map_err(Into::into))
    }

    /// Opens a model given as bytes (`options` as for [`Self::open_model`]).
    pub fn open_model_bytes(&mut self, bytes: &[u8], options: impl Into<LoadOptions>) -> Outcome<Model> {
        let options = wit_options(options.into());
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_from_bytes(st, bytes, options))?;
        Ok(r.map(Model).map_err(Into::into))
    }

    /// What the model is: architecture, sizes, tokenizer, tensors, metadata, device.
    pub fn model_info(&mut self, m: Model) -> Result<ModelInfo> {
        let i = self.call(|st, api| api.wisp_llm_engine().model().call_info(st, m.0))?;
        Ok(ModelInfo {
            architecture: i.architecture,
            name: i.name,
            n_params: i.n_params,
            n_layers: i.n_layers,
            n_embd: i.n_embd,
            n_vocab: i.n_vocab,
            n_ctx_train: i.n_ctx_train,
            file_bytes: i.file_bytes,
            tokenizer: i.tokenizer,
            bos: i.bos,
            eos: i.eos,
            tensors: i.tensors.into_iter().map(|t| (t.name, t.kind, t.shape, t.bytes)).collect(),
            metadata: i.metadata,
            device: i.device.map(|d| (d.name, d.backend)),
            gpu_weights: i.gpu_weights,
            chat_template: i.chat_template.map(|t| match t {
                wit::ChatTemplate::File => ChatTemplate::File,
                wit::ChatTemplate::Builtin(name) => ChatTemplate::Builtin(name),
                wit::ChatTemplate::Custom => ChatTemplate::Custom,
            }),
        })
    }

    /// The tokens of `text`. `add_special` prepends the model's BOS token (where it has one);
    /// `parse_special` reads special tokens written as text (`<start_of_turn>`) as themselves.
    pub fn tokenize(&mut self, m: Model, text: &str, add_special: bool, parse_special: bool) -> Outcome<Vec<u32>> {
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_tokenize(st, m.0, text, add_special, parse_special))?;
        Ok(r.map_err(Into::into))
    }

    /// The bytes of one token (a piece may end inside a UTF-8 sequence); special tokens are
    /// empty unless `special`. An unknown id is [`EngineError::InvalidArgument`].
    pub fn token_piece(&mut self, m: Model, token: u32, special: bool) -> Outcome<Vec<u8>> {
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_token_piece(st, m.0, token, special))?;
        Ok(r.map_err(Into::into))
    }

    /// The text of a token sequence (invalid UTF-8 replaced); special tokens only with `special`.
    pub fn detokenize(&mut self, m: Model, tokens: &[u32], special: bool) -> Outcome<String> {
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_detokenize(st, m.0, tokens, special))?;
        Ok(r.map_err(Into::into))
    }

    /// Whether `token` ends generation for this model (end of sequence, end of turn).
    pub fn is_end_of_generation(&mut self, m: Model, token: u32) -> Result<bool> {
        self.call(|st, api| api.wisp_llm_engine().model().call_is_end_of_generation(st, m.0, token))
    }

    /// Renders `(role, content)` messages with the model's chat template; with
    /// `add_generation_prompt`, the text ends where the assistant's reply begins. Tokenize it
    /// with `parse_special`.
    pub fn apply_chat_template(&mut self, m: Model, messages: &[(String, String)], add_generation_prompt: bool) -> Outcome<String> {
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_apply_chat_template(st, m.0, messages, add_generation_prompt))?;
        Ok(r.map_err(Into::into))
    }

    /// Renders a conversation given as JSON in OpenAI's chat shape, `{"messages": [...],
    /// "tools": [...]}` (messages with `tool_calls` and `role: "tool"` results included), with
    /// the model's chat template, and says how the model will write its calls: the template's
    /// own syntax where it renders tools in one the engine reads, else the tools are described
    /// as text in the [`ToolSyntax::Hermes`] syntax. Errors as
    /// [`Instance::apply_chat_template`]'s; [`EngineError::InvalidArgument`] for JSON that is
    /// not such a conversation.
    pub fn render_chat(&mut self, m: Model, conversation: &str, add_generation_prompt: bool) -> Outcome<(String, ToolSyntax)> {
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_render_chat(st, m.0, conversation, add_generation_prompt))?;
        Ok(r.map(|c| {
            let syntax = match c.tool_syntax {
                wit::ToolSyntax::Hermes => ToolSyntax::Hermes,
                wit::ToolSyntax::Llama3Json => ToolSyntax::Llama3Json,
            };
            (c.text, syntax)
        })
        .map_err(Into::into))
    }

    /// Replaces the model's chat template for every later [`Instance::apply_chat_template`]: a
    /// built-in one's name (`chatml`, `gemma`, `llama3`) or a Jinja template's source.
    /// [`EngineError::InvalidArgument`] for an unknown name, a template that does not compile or
    /// one longer than 1 MiB; the template in use is then unchanged.
    pub fn set_chat_template(&mut self, m: Model, template: &str) -> Outcome<()> {
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_set_chat_template(st, m.0, template))?;
        Ok(r.map_err(Into::into))
    }

    /// For each text of `texts` (token ids, as [`Instance::tokenize`] gives them), its
    /// embedding: the model's hidden states after its last norm, pooled by `pooling` and
    /// L2-normalized, `n_embd` values. Each text runs alone, from position 0, as a prompt does,
    /// with the model's load options. [`EngineError::InvalidArgument`] for no texts, more than
    /// 2048, an empty one or a token past the vocabulary; [`EngineError::ContextFull`] for one
    /// past the training context.
    pub fn embed(&mut self, m: Model, texts: &[Vec<u32>], pooling: Pooling) -> Outcome<Vec<Vec<f32>>> {
        let pooling = match pooling {
            Pooling::Mean => wit::Pooling::Mean,
            Pooling::Last => wit::Pooling::Last,
            Pooling::Cls => wit::Pooling::Cls,
        };
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_embed(st, m.0, texts, pooling))?;
        Ok(r.map_err(Into::into))
    }

    /// A new session with room for `n_ctx` tokens (0: the model's training context).
    pub fn new_session(&mut self, m: Model, n_ctx: u32) -> Outcome<Session> {
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_new_session(st, m.0, n_ctx))?;
        Ok(r.map(Session).map_err(Into::into))
    }

    /// Appends tokens to the session's context and computes the logits after the last one.
    /// Past the capacity, [`EngineError::ContextFull`] and nothing is appended.
    pub fn feed(&mut self, s: Session, tokens: &[u32]) -> Outcome<()> {
        let r = self.call(|st, api| api.wisp_llm_engine().session().call_feed(st, s.0, tokens))?;
        Ok(r.map_err(Into::into))
    }

    /// Samples the next token from the current logits, appends it, and computes the logits
    /// after it (lazily: a generation that stops costs nothing extra).
    pub fn next(&mut self, s: Session, sampling: &Sampling) -> Outcome<Step> {
        let p = wit_sampling(sampling);
        let r = self.call(|st, api| api.wisp_llm_engine().session().call_next(st, s.0, p))?;
        Ok(r.map(step).map_err(Into::into))
    }

    /// Advances several sessions of model `m` at once (continuous batching): each appends its
    /// tokens, then the tokens of all of them not yet run go through the model in the same
    /// forward passes, and each that asks samples its next token as [`Instance::next`] would.
    /// A session's logits and tokens are those it would have alone. One result per entry (an
    /// entry's error leaves its session as it was); the whole call fails with
    /// [`EngineError::InvalidArgument`] for a session of another model, one in two entries, or
    /// more than 1024 entries. See `examples/batch.rs`.
    pub fn step(&mut self, m: Model, work: &[Advance<'_>]) -> Outcome<Vec<std::result::Result<Option<Step>, EngineError>>> {
        let work: Vec<wit::Advance> = work
            .iter()
            .map(|a| wit::Advance { session: a.session.0, tokens: a.tokens.to_vec(), sample: a.sample.as_ref().map(wit_sampling) })
            .collect();
        let r = self.call(|st, api| api.wisp_llm_engine().model().call_step(st, m.0, &work))?;
        Ok(r.map(|each| each.into_iter().map(|r| r.map(|s| s.map(step)).map_err(Into::into)).collect()).map_err(Into::into))
    }

    /// Constrains the tokens that the following [`Instance::next`] calls produce (`None`
    /// removes the constraint, as [`Instance::reset`] does). Compiled here, once:
    /// [`EngineError::InvalidConstraint`] names what is wrong with it.
    pub fn constrain(&mut self, s: Session, constraint: Option<&Constraint>) -> Outcome<()> {
        let c = constraint.map(|c| match c {
            Constraint::JsonSchema(t) => wit::Constraint::JsonSchema(t.clone()),
            Constraint::Regex(t) => wit::Constraint::Regex(t.clone()),
            Constraint::Lark(t) => wit::Constraint::Lark(t.clone()),
        });
        let r = self.call(|st, api| api.wisp_llm_engine().session().call_constrain(st, s.0, c.as_ref()))?;
        Ok(r.map_err(Into::into))
    }

    /// All logits after the last token (the vocabulary's size).
    pub fn logits(&mut self, s: Session) -> Outcome<Vec<f32>> {
        let r = self.call(|st, api| api.wisp_llm_engine().session().call_logits(st, s.0))?;
        Ok(r.map_err(Into::into))
    }

    /// The `k` largest logits after the last token, as `(token, logit)`, largest first.
    pub fn top(&mut self, s: Session, k: u32) -> Outcome<Vec<(u32, f32)>> {
        let r = self.call(|st, api| api.wisp_llm_engine().session().call_top(st, s.0, k))?;
        Ok(r.map_err(Into::into))
    }

    /// Tokens in the session's context.
    pub fn position(&mut self, s: Session) -> Result<u32> {
        self.call(|st, api| api.wisp_llm_engine().session().call_position(st, s.0))
    }

    /// Forgets every token of the session; its KV cache is kept for reuse.
    pub fn reset(&mut self, s: Session) -> Result<()> {
        self.call(|st, api| api.wisp_llm_engine().session().call_reset(st, s.0))
    }

    /// Keeps the first `tokens` tokens of the session's context and forgets the rest, reusing
    /// the keys and values of those kept (a chat's next turn then runs its new tokens alone).
    /// Removes the constraint. [`EngineError::InvalidArgument`] past its position.
    pub fn truncate(&mut self, s: Session, tokens: u32) -> Outcome<()> {
        let r = self.call(|st, api| api.wisp_llm_engine().session().call_truncate(st, s.0, tokens))?;
        Ok(r.map_err(Into::into))
    }

    /// A new session of the same model and capacity whose context is a copy of the first
    /// `tokens` tokens of `s` (a shared prefix computed once). [`EngineError::InvalidArgument`]
    /// past its position.
    pub fn fork(&mut self, s: Session, tokens: u32) -> Outcome<Session> {
        let r = self.call(|st, api| api.wisp_llm_engine().session().call_fork(st, s.0, tokens))?;
        Ok(r.map(Session).map_err(Into::into))
    }

    /// The guest's linear memory, in bytes: the most it has held (a wasm memory never shrinks;
    /// the guest reuses what it frees).
    pub fn memory_bytes(&self) -> usize {
        self.store.data().limits.size
    }

    /// The session's counters: tokens and time of prefill and decode, products on the CPU and
    /// the device.
    pub fn stats(&mut self, s: Session) -> Result<Stats> {
        self.call(|st, api| api.wisp_llm_engine().session().call_stats(st, s.0))
    }

    /// Frees a session's memory in the guest.
    pub fn drop_session(&mut self, s: Session) -> Result<()> {
        self.call(|store, _| s.0.resource_drop(store))
    }

    /// Frees a model's memory in the guest (its sessions keep it alive until they go).
    pub fn drop_model(&mut self, m: Model) -> Result<()> {
        self.call(|store, _| m.0.resource_drop(store))
    }

    /// The instance's GPU context (device usage, for statistics and tests).
    pub fn gpu(&mut self) -> &mut GpuCtx {
        &mut self.store.data_mut().gpu
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    /// The cache keeps the builds used last, and only the named files go.
    #[test]
    fn pruning_keeps_the_builds_used_last_and_other_files() {
        let dir = std::env::temp_dir().join(format!("wisp-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let now = SystemTime::now();
        let build = |i: u64| format!("wisp-{i:016x}.cwasm");
        for i in 0..6u64 {
            let f = std::fs::File::create(dir.join(build(i))).unwrap();
            // Build 0 used last, then 1, 2, ...
            f.set_modified(now - Duration::from_secs(60 * (i + 1))).unwrap();
        }
        let others = ["wisp-preloaded-gemma_3_270m_q4_k_m-0123456789abcdef.cwasm", "wisp-0123.cwasm", "notes.txt"];
        for name in others {
            let f = std::fs::File::create(dir.join(name)).unwrap();
            f.set_modified(now - Duration::from_secs(86_400)).unwrap();
        }
        let left = || {
            let mut v: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
            v.sort();
            v
        };
        super::prune(&dir, "wisp", 4);
        let mut want: Vec<String> = (0..4).map(build).chain(others.iter().map(|s| s.to_string())).collect();
        want.sort();
        assert_eq!(left(), want);
        // A pre-initialized guest's name: its files alone go.
        super::prune(&dir, "wisp-preloaded-gemma_3_270m_q4_k_m", 0);
        want.retain(|n| n != others[0]);
        assert_eq!(left(), want);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
