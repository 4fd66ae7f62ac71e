//! The guest's memory for a model: opened from a file, the guest reads it a piece at a time and
//! holds the converted weights (about the file's size), not the file beside them; the weights
//! are the ones `from-bytes` makes from the whole file.

use std::path::Path;
use wisp::{GpuCtx, GpuMode, Sampling};
use wisp_tests::{model, open, qwen_model};

/// The guest's memory after opening `path` with the GPU off and generating 32 tokens, as
/// `wisp run --gpu off` does; and the logits after the prompt.
fn run(path: &Path, from_bytes: bool) -> (usize, Vec<f32>) {
    let (mut inst, m) = if from_bytes {
        let wisp = wisp::Wisp::new(wisp::Options::default()).unwrap();
        let mut inst = wisp.instantiate(GpuCtx::none(), None).unwrap();
        let m = inst.open_model_bytes(&std::fs::read(path).unwrap(), GpuMode::Off).unwrap().unwrap();
        (inst, m)
    } else {
        open(path, GpuCtx::none(), GpuMode::Off)
    };
    let prompt = inst.tokenize(m, "The history of the printing press begins", true, false).unwrap().unwrap();
    let s = inst.new_session(m, prompt.len() as u32 + 32).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    let logits = inst.logits(s).unwrap().unwrap();
    for _ in 0..32 {
        inst.next(s, &Sampling::default()).unwrap().unwrap();
    }
    (inst.memory_bytes(), logits)
}

fn check(path: &Path) {
    let file = std::fs::metadata(path).unwrap().len() as f64;
    let (memory, logits) = run(path, false);
    let ratio = memory as f64 / file;
    println!("{}: guest memory {} MiB for a file of {} MiB: {ratio:.3}x", path.display(), memory >> 20, file as u64 >> 20);
    assert!(ratio <= 1.2, "{}: the guest holds {ratio:.3}x the file", path.display());
    // The same weights as a load from the whole file in memory: the same logits, bit for bit.
    let (_, whole) = run(path, true);
    assert!(logits.len() == whole.len() && logits.iter().zip(&whole).all(|(a, b)| a.to_bits() == b.to_bits()), "other logits");
}

#[test]
fn gemma_takes_at_most_1_2x_its_file_in_guest_memory() {
    check(model());
}

#[test]
fn qwen_takes_at_most_1_2x_its_file_in_guest_memory() {
    check(qwen_model());
}
