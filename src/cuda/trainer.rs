//! The CUDA backend's trainer: a [`Feeder`] driving the [`Step`], and the device cache
//! that later epochs read instead of the loader.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaEvent, CudaGraph};

use super::augment::EpochAugment;
use super::cache::DeviceCache;
use super::feeder::{DeviceBatch, Feeder};
use super::kernels::{KernelOrigin, Kernels};
use super::step::Step;
use super::Cuda;
use crate::augment::Augmenter;
use crate::backend::{check_columns, Trainer};
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, Epoch, HostBatch, Loader};
use crate::model::{Metrics, Mlp, Normalize};
use crate::sampler::EpochOrder;
use crate::telemetry::{EpochOutcome, Progress, Stage, Trace, Track};

/// Training state on the GPU: a feeder and the step it drives.
pub struct CudaTrainer {
    feeder: Feeder,
    step: Step,
    cache: Option<DeviceCache>,
    /// The augmentation of each batch on the device, between its copy or gather and its
    /// step, if any: the loader's batches and the device cache are then raw.
    augment: Option<EpochAugment>,
    /// Events for trace spans of epochs served by the device cache: an origin, then per
    /// batch the start of its device gather, the start of its step and the step's end.
    marks: Option<(CudaEvent, Vec<[CudaEvent; 3]>)>,
    /// A cached epoch's launches (device gathers and steps, batch after batch) as one
    /// CUDA graph, for epochs of the shape it was captured for: every cached epoch makes
    /// the same launches with the same arguments (the index list is uploaded to the same
    /// buffer), so one capture serves them all.
    graph: Option<(EpochShape, CudaGraph)>,
}

/// What a captured cached epoch depends on: its batches, the last one's samples, and
/// where the augmentation's draws are (0 without one).
type EpochShape = (u64, usize, u64);

fn shape_of(order: &EpochOrder, augment: Option<&EpochAugment>) -> EpochShape {
    (
        order.batches(),
        order.batch_len(order.batches().saturating_sub(1)),
        augment.map_or(0, EpochAugment::draws_addr),
    )
}

/// Enqueues `step` on `db`, augmented first when there is an augmentation (its draws
/// uploaded for `db`'s epoch); `replayed`: as one CUDA graph for a full batch.
fn step_on(
    step: &Step,
    augment: Option<&EpochAugment>,
    db: &DeviceBatch,
    replayed: bool,
) -> Result<()> {
    let augmented = match augment {
        Some(a) => Some(a.apply(db, db.number() as usize * db.layout().batch_size())?),
        None => None,
    };
    let db = augmented.as_ref().unwrap_or(db);
    match replayed {
        true => step.enqueue_replayed(db),
        false => step.enqueue(db),
    }
}

impl CudaTrainer {
    /// Uploads `mlp`'s weights (so both backends start from the same ones) and allocates
    /// `slots` device slots (at least 2) for batches of `layout`.
    ///
    /// # Errors
    /// [`Error::Config`] for columns that do not fit the model; [`Error::Cuda`] when an
    /// allocation or stream creation fails.
    pub fn new(
        cuda: Cuda,
        kernels: Kernels,
        mlp: &Mlp,
        norm: Normalize,
        layout: &BatchLayout,
        columns: (usize, usize),
        slots: usize,
    ) -> Result<CudaTrainer> {
        check_columns(mlp.config.inputs, layout, columns)?;
        let feeder = Feeder::new(&cuda, layout, slots)?;
        let batch = layout.batch_size();
        let step = Step::new(feeder.stream(), kernels, (mlp, norm), batch, columns)?;
        Ok(CudaTrainer {
            feeder,
            step,
            cache: None,
            augment: None,
            marks: None,
            graph: None,
        })
    }

    /// The device this trainer runs on.
    pub fn cuda(&self) -> &Cuda {
        self.feeder.cuda()
    }

    /// The kernels (with how they were obtained).
    pub fn kernels(&self) -> &Kernels {
        self.step.kernels()
    }

    /// The augmentation run on the device, if any.
    pub fn augmenter(&self) -> Option<&Augmenter> {
        self.augment.as_ref().map(EpochAugment::augmenter)
    }

    /// Augments each batch on the device (see [`Trainer::augment_on_device`]); returns
    /// how the augmentation kernel was obtained.
    ///
    /// # Errors
    /// As [`Trainer::augment_on_device`].
    pub fn augment_with(&mut self, augmenter: &Augmenter) -> Result<&KernelOrigin> {
        let cuda = self.feeder.cuda();
        let a = EpochAugment::new(cuda, self.feeder.stream(), self.feeder.layout(), augmenter)?;
        check_columns(self.step.inputs(), a.layout(), self.step.columns())?;
        // A captured epoch has no augmentation in it.
        self.graph = None;
        Ok(self.augment.insert(a).origin())
    }

    /// Captures the launches of a cached epoch shaped like `order` into a CUDA graph
    /// (unless one of that shape is kept already) and uploads it, so that the first
    /// cached epoch does not pay for it.
    ///
    /// # Errors
    /// A driver error; the stream is left out of capture mode.
    fn capture_cached_epoch(&mut self, order: &EpochOrder) -> Result<()> {
        if let Some(a) = &mut self.augment {
            // Draws for an epoch of this shape, so that its own upload moves nothing.
            a.upload_order(order)?;
        }
        let shape = shape_of(order, self.augment.as_ref());
        if self.graph.as_ref().is_some_and(|(s, _)| *s == shape) {
            return Ok(());
        }
        self.graph = None;
        let Some(cache) = &self.cache else {
            return Ok(());
        };
        let stream = Arc::clone(self.feeder.stream());
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        stream.begin_capture(mode)?;
        let enqueued = (|| -> Result<()> {
            for b in 0..order.batches() {
                let rows = order.batch_len(b);
                let db = cache.gather(self.step.kernels(), &stream, order.epoch(), b, rows)?;
                step_on(&self.step, self.augment.as_ref(), &db, false)?;
            }
            Ok(())
        })();
        // End the capture whatever happened, so the stream is usable again.
        let flags = sys::CUgraphInstantiate_flags(0);
        let graph = stream.end_capture(flags).map_err(Error::from);
        enqueued?;
        let graph = graph?.ok_or_else(|| Error::cuda("the captured epoch is empty"))?;
        graph.upload()?;
        self.graph = Some((shape, graph));
        Ok(())
    }

    /// Whether the device cache holds a whole epoch's samples.
    pub fn cache_filled(&self) -> bool {
        self.cache.as_ref().is_some_and(DeviceCache::filled)
    }

    /// Trains an epoch from the device cache: batches gathered on the device by index,
    /// no host gathering, no host-to-device copy but the epoch's index list.
    ///
    /// # Errors
    /// [`Error::Config`] if the cache is not filled; a driver error; [`Error::Cuda`] for
    /// a bad label.
    pub fn train_epoch_cached(
        &mut self,
        order: &EpochOrder,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<EpochOutcome> {
        let start = Instant::now();
        let cache = match &mut self.cache {
            Some(c) if c.filled() => c,
            _ => return Err(Error::Config("the device cache is not filled".into())),
        };
        self.step.reset_metrics()?;
        let stream = Arc::clone(self.feeder.stream());
        cache.upload_order(order, &stream)?;
        if let Some(a) = &mut self.augment {
            a.upload_order(order)?;
        }
        let trace = self.feeder.trace().cloned();
        let n = order.batches() as usize;
        let marks = match &trace {
            Some(_) => Some(marks_for(&mut self.marks, self.feeder.cuda(), n)?),
            None => None,
        };
        // The whole epoch in one launch where a graph of its shape was captured; traced
        // epochs launch batch by batch, to place their events.
        let graph = match (&trace, &self.graph) {
            (None, Some((shape, g))) if *shape == shape_of(order, self.augment.as_ref()) => Some(g),
            _ => None,
        };
        let t0 = Instant::now();
        if let Some(g) = graph {
            g.launch()?;
        } else if let Some((origin, _)) = &marks {
            origin.record(&stream)?;
        }
        let mark = |b: usize, i: usize| match &marks {
            Some((_, m)) => m[b][i].record(&stream).map_err(Error::from),
            None => Ok(()),
        };
        let (mut batches, mut samples) = (0, 0);
        for b in 0..order.batches() {
            let rows = order.batch_len(b);
            if graph.is_none() {
                mark(b as usize, 0)?;
                let db = cache.gather(self.step.kernels(), &stream, order.epoch(), b, rows)?;
                mark(b as usize, 1)?;
                step_on(&self.step, self.augment.as_ref(), &db, false)?;
                mark(b as usize, 2)?;
            }
            batches += 1;
            samples += rows as u64;
            progress(rows as u64, 0.0);
        }
        let metrics = self.step.read_metrics(samples)?;
        let wall = start.elapsed();
        if let (Some(tr), Some((origin, m))) = (&trace, &marks) {
            // The stream is synchronised: every event has completed.
            let at = |e: &CudaEvent| -> Result<Instant> {
                let ms = origin.elapsed_ms(e)?;
                Ok(t0 + Duration::from_secs_f64(ms.max(0.0) as f64 / 1e3))
            };
            for (b, [g, s, e]) in m.iter().take(n).enumerate() {
                let (g, s, e) = (at(g)?, at(s)?, at(e)?);
                let (epoch, b) = (order.epoch(), b as u64);
                tr.span(Stage::DeviceGather, Track::Compute, (g, s), epoch, b);
                tr.span(Stage::Compute, Track::Compute, (s, e), epoch, b);
            }
        }
        let mut out = EpochOutcome {
            metrics,
            wall,
            batches,
            ..EpochOutcome::default()
        };
        out.stages.compute = wall;
        Ok(out)
    }

    /// One step on one batch, synchronously (for checking against the CPU backend),
    /// augmented first when the trainer augments.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error or a bad label (flagged on the device).
    pub fn step_once(&mut self, batch: &HostBatch) -> Result<Metrics> {
        self.step.reset_metrics()?;
        if let Some(a) = &mut self.augment {
            a.upload_batch(batch.epoch(), batch.indices())?;
        }
        let (step, augment) = (&self.step, self.augment.as_ref());
        self.feeder.feed_one(batch, |db| {
            let augmented = match augment {
                Some(a) => Some(a.apply(db, 0)?),
                None => None,
            };
            step.enqueue(augmented.as_ref().unwrap_or(db))
        })?;
        self.step.read_metrics(batch.len() as u64)
    }

    /// Trains on every batch of `epoch`, copies overlapped with compute (see
    /// [`Feeder`]); `progress(samples, stalled)` after each batch is enqueued.
    ///
    /// # Errors
    /// The loader's first error, a driver error, or [`Error::Cuda`] for a label outside
    /// the classes (checked at the end of the epoch, when the device's counters are read).
    pub fn train_epoch_with(
        &mut self,
        epoch: Epoch<'_>,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<EpochOutcome> {
        self.step.reset_metrics()?;
        // A whole epoch, started from its first batch (and not resumed elastically, after
        // other ranks took part of it), fills the cache on the way.
        let whole = epoch.first_batch() == 0 && epoch.order().start() == 0;
        let filling = whole && self.cache.as_ref().is_some_and(|c| !c.filled());
        let epoch_order = epoch.order().clone();
        let t = Instant::now();
        if filling {
            if let Some(c) = &mut self.cache {
                c.upload_order(epoch.order(), self.feeder.stream())?;
            }
        }
        if let Some(a) = &mut self.augment {
            a.upload_order(epoch.order())?;
        }
        let uploads = t.elapsed();
        let (step, cache, augment) = (&self.step, &self.cache, self.augment.as_ref());
        let fed = self.feeder.run_epoch(
            epoch,
            &mut |db| {
                // The cache keeps the batch as the loader gathered it: raw, when the
                // device augments.
                if let Some(c) = cache.as_ref().filter(|_| filling) {
                    c.scatter(step.kernels(), db)?;
                }
                step_on(step, augment, db, true)
            },
            progress,
        )?;
        if filling {
            if let Some(c) = &mut self.cache {
                c.set_filled();
            }
            self.capture_cached_epoch(&epoch_order)?;
        }
        let mut out = EpochOutcome {
            metrics: self.step.read_metrics(fed.samples)?,
            batches: fed.batches,
            ..EpochOutcome::default()
        };
        // The index and draw uploads are part of the epoch.
        out.close(fed.loader, fed.wall + uploads);
        out.stages.wait_data = fed.wait_data;
        out.stages.copy = fed.copy;
        out.stages.compute = fed.compute;
        // The host thread waits for data, then enqueues: its waits are the stalls (its
        // copies are asynchronous, and count as their stream measured them).
        out.stages.in_series();
        Ok(out)
    }
}

/// The trace events of a cached epoch of `n` batches, made on first use and kept.
fn marks_for<'a>(
    marks: &'a mut Option<(CudaEvent, Vec<[CudaEvent; 3]>)>,
    cuda: &Cuda,
    n: usize,
) -> Result<&'a (CudaEvent, Vec<[CudaEvent; 3]>)> {
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
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

impl Trainer for CudaTrainer {
    fn train(&mut self, from: &mut Loader, epoch: u64, progress: Progress) -> Result<EpochOutcome> {
        // A resumed epoch goes through the loader: the cache would replay all of it.
        if self.cache_filled() && !from.resumes(epoch) {
            // Refused before any step, as the loader would refuse the epoch; once done,
            // the loader's state moves past it, as if it had served it.
            from.can_serve(epoch)?;
            let out = self.train_epoch_cached(&from.order().epoch(epoch), progress)?;
            from.served(epoch)?;
            Ok(out)
        } else {
            self.train_epoch_with(from.epoch(epoch)?, progress)
        }
    }

    fn set_trace(&mut self, trace: Arc<Trace>) {
        self.feeder.set_trace(trace);
    }

    fn set_serial(&mut self, serial: bool) -> Result<()> {
        self.feeder.set_serial(serial)
    }

    fn weights(&self) -> Result<Mlp> {
        self.step.weights()
    }

    fn augment_on_device(&mut self, augmenter: &Augmenter) -> Result<Duration> {
        let t = Instant::now();
        self.augment_with(augmenter)?;
        Ok(t.elapsed())
    }

    fn warm_up(&mut self) -> Result<Duration> {
        let t = Instant::now();
        self.step.warm_up()?;
        if let Some(a) = &self.augment {
            a.warm_up()?;
        }
        Ok(t.elapsed())
    }

    /// The cache is filled by the next whole epoch from the loader, or by
    /// [`fill_device_cache`](Trainer::fill_device_cache).
    fn enable_device_cache(&mut self, loader: &Loader, share: f64) -> Result<Option<u64>> {
        // The graph reads the cache's buffers, which go with it: captured again for the
        // new one.
        self.graph = None;
        // Epoch 0's batches are what the cache keeps: augmented, they would be replayed.
        if loader.augmenter().is_some() {
            self.cache = None;
            return Ok(None);
        }
        let order = loader.order();
        // One epoch must scatter every row, or later epochs would gather rows never
        // written: one shard, and no sample dropped by the tail rule or drop_last.
        let rows = order.len();
        let whole = order.shard().world_size() == 1
            && order.samples() == rows
            && order.batches() * order.batch_size() >= rows;
        if !whole {
            self.cache = None;
            return Ok(None);
        }
        let layout = self.feeder.layout().clone();
        let (cuda, stream) = (self.feeder.cuda(), self.feeder.stream());
        self.cache = DeviceCache::new(cuda, stream, &layout, rows, rows, share)?;
        Ok(self.cache.as_ref().map(DeviceCache::bytes))
    }

    fn fill_device_cache(&mut self, loader: &Loader) -> Result<Option<Duration>> {
        let t = Instant::now();
        match &mut self.cache {
            Some(c) => {
                c.fill_from(self.feeder.cuda(), loader.dataset().as_ref())?;
                self.capture_cached_epoch(&loader.order().epoch(0))?;
                Ok(Some(t.elapsed()))
            }
            None => Ok(None),
        }
    }
}
