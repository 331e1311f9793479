//! Batches handed to candle on CUDA with one copy, host to device, and none on candle's
//! side (feature `candle-cuda`).
//!
//! [`CudaTensors::tensors`] copies each column of a host batch from its buffer (page-locked
//! when the loader was built with [`PinnedAlloc`](crate::cuda::PinnedAlloc)) straight
//! into a device allocation of its own, on a copy stream that stokehold opens in
//! candle's context, and that allocation becomes the tensor's storage
//! (`CudaStorage::wrap_cuda_slice`, `Tensor::from_storage`): no staging buffer, no
//! device-to-device copy, and the host does not wait for the copy.
//!
//! Ordering, on the device:
//! - candle's stream waits for an event recorded after the batch's copies, so no kernel
//!   candle enqueues from then on reads a column before it lands;
//! - candle's stream is not waited for by the copies: the next batch's copy overlaps the
//!   step running on candle's stream;
//! - each allocation is freed on the copy stream when its tensor is dropped, after the
//!   kernels that read it (cudarc records an event on candle's stream for every kernel
//!   argument, which is why [`CudaTensors::new`] refuses a context with event tracking
//!   turned off).
//!
//! The host batch is kept until its copies are done (at most two batches at a time), then
//! goes back to the loader's pool.
//!
//! Element types are as in [`super::candle`]; token ids (`u16`) are copied as they are
//! and widened to `u32` by candle's own kernels, on its stream. An `i8` column, rare in
//! training data, goes through candle's own copy ([`super::candle::column`]).

use std::collections::VecDeque;
use std::sync::Arc;

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor, D};
use cudarc::driver::{result, CudaEvent, CudaStream, DevicePtrMut, DeviceRepr};

use super::candle::{candle_err, column, dims};
use crate::dataset::DType;
use crate::error::{Error, Result};
use crate::loader::HostBatch;

/// Host batches whose copies may still be running, at most.
const IN_FLIGHT: usize = 2;

/// A column copied, as candle will get it.
enum Column {
    /// Its own element type.
    Same(Tensor),
    /// Token ids: `[.., 2]` bytes, little-endian.
    Ids(Tensor),
}

impl Column {
    /// The tensor; token ids widened to `u32` on candle's stream: low + 256 * high.
    fn tensor(self) -> Result<Tensor> {
        match self {
            Column::Same(t) => Ok(t),
            Column::Ids(bytes) => {
                let wide = bytes
                    .to_dtype(candle_core::DType::U32)
                    .map_err(candle_err)?;
                let low = wide.narrow(D::Minus1, 0, 1).map_err(candle_err)?;
                let high = wide.narrow(D::Minus1, 1, 1).map_err(candle_err)?;
                high.affine(256.0, 0.0)
                    .and_then(|h| h + low)
                    .and_then(|t| t.squeeze(D::Minus1))
                    .map_err(candle_err)
            }
        }
    }
}

/// Hands host batches to candle as CUDA tensors (see the module docs).
pub struct CudaTensors {
    device: CudaDevice,
    /// stokehold's copy stream, in candle's context.
    copy: Arc<CudaStream>,
    /// Host batches whose copies were enqueued, each with the event recorded after them.
    in_flight: VecDeque<(HostBatch, CudaEvent)>,
}

impl std::fmt::Debug for CudaTensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTensors")
            .field("in_flight", &self.in_flight.len())
            .finish_non_exhaustive()
    }
}

impl CudaTensors {
    /// Opens a copy stream in the context of candle's `device`.
    ///
    /// # Errors
    /// [`Error::Config`] if the context's event tracking is off (a batch could then be
    /// freed while candle's kernels still read it); [`Error::Cuda`] if the stream cannot
    /// be created.
    pub fn new(device: &CudaDevice) -> Result<CudaTensors> {
        let ctx = device.cuda_stream().context().clone();
        if !ctx.is_event_tracking() {
            return Err(Error::Config(
                "candle's CUDA context has event tracking turned off: stokehold's copies \
                 could then be freed before candle's kernels have read them"
                    .into(),
            ));
        }
        let copy = ctx.new_stream()?;
        Ok(CudaTensors {
            device: device.clone(),
            copy,
            in_flight: VecDeque::new(),
        })
    }

    /// Every column of `batch` as a tensor on candle's device, in column order. Takes
    /// the batch: it goes back to the loader once its copies are done.
    ///
    /// # Errors
    /// [`Error::Config`] for a `u64` column or an error from candle; [`Error::Cuda`] on a
    /// driver error.
    pub fn tensors(&mut self, batch: HostBatch) -> Result<Vec<Tensor>> {
        self.copy.context().bind_to_thread()?;
        let mut copies = Vec::with_capacity(batch.columns().len());
        for c in 0..batch.columns().len() {
            copies.push(self.column(&batch, c)?);
        }
        let copied = self.copy.record_event(None)?;
        // Before any of candle's kernels (the widening below included) is enqueued.
        self.device.cuda_stream().wait(&copied)?;
        self.in_flight.push_back((batch, copied));
        self.retire()?;
        copies.into_iter().map(Column::tensor).collect()
    }

    /// Column `c` of `batch`, its copy enqueued.
    fn column(&self, batch: &HostBatch, c: usize) -> Result<Column> {
        let col = &batch.columns()[c];
        let mut shape = dims(batch, c);
        let same = match col.dtype {
            DType::U8 | DType::Bool => self.copied::<u8>(batch.bytes(c), shape),
            DType::U32 => self.copied::<u32>(batch.bytes(c), shape),
            DType::I16 => self.copied::<i16>(batch.bytes(c), shape),
            DType::I32 => self.copied::<i32>(batch.bytes(c), shape),
            DType::I64 => self.copied::<i64>(batch.bytes(c), shape),
            DType::F32 => self.copied::<f32>(batch.bytes(c), shape),
            DType::F64 => self.copied::<f64>(batch.bytes(c), shape),
            DType::F16 => self.copied::<half::f16>(batch.bytes(c), shape),
            DType::U16 => {
                // The ids' two bytes as a trailing dimension of u8, widened once candle's
                // stream waits for the copy.
                shape.push(2);
                return Ok(Column::Ids(self.copied::<u8>(batch.bytes(c), shape)?));
            }
            DType::I8 => column(batch, c, &Device::Cuda(self.device.clone())),
            DType::U64 => Err(Error::Config(format!(
                "column {}: candle has no uint64 tensors",
                col.name
            ))),
        };
        same.map(Column::Same)
    }

    /// A device allocation for the elements of type `T` in `bytes`, on the copy stream,
    /// `bytes` copied into it there, as a tensor of `shape` on candle's device.
    fn copied<T>(&self, bytes: &[u8], shape: Vec<usize>) -> Result<Tensor>
    where
        T: DeviceRepr + candle_core::cuda::CudaDType,
    {
        let len = bytes.len() / std::mem::size_of::<T>();
        debug_assert_eq!(len * std::mem::size_of::<T>(), bytes.len());
        // SAFETY: the allocation is written whole by the copy enqueued just after, on the
        // same stream, before anything can read it (candle's stream waits for the
        // batch's copies before the tensor is handed out).
        let mut slice = unsafe { self.copy.alloc::<T>(len) }?;
        {
            let (ptr, _written) = slice.device_ptr_mut(&self.copy);
            // SAFETY: `ptr` holds `len` elements of `T`, `bytes.len()` bytes; the host
            // memory stays alive and unchanged until the copy is done (the batch is kept
            // in `in_flight` until its event completes).
            unsafe { result::memcpy_htod_async(ptr, bytes, self.copy.cu_stream()) }?;
            // Dropping `_written` records the slice's write event on the copy stream.
        }
        let storage = CudaStorage::wrap_cuda_slice(slice, self.device.clone());
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            shape,
            BackpropOp::none(),
            false,
        ))
    }

    /// Hands back the host batches whose copies are done, waiting for the oldest while
    /// more than [`IN_FLIGHT`] remain.
    fn retire(&mut self) -> Result<()> {
        while let Some((_, event)) = self.in_flight.front() {
            if self.in_flight.len() <= IN_FLIGHT && !event.try_is_complete()? {
                break;
            }
            event.synchronize()?;
            self.in_flight.pop_front();
        }
        Ok(())
    }
}

impl Drop for CudaTensors {
    fn drop(&mut self) {
        // The host batches go back to the pool only once no copy reads them.
        for (_, event) in self.in_flight.drain(..) {
            let _ = event.synchronize();
        }
    }
}
