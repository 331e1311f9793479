//! The consumer's side of an epoch: in-order delivery, early stop, state.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use super::batch::{BatchTiming, HostBatch};
use super::worker::{Done, Job};
use super::{LoaderState, Storage};
use crate::error::{Error, Result};

/// How long `next()` waits before checking whether progress is still possible.
const STALL_CHECK: Duration = Duration::from_millis(50);

/// How long the consumer may hold every buffer, releasing none, before `next()` calls it
/// a deadlock (where no batch of the loader was ever read or dropped on another
/// thread). Long enough for a thread that was handed a batch to start reading it.
const EXHAUSTED_GRACE: Duration = Duration::from_secs(1);

/// What the consumer side of an epoch measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct EpochStats {
    /// Batches delivered.
    pub batches: u64,
    /// Samples delivered.
    pub samples: u64,
    /// Sum of the workers' gather times for delivered batches.
    pub gather: Duration,
    /// Time the consumer spent blocked in `next()`.
    pub waited: Duration,
    /// Calls to `next()` that found their batch not ready and had to block.
    pub stalls: u64,
    /// From the epoch's start to its first batch.
    pub first_batch: Option<Duration>,
    /// What storage did for this epoch's data: warm, warming or streaming.
    pub storage: Storage,
    /// Bytes this process read from storage since the epoch started (`/proc/self/io`);
    /// `None` where the kernel does not say (no `/proc`, a kernel without task I/O
    /// accounting), and in [`Epoch::counts`].
    pub bytes_read: Option<u64>,
}

impl EpochStats {
    /// These figures with `bytes_read` counted now: what this process has read from
    /// storage since its counter read `start` ([`Epoch::read_at_start`]); `None` where
    /// the kernel does not say.
    pub fn with_reads_since(self, start: Option<u64>) -> EpochStats {
        let read = crate::pagecache::storage_read_bytes();
        EpochStats {
            bytes_read: read.zip(start).map(|(n, s)| n.saturating_sub(s)),
            ..self
        }
    }
}

/// One epoch of batches, in order: an [`ExactSizeIterator`] of `Result<HostBatch>`.
///
/// An error (a failed read, a worker panic, a deadlock) is yielded once and ends the
/// epoch, so the iterator can yield fewer items than `len()` promised;
/// [`state`](Epoch::state) then points at the batch that failed, ready for a resume
/// (`loader.resume(loader.state())` goes on from it; `loader.epoch(e)` alone starts the
/// epoch again once it had delivered a batch). Dropping the iterator stops the
/// workers (each finishes at most the batch in hand), and returns every buffer not held
/// by a [`HostBatch`] before `drop` returns.
pub struct Epoch<'a> {
    state: &'a mut LoaderState,
    job: Arc<Job>,
    results: Receiver<Done>,
    finished: Receiver<()>,
    pending: Vec<Option<Done>>,
    next: u64,
    first: u64,
    done: bool,
    started: Instant,
    stats: EpochStats,
    read_at_start: Option<u64>,
    /// Asked while `next()` waits ([`Epoch::interrupt_with`]).
    interrupt: Option<Interrupt>,
    /// Where an interrupted wait stood, for the next `next()` to go on from: it had
    /// stalled, and since when (and at which release count) every buffer was held.
    paused: Option<Option<(Instant, u64)>>,
}

/// A check that `next()` makes while it waits: `true` stops the wait.
type Interrupt = Box<dyn FnMut() -> bool + Send>;

impl EpochStats {
    /// Bytes read from storage over the sample bytes delivered, for samples of
    /// `bytes_per_sample`: 1.0 reads each byte used once; above 1, storage read bytes no
    /// batch used (whole pages, read-around). `None` where the bytes read are not known.
    pub fn read_amplification(&self, bytes_per_sample: u64) -> Option<f64> {
        let used = self.samples.saturating_mul(bytes_per_sample).max(1) as f64;
        self.bytes_read.map(|read| read as f64 / used)
    }
}

impl<'a> Epoch<'a> {
    pub(crate) fn new(
        state: &'a mut LoaderState,
        job: Arc<Job>,
        results: Receiver<Done>,
        finished: Receiver<()>,
        start: u64,
        read_at_start: Option<u64>,
    ) -> Epoch<'a> {
        let ring = job.pool.size();
        Epoch {
            state,
            job,
            results,
            finished,
            pending: (0..ring).map(|_| None).collect(),
            next: start,
            first: start,
            done: false,
            started: Instant::now(),
            stats: EpochStats::default(),
            read_at_start,
            interrupt: None,
            paused: None,
        }
    }

    /// Has `next()` call `check` every 50 ms while it waits for a batch: once `check`
    /// returns `true`, `next()` returns [`Error::Interrupted`] at once. The epoch is not
    /// ended, and no batch is taken: the next `next()` waits for the same batch, going
    /// on from where the interrupted wait stood (a wait cut into pieces still ends in
    /// [`Error::PoolExhausted`] after the same grace). For a host that must stay
    /// responsive while it waits (Python's Ctrl-C: its bindings stop the wait, check
    /// for signals outside the epoch's lock, and wait again).
    pub fn interrupt_with(&mut self, check: impl FnMut() -> bool + Send + 'static) {
        self.interrupt = Some(Box::new(check));
    }

    /// The epoch number.
    pub fn epoch(&self) -> u64 {
        self.job.order.epoch()
    }

    /// The epoch's order (every batch's indices, computable without the loader).
    pub fn order(&self) -> &crate::sampler::EpochOrder {
        &self.job.order
    }

    /// Host buffers in the loader's pool: how many batches a consumer can hold at once.
    pub fn buffers(&self) -> usize {
        self.job.pool.size()
    }

    /// The first batch this iterator yields (0 unless resumed mid-epoch).
    pub fn first_batch(&self) -> u64 {
        self.first
    }

    /// A handle that stops this epoch from another thread: for a thread that owns the
    /// epoch and may be waiting in [`next`](Iterator::next) (for a buffer that batches
    /// held elsewhere keep, say) while another must end it.
    pub fn canceller(&self) -> Canceller {
        Canceller(Arc::clone(&self.job))
    }

    /// Where a loader resumed from this point would start: this epoch, after the batches
    /// delivered so far.
    pub fn state(&self) -> LoaderState {
        *self.state
    }

    /// What the consumer side measured so far.
    pub fn stats(&self) -> EpochStats {
        self.counts().with_reads_since(self.read_at_start)
    }

    /// [`stats`](Epoch::stats) bar `bytes_read` (left `None`), without the system call that
    /// reads the storage counter: cheap enough to take after every batch, for a view of
    /// the epoch that another thread reads (with [`read_at_start`](Epoch::read_at_start)
    /// for the bytes read).
    pub fn counts(&self) -> EpochStats {
        EpochStats {
            storage: self.job.storage,
            bytes_read: None,
            ..self.stats
        }
    }

    /// When the epoch started (its workers were handed it): what its `first_batch` is
    /// measured from, and where a timer of the epoch starts.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The process's storage read counter (`read_bytes` of `/proc/self/io`) when the
    /// epoch started, which `stats().bytes_read` counts from; `None` where the kernel
    /// does not say.
    pub fn read_at_start(&self) -> Option<u64> {
        self.read_at_start
    }

    fn deliver(&mut self, done: Done, asked: Instant, waited: Duration) -> Result<HostBatch> {
        let rows = match done.result {
            Ok(rows) => rows,
            Err(e) => {
                self.done = true;
                self.job.cancel();
                return Err(e);
            }
        };
        let timing = BatchTiming {
            worker: done.worker,
            gather_start: done.start,
            gather_end: done.end,
            asked,
            waited,
        };
        self.next += 1;
        self.job.delivered.store(self.next, Ordering::Release);
        self.state.batch = self.next;
        self.state.taken = self.job.order.taken(self.next);
        self.stats.batches += 1;
        self.stats.samples += rows as u64;
        self.stats.gather += done.end - done.start;
        self.stats.waited += waited;
        if self.stats.first_batch.is_none() {
            self.stats.first_batch = Some(self.started.elapsed());
        }
        Ok(HostBatch::new(
            done.lease,
            Arc::clone(&self.job.layout),
            rows,
            self.epoch(),
            done.number,
            timing,
            self.job.indices_only,
        ))
    }
}

impl Iterator for Epoch<'_> {
    type Item = Result<HostBatch>;

    fn next(&mut self) -> Option<Result<HostBatch>> {
        if self.done {
            return None;
        }
        if self.next >= self.job.end {
            self.finish();
            return None;
        }
        let asked = Instant::now();
        let ring = self.pending.len() as u64;
        let (mut stalled, mut stuck) = match self.paused.take() {
            Some(stuck) => (true, stuck),
            None => (false, None),
        };
        loop {
            let slot = (self.next % ring) as usize;
            if self.pending[slot]
                .as_ref()
                .is_some_and(|d| d.number == self.next)
            {
                let done = self.pending[slot].take().expect("checked above");
                self.stats.stalls += u64::from(stalled);
                return Some(self.deliver(done, asked, asked.elapsed()));
            }
            if let Ok(done) = self.results.try_recv() {
                let slot = (done.number % ring) as usize;
                debug_assert!(self.pending[slot].is_none(), "two batches in one slot");
                self.pending[slot] = Some(done);
                continue;
            }
            stalled = true;
            match self.results.recv_timeout(STALL_CHECK) {
                Ok(done) => {
                    let slot = (done.number % ring) as usize;
                    debug_assert!(self.pending[slot].is_none(), "two batches in one slot");
                    self.pending[slot] = Some(done);
                }
                Err(RecvTimeoutError::Timeout) => {
                    let pool = &self.job.pool;
                    // Every buffer held, and no batch ever read or dropped on another
                    // thread: only this thread can release one, and it waits here. Once
                    // one was (a training thread fed through a queue), batches held
                    // there, or still queued unread for it, will be released however
                    // slow its step is (it may drop its batch before its step).
                    if pool.held.load(Ordering::Acquire) >= pool.size()
                        && !pool.handed_on.load(Ordering::Acquire)
                    {
                        let released = pool.released.load(Ordering::Acquire);
                        match stuck {
                            Some((since, r)) if r == released => {
                                if since.elapsed() >= EXHAUSTED_GRACE {
                                    self.done = true;
                                    self.job.cancel();
                                    return Some(Err(Error::PoolExhausted {
                                        buffers: pool.size(),
                                    }));
                                }
                            }
                            _ => stuck = Some((Instant::now(), released)),
                        }
                    } else {
                        stuck = None;
                    }
                    if self.interrupt.as_mut().is_some_and(|check| check()) {
                        self.stats.waited += asked.elapsed();
                        self.paused = Some(stuck);
                        return Some(Err(Error::Interrupted));
                    }
                    if matches!(self.finished.try_recv(), Err(TryRecvError::Disconnected)) {
                        // Every worker has left the job: whatever it sent is queued.
                        while let Ok(done) = self.results.try_recv() {
                            let slot = (done.number % ring) as usize;
                            self.pending[slot] = Some(done);
                        }
                        let slot = (self.next % ring) as usize;
                        if !self.pending[slot]
                            .as_ref()
                            .is_some_and(|d| d.number == self.next)
                        {
                            self.done = true;
                            return Some(Err(Error::WorkersStopped { batch: self.next }));
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    unreachable!("the job holds the results sender while the epoch lives")
                }
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = if self.done {
            0
        } else {
            (self.job.end - self.next) as usize
        };
        (n, Some(n))
    }
}

impl ExactSizeIterator for Epoch<'_> {}

impl std::iter::FusedIterator for Epoch<'_> {}

/// Stops an [`Epoch`]'s workers from any thread ([`Epoch::canceller`]).
#[derive(Clone)]
pub struct Canceller(Arc<Job>);

impl Canceller {
    /// Stops the epoch's workers: each finishes at most the batch in hand, and those
    /// waiting for a buffer leave at once. A `next` waiting on the epoch then yields
    /// the batch if it was assembled, or else [`Error::WorkersStopped`] within 50 ms,
    /// and the epoch ends; its state stays where the delivered batches left it.
    pub fn cancel(&self) {
        self.0.cancel();
    }
}

impl std::fmt::Debug for Canceller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Canceller")
            .field("epoch", &self.0.order.epoch())
            .finish_non_exhaustive()
    }
}

impl Epoch<'_> {
    /// Ends an epoch every batch of which was delivered: the state moves to the next
    /// epoch's start.
    fn finish(&mut self) {
        self.done = true;
        self.state.epoch = self.epoch().saturating_add(1);
        self.state.batch = 0;
        self.state.start = 0;
        self.state.taken = 0;
    }
}

impl Drop for Epoch<'_> {
    fn drop(&mut self) {
        // Every batch delivered, but the `None` after the last never asked for (a loop
        // that stops at the count: `take(len)`, a zip): the epoch is whole all the same.
        if !self.done && self.next >= self.job.end {
            self.finish();
        }
        // Wakes workers waiting for a buffer; each then leaves the job.
        self.job.cancel();
        // Each worker drops its `finished` sender once it has left this job; the channel
        // disconnects when all of them have.
        while self.finished.recv().is_ok() {}
        // Every result is now in the channel or the ring; dropping them returns buffers.
        self.pending.clear();
        while self.results.try_recv().is_ok() {}
        self.job.closed.store(true, Ordering::Release);
    }
}

impl std::fmt::Debug for Epoch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Epoch")
            .field("epoch", &self.epoch())
            .field("next", &self.next)
            .field("end", &self.job.end)
            .finish_non_exhaustive()
    }
}
