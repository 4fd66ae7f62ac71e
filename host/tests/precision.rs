//! `precision: fast` on the guest's CPU: the products of every weight format but Q8_0 take int8
//! activations (`guest/src/kernels/int8.rs`). The native host runs the guest built with relaxed
//! SIMD, other hosts the portable build: their `fast` logits are the same bits. `fast` differs
//! from `exact` (the int8 products ran) and stays near it (the golden thresholds are checked in
//! `cli.rs`); a session's `fast` logits do not depend on the sessions sharing its step; and
//! sessions of model handles of two precisions cannot share a step.

use std::path::PathBuf;
use wisp::{Advance, EngineError, GpuCtx, GpuMode, Instance, LoadOptions, Model, Options, Precision, Sampling, Wisp};

fn model() -> PathBuf {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).expect("fetching the default model")).clone()
}

fn options(precision: Precision) -> LoadOptions {
    LoadOptions { gpu: GpuMode::Off, precision }
}

/// An instance of `guest` with the default model open at `precision`.
fn open(guest: &[u8], precision: Precision) -> (Instance, Model) {
    let path = model();
    let wisp = Wisp::with_component(guest, Options::default()).unwrap();
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent()).unwrap();
    let m = inst.open_model(&path, options(precision)).unwrap().unwrap();
    (inst, m)
}

/// A prompt of `n` tokens (more than one 4-token group of the prefill kernel, and a remainder).
fn prompt(inst: &mut Instance, m: Model, n: usize) -> Vec<u32> {
    let text = "The river of light runs north under seven quiet bridges, and a cat watches the boats go by. ".repeat(4);
    let mut tokens = inst.tokenize(m, &text, true, false).unwrap().unwrap();
    tokens.truncate(n);
    assert_eq!(tokens.len(), n);
    tokens
}

/// The most likely token (the lowest id among equals).
fn argmax(logits: &[f32]) -> u32 {
    (0..logits.len()).fold(0, |best, i| if logits[i] > logits[best] { i } else { best }) as u32
}

/// The logits after `prompt` (fed at once: the prefill kernels), then after each of 3 greedy
/// tokens fed back (the one-token kernels).
fn logits(inst: &mut Instance, m: Model, prompt: &[u32]) -> Vec<Vec<f32>> {
    let s = inst.new_session(m, 128).unwrap().unwrap();
    inst.feed(s, prompt).unwrap().unwrap();
    let mut out = vec![inst.logits(s).unwrap().unwrap()];
    for _ in 0..3 {
        let token = argmax(out.last().unwrap());
        inst.feed(s, &[token]).unwrap().unwrap();
        out.push(inst.logits(s).unwrap().unwrap());
    }
    inst.drop_session(s).unwrap();
    out
}

fn rmse(a: &[f32], b: &[f32]) -> f64 {
    (a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>() / a.len() as f64).sqrt()
}

#[test]
fn logits_are_the_same_bits_in_the_portable_and_relaxed_guests() {
    let (mut relaxed, rm) = open(wisp::GUEST_RELAXED_WASM, Precision::Fast);
    let p = prompt(&mut relaxed, rm, 23);
    let fast = logits(&mut relaxed, rm, &p);
    let (mut portable, pm) = open(wisp::GUEST_WASM, Precision::Fast);
    let fast_portable = logits(&mut portable, pm, &p);
    for (i, (a, b)) in fast.iter().zip(&fast_portable).enumerate() {
        let same = a.iter().zip(b).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
        assert_eq!(same, a.len(), "step {i}: {} of {} logits differ between the relaxed and portable guests", a.len() - same, a.len());
    }
    // The int8 products ran (`exact` gives other logits), and stay near exact math.
    let (mut exact_inst, em) = open(wisp::GUEST_RELAXED_WASM, Precision::Exact);
    let exact = logits(&mut exact_inst, em, &p);
    // `exact` is the same in both builds too (relaxed SIMD is only in the int8 products).
    let (mut exact_portable, epm) = open(wisp::GUEST_WASM, Precision::Exact);
    let exact_p = logits(&mut exact_portable, epm, &p);
    for (i, (a, b)) in exact.iter().zip(&exact_p).enumerate() {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "step {i}: exact logits differ between the builds");
    }
    for (i, (f, e)) in fast.iter().zip(&exact).enumerate() {
        let r = rmse(f, e);
        assert!(r > 1e-3 && r < 0.5, "step {i}: fast vs exact RMSE {r}");
    }
    assert_eq!(argmax(&fast[0]), argmax(&exact[0]), "the prompt's most likely next token");
}

#[test]
fn a_sessions_fast_logits_do_not_depend_on_its_step() {
    let (mut inst, m) = open(wisp::native_guest(), Precision::Fast);
    let prompts: Vec<Vec<u32>> = [9usize, 17, 6].iter().map(|&n| prompt(&mut inst, m, n)).collect();
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| {
            let s = inst.new_session(m, 128).unwrap().unwrap();
            inst.feed(s, p).unwrap().unwrap();
            let l = inst.logits(s).unwrap().unwrap();
            inst.drop_session(s).unwrap();
            l
        })
        .collect();
    let sessions: Vec<_> = prompts.iter().map(|_| inst.new_session(m, 128).unwrap().unwrap()).collect();
    let work: Vec<Advance<'_>> = sessions.iter().zip(&prompts).map(|(&s, p)| Advance { session: s, tokens: p, sample: None }).collect();
    for r in inst.step(m, &work).unwrap().unwrap() {
        r.expect("each session's step");
    }
    for (i, (&s, want)) in sessions.iter().zip(&alone).enumerate() {
        let got = inst.logits(s).unwrap().unwrap();
        assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "session {i}: its logits in the step differ from alone");
    }
}

/// Two handles of one preloaded model at two precisions: a session of the `fast` one in a step
/// of the `exact` one is refused with a typed error, and the others of the step go on.
#[test]
fn sessions_of_two_precisions_cannot_share_a_step() {
    let path = model();
    let wisp = Wisp::preloaded(&path, Options::default()).unwrap();
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent()).unwrap();
    let exact = inst.open_model(&path, options(Precision::Exact)).unwrap().unwrap();
    let fast = inst.open_model(&path, options(Precision::Fast)).unwrap().unwrap();
    let p = prompt(&mut inst, exact, 5);
    let (a, b) = (inst.new_session(exact, 64).unwrap().unwrap(), inst.new_session(fast, 64).unwrap().unwrap());
    let greedy = Sampling { temperature: 0.0, ..Sampling::default() };
    let work = [Advance { session: a, tokens: &p, sample: Some(greedy.clone()) }, Advance { session: b, tokens: &p, sample: Some(greedy) }];
    let results = inst.step(exact, &work).unwrap().unwrap();
    assert!(matches!(&results[0], Ok(Some(_))), "{:?}", results[0]);
    match &results[1] {
        Err(EngineError::InvalidArgument(m)) => assert!(m.contains("precision"), "{m}"),
        other => panic!("a session of a fast handle in an exact handle's step: {other:?}"),
    }
    // Refused, it is as it was: nothing fed.
    assert_eq!(inst.position(b).unwrap(), 0);
}
