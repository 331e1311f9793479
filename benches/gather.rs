//! Criterion: one loader epoch against the bare-gather roofline on the same rows, plus
//! the index permutation alone. A page-cached CIFAR-shaped set of 20,000 samples is
//! generated in a temporary directory (`stokehold bench` runs the full-size comparison).
//!
//! `cargo bench --bench gather`

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use stokehold::bench::{loader_epoch, Roofline};
use stokehold::gen::{self, ClassificationSpec};
use stokehold::{pagecache, Dataset, Loader, NpyDataset, Order, Permutation, Shard, Shuffle};

const SAMPLES: u64 = 20_000;
const BATCH: usize = 256;
const WORKERS: usize = 2;

fn gather(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let spec = ClassificationSpec {
        samples: SAMPLES,
        ..ClassificationSpec::default()
    };
    gen::classification(dir.path(), &spec, &|_| {}).expect("dataset written");
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(dir.path()).expect("dataset opens"));
    pagecache::read_ahead(ds.as_ref()).expect("read-ahead");

    let shuffle = Shuffle::Full { seed: 1 };
    let mut loader = Loader::builder_shared(Arc::clone(&ds))
        .batch_size(BATCH)
        .workers(WORKERS)
        .shuffle(shuffle)
        .build()
        .expect("loader");
    let order = Order::new(SAMPLES, shuffle, Shard::single(), BATCH as u64, false).unwrap();
    let e = order.epoch(0);
    let mut indices = Vec::new();
    let mut batch = Vec::new();
    for b in 0..e.batches() {
        e.batch(b, &mut batch);
        indices.extend_from_slice(&batch);
    }
    let roofline = Roofline::new(Arc::clone(&ds), loader.layout(), WORKERS).expect("roofline");
    let indices: Arc<[u64]> = indices.into();

    let mut group = c.benchmark_group("epoch");
    group.throughput(Throughput::Elements(SAMPLES));
    group.sample_size(20);
    group.bench_function("roofline", |b| {
        b.iter(|| roofline.pass(0, Arc::clone(&indices)).unwrap())
    });
    group.bench_function("loader", |b| {
        b.iter(|| loader_epoch(&mut loader, 0).unwrap())
    });
    group.finish();

    let mut group = c.benchmark_group("permutation");
    group.throughput(Throughput::Elements(BATCH as u64));
    let p = Permutation::new(200_000, 7);
    let mut xs: Vec<u64> = (0..BATCH as u64).collect();
    group.bench_function("apply_in_place_256", |b| {
        b.iter(|| {
            xs.iter_mut().enumerate().for_each(|(i, x)| *x = i as u64);
            p.apply_in_place(std::hint::black_box(&mut xs));
        })
    });
    group.finish();
}

criterion_group!(benches, gather);
criterion_main!(benches);
