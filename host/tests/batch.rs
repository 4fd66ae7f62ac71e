//! Batched steps (`model.step`, continuous batching) on the guest's CPU path, with the default
//! model: each session's logits in a batch are bit for bit those of the same session alone,
//! whatever shares its steps (sessions joining and leaving mid-way, prompts fed in chunks of
//! different sizes); sampled tokens are those of `next`; errors are per entry or, for the
//! whole call, leave every session as it was.

use std::path::PathBuf;
use wisp::{Advance, EngineError, GpuCtx, GpuMode, Instance, Model, Options, Sampling, Session, Wisp};

fn model() -> PathBuf {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| wisp::fetch::ensure(&wisp::fetch::GEMMA3_270M, false).expect("fetching the default model")).clone()
}

fn open() -> (Instance, Model) {
    let path = model();
    let wisp = Wisp::new(Options::default()).unwrap();
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent()).unwrap();
    let m = inst.open_model(&path, GpuMode::Off).unwrap().unwrap();
    (inst, m)
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

/// Runs `n` sessions through batched steps, each fed its prompt in chunks and then `g` greedy
/// tokens (the host's choice from its logits, fed back), joining at different steps and leaving
/// when done; every logits row read after a step must equal the session's alone, bit for bit.
fn batch_matches_alone(n: usize, g: usize) {
    let (mut inst, m) = open();
    let mut lives: Vec<Live> = (0..n)
        .map(|i| Live {
            prompt: prompt(&mut inst, m, i, 1 + (i * 11) % 37),
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
            let want = &reference[*i][l.checked];
            let same = got.len() == want.len() && got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "session {i} (prompt of {}, chunks of {}), logits {} at step {step_no}: not those of the session alone", l.prompt.len(), l.chunk, l.checked);
            l.checked += 1;
            if l.checked > g {
                inst.drop_session(s).unwrap();
                l.session = None;
            }
        }
        step_no += 1;
    }
    assert!(widest >= n.min(4) * 3 / 4, "at most {widest} sessions shared a step");
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

/// Tokens sampled by the step (greedy and at a temperature with a seed) are those `next`
/// samples for the same session alone.
#[test]
fn a_steps_samples_are_those_of_next() {
    let (mut inst, m) = open();
    let settings = [
        Sampling { temperature: 0.0, ..Sampling::default() },
        Sampling { temperature: 0.9, seed: 7, ..Sampling::default() },
        Sampling { temperature: 0.7, top_k: 0, top_p: 0.9, min_p: 0.0, repeat_penalty: 1.3, seed: 99, ..Sampling::default() },
    ];
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(&mut inst, m, 20 + i, 6 + 5 * i)).collect();
    let mut want = Vec::new();
    for (p, s) in prompts.iter().zip(&settings) {
        let session = inst.new_session(m, 128).unwrap().unwrap();
        inst.feed(session, p).unwrap().unwrap();
        want.push((0..6).map(|_| inst.next(session, s).unwrap().unwrap().token).collect::<Vec<u32>>());
        inst.drop_session(session).unwrap();
    }
    let sessions: Vec<Session> = (0..3).map(|_| inst.new_session(m, 128).unwrap().unwrap()).collect();
    let mut got = vec![Vec::new(); 3];
    for k in 0..6 {
        let work: Vec<Advance> = (0..3)
            .map(|i| Advance { session: sessions[i], tokens: if k == 0 { &prompts[i] } else { &[] }, sample: Some(settings[i]) })
            .collect();
        for (i, r) in inst.step(m, &work).unwrap().unwrap().into_iter().enumerate() {
            got[i].push(r.unwrap().expect("a sampled token").token);
        }
    }
    assert_eq!(got, want);
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
