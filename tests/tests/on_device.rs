//! Weights on the device: a model the guest cannot hold (here, the default model under a guest
//! memory limit below its weights) goes to the device that is offered, each matrix streamed
//! there a piece at a time as it is read, the guest keeping the metadata, the tokenizer, the
//! norms and where the embedding's rows lie in the file; its sessions' keys and values live
//! there too. Its logits and tokens are the ones the same device gives where the guest also
//! holds a copy, bit for bit, alone and as a server uses sessions (copies of a context, cuts,
//! batched steps). A model nothing can hold is refused in one line that names both
//! numbers; a device lost under a model it alone holds is a typed error for each session, not
//! a trap and not a replay on a CPU that has no weights.

use std::sync::atomic::Ordering;
use wisp::{Advance, Budget, EngineError, GpuCtx, GpuMode, Instance, Model, NativeBackend, Options, Pooling, Sampling, Wisp};
use wisp_tests::{Losable, model, open};

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

/// Embeddings of a short text and one past a prompt's batch, mean-pooled.
fn embeddings(inst: &mut Instance, m: Model) -> Vec<Vec<f32>> {
    let texts = ["Printing presses", &"Movable type spread across Europe within decades. ".repeat(8)];
    let tokens: Vec<Vec<u32>> = texts.iter().map(|t| inst.tokenize(m, t, true, false).unwrap().unwrap()).collect();
    inst.embed(m, &tokens, Pooling::Mean).unwrap().unwrap()
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
    let embedded = embeddings(&mut both, m);
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
        let got = embeddings(&mut inst, m);
        assert!(got.iter().zip(&embedded).all(|(a, b)| bits(a) == bits(b)), "{mode:?}: the embeddings");
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

#[test]
fn a_device_lost_under_a_model_it_alone_holds_is_an_error_for_each_session() {
    let (device, lost) = Losable::new(native());
    let mut inst = instance(GpuCtx::new(Box::new(device), Budget::default()), LIMIT);
    let m = inst.open_model(model(), GpuMode::Auto).expect("no trap").expect("the model opens on the device");
    let prompt = inst.tokenize(m, "Once upon a time", true, false).unwrap().unwrap();
    let s = inst.new_session(m, 64).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    inst.next(s, &Sampling::default()).unwrap().unwrap();

    lost.store(true, Ordering::SeqCst);
    let is_lost = |r: Result<(), EngineError>, what: &str| match r {
        Err(EngineError::Io(m)) if m.contains("was lost (simulated loss mid-session)") && m.contains("load the model again") => {}
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
