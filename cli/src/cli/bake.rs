//! `wisp bake`: a model baked into a `wasi:http/proxy` component (see `wisp::bake`).

use super::model_path;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct BakeArgs {
    /// GGUF file, or the name of a known model (fetched if missing) [default: Gemma 3 270M].
    #[arg(long, short = 'm')]
    model: Option<PathBuf>,
    /// Where to write the component [default: the model's file name with .http.wasm, here].
    #[arg(long, short = 'o', value_name = "FILE")]
    output: Option<PathBuf>,
}

pub fn bake(a: BakeArgs) -> Result<()> {
    let path = model_path(a.model.as_deref())?;
    let output = match a.output {
        Some(o) => o,
        None => {
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
            PathBuf::from(format!("{stem}.http.wasm"))
        }
    };
    // A place it cannot write is said now, not after the bake.
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.is_dir()
    {
        bail!("cannot write {}: {} is not a directory", output.display(), dir.display());
    }
    let started = Instant::now();
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.enable_steady_tick(Duration::from_millis(120));
    spinner.set_message(format!("pre-initializing the guest with {} and composing", path.display()));
    let bytes = wisp::bake::bake(&path);
    spinner.finish_and_clear();
    let bytes = bytes.with_context(|| format!("cannot bake {}", path.display()))?;
    std::fs::write(&output, &bytes).with_context(|| format!("writing {}", output.display()))?;
    let id = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    eprintln!(
        "wisp: baked {} into {} ({:.0} MB, {:.1} s): a wasi:http/proxy component serving `{id}`",
        path.display(),
        output.display(),
        bytes.len() as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    // What each instance starts from: mapped copy-on-write (the weights in memory once, however
    // many instances run), or written into every instance. A note: a component it cannot
    // measure is still written.
    if let Ok(Some(image)) = wisp::bake::memory_image(&bytes) {
        let mib = |b: u64| b as f64 / f64::from(1 << 20);
        let how = if image.mapped_by_default() {
            "dense: runtimes map it copy-on-write into each instance with their default settings"
        } else {
            "sparse: runtimes with default settings copy it into each instance"
        };
        eprintln!("wisp: memory image {:.0} MiB of data over {:.0} MiB ({how})", mib(image.data_bytes), mib(image.span_bytes));
    }
    eprintln!(
        "wisp: run it with `wasmtime serve --addr 127.0.0.1:8080 {}`; compiled ahead for production (docs/deploy.md)",
        output.display()
    );
    Ok(())
}
