//! stokehold's epoch timers and report around a training step of your own.
//!
//! The step here is a softmax regression written out by hand (no stokehold model): the
//! `EpochTimer` times the waits for batches and the step, reads the page-cache residency
//! at each epoch's start and end, and the `TrainReport` prints the same table and
//! warm-up split as `stokehold train`. The dataset is evicted from the page cache first,
//! so the first epoch's cold reads show.
//!
//! `cargo run --release --example 06_own_loop`

use std::sync::Arc;

use stokehold::report::{EpochTimer, Setup, TrainReport};
use stokehold::{pagecache, Dataset, Loader, NpyDataset, Shuffle};

const CLASSES: usize = 10;

/// One SGD step of softmax regression on a batch; returns (loss sum, correct).
fn step(w: &mut [f32], x: &[u8], y: &[i64], inputs: usize, lr: f32) -> (f64, u64) {
    let n = y.len();
    let mut grad = vec![0f32; w.len()];
    let (mut loss, mut correct) = (0f64, 0u64);
    for (row, &label) in x.chunks_exact(inputs).zip(y) {
        let xs: Vec<f32> = row.iter().map(|&b| b as f32 / 16.0).collect();
        let mut z = [0f32; CLASSES];
        for (c, zc) in z.iter_mut().enumerate() {
            *zc = w[c * (inputs + 1) + inputs]
                + xs.iter()
                    .zip(&w[c * (inputs + 1)..])
                    .map(|(a, b)| a * b)
                    .sum::<f32>();
        }
        let max = z.iter().cloned().fold(f32::MIN, f32::max);
        let sum: f32 = z.iter().map(|v| (v - max).exp()).sum();
        let label = label as usize;
        loss += f64::from(sum.ln() - (z[label] - max));
        let best = (0..CLASSES)
            .max_by(|&a, &b| z[a].total_cmp(&z[b]))
            .unwrap_or(0);
        correct += u64::from(best == label);
        for c in 0..CLASSES {
            let p = (z[c] - max).exp() / sum - if c == label { 1.0 } else { 0.0 };
            let g = &mut grad[c * (inputs + 1)..(c + 1) * (inputs + 1)];
            for (gi, xi) in g.iter_mut().zip(&xs) {
                *gi += p * xi;
            }
            g[inputs] += p;
        }
    }
    for (wi, gi) in w.iter_mut().zip(&grad) {
        *wi -= lr * gi / n as f32;
    }
    (loss, correct)
}

fn main() -> stokehold::Result<()> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let ds = Arc::new(NpyDataset::open(path)?);
    let inputs = ds.columns()[0].row_bytes;
    let mut loader = Loader::builder_shared(ds.clone())
        .batch_size(64)
        .shuffle(Shuffle::Full { seed: 1 })
        .workers(2)
        .build()?;
    let mut w = vec![0f32; CLASSES * (inputs + 1)];
    let mut report = TrainReport::new("softmax regression (cpu)", path, &loader);
    report.setup = Setup::of_loader(&loader);
    pagecache::evict(ds.as_ref())?;
    for epoch in 0..5 {
        let mut timer = EpochTimer::new(loader.epoch(epoch)?, ds.as_ref())?;
        while let Some(batch) = timer.next() {
            let batch = batch?;
            let (x, y) = (batch.column::<u8>(0)?, batch.column::<i64>(1)?);
            let (loss, correct) = timer.step(|| step(&mut w, x, y, inputs, 0.5));
            timer.record(loss, correct, batch.len() as u64);
        }
        report.push(timer.finish()?);
    }
    print!("{}\n{}", report.table(), report.warmup_text());
    let last = report.epochs.last().map_or(0.0, |r| r.accuracy);
    assert!(
        last > 0.9,
        "softmax regression reaches 90% on digits: {last}"
    );
    Ok(())
}
