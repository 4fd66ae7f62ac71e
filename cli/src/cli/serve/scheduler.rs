//! The engine side of `wisp serve`: a bounded queue of generation requests and the workers that
//! serve them, each owning one guest instance with the model open.
//!
//! A worker keeps up to its share of `--parallel` requests in flight, each in a session of its
//! own, and advances them together (continuous batching): every round is one `step` of the
//! engine, in which each request brings one chunk of its prompt or samples one token (with its
//! last chunk, then a token a round), the rows of all of them in one forward pass. Requests
//! join between rounds as slots free up.
//!
//! A request's text depends only on its own tokens and settings: the engine's step gives each
//! session the logits it would have alone, and its session is its own.

use super::api::{self, ApiError, Call, Constraint, Finish, Prompt, Reply, Sampling, TokenLogprob, ToolSyntax, Tools, Usage};
use super::metrics::Metrics;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use wisp::{Advance, EngineError, Instance, Model, ModelInfo, Outcome, Session};

/// How much a worker takes on.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests in flight at once, over all workers.
    pub parallel: usize,
    /// Requests waiting for a slot; past it, `429`.
    pub queue: usize,
    /// A request's context (prompt and generated tokens) at most.
    pub ctx: u32,
    /// Prompt tokens fed in one turn.
    pub prefill_chunk: usize,
    /// Finished requests' sessions are kept for later requests that share their prefix.
    pub prompt_cache: bool,
    /// How `/v1/embeddings` pools a text's rows.
    pub pooling: wisp::Pooling,
}

/// What a generation request hears from its worker, in order: `Started` or `Failed`, then for
/// each of its choices (`index`) `Text` pieces and `Calls`, then its `Done`; or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// The prompt is accepted: it fits, and a session holds it; its tokens.
    Started { prompt_tokens: u32 },
    /// Text to send (whole characters, nothing of a stop sequence), with the log-probabilities
    /// of the tokens that gave it where the request asked for them.
    Text { index: usize, text: String, logprobs: Vec<TokenLogprob> },
    /// The calls of tools a choice made (before its `Done`).
    Calls { index: usize, calls: Vec<Call> },
    Done { index: usize, finish: Finish, usage: Usage },
    Failed(ApiError),
}

/// A generation request.
pub struct Job {
    pub prompt: Prompt,
    pub max_tokens: Option<u32>,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    /// What the output must spell, and the request's field that gave it (for errors):
    /// compiled when the request is admitted.
    pub constraint: Option<(&'static str, Constraint)>,
    /// Report each token's log-probability and this many alternatives'.
    pub logprobs: Option<u32>,
    /// Choices to generate: the first's session is forked for the others once the prompt is in.
    pub n: u32,
    /// Where the events go; when the receiver is gone (the client left), the job ends.
    pub events: mpsc::UnboundedSender<Event>,
    pub arrived: Instant,
    pub deadline: Instant,
    /// The limit the deadline comes from, for the error's message.
    pub time_limit: Duration,
}

/// Token ids, each with its text when asked for (`/tokenize` with `with_pieces`).
pub type Pieces = Vec<(u32, Option<String>)>;

/// A short request that needs the model but no session.
pub enum Task {
    Tokenize {
        text: String,
        add_special: bool,
        parse_special: bool,
        with_pieces: bool,
        reply: oneshot::Sender<Result<Pieces, ApiError>>,
    },
    Detokenize { tokens: Vec<u32>, reply: oneshot::Sender<Result<String, ApiError>> },
    /// Embeddings of the inputs, with the tokens they came to: run a turn at a time between
    /// rounds of generation (see [`Worker::embed_turn`]).
    Embed { inputs: Vec<api::embeddings::Input>, reply: oneshot::Sender<Result<Embedded, ApiError>> },
}

/// Embeddings of a request's inputs, in order, and the tokens they came to.
pub type Embedded = (Vec<Vec<f32>>, u32);

/// An embeddings request under way in a worker: the vectors of its first inputs so far.
struct Embedding {
    inputs: Vec<api::embeddings::Input>,
    vectors: Vec<Vec<f32>>,
    tokens: u32,
    reply: oneshot::Sender<Result<Embedded, ApiError>>,
}

/// Opens a guest instance with the model loaded (called on the worker's own thread).
pub type Open = Arc<dyn Fn() -> anyhow::Result<(Instance, Model)> + Send + Sync>;

struct Queue {
    jobs: VecDeque<Job>,
    tasks: VecDeque<Task>,
    /// No new requests; workers end when their queue and slots are empty.
    stopping: bool,
    /// Every request in flight or queued ends now, with `503`.
    cancel: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    limits: Limits,
    metrics: Arc<Metrics>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A worker that panicked holding the lock left the queue consistent (every change is
        // one push or pop): go on with it.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The queue and its workers.
pub struct Scheduler {
    shared: Arc<Shared>,
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Scheduler {
    /// Starts `instances` workers, each opening its guest instance with `open`, and returns
    /// once all have the model loaded (or the first error), with what the model is.
    pub fn start(instances: usize, limits: Limits, metrics: Arc<Metrics>, open: Open) -> anyhow::Result<(Scheduler, ModelInfo)> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue { jobs: VecDeque::new(), tasks: VecDeque::new(), stopping: false, cancel: false }),
            wake: Condvar::new(),
            limits,
            metrics,
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let mut workers = Vec::new();
        for id in 0..instances {
            // Each worker's share of the slots; together they hold `parallel`.
            let slots = limits.parallel / instances + usize::from(id < limits.parallel % instances);
            let (shared, open, ready) = (shared.clone(), open.clone(), ready_tx.clone());
            let handle = std::thread::Builder::new().name(format!("wisp-worker-{id}")).spawn(move || {
                let opened = open().and_then(|(mut inst, model)| {
                    let info = inst.model_info(model)?;
                    Ok((inst, model, info))
                });
                let _ = ready.send(opened.as_ref().map(|o| o.2.clone()).map_err(|e| format!("{e:#}")));
                if let Ok((inst, model, info)) = opened {
                    let ctx = limits.ctx.min(info.n_ctx_train);
                    let embeds = VecDeque::new();
                    Worker { shared, open, inst, model, slots: slots.max(1), ctx, bos: info.bos, active: Vec::new(), embeds, idle: Vec::new() }.run();
                }
            })?;
            workers.push(handle);
        }
        drop(ready_tx);
        let scheduler = Scheduler { shared, workers: Mutex::new(workers) };
        let mut info = None;
        for _ in 0..instances {
            match ready_rx.recv() {
                Ok(Ok(i)) => info = Some(i),
                Ok(Err(e)) => {
                    scheduler.stop(true);
                    anyhow::bail!("{e}");
                }
                Err(_) => {
                    scheduler.stop(true);
                    anyhow::bail!("a worker ended while loading the model");
                }
            }
        }
        let info = info.ok_or_else(|| anyhow::anyhow!("no instance to serve with"))?;
        Ok((scheduler, info))
    }

    /// Queues a generation; `429` when the queue is full, `503` when stopping.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        self.enqueue(job, |q| &mut q.jobs)
    }

    /// Queues a short task, served between two rounds of generation (its own queue, as long).
    pub fn task(&self, task: Task) -> Result<(), ApiError> {
        self.enqueue(task, |q| &mut q.tasks)
    }

    fn enqueue<T>(&self, item: T, queue: impl FnOnce(&mut Queue) -> &mut VecDeque<T>) -> Result<(), ApiError> {
        let mut q = self.shared.lock();
        if q.stopping {
            return Err(ApiError::shutting_down());
        }
        let items = queue(&mut q);
        if items.len() >= self.shared.limits.queue {
            return Err(ApiError::queue_full(items.len()));
        }
        items.push_back(item);
        self.shared.metrics.queue_depth.set(q.jobs.len() as i64);
        drop(q);
        self.shared.wake.notify_all();
        Ok(())
    }

    /// Takes no new requests. With `cancel`, what is in flight or queued ends now (`503`);
    /// without, it runs to its end.
    pub fn stop(&self, cancel: bool) {
        let mut q = self.shared.lock();
        q.stopping = true;
        q.cancel |= cancel;
        drop(q);
        self.shared.wake.notify_all();
    }

    /// Waits for every worker to end (after [`Scheduler::stop`]).
    pub fn join(&self) {
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in workers {
            let _ = w.join();
        }
    }
}

/// A request's choice holding a session.
struct Active {
    job: Rc<Job>,
    /// The choice (0 for the first; `n` choices fork the first's session).
    index: usize,
    /// Choices still to fork from this one once its prompt is in.
    forks: u32,
    /// How the model writes calls, where the request has tools it may call.
    tools: Option<ToolSyntax>,
    /// Log-probabilities of tokens whose text is not sent yet.
    pending: Vec<TokenLogprob>,
    session: Session,
    /// The session's capacity.
    capacity: u32,
    prompt: Vec<u32>,
    /// The tokens sampled so far (each appended to the session's context).
    generated: Vec<u32>,
    /// Prompt tokens fed so far.
    fed: usize,
    reply: Reply,
    last_token: Option<Instant>,
}

/// How a guest call went wrong: the request's fault (or limit), or the instance's end.
enum Failure {
    Request(ApiError),
    Trap(anyhow::Error),
}

fn guest<T>(r: Outcome<T>) -> Result<T, Failure> {
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Failure::Request(api_error(e))),
        Err(e) => Err(Failure::Trap(e)),
    }
}

/// The engine's error as a request hears it: 400 where the request is at fault, else 500.
fn api_error(e: EngineError) -> ApiError {
    use EngineError as E;
    let requests_fault = matches!(e, E::InvalidArgument(_) | E::ContextFull(_) | E::Unsupported(_) | E::InvalidConstraint(_));
    ApiError::engine(requests_fault, e.to_string())
}

/// The wire format's sampling settings as the engine takes them, for choice `index` (its own
/// seed) of a request that asks `logprobs`.
fn engine_sampling(s: &Sampling, index: usize, logprobs: Option<u32>) -> wisp::Sampling {
    let Sampling { temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed } = *s;
    let seed = seed.wrapping_add(index as u64);
    wisp::Sampling { temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, logprobs }
}

/// A request's tools as the engine's constraint of calls in `syntax`.
fn tool_constraint(tools: &Tools, syntax: ToolSyntax) -> wisp::Constraint {
    wisp::Constraint::Lark(tools.grammar(syntax))
}

/// The wire format's syntax of calls.
fn api_syntax(s: wisp::ToolSyntax) -> ToolSyntax {
    match s {
        wisp::ToolSyntax::Hermes => ToolSyntax::Hermes,
        wisp::ToolSyntax::Llama3Json => ToolSyntax::Llama3Json,
    }
}

/// The wire format's constraint as the engine takes it.
fn engine_constraint(c: &Constraint) -> wisp::Constraint {
    match c {
        Constraint::JsonSchema(s) => wisp::Constraint::JsonSchema(s.clone()),
        Constraint::Regex(s) => wisp::Constraint::Regex(s.clone()),
        Constraint::Lark(s) => wisp::Constraint::Lark(s.clone()),
    }
}

/// `guest`, where a constraint's error names the request's field that gave the constraint.
fn constrained<T>(r: Outcome<T>, param: &str) -> Result<T, Failure> {
    match r {
        Ok(Err(e @ EngineError::InvalidConstraint(_))) => Err(Failure::Request(ApiError::invalid_param(param, e.to_string()))),
        r => guest(r),
    }
}

/// A request's session as `open_session` makes it ready: its capacity, the prompt's tokens,
/// the tokens it may generate, and how many of the prompt's the session already holds.
struct Opened {
    session: Session,
    capacity: u32,
    prompt: Vec<u32>,
    budget: u32,
    cached: usize,
    tools: Option<ToolSyntax>,
}

/// What one turn of a request came to.
enum Turn {
    Continue,
    Ended,
}

struct Worker {
    shared: Arc<Shared>,
    open: Open,
    inst: Instance,
    model: Model,
    slots: usize,
    /// A request's context at most: `--ctx`, or the model's training context if smaller.
    ctx: u32,
    /// The model's BOS token (a rendered chat may begin with it).
    bos: Option<u32>,
    active: Vec<Active>,
    /// Embeddings requests, the first under way.
    embeds: VecDeque<Embedding>,
    /// Finished requests' sessions, least recently used first, for later requests that share
    /// their prefix (with `Limits::prompt_cache`); with the active ones, at most `slots`.
    idle: Vec<Idle>,
}

/// A finished request's session: its context (prompt and generated tokens) and capacity.
struct Idle {
    session: Session,
    context: Vec<u32>,
    capacity: u32,
}

impl Worker {
    fn run(mut self) {
        loop {
            let (tasks, jobs, cancel) = {
                let mut q = self.shared.lock();
                loop {
                    let free = self.slots.saturating_sub(self.active.len());
                    if q.cancel || !q.tasks.is_empty() || (free > 0 && !q.jobs.is_empty()) || !self.active.is_empty() || !self.embeds.is_empty() {
                        break;
                    }
                    if q.stopping {
                        return;
                    }
                    q = self.shared.wake.wait(q).unwrap_or_else(|p| p.into_inner());
                }
                let take = if q.cancel { q.jobs.len() } else { (self.slots.saturating_sub(self.active.len())).min(q.jobs.len()) };
                let jobs: Vec<Job> = q.jobs.drain(..take).collect();
                self.shared.metrics.queue_depth.set(q.jobs.len() as i64);
                (std::mem::take(&mut q.tasks), jobs, q.cancel)
            };
            if cancel {
                for job in jobs {
                    let _ = job.events.send(Event::Failed(ApiError::shutting_down()));
                }
                for a in std::mem::take(&mut self.active) {
                    let _ = a.job.events.send(Event::Failed(ApiError::shutting_down()));
                    self.release(a.session);
                }
                self.shared.metrics.in_flight.set(0);
                for t in tasks {
                    refuse(t, ApiError::shutting_down());
                }
                for e in std::mem::take(&mut self.embeds) {
                    let _ = e.reply.send(Err(ApiError::shutting_down()));
                }
                // Only a stop cancels, and a stop is for good.
                return;
            }
            for t in tasks {
                self.task(t);
            }
            for job in jobs {
                self.admit(job);
            }
            self.embed_turn();
            self.round();
        }
    }

    fn task(&mut self, t: Task) {
        match t {
            Task::Tokenize { text, add_special, parse_special, with_pieces, reply } => {
                let r = self.tokenize(&text, add_special, parse_special, with_pieces);
                let _ = reply.send(r.map_err(|f| self.failed(f)));
            }
            Task::Detokenize { tokens, reply } => {
                let r = guest(self.inst.detokenize(self.model, &tokens, true));
                let _ = reply.send(r.map_err(|f| self.failed(f)));
            }
            Task::Embed { inputs, reply } => {
                let vectors = Vec::with_capacity(inputs.len());
                self.embeds.push_back(Embedding { inputs, vectors, tokens: 0, reply });
            }
        }
    }

    /// One turn of the first embeddings request: its next inputs, as many as make a prompt
    /// chunk's tokens (one at least), so that the requests generating meanwhile wait for one
    /// chunk at a time, as a long prompt makes them. A request whose client left ends here.
    fn embed_turn(&mut self) {
        let Some(mut e) = self.embeds.pop_front() else { return };
        if e.reply.is_closed() {
            self.shared.metrics.cancelled.inc();
            return;
        }
        match self.embed_some(&mut e) {
            Err(f) => {
                let err = self.failed(f);
                let _ = e.reply.send(Err(err));
            }
            Ok(()) if e.vectors.len() == e.inputs.len() => {
                self.shared.metrics.prompt_tokens.inc_by(u64::from(e.tokens));
                let _ = e.reply.send(Ok((std::mem::take(&mut e.vectors), e.tokens)));
            }
            Ok(()) => self.embeds.push_front(e),
        }
    }

    fn embed_some(&mut self, e: &mut Embedding) -> Result<(), Failure> {
        let mut texts = Vec::new();
        let mut tokens = 0;
        while let Some(input) = e.inputs.get(e.vectors.len() + texts.len()) {
            if !texts.is_empty() && tokens >= self.shared.limits.prefill_chunk {
                break;
            }
            let ids = match input {
                api::embeddings::Input::Text(t) => guest(self.inst.tokenize(self.model, t, true, false))?,
                api::embeddings::Input::Tokens(t) => t.clone(),
            };
            let ids = api::embeddings::input_tokens(e.vectors.len() + texts.len(), ids, self.ctx).map_err(|mut e| {
                if e.code == Some("context_length_exceeded") {
                    e.message.push_str(" (--ctx)");
                }
                Failure::Request(e)
            })?;
            tokens += ids.len();
            texts.push(ids);
        }
        let vectors = guest(self.inst.embed(self.model, &texts, self.shared.limits.pooling)).map_err(|f| match f {
            Failure::Request(err) => Failure::Request(ApiError::invalid_param("input", err.message)),
            other => other,
        })?;
        e.tokens += tokens as u32;
        e.vectors.extend(vectors);
        Ok(())
    }

    fn tokenize(&mut self, text: &str, add_special: bool, parse_special: bool, with_pieces: bool) -> Result<Pieces, Failure> {
        let ids = guest(self.inst.tokenize(self.model, text, add_special, parse_special))?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let piece = match with_pieces {
                true => Some(String::from_utf8_lossy(&guest(self.inst.token_piece(self.model, id, true))?).into_owned()),
                false => None,
            };
            out.push((id, piece));
        }
        Ok(out)
    }

    /// The error a request hears; a trap also replaces the instance.
    fn failed(&mut self, f: Failure) -> ApiError {
        match f {
            Failure::Request(e) => e,
            Failure::Trap(e) => {
                let message = format!("the engine failed: {e:#}");
                tracing::error!("{message}; opening a new instance");
                self.restart(&message);
                ApiError::internal(message)
            }
        }
    }

    /// After a trap the instance cannot be used: every request in it fails, a new one opens.
    fn restart(&mut self, why: &str) {
        // The idle sessions go with the instance.
        self.idle.clear();
        for a in std::mem::take(&mut self.active) {
            let _ = a.job.events.send(Event::Failed(ApiError::internal(why.to_string())));
            self.shared.metrics.in_flight.dec();
        }
        match (self.open)() {
            Ok((inst, model)) => (self.inst, self.model) = (inst, model),
            Err(e) => {
                // Nothing to serve with: the other workers go on; this one ends.
                tracing::error!("cannot reopen the model: {e:#}; a worker is gone");
                self.slots = 0;
            }
        }
    }

    /// The prompt's tokens, and how the model writes calls where a chat has tools to call.
    fn prompt_tokens(&mut self, prompt: &Prompt) -> Result<(Vec<u32>, Option<ToolSyntax>), Failure> {
        match prompt {
            Prompt::Tokens(t) => Ok((t.clone(), None)),
            Prompt::Text(t) => Ok((guest(self.inst.tokenize(self.model, t, true, false))?, None)),
            Prompt::Chat(chat) => {
                let (text, syntax) = guest(self.inst.render_chat(self.model, &chat.conversation(), true)).map_err(|f| match f {
                    Failure::Request(e) => Failure::Request(ApiError::invalid_param("messages", e.message)),
                    other => other,
                })?;
                let mut tokens = guest(self.inst.tokenize(self.model, &text, true, true))?;
                api::drop_doubled_bos(&mut tokens, self.bos);
                let calls = chat.tools.as_ref().filter(|t| t.choice != api::Choice::None).map(|_| api_syntax(syntax));
                Ok((tokens, calls))
            }
        }
    }

    /// Takes a queued request into a session, or fails it.
    fn admit(&mut self, job: Job) {
        if job.events.is_closed() {
            self.shared.metrics.cancelled.inc();
            return;
        }
        if Instant::now() >= job.deadline {
            let _ = job.events.send(Event::Failed(ApiError::timed_out(job.time_limit)));
            return;
        }
        match self.open_session(&job) {
            Ok(Opened { session, capacity, prompt, budget, cached, tools }) => {
                let _ = job.events.send(Event::Started { prompt_tokens: prompt.len() as u32 });
                self.shared.metrics.prompt_tokens.inc_by(prompt.len() as u64);
                self.shared.metrics.cached_prompt_tokens.inc_by(cached as u64);
                self.shared.metrics.in_flight.inc();
                let reply = reply_for(&job, prompt.len(), budget, tools).cached(cached as u32);
                let forks = job.n.saturating_sub(1);
                let job = Rc::new(job);
                let pending = Vec::new();
                let generated = Vec::new();
                self.active.push(Active { job, index: 0, forks, tools, pending, session, capacity, prompt, generated, fed: cached, reply, last_token: None });
            }
            Err(f) => {
                let e = self.failed(f);
                let _ = job.events.send(Event::Failed(e));
            }
        }
    }

    fn open_session(&mut self, job: &Job) -> Result<Opened, Failure> {
        let (prompt, tools) = self.prompt_tokens(&job.prompt)?;
        let (n_ctx, budget) = api::session_size(prompt.len(), job.max_tokens, self.ctx).map_err(|mut e| {
            if e.code == Some("context_length_exceeded") {
                e.message.push_str(" (--ctx)");
            }
            Failure::Request(e)
        })?;
        let (session, capacity, cached) = match self.reuse(&prompt, n_ctx)? {
            Some(kept) => kept,
            None => {
                // Room for a new session: the least recently used idle ones go first.
                while !self.idle.is_empty() && self.active.len() + self.idle.len() >= self.slots {
                    let old = self.idle.remove(0);
                    self.release(old.session);
                }
                // Under the prompt cache a session has room for twice its request (within
                // --ctx), so that a chat's next turn fits where the first turn's tokens are.
                let capacity = if self.shared.limits.prompt_cache { n_ctx.saturating_mul(2).min(self.ctx) } else { n_ctx };
                (guest(self.inst.new_session(self.model, capacity))?, capacity, 0)
            }
        };
        if let Err(f) = self.constrain_from_start(session, job, tools) {
            self.release(session);
            return Err(f);
        }
        Ok(Opened { session, capacity, prompt, budget, cached, tools })
    }

    /// Constrains a new session of `job` as its reply must be from the first token: the
    /// request's constraint, or its calls where its `tool_choice` forces some.
    fn constrain_from_start(&mut self, session: Session, job: &Job, tools: Option<ToolSyntax>) -> Result<(), Failure> {
        if let Some((param, c)) = &job.constraint {
            return constrained(self.inst.constrain(session, Some(&engine_constraint(c))), param);
        }
        match (job_tools(job), tools) {
            (Some(t), Some(syntax)) if t.forced() => constrained(self.inst.constrain(session, Some(&tool_constraint(t, syntax))), "tools"),
            // Under `auto` the calls are constrained once one opens: their grammar is compiled
            // here, so that one that cannot be fails the request before it starts.
            (Some(t), Some(syntax)) => {
                constrained(self.inst.constrain(session, Some(&tool_constraint(t, syntax))), "tools")?;
                guest(self.inst.constrain(session, None))
            }
            _ => Ok(()),
        }
    }

    /// The idle session of room for `n_ctx` tokens whose context shares the longest prefix
    /// with `prompt` (the most recent among equals), truncated to that prefix: the session, its
    /// capacity and the prompt tokens it holds.
    fn reuse(&mut self, prompt: &[u32], n_ctx: u32) -> Result<Option<(Session, u32, usize)>, Failure> {
        let shared = |context: &[u32]| context.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let best = self.idle.iter().enumerate().filter(|(_, i)| i.capacity >= n_ctx).max_by_key(|(at, i)| (shared(&i.context), *at)).map(|(at, _)| at);
        let Some(at) = best else { return Ok(None) };
        let kept = self.idle.remove(at);
        let n = shared(&kept.context);
        if let Err(f) = guest(self.inst.truncate(kept.session, n as u32)) {
            self.release(kept.session);
            return Err(f);
        }
        Ok(Some((kept.session, kept.capacity, n)))
    }

    /// One step for every request in flight, in one `step` of the engine (one forward pass
    /// over all their rows): each brings its prompt's next chunk, and samples its next token
    /// once its whole prompt is in (with its last chunk, then a token a step).
    fn round(&mut self) {
        // Requests whose client left or whose time is up end first.
        let mut i = 0;
        while i < self.active.len() {
            match self.expired(i) {
                true => self.end(i, None),
                false => i += 1,
            }
        }
        if self.active.is_empty() {
            return;
        }
        self.shared.metrics.batch_size.observe(self.active.len() as f64);
        let chunk = self.shared.limits.prefill_chunk;
        let ends: Vec<usize> = self.active.iter().map(|a| (a.fed + chunk).min(a.prompt.len())).collect();
        let work: Vec<Advance> = self
            .active
            .iter()
            .zip(&ends)
            .map(|(a, &end)| Advance {
                session: a.session,
                tokens: &a.prompt[a.fed..end],
                sample: (end == a.prompt.len()).then(|| engine_sampling(&a.job.sampling, a.index, a.job.logprobs)),
            })
            .collect();
        let results = match guest(self.inst.step(self.model, &work)) {
            Ok(results) if results.len() == self.active.len() => results,
            Ok(_) => {
                let e = ApiError::internal("the engine's step answered for a different number of requests".to_string());
                return self.fail_all(e);
            }
            Err(Failure::Request(e)) => return self.fail_all(e),
            Err(trap) => {
                // Every request of the instance fails with it.
                self.failed(trap);
                return;
            }
        };
        // Back to front, so that ending a request moves none still to be seen.
        for (i, (r, end)) in results.into_iter().zip(ends).enumerate().rev() {
            self.active[i].fed = end;
            let param = self.active[i].job.constraint.as_ref().map_or("response_format", |c| c.0);
            match r {
                Ok(None) => {}
                Ok(Some(step)) => {
                    if self.active[i].forks > 0 {
                        self.fork(i);
                    }
                    match self.emit(i, step) {
                        Ok(Turn::Ended) => self.finish(i),
                        Ok(Turn::Continue) => {}
                        Err(f) => {
                            let e = self.failed(f);
                            if i < self.active.len() {
                                self.end(i, Some(e));
                            }
                        }
                    }
                }
                Err(e @ EngineError::InvalidConstraint(_)) => self.end(i, Some(ApiError::invalid_param(param, e.to_string()))),
                Err(e) => self.end(i, Some(api_error(e))),
            }
        }
    }

    /// Whether request `i` ends before its turn: its client left (cancelled), or its time is up
    /// (told so).
    fn expired(&mut self, i: usize) -> bool {
        let a = &self.active[i];
        if a.job.events.is_closed() {
            self.shared.metrics.cancelled.inc();
            return true;
        }
        if Instant::now() >= a.job.deadline {
            let _ = a.job.events.send(Event::Failed(ApiError::timed_out(a.job.time_limit)));
            return true;
        }
        false
    }

    /// Request `i` leaves, told `failure` if it failed; its session is freed.
    fn end(&mut self, i: usize, failure: Option<ApiError>) {
        let a = self.active.swap_remove(i);
        self.shared.metrics.in_flight.dec();
        if let Some(e) = failure {
            let _ = a.job.events.send(Event::Failed(e));
        }
        self.release(a.session);
    }

    /// Request `i` is done: its session kept for a later request that shares its prefix (with
    /// the prompt cache), else freed.
    fn finish(&mut self, i: usize) {
        if !self.shared.limits.prompt_cache {
            return self.end(i, None);
        }
        let a = self.active.swap_remove(i);
        self.shared.metrics.in_flight.dec();
        let context = [a.prompt, a.generated].concat();
        self.idle.push(Idle { session: a.session, context, capacity: a.capacity });
    }

    /// Every request in flight fails with `e`.
    fn fail_all(&mut self, e: ApiError) {
        while !self.active.is_empty() {
            self.end(self.active.len() - 1, Some(e.clone()));
        }
    }

    fn release(&mut self, session: Session) {
        if let Err(e) = self.inst.drop_session(session) {
            let message = format!("freeing a session: {e:#}");
            self.restart(&message);
        }
    }

    /// The other choices of request `i` (its first, whose prompt is in and which has just
    /// sampled its first token): sessions forked from its prompt, each its own seed.
    fn fork(&mut self, i: usize) {
        let forks = std::mem::take(&mut self.active[i].forks);
        for index in 1..=forks as usize {
            let a = &self.active[i];
            let (job, tools, prompt, capacity) = (a.job.clone(), a.tools, a.prompt.clone(), a.capacity);
            let budget = capacity - prompt.len() as u32;
            let opened = guest(self.inst.fork(a.session, prompt.len() as u32)).and_then(|session| {
                match self.constrain_from_start(session, &job, tools) {
                    Ok(()) => Ok(session),
                    Err(f) => {
                        self.release(session);
                        Err(f)
                    }
                }
            });
            match opened {
                Ok(session) => {
                    self.shared.metrics.in_flight.inc();
                    let reply = reply_for(&job, prompt.len(), budget, tools);
                    let fed = prompt.len();
                    self.active.push(Active { job, index, forks: 0, tools, pending: Vec::new(), session, capacity, prompt, generated: Vec::new(), fed, reply, last_token: None });
                }
                Err(f) => {
                    let e = self.failed(f);
                    let _ = job.events.send(Event::Failed(e));
                    return;
                }
            }
        }
    }

    /// Request `i`'s sampled token: its text to the client, and whether the request ends. A
    /// call the model opens takes the session back to where it began and constrains the rest.
    fn emit(&mut self, i: usize, step: wisp::Step) -> Result<Turn, Failure> {
        let a = &mut self.active[i];
        if !step.dead_end {
            let now = Instant::now();
            let m = &self.shared.metrics;
            match a.last_token {
                None => m.time_to_first_token.observe((now - a.job.arrived).as_secs_f64()),
                Some(t) => m.time_per_token.observe((now - t).as_secs_f64()),
            }
            a.last_token = Some(now);
            m.generated_tokens.inc();
        }
        if !step.dead_end {
            a.generated.push(step.token);
        }
        if let Some(l) = &step.logprobs {
            let lp = token_logprob(&mut self.inst, self.model, &step.piece, l)?;
            self.active[i].pending.push(lp);
        }
        let a = &mut self.active[i];
        let advance = a.reply.step(&step.piece, step.end_of_generation, step.dead_end);
        let index = a.index;
        if !advance.text.is_empty() {
            let logprobs = std::mem::take(&mut a.pending);
            let _ = a.job.events.send(Event::Text { index, text: advance.text, logprobs });
        }
        if let Some(keep) = advance.call_opened {
            a.pending.clear();
            a.generated.truncate(keep as usize);
            let (session, at) = (a.session, (a.prompt.len() + keep as usize) as u32);
            let (job, syntax) = (a.job.clone(), a.tools);
            guest(self.inst.truncate(session, at))?;
            if let (Some(tools), Some(syntax)) = (job_tools(&job), syntax) {
                constrained(self.inst.constrain(session, Some(&tool_constraint(tools, syntax))), "tools")?;
            }
            return Ok(Turn::Continue);
        }
        match advance.end {
            Some((finish, usage)) => {
                if !advance.calls.is_empty() {
                    let _ = a.job.events.send(Event::Calls { index, calls: advance.calls });
                }
                let _ = a.job.events.send(Event::Done { index, finish, usage });
                Ok(Turn::Ended)
            }
            None => Ok(Turn::Continue),
        }
    }
}

/// A request's tools.
fn job_tools(job: &Job) -> Option<&Tools> {
    match &job.prompt {
        Prompt::Chat(c) => c.tools.as_ref(),
        _ => None,
    }
}

/// The reply of one choice of `job`, whose calls (where it has tools) are written in `tools`.
fn reply_for(job: &Job, prompt: usize, budget: u32, tools: Option<ToolSyntax>) -> Reply {
    let reply = Reply::new(prompt as u32, budget, job.stop.clone());
    match (tools, job_tools(job)) {
        (Some(syntax), Some(t)) => reply.calling(syntax, t),
        _ => reply,
    }
}

/// A step's log-probabilities with the texts of its tokens.
fn token_logprob(inst: &mut Instance, model: Model, piece: &[u8], l: &wisp::Logprobs) -> Result<TokenLogprob, Failure> {
    let mut top = Vec::with_capacity(l.top.len());
    for &(id, lp) in &l.top {
        let bytes = guest(inst.token_piece(model, id, true))?;
        top.push((String::from_utf8_lossy(&bytes).into_owned(), bytes, lp));
    }
    Ok(TokenLogprob { token: String::from_utf8_lossy(piece).into_owned(), bytes: piece.to_vec(), logprob: l.logprob, top })
}

fn refuse(t: Task, e: ApiError) {
    match t {
        Task::Tokenize { reply, .. } => {
            let _ = reply.send(Err(e));
        }
        Task::Detokenize { reply, .. } => {
            let _ = reply.send(Err(e));
        }
        Task::Embed { reply, .. } => {
            let _ = reply.send(Err(e));
        }
    }
}
