//! Per-epoch progress: an indicatif bar on a terminal, plain periodic lines otherwise
//! (a pipe, a file, or a terminal indicatif does not draw on: `TERM=dumb` or unset).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Progress of one epoch, on stderr.
pub struct EpochProgress {
    bar: Option<ProgressBar>,
    epoch: u64,
    total: u64,
    done: u64,
    bytes_per_sample: u64,
    start: Instant,
    last_line: Instant,
    every: Duration,
}

impl EpochProgress {
    /// Starts the bar for `epoch` of `total` samples; `quiet` draws nothing at all.
    pub fn new(epoch: u64, total: u64, bytes_per_sample: u64, quiet: bool) -> EpochProgress {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "epoch {prefix:>3} {bar:28.cyan/blue} {pos:>8}/{len} {msg} eta {eta}",
                )
                .expect("static template")
                .progress_chars("=> "),
            );
            bar.set_prefix(epoch.to_string());
            bar
        });
        // indicatif hides its bar on a terminal it cannot draw on: lines instead.
        let bar = bar.filter(|b| !b.is_hidden());
        EpochProgress {
            bar,
            epoch,
            total,
            done: 0,
            bytes_per_sample,
            start: Instant::now(),
            last_line: Instant::now(),
            every: if quiet {
                Duration::MAX
            } else {
                Duration::from_secs(2)
            },
        }
    }

    /// Records `samples` more, with the share of time so far stalled on data. The rates
    /// are worked out only when shown: on the bar at most 20 times a second (indicatif's
    /// own pace), off a terminal once a line is due.
    pub fn advance(&mut self, samples: u64, stalled: f64) {
        self.done += samples;
        match &self.bar {
            Some(bar) => {
                bar.set_position(self.done);
                if self.last_line.elapsed() >= Duration::from_millis(50) {
                    self.last_line = Instant::now();
                    bar.set_message(self.message(stalled));
                }
            }
            None if self.last_line.elapsed() >= self.every => {
                self.last_line = Instant::now();
                // A closed stderr (`2>&1 | head`) is no reason to stop the run.
                let msg = self.message(stalled);
                let line = format!("epoch {} {}/{} {msg}\n", self.epoch, self.done, self.total);
                let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            }
            None => {}
        }
    }

    /// The rates so far, and the share of time stalled on data.
    fn message(&self, stalled: f64) -> String {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let rate = self.done as f64 / secs;
        format!(
            "{:>9.0} samples/s {:>7.1} MB/s stalled {:>3.0}%",
            rate,
            rate * self.bytes_per_sample as f64 / 1e6,
            100.0 * stalled
        )
    }

    /// Clears the bar.
    pub fn finish(mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

impl Drop for EpochProgress {
    /// An epoch that ended before [`finish`](EpochProgress::finish) (an error) leaves its
    /// bar where it stopped, not drawn full as indicatif's own drop would.
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        }
    }
}
