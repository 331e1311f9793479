//! The CPU backend learns: digits, a generated CIFAR-shaped set, and bad labels.

mod common;

use std::sync::Arc;

use common::write_bad_label_set;
use stokehold::cpu::CpuTrainer;
use stokehold::gen::{self, ClassificationSpec, NpyWriter};
use stokehold::model::{Mlp, MlpConfig, Normalize};
use stokehold::{DType, Dataset, Error, Loader, NpyArray, NpyDataset, Shuffle};

fn trainer_for(ds: &Arc<dyn Dataset>, loader: &Loader, hidden: usize, lr: f32) -> CpuTrainer {
    let inputs = ds.columns()[0].row_bytes;
    let mlp = Mlp::new(MlpConfig {
        inputs,
        hidden,
        classes: 10,
        lr,
        seed: 1,
    })
    .unwrap();
    let sample: Vec<u8> = (0..ds.len().min(512))
        .flat_map(|i| {
            let mut row = vec![0u8; inputs];
            let mut y = vec![0u8; 8];
            ds.gather(0, &[i], &mut [&mut row, &mut y]).unwrap();
            row
        })
        .collect();
    CpuTrainer::new(mlp, Normalize::fit(&sample), loader.layout(), (0, 1), 3).unwrap()
}

#[test]
fn digits_reach_90_percent_within_10_epochs() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(dir).unwrap());
    let mut loader = Loader::builder_shared(ds.clone())
        .batch_size(64)
        .shuffle(Shuffle::Full { seed: 4 })
        .workers(2)
        .build()
        .unwrap();
    let mut trainer = trainer_for(&ds, &loader, 64, 0.1);
    let mut best = 0.0;
    for epoch in 0..10 {
        let out = trainer.train_epoch(loader.epoch(epoch).unwrap()).unwrap();
        assert_eq!(out.metrics.samples, 1797);
        assert_eq!(out.batches, 29);
        best = out.metrics.accuracy();
        if best >= 0.9 {
            break;
        }
    }
    assert!(best >= 0.9, "training accuracy {best}");
}

#[test]
fn a_generated_cifar_shaped_set_reaches_95_percent() {
    let dir = generated(4000);
    let acc = train_generated(dir.path(), 5);
    assert!(acc >= 0.95, "training accuracy {acc}");
}

/// A generated CIFAR-shaped set of `samples` in a temporary directory.
fn generated(samples: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let spec = ClassificationSpec {
        samples,
        ..ClassificationSpec::default()
    };
    gen::classification(dir.path(), &spec, &|_| {}).unwrap();
    dir
}

/// Trains on the set in `dir` for up to `epochs` (stopping at 95%); the last accuracy.
fn train_generated(dir: &std::path::Path, epochs: u64) -> f64 {
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(dir).unwrap());
    let mut loader = Loader::builder_shared(ds.clone())
        .batch_size(128)
        .workers(2)
        .build()
        .unwrap();
    let mut trainer = trainer_for(&ds, &loader, 32, 0.05);
    let mut acc = 0.0;
    for epoch in 0..epochs {
        acc = trainer
            .train_epoch(loader.epoch(epoch).unwrap())
            .unwrap()
            .metrics
            .accuracy();
        if acc >= 0.95 {
            break;
        }
    }
    acc
}

#[test]
fn shuffled_labels_do_not_learn() {
    // The same images with labels that do not follow them: a loader that mixed up
    // samples and labels would look like this, and must not pass the tests above.
    let dir = generated(4000);
    let y = NpyArray::open(dir.path().join("y.npy")).unwrap();
    let mut w = NpyWriter::create(dir.path().join("y.npy"), DType::I64, &[4000]).unwrap();
    for (i, out) in w.data_mut().chunks_exact_mut(8).enumerate() {
        out.copy_from_slice(y.row(((i * 7919) % 4000) as u64).unwrap());
    }
    drop(y);
    w.finish().unwrap();
    let acc = train_generated(dir.path(), 3);
    assert!(acc < 0.5, "learned from mismatched labels: {acc}");
}

#[test]
fn a_bad_label_is_an_error_naming_the_sample_and_nothing_hangs() {
    let dir = tempfile::tempdir().unwrap();
    write_bad_label_set(dir.path());
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(dir.path()).unwrap());
    let mut loader = Loader::builder_shared(ds.clone())
        .batch_size(16)
        .workers(2)
        .build()
        .unwrap();
    let mut trainer = trainer_for(&ds, &loader, 8, 0.1);
    let the_bad_label = |e: Error| {
        let bad = matches!(
            e,
            Error::Label {
                label: 42,
                sample: Some(123),
                ..
            }
        );
        assert!(bad, "{e}");
    };
    the_bad_label(trainer.train_epoch(loader.epoch(0).unwrap()).unwrap_err());
    // Buffers came back and the next epoch starts (and fails the same way).
    assert_eq!(loader.free_buffers(), loader.buffers());
    the_bad_label(trainer.train_epoch(loader.epoch(1).unwrap()).unwrap_err());
}

#[test]
fn the_main_job_reports_every_epoch_and_the_warmup_split() {
    let dir = tempfile::tempdir().unwrap();
    let trace_path = dir.path().join("trace.json");
    let config = stokehold::train::TrainConfig {
        data: concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits").into(),
        epochs: 3,
        batch: 64,
        workers: 2,
        prefetch: None,
        page_cache_budget: None,
        direct_reads: true,
        shuffle: Shuffle::Full { seed: 1 },
        device: stokehold::device::DeviceChoice::Cpu,
        hidden: 32,
        lr: 0.1,
        cold: true,
        warmup: false,
        seed: 1,
        quiet: true,
        trace: Some(trace_path.clone()),
        device_cache: true,
        pinned: stokehold::cuda::PinnedKind::Plain,
        crop: 0,
        flip: false,
    };
    let report = stokehold::train::run(&config).unwrap();
    assert_eq!(report.epochs.len(), 3);
    assert_eq!(report.samples, 1797);
    for row in &report.epochs {
        assert_eq!(row.samples, 1797);
        assert!(row.wall_s > 0.0 && row.samples_per_s > 0.0);
        assert!(row.compute_s > 0.0 && row.gather_s > 0.0);
        // The step's stalls and steps are on its own thread, within the epoch.
        assert!(row.stall_data_s + row.stall_copy_s + row.compute_s <= row.wall_s);
        assert!(
            row.residency_end.fraction() > 0.99,
            "read back in: {:?}",
            row.residency_end
        );
    }
    let w = report.warmup.expect("three epochs give a split");
    assert_eq!(w.first_s, report.epochs[0].wall_s);
    assert!(w.ratio > 0.0 && (w.ratio - w.first_s / w.steady_s).abs() < 1e-9);
    // Each cause against the steady epoch, the later one of median wall time (of two,
    // the slower), as the table explains it.
    let (e0, e1, e2) = (&report.epochs[0], &report.epochs[1], &report.epochs[2]);
    let steady = if e1.wall_s > e2.wall_s { e1 } else { e2 };
    assert_eq!(w.steady_s, steady.wall_s);
    assert_eq!(w.excess_s, e0.wall_s - steady.wall_s);
    assert_eq!(w.cold_cache_s, e0.stall_data_s - steady.stall_data_s);
    assert_eq!(w.compute_s, e0.compute_s - steady.compute_s);
    assert_eq!(w.copy_s, e0.stall_copy_s - steady.stall_copy_s);
    assert!(report.table().lines().count() == 4);
    assert!(report.warmup_text().contains("unexplained"));
    let json = serde_json::to_value(&report).unwrap();
    assert!(json.pointer("/epochs/2/loss").is_some());
    assert!(json.pointer("/warmup/cold_cache_s").is_some());
    // Every key the JSON has is in the README's schema (scripts rely on it).
    let readme = include_str!("../README.md");
    let schema = readme
        .split("## `stokehold train --json FILE`: the schema")
        .nth(1)
        .and_then(|s| s.split("```text").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("the README's schema block");
    let words: std::collections::HashSet<&str> = schema
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    let mut keys = Vec::new();
    for (at, value) in [
        ("", &json),
        ("setup.", &json["setup"]),
        ("epochs[].", &json["epochs"][0]),
        ("residency_start.", &json["epochs"][0]["residency_start"]),
        ("warmup.", &json["warmup"]),
    ] {
        for key in value.as_object().expect("an object").keys() {
            keys.push(format!("{at}{key}"));
        }
    }
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !words.contains(k.rsplit('.').next().unwrap()))
        .collect();
    assert!(
        missing.is_empty(),
        "not in the README's schema: {missing:?}"
    );
    // The trace has a span per batch per stage: 29 batches x 3 epochs each.
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace_path).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for stage in [
        "gather",
        "copy",
        "compute",
        "wait for data",
        "wait for copy",
    ] {
        let n = events.iter().filter(|e| e["name"] == stage).count();
        assert_eq!(n, 87, "{stage} spans");
    }
    let workers = events
        .iter()
        .filter(|e| {
            e["ph"] == "M"
                && e["args"]["name"]
                    .as_str()
                    .unwrap()
                    .starts_with("gather worker")
        })
        .count();
    assert!((1..=2).contains(&workers), "{workers} worker threads named");
}

#[test]
fn another_loaders_batches_are_refused_not_a_panic() {
    // An evaluation loader with twice the batch, or a smaller one, fed to a trainer
    // made for another loader: its batches do not fit the trainer's slots.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(dir).unwrap());
    let loader = |batch| {
        Loader::builder_shared(ds.clone())
            .batch_size(batch)
            .build()
            .unwrap()
    };
    let train = loader(64);
    let mut trainer = trainer_for(&ds, &train, 16, 0.1);
    for batch in [128, 32] {
        let mut other = loader(batch);
        for serial in [false, true] {
            stokehold::Trainer::set_serial(&mut trainer, serial).unwrap();
            let err = trainer.train_epoch(other.epoch(0).unwrap()).unwrap_err();
            assert!(
                err.to_string().contains("another loader's layout"),
                "batch {batch}, serial {serial}: {err}"
            );
        }
    }
}
