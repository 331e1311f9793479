//! Batches as [burn](https://burn.dev) tensor data, and a burn `DataLoader` (feature
//! `burn`, burn 0.22).
//!
//! - [`Batch::data`] turns a column into a `burn::tensor::TensorData` **without a copy**:
//!   the data is the loader's own host buffer, kept out of the loader's pool until the
//!   last `TensorData` or tensor made from it is dropped. burn's pure-Rust CPU backend
//!   (`Device::flex()`) reads those bytes in place (an operation that would write to
//!   them copies them first: the loader's buffer is never written by burn);
//!   `Tensor::from_data(data, &device)` converts where the device's default element
//!   type differs (images stored as `u8` become `f32` there), and a GPU backend copies
//!   them to the device. (The bytes are handed over as ordinary memory even when the
//!   loader's buffers are page-locked: burn's GPU backends hold page-locked uploads
//!   until a flush, which would keep the pool's buffers from the loader.)
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

    /// The samples' indices in the loader's dataset: for a loader made by `slice` (burn's
    /// `split_dataloader`), in its part, counted from the part's first sample.
    pub fn indices(&self) -> &[u64] {
        self.host.indices()
    }

    /// Column `c` as burn tensor data of shape `[samples, sample shape...]`, without a
    /// copy.
    ///
    /// # Errors
    /// [`Error::Config`] if the column's sample shape does not hold its bytes (a
    /// [`Dataset`] of your own whose columns disagree with themselves), or for a batch
    /// of indices only ([`Loader::epoch_indices`](crate::Loader::epoch_indices)).
    ///
    /// # Panics
    /// If `c` is not a column of the batch.
    pub fn data(&self, c: usize) -> Result<TensorData> {
        self.host.has_data()?;
        let col = &self.host.columns()[c];
        let mut shape = Vec::with_capacity(col.shape.len() + 1);
        shape.push(self.host.len());
        shape.extend(col.shape.iter().map(|&d| d as usize));
        let owner = ColumnBytes {
            batch: Arc::clone(&self.host),
            c,
        };
        // `Native` even for page-locked buffers: a GPU backend keeps `Pinned` bytes
        // until its uploads are flushed, which would hold the pool's few buffers.
        let bytes = Bytes::from_shared(bytes::Bytes::from_owner(owner), AllocationProperty::Native);
        TensorData::try_from_bytes(bytes, shape, dtype(col.dtype)).map_err(|e| {
            Error::Config(format!(
                "column {}: its sample shape {:?} does not hold its {} bytes per sample ({e})",
                col.name, col.shape, col.row_bytes
            ))
        })
    }

    /// The column named `name` (a file stem such as `x`, or `tokens`) as burn tensor
    /// data, without a copy.
    ///
    /// # Errors
    /// [`Error::Config`] if the batch has no such column.
    pub fn data_named(&self, name: &str) -> Result<TensorData> {
        let columns = self.host.columns();
        match columns.iter().position(|c| c.name == name) {
            Some(c) => self.data(c),
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
    ///
    /// # Errors
    /// As [`data`](Batch::data).
    pub fn columns(&self) -> Result<Vec<TensorData>> {
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
/// - `to_device(d)` shares the loader (and its epoch count) and builds batches for `d`:
///   iterate one of them at a time. For one loader per device, `slice` it.
/// - `slice(start, end)` is a new loader (its own threads and buffers), configured the
///   same and starting at this one's next epoch, over the part of the dataset that
///   items `start..end` of `num_items()` stand for ([`Subset`]; the dataset's samples
///   in proportion, so a sharded or `drop_last` loader's parts still cover all of it):
///   how burn's `split_dataloader` gives each device its part. An empty range is an
///   empty loader.
/// - An iterator that is leaked (`mem::forget`) keeps the loader for good: later
///   `iter()`s yield the "one epoch at a time" error.
/// - Errors (a failed read, a batcher's `Err`, a bad slice) are items:
///   `burn::data::dataset::DatasetError` wrapping the [`Error`], which names the file.
pub struct BurnLoader<O> {
    source: Source,
    device: Device,
    batcher: Arc<Batcher<O>>,
}

/// Where a [`BurnLoader`]'s batches come from.
#[derive(Clone)]
enum Source {
    /// A loader, shared with the copies `to_device` made.
    Loader(Arc<Shared>),
    /// An empty slice.
    Empty,
    /// A slice that could not be built: the reason, yielded as an error item.
    Failed(String),
}

/// The loader behind a [`BurnLoader`] and its copies for other devices.
struct Shared {
    loader: Exclusive,
    /// The epoch the next `iter()` runs.
    next: AtomicU64,
    /// The loader's configuration (and dataset), for `slice`.
    builder: LoaderBuilder,
    /// Samples per epoch on this rank.
    items: usize,
}

/// The loader, reached mutably by one holder at a time.
struct Exclusive {
    /// Reached only by the holder of `busy`.
    loader: UnsafeCell<Loader>,
    /// Set while an epoch's iterator (or a `state` call) holds the loader.
    busy: AtomicBool,
}

// SAFETY: the loader is `Send` (checked below); it is only reached through `&mut` by
// whoever set `busy` from false to true, and `busy` is released (with `Release`, after
// that `&mut` is gone) only by that holder's `Held`, so no two threads ever hold a
// reference to it at once.
unsafe impl Sync for Exclusive {}

const _: () = {
    const fn send<T: Send>() {}
    send::<Loader>()
};

/// Holds the loader of an [`Exclusive`]; dropping it lets the next holder in.
struct Held<'a>(&'a Exclusive);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

impl Exclusive {
    /// The loader and the token that holds it, if no one else holds it.
    #[allow(clippy::mut_from_ref)] // exclusive through `busy`, as the SAFETY note says
    fn take(&self) -> Result<(&mut Loader, Held<'_>)> {
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
        // exists until the `Held` returned with it is dropped; its holder drops the
        // reference (or what borrows it) first.
        Ok((unsafe { &mut *self.loader.get() }, Held(self)))
    }
}

impl Shared {
    /// The loader `builder` configures; its first `iter()` runs `first`, or the epoch
    /// of the loader's state.
    fn new(builder: LoaderBuilder, first: Option<u64>) -> Result<Shared> {
        let loader = builder.clone().build()?;
        let items = loader.order().epoch(0).items() as usize;
        Ok(Shared {
            next: AtomicU64::new(first.unwrap_or(loader.state().epoch)),
            loader: Exclusive {
                loader: UnsafeCell::new(loader),
                busy: AtomicBool::new(false),
            },
            builder,
            items,
        })
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
            source: Source::Loader(Arc::new(Shared::new(builder, None)?)),
            device,
            batcher: Arc::new(batcher),
        })
    }

    /// The epoch the next `iter()` runs.
    pub fn epoch(&self) -> u64 {
        match &self.source {
            Source::Loader(s) => s.next.load(Ordering::Acquire),
            _ => 0,
        }
    }

    /// Makes the next `iter()` run epoch `epoch`.
    pub fn set_epoch(&self, epoch: u64) {
        if let Source::Loader(s) = &self.source {
            s.next.store(epoch, Ordering::Release);
        }
    }

    /// Where the loader stands, for a checkpoint ([`LoaderBuilder::resume`] takes it):
    /// the next epoch's start, `(e + 1, 0)` after epoch `e`, whether `e`'s iterator ran
    /// to its end or was dropped before (the next `iter()` runs `e + 1` either way), or
    /// the point a resumed epoch starts from before its `iter()`.
    ///
    /// # Errors
    /// [`Error::Config`] while an epoch is being iterated, or for a loader whose slice
    /// could not be built or is empty.
    pub fn state(&self) -> Result<LoaderState> {
        let shared = match &self.source {
            Source::Loader(s) => s,
            Source::Empty => return Err(Error::Config("an empty slice has no state".into())),
            Source::Failed(e) => return Err(Error::Config(e.clone())),
        };
        let (loader, _held) = shared.loader.take()?;
        let next = shared.next.load(Ordering::Acquire);
        // The loader's own state only while it resumes the epoch the next `iter()` runs:
        // otherwise that `iter()` runs its epoch from the start (after `set_epoch` back
        // to an epoch dropped part-way, say), whatever the loader's state says.
        Ok(match loader.resumes(next) {
            true => loader.state(),
            false => LoaderState::at(loader.order(), next, 0, 0),
        })
    }
}

impl<O> Clone for BurnLoader<O> {
    fn clone(&self) -> Self {
        BurnLoader {
            source: self.source.clone(),
            device: self.device.clone(),
            batcher: Arc::clone(&self.batcher),
        }
    }
}

impl<O> std::fmt::Debug for BurnLoader<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("BurnLoader");
        match &self.source {
            Source::Loader(s) => d.field("items", &s.items).field("epoch", &self.epoch()),
            Source::Empty => d.field("items", &0),
            Source::Failed(e) => d.field("error", e),
        };
        d.field("device", &self.device).finish()
    }
}

impl<O: 'static> DataLoader<O> for BurnLoader<O> {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        let mut it = Iter {
            epoch: None,
            held: None,
            failed: None,
            batcher: self.batcher.as_ref(),
            device: &self.device,
            processed: 0,
            total: 0,
        };
        let shared = match &self.source {
            Source::Loader(s) => s,
            Source::Empty => return Box::new(it),
            Source::Failed(e) => {
                it.failed = Some(Error::Config(e.clone()));
                return Box::new(it);
            }
        };
        let (loader, held) = match shared.loader.take() {
            Ok(taken) => taken,
            Err(e) => {
                it.failed = Some(e);
                return Box::new(it);
            }
        };
        let e = shared.next.load(Ordering::Acquire);
        match loader.epoch(e) {
            Ok(epoch) => {
                shared.next.store(e.saturating_add(1), Ordering::Release);
                // What this epoch yields (a resumed one, less), and where it starts.
                let order = epoch.order();
                it.total = order.items() as usize;
                let before = epoch.first_batch().saturating_mul(order.batch_size());
                it.processed = (before as usize).min(it.total);
                it.epoch = Some(epoch);
            }
            Err(err) => it.failed = Some(err),
        }
        it.held = Some(held);
        Box::new(it)
    }

    fn num_items(&self) -> usize {
        match &self.source {
            Source::Loader(s) => s.items,
            _ => 0,
        }
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<O>> {
        Arc::new(BurnLoader {
            device: device.clone(),
            ..self.clone()
        })
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<O>> {
        let source = match &self.source {
            Source::Loader(s) => match part(s, start, end) {
                Ok(Some(shared)) => Source::Loader(Arc::new(shared)),
                Ok(None) => Source::Empty,
                Err(Error::Config(why)) => Source::Failed(why),
                Err(e) => Source::Failed(e.to_string()),
            },
            Source::Empty if start == end => Source::Empty,
            Source::Empty => Source::Failed(format!(
                "items {start}..{end} of an empty slice: a slice needs a range inside it"
            )),
            Source::Failed(e) => Source::Failed(e.clone()),
        };
        Arc::new(BurnLoader {
            source,
            device: self.device.clone(),
            batcher: Arc::clone(&self.batcher),
        })
    }
}

/// The loader over the part of `shared`'s dataset that its items `start..end` stand
/// for, starting at its next epoch; `None` for an empty range.
fn part(shared: &Shared, start: usize, end: usize) -> Result<Option<Shared>> {
    let dataset = shared.builder.dataset();
    let (n, items) = (dataset.len(), shared.items as u64);
    if start > end || end as u64 > items {
        return Err(Error::Config(format!(
            "items {start}..{end} of a loader of {items}: a slice needs a range inside it"
        )));
    }
    // Items to samples in proportion: the identity for one rank without `drop_last`.
    let at = |i: usize| match i as u64 == items {
        true => n,
        false => (i as u128 * n as u128 / items.max(1) as u128) as u64,
    };
    let (from, to) = (at(start), at(end));
    if from == to {
        return Ok(None);
    }
    let next = shared.next.load(Ordering::Acquire);
    // Busy, the loader is iterating an epoch before `next`: no resume is pending for it.
    if let Ok((loader, _held)) = shared.loader.take() {
        if loader.resumes(next) {
            return Err(Error::Config(format!(
                "this loader resumes epoch {next} part-way: its slices would each start \
                 that epoch from its first batch, training the batches before the resume \
                 point again; split a loader that starts at an epoch's first batch"
            )));
        }
    }
    let dataset = Subset::new(Arc::clone(dataset), from..to)?;
    Shared::new(shared.builder.clone().over(Arc::new(dataset)), Some(next)).map(Some)
}

/// One epoch of a [`BurnLoader`].
struct Iter<'a, O> {
    /// Declared before `held`: the epoch (and its `&mut` to the loader) is dropped
    /// first, then the loader is let go.
    epoch: Option<Epoch<'a>>,
    held: Option<Held<'a>>,
    /// An error to yield once, in place of the epoch.
    failed: Option<Error>,
    batcher: &'a Batcher<O>,
    device: &'a Device,
    processed: usize,
    total: usize,
}

impl<O> Iterator for Iter<'_, O> {
    type Item = std::result::Result<O, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(e) = self.failed.take() {
            return Some(Err(DatasetError::new(e)));
        }
        let batch = match self.epoch.as_mut()?.next()? {
            Ok(b) => b,
            Err(e) => return Some(Err(DatasetError::new(e))),
        };
        self.processed += batch.len();
        Some((self.batcher)(Batch::new(batch), self.device).map_err(DatasetError::new))
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
