//! Epoch reports: per-epoch figures, the warm-up split, the human table and JSON.

mod inspect;
mod progress;
mod timer;

pub use inspect::inspect;
pub use progress::EpochProgress;
pub use timer::{EpochTimer, LoopTimes};

use crate::loader::{Loader, Storage};
use crate::pagecache::Residency;
use crate::telemetry::EpochOutcome;
use crate::util::megabytes;

/// Figures of one epoch.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EpochRow {
    /// The epoch number.
    pub epoch: u64,
    /// Wall time, seconds.
    pub wall_s: f64,
    /// Samples trained on.
    pub samples: u64,
    /// Samples per second.
    pub samples_per_s: f64,
    /// Sample data per second, GB (1e9 bytes).
    pub gb_per_s: f64,
    /// From the epoch's start to its first batch, seconds.
    pub first_batch_s: f64,
    /// Worker time assembling batches, summed over workers, seconds.
    pub gather_s: f64,
    /// Time the pipeline waited for the loader, seconds.
    pub wait_data_s: f64,
    /// Time copying batches to the device (or device slots), seconds.
    pub copy_s: f64,
    /// Time in the training step, seconds.
    pub compute_s: f64,
    /// Time the training step stood idle for want of a batch from the loader (the
    /// critical path's share of `wait_data_s`), seconds.
    pub stall_data_s: f64,
    /// Time the training step stood idle while its batch was copied, seconds.
    pub stall_copy_s: f64,
    /// Share of batches the pipeline had to wait for.
    pub stalled_share: f64,
    /// Page-cache residency of the dataset at the epoch's start.
    pub residency_start: Residency,
    /// And at its end.
    pub residency_end: Residency,
    /// Mean training loss.
    pub loss: f64,
    /// Training accuracy (predictions before each step's update).
    pub accuracy: f64,
    /// What storage did: `warm` (all resident at the start), `warming` (read in, the
    /// files fit the page-cache budget) or `streaming` (read as planned, dropped behind).
    pub storage: Storage,
    /// Bytes the process read from storage during the epoch (`/proc/self/io`); `None`
    /// (JSON `null`) where the kernel does not say.
    pub bytes_read: Option<u64>,
    /// `bytes_read` over the sample bytes delivered: 1.0 reads each byte used once;
    /// above 1, storage read bytes no batch used (whole pages, read-around). `None`
    /// with `bytes_read`.
    pub read_amplification: Option<f64>,
}

impl EpochRow {
    /// The row of an epoch's outcome.
    pub fn new(
        epoch: u64,
        out: &EpochOutcome,
        bytes_per_sample: u64,
        residency: (Residency, Residency),
    ) -> EpochRow {
        let wall = out.wall.as_secs_f64().max(1e-9);
        let samples = out.metrics.samples;
        EpochRow {
            epoch,
            wall_s: wall,
            samples,
            samples_per_s: samples as f64 / wall,
            gb_per_s: (samples * bytes_per_sample) as f64 / wall / 1e9,
            first_batch_s: out.loader.first_batch.unwrap_or_default().as_secs_f64(),
            gather_s: out.stages.gather.as_secs_f64(),
            wait_data_s: out.stages.wait_data.as_secs_f64(),
            copy_s: out.stages.copy.as_secs_f64(),
            compute_s: out.stages.compute.as_secs_f64(),
            stall_data_s: out.stages.stall_data.as_secs_f64(),
            stall_copy_s: out.stages.stall_copy.as_secs_f64(),
            stalled_share: out.loader.stalls as f64 / out.loader.batches.max(1) as f64,
            residency_start: residency.0,
            residency_end: residency.1,
            loss: out.metrics.loss(),
            accuracy: out.metrics.accuracy(),
            storage: out.loader.storage,
            bytes_read: out.loader.bytes_read,
            read_amplification: out.loader.read_amplification(bytes_per_sample),
        }
    }
}

/// One-off costs paid before the first epoch, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Setup {
    /// Creating the CUDA context (0 on the CPU).
    pub cuda_context_s: f64,
    /// Compiling kernels or loading them from the cache (0 on the CPU).
    pub kernels_s: f64,
    /// Whether the kernels came from the on-disk cache (`false`: NVRTC compiled them, and
    /// the cache was written for the next run).
    pub kernels_from_cache: bool,
    /// First launch of every kernel, with `--warmup` (lazy module loading); `None`
    /// where it was not measured apart (without `--warmup` the first launches happen in
    /// epoch 0, in its step time; on the CPU there are none).
    pub first_launch_s: Option<f64>,
    /// Allocating the loader's host-buffer pool.
    pub pool_alloc_s: f64,
    /// Starting the loader's worker threads.
    pub worker_start_s: f64,
    /// Opening and mapping the dataset (in `stokehold train`, with its scan of the
    /// labels for the classes and of a few hundred rows for the normalisation).
    pub dataset_open_s: f64,
    /// An explicit warm-up (`--warmup`), when asked for.
    pub warmup_s: f64,
    /// Filling the device cache from the files before epoch 0 (`--warmup` on CUDA with
    /// the device cache; 0 otherwise).
    pub device_cache_fill_s: f64,
    /// Compiling the augmentation kernel or loading it from the disk cache, when the
    /// device augments (0 otherwise).
    pub augment_kernel_s: f64,
}

/// Why the first epoch took longer than the steady ones, each cause measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Warmup {
    /// First epoch's wall time.
    pub first_s: f64,
    /// Wall time of the steady epoch (the later epoch of median wall time), scaled by
    /// `steady_scale`.
    pub steady_s: f64,
    /// What the steady epoch's figures are scaled by: 1.0, or, where the two epochs
    /// ran different sample counts (a resumed or stopped first epoch), the first's
    /// samples over the steady one's, so that they are compared per sample.
    pub steady_scale: f64,
    /// `first_s - steady_s`.
    pub excess_s: f64,
    /// `first_s / steady_s`: 1.0 when epoch 0 ran at steady speed.
    pub ratio: f64,
    /// Extra time the training step stood idle for data in the first epoch (cold page
    /// cache), over the steady epoch.
    pub cold_cache_s: f64,
    /// Bytes the first epoch read from storage beyond the steady epoch
    /// (`/proc/self/io`): what the cold cache cost in reads. `None` where either epoch's
    /// reads are not known.
    pub cold_read_bytes: Option<u64>,
    /// Extra time the loader's workers spent gathering in the first epoch over the steady
    /// epoch, summed over workers: mostly blocked on storage reads (page faults or
    /// direct reads) when the data was cold.
    pub cold_gather_s: f64,
    /// Extra time in the training step (first launches, cold caches).
    pub compute_s: f64,
    /// Extra time the step stood idle for copies.
    pub copy_s: f64,
    /// What is left: `excess_s` minus the causes above; the time the epoch spent outside
    /// the step and its two stalls, against the steady epoch's.
    pub unexplained_s: f64,
}

impl Warmup {
    /// The split of the first epoch against the steady epoch: the later epoch of median wall
    /// time (the upper median of an even count). Every cause is charged against that one
    /// epoch, so that the causes and what is left add up to the excess; `None` with
    /// fewer than two epochs.
    ///
    /// The causes are measured on the epoch's critical path, the training step: the time
    /// it stood idle for data (the cold cache), stepped, and stood idle for copies. A
    /// stage that overlaps the step (the workers' gathering, a copy of the next batch)
    /// costs wall time only through those stalls.
    pub fn of(rows: &[EpochRow]) -> Option<Warmup> {
        let (first, rest) = rows.split_first()?;
        if rest.is_empty() {
            return None;
        }
        let mut by_wall: Vec<&EpochRow> = rest.iter().collect();
        by_wall.sort_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
        let steady = by_wall[by_wall.len() / 2];
        // Epochs of other sample counts (a resumed first epoch, one a loop stopped
        // early) are compared per sample: the steady one's figures scaled to the first's.
        let scale = match (first.samples, steady.samples) {
            (a, b) if a == b || a == 0 || b == 0 => 1.0,
            (a, b) => a as f64 / b as f64,
        };
        let steady_s = steady.wall_s * scale;
        let excess = first.wall_s - steady_s;
        let cold = first.stall_data_s - steady.stall_data_s * scale;
        let cold_read_bytes = first
            .bytes_read
            .zip(steady.bytes_read)
            .map(|(first, steady)| first.saturating_sub((steady as f64 * scale) as u64));
        let cold_gather_s = first.gather_s - steady.gather_s * scale;
        let compute = first.compute_s - steady.compute_s * scale;
        let copy = first.stall_copy_s - steady.stall_copy_s * scale;
        Some(Warmup {
            first_s: first.wall_s,
            steady_s,
            steady_scale: scale,
            excess_s: excess,
            ratio: first.wall_s / steady_s.max(1e-12),
            cold_cache_s: cold,
            cold_read_bytes,
            cold_gather_s,
            compute_s: compute,
            copy_s: copy,
            unexplained_s: excess - cold - compute - copy,
        })
    }
}

/// Everything `stokehold train` measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TrainReport {
    /// The device the step ran on.
    pub device: String,
    /// Why not CUDA, when the CPU ran instead.
    pub fallback_reason: Option<String>,
    /// Bytes of the device cache, when the dataset was kept on the GPU after epoch 0.
    pub device_cache_bytes: Option<u64>,
    /// Where the images were augmented: `"device"` (after the copy, or the gather from
    /// the device cache) or `"workers"` (the loader's); `None` without augmentation.
    pub augment_on: Option<String>,
    /// The dataset directory.
    pub data: String,
    /// Samples one epoch delivers (this rank's shard, after `drop_last`): the job's and
    /// a loop of yours alike.
    pub samples: u64,
    /// Bytes per sample.
    pub bytes_per_sample: u64,
    /// Loader worker threads that ran (the request, capped at the batches of an epoch).
    pub workers: usize,
    /// Batches prefetched (the request or the default, capped at the batches of an epoch).
    pub prefetch: usize,
    /// Host buffers in the loader's pool.
    pub buffers: usize,
    /// Batch size, workers, prefetch (as asked for), shuffle, hidden units, learning rate.
    pub config: serde_json::Value,
    /// One-off costs before epoch 0.
    pub setup: Setup,
    /// Per-epoch figures.
    pub epochs: Vec<EpochRow>,
    /// The warm-up split, with two or more epochs.
    pub warmup: Option<Warmup>,
    /// The first epoch whose mean loss was not finite (the run diverged: the learning
    /// rate is too high), if any.
    pub diverged_at: Option<u64>,
    /// Why the `--trace` file could not be written (a full disk), if it could not: the
    /// run's figures survive it.
    pub trace_error: Option<String>,
    /// The error that ended the run before its last epoch (`"epoch 3: ..."`), if one
    /// did: the epochs before it are reported.
    pub error: Option<String>,
}

impl Setup {
    /// The loader's own one-off costs (pool allocation, worker start); the rest zero,
    /// for you to fill in.
    pub fn of_loader(loader: &Loader) -> Setup {
        let s = loader.startup();
        Setup {
            pool_alloc_s: s.pool_alloc.as_secs_f64(),
            worker_start_s: s.threads.as_secs_f64(),
            ..Setup::default()
        }
    }
}

impl TrainReport {
    /// An empty report for epochs of `loader` over the data found at `data`, running on
    /// `device` (any name: it is printed as given). Add epochs with
    /// [`push`](TrainReport::push); see [`EpochTimer`].
    pub fn new(device: impl Into<String>, data: impl Into<String>, loader: &Loader) -> TrainReport {
        TrainReport {
            device: device.into(),
            fallback_reason: None,
            device_cache_bytes: None,
            augment_on: None,
            data: data.into(),
            samples: loader.order().samples(),
            bytes_per_sample: loader.layout().data_bytes(1) as u64,
            workers: loader.workers(),
            prefetch: loader.prefetch(),
            buffers: loader.buffers(),
            config: serde_json::Value::Null,
            setup: Setup::default(),
            epochs: Vec::new(),
            warmup: None,
            diverged_at: None,
            trace_error: None,
            error: None,
        }
    }

    /// Adds an epoch's row and updates the warm-up split.
    pub fn push(&mut self, row: EpochRow) {
        if !row.loss.is_finite() && self.diverged_at.is_none() {
            self.diverged_at = Some(row.epoch);
        }
        self.epochs.push(row);
        self.warmup = Warmup::of(&self.epochs);
    }

    /// The epoch table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{:>5} {:>7} {:>10} {:>6} {:>7} {:>7} {:>7} {:>7} {:>8} {:>9} {:>9} {:>8} {:>7} {:>6}\n",
            "epoch",
            "wall s",
            "samples/s",
            "GB/s",
            "first",
            "gather",
            "wait",
            "copy",
            "compute",
            "resident",
            "storage",
            "read MB",
            "loss",
            "acc"
        );
        for r in &self.epochs {
            s += &format!(
                "{:>5} {:>7.2} {:>10.0} {:>6.2} {:>6.3}s {:>6.2}s {:>6.2}s {:>6.2}s {:>7.2}s {:>4}>{:<4} {:>9} {:>8} {:>7.4} {:>5.1}%\n",
                r.epoch,
                r.wall_s,
                r.samples_per_s,
                r.gb_per_s,
                r.first_batch_s,
                r.gather_s,
                r.wait_data_s,
                r.copy_s,
                r.compute_s,
                r.residency_start,
                r.residency_end,
                r.storage.name(),
                r.bytes_read
                    .map_or_else(|| "?".to_string(), |b| format!("{:.1}", b as f64 / 1e6)),
                r.loss,
                100.0 * r.accuracy
            );
        }
        s
    }

    /// The warm-up explanation.
    pub fn warmup_text(&self) -> String {
        let st = &self.setup;
        let mut s = format!(
            "setup before epoch 0: dataset open {:.3} s, pool allocation {:.3} s, worker start {:.4} s",
            st.dataset_open_s, st.pool_alloc_s, st.worker_start_s
        );
        if st.cuda_context_s > 0.0 || st.kernels_s > 0.0 {
            s += &format!(
                ", CUDA context {:.3} s, kernels {:.3} s ({}), first launches {}",
                st.cuda_context_s,
                st.kernels_s,
                if st.kernels_from_cache {
                    "from the disk cache"
                } else {
                    "compiled"
                },
                match st.first_launch_s {
                    Some(t) => format!("{t:.3} s"),
                    None => "in epoch 0 (--warmup times them apart)".to_string(),
                }
            );
        }
        if st.augment_kernel_s > 0.0 {
            s += &format!(", augment kernel {:.3} s", st.augment_kernel_s);
        }
        if st.warmup_s > 0.0 {
            s += &format!(", explicit warm-up {:.3} s", st.warmup_s);
        }
        if st.device_cache_fill_s > 0.0 {
            s += &format!(", device cache filled {:.3} s", st.device_cache_fill_s);
        }
        s.push('\n');
        if let Some(e) = self.diverged_at {
            s += &format!(
                "the loss is not finite from epoch {e} on: the run diverged (lower the learning rate)\n"
            );
        }
        let Some(w) = &self.warmup else {
            s += match self.epochs.len() {
                0 => "no epochs run\n",
                _ => "one epoch only: no steady epochs to compare the first with\n",
            };
            return s;
        };
        let first = &self.epochs[0];
        s += &format!(
            "epoch {} took {:.3} s against a steady {:.3} s (the later epoch of median time): {:+.3} s, {:.2}x\n",
            first.epoch, w.first_s, w.steady_s, w.excess_s, w.ratio
        );
        if w.steady_scale != 1.0 {
            s += &format!(
                "  (per sample: epoch {} ran {} samples, so the steady epoch's figures are scaled by {:.3})\n",
                first.epoch, first.samples, w.steady_scale
            );
        }
        s += &format!(
            "  cold page cache (step idle for data): {:+.3} s  (resident {} -> {}, {}",
            w.cold_cache_s,
            first.residency_start,
            first.residency_end,
            first.storage.name(),
        );
        if let (Some(cold), Some(amplification)) = (w.cold_read_bytes, first.read_amplification) {
            if cold > 0 {
                s += &format!(
                    ": {} more read from storage than a steady epoch, {:.2}x the rows; \
                     the workers gathered {:+.3} s longer, blocked on those reads",
                    megabytes(cold),
                    amplification,
                    w.cold_gather_s
                );
            }
        }
        s += ")\n";
        s += &format!(
            "  slower training step:                {:+.3} s\n",
            w.compute_s
        );
        s += &format!(
            "  step idle for copies:                {:+.3} s\n",
            w.copy_s
        );
        s += &format!(
            "  unexplained:                          {:+.3} s\n",
            w.unexplained_s
        );
        match self.device_cache_bytes {
            Some(bytes) if self.setup.device_cache_fill_s > 0.0 => {
                s += &format!(
                    "  (every epoch read a {} device cache, filled before epoch 0 in {:.3} s)\n",
                    megabytes(bytes),
                    self.setup.device_cache_fill_s
                );
            }
            Some(bytes) => {
                s += &format!(
                    "  (epochs after the first read a {} device cache: they skip host \
                     gathering and copies, so part of the excess is work the cache removed)\n",
                    megabytes(bytes)
                );
            }
            None => {}
        }
        s
    }
}

/// Checks, before a long run, that its output file can be written at `path` (see
/// [`write_json`]): the directory exists and takes a new file, or `path` is a stream
/// (`/dev/stdout`, a FIFO) that the JSON is written to in place.
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) naming `path`.
pub fn check_output(path: &std::path::Path) -> crate::Result<()> {
    crate::util::check_writable(path, true)
}

/// Whether outputs `a` and `b` name one file: the same directory (however spelt) and
/// name, once their symbolic links are followed. Two outputs given one path would
/// replace each other.
pub fn same_output(a: &std::path::Path, b: &std::path::Path) -> bool {
    // A descriptor (`/dev/stdout`) and a file are one output where the descriptor has
    // that file open (`--json /dev/stdout > run.json`): the same device and inode.
    if let (Some(_), _) | (_, Some(_)) = (crate::util::descriptor(a), crate::util::descriptor(b)) {
        use std::os::unix::fs::MetadataExt;
        let id = |p: &std::path::Path| {
            let m = std::fs::metadata(crate::util::destination(p)).ok()?;
            Some((m.dev(), m.ino()))
        };
        return matches!((id(a), id(b)), (Some(x), Some(y)) if x == y);
    }
    let key = |p: &std::path::Path| {
        let p = crate::util::destination(p);
        let dir = crate::partial::directory(&p).to_path_buf();
        let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
        (dir, p.file_name().map(|n| n.to_owned()))
    };
    key(a) == key(b)
}

/// Checks, before a long run, that a trace can be written at `path`
/// ([`Trace::create`](crate::telemetry::Trace::create)): as [`check_output`], but a
/// regular file (a trace is streamed to a file beside it and renamed into place).
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) naming `path`.
pub fn check_trace_output(path: &std::path::Path) -> crate::Result<()> {
    crate::util::check_writable(path, false)
}

/// Writes `value` as pretty JSON to `path`, whole or not at all: into a temporary file
/// beside it, renamed over it once written and synced.
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) naming the file.
pub fn write_json(path: &std::path::Path, value: &impl serde::Serialize) -> crate::Result<()> {
    let text = serde_json::to_string_pretty(value).expect("reports serialise") + "\n";
    crate::util::write_whole(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::{EpochRow, Warmup};
    use crate::pagecache::Residency;

    /// A row whose step stood idle for `stall_data_s` and `stall_copy_s`; the copier's
    /// own waits and copies are twice those (they overlap the step, and must not count).
    fn row(
        epoch: u64,
        wall_s: f64,
        stall_data_s: f64,
        compute_s: f64,
        stall_copy_s: f64,
    ) -> EpochRow {
        EpochRow {
            epoch,
            wall_s,
            samples: 100,
            samples_per_s: 100.0 / wall_s,
            gb_per_s: 0.0,
            first_batch_s: 0.0,
            gather_s: 0.0,
            wait_data_s: 2.0 * stall_data_s,
            copy_s: 2.0 * stall_copy_s,
            compute_s,
            stall_data_s,
            stall_copy_s,
            stalled_share: 0.0,
            residency_start: Residency::default(),
            residency_end: Residency::default(),
            loss: 0.0,
            accuracy: 0.0,
            storage: crate::loader::Storage::Warm,
            bytes_read: Some(0),
            read_amplification: Some(0.0),
        }
    }

    #[test]
    fn the_warmup_split_charges_each_cause_against_the_median_later_epoch() {
        // Epoch 0's step stood idle 0.3 s more for data, computed 0.1 s more and stood
        // idle 0.05 s more for copies than in the later epoch of median time (epoch 2,
        // whose causes count even where another epoch's are lower; epoch 3 is an outlier
        // that must not count).
        let rows = [
            row(0, 1.5, 0.4, 0.6, 0.15),
            row(1, 0.9, 0.05, 0.45, 0.05),
            row(2, 1.0, 0.1, 0.5, 0.1),
            row(3, 9.0, 5.0, 0.4, 0.0),
        ];
        let w = Warmup::of(&rows).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert_eq!((w.first_s, w.steady_s), (1.5, 1.0));
        assert!(close(w.ratio, 1.5), "{w:?}");
        assert!(close(w.cold_cache_s, 0.3), "{w:?}");
        assert!(close(w.compute_s, 0.1), "{w:?}");
        assert!(close(w.copy_s, 0.05), "{w:?}");
        assert!(close(w.unexplained_s, 0.05), "{w:?}");
        assert!(
            Warmup::of(&rows[..1]).is_none(),
            "one epoch has nothing to compare with"
        );
    }

    #[test]
    fn a_first_epoch_of_other_samples_is_compared_per_sample() {
        // A resumed first epoch ran 25 of the 100 samples at the steady epochs' speed: no
        // excess, where a comparison of wall times would find it 0.75 s "faster".
        let mut first = row(3, 0.25, 0.025, 0.125, 0.025);
        first.samples = 25;
        let rows = [
            first,
            row(4, 1.0, 0.1, 0.5, 0.1),
            row(5, 1.0, 0.1, 0.5, 0.1),
        ];
        let w = Warmup::of(&rows).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(w.steady_scale, 0.25), "{w:?}");
        assert!(close(w.steady_s, 0.25) && close(w.ratio, 1.0), "{w:?}");
        for part in [
            w.excess_s,
            w.cold_cache_s,
            w.compute_s,
            w.copy_s,
            w.unexplained_s,
        ] {
            assert!(close(part, 0.0), "{w:?}");
        }
        let report = super::TrainReport {
            epochs: rows.to_vec(),
            warmup: Some(w),
            ..Default::default()
        };
        let text = report.warmup_text();
        assert!(
            text.contains("per sample: epoch 3 ran 25 samples"),
            "{text}"
        );
    }

    #[test]
    fn reads_the_kernel_does_not_count_are_unknown_not_zero() {
        // Where /proc/self/io is missing, an epoch's reads are `None`: the JSON says
        // null, the table "?", and the split compares no reads.
        let mut first = row(0, 2.0, 1.0, 0.5, 0.0);
        first.bytes_read = None;
        first.read_amplification = None;
        let mut steady = row(1, 1.0, 0.0, 0.5, 0.0);
        steady.bytes_read = Some(1000);
        let w = Warmup::of(&[first.clone(), steady.clone()]).unwrap();
        assert_eq!(w.cold_read_bytes, None);
        let report = super::TrainReport {
            epochs: vec![first.clone(), steady.clone()],
            warmup: Some(w),
            ..Default::default()
        };
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["epochs"][0]["bytes_read"].is_null(), "{json}");
        assert!(json["epochs"][0]["read_amplification"].is_null(), "{json}");
        assert!(json["warmup"]["cold_read_bytes"].is_null(), "{json}");
        assert_eq!(json["epochs"][1]["bytes_read"], 1000);
        let table = report.table();
        let line = table.lines().nth(1).unwrap();
        assert!(line.contains(" ? "), "{table}");
        assert!(!report.warmup_text().contains("more read from storage"));
        // Counted on both sides, the extra reads are told.
        first.bytes_read = Some(5_000_000);
        first.read_amplification = Some(1.25);
        let w = Warmup::of(&[first, steady]).unwrap();
        assert_eq!(w.cold_read_bytes, Some(4_999_000));
    }

    #[test]
    fn residency_is_rounded_down() {
        let r = |resident, pages, unknown| Residency {
            resident,
            pages,
            unknown,
        };
        assert_eq!(r(999, 1000, 0).to_string(), "99%");
        assert_eq!(r(1000, 1000, 0).to_string(), "100%");
        assert_eq!(r(0, 0, 0).to_string(), "100%");
        // Pages whose residency the kernel would not tell are not shown as cached.
        assert_eq!(r(0, 1000, 1000).to_string(), "?");
        assert_eq!(r(500, 1000, 400).to_string(), "50%?");
    }
}
