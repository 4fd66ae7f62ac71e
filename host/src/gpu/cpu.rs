//! A reference implementation of the `gpu` interface on the host's CPU: it decodes every upload
//! format to f32 and multiplies plainly. It defines what the device backends must compute, and
//! lets the guest's device path be tested on any machine.

use super::{AttentionShape, Backend, BufferId, Device, Format, GpuError};
use std::collections::HashMap;

struct Weight {
    n_out: usize,
    n_in: usize,
    format: Format,
    /// `[n_out, n_in]`, decoded.
    w: Vec<f32>,
}

/// The CPU reference backend: every weight is decoded to f32 when written, and `matmul` is a
/// plain loop of dot products. Slow; it is the plainest reading of the contract, and the wgpu
/// backend's tests compare their products with its.
#[derive(Default)]
pub struct CpuBackend {
    weights: HashMap<BufferId, Weight>,
    caches: HashMap<BufferId, KvRing>,
    next: BufferId,
}

/// A `kv-cache` in host memory, as the host's CPU devices (this reference and the native one)
/// keep it: `slots` rows of `width` keys and as many values, position `p` in row `p % slots`.
pub(super) struct KvRing {
    pub slots: usize,
    pub width: usize,
    /// `[slots, width]`.
    pub k: Vec<f32>,
    /// `[slots, width]`.
    pub v: Vec<f32>,
}

impl KvRing {
    /// A zeroed ring, or `out-of-memory` where the host has not the memory.
    pub fn new(slots: u32, width: u32) -> Result<KvRing, GpuError> {
        let n = slots as usize * width as usize;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        if k.try_reserve_exact(n).is_err() || v.try_reserve_exact(n).is_err() {
            return Err(GpuError::OutOfMemory(format!("a kv-cache of 2 x {n} values")));
        }
        k.resize(n, 0.0);
        v.resize(n, 0.0);
        Ok(KvRing { slots: slots as usize, width: width as usize, k, v })
    }

    /// Where position `p`'s row starts in `k` and `v`.
    pub fn row(&self, p: u64) -> usize {
        (p % self.slots as u64) as usize * self.width
    }

    /// The whole rows `k_new` and `v_new` at the rows of positions `first..`.
    pub fn write(&mut self, first: u32, k_new: &[f32], v_new: &[f32]) {
        let w = self.width;
        for (r, (kr, vr)) in k_new.chunks_exact(w).zip(v_new.chunks_exact(w)).enumerate() {
            let at = self.row(first as u64 + r as u64);
            self.k[at..at + w].copy_from_slice(kr);
            self.v[at..at + w].copy_from_slice(vr);
        }
    }
}

/// The `kv-cache` `id` of `caches`, or `invalid-argument`.
pub(super) fn ring(caches: &mut HashMap<BufferId, KvRing>, id: BufferId) -> Result<&mut KvRing, GpuError> {
    caches.get_mut(&id).ok_or_else(|| GpuError::InvalidArgument(format!("no kv-cache {id}")))
}

impl CpuBackend {
    /// A backend holding no weights. Its device, "wisp CPU reference", accepts weights of up to
    /// 4 GiB and activations of up to 2^28 f32; its memory is the process's.
    pub fn new() -> Self {
        Self::default()
    }
}

/// Decodes `rows` whole rows of `n_in` elements of `format` into `out`.
pub fn decode_rows(format: Format, n_in: usize, data: &[u8], scales: &[f32], out: &mut [f32]) {
    match format {
        Format::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Format::Bf16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        Format::Q8x32 | Format::Q8x16 => {
            let g = format.block() as usize;
            for (i, o) in out.iter_mut().enumerate() {
                *o = scales[i / g] * data[i] as i8 as f32;
            }
        }
        Format::Q4x32 => {
            for (i, o) in out.iter_mut().enumerate() {
                let q = (data[i / 2] >> (4 * (i % 2))) & 0xF;
                let b = i / 32;
                *o = scales[2 * b] * q as f32 - scales[2 * b + 1];
            }
        }
    }
    debug_assert_eq!(out.len() % n_in, 0);
}

/// Attention as the contract reads (see `wit/gpu.wit`), with sums in f64: for each query and
/// head, the softmax of the scaled (and soft-capped, in f64) products with the keys it sees,
/// then their weighted sum of the values. `q`, `k` and `v` have the lengths `s` implies.
pub fn attention_reference(q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape) -> Vec<f32> {
    let hd = s.head_dim as usize;
    let (nq, nkv) = (s.n_head as usize * hd, s.n_head_kv as usize * hd);
    let group = (s.n_head / s.n_head_kv) as usize;
    let mut out = vec![0f32; q.len()];
    for i in 0..s.t {
        let keys = s.keys_of(i);
        for h in 0..s.n_head as usize {
            let at = i as usize * nq + h * hd;
            let (qh, g) = (&q[at..at + hd], h / group * hd);
            let scores: Vec<f64> = keys
                .clone()
                .map(|j| s.scale as f64 * qh.iter().zip(&k[j * nkv + g..]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>())
                .map(|e| if s.softcap > 0.0 { s.softcap as f64 * (e / s.softcap as f64).tanh() } else { e })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for (d, o) in out[at..at + hd].iter_mut().enumerate() {
                let sum: f64 = keys.clone().zip(&weights).map(|(j, w)| w * v[j * nkv + g + d] as f64).sum();
                *o = (sum / total) as f32;
            }
        }
    }
    out
}

impl Backend for CpuBackend {
    fn device(&self) -> Option<Device> {
        Some(Device {
            name: "wisp CPU reference".into(),
            backend: "cpu".into(),
            device_type: "cpu".into(),
            max_weight_bytes: 1 << 32,
            max_activation_elements: 1 << 28,
        })
    }

    fn create(&mut self, format: Format, n_out: u32, n_in: u32) -> Result<BufferId, GpuError> {
        let n = n_out as usize * n_in as usize;
        let mut w = Vec::new();
        w.try_reserve_exact(n).map_err(|_| GpuError::OutOfMemory(format!("{n} weights")))?;
        w.resize(n, 0.0);
        let id = self.next;
        self.next += 1;
        self.weights.insert(id, Weight { n_out: n_out as usize, n_in: n_in as usize, format, w });
        Ok(id)
    }

    fn write_rows(&mut self, id: BufferId, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), GpuError> {
        let w = self.weights.get_mut(&id).ok_or_else(|| GpuError::InvalidArgument(format!("no buffer {id}")))?;
        let row_bytes = w.format.data_bytes(w.n_in as u64).unwrap_or(0) as usize;
        let rows = data.len() / row_bytes;
        let start = first_row as usize * w.n_in;
        decode_rows(w.format, w.n_in, data, scales, &mut w.w[start..start + rows * w.n_in]);
        Ok(())
    }

    fn matmul(&mut self, x: &[f32], t: u32, n_in: u32, jobs: &[BufferId]) -> Result<Vec<Vec<f32>>, GpuError> {
        let n_in = n_in as usize;
        jobs.iter()
            .map(|id| {
                let w = self.weights.get(id).ok_or_else(|| GpuError::InvalidArgument(format!("no buffer {id}")))?;
                let mut y = vec![0f32; t as usize * w.n_out];
                for (xr, yr) in x.chunks_exact(n_in).zip(y.chunks_exact_mut(w.n_out)) {
                    for (o, wr) in yr.iter_mut().zip(w.w.chunks_exact(n_in)) {
                        *o = wr.iter().zip(xr).map(|(a, b)| a * b).sum();
                    }
                }
                Ok(y)
            })
            .collect()
    }

    fn free(&mut self, id: BufferId) {
        self.weights.remove(&id);
    }

    fn create_cache(&mut self, slots: u32, width: u32) -> Result<BufferId, GpuError> {
        let ring = KvRing::new(slots, width)?;
        let id = self.next;
        self.next += 1;
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
        // The shape's keys in order of position, then attention as the contract reads it.
        let keys: Vec<usize> = (0..shape.n_keys as u64).map(|j| c.row(first_key as u64 + j)).collect();
        let gather = |m: &[f32]| keys.iter().flat_map(|&at| m[at..at + c.width].iter().copied()).collect::<Vec<f32>>();
        Ok(attention_reference(q, &gather(&c.k), &gather(&c.v), shape))
    }
}
