//! Where each batch of matrix products runs. Today: the guest's CPU kernels; the products are
//! grouped by input (q/k/v, gate/up) so that the input is prepared once per batch.

use crate::kernels::{self, QActs};
use crate::models::{Linear, WeightData};

/// Counters of what ran where.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    pub cpu_matmuls: u64,
    pub cpu_flops: u64,
    pub gpu_calls: u64,
    pub gpu_flops: u64,
    pub gpu_ns: u64,
    pub gpu_fallbacks: u64,
}

/// Per-session dispatcher: scratch for the quantized input, and counters.
#[derive(Default)]
pub struct Dispatch {
    acts: QActs,
    pub counters: Counters,
}

impl Dispatch {
    /// For each `(W, y)` in `jobs`: `y[t, n_out] = x[t, n_in] @ W^T`. Every `W` has `n_in`
    /// columns.
    pub fn matmul(&mut self, x: &[f32], t: usize, jobs: &mut [(&Linear, &mut [f32])]) {
        let Some(n_in) = jobs.first().map(|(w, _)| w.n_in) else { return };
        debug_assert!(jobs.iter().all(|(w, y)| w.n_in == n_in && y.len() >= t * w.n_out));
        let x = &x[..t * n_in];
        if jobs.iter().any(|(w, _)| matches!(w.w, WeightData::Q(_))) {
            self.acts.quantize(x, t, n_in);
        }
        for (w, y) in jobs.iter_mut() {
            let y = &mut y[..t * w.n_out];
            match &w.w {
                WeightData::Q(q) => kernels::matmul_q(q, &self.acts, y),
                WeightData::F32(f) => kernels::matmul_f32(f, w.n_out, w.n_in, x, t, y),
            }
            self.counters.cpu_matmuls += 1;
            self.counters.cpu_flops += w.flops(t);
        }
    }
}
