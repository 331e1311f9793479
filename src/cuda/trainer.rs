//! The GPU pipeline: pinned batches copied on a copy stream into a ring of device slots,
//! the training step on a compute stream, ordered by events.
//!
//! For batch `i` in slot `k = i % K`:
//! 1. the copy stream waits for `consumed[k]` (the step that last read slot `k`),
//! 2. `cuMemcpyHtoDAsync` from the pinned `HostBatch` into slot `k`, then `copied[k]`,
//! 3. the compute stream waits for `copied[k]`, runs the step, records `consumed[k]`,
//! 4. the `HostBatch` (its pinned buffer) goes back to the loader once `copied[k]` has
//!    completed, never before.
//!
//! The host blocks only as back-pressure: when `K` batches are in flight it waits for the
//! oldest copy, and when it reuses a slot it reads that slot's timing events.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    result, sys, CudaEvent, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::kernels::Kernels;
use super::Cuda;
use crate::cpu::{check_columns, EpochOutcome};
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, Epoch, HostBatch};
use crate::train::{Metrics, Mlp, MlpConfig, Normalize};

fn cuda_err(e: cudarc::driver::DriverError) -> Error {
    Error::Cuda(e.to_string())
}

/// The device address of a slice's first element.
fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(stream).0
}

/// Training state on the GPU.
pub struct CudaTrainer {
    cuda: Cuda,
    kernels: Kernels,
    copy: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    config: MlpConfig,
    norm: Normalize,
    layout: BatchLayout,
    columns: (usize, usize),
    w1: CudaSlice<f32>,
    b1: CudaSlice<f32>,
    w2: CudaSlice<f32>,
    b2: CudaSlice<f32>,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    z: CudaSlice<f32>,
    dh: CudaSlice<f32>,
    slots: Vec<CudaSlice<u8>>,
    copy_start: Vec<CudaEvent>,
    copied: Vec<CudaEvent>,
    compute_start: Vec<CudaEvent>,
    consumed: Vec<CudaEvent>,
    loss_sum: CudaSlice<f64>,
    correct: CudaSlice<u64>,
    bad: CudaSlice<i32>,
}

impl CudaTrainer {
    /// Uploads `mlp`'s weights (so both backends start from the same ones) and allocates
    /// `slots` device slots (at least 2) for batches of `layout`.
    ///
    /// # Errors
    /// [`Error::Config`] for columns that do not fit the model; [`Error::Cuda`] when an
    /// allocation or stream creation fails.
    pub fn new(
        cuda: Cuda,
        kernels: Kernels,
        mlp: &Mlp,
        norm: Normalize,
        layout: &BatchLayout,
        columns: (usize, usize),
        slots: usize,
    ) -> Result<CudaTrainer> {
        check_columns(mlp, layout, columns.0, columns.1)?;
        let ctx = Arc::clone(&cuda.ctx);
        // All ordering is done with the events below.
        // SAFETY: from here on, every stream touching these buffers is ordered by our
        // own events (see the module docs), so cudarc's per-slice tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let copy = ctx.new_stream().map_err(cuda_err)?;
        let compute = ctx.new_stream().map_err(cuda_err)?;
        let s = &compute;
        let up = |v: &[f32]| s.clone_htod(v).map_err(cuda_err);
        let MlpConfig {
            inputs: d,
            hidden: hd,
            classes: c,
            ..
        } = mlp.config;
        let b = layout.batch_size();
        let zeros_f = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(cuda_err);
        let k = slots.max(2);
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let events = |n: usize| -> Result<Vec<CudaEvent>> {
            (0..n)
                .map(|_| ctx.new_event(timing).map_err(cuda_err))
                .collect()
        };
        let trainer = CudaTrainer {
            w1: up(&mlp.w1)?,
            b1: up(&mlp.b1)?,
            w2: up(&mlp.w2)?,
            b2: up(&mlp.b2)?,
            x: zeros_f(b * d)?,
            h: zeros_f(b * hd)?,
            z: zeros_f(b * c)?,
            dh: zeros_f(b * hd)?,
            slots: (0..k)
                .map(|_| s.alloc_zeros::<u8>(layout.bytes()).map_err(cuda_err))
                .collect::<Result<_>>()?,
            copy_start: events(k)?,
            copied: events(k)?,
            compute_start: events(k)?,
            consumed: events(k)?,
            loss_sum: s.alloc_zeros::<f64>(1).map_err(cuda_err)?,
            correct: s.alloc_zeros::<u64>(1).map_err(cuda_err)?,
            bad: s.alloc_zeros::<i32>(1).map_err(cuda_err)?,
            config: mlp.config,
            norm,
            layout: layout.clone(),
            columns,
            kernels,
            copy,
            compute,
            cuda,
        };
        trainer.compute.synchronize().map_err(cuda_err)?;
        Ok(trainer)
    }

    /// The device this trainer runs on.
    pub fn cuda(&self) -> &Cuda {
        &self.cuda
    }

    /// The kernels (with how they were obtained).
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Copies the weights back to the host.
    ///
    /// # Errors
    /// [`Error::Cuda`] if the copy fails.
    pub fn weights(&self) -> Result<Mlp> {
        let s = &self.compute;
        s.synchronize().map_err(cuda_err)?;
        let down = |v: &CudaSlice<f32>| s.clone_dtoh(v).map_err(cuda_err);
        Ok(Mlp {
            config: self.config,
            w1: down(&self.w1)?,
            b1: down(&self.b1)?,
            w2: down(&self.w2)?,
            b2: down(&self.b2)?,
        })
    }

    fn launch1(
        &self,
        f: &cudarc::driver::CudaFunction,
        count: u64,
        args: &[&dyn ArgOf],
    ) -> Result<()> {
        let blocks = count.div_ceil(256).max(1) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.compute.launch_builder(f);
        for a in args {
            a.push(&mut b);
        }
        // SAFETY: every kernel of `kernels/mlp.cu` takes exactly the arguments its caller
        // passes here (device addresses as u64, sizes, scalars), and every address points
        // into a live allocation of at least the size the kernel reads or writes.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(cuda_err)
    }

    /// `c = alpha * a(m x k) b(k x n) + beta * c` with strides, on the compute stream.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: u64,
        (rsa, csa): (usize, usize),
        b: u64,
        (rsb, csb): (usize, usize),
        beta: f32,
        c: u64,
        rsc: usize,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
            block_dim: (16, 16, 1),
            shared_mem_bytes: 0,
        };
        let (m, n, k) = (m as i32, n as i32, k as i32);
        let (rsa, csa, rsb, csb, rsc) =
            (rsa as i64, csa as i64, rsb as i64, csb as i64, rsc as i64);
        let mut l = self.compute.launch_builder(&self.kernels.sgemm);
        l.arg(&m).arg(&n).arg(&k).arg(&alpha);
        l.arg(&a).arg(&rsa).arg(&csa).arg(&b).arg(&rsb).arg(&csb);
        l.arg(&beta).arg(&c).arg(&rsc);
        // SAFETY: `sgemm_strided`'s signature is (int, int, int, float, ptr, i64, i64, ptr,
        // i64, i64, float, ptr, i64); the callers' strides keep every access inside the
        // matrices they pass, as in the CPU backend's checked `gemm`.
        unsafe { l.launch(cfg) }.map(|_| ()).map_err(cuda_err)
    }

    /// Enqueues the step on the batch in slot `k` (`n` samples) on the compute stream.
    fn enqueue_step(&self, k: usize, n: usize) -> Result<()> {
        let s = &self.compute;
        let MlpConfig {
            inputs: d,
            hidden: h,
            classes: c,
            lr,
            ..
        } = self.config;
        let slot = addr(&self.slots[k], s);
        let xin = slot + self.layout.offset(self.columns.0) as u64;
        let yin = slot + self.layout.offset(self.columns.1) as u64;
        let (x, hh, z, dh) = (
            addr(&self.x, s),
            addr(&self.h, s),
            addr(&self.z, s),
            addr(&self.dh, s),
        );
        let (w1, b1, w2, b2) = (
            addr(&self.w1, s),
            addr(&self.b1, s),
            addr(&self.w2, s),
            addr(&self.b2, s),
        );
        let (nd, nh, nc) = ((n * d) as i64, (n * h) as i64, n * c);
        let (ni, hi, ci) = (n as i32, h as i32, c as i32);
        let kk = &self.kernels;
        self.launch1(
            &kk.normalize,
            nd as u64,
            &[&xin, &x, &nd, &self.norm.mean, &self.norm.inv_std],
        )?;
        self.launch1(&kk.fill_rows, nh as u64, &[&hh, &b1, &ni, &hi])?;
        self.gemm((n, h, d), 1.0, x, (d, 1), w1, (h, 1), 1.0, hh, h)?;
        self.launch1(&kk.relu, nh as u64, &[&hh, &nh])?;
        self.launch1(&kk.fill_rows, nc as u64, &[&z, &b2, &ni, &ci])?;
        self.gemm((n, c, h), 1.0, hh, (h, 1), w2, (c, 1), 1.0, z, c)?;
        let (loss, correct, bad) = (
            addr(&self.loss_sum, s),
            addr(&self.correct, s),
            addr(&self.bad, s),
        );
        self.launch1(
            &kk.softmax_xent,
            n as u64,
            &[&z, &yin, &ni, &ci, &loss, &correct, &bad],
        )?;
        // dh = dz W2^T (before W2 changes), masked by the ReLU.
        self.gemm((n, h, c), 1.0, z, (c, 1), w2, (1, c), 0.0, dh, h)?;
        self.launch1(&kk.relu_backward, nh as u64, &[&dh, &hh, &nh])?;
        // W2 -= lr h^T dz ; b2 -= lr sum(dz) ; W1 -= lr x^T dh ; b1 -= lr sum(dh)
        self.gemm((h, c, n), -lr, hh, (1, h), z, (c, 1), 1.0, w2, c)?;
        self.launch1(&kk.bias_sgd, c as u64, &[&b2, &z, &ni, &ci, &lr])?;
        self.gemm((d, h, n), -lr, x, (1, d), dh, (h, 1), 1.0, w1, h)?;
        self.launch1(&kk.bias_sgd, h as u64, &[&b1, &dh, &ni, &hi, &lr])?;
        Ok(())
    }

    fn reset_metrics(&mut self) -> Result<()> {
        let s = Arc::clone(&self.compute);
        s.memset_zeros(&mut self.loss_sum).map_err(cuda_err)?;
        s.memset_zeros(&mut self.correct).map_err(cuda_err)?;
        s.memset_zeros(&mut self.bad).map_err(cuda_err)
    }

    /// Reads the epoch's loss and accuracy (one device-to-host copy per epoch).
    fn read_metrics(&self, samples: u64) -> Result<Metrics> {
        let s = &self.compute;
        s.synchronize().map_err(cuda_err)?;
        let loss = s.clone_dtoh(&self.loss_sum).map_err(cuda_err)?[0];
        let correct = s.clone_dtoh(&self.correct).map_err(cuda_err)?[0];
        let bad = s.clone_dtoh(&self.bad).map_err(cuda_err)?[0];
        if bad != 0 {
            return Err(Error::Cuda(format!(
                "a label outside 0..{} reached the training step (row {} of a batch)",
                self.config.classes,
                bad - 1
            )));
        }
        Ok(Metrics {
            loss_sum: loss,
            correct,
            samples,
        })
    }

    /// One step on one batch, synchronously (for checking against the CPU backend).
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error or a bad label (flagged on the device).
    pub fn step_once(&mut self, batch: &HostBatch) -> Result<Metrics> {
        self.reset_metrics()?;
        let dst = addr(&self.slots[0], &self.copy);
        // SAFETY: slot 0 holds `layout.bytes()` bytes, the batch buffer as many; the copy
        // is waited for before the batch can be dropped (synchronize below).
        unsafe { result::memcpy_htod_async(dst, batch.as_bytes(), self.copy.cu_stream()) }
            .map_err(cuda_err)?;
        self.copy.synchronize().map_err(cuda_err)?;
        self.enqueue_step(0, batch.len())?;
        self.read_metrics(batch.len() as u64)
    }

    /// Trains on every batch of `epoch`: copies overlapped with compute, as the module
    /// docs describe; `progress(samples, stalled)` after each batch is enqueued.
    ///
    /// # Errors
    /// The loader's first error, a driver error, or [`Error::Cuda`] for a label outside
    /// the classes (checked at the end of the epoch, when the device's counters are read).
    pub fn train_epoch_with(
        &mut self,
        mut epoch: Epoch<'_>,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<EpochOutcome> {
        let start = Instant::now();
        self.reset_metrics()?;
        let k_slots = self.slots.len();
        let mut out = EpochOutcome::default();
        let mut inflight: VecDeque<(HostBatch, usize)> = VecDeque::with_capacity(k_slots);
        let (mut copy_ms, mut compute_ms) = (0f64, 0f64);
        let mut i = 0usize;
        loop {
            let t = Instant::now();
            let Some(batch) = epoch.next() else { break };
            out.stages.wait_data += t.elapsed();
            let batch = batch?;
            let k = i % k_slots;
            if i >= k_slots {
                // Back-pressure: slot k's last step must be done before its timing can be
                // read and the slot refilled.
                self.consumed[k].synchronize().map_err(cuda_err)?;
                compute_ms += self.compute_start[k]
                    .elapsed_ms(&self.consumed[k])
                    .map_err(cuda_err)? as f64;
            }
            self.copy.wait(&self.consumed[k]).map_err(cuda_err)?;
            self.copy_start[k].record(&self.copy).map_err(cuda_err)?;
            let dst = addr(&self.slots[k], &self.copy);
            // SAFETY: slot k holds `layout.bytes()` bytes, as does the pinned batch; the
            // batch stays alive in `inflight` until `copied[k]` has completed.
            unsafe { result::memcpy_htod_async(dst, batch.as_bytes(), self.copy.cu_stream()) }
                .map_err(cuda_err)?;
            self.copied[k].record(&self.copy).map_err(cuda_err)?;
            self.compute.wait(&self.copied[k]).map_err(cuda_err)?;
            self.compute_start[k]
                .record(&self.compute)
                .map_err(cuda_err)?;
            self.enqueue_step(k, batch.len())?;
            self.consumed[k].record(&self.compute).map_err(cuda_err)?;
            out.metrics.samples += batch.len() as u64;
            out.batches += 1;
            progress(
                batch.len() as u64,
                out.stages.wait_data.as_secs_f64() / start.elapsed().as_secs_f64().max(1e-9),
            );
            inflight.push_back((batch, k));
            // Give pinned buffers back as soon as their copies are done; keep at most
            // K - 1 in flight so a slot's previous batch is always released first.
            while let Some((_, k0)) = inflight.front() {
                let k0 = *k0;
                if inflight.len() < k_slots && !self.copied[k0].is_complete() {
                    break;
                }
                self.copied[k0].synchronize().map_err(cuda_err)?;
                copy_ms += self.copy_start[k0]
                    .elapsed_ms(&self.copied[k0])
                    .map_err(cuda_err)? as f64;
                inflight.pop_front();
            }
            i += 1;
        }
        for (_, k0) in inflight.drain(..) {
            self.copied[k0].synchronize().map_err(cuda_err)?;
            copy_ms += self.copy_start[k0]
                .elapsed_ms(&self.copied[k0])
                .map_err(cuda_err)? as f64;
        }
        self.compute.synchronize().map_err(cuda_err)?;
        for j in i.saturating_sub(k_slots)..i {
            let k = j % k_slots;
            compute_ms += self.compute_start[k]
                .elapsed_ms(&self.consumed[k])
                .map_err(cuda_err)? as f64;
        }
        let samples = out.metrics.samples;
        out.metrics = self.read_metrics(samples)?;
        out.loader = epoch.stats();
        out.stages.gather = out.loader.gather;
        out.stages.copy = Duration::from_secs_f64(copy_ms / 1e3);
        out.stages.compute = Duration::from_secs_f64(compute_ms / 1e3);
        out.wall = start.elapsed();
        Ok(out)
    }
}

/// A kernel argument of any supported type, for `launch1`'s argument lists.
trait ArgOf {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}

impl<T: DeviceRepr> ArgOf for T {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }
}
