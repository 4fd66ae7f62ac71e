//! A host that supplies its own implementation of the `gpu` interface: a device that does the
//! products on the host's CPU in plain Rust and counts what the guest asked of it. Any backend
//! that keeps the contract of `wit/gpu.wit` gives the guest the same tokens.
//! Usage: `cargo run --release --example custom_gpu -- [MODEL.gguf] [PROMPT]`.

use anyhow::{Result, anyhow};
use std::path::PathBuf;
use wisp::{Backend, BufferId, CpuBackend, Device, Format, GpuCtx, GpuError, GpuMode, Options, Sampling, Wisp};

/// The device: the CPU reference decoder, plus counters.
struct CountingDevice {
    inner: CpuBackend,
    uploads: usize,
    calls: usize,
}

impl Backend for CountingDevice {
    fn device(&self) -> Option<Device> {
        Some(Device { name: "counting CPU device".into(), ..self.inner.device()? })
    }
    fn create(&mut self, format: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        self.uploads += 1;
        self.inner.create(format, n_out, n_in)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.inner.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.calls += 1;
        self.inner.matmul(x, t, n_in, jobs)
    }
    fn free(&mut self, id: BufferId) {
        self.inner.free(id)
    }
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let path = match args.next() {
        Some(p) => PathBuf::from(p),
        None => wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, true)?,
    };
    let prompt = args.next().unwrap_or_else(|| "The capital of France is".into());
    let device = CountingDevice { inner: CpuBackend::new(), uploads: 0, calls: 0 };
    let wisp = Wisp::new(Options::default())?;
    let mut inst = wisp.instantiate(GpuCtx::new(Box::new(device), Default::default()), path.parent())?;
    // `On`: every product the device can take goes to it.
    let model = inst.open_model(&path, GpuMode::On)?.map_err(|e| anyhow!("{e}"))?;
    let tokens = inst.tokenize(model, &prompt, true, false)?.map_err(|e| anyhow!("{e}"))?;
    let session = inst.new_session(model, tokens.len() as u32 + 8)?.map_err(|e| anyhow!("{e}"))?;
    inst.feed(session, &tokens)?.map_err(|e| anyhow!("{e}"))?;
    let mut text = prompt.clone();
    for _ in 0..8 {
        let step = inst.next(session, &Sampling::default())?.map_err(|e| anyhow!("{e}"))?;
        text.push_str(&String::from_utf8_lossy(&step.piece));
    }
    let stats = inst.stats(session)?;
    println!("{text}");
    println!("[{} weights on the device, {} device calls, {} CPU products]", inst.model_info(model)?.gpu_weights, stats.gpu_calls, stats.cpu_matmuls);
    Ok(())
}
