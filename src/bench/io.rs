//! The I/O roofline: what the storage under a dataset file delivers with direct I/O
//! (no page cache), sequentially in 1 MiB reads and randomly in reads of one row's
//! pages at queue depth 32, so that cold epochs are ratios of it measured in one run.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::loader::{HostAlloc, PlainAlloc};
use crate::util::mix;

/// What the storage delivered.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IoRoofline {
    /// The file read.
    pub file: String,
    /// Sequential 1 MiB direct reads, bytes per second.
    pub sequential_bytes_per_s: f64,
    /// Random direct reads of `random_read_bytes` (one row's pages) at depth 32, reads
    /// per second.
    pub random_iops: f64,
    /// Bytes of each random read.
    pub random_read_bytes: usize,
}

/// Sequential reads of this size.
const SEQUENTIAL: usize = 1 << 20;
/// Random reads in flight (one thread each).
const DEPTH: usize = 32;
/// How long each measurement runs, at most.
const BUDGET: Duration = Duration::from_millis(1500);

/// Measures [`IoRoofline`] on `path`, whose rows are `row_bytes` long.
///
/// # Errors
/// [`Error::Io`] naming the file if it cannot be opened for direct I/O (a file system
/// without `O_DIRECT`, such as tmpfs) or a read fails.
pub fn measure(path: &Path, row_bytes: usize) -> Result<IoRoofline> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let page = crate::util::page_size();
    let buf = PlainAlloc.alloc(SEQUENTIAL)?;
    // SAFETY: `HostMemory` guarantees `len` initialised bytes at `as_ptr`, owned by
    // `buf`, which outlives the slice; page-aligned, as O_DIRECT requires.
    let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), buf.len()) };
    let start = Instant::now();
    let mut read = 0u64;
    while read + (SEQUENTIAL as u64) <= len && start.elapsed() < BUDGET {
        read += file
            .read_at(&mut bytes[..SEQUENTIAL], read)
            .map_err(|e| Error::io(path, e))? as u64;
    }
    let sequential_bytes_per_s = read as f64 / start.elapsed().as_secs_f64().max(1e-9);

    // One row's pages: a row at a random offset spans this many whole pages, on average
    // a little more than its length rounded up.
    let span = (row_bytes.div_ceil(page) * page).max(page);
    let slots = len.saturating_sub(span as u64) / page as u64;
    let reads = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let threads: Vec<_> = (0..DEPTH)
            .map(|t| {
                let (file, reads) = (&file, &reads);
                s.spawn(move || random_reads(file, t as u64, span, slots, page, reads))
            })
            .collect();
        threads
            .into_iter()
            .try_for_each(|h| h.join().expect("reads do not panic"))
            .map_err(|e| Error::io(path, e))
    })?;
    let random_iops = reads.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    Ok(IoRoofline {
        file: path.display().to_string(),
        sequential_bytes_per_s,
        random_iops,
        random_read_bytes: span,
    })
}

/// One thread of the random reads: page-aligned reads of `span` bytes until the budget
/// is spent.
fn random_reads(
    file: &File,
    seed: u64,
    span: usize,
    slots: u64,
    page: usize,
    reads: &AtomicU64,
) -> std::io::Result<()> {
    if slots == 0 {
        return Ok(());
    }
    let buf = PlainAlloc
        .alloc(span)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    // SAFETY: as in `measure`, for this thread's own buffer.
    let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), span) };
    let start = Instant::now();
    let mut k = 0u64;
    while start.elapsed() < BUDGET {
        let at = mix(seed.wrapping_mul(0x9e37_79b9) ^ k) % slots * page as u64;
        file.read_at(bytes, at)?;
        reads.fetch_add(1, Ordering::Relaxed);
        k += 1;
    }
    Ok(())
}
