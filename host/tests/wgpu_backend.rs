//! The wgpu backend against the CPU reference, on fresh random shapes and data.
//!
//! Each test names the adapter it ran on. Without an adapter a test is skipped with a message,
//! except under `CI=true`, where it fails. Tolerance: `|gpu - cpu| <= 1e-4 * sum_k |w[n, k] * x[t, k]|`
//! for every output (both sides compute in f32, in a different order). `WISP_TEST_SEED` repeats
//! a run; every test prints its seed.

use std::time::Instant;
use wisp::gpu::program::{self, Op, Output, Precision, SequenceRun, WeightRef};
use wisp::{Activation, AttentionShape, Backend, Budget, CpuBackend, Format, Gemm, GpuCtx, GpuError, Rotation, WgpuBackend};

const TOLERANCE: f32 = 1e-4;

/// The backend on the preferred adapter, or `None` (skip) when there is none outside CI.
fn backend(test: &str) -> Option<WgpuBackend> {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    match WgpuBackend::new() {
        Ok(Some(b)) => {
            println!("{test}: adapter {}", b.describe());
            Some(b)
        }
        Ok(None) if ci => panic!("{test}: no wgpu adapter, and CI=true (install mesa-vulkan-drivers for lavapipe)"),
        Ok(None) => {
            println!("{test}: skipped: no wgpu adapter (install mesa-vulkan-drivers for lavapipe)");
            None
        }
        Err(e) => panic!("{test}: opening the adapter failed: {e:#}"),
    }
}

/// SplitMix64: small, seedable, good enough for test data.
struct Rng(u64);

impl Rng {
    fn new(test: &str) -> Rng {
        let seed = match std::env::var("WISP_TEST_SEED") {
            Ok(s) => s.parse().unwrap_or(0),
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1),
        };
        println!("{test}: seed {seed}");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next() % (hi - lo + 1) as u64) as u32
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A weight in its upload format, and its values decoded as `wit/gpu.wit` defines them.
struct Weight {
    format: Format,
    n_out: u32,
    n_in: u32,
    data: Vec<u8>,
    scales: Vec<f32>,
    decoded: Vec<f32>,
}

impl Weight {
    fn random(rng: &mut Rng, format: Format, n_out: u32, n_in: u32) -> Weight {
        let n = n_out as usize * n_in as usize;
        let (data, scales) = match format {
            Format::F32 => ((0..n).flat_map(|_| rng.unit().to_le_bytes()).collect(), vec![]),
            Format::Bf16 => {
                ((0..n).flat_map(|_| ((rng.unit().to_bits() >> 16) as u16).to_le_bytes()).collect(), vec![])
            }
            Format::Q8x32 | Format::Q8x16 => {
                (rng.bytes(n), (0..format.scale_count(n as u64)).map(|_| rng.unit() * 0.05).collect())
            }
            Format::Q4x32 => (rng.bytes(n / 2), (0..format.scale_count(n as u64)).map(|_| rng.unit() * 0.1).collect()),
        };
        let decoded = decode(format, &data, &scales, n);
        Weight { format, n_out, n_in, data, scales, decoded }
    }

    fn row_bytes(&self) -> usize {
        self.data.len() / self.n_out as usize
    }

    fn row_scales(&self) -> usize {
        self.scales.len() / self.n_out as usize
    }
}

/// The WIT's layouts, written out again independently of the host's decoder.
fn decode(format: Format, data: &[u8], scales: &[f32], n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match format {
            Format::F32 => f32::from_le_bytes([data[4 * i], data[4 * i + 1], data[4 * i + 2], data[4 * i + 3]]),
            Format::Bf16 => f32::from_bits(((data[2 * i + 1] as u32) << 24) | ((data[2 * i] as u32) << 16)),
            Format::Q8x32 => scales[i / 32] * (data[i] as i8) as f32,
            Format::Q8x16 => scales[i / 16] * (data[i] as i8) as f32,
            Format::Q4x32 => {
                let q = if i % 2 == 0 { data[i / 2] & 0xf } else { data[i / 2] >> 4 };
                scales[2 * (i / 32)] * q as f32 - scales[2 * (i / 32) + 1]
            }
        })
        .collect()
}

fn random_x(rng: &mut Rng, t: u32, n_in: u32) -> Vec<f32> {
    (0..t as usize * n_in as usize).map(|_| rng.unit()).collect()
}

/// A random `n_in` for `format`: a multiple of its block only (odd for the float formats).
fn random_n_in(rng: &mut Rng, format: Format, max_blocks: u32) -> u32 {
    let block = format.block() as u32;
    match block {
        1 => rng.range(1, max_blocks * 8),
        b => b * rng.range(1, max_blocks),
    }
}

fn upload(b: &mut dyn Backend, w: &Weight) -> u64 {
    let id = b.create(w.format, w.n_out, w.n_in).expect("create");
    b.write_rows(id, 0, &w.data, &w.scales).expect("write_rows");
    id
}

/// Attention of `q` over the keys and values `k`, `v` as a program's `attention` op computes it:
/// over a `kv-cache` of as many rows, made for the call and freed after it.
fn attend(b: &mut dyn Backend, q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape) -> Result<Vec<f32>, GpuError> {
    let cache = b.create_cache(s.n_keys, s.n_head_kv * s.head_dim)?;
    let out = b.write_cache(cache, 0, k, v).and_then(|()| b.attention_cached(q, &[], &[], 0, cache, 0, s));
    b.free_cache(cache);
    out
}

/// Checks `got` (outputs of `weights` over `x`) against the CPU reference and the tolerance.
fn check(what: &str, weights: &[&Weight], x: &[f32], t: u32, got: &[Vec<f32>]) {
    check_within(TOLERANCE, what, weights, x, t, got);
}

/// As [`check`], with `tolerance` in place of TOLERANCE.
fn check_within(tolerance: f32, what: &str, weights: &[&Weight], x: &[f32], t: u32, got: &[Vec<f32>]) {
    let mut cpu = CpuBackend::new();
    let ids: Vec<u64> = weights.iter().map(|w| upload(&mut cpu, w)).collect();
    let n_in = weights[0].n_in;
    let want = cpu.matmul(x, t, n_in, &ids).expect("cpu matmul");
    assert_eq!(got.len(), weights.len(), "{what}: one output per job");
    for (j, w) in weights.iter().enumerate() {
        assert_eq!(got[j].len(), t as usize * w.n_out as usize, "{what}: job {j}: output length");
        let n_in = n_in as usize;
        for ti in 0..t as usize {
            let xr = &x[ti * n_in..(ti + 1) * n_in];
            for n in 0..w.n_out as usize {
                let wr = &w.decoded[n * n_in..(n + 1) * n_in];
                let magnitude: f32 = wr.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
                let i = ti * w.n_out as usize + n;
                let (g, c) = (got[j][i], want[j][i]);
                assert!(
                    (g - c).abs() <= tolerance * magnitude + f32::MIN_POSITIVE,
                    "{what}: job {j} ({} [{}, {}]): y[{ti}, {n}] = {g}, the CPU has {c} (sum |w x| = {magnitude})",
                    w.format.name(),
                    w.n_out,
                    w.n_in
                );
            }
        }
    }
}

#[test]
fn every_format_matches_the_cpu() {
    let Some(mut gpu) = backend("every_format_matches_the_cpu") else { return };
    let mut rng = Rng::new("every_format_matches_the_cpu");
    for format in Format::ALL {
        for t in [1, 2, 7, 64] {
            let n_in = random_n_in(&mut rng, format, 24);
            // Several jobs in one call, with ragged row counts.
            let weights: Vec<Weight> = (0..3)
                .map(|_| {
                    let n_out = rng_rows(&mut rng);
                    Weight::random(&mut rng, format, n_out, n_in)
                })
                .collect();
            let ids: Vec<u64> = weights.iter().map(|w| upload(&mut gpu, w)).collect();
            let x = random_x(&mut rng, t, n_in);
            let got = gpu.matmul(&x, t, n_in, &ids).expect("matmul");
            let what = format!("{} t={t} n_in={n_in}", format.name());
            check(&what, &weights.iter().collect::<Vec<_>>(), &x, t, &got);
            for id in ids {
                gpu.free(id);
            }
        }
    }
}

/// A ragged row count: not a multiple of any tile.
fn rng_rows(rng: &mut Rng) -> u32 {
    match rng.range(0, 3) {
        0 => rng.range(1, 5),
        1 => 128 * rng.range(1, 3) + rng.range(1, 127),
        _ => rng.range(1, 300),
    }
}

#[test]
fn mixed_formats_in_one_call() {
    let Some(mut gpu) = backend("mixed_formats_in_one_call") else { return };
    let mut rng = Rng::new("mixed_formats_in_one_call");
    let n_in = 32 * rng.range(1, 12);
    for t in [1, 7, 64] {
        let weights: Vec<Weight> = Format::ALL
            .iter()
            .map(|&f| {
                let n_out = rng_rows(&mut rng);
                Weight::random(&mut rng, f, n_out, n_in)
            })
            .collect();
        let ids: Vec<u64> = weights.iter().map(|w| upload(&mut gpu, w)).collect();
        let x = random_x(&mut rng, t, n_in);
        let got = gpu.matmul(&x, t, n_in, &ids).expect("matmul");
        check(&format!("mixed t={t} n_in={n_in}"), &weights.iter().collect::<Vec<_>>(), &x, t, &got);
    }
}

#[test]
fn rows_written_in_chunks_equal_one_write() {
    let Some(mut gpu) = backend("rows_written_in_chunks_equal_one_write") else { return };
    let mut rng = Rng::new("rows_written_in_chunks_equal_one_write");
    for format in Format::ALL {
        let n_in = random_n_in(&mut rng, format, 8);
        let n_out = rng.range(3, 200);
        let w = Weight::random(&mut rng, format, n_out, n_in);
        let whole = upload(&mut gpu, &w);

        // The same rows in three writes, last chunk first.
        let chunked = gpu.create(format, n_out, n_in).expect("create");
        let a = rng.range(1, n_out - 2) as usize;
        let b = rng.range(a as u32 + 1, n_out - 1) as usize;
        let (rb, rs) = (w.row_bytes(), w.row_scales());
        for (lo, hi) in [(b, n_out as usize), (0, a), (a, b)] {
            gpu.write_rows(chunked, lo as u32, &w.data[lo * rb..hi * rb], &w.scales[lo * rs..hi * rs])
                .expect("write_rows");
        }
        for t in [1, 7] {
            let x = random_x(&mut rng, t, n_in);
            let got = gpu.matmul(&x, t, n_in, &[whole, chunked]).expect("matmul");
            assert_eq!(got[0], got[1], "{}: chunked rows {a}, {b} of {n_out}", format.name());
            check(&format!("{} chunked", format.name()), &[&w, &w], &x, t, &got);
        }
    }
}

#[test]
fn rows_never_written_read_as_zero() {
    let Some(mut gpu) = backend("rows_never_written_read_as_zero") else { return };
    let mut rng = Rng::new("rows_never_written_read_as_zero");
    for format in Format::ALL {
        let n_in = random_n_in(&mut rng, format, 4);
        let n_out = rng.range(2, 150);
        let w = Weight::random(&mut rng, format, n_out, n_in);
        let id = gpu.create(format, n_out, n_in).expect("create");
        let half = (n_out / 2) as usize;
        let (rb, rs) = (w.row_bytes(), w.row_scales());
        gpu.write_rows(id, 0, &w.data[..half * rb], &w.scales[..half * rs]).expect("write_rows");
        let x = random_x(&mut rng, 5, n_in);
        let got = gpu.matmul(&x, 5, n_in, &[id]).expect("matmul");
        for ti in 0..5 {
            let row = &got[0][ti * n_out as usize..(ti + 1) * n_out as usize];
            assert!(
                row[half..].iter().all(|&v| v == 0.0),
                "{}: unwritten rows are not zero: {:?}",
                format.name(),
                &row[half..]
            );
        }
    }
}

#[test]
fn device_loss_is_an_error_not_a_panic() {
    let Some(mut gpu) = backend("device_loss_is_an_error_not_a_panic") else { return };
    let mut rng = Rng::new("device_loss_is_an_error_not_a_panic");
    let w = Weight::random(&mut rng, Format::Q8x32, 40, 64);
    let id = upload(&mut gpu, &w);
    let x = random_x(&mut rng, 3, 64);
    gpu.matmul(&x, 3, 64, &[id]).expect("matmul before the loss");

    gpu.simulate_device_loss();
    let lost = |r: Result<(), GpuError>, what: &str| match r {
        Err(GpuError::DeviceLost(m)) if !m.is_empty() => println!("{what}: device-lost: {m}"),
        other => panic!("{what} after the loss: {other:?}, not device-lost with a reason"),
    };
    lost(gpu.create(Format::F32, 4, 4).map(|_| ()), "create");
    lost(gpu.write_rows(id, 0, &w.data, &w.scales), "write_rows");
    lost(gpu.matmul(&x, 3, 64, &[id]).map(|_| ()), "matmul");
    lost(gpu.matmul(&x, 3, 64, &[id]).map(|_| ()), "a second matmul");
    assert!(gpu.device().is_none(), "a lost device is not offered");
    gpu.free(id);

    // A GpuCtx over a backend lost before it was made offers no device, and says so.
    let Some(mut gpu) = backend("device_loss_is_an_error_not_a_panic") else { return };
    gpu.simulate_device_loss();
    let mut ctx = GpuCtx::new(Box::new(gpu), Budget::default());
    assert!(ctx.device().is_none());
    match ctx.allocate(Format::F32, 4, 4) {
        Err(GpuError::Unavailable(m)) => assert!(m.contains("no GPU"), "{m}"),
        other => panic!("allocate on a context over a lost device: {other:?}, not unavailable"),
    }
}

/// A readback that spins before it blocks (GPUs) reads what a blocking one reads, for products
/// and attention alike, and a device lost under it is still an error.
#[test]
fn spinning_and_blocking_readbacks_agree() {
    let Some(mut gpu) = backend("spinning_and_blocking_readbacks_agree") else { return };
    let mut rng = Rng::new("spinning_and_blocking_readbacks_agree");
    let w = Weight::random(&mut rng, Format::Q4x32, 70, 128);
    let id = upload(&mut gpu, &w);
    let x = random_x(&mut rng, 5, 128);
    let s = AttentionShape { t: 3, n_keys: 9, n_head: 4, n_head_kv: 2, head_dim: 32, window: 0, scale: 0.2, softcap: 0.0 };
    let q: Vec<f32> = (0..3 * 4 * 32).map(|_| rng.unit()).collect();
    let k: Vec<f32> = (0..9 * 2 * 32).map(|_| rng.unit()).collect();
    let mut seen = Vec::new();
    for spin in [false, true, false] {
        gpu.set_spin_wait(spin);
        let y = gpu.matmul(&x, 5, 128, &[id]).expect("matmul");
        let a = attend(&mut gpu, &q, &k, &k, &s).expect("attention");
        check(&format!("spin={spin}"), &[&w], &x, 5, &y);
        seen.push((y, a));
    }
    assert!(seen.windows(2).all(|p| p[0] == p[1]), "the results differ between spinning and blocking readbacks");
    // A call longer than the spin (on CPU devices by far): the readback falls back to blocking.
    gpu.set_spin_wait(true);
    let big = Weight::random(&mut rng, Format::F32, 1024, 1024);
    let big_id = upload(&mut gpu, &big);
    let xb = random_x(&mut rng, 64, 1024);
    let start = Instant::now();
    let y = gpu.matmul(&xb, 64, 1024, &[big_id]).expect("a long matmul");
    println!("a [1024, 1024] x 64 product with a spinning readback: {:?}", start.elapsed());
    check("a product longer than the spin", &[&big], &xb, 64, &y);
    gpu.simulate_device_loss();
    match gpu.matmul(&x, 5, 128, &[id]) {
        Err(GpuError::DeviceLost(_)) => {}
        other => panic!("matmul on a lost device, spinning: {other:?}"),
    }
}

/// Random queries, keys and values of `shape`, each in [-2, 2).
fn attention_inputs(rng: &mut Rng, s: &AttentionShape) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (q, k) = s.lens().expect("a small shape");
    let mut values = |n: u64| (0..n).map(|_| 2.0 * rng.unit()).collect::<Vec<f32>>();
    (values(q), values(k), values(k))
}

/// `got` is the CPU reference's attention within `TOLERANCE` of the largest `|v|` (every output
/// is a convex combination of values).
#[track_caller]
fn check_attention(what: &str, got: &[f32], want: &[f32], v: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: output length");
    let scale = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= TOLERANCE * scale, "{what}: output {i}: {g} vs {w}");
    }
}

/// Attention on the device against the CPU reference: grouped heads, heads of every width up
/// to the contract's 512 (and odd ones), windows, more keys than the kernel's chunk, one query
/// and many; then a device loss makes it `device-lost`.
#[test]
fn attention_matches_the_cpu() {
    let Some(mut gpu) = backend("attention_matches_the_cpu") else { return };
    let mut rng = Rng::new("attention_matches_the_cpu");
    let mut cpu = CpuBackend::new();
    let mut shapes = vec![
        // A 270M model's prefill batch and decode step (one key/value head of 256), a sliding
        // layer.
        AttentionShape { t: 64, n_keys: 200, n_head: 4, n_head_kv: 1, head_dim: 256, window: 150, scale: 0.0625, softcap: 0.0 },
        AttentionShape { t: 1, n_keys: 130, n_head: 4, n_head_kv: 1, head_dim: 256, window: 0, scale: 0.0625, softcap: 0.0 },
        // 14 heads of 64 sharing 2.
        AttentionShape { t: 7, n_keys: 70, n_head: 14, n_head_kv: 2, head_dim: 64, window: 0, scale: 0.125, softcap: 0.0 },
        AttentionShape { t: 3, n_keys: 3, n_head: 2, n_head_kv: 2, head_dim: 512, window: 1, scale: 0.04, softcap: 0.0 },
        AttentionShape { t: 2, n_keys: 5, n_head: 3, n_head_kv: 1, head_dim: 1, window: 0, scale: 1.0, softcap: 0.0 },
        // Gemma 2's soft-capped scores (here a cap tight enough to bite), a window.
        AttentionShape { t: 9, n_keys: 90, n_head: 8, n_head_kv: 4, head_dim: 256, window: 40, scale: 0.0625, softcap: 0.5 },
    ];
    for _ in 0..6 {
        let t = rng.range(1, 40);
        let n_head_kv = rng.range(1, 3);
        shapes.push(AttentionShape {
            t,
            n_keys: t + rng.range(0, 150),
            n_head: n_head_kv * rng.range(1, 4),
            n_head_kv,
            head_dim: rng.range(1, 300),
            window: if rng.range(0, 1) == 0 { 0 } else { rng.range(1, 100) },
            scale: 0.05 + rng.unit().abs(),
            // Half of them capped (Gemma 2's soft-capping), tight enough to bite.
            softcap: if rng.range(0, 1) == 0 { 0.0 } else { 0.3 + rng.unit().abs() },
        });
    }
    for s in &shapes {
        let what = format!("{s:?}");
        let (q, k, v) = attention_inputs(&mut rng, s);
        let want = attend(&mut cpu, &q, &k, &v, s).expect("the reference");
        let got = attend(&mut gpu, &q, &k, &v, s).unwrap_or_else(|e| panic!("{what}: {e}"));
        check_attention(&what, &got, &want, &v);
    }
    println!("attention_matches_the_cpu: {} shapes", shapes.len());

    let s = &shapes[2];
    let (q, k, v) = attention_inputs(&mut rng, s);
    gpu.simulate_device_loss();
    match attend(&mut gpu, &q, &k, &v, s) {
        Err(GpuError::DeviceLost(m)) if !m.is_empty() => {}
        other => panic!("attention after the loss: {other:?}, not device-lost with a reason"),
    }
}

/// `attention_cached` on the device against the CPU reference's, call after call on one ring:
/// a prefill batch, decode steps, a batch that wraps the ring, windows, grouped heads.
#[test]
fn cached_attention_matches_the_cpu() {
    let Some(mut gpu) = backend("cached_attention_matches_the_cpu") else { return };
    let mut rng = Rng::new("cached_attention_matches_the_cpu");
    let mut cpu = CpuBackend::new();
    let (n_head, n_head_kv, head_dim, slots) = (8u32, 2u32, 64u32, 150u32);
    let width = n_head_kv * head_dim;
    let (g, c) = (gpu.create_cache(slots, width).expect("a cache"), cpu.create_cache(slots, width).expect("a cache"));
    for (pos, t, window) in [(0u32, 70u32, 0u32), (70, 1, 0), (71, 1, 0), (72, 64, 100), (136, 1, 100), (137, 40, 100)] {
        let first = if window == 0 { 0 } else { (pos + 1).saturating_sub(window) };
        let s = AttentionShape { t, n_keys: pos + t - first, n_head, n_head_kv, head_dim, window, scale: 0.125, softcap: 0.0 };
        let what = format!("{s:?} at position {pos}");
        let q: Vec<f32> = (0..t * n_head * head_dim).map(|_| 2.0 * rng.unit()).collect();
        let k: Vec<f32> = (0..t * width).map(|_| 2.0 * rng.unit()).collect();
        let v: Vec<f32> = (0..t * width).map(|_| 2.0 * rng.unit()).collect();
        let want = cpu.attention_cached(&q, &k, &v, pos, c, first, &s).expect("the reference");
        let got = gpu.attention_cached(&q, &k, &v, pos, g, first, &s).unwrap_or_else(|e| panic!("{what}: {e}"));
        check_attention(&what, &got, &want, &v);
    }
    gpu.free_cache(g);
    match gpu.attention_cached(&[0.0; 512], &[], &[], 0, g, 0, &AttentionShape { t: 1, n_keys: 1, n_head, n_head_kv, head_dim, window: 0, scale: 1.0, softcap: 0.0 }) {
        Err(GpuError::InvalidArgument(_)) => {}
        other => panic!("attention over a freed cache: {other:?}"),
    }
}

/// The backend's own checks, for a caller that skips `GpuCtx`: errors, never a wgpu panic or a
/// buffer whose size wrapped; afterwards the backend still computes.
#[test]
fn the_backend_alone_refuses_what_it_cannot_hold() {
    let Some(mut gpu) = backend("the_backend_alone_refuses_what_it_cannot_hold") else { return };
    let max = gpu.device().expect("a device").max_weight_bytes;
    let oom = |r: Result<u64, GpuError>, what: &str| match r {
        Err(GpuError::OutOfMemory(m)) if m.contains("the device's limit is") => {}
        other => panic!("{what}: want out-of-memory naming the limit, got {other:?}"),
    };
    // Sizes past the limit, and sizes whose byte count passes 2^64 (and would wrap to 0).
    oom(gpu.create(Format::F32, (max / 4096 + 1) as u32, 1024), "an f32 weight one row past the limit");
    oom(gpu.create(Format::F32, u32::MAX, u32::MAX), "f32 [u32::MAX, u32::MAX]");
    oom(gpu.create(Format::F32, 1 << 30, u32::MAX), "f32 [2^30, u32::MAX]: 2^64 bytes");
    oom(gpu.create(Format::Bf16, 1 << 31, u32::MAX), "bf16 [2^31, u32::MAX]: 2^64 bytes");
    oom(gpu.create(Format::Q8x32, u32::MAX, u32::MAX - 31), "q8x32 [u32::MAX, u32::MAX - 31]");
    let id = gpu.create(Format::Q8x32, 4, 64).expect("create");
    let invalid = |r: Result<(), GpuError>, what: &str| match r {
        Err(GpuError::InvalidArgument(m)) if !m.is_empty() => {}
        other => panic!("{what}: want invalid-argument, got {other:?}"),
    };
    invalid(gpu.write_rows(id, 0, &[1; 63], &[1.0; 2]), "63 bytes");
    invalid(gpu.write_rows(id, 4, &[1; 64], &[1.0; 2]), "row 4 of 4");
    invalid(gpu.write_rows(id, u32::MAX, &[1; 64], &[1.0; 2]), "row u32::MAX");
    invalid(gpu.write_rows(id, 0, &[1; 64], &[1.0; 3]), "3 scales");
    invalid(gpu.write_rows(id + 1000, 0, &[1; 64], &[1.0; 2]), "an unknown weight");
    invalid(gpu.matmul(&[1.0; 63], 1, 64, &[id]).map(drop), "x of 63 for n-in 64");
    invalid(gpu.matmul(&[1.0; 32], 1, 32, &[id]).map(drop), "n-in 32 for a weight of 64 columns");
    invalid(gpu.matmul(&[1.0; 64], 1, 64, &[]).map(drop), "no jobs");
    invalid(gpu.matmul(&[1.0; 64], 1, 64, &[id + 1000]).map(drop), "an unknown weight");
    // The weight computes: row 0 written, the rest zero.
    gpu.write_rows(id, 0, &[1; 64], &[0.5, 0.25]).expect("write_rows");
    assert_eq!(gpu.matmul(&[1.0; 64], 1, 64, &[id]).expect("matmul"), vec![vec![24.0, 0.0, 0.0, 0.0]]);
}

#[test]
fn requests_past_the_limits_are_refused_by_gpuctx() {
    let Some(gpu) = backend("requests_past_the_limits_are_refused_by_gpuctx") else { return };
    let device = gpu.device().expect("a device");
    println!(
        "limits: max_weight_bytes {}, max_activation_elements {}",
        device.max_weight_bytes, device.max_activation_elements
    );
    let budget = Budget { bytes: u64::MAX / 2, handles: 16, jobs: 64 };
    let mut ctx = GpuCtx::new(Box::new(gpu), budget);

    // A weight one block past the largest buffer.
    let n_in = 4096u32;
    let n_out = (device.max_weight_bytes / n_in as u64 + 1).min(u32::MAX as u64) as u32;
    match ctx.allocate(Format::Q8x32, n_out, n_in) {
        Err(GpuError::OutOfMemory(m))
            if m.contains(&format!("exceeds the device's limit of {}", device.max_weight_bytes)) =>
        {
            println!("refused as it should be: {m}")
        }
        Err(e) => panic!("a weight past the limit: {e}, not out-of-memory"),
        Ok(_) => panic!("a weight past the limit was allocated"),
    }

    // An output past the activation limit, from a small input.
    let n_in = 32u32;
    let n_out = 1u32 << 16;
    let w = ctx.allocate(Format::Q4x32, n_out, n_in).expect("allocate");
    let t = (device.max_activation_elements / n_out as u64 + 1) as u32;
    let x = vec![0.5f32; t as usize * n_in as usize];
    match ctx.matmul(&x, t, n_in, std::slice::from_ref(&w)) {
        Err(GpuError::OutOfMemory(m))
            if m.contains(&format!("exceeds the device's limit of {}", device.max_activation_elements)) =>
        {
            println!("refused as it should be: {m}")
        }
        Err(e) => panic!("an output past the limit: {e}, not out-of-memory"),
        Ok(_) => panic!("an output past the limit was computed"),
    }
    // The context still works.
    let y = ctx.matmul(&x[..n_in as usize * 2], 2, n_in, std::slice::from_ref(&w)).expect("a matmul in the limits");
    assert_eq!(y[0].len(), 2 * n_out as usize);
    assert!(y[0].iter().all(|&v| v == 0.0), "an allocated, unwritten weight reads as zero");
}

/// A mid-size case, timed: q4x32 [2048, 2048] at t = 1 and t = 64 (the latter split over
/// several dispatches), checked against the CPU and reported in GFLOP/s.
#[test]
fn mid_size_throughput() {
    let Some(mut gpu) = backend("mid_size_throughput") else { return };
    let mut rng = Rng::new("mid_size_throughput");
    for format in [Format::Q4x32, Format::Q8x32, Format::F32] {
        let (n_out, n_in) = (2048u32, 2048u32);
        let w = Weight::random(&mut rng, format, n_out, n_in);
        let id = upload(&mut gpu, &w);
        for t in [1u32, 64] {
            let x = random_x(&mut rng, t, n_in);
            // The first call builds the pipeline.
            let got = gpu.matmul(&x, t, n_in, &[id]).expect("matmul");
            let runs = 3;
            let start = Instant::now();
            for _ in 0..runs {
                gpu.matmul(&x, t, n_in, &[id]).expect("matmul");
            }
            let secs = start.elapsed().as_secs_f64() / runs as f64;
            let flops = 2.0 * t as f64 * n_out as f64 * n_in as f64;
            println!(
                "mid_size_throughput: {} [{n_out}, {n_in}] t={t}: {:.2} ms, {:.2} GFLOP/s",
                format.name(),
                secs * 1e3,
                flops / secs / 1e9
            );
            check(&format!("{} mid-size t={t}", format.name()), &[&w], &x, t, &got);
        }
        gpu.free(id);
    }
}

/// Calls large enough to be split into several dispatches, over rows and over t, with ragged
/// edges at the splits.
#[test]
fn large_calls_split_into_dispatches() {
    let Some(mut gpu) = backend("large_calls_split_into_dispatches") else { return };
    let mut rng = Rng::new("large_calls_split_into_dispatches");
    for (format, n_out, n_in, t) in [(Format::Q4x32, 4173, 16384, 5), (Format::Q8x32, 700, 2048, 301)] {
        let w = Weight::random(&mut rng, format, n_out, n_in);
        let id = upload(&mut gpu, &w);
        let x = random_x(&mut rng, t, n_in);
        let got = gpu.matmul(&x, t, n_in, &[id]).expect("matmul");
        check(&format!("{} [{n_out}, {n_in}] t={t}", format.name()), &[&w], &x, t, &got);
        gpu.free(id);
    }
}

/// The small-t kernel with a row shared by several invocations (the GPU layout, summed through
/// workgroup memory) and by one (the CPU layout) gives the CPU's results either way.
#[test]
fn gemv_row_sharing_matches_the_cpu() {
    let Some(mut gpu) = backend("gemv_row_sharing_matches_the_cpu") else { return };
    let mut rng = Rng::new("gemv_row_sharing_matches_the_cpu");
    assert!(gpu.set_gemv_lanes(3).is_err() && gpu.set_gemv_lanes(128).is_err());
    for lanes in [1, 4, 32, 64] {
        gpu.set_gemv_lanes(lanes).expect("lanes");
        for format in Format::ALL {
            let n_in = random_n_in(&mut rng, format, 40);
            let n_out = rng_rows(&mut rng);
            let w = Weight::random(&mut rng, format, n_out, n_in);
            let id = upload(&mut gpu, &w);
            for t in [1, 3] {
                let x = random_x(&mut rng, t, n_in);
                let got = gpu.matmul(&x, t, n_in, &[id]).expect("matmul");
                check(&format!("{} lanes={lanes} t={t} [{n_out}, {n_in}]", format.name()), &[&w], &x, t, &got);
            }
            gpu.free(id);
        }
    }
}

/// The tiled kernels (the GPU's paths for t >= 4: 64 x 64 tiles, 128 x 128 double-buffered, and
/// 128 x 256 where the adapter offers 48 KiB of workgroup memory) give the CPU's results for
/// every format, with ragged tiles in rows, in t and in the columns, and when a call is split
/// into dispatches. Where `gemm_large` cannot run (lavapipe), asking for it is a clear error and
/// it is skipped, saying so; `WISP_REQUIRE_LARGE=1` (bench/gpu.sh on the GPU machine) makes
/// that a failure.
#[test]
fn tiled_gemm_matches_the_cpu() {
    let Some(mut gpu) = backend("tiled_gemm_matches_the_cpu") else { return };
    let mut rng = Rng::new("tiled_gemm_matches_the_cpu");
    let large = gpu.has_large().then_some(Gemm::Large);
    if large.is_none() {
        let required = std::env::var("WISP_REQUIRE_LARGE").is_ok_and(|v| v == "1");
        assert!(!required, "tiled_gemm_matches_the_cpu: gemm_large cannot run here, and WISP_REQUIRE_LARGE=1");
        let e = gpu.set_gemm(Gemm::Large).expect_err("gemm_large on an adapter without its workgroup memory");
        assert!(e.to_string().contains("workgroup memory"), "{e}");
        println!("tiled_gemm_matches_the_cpu: gemm_large skipped: {e}");
    }
    for gemm in [Gemm::Tiled, Gemm::Wide].into_iter().chain(large) {
        gpu.set_gemm(gemm).expect("gemm");
        for format in Format::ALL {
            let n_in = random_n_in(&mut rng, format, 12);
            let n_out = rng_rows(&mut rng) + 64;
            let w = Weight::random(&mut rng, format, n_out, n_in);
            let id = upload(&mut gpu, &w);
            for t in [4, 5, 67, 131] {
                let x = random_x(&mut rng, t, n_in);
                let got = gpu.matmul(&x, t, n_in, &[id]).expect("matmul");
                check(&format!("{gemm:?} {} t={t} [{n_out}, {n_in}]", format.name()), &[&w], &x, t, &got);
            }
            gpu.free(id);
        }
        let (n_out, n_in, t) = (300, 4096, 260);
        let w = Weight::random(&mut rng, Format::Q8x32, n_out, n_in);
        let id = upload(&mut gpu, &w);
        let x = random_x(&mut rng, t, n_in);
        let got = gpu.matmul(&x, t, n_in, &[id]).expect("matmul");
        check(&format!("{gemm:?} q8x32 [{n_out}, {n_in}] t={t}, split"), &[&w], &x, t, &got);
        gpu.free(id);
    }
}

/// A decoder block as a program, recorded on the device with `gemm_wide` on every product of 4
/// rows or more, gives the rows, keys and values of the CPU reference's op-by-op run: at t = 130
/// its products have 2 to 8 tiles, so each is split over k (2 to 4 runs) and the planes of
/// partial sums are added by `sum_planes`; then a token, unsplit. A block with head norms, norms
/// after attention and the feed-forward products, GELU and rotation by halves, and one with
/// biases, SiLU and rotation by pairs; matrices in every format. Tolerance: 1e-3 of each row's
/// rms; where the adapter offers cooperative matrices, the normed block again with `gemm_coop`
/// and `fast` products (f16 inputs), within 1e-2 (the other, with no norms after its products,
/// grows values past f16's range).
#[test]
fn programs_split_over_k_match_the_cpu() {
    let Some(mut gpu) = backend("programs_split_over_k_match_the_cpu") else { return };
    let mut cpu = CpuBackend::new();
    let mut rng = Rng::new("programs_split_over_k_match_the_cpu");
    let (e, ff, n_head, n_head_kv, hd, slots) = (256u32, 512u32, 4u32, 1u32, 64u32, 160u32);
    let (nq, nkv) = (n_head * hd, n_head_kv * hd);
    let coop = gpu.has_coop().then_some((Gemm::Coop, 1e-2, true));
    for (gemm, tolerance, normed) in [(Gemm::Wide, 1e-3, true), (Gemm::Wide, 1e-3, false)].into_iter().chain(coop) {
        gpu.set_gemm(gemm).expect("gemm");
        let precision = if gemm == Gemm::Coop { Precision::Fast } else { Precision::Exact };
        // The weights, each on both backends: (format, rows, columns), and f32 values of vectors.
        let mut weights: Vec<(Weight, u64, u64)> = Vec::new();
        let mut f = Format::ALL.iter().cycle().skip(rng.range(0, 4) as usize);
        let mut add = |rng: &mut Rng, format: Format, n_out: u32, n_in: u32| {
            let w = Weight::random(rng, format, n_out, n_in);
            let ids = (upload(&mut gpu, &w), upload(&mut cpu, &w));
            weights.push((w, ids.0, ids.1));
            weights.len() - 1
        };
        let mut mat = |rng: &mut Rng, n_out, n_in| add(rng, *f.next().unwrap(), n_out, n_in);
        let (wq, wk, wv, wo) = (mat(&mut rng, nq, e), mat(&mut rng, nkv, e), mat(&mut rng, nkv, e), mat(&mut rng, e, nq));
        let (gate, up, down) = (mat(&mut rng, ff, e), mat(&mut rng, ff, e), mat(&mut rng, e, ff));
        let mut vector = |rng: &mut Rng, n| add(rng, Format::F32, 1, n);
        let (attn_norm, ffn_norm) = (vector(&mut rng, e), vector(&mut rng, e));
        let eps = 1e-6;
        let norm = |x, weight, group| Op::RmsNorm { x, weight: Some(weight), offset: 0.0, group, eps };
        let mm = |x, weight| Op::Matmul { x, weight, precision };
        let (rotation, act) = if normed { (Rotation::Halves, Activation::GeluTanh) } else { (Rotation::Pairs, Activation::Silu) };
        let [after_q, after_k, after_o, after_down] = if normed {
            let (q, k) = (vector(&mut rng, hd), vector(&mut rng, hd));
            let (o, d) = (vector(&mut rng, e), vector(&mut rng, e));
            [norm(3, q, hd), norm(4, k, hd), norm(12, o, e), norm(19, d, e)]
        } else {
            let (q, k, o) = (vector(&mut rng, nq), vector(&mut rng, nkv), vector(&mut rng, e));
            [Op::Bias { x: 3, weight: q }, Op::Bias { x: 4, weight: k }, Op::Bias { x: 12, weight: o }, Op::Scale { x: 19, by: 1.0 }]
        };
        let ops = vec![
            Op::Input { width: e },
            Op::Input { width: hd },
            norm(0, attn_norm, e),
            mm(2, wq),
            mm(2, wk),
            mm(2, wv),
            after_q,
            after_k,
            Op::Rotate { x: 6, table: 1, head_dim: hd, rotation },
            Op::Rotate { x: 7, table: 1, head_dim: hd, rotation },
            Op::CacheWrite { k: 9, v: 5, cache: 0 },
            Op::Attention { q: 8, cache: 0, n_head, n_head_kv, head_dim: hd, window: 0, scale: 0.01, softcap: 0.0, precision },
            mm(11, wo),
            after_o,
            Op::Add(0, 13),
            norm(14, ffn_norm, e),
            mm(15, gate),
            mm(15, up),
            Op::Gated { gate: 16, up: 17, act },
            mm(18, down),
            after_down,
            Op::Add(14, 20),
            Op::Output(21),
            Op::Output(9),
            Op::Output(5),
        ];
        let refs = |on_gpu: bool| {
            let of = |(i, (w, g, c)): (usize, &(Weight, u64, u64))| WeightRef {
                rep: i as u32,
                id: if on_gpu { *g } else { *c },
                rows: w.n_out,
                cols: w.n_in,
                format: w.format,
            };
            weights.iter().enumerate().map(of).collect::<Vec<_>>()
        };
        let (on_gpu, on_cpu) = (program::check(ops.clone(), refs(true), 1).unwrap(), program::check(ops, refs(false), 1).unwrap());
        let vectors: Vec<Vec<f32>> =
            weights.iter().map(|(w, ..)| if w.format == Format::F32 && w.n_out == 1 { w.decoded.clone() } else { Vec::new() }).collect();
        let vectors: Vec<&[f32]> = vectors.iter().map(Vec::as_slice).collect();
        gpu.prepare_program(&on_gpu).expect("the program's pipelines");
        // The biased block's keys and values in two buffers (two cache writes), the others' in
        // one.
        gpu.set_joint_caches(normed);
        let caches = (gpu.create_cache(slots, nkv).expect("cache"), cpu.create_cache(slots, nkv).expect("cache"));
        for (t, pos) in [(130u32, 0u32), (1, 130)] {
            let x: Vec<f32> = (0..t * e).map(|_| rng.unit()).collect();
            let mut table = vec![0f32; (t * hd) as usize];
            for (r, row) in table.chunks_exact_mut(hd as usize).enumerate() {
                for j in 0..hd as usize / 2 {
                    let angle = (pos as usize + r) as f64 * 1e4f64.powf(-2.0 * j as f64 / hd as f64);
                    (row[j], row[hd as usize / 2 + j]) = (angle.cos() as f32, angle.sin() as f32);
                }
            }
            let inputs = vec![x, table];
            let batch = |cache| [SequenceRun { rows: t, start: pos, caches: vec![(cache, slots, nkv)] }];
            let got = gpu.run_program(&on_gpu, &inputs, &batch(caches.0)).expect("the run recorded").expect("the device's run");
            let want = program::run(&on_cpu, &mut cpu, &vectors, inputs.clone(), &batch(caches.1)).expect("the reference's run");
            let what = format!("{gemm:?}, {} block, t {t} at {pos}", if normed { "normed" } else { "biased" });
            for ((name, width), (got, want)) in [("x", e), ("keys", nkv), ("values", nkv)].into_iter().zip(got.iter().zip(&want)) {
                let (Output::Rows(got), Output::Rows(want)) = (got, want) else { panic!("{what}: {name}: not rows") };
                assert_eq!(got.len(), want.len(), "{what}: {name}: lengths");
                for (r, (g, c)) in got.chunks_exact(width as usize).zip(want.chunks_exact(width as usize)).enumerate() {
                    let rms = (c.iter().map(|v| v * v).sum::<f32>() / width as f32).sqrt();
                    let worst = g.iter().zip(c).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(worst <= tolerance * rms, "{what}: {name} row {r}: off by {worst}, rms {rms}");
                }
            }
        }
    }
}

/// The cooperative-matrix kernel (t >= 128 where the adapter offers 16x16x16 f16 matrices) gives
/// the CPU's results within f16 rounding of both inputs (2e-3 of sum |w x|), for every format,
/// on whole tiles (stored straight from the matrices) and ragged ones (through workgroup
/// memory). It runs where the adapter offers cooperative matrices (and WISP_COOP is not 0);
/// elsewhere (lavapipe, CI) it is skipped, saying so, and `WISP_REQUIRE_COOP=1` (bench/gpu.sh on
/// the GPU machine) makes that a failure.
#[test]
fn coop_gemm_matches_the_cpu() {
    let Some(mut gpu) = backend("coop_gemm_matches_the_cpu") else { return };
    if !gpu.has_coop() {
        let required = std::env::var("WISP_REQUIRE_COOP").is_ok_and(|v| v == "1");
        assert!(!required, "coop_gemm_matches_the_cpu: no cooperative matrices, and WISP_REQUIRE_COOP=1");
        println!("coop_gemm_matches_the_cpu: skipped: no cooperative matrices (none offered, or WISP_COOP=0)");
        return;
    }
    let mut rng = Rng::new("coop_gemm_matches_the_cpu");
    gpu.set_gemm(Gemm::Coop).expect("gemm");
    let mut shapes: Vec<(Format, u32, u32, u32)> = Format::ALL
        .iter()
        .map(|&f| (f, rng_rows(&mut rng) + 64, random_n_in(&mut rng, f, 12), 128 + rng.range(0, 200)))
        .collect();
    shapes.extend([(Format::Q8x32, 256, 512, 256), (Format::F32, 384, 4096, 128), (Format::Q4x32, 300, 4096, 260)]);
    for (format, n_out, n_in, t) in shapes {
        let w = Weight::random(&mut rng, format, n_out, n_in);
        let id = upload(&mut gpu, &w);
        let x = random_x(&mut rng, t, n_in);
        let got = gpu.matmul(&x, t, n_in, &[id]).expect("matmul");
        check_within(2e-3, &format!("coop {} t={t} [{n_out}, {n_in}]", format.name()), &[&w], &x, t, &got);
        gpu.free(id);
    }
}

/// Kernel-only rates of every kernel variant on the preferred adapter (timestamp queries): a
/// tuning aid for real GPUs, not a check. `cargo test --release -p wisp --test wgpu_backend --
/// --ignored --nocapture kernel_sweep`; WISP_SWEEP_N sets the GEMV size (default 8192),
/// WISP_SWEEP_M the GEMM size (default 4096), WISP_SWEEP_REPS the calls each rate is the best of
/// (default 10).
#[test]
#[ignore = "a benchmark: run by hand on a GPU"]
fn kernel_sweep() {
    let Some(mut gpu) = backend("kernel_sweep") else { return };
    let n: u32 = std::env::var("WISP_SWEEP_N").ok().and_then(|v| v.parse().ok()).unwrap_or(8192);
    let reps: u32 = std::env::var("WISP_SWEEP_REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let mut rng = Rng::new("kernel_sweep");
    let best_ns = |gpu: &mut WgpuBackend, x: &[f32], t: u32, n_in: u32, id: u64| {
        // GPUs idle at low clocks and take a while of steady work to raise them.
        gpu.set_kernel_repeats(10);
        let warm = Instant::now();
        while warm.elapsed().as_secs_f64() < 0.3 {
            gpu.matmul(x, t, n_in, &[id]).expect("matmul");
        }
        let mut best = u64::MAX;
        for _ in 0..reps {
            gpu.matmul(x, t, n_in, &[id]).expect("matmul");
            best = best.min(gpu.last_kernel_ns().unwrap_or(u64::MAX));
        }
        best as f64
    };
    let max_weight = gpu.device().map_or(0, |d| d.max_weight_bytes);
    for format in Format::ALL {
        if format.data_bytes(n as u64 * n as u64).is_none_or(|b| b > max_weight) {
            println!("sweep gemv {} [{n}, {n}]: over the device's largest weight", format.name());
            continue;
        }
        let w = Weight::random(&mut rng, format, n, n);
        let bytes = (w.data.len() + 4 * w.scales.len()) as f64;
        let id = upload(&mut gpu, &w);
        let x = random_x(&mut rng, 1, n);
        for lanes in [16, 32, 64] {
            gpu.set_gemv_lanes(lanes).expect("lanes");
            let ns = best_ns(&mut gpu, &x, 1, n, id);
            println!(
                "sweep gemv {} [{n}, {n}] lanes={lanes}: {:.1} us, {:.0} GB/s",
                format.name(),
                ns / 1e3,
                bytes / ns
            );
        }
        gpu.free(id);
    }
    gpu.set_gemv_lanes(32).expect("lanes");
    let m: u32 = std::env::var("WISP_SWEEP_M").ok().and_then(|v| v.parse().ok()).unwrap_or(4096);
    for format in [Format::F32, Format::Bf16, Format::Q8x32, Format::Q4x32] {
        let w = Weight::random(&mut rng, format, m, m);
        let id = upload(&mut gpu, &w);
        for t in [512, m] {
            let x = random_x(&mut rng, t, m);
            let coop = gpu.has_coop().then_some(Gemm::Coop);
            let large = gpu.has_large().then_some(Gemm::Large);
            for gemm in [Some(Gemm::Tiled), Some(Gemm::Wide), large, coop].into_iter().flatten() {
                gpu.set_gemm(gemm).expect("gemm");
                let ns = best_ns(&mut gpu, &x, t, m, id);
                let tflops = 2.0 * t as f64 * m as f64 * m as f64 / ns / 1e3;
                println!(
                    "sweep gemm {} [{m}, {m}] t={t} {gemm:?}: {:.1} us, {tflops:.1} TFLOP/s",
                    format.name(),
                    ns / 1e3
                );
            }
        }
        gpu.free(id);
    }
}

/// Calls timed end to end (wall clock, median of 20), in Gemma 3 270M's attention shape: a
/// decode step (t = 1) against kv-caches of 128, 512 and 2048 keys, attention over one key and a
/// [64, 64] product (a call's floor: the round trip), and a batch of 512 queries.
#[test]
#[ignore]
fn round_trip_sweep() {
    let Some(mut gpu) = backend("round_trip_sweep") else { return };
    let mut rng = Rng::new("round_trip_sweep");
    let (n_head, n_head_kv, head_dim) = (4u32, 1u32, 256u32);
    let width = n_head_kv * head_dim;
    let shape = |t, n_keys| AttentionShape { t, n_keys, n_head, n_head_kv, head_dim, window: 0, scale: 0.0625, softcap: 0.0 };
    let rows = |rng: &mut Rng, n: u32| -> Vec<f32> { (0..n).map(|_| rng.unit()).collect() };
    let median_us = |call: &mut dyn FnMut()| {
        let mut times: Vec<f64> = (0..20)
            .map(|_| {
                let start = Instant::now();
                call();
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        times.sort_by(f64::total_cmp);
        times[10]
    };
    let cache = gpu.create_cache(4096, width).expect("a cache");
    let mut pos = 0u32;
    for keys in [128u32, 512, 2048] {
        // The cache filled with keys - 1 rows, then a step that adds the last (each repeat
        // writes the same row again).
        let t = keys - 1 - pos;
        let (q, k) = (rows(&mut rng, t * n_head * head_dim), rows(&mut rng, t * width));
        gpu.attention_cached(&q, &k, &k, pos, cache, 0, &shape(t, pos + t)).expect("a prefill");
        pos += t;
        let (q, k) = (rows(&mut rng, n_head * head_dim), rows(&mut rng, width));
        let us = median_us(&mut || {
            gpu.attention_cached(&q, &k, &k, pos, cache, 0, &shape(1, keys)).expect("a decode step");
        });
        println!("sweep round trip: attention, decode at {keys} keys: {us:.0} us");
    }
    let (q, k) = (rows(&mut rng, n_head * head_dim), rows(&mut rng, width));
    let us = median_us(&mut || {
        attend(&mut gpu, &q, &k, &k, &shape(1, 1)).expect("one key");
    });
    println!("sweep round trip: attention over one key: {us:.0} us");
    let id = upload(&mut gpu, &Weight::random(&mut rng, Format::F32, 64, 64));
    let x = random_x(&mut rng, 1, 64);
    let us = median_us(&mut || {
        gpu.matmul(&x, 1, 64, &[id]).expect("a product");
    });
    println!("sweep round trip: [64, 64] product, t = 1: {us:.0} us");
    let t = 512;
    let (q, k) = (rows(&mut rng, t * n_head * head_dim), rows(&mut rng, t * width));
    let us = median_us(&mut || {
        attend(&mut gpu, &q, &k, &k, &shape(t, t)).expect("a batch");
    });
    println!("sweep round trip: attention, a batch of {t} queries: {us:.0} us");
}

/// A batch of sequences whose kv-caches share an arena (ranges of one buffer) writes and
/// attends them one dispatch a group over a table of its rows (`scatter_rows`, `attend_rows`):
/// with sequences of caches of their own buffers between them, prompts of several rows, a
/// sliding window whose ring wraps, a sequence's caches freed and new ones made in their range
/// mid-way, and the arena grown (its caches moved to a larger buffer) by a large cache made
/// mid-way, every row's output within 1e-3 of its rms of the CPU reference's, run after run
/// (products of few rows on `gemv` as GPUs run them).
#[test]
fn a_batch_over_shared_kv_cache_arenas_matches_the_cpu() {
    let Some(mut gpu) = backend("a_batch_over_shared_kv_cache_arenas_matches_the_cpu") else { return };
    let mut cpu = CpuBackend::new();
    let mut rng = Rng::new("a_batch_over_shared_kv_cache_arenas_matches_the_cpu");
    gpu.set_gemm(Gemm::GPU).expect("gemm");
    let (e, n_head, n_head_kv, hd, window) = (64u32, 4u32, 2u32, 32u32, 5u32);
    let (nq, nkv) = (n_head * hd, n_head_kv * hd);
    let mut weights: Vec<(Weight, u64, u64)> = Vec::new();
    for (i, n_out) in [nq, nkv, nkv].into_iter().enumerate() {
        let format = Format::ALL[(i + rng.range(0, 4) as usize) % Format::ALL.len()];
        let w = Weight::random(&mut rng, format, n_out, e);
        let ids = (upload(&mut gpu, &w), upload(&mut cpu, &w));
        weights.push((w, ids.0, ids.1));
    }
    let precision = Precision::Exact;
    let attention = |cache, window| Op::Attention { q: 1, cache, n_head, n_head_kv, head_dim: hd, window, scale: 0.1, softcap: 0.0, precision };
    let ops = vec![
        Op::Input { width: e },
        Op::Matmul { x: 0, weight: 0, precision },
        Op::Matmul { x: 0, weight: 1, precision },
        Op::Matmul { x: 0, weight: 2, precision },
        Op::CacheWrite { k: 2, v: 3, cache: 0 },
        attention(0, 0),
        Op::CacheWrite { k: 2, v: 3, cache: 1 },
        attention(1, window),
        Op::Output(5),
        Op::Output(7),
    ];
    let refs = |on_gpu: bool| {
        let of = |(i, (w, g, c)): (usize, &(Weight, u64, u64))| WeightRef { rep: i as u32, id: if on_gpu { *g } else { *c }, rows: w.n_out, cols: w.n_in, format: w.format };
        weights.iter().enumerate().map(of).collect::<Vec<_>>()
    };
    let (on_gpu, on_cpu) = (program::check(ops.clone(), refs(true), 2).unwrap(), program::check(ops, refs(false), 2).unwrap());
    gpu.prepare_program(&on_gpu).expect("the program's pipelines");
    // (slots of the whole cache, of the windowed one): each sequence's caches on both sides.
    let slots = (48u32, 12u32);
    let make = |gpu: &mut WgpuBackend, cpu: &mut CpuBackend, joint: bool| {
        gpu.set_joint_caches(joint);
        [slots.0, slots.1].map(|n| (gpu.create_cache(n, nkv).expect("cache"), cpu.create_cache(n, nkv).expect("cache")))
    };
    // Sequences 1 and 3 keep their caches in buffers of their own.
    let mut seqs: Vec<([(u64, u64); 2], u32)> = (0..6).map(|s| (make(&mut gpu, &mut cpu, s != 1 && s != 3), 0)).collect();
    assert_eq!(gpu.arena_sizes().len(), 1, "the joint caches in one arena");
    let mut large = None;
    for run in 0..5 {
        if run == 3 {
            // 32 MiB of keys and values: past the first arena's room.
            let before = gpu.arena_sizes();
            large = Some(gpu.create_cache(1 << 16, nkv).expect("a large cache"));
            let after = gpu.arena_sizes();
            assert!(after.len() == 1 && after[0] > before[0], "the arena grown: {before:?} -> {after:?}");
        }
        if run == 2 {
            // Sequence 2 starts again in new caches, in the range its old ones held.
            for (g, c) in seqs[2].0 {
                gpu.free_cache(g);
                cpu.free_cache(c);
            }
            seqs[2] = (make(&mut gpu, &mut cpu, true), 0);
        }
        let rows: Vec<u32> = (0..seqs.len()).map(|s| [3, 1, 7, 2, 1, 4][(s + run) % 6]).collect();
        let total: u32 = rows.iter().sum();
        let x: Vec<f32> = (0..total * e).map(|_| rng.unit()).collect();
        let batch = |gpu_side: bool| -> Vec<SequenceRun> {
            seqs.iter().zip(&rows).map(|((c, start), &rows)| {
                let caches = c.iter().zip([slots.0, slots.1]).map(|(&(g, cc), n)| (if gpu_side { g } else { cc }, n, nkv)).collect();
                SequenceRun { rows, start: *start, caches }
            }).collect()
        };
        let got = gpu.run_program(&on_gpu, std::slice::from_ref(&x), &batch(true)).expect("the run recorded").expect("the device's run");
        let want = program::run(&on_cpu, &mut cpu, &[], vec![x], &batch(false)).expect("the reference's run");
        for (name, (got, want)) in ["attention", "windowed attention"].into_iter().zip(got.iter().zip(&want)) {
            let (Output::Rows(got), Output::Rows(want)) = (got, want) else { panic!("{name}: not rows") };
            assert_eq!(got.len(), want.len(), "run {run}: {name}: lengths");
            for (r, (g, c)) in got.chunks_exact(nq as usize).zip(want.chunks_exact(nq as usize)).enumerate() {
                let rms = (c.iter().map(|v| v * v).sum::<f32>() / nq as f32).sqrt();
                let worst = g.iter().zip(c).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst <= 1e-3 * rms, "run {run}: {name} row {r}: off by {worst}, rms {rms}");
            }
        }
        for (s, r) in seqs.iter_mut().zip(&rows) {
            s.1 += r;
        }
    }
    gpu.free_cache(large.expect("made"));
    assert_eq!(gpu.arena_sizes().len(), 1, "a freed range taken again");
}

/// On GPUs a product of 4 to 64 rows of x with few tiles runs `gemv` a row: each row's outputs
/// bit for bit those of the row alone, every format, ragged numbers of rows and columns
/// included, so that a batched decode step's products do not depend on the other rows.
#[test]
fn products_of_few_rows_are_each_row_alone_bit_for_bit() {
    let Some(mut gpu) = backend("products_of_few_rows_are_each_row_alone_bit_for_bit") else { return };
    let mut rng = Rng::new("products_of_few_rows_are_each_row_alone_bit_for_bit");
    gpu.set_gemm(Gemm::GPU).expect("gemm");
    for format in Format::ALL {
        let (n_out, n_in) = (rng.range(1, 900), random_n_in(&mut rng, format, 12));
        let w = Weight::random(&mut rng, format, n_out, n_in);
        let id = upload(&mut gpu, &w);
        for t in [4, 5, 31, 64] {
            let x = random_x(&mut rng, t, n_in);
            let got = gpu.matmul(&x, t, n_in, &[id]).expect("matmul");
            check_within(TOLERANCE, &format!("{} t={t} [{n_out}, {n_in}]", format.name()), &[&w], &x, t, &got);
            for (r, row) in x.chunks_exact(n_in as usize).enumerate() {
                let alone = gpu.matmul(row, 1, n_in, &[id]).expect("matmul");
                let batched = &got[0][r * n_out as usize..(r + 1) * n_out as usize];
                assert!(batched.iter().zip(&alone[0]).all(|(a, b)| a.to_bits() == b.to_bits()), "{} [{n_out}, {n_in}] t={t}: row {r} differs from the row alone", format.name());
            }
        }
        gpu.free(id);
    }
}

/// A weight past one binding (here a binding capped at 128 KiB) is held in parts, each a
/// buffer of whole rows: written in pieces that cross the parts, its products, alone and in a
/// program (where each part's columns are placed among the whole product's), are the CPU's for
/// every format and batch size; past the parts' total it is refused naming the limit.
#[test]
fn weights_past_one_binding_are_held_in_parts() {
    let Some(mut gpu) = backend("weights_past_one_binding_are_held_in_parts") else { return };
    let mut rng = Rng::new("weights_past_one_binding_are_held_in_parts");
    let cap = 128 << 10;
    gpu.cap_binding(cap);
    let max = gpu.device().expect("a device").max_weight_bytes;
    assert!(max > cap, "the weights the device takes: {max}");
    for format in Format::ALL {
        // Outputs of 32 rows still fit one binding.
        let n_in = 1024;
        let n_out = rng.range(600, 1000);
        let w = Weight::random(&mut rng, format, n_out, n_in);
        assert!(w.data.len() as u64 > 2 * cap, "{}: {} bytes, not past two bindings", format.name(), w.data.len());
        // Written in three pieces at random rows.
        let id = gpu.create(format, n_out, n_in).expect("create");
        let (a, b) = (rng.range(1, n_out / 2), rng.range(n_out / 2 + 1, n_out - 1));
        for (from, to) in [(0, a), (a, b), (b, n_out)] {
            let (rb, rs) = (w.row_bytes(), w.row_scales());
            let (from, to) = (from as usize, to as usize);
            gpu.write_rows(id, from as u32, &w.data[from * rb..to * rb], &w.scales[from * rs..to * rs]).expect("write_rows");
        }
        let refs = |id| vec![WeightRef { rep: 0, id, rows: n_out, cols: n_in, format }];
        let ops = vec![Op::Input { width: n_in }, Op::Matmul { x: 0, weight: 0, precision: Precision::Exact }, Op::Output(1)];
        let on_gpu = program::check(ops.clone(), refs(id), 0).unwrap();
        gpu.prepare_program(&on_gpu).expect("the program's pipelines");
        for t in [1, 7, 32] {
            let x = random_x(&mut rng, t, n_in);
            let what = format!("{} [{n_out}, {n_in}] in parts of {cap} bytes, t {t}", format.name());
            let got = gpu.matmul(&x, t, n_in, &[id]).expect("matmul");
            check(&what, &[&w], &x, t, &got);
            let run = [SequenceRun { rows: t, start: 0, caches: vec![] }];
            let out = gpu.run_program(&on_gpu, &[x.clone()], &run).expect("the run recorded").expect("the device's run");
            let [Output::Rows(rows)] = out.as_slice() else { panic!("{what}: not one output of rows") };
            check(&format!("{what}, as a program"), &[&w], &x, t, &[rows.clone()]);
        }
        gpu.free(id);
    }
    match gpu.create(Format::F32, (max / 4096 + 1) as u32, 1024) {
        Err(GpuError::OutOfMemory(m)) if m.contains(&format!("the device's limit is {max}")) => {}
        other => panic!("a weight past every part: want out-of-memory naming {max}, got {other:?}"),
    }
}
