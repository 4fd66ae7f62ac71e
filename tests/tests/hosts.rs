//! The guest against each host: CPU only, the CPU reference device, and wgpu (lavapipe where
//! there is no GPU), held to the same golden thresholds and producing the same tokens.

use wisp::golden::{self, Case};
use wisp::gpu::program;
use wisp::{
    AttentionShape, Backend, BufferId, Budget, CpuBackend, Device, EngineError, Format, GpuCtx, GpuError, GpuMode, Instance, LoadOptions, Model,
    Sampling,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use wisp_tests::{Losable, open, golden_cases, model, wgpu_backend};

fn check(inst: &mut Instance, m: Model, cases: &[Case]) {
    for case in cases {
        let r = golden::run_case(inst, m, case, 5).unwrap();
        eprintln!("{}: max top5 diff {:.4}, rmse {:?}", r.name, r.max_top5_diff, r.rmse);
        assert!(r.pass(), "{} fails the golden thresholds: {r:?}", r.name);
    }
}

/// Greedy tokens of a prompt.
fn greedy(inst: &mut Instance, m: Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let s = inst.new_session(m, (prompt.len() + n) as u32).unwrap().unwrap();
    inst.feed(s, prompt).unwrap().unwrap();
    let greedy = Sampling { temperature: 0.0, ..Sampling::default() };
    let out = (0..n).map(|_| inst.next(s, &greedy).unwrap().unwrap().token).collect();
    inst.drop_session(s).unwrap();
    out
}

/// Every weight created, as (format, rows, columns), and the writes to it as (first row, bytes).
type WriteLog = Arc<Mutex<HashMap<BufferId, ((Format, u32, u32), Vec<(u32, usize)>)>>>;

/// Ops a program of [`Slices`] may have.
const SMALL_PROGRAMS: usize = 8;

/// The CPU reference device, recording how each weight was written, that makes no program of
/// more than [`SMALL_PROGRAMS`] ops (a host's limit: it refuses the model's program); `mute`,
/// it answers every run of a program that attends with no output at all (a broken host).
struct Slices {
    inner: CpuBackend,
    log: WriteLog,
    mute: bool,
}

impl Backend for Slices {
    fn device(&self) -> Option<Device> {
        self.inner.device()
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        let id = self.inner.create(f, n_out, n_in)?;
        self.log.lock().unwrap().insert(id, ((f, n_out, n_in), Vec::new()));
        Ok(id)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        if let Some((_, writes)) = self.log.lock().unwrap().get_mut(&id) {
            writes.push((first_row, data.len()));
        }
        self.inner.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.inner.matmul(x, t, n_in, jobs)
    }
    fn free(&mut self, id: BufferId) {
        self.inner.free(id)
    }
    fn create_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        self.inner.create_cache(slots, width)
    }
    fn free_cache(&mut self, id: BufferId) {
        self.inner.free_cache(id)
    }
    fn write_cache(&mut self, id: BufferId, first: u32, k: &[f32], v: &[f32]) -> Result<(), GpuError> {
        self.inner.write_cache(id, first, k, v)
    }
    fn run_program(
        &mut self,
        p: &program::Program,
        inputs: &[Vec<f32>],
        batch: &[program::SequenceRun],
    ) -> Option<Result<Vec<program::Output>, GpuError>> {
        if self.mute && p.ops.iter().any(|op| matches!(op, program::Op::Attention { .. })) {
            return Some(Ok(Vec::new()));
        }
        self.inner.run_program(p, inputs, batch)
    }
    fn prepare_program(&mut self, p: &program::Program) -> Result<(), GpuError> {
        if p.ops.len() > SMALL_PROGRAMS {
            return Err(GpuError::OutOfMemory(format!("{} ops: this host makes programs of at most {SMALL_PROGRAMS}", p.ops.len())));
        }
        self.inner.prepare_program(p)
    }
    fn attention_cached(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        first_new: u32,
        cache: BufferId,
        first_key: u32,
        s: &AttentionShape,
    ) -> Result<Vec<f32>, GpuError> {
        self.inner.attention_cached(q, k, v, first_new, cache, first_key, s)
    }
}

/// Device calls of a short prompt's prefill, and of the two decode steps after it (their
/// attention calls alone): `(prefill, decode attention calls)`. No call fell back.
fn device_calls(inst: &mut Instance, m: Model) -> (wisp::Stats, u64) {
    let s = inst.new_session(m, 8).unwrap().unwrap();
    inst.feed(s, &[2, 818]).unwrap().unwrap();
    let stats = inst.stats(s).unwrap();
    let greedy = Sampling { temperature: 0.0, ..Sampling::default() };
    for _ in 0..3 {
        inst.next(s, &greedy).unwrap().unwrap();
    }
    let decoded = inst.stats(s).unwrap();
    assert_eq!(decoded.gpu_fallbacks, 0, "{decoded:?}");
    inst.drop_session(s).unwrap();
    (stats, decoded.gpu_attention_calls - stats.gpu_attention_calls)
}

/// Largest `write-rows` the guest sends (its `UPLOAD_SLICE_BYTES`).
const SLICE: usize = 8 << 20;

#[test]
fn every_golden_case_passes_through_the_cpu_reference_device() {
    let log = WriteLog::default();
    let backend = Slices { inner: CpuBackend::new(), log: log.clone(), mute: false };
    let (mut inst, m) = open(model(), GpuCtx::new(Box::new(backend), Budget::default()), GpuMode::On);
    let info = inst.model_info(m).unwrap();
    assert!(info.gpu_weights > 100, "weights resident: {}", info.gpu_weights);
    // RELIABILITY 21: a weight larger than one list the guest sends goes up in slices of whole
    // rows (the tied embedding: 262144 x 640 bytes), each row written once, in order.
    let mut sliced = 0;
    for ((f, n_out, n_in), writes) in log.lock().unwrap().values() {
        let row = f.data_bytes(*n_in as u64).unwrap() as usize;
        let mut next = 0u32;
        for &(first, bytes) in writes {
            assert!(first == next && bytes % row == 0 && bytes <= SLICE.max(row), "{} [{n_out}, {n_in}]: {writes:?}", f.name());
            next += (bytes / row) as u32;
        }
        assert_eq!(next, *n_out, "{} [{n_out}, {n_in}]: rows written {writes:?}", f.name());
        if row * *n_out as usize > SLICE {
            assert!(writes.len() > 1);
            sliced += 1;
        }
    }
    assert!(sliced > 0, "no weight was larger than one slice");
    // This host refuses the model's program: the guest runs its recipe on its CPU, with its
    // products and attention on the device as programs of one op each. Attention went to the
    // device (18 layers of one batch), each layer's products in four calls (q/k/v, wo,
    // gate/up, down), the output projection's in one, and nothing fell back. The two decode
    // steps, while the model has measured neither attention yet: to the CPU (measured first),
    // to the device over its kv-caches (measured next), then to the faster.
    let (stats, decode_attention) = device_calls(&mut inst, m);
    assert!(stats.gpu_attention_calls == 18 && stats.gpu_calls == 4 * 18 + 1 && stats.gpu_fallbacks == 0, "{stats:?}");
    assert!(decode_attention > 0 && decode_attention < 2 * 18, "{decode_attention}");
    let cases: Vec<Case> = golden_cases().into_iter().filter(|c| c.name != "long-gpl").collect();
    check(&mut inst, m, &cases);
}

/// A host that answers the guest's attention with no output at all: the guest takes it for a
/// device not to trust (an answer of the wrong shape), not a reason to trap, and the tokens are
/// those of its CPU.
#[test]
fn an_attention_answered_with_nothing_leaves_the_tokens_unchanged() {
    let backend = Slices { inner: CpuBackend::new(), log: WriteLog::default(), mute: true };
    let (mut on, m_on) = open(model(), GpuCtx::new(Box::new(backend), Budget::default()), GpuMode::On);
    let (mut off, m_off) = open(model(), GpuCtx::none(), GpuMode::Off);
    let prompt = &golden_cases()[0].prompt_tokens;
    assert_eq!(greedy(&mut on, m_on, prompt, 4), greedy(&mut off, m_off, prompt, 4));
}

#[test]
fn every_golden_case_passes_on_wgpu() {
    let Some(backend) = wgpu_backend() else { return };
    let (mut inst, m) = open(model(), GpuCtx::new(Box::new(backend), Budget::default()), GpuMode::On);
    let info = inst.model_info(m).unwrap();
    eprintln!("device {:?}, {} weights resident", info.device, info.gpu_weights);
    assert!(info.gpu_weights > 100, "weights resident: {}", info.gpu_weights);
    let (stats, decode_attention) = device_calls(&mut inst, m);
    // Every layer in one run of the model's program (its 18 attentions counted), and the output
    // projection where it does not fit (lavapipe's 128 MiB binding cap); each decode step the same.
    assert!(matches!(stats.gpu_calls, 1 | 2), "{stats:?}");
    assert!(stats.gpu_attention_calls == 18 && decode_attention == 2 * 18, "{stats:?}, {decode_attention}");
    check(&mut inst, m, &golden_cases());
}

/// A device that keeps the precisions of the products and attention of the programs made on
/// it, and counts the runs of programs that read back a top-k.
struct Precisions<B: Backend>(B, Arc<Mutex<Vec<program::Precision>>>, Arc<AtomicUsize>);

impl<B: Backend> Backend for Precisions<B> {
    fn run_program(
        &mut self,
        p: &program::Program,
        inputs: &[Vec<f32>],
        batch: &[program::SequenceRun],
    ) -> Option<Result<Vec<program::Output>, GpuError>> {
        if p.ops.iter().any(|op| matches!(op, program::Op::TopK { .. })) {
            self.2.fetch_add(1, Ordering::SeqCst);
        }
        self.0.run_program(p, inputs, batch)
    }
    fn prepare_program(&mut self, p: &program::Program) -> Result<(), GpuError> {
        let mut seen = self.1.lock().unwrap();
        for op in &p.ops {
            if let program::Op::Matmul { precision, .. } | program::Op::Attention { precision, .. } = *op {
                seen.push(precision);
            }
        }
        self.0.prepare_program(p)
    }
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
    fn attention_cached(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        first_new: u32,
        cache: BufferId,
        first_key: u32,
        s: &AttentionShape,
    ) -> Result<Vec<f32>, GpuError> {
        self.0.attention_cached(q, k, v, first_new, cache, first_key, s)
    }
}

/// On a device that offers programs, every pass is one program run: the
/// model's recipe, the one the guest's CPU runs, made on the device at load, its products and
/// attention at the precision the model was opened with.
fn passes_by_program(backend: impl Backend + 'static, cases: &[Case], precision: program::Precision) {
    let (seen, tops) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicUsize::new(0)));
    let gpu = GpuCtx::new(Box::new(Precisions(backend, seen.clone(), tops.clone())), Budget::default());
    let (mut inst, m) = open(model(), gpu, LoadOptions { gpu: GpuMode::On, precision });
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    // 18 layers of 7 products and an attention each, and the output projection where the
    // device holds it.
    assert!(seen.len() >= 18 * 8 && seen.iter().all(|&p| p == precision), "{precision:?}: {seen:?}");
    let (stats, decode_attention) = device_calls(&mut inst, m);
    // The prefill in one run (its 18 attentions counted), and each decode step the same;
    // nothing fell back. On the guest's CPU at most the output projection, where the device
    // does not hold it (lavapipe's 128 MiB binding cap).
    assert!(stats.gpu_calls == 1 && stats.gpu_attention_calls == 18 && stats.cpu_matmuls <= 1, "{stats:?}");
    assert_eq!(decode_attention, 2 * 18);
    // The two greedy decode steps read back their largest logit alone, where the device holds
    // the output projection (the prompt's pass, before any step, the logits).
    assert_eq!(tops.load(Ordering::SeqCst), if stats.cpu_matmuls == 0 { 2 } else { 0 }, "{stats:?}");
    check(&mut inst, m, cases);
}

#[test]
fn the_golden_cases_pass_as_programs_on_the_cpu_reference_device() {
    let cases: Vec<Case> = golden_cases().into_iter().filter(|c| c.name != "long-gpl").collect();
    passes_by_program(CpuBackend::new(), &cases, program::Precision::Exact);
}

/// `fast` reaches the device's programs (the CPU reference computes it exactly); the golden
/// thresholds hold.
#[test]
fn a_model_opened_fast_makes_fast_programs() {
    let cases: Vec<Case> = golden_cases().into_iter().filter(|c| c.name == "capital").collect();
    passes_by_program(CpuBackend::new(), &cases, program::Precision::Fast);
}

/// A greedy step reads back its largest logit alone (the program's top form, where the device
/// holds the output projection), and the tokens are those of the guest's CPU.
#[test]
fn greedy_steps_read_back_the_top_logit_and_give_the_cpus_tokens() {
    let tops = Arc::new(AtomicUsize::new(0));
    let backend = Precisions(CpuBackend::new(), Arc::default(), tops.clone());
    let (mut on, m_on) = open(model(), GpuCtx::new(Box::new(backend), Budget::default()), GpuMode::On);
    let (mut off, m_off) = open(model(), GpuCtx::none(), GpuMode::Off);
    let prompt = &golden_cases()[0].prompt_tokens;
    assert_eq!(greedy(&mut on, m_on, prompt, 8), greedy(&mut off, m_off, prompt, 8));
    // Every step but the first (the prompt's pass reads the logits).
    assert_eq!(tops.load(Ordering::SeqCst), 7);
}

#[test]
fn a_golden_case_passes_as_programs_on_wgpu() {
    let Some(backend) = wgpu_backend() else { return };
    let cases: Vec<Case> = golden_cases().into_iter().filter(|c| c.name == "capital").collect();
    passes_by_program(backend, &cases, program::Precision::Exact);
}

#[test]
fn greedy_tokens_are_the_same_with_the_gpu_on_and_off() {
    let Some(backend) = wgpu_backend() else { return };
    let (mut on, m_on) = open(model(), GpuCtx::new(Box::new(backend), Budget::default()), GpuMode::On);
    let (mut off, m_off) = open(model(), GpuCtx::none(), GpuMode::Off);
    for case in golden_cases().iter().filter(|c| c.name != "long-gpl") {
        let a = greedy(&mut on, m_on, &case.prompt_tokens, 8);
        let b = greedy(&mut off, m_off, &case.prompt_tokens, 8);
        assert_eq!(a, b, "case {}", case.name);
    }
}

/// A device that works for `healthy` matmul calls, then is lost.
struct Failing {
    inner: CpuBackend,
    healthy: usize,
    lost: bool,
}

impl Backend for Failing {
    fn device(&self) -> Option<Device> {
        self.inner.device()
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        if self.lost { Err(GpuError::DeviceLost("simulated".into())) } else { self.inner.create(f, n_out, n_in) }
    }
    fn write_rows(&mut self, id: BufferId, r: u32, d: &[u8], s: &[f32]) -> Result<(), GpuError> {
        if self.lost { Err(GpuError::DeviceLost("simulated".into())) } else { self.inner.write_rows(id, r, d, s) }
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        if self.healthy == 0 {
            self.lost = true;
        }
        if self.lost {
            return Err(GpuError::DeviceLost("simulated loss mid-session".into()));
        }
        self.healthy -= 1;
        self.inner.matmul(x, t, n_in, jobs)
    }
    fn free(&mut self, id: BufferId) {
        self.inner.free(id)
    }
}

#[test]
fn a_device_lost_mid_generation_leaves_the_tokens_unchanged() {
    let prompt = golden_cases()[0].prompt_tokens.clone();
    let (mut off, m_off) = open(model(), GpuCtx::none(), GpuMode::Off);
    let want = greedy(&mut off, m_off, &prompt, 12);
    // Without kv-caches the model runs its recipe on the CPU, its products on the device as
    // programs of one op: 18 layers of 7 products a token and the output projection, each its
    // own backend call. Lost during the third generated token.
    let failing = Failing { inner: CpuBackend::new(), healthy: (7 * 18 + 1) * 3 + 5, lost: false };
    let (mut inst, m) = open(model(), GpuCtx::new(Box::new(failing), Budget::default()), GpuMode::On);
    let s = inst.new_session(m, 64).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    let greedy_s = Sampling { temperature: 0.0, ..Sampling::default() };
    let got: Vec<u32> = (0..12).map(|_| inst.next(s, &greedy_s).unwrap().unwrap().token).collect();
    assert_eq!(got, want);
    let stats = inst.stats(s).unwrap();
    assert!(stats.gpu_calls > 0, "{stats:?}");
    assert_eq!(stats.gpu_fallbacks, 1, "the loss is seen once, then the device is not asked again: {stats:?}");
    assert!(stats.cpu_matmuls > 0, "{stats:?}");
    // The host keeps serving: a new session on the same instance works, on the CPU.
    let s2 = inst.new_session(m, 16).unwrap().unwrap();
    inst.feed(s2, &prompt).unwrap().unwrap();
    assert_eq!(inst.next(s2, &greedy_s).unwrap().unwrap().token, want[0]);
}

/// With `--gpu on`, a device that can hold every weight and runs programs over kv-caches holds
/// them alone, also where the guest could hold them: the guest reads the file a piece at a
/// time and keeps none of the matrices, so its memory stays a fraction of the model's. The
/// device's tokens are the tokens of the guest's CPU. Lost after the prompt and a few tokens,
/// the session gets a typed error that says to load the model again (its keys, values and
/// weights went with the device), not a replay on a CPU that has no weights.
#[test]
fn with_gpu_on_the_device_alone_holds_the_weights_and_a_loss_is_a_typed_error() {
    let prompt = golden_cases()[0].prompt_tokens.clone();
    let (mut off, m_off) = open(model(), GpuCtx::none(), GpuMode::Off);
    let want = greedy(&mut off, m_off, &prompt, 10);
    let copy = off.memory_bytes();
    // One call for the prompt, one a generated token: lost at the fifth token's pass.
    let failing = Losable { inner: Box::new(CpuBackend::new()), healthy: 5, lost: Default::default() };
    let (mut inst, m) = open(model(), GpuCtx::new(Box::new(failing), Budget::default()), GpuMode::On);
    let held = inst.memory_bytes();
    assert!(held * 3 < copy, "the guest holds {held} bytes with the weights on the device, {copy} with its own copy");
    let s = inst.new_session(m, 64).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    let greedy_s = Sampling { temperature: 0.0, ..Sampling::default() };
    let mut got = Vec::new();
    let failed = loop {
        match inst.next(s, &greedy_s).expect("no trap") {
            Ok(a) if got.len() < want.len() => got.push(a.token),
            Ok(_) => panic!("the device was never lost: {got:?}"),
            Err(e) => break e,
        }
    };
    assert!(matches!(&failed, EngineError::Io(m) if m.contains("was lost") && m.contains("load the model again")), "{failed:?}");
    assert_eq!(got, want[..got.len()], "the tokens before the loss");
    assert!(got.len() >= 3, "lost at the fifth pass: {got:?}");
    let stats = inst.stats(s).unwrap();
    assert_eq!(stats.cpu_matmuls, 0, "nothing ran on the guest's CPU: {stats:?}");
}

#[test]
fn auto_mode_on_a_slow_device_keeps_work_on_the_cpu() {
    // The CPU reference device is far slower than the guest's kernels: auto must notice.
    let (mut inst, m) = open(model(), GpuCtx::new(Box::new(CpuBackend::new()), Budget::default()), GpuMode::Auto);
    let s = inst.new_session(m, 32).unwrap().unwrap();
    inst.feed(s, &golden_cases()[0].prompt_tokens).unwrap().unwrap();
    let stats = inst.stats(s).unwrap();
    assert_eq!((stats.gpu_calls, stats.gpu_attention_calls), (0, 0), "{stats:?}");
    assert_eq!(inst.model_info(m).unwrap().gpu_weights, 0);
}

/// The golden cases as one batch (`golden::run_cases_together`, `model.step`): on the guest's
/// CPU and on the CPU reference device running the model's program, every case's outcome is
/// the case's alone, value for value (each step's top logits, the logits after the prompt); on
/// wgpu the batch passes the thresholds.
#[test]
fn the_golden_cases_as_one_batch_are_the_cases_alone() {
    let same = |a: &golden::Outcome, b: &golden::Outcome| {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let tops = |o: &golden::Outcome| o.top.iter().map(|s| s.iter().map(|(i, l)| (*i, l.to_bits())).collect::<Vec<_>>()).collect::<Vec<_>>();
        a.name == b.name && tops(a) == tops(b) && bits(&a.prompt_logits) == bits(&b.prompt_logits)
    };
    let all = golden_cases();
    // The reference device computes ~10 rows a second: three cases there (32 and 16 steps).
    let short: Vec<Case> = all.iter().filter(|c| ["capital", "count", "unicode"].contains(&c.name.as_str())).cloned().collect();
    assert_eq!(short.len(), 3);
    for (gpu, mode, cases) in [(GpuCtx::none(), GpuMode::Off, &all), (GpuCtx::new(Box::new(CpuBackend::new()), Budget::default()), GpuMode::On, &short)] {
        let (mut inst, m) = open(model(), gpu, mode);
        let together = golden::run_cases_together(&mut inst, m, cases, 5).unwrap();
        assert_eq!(together.len(), cases.len());
        for (case, batched) in cases.iter().zip(&together) {
            let alone = golden::run_case(&mut inst, m, case, 5).unwrap();
            assert!(batched.pass(), "{mode:?}: {} in the batch fails the thresholds: {batched:?}", case.name);
            assert!(same(batched, &alone), "{mode:?}: {} in the batch differs from the case alone", case.name);
        }
    }
    let Some(backend) = wgpu_backend() else { return };
    let (mut inst, m) = open(model(), GpuCtx::new(Box::new(backend), Budget::default()), GpuMode::On);
    for o in golden::run_cases_together(&mut inst, m, &all, 5).unwrap() {
        eprintln!("wgpu, one batch: {}: max top5 diff {:.4}, rmse {:?}", o.name, o.max_top5_diff, o.rmse);
        assert!(o.pass(), "wgpu: {} in the batch fails the golden thresholds: {o:?}", o.name);
    }
}
