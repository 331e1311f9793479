//! A fixed pool of host buffers, allocated once and recycled through RAII leases.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Alignment of plain host buffers: a page, so that buffers can also be registered with
/// a driver and column offsets (multiples of 256) stay aligned for any element type.
pub const BUFFER_ALIGN: usize = 4096;

/// Memory one host buffer lives in.
///
/// # Safety
/// Implementors promise that [`as_ptr`](HostMemory::as_ptr) points to
/// [`len`](HostMemory::len) bytes that are valid for reads and writes, aligned to at
/// least 256 bytes, owned exclusively by this value, initialised, and not moved or
/// freed before it is dropped.
pub unsafe trait HostMemory: Send + Sync {
    /// Start of the memory.
    fn as_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the length is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Allocates the loader's host buffers: plain memory here, page-locked memory from the
/// CUDA backend.
pub trait HostAlloc: Send + Sync + 'static {
    /// A short name for reports (`plain`, `pinned`...).
    fn name(&self) -> &'static str;
    /// Allocates `bytes` bytes (at least one page), zero-filled, every page touched.
    ///
    /// # Errors
    /// [`Error::Alloc`] when the memory cannot be had.
    fn alloc(&self, bytes: usize) -> Result<Box<dyn HostMemory>>;
}

/// Ordinary page-aligned heap memory.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlainAlloc;

struct PlainMemory {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: `PlainMemory` owns its allocation exclusively; moving it between threads or
// sharing `&PlainMemory` (which only exposes the pointer) is sound.
unsafe impl Send for PlainMemory {}
// SAFETY: as above; writes go through `&mut` access arranged by the pool.
unsafe impl Sync for PlainMemory {}

// SAFETY: the pointer comes from `std::alloc::alloc` with `layout` (page-aligned, the
// reported length), is zero-filled at allocation and freed only in `Drop`.
unsafe impl HostMemory for PlainMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for PlainMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `PlainAlloc::alloc` with exactly this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl HostAlloc for PlainAlloc {
    fn name(&self) -> &'static str {
        "plain"
    }

    fn alloc(&self, bytes: usize) -> Result<Box<dyn HostMemory>> {
        let size = bytes
            .max(1)
            .checked_next_multiple_of(BUFFER_ALIGN)
            .ok_or_else(|| Error::Alloc {
                bytes,
                allocator: "plain",
                message: "size overflows".into(),
            })?;
        let layout = Layout::from_size_align(size, BUFFER_ALIGN).map_err(|e| Error::Alloc {
            bytes,
            allocator: "plain",
            message: e.to_string(),
        })?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::Alloc {
            bytes,
            allocator: "plain",
            message: "out of memory".into(),
        })?;
        // Touch every page now, so that page faults are paid at pool creation (where they
        // are measured) rather than inside the first epoch's gathers.
        // SAFETY: `ptr` points to `size` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, size) };
        Ok(Box::new(PlainMemory { ptr, layout }))
    }
}

/// One buffer of the pool with the batch's sample indices beside it.
pub(crate) struct Slot {
    pub(crate) mem: Box<dyn HostMemory>,
    pub(crate) indices: Vec<u64>,
}

impl Slot {
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `HostMemory` guarantees `len` initialised bytes at `as_ptr`, owned by
        // this slot; the shared borrow of the slot excludes writers.
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr(), self.mem.len()) }
    }

    /// The buffer's bytes and the index list, borrowed apart.
    pub(crate) fn parts_mut(&mut self) -> (&mut [u8], &mut Vec<u64>) {
        // SAFETY: as above, and `&mut self` makes this the only access to the memory.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.mem.as_ptr(), self.mem.len()) };
        (bytes, &mut self.indices)
    }
}

/// The pool: `size` slots of `bytes` each, allocated once.
///
/// Free slots form a stack: the slot released last is lent first, so in steady state a
/// worker writes into a buffer that is still in the CPU caches, the way a bare gather
/// reusing one buffer does.
pub(crate) struct Pool {
    free: Mutex<Free>,
    available: Condvar,
    size: usize,
    bytes: usize,
    /// Slots currently inside a `HostBatch` handed to the consumer.
    pub(crate) held: AtomicUsize,
    /// `HostBatch`es dropped so far (on any thread).
    pub(crate) released: AtomicU64,
    /// Set once a batch of this pool was read or dropped on a thread other than the one
    /// it was delivered to: its consumer hands batches on (a queue to a training
    /// thread), so batches held and not yet read there are no proof that waiting for a
    /// buffer would never end. Never cleared: such a consumer may drop every batch
    /// before a long step (validation between epochs) while the next epoch's batches
    /// wait in its queue, unread, however long that takes.
    pub(crate) handed_on: AtomicBool,
    allocator: &'static str,
    alloc_time: Duration,
}

impl Pool {
    pub(crate) fn new(
        alloc: &dyn HostAlloc,
        size: usize,
        bytes: usize,
        batch_size: usize,
    ) -> Result<Arc<Pool>> {
        let start = Instant::now();
        let mut free = Vec::new();
        free.try_reserve_exact(size).map_err(|e| Error::Alloc {
            bytes,
            allocator: alloc.name(),
            message: format!("a pool of {size} buffers: {e}"),
        })?;
        for _ in 0..size {
            let slot = Slot {
                mem: alloc.alloc(bytes)?,
                indices: Vec::with_capacity(batch_size),
            };
            if slot.mem.as_ptr() as usize % 256 != 0 {
                return Err(Error::Alloc {
                    bytes,
                    allocator: alloc.name(),
                    message: "the allocator returned memory not aligned to 256 bytes".into(),
                });
            }
            if slot.mem.len() < bytes {
                return Err(Error::Alloc {
                    bytes,
                    allocator: alloc.name(),
                    message: format!("the allocator returned only {} bytes", slot.mem.len()),
                });
            }
            free.push(slot);
        }
        Ok(Arc::new(Pool {
            free: Mutex::new(Free {
                slots: free,
                waiting: 0,
            }),
            available: Condvar::new(),
            size,
            bytes,
            held: AtomicUsize::new(0),
            released: AtomicU64::new(0),
            handed_on: AtomicBool::new(false),
            allocator: alloc.name(),
            alloc_time: start.elapsed(),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, Free> {
        // Nothing panics while holding the lock; recover the data if something did.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the most recently released slot, waiting for one; `None` once `cancelled`
    /// is set (and [`wake_all`](Pool::wake_all) called).
    pub(crate) fn take(&self, cancelled: &AtomicBool) -> Option<Slot> {
        let mut free = self.lock();
        loop {
            if cancelled.load(Ordering::Acquire) {
                return None;
            }
            if let Some(slot) = free.slots.pop() {
                return Some(slot);
            }
            free.waiting += 1;
            free = self.available.wait(free).unwrap_or_else(|e| e.into_inner());
            free.waiting -= 1;
        }
    }

    fn put(&self, slot: Slot) {
        let mut free = self.lock();
        free.slots.push(slot);
        let wake = free.waiting > 0;
        drop(free);
        if wake {
            self.available.notify_one();
        }
    }

    /// Wakes every waiter so it can see a cancellation flag set before the call.
    pub(crate) fn wake_all(&self) {
        // Taking the lock orders this after any waiter's flag check.
        drop(self.lock());
        self.available.notify_all();
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn allocator(&self) -> &'static str {
        self.allocator
    }

    pub(crate) fn alloc_time(&self) -> Duration {
        self.alloc_time
    }

    /// Slots waiting in the pool right now.
    pub(crate) fn free(&self) -> usize {
        self.lock().slots.len()
    }
}

/// The free stack and how many threads wait on it (so a release wakes no one, and
/// makes no system call, when nobody waits).
struct Free {
    slots: Vec<Slot>,
    waiting: usize,
}

/// A slot lent out of the pool; dropping it gives the slot back.
pub(crate) struct Lease {
    slot: Option<Slot>,
    pool: Arc<Pool>,
}

impl Lease {
    pub(crate) fn new(slot: Slot, pool: Arc<Pool>) -> Lease {
        Lease {
            slot: Some(slot),
            pool,
        }
    }

    pub(crate) fn slot(&self) -> &Slot {
        self.slot
            .as_ref()
            .expect("a lease holds its slot until dropped")
    }

    pub(crate) fn slot_mut(&mut self) -> &mut Slot {
        self.slot
            .as_mut()
            .expect("a lease holds its slot until dropped")
    }

    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.pool.put(slot);
        }
    }
}
