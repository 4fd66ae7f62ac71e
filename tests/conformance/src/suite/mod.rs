//! The cases of the kit and what they share: calls to the host that turn its answers into a
//! case's verdict, never into a trap.
//!
//! A case is a function `fn(&mut Ctx) -> Check<String>`: `Ok` carries what was checked,
//! `Err(Stop::Fail)` what went wrong (the call, the shape, the values), `Err(Stop::Skip)` why the
//! case cannot run on this host. Every case drops what it uploaded before it returns.

mod hostile;
mod products;
mod programs;
mod resources;

use crate::bindings::wisp::llm::gpu::{self, DeviceInfo, Error, MatmulOp, Op, Output, Precision, Program, Sequence, Weight as Handle, WeightFormat};
use crate::bindings::{CaseResult, Guest};
use crate::reference::{self, Decoded, Format, Weight};
use crate::rng::Rng;
use std::time::Instant;

pub struct Kit;

/// Why a case ended without passing.
pub enum Stop {
    Fail(String),
    Skip(String),
}

pub type Check<T = ()> = Result<T, Stop>;

pub fn fail<T>(message: impl Into<String>) -> Check<T> {
    Err(Stop::Fail(message.into()))
}

pub fn skip<T>(why: impl Into<String>) -> Check<T> {
    Err(Stop::Skip(why.into()))
}

/// What a case works with.
pub struct Ctx {
    /// The device as `available` reports it when the case starts.
    pub device: DeviceInfo,
    /// The budget when the kit started: `(bytes, handles)`.
    pub initial: (u64, u32),
    pub rng: Rng,
    /// The largest error of a product the case compared (see `reference::compare`).
    pub max_error: f64,
}

type Case = (&'static str, fn(&mut Ctx) -> Check<String>);

/// The cases that need a device, in the order they run.
const DEVICE_CASES: &[Case] = &[
    ("matmul-f32", |c| products::format(c, Format::F32)),
    ("matmul-bf16", |c| products::format(c, Format::Bf16)),
    ("matmul-q8x32", |c| products::format(c, Format::Q8x32)),
    ("matmul-q8x16", |c| products::format(c, Format::Q8x16)),
    ("matmul-q4x32", |c| products::format(c, Format::Q4x32)),
    ("matmul-batch", products::batch),
    ("write-rows-chunked", products::chunked),
    ("unwritten-rows-read-zero", products::unwritten_rows),
    ("nan-inf-input", products::non_finite_input),
    ("nan-inf-weights", products::non_finite_weights),
    ("weight-accessors", resources::accessors),
    ("handle-lifetimes", resources::lifetimes),
    ("budget-handles", resources::budget_handles),
    ("budget-bytes", resources::budget_bytes),
    ("limit-weight-bytes", resources::limit_weight_bytes),
    ("limit-activation-elements", resources::limit_activations),
    ("hostile-upload-lengths", hostile::upload_lengths),
    ("hostile-n-in-not-block", hostile::n_in_not_block),
    ("hostile-zero-shapes", hostile::zero_shapes),
    ("hostile-overflowing-shapes", hostile::overflowing_shapes),
    ("hostile-x-length", hostile::x_length),
    ("hostile-no-outputs", hostile::no_outputs),
    ("hostile-cols-mismatch", hostile::cols_mismatch),
    ("hostile-huge-weight-list", hostile::huge_weight_list),
    ("hostile-write-rows", hostile::write_rows),
    ("hostile-kv-cache", hostile::kv_cache),
    ("program-ops", programs::ops),
    ("program-top-k", programs::top_k),
    ("program-attention", programs::attention),
    ("program-decoder", programs::decoder),
    ("program-lifetimes", programs::lifetimes),
    ("hostile-programs", programs::hostile_programs),
    ("hostile-program-runs", programs::hostile_runs),
    ("recovers-after-refusals", resources::recovers),
];

impl Guest for Kit {
    fn run_suite(seed: u64) -> Vec<CaseResult> {
        let mut results = Vec::new();
        let start = Instant::now();
        let device = gpu::available();
        results.push(verdict("device-info", device_info(&device), 0.0, start));
        let Some(first) = device else {
            let start = Instant::now();
            results.push(verdict("no-device", no_device(), 0.0, start));
            for (name, _) in DEVICE_CASES {
                let why = "no device: `available` returned none".to_string();
                results.push(verdict(name, Err(Stop::Skip(why)), 0.0, Instant::now()));
            }
            return results;
        };
        let initial = (first.budget_bytes, first.budget_handles);
        for (name, case) in DEVICE_CASES {
            let start = Instant::now();
            let Some(device) = gpu::available() else {
                let r = fail("`available` returned none after it had returned a device");
                results.push(verdict(name, r, 0.0, start));
                continue;
            };
            let mut ctx = Ctx { device, initial, rng: Rng::for_case(seed, name), max_error: 0.0 };
            let r = case(&mut ctx);
            results.push(verdict(name, r, ctx.max_error, start));
        }
        results
    }
}

fn verdict(name: &str, r: Check<String>, max_error: f64, start: Instant) -> CaseResult {
    let micros = start.elapsed().as_micros() as u64;
    let (passed, skipped, message) = match r {
        Ok(m) => (true, false, m),
        Err(Stop::Fail(m)) => (false, false, m),
        Err(Stop::Skip(m)) => (false, true, m),
    };
    CaseResult { name: name.to_string(), passed, skipped, max_error, micros, message }
}

/// `available`: a device that says what it is and what it accepts, or none.
fn device_info(device: &Option<DeviceInfo>) -> Check<String> {
    let Some(d) = device else { return Ok("no device (a normal answer: guests run on their CPU)".into()) };
    if d.name.is_empty() || d.backend.is_empty() {
        return fail(format!("the device's name {:?} or backend {:?} is empty", d.name, d.backend));
    }
    const TYPES: [&str; 5] = ["discrete-gpu", "integrated-gpu", "virtual-gpu", "cpu", "other"];
    if !TYPES.contains(&d.device_type.as_str()) {
        return fail(format!("device-type {:?} is none of {TYPES:?}", d.device_type));
    }
    if d.max_weight_bytes == 0 || d.max_activation_elements == 0 {
        return fail(format!(
            "max-weight-bytes {} and max-activation-elements {} must be at least 1",
            d.max_weight_bytes, d.max_activation_elements
        ));
    }
    Ok(format!(
        "{} ({}, {}): weights up to {} bytes, activations up to {} values; budget {} bytes, {} handles",
        d.name,
        d.backend,
        d.device_type,
        d.max_weight_bytes,
        d.max_activation_elements,
        d.budget_bytes,
        d.budget_handles
    ))
}

/// Without a device, every call is `unavailable`.
fn no_device() -> Check<String> {
    let u = &[Kind::Unavailable];
    expect("upload of f32 [1, 1]", gpu::upload(WeightFormat::F32, 1, 1, &[0; 4], &[]), u)?;
    expect("allocate of q8x32 [1, 32]", gpu::allocate(WeightFormat::Q8x32, 1, 32), u)?;
    expect("create-kv-cache of 4 slots of 8", gpu::create_kv_cache(4, 8), u)?;
    let ops = [Op::Input(1), Op::Output(0)];
    expect("create-program of an input and its output", gpu::create_program(&[], 0, &ops), u)?;
    Ok("upload, allocate, create-kv-cache and create-program are all `unavailable`".into())
}

/// The variants of the WIT `error`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Unavailable,
    InvalidArgument,
    OutOfMemory,
    DeviceLost,
}

impl Kind {
    fn of(e: &Error) -> Kind {
        match e {
            Error::Unavailable(_) => Kind::Unavailable,
            Error::InvalidArgument(_) => Kind::InvalidArgument,
            Error::OutOfMemory(_) => Kind::OutOfMemory,
            Error::DeviceLost(_) => Kind::DeviceLost,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Unavailable => "unavailable",
            Kind::InvalidArgument => "invalid-argument",
            Kind::OutOfMemory => "out-of-memory",
            Kind::DeviceLost => "device-lost",
        }
    }
}

/// An error as `variant("message")`.
pub fn describe(e: &Error) -> String {
    let m = match e {
        Error::Unavailable(m) | Error::InvalidArgument(m) | Error::OutOfMemory(m) | Error::DeviceLost(m) => m,
    };
    format!("{}({m:?})", Kind::of(e).name())
}

fn names(kinds: &[Kind]) -> String {
    kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(" or ")
}

/// The call must fail with one of `want`.
pub fn expect<T>(what: &str, r: Result<T, Error>, want: &[Kind]) -> Check {
    match &r {
        Ok(_) => fail(format!("{what} was accepted; want {}", names(want))),
        Err(e) if want.contains(&Kind::of(e)) => Ok(()),
        Err(e) => fail(format!("{what} returned {}; want {}", describe(e), names(want))),
    }
}

/// The call must fail with one of `want` and leave the device as it was: the same budget
/// before and after.
pub fn refused<T>(what: &str, want: &[Kind], call: impl FnOnce() -> Result<T, Error>) -> Check {
    let before = budget()?;
    let r = call();
    let outcome = expect(what, r, want);
    outcome?;
    let after = budget()?;
    if after != before {
        return fail(format!(
            "{what} was refused, but the budget (bytes, handles) went from {before:?} to {after:?}: \
             a refused call must change nothing"
        ));
    }
    Ok(())
}

/// What this instance may still upload: `(budget-bytes, budget-handles)`.
pub fn budget() -> Check<(u64, u32)> {
    match gpu::available() {
        Some(d) => Ok((d.budget_bytes, d.budget_handles)),
        None => fail("`available` returned none after it had returned a device"),
    }
}

pub fn wit(f: Format) -> WeightFormat {
    match f {
        Format::F32 => WeightFormat::F32,
        Format::Bf16 => WeightFormat::Bf16,
        Format::Q8x32 => WeightFormat::Q8x32,
        Format::Q8x16 => WeightFormat::Q8x16,
        Format::Q4x32 => WeightFormat::Q4x32,
    }
}

/// `q4x32 [37, 96]`: a weight's format and shape `[n-out, n-in]`.
pub fn shape(w: &Weight) -> String {
    format!("{} [{}, {}]", w.format.name(), w.n_out, w.n_in)
}

pub fn upload(w: &Weight) -> Check<Handle> {
    gpu::upload(wit(w.format), w.n_out, w.n_in, &w.data, &w.scales)
        .or_else(|e| fail(format!("upload of {} failed: {}", shape(w), describe(&e))))
}

pub fn allocate(f: Format, n_out: u32, n_in: u32) -> Check<Handle> {
    gpu::allocate(wit(f), n_out, n_in)
        .or_else(|e| fail(format!("allocate of {} [{n_out}, {n_in}] failed: {}", f.name(), describe(&e))))
}

pub fn write_rows(h: &Handle, w: &Weight, first: u32, count: u32) -> Check {
    let (data, scales) = w.rows(first, count);
    h.write_rows(first, data, scales)
        .or_else(|e| fail(format!("write-rows {first}..{} of {} failed: {}", first + count, shape(w), describe(&e))))
}

/// `y_j[t, n_out_j] = x[t, n_in] @ W_j^T` for each job, as a program of one product a job
/// (`exact`) over one input, run on one sequence of `t` rows; it must succeed with one output
/// of rows per job.
pub fn matmul(what: &str, x: &[f32], t: u32, n_in: u32, jobs: &[&Handle]) -> Check<Vec<Vec<f32>>> {
    let p = gpu::create_program(jobs, 0, &products(n_in, jobs.len() as u32))
        .or_else(|e| fail(format!("{what}: create-program of {} products failed: {}", jobs.len(), describe(&e))))?;
    let y = p
        .run(&[x.to_vec()], &[one_sequence(t)])
        .or_else(|e| fail(format!("{what}: the run of {} products failed: {}", jobs.len(), describe(&e))))?;
    if y.len() != jobs.len() {
        return fail(format!("{what}: the run returned {} outputs for {} products", y.len(), jobs.len()));
    }
    y.into_iter()
        .enumerate()
        .map(|(j, o)| match o {
            Output::Rows(v) => Ok(v),
            Output::Top(_) => fail(format!("{what}: output {j} of the run is a top, not rows")),
        })
        .collect()
}

/// The ops of `jobs` products of one input of width `n_in`: `input(n_in)`, `matmul(0, j,
/// exact)` for each weight `j`, then an `output` of each.
pub fn products(n_in: u32, jobs: u32) -> Vec<Op> {
    let mm = (0..jobs).map(|j| Op::Matmul(MatmulOp { x: 0, weight: j, precision: Precision::Exact }));
    std::iter::once(Op::Input(n_in)).chain(mm).chain((1..=jobs).map(Op::Output)).collect()
}

/// A program of no caches that must be made.
pub fn program(what: &str, weights: &[&Handle], ops: &[Op]) -> Check<Program> {
    gpu::create_program(weights, 0, ops).or_else(|e| fail(format!("create-program of {what} failed: {}", describe(&e))))
}

/// A batch's one sequence: `rows` rows from position 0, no caches.
pub fn one_sequence<'a>(rows: u32) -> Sequence<'a> {
    Sequence { rows, start: 0, caches: Vec::new() }
}

impl Ctx {
    /// Holds `y[t, n_out]` to the reference product of `x` and `w`.
    pub fn check(&mut self, what: &str, y: &[f32], x: &[f32], t: u32, w: &Decoded) -> Check {
        match reference::compare(y, x, t as usize, w) {
            Ok(c) => {
                self.max_error = self.max_error.max(c.max_error);
                Ok(())
            }
            Err(m) => {
                self.max_error = self.max_error.max(m.max_error);
                fail(format!("{what}: {}", m.message))
            }
        }
    }
}
