//! What a [`Feeder`] keeps on the device from one epoch to the next: the device cache
//! (the dataset, scattered there by a whole epoch from the loader or filled straight
//! from the files), the augmentation of each batch on the device, and a cached epoch's
//! work captured once as a CUDA graph.
//!
//! A cached epoch needs neither the loader nor the host: its index list (and its draws,
//! when the device augments) go to the device in one copy each at its start, then each
//! batch is gathered from the cache on the compute stream, augmented, and handed to the
//! work, as a copied batch would be.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaEvent, CudaGraph, CudaStream};

use super::augment::EpochAugment;
use super::cache::DeviceCache;
use super::feeder::{DeviceBatch, FeedStats, Feeder};
use super::kernels::{KernelOrigin, Kernels};
use super::Cuda;
use crate::augment::Augmenter;
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, Epoch, HostBatch, Loader};
use crate::sampler::EpochOrder;
use crate::telemetry::{Stage, Trace, Track};

/// The work on each batch, as [`Feeder::run_epoch`] takes it.
pub type Work<'w> = &'w mut dyn FnMut(&DeviceBatch) -> Result<()>;

/// What a captured cached epoch depends on: its batches, the last one's samples, and
/// where the augmentation's draws are (0 without one).
type EpochShape = (u64, usize, u64);

/// Per batch of a traced cached epoch: the start of its gather, of its work, the end.
type Marks = (CudaEvent, Vec<[CudaEvent; 3]>);

/// A feeder's device-resident state.
#[derive(Default)]
pub(super) struct Resident {
    /// The gather and scatter kernels, loaded with the cache.
    kernels: Option<Kernels>,
    cache: Option<DeviceCache>,
    augment: Option<EpochAugment>,
    /// Whether cached epochs replay their work as a CUDA graph.
    replay: bool,
    graph: Option<(EpochShape, CudaGraph)>,
    marks: Option<Marks>,
}

impl Resident {
    fn shape_of(&self, order: &EpochOrder) -> EpochShape {
        (
            order.batches(),
            order.batch_len(order.batches().saturating_sub(1)),
            self.augment.as_ref().map_or(0, EpochAugment::draws_addr),
        )
    }

    /// Before a fed epoch: whether it fills the cache (a whole epoch from its first
    /// batch, not resumed elastically after other ranks took part of it, whose batches
    /// hold as many samples as the cache has rows, while the cache is not filled), with
    /// the epoch's index list and draws enqueued on `stream`.
    ///
    /// # Errors
    /// As `DeviceCache::upload_order` (a sample past the cache's rows).
    pub(super) fn before_fed(&mut self, epoch: &Epoch<'_>, stream: &CudaStream) -> Result<bool> {
        let rows = self.cache.as_ref().map(|c| c.rows());
        let whole = epoch.first_batch() == 0
            && epoch.order().start() == 0
            && Some(epoch.order().items()) == rows;
        let filling = whole && self.cache.as_ref().is_some_and(|c| !c.filled());
        if let Some(c) = self.cache.as_mut().filter(|_| filling) {
            c.upload_order(epoch.order(), stream)?;
        }
        if let Some(a) = &mut self.augment {
            a.upload_order(epoch.order())?;
        }
        Ok(filling)
    }

    /// The device's share of the work on fed batch `db`: scattered into the cache when
    /// `filling` (raw, as the loader gathered it), augmented; then `work` on it.
    pub(super) fn fed(&self, db: &DeviceBatch, filling: bool, work: Work<'_>) -> Result<()> {
        if let (Some(c), Some(k), true) = (&self.cache, &self.kernels, filling) {
            c.scatter(k, db)?;
        }
        self.augmented(db, work)
    }

    /// Before one batch fed alone ([`Feeder::feed_one`]): its draws uploaded, from 0.
    pub(super) fn before_one(&mut self, batch: &HostBatch) -> Result<()> {
        match &mut self.augment {
            Some(a) => a.upload_batch(batch.epoch(), batch.indices()),
            None => Ok(()),
        }
    }

    /// `db` as the work gets it: augmented by the draws uploaded from `at`, or as it is.
    pub(super) fn for_work<'b>(
        &'b self,
        db: &'b DeviceBatch<'_>,
        at: usize,
    ) -> Result<Option<DeviceBatch<'b>>> {
        self.augment.as_ref().map(|a| a.apply(db, at)).transpose()
    }

    /// `work` on `db`, augmented first when the device augments (its epoch's draws
    /// uploaded).
    fn augmented(&self, db: &DeviceBatch, work: Work<'_>) -> Result<()> {
        let at = db.number() as usize * db.layout().batch_size();
        let augmented = self.for_work(db, at)?;
        work(augmented.as_ref().unwrap_or(db))
    }

    /// After a fed epoch that filled the cache: it is filled, and with replay on, the
    /// work of a cached epoch shaped like `order` is captured now, so that the first
    /// cached epoch does not pay for it.
    pub(super) fn after_fed(
        &mut self,
        stream: &Arc<CudaStream>,
        order: &EpochOrder,
        work: Work<'_>,
    ) -> Result<()> {
        if let Some(c) = &mut self.cache {
            c.set_filled();
        }
        self.capture(stream, order, work)
    }

    /// Enqueues the gather of batch `b` of `order` from the cache, then `gathered()`,
    /// then its augmentation and `work` on it.
    fn enqueue_cached(
        &self,
        stream: &Arc<CudaStream>,
        (order, b): (&EpochOrder, u64),
        gathered: impl FnOnce() -> Result<()>,
        work: Work<'_>,
    ) -> Result<()> {
        let (Some(cache), Some(kernels)) = (&self.cache, &self.kernels) else {
            return Err(Error::Config("the device cache is not filled".into()));
        };
        let rows = order.batch_len(b);
        let db = cache.gather(kernels, stream, order.epoch(), b, rows)?;
        gathered()?;
        self.augmented(&db, work)
    }

    /// With replay on and the cache filled, captures the work of a cached epoch shaped
    /// like `order` into a CUDA graph (unless one of that shape is kept already) and
    /// uploads it.
    ///
    /// # Errors
    /// `work`'s error or a driver error; the stream is left out of capture mode.
    fn capture(
        &mut self,
        stream: &Arc<CudaStream>,
        order: &EpochOrder,
        work: Work<'_>,
    ) -> Result<()> {
        if !self.replay || !self.cache.as_ref().is_some_and(DeviceCache::filled) {
            return Ok(());
        }
        if let Some(a) = &mut self.augment {
            // Room for an epoch of this shape's draws, so that its upload moves nothing.
            a.reserve_for(order)?;
        }
        let shape = self.shape_of(order);
        if self.graph.as_ref().is_some_and(|(s, _)| *s == shape) {
            return Ok(());
        }
        self.graph = None;
        let graph = super::capture_graph(stream, "epoch", || {
            (0..order.batches())
                .try_for_each(|b| self.enqueue_cached(stream, (order, b), || Ok(()), &mut *work))
        })?;
        graph.upload()?;
        self.graph = Some((shape, graph));
        Ok(())
    }
}

/// The trace events of a cached epoch of `n` batches, made on first use and kept.
fn marks_for<'a>(marks: &'a mut Option<Marks>, cuda: &Cuda, n: usize) -> Result<&'a Marks> {
    let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let event = || cuda.ctx.new_event(timed).map_err(Error::from);
    if marks.is_none() {
        *marks = Some((event()?, Vec::new()));
    }
    let (_, m) = marks.as_mut().expect("just set");
    while m.len() < n {
        m.push([event()?, event()?, event()?]);
    }
    Ok(marks.as_ref().expect("just set"))
}

/// The device cache and the augmentation on the device.
impl Feeder {
    /// The gather and scatter kernels: `kernels` (a trainer's, loaded already) from now
    /// on, instead of loading them when the cache is enabled.
    pub(crate) fn use_kernels(&mut self, kernels: Kernels) {
        self.resident.kernels = Some(kernels);
    }

    /// Keeps the dataset of `loader` on the device if it fits under `share` of the free
    /// device memory, one epoch covers every row (one shard, no sample dropped by the
    /// tail rule or `drop_last`), its samples are the same every epoch
    /// ([`Dataset::same_every_epoch`](crate::Dataset::same_every_epoch): not random token
    /// windows), the loader's batches have this feeder's layout, and the loader does not
    /// augment (its batches differ every epoch;
    /// [`augment_on_device`](Self::augment_on_device) augments cached batches instead).
    /// Returns the cache's size in bytes, or `None` where it does not apply. The next whole epoch that [`run_epoch`](Self::run_epoch) feeds fills it,
    /// or [`fill_device_cache`](Self::fill_device_cache) does; then
    /// [`feed`](Self::feed) serves epochs from it. A cache enabled again replaces the
    /// last.
    ///
    /// # Errors
    /// [`Error::Cuda`] if a device allocation fails, or for the kernels' compilation
    /// (NVRTC's log) the first time; [`Error::Alloc`] for the page-locked index list.
    pub fn enable_device_cache(&mut self, loader: &Loader, share: f64) -> Result<Option<u64>> {
        let r = &mut self.resident;
        // The graph reads the cache's buffers, which go with it.
        r.graph = None;
        r.cache = None;
        let order = loader.order();
        let rows = order.len();
        if loader.augmenter().is_some()
            || !order.is_whole()
            || !loader.dataset().same_every_epoch()
            || loader.layout() != &self.layout
        {
            return Ok(None);
        }
        if r.kernels.is_none() {
            r.kernels = Some(Kernels::load(&self.cuda)?);
        }
        let (cuda, stream) = (&self.cuda, &self.compute);
        r.cache = DeviceCache::new(cuda, stream, &self.layout, rows, rows, share)?
            .map(|c| c.holding(order.dataset_fingerprint()));
        Ok(r.cache.as_ref().map(DeviceCache::bytes))
    }

    /// Fills the device cache straight from `loader`'s dataset, in large sequential
    /// copies (far cheaper than the first epoch's scatter): epoch 0 then already comes
    /// from the device. Returns how long it took, or `None` without a cache.
    ///
    /// # Errors
    /// The dataset's error or a driver error.
    pub fn fill_device_cache(&mut self, loader: &Loader) -> Result<Option<Duration>> {
        let t = Instant::now();
        match &mut self.resident.cache {
            Some(c) => {
                c.fill_from(&self.cuda, loader.dataset().as_ref())?;
                Ok(Some(t.elapsed()))
            }
            None => Ok(None),
        }
    }

    /// Whether the device cache holds every sample.
    pub fn cache_filled(&self) -> bool {
        self.resident
            .cache
            .as_ref()
            .is_some_and(DeviceCache::filled)
    }

    /// Bytes of the device cache, if there is one.
    pub fn cache_bytes(&self) -> Option<u64> {
        self.resident.cache.as_ref().map(DeviceCache::bytes)
    }

    /// Augments each batch on the device before the work sees it, after its copy or its
    /// gather from the device cache, drawn per sample from `(seed, epoch, sample)` as
    /// the loader's workers draw ([`LoaderBuilder::augment`](crate::LoaderBuilder::augment)):
    /// the loader gathers raw batches, and the device cache keeps the raw images. Each
    /// epoch's draws go to the device in one copy at its start. The work gets batches of
    /// [`Augmenter::columns`]; returns how the augmentation kernel was obtained.
    ///
    /// # Errors
    /// [`Error::Config`] for an augmenter bound to other columns than the batches';
    /// [`Error::Cuda`] for NVRTC's log or a driver error.
    pub fn augment_on_device(&mut self, augmenter: &Augmenter) -> Result<&KernelOrigin> {
        let a = EpochAugment::new(&self.cuda, &self.compute, &self.layout, augmenter)?;
        // A captured epoch has no augmentation in it.
        self.resident.graph = None;
        Ok(self.resident.augment.insert(a).origin())
    }

    /// The augmentation run on the device, if any.
    pub fn augmenter(&self) -> Option<&Augmenter> {
        self.resident.augment.as_ref().map(EpochAugment::augmenter)
    }

    /// Launches the augmentation kernel once on nothing and waits, if the device
    /// augments: CUDA's lazy module loading is paid here, not by the first batch.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    pub fn warm_up(&self) -> Result<()> {
        match &self.resident.augment {
            Some(a) => a.warm_up(),
            None => Ok(()),
        }
    }

    /// The layout of the batches the work gets: the loader's, or the augmented one.
    pub fn work_layout(&self) -> &BatchLayout {
        self.resident
            .augment
            .as_ref()
            .map_or(&self.layout, EpochAugment::layout)
    }

    /// Whether the work of a cached epoch is captured once as a CUDA graph and replayed
    /// (off by default). The whole epoch is then one launch, but the work is called only
    /// while capturing: at the end of the epoch that filled the cache (counted in its
    /// wall time), by [`capture_cached_epoch`](Self::capture_cached_epoch), or by the
    /// first cached epoch of a shape no graph was captured for (after
    /// [`augment_on_device`](Self::augment_on_device), say). It must then enqueue the
    /// same launches with the same arguments for every cached epoch, reading what
    /// changes from device memory it owns, and must not wait for the device. Traced
    /// epochs run batch by batch.
    ///
    /// Launch the work's kernels on slices of a context object whose event tracking is
    /// off (`CudaContext::disable_event_tracking`, an `unsafe` call: ordering those
    /// slices is then yours, as the feeder's own context object orders its own): with
    /// tracking on, cudarc records and waits on events around each launch, which a
    /// capture either refuses or keeps as waits on events recorded outside it.
    pub fn replay_cached_epochs(&mut self, yes: bool) {
        self.resident.replay = yes;
        if !yes {
            self.resident.graph = None;
        }
    }

    /// With replay on and the cache filled, captures `work` on a cached epoch shaped
    /// like `order` now, replacing the graph kept, so that the first cached epoch does
    /// not pay for it (after [`fill_device_cache`](Self::fill_device_cache); an epoch
    /// that fills the cache captures by itself).
    ///
    /// # Errors
    /// `work`'s error, [`Error::Config`] for a batch the augmentation refuses, a driver
    /// error; [`Error::Alloc`] for the staging of more draws.
    pub fn capture_cached_epoch(&mut self, order: &EpochOrder, work: Work<'_>) -> Result<()> {
        let stream = Arc::clone(&self.compute);
        self.resident.graph = None;
        self.resident.capture(&stream, order, work)
    }

    /// Feeds epoch `epoch` of `loader`: from the device cache when it holds the data and
    /// no resume is pending for the epoch (the loader is not touched, but its state moves
    /// past the epoch, as if it had served it), else through the loader
    /// ([`run_epoch`](Self::run_epoch)).
    ///
    /// # Errors
    /// As [`run_epoch`](Self::run_epoch) and [`run_cached_epoch`](Self::run_cached_epoch);
    /// an epoch the loader would refuse is refused before any work.
    pub fn feed(
        &mut self,
        loader: &mut Loader,
        epoch: u64,
        work: Work<'_>,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<FeedStats> {
        if self.cache_filled() && !loader.resumes(epoch) {
            loader.can_serve(epoch)?;
            let fed = self.run_cached_epoch(&loader.order().epoch(epoch), work, progress)?;
            loader.served(epoch)?;
            Ok(fed)
        } else {
            self.run_epoch(loader.epoch(epoch)?, work, progress)
        }
    }

    /// Runs `work` on every batch of `order` gathered from the filled device cache on
    /// the compute stream: no host gathering, no copy but the epoch's index list (and
    /// draws). With replay on, untraced, the work is one graph launch (captured first if
    /// no graph of this epoch's shape is kept). Waits for the device at the end: its
    /// stats' `compute` is the wall time.
    ///
    /// # Errors
    /// [`Error::Config`] if the cache is not filled; `work`'s error or a driver error;
    /// [`Error::Alloc`] for the staging of more draws.
    pub fn run_cached_epoch(
        &mut self,
        order: &EpochOrder,
        work: Work<'_>,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<FeedStats> {
        let start = Instant::now();
        if !self.cache_filled() {
            return Err(Error::Config("the device cache is not filled".into()));
        }
        let stream = Arc::clone(&self.compute);
        let r = &mut self.resident;
        if let Some(c) = &mut r.cache {
            c.upload_order(order, &stream)?;
        }
        if let Some(a) = &mut r.augment {
            a.upload_order(order)?;
        }
        let n = order.batches() as usize;
        if self.trace.is_some() {
            marks_for(&mut r.marks, &self.cuda, n)?;
        } else {
            // Replay, with the graph captured now where none of this shape is kept.
            r.capture(&stream, order, &mut *work)?;
        }
        let r = &self.resident;
        let marks = r.marks.as_ref().filter(|_| self.trace.is_some());
        // The whole epoch in one launch where a graph of its shape was captured; traced
        // epochs launch batch by batch, to place their events.
        let graph = match (marks, &r.graph) {
            (None, Some((shape, g))) if *shape == r.shape_of(order) => Some(g),
            _ => None,
        };
        let t0 = Instant::now();
        let mut stats = FeedStats {
            cached: true,
            ..FeedStats::default()
        };
        let enqueued = (|| -> Result<()> {
            if let Some(g) = graph {
                g.launch()?;
            } else if let Some((origin, _)) = marks {
                origin.record(&stream)?;
            }
            let mark = |b: usize, i: usize| match marks {
                Some((_, m)) => m[b][i].record(&stream).map_err(Error::from),
                None => Ok(()),
            };
            for b in 0..order.batches() {
                let rows = order.batch_len(b);
                if graph.is_none() {
                    mark(b as usize, 0)?;
                    let gathered = || mark(b as usize, 1);
                    r.enqueue_cached(&stream, (order, b), gathered, &mut *work)?;
                    mark(b as usize, 2)?;
                }
                stats.batches += 1;
                stats.samples += rows as u64;
                progress(rows as u64, 0.0);
            }
            Ok(())
        })();
        // Whatever happened, the epoch's work is done before its index list and draws
        // are rewritten, or the cache freed.
        let settled = super::wait_stream(&stream);
        enqueued?;
        settled?;
        stats.wall = start.elapsed();
        stats.compute = stats.wall;
        if let (Some(tr), Some((origin, m))) = (self.trace.as_deref(), marks) {
            trace_cached(tr, (origin, m), (t0, order.epoch()), n)?;
        }
        Ok(stats)
    }
}

/// Records the spans of a cached epoch's `n` batches from their completed events: a
/// device gather, then the work, on the compute track.
fn trace_cached(
    tr: &Trace,
    (origin, m): (&CudaEvent, &[[CudaEvent; 3]]),
    (t0, epoch): (Instant, u64),
    n: usize,
) -> Result<()> {
    let at = |e: &CudaEvent| -> Result<Instant> {
        let ms = origin.elapsed_ms(e)?;
        Ok(t0 + Duration::from_secs_f64(ms.max(0.0) as f64 / 1e3))
    };
    for (b, [g, s, e]) in m.iter().take(n).enumerate() {
        let (g, s, e) = (at(g)?, at(s)?, at(e)?);
        tr.span(Stage::DeviceGather, Track::Compute, (g, s), epoch, b as u64);
        tr.span(Stage::Compute, Track::Compute, (s, e), epoch, b as u64);
    }
    Ok(())
}
