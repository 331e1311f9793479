//! Augmentation on the GPU (`kernels/augment.cu`): a batch's raw images are copied to the
//! device and cropped, flipped and normalised there, into the batch's slot, so the bus
//! carries bytes, not the floats they become (4x fewer with a normalisation).

use std::sync::Arc;

use cudarc::driver::{result, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig};
use cudarc::driver::{PushKernelArg, ValidAsZeroBits};

use super::feeder::addr;
use super::kernels::{cache_dir, load_program, KernelOrigin, Program};
use super::pinned::{PinnedAlloc, PinnedKind};
use super::Cuda;
use crate::augment::{Augmenter, Draw, MAX_PAD};
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, HostAlloc, HostBatch, HostMemory};

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

/// An [`Augmenter`] on a device: its kernel, its normalisation table, and for each slot
/// of a [`DeviceSlots`](super::DeviceSlots) the raw images and the draws of the batch
/// in it.
pub(crate) struct DeviceAugment {
    augmenter: Augmenter,
    /// The batches' layout as the loader gathers them (the raw column).
    raw: BatchLayout,
    function: CudaFunction,
    _module: Arc<CudaModule>,
    table: Option<CudaSlice<f32>>,
    images: Vec<CudaSlice<u8>>,
    draws: Vec<CudaSlice<u32>>,
    /// Page-locked staging of each slot's draws, rewritten only once that slot's last
    /// copy is done (the caller's `copied` event).
    staged: Vec<Box<dyn HostMemory>>,
    /// Where the kernel came from, and how long it took.
    pub(crate) origin: KernelOrigin,
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
        let c = augmenter.column();
        if raw.columns() != augmenter.inputs() {
            return Err(Error::Config(
                "augment: the augmenter was bound to other columns than these batches'".into(),
            ));
        }
        let (module, origin) = load_program(cuda, &cache_dir(), &AUGMENT, |cuda, ptx, origin| {
            Ok((cuda.ctx.load_module(ptx)?, origin))
        })?;
        let function = module.load_function("augment_images")?;
        let table = match augmenter.table() {
            Some(t) => Some(stream.clone_htod(t)?),
            None => None,
        };
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
            augmenter: augmenter.clone(),
            raw: raw.clone(),
            function,
            _module: module,
            table,
            images,
            draws,
            staged,
            origin,
        })
    }

    /// The augmenter.
    pub(crate) fn augmenter(&self) -> &Augmenter {
        &self.augmenter
    }

    /// Enqueues on `stream` the copies of `batch` into slot `k` (its device memory at
    /// `slot`, laid out as `out`): every other column straight to its place, the raw
    /// images and the draws to the slot's own buffers; then the kernel that augments
    /// the images into their place.
    ///
    /// # Errors
    /// [`Error::Config`] for a batch of another layout than the slots were made for;
    /// [`Error::Cuda`] on a driver error.
    ///
    /// # Safety
    /// `slot` is a device allocation of `out.bytes()` bytes that nothing else uses until
    /// `stream` has run this work; slot `k`'s earlier copies have completed (its staged
    /// draws are rewritten here); `batch` stays alive until they have.
    pub(crate) unsafe fn enqueue(
        &mut self,
        stream: &CudaStream,
        k: usize,
        batch: &HostBatch,
        slot: u64,
        out: &BatchLayout,
    ) -> Result<()> {
        let rows = batch.len();
        let c = self.augmenter.column();
        let bytes = batch.as_bytes();
        let same = batch.layout().columns() == self.raw.columns();
        if !same || bytes.len() != self.raw.bytes() || rows > self.raw.batch_size() {
            return Err(Error::Config(format!(
                "augment: a batch of {} bytes and {rows} rows, for slots of batches of {} \
                 bytes and at most {} rows",
                bytes.len(),
                self.raw.bytes(),
                self.raw.batch_size()
            )));
        }
        let cu = stream.cu_stream();
        for (j, col) in self.raw.columns().iter().enumerate() {
            let from = &bytes[self.raw.offset(j)..][..col.row_bytes * rows];
            let to = match j == c {
                true => addr(&self.images[k], stream),
                false => slot + out.offset(j) as u64,
            };
            // SAFETY: `to` holds `rows` rows of this column (the slot by the caller's
            // contract, the images buffer as allocated for a full batch); the batch
            // outlives the copy (the caller's contract).
            unsafe { result::memcpy_htod_async(to, from, cu) }?;
        }
        let staged = &mut self.staged[k];
        // SAFETY: the staging holds `batch_size` u32 (allocated so, page-aligned), and
        // slot k's earlier copy from it is done (the caller's contract).
        let draws = unsafe { std::slice::from_raw_parts_mut(staged.as_ptr().cast::<u32>(), rows) };
        for (d, &i) in draws.iter_mut().zip(batch.indices()) {
            *d = packed(self.augmenter.augment().draw(batch.epoch(), i));
        }
        let to = addr(&self.draws[k], stream);
        // SAFETY: the device buffer holds a full batch of draws; the page-locked staging
        // is rewritten only after this copy is done (the caller's contract).
        unsafe { result::memcpy_htod_async(to, &*draws, cu) }?;
        let (ch, h, w) = self.augmenter.geometry();
        let total = (rows * ch * h * w) as u64;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let raw = addr(&self.images[k], stream);
        let dst = slot + out.offset(c) as u64;
        let table = self.table.as_ref().map_or(0, |t| addr(t, stream));
        let (rows, ch, h, w) = (rows as u32, ch as u32, h as u32, w as u32);
        let last = u32::from(self.augmenter.channels_last());
        let fill = u32::from(self.augmenter.fill());
        let mut l = stream.launch_builder(&self.function);
        l.arg(&raw)
            .arg(&dst)
            .arg(&to)
            .arg(&table)
            .arg(&rows)
            .arg(&ch)
            .arg(&h)
            .arg(&w)
            .arg(&last)
            .arg(&fill);
        // SAFETY: augment_images(const u8*, void*, const u32*, const float*, u32 x6): the
        // images buffer holds `rows` raw images, the slot's column `rows` augmented ones
        // (float32 when there is a table, of channels * 256 floats), the draws `rows`;
        // the kernel reads and writes only inside those (its loop ends at the total).
        unsafe { l.launch(cfg) }.map(|_| ()).map_err(Error::from)
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
