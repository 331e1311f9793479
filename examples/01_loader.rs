//! The basics: a shuffled, prefetching loader over the shipped `digits` dataset.
//!
//! ```text
//! cargo run --example 01_loader
//! ```
//!
//! `datasets/digits` holds two NumPy files: `x.npy`, 1797 images of 8x8 `uint8` pixels,
//! and `y.npy`, their 1797 `int64` labels (0-9). Opening the directory maps both files
//! read-only; nothing is read until a batch needs it.

use std::time::Duration;

use stokehold::{Loader, NpyDataset, Shuffle};

fn main() -> stokehold::Result<()> {
    // A directory opens as columns: `x.npy` is column 0, `y.npy` column 1.
    let ds = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;

    // Batches of 256 samples, a new shuffle every epoch (a pure function of the seed and
    // the epoch number), two worker threads assembling up to four batches ahead.
    let mut loader = Loader::builder(ds)
        .batch_size(256)
        .shuffle(Shuffle::Full { seed: 42 })
        .workers(2)
        .prefetch(4)
        .build()?;

    for c in loader.layout().columns() {
        println!(
            "column {:<2} {:<8} sample shape {:?}",
            c.name,
            c.dtype.name(),
            c.shape
        );
    }
    println!(
        "{} batches per epoch, {} host buffers of {} bytes, allocated once\n",
        loader.batches(),
        loader.buffers(),
        loader.layout().bytes()
    );

    for e in 0..3 {
        // `epoch(e)` hands the epoch's batches to the workers and returns an iterator
        // that yields them in order. Keep it in a variable to read its stats afterwards.
        let mut it = loader.epoch(e)?;
        let mut histogram = [0u64; 10];
        let (mut pixel_sum, mut pixels) = (0u64, 0u64);
        let mut first_labels = Vec::new();

        for batch in it.by_ref() {
            // Each item is a `Result`: a failed read ends the epoch with an error.
            let batch = batch?;
            // Zero-copy views of the batch's host buffer, typed after the .npy dtypes;
            // asking for the wrong type is an `Error::DType`, never garbage.
            let x: &[u8] = batch.column(0)?; // batch.len() * 64 pixels
            let y: &[i64] = batch.column(1)?; // batch.len() labels
            for &label in y {
                histogram[label as usize] += 1;
            }
            pixel_sum += x.iter().map(|&p| p as u64).sum::<u64>();
            pixels += x.len() as u64;
            if batch.number() == 0 {
                first_labels.extend_from_slice(&y[..8]);
            }
            // Dropping `batch` here returns its buffer to the pool for the workers.
        }
        let stats = it.stats();

        println!("epoch {e}: first labels {first_labels:?}");
        println!(
            "  {} batches, {} samples, mean pixel {:.3}",
            stats.batches,
            stats.samples,
            pixel_sum as f64 / pixels as f64
        );
        // Every epoch visits every sample once, in a new order: the first labels change,
        // the histogram and the mean do not.
        println!("  labels 0-9: {histogram:?}");
        println!(
            "  gather {:?} (worker time), waited {:?}, first batch after {:?}",
            stats.gather,
            stats.waited,
            stats.first_batch.unwrap_or(Duration::ZERO)
        );
    }

    // After a whole epoch `e` the loader stands at (e + 1, 0): see 02_resume.rs.
    println!("\nloader state: {:?}", loader.state());
    Ok(())
}
