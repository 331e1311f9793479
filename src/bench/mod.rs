//! The loader against its roofline, measured in one run.
//!
//! The roofline ([`Roofline`]) is a bare random gather of the same rows, in the same
//! order, from the same mapping, through the same [`Dataset::gather`], into one reused
//! buffer per thread, on the same number of persistent threads. Whatever the loader adds (claiming batches, buffer
//! recycling, in-order delivery, waking the consumer) shows as the gap between the two.

pub mod gpu;
pub mod io;
mod roofline;
mod text;

pub use roofline::Roofline;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dataset::{Dataset, NpyDataset};
use crate::device::Device;
use crate::error::Result;
use crate::loader::{EpochStats, Loader, LoaderBuilder};
use crate::model::{fit_classifier, Normalize};
use crate::pagecache::{self, Residency};
use crate::sampler::{Order, Shard, Shuffle};

/// What to measure.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchConfig {
    /// Samples per batch.
    pub batch: usize,
    /// Loader workers, and roofline threads.
    pub workers: usize,
    /// Loader prefetch depth (`None`: the loader's default).
    pub prefetch: Option<usize>,
    /// Timed passes of each (after one untimed warm pass each).
    pub reps: usize,
    /// Shuffle seed.
    pub seed: u64,
    /// Also measure cold-cache epochs (evicting the files first).
    pub cold: bool,
    /// Only the cold epochs and the I/O roofline (`--only cold`).
    pub only_cold: bool,
    /// The loaders' page-cache budget (`None`: the loader's default).
    pub page_cache_budget: Option<u64>,
    /// Whether the loaders read streamed files with direct I/O
    /// ([`LoaderBuilder::direct_reads`](crate::LoaderBuilder::direct_reads)).
    pub direct_reads: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            batch: 256,
            workers: 2,
            prefetch: None,
            reps: 11,
            seed: 0,
            cold: true,
            only_cold: false,
            page_cache_budget: None,
            direct_reads: true,
        }
    }
}

/// Throughput over repeated passes.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Throughput {
    /// Median samples per second.
    pub samples_per_s: f64,
    /// Median gigabytes (1e9 bytes) of sample data per second.
    pub gb_per_s: f64,
    /// Seconds of each timed pass, in order.
    pub seconds: Vec<f64>,
    /// Median thread-time per batch spent gathering, in microseconds.
    pub gather_us_per_batch: f64,
    /// Median share of batches the consumer had to wait for (loader only).
    pub stalled_share: f64,
}

impl Throughput {
    fn from_runs(
        runs: &[Duration],
        gathers: &mut [f64],
        stalls: &mut [f64],
        samples: u64,
        bytes: u64,
    ) -> Throughput {
        gathers.sort_by(f64::total_cmp);
        stalls.sort_by(f64::total_cmp);
        let mut secs: Vec<f64> = runs.iter().map(Duration::as_secs_f64).collect();
        let seconds = secs.clone();
        secs.sort_by(f64::total_cmp);
        let median = secs[secs.len() / 2];
        Throughput {
            samples_per_s: samples as f64 / median,
            gb_per_s: bytes as f64 / median / 1e9,
            seconds,
            gather_us_per_batch: gathers[gathers.len() / 2],
            stalled_share: stalls.get(stalls.len() / 2).copied().unwrap_or(0.0),
        }
    }
}

/// One epoch from a cold page cache.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ColdEpoch {
    /// Epoch time, seconds.
    pub epoch_s: f64,
    /// Samples per second.
    pub samples_per_s: f64,
    /// Bytes the process read from storage during the epoch (`/proc/self/io`); `None`
    /// (JSON `null`) where the kernel does not say.
    pub bytes_read: Option<u64>,
    /// `bytes_read` over the sample bytes delivered; `None` with `bytes_read`.
    pub read_amplification: Option<f64>,
    /// What the loader's planner did: warming or streaming.
    pub storage: crate::loader::Storage,
    /// Residency of the dataset's files before the epoch (after eviction).
    pub residency_before: Residency,
    /// Residency after it.
    pub residency_after: Residency,
}

/// A cold epoch with each shuffle.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ColdEpochs {
    /// Full shuffle.
    pub full: ColdEpoch,
    /// Block shuffle.
    pub block: ColdEpoch,
}

/// The dataset measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DatasetInfo {
    /// Samples.
    pub samples: u64,
    /// Bytes per sample over all columns.
    pub row_bytes: usize,
    /// Bytes of the files.
    pub file_bytes: u64,
}

/// Everything `stokehold bench` measures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    /// The dataset.
    pub dataset: DatasetInfo,
    /// The configuration.
    pub config: BenchConfig,
    /// Logical CPUs of the machine.
    pub cpus: usize,
    /// The bare gather (absent with `--only cold`).
    pub roofline: Option<Throughput>,
    /// The loader (warm page cache, full shuffle).
    pub loader: Option<Throughput>,
    /// Loader throughput over roofline throughput: the median over timed repetitions of
    /// the ratio within each back-to-back pair (so drift on a shared machine cancels).
    pub ratio: Option<f64>,
    /// The per-pair ratios, in order.
    pub ratios: Vec<f64>,
    /// Cold-cache epochs.
    pub cold: Option<ColdEpochs>,
    /// What the storage under `x.npy` delivers with direct I/O (with cold epochs).
    pub io_roofline: Option<io::IoRoofline>,
    /// Why the I/O roofline is missing (a file system without direct I/O).
    pub io_roofline_skipped: Option<String>,
    /// Overlapped against serialised on the CPU backend.
    pub cpu_overlap: Option<CpuOverlap>,
    /// GPU figures, where a GPU was found.
    pub gpu: Option<gpu::GpuBench>,
    /// Why the GPU figures are missing.
    pub gpu_skipped: Option<String>,
}

/// Runs one epoch of `loader`, dropping each batch as it arrives; returns its wall time
/// and sample count.
///
/// # Errors
/// The first error the epoch yields.
pub fn loader_epoch(loader: &mut Loader, epoch: u64) -> Result<(Duration, EpochStats)> {
    let start = Instant::now();
    let mut it = loader.epoch(epoch)?;
    for batch in it.by_ref() {
        batch?;
    }
    Ok((start.elapsed(), it.stats()))
}

/// A loader over `dataset` as `cfg` asks (batch, workers, prefetch, page-cache budget,
/// direct reads): every loader the bench measures, CPU or GPU, starts from this one.
fn builder(dataset: &Arc<dyn Dataset>, cfg: &BenchConfig, shuffle: Shuffle) -> LoaderBuilder {
    let mut b = Loader::builder_shared(Arc::clone(dataset))
        .batch_size(cfg.batch)
        .workers(cfg.workers)
        .shuffle(shuffle)
        .direct_reads(cfg.direct_reads);
    if let Some(p) = cfg.prefetch {
        b = b.prefetch(p);
    }
    if let Some(budget) = cfg.page_cache_budget {
        b = b.page_cache_budget(budget);
    }
    b
}

fn build(dataset: &Arc<dyn Dataset>, cfg: &BenchConfig, shuffle: Shuffle) -> Result<Loader> {
    builder(dataset, cfg, shuffle).build()
}

/// Measures the loader against the roofline on a page-cached dataset (unless
/// `cfg.only_cold`), then (if asked) full against block shuffle from a cold cache, with
/// the I/O roofline of the storage.
///
/// # Errors
/// Any error of the dataset, the loader or the page-cache calls; [`Error::Config`] for
/// no timed pass (`reps` 0) where the page-cached comparison runs.
///
/// [`Error::Config`]: crate::Error::Config
pub fn run(dataset: Arc<dyn Dataset>, cfg: &BenchConfig) -> Result<BenchReport> {
    if cfg.reps == 0 && !cfg.only_cold {
        return Err(crate::Error::Config(
            "the bench needs at least one timed pass (reps >= 1)".into(),
        ));
    }
    let shuffle = Shuffle::Full { seed: cfg.seed };
    let mut loader = build(&dataset, cfg, shuffle)?;
    let order = Order::new(
        dataset.len(),
        shuffle,
        Shard::single(),
        cfg.batch as u64,
        false,
    )?;
    let layout = loader.layout().clone();
    let prefetch = loader.prefetch();
    let samples = order.samples();
    let row_bytes: usize = dataset.columns().iter().map(|c| c.row_bytes).sum();
    let bytes = samples * row_bytes as u64;
    let mut report = BenchReport {
        dataset: DatasetInfo {
            samples: dataset.len(),
            row_bytes,
            file_bytes: dataset.files().iter().map(|f| f.bytes().len() as u64).sum(),
        },
        config: BenchConfig {
            prefetch: Some(prefetch),
            ..cfg.clone()
        },
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        ratio: None,
        ratios: Vec::new(),
        roofline: None,
        loader: None,
        cold: None,
        io_roofline: None,
        io_roofline_skipped: None,
        cpu_overlap: None,
        gpu: None,
        gpu_skipped: None,
    };
    if !cfg.only_cold {
        pagecache::read_ahead(dataset.as_ref())?;
        // As many threads as the loader runs (its workers are capped at the batches of
        // an epoch): idle threads would each hold a batch buffer and count as gathering.
        let threads = loader.workers();
        let bare = Roofline::new(Arc::clone(&dataset), &layout, threads)?;
        let mut indices = Vec::with_capacity(samples as usize);
        let mut roof = Vec::new();
        let mut load = Vec::new();
        let (mut roof_gather, mut load_gather) = (Vec::new(), Vec::new());
        let mut stalls = Vec::new();
        let batches = order.batches() as f64;
        let mut batch = Vec::new();
        for rep in 0..=cfg.reps {
            let epoch = rep as u64;
            let e = order.epoch(epoch);
            indices.clear();
            for b in 0..e.batches() {
                e.batch(b, &mut batch);
                indices.extend_from_slice(&batch);
            }
            // Alternate the two so that drift on a shared machine hits both alike.
            let r = bare.pass(epoch, indices.as_slice().into())?;
            let (l, stats) = loader_epoch(&mut loader, epoch)?;
            debug_assert_eq!(stats.samples, samples);
            if rep > 0 {
                roof.push(r);
                load.push(l);
                // Every roofline thread gathers for the whole pass.
                roof_gather.push(r.as_secs_f64() * threads as f64 / batches * 1e6);
                load_gather.push(stats.gather.as_secs_f64() / batches * 1e6);
                stalls.push(stats.stalls as f64 / batches);
            }
        }
        let ratios: Vec<f64> = roof
            .iter()
            .zip(&load)
            .map(|(r, l)| r.as_secs_f64() / l.as_secs_f64())
            .collect();
        let mut sorted = ratios.clone();
        sorted.sort_by(f64::total_cmp);
        let ratio = sorted[sorted.len() / 2];
        let roofline = Throughput::from_runs(&roof, &mut roof_gather, &mut [], samples, bytes);
        let loader_tp = Throughput::from_runs(&load, &mut load_gather, &mut stalls, samples, bytes);
        drop((loader, bare));
        report.ratio = Some(ratio);
        report.ratios = ratios;
        report.roofline = Some(roofline);
        report.loader = Some(loader_tp);
    } else {
        drop(loader);
    }
    if cfg.cold || cfg.only_cold {
        let cold = |shuffle: Shuffle| -> Result<ColdEpoch> {
            let mut loader = build(&dataset, cfg, shuffle)?;
            pagecache::evict(dataset.as_ref())?;
            let before = pagecache::residency(dataset.as_ref())?;
            let (t, stats) = loader_epoch(&mut loader, 0)?;
            let after = pagecache::residency(dataset.as_ref())?;
            Ok(ColdEpoch {
                epoch_s: t.as_secs_f64(),
                samples_per_s: stats.samples as f64 / t.as_secs_f64(),
                bytes_read: stats.bytes_read,
                read_amplification: stats.read_amplification(row_bytes as u64),
                storage: stats.storage,
                residency_before: before,
                residency_after: after,
            })
        };
        // Each rate of the I/O roofline is measured just before and just after the
        // epoch it bounds (see `io`), on the largest file (x.npy: nearly all the bytes),
        // in reads of the widest row.
        let widest = dataset.columns().iter().map(|c| c.row_bytes).max();
        let largest = dataset.files().into_iter().max_by_key(|f| f.bytes().len());
        let probe = match (largest, widest) {
            (Some(f), Some(row)) => io::Probe::open(f.path(), row),
            _ => Err(crate::Error::Config("the dataset has no file".into())),
        };
        let rate = |random: bool| -> Option<Result<f64>> {
            let p = probe.as_ref().ok()?;
            Some(if random { p.random() } else { p.sequential() })
        };
        let random_before = rate(true);
        let full = cold(Shuffle::Full { seed: cfg.seed })?;
        let random_after = rate(true);
        let sequential_before = rate(false);
        let block = cold(Shuffle::block(cfg.seed))?;
        let sequential_after = rate(false);
        report.cold = Some(ColdEpochs { full, block });
        let passes = |a: Option<Result<f64>>, b| -> Result<Vec<f64>> {
            [a, b].into_iter().flatten().collect()
        };
        let random = passes(random_before, random_after);
        let sequential = passes(sequential_before, sequential_after);
        match (probe, sequential, random) {
            (Ok(p), Ok(s), Ok(r)) => report.io_roofline = Some(io::IoRoofline::of(&p, s, r)),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                report.io_roofline_skipped = Some(e.to_string())
            }
        }
        // Leave the set warm, as it was found, where it fits the page-cache budget (a
        // set larger than memory cannot be).
        let total: u64 = dataset.files().iter().map(|f| f.bytes().len() as u64).sum();
        let budget = cfg
            .page_cache_budget
            .unwrap_or_else(pagecache::default_budget);
        if total <= budget {
            pagecache::read_ahead(dataset.as_ref())?;
        }
    }
    Ok(report)
}

/// Overlapped against serialised on the CPU backend: the training step with copies on
/// their own thread, and the same step copying then computing on one thread. The hidden
/// width is chosen so that compute per batch is close to the gather per worker.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CpuOverlap {
    /// Hidden units used.
    pub hidden: usize,
    /// Best overlapped epoch, seconds.
    pub overlapped_s: f64,
    /// Best serialised epoch, seconds.
    pub serialised_s: f64,
    /// Gather time per worker in the overlapped epoch, seconds.
    pub gather_per_worker_s: f64,
    /// Copy time in the overlapped epoch, seconds.
    pub copy_s: f64,
    /// Compute time in the overlapped epoch, seconds.
    pub compute_s: f64,
    /// `serialised_s / overlapped_s`.
    pub speedup: f64,
    /// `overlapped_s / max(gather_per_worker_s, copy_s, compute_s)`.
    pub overlapped_vs_slowest: f64,
}

/// Measures [`CpuOverlap`] on `dataset` (column 0 `u8` inputs, column 1 `i64` labels
/// below `classes`), normalising inputs with `norm` (see
/// [`fit_classifier`]).
///
/// # Errors
/// Loader, dataset and step errors; [`Error::Config`](crate::Error::Config) for columns
/// the model cannot read.
pub fn overlap_cpu(
    dataset: Arc<dyn Dataset>,
    cfg: &BenchConfig,
    (norm, classes): (Normalize, usize),
) -> Result<CpuOverlap> {
    use crate::backend::Trainer;
    use crate::cpu::CpuTrainer;
    use crate::model::{Mlp, MlpConfig};

    let mut loader = build(&dataset, cfg, Shuffle::Full { seed: cfg.seed })?;
    let inputs = dataset.columns()[0].row_bytes;
    let layout = loader.layout().clone();
    let trainer = |hidden: usize| -> Result<CpuTrainer> {
        let mlp = Mlp::new(MlpConfig {
            inputs,
            hidden,
            classes,
            lr: 0.01,
            seed: 0,
        })?;
        CpuTrainer::new(mlp, norm, &layout, (0, 1), 3)
    };
    // The workers that ran (capped at the batches of an epoch), not those asked for.
    let workers = loader.workers().max(1) as f64;
    let mut hidden = 1;
    let mut epoch = 0;
    loop {
        let mut t = trainer(hidden)?;
        let out = t.train(&mut loader, epoch, &mut |_, _| {})?;
        epoch += 1;
        if out.stages.compute.as_secs_f64() >= out.stages.gather.as_secs_f64() / workers
            || hidden >= 1024
        {
            break;
        }
        hidden *= 2;
    }
    let mut t = trainer(hidden)?;
    let (mut best_over, mut best_ser) = (None::<crate::telemetry::EpochOutcome>, f64::INFINITY);
    for _ in 0..2 {
        t.set_serial(false)?;
        let o = t.train(&mut loader, epoch, &mut |_, _| {})?;
        t.set_serial(true)?;
        let s = t.train(&mut loader, epoch, &mut |_, _| {})?;
        epoch += 1;
        if best_over.as_ref().map_or(true, |b| o.wall < b.wall) {
            best_over = Some(o);
        }
        best_ser = best_ser.min(s.wall.as_secs_f64());
    }
    let o = best_over.expect("two runs");
    let gather = o.stages.gather.as_secs_f64() / workers;
    let slowest = gather
        .max(o.stages.copy.as_secs_f64())
        .max(o.stages.compute.as_secs_f64());
    Ok(CpuOverlap {
        hidden,
        overlapped_s: o.wall.as_secs_f64(),
        serialised_s: best_ser,
        gather_per_worker_s: gather,
        copy_s: o.stages.copy.as_secs_f64(),
        compute_s: o.stages.compute.as_secs_f64(),
        speedup: best_ser / o.wall.as_secs_f64(),
        overlapped_vs_slowest: o.wall.as_secs_f64() / slowest.max(1e-9),
    })
}

/// Everything `stokehold bench` measures on the classification set in `data` (`x.npy`
/// `u8` inputs, `y.npy` `i64` labels): the loader against its roofline, cold epochs,
/// the CPU backend's overlap, and the GPU figures where a GPU is usable (else the
/// reason). `log` hears what is being measured, a line at a time.
///
/// # Errors
/// Any error of the dataset, the loader, the page-cache calls or the backends.
pub fn measure(
    data: &std::path::Path,
    cfg: &BenchConfig,
    log: &mut dyn FnMut(&str),
) -> Result<BenchReport> {
    let ds = NpyDataset::open_xy(data)?;
    let fitted = fit_classifier(&ds)?;
    let ds: Arc<dyn Dataset> = Arc::new(ds);
    log(&format!(
        "bench: {} samples, batch {}, {} workers, prefetch {}, {} reps{}",
        ds.len(),
        cfg.batch,
        cfg.workers,
        cfg.prefetch.map_or("default".into(), |p| p.to_string()),
        cfg.reps,
        if cfg.cold { ", then cold epochs" } else { "" }
    ));
    let mut report = run(Arc::clone(&ds), cfg)?;
    if cfg.only_cold {
        return Ok(report);
    }
    report.cpu_overlap = Some(overlap_cpu(Arc::clone(&ds), cfg, fitted)?);
    match Device::auto() {
        Device::Cuda(c) => {
            log(&format!("bench: GPU figures on {}", c.name));
            let base = builder(&ds, cfg, Shuffle::Full { seed: cfg.seed });
            report.gpu = Some(gpu::run(&c, (base, cfg.workers), fitted)?);
        }
        Device::Cpu { reason } => report.gpu_skipped = reason,
    }
    Ok(report)
}
