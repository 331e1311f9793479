//! Persistent worker threads and the per-epoch job they share.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::batch::BatchLayout;
use super::direct::{Reader, Source};
use super::extents::{Extents, Scratch};
use super::pool::{Lease, Pool};
use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::sampler::EpochOrder;
use crate::util::panic_message;

/// What a worker hands back for one batch number.
pub(crate) struct Done {
    pub(crate) number: u64,
    pub(crate) lease: Lease,
    pub(crate) result: Result<usize>,
    pub(crate) worker: usize,
    pub(crate) start: Instant,
    pub(crate) end: Instant,
}

/// One epoch's work, shared by every worker.
pub(crate) struct Job {
    pub(crate) order: EpochOrder,
    pub(crate) dataset: Arc<dyn Dataset>,
    pub(crate) layout: Arc<BatchLayout>,
    pub(crate) pool: Arc<Pool>,
    /// The next batch number to claim.
    pub(crate) next: AtomicU64,
    pub(crate) end: u64,
    pub(crate) cancelled: AtomicBool,
    /// Set when the consumer's [`Epoch`](super::Epoch) has been dropped and every
    /// worker has left the job; still false afterwards only if the `Epoch` was leaked.
    pub(crate) closed: AtomicBool,
    pub(crate) results: Sender<Done>,
    /// Batches delivered to the consumer so far (the planner drops pages behind it).
    pub(crate) delivered: AtomicU64,
    /// What storage does this epoch, decided as it started.
    pub(crate) storage: super::Storage,
    /// Whether the epoch's rows are scattered over their files ([`plan::scattered`]):
    /// read one by one, not in runs with the pages between them.
    ///
    /// [`plan::scattered`]: super::plan::scattered
    pub(crate) scattered: bool,
    /// Each file's plan (mode and residency as the epoch started), for the planner to
    /// take.
    pub(crate) plans: std::sync::Mutex<Vec<super::plan::FilePlan>>,
    /// The files opened for direct reads, one per file, when the workers read rows
    /// straight from storage this epoch.
    pub(crate) direct: Option<Vec<Source>>,
    /// The extents the workers copy windowed files' rows from, when the planner reads
    /// them into the loader's buffers this epoch.
    pub(crate) extents: Option<Arc<Extents>>,
    /// The planner's thread, woken when a batch is claimed.
    pub(crate) planner: Option<std::thread::Thread>,
    /// The augmentation applied to each batch after its gather, if any.
    pub(crate) augment: Option<Arc<Staged>>,
    /// Whether the batches carry their indices only, nothing read
    /// ([`Loader::epoch_indices`](crate::Loader::epoch_indices)).
    pub(crate) indices_only: bool,
}

/// An augmentation and the layout of the dataset's own columns, which a worker gathers
/// into its staging buffer before augmenting them into the batch.
#[derive(Debug)]
pub(crate) struct Staged {
    pub(crate) augmenter: crate::augment::Augmenter,
    pub(crate) layout: BatchLayout,
}

/// A job and the sender a worker drops when it is done with it.
pub(crate) type Assignment = (Arc<Job>, Sender<()>);

impl Job {
    /// Stops every worker on this job: those waiting for a buffer wake up and leave.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        self.pool.wake_all();
    }

    /// Claims and assembles batches until the epoch is exhausted or cancelled, with the
    /// worker's own reader and lists.
    fn run(&self, worker: usize, local: &mut Local) {
        loop {
            if self.cancelled.load(Ordering::Acquire)
                || self.next.load(Ordering::Relaxed) >= self.end
            {
                return;
            }
            // Take a buffer before claiming a number: the lowest unclaimed batch then
            // always has a buffer, so in-order delivery cannot deadlock.
            let Some(slot) = self.pool.take(&self.cancelled) else {
                return;
            };
            let mut lease = Lease::new(slot, Arc::clone(&self.pool));
            let number = self.next.fetch_add(1, Ordering::Relaxed);
            // Cancelled while this worker waited for its buffer: no new batch is
            // gathered (a cold read, a wait for the planner) for an epoch that ends.
            if number >= self.end || self.cancelled.load(Ordering::Acquire) {
                return;
            }
            if let Some(planner) = &self.planner {
                planner.unpark();
            }
            let start = Instant::now();
            let result = catch_unwind(AssertUnwindSafe(|| {
                self.assemble(&mut lease, number, local)
            }))
            .unwrap_or_else(|payload| {
                Err(Error::WorkerPanic {
                    worker,
                    epoch: self.order.epoch(),
                    batch: number,
                    message: panic_message(payload.as_ref()),
                })
            });
            let end = Instant::now();
            let failed = result.is_err();
            let done = Done {
                number,
                lease,
                result,
                worker,
                start,
                end,
            };
            // A send fails only when the epoch is gone; the lease then returns itself.
            if self.results.send(done).is_err() || failed {
                self.cancel();
                return;
            }
        }
    }

    /// Writes batch `number` into the lease's buffer; returns its sample count.
    fn assemble(&self, lease: &mut Lease, number: u64, local: &mut Local) -> Result<usize> {
        let (bytes, indices) = lease.slot_mut().parts_mut();
        self.order.batch(number, indices);
        let rows = indices.len();
        if self.indices_only {
            return Ok(rows);
        }
        let (mut parts, n) = self.layout.split(bytes, rows);
        let Some(staged) = &self.augment else {
            self.gather(number, indices, &mut parts[..n], local)?;
            return Ok(rows);
        };
        let mut staging = std::mem::take(&mut local.staging);
        staging.resize(staged.layout.bytes(), 0);
        let (mut raw, m) = staged.layout.split(&mut staging, rows);
        let result = self
            .gather(number, indices, &mut raw[..m], local)
            .and_then(|()| {
                let input: Vec<&[u8]> = raw[..m].iter().map(|p| &**p).collect();
                let epoch = self.order.epoch();
                staged
                    .augmenter
                    .apply(epoch, indices, &input, &mut parts[..n])
            });
        local.staging = staging;
        result.map(|()| rows)
    }

    /// Gathers the samples `indices` of batch `number` into `out`: from the planner's
    /// extents, by direct reads, or through the dataset's mappings.
    fn gather(
        &self,
        number: u64,
        indices: &[u64],
        out: &mut [&mut [u8]],
        local: &mut Local,
    ) -> Result<()> {
        let epoch = self.order.epoch();
        let dataset = self.dataset.as_ref();
        if let Some(extents) = &self.extents {
            if extents.gather(dataset, epoch, number, indices, out, &mut local.window)? {
                return Ok(());
            }
        }
        if let Some(sources) = &self.direct {
            if let Some(reader) = local.reader.get() {
                if reader.gather(dataset, sources, epoch, indices, out)? {
                    return Ok(());
                }
            }
        }
        dataset.gather(epoch, indices, out)
    }
}

/// What a worker keeps from batch to batch: its direct reader, its lists for copying
/// from extents, and the buffer it gathers a batch into before augmenting it.
#[derive(Debug, Default)]
pub(crate) struct Local {
    reader: ReaderSlot,
    window: Scratch,
    staging: Vec<u8>,
}

/// A worker's direct reader: not made yet, made, or not to be had here (the worker
/// then gathers through the mapping).
#[derive(Debug, Default)]
pub(crate) enum ReaderSlot {
    #[default]
    Unmade,
    Made(Box<Reader>),
    Unavailable,
}

impl ReaderSlot {
    fn get(&mut self) -> Option<&mut Reader> {
        if let ReaderSlot::Unmade = self {
            *self = match Reader::new() {
                Ok(r) => ReaderSlot::Made(Box::new(r)),
                Err(_) => ReaderSlot::Unavailable,
            };
        }
        match self {
            ReaderSlot::Made(r) => Some(r),
            _ => None,
        }
    }
}

/// Starts worker `id`: it serves jobs until its channel closes.
pub(crate) fn spawn(id: usize, jobs: Receiver<Assignment>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("stokehold-worker-{id}"))
        .spawn(move || {
            let mut local = Local::default();
            for (job, done) in jobs {
                job.run(id, &mut local);
                drop(job);
                drop(done);
            }
        })
}
