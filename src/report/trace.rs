//! Chrome Trace Event JSON (opens in Perfetto and chrome://tracing): one span per batch
//! per stage, on the thread that ran it.

use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use crate::error::{Error, Result};

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

    /// Records a span of stage `name` for batch `batch` of `epoch` on `thread`.
    pub fn span(
        &self,
        name: &'static str,
        thread: impl Into<String>,
        (start, end): (Instant, Instant),
        epoch: u64,
        batch: u64,
    ) {
        let span = Span {
            name,
            thread: thread.into(),
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
        let worker = format!("gather worker {}", tm.worker);
        let span = (tm.gather_start, tm.gather_end);
        self.span("gather", worker, span, batch.epoch(), batch.number());
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

    /// Writes the trace to `path`.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string(&self.to_json()).expect("a trace serialises");
        std::fs::write(path, text).map_err(|e| Error::io(path, e))
    }
}
