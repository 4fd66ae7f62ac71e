//! `wisp bench`: prefill and decode speed, median of several runs.

use super::{ModelArgs, engine, load};
use anyhow::Result;
use clap::Args;
use std::time::Instant;
use wisp::{Advance, Constraint, Format, Instance, Sampling, Session, Stats};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Runs to take the median of.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Generated tokens for the decode measurement.
    #[arg(long, default_value_t = 64)]
    decode_tokens: u32,
    /// Also measures N sessions advanced together (batched steps), for each N given: each a
    /// prompt of `--prompt-tokens` and `--decode-tokens` greedy tokens, as `llama-batched-bench
    /// -npp P -ntg G -npl N` does; prints the aggregate prefill and decode tok/s of each N.
    #[arg(long, value_delimiter = ',', value_name = "N[,N...]", value_parser = clap::value_parser!(u32).range(1..=1024))]
    parallel: Vec<u32>,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Size of the square weight of the per-format matmul benchmark (with `--gpu on`); 0 skips
    /// it.
    #[arg(long, default_value_t = 2048)]
    matmul_size: u32,
    /// With a constraint, decoding is also timed under it, interleaved with the unconstrained
    /// decode of each run.
    #[command(flatten)]
    constraint: super::ConstraintArgs,
}

/// Constrained decoding timed: the `next` calls alone, greedy, `n` tokens after `prompt`.
/// Where the constraint is complete (an end-of-generation token or a dead end), it is compiled
/// again and the generation goes on. The compile times are returned apart.
#[derive(Default)]
struct Constrained {
    tokens: u64,
    next_ns: u64,
    compiles_ns: Vec<u64>,
}

impl Constrained {
    fn run(&mut self, inst: &mut Instance, session: Session, prompt: &[u32], c: &Constraint, n: u32) -> Result<()> {
        inst.reset(session)?;
        engine(inst.feed(session, prompt)?)?;
        let compile = |inst: &mut Instance, times: &mut Vec<u64>| -> Result<()> {
            let start = Instant::now();
            engine(inst.constrain(session, Some(c))?)?;
            times.push(start.elapsed().as_nanos() as u64);
            Ok(())
        };
        compile(inst, &mut self.compiles_ns)?;
        for _ in 0..n {
            let start = Instant::now();
            let step = engine(inst.next(session, &Sampling::default())?)?;
            self.next_ns += start.elapsed().as_nanos() as u64;
            self.tokens += 1;
            if step.end_of_generation {
                compile(inst, &mut self.compiles_ns)?;
            }
        }
        Ok(())
    }

    fn ms_per_token(&self) -> f64 {
        self.next_ns as f64 / self.tokens.max(1) as f64 / 1e6
    }
}

/// GFLOP/s of the device's matmul per upload format and batch size, and the round trip of a
/// tiny call: what the guest's dispatch policy weighs.
fn device_matmuls(a: &BenchArgs) -> Result<Option<serde_json::Value>> {
    let mut ctx = super::gpu_ctx(&a.model)?;
    let Some(device) = ctx.device().cloned() else { return Ok(None) };
    let n = a.matmul_size;
    let elems = n as usize * n as usize;
    let mut formats = serde_json::Map::new();
    // The same products timed on the device alone (timestamp queries), where it can tell.
    let mut kernel = serde_json::Map::new();

    // Bytes of weights (and scales) a t = 1 product reads, per second of kernel time.
    let mut gemv_bandwidth = serde_json::Map::new();
    for format in Format::ALL {
        // Values from a hash, not a short pattern: GPUs compress regular data in memory, which
        // would flatter every rate that memory bounds.
        let data: Vec<u8> = match format {
            Format::F32 => (0..elems).flat_map(|i| unit(i as u64).to_le_bytes()).collect(),
            Format::Bf16 => (0..elems).flat_map(|i| ((unit(i as u64).to_bits() >> 16) as u16).to_le_bytes()).collect(),
            Format::Q4x32 => (0..elems / 2).map(|i| hash(i as u64) as u8).collect(),
            _ => (0..elems).map(|i| hash(i as u64) as u8).collect(),
        };
        let scales = vec![0.01f32; format.scale_count(elems as u64) as usize];
        let w = ctx.upload(format, n, n, &data, &scales)?;
        let mut rates = serde_json::Map::new();
        let mut kernel_rates = serde_json::Map::new();
        let weight_bytes = (data.len() + 4 * scales.len()) as f64;
        for t in bench_ts(n) {
            let x: Vec<f32> = (0..t as u64 * n as u64).map(|i| unit(i ^ 0x5eed)).collect();
            let runs = if t >= 512 { 5 } else { 10 };
            let (mut best, mut best_kernel) = (f64::INFINITY, f64::INFINITY);
            // A GPU idles at low clocks and takes a while of steady work to raise them: the
            // same product for 0.3 s first.
            let warm = Instant::now();
            while warm.elapsed().as_secs_f64() < 0.3 {
                ctx.matmul(&x, t, n, std::slice::from_ref(&w))?;
            }
            for _ in 0..runs {
                let start = Instant::now();
                ctx.matmul(&x, t, n, std::slice::from_ref(&w))?;
                best = best.min(start.elapsed().as_secs_f64());
            }
            // Kernels alone: ten back-to-back runs of the product's kernels a call, after one
            // that waits for the input's upload.
            ctx.set_kernel_repeats(10);
            for _ in 0..runs {
                ctx.matmul(&x, t, n, std::slice::from_ref(&w))?;
                if let Some(ns) = ctx.last_kernel_ns().filter(|&ns| ns > 0) {
                    best_kernel = best_kernel.min(ns as f64 / 1e9);
                }
            }
            ctx.set_kernel_repeats(0);
            let flops = 2.0 * t as f64 * elems as f64;
            rates.insert(format!("t{t}"), serde_json::json!(flops / best / 1e9));
            if best_kernel.is_finite() {
                kernel_rates.insert(format!("t{t}"), serde_json::json!(flops / best_kernel / 1e9));
                if t == 1 {
                    gemv_bandwidth
                        .insert(format.name().to_string(), serde_json::json!(weight_bytes / best_kernel / 1e9));
                }
            }
        }
        ctx.release(w);
        formats.insert(format.name().to_string(), serde_json::Value::Object(rates));
        if !kernel_rates.is_empty() {
            kernel.insert(format.name().to_string(), serde_json::Value::Object(kernel_rates));
        }
    }
    let tiny = ctx.upload(Format::F32, 32, 32, &vec![0u8; 32 * 32 * 4], &[])?;
    let mut latency = f64::INFINITY;
    for _ in 0..20 {
        let start = Instant::now();
        ctx.matmul(&[0.5; 32], 1, 32, std::slice::from_ref(&tiny))?;
        latency = latency.min(start.elapsed().as_secs_f64());
    }
    ctx.release(tiny);
    Ok(Some(serde_json::json!({
        "device": device.name, "backend": device.backend, "size": n,
        "gflops": formats, "kernel_gflops": kernel, "kernel_gemv_gbytes_s": gemv_bandwidth,
        "round_trip_us": latency * 1e6,
    })))
}

/// SplitMix64's finalizer: a well-mixed hash of `i`.
fn hash(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A value in [-1, 1) from the hash of `i`.
fn unit(i: u64) -> f32 {
    (hash(i) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// The rows of x the device matmuls are timed at: the models' usual ones, and n (an n^3 product)
/// where n is larger, up to 8192 (x is n^2 floats, sent with every call).
fn bench_ts(n: u32) -> Vec<u32> {
    [1, 16, 128, 512].into_iter().chain((512 < n && n <= 8192).then_some(n)).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Where the time of one phase (prefill or decode) went, per token, from the session's stats
/// before and after it, summed over the runs.
#[derive(Default)]
struct Stages {
    tokens: f64,
    wall_ns: f64,
    cpu_ns: f64,
    cpu_flops: f64,
    cpu_bytes: f64,
    gpu_ns: f64,
    attention_ns: f64,
    output_ns: f64,
}

impl Stages {
    fn add(&mut self, tokens: usize, wall_ns: f64, before: &Stats, after: &Stats) {
        self.tokens += tokens as f64;
        self.wall_ns += wall_ns;
        self.cpu_ns += (after.cpu_ns - before.cpu_ns) as f64;
        self.cpu_flops += (after.cpu_flops - before.cpu_flops) as f64;
        self.cpu_bytes += (after.cpu_bytes - before.cpu_bytes) as f64;
        self.gpu_ns += (after.gpu_ns - before.gpu_ns) as f64;
        self.attention_ns += (after.attention_ns - before.attention_ns) as f64;
        self.output_ns += (after.output_ns - before.output_ns) as f64;
    }

    /// Milliseconds per token of a total in nanoseconds.
    fn ms(&self, ns: f64) -> f64 {
        ns / self.tokens.max(1.0) / 1e6
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "ms_per_token": self.ms(self.wall_ns),
            "cpu_matmul_ms": self.ms(self.cpu_ns),
            "device_matmul_ms": self.ms(self.gpu_ns),
            "attention_ms": self.ms(self.attention_ns),
            "output_projection_ms": self.ms(self.output_ns),
            "cpu_matmul_gflop_s": self.cpu_flops / self.cpu_ns.max(1.0),
            "cpu_weight_gb_s": self.cpu_bytes / self.cpu_ns.max(1.0),
        })
    }

    /// One line: the phase's time per token and where it went.
    fn line(&self, phase: &str) -> String {
        let other = self.wall_ns - self.cpu_ns - self.gpu_ns - self.attention_ns;
        let mut s = format!(
            "{phase:<8} {:6.2} ms/token: CPU matmul {:.2} ({:.1} GFLOP/s, weights at {:.2} GB/s)",
            self.ms(self.wall_ns),
            self.ms(self.cpu_ns),
            self.cpu_flops / self.cpu_ns.max(1.0),
            self.cpu_bytes / self.cpu_ns.max(1.0),
        );
        if self.gpu_ns > 0.0 {
            s += &format!(", device matmul {:.2}", self.ms(self.gpu_ns));
        }
        s += &format!(
            ", attention {:.2}, other {:.2}; output projection {:.2} of these",
            self.ms(self.attention_ns),
            self.ms(other.max(0.0)),
            self.ms(self.output_ns)
        );
        s
    }
}

/// Aggregate prefill and decode rates of `n` sessions advanced together, medians of `runs`:
/// one step feeds every prompt, then `decode` steps sample a token of each (a last step runs
/// the last tokens' passes, as the single-session decode's closing `top` does).
fn parallel(inst: &mut Instance, model: wisp::Model, prompt: &[u32], decode: u32, n: usize, runs: usize) -> Result<(f64, f64)> {
    let n_ctx = (prompt.len() + decode as usize + 1) as u32;
    let mut sessions = Vec::with_capacity(n);
    for _ in 0..n {
        sessions.push(engine(inst.new_session(model, n_ctx)?)?);
    }
    let (mut prefill, mut decoded) = (Vec::new(), Vec::new());
    let step = |inst: &mut Instance, tokens: &[u32], sample: Option<Sampling>| -> Result<()> {
        let work: Vec<Advance> = sessions.iter().map(|&session| Advance { session, tokens, sample }).collect();
        for r in engine(inst.step(model, &work)?)? {
            engine(r)?;
        }
        Ok(())
    };
    for _ in 0..runs {
        for &s in &sessions {
            inst.reset(s)?;
        }
        let start = Instant::now();
        step(inst, prompt, None)?;
        prefill.push((n * prompt.len()) as f64 / start.elapsed().as_secs_f64());
        let start = Instant::now();
        for _ in 0..decode {
            step(inst, &[], Some(Sampling::default()))?;
        }
        step(inst, &[], None)?;
        decoded.push((n * decode as usize) as f64 / start.elapsed().as_secs_f64());
    }
    for s in sessions {
        inst.drop_session(s)?;
    }
    Ok((median(prefill), median(decoded)))
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins \
                    with a single step. To be or not to be, that is the question. ";

pub fn bench(a: BenchArgs) -> Result<()> {
    let constraint = a.constraint.constraint()?;
    let mut constrained = Constrained::default();
    let mut l = load(&a.model)?;
    let (inst, model) = (&mut l.inst, l.model);
    // The model's special prefix (BOS, if it adds one), then the text repeated.
    let mut prompt = engine(inst.tokenize(model, TEXT, true, false)?)?;
    let body = engine(inst.tokenize(model, TEXT, false, false)?)?;
    while prompt.len() < a.prompt_tokens {
        prompt.extend_from_slice(&body);
    }
    prompt.truncate(a.prompt_tokens.max(1));
    let n_ctx = (prompt.len() + a.decode_tokens as usize + 1) as u32;
    let session = engine(inst.new_session(model, n_ctx)?)?;
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    let (mut prefill_stages, mut decode_stages) = (Stages::default(), Stages::default());
    let mut last = None;
    for run in 0..a.runs.max(1) {
        inst.reset(session)?;
        let before = inst.stats(session)?;
        let start = Instant::now();
        engine(inst.feed(session, &prompt)?)?;
        let wall = start.elapsed();
        prefill.push(prompt.len() as f64 / wall.as_secs_f64());
        let fed = inst.stats(session)?;
        prefill_stages.add(prompt.len(), wall.as_nanos() as f64, &before, &fed);
        // Each `next` samples and runs the previous token's forward pass; the last token's
        // pass runs when its logits are asked for: `decode_tokens` passes and samples in all.
        let start = Instant::now();
        for _ in 0..a.decode_tokens {
            engine(inst.next(session, &Sampling::default())?)?;
        }
        engine(inst.top(session, 1)?)?;
        let wall = start.elapsed();
        decode.push(a.decode_tokens as f64 / wall.as_secs_f64());
        let after = inst.stats(session)?;
        decode_stages.add(a.decode_tokens as usize, wall.as_nanos() as f64, &fed, &after);
        if !a.json {
            eprintln!("run {}: prefill {:.1} tok/s, decode {:.1} tok/s", run + 1, prefill[run], decode[run]);
        }
        last = Some(after);
        if let Some(c) = &constraint {
            constrained.run(inst, session, &prompt, c, a.decode_tokens)?;
        }
    }
    let mut parallels = Vec::new();
    for &n in &a.parallel {
        let (pp, tg) = parallel(inst, model, &prompt, a.decode_tokens, n as usize, a.runs.max(1))?;
        if !a.json {
            eprintln!("parallel {n}: prefill {pp:.1} tok/s, decode {tg:.1} tok/s (aggregate)");
        }
        parallels.push(serde_json::json!({ "n": n, "prefill_tok_s": pp, "decode_tok_s": tg }));
    }
    let (p, d) = (median(prefill), median(decode));
    let matmuls = if matches!(a.model.gpu, super::GpuArg::On) && a.matmul_size > 0 { device_matmuls(&a)? } else { None };
    let Some(s) = last else { anyhow::bail!("no run") };
    // Per token, constrained against unconstrained: both timed over all runs' `next` calls.
    let plain_ms = decode_stages.ms(decode_stages.wall_ns);
    let constrained_json = constraint.as_ref().map(|_| {
        let c = &constrained.compiles_ns;
        serde_json::json!({
            "ms_per_token": constrained.ms_per_token(),
            "unconstrained_ms_per_token": plain_ms,
            "ratio": constrained.ms_per_token() / plain_ms,
            "first_compile_ms": c.first().copied().unwrap_or(0) as f64 / 1e6,
            "compile_ms": median(c.iter().skip(1).map(|&ns| ns as f64 / 1e6).collect()),
            "compiles": c.len(),
        })
    });
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": l.path, "runs": a.runs.max(1), "prompt_tokens": prompt.len(), "decode_tokens": a.decode_tokens,
                "prefill_tok_s": p, "decode_tok_s": d, "load_s": l.load_s,
                "precision": format!("{:?}", a.model.precision).to_lowercase(),
                "cpu_matmuls": s.cpu_matmuls, "gpu_calls": s.gpu_calls,
                "gpu_attention_calls": s.gpu_attention_calls, "device_matmul": matmuls,
                "guest_memory_peak_bytes": inst.memory_bytes(),
                "stages": { "prefill": prefill_stages.json(), "decode": decode_stages.json() },
                "constrained": constrained_json,
                "parallel": parallels,
            })
        );
    } else {
        println!("model:   {}", l.path.display());
        println!("load:    {:.2} s ({:?} precision; guest memory {} MiB at most)", l.load_s, a.model.precision, inst.memory_bytes() >> 20);
        println!("prefill: {:.1} tok/s ({} tokens, median of {})", p, prompt.len(), a.runs.max(1));
        println!("decode:  {:.1} tok/s ({} tokens, median of {})", d, a.decode_tokens, a.runs.max(1));
        for r in &parallels {
            println!(
                "parallel {:>3}: prefill {:8.1} tok/s, decode {:8.1} tok/s (aggregate over the sessions, median of {})",
                r["n"],
                r["prefill_tok_s"].as_f64().unwrap_or(0.0),
                r["decode_tok_s"].as_f64().unwrap_or(0.0),
                a.runs.max(1)
            );
        }
        println!(
            "matmuls: {} on the CPU, {} device calls; attention: {} device calls (the {} runs' session)",
            s.cpu_matmuls,
            s.gpu_calls,
            s.gpu_attention_calls,
            a.runs.max(1)
        );
        if let Some(c) = &constrained_json {
            println!(
                "constrained decode: {:.2} ms/token against {:.2} unconstrained ({:.2}x); compiled {} times: \
                 first {:.0} ms (the vocabulary's grammar environment built), then {:.1} ms (median)",
                c["ms_per_token"].as_f64().unwrap_or(0.0),
                plain_ms,
                c["ratio"].as_f64().unwrap_or(0.0),
                c["compiles"],
                c["first_compile_ms"].as_f64().unwrap_or(0.0),
                c["compile_ms"].as_f64().unwrap_or(0.0),
            );
        }
        println!("where the time goes (all runs):");
        println!("  {}", prefill_stages.line("prefill"));
        println!("  {}", decode_stages.line("decode"));
        if let Some(m) = &matmuls {
            for (key, what) in [("gflops", "whole calls"), ("kernel_gflops", "kernels alone, timestamp queries")] {
                let Some(rates) = m[key].as_object().filter(|r| !r.is_empty()) else { continue };
                println!(
                    "device matmul, [{n}, {n}] weight, GFLOP/s, {what} ({}, {}):",
                    m["device"],
                    m["backend"],
                    n = a.matmul_size
                );
                let ts = bench_ts(a.matmul_size);
                let head: String = ts.iter().map(|t| format!(" {:>9}", format!("t={t}"))).collect();
                println!("  {:<6}{head}", "format");
                for (f, r) in rates {
                    let row: String =
                        ts.iter().map(|t| format!(" {:>9.2}", r[format!("t{t}")].as_f64().unwrap_or(0.0))).collect();
                    println!("  {f:<6}{row}");
                }
            }
            if let Some(bw) = m["kernel_gemv_gbytes_s"].as_object().filter(|r| !r.is_empty()) {
                let row: Vec<String> =
                    bw.iter().map(|(f, v)| format!("{f} {:.0}", v.as_f64().unwrap_or(0.0))).collect();
                println!("  t=1, weights read by the kernel alone, GB/s: {}", row.join(", "));
            }
            println!("  round trip of a tiny matmul: {:.0} us", m["round_trip_us"].as_f64().unwrap_or(0.0));
        }
    }
    Ok(())
}
