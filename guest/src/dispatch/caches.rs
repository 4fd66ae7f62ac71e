//! The device-cache mirror: which positions each layer's `kv-cache` on the device holds, and
//! from where the device alone holds a session's keys and values (after a whole pass ran
//! there), so that the guest knows what to send and when its own rings fall short.
//!
//! Bookkeeping of a session's state, apart from the policy that decides where work runs.

use super::{DeviceError, Dispatch, Gpu};
use crate::models::LayerCache;
use std::time::Instant;

/// A layer's keys and values on the device: a `kv-cache` of as many rows as the guest's ring,
/// position `p` in row `p % slots` in both, holding positions `lo..hi` (the last `slots` of
/// them).
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceCache {
    pub(super) id: usize,
    pub(super) lo: usize,
    pub(super) hi: usize,
}

impl Dispatch {
    /// Layer `layer`'s `kv-cache` on the device, made now if there is none yet (`None` where
    /// the device has none to give).
    pub(super) fn device_cache(&mut self, gpu: &Gpu, layer: usize, slots: usize, width: usize) -> Option<DeviceCache> {
        if gpu.no_kv_cache.get() || self.no_caches {
            return None;
        }
        if self.caches.len() <= layer {
            self.caches.resize(layer + 1, None);
        }
        if let Some(c) = self.caches[layer] {
            return Some(c);
        }
        match gpu.device.create_kv_cache(slots as u32, width as u32) {
            Ok(id) => {
                let c = DeviceCache { id, lo: 0, hi: 0 };
                self.caches[layer] = Some(c);
                Some(c)
            }
            // A failed call: the layer's work runs on the CPU instead (a fallback).
            Err(DeviceError::Lost(why)) => {
                *gpu.lost.borrow_mut() = Some(why);
                self.counters.gpu_fallbacks += 1;
                None
            }
            // Not offered: no session asks again. No room: this session does not.
            Err(DeviceError::Unavailable(_)) => {
                gpu.no_kv_cache.set(true);
                None
            }
            Err(e) => {
                self.fault = Some(e);
                self.no_caches = true;
                self.counters.gpu_fallbacks += 1;
                None
            }
        }
    }

    /// Takes note of a whole pass of `t` rows at `pos` that ran on the device (the model's
    /// program), over the layers of `caches`: their keys and values are on the device
    /// alone from `pos` on (see [`Dispatch::ring_holds`]).
    pub(super) fn ran_whole_pass(&mut self, (pos, t): (usize, usize), caches: &[LayerCache], flops: u64, start: Instant) {
        self.device_only_from = Some(self.device_only_from.map_or(pos, |p| p.min(pos)));
        for (c, ring) in self.caches.iter_mut().zip(caches) {
            if let Some(c) = c {
                c.lo = c.lo.max((pos + t).saturating_sub(ring.cap));
                c.hi = pos + t;
            }
        }
        self.counters.gpu_calls += 1;
        self.counters.gpu_flops += flops;
        self.counters.gpu_ns += start.elapsed().as_nanos() as u64;
        self.counters.gpu_attention_calls += caches.len() as u64;
    }

    /// After a failed whole pass, what the device's caches hold is unknown.
    pub(super) fn forget_device_caches(&mut self) {
        for c in self.caches.iter_mut().flatten() {
            (c.lo, c.hi) = (0, 0);
        }
    }

    /// The session's context now ends at `pos` (a truncation): the device's caches hold
    /// nothing from there on, and the guest's rings lack nothing before it unless they
    /// already did.
    pub fn rewind(&mut self, pos: usize) {
        self.device_only_from = self.device_only_from.filter(|&p| p < pos);
        for c in self.caches.iter_mut().flatten() {
            c.hi = c.hi.min(pos);
            if c.lo > c.hi {
                (c.lo, c.hi) = (0, 0);
            }
        }
    }

    /// For a copy of another session's caches on the guest (its device caches not copied):
    /// the rings lack what `other`'s lack.
    pub fn follow(&mut self, other: &Dispatch) {
        self.device_only_from = other.device_only_from;
    }

    /// Whether the guest's rings hold every key and value before `pos`, so that the batch at
    /// `pos` can run layer by layer; `false` when the device alone holds some (see
    /// [`Dispatch::run_program`]): the session must run its history again from position 0. A batch
    /// that runs here from `pos` rewrites the rings from there on.
    pub fn ring_holds(&mut self, pos: usize) -> bool {
        match self.device_only_from {
            Some(p) if p < pos => false,
            _ => {
                self.device_only_from = None;
                true
            }
        }
    }
}
