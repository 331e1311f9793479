//! Token sequences stored back to back with an index of where each one is: the files
//! of a Megatron / fairseq indexed dataset, a token `.npy` with an offsets `.npy`, a
//! list column of an Arrow IPC file, or an array column of an MDS shard, opened and
//! checked once. [`Documents`](super::Documents) serves them padded,
//! [`Packed`](super::Packed) concatenated.

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::arrow::{self, Chunk};
use super::guard::Watched;
use super::mds;
use super::{DType, MappedFile, NpyArray};
use crate::error::{Error, Result};

/// The first bytes of a Megatron-LM / Megatron-Core and a fairseq `MMapIndexedDataset`
/// index file.
const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Magic, version (`<Q`), dtype code (`<B`), sequence count (`<Q`), document count
/// (`<Q`): Megatron's arrays start after these.
const MEGATRON_HEADER: usize = 9 + 8 + 1 + 8 + 8;
/// fairseq's header has no document count (nor document indices after the arrays).
const FAIRSEQ_HEADER: usize = 9 + 8 + 1 + 8;

/// The token types of the index files' dtype codes (Megatron-Core `DType`: 1 uint8,
/// 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16; fairseq's agree on
/// the integers and add 9 uint32, 10 uint64, which it picks for large vocabularies).
fn megatron_dtype(code: u8) -> Option<DType> {
    Some(match code {
        1 => DType::U8,
        2 => DType::I8,
        3 => DType::I16,
        4 => DType::I32,
        5 => DType::I64,
        8 => DType::U16,
        9 => DType::U32,
        10 => DType::U64,
        _ => return None,
    })
}

/// A file read through its mapping, watched for changes.
#[derive(Debug)]
pub(super) struct Mapped {
    pub(super) path: PathBuf,
    map: Mmap,
    watched: Watched,
}

impl Mapped {
    /// Opens and maps the file at `path`.
    fn open(path: &Path) -> Result<Mapped> {
        let (watched, map) =
            super::open_mapped(path, || Error::dataset(path, "the file is empty"))?;
        Ok(Mapped {
            path: path.to_path_buf(),
            map,
            watched,
        })
    }

    fn from_array(array: NpyArray) -> Mapped {
        let path = array.path().to_path_buf();
        let (watched, map) = array.into_parts();
        Mapped { path, map, watched }
    }

    /// Runs `read` over the mapping, guarded (see [`Watched::read`]).
    pub(super) fn read<R>(&self, read: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.watched.read(&self.map, read)
    }

    pub(super) fn mapped(&self) -> MappedFile<'_> {
        MappedFile::new(&self.path, &self.map).watched_by(&self.watched)
    }

    /// The error for a read that found the file other than it was checked.
    pub(super) fn changed(&self) -> Error {
        Error::dataset(&self.path, "changed since it was checked")
    }
}

/// Where the index keeps each document's place.
#[derive(Debug, Clone)]
enum Index {
    /// Megatron: `int32` lengths (tokens) at byte `lengths` of the index file, `int64`
    /// pointers (bytes into the token file) at byte `pointers`.
    Megatron { lengths: usize, pointers: usize },
    /// `n + 1` token offsets of type `dtype` at byte `at` of the offsets file: document
    /// `i` is tokens `offsets[i]..offsets[i + 1]`.
    Offsets { at: usize, dtype: DType },
    /// An Arrow list column: per record batch, `rows + 1` offsets into its values (both
    /// in the token file); `firsts[c]` is chunk `c`'s first document (no chunk empty).
    Chunks {
        chunks: Vec<Chunk>,
        firsts: Vec<u64>,
    },
    /// An MDS shard's array column: each sample's offset, sizes and shape header say
    /// where its values are (in the token file, which holds them all).
    Mds(mds::Column),
}

/// Checks that the offsets `o` (of the integer type `dtype`) rise, from 0 at least to
/// `count` (of `what`, say "tokens") at most.
fn rising(o: &[u8], dtype: DType, count: u64, what: &str) -> std::result::Result<(), String> {
    let mut last = 0i64;
    for (k, e) in o.chunks_exact(dtype.size()).enumerate() {
        let v = dtype.read_i64(e).expect("an integer type");
        // A uint64 offset past 2^63 reads as negative.
        if v < 0 || (k > 0 && v < last) || v as u64 > count {
            let shown = match dtype {
                DType::U64 => (v as u64).to_string(),
                _ => v.to_string(),
            };
            return Err(format!(
                "offset {k} is {shown}: offsets rise, from 0 at least to the {count} {what} \
                 at most"
            ));
        }
        last = v;
    }
    Ok(())
}

/// Reads the little-endian `N` bytes at `at`.
fn le<const N: usize>(bytes: &[u8], at: usize) -> Option<[u8; N]> {
    bytes.get(at..at + N)?.try_into().ok()
}

impl Index {
    /// Document `i`'s first byte in the token data and its length in tokens, as the
    /// index file's bytes `idx` say (`width`: bytes per token). `None` for a place the
    /// index does not hold, or a negative length or place (checked when the dataset
    /// opened; the index is not trusted again here).
    fn extent(&self, idx: &[u8], i: usize, width: usize) -> Option<(u64, u64)> {
        match *self {
            Index::Megatron { lengths, pointers } => {
                let len = i32::from_le_bytes(le(idx, lengths.checked_add(4 * i)?)?);
                let ptr = i64::from_le_bytes(le(idx, pointers.checked_add(8 * i)?)?);
                Some((u64::try_from(ptr).ok()?, u64::try_from(len).ok()?))
            }
            Index::Offsets { at, dtype } => {
                let w = dtype.size();
                let first = dtype.read_i64(idx.get(at.checked_add(w * i)?..)?)?;
                let end = dtype.read_i64(idx.get(at.checked_add(w * (i + 1))?..)?)?;
                let first = u64::try_from(first).ok()?;
                let len = u64::try_from(end).ok()?.checked_sub(first)?;
                Some((first.checked_mul(width as u64)?, len))
            }
            Index::Chunks {
                ref chunks,
                ref firsts,
            } => {
                let c = firsts.partition_point(|&f| f <= i as u64).checked_sub(1)?;
                let (chunk, j) = (chunks[c], i - firsts[c] as usize);
                if j as u64 >= chunk.rows {
                    return None;
                }
                if let Some(n) = chunk.fixed {
                    let first = (j as u64).checked_mul(n)?.checked_mul(width as u64)?;
                    return Some(((chunk.values as u64).checked_add(first)?, n));
                }
                let dtype = chunk.offset_type();
                let w = dtype.size();
                let at = |k: usize| chunk.offsets.checked_add(w.checked_mul(k)?);
                let first = dtype.read_i64(idx.get(at(j)?..)?)?;
                let end = dtype.read_i64(idx.get(at(j + 1)?..)?)?;
                let len = u64::try_from(end.checked_sub(first)?).ok()?;
                let first = u64::try_from(first).ok()?.checked_mul(width as u64)?;
                Some(((chunk.values as u64).checked_add(first)?, len))
            }
            Index::Mds(ref column) => column.extent(idx, i),
        }
    }

    /// Why document `i` has no extent, as a scan of the whole index says it.
    fn unreadable(&self, i: usize) -> String {
        match self {
            Index::Mds(_) => format!(
                "sample {i}: its array lies outside the sample (a size or shape header \
                 that does not match its values, raw bytes that are no whole number \
                 of values, or a plain ndarray of another type than the first sample's)"
            ),
            _ => format!("document {i} has a negative length or place"),
        }
    }
}

/// What a scan of the whole index found.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Scan {
    /// Tokens in all documents.
    pub(super) tokens: u64,
    /// The longest document's length.
    pub(super) longest: u64,
    /// Documents longer than the scan's `max_len`.
    pub(super) truncated: u64,
    /// Whether each document starts where the one before it ends (always so for
    /// offsets; so for Megatron sets as its tools write them; not for an Arrow table of
    /// several record batches).
    pub(super) contiguous: bool,
}

/// The files of a set of documents, as opened: token data, and an index of each
/// document's place and length in it, checked against each other.
#[derive(Debug)]
pub(super) struct Stored {
    pub(super) tokens: Mapped,
    /// The first byte of the token data in `tokens`' file (after an `.npy` header).
    pub(super) data: usize,
    /// The index's file, where it is not the token file.
    index: Option<Mapped>,
    layout: Index,
    pub(super) dtype: DType,
    pub(super) docs: u64,
    /// What was read of the files beyond their bytes (an Arrow or MDS column's name and
    /// its type), for a fingerprint: 0 for a set with one way to read it.
    pub(super) key: u64,
}

/// The [`Stored::key`] of column `name` read as `dtype`.
fn column_key(name: &str, dtype: DType) -> u64 {
    crate::util::fold(
        name.bytes()
            .chain(dtype.to_string().into_bytes())
            .map(u64::from),
    )
}

impl Stored {
    /// Opens a Megatron (or fairseq `mmap`) indexed dataset: `prefix.idx` and
    /// `prefix.bin` (a `prefix` ending in `.idx` or `.bin` names the pair too). Which of
    /// the two an index is follows from its length.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; [`Error::Dataset`] naming the index
    /// for a bad magic, version, token type, length or document list, and naming the
    /// token file for a length that is not a whole number of tokens.
    pub(super) fn megatron(prefix: &Path) -> Result<Stored> {
        let stem = match prefix.extension().and_then(|e| e.to_str()) {
            Some("idx" | "bin") => prefix.with_extension(""),
            _ => prefix.to_path_buf(),
        };
        let with = |ext: &str| {
            let mut p = stem.clone().into_os_string();
            p.push(ext);
            PathBuf::from(p)
        };
        let index = Mapped::open(&with(".idx"))?;
        let tokens = Mapped::open(&with(".bin"))?;
        let bad = |problem: String| Error::dataset(&index.path, problem);
        let len = index.watched.len();
        let head = index.read(|m| m[..m.len().min(MEGATRON_HEADER)].to_vec())?;
        if head.len() < FAIRSEQ_HEADER {
            return Err(bad(format!(
                "{len} bytes, shorter than an index header ({FAIRSEQ_HEADER} bytes for \
                 fairseq, {MEGATRON_HEADER} for Megatron)"
            )));
        }
        if &head[..9] != MEGATRON_MAGIC {
            return Err(bad(
                "not a Megatron or fairseq index: it does not start with MMIDIDX\\0\\0".into(),
            ));
        }
        let word = |at: usize| le(&head, at).map(u64::from_le_bytes);
        let version = word(9).expect("within the header");
        if version != 1 {
            return Err(bad(format!(
                "index version {version}: stokehold reads version 1"
            )));
        }
        let code = head[17];
        let Some(dtype) = megatron_dtype(code) else {
            return Err(bad(format!(
                "token type code {code}: tokens are integers (codes 1 to 5 and 8 to 10)"
            )));
        };
        let docs = word(18).expect("within the header");
        let arrays = docs.checked_mul(12);
        // Megatron: lengths, pointers, document indices, and optionally one mode byte per
        // sequence (Megatron-Core's multimodal sets). fairseq: lengths and pointers.
        let doc_count = word(26);
        let megatron = doc_count.and_then(|d| {
            let a = arrays?.checked_add(d.checked_mul(8)?)?.checked_add(34)?;
            let modes = Some(len) == a.checked_add(docs);
            (len == a || modes).then_some((d, modes))
        });
        let fairseq = arrays.and_then(|a| a.checked_add(26)) == Some(len);
        let (lengths, doc_count, modes) = match (megatron, fairseq) {
            (Some((d, modes)), _) => (MEGATRON_HEADER, d, modes),
            (None, true) => (FAIRSEQ_HEADER, 0, false),
            (None, false) => {
                return Err(bad(format!(
                    "{len} bytes, which fits neither layout for its header's {docs} \
                     sequences: Megatron's 34 + 12 x sequences + 8 x document indices \
                     ({} counted) bytes, nor fairseq's 26 + 12 x sequences",
                    doc_count.map_or("none".into(), |d| d.to_string())
                )))
            }
        };
        let pointers = lengths + 4 * docs as usize;
        let documents = pointers + 8 * docs as usize;
        let width = dtype.size() as u64;
        if tokens.watched.len() % width != 0 {
            return Err(Error::dataset(
                &tokens.path,
                format!(
                    "{} bytes is not a whole number of {width}-byte {dtype} tokens",
                    tokens.watched.len()
                ),
            ));
        }
        // The document indices: 0, then where each document's sequences end, the last at
        // the sequence count.
        let list = index.read(|m| {
            let mut last = 0i64;
            for k in 0..doc_count {
                let at = documents + 8 * k as usize;
                let Some(d) = le(m, at).map(i64::from_le_bytes) else {
                    return Err(format!("cut short at document index {k}"));
                };
                let ok = if k == 0 { d == 0 } else { d >= last };
                if !ok || d as u64 > docs {
                    return Err(format!(
                        "document index {k} is {d}: they rise from 0 to the sequence count {docs}"
                    ));
                }
                last = d;
            }
            match doc_count > 0 && last as u64 != docs {
                true => Err(format!(
                    "its last document index is {last}, not the sequence count {docs}"
                )),
                false => Ok(()),
            }
        })?;
        list.map_err(bad)?;
        // A multimodal set (Megatron-Core's `multimodal=True`): one mode byte a sequence,
        // 0 for text. Any other sequence holds an image's bytes, not tokens.
        if modes {
            let at = documents + 8 * doc_count as usize;
            let other = index.read(|m| {
                let bytes = m.get(at..at + docs as usize).unwrap_or_default();
                bytes.iter().position(|&b| b != 0).map(|k| (k, bytes[k]))
            })?;
            if let Some((k, mode)) = other {
                return Err(bad(format!(
                    "a multimodal index: sequence {k} has mode {mode}, not text (0); \
                     stokehold reads token sequences only"
                )));
            }
        }
        Ok(Stored {
            tokens,
            data: 0,
            index: Some(index),
            layout: Index::Megatron { lengths, pointers },
            dtype,
            docs,
            key: 0,
        })
    }

    /// Opens a 1-d integer `.npy` of tokens and a 1-d integer `.npy` of `n + 1` offsets
    /// into it: document `i` is `tokens[offsets[i]..offsets[i + 1]]`.
    ///
    /// # Errors
    /// Anything [`NpyArray::open`] returns; [`Error::Dataset`] naming the file for
    /// arrays that are not 1-d integers, no offsets, and offsets that are negative, fall,
    /// or pass the end of the tokens.
    pub(super) fn npy(tokens: &Path, offsets: &Path) -> Result<Stored> {
        let tokens = super::open_integers(tokens, "the documents' token stream")?;
        let offsets = super::open_integers(offsets, "a document offset list")?;
        if offsets.rows() == 0 {
            return Err(Error::dataset(
                offsets.path(),
                "no offsets: n documents need n + 1, starting with the first one's",
            ));
        }
        let (dtype, count) = (tokens.dtype(), tokens.rows());
        let data = tokens.header().data_offset as usize;
        let layout = Index::Offsets {
            at: offsets.header().data_offset as usize,
            dtype: offsets.dtype(),
        };
        let docs = offsets.rows() - 1;
        let (od, path) = (offsets.dtype(), offsets.path().to_path_buf());
        let checked = offsets.read(|o| rising(o, od, count, "tokens"))?;
        checked.map_err(|problem| Error::dataset(&path, problem))?;
        Ok(Stored {
            tokens: Mapped::from_array(tokens),
            data,
            index: Some(Mapped::from_array(offsets)),
            layout,
            dtype,
            docs,
            key: 0,
        })
    }

    /// Opens the list-of-integers column `column` of an Arrow IPC stream or file (a
    /// Hugging Face `datasets` table's `input_ids`, say): each row is a document.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; [`Error::Dataset`] naming the file
    /// for one that is not Arrow IPC or is malformed, a column that is missing, not a
    /// list of integers, compressed or holds nulls, and offsets that are negative, fall,
    /// or pass the end of their values.
    pub(super) fn arrow(path: &Path, column: &str) -> Result<Stored> {
        let file = Mapped::open(path)?;
        let bad = |problem: String| Error::dataset(path, problem);
        let list = file.read(|m| arrow::list_column(m, column))?.map_err(bad)?;
        let (mut chunks, mut firsts, mut docs) = (Vec::new(), Vec::new(), 0u64);
        let width = list.dtype.size() as u64;
        let checked = file.read(|m| {
            // (An empty record batch may have no offsets at all.)
            // (A fixed-size list's rows were checked against its values as it was read.)
            let listed = list.chunks.iter().enumerate();
            for (c, chunk) in listed.filter(|(_, c)| c.rows > 0 && c.fixed.is_none()) {
                let dtype = chunk.offset_type();
                let bytes = (chunk.rows as usize + 1) * dtype.size();
                let Some(o) = m.get(chunk.offsets..).and_then(|o| o.get(..bytes)) else {
                    return Err(format!("record batch {c}: its offsets are cut short"));
                };
                let values = chunk.values_len as u64 / width;
                rising(o, dtype, values, "values")
                    .map_err(|e| format!("column {column:?}, record batch {c}: {e}"))?;
            }
            Ok(())
        })?;
        checked.map_err(bad)?;
        for chunk in list.chunks.into_iter().filter(|c| c.rows > 0) {
            firsts.push(docs);
            docs += chunk.rows;
            chunks.push(chunk);
        }
        Ok(Stored {
            tokens: file,
            data: 0,
            index: None,
            layout: Index::Chunks { chunks, firsts },
            dtype: list.dtype,
            docs,
            key: column_key(column, list.dtype),
        })
    }

    /// Opens the array column `column` of an MosaicML Streaming (MDS) shard: each
    /// sample's array is a document, read where it lies. `dtype` is the type of a
    /// `bytes` column's values (and must be an array column's own where given).
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; [`Error::Dataset`] naming the file
    /// for one that is not an MDS shard, a missing column, one that is not an array of
    /// integers, or one whose type is not `dtype`.
    pub(super) fn mds(path: &Path, name: &str, dtype: Option<DType>) -> Result<Stored> {
        let file = Mapped::open(path)?;
        let found = file.read(|m| mds::column(m, name, dtype))?;
        let column = found.map_err(|problem| Error::dataset(path, problem))?;
        Ok(Stored {
            tokens: file,
            data: 0,
            index: None,
            dtype: column.dtype,
            docs: column.samples,
            key: column_key(name, column.dtype),
            layout: Index::Mds(column),
        })
    }

    /// Checks that every document lies inside the token data, and totals them
    /// (`truncated` counts those longer than `max_len`).
    ///
    /// # Errors
    /// [`Error::Dataset`] naming the index for a document with a negative length or
    /// place, or one that lies outside the token data.
    pub(super) fn scan(&self, max_len: u64) -> Result<Scan> {
        let (layout, width) = (&self.layout, self.dtype.size());
        let body = self.tokens.watched.len() - self.data as u64;
        let scan = self.index().read(|m| {
            let mut scan = Scan {
                contiguous: true,
                ..Scan::default()
            };
            let mut next = None;
            for i in 0..self.docs as usize {
                let Some((start, len)) = layout.extent(m, i, width) else {
                    return Err(layout.unreadable(i));
                };
                let end = len
                    .checked_mul(width as u64)
                    .and_then(|b| b.checked_add(start));
                // (An MDS sample's values lie wherever its headers end.)
                if start % width as u64 != 0 && !matches!(layout, Index::Mds(_)) {
                    return Err(format!(
                        "document {i} starts at byte {start}, not on a {width}-byte token"
                    ));
                }
                if !end.is_some_and(|e| e <= body) {
                    return Err(format!(
                        "document {i} ({len} tokens at byte {start}) lies outside the \
                         {body} bytes of tokens in {}",
                        self.tokens.path.display()
                    ));
                }
                scan.contiguous &= next.map_or(true, |n| n == start);
                next = end;
                scan.tokens = scan.tokens.saturating_add(len);
                scan.longest = scan.longest.max(len);
                scan.truncated += u64::from(len > max_len);
            }
            Ok(scan)
        })?;
        scan.map_err(|problem| Error::dataset(&self.index().path, problem))
    }

    /// The place (first byte in the token data) and length of each of `indices`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for an index `>= docs`; [`Error::Dataset`] if the index
    /// file changed since it was checked.
    pub(super) fn extents(&self, indices: &[u64]) -> Result<Vec<(u64, u64)>> {
        if let Some(&index) = indices.iter().find(|&&i| i >= self.docs) {
            return Err(Error::OutOfRange {
                index,
                len: self.docs,
            });
        }
        self.each_extent(indices.iter().copied(), |e| e)
    }

    /// `each` of the place and length of every document of `indices` (all below
    /// `docs`), read from the index in one guarded pass.
    ///
    /// # Errors
    /// [`Error::Dataset`] if the index file changed since it was checked.
    pub(super) fn each_extent<T>(
        &self,
        indices: impl Iterator<Item = u64>,
        mut each: impl FnMut((u64, u64)) -> T,
    ) -> Result<Vec<T>> {
        let found = self.with_extents(|extent| {
            indices
                .map(|i| extent(i).map(&mut each))
                .collect::<Option<Vec<T>>>()
        });
        found?.ok_or_else(|| self.index().changed())
    }

    /// Runs `read` with a reader of document places and lengths (`None` for one the
    /// index no longer holds), over one guarded read of the index.
    ///
    /// # Errors
    /// [`Error::Dataset`] if a page of the index could not be read.
    pub(super) fn with_extents<R>(
        &self,
        read: impl FnOnce(&dyn Fn(u64) -> Option<(u64, u64)>) -> R,
    ) -> Result<R> {
        let (layout, width) = (&self.layout, self.dtype.size());
        self.index().read(|m| {
            let extent = |i: u64| match i < self.docs {
                true => layout.extent(m, i as usize, width),
                false => None,
            };
            read(&extent)
        })
    }

    /// The file holding the index: its own, or the token file.
    pub(super) fn index(&self) -> &Mapped {
        self.index.as_ref().unwrap_or(&self.tokens)
    }

    /// The files, tokens first.
    pub(super) fn files(&self) -> Vec<MappedFile<'_>> {
        let index = self.index.iter().map(Mapped::mapped);
        std::iter::once(self.tokens.mapped()).chain(index).collect()
    }
}
