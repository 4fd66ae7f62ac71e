//! Where a model's bytes come from: a whole GGUF file already in memory (`&[u8]`, what
//! `from-bytes` gives), or a file read a piece at a time (`FileSource`, what `open` uses), so
//! that loading holds the converted weights and one piece of the file, never the whole file
//! beside them.

use crate::gguf::Gguf;
use crate::models::LoadError;
use std::borrow::Cow;
use std::cell::RefCell;
use std::io::{Read, Seek, SeekFrom};
use std::rc::Rc;

/// The most bytes of a tensor read at once while loading: what a load holds besides the
/// weights it has converted.
pub const PIECE_BYTES: usize = 4 << 20;

/// The first read of a file's header; a longer header is read again with twice as many.
const HEADER_BYTES: usize = 8 << 20;

/// Random access to a GGUF file's bytes.
pub trait Source {
    /// The file's length in bytes.
    fn len(&self) -> u64;

    /// The `len` bytes at `offset`.
    fn read(&self, offset: u64, len: usize) -> Result<Cow<'_, [u8]>, LoadError>;

    /// The most bytes of a tensor the loader reads at once (a whole row at least).
    fn piece_bytes(&self) -> usize {
        PIECE_BYTES
    }

    /// Where the model's matrices go as they are read: the device, a piece at a time, the
    /// guest keeping none of their rows (`crate::upload::Streaming`). `None`, the default:
    /// into the guest's memory, as its CPU kernels read them.
    fn device(&self) -> Option<&crate::upload::Streaming<'_>> {
        None
    }

    /// The same bytes again, to be read after the load (the embedding's rows, read as tokens
    /// need them where the device holds the weights). `None` where the source cannot be kept:
    /// bytes in memory, borrowed for the load.
    fn reopen(&self) -> Option<Rc<dyn Source>> {
        None
    }

    /// The file's header, read with as few bytes as it takes.
    fn header(&self) -> Result<Gguf, LoadError> {
        let mut want = HEADER_BYTES;
        loop {
            let n = want.min(usize::try_from(self.len()).unwrap_or(usize::MAX));
            let prefix = self.read(0, n)?;
            match Gguf::parse_prefix(&prefix, self.len()) {
                Ok(Some(g)) => return Ok(g),
                Ok(None) if (n as u64) < self.len() => want = want.saturating_mul(2),
                // A prefix that is the whole file is never short; a parse error says why.
                Ok(None) => return Err(LoadError::Invalid("the GGUF header lies past the end of the file".into())),
                Err(e) => return Err(LoadError::Invalid(e.to_string())),
            }
        }
    }
}

impl Source for &[u8] {
    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }

    fn read(&self, offset: u64, len: usize) -> Result<Cow<'_, [u8]>, LoadError> {
        let bytes: &[u8] = self;
        let piece = usize::try_from(offset).ok().and_then(|at| bytes.get(at..at.checked_add(len)?));
        piece.map(Cow::Borrowed).ok_or_else(|| {
            LoadError::Invalid(format!("{len} bytes at offset {offset} lie past the end of the {}-byte file", bytes.len()))
        })
    }
}

/// A file, read where the loader asks.
pub struct FileSource {
    path: String,
    file: RefCell<std::fs::File>,
    len: u64,
}

impl FileSource {
    pub fn open(path: &str) -> Result<FileSource, LoadError> {
        let io = |e: std::io::Error| LoadError::Io(format!("{path}: {e}"));
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        Ok(FileSource { path: path.to_string(), file: RefCell::new(file), len })
    }
}

impl Source for FileSource {
    fn len(&self) -> u64 {
        self.len
    }

    fn reopen(&self) -> Option<Rc<dyn Source>> {
        let again = FileSource::open(&self.path).ok().filter(|f| f.len == self.len)?;
        Some(Rc::new(again))
    }

    fn read(&self, offset: u64, len: usize) -> Result<Cow<'_, [u8]>, LoadError> {
        let io = |e: std::io::Error| LoadError::Io(format!("{}: {len} bytes at offset {offset}: {e}", self.path));
        if offset.checked_add(len as u64).is_none_or(|end| end > self.len) {
            return Err(LoadError::Invalid(format!("{len} bytes at offset {offset} lie past the end of the {}-byte file", self.len)));
        }
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(len).map_err(|_| LoadError::OutOfMemory(format!("{}: {len} bytes do not fit in guest memory", self.path)))?;
        bytes.resize(len, 0);
        let mut file = self.file.borrow_mut();
        file.seek(SeekFrom::Start(offset)).map_err(io)?;
        file.read_exact(&mut bytes).map_err(io)?;
        Ok(Cow::Owned(bytes))
    }
}
