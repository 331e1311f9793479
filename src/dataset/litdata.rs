//! LitData datasets optimized for its `TokensLoader` (litgpt's pretraining data): the
//! token streams of the chunk files an `index.json` lists, read in place.
//!
//! `litdata.optimize(..., item_loader=TokensLoader())` writes `chunk-<w>-<n>.bin`
//! files, each a little-endian `u32` item count `n`, `n + 1` `u32` item offsets (bytes
//! from the file's start; the first just past them), then the items' tokens back to
//! back, and an `index.json` whose `config.data_format` names the token type
//! (`no_header_tensor:<torch dtype code>` or `no_header_numpy:<numpy type code>`) and
//! whose `chunks` list each file with its item count (`chunk_size`) and tokens (`dim`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::arrow::u32_at;
use super::mds::falling_offset;
use super::{Concat, DType, Dataset, TokenDataset, Windows};
use crate::error::{Error, Result};

/// `index.json`, as far as it is needed here.
#[derive(serde::Deserialize)]
struct Index {
    chunks: Vec<ChunkEntry>,
    config: Config,
}

#[derive(serde::Deserialize)]
struct ChunkEntry {
    filename: String,
    chunk_size: u64,
    dim: Option<u64>,
}

#[derive(serde::Deserialize)]
struct Config {
    data_format: Vec<String>,
    #[serde(default)]
    compression: Option<String>,
    #[serde(default)]
    item_loader: Option<String>,
    /// LitData's `encryption` (its kind and level), `null` for plain chunks.
    #[serde(default)]
    encryption: Option<serde_json::Value>,
}

/// The token types of `no_header_tensor` codes (LitData's `_TORCH_DTYPES_MAPPING`).
fn torch_dtype(code: u32) -> Option<DType> {
    Some(match code {
        11 => DType::U8,
        12 => DType::I8,
        13 | 14 => DType::I16,
        15 | 16 => DType::I32,
        17 | 18 => DType::I64,
        20 => DType::U16,
        _ => return None,
    })
}

/// The token types of `no_header_numpy` codes (LitData's `_NUMPY_DTYPES_MAPPING`).
fn numpy_dtype(code: u32) -> Option<DType> {
    [
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
    ]
    .get(code as usize)
    .copied()
}

/// A LitData dataset of token chunks, its `index.json` read and checked.
#[derive(Debug, Clone)]
pub struct LitData {
    dtype: DType,
    /// Each chunk file, with its items and tokens as the index counts them.
    chunks: Vec<(PathBuf, u64, u64)>,
}

impl LitData {
    /// Reads the `index.json` of the LitData dataset at `dir` (or that file itself),
    /// written by `litdata.optimize` with `item_loader=TokensLoader()`.
    ///
    /// # Errors
    /// [`Error::Io`] if it cannot be read; [`Error::Dataset`] naming it for one that is
    /// not LitData's, another item loader's, compressed, or whose token type is not an
    /// integer type.
    pub fn open(dir: impl AsRef<Path>) -> Result<LitData> {
        let dir = dir.as_ref();
        let index = match dir.is_dir() {
            true => dir.join("index.json"),
            false => dir.to_path_buf(),
        };
        // Through `open_regular`: an `index.json` that is a FIFO would block a plain read.
        let mut text = Vec::new();
        std::io::Read::read_to_end(&mut super::open_regular(&index)?, &mut text)
            .map_err(|e| Error::io(&index, e))?;
        let bad = |problem: String| Error::dataset(&index, problem);
        let parsed: Index = serde_json::from_slice(&text)
            .map_err(|e| bad(format!("not the index.json of a LitData dataset ({e})")))?;
        let config = &parsed.config;
        if let Some(loader) = config
            .item_loader
            .as_deref()
            .filter(|l| *l != "TokensLoader")
        {
            return Err(bad(format!(
                "optimized for the {loader}: stokehold reads token chunks (TokensLoader)"
            )));
        }
        if let Some(codec) = &config.compression {
            return Err(bad(format!(
                "its chunks are compressed ({codec}): optimize it without compression"
            )));
        }
        if let Some(how) = config.encryption.as_ref().filter(|e| !e.is_null()) {
            return Err(bad(format!(
                "its chunks are encrypted ({how}): optimize it without encryption"
            )));
        }
        let format = match &config.data_format[..] {
            [one] => one.as_str(),
            many => return Err(bad(format!("items of {} parts: {many:?}", many.len()))),
        };
        let dtype = match format.split_once(':') {
            Some(("no_header_tensor", code)) => code.parse().ok().and_then(torch_dtype),
            Some(("no_header_numpy", code)) => code.parse().ok().and_then(numpy_dtype),
            _ => None,
        }
        .ok_or_else(|| {
            bad(format!(
                "data format {format:?}: stokehold reads integer tokens \
                 (no_header_tensor or no_header_numpy)"
            ))
        })?;
        let root = index.parent().unwrap_or(Path::new("."));
        if parsed.chunks.is_empty() {
            return Err(bad("it lists no chunks".into()));
        }
        // A chunk is a file of the set's directory: a name, not a path.
        let plain = |name: &str| {
            let mut parts = Path::new(name).components();
            matches!(
                (parts.next(), parts.next()),
                (Some(std::path::Component::Normal(_)), None)
            )
        };
        if let Some(c) = parsed.chunks.iter().find(|c| !plain(&c.filename)) {
            return Err(bad(format!(
                "chunk {:?} is not a file name of its directory",
                c.filename
            )));
        }
        let chunks = parsed
            .chunks
            .iter()
            .map(|c| match c.dim {
                Some(dim) => Ok((root.join(&c.filename), c.chunk_size, dim)),
                None => Err(bad(format!("chunk {} has no token count", c.filename))),
            })
            .collect::<Result<Vec<_>>>()?;
        if chunks
            .iter()
            .try_fold(0u64, |sum, c| sum.checked_add(c.2))
            .is_none()
        {
            return Err(bad("its chunks' token counts add up past 2^64".into()));
        }
        Ok(LitData { dtype, chunks })
    }

    /// The token type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The chunk files, in order.
    pub fn chunks(&self) -> impl Iterator<Item = &Path> {
        self.chunks.iter().map(|(p, _, _)| p.as_path())
    }

    /// Tokens in all chunks, as the index counts them.
    pub fn tokens(&self) -> u64 {
        self.chunks.iter().map(|c| c.2).sum()
    }

    /// The chunks' token streams cut into windows of `seq_len + 1` tokens, as
    /// [`TokenDataset`] cuts a token file (window `i` consecutive at token
    /// `i * seq_len`, sharing a token with the next, where LitData's `TokensLoader`
    /// cuts blocks that share none): each chunk on its own, so that, as with LitData's
    /// blocks, no window crosses two chunks and a chunk shorter than a window gives
    /// none. Random windows are drawn from another seed for each chunk (derived from
    /// `windows`' and the chunk's place), so equal chunks are not cut alike.
    ///
    /// # Errors
    /// [`Error::Dataset`] naming a chunk that cannot be read, is not a LitData chunk
    /// (item offsets that do not start past the header, fall, or end other than at the
    /// file's end), or holds other than the tokens the index counts; or naming the
    /// first chunk when no chunk holds a window; [`Error::Config`] for a `seq_len` out
    /// of range.
    pub fn windows(&self, seq_len: usize, windows: Windows) -> Result<Concat> {
        Windows::check(seq_len)?;
        let mut parts: Vec<Arc<dyn Dataset>> = Vec::new();
        for (k, (path, items, tokens)) in self.chunks.iter().enumerate() {
            if *tokens <= seq_len as u64 {
                continue;
            }
            let header =
                |bytes: &[u8]| chunk_header(bytes, *items).map_err(|p| Error::dataset(path, p));
            let windows = windows.for_part(k);
            let ds = TokenDataset::open_with(path, self.dtype, seq_len, windows, header)?;
            if ds.tokens() != *tokens {
                return Err(Error::dataset(
                    path,
                    format!(
                        "holds {} tokens, and its index.json counts {tokens}",
                        ds.tokens()
                    ),
                ));
            }
            parts.push(Arc::new(ds));
        }
        if parts.is_empty() {
            return Err(Error::dataset(
                &self.chunks[0].0,
                format!(
                    "no chunk holds a window of seq_len + 1 = {} tokens (the longest holds {})",
                    seq_len + 1,
                    self.chunks.iter().map(|c| c.2).max().unwrap_or(0)
                ),
            ));
        }
        Concat::new(parts)
    }
}

/// The bytes before a chunk's tokens, checked: it holds `expected` items, whose
/// offsets start right after them, never fall, and end at the end of the file.
fn chunk_header(bytes: &[u8], expected: u64) -> std::result::Result<usize, String> {
    let word = |k: u64| u32_at(bytes, usize::try_from(4 * k).ok()?).map(u64::from);
    let not = |why: String| format!("not a LitData chunk: {why}");
    let items = word(0).ok_or_else(|| not(format!("{} bytes", bytes.len())))?;
    if items != expected {
        return Err(format!(
            "holds {items} items, and its index.json counts {expected}"
        ));
    }
    let header = 4 * (items + 2);
    if header > bytes.len() as u64 {
        return Err(not(format!("{items} items need {header} bytes of offsets")));
    }
    let (first, end) = (word(1).unwrap_or(0), word(1 + items).unwrap_or(0));
    let wrong = match falling_offset(bytes, items) {
        _ if first != header => Some((0, first)),
        Some(falling) => Some(falling),
        None if end != bytes.len() as u64 => Some((items, end)),
        None => None,
    };
    if let Some((k, at)) = wrong {
        return Err(not(format!(
            "item offset {k} is {at}: offsets rise from the end of the header ({header}) \
             to the end of the file ({})",
            bytes.len()
        )));
    }
    Ok(header as usize)
}
