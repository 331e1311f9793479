//! Epoch timers for your own training loop: the figures and the warm-up split that
//! `stokehold train` reports, around a step stokehold does not know.

use std::time::{Duration, Instant};

use crate::dataset::Dataset;
use crate::error::Result;
use crate::loader::{Epoch, EpochStats, HostBatch};
use crate::model::Metrics;
use crate::pagecache::{self, Residency};
use crate::telemetry::EpochOutcome;

use super::EpochRow;

/// Times one epoch of a loop of yours: the wait for each batch, your copies and your
/// step, the page-cache residency of the dataset at the start and the end, and the loss
/// and accuracy you record. [`finish`](EpochTimer::finish) gives the same
/// [`EpochRow`] as `stokehold train`'s, for a [`TrainReport`](super::TrainReport).
///
/// ```no_run
/// use stokehold::report::{EpochTimer, Setup, TrainReport};
/// use stokehold::{Dataset, Loader, NpyDataset};
/// # fn my_step(x: &[u8], y: &[i64]) -> (f64, u64) { (0.0, 0) }
/// # fn main() -> stokehold::Result<()> {
/// let ds = std::sync::Arc::new(NpyDataset::open("datasets/digits")?);
/// let mut loader = Loader::builder_shared(ds.clone()).batch_size(128).build()?;
/// let mut report = TrainReport::new("my model (cpu)", "datasets/digits", &loader);
/// report.setup = Setup::of_loader(&loader);
/// for epoch in 0..3 {
///     let mut timer = EpochTimer::new(loader.epoch(epoch)?, ds.as_ref())?;
///     while let Some(batch) = timer.next() {
///         let batch = batch?;
///         let (x, y) = (batch.column::<u8>(0)?, batch.column::<i64>(1)?);
///         let (loss_sum, correct) = timer.step(|| my_step(x, y));
///         timer.record(loss_sum, correct, batch.len() as u64);
///     }
///     report.push(timer.finish()?);
/// }
/// print!("{}{}", report.table(), report.warmup_text());
/// # Ok(())
/// # }
/// ```
pub struct EpochTimer<'a> {
    epoch: Epoch<'a>,
    dataset: &'a dyn Dataset,
    number: u64,
    start: Instant,
    residency_start: Residency,
    wait: Duration,
    copy: Duration,
    compute: Duration,
    metrics: Metrics,
    /// Bytes of a sample as the batches hold it (augmented, where the loader augments),
    /// from the first batch: the report's own measure.
    bytes_per_sample: Option<u64>,
}

impl<'a> EpochTimer<'a> {
    /// Starts timing `epoch`, a loader's epoch over `dataset` (whose files' residency is
    /// read now and at the end).
    ///
    /// # Errors
    /// The error of [`pagecache::residency`] on the dataset's mappings.
    pub fn new(epoch: Epoch<'a>, dataset: &'a dyn Dataset) -> Result<EpochTimer<'a>> {
        let scan = Instant::now();
        let residency_start = pagecache::residency(dataset)?;
        Ok(EpochTimer {
            number: epoch.epoch(),
            // From the epoch's own start (its workers may be at work already), on the
            // clock its first batch is measured on; the residency scan, the timer's own
            // work, left out.
            start: epoch.started() + scan.elapsed(),
            epoch,
            dataset,
            residency_start,
            wait: Duration::ZERO,
            copy: Duration::ZERO,
            compute: Duration::ZERO,
            metrics: Metrics::default(),
            bytes_per_sample: None,
        })
    }

    /// Runs `f` (your training step) and counts its time as compute.
    pub fn step<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        self.compute += t.elapsed();
        r
    }

    /// Runs `f` (your copy to a device, say) and counts its time as copy.
    pub fn copy<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        self.copy += t.elapsed();
        r
    }

    /// Adds a batch's summed loss, its correct predictions and its sample count. The
    /// row's loss is the mean over the recorded samples, its accuracy the share correct.
    pub fn record(&mut self, loss_sum: f64, correct: u64, samples: u64) {
        self.metrics.loss_sum += loss_sum;
        self.metrics.correct += correct;
        self.metrics.samples += samples;
    }

    /// Ends the epoch and returns its row. Batches not taken are dropped (their buffers
    /// go back to the loader). Time outside `step` and `copy` and the waits for batches
    /// shows in the warm-up split as unexplained.
    ///
    /// # Errors
    /// As [`new`](EpochTimer::new), for the residency at the end.
    pub fn finish(self) -> Result<EpochRow> {
        let wall = self.start.elapsed();
        let loader = self.epoch.stats();
        drop(self.epoch);
        let residency_end = pagecache::residency(self.dataset)?;
        let times = LoopTimes {
            wall,
            wait: self.wait,
            copy: self.copy,
            compute: self.compute,
            overlapped_copy: Duration::ZERO,
        };
        // No batch taken: the dataset's own row.
        let bytes_per_sample = self.bytes_per_sample.unwrap_or_else(|| {
            let columns = self.dataset.columns();
            columns.iter().map(|c| c.row_bytes as u64).sum()
        });
        Ok(EpochRow::of_loop(
            self.number,
            loader,
            self.metrics,
            times,
            bytes_per_sample,
            (self.residency_start, residency_end),
        ))
    }
}

/// What a training loop of yours measured over an epoch (see [`EpochRow::of_loop`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoopTimes {
    /// The epoch's wall time.
    pub wall: Duration,
    /// Time spent waiting for batches.
    pub wait: Duration,
    /// Time spent in your copies.
    pub copy: Duration,
    /// Time spent in your step.
    pub compute: Duration,
    /// Device time of copies that ran on a stream of their own, overlapped with the
    /// step (a [`DeviceSlots`](crate::cuda::DeviceSlots)'
    /// [`copy_time`](crate::cuda::DeviceSlots::copy_time) over the epoch): counted as
    /// copy time, but not as time the step stood idle for copies.
    pub overlapped_copy: Duration,
}

impl EpochRow {
    /// The row of an epoch that a loop of yours ran and timed, as [`EpochTimer`] does
    /// (or a loop in another language): the loader's `stats` at the epoch's end, the
    /// `metrics` recorded (with no samples recorded, the loader's count), the loop's
    /// `times`, the bytes of one sample, and the residency at the start and the end.
    pub fn of_loop(
        epoch: u64,
        stats: EpochStats,
        metrics: Metrics,
        times: LoopTimes,
        bytes_per_sample: u64,
        residency: (Residency, Residency),
    ) -> EpochRow {
        let mut out = EpochOutcome {
            metrics,
            batches: stats.batches,
            ..EpochOutcome::default()
        };
        if out.metrics.samples == 0 {
            out.metrics.samples = stats.samples;
        }
        out.close(stats, times.wall);
        out.stages.wait_data = times.wait;
        out.stages.copy = times.copy;
        out.stages.compute = times.compute;
        out.stages.in_series();
        out.stages.copy += times.overlapped_copy;
        EpochRow::new(epoch, &out, bytes_per_sample, residency)
    }
}

impl Iterator for EpochTimer<'_> {
    type Item = Result<HostBatch>;

    /// The next batch, timing the wait for it.
    fn next(&mut self) -> Option<Result<HostBatch>> {
        let t = Instant::now();
        let b = self.epoch.next();
        self.wait += t.elapsed();
        if let (None, Some(Ok(batch))) = (self.bytes_per_sample, &b) {
            self.bytes_per_sample = Some(batch.layout().data_bytes(1) as u64);
        }
        b
    }
}
