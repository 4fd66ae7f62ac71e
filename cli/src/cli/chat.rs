//! `wisp chat`: a conversation rendered by the model's own chat template (inside the guest),
//! one reply per user message, each ending at the model's end-of-generation token.
//!
//! The session's KV cache carries over between turns: each turn renders the whole conversation,
//! and only the tokens past what the cache already holds are fed.

use super::{DEAD_END, ModelArgs, SamplingArgs, engine, flush_utf8, load};
use anyhow::{Context, Result, bail};
use clap::Args;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use wisp::{ChatTemplate, Constraint, EngineError, Instance, Model, Sampling, Session};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens to generate at most per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    n_predict: u32,
    /// A system message that opens the conversation.
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// Context size in tokens, for the whole conversation (0: the model's training context).
    #[arg(long, default_value_t = 4096)]
    ctx: u32,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print token counts and speeds on stderr after each reply.
    #[arg(long)]
    stats: bool,
    /// Print each rendered prompt (the whole conversation, as the template writes it) on stderr.
    #[arg(long)]
    show_prompt: bool,
    /// The chat template: a built-in one's name (chatml, gemma, llama3) or a file holding a Jinja
    /// template [default: the model's own]
    #[arg(long, value_name = "NAME|FILE")]
    chat_template: Option<String>,
    /// The user's message: one reply, then exit. Without it, each line read from stdin is a
    /// message (`/reset` starts over, `/exit` or end of input ends).
    prompt: Option<String>,
}

/// A conversation and the session that holds its tokens.
struct Chat {
    inst: Instance,
    model: Model,
    session: Session,
    capacity: u32,
    bos: Option<u32>,
    system: Option<String>,
    messages: Vec<(String, String)>,
    /// Every token in the session's context, in order.
    context: Vec<u32>,
    sampling: Sampling,
    /// What each reply must spell, compiled anew for each.
    constraint: Option<Constraint>,
    n_predict: u32,
    stats: bool,
    show_prompt: bool,
}

/// Set by Ctrl-C: the reply stops after the current token.
struct Interrupt {
    stop: Arc<AtomicBool>,
    generating: Arc<AtomicBool>,
}

impl Interrupt {
    /// Ctrl-C during a reply stops it; at the prompt, or twice, it exits.
    fn install() -> Interrupt {
        let stop = Arc::new(AtomicBool::new(false));
        let generating = Arc::new(AtomicBool::new(false));
        let (s, g) = (stop.clone(), generating.clone());
        let _ = ctrlc::set_handler(move || {
            if !g.load(Ordering::SeqCst) || s.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
        });
        Interrupt { stop, generating }
    }
}

impl Chat {
    fn reset(&mut self) -> Result<()> {
        self.messages.clear();
        if let Some(s) = &self.system {
            self.messages.push(("system".into(), s.clone()));
        }
        self.inst.reset(self.session)?;
        self.context.clear();
        Ok(())
    }

    /// The conversation with `user` appended, as tokens ending with the assistant's turn opening.
    fn prompt_tokens(&mut self, user: &str) -> Result<Vec<u32>> {
        self.messages.push(("user".into(), user.to_string()));
        let text = engine(self.inst.apply_chat_template(self.model, &self.messages, true)?);
        if let (true, Ok(text)) = (self.show_prompt, &text) {
            eprintln!("{text}");
        }
        let tokens = text.and_then(|text| engine(self.inst.tokenize(self.model, &text, true, true)?));
        let mut tokens = match tokens {
            Ok(t) => t,
            Err(e) => {
                self.messages.pop();
                return Err(e);
            }
        };
        wisp_api::drop_doubled_bos(&mut tokens, self.bos);
        if tokens.len() as u32 >= self.capacity {
            self.messages.pop();
            let why = format!(
                "the conversation ({} tokens) does not fit in the context of {} tokens (--ctx sets it; /reset starts over)",
                tokens.len(),
                self.capacity
            );
            return Err(EngineError::ContextFull(why).into());
        }
        Ok(tokens)
    }

    /// Streams the reply to `user` to `out` and adds both to the conversation.
    fn turn(&mut self, user: &str, out: &mut impl Write, interrupt: &Interrupt) -> Result<()> {
        let tokens = self.prompt_tokens(user)?;
        let before = self.inst.stats(self.session)?;
        // Feed only what the cache does not hold yet; a conversation that re-tokenizes
        // differently from what was generated starts the cache over.
        let kept = if tokens.starts_with(&self.context) {
            self.context.len()
        } else {
            self.inst.reset(self.session)?;
            0
        };
        engine(self.inst.feed(self.session, &tokens[kept..])?)?;
        engine(self.inst.constrain(self.session, self.constraint.as_ref())?)?;
        self.context = tokens;
        let budget = self.n_predict.min(self.capacity - self.context.len() as u32);
        let (mut reply, mut pending) = (Vec::new(), Vec::new());
        interrupt.stop.store(false, Ordering::SeqCst);
        interrupt.generating.store(true, Ordering::SeqCst);
        let mut ended = false;
        for _ in 0..budget {
            if interrupt.stop.load(Ordering::SeqCst) {
                break;
            }
            let step = engine(self.inst.next(self.session, &self.sampling)?)?;
            if step.dead_end {
                eprintln!("\n{DEAD_END}");
                ended = true;
                break;
            }
            self.context.push(step.token);
            if step.end_of_generation {
                ended = true;
                break;
            }
            reply.extend_from_slice(&step.piece);
            pending.extend_from_slice(&step.piece);
            flush_utf8(out, &mut pending)?;
        }
        interrupt.generating.store(false, Ordering::SeqCst);
        if !pending.is_empty() {
            out.write_all(String::from_utf8_lossy(&pending).as_bytes())?;
        }
        writeln!(out)?;
        out.flush()?;
        if interrupt.stop.load(Ordering::SeqCst) {
            eprintln!("[interrupted]");
        } else if !ended {
            eprintln!("[stopped after {budget} tokens]");
        }
        self.messages.push(("assistant".into(), String::from_utf8_lossy(&reply).into_owned()));
        if self.stats {
            let s = self.inst.stats(self.session)?;
            let rate = |n: u64, ns: u64| if ns == 0 { 0.0 } else { n as f64 * 1e9 / ns as f64 };
            let (pt, pns) = (s.prefill_tokens - before.prefill_tokens, s.prefill_ns - before.prefill_ns);
            let (dt, dns) = (s.decode_tokens - before.decode_tokens, s.decode_ns - before.decode_ns);
            eprintln!(
                "[prompt {pt} tokens, {:.1} tok/s | reply {dt} tokens, {:.1} tok/s | context {}/{} | seed {}]",
                rate(pt, pns),
                rate(dt, dns),
                self.context.len(),
                self.capacity,
                self.sampling.seed
            );
        }
        Ok(())
    }
}

pub fn chat(mut a: ChatArgs) -> Result<()> {
    let constraint = a.sampling.constraint.constraint()?;
    // A template from a file, read before the model loads: a wrong path fails at once.
    let template = match &a.chat_template {
        Some(t) if std::path::Path::new(t).is_file() => {
            Some(std::fs::read_to_string(t).with_context(|| format!("cannot read the chat template {t}"))?)
        }
        Some(t) if t.contains('/') || t.ends_with(".jinja") => bail!("cannot read the chat template {t}: no such file"),
        other => other.clone(),
    };
    // Without --model, an instruction-tuned model with a chat template (the default Gemma 3
    // 270M is a base model).
    if a.model.model.is_none() {
        a.model.model = Some(wisp::fetch::QWEN25_CODER_05B.name.into());
    }
    let loaded = load(&a.model)?;
    let (mut inst, model) = (loaded.inst, loaded.model);
    if let Some(t) = &template {
        engine(inst.set_chat_template(model, t)?).context("--chat-template")?;
    }
    let info = inst.model_info(model)?;
    let name = if info.name.is_empty() { loaded.path.display().to_string() } else { info.name.clone() };
    match (&info.chat_template, &template) {
        (Some(ChatTemplate::Builtin(builtin)), None) => eprintln!(
            "wisp: {name} has no chat template of its own: using the built-in `{builtin}` template, which it may not have \
             been trained on (--chat-template NAME|FILE sets another)"
        ),
        (None, None) => bail!("{name} has no chat template (--chat-template NAME|FILE gives it one: chatml, gemma, llama3 or a Jinja file)"),
        _ => {}
    }
    let capacity = if a.ctx == 0 { info.n_ctx_train } else { a.ctx.min(info.n_ctx_train) };
    let session = engine(inst.new_session(model, capacity)?)?;
    let sampling = a.sampling.sampling();
    let mut chat = Chat {
        inst,
        model,
        session,
        capacity,
        bos: info.bos,
        system: a.system,
        messages: Vec::new(),
        context: Vec::new(),
        sampling,
        constraint,
        n_predict: a.n_predict,
        stats: a.stats,
        show_prompt: a.show_prompt,
    };
    chat.reset()?;
    let interrupt = Interrupt::install();
    let mut out = std::io::stdout().lock();
    if let Some(prompt) = &a.prompt {
        return chat.turn(prompt, &mut out, &interrupt);
    }
    let stdin = std::io::stdin();
    let terminal = stdin.is_terminal();
    if terminal {
        eprintln!("{} — one message per line; /reset starts over, /exit or Ctrl-D ends.", info.name);
    }
    let mut lines = stdin.lock().lines();
    loop {
        if terminal {
            eprint!("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                chat.reset()?;
                continue;
            }
            _ => {}
        }
        if let Err(e) = chat.turn(&line, &mut out, &interrupt) {
            // The conversation outgrew the context, or the template refused it: say so, go on.
            if e.downcast_ref::<EngineError>().is_none() {
                return Err(e);
            }
            eprintln!("wisp: error: {e:#}");
        }
        if terminal {
            writeln!(out)?;
        }
    }
    Ok(())
}
