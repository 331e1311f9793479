//! The built-in training step on the GPU, fed by a [`Feeder`].

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};

use super::cache::DeviceCache;
use super::feeder::{addr, cuda_err, DeviceBatch, Feeder};
use super::kernels::Kernels;
use super::Cuda;
use crate::cpu::{check_columns, EpochOutcome};
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, Epoch, HostBatch};
use crate::sampler::{EpochOrder, Order};
use crate::train::{Metrics, Mlp, MlpConfig, Normalize};

/// Training state on the GPU: a feeder and the step it drives.
pub struct CudaTrainer {
    feeder: Feeder,
    step: Step,
    cache: Option<DeviceCache>,
    /// Events for trace spans of epochs served by the device cache: an origin, then per
    /// batch the start of its device gather, the start of its step and the step's end.
    marks: Option<(CudaEvent, Vec<[CudaEvent; 3]>)>,
}

/// The model on the device and the kernels that train it, enqueued on `stream`.
struct Step {
    stream: Arc<CudaStream>,
    kernels: Kernels,
    config: MlpConfig,
    norm: Normalize,
    columns: (usize, usize),
    w1: CudaSlice<f32>,
    b1: CudaSlice<f32>,
    w2: CudaSlice<f32>,
    b2: CudaSlice<f32>,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    z: CudaSlice<f32>,
    dh: CudaSlice<f32>,
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
        // The matrix kernel puts 16 rows per block on the grid's y axis (at most 65535).
        let largest = layout
            .batch_size()
            .max(mlp.config.inputs)
            .max(mlp.config.hidden);
        if largest > 65_535 * 16 {
            return Err(Error::Config(format!(
                "the CUDA step handles batch, inputs and hidden up to {}, got {largest}",
                65_535 * 16
            )));
        }
        let feeder = Feeder::new(&cuda, layout, slots)?;
        let s = Arc::clone(feeder.stream());
        let up = |v: &[f32]| s.clone_htod(v).map_err(cuda_err);
        let MlpConfig {
            inputs: d,
            hidden: hd,
            classes: c,
            ..
        } = mlp.config;
        let b = layout.batch_size();
        let zeros_f = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(cuda_err);
        let step = Step {
            stream: Arc::clone(&s),
            w1: up(&mlp.w1)?,
            b1: up(&mlp.b1)?,
            w2: up(&mlp.w2)?,
            b2: up(&mlp.b2)?,
            x: zeros_f(b * d)?,
            h: zeros_f(b * hd)?,
            z: zeros_f(b * c)?,
            dh: zeros_f(b * hd)?,
            loss_sum: s.alloc_zeros::<f64>(1).map_err(cuda_err)?,
            correct: s.alloc_zeros::<u64>(1).map_err(cuda_err)?,
            bad: s.alloc_zeros::<i32>(1).map_err(cuda_err)?,
            config: mlp.config,
            norm,
            columns,
            kernels,
        };
        s.synchronize().map_err(cuda_err)?;
        Ok(CudaTrainer {
            feeder,
            step,
            cache: None,
            marks: None,
        })
    }

    /// The device this trainer runs on.
    pub fn cuda(&self) -> &Cuda {
        self.feeder.cuda()
    }

    /// The kernels (with how they were obtained).
    pub fn kernels(&self) -> &Kernels {
        &self.step.kernels
    }

    /// Copies the weights back to the host.
    ///
    /// # Errors
    /// [`Error::Cuda`] if the copy fails.
    pub fn weights(&self) -> Result<Mlp> {
        self.step.weights()
    }

    /// Records trace spans (see [`Feeder::set_trace`]).
    pub fn set_trace(&mut self, trace: Arc<crate::report::Trace>) {
        self.feeder.set_trace(trace);
    }

    /// Serialised mode for the overlap benchmark (see [`Feeder::set_serial`]).
    ///
    /// # Errors
    /// [`Error::Cuda`] if a stream cannot be made.
    pub fn set_serial(&mut self, serial: bool) -> Result<()> {
        self.feeder.set_serial(serial)
    }

    /// Keeps a device-resident copy of the dataset of `order` if it fits under `share` of
    /// free device memory and one epoch covers every row (a single shard, nothing
    /// dropped): the next whole epoch fills it, and
    /// [`train_epoch_cached`](CudaTrainer::train_epoch_cached) reads from it. Returns
    /// the cache's size in bytes, or `None` when it does not apply.
    ///
    /// # Errors
    /// [`Error::Cuda`] if the allocation fails.
    pub fn enable_device_cache(&mut self, order: &Order, share: f64) -> Result<Option<u64>> {
        // One epoch must scatter every row, or later epochs would gather rows never
        // written: one shard, and no sample dropped by the tail rule or drop_last.
        let rows = order.len();
        let whole = order.shard().world_size() == 1
            && order.samples() == rows
            && order.batches() * order.batch_size() >= rows;
        if !whole {
            self.cache = None;
            return Ok(None);
        }
        let layout = self.feeder.layout().clone();
        let (cuda, stream) = (self.feeder.cuda(), self.feeder.stream());
        self.cache = DeviceCache::new(cuda, stream, &layout, rows, rows, share)?;
        Ok(self.cache.as_ref().map(DeviceCache::bytes))
    }

    /// Whether the device cache holds a whole epoch's samples.
    pub fn cache_filled(&self) -> bool {
        self.cache.as_ref().is_some_and(DeviceCache::filled)
    }

    /// Trains an epoch from the device cache: batches gathered on the device by index,
    /// no host gathering, no host-to-device copy but the epoch's index list.
    ///
    /// # Errors
    /// [`Error::Config`] if the cache is not filled; a driver error; [`Error::Cuda`] for
    /// a bad label.
    pub fn train_epoch_cached(
        &mut self,
        order: &EpochOrder,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<EpochOutcome> {
        let start = std::time::Instant::now();
        let cache = match &mut self.cache {
            Some(c) if c.filled() => c,
            _ => return Err(Error::Config("the device cache is not filled".into())),
        };
        self.step.reset_metrics()?;
        let stream = Arc::clone(self.feeder.stream());
        cache.upload_order(order, &stream)?;
        let trace = self.feeder.trace().cloned();
        let n = order.batches() as usize;
        let marks = match &trace {
            Some(_) => Some(marks_for(&mut self.marks, self.feeder.cuda(), n)?),
            None => None,
        };
        let t0 = std::time::Instant::now();
        if let Some((origin, _)) = &marks {
            origin.record(&stream).map_err(cuda_err)?;
        }
        let mark = |b: usize, i: usize| match &marks {
            Some((_, m)) => m[b][i].record(&stream).map_err(cuda_err),
            None => Ok(()),
        };
        let (mut batches, mut samples) = (0, 0);
        for b in 0..order.batches() {
            let rows = order.batch_len(b);
            mark(b as usize, 0)?;
            let db = cache.gather(&self.step.kernels, &stream, order.epoch(), b, rows)?;
            mark(b as usize, 1)?;
            self.step.enqueue(&db)?;
            mark(b as usize, 2)?;
            batches += 1;
            samples += rows as u64;
            progress(rows as u64, 0.0);
        }
        let metrics = self.step.read_metrics(samples)?;
        let wall = start.elapsed();
        if let (Some(tr), Some((origin, m))) = (&trace, &marks) {
            // The stream is synchronised: every event has completed.
            let at = |e: &CudaEvent| -> Result<std::time::Instant> {
                let ms = origin.elapsed_ms(e).map_err(cuda_err)?;
                Ok(t0 + std::time::Duration::from_secs_f64(ms.max(0.0) as f64 / 1e3))
            };
            for (b, [g, s, e]) in m.iter().take(n).enumerate() {
                let track = "compute stream";
                let (g, s, e) = (at(g)?, at(s)?, at(e)?);
                tr.span("device gather", track, (g, s), order.epoch(), b as u64);
                tr.span("compute", track, (s, e), order.epoch(), b as u64);
            }
        }
        let mut out = EpochOutcome {
            metrics,
            wall,
            batches,
            ..EpochOutcome::default()
        };
        out.stages.compute = wall;
        Ok(out)
    }

    /// Pays the first launch of every kernel (lazy module loading) now; returns how long
    /// it took.
    ///
    /// # Errors
    /// [`Error::Cuda`] if a launch fails.
    pub fn warm_up(&self) -> Result<std::time::Duration> {
        let t = std::time::Instant::now();
        self.step.warm_up()?;
        Ok(t.elapsed())
    }

    /// One step on one batch, synchronously (for checking against the CPU backend).
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error or a bad label (flagged on the device).
    pub fn step_once(&mut self, batch: &HostBatch) -> Result<Metrics> {
        self.step.reset_metrics()?;
        let step = &self.step;
        self.feeder.feed_one(batch, |db| step.enqueue(db))?;
        self.step.read_metrics(batch.len() as u64)
    }

    /// Trains on every batch of `epoch`, copies overlapped with compute (see
    /// [`Feeder`]); `progress(samples, stalled)` after each batch is enqueued.
    ///
    /// # Errors
    /// The loader's first error, a driver error, or [`Error::Cuda`] for a label outside
    /// the classes (checked at the end of the epoch, when the device's counters are read).
    pub fn train_epoch_with(
        &mut self,
        epoch: Epoch<'_>,
        progress: &mut dyn FnMut(u64, f64),
    ) -> Result<EpochOutcome> {
        self.step.reset_metrics()?;
        // A whole epoch, started from its first batch, fills the cache on the way.
        let filling = epoch.first_batch() == 0 && self.cache.as_ref().is_some_and(|c| !c.filled());
        if filling {
            if let Some(c) = &mut self.cache {
                c.upload_order(epoch.order(), self.feeder.stream())?;
            }
        }
        let (step, cache) = (&self.step, &self.cache);
        let fed = self.feeder.run_epoch(
            epoch,
            &mut |db| {
                step.enqueue(db)?;
                match cache {
                    Some(c) if filling => c.scatter(&step.kernels, db),
                    _ => Ok(()),
                }
            },
            progress,
        )?;
        if filling {
            if let Some(c) = &mut self.cache {
                c.set_filled();
            }
        }
        let mut out = EpochOutcome {
            metrics: self.step.read_metrics(fed.samples)?,
            loader: fed.loader,
            wall: fed.wall,
            batches: fed.batches,
            ..EpochOutcome::default()
        };
        out.stages.gather = fed.loader.gather;
        out.stages.wait_data = fed.wait_data;
        out.stages.copy = fed.copy;
        out.stages.compute = fed.compute;
        Ok(out)
    }
}

/// The trace events of a cached epoch of `n` batches, made on first use and kept.
fn marks_for<'a>(
    marks: &'a mut Option<(CudaEvent, Vec<[CudaEvent; 3]>)>,
    cuda: &Cuda,
    n: usize,
) -> Result<&'a (CudaEvent, Vec<[CudaEvent; 3]>)> {
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let event = || cuda.ctx.new_event(timed).map_err(cuda_err);
    if marks.is_none() {
        *marks = Some((event()?, Vec::new()));
    }
    let (_, m) = marks.as_mut().expect("just set");
    while m.len() < n {
        m.push([event()?, event()?, event()?]);
    }
    Ok(marks.as_ref().expect("just set"))
}

impl Step {
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Launches every kernel once with zero sizes (each guards its indices, so nothing
    /// is read or written) and waits: CUDA's lazy module loading is paid here, not by
    /// the first batch.
    fn warm_up(&self) -> Result<()> {
        let (zero, zero64, null) = (0i32, 0i64, 0u64);
        let kk = &self.kernels;
        let f = 0f32;
        self.launch1(&kk.normalize, 0, &[&null, &null, &zero64, &f, &f])?;
        self.launch1(&kk.fill_rows, 0, &[&null, &null, &zero, &zero])?;
        self.launch1(&kk.relu, 0, &[&null, &zero64])?;
        self.launch1(
            &kk.softmax_xent,
            0,
            &[&null, &null, &zero, &zero, &null, &null, &null],
        )?;
        self.launch1(&kk.relu_backward, 0, &[&null, &null, &zero64])?;
        self.launch1(&kk.bias_sgd, 0, &[&null, &null, &zero, &zero, &f])?;
        self.launch1(&kk.scatter_rows, 0, &[&null, &null, &null, &zero, &zero64])?;
        self.launch1(&kk.gather_rows, 0, &[&null, &null, &null, &zero, &zero64])?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (16, 16, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream().launch_builder(&self.kernels.sgemm);
        l.arg(&zero).arg(&zero).arg(&zero).arg(&f);
        l.arg(&null)
            .arg(&zero64)
            .arg(&zero64)
            .arg(&null)
            .arg(&zero64)
            .arg(&zero64);
        l.arg(&f).arg(&null).arg(&zero64);
        // SAFETY: m = n = k = 0: the kernel's bounds checks skip every load and store.
        unsafe { l.launch(cfg) }.map_err(cuda_err)?;
        self.stream().synchronize().map_err(cuda_err)
    }

    fn weights(&self) -> Result<Mlp> {
        let s = self.stream();
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
        let mut b = self.stream().launch_builder(f);
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
        let mut l = self.stream().launch_builder(&self.kernels.sgemm);
        l.arg(&m).arg(&n).arg(&k).arg(&alpha);
        l.arg(&a).arg(&rsa).arg(&csa).arg(&b).arg(&rsb).arg(&csb);
        l.arg(&beta).arg(&c).arg(&rsc);
        // SAFETY: `sgemm_strided`'s signature is (int, int, int, float, ptr, i64, i64, ptr,
        // i64, i64, float, ptr, i64); the callers' strides keep every access inside the
        // matrices they pass, as in the CPU backend's checked `gemm`.
        unsafe { l.launch(cfg) }.map(|_| ()).map_err(cuda_err)
    }

    /// Enqueues the step on a batch on the device (on the batch's stream, which is the
    /// feeder's compute stream).
    fn enqueue(&self, batch: &DeviceBatch) -> Result<()> {
        let s = self.stream();
        let n = batch.len();
        let MlpConfig {
            inputs: d,
            hidden: h,
            classes: c,
            lr,
            ..
        } = self.config;
        let xin = batch.column_ptr(self.columns.0);
        let yin = batch.column_ptr(self.columns.1);
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
        let s = Arc::clone(self.stream());
        s.memset_zeros(&mut self.loss_sum).map_err(cuda_err)?;
        s.memset_zeros(&mut self.correct).map_err(cuda_err)?;
        s.memset_zeros(&mut self.bad).map_err(cuda_err)
    }

    /// Reads the epoch's loss and accuracy (one device-to-host copy per epoch).
    fn read_metrics(&self, samples: u64) -> Result<Metrics> {
        let s = self.stream();
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
