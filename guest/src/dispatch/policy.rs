//! The policy: whether a batch runs on the device or the CPU, from rates measured on this
//! machine ([`calibrate`] at load, then running averages of what ran), and what a failed call
//! leaves behind.
//!
//! Pure decisions over [`Gpu`]'s state, apart from the device calls and the cache bookkeeping
//! of `Dispatch`, so that they can be tested against a fake device.

use super::{Device, DeviceError, DeviceLimits, Dispatch, Mode};
use crate::models::Linear;
use std::cell::{Cell, RefCell};
use std::time::Instant;

/// Measured speeds, in FLOP/s and seconds, for the policy.
#[derive(Debug, Clone, Copy)]
pub struct Rates {
    /// Round trip of a tiny device call.
    pub gpu_latency: f64,
    /// Device FLOP/s on a large batch, and its bytes/s for moving activations.
    pub gpu_flops: f64,
    pub gpu_bytes: f64,
    /// CPU FLOP/s at t = 1 and on batches.
    pub cpu_flops_1: f64,
    pub cpu_flops_n: f64,
}

/// The model's device: its uploaded weights' ids live in each `Linear::gpu`.
pub struct Gpu {
    pub device: Box<dyn Device>,
    pub mode: Mode,
    pub limits: DeviceLimits,
    pub rates: Cell<Option<Rates>>,
    /// Why the device is no longer used, once it was lost.
    pub lost: RefCell<Option<String>>,
    /// Attention stays on the CPU (the CPU beat the device at load).
    pub no_attention: Cell<bool>,
    /// The host answered `create-kv-cache` or an attention with `unavailable`: the CPU attends.
    pub no_kv_cache: Cell<bool>,
    /// The host answered a program's run with `unavailable`: batches go call by call.
    pub no_programs: Cell<bool>,
    /// The CPU's attention FLOP/s, a running average of what ran (none ran yet: `None`).
    pub cpu_attention: Cell<Option<f64>>,
    /// Seconds of a decode step's attention on the device over its `kv-cache`, a running
    /// average (none ran yet: `None`).
    pub device_attention: Cell<Option<f64>>,
    /// The device holds the model's weights alone (the guest keeps no copy, see
    /// `upload::Streaming`): every pass runs there, whatever the rates, or fails.
    pub owns: bool,
}

impl Gpu {
    /// The device `device` in `mode`, nothing measured or failed yet.
    pub fn new(device: Box<dyn Device>, mode: Mode, limits: DeviceLimits, owns: bool) -> Gpu {
        Gpu {
            device,
            mode,
            limits,
            rates: Cell::new(None),
            lost: RefCell::new(None),
            no_attention: Cell::new(false),
            no_kv_cache: Cell::new(false),
            no_programs: Cell::new(false),
            cpu_attention: Cell::new(None),
            device_attention: Cell::new(None),
            owns,
        }
    }

    /// Whether the device may be asked: the mode allows it and it was not lost.
    pub(super) fn usable(&self) -> bool {
        self.mode != Mode::Off && self.lost.borrow().is_none()
    }

    /// The policy: should this batch run on the device?
    pub(super) fn wants(&self, t: usize, flops: u64, bytes: u64) -> bool {
        match self.mode {
            Mode::Off => false,
            _ if self.owns => true,
            Mode::On => true,
            Mode::Auto => match self.rates.get() {
                None => false,
                Some(r) => {
                    let gpu = r.gpu_latency + bytes as f64 / r.gpu_bytes + flops as f64 / r.gpu_flops;
                    let cpu = flops as f64 / if t == 1 { r.cpu_flops_1 } else { r.cpu_flops_n };
                    gpu < cpu
                }
            },
        }
    }

    /// The policy for an attention batch over the device's `kv-cache` of its layer: the
    /// device's estimate as for products, the CPU's from its own measured attention rate (with
    /// none yet, the CPU runs it and is measured). With `On`, batches of queries (prefill) go
    /// to the device. A single query (a decode step) goes, in either mode, to whichever has
    /// been faster: the device's measured time a call against the CPU's measured rate for
    /// these keys (the CPU is measured first, then the device once). On an H200 a call costs
    /// ~0.1 ms (~0.3 before its keys were split in runs of 16), the CPU's attention at 128
    /// keys ~0.08 and at 576 ~0.5.
    pub(super) fn wants_attention(&self, t: usize, flops: u64, bytes: u64) -> bool {
        if self.mode != Mode::Off && t == 1 {
            return match (self.cpu_attention.get(), self.device_attention.get()) {
                (Some(cpu), Some(device)) => device < flops as f64 / cpu,
                (Some(_), None) => true,
                (None, _) => false,
            };
        }
        match self.mode {
            Mode::Off => false,
            _ if self.owns => true,
            Mode::On => true,
            Mode::Auto => match (self.rates.get(), self.cpu_attention.get()) {
                (Some(r), Some(cpu)) => {
                    r.gpu_latency + bytes as f64 / r.gpu_bytes + flops as f64 / r.gpu_flops < flops as f64 / cpu
                }
                _ => false,
            },
        }
    }

    /// Folds the measured time of a decode step's attention on the device into the estimate.
    pub(super) fn observe_device_attention(&self, secs: f64) {
        self.device_attention.set(Some(self.device_attention.get().map_or(secs, |d| 0.8 * d + 0.2 * secs)));
    }

    /// Folds a measured CPU attention rate into the estimate.
    pub(super) fn observe_cpu_attention(&self, flops: u64, secs: f64) {
        if secs > 0.0 {
            let rate = flops as f64 / secs;
            self.cpu_attention.set(Some(self.cpu_attention.get().map_or(rate, |r| 0.9 * r + 0.1 * rate)));
        }
    }

    /// Takes note of a failed call (`e`, or `None` for an answer of the wrong shape, `what`):
    /// a loss, or a wrong shape, is remembered and the device not asked again; `unavailable`
    /// from a call the host need not offer sets `not_offered` instead. Returns whether the work
    /// falls back to the CPU as a failure (counted), not as a call the host does not have.
    pub(super) fn failed(&self, e: Option<DeviceError>, what: &str, not_offered: Option<&Cell<bool>>) -> bool {
        match (e, not_offered) {
            (None, _) => *self.lost.borrow_mut() = Some(format!("the device returned {what} of the wrong shape")),
            (Some(DeviceError::Lost(why)), _) => *self.lost.borrow_mut() = Some(why),
            (Some(DeviceError::Unavailable(_)), Some(flag)) => {
                flag.set(true);
                return false;
            }
            (Some(_), _) => {}
        }
        true
    }

    /// Folds a measured CPU rate into the estimate (a running average).
    pub(super) fn observe_cpu(&self, t: usize, flops: u64, secs: f64) {
        if let (Some(mut r), true) = (self.rates.get(), secs > 0.0) {
            let rate = flops as f64 / secs;
            let slot = if t == 1 { &mut r.cpu_flops_1 } else { &mut r.cpu_flops_n };
            *slot = 0.9 * *slot + 0.1 * rate;
            self.rates.set(Some(r));
        }
    }
}

/// Times `f` a few times and keeps the fastest, in seconds.
fn fastest(runs: usize, mut f: impl FnMut() -> bool) -> Option<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let start = Instant::now();
        if !f() {
            return None;
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    Some(best)
}

/// Measures the device and the CPU on one of the model's own weights (`probe`, already
/// uploaded): round trip at t = 1, throughput at a prefill-sized batch, CPU at both.
pub fn calibrate(gpu: &Gpu, probe: &Linear) -> Option<Rates> {
    let id = probe.gpu?;
    let (n_in, n_out) = (probe.n_in, probe.n_out);
    let big_t = 64;
    let x: Vec<f32> = (0..big_t * n_in).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
    let dev = &gpu.device;
    let latency = fastest(3, || dev.matmul(&x[..n_in], 1, n_in as u32, &[id]).is_ok())?;
    let batch = fastest(2, || dev.matmul(&x, big_t as u32, n_in as u32, &[id]).is_ok())?;
    let flops = 2.0 * (big_t * n_in * n_out) as f64;
    let bytes = 4.0 * (big_t * (n_in + n_out)) as f64;
    let work = (batch - latency).max(1e-7);
    let mut d = Dispatch::default();
    let mut y = vec![0f32; big_t * n_out];
    let cpu_1 = fastest(3, || {
        d.cpu(&x[..n_in], 1, n_in, &mut [(probe, &mut y[..n_out])]);
        true
    })?;
    let cpu_n = fastest(2, || {
        d.cpu(&x, big_t, n_in, &mut [(probe, &mut y)]);
        true
    })?;
    Some(Rates {
        gpu_latency: latency,
        // Bandwidth and arithmetic share the time beyond the round trip; charge it all to both
        // so neither is overestimated.
        gpu_flops: flops / work,
        gpu_bytes: bytes / work,
        cpu_flops_1: 2.0 * (n_in * n_out) as f64 / cpu_1,
        cpu_flops_n: flops / cpu_n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upload::Format;

    /// A device that takes every call and computes nothing: the policy never reads its answers.
    struct Fake;

    impl Device for Fake {
        fn allocate(&self, _format: Format, _n_out: u32, _n_in: u32) -> Result<usize, DeviceError> {
            Ok(0)
        }
        fn write_rows(&self, _id: usize, _first_row: u32, _data: &[u8], _scales: &[f32]) -> Result<(), DeviceError> {
            Ok(())
        }
        fn matmul(&self, _x: &[f32], _t: u32, _n_in: u32, jobs: &[usize]) -> Result<Vec<Vec<f32>>, DeviceError> {
            Ok(vec![Vec::new(); jobs.len()])
        }
        fn free(&self, _id: usize) {}
    }

    /// The fake device in `mode` with `rates`, nothing measured or failed yet.
    fn gpu(mode: Mode, rates: Option<Rates>) -> Gpu {
        let limits = DeviceLimits {
            name: "fake".into(),
            max_weight_bytes: u64::MAX,
            max_activation_elements: u64::MAX,
            budget_bytes: u64::MAX,
            budget_handles: u32::MAX,
        };
        let gpu = Gpu::new(Box::new(Fake), mode, limits, false);
        gpu.rates.set(rates);
        gpu
    }

    /// Rates in powers of two, so that the estimates compare exactly: a device round trip of
    /// 0.5 s, 4 bytes/s and 8 FLOP/s; a CPU of 2 FLOP/s at t = 1 and 4 FLOP/s on batches.
    const RATES: Rates = Rates { gpu_latency: 0.5, gpu_flops: 8.0, gpu_bytes: 4.0, cpu_flops_1: 2.0, cpu_flops_n: 4.0 };

    /// `Off` keeps everything on the CPU, `On` sends every batch, measured or not.
    #[test]
    fn off_never_wants_the_device_and_on_always_does() {
        let off = gpu(Mode::Off, Some(RATES));
        let on = gpu(Mode::On, None);
        for (t, flops, bytes) in [(1, 0, 0), (1, 1 << 40, 0), (64, 1 << 40, 4), (64, 1, 1 << 40)] {
            assert!(!off.wants(t, flops, bytes));
            assert!(on.wants(t, flops, bytes));
        }
        assert!(!off.usable());
        assert!(on.usable());
    }

    /// `Auto` with no rates (no calibration ran) has nothing to compare: the CPU runs it.
    #[test]
    fn auto_without_rates_keeps_work_on_the_cpu() {
        let auto = gpu(Mode::Auto, None);
        for t in [1, 64] {
            assert!(!auto.wants(t, 1 << 40, 0));
        }
    }

    /// Device time 0.5 + bytes / 4 + flops / 8 against CPU time flops / 2 (t = 1) or flops / 4
    /// (batches), on either side of where they meet.
    #[test]
    fn auto_prefers_the_device_exactly_when_its_estimate_is_lower() {
        let auto = gpu(Mode::Auto, Some(RATES));
        // t = 1 and 4 bytes: 1.5 + flops / 8 against flops / 2, equal at 4 FLOPs.
        assert!(!auto.wants(1, 3, 4));
        assert!(!auto.wants(1, 4, 4), "a tie stays on the CPU");
        assert!(auto.wants(1, 5, 4));
        // More bytes to move: 2.5 + 5 / 8 against 5 / 2.
        assert!(!auto.wants(1, 5, 8));
        // A batch against the CPU's batch rate: 1.5 + flops / 8 against flops / 4, equal at 12.
        assert!(!auto.wants(8, 5, 4));
        assert!(!auto.wants(8, 12, 4));
        assert!(auto.wants(8, 13, 4));
    }

    /// A decode step over a device cache: the CPU first (to measure it), then the device once,
    /// then whichever measured faster, in `Auto` and `On` alike; never with `Off`.
    #[test]
    fn decode_attention_measures_the_cpu_then_the_device_then_takes_the_faster() {
        for mode in [Mode::Auto, Mode::On] {
            let g = gpu(mode, Some(RATES));
            assert!(!g.wants_attention(1, 100, 0));
            // The CPU attends at 100 FLOP/s.
            g.observe_cpu_attention(100, 1.0);
            assert!(g.wants_attention(1, 100, 0));
            // The device takes 0.5 s a call; the CPU 1 s for 100 FLOPs, 0.5 s for 50.
            g.observe_device_attention(0.5);
            assert!(g.wants_attention(1, 100, 0));
            assert!(!g.wants_attention(1, 50, 0), "a tie stays on the CPU");
            assert!(!g.wants_attention(1, 25, 0));
        }
        let off = gpu(Mode::Off, Some(RATES));
        off.observe_cpu_attention(100, 1.0);
        assert!(!off.wants_attention(1, 100, 0));
    }

    /// `On` sends batches of queries, measured or not; `Off` none.
    #[test]
    fn on_sends_prefill_attention_and_off_does_not() {
        assert!(gpu(Mode::On, None).wants_attention(4, 100, 0));
        assert!(!gpu(Mode::Off, Some(RATES)).wants_attention(4, 100, 0));
    }

    /// A lost device is remembered: a counted failure, and no call after.
    #[test]
    fn failed_with_lost_remembers_the_loss() {
        let g = gpu(Mode::On, None);
        assert!(g.failed(Some(DeviceError::Lost("gone".into())), "outputs", None));
        assert_eq!(g.lost.borrow().as_deref(), Some("gone"));
        assert!(!g.usable());
    }

    /// `unavailable` from a call the host need not offer sets its flag and is no failure;
    /// without a flag, or another error, it is a failure and the device stays in use.
    #[test]
    fn failed_with_unavailable_sets_the_flag() {
        let g = gpu(Mode::On, None);
        assert!(!g.failed(Some(DeviceError::Unavailable("no".into())), "attention", Some(&g.no_attention)));
        assert!(g.no_attention.get());
        assert!(g.usable());
        assert!(g.failed(Some(DeviceError::Unavailable("no".into())), "outputs", None));
        assert!(g.failed(Some(DeviceError::OutOfMemory("full".into())), "attention", Some(&g.no_kv_cache)));
        assert!(!g.no_kv_cache.get());
        assert!(g.usable());
    }

    /// An answer of the wrong shape (`None`) is a device not to trust again: lost.
    #[test]
    fn failed_with_a_wrong_shape_marks_the_device_lost() {
        let g = gpu(Mode::On, None);
        assert!(g.failed(None, "outputs", Some(&g.no_programs)));
        assert!(!g.no_programs.get());
        assert_eq!(g.lost.borrow().as_deref(), Some("the device returned outputs of the wrong shape"));
        assert!(!g.usable());
    }

    /// Each CPU measurement moves the rate for its kind of batch a tenth of the way to it.
    #[test]
    fn observe_cpu_moves_the_rate_a_tenth_toward_the_measurement() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let g = gpu(Mode::Auto, Some(Rates { cpu_flops_1: 100.0, cpu_flops_n: 1000.0, ..RATES }));
        g.observe_cpu(1, 200, 1.0);
        let r = g.rates.get().unwrap();
        assert!(close(r.cpu_flops_1, 110.0) && close(r.cpu_flops_n, 1000.0));
        g.observe_cpu(8, 2000, 1.0);
        let r = g.rates.get().unwrap();
        assert!(close(r.cpu_flops_1, 110.0) && close(r.cpu_flops_n, 1100.0));
        // A measurement of no time is none.
        g.observe_cpu(8, 2000, 0.0);
        assert!(close(g.rates.get().unwrap().cpu_flops_n, 1100.0));
        // Without rates there is nothing to move.
        let none = gpu(Mode::Auto, None);
        none.observe_cpu(1, 200, 1.0);
        assert!(none.rates.get().is_none());
    }
}
