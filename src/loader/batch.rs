//! Batches as the consumer sees them.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::pool::Lease;
use crate::dataset::{Column, Element};
use crate::error::{Error, Result};

/// Byte offset alignment of each column inside a batch buffer.
pub const COLUMN_ALIGN: usize = 256;

/// Columns a batch may have (fixed so that splitting a buffer allocates nothing).
pub const MAX_COLUMNS: usize = 16;

/// Where each column of a batch lives inside its host buffer: column `c` occupies
/// `offset(c) .. offset(c) + batch_size * row_bytes`, at a 256-byte-aligned offset, so a
/// whole batch moves to the device in one copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchLayout {
    columns: Vec<Column>,
    offsets: Vec<usize>,
    batch_size: usize,
    bytes: usize,
}

impl BatchLayout {
    /// The layout of batches of `batch_size` samples of `columns`.
    ///
    /// # Errors
    /// [`Error::Config`] for no column, more than [`MAX_COLUMNS`], or a byte size that
    /// overflows.
    pub fn new(columns: &[Column], batch_size: usize) -> Result<BatchLayout> {
        if columns.is_empty() || columns.len() > MAX_COLUMNS {
            return Err(Error::Config(format!(
                "a batch has 1 to {MAX_COLUMNS} columns, this dataset has {}",
                columns.len()
            )));
        }
        if let Some(c) = columns.iter().find(|c| c.row_bytes % c.dtype.size() != 0) {
            return Err(Error::Config(format!(
                "column {} has {} bytes per sample, not a whole number of {}",
                c.name, c.row_bytes, c.dtype
            )));
        }
        let mut offsets = Vec::with_capacity(columns.len());
        let mut at = 0usize;
        for c in columns {
            offsets.push(at);
            let size = c
                .row_bytes
                .checked_mul(batch_size)
                .and_then(|s| s.checked_next_multiple_of(COLUMN_ALIGN))
                .and_then(|s| s.checked_add(at));
            at = size.ok_or_else(|| {
                Error::Config(format!("a batch of {batch_size} samples overflows memory"))
            })?;
        }
        if at > isize::MAX as usize / 2 {
            return Err(Error::Config(format!(
                "a batch of {batch_size} samples needs {at} bytes"
            )));
        }
        Ok(BatchLayout {
            columns: columns.to_vec(),
            offsets,
            batch_size,
            bytes: at.max(COLUMN_ALIGN),
        })
    }

    /// The columns.
    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    /// Byte offset of column `c` in the buffer.
    ///
    /// # Panics
    /// If `c` is not a column.
    pub fn offset(&self, c: usize) -> usize {
        self.offsets[c]
    }

    /// Samples a buffer holds: those of a full batch (the loader's batch size, or an
    /// epoch's samples when there are fewer).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Bytes of one batch buffer.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Refuses a batch not laid out as this layout's buffers (a loader with another
    /// batch size or other columns: an evaluation loader with a larger batch, say), for
    /// code that copies batches into buffers or device slots of this layout. Copied, it
    /// would run past them, and its columns would be read at other offsets.
    ///
    /// # Errors
    /// [`Error::Config`] naming both layouts' batch sizes and bytes.
    pub fn check_batch(&self, batch: &HostBatch) -> Result<()> {
        let theirs = batch.layout();
        if theirs == self {
            return Ok(());
        }
        Err(Error::Config(format!(
            "a batch laid out for {} samples ({} bytes), for buffers laid out for {} \
             ({} bytes{}): another loader's layout; give each loader its own trainer, \
             feeder or slots",
            theirs.batch_size(),
            theirs.bytes(),
            self.batch_size(),
            self.bytes(),
            match theirs.columns() == self.columns() {
                true => "",
                false => ", and other columns",
            }
        )))
    }

    /// Bytes of sample data in a batch of `rows` samples (padding excluded).
    pub fn data_bytes(&self, rows: usize) -> usize {
        self.columns.iter().map(|c| c.row_bytes * rows).sum()
    }

    /// Splits `buf` into one slice per column, each `rows` samples long, without
    /// allocating. Returns the array and how many of its entries are used.
    pub(crate) fn split<'a>(
        &self,
        mut buf: &'a mut [u8],
        rows: usize,
    ) -> ([&'a mut [u8]; MAX_COLUMNS], usize) {
        let mut parts: [&'a mut [u8]; MAX_COLUMNS] = Default::default();
        let mut at = 0;
        for ((c, &off), part) in self.columns.iter().zip(&self.offsets).zip(parts.iter_mut()) {
            let rest = std::mem::take(&mut buf);
            let (_, tail) = rest.split_at_mut(off - at);
            let (mine, tail) = tail.split_at_mut(c.row_bytes * rows);
            *part = mine;
            buf = tail;
            at = off + c.row_bytes * rows;
        }
        (parts, self.columns.len())
    }
}

/// When and where a batch was assembled, and how long the consumer waited for it.
#[derive(Debug, Clone, Copy)]
pub struct BatchTiming {
    /// The worker that assembled it.
    pub worker: usize,
    /// When the worker started gathering.
    pub gather_start: Instant,
    /// When it finished.
    pub gather_end: Instant,
    /// When the consumer asked for it.
    pub asked: Instant,
    /// How long the consumer's `next()` blocked before the batch was there.
    pub waited: Duration,
}

impl BatchTiming {
    /// Gather time.
    pub fn gather(&self) -> Duration {
        self.gather_end - self.gather_start
    }
}

/// A number for the calling thread, unique in the process; `None` while the thread's
/// locals are being destroyed.
fn thread_number() -> Option<u64> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static NUMBER: Cell<u64> = const { Cell::new(0) });
    NUMBER
        .try_with(|n| {
            if n.get() == 0 {
                n.set(NEXT.fetch_add(1, Ordering::Relaxed));
            }
            n.get()
        })
        .ok()
}

/// A batch in a host buffer of the loader's pool. Dropping it returns the buffer.
pub struct HostBatch {
    pub(crate) lease: Lease,
    pub(crate) layout: Arc<BatchLayout>,
    pub(crate) len: usize,
    pub(crate) epoch: u64,
    pub(crate) number: u64,
    pub(crate) timing: BatchTiming,
    /// Whether the batch holds its indices only ([`Loader::epoch_indices`]).
    ///
    /// [`Loader::epoch_indices`]: crate::Loader::epoch_indices
    indices_only: bool,
    /// The thread the epoch delivered it to.
    home: Option<u64>,
}

impl HostBatch {
    pub(crate) fn new(
        lease: Lease,
        layout: Arc<BatchLayout>,
        len: usize,
        epoch: u64,
        number: u64,
        timing: BatchTiming,
        indices_only: bool,
    ) -> HostBatch {
        lease.pool().held.fetch_add(1, Ordering::AcqRel);
        HostBatch {
            lease,
            layout,
            len,
            epoch,
            number,
            timing,
            indices_only,
            home: thread_number(),
        }
    }

    /// Notes a read or a drop on a thread other than the one it was delivered to: the
    /// consumer hands batches on (see `Pool::handed_on`).
    fn touch(&self) {
        let pool = self.lease.pool();
        if !pool.handed_on.load(Ordering::Relaxed) && thread_number() != self.home {
            pool.handed_on.store(true, Ordering::Release);
        }
    }

    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch has no sample (never, for batches a loader yields).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The epoch it belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Its number within the epoch, from 0.
    pub fn number(&self) -> u64 {
        self.number
    }

    /// The dataset indices of its samples, in batch order.
    pub fn indices(&self) -> &[u64] {
        self.touch();
        &self.lease.slot().indices
    }

    /// Whether the batch holds its [`indices`](HostBatch::indices) only, its columns not
    /// read: a batch of an epoch started with
    /// [`Loader::epoch_indices`](crate::Loader::epoch_indices), for a consumer that has
    /// the rows already (a device cache). Its bytes are then unspecified (what the
    /// buffer held last).
    pub fn is_indices_only(&self) -> bool {
        self.indices_only
    }

    /// Fails for a batch of [indices only](HostBatch::is_indices_only), whose bytes a
    /// hand-over to a framework must not pass on as data.
    ///
    /// # Errors
    /// [`Error::Config`] naming the batch and what it holds.
    #[cfg(any(feature = "candle", feature = "burn"))]
    pub(crate) fn has_data(&self) -> Result<()> {
        match self.indices_only {
            false => Ok(()),
            true => Err(Error::Config(format!(
                "batch {} of epoch {} holds indices only (an epoch of \
                 Loader::epoch_indices): its columns were not read",
                self.number(),
                self.epoch()
            ))),
        }
    }

    /// The layout of the buffer.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// The columns.
    pub fn columns(&self) -> &[Column] {
        self.layout.columns()
    }

    /// Timing of its assembly.
    pub fn timing(&self) -> &BatchTiming {
        &self.timing
    }

    /// The raw bytes of column `c`: `len() * row_bytes`.
    ///
    /// # Panics
    /// If `c` is not a column index.
    pub fn bytes(&self, c: usize) -> &[u8] {
        self.touch();
        let off = self.layout.offset(c);
        let n = self.layout.columns()[c].row_bytes * self.len;
        &self.lease.slot().bytes()[off..off + n]
    }

    /// Column `c` viewed as elements of `T`.
    ///
    /// # Errors
    /// [`Error::DType`] if `T` does not match the column's dtype.
    ///
    /// # Panics
    /// If `c` is not a column index.
    pub fn column<T: Element>(&self, c: usize) -> Result<&[T]> {
        let col = &self.layout.columns()[c];
        if !T::accepts(col.dtype) {
            return Err(Error::DType {
                column: col.name.clone(),
                actual: col.dtype.name(),
                asked: T::NAME,
            });
        }
        let bytes = self.bytes(c);
        // SAFETY: `T` is a plain integer or float type accepted for this dtype, so it has
        // the dtype's size and any bit pattern is valid; the column starts at a
        // 256-byte-aligned offset of a buffer aligned to at least 256 bytes, which
        // satisfies `T`'s alignment; the length is a whole number of elements.
        Ok(unsafe {
            std::slice::from_raw_parts(
                bytes.as_ptr().cast::<T>(),
                bytes.len() / std::mem::size_of::<T>(),
            )
        })
    }

    /// The column named `name` viewed as `T`.
    ///
    /// # Errors
    /// [`Error::Config`] if there is no such column; [`Error::DType`] on a type mismatch.
    pub fn column_named<T: Element>(&self, name: &str) -> Result<&[T]> {
        let c = self
            .layout
            .columns()
            .iter()
            .position(|c| c.name == name)
            .ok_or_else(|| Error::Config(format!("no column named {name:?}")))?;
        self.column(c)
    }

    /// The whole buffer (every column at its offset, padding included): what a single
    /// host-to-device copy moves.
    pub fn as_bytes(&self) -> &[u8] {
        self.touch();
        &self.lease.slot().bytes()[..self.layout.bytes()]
    }
}

impl std::fmt::Debug for HostBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBatch")
            .field("epoch", &self.epoch)
            .field("number", &self.number)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Drop for HostBatch {
    fn drop(&mut self) {
        self.touch();
        let pool = self.lease.pool();
        pool.released.fetch_add(1, Ordering::AcqRel);
        pool.held.fetch_sub(1, Ordering::AcqRel);
    }
}
