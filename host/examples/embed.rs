//! Embedding wisp in a wasmtime host: load the component, open a model, stream a greedy
//! continuation. Usage: `cargo run --release --example embed -- [MODEL.gguf] [PROMPT]`.

use anyhow::{Result, anyhow};
use std::io::Write;
use std::path::PathBuf;
use wisp::{GpuCtx, GpuMode, Options, Sampling, WgpuBackend, Wisp};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let path = match args.next() {
        Some(p) => PathBuf::from(p),
        None => wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, true)?,
    };
    let prompt = args.next().unwrap_or_else(|| "The capital of France is".into());

    // The host's GPU, if wgpu finds one; the guest decides what to run on it.
    let gpu = match WgpuBackend::new()? {
        Some(backend) => GpuCtx::new(Box::new(backend), Default::default()),
        None => GpuCtx::none(),
    };
    let wisp = Wisp::new(Options::default())?;
    // The model's directory is the only part of the file system the guest sees.
    let mut inst = wisp.instantiate(gpu, path.parent())?;
    let model = inst.open_model(&path, GpuMode::Auto)?.map_err(|e| anyhow!("{e}"))?;

    let tokens = inst.tokenize(model, &prompt, true, false)?.map_err(|e| anyhow!("{e}"))?;
    let session = inst.new_session(model, tokens.len() as u32 + 32)?.map_err(|e| anyhow!("{e}"))?;
    inst.feed(session, &tokens)?.map_err(|e| anyhow!("{e}"))?;

    let mut out = std::io::stdout().lock();
    write!(out, "{prompt}")?;
    for _ in 0..32 {
        let step = inst.next(session, &Sampling::default())?.map_err(|e| anyhow!("{e}"))?;
        if step.end_of_generation {
            break;
        }
        out.write_all(&step.piece)?;
        out.flush()?;
    }
    let stats = inst.stats(session)?;
    writeln!(out, "\n[{} tokens, {} GPU calls]", stats.decode_tokens, stats.gpu_calls)?;
    Ok(())
}
