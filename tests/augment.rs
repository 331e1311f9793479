//! Augmentation through the loader: each row is its sample cropped, flipped and
//! normalised by the draw of `(seed, epoch, sample)`, the same on any worker count,
//! warm or streamed from storage, and after an exact resume; bad settings are errors.

use std::path::Path;

use stokehold::gen::NpyWriter;
use stokehold::{Augment, DType, Dataset, Loader, LoaderState, NpyDataset, Shuffle};

const N: u64 = 500;
const SHAPE: [u64; 3] = [3, 24, 24];
const IMAGE: usize = 3 * 24 * 24;

/// `x.npy`: N images of pseudo-random bytes; `y.npy`: each sample's index.
fn write(dir: &Path) {
    let mut x = NpyWriter::create(dir.join("x.npy"), DType::U8, &[N, 3, 24, 24]).unwrap();
    for (i, b) in x.data_mut().iter_mut().enumerate() {
        *b = ((i as u64).wrapping_mul(0x9e37_79b9) >> 11) as u8;
    }
    x.finish().unwrap();
    let mut y = NpyWriter::create(dir.join("y.npy"), DType::I64, &[N]).unwrap();
    for (i, out) in y.data_mut().chunks_exact_mut(8).enumerate() {
        out.copy_from_slice(&(i as i64).to_le_bytes());
    }
    y.finish().unwrap();
}

fn augment() -> Augment {
    Augment::new("x", 3)
        .crop(4)
        .flip(true)
        .normalize(&[0.49, 0.48, 0.45], &[0.25, 0.24, 0.26])
}

/// Every row of an epoch (or its first `stop` batches): its index, label and pixels.
fn rows(loader: &mut Loader, epoch: u64, stop: Option<usize>) -> Vec<(u64, i64, Vec<f32>)> {
    let mut out = Vec::new();
    for batch in loader
        .epoch(epoch)
        .unwrap()
        .take(stop.unwrap_or(usize::MAX))
    {
        let batch = batch.unwrap();
        let x = batch.column_named::<f32>("x").unwrap();
        let y = batch.column_named::<i64>("y").unwrap();
        for (k, &i) in batch.indices().iter().enumerate() {
            out.push((i, y[k], x[k * IMAGE..(k + 1) * IMAGE].to_vec()));
        }
    }
    out
}

/// Sample `i` of `epoch`, augmented on its own from the dataset's bytes.
fn expected(ds: &NpyDataset, epoch: u64, i: u64) -> Vec<f32> {
    let a = augment().bind(ds.columns()).unwrap();
    let (mut x, mut y) = (vec![0u8; IMAGE], vec![0u8; 8]);
    ds.gather(epoch, &[i], &mut [&mut x, &mut y]).unwrap();
    let mut out = vec![0u8; IMAGE * 4];
    let mut label = vec![0u8; 8];
    a.apply(epoch, &[i], &[&x, &y], &mut [&mut out, &mut label])
        .unwrap();
    out.chunks_exact(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect()
}

fn loader(dir: &Path, workers: usize, budget: Option<u64>) -> Loader {
    let mut b = Loader::builder(NpyDataset::open(dir).unwrap())
        .batch_size(32)
        .shuffle(Shuffle::Full { seed: 9 })
        .workers(workers)
        .augment(augment());
    if let Some(bytes) = budget {
        b = b.page_cache_budget(bytes);
    }
    b.build().unwrap()
}

#[test]
fn rows_are_their_samples_augmented_whatever_the_workers_or_storage() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let ds = NpyDataset::open(dir.path()).unwrap();
    let mut one = loader(dir.path(), 1, None);
    assert_eq!(one.layout().columns()[0].dtype, DType::F32);
    assert_eq!(one.layout().columns()[0].shape, SHAPE);
    for epoch in 0..2 {
        let want = rows(&mut one, epoch, None);
        assert_eq!(want.len() as u64, N);
        for (i, label, x) in &want {
            assert_eq!(*label, *i as i64);
            assert_eq!(x, &expected(&ds, epoch, *i), "epoch {epoch} sample {i}");
        }
        for (workers, budget) in [(2, None), (3, None), (2, Some(0))] {
            let got = rows(&mut loader(dir.path(), workers, budget), epoch, None);
            assert!(
                got == want,
                "{workers} workers, budget {budget:?}, epoch {epoch}"
            );
        }
    }
    // Another epoch draws other crops for the same sample.
    assert_ne!(expected(&ds, 0, 5), expected(&ds, 1, 5));
}

#[test]
fn an_augmented_epoch_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let mut whole = loader(dir.path(), 2, None);
    let all = rows(&mut whole, 1, None);
    let mut first = loader(dir.path(), 2, None);
    let head = rows(&mut first, 1, Some(5));
    let state: LoaderState = first.state();
    let mut second = Loader::builder(NpyDataset::open(dir.path()).unwrap())
        .batch_size(32)
        .shuffle(Shuffle::Full { seed: 9 })
        .workers(3)
        .augment(augment())
        .resume(state)
        .build()
        .unwrap();
    let tail = rows(&mut second, 1, None);
    assert_eq!(head.len() + tail.len(), all.len());
    assert!(head.iter().chain(&tail).eq(all.iter()));
}

#[test]
fn bad_augmentations_are_errors_naming_the_column() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let build = |a: Augment| {
        Loader::builder(NpyDataset::open(dir.path()).unwrap())
            .augment(a)
            .build()
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let e = build(Augment::new("image", 0));
    assert!(
        e.contains("\"image\"") && e.contains("no such column"),
        "{e}"
    );
    let e = build(Augment::new("y", 0));
    assert!(e.contains("\"y\"") && e.contains("uint8"), "{e}");
    let e = build(Augment::new("x", 0).normalize(&[0.5, 0.5], &[0.5, 0.5]));
    assert!(e.contains("2 values of mean for 3 channels"), "{e}");
    let e = build(
        Augment::new("x", 0)
            .channels_last(true)
            .normalize(&[0.5; 3], &[1.0; 3]),
    );
    assert!(e.contains("24 channels"), "{e}");
}
