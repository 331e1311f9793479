//! A flat stream of tokens cut into training windows.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{check_out, Column, DType, Dataset, MappedFile, NpyArray};
use crate::error::{Error, Result};
use crate::sampler::mix;

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

/// A flat token stream (a raw `.bin` of `u16`/`u32`, or a 1-d integer `.npy`) served
/// as windows of `seq_len + 1` tokens: `w[..seq_len]` is the input, `w[1..]` the
/// next-token target.
#[derive(Debug)]
pub struct TokenDataset {
    path: PathBuf,
    map: Mmap,
    offset: usize,
    tokens: u64,
    dtype: DType,
    seq_len: usize,
    windows: Windows,
    columns: Vec<Column>,
}

impl TokenDataset {
    /// Opens a raw token file of `dtype` (`U16` or `U32`).
    ///
    /// # Errors
    /// [`Error::Io`] if it cannot be read; [`Error::Dataset`] if its length is not a
    /// whole number of tokens or it is too short for one window; [`Error::Config`] for
    /// another dtype or `seq_len == 0`.
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
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len % dtype.size() as u64 != 0 {
            return Err(Error::dataset(
                path,
                format!(
                    "{len} bytes is not a whole number of {}-byte {dtype} tokens",
                    dtype.size()
                ),
            ));
        }
        if len == 0 {
            return Err(Error::dataset(path, "the token file is empty"));
        }
        // SAFETY: read-only mapping of a dataset file treated as immutable while mapped
        // (see `NpyArray::open`).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::build(
            path,
            map,
            0,
            len / dtype.size() as u64,
            dtype,
            seq_len,
            windows,
        )
    }

    /// Opens a 1-d `.npy` array of integer tokens.
    ///
    /// # Errors
    /// Anything [`NpyArray::open`] returns; [`Error::Dataset`] if the array is not 1-d
    /// integers or is too short for one window.
    pub fn open_npy(
        path: impl AsRef<Path>,
        seq_len: usize,
        windows: Windows,
    ) -> Result<TokenDataset> {
        let path = path.as_ref();
        let array = NpyArray::open(path)?;
        if array.shape().len() != 1 || !array.dtype().is_integer() {
            return Err(Error::dataset(
                path,
                format!(
                    "a token stream is a 1-d integer array, this is {} of shape {}",
                    array.dtype(),
                    super::shape_string(array.shape())
                ),
            ));
        }
        let (offset, tokens, dtype) = (
            array.header().data_offset as usize,
            array.rows(),
            array.dtype(),
        );
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: as in `NpyArray::open`; this maps the file that was just validated.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        if map.len() != array.mapping().len() {
            return Err(Error::dataset(path, "the file changed while it was opened"));
        }
        Self::build(path, map, offset, tokens, dtype, seq_len, windows)
    }

    fn build(
        path: &Path,
        map: Mmap,
        offset: usize,
        tokens: u64,
        dtype: DType,
        seq_len: usize,
        windows: Windows,
    ) -> Result<TokenDataset> {
        if seq_len == 0 || seq_len >= (isize::MAX as usize) / 8 {
            return Err(Error::Config(format!("seq_len {seq_len} is out of range")));
        }
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
    pub fn window_start(&self, epoch: u64, index: u64) -> u64 {
        match self.windows {
            Windows::Consecutive => index * self.seq_len as u64,
            Windows::Random { seed } => {
                let starts = self.tokens - self.seq_len as u64;
                mix(mix(seed ^ 0x746f_6b65_6e73)
                    ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    ^ mix(index))
                    % starts
            }
        }
    }
}

impl Dataset for TokenDataset {
    fn len(&self) -> u64 {
        (self.tokens - 1) / self.seq_len as u64
    }

    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        check_out(&self.columns, indices.len(), out)?;
        let rb = self.columns[0].row_bytes;
        let data = &self.map[self.offset..];
        let len = self.len();
        for (dst, &index) in out[0].chunks_exact_mut(rb).zip(indices) {
            if index >= len {
                return Err(Error::OutOfRange { index, len });
            }
            let start = self.window_start(epoch, index) as usize * self.dtype.size();
            dst.copy_from_slice(&data[start..start + rb]);
        }
        Ok(())
    }

    fn files(&self) -> Vec<MappedFile<'_>> {
        vec![MappedFile::new(&self.path, &self.map)]
    }
}
