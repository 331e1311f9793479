//! Planned storage reads: the loader knows every row it will gather, batches ahead, so
//! it reads what it needs, the way storage does it best, instead of leaving reads to
//! page faults and the kernel's read-around.
//!
//! As an epoch starts, the files' residency (`mincore`) and the page-cache budget decide
//! each file's [`Mode`]: the smallest files are kept while they fit under the budget
//! together, the others are streamed. The epoch is then:
//!
//! - **warm**: every page resident; nothing to do.
//! - **warming**: every file is kept. One planner thread per loader reads the files
//!   that are not resident sequentially, in the larger requests the device takes
//!   (`madvise(MADV_WILLNEED)`), so epoch 0 costs about one sequential read of them.
//! - **streaming**: some file exceeds the budget. Where its rows are [`scattered`] (a
//!   full shuffle, random token windows), the workers read each batch's rows straight
//!   from storage ([`direct`](super::direct), nothing left in the page cache).
//!   Otherwise (a block shuffle's windows) the planner plans the pages of the next
//!   batches, with the gaps between them, so that a window's blocks are read in long
//!   runs: into the loader's own buffers with `O_DIRECT` ([`extents`](super::extents)),
//!   or, where direct I/O is refused, through the page cache; pages are dropped once
//!   gathered unless a planned row still needs them, so the page cache the loader fills
//!   stays near the planned window. These reads go to storage in the order the batches
//!   need them, a few requests at a time ([`Queue`]): the block layer serves what it
//!   holds in the order of the sectors.
//!
//! The mappings of the files the planner reads are set to `MADV_RANDOM`: a fault on a
//! page not read yet then reads that page, not a window of `read_ahead_kb`. The plan is
//! advice: the gathers read the same bytes whatever it did.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Receiver;

use super::extents::{Clearing, Closing, Extents, Window, READERS};
use super::worker::{Assignment, Job};
use crate::dataset::{Dataset, MappedFile, Opened};
use crate::pagecache::{
    advise_normal, advise_random, drop_range, page_cached, residency_known, resident_pages,
    resident_range, will_need, will_need_piece, WILL_NEED_PIECE,
};
use crate::sampler::{EpochOrder, Shuffle};
use crate::util::page_size;

/// What storage did for an epoch's data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    /// Every page was resident when the epoch started (or nothing was planned).
    #[default]
    Warm,
    /// The files fit under the page-cache budget and were read in during the epoch.
    Warming,
    /// The files exceed the budget: planned rows were read and dropped behind.
    Streaming,
}

impl Storage {
    /// The name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Storage::Warm => "warm",
            Storage::Warming => "warming",
            Storage::Streaming => "streaming",
        }
    }
}

/// What the planner does for one file in an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Every page was resident as the epoch started: nothing.
    Resident,
    /// Kept under the budget: the next batches' rows are asked for, and the rest of the
    /// file is warmed sequentially.
    Keep,
    /// Over the budget, through the page cache: the next batches' rows are asked for,
    /// and dropped once gathered unless a planned row still needs them.
    Stream,
    /// Over the budget, read by the workers straight from storage (see
    /// [`direct`](super::direct)): nothing for the planner.
    Direct,
    /// Over the budget, the next batches' rows read as [`Stream`](Mode::Stream) plans
    /// them, but into the loader's own buffers, with `O_DIRECT` (see
    /// [`extents`](super::extents)): a block shuffle's windows.
    Window,
}

/// One file's plan for an epoch: its mode and its residency as the epoch started (one
/// byte per page, bit 0 set where resident; none where the kernel does not tell).
#[derive(Debug, Clone)]
pub(crate) struct FilePlan {
    pub(crate) mode: Mode,
    pub(crate) pages: Vec<u8>,
    /// Whether `mincore` tells this process the truth about the file's pages
    /// ([`residency_known`]), asked once as the epoch starts.
    pub(crate) known: bool,
}

/// The residency of every file of `dataset` as an epoch starts, and what storage will
/// do for each under `budget`: the smallest files are kept while they fit under it
/// together (labels stay in memory while images stream), the others are streamed.
/// Taken where the epoch starts, so that the epoch's report does not depend on how far
/// the planner's thread has got; the planner then starts from these pages.
pub(crate) fn snapshot(dataset: &dyn Dataset, budget: u64) -> (Storage, Vec<FilePlan>) {
    let files = dataset.files();
    // A file whose residency the kernel does not tell, or whose `mincore` fails, is
    // planned as cold: its reads are the planner's, which checks each page it would ask
    // for without waiting (`Pages::cached`).
    let pages: Vec<(Vec<u8>, bool)> = files
        .iter()
        .map(|&f| {
            let known = residency_known(f).then(|| resident_pages(f).ok()).flatten();
            match known {
                Some(p) => (p, true),
                None => (vec![0; f.bytes().len().div_ceil(page_size())], false),
            }
        })
        .collect();
    let mut by_size: Vec<usize> = (0..files.len()).collect();
    by_size.sort_by_key(|&f| files[f].bytes().len());
    let mut plans: Vec<FilePlan> = pages
        .into_iter()
        .map(|(pages, known)| FilePlan {
            mode: Mode::Resident,
            pages,
            known,
        })
        .collect();
    let mut kept = 0u64;
    for f in by_size {
        let plan = &mut plans[f];
        let len = files[f].bytes().len() as u64;
        if plan.pages.iter().all(|&b| b & 1 != 0) {
            kept = kept.saturating_add(len);
        } else if kept.saturating_add(len) <= budget {
            plan.mode = Mode::Keep;
            kept += len;
        } else {
            plan.mode = Mode::Stream;
        }
    }
    let storage = if plans.iter().any(|p| p.mode == Mode::Stream) {
        Storage::Streaming
    } else if plans.iter().any(|p| p.mode == Mode::Keep) {
        Storage::Warming
    } else {
        Storage::Warm
    };
    (storage, plans)
}

/// Sequential warming: bytes that may be asked for and not yet resident, in requests of
/// the file's read-ahead piece ([`will_need_piece`]).
const WARMING: usize = 64 << 20;

/// The widest gap between two planned rows that is read with them when rows are not
/// [`scattered`]: about a block of a block shuffle.
const GAP: usize = 1 << 20;

/// Batches, and rows at most (one batch more), whose layout [`scattered`] looks at.
const SAMPLE: (u64, usize) = (64, 1 << 14);

/// Whether the rows of `order`'s batches from `first` on are scattered over the files
/// `streamed` marks, and best read one by one (straight from storage, each in its
/// sectors), rather than in runs of the pages around them (extents, or the page cache).
/// Judged on the next [`SAMPLE`] batches: their rows' pages, merged where at most
/// [`GAP`] apart, make runs shorter than 32 pages on average, or runs more than twice
/// the pages the rows need. A full (or grouped) shuffle always is; a block shuffle's windows, or
/// file order, are not; random token windows in file order are. A block shuffle with
/// about one row per block in each batch (default 1 MiB blocks, window 16, batches of
/// about 16 rows or fewer) is too: its planned runs would come a row at a time anyway.
pub(crate) fn scattered(
    dataset: &dyn Dataset,
    order: &EpochOrder,
    first: u64,
    streamed: &[bool],
) -> bool {
    if matches!(
        order.shuffle(),
        Shuffle::Full { .. } | Shuffle::Grouped { .. }
    ) {
        return true;
    }
    let page = page_size();
    // Each row's pages, `(file, first, end)`: one entry a row, whatever its length.
    let (mut idx, mut rows) = (Vec::new(), Vec::new());
    let last = first.saturating_add(SAMPLE.0).min(order.batches());
    for b in first..last {
        if rows.len() >= SAMPLE.1 {
            break;
        }
        order.batch(b, &mut idx);
        for &i in &idx {
            dataset.locate(order.epoch(), i, &mut |f, off, len| {
                if len > 0 && streamed.get(f) == Some(&true) {
                    rows.push((f, off / page, (off + len).div_ceil(page)));
                }
            });
        }
    }
    let pages = |runs: &[(usize, usize, usize)]| runs.iter().map(|r| r.2 - r.1).sum::<usize>();
    // The pages the rows need, then the runs they make with gaps of up to `GAP` filled.
    merge(&mut rows, 0);
    let needed = pages(&rows);
    merge(&mut rows, GAP / page);
    let (runs, spanned) = (rows.len(), pages(&rows));
    runs > 0 && (spanned < 32 * runs || spanned > 2 * needed)
}

/// Sorts `runs` (`(file, first page, end page)`) and merges, in place, those of one
/// file at most `gap` pages apart (overlapping or touching, for 0).
fn merge(runs: &mut Vec<(usize, usize, usize)>, gap: usize) {
    runs.sort_unstable();
    let mut merged = 0;
    for k in 0..runs.len() {
        let r = runs[k];
        if merged > 0 && runs[merged - 1].0 == r.0 && runs[merged - 1].2 + gap >= r.1 {
            runs[merged - 1].2 = runs[merged - 1].2.max(r.2);
        } else {
            runs[merged] = r;
            merged += 1;
        }
    }
    runs.truncate(merged);
}

/// Starts the planner: it serves jobs until its channel closes.
/// `ahead` is how many batches are planned beyond the last one a worker claimed.
pub(crate) fn spawn(ahead: u64, jobs: Receiver<Assignment>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("stokehold-planner".into())
        .spawn(move || {
            for (job, done) in jobs {
                // A panic leaves this epoch unplanned (the plan is advice), not the
                // epochs after it.
                let _ = catch_unwind(AssertUnwindSafe(|| plan_epoch(&job, ahead)));
                drop(job);
                drop(done);
            }
        })
}

/// One file's pages: bit 0 of `state` ([`WANTED`]) resident or asked for, bit 1
/// ([`ISSUED`]) asked for from storage since it was last dropped; `refs` counts the
/// planned rows that still need each page ([`Mode::Stream`] and [`Mode::Window`]).
struct Pages<'a> {
    file: MappedFile<'a>,
    mode: Mode,
    state: Vec<u8>,
    refs: Vec<u16>,
    /// The file, open: for its device's read-ahead piece, and to drop pages (the
    /// dataset's own descriptor where it has one: no descriptor more per file).
    fd: Option<Opened<'a>>,
    /// Whether `mincore` tells this process the truth about its pages
    /// ([`residency_known`]): else a page is asked after with a read that may not wait.
    known: bool,
    /// Bytes per read-ahead request ([`will_need_piece`]).
    piece: usize,
    /// The extents its pages are read into ([`Mode::Window`] only).
    window: Option<Window>,
}

impl Pages<'_> {
    /// Whether the page at `offset` is in the page cache: by `mincore` where the kernel
    /// tells this process, else by a one-byte read that may not wait ([`page_cached`]).
    /// One that cannot be checked counts as there: the plan is only advice.
    fn cached(&self, offset: usize) -> bool {
        if self.known {
            let page = page_size();
            return resident_range(self.file, offset, page).map_or(true, |v| v[0] & 1 != 0);
        }
        let fd = self.fd.as_deref();
        fd.and_then(|fd| page_cached(fd, offset as u64))
            .unwrap_or(true)
    }

    /// Whether planned rows are counted per page, and pages dropped behind them.
    fn streamed(&self) -> bool {
        matches!(self.mode, Mode::Stream | Mode::Window)
    }

    /// Marks page `k` wanted; false if it was already.
    fn want(&mut self, k: usize) -> bool {
        if self.state[k] & WANTED != 0 {
            return false;
        }
        self.state[k] |= WANTED;
        if let Some(w) = &mut self.window {
            w.want(k);
        }
        true
    }

    /// Page `k` is no longer wanted (nor issued): it may be dropped.
    fn unwant(&mut self, k: usize) {
        self.state[k] &= !(WANTED | ISSUED | CACHED);
        if let Some(w) = &mut self.window {
            w.unwant(k);
        }
    }
}

/// Bit of [`Pages::state`]: the page is resident or asked for.
const WANTED: u8 = 1;
/// Bit of [`Pages::state`]: the page was asked for from storage ([`Queue::issue`]) and
/// has not been dropped since.
const ISSUED: u8 = 2;
/// Bit of [`Pages::state`], in a windowed file: the page was resident as the epoch
/// started and has not been dropped since. Its rows are copied from the mapping; it is
/// not read into an extent.
const CACHED: u8 = 4;

/// The pages of one batch's rows, merged: `(file, first page, end page)`.
fn batch_pages(
    job: &Job,
    b: u64,
    (page, files): (usize, usize),
    idx: &mut Vec<u64>,
    runs: &mut Vec<(usize, usize, usize)>,
) {
    runs.clear();
    job.order.batch(b, idx);
    let epoch = job.order.epoch();
    for &i in idx.iter() {
        job.dataset.locate(epoch, i, &mut |f, off, len| {
            // A range in a file past those listed (`Concat` locates its parts' unlisted
            // files so) is the mapping's to read: nothing to plan.
            if len > 0 && f < files {
                runs.push((f, off / page, (off + len).div_ceil(page)));
            }
        });
    }
    merge(runs, 0);
}

/// Files whose mappings a plan turned read-around off in ([`advise_random`]), turned
/// back on when it ends: a later epoch with no plan (all resident, or a loader built
/// without planned reads over the same files) must not fault one page at a time.
struct Advised<'a>(Vec<MappedFile<'a>>);

impl Drop for Advised<'_> {
    fn drop(&mut self) {
        for &f in &self.0 {
            advise_normal(f);
        }
    }
}

/// Plans `job`, with the threads that read its extents when it has windowed files.
fn plan_epoch(job: &Job, ahead: u64) {
    let Some(extents) = &job.extents else {
        return plan_files(job, ahead, None);
    };
    let alive = &std::sync::atomic::AtomicUsize::new(READERS);
    // Dropped after the scope has waited for the readers, even when a dataset's
    // `locate` panics in `plan_files`: the extents' buffers go then, not with the epoch.
    let _clearing = Clearing(extents);
    std::thread::scope(|s| {
        // Closed before the scope waits for the readers, even when unwinding.
        let _closing = Closing(extents);
        let mut readers = 0;
        for k in 0..READERS {
            // A reader that cannot start, or that panics, leaves its reads to the
            // workers (and does not take the planner down with it); once none is
            // left, no worker waits for the planner to queue extents.
            let planner = std::thread::current();
            let serve = move || {
                let _ = catch_unwind(AssertUnwindSafe(|| extents.serve(&planner)));
                if alive.fetch_sub(1, Ordering::AcqRel) == 1 {
                    extents.close();
                }
            };
            let spawned = std::thread::Builder::new()
                .name(format!("stokehold-read-{k}"))
                .spawn_scoped(s, serve);
            readers += usize::from(spawned.is_ok());
        }
        // Readers that did not start count as gone: with none, the extents are read
        // by the workers that reach them, and none waits for the planner to queue them.
        let failed = READERS - readers;
        if failed > 0 && alive.fetch_sub(failed, Ordering::AcqRel) == failed {
            extents.close();
        }
        plan_files(job, ahead, Some(extents));
    });
}

fn plan_files(job: &Job, ahead: u64, extents: Option<&Arc<Extents>>) {
    let plans = std::mem::take(&mut *job.plans.lock().unwrap_or_else(|e| e.into_inner()));
    let files = job.dataset.files();
    if plans.len() != files.len() {
        return;
    }
    let page = page_size();
    let mut pages: Vec<Pages<'_>> = files
        .into_iter()
        .zip(plans)
        .map(|(file, plan)| Pages {
            file,
            mode: plan.mode,
            state: plan.pages,
            refs: Vec::new(),
            fd: None,
            known: plan.known,
            piece: 0,
            window: None,
        })
        .collect();
    let (mut keep, mut stream) = (false, false);
    // The kernel's read-around comes back when the plan ends, by return or panic.
    let mut advised = Advised(Vec::new());
    for (f, p) in pages.iter_mut().enumerate() {
        match p.mode {
            Mode::Keep => keep = true,
            Mode::Stream | Mode::Window => {
                stream = true;
                p.refs = vec![0; p.state.len()];
                p.window = extents
                    .filter(|x| p.mode == Mode::Window && x.windowed(f))
                    .map(|x| Window::new(Arc::clone(x), f, p.state.len()));
                match p.window {
                    // Resident pages are not wanted until a planned row needs them, so
                    // that each extent counts only the pages rows need.
                    Some(_) => p.state.iter_mut().for_each(|b| {
                        if *b & WANTED != 0 {
                            *b = CACHED;
                        }
                    }),
                    None => p.mode = Mode::Stream,
                }
            }
            // Nothing to plan: their page map (a byte a page, 256 MiB for a 1 TB file)
            // is not kept through the epoch.
            Mode::Resident | Mode::Direct => {
                p.state = Vec::new();
                continue;
            }
        }
        p.fd = p.file.opened().ok();
        p.piece = p.fd.as_deref().map_or(WILL_NEED_PIECE, will_need_piece);
        advise_random(p.file);
        advised.0.push(p.file);
    }
    if !keep && !stream {
        return;
    }
    let (mut idx, mut runs, mut wanted) = (Vec::new(), Vec::new(), Vec::new());
    let mut queue = Queue::default();
    // Pages asked for between rows, with the batch they were asked with.
    let mut gaps: std::collections::VecDeque<(u64, Vec<(usize, usize)>)> = Default::default();
    // A block shuffle's window uses every row of its blocks within a few batches, so
    // the pages between two planned rows are asked for with them (up to a block of
    // about 1 MiB): the window's blocks are read in long runs from its first batch on,
    // not page by page as its batches come up. Scattered rows are far apart.
    let gap = match job.scattered {
        true => 0,
        false => GAP / page,
    };
    // From the epoch's (or the resume's) first batch, whatever the workers have claimed
    // already: those batches' rows are still being read, and without a plan each fault
    // would read one page (the mapping reads at random).
    let first = job.delivered.load(Ordering::Acquire).min(job.end);
    let (mut planned, mut dropped) = (first, first);
    // Sequential warming: the next chunk to ask for, and those asked for, oldest first.
    let (mut cursor, mut asked) = ((0usize, 0usize), std::collections::VecDeque::new());
    loop {
        if job.cancelled.load(Ordering::Acquire) {
            return;
        }
        let claimed = job.next.load(Ordering::Relaxed).min(job.end);
        let target = claimed.saturating_add(ahead).min(job.end);
        // The pages of each batch planned now, in the order the batches are needed:
        // the storage serves asks roughly in the order they come, so the blocks of the
        // next batch's window come first. (Merged and sorted across all the batches
        // planned at once, as the epoch starts or after a run of batches served from
        // pages already read, the next batch waited behind the reads of the whole
        // planned window: 78 MB before the first batch of a block-shuffled epoch.) Pages
        // an earlier batch asked for are not asked again, so a block shuffle's window is
        // still read in long runs, with its first batch.
        while planned < target {
            batch_pages(job, planned, (page, pages.len()), &mut idx, &mut runs);
            for &(f, start, end) in &runs {
                ask(&mut pages[f], f, start, end, &mut wanted);
            }
            let mut filled = Vec::new();
            ask_runs(
                &mut pages,
                &mut wanted,
                gap,
                &mut filled,
                &mut queue,
                planned,
            );
            if !filled.is_empty() {
                gaps.push_back((planned, filled));
            }
            planned += 1;
        }
        queue.issue(&mut pages, page, extents.map(|x| &**x));
        if let Some(x) = extents {
            x.issued(queue.frontier(planned));
        }
        if stream {
            let delivered = job.delivered.load(Ordering::Acquire).min(planned);
            while dropped < delivered {
                batch_pages(job, dropped, (page, pages.len()), &mut idx, &mut runs);
                for &(f, start, end) in &runs {
                    release(&mut pages[f], f, start, end, &mut wanted);
                }
                // Pages read between rows, released with the batch they were asked with.
                while gaps.front().is_some_and(|&(b, _)| b <= dropped) {
                    let (_, filled) = gaps.pop_front().expect("just seen");
                    for (f, k) in filled {
                        release(&mut pages[f], f, k, k + 1, &mut wanted);
                    }
                }
                dropped += 1;
            }
            drop_runs(&pages, &mut wanted, page);
        }
        if keep {
            warm(&mut pages, &mut cursor, &mut asked, page);
        }
        let done = planned >= job.end
            && (!stream || dropped >= job.end)
            && (!keep || cursor.0 >= pages.len());
        if done {
            return;
        }
        std::thread::park_timeout(Duration::from_millis(1));
    }
}

/// Marks the pages `start..end` of a streamed file `f` that are neither resident nor
/// asked for as asked for, adding them to `wanted`, and counts the row's need for each.
fn ask(p: &mut Pages<'_>, f: usize, start: usize, end: usize, wanted: &mut Vec<(usize, usize)>) {
    let end = end.min(p.state.len());
    let start = start.min(end);
    match p.mode {
        Mode::Stream | Mode::Window => p.refs[start..end]
            .iter_mut()
            .for_each(|r| *r = r.saturating_add(1)),
        // A kept file is read whole and in order by `warm`: asking for rows at random
        // as well only splits the disk's time between two streams (measured: a cold
        // full-shuffle epoch of a 616 MB set took 1.0 to 1.4 s with row asks, 0.6 to
        // 0.7 s without).
        Mode::Keep | Mode::Resident | Mode::Direct => return,
    }
    for k in start..end {
        if p.want(k) && p.state[k] & CACHED == 0 {
            wanted.push((f, k));
        }
    }
}

/// Queues the pages in `wanted` (`(file, page)`) to be asked for ([`Queue`]) for batch
/// `batch`, in runs of pages at most `gap` apart (the pages between them included),
/// and empties it. The pages between that no row asked for are counted as needed, in a
/// streamed file, and added to `filled`, to be released with the batch being planned.
fn ask_runs(
    pages: &mut [Pages<'_>],
    wanted: &mut Vec<(usize, usize)>,
    gap: usize,
    filled: &mut Vec<(usize, usize)>,
    queue: &mut Queue,
    batch: u64,
) {
    for (f, first, end) in runs_of(wanted, gap) {
        let p = &mut pages[f];
        for k in first..end {
            // A page resident as the epoch started that no row asked for stays as it
            // was: not read, and not dropped with this batch.
            if p.state[k] & (CACHED | WANTED) == CACHED {
                continue;
            }
            if p.want(k) && p.streamed() {
                p.refs[k] = p.refs[k].saturating_add(1);
                filled.push((f, k));
            }
        }
        queue.pending.push_back((batch, f, first, end));
    }
    wanted.clear();
}

/// Streamed reads, in the order the batches need them, with at most [`STREAMING`] bytes
/// asked for and not yet read at once.
///
/// The block layer's scheduler (`mq-deadline`, the default for virtio and SATA disks)
/// serves what it holds in the order of the sectors, not of the asks: with the whole
/// planned window asked for at once, the next batch's blocks, scattered over the file,
/// came last. Kept to a few requests, the device still has a queue, and what it holds
/// is what the next batches need.
///
/// A windowed file's runs become extents ([`Window::read`]) under the same bound, on
/// the bytes its extents' readers have yet to read: kept pending until then, a run is
/// read with the pages later batches want next to it (a block asked for by several
/// batches of its window is read in one piece, not in as many as batches asked).
#[derive(Default)]
struct Queue {
    /// Runs of pages to ask for: `(batch, file, first, end)`, in the order of batches.
    pending: std::collections::VecDeque<(u64, usize, usize, usize)>,
    /// Runs asked for and not yet seen read: `(file, last page, bytes)`.
    asked: std::collections::VecDeque<(usize, usize, usize)>,
    /// Bytes in `asked`.
    in_flight: usize,
}

/// Streamed bytes asked for and not yet read, at most (a few of the device's largest
/// requests).
const STREAMING: usize = 16 << 20;

impl Queue {
    /// Forgets the asks that have been read (or whose pages were dropped since), then
    /// asks for pending runs while fewer than [`STREAMING`] bytes are in flight (or, for
    /// windowed files, not yet read into `extents`).
    fn issue(&mut self, pages: &mut [Pages<'_>], page: usize, extents: Option<&Extents>) {
        while let Some(&(f, last, bytes)) = self.asked.front() {
            let p = &pages[f];
            // A page dropped since (its rows gathered, maybe asked for again and not
            // yet issued) is done with; one that cannot be checked counts as read: the
            // plan is only advice.
            let read = p.state[last] & ISSUED == 0 || p.cached(last * page);
            if !read {
                break;
            }
            self.asked.pop_front();
            self.in_flight -= bytes;
        }
        while let Some(&(_, f, first, end)) = self.pending.front() {
            let p = &mut pages[f];
            let full = match (&p.window, extents) {
                (Some(_), Some(x)) => x.unread() >= STREAMING as u64,
                _ => self.in_flight >= STREAMING,
            };
            if full {
                return;
            }
            self.pending.pop_front();
            // Pages dropped before their turn came (their rows were gathered from
            // faults) are not read again.
            let wanted = |k: usize| p.state[k] & WANTED != 0;
            let Some(last) = (first..end).rev().find(|&k| wanted(k)) else {
                continue;
            };
            let first = (first..=last).find(|&k| wanted(k)).unwrap_or(first);
            // Extent reads that keep failing: the rest of the file goes through the
            // page cache.
            if extents.is_some_and(Extents::failing) {
                p.window = None;
                p.mode = Mode::Stream;
            }
            if let Some(w) = &mut p.window {
                let state = &p.state;
                let len = p.file.bytes().len() as u64;
                let wanted = |k: usize| state[k] & (WANTED | CACHED) == WANTED;
                let cached = |k: usize| state[k] & CACHED != 0;
                w.read((first, last + 1), wanted, cached, page, len);
                continue;
            }
            // Only the pages still wanted, in runs: one between them was released (its
            // rows gathered from faults while the run waited), and read again it would
            // stay cached, past the budget, with nothing left to drop it.
            let mut k = first;
            while k <= last {
                if p.state[k] & WANTED == 0 {
                    k += 1;
                    continue;
                }
                let start = k;
                while k <= last && p.state[k] & WANTED != 0 {
                    p.state[k] |= ISSUED;
                    k += 1;
                }
                let bytes = (k - start) * page;
                will_need(p.file, start * page, bytes, p.piece);
                self.asked.push_back((f, k - 1, bytes));
                self.in_flight += bytes;
            }
        }
    }

    /// The first batch some of whose runs are still pending: every batch before it,
    /// up to `planned`, has been asked for.
    fn frontier(&self, planned: u64) -> u64 {
        self.pending.front().map_or(planned, |r| r.0)
    }
}

/// A gathered row no longer needs pages `start..end` of file `f`: those no planned row
/// needs are added to `free` ([`Mode::Stream`] and [`Mode::Window`] only).
fn release(p: &mut Pages<'_>, f: usize, start: usize, end: usize, free: &mut Vec<(usize, usize)>) {
    if !p.streamed() {
        return;
    }
    let end = end.min(p.state.len());
    let start = start.min(end);
    for k in start..end {
        p.refs[k] = p.refs[k].saturating_sub(1);
        if p.refs[k] == 0 && p.state[k] & WANTED != 0 {
            p.unwant(k);
            free.push((f, k));
        }
    }
}

/// Drops the pages in `free` (`(file, page)`) from the page cache, in runs of
/// consecutive pages, and empties it.
fn drop_runs(pages: &[Pages<'_>], free: &mut Vec<(usize, usize)>, page: usize) {
    for (f, first, end) in runs_of(free, 0) {
        if let Some(fd) = &pages[f].fd {
            drop_range(pages[f].file, fd, first * page, (end - first) * page);
        }
    }
    free.clear();
}

/// The runs of pages in `list` (`(file, page)`, sorted here) with at most `gap` pages
/// between neighbours: `(file, first, end)`.
fn runs_of(
    list: &mut [(usize, usize)],
    gap: usize,
) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    list.sort_unstable();
    let mut k = 0;
    std::iter::from_fn(move || {
        let &(f, first) = list.get(k)?;
        let mut end = first + 1;
        k += 1;
        while k < list.len() && list[k].0 == f && list[k].1 <= end + gap {
            end = end.max(list[k].1 + 1);
            k += 1;
        }
        Some((f, first, end))
    })
}

/// Asks for the next sequential chunks of the kept files, keeping at most
/// [`WARMING`] bytes asked for and not yet resident.
fn warm(
    pages: &mut [Pages<'_>],
    cursor: &mut (usize, usize),
    asked: &mut std::collections::VecDeque<(usize, usize)>,
    page: usize,
) {
    while let Some(&(f, at)) = asked.front() {
        // A page that cannot be checked counts as read: the plan is only advice.
        let resident = pages[f].cached(at);
        if !resident {
            break;
        }
        asked.pop_front();
    }
    while cursor.0 < pages.len() {
        let p = &mut pages[cursor.0];
        let len = p.file.bytes().len();
        if p.mode != Mode::Keep || cursor.1 >= len {
            *cursor = (cursor.0 + 1, 0);
            continue;
        }
        // Never 0: the cursor must move.
        let chunk = p.piece.max(page);
        if asked.len() * chunk >= WARMING {
            break;
        }
        let (first, end) = (cursor.1 / page, (cursor.1 + chunk).min(len).div_ceil(page));
        if p.state[first..end].iter().any(|&b| b & WANTED == 0) {
            p.state[first..end].iter_mut().for_each(|b| *b |= WANTED);
            will_need(p.file, first * page, (end - first) * page, p.piece);
            asked.push_back((cursor.0, (end - 1) * page));
        }
        cursor.1 += chunk;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pagecache::{evict_file, file_residency};

    /// A sparse file of `bytes`, mapped, evicted; `None` where evicting does nothing
    /// (tmpfs): the queue's checks need pages that are not resident.
    fn mapped(bytes: u64) -> Option<(tempfile::NamedTempFile, memmap2::Mmap)> {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(bytes).unwrap();
        // SAFETY: a private temporary file that nothing else writes.
        let map = unsafe { memmap2::Mmap::map(f.as_file()).unwrap() };
        let file = MappedFile::new(f.path(), &map);
        let _ = resident_range(file, 0, page_size());
        evict_file(file).unwrap();
        let evicted = file_residency(file).unwrap().resident == 0;
        if !evicted {
            crate::testing::skip_cold("evicting a file leaves its pages here (tmpfs)");
        }
        evicted.then_some((f, map))
    }

    fn streamed(file: MappedFile<'_>) -> Pages<'_> {
        let n = file.bytes().len() / page_size();
        Pages {
            file,
            mode: Mode::Stream,
            state: vec![0; n],
            refs: vec![0; n],
            fd: file.opened().ok(),
            known: true,
            piece: WILL_NEED_PIECE,
            window: None,
        }
    }

    /// Marks pages `first..end` wanted and queues them, as `ask_runs` does.
    fn want(queue: &mut Queue, p: &mut Pages<'_>, first: usize, end: usize) {
        p.state[first..end].iter_mut().for_each(|b| *b |= WANTED);
        queue.pending.push_back((0, 0, first, end));
    }

    /// Rows of 3,000 bytes of one file, in order, or at pseudo-random places (as random
    /// token windows are).
    struct Rows {
        len: u64,
        random: bool,
    }

    impl Dataset for Rows {
        fn len(&self) -> u64 {
            self.len
        }
        fn columns(&self) -> &[crate::dataset::Column] {
            &[]
        }
        fn gather(&self, _: u64, _: &[u64], _: &mut [&mut [u8]]) -> crate::Result<()> {
            Ok(())
        }
        fn locate(&self, _: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
            let at = match self.random {
                true => crate::util::mix(index) % self.len,
                false => index,
            };
            each(0, at as usize * 3000, 3000);
        }
    }

    fn is_scattered(rows: Rows, shuffle: Shuffle, world: u64) -> bool {
        let shard = crate::sampler::Shard::new(0, world).unwrap();
        let order = crate::sampler::Order::new(rows.len, shuffle, shard, 256, false).unwrap();
        scattered(&rows, &order.epoch(0), 0, &[true])
    }

    #[test]
    fn rows_are_read_one_by_one_only_where_they_are_scattered() {
        let rows = |random| Rows {
            len: 200_000,
            random,
        };
        // The loader's default: about 1 MiB of rows per block, 16 blocks a window.
        let block = Shuffle::Block {
            seed: 1,
            block_rows: 350,
            window: 16,
        };
        assert!(is_scattered(rows(false), Shuffle::Full { seed: 1 }, 1));
        assert!(!is_scattered(rows(false), Shuffle::None, 1));
        assert!(!is_scattered(rows(false), block, 1));
        // Each rank of two needs half the rows of each block: still read whole.
        assert!(!is_scattered(rows(false), block, 2));
        // Of eight, an eighth: reading the blocks whole would read 8x.
        assert!(is_scattered(rows(false), block, 8));
        // Random places in file order (random token windows).
        assert!(is_scattered(rows(true), Shuffle::None, 1));
    }

    #[test]
    fn the_queue_keeps_a_bounded_number_of_bytes_in_flight() {
        let page = page_size();
        let Some((f, map)) = mapped(4 * STREAMING as u64) else {
            return;
        };
        let mut pages = [streamed(MappedFile::new(f.path(), &map))];
        let run = STREAMING / 2 / page;
        let mut queue = Queue::default();
        for k in 0..3 {
            want(&mut queue, &mut pages[0], k * run, (k + 1) * run);
        }
        queue.issue(&mut pages, page, None);
        assert_eq!(queue.asked.len(), 2, "two halves of the limit");
        assert_eq!(queue.pending.len(), 1);
        assert_eq!(queue.in_flight, STREAMING);
        // Once the first two are read (a sparse file's holes are read at once), the
        // third goes out.
        let start = std::time::Instant::now();
        while !queue.pending.is_empty() && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
            queue.issue(&mut pages, page, None);
        }
        assert!(queue.pending.is_empty());
    }

    #[test]
    fn pages_released_before_their_run_is_issued_are_not_read() {
        // A run waited behind the limit while the rows of its middle pages were gathered
        // from faults and released: issued, it asks for the pages still wanted only.
        let page = page_size();
        let Some((f, map)) = mapped(64 * page as u64) else {
            return;
        };
        let mut pages = [streamed(MappedFile::new(f.path(), &map))];
        let mut queue = Queue::default();
        want(&mut queue, &mut pages[0], 0, 16);
        for k in 4..8 {
            pages[0].unwant(k);
        }
        queue.issue(&mut pages, page, None);
        let issued: Vec<usize> = (0..16)
            .filter(|&k| pages[0].state[k] & ISSUED != 0)
            .collect();
        assert_eq!(issued, [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]);
        assert_eq!(queue.in_flight, 12 * page);
        assert_eq!(queue.asked.len(), 2);
    }

    #[test]
    fn a_dropped_ask_does_not_hold_the_queue() {
        // The rows of a run asked for were gathered and its pages dropped; a later batch
        // asked for its last page again, queued behind the limit. The dropped run must
        // not be waited for: its page will not come back until the queue issues it.
        let page = page_size();
        let Some((f, map)) = mapped(2 * STREAMING as u64) else {
            return;
        };
        let file = MappedFile::new(f.path(), &map);
        let mut pages = [streamed(file)];
        let run = STREAMING / page;
        let mut queue = Queue::default();
        want(&mut queue, &mut pages[0], 0, run);
        want(&mut queue, &mut pages[0], run, run + 1);
        queue.issue(&mut pages, page, None);
        assert_eq!((queue.asked.len(), queue.pending.len()), (1, 1));
        // Gathered and dropped, as `release` and `drop_runs` do.
        let mut free = Vec::new();
        release(&mut pages[0], 0, 0, run, &mut free);
        assert_eq!(free.len(), run);
        drop_runs(&pages, &mut free, page);
        evict_file(file).unwrap();
        // Its last page wanted again.
        want(&mut queue, &mut pages[0], run - 1, run);
        queue.issue(&mut pages, page, None);
        assert!(queue.pending.is_empty(), "{:?}", queue.pending);
        assert_eq!(queue.asked.len(), 2);
    }
}
