//! The main job: train the MLP on a dataset for some epochs, timing everything.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::augment::Augment;
use crate::cuda::PinnedKind;
use crate::dataset::{Dataset, NpyDataset};
use crate::device::{Backend, DeviceChoice};
use crate::error::Result;
use crate::loader::Loader;
use crate::model::{fit_classifier, Mlp, MlpConfig};
use crate::pagecache;
use crate::report::{EpochProgress, EpochRow, Setup, TrainReport};
use crate::sampler::Shuffle;
use crate::telemetry::Trace;

/// A path in the report's JSON as text, whatever bytes it holds (a name that is not
/// UTF-8 gets replacement characters; serde's own `PathBuf` refuses it).
fn lossy<S: serde::Serializer>(path: &Path, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&path.to_string_lossy())
}

/// [`lossy`] for a path that may be absent.
fn lossy_some<S: serde::Serializer>(
    path: &Option<PathBuf>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    match path {
        Some(p) => s.serialize_some(&*p.to_string_lossy()),
        None => s.serialize_none(),
    }
}

/// What `stokehold train` runs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainConfig {
    /// Directory with `x.npy` (u8 inputs) and `y.npy` (i64 labels).
    #[serde(serialize_with = "lossy")]
    pub data: PathBuf,
    /// Epochs.
    pub epochs: u64,
    /// Samples per batch.
    pub batch: usize,
    /// Loader workers.
    pub workers: usize,
    /// Prefetch depth (`None`: the loader's default).
    pub prefetch: Option<usize>,
    /// Bytes of page cache the loader may fill (`None`: half the available memory, or of
    /// the memory cgroup's room where that is less).
    pub page_cache_budget: Option<u64>,
    /// Whether streamed files are read with direct I/O
    /// ([`LoaderBuilder::direct_reads`](crate::LoaderBuilder::direct_reads)).
    pub direct_reads: bool,
    /// Sample order.
    pub shuffle: Shuffle,
    /// Where the step runs.
    pub device: DeviceChoice,
    /// Hidden units.
    pub hidden: usize,
    /// Learning rate.
    pub lr: f32,
    /// Evict the dataset from the page cache before epoch 0.
    pub cold: bool,
    /// Pay the one-off costs (read-ahead of the files) before epoch 0.
    pub warmup: bool,
    /// Seed of the weights.
    pub seed: u64,
    /// Draw no progress bars.
    pub quiet: bool,
    /// Write a Chrome trace (a span per batch per stage per thread) here.
    #[serde(serialize_with = "lossy_some")]
    pub trace: Option<PathBuf>,
    /// On CUDA, keep the dataset on the device after epoch 0 when it fits under half of
    /// the free device memory.
    pub device_cache: bool,
    /// On CUDA, the kind of page-locked memory the loader's buffers are.
    pub pinned: PinnedKind,
    /// Pixels of padding of a random crop of `x`, drawn per sample (0: no crop): on
    /// CUDA on the device, after the copy or the gather from the device cache (which
    /// keeps the raw images); on the CPU in the loader's workers.
    pub crop: u32,
    /// Flip `x` left to right, for half the samples, where [`crop`](Self::crop) says.
    pub flip: bool,
}

impl TrainConfig {
    /// The augmentation of column `x` that [`crop`](Self::crop) and
    /// [`flip`](Self::flip) ask for (its images stay `uint8`), drawn from
    /// [`seed`](Self::seed); `None` for neither.
    pub fn augment(&self) -> Option<Augment> {
        (self.crop > 0 || self.flip)
            .then(|| Augment::new("x", self.seed).crop(self.crop).flip(self.flip))
    }
}

/// Trains as `config` says and reports every figure.
///
/// An epoch that fails ends the run without an `Err`: the report holds the epochs
/// before it, the set-up, and the error ([`TrainReport::error`]), and the trace is
/// finished, so that what was measured up to the failure is not lost.
///
/// # Errors
/// Anything the dataset, the loader, the backend or the step returns before the first
/// epoch; [`Error::Cuda`] when CUDA is asked for and not usable.
///
/// [`Error::Cuda`]: crate::Error::Cuda
pub fn run(config: &TrainConfig) -> Result<TrainReport> {
    if let Some(path) = &config.trace {
        crate::report::check_trace_output(path)?;
    }
    let backend = Backend::open(config.device)?;
    let mut setup = Setup {
        cuda_context_s: backend.context.as_secs_f64(),
        kernels_s: backend.kernels_load.as_secs_f64(),
        kernels_from_cache: backend.kernels_from_cache,
        ..Setup::default()
    };

    let t = Instant::now();
    let ds = NpyDataset::open_xy(&config.data)?;
    let (norm, classes) = fit_classifier(&ds)?;
    let inputs = ds.columns()[0].row_bytes;
    let ds: Arc<dyn Dataset> = Arc::new(ds);
    setup.dataset_open_s = t.elapsed().as_secs_f64();

    if config.cold {
        pagecache::evict(ds.as_ref())?;
    }
    let mut builder = Loader::builder_shared(Arc::clone(&ds))
        .batch_size(config.batch)
        .workers(config.workers)
        .shuffle(config.shuffle)
        .direct_reads(config.direct_reads);
    if let Some(p) = config.prefetch {
        builder = builder.prefetch(p);
    }
    if let Some(b) = config.page_cache_budget {
        builder = builder.page_cache_budget(b);
    }
    if let Some(alloc) = backend.allocator(config.pinned) {
        builder = builder.allocator(alloc);
    }
    // On CUDA the device augments: the loader gathers raw batches, and a device cache
    // keeps the raw images.
    let augment = config.augment();
    let on_device = augment.is_some() && backend.augments_on_device();
    if let Some(a) = augment.clone().filter(|_| !on_device) {
        builder = builder.augment(a);
    }
    let mut loader = builder.build()?;
    setup.pool_alloc_s = loader.startup().pool_alloc.as_secs_f64();
    setup.worker_start_s = loader.startup().threads.as_secs_f64();

    let mlp = Mlp::new(MlpConfig {
        inputs,
        hidden: config.hidden,
        classes,
        lr: config.lr,
        seed: config.seed,
    })?;
    let mut trainer = backend.trainer(mlp, norm, loader.layout(), (0, 1))?;
    if let Some(a) = augment.as_ref().filter(|_| on_device) {
        let augmenter = a.bind(loader.dataset().columns())?;
        setup.augment_kernel_s = trainer.augment_on_device(&augmenter)?.as_secs_f64();
    }
    if config.cold {
        // The probe above read a few pages back in; start truly cold.
        pagecache::evict(ds.as_ref())?;
    }
    if config.warmup {
        let t = Instant::now();
        loader.warmup()?;
        setup.warmup_s = t.elapsed().as_secs_f64();
        let launched = trainer.warm_up()?;
        // On the CPU there are no launches to time.
        if matches!(backend.device(), crate::device::Device::Cuda(_)) {
            setup.first_launch_s = Some(launched.as_secs_f64());
        }
    }
    let mut device_cache = None;
    if config.device_cache {
        device_cache = trainer.enable_device_cache(&loader, 0.5)?;
        if config.warmup {
            // The device cache filled up front, in large sequential copies: epoch 0 then
            // reads the device like the later ones.
            if let Some(d) = trainer.fill_device_cache(&loader)? {
                setup.device_cache_fill_s = d.as_secs_f64();
            }
        }
    }
    let trace = match &config.trace {
        Some(path) => Some(Arc::new(Trace::create(path)?)),
        None => None,
    };
    if let Some(tr) = &trace {
        trainer.set_trace(Arc::clone(tr));
    }

    let mut report = TrainReport::new(
        backend.device().name(),
        config.data.display().to_string(),
        &loader,
    );
    report.fallback_reason = backend.device().fallback_reason().map(str::to_string);
    report.device_cache_bytes = device_cache;
    report.augment_on = augment.map(|_| match on_device {
        true => "device".to_string(),
        false => "workers".to_string(),
    });
    report.config = serde_json::to_value(config)
        .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }));
    report.setup = setup;
    for epoch in 0..config.epochs {
        let (samples, bytes) = (report.samples, report.bytes_per_sample);
        let row = (|| -> Result<EpochRow> {
            let before = pagecache::residency(ds.as_ref())?;
            let mut bar = EpochProgress::new(epoch, samples, bytes, config.quiet);
            let out = trainer.train(&mut loader, epoch, &mut |n, stalled| {
                bar.advance(n, stalled)
            })?;
            bar.finish();
            let after = pagecache::residency(ds.as_ref())?;
            Ok(EpochRow::new(epoch, &out, bytes, (before, after)))
        })();
        match row {
            Ok(row) => report.push(row),
            Err(e) => {
                // The epochs before it, the setup and the trace are kept: they are what
                // tells why it failed.
                report.error = Some(format!("epoch {epoch}: {e}"));
                break;
            }
        }
    }
    if let Some(tr) = &trace {
        report.trace_error = tr.finish().err().map(|e| e.to_string());
    }
    Ok(report)
}

/// What `stokehold train` prints: the device (and why not CUDA), the data, the epoch
/// table and the warm-up split.
pub fn summary(report: &TrainReport, config: &TrainConfig) -> String {
    let mut s = format!("device: {}\n", report.device);
    if let Some(reason) = &report.fallback_reason {
        s += &format!("  (CPU backend: {reason})\n");
    }
    if let Some(bytes) = report.device_cache_bytes {
        s += &format!(
            "  device cache: {}, epochs after the first read from the GPU\n",
            crate::util::megabytes(bytes)
        );
    }
    s += &format!(
        "data: {} ({} samples of {} bytes), batch {}, {} workers, {:?} shuffle, hidden {}\n",
        report.data,
        report.samples,
        report.bytes_per_sample,
        config.batch,
        report.workers,
        config.shuffle,
        config.hidden
    );
    if config.augment().is_some() {
        let crop = match config.crop {
            0 => "no crop".to_string(),
            pad => format!("a random crop (padding {pad})"),
        };
        let flip = if config.flip { "a flip" } else { "no flip" };
        let place = match (report.augment_on.as_deref(), report.device_cache_bytes) {
            (Some("device"), Some(_)) => {
                "on the GPU, after the copy or the gather from the device cache (which keeps \
                 the raw images)"
            }
            (Some("device"), None) => "on the GPU, after the copy",
            _ => "in the loader's workers",
        };
        s += &format!("augment: x, {crop}, {flip}, drawn per sample {place}\n");
    }
    s.push('\n');
    s += &report.table();
    s.push('\n');
    s += &report.warmup_text();
    s
}
