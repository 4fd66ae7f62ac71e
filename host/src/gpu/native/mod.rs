//! The native CPU device: the `gpu` interface on the host's own CPU, at its full vector width
//! and on every core the host gives it. It runs programs with the op core's interpreter
//! ([`super::program::run`]); its products, cache writes and attention are its own (the
//! private `kernels` module): weights kept in their upload formats, `exact` products in f32 and `fast` ones
//! over int8 activations, the rows of each product split over a pool of threads (each weight
//! read once a pass, whatever the number of sequences), attention split by head.
//!
//! Where the guest's own kernels are wasm's 128-bit vectors on one core, this device is what a
//! native host offers on a machine without a GPU, as ggml's CPU backend is llama.cpp's.

mod kernels;

use super::cpu::{KvRing, ring};
use super::{Activation, AttentionShape, Backend, BufferId, Device, Format, GpuError, Precision};
use kernels::{Isa, Quantized, Stored};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// A weight: its shape, and its values as [`Stored`].
struct Matrix {
    n_out: usize,
    n_in: usize,
    stored: Stored,
    /// Whether its form was chosen since its last write ([`Matrix::settle`]).
    settled: bool,
    /// Rows written so far (counted again where rewritten): once every row may have been,
    /// the weight settles, at load rather than in its first product.
    written: u64,
}

impl Matrix {
    /// Once written, a weight takes its own form: a `q8x32` weight of five-bit values (a GGUF
    /// Q5_0 or Q4_0 tensor) keeps five bits a value ([`Stored::Q5`]), which a decode step,
    /// reading every weight from memory, streams a third faster, and one of other values its
    /// bytes ([`Stored::Q8G`]); a `q4x32` weight of Q4_K's scales keeps them as its six-bit
    /// integers ([`Stored::Q4K`]), a fifth smaller; a `q8x16` one of Q6_K's values and scales
    /// six bits a value ([`Stored::Q6K`]), a third smaller. Each with its rows interleaved
    /// eight at a time, as their kernels read them.
    fn settle(&mut self) {
        if !self.settled {
            if let Some(c) = self.stored.compacted(self.n_in) {
                self.stored = c;
            }
            self.settled = true;
        }
    }
}

/// The native CPU device.
pub struct NativeBackend {
    weights: HashMap<BufferId, Matrix>,
    caches: HashMap<BufferId, KvRing>,
    next: BufferId,
    /// The workers; `None` for one thread (the caller's).
    pool: Option<Arc<rayon::ThreadPool>>,
    threads: usize,
    isa: Isa,
}

/// The physical cores of this machine (logical CPUs sharing a core counted once), as far as
/// the system tells; at least 1.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_os = "linux")]
    if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
        // Distinct (physical id, core id) pairs.
        let mut cores = std::collections::HashSet::new();
        let (mut phys, mut core) = (None, None);
        for line in info.lines() {
            let value = || line.split(':').nth(1).map(|v| v.trim().to_string());
            if line.starts_with("physical id") {
                phys = value();
            } else if line.starts_with("core id") {
                core = value();
            } else if line.trim().is_empty() {
                if let (Some(p), Some(c)) = (phys.take(), core.take()) {
                    cores.insert((p, c));
                }
            }
        }
        if !cores.is_empty() {
            return cores.len().min(logical);
        }
    }
    logical
}

/// A process-wide pool of `threads` workers, made on first use (instances of a server share
/// it); a later call with another count gets a pool of its own.
fn pool(threads: usize) -> Result<Arc<rayon::ThreadPool>, GpuError> {
    static POOL: OnceLock<(usize, Arc<rayon::ThreadPool>)> = OnceLock::new();
    let make = || {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("wisp-native-{i}"))
            .build()
            .map(Arc::new)
            .map_err(|e| GpuError::Unavailable(format!("cannot start {threads} worker threads: {e}")))
    };
    if let Some((n, p)) = POOL.get() {
        return if *n == threads { Ok(p.clone()) } else { make() };
    }
    let p = make()?;
    Ok(POOL.get_or_init(|| (threads, p.clone())).1.clone())
}

/// Bytes of one uploaded row of `n_in` values for a weight kept as `s` (its upload format's).
fn format_bytes(s: &Stored, n_in: usize) -> u64 {
    match s {
        Stored::F32(_) => 4 * n_in as u64,
        Stored::Bf16(_) => 2 * n_in as u64,
        Stored::Q8 { .. } | Stored::Q5 { .. } | Stored::Q6K { .. } | Stored::Q8G { .. } => n_in as u64,
        Stored::Q4 { .. } | Stored::Q4K { .. } | Stored::Q4G { .. } => n_in as u64 / 2,
    }
}

impl NativeBackend {
    /// The device on `threads` threads (0: one a physical core), with the best kernels this CPU
    /// runs.
    pub fn new(threads: usize) -> Result<NativeBackend, GpuError> {
        Self::with_isa(threads, Isa::detect())
    }

    /// As [`NativeBackend::new`] with the kernels of `isa` (for tests: [`Isa::Scalar`] runs
    /// everywhere).
    pub(crate) fn with_isa(threads: usize, isa: Isa) -> Result<NativeBackend, GpuError> {
        let threads = if threads == 0 { physical_cores() } else { threads };
        let pool = if threads > 1 { Some(pool(threads)?) } else { None };
        Ok(NativeBackend { weights: HashMap::new(), caches: HashMap::new(), next: 1, pool, threads, isa })
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on the pool (or here, with one thread).
    fn on_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }

    fn id(&mut self) -> BufferId {
        self.next += 1;
        self.next - 1
    }

    fn matrix(&self, id: BufferId) -> Result<&Matrix, GpuError> {
        self.weights.get(&id).ok_or_else(|| GpuError::InvalidArgument(format!("no buffer {id}")))
    }

    /// `y[t, n_out] = x[t, n_in] @ W^T` for each weight of `ms` (all of `n_in` values a row),
    /// over the pool in one parallel region: each task a run of one weight's rows against every
    /// row of x (a decode step's products of one value, a layer's query, key and value, are
    /// one fork and join rather than three).
    fn products_of(&self, ms: &[&Matrix], x: &[f32], t: usize, precision: Precision) -> Vec<Vec<f32>> {
        if t == 0 {
            return vec![Vec::new(); ms.len()];
        }
        // x as each weight's kernels read it, made once a layout: quantized for `fast`,
        // reordered for `exact` where the weight decodes in the q4x32 layout.
        let n_in = ms.first().map_or(0, |m| m.n_in);
        let mut quantized: Vec<((usize, bool), Quantized)> = Vec::new();
        let mut reordered: Option<Vec<f32>> = None;
        for m in ms {
            match m.stored.x_layout() {
                Some(l) if precision == Precision::Fast => {
                    if !quantized.iter().any(|(have, _)| *have == l) {
                        quantized.push((l, self.quantize(x, n_in, t, l)));
                    }
                }
                Some((_, true)) if reordered.is_none() => reordered = Some(kernels::reorder_q4(x, n_in)),
                _ => {}
            }
        }
        // Runs of weight rows: about four a thread, whole groups of 8; each task's output
        // `[t, rows]`, copied into place after.
        let per_of = |m: &Matrix| if self.pool.is_some() { m.n_out.div_ceil(self.threads * 4).next_multiple_of(8).max(16) } else { m.n_out.max(1) };
        let tasks: Vec<(usize, usize)> = ms.iter().enumerate().flat_map(|(k, m)| (0..m.n_out.div_ceil(per_of(m))).map(move |c| (k, c))).collect();
        let isa = self.isa;
        let task = |&(k, c): &(usize, usize)| {
            let m = ms[k];
            let per = per_of(m);
            let rows = c * per..((c + 1) * per).min(m.n_out);
            let mut out = vec![0f32; t * rows.len()];
            let layout = m.stored.x_layout();
            // Quantized where `fast` made x for this layout (only `fast` makes any).
            match quantized.iter().find(|(l, _)| Some(*l) == layout) {
                Some((_, q)) => fast_rows(isa, m, rows, q, t, &mut out),
                None => {
                    let xs = if layout.is_some_and(|(_, q4)| q4) { reordered.as_deref().unwrap_or(x) } else { x };
                    exact_rows(isa, m, rows, xs, t, &mut out)
                }
            }
            out
        };
        let tiles: Vec<Vec<f32>> = if self.pool.is_some() && tasks.len() > 1 {
            self.on_pool(|| tasks.par_iter().map(task).collect())
        } else {
            tasks.iter().map(task).collect()
        };
        let mut ys: Vec<Vec<f32>> = vec![Vec::new(); ms.len()];
        for (&(k, c), tile) in tasks.iter().zip(tiles) {
            let (m, per) = (ms[k], per_of(ms[k]));
            if m.n_out <= per {
                // One task: its tile is the whole product.
                ys[k] = tile;
                continue;
            }
            let y = &mut ys[k];
            if y.is_empty() {
                *y = vec![0f32; m.n_out * t];
            }
            let width = tile.len() / t;
            for (r, row) in tile.chunks_exact(width).enumerate() {
                y[r * m.n_out + c * per..][..width].copy_from_slice(row);
            }
        }
        ys
    }

    /// [`kernels::quantize`] of `t` rows of x, their runs over the pool where there are many
    /// (each row's values are its own: the same bytes however the rows are split).
    fn quantize(&self, x: &[f32], n_in: usize, t: usize, layout: (usize, bool)) -> Quantized {
        const MIN_ROWS: usize = 16;
        if self.pool.is_none() || t < MIN_ROWS {
            return kernels::quantize(self.isa, x, n_in, layout);
        }
        let per = t.div_ceil(self.threads).max(MIN_ROWS / 2);
        let isa = self.isa;
        let parts: Vec<Quantized> = self.on_pool(|| x.par_chunks(per * n_in).map(|rows| kernels::quantize(isa, rows, n_in, layout)).collect());
        let mut all = Quantized { block: layout.0, q: Vec::with_capacity(x.len()), s: Vec::new(), c: Vec::new(), pairs: Vec::new() };
        for p in parts {
            all.q.extend_from_slice(&p.q);
            all.s.extend_from_slice(&p.s);
            all.c.extend_from_slice(&p.c);
            all.pairs.extend_from_slice(&p.pairs);
        }
        all
    }

    /// Attention of `q` over cache `c`'s positions `first_key..`, split by head over the pool.
    fn attend(&self, c: &KvRing, first_key: u32, q: &[f32], s: &AttentionShape) -> Vec<f32> {
        let (hd, n_head) = (s.head_dim as usize, s.n_head as usize);
        let group = n_head / s.n_head_kv as usize;
        let width = n_head * hd;
        let t = s.t as usize;
        let isa = self.isa;
        let head = |h: usize| {
            let mut out = vec![0f32; t * hd];
            let mut scores = Vec::with_capacity(s.n_keys as usize);
            let g = h / group * hd;
            for i in 0..t {
                let qh = &q[i * width + h * hd..][..hd];
                let keys = s.keys_of(i as u32);
                let row = |j: usize| c.row(first_key as u64 + j as u64) + g;
                scores.clear();
                scores.extend(keys.clone().map(|j| s.score(dot(isa, qh, &c.k[row(j)..][..hd]))));
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0f32;
                for e in scores.iter_mut() {
                    *e = (*e - max).exp();
                    total += *e;
                }
                let o = &mut out[i * hd..][..hd];
                for (j, &e) in keys.zip(&scores) {
                    axpy(isa, e / total, &c.v[row(j)..][..hd], o);
                }
            }
            out
        };
        let heads: Vec<Vec<f32>> = if self.pool.is_some() && n_head > 1 {
            self.on_pool(|| (0..n_head).into_par_iter().map(head).collect())
        } else {
            (0..n_head).map(head).collect()
        };
        let mut out = vec![0f32; t * width];
        for (h, v) in heads.iter().enumerate() {
            for i in 0..t {
                out[i * width + h * hd..][..hd].copy_from_slice(&v[i * hd..][..hd]);
            }
        }
        out
    }
}

/// `fast` products of weight rows `rows` against the `t` rows of `x`: `out[r * rows.len() + o
/// - rows.start]`.
fn fast_rows(isa: Isa, m: &Matrix, rows: std::ops::Range<usize>, x: &Quantized, t: usize, out: &mut [f32]) {
    let (n_in, width, first) = (m.n_in, rows.len(), rows.start);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only chosen where the CPU has AVX2 and FMA.
        Isa::Avx2 => unsafe { kernels::avx2::fast_rows(&m.stored, rows, n_in, x, t, out, width) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2Vnni` is only chosen where the CPU has AVX2, FMA and AVX-VNNI.
        Isa::Avx2Vnni => unsafe { kernels::avx2::fast_rows_vnni(&m.stored, rows, n_in, x, t, out, width) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512Vnni` is only chosen where the CPU has AVX2, FMA and AVX-512 F,
        // BW, VL and VNNI.
        Isa::Avx512Vnni => unsafe { kernels::avx2::fast_rows_avx512(&m.stored, rows, n_in, x, t, out, width) },
        _ => {
            for o in rows {
                for r in 0..t {
                    out[r * width + o - first] = kernels::scalar::fast(&m.stored, o, n_in, x, r);
                }
            }
        }
    }
}

/// Rows of x below which `exact` products decode each weight as they read it (a decode step),
/// and from which they decode rows once into a scratch buffer for a tile of x (a prefill). The
/// two ways sum each pair of rows alike, to the same bits.
const FUSED_MAX_T: usize = 4;

/// `exact` products of weight rows `rows` against the `t` rows of `x` (in the layout the
/// format's decoding gives): `out[r * rows.len() + o - rows.start]`.
fn exact_rows(isa: Isa, m: &Matrix, rows: std::ops::Range<usize>, x: &[f32], t: usize, out: &mut [f32]) {
    let (n_in, width, first) = (m.n_in, rows.len(), rows.start);
    if let Some(k) = kernels::Groups::of(&m.stored) {
        // A weight of interleaved rows: its own kernel, for every count of rows (its groups'
        // order of sums).
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx512Vnni` is only chosen where the CPU has AVX2, FMA and AVX-512
            // F and VL.
            Isa::Avx512Vnni => unsafe { kernels::avx2::exact_groups_avx512(k, rows, n_in, x, t, out, width) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every `Isa` but `Scalar` is only chosen where the CPU has AVX2 and FMA.
            _ if isa.avx2() => unsafe { kernels::avx2::exact_groups(k, rows, n_in, x, t, out, width) },
            _ => {
                for o in rows {
                    for r in 0..t {
                        out[r * width + o - first] = kernels::scalar::exact_group(&m.stored, o, n_in, &x[r * n_in..][..n_in]);
                    }
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() && t < FUSED_MAX_T && matches!(m.stored, Stored::Q8 { .. } | Stored::Q4 { .. }) {
        use kernels::avx2::exact_fused;
        let mut y = [0f32; 8];
        for r in 0..t {
            let xr = &x[r * n_in..][..n_in];
            let mut o = rows.start;
            while o < rows.end {
                // Four weight rows a call: eight decoded Gemma 3 270M 7% slower on a Zen 4
                // (streams through memory, as `fast`'s one-row kernel found).
                let nw = if rows.end - o >= 4 { 4 } else { 1 };
                // SAFETY: every `Isa` but `Scalar` is only chosen where the CPU has AVX2 and FMA.
                unsafe {
                    match nw {
                        4 => exact_fused::<4>(&m.stored, o, n_in, xr, &mut y),
                        _ => exact_fused::<1>(&m.stored, o, n_in, xr, &mut y),
                    }
                }
                for j in 0..nw {
                    out[r * width + o + j - first] = y[j];
                }
                o += nw;
            }
        }
        return;
    }
    // f32 rows are read where they are; the others decoded, four rows at a time.
    let plain = match &m.stored {
        Stored::F32(v) => Some(v),
        _ => None,
    };
    let mut w = vec![0f32; if plain.is_some() { 0 } else { 4 * n_in }];
    for tile in (0..t).step_by(kernels::X_TILE) {
        let tile = tile..(tile + kernels::X_TILE).min(t);
        let mut o = rows.start;
        while o < rows.end {
            let nw = (rows.end - o).min(4);
            if plain.is_none() {
                for j in 0..nw {
                    let dst = &mut w[j * n_in..][..n_in];
                    match isa {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: every `Isa` but `Scalar` is only chosen where the CPU has AVX2
                        // and FMA.
                        _ if isa.avx2() => unsafe { kernels::avx2::decode(&m.stored, o + j, n_in, dst) },
                        _ => kernels::scalar::decode(&m.stored, o + j, n_in, dst),
                    }
                }
            }
            let wr = |j: usize| match plain {
                Some(v) => &v[(o + j) * n_in..][..n_in],
                None => &w[j * n_in..][..n_in],
            };
            let mut r = tile.start;
            while r < tile.end {
                // Four rows of x a call where AVX-512's registers hold the tile.
                let nr = if isa == Isa::Avx512Vnni && nw == 4 && tile.end - r >= 4 { 4 } else { (tile.end - r).min(2) };
                let mut y = [0f32; 16];
                let xr = |i: usize| &x[(r + i) * n_in..][..n_in];
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above, and `Isa::Avx512Vnni` only where the CPU has AVX-512
                    // F and VL.
                    Isa::Avx512Vnni if nr == 4 => unsafe {
                        kernels::avx2::exact_avx512::<4, 4>([wr(0), wr(1), wr(2), wr(3)], [xr(0), xr(1), xr(2), xr(3)], &mut y)
                    },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    _ if isa.avx2() => unsafe {
                        use kernels::avx2::exact;
                        match (nw, nr) {
                            (4, 2) => exact::<4, 2>([wr(0), wr(1), wr(2), wr(3)], [xr(0), xr(1)], &mut y),
                            (4, _) => exact::<4, 1>([wr(0), wr(1), wr(2), wr(3)], [xr(0)], &mut y),
                            (_, 2) => {
                                for j in 0..nw {
                                    exact::<1, 2>([wr(j)], [xr(0), xr(1)], &mut y[j * 2..]);
                                }
                            }
                            _ => {
                                for j in 0..nw {
                                    exact::<1, 1>([wr(j)], [xr(0)], &mut y[j..]);
                                }
                            }
                        }
                    },
                    _ => {
                        for j in 0..nw {
                            for i in 0..nr {
                                y[j * nr + i] = kernels::scalar::exact(wr(j), xr(i));
                            }
                        }
                    }
                }
                for j in 0..nw {
                    for i in 0..nr {
                        out[(r + i) * width + o + j - first] = y[j * nr + i];
                    }
                }
                r += nr;
            }
            o += nw;
        }
    }
}

/// `a . b` in eight f32 lanes, then their sum.
fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    #[inline(always)]
    fn plain(a: &[f32], b: &[f32]) -> f32 {
        let mut lanes = [0f32; 8];
        let whole = a.len() / 8 * 8;
        for (x, y) in a[..whole].chunks_exact(8).zip(b[..whole].chunks_exact(8)) {
            for l in 0..8 {
                lanes[l] += x[l] * y[l];
            }
        }
        let mut s = kernels::scalar::sum8(&lanes);
        for (x, y) in a[whole..].iter().zip(&b[whole..]) {
            s += x * y;
        }
        s
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn wide(a: &[f32], b: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let n = a.len().min(b.len());
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut k = 0;
        // SAFETY: every load reads 8 f32 at `k..k + 8 <= n`, inside both slices.
        unsafe {
            while k + 16 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(k)), _mm256_loadu_ps(b.as_ptr().add(k)), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(k + 8)), _mm256_loadu_ps(b.as_ptr().add(k + 8)), s1);
                k += 16;
            }
            if k + 8 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(k)), _mm256_loadu_ps(b.as_ptr().add(k)), s0);
                k += 8;
            }
        }
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(s0, s1)) };
        let mut s = kernels::scalar::sum8(&lanes);
        for (x, y) in a[k..n].iter().zip(&b[k..n]) {
            s = x.mul_add(*y, s);
        }
        s
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: every `Isa` but `Scalar` is only chosen where the CPU has AVX2 and FMA.
        _ if isa.avx2() => unsafe { wide(a, b) },
        _ => plain(a, b),
    }
}

/// `y += a * x`.
fn axpy(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    #[inline(always)]
    fn plain(a: f32, x: &[f32], y: &mut [f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y += a * x;
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn wide(a: f32, x: &[f32], y: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = x.len().min(y.len());
        let av = _mm256_set1_ps(a);
        let mut k = 0;
        // SAFETY: every load and store covers 8 f32 at `k..k + 8 <= n`, inside both slices.
        unsafe {
            while k + 8 <= n {
                let v = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(k)), _mm256_loadu_ps(y.as_ptr().add(k)));
                _mm256_storeu_ps(y.as_mut_ptr().add(k), v);
                k += 8;
            }
        }
        for (y, x) in y[k..n].iter_mut().zip(&x[k..n]) {
            *y = a.mul_add(*x, *y);
        }
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot`.
        _ if isa.avx2() => unsafe { wide(a, x, y) },
        _ => plain(a, x, y),
    }
}

impl Backend for NativeBackend {
    fn device(&self) -> Option<Device> {
        Some(Device {
            name: format!("native CPU ({}, {} threads)", self.isa.name(), self.threads),
            backend: "native".into(),
            device_type: "cpu".into(),
            // The host's memory is the limit: an allocation that fails is `out-of-memory`.
            max_weight_bytes: 1 << 40,
            max_activation_elements: 1 << 28,
        })
    }

    fn create(&mut self, format: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        let n = n_out as usize * n_in as usize;
        let stored = Stored::zeroed(format, n).ok_or_else(|| GpuError::OutOfMemory(format!("a {} weight of {n} values", format.name())))?;
        let id = self.id();
        self.weights.insert(id, Matrix { n_out: n_out as usize, n_in: n_in as usize, stored, settled: false, written: 0 });
        Ok(id)
    }

    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        let w = self.weights.get_mut(&id).ok_or_else(|| GpuError::InvalidArgument(format!("no buffer {id}")))?;
        if let Some(full) = w.stored.expanded(w.n_in) {
            w.stored = full;
        }
        w.stored.write(first_row as usize * w.n_in, data, scales);
        w.settled = false;
        let rows = data.len() as u64 / format_bytes(&w.stored, w.n_in).max(1);
        // Once, as the count first reaches every row (the load); rewrites after it settle at
        // the next product, so that writing a row at a time does not compact the whole weight
        // each time.
        let before = w.written;
        w.written = w.written.saturating_add(rows);
        if before < w.n_out as u64 && w.written >= w.n_out as u64 {
            w.settle();
        }
        Ok(())
    }

    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        self.matmul_ops(jobs, x, t, n_in, Precision::Exact)
    }

    fn matmul_op(&mut self, id: BufferId, x: &[f32], t: u32, n_in: u32, precision: Precision) -> Result<Vec<f32>, GpuError> {
        let mut ys = self.matmul_ops(&[id], x, t, n_in, precision)?;
        ys.pop().ok_or_else(|| GpuError::InvalidArgument("a product of no weight".into()))
    }

    fn matmul_ops(&mut self, ids: &[BufferId], x: &[f32], t: u32, _n_in: u32, precision: Precision) -> Result<Vec<Vec<f32>>, GpuError> {
        for id in ids {
            if let Some(m) = self.weights.get_mut(id) {
                m.settle();
            }
        }
        let ms = ids.iter().map(|&id| self.matrix(id)).collect::<Result<Vec<_>, _>>()?;
        Ok(self.products_of(&ms, x, t as usize, precision))
    }

    fn free(&mut self, id: BufferId) {
        self.weights.remove(&id);
    }

    fn gated(&mut self, act: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
        // Runs of 64 Ki values over the pool (each value its own: the same whatever the split).
        const RUN: usize = 1 << 16;
        let n = gate.len().min(up.len());
        let mut out = vec![0f32; n];
        let isa = self.isa;
        if self.pool.is_some() && n > RUN {
            self.on_pool(|| {
                out.par_chunks_mut(RUN).enumerate().for_each(|(i, o)| {
                    let at = i * RUN;
                    kernels::gated(isa, act, &gate[at..at + o.len()], &up[at..at + o.len()], o)
                })
            });
        } else {
            kernels::gated(isa, act, gate, up, &mut out);
        }
        out
    }

    fn create_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        let ring = KvRing::new(slots, width)?;
        let id = self.id();
        self.caches.insert(id, ring);
        Ok(id)
    }

    fn free_cache(&mut self, id: BufferId) {
        self.caches.remove(&id);
    }

    fn write_cache(&mut self, id: BufferId, first: u32, k_new: &[f32], v_new: &[f32]) -> Result<(), GpuError> {
        ring(&mut self.caches, id)?.write(first, k_new, v_new);
        Ok(())
    }

    fn attention_cached(
        &mut self,
        q: &[f32],
        k_new: &[f32],
        v_new: &[f32],
        first_new: u32,
        cache: BufferId,
        first_key: u32,
        shape: &AttentionShape,
    ) -> Result<Vec<f32>, GpuError> {
        let c = ring(&mut self.caches, cache)?;
        c.write(first_new, k_new, v_new);
        Ok(self.attend(&self.caches[&cache], first_key, q, shape))
    }
}

#[cfg(test)]
mod tests;
