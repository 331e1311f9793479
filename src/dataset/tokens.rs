//! A flat stream of tokens cut into training windows.

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::guard::Watched;

use super::{check_out, Column, DType, Dataset, MappedFile};
use crate::error::{Error, Result};
use crate::util::{fold, mix};

/// How a token stream is cut into samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Windows {
    /// Window `i` starts at token `i * seq_len`: consecutive, non-overlapping inputs
    /// (each window's last token is the next window's first, as the target).
    Consecutive,
    /// Each window starts at a random offset drawn from `(seed, epoch, i)`, as GPT
    /// pretraining loops do; an epoch has as many windows as the consecutive cut.
    Random {
        /// The seed of the offsets.
        seed: u64,
    },
}

impl Windows {
    /// The first token of window `index` of `epoch` over a stream of `tokens` tokens cut
    /// into windows of `seq_len + 1` (`tokens > seq_len`).
    pub(super) fn start(self, epoch: u64, index: u64, seq_len: usize, tokens: u64) -> u64 {
        match self {
            Windows::Consecutive => index * seq_len as u64,
            Windows::Random { seed } => {
                let starts = tokens - seq_len as u64;
                mix(mix(seed ^ 0x746f_6b65_6e73)
                    ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    ^ mix(index))
                    % starts
            }
        }
    }

    /// The windows of part `part` of a set of several token streams: the same for the
    /// first part and for consecutive windows; random ones are drawn from another seed
    /// for each later part, so parts of one length are not cut alike.
    pub fn for_part(self, part: usize) -> Windows {
        match self {
            Windows::Random { seed } if part > 0 => Windows::Random {
                seed: mix(seed ^ mix(part as u64)),
            },
            other => other,
        }
    }

    /// Checks that `seq_len` makes windows: at least 1, and rows that fit in memory.
    ///
    /// # Errors
    /// [`Error::Config`] otherwise.
    pub(super) fn check(seq_len: usize) -> Result<()> {
        match seq_len == 0 || seq_len >= (isize::MAX as usize) / 8 {
            true => Err(Error::Config(format!("seq_len {seq_len} is out of range"))),
            false => Ok(()),
        }
    }

    /// What tells these windows apart from others over the same stream, for a
    /// [`Dataset::fingerprint`].
    pub(super) fn fingerprint_parts(self) -> [u64; 2] {
        match self {
            Windows::Consecutive => [1, 0],
            Windows::Random { seed } => [2, seed],
        }
    }

    /// Windows an epoch has over a stream of `tokens` tokens: as many as the
    /// consecutive cut, whose last target is the stream's last token.
    pub(super) fn count(seq_len: usize, tokens: u64) -> u64 {
        tokens.saturating_sub(1) / seq_len as u64
    }
}

/// The llm.c / modded-nanogpt token file header: 256 little-endian int32 before the
/// tokens (llm.c's `dev/data/data_common.py`, `write_datafile`).
const LLMC_HEADER_BYTES: usize = 1024;
/// (magic, version, token type) of the llm.c formats: GPT-2 and LLaMA-3 tokens.
const LLMC_FORMATS: [(i32, i32, DType); 2] = [(20240520, 1, DType::U16), (20240801, 7, DType::U32)];

/// The first words of an llm.c header, when the file starts with one of its magics.
struct LlmcHeader {
    magic: i32,
    words: Option<[i32; 3]>,
}

/// Reads the llm.c header at the start of `bytes`, if it starts with an llm.c magic.
fn llmc_header(bytes: &[u8]) -> Option<LlmcHeader> {
    let word = |i: usize| {
        bytes
            .get(4 * i..4 * i + 4)
            .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")))
    };
    let magic = word(0)?;
    LLMC_FORMATS
        .iter()
        .any(|f| f.0 == magic)
        .then(|| LlmcHeader {
            magic,
            words: (bytes.len() >= LLMC_HEADER_BYTES)
                .then(|| [word(0), word(1), word(2)].map(|w| w.expect("within the header"))),
        })
}

impl LlmcHeader {
    /// Checks the header against the file and the token type asked for; returns where
    /// the tokens start.
    fn check(&self, path: &Path, bytes: &[u8], dtype: DType) -> Result<usize> {
        let Some([_, version, count]) = self.words else {
            return Err(Error::dataset(
                path,
                format!(
                    "starts with the llm.c magic {} but is {} bytes, shorter than its \
                     {LLMC_HEADER_BYTES}-byte header",
                    self.magic,
                    bytes.len()
                ),
            ));
        };
        let Some(&(_, _, width)) = LLMC_FORMATS
            .iter()
            .find(|f| f.0 == self.magic && f.1 == version)
        else {
            return Err(Error::dataset(
                path,
                format!(
                    "llm.c token file (magic {}) of version {version}: stokehold reads \
                     version 1 (magic 20240520, uint16) and version 7 (magic 20240801, uint32)",
                    self.magic
                ),
            ));
        };
        if width != dtype {
            return Err(Error::dataset(
                path,
                format!("its llm.c header says {width} tokens, {dtype} were asked for"),
            ));
        }
        let held = (bytes.len() - LLMC_HEADER_BYTES) as u64 / width.size() as u64;
        let whole = (bytes.len() - LLMC_HEADER_BYTES) % width.size() == 0;
        if count < 0 || count as u64 != held || !whole {
            return Err(Error::dataset(
                path,
                format!(
                    "its llm.c header counts {count} tokens, but the file holds {} bytes of \
                     tokens after the header ({held} {width} tokens)",
                    bytes.len() - LLMC_HEADER_BYTES
                ),
            ));
        }
        Ok(LLMC_HEADER_BYTES)
    }
}

/// A flat token stream (a raw `.bin` of `u16`/`u32`, or a 1-d integer `.npy`) served
/// as windows of `seq_len + 1` tokens: `w[..seq_len]` is the input, `w[1..]` the
/// next-token target.
#[derive(Debug)]
pub struct TokenDataset {
    path: PathBuf,
    map: Mmap,
    watched: Watched,
    offset: usize,
    tokens: u64,
    dtype: DType,
    seq_len: usize,
    windows: Windows,
    columns: Vec<Column>,
}

impl TokenDataset {
    /// Opens a token file: an llm.c / modded-nanogpt `.bin` (a 1024-byte header of 256
    /// little-endian int32, magic 20240520 with version 1 for `u16` GPT-2 tokens or magic
    /// 20240801 with version 7 for `u32` LLaMA-3 tokens, then the token count, then the
    /// tokens), or a headerless nanoGPT-style stream of `dtype` (`U16` or `U32`) tokens.
    /// A file that starts with an llm.c magic is read as one, and must be whole.
    ///
    /// # Errors
    /// [`Error::Io`] if it cannot be read; [`Error::Dataset`] if its length is not a
    /// whole number of tokens, it is too short for one window, or its llm.c header is
    /// cut short, of an unknown version, of another token width than `dtype`, or counts
    /// other than the tokens the file holds; [`Error::Config`] for another dtype or
    /// `seq_len == 0`.
    pub fn open_bin(
        path: impl AsRef<Path>,
        dtype: DType,
        seq_len: usize,
        windows: Windows,
    ) -> Result<TokenDataset> {
        let path = path.as_ref();
        if !matches!(dtype, DType::U16 | DType::U32) {
            return Err(Error::Config(format!(
                "token files hold uint16 or uint32, not {dtype}"
            )));
        }
        Self::open_with(path, dtype, seq_len, windows, |map| {
            match llmc_header(map) {
                Some(header) => header.check(path, map, dtype),
                None => Ok(0),
            }
        })
    }

    /// The token type the llm.c header at the start of `path` names (`U16` for version
    /// 1, `U32` for version 7); `None` for a file that does not start with a known
    /// header (a headerless stream, whose type the file cannot tell). Pass it to
    /// [`open_bin`](TokenDataset::open_bin) to read either kind without being told.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be read; [`Error::Dataset`] if it is not a
    /// regular file.
    pub fn header_dtype(path: impl AsRef<Path>) -> Result<Option<DType>> {
        let path = path.as_ref();
        let mut head = [0u8; 8];
        match std::io::Read::read_exact(&mut super::open_regular(path)?, &mut head) {
            Ok(()) => {}
            // Shorter than a magic and a version: no header.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(Error::io(path, e)),
        }
        let word =
            |i: usize| i32::from_le_bytes(head[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        Ok(LLMC_FORMATS
            .iter()
            .find(|f| f.0 == word(0) && f.1 == word(1))
            .map(|f| f.2))
    }

    /// Opens the token file at `path`, whose tokens of `dtype` follow the bytes that
    /// `header` reads and checks (it returns how many there are).
    ///
    /// # Errors
    /// As [`open_bin`](TokenDataset::open_bin), and `header`'s.
    pub(super) fn open_with(
        path: &Path,
        dtype: DType,
        seq_len: usize,
        windows: Windows,
        header: impl FnOnce(&[u8]) -> Result<usize>,
    ) -> Result<TokenDataset> {
        let (watched, map) =
            super::open_mapped(path, || Error::dataset(path, "the token file is empty"))?;
        let len = watched.len();
        let offset = header(&map)?;
        let body = len - offset as u64;
        if body % dtype.size() as u64 != 0 {
            return Err(Error::dataset(
                path,
                format!(
                    "{body} bytes is not a whole number of {}-byte {dtype} tokens",
                    dtype.size()
                ),
            ));
        }
        Self::build(
            path,
            (watched, map),
            offset,
            body / dtype.size() as u64,
            dtype,
            seq_len,
            windows,
        )
    }

    /// Opens a 1-d `.npy` array of integer tokens.
    ///
    /// # Errors
    /// Anything [`NpyArray::open`](super::NpyArray::open) returns; [`Error::Dataset`] if the array is not 1-d
    /// integers or is too short for one window.
    pub fn open_npy(
        path: impl AsRef<Path>,
        seq_len: usize,
        windows: Windows,
    ) -> Result<TokenDataset> {
        let path = path.as_ref();
        let array = super::open_integers(path, "a token stream")?;
        let (offset, tokens, dtype) = (
            array.header().data_offset as usize,
            array.rows(),
            array.dtype(),
        );
        Self::build(
            path,
            array.into_parts(),
            offset,
            tokens,
            dtype,
            seq_len,
            windows,
        )
    }

    fn build(
        path: &Path,
        (watched, map): (Watched, Mmap),
        offset: usize,
        tokens: u64,
        dtype: DType,
        seq_len: usize,
        windows: Windows,
    ) -> Result<TokenDataset> {
        Windows::check(seq_len)?;
        if tokens < seq_len as u64 + 1 {
            return Err(Error::dataset(
                path,
                format!(
                    "holds {tokens} tokens, fewer than one window of seq_len + 1 = {}",
                    seq_len + 1
                ),
            ));
        }
        let columns = vec![Column {
            name: "tokens".into(),
            dtype,
            shape: vec![seq_len as u64 + 1],
            row_bytes: (seq_len + 1) * dtype.size(),
        }];
        Ok(TokenDataset {
            path: path.to_path_buf(),
            map,
            watched,
            offset,
            tokens,
            dtype,
            seq_len,
            windows,
            columns,
        })
    }

    /// Number of tokens in the stream.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The window length minus one.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The first token of window `index` in `epoch`.
    ///
    /// # Panics
    /// If `index >= len()` (its start would overflow or pass the stream).
    pub fn window_start(&self, epoch: u64, index: u64) -> u64 {
        assert!(index < self.len(), "window {index} of {}", self.len());
        self.windows.start(epoch, index, self.seq_len, self.tokens)
    }
}

impl Dataset for TokenDataset {
    /// Covers the windows (consecutive, or random and their seed) and their length.
    fn fingerprint(&self) -> u64 {
        let [kind, seed] = self.windows.fingerprint_parts();
        fold([kind, seed, self.seq_len as u64])
    }

    fn same_every_epoch(&self) -> bool {
        self.windows == Windows::Consecutive
    }

    fn len(&self) -> u64 {
        Windows::count(self.seq_len, self.tokens)
    }

    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        check_out(&self.columns, indices.len(), out)?;
        let rb = self.columns[0].row_bytes;
        let len = self.len();
        if let Some(&index) = indices.iter().find(|&&i| i >= len) {
            return Err(Error::OutOfRange { index, len });
        }
        self.watched.read(&self.map, |map| {
            let data = &map[self.offset..];
            for (dst, &index) in out[0].chunks_exact_mut(rb).zip(indices) {
                let start = self.window_start(epoch, index) as usize * self.dtype.size();
                dst.copy_from_slice(&data[start..start + rb]);
            }
        })
    }

    fn locate(&self, epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        if index >= self.len() {
            return;
        }
        let start = self.window_start(epoch, index) as usize * self.dtype.size();
        each(0, self.offset + start, self.columns[0].row_bytes);
    }

    fn files(&self) -> Vec<MappedFile<'_>> {
        vec![MappedFile::new(&self.path, &self.map).watched_by(&self.watched)]
    }
}
