//! What goes to the device at load: the model's weights ([`place`]) and the model's program
//! ([`place_program`]).
//!
//! Done once a model, apart from the per-batch choices of `Dispatch` and the policy.

use super::{DeviceError, Gpu, Mode, calibrate};
use crate::models::Linear;
use crate::program::{Op, Program, Tensor, Tensors, WeightId, compact};
use crate::upload::{encode_rows, upload, upload_vector, uploadable};
use std::collections::HashMap;

/// A model's program on the device: its id, the caches each run brings, and the product of
/// its output that stays with the guest (`head`: its weight is not on the device), if any;
/// and the same program with its output read as the top value of each row (`top`), for a
/// greedy step (the largest logit and its token: 8 bytes back in place of the vocabulary's
/// logits), where the device has the head and made it.
#[derive(Debug, Clone)]
pub struct DeviceProgram {
    pub(super) id: usize,
    pub(super) top: Option<usize>,
    pub(super) caches: usize,
    pub head: Option<WeightId>,
}

impl DeviceProgram {
    /// Whether the program has a `top` form (a run that reads back each sequence's largest
    /// logit alone).
    pub fn has_top(&self) -> bool {
        self.top.is_some()
    }
}

/// Places a model's program on the device: its matrices must be there already (each
/// `Linear::gpu`), but for a product that makes its output (the output projection past a
/// device's binding limit): that one stays with the guest, and the program outputs its input.
/// Its vectors are uploaded now (and freed again if the program is not made). With `top`, its
/// `top` form too. `None` where another matrix is not on the device, or the device does not
/// make the program.
pub fn place_program(gpu: &Gpu, p: &Program, w: &dyn Tensors, caches: usize, top: bool) -> Option<DeviceProgram> {
    let mut head = None;
    let mut all = p.ops.clone();
    for op in all.iter_mut() {
        if let (Op::Output(v), None) = (*op, head) {
            if let Op::Matmul { x, weight, .. } = p.ops[v] {
                let id = p.weights[weight].id;
                if w.matrix(id).gpu.is_none() {
                    *op = Op::Output(x);
                    head = Some(id);
                }
            }
        }
    }
    // The device's weights: those the kept ops name, in the order they first do.
    let ops = compact(&all);
    let mut local: HashMap<usize, usize> = HashMap::new();
    let (mut ids, mut vectors) = (Vec::new(), Vec::new());
    let mut placed = true;
    for i in ops.iter().filter_map(Op::weight) {
        if local.contains_key(&i) {
            continue;
        }
        let device = match w.tensor(p.weights[i].id) {
            Tensor::Matrix(m) => m.gpu,
            Tensor::Vector(v) => upload_vector(gpu.device.as_ref(), v).ok().inspect(|&d| vectors.push(d)),
        };
        let Some(device) = device else {
            placed = false;
            break;
        };
        ids.push(device);
        local.insert(i, ids.len() - 1);
    }
    let ops: Vec<Op> = ops.iter().map(|op| op.map_weights(|i| local.get(&i).copied().unwrap_or(usize::MAX))).collect();
    let made = if placed { gpu.device.create_program(&ids, caches as u32, &ops).ok() } else { None };
    if made.is_none() {
        for v in vectors {
            gpu.device.free(v);
        }
    }
    let id = made?;
    let top = match head {
        None if top => {
            let top: Vec<Op> = ops.iter().map(|&op| if let Op::Output(x) = op { Op::TopK { x, k: 1 } } else { op }).collect();
            gpu.device.create_program(&ids, caches as u32, &top).ok()
        }
        _ => None,
    };
    Some(DeviceProgram { id, top, caches, head })
}

/// Uploads the model's weights as the mode wants: every one with `On`; with `Auto`, one probe
/// first, then the rest only if the measured device beats the CPU at a prefill-sized batch.
/// Returns how many are resident. Errors stop the uploads; what is resident stays in use.
pub fn place(gpu: &Gpu, linears: &mut [&mut Linear]) -> usize {
    if gpu.mode == Mode::Off || linears.is_empty() {
        return 0;
    }
    let mut resident = 0;
    let mut budget = gpu.limits.budget_bytes;
    let mut handles = gpu.limits.budget_handles;
    let try_upload = |w: &mut Linear, budget: &mut u64, handles: &mut u32| -> bool {
        let (_, data, scales) = encode_rows(w, 0, 1);
        let bytes = (data.len() + 4 * scales.len()) as u64 * w.n_out as u64;
        if !uploadable(w) || bytes > *budget || *handles == 0 || data.len() as u64 * w.n_out as u64 > gpu.limits.max_weight_bytes {
            return false;
        }
        match upload(gpu.device.as_ref(), w) {
            Ok(id) => {
                w.gpu = Some(id);
                *budget -= bytes;
                *handles -= 1;
                true
            }
            Err(DeviceError::Lost(why)) => {
                *gpu.lost.borrow_mut() = Some(why);
                false
            }
            Err(_) => false,
        }
    };
    if gpu.mode == Mode::Auto {
        // The largest layer weight (not the output projection) is the probe.
        let n = linears.len().saturating_sub(1).max(1);
        let Some(probe) = (0..n).max_by_key(|&i| linears[i].n_out * linears[i].n_in) else { return 0 };
        if !try_upload(linears[probe], &mut budget, &mut handles) {
            return 0;
        }
        resident += 1;
        let rates = calibrate(gpu, linears[probe]);
        gpu.rates.set(rates);
        let worth = rates.is_some_and(|r| {
            let flops = 2.0 * 64.0 * (linears[probe].n_in * linears[probe].n_out) as f64;
            r.gpu_latency + flops / r.gpu_flops < flops / r.cpu_flops_n
        });
        if !worth {
            // The CPU wins even on batches: keep nothing on the device, and attend here too.
            gpu.no_attention.set(true);
            if let Some(id) = linears[probe].gpu.take() {
                gpu.device.free(id);
            }
            return 0;
        }
    }
    for w in linears.iter_mut() {
        if w.gpu.is_some() {
            continue;
        }
        if gpu.lost.borrow().is_some() {
            break;
        }
        if try_upload(w, &mut budget, &mut handles) {
            resident += 1;
        }
    }
    resident
}
