//! Planned storage reads: the loader knows every row it will gather, batches ahead, so
//! it asks for exactly those pages instead of leaving reads to page faults.
//!
//! One planner thread per loader joins each epoch's job beside the workers. At the
//! start of an epoch it takes the files' residency (`mincore`):
//!
//! - **warm**: every page resident; nothing to do.
//! - **warming**: the files fit under the page-cache budget. The rows of the next
//!   batches are asked for first (`madvise(MADV_WILLNEED)` on exactly their pages), and
//!   the rest of the files streams in sequentially in the background, so epoch 0 costs
//!   about one sequential read of the files.
//! - **streaming**: the files are larger than the budget. Only the rows of the next
//!   batches are read, and the pages of batches already gathered are dropped unless a
//!   planned row still needs them, so the page cache the loader fills stays near the
//!   planned window.
//!
//! Either way the mappings are set to `MADV_RANDOM`: a page fault then reads one page,
//! not the kernel's read-around window (`read_ahead_kb`), and what is read is what the
//! plan asked for. The plan is advice: the gathers read the same bytes whatever it did.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Receiver;

use super::worker::{Assignment, Job};
use crate::dataset::{Dataset, MappedFile};
use crate::pagecache::{advise_random, drop_range, resident_pages, resident_range, will_need};
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

/// The residency of every file of `dataset` as an epoch starts (one byte per page,
/// bit 0 set where resident), and what storage will do for it under `budget`. Taken
/// where the epoch starts, so that the epoch's report does not depend on how far the
/// planner's thread has got; the planner then starts from these pages.
pub(crate) fn snapshot(dataset: &dyn Dataset, budget: u64) -> (Storage, Vec<Vec<u8>>) {
    let files = dataset.files();
    let pages: Option<Vec<Vec<u8>>> = files.iter().map(|&f| resident_pages(f).ok()).collect();
    let Some(pages) = pages else {
        return (Storage::Warm, Vec::new());
    };
    let total: u64 = files.iter().map(|f| f.bytes().len() as u64).sum();
    let storage = if pages.iter().flatten().all(|&b| b & 1 != 0) {
        Storage::Warm
    } else if total > budget {
        Storage::Streaming
    } else {
        Storage::Warming
    };
    (storage, pages)
}

/// Sequential warming: bytes per request (within any kernel's read-ahead cap, so the
/// whole range is read) and requests that may be in flight.
const CHUNK: usize = 128 << 10;
const IN_FLIGHT: usize = 64;

/// Starts the planner: it serves jobs until its channel closes.
/// `ahead` is how many batches are planned beyond the last one a worker claimed.
pub(crate) fn spawn(ahead: u64, jobs: Receiver<Assignment>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("stokehold-planner".into())
        .spawn(move || {
            for (job, done) in jobs {
                plan_epoch(&job, ahead);
                drop(job);
                drop(done);
            }
        })
}

/// One file's pages: bit 0 of `state` resident or asked for; `refs` counts the planned
/// rows that still need each page (streaming only).
struct Pages<'a> {
    file: MappedFile<'a>,
    state: Vec<u8>,
    refs: Vec<u16>,
    fd: Option<File>,
}

/// The pages of one batch's rows, merged: `(file, first page, end page)`.
fn batch_pages(
    job: &Job,
    b: u64,
    page: usize,
    idx: &mut Vec<u64>,
    runs: &mut Vec<(usize, usize, usize)>,
) {
    runs.clear();
    job.order.batch(b, idx);
    let epoch = job.order.epoch();
    for &i in idx.iter() {
        job.dataset.locate(epoch, i, &mut |f, off, len| {
            if len > 0 {
                runs.push((f, off / page, (off + len).div_ceil(page)));
            }
        });
    }
    runs.sort_unstable();
    let mut merged = 0;
    for k in 0..runs.len() {
        let r = runs[k];
        if merged > 0 && runs[merged - 1].0 == r.0 && runs[merged - 1].2 >= r.1 {
            runs[merged - 1].2 = runs[merged - 1].2.max(r.2);
        } else {
            runs[merged] = r;
            merged += 1;
        }
    }
    runs.truncate(merged);
}

fn plan_epoch(job: &Job, ahead: u64) {
    if job.storage == Storage::Warm {
        return;
    }
    let streaming = job.storage == Storage::Streaming;
    let states = std::mem::take(&mut *job.resident.lock().unwrap_or_else(|e| e.into_inner()));
    let files = job.dataset.files();
    if states.len() != files.len() {
        return;
    }
    let page = page_size();
    let mut pages: Vec<Pages<'_>> = files
        .into_iter()
        .zip(states)
        .map(|(file, state)| Pages {
            file,
            state,
            refs: Vec::new(),
            fd: None,
        })
        .collect();
    for p in &mut pages {
        advise_random(p.file);
        if streaming {
            p.refs = vec![0; p.state.len()];
            p.fd = File::open(p.file.path()).ok();
        }
    }
    let (mut idx, mut runs) = (Vec::new(), Vec::new());
    let first = job.next.load(Ordering::Relaxed).min(job.end);
    let (mut planned, mut dropped) = (first, first);
    // Sequential warming: the next chunk to ask for, and those asked for, oldest first.
    let (mut cursor, mut asked) = ((0usize, 0usize), std::collections::VecDeque::new());
    loop {
        if job.cancelled.load(Ordering::Acquire) {
            return;
        }
        let claimed = job.next.load(Ordering::Relaxed).min(job.end);
        let target = claimed.saturating_add(ahead).min(job.end);
        while planned < target {
            batch_pages(job, planned, page, &mut idx, &mut runs);
            for &(f, start, end) in &runs {
                ask(&mut pages[f], start, end, page, streaming);
            }
            planned += 1;
        }
        let done = if streaming {
            let delivered = job.delivered.load(Ordering::Acquire).min(planned);
            while dropped < delivered {
                batch_pages(job, dropped, page, &mut idx, &mut runs);
                for &(f, start, end) in &runs {
                    release(&mut pages[f], start, end, page);
                }
                dropped += 1;
            }
            dropped >= job.end
        } else {
            warm(&mut pages, &mut cursor, &mut asked, page);
            planned >= job.end && cursor.0 >= pages.len()
        };
        if done {
            return;
        }
        std::thread::park_timeout(Duration::from_millis(1));
    }
}

/// Asks for the pages `start..end` of a file that are neither resident nor asked for,
/// in runs; counts the row's need for each when streaming.
fn ask(p: &mut Pages<'_>, start: usize, end: usize, page: usize, streaming: bool) {
    let end = end.min(p.state.len());
    if streaming {
        p.refs[start..end]
            .iter_mut()
            .for_each(|r| *r = r.saturating_add(1));
    }
    let mut k = start;
    while k < end {
        if p.state[k] & 1 != 0 {
            k += 1;
            continue;
        }
        let run = k;
        while k < end && p.state[k] & 1 == 0 {
            p.state[k] |= 1;
            k += 1;
        }
        will_need(p.file, run * page, (k - run) * page);
    }
}

/// A gathered row no longer needs pages `start..end`: those no planned row needs are
/// dropped from the page cache, in runs.
fn release(p: &mut Pages<'_>, start: usize, end: usize, page: usize) {
    let end = end.min(p.state.len());
    p.refs[start..end]
        .iter_mut()
        .for_each(|r| *r = r.saturating_sub(1));
    let mut k = start;
    while k < end {
        if p.refs[k] > 0 || p.state[k] & 1 == 0 {
            k += 1;
            continue;
        }
        let run = k;
        while k < end && p.refs[k] == 0 && p.state[k] & 1 != 0 {
            p.state[k] &= !1;
            k += 1;
        }
        if let Some(fd) = &p.fd {
            drop_range(p.file, fd, run * page, (k - run) * page);
        }
    }
}

/// Asks for the next sequential chunks of the files, keeping at most [`IN_FLIGHT`]
/// chunks asked for and not yet resident.
fn warm(
    pages: &mut [Pages<'_>],
    cursor: &mut (usize, usize),
    asked: &mut std::collections::VecDeque<(usize, usize)>,
    page: usize,
) {
    while let Some(&(f, at)) = asked.front() {
        // A page that cannot be checked counts as read: the plan is only advice.
        let resident = resident_range(pages[f].file, at, page).map_or(true, |v| v[0] & 1 != 0);
        if !resident {
            break;
        }
        asked.pop_front();
    }
    while asked.len() < IN_FLIGHT && cursor.0 < pages.len() {
        let p = &mut pages[cursor.0];
        let len = p.file.bytes().len();
        if cursor.1 >= len {
            *cursor = (cursor.0 + 1, 0);
            continue;
        }
        let (first, end) = (cursor.1 / page, (cursor.1 + CHUNK).min(len).div_ceil(page));
        if p.state[first..end].iter().any(|&b| b & 1 == 0) {
            p.state[first..end].iter_mut().for_each(|b| *b |= 1);
            will_need(p.file, first * page, (end - first) * page);
            asked.push_back((cursor.0, (end - 1) * page));
        }
        cursor.1 += CHUNK;
    }
}
