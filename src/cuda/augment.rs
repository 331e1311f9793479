//! Augmentation on the GPU (`kernels/augment.cu`): a batch's raw images are copied to the
//! device and cropped, flipped and normalised there, into the batch's slot, so the bus
//! carries bytes, not the floats they become (4x fewer with a normalisation).

use std::sync::Arc;

use cudarc::driver::{result, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig};
use cudarc::driver::{PushKernelArg, ValidAsZeroBits};

use rayon::prelude::*;

use super::feeder::{addr, DeviceBatch};
use super::kernels::{cache_dir, load_program, KernelOrigin, Program};
use super::pinned::{PinnedAlloc, PinnedKind};
use super::Cuda;
use crate::augment::{Augment, Augmenter, Draw, MAX_PAD};
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, HostAlloc, HostBatch, HostMemory};
use crate::sampler::EpochOrder;

/// The augmentation kernel's source.
pub const AUGMENT: Program = Program {
    source: include_str!("../../kernels/augment.cu"),
    name: "augment",
};

/// A draw as the kernel reads it: `dy + MAX_PAD` in bits 0..14, `dx + MAX_PAD` in bits
/// 14..28, the flip in bit 28.
pub fn packed(d: Draw) -> u32 {
    let at = |v: i32| (v + MAX_PAD as i32) as u32 & 0x3fff;
    at(d.dy) | at(d.dx) << 14 | u32::from(d.flip) << 28
}

/// Writes the packed draws of samples `indices` of `epoch` into `out` (as many as both
/// hold).
fn pack_draws(augment: &Augment, epoch: u64, indices: &[u64], out: &mut [u32]) {
    for (d, &i) in out.iter_mut().zip(indices) {
        *d = packed(augment.draw(epoch, i));
    }
}

/// The augmentation kernel loaded on a device, with its normalisation table.
pub(crate) struct AugmentKernel {
    augmenter: Augmenter,
    function: CudaFunction,
    _module: Arc<CudaModule>,
    table: Option<CudaSlice<f32>>,
    /// Where the kernel came from, and how long it took.
    pub(crate) origin: KernelOrigin,
}

impl AugmentKernel {
    /// Loads the kernel (compiled, or from the disk cache) and uploads `augmenter`'s
    /// normalisation table on `stream` (not waited for).
    ///
    /// # Errors
    /// [`Error::Cuda`] for NVRTC's log or a driver error.
    fn load(cuda: &Cuda, stream: &Arc<CudaStream>, augmenter: &Augmenter) -> Result<AugmentKernel> {
        let (module, origin) = load_program(cuda, &cache_dir(), &AUGMENT, |cuda, ptx, origin| {
            Ok((cuda.ctx.load_module(ptx)?, origin))
        })?;
        let function = module.load_function("augment_images")?;
        let table = match augmenter.table() {
            Some(t) => Some(stream.clone_htod(t)?),
            None => None,
        };
        Ok(AugmentKernel {
            augmenter: augmenter.clone(),
            function,
            _module: module,
            table,
            origin,
        })
    }

    /// Enqueues on `stream` the augmentation of the `rows` raw images at `raw` into `dst`,
    /// by the packed draws at `draws`.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    ///
    /// # Safety
    /// `raw` holds `rows` raw images, `dst` as many augmented ones (float32 when the
    /// augmenter normalises), `draws` `rows` packed draws, all device memory that stays
    /// allocated, and unwritten by other work, until `stream` has run the kernel.
    unsafe fn launch(
        &self,
        stream: &CudaStream,
        (raw, dst, draws): (u64, u64, u64),
        rows: usize,
    ) -> Result<()> {
        let (ch, h, w) = self.augmenter.geometry();
        let total = (rows * ch * h * w) as u64;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let table = self.table.as_ref().map_or(0, |t| addr(t, stream));
        let (rows, ch, h, w) = (rows as u32, ch as u32, h as u32, w as u32);
        let last = u32::from(self.augmenter.channels_last());
        let fill = u32::from(self.augmenter.fill());
        let mut l = stream.launch_builder(&self.function);
        l.arg(&raw)
            .arg(&dst)
            .arg(&draws)
            .arg(&table)
            .arg(&rows)
            .arg(&ch)
            .arg(&h)
            .arg(&w)
            .arg(&last)
            .arg(&fill);
        // SAFETY: augment_images(const u8*, void*, const u32*, const float*, u32 x6): the
        // images at `raw`, the output at `dst` (of channels * 256 floats a table) and the
        // draws hold `rows` of theirs (the caller's contract); the kernel reads and writes
        // only inside those (its loop ends at the total).
        unsafe { l.launch(cfg) }.map(|_| ()).map_err(Error::from)
    }
}

/// An [`Augmenter`] on a device for the slots of a [`DeviceSlots`](super::DeviceSlots):
/// its kernel, and for each slot the raw images and the draws of the batch in it.
pub(crate) struct DeviceAugment {
    kernel: AugmentKernel,
    /// The batches' layout as the loader gathers them (the raw column).
    raw: BatchLayout,
    images: Vec<CudaSlice<u8>>,
    draws: Vec<CudaSlice<u32>>,
    /// Page-locked staging of each slot's draws, rewritten only once that slot's last
    /// copy is done (the caller's `copied` event).
    staged: Vec<Box<dyn HostMemory>>,
}

/// Refuses an augmenter bound to other columns than `raw`'s.
fn check_inputs(raw: &BatchLayout, augmenter: &Augmenter) -> Result<()> {
    if raw.columns() != augmenter.inputs() {
        return Err(Error::Config(
            "augment: the augmenter was bound to other columns than these batches'".into(),
        ));
    }
    Ok(())
}

impl DeviceAugment {
    /// Loads the kernel (compiled, or from the cache) and allocates, for `slots` slots of
    /// batches of `raw` (the loader's layout, before augmentation), the raw images and
    /// the draws.
    ///
    /// # Errors
    /// [`Error::Cuda`] for NVRTC's log or a driver error; [`Error::Alloc`] for the
    /// staging memory; [`Error::Config`] for an augmenter of other columns.
    pub(crate) fn new(
        cuda: &Cuda,
        stream: &Arc<CudaStream>,
        raw: &BatchLayout,
        augmenter: &Augmenter,
        slots: usize,
    ) -> Result<DeviceAugment> {
        check_inputs(raw, augmenter)?;
        let kernel = AugmentKernel::load(cuda, stream, augmenter)?;
        let c = augmenter.column();
        let n = raw.batch_size();
        let image = raw.columns()[c].row_bytes * n;
        let images = (0..slots)
            .map(|_| alloc::<u8>(stream, image))
            .collect::<Result<_>>()?;
        let draws = (0..slots)
            .map(|_| alloc::<u32>(stream, n))
            .collect::<Result<_>>()?;
        let pinned = PinnedAlloc::new(Arc::clone(&cuda.ctx), PinnedKind::Plain);
        let staged = (0..slots)
            .map(|_| pinned.alloc(n.max(1) * 4))
            .collect::<Result<_>>()?;
        stream.synchronize()?;
        Ok(DeviceAugment {
            kernel,
            raw: raw.clone(),
            images,
            draws,
            staged,
        })
    }

    /// The augmenter.
    pub(crate) fn augmenter(&self) -> &Augmenter {
        &self.kernel.augmenter
    }

    /// Where the kernel came from, and how long it took.
    pub(crate) fn origin(&self) -> &KernelOrigin {
        &self.kernel.origin
    }

    /// The layout of the batches it augments, as the loader gathers them.
    pub(crate) fn raw(&self) -> &BatchLayout {
        &self.raw
    }

    /// Where the raw rows of slot `k`'s batch go, column by column of the loader's
    /// layout: the images to the slot's own buffer, every other column straight to its
    /// place in the slot (device memory at `slot`, laid out as `out`).
    pub(crate) fn targets(
        &self,
        stream: &CudaStream,
        k: usize,
        slot: u64,
        out: &BatchLayout,
    ) -> Vec<u64> {
        let c = self.kernel.augmenter.column();
        (0..self.raw.columns().len())
            .map(|j| match j == c {
                true => addr(&self.images[k], stream),
                false => slot + out.offset(j) as u64,
            })
            .collect()
    }

    /// Enqueues on `stream` the copies of `batch`'s raw rows to `targets` (from
    /// [`targets`](Self::targets)): every other column straight to its place in the
    /// slot, the images to the slot's own buffer, for
    /// [`enqueue_kernel`](Self::enqueue_kernel) to augment.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    ///
    /// # Safety
    /// `batch` passed [`check`](Self::check); each target holds its column's rows and
    /// nothing else uses it until `stream` has run this work; `batch` stays alive until
    /// then.
    pub(crate) unsafe fn copy_raw(
        &self,
        stream: &CudaStream,
        batch: &HostBatch,
        targets: &[u64],
    ) -> Result<()> {
        let bytes = batch.as_bytes();
        for (j, col) in self.raw.columns().iter().enumerate() {
            let from = &bytes[self.raw.offset(j)..][..col.row_bytes * batch.len()];
            // SAFETY: `targets[j]` holds `rows` rows of this column (the slot's column,
            // or the images buffer allocated for a full batch, by the caller's
            // contract); the batch outlives the copy (the caller's contract).
            unsafe { result::memcpy_htod_async(targets[j], from, stream.cu_stream()) }?;
        }
        Ok(())
    }

    /// The rows of `batch`, checked against the loader's layout the slots were made for.
    pub(crate) fn check(&self, batch: &HostBatch) -> Result<usize> {
        let rows = batch.len();
        let bytes = batch.as_bytes().len();
        let same = batch.layout().columns() == self.raw.columns();
        if !same || bytes != self.raw.bytes() || rows > self.raw.batch_size() {
            return Err(Error::Config(format!(
                "augment: a batch of {bytes} bytes and {rows} rows, for slots of batches of {} \
                 bytes and at most {} rows",
                self.raw.bytes(),
                self.raw.batch_size()
            )));
        }
        Ok(rows)
    }

    /// Enqueues on `stream` the upload of `batch`'s draws and the kernel that augments
    /// slot `k`'s raw images (in place already, at [`targets`](Self::targets)) into the
    /// slot.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    ///
    /// # Safety
    /// `slot` is a device allocation of `out.bytes()` bytes that nothing else uses until
    /// `stream` has run this work; slot `k`'s earlier copies have completed (its staged
    /// draws are rewritten here); its raw rows are enqueued on `stream` before
    /// ([`copy_raw`](Self::copy_raw), or a gather from a device cache).
    pub(crate) unsafe fn enqueue_kernel(
        &mut self,
        stream: &CudaStream,
        k: usize,
        batch: &HostBatch,
        slot: u64,
        out: &BatchLayout,
    ) -> Result<()> {
        let rows = batch.len();
        let c = self.kernel.augmenter.column();
        let staged = &mut self.staged[k];
        // SAFETY: the staging holds `batch_size` u32 (allocated so, page-aligned), and
        // slot k's earlier copy from it is done (the caller's contract).
        let draws = unsafe { std::slice::from_raw_parts_mut(staged.as_ptr().cast::<u32>(), rows) };
        let augment = self.kernel.augmenter.augment();
        pack_draws(augment, batch.epoch(), batch.indices(), draws);
        let to = addr(&self.draws[k], stream);
        // SAFETY: the device buffer holds a full batch of draws; the page-locked staging
        // is rewritten only after this copy is done (the caller's contract).
        unsafe { result::memcpy_htod_async(to, &*draws, stream.cu_stream()) }?;
        let raw = addr(&self.images[k], stream);
        let dst = slot + out.offset(c) as u64;
        // SAFETY: the images buffer holds `rows` raw images, the slot's column `rows`
        // augmented ones (`out` is the augmenter's layout), the draws buffer `rows`; the
        // slot is this work's alone until the stream has run it (the caller's contract).
        unsafe { self.kernel.launch(stream, (raw, dst, to), rows) }
    }
}

/// An [`Augmenter`] for batches already on the device (in a feeder's slot, gathered from
/// a device cache): each is augmented into one batch buffer of the augmented layout, by
/// draws uploaded at the start of its epoch, so that the work of a batch is all on the
/// stream (a CUDA graph can replay it) and a device cache keeps the raw images.
pub(crate) struct EpochAugment {
    kernel: AugmentKernel,
    /// The layout of the batches it augments (the raw column).
    raw: BatchLayout,
    /// The layout of the batches it makes ([`Augmenter::columns`]).
    layout: BatchLayout,
    stream: Arc<CudaStream>,
    /// The augmented batch.
    out: CudaSlice<u8>,
    /// The draws of an epoch, batch `b`'s from `b * batch_size`.
    draws: CudaSlice<u32>,
    /// Their page-locked staging, rewritten only once the stream is idle.
    staged: Box<dyn HostMemory>,
    pinned: PinnedAlloc,
}

impl Drop for EpochAugment {
    fn drop(&mut self) {
        // An upload of the draws may still read the staging freed below.
        let _ = super::wait_stream(&self.stream);
    }
}

impl EpochAugment {
    /// Loads the kernel (compiled, or from the cache) and allocates an augmented batch
    /// for batches of `raw` (the loader's layout) on `stream`, where its work goes.
    ///
    /// # Errors
    /// [`Error::Cuda`] for NVRTC's log or a driver error; [`Error::Alloc`] for the
    /// staging memory; [`Error::Config`] for an augmenter of other columns.
    pub(crate) fn new(
        cuda: &Cuda,
        stream: &Arc<CudaStream>,
        raw: &BatchLayout,
        augmenter: &Augmenter,
    ) -> Result<EpochAugment> {
        check_inputs(raw, augmenter)?;
        let kernel = AugmentKernel::load(cuda, stream, augmenter)?;
        let layout = BatchLayout::new(augmenter.columns(), raw.batch_size())?;
        let out = alloc::<u8>(stream, layout.bytes())?;
        let draws = alloc::<u32>(stream, raw.batch_size())?;
        let pinned = PinnedAlloc::new(Arc::clone(&cuda.ctx), PinnedKind::Plain);
        let staged = pinned.alloc(raw.batch_size().max(1) * 4)?;
        stream.synchronize()?;
        Ok(EpochAugment {
            kernel,
            raw: raw.clone(),
            layout,
            stream: Arc::clone(stream),
            out,
            draws,
            staged,
            pinned,
        })
    }

    /// The augmenter.
    pub(crate) fn augmenter(&self) -> &Augmenter {
        &self.kernel.augmenter
    }

    /// The layout of the augmented batches.
    pub(crate) fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// Where the kernel came from, and how long it took.
    pub(crate) fn origin(&self) -> &KernelOrigin {
        &self.kernel.origin
    }

    /// The device address of the draws, which an upload of more than they hold moves: a
    /// CUDA graph that captured [`apply`](Self::apply) is valid while it is unchanged.
    pub(crate) fn draws_addr(&self) -> u64 {
        addr(&self.draws, &self.stream)
    }

    /// Launches the kernel once on no images and waits: CUDA's lazy module loading is
    /// paid here, not by the first batch.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    pub(crate) fn warm_up(&self) -> Result<()> {
        let out = addr(&self.out, &self.stream);
        let draws = addr(&self.draws, &self.stream);
        // SAFETY: no rows: the kernel's loop ends before it reads or writes anything.
        unsafe { self.kernel.launch(&self.stream, (out, out, draws), 0) }?;
        self.stream.synchronize().map_err(Error::from)
    }

    /// Uploads the draws of every batch of `order`, batch `b`'s from `b * batch_size`
    /// (for [`apply`](Self::apply) with `at = b * batch_size`). Waits for the stream
    /// first: the last upload's staging is rewritten.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error; [`Error::Alloc`] for more staging memory.
    pub(crate) fn upload_order(&mut self, order: &EpochOrder) -> Result<()> {
        let b = self.raw.batch_size().max(1);
        let batches = order.batches() as usize;
        let augment = self.kernel.augmenter.augment().clone();
        let epoch = order.epoch();
        self.upload(batches * b, |host| {
            host.par_chunks_mut(b)
                .take(batches)
                .enumerate()
                .for_each_init(Vec::new, |indices, (k, draws)| {
                    order.batch(k as u64, indices);
                    pack_draws(&augment, epoch, indices, draws);
                });
        })
    }

    /// Uploads the draws of one batch's samples `indices` of `epoch`, from 0.
    ///
    /// # Errors
    /// As [`upload_order`](Self::upload_order).
    pub(crate) fn upload_batch(&mut self, epoch: u64, indices: &[u64]) -> Result<()> {
        let augment = self.kernel.augmenter.augment().clone();
        self.upload(indices.len(), |host| {
            pack_draws(&augment, epoch, indices, host)
        })
    }

    /// Room for the draws of every batch of `order`, on the device and in the staging:
    /// when they hold less, both are made anew (the draws' address changes), once the
    /// stream is idle.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error; [`Error::Alloc`] for the staging.
    pub(crate) fn reserve_for(&mut self, order: &EpochOrder) -> Result<()> {
        self.reserve(order.batches() as usize * self.raw.batch_size().max(1))
    }

    /// Room for `n` draws (see [`reserve_for`](Self::reserve_for)).
    fn reserve(&mut self, n: usize) -> Result<()> {
        if self.staged.len() < n * 4 {
            // The staging may still be read by the last upload's copy.
            self.stream.synchronize()?;
            self.staged = self.pinned.alloc(n * 4)?;
            self.draws = alloc::<u32>(&self.stream, n)?;
        }
        Ok(())
    }

    /// Waits for the stream, has `fill` write `n` draws into the staging (grown if need
    /// be) and enqueues their copy to the device's draws.
    fn upload(&mut self, n: usize, fill: impl FnOnce(&mut [u32])) -> Result<()> {
        self.stream.synchronize()?;
        if n == 0 {
            return Ok(());
        }
        self.reserve(n)?;
        // SAFETY: the staging holds at least `n` u32 (allocated so, page-aligned); the
        // stream is idle, so no copy reads it, and `&mut self` makes this the only access.
        let host = unsafe { std::slice::from_raw_parts_mut(self.staged.as_ptr().cast(), n) };
        fill(host);
        let to = addr(&self.draws, &self.stream);
        // SAFETY: the device buffer holds at least `n` draws; the staging is rewritten
        // only by the next upload, which waits for the stream first, and freed only
        // after it (the drop settles the stream).
        unsafe { result::memcpy_htod_async(to, &host[..], self.stream.cu_stream()) }?;
        Ok(())
    }

    /// Enqueues on the batch's stream the augmentation of `raw` (a batch of the raw
    /// layout) into the augmented batch, by the draws uploaded from `at`, and returns
    /// that batch: every other column copied over, the images augmented. The augmented
    /// batch is one buffer: work that reads it must be on the same stream, enqueued
    /// before the next `apply`.
    ///
    /// # Errors
    /// [`Error::Config`] for a batch of another layout or on another stream, or draws
    /// past those uploaded (that the draws from `at` are this batch's is the caller's
    /// to see to);
    /// [`Error::Cuda`] on a driver error.
    pub(crate) fn apply<'b>(
        &'b self,
        raw: &'b DeviceBatch<'_>,
        at: usize,
    ) -> Result<DeviceBatch<'b>> {
        let rows = raw.len();
        let stream = raw.stream();
        if raw.layout().columns() != self.raw.columns() || rows > self.raw.batch_size() {
            return Err(Error::Config(format!(
                "augment: a device batch of {rows} rows and other columns than the {} the \
                 augmentation was made for",
                self.raw.batch_size()
            )));
        }
        if !Arc::ptr_eq(stream, &self.stream) || at + rows > self.draws.len() {
            return Err(Error::Config(
                "augment: a device batch on another stream, or without its draws".into(),
            ));
        }
        let base = addr(&self.out, stream);
        let c = self.kernel.augmenter.column();
        for (j, col) in self.raw.columns().iter().enumerate() {
            if j == c {
                continue;
            }
            let to = base + self.layout.offset(j) as u64;
            // SAFETY: both hold `rows` rows of column j (the raw batch by its layout,
            // checked above; the augmented batch allocated for a full batch); the copy is
            // on the stream the raw batch is ready on and that reads the augmented one.
            unsafe {
                result::memcpy_dtod_async(
                    to,
                    raw.column_ptr(j),
                    col.row_bytes * rows,
                    stream.cu_stream(),
                )
            }?;
        }
        let draws = addr(&self.draws, stream) + at as u64 * 4;
        let dst = base + self.layout.offset(c) as u64;
        // SAFETY: the raw batch holds `rows` raw images, the augmented batch as many
        // augmented ones (its layout is the augmenter's), the draws from `at` `rows`
        // (checked above); all of it is this stream's to use (the caller's contract).
        unsafe {
            self.kernel
                .launch(stream, (raw.column_ptr(c), dst, draws), rows)
        }?;
        let (epoch, number) = (raw.epoch(), raw.number());
        let out = DeviceBatch::new(
            base,
            &self.layout,
            stream,
            rows,
            epoch,
            number,
            raw.indices(),
        );
        Ok(out.with_cached(raw.from_cache()))
    }
}

/// `len` zeroed elements on the device (at least one: a batch of no rows still has a
/// buffer).
fn alloc<T: cudarc::driver::DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>> {
    stream.alloc_zeros::<T>(len.max(1)).map_err(Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_pack_into_32_bits() {
        let p = |dy, dx, flip| packed(Draw { dy, dx, flip });
        assert_eq!(p(0, 0, false), 4096 | 4096 << 14);
        assert_eq!(p(-4096, -4096, false), 0);
        assert_eq!(p(4096, 4096, true), 8192 | 8192 << 14 | 1 << 28);
        assert_eq!(p(-3, 2, true) & 0x3fff, 4093);
        assert_eq!(p(-3, 2, true) >> 14 & 0x3fff, 4098);
    }
}
