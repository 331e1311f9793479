//! Device batches lent to code that runs on its own CUDA streams: a DLPack consumer
//! (PyTorch, JAX and CuPy through the Python package) or a Rust framework.
//!
//! [`DeviceSlots::lend`] copies a host batch into a free device slot on stokehold's copy
//! stream and records an event after the copy; the host does not wait. A consumer calls
//! [`LentBatch::wait_on`] with its stream before it reads the slot: that stream then
//! waits for the copy on the device. When the last handle of a batch is dropped, an event
//! is recorded on every stream that waited on it, and the next copy into the slot waits
//! for those events: the slot is overwritten only once the consumer's work on it,
//! enqueued before the release, has run. Work enqueued on a stream that was never named
//! is the consumer's to order; with no stream named at all, the release is recorded on
//! the legacy default stream (which waits for every blocking stream).
//!
//! Pinned host batches stay alive until their copies are done, at most two at a time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream};

use super::augment::DeviceAugment;
use super::feeder::addr;
use super::slot_cache::SlotCache;
use super::{Cuda, KeepCurrent, Restore};
use crate::augment::Augmenter;
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, HostBatch};

/// A CUDA stream handle (`CUstream`) as an integer, as DLPack's `stream` argument gives
/// it: a stream's address, or [`LEGACY_STREAM`] / [`PER_THREAD_STREAM`].
pub type StreamHandle = usize;

/// `CU_STREAM_LEGACY`: the legacy default stream.
pub const LEGACY_STREAM: StreamHandle = 1;

/// `CU_STREAM_PER_THREAD`: the calling thread's default stream.
pub const PER_THREAD_STREAM: StreamHandle = 2;

/// How long [`DeviceSlots::lend`] waits for a slot while every one is lent and none comes
/// back, before it reports that waiting would never end (where no batch of the slots was
/// ever used or dropped on another thread).
const EXHAUSTED_GRACE: Duration = Duration::from_secs(1);

/// Host batches whose copies may still be running, at most.
const IN_FLIGHT: usize = 2;

/// A copy whose host batch is kept until it has run: the batch, its slot, and the
/// timed events around its work on the copy stream.
struct InFlight {
    batch: HostBatch,
    slot: usize,
    timed: Timed,
}

/// Timed events recorded on the copy stream where a lend's work starts and where it
/// ends (before the slot's `copied` event: that one completed, both have).
type Timed = [CudaEvent; 2];

/// The device time of the copies a [`DeviceSlots`] has seen complete, readable without
/// the slots ([`DeviceSlots::copy_clock`]): a thread waiting for a slot holds them.
#[derive(Clone, Debug, Default)]
pub struct CopyClock(Arc<AtomicU64>);

impl CopyClock {
    /// The copy stream's time on the lends seen complete so far: for each, from where
    /// the stream started on it to its end (the copy, or the gather from the device
    /// cache, with the augmentation and the cache's fill that go with it). A copy is
    /// seen complete by a later lend, or by [`DeviceSlots::drain`], which sees them all.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }

    fn add(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        // Only the slots' owner adds, under its `&mut`: no two adds race.
        let total = self.0.load(Ordering::Relaxed).saturating_add(ns);
        self.0.store(total, Ordering::Relaxed);
    }
}

/// What a slot's reuse waits for.
#[derive(Default)]
struct Release {
    /// Recorded on the consumers' streams when the slot's last batch was released.
    events: Vec<CudaEvent>,
    /// Events to record again.
    spare: Vec<CudaEvent>,
}

/// The slots and their bookkeeping, shared by the ring and the batches it lent.
struct Shared {
    ctx: Arc<CudaContext>,
    memory: Vec<CudaSlice<u8>>,
    /// Each slot's device address.
    ptrs: Vec<u64>,
    /// Recorded on the copy stream after each copy into the slot.
    copied: Vec<CudaEvent>,
    release: Vec<Mutex<Release>>,
    free: Mutex<Vec<usize>>,
    available: Condvar,
    /// Set once a batch was used or dropped on a thread other than the one it was lent
    /// to: its consumer hands batches on, so batches lent there (used or not yet) are
    /// released however long the asking thread waits, and slots all lent are no proof
    /// that waiting for one would never end. Never cleared: such a consumer may have
    /// dropped every batch before a long step (validation between epochs), and the
    /// batches lent meanwhile wait in its queue, unread, however long that takes.
    handed_on: AtomicBool,
    /// Set when dropped, and dropped last: the caller's context is current again once
    /// the memory, the events and the context's handle (which bind theirs) are gone.
    restore: Option<Restore>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Records slot `k`'s release on `streams` and returns the slot. On a driver error
    /// the context is synchronised instead (everything enqueued so far has then run).
    fn release(&self, k: usize, streams: &[StreamHandle]) {
        let _current = KeepCurrent::new();
        let recorded = (|| -> Result<()> {
            self.ctx.bind_to_thread()?;
            let mut r = lock(&self.release[k]);
            for &s in streams {
                // The per-thread default stream of the thread dropping the batch may not
                // be the one its consumer named (a deleter run by another thread): the
                // legacy stream comes after every thread's, which are blocking streams.
                let s = match s {
                    PER_THREAD_STREAM => LEGACY_STREAM,
                    other => other,
                };
                let event = match r.spare.pop() {
                    Some(e) => e,
                    None => self.ctx.new_event(None)?,
                };
                // SAFETY: the event is live (owned here); the stream handle is the
                // consumer's, named to `wait_on`, whose contract is that the stream
                // lives as long as the batch (PyTorch's and JAX's streams live as long
                // as the process; a stream destroyed before the batch is dropped is the
                // caller's undefined behaviour, which the driver need not catch). An
                // error the driver does return is stood in for by the context's
                // synchronisation below.
                let status = unsafe { result::event::record(event.cu_event(), s as sys::CUstream) };
                match status {
                    Ok(()) => r.events.push(event),
                    Err(e) => {
                        r.spare.push(event);
                        return Err(e.into());
                    }
                }
            }
            Ok(())
        })();
        if recorded.is_err() {
            let _ = super::settle(&self.ctx);
        }
        lock(&self.free).push(k);
        self.available.notify_all();
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.restore = Some(Restore::now());
        // The memory is freed after the consumers' last work on it has run (a wait that
        // an error left in the context by another thread cannot skip).
        for r in &self.release {
            for e in &lock(r).events {
                let _ = super::wait_event(&self.ctx, e);
            }
        }
    }
}

/// A ring of device slots that batches are copied into and lent from.
pub struct DeviceSlots {
    shared: Arc<Shared>,
    copy: Arc<CudaStream>,
    layout: Arc<BatchLayout>,
    /// Host batches whose copies may still be running, with their slots.
    in_flight: VecDeque<InFlight>,
    /// Timed events to record again.
    spare_timed: Vec<Timed>,
    /// The device time of the copies seen complete.
    clock: CopyClock,
    /// The augmentation run on the device after each copy, if any.
    augment: Option<DeviceAugment>,
    /// Asked while [`reserve`](DeviceSlots::reserve) waits
    /// ([`interrupt_with`](DeviceSlots::interrupt_with)).
    interrupt: Option<Interrupt>,
    /// How long an interrupted wait had waited with every slot lent and none ever handed
    /// on, for the next wait to go on from.
    stuck: Duration,
    /// The device cache, if enabled ([`enable_device_cache`](DeviceSlots::enable_device_cache)).
    pub(super) cache: Option<SlotCache>,
    /// Whether the cache holds every row, readable without the slots
    /// ([`cache_filled_flag`](DeviceSlots::cache_filled_flag)); the cache keeps it.
    pub(super) filled: Arc<AtomicBool>,
    /// Set when dropped, and dropped last: the caller's context is current again once
    /// the stream, the augmentation's module and buffers and the slots (which bind
    /// theirs) are gone.
    restore: Option<Restore>,
}

/// A check that [`DeviceSlots::reserve`] makes while it waits: `true` stops the wait.
type Interrupt = Box<dyn FnMut() -> bool + Send + Sync>;

impl DeviceSlots {
    /// The most host batches the slots keep from their loader's pool at once: the
    /// copies that may still be running and the batch being lent. A loader that feeds
    /// only a `DeviceSlots` needs [`held`](crate::LoaderBuilder::held) of at least this
    /// (its consumer holds device slots, not host batches), or its workers wait for a
    /// buffer that only the next [`lend`](DeviceSlots::lend) gives back.
    pub const HOST_BATCHES: usize = IN_FLIGHT + 1;

    /// `slots` device slots (at least 1) for batches of `layout` on the device of `ctx`,
    /// with a copy stream of their own.
    ///
    /// # Errors
    /// [`Error::Config`] for slots that the device's free memory cannot hold;
    /// [`Error::Cuda`] when the stream, an event or a slot cannot be made.
    pub fn new(ctx: &Arc<CudaContext>, layout: &BatchLayout, slots: usize) -> Result<DeviceSlots> {
        let _current = KeepCurrent::new();
        let k = slots.max(1);
        let (free, _) = ctx.mem_get_info()?;
        let needed = k.saturating_mul(layout.bytes());
        if needed > free {
            return Err(Error::Config(format!(
                "{k} device slots of {} bytes need {needed} bytes, more than the device's \
                 {free} free: hold fewer batches or make them smaller",
                layout.bytes()
            )));
        }
        let copy = ctx.new_stream()?;
        let memory = (0..k)
            .map(|_| copy.alloc_zeros::<u8>(layout.bytes()).map_err(Error::from))
            .collect::<Result<Vec<_>>>()?;
        copy.synchronize()?;
        let ptrs = memory.iter().map(|m| addr(m, &copy)).collect();
        // A host wait sleeps instead of spinning a core the loader needs.
        let blocking = Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
        let copied = (0..k)
            .map(|_| ctx.new_event(blocking).map_err(Error::from))
            .collect::<Result<Vec<_>>>()?;
        let shared = Shared {
            ctx: Arc::clone(ctx),
            memory,
            ptrs,
            copied,
            release: (0..k).map(|_| Mutex::default()).collect(),
            free: Mutex::new((0..k).rev().collect()),
            available: Condvar::new(),
            handed_on: AtomicBool::new(false),
            restore: None,
        };
        Ok(DeviceSlots {
            shared: Arc::new(shared),
            copy,
            layout: Arc::new(layout.clone()),
            in_flight: VecDeque::with_capacity(IN_FLIGHT + 1),
            spare_timed: Vec::new(),
            clock: CopyClock::default(),
            augment: None,
            interrupt: None,
            stuck: Duration::ZERO,
            cache: None,
            filled: Arc::new(AtomicBool::new(false)),
            restore: None,
        })
    }

    /// `slots` device slots for batches of `raw` (the loader's layout) that `augmenter`
    /// augments on the device (`kernels/augment.cu`, compiled by NVRTC, cached on disk):
    /// each batch's raw images are copied to a buffer of the slot's own, and the kernel
    /// writes them, cropped, flipped and normalised, into the slot, laid out as
    /// [`Augmenter::columns`] (the [`layout`](LentBatch::layout) of the batches lent).
    /// The same bytes as the loader's workers write with
    /// [`LoaderBuilder::augment`](crate::LoaderBuilder::augment).
    ///
    /// # Errors
    /// As [`new`](DeviceSlots::new); [`Error::Cuda`] with NVRTC's log when the kernel
    /// does not build; [`Error::Config`] for an augmenter bound to other columns.
    pub fn augmented(
        cuda: &Cuda,
        raw: &BatchLayout,
        slots: usize,
        augmenter: &Augmenter,
    ) -> Result<DeviceSlots> {
        let _current = KeepCurrent::new();
        let out = BatchLayout::new(augmenter.columns(), raw.batch_size())?;
        let mut s = DeviceSlots::new(&cuda.ctx, &out, slots)?;
        let k = s.slots();
        s.augment = Some(DeviceAugment::new(cuda, &s.copy, raw, augmenter, k)?);
        Ok(s)
    }

    /// The augmentation run on the device, if any.
    pub fn augmenter(&self) -> Option<&Augmenter> {
        self.augment.as_ref().map(DeviceAugment::augmenter)
    }

    /// How the augmentation kernel was obtained (compiled or cached), if there is one.
    pub fn augment_origin(&self) -> Option<&super::KernelOrigin> {
        self.augment.as_ref().map(DeviceAugment::origin)
    }

    /// The layout of the batches the slots take (the loader's): the raw one, where the
    /// device augments.
    pub(super) fn raw_layout(&self) -> &BatchLayout {
        self.augment
            .as_ref()
            .map_or(&*self.layout, DeviceAugment::raw)
    }

    /// The context the slots live in.
    pub(super) fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// The slots.
    pub fn slots(&self) -> usize {
        self.shared.memory.len()
    }

    /// The copy stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// The device time of the copies seen complete so far
    /// ([`CopyClock::elapsed`]), for an epoch's `copy` figure: the copies run on the
    /// copy stream, overlapped with the consumer's work, so the host never waits for
    /// them and no host timer sees them.
    pub fn copy_time(&self) -> Duration {
        self.clock.elapsed()
    }

    /// A handle on [`copy_time`](DeviceSlots::copy_time) that reads it without the
    /// slots.
    pub fn copy_clock(&self) -> CopyClock {
        self.clock.clone()
    }

    /// Copies `batch` into a free slot and lends it. Waits for a slot while every one is
    /// lent (a wait that is not interrupted: the batch is in hand); the host never
    /// waits for the consumers' work, only the copy stream does.
    ///
    /// # Errors
    /// [`Error::SlotsExhausted`] when every slot stays lent and none comes back, no batch
    /// of the slots ever having been used on another thread (waiting would never end);
    /// [`Error::CopyFailed`] when an earlier batch's copy failed, naming it or a batch
    /// before it (the copies in flight are then waited for and let go: the next lend
    /// starts afresh; see the error); [`Error::Config`] for a batch of another layout,
    /// or of indices only while the device cache is not filled
    /// ([`enable_device_cache`](DeviceSlots::enable_device_cache)), or with a sample
    /// past the cached rows; [`Error::Cuda`] on a driver error. On an error the batch goes back to its pool, but its epoch has
    /// counted it: a loop that goes on (or saves a checkpoint) resumes its loader from
    /// the epoch's [`state`](crate::Epoch::state) taken before the batch (Python's
    /// loader does so itself). A slot [`reserve`](DeviceSlots::reserve)d before the
    /// batch is taken keeps the first error from happening with the batch in hand.
    pub fn lend(&mut self, batch: HostBatch) -> Result<LentBatch> {
        let _current = KeepCurrent::new();
        // The copies still running first: a failed one is no slot's business.
        self.retire(IN_FLIGHT - 1)?;
        let k = self.take_slot(false)?;
        self.lend_into(k, batch)
    }

    /// [`lend`](DeviceSlots::lend) into the slot `reserved` keeps, without waiting for
    /// one.
    ///
    /// # Errors
    /// As [`lend`](DeviceSlots::lend), but for [`Error::SlotsExhausted`];
    /// [`Error::Config`] for a slot reserved from other slots (the batch goes back).
    pub fn lend_reserved(&mut self, reserved: Reserved, batch: HostBatch) -> Result<LentBatch> {
        let _current = KeepCurrent::new();
        if !Arc::ptr_eq(&reserved.shared, &self.shared) {
            return Err(Error::Config(
                "a device slot reserved from other slots was given to lend_reserved".into(),
            ));
        }
        // Dropped on an error here, the reservation gives its slot back.
        self.retire(IN_FLIGHT - 1)?;
        let k = reserved.take();
        self.lend_into(k, batch)
    }

    /// Copies `batch` into slot `k`, which this call now owns, and lends it.
    fn lend_into(&mut self, k: usize, batch: HostBatch) -> Result<LentBatch> {
        let timed = self.spare_timed.pop().map_or_else(|| self.new_timed(), Ok);
        // On an error the events go with it (the context is settled below).
        let enqueued = timed.and_then(|t| self.enqueue_copy(k, &batch, &t).map(|()| t));
        let timed = match enqueued {
            Ok(t) => t,
            Err(e) => {
                // Some of the copies may be enqueued (several with an augmentation): they
                // must be done before the batch's buffer and the slot are used again, and
                // so must the consumers' work whose release events a failed wait dropped.
                let _ = super::settle(&self.shared.ctx);
                // The cache counted this batch's rows as its scatter was enqueued, which
                // may not have run: not trusted, as after a failed copy.
                if let Some(c) = &mut self.cache {
                    c.forget();
                }
                // Nothing of this slot is lent: it goes back as it was.
                self.shared.release(k, &[]);
                // A fault in an earlier copy, still in flight, leaves the context failing
                // every call (a sticky error): the earlier batch is the one lost.
                self.retire(0)?;
                return Err(e);
            }
        };
        let lent = LentBatch {
            shared: Arc::clone(&self.shared),
            layout: Arc::clone(&self.layout),
            slot: k,
            len: batch.len(),
            epoch: batch.epoch(),
            number: batch.number(),
            indices: batch.indices().to_vec(),
            owner: std::thread::current().id(),
            streams: Mutex::new(Vec::new()),
        };
        self.in_flight.push_back(InFlight {
            batch,
            slot: k,
            timed,
        });
        Ok(lent)
    }

    /// Two timed events for a lend's work on the copy stream.
    fn new_timed(&self) -> Result<Timed> {
        let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let event = || self.shared.ctx.new_event(timed).map_err(Error::from);
        Ok([event()?, event()?])
    }

    /// Makes the copy stream wait for slot `k`'s release and enqueues the copy of
    /// `batch` into it (or, for a batch of indices only, its gather from the device
    /// cache), its augmentation, and, while the cache is being filled, the scatter of the
    /// batch's raw rows into it; then the slot's `copied` event. `timed` is recorded
    /// around that work (after the waits and the host's checks).
    fn enqueue_copy(&mut self, k: usize, batch: &HostBatch, timed: &Timed) -> Result<()> {
        let s = &*self.shared;
        s.ctx.bind_to_thread()?;
        {
            let mut r = lock(&s.release[k]);
            let Release { events, spare } = &mut *r;
            for e in events.drain(..) {
                let waited = self.copy.wait(&e);
                spare.push(e);
                waited?;
            }
        }
        let gather = batch.is_indices_only();
        let fill = !gather && self.cache.as_ref().is_some_and(|c| !c.filled());
        if gather && !self.cache.as_ref().is_some_and(SlotCache::filled) {
            return Err(Error::Config(
                "a batch of indices only (Loader::epoch_indices) needs the device slots' \
                 cache filled, and it is not (never filled, or emptied after a failed copy): \
                 take the epoch from Loader::epoch, which fills it"
                    .into(),
            ));
        }
        let rows = match &self.augment {
            Some(a) => a.check(batch)?,
            None => {
                self.layout.check_batch(batch)?;
                batch.len()
            }
        };
        if gather || fill || self.augment.is_some() {
            // The slot's staged draws and indices are rewritten: its last copy must be
            // done (it is, unless the slot's consumer released it before its own stream
            // had waited).
            s.copied[k].synchronize()?;
        }
        // Column by column of the loader's layout, where the batch's raw rows go (a plain
        // copy, neither cached nor augmented, moves the whole buffer at once).
        let targets = match &self.augment {
            Some(a) => a.targets(&self.copy, k, s.ptrs[k], &self.layout),
            None if gather || fill => (0..self.layout.columns().len())
                .map(|c| s.ptrs[k] + self.layout.offset(c) as u64)
                .collect(),
            None => Vec::new(),
        };
        // The copy stream's work on the batch starts here: the host's checks and waits
        // above are not its time.
        timed[0].record(&self.copy)?;
        let idx = match (&mut self.cache, gather || fill) {
            // SAFETY: slot k's earlier work is done (above); the slot's indices are used
            // on the copy stream only.
            (Some(c), true) => Some(unsafe { c.upload(&self.copy, k, batch.indices()) }?),
            _ => None,
        };
        // The batch's raw rows in place: gathered from the cache, or copied (column by
        // column where the device augments, the images to the slot's own buffer).
        match (&self.cache, idx, &self.augment) {
            (Some(c), Some(idx), _) if gather => c.gather(&self.copy, &targets, idx, rows)?,
            // SAFETY: the batch passed the augmentation's check (above); each target
            // holds its column's rows, this lend's until the stream has run it (the
            // copy stream waits for every release of the slot, above); the batch stays
            // in `in_flight` until the copy has completed.
            (_, _, Some(a)) => unsafe { a.copy_raw(&self.copy, batch, &targets) }?,
            (_, _, None) => {
                let bytes = batch.as_bytes();
                // SAFETY: slot k holds `layout.bytes()` bytes, as does the batch's buffer
                // (its layout is the slots', checked above); the copy stream waits for
                // every consumer's release of the slot (just above), and the batch stays
                // in `in_flight` until the copy has completed.
                unsafe { result::memcpy_htod_async(s.ptrs[k], bytes, self.copy.cu_stream()) }?;
            }
        }
        if let Some(a) = &mut self.augment {
            // SAFETY: slot k holds `layout.bytes()` bytes, the augmented layout; the copy
            // stream waits for every release of the slot (above), and its earlier copies
            // are done; its raw rows are enqueued just above; the batch stays in
            // `in_flight` until this work has completed.
            unsafe { a.enqueue_kernel(&self.copy, k, batch, s.ptrs[k], &self.layout) }?;
        }
        // Before the event: a consumer may write to the batch in place (its arrays are
        // writeable), and the cache must keep the rows as the loader gave them.
        if let (Some(c), Some(idx), true) = (&mut self.cache, idx, fill) {
            c.fill(&self.copy, &targets, idx, batch.indices())?;
        }
        timed[1].record(&self.copy)?;
        s.copied[k].record(&self.copy)?;
        Ok(())
    }

    /// Releases the host batches whose copies are done, waiting for the oldest while
    /// more than `keep` remain.
    ///
    /// # Errors
    /// [`Error::CopyFailed`] naming the oldest batch whose copy was not seen complete
    /// when a wait failed, once every copy in flight is done (or failed) and their host
    /// batches are let go. A fault on the device (a sticky error) fails every wait after
    /// it, that batch's included, however early its own copy completed: the batch named
    /// is the one that failed or one before it (of the two still in flight).
    fn retire(&mut self, keep: usize) -> Result<()> {
        while let Some(InFlight { batch, slot, .. }) = self.in_flight.front() {
            let event = &self.shared.copied[*slot];
            let done = (|| -> Result<bool> {
                if self.in_flight.len() <= keep && !event.try_is_complete()? {
                    return Ok(false);
                }
                // Straight through the driver: cudarc's own wait would first return an
                // error a drop left in the context (not this copy's), as if it failed.
                super::wait_event(&self.shared.ctx, event)?;
                Ok(true)
            })();
            match done {
                Ok(false) => break,
                Ok(true) => {
                    let done = self.in_flight.pop_front().expect("the front is there");
                    let [start, end] = &done.timed;
                    // Both are complete (recorded before `copied`, seen complete).
                    if let Ok(ms) = start.elapsed_ms(end) {
                        self.clock
                            .add(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3));
                    }
                    self.spare_timed.push(done.timed);
                }
                Err(e) => {
                    let (batch, epoch) = (batch.number(), batch.epoch());
                    // No host buffer goes back while a copy may still read it.
                    let _ = super::settle(&self.shared.ctx);
                    self.in_flight.clear();
                    // What the failed copies scattered is not trusted.
                    if let Some(c) = &mut self.cache {
                        c.forget();
                    }
                    return Err(Error::copy_failed(epoch, batch, e));
                }
            }
        }
        Ok(())
    }

    /// Waits for a free slot and keeps it for [`lend_reserved`](DeviceSlots::lend_reserved):
    /// a loop that takes batches from an epoch learns that every slot stays lent before
    /// it takes one (a batch taken and then refused a slot would be lost to it, though
    /// the epoch's state counts it). Each thread that takes batches keeps its own;
    /// dropped unused, the slot is free again.
    ///
    /// # Errors
    /// [`Error::SlotsExhausted`], as [`lend`](DeviceSlots::lend);
    /// [`Error::Interrupted`] when the check given to
    /// [`interrupt_with`](DeviceSlots::interrupt_with) stopped the wait.
    pub fn reserve(&mut self) -> Result<Reserved> {
        let k = self.take_slot(true)?;
        Ok(Reserved {
            shared: Arc::clone(&self.shared),
            slot: Some(k),
        })
    }

    /// Has [`reserve`](DeviceSlots::reserve) call `check` every 20 ms while it waits for
    /// a slot (a batch kept on another thread may be kept indefinitely), with no lock
    /// of the slots held: once `check` returns `true`, `reserve` returns
    /// [`Error::Interrupted`] at once, and the next call waits again from where this one
    /// stood (a wait cut into pieces still ends in [`Error::SlotsExhausted`] after the
    /// same grace; time between the pieces does not count). The wait of a
    /// [`lend`](DeviceSlots::lend) is not interrupted: its batch is in hand. For a host
    /// that must stay responsive (Python's Ctrl-C).
    pub fn interrupt_with(&mut self, check: impl FnMut() -> bool + Send + Sync + 'static) {
        self.interrupt = Some(Box::new(check));
    }

    /// A free slot: the one released last. Waits while none is free; `interruptible`:
    /// the interrupt check may stop the wait.
    fn take_slot(&mut self, interruptible: bool) -> Result<usize> {
        let slots = self.slots();
        let shared = Arc::clone(&self.shared);
        // Waited with every slot lent and none ever handed on.
        let mut stuck = std::mem::take(&mut self.stuck);
        loop {
            let started = Instant::now();
            let mut free = lock(&shared.free);
            if let Some(k) = free.pop() {
                return Ok(k);
            }
            // Sticky: once set, the wait never ends in an error.
            let alone = !shared.handed_on.load(Ordering::Acquire);
            if alone && stuck >= EXHAUSTED_GRACE {
                return Err(Error::SlotsExhausted { slots });
            }
            free = shared
                .available
                .wait_timeout(free, Duration::from_millis(20))
                .unwrap_or_else(|e| e.into_inner())
                .0;
            let got = free.pop();
            // The check runs with no lock held (it may drop a batch, which takes it).
            drop(free);
            if let Some(k) = got {
                return Ok(k);
            }
            if alone {
                stuck += started.elapsed();
            }
            if let Some(check) = self.interrupt.as_mut().filter(|_| interruptible) {
                if check() {
                    self.stuck = stuck;
                    return Err(Error::Interrupted);
                }
            }
        }
    }

    /// Waits for every copy enqueued so far and releases the host batches. Called at
    /// the end of an epoch, it finds a failed copy of the epoch's last batches there,
    /// not at the next epoch's first lend.
    ///
    /// # Errors
    /// [`Error::CopyFailed`], as [`lend`](DeviceSlots::lend); [`Error::Cuda`] on a
    /// driver error.
    pub fn drain(&mut self) -> Result<()> {
        let _current = KeepCurrent::new();
        self.retire(0)?;
        if let Err(e) = self.copy.synchronize() {
            // A scatter into the device cache may be what failed.
            if let Some(c) = &mut self.cache {
                c.forget();
            }
            return Err(e.into());
        }
        Ok(())
    }
}

impl Drop for DeviceSlots {
    fn drop(&mut self) {
        self.restore = Some(Restore::now());
        // No pinned buffer goes back to the loader while a copy may still read it.
        if self.copy.synchronize().is_err() {
            let _ = super::settle(&self.shared.ctx);
        }
        self.in_flight.clear();
    }
}

/// A free device slot kept for one [`DeviceSlots::lend_reserved`]
/// ([`DeviceSlots::reserve`]); dropped unused, the slot is free again.
#[must_use = "a reserved slot is given to lend_reserved; dropped, it is free again"]
pub struct Reserved {
    shared: Arc<Shared>,
    slot: Option<usize>,
}

impl Reserved {
    /// The slot, now the caller's to fill or give back.
    fn take(mut self) -> usize {
        self.slot
            .take()
            .expect("a reservation holds its slot until taken")
    }
}

impl std::fmt::Debug for Reserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reserved")
            .field("slot", &self.slot)
            .finish()
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(k) = self.slot.take() {
            // Nothing was copied into it: it goes back as it was.
            self.shared.release(k, &[]);
        }
    }
}

/// A batch in a device slot, lent to the caller: [`wait_on`](LentBatch::wait_on) before
/// reading it on a stream. The slot is copied into again only after every stream named
/// has passed the point where the batch was dropped.
pub struct LentBatch {
    shared: Arc<Shared>,
    layout: Arc<BatchLayout>,
    slot: usize,
    len: usize,
    epoch: u64,
    number: u64,
    indices: Vec<u64>,
    owner: ThreadId,
    /// The streams named to `wait_on`, each once.
    streams: Mutex<Vec<StreamHandle>>,
}

impl std::fmt::Debug for LentBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentBatch")
            .field("slot", &self.slot)
            .field("epoch", &self.epoch)
            .field("number", &self.number)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl LentBatch {
    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch has no samples.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The epoch it belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Its number in the epoch.
    pub fn number(&self) -> u64 {
        self.number
    }

    /// The samples (global indices), on the host.
    pub fn indices(&self) -> &[u64] {
        &self.indices
    }

    /// Where the columns sit in the slot.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// The slot it was lent (for tests and traces).
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The device address of column `c`'s first row; its rows follow one another.
    ///
    /// # Panics
    /// If `c` is not a column of the layout.
    pub fn column_ptr(&self, c: usize) -> u64 {
        self.shared.ptrs[self.slot] + self.layout.offset(c) as u64
    }

    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.shared.ctx.ordinal()
    }

    /// Makes `stream` wait on the device for the batch's copy (the host does not wait),
    /// and remembers it: the slot is reused only after `stream` has run what was
    /// enqueued on it before the batch is dropped (the release is recorded on it then).
    ///
    /// # Safety
    /// `stream` is [`LEGACY_STREAM`], [`PER_THREAD_STREAM`] or a stream of the batch's
    /// context that stays alive, and is not destroyed (its handle reused for another
    /// stream), until the batch is dropped, as DLPack's `stream` promises. Anything
    /// else is undefined.
    ///
    /// # Errors
    /// [`Error::Config`] for a stream of another context (another device's: the driver
    /// would let it wait, but the slot's release could not be recorded on it);
    /// [`Error::Cuda`] when the driver refuses the stream (not a stream).
    pub unsafe fn wait_on(&self, stream: StreamHandle) -> Result<()> {
        let _current = KeepCurrent::new();
        self.touch();
        let s = &*self.shared;
        s.ctx.bind_to_thread()?;
        if stream > PER_THREAD_STREAM {
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: writes the stream's context into `ctx`; the stream is valid by
            // this function's contract.
            let rc = unsafe { sys::cuStreamGetCtx(stream as sys::CUstream, &mut ctx) };
            rc.result()?;
            if ctx != s.ctx.cu_ctx() {
                return Err(Error::Config(format!(
                    "the consumer's stream belongs to another CUDA context than the \
                     batch's (device {}): name a stream of that device",
                    s.ctx.ordinal()
                )));
            }
        }
        let event = s.copied[self.slot].cu_event();
        // SAFETY: the event is live (owned by `shared`, which `self` holds); the stream
        // is valid by this function's contract.
        unsafe {
            result::stream::wait_event(
                stream as sys::CUstream,
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }?;
        let mut streams = lock(&self.streams);
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        Ok(())
    }

    /// Names `stream` as one the batch is used on, without waiting for the copy on it
    /// (the caller has ordered it otherwise, as DLPack's `stream=-1` promises).
    ///
    /// # Safety
    /// As [`wait_on`](LentBatch::wait_on): the release is recorded on `stream` when the
    /// batch is dropped.
    pub unsafe fn used_on(&self, stream: StreamHandle) {
        self.touch();
        let mut streams = lock(&self.streams);
        if !streams.contains(&stream) {
            streams.push(stream);
        }
    }

    /// Waits on the host until the batch's copy is done.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    pub fn synchronize(&self) -> Result<()> {
        let _current = KeepCurrent::new();
        self.touch();
        Ok(self.shared.copied[self.slot].synchronize()?)
    }

    /// Notes a use or a drop on a thread other than the one the batch was lent to: the
    /// ring then waits for slots however long that takes (see `Shared::handed_on`).
    fn touch(&self) {
        let handed_on = &self.shared.handed_on;
        if !handed_on.load(Ordering::Relaxed) && std::thread::current().id() != self.owner {
            handed_on.store(true, Ordering::Release);
        }
    }
}

impl Drop for LentBatch {
    fn drop(&mut self) {
        let streams = std::mem::take(&mut *lock(&self.streams));
        let streams = match streams.is_empty() {
            true => vec![LEGACY_STREAM],
            false => streams,
        };
        self.touch();
        self.shared.release(self.slot, &streams);
    }
}
