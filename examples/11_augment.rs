//! Augmentation: random crops, flips and normalisation of an image column, in the
//! loader's workers.
//!
//! ```text
//! cargo run --release --example 11_augment
//! ```
//!
//! Image models train on augmented images: each epoch sees each image cropped and
//! flipped anew. [`Augment`] draws each sample's crop and flip from
//! `(seed, epoch, sample)`, so an augmented epoch is the same on any worker count and
//! after a resume, and writes the column as normalised `float32`.

use std::time::Instant;

use stokehold::gen::{classification, ClassificationSpec};
use stokehold::{Augment, Dataset, Loader, NpyDataset, Shuffle};

fn main() -> stokehold::Result<()> {
    // A CIFAR-shaped set in a temporary directory (deleted at the end).
    let dir = tempfile::tempdir().expect("a temporary directory");
    let spec = ClassificationSpec {
        samples: 20_000,
        shape: vec![3, 32, 32],
        classes: 10,
        ..ClassificationSpec::default()
    };
    classification(dir.path(), &spec, &|_| {})?;
    let augment = Augment::new("x", 7)
        .crop(4)
        .flip(true)
        .normalize(&[0.4914, 0.4822, 0.4465], &[0.2470, 0.2435, 0.2616]);
    let build = |augment: Option<Augment>| -> stokehold::Result<Loader> {
        let mut b = Loader::builder(NpyDataset::open(dir.path())?)
            .batch_size(256)
            .shuffle(Shuffle::Full { seed: 7 })
            .workers(2);
        if let Some(a) = augment {
            b = b.augment(a);
        }
        b.build()
    };
    let mut plain = build(None)?;
    let mut loader = build(Some(augment.clone()))?;
    let x = &loader.layout().columns()[0];
    println!("column {}: {} {:?} a sample", x.name, x.dtype, x.shape);

    // Each row is its sample augmented by the draw of (seed, epoch, sample): check the
    // first batch of two epochs against the augmenter applied to the raw sample.
    let raw = NpyDataset::open(dir.path())?;
    let augmenter = augment.bind(raw.columns())?;
    let image = 3 * 32 * 32;
    for epoch in 0..2 {
        let batch = loader.epoch(epoch)?.next().expect("a batch")?;
        let xs = batch.column::<f32>(0)?;
        for (k, &i) in batch.indices().iter().enumerate().take(8) {
            let (mut px, mut y) = (vec![0u8; image], vec![0u8; 8]);
            raw.gather(epoch, &[i], &mut [&mut px, &mut y])?;
            let (mut out, mut label) = (vec![0u8; image * 4], vec![0u8; 8]);
            augmenter.apply(epoch, &[i], &[&px, &y], &mut [&mut out, &mut label])?;
            let want: Vec<f32> = out
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes(b.try_into().expect("4 bytes")))
                .collect();
            assert_eq!(&xs[k * image..(k + 1) * image], &want[..]);
        }
        let d = augment.draw(epoch, batch.indices()[0]);
        println!(
            "epoch {epoch}: sample {} moved by ({}, {}){}; 8 rows checked",
            batch.indices()[0],
            d.dy,
            d.dx,
            if d.flip { ", flipped" } else { "" }
        );
    }

    // What it costs: an epoch with and without (warm cache, threads started).
    let seconds = |loader: &mut Loader, epoch| -> stokehold::Result<f64> {
        let t = Instant::now();
        for batch in loader.epoch(epoch)? {
            batch?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    seconds(&mut plain, 0)?;
    let (a, b) = (seconds(&mut plain, 1)?, seconds(&mut loader, 2)?);
    println!(
        "an epoch of {} samples: {:.1} ms plain, {:.1} ms augmented (float32 out: 4x the bytes)",
        spec.samples,
        a * 1e3,
        b * 1e3
    );
    Ok(())
}
