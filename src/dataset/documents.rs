//! Variable-length samples: documents (or conversations, or any token sequences) of any
//! length, stored back to back with an index of where each one is, served as rows
//! padded to `max_len` together with their lengths.

use std::path::Path;

use super::indexed::{Scan, Stored};
use super::{check_out, Column, DType, Dataset, MappedFile};
use crate::error::{Error, Result};

/// Variable-length samples stored back to back in a token file, with an index of where
/// each one starts and how long it is, served as fixed-size rows: column `"tokens"`
/// holds a document's first `max_len` tokens followed by `pad`, column `"len"` (`int64`)
/// how many of them are the document's. Longer documents are cut at `max_len` (how many
/// were is [`truncated`](Documents::truncated)).
///
/// Three layouts open in place:
/// - Megatron-LM / Megatron-Core indexed datasets (`prefix.bin` + `prefix.idx`, as
///   `tools/preprocess_data.py` writes them), and fairseq's `mmap` datasets (the same
///   format without document indices, and with `uint32`/`uint64` tokens too): each of
///   their sequences is a sample.
/// - A 1-d integer `.npy` of tokens with a 1-d integer `.npy` of `n + 1` offsets into it
///   (`np.cumsum` of the lengths with a leading 0, the layout of Arrow's list columns).
/// - A list-of-integers column of an Arrow IPC stream or file, such as a Hugging Face
///   `datasets` table's `input_ids`: its rows are the samples.
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
        Self::build(Stored::megatron(prefix.as_ref())?, max_len, pad)
    }

    /// Opens a 1-d integer `.npy` of tokens and a 1-d integer `.npy` of `n + 1` offsets
    /// into it: document `i` is `tokens[offsets[i]..offsets[i + 1]]`.
    ///
    /// # Errors
    /// Anything [`NpyArray::open`](super::NpyArray::open) returns; [`Error::Dataset`] naming the file for
    /// arrays that are not 1-d integers, no offsets, and offsets that are negative, fall,
    /// or pass the end of the tokens; [`Error::Config`] for `max_len == 0` or a `pad`
    /// the token type cannot hold.
    pub fn open_npy(
        tokens: impl AsRef<Path>,
        offsets: impl AsRef<Path>,
        max_len: usize,
        pad: i64,
    ) -> Result<Documents> {
        Self::build(
            Stored::npy(tokens.as_ref(), offsets.as_ref())?,
            max_len,
            pad,
        )
    }

    /// Opens the list-of-integers column `column` of an Arrow IPC file: a Hugging Face
    /// `datasets` table as `save_to_disk` or its cache writes it (`column` is then
    /// usually `"input_ids"`), or any `pyarrow` stream or file. Each row is a document;
    /// the record batches' offsets and values are read in place. A list, a large list or
    /// a fixed-size list (`datasets`' `Sequence(Value("int32"), length=n)`) of integers.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; [`Error::Dataset`] naming the file
    /// for one that is not Arrow IPC or is malformed, a column that is missing (the
    /// message lists those there are), not a list of integers, compressed or holding
    /// nulls, and bad offsets; [`Error::Config`] as for
    /// [`open_megatron`](Documents::open_megatron).
    pub fn open_arrow(
        path: impl AsRef<Path>,
        column: &str,
        max_len: usize,
        pad: i64,
    ) -> Result<Documents> {
        Self::build(Stored::arrow(path.as_ref(), column)?, max_len, pad)
    }

    /// Opens the array column `column` of a MosaicML Streaming shard
    /// (`shard.00000.mds`, as `streaming.MDSWriter` writes it; LLM Foundry's token
    /// column is `"tokens"`, encoded `ndarray:uint32` say). Each sample's array, of an
    /// integer type, is a document, read where it lies in the shard (its shape is
    /// ignored: the values in order). A dataset of several shards is several files
    /// (see [`Concat`](super::Concat)); a compressed shard (`.mds.zstd`) is refused,
    /// saying so: decompress it first, as `streaming` does on download.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; [`Error::Dataset`] naming the file
    /// for one that is not an MDS shard (sample offsets that fall or pass the file,
    /// a configuration that is not the writer's, a layout version other than 2, zstd
    /// compression), a missing column (the message lists
    /// those there are), one not encoded as an array of integers
    /// (`ndarray:<integer type>[:<shape>]`, or a plain `ndarray` whose samples name one
    /// integer type), and a sample whose array does not fit it;
    /// [`Error::Config`] as for [`open_megatron`](Documents::open_megatron).
    pub fn open_mds(
        path: impl AsRef<Path>,
        column: &str,
        max_len: usize,
        pad: i64,
    ) -> Result<Documents> {
        Self::build(Stored::mds(path.as_ref(), column, None)?, max_len, pad)
    }

    /// [`open_mds`](Documents::open_mds) for a column whose values are `dtype`: one
    /// encoded `bytes`, as LLM Foundry's `convert_dataset_hf.py` wrote `int64` tokens
    /// before it wrote `ndarray:int32` (each sample's bytes are its values), or an
    /// array column, which must then hold `dtype`.
    ///
    /// # Errors
    /// As [`open_mds`](Documents::open_mds); [`Error::Dataset`](crate::Error::Dataset)
    /// naming the file for a `dtype` that is not an integer type or not the array
    /// column's, and a sample whose bytes are no whole number of values.
    pub fn open_mds_bytes(
        path: impl AsRef<Path>,
        column: &str,
        dtype: DType,
        max_len: usize,
        pad: i64,
    ) -> Result<Documents> {
        Self::build(
            Stored::mds(path.as_ref(), column, Some(dtype))?,
            max_len,
            pad,
        )
    }

    fn build(stored: Stored, max_len: usize, pad: i64) -> Result<Documents> {
        let dtype = stored.dtype;
        if max_len == 0 || max_len >= (isize::MAX as usize) / 8 {
            return Err(Error::Config(format!("max_len {max_len} is out of range")));
        }
        let Some(pad_bytes) = encode(dtype, pad) else {
            return Err(Error::Config(format!(
                "pad {pad} does not fit the {dtype} tokens of {}",
                stored.tokens.path.display()
            )));
        };
        let scan = stored.scan(max_len as u64)?;
        let width = dtype.size();
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
        self.stored.extents(&[index]).map(|e| e[0].1)
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

    /// Covers how each document becomes a row (`max_len` and `pad`) and the column read
    /// (an Arrow or MDS set's, and its type).
    fn fingerprint(&self) -> u64 {
        let pad = u64::from_le_bytes(self.pad);
        crate::util::fold([self.max_len as u64, pad, self.stored.key])
    }

    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn gather(&self, _epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        check_out(&self.columns, indices.len(), out)?;
        let extents = self.stored.extents(indices)?;
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
                let src = data.get(from..from.checked_add(keep * width)?)?;
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
        copied.ok_or_else(|| self.stored.tokens.changed())
    }

    fn files(&self) -> Vec<MappedFile<'_>> {
        self.stored.files()
    }

    /// Each document's length as served: its tokens, at most `max_len`.
    fn lengths(&self) -> Result<Option<Vec<u32>>> {
        let cap = self.max_len.min(u32::MAX as usize) as u64;
        let all = 0..self.stored.docs;
        self.stored
            .each_extent(all, |(_, n)| n.min(cap) as u32)
            .map(Some)
    }

    /// The document's bytes in the token file (its first `max_len` tokens). The index
    /// is left out: it is small (8 to 12 bytes a document), and once read it stays in
    /// the page cache (the planner drops only the rows it planned).
    fn locate(&self, _epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        let found = self.stored.with_extents(|extent| extent(index));
        if let Ok(Some((start, n))) = found {
            let keep = n.min(self.max_len as u64) as usize * self.stored.dtype.size();
            match self.stored.data.checked_add(start as usize) {
                Some(at) if keep > 0 => each(0, at, keep),
                _ => {}
            }
        }
    }
}
