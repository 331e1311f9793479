//! Window reads: while a dataset streams under a block shuffle (or in file order), the
//! runs of pages the next batches need (a window's blocks, about 1 MiB each) are read
//! with `O_DIRECT` into the loader's own buffers, and the workers copy rows from there.
//!
//! Through the page cache those runs were read at what buffered reads give: on the CI
//! VM 0.64 to 0.84 GB/s, where direct reads of the same 1 MiB gave 0.8 to 1.25 GB/s
//! (every page of a buffered read is allocated, inserted, locked and dropped again, and
//! every row gathered from the mapping faults its pages in). Read directly, a window
//! costs its bytes once, and the page cache is not touched at all.
//!
//! - The planner ([`plan`](super::plan)) turns each run it would have asked the page
//!   cache for into [`Extent`]s of at most [`EXTENT`] bytes ([`Window::read`]), queued
//!   in the order the batches need them, once fewer than 16 MiB are left to read. By
//!   then the window's later batches are planned too, and an extent takes in the pages
//!   they want around its run: a block is read in one piece, not in as many as the
//!   batches that ask for its rows. Pages resident as the epoch started are left to
//!   the page cache. [`READERS`] threads read the extents, one read each at a time; a
//!   worker that needs an extent no reader has started reads it itself.
//! - The planner counts, per extent, the pages that planned rows still need
//!   ([`Window::want`], [`Window::unwant`]) and releases the extent when none does; its
//!   buffer goes back to a short free list.
//! - A worker copies each row from the extents that hold it ([`Extents::gather`]). Any
//!   part no extent holds (the planner was behind, the extent was released, or its read
//!   failed) is copied from the mapping, guarded as every gather is, so the plan stays
//!   advice and a file that changed is still an error naming it. After [`FAILURES`]
//!   failed reads, the planner streams the file through the page cache instead.

use std::collections::{BTreeMap, VecDeque};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::direct::{locate, unchanged, Row, Source};
use super::pool::{HostAlloc, HostMemory, PlainAlloc};
use crate::dataset::{check_out, Dataset, MappedFile};
use crate::error::{Error, Result};

/// The longest extent, in bytes: a longer run is read as several.
pub(crate) const EXTENT: usize = 1 << 20;
/// Threads that read extents while an epoch streams windows: reads in flight, at most,
/// besides those of workers reading an extent they reached first.
pub(crate) const READERS: usize = 4;
/// Free extent buffers kept for later extents (the rest are freed): twice the bytes
/// the planner lets wait to be read.
const SPARE: usize = 32;
/// Failed extent reads after which the planner stops reading a file into extents (a
/// file system that takes `O_DIRECT` at open and refuses the reads).
const FAILURES: u32 = 4;
/// How long a worker waits for the planner to have queued its batch's extents before it
/// copies the batch from the mapping instead: a safety net, not a pace. The planner
/// queues them as the reads before them complete, so a slow disk delays them, and
/// copying from the mapping then would read the same rows twice.
const PLAN_WAIT: Duration = Duration::from_secs(10);

/// Locks `m`, poisoned or not: every state a panic can leave behind is one the others
/// handle (an extent left queued is read again; a failed one is read from the mapping).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A run of one file's bytes, read (or to be read) into a buffer of its own.
pub(crate) struct Extent {
    file: usize,
    /// Where it starts in the file (a multiple of the page size).
    offset: u64,
    /// Bytes to read: a multiple of the file's direct-I/O alignment, at most [`EXTENT`].
    len: u64,
    /// Bytes of the file it holds: `len`, or less where the file ends.
    wanted: u64,
    slot: Mutex<Slot>,
}

impl Extent {
    /// The file offset just past the bytes it holds.
    fn end(&self) -> u64 {
        self.offset + self.wanted
    }
}

/// What an extent holds.
enum Slot {
    /// Not read yet.
    Queued,
    /// Read: the first `wanted` bytes of the buffer are the file's.
    Ready(Box<dyn HostMemory>),
    /// The read failed or came back short: its rows are copied from the mapping, which
    /// reports the file's error.
    Failed,
    /// No planned row needs it any more.
    Released,
}

/// The extents of an epoch's windowed files, shared by the planner, the readers and the
/// workers.
///
/// Locks are taken in one order: an extent's slot, then `inner`; never the other way.
pub(crate) struct Extents {
    /// Per file: opened with `O_DIRECT` where the file is windowed.
    sources: Vec<Option<Source>>,
    /// Extent reads that failed or came back short.
    failed: std::sync::atomic::AtomicU32,
    inner: Mutex<Inner>,
    /// Signalled when an extent is queued, and on close.
    queued: Condvar,
    /// Signalled when the planner has queued more batches' extents, and on close.
    issued: Condvar,
}

struct Inner {
    /// Per file, the live extents by offset.
    held: Vec<BTreeMap<u64, Arc<Extent>>>,
    /// Extents to read, in the order the batches need them.
    queue: VecDeque<Arc<Extent>>,
    /// Buffers of released extents, for the next ones.
    spare: Vec<Box<dyn HostMemory>>,
    /// Batches whose runs have all been queued: every batch numbered below.
    issued: u64,
    /// Bytes of extents queued and not yet read.
    unread: u64,
    /// The planner has left the epoch: readers leave, workers no longer wait for it.
    closed: bool,
}

impl Extents {
    /// The extents of files opened as `sources` (`None` for a file not windowed).
    pub(crate) fn new(sources: Vec<Option<Source>>) -> Extents {
        let held = sources.iter().map(|_| BTreeMap::new()).collect();
        Extents {
            sources,
            failed: std::sync::atomic::AtomicU32::new(0),
            inner: Mutex::new(Inner {
                held,
                queue: VecDeque::new(),
                spare: Vec::new(),
                issued: 0,
                unread: 0,
                closed: false,
            }),
            queued: Condvar::new(),
            issued: Condvar::new(),
        }
    }

    /// Whether `file`'s planned runs are read into extents.
    pub(crate) fn windowed(&self, file: usize) -> bool {
        self.sources.get(file).is_some_and(Option::is_some)
    }

    /// Queues a read of `len` bytes of `file` at `offset`, `wanted` of which the file
    /// holds, and makes it the extent there.
    fn push(&self, file: usize, offset: u64, len: u64, wanted: u64) -> Arc<Extent> {
        let extent = Arc::new(Extent {
            file,
            offset,
            len,
            wanted,
            slot: Mutex::new(Slot::Queued),
        });
        let mut inner = lock(&self.inner);
        inner.held[file].insert(offset, Arc::clone(&extent));
        inner.queue.push_back(Arc::clone(&extent));
        inner.unread += len;
        drop(inner);
        self.queued.notify_one();
        extent
    }

    /// Forgets `extent`: no planned row needs it. Its buffer is kept for a later one.
    fn release(&self, extent: &Arc<Extent>) {
        {
            let mut inner = lock(&self.inner);
            let held = &mut inner.held[extent.file];
            if held
                .get(&extent.offset)
                .is_some_and(|e| Arc::ptr_eq(e, extent))
            {
                held.remove(&extent.offset);
            }
        }
        // Waits for a read in progress: its buffer is being written.
        let old = std::mem::replace(&mut *lock(&extent.slot), Slot::Released);
        match old {
            Slot::Ready(buf) => self.keep(buf),
            Slot::Queued => self.settled(extent),
            Slot::Failed | Slot::Released => {}
        }
    }

    /// `extent` has left [`Slot::Queued`]: its bytes are no longer to be read.
    fn settled(&self, extent: &Extent) {
        let mut inner = lock(&self.inner);
        inner.unread = inner.unread.saturating_sub(extent.len);
    }

    /// Bytes of extents queued and not yet read.
    pub(crate) fn unread(&self) -> u64 {
        lock(&self.inner).unread
    }

    /// Whether enough extent reads have failed that the rest should go through the page
    /// cache.
    pub(crate) fn failing(&self) -> bool {
        self.failed.load(std::sync::atomic::Ordering::Relaxed) >= FAILURES
    }

    /// Frees every extent and spare buffer: the epoch's planning is over (a worker of
    /// a cancelled epoch still copying finds its extents released, and copies from the
    /// mapping). The job, and these extents, outlive the epoch until the next one.
    pub(crate) fn clear(&self) {
        let mut extents = Vec::new();
        {
            let mut inner = lock(&self.inner);
            for held in &mut inner.held {
                extents.extend(std::mem::take(held).into_values());
            }
            inner.queue.clear();
            inner.spare.clear();
            inner.unread = 0;
        }
        for extent in extents {
            *lock(&extent.slot) = Slot::Released;
        }
    }

    /// Keeps a buffer for a later extent, or frees it.
    fn keep(&self, buf: Box<dyn HostMemory>) {
        let mut inner = lock(&self.inner);
        if inner.spare.len() < SPARE {
            inner.spare.push(buf);
        }
    }

    /// Says that the runs of every batch below `batches` are queued.
    pub(crate) fn issued(&self, batches: u64) {
        let mut inner = lock(&self.inner);
        if batches > inner.issued {
            inner.issued = batches;
            drop(inner);
            self.issued.notify_all();
        }
    }

    /// The planner has left the epoch: the readers leave (extents still queued are read
    /// by the workers that reach them), and no worker waits for the planner.
    pub(crate) fn close(&self) {
        lock(&self.inner).closed = true;
        self.queued.notify_all();
        self.issued.notify_all();
    }

    /// A reader thread: reads queued extents, oldest first, until [`close`], waking
    /// `planner` after each (it may ask for more).
    ///
    /// [`close`]: Extents::close
    pub(crate) fn serve(&self, planner: &std::thread::Thread) {
        loop {
            let extent = {
                let mut inner = lock(&self.inner);
                loop {
                    if inner.closed {
                        return;
                    }
                    if let Some(e) = inner.queue.pop_front() {
                        break e;
                    }
                    inner = self.queued.wait(inner).unwrap_or_else(|e| e.into_inner());
                }
            };
            let mut slot = lock(&extent.slot);
            self.fill(&extent, &mut slot);
            drop(slot);
            planner.unpark();
        }
    }

    /// Reads `extent` into a buffer if it is still queued; `slot` is its slot, locked.
    fn fill(&self, extent: &Extent, slot: &mut Slot) {
        if !matches!(slot, Slot::Queued) {
            return;
        }
        *slot = self.take(extent);
        self.settled(extent);
    }

    /// Reads `extent` into a buffer: [`Slot::Ready`] with it, or [`Slot::Failed`].
    fn take(&self, extent: &Extent) -> Slot {
        let Some(source) = self.sources.get(extent.file).and_then(Option::as_ref) else {
            return Slot::Failed;
        };
        let spare = lock(&self.inner).spare.pop();
        let Ok(buf) = spare.map_or_else(|| PlainAlloc.alloc(EXTENT), Ok) else {
            return Slot::Failed;
        };
        if read(source, extent, &*buf) {
            Slot::Ready(buf)
        } else {
            self.failed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.keep(buf);
            Slot::Failed
        }
    }

    /// Waits until the planner has queued batch `number`'s runs, it has left the epoch,
    /// or [`PLAN_WAIT`] has passed.
    fn wait_issued(&self, number: u64) {
        let deadline = Instant::now() + PLAN_WAIT;
        let mut inner = lock(&self.inner);
        while inner.issued <= number && !inner.closed {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            inner = self
                .issued
                .wait_timeout(inner, left)
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// Copies the samples `indices` of `epoch` (batch `number`) into `out`, as
    /// [`Dataset::gather`] does: each row from the extents that hold it, the rest from
    /// the mapping. Returns `Ok(false)`, having copied nothing, where `locate` does not
    /// describe the gather or a file is not watched for changes: the caller then
    /// gathers through the dataset.
    ///
    /// # Errors
    /// [`Error::Dataset`] naming the file if it changed since it was opened, or for a
    /// row past its end; [`Error::Config`] if `out` does not match the columns.
    pub(crate) fn gather(
        &self,
        dataset: &dyn Dataset,
        epoch: u64,
        number: u64,
        indices: &[u64],
        out: &mut [&mut [u8]],
        scratch: &mut Scratch,
    ) -> Result<bool> {
        check_out(dataset.columns(), indices.len(), out)?;
        let files = dataset.files();
        let watched = files.iter().all(|f| f.watched().is_some());
        if files.len() != self.sources.len() || !watched {
            return Ok(false);
        }
        let Scratch { rows, pieces } = scratch;
        if !locate(dataset, files.len(), epoch, indices, rows) {
            return Ok(false);
        }
        self.wait_issued(number);
        self.cut(rows, pieces);
        pieces.sort_unstable_by_key(|p| (rows[p.row as usize].file, p.offset));
        let mut k = 0;
        while k < pieces.len() {
            let Some(extent) = pieces[k].extent.clone() else {
                copy_mapped(&files, rows, &pieces[k], out)?;
                k += 1;
                continue;
            };
            let mut end = k + 1;
            while pieces
                .get(end)
                .and_then(|p| p.extent.as_ref())
                .is_some_and(|e| Arc::ptr_eq(e, &extent))
            {
                end += 1;
            }
            let mut slot = lock(&extent.slot);
            self.fill(&extent, &mut slot);
            match &*slot {
                Slot::Ready(buf) => {
                    // SAFETY: `HostMemory` guarantees `len` initialised bytes at
                    // `as_ptr`, at least `wanted` of them (an extent's buffer is
                    // `EXTENT` bytes); the slot's lock, held, excludes the one writer
                    // (`fill`, under the same lock).
                    let bytes =
                        unsafe { std::slice::from_raw_parts(buf.as_ptr(), extent.wanted as usize) };
                    for p in &pieces[k..end] {
                        let from = (p.offset - extent.offset) as usize;
                        let src = &bytes[from..from + p.len as usize];
                        destination(rows, p, out).copy_from_slice(src);
                    }
                }
                Slot::Queued | Slot::Failed | Slot::Released => {
                    drop(slot);
                    for p in &pieces[k..end] {
                        copy_mapped(&files, rows, p, out)?;
                    }
                }
            }
            k = end;
        }
        pieces.clear();
        unchanged(&files)?;
        Ok(true)
    }

    /// Cuts each row into pieces that lie in one extent each, or in none.
    fn cut(&self, rows: &[Row], pieces: &mut Vec<Piece>) {
        pieces.clear();
        let inner = lock(&self.inner);
        for (r, row) in rows.iter().enumerate() {
            let held = &inner.held[row.file as usize];
            let (mut at, end) = (row.offset, row.offset + u64::from(row.len));
            while at < end {
                let (to, extent) = match held.range(..=at).next_back() {
                    Some((_, e)) if e.end() > at => (e.end().min(end), Some(Arc::clone(e))),
                    _ => {
                        let next = held.range(at + 1..).next().map_or(end, |(&o, _)| o);
                        (next.min(end), None)
                    }
                };
                pieces.push(Piece {
                    row: r as u32,
                    offset: at,
                    len: (to - at) as u32,
                    extent,
                });
                at = to;
            }
        }
    }
}

/// Reads `extent` from `source` into `buf` (at least `extent.len` bytes): whether all
/// the bytes the file holds of it came back.
fn read(source: &Source, extent: &Extent, buf: &dyn HostMemory) -> bool {
    let len = extent.len as usize;
    // `PlainAlloc` aligns to `BUFFER_ALIGN`, which `Source::open` checked covers the
    // file's direct-I/O alignment.
    debug_assert_eq!(buf.as_ptr() as u64 % source.align(), 0);
    if buf.len() < len {
        return false;
    }
    // SAFETY: `HostMemory` guarantees `len()` initialised bytes at `as_ptr`; the buffer
    // was just taken from the spare list or allocated, and is reachable from nowhere
    // else until `fill` puts it in the slot.
    let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), len) };
    let mut done = 0u64;
    while done < extent.wanted {
        match source
            .file()
            .read_at(&mut bytes[done as usize..], extent.offset + done)
        {
            Ok(0) => return false,
            Ok(n) => {
                done += n as u64;
                // A direct read cut short anywhere but at the file's end: it shrank.
                if done < extent.wanted && done % source.align() != 0 {
                    return false;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

/// The bytes of `out` that piece `p` of a row fills.
fn destination<'o>(rows: &[Row], p: &Piece, out: &'o mut [&mut [u8]]) -> &'o mut [u8] {
    let row = &rows[p.row as usize];
    let to = row.sample as usize * row.len as usize + (p.offset - row.offset) as usize;
    &mut out[row.column as usize][to..to + p.len as usize]
}

/// Copies piece `p` from its file's mapping, guarded against the file changing.
///
/// # Errors
/// [`Error::Dataset`] naming the file if it changed, or if the piece lies past its end.
fn copy_mapped(
    files: &[MappedFile<'_>],
    rows: &[Row],
    p: &Piece,
    out: &mut [&mut [u8]],
) -> Result<()> {
    let file = files[rows[p.row as usize].file as usize];
    let (at, len) = (p.offset as usize, p.len as usize);
    let Some(src) = file.bytes().get(at..at + len) else {
        return Err(Error::dataset(
            file.path(),
            format!("{len} bytes at offset {at} run past its end"),
        ));
    };
    let dst = destination(rows, p, out);
    match file.watched() {
        Some(w) => w.read(src, |src| dst.copy_from_slice(src)),
        None => {
            dst.copy_from_slice(src);
            Ok(())
        }
    }
}

/// Part of a row that lies in one extent, or in none.
struct Piece {
    /// The row, in the worker's list.
    row: u32,
    offset: u64,
    len: u32,
    extent: Option<Arc<Extent>>,
}

/// A worker's lists, kept from batch to batch.
#[derive(Default)]
pub(crate) struct Scratch {
    rows: Vec<Row>,
    pieces: Vec<Piece>,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch").finish_non_exhaustive()
    }
}

/// No extent holds the page.
const NONE: u32 = u32::MAX;

/// The planner's side of one windowed file: which extent holds each page, and how many
/// of each extent's pages planned rows still need.
pub(crate) struct Window {
    store: Arc<Extents>,
    file: usize,
    /// Per page, its extent's index in `held`, or [`NONE`].
    owner: Vec<u32>,
    held: Vec<Held>,
    /// Indices of `held` free for reuse.
    vacant: Vec<u32>,
}

/// A live extent and the pages it holds.
struct Held {
    extent: Option<Arc<Extent>>,
    first: usize,
    end: usize,
    /// Its pages that planned rows still need.
    live: u32,
}

impl Window {
    /// File `file` of `store`, of `pages` pages, no extent yet.
    pub(crate) fn new(store: Arc<Extents>, file: usize, pages: usize) -> Window {
        Window {
            store,
            file,
            owner: vec![NONE; pages],
            held: Vec::new(),
            vacant: Vec::new(),
        }
    }

    /// Page `k` is wanted again: if an extent holds it, that extent is kept for it.
    pub(crate) fn want(&mut self, k: usize) {
        if let Some(&id) = self.owner.get(k).filter(|&&id| id != NONE) {
            self.held[id as usize].live += 1;
        }
    }

    /// No planned row needs page `k` any more: an extent none of whose pages is needed
    /// is released.
    pub(crate) fn unwant(&mut self, k: usize) {
        let Some(&id) = self.owner.get(k).filter(|&&id| id != NONE) else {
            return;
        };
        let held = &mut self.held[id as usize];
        held.live = held.live.saturating_sub(1);
        if held.live > 0 {
            return;
        }
        let (first, end) = (held.first, held.end);
        if let Some(extent) = held.extent.take() {
            self.store.release(&extent);
        }
        self.owner[first..end].iter_mut().for_each(|o| *o = NONE);
        self.vacant.push(id);
    }

    /// Reads pages `first..end` of the file (of `file_len` bytes, pages of `page`
    /// bytes) that no extent holds yet and that are not `cached` (resident as the epoch
    /// started: their rows are copied from the mapping): each run of them that has a
    /// page `wanted` says a planned row needs becomes an extent, queued, with the wanted
    /// pages around it that are not held or cached either (later batches' rows of the
    /// same blocks), up to [`EXTENT`] bytes.
    pub(crate) fn read(
        &mut self,
        (first, end): (usize, usize),
        wanted: impl Fn(usize) -> bool,
        cached: impl Fn(usize) -> bool,
        page: usize,
        file_len: u64,
    ) {
        let end = end.min(self.owner.len());
        let most = (EXTENT / page).max(1);
        let mut k = first;
        let free = |owner: &[u32], k: usize| owner[k] == NONE && !cached(k);
        while k < end {
            if !free(&self.owner, k) {
                k += 1;
                continue;
            }
            // On over the run and the wanted pages after it, then back over those
            // before it, up to an extent in all.
            let mut start = k;
            while k < self.owner.len()
                && free(&self.owner, k)
                && k - start < most
                && (k < end || wanted(k))
            {
                k += 1;
            }
            while start > 0 && k - start < most && free(&self.owner, start - 1) && wanted(start - 1)
            {
                start -= 1;
            }
            let live = (start..k).filter(|&p| wanted(p)).count() as u32;
            let offset = (start * page) as u64;
            if live == 0 || offset >= file_len {
                continue;
            }
            let len = ((k - start) * page) as u64;
            let extent = self
                .store
                .push(self.file, offset, len, len.min(file_len - offset));
            let held = Held {
                extent: Some(extent),
                first: start,
                end: k,
                live,
            };
            let id = match self.vacant.pop() {
                Some(id) => {
                    self.held[id as usize] = held;
                    id
                }
                None => {
                    self.held.push(held);
                    (self.held.len() - 1) as u32
                }
            };
            self.owner[start..k].iter_mut().for_each(|o| *o = id);
        }
    }
}

/// Closes `store` when dropped (the planner leaving the epoch, or unwinding).
pub(crate) struct Closing<'a>(pub(crate) &'a Extents);

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Releases every extent of `store` when dropped (the planner done with the epoch, or
/// unwinding from a panic in a dataset's code), once no reader is left to fill one.
pub(crate) struct Clearing<'a>(pub(crate) &'a Extents);

impl Drop for Clearing<'_> {
    fn drop(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::{DType, NpyDataset};
    use crate::gen::NpyWriter;
    use crate::util::page_size;

    /// Rows of 1,000 bytes (so that rows straddle pages), each byte telling its row.
    const WIDTH: usize = 1000;

    fn dataset(rows: u64) -> (tempfile::TempDir, NpyDataset) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.npy");
        let mut w = NpyWriter::create(&path, DType::U8, &[rows, WIDTH as u64]).unwrap();
        for (k, b) in w.data_mut().iter_mut().enumerate() {
            *b = ((k / WIDTH) as u8).wrapping_mul(31) ^ (k % WIDTH) as u8;
        }
        w.finish().unwrap();
        (dir, NpyDataset::open(&path).unwrap())
    }

    /// The extents of the dataset's one file, read through the page cache (the logic is
    /// the same as with `O_DIRECT`, which tmpfs would refuse), and its planner's window.
    fn window(ds: &NpyDataset) -> (Arc<Extents>, Window) {
        let file = ds.files()[0];
        let source = Source::open(file, false).unwrap();
        let store = Arc::new(Extents::new(vec![Some(source)]));
        let pages = file.bytes().len().div_ceil(page_size());
        let w = Window::new(Arc::clone(&store), 0, pages);
        (store, w)
    }

    /// Batch `indices` through the extents, against the dataset's own gather.
    fn check(ds: &NpyDataset, store: &Extents, indices: &[u64]) {
        let mut want = vec![0u8; indices.len() * WIDTH];
        ds.gather(0, indices, &mut [&mut want[..]]).unwrap();
        let mut got = vec![0u8; indices.len() * WIDTH];
        let mut scratch = Scratch::default();
        let done = store
            .gather(ds, 0, 0, indices, &mut [&mut got[..]], &mut scratch)
            .unwrap();
        assert!(done);
        assert!(got == want, "the rows differ");
    }

    fn len(ds: &NpyDataset) -> u64 {
        ds.files()[0].bytes().len() as u64
    }

    fn held(store: &Extents) -> usize {
        lock(&store.inner).held[0].len()
    }

    #[test]
    fn rows_come_the_same_from_extents_a_reader_or_the_mapping() {
        let (_dir, ds) = dataset(2000);
        let (store, mut w) = window(&ds);
        let page = page_size();
        // Two runs with a gap of two pages between them: rows across their edges come
        // partly from an extent and partly from the mapping.
        let wanted = |k: usize| (2..10).contains(&k) || (12..20).contains(&k);
        w.read((2, 10), wanted, |_| false, page, len(&ds));
        w.read((12, 20), wanted, |_| false, page, len(&ds));
        assert_eq!(held(&store), 2);
        assert_eq!(store.unread(), (16 * page) as u64);
        store.issued(u64::MAX);
        // No reader: the worker reads the extents it reaches.
        let indices: Vec<u64> = (0..2000).rev().step_by(3).chain(0..100).collect();
        check(&ds, &store, &indices);
        assert_eq!(store.unread(), 0);
        // With a reader thread.
        let wanted = |k: usize| (30..60).contains(&k);
        w.read((30, 60), wanted, |_| false, page, len(&ds));
        std::thread::scope(|s| {
            let planner = std::thread::current();
            let store = &store;
            let reader = s.spawn(move || store.serve(&planner));
            check(&ds, store, &(100..300).collect::<Vec<_>>());
            store.close();
            reader.join().unwrap();
        });
        assert_eq!(store.unread(), 0);
    }

    #[test]
    fn an_extent_lives_while_a_page_of_it_is_wanted() {
        let (_dir, ds) = dataset(2000);
        let (store, mut w) = window(&ds);
        let page = page_size();
        w.read((0, 4), |k| k < 4, |_| false, page, len(&ds));
        assert_eq!(held(&store), 1);
        w.unwant(0);
        w.unwant(2);
        w.want(2);
        w.unwant(3);
        w.unwant(1);
        assert_eq!(held(&store), 1, "page 2 is still wanted");
        // Pages an extent holds are not read again.
        w.read((0, 4), |k| k == 2, |_| false, page, len(&ds));
        assert_eq!((held(&store), store.unread()), (1, (4 * page) as u64));
        w.unwant(2);
        assert_eq!(held(&store), 0);
        assert_eq!(store.unread(), 0, "released before it was read");
        assert!(w.owner.iter().all(|&o| o == NONE));
        // Released, its pages come from the mapping.
        store.issued(u64::MAX);
        check(&ds, &store, &[0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_read_takes_in_the_wanted_pages_around_it_up_to_an_extent() {
        let (_dir, ds) = dataset(2000);
        let (store, mut w) = window(&ds);
        let page = page_size();
        // Later batches want pages 0..10: asked for 4..6, all ten are read as one.
        w.read((4, 6), |k| k < 10, |_| false, page, len(&ds));
        let extents: Vec<(u64, u64)> = lock(&store.inner).held[0]
            .values()
            .map(|e| (e.offset, e.len))
            .collect();
        assert_eq!(extents, [(0, (10 * page) as u64)]);
        // A page resident as the epoch started is not read again: its rows come from
        // the mapping, and the extents stop at it.
        let later = |k: usize| (20..30).contains(&k);
        w.read((20, 30), later, |k| k == 24, page, len(&ds));
        let extents: Vec<(u64, u64)> = lock(&store.inner).held[0]
            .range((20 * page) as u64..)
            .map(|(_, e)| (e.offset / page as u64, e.len / page as u64))
            .collect();
        assert_eq!(extents, [(20, 4), (25, 5)]);
        // Every page wanted: one extent of at most EXTENT bytes around the ask.
        let pages = w.owner.len();
        assert!(pages * page > EXTENT + 20 * page);
        w.read((pages - 3, pages - 2), |_| true, |_| false, page, len(&ds));
        let last = lock(&store.inner).held[0]
            .values()
            .last()
            .map(|e| (e.offset, e.len, e.wanted));
        let (offset, bytes, wanted) = last.unwrap();
        assert_eq!(bytes, EXTENT as u64);
        assert_eq!(offset + bytes, (pages * page) as u64);
        assert_eq!(offset + wanted, len(&ds), "the file's end is not a page's");
        store.issued(u64::MAX);
        check(&ds, &store, &(0..2000).collect::<Vec<_>>());
    }

    #[test]
    fn a_file_that_shrank_under_its_extents_is_an_error_naming_it() {
        let (dir, ds) = dataset(2000);
        let (store, mut w) = window(&ds);
        w.read((0, 100), |_| true, |_| false, page_size(), len(&ds));
        store.issued(u64::MAX);
        let path = dir.path().join("x.npy");
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(4096).unwrap();
        let mut out = vec![0u8; 10 * WIDTH];
        let indices: Vec<u64> = (100..110).collect();
        let err = store
            .gather(
                &ds,
                0,
                0,
                &indices,
                &mut [&mut out[..]],
                &mut Scratch::default(),
            )
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("x.npy") && msg.contains("changed"), "{msg}");
    }
}
