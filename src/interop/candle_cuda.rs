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
//! - each allocation is then handed to candle's stream (`CudaSlice::leak`,
//!   `CudaStream::upgrade_device_ptr`): candle records its reads there and frees it
//!   there when the tensor is dropped, in order after every kernel candle enqueued
//!   before the drop. Left the copy stream's, the allocation would be freed on the
//!   copy stream, whose next allocation (the next batch's copy) the stream-ordered
//!   allocator may give the same memory, while candle's ops that take their input's
//!   pointer on the slice's own stream (`to_dtype`, `index_select`, `gather`,
//!   `where_cond`) record their reads there, not on candle's stream;
//! - the copies wait for nothing of candle's (but where the allocator's pool, reusing
//!   memory freed on candle's stream, orders a copy after the kernels that freed it).
//!
//! candle's default device ([`CudaDevice::new`](candle_core::CudaDevice), through
//! `Device::new_cuda`) runs on the *per-thread* default stream, which names the calling
//! thread's own stream: call [`CudaTensors::tensors`] on the thread that runs candle's
//! ops on its tensors (or build the device with `CudaDevice::new_with_stream`, whose
//! stream is one for every thread); called on another thread, the wait for the copies
//! lands on that thread's stream, and candle's kernels could read a batch before it
//! lands.
//!
//! The host batch is kept until its copies are done (at most two batches at a time), then
//! goes back to the loader's pool; the loader must allow that many batches out at once,
//! plus the one being asked for: [`held`](crate::LoaderBuilder::held) of at least 2,
//! or the next batch waits for a buffer until the pool's grace period ends in
//! [`Error::PoolExhausted`].
//!
//! Element types are as in [`super::candle`]; token ids (`u16`) are copied as they are
//! and widened to `u32` by candle's own kernels, on its stream. An `i8` column, rare in
//! training data, goes through candle's own copy ([`super::candle::column`]).

use std::collections::VecDeque;
use std::sync::Arc;

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor, D};
use cudarc::driver::{result, sys, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr};

use super::candle::{candle_err, column, dims};
use crate::dataset::DType;
use crate::error::{Error, Result};
use crate::loader::HostBatch;

/// Host batches whose copies may still be running, at most.
const IN_FLIGHT: usize = 2;

/// A column's copy, enqueued on the copy stream, its allocation still the copy
/// stream's until candle's stream waits for it ([`adopt`]).
type Pending = Box<dyn FnOnce(&CudaDevice) -> Tensor>;

/// A column copied, as candle will get it.
enum Column {
    /// Its own element type.
    Same(Pending),
    /// Token ids: `[.., 2]` bytes, little-endian.
    Ids(Pending),
    /// Made by candle itself (an `i8` column), on its own stream.
    Candle(Tensor),
}

impl Column {
    /// The tensor, its allocation handed to candle's stream (which must wait for the
    /// batch's copies first); token ids widened to `u32` on candle's stream:
    /// low + 256 * high.
    fn tensor(self, device: &CudaDevice) -> Result<Tensor> {
        match self {
            Column::Candle(t) => Ok(t),
            Column::Same(pending) => Ok(pending(device)),
            Column::Ids(pending) => {
                let bytes = pending(device);
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

/// `slice`, allocated and written on the copy stream, as a tensor of `shape` whose
/// allocation is candle's stream's: candle's reads of it are recorded there and it is
/// freed there, after them. Candle's stream must already wait for the copy.
fn adopt<T>(slice: CudaSlice<T>, shape: Vec<usize>, device: &CudaDevice) -> Tensor
where
    T: DeviceRepr + candle_core::cuda::CudaDType,
{
    let len = slice.len();
    // The copy stream gives the allocation up (it waits for its own write: nothing).
    let ptr = slice.leak();
    // SAFETY: `ptr` is the live allocation of `len` elements of `T` just given up, now
    // owned by the new slice alone (freed once, on candle's stream, when it drops); its
    // bytes are the copy's, which candle's stream waits for before any of its kernels.
    let slice = unsafe { device.cuda_stream().upgrade_device_ptr::<T>(ptr, len) };
    let storage = CudaStorage::wrap_cuda_slice(slice, device.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
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
    /// [`Error::Config`] for a `u64` column, a batch of indices only, or an error from
    /// candle; [`Error::Cuda`] on a driver error; [`Error::CopyFailed`] when the copy of
    /// an earlier batch failed, naming the oldest still in flight (resume from it:
    /// `batch` was not copied), or when candle's context holds an error (left by a
    /// drop), naming `batch`.
    pub fn tensors(&mut self, batch: HostBatch) -> Result<Vec<Tensor>> {
        batch.has_data()?;
        let _current = crate::cuda::KeepCurrent::new();
        // Earlier batches first: a failed copy among them is found before this batch's
        // copies are enqueued for nothing.
        self.retire(IN_FLIGHT - 1)?;
        // An error left in candle's context (by a drop, anywhere in it) fails this
        // batch before it is copied: named, so that a resume yields it again.
        let ctx = self.copy.context();
        if let Err(e) = ctx.bind_to_thread() {
            return Err(Error::copy_failed(batch.epoch(), batch.number(), e.into()));
        }
        if let Some(col) = batch.columns().iter().find(|c| c.dtype == DType::U64) {
            return Err(Error::Config(format!(
                "column {}: candle has no uint64 tensors",
                col.name
            )));
        }
        let enqueued = (|| -> Result<(Vec<Column>, CudaEvent)> {
            let copies = (0..batch.columns().len())
                .map(|c| self.column(&batch, c))
                .collect::<Result<Vec<_>>>()?;
            // A host wait for it (in `retire`) sleeps instead of spinning a core the
            // loader's workers need.
            let copied = self
                .copy
                .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?;
            // Before any of candle's kernels (the widening below included) is enqueued,
            // and before the allocations become candle's stream's.
            self.device.cuda_stream().wait(&copied)?;
            Ok((copies, copied))
        })();
        let (copies, copied) = match enqueued {
            Ok(enqueued) => enqueued,
            Err(e) => {
                // The batch goes back to the pool on return: the copies enqueued from its
                // buffer must be done first.
                let _ = crate::cuda::wait_stream(&self.copy);
                return Err(e);
            }
        };
        self.in_flight.push_back((batch, copied));
        copies.into_iter().map(|c| c.tensor(&self.device)).collect()
    }

    /// Column `c` of `batch`, its copy enqueued.
    fn column(&self, batch: &HostBatch, c: usize) -> Result<Column> {
        let col = &batch.columns()[c];
        let mut shape = dims(batch, c);
        let (name, bytes) = (col.name.as_str(), batch.bytes(c));
        let same = match col.dtype {
            DType::U8 | DType::Bool => self.copied::<u8>(name, bytes, shape),
            DType::U32 => self.copied::<u32>(name, bytes, shape),
            DType::I16 => self.copied::<i16>(name, bytes, shape),
            DType::I32 => self.copied::<i32>(name, bytes, shape),
            DType::I64 => self.copied::<i64>(name, bytes, shape),
            DType::F32 => self.copied::<f32>(name, bytes, shape),
            DType::F64 => self.copied::<f64>(name, bytes, shape),
            DType::F16 => self.copied::<half::f16>(name, bytes, shape),
            DType::U16 => {
                // The ids' two bytes as a trailing dimension of u8, widened once candle's
                // stream waits for the copy.
                shape.push(2);
                return Ok(Column::Ids(self.copied::<u8>(name, bytes, shape)?));
            }
            DType::I8 => {
                let device = Device::Cuda(self.device.clone());
                return column(batch, c, &device).map(Column::Candle);
            }
            DType::U64 => Err(Error::Config(format!(
                "column {}: candle has no uint64 tensors",
                col.name
            ))),
        };
        same.map(Column::Same)
    }

    /// A device allocation for the elements of type `T` in `bytes`, on the copy stream,
    /// `bytes` copied into it there, to become a tensor of `shape` on candle's device
    /// once candle's stream waits for the copy.
    ///
    /// # Errors
    /// [`Error::Config`] naming column `name` if `shape` does not hold exactly the
    /// elements in `bytes` (a dataset whose column's shape and row size disagree): candle
    /// does not check a tensor made from storage, whose kernels would read past it.
    fn copied<T>(&self, name: &str, bytes: &[u8], shape: Vec<usize>) -> Result<Pending>
    where
        T: DeviceRepr + candle_core::cuda::CudaDType + 'static,
    {
        let len = bytes.len() / std::mem::size_of::<T>();
        let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if elements != Some(len) || len * std::mem::size_of::<T>() != bytes.len() {
            return Err(Error::Config(format!(
                "column {name}: a batch of {} bytes is not a tensor of shape {shape:?} of \
                 {}-byte elements (the column's shape and row size disagree)",
                bytes.len(),
                std::mem::size_of::<T>()
            )));
        }
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
        Ok(Box::new(move |device: &CudaDevice| {
            adopt(slice, shape, device)
        }))
    }

    /// Hands back the host batches whose copies are done, waiting for the oldest while
    /// more than `most` remain. A failed wait is [`Error::CopyFailed`] naming the oldest
    /// batch in flight; every copy is then waited for (none still reads a host batch)
    /// and the batches go back.
    fn retire(&mut self, most: usize) -> Result<()> {
        let _current = crate::cuda::KeepCurrent::new();
        while let Some((batch, event)) = self.in_flight.front() {
            let done = match self.in_flight.len() <= most {
                true => event.try_is_complete().map_err(Error::from),
                false => crate::cuda::wait_event(self.copy.context(), event)
                    .map(|()| true)
                    .map_err(Error::from),
            };
            match done {
                Ok(false) => break,
                Ok(true) => drop(self.in_flight.pop_front()),
                Err(e) => {
                    let (epoch, number) = (batch.epoch(), batch.number());
                    let _ = crate::cuda::wait_stream(&self.copy);
                    self.in_flight.clear();
                    return Err(Error::copy_failed(epoch, number, e));
                }
            }
        }
        Ok(())
    }
}

impl Drop for CudaTensors {
    fn drop(&mut self) {
        // The host batches go back to the pool only once no copy reads them (a wait
        // that an error left in candle's context by another thread cannot skip).
        let _current = crate::cuda::KeepCurrent::new();
        let ctx = std::sync::Arc::clone(self.copy.context());
        for (_, event) in self.in_flight.drain(..) {
            let _ = crate::cuda::wait_event(&ctx, &event);
        }
    }
}
