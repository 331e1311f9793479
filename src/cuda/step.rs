//! The training step on the device: the model's weights, the buffers of the three
//! kernels of `kernels/mlp.cu` (a split-K forward product, a per-sample tail, one update),
//! and how each launch is shaped. The host reference is [`crate::model::step`].

use std::cell::RefCell;
use std::collections::hash_map::{Entry, HashMap};
use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};

use super::feeder::{addr, DeviceBatch};
use super::kernels::Kernels;
use crate::error::{Error, Result};
use crate::model::{Metrics, Mlp, MlpConfig, Normalize};

/// The model on the device and the kernels that train it, enqueued on `stream`.
pub(super) struct Step {
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
    graphs: RefCell<HashMap<(u64, u64), CudaGraph>>,
    h: CudaSlice<f32>,
    z: CudaSlice<f32>,
    dh: CudaSlice<f32>,
    loss_sum: CudaSlice<f64>,
    correct: CudaSlice<u64>,
    /// The first bad label's row plus one (0: none), and its value.
    bad: CudaSlice<u64>,
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
    /// Uploads `mlp`'s weights and allocates the step's buffers for batches of up to
    /// `batch` samples, on `stream`.
    ///
    /// # Errors
    /// [`Error::Config`] for batches the launch grids cannot cover; [`Error::Cuda`] when
    /// an allocation fails.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        kernels: Kernels,
        (mlp, norm): (&Mlp, Normalize),
        batch: usize,
        columns: (usize, usize),
    ) -> Result<Step> {
        let MlpConfig {
            inputs: d,
            hidden: hd,
            classes: c,
            ..
        } = mlp.config;
        let b = batch;
        let split = Split::of(b, d, hd);
        let rows = RowSplit::of(b, d, hd);
        if b.div_ceil(TILE) > 65_535 || split.splits > 65_535 {
            return Err(Error::Config(format!(
                "the CUDA step handles batches of up to {} samples, got {b}",
                65_535 * TILE
            )));
        }
        let s = stream;
        let up = |v: &[f32]| s.clone_htod(v).map_err(Error::from);
        let zeros_f = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(Error::from);
        let step = Step {
            stream: Arc::clone(s),
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
            ticket: s.alloc_zeros::<u32>(rows.tiles.max(1))?,
            rows,
            batch_size: b,
            graphs: RefCell::default(),
            h: zeros_f(b * hd)?,
            z: zeros_f(b * c)?,
            dh: zeros_f(b * hd)?,
            loss_sum: s.alloc_zeros::<f64>(1)?,
            correct: s.alloc_zeros::<u64>(1)?,
            bad: s.alloc_zeros::<u64>(2)?,
            config: mlp.config,
            norm,
            columns,
            kernels,
        };
        s.synchronize()?;
        Ok(step)
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The kernels.
    pub(super) fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// The model's inputs per sample (bytes of the `x` column).
    pub(super) fn inputs(&self) -> usize {
        self.config.inputs
    }

    /// The columns it reads: the inputs and the labels.
    pub(super) fn columns(&self) -> (usize, usize) {
        self.columns
    }

    /// Launches every kernel once with zero sizes (each guards its indices, so nothing
    /// is read or written) and waits: CUDA's lazy module loading is paid here, not by
    /// the first batch.
    pub(super) fn warm_up(&self) -> Result<()> {
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
        self.stream().synchronize().map_err(Error::from)
    }

    pub(super) fn weights(&self) -> Result<Mlp> {
        let s = self.stream();
        s.synchronize()?;
        let down = |v: &CudaSlice<f32>| s.clone_dtoh(v).map_err(Error::from);
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
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(Error::from)
    }

    /// Enqueues the step on a batch on the device (on the batch's stream, which is the
    /// feeder's compute stream).
    /// [`enqueue`](Step::enqueue) as one graph launch: the step's launches on a full batch
    /// in a given device slot are captured into a CUDA graph the first time, and replayed
    /// after (one launch instead of three, the host's cost per batch). Partial batches
    /// launch directly.
    pub(super) fn enqueue_replayed(&self, batch: &DeviceBatch) -> Result<()> {
        if batch.len() != self.batch_size {
            return self.enqueue(batch);
        }
        let key = (
            batch.column_ptr(self.columns.0),
            batch.column_ptr(self.columns.1),
        );
        let mut graphs = self.graphs.borrow_mut();
        let graph = match graphs.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let graph = super::capture_graph(self.stream(), "step", || self.enqueue(batch))?;
                e.insert(graph)
            }
        };
        graph.launch().map_err(Error::from)
    }

    pub(super) fn enqueue(&self, batch: &DeviceBatch) -> Result<()> {
        let s = self.stream();
        let n = batch.len();
        // The kernels write `n` rows into buffers of `batch_size`.
        if n > self.batch_size {
            return Err(Error::Config(format!(
                "a batch of {n} samples for a step built for batches of {}",
                self.batch_size
            )));
        }
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

    pub(super) fn reset_metrics(&mut self) -> Result<()> {
        let s = Arc::clone(self.stream());
        s.memset_zeros(&mut self.loss_sum)?;
        s.memset_zeros(&mut self.correct)?;
        s.memset_zeros(&mut self.bad).map_err(Error::from)
    }

    /// Reads the epoch's loss and accuracy (one device-to-host copy per epoch).
    pub(super) fn read_metrics(&self, samples: u64) -> Result<Metrics> {
        let s = self.stream();
        s.synchronize()?;
        let loss = s.clone_dtoh(&self.loss_sum)?[0];
        let correct = s.clone_dtoh(&self.correct)?[0];
        let bad = s.clone_dtoh(&self.bad)?;
        if bad[0] != 0 {
            // The device knows the label and its row in a batch, not the sample's index.
            return Err(Error::Label {
                label: bad[1] as i64,
                classes: self.config.classes,
                sample: None,
            });
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
