//! Batches as [candle](https://github.com/huggingface/candle) tensors (feature `candle`).
//!
//! Each column becomes one `Tensor` of shape `[samples, sample shape...]`. Element types
//! map one to one where candle has them (`u8`, `u32`, `i16`, `i32`, `i64`, `f16`, `f32`,
//! `f64`); candle has no `u16`, `i8` or `bool`, so token ids (`u16`) widen to `u32`,
//! `i8` to `i16` and `bool` reads as `u8`; a `u64` column is refused.
//!
//! candle's tensors own their storage, so a tensor is one copy of the batch's bytes: into
//! candle's CPU storage, or, for a CUDA device, a host-to-device copy on candle's own
//! stream. The batch (and its pooled, possibly pinned buffer) can go back to the loader
//! as soon as the tensors are made: on CUDA, each column's copy is waited for (with
//! candle's earlier work on its stream) before its tensor is returned, because a copy
//! from page-locked memory reads the buffer after the call. For copies that overlap
//! candle's kernels instead, onto device slots that stay with the loader, use
//! `interop::candle_cuda::CudaTensors` (feature `candle-cuda`).
//!
//! ```
//! # fn main() -> stokehold::Result<()> {
//! use stokehold::interop::candle::tensors;
//! use stokehold::{Loader, NpyDataset};
//!
//! let ds = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
//! let mut loader = Loader::builder(ds).batch_size(256).build()?;
//! for batch in loader.epoch(0)? {
//!     let t = tensors(&batch?, &candle_core::Device::Cpu)?;
//!     assert_eq!(t[0].dims(), &[256, 8, 8]); // x: u8 images
//!     assert_eq!(t[1].dims(), &[256]); // y: i64 labels
//!     break;
//! }
//! # Ok(())
//! # }
//! ```

use candle_core::{Device, Tensor, WithDType};

use crate::dataset::{DType, Element};
use crate::error::{Error, Result};
use crate::loader::HostBatch;

/// A candle error as stokehold's.
pub(super) fn candle_err(e: candle_core::Error) -> Error {
    Error::Config(format!("candle: {e}"))
}

/// The dims of column `c`'s tensor: the batch's samples, then a sample's shape.
pub(super) fn dims(batch: &HostBatch, c: usize) -> Vec<usize> {
    let col = &batch.columns()[c];
    let mut dims = Vec::with_capacity(col.shape.len() + 2);
    dims.push(batch.len());
    dims.extend(col.shape.iter().map(|&d| d as usize));
    dims
}

/// Column `c` of `batch` as a tensor on `device` (see the module docs for the types).
///
/// # Errors
/// [`Error::Config`] for a `u64` column, a batch of indices only
/// ([`Loader::epoch_indices`](crate::Loader::epoch_indices)), or an error from candle
/// (a device it cannot reach, say).
///
/// # Panics
/// If `c` is not a column of the batch.
pub fn column(batch: &HostBatch, c: usize, device: &Device) -> Result<Tensor> {
    batch.has_data()?;
    let col = &batch.columns()[c];
    let shape = dims(batch, c);
    match col.dtype {
        DType::U8 | DType::Bool => same::<u8>(batch, c, shape, device),
        DType::U32 => same::<u32>(batch, c, shape, device),
        DType::I16 => same::<i16>(batch, c, shape, device),
        DType::I32 => same::<i32>(batch, c, shape, device),
        DType::I64 => same::<i64>(batch, c, shape, device),
        DType::F32 => same::<f32>(batch, c, shape, device),
        DType::F64 => same::<f64>(batch, c, shape, device),
        DType::U16 => widened(batch.column::<u16>(c)?, u32::from, shape, device),
        DType::I8 => widened(batch.column::<i8>(c)?, i16::from, shape, device),
        DType::F16 => widened(batch.column::<u16>(c)?, half::f16::from_bits, shape, device),
        DType::U64 => Err(Error::Config(format!(
            "column {}: candle has no uint64 tensors",
            col.name
        ))),
    }
}

/// Every column of `batch` as a tensor on `device`, in column order.
///
/// # Errors
/// As [`column()`].
pub fn tensors(batch: &HostBatch, device: &Device) -> Result<Vec<Tensor>> {
    (0..batch.columns().len())
        .map(|c| column(batch, c, device))
        .collect()
}

/// A column whose element type candle has.
fn same<T: Element + WithDType>(
    batch: &HostBatch,
    c: usize,
    shape: Vec<usize>,
    device: &Device,
) -> Result<Tensor> {
    let tensor = Tensor::from_slice(batch.column::<T>(c)?, shape, device).map_err(candle_err)?;
    // On CUDA the copy is enqueued on candle's stream and, from a pinned buffer, reads
    // it later: it must be done before the batch can go back to the pool and be refilled.
    // (A widened column is copied from a pageable vector, which the driver stages first.)
    if device.is_cuda() {
        device.synchronize().map_err(candle_err)?;
    }
    Ok(tensor)
}

/// A column widened element by element to a type candle has.
fn widened<S: Copy, T: WithDType>(
    values: &[S],
    widen: impl Fn(S) -> T,
    shape: Vec<usize>,
    device: &Device,
) -> Result<Tensor> {
    let wide: Vec<T> = values.iter().map(|&v| widen(v)).collect();
    Tensor::from_vec(wide, shape, device).map_err(candle_err)
}
