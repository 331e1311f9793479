//! What an epoch of training produced: metrics, per-stage times, the loader's view.

use std::time::Duration;

use crate::loader::EpochStats;
use crate::model::Metrics;

/// Time spent per stage over one epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StageTimes {
    /// Worker time assembling batches (summed over workers).
    pub gather: Duration,
    /// Time the copy stage waited for the loader.
    pub wait_data: Duration,
    /// Time spent copying batches into device slots.
    pub copy: Duration,
    /// Time spent in the training step.
    pub compute: Duration,
    /// Time the compute stage waited for a filled slot.
    pub wait_copy: Duration,
    /// Time the training step stood idle for want of a batch from the loader: the share
    /// of the waits on the epoch's critical path (the step) that data caused. Where one
    /// thread waits, copies and steps in turn, `wait_data` itself.
    pub stall_data: Duration,
    /// Time the training step stood idle while its batch was being copied (on the
    /// critical path); where one thread copies and steps in turn, `copy` itself.
    pub stall_copy: Duration,
}

impl StageTimes {
    /// Sets the stalls of a pipeline run by one thread in series (wait, copy, step): each
    /// wait for data and each copy held the step up.
    pub fn in_series(&mut self) {
        self.stall_data = self.wait_data;
        self.stall_copy = self.copy;
    }
}

/// What one epoch of training produced.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct EpochOutcome {
    /// Loss and accuracy.
    pub metrics: Metrics,
    /// Per-stage time.
    pub stages: StageTimes,
    /// The loader's view of the epoch.
    pub loader: EpochStats,
    /// Wall time.
    pub wall: Duration,
    /// Batches trained on.
    pub batches: u64,
}

impl EpochOutcome {
    /// Closes the outcome of an epoch that took `wall`: the loader's statistics, and its
    /// gather time as the gather stage's.
    pub fn close(&mut self, loader: EpochStats, wall: Duration) {
        self.loader = loader;
        self.stages.gather = loader.gather;
        self.wall = wall;
    }
}

/// Called after each batch with its sample count and the [`stalled`] share so far.
pub type Progress<'a> = &'a mut dyn FnMut(u64, f64);

/// The share of `elapsed` the pipeline spent waiting for the loader: what every backend
/// reports as `stalled` to a progress callback, and what the `wait` column sums.
pub fn stalled(wait_data: Duration, elapsed: Duration) -> f64 {
    wait_data.as_secs_f64() / elapsed.as_secs_f64().max(1e-9)
}
