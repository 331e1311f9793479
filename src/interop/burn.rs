//! Batches as [burn](https://burn.dev) tensor data, and a burn `DataLoader` (feature
//! `burn`, burn 0.22).
//!
//! - [`Batch::data`] turns a column into a `burn::tensor::TensorData` **without a copy**:
//!   the data is the loader's own host buffer (page-locked when the loader was built
//!   with the CUDA backend's allocator, and then marked so to burn), kept out of the
//!   loader's pool until the last `TensorData` or tensor made from it is dropped. burn's
//!   pure-Rust CPU backend (`Device::flex()`) computes on those bytes in place;
//!   `Tensor::from_data(data, &device)` converts where the device's default element
//!   type differs (images stored as `u8` become `f32` there), and a GPU backend copies
//!   them to the device.
//! - [`BurnLoader`] is a `burn::data::dataloader::DataLoader`: each `iter()` is the next
//!   epoch of a stokehold [`Loader`], its batches turned into your batch type by a
//!   closure, so burn's `Learner` (or your own loop) trains on it as on burn's own
//!   loaders, with stokehold's prefetch, shuffles, sharding and exact resume.
//!
//! Element types map one to one (burn has every one stokehold reads), except `bool`,
//! which is handed over as `u8` (0 or 1): a file's bytes are not checked to be valid
//! Rust `bool`s.
//!
//! Holding batches: a tensor made without a copy holds its batch's buffer. The loader's
//! pool has room for [`LoaderBuilder::held`] batches held while the next ones are made
//! (default 2); keep at most that many batches' tensors alive at once, or raise it.
//!
//! The example below runs on burn's CPU backend (`Device::flex()`, burn-core's `flex`
//! feature, which `burn-example` turns on):
//!
#![cfg_attr(feature = "burn-example", doc = "```")]
#![cfg_attr(not(feature = "burn-example"), doc = "```ignore")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use burn_core::data::dataloader::DataLoader;
//! use burn_core::tensor::{Device, Int, Tensor};
//! use stokehold::interop::burn::BurnLoader;
//! use stokehold::{Loader, NpyDataset};
//!
//! let digits = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
//! let builder = Loader::builder(digits).batch_size(256).workers(2);
//! let loader = BurnLoader::new(builder, Device::flex(), |batch, device| {
//!     let x = Tensor::<3>::from_data(batch.data_named("x")?, device); // u8 -> f32
//!     let y = Tensor::<1, Int>::from_data(batch.data_named("y")?, device);
//!     Ok((x, y))
//! })?;
//! assert_eq!(loader.num_items(), 1797);
//! for item in loader.iter() {
//!     let (x, y) = item?; // epoch 0; the next iter() is epoch 1
//!     assert_eq!(x.dims()[1..], [8, 8]);
//!     assert_eq!(x.dims()[0], y.dims()[0]);
//! }
//! # Ok(())
//! # }
//! ```

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use burn_core::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn_core::data::dataset::DatasetError;
use burn_core::tensor::{AllocationProperty, Bytes, DType as BurnDType, Device, TensorData};

use crate::dataset::{DType, Dataset, Subset};
use crate::error::{Error, Result};
use crate::loader::{Epoch, HostBatch, Loader, LoaderBuilder, LoaderState};

/// A batch whose columns burn reads in place. Cloning it shares the batch.
#[derive(Clone)]
pub struct Batch {
    host: Arc<HostBatch>,
}

/// One column of a shared batch: the owner of the bytes a `TensorData` holds.
struct ColumnBytes {
    batch: Arc<HostBatch>,
    c: usize,
}

impl AsRef<[u8]> for ColumnBytes {
    fn as_ref(&self) -> &[u8] {
        self.batch.bytes(self.c)
    }
}

impl Batch {
    /// Shares `batch` with burn.
    pub fn new(batch: HostBatch) -> Batch {
        Batch {
            host: Arc::new(batch),
        }
    }

    /// The batch as the loader delivered it (indices, timing, columns as slices).
    pub fn host(&self) -> &HostBatch {
        &self.host
    }

    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether the batch has no sample (never, for a batch a loader delivered).
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The samples' indices in the dataset.
    pub fn indices(&self) -> &[u64] {
        self.host.indices()
    }

    /// Column `c` as burn tensor data of shape `[samples, sample shape...]`, without a
    /// copy.
    ///
    /// # Panics
    /// If `c` is not a column of the batch.
    pub fn data(&self, c: usize) -> TensorData {
        let col = &self.host.columns()[c];
        let mut shape = Vec::with_capacity(col.shape.len() + 1);
        shape.push(self.host.len());
        shape.extend(col.shape.iter().map(|&d| d as usize));
        let property = match self.host.allocator().starts_with("pinned") {
            true => AllocationProperty::Pinned,
            false => AllocationProperty::Native,
        };
        let owner = ColumnBytes {
            batch: Arc::clone(&self.host),
            c,
        };
        let bytes = Bytes::from_shared(bytes::Bytes::from_owner(owner), property);
        TensorData::from_bytes(bytes, shape, dtype(col.dtype))
    }

    /// The column named `name` (a file stem such as `x`, or `tokens`) as burn tensor
    /// data, without a copy.
    ///
    /// # Errors
    /// [`Error::Config`] if the batch has no such column.
    pub fn data_named(&self, name: &str) -> Result<TensorData> {
        let columns = self.host.columns();
        match columns.iter().position(|c| c.name == name) {
            Some(c) => Ok(self.data(c)),
            None => Err(Error::Config(format!(
                "no column named {name:?} (the batch has {})",
                columns
                    .iter()
                    .map(|c| c.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// Every column as burn tensor data, in column order, without a copy.
    pub fn columns(&self) -> Vec<TensorData> {
        (0..self.host.columns().len())
            .map(|c| self.data(c))
            .collect()
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.host.fmt(f)
    }
}

/// burn's element type for a column's.
fn dtype(d: DType) -> BurnDType {
    match d {
        DType::Bool | DType::U8 => BurnDType::U8,
        DType::I8 => BurnDType::I8,
        DType::U16 => BurnDType::U16,
        DType::I16 => BurnDType::I16,
        DType::U32 => BurnDType::U32,
        DType::I32 => BurnDType::I32,
        DType::U64 => BurnDType::U64,
        DType::I64 => BurnDType::I64,
        DType::F16 => BurnDType::F16,
        DType::F32 => BurnDType::F32,
        DType::F64 => BurnDType::F64,
    }
}

/// Turns each batch into the type the training step takes.
type Batcher<O> = dyn Fn(Batch, &Device) -> Result<O> + Send + Sync;

/// A stokehold [`Loader`] as a burn `DataLoader`: each `iter()` yields the next epoch.
///
/// - `iter()` runs epoch `e`, then `e + 1` at the next call, from the loader's state (0,
///   or the epoch of [`LoaderBuilder::resume`], whose first `iter()` yields only the rest
///   of that epoch). [`set_epoch`](BurnLoader::set_epoch) picks another.
/// - One epoch at a time: an `iter()` while another epoch's iterator is alive yields
///   one error instead of batches.
/// - `num_items()` is the samples one epoch delivers on this rank (after `drop_last`).
/// - `to_device(d)` shares the loader (and its epoch count) and builds batches for `d`.
/// - `slice(start, end)` is a new loader, configured the same, over samples
///   `start..end` of the dataset ([`Subset`]): how burn's `split_dataloader` gives each
///   device its part.
/// - Errors (a failed read, a batcher's `Err`, a bad slice) are items:
///   `burn::data::dataset::DatasetError` wrapping the [`Error`], which names the file.
pub struct BurnLoader<O> {
    shared: std::result::Result<Arc<Shared>, String>,
    device: Device,
    batcher: Arc<Batcher<O>>,
}

/// The loader behind a [`BurnLoader`] and its copies for other devices.
struct Shared {
    /// Reached mutably only by the holder of `busy`.
    loader: UnsafeCell<Loader>,
    /// Set while an epoch's iterator (or a state call) holds the loader.
    busy: AtomicBool,
    /// The epoch the next `iter()` runs.
    next: AtomicU64,
    /// The loader's configuration and dataset, for `slice`.
    builder: LoaderBuilder,
    dataset: Arc<dyn Dataset>,
    /// Samples per epoch on this rank, and per batch.
    items: usize,
    batch_size: usize,
}

// SAFETY: the loader is `Send`; it is only reached through `&mut` by whoever set `busy`
// from false to true, and `busy` is released (with `Release`, after the `&mut` is gone)
// only by that holder, so no two threads ever hold a reference to it at once.
unsafe impl Sync for Shared {}

impl Shared {
    fn new(builder: LoaderBuilder) -> Result<Shared> {
        let loader = builder.clone().build()?;
        let order = loader.order();
        let items = (order.batches() * order.batch_size()).min(order.samples()) as usize;
        Ok(Shared {
            next: AtomicU64::new(loader.state().epoch),
            dataset: Arc::clone(loader.dataset()),
            batch_size: order.batch_size() as usize,
            loader: UnsafeCell::new(loader),
            busy: AtomicBool::new(false),
            builder,
            items,
        })
    }

    /// The loader, if no epoch holds it; `busy` stays set until [`release`](Self::release).
    #[allow(clippy::mut_from_ref)] // exclusive through `busy`, as the SAFETY note says
    fn take(&self) -> Result<&mut Loader> {
        if self
            .busy
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(Error::Config(
                "an epoch of this loader is still being iterated: a burn DataLoader runs \
                 one epoch at a time (drop the last iter() first)"
                    .into(),
            ));
        }
        // SAFETY: this thread just set `busy`, so no other reference to the loader
        // exists until it calls `release`, after dropping this one.
        Ok(unsafe { &mut *self.loader.get() })
    }

    fn release(&self) {
        self.busy.store(false, Ordering::Release);
    }
}

impl<O> BurnLoader<O> {
    /// Builds the loader `builder` configures; `batcher` turns each of its batches into
    /// the type the training step takes, on `device`.
    ///
    /// # Errors
    /// As [`LoaderBuilder::build`].
    pub fn new<F>(builder: LoaderBuilder, device: Device, batcher: F) -> Result<BurnLoader<O>>
    where
        F: Fn(Batch, &Device) -> Result<O> + Send + Sync + 'static,
    {
        Ok(BurnLoader {
            shared: Ok(Arc::new(Shared::new(builder)?)),
            device,
            batcher: Arc::new(batcher),
        })
    }

    /// The epoch the next `iter()` runs.
    pub fn epoch(&self) -> u64 {
        self.shared
            .as_ref()
            .map_or(0, |s| s.next.load(Ordering::Acquire))
    }

    /// Makes the next `iter()` run epoch `epoch`.
    pub fn set_epoch(&self, epoch: u64) {
        if let Ok(s) = &self.shared {
            s.next.store(epoch, Ordering::Release);
        }
    }

    /// Where the loader stands, for a checkpoint: after a whole epoch `e`, `(e + 1, 0)`.
    ///
    /// # Errors
    /// [`Error::Config`] while an epoch is being iterated, or for a loader whose slice
    /// could not be built.
    pub fn state(&self) -> Result<LoaderState> {
        let shared = self.shared()?;
        let state = shared.take()?.state();
        shared.release();
        Ok(state)
    }

    /// The loader behind it, or the reason there is none.
    fn shared(&self) -> Result<&Arc<Shared>> {
        self.shared.as_ref().map_err(|e| Error::Config(e.clone()))
    }
}

impl<O> Clone for BurnLoader<O> {
    fn clone(&self) -> Self {
        BurnLoader {
            shared: self.shared.clone(),
            device: self.device.clone(),
            batcher: Arc::clone(&self.batcher),
        }
    }
}

impl<O> std::fmt::Debug for BurnLoader<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("BurnLoader");
        match &self.shared {
            Ok(s) => d.field("items", &s.items).field("epoch", &self.epoch()),
            Err(e) => d.field("error", e),
        };
        d.field("device", &self.device).finish()
    }
}

impl<O: 'static> DataLoader<O> for BurnLoader<O> {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        let mut it = Iter {
            epoch: None,
            lock: None,
            failed: None,
            batcher: self.batcher.as_ref(),
            device: &self.device,
            processed: 0,
            total: self.num_items(),
        };
        let shared = match self.shared() {
            Ok(s) => s,
            Err(e) => {
                it.failed = Some(e);
                return Box::new(it);
            }
        };
        let loader = match shared.take() {
            Ok(l) => l,
            Err(e) => {
                it.failed = Some(e);
                return Box::new(it);
            }
        };
        let e = shared.next.fetch_add(1, Ordering::AcqRel);
        it.lock = Some(shared);
        match loader.epoch(e) {
            Ok(epoch) => {
                let resumed = epoch.first_batch() as usize;
                it.processed = resumed.saturating_mul(shared.batch_size).min(it.total);
                it.epoch = Some(epoch);
            }
            Err(err) => it.failed = Some(err),
        }
        Box::new(it)
    }

    fn num_items(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.items)
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<O>> {
        Arc::new(BurnLoader {
            device: device.clone(),
            ..self.clone()
        })
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<O>> {
        let shared = self.shared().and_then(|s| {
            let part = Subset::new(Arc::clone(&s.dataset), start as u64..end as u64)?;
            Shared::new(s.builder.clone().over(Arc::new(part)))
        });
        Arc::new(BurnLoader {
            shared: shared.map(Arc::new).map_err(|e| e.to_string()),
            device: self.device.clone(),
            batcher: Arc::clone(&self.batcher),
        })
    }
}

/// One epoch of a [`BurnLoader`].
struct Iter<'a, O> {
    /// Dropped before `lock` is released.
    epoch: Option<Epoch<'a>>,
    lock: Option<&'a Shared>,
    /// An error to yield once, in place of the epoch.
    failed: Option<Error>,
    batcher: &'a Batcher<O>,
    device: &'a Device,
    processed: usize,
    total: usize,
}

fn dataset_error(e: Error) -> DatasetError {
    DatasetError::new(e)
}

impl<O> Iterator for Iter<'_, O> {
    type Item = std::result::Result<O, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(e) = self.failed.take() {
            return Some(Err(dataset_error(e)));
        }
        let batch = match self.epoch.as_mut()?.next()? {
            Ok(b) => b,
            Err(e) => return Some(Err(dataset_error(e))),
        };
        self.processed += batch.len();
        Some((self.batcher)(Batch::new(batch), self.device).map_err(dataset_error))
    }
}

impl<O> DataLoaderIterator<O> for Iter<'_, O> {
    fn progress(&self) -> Progress {
        Progress {
            items_processed: self.processed,
            items_total: self.total,
            unit: None,
        }
    }
}

impl<O> Drop for Iter<'_, O> {
    fn drop(&mut self) {
        // The epoch (and its `&mut` to the loader) goes first, then the loader is free.
        self.epoch = None;
        if let Some(shared) = self.lock {
            shared.release();
        }
    }
}
