//! What a platform that starts an instance per request (`wasmtime serve`, Spin) pays before the
//! first token: a fresh guest instance and its model open, with the guest pre-initialized (the
//! model in its memory image, as `wisp bake` and `wisp serve --instances N` make it) against
//! the guest that reads and parses the GGUF in each instance. Prints the medians and the ratio.
//! Usage: `cargo run --release --example instance_start -- [MODEL.gguf] [RUNS]`.

use anyhow::{Result, anyhow};
use std::path::{Path, PathBuf};
use std::time::Instant;
use wisp::{GpuCtx, GpuMode, Options, Wisp};

/// The median time, in seconds, of `runs` instances started and the model opened in each.
fn start(wisp: &Wisp, model: &Path, runs: usize) -> Result<f64> {
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        let mut inst = wisp.instantiate(GpuCtx::none(), model.parent())?;
        let m = inst.open_model(model, GpuMode::Off)?.map_err(|e| anyhow!("{e}"))?;
        inst.model_info(m)?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[runs / 2])
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let model = match args.next() {
        Some(p) => std::fs::canonicalize(PathBuf::from(p))?,
        None => wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, true)?,
    };
    let runs: usize = args.next().map_or(Ok(10), |r| r.parse())?;
    let preloaded = Wisp::preloaded(&model, Options::default())?;
    let loading = Wisp::new(Options::default())?;
    // One of each first: compilation and the file in the page cache are not the measure.
    start(&preloaded, &model, 1)?;
    start(&loading, &model, 1)?;
    let (p, l) = (start(&preloaded, &model, runs)?, start(&loading, &model, runs)?);
    println!("model: {}", model.display());
    println!("instance + model open, median of {runs}: pre-initialized {:.1} ms, loading the GGUF {:.1} ms: {:.0}x", p * 1e3, l * 1e3, l / p);
    Ok(())
}
