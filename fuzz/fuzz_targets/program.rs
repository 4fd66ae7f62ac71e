//! Random weights, caches, programs and batches through the host's checks (`GpuCtx`) on the CPU
//! reference backend or the native CPU device (the input's first choice), against the same
//! calls made one sequence at a time: a call is either a typed error that changed nothing, or a
//! result equal, bit for bit, to each of its sequences run alone (the contract's batch
//! invariance, which both devices keep in both precisions).
//!
//! Two contexts see the same uploads, caches, programs and releases. `batched` runs each batch
//! whole; `alone` runs only the batches `batched` accepted, one sequence at a time. A batch that
//! failed yet wrote a cache, or a batch whose rows depend on their neighbours, makes the two
//! differ, then or at a later run.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use wisp::gpu::program::{Op, Output};
use wisp::gpu::{KvCacheHandle, ProgramHandle, WeightHandle};
use wisp::{Activation, Budget, CpuBackend, Format, GpuCtx, GpuError, NativeBackend, Precision, Rotation};
use wasmtime::component::Resource;

#[derive(Arbitrary, Debug)]
enum Call {
    /// A weight: with `fit`, `n_out` and `n_in` made small and valid and the data cycled to the
    /// length the shape needs; without, the raw lengths for the checks to refuse.
    Upload { format: u8, n_out: u8, n_in: u8, data: Vec<u8>, scales: Vec<f32>, fit: bool },
    Cache { slots: u8, width: u16 },
    Program { weights: Vec<u8>, caches: u8, ops: Vec<FuzzOp> },
    /// Sequences of `(rows, start, caches)`, caches by index into the live ones; the inputs are
    /// cycled from `values` (`short`: one value short, for the checks to refuse).
    Run { program: u8, batch: Vec<(u8, u16, Vec<u8>)>, values: Vec<f32>, short: bool },
    ReleaseWeight(u8),
    ReleaseCache(u8),
    ReleaseProgram(u8),
}

/// An op whose operands are counted back from the op itself (0: the value just before), so that
/// most name an earlier value.
#[derive(Arbitrary, Debug)]
enum FuzzOp {
    Input(u16),
    Matmul(u8, u8, bool),
    RmsNorm { x: u8, weight: Option<u8>, offset: f32, group: u16, eps: f32 },
    Add(u8, u8),
    Mul(u8, u8),
    Bias(u8, u8),
    Scale(u8, f32),
    Softcap(u8, f32),
    Gated(u8, u8, bool),
    Rotate { x: u8, table: u8, head_dim: u16, pairs: bool },
    CacheWrite(u8, u8, u8),
    Attention { q: u8, cache: u8, n_head: u8, n_head_kv: u8, head_dim: u16, window: u16, scale: f32, softcap: f32, fast: bool },
    LastRows(u8),
    Output(u8),
    TopK(u8, u16),
}

fn back(i: usize, a: u8) -> usize {
    // An op's own index or later for a large `a` on an early op: the checks refuse it.
    (i as isize - 1 - a as isize).unsigned_abs()
}

fn precision(fast: bool) -> Precision {
    if fast { Precision::Fast } else { Precision::Exact }
}

fn op(i: usize, f: &FuzzOp) -> Op {
    match *f {
        FuzzOp::Input(width) => Op::Input { width: width as u32 },
        FuzzOp::Matmul(x, w, fast) => Op::Matmul { x: back(i, x), weight: w as usize, precision: precision(fast) },
        FuzzOp::RmsNorm { x, weight, offset, group, eps } => {
            Op::RmsNorm { x: back(i, x), weight: weight.map(usize::from), offset, group: group as u32, eps }
        }
        FuzzOp::Add(a, b) => Op::Add(back(i, a), back(i, b)),
        FuzzOp::Mul(a, b) => Op::Mul(back(i, a), back(i, b)),
        FuzzOp::Bias(x, w) => Op::Bias { x: back(i, x), weight: w as usize },
        FuzzOp::Scale(x, by) => Op::Scale { x: back(i, x), by },
        FuzzOp::Softcap(x, cap) => Op::Softcap { x: back(i, x), cap },
        FuzzOp::Gated(g, u, silu) => {
            Op::Gated { gate: back(i, g), up: back(i, u), act: if silu { Activation::Silu } else { Activation::GeluTanh } }
        }
        FuzzOp::Rotate { x, table, head_dim, pairs } => Op::Rotate {
            x: back(i, x),
            table: back(i, table),
            head_dim: head_dim as u32,
            rotation: if pairs { Rotation::Pairs } else { Rotation::Halves },
        },
        FuzzOp::CacheWrite(k, v, cache) => Op::CacheWrite { k: back(i, k), v: back(i, v), cache: cache as u32 },
        FuzzOp::Attention { q, cache, n_head, n_head_kv, head_dim, window, scale, softcap, fast } => Op::Attention {
            q: back(i, q),
            cache: cache as u32,
            n_head: n_head as u32,
            n_head_kv: n_head_kv as u32,
            head_dim: head_dim as u32,
            window: window as u32,
            scale,
            softcap,
            precision: precision(fast),
        },
        FuzzOp::LastRows(x) => Op::LastRows(back(i, x)),
        FuzzOp::Output(x) => Op::Output(back(i, x)),
        FuzzOp::TopK(x, k) => Op::TopK { x: back(i, x), k: k as u32 },
    }
}

/// `n` values cycled from `from` (zeros where it is empty).
fn cycle<T: Copy + Default>(from: &[T], n: usize) -> Vec<T> {
    if from.is_empty() { vec![T::default(); n] } else { from.iter().copied().cycle().take(n).collect() }
}

/// One context and its handles, by the index of the call that made them (`None` once released
/// or where the call failed).
struct Side {
    ctx: GpuCtx,
    weights: Vec<Option<Resource<WeightHandle>>>,
    caches: Vec<Option<Resource<KvCacheHandle>>>,
    programs: Vec<Option<Resource<ProgramHandle>>>,
}

impl Side {
    /// A context on the CPU reference backend, or with `native` on the native device (one
    /// thread, its vector kernels where the CPU has them).
    fn new(native: bool) -> Side {
        let budget = Budget { bytes: 4 << 20, handles: 64, jobs: 8 };
        let backend: Box<dyn wisp::Backend> = if native { Box::new(NativeBackend::new(1).unwrap()) } else { Box::new(CpuBackend::new()) };
        Side { ctx: GpuCtx::new(backend, budget), weights: Vec::new(), caches: Vec::new(), programs: Vec::new() }
    }
}

fn pick<T>(list: &[Option<T>], i: u8) -> Option<&T> {
    if list.is_empty() { None } else { list[i as usize % list.len()].as_ref() }
}

/// The handle that names `list[i]` in a call: its rep, or one no live handle has where that
/// call failed or the handle was released.
fn named<T: 'static>(list: &[Option<Resource<T>>], i: u8) -> Resource<T> {
    pick(list, i).map_or(Resource::new_own(0), |h| Resource::new_own(h.rep()))
}

fn take<T>(list: &mut [Option<T>], i: u8) -> Option<T> {
    let n = list.len();
    if n == 0 { None } else { list[i as usize % n].take() }
}

/// The same kind of result: both made something, or both failed alike.
fn agree<A, B>(what: &str, a: &Result<A, GpuError>, b: &Result<B, GpuError>) {
    match (a, b) {
        (Ok(_), Ok(_)) => {}
        (Err(x), Err(y)) => assert_eq!(std::mem::discriminant(x), std::mem::discriminant(y), "{what}: {x} / {y}"),
        (a, b) => panic!("{what}: one context failed, the other did not: {:?} / {:?}", a.as_ref().err(), b.as_ref().err()),
    }
}

/// `f` on `ctx`, checking that where it fails it holds no more bytes or handles than before.
fn unchanged_on_error<T>(ctx: &mut GpuCtx, f: impl FnOnce(&mut GpuCtx) -> Result<T, GpuError>) -> Result<T, GpuError> {
    let before = ctx.usage();
    let r = f(ctx);
    if let Err(e) = &r {
        assert_eq!(ctx.usage(), before, "a failed call ({e}) changed what the context holds");
    }
    r
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Appends `o` to `into` (a sequence's output after the ones before it).
fn append(into: &mut Output, o: Output) {
    match (into, o) {
        (Output::Rows(a), Output::Rows(b)) => a.extend(b),
        (Output::Top { values, indices }, Output::Top { values: v, indices: i }) => {
            values.extend(v);
            indices.extend(i);
        }
        (a, b) => panic!("outputs of different kinds: {a:?} / {b:?}"),
    }
}

fn same(a: &Output, b: &Output) -> bool {
    match (a, b) {
        (Output::Rows(a), Output::Rows(b)) => bits(a) == bits(b),
        (Output::Top { values: va, indices: ia }, Output::Top { values: vb, indices: ib }) => bits(va) == bits(vb) && ia == ib,
        _ => false,
    }
}

fuzz_target!(|input: (bool, Vec<Call>)| {
    let (native, calls) = input;
    let (mut batched, mut alone) = (Side::new(native), Side::new(native));
    // The widths of each program's inputs, as its guest would know them.
    let mut widths: Vec<Vec<u32>> = Vec::new();
    for call in calls.iter().take(64) {
        match call {
            Call::Upload { format, n_out, n_in, data, scales, fit } => {
                let format = Format::ALL[*format as usize % Format::ALL.len()];
                let (n_out, n_in) = if *fit {
                    ((*n_out as u32 % 16) + 1, ((*n_in as u32 % 4) + 1) * format.block() as u32)
                } else {
                    (*n_out as u32, *n_in as u32)
                };
                let n = n_out as u64 * n_in as u64;
                let (data, scales) = if *fit {
                    let bytes = format.data_bytes(n).unwrap_or(0) as usize;
                    (cycle(data, bytes), cycle(scales, format.scale_count(n) as usize))
                } else {
                    (data.clone(), scales.clone())
                };
                let a = unchanged_on_error(&mut batched.ctx, |c| c.upload(format, n_out, n_in, &data, &scales));
                let b = unchanged_on_error(&mut alone.ctx, |c| c.upload(format, n_out, n_in, &data, &scales));
                agree("upload", &a, &b);
                batched.weights.push(a.ok());
                alone.weights.push(b.ok());
            }
            Call::Cache { slots, width } => {
                let a = unchanged_on_error(&mut batched.ctx, |c| c.create_kv_cache(*slots as u32, *width as u32));
                let b = unchanged_on_error(&mut alone.ctx, |c| c.create_kv_cache(*slots as u32, *width as u32));
                agree("create-kv-cache", &a, &b);
                batched.caches.push(a.ok());
                alone.caches.push(b.ok());
            }
            Call::Program { weights, caches, ops } => {
                let ops: Vec<Op> = ops.iter().take(256).enumerate().map(|(i, f)| op(i, f)).collect();
                widths.push(ops.iter().filter_map(|o| if let Op::Input { width } = o { Some(*width) } else { None }).collect());
                let [a, b] = [&mut batched, &mut alone].map(|side| {
                    let handles: Vec<Resource<WeightHandle>> = weights.iter().take(80).map(|&w| named(&side.weights, w)).collect();
                    unchanged_on_error(&mut side.ctx, |c| c.create_program(&handles, *caches as u32, ops.clone()))
                });
                agree("create-program", &a, &b);
                batched.programs.push(a.ok());
                alone.programs.push(b.ok());
            }
            Call::Run { program, batch, values, short } => {
                let (Some(pa), Some(pb)) = (pick(&batched.programs, *program), pick(&alone.programs, *program)) else { continue };
                let (pa, pb) = (Resource::<ProgramHandle>::new_own(pa.rep()), Resource::<ProgramHandle>::new_own(pb.rep()));
                let batch: Vec<&(u8, u16, Vec<u8>)> = batch.iter().take(16).collect();
                let caches = |side: &Side, list: &[u8]| -> Vec<Resource<KvCacheHandle>> {
                    list.iter().take(8).map(|&c| named(&side.caches, c)).collect()
                };
                // The inputs' widths are the program's: taken from the ops, as the guest would.
                let widths = &widths[*program as usize % widths.len()];
                let rows: u64 = batch.iter().map(|s| s.0 as u64).sum();
                if widths.iter().map(|&w| rows * w as u64).sum::<u64>() > 1 << 20 {
                    continue;
                }
                let mut inputs: Vec<Vec<f32>> = widths.iter().map(|&w| cycle(values, (rows * w as u64) as usize)).collect();
                if *short {
                    if let Some(x) = inputs.last_mut() {
                        x.pop();
                    }
                }
                let runs_a: Vec<Vec<Resource<KvCacheHandle>>> = batch.iter().map(|s| caches(&batched, &s.2)).collect();
                let list_a: Vec<(u32, u32, &[Resource<KvCacheHandle>])> =
                    batch.iter().zip(&runs_a).map(|(s, c)| (s.0 as u32, s.1 as u32, &c[..])).collect();
                let run = unchanged_on_error(&mut batched.ctx, |c| c.run_program(&pa, inputs.clone(), &list_a));
                let Ok(outputs) = run else { continue };
                // Accepted: each sequence alone gives its rows of the outputs.
                let mut joined: Option<Vec<Output>> = None;
                let mut at = 0u64;
                for s in &batch {
                    let c = caches(&alone, &s.2);
                    let mine: Vec<Vec<f32>> = inputs
                        .iter()
                        .zip(widths.iter())
                        .map(|(x, &w)| x[(at * w as u64) as usize..((at + s.0 as u64) * w as u64) as usize].to_vec())
                        .collect();
                    at += s.0 as u64;
                    let one = match alone.ctx.run_program(&pb, mine, &[(s.0 as u32, s.1 as u32, &c[..])]) {
                        Ok(one) => one,
                        Err(e) => panic!("a sequence of an accepted batch fails alone: {e}"),
                    };
                    match &mut joined {
                        None => joined = Some(one),
                        Some(j) => j.iter_mut().zip(one).for_each(|(j, o)| append(j, o)),
                    }
                }
                let joined = joined.unwrap_or_default();
                assert_eq!(joined.len(), outputs.len());
                for (k, (a, b)) in outputs.iter().zip(&joined).enumerate() {
                    assert!(same(a, b), "output {k} of a batch of {} differs from its sequences alone:\n{a:?}\n{b:?}", batch.len());
                }
            }
            Call::ReleaseWeight(i) => {
                if let Some(h) = take(&mut batched.weights, *i) {
                    batched.ctx.release(h);
                }
                if let Some(h) = take(&mut alone.weights, *i) {
                    alone.ctx.release(h);
                }
            }
            Call::ReleaseCache(i) => {
                if let Some(h) = take(&mut batched.caches, *i) {
                    batched.ctx.release_cache(h);
                }
                if let Some(h) = take(&mut alone.caches, *i) {
                    alone.ctx.release_cache(h);
                }
            }
            Call::ReleaseProgram(i) => {
                if let Some(h) = take(&mut batched.programs, *i) {
                    batched.ctx.release_program(h);
                }
                if let Some(h) = take(&mut alone.programs, *i) {
                    alone.ctx.release_program(h);
                }
            }
        }
    }
});
