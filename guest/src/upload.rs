//! The upload formats' encoding of the guest's weights: the byte layouts of `wit/gpu.wit`.
//!
//! `quant` holds the blocks as the GGUF stores them and the CPU kernels read them; this module
//! turns them into the rows a host's device takes (`weight-format`), exactly the values the CPU
//! kernels use. It changes with the WIT's formats, not with the choice of where work runs
//! (`dispatch`).

use crate::dispatch::{Device, DeviceError};
use crate::gguf::TensorType;
use crate::models::{FileRows, Linear, LoadError, WeightData};
use crate::quant::{self, Group, QMatrix, Values};
use crate::source::Source;
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::rc::Rc;

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
        // Not the guest's to upload (`uploadable` says no).
        WeightData::Device(f) => (*f, Vec::new(), Vec::new()),
        WeightData::File(_) => (Format::F32, Vec::new(), Vec::new()),
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
    } else if matches!(&q.values, Values::Nibbles { fifth, .. } if !fifth.is_empty()) {
        // Five-bit values with mins (Q5_K, Q5_1): no upload format holds them; f32 does, exactly.
        let mut data = Vec::with_capacity(4 * rows * n);
        let mut row = vec![0f32; n];
        for r in first..first + rows {
            q.row_f32(r, &mut row);
            data.extend(row.iter().flat_map(|v| v.to_le_bytes()));
        }
        (Format::F32, data, Vec::new())
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
        WeightData::Device(_) | WeightData::File(_) => false,
        WeightData::Q(q) => match &q.values {
            _ if q.m.is_empty() => true,
            // Q4_K: 4-bit values with no offset, 0..=15 by construction; with fifth bits (Q5_K,
            // Q5_1), as f32.
            Values::Nibbles { offset: 0, .. } => q.group == Group::G32,
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

/// The upload format a tensor of GGUF type `kind` goes to the device in (as `encode_rows` makes
/// it: the block formats' own; f32 for the float types and Q2_K, which the guest widens at load,
/// and for the five-bit formats with mins, Q5_K and Q5_1, which no other upload format holds).
pub fn format_of(kind: TensorType) -> Format {
    if matches!(kind, TensorType::Q5K | TensorType::Q5_1) {
        return Format::F32;
    }
    match quant::qmatrix_layout(kind) {
        Some((Group::G16, _)) => Format::Q8x16,
        Some((Group::G32, true)) => Format::Q4x32,
        Some((Group::G32, false)) => Format::Q8x32,
        None => Format::F32,
    }
}

/// Bytes of a `[n_out, n_in]` tensor of type `kind` on the device: its data and its scales
/// (each one buffer there, at most the device's `max-weight-bytes`).
pub fn device_sizes(kind: TensorType, n_out: u64, n_in: u64) -> (u64, u64) {
    let (format, n) = (format_of(kind), n_out.saturating_mul(n_in));
    (format.data_bytes(n).unwrap_or(u64::MAX), format.scale_count(n).saturating_mul(4))
}

/// The embedding's tensor in every architecture here: read by the guest (a token's row), and
/// the output projection too where a model has no `output.weight`.
const EMBEDDING: &str = "token_embd.weight";

/// A load that puts each matrix on the device as it is read, a piece of rows at a time, the
/// guest keeping nothing of it: the [`Source`] the architectures read from where the model's
/// weights live on the device (the engine decides). The embedding's rows stay in the file, read
/// as tokens need them (from bytes in memory, in guest memory as the CPU reads them); it goes
/// to the device too where it is also the output projection (`tied`). Vectors (norms, biases)
/// are read into guest memory as always: the program uploads them.
pub struct Streaming<'a> {
    file: &'a dyn Source,
    device: &'a dyn Device,
    /// The model has no `output.weight`: the embedding is also the output projection.
    tied: bool,
    /// The device's largest weight, in bytes of data.
    max_weight_bytes: u64,
    /// The device ids of the weights made, for [`Streaming::release`].
    made: RefCell<Vec<usize>>,
    /// The device refused a weight (its room, its limit, a loss), as opposed to the file
    /// failing to read: [`Streaming::device_refused`].
    refused: Cell<bool>,
}

impl<'a> Streaming<'a> {
    pub fn new(file: &'a dyn Source, device: &'a dyn Device, tied: bool, max_weight_bytes: u64) -> Streaming<'a> {
        Streaming { file, device, tied, max_weight_bytes, made: RefCell::new(Vec::new()), refused: Cell::new(false) }
    }

    /// Whether the device refused a weight of this load (not the file that failed).
    pub fn device_refused(&self) -> bool {
        self.refused.get()
    }

    /// Frees every weight this load made on the device (a load that failed part way: nothing
    /// of it stays there).
    pub fn release(&self) {
        for id in self.made.borrow_mut().drain(..) {
            self.device.free(id);
        }
    }

    /// Rows `rows` of the tensor `name` (`kind`, its rows of `row` bytes from `offset` in the
    /// file), `n_in` wide, on the device (`Linear::gpu`); the embedding as the type says.
    pub(crate) fn load(&self, name: &str, (kind, offset, row): (TensorType, u64, usize), n_in: usize, rows: Range<usize>) -> Result<Linear, LoadError> {
        let n_part = rows.len();
        if name != EMBEDDING {
            let id = self.upload(name, (kind, offset, row), n_in, rows)?;
            return Ok(Linear { name: name.to_string(), n_out: n_part, n_in, w: WeightData::Device(format_of(kind)), kind, gpu: Some(id) });
        }
        let gpu = if self.tied { Some(self.upload(name, (kind, offset, row), n_in, rows.clone())?) } else { None };
        let w = match self.file.reopen() {
            Some(source) => WeightData::File(FileRows { source, kind, offset: offset + (rows.start * row) as u64, row_bytes: row }),
            // Bytes in memory (borrowed for the load): the embedding converted as the CPU reads
            // it (the guest holds the whole file anyway).
            None => Linear::read_here(self.file, name, (kind, offset, row), n_in, rows)?.w,
        };
        Ok(Linear { name: name.to_string(), n_out: n_part, n_in, w, kind, gpu })
    }

    /// Uploads rows `rows` of a tensor a piece at a time: each piece read, converted to the
    /// upload format and written, then dropped. Returns the device id; frees what it made on
    /// an error.
    fn upload(&self, name: &str, (kind, offset, row): (TensorType, u64, usize), n_in: usize, rows: Range<usize>) -> Result<usize, LoadError> {
        let format = format_of(kind);
        let n_part = rows.len();
        let bytes = format.data_bytes(n_part as u64 * n_in as u64).unwrap_or(u64::MAX);
        if bytes > self.max_weight_bytes {
            self.refused.set(true);
            return Err(LoadError::OutOfMemory(format!(
                "tensor {name}: {} MiB of {} on the device, past its largest weight of {} MiB",
                bytes >> 20,
                format.name(),
                self.max_weight_bytes >> 20
            )));
        }
        let device = |e: DeviceError| {
            self.refused.set(true);
            match e {
                DeviceError::OutOfMemory(m) => LoadError::OutOfMemory(format!("tensor {name}: the device has no room for it: {m}")),
                DeviceError::Lost(m) => LoadError::Io(format!("tensor {name}: the device was lost: {m}")),
                DeviceError::InvalidArgument(m) | DeviceError::Unavailable(m) => {
                    LoadError::Io(format!("tensor {name}: the device refused it: {m}"))
                }
            }
        };
        let id = self.device.allocate(format, n_part as u32, n_in as u32).map_err(device)?;
        let per_piece = (self.file.piece_bytes() / row.max(1)).max(1);
        let mut first = rows.start;
        let written = (|| {
            while first < rows.end {
                let n = per_piece.min(rows.end - first);
                let data: Cow<'_, [u8]> = self.file.read(offset + (first * row) as u64, n * row)?;
                if kind == TensorType::F32 {
                    // The file's rows are the upload format's already.
                    self.device.write_rows(id, (first - rows.start) as u32, &data, &[]).map_err(device)?;
                    first += n;
                    continue;
                }
                let (got, data, scales) = match transcode(kind, &data, n, n_in) {
                    Some(rows) => rows,
                    // A float type: widened to f32, the format it goes up in.
                    None => {
                        let mut w = vec![0f32; n * n_in];
                        quant::dequantize(kind, &data, &mut w);
                        encode_rows(&Linear { name: name.to_string(), n_out: n, n_in, w: WeightData::F32(w), kind, gpu: None }, 0, n)
                    }
                };
                debug_assert_eq!(got, format);
                self.device.write_rows(id, (first - rows.start) as u32, &data, &scales).map_err(device)?;
                first += n;
            }
            Ok(())
        })();
        if let Err(e) = written {
            self.device.free(id);
            return Err(e);
        }
        self.made.borrow_mut().push(id);
        Ok(id)
    }
}

/// `n` rows of GGUF blocks of type `kind` (`data`, whole blocks), `n_in` values a row, in their
/// upload format: the very bytes and scales [`encode_rows`] gives from the weights converted
/// for the CPU kernels (the same values, scales and mins, read by `quant`'s one reading of each
/// block), without converting them first: a load to the device. `None` for the types that go
/// up as f32 (the caller widens them).
pub(crate) fn transcode(kind: TensorType, data: &[u8], n: usize, n_in: usize) -> Option<(Format, Vec<u8>, Vec<f32>)> {
    quant::qmatrix_layout(kind)?;
    let format = format_of(kind);
    if format == Format::F32 {
        return None;
    }
    let (block, bytes) = kind.block();
    let (block, total) = (block as usize, n * n_in);
    let mut values = vec![0u8; format.data_bytes(total as u64)? as usize];
    let mut scales = vec![0f32; format.scale_count(total as u64) as usize];
    // GGUF's blocks lie within rows: element `base + i` of the whole is that of the block.
    let blocks = data.chunks_exact(bytes as usize).take(total / block);
    match format {
        // Q4_K, the commonest: its nibbles repacked a byte at a time (the file pairs element j
        // of a 64 with element 32 + j; the format pairs neighbours), its scales and mins a
        // sub-block at a time.
        Format::Q4x32 if kind == TensorType::Q4K => {
            for ((b, out), sc) in blocks.zip(values.chunks_exact_mut(128)).zip(scales.chunks_exact_mut(16)) {
                let (d, dmin) = (quant::f16_at(b, 0), quant::f16_at(b, 2));
                for chunk in 0..4 {
                    let q = &b[16 + 32 * chunk..][..32];
                    let (lo, hi) = out[32 * chunk..][..32].split_at_mut(16);
                    for k in 0..16 {
                        lo[k] = (q[2 * k] & 0xF) | (q[2 * k + 1] << 4);
                        hi[k] = (q[2 * k] >> 4) | (q[2 * k + 1] & 0xF0);
                    }
                    for sub in [2 * chunk, 2 * chunk + 1] {
                        let (s, m) = quant::scale_min_k4(sub, &b[4..16]);
                        sc[2 * sub] = d * s as f32;
                        sc[2 * sub + 1] = dmin * m as f32;
                    }
                }
            }
        }
        Format::Q4x32 => {
            // Two 4-bit values a byte, element `2i` low; `[d, m]` a block of 32.
            for (k, b) in blocks.enumerate() {
                quant::for_each_in_block(kind, b, |i, q, d, m| {
                    let e = k * block + i;
                    values[e / 2] |= (q as u8 & 0xF) << (4 * (e % 2));
                    scales[e / 32 * 2] = d;
                    scales[e / 32 * 2 + 1] = m;
                });
            }
        }
        _ => {
            let group = format.block() as usize;
            for (k, b) in blocks.enumerate() {
                quant::for_each_in_block(kind, b, |i, q, d, _| {
                    let e = k * block + i;
                    values[e] = q as u8;
                    scales[e / group] = d;
                });
            }
        }
    }
    Some((format, values, scales))
}

impl Source for Streaming<'_> {
    fn len(&self) -> u64 {
        self.file.len()
    }

    fn read(&self, offset: u64, len: usize) -> Result<Cow<'_, [u8]>, LoadError> {
        self.file.read(offset, len)
    }

    fn piece_bytes(&self) -> usize {
        self.file.piece_bytes()
    }

    fn device(&self) -> Option<&Streaming<'_>> {
        Some(self)
    }

    fn reopen(&self) -> Option<Rc<dyn Source>> {
        self.file.reopen()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::tests::{Rng, random_blocks};

    /// Every block type's rows transcoded straight from the file are the bytes and scales the
    /// upload encoder makes from the converted weights.
    #[test]
    fn blocks_transcode_to_what_the_encoder_makes_of_the_converted_weights() {
        let mut rng = Rng(7);
        for kind in crate::quant::tests::BLOCK_KINDS {
            for (n, n_in) in [(1, 256), (3, 512), (5, 768)] {
                let data = random_blocks(kind, n * n_in, &mut rng);
                let Some(q) = QMatrix::from_blocks(kind, &data, n, n_in) else {
                    // Q2_K: widened to f32 at load, and so uploaded.
                    assert!(quant::qmatrix_layout(kind).is_none() && format_of(kind) == Format::F32, "{kind:?}");
                    continue;
                };
                let converted = Linear { name: "w".into(), n_out: n, n_in, w: WeightData::Q(q), kind, gpu: None };
                assert!(uploadable(&converted), "{kind:?}");
                let want = encode_rows(&converted, 0, n);
                assert_eq!(want.0, format_of(kind), "{kind:?}");
                if want.0 == Format::F32 {
                    // Five bits with mins: f32, the values `dequantize` gives.
                    let mut values = vec![0f32; n * n_in];
                    quant::dequantize(kind, &data, &mut values);
                    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                    assert_eq!(want.1, bytes, "{kind:?} {n}x{n_in}");
                    assert!(transcode(kind, &data, n, n_in).is_none(), "{kind:?}");
                    continue;
                }
                let got = transcode(kind, &data, n, n_in).expect("a block type");
                assert_eq!((got.0, &got.1), (want.0, &want.1), "{kind:?} {n}x{n_in}: data");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&got.2), bits(&want.2), "{kind:?} {n}x{n_in}: scales");
            }
        }
        assert!(transcode(TensorType::F16, &[0; 64], 1, 32).is_none());
    }
}
