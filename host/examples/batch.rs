//! Several sessions served at once (continuous batching): each prompt in its own session, all of
//! them advanced together by `Instance::step`, one forward pass for the rows of all; a session
//! that ends leaves, the others go on. Each completion is the one its prompt gets alone.
//! Usage: `cargo run --release --example batch -- [MODEL.gguf] [PROMPT...]`.

use anyhow::{Result, anyhow};
use std::path::PathBuf;
use wisp::{Advance, GpuCtx, GpuMode, Options, Sampling, Wisp};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let path = match args.next() {
        Some(p) => PathBuf::from(p),
        None => wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, true)?,
    };
    let mut prompts: Vec<String> = args.collect();
    if prompts.is_empty() {
        prompts = ["The capital of France is", "Water boils at", "The largest planet is", "Once upon a time"].map(String::from).into();
    }

    let wisp = Wisp::new(Options::default())?;
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent())?;
    let model = inst.open_model(&path, GpuMode::Off)?.map_err(|e| anyhow!("{e}"))?;

    // One session a prompt; its tokens go in with the first step.
    let mut live = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let tokens = inst.tokenize(model, p, true, false)?.map_err(|e| anyhow!("{e}"))?;
        let session = inst.new_session(model, tokens.len() as u32 + 32)?.map_err(|e| anyhow!("{e}"))?;
        live.push((i, session, tokens, Vec::new()));
    }
    let mut done = vec![Vec::new(); prompts.len()];
    for _ in 0..24 {
        if live.is_empty() {
            break;
        }
        // Every live session in one step: its prompt (the first time), then a greedy token.
        let work: Vec<Advance> =
            live.iter().map(|(_, s, prompt, _)| Advance { session: *s, tokens: prompt, sample: Some(Sampling::default()) }).collect();
        let results = inst.step(model, &work)?.map_err(|e| anyhow!("{e}"))?;
        let mut still = Vec::new();
        for ((i, s, _, mut text), r) in live.into_iter().zip(results) {
            let step = r.map_err(|e| anyhow!("{e}"))?.ok_or_else(|| anyhow!("no token"))?;
            text.extend_from_slice(&step.piece);
            if step.end_of_generation {
                done[i] = text;
                inst.drop_session(s)?;
            } else {
                still.push((i, s, Vec::new(), text));
            }
        }
        live = still;
    }
    for (i, _, _, text) in live {
        done[i] = text;
    }
    for (p, text) in prompts.iter().zip(done) {
        println!("{p}{}", String::from_utf8_lossy(&text).replace('\n', " "));
    }
    Ok(())
}
