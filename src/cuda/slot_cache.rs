//! The device cache of [`DeviceSlots`]: the batches lent to a consumer's own loop (a
//! DLPack consumer, a Rust framework) scattered by sample index into a device-resident
//! copy of the dataset, so that once every row is there the slots gather later epochs
//! on the device, from batches that carry their indices only
//! ([`Loader::epoch_indices`]): no host gathering, no copy but the indices.
//!
//! Each lend uploads its batch's indices to the slot's own part of one index buffer (a
//! few KiB), so batches of different epochs, lent from several threads, never share
//! an index list.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, CudaSlice, CudaStream};

use super::cache::DeviceCache;
use super::feeder::addr;
use super::kernels::Kernels;
use super::lease::DeviceSlots;
use super::pinned::{PinnedAlloc, PinnedKind};
use super::Cuda;
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, HostAlloc, HostMemory, Loader};

/// The slots' cache, its kernels, and which rows it holds.
pub(super) struct SlotCache {
    kernels: Kernels,
    cache: DeviceCache,
    batch_size: usize,
    /// Each slot's sample indices (slot `k`'s from `k * batch_size`), page-locked, and
    /// their copy on the device.
    host_idx: Box<dyn HostMemory>,
    idx: CudaSlice<u64>,
    /// One bit a row: set once its scatter is enqueued.
    held: Vec<u64>,
    count: u64,
    /// Whether every row is there: the slots' flag
    /// ([`DeviceSlots::cache_filled_flag`]), set with the last row, cleared when the
    /// rows are forgotten.
    flag: Arc<AtomicBool>,
}

impl SlotCache {
    /// Whether every row is in the cache (its scatter enqueued).
    pub(super) fn filled(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Enqueues on `stream` the upload of `indices` (slot `k`'s batch) to the slot's
    /// part of the index buffer; returns its device address.
    ///
    /// # Errors
    /// [`Error::Config`] for more indices than a batch holds, or a sample past the
    /// cached rows (a batch of another loader: the kernels would reach outside the
    /// cache); [`Error::Cuda`] on a driver error.
    ///
    /// # Safety
    /// Slot `k`'s earlier index upload has completed (its page-locked indices are
    /// rewritten here), and the stream is the one every use of the slot's indices is
    /// enqueued on.
    pub(super) unsafe fn upload(
        &mut self,
        stream: &CudaStream,
        k: usize,
        indices: &[u64],
    ) -> Result<u64> {
        let b = self.batch_size;
        if indices.len() > b {
            return Err(Error::Config(format!(
                "device cache: a batch of {} samples, for slots of {b}",
                indices.len()
            )));
        }
        let rows = self.cache.rows();
        if let Some(i) = indices.iter().find(|&&i| i >= rows) {
            return Err(Error::Config(format!(
                "device cache: sample {i} of a batch lent to slots caching {rows} rows \
                 (a batch of another loader than the cache's)"
            )));
        }
        let cap = self.host_idx.len() / 8;
        // SAFETY: the page-locked buffer holds `cap` u64 (page-aligned, initialised),
        // `k * b + b <= cap` as allocated for every slot; `&mut self` and the caller's
        // contract make this the only access to slot k's part.
        let host = unsafe {
            let all = std::slice::from_raw_parts_mut(self.host_idx.as_ptr().cast::<u64>(), cap);
            &mut all[k * b..k * b + indices.len()]
        };
        host.copy_from_slice(indices);
        let dst = addr(&self.idx, stream) + (k * b * 8) as u64;
        // SAFETY: the device buffer holds `b` u64 from slot k's start; the page-locked
        // source is rewritten only once this copy has completed (the caller's contract).
        unsafe { result::memcpy_htod_async(dst, &*host, stream.cu_stream()) }?;
        Ok(dst)
    }

    /// Enqueues on `stream` the scatter of a lent batch's raw rows (column `c`'s at
    /// `from[c]`) into the cache, by the indices uploaded to `idx`, and counts its rows
    /// as held.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error (no row is counted then).
    pub(super) fn fill(
        &mut self,
        stream: &CudaStream,
        from: &[u64],
        idx: u64,
        indices: &[u64],
    ) -> Result<()> {
        self.cache
            .scatter_from(&self.kernels, stream, from, idx, indices.len())?;
        for &i in indices {
            let (word, bit) = ((i / 64) as usize, 1u64 << (i % 64));
            if self.held[word] & bit == 0 {
                self.held[word] |= bit;
                self.count += 1;
            }
        }
        if self.count == self.cache.rows() {
            self.flag.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Enqueues on `stream` the gather of `rows` rows, listed at `idx`, from the cache
    /// (column `c`'s to `to[c]`); the cache is [`filled`](Self::filled).
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    pub(super) fn gather(
        &self,
        stream: &CudaStream,
        to: &[u64],
        idx: u64,
        rows: usize,
    ) -> Result<()> {
        self.cache.gather_to(&self.kernels, stream, to, idx, rows)
    }

    /// Forgets every row: after a failed copy, the cache is not trusted.
    pub(super) fn forget(&mut self) {
        self.held.iter_mut().for_each(|w| *w = 0);
        self.count = 0;
        self.flag.store(false, Ordering::Release);
    }
}

/// The device cache of the slots.
impl DeviceSlots {
    /// Keeps the dataset of `loader` on the device, if it fits under `share` of the free
    /// device memory, one epoch covers every row (one shard, no sample dropped by the
    /// tail rule or `drop_last`), its samples are the same every epoch
    /// ([`Dataset::same_every_epoch`](crate::Dataset::same_every_epoch): not random token
    /// windows), the loader gathers the batches these slots were made for, and it does
    /// not augment in its workers
    /// ([`augmented`](DeviceSlots::augmented) slots augment cached batches). Returns
    /// the cache's size in bytes, or `None` where it does not apply.
    ///
    /// Every batch lent from then on is scattered into the cache after its copy, raw
    /// (before the device's augmentation), until each row is there
    /// ([`cache_filled`](DeviceSlots::cache_filled)): one whole epoch does it, or the
    /// parts of several. From then on, lend batches of
    /// [`Loader::epoch_indices`]: each is gathered from the cache on the copy stream
    /// (then augmented), with the epoch's order, state and resume still the loader's.
    /// A cache enabled again starts empty.
    ///
    /// # Errors
    /// [`Error::Config`] for `cuda` of another context than the slots';
    /// [`Error::CopyFailed`] from the copies still in flight ([`drain`](Self::drain),
    /// called first); [`Error::Cuda`] if a device allocation fails, or for the kernels'
    /// compilation (NVRTC's log) the first time; [`Error::Alloc`] for the page-locked
    /// indices.
    pub fn enable_device_cache(
        &mut self,
        cuda: &Cuda,
        loader: &Loader,
        share: f64,
    ) -> Result<Option<u64>> {
        let _current = super::KeepCurrent::new();
        if cuda.ctx.cu_ctx() != self.context().cu_ctx() {
            return Err(Error::Config(
                "enable_device_cache: a CUDA context other than the device slots'".into(),
            ));
        }
        // Copies in flight may still scatter into the cache this replaces.
        self.drain()?;
        self.cache = None;
        self.filled.store(false, Ordering::Release);
        let order = loader.order();
        let rows = order.len();
        if loader.augmenter().is_some()
            || !order.is_whole()
            || !loader.dataset().same_every_epoch()
            || loader.layout() != self.raw_layout()
        {
            return Ok(None);
        }
        let stream = Arc::clone(self.stream());
        let layout: &BatchLayout = loader.layout();
        let Some(cache) = DeviceCache::new(cuda, &stream, layout, rows, 0, share)? else {
            return Ok(None);
        };
        let cache = cache.holding(order.dataset_fingerprint());
        let b = layout.batch_size();
        let n = self.slots() * b;
        let pinned = PinnedAlloc::new(Arc::clone(&cuda.ctx), PinnedKind::Plain);
        let c = SlotCache {
            kernels: Kernels::load(cuda)?,
            host_idx: pinned.alloc(n.max(1) * 8)?,
            idx: stream.alloc_zeros::<u64>(n.max(1))?,
            held: vec![0; rows.div_ceil(64) as usize],
            count: 0,
            flag: Arc::clone(&self.filled),
            batch_size: b,
            cache,
        };
        stream.synchronize()?;
        let bytes = c.cache.bytes();
        self.cache = Some(c);
        Ok(Some(bytes))
    }

    /// Whether the device cache holds every row: lend batches of
    /// [`Loader::epoch_indices`] from now on.
    pub fn cache_filled(&self) -> bool {
        self.cache.as_ref().is_some_and(SlotCache::filled)
    }

    /// The flag [`cache_filled`](Self::cache_filled) reads, shared: another thread asks
    /// it without the slots (which a thread waiting for a slot holds, behind a lock of
    /// a binding's, say). It follows the cache: set once every row is there, cleared
    /// when the cache is replaced or forgets its rows after a failed copy.
    pub fn cache_filled_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.filled)
    }

    /// Bytes of the device cache, if there is one.
    pub fn cache_bytes(&self) -> Option<u64> {
        self.cache.as_ref().map(|c| c.cache.bytes())
    }
}
