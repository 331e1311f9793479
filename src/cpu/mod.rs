//! The CPU backend: the same training step and the same pipeline shape as the GPU.
//!
//! A copy thread takes each [`HostBatch`] from the loader and copies it
//! into a free "device slot" (a host buffer standing in for device memory), then releases
//! the loader's buffer at once, as the GPU path does after its host-to-device copy. The
//! calling thread runs the training step on filled slots and hands them back. Slots are a
//! ring: the copy of batch `k + 1` overlaps the compute of batch `k`, as the copy and
//! compute streams do on a GPU.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::error::{Error, Result};
use crate::loader::{BatchLayout, Epoch, EpochStats, HostBatch};
use crate::report::Trace;
use crate::train::{step, Metrics, Mlp, Normalize, Workspace};

/// Time spent per stage over one epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StageTimes {
    /// Worker time assembling batches (summed over workers).
    pub gather: Duration,
    /// Time the copy stage waited for the loader.
    pub wait_data: Duration,
    /// Time spent copying batches into device slots.
    pub copy: Duration,
    /// Time spent in the training step.
    pub compute: Duration,
    /// Time the compute stage waited for a filled slot.
    pub wait_copy: Duration,
}

/// What one epoch of training produced.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct EpochOutcome {
    /// Loss and accuracy.
    pub metrics: Metrics,
    /// Per-stage time.
    pub stages: StageTimes,
    /// The loader's view of the epoch.
    pub loader: EpochStats,
    /// Wall time.
    pub wall: Duration,
    /// Batches trained on.
    pub batches: u64,
}

/// A device slot: a batch's bytes and indices.
struct Slot {
    bytes: Vec<u8>,
    indices: Vec<u64>,
    len: usize,
    number: u64,
}

impl Slot {
    /// Copies a batch (bytes, indices, length, number) into the slot.
    fn fill(&mut self, batch: &HostBatch) {
        let src = batch.as_bytes();
        self.bytes[..src.len()].copy_from_slice(src);
        self.indices.clear();
        self.indices.extend_from_slice(batch.indices());
        self.len = batch.len();
        self.number = batch.number();
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
    /// Serialised mode, the baseline of the overlap benchmark: each batch is copied and
    /// then trained on by the calling thread, one after the other (the loader's workers
    /// still prefetch).
    pub fn set_serial(&mut self, serial: bool) {
        self.serial = serial;
    }

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
            slot.fill(&batch);
            drop(batch);
            out.stages.copy += t.elapsed();
            let t = Instant::now();
            let model = (&mut self.mlp, &mut self.workspace, self.norm);
            inputs.step(model, &slot, &mut out.metrics)?;
            out.stages.compute += t.elapsed();
            out.batches += 1;
            let elapsed = start.elapsed().as_secs_f64().max(1e-9);
            progress(
                slot.len as u64,
                out.stages.wait_data.as_secs_f64() / elapsed,
            );
        }
        drop(slot);
        out.loader = epoch.stats();
        out.stages.gather = out.loader.gather;
        out.wall = start.elapsed();
        Ok(out)
    }

    /// Records a span per batch per stage (gather on its worker, copy, wait, compute)
    /// into `trace` from now on.
    pub fn set_trace(&mut self, trace: Arc<Trace>) {
        self.trace = Some(trace);
    }

    /// A trainer for batches of `layout`, reading inputs (`u8`) from column `x_column`
    /// and labels (`i64`) from `y_column`, with `slots` device slots (at least 2, so
    /// copy and compute overlap).
    ///
    /// # Errors
    /// [`Error::Config`] if the columns have the wrong dtypes or sizes for the model.
    pub fn new(
        mlp: Mlp,
        norm: Normalize,
        layout: &BatchLayout,
        (x_column, y_column): (usize, usize),
        slots: usize,
    ) -> Result<CpuTrainer> {
        check_columns(&mlp, layout, x_column, y_column)?;
        let workspace = Workspace::new(&mlp.config, layout.batch_size());
        let slots = (0..slots.max(2))
            .map(|_| {
                Mutex::new(Slot {
                    bytes: vec![0u8; layout.bytes()],
                    indices: Vec::with_capacity(layout.batch_size()),
                    len: 0,
                    number: 0,
                })
            })
            .collect();
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
    /// compute stage waited for data.
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
        let slots = &*slots;
        let (copied, computed) = std::thread::scope(|s| {
            let copier = s.spawn(move || copy_stage(epoch, slots, free_rx, full_tx, trace));
            let computed = (|| {
                let mut inputs = StepInputs::new(layout, (*x_column, *y_column));
                loop {
                    let waited = Instant::now();
                    let Ok(i) = full_rx.recv() else {
                        return Ok(());
                    };
                    out.stages.wait_copy += waited.elapsed();
                    let t = Instant::now();
                    let slot = slots[i].lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(tr) = trace {
                        tr.span(
                            "wait for copy",
                            "compute",
                            (waited, t),
                            epoch_no,
                            slot.number,
                        );
                    }
                    let n = slot.len;
                    inputs.step((mlp, workspace, *norm), &slot, &mut out.metrics)?;
                    let number = slot.number;
                    drop(slot);
                    if let Some(tr) = trace {
                        tr.span("compute", "compute", (t, Instant::now()), epoch_no, number);
                    }
                    out.stages.compute += t.elapsed();
                    out.batches += 1;
                    let elapsed = start.elapsed().as_secs_f64().max(1e-9);
                    progress(n as u64, out.stages.wait_copy.as_secs_f64() / elapsed);
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
        out.stages.gather = loader.gather;
        out.stages.copy = copy;
        out.stages.wait_data = wait_data;
        out.loader = loader;
        out.wall = start.elapsed();
        Ok(out)
    }
}

/// Copies each batch into a free slot, releases the loader's buffer, and hands the slot
/// to the compute stage. Returns copy time, time waiting for the loader, and the
/// loader's statistics.
fn copy_stage(
    mut epoch: Epoch<'_>,
    slots: &[Mutex<Slot>],
    free: Receiver<usize>,
    full: Sender<usize>,
    trace: Option<&Trace>,
) -> Result<(Duration, Duration, EpochStats)> {
    let epoch_no = epoch.epoch();
    let (mut copy, mut wait) = (Duration::ZERO, Duration::ZERO);
    loop {
        let t = Instant::now();
        let Some(batch) = epoch.next() else { break };
        wait += t.elapsed();
        let batch = batch?;
        if let Some(tr) = trace {
            tr.gather(&batch);
            let waited = (t, t + batch.timing().waited);
            tr.span("wait for data", "copy", waited, epoch_no, batch.number());
        }
        let Ok(i) = free.recv() else { break };
        let t = Instant::now();
        slots[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fill(&batch);
        let number = batch.number();
        drop(batch);
        if let Some(tr) = trace {
            tr.span("copy", "copy", (t, Instant::now()), epoch_no, number);
        }
        copy += t.elapsed();
        if full.send(i).is_err() {
            break;
        }
    }
    Ok((copy, wait, epoch.stats()))
}

/// Checks that `x_column` holds `u8` rows of `inputs` bytes and `y_column` one `i64`.
pub(crate) fn check_columns(mlp: &Mlp, layout: &BatchLayout, x: usize, y: usize) -> Result<()> {
    let cols = layout.columns();
    let (Some(xc), Some(yc)) = (cols.get(x), cols.get(y)) else {
        return Err(Error::Config(format!(
            "the model reads columns {x} and {y}, the dataset has {}",
            cols.len()
        )));
    };
    if xc.dtype != crate::DType::U8 || xc.row_bytes != mlp.config.inputs {
        return Err(Error::Config(format!(
            "column {} must hold {} uint8 values per sample, it holds {} {}",
            xc.name,
            mlp.config.inputs,
            xc.row_bytes / xc.dtype.size(),
            xc.dtype
        )));
    }
    if yc.dtype != crate::DType::I64 || yc.row_bytes != 8 {
        return Err(Error::Config(format!(
            "column {} must hold one int64 label per sample",
            yc.name
        )));
    }
    Ok(())
}
