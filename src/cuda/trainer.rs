//! The CUDA backend's trainer: a [`Feeder`] driving the [`Step`], and the device cache
//! that later epochs read instead of the loader.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::feeder::{DeviceBatch, FeedStats, Feeder};
use super::kernels::{KernelOrigin, Kernels};
use super::step::Step;
use super::Cuda;
use crate::augment::Augmenter;
use crate::backend::{check_columns, Trainer};
use crate::error::Result;
use crate::loader::{BatchLayout, Epoch, HostBatch, Loader};
use crate::model::{Metrics, Mlp, Normalize};
use crate::sampler::EpochOrder;
use crate::telemetry::{EpochOutcome, Progress, Trace};

/// Training state on the GPU: a feeder (with its device cache and augmentation) and the
/// step it drives.
pub struct CudaTrainer {
    feeder: Feeder,
    step: Step,
}

/// Enqueues `step` on `db`: a copied full batch as the step's CUDA graph for its slot; a
/// batch from the device cache launch by launch (a cached epoch's work is captured as a
/// graph of its own).
fn step_on(step: &Step, db: &DeviceBatch) -> Result<()> {
    match db.from_cache() {
        true => step.enqueue(db),
        false => step.enqueue_replayed(db),
    }
}

impl CudaTrainer {
    /// Uploads `mlp`'s weights (so both backends start from the same ones) and allocates
    /// `slots` device slots (at least 2) for batches of `layout`.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) for columns that do not fit the model;
    /// [`Error::Cuda`](crate::Error::Cuda) when an allocation or stream creation fails.
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
        let mut feeder = Feeder::new(&cuda, layout, slots)?;
        feeder.use_kernels(kernels.clone());
        // Every cached epoch makes the same launches with the same arguments (the index
        // list and draws are uploaded to the same buffers): one capture serves them all.
        feeder.replay_cached_epochs(true);
        let batch = layout.batch_size();
        let step = Step::new(feeder.stream(), kernels, (mlp, norm), batch, columns)?;
        Ok(CudaTrainer { feeder, step })
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
        self.feeder.augmenter()
    }

    /// Augments each batch on the device (see [`Trainer::augment_on_device`]); returns
    /// how the augmentation kernel was obtained.
    ///
    /// # Errors
    /// As [`Trainer::augment_on_device`].
    pub fn augment_with(&mut self, augmenter: &Augmenter) -> Result<&KernelOrigin> {
        let raw = self.feeder.layout();
        let out = BatchLayout::new(augmenter.columns(), raw.batch_size())?;
        if raw.columns() == augmenter.inputs() {
            check_columns(self.step.inputs(), &out, self.step.columns())?;
        }
        self.feeder.augment_on_device(augmenter)
    }

    /// Whether the device cache holds a whole epoch's samples.
    pub fn cache_filled(&self) -> bool {
        self.feeder.cache_filled()
    }

    /// The outcome of a fed epoch, with the step's metrics.
    fn outcome(&self, fed: FeedStats) -> Result<EpochOutcome> {
        let mut out = EpochOutcome {
            metrics: self.step.read_metrics(fed.samples)?,
            batches: fed.batches,
            ..EpochOutcome::default()
        };
        out.close(fed.loader, fed.wall);
        out.stages.wait_data = fed.wait_data;
        out.stages.copy = fed.copy;
        out.stages.compute = fed.compute;
        if !fed.cached {
            // The host thread waits for data, then enqueues: its waits are the step's
            // stalls for data. The copies are asynchronous, on a stream of their own:
            // the step's stall for them is the compute stream's idle time while they
            // ran, read from the device's events.
            out.stages.stall_data = fed.wait_data;
            out.stages.stall_copy = fed.stall_copy;
        }
        Ok(out)
    }

    /// Trains an epoch from the device cache: batches gathered on the device by index,
    /// no host gathering, no host-to-device copy but the epoch's index list.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) if the cache is not filled; a driver
    /// error; [`Error::Label`](crate::Error::Label) for a bad label.
    pub fn train_epoch_cached(
        &mut self,
        order: &EpochOrder,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<EpochOutcome> {
        self.step.reset_metrics()?;
        let step = &self.step;
        let fed = self
            .feeder
            .run_cached_epoch(order, &mut |db| step_on(step, db), progress)?;
        self.outcome(fed)
    }

    /// One step on one batch, synchronously (for checking against the CPU backend),
    /// augmented first when the trainer augments.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda) on a driver error, or
    /// [`Error::Label`](crate::Error::Label) for a bad label (flagged on the device).
    pub fn step_once(&mut self, batch: &HostBatch) -> Result<Metrics> {
        self.step.reset_metrics()?;
        let step = &self.step;
        self.feeder.feed_one(batch, |db| step.enqueue(db))?;
        self.step.read_metrics(batch.len() as u64)
    }

    /// Trains on every batch of `epoch`, copies overlapped with compute (see
    /// [`Feeder`]); `progress(samples, stalled)` after each batch is enqueued. A whole
    /// epoch fills the device cache, if enabled and not filled yet.
    ///
    /// # Errors
    /// The loader's first error, a driver error, or [`Error::Label`](crate::Error::Label)
    /// for a label outside the classes (checked at the end of the epoch, when the
    /// device's counters are read).
    pub fn train_epoch_with(
        &mut self,
        epoch: Epoch<'_>,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<EpochOutcome> {
        self.step.reset_metrics()?;
        let step = &self.step;
        let fed = self
            .feeder
            .run_epoch(epoch, &mut |db| step_on(step, db), progress)?;
        self.outcome(fed)
    }
}

impl Trainer for CudaTrainer {
    fn train(&mut self, from: &mut Loader, epoch: u64, progress: Progress) -> Result<EpochOutcome> {
        // From the device cache when it is filled, unless a resume is pending for the
        // epoch (the cache would replay all of it).
        self.step.reset_metrics()?;
        let step = &self.step;
        let fed = self
            .feeder
            .feed(from, epoch, &mut |db| step_on(step, db), progress)?;
        self.outcome(fed)
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
        self.feeder.warm_up()?;
        Ok(t.elapsed())
    }

    /// The cache is filled by the next whole epoch from the loader, or by
    /// [`fill_device_cache`](Trainer::fill_device_cache).
    fn enable_device_cache(&mut self, loader: &Loader, share: f64) -> Result<Option<u64>> {
        self.feeder.enable_device_cache(loader, share)
    }

    fn fill_device_cache(&mut self, loader: &Loader) -> Result<Option<Duration>> {
        let t = Instant::now();
        if self.feeder.fill_device_cache(loader)?.is_none() {
            return Ok(None);
        }
        // Captured now, so that epoch 0 does not pay for it.
        let step = &self.step;
        let order = loader.order().epoch(0);
        self.feeder
            .capture_cached_epoch(&order, &mut |db| step_on(step, db))?;
        Ok(Some(t.elapsed()))
    }
}
