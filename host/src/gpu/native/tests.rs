#![cfg(test)]
//! The native device's kernels against the CPU reference and each other.

use super::kernels::Isa;
use super::*;
use crate::gpu::CpuBackend;

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// In -1..1.
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A random weight `[n_out, n_in]` of `format`: its upload bytes and scales. `n_in` past 10000
/// (`FIVE_BITS` added) makes a `q8x32` weight of values in -16..=15, which the native device
/// keeps in five bits, and a `q4x32` one of Q4_K's scales (each superblock's an f32 times
/// six-bit integers), which it keeps as those integers where rows are whole superblocks.
fn weight(rng: &mut Rng, format: Format, n_out: usize, marked: usize) -> (Vec<u8>, Vec<f32>) {
    let n = n_out * (marked % FIVE_BITS);
    let data = match format {
        Format::F32 => (0..n).flat_map(|_| rng.f().to_le_bytes()).collect(),
        Format::Bf16 => (0..n).flat_map(|_| ((rng.f().to_bits() >> 16) as u16).to_le_bytes()).collect(),
        Format::Q8x32 if five_bits(marked) => (0..n).map(|_| ((rng.next() % 32) as i8 - 16) as u8).collect(),
        Format::Q8x16 if five_bits(marked) => (0..n).map(|_| ((rng.next() % 64) as i8 - 32) as u8).collect(),
        _ => rng.bytes(format.data_bytes(n as u64).unwrap() as usize),
    };
    let mut scales: Vec<f32> = (0..format.scale_count(n as u64)).map(|i| if format == Format::Q4x32 && i % 2 == 1 { rng.f() * 0.1 } else { rng.f().abs() * 0.05 + 0.001 }).collect();
    if format == Format::Q4x32 && five_bits(marked) {
        // Superblocks of eight blocks: `[d, m]` each, `d = s sc` and `m = s' mn` with `s` of
        // f16's eleven bits (as GGUF keeps it) and six-bit integers: the largest 63 (as
        // llama.cpp quantizes), or below it (every third), or every min 0 (every fifth).
        for (k, sb) in scales.chunks_mut(16).enumerate() {
            for half in 0..2 {
                let s = f32::from_bits((rng.f().abs() * 0.01 + 1e-4).to_bits() & !0x1FFF);
                let top = if k % 3 == 2 { 40 } else { 63 };
                let zero = half == 1 && k % 5 == 4;
                for b in 0..8 {
                    let i = if b == k % 8 { top } else { rng.next() % (top + 1) };
                    // (A last superblock may be short where rows are not whole ones.)
                    if let Some(v) = sb.get_mut(2 * b + half) {
                        *v = if zero { 0.0 } else { s * i as f32 };
                    }
                }
            }
        }
    }
    if format == Format::Q8x16 && five_bits(marked) {
        // Q6_K's: superblocks of sixteen blocks, `d = s sc` with `s` of f16's eleven bits and
        // signed bytes, the largest in magnitude -128 (as llama.cpp quantizes), or below it
        // (every third).
        for (k, sb) in scales.chunks_mut(16).enumerate() {
            let s = f32::from_bits((rng.f() * 0.01).to_bits() & !0x1FFF);
            let top = if k % 3 == 2 { 100 } else { 128 };
            for (b, v) in sb.iter_mut().enumerate() {
                let i = if b == k % 16 { -top } else { (rng.next() % (2 * top as u64 - 1)) as i64 - top + 1 };
                *v = s * i as f32;
            }
        }
    }
    (data, scales)
}

/// Whether the native device keeps a case's weight in a form of its own: a `q8x32` one always
/// (five bits where its values fit, else its bytes with rows interleaved), a `q4x32` one
/// always (Q4_K's integer scales where they are those, else its own, rows interleaved), Q6_K's
/// six bits (`q8x16`) where rows are whole superblocks.
fn compact(format: Format, marked: usize) -> bool {
    matches!(format, Format::Q8x32 | Format::Q4x32) || (five_bits(marked) && (marked % FIVE_BITS) % kernels::SUPER == 0)
}

/// Whether a weight is held in a compact form ([`compact`]).
fn compacted(s: &Stored) -> bool {
    matches!(s, Stored::Q5 { .. } | Stored::Q4K { .. } | Stored::Q6K { .. } | Stored::Q8G { .. } | Stored::Q4G { .. })
}

fn upload(b: &mut dyn Backend, format: Format, n_out: usize, n_in: usize, data: &[u8], scales: &[f32]) -> BufferId {
    let id = b.create(format, n_out as u32, n_in as u32).unwrap();
    // In two writes, to cover rows written after the first.
    let half = n_out / 2;
    let row = format.data_bytes(n_in as u64).unwrap() as usize;
    let srow = format.scale_count(n_in as u64) as usize;
    b.write_rows(id, 0, &data[..half * row], &scales[..half * srow]).unwrap();
    b.write_rows(id, half as u32, &data[half * row..], &scales[half * srow..]).unwrap();
    id
}

/// Marks a `q8x32` case's width as one of five-bit values (see [`weight`]).
const FIVE_BITS: usize = 100_000;

fn five_bits(n_in: usize) -> bool {
    n_in > FIVE_BITS
}

/// Each format at widths with and without a lone last block (q4x32 pairs, q8x16 chunks of 32),
/// and at f32 widths that leave a tail past whole vectors; `q8x32` also with five-bit values.
/// Returns each case's format, width, and the `n_in` to give it (`FIVE_BITS` added where so).
fn cases() -> Vec<(Format, usize)> {
    vec![
        (Format::F32, 64),
        (Format::F32, 37),
        (Format::Bf16, 45),
        (Format::Q8x32, 96),
        (Format::Q8x32, FIVE_BITS + 96),
        (Format::Q8x32, FIVE_BITS + 128),
        (Format::Q8x16, 80),
        (Format::Q8x16, 64),
        (Format::Q8x16, FIVE_BITS + 512),
        (Format::Q4x32, 128),
        (Format::Q4x32, 96),
        (Format::Q4x32, FIVE_BITS + 512),
        // Q4_K's scales in rows that are not whole superblocks: kept as uploaded.
        (Format::Q4x32, FIVE_BITS + 160),
    ]
}

/// Every kernel set this CPU runs: the plain one, AVX2 + FMA, and AVX2 with AVX-VNNI's or
/// AVX-512 VNNI's products where it has them.
fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Scalar];
    if Isa::detect().avx2() {
        v.push(Isa::Avx2);
        // AVX-VNNI's kernels also where `detect` prefers AVX-512's (a CPU with both).
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avxvnni") {
            v.push(Isa::Avx2Vnni);
        }
        if Isa::detect() == Isa::Avx512Vnni {
            v.push(Isa::Avx512Vnni);
        }
    } else if std::env::var("CI").is_ok_and(|v| v == "true") && cfg!(target_arch = "x86_64") {
        panic!("CI=true: this x86-64 CPU offers no AVX2 + FMA, so the vector kernels are not tested");
    }
    v
}

#[test]
fn exact_products_match_the_cpu_reference_and_each_isa_the_same_bits() {
    let mut rng = Rng(7);
    for (format, marked) in cases() {
        let (n_out, n_in) = (37, marked % FIVE_BITS);
        let (data, scales) = weight(&mut rng, format, n_out, marked);
        let mut reference = CpuBackend::new();
        let rid = upload(&mut reference, format, n_out, n_in, &data, &scales);
        for t in [1, 2, 5, 40] {
            let x: Vec<f32> = (0..t * n_in).map(|_| rng.f()).collect();
            let want = reference.matmul(&x, t as u32, n_in as u32, &[rid]).unwrap().remove(0);
            let mut bits = None;
            for isa in isas() {
                for threads in [1, 3] {
                    let mut b = NativeBackend::with_isa(threads, isa).unwrap();
                    let id = upload(&mut b, format, n_out, n_in, &data, &scales);
                    let got = b.matmul_op(id, &x, t as u32, n_in as u32, Precision::Exact).unwrap();
                    assert_eq!(compacted(&b.weights[&id].stored), compact(format, marked), "{} {marked}: the form kept", format.name());
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let row = &x[i / n_out * n_in..][..n_in];
                        let scale: f32 = row.iter().map(|v| v.abs()).sum::<f32>() + 1.0;
                        assert!((g - w).abs() <= 1e-5 * scale, "{} n_in {n_in} t {t} {isa:?}: {g} against {w}", format.name());
                    }
                    // The same bits whatever the kernels' width and the threads.
                    let b2: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(bits.get_or_insert(b2.clone()), &b2, "{} {isa:?} {threads} threads", format.name());
                }
            }
        }
    }
}

#[test]
fn a_rows_exact_and_fast_products_do_not_depend_on_the_batch() {
    let mut rng = Rng(11);
    for (format, marked) in cases() {
        let (n_out, n_in) = (21, marked % FIVE_BITS);
        let (data, scales) = weight(&mut rng, format, n_out, marked);
        // 33 rows: past the count from which x's quantization splits over the threads.
        let x: Vec<f32> = (0..33 * n_in).map(|_| rng.f()).collect();
        for isa in isas() {
            let mut b = NativeBackend::with_isa(2, isa).unwrap();
            let id = upload(&mut b, format, n_out, n_in, &data, &scales);
            for precision in [Precision::Exact, Precision::Fast] {
                let all = b.matmul_op(id, &x, 33, n_in as u32, precision).unwrap();
                for r in 0..33 {
                    let alone = b.matmul_op(id, &x[r * n_in..][..n_in], 1, n_in as u32, precision).unwrap();
                    assert_eq!(alone, all[r * n_out..][..n_out], "{} {isa:?} {precision:?} row {r}", format.name());
                }
            }
        }
    }
}

#[test]
fn fast_products_are_within_the_int8_rounding_of_exact_ones() {
    let mut rng = Rng(3);
    for (format, marked) in cases().into_iter().filter(|c| !matches!(c.0, Format::F32 | Format::Bf16)) {
        let (n_out, n_in) = (19, marked % FIVE_BITS);
        let (data, scales) = weight(&mut rng, format, n_out, marked);
        let mut reference = CpuBackend::new();
        let rid = upload(&mut reference, format, n_out, n_in, &data, &scales);
        let mut plain = NativeBackend::with_isa(1, Isa::Scalar).unwrap();
        let pid = upload(&mut plain, format, n_out, n_in, &data, &scales);
        let mut dense = vec![0f32; n_out * n_in];
        for (o, row) in dense.chunks_exact_mut(n_in).enumerate() {
            plain.weights[&pid].stored.decode_row(o, n_in, row);
        }
        let t = 6;
        let x: Vec<f32> = (0..t * n_in).map(|_| rng.f() * 3.0).collect();
        let exact = reference.matmul(&x, t as u32, n_in as u32, &[rid]).unwrap().remove(0);
        let mut first: Option<Vec<f32>> = None;
        for isa in isas() {
            let mut b = NativeBackend::with_isa(1, isa).unwrap();
            let id = upload(&mut b, format, n_out, n_in, &data, &scales);
            let fast = b.matmul_op(id, &x, t as u32, n_in as u32, Precision::Fast).unwrap();
            for (i, (f, e)) in fast.iter().zip(&exact).enumerate() {
                let (r, o) = (i / n_out, i % n_out);
                let (xr, wr) = (&x[r * n_in..][..n_in], &dense[o * n_in..][..n_in]);
                // Each x value moves by at most half its block's step, amax / 254.
                let block = kernels::block_of(format);
                let bound: f32 = xr
                    .chunks(block)
                    .zip(wr.chunks(block))
                    .map(|(xb, wb)| xb.iter().fold(0f32, |a, v| a.max(v.abs())) / 254.0 * wb.iter().map(|w| w.abs()).sum::<f32>())
                    .sum();
                assert!((f - e).abs() <= bound * 1.01 + 1e-4, "{} {isa:?} [{r}, {o}]: {f} against {e} (bound {bound})", format.name());
            }
            // The vector kernels sum the same integers as the plain ones, in another order.
            if let Some(first) = &first {
                for (a, b) in fast.iter().zip(first) {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{} {isa:?}: {a} against the scalar {b}", format.name());
                }
            } else {
                first = Some(fast);
            }
        }
    }
}

#[test]
fn fast_products_with_avx_vnni_are_the_avx2_bits() {
    // The same integer sums (AVX2 sums pairs in 16 bits first, within range), the same f32
    // arithmetic after them: the same bits, for every format, batch size and thread count.
    let vnni: Vec<Isa> = isas().into_iter().filter(|i| matches!(i, Isa::Avx2Vnni | Isa::Avx512Vnni)).collect();
    if vnni.is_empty() {
        eprintln!("this CPU has no AVX-VNNI or AVX-512 VNNI ({:?}): nothing to compare", Isa::detect());
        return;
    }
    let mut rng = Rng(13);
    for (format, marked) in cases().into_iter().filter(|c| !matches!(c.0, Format::F32 | Format::Bf16)) {
        let (n_out, n_in) = (23, marked % FIVE_BITS);
        let (data, scales) = weight(&mut rng, format, n_out, marked);
        for t in [1, 3, 4, 9, 40] {
            let x: Vec<f32> = (0..t * n_in).map(|_| rng.f() * 4.0).collect();
            let mut results = Vec::new();
            let runs = [(Isa::Avx2, 1)].into_iter().chain(vnni.iter().flat_map(|&v| [(v, 1), (v, 3)]));
            for (isa, threads) in runs {
                let mut b = NativeBackend::with_isa(threads, isa).unwrap();
                let id = upload(&mut b, format, n_out, n_in, &data, &scales);
                let y = b.matmul_op(id, &x, t as u32, n_in as u32, Precision::Fast).unwrap();
                results.push(y.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
            }
            assert!(results.iter().all(|r| *r == results[0]), "{} {marked} t {t}", format.name());
        }
    }
}

#[test]
fn x_quantizes_to_the_same_bytes_with_every_isa() {
    let mut rng = Rng(17);
    for (block, q4, n_in) in [(32, false, 96), (16, false, 80), (32, true, 128), (32, true, 96)] {
        let t = 5;
        let mut x: Vec<f32> = (0..t * n_in).map(|_| rng.f() * 9.0).collect();
        // Blocks of zeros, a NaN, infinities, halves that round away from zero, tiny values.
        x[..block].fill(0.0);
        x[n_in + 3] = f32::NAN;
        x[2 * n_in + 1] = f32::INFINITY;
        x[2 * n_in + block + 2] = f32::NEG_INFINITY;
        for (i, v) in x[3 * n_in..4 * n_in].iter_mut().enumerate() {
            *v = (i as f32 - 40.0) * 0.5;
        }
        for v in &mut x[4 * n_in..] {
            *v *= 1e-30;
        }
        let plain = kernels::quantize(Isa::Scalar, &x, n_in, (block, q4));
        for isa in isas() {
            let q = kernels::quantize(isa, &x, n_in, (block, q4));
            assert_eq!(q.q, plain.q, "{isa:?} block {block} q4 {q4}");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&q.s), bits(&plain.s), "{isa:?} block {block} q4 {q4}");
            assert_eq!(bits(&q.c), bits(&plain.c), "{isa:?} block {block} q4 {q4}");
            assert_eq!(bits(&q.pairs), bits(&plain.pairs), "{isa:?} block {block} q4 {q4}");
        }
    }
}

#[test]
fn attention_matches_the_reference_over_a_ring_with_windows_and_groups() {
    let mut rng = Rng(5);
    let (n_head, n_head_kv, hd) = (4u32, 2u32, 16u32);
    let width = (n_head_kv * hd) as usize;
    // The last two soft-capped (Gemma 2), the cap tight enough to bite.
    for (t, start, window, slots, softcap) in [(1u32, 9u32, 0u32, 16u32, 0.0f32), (5, 3, 0, 16, 0.0), (3, 20, 6, 8, 0.3), (7, 0, 0, 7, 0.5)] {
        let (first, n_keys) = {
            let f = wisp_ops::first_key(start, window);
            (f, start + t - f)
        };
        let shape = AttentionShape { t, n_keys, n_head, n_head_kv, head_dim: hd, window, scale: 0.25, softcap };
        let k: Vec<f32> = (0..(start + t) as usize * width).map(|_| rng.f()).collect();
        let v: Vec<f32> = (0..(start + t) as usize * width).map(|_| rng.f()).collect();
        let q: Vec<f32> = (0..(t * n_head * hd) as usize).map(|_| rng.f()).collect();
        let mut want = None;
        let run = |b: &mut dyn Backend| {
            let c = b.create_cache(slots, width as u32).unwrap();
            // The history first (the ring keeps its last `slots` positions), then the queries'.
            let before = start as usize * width;
            for p in 0..start as usize {
                b.write_cache(c, p as u32, &k[p * width..][..width], &v[p * width..][..width]).unwrap();
            }
            b.attention_cached(&q, &k[before..], &v[before..], start, c, first, &shape).unwrap()
        };
        let reference = run(&mut CpuBackend::new());
        for isa in isas() {
            let got = run(&mut NativeBackend::with_isa(2, isa).unwrap());
            for (g, w) in got.iter().zip(&reference) {
                assert!((g - w).abs() < 1e-5, "t {t} start {start} window {window} {isa:?}: {g} against {w}");
            }
            want.get_or_insert(got);
        }
    }
}

#[test]
#[ignore = "a timing, not a test: cargo test --release -p wisp --lib native_speed -- --ignored --nocapture (SHAPE, T, ISA, THREADS pick)"]
fn native_speed() {
    let mut rng = Rng(1);
    let threads: usize = std::env::var("THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    // Widths as `weight` reads them: q8x32 of five-bit values (Gemma's Q5_0 layers), q4x32 of
    // Q4_K's scales, q8x16 of Q6_K's values and scales (Qwen 1.5B's `ffn_down`).
    let shapes = [(Format::Q8x32, 2048, 640), (Format::Q4x32, 2048, 640), (Format::Q8x16, 640, 2048), (Format::Q8x32, 262144, 640), (Format::Q8x32, 2048, FIVE_BITS + 640), (Format::Q4x32, 2048, 1536), (Format::Q4x32, 2048, FIVE_BITS + 1536), (Format::Q4x32, 1536, 8960), (Format::Q4x32, 1536, FIVE_BITS + 8960), (Format::Q8x16, 1536, 8960), (Format::Q8x16, 1536, FIVE_BITS + 8960)];
    let only: Option<usize> = std::env::var("SHAPE").ok().and_then(|v| v.parse().ok());
    for (i, &(format, n_out, marked)) in shapes.iter().enumerate() {
        if only.is_some_and(|o| o != i) {
            continue;
        }
        let (data, scales) = weight(&mut rng, format, n_out, marked);
        let n_in = marked % FIVE_BITS;
        // ISA=avx2, vnni, avx512 or scalar: those kernels (on a CPU that has them).
        let isa = match std::env::var("ISA").as_deref() {
            Ok("avx2") => Isa::Avx2,
            Ok("vnni") => Isa::Avx2Vnni,
            Ok("avx512") => Isa::Avx512Vnni,
            Ok("scalar") => Isa::Scalar,
            _ => Isa::detect(),
        };
        let mut b = NativeBackend::with_isa(threads, isa).unwrap();
        let id = upload(&mut b, format, n_out, n_in, &data, &scales);
        if let Ok(m) = std::fs::read_to_string("/proc/self/smaps_rollup") {
            println!("  {}", m.lines().filter(|l| l.contains("AnonHuge") || l.starts_with("Rss")).collect::<Vec<_>>().join("; "));
        }
        if let Stored::Q8 { q, .. } = &b.weights[&id].stored {
            for _ in 0..3 {
                let start = std::time::Instant::now();
                let sum: i64 = q.chunks(4096).map(|c| c.iter().map(|&v| v as i32).sum::<i32>() as i64).sum();
                let s = start.elapsed().as_secs_f64();
                println!("  streaming the weight's {} bytes: {:.1} GB/s ({sum})", q.len(), q.len() as f64 / s / 1e9);
            }
        }
        let only_t: Option<usize> = std::env::var("T").ok().and_then(|v| v.parse().ok());
        for t in [1usize, 32, 128] {
            if (n_out > 100_000 && t > 32) || only_t.is_some_and(|o| o != t) {
                continue;
            }
            let x: Vec<f32> = (0..t * n_in).map(|_| rng.f()).collect();
            for precision in [Precision::Exact, Precision::Fast] {
                let runs = if n_out > 100_000 { 5 } else if t == 1 { 200 } else { 10 };
                b.matmul_op(id, &x, t as u32, n_in as u32, precision).unwrap();
                let start = std::time::Instant::now();
                for _ in 0..runs {
                    b.matmul_op(id, &x, t as u32, n_in as u32, precision).unwrap();
                }
                let s = start.elapsed().as_secs_f64() / runs as f64;
                let q = std::time::Instant::now();
                if precision == Precision::Fast {
                    for _ in 0..runs {
                        std::hint::black_box(kernels::quantize(isa, &x, n_in, b.weights[&id].stored.x_layout().unwrap()));
                    }
                }
                let qs = q.elapsed().as_secs_f64() / runs as f64;
                let form = match format {
                    _ if !five_bits(marked) => "",
                    Format::Q8x32 => " (five bits)",
                    Format::Q4x32 => " (Q4_K scales)",
                    _ => " (Q6_K's six bits)",
                };
                println!("{}{form} [{n_out}, {n_in}] t {t} {precision:?}: {:.1} GMAC/s ({:.3} ms, quantize {:.3} ms)", format.name(), (t * n_out * n_in) as f64 / s / 1e9, s * 1e3, qs * 1e3);
            }
        }
    }
}

#[test]
fn gated_activations_match_the_op_cores_formula() {
    let mut rng = Rng(9);
    let mut gate: Vec<f32> = (0..1000).map(|_| rng.f() * 12.0).collect();
    gate.extend([0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e-30, -1e-30, f32::MAX, f32::MIN]);
    let up: Vec<f32> = gate.iter().map(|_| rng.f() * 2.0).collect();
    for act in [Activation::GeluTanh, Activation::Silu] {
        for isa in isas() {
            let mut out = vec![0f32; gate.len()];
            kernels::gated(isa, act, &gate, &up, &mut out);
            for ((&g, &u), &o) in gate.iter().zip(&up).zip(&out) {
                let want = act.apply(g) * u;
                let tol = 8.0 * f32::EPSILON * want.abs() + 1e-30;
                let same = o == want || (o.is_nan() && want.is_nan()) || (o - want).abs() <= tol;
                // Past f32's range the vector form may saturate where the formula overflows.
                assert!(same || !want.is_finite(), "{act:?} {isa:?} at {g}: {o} against {want}");
            }
        }
    }
}

#[test]
fn a_compacted_weight_written_again_takes_the_new_values() {
    let mut rng = Rng(13);
    let n_out = 8;
    for (format, n_in) in [(Format::Q8x32, 96), (Format::Q4x32, 512), (Format::Q8x16, 256)] {
        let (data, scales) = weight(&mut rng, format, n_out, FIVE_BITS + n_in);
        // Rows 2..5 again: values past five bits, scales of no superblock's integers.
        let (row, srow) = (format.data_bytes(n_in as u64).unwrap() as usize, format.scale_count(n_in as u64) as usize);
        let wide = rng.bytes(row * 3);
        let loose: Vec<f32> = (0..srow * 3).map(|_| rng.f().abs() * 0.05 + 0.001).collect();
        let x: Vec<f32> = (0..2 * n_in).map(|_| rng.f()).collect();
        for isa in isas() {
            let mut reference = CpuBackend::new();
            let mut b = NativeBackend::with_isa(1, isa).unwrap();
            let (rid, id) = (upload(&mut reference, format, n_out, n_in, &data, &scales), upload(&mut b, format, n_out, n_in, &data, &scales));
            for round in 0..2 {
                for precision in [Precision::Exact, Precision::Fast] {
                    let got = b.matmul_op(id, &x, 2, n_in as u32, precision).unwrap();
                    let want = reference.matmul(&x, 2, n_in as u32, &[rid]).unwrap().remove(0);
                    // `fast`'s int8 rounding of x against rows of values to 127: far below
                    // what a stale row would be off by.
                    let tol = if precision == Precision::Exact { 1e-4 } else { 0.1 };
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{} round {round} {isa:?} {precision:?}: {g} against {w}", format.name());
                    }
                }
                // The compact form, then (values past five bits, scales of no superblock's
                // integers) a q8x32 weight's bytes and a q4x32 one's own scales, rows
                // interleaved; the other as uploaded.
                let stored = &b.weights[&id].stored;
                let form = match (format, round) {
                    (Format::Q8x32, 0) => matches!(stored, Stored::Q5 { .. }),
                    (Format::Q8x32, _) => matches!(stored, Stored::Q8G { .. }),
                    (Format::Q4x32, 0) => matches!(stored, Stored::Q4K { .. }),
                    (Format::Q4x32, _) => matches!(stored, Stored::Q4G { .. }),
                    (_, 0) => compacted(stored),
                    _ => !compacted(stored),
                };
                assert!(form, "{} round {round}", format.name());
                reference.write_rows(rid, 2, &wide, &loose).unwrap();
                b.write_rows(id, 2, &wide, &loose).unwrap();
            }
        }
    }
}
