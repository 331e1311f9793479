//! The CPU backend: the same training step and the same pipeline shape as the GPU.
//!
//! A copy thread takes each [`HostBatch`](crate::HostBatch) from the loader and copies it
//! into a free "device slot" (a host buffer standing in for device memory), then releases
//! the loader's buffer at once, as the GPU path does after its host-to-device copy. The
//! calling thread runs the training step on filled slots and hands them back. Slots are a
//! ring: the copy of batch `k + 1` overlaps the compute of batch `k`, as the copy and
//! compute streams do on a GPU.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::error::{Error, Result};
use crate::loader::{BatchLayout, Epoch, EpochStats};
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
        let (xo, yo) = (
            self.layout.offset(self.x_column),
            self.layout.offset(self.y_column),
        );
        let row = self.layout.columns()[self.x_column].row_bytes;
        let mut y = Vec::with_capacity(self.layout.batch_size());
        let mut slot = self.slots[0].lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let t = Instant::now();
            let Some(batch) = epoch.next() else { break };
            out.stages.wait_data += t.elapsed();
            let batch = batch?;
            let t = Instant::now();
            let src = batch.as_bytes();
            slot.bytes[..src.len()].copy_from_slice(src);
            let n = batch.len();
            slot.indices.clear();
            slot.indices.extend_from_slice(batch.indices());
            drop(batch);
            out.stages.copy += t.elapsed();
            let t = Instant::now();
            y.clear();
            y.extend(
                slot.bytes[yo..yo + n * 8]
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))),
            );
            let x = &slot.bytes[xo..xo + n * row];
            step(
                &mut self.mlp,
                &mut self.workspace,
                self.norm,
                x,
                &y,
                &slot.indices,
                &mut out.metrics,
            )?;
            out.stages.compute += t.elapsed();
            out.batches += 1;
            let elapsed = start.elapsed().as_secs_f64().max(1e-9);
            progress(n as u64, out.stages.wait_data.as_secs_f64() / elapsed);
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
                let (xo, yo) = (layout.offset(*x_column), layout.offset(*y_column));
                let row = layout.columns()[*x_column].row_bytes;
                let mut y = Vec::with_capacity(layout.batch_size());
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
                    y.clear();
                    y.extend(
                        slot.bytes[yo..yo + n * 8]
                            .chunks_exact(8)
                            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))),
                    );
                    let x = &slot.bytes[xo..xo + n * row];
                    step(
                        mlp,
                        workspace,
                        *norm,
                        x,
                        &y,
                        &slot.indices,
                        &mut out.metrics,
                    )?;
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
            let tm = batch.timing();
            let worker = format!("gather worker {}", tm.worker);
            tr.span(
                "gather",
                worker,
                (tm.gather_start, tm.gather_end),
                epoch_no,
                batch.number(),
            );
            tr.span(
                "wait for data",
                "copy",
                (t, t + tm.waited),
                epoch_no,
                batch.number(),
            );
        }
        let Ok(i) = free.recv() else { break };
        let t = Instant::now();
        {
            let mut slot = slots[i].lock().unwrap_or_else(|e| e.into_inner());
            let src = batch.as_bytes();
            slot.bytes[..src.len()].copy_from_slice(src);
            slot.indices.clear();
            slot.indices.extend_from_slice(batch.indices());
            slot.len = batch.len();
            slot.number = batch.number();
        }
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
