//! The upload formats' encoding of the guest's weights: the byte layouts of `wit/gpu.wit`.
//!
//! `quant` holds the blocks as the GGUF stores them and the CPU kernels read them; this module
//! turns them into the rows a host's device takes (`weight-format`), exactly the values the CPU
//! kernels use. It changes with the WIT's formats, not with the choice of where work runs
//! (`dispatch`).

use crate::dispatch::{Device, DeviceError};
use crate::models::{Linear, WeightData};
use crate::quant::{Group, QMatrix, Values};

/// The upload formats of the WIT `weight-format`: the op core's.
pub use wisp_ops::Format;

/// Bytes per `write-rows` call: large weights go up in slices of rows, so no single list
/// crossing the component boundary is large.
const UPLOAD_SLICE_BYTES: usize = 8 << 20;

/// A weight as `(format, data, scales)` for `rows` rows starting at `first`, exactly the values
/// the CPU kernels use.
pub(crate) fn encode_rows(w: &Linear, first: usize, rows: usize) -> (Format, Vec<u8>, Vec<f32>) {
    let n = w.n_in;
    match &w.w {
        WeightData::F32(f) => {
            let data = f[first * n..(first + rows) * n].iter().flat_map(|v| v.to_le_bytes()).collect();
            (Format::F32, data, Vec::new())
        }
        WeightData::Q(q) => encode_q(q, first, rows),
    }
}

/// A quantized weight's rows `first..first + rows` in its upload format: 8-bit values with a
/// scale a group, or 4-bit values two a byte with a scale and a min a group (Q4_K).
fn encode_q(q: &QMatrix, first: usize, rows: usize) -> (Format, Vec<u8>, Vec<f32>) {
    let n = q.n_in;
    let g = q.group as usize;
    let mut values = vec![0i8; rows * n];
    let mut scales = vec![0f32; rows * n / g];
    for (i, r) in (first..first + rows).enumerate() {
        q.row_values(r, &mut values[i * n..(i + 1) * n]);
        q.row_scales(r, &mut scales[i * n / g..(i + 1) * n / g]);
    }
    if q.m.is_empty() {
        let format = if q.group == Group::G16 { Format::Q8x16 } else { Format::Q8x32 };
        (format, values.iter().map(|&v| v as u8).collect(), scales)
    } else {
        // Formats with mins have 4-bit values 0..=15 (Q4_K): pack two a byte, low nibble first.
        let data = values.chunks_exact(2).map(|p| (p[0] as u8 & 0xF) | ((p[1] as u8 & 0xF) << 4)).collect();
        let mins = &q.m[first * n / 32..(first + rows) * n / 32];
        (Format::Q4x32, data, scales.iter().zip(mins).flat_map(|(&d, &m)| [d, m]).collect())
    }
}

/// Whether a weight can go to the device in an upload format.
pub(crate) fn uploadable(w: &Linear) -> bool {
    match &w.w {
        WeightData::F32(_) => true,
        WeightData::Q(q) => match &q.values {
            _ if q.m.is_empty() => true,
            // Q4_K: 4-bit values with no offset, 0..=15 by construction.
            Values::Nibbles { fifth, offset: 0, .. } => q.group == Group::G32 && fifth.is_empty(),
            _ => q.group == Group::G32 && (0..q.n_out).all(|r| (0..q.n_in).all(|c| (0..16).contains(&q.value(r, c)))),
        },
    }
}

/// Uploads one weight, a slice of rows at a time. Returns its device id.
pub fn upload(dev: &dyn Device, w: &Linear) -> Result<usize, DeviceError> {
    let (format, _, _) = encode_rows(w, 0, 0);
    let id = dev.allocate(format, w.n_out as u32, w.n_in as u32)?;
    let row_bytes = format.data_bytes(w.n_in as u64).unwrap_or(u64::MAX) as usize;
    let rows_per_slice = (UPLOAD_SLICE_BYTES / row_bytes.max(1)).max(1);
    let mut first = 0;
    while first < w.n_out {
        let rows = rows_per_slice.min(w.n_out - first);
        let (_, data, scales) = encode_rows(w, first, rows);
        dev.write_rows(id, first as u32, &data, &scales)?;
        first += rows;
    }
    Ok(id)
}

/// Uploads a vector (a norm weight, a bias) as an f32 weight of one row. Returns its device id.
pub fn upload_vector(dev: &dyn Device, v: &[f32]) -> Result<usize, DeviceError> {
    let id = dev.allocate(Format::F32, 1, v.len() as u32)?;
    let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    if let Err(e) = dev.write_rows(id, 0, &data, &[]) {
        dev.free(id);
        return Err(e);
    }
    Ok(id)
}
