//! The interface both backends implement, so that the training job and the benchmarks
//! drive the CPU and the GPU alike.

use std::sync::Arc;
use std::time::Duration;

use crate::augment::Augmenter;
use crate::dataset::DType;
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, Loader};
use crate::model::Mlp;
use crate::telemetry::{EpochOutcome, Progress, Trace};

/// The training step of a backend, fed epoch by epoch.
///
/// Both implementations ([`CpuTrainer`](crate::cpu::CpuTrainer),
/// [`CudaTrainer`](crate::cuda::CudaTrainer)) run the same model from the same weights,
/// report the same [`EpochOutcome`] fields, the same `stalled` share to `progress`
/// (see [`stalled`](crate::telemetry::stalled)) and the same [`Error::Label`] for a label
/// outside the classes.
pub trait Trainer {
    /// Trains epoch `epoch`: from the device cache when it holds the data (the loader is
    /// not touched then), else from the batches of the loader `from`, copies overlapped
    /// with the step. `progress(samples, stalled)` follows each batch.
    ///
    /// # Errors
    /// The loader's first error, the step's (a bad label: [`Error::Label`]), or a device
    /// error; the epoch stops there and the loader's workers are stopped.
    fn train(&mut self, from: &mut Loader, epoch: u64, progress: Progress) -> Result<EpochOutcome>;

    /// Records a span per batch per stage into `trace` from now on.
    fn set_trace(&mut self, trace: Arc<Trace>);

    /// Serialised mode, the baseline of the overlap benchmark: each batch's copy and step
    /// run one after the other.
    ///
    /// # Errors
    /// [`Error::Cuda`] if a stream cannot be made.
    fn set_serial(&mut self, serial: bool) -> Result<()>;

    /// The model's current weights, on the host.
    ///
    /// # Errors
    /// [`Error::Cuda`] if reading them back from the device fails.
    fn weights(&self) -> Result<Mlp>;

    /// Pays the backend's first-use costs (the first launch of every kernel) now;
    /// returns how long that took (zero where there is none).
    ///
    /// # Errors
    /// [`Error::Cuda`] if a launch fails.
    fn warm_up(&mut self) -> Result<Duration>;

    /// Augments each batch on the device, after its copy or its gather from the device
    /// cache and before the step, drawn per sample from `(seed, epoch, sample)` as the
    /// loader's workers draw ([`LoaderBuilder::augment`](crate::LoaderBuilder::augment)):
    /// the loader gathers raw batches, and a device cache keeps the raw images, each
    /// epoch augmented anew. Returns how long compiling or loading its kernel took.
    ///
    /// # Errors
    /// [`Error::Config`] where the backend cannot (the CPU's augments in the loader's
    /// workers), for an augmenter bound to other columns than the batches', or for
    /// augmented columns the model cannot read; [`Error::Cuda`] for the kernel's
    /// compilation or a driver error.
    fn augment_on_device(&mut self, augmenter: &Augmenter) -> Result<Duration> {
        let _ = augmenter;
        Err(Error::Config(
            "this backend augments in the loader's workers (LoaderBuilder::augment)".into(),
        ))
    }

    /// Keeps the dataset of `loader` in device memory if it fits under `share` of the
    /// free device memory, one epoch covers every row and the loader does not augment
    /// (an augmented epoch differs from the last: a cache would replay epoch 0's draws;
    /// [`augment_on_device`](Trainer::augment_on_device) augments the cached batches
    /// instead); returns its size in bytes, or `None` where that does not apply
    /// (always, on the CPU).
    ///
    /// # Errors
    /// [`Error::Cuda`] if the allocation fails.
    fn enable_device_cache(&mut self, loader: &Loader, share: f64) -> Result<Option<u64>> {
        let _ = (loader, share);
        Ok(None)
    }

    /// Fills the device cache from `loader`'s dataset before the first epoch, in large
    /// copies; returns how long it took, or `None` when there is no device cache.
    ///
    /// # Errors
    /// The dataset's error or a device error.
    fn fill_device_cache(&mut self, loader: &Loader) -> Result<Option<Duration>> {
        let _ = loader;
        Ok(None)
    }
}

/// Checks that `x` holds `u8` rows of the model's `inputs` bytes and `y` one `i64`: the
/// columns both backends' steps read.
///
/// # Errors
/// [`Error::Config`] naming the column and what it holds.
pub(crate) fn check_columns(
    inputs: usize,
    layout: &BatchLayout,
    (x, y): (usize, usize),
) -> Result<()> {
    let cols = layout.columns();
    let (Some(xc), Some(yc)) = (cols.get(x), cols.get(y)) else {
        return Err(Error::Config(format!(
            "the model reads columns {x} and {y}, the dataset has {}",
            cols.len()
        )));
    };
    if xc.dtype != DType::U8 || xc.row_bytes != inputs {
        return Err(Error::Config(format!(
            "column {} must hold {inputs} uint8 values per sample, it holds {} {}",
            xc.name,
            xc.row_bytes / xc.dtype.size(),
            xc.dtype
        )));
    }
    if yc.dtype != DType::I64 || yc.row_bytes != 8 {
        return Err(Error::Config(format!(
            "column {} must hold one int64 label per sample",
            yc.name
        )));
    }
    Ok(())
}
