//! GGUF v2/v3 reader: header, metadata, tensor infos, data offsets.
//!
//! The file is untrusted. Every size is computed with checked arithmetic, every length-prefixed
//! read checks the bytes left first, and counts are capped by what the remaining bytes could
//! possibly hold, so a hostile header cannot make the reader allocate more than the file's size.
//! Spec: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>.

use std::collections::HashMap;
use std::fmt;

pub const MAGIC: &[u8; 4] = b"GGUF";
/// Caps on what a sane model file holds; a file beyond them is rejected, not trusted.
pub const MAX_STRING_BYTES: u64 = 1 << 24;
pub const MAX_TENSOR_NAME_BYTES: u64 = 63;
pub const MAX_DIMS: u32 = 4;
pub const MAX_ALIGNMENT: u64 = 1 << 16;
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Largest capacity reserved up front from a count read from the file.
const PREALLOC_CAP: u64 = 4096;

/// An empty vector for `n` items counted in the file, with room reserved for at most
/// `PREALLOC_CAP` of them and never more bytes than the file has left: a count only proves the
/// bytes for its smallest items, which may be smaller than a `T`.
fn reserved<T>(n: u64, bytes_left: u64) -> Vec<T> {
    let room = bytes_left / size_of::<T>().max(1) as u64;
    Vec::with_capacity(n.min(PREALLOC_CAP).min(room) as usize)
}

/// A parse failure, with where in the file it happened.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufError {
    pub offset: u64,
    pub message: String,
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GGUF at byte {}: {}", self.offset, self.message)
    }
}

impl std::error::Error for GgufError {}

pub type Result<T> = std::result::Result<T, GgufError>;

/// The tensor element types of ggml that this reader knows the block size of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
    IQ4NL,
    IQ4XS,
}

impl TensorType {
    pub fn from_id(id: u32) -> Option<Self> {
        use TensorType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            20 => IQ4NL,
            23 => IQ4XS,
            28 => F64,
            30 => BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block)
    pub fn block(self) -> (u64, u64) {
        use TensorType::*;
        match self {
            F32 => (1, 4),
            F16 | BF16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2K => (256, 84),
            Q3K => (256, 110),
            Q4K => (256, 144),
            Q5K => (256, 176),
            Q6K => (256, 210),
            Q8K => (256, 292),
            IQ4NL => (32, 18),
            IQ4XS => (256, 136),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 | F64 => (1, 8),
        }
    }

    pub fn name(self) -> &'static str {
        use TensorType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            IQ4NL => "IQ4_NL",
            IQ4XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            BF16 => "BF16",
        }
    }
}

/// A metadata value. Arrays hold scalars or strings, never arrays.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

/// A typed metadata array.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as an i64, for integer arrays.
    pub fn int_at(&self, i: usize) -> Option<i64> {
        Some(match self {
            Array::U8(v) => *v.get(i)? as i64,
            Array::I8(v) => *v.get(i)? as i64,
            Array::U16(v) => *v.get(i)? as i64,
            Array::I16(v) => *v.get(i)? as i64,
            Array::U32(v) => *v.get(i)? as i64,
            Array::I32(v) => *v.get(i)? as i64,
            Array::U64(v) => i64::try_from(*v.get(i)?).ok()?,
            Array::I64(v) => *v.get(i)?,
            _ => return None,
        })
    }
}

impl Value {
    /// The value as an unsigned integer, for any integer type holding a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// The value as text for display; arrays longer than `max_items` are summarised.
    pub fn render(&self, max_items: usize) -> String {
        fn list<T: fmt::Debug>(v: &[T], max: usize) -> String {
            if v.len() <= max {
                format!("{v:?}")
            } else {
                format!("[{} items: {:?}, ...]", v.len(), &v[..max])
            }
        }
        match self {
            Value::U8(v) => v.to_string(),
            Value::I8(v) => v.to_string(),
            Value::U16(v) => v.to_string(),
            Value::I16(v) => v.to_string(),
            Value::U32(v) => v.to_string(),
            Value::I32(v) => v.to_string(),
            Value::U64(v) => v.to_string(),
            Value::I64(v) => v.to_string(),
            Value::F32(v) => v.to_string(),
            Value::F64(v) => v.to_string(),
            Value::Bool(v) => v.to_string(),
            Value::String(s) => s.clone(),
            Value::Array(a) => match a {
                Array::U8(v) => list(v, max_items),
                Array::I8(v) => list(v, max_items),
                Array::U16(v) => list(v, max_items),
                Array::I16(v) => list(v, max_items),
                Array::U32(v) => list(v, max_items),
                Array::I32(v) => list(v, max_items),
                Array::U64(v) => list(v, max_items),
                Array::I64(v) => list(v, max_items),
                Array::F32(v) => list(v, max_items),
                Array::F64(v) => list(v, max_items),
                Array::Bool(v) => list(v, max_items),
                Array::String(v) => list(v, max_items),
            },
        }
    }
}

/// Where a tensor's data lies, and what it is.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, innermost (contiguous) first, as GGUF stores them.
    pub dims: Vec<u64>,
    pub kind: TensorType,
    /// Offset of the data in the file (absolute).
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

/// A parsed GGUF header. The tensor data stays in the caller's buffer.
#[derive(Debug, Clone)]
pub struct Gguf {
    pub version: u32,
    pub alignment: u64,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Absolute offset of the tensor data section.
    pub data_offset: u64,
}

struct Reader<'a> {
    /// The file's first bytes (all of them, or a prefix).
    bytes: &'a [u8],
    pos: usize,
    /// The whole file's length: counts and the data's bounds are checked against it.
    file_len: u64,
    /// A read went past `bytes` but not past the file: the header needs a longer prefix.
    short: bool,
}

impl<'a> Reader<'a> {
    fn err<T>(&self, message: impl Into<String>) -> Result<T> {
        Err(GgufError { offset: self.pos as u64, message: message.into() })
    }

    /// Bytes left in the file (not only in the prefix read).
    fn remaining(&self) -> u64 {
        self.file_len - self.pos as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return self.err(format!(
                "truncated: {what} needs {n} bytes, {} left",
                self.remaining()
            ));
        }
        if n > (self.bytes.len() - self.pos) as u64 {
            self.short = true;
            return self.err(format!("{what} lies past the {} bytes read", self.bytes.len()));
        }
        let n = n as usize;
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that is about to drive a loop over items of at least `min_item_bytes` each:
    /// rejected unless the remaining bytes could hold that many items.
    fn count(&mut self, what: &str, min_item_bytes: u64) -> Result<u64> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = n.checked_mul(min_item_bytes).is_some_and(|b| b <= self.remaining());
        if !fits {
            return Err(GgufError {
                offset: at as u64,
                message: format!(
                    "{what} {n} cannot fit in the {} bytes left",
                    self.remaining()
                ),
            });
        }
        Ok(n)
    }

    fn string(&mut self, what: &str, max: u64) -> Result<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > max {
            return Err(GgufError {
                offset: at as u64,
                message: format!("{what} length {len} exceeds the cap of {max} bytes"),
            });
        }
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError {
                offset: at as u64 + 8 + e.valid_up_to() as u64,
                message: format!("{what} is not valid UTF-8"),
            }),
        }
    }

    fn value(&mut self, ty: u32, what: &str) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.u8(what)?),
            1 => Value::I8(self.u8(what)? as i8),
            2 => Value::U16(self.u16(what)?),
            3 => Value::I16(self.u16(what)? as i16),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(self.u32(what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(what)?)),
            7 => {
                let at = self.pos;
                match self.u8(what)? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => {
                        return Err(GgufError {
                            offset: at as u64,
                            message: format!("{what}: bool byte {b} is neither 0 nor 1"),
                        });
                    }
                }
            }
            8 => Value::String(self.string(what, MAX_STRING_BYTES)?),
            9 => Value::Array(self.array_value(what)?),
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(self.u64(what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(what)?)),
            _ => return self.err(format!("{what}: unknown value type {ty}")),
        })
    }

    fn array_value(&mut self, what: &str) -> Result<Array> {
        let at = self.pos;
        let ty = self.u32(what)?;
        let item = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4 | 5 | 6 => 4,
            10..=12 => 8,
            8 => 8, // a string is at least its length prefix
            9 => {
                return Err(GgufError {
                    offset: at as u64,
                    message: format!("{what}: nested arrays are not supported"),
                });
            }
            _ => {
                return Err(GgufError {
                    offset: at as u64,
                    message: format!("{what}: unknown array element type {ty}"),
                });
            }
        };
        let n = self.count(&format!("{what}: array length"), item)? as usize;
        macro_rules! items {
            ($variant:ident, $read:expr) => {{
                let mut v = reserved(n as u64, self.remaining());
                for _ in 0..n {
                    v.push($read(&mut *self)?);
                }
                Array::$variant(v)
            }};
        }
        Ok(match ty {
            0 => Array::U8(self.take(n as u64, what)?.to_vec()),
            1 => Array::I8(self.take(n as u64, what)?.iter().map(|&b| b as i8).collect()),
            2 => items!(U16, |r: &mut Self| r.u16(what)),
            3 => items!(I16, |r: &mut Self| r.u16(what).map(|v| v as i16)),
            4 => items!(U32, |r: &mut Self| r.u32(what)),
            5 => items!(I32, |r: &mut Self| r.u32(what).map(|v| v as i32)),
            6 => items!(F32, |r: &mut Self| r.u32(what).map(f32::from_bits)),
            7 => items!(Bool, |r: &mut Self| match r.value(7, what)? {
                Value::Bool(b) => Ok(b),
                _ => unreachable!("value type 7 is bool"),
            }),
            8 => items!(String, |r: &mut Self| r.string(what, MAX_STRING_BYTES)),
            10 => items!(U64, |r: &mut Self| r.u64(what)),
            11 => items!(I64, |r: &mut Self| r.u64(what).map(|v| v as i64)),
            12 => items!(F64, |r: &mut Self| r.u64(what).map(f64::from_bits)),
            _ => unreachable!("element type checked above"),
        })
    }
}

impl Gguf {
    /// Parses the header of a GGUF file held in `bytes` and checks that every tensor's data lies
    /// inside it.
    pub fn parse(bytes: &[u8]) -> Result<Gguf> {
        // A prefix that is the whole file is never short.
        Gguf::parse_prefix(bytes, bytes.len() as u64)?
            .ok_or_else(|| GgufError { offset: 0, message: "the header lies past the file".into() })
    }

    /// Parses the header of a GGUF file of `file_len` bytes from its first bytes, `prefix`, and
    /// checks that every tensor's data lies inside the file. `None` when the header goes on past
    /// `prefix` (read more and parse again); the same errors as `parse` otherwise.
    pub fn parse_prefix(prefix: &[u8], file_len: u64) -> Result<Option<Gguf>> {
        let bytes = &prefix[..prefix.len().min(usize::try_from(file_len).unwrap_or(usize::MAX))];
        let mut r = Reader { bytes, pos: 0, file_len, short: false };
        match Gguf::parse_with(&mut r) {
            Err(_) if r.short => Ok(None),
            other => other.map(Some),
        }
    }

    fn parse_with(r: &mut Reader<'_>) -> Result<Gguf> {
        if r.file_len < 4 {
            return r.err(format!("file of {} bytes is too short to be GGUF", r.file_len));
        }
        let magic = r.array::<4>("magic")?;
        if &magic != MAGIC {
            return Err(GgufError {
                offset: 0,
                message: format!("bad magic {magic:02x?}: not a GGUF file"),
            });
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError {
                offset: 4,
                message: format!("unsupported GGUF version {version} (2 and 3 are supported)"),
            });
        }
        // A tensor info is at least name length + n_dims + one dim + type + offset: 32 bytes.
        let n_tensors = r.count("tensor count", 32)?;
        // A key/value is at least key length + type + one byte: 13 bytes.
        let n_kv = r.count("metadata count", 13)?;

        // Capacities are capped by the bytes left; the indexes grow with the entries read.
        let mut metadata = reserved(n_kv, r.remaining());
        let mut index = HashMap::new();
        for _ in 0..n_kv {
            let at = r.pos as u64;
            let key = r.string("metadata key", MAX_STRING_BYTES)?;
            if key.is_empty() {
                return Err(GgufError { offset: at, message: "empty metadata key".into() });
            }
            if index.contains_key(&key) {
                return Err(GgufError { offset: at, message: format!("duplicate key {key:?}") });
            }
            let ty = r.u32("value type")?;
            let value = r.value(ty, &key)?;
            index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }

        let alignment = match index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) => {
                let a = *a as u64;
                if a == 0 || !a.is_power_of_two() || a > MAX_ALIGNMENT {
                    return r.err(format!(
                        "general.alignment {a} is not a power of two in 1..={MAX_ALIGNMENT}"
                    ));
                }
                a
            }
            Some(v) => {
                return r.err(format!("general.alignment has type {}, not u32", v.type_name()));
            }
        };

        let mut tensors = reserved(n_tensors, r.remaining());
        let mut tensor_index = HashMap::new();
        for _ in 0..n_tensors {
            let at = r.pos as u64;
            let name = r.string("tensor name", MAX_STRING_BYTES)?;
            if name.len() as u64 > MAX_TENSOR_NAME_BYTES {
                return Err(GgufError {
                    offset: at,
                    message: format!(
                        "tensor name of {} bytes exceeds {MAX_TENSOR_NAME_BYTES}",
                        name.len()
                    ),
                });
            }
            if tensor_index.contains_key(&name) {
                return Err(GgufError {
                    offset: at,
                    message: format!("duplicate tensor name {name:?}"),
                });
            }
            let n_dims = r.u32("n_dims")?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return r.err(format!("tensor {name:?}: n_dims {n_dims} is not in 1..={MAX_DIMS}"));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            let mut n_elements: u64 = 1;
            for _ in 0..n_dims {
                let d = r.u64("dimension")?;
                if d == 0 {
                    return r.err(format!("tensor {name:?}: a dimension is 0"));
                }
                n_elements = n_elements.checked_mul(d).ok_or_else(|| GgufError {
                    offset: r.pos as u64,
                    message: format!("tensor {name:?}: element count overflows"),
                })?;
                dims.push(d);
            }
            let type_id = r.u32("tensor type")?;
            let kind = match TensorType::from_id(type_id) {
                Some(k) => k,
                None => return r.err(format!("tensor {name:?}: unknown tensor type {type_id}")),
            };
            let (block, block_bytes) = kind.block();
            if dims[0] % block != 0 {
                return r.err(format!(
                    "tensor {name:?}: first dimension {} is not a multiple of {}'s block of {block}",
                    dims[0],
                    kind.name()
                ));
            }
            let n_bytes = (n_elements / block).checked_mul(block_bytes).ok_or_else(|| GgufError {
                offset: r.pos as u64,
                message: format!("tensor {name:?}: byte size overflows"),
            })?;
            let offset = r.u64("tensor offset")?;
            if offset % alignment != 0 {
                return r.err(format!(
                    "tensor {name:?}: offset {offset} is not aligned to {alignment}"
                ));
            }
            tensor_index.insert(name.clone(), tensors.len());
            tensors.push(TensorInfo { name, dims, kind, offset, n_elements, n_bytes });
        }

        let header_end = r.pos as u64;
        let data_offset = header_end.div_ceil(alignment) * alignment;
        let file_len = r.file_len;
        // Tensor data must lie inside the file, in the order of the tensor infos, without
        // overlap (llama.cpp refuses any other layout too, so no real file has one).
        let mut previous: Option<&TensorInfo> = None;
        for t in &tensors {
            let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes));
            if end.is_none_or(|end| end > file_len) {
                return Err(GgufError {
                    offset: header_end,
                    message: format!(
                        "tensor {:?}: data at offset {} + {} bytes lies past the end of the \
                         {file_len}-byte file",
                        t.name, t.offset, t.n_bytes
                    ),
                });
            }
            if let Some(p) = previous.filter(|p| t.offset < p.offset) {
                return Err(GgufError {
                    offset: header_end,
                    message: format!(
                        "tensor {:?} at offset {} comes before tensor {:?} at offset {}: tensor data \
                         must follow the order of the tensor infos",
                        t.name, t.offset, p.name, p.offset
                    ),
                });
            }
            // `p` passed the check above, so its end does not overflow.
            if let Some(p) = previous.filter(|p| t.offset < p.offset + p.n_bytes) {
                return Err(GgufError {
                    offset: header_end,
                    message: format!("tensor {:?} overlaps tensor {:?}", t.name, p.name),
                });
            }
            previous = Some(t);
        }
        for t in &mut tensors {
            t.offset += data_offset;
        }

        Ok(Gguf { version, alignment, metadata, index, tensors, tensor_index, data_offset })
    }

    /// Frees the metadata (every key then reads as absent); the tensor infos stay.
    pub fn forget_metadata(&mut self) {
        self.metadata = Vec::new();
        self.index = HashMap::new();
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        want: &str,
        f: impl FnOnce(&'a Value) -> Option<T>,
    ) -> std::result::Result<Option<T>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => f(v).map(Some).ok_or_else(|| {
                format!("metadata {key} is {} {}, expected {want}", v.type_name(), v.render(4))
            }),
        }
    }

    /// An unsigned integer key: `Ok(None)` when absent, an error when of another type.
    pub fn get_u64(&self, key: &str) -> std::result::Result<Option<u64>, String> {
        self.typed(key, "an unsigned integer", |v| v.as_u64())
    }

    pub fn get_f64(&self, key: &str) -> std::result::Result<Option<f64>, String> {
        self.typed(key, "a number", |v| v.as_f64())
    }

    pub fn get_str(&self, key: &str) -> std::result::Result<Option<&str>, String> {
        self.typed(key, "a string", |v| v.as_str())
    }

    pub fn get_bool(&self, key: &str) -> std::result::Result<Option<bool>, String> {
        self.typed(key, "a bool", |v| v.as_bool())
    }

    pub fn get_array(&self, key: &str) -> std::result::Result<Option<&Array>, String> {
        self.typed(key, "an array", |v| match v {
            Value::Array(a) => Some(a),
            _ => None,
        })
    }
}
