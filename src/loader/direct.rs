//! Direct reads: while a dataset streams (its files exceed the page-cache budget), each
//! worker reads its batch's rows straight from storage, bypassing the page cache.
//!
//! Through the page cache a row costs its whole pages: a 3,080-byte row spans two 4 KiB
//! pages more often than one, and a page shared with a row outside the planned window is
//! read again later. With `O_DIRECT` a read costs the row's sectors (the file system's
//! direct-I/O alignment, 512 bytes on most disks) and leaves nothing behind in the page
//! cache. A worker puts every read of its batch in flight at once on its own io_uring,
//! so storage sees a queue as deep as the batch, without a thread per read.
//!
//! Rows that are adjacent or overlap after alignment (block shuffle, neighbouring
//! windows) are merged into one read of up to [`MAX_READ`]. Files kept under the budget
//! are read the same way without `O_DIRECT` (from the page cache). A read that comes
//! back short, or a file whose length or modification time changed, is an error naming
//! the file, as for the mapped path.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use io_uring::{opcode, types, IoUring};

use super::pool::{HostAlloc, HostMemory, PlainAlloc, BUFFER_ALIGN};
use crate::dataset::{check_out, Dataset, MappedFile};
use crate::error::{Error, Result};
use crate::util::{page_size, with_room};

/// The longest single read, in bytes (a longer row is read alone).
const MAX_READ: u64 = 1 << 20;
/// The longest row read directly; longer ones are gathered through the mapping.
const MAX_ROW: usize = 1 << 30;
/// Reads in flight per worker, at most (the ring's size).
const DEPTH: u32 = 32;

/// One dataset file opened for reads outside its mapping.
#[derive(Debug)]
pub(crate) struct Source {
    file: File,
    /// Offsets, lengths and buffer addresses are multiples of this (1 without
    /// `O_DIRECT`).
    align: u64,
}

impl Source {
    /// Opens the file behind `mapped` again, the same inode as its mapping (through
    /// `/proc/self/fd`, whatever has happened to its path since), with `O_DIRECT` when
    /// `direct`. `None` where that cannot be done: for direct reads, a dataset that gave
    /// no open file, no `/proc`, or a file system without direct I/O (tmpfs).
    pub(crate) fn open(mapped: MappedFile<'_>, direct: bool) -> Option<Source> {
        if !direct {
            return Some(Source {
                file: mapped.reopen().ok()?,
                align: 1,
            });
        }
        let watched = mapped.watched()?;
        let path = format!("/proc/self/fd/{}", watched.file().as_raw_fd());
        let file = open_direct(path.as_ref()).ok()?;
        let align = direct_align(&file)?;
        Some(Source { file, align })
    }

    /// Whether reads bypass the page cache.
    pub(crate) fn is_direct(&self) -> bool {
        self.align > 1
    }

    /// What offsets, lengths and buffer addresses of reads must be multiples of.
    pub(crate) fn align(&self) -> u64 {
        self.align
    }

    /// The open file.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }
}

/// The alignment direct reads of the file at `path` need ([`direct_align`]), or `None`
/// where it cannot be opened with `O_DIRECT`.
pub(crate) fn path_align(path: &std::path::Path) -> Option<u64> {
    direct_align(&open_direct(path).ok()?)
}

/// `path` opened for reading with `O_DIRECT` (with room: [`with_room`]).
fn open_direct(path: &std::path::Path) -> std::io::Result<File> {
    with_room(|| {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
    })
}

/// The alignment direct reads of `file` need (offset, length and memory), from
/// `statx(STATX_DIOALIGN)`; the page size where the kernel does not say; `None` where
/// the file system does not do direct I/O, or needs more memory alignment than the
/// staging buffers have ([`BUFFER_ALIGN`]).
fn direct_align(file: &File) -> Option<u64> {
    let page = page_size() as u64;
    // SAFETY: `statx` is plain old data, for which all zeroes is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, an empty NUL-terminated path with AT_EMPTY_PATH (the
    // descriptor itself), and a live `statx` for the kernel to fill.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return (page <= BUFFER_ALIGN as u64).then_some(page);
    }
    let (offset, memory) = (
        u64::from(stx.stx_dio_offset_align),
        u64::from(stx.stx_dio_mem_align),
    );
    if offset == 0 || memory > BUFFER_ALIGN as u64 {
        return None;
    }
    Some(offset.max(memory).max(1))
}

/// Checks, after rows were read outside the mappings, that no file changed meanwhile: a
/// file rewritten in place keeps its length, and its modification time tells.
///
/// # Errors
/// [`Error::Dataset`] naming a file that changed since it was opened.
pub(crate) fn unchanged(files: &[MappedFile<'_>]) -> Result<()> {
    for f in files {
        if let Some(w) = f.watched() {
            w.check_recently()?;
        }
    }
    Ok(())
}

/// One row of one column, as [`Dataset::locate`] gave it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row {
    pub(crate) file: u32,
    pub(crate) column: u32,
    pub(crate) sample: u32,
    pub(crate) offset: u64,
    pub(crate) len: u32,
    /// The read that brings it in (direct reads only).
    read: u32,
}

/// Collects into `rows` the rows of `indices` that `dataset.locate` gives, in the
/// files `0..files`; false if that does not describe the gather (not one range per
/// column of its row's length, in column order, in a known file): the caller then
/// gathers through the dataset.
pub(crate) fn locate(
    dataset: &dyn Dataset,
    files: usize,
    epoch: u64,
    indices: &[u64],
    rows: &mut Vec<Row>,
) -> bool {
    let columns = dataset.columns();
    rows.clear();
    let mut fits = indices.len() <= u32::MAX as usize;
    for (sample, &index) in indices.iter().enumerate() {
        let mut column = 0usize;
        dataset.locate(epoch, index, &mut |file, offset, len| {
            fits &= column < columns.len()
                && columns[column].row_bytes == len
                && file < files
                && len <= MAX_ROW;
            if fits && len > 0 {
                rows.push(Row {
                    file: file as u32,
                    column: column as u32,
                    sample: sample as u32,
                    offset: offset as u64,
                    len: len as u32,
                    read: 0,
                });
            }
            column += 1;
        });
        if !fits || column != columns.len() {
            return false;
        }
    }
    true
}

/// Whether `dataset`'s [`Dataset::locate`] describes its gather, judged on its first
/// sample (see [`locate`]): only then can its rows be read outside the mappings. A
/// dataset that pads or computes its rows ([`Documents`](crate::Documents)) does not.
pub(crate) fn describes(dataset: &dyn Dataset) -> bool {
    let mut rows = Vec::new();
    !dataset.is_empty() && locate(dataset, dataset.files().len(), 0, &[0], &mut rows)
}

/// One read: aligned bytes of a file into the staging buffer at `at`.
#[derive(Debug, Clone, Copy)]
struct Read {
    file: u32,
    offset: u64,
    len: u64,
    at: usize,
    /// Bytes the file holds of this read (less than `len` only at its end).
    wanted: u64,
    done: u64,
}

/// A worker's ring, staging buffer and scratch lists, kept from batch to batch.
///
/// The staging buffer may be written by the kernel while reads are in flight: it is
/// freed or replaced only once `in_flight` is 0. Whatever interrupts a batch (an error
/// of the ring, a panic that unwinds through the worker), the reads still in flight are
/// waited for before the buffer is touched again ([`Reader::settle`], and `Drop`); if
/// they cannot be, the buffer is leaked and the reader is `broken`: the worker gathers
/// through the mapping from then on. It does too once the file system has `refused` a
/// direct read that it let the file be opened for.
pub(crate) struct Reader {
    ring: IoUring,
    buf: Option<Box<dyn HostMemory>>,
    in_flight: u32,
    broken: bool,
    refused: bool,
    rows: Vec<Row>,
    reads: Vec<Read>,
    order: Vec<u32>,
    queue: Vec<u32>,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader").finish_non_exhaustive()
    }
}

impl Reader {
    /// A reader with its own ring.
    ///
    /// # Errors
    /// [`Error::Io`] where io_uring cannot be set up (an old kernel, or a sandbox that
    /// forbids it); the worker then gathers through the mapping.
    pub(crate) fn new() -> Result<Reader> {
        let ring = with_room(|| IoUring::new(DEPTH)).map_err(|e| Error::io("<io_uring>", e))?;
        Ok(Reader {
            ring,
            buf: None,
            in_flight: 0,
            broken: false,
            refused: false,
            rows: Vec::new(),
            reads: Vec::new(),
            order: Vec::new(),
            queue: Vec::new(),
        })
    }

    /// Whether io_uring works here: a ring can be made, and it knows the read opcode
    /// (kernels before 5.6 do not).
    pub(crate) fn available() -> bool {
        let Ok(ring) = with_room(|| IoUring::new(2)) else {
            return false;
        };
        let mut probe = io_uring::Probe::new();
        ring.submitter().register_probe(&mut probe).is_ok()
            && probe.is_supported(opcode::Read::CODE)
    }

    /// Waits for every read still in flight from an interrupted batch, discarding them;
    /// if the ring will not say, leaks the buffer and marks the reader broken.
    fn settle(&mut self) {
        while self.in_flight > 0 && !self.broken {
            match self.ring.submit_and_wait(self.in_flight as usize) {
                Ok(_) => {}
                Err(e) if transient(&e) => {}
                Err(_) => {
                    self.abandon();
                    return;
                }
            }
            let done = self.ring.completion().count() as u32;
            self.in_flight = self.in_flight.saturating_sub(done);
        }
    }

    /// Gives up on the reads in flight: the buffer they may still write is leaked, and
    /// the reader reads no more.
    fn abandon(&mut self) {
        std::mem::forget(self.buf.take());
        self.broken = true;
    }

    /// Copies the samples `indices` of `epoch` into `out`, as [`Dataset::gather`] does,
    /// by reading the byte ranges `locate` gives from `sources` (one per file of
    /// `dataset`). Returns `Ok(false)`, having read nothing, where `locate` does not
    /// describe the gather (not one range per column of its row's length, in column
    /// order), or where the file system refuses direct reads of a file it let be opened
    /// with `O_DIRECT` (`EINVAL` or `EOPNOTSUPP` when read: some network and FUSE file
    /// systems): the caller then gathers through the dataset, as this reader's later
    /// calls leave it to.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file for a failed read; [`Error::Dataset`] naming it for
    /// a short read or a file that changed since it was opened.
    pub(crate) fn gather(
        &mut self,
        dataset: &dyn Dataset,
        sources: &[Source],
        epoch: u64,
        indices: &[u64],
        out: &mut [&mut [u8]],
    ) -> Result<bool> {
        let columns = dataset.columns();
        check_out(columns, indices.len(), out)?;
        self.settle();
        if self.broken
            || self.refused
            || !locate(dataset, sources.len(), epoch, indices, &mut self.rows)
        {
            return Ok(false);
        }
        let files = dataset.files();
        if files.len() != sources.len() {
            return Ok(false);
        }
        if !self.merge(sources, &files)? {
            // No staging memory for this batch: the mapping serves it.
            return Ok(false);
        }
        if !self.read_all(sources, &files)? {
            self.refused = true;
            return Ok(false);
        }
        let buf = self.buf.as_ref().map_or(&[][..], |b| {
            // SAFETY: `HostMemory` guarantees `len` initialised bytes at `as_ptr`, owned
            // by `b`; no read is in flight (`read_all` drained the ring).
            unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) }
        });
        for row in &self.rows {
            let read = &self.reads[row.read as usize];
            let from = read.at + (row.offset - read.offset) as usize;
            let len = row.len as usize;
            let to = row.sample as usize * len;
            out[row.column as usize][to..to + len].copy_from_slice(&buf[from..from + len]);
        }
        unchanged(&files)?;
        Ok(true)
    }

    /// Turns the rows into aligned reads, merging those that touch, and sizes the
    /// staging buffer for them: `false` where it cannot grow (the mapping serves the
    /// batch then).
    ///
    /// # Errors
    /// [`Error::Dataset`] for a row beyond its file's end.
    fn merge(&mut self, sources: &[Source], files: &[MappedFile<'_>]) -> Result<bool> {
        let rows = &mut self.rows;
        self.order.clear();
        self.order.extend(0..rows.len() as u32);
        self.order
            .sort_unstable_by_key(|&r| (rows[r as usize].file, rows[r as usize].offset));
        self.reads.clear();
        for &r in &self.order {
            let row = &mut rows[r as usize];
            let file = files[row.file as usize];
            if row.offset + u64::from(row.len) > file.bytes().len() as u64 {
                return Err(Error::dataset(
                    file.path(),
                    format!(
                        "a row of {} bytes at offset {} runs past its end",
                        row.len, row.offset
                    ),
                ));
            }
            let a = sources[row.file as usize].align;
            let start = row.offset / a * a;
            let end = (row.offset + u64::from(row.len)).div_ceil(a) * a;
            let merged = match self.reads.last_mut() {
                Some(last)
                    if last.file == row.file
                        && start <= last.offset + last.len
                        && end.max(last.offset + last.len) - last.offset <= MAX_READ =>
                {
                    last.len = last.len.max(end - last.offset);
                    true
                }
                _ => false,
            };
            if !merged {
                self.reads.push(Read {
                    file: row.file,
                    offset: start,
                    len: end - start,
                    at: 0,
                    wanted: 0,
                    done: 0,
                });
            }
            row.read = (self.reads.len() - 1) as u32;
        }
        let mut total = 0usize;
        for read in &mut self.reads {
            let f = read.file as usize;
            let a = sources[f].align as usize;
            read.at = total.div_ceil(a) * a;
            total = read.at + read.len as usize;
            let file_len = files[f].bytes().len() as u64;
            read.wanted = read.len.min(file_len - read.offset);
        }
        if self.buf.as_ref().map_or(0, |b| b.len()) < total {
            // No read is in flight: `gather` settled the last batch's first.
            debug_assert_eq!(self.in_flight, 0);
            self.buf = None;
            match PlainAlloc.alloc(total.next_power_of_two()) {
                Ok(buf) => self.buf = Some(buf),
                // The batch is read through the mapping instead, which needs none.
                Err(_) => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Puts every read in flight, [`DEPTH`] at a time, and waits for all of them. Reads
    /// cut short by a signal or a full queue are submitted again for the rest; a read
    /// that ends before the file does is an error. Every read has completed when this
    /// returns, error or not, unless the ring itself fails: the buffer is then leaked
    /// (the kernel may still write it) and the reader is broken. A panic out of here
    /// leaves `in_flight` counted, for [`settle`](Reader::settle) or `Drop`.
    ///
    /// Returns `Ok(false)` where the file system refused a direct read as such
    /// ([`refusal`]), after the reads in flight have completed, and where the ring
    /// failed (the reader is then broken, and the mapping serves this batch and the
    /// next).
    fn read_all(&mut self, sources: &[Source], files: &[MappedFile<'_>]) -> Result<bool> {
        let base = match &self.buf {
            Some(b) => b.as_ptr(),
            None => return Ok(true),
        };
        self.queue.clear();
        self.queue.extend((0..self.reads.len() as u32).rev());
        let mut failed = None::<Error>;
        let mut refused = false;
        loop {
            if failed.is_none() && !refused {
                let mut sq = self.ring.submission();
                while self.in_flight < DEPTH {
                    let Some(&r) = self.queue.last() else { break };
                    let read = &self.reads[r as usize];
                    let source = &sources[read.file as usize];
                    // At most a merged read (1 MiB) or one row (1 GiB), aligned up.
                    let len = (read.len - read.done) as u32;
                    // SAFETY: `at + done .. at + len` lies within the staging buffer
                    // (`merge` sized it). The buffer stays allocated and is neither
                    // replaced nor freed while `in_flight` counts this read: the read
                    // is waited for here, by `settle` before the next batch, or in
                    // `Drop`, or else the buffer is leaked (`abandon`).
                    let dst = unsafe { base.add(read.at + read.done as usize) };
                    let entry = opcode::Read::new(types::Fd(source.file.as_raw_fd()), dst, len)
                        .offset(read.offset + read.done)
                        .build()
                        .user_data(u64::from(r));
                    // SAFETY: as above for the buffer; the descriptor stays open for as
                    // long as `sources` lives, which outlives this call.
                    if unsafe { sq.push(&entry) }.is_err() {
                        break;
                    }
                    self.queue.pop();
                    self.in_flight += 1;
                }
            }
            if self.in_flight == 0 {
                break;
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                // Anything but a transient error leaves the ring's state unknown.
                // The reads' bytes are not trusted and the reader is broken from now
                // on; the batch, none of it yet copied out, is gathered from the
                // mapping instead, as a refused read's is.
                if !transient(&e) {
                    self.abandon();
                    return Ok(false);
                }
            }
            for cqe in self.ring.completion() {
                self.in_flight = self.in_flight.saturating_sub(1);
                let r = cqe.user_data() as u32;
                let Some(read) = self.reads.get_mut(r as usize) else {
                    continue;
                };
                let res = cqe.result();
                let file = files[read.file as usize];
                if res == -libc::EINTR || res == -libc::EAGAIN {
                    self.queue.push(r);
                } else if res < 0 && sources[read.file as usize].is_direct() && refusal(-res) {
                    refused = true;
                } else if res < 0 {
                    let e = std::io::Error::from_raw_os_error(-res);
                    failed.get_or_insert(Error::io(file.path(), e));
                } else {
                    read.done += res as u64;
                    let align = sources[read.file as usize].align;
                    if read.done >= read.wanted {
                        continue;
                    }
                    if res > 0 && read.done % align == 0 {
                        self.queue.push(r);
                        continue;
                    }
                    let short = match file.watched() {
                        Some(w) => {
                            w.short_read(read.offset, read.wanted as usize, read.done as usize)
                        }
                        None => Error::dataset(file.path(), "a read came back short"),
                    };
                    failed.get_or_insert(short);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(!refused),
        }
    }
}

/// Whether a direct read's error says the file system will not read this file (or these
/// offsets) directly, rather than that the read failed: the same bytes can still be read
/// through the mapping.
fn refusal(errno: i32) -> bool {
    errno == libc::EINVAL || errno == libc::EOPNOTSUPP
}

/// An error of `io_uring_enter` after which the ring is still sound: a signal, or no
/// room to submit or complete for now (reap what has completed and go on).
fn transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

impl Drop for Reader {
    fn drop(&mut self) {
        // The ring's teardown does not wait for reads in flight; the buffer must
        // outlive them.
        self.settle();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::{DType, NpyDataset};
    use crate::gen::NpyWriter;

    /// Rows of 100 bytes: no row but the first starts on a sector.
    const WIDTH: usize = 100;

    #[test]
    fn a_direct_read_refused_when_made_falls_back_to_the_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.npy");
        let mut w = NpyWriter::create(&path, DType::U8, &[64, WIDTH as u64]).unwrap();
        for (k, b) in w.data_mut().iter_mut().enumerate() {
            *b = (k / WIDTH) as u8 ^ (k % WIDTH) as u8;
        }
        w.finish().unwrap();
        let ds = NpyDataset::open(&path).unwrap();
        let (Ok(file), Ok(mut reader)) = (open_direct(&path), Reader::new()) else {
            crate::testing::skip_cold("no O_DIRECT or no io_uring here");
            return;
        };
        // A file opened with O_DIRECT whose reads are refused: the alignment the reader
        // is told (2 bytes) is one that ext4, xfs or btrfs will not read directly, which
        // stands for a file system that refuses every direct read at read time.
        let sources = [Source { file, align: 2 }];
        let indices = [3u64, 17, 40];
        let mut want = vec![0u8; indices.len() * WIDTH];
        ds.gather(0, &indices, &mut [&mut want[..]]).unwrap();
        for _ in 0..2 {
            let mut got = vec![0u8; indices.len() * WIDTH];
            match reader.gather(&ds, &sources, 0, &indices, &mut [&mut got[..]]) {
                Ok(true) => assert!(got == want, "read directly, the rows differ"),
                Ok(false) => assert!(reader.refused),
                Err(e) => panic!("a refused direct read failed the batch: {e}"),
            }
        }
        assert_eq!(reader.in_flight, 0);
        if !reader.refused {
            crate::testing::skip_cold("this file system reads 2-byte-aligned O_DIRECT");
            return;
        }
        // Refused, the reader says so at once from then on (no read submitted), so that
        // the loader gathers from the mapping.
        let mut got = vec![0u8; indices.len() * WIDTH];
        assert!(!reader
            .gather(&ds, &sources, 0, &indices, &mut [&mut got[..]])
            .unwrap());
        assert_eq!(reader.in_flight, 0);
    }
}
