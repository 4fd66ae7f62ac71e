//! The host's side of the `gpu` contract against a hostile guest (RELIABILITY 17-20, 24): `GpuCtx`
//! called as the component ABI calls it, with handles a guest could forge (any rep), keep after
//! releasing, or bring from another instance; lengths and shapes that do not match or
//! overflow; sizes past the device's limits; uploads until the budget is spent; a device lost
//! under it. Every answer is a typed error whose message says what is wrong; nothing panics,
//! the backend never sees a refused request, and a valid call afterwards still computes.

use std::sync::{Arc, Mutex};
use wasmtime::component::Resource;
use wisp::gpu::WeightHandle;
use wisp::gpu::program::Op;
use wisp::{Backend, Budget, BufferId, CpuBackend, Device, Format, GpuCtx, GpuError};

fn cpu(budget: Budget) -> GpuCtx {
    GpuCtx::new(Box::new(CpuBackend::new()), budget)
}

/// An upload of `[n_out, n_in]` f32 ones.
fn ones(ctx: &mut GpuCtx, n_out: u32, n_in: u32) -> Resource<WeightHandle> {
    let data: Vec<u8> = (0..n_out * n_in).flat_map(|_| 1f32.to_le_bytes()).collect();
    ctx.upload(Format::F32, n_out, n_in, &data, &[]).unwrap()
}

/// What the ABI hands the host for a guest's `borrow<weight>` of this rep.
fn borrow(rep: u32) -> Resource<WeightHandle> {
    Resource::new_borrow(rep)
}

/// `r` is an `invalid-argument` whose message contains `message`.
#[track_caller]
fn invalid<T: std::fmt::Debug>(r: Result<T, GpuError>, message: &str, what: &str) {
    match r {
        Err(GpuError::InvalidArgument(m)) if m.contains(message) => {}
        other => panic!("{what}: want invalid-argument saying {message:?}, got {other:?}"),
    }
}

/// `r` is an `out-of-memory` whose message contains `message`.
#[track_caller]
fn out_of_memory<T: std::fmt::Debug>(r: Result<T, GpuError>, message: &str, what: &str) {
    match r {
        Err(GpuError::OutOfMemory(m)) if m.contains(message) => {}
        other => panic!("{what}: want out-of-memory saying {message:?}, got {other:?}"),
    }
}

const NOT_LIVE: &str = "not a live weight handle of this instance";

#[test]
fn forged_handles_are_invalid_arguments() {
    let mut ctx = cpu(Budget::default());
    let w = ones(&mut ctx, 2, 4);
    for rep in [0, 12345, u32::MAX, w.rep() + 1, w.rep().wrapping_sub(1)] {
        invalid(ctx.write_rows(&Resource::new_own(rep), 0, &[0; 16], &[]), NOT_LIVE, &format!("write-rows of forged rep {rep}"));
        invalid(ctx.matmul(&[1.0; 4], 1, 4, &[borrow(rep)]), &format!("job 0: {NOT_LIVE}"), &format!("matmul of forged rep {rep}"));
        invalid(
            ctx.matmul(&[1.0; 4], 1, 4, &[borrow(w.rep()), borrow(rep)]),
            &format!("job 1: {NOT_LIVE}"),
            &format!("forged rep {rep} beside a real one"),
        );
        ctx.release(Resource::new_own(rep));
    }
    // Releasing forged reps freed nothing; the real weight still computes.
    assert_eq!(ctx.usage(), (32, 1));
    assert_eq!(ctx.matmul(&[1.0; 4], 1, 4, &[borrow(w.rep())]).unwrap(), vec![vec![4.0, 4.0]]);
}

#[test]
fn released_and_stale_handles_are_invalid_arguments() {
    let mut ctx = cpu(Budget::default());
    let w = ones(&mut ctx, 2, 4);
    let rep = w.rep();
    ctx.release(w);
    assert_eq!(ctx.usage(), (0, 0));
    invalid(ctx.write_rows(&Resource::new_own(rep), 0, &[0; 16], &[]), NOT_LIVE, "write-rows of a released handle");
    invalid(ctx.matmul(&[1.0; 4], 1, 4, &[borrow(rep)]), NOT_LIVE, "matmul of a released handle");
    // A second release (a double drop) changes nothing and does not underflow the budget.
    ctx.release(Resource::new_own(rep));
    assert_eq!(ctx.usage(), (0, 0));
    // New weights never take the released handle's place: the stale handle stays invalid.
    let newer: Vec<_> = (0..4).map(|_| ones(&mut ctx, 3, 4)).collect();
    assert!(newer.iter().all(|n| n.rep() != rep), "a released rep was handed out again");
    invalid(ctx.matmul(&[1.0; 4], 1, 4, &[borrow(rep)]), NOT_LIVE, "matmul of a stale handle after new uploads");
    invalid(
        ctx.write_rows(&Resource::new_own(rep), 0, &[0; 16], &[]),
        NOT_LIVE,
        "write-rows of a stale handle after new uploads",
    );
    ctx.release(Resource::new_own(rep));
    assert_eq!(ctx.usage(), (4 * 48, 4), "releasing the stale handle freed a newer weight");
    // The newer weights compute.
    let jobs: Vec<_> = newer.iter().map(|n| borrow(n.rep())).collect();
    assert_eq!(ctx.matmul(&[1.0; 4], 1, 4, &jobs).unwrap(), vec![vec![4.0; 3]; 4]);
}

#[test]
fn handles_of_another_instance_are_invalid_arguments() {
    let mut a = cpu(Budget::default());
    let mut b = cpu(Budget::default());
    let wa = ones(&mut a, 2, 4);
    let wb = ones(&mut b, 5, 4);
    invalid(b.matmul(&[1.0; 4], 1, 4, &[borrow(wa.rep())]), NOT_LIVE, "matmul in b of a's handle");
    invalid(b.write_rows(&Resource::new_own(wa.rep()), 0, &[0; 16], &[]), NOT_LIVE, "write-rows in b of a's handle");
    b.release(Resource::new_own(wa.rep()));
    assert_eq!(b.usage(), (80, 1), "releasing a's handle in b freed b's weight");
    assert_eq!(a.matmul(&[1.0; 4], 1, 4, &[borrow(wa.rep())]).unwrap(), vec![vec![4.0; 2]]);
    assert_eq!(b.matmul(&[1.0; 4], 1, 4, &[borrow(wb.rep())]).unwrap(), vec![vec![4.0; 5]]);
}

#[test]
fn lengths_and_shapes_that_break_the_contract_are_invalid_arguments() {
    let mut ctx = cpu(Budget::default());
    let max = u32::MAX;
    for f in Format::ALL {
        let name = f.name();
        let (n_out, n_in) = (3u32, 64u32);
        let n = (n_out * n_in) as u64;
        let d = f.data_bytes(n).unwrap() as usize;
        let s = f.scale_count(n) as usize;
        for (dl, sl) in [(d - 1, s), (d + 1, s), (0, s), (d, s + 1)].into_iter().chain((s > 0).then_some((d, s - 1))) {
            invalid(
                ctx.upload(f, n_out, n_in, &vec![1; dl], &vec![0.5; sl]),
                &format!("a {name} weight [3, 64] needs {d} bytes and {s} scales, got {dl} and {sl}"),
                &format!("{name} with {dl} bytes, {sl} scales"),
            );
        }
        // Zero and overflowing shapes.
        invalid(ctx.allocate(f, 0, 64), "empty weight [0, 64]", &format!("{name} [0, 64]"));
        invalid(ctx.allocate(f, 3, 0), "empty weight [3, 0]", &format!("{name} [3, 0]"));
        invalid(ctx.upload(f, 0, 0, &[], &[]), "empty weight [0, 0]", &format!("{name} [0, 0]"));
        // [u32::MAX, u32::MAX]: the float formats' byte size passes 2^64; u32::MAX is no
        // multiple of the block formats' blocks.
        let (alloc_msg, upload_msg) = match f {
            Format::F32 | Format::Bf16 => ("weight size overflows".to_string(), "weight size overflows".to_string()),
            _ => (
                format!("n-in {max} is not a multiple of {name}'s block of {}", f.block()),
                format!("a {name} weight [{max}, {max}] needs"),
            ),
        };
        invalid(ctx.allocate(f, max, max), &alloc_msg, &format!("{name} [u32::MAX, u32::MAX]"));
        invalid(ctx.upload(f, max, max, &[0; 16], &[1.0]), &upload_msg, &format!("upload {name} [u32::MAX, u32::MAX]"));
        // 2^32 elements: the element count wraps to 0 in 32-bit arithmetic, matching the empty lists.
        let want = (f.data_bytes(1 << 32).unwrap(), f.scale_count(1 << 32));
        invalid(
            ctx.upload(f, 65536, 65536, &[], &[]),
            &format!("a {name} weight [65536, 65536] needs {} bytes and {} scales, got 0 and 0", want.0, want.1),
            &format!("upload {name} [65536, 65536] with no data"),
        );
    }
    // A huge block-aligned weight whose data and scales together pass 2^64 bytes.
    invalid(ctx.allocate(Format::Q8x32, max, max - 31), "weight size overflows", "q8x32 [u32::MAX, u32::MAX - 31]");
    for (f, n_in) in
        [(Format::Q8x32, 16), (Format::Q8x32, 33), (Format::Q8x16, 8), (Format::Q4x32, 48), (Format::Q4x32, 1)]
    {
        invalid(
            ctx.allocate(f, 2, n_in),
            &format!("n-in {n_in} is not a multiple of {}'s block of {}", f.name(), f.block()),
            &format!("{} with n-in {n_in}", f.name()),
        );
    }
    assert_eq!(ctx.usage(), (0, 0), "a refused call reserved something");

    let w = ones(&mut ctx, 4, 32);
    let other = ones(&mut ctx, 4, 64);
    let x = vec![1.0f32; 96];
    invalid(ctx.matmul(&x[..95], 3, 32, &[borrow(w.rep())]), "x has 95 values, t * n-in is 96", "x of 95 for t 3, n-in 32");
    invalid(ctx.matmul(&x[..33], 1, 32, &[borrow(w.rep())]), "x has 33 values, t * n-in is 32", "x of 33 for t 1, n-in 32");
    invalid(ctx.matmul(&[], 0, 32, &[borrow(w.rep())]), "empty input [0, 32]", "t 0");
    invalid(ctx.matmul(&[], 1, 0, &[borrow(w.rep())]), "empty input [1, 0]", "n-in 0");
    invalid(
        ctx.matmul(&[], 1 << 31, 2, &[borrow(w.rep())]),
        "x has 0 values, t * n-in is 4294967296",
        "t * n-in wrapping 32 bits",
    );
    invalid(ctx.matmul(&x[..32], 1, 32, &[]), "no jobs", "no jobs");
    invalid(
        ctx.matmul(&x[..32], 1, 32, &[borrow(w.rep()), borrow(other.rep())]),
        "job 1: the weight has 64 columns, n-in is 32",
        "a job with cols != n-in",
    );
    let huge: Vec<_> = (0..100_000).map(|_| borrow(w.rep())).collect();
    invalid(ctx.matmul(&x[..32], 1, 32, &huge), "100000 jobs exceed the limit of 64 per call", "100000 jobs");
    // The weights still compute.
    assert_eq!(ctx.matmul(&x[..32], 1, 32, &[borrow(w.rep())]).unwrap(), vec![vec![32.0; 4]]);

    // write-rows: past the end, wrapping, partial rows, wrong scales.
    let q = ctx.allocate(Format::Q8x32, 5, 64).unwrap();
    let row = [1u8; 64];
    invalid(ctx.write_rows(&q, 5, &row, &[1.0; 2]), "rows 5..6 are past the weight's 5 rows", "rows 5..6 of 5");
    invalid(
        ctx.write_rows(&q, max - 1, &[1; 192], &[1.0; 6]),
        "rows 4294967294..4294967297 are past the weight's 5 rows",
        "first-row u32::MAX - 1 and 3 rows",
    );
    invalid(ctx.write_rows(&q, max, &row, &[1.0; 2]), "rows 4294967295..4294967296 are past", "first-row u32::MAX");
    invalid(ctx.write_rows(&q, 0, &row[..63], &[1.0; 2]), "63 bytes of data is not a whole number of 64-byte rows", "63 bytes");
    invalid(ctx.write_rows(&q, 0, &row, &[1.0; 3]), "1 rows of q8x32 need 2 scales, got 3", "3 scales for one row");
    invalid(ctx.write_rows(&q, 0, &[], &[]), "0 bytes of data is not a whole number of 64-byte rows", "no rows");
    // None of it reached the weight: it still reads as zero, and a valid write lands.
    assert_eq!(ctx.matmul(&[1.0; 64], 1, 64, &[borrow(q.rep())]).unwrap(), vec![vec![0.0; 5]]);
    ctx.write_rows(&q, 4, &row, &[0.5, 0.25]).unwrap();
    assert_eq!(ctx.matmul(&[1.0; 64], 1, 64, &[borrow(q.rep())]).unwrap(), vec![vec![0.0, 0.0, 0.0, 0.0, 24.0]]);
}

/// Records what reaches the backend, with small device limits.
struct Recording {
    inner: CpuBackend,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Backend for Recording {
    fn device(&self) -> Option<Device> {
        Some(Device { max_weight_bytes: 4096, max_activation_elements: 1024, ..self.inner.device()? })
    }
    fn create(&mut self, f: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        self.seen.lock().unwrap().push(format!("create {} [{n_out}, {n_in}]", f.name()));
        self.inner.create(f, n_out, n_in)
    }
    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        self.inner.write_rows(id, first_row, data, scales)
    }
    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.seen.lock().unwrap().push(format!("matmul t {t}, n-in {n_in}"));
        self.inner.matmul(x, t, n_in, jobs)
    }
    fn free(&mut self, id: BufferId) {
        self.inner.free(id)
    }
}

/// A backend that keeps the trait's defaults: no kv-caches.
struct NoCaches(CpuBackend);

impl Backend for NoCaches {
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
}

/// `kv-cache`s: sizes that are empty or overflow, past the device's limit or the budget; the
/// budget counts them; a program's run with a cache of another instance, a weight's handle or a
/// released cache is refused; a backend without caches says `unavailable`.
#[test]
fn kv_caches_outside_the_contract_are_refused() {
    let mut ctx = cpu(Budget { bytes: 4096, handles: 3, jobs: 8 });
    invalid(ctx.create_kv_cache(0, 4), "empty kv-cache", "0 slots");
    invalid(ctx.create_kv_cache(4, 0), "empty kv-cache", "width 0");
    invalid(ctx.create_kv_cache(u32::MAX, u32::MAX), "kv-cache size overflows", "u32::MAX x u32::MAX");
    out_of_memory(ctx.create_kv_cache(1 << 30, 2), "exceeds the device's limit", "2^33 bytes a half");
    out_of_memory(ctx.create_kv_cache(64, 9), "4608 more bytes exceed this instance's budget (0 of 4096 used)", "past the budget");
    let cache = ctx.create_kv_cache(8, 4).unwrap();
    assert_eq!(ctx.usage(), (256, 1));
    // A program that writes its input's rows to its one cache, and outputs them.
    let writes = vec![Op::Input { width: 4 }, Op::CacheWrite { k: 0, v: 0, cache: 0 }, Op::Output(0)];
    let p = ctx.create_program(&[], 1, writes).unwrap();
    let run = |ctx: &mut GpuCtx, c: &Resource<wisp::gpu::KvCacheHandle>| ctx.run_program(&p, vec![vec![0.5; 4]], &[(1, 0, std::slice::from_ref(c))]);
    run(&mut ctx, &cache).unwrap();
    // Another instance's handle, a weight's rep and a released one are not caches here.
    let mut other = cpu(Budget::default());
    let foreign = other.create_kv_cache(8, 4).unwrap();
    invalid(run(&mut ctx, &Resource::new_borrow(foreign.rep())), "not a live kv-cache", "foreign");
    let w = ones(&mut ctx, 1, 4);
    invalid(run(&mut ctx, &Resource::new_borrow(w.rep())), "not a live kv-cache", "a weight");
    let rep = cache.rep();
    ctx.release_cache(cache);
    assert_eq!(ctx.usage(), (16, 2));
    invalid(run(&mut ctx, &Resource::new_borrow(rep)), "not a live kv-cache", "released");
    // A backend without caches.
    let mut plain = GpuCtx::new(Box::new(NoCaches(CpuBackend::new())), Budget::default());
    match plain.create_kv_cache(8, 4) {
        Err(GpuError::Unavailable(m)) if m.contains("does not offer kv-caches") => {}
        other => panic!("a kv-cache on a backend without them: {other:?}"),
    }
    assert_eq!(plain.usage(), (0, 0));
}

#[test]
fn sizes_past_the_device_limits_are_refused_before_the_backend() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut ctx = GpuCtx::new(Box::new(Recording { inner: CpuBackend::new(), seen: seen.clone() }), Budget::default());
    let limit = "exceeds the device's limit of 4096";
    out_of_memory(ctx.allocate(Format::F32, 1025, 1), &format!("a weight of 4100 bytes {limit}"), "f32 [1025, 1]");
    out_of_memory(ctx.allocate(Format::Q8x32, 129, 32), &format!("a weight of 4128 bytes {limit}"), "q8x32 [129, 32]");
    out_of_memory(
        ctx.allocate(Format::Q8x32, 1 << 20, 1 << 20),
        &format!("a weight of 1099511627776 bytes {limit}"),
        "q8x32 [2^20, 2^20]",
    );
    out_of_memory(
        ctx.upload(Format::F32, 1025, 1, &[0; 4100], &[]),
        &format!("a weight of 4100 bytes {limit}"),
        "an upload of f32 [1025, 1]",
    );
    assert!(seen.lock().unwrap().is_empty(), "the backend saw {:?}", seen.lock().unwrap());
    assert_eq!(ctx.usage(), (0, 0));
    let w = ctx.allocate(Format::F32, 1024, 1).unwrap();
    let small = ctx.allocate(Format::F32, 1, 1).unwrap();
    out_of_memory(
        ctx.matmul(&[1.0; 1025], 1025, 1, &[borrow(small.rep())]),
        "an input of 1025 values exceeds the device's limit of 1024",
        "an input of 1025 values",
    );
    out_of_memory(
        ctx.matmul(&[1.0; 2], 2, 1, &[borrow(w.rep())]),
        "job 0: an output of 2048 values exceeds the device's limit of 1024",
        "an output of 2048 values",
    );
    assert_eq!(*seen.lock().unwrap(), ["create f32 [1024, 1]", "create f32 [1, 1]"]);
    assert_eq!(ctx.matmul(&[2.0], 1, 1, &[borrow(w.rep())]).unwrap()[0].len(), 1024);
}

#[test]
fn uploads_past_the_budget_are_out_of_memory_and_release_gives_it_back() {
    // 4000 bytes a weight: two fit in 10000 bytes, the third does not.
    let mut ctx = cpu(Budget { bytes: 10_000, handles: 3, jobs: 4 });
    let a = ones(&mut ctx, 10, 100);
    let b = ones(&mut ctx, 10, 100);
    let data = vec![0u8; 4000];
    out_of_memory(
        ctx.upload(Format::F32, 10, 100, &data, &[]),
        "4000 more bytes exceed this instance's budget (8000 of 10000 used)",
        "a third weight past 10000 bytes",
    );
    out_of_memory(
        ctx.allocate(Format::Q8x32, 1, 8192),
        "9216 more bytes exceed this instance's budget (8000 of 10000 used)",
        "an allocation past 10000 bytes (data and scales)",
    );
    assert_eq!(ctx.usage(), (8000, 2));
    ctx.release(a);
    let c = ctx.upload(Format::F32, 10, 100, &data, &[]).unwrap();
    // Handles: three at most.
    let d = ctx.allocate(Format::F32, 1, 1).unwrap();
    out_of_memory(ctx.allocate(Format::F32, 1, 1), "this instance holds its budget of 3 handles", "a fourth handle");
    assert_eq!(ctx.usage(), (8004, 3));
    // The job cap.
    let jobs: Vec<_> = (0..5).map(|_| borrow(d.rep())).collect();
    invalid(ctx.matmul(&[1.0], 1, 1, &jobs), "5 jobs exceed the limit of 4 per call", "5 jobs past a cap of 4");
    assert_eq!(ctx.matmul(&[1.0], 1, 1, &jobs[..4]).unwrap(), vec![vec![0.0]; 4], "4 jobs are within the cap");
    ctx.release(c);
    ctx.release(d);
    ctx.release(b);
    assert_eq!(ctx.usage(), (0, 0));
    // All of it can be used again.
    let all: Vec<_> = (0..2).map(|_| ones(&mut ctx, 10, 100)).collect();
    assert_eq!(ctx.matmul(&[1.0; 100], 1, 100, &[borrow(all[1].rep())]).unwrap(), vec![vec![100.0; 10]]);
}

/// A device that works for `healthy` backend calls, then is lost (as a driver reset would do):
/// it answers `device-lost` from then on, and counts the calls it still gets.
struct Lost {
    inner: CpuBackend,
    healthy: usize,
    calls_after: Arc<Mutex<usize>>,
}

impl Lost {
    fn check(&mut self) -> Result<(), GpuError> {
        if self.healthy == 0 {
            *self.calls_after.lock().unwrap() += 1;
            return Err(GpuError::DeviceLost("the driver reset the device".into()));
        }
        self.healthy -= 1;
        Ok(())
    }
}

impl Backend for Lost {
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
    fn free(&mut self, id: BufferId) {
        self.inner.free(id)
    }
}

#[test]
fn after_a_device_loss_every_call_is_device_lost() {
    let calls_after = Arc::new(Mutex::new(0));
    // Healthy for one upload (create + write-rows) and one product.
    let lost = Lost { inner: CpuBackend::new(), healthy: 3, calls_after: calls_after.clone() };
    let mut ctx = GpuCtx::new(Box::new(lost), Budget::default());
    let w = ones(&mut ctx, 2, 4);
    assert_eq!(ctx.matmul(&[1.0; 4], 1, 4, &[borrow(w.rep())]).unwrap(), vec![vec![4.0; 2]]);
    // The loss, as the backend reports it.
    let why = "the driver reset the device";
    let device_lost = |r: Result<(), GpuError>, what: &str| match r {
        Err(GpuError::DeviceLost(m)) if m.contains(why) => {}
        other => panic!("{what} after the loss: want device-lost saying {why:?}, got {other:?}"),
    };
    device_lost(ctx.matmul(&[1.0; 4], 1, 4, &[borrow(w.rep())]).map(|_| ()), "the matmul that meets the loss");
    assert_eq!(*calls_after.lock().unwrap(), 1);
    // From then on every call is device-lost, without asking the backend again.
    device_lost(ctx.matmul(&[1.0; 4], 1, 4, &[borrow(w.rep())]).map(|_| ()), "matmul");
    device_lost(ctx.write_rows(&w, 0, &[0; 16], &[]).map(|_| ()), "write-rows");
    device_lost(ctx.allocate(Format::F32, 1, 1).map(|_| ()), "allocate");
    device_lost(ctx.upload(Format::F32, 1, 4, &[0; 16], &[]).map(|_| ()), "upload");
    device_lost(ctx.create_kv_cache(4, 4).map(|_| ()), "create-kv-cache");
    // Even a call that is invalid anyway: the loss is what the guest needs to know.
    device_lost(ctx.matmul(&[], 0, 0, &[]).map(|_| ()), "an invalid matmul");
    assert_eq!(*calls_after.lock().unwrap(), 1, "the backend was asked again after the loss");
    // Releasing still gives the budget back.
    assert_eq!(ctx.usage(), (32, 1));
    ctx.release(w);
    assert_eq!(ctx.usage(), (0, 0));
    // Another instance's context, on a working device, is unaffected.
    let mut other = cpu(Budget::default());
    let v = ones(&mut other, 3, 4);
    assert_eq!(other.matmul(&[1.0; 4], 1, 4, &[borrow(v.rep())]).unwrap(), vec![vec![4.0; 3]]);
}

/// SplitMix64, for the hostile call generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[(self.next() % xs.len() as u64) as usize]
    }
}

#[test]
fn random_hostile_calls_never_panic_and_keep_the_books() {
    let seed = std::env::var("WISP_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed);
    println!("seed {seed}");
    let mut rng = Rng(seed);
    let mut ctx = cpu(Budget { bytes: 1 << 20, handles: 16, jobs: 8 });
    let dims = [0, 1, 2, 15, 16, 31, 32, 33, 64, 100, 1000, 65536, u32::MAX - 31, u32::MAX];
    let mut live: Vec<u32> = Vec::new();
    let mut dead: Vec<u32> = vec![12345];
    let mut caches: Vec<u32> = Vec::new();
    for _ in 0..20_000 {
        let f = rng.pick(&Format::ALL);
        let (n_out, n_in) = (rng.pick(&dims), rng.pick(&dims));
        let rep = match rng.next() % 3 {
            0 if !live.is_empty() => rng.pick(&live),
            1 => rng.pick(&dead),
            _ => rng.next() as u32,
        };
        let len = rng.pick(&[0usize, 1, 3, 4, 16, 31, 32, 64, 128, 4096]);
        match rng.next() % 6 {
            0 => {
                let data = vec![1u8; len * 4];
                let scales = vec![0.5f32; len / 8];
                if let Ok(w) = ctx.upload(f, n_out % 70, n_in % 70, &data, &scales) {
                    live.push(w.rep());
                }
            }
            1 => {
                if let Ok(w) = ctx.allocate(f, n_out, n_in) {
                    live.push(w.rep());
                }
            }
            2 => {
                let _ = ctx.write_rows(&Resource::new_own(rep), n_out, &vec![1u8; len * 4], &vec![0.5f32; len / 8]);
            }
            3 => {
                let jobs: Vec<_> = (0..rng.pick(&[0, 1, 2, 9])).map(|_| borrow(rep)).collect();
                let t = rng.pick(&[0, 1, 2, 3]);
                let _ = ctx.matmul(&vec![0.5f32; len], t, n_in % 70, &jobs);
            }
            4 => {
                if let Ok(c) = ctx.create_kv_cache(n_out % 70, n_in % 70) {
                    caches.push(c.rep());
                }
            }
            _ => {
                ctx.release(Resource::new_own(rep));
                if let Some(i) = live.iter().position(|&r| r == rep) {
                    dead.push(live.swap_remove(i));
                }
            }
        }
        let (bytes, handles) = ctx.usage();
        assert!(
            bytes <= 1 << 20 && handles <= 16 && handles as usize == live.len() + caches.len(),
            "books: {bytes} bytes, {handles} handles, {} weights and {} caches live",
            live.len(),
            caches.len()
        );
    }
    for rep in live {
        ctx.release(Resource::new_own(rep));
    }
    for rep in caches {
        ctx.release_cache(Resource::new_own(rep));
    }
    assert_eq!(ctx.usage(), (0, 0));
}
