//! Datasets: fixed-size samples read from memory-mapped files.
//!
//! - [`NpyArray`]: one `.npy` file, validated at open time.
//! - [`NpyDataset`]: several `.npy` columns with one first dimension (`x.npy`, `y.npy`).
//! - [`TokenDataset`]: a flat token stream cut into windows of `seq_len + 1` tokens.
//! - [`LitData`]: the token chunks of a LitData dataset (`litdata.optimize` with its
//!   `TokensLoader`), as windows.
//! - [`Documents`]: variable-length token sequences (a Megatron indexed dataset, or
//!   tokens and offsets in `.npy`), padded to one row width, with their lengths.
//! - [`Packed`]: the same documents concatenated and cut into windows, with each
//!   token's position in its document.
//! - [`Subset`]: a contiguous range of another dataset's samples.
//! - [`Concat`]: several datasets with the same columns, one after another (a table's
//!   shards).
//! - [`Mix`]: several datasets with the same columns, mixed by weight (a pretraining
//!   mixture).
//!
//! Anything implementing [`Dataset`] can be fed to a [`Loader`](crate::Loader).

mod arrow;
mod columns;
mod concat;
#[cfg(test)]
mod counting;
mod documents;
mod dtype;
pub(crate) mod guard;
mod indexed;
mod litdata;
mod mds;
mod mix;
mod npy;
mod packed;
mod subset;
mod tokens;

use std::path::Path;

pub use columns::NpyDataset;
pub use concat::Concat;
pub use documents::Documents;
pub use dtype::{DType, Element};
pub use litdata::LitData;
pub use mix::Mix;
pub use npy::{shape_string, NpyArray, NpyHeader};
pub use packed::Packed;
pub use subset::Subset;
pub use tokens::{TokenDataset, Windows};

use crate::error::Result;

/// One column of a dataset: every sample has `row_bytes` bytes of `dtype` in it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Column {
    /// The column's name (a file stem such as `x`, or `tokens`).
    pub name: String,
    /// The element type.
    pub dtype: DType,
    /// The shape of one sample (the array's shape without its first axis).
    pub shape: Vec<u64>,
    /// Bytes per sample.
    pub row_bytes: usize,
}

/// A dataset file open for reading ([`MappedFile::opened`]).
#[derive(Debug)]
pub(crate) enum Opened<'a> {
    /// The dataset's own descriptor.
    Dataset(&'a std::fs::File),
    /// One opened for the caller.
    Own(std::fs::File),
}

impl std::ops::Deref for Opened<'_> {
    type Target = std::fs::File;

    fn deref(&self) -> &std::fs::File {
        match self {
            Opened::Dataset(f) => f,
            Opened::Own(f) => f,
        }
    }
}

/// A file a dataset reads through a memory map.
///
/// Only a real file mapping can be wrapped (the page-cache calls advise the kernel on
/// its pages, which must not be ordinary memory).
#[derive(Debug, Clone, Copy)]
pub struct MappedFile<'a> {
    path: &'a Path,
    map: &'a memmap2::Mmap,
    watched: Option<&'a guard::Watched>,
}

impl<'a> MappedFile<'a> {
    /// The mapping `map` of the file at `path`.
    pub fn new(path: &'a Path, map: &'a memmap2::Mmap) -> MappedFile<'a> {
        MappedFile {
            path,
            map,
            watched: None,
        }
    }

    /// The same, with the open file the mapping was made from, watched for changes: the
    /// loader may then read its rows straight from storage (see
    /// [`LoaderBuilder::page_cache_budget`](crate::LoaderBuilder::page_cache_budget)).
    pub(crate) fn watched_by(mut self, watched: &'a guard::Watched) -> MappedFile<'a> {
        self.watched = Some(watched);
        self
    }

    /// The open file behind the mapping, watched for changes, where the dataset gave it.
    pub(crate) fn watched(&self) -> Option<&'a guard::Watched> {
        self.watched
    }

    /// The file behind the mapping, open for reading: the dataset's own descriptor,
    /// duplicated (the inode that was mapped, whatever happened to the path since), or
    /// the path opened again where the dataset gave none.
    ///
    /// # Errors
    /// The error of `dup` or `open`.
    pub(crate) fn reopen(&self) -> std::io::Result<std::fs::File> {
        crate::util::with_room(|| match self.watched {
            Some(w) => w.file().try_clone(),
            None => std::fs::File::open(self.path),
        })
    }

    /// The file behind the mapping, open for reading, without a descriptor more where
    /// it can: the dataset's own, borrowed, or else the path opened again (see
    /// [`reopen`](MappedFile::reopen)).
    ///
    /// # Errors
    /// The error of `open`.
    pub(crate) fn opened(&self) -> std::io::Result<Opened<'a>> {
        match self.watched {
            Some(w) => Ok(Opened::Dataset(w.file())),
            None => self.reopen().map(Opened::Own),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &'a Path {
        self.path
    }

    /// The whole mapping.
    pub fn bytes(&self) -> &'a [u8] {
        self.map
    }

    /// The mapping itself (for its `advise` calls).
    pub(crate) fn mapping(&self) -> &'a memmap2::Mmap {
        self.map
    }
}

/// A source of fixed-size samples, each made of one row per column.
///
/// Implementations must be cheap to share between threads: [`gather`](Dataset::gather)
/// is called concurrently by every loader worker.
pub trait Dataset: Send + Sync + 'static {
    /// Number of samples in one epoch.
    fn len(&self) -> u64;

    /// Whether the dataset has no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The columns, in the order [`gather`](Dataset::gather) fills them.
    fn columns(&self) -> &[Column];

    /// Copies the samples `indices` of `epoch` into `out`, one slice per column: sample
    /// `k`'s row of column `c` goes to `out[c][k * row_bytes .. (k + 1) * row_bytes]`.
    ///
    /// `epoch` matters only to datasets whose samples change per epoch (random token
    /// windows); the others ignore it.
    ///
    /// # Errors
    /// [`Error::OutOfRange`](crate::Error::OutOfRange) for an index `>= len()`,
    /// [`Error::Config`](crate::Error::Config) when `out` does not match the columns, or
    /// whatever the implementation's storage reports. Never panics on a file that opened.
    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()>;

    /// The memory-mapped files behind the dataset, for page-cache residency, eviction and
    /// read-ahead. Empty for in-memory datasets.
    fn files(&self) -> Vec<MappedFile<'_>> {
        Vec::new()
    }

    /// Each sample's length (tokens, say), for a length-grouped shuffle
    /// ([`Shuffle::Grouped`](crate::Shuffle::Grouped)); `None`, the default, for samples
    /// that all have the same size.
    ///
    /// # Errors
    /// Whatever reading them from the dataset's storage reports.
    fn lengths(&self) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }

    /// Where sample `index` of `epoch` lives: calls `each(file, offset, len)` for every
    /// byte range of [`files`](Dataset::files)`()[file]` that its gather reads. The
    /// loader plans its storage reads from this (see
    /// [`LoaderBuilder::page_cache_budget`](crate::LoaderBuilder::page_cache_budget));
    /// the default, no range, leaves reads to page faults.
    fn locate(&self, epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        let _ = (epoch, index, each);
    }

    /// A fingerprint of what decides which sample each index is, beyond the files and
    /// the length: the parameters a dataset was opened with (a window seed, a mixture's
    /// weights, the parts of a concatenation and their order). A loader's resume states
    /// carry it ([`LoaderState`](crate::LoaderState)'s `order` and `global`), so a state
    /// saved over the same files opened otherwise is refused instead of resuming into
    /// other samples. 0, the default, for a dataset whose samples follow from its
    /// files alone (whose contents it does not cover).
    fn fingerprint(&self) -> u64 {
        0
    }

    /// Whether sample `i` holds the same rows every epoch (the default). Random token
    /// windows, per-epoch packing of shuffled documents and a mixture's draws are
    /// datasets whose samples change: a device cache, which keeps the rows one epoch
    /// read, refuses them.
    fn same_every_epoch(&self) -> bool {
        true
    }
}

/// Opens `path` for reading if it is a regular file (or a link to one). A FIFO would
/// block the open, and a directory or a device would fail later with a misleading
/// message: they are refused here, naming the path and what it is. A process out of
/// file descriptors has its soft limit raised to its hard one first
/// ([`with_room`](crate::util::with_room)).
///
/// # Errors
/// [`Error::Io`] if `path` does not exist; [`Error::Dataset`] for a dangling symbolic
/// link, anything that is not a regular file, or a process that has its hard limit of
/// files open.
pub(crate) fn open_regular(path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if path.is_symlink() => {
            return Err(crate::Error::dataset(
                path,
                format!("a dangling symbolic link ({e})"),
            ))
        }
        Err(e) => return Err(crate::Error::io(path, e)),
    };
    let t = meta.file_type();
    let kind = if t.is_file() {
        None
    } else if t.is_dir() {
        Some("a directory")
    } else if t.is_fifo() {
        Some("a FIFO")
    } else if t.is_socket() {
        Some("a socket")
    } else if t.is_char_device() || t.is_block_device() {
        Some("a device")
    } else {
        Some("not a regular file")
    };
    if let Some(kind) = kind {
        let problem = format!("is {kind}, not a regular file");
        return Err(crate::Error::dataset(path, problem));
    }
    crate::util::with_room(|| std::fs::File::open(path)).map_err(|e| {
        match (e.raw_os_error(), crate::util::open_files_limit()) {
            (Some(libc::EMFILE), Some((soft, _))) => crate::Error::dataset(
                path,
                format!(
                    "cannot be opened: this process already has its limit of {soft} \
                     files open (RLIMIT_NOFILE, `ulimit -n`; a set keeps each of its files \
                     open): raise the hard limit, or join the shards into fewer, larger \
                     files"
                ),
            ),
            _ => crate::Error::io(path, e),
        }
    })
}

/// Opens `path` (a regular file, see [`open_regular`]), watched for changes, and maps
/// it; an empty file, which cannot be mapped, is the error `empty` makes.
///
/// # Errors
/// As [`open_regular`]; [`Error::Io`](crate::Error::Io) naming `path` if its metadata
/// cannot be read or it cannot be mapped; `empty()` for an empty file.
pub(crate) fn open_mapped(
    path: &Path,
    empty: impl FnOnce() -> crate::Error,
) -> Result<(guard::Watched, memmap2::Mmap)> {
    let watched = guard::Watched::new(path, open_regular(path)?)?;
    if watched.len() == 0 {
        return Err(empty());
    }
    // SAFETY: the mapping is read-only; stokehold never writes through it. Another
    // process may still truncate or rewrite the file while it is mapped: reads that go
    // through `Watched::read` (every gather) turn that into an error naming the file
    // instead of a SIGBUS or silently different bytes.
    let map =
        unsafe { memmap2::Mmap::map(watched.file()) }.map_err(|e| crate::Error::io(path, e))?;
    Ok((watched, map))
}

/// Opens the `.npy` at `path`, which must be a 1-d integer array: `what` says what it
/// holds in the error otherwise ("a token stream": "a token stream is a 1-d integer
/// array, this is float32 of shape (5, 3)").
///
/// # Errors
/// Anything [`NpyArray::open`] returns; [`Error::Dataset`](crate::Error::Dataset) for
/// another shape or type.
pub(crate) fn open_integers(path: &Path, what: &str) -> Result<NpyArray> {
    let array = NpyArray::open(path)?;
    if array.shape().len() != 1 || !array.dtype().is_integer() {
        return Err(crate::Error::dataset(
            path,
            format!(
                "{what} is a 1-d integer array, this is {} of shape {}",
                array.dtype(),
                shape_string(array.shape())
            ),
        ));
    }
    Ok(array)
}

/// Checks that `out` has one slice per column, each large enough for `n` rows.
pub(crate) fn check_out(columns: &[Column], n: usize, out: &[&mut [u8]]) -> Result<()> {
    if out.len() != columns.len() {
        return Err(crate::Error::Config(format!(
            "gather: {} output slices for {} columns",
            out.len(),
            columns.len()
        )));
    }
    for (c, o) in columns.iter().zip(out) {
        if o.len() < n * c.row_bytes {
            return Err(crate::Error::Config(format!(
                "gather: output for column {} holds {} bytes, {} rows need {}",
                c.name,
                o.len(),
                n,
                n * c.row_bytes
            )));
        }
    }
    Ok(())
}

impl<D: Dataset + ?Sized> Dataset for std::sync::Arc<D> {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn columns(&self) -> &[Column] {
        (**self).columns()
    }
    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        (**self).gather(epoch, indices, out)
    }
    fn files(&self) -> Vec<MappedFile<'_>> {
        (**self).files()
    }
    fn lengths(&self) -> Result<Option<Vec<u32>>> {
        (**self).lengths()
    }
    fn locate(&self, epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        (**self).locate(epoch, index, each)
    }
    fn fingerprint(&self) -> u64 {
        (**self).fingerprint()
    }
    fn same_every_epoch(&self) -> bool {
        (**self).same_every_epoch()
    }
}
