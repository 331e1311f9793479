//! Chrome Trace Event JSON (opens in Perfetto and chrome://tracing): one span per batch
//! per stage, on the track (a thread, or a CUDA stream) that ran it. Both backends use
//! the same [`Stage`] and [`Track`] names for the same work.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::partial::{self, Claimed};

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
#[derive(Debug, Clone, Copy, PartialEq)]
struct Span {
    stage: Stage,
    track: Track,
    start: Instant,
    end: Instant,
    epoch: u64,
    batch: u64,
}

impl Span {
    /// The span as a trace event on thread id `tid`, timed from `origin`.
    fn event(&self, tid: usize, origin: Instant) -> serde_json::Value {
        let us = |i: Instant| i.saturating_duration_since(origin).as_secs_f64() * 1e6;
        serde_json::json!({
            "name": self.stage.name(), "cat": "stokehold", "ph": "X", "pid": 1, "tid": tid,
            "ts": us(self.start), "dur": (us(self.end) - us(self.start)).max(0.0),
            "args": {"epoch": self.epoch, "batch": self.batch},
        })
    }
}

/// The metadata event naming thread id `tid`.
fn thread_name(tid: usize, name: &str) -> serde_json::Value {
    serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"name": name}})
}

/// Spans handed to the writer thread at a time.
const CHUNK: usize = 4096;

/// Full chunks that may wait for the writer before recording threads block: with the
/// chunk being filled and the one being written, memory stays under `4 * CHUNK` spans.
const QUEUED: usize = 2;

/// Collects spans from any thread, in memory ([`Trace::new`]) or streamed to a file
/// ([`Trace::create`]).
#[derive(Debug)]
pub struct Trace {
    origin: Instant,
    spans: Mutex<Vec<Span>>,
    file: Mutex<Option<Stream>>,
}

/// A trace being written: full chunks go to a writer thread, which appends them to a
/// temporary file beside the destination; [`Trace::finish`] renames it into place.
#[derive(Debug)]
struct Stream {
    path: PathBuf,
    tmp: PathBuf,
    chunks: Option<SyncSender<Vec<Span>>>,
    writer: Option<JoinHandle<std::io::Result<()>>>,
    /// The temporary file, open (and so locked: see [`partial`](crate::partial)) until it
    /// is in place or removed.
    _claim: std::fs::File,
}

impl Stream {
    /// Closes the channel and waits for the writer: its result.
    fn close(&mut self) -> std::io::Result<()> {
        drop(self.chunks.take());
        match self.writer.take().map(JoinHandle::join) {
            Some(Ok(written)) => written,
            Some(Err(_)) => Err(std::io::Error::other("the trace writer panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Unfinished (the run failed): no half-written trace is left behind.
        if self.writer.is_some() {
            let _ = self.close();
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// The writer thread: `{"traceEvents":[` then each chunk's events, each track named by a
/// metadata event the first time it appears, then the closing bracket, synced.
fn write_stream(
    file: std::fs::File,
    chunks: Receiver<Vec<Span>>,
    origin: Instant,
) -> std::io::Result<()> {
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let mut tracks: Vec<Track> = Vec::new();
    let mut result = out.write_all(b"{\"traceEvents\":[");
    let mut first = true;
    for chunk in chunks {
        if result.is_err() {
            // Keep receiving so recording threads never block on a dead writer.
            continue;
        }
        result = (|| {
            for span in &chunk {
                let tid = match tracks.iter().position(|&t| t == span.track) {
                    Some(tid) => tid,
                    None => {
                        tracks.push(span.track);
                        let tid = tracks.len() - 1;
                        let name = thread_name(tid, &span.track.name());
                        out.write_all(if first { b"\n" } else { b",\n" })?;
                        serde_json::to_writer(&mut out, &name)?;
                        first = false;
                        tid
                    }
                };
                out.write_all(if first { b"\n" } else { b",\n" })?;
                serde_json::to_writer(&mut out, &span.event(tid, origin))?;
                first = false;
            }
            Ok(())
        })();
    }
    result?;
    out.write_all(b"\n],\"displayTimeUnit\":\"ms\"}\n")?;
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()
}

impl Default for Trace {
    fn default() -> Self {
        Trace::new()
    }
}

impl Trace {
    /// An empty trace kept in memory (for a short run; see [`Trace::create`] for long
    /// ones), whose time zero is now.
    pub fn new() -> Trace {
        Trace {
            origin: Instant::now(),
            spans: Mutex::new(Vec::new()),
            file: Mutex::new(None),
        }
    }

    /// A trace streamed to `path` as it is recorded, in bounded memory, whose time zero
    /// is now. It goes to a temporary file beside `path` that [`finish`](Trace::finish)
    /// renames into place; dropped unfinished, it leaves no file.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) naming `path` if the file or the writer thread
    /// cannot be created.
    pub fn create(path: &Path) -> Result<Trace> {
        crate::util::check_writable(path, false)?;
        // Through a symbolic link to the file it names.
        let dest = crate::util::destination(path);
        let path = dest.as_path();
        let Claimed { path: tmp, file } = partial::claim(path).map_err(|e| Error::io(path, e))?;
        let claim = file.try_clone().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io(path, e)
        })?;
        let origin = Instant::now();
        let (chunks, rx) = sync_channel(QUEUED);
        let writer = std::thread::Builder::new()
            .name("stokehold-trace".into())
            .spawn(move || write_stream(file, rx, origin))
            .map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                Error::io(path, e)
            })?;
        Ok(Trace {
            origin,
            spans: Mutex::new(Vec::with_capacity(CHUNK)),
            file: Mutex::new(Some(Stream {
                path: path.to_path_buf(),
                tmp,
                chunks: Some(chunks),
                writer: Some(writer),
                _claim: claim,
            })),
        })
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
            stage,
            track,
            start,
            end,
            epoch,
            batch,
        };
        let mut spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        spans.push(span);
        // A streamed trace hands over each full chunk; an in-memory one (or one already
        // finished) looks for a stream once per chunk, not on every span.
        if spans.len() % CHUNK != 0 {
            return;
        }
        let file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(chunks) = file.as_ref().and_then(|f| f.chunks.as_ref()) {
            let full = std::mem::replace(&mut *spans, Vec::with_capacity(CHUNK));
            drop(spans);
            // Fails only once the writer is gone, after `finish`.
            let _ = chunks.send(full);
        }
    }

    /// Records the gather span of `batch` on the worker thread that assembled it.
    pub fn gather(&self, batch: &crate::loader::HostBatch) {
        let tm = batch.timing();
        let span = (tm.gather_start, tm.gather_end);
        let track = Track::Worker(tm.worker);
        self.span(Stage::Gather, track, span, batch.epoch(), batch.number());
    }

    /// Spans held in memory now: all of them for [`Trace::new`], at most a few chunks
    /// for [`Trace::create`].
    pub fn len(&self) -> usize {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no span is held in memory.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The spans held in memory as Chrome Trace Event JSON.
    pub fn to_json(&self) -> serde_json::Value {
        let spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        let mut tracks: Vec<String> = spans.iter().map(|s| s.track.name()).collect();
        tracks.sort_unstable();
        tracks.dedup();
        let mut events: Vec<serde_json::Value> = tracks
            .iter()
            .enumerate()
            .map(|(tid, name)| thread_name(tid, name))
            .collect();
        events.extend(spans.iter().map(|s| {
            let name = s.track.name();
            let tid = tracks.iter().position(|t| *t == name).unwrap_or(0);
            s.event(tid, self.origin)
        }));
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }

    /// Writes the spans held in memory to `path`, whole or not at all.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) naming the file.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string(&self.to_json()).expect("a trace serialises");
        crate::util::write_whole(path, text.as_bytes())
    }

    /// Completes a trace made by [`Trace::create`]: the last spans are written, the
    /// file is synced and renamed to its path. Spans recorded afterwards are kept in
    /// memory only. Does nothing for an in-memory trace, or a second time.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) naming the file if a write failed (a full disk):
    /// the temporary file is then removed and the path left as it was.
    pub fn finish(&self) -> Result<()> {
        let Some(mut stream) = self.file.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(());
        };
        let rest = std::mem::take(&mut *self.spans.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(chunks) = &stream.chunks {
            let _ = chunks.send(rest);
        }
        let written = stream
            .close()
            .and_then(|()| std::fs::rename(&stream.tmp, &stream.path));
        written.map_err(|e| {
            let _ = std::fs::remove_file(&stream.tmp);
            Error::io(&stream.path, e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(trace: &Trace, spans: usize) {
        let t = Instant::now();
        for b in 0..spans as u64 {
            let track = Track::Worker((b % 3) as usize);
            trace.span(Stage::Gather, track, (t, t), 0, b);
        }
    }

    #[test]
    fn a_streamed_trace_holds_few_spans_and_writes_them_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        let trace = Trace::create(&path).unwrap();
        record(&trace, 10 * CHUNK + 7);
        assert!(trace.len() < CHUNK, "memory is bounded: {}", trace.len());
        assert!(!path.exists(), "the file appears whole, at the end");
        trace.finish().unwrap();
        let t: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let events = t["traceEvents"].as_array().unwrap();
        let spans = events.iter().filter(|e| e["ph"] == "X").count();
        let names: Vec<&str> = events
            .iter()
            .filter_map(|e| e["args"]["name"].as_str())
            .collect();
        assert_eq!(spans, 10 * CHUNK + 7);
        assert_eq!(names.len(), 3, "each track named once: {names:?}");
        let entries: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(entries.len(), 1, "no temporary file left");
        trace.finish().unwrap();
    }

    #[test]
    fn an_unfinished_trace_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        let trace = Trace::create(&path).unwrap();
        record(&trace, 3 * CHUNK);
        drop(trace);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
