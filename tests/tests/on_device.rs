//! Weights on the device: a model the guest cannot hold (here, the default model under a guest
//! memory limit below its weights) goes to the device that is offered, each matrix streamed
//! there a piece at a time as it is read, the guest keeping the metadata, the tokenizer, the
//! norms and where the embedding's rows lie in the file; its sessions' keys and values live
//! there too. Its logits and tokens are the ones the same device gives where the guest also
//! holds a copy, bit for bit, alone and as a server uses sessions (copies of a context, cuts,
//! batched steps). A model nothing can hold is refused in one line that names both
//! numbers; a device lost under a model it alone holds is a typed error for each session, not
//! a trap and not a replay on a CPU that has no weights.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use wisp::gpu::program::{Output, Program, SequenceRun};
use wisp::{
    Activation, Advance, AttentionShape, Backend, BufferId, Budget, Device, EngineError, Format, GpuCtx, GpuError, GpuMode, Instance, Model, NativeBackend, Options,
    Precision, Sampling, Wisp,
};
use wisp_tests::{model, open};

/// The guest's memory limit: far below the default model's weights (about 250 MiB converted).
const LIMIT: usize = 96 << 20;

fn native() -> Box<NativeBackend> {
    Box::new(NativeBackend::new(2).expect("the native device"))
}

/// An instance with its memory capped at `max_memory`, offered `gpu`.
fn instance(gpu: GpuCtx, max_memory: usize) -> Instance {
    let wisp = Wisp::new(Options { max_memory, ..Options::default() }).expect("the runtime");
    wisp.instantiate(gpu, model().parent()).expect("an instance")
}

/// The logits after a prompt, then 16 greedy tokens.
fn generate(inst: &mut Instance, m: Model) -> (Vec<f32>, Vec<u32>) {
    let prompt = inst.tokenize(m, "The history of the printing press begins", true, false).unwrap().unwrap();
    let s = inst.new_session(m, 128).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    let logits = inst.logits(s).unwrap().unwrap();
    let tokens = (0..16).map(|_| inst.next(s, &Sampling::default()).unwrap().unwrap().token).collect();
    (logits, tokens)
}

/// What a server does with sessions, greedy: a copy of a session's context continued, a
/// session cut back and continued, and three sessions advanced in batched steps (each fed its
/// own prompt in the first). Every token, in order.
fn serve_like(inst: &mut Instance, m: Model) -> Vec<u32> {
    let greedy = Sampling { temperature: 0.0, ..Sampling::default() };
    let prompt = inst.tokenize(m, "A list of the planets:", true, false).unwrap().unwrap();
    let s = inst.new_session(m, 96).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    let mut out: Vec<u32> = (0..6).map(|_| inst.next(s, &greedy).unwrap().unwrap().token).collect();
    let copy = inst.fork(s, prompt.len() as u32 + 3).unwrap().unwrap();
    out.extend((0..4).map(|_| inst.next(copy, &greedy).unwrap().unwrap().token));
    inst.truncate(s, prompt.len() as u32).unwrap().unwrap();
    out.extend((0..4).map(|_| inst.next(s, &greedy).unwrap().unwrap().token));
    let texts = ["One, two,", "The sky is", "def main():"];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| inst.tokenize(m, t, true, false).unwrap().unwrap()).collect();
    let sessions: Vec<_> = prompts.iter().map(|_| inst.new_session(m, 64).unwrap().unwrap()).collect();
    for round in 0..4 {
        let work: Vec<Advance<'_>> = sessions
            .iter()
            .zip(&prompts)
            .map(|(&session, p)| Advance { session, tokens: if round == 0 { p } else { &[] }, sample: Some(greedy) })
            .collect();
        for r in inst.step(m, &work).unwrap().unwrap() {
            out.push(r.unwrap().unwrap().token);
        }
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_model_past_the_guest_memory_lives_on_the_device_with_the_same_logits() {
    let path = model();
    // The native device running every pass, the guest holding a copy as well.
    let (mut both, m) = open(path, GpuCtx::new(native(), Budget::default()), GpuMode::On);
    let want = generate(&mut both, m);
    let served = serve_like(&mut both, m);
    let copies = both.model_info(m).unwrap().gpu_weights;
    drop(both);

    for mode in [GpuMode::Auto, GpuMode::On] {
        let mut inst = instance(GpuCtx::new(native(), Budget::default()), LIMIT);
        let m = inst.open_model(path, mode).expect("no trap").expect("the model opens on the device");
        assert_eq!(inst.model_info(m).unwrap().gpu_weights, copies, "{mode:?}: every matrix on the device");
        let got = generate(&mut inst, m);
        assert_eq!(bits(&got.0), bits(&want.0), "{mode:?}: the prompt's logits");
        assert_eq!(got.1, want.1, "{mode:?}: the greedy tokens");
        assert_eq!(serve_like(&mut inst, m), served, "{mode:?}: forks, truncations and batched steps");
        let file = std::fs::metadata(path).unwrap().len() as usize;
        let peak = inst.memory_bytes();
        println!("{mode:?}: guest memory {} MiB at most, for a file of {} MiB", peak >> 20, file >> 20);
        assert!(peak <= LIMIT && peak < file / 3, "{mode:?}: the guest grew to {peak} bytes");
    }
}

#[test]
fn a_model_nothing_can_hold_is_refused_in_one_line_naming_both_numbers() {
    let path = model();
    let refused = |inst: &mut Instance, mode: GpuMode| match inst.open_model(path, mode).expect("no trap") {
        Err(EngineError::OutOfMemory(m)) if !m.contains('\n') => m,
        other => panic!("want one line of out-of-memory, got {:?}", other.map(|_| ())),
    };
    // No device, or the guest told not to use it: the guest's limit alone.
    let m = refused(&mut instance(GpuCtx::none(), LIMIT), GpuMode::Auto);
    assert!(m.contains("MiB of guest memory") && m.contains("no device"), "{m}");
    let m = refused(&mut instance(GpuCtx::new(native(), Budget::default()), LIMIT), GpuMode::Off);
    assert!(m.contains("MiB of guest memory") && m.contains("no device"), "{m}");
    // A device whose budget is below the weights: both numbers.
    let small = GpuCtx::new(native(), Budget { bytes: 64 << 20, ..Budget::default() });
    let m = refused(&mut instance(small, LIMIT), GpuMode::Auto);
    assert!(m.contains("MiB of guest memory") && m.contains("past its budget of 64 MiB"), "{m}");
}

/// The native device until `lost` is set (as a driver reset would do), then `device-lost` for
/// every call.
struct Losable {
    inner: Box<NativeBackend>,
    lost: Arc<AtomicBool>,
}

impl Losable {
    fn check(&self) -> Result<(), GpuError> {
        match self.lost.load(Ordering::SeqCst) {
            true => Err(GpuError::DeviceLost("the driver reset the device".into())),
            false => Ok(()),
        }
    }
}

impl Backend for Losable {
    fn device(&self) -> Option<Device> {
        self.inner.device()
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        self.check()?;
        self.inner.create(f, n_out, n_in)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.check()?;
        self.inner.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.check()?;
        self.inner.matmul(x, t, n_in, jobs)
    }
    fn matmul_op(&mut self, id: BufferId, x: &[f32], t: u32, n_in: u32, precision: Precision) -> Result<Vec<f32>, GpuError> {
        self.check()?;
        self.inner.matmul_op(id, x, t, n_in, precision)
    }
    fn matmul_ops(&mut self, ids: &[BufferId], x: &[f32], t: u32, n_in: u32, precision: Precision) -> Result<Vec<Vec<f32>>, GpuError> {
        self.check()?;
        self.inner.matmul_ops(ids, x, t, n_in, precision)
    }
    fn gated(&mut self, act: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
        self.inner.gated(act, gate, up)
    }
    fn free(&mut self, id: BufferId) {
        self.inner.free(id)
    }
    fn create_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        self.check()?;
        self.inner.create_cache(slots, width)
    }
    fn free_cache(&mut self, id: BufferId) {
        self.inner.free_cache(id)
    }
    fn write_cache(&mut self, id: BufferId, first: u32, k: &[f32], v: &[f32]) -> Result<(), GpuError> {
        self.check()?;
        self.inner.write_cache(id, first, k, v)
    }
    fn attention_cached(&mut self, q: &[f32], k: &[f32], v: &[f32], first_new: u32, cache: BufferId, first_key: u32, shape: &AttentionShape) -> Result<Vec<f32>, GpuError> {
        self.check()?;
        self.inner.attention_cached(q, k, v, first_new, cache, first_key, shape)
    }
    fn run_program(&mut self, p: &Program, inputs: &[Vec<f32>], batch: &[SequenceRun]) -> Option<Result<Vec<Output>, GpuError>> {
        if let Err(e) = self.check() {
            return Some(Err(e));
        }
        self.inner.run_program(p, inputs, batch)
    }
}

#[test]
fn a_device_lost_under_a_model_it_alone_holds_is_an_error_for_each_session() {
    let lost = Arc::new(AtomicBool::new(false));
    let device = Losable { inner: native(), lost: lost.clone() };
    let mut inst = instance(GpuCtx::new(Box::new(device), Budget::default()), LIMIT);
    let m = inst.open_model(model(), GpuMode::Auto).expect("no trap").expect("the model opens on the device");
    let prompt = inst.tokenize(m, "Once upon a time", true, false).unwrap().unwrap();
    let s = inst.new_session(m, 64).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    inst.next(s, &Sampling::default()).unwrap().unwrap();

    lost.store(true, Ordering::SeqCst);
    let is_lost = |r: Result<(), EngineError>, what: &str| match r {
        Err(EngineError::Io(m)) if m.contains("was lost") && m.contains("load the model again") => {}
        other => panic!("{what}: want an i/o error saying the device was lost, got {other:?}"),
    };
    // The pending token's pass meets the loss; every later pass too; no trap.
    is_lost(inst.next(s, &Sampling::default()).expect("no trap").map(|_| ()), "the step after the loss");
    is_lost(inst.next(s, &Sampling::default()).expect("no trap").map(|_| ()), "the step after that");
    let other = inst.new_session(m, 64).unwrap().unwrap();
    is_lost(inst.feed(other, &prompt).expect("no trap"), "a new session's prompt");
    // The instance itself carries on: what needs no device still answers.
    assert_eq!(inst.tokenize(m, "Once upon a time", true, false).unwrap().unwrap(), prompt);
}
