//! The I/O roofline: what the storage under a dataset file delivers with direct I/O
//! (no page cache), sequentially in 1 MiB reads and randomly in reads of one row's
//! pages at queue depth 32, so that cold epochs are ratios of it measured in one run.
//!
//! A shared or cloud disk's rate drifts by tens of percent within seconds, so each rate
//! is measured twice, just before and just after the cold epoch it is the ceiling of
//! (random reads around the full-shuffle epoch, sequential ones around the
//! block-shuffle epoch), and the roofline is their mean: [`Probe`] takes the passes,
//! [`IoRoofline::of`] puts them together.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
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
    /// Sequential 1 MiB direct reads, bytes per second: the mean of
    /// `sequential_passes`.
    pub sequential_bytes_per_s: f64,
    /// Random direct reads of `random_read_bytes` (one row's pages) at depth 32, reads
    /// per second: the mean of `random_passes`.
    pub random_iops: f64,
    /// Bytes of each random read.
    pub random_read_bytes: usize,
    /// The sequential rate just before and just after the block-shuffle epoch.
    pub sequential_passes: Vec<f64>,
    /// The random rate just before and just after the full-shuffle epoch.
    pub random_passes: Vec<f64>,
}

impl IoRoofline {
    /// The roofline of `probe`'s file from its passes: each rate is the mean of its
    /// passes (0 where there is none).
    pub fn of(probe: &Probe, sequential_passes: Vec<f64>, random_passes: Vec<f64>) -> Self {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        IoRoofline {
            file: probe.path.display().to_string(),
            sequential_bytes_per_s: mean(&sequential_passes),
            random_iops: mean(&random_passes),
            random_read_bytes: probe.span,
            sequential_passes,
            random_passes,
        }
    }
}

/// Sequential reads of this size.
const SEQUENTIAL: usize = 1 << 20;
/// Random reads in flight (one thread each).
const DEPTH: usize = 32;
/// How long each pass runs, at most.
const BUDGET: Duration = Duration::from_millis(1500);

/// A dataset file opened for direct reads, to measure what its storage delivers.
#[derive(Debug)]
pub struct Probe {
    file: File,
    path: PathBuf,
    len: u64,
    page: usize,
    /// Bytes of each random read: the pages one row at a random offset spans.
    span: usize,
    /// Random passes taken: each reads other offsets.
    passes: AtomicU64,
}

impl Probe {
    /// Opens `path`, whose rows are `row_bytes` long, with `O_DIRECT`.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file if it cannot be opened for direct I/O (a file system
    /// without `O_DIRECT`, such as tmpfs).
    pub fn open(path: &Path, row_bytes: usize) -> Result<Probe> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let page = crate::util::page_size();
        // A row at a random offset spans this many whole pages, on average a little
        // more than its length rounded up.
        let span = (row_bytes.div_ceil(page) * page).max(page);
        Ok(Probe {
            file,
            path: path.to_path_buf(),
            len,
            page,
            span,
            passes: AtomicU64::new(0),
        })
    }

    /// One pass of sequential 1 MiB reads from the start of the file, for at most 1.5 s
    /// or the whole file: bytes per second.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file if a read fails.
    pub fn sequential(&self) -> Result<f64> {
        let buf = PlainAlloc.alloc(SEQUENTIAL)?;
        // SAFETY: `HostMemory` guarantees `len` initialised bytes at `as_ptr`, owned by
        // `buf`, which outlives the slice; page-aligned, as O_DIRECT requires.
        let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), buf.len()) };
        let start = Instant::now();
        let mut read = 0u64;
        // The last read of a file that is not a multiple of 1 MiB comes back short.
        while read < self.len && start.elapsed() < BUDGET {
            let n = self
                .file
                .read_at(bytes, read)
                .map_err(|e| Error::io(&self.path, e))?;
            if n == 0 {
                break;
            }
            read += n as u64;
        }
        Ok(read as f64 / start.elapsed().as_secs_f64().max(1e-9))
    }

    /// One pass of random page-aligned reads of one row's pages, 32 in flight (a thread
    /// each), for 1.5 s: reads per second.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file if a read fails; [`Error::Config`] for a file too
    /// small for one read at a random place (no figure to divide by).
    pub fn random(&self) -> Result<f64> {
        let slots = self.len.saturating_sub(self.span as u64) / self.page as u64;
        if slots == 0 {
            return Err(Error::Config(format!(
                "{}: {} bytes leave no room for reads of {} bytes at random places",
                self.path.display(),
                self.len,
                self.span
            )));
        }
        let pass = self.passes.fetch_add(1, Ordering::Relaxed);
        let reads = AtomicU64::new(0);
        let start = Instant::now();
        std::thread::scope(|s| -> Result<()> {
            let threads: Vec<_> = (0..DEPTH)
                .map(|t| {
                    let reads = &reads;
                    s.spawn(move || {
                        let seed = pass * DEPTH as u64 + t as u64;
                        random_reads(&self.file, seed, self.span, slots, self.page, reads)
                    })
                })
                .collect();
            threads
                .into_iter()
                .try_for_each(|h| h.join().expect("reads do not panic"))
                .map_err(|e| Error::io(&self.path, e))
        })?;
        Ok(reads.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
    }
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
