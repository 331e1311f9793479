//! Variable-length samples: documents (or conversations, or any token sequences) of any
//! length, stored back to back with an index of where each one is, served as rows
//! padded to `max_len` together with their lengths.

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::guard::Watched;
use super::{check_out, Column, DType, Dataset, MappedFile, NpyArray};
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
struct Mapped {
    path: PathBuf,
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
    fn read<R>(&self, read: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.watched.read(&self.map, read)
    }

    fn mapped(&self) -> MappedFile<'_> {
        MappedFile::new(&self.path, &self.map).watched_by(&self.watched)
    }
}

/// Where the index keeps each document's place.
#[derive(Debug, Clone, Copy)]
enum Index {
    /// Megatron: `int32` lengths (tokens) at byte `lengths` of the index file, `int64`
    /// pointers (bytes into the token file) at byte `pointers`.
    Megatron { lengths: usize, pointers: usize },
    /// `n + 1` token offsets of type `dtype` at byte `at` of the offsets file: document
    /// `i` is tokens `offsets[i]..offsets[i + 1]`.
    Offsets { at: usize, dtype: DType },
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
    fn extent(self, idx: &[u8], i: usize, width: usize) -> Option<(u64, u64)> {
        match self {
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
        }
    }
}

/// What a scan of the whole index found.
#[derive(Debug, Default, Clone, Copy)]
struct Scan {
    tokens: u64,
    longest: u64,
    truncated: u64,
}

/// Variable-length samples stored back to back in a token file, with an index of where
/// each one starts and how long it is, served as fixed-size rows: column `"tokens"`
/// holds a document's first `max_len` tokens followed by `pad`, column `"len"` (`int64`)
/// how many of them are the document's. Longer documents are cut at `max_len` (how many
/// were is [`truncated`](Documents::truncated)).
///
/// Two layouts open in place:
/// - Megatron-LM / Megatron-Core indexed datasets (`prefix.bin` + `prefix.idx`, as
///   `tools/preprocess_data.py` writes them), and fairseq's `mmap` datasets (the same
///   format without document indices, and with `uint32`/`uint64` tokens too): each of
///   their sequences is a sample.
/// - A 1-d integer `.npy` of tokens with a 1-d integer `.npy` of `n + 1` offsets into it
///   (`np.cumsum` of the lengths with a leading 0, the layout of Arrow's list columns).
///
/// The whole index is checked when the dataset opens (every document inside the token
/// file): a bad one is an error naming the file and the document, never a panic later.
#[derive(Debug)]
pub struct Documents {
    stored: Stored,
    max_len: usize,
    /// `pad`, as one element of `dtype`.
    pad: [u8; 8],
    scan: Scan,
    columns: Vec<Column>,
}

/// The files of a set of documents, as opened.
#[derive(Debug)]
struct Stored {
    tokens: Mapped,
    /// The first byte of the token data in `tokens`' file (after an `.npy` header).
    data: usize,
    index: Mapped,
    layout: Index,
    dtype: DType,
    docs: u64,
}

impl Documents {
    /// Opens a Megatron (or fairseq `mmap`) indexed dataset: `prefix.idx` and
    /// `prefix.bin` (a `prefix` ending in `.idx` or `.bin` names the pair too). Its
    /// sequences are the samples. Which of the two an index is follows from its length.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; [`Error::Dataset`] naming the index
    /// for a bad magic, version, token type, length or document list, and for a
    /// sequence that lies outside the token file; [`Error::Config`] for `max_len == 0`
    /// or a `pad` the token type cannot hold.
    pub fn open_megatron(prefix: impl AsRef<Path>, max_len: usize, pad: i64) -> Result<Documents> {
        let prefix = prefix.as_ref();
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
            (len == a || Some(len) == a.checked_add(docs)).then_some(d)
        });
        let fairseq = arrays.and_then(|a| a.checked_add(26)) == Some(len);
        let (lengths, doc_count) = match (megatron, fairseq) {
            (Some(d), _) => (MEGATRON_HEADER, d),
            (None, true) => (FAIRSEQ_HEADER, 0),
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
        let layout = Index::Megatron { lengths, pointers };
        let stored = Stored {
            tokens,
            data: 0,
            index,
            layout,
            dtype,
            docs,
        };
        Self::build(stored, max_len, pad)
    }

    /// Opens a 1-d integer `.npy` of tokens and a 1-d integer `.npy` of `n + 1` offsets
    /// into it: document `i` is `tokens[offsets[i]..offsets[i + 1]]`.
    ///
    /// # Errors
    /// Anything [`NpyArray::open`] returns; [`Error::Dataset`] naming the file for
    /// arrays that are not 1-d integers, no offsets, and offsets that are negative, fall,
    /// or pass the end of the tokens; [`Error::Config`] for `max_len == 0` or a `pad`
    /// the token type cannot hold.
    pub fn open_npy(
        tokens: impl AsRef<Path>,
        offsets: impl AsRef<Path>,
        max_len: usize,
        pad: i64,
    ) -> Result<Documents> {
        let tokens = super::open_integers(tokens.as_ref(), "the documents' token stream")?;
        let offsets = super::open_integers(offsets.as_ref(), "a document offset list")?;
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
        let checked = offsets.read(|o| {
            let mut last = 0i64;
            for (k, e) in o.chunks_exact(od.size()).enumerate() {
                let v = od.read_i64(e).expect("an integer type");
                // A uint64 offset past 2^63 reads as negative.
                let fine = v >= 0 && (k == 0 || v >= last) && v as u64 <= count;
                if !fine {
                    return Err(format!(
                        "offset {k} is {}: offsets rise, from 0 at least to the {count} \
                         tokens at most",
                        if od == DType::U64 {
                            (v as u64).to_string()
                        } else {
                            v.to_string()
                        }
                    ));
                }
                last = v;
            }
            Ok(())
        })?;
        checked.map_err(|problem| Error::dataset(&path, problem))?;
        let stored = Stored {
            tokens: Mapped::from_array(tokens),
            data,
            index: Mapped::from_array(offsets),
            layout,
            dtype,
            docs,
        };
        Self::build(stored, max_len, pad)
    }

    fn build(stored: Stored, max_len: usize, pad: i64) -> Result<Documents> {
        let Stored {
            ref tokens,
            data,
            ref index,
            layout,
            dtype,
            docs,
        } = stored;
        if max_len == 0 || max_len >= (isize::MAX as usize) / 8 {
            return Err(Error::Config(format!("max_len {max_len} is out of range")));
        }
        let Some(pad_bytes) = encode(dtype, pad) else {
            return Err(Error::Config(format!(
                "pad {pad} does not fit the {dtype} tokens of {}",
                tokens.path.display()
            )));
        };
        let width = dtype.size();
        let body = tokens.watched.len() - data as u64;
        // Every document inside the token data; the totals.
        let scan = index.read(|m| {
            let mut scan = Scan::default();
            for i in 0..docs as usize {
                let Some((start, len)) = layout.extent(m, i, width) else {
                    return Err(format!("document {i} has a negative length or place"));
                };
                let end = len
                    .checked_mul(width as u64)
                    .and_then(|b| b.checked_add(start));
                if start % width as u64 != 0 || !end.is_some_and(|e| e <= body) {
                    return Err(format!(
                        "document {i} ({len} tokens at byte {start}) lies outside the \
                         {body} bytes of tokens in {}",
                        tokens.path.display()
                    ));
                }
                scan.tokens = scan.tokens.saturating_add(len);
                scan.longest = scan.longest.max(len);
                scan.truncated += u64::from(len > max_len as u64);
            }
            Ok(scan)
        })?;
        let scan = scan.map_err(|problem| Error::dataset(&index.path, problem))?;
        let columns = vec![
            Column {
                name: "tokens".into(),
                dtype,
                shape: vec![max_len as u64],
                row_bytes: max_len * width,
            },
            Column {
                name: "len".into(),
                dtype: DType::I64,
                shape: vec![],
                row_bytes: 8,
            },
        ];
        Ok(Documents {
            stored,
            max_len,
            pad: pad_bytes,
            scan,
            columns,
        })
    }

    /// Tokens in all documents (before any cut at `max_len`).
    pub fn tokens(&self) -> u64 {
        self.scan.tokens
    }

    /// The longest document's length, in tokens.
    pub fn longest(&self) -> u64 {
        self.scan.longest
    }

    /// Documents longer than `max_len`, served cut to their first `max_len` tokens.
    pub fn truncated(&self) -> u64 {
        self.scan.truncated
    }

    /// The row width of column `"tokens"`.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The token type.
    pub fn dtype(&self) -> DType {
        self.stored.dtype
    }

    /// Document `index`'s length in tokens (before any cut at `max_len`).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for `index >= len()`; [`Error::Dataset`] if the index file
    /// changed since it was opened.
    pub fn length(&self, index: u64) -> Result<u64> {
        self.extents(&[index]).map(|e| e[0].1)
    }

    /// The place and length of each of `indices`.
    fn extents(&self, indices: &[u64]) -> Result<Vec<(u64, u64)>> {
        if let Some(&index) = indices.iter().find(|&&i| i >= self.stored.docs) {
            return Err(Error::OutOfRange {
                index,
                len: self.stored.docs,
            });
        }
        self.each_extent(indices.iter().copied(), |e| e)
    }

    /// `each` of the place and length of every document of `indices` (all below
    /// `len()`), read from the index in one guarded pass.
    fn each_extent<T>(
        &self,
        indices: impl Iterator<Item = u64>,
        mut each: impl FnMut((u64, u64)) -> T,
    ) -> Result<Vec<T>> {
        let (layout, width) = (self.stored.layout, self.stored.dtype.size());
        let found = self.stored.index.read(|m| {
            indices
                .map(|i| layout.extent(m, i as usize, width).map(&mut each))
                .collect::<Option<Vec<T>>>()
        })?;
        found.ok_or_else(|| Error::dataset(&self.stored.index.path, "changed since it was checked"))
    }
}

/// `value` as one little-endian element of the integer type `dtype`, if it fits.
fn encode(dtype: DType, value: i64) -> Option<[u8; 8]> {
    let mut out = [0u8; 8];
    let bytes: Vec<u8> = match dtype {
        DType::U8 => u8::try_from(value).ok()?.to_le_bytes().to_vec(),
        DType::I8 => i8::try_from(value).ok()?.to_le_bytes().to_vec(),
        DType::U16 => u16::try_from(value).ok()?.to_le_bytes().to_vec(),
        DType::I16 => i16::try_from(value).ok()?.to_le_bytes().to_vec(),
        DType::U32 => u32::try_from(value).ok()?.to_le_bytes().to_vec(),
        DType::I32 => i32::try_from(value).ok()?.to_le_bytes().to_vec(),
        DType::U64 => u64::try_from(value).ok()?.to_le_bytes().to_vec(),
        DType::I64 => value.to_le_bytes().to_vec(),
        DType::Bool | DType::F16 | DType::F32 | DType::F64 => return None,
    };
    out[..bytes.len()].copy_from_slice(&bytes);
    Some(out)
}

impl Dataset for Documents {
    fn len(&self) -> u64 {
        self.stored.docs
    }

    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn gather(&self, _epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        check_out(&self.columns, indices.len(), out)?;
        let extents = self.extents(indices)?;
        let (width, rb) = (self.stored.dtype.size(), self.columns[0].row_bytes);
        let pad = &self.pad[..width];
        let zero = pad.iter().all(|&b| b == 0);
        let (tokens, lens) = out.split_at_mut(1);
        let rows = tokens[0]
            .chunks_exact_mut(rb)
            .zip(lens[0].chunks_exact_mut(8));
        let copied = self.stored.tokens.read(|m| {
            let data = &m[self.stored.data..];
            for ((dst, len), &(start, n)) in rows.zip(&extents) {
                let keep = n.min(self.max_len as u64) as usize;
                let from = start as usize;
                let src = data.get(from..from + keep * width)?;
                dst[..src.len()].copy_from_slice(src);
                let rest = &mut dst[src.len()..];
                match zero {
                    true => rest.fill(0),
                    false => rest
                        .chunks_exact_mut(width)
                        .for_each(|p| p.copy_from_slice(pad)),
                }
                len.copy_from_slice(&(keep as i64).to_le_bytes());
            }
            Some(())
        })?;
        copied
            .ok_or_else(|| Error::dataset(&self.stored.tokens.path, "changed since it was checked"))
    }

    fn files(&self) -> Vec<MappedFile<'_>> {
        vec![self.stored.tokens.mapped(), self.stored.index.mapped()]
    }

    /// Each document's length as served: its tokens, at most `max_len`.
    fn lengths(&self) -> Result<Option<Vec<u32>>> {
        let cap = self.max_len.min(u32::MAX as usize) as u64;
        let all = 0..self.stored.docs;
        self.each_extent(all, |(_, n)| n.min(cap) as u32).map(Some)
    }

    /// The document's bytes in the token file (its first `max_len` tokens). The index
    /// is left out: it is small (8 to 12 bytes a document), and once read it stays in
    /// the page cache (the planner drops only the rows it planned).
    fn locate(&self, _epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        let width = self.stored.dtype.size();
        let found = (index < self.stored.docs)
            .then(|| {
                self.stored
                    .index
                    .read(|m| self.stored.layout.extent(m, index as usize, width))
            })
            .and_then(|r| r.ok().flatten());
        if let Some((start, n)) = found {
            let keep = n.min(self.max_len as u64) as usize * self.stored.dtype.size();
            if keep > 0 {
                each(0, self.stored.data + start as usize, keep);
            }
        }
    }
}
