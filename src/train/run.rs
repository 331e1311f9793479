//! The main job: train the MLP on a dataset for some epochs, timing everything.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::cpu::CpuTrainer;
use crate::cuda::{CudaTrainer, KernelOrigin, Kernels, PinnedAlloc, PinnedKind};
use crate::dataset::{Dataset, NpyDataset};
use crate::device::{Device, DeviceChoice};
use crate::error::{Error, Result};
use crate::loader::Loader;
use crate::pagecache;
use crate::report::{EpochProgress, EpochRow, Setup, Trace, TrainReport, Warmup};
use crate::sampler::Shuffle;
use crate::train::{Mlp, MlpConfig, Normalize};

/// The trainer of either backend.
enum Backend {
    Cpu(Box<CpuTrainer>),
    Cuda(Box<CudaTrainer>),
}

/// What `stokehold train` runs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainConfig {
    /// Directory with `x.npy` (u8 inputs) and `y.npy` (i64 labels).
    pub data: PathBuf,
    /// Epochs.
    pub epochs: u64,
    /// Samples per batch.
    pub batch: usize,
    /// Loader workers.
    pub workers: usize,
    /// Prefetch depth (`None`: the loader's default).
    pub prefetch: Option<usize>,
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
    pub trace: Option<PathBuf>,
    /// On CUDA, keep the dataset on the device after epoch 0 when it fits under half of
    /// the free device memory.
    pub device_cache: bool,
    /// On CUDA, the kind of page-locked memory the loader's buffers are.
    pub pinned: PinnedKind,
}

/// What a classifier over `ds` needs from the data: the input normalisation (from the
/// first 512 samples of column 0) and the number of classes (largest label of column 1,
/// read straight from its file, plus one).
///
/// # Errors
/// [`Error::Dataset`] naming the file when there is no `int64` label column or a label
/// is negative.
pub fn fit_classifier(ds: &NpyDataset) -> Result<(Normalize, usize)> {
    let (inputs, labels) = match ds.arrays() {
        [x, y, ..] => (x, y),
        [x] => {
            return Err(Error::dataset(
                x.path(),
                "needs a second column of labels (y.npy)",
            ))
        }
        [] => return Err(Error::Config("a dataset needs at least one column".into())),
    };
    if labels.dtype() != crate::DType::I64 || labels.row_bytes() != 8 {
        return Err(Error::dataset(
            labels.path(),
            "labels must be one int64 per sample",
        ));
    }
    let max = labels
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
        .try_fold(0i64, |m, l| if l < 0 { Err(l) } else { Ok(m.max(l)) })
        .map_err(|l| Error::dataset(labels.path(), format!("negative label {l}")))?;
    let sample = inputs.rows().min(512) as usize * inputs.row_bytes();
    Ok((
        Normalize::fit(&inputs.data()[..sample]),
        (max + 1).max(2) as usize,
    ))
}

/// Trains as `config` says and reports every figure.
///
/// # Errors
/// Anything the dataset, the loader, the backend or the step returns; [`Error::Cuda`]
/// when CUDA is asked for and not usable.
pub fn run(config: &TrainConfig) -> Result<TrainReport> {
    let mut setup = Setup::default();
    let (device, kernels) = match Device::select(config.device)? {
        Device::Cuda(c) => {
            setup.cuda_context_s = c.context_time.as_secs_f64();
            let t = Instant::now();
            match Kernels::load(&c) {
                Ok(k) => {
                    setup.kernels_s = t.elapsed().as_secs_f64();
                    setup.kernels_from_cache = matches!(k.origin, KernelOrigin::Cached { .. });
                    (Device::Cuda(c), Some(k))
                }
                // With --device auto, kernels the driver cannot load (an NVRTC newer than
                // the driver, say) mean the CPU, with the reason.
                Err(e) if config.device == DeviceChoice::Auto => {
                    setup.cuda_context_s = 0.0;
                    let reason = format!("{} is there, but its kernels are not: {e}", c.name);
                    (
                        Device::Cpu {
                            reason: Some(reason),
                        },
                        None,
                    )
                }
                Err(e) => return Err(e),
            }
        }
        cpu => (cpu, None),
    };
    let fallback_reason = device.fallback_reason().map(str::to_string);
    let device_name = device.name();

    let t = Instant::now();
    let ds = NpyDataset::open(&config.data)?;
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
        .shuffle(config.shuffle);
    if let Some(p) = config.prefetch {
        builder = builder.prefetch(p);
    }
    if let Device::Cuda(c) = &device {
        builder = builder.allocator(Arc::new(PinnedAlloc::new(
            Arc::clone(&c.ctx),
            config.pinned,
        )));
    }
    let mut loader = builder.build()?;
    let samples_per_epoch = loader.order().samples();
    setup.pool_alloc_s = loader.startup().pool_alloc.as_secs_f64();
    setup.worker_start_s = loader.startup().threads.as_secs_f64();

    let mlp = Mlp::new(MlpConfig {
        inputs,
        hidden: config.hidden,
        classes,
        lr: config.lr,
        seed: config.seed,
    })?;
    let mut trainer = match (&device, kernels) {
        (Device::Cuda(c), Some(k)) => Backend::Cuda(Box::new(CudaTrainer::new(
            c.clone(),
            k,
            &mlp,
            norm,
            loader.layout(),
            (0, 1),
            4,
        )?)),
        _ => Backend::Cpu(Box::new(CpuTrainer::new(
            mlp,
            norm,
            loader.layout(),
            (0, 1),
            3,
        )?)),
    };
    if config.cold {
        // The probe above read a few pages back in; start truly cold.
        pagecache::evict(ds.as_ref())?;
    }
    if config.warmup {
        let t = Instant::now();
        loader.warmup()?;
        setup.warmup_s = t.elapsed().as_secs_f64();
        if let Backend::Cuda(t) = &trainer {
            setup.first_launch_s = t.warm_up()?.as_secs_f64();
        }
    }
    let mut device_cache = None;
    if let (true, Backend::Cuda(t)) = (config.device_cache, &mut trainer) {
        device_cache = t.enable_device_cache(loader.order(), 0.5)?;
        if config.warmup {
            // The device cache filled up front, in large sequential copies: epoch 0 then
            // reads the device like the later ones.
            if let Some(d) = t.fill_device_cache(ds.as_ref(), loader.order())? {
                setup.device_cache_fill_s = d.as_secs_f64();
            }
        }
    }
    let trace = config.trace.as_ref().map(|_| Arc::new(Trace::new()));
    match (&trace, &mut trainer) {
        (Some(tr), Backend::Cpu(t)) => t.set_trace(Arc::clone(tr)),
        (Some(tr), Backend::Cuda(t)) => t.set_trace(Arc::clone(tr)),
        (None, _) => {}
    }

    let bytes_per_sample: u64 = ds.columns().iter().map(|c| c.row_bytes as u64).sum();
    let samples = samples_per_epoch;
    let mut rows = Vec::new();
    for epoch in 0..config.epochs {
        let before = pagecache::residency(ds.as_ref())?;
        let mut bar = EpochProgress::new(epoch, samples, bytes_per_sample, config.quiet);
        let mut advance = |n, stalled| bar.advance(n, stalled);
        let out = match &mut trainer {
            Backend::Cpu(t) => t.train_epoch_with(loader.epoch(epoch)?, &mut advance)?,
            Backend::Cuda(t) if t.cache_filled() => {
                t.train_epoch_cached(&loader.order().epoch(epoch), &mut advance)?
            }
            Backend::Cuda(t) => t.train_epoch_with(loader.epoch(epoch)?, &mut advance)?,
        };
        bar.finish();
        let after = pagecache::residency(ds.as_ref())?;
        rows.push(EpochRow::new(
            epoch,
            &out,
            bytes_per_sample,
            (before, after),
        ));
    }
    if let (Some(tr), Some(path)) = (&trace, &config.trace) {
        tr.write(path)?;
    }
    Ok(TrainReport {
        device_cache_bytes: device_cache,
        device: device_name,
        fallback_reason,
        data: config.data.display().to_string(),
        samples,
        bytes_per_sample,
        config: serde_json::to_value(config).expect("the config serialises"),
        setup,
        warmup: Warmup::of(&rows),
        epochs: rows,
    })
}
