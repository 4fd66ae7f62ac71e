//! A hostile guest for the host's reliability tests: a component of the `inference` world whose
//! `model.open` and `model.from-bytes` never return when asked not to. Named by the path or
//! the bytes:
//!
//! - `spin`: loops forever (the host's per-call time limit must end it);
//! - `recurse`: recurses without bound (the host's stack limit must end it);
//! - `grow`: allocates without bound, 1 MiB at a time, as a leak would (the host's memory limit
//!   refuses the growth; the allocator then aborts, a trap);
//! - anything else: the typed error `unsupported`, so a caller can tell the fixture is alive.
//!
//! No model ever opens, so the model and session resources are uninhabited types: their
//! methods cannot be called.

#![cfg(target_arch = "wasm32")]

use bindings::exports::wisp::llm::engine::{
    Error, Guest, GuestModel, GuestSession, LoadOptions, ModelInfo, Sampling, Stats, Step,
};
use std::hint::black_box;

mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "inference",
    });

    use super::Runaway;
    export!(Runaway with_types_in self);
}

struct Runaway;

/// No model opens in this fixture.
enum Model {}

/// No session opens in this fixture.
enum Session {}

impl Guest for Runaway {
    type Model = Model;
    type Session = Session;
}

/// Never returns: counts forever (through `black_box`, so the loop stays).
fn spin() -> ! {
    let mut n = 0u64;
    loop {
        n = black_box(n.wrapping_add(1));
    }
}

/// Recurses `depth` times; called with `u64::MAX`, it overflows any stack first.
fn recurse(depth: u64) -> u64 {
    if depth == 0 {
        return 0;
    }
    black_box(recurse(black_box(depth - 1))) + 1
}

/// Allocates (and touches) 1 MiB after 1 MiB and keeps it all; never returns.
fn grow() -> ! {
    let mut held: Vec<Vec<u8>> = Vec::new();
    loop {
        held.push(vec![1u8; 1 << 20]);
        black_box(&mut held);
    }
}

fn run(what: &[u8]) -> Result<bindings::exports::wisp::llm::engine::Model, Error> {
    let has = |needle: &[u8]| what.windows(needle.len()).any(|w| w == needle);
    if has(b"spin") {
        spin()
    }
    if has(b"grow") {
        grow()
    }
    if has(b"recurse") {
        let depth = recurse(black_box(u64::MAX));
        return Err(Error::Unsupported(format!("recursed {depth} times without running out of stack")));
    }
    Err(Error::Unsupported("the runaway fixture only spins, recurses or grows".into()))
}

impl GuestModel for Model {
    fn open(path: String, _: LoadOptions) -> Result<bindings::exports::wisp::llm::engine::Model, Error> {
        run(path.as_bytes())
    }
    fn from_bytes(bytes: Vec<u8>, _: LoadOptions) -> Result<bindings::exports::wisp::llm::engine::Model, Error> {
        run(&bytes)
    }
    fn info(&self) -> ModelInfo {
        match *self {}
    }
    fn tokenize(&self, _: String, _: bool, _: bool) -> Result<Vec<u32>, Error> {
        match *self {}
    }
    fn token_piece(&self, _: u32, _: bool) -> Result<Vec<u8>, Error> {
        match *self {}
    }
    fn detokenize(&self, _: Vec<u32>, _: bool) -> Result<String, Error> {
        match *self {}
    }
    fn is_end_of_generation(&self, _: u32) -> bool {
        match *self {}
    }
    fn apply_chat_template(&self, _: Vec<(String, String)>, _: bool) -> Result<String, Error> {
        match *self {}
    }
    fn set_chat_template(&self, _: String) -> Result<(), Error> {
        match *self {}
    }
    fn render_chat(&self, _: String, _: bool) -> Result<bindings::exports::wisp::llm::engine::RenderedChat, Error> {
        match *self {}
    }
    fn embed(&self, _: Vec<Vec<u32>>, _: bindings::exports::wisp::llm::engine::Pooling) -> Result<Vec<Vec<f32>>, Error> {
        match *self {}
    }
    fn new_session(&self, _: u32) -> Result<bindings::exports::wisp::llm::engine::Session, Error> {
        match *self {}
    }
    fn step(&self, _: Vec<bindings::exports::wisp::llm::engine::Advance<'_>>) -> Result<Vec<Result<Option<Step>, Error>>, Error> {
        match *self {}
    }
}

impl GuestSession for Session {
    fn feed(&self, _: Vec<u32>) -> Result<(), Error> {
        match *self {}
    }
    fn next(&self, _: Sampling) -> Result<Step, Error> {
        match *self {}
    }
    fn constrain(&self, _: Option<bindings::exports::wisp::llm::engine::Constraint>) -> Result<(), Error> {
        match *self {}
    }
    fn logits(&self) -> Result<Vec<f32>, Error> {
        match *self {}
    }
    fn top(&self, _: u32) -> Result<Vec<(u32, f32)>, Error> {
        match *self {}
    }
    fn position(&self) -> u32 {
        match *self {}
    }
    fn capacity(&self) -> u32 {
        match *self {}
    }
    fn reset(&self) {
        match *self {}
    }
    fn truncate(&self, _: u32) -> Result<(), Error> {
        match *self {}
    }
    fn fork(&self, _: u32) -> Result<bindings::exports::wisp::llm::engine::Session, Error> {
        match *self {}
    }
    fn stats(&self) -> Stats {
        match *self {}
    }
}
