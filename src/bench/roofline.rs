//! The roofline: a bare random gather with nothing of the loader's machinery.
//!
//! Its threads and buffers are made once, as the loader's are, so a pass times only
//! gathers: on a small set, starting threads and faulting in fresh buffers on every pass
//! would cost more than the gathers themselves, and the loader would seem to beat its
//! own upper bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, HostAlloc, PlainAlloc};

/// One pass: the batches of `indices`, cut every batch size, claimed in turn.
struct Pass {
    epoch: u64,
    indices: Arc<[u64]>,
    next: AtomicUsize,
}

/// `threads` persistent threads, each with its own page-aligned buffer of one batch,
/// allocated and touched up front by the loader's plain allocator.
pub struct Roofline {
    passes: Vec<Sender<Arc<Pass>>>,
    done: Receiver<Result<()>>,
    handles: Vec<JoinHandle<()>>,
}

impl Roofline {
    /// Starts `threads` threads gathering from `dataset` into buffers laid out as
    /// `layout`.
    ///
    /// # Errors
    /// [`Error::Alloc`] if a buffer cannot be had; [`Error::Io`] if a thread cannot be
    /// started; [`Error::Config`] for zero threads.
    pub fn new(
        dataset: Arc<dyn Dataset>,
        layout: &BatchLayout,
        threads: usize,
    ) -> Result<Roofline> {
        if threads == 0 {
            return Err(Error::Config("the roofline needs at least 1 thread".into()));
        }
        let (done_tx, done) = crossbeam_channel::unbounded();
        let mut roofline = Roofline {
            passes: Vec::with_capacity(threads),
            done,
            handles: Vec::with_capacity(threads),
        };
        for id in 0..threads {
            let mem = PlainAlloc.alloc(layout.bytes())?;
            let (tx, rx) = crossbeam_channel::unbounded::<Arc<Pass>>();
            let (dataset, layout, done) = (Arc::clone(&dataset), layout.clone(), done_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("stokehold-roofline-{id}"))
                .spawn(move || {
                    // SAFETY: `HostMemory` guarantees `len` initialised bytes at `as_ptr`,
                    // owned by `mem`, which this thread alone holds until it ends.
                    let buf = unsafe { std::slice::from_raw_parts_mut(mem.as_ptr(), mem.len()) };
                    for pass in rx {
                        // A dataset's panic is this pass's error: the thread goes on, and
                        // `pass` does not wait for it forever.
                        let gathered =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                gather_pass(dataset.as_ref(), &layout, &pass, buf)
                            }))
                            .unwrap_or_else(|p| {
                                Err(Error::Config(format!(
                                    "the roofline's gather panicked: {}",
                                    crate::util::panic_message(p.as_ref())
                                )))
                            });
                        let _ = done.send(gathered);
                    }
                })
                .map_err(|e| Error::io(format!("<roofline thread {id}>"), e))?;
            roofline.passes.push(tx);
            roofline.handles.push(handle);
        }
        Ok(roofline)
    }

    /// Gathers every batch of `indices` (epoch `epoch`) once, spread over the threads;
    /// returns the wall time from handing out the pass to the last thread's end.
    ///
    /// # Errors
    /// The first error a gather returned.
    pub fn pass(&self, epoch: u64, indices: Arc<[u64]>) -> Result<Duration> {
        let pass = Arc::new(Pass {
            epoch,
            indices,
            next: AtomicUsize::new(0),
        });
        let start = Instant::now();
        for tx in &self.passes {
            tx.send(Arc::clone(&pass))
                .map_err(|_| Error::Config("a roofline thread is gone".into()))?;
        }
        let mut result = Ok(());
        for _ in &self.passes {
            let r = self
                .done
                .recv()
                .map_err(|_| Error::Config("a roofline thread is gone".into()))?;
            result = result.and(r);
        }
        let elapsed = start.elapsed();
        result.map(|()| elapsed)
    }
}

/// One thread's share of a pass: batches claimed until none is left.
fn gather_pass(
    dataset: &dyn Dataset,
    layout: &BatchLayout,
    pass: &Pass,
    buf: &mut [u8],
) -> Result<()> {
    let batch = layout.batch_size();
    let batches = pass.indices.len().div_ceil(batch);
    loop {
        let b = pass.next.fetch_add(1, Ordering::Relaxed);
        if b >= batches {
            return Ok(());
        }
        let ids = &pass.indices[b * batch..((b + 1) * batch).min(pass.indices.len())];
        let (mut parts, n) = layout.split(buf, ids.len());
        dataset.gather(pass.epoch, ids, &mut parts[..n])?;
    }
}

impl Drop for Roofline {
    fn drop(&mut self) {
        self.passes.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for Roofline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Roofline")
            .field("threads", &self.handles.len())
            .finish_non_exhaustive()
    }
}
