//! `stokehold bench`'s report as text: the same figures as its JSON, one line each.

use super::{BenchReport, ColdEpoch, DatasetInfo};
use crate::loader::Storage;

impl BenchReport {
    /// The figures as `stokehold bench` prints them.
    pub fn text(&self) -> String {
        let mut s = String::new();
        if let Some(o) = &self.cpu_overlap {
            s += &format!(
                "CPU backend, hidden {}: overlapped epoch {:.3} s vs serialised {:.3} s ({:.2}x); gather/worker {:.3} s, copy {:.3} s, compute {:.3} s: {:.2}x the slowest stage\n",
                o.hidden, o.overlapped_s, o.serialised_s, o.speedup, o.gather_per_worker_s, o.copy_s, o.compute_s, o.overlapped_vs_slowest
            );
        }
        if let (Some(r), Some(l), Some(ratio)) = (&self.roofline, &self.loader, self.ratio) {
            s += &format!(
                "warm page cache, full shuffle, batch {}, {} threads:\n",
                self.config.batch, self.config.workers
            );
            s += &format!(
                "  roofline (bare gather)  {:>10.0} samples/s  {:>6.2} GB/s  {:>6.0} us/batch gather\n",
                r.samples_per_s, r.gb_per_s, r.gather_us_per_batch
            );
            s += &format!(
                "  loader                  {:>10.0} samples/s  {:>6.2} GB/s  {:>6.0} us/batch gather  = {:.1}% of roofline (median of paired runs), stalled on {:.0}% of batches\n",
                l.samples_per_s,
                l.gb_per_s,
                l.gather_us_per_batch,
                100.0 * ratio,
                100.0 * l.stalled_share
            );
        }
        if let Some(c) = &self.cold {
            for (name, e) in [("full", &c.full), ("block", &c.block)] {
                s += &format!(
                    "cold cache, {name:<5} shuffle: {:>7.2} s  {:>10.0} samples/s  read {}, {}, resident {} -> {}\n",
                    e.epoch_s,
                    e.samples_per_s,
                    match (e.bytes_read, e.read_amplification) {
                        (Some(read), Some(amplification)) => format!(
                            "{:.0} MB ({amplification:.2}x the rows)",
                            read as f64 / 1e6
                        ),
                        _ => "? MB (the kernel does not count this process's reads)".into(),
                    },
                    e.storage.name(),
                    e.residency_before,
                    e.residency_after
                );
                let before = e.residency_before;
                if before.unknown == 0 && before.fraction() > 0.05 {
                    s += &format!(
                        "  (not cold: {} of the set stayed cached after the eviction (tmpfs, \
                         dirty pages, or another process mapping it): these figures are partly warm)\n",
                        before
                    );
                }
            }
        }
        match (&self.io_roofline, &self.io_roofline_skipped) {
            (Some(io), _) => {
                let list = |v: &[f64], scale: f64, digits: usize| {
                    let v: Vec<String> = v
                        .iter()
                        .map(|x| format!("{:.*}", digits, x / scale))
                        .collect();
                    v.join(" then ")
                };
                s += &format!(
                    "I/O roofline (direct I/O on {}): sequential {:.2} GB/s ({} around the block epoch), random {:.0} reads/s of {} bytes at depth 32 ({} around the full one)\n",
                    io.file,
                    io.sequential_bytes_per_s / 1e9,
                    list(&io.sequential_passes, 1e9, 2),
                    io.random_iops,
                    io.random_read_bytes,
                    list(&io.random_passes, 1.0, 0),
                );
                if let Some(c) = &self.cold {
                    s += &against(&self.dataset, io, "full", &c.full);
                    s += &against(&self.dataset, io, "block", &c.block);
                }
            }
            (None, Some(reason)) => s += &format!("I/O roofline skipped: {reason}\n"),
            (None, None) => {}
        }
        match (&self.gpu, &self.gpu_skipped) {
            (Some(g), _) => s += &gpu_text(g),
            (None, Some(reason)) => s += &format!("GPU figures skipped: {reason}\n"),
            (None, None) => {}
        }
        s
    }
}

/// A cold epoch against the I/O roofline, as the storage read it: streamed under a full
/// shuffle, samples/s over random reads/s; streamed otherwise, the rows' bytes/s over the
/// sequential rate; warmed, the epoch against one sequential read of the files.
fn against(dataset: &DatasetInfo, io: &super::io::IoRoofline, name: &str, e: &ColdEpoch) -> String {
    let sequential = io.sequential_bytes_per_s.max(1e-9);
    match e.storage {
        Storage::Streaming if name == "full" => format!(
            "  {name} shuffle, streamed: {:.0}% of the random reads (samples/s over reads/s)\n",
            100.0 * e.samples_per_s / io.random_iops.max(1e-9)
        ),
        Storage::Streaming => format!(
            "  {name} shuffle, streamed: {:.0}% of the sequential rate (the rows' bytes/s)\n",
            100.0 * e.samples_per_s * dataset.row_bytes as f64 / sequential
        ),
        Storage::Warming => {
            let read = dataset.file_bytes as f64 / sequential;
            format!(
                "  {name} shuffle, warmed: the epoch took {:.2}x one sequential read of the files ({read:.2} s)\n",
                e.epoch_s / read
            )
        }
        Storage::Warm => String::new(),
    }
}

fn gpu_text(g: &super::gpu::GpuBench) -> String {
    let h = &g.h2d;
    let mut s = format!("GPU {}:\n", g.device);
    s += &format!(
        "  H2D GB/s: bare pinned {:.1}, write-combined {:.1}, pageable {:.1}, freshly written pinned {:.1}\n",
        h.bare_pinned_gb_s, h.bare_write_combined_gb_s, h.bare_pageable_gb_s, h.bare_fresh_gb_s
    );
    s += &format!(
        "  feeder copies {:.1} GB/s = {:.0}% of bare pinned, {:.0}% of freshly written (wall {:.1}); from write-combined buffers {:.1}\n",
        h.feeder_copy_gb_s,
        100.0 * h.feeder_vs_bare,
        100.0 * h.feeder_vs_fresh,
        h.feeder_wall_gb_s,
        h.feeder_copy_write_combined_gb_s
    );
    let o = &g.overlap;
    s += &format!(
        "  overlap ({} workers, hidden {}): {:.3} s overlapped vs {:.3} s serialised; copy {:.3} s, compute {:.3} s, gather {:.3} s: {:.2}x the slowest stage\n",
        o.workers, o.hidden, o.overlapped_s, o.serialised_s, o.copy_s, o.compute_s, o.gather_s, o.overlapped_vs_slowest
    );
    for w in &g.warmup {
        let path = if w.device_cache {
            "device cache"
        } else {
            "host path"
        };
        s += &format!(
            "  warm-up paid first, {path}: epoch 0 {:.3} s against a steady {:.3} s ({:.2}x)\n",
            w.first_s, w.steady_s, w.ratio
        );
    }
    for c in &g.cache {
        s += &format!(
            "  device cache, {} worker(s): epoch {:.3} s from the host path, {:.3} s from the cache ({:.1}x)\n",
            c.workers, c.uncached_s, c.cached_s, c.speedup
        );
    }
    s
}
