//! The device cache: the first epoch's batches, scattered by sample index into a
//! device-resident copy of the dataset; later epochs gather their batches there and skip
//! host gathering and PCIe.
//!
//! Each epoch's whole index list (a pure function of the order) goes to the device in one
//! pinned copy at the epoch's start, so the per-batch work needs no host synchronisation.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use rayon::prelude::*;

use super::feeder::{addr, DeviceBatch};
use super::kernels::Kernels;
use super::pinned::{PinnedAlloc, PinnedKind};
use super::Cuda;
use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, HostAlloc, HostMemory};
use crate::sampler::EpochOrder;

/// A device-resident copy of a dataset's columns.
pub struct DeviceCache {
    stream: Arc<CudaStream>,
    columns: Vec<CudaSlice<u8>>,
    idx: CudaSlice<u64>,
    host_idx: Box<dyn HostMemory>,
    batch: CudaSlice<u8>,
    layout: BatchLayout,
    rows: u64,
    /// The fingerprint of the dataset it holds ([`Dataset::fingerprint`]; 0: unknown).
    dataset: u64,
    filled: bool,
    bytes: u64,
}

impl Drop for DeviceCache {
    fn drop(&mut self) {
        // An index upload may still read the pinned host buffer freed below.
        let _ = super::wait_stream(&self.stream);
    }
}

/// Gathers rows `start..start + m` of `dataset` into `out` (one region per column),
/// split into runs of 1024 rows over rayon's threads.
fn gather_rows_in_parallel(
    dataset: &dyn Dataset,
    start: u64,
    m: usize,
    widths: &[usize],
    out: &mut [&mut [u8]],
) -> Result<()> {
    const RUN: usize = 1024;
    let mut runs: Vec<Vec<&mut [u8]>> = (0..m.div_ceil(RUN)).map(|_| Vec::new()).collect();
    for (region, &w) in out.iter_mut().zip(widths) {
        for (run, part) in runs.iter_mut().zip(region.chunks_mut(RUN * w.max(1))) {
            run.push(part);
        }
    }
    runs.into_par_iter()
        .enumerate()
        .try_for_each(|(k, mut parts)| {
            let first = start + (k * RUN) as u64;
            let n = (m - k * RUN).min(RUN) as u64;
            let indices: Vec<u64> = (first..first + n).collect();
            dataset.gather(0, &indices, &mut parts)
        })
}

/// Bytes each thread of the row kernels moves: 16 or 8 where that divides the row, else 1.
fn copy_unit(row_bytes: usize) -> usize {
    [16, 8]
        .into_iter()
        .find(|u| row_bytes % u == 0)
        .unwrap_or(1)
}

impl DeviceCache {
    /// A cache for `rows` samples of `layout`'s columns and epochs of up to `samples`
    /// indices, if its size fits under `share` of the device's free memory. `samples`
    /// 0: a cache that is only scattered into and gathered from at addresses given
    /// (the device slots'), with no index list or batch buffer of its own.
    ///
    /// `None` too where the device's memory runs out while allocating it (another
    /// process took some since the free memory was read).
    ///
    /// # Errors
    /// [`Error::Cuda`] if an allocation fails after the size check for another reason
    /// than memory.
    pub fn new(
        cuda: &Cuda,
        stream: &Arc<CudaStream>,
        layout: &BatchLayout,
        rows: u64,
        samples: u64,
        share: f64,
    ) -> Result<Option<DeviceCache>> {
        use cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        let bytes: u64 = layout
            .columns()
            .iter()
            .map(|c| c.row_bytes as u64 * rows)
            .sum();
        let n = samples.max(1) as usize;
        // The share holds the index list and the batch buffer too.
        let batch_bytes = if samples > 0 { layout.bytes() } else { 1 };
        let all = bytes + n as u64 * 8 + batch_bytes as u64;
        let (free, _) = cuda.ctx.mem_get_info()?;
        if all as f64 > share * free as f64 {
            return Ok(None);
        }
        let allocated = (|| -> std::result::Result<_, cudarc::driver::DriverError> {
            let columns = layout
                .columns()
                .iter()
                .map(|c| stream.alloc_zeros::<u8>((c.row_bytes as u64 * rows).max(1) as usize))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            Ok((
                columns,
                stream.alloc_zeros::<u64>(n)?,
                stream.alloc_zeros::<u8>(batch_bytes)?,
            ))
        })();
        let (columns, idx, batch) = match allocated {
            Ok(a) => a,
            Err(e) if e.0 == CUDA_ERROR_OUT_OF_MEMORY => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let host_idx = PinnedAlloc::new(Arc::clone(&cuda.ctx), PinnedKind::Plain).alloc(n * 8)?;
        Ok(Some(DeviceCache {
            stream: Arc::clone(stream),
            columns,
            idx,
            host_idx,
            batch,
            layout: layout.clone(),
            rows,
            dataset: 0,
            filled: false,
            bytes,
        }))
    }

    /// This cache, holding the rows of the dataset whose fingerprint is `dataset`
    /// ([`Dataset::fingerprint`]): an epoch or a fill of another dataset is refused.
    pub(crate) fn holding(mut self, dataset: u64) -> DeviceCache {
        self.dataset = dataset;
        self
    }

    /// Fails for a dataset of fingerprint `other` that is known not to be the one held.
    fn check_dataset(&self, other: u64) -> Result<()> {
        match self.dataset != 0 && other != 0 && other != self.dataset {
            true => Err(Error::Config(
                "device cache: an epoch or dataset of another dataset than the one it holds".into(),
            )),
            false => Ok(()),
        }
    }

    /// Bytes of device memory the cached columns take.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether a whole epoch has been scattered into the cache.
    pub fn filled(&self) -> bool {
        self.filled
    }

    pub(crate) fn set_filled(&mut self) {
        self.filled = true;
    }

    /// The rows it holds room for.
    pub(crate) fn rows(&self) -> u64 {
        self.rows
    }

    /// Fills the cache straight from `dataset`, its rows in order: gathered by rayon's
    /// threads into two pinned staging buffers of about 32 MiB in turn, each copied in a
    /// few large transfers while the other is filled. Sequential reads and large copies
    /// make this far cheaper than the first epoch's per-batch scatter; `warmup` uses it so
    /// that epoch 0 already reads the device.
    ///
    /// # Errors
    /// The dataset's error, or a driver error.
    pub(crate) fn fill_from(&mut self, cuda: &Cuda, dataset: &dyn Dataset) -> Result<()> {
        const STAGING: usize = 32 << 20;
        self.check_dataset(dataset.fingerprint())?;
        if dataset.len() != self.rows {
            return Err(Error::Config(format!(
                "device cache: a dataset of {} samples, where it holds {}",
                dataset.len(),
                self.rows
            )));
        }
        // Rows rewritten from here on: not filled until all of them are.
        self.filled = false;
        let widths: Vec<usize> = self.layout.columns().iter().map(|c| c.row_bytes).collect();
        let per_row: usize = widths.iter().sum::<usize>().max(1);
        let rows = self.rows as usize;
        let chunk = (STAGING / per_row).clamp(1, rows.max(1));
        let alloc = PinnedAlloc::new(Arc::clone(&cuda.ctx), PinnedKind::Plain);
        let staging = [alloc.alloc(chunk * per_row)?, alloc.alloc(chunk * per_row)?];
        let timing = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let done = [cuda.ctx.new_event(timing)?, cuda.ctx.new_event(timing)?];
        let stream = Arc::clone(&self.stream);
        let filled = (|| -> Result<()> {
            for (j, start) in (0..rows).step_by(chunk).enumerate() {
                let m = chunk.min(rows - start);
                let buf = &staging[j % 2];
                // The copies that last read this buffer must be done before it is rewritten.
                done[j % 2].synchronize()?;
                // SAFETY: the buffer holds `len()` bytes it owns; its last copies have
                // completed (the event above), and nothing else refers to it.
                let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), buf.len()) };
                // Column c's rows at chunk * (widths before c).
                let mut regions: Vec<&mut [u8]> = Vec::with_capacity(widths.len());
                let mut rest = bytes;
                for &w in &widths {
                    let (head, tail) = rest.split_at_mut(chunk * w);
                    regions.push(&mut head[..m * w]);
                    rest = tail;
                }
                gather_rows_in_parallel(dataset, start as u64, m, &widths, &mut regions)?;
                for (c, region) in regions.iter().enumerate() {
                    let dst = addr(&self.columns[c], &stream) + (start * widths[c]) as u64;
                    // SAFETY: the cache column holds rows * widths[c] bytes, of which rows
                    // start..start + m are written; the pinned source stays untouched until
                    // `done[j % 2]`, recorded below, has completed.
                    unsafe { result::memcpy_htod_async(dst, &region[..], stream.cu_stream()) }?;
                }
                done[j % 2].record(&stream)?;
            }
            Ok(())
        })();
        // Whatever happened, no staging buffer is freed while a copy may read it.
        super::wait_stream(&stream)?;
        filled?;
        self.filled = true;
        Ok(())
    }

    /// The host copy of the current epoch's indices.
    fn host_indices(&self) -> &[u64] {
        // SAFETY: the pinned buffer holds `len` initialised bytes, aligned to a page,
        // so it is a valid `[u64]` of `len / 8` elements; no writer is active.
        unsafe {
            std::slice::from_raw_parts(
                self.host_idx.as_ptr().cast::<u64>(),
                self.host_idx.len() / 8,
            )
        }
    }

    /// Uploads the indices of every batch of `order` (batch `b` at `b * batch_size`).
    ///
    /// # Errors
    /// [`Error::Config`] for an order of another dataset, with a sample past the
    /// cache's rows or batches larger than the cache's (an epoch of another loader than
    /// the cache's: its kernels would read or write outside the cache and its batch
    /// buffer), or more batches than planned; [`Error::Cuda`] from the copy.
    pub(crate) fn upload_order(&mut self, order: &EpochOrder, stream: &CudaStream) -> Result<()> {
        self.check_dataset(order.dataset_fingerprint())?;
        let b = self.layout.batch_size();
        if order.batch_size() != b as u64 {
            return Err(Error::Config(format!(
                "device cache: an epoch of batches of {} samples, where its batches hold {b} \
                 (an epoch of another loader than the cache's)",
                order.batch_size()
            )));
        }
        // The previous epoch's copy of the host buffer must be done before it is rewritten.
        stream.synchronize()?;
        let cap = self.host_idx.len() / 8;
        // SAFETY: as in `host_indices`; `&mut self` makes this the only access, and the
        // stream is idle, so no copy reads the buffer.
        let host =
            unsafe { std::slice::from_raw_parts_mut(self.host_idx.as_ptr().cast::<u64>(), cap) };
        let mut batch = Vec::with_capacity(b);
        for k in 0..order.batches() {
            order.batch(k, &mut batch);
            if let Some(&i) = batch.iter().find(|&&i| i >= self.rows) {
                return Err(Error::Config(format!(
                    "device cache: sample {i} of epoch {} is past its {} rows (an epoch of \
                     another loader than the cache's)",
                    order.epoch(),
                    self.rows
                )));
            }
            let at = k as usize * b;
            host.get_mut(at..at + batch.len())
                .ok_or_else(|| Error::Config("device cache: epoch larger than planned".into()))?
                .copy_from_slice(&batch);
        }
        let used = (order.batches() as usize * b).min(cap);
        let dst = addr(&self.idx, stream);
        // SAFETY: `idx` holds `cap` u64; the pinned source stays alive (owned by self)
        // and unchanged until the next `upload_order`, which synchronises first.
        unsafe { result::memcpy_htod_async(dst, &host[..used], stream.cu_stream()) }
            .map_err(Error::from)
    }

    fn launch_rows(
        &self,
        f: &cudarc::driver::CudaFunction,
        stream: &CudaStream,
        (src, dst, idx): (u64, u64, u64),
        rows: usize,
        row_bytes: usize,
    ) -> Result<()> {
        let unit = copy_unit(row_bytes);
        let total = (rows * row_bytes / unit) as u64;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, rb, unit) = (rows as i32, row_bytes as i64, unit as i32);
        let mut l = stream.launch_builder(f);
        l.arg(&src)
            .arg(&dst)
            .arg(&idx)
            .arg(&rows)
            .arg(&rb)
            .arg(&unit);
        // SAFETY: scatter_rows/gather_rows(const u8*, u8*, const u64*, int, i64, int): the
        // batch column holds rows * row_bytes bytes, the cache column len * row_bytes,
        // every index is below len (the sampler's indices), and `unit` divides row_bytes
        // while every base address is 256-byte aligned (device allocations, and batch
        // columns at 256-byte offsets in a batch buffer or a device slot), so the
        // kernel's 16- or 8-byte accesses are aligned.
        unsafe { l.launch(cfg) }.map(|_| ()).map_err(Error::from)
    }

    /// Enqueues the scatter of a fed batch into the cache (epoch being filled).
    pub(crate) fn scatter(&self, kernels: &Kernels, batch: &DeviceBatch) -> Result<()> {
        let s = batch.stream();
        let idx = addr(&self.idx, s) + batch.number() * self.layout.batch_size() as u64 * 8;
        let from: Vec<u64> = (0..self.columns.len())
            .map(|c| batch.column_ptr(c))
            .collect();
        self.scatter_from(kernels, s, &from, idx, batch.len())
    }

    /// Enqueues on `stream` the scatter of `rows` rows into the cache: column `c`'s from
    /// device address `from[c]`, to the samples listed at device address `idx`.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    pub(crate) fn scatter_from(
        &self,
        kernels: &Kernels,
        stream: &CudaStream,
        from: &[u64],
        idx: u64,
        rows: usize,
    ) -> Result<()> {
        self.each_column(&kernels.scatter_rows, stream, (from, idx), rows, true)
    }

    /// Enqueues on `stream` the gather of `rows` rows from the cache: the samples listed
    /// at device address `idx`, column `c`'s to device address `to[c]`.
    ///
    /// # Errors
    /// [`Error::Cuda`] on a driver error.
    pub(crate) fn gather_to(
        &self,
        kernels: &Kernels,
        stream: &CudaStream,
        to: &[u64],
        idx: u64,
        rows: usize,
    ) -> Result<()> {
        self.each_column(&kernels.gather_rows, stream, (to, idx), rows, false)
    }

    /// Launches `f` for each column, between the cache's and `batch[c]`: from the batch
    /// into the cache when `into_cache`, else the other way.
    fn each_column(
        &self,
        f: &cudarc::driver::CudaFunction,
        stream: &CudaStream,
        (batch, idx): (&[u64], u64),
        rows: usize,
        into_cache: bool,
    ) -> Result<()> {
        for (c, col) in self.columns.iter().enumerate() {
            let rb = self.layout.columns()[c].row_bytes;
            let cache = addr(col, stream);
            let (src, dst) = match into_cache {
                true => (batch[c], cache),
                false => (cache, batch[c]),
            };
            self.launch_rows(f, stream, (src, dst, idx), rows, rb)?;
        }
        Ok(())
    }

    /// Enqueues the gather of batch `b` (`rows` samples) from the cache into the cache's
    /// batch buffer, and returns that batch.
    pub(crate) fn gather<'a>(
        &'a self,
        kernels: &Kernels,
        stream: &'a Arc<CudaStream>,
        epoch: u64,
        b: u64,
        rows: usize,
    ) -> Result<DeviceBatch<'a>> {
        let at = b as usize * self.layout.batch_size();
        if rows > self.layout.batch_size() || at + rows > self.host_idx.len() / 8 {
            return Err(Error::Config(format!(
                "device cache: batch {b} of {rows} samples is not one of the epoch uploaded"
            )));
        }
        let base = addr(&self.batch, stream);
        let idx = addr(&self.idx, stream) + at as u64 * 8;
        let to: Vec<u64> = (0..self.columns.len())
            .map(|c| base + self.layout.offset(c) as u64)
            .collect();
        self.gather_to(kernels, stream, &to, idx, rows)?;
        let indices = &self.host_indices()[at..at + rows];
        Ok(DeviceBatch::new(base, &self.layout, stream, rows, epoch, b, indices).with_cached(true))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rows_move_in_the_widest_unit_that_divides_them() {
        assert_eq!(super::copy_unit(3072), 16);
        assert_eq!(super::copy_unit(8), 8);
        assert_eq!(super::copy_unit(24), 8);
        assert_eq!(super::copy_unit(3), 1);
        assert_eq!(super::copy_unit(1), 1);
    }
}
