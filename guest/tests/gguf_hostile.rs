//! Hostile GGUF files and prompts (RELIABILITY.md items 1-16, the guest's part).
//!
//! Every file is built byte by byte by `Builder`, which writes a well-formed GGUF and has a knob
//! for each field a hostile file can corrupt. Each test asserts the error variant and a fragment
//! of the message that says what is wrong. Parse errors are also checked for memory: a counting
//! global allocator (per thread, as tests run in parallel) bounds the peak bytes allocated during
//! the parse by `SLACK + file size`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use wisp_guest::engine::{Error, Model, can_allocate};
use wisp_guest::gguf::{Gguf, GgufError, MAX_TENSOR_NAME_BYTES, TensorType, Value};
use wisp_guest::models::LoadError;
use wisp_guest::session::Session;
use wisp_guest::source::Source;

// ---------------------------------------------------------------------------------------------
// Counting allocator: live and peak bytes of the current thread.

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        note(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Counted as if old and new blocks coexist for a moment.
            note(new_size as isize);
            note(-(layout.size() as isize));
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its result with the peak bytes this thread allocated during it.
fn peak_bytes<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    let peak = PEAK.with(Cell::get) - base;
    (r, peak.max(0) as usize)
}

/// What a hostile parse may allocate beyond the file's size.
const SLACK: usize = 64 << 10;

// ---------------------------------------------------------------------------------------------
// The GGUF builder.

const GGUF_F32: u32 = 0;
const GGUF_F16: u32 = 1;
const GGUF_Q8_0: u32 = 8;
/// Q8_K: ggml's intermediate type for the activations of K-quant products, never a weight's.
const GGUF_Q8_K: u32 = 15;
const GGUF_Q4_K: u32 = 12;
const GGUF_I32: u32 = 26;

/// Metadata value type ids.
const V_U8: u32 = 0;
const V_I32: u32 = 5;
const V_U32: u32 = 4;
const V_F32: u32 = 6;
const V_BOOL: u32 = 7;
const V_STRING: u32 = 8;
const V_ARRAY: u32 = 9;
const V_U64: u32 = 10;

/// (elements per block, bytes per block) of the tensor types the tests write.
fn block(ty: u32) -> (u64, u64) {
    match ty {
        GGUF_F32 => (1, 4),
        GGUF_F16 => (1, 2),
        GGUF_I32 => (1, 4),
        GGUF_Q8_0 => (32, 34),
        GGUF_Q8_K => (256, 292),
        GGUF_Q4_K => (256, 144),
        _ => (1, 0),
    }
}

fn le32(v: u32) -> [u8; 4] {
    v.to_le_bytes()
}

fn le64(v: u64) -> [u8; 8] {
    v.to_le_bytes()
}

/// A GGUF string: u64 length, then the bytes.
fn gstr(s: &[u8]) -> Vec<u8> {
    let mut v = le64(s.len() as u64).to_vec();
    v.extend_from_slice(s);
    v
}

#[derive(Clone)]
enum Val {
    U8(u8),
    U32(u32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(Vec<u8>),
    ArrStr(Vec<String>),
    ArrF32(Vec<f32>),
    ArrI32(Vec<i32>),
    /// A type id followed by arbitrary bytes.
    Raw(u32, Vec<u8>),
}

fn s(v: &str) -> Val {
    Val::Str(v.as_bytes().to_vec())
}

impl Val {
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Val::U8(v) => {
                out.extend(le32(V_U8));
                out.push(*v);
            }
            Val::U32(v) => {
                out.extend(le32(V_U32));
                out.extend(le32(*v));
            }
            Val::U64(v) => {
                out.extend(le32(V_U64));
                out.extend(le64(*v));
            }
            Val::F32(v) => {
                out.extend(le32(V_F32));
                out.extend(v.to_le_bytes());
            }
            Val::Bool(v) => {
                out.extend(le32(V_BOOL));
                out.push(*v as u8);
            }
            Val::Str(v) => {
                out.extend(le32(V_STRING));
                out.extend(gstr(v));
            }
            Val::ArrStr(v) => {
                out.extend(le32(V_ARRAY));
                out.extend(le32(V_STRING));
                out.extend(le64(v.len() as u64));
                for s in v {
                    out.extend(gstr(s.as_bytes()));
                }
            }
            Val::ArrF32(v) => {
                out.extend(le32(V_ARRAY));
                out.extend(le32(V_F32));
                out.extend(le64(v.len() as u64));
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
            Val::ArrI32(v) => {
                out.extend(le32(V_ARRAY));
                out.extend(le32(V_I32));
                out.extend(le64(v.len() as u64));
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
            Val::Raw(ty, bytes) => {
                out.extend(le32(*ty));
                out.extend_from_slice(bytes);
            }
        }
    }
}

enum Kv {
    Typed(Vec<u8>, Val),
    /// A whole key/value entry written verbatim.
    Raw(Vec<u8>),
}

#[derive(Clone)]
struct Tensor {
    name: Vec<u8>,
    dims: Vec<u64>,
    /// Written instead of `dims.len()` when set.
    n_dims: Option<u32>,
    ty: u32,
    /// Written instead of the laid-out offset when set (the data stays where it was laid out).
    offset: Option<u64>,
    data: Vec<u8>,
}

struct Builder {
    magic: [u8; 4],
    version: u32,
    /// Written instead of the real counts when set.
    n_tensors: Option<u64>,
    n_kv: Option<u64>,
    kvs: Vec<Kv>,
    tensors: Vec<Tensor>,
    /// The alignment the builder pads with (`general.alignment` is set separately).
    align: u64,
    /// Bytes appended after the data.
    trailing: usize,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            magic: *b"GGUF",
            version: 3,
            n_tensors: None,
            n_kv: None,
            kvs: Vec::new(),
            tensors: Vec::new(),
            align: 32,
            trailing: 0,
        }
    }

    /// Appends a key/value (a second one with the same key included).
    fn kv(&mut self, key: &str, v: Val) -> &mut Self {
        self.kvs.push(Kv::Typed(key.as_bytes().to_vec(), v));
        self
    }

    fn kv_key_bytes(&mut self, key: &[u8], v: Val) -> &mut Self {
        self.kvs.push(Kv::Typed(key.to_vec(), v));
        self
    }

    fn kv_raw(&mut self, entry: Vec<u8>) -> &mut Self {
        self.kvs.push(Kv::Raw(entry));
        self
    }

    /// Replaces the value of `key`, or appends it.
    fn set(&mut self, key: &str, v: Val) -> &mut Self {
        for kv in &mut self.kvs {
            if let Kv::Typed(k, old) = kv
                && k == key.as_bytes()
            {
                *old = v;
                return self;
            }
        }
        self.kv(key, v)
    }

    fn remove(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|kv| !matches!(kv, Kv::Typed(k, _) if k == key.as_bytes()));
        self
    }

    /// A tensor with zero data of the size its type and dims imply.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32) -> &mut Self {
        let (b, bb) = block(ty);
        let n: u64 = dims.iter().product();
        self.tensor_data(name, dims, ty, vec![0; (n / b * bb) as usize])
    }

    fn tensor_data(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push(Tensor {
            name: name.as_bytes().to_vec(),
            dims: dims.to_vec(),
            n_dims: None,
            ty,
            offset: None,
            data,
        });
        self
    }

    /// A tensor info whose dims need not describe its data (no data is written for it).
    fn tensor_info(&mut self, name: &[u8], dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.tensors.push(Tensor {
            name: name.to_vec(),
            dims: dims.to_vec(),
            n_dims: None,
            ty,
            offset: Some(offset),
            data: Vec::new(),
        });
        self
    }

    fn tensor_mut(&mut self, name: &str) -> &mut Tensor {
        self.tensors.iter_mut().find(|t| t.name == name.as_bytes()).expect("no such tensor")
    }

    fn remove_tensor(&mut self, name: &str) -> &mut Self {
        self.tensors.retain(|t| t.name != name.as_bytes());
        self
    }

    /// Laid-out offsets of each tensor's data, relative to the data section.
    fn layout(&self) -> Vec<u64> {
        let mut at = 0u64;
        self.tensors
            .iter()
            .map(|t| {
                let o = at;
                at = (at + t.data.len() as u64).next_multiple_of(self.align);
                o
            })
            .collect()
    }

    fn build(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(self.magic);
        out.extend(le32(self.version));
        out.extend(le64(self.n_tensors.unwrap_or(self.tensors.len() as u64)));
        out.extend(le64(self.n_kv.unwrap_or(self.kvs.len() as u64)));
        for kv in &self.kvs {
            match kv {
                Kv::Typed(k, v) => {
                    out.extend(gstr(k));
                    v.encode(&mut out);
                }
                Kv::Raw(bytes) => out.extend_from_slice(bytes),
            }
        }
        let offsets = self.layout();
        for (t, &laid) in self.tensors.iter().zip(&offsets) {
            out.extend(gstr(&t.name));
            out.extend(le32(t.n_dims.unwrap_or(t.dims.len() as u32)));
            t.dims.iter().for_each(|&d| out.extend(le64(d)));
            out.extend(le32(t.ty));
            out.extend(le64(t.offset.unwrap_or(laid)));
        }
        if self.tensors.is_empty() {
            out.resize(out.len() + self.trailing, 0);
            return out;
        }
        let data_start = (out.len() as u64).next_multiple_of(self.align) as usize;
        out.resize(data_start, 0);
        for (t, &laid) in self.tensors.iter().zip(&offsets) {
            out.resize(data_start + laid as usize, 0);
            out.extend_from_slice(&t.data);
        }
        out.resize(out.len() + self.trailing, 0);
        out
    }
}

/// The 24-byte header of a file with no tensors and no metadata.
fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = Builder::new();
    b.version = version;
    b.n_tensors = Some(n_tensors);
    b.n_kv = Some(n_kv);
    b.build()
}

// ---------------------------------------------------------------------------------------------
// Assertions.

/// Parses `bytes`, expecting an error whose message contains `fragment`, with allocation bounded
/// by the file's size.
#[track_caller]
fn parse_err(bytes: &[u8], fragment: &str) -> GgufError {
    let (r, peak) = peak_bytes(|| Gguf::parse(bytes));
    let e = match r {
        Ok(g) => panic!("parsed, expected an error with {fragment:?}: {g:?}"),
        Err(e) => e,
    };
    assert!(
        e.message.contains(fragment),
        "error {:?} does not mention {fragment:?}",
        e.to_string()
    );
    assert!(
        peak <= SLACK + bytes.len(),
        "parsing a {}-byte file allocated {peak} bytes at peak ({e})",
        bytes.len()
    );
    e
}

#[track_caller]
fn parse_ok(bytes: &[u8]) -> Gguf {
    match Gguf::parse(bytes) {
        Ok(g) => g,
        Err(e) => panic!("expected a valid file: {e}"),
    }
}

#[track_caller]
fn load_err(bytes: &[u8]) -> Error {
    match Model::load(bytes) {
        Ok(_) => panic!("loaded, expected an error"),
        Err(e) => e,
    }
}

#[track_caller]
fn assert_invalid(e: Error, fragment: &str) {
    match &e {
        Error::InvalidModel(m) if m.contains(fragment) => {}
        _ => panic!("expected InvalidModel mentioning {fragment:?}, got {e:?}"),
    }
}

#[track_caller]
fn assert_unsupported(e: Error, fragment: &str) {
    match &e {
        Error::Unsupported(m) if m.contains(fragment) => {}
        _ => panic!("expected Unsupported mentioning {fragment:?}, got {e:?}"),
    }
}

/// A file with one metadata entry written verbatim.
fn with_kv_raw(entry: Vec<u8>) -> Vec<u8> {
    let mut b = Builder::new();
    b.kv_raw(entry);
    b.build()
}

/// A file with one metadata entry `key = v`.
fn with_kv(key: &str, v: Val) -> Vec<u8> {
    let mut b = Builder::new();
    b.kv(key, v);
    b.build()
}

/// A file with one tensor info (no data).
fn with_tensor_info(name: &[u8], dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut b = Builder::new();
    b.tensor_info(name, dims, ty, offset);
    b.build()
}

// ---------------------------------------------------------------------------------------------
// 1. Empty or truncated files, bad magic.

#[test]
fn smallest_valid_file_parses() {
    let bytes = header(3, 0, 0);
    assert_eq!(bytes.len(), 24);
    let g = parse_ok(&bytes);
    assert!(g.tensors.is_empty() && g.metadata.is_empty());
    assert_eq!(g.version, 3);
    parse_ok(&header(2, 0, 0));
}

#[test]
fn empty_and_truncated_headers() {
    let full = header(3, 0, 0);
    for n in 0..24 {
        let what = match n {
            0..4 => "too short to be GGUF",
            4..8 => "truncated: version",
            8..16 => "truncated: tensor count",
            _ => "truncated: metadata count",
        };
        let e = parse_err(&full[..n], what);
        assert!(e.offset <= n as u64, "{n} bytes: error offset {} past the end", e.offset);
    }
}

#[test]
fn every_truncation_of_a_model_is_an_error() {
    let bytes = tiny_gemma().build();
    let g = parse_ok(&bytes);
    let last_end = g.tensors.iter().map(|t| t.offset + t.n_bytes).max().unwrap_or(0);
    assert_eq!(last_end, bytes.len() as u64, "the last tensor ends the file");
    // Every cut in the header, then a sample of cuts in the data.
    let header_end = g.data_offset as usize;
    let cuts = (0..header_end).chain((header_end..bytes.len()).step_by(4093));
    for n in cuts {
        let (r, peak) = peak_bytes(|| Gguf::parse(&bytes[..n]));
        assert!(r.is_err(), "a file cut to {n} of {} bytes parsed", bytes.len());
        assert!(peak <= SLACK + 2 * n, "cut to {n} bytes: allocated {peak} bytes at peak");
    }
    let e = load_err(&bytes[..bytes.len() - 1]);
    assert_invalid(e, "lies past the end");
}

#[test]
fn a_header_parses_from_any_prefix_that_holds_it_and_asks_for_more_before() {
    let bytes = tiny_gemma().build();
    let whole = parse_ok(&bytes);
    let len = bytes.len() as u64;
    // Where the tensor infos end (the data starts at the next multiple of the alignment).
    let header_end = (0..=bytes.len()).find(|&n| matches!(Gguf::parse_prefix(&bytes[..n], len), Ok(Some(_)))).unwrap();
    assert!(header_end as u64 <= whole.data_offset && whole.data_offset - (header_end as u64) < whole.alignment);
    for n in 0..header_end {
        assert!(matches!(Gguf::parse_prefix(&bytes[..n], len), Ok(None)), "a prefix of {n} bytes");
    }
    for n in [header_end, header_end + 1, bytes.len()] {
        let g = Gguf::parse_prefix(&bytes[..n], len).unwrap().unwrap();
        assert_eq!((g.tensors, g.metadata.len(), g.data_offset), (whole.tensors.clone(), whole.metadata.len(), whole.data_offset));
    }
    // An error in the header is the whole file's error from any prefix that holds it, and a
    // file shorter than its tensors is caught from the header alone.
    let mut bad = bytes.clone();
    bad[..4].copy_from_slice(b"GGUX");
    for n in [4, 100, bytes.len()] {
        assert_eq!(Gguf::parse_prefix(&bad[..n], len).unwrap_err(), parse_err(&bad, "bad magic"));
    }
    let short = Gguf::parse_prefix(&bytes[..header_end], len - 1).unwrap_err();
    assert!(short.message.contains("lies past the end"), "{short}");
}

/// The tiny model's bytes, served in small reads as a file source would be: `piece` bytes of
/// a tensor at a time, every read counted.
struct Pieces<'a> {
    bytes: &'a [u8],
    piece: usize,
    reads: std::cell::RefCell<Vec<usize>>,
}

impl Source for Pieces<'_> {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }
    fn read(&self, offset: u64, len: usize) -> Result<std::borrow::Cow<'_, [u8]>, LoadError> {
        self.reads.borrow_mut().push(len);
        Source::read(&self.bytes, offset, len)
    }
    fn piece_bytes(&self) -> usize {
        self.piece
    }
}

#[test]
fn a_model_read_in_pieces_is_the_model_read_whole() {
    let bytes = tiny_gemma().build();
    let logits = |model: Model| {
        let model = Rc::new(model);
        let mut s = Session::new(Rc::clone(&model), 16).expect("a session");
        s.feed(&[2, 5, 6, 7]).expect("feed");
        s.logits().expect("logits").to_vec()
    };
    let want = logits(load_ok(&bytes));
    // Pieces of one row of a tensor (the widest row here is a few hundred bytes) and of a
    // few rows.
    for piece in [1, 700] {
        let src = Pieces { bytes: &bytes, piece, reads: Default::default() };
        let g = src.header().expect("the header");
        let model = Model::load_from(g, &src, None).expect("the model loads in pieces");
        let got = logits(model);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "pieces of {piece} bytes: other logits");
        let reads = src.reads.borrow();
        let widest = N_FF as usize * 4;
        let header = reads[0];
        assert!(reads[1..].iter().all(|&n| n <= piece.max(widest)), "pieces of {piece}: reads {reads:?}");
        assert!(header <= bytes.len(), "{header}");
    }
    // A file source that fails to read: a typed error, not a trap.
    struct Broken<'a>(&'a [u8]);
    impl Source for Broken<'_> {
        fn len(&self) -> u64 {
            self.0.len() as u64
        }
        fn read(&self, offset: u64, len: usize) -> Result<std::borrow::Cow<'_, [u8]>, LoadError> {
            if offset > 0 { Err(LoadError::Io(format!("disk gone at {offset}"))) } else { Source::read(&self.0, offset, len) }
        }
    }
    let src = Broken(&bytes);
    match Model::load_from(src.header().expect("the header"), &src, None) {
        Err(Error::Io(m)) => assert!(m.contains("disk gone"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("loaded from a broken source"),
    }
}

#[test]
fn bad_magic() {
    for magic in [*b"GGUG", *b"gguf", *b"GGML", *b"\0\0\0\0", *b"FUGG"] {
        let mut b = Builder::new();
        b.magic = magic;
        let e = parse_err(&b.build(), "bad magic");
        assert_eq!(e.offset, 0);
    }
    let e = load_err(b"PK\x03\x04 this is a zip file, not a model");
    assert_invalid(e, "not a GGUF file");
}

// ---------------------------------------------------------------------------------------------
// 2. Unsupported versions.

#[test]
fn unsupported_versions() {
    for v in [0, 1, 4, u32::MAX] {
        let e = parse_err(&header(v, 0, 0), &format!("unsupported GGUF version {v}"));
        assert_eq!(e.offset, 4);
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Huge counts in a tiny file: an error before anything is allocated.

#[test]
fn huge_tensor_count_in_a_tiny_file() {
    for n in [1u64 << 32, 1 << 63, u64::MAX] {
        let bytes = header(3, n, 0);
        let (r, peak) = peak_bytes(|| Gguf::parse(&bytes));
        let e = r.expect_err("a huge tensor count parsed");
        assert!(e.message.contains(&format!("tensor count {n} cannot fit")), "{e}");
        assert_eq!(e.offset, 8);
        assert!(peak < 4096, "allocated {peak} bytes before rejecting tensor count {n}");
    }
}

#[test]
fn huge_metadata_count_in_a_tiny_file() {
    for n in [1u64 << 32, 1 << 63, u64::MAX] {
        let mut bytes = header(3, 0, n);
        // Some bytes after the header, so that the count is checked against what is left.
        bytes.extend([0u8; 100]);
        let (r, peak) = peak_bytes(|| Gguf::parse(&bytes));
        let e = r.expect_err("a huge metadata count parsed");
        assert!(e.message.contains(&format!("metadata count {n} cannot fit")), "{e}");
        assert_eq!(e.offset, 16);
        assert!(peak < 4096, "allocated {peak} bytes before rejecting metadata count {n}");
    }
}

#[test]
fn counts_that_fit_allocate_in_proportion_to_the_file() {
    // Counts as large as the bytes left allow, followed by garbage: whatever is reserved up
    // front from the counts stays within the bound.
    for size in [64usize, 1 << 10, 64 << 10, 1 << 20] {
        let mut bytes = header(3, 0, (size / 13) as u64);
        bytes.extend(std::iter::repeat_n(0xFFu8, size));
        parse_err(&bytes, "metadata key length");

        let mut bytes = header(3, (size / 32) as u64, 0);
        bytes.extend(std::iter::repeat_n(0x01u8, size));
        parse_err(&bytes, "tensor name length");

        // An array of as many strings as 8-byte length prefixes fit.
        let mut value = le32(V_STRING).to_vec();
        value.extend(le64((size / 8) as u64));
        value.extend(std::iter::repeat_n(0xFFu8, size));
        parse_err(&with_kv("tokenizer.ggml.tokens", Val::Raw(V_ARRAY, value)), "length");
    }
}

#[test]
fn the_allocator_counts() {
    let (v, peak) = peak_bytes(|| vec![1u8; 1 << 20]);
    assert!(peak >= 1 << 20, "peak {peak}");
    drop(v);
    let ((), peak) = peak_bytes(|| ());
    assert_eq!(peak, 0);
}

// ---------------------------------------------------------------------------------------------
// 4. String lengths.

#[test]
fn huge_string_lengths() {
    for len in [1u64 << 63, u64::MAX, 1 << 40] {
        // As a key.
        let mut entry = le64(len).to_vec();
        entry.extend(b"general.name");
        let e = parse_err(&with_kv_raw(entry), &format!("metadata key length {len} exceeds"));
        assert_eq!(e.offset, 24);

        // As a value.
        let mut value = le64(len).to_vec();
        value.extend(b"abc");
        parse_err(
            &with_kv("general.name", Val::Raw(V_STRING, value)),
            &format!("general.name length {len} exceeds"),
        );

        // As an array element.
        let mut value = le32(V_STRING).to_vec();
        value.extend(le64(1));
        value.extend(le64(len));
        parse_err(
            &with_kv("tokenizer.ggml.tokens", Val::Raw(V_ARRAY, value)),
            &format!("tokenizer.ggml.tokens length {len} exceeds"),
        );

        // As a tensor name.
        let mut b = Builder::new();
        b.tensor("a", &[4], GGUF_F32);
        let mut bytes = b.build();
        bytes[24..32].copy_from_slice(&le64(len));
        parse_err(&bytes, &format!("tensor name length {len} exceeds"));
    }
}

#[test]
fn string_longer_than_the_bytes_left() {
    let mut entry = le64(1000).to_vec();
    entry.extend(b"general.name");
    parse_err(&with_kv_raw(entry), "truncated: metadata key needs 1000 bytes, 12 left");

    let mut value = le64(500).to_vec();
    value.extend(b"short");
    parse_err(
        &with_kv("general.name", Val::Raw(V_STRING, value)),
        "truncated: general.name needs 500 bytes, 5 left",
    );
}

// ---------------------------------------------------------------------------------------------
// 5. Invalid UTF-8.

#[test]
fn key_not_utf8() {
    let e = parse_err(
        &{
            let mut b = Builder::new();
            b.kv_key_bytes(b"general.\xFFname", s("x"));
            b.build()
        },
        "metadata key is not valid UTF-8",
    );
    // The offset points at the bad byte.
    assert_eq!(e.offset, 24 + 8 + 8);
}

#[test]
fn value_not_utf8() {
    parse_err(
        &with_kv("general.name", Val::Str(b"ok \xC3\x28 bad".to_vec())),
        "general.name is not valid UTF-8",
    );
    parse_err(
        &with_kv(
            "tokenizer.ggml.tokens",
            Val::Raw(V_ARRAY, {
                let mut v = le32(V_STRING).to_vec();
                v.extend(le64(2));
                v.extend(gstr(b"fine"));
                v.extend(gstr(b"\xED\xA0\x80")); // a UTF-16 surrogate, encoded
                v
            }),
        ),
        "tokenizer.ggml.tokens is not valid UTF-8",
    );
}

#[test]
fn tensor_name_not_utf8() {
    parse_err(
        &with_tensor_info(b"blk.\xC0.weight", &[4], GGUF_F32, 0),
        "tensor name is not valid UTF-8",
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Keys and tensor names.

#[test]
fn empty_key() {
    let e = parse_err(&with_kv("", Val::U32(1)), "empty metadata key");
    assert_eq!(e.offset, 24);
}

#[test]
fn duplicate_key() {
    let mut b = Builder::new();
    b.kv("general.name", s("a")).kv("general.architecture", s("gemma3"));
    b.kv("general.name", Val::U32(7));
    parse_err(&b.build(), "duplicate key \"general.name\"");
}

#[test]
fn duplicate_tensor_name() {
    let mut b = Builder::new();
    b.tensor("a.weight", &[4], GGUF_F32).tensor("b.weight", &[4], GGUF_F32);
    b.tensor("a.weight", &[8], GGUF_F32);
    parse_err(&b.build(), "duplicate tensor name \"a.weight\"");
}

#[test]
fn tensor_name_length_cap() {
    let max = MAX_TENSOR_NAME_BYTES as usize;
    let mut b = Builder::new();
    b.tensor(&"n".repeat(max), &[4], GGUF_F32);
    let g = parse_ok(&b.build());
    assert_eq!(g.tensors[0].name.len(), max);

    for len in [max + 1, 256, 100_000] {
        let mut b = Builder::new();
        b.tensor(&"n".repeat(len), &[4], GGUF_F32);
        parse_err(&b.build(), &format!("tensor name of {len} bytes exceeds {max}"));
    }
}

// ---------------------------------------------------------------------------------------------
// 7. Huge array counts: an error at once, no long loop.

#[test]
fn huge_array_counts() {
    for (ty, count) in [
        (V_U8, 1u64 << 62),
        (V_U32, 1 << 62),
        (V_STRING, 1 << 62),
        (V_U64, 1 << 62),
        (V_BOOL, u64::MAX),
        (V_F32, 1 << 61),
    ] {
        let mut value = le32(ty).to_vec();
        value.extend(le64(count));
        value.extend([0u8; 64]);
        let start = Instant::now();
        let bytes = with_kv("tokenizer.ggml.scores", Val::Raw(V_ARRAY, value));
        let e = parse_err(&bytes, &format!("array length {count} cannot fit"));
        // Key entry: 8 + 21 bytes of key, 4 of value type, 4 of element type.
        assert_eq!(e.offset, 24 + 8 + 21 + 4 + 4, "rejected at the count, before any item");
        assert!(start.elapsed() < Duration::from_secs(2), "took {:?}", start.elapsed());
    }
}

#[test]
fn array_count_beyond_the_bytes_left_but_plausible() {
    // 1000 u32 claimed, 10 present: rejected at the count, not after reading the 10.
    let mut value = le32(V_U32).to_vec();
    value.extend(le64(1000));
    value.extend([0u8; 40]);
    parse_err(
        &with_kv("x", Val::Raw(V_ARRAY, value)),
        "array length 1000 cannot fit in the 40 bytes left",
    );
}

// ---------------------------------------------------------------------------------------------
// 8. Nested arrays, unknown types.

#[test]
fn nested_array() {
    let mut value = le32(V_ARRAY).to_vec();
    value.extend(le64(1));
    value.extend(le32(V_ARRAY));
    value.extend(le64(1));
    value.extend(le32(V_U8));
    value.extend(le64(1));
    value.push(0);
    parse_err(
        &with_kv("nested", Val::Raw(V_ARRAY, value)),
        "nested: nested arrays are not supported",
    );
}

#[test]
fn deeply_nested_arrays_do_not_recurse() {
    // 100 000 levels of "array of arrays": refused at the first level.
    let mut value = Vec::new();
    for _ in 0..100_000 {
        value.extend(le32(V_ARRAY));
        value.extend(le64(1));
    }
    parse_err(&with_kv("deep", Val::Raw(V_ARRAY, value)), "nested arrays are not supported");
}

#[test]
fn unknown_value_type() {
    for ty in [13u32, 14, 255, u32::MAX] {
        let e = parse_err(
            &with_kv("k", Val::Raw(ty, vec![0; 16])),
            &format!("k: unknown value type {ty}"),
        );
        assert_eq!(e.offset, 24 + 8 + 1 + 4);
    }
}

#[test]
fn unknown_array_element_type() {
    for ty in [13u32, 100, u32::MAX] {
        let mut value = le32(ty).to_vec();
        value.extend(le64(1));
        value.extend([0u8; 16]);
        parse_err(
            &with_kv("k", Val::Raw(V_ARRAY, value)),
            &format!("unknown array element type {ty}"),
        );
    }
}

#[test]
fn bool_that_is_neither_0_nor_1() {
    parse_err(&with_kv("flag", Val::Raw(V_BOOL, vec![2])), "flag: bool byte 2 is neither 0 nor 1");
}

// ---------------------------------------------------------------------------------------------
// 9 and 10. Known keys with the wrong type; alignment.

#[test]
fn alignment_of_the_wrong_type() {
    parse_err(&with_kv("general.alignment", s("32")), "general.alignment has type string, not u32");
    parse_err(&with_kv("general.alignment", Val::F32(32.0)), "general.alignment has type f32");
    parse_err(&with_kv("general.alignment", Val::U64(32)), "general.alignment has type u64");
}

#[test]
fn alignment_values() {
    for a in [0u32, 3, 48, 1 << 17, 1 << 31, u32::MAX] {
        parse_err(
            &with_kv("general.alignment", Val::U32(a)),
            &format!("general.alignment {a} is not a power of two"),
        );
    }
    // A valid non-default alignment is honoured for the data section and the offsets.
    for a in [1u32, 8, 64, 1 << 16] {
        let mut b = Builder::new();
        b.align = a as u64;
        b.kv("general.alignment", Val::U32(a));
        b.tensor("a", &[3], GGUF_F32).tensor("b", &[5], GGUF_F32);
        let bytes = b.build();
        let g = parse_ok(&bytes);
        assert_eq!(g.alignment, a as u64);
        assert_eq!(g.data_offset % a as u64, 0);
        assert_eq!(
            g.tensor("b").map(|t| t.offset),
            Some(g.data_offset + 12u64.next_multiple_of(a as u64))
        );
    }
    // Offsets aligned to 32 but not to the file's 64.
    let mut b = Builder::new();
    b.kv("general.alignment", Val::U32(64));
    b.tensor("a", &[8], GGUF_F32).tensor("b", &[8], GGUF_F32);
    parse_err(&b.build(), "tensor \"b\": offset 32 is not aligned to 64");
}

#[test]
fn known_model_key_of_the_wrong_type() {
    let mut b = tiny_gemma();
    b.set("gemma3.block_count", Val::F32(2.0));
    let e = load_err(&b.build());
    assert_invalid(e, "gemma3.block_count is f32");

    let mut b = tiny_gemma();
    b.set("gemma3.embedding_length", s("64"));
    assert_invalid(load_err(&b.build()), "gemma3.embedding_length is string");

    let mut b = tiny_gemma();
    b.set("general.architecture", Val::U32(3));
    assert_invalid(load_err(&b.build()), "general.architecture is u32");

    let mut b = tiny_gemma();
    b.set("tokenizer.ggml.tokens", Val::ArrF32(vec![0.0; N_VOCAB]));
    assert_invalid(
        load_err(&b.build()),
        "tokenizer.ggml.tokens is missing or not a list of strings",
    );

    let mut b = tiny_gemma();
    b.set("tokenizer.ggml.token_type", Val::ArrStr(vec!["1".into(); N_VOCAB]));
    assert_invalid(load_err(&b.build()), "token_type is not a list of integers");

    let mut b = tiny_gemma();
    b.set("tokenizer.ggml.scores", Val::ArrF32(vec![0.0; N_VOCAB - 1]));
    assert_invalid(load_err(&b.build()), "tokenizer.ggml.scores has 299 entries");

    let mut b = tiny_gemma();
    b.set("tokenizer.ggml.add_bos_token", Val::U8(1));
    assert_invalid(load_err(&b.build()), "add_bos_token is u8");

    let mut b = tiny_gemma();
    b.set("tokenizer.ggml.bos_token_id", Val::F32(2.0));
    assert_invalid(load_err(&b.build()), "bos_token_id is f32");
}

// ---------------------------------------------------------------------------------------------
// 11. Dimensions and sizes.

#[test]
fn n_dims_out_of_range() {
    for n in [0u32, 5, 64, u32::MAX] {
        let mut b = Builder::new();
        b.tensor("t", &[4], GGUF_F32);
        b.tensor_mut("t").n_dims = Some(n);
        parse_err(&b.build(), &format!("tensor \"t\": n_dims {n} is not in 1..=4"));
    }
    // 4 dims are fine.
    let mut b = Builder::new();
    b.tensor("t", &[2, 3, 4, 5], GGUF_F32);
    assert_eq!(parse_ok(&b.build()).tensors[0].n_elements, 120);
}

#[test]
fn zero_dimension() {
    for dims in [[0u64, 4], [4, 0]] {
        parse_err(&with_tensor_info(b"t", &dims, GGUF_F32, 0), "tensor \"t\": a dimension is 0");
    }
}

#[test]
fn dimension_product_overflows() {
    parse_err(&with_tensor_info(b"t", &[1 << 32, 1 << 32], GGUF_F32, 0), "element count overflows");
    parse_err(&with_tensor_info(b"t", &[u64::MAX, 2], GGUF_F32, 0), "element count overflows");
    parse_err(
        &with_tensor_info(b"t", &[1 << 16, 1 << 16, 1 << 16, 1 << 16], GGUF_F32, 0),
        "element count overflows",
    );
}

#[test]
fn byte_size_overflows() {
    // 2^62 elements of 4 bytes.
    parse_err(
        &with_tensor_info(b"t", &[1 << 62], GGUF_F32, 0),
        "tensor \"t\": byte size overflows",
    );
    parse_err(&with_tensor_info(b"t", &[1 << 63], GGUF_F16, 0), "byte size overflows");
    // Q8_0: 2^59 - 1 blocks of 34 bytes.
    parse_err(&with_tensor_info(b"t", &[u64::MAX - 31], GGUF_Q8_0, 0), "byte size overflows");
}

#[test]
fn huge_but_representable_tensor_lies_past_the_end() {
    parse_err(&with_tensor_info(b"t", &[1 << 40, 1 << 20], GGUF_F32, 0), "lies past the end");
}

// ---------------------------------------------------------------------------------------------
// 12. Tensor types.

#[test]
fn unknown_tensor_type() {
    for ty in [4u32, 5, 16, 22, 29, 31, 39, 1000, u32::MAX] {
        parse_err(
            &with_tensor_info(b"t", &[256], ty, 0),
            &format!("tensor \"t\": unknown tensor type {ty}"),
        );
    }
}

#[test]
fn first_dimension_not_a_multiple_of_the_block() {
    parse_err(
        &with_tensor_info(b"t", &[100, 4], GGUF_Q4_K, 0),
        "first dimension 100 is not a multiple of Q4_K's block of 256",
    );
    parse_err(
        &with_tensor_info(b"t", &[48, 2], GGUF_Q8_0, 0),
        "first dimension 48 is not a multiple of Q8_0's block of 32",
    );
    // The block constraint is on the first dimension only.
    let mut b = Builder::new();
    b.tensor("t", &[256, 3], GGUF_Q4_K);
    let g = parse_ok(&b.build());
    assert_eq!(g.tensors[0].kind, TensorType::Q4K);
    assert_eq!(g.tensors[0].n_bytes, 3 * 144);
}

// ---------------------------------------------------------------------------------------------
// 13. Tensor offsets.

#[test]
fn offsets_out_of_order() {
    let mut b = Builder::new();
    b.tensor_data("a", &[8], GGUF_F32, vec![1; 32]);
    b.tensor_data("b", &[8], GGUF_F32, vec![2; 32]);
    b.tensor_data("c", &[8], GGUF_F32, vec![3; 32]);
    // Swap where the infos say a and c lie: data order c, b, a.
    b.tensor_mut("a").offset = Some(64);
    b.tensor_mut("c").offset = Some(0);
    parse_err(&b.build(), "tensor \"b\" at offset 32 comes before tensor \"a\" at offset 64");

    // Gaps between tensors, in order, are fine: each is read from its own offset.
    let mut b = Builder::new();
    b.tensor_data("a", &[8], GGUF_F32, vec![1; 32]);
    b.tensor_data("b", &[8], GGUF_F32, vec![2; 32]);
    b.tensor_mut("b").offset = Some(64);
    let mut bytes = b.build();
    bytes.extend([0; 32]);
    let g = parse_ok(&bytes);
    let at = |n: &str| g.tensor(n).map(|t| bytes[t.offset as usize]);
    assert_eq!((at("a"), at("b")), (Some(1), Some(0)));
}

#[test]
fn overlapping_tensors() {
    let mut b = Builder::new();
    b.tensor("a", &[16], GGUF_F32).tensor("b", &[16], GGUF_F32);
    b.tensor_mut("b").offset = Some(32); // a is 64 bytes at 0
    parse_err(&b.build(), "tensor \"b\" overlaps tensor \"a\"");

    // The same data for two names.
    let mut b = Builder::new();
    b.tensor("a", &[16], GGUF_F32).tensor("b", &[16], GGUF_F32);
    b.tensor_mut("b").offset = Some(0);
    parse_err(&b.build(), "overlaps");

    // A small tensor inside a big one, with a third between them in the infos: out of order.
    let mut b = Builder::new();
    b.tensor("big", &[64], GGUF_F32).tensor("x", &[8], GGUF_F32).tensor("small", &[8], GGUF_F32);
    b.tensor_mut("big").offset = Some(0);
    b.tensor_mut("x").offset = Some(256);
    b.tensor_mut("small").offset = Some(96);
    parse_err(&b.build(), "tensor \"small\" at offset 96 comes before tensor \"x\"");
}

#[test]
fn misaligned_offset() {
    let mut b = Builder::new();
    b.tensor("a", &[16], GGUF_F32).tensor("b", &[16], GGUF_F32);
    b.tensor_mut("b").offset = Some(65);
    parse_err(&b.build(), "tensor \"b\": offset 65 is not aligned to 32");
}

#[test]
fn offset_past_the_end() {
    let mut b = Builder::new();
    b.tensor("a", &[16], GGUF_F32);
    b.tensor_mut("a").offset = Some(64);
    parse_err(&b.build(), "tensor \"a\": data at offset 64 + 64 bytes lies past the end");

    // Offsets near u64::MAX: offset + size overflows.
    for offset in [u64::MAX / 32 * 32, 1 << 63] {
        let mut b = Builder::new();
        b.tensor("a", &[16], GGUF_F32);
        b.tensor_mut("a").offset = Some(offset);
        parse_err(&b.build(), "lies past the end");
    }

    // One byte short.
    let mut b = Builder::new();
    b.tensor("a", &[16], GGUF_F32);
    let mut bytes = b.build();
    bytes.pop();
    parse_err(&bytes, "lies past the end of the");
}

// ---------------------------------------------------------------------------------------------
// 14. Semantic errors, through Model::load on a tiny but otherwise valid Gemma 3.

const N_EMBD: u64 = 64;
const N_LAYER: u32 = 2;
const N_FF: u64 = 256;
const N_HEAD: u32 = 2;
const N_HEAD_KV: u32 = 1;
const HEAD_DIM: u64 = 32;
const N_CTX: u32 = 128;
const N_VOCAB: usize = 300;

/// Deterministic values in [-scale, scale].
struct Rng(u64);
impl Rng {
    fn f32(&mut self, scale: f32) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// Q8_0 blocks with scale 1/64 and random quants.
fn q8_0_bytes(n: u64, rng: &mut Rng) -> Vec<u8> {
    let d = 0x2400u16.to_le_bytes(); // f16 1/64
    let mut out = Vec::new();
    for _ in 0..n / 32 {
        out.extend(d);
        out.extend((0..32).map(|_| (rng.f32(100.0) as i8) as u8));
    }
    out
}

/// The vocabulary: 4 specials, 256 byte tokens, then some pieces.
fn vocab() -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"].map(String::from).to_vec();
    let mut types = vec![3, 3, 3, 2];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let pieces = ["\u{2581}", "\u{2581}a", "\u{2581}the", "he", "ll", "o", "\u{2581}w", "or", "ld"];
    let mut i = 0;
    while tokens.len() < N_VOCAB {
        let p = pieces.get(i).map(|p| p.to_string()).unwrap_or(format!("p{i}"));
        tokens.push(p);
        types.push(1);
        i += 1;
    }
    (tokens, types)
}

/// A complete Gemma 3 of 2 layers, n_embd 64, 2 heads of 32 (one KV head), vocabulary 300.
fn tiny_gemma() -> Builder {
    let mut b = Builder::new();
    let (tokens, types) = vocab();
    b.kv("general.architecture", s("gemma3"))
        .kv("general.name", s("tiny hostile-test gemma"))
        .kv("gemma3.context_length", Val::U32(N_CTX))
        .kv("gemma3.embedding_length", Val::U32(N_EMBD as u32))
        .kv("gemma3.block_count", Val::U32(N_LAYER))
        .kv("gemma3.feed_forward_length", Val::U32(N_FF as u32))
        .kv("gemma3.attention.head_count", Val::U32(N_HEAD))
        .kv("gemma3.attention.head_count_kv", Val::U32(N_HEAD_KV))
        .kv("gemma3.attention.key_length", Val::U32(HEAD_DIM as u32))
        .kv("gemma3.attention.value_length", Val::U32(HEAD_DIM as u32))
        .kv("gemma3.attention.layer_norm_rms_epsilon", Val::F32(1e-6))
        .kv("gemma3.rope.freq_base", Val::F32(1e6))
        .kv("gemma3.attention.sliding_window", Val::U32(8))
        .kv("tokenizer.ggml.model", s("llama"))
        .kv("tokenizer.ggml.scores", Val::ArrF32((0..N_VOCAB).map(|i| -(i as f32)).collect()))
        .kv("tokenizer.ggml.token_type", Val::ArrI32(types))
        .kv("tokenizer.ggml.tokens", Val::ArrStr(tokens))
        .kv("tokenizer.ggml.bos_token_id", Val::U32(2))
        .kv("tokenizer.ggml.eos_token_id", Val::U32(1))
        .kv("tokenizer.ggml.unknown_token_id", Val::U32(3))
        .kv("tokenizer.ggml.padding_token_id", Val::U32(0))
        .kv("tokenizer.ggml.add_bos_token", Val::Bool(true));

    let mut rng = Rng(0x2545F4914F6CDD1D);
    let mut matrix = |b: &mut Builder, name: &str, n_out: u64, n_in: u64, ty: u32| {
        let n = n_out * n_in;
        let data = match ty {
            GGUF_Q8_0 => q8_0_bytes(n, &mut rng),
            _ => f32_bytes((0..n).map(|_| rng.f32(0.1))),
        };
        b.tensor_data(name, &[n_in, n_out], ty, data);
    };
    let ones = |n: u64| f32_bytes((0..n).map(|_| 1.0));
    let (nq, nkv) = (N_HEAD as u64 * HEAD_DIM, N_HEAD_KV as u64 * HEAD_DIM);
    matrix(&mut b, "token_embd.weight", N_VOCAB as u64, N_EMBD, GGUF_F32);
    for l in 0..N_LAYER {
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        b.tensor_data(&name("attn_norm"), &[N_EMBD], GGUF_F32, ones(N_EMBD));
        matrix(&mut b, &name("attn_q"), nq, N_EMBD, GGUF_Q8_0);
        matrix(&mut b, &name("attn_k"), nkv, N_EMBD, GGUF_F32);
        matrix(&mut b, &name("attn_v"), nkv, N_EMBD, GGUF_F32);
        b.tensor_data(&name("attn_q_norm"), &[HEAD_DIM], GGUF_F32, ones(HEAD_DIM));
        b.tensor_data(&name("attn_k_norm"), &[HEAD_DIM], GGUF_F32, ones(HEAD_DIM));
        matrix(&mut b, &name("attn_output"), N_EMBD, nq, GGUF_F32);
        b.tensor_data(&name("post_attention_norm"), &[N_EMBD], GGUF_F32, ones(N_EMBD));
        b.tensor_data(&name("ffn_norm"), &[N_EMBD], GGUF_F32, ones(N_EMBD));
        matrix(&mut b, &name("ffn_gate"), N_FF, N_EMBD, GGUF_Q8_0);
        matrix(&mut b, &name("ffn_up"), N_FF, N_EMBD, GGUF_F32);
        matrix(&mut b, &name("ffn_down"), N_EMBD, N_FF, GGUF_F32);
        b.tensor_data(&name("post_ffw_norm"), &[N_EMBD], GGUF_F32, ones(N_EMBD));
    }
    b.tensor_data("output_norm.weight", &[N_EMBD], GGUF_F32, ones(N_EMBD));
    b
}

#[track_caller]
fn load_ok(bytes: &[u8]) -> Model {
    match Model::load(bytes) {
        Ok(m) => m,
        Err(e) => panic!("the model should load: {e}"),
    }
}

#[test]
fn positive_control_loads_and_runs() {
    let bytes = tiny_gemma().build();
    let model = Rc::new(load_ok(&bytes));
    assert_eq!(model.n_vocab(), N_VOCAB);
    assert_eq!(model.n_ctx_train(), N_CTX as usize);
    assert_eq!(model.summary.n_layers, N_LAYER);
    assert_eq!(model.summary.architecture, "gemma3");

    let ids = model.tokenizer.encode("hello world", true, false);
    assert_eq!(ids.first(), Some(&2), "BOS first: {ids:?}");
    assert!(ids.iter().all(|&t| (t as usize) < N_VOCAB));

    let mut s = Session::new(Rc::clone(&model), 16).expect("a session of 16 tokens");
    assert_eq!(s.capacity(), 16);
    s.feed(&ids[..3.min(ids.len())]).expect("feed");
    s.feed(&[5, 6]).expect("a second feed");
    let fed = s.position();
    let logits = s.logits().expect("logits").to_vec();
    assert_eq!(logits.len(), N_VOCAB);
    assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");

    // 16. Hostile prompts: each is refused and leaves the session as it was.
    match s.feed(&[N_VOCAB as u32]) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("not below the vocabulary size 300"), "{m}")
        }
        other => panic!("expected InvalidArgument, got {:?}", other.err()),
    }
    match s.feed(&[1, u32::MAX, 2]) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains(&format!("token id {}", u32::MAX)), "{m}")
        }
        other => panic!("expected InvalidArgument, got {:?}", other.err()),
    }
    match s.feed(&[]) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("no tokens"), "{m}"),
        other => panic!("expected InvalidArgument, got {:?}", other.err()),
    }
    let too_many = vec![7u32; 16 - fed + 1];
    match s.feed(&too_many) {
        Err(Error::ContextFull(m)) => assert!(m.contains("exceed the capacity of 16"), "{m}"),
        other => panic!("expected ContextFull, got {:?}", other.err()),
    }
    assert_eq!(s.position(), fed, "a refused feed changed the context");
    assert_eq!(s.logits().expect("logits").to_vec(), logits, "a refused feed changed the logits");

    // The context fills exactly, then is full.
    s.feed(&vec![8u32; 16 - fed]).expect("filling the context exactly");
    match s.feed(&[9]) {
        Err(Error::ContextFull(_)) => {}
        other => panic!("expected ContextFull, got {:?}", other.err()),
    }

    // A prompt longer than any context in one go.
    let mut s = Session::new(Rc::clone(&model), 0).expect("a session of the trained context");
    assert_eq!(s.capacity(), N_CTX as usize);
    match s.feed(&vec![5u32; N_CTX as usize + 1]) {
        Err(Error::ContextFull(_)) => {}
        other => panic!("expected ContextFull, got {:?}", other.err()),
    }
    match s.logits() {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("no token has been fed"), "{m}"),
        other => panic!("expected InvalidArgument, got {:?}", other.err()),
    }
}

#[test]
fn session_context_larger_than_the_model_is_refused() {
    let model = Rc::new(load_ok(&tiny_gemma().build()));
    match Session::new(model, N_CTX as usize + 1) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("exceeds the model's 128"), "{m}"),
        Err(e) => panic!("expected InvalidArgument, got {e:?}"),
        Ok(_) => panic!("a session beyond the model's context was created"),
    }
}

#[test]
fn hostile_text_tokenizes() {
    let model = load_ok(&tiny_gemma().build());
    let texts = [
        "",
        " ",
        "<bos><eos><unk><pad>",
        "\u{0}\u{1}\u{7F}",
        "\u{1F600} emoji and \u{202E}bidi",
        &"a".repeat(5000),
        &"<0xFF>".repeat(50),
    ];
    for text in texts {
        for (special, parse) in [(true, true), (false, false)] {
            let ids = model.tokenizer.encode(text, special, parse);
            assert!(ids.iter().all(|&t| (t as usize) < N_VOCAB), "{text:?}: {ids:?}");
            let _ = model.tokenizer.decode(&ids, true);
        }
    }
    // Ids outside the vocabulary decode to nothing.
    assert_eq!(model.tokenizer.decode(&[N_VOCAB as u32, u32::MAX], true), "");
}

#[test]
fn block_count_above_the_cap() {
    for (n, what) in
        [(513u32, "gemma3.block_count = 513 exceeds the cap of 512"), (u32::MAX, "exceeds the cap")]
    {
        let mut b = tiny_gemma();
        b.set("gemma3.block_count", Val::U32(n));
        assert_invalid(load_err(&b.build()), what);
    }
    let mut b = tiny_gemma();
    b.set("gemma3.block_count", Val::U64(u64::MAX));
    assert_invalid(load_err(&b.build()), "exceeds the cap");
    let mut b = tiny_gemma();
    b.set("gemma3.block_count", Val::U32(0));
    assert_invalid(load_err(&b.build()), "gemma3.block_count is 0");
    // More layers than the file has tensors for.
    let mut b = tiny_gemma();
    b.set("gemma3.block_count", Val::U32(3));
    assert_invalid(load_err(&b.build()), "tensor blk.2.attn_norm.weight is missing");
}

#[test]
fn other_hyperparameters_above_their_caps() {
    for (key, v, what) in [
        (
            "gemma3.embedding_length",
            u32::MAX,
            "gemma3.embedding_length = 4294967295 exceeds the cap",
        ),
        (
            "gemma3.feed_forward_length",
            u32::MAX,
            "feed_forward_length = 4294967295 exceeds the cap",
        ),
        ("gemma3.attention.head_count", 1 << 20, "head_count = 1048576 exceeds the cap"),
        (
            "gemma3.attention.key_length",
            u32::MAX,
            "attention.key_length 4294967295 is not a usable head size",
        ),
        ("gemma3.attention.key_length", 31, "attention.key_length 31 is not a usable head size"),
    ] {
        let mut b = tiny_gemma();
        b.set(key, Val::U32(v));
        assert_invalid(load_err(&b.build()), what);
    }
    let mut b = tiny_gemma();
    b.remove("gemma3.embedding_length");
    assert_invalid(load_err(&b.build()), "gemma3.embedding_length is missing");
}

#[test]
fn head_count_zero() {
    let mut b = tiny_gemma();
    b.set("gemma3.attention.head_count", Val::U32(0));
    assert_invalid(load_err(&b.build()), "gemma3.attention.head_count is 0");
}

#[test]
fn head_count_kv_not_dividing_head_count() {
    for kv in [0u32, 3, 4] {
        let mut b = tiny_gemma();
        b.set("gemma3.attention.head_count_kv", Val::U32(kv));
        assert_invalid(
            load_err(&b.build()),
            &format!("attention.head_count_kv = {kv} does not divide head_count = 2"),
        );
    }
    let mut b = tiny_gemma();
    b.set("gemma3.attention.head_count_kv", Val::U64((1 << 32) + 1));
    assert_invalid(load_err(&b.build()), "does not divide head_count = 2");
    let mut b = tiny_gemma();
    b.set("gemma3.attention.head_count_kv", Val::U64(1 << 32));
    assert_invalid(load_err(&b.build()), "does not divide head_count = 2");
}

#[test]
fn head_count_not_dividing_the_width() {
    // Without key_length the head size is n_embd / head_count.
    let mut b = tiny_gemma();
    b.remove("gemma3.attention.key_length").remove("gemma3.attention.value_length");
    b.set("gemma3.attention.head_count", Val::U32(3));
    b.set("gemma3.attention.head_count_kv", Val::U32(1));
    assert_invalid(load_err(&b.build()), "head_count 3 does not divide embedding_length 64");
    // With key_length, the attention width must agree with the tensors.
    let mut b = tiny_gemma();
    b.set("gemma3.attention.head_count", Val::U32(4));
    b.set("gemma3.attention.head_count_kv", Val::U32(2));
    assert_invalid(
        load_err(&b.build()),
        "tensor blk.0.attn_q.weight has shape [64, 64], the metadata implies [64, 128]",
    );
}

#[test]
fn value_length_differs_from_key_length() {
    let mut b = tiny_gemma();
    b.set("gemma3.attention.value_length", Val::U32(16));
    assert_unsupported(load_err(&b.build()), "value_length 16 differs from key_length 32");
}

#[test]
fn implausible_floats() {
    for (key, v) in [
        ("gemma3.attention.layer_norm_rms_epsilon", f32::NAN),
        ("gemma3.attention.layer_norm_rms_epsilon", 0.0),
        ("gemma3.attention.layer_norm_rms_epsilon", -1.0),
        ("gemma3.rope.freq_base", f32::NAN),
        ("gemma3.rope.freq_base", 0.5),
    ] {
        let mut b = tiny_gemma();
        b.set(key, Val::F32(v));
        assert_invalid(load_err(&b.build()), "implausible hyperparameters");
    }
}

#[test]
fn huge_sliding_window_and_context_length_are_clamped() {
    for window in [u64::MAX, u64::MAX - 63, 1 << 40] {
        let mut b = tiny_gemma();
        b.set("gemma3.attention.sliding_window", Val::U64(window));
        b.set("gemma3.context_length", Val::U64(u64::MAX));
        let model = Rc::new(load_ok(&b.build()));
        // Contexts of 1 and 2 tokens: the smallest rings, where an overflowing window + batch
        // would leave no room at all.
        for n_ctx in [1usize, 2, 16] {
            let mut s = Session::new(Rc::clone(&model), n_ctx).expect("session");
            for t in 0..n_ctx as u32 {
                s.feed(&[5 + t]).expect("feed");
            }
            assert!(s.logits().expect("logits").iter().all(|v| v.is_finite()));
        }
    }
    let mut b = tiny_gemma();
    b.set("gemma3.attention.sliding_window", Val::U32(0));
    assert_invalid(load_err(&b.build()), "window 0");
}

#[test]
fn special_token_id_outside_the_vocabulary() {
    for key in ["bos_token_id", "eos_token_id", "unknown_token_id", "eot_token_id"] {
        for id in [N_VOCAB as u64, (1 << 32) + 1, u64::MAX] {
            let mut b = tiny_gemma();
            b.set(&format!("tokenizer.ggml.{key}"), Val::U64(id));
            assert_invalid(
                load_err(&b.build()),
                &format!("tokenizer.ggml.{key} = {id} is not below the vocabulary size 300"),
            );
        }
    }
    // -1 as u32 means "none", as in llama.cpp.
    let mut b = tiny_gemma();
    b.set("tokenizer.ggml.eos_token_id", Val::U32(u32::MAX));
    let m = load_ok(&b.build());
    assert_eq!(m.tokenizer.eos, None);
}

/// The tiny Gemma's weights as `arch` (`qwen2` or `llama`): no extra norms, q/k/v biases, and
/// a byte-level BPE vocabulary (`gpt2`, pre-tokenizer `qwen2`).
fn tiny_qwen2(arch: &str) -> Builder {
    let mut b = tiny_gemma();
    for kv in &mut b.kvs {
        if let Kv::Typed(k, _) = kv
            && let Some(rest) = k.strip_prefix(b"gemma3.")
        {
            *k = [format!("{arch}.").as_bytes(), rest].concat();
        }
    }
    b.set("general.architecture", s(arch))
        .remove(&format!("{arch}.attention.sliding_window"))
        .set("tokenizer.ggml.model", s("gpt2"))
        .set("tokenizer.ggml.pre", s("qwen2"))
        .set("tokenizer.ggml.merges", Val::ArrStr(vec!["h e".into(), "l l".into(), "o r".into()]))
        .set("tokenizer.ggml.add_bos_token", Val::Bool(false));
    let (nq, nkv) = (N_HEAD as u64 * HEAD_DIM, N_HEAD_KV as u64 * HEAD_DIM);
    for l in 0..N_LAYER {
        for t in ["attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"] {
            b.remove_tensor(&format!("blk.{l}.{t}.weight"));
        }
        for (t, n) in [("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv)] {
            b.tensor_data(&format!("blk.{l}.{t}.bias"), &[n], GGUF_F32, f32_bytes((0..n).map(|i| i as f32 / 1e3)));
        }
    }
    b
}

#[test]
fn qwen2_and_llama_positive_controls_load_and_run() {
    for arch in ["qwen2", "llama"] {
        let model = Rc::new(load_ok(&tiny_qwen2(arch).build()));
        assert_eq!(model.summary.architecture, arch);
        let ids = model.tokenizer.encode("hello world", true, false);
        assert!(!ids.is_empty() && ids.iter().all(|&t| (t as usize) < N_VOCAB), "{ids:?}");
        assert_ne!(ids.first(), Some(&2), "no BOS: {ids:?}");
        let mut s = Session::new(Rc::clone(&model), 16).expect("a session");
        s.feed(&[5, 6, 7]).expect("feed");
        assert!(s.logits().expect("logits").iter().all(|v| v.is_finite()), "{arch}: non-finite logits");
    }
    // Biases are optional; the q/k/v weights are not.
    let mut b = tiny_qwen2("llama");
    for l in 0..N_LAYER {
        for t in ["attn_q", "attn_k", "attn_v"] {
            b.remove_tensor(&format!("blk.{l}.{t}.bias"));
        }
    }
    load_ok(&b.build());
    b.remove_tensor("blk.1.attn_k.weight");
    assert_invalid(load_err(&b.build()), "tensor blk.1.attn_k.weight is missing");
}

#[test]
fn granite_smollm3_and_phi3_scales_are_checked() {
    // Granite needs its logit scale (llama.cpp requires it) and a usable number in each.
    assert_invalid(load_err(&tiny_qwen2("granite").build()), "granite.logit_scale is missing");
    let mut b = tiny_qwen2("granite");
    b.set("granite.logit_scale", Val::F32(8.0)).set("granite.residual_scale", Val::F32(f32::NAN));
    assert_invalid(load_err(&b.build()), "granite.residual_scale = NaN is not a usable scale");
    b.set("granite.residual_scale", Val::F32(0.22)).set("granite.attention.scale", Val::F32(-1.0));
    assert_invalid(load_err(&b.build()), "granite.attention.scale = -1 is not a usable scale");
    b.set("granite.attention.scale", Val::F32(0.0078125));
    for arch in [b, tiny_qwen2("smollm3")] {
        let model = Rc::new(load_ok(&arch.build()));
        let mut s = Session::new(Rc::clone(&model), 16).expect("a session");
        s.feed(&[5, 6, 7]).expect("feed");
        assert!(s.logits().expect("logits").iter().all(|v| v.is_finite()), "{}", model.summary.architecture);
    }
    // Phi-3.5's attention factor scales the rotation's cosines and sines: a usable number.
    let mut b = tiny_qwen2("phi3");
    b.set("phi3.rope.scaling.attn_factor", Val::F32(f32::INFINITY));
    assert_invalid(load_err(&b.build()), "phi3.rope.scaling.attn_factor = inf is not a usable factor");
}

#[test]
fn qwen2_problems() {
    let mut b = tiny_qwen2("qwen2");
    b.tensor_mut("blk.0.attn_q.bias").dims = vec![HEAD_DIM];
    assert_invalid(load_err(&b.build()), "tensor blk.0.attn_q.bias has shape");

    let mut b = tiny_qwen2("llama");
    b.tensor_data("rope_freqs.weight", &[HEAD_DIM / 2], GGUF_F32, f32_bytes((0..HEAD_DIM / 2).map(|_| 0.0)));
    assert_invalid(load_err(&b.build()), "rope_freqs.weight holds the factor 0");

    // A partial rotation turns an even count of at most a head's values; half a head loads.
    for (dims, error) in [(HEAD_DIM as u32 + 2, "rope.dimension_count 34 is not"), (15, "rope.dimension_count 15 is not"), (0, "rope.dimension_count 0 is not")] {
        let mut b = tiny_qwen2("qwen2");
        b.set("qwen2.rope.dimension_count", Val::U32(dims));
        assert_invalid(load_err(&b.build()), error);
    }
    let mut b = tiny_qwen2("qwen2");
    b.set("qwen2.rope.dimension_count", Val::U32(HEAD_DIM as u32 / 2));
    let mut half = Session::new(Rc::new(load_ok(&b.build())), 16).expect("a session");
    half.feed(&[5, 6, 7]).expect("feed");
    assert!(half.logits().expect("logits").iter().all(|v| v.is_finite()));

    let mut b = tiny_qwen2("qwen2");
    b.set("qwen2.rope.scaling.type", s("longrope"));
    assert_unsupported(load_err(&b.build()), "rope scaling \"longrope\"");

    // YaRN's parameters are usable numbers, its factor at least 1.
    for (key, value, error) in [
        ("rope.scaling.factor", 0.5, "implausible YaRN scaling"),
        ("rope.scaling.yarn_beta_fast", f32::NAN, "qwen2.rope.scaling.yarn_beta_fast = NaN is not a usable YaRN parameter"),
        ("rope.scaling.yarn_beta_slow", -1.0, "qwen2.rope.scaling.yarn_beta_slow = -1 is not a usable YaRN parameter"),
    ] {
        let mut b = tiny_qwen2("qwen2");
        b.set("qwen2.rope.scaling.type", s("yarn"));
        b.set("qwen2.rope.scaling.factor", Val::F32(4.0));
        b.set(&format!("qwen2.{key}"), Val::F32(value));
        assert_invalid(load_err(&b.build()), error);
    }
    // OLMo 3's pattern holds a flag for each layer.
    let mut b = tiny_qwen2("olmo2");
    b.set("olmo2.attention.sliding_window", Val::U32(16));
    let flags = [&7u32.to_le_bytes()[..], &5u64.to_le_bytes(), &[1, 1, 0, 1, 1]].concat();
    b.set("olmo2.attention.sliding_window_pattern", Val::Raw(9, flags));
    assert_invalid(load_err(&b.build()), "olmo2.attention.sliding_window_pattern has 5 flags for");
    // Gemma's sliding layers' base and pattern are usable.
    let mut b = tiny_gemma();
    b.set("gemma3.rope.freq_base_swa", Val::F32(f32::NAN));
    assert_invalid(load_err(&b.build()), "gemma3.rope.freq_base_swa = NaN is not a usable base");
    let mut b = tiny_gemma();
    b.set("gemma3.attention.sliding_window_pattern", Val::Raw(9, [&7u32.to_le_bytes()[..], &1u64.to_le_bytes(), &[1]].concat()));
    assert_invalid(load_err(&b.build()), "gemma3.attention.sliding_window_pattern has 1 flags for");
    // A mixture of experts (Mixtral's `llama` files) is refused as such.
    let mut b = tiny_qwen2("llama");
    b.set("llama.expert_count", Val::U32(8));
    assert_unsupported(load_err(&b.build()), "a mixture of experts (llama.expert_count = 8)");
    // Mistral 3's attention temperature is a usable number.
    let mut b = tiny_qwen2("mistral3");
    b.set("mistral3.attention.temperature_scale", Val::F32(f32::INFINITY));
    assert_invalid(load_err(&b.build()), "mistral3.attention.temperature_scale = inf is not a usable scale");

    let mut b = tiny_qwen2("qwen2");
    b.set("tokenizer.ggml.pre", s("no-such-pre"));
    assert_unsupported(load_err(&b.build()), "tokenizer.ggml.pre = \"no-such-pre\"");
}

#[test]
fn tokenizer_problems() {
    let mut b = tiny_gemma();
    b.set("tokenizer.ggml.model", s("rwkv"));
    assert_unsupported(load_err(&b.build()), "unsupported tokenizer model \"rwkv\"");

    // Byte-level BPE needs a pre-tokenizer this engine has, and its merges.
    let mut b = tiny_gemma();
    b.set("tokenizer.ggml.model", s("gpt2"));
    // `gemma4`: a name llama.cpp knows, whose vocabulary is not byte-level.
    b.set("tokenizer.ggml.pre", s("gemma4"));
    assert_unsupported(load_err(&b.build()), "tokenizer.ggml.pre = \"gemma4\"");
    b.set("tokenizer.ggml.pre", s("qwen2"));
    assert_invalid(load_err(&b.build()), "tokenizer.ggml.merges is missing");
    b.set("tokenizer.ggml.merges", Val::ArrI32(vec![1, 2]));
    assert_invalid(load_err(&b.build()), "tokenizer.ggml.merges is missing or not a list of strings");

    let mut b = tiny_gemma();
    b.remove("tokenizer.ggml.model");
    assert_invalid(load_err(&b.build()), "tokenizer.ggml.model is missing");

    let mut b = tiny_gemma();
    b.set("tokenizer.ggml.tokens", Val::ArrStr(Vec::new()));
    assert_invalid(load_err(&b.build()), "tokenizer.ggml.tokens is missing");

    // One token fewer than the embedding has rows.
    let mut b = tiny_gemma();
    let (mut tokens, mut types) = vocab();
    tokens.pop();
    types.pop();
    b.set("tokenizer.ggml.tokens", Val::ArrStr(tokens));
    b.set("tokenizer.ggml.token_type", Val::ArrI32(types));
    b.set("tokenizer.ggml.scores", Val::ArrF32(vec![0.0; N_VOCAB - 1]));
    assert_invalid(load_err(&b.build()), "the embedding has 300 rows, the vocabulary 299 tokens");

    // Duplicate token texts and odd token types still load.
    let mut b = tiny_gemma();
    let (mut tokens, mut types) = vocab();
    tokens[290] = "<bos>".into();
    types[291] = -7;
    types[292] = i32::MAX;
    b.set("tokenizer.ggml.tokens", Val::ArrStr(tokens));
    b.set("tokenizer.ggml.token_type", Val::ArrI32(types));
    load_ok(&b.build());
}

#[test]
fn architecture_problems() {
    let mut b = tiny_gemma();
    b.remove("general.architecture");
    assert_invalid(load_err(&b.build()), "general.architecture is missing");

    let mut b = tiny_gemma();
    b.set("general.architecture", s("mamba"));
    assert_unsupported(load_err(&b.build()), "architecture \"mamba\"");
}

#[test]
fn required_tensor_missing() {
    for name in [
        "token_embd.weight",
        "output_norm.weight",
        "blk.0.attn_q.weight",
        "blk.1.ffn_up.weight",
        "blk.1.post_ffw_norm.weight",
        "blk.0.attn_k_norm.weight",
    ] {
        let mut b = tiny_gemma();
        b.remove_tensor(name);
        assert_invalid(load_err(&b.build()), &format!("tensor {name} is missing"));
    }
}

#[test]
fn tensor_shape_disagrees_with_the_metadata() {
    let cases: [(&str, &[u64], &str); 5] = [
        (
            "blk.0.attn_k.weight",
            &[64, 64],
            "tensor blk.0.attn_k.weight has shape [64, 64], the metadata implies [64, 32]",
        ),
        (
            "blk.1.ffn_down.weight",
            &[64, 256],
            "tensor blk.1.ffn_down.weight has shape [64, 256], the metadata implies [256, 64]",
        ),
        ("blk.0.attn_norm.weight", &[32], "has shape [32], the metadata implies [64]"),
        ("blk.0.attn_q_norm.weight", &[32, 1], "has shape [32, 1], the metadata implies [32]"),
        (
            "token_embd.weight",
            &[32, 300],
            "token_embd.weight has shape [32, 300], expected [64, n_vocab]",
        ),
    ];
    for (name, dims, what) in cases {
        let mut b = tiny_gemma();
        let n: u64 = dims.iter().product();
        let t = b.tensor_mut(name);
        t.dims = dims.to_vec();
        t.data = f32_bytes((0..n).map(|_| 0.01));
        assert_invalid(load_err(&b.build()), what);
    }
    // An output projection of the wrong shape.
    let mut b = tiny_gemma();
    b.tensor("output.weight", &[64, 299], GGUF_F32);
    assert_invalid(
        load_err(&b.build()),
        "tensor output.weight has shape [64, 299], the metadata implies [64, 300]",
    );
}

#[test]
fn tensor_type_the_engine_cannot_compute_with() {
    let mut b = tiny_gemma();
    b.remove_tensor("blk.1.ffn_down.weight");
    b.tensor("blk.1.ffn_down.weight", &[N_FF, N_EMBD], GGUF_Q8_K);
    assert_unsupported(
        load_err(&b.build()),
        "tensor blk.1.ffn_down.weight has type Q8_K, which this engine does not compute with",
    );
    // I32 is a known type, but not for weights.
    let mut b = tiny_gemma();
    b.remove_tensor("output_norm.weight");
    b.tensor("output_norm.weight", &[N_EMBD], GGUF_I32);
    assert_unsupported(load_err(&b.build()), "output_norm.weight has type I32");
}

#[test]
fn width_not_a_multiple_of_32() {
    // n_embd 48: valid as a GGUF and for F32, but the kernels work in blocks of 32.
    let mut b = tiny_gemma();
    b.set("gemma3.embedding_length", Val::U32(48));
    b.set("gemma3.attention.key_length", Val::U32(24));
    b.set("gemma3.attention.value_length", Val::U32(24));
    let names: Vec<String> =
        b.tensors.iter().map(|t| String::from_utf8_lossy(&t.name).into_owned()).collect();
    for name in names {
        let t = b.tensor_mut(&name);
        t.ty = GGUF_F32;
        t.dims = t
            .dims
            .iter()
            .map(|&d| match d {
                64 => 48,
                32 => 24,
                d => d,
            })
            .collect();
        let n: u64 = t.dims.iter().product();
        t.data = f32_bytes((0..n).map(|_| 0.01));
    }
    let e = load_err(&b.build());
    assert_unsupported(e, "is not a multiple of 32");
}

// ---------------------------------------------------------------------------------------------
// 15. Memory the guest cannot have.

#[test]
fn impossible_allocations_are_refused_not_aborted() {
    assert!(!can_allocate(usize::MAX));
    assert!(!can_allocate(isize::MAX as usize));
    assert!(can_allocate(1 << 10));
}

// ---------------------------------------------------------------------------------------------
// Sanity of the builder: metadata round-trips.

#[test]
fn builder_round_trip() {
    let mut b = Builder::new();
    b.kv("a.u8", Val::U8(7))
        .kv("a.u32", Val::U32(70_000))
        .kv("a.u64", Val::U64(1 << 40))
        .kv("a.f32", Val::F32(0.5))
        .kv("a.bool", Val::Bool(true))
        .kv("a.str", s("hé"))
        .kv("a.strs", Val::ArrStr(vec!["x".into(), String::new()]))
        .kv("a.i32s", Val::ArrI32(vec![-1, 2]));
    b.tensor("t", &[32, 2], GGUF_Q8_0);
    let g = parse_ok(&b.build());
    assert_eq!(g.get("a.u8"), Some(&Value::U8(7)));
    assert_eq!(g.get_u64("a.u32"), Ok(Some(70_000)));
    assert_eq!(g.get_u64("a.u64"), Ok(Some(1 << 40)));
    assert_eq!(g.get_f64("a.f32"), Ok(Some(0.5)));
    assert_eq!(g.get_bool("a.bool"), Ok(Some(true)));
    assert_eq!(g.get_str("a.str"), Ok(Some("hé")));
    assert_eq!(g.get_array("a.strs").map(|a| a.map(|a| a.len())), Ok(Some(2)));
    assert_eq!(g.get_array("a.i32s").map(|a| a.and_then(|a| a.int_at(0))), Ok(Some(-1)));
    assert!(g.get_u64("a.str").is_err());
    let t = g.tensor("t").expect("tensor t");
    assert_eq!((t.n_elements, t.n_bytes, t.offset), (64, 68, g.data_offset));
}

/// A device that keeps what it is given (no programs: a model on it does not load past its
/// weights), counting what it holds; with `caches`, it also makes kv-caches.
#[derive(Default)]
struct Holding {
    live: Rc<Cell<isize>>,
    made: Rc<Cell<usize>>,
    caches: bool,
}

impl wisp_guest::dispatch::Device for Holding {
    fn allocate(&self, _: wisp_guest::upload::Format, _: u32, _: u32) -> Result<usize, wisp_guest::dispatch::DeviceError> {
        self.live.set(self.live.get() + 1);
        self.made.set(self.made.get() + 1);
        Ok(self.made.get())
    }
    fn write_rows(&self, _: usize, _: u32, _: &[u8], _: &[f32]) -> Result<(), wisp_guest::dispatch::DeviceError> {
        Ok(())
    }
    fn matmul(&self, _: &[f32], _: u32, _: u32, _: &[usize]) -> Result<Vec<Vec<f32>>, wisp_guest::dispatch::DeviceError> {
        Err(wisp_guest::dispatch::DeviceError::Unavailable("no products".into()))
    }
    fn free(&self, _: usize) {
        self.live.set(self.live.get() - 1);
    }
    fn create_kv_cache(&self, _: u32, _: u32) -> Result<usize, wisp_guest::dispatch::DeviceError> {
        if self.caches { Ok(0) } else { Err(wisp_guest::dispatch::DeviceError::Unavailable("no kv-cache".into())) }
    }
}

/// The offer of a [`Holding`] device with `budget` bytes, the weights to live on it alone.
fn holding(budget: u64) -> (wisp_guest::engine::DeviceOffer, Rc<Cell<isize>>, Rc<Cell<usize>>) {
    let device = Holding::default();
    let (live, made) = (device.live.clone(), device.made.clone());
    let limits = wisp_guest::dispatch::DeviceLimits {
        name: "holding".into(),
        max_weight_bytes: u64::MAX,
        max_activation_elements: u64::MAX,
        budget_bytes: budget,
        budget_handles: u32::MAX,
    };
    let offer = wisp_guest::engine::DeviceOffer { mode: wisp_guest::dispatch::Mode::Auto, device: Box::new(device), limits, weights_on_device: true };
    (offer, live, made)
}

#[test]
fn weights_streamed_to_a_device_are_freed_when_the_file_breaks_mid_stream() {
    let bytes = tiny_gemma().build();
    // A file whose reads fail from half way through its tensors (the header read whole).
    struct Cut<'a>(&'a [u8], u64);
    impl Source for Cut<'_> {
        fn len(&self) -> u64 {
            self.0.len() as u64
        }
        fn read(&self, offset: u64, len: usize) -> Result<std::borrow::Cow<'_, [u8]>, LoadError> {
            if offset > 0 && offset + len as u64 > self.1 { Err(LoadError::Io(format!("the file ends at {}", self.1))) } else { Source::read(&self.0, offset, len) }
        }
    }
    let header = Gguf::parse(&bytes).expect("the header");
    let first = header.tensors.iter().map(|t| t.offset).min().unwrap();
    let cut = Cut(&bytes, first + (bytes.len() as u64 - first) / 2);
    let (offer, live, made) = holding(u64::MAX);
    match Model::load_from(cut.header().expect("the header"), &cut, Some(offer)) {
        Err(Error::Io(m)) => assert!(m.contains("the file ends at"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("loaded from a cut file"),
    }
    assert!(made.get() > 0, "nothing went to the device before the cut");
    assert_eq!(live.get(), 0, "weights left on the device after the failed load");

    // The whole file: every matrix goes to the device; one that does not run programs leaves
    // the model unloaded (the guest has no copy to run it with), and nothing on the device.
    let (offer, live, made) = holding(u64::MAX);
    match Model::load_from(Gguf::parse(&bytes).unwrap(), &bytes.as_slice(), Some(offer)) {
        Err(Error::Unsupported(m)) => assert!(m.contains("does not run its program"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a model without weights loaded"),
    }
    assert!(made.get() >= 7 && live.get() == 0, "made {}, left {}", made.get(), live.get());

    // A budget below the weights: refused before anything is made, in one line with both
    // numbers.
    let (offer, _, made) = holding(1000);
    match Model::load_from(Gguf::parse(&bytes).unwrap(), &bytes.as_slice(), Some(offer)) {
        Err(Error::OutOfMemory(m)) => assert!(m.contains("on the device, past its budget of 0 MiB") && !m.contains('\n'), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("loaded past the budget"),
    }
    assert_eq!(made.get(), 0);
}

/// With `On`, a device that takes every weight and makes kv-caches is chosen to hold the weights
/// alone; where it then does not run the model's program, the guest reads the file again and
/// keeps its own copy: the model loads, not on the device, and what the first attempt made
/// there is freed.
#[test]
fn a_device_chosen_to_hold_the_weights_that_runs_no_program_leaves_them_to_the_guest() {
    let bytes = tiny_gemma().build();
    let (mut offer, live, made) = holding(u64::MAX);
    offer.mode = wisp_guest::dispatch::Mode::On;
    offer.weights_on_device = false;
    offer.device = Box::new(Holding { live: live.clone(), made: made.clone(), caches: true });
    let model = Model::load_from(Gguf::parse(&bytes).unwrap(), &bytes.as_slice(), Some(offer)).expect("the guest's own copy");
    assert!(!model.on_device(), "the weights were left on a device that runs no program");
    // The second attempt places a copy of each matrix on the device (`On`); the first
    // attempt's are gone.
    assert_eq!(live.get() as usize, model.gpu_weights, "made {}, left {}", made.get(), live.get());
    assert!(made.get() > model.gpu_weights, "the device was not chosen first: made {}", made.get());
}
