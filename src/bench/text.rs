//! `stokehold bench`'s report as text: the same figures as its JSON, one line each.

use super::BenchReport;

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
                    "cold cache, {name:<5} shuffle: {:>7.2} s  {:>10.0} samples/s  read {:.0} MB ({:.2}x the rows), {}, resident {:.0}% -> {:.0}%\n",
                    e.epoch_s,
                    e.samples_per_s,
                    e.bytes_read as f64 / 1e6,
                    e.read_amplification,
                    e.storage.name(),
                    100.0 * e.residency_before.fraction(),
                    100.0 * e.residency_after.fraction()
                );
            }
        }
        match (&self.io_roofline, &self.io_roofline_skipped) {
            (Some(io), _) => {
                s += &format!(
                    "I/O roofline (direct I/O on {}): sequential {:.2} GB/s, random {:.0} reads/s of {} bytes at depth 32\n",
                    io.file,
                    io.sequential_bytes_per_s / 1e9,
                    io.random_iops,
                    io.random_read_bytes
                );
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
