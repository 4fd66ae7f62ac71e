//! `wisp bench`: prefill and decode speed, median of several runs.

use super::{ModelArgs, engine, load};
use anyhow::Result;
use clap::Args;
use std::time::Instant;
use wisp::Sampling;

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
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
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

const TEXT: &str = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins \
                    with a single step. To be or not to be, that is the question. ";

pub fn bench(a: BenchArgs) -> Result<()> {
    let mut l = load(&a.model)?;
    let (inst, model) = (&mut l.inst, l.model);
    let mut prompt = engine(inst.tokenize(model, TEXT, true, false)?)?;
    let body = prompt[1..].to_vec();
    while prompt.len() < a.prompt_tokens {
        prompt.extend_from_slice(&body);
    }
    prompt.truncate(a.prompt_tokens.max(1));
    let n_ctx = (prompt.len() + a.decode_tokens as usize + 1) as u32;
    let session = engine(inst.new_session(model, n_ctx)?)?;
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    let mut last = None;
    for run in 0..a.runs.max(1) {
        inst.reset(session)?;
        let start = Instant::now();
        engine(inst.feed(session, &prompt)?)?;
        prefill.push(prompt.len() as f64 / start.elapsed().as_secs_f64());
        // Each `next` samples and runs the previous token's forward pass; the last token's
        // pass runs when its logits are asked for: `decode_tokens` passes and samples in all.
        let start = Instant::now();
        for _ in 0..a.decode_tokens {
            engine(inst.next(session, &Sampling::default())?)?;
        }
        engine(inst.top(session, 1)?)?;
        decode.push(a.decode_tokens as f64 / start.elapsed().as_secs_f64());
        let after = inst.stats(session)?;
        if !a.json {
            eprintln!("run {}: prefill {:.1} tok/s, decode {:.1} tok/s", run + 1, prefill[run], decode[run]);
        }
        last = Some(after);
    }
    let (p, d) = (median(prefill), median(decode));
    let s = last.expect("at least one run");
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": l.path, "runs": a.runs.max(1), "prompt_tokens": prompt.len(), "decode_tokens": a.decode_tokens,
                "prefill_tok_s": p, "decode_tok_s": d, "load_s": l.load_s,
                "cpu_matmuls": s.cpu_matmuls, "gpu_calls": s.gpu_calls,
            })
        );
    } else {
        println!("model:   {}", l.path.display());
        println!("load:    {:.2} s", l.load_s);
        println!("prefill: {:.1} tok/s ({} tokens, median of {})", p, prompt.len(), a.runs.max(1));
        println!("decode:  {:.1} tok/s ({} tokens, median of {})", d, a.decode_tokens, a.runs.max(1));
    }
    Ok(())
}
