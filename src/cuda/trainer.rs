//! The built-in training step on the GPU, fed by a [`Feeder`].

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaEvent, CudaGraph, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

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
    /// A cached epoch's launches (device gathers and steps, batch after batch) as one
    /// CUDA graph, for epochs of the shape it was captured for: every cached epoch makes
    /// the same launches with the same arguments (the index list is uploaded to the same
    /// buffer), so one capture serves them all.
    graph: Option<(EpochShape, CudaGraph)>,
}

/// What a captured cached epoch depends on: its batches and the last one's samples.
type EpochShape = (u64, usize);

fn shape_of(order: &EpochOrder) -> EpochShape {
    (
        order.batches(),
        order.batch_len(order.batches().saturating_sub(1)),
    )
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
    /// The first product's partial sums, `splits` of them (split-K).
    part: CudaSlice<f32>,
    split: Split,
    /// The W1 step's per-split partial gradients, and a ticket per tile (see `update`).
    gpart: CudaSlice<f32>,
    ticket: CudaSlice<u32>,
    rows: RowSplit,
    batch_size: usize,
    /// The step on a full batch in each device slot (keyed by its columns' addresses), as
    /// a CUDA graph.
    graphs: std::cell::RefCell<std::collections::HashMap<(u64, u64), CudaGraph>>,
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
        let MlpConfig {
            inputs: d,
            hidden: hd,
            classes: c,
            ..
        } = mlp.config;
        let b = layout.batch_size();
        let split = Split::of(b, d, hd);
        let rows = RowSplit::of(b, d, hd);
        if b.div_ceil(TILE) > 65_535 || split.splits > 65_535 {
            return Err(Error::Config(format!(
                "the CUDA step handles batches of up to {} samples, got {b}",
                65_535 * TILE
            )));
        }
        let feeder = Feeder::new(&cuda, layout, slots)?;
        let s = Arc::clone(feeder.stream());
        let up = |v: &[f32]| s.clone_htod(v).map_err(cuda_err);
        let zeros_f = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(cuda_err);
        let step = Step {
            stream: Arc::clone(&s),
            w1: up(&mlp.w1)?,
            b1: up(&mlp.b1)?,
            w2: up(&mlp.w2)?,
            b2: up(&mlp.b2)?,
            part: zeros_f(split.splits * b * hd)?,
            split,
            gpart: zeros_f(if rows.splits > 1 {
                rows.splits * d * hd
            } else {
                1
            })?,
            ticket: s.alloc_zeros::<u32>(rows.tiles.max(1)).map_err(cuda_err)?,
            rows,
            batch_size: b,
            graphs: Default::default(),
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
            graph: None,
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

    /// Fills the device cache (see
    /// [`enable_device_cache`](CudaTrainer::enable_device_cache)) straight from
    /// `dataset`, its rows in order, in large copies, so that the next epoch already reads
    /// the device; returns how long it took, or `None` when there is no cache.
    ///
    /// # Errors
    /// The dataset's error or a driver error.
    pub fn fill_device_cache(
        &mut self,
        dataset: &dyn crate::dataset::Dataset,
        order: &Order,
    ) -> Result<Option<std::time::Duration>> {
        let t = std::time::Instant::now();
        match &mut self.cache {
            Some(c) => {
                c.fill_from(self.feeder.cuda(), dataset)?;
                self.capture_cached_epoch(&order.epoch(0))?;
                Ok(Some(t.elapsed()))
            }
            None => Ok(None),
        }
    }

    /// Captures the launches of a cached epoch shaped like `order` into a CUDA graph
    /// (unless one of that shape is kept already) and uploads it, so that the first
    /// cached epoch does not pay for it.
    ///
    /// # Errors
    /// A driver error; the stream is left out of capture mode.
    fn capture_cached_epoch(&mut self, order: &EpochOrder) -> Result<()> {
        let shape = shape_of(order);
        if self.graph.as_ref().is_some_and(|(s, _)| *s == shape) {
            return Ok(());
        }
        self.graph = None;
        let Some(cache) = &self.cache else {
            return Ok(());
        };
        let stream = Arc::clone(self.feeder.stream());
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        stream.begin_capture(mode).map_err(cuda_err)?;
        let enqueued = (|| -> Result<()> {
            for b in 0..order.batches() {
                let rows = order.batch_len(b);
                let db = cache.gather(&self.step.kernels, &stream, order.epoch(), b, rows)?;
                self.step.enqueue(&db)?;
            }
            Ok(())
        })();
        // End the capture whatever happened, so the stream is usable again.
        let flags = sys::CUgraphInstantiate_flags(0);
        let graph = stream.end_capture(flags).map_err(cuda_err);
        enqueued?;
        let graph = graph?.ok_or_else(|| Error::Cuda("the captured epoch is empty".into()))?;
        graph.upload().map_err(cuda_err)?;
        self.graph = Some((shape, graph));
        Ok(())
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
        // The whole epoch in one launch where a graph of its shape was captured; traced
        // epochs launch batch by batch, to place their events.
        let graph = match (&trace, &self.graph) {
            (None, Some((shape, g))) if *shape == shape_of(order) => Some(g),
            _ => None,
        };
        let t0 = std::time::Instant::now();
        if let Some(g) = graph {
            g.launch().map_err(cuda_err)?;
        } else if let Some((origin, _)) = &marks {
            origin.record(&stream).map_err(cuda_err)?;
        }
        let mark = |b: usize, i: usize| match &marks {
            Some((_, m)) => m[b][i].record(&stream).map_err(cuda_err),
            None => Ok(()),
        };
        let (mut batches, mut samples) = (0, 0);
        for b in 0..order.batches() {
            let rows = order.batch_len(b);
            if graph.is_none() {
                mark(b as usize, 0)?;
                let db = cache.gather(&self.step.kernels, &stream, order.epoch(), b, rows)?;
                mark(b as usize, 1)?;
                self.step.enqueue(&db)?;
                mark(b as usize, 2)?;
            }
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
        let epoch_order = epoch.order().clone();
        if filling {
            if let Some(c) = &mut self.cache {
                c.upload_order(epoch.order(), self.feeder.stream())?;
            }
        }
        let (step, cache) = (&self.step, &self.cache);
        let fed = self.feeder.run_epoch(
            epoch,
            &mut |db| {
                step.enqueue_replayed(db)?;
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
            self.capture_cached_epoch(&epoch_order)?;
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

/// Both products' output tiles are `TILE x TILE` per block (`TILE` in the kernel).
const TILE: usize = 64;
/// `update`'s small outputs (b1, W2, b2) per block (`SMALL`).
const SMALL_PER_BLOCK: usize = 32;
/// `row_tail`'s threads per sample (`TAIL`).
const TAIL_THREADS: u32 = 256;
/// Chunks of the summed dimension are multiples of this.
const CHUNK_STEP: usize = 16;
/// Blocks each product aims for: two per SM on the largest GPUs (132 SMs on an H100
/// SXM), so that a skinny product (256 x 64 outputs: 4 tiles) fills the device.
const TARGET_BLOCKS: usize = 264;

/// The share of a summed dimension of `len` each block takes, with `tiles` output tiles:
/// small enough that tiles x splits reaches [`TARGET_BLOCKS`], a multiple of
/// [`CHUNK_STEP`]. Where the output alone has too few tiles (skinny products, the
/// default model's), that share fits one shared-memory stage (`KT`, 64, in the
/// kernels): each block loads all it needs at once, one memory round trip.
fn chunk_of(len: usize, tiles: usize) -> usize {
    let want = TARGET_BLOCKS.div_ceil(tiles).max(1);
    len.div_ceil(want).div_ceil(CHUNK_STEP).max(1) * CHUNK_STEP
}

/// How the first product's inputs are split (split-K): `splits` chunks of `chunk`
/// inputs, the last possibly shorter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Split {
    splits: usize,
    chunk: usize,
}

impl Split {
    /// The split for batches of `batch` samples, `inputs` inputs and `hidden` units.
    fn of(batch: usize, inputs: usize, hidden: usize) -> Split {
        let tiles = batch.div_ceil(TILE).max(1) * hidden.div_ceil(TILE).max(1);
        let chunk = chunk_of(inputs, tiles);
        Split {
            splits: inputs.div_ceil(chunk).max(1),
            chunk,
        }
    }
}

/// How the W1 step's samples are split: `tiles` tiles of W1, each summed over `splits`
/// runs of `rows` samples (a multiple of the stage), the last possibly shorter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowSplit {
    tiles: usize,
    splits: usize,
    rows: usize,
}

impl RowSplit {
    /// The split for batches of `batch` samples, `inputs` inputs and `hidden` units.
    fn of(batch: usize, inputs: usize, hidden: usize) -> RowSplit {
        let tiles = inputs.div_ceil(TILE).max(1) * hidden.div_ceil(TILE).max(1);
        // Fewer than the forward product's blocks: the same launch runs the small
        // outputs' blocks too, and all should fit one wave.
        let rows = chunk_of(batch, tiles * 4 / 3);
        RowSplit {
            tiles,
            splits: batch.div_ceil(rows).max(1),
            rows,
        }
    }
}

impl Step {
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Launches every kernel once with zero sizes (each guards its indices, so nothing
    /// is read or written) and waits: CUDA's lazy module loading is paid here, not by
    /// the first batch.
    fn warm_up(&self) -> Result<()> {
        let (zero, zero64, null, f, one) = (0i32, 0i64, 0u64, 0f32, 1i32);
        let kk = &self.kernels;
        let one_block = ((1, 1, 1), 256);
        self.launch(
            &kk.forward,
            one_block,
            &[&null, &null, &null, &zero, &zero, &zero, &one, &f, &f],
        )?;
        let args: [&dyn ArgOf; 15] = [
            &null, &zero, &null, &null, &null, &null, &null, &null, &null, &zero, &zero, &zero,
            &null, &null, &null,
        ];
        self.launch(&kk.tail, ((1, 1, 1), TAIL_THREADS), &args)?;
        let args: [&dyn ArgOf; 20] = [
            &null, &null, &null, &null, &null, &null, &null, &null, &null, &null, &zero, &zero,
            &zero, &zero, &f, &f, &f, &zero, &one, &zero,
        ];
        self.launch(&kk.update, one_block, &args)?;
        let rows = [&null as &dyn ArgOf, &null, &null, &zero, &zero64, &one];
        self.launch(&kk.scatter_rows, one_block, &rows)?;
        self.launch(&kk.gather_rows, one_block, &rows)?;
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

    /// Launches `f` on the compute stream with a `grid` of blocks of `threads` threads.
    fn launch(
        &self,
        f: &cudarc::driver::CudaFunction,
        (grid, threads): ((u32, u32, u32), u32),
        args: &[&dyn ArgOf],
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(f);
        for a in args {
            a.push(&mut b);
        }
        // SAFETY: every kernel of `kernels/mlp.cu` takes exactly the arguments its caller
        // passes here (device addresses as u64, sizes, scalars, in its order), every
        // address points into a live allocation of at least the size the kernel reads or
        // writes for the sizes passed with it, and each kernel checks its indices against
        // those sizes (zero sizes touch nothing).
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(cuda_err)
    }

    /// Enqueues the step on a batch on the device (on the batch's stream, which is the
    /// feeder's compute stream).
    /// [`enqueue`](Step::enqueue) as one graph launch: the step's launches on a full batch
    /// in a given device slot are captured into a CUDA graph the first time, and replayed
    /// after (one launch instead of three, the host's cost per batch). Partial batches
    /// launch directly.
    fn enqueue_replayed(&self, batch: &DeviceBatch) -> Result<()> {
        if batch.len() != self.batch_size {
            return self.enqueue(batch);
        }
        let key = (
            batch.column_ptr(self.columns.0),
            batch.column_ptr(self.columns.1),
        );
        let mut graphs = self.graphs.borrow_mut();
        let graph = match graphs.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let s = self.stream();
                let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
                s.begin_capture(mode).map_err(cuda_err)?;
                let enqueued = self.enqueue(batch);
                // End the capture whatever happened, so the stream is usable again.
                let graph = s.end_capture(sys::CUgraphInstantiate_flags(0));
                enqueued?;
                let graph = graph
                    .map_err(cuda_err)?
                    .ok_or_else(|| Error::Cuda("the captured step is empty".into()))?;
                e.insert(graph)
            }
        };
        graph.launch().map_err(cuda_err)
    }

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
        let [part, hid, z, dh, w1, b1, w2, b2] = [
            &self.part, &self.h, &self.z, &self.dh, &self.w1, &self.b1, &self.w2, &self.b2,
        ]
        .map(|m| addr(m, s));
        let [loss, correct] = [addr(&self.loss_sum, s), addr(&self.correct, s)];
        let bad = addr(&self.bad, s);
        let Normalize { mean, inv_std } = self.norm;
        let (ni, di, hi, ci) = (n as i32, d as i32, h as i32, c as i32);
        let Split { splits, chunk } = self.split;
        let (splits_i, chunk_i) = (splits as i32, chunk as i32);
        let kk = &self.kernels;
        // part[s] = norm(x) W1 over inputs [s * chunk, (s + 1) * chunk).
        let grid = (
            h.div_ceil(TILE) as u32,
            n.div_ceil(TILE) as u32,
            splits as u32,
        );
        let args: [&dyn ArgOf; 9] = [&xin, &w1, &part, &ni, &di, &hi, &chunk_i, &mean, &inv_std];
        self.launch(&kk.forward, (grid, 256), &args)?;
        // Per sample: hidden layer, logits, loss, dz (in z) and dh.
        let args: [&dyn ArgOf; 15] = [
            &part, &splits_i, &b1, &w2, &b2, &yin, &hid, &z, &dh, &ni, &hi, &ci, &loss, &correct,
            &bad,
        ];
        self.launch(&kk.tail, ((n as u32, 1, 1), TAIL_THREADS), &args)?;
        // Every weight's SGD step.
        let RowSplit {
            tiles,
            splits,
            rows,
        } = self.rows;
        let w1_blocks = tiles * splits;
        let small = (h + h * c + c).div_ceil(SMALL_PER_BLOCK);
        let [gpart, ticket] = [addr(&self.gpart, s), addr(&self.ticket, s)];
        let [w1_blocks_i, row_splits, rows_per] = [w1_blocks, splits, rows].map(|v| v as i32);
        let args: [&dyn ArgOf; 20] = [
            &xin,
            &hid,
            &z,
            &dh,
            &w1,
            &b1,
            &w2,
            &b2,
            &gpart,
            &ticket,
            &ni,
            &di,
            &hi,
            &ci,
            &mean,
            &inv_std,
            &lr,
            &w1_blocks_i,
            &row_splits,
            &rows_per,
        ];
        self.launch(&kk.update, (((w1_blocks + small) as u32, 1, 1), 256), &args)?;
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

/// A kernel argument of any supported type, for [`Step::launch`]'s argument lists.
trait ArgOf {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}

impl<T: DeviceRepr> ArgOf for T {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }
}

#[cfg(test)]
mod tests {
    use super::{RowSplit, Split};

    #[test]
    fn the_split_covers_every_input_in_whole_stages() {
        for (b, d, h) in [
            (256, 3072, 64),
            (256, 64, 64),
            (1, 1, 1),
            (64, 100, 4096),
            (512, 3, 10),
        ] {
            let s = Split::of(b, d, h);
            assert_eq!(s.chunk % 16, 0, "{b} {d} {h}: {s:?}");
            assert!(s.splits * s.chunk >= d, "{b} {d} {h}: {s:?}");
            assert!(
                (s.splits - 1) * s.chunk < d.max(1),
                "{b} {d} {h}: empty split {s:?}"
            );
        }
        // The default model (CIFAR-like inputs, 64 hidden): the skinny product is split
        // enough to fill an H100.
        let s = Split::of(256, 3072, 64);
        assert!(s.splits * 4 >= 132, "{s:?}");
        // ... and each block's share fits one shared-memory stage (64).
        assert!(s.chunk <= 64, "{s:?}");
    }

    #[test]
    fn the_row_split_covers_every_sample() {
        for (b, d, h) in [
            (256, 3072, 64),
            (256, 64, 64),
            (1, 1, 1),
            (64, 100, 4096),
            (7, 3, 10),
        ] {
            let r = RowSplit::of(b, d, h);
            assert_eq!(r.rows % 16, 0, "{b} {d} {h}: {r:?}");
            assert!(r.splits * r.rows >= b, "{b} {d} {h}: {r:?}");
            assert!(
                (r.splits - 1) * r.rows < b,
                "{b} {d} {h}: empty split {r:?}"
            );
        }
        let r = RowSplit::of(256, 3072, 64);
        assert!(r.tiles * r.splits >= 132, "{r:?}");
        assert!(r.rows <= 64, "{r:?}");
        // A wide model has tiles enough: no split, no partial sums.
        assert_eq!(RowSplit::of(256, 3072, 16_384).splits, 1);
    }
}
