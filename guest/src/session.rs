//! A session: one KV cache, the logits of its last position, the tokens so far, counters.

use crate::constraint::{Allowed, Constraint, Spec};
use crate::dispatch::{self, Counters, DeviceProgram, Dispatch, Member, Pass};
use crate::engine::{Error, Model, PassParts, can_allocate};
use crate::models::{self, LoadError, State, embed, rope};
use crate::program::cpu::{self, Values};
use crate::sampler::{self, Params, Sampler};
use std::rc::Rc;
use std::time::Instant;

/// Tokens per forward pass during prefill: bounds the scratch memory of a session.
pub const BATCH: usize = 64;
/// The same with weights on a device: each pass is a round trip per batch of products (and
/// of attention), so fewer, larger passes; the device's kernels also run best on them.
pub const DEVICE_BATCH: usize = 512;

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
    /// The log-probabilities `Params::logprobs` asked for: the picked token's, and the most
    /// likely tokens'.
    pub logprobs: Option<(f32, Vec<(u32, f32)>)>,
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
        // Estimate first so that a context too large for guest memory is an error (where the
        // device holds the model, its keys and values live there: the device's budget says).
        let need = n_ctx.saturating_mul(model.arch.hparams().kv_bytes_per_token());
        if !model.on_device() && !can_allocate(need) {
            return Err(Error::OutOfMemory(format!(
                "a context of {n_ctx} tokens needs {} MiB of KV cache",
                need >> 20
            )));
        }
        let batch = if model.gpu_weights > 0 { DEVICE_BATCH } else { BATCH }.min(n_ctx);
        let state = State::new(model.arch.as_ref(), &model.recipe, n_ctx, batch, model.on_device(), true);
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

    /// Whether the session is one of `model`'s.
    pub fn belongs_to(&self, model: &Rc<Model>) -> bool {
        Rc::ptr_eq(&self.model, model)
    }

    pub fn capacity(&self) -> usize {
        self.state.n_ctx
    }

    pub fn position(&self) -> usize {
        self.history.len()
    }

    /// Forgets every token and the constraint; the sampler starts again as a new session's.
    pub fn reset(&mut self) {
        self.history.clear();
        self.done = 0;
        self.constraint = None;
        self.sampler = Sampler::default();
    }

    /// Keeps the first `k` tokens of the context and forgets the rest; the keys and values of
    /// those kept are reused where the caches still hold them. The last kept token's pass runs
    /// again at the next call that needs its logits. Removes the constraint (its state follows
    /// the tokens it saw); the sampler starts again as a new session's (a seed gives the
    /// draws it gives a new session).
    pub fn truncate(&mut self, k: usize) -> Result<(), Error> {
        if k > self.history.len() {
            return Err(Error::InvalidArgument(format!("cannot keep {k} tokens of a context of {}", self.history.len())));
        }
        self.constraint = None;
        self.sampler = Sampler::default();
        self.history.truncate(k);
        self.rewind();
        Ok(())
    }

    /// `precision: fast` for this session's products on the guest's CPU (int8 activations
    /// where the weight's format allows; see `Dispatch::fast`). Its handle's load option.
    pub fn set_fast(&mut self, fast: bool) {
        self.dispatch.fast = fast;
    }

    /// A new session of the same model and capacity whose context is a copy of this one's
    /// first `k` tokens: the guest's caches copied, so that only what they lack runs again
    /// (a device's caches are not copied: where the device alone holds keys, the copy runs
    /// its context again).
    pub fn fork(&self, k: usize) -> Result<Session, Error> {
        if k > self.history.len() {
            return Err(Error::InvalidArgument(format!("cannot copy {k} tokens of a context of {}", self.history.len())));
        }
        let mut s = Session::new(Rc::clone(&self.model), self.capacity())?;
        s.set_fast(self.dispatch.fast);
        if s.state.batch != self.state.batch {
            return Err(Error::InvalidArgument("the copy's caches differ from the session's".into()));
        }
        let mine = &self.state.cache;
        let (theirs, _) = s.state.parts();
        for (to, from) in theirs.iter_mut().zip(mine) {
            to.k.copy_from_slice(&from.k);
            to.v.copy_from_slice(&from.v);
        }
        s.history = self.history[..k].to_vec();
        s.done = self.done;
        s.dispatch.follow(&self.dispatch);
        s.rewind();
        Ok(s)
    }

    /// After the context shrank to `history`: the passes from where the caches still serve.
    /// The last token's pass runs again (its logits, which a greedy step on the device may not
    /// have read back); from the start where a sliding window's ring has lost keys that the
    /// tokens from there on see (as `Dispatch::ring_holds` makes a session do for the device).
    fn rewind(&mut self) {
        let k = self.history.len();
        self.dispatch.top = None;
        if self.done < k {
            return;
        }
        let from = k.saturating_sub(1);
        let written = self.done;
        let (caches, _) = self.state.parts();
        // A ring slot holds the last position written to it: position `p` is still there when
        // no later one of the same slot was written (`p + cap >= written`).
        let holds = caches.iter().all(|c| {
            let lowest = (from + 1).saturating_sub(c.window.unwrap_or(usize::MAX));
            lowest >= from || lowest + c.cap >= written
        });
        self.done = if holds { from } else { 0 };
        self.dispatch.rewind(self.done);
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
        self.check_tokens(tokens)?;
        let start = Instant::now();
        let before = self.history.len() - self.done;
        self.history.extend_from_slice(tokens);
        self.run()?;
        self.stats.prefill_tokens += (tokens.len() + before) as u64;
        self.stats.prefill_ns += start.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Whether `tokens` may be appended: each in the vocabulary, all within the capacity.
    fn check_tokens(&self, tokens: &[u32]) -> Result<(), Error> {
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
        Ok(())
    }

    /// Runs the forward pass over every token not yet run.
    fn run(&mut self) -> Result<(), Error> {
        if self.done == self.history.len() {
            return Ok(());
        }
        let model = Rc::clone(&self.model);
        let batch = self.state.batch;
        while self.done < self.history.len() {
            let n = (self.history.len() - self.done).min(batch);
            let last = self.done + n == self.history.len();
            let tokens = &self.history[self.done..self.done + n];
            let d = &mut self.dispatch;
            let want = if last { models::Want::Logits } else { models::Want::Nothing };
            let ran = models::forward(model.arch.as_ref(), &model.recipe, &mut self.state, d, tokens, self.done, want)?;
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
        Ok(&self.state.buf.logits)
    }

    /// Samples a token from the current logits and appends it (its forward pass is deferred).
    pub fn next(&mut self, params: &Params) -> Result<Step, Error> {
        self.check_next(params, 0)?;
        let start = Instant::now();
        // A greedy step needs the largest logit alone: the device may read back just that.
        self.dispatch.greedy = self.greedy(params);
        self.dispatch.top = None;
        let ran = self.logits().map(|_| ());
        self.dispatch.greedy = false;
        ran?;
        let step = self.pick(params)?;
        // Decode time includes the deferred forward pass of the previous generated token.
        self.stats.decode_ns += start.elapsed().as_nanos() as u64;
        Ok(step)
    }

    /// Whether sampling with `params` takes the largest logit, nothing changing the logits
    /// first (no constraint, no repeat penalty).
    fn greedy(&self, params: &Params) -> bool {
        let penalized = params.repeat_penalty != 1.0 && params.repeat_last_n > 0;
        self.constraint.is_none() && params.temperature <= 0.0 && !penalized && params.logprobs.is_none()
    }

    /// Whether `next` may sample with `params` once `more` tokens are appended.
    fn check_next(&self, params: &Params, more: usize) -> Result<(), Error> {
        params.check().map_err(Error::InvalidArgument)?;
        if self.history.len() + more >= self.capacity() {
            return Err(Error::ContextFull(format!(
                "the context of {} tokens is full",
                self.capacity()
            )));
        }
        Ok(())
    }

    /// `next`'s choice from the logits of the last token, which have run, and its appending.
    fn pick(&mut self, params: &Params) -> Result<Step, Error> {
        let model = Rc::clone(&self.model);
        let logits = &self.state.buf.logits;
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
                    return Ok(Step { token: eos, piece: Vec::new(), end_of_generation: true, dead_end: true, logprobs: None });
                }
            },
        };
        // The model's own distribution: the logits as the pass left them (a greedy step on the
        // device is never asked for these: see `greedy`).
        let logprobs = params.logprobs.map(|k| sampler::logprobs(&self.state.buf.logits, token, k as usize));
        self.history.push(token);
        self.stats.decode_tokens += 1;
        Ok(Step {
            token,
            piece: model.tokenizer.piece(token, false),
            end_of_generation: model.tokenizer.is_eog(token),
            dead_end: false,
            logprobs,
        })
    }
}

/// Token rows of a batched step's pass at most (its sessions' rows together): a session's own
/// rows in a pass are at most its batch (`BATCH`), as in its own passes.
pub const STEP_ROWS: usize = 4 * BATCH;

/// One session's part of a batched step ([`step`]).
pub struct Advance<'a> {
    pub session: &'a mut Session,
    /// Appended before the pass, as `feed` appends them; may be empty.
    pub tokens: &'a [u32],
    /// Samples a token after the pass, as `next` does; `None` takes in the tokens alone.
    pub sample: Option<Params>,
}

/// What a model keeps for its batched steps on the CPU, made by the first and grown as needed.
#[derive(Default)]
pub struct StepScratch {
    /// The products' dispatcher (each session's attention goes through its own).
    dispatch: Dispatch,
    values: Option<Values>,
    scores: Vec<f32>,
}

/// Advances the sessions of `work` (all of `model`, each at most once) together: each appends
/// its tokens, then every row they have not run (their new tokens, and the token a previous
/// `next` appended) goes through the model, the rows of all of them in the same passes, and
/// each session that asks samples its next token from its logits. One result per session: an
/// error leaves that session as it was (its checks are `feed`'s and `next`'s). A session's
/// logits and tokens are those it would have alone: on the guest's CPU its rows share each
/// pass's products, which are batch-invariant; a model whose program is on a device runs the
/// rows of all in runs of the program over their sequences (batch-invariant where the device
/// is), each with its own device caches; what the device does not take runs session by session.
pub fn step(model: &Rc<Model>, fast: bool, work: &mut [Advance<'_>]) -> Vec<Result<Option<Step>, Error>> {
    let start = Instant::now();
    let mut results: Vec<Result<Option<Step>, Error>> = Vec::with_capacity(work.len());
    let mut fed = Vec::with_capacity(work.len());
    for a in work.iter_mut() {
        let s = &mut *a.session;
        let admitted = if !Rc::ptr_eq(&s.model, model) {
            Err(Error::InvalidArgument("the session belongs to another model".into()))
        } else if s.dispatch.fast != fast {
            // One pass's products run at one precision.
            Err(Error::InvalidArgument("the session was made by a model handle of another precision".into()))
        } else if a.sample.is_some() && s.history.is_empty() && a.tokens.is_empty() {
            Err(Error::InvalidArgument("no token has been fed".into()))
        } else {
            s.check_tokens(a.tokens).and_then(|()| a.sample.as_ref().map_or(Ok(()), |p| s.check_next(p, a.tokens.len())))
        };
        fed.push(s.history.len() - s.done + a.tokens.len());
        if admitted.is_ok() {
            s.history.extend_from_slice(a.tokens);
        }
        results.push(admitted.map(|()| None));
    }
    let live: Vec<bool> = results.iter().map(Result::is_ok).collect();
    let parts = model.pass_parts();
    match &parts.recipe.device {
        Some(prog) => run_on_device(model, &parts, prog, work, &live),
        None => run_together(model, &parts, work, &live),
    }
    // What the device did not run (or all of it, after a failure) runs session by session.
    for (a, r) in work.iter_mut().zip(results.iter_mut()).filter(|(_, r)| r.is_ok()) {
        if let Err(e) = a.session.run() {
            *r = Err(e);
        }
    }
    let forward = start.elapsed().as_nanos() as u64;
    for ((a, r), fed) in work.iter_mut().zip(results.iter_mut()).zip(fed) {
        if r.is_err() {
            continue;
        }
        let s = &mut *a.session;
        if !a.tokens.is_empty() {
            s.stats.prefill_tokens += fed as u64;
            s.stats.prefill_ns += forward;
        }
        if let Some(params) = &a.sample {
            let picking = Instant::now();
            *r = s.pick(params).map(Some);
            let ran = if a.tokens.is_empty() { forward } else { 0 };
            s.stats.decode_ns += ran + picking.elapsed().as_nanos() as u64;
        }
    }
    results
}

/// The forward passes of a step on the guest's CPU: every row the `live` sessions have not
/// run, in passes of at most `STEP_ROWS` rows, each session's rows in order. A session's
/// logits are computed with its last row (as `feed` computes them).
fn run_together(model: &Model, parts: &PassParts<'_>, work: &mut [Advance<'_>], live: &[bool]) {
    let (p, plan) = (&parts.recipe.program, &parts.recipe.plan);
    let mut scratch = model.step_scratch.borrow_mut();
    let StepScratch { dispatch, values, scores } = &mut *scratch;
    // The sessions of a step share one precision (`step` admits no other).
    dispatch.fast = work.iter().zip(live).find(|(_, live)| **live).is_some_and(|(a, _)| a.session.dispatch.fast);
    loop {
        // This pass: each session's next rows, in order, while the pass has room.
        let mut room = STEP_ROWS;
        let take: Vec<usize> = work
            .iter()
            .zip(live)
            .map(|(a, &live)| {
                let s = &a.session;
                let n = if live { (s.history.len() - s.done).min(s.state.batch).min(room) } else { 0 };
                room -= n;
                n
            })
            .collect();
        if room == STEP_ROWS {
            return;
        }
        let rows = STEP_ROWS - room;
        let wants = |a: &Advance<'_>, n: usize| n > 0 && a.session.done + n == a.session.history.len();
        let n_out = work.iter().zip(&take).filter(|(a, n)| wants(a, **n)).count();
        if !values.as_ref().is_some_and(|v| v.holds(rows, n_out)) {
            // Grown by doubling to what this pass needs (a logits row is a vocabulary wide).
            let (had_rows, had_seqs) = values.as_ref().map_or((0, 0), Values::capacity);
            *values = Some(Values::new(p, plan, rows.next_power_of_two().max(had_rows), n_out.next_power_of_two().max(had_seqs)));
        }
        let Some(values) = values.as_mut() else { return };
        let widest = work.iter().zip(&take).filter(|(_, n)| **n > 0).map(|(a, n)| a.session.done + n).max().unwrap_or(0);
        if scores.len() < widest {
            scores.resize(widest, 0.0);
        }
        dispatch.counters = Counters::default();
        {
            let mut seqs = Vec::new();
            let mut tokens: Vec<Rows<'_>> = Vec::new();
            let mut own: Vec<&mut Dispatch> = Vec::new();
            for (a, &n) in work.iter_mut().zip(&take).filter(|(_, n)| **n > 0) {
                let outputs = a.session.done + n == a.session.history.len();
                let Session { state, dispatch, history, done, .. } = &mut *a.session;
                let (caches, tables) = state.pass_parts();
                tokens.push(Rows { tokens: &history[*done..*done + n], pos: *done, tables });
                seqs.push(cpu::Seq { t: n, pos: *done, outputs, caches, d: own.len() + 1 });
                own.push(dispatch);
            }
            let hd = model.arch.hparams().head_dim;
            let mut failed = false;
            let mut input = |i: usize, out: &mut [f32]| failed |= pass_input(parts, hd, &mut tokens, i, out).is_err();
            let mut ds: Vec<&mut Dispatch> = std::iter::once(&mut *dispatch).chain(own).collect();
            cpu::run(p, plan, parts.weights, &mut ds, values, scores, &mut seqs, &mut input);
            if failed {
                // An embedding row that did not read: each session runs its rows on its own,
                // and meets the error there.
                return;
            }
        }
        let logits = values.get(p, plan, p.outputs[0], n_out);
        let mut row = 0;
        for (a, &n) in work.iter_mut().zip(&take).filter(|(_, n)| **n > 0) {
            let s = &mut *a.session;
            s.done += n;
            s.dispatch.counters.add(&dispatch.counters);
            if s.done == s.history.len() {
                let (_, out) = s.state.parts();
                out.copy_from_slice(&logits[row * out.len()..(row + 1) * out.len()]);
                row += 1;
            }
        }
    }
}

/// One sequence's rows in a batched pass: its tokens from position `pos`, and its session's
/// rotation tables (`State::pass_parts`).
pub(crate) struct Rows<'a> {
    pub tokens: &'a [u32],
    pub pos: usize,
    pub tables: Vec<&'a mut rope::Table>,
}

/// Input `i` of a pass of the model's recipe over several sequences, their rows one sequence
/// after another: the tokens' embeddings (input 0), then the rotation tables of their positions
/// (`hd` wide), filled in each session's own tables.
pub(crate) fn pass_input(parts: &PassParts<'_>, hd: usize, seqs: &mut [Rows<'_>], i: usize, out: &mut [f32]) -> Result<(), LoadError> {
    let mut at = 0;
    for seq in seqs {
        let t = seq.tokens.len();
        match i {
            0 => embed(parts.embd, seq.tokens, &mut out[at * parts.embd.n_in..(at + t) * parts.embd.n_in])?,
            i => {
                let table = &mut *seq.tables[i - 1];
                table.fill(&parts.freqs[i - 1], seq.pos, t);
                table.write_rows(t, &mut out[at * hd..(at + t) * hd]);
            }
        }
        at += t;
    }
    Ok(())
}

/// The forward passes of a step for a model whose program is on the device: the rows the
/// `live` sessions have not run go through the program in runs over several sessions'
/// sequences (at most `DEVICE_BATCH` rows a run, a session's at most its batch), each session
/// with its own device caches, as `run_together` runs them on the CPU. Greedy entries whose
/// rows end in a run read back their top token alone (the program's `top` form, one run), the
/// others their logits rows (another). A session the device does not take (the policy, its
/// caches, a failed run) is left with rows to run: the caller runs it on its own.
fn run_on_device(model: &Model, parts: &PassParts<'_>, prog: &DeviceProgram, work: &mut [Advance<'_>], live: &[bool]) {
    let h = model.arch.hparams();
    let kv = h.n_head_kv * h.head_dim;
    let head = prog.head.map(|id| parts.weights.matrix(id));
    let out_len = head.map_or(h.n_vocab, |m| m.n_in);
    let program = &parts.recipe.program;
    let widths: Vec<usize> = program.input_widths().map(|w| w as usize).collect();
    let mut left = vec![false; work.len()];
    loop {
        let mut room = DEVICE_BATCH;
        let take: Vec<usize> = work
            .iter()
            .zip(live.iter().zip(&left))
            .map(|(a, (&live, &left))| {
                let s = &a.session;
                let n = if live && !left { (s.history.len() - s.done).min(s.state.batch).min(room) } else { 0 };
                room -= n;
                n
            })
            .collect();
        if room == DEVICE_BATCH {
            return;
        }
        let ends = |a: &Advance<'_>, n: usize| n > 0 && a.session.done + n == a.session.history.len();
        let top: Vec<bool> = work
            .iter()
            .zip(&take)
            .map(|(a, &n)| prog.has_top() && ends(a, n) && a.sample.as_ref().is_some_and(|p| a.session.greedy(p)))
            .collect();
        for group in [true, false] {
            let members: Vec<bool> = take.iter().zip(&top).map(|(&n, &t)| n > 0 && t == group).collect();
            if !members.contains(&true) {
                continue;
            }
            // The policy over the group's rows; then each member's device caches.
            let t: usize = take.iter().zip(&members).filter(|(_, m)| **m).map(|(n, _)| n).sum();
            let flops = model.recipe.flops(t);
            let bytes = 4 * (t * widths.iter().sum::<usize>()) as u64;
            let mut joined = vec![false; work.len()];
            let mut ids = vec![Vec::new(); work.len()];
            for (i, a) in work.iter_mut().enumerate().filter(|(i, _)| members[*i]) {
                let Session { state, dispatch, done, .. } = &mut *a.session;
                let (caches, _) = state.parts();
                // The policy first: a session the device will not take makes no caches there.
                let wanted = dispatch.program_wanted(prog, caches, t, flops, bytes);
                match wanted.then(|| dispatch.program_caches(prog, (take[i], *done), caches, kv)).flatten() {
                    Some(c) => (joined[i], ids[i]) = (true, c),
                    None => left[i] = true,
                }
            }
            if !joined.contains(&true) {
                continue;
            }
            let passes = {
                let mut tokens: Vec<Rows<'_>> = Vec::new();
                let mut run: Vec<Member<'_>> = Vec::new();
                for (i, a) in work.iter_mut().enumerate().filter(|(i, _)| joined[*i]) {
                    let n = take[i];
                    let Session { state, dispatch, history, done, .. } = &mut *a.session;
                    let (caches, tables) = state.pass_parts();
                    tokens.push(Rows { tokens: &history[*done..*done + n], pos: *done, tables });
                    let flops = model.recipe.flops(n);
                    run.push(Member { d: dispatch, t: n, pos: *done, caches, ids: std::mem::take(&mut ids[i]), flops });
                }
                let rows: usize = tokens.iter().map(|r| r.tokens.len()).sum();
                let inputs: Result<Vec<Vec<f32>>, LoadError> = widths
                    .iter()
                    .enumerate()
                    .map(|(k, &w)| {
                        let mut v = vec![0.0; rows * w];
                        pass_input(parts, h.head_dim, &mut tokens, k, &mut v).map(|()| v)
                    })
                    .collect();
                // An embedding row that did not read: each session meets the error on its own.
                inputs.ok().and_then(|inputs| dispatch::run_together(prog, &inputs, &mut run, out_len, group))
            };
            let Some(passes) = passes else {
                for (l, j) in left.iter_mut().zip(&joined) {
                    *l |= *j;
                }
                continue;
            };
            // Each member's rows are run; its logits (through the guest's head product where
            // the device does not hold it, all members' rows at once) or its top token.
            let mut heads: Vec<(usize, Vec<f32>)> = Vec::new();
            for ((i, a), pass) in work.iter_mut().enumerate().filter(|(i, _)| joined[*i]).zip(passes) {
                let wants = ends(a, take[i]);
                let s = &mut *a.session;
                s.done += take[i];
                match pass {
                    Pass::Top(token) => s.dispatch.top = Some(token),
                    Pass::Rows(out) if wants && head.is_some() => heads.push((i, out)),
                    Pass::Rows(out) if wants => s.state.parts().1.copy_from_slice(&out),
                    Pass::Rows(_) => {}
                }
            }
            if let (Some(m), Some(&(first, _))) = (head, heads.first()) {
                let x: Vec<f32> = heads.iter().flat_map(|(_, r)| r.iter().copied()).collect();
                let mut y = vec![0.0; heads.len() * m.n_out];
                let d = &mut work[first].session.dispatch;
                let start = Instant::now();
                d.matmul(&x, heads.len(), &mut [(m, &mut y)]);
                d.counters.output_ns += start.elapsed().as_nanos() as u64;
                for ((i, _), row) in heads.iter().zip(y.chunks_exact(m.n_out)) {
                    work[*i].session.state.parts().1.copy_from_slice(row);
                }
            }
        }
    }
}
