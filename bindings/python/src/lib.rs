//! `stokehold._stokehold`: the Python face of the stokehold loader.
//!
//! The Rust core knows nothing of Python; this crate wraps its public API. Batches are
//! NumPy arrays viewing the loader's own host buffers (no copy): each view holds its
//! batch, and the buffer returns to the loader's pool when the batch and every view of
//! it are gone. The GIL is released while a batch is awaited.

mod augment;
mod device;

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use numpy::ndarray::{ArrayView1, ArrayView2};
use numpy::{PyArray1, PyArray2};
use pyo3::exceptions::{PyException, PyIndexError, PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use stokehold::model::Metrics;
use stokehold::pagecache::{self, Residency};
use stokehold::report::{EpochProgress, EpochRow, LoopTimes, Setup, TrainReport};
use stokehold::{
    Column, Concat, DType, Dataset, Documents, HostBatch, LitData, LoaderState, Mix, NpyDataset,
    Packed, Shard, Shuffle, TokenDataset, Windows,
};

pyo3::create_exception!(
    _stokehold,
    Error,
    PyException,
    "A stokehold error: the message names the file and the problem."
);

/// `e` as a `stokehold.Error`; one from the CUDA driver carries its `cuda_code` and
/// whether the context is lost (`context_lost`), which the class defaults to `None`
/// and `False`.
fn error(e: stokehold::Error) -> PyErr {
    let err = Error::new_err(e.to_string());
    if let Some(code) = e.cuda_code() {
        Python::attach(|py| {
            let value = err.value(py);
            // Setting an attribute of a fresh exception object cannot fail.
            let _ = value.setattr("cuda_code", code);
            let _ = value.setattr("context_lost", e.context_lost());
        });
    }
    err
}

/// The epoch a loader is running, shared by the loader and the epoch's Python object.
struct Running {
    /// Bumped each time an epoch starts or the loader is resumed: an older epoch
    /// object then finds it ended.
    generation: u64,
    /// Borrows the loader it came from (see [`Loader`] for why that is sound).
    epoch: Option<stokehold::Epoch<'static>>,
}

type Slot = Arc<Mutex<Running>>;

/// What the running epoch last showed, kept beside the slot: a thread waiting in
/// `__next__` holds the slot's lock for as long as its batch takes (for ever, while
/// every buffer is held by batches another thread keeps), and the loader's state and
/// the way to stop the epoch must be had meanwhile. Locked after the slot, never
/// before it.
struct Glance {
    /// The loader's state as the last call left it.
    state: LoaderState,
    /// The running epoch's generation and what stops its workers (waking a thread
    /// waiting for a buffer).
    stop: Option<(u64, stokehold::Canceller)>,
    /// The generation of an epoch being ended: a `__next__` its cancel woke says so.
    ended: Option<u64>,
    /// The running epoch's figures as its last `__next__` left them, for `stats()`
    /// and `row()` from any thread.
    shown: Option<Shown>,
}

/// An epoch's figures, seen from beside the slot.
#[derive(Clone, Copy)]
struct Shown {
    generation: u64,
    /// `Epoch::counts`: its stats bar the bytes read.
    counts: stokehold::EpochStats,
    /// The storage read counter when it started (`Epoch::read_at_start`).
    read_at_start: Option<u64>,
}

impl Shown {
    fn of(generation: u64, epoch: &stokehold::Epoch<'_>) -> Shown {
        Shown {
            generation,
            counts: epoch.counts(),
            read_at_start: epoch.read_at_start(),
        }
    }

    /// The epoch's stats now, as `Epoch::stats` gives them.
    fn stats(&self) -> stokehold::EpochStats {
        self.counts.with_reads_since(self.read_at_start)
    }
}

type Seen = Arc<Mutex<Glance>>;

/// Ends the running epoch (only if its generation is `only`, where given) and returns
/// the slot, locked: stops the epoch's workers first, so that a thread waiting in its
/// `__next__` lets go of the slot. To be called without the GIL.
fn end_epoch<'a>(slot: &'a Slot, seen: &Seen, only: Option<u64>) -> MutexGuard<'a, Running> {
    let wanted = |g: u64| !matches!(only, Some(o) if o != g);
    let stop = {
        let mut glance = lock(seen);
        match glance.stop.take() {
            Some((g, stop)) if wanted(g) => {
                glance.ended = Some(g);
                Some(stop)
            }
            other => {
                glance.stop = other;
                None
            }
        }
    };
    if let Some(stop) = stop {
        stop.cancel();
    }
    let mut running = lock(slot);
    if wanted(running.generation) {
        running.epoch = None;
    }
    running
}

/// The loader's pointer, sent to a thread without the GIL for one call.
struct SendPtr(*mut stokehold::Loader);

// SAFETY: `stokehold::Loader` is `Send`; the pointer is used by one thread at a time
// (the caller waits for the closure it is sent to).
unsafe impl Send for SendPtr {}

impl SendPtr {
    fn get(&self) -> *mut stokehold::Loader {
        self.0
    }
}

/// The error of an epoch object whose epoch the loader ended before it was exhausted.
fn ended() -> PyErr {
    Error::new_err("this epoch was ended: the loader started another epoch or was resumed")
}

/// Locks a mutex of this module (the slot, the glance), whether or not a thread
/// panicked holding it (nothing they hold is left half-changed by a panic).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a loader's batches look like, kept apart from the loader so that it can be read
/// while an epoch runs.
struct Shape {
    batches: u64,
    columns: Vec<Column>,
    dataset: Arc<dyn Dataset>,
    /// An empty report of this loader (its setup included), for `_Report`.
    report: TrainReport,
    /// Bytes of one sample, all columns.
    bytes_per_sample: u64,
    /// Whether epochs draw a progress bar (`None`: on a terminal only).
    progress: Option<bool>,
    /// The device slots batches are copied into, with `device="cuda"`.
    device: Option<device::Slots>,
    /// Whether their device cache holds every sample, read without their lock (a
    /// thread waiting for a slot holds it).
    cache_filled: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// The device time of their copies, read without their lock, for the `copy` of an
    /// epoch's row.
    copy_clock: Option<stokehold::cuda::CopyClock>,
    /// With `device_cache`, why the dataset does not fit (the cache's bytes are the
    /// report's `device_cache_bytes`).
    cache_refused: Option<String>,
    /// The loader's order, to check a resume state before the running epoch is ended.
    order: stokehold::Order,
    /// What the loader runs with (`info()`), fixed once built: read without ending the
    /// running epoch.
    info: Info,
    /// The process that built the loader: its worker threads live there only.
    pid: u32,
}

/// What a loader runs with, as built (`_Loader.info`).
struct Info {
    workers: usize,
    prefetch: usize,
    buffers: usize,
    pool_bytes: usize,
    page_cache_budget: u64,
    direct_reads: bool,
}

/// An opened dataset, for a loader to be built over.
#[pyclass(module = "stokehold._stokehold", name = "_Dataset")]
struct OpenDataset {
    dataset: Arc<dyn Dataset>,
    /// Where it came from, for the report.
    data: String,
    /// Seconds opening it took.
    open_s: f64,
    /// The same dataset where it is a mix, for its parts' shares and sources.
    mix: Option<Arc<Mix>>,
}

impl OpenDataset {
    fn opened(
        py: Python<'_>,
        data: String,
        open: impl FnOnce() -> stokehold::Result<Arc<dyn Dataset>> + Send,
    ) -> PyResult<OpenDataset> {
        let start = std::time::Instant::now();
        let dataset = py.detach(open).map_err(error)?;
        Ok(OpenDataset {
            dataset,
            data,
            open_s: start.elapsed().as_secs_f64(),
            mix: None,
        })
    }
}

#[pymethods]
impl OpenDataset {
    /// `.npy` columns: a directory (every `.npy` in it, `x` and `y` first) or
    /// `columns`, a list of paths.
    #[staticmethod]
    #[pyo3(signature = (path, columns))]
    fn npy(
        py: Python<'_>,
        path: Option<std::path::PathBuf>,
        columns: Option<Vec<std::path::PathBuf>>,
    ) -> PyResult<OpenDataset> {
        let data = match (&columns, &path) {
            (Some(c), _) => c
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(","),
            (None, Some(p)) => p.display().to_string(),
            (None, None) => String::new(),
        };
        Self::opened(py, data, move || {
            let ds = match (columns, path) {
                (Some(c), _) => NpyDataset::open_columns(c)?,
                (None, Some(p)) => NpyDataset::open(p)?,
                (None, None) => {
                    return Err(stokehold::Error::Config(
                        "give a directory or a list of column files".into(),
                    ))
                }
            };
            Ok(Arc::new(ds))
        })
    }

    /// A token file (llm.c `.bin`, a raw stream of `dtype`, or a 1-d `.npy`), or a
    /// LitData dataset of token chunks (its directory or `index.json`), cut into windows
    /// of `seq_len + 1` tokens. The token type of an llm.c file, a `.npy` or a LitData
    /// set is its own (`dtype`, if given, must agree); a raw stream's is `dtype`,
    /// `uint16` if not given.
    #[staticmethod]
    #[pyo3(signature = (path, seq_len, windows, seed, dtype))]
    fn tokens(
        py: Python<'_>,
        path: std::path::PathBuf,
        seq_len: usize,
        windows: &str,
        seed: u64,
        dtype: Option<String>,
    ) -> PyResult<OpenDataset> {
        let windows = windows_named(windows, seed)?;
        let litdata = path.is_dir() || path.file_name().is_some_and(|n| n == "index.json");
        let npy = path.extension().is_some_and(|e| e == "npy");
        let named = dtype.as_deref().map(|name| match DType::from_name(name) {
            // A set of its own type: checked against it once open.
            Some(d) if (litdata || npy) && d.is_integer() => Ok(d),
            Some(d) if matches!(d, DType::U16 | DType::U32) => Ok(d),
            _ if litdata || npy => Err(PyValueError::new_err(format!(
                "dtype {name:?}: a LitData set or a .npy stream holds integer tokens \
                 (\"uint16\", \"int32\"...)"
            ))),
            _ => Err(PyValueError::new_err(format!(
                "dtype {name:?}: token files hold \"uint16\" or \"uint32\""
            ))),
        });
        let named = named.transpose()?;
        let data = path.display().to_string();
        Self::opened(py, data, move || {
            let ds: Arc<dyn Dataset> = match npy {
                _ if litdata => Arc::new(LitData::open(&path)?.windows(seq_len, windows)?),
                true => Arc::new(TokenDataset::open_npy(&path, seq_len, windows)?),
                false => {
                    let dtype = match named {
                        Some(d) => d,
                        None => TokenDataset::header_dtype(&path)?.unwrap_or(DType::U16),
                    };
                    Arc::new(TokenDataset::open_bin(&path, dtype, seq_len, windows)?)
                }
            };
            // A LitData set and a `.npy` hold their own type (a `.bin` checked it).
            let held = ds.columns()[0].dtype;
            if let Some(d) = named.filter(|&d| d != held) {
                return Err(stokehold::Error::Config(format!(
                    "dtype {d} was asked for, and {} holds {held} tokens",
                    path.display()
                )));
            }
            Ok(ds)
        })
    }

    /// Variable-length documents packed: concatenated and cut into windows of
    /// `seq_len + 1` tokens, with each token's position in its document. The files are
    /// those of `documents`. With `shuffle_documents`, each file's documents are
    /// concatenated in another order each epoch (from `seed` and the file's place).
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (paths, seq_len, windows, seed, offsets, column, shuffle_documents, dtype=None))]
    fn packed(
        py: Python<'_>,
        paths: Vec<std::path::PathBuf>,
        seq_len: usize,
        windows: &str,
        seed: u64,
        offsets: Option<std::path::PathBuf>,
        column: Option<String>,
        shuffle_documents: bool,
        dtype: Option<&str>,
    ) -> PyResult<OpenDataset> {
        let windows = windows_named(windows, seed)?;
        let found = (offsets, column, dtype);
        Self::parts(py, paths, found, move |part, path, layout| {
            let windows = windows.for_part(part);
            let packed = match layout {
                Layout::Npy(o) => Packed::open_npy(path, o, seq_len, windows)?,
                Layout::Arrow(c) => Packed::open_arrow(path, &c, seq_len, windows)?,
                Layout::Mds(c, None) => Packed::open_mds(path, &c, seq_len, windows)?,
                Layout::Mds(c, Some(d)) => Packed::open_mds_bytes(path, &c, d, seq_len, windows)?,
                Layout::Megatron => Packed::open_megatron(path, seq_len, windows)?,
            };
            Ok(Arc::new(match shuffle_documents {
                true => packed.shuffle_documents(seed.wrapping_add(part as u64)),
                false => packed,
            }))
        })
    }

    /// Variable-length documents padded to `max_len`: a Megatron indexed dataset
    /// (`path` is its prefix, or its `.idx` or `.bin`), an Arrow IPC file's list
    /// `column`, or, with `offsets`, a 1-d token `.npy` at `path` and the `n + 1`
    /// offsets into it; an MDS shard's `column`, its values `dtype` where given (a
    /// `bytes` column's). Several paths (a table's shards) are one set, in order.
    #[staticmethod]
    #[pyo3(signature = (paths, max_len, pad, offsets, column, dtype=None))]
    fn documents(
        py: Python<'_>,
        paths: Vec<std::path::PathBuf>,
        max_len: usize,
        pad: i64,
        offsets: Option<std::path::PathBuf>,
        column: Option<String>,
        dtype: Option<&str>,
    ) -> PyResult<OpenDataset> {
        Self::parts(
            py,
            paths,
            (offsets, column, dtype),
            move |_, path, layout| {
                Ok(Arc::new(match layout {
                    Layout::Npy(o) => Documents::open_npy(path, o, max_len, pad)?,
                    Layout::Arrow(c) => Documents::open_arrow(path, &c, max_len, pad)?,
                    Layout::Mds(c, None) => Documents::open_mds(path, &c, max_len, pad)?,
                    Layout::Mds(c, Some(d)) => {
                        Documents::open_mds_bytes(path, &c, d, max_len, pad)?
                    }
                    Layout::Megatron => Documents::open_megatron(path, max_len, pad)?,
                }))
            },
        )
    }

    /// Several opened datasets mixed by `weights`, `samples` an epoch (`None`: as many
    /// as they hold together), their orders drawn from `seed`.
    #[staticmethod]
    #[pyo3(signature = (parts, weights, samples, seed))]
    fn mix(
        parts: Vec<PyRef<'_, OpenDataset>>,
        weights: Vec<f64>,
        samples: Option<u64>,
        seed: u64,
    ) -> PyResult<OpenDataset> {
        let data = parts
            .iter()
            .zip(&weights)
            .map(|(p, w)| format!("{}*{w}", p.data))
            .collect::<Vec<_>>()
            .join("+");
        let open_s = parts.iter().map(|p| p.open_s).sum();
        let datasets = parts.iter().map(|p| Arc::clone(&p.dataset)).collect();
        let mix = Arc::new(Mix::new(datasets, &weights, samples, seed).map_err(error)?);
        Ok(OpenDataset {
            dataset: Arc::clone(&mix) as Arc<dyn Dataset>,
            data,
            open_s,
            mix: Some(mix),
        })
    }

    /// A mix's samples from each part an epoch.
    fn takes(&self) -> PyResult<Vec<u64>> {
        Ok(self.as_mix()?.takes().to_vec())
    }

    /// A mix's part and part's sample at each of `indices` in `epoch`.
    fn sources(&self, epoch: u64, indices: Vec<u64>) -> PyResult<(Vec<i64>, Vec<u64>)> {
        let mix = self.as_mix()?;
        let (mut parts, mut samples) = (Vec::new(), Vec::new());
        for i in indices {
            let (p, s) = mix.source(epoch, i).ok_or_else(|| {
                PyIndexError::new_err(format!("position {i} of a mix of {}", mix.len()))
            })?;
            parts.push(p as i64);
            samples.push(s);
        }
        Ok((parts, samples))
    }
}

impl OpenDataset {
    /// The mix this dataset is, or an error saying it is none.
    fn as_mix(&self) -> PyResult<&Arc<Mix>> {
        self.mix
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("not a mix of datasets"))
    }

    /// Opens each of `paths` with `open` (in the layout its name and the options
    /// `(offsets, column, dtype)` say), as one dataset: a [`Concat`] of them where there
    /// are several.
    fn parts(
        py: Python<'_>,
        paths: Vec<std::path::PathBuf>,
        (offsets, column, dtype): (Option<std::path::PathBuf>, Option<String>, Option<&str>),
        open: impl Fn(usize, &std::path::Path, Layout) -> stokehold::Result<Arc<dyn Dataset>> + Send,
    ) -> PyResult<OpenDataset> {
        let dtype = dtype
            .map(|name| {
                DType::from_name(name).ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "dtype {name:?}: not a NumPy type stokehold reads"
                    ))
                })
            })
            .transpose()?;
        if paths.is_empty() || (paths.len() > 1 && offsets.is_some()) {
            return Err(PyValueError::new_err(
                "give one path, or several (a table's shards) without offsets",
            ));
        }
        let layouts = paths
            .iter()
            .map(|p| Layout::of(p, offsets.clone(), column.clone(), dtype))
            .collect::<PyResult<Vec<_>>>()?;
        let data = paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(",");
        Self::opened(py, data, move || {
            let mut parts = paths
                .iter()
                .zip(layouts)
                .enumerate()
                .map(|(part, (p, layout))| open(part, p, layout))
                .collect::<stokehold::Result<Vec<_>>>()?;
            match parts.len() {
                1 => Ok(parts.remove(0)),
                _ => Ok(Arc::new(Concat::new(parts)?)),
            }
        })
    }
}

/// Takes turns at the calls that use the loader itself (starting an epoch, resuming,
/// draining, reading its figures): one at a time, a second thread's call waiting
/// without the GIL (with `&mut self`, pyo3's borrow flag would fail it instead, with
/// "Already borrowed", while the first waits for the old epoch's workers).
#[derive(Default)]
struct Control {
    busy: Mutex<bool>,
    free: std::sync::Condvar,
}

/// The turn at the loader, until dropped.
struct Turn<'a>(&'a Control);

impl Control {
    /// Waits for the turn, without the GIL.
    fn take(&self, py: Python<'_>) -> Turn<'_> {
        py.detach(|| {
            let mut busy = lock(&self.busy);
            while *busy {
                busy = self.free.wait(busy).unwrap_or_else(|e| e.into_inner());
            }
            *busy = true;
        });
        Turn(self)
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *lock(&self.0.busy) = false;
        self.0.free.notify_one();
    }
}

/// A loader over `.npy` columns, a token file or documents.
///
/// The Rust loader lives on the heap behind `loader` and is reached only through this
/// pointer: an epoch (`stokehold::Epoch<'static>` in `slot`) borrows it mutably, so the
/// loader itself is touched only while no epoch is held, by the holder of the
/// control's turn (each method that needs it takes the turn and ends the running epoch
/// first), and it is freed only after the slot is emptied (`Drop`). Every epoch object
/// holds a reference to this object, which therefore outlives them.
#[pyclass(module = "stokehold._stokehold", name = "_Loader")]
struct Loader {
    slot: Slot,
    seen: Seen,
    control: Control,
    loader: NonNull<stokehold::Loader>,
    shape: Shape,
}

// SAFETY: `stokehold::Loader` is `Send` and `Sync`; the pointer is owned (a leaked Box)
// and reached only under the rules above: the control's turn for the loader, the
// slot's mutex for the epoch.
unsafe impl Send for Loader {}
// SAFETY: as for `Send`: shared access reads `shape`, locks `slot` or `seen`, and
// reaches the loader only holding the control's turn.
unsafe impl Sync for Loader {}

/// Fails in a forked child of process `pid`, which built the loader: its worker threads
/// (and any thread waiting in one of its epochs) exist in that process only, so an
/// epoch here would wait for them for ever.
fn forked(pid: u32) -> PyResult<()> {
    match std::process::id() == pid {
        true => Ok(()),
        false => Err(Error::new_err(format!(
            "this loader was built in process {pid}, and this is a forked child of it \
             (a DataLoader worker, multiprocessing with fork): its worker threads do not \
             exist here; build a loader in the child, or start children with spawn"
        ))),
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        if std::process::id() != self.shape.pid {
            // A forked child: ending the epoch or joining the workers would wait for
            // threads that do not exist here. The copies of them are left as they are.
            match self.slot.try_lock() {
                Ok(mut running) => std::mem::forget(running.epoch.take()),
                // Locked in the parent when it forked (a thread waited for a batch): the
                // epoch stays where it is, never dropped.
                Err(_) => std::mem::forget(Arc::clone(&self.slot)),
            }
            std::mem::forget(self.shape.device.take());
            return;
        }
        let slot = Arc::clone(&self.slot);
        let loader = SendPtr(self.loader.as_ptr());
        let device = self.shape.device.take();
        let end = move || {
            // The epoch borrows the loader: it goes first.
            lock(&slot).epoch = None;
            // SAFETY: the pointer came from `Box::leak` in `build` and nothing borrows
            // the loader any more (the slot is empty and every epoch object is gone,
            // since each holds a reference to this one).
            drop(unsafe { Box::from_raw(loader.get()) });
            // The device slots wait for their copies, which wait for the consumers'
            // streams (whose work may need the GIL: a host callback).
            drop(device);
        };
        // Ending an epoch and joining the threads wait for the workers: without the
        // GIL, so that other Python threads run meanwhile (with it while the
        // interpreter shuts down, when it cannot be let go).
        let mut end = Some(end);
        Python::try_attach(|py| {
            py.detach(|| {
                if let Some(end) = end.take() {
                    end();
                }
            })
        });
        if let Some(end) = end {
            end();
        }
    }
}

/// Which files hold a set of documents.
enum Layout {
    /// A token `.npy` and these offsets.
    Npy(std::path::PathBuf),
    /// This list column of an Arrow IPC file.
    Arrow(String),
    /// This array column of an MDS shard, its values of this type where given (a
    /// `bytes` column's).
    Mds(String, Option<DType>),
    /// A Megatron / fairseq indexed dataset.
    Megatron,
}

impl Layout {
    /// The layout `path` and the options name: offsets for a token `.npy`, an `.arrow`
    /// file's column (`input_ids` unless given), an `.mds` shard's (`tokens`, LLM
    /// Foundry's, unless given), or else a Megatron prefix.
    fn of(
        path: &std::path::Path,
        offsets: Option<std::path::PathBuf>,
        column: Option<String>,
        dtype: Option<DType>,
    ) -> PyResult<Layout> {
        let arrow = path.extension().is_some_and(|e| e == "arrow");
        // (`shard.00000.mds.zstd` too: its error says to decompress it.)
        let name = path.file_name().map(|n| n.to_string_lossy());
        let mds = name.is_some_and(|n| n.ends_with(".mds") || n.contains(".mds."));
        if dtype.is_some() && !mds {
            return Err(PyValueError::new_err(format!(
                "dtype is for an .mds shard's column (raw bytes), and {} is none",
                path.display()
            )));
        }
        match (offsets, column) {
            (Some(_), Some(_)) => Err(PyValueError::new_err(
                "give offsets (a token .npy) or column (an .arrow file or .mds shard), not both",
            )),
            (Some(o), None) => Ok(Layout::Npy(o)),
            (None, column) if arrow => Ok(Layout::Arrow(column.unwrap_or("input_ids".into()))),
            (None, column) if mds => Ok(Layout::Mds(column.unwrap_or("tokens".into()), dtype)),
            (None, Some(c)) => Err(PyValueError::new_err(format!(
                "column {c:?} is for an .arrow file or an .mds shard, and {} is neither",
                path.display()
            ))),
            (None, None) => Ok(Layout::Megatron),
        }
    }
}

/// The windows named `"random"` (drawn from `seed`) or `"consecutive"`.
fn windows_named(name: &str, seed: u64) -> PyResult<Windows> {
    match name {
        "random" => Ok(Windows::Random { seed }),
        "consecutive" => Ok(Windows::Consecutive),
        other => Err(PyValueError::new_err(format!(
            "windows {other:?}: expected \"random\" or \"consecutive\""
        ))),
    }
}

fn shuffle_named(name: &str, seed: u64) -> PyResult<Shuffle> {
    Shuffle::named(name, seed).map_err(|e| PyValueError::new_err(e.to_string()))
}

fn shard(rank: Option<u64>, world_size: Option<u64>) -> PyResult<Shard> {
    match (rank, world_size) {
        (None, None) => Shard::from_env().map_err(error),
        (Some(r), Some(w)) => Shard::new(r, w).map_err(error),
        _ => Err(PyValueError::new_err(
            "rank and world_size go together: give both or neither",
        )),
    }
}

/// What a loader is built from, besides its dataset.
struct Options {
    batch_size: usize,
    shuffle: Shuffle,
    workers: Option<usize>,
    drop_last: bool,
    prefetch: Option<usize>,
    held: Option<usize>,
    shard: Shard,
    page_cache_budget: Option<u64>,
    /// Whether streamed files are read with direct I/O.
    direct_reads: bool,
    progress: Option<bool>,
    /// `"cuda"` or `"cuda:N"`: batches are copied to that device.
    device: Option<String>,
    /// The augmentation of an image column, if any.
    augment: Option<stokehold::Augment>,
    /// The share of the device's free memory a device cache may take, if one is asked for.
    device_cache: Option<f64>,
    data: String,
    /// Seconds opening the dataset took.
    open_s: f64,
}

/// The device ordinal `device` names (`"cuda"`, `"cuda:N"`; `"cpu"` or `None`: none).
fn device_ordinal(device: Option<&str>) -> PyResult<Option<usize>> {
    match device {
        None | Some("cpu") => Ok(None),
        // The thread's current device (PyTorch's), else torchrun's LOCAL_RANK, else 0.
        Some("cuda") => Ok(Some(stokehold::cuda::default_device())),
        Some(d) => d
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Some)
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "device {d:?}: expected \"cpu\", \"cuda\" or \"cuda:N\""
                ))
            }),
    }
}

/// Enables the device cache of `slots` for `loader`'s dataset, within `share` of the
/// device's free memory: its bytes, or why it does not fit (the loader goes on without).
///
/// # Errors
/// `stokehold.Error` where no epoch of the loader could fill a cache (sharded, dropping
/// a tail, samples that change each epoch), or for a driver or NVRTC error.
fn enable_cache(
    slots: &mut stokehold::cuda::DeviceSlots,
    cuda: &stokehold::cuda::Cuda,
    loader: &stokehold::Loader,
    share: f64,
) -> PyResult<Result<u64, String>> {
    let order = loader.order();
    let refused = |why: &str| {
        Error::new_err(format!(
            "device_cache: {why}; a device cache needs every sample, the same each epoch"
        ))
    };
    if !order.is_whole() {
        return Err(refused(&format!(
            "an epoch of this loader leaves samples out (rank {} of {}, drop_last={})",
            order.shard().rank(),
            order.shard().world_size(),
            loader.batches() * order.batch_size() < order.len()
        )));
    }
    if !loader.dataset().same_every_epoch() {
        return Err(refused(
            "this dataset's samples change every epoch (random token windows, a mix)",
        ));
    }
    match slots
        .enable_device_cache(cuda, loader, share)
        .map_err(error)?
    {
        Some(bytes) => Ok(Ok(bytes)),
        None => {
            let row_bytes: u64 = loader
                .layout()
                .columns()
                .iter()
                .map(|c| c.row_bytes as u64)
                .sum();
            let (free, _) = cuda.ctx.mem_get_info().map_err(|e| error(e.into()))?;
            Ok(Err(format!(
                "device_cache: the dataset's {:.1} MB do not fit under {share} of the \
                 device's {:.1} MB free; epochs copy every batch instead",
                (row_bytes * order.len()) as f64 / 1e6,
                free as f64 / 1e6
            )))
        }
    }
}

fn build(dataset: Arc<dyn Dataset>, o: Options) -> PyResult<Loader> {
    let Options {
        batch_size,
        shuffle,
        workers,
        drop_last,
        prefetch,
        held,
        shard,
        page_cache_budget,
        direct_reads,
        progress,
        device,
        augment,
        device_cache,
        data,
        open_s,
    } = o;
    let named = |reason: String| {
        Error::new_err(format!(
            "device={:?}: {reason}",
            device.as_deref().unwrap_or("")
        ))
    };
    // The context's handles bind it as they go, the last ones at the end here on an
    // error: the thread's own context (PyTorch's device) is put back after.
    let _current = device.as_ref().map(|_| stokehold::cuda::KeepCurrent::new());
    let ordinal = device_ordinal(device.as_deref())?;
    if let (Some(_), None) = (device_cache, ordinal) {
        return Err(Error::new_err(
            "device_cache keeps the dataset on a CUDA device: it goes with device=\"cuda\"",
        ));
    }
    // Augmenting on the device and the device cache compile kernels: NVRTC is needed
    // too, not the driver only.
    let nvrtc = augment.is_some() || device_cache.is_some();
    let (ctx, cuda) = match (ordinal, nvrtc) {
        (None, _) => (None, None),
        (Some(n), false) => (
            Some(stokehold::cuda::probe_driver(n).map_err(named)?.ctx),
            None,
        ),
        (Some(n), true) => {
            let c = stokehold::cuda::probe_device(n).map_err(named)?;
            (Some(Arc::clone(&c.ctx)), Some(c))
        }
    };
    let mut b = stokehold::Loader::builder_shared(Arc::clone(&dataset))
        .batch_size(batch_size)
        .shuffle(shuffle)
        .shard(shard)
        .drop_last(drop_last)
        .direct_reads(direct_reads);
    if let Some(w) = workers {
        b = b.workers(w);
    }
    if let Some(p) = prefetch {
        b = b.prefetch(p);
    }
    // On a device, the loop holds device slots (`held + 2` of them, below), not host
    // batches: the host pool holds the batches the slots keep while their copies run.
    let held_by_loop = held.unwrap_or(stokehold::DEFAULT_HELD);
    if ctx.is_some() {
        b = b.held(stokehold::cuda::DeviceSlots::HOST_BATCHES);
    } else if let Some(h) = held {
        b = b.held(h);
    }
    if let Some(bytes) = page_cache_budget {
        b = b.page_cache_budget(bytes);
    }
    match (&augment, &ctx) {
        // On the host, the workers augment; on a device, the device does, after the copy.
        (Some(a), None) => b = b.augment(a.clone()),
        (_, Some(ctx)) => {
            // Batches are gathered straight into page-locked memory, for asynchronous
            // copies.
            let pinned = stokehold::cuda::PinnedAlloc::new(
                Arc::clone(ctx),
                stokehold::cuda::PinnedKind::Plain,
            );
            b = b.allocator(Arc::new(pinned));
        }
        (None, None) => {}
    }
    let loader = b.build().map_err(error)?;
    let mut columns = loader.layout().columns().to_vec();
    // The device cache's size, or why it does not fit.
    let mut cache = Ok(None);
    let mut cache_filled = None;
    let mut copy_clock = None;
    let device = match (&ctx, &cuda, &augment) {
        (Some(ctx), _, _) => {
            // As many slots as batches the loop may hold, plus the one being copied and
            // the one being read.
            let slots = held_by_loop.checked_add(2).ok_or_else(|| {
                PyValueError::new_err(format!("held={held_by_loop}: too many device slots"))
            })?;
            let layout = loader.layout();
            let mut s = match (&cuda, &augment) {
                (Some(c), Some(a)) => {
                    let augmenter = a.bind(layout.columns()).map_err(error)?;
                    columns = augmenter.columns().to_vec();
                    stokehold::cuda::DeviceSlots::augmented(c, layout, slots, &augmenter)
                }
                _ => stokehold::cuda::DeviceSlots::new(ctx, layout, slots),
            }
            .map_err(error)?;
            // Ctrl-C while the loop waits for a slot (a batch kept on another thread):
            // the wait stops every 20 ms for `__next__` to run Python's signal handlers.
            s.interrupt_with(|| true);
            if let (Some(share), Some(c)) = (device_cache, &cuda) {
                cache = enable_cache(&mut s, c, &loader, share)?.map(Some);
            }
            cache_filled = Some(s.cache_filled_flag());
            copy_clock = Some(s.copy_clock());
            Some(Arc::new(Mutex::new(s)))
        }
        _ => None,
    };
    let mut report = TrainReport::new("python", data, &loader);
    report.setup = Setup::of_loader(&loader);
    let (cache_bytes, cache_refused) = match cache {
        Ok(bytes) => (bytes, None),
        Err(why) => (None, Some(why)),
    };
    report.device_cache_bytes = cache_bytes;
    report.setup.dataset_open_s = open_s;
    // The bytes of a sample as the loop gets it (augmented, where the device augments).
    let bytes_per_sample = columns.iter().map(|c| c.row_bytes as u64).sum();
    // Left to stderr being a terminal, only rank 0 of several draws its bar: each rank of
    // a torchrun job shares the terminal, and their bars would overwrite each other.
    let progress = progress.or((shard.world_size() > 1 && shard.rank() != 0).then_some(false));
    let shape = Shape {
        batches: loader.batches(),
        columns,
        bytes_per_sample,
        dataset,
        report,
        progress,
        device,
        cache_filled,
        copy_clock,
        cache_refused,
        order: loader.order().clone(),
        info: Info {
            workers: loader.workers(),
            prefetch: loader.prefetch(),
            buffers: loader.buffers(),
            pool_bytes: loader.pool_bytes(),
            page_cache_budget: loader.page_cache_budget(),
            direct_reads: loader.direct_reads(),
        },
        pid: std::process::id(),
    };
    Ok(Loader {
        slot: Arc::new(Mutex::new(Running {
            generation: 0,
            epoch: None,
        })),
        seen: Arc::new(Mutex::new(Glance {
            state: loader.state(),
            stop: None,
            ended: None,
            shown: None,
        })),
        control: Control::default(),
        loader: NonNull::from(Box::leak(Box::new(loader))),
        shape,
    })
}

impl Loader {
    /// Ends the running epoch, if any, and returns the loader. The slot is locked with
    /// the GIL released: a thread waiting for a batch holds the lock without the GIL
    /// (and is woken first, by stopping the epoch's workers).
    ///
    /// # Errors
    /// In a forked child of the process that built the loader (see [`forked`]).
    fn idle<'t>(
        &self,
        py: Python<'_>,
        _turn: &'t mut Turn<'_>,
    ) -> PyResult<&'t mut stokehold::Loader> {
        forked(self.shape.pid)?;
        let (slot, seen) = (Arc::clone(&self.slot), Arc::clone(&self.seen));
        py.detach(move || end_epoch(&slot, &seen, None).generation += 1);
        // SAFETY: the slot is empty, so no epoch borrows the loader, and every other
        // use of it takes the turn, held (and borrowed) for the returned borrow's life.
        Ok(unsafe { &mut *self.loader.as_ptr() })
    }

    /// Notes the loader's state (after a resume or a drained epoch) for `state_json`.
    fn note_state(&self, state: LoaderState) {
        lock(&self.seen).state = state;
    }
}

#[pymethods]
impl Loader {
    /// Builds a loader over `dataset` (from `_Dataset.npy`, `_Dataset.tokens` or
    /// `_Dataset.documents`); `group` sets a grouped shuffle's group.
    #[new]
    #[pyo3(signature = (dataset, batch_size, shuffle, seed, workers, drop_last, prefetch, held, rank, world_size, page_cache_budget, progress, device=None, direct_reads=true, group=None, augment=None, device_cache=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        dataset: PyRef<'_, OpenDataset>,
        batch_size: usize,
        shuffle: &str,
        seed: u64,
        workers: Option<usize>,
        drop_last: bool,
        prefetch: Option<usize>,
        held: Option<usize>,
        rank: Option<u64>,
        world_size: Option<u64>,
        page_cache_budget: Option<u64>,
        progress: Option<bool>,
        device: Option<String>,
        direct_reads: bool,
        group: Option<u64>,
        augment: Option<augment::Args>,
        device_cache: Option<f64>,
    ) -> PyResult<Loader> {
        if device_cache.is_some_and(|s| !(s > 0.0 && s <= 1.0)) {
            return Err(PyValueError::new_err(format!(
                "device_cache={}: a share of the device's free memory, in (0, 1]",
                device_cache.unwrap_or_default()
            )));
        }
        let shuffle = match (shuffle_named(shuffle, seed)?, group) {
            (Shuffle::Grouped { .. }, Some(0)) => {
                return Err(PyValueError::new_err(
                    "group=0: a group is 1 position or more (None: the loader's default)",
                ))
            }
            (Shuffle::Grouped { seed, .. }, Some(group)) => Shuffle::Grouped { seed, group },
            (_, Some(_)) => {
                return Err(PyValueError::new_err("group goes with shuffle=\"grouped\""))
            }
            (s, None) => s,
        };
        let options = Options {
            batch_size,
            shuffle,
            workers,
            drop_last,
            prefetch,
            held,
            shard: shard(rank, world_size)?,
            page_cache_budget,
            direct_reads,
            progress,
            device,
            augment: augment.map(augment::Args::augment),
            device_cache,
            data: dataset.data.clone(),
            open_s: dataset.open_s,
        };
        let dataset = Arc::clone(&dataset.dataset);
        // Without the GIL: allocating and touching the pool, starting the threads and,
        // for a device, creating its context and compiling kernels take up to seconds,
        // in which the interpreter's other threads (a heartbeat, a watchdog) run on.
        let loader = py.detach(move || build(dataset, options))?;
        if let Some(why) = &loader.shape.cache_refused {
            let warning = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
            PyErr::warn(py, &warning, &std::ffi::CString::new(why.as_str())?, 1)?;
        }
        Ok(loader)
    }

    /// Bytes of the device cache (`device_cache`), or `None` without one.
    fn device_cache_bytes(&self) -> Option<u64> {
        self.shape.report.device_cache_bytes
    }

    /// Whether the device cache holds every sample: epochs started from now on gather
    /// their batches there.
    fn device_cache_filled(&self) -> bool {
        self.shape
            .cache_filled
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Acquire))
    }

    /// Batches per epoch for this rank.
    fn __len__(&self) -> usize {
        self.shape.batches as usize
    }

    /// The columns: a list of `(name, numpy dtype string, shape of one sample)`.
    fn columns<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items: Vec<Bound<'py, PyTuple>> = self
            .shape
            .columns
            .iter()
            .map(|c| (c.name.clone(), c.dtype.descr(), c.shape.clone()).into_pyobject(py))
            .collect::<PyResult<_>>()?;
        PyList::new(py, items)
    }

    /// Starts epoch `epoch` (ending the one running, if any) and returns its batches.
    fn epoch(slf: PyRef<'_, Self>, py: Python<'_>, epoch: u64) -> PyResult<Epoch> {
        let slot = Arc::clone(&slf.slot);
        let mut turn = slf.control.take(py);
        let loader: *mut stokehold::Loader = slf.idle(py, &mut turn)?;
        let loader = SendPtr(loader);
        // Once the device cache holds every sample, the epoch's batches carry their
        // indices only, and the slots gather them on the device.
        let cached = slf.device_cache_filled();
        let started = py.detach(move || {
            // SAFETY: `idle` emptied the slot, and the turn is held until the epoch is
            // in it: this is the only borrow of the loader; it is stored in the slot,
            // which `Drop` empties before freeing the loader, and the epoch object holds
            // a reference to this object, so the loader outlives every use of the borrow.
            let loader = unsafe { &mut *loader.get() };
            let started = match cached {
                true => loader.epoch_indices(epoch),
                false => loader.epoch(epoch),
            };
            (cached, started)
        });
        let (cached, started) = started;
        let mut started: stokehold::Epoch<'static> = started.map_err(error)?;
        // Ctrl-C while the loop waits for a batch: the wait stops every 50 ms for
        // `__next__` to run Python's signal handlers.
        started.interrupt_with(|| true);
        let began = started.started();
        let len = started.len();
        // What the bar counts: the samples of the batches left (a resumed epoch starts
        // part of the way in; `drop_last` leaves the tail out).
        let samples = {
            let order = started.order();
            let taken = started.first_batch().saturating_mul(order.batch_size());
            order.items() - taken.min(order.items())
        };
        let seen = Arc::clone(&slf.seen);
        let generation = {
            let (slot, seen) = (Arc::clone(&slot), Arc::clone(&seen));
            // Nobody else can hold the lock now (this thread holds the turn, and the
            // slot is empty), but it is taken without the GIL all the same.
            py.detach(move || {
                let mut running = lock(&slot);
                let generation = running.generation;
                *lock(&seen) = Glance {
                    state: started.state(),
                    stop: Some((generation, started.canceller())),
                    ended: None,
                    shown: Some(Shown::of(generation, &started)),
                };
                running.epoch = Some(started);
                generation
            })
        };
        drop(turn);
        let columns = slf.shape.columns.clone();
        let quiet = match slf.shape.progress {
            Some(on) => !on,
            None => !std::io::IsTerminal::is_terminal(&std::io::stderr()),
        };
        let progress = (!quiet).then(|| {
            Mutex::new(EpochProgress::new(
                epoch,
                samples,
                slf.shape.bytes_per_sample,
                false,
            ))
        });
        let dataset = Arc::clone(&slf.shape.dataset);
        let device = slf.shape.device.clone();
        let copy_clock = slf.shape.copy_clock.clone().map(|c| {
            let at = c.elapsed();
            (c, at)
        });
        let pid = slf.shape.pid;
        Ok(Epoch {
            dataset,
            device,
            _loader: slf.into(),
            slot,
            seen,
            generation,
            number: epoch,
            len,
            cached,
            columns: columns.into(),
            progress: Mutex::new(progress),
            pid,
            exhausted: AtomicBool::new(false),
            failed: Mutex::new(None),
            last: Mutex::new(None),
            started: began,
            copy_clock,
        })
    }

    /// Where the loader is: a JSON string of `{epoch, batch, order}`; mid-epoch, the
    /// batches delivered so far. It does not wait for a thread waiting for a batch.
    fn state_json(&self, py: Python<'_>) -> PyResult<String> {
        let seen = Arc::clone(&self.seen);
        let state = py.detach(move || lock(&seen).state);
        serde_json::to_string(&state).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Resumes from a state saved by `state_json` (ending the running epoch): the next
    /// `epoch(e)` for the saved epoch yields exactly the rest of it, or, `elastic`, this
    /// rank's share of what the saving loader's ranks had not taken.
    #[pyo3(signature = (json, elastic=false))]
    fn resume_json(&self, py: Python<'_>, json: &str, elastic: bool) -> PyResult<()> {
        let state: LoaderState = serde_json::from_str(json)
            .map_err(|e| Error::new_err(format!("a loader state: {e}")))?;
        // Refused before the running epoch is ended: a rejected state changes nothing.
        state.check(&self.shape.order, elastic).map_err(error)?;
        let mut turn = self.control.take(py);
        let loader = self.idle(py, &mut turn)?;
        let resumed = match elastic {
            true => loader.resume_elastic(state),
            false => loader.resume(state),
        };
        self.note_state(loader.state());
        resumed.map_err(error)
    }

    /// Runs epoch `epoch` in Rust, taking every batch and dropping it, with the GIL
    /// released: `(samples, seconds)`, the loader's own speed without Python, for
    /// benchmarks. Ends the running epoch.
    fn drain(&self, py: Python<'_>, epoch: u64) -> PyResult<(u64, f64)> {
        let mut turn = self.control.take(py);
        let loader = SendPtr(self.idle(py, &mut turn)?);
        let (drained, state) = py.detach(move || {
            let start = std::time::Instant::now();
            // SAFETY: `idle` emptied the slot and the turn is held for this call: this
            // is the only borrow of the loader.
            let loader = unsafe { &mut *loader.get() };
            let drained = (|| {
                let mut samples = 0u64;
                for batch in loader.epoch(epoch)? {
                    samples += batch?.len() as u64;
                }
                Ok((samples, start.elapsed().as_secs_f64()))
            })();
            (drained, loader.state())
        });
        self.note_state(state);
        drained.map_err(error)
    }

    /// The page-cache residency of the dataset's files: `(resident pages, pages, pages
    /// of unknown residency)`.
    fn residency(&self, py: Python<'_>) -> PyResult<(u64, u64, u64)> {
        let dataset = Arc::clone(&self.shape.dataset);
        let r = py
            .detach(move || pagecache::residency(dataset.as_ref()))
            .map_err(error)?;
        Ok((r.resident, r.pages, r.unknown))
    }

    /// An empty report of this loader's epochs (its setup included).
    fn report(&self, device: &str) -> Report {
        let mut report = self.shape.report.clone();
        report.device = device.to_string();
        Report { report }
    }

    /// The epoch report's figures of the loader (workers, prefetch, buffers, pool): as
    /// built, so the running epoch goes on.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = &self.shape.info;
        let d = PyDict::new(py);
        d.set_item("workers", i.workers)?;
        d.set_item("prefetch", i.prefetch)?;
        d.set_item("buffers", i.buffers)?;
        d.set_item("pool_bytes", i.pool_bytes)?;
        d.set_item("page_cache_budget", i.page_cache_budget)?;
        d.set_item("direct_reads", i.direct_reads)?;
        Ok(d)
    }
}

/// One epoch's batches, in order.
#[pyclass(module = "stokehold._stokehold", name = "_Epoch")]
struct Epoch {
    /// The device slots batches are copied into, with `device="cuda"`. Before the
    /// loader: dropped first, so that the loader's drop lets go of the slots' last
    /// handle, without the GIL.
    device: Option<device::Slots>,
    _loader: Py<Loader>,
    dataset: Arc<dyn Dataset>,
    slot: Slot,
    seen: Seen,
    generation: u64,
    number: u64,
    len: usize,
    /// Whether its batches are gathered from the device cache (indices only from the
    /// loader).
    cached: bool,
    columns: Arc<[Column]>,
    progress: Mutex<Option<Mutex<EpochProgress>>>,
    /// The process that built the loader (see [`forked`]).
    pid: u32,
    /// Set once the epoch has yielded its last batch: `__next__` stops from then on,
    /// even after the loader has started another epoch.
    exhausted: AtomicBool,
    /// Why the epoch ended before its last batch, if an error ended it: `__next__`
    /// raises it again rather than stop, so that a loop that caught it does not go on
    /// as if the epoch were whole.
    failed: Mutex<Option<String>>,
    /// The loader's figures when the epoch yielded its last batch: its row can still be
    /// had once the loader has started another epoch.
    last: Mutex<Option<stokehold::EpochStats>>,
    /// When the epoch started (the loader's own instant): the progress bar's share of
    /// time stalled on data, and where an `EpochTimer` starts.
    started: std::time::Instant,
    /// With `device="cuda"`, the slots' copy clock and its reading at the epoch's
    /// start: the device time of stokehold's copies, which no host timer sees.
    copy_clock: Option<(stokehold::cuda::CopyClock, std::time::Duration)>,
}

impl Epoch {
    /// The loader's figures of this epoch so far; `None` once it was ended.
    fn loader_stats(&self, py: Python<'_>) -> Option<stokehold::EpochStats> {
        if let Some(last) = *lock(&self.last) {
            return Some(last);
        }
        self.shown(py).map(|s| s.stats())
    }

    /// How long the loop has waited for the epoch's batches so far (for the progress
    /// bar, each batch: without the storage counter `loader_stats` reads from
    /// `/proc/self/io`).
    fn waited(&self, py: Python<'_>) -> std::time::Duration {
        if let Some(last) = *lock(&self.last) {
            return last.waited;
        }
        self.shown(py)
            .map_or(Default::default(), |s| s.counts.waited)
    }

    /// The loader's glance at this epoch, while it runs.
    fn shown(&self, py: Python<'_>) -> Option<Shown> {
        let seen = Arc::clone(&self.seen);
        let generation = self.generation;
        // From the glance, not the slot: a thread waiting in `__next__` for a buffer
        // that this thread's batches hold keeps the slot locked.
        py.detach(move || {
            let glance = lock(&seen);
            match glance.shown {
                Some(s) if s.generation == generation && glance.ended != Some(generation) => {
                    Some(s)
                }
                _ => None,
            }
        })
    }

    /// The epoch has yielded its last batch: `__next__` stops from now on, and its
    /// figures as they stand are kept.
    fn exhaust(&self, py: Python<'_>) {
        let last = self.loader_stats(py);
        *lock(&self.last) = last;
        self.exhausted.store(true, Ordering::Release);
        self.end_progress();
    }

    /// After an error ended this epoch (a failed read, every buffer held) or lost a
    /// batch taken from it (its copy to the device failed): ends the epoch with the
    /// loader's state at `before`, the state before that batch, resumed there, so that
    /// the next `epoch(e)` (or a resume from the state) yields the batch again;
    /// iterating this epoch again raises the error again, and its figures stay. Once
    /// the loader has moved on to another epoch, its state is left as it is.
    ///
    /// Where `failed` says the copy of an earlier batch of this epoch failed (found by
    /// a later lend, or by the drain at the epoch's end, `before` being its end), the
    /// state goes back to that batch instead (the batches after it come again).
    fn rewind(&self, py: Python<'_>, before: LoaderState, failed: &stokehold::Error) {
        // Its figures stay readable, as at its end (`exhaust`).
        let last = self.loader_stats(py);
        *lock(&self.last) = last;
        *lock(&self.failed) = Some(format!("this epoch ended with an error: {failed}"));
        let loader = self._loader.borrow(py);
        let mut turn = loader.control.take(py);
        let (slot, generation) = (Arc::clone(&self.slot), self.generation);
        let earlier = match *failed {
            stokehold::Error::CopyFailed { epoch, batch, .. }
                if epoch == before.epoch && batch < before.batch =>
            {
                Some(batch)
            }
            _ => None,
        };
        // Epochs start holding the turn, which this thread holds now.
        let state = py.detach(move || {
            let running = lock(&slot);
            if running.generation != generation {
                return None;
            }
            Some(match (earlier, &running.epoch) {
                (Some(batch), Some(e)) => LoaderState {
                    batch,
                    taken: e.order().taken(batch),
                    ..before
                },
                _ => before,
            })
        });
        let Some(state) = state else {
            return;
        };
        // Ended by its own error: iterating it again raises it again.
        self.exhausted.store(true, Ordering::Release);
        if let Ok(l) = loader.idle(py, &mut turn) {
            if l.resume(state).is_ok() {
                loader.note_state(l.state());
                *lock(&self.failed) = Some(format!(
                    "epoch {} ended with an error at batch {}: {failed}; the loader's \
                     epoch({}) goes on from there (its state_dict() stands there)",
                    state.epoch, state.batch, state.epoch
                ));
            }
        }
    }

    /// Moves the state the loader reports on to `after`, this epoch's state once a
    /// batch for the device was lent (or, at its end, once its last copies are done);
    /// unless the epoch was ended meanwhile, or another thread's later batch of it was
    /// lent first.
    fn note_lent(&self, py: Python<'_>, after: LoaderState) {
        let (seen, generation) = (Arc::clone(&self.seen), self.generation);
        py.detach(move || {
            let mut glance = lock(&seen);
            // Still the running epoch (a new one, or a resume, takes or replaces its stop).
            let running = matches!(glance.stop, Some((g, _)) if g == generation);
            let (now, then) = (&glance.state, &after);
            if running && (now.epoch, now.batch) < (then.epoch, then.batch) {
                glance.state = after;
            }
        });
    }

    /// Waits for the copies of the epoch's last batches taken, where the loop stops
    /// (`end`, its state there: the epoch's end, or a partial epoch's row): a fault in
    /// one of them loses a batch of this epoch, which a resume must yield again, so the
    /// state goes back to it and the error is raised.
    fn settle(&self, py: Python<'_>, slots: &device::Slots, end: LoaderState) -> PyResult<()> {
        device::drain(py, slots).map_err(|e| {
            self.end_progress();
            self.rewind(py, end, &e);
            error(e)
        })
    }

    /// Ends the progress bar, if any.
    fn end_progress(&self) {
        let bar = self
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(bar) = bar {
            bar.into_inner().unwrap_or_else(|e| e.into_inner()).finish();
        }
    }
}

#[pymethods]
impl Epoch {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next batch (a `_Batch`, or a `_DeviceBatch` on a device); `None` at the end.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        if self.exhausted.load(Ordering::Acquire) {
            return match lock(&self.failed).clone() {
                Some(why) => Err(Error::new_err(why)),
                None => Ok(None),
            };
        }
        forked(self.pid)?;
        let (slot, seen) = (Arc::clone(&self.slot), Arc::clone(&self.seen));
        let generation = self.generation;
        let mut reserved = None;
        if let Some(slots) = &self.device {
            // A slot first, where a batch is still to come: a loop holding every slot
            // gets its error with the batch still in the epoch (taken, it would be lost,
            // and the state would count it), and one that kept every batch of the epoch
            // ends it as any other, below, without waiting for a slot.
            let running = Arc::clone(&slot);
            let left = py.detach(move || {
                let r = lock(&running);
                (r.generation == generation).then(|| r.epoch.as_ref().map_or(0, |e| e.len()))
            });
            if left.is_some_and(|n| n > 0) {
                // Its errors (every slot held, Ctrl-C) leave the epoch as it was.
                reserved = Some(device::reserve(py, slots)?);
            }
        }
        let device = self.device.is_some();
        let next = loop {
            let (slot, seen) = (Arc::clone(&slot), Arc::clone(&seen));
            let next = py.detach(move || {
                let mut running = lock(&slot);
                if running.generation != generation {
                    return Err(());
                }
                // With the states before and after it; at the end, the states there
                // and past it.
                let mut end = None;
                let next = running.epoch.as_mut().and_then(|e| {
                    let before = e.state();
                    let next = e.next().map(|n| (n, before, e.state()));
                    end = next.is_none().then(|| (before, e.state()));
                    next
                });
                let mut glance = lock(&seen);
                if glance.ended == Some(generation) {
                    // Ended while this thread waited (its batch, if any, goes back).
                    return Err(());
                }
                if let Some(e) = &running.epoch {
                    // A batch for the device counts once it is lent, and its end once
                    // its last copies are done (`note_lent`).
                    if !(device && (matches!(next, Some((Ok(_), ..))) || end.is_some())) {
                        glance.state = e.state();
                    }
                    glance.shown = Some(Shown::of(generation, e));
                }
                Ok((next, end))
            });
            if let Ok((Some((Err(stokehold::Error::Interrupted), ..)), _)) = next {
                // The wait stops every 50 ms: Python's signal handlers run here, with
                // the epoch's lock let go (a handler may end the epoch or ask for its
                // row); what they raise (Ctrl-C's KeyboardInterrupt) leaves the batch
                // still to come.
                py.check_signals()?;
                continue;
            }
            break next;
        };
        match next {
            Err(()) => Err(ended()),
            Ok((None, end)) => {
                if let (Some(slots), Some((at, past))) = (&self.device, end) {
                    self.settle(py, slots, at)?;
                    self.note_lent(py, past);
                }
                self.exhaust(py);
                Ok(None)
            }
            Ok((Some((Err(e), before, _)), _)) => {
                self.end_progress();
                self.rewind(py, before, &e);
                Err(error(e))
            }
            Ok((Some((Ok(batch), before, after)), _)) => {
                if let Some(bar) = &*self.progress.lock().unwrap_or_else(|e| e.into_inner()) {
                    // The share of the epoch's time the loop waited for its batches.
                    let waited = self.waited(py);
                    let stalled = stokehold::telemetry::stalled(waited, self.started.elapsed());
                    let mut bar = bar.lock().unwrap_or_else(|e| e.into_inner());
                    bar.advance(batch.len() as u64, stalled);
                }
                let columns = Arc::clone(&self.columns);
                let batch = match &self.device {
                    None => Py::new(py, Batch { batch, columns })?.into_any(),
                    Some(slots) => {
                        let batch = match device::lend(py, slots, reserved, batch) {
                            Ok(batch) => batch,
                            Err(e) => {
                                self.end_progress();
                                self.rewind(py, before, &e);
                                return Err(error(e));
                            }
                        };
                        self.note_lent(py, after);
                        let batch = device::Held::new(batch);
                        Py::new(py, device::DeviceBatch { batch, columns })?.into_any()
                    }
                };
                Ok(Some(batch))
            }
        }
    }

    /// Batches this epoch yields in all (from its first, or from the resumed batch).
    fn __len__(&self) -> usize {
        self.len
    }

    /// The epoch's figures so far, as a dict: batches, samples, gather_s, waited_s,
    /// stalls, first_batch_s, storage, bytes_read, device_cache.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let Some(s) = self.loader_stats(py) else {
            return Err(Error::new_err("this epoch was ended"));
        };
        let d = PyDict::new(py);
        d.set_item("batches", s.batches)?;
        d.set_item("samples", s.samples)?;
        d.set_item("gather_s", s.gather.as_secs_f64())?;
        d.set_item("waited_s", s.waited.as_secs_f64())?;
        d.set_item("stalls", s.stalls)?;
        d.set_item("first_batch_s", s.first_batch.map(|d| d.as_secs_f64()))?;
        d.set_item("storage", s.storage.name())?;
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("device_cache", self.cached)?;
        Ok(d)
    }

    /// Seconds since the epoch started (its workers were handed it): where an
    /// `EpochTimer`'s wall time starts.
    fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The epoch's row, as `stokehold train` reports it, from the times an
    /// `EpochTimer` measured around it (seconds), the metrics recorded, and the
    /// residency at the start (`(resident, pages, unknown)`, from `_Loader.residency`).
    /// Ends the epoch: batches not taken go back to the loader.
    #[pyo3(signature = (wall_s, wait_s, copy_s, compute_s, loss_sum, correct, samples, residency_start))]
    #[allow(clippy::too_many_arguments)]
    fn row(
        &self,
        py: Python<'_>,
        wall_s: f64,
        wait_s: f64,
        copy_s: f64,
        compute_s: f64,
        loss_sum: f64,
        correct: u64,
        samples: u64,
        residency_start: (u64, u64, u64),
    ) -> PyResult<Row> {
        // Checked before the epoch is ended: a refused row changes nothing.
        let secs = |name: &str, s: f64| {
            let d = s
                .is_finite()
                .then(|| std::time::Duration::try_from_secs_f64(s.max(0.0)));
            d.and_then(Result::ok)
                .ok_or_else(|| PyValueError::new_err(format!("{name}={s}: not seconds")))
        };
        let (wall, wait) = (secs("wall_s", wall_s)?, secs("wait_s", wait_s)?);
        let (copy, compute) = (secs("copy_s", copy_s)?, secs("compute_s", compute_s)?);
        forked(self.pid)?;
        let Some(loader) = self.loader_stats(py) else {
            return Err(Error::new_err(
                "this epoch was ended before its row was taken",
            ));
        };
        // With `device="cuda"`, stokehold's own copies of the epoch's batches count
        // beside the loop's: all of them, those still in flight too when the loop left
        // the epoch early (else the next epoch would count them). A copy that failed
        // fails the row, and the state goes back to its batch, as at an epoch's end: a
        // checkpoint saved in the handler resumes with it.
        if let Some(slots) = &self.device {
            let seen = Arc::clone(&self.seen);
            let state = py.detach(move || lock(&seen).state);
            self.settle(py, slots, state)?;
        }
        self.end_progress();
        {
            let (slot, seen) = (Arc::clone(&self.slot), Arc::clone(&self.seen));
            let generation = self.generation;
            py.detach(move || drop(end_epoch(&slot, &seen, Some(generation))));
        }
        let copied = self
            .copy_clock
            .as_ref()
            .map_or(Default::default(), |(c, at)| {
                c.elapsed().saturating_sub(*at)
            });
        let times = LoopTimes {
            wall,
            wait,
            copy,
            overlapped_copy: copied,
            compute,
        };
        let metrics = Metrics {
            loss_sum,
            correct,
            samples,
        };
        let bytes_per_sample = self.columns.iter().map(|c| c.row_bytes as u64).sum();
        let dataset = Arc::clone(&self.dataset);
        let end = py
            .detach(move || pagecache::residency(dataset.as_ref()))
            .map_err(error)?;
        let start = Residency {
            resident: residency_start.0,
            pages: residency_start.1,
            unknown: residency_start.2,
        };
        let row = EpochRow::of_loop(
            self.number,
            loader,
            metrics,
            times,
            bytes_per_sample,
            (start, end),
        );
        Ok(Row { row })
    }
}

/// One epoch's row of the report.
#[pyclass(module = "stokehold._stokehold", name = "_Row")]
struct Row {
    row: EpochRow,
}

#[pymethods]
impl Row {
    /// The row as JSON (the keys of `stokehold train --json`'s `epochs`).
    fn json(&self) -> PyResult<String> {
        serde_json::to_string(&self.row).map_err(|e| PyValueError::new_err(e.to_string()))
    }
}

/// The epochs of a loop and why the first was slower: `stokehold train`'s table and
/// warm-up split.
#[pyclass(module = "stokehold._stokehold", name = "_Report")]
struct Report {
    report: TrainReport,
}

#[pymethods]
impl Report {
    /// Adds an epoch's row.
    fn push(&mut self, row: PyRef<'_, Row>) {
        self.report.push(row.row.clone());
    }

    /// The epoch table.
    fn table(&self) -> String {
        self.report.table()
    }

    /// The setup costs and the warm-up split.
    fn warmup_text(&self) -> String {
        self.report.warmup_text()
    }

    /// The whole report as JSON (the format of `stokehold train --json`).
    fn json(&self) -> PyResult<String> {
        serde_json::to_string(&self.report).map_err(|e| PyValueError::new_err(e.to_string()))
    }
}

/// One batch: a view per column of the loader's host buffer.
#[pyclass(module = "stokehold._stokehold", name = "_Batch")]
struct Batch {
    batch: HostBatch,
    columns: Arc<[Column]>,
}

impl Batch {
    fn column(&self, key: &str) -> PyResult<usize> {
        self.columns
            .iter()
            .position(|c| c.name == key)
            .ok_or_else(|| {
                let names: Vec<&str> = self.columns.iter().map(|c| c.name.as_str()).collect();
                PyKeyError::new_err(format!("no column {key:?}; the columns are {names:?}"))
            })
    }
}

#[pymethods]
impl Batch {
    /// Column `key`'s rows as a 2-d `uint8` array (samples × bytes per sample) viewing
    /// the batch's buffer; the Python layer views it as the column's dtype and shape.
    /// The array is writeable, as DLPack consumers (torch, JAX) need: the buffer is the
    /// batch's own until it goes back to the pool, and writing it changes no file.
    fn raw<'py>(slf: Bound<'py, Self>, key: &str) -> PyResult<Bound<'py, PyArray2<u8>>> {
        let this = slf.borrow();
        let c = this.column(key)?;
        let rows = this.batch.len();
        let row_bytes = this.columns[c].row_bytes;
        let bytes = this.batch.bytes(c);
        let view = ArrayView2::from_shape((rows, row_bytes), bytes)
            .map_err(|e| PyIndexError::new_err(e.to_string()))?;
        // SAFETY: the array views the batch's buffer and holds `slf` (the batch) as its
        // base object: the buffer is neither freed nor reused while the array lives.
        let array = unsafe { PyArray2::borrow_from_array(&view, slf.clone().into_any()) };
        drop(this);
        Ok(array)
    }

    /// The samples of the batch (global indices), a read-only `uint64` array viewing the
    /// batch (the loader's own record of them: a write would change what `source`
    /// says of the rows).
    #[getter]
    fn indices<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let this = slf.borrow();
        let view = ArrayView1::from(this.batch.indices());
        // SAFETY: as in `raw`: the indices live in the batch, the array's base; the
        // array is made read-only below, before Python sees it.
        let array = unsafe { PyArray1::borrow_from_array(&view, slf.clone().into_any()) };
        drop(this);
        let kwargs = pyo3::types::PyDict::new(slf.py());
        kwargs.set_item("write", false)?;
        array.call_method("setflags", (), Some(&kwargs))?;
        Ok(array)
    }

    /// Samples in the batch.
    fn __len__(&self) -> usize {
        self.batch.len()
    }

    /// The epoch the batch belongs to.
    #[getter]
    fn epoch(&self) -> u64 {
        self.batch.epoch()
    }

    /// The batch's number in its epoch.
    #[getter]
    fn number(&self) -> u64 {
        self.batch.number()
    }
}

/// The extension module.
#[pymodule]
fn _stokehold(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("Error", m.py().get_type::<Error>())?;
    m.add_class::<OpenDataset>()?;
    m.add_class::<Loader>()?;
    m.add_class::<Epoch>()?;
    m.add_class::<Batch>()?;
    m.add_class::<device::DeviceBatch>()?;
    m.add_class::<device::DeviceArray>()?;
    m.add_class::<Row>()?;
    m.add_class::<Report>()?;
    m.add_function(wrap_pyfunction!(augment::_augment_draws, m)?)?;
    m.add("_AUGMENT_MAX_PAD", stokehold::augment::MAX_PAD)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
