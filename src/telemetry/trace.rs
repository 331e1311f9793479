//! Chrome Trace Event JSON (opens in Perfetto and chrome://tracing): one span per batch
//! per stage, on the track (a thread, or a CUDA stream) that ran it. Both backends use
//! the same [`Stage`] and [`Track`] names for the same work.

use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use crate::error::Result;

/// A stage of the pipeline, as a span's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// A loader worker assembling a batch.
    Gather,
    /// The feeding thread waiting for the loader's next batch.
    WaitData,
    /// A batch's copy into device memory (a device slot on the CPU backend).
    Copy,
    /// Waiting for a batch's copy: the compute thread (CPU), or the feeding thread before
    /// a pinned buffer goes back to the loader (CUDA).
    WaitCopy,
    /// The feeding thread waiting for a device slot's last work (CUDA back-pressure).
    WaitSlot,
    /// The training step on a batch.
    Compute,
    /// A batch gathered from the device cache.
    DeviceGather,
}

impl Stage {
    /// The span's name in the trace.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Gather => "gather",
            Stage::WaitData => "wait for data",
            Stage::Copy => "copy",
            Stage::WaitCopy => "wait for copy",
            Stage::WaitSlot => "wait for slot",
            Stage::Compute => "compute",
            Stage::DeviceGather => "device gather",
        }
    }
}

/// Where a span is drawn: one track per thread or stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Track {
    /// Loader worker `n`.
    Worker(usize),
    /// The thread that takes batches from the loader: the copy thread (CPU; its copies
    /// are drawn on [`Track::Copy`]), the feeder's thread (CUDA).
    Feed,
    /// Where copies run: the copy thread (CPU), the copy stream (CUDA).
    Copy,
    /// Where the step runs: the compute thread (CPU), the compute stream (CUDA).
    Compute,
}

impl Track {
    /// The track's name in the trace.
    pub fn name(self) -> String {
        match self {
            Track::Worker(n) => format!("gather worker {n}"),
            Track::Feed => "feed".into(),
            Track::Copy => "copy".into(),
            Track::Compute => "compute".into(),
        }
    }
}

/// One complete span (`"ph": "X"`).
#[derive(Debug, Clone, PartialEq)]
struct Span {
    name: &'static str,
    thread: String,
    start: Instant,
    end: Instant,
    epoch: u64,
    batch: u64,
}

/// Collects spans from any thread; written once at the end.
#[derive(Debug)]
pub struct Trace {
    origin: Instant,
    spans: Mutex<Vec<Span>>,
}

impl Default for Trace {
    fn default() -> Self {
        Trace::new()
    }
}

impl Trace {
    /// An empty trace whose time zero is now.
    pub fn new() -> Trace {
        Trace {
            origin: Instant::now(),
            spans: Mutex::new(Vec::new()),
        }
    }

    /// Records a span of `stage` for batch `batch` of `epoch` on `track`.
    pub fn span(
        &self,
        stage: Stage,
        track: Track,
        (start, end): (Instant, Instant),
        epoch: u64,
        batch: u64,
    ) {
        let span = Span {
            name: stage.name(),
            thread: track.name(),
            start,
            end,
            epoch,
            batch,
        };
        self.spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(span);
    }

    /// Records the gather span of `batch` on the worker thread that assembled it.
    pub fn gather(&self, batch: &crate::loader::HostBatch) {
        let tm = batch.timing();
        let span = (tm.gather_start, tm.gather_end);
        let track = Track::Worker(tm.worker);
        self.span(Stage::Gather, track, span, batch.epoch(), batch.number());
    }

    /// Spans recorded so far.
    pub fn len(&self) -> usize {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no span was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The trace as Chrome Trace Event JSON.
    pub fn to_json(&self) -> serde_json::Value {
        let spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        let mut threads: Vec<&str> = spans.iter().map(|s| s.thread.as_str()).collect();
        threads.sort_unstable();
        threads.dedup();
        let tid = |t: &str| threads.iter().position(|&x| x == t).unwrap_or(0);
        let us = |i: Instant| i.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        let mut events: Vec<serde_json::Value> = threads
            .iter()
            .enumerate()
            .map(|(i, t)| {
                serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": i,
                                   "args": {"name": t}})
            })
            .collect();
        events.extend(spans.iter().map(|s| {
            serde_json::json!({
                "name": s.name, "cat": "stokehold", "ph": "X", "pid": 1, "tid": tid(&s.thread),
                "ts": us(s.start), "dur": (us(s.end) - us(s.start)).max(0.0),
                "args": {"epoch": s.epoch, "batch": s.batch},
            })
        }));
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }

    /// Writes the trace to `path`, whole or not at all.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) naming the file.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string(&self.to_json()).expect("a trace serialises");
        crate::util::write_whole(path, text.as_bytes())
    }
}
