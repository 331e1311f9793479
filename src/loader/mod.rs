//! The loader: persistent workers assembling batches into a fixed pool of host buffers,
//! delivered in order, one epoch at a time.
//!
//! Memory: the pool holds `prefetch + held` buffers of [`BatchLayout::bytes`] each,
//! allocated once in [`LoaderBuilder::build`] and never again. Workers fill at most
//! `prefetch` batches ahead of the consumer when it holds `held` batches; if it holds
//! more, fewer are prefetched. Nothing is allocated per batch in steady state.

mod batch;
mod direct;
mod epoch;
mod extents;
mod plan;
mod pool;
mod worker;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

pub use batch::{BatchLayout, BatchTiming, HostBatch, COLUMN_ALIGN, MAX_COLUMNS};
pub use epoch::{Canceller, Epoch, EpochStats};
pub use plan::Storage;
pub use pool::{HostAlloc, HostMemory, PlainAlloc, BUFFER_ALIGN};

use crate::augment::{Augment, Augmenter};
use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::sampler::{EpochOrder, Order, Shard, Shuffle};
use pool::Pool;
use worker::{Assignment, Job, Staged};

/// Bytes of prefetched batches the loader aims for when no prefetch depth is given.
pub const DEFAULT_PREFETCH_BYTES: usize = 32 << 20;

/// Batches a consumer may hold at once without slowing prefetch, unless
/// [`LoaderBuilder::held`] says otherwise.
pub const DEFAULT_HELD: usize = 2;

/// Worker threads a loader may have.
pub const MAX_WORKERS: usize = 1024;

/// Where a loader stands: `batch` batches of epoch `epoch` have been delivered.
///
/// Save it with a checkpoint; a loader built with [`LoaderBuilder::resume`] yields exactly
/// the rest of that epoch. After a whole epoch `e`, the state is `(e + 1, 0)`.
///
/// `order` fingerprints what the order depends on (dataset length, shuffle and seed,
/// shard, batch size, `drop_last`): resuming a loader configured differently is an
/// error rather than a silently different epoch. `0` skips that check. Both
/// fingerprints cover the dataset's own ([`Dataset::fingerprint`]: a window seed, a
/// mixture's weights). In JSON, a key this struct does not have is an error (a
/// misspelt `order` would otherwise read as 0, unchecked).
///
/// An elastic resume ([`LoaderBuilder::resume_elastic`]) goes on with another world
/// size, batch size or tail: `global` fingerprints what every rank shares (dataset
/// length, shuffle and seed; for a grouped shuffle its group and the samples'
/// lengths), and `taken` is where the epoch's global order stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoaderState {
    /// The epoch.
    pub epoch: u64,
    /// Batches of it already delivered.
    pub batch: u64,
    /// Fingerprint of the loader's order ([`Order::fingerprint`]); 0 for unchecked.
    #[serde(default)]
    pub order: u64,
    /// Positions of the epoch's global order taken before its first batch: 0, unless the
    /// epoch was resumed elastically ([`EpochOrder::start`](crate::EpochOrder::start)).
    #[serde(default)]
    pub start: u64,
    /// Positions of the epoch's global order taken once every rank has had `batch`
    /// batches ([`EpochOrder::taken`](crate::EpochOrder::taken)).
    #[serde(default)]
    pub taken: u64,
    /// Fingerprint of the global order ([`Order::global_fingerprint`]); 0 for unknown
    /// (a state saved before elastic resumes, which resumes exactly only).
    #[serde(default)]
    pub global: u64,
}

impl LoaderState {
    /// A state for `epoch` after `batch` batches, without an order fingerprint.
    pub const fn new(epoch: u64, batch: u64) -> LoaderState {
        LoaderState {
            epoch,
            batch,
            order: 0,
            start: 0,
            taken: 0,
            global: 0,
        }
    }

    /// Checks, without resuming anything, that a loader with order `order` can resume
    /// from this state: exactly ([`Loader::resume`]) or, `elastic`, as
    /// [`Loader::resume_elastic`] would.
    ///
    /// # Errors
    /// As those calls: [`Error::Config`] for a state saved under another order (or
    /// global order), or past the end of its epoch.
    pub fn check(&self, order: &Order, elastic: bool) -> Result<()> {
        let how = match elastic {
            true => Resume::Elastic,
            false => Resume::Exact,
        };
        check_resume(order, *self, how).map(drop)
    }

    /// The state of a loader with order `order` after `batch` batches of `epoch`, whose
    /// ranks started at position `start` of its global order.
    pub(crate) fn at(order: &Order, epoch: u64, start: u64, batch: u64) -> LoaderState {
        LoaderState::of(order, &order.epoch_from(epoch, start), batch)
    }

    /// The same, for `epoch`, an epoch of `order`.
    fn of(order: &Order, epoch: &EpochOrder, batch: u64) -> LoaderState {
        LoaderState {
            epoch: epoch.epoch(),
            batch,
            order: order.fingerprint(),
            start: epoch.start(),
            taken: epoch.taken(batch),
            global: order.global_fingerprint(),
        }
    }
}

/// One-off costs paid when the loader was built.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Startup {
    /// Allocating (and touching) the host-buffer pool.
    pub pool_alloc: Duration,
    /// Starting the worker threads.
    pub threads: Duration,
}

/// Configures a [`Loader`]. Cloning it gives the same configuration for another loader.
#[derive(Clone)]
pub struct LoaderBuilder {
    dataset: Arc<dyn Dataset>,
    batch_size: usize,
    shuffle: Shuffle,
    shard: Shard,
    workers: usize,
    prefetch: Option<usize>,
    held: usize,
    drop_last: bool,
    allocator: Arc<dyn HostAlloc>,
    resume: Option<(LoaderState, Resume)>,
    budget: Option<u64>,
    plan: bool,
    direct: bool,
    augment: Option<Augment>,
}

/// How a saved state is resumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resume {
    /// By a loader with the same order: the rest of the epoch, batch for batch.
    Exact,
    /// By a loader with the same global order: the positions not yet taken, sharded
    /// and batched its own way.
    Elastic,
}

impl LoaderBuilder {
    /// The same configuration over another dataset, with no resume state: what
    /// `interop::burn`'s `slice` builds its loader from.
    #[cfg_attr(not(feature = "burn"), allow(dead_code))]
    pub(crate) fn over(mut self, dataset: Arc<dyn Dataset>) -> Self {
        self.dataset = dataset;
        self.resume = None;
        self
    }

    /// The dataset the loader will read.
    #[cfg_attr(not(feature = "burn"), allow(dead_code))]
    pub(crate) fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    /// Samples per batch (default 256).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// The order of samples (default [`Shuffle::Full`] with seed 0).
    /// [`Shuffle::Grouped`] needs a dataset with [`Dataset::lengths`]: building fails
    /// with [`Error::Config`] otherwise.
    pub fn shuffle(mut self, shuffle: Shuffle) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// This process's part of each epoch (default the whole epoch).
    pub fn shard(mut self, shard: Shard) -> Self {
        self.shard = shard;
        self
    }

    /// Worker threads (default: the available parallelism, at most 8). Capped at the
    /// batches of an epoch (more would have nothing to do); more than [`MAX_WORKERS`] is
    /// refused.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    /// Batches assembled ahead of the consumer.
    ///
    /// The default is about [`DEFAULT_PREFETCH_BYTES`] of batches, at least
    /// `2 * workers` and at most 64: deep enough that workers do not run out of buffers
    /// while the consumer waits for a CPU (on 2 cores with 2 workers, 4 buffers reached
    /// 75% of the bare-gather roofline and 32 reached 89%; see `BENCHMARKS.md`).
    /// Whatever the request, it is capped at the batches of an epoch.
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = Some(n);
        self
    }

    /// Batches the consumer may hold at once without slowing prefetch (default
    /// [`DEFAULT_HELD`]).
    pub fn held(mut self, n: usize) -> Self {
        self.held = n;
        self
    }

    /// Drop the last batch of an epoch when it is short (default false).
    pub fn drop_last(mut self, yes: bool) -> Self {
        self.drop_last = yes;
        self
    }

    /// The host-buffer allocator (default [`PlainAlloc`]; the CUDA backend supplies
    /// page-locked memory).
    pub fn allocator(mut self, alloc: Arc<dyn HostAlloc>) -> Self {
        self.allocator = alloc;
        self
    }

    /// Bytes of page cache the loader may fill with the dataset (default: half the
    /// memory available when the loader is built, `MemAvailable` of `/proc/meminfo`, or
    /// of the room left in the process's memory cgroup where that is less:
    /// [`pagecache::default_budget`](crate::pagecache::default_budget)).
    ///
    /// The smallest files are kept while they fit under the budget together (labels stay
    /// in memory while images stream). Kept files are read in during the first epoch
    /// that finds them cold, sequentially, in the background. The others are streamed
    /// straight from storage, bypassing the page cache (see
    /// [`direct_reads`](LoaderBuilder::direct_reads)): rows scattered over their file (a
    /// full shuffle, random token windows) are read by each worker (`O_DIRECT` through
    /// io_uring); rows in runs (a block shuffle's windows, file order) are read by the
    /// planner into the loader's own buffers, and the workers copy them from there. `0`
    /// streams every file (a set larger than memory, simulated). Either way the batches are the same; see
    /// [`Storage`].
    pub fn page_cache_budget(mut self, bytes: u64) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// Whether to plan storage reads at all (default true); without a plan, cold data
    /// is read by page faults and the kernel's read-around, as a plain mapping is.
    pub fn plan_reads(mut self, yes: bool) -> Self {
        self.plan = yes;
        self
    }

    /// Whether streamed files are read with direct I/O (default true, where the file
    /// system and the kernel allow it).
    ///
    /// - Where the next batches' rows are scattered over their files (a full shuffle,
    ///   random token windows, a block shuffle sharded over many ranks: judged from
    ///   their pages as each epoch starts), each worker reads its batch's rows with
    ///   `O_DIRECT` through io_uring, for files whose rows are at least 1 KiB (shorter
    ///   rows share pages, and are read through the page cache).
    /// - Where they come in runs (a block shuffle's windows, file order), the planner
    ///   reads the runs of the next windows' blocks with `O_DIRECT` into buffers of the
    ///   loader's own, up to 1 MiB each, a few reads in flight, and the workers copy
    ///   rows from them.
    ///
    /// Without it, or where it is refused, streamed rows are read through the page
    /// cache: their pages are asked for ahead and dropped behind, at the cost of reading
    /// whole pages (4 KiB for a 3 KB row, often two) instead of the row's sectors, and
    /// of what buffered reads cost the kernel (a block shuffle's windows came at 0.64 to
    /// 0.84 GB/s where direct reads gave 0.8 to 1.25 on the same disk).
    pub fn direct_reads(mut self, yes: bool) -> Self {
        self.direct = yes;
        self
    }

    /// Augments an image column in the workers, as each batch is gathered (see
    /// [`Augment`]): the batches then have the columns of
    /// [`Augmenter::columns`](crate::Augmenter::columns), and sample `i` of epoch `e`
    /// is cropped and flipped by `augment.draw(e, i)`, whatever the workers, shard or
    /// resume. Each worker keeps a staging buffer of one raw batch, beside the pool. To
    /// augment on the GPU instead, after the copy of the raw bytes, leave
    /// the loader without it and give it to the device's copy (see
    /// [`cuda::DeviceSlots`](crate::cuda::DeviceSlots)).
    pub fn augment(mut self, augment: Augment) -> Self {
        self.augment = Some(augment);
        self
    }

    /// Resume from a saved state: [`Loader::epoch`] for `state.epoch` yields only the
    /// batches after `state.batch` (once); asking for an earlier epoch first is an error,
    /// a later one abandons the resume.
    pub fn resume(mut self, state: LoaderState) -> Self {
        self.resume = Some((state, Resume::Exact));
        self
    }

    /// Resume from a state saved by a loader over the same data, shuffle and seed, but
    /// another world size, rank, batch size, `drop_last` or tail: [`Loader::epoch`] for
    /// `state.epoch` yields this rank's share of the samples the saved loader's ranks
    /// had not yet taken (`state.taken` on; any rank's state will do, saved when every
    /// rank had taken the same number of batches, as data-parallel steps do). Together
    /// the new ranks take each of those samples once (plus the padding their tail asks
    /// for); later epochs are as this loader's own.
    ///
    /// [`build`](LoaderBuilder::build) refuses a state whose global order differs, or
    /// one saved before elastic resumes existed (it resumes exactly only).
    pub fn resume_elastic(mut self, state: LoaderState) -> Self {
        self.resume = Some((state, Resume::Elastic));
        self
    }

    /// Allocates the buffer pool and starts the workers.
    ///
    /// Buffers hold `min(batch size, samples per epoch)` rows, so a batch size beyond
    /// the dataset costs no memory.
    ///
    /// # Errors
    /// [`Error::Config`] for zero batch size, workers or prefetch, more than
    /// [`MAX_WORKERS`] workers, a shard leaving this rank no batch, a dataset with no
    /// column, or a pool larger than the machine's memory; [`Error::Alloc`] if the pool
    /// cannot be allocated; [`Error::Io`] if a thread cannot be started.
    pub fn build(self) -> Result<Loader> {
        if self.workers == 0 {
            return Err(Error::Config("workers must be at least 1".into()));
        }
        if self.workers > MAX_WORKERS {
            return Err(Error::Config(format!(
                "{} workers: at most {MAX_WORKERS} threads (workers beyond the CPUs and \
                 the storage's queue depth only add contention)",
                self.workers
            )));
        }
        let columns = self.dataset.columns();
        let shuffle = match self.shuffle {
            Shuffle::Block {
                seed,
                block_rows: 0,
                window,
            } => {
                let row: usize = columns.iter().map(|c| c.row_bytes).sum();
                Shuffle::Block {
                    seed,
                    block_rows: ((1 << 20) / row.max(1)).max(1) as u64,
                    window,
                }
            }
            Shuffle::Grouped { seed, group: 0 } => Shuffle::Grouped {
                seed,
                group: (self.batch_size as u64)
                    .saturating_mul(self.shard.world_size())
                    .saturating_mul(64),
            },
            other => other,
        };
        // Only a grouped shuffle reads the lengths; without them `Order::new` refuses it.
        let lengths = match shuffle {
            Shuffle::Grouped { .. } => self.dataset.lengths()?,
            _ => None,
        };
        let (len, bs, drop_last) = (self.dataset.len(), self.batch_size as u64, self.drop_last);
        let order = match lengths {
            Some(l) if l.len() as u64 != len => {
                return Err(Error::Config(format!(
                    "the dataset gave {} lengths for {len} samples",
                    l.len()
                )))
            }
            Some(l) => Order::with_lengths(l.into(), shuffle, self.shard, bs, drop_last)?,
            None => Order::new(len, shuffle, self.shard, bs, drop_last)?,
        }
        .for_dataset(self.dataset.fingerprint());
        let resume = match self.resume {
            Some((r, how)) => Some(check_resume(&order, r, how)?),
            None => None,
        };
        // Buffers hold the rows a batch can have; capped by usize::MAX, `batches` fits.
        let rows = (self.batch_size as u64).min(order.samples()) as usize;
        let batches = usize::try_from(order.batches()).unwrap_or(usize::MAX);
        let augment = match &self.augment {
            Some(a) => Some(Arc::new(Staged {
                augmenter: a.bind(columns)?,
                layout: BatchLayout::new(columns, rows)?,
            })),
            None => None,
        };
        let layout = Arc::new(match &augment {
            Some(s) => BatchLayout::new(s.augmenter.columns(), rows)?,
            None => BatchLayout::new(columns, rows)?,
        });
        let workers = self.workers.min(batches);
        let prefetch = self.prefetch.unwrap_or_else(|| {
            (DEFAULT_PREFETCH_BYTES / layout.bytes())
                .min(64)
                .max(workers * 2)
        });
        if prefetch == 0 {
            return Err(Error::Config("prefetch must be at least 1".into()));
        }
        let prefetch = prefetch.min(batches);
        let buffers = prefetch
            .checked_add(self.held)
            .ok_or_else(|| Error::Config("prefetch + held overflows".into()))?;
        check_pool_fits(buffers, layout.bytes(), rows)?;
        let pool = Pool::new(self.allocator.as_ref(), buffers, layout.bytes(), rows)?;
        let budget = self.budget.unwrap_or_else(crate::pagecache::default_budget);
        let threads_start = Instant::now();
        let planner = match self.plan && !self.dataset.files().is_empty() {
            true => {
                // About 64 MiB of batches, at most 64, and two a worker at the least
                // (which wins over 32 workers).
                let least = workers.max(4) * 2;
                let ahead = ((64 << 20) / layout.bytes()).clamp(least, least.max(64)) as u64;
                let (tx, rx) = crossbeam_channel::unbounded();
                let handle =
                    plan::spawn(ahead, rx).map_err(|e| Error::io("<planner thread>", e))?;
                Some(Worker {
                    jobs: Some(tx),
                    handle: Some(handle),
                })
            }
            false => None,
        };
        let mut workers = Vec::with_capacity(workers);
        for id in 0..workers.capacity() {
            let (tx, rx) = crossbeam_channel::unbounded();
            let handle =
                worker::spawn(id, rx).map_err(|e| Error::io(format!("<worker thread {id}>"), e))?;
            workers.push(Worker {
                jobs: Some(tx),
                handle: Some(handle),
            });
        }
        let startup = Startup {
            pool_alloc: pool.alloc_time(),
            threads: threads_start.elapsed(),
        };
        let state = resume.unwrap_or_else(|| LoaderState::at(&order, 0, 0, 0));
        Ok(Loader {
            dataset: self.dataset,
            order,
            layout,
            pool,
            workers,
            prefetch,
            state,
            resume,
            resumed: None,
            startup,
            last: None,
            planner,
            budget,
            direct: self.direct && self.plan,
            uring: self.direct && self.plan && direct::Reader::available(),
            augment,
        })
    }
}

/// Samples, evenly spaced, whose rows [`direct_sources`] measures for each file's row
/// length: a file that holds one in 4,096 of the samples or more is measured.
const ROW_PROBES: u64 = 4096;

/// Opens every file of `dataset` for the workers' direct reads. A streamed file is read
/// with `O_DIRECT` (its mode becomes [`plan::Mode::Direct`]) when its rows are at least
/// [`DIRECT_ROW`] long; shorter rows share pages with the planned rows around them
/// (labels: hundreds to a page), so those files stay streamed through the page cache,
/// and the workers read them from there. `None`, the plans untouched, if a file cannot
/// be opened so, or the dataset's rows are not the ranges it locates (padded, computed):
/// every streamed page then goes through the page cache, as planned.
fn direct_sources(
    dataset: &dyn Dataset,
    plans: &mut [plan::FilePlan],
) -> Option<Vec<direct::Source>> {
    let files = dataset.files();
    if files.len() != plans.len() || !direct::describes(dataset) {
        return None;
    }
    // Each file's row length, from samples spread over the dataset: a set of many
    // files (shards, chunks, a mixture's corpora) holds sample 0 in a few of them only.
    let mut row = vec![0usize; files.len()];
    let n = dataset.len();
    let probes = n.min(ROW_PROBES);
    for k in 0..probes {
        let i = (u128::from(k) * u128::from(n) / u128::from(probes)) as u64;
        dataset.locate(0, i, &mut |f, _, len| {
            if let Some(r) = row.get_mut(f) {
                *r = (*r).max(len);
            }
        });
    }
    let direct: Vec<bool> = plans
        .iter()
        .zip(&row)
        .map(|(p, &len)| p.mode == plan::Mode::Stream && len >= DIRECT_ROW)
        .collect();
    if !direct.contains(&true) {
        return None;
    }
    let sources: Option<Vec<direct::Source>> = files
        .iter()
        .zip(&direct)
        .map(|(&f, &d)| direct::Source::open(f, d))
        .collect();
    let sources = sources?;
    for (p, s) in plans.iter_mut().zip(&sources) {
        if s.is_direct() {
            p.mode = plan::Mode::Direct;
        }
    }
    Some(sources)
}

/// The extents of the files streamed in runs (a block shuffle's windows), read with
/// `O_DIRECT` (their mode becomes [`plan::Mode::Window`]). `None`, the plans untouched,
/// where no streamed file can be read so, a file is not watched for changes (the
/// workers copy what no extent holds from the mapping, guarded by the watch), or the
/// dataset's rows are not the ranges it locates.
fn window_sources(
    dataset: &dyn Dataset,
    plans: &mut [plan::FilePlan],
) -> Option<Arc<extents::Extents>> {
    let files = dataset.files();
    let watched = files.iter().all(|f| f.watched().is_some());
    if files.len() != plans.len() || !watched || !direct::describes(dataset) {
        return None;
    }
    // Extents are whole pages: the alignment must divide the page.
    let page = crate::util::page_size() as u64;
    let sources: Vec<Option<direct::Source>> = files
        .iter()
        .zip(plans.iter())
        .map(|(&f, p)| {
            let s = (p.mode == plan::Mode::Stream).then(|| direct::Source::open(f, true))?;
            s.filter(|s| s.is_direct() && page % s.align() == 0)
        })
        .collect();
    if sources.iter().all(Option::is_none) {
        return None;
    }
    for (p, s) in plans.iter_mut().zip(&sources) {
        if s.is_some() {
            p.mode = plan::Mode::Window;
        }
    }
    Some(Arc::new(extents::Extents::new(sources)))
}

/// The alignment direct reads of the file at `path` need, or `None` where it cannot be
/// read with `O_DIRECT` (for tests, through [`crate::testing`]).
pub(crate) fn direct_align(path: &std::path::Path) -> Option<u64> {
    direct::path_align(path)
}

/// What storage does for an epoch's files, and how its workers read them.
#[derive(Default)]
struct Planned {
    storage: Storage,
    plans: Vec<plan::FilePlan>,
    /// Rows scattered over the files (a full shuffle), rather than runs of them.
    scattered: bool,
    direct: Option<Vec<direct::Source>>,
    extents: Option<Arc<extents::Extents>>,
}

/// Plans the reads of `order` from batch `start` on, for a loader with a planner.
fn plan_epoch(
    dataset: &dyn Dataset,
    budget: u64,
    order: &EpochOrder,
    start: u64,
    direct: bool,
    uring: bool,
) -> Planned {
    let (storage, mut plans) = plan::snapshot(dataset, budget);
    // Direct reads of single rows suit rows scattered over the whole file; a block
    // shuffle's windows are read whole, in runs of its blocks, into extents.
    let scattered = storage == Storage::Streaming && {
        let streamed: Vec<bool> = plans.iter().map(|p| p.mode == plan::Mode::Stream).collect();
        plan::scattered(dataset, order, start, &streamed)
    };
    let streaming = storage == Storage::Streaming && direct;
    let direct = match streaming && scattered && uring {
        true => direct_sources(dataset, &mut plans),
        false => None,
    };
    let extents = match streaming && !scattered {
        true => window_sources(dataset, &mut plans),
        false => None,
    };
    Planned {
        storage,
        plans,
        scattered,
        direct,
        extents,
    }
}

/// The shortest row a streamed file is read directly for: a quarter of a page.
const DIRECT_ROW: usize = 1024;

/// The state a loader with `order` resumes `r` from, or why it cannot: saved under
/// another order (for an exact resume) or global order (for an elastic one), or past
/// the end of its epoch.
fn check_resume(order: &Order, r: LoaderState, how: Resume) -> Result<LoaderState> {
    if how == Resume::Elastic {
        if r.global == 0 {
            return Err(Error::Config(
                "an elastic resume needs a state saved by this version or later (it \
                 records where the epoch's global order stands); resume this one exactly"
                    .into(),
            ));
        }
        if r.global != order.global_fingerprint() {
            return Err(Error::Config(format!(
                "the resume state was saved by a loader with another global order (dataset \
                 length, shuffle or seed differ{}, or a stokehold version that ordered \
                 epochs otherwise): fingerprint {:#x}, this loader's is {:#x}",
                match order.shuffle() {
                    Shuffle::Grouped { group, .. } => format!(
                        ", or a grouped shuffle's group, here {group}, or the samples' \
                         lengths; a group left to the loader follows batch and world size"
                    ),
                    _ => String::new(),
                },
                r.global,
                order.global_fingerprint()
            )));
        }
        // Saved by a loader configured as this one: where it stands follows from its
        // batch, whatever `taken` says.
        let taken = match r.order == order.fingerprint() {
            true => check_resume(order, r, Resume::Exact)?.taken,
            false => r.taken,
        };
        if r.start > taken || taken > order.len() {
            return Err(Error::Config(format!(
                "resume state has taken positions {}..{} of an epoch of {}",
                r.start,
                taken,
                order.len()
            )));
        }
        return Ok(LoaderState::at(order, r.epoch, taken, 0));
    }
    if r.order != 0 && r.order != order.fingerprint() {
        return Err(Error::Config(format!(
            "the resume state was saved by a loader with another order (dataset \
             length, shuffle, seed, shard, batch size or drop_last differ, or a stokehold \
             version that ordered epochs otherwise): fingerprint {:#x}, this loader's is {:#x}",
            r.order,
            order.fingerprint()
        )));
    }
    let epoch = order.epoch_from(r.epoch, r.start);
    if r.start > order.len() || r.batch > epoch.batches() {
        return Err(Error::Config(format!(
            "resume state is at batch {} of epoch {} (from position {}), which has {} \
             batches",
            r.batch,
            r.epoch,
            r.start,
            epoch.batches()
        )));
    }
    let state = LoaderState::of(order, &epoch, r.batch);
    // A state this loader saved (it records its global order) and resumed elastically
    // (`start`) says where the global order stands as its batch and start do: a start
    // changed on its own would skip or repeat samples. (`taken` follows from them; a
    // state's `batch` set by hand, its `start` 0, resumes at that batch.)
    let inconsistent = r.global != state.global || (r.start != 0 && r.taken != state.taken);
    if r.order != 0 && r.global != 0 && inconsistent {
        return Err(Error::Config(format!(
            "the resume state does not hold together: batch {} of epoch {} from position {} \
             has taken {} positions of the global order {:#x}, the state says {} of {:#x} \
             (a field was changed, or the state was pieced together from two)",
            r.batch, r.epoch, r.start, state.taken, state.global, r.taken, r.global
        )));
    }
    Ok(state)
}

/// Refuses a pool of `buffers` buffers of `bytes` for batches of `rows` rows that the
/// machine's memory cannot hold (allocating it would end in the out-of-memory killer, not
/// an error). Each buffer costs its bytes rounded up to whole aligned pages (all touched),
/// its batch's sample indices, and its entry in each epoch's results ring.
fn check_pool_fits(buffers: usize, bytes: usize, rows: usize) -> Result<()> {
    // SAFETY: sysconf only reads system configuration.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    let memory = u64::try_from(pages)
        .ok()
        .map(|n| n.saturating_mul(crate::util::page_size() as u64))
        .filter(|&m| m > 0);
    let align = BUFFER_ALIGN.max(crate::util::page_size()) as u64;
    let each = (bytes as u64)
        .div_ceil(align)
        .saturating_mul(align)
        .saturating_add((rows as u64).saturating_mul(8))
        .saturating_add(std::mem::size_of::<Option<worker::Done>>() as u64);
    let needed = (buffers as u64).saturating_mul(each);
    match memory {
        Some(memory) if needed > memory => Err(Error::Config(format!(
            "the buffer pool needs {needed} bytes ({buffers} buffers of {bytes} bytes, \
             {each} with their pages and indices), more than this machine's {memory} bytes \
             of memory: lower the prefetch depth, the held batches or the batch size"
        ))),
        _ => Ok(()),
    }
}

struct Worker {
    jobs: Option<Sender<Assignment>>,
    handle: Option<JoinHandle<()>>,
}

/// A prefetching, shuffling, multi-threaded loader over a [`Dataset`].
///
/// ```
/// use stokehold::{Loader, NpyDataset, Shuffle};
/// # fn main() -> stokehold::Result<()> {
/// let ds = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
/// let mut loader = Loader::builder(ds)
///     .batch_size(128)
///     .shuffle(Shuffle::Full { seed: 7 })
///     .workers(2)
///     .build()?;
/// for epoch in 0..2 {
///     for batch in loader.epoch(epoch)? {
///         let batch = batch?;
///         let pixels: &[u8] = batch.column(0)?;
///         let labels: &[i64] = batch.column(1)?;
///         assert_eq!(pixels.len(), batch.len() * 64);
///         assert_eq!(labels.len(), batch.len());
///     }
/// }
/// assert_eq!(loader.state().epoch, 2);
/// # Ok(())
/// # }
/// ```
pub struct Loader {
    dataset: Arc<dyn Dataset>,
    order: Order,
    layout: Arc<BatchLayout>,
    pool: Arc<Pool>,
    workers: Vec<Worker>,
    prefetch: usize,
    state: LoaderState,
    resume: Option<LoaderState>,
    /// The resume the last epoch started from: until that epoch delivers a batch, the
    /// resume stands (the loader's state still says so).
    resumed: Option<LoaderState>,
    startup: Startup,
    /// The job of the last epoch started, to tell a dropped `Epoch` from a leaked one.
    last: Option<Arc<Job>>,
    /// The thread that plans storage reads, if any.
    planner: Option<Worker>,
    budget: u64,
    /// Whether streamed files are read with direct I/O (asked for, and reads planned).
    direct: bool,
    /// Whether io_uring works here (the workers' direct reads of single rows need it).
    uring: bool,
    /// The augmentation the workers apply, if any.
    augment: Option<Arc<Staged>>,
}

impl Loader {
    /// A builder over `dataset` (anything implementing [`Dataset`], or an
    /// `Arc<dyn Dataset>` to share one).
    pub fn builder(dataset: impl Dataset) -> LoaderBuilder {
        Self::builder_shared(Arc::new(dataset))
    }

    /// A builder over a shared dataset.
    pub fn builder_shared(dataset: Arc<dyn Dataset>) -> LoaderBuilder {
        let workers = std::thread::available_parallelism()
            .map(|n| n.get().min(8))
            .unwrap_or(2);
        LoaderBuilder {
            dataset,
            batch_size: 256,
            shuffle: Shuffle::Full { seed: 0 },
            shard: Shard::single(),
            workers,
            prefetch: None,
            held: DEFAULT_HELD,
            drop_last: false,
            allocator: Arc::new(PlainAlloc),
            resume: None,
            budget: None,
            plan: true,
            direct: true,
            augment: None,
        }
    }

    /// Starts epoch `epoch` and returns its batches.
    ///
    /// The order is a pure function of the seed, `epoch` and the shard. If the loader was
    /// built with [`LoaderBuilder::resume`] (or [`resume`](Loader::resume)d) and this is
    /// the resumed epoch, the iterator starts after the batches already consumed: on the
    /// first call, and on later ones for as long as no epoch started so has delivered a
    /// batch (one dropped at once leaves the resume standing, as its state says).
    ///
    /// # Errors
    /// [`Error::Config`] if the loader was built to resume a later epoch than `epoch`;
    /// [`Error::EpochLeaked`] if an earlier [`Epoch`] was leaked with `mem::forget`
    /// instead of dropped (its buffers are lost; the loader's drop still returns).
    pub fn epoch(&mut self, epoch: u64) -> Result<Epoch<'_>> {
        self.start(epoch, false)
    }

    /// Starts epoch `epoch` as [`epoch`](Loader::epoch) does (the same order, resume and
    /// state), but its batches hold their [`indices`](HostBatch::indices) only: nothing is
    /// read from the dataset or augmented, and the bytes of each batch are unspecified
    /// ([`HostBatch::is_indices_only`]). For a consumer that has every row already (the
    /// device cache of the CUDA slots, which gathers the batches on the GPU): the epoch's
    /// order, state and resume stay the loader's, at the cost of computing indices.
    ///
    /// # Errors
    /// As [`epoch`](Loader::epoch).
    pub fn epoch_indices(&mut self, epoch: u64) -> Result<Epoch<'_>> {
        self.start(epoch, true)
    }

    fn start(&mut self, epoch: u64, indices_only: bool) -> Result<Epoch<'_>> {
        self.check_last()?;
        let pending = self.pending();
        let (start, from) = match pending {
            Some(r) if epoch < r.epoch => {
                return Err(Error::Config(format!(
                    "this loader resumes epoch {} at batch {}: epoch {epoch} comes before it",
                    r.epoch, r.batch
                )))
            }
            Some(r) if epoch == r.epoch => (r.batch, r.start),
            _ => (0, 0),
        };
        // The last epoch's job has nothing left to tell (it was dropped, and the resume
        // it left is in `pending`): let go of it before this epoch opens its files again,
        // so that its direct-read descriptors and extents close first (a set of
        // thousands of files would otherwise hold both epochs' at once).
        self.last = None;
        // Storage's count before any worker or the planner has the job: counted after,
        // the reads they issued at once went missing from the epoch's figure.
        let read_at_start = crate::pagecache::storage_read_bytes();
        let order = self.order.epoch_from(epoch, from);
        // The plan is advice: a dataset whose `locate` panics here (the workers catch
        // their own calls) gets an epoch read from its mapping, not a panic.
        let planned = (self.planner.is_some() && !indices_only).then(|| {
            let dataset = self.dataset.as_ref();
            let (direct, uring) = (self.direct, self.uring);
            let budget = self.budget;
            std::panic::catch_unwind(AssertUnwindSafe(|| {
                plan_epoch(dataset, budget, &order, start, direct, uring)
            }))
        });
        let Planned {
            storage,
            plans,
            scattered,
            direct,
            extents,
        } = planned.and_then(|p| p.ok()).unwrap_or_default();
        self.resume = None;
        // A resume is spent once its epoch has nothing left to deliver.
        self.resumed = pending.filter(|r| r.epoch == epoch && start < order.batches());
        // The planner joins only an epoch with files to read: in a warm one it would be
        // woken for every batch claimed, for nothing.
        let planned = plans.iter().any(|p| {
            matches!(
                p.mode,
                plan::Mode::Keep | plan::Mode::Stream | plan::Mode::Window
            )
        });
        let (results_tx, results_rx) = crossbeam_channel::unbounded();
        let (finished_tx, finished_rx) = crossbeam_channel::bounded(0);
        self.state = LoaderState::of(&self.order, &order, start);
        let job = Arc::new(Job {
            end: order.batches(),
            order,
            dataset: Arc::clone(&self.dataset),
            layout: Arc::clone(&self.layout),
            pool: Arc::clone(&self.pool),
            next: AtomicU64::new(start),
            cancelled: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            results: results_tx,
            delivered: AtomicU64::new(start),
            storage,
            scattered,
            plans: std::sync::Mutex::new(plans),
            direct,
            extents,
            planner: self
                .planner
                .as_ref()
                .filter(|_| planned)
                .and_then(|p| p.handle.as_ref())
                .map(|h| h.thread().clone()),
            augment: self.augment.clone(),
            indices_only,
        });
        self.last = Some(Arc::clone(&job));
        // The planner holds the job (and so the dataset) for as long as it works on it,
        // and leaves within a millisecond of the epoch's end or drop: nothing waits
        // for it, so its own finished channel goes nowhere. It has the job before the
        // workers, so that it asks for the first batches' rows as they start on them.
        let jobs = self.planner.as_ref().filter(|_| planned);
        let sent = jobs.and_then(|p| p.jobs.as_ref()).is_some_and(|jobs| {
            jobs.send((Arc::clone(&job), crossbeam_channel::bounded(0).0))
                .is_ok()
        });
        // With no planner to read them (its thread is gone), the workers copy from the
        // mapping rather than wait for extents.
        if let (false, Some(x)) = (sent, &job.extents) {
            x.close();
        }
        for w in &self.workers {
            if let Some(jobs) = &w.jobs {
                // A worker that is gone drops the assignment, and with it its sender.
                let _ = jobs.send((Arc::clone(&job), finished_tx.clone()));
            }
        }
        drop(finished_tx);
        Ok(Epoch::new(
            &mut self.state,
            job,
            results_rx,
            finished_rx,
            start,
            read_at_start,
        ))
    }

    /// An `Epoch` borrows the loader mutably, so when `&mut self` is available again
    /// the previous one is gone: dropped (its job is closed) or leaked. A leaked one's
    /// workers are stopped so they wait for no buffer, and the loader refuses to go on.
    fn check_last(&mut self) -> Result<()> {
        if let Some(last) = &self.last {
            if !last.closed.load(Ordering::Acquire) {
                last.cancel();
                return Err(Error::EpochLeaked {
                    epoch: last.order.epoch(),
                });
            }
        }
        Ok(())
    }

    /// Pays the loader's one-off costs before epoch 0: the buffer pool and the workers
    /// already exist once built, so this reads the dataset's files into the page cache
    /// (see [`pagecache::read_ahead`](crate::pagecache::read_ahead)). Returns the bytes
    /// read.
    ///
    /// # Errors
    /// [`Error::Io`] naming a file whose read-ahead was refused.
    pub fn warmup(&self) -> Result<u64> {
        crate::pagecache::read_ahead(self.dataset.as_ref())
    }

    /// Where the loader stands (see [`LoaderState`]).
    pub fn state(&self) -> LoaderState {
        self.state
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    /// The augmentation the workers apply to each batch, if any
    /// ([`LoaderBuilder::augment`]).
    pub fn augmenter(&self) -> Option<&Augmenter> {
        self.augment.as_ref().map(|s| &s.augmenter)
    }

    /// The order (batches per epoch, shard, shuffle).
    pub fn order(&self) -> &Order {
        &self.order
    }

    /// Batches per epoch.
    pub fn batches(&self) -> u64 {
        self.order.batches()
    }

    /// The buffer layout of every batch.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// Worker threads.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Prefetch depth.
    pub fn prefetch(&self) -> usize {
        self.prefetch
    }

    /// Host buffers in the pool (`prefetch + held`).
    pub fn buffers(&self) -> usize {
        self.pool.size()
    }

    /// Batches the consumer may hold at once without slowing prefetch (see
    /// [`LoaderBuilder::held`]).
    pub fn held(&self) -> usize {
        self.pool.size() - self.prefetch
    }

    /// Bytes of host memory the pool holds: `buffers() * layout().bytes()`, rounded up to
    /// whole pages per buffer by the allocator.
    pub fn pool_bytes(&self) -> usize {
        self.pool.size() * self.pool.bytes()
    }

    /// Buffers sitting free in the pool right now (neither being filled, waiting for
    /// delivery, nor held in a [`HostBatch`]).
    pub fn free_buffers(&self) -> usize {
        self.pool.free()
    }

    /// The allocator's name.
    pub fn allocator(&self) -> &'static str {
        self.pool.allocator()
    }

    /// Whether the whole of `epoch` may be served without the loader (a device cache
    /// replaying it), to be recorded by [`served`](Loader::served) once done: asked
    /// first, so that nothing is trained on a refusal.
    ///
    /// # Errors
    /// [`Error::Config`] while a resume is pending inside `epoch` or for a later epoch
    /// (part of `epoch` was taken already, or it comes before the resumed one: go
    /// through [`epoch`](Loader::epoch)); [`Error::EpochLeaked`] while an earlier
    /// epoch's iterator was leaked, as for [`epoch`](Loader::epoch).
    pub fn can_serve(&self, epoch: u64) -> Result<()> {
        if let Some(last) = self
            .last
            .as_ref()
            .filter(|l| !l.closed.load(Ordering::Acquire))
        {
            return Err(Error::EpochLeaked {
                epoch: last.order.epoch(),
            });
        }
        match self.pending() {
            Some(r) if r.epoch > epoch || self.resumes(epoch) => Err(Error::Config(format!(
                "this loader resumes epoch {} at batch {}: epoch {epoch} cannot be served whole",
                r.epoch, r.batch
            ))),
            _ => Ok(()),
        }
    }

    /// Records that the whole of `epoch` was served without the loader (a device cache
    /// replayed it): [`state`](Loader::state) moves to the next epoch's start, as after
    /// an [`Epoch`] run to its end, so a checkpoint taken now resumes after it. A
    /// resume pending for the start of `epoch`, or for an earlier epoch, is spent.
    ///
    /// # Errors
    /// As [`can_serve`](Loader::can_serve) (a leaked epoch's workers are stopped, as
    /// [`epoch`](Loader::epoch) does); the loader is otherwise unchanged.
    pub fn served(&mut self, epoch: u64) -> Result<()> {
        self.check_last()?;
        self.can_serve(epoch)?;
        (self.resume, self.resumed) = (None, None);
        self.state = LoaderState::at(&self.order, epoch.saturating_add(1), 0, 0);
        Ok(())
    }

    /// Resumes from a saved state, as [`LoaderBuilder::resume`] does for a new loader:
    /// the next [`epoch`](Loader::epoch) call for `state.epoch` yields only the batches
    /// after `state.batch`.
    ///
    /// # Errors
    /// [`Error::Config`] for a state saved by a loader with another order (its
    /// fingerprint differs) or past the end of its epoch; the loader is unchanged.
    pub fn resume(&mut self, state: LoaderState) -> Result<()> {
        self.resume_as(state, Resume::Exact)
    }

    /// Whether [`epoch`](Loader::epoch)`(epoch)` will start part of the way into the
    /// epoch: a resume is pending for it.
    pub fn resumes(&self, epoch: u64) -> bool {
        self.pending()
            .is_some_and(|r| r.epoch == epoch && (r.batch > 0 || r.start > 0))
    }

    /// The resume the next [`epoch`](Loader::epoch) call for its epoch starts from: the
    /// one given, or the one the last epoch started from while that epoch has delivered
    /// no batch (dropped at once, it leaves the resume standing, as the state says).
    fn pending(&self) -> Option<LoaderState> {
        self.resume.or_else(|| {
            let (r, last) = (self.resumed?, self.last.as_ref()?);
            (last.delivered.load(Ordering::Acquire) == r.batch).then_some(r)
        })
    }

    /// Resumes from a state saved by a loader with another world size, rank, batch size
    /// or tail, as [`LoaderBuilder::resume_elastic`] does for a new loader.
    ///
    /// # Errors
    /// [`Error::Config`] for a state saved under another global order (dataset length,
    /// shuffle or seed), or one that does not record it; the loader is unchanged.
    pub fn resume_elastic(&mut self, state: LoaderState) -> Result<()> {
        self.resume_as(state, Resume::Elastic)
    }

    fn resume_as(&mut self, state: LoaderState, how: Resume) -> Result<()> {
        let state = check_resume(&self.order, state, how)?;
        (self.resume, self.resumed) = (Some(state), None);
        self.state = state;
        Ok(())
    }

    /// Bytes of page cache the loader may fill (see
    /// [`LoaderBuilder::page_cache_budget`]).
    pub fn page_cache_budget(&self) -> u64 {
        self.budget
    }

    /// Whether files streamed with their rows scattered are read with direct I/O here:
    /// asked for ([`LoaderBuilder::direct_reads`]), reads planned, and io_uring
    /// available.
    /// Each epoch still falls back to the page cache for a file system without
    /// `O_DIRECT`.
    pub fn direct_reads(&self) -> bool {
        self.uring
    }

    /// One-off costs of building the loader.
    pub fn startup(&self) -> Startup {
        self.startup
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // A leaked epoch's workers may wait for buffers that never come back.
        let _ = self.check_last();
        for w in self.workers.iter_mut().chain(&mut self.planner) {
            drop(w.jobs.take());
        }
        for w in self.workers.iter_mut().chain(&mut self.planner) {
            if let Some(h) = w.handle.take() {
                let _ = h.join();
            }
        }
    }
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("order", &self.order)
            .field("workers", &self.workers.len())
            .field("buffers", &self.pool.size())
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}
