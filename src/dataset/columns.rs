//! Several `.npy` arrays read together, one row of each per sample.

use std::path::{Path, PathBuf};

use super::{check_out, Column, Dataset, MappedFile, NpyArray};
use crate::error::{Error, Result};

/// Several `.npy` columns with the same first dimension, read together per sample:
/// typically `x.npy` (inputs) and `y.npy` (labels).
#[derive(Debug)]
pub struct NpyDataset {
    arrays: Vec<NpyArray>,
    columns: Vec<Column>,
    len: u64,
}

impl NpyDataset {
    /// Opens one `.npy` file, a directory, or several files as columns.
    ///
    /// A directory opens every `*.npy` file in it: `x.npy` first, then `y.npy`, then the
    /// others in name order.
    ///
    /// # Errors
    /// See [`open_columns`](NpyDataset::open_columns); a directory with no `.npy` file is
    /// an [`Error::Dataset`].
    pub fn open(path: impl AsRef<Path>) -> Result<NpyDataset> {
        let path = path.as_ref();
        if path.is_dir() {
            Self::open_dir(path)
        } else {
            Self::open_columns([path])
        }
    }

    /// Opens `x.npy` and `y.npy` of the directory `dir` as two columns, whatever else the
    /// directory holds: the inputs and labels of a classifier.
    ///
    /// # Errors
    /// As [`open_columns`](NpyDataset::open_columns), naming a missing file.
    pub fn open_xy(dir: impl AsRef<Path>) -> Result<NpyDataset> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            let e = match dir.exists() {
                true => std::io::Error::other("not a directory (x.npy and y.npy go in one)"),
                false => std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory"),
            };
            return Err(Error::io(dir, e));
        }
        Self::open_columns([dir.join("x.npy"), dir.join("y.npy")])
    }

    /// Opens the `*.npy` files of a directory as columns (`x`, `y`, then by name).
    ///
    /// # Errors
    /// [`Error::Io`] if the directory cannot be read, [`Error::Dataset`] if it holds no
    /// `.npy` file, and anything [`open_columns`](NpyDataset::open_columns) returns.
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<NpyDataset> {
        let dir = dir.as_ref();
        let mut files: Vec<PathBuf> = crate::util::with_room(|| std::fs::read_dir(dir))
            .map_err(|e| Error::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "npy"))
            .collect();
        if files.is_empty() {
            return Err(Error::dataset(dir, "no .npy file in this directory"));
        }
        let rank = |p: &PathBuf| match p.file_stem().and_then(|s| s.to_str()) {
            Some("x") => 0,
            Some("y") => 1,
            _ => 2,
        };
        files.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| a.cmp(b)));
        Self::open_columns(files)
    }

    /// Opens each path as one column. Column names are the file stems.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Npy`] for a file that cannot be read;
    /// [`Error::Dataset`] if the files disagree on their first dimension, if there are
    /// none, if they hold zero samples, or if two have the same stem (the same column
    /// name).
    pub fn open_columns<P: AsRef<Path>>(paths: impl IntoIterator<Item = P>) -> Result<NpyDataset> {
        let arrays = paths
            .into_iter()
            .map(NpyArray::open)
            .collect::<Result<Vec<_>>>()?;
        Self::from_arrays(arrays)
    }

    /// Assembles already opened arrays as columns.
    ///
    /// # Errors
    /// As [`open_columns`](NpyDataset::open_columns).
    pub fn from_arrays(arrays: Vec<NpyArray>) -> Result<NpyDataset> {
        let first = arrays
            .first()
            .ok_or_else(|| Error::Config("a dataset needs at least one column".into()))?;
        let len = first.rows();
        for a in &arrays[1..] {
            if a.rows() != len {
                return Err(Error::dataset(
                    a.path(),
                    format!(
                        "has {} rows but {} has {}: columns must share their first dimension",
                        a.rows(),
                        first.path().display(),
                        len
                    ),
                ));
            }
        }
        if len == 0 {
            return Err(Error::dataset(first.path(), "holds zero samples"));
        }
        let columns = arrays
            .iter()
            .map(|a| Column {
                name: a
                    .path()
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                dtype: a.dtype(),
                shape: a.shape()[1..].to_vec(),
                row_bytes: a.row_bytes(),
            })
            .collect::<Vec<Column>>();
        for (k, c) in columns.iter().enumerate() {
            if let Some(j) = columns[..k].iter().position(|o| o.name == c.name) {
                return Err(Error::dataset(
                    arrays[k].path(),
                    format!(
                        "names its column {:?}, as {} does: columns are named by their \
                         file stems, so one of them needs another name",
                        c.name,
                        arrays[j].path().display()
                    ),
                ));
            }
        }
        Ok(NpyDataset {
            arrays,
            columns,
            len,
        })
    }

    /// The arrays, one per column.
    pub fn arrays(&self) -> &[NpyArray] {
        &self.arrays
    }
}

impl Dataset for NpyDataset {
    fn len(&self) -> u64 {
        self.len
    }

    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn gather(&self, _epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        check_out(&self.columns, indices.len(), out)?;
        if let Some(&index) = indices.iter().find(|&&i| i >= self.len) {
            return Err(Error::OutOfRange {
                index,
                len: self.len,
            });
        }
        for (array, out) in self.arrays.iter().zip(out.iter_mut()) {
            let rb = array.row_bytes();
            if rb == 0 {
                continue;
            }
            array.read(|data| {
                // The row two ahead is asked for while this one is copied: a random row's
                // first cache misses (and page walks) overlap the copies before it.
                const AHEAD: usize = 2;
                for (k, (dst, &index)) in out.chunks_exact_mut(rb).zip(indices).enumerate() {
                    if let Some(&next) = indices.get(k + AHEAD) {
                        let at = next as usize * rb;
                        crate::util::prefetch(&data[at..at + rb]);
                    }
                    let start = index as usize * rb;
                    dst.copy_from_slice(&data[start..start + rb]);
                }
            })?;
        }
        Ok(())
    }

    fn locate(&self, _epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        if index >= self.len {
            return;
        }
        for (f, a) in self.arrays.iter().enumerate() {
            let rb = a.row_bytes();
            each(f, a.header().data_offset as usize + index as usize * rb, rb);
        }
    }

    fn files(&self) -> Vec<MappedFile<'_>> {
        self.arrays
            .iter()
            .map(|a| MappedFile::new(a.path(), a.mapping()).watched_by(a.watched()))
            .collect()
    }
}
