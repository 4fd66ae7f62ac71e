//! Batched steps (`model.step`, continuous batching), with the default model: on the guest's
//! CPU path and on the CPU reference device each session's logits in a batch are bit for bit
//! those of the same session alone, whatever shares its steps (sessions joining and leaving
//! mid-way, prompts fed in chunks of different sizes); on wgpu (lavapipe here) within an RMSE
//! of 1e-3, the same greedy token wherever the session alone has a margin of at least 0.01.
//! Sampled tokens are those of `next`; errors are per entry or, for the whole call, leave every
//! session as it was.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use wisp::gpu::program::{Output, Program, SequenceRun};
use wisp::{
    Activation, Advance, AttentionShape, Backend, BufferId, Budget, CpuBackend, Device, EngineError, Format, Gemm, GpuError, GpuCtx, GpuMode, Instance, Model,
    NativeBackend, Options, Precision, Sampling, Session, WgpuBackend, Wisp,
};

fn model() -> PathBuf {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).expect("fetching the default model")).clone()
}

/// Where the model's passes run.
#[derive(Debug, Clone, Copy, PartialEq)]
enum On {
    /// The guest's CPU kernels (no device).
    Guest,
    /// The host's CPU reference device, every pass there (`--gpu on`).
    Reference,
    /// wgpu's adapter (lavapipe where there is no GPU), every pass there it takes.
    Wgpu,
    /// The native CPU device on two threads, every pass there (`--gpu on`).
    Native,
}

/// A CPU device (the reference or the native one), noting the most sequences any program run
/// brought.
struct Widest(Box<dyn Backend>, Arc<AtomicUsize>);

impl Backend for Widest {
    fn device(&self) -> Option<Device> {
        self.0.device()
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        self.0.create(f, n_out, n_in)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.0.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.0.matmul(x, t, n_in, jobs)
    }
    fn matmul_op(&mut self, id: BufferId, x: &[f32], t: u32, n_in: u32, precision: Precision) -> Result<Vec<f32>, GpuError> {
        self.0.matmul_op(id, x, t, n_in, precision)
    }
    fn gated(&mut self, act: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
        self.0.gated(act, gate, up)
    }
    fn free(&mut self, id: BufferId) {
        self.0.free(id)
    }
    fn create_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        self.0.create_cache(slots, width)
    }
    fn free_cache(&mut self, id: BufferId) {
        self.0.free_cache(id)
    }
    fn write_cache(&mut self, id: BufferId, first: u32, k: &[f32], v: &[f32]) -> Result<(), GpuError> {
        self.0.write_cache(id, first, k, v)
    }
    fn attention_cached(&mut self, q: &[f32], k: &[f32], v: &[f32], first_new: u32, cache: BufferId, first_key: u32, shape: &AttentionShape) -> Result<Vec<f32>, GpuError> {
        self.0.attention_cached(q, k, v, first_new, cache, first_key, shape)
    }
    fn run_program(&mut self, p: &Program, inputs: &[Vec<f32>], batch: &[SequenceRun]) -> Option<Result<Vec<Output>, GpuError>> {
        self.1.fetch_max(batch.len(), Ordering::Relaxed);
        self.0.run_program(p, inputs, batch)
    }
}

fn open() -> (Instance, Model) {
    let (inst, m, _) = open_on(On::Guest).expect("the guest's CPU");
    (inst, m)
}

/// An instance and the default model on `on`, and the most sequences a program run on the
/// reference device has brought so far; `None` (a skip) where wgpu finds no adapter outside CI,
/// a failure under `CI=true`.
fn open_on(on: On) -> Option<(Instance, Model, Arc<AtomicUsize>)> {
    let widest = Arc::new(AtomicUsize::new(0));
    let path = model();
    let wisp = Wisp::new(Options::default()).unwrap();
    let (ctx, mode) = match on {
        On::Guest => (GpuCtx::none(), GpuMode::Off),
        On::Reference => (GpuCtx::new(Box::new(Widest(Box::new(CpuBackend::new()), widest.clone())), Budget::default()), GpuMode::On),
        On::Native => {
            let native = NativeBackend::new(2).expect("the native device");
            (GpuCtx::new(Box::new(Widest(Box::new(native), widest.clone())), Budget::default()), GpuMode::On)
        }
        On::Wgpu => match WgpuBackend::new().expect("opening the wgpu adapter") {
            Some(mut b) => {
                // As on GPUs (lavapipe is a CPU device): products of at most 64 rows and few
                // tiles on `gemv` a row, each row's sums those of the row alone.
                b.set_gemm(Gemm::GPU).unwrap();
                (GpuCtx::new(Box::new(b), Budget::default()), GpuMode::On)
            }
            None if std::env::var("CI").is_ok_and(|v| v == "true") => {
                panic!("no wgpu adapter, and CI=true (install mesa-vulkan-drivers for lavapipe)")
            }
            None => {
                println!("skipped: no wgpu adapter (install mesa-vulkan-drivers for lavapipe)");
                return None;
            }
        },
    };
    let mut inst = wisp.instantiate(ctx, path.parent()).unwrap();
    let m = inst.open_model(&path, mode).unwrap().unwrap();
    Some((inst, m, widest))
}

/// The most likely token (the lowest id among equals), as the host's own greedy choice.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A prompt of `n` tokens, different for each `seed` (ids from the model's vocabulary).
fn prompt(inst: &mut Instance, m: Model, seed: usize, n: usize) -> Vec<u32> {
    let words = ["the", "river", "of", "light", "runs", "north", "under", "seven", "quiet", "bridges", "and", "a", "cat"];
    let text: Vec<&str> = (0..4 * n).map(|i| words[(seed * 7 + i * (seed % 5 + 1)) % words.len()]).collect();
    let mut tokens = inst.tokenize(m, &text.join(" "), true, false).unwrap().unwrap();
    tokens.truncate(n);
    tokens
}

/// Session `i`'s logits alone: after its prompt, then after each of `g` greedy tokens fed back.
fn alone(inst: &mut Instance, m: Model, prompt: &[u32], g: usize) -> Vec<Vec<f32>> {
    let s = inst.new_session(m, 256).unwrap().unwrap();
    inst.feed(s, prompt).unwrap().unwrap();
    let mut out = vec![inst.logits(s).unwrap().unwrap()];
    for _ in 0..g {
        let token = argmax(out.last().unwrap());
        inst.feed(s, &[token]).unwrap().unwrap();
        out.push(inst.logits(s).unwrap().unwrap());
    }
    inst.drop_session(s).unwrap();
    out
}

/// A session of the batch: its prompt, the step it joins at, its chunk size, and how far it is.
struct Live {
    prompt: Vec<u32>,
    joins: usize,
    chunk: usize,
    session: Option<Session>,
    fed: usize,
    /// Logits compared so far (0: the prompt's).
    checked: usize,
}

/// Whether `got` (a session's logits in a batch) is close enough to `want` (alone) on `on`:
/// bit for bit on the guest's CPU and the reference device; on wgpu within an RMSE of 1e-3 and
/// the same greedy token wherever `want`'s top two differ by at least 0.01. The second value
/// says whether the two are bitwise equal.
fn agrees(on: On, got: &[f32], want: &[f32]) -> (Result<(), String>, bool) {
    if got.len() != want.len() {
        return (Err(format!("{} logits, {} alone", got.len(), want.len())), false);
    }
    let bitwise = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
    if on != On::Wgpu || bitwise {
        return (if bitwise { Ok(()) } else { Err("not bit for bit those of the session alone".into()) }, bitwise);
    }
    let rmse = (got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    if rmse > 1e-3 {
        return (Err(format!("RMSE {rmse:e} against the session alone")), false);
    }
    let best = argmax(want) as usize;
    let second = want.iter().enumerate().filter(|(i, _)| *i != best).map(|(_, v)| *v).fold(f32::NEG_INFINITY, f32::max);
    if want[best] - second >= 0.01 && argmax(got) as usize != best {
        return (Err(format!("greedy token {} against {best} alone (margin {})", argmax(got), want[best] - second)), false);
    }
    (Ok(()), false)
}

/// Runs `n` sessions through batched steps, each fed its prompt (of 1 to `longest` tokens) in
/// chunks and then `g` greedy tokens (the host's choice from its logits alone, fed back),
/// joining at different steps and leaving when done; every logits row read after a step must
/// agree with the session's alone ([`agrees`]). Returns how many rows were bitwise equal, how
/// many were compared, and the most sequences of a program run (on the reference device).
fn batch_matches_alone(n: usize, g: usize) {
    batch_matches_alone_on(On::Guest, n, g, 37);
}

fn batch_matches_alone_on(on: On, n: usize, g: usize, longest: usize) -> Option<(usize, usize, usize)> {
    let (mut inst, m, widest_run) = open_on(on)?;
    let mut lives: Vec<Live> = (0..n)
        .map(|i| Live {
            prompt: prompt(&mut inst, m, i, 1 + (i * 11) % longest),
            joins: i % 4,
            chunk: [5, 16, 64, 3][i % 4],
            session: None,
            fed: 0,
            checked: 0,
        })
        .collect();
    let reference: Vec<Vec<Vec<f32>>> = lives.iter().map(|l| alone(&mut inst, m, &l.prompt, g)).collect();
    let mut step_no = 0;
    let mut widest = 0;
    let (mut same, mut compared) = (0, 0);
    while lives.iter().any(|l| l.checked <= g) {
        // Joining sessions open; each live one brings its next chunk or its next token.
        let mut feeds: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, l) in lives.iter_mut().enumerate() {
            if l.checked > g || l.joins > step_no {
                continue;
            }
            if l.session.is_none() {
                l.session = Some(inst.new_session(m, 256).unwrap().unwrap());
            }
            let tokens = if l.fed < l.prompt.len() {
                let end = (l.fed + l.chunk).min(l.prompt.len());
                let t = l.prompt[l.fed..end].to_vec();
                l.fed = end;
                t
            } else {
                vec![argmax(&reference[i][l.checked - 1])]
            };
            feeds.push((i, tokens));
        }
        let work: Vec<Advance> = feeds.iter().map(|(i, t)| Advance { session: lives[*i].session.unwrap(), tokens: t, sample: None }).collect();
        widest = widest.max(work.len());
        let results = inst.step(m, &work).unwrap().unwrap();
        assert_eq!(results.len(), work.len());
        for ((i, _), r) in feeds.iter().zip(results) {
            assert_eq!(r, Ok(None), "session {i} at step {step_no}");
            let l = &mut lives[*i];
            if l.fed < l.prompt.len() {
                continue;
            }
            let s = l.session.unwrap();
            let got = inst.logits(s).unwrap().unwrap();
            let (agreed, bitwise) = agrees(on, &got, &reference[*i][l.checked]);
            if let Err(e) = agreed {
                panic!("{on:?}: session {i} (prompt of {}, chunks of {}), logits {} at step {step_no}: {e}", l.prompt.len(), l.chunk, l.checked);
            }
            (same, compared) = (same + bitwise as usize, compared + 1);
            l.checked += 1;
            if l.checked > g {
                inst.drop_session(s).unwrap();
                l.session = None;
            }
        }
        step_no += 1;
    }
    assert!(widest >= n.min(4) * 3 / 4, "at most {widest} sessions shared a step");
    Some((same, compared, widest_run.load(Ordering::Relaxed)))
}

#[test]
fn a_sessions_logits_in_a_batch_are_those_it_has_alone() {
    batch_matches_alone(1, 2);
    batch_matches_alone(9, 3);
}

#[test]
fn sixty_four_sessions_in_one_batch_match_each_alone() {
    batch_matches_alone(64, 1);
}

/// On the CPU reference device (the model's whole passes there, as programs over batches of
/// sequences): every session's logits in a batch bit for bit those it has alone, 1, 5 and 64
/// sessions (the last with short prompts: the reference device computes ~10 rows a second).
#[test]
fn on_the_reference_device_a_batch_is_bit_for_bit_each_session_alone() {
    for (n, g, longest, widest) in [(1, 2, 37, 1), (5, 2, 37, 4), (64, 1, 3, 32)] {
        let (same, compared, run) = batch_matches_alone_on(On::Reference, n, g, longest).expect("the reference device");
        assert_eq!(same, compared);
        // The batches were runs of the model's program over the sessions' sequences, not
        // session by session (of the 64, at most 32 share a step: they join 16 a step).
        assert!(run >= widest, "{n} sessions: the widest program run had {run} sequences");
    }
}

/// On the native CPU device, as on the reference one: every session's logits in a batch bit
/// for bit those it has alone (its `exact` products sum each row alike whatever the batch).
#[test]
fn on_the_native_device_a_batch_is_bit_for_bit_each_session_alone() {
    for (n, g, longest, widest) in [(1, 2, 37, 1), (5, 2, 37, 4), (64, 1, 3, 32)] {
        let (same, compared, run) = batch_matches_alone_on(On::Native, n, g, longest).expect("the native device");
        assert_eq!(same, compared);
        assert!(run >= widest, "{n} sessions: the widest program run had {run} sequences");
    }
}

/// On wgpu (lavapipe here): each session's logits in a batch within an RMSE of 1e-3 of its
/// logits alone, its greedy token the same wherever the margin allows; prints how many rows
/// were bitwise equal.
#[test]
fn on_wgpu_a_batch_agrees_with_each_session_alone() {
    let Some((same, compared, _)) = batch_matches_alone_on(On::Wgpu, 9, 2, 37) else { return };
    println!("wgpu: {same} of {compared} logits rows in batches bitwise equal to the session's alone");
}

/// Tokens sampled by the step (greedy and at a temperature with a seed) are those `next`
/// samples for the same session alone, on the guest's CPU and on the reference device (where
/// greedy entries read back their top token alone, the others their logits).
#[test]
fn a_steps_samples_are_those_of_next() {
    samples_are_those_of_next(On::Guest);
    samples_are_those_of_next(On::Reference);
}

fn samples_are_those_of_next(on: On) {
    let (mut inst, m, widest) = open_on(on).expect("a device that is always there");
    let settings = [
        Sampling { temperature: 0.0, ..Sampling::default() },
        Sampling { temperature: 0.9, seed: 7, ..Sampling::default() },
        Sampling { temperature: 0.7, top_k: 0, top_p: 0.9, min_p: 0.0, repeat_penalty: 1.3, seed: 99, ..Sampling::default() },
        Sampling { temperature: 0.0, ..Sampling::default() },
    ];
    let n = settings.len();
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| prompt(&mut inst, m, 20 + i, 6 + 5 * i)).collect();
    let mut want = Vec::new();
    for (p, s) in prompts.iter().zip(&settings) {
        let session = inst.new_session(m, 128).unwrap().unwrap();
        inst.feed(session, p).unwrap().unwrap();
        want.push((0..6).map(|_| inst.next(session, s).unwrap().unwrap().token).collect::<Vec<u32>>());
        inst.drop_session(session).unwrap();
    }
    let sessions: Vec<Session> = (0..n).map(|_| inst.new_session(m, 128).unwrap().unwrap()).collect();
    let mut got = vec![Vec::new(); n];
    for k in 0..6 {
        let work: Vec<Advance> = (0..n)
            .map(|i| Advance { session: sessions[i], tokens: if k == 0 { &prompts[i] } else { &[] }, sample: Some(settings[i]) })
            .collect();
        for (i, r) in inst.step(m, &work).unwrap().unwrap().into_iter().enumerate() {
            got[i].push(r.unwrap().expect("a sampled token").token);
        }
    }
    assert_eq!(got, want, "{on:?}");
    // On the device the greedy entries ran as one program run, the others as another.
    assert!(on != On::Reference || widest.load(Ordering::Relaxed) == 2, "{on:?}: the widest run had {widest:?} sequences");
}

/// An entry's error is its own: the others advance, and its session is as it was. A session in
/// two entries, or of another model, fails the whole call with nothing changed.
#[test]
fn a_steps_errors_are_per_entry_or_change_nothing() {
    let (mut inst, m) = open();
    let a = inst.new_session(m, 16).unwrap().unwrap();
    let b = inst.new_session(m, 16).unwrap().unwrap();
    let c = inst.new_session(m, 16).unwrap().unwrap();
    let greedy = Some(Sampling::default());
    let bad = [u32::MAX];
    let long = [2u32; 17];
    let work = [
        Advance { session: a, tokens: &[2, 651], sample: greedy },
        Advance { session: b, tokens: &bad, sample: None },
        Advance { session: c, tokens: &long, sample: None },
    ];
    let r = inst.step(m, &work).unwrap().unwrap();
    assert!(matches!(r[0], Ok(Some(_))), "{:?}", r[0]);
    assert!(matches!(&r[1], Err(EngineError::InvalidArgument(e)) if e.contains("vocabulary")), "{:?}", r[1]);
    assert!(matches!(&r[2], Err(EngineError::ContextFull(_))), "{:?}", r[2]);
    assert_eq!((inst.position(a).unwrap(), inst.position(b).unwrap(), inst.position(c).unwrap()), (3, 0, 0));
    // Sampling a session that holds no token.
    let r = inst.step(m, &[Advance { session: b, tokens: &[], sample: greedy }]).unwrap().unwrap();
    assert!(matches!(&r[0], Err(EngineError::InvalidArgument(_))), "{:?}", r[0]);
    // A session twice, or of another model: the whole call, nothing changed.
    let twice = [Advance { session: a, tokens: &[651], sample: None }, Advance { session: a, tokens: &[651], sample: None }];
    assert!(matches!(inst.step(m, &twice).unwrap(), Err(EngineError::InvalidArgument(e)) if e.contains("earlier entry")));
    let other = inst.open_model(&model(), GpuMode::Off).unwrap().unwrap();
    let stranger = inst.new_session(other, 16).unwrap().unwrap();
    let mixed = [Advance { session: a, tokens: &[651], sample: None }, Advance { session: stranger, tokens: &[651], sample: None }];
    assert!(matches!(inst.step(m, &mixed).unwrap(), Err(EngineError::InvalidArgument(e)) if e.contains("another model")));
    assert_eq!((inst.position(a).unwrap(), inst.position(stranger).unwrap()), (3, 0));
    // No entries: nothing to do.
    assert_eq!(inst.step(m, &[]).unwrap().unwrap(), Vec::new());
}

/// The logits of `context` computed from scratch in a fresh session (capacity `n_ctx`), and the
/// CPU products' FLOPs that took.
fn from_scratch(inst: &mut Instance, m: Model, n_ctx: u32, context: &[u32]) -> (Vec<f32>, u64) {
    let s = inst.new_session(m, n_ctx).unwrap().unwrap();
    inst.feed(s, context).unwrap().unwrap();
    let logits = inst.logits(s).unwrap().unwrap();
    let flops = inst.stats(s).unwrap().cpu_flops;
    inst.drop_session(s).unwrap();
    (logits, flops)
}

fn bitwise(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Prefix reuse on `on`: a session of a prompt and a few greedy tokens (on a device, read back
/// as its top token alone) truncated to `k` tokens, or copied from its first `k`, then fed more,
/// has bit for bit the logits of that context computed from scratch; right after the
/// truncation too. The copied-from session goes on as if nothing happened. Past the position,
/// both calls are `invalid-argument` and change nothing.
fn prefix_reuse_matches_recomputing(on: On, n: usize) {
    let Some((mut inst, m, _)) = open_on(on) else { return };
    let p = prompt(&mut inst, m, 3, n);
    let more = prompt(&mut inst, m, 4, 5);
    let a = inst.new_session(m, 256).unwrap().unwrap();
    inst.feed(a, &p).unwrap().unwrap();
    let mut context = p.clone();
    for _ in 0..3 {
        context.push(inst.next(a, &Sampling::default()).unwrap().unwrap().token);
    }
    for k in [1, n / 2, n, n + 2] {
        let with = |k: usize| [&context[..k], &more[..]].concat();
        let (want, _) = from_scratch(&mut inst, m, 256, &with(k));
        let b = inst.fork(a, k as u32).unwrap().unwrap();
        assert_eq!(inst.position(b).unwrap(), k as u32);
        let (alone, _) = from_scratch(&mut inst, m, 256, &context[..k]);
        assert!(bitwise(&inst.logits(b).unwrap().unwrap(), &alone), "{on:?}: a copy of {k} tokens, its logits");
        inst.feed(b, &more).unwrap().unwrap();
        assert!(bitwise(&inst.logits(b).unwrap().unwrap(), &want), "{on:?}: a copy of {k} tokens, fed more");
        inst.drop_session(b).unwrap();
    }
    // The copied-from session is as it was: its next token's logits those from scratch.
    let token = inst.next(a, &Sampling::default()).unwrap().unwrap().token;
    context.push(token);
    let (want, _) = from_scratch(&mut inst, m, 256, &context);
    assert!(bitwise(&inst.logits(a).unwrap().unwrap(), &want), "{on:?}: the session copied from");
    // Truncations, each then fed more.
    for k in [n + 3, n - 1, 2] {
        inst.truncate(a, k as u32).unwrap().unwrap();
        assert_eq!(inst.position(a).unwrap(), k as u32);
        let (alone, _) = from_scratch(&mut inst, m, 256, &context[..k]);
        assert!(bitwise(&inst.logits(a).unwrap().unwrap(), &alone), "{on:?}: truncated to {k}, its logits");
        inst.feed(a, &more).unwrap().unwrap();
        let (want, _) = from_scratch(&mut inst, m, 256, &[&context[..k], &more[..]].concat());
        assert!(bitwise(&inst.logits(a).unwrap().unwrap(), &want), "{on:?}: truncated to {k}, fed more");
        inst.truncate(a, k as u32).unwrap().unwrap();
    }
    // Past the position: an error, nothing changed.
    let at = inst.position(a).unwrap();
    assert!(matches!(inst.truncate(a, at + 1).unwrap(), Err(EngineError::InvalidArgument(_))));
    assert!(matches!(inst.fork(a, at + 1).unwrap(), Err(EngineError::InvalidArgument(_))));
    assert_eq!(inst.position(a).unwrap(), at);
}

#[test]
fn truncating_or_copying_a_prefix_gives_the_logits_of_recomputing() {
    prefix_reuse_matches_recomputing(On::Guest, 24);
    prefix_reuse_matches_recomputing(On::Reference, 8);
}

/// Past a sliding window (Gemma's 512-token rings on the guest's CPU, 576 slots): a truncation
/// the ring still serves reruns the last kept token alone; one whose keys the ring has
/// overwritten runs the kept tokens again; both give the logits from scratch, and so does a
/// copy.
#[test]
fn a_truncation_past_a_sliding_window_reuses_the_ring_or_recomputes() {
    let (mut inst, m) = open();
    let context: Vec<u32> = (0..8).flat_map(|i| prompt(&mut inst, m, 30 + i, 80)).take(620).collect();
    assert_eq!(context.len(), 620);
    let more = prompt(&mut inst, m, 5, 4);
    let a = inst.new_session(m, 1024).unwrap().unwrap();
    inst.feed(a, &context).unwrap().unwrap();
    let (_, all) = from_scratch(&mut inst, m, 1024, &context);
    let per_token = all / context.len() as u64;
    let b = inst.fork(a, 600).unwrap().unwrap();
    for (s, k, reruns) in [(b, 600, 1), (a, 600, 1), (a, 30, 30)] {
        inst.truncate(s, k as u32).unwrap().unwrap();
        let before = inst.stats(s).unwrap().cpu_flops;
        inst.feed(s, &more).unwrap().unwrap();
        let ran = (inst.stats(s).unwrap().cpu_flops - before) / per_token;
        let (want, _) = from_scratch(&mut inst, m, 1024, &[&context[..k], &more[..]].concat());
        assert!(bitwise(&inst.logits(s).unwrap().unwrap(), &want), "truncated to {k}, fed more");
        // The products of the tokens that ran, in tokens' worth (the output projection adds
        // about two): the last kept one and those fed where the ring serves, all where not.
        let least = (reruns + more.len()) as u64;
        assert!(ran >= least && ran <= least + 3, "truncated to {k}: {ran} tokens' products ran, {least} tokens");
    }
}

/// The guest's memory after `n` sessions of `n_ctx` tokens each took a 16-token prompt and 4
/// greedy tokens in batched steps, in a fresh instance.
fn memory_with(n: usize, n_ctx: u32) -> usize {
    let (mut inst, m) = open();
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| prompt(&mut inst, m, 40 + i, 16)).collect();
    let sessions: Vec<Session> = (0..n).map(|_| inst.new_session(m, n_ctx).unwrap().unwrap()).collect();
    for k in 0..5 {
        let work: Vec<Advance> = (0..n)
            .map(|i| Advance { session: sessions[i], tokens: if k == 0 { &prompts[i] } else { &[] }, sample: Some(Sampling::default()) })
            .collect();
        for r in inst.step(m, &work).unwrap().unwrap() {
            r.unwrap();
        }
    }
    inst.memory_bytes()
}

/// Each extra session costs the guest its key/value cache and little else: measured across
/// fresh instances with 17 and 33 sessions batched, at most 4 MiB past its cache (its logits, a
/// share of the step's scratch of logits rows, its rotation tables and attention scores).
#[test]
fn an_extra_session_costs_its_kv_cache_and_little_else() {
    let (mut inst, m) = open();
    let info = inst.model_info(m).unwrap();
    let meta = |key: &str| -> u64 {
        let k = format!("{}.{key}", info.architecture);
        info.metadata.iter().find(|(name, _)| *name == k).and_then(|(_, v)| v.parse().ok()).unwrap_or_else(|| panic!("no {k}"))
    };
    let n_ctx = 512u32;
    // Keys and values in f32 for every layer and position (within Gemma's 512-token window, its
    // sliding layers hold every position too).
    let kv = info.n_layers as u64 * 2 * 4 * meta("attention.head_count_kv") * meta("attention.key_length") * n_ctx as u64;
    drop(inst);
    // The guest's memory only grows, and the first sessions fit where loading the model freed
    // memory: measured past that, between 17 and 33 sessions.
    let (fewer, more) = (memory_with(17, n_ctx), memory_with(33, n_ctx));
    let extra = (more - fewer) as u64 / 16;
    println!("guest memory: {} MiB with 17 sessions, {} MiB with 33; {:.2} MiB an extra session, its KV cache {:.2} MiB", fewer >> 20, more >> 20, extra as f64 / 1048576.0, kv as f64 / 1048576.0);
    assert!(extra >= kv * 9 / 10, "{extra} bytes an extra session: less than its KV cache of {kv}?");
    assert!(extra <= kv + (4 << 20), "{extra} bytes an extra session, its KV cache {kv}");
}

/// `reset` and `truncate` start the sampler again: a seed then gives the draws it gives a new
/// session (so that a server reusing a session for a later request answers as a fresh one).
#[test]
fn a_reset_or_truncated_session_samples_as_a_new_one() {
    let (mut inst, m) = open();
    let p = prompt(&mut inst, m, 5, 9);
    let s = Sampling { temperature: 1.0, top_k: 0, seed: 12, ..Sampling::default() };
    let draws = |inst: &mut Instance, session| (0..8).map(|_| inst.next(session, &s).unwrap().unwrap().token).collect::<Vec<u32>>();
    let session = inst.new_session(m, 64).unwrap().unwrap();
    inst.feed(session, &p).unwrap().unwrap();
    let fresh = draws(&mut inst, session);
    inst.reset(session).unwrap();
    inst.feed(session, &p).unwrap().unwrap();
    assert_eq!(draws(&mut inst, session), fresh, "after reset");
    inst.truncate(session, p.len() as u32).unwrap().unwrap();
    assert_eq!(draws(&mut inst, session), fresh, "after truncate");
}
