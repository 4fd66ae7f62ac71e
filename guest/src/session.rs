//! A session: one KV cache, the logits of its last position, the tokens so far, counters.

use crate::constraint::{Allowed, Constraint, Spec};
use crate::dispatch::{Counters, Dispatch};
use crate::engine::{Arch, Error, Model, can_allocate};
use crate::models::{gemma3, phi3, qwen2};
use crate::sampler::{Params, Sampler};
use std::rc::Rc;
use std::time::Instant;

/// Tokens per forward pass during prefill: bounds the scratch memory of a session.
pub const BATCH: usize = 64;
/// The same with weights on a device: each pass is a round trip per batch of products (and
/// of attention), so fewer, larger passes; the device's kernels also run best on them.
pub const DEVICE_BATCH: usize = 512;

enum State {
    Gemma3(gemma3::State),
    Qwen2(qwen2::State),
    Phi3(phi3::State),
}

impl State {
    fn n_ctx(&self) -> usize {
        match self {
            State::Gemma3(s) => s.n_ctx,
            State::Qwen2(s) => s.n_ctx,
            State::Phi3(s) => s.n_ctx,
        }
    }

    fn batch(&self) -> usize {
        match self {
            State::Gemma3(s) => s.batch,
            State::Qwen2(s) => s.batch,
            State::Phi3(s) => s.batch,
        }
    }

    fn logits(&self) -> &[f32] {
        match self {
            State::Gemma3(s) => &s.buf.logits,
            State::Qwen2(s) => &s.buf.logits,
            State::Phi3(s) => &s.buf.logits,
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub prefill_tokens: u64,
    pub prefill_ns: u64,
    pub decode_tokens: u64,
    pub decode_ns: u64,
    pub dispatch: Counters,
}

pub struct Session {
    model: Rc<Model>,
    state: State,
    dispatch: Dispatch,
    sampler: Sampler,
    /// What the generated tokens must spell, if anything.
    constraint: Option<Constraint>,
    /// Every token in the context, the pending one included.
    history: Vec<u32>,
    /// Tokens whose forward pass has run (`history[..done]`).
    done: usize,
    stats: Stats,
}

pub struct Step {
    pub token: u32,
    pub piece: Vec<u8>,
    pub end_of_generation: bool,
    /// The constraint admitted no token: nothing was appended.
    pub dead_end: bool,
}

impl Session {
    pub fn new(model: Rc<Model>, n_ctx: usize) -> Result<Session, Error> {
        let n_ctx = if n_ctx == 0 { model.n_ctx_train() } else { n_ctx };
        if n_ctx > model.n_ctx_train() {
            return Err(Error::InvalidArgument(format!(
                "context of {n_ctx} tokens exceeds the model's {}",
                model.n_ctx_train()
            )));
        }
        // Estimate first so that a context too large for guest memory is an error.
        let need = n_ctx.saturating_mul(model.arch.hparams().kv_bytes_per_token());
        if !can_allocate(need) {
            return Err(Error::OutOfMemory(format!(
                "a context of {n_ctx} tokens needs {} MiB of KV cache",
                need >> 20
            )));
        }
        let batch = if model.gpu_weights > 0 { DEVICE_BATCH } else { BATCH }.min(n_ctx);
        let state = match &model.arch {
            Arch::Gemma3 { config, weights } => State::Gemma3(gemma3::State::new(config, weights, n_ctx, batch)),
            Arch::Qwen2 { config, weights } => State::Qwen2(qwen2::State::new(config, weights, n_ctx, batch)),
            Arch::Phi3 { config, weights } => State::Phi3(phi3::State::new(config, weights, n_ctx, batch)),
        };
        let dispatch = Dispatch::new(model.gpu.clone());
        Ok(Session {
            model,
            state,
            dispatch,
            sampler: Sampler::default(),
            constraint: None,
            history: Vec::new(),
            done: 0,
            stats: Stats::default(),
        })
    }

    pub fn capacity(&self) -> usize {
        self.state.n_ctx()
    }

    pub fn position(&self) -> usize {
        self.history.len()
    }

    pub fn reset(&mut self) {
        self.history.clear();
        self.done = 0;
        self.constraint = None;
    }

    /// Constrains the tokens of the following `next` calls (none: unconstrained).
    pub fn constrain(&mut self, spec: Option<&Spec>) -> Result<(), Error> {
        self.constraint = match spec {
            None => None,
            Some(spec) => Some(self.model.grammars()?.compile(spec).map_err(Error::InvalidConstraint)?),
        };
        Ok(())
    }

    pub fn stats(&self) -> Stats {
        Stats { dispatch: self.dispatch.counters, ..self.stats }
    }

    /// Appends `tokens` and runs them, leaving the logits of the last one.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<(), Error> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("no tokens to feed".into()));
        }
        let n_vocab = self.model.n_vocab();
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(Error::InvalidArgument(format!(
                "token id {bad} is not below the vocabulary size {n_vocab}"
            )));
        }
        if self.history.len() + tokens.len() > self.capacity() {
            return Err(Error::ContextFull(format!(
                "{} tokens in context + {} new exceed the capacity of {}",
                self.history.len(),
                tokens.len(),
                self.capacity()
            )));
        }
        let start = Instant::now();
        let before = self.history.len() - self.done;
        self.history.extend_from_slice(tokens);
        self.run()?;
        self.stats.prefill_tokens += (tokens.len() + before) as u64;
        self.stats.prefill_ns += start.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Runs the forward pass over every token not yet run.
    fn run(&mut self) -> Result<(), Error> {
        if self.done == self.history.len() {
            return Ok(());
        }
        let model = Rc::clone(&self.model);
        let batch = self.state.batch();
        while self.done < self.history.len() {
            let n = (self.history.len() - self.done).min(batch);
            let last = self.done + n == self.history.len();
            let tokens = &self.history[self.done..self.done + n];
            let d = &mut self.dispatch;
            let ran = match (&model.arch, &mut self.state) {
                (Arch::Gemma3 { config, weights }, State::Gemma3(s)) => {
                    gemma3::forward(config, weights, s, d, tokens, self.done, last)
                }
                (Arch::Qwen2 { config, weights }, State::Qwen2(s)) => {
                    qwen2::forward(config, weights, s, d, tokens, self.done, last)
                }
                (Arch::Phi3 { config, weights }, State::Phi3(s)) => {
                    phi3::forward(config, weights, s, d, tokens, self.done, last)
                }
                _ => return Err(Error::InvalidArgument("the session belongs to another model".into())),
            };
            if !ran {
                // The device kept keys the guest's cache lacks, and cannot go on: the history
                // runs again, here, from its start (the same tokens, later).
                self.done = 0;
                continue;
            }
            self.done += n;
        }
        Ok(())
    }

    /// The logits after the last token.
    pub fn logits(&mut self) -> Result<&[f32], Error> {
        if self.history.is_empty() {
            return Err(Error::InvalidArgument("no token has been fed".into()));
        }
        self.run()?;
        Ok(self.state.logits())
    }

    /// Samples a token from the current logits and appends it (its forward pass is deferred).
    pub fn next(&mut self, params: &Params) -> Result<Step, Error> {
        params.check().map_err(Error::InvalidArgument)?;
        if self.history.len() >= self.capacity() {
            return Err(Error::ContextFull(format!(
                "the context of {} tokens is full",
                self.capacity()
            )));
        }
        let start = Instant::now();
        let model = Rc::clone(&self.model);
        // A greedy step needs the largest logit alone: the device may read back just that.
        let penalized = params.repeat_penalty != 1.0 && params.repeat_last_n > 0;
        self.dispatch.greedy = self.constraint.is_none() && params.temperature <= 0.0 && !penalized;
        self.dispatch.top = None;
        let ran = self.logits().map(|_| ());
        self.dispatch.greedy = false;
        ran?;
        let logits = self.state.logits();
        let token = match (&mut self.constraint, self.dispatch.top.take()) {
            (None, Some(token)) => token,
            (None, None) => self.sampler.sample(logits, &self.history, params),
            (Some(c), _) => match c.allowed(logits).map_err(Error::InvalidConstraint)? {
                Allowed::Logits(masked) => {
                    let token = self.sampler.sample(masked, &self.history, params);
                    c.consume(token).map_err(Error::InvalidConstraint)?;
                    token
                }
                Allowed::None => {
                    let eos = model.tokenizer.eos.unwrap_or(0);
                    return Ok(Step { token: eos, piece: Vec::new(), end_of_generation: true, dead_end: true });
                }
            },
        };
        self.history.push(token);
        // Decode time includes the deferred forward pass of the previous generated token.
        self.stats.decode_ns += start.elapsed().as_nanos() as u64;
        self.stats.decode_tokens += 1;
        Ok(Step {
            token,
            piece: model.tokenizer.piece(token, false),
            end_of_generation: model.tokenizer.is_eog(token),
            dead_end: false,
        })
    }
}
