//! The CPU backend: the same training step and the same pipeline shape as the GPU.
//!
//! A copy thread takes each [`HostBatch`] from the loader and copies it
//! into a free "device slot" (a host buffer standing in for device memory), then releases
//! the loader's buffer at once, as the GPU path does after its host-to-device copy. The
//! calling thread runs the training step on filled slots and hands them back. Slots are a
//! ring: the copy of batch `k + 1` overlaps the compute of batch `k`, as the copy and
//! compute streams do on a GPU.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::backend::{check_columns, Trainer};
use crate::error::Result;
use crate::loader::{BatchLayout, Epoch, EpochStats, HostBatch, Loader};
use crate::model::{step, Metrics, Mlp, Normalize, Workspace};
use crate::telemetry::{stalled, EpochOutcome, Progress, Stage, Trace, Track};
use crate::util::zeroed;

/// A device slot: a batch's bytes and indices.
struct Slot {
    bytes: Vec<u8>,
    indices: Vec<u64>,
    len: usize,
    number: u64,
    /// When the loader handed the batch over: what splits the step's wait for this slot
    /// into waiting for data and waiting for the copy.
    arrived: Instant,
}

impl Slot {
    /// Copies a batch (bytes, indices, length, number) into the slot, if it is laid out
    /// as the slot (`layout`, the trainer's).
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) for a batch of another layout (another
    /// loader's).
    fn fill(&mut self, batch: &HostBatch, layout: &BatchLayout) -> Result<()> {
        layout.check_batch(batch)?;
        let src = batch.as_bytes();
        self.bytes[..src.len()].copy_from_slice(src);
        self.indices.clear();
        self.indices.extend_from_slice(batch.indices());
        self.len = batch.len();
        self.number = batch.number();
        Ok(())
    }
}

/// Where the step's inputs sit in a slot, and a reusable label buffer.
struct StepInputs {
    x_offset: usize,
    y_offset: usize,
    x_row: usize,
    y: Vec<i64>,
}

impl StepInputs {
    fn new(layout: &BatchLayout, (x_column, y_column): (usize, usize)) -> StepInputs {
        StepInputs {
            x_offset: layout.offset(x_column),
            y_offset: layout.offset(y_column),
            x_row: layout.columns()[x_column].row_bytes,
            y: Vec::with_capacity(layout.batch_size()),
        }
    }

    /// One training step on the batch in `slot`.
    fn step(
        &mut self,
        (mlp, workspace, norm): (&mut Mlp, &mut Workspace, Normalize),
        slot: &Slot,
        metrics: &mut Metrics,
    ) -> Result<()> {
        let n = slot.len;
        self.y.clear();
        self.y.extend(
            slot.bytes[self.y_offset..self.y_offset + n * 8]
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))),
        );
        let x = &slot.bytes[self.x_offset..self.x_offset + n * self.x_row];
        step(mlp, workspace, norm, x, &self.y, &slot.indices, metrics)
    }
}

/// The training state of the CPU backend.
pub struct CpuTrainer {
    mlp: Mlp,
    norm: Normalize,
    layout: BatchLayout,
    workspace: Workspace,
    /// Allocated once; between the stages only slot numbers travel, and each number is
    /// owned by one stage at a time, so these locks are never contended.
    slots: Vec<Mutex<Slot>>,
    x_column: usize,
    y_column: usize,
    trace: Option<Arc<Trace>>,
    serial: bool,
}

impl CpuTrainer {
    fn train_serial(
        &mut self,
        mut epoch: Epoch<'_>,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<EpochOutcome> {
        let start = Instant::now();
        let mut out = EpochOutcome::default();
        let mut inputs = StepInputs::new(&self.layout, (self.x_column, self.y_column));
        let mut slot = self.slots[0].lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let t = Instant::now();
            let Some(batch) = epoch.next() else { break };
            out.stages.wait_data += t.elapsed();
            let batch = batch?;
            let t = Instant::now();
            slot.fill(&batch, &self.layout)?;
            drop(batch);
            out.stages.copy += t.elapsed();
            let t = Instant::now();
            let model = (&mut self.mlp, &mut self.workspace, self.norm);
            inputs.step(model, &slot, &mut out.metrics)?;
            out.stages.compute += t.elapsed();
            out.batches += 1;
            progress(
                slot.len as u64,
                stalled(out.stages.wait_data, start.elapsed()),
            );
        }
        drop(slot);
        out.close(epoch.stats(), start.elapsed());
        out.stages.in_series();
        Ok(out)
    }

    /// A trainer for batches of `layout`, reading inputs (`u8`) from column `x_column`
    /// and labels (`i64`) from `y_column`, with `slots` device slots (at least 2, so
    /// copy and compute overlap).
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) if the columns have the wrong dtypes or sizes for the model.
    pub fn new(
        mlp: Mlp,
        norm: Normalize,
        layout: &BatchLayout,
        (x_column, y_column): (usize, usize),
        slots: usize,
    ) -> Result<CpuTrainer> {
        check_columns(mlp.config.inputs, layout, (x_column, y_column))?;
        let workspace = Workspace::new(&mlp.config, layout.batch_size())?;
        let slots = (0..slots.max(2))
            .map(|_| {
                Ok(Mutex::new(Slot {
                    bytes: zeroed(layout.bytes(), "CPU device slots")?,
                    indices: Vec::with_capacity(layout.batch_size()),
                    len: 0,
                    number: 0,
                    arrived: Instant::now(),
                }))
            })
            .collect::<Result<_>>()?;
        Ok(CpuTrainer {
            mlp,
            norm,
            layout: layout.clone(),
            workspace,
            slots,
            x_column,
            y_column,
            trace: None,
            serial: false,
        })
    }

    /// The model.
    pub fn model(&self) -> &Mlp {
        &self.mlp
    }

    /// Trains on every batch of `epoch`, copy overlapped with compute.
    ///
    /// # Errors
    /// The first error of the loader or the step (a bad label, say); the epoch stops
    /// there and the loader's workers are stopped.
    pub fn train_epoch(&mut self, epoch: Epoch<'_>) -> Result<EpochOutcome> {
        self.train_epoch_with(epoch, &mut |_, _| {})
    }

    /// [`train_epoch`](CpuTrainer::train_epoch), calling `progress(samples, stalled)`
    /// after each batch with the batch's sample count and the share of time so far the
    /// pipeline waited for the loader (see [`stalled`]).
    ///
    /// # Errors
    /// As [`train_epoch`](CpuTrainer::train_epoch).
    pub fn train_epoch_with(
        &mut self,
        epoch: Epoch<'_>,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<EpochOutcome> {
        if self.serial {
            return self.train_serial(epoch, progress);
        }
        let start = Instant::now();
        let (free_tx, free_rx) = bounded::<usize>(self.slots.len());
        let (full_tx, full_rx) = bounded::<usize>(self.slots.len());
        for i in 0..self.slots.len() {
            free_tx.send(i).expect("capacity is the slot count");
        }
        let mut out = EpochOutcome::default();
        let Self {
            mlp,
            norm,
            layout,
            workspace,
            slots,
            x_column,
            y_column,
            trace,
            serial: _,
        } = self;
        let trace = trace.as_deref();
        let epoch_no = epoch.epoch();
        let (slots, layout) = (&slots[..], &*layout);
        let waited_ns = &AtomicU64::new(0);
        let (copied, computed) = std::thread::scope(|s| {
            let copier = s.spawn(move || {
                let stages = (free_rx, full_tx);
                copy_stage(epoch, (slots, layout), stages, waited_ns, trace)
            });
            let computed = (|| -> Result<()> {
                let mut inputs = StepInputs::new(layout, (*x_column, *y_column));
                loop {
                    let waited = Instant::now();
                    let Ok(i) = full_rx.recv() else {
                        return Ok(());
                    };
                    let t = Instant::now();
                    let slot = slots[i].lock().unwrap_or_else(|e| e.into_inner());
                    // The step stood idle from `waited` to `t`: for data until the loader
                    // handed the batch over, then for its copy.
                    let idle = t - waited;
                    let for_data = slot.arrived.saturating_duration_since(waited).min(idle);
                    out.stages.wait_copy += idle;
                    out.stages.stall_data += for_data;
                    out.stages.stall_copy += idle - for_data;
                    if let Some(tr) = trace {
                        let span = (waited, t);
                        tr.span(Stage::WaitCopy, Track::Compute, span, epoch_no, slot.number);
                    }
                    let n = slot.len;
                    // The step alone: the trace's own bookkeeping is not compute.
                    let stepped = Instant::now();
                    inputs.step((mlp, workspace, *norm), &slot, &mut out.metrics)?;
                    let span = (stepped, Instant::now());
                    let number = slot.number;
                    drop(slot);
                    if let Some(tr) = trace {
                        tr.span(Stage::Compute, Track::Compute, span, epoch_no, number);
                    }
                    out.stages.compute += span.1 - span.0;
                    out.batches += 1;
                    let wait = Duration::from_nanos(waited_ns.load(Ordering::Relaxed));
                    progress(n as u64, stalled(wait, start.elapsed()));
                    let _ = free_tx.send(i);
                }
            })();
            // Closing both our ends stops the copier early if the compute failed, wherever
            // it waits.
            drop(full_rx);
            drop(free_tx);
            let copied = copier.join().expect("the copy stage does not panic");
            (copied, computed)
        });
        let (copy, wait_data, loader) = copied?;
        computed?;
        out.stages.copy = copy;
        out.stages.wait_data = wait_data;
        out.close(loader, start.elapsed());
        Ok(out)
    }
}

/// Copies each batch into a free slot, releases the loader's buffer, and hands the slot
/// to the compute stage, adding its waits for the loader to `waited_ns` as it goes.
/// Returns copy time, time waiting for the loader, and the loader's statistics.
fn copy_stage(
    mut epoch: Epoch<'_>,
    (slots, layout): (&[Mutex<Slot>], &BatchLayout),
    (free, full): (Receiver<usize>, Sender<usize>),
    waited_ns: &AtomicU64,
    trace: Option<&Trace>,
) -> Result<(Duration, Duration, EpochStats)> {
    let epoch_no = epoch.epoch();
    let (mut copy, mut wait) = (Duration::ZERO, Duration::ZERO);
    loop {
        let t = Instant::now();
        let Some(batch) = epoch.next() else { break };
        let arrived = Instant::now();
        let waited = arrived - t;
        wait += waited;
        waited_ns.fetch_add(waited.as_nanos() as u64, Ordering::Relaxed);
        let batch = batch?;
        if let Some(tr) = trace {
            tr.gather(&batch);
            let span = (t, t + waited);
            tr.span(Stage::WaitData, Track::Feed, span, epoch_no, batch.number());
        }
        let Ok(i) = free.recv() else { break };
        let t = Instant::now();
        let mut slot = slots[i].lock().unwrap_or_else(|e| e.into_inner());
        slot.arrived = arrived;
        slot.fill(&batch, layout)?;
        drop(slot);
        let number = batch.number();
        drop(batch);
        if let Some(tr) = trace {
            tr.span(
                Stage::Copy,
                Track::Copy,
                (t, Instant::now()),
                epoch_no,
                number,
            );
        }
        copy += t.elapsed();
        if full.send(i).is_err() {
            break;
        }
    }
    Ok((copy, wait, epoch.stats()))
}

impl Trainer for CpuTrainer {
    fn train(&mut self, from: &mut Loader, epoch: u64, progress: Progress) -> Result<EpochOutcome> {
        self.train_epoch_with(from.epoch(epoch)?, progress)
    }

    /// Spans of gather (on each worker), wait for data, copy (the copy thread), wait
    /// for copy and compute (the compute thread).
    fn set_trace(&mut self, trace: Arc<Trace>) {
        self.trace = Some(trace);
    }

    /// Serial: each batch is copied and then trained on by the calling thread (the
    /// loader's workers still prefetch).
    fn set_serial(&mut self, serial: bool) -> Result<()> {
        self.serial = serial;
        Ok(())
    }

    fn weights(&self) -> Result<Mlp> {
        Ok(self.mlp.clone())
    }

    /// Nothing to pay: the step is plain host code.
    fn warm_up(&mut self) -> Result<Duration> {
        Ok(Duration::ZERO)
    }
}
