//! The feeder: pinned batches into a ring of device slots on a copy stream, handed to
//! work on a compute stream, ordered by events. The built-in training step and users'
//! own kernels both run on the [`DeviceBatch`]es it yields.
//!
//! For batch `i` in slot `k = i % K`:
//! 1. the copy stream waits for `consumed[k]` (the work that last read slot `k`),
//! 2. `cuMemcpyHtoDAsync` from the pinned `HostBatch` into slot `k`, then `copied[k]`,
//! 3. the compute stream waits for `copied[k]`; the caller's work is enqueued on it;
//!    then `consumed[k]` is recorded,
//! 4. the `HostBatch` (its pinned buffer) goes back to the loader once `copied[k]` has
//!    completed, never before.
//!
//! The host blocks only as back-pressure: with `K` batches in flight it waits for the
//! oldest copy, and before refilling a slot it waits for that slot's last work (whose
//! timing it then reads).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};

use super::resident::Resident;
use super::Cuda;
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, Epoch, EpochStats, HostBatch};
use crate::telemetry::{stalled, Stage, Trace, Track};

/// The device address of a slice's first element.
pub(crate) fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

/// A batch in device memory, ready on [`stream`](DeviceBatch::stream): enqueue work
/// that reads it there. The slot is reused only after that work completes.
#[derive(Debug)]
pub struct DeviceBatch<'a> {
    base: u64,
    layout: &'a BatchLayout,
    stream: &'a Arc<CudaStream>,
    len: usize,
    epoch: u64,
    number: u64,
    indices: &'a [u64],
    cached: bool,
}

impl<'a> DeviceBatch<'a> {
    pub(crate) fn new(
        base: u64,
        layout: &'a BatchLayout,
        stream: &'a Arc<CudaStream>,
        len: usize,
        epoch: u64,
        number: u64,
        indices: &'a [u64],
    ) -> DeviceBatch<'a> {
        DeviceBatch {
            base,
            layout,
            stream,
            len,
            epoch,
            number,
            indices,
            cached: false,
        }
    }

    /// The same batch, marked as gathered from the device cache or not.
    pub(crate) fn with_cached(mut self, cached: bool) -> DeviceBatch<'a> {
        self.cached = cached;
        self
    }
}

impl DeviceBatch<'_> {
    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch is empty (never, for batches a loader yields).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of column `c` (`len() * row_bytes` bytes, 256-byte aligned).
    ///
    /// # Panics
    /// If `c` is not a column.
    pub fn column_ptr(&self, c: usize) -> u64 {
        self.base + self.layout.offset(c) as u64
    }

    /// The layout of the slot (column offsets, row sizes).
    pub fn layout(&self) -> &BatchLayout {
        self.layout
    }

    /// The stream the batch is ready on: enqueue work reading it here.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }

    /// The epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The batch number within the epoch.
    pub fn number(&self) -> u64 {
        self.number
    }

    /// The dataset indices of its samples (host memory).
    pub fn indices(&self) -> &[u64] {
        self.indices
    }

    /// Whether it was gathered from the device cache (a cached epoch, whose work may be
    /// captured in a CUDA graph: see [`Feeder::replay_cached_epochs`]) rather than
    /// copied from the host.
    pub fn from_cache(&self) -> bool {
        self.cached
    }
}

/// What the feeder measured over an epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct FeedStats {
    /// Batches fed.
    pub batches: u64,
    /// Samples fed.
    pub samples: u64,
    /// Host time waiting for the loader.
    pub wait_data: Duration,
    /// Device time of the copies (sum of copy events).
    pub copy: Duration,
    /// Device time the compute stream stood idle while a batch's copy ran: for each
    /// batch, from the later of the previous batch's end and its copy's start to the
    /// earlier of its copy's end and its work's start. A copy overlapped with the work
    /// on the batches before it costs none.
    pub stall_copy: Duration,
    /// Device time of the work on each batch (sum of its events).
    pub compute: Duration,
    /// Bytes copied host to device.
    pub bytes: u64,
    /// The loader's statistics.
    pub loader: EpochStats,
    /// Wall time.
    pub wall: Duration,
    /// Whether the epoch came from the device cache (no loader, no batch copies: only its
    /// index list, and its draws when the device augments).
    pub cached: bool,
}

/// Copies batches to the device, overlapped with the work on them; optionally keeps the
/// dataset on the device and augments batches there (see the methods from
/// [`enable_device_cache`](Feeder::enable_device_cache) on).
pub struct Feeder {
    pub(super) cuda: Cuda,
    copy: Arc<CudaStream>,
    pub(super) compute: Arc<CudaStream>,
    pub(super) layout: BatchLayout,
    slots: Vec<CudaSlice<u8>>,
    copy_start: Vec<CudaEvent>,
    copied: Vec<CudaEvent>,
    work_start: Vec<CudaEvent>,
    consumed: Vec<CudaEvent>,
    /// Recorded when an epoch starts: device times in the trace are measured from it.
    epoch_start: CudaEvent,
    /// The batch number each slot last held (for trace spans).
    slot_batch: Vec<u64>,
    pub(super) trace: Option<Arc<Trace>>,
    /// The device cache, the augmentation and the cached epochs' graph.
    pub(super) resident: Resident,
}

impl Feeder {
    /// A feeder with `slots` device slots (at least 2) for batches of `layout`, on its
    /// own copy and compute streams.
    ///
    /// The feeder works through a context object of its own over the same device
    /// context (cudarc's `CudaContext` for the device's primary context, which `cuda.ctx`
    /// is), with cudarc's event tracking off: it orders everything it touches with its
    /// own events, and work enqueued on [`DeviceBatch::stream`] is ordered by that
    /// stream. Slices made through `cuda.ctx` keep their tracking. (A `cuda.ctx` that is
    /// not a primary context is used as it is, its tracking turned off.)
    ///
    /// # Errors
    /// [`Error::Cuda`] when a stream, event or slot cannot be created.
    pub fn new(cuda: &Cuda, layout: &BatchLayout, slots: usize) -> Result<Feeder> {
        let own = CudaContext::new(cuda.ctx.ordinal())?;
        let cuda = match *own == *cuda.ctx {
            true => Cuda {
                ctx: own,
                ..cuda.clone()
            },
            false => cuda.clone(),
        };
        let ctx = &Arc::clone(&cuda.ctx);
        // SAFETY: every buffer the feeder and the trainer make through this context
        // object is ordered by the events and streams described in the module docs, so
        // cudarc's per-slice tracking is not needed; the user's slices are made through
        // another object (unless they gave a context that is not the primary one).
        unsafe { ctx.disable_event_tracking() };
        let copy = ctx.new_stream()?;
        let compute = ctx.new_stream()?;
        let k = slots.max(2);
        // Timing on, and a host wait sleeps instead of spinning a core the loader needs.
        let timing = Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
        let events = |n: usize| -> Result<Vec<CudaEvent>> {
            (0..n)
                .map(|_| ctx.new_event(timing).map_err(Error::from))
                .collect()
        };
        let slots = (0..k)
            .map(|_| {
                compute
                    .alloc_zeros::<u8>(layout.bytes())
                    .map_err(Error::from)
            })
            .collect::<Result<Vec<_>>>()?;
        compute.synchronize()?;
        Ok(Feeder {
            epoch_start: ctx.new_event(timing)?,
            slot_batch: vec![0; k],
            trace: None,
            resident: Resident::default(),
            cuda,
            copy_start: events(k)?,
            copied: events(k)?,
            work_start: events(k)?,
            consumed: events(k)?,
            copy,
            compute,
            layout: layout.clone(),
            slots,
        })
    }

    /// The device.
    pub fn cuda(&self) -> &Cuda {
        &self.cuda
    }

    /// Serialised mode, the baseline of the overlap benchmark: copies go on the compute
    /// stream, so each batch's copy and work run one after the other.
    ///
    /// # Errors
    /// [`Error::Cuda`] if a new copy stream cannot be made when leaving serial mode.
    pub fn set_serial(&mut self, serial: bool) -> Result<()> {
        self.copy = if serial {
            Arc::clone(&self.compute)
        } else {
            self.cuda.ctx.new_stream()?
        };
        Ok(())
    }

    /// Milliseconds of slot `k`'s last copy (both events complete), recorded as a trace
    /// span on the copy stream's track when tracing.
    fn copy_done(&self, k: usize, at: (Instant, u64)) -> Result<f64> {
        let pair = (&self.copy_start[k], &self.copied[k]);
        self.device_time(pair, (Stage::Copy, Track::Copy), k, at)
    }

    /// Milliseconds of the work on slot `k`'s last batch, traced on the compute stream.
    fn work_done(&self, k: usize, at: (Instant, u64)) -> Result<f64> {
        let pair = (&self.work_start[k], &self.consumed[k]);
        self.device_time(pair, (Stage::Compute, Track::Compute), k, at)
    }

    /// Milliseconds the compute stream stood idle for slot `k`'s last copy, its work
    /// and its copy complete: from the later of the previous batch's end (`prev_end`,
    /// milliseconds after the epoch's start, which moves to this batch's end) and the
    /// copy's start, to the earlier of the copy's end and the work's start.
    fn copy_stall(&self, k: usize, prev_end: &mut f64) -> Result<f64> {
        let at = |e: &CudaEvent| self.epoch_start.elapsed_ms(e).map(f64::from);
        let (copy_start, copied) = (at(&self.copy_start[k])?, at(&self.copied[k])?);
        let (start, end) = (at(&self.work_start[k])?, at(&self.consumed[k])?);
        let idle = (copied.min(start) - prev_end.max(copy_start)).max(0.0);
        *prev_end = end;
        Ok(idle)
    }

    /// The time between two completed events; when tracing, also a span placing device
    /// time relative to `epoch_start` (recorded at host instant `t0`).
    fn device_time(
        &self,
        (a, b): (&CudaEvent, &CudaEvent),
        (stage, track): (Stage, Track),
        k: usize,
        (t0, epoch): (Instant, u64),
    ) -> Result<f64> {
        let ms = a.elapsed_ms(b)?;
        if let Some(tr) = self.trace.as_deref() {
            let origin = &self.epoch_start;
            if let (Ok(sa), Ok(sb)) = (origin.elapsed_ms(a), origin.elapsed_ms(b)) {
                let at = |ms: f32| t0 + Duration::from_secs_f64(ms.max(0.0) as f64 / 1e3);
                tr.span(stage, track, (at(sa), at(sb)), epoch, self.slot_batch[k]);
            }
        }
        Ok(ms as f64)
    }

    /// A span of the feeding thread, from `start` to now, when tracing.
    fn host_span(&self, stage: Stage, start: Instant, epoch: u64, batch: u64) {
        if let Some(tr) = self.trace.as_deref() {
            tr.span(stage, Track::Feed, (start, Instant::now()), epoch, batch);
        }
    }

    /// Records spans into `trace` from now on: gather on each loader worker, and the
    /// copies and the work on each batch as the device ran them (from the events).
    pub fn set_trace(&mut self, trace: Arc<Trace>) {
        self.trace = Some(trace);
    }

    /// `batch`, copied into slot `k`, as work on the compute stream sees it.
    fn in_slot<'b>(&'b self, k: usize, batch: &'b HostBatch) -> DeviceBatch<'b> {
        let base = addr(&self.slots[k], &self.compute);
        let (epoch, number) = (batch.epoch(), batch.number());
        let (layout, stream) = (&self.layout, &self.compute);
        DeviceBatch::new(
            base,
            layout,
            stream,
            batch.len(),
            epoch,
            number,
            batch.indices(),
        )
    }

    /// The layout of the batches it feeds.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// The compute stream, on which every [`DeviceBatch`] is ready.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// Copies one batch into slot 0 and waits for it (for one-off steps and tests);
    /// `work` gets it augmented when the device augments.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    pub fn feed_one<R>(
        &mut self,
        batch: &HostBatch,
        work: impl FnOnce(&DeviceBatch) -> Result<R>,
    ) -> Result<R> {
        self.layout.check_batch(batch)?;
        self.cuda.ctx.bind_to_thread()?;
        self.resident.before_one(batch)?;
        let dst = addr(&self.slots[0], &self.copy);
        // SAFETY: slot 0 holds `layout.bytes()` bytes, the batch buffer as many (its
        // layout is the slots', checked above); the copy is waited for before this
        // returns, so the batch outlives it.
        unsafe { result::memcpy_htod_async(dst, batch.as_bytes(), self.copy.cu_stream()) }?;
        super::wait_stream(&self.copy)?;
        let db = self.in_slot(0, batch);
        let worked = match self.resident.for_work(&db, 0) {
            Ok(augmented) => work(augmented.as_ref().unwrap_or(&db)),
            Err(e) => Err(e),
        };
        // What `work` enqueued reads slot 0, error or not: done before the next copy.
        super::wait_stream(&self.compute)?;
        worked
    }

    /// Feeds every batch of `epoch`, calling `work` on each once it is on the device
    /// (augmented, when the device augments). `work` must only enqueue (never wait for
    /// the device); `progress(samples, stalled)` follows each batch. A whole epoch
    /// fills an enabled device cache on the way; with
    /// [`replay_cached_epochs`](Feeder::replay_cached_epochs) on, it then also captures
    /// a cached epoch's work (`work` called once more per batch, on batches
    /// [`from_cache`](DeviceBatch::from_cache)), counted in its wall time.
    ///
    /// # Errors
    /// The loader's first error, `work`'s first error, or a driver error;
    /// [`Error::Alloc`] for the staging of more draws.
    pub fn run_epoch(
        &mut self,
        mut epoch: Epoch<'_>,
        work: &mut dyn FnMut(&DeviceBatch) -> Result<()>,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<FeedStats> {
        let start = Instant::now();
        let k_slots = self.slots.len();
        // Up to K - 1 batches stay in flight while the next is asked for: the loader
        // needs more buffers than that, or it would wait for buffers only we can free.
        if epoch.buffers() < k_slots + 1 {
            return Err(Error::Config(format!(
                "the feeder keeps up to {} batches in flight: build the loader with at least \
                 {} buffers (prefetch + held), it has {}",
                k_slots - 1,
                k_slots + 1,
                epoch.buffers()
            )));
        }
        let t0 = Instant::now();
        self.epoch_start.record(&self.copy)?;
        let filling = self.resident.before_fed(&epoch, &self.compute)?;
        let order = epoch.order().clone();
        let epoch_no = epoch.epoch();
        let mut stats = FeedStats::default();
        let mut inflight: VecDeque<(HostBatch, usize)> = VecDeque::with_capacity(k_slots);
        let (mut copy_ms, mut work_ms) = (0f64, 0f64);
        // The compute stream's idle time for copies, and where its last batch ended.
        let (mut stall_ms, mut prev_end) = (0f64, 0f64);
        let mut i = 0usize;
        // A panic of `work` or `progress` is caught until the clean-up below has run:
        // unwinding through here would hand the pinned buffers back with copies reading
        // them.
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| -> Result<()> {
            loop {
                let t = Instant::now();
                let Some(batch) = epoch.next() else {
                    return Ok(());
                };
                stats.wait_data += t.elapsed();
                self.host_span(Stage::WaitData, t, epoch_no, i as u64);
                let batch = batch?;
                self.layout.check_batch(&batch)?;
                let k = i % k_slots;
                if i >= k_slots {
                    let t = Instant::now();
                    self.consumed[k].synchronize()?;
                    self.host_span(Stage::WaitSlot, t, epoch_no, i as u64);
                    work_ms += self.work_done(k, (t0, epoch_no))?;
                    stall_ms += self.copy_stall(k, &mut prev_end)?;
                }
                if let Some(tr) = self.trace.as_deref() {
                    tr.gather(&batch);
                }
                self.slot_batch[k] = batch.number();
                self.copy.wait(&self.consumed[k])?;
                self.copy_start[k].record(&self.copy)?;
                let dst = addr(&self.slots[k], &self.copy);
                let bytes = batch.as_bytes().len() as u64;
                // SAFETY: slot k holds `layout.bytes()` bytes, as does the pinned batch
                // (its layout is the slots', checked above);
                // the batch goes into `inflight` right away and stays there until
                // `copied[k]` has completed (or, on any error, until the copy stream is
                // synchronised in the clean-up below).
                unsafe { result::memcpy_htod_async(dst, batch.as_bytes(), self.copy.cu_stream()) }?;
                inflight.push_back((batch, k));
                let (batch, _) = inflight.back().expect("just pushed");
                self.copied[k].record(&self.copy)?;
                self.compute.wait(&self.copied[k])?;
                self.work_start[k].record(&self.compute)?;
                let db = self.in_slot(k, batch);
                let worked = self.resident.fed(&db, filling, &mut *work);
                // Record even after an error, so the slot's ordering stays sound.
                self.consumed[k].record(&self.compute)?;
                worked?;
                stats.batches += 1;
                stats.samples += batch.len() as u64;
                stats.bytes += bytes;
                progress(
                    batch.len() as u64,
                    stalled(stats.wait_data, start.elapsed()),
                );
                // Pinned buffers go back once their copies are done; at most K - 1 stay
                // in flight, so a slot's previous batch is always released first.
                while let Some(&(_, k0)) = inflight.front() {
                    if inflight.len() < k_slots && !self.copied[k0].try_is_complete()? {
                        break;
                    }
                    let t = Instant::now();
                    self.copied[k0].synchronize()?;
                    self.host_span(Stage::WaitCopy, t, epoch_no, self.slot_batch[k0]);
                    copy_ms += self.copy_done(k0, (t0, epoch_no))?;
                    inflight.pop_front();
                }
                i += 1;
            }
        }));
        // Whatever happened, no pinned buffer goes back, and no slot is freed, before
        // every copy enqueued so far is done.
        let drained = (|| -> Result<()> {
            // Both streams waited for, whatever the first says: the slots are freed on
            // the compute stream, not after the copy stream's writes.
            let copies = super::wait_stream(&self.copy);
            let steps = super::wait_stream(&self.compute);
            copies?;
            steps?;
            for (_, k0) in inflight.drain(..) {
                self.copied[k0].synchronize()?;
                copy_ms += self.copy_done(k0, (t0, epoch_no))?;
            }
            for j in i.saturating_sub(k_slots)..i {
                let k = j % k_slots;
                work_ms += self.work_done(k, (t0, epoch_no))?;
                stall_ms += self.copy_stall(k, &mut prev_end)?;
            }
            Ok(())
        })();
        let result = match result {
            Ok(result) => result,
            // The streams are settled: the panic goes on.
            Err(panic) => std::panic::resume_unwind(panic),
        };
        result?;
        drained?;
        if filling {
            let compute = Arc::clone(&self.compute);
            self.resident
                .after_fed(&compute, &order, work)
                .map_err(|e| after_whole(e, order.epoch()))?;
        }
        stats.loader = epoch.stats();
        stats.copy = Duration::from_secs_f64(copy_ms / 1e3);
        stats.compute = Duration::from_secs_f64(work_ms / 1e3);
        stats.stall_copy = Duration::from_secs_f64(stall_ms / 1e3);
        stats.wall = start.elapsed();
        Ok(stats)
    }
}

/// `e`, from the capture of a cached epoch's work after epoch `epoch` was fed whole, said
/// so: the epoch's work ran and the loader's state is past it (fed again, it would be
/// trained on twice), and only its capture for replay failed.
fn after_whole(e: Error, epoch: u64) -> Error {
    let say = |m: &str| {
        format!(
            "epoch {epoch} ran whole (the loader's state is past it); capturing its work \
             for replay then failed: {m}"
        )
    };
    match e {
        Error::Cuda { code, message } => Error::Cuda {
            code,
            message: say(&message),
        },
        Error::Config(m) => Error::Config(say(&m)),
        other => other,
    }
}
