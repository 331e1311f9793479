//! The epoch timers and report as a library API around a loop of the user's own.

mod common;

use std::sync::Arc;

use common::DIGITS;
use stokehold::report::{EpochTimer, Setup, TrainReport};
use stokehold::{pagecache, Loader, NpyDataset, Shuffle};

#[test]
fn a_users_loop_gets_the_rows_and_the_warmup_split() {
    // A copy of its own: another test reading the same files would refill the page cache.
    let dir = tempfile::tempdir().unwrap();
    for f in ["x.npy", "y.npy"] {
        std::fs::copy(format!("{DIGITS}/{f}"), dir.path().join(f)).unwrap();
        // Written back, or the page cache could not drop the new (dirty) pages.
        std::fs::File::open(dir.path().join(f))
            .unwrap()
            .sync_all()
            .unwrap();
    }
    let ds = Arc::new(NpyDataset::open(dir.path()).unwrap());
    let mut loader = Loader::builder_shared(ds.clone())
        .batch_size(100)
        .shuffle(Shuffle::Full { seed: 4 })
        .workers(2)
        .build()
        .unwrap();
    let mut report = TrainReport::new("test loop", DIGITS, &loader);
    assert_eq!((report.samples, report.bytes_per_sample), (1797, 64 + 8));
    report.setup = Setup::of_loader(&loader);
    assert!(report.setup.pool_alloc_s > 0.0);
    pagecache::evict(ds.as_ref()).unwrap();
    for epoch in 0..3 {
        let mut timer = EpochTimer::new(loader.epoch(epoch).unwrap(), ds.as_ref()).unwrap();
        let mut batches = 0;
        while let Some(batch) = timer.next() {
            let batch = batch.unwrap();
            let y: &[i64] = batch.column(1).unwrap();
            // A "step" whose loss is 1 per sample and which gets the even labels right.
            let correct = timer.step(|| y.iter().filter(|&&l| l % 2 == 0).count() as u64);
            timer.copy(|| std::hint::black_box(batch.as_bytes().len()));
            timer.record(y.len() as f64, correct, y.len() as u64);
            batches += 1;
        }
        assert_eq!(batches, 18);
        report.push(timer.finish().unwrap());
    }
    let labels = stokehold::NpyArray::open(format!("{DIGITS}/y.npy")).unwrap();
    let even = (0..labels.rows())
        .filter(|&i| i64::from_le_bytes(labels.row(i).unwrap().try_into().unwrap()) % 2 == 0)
        .count() as f64;
    for (e, row) in report.epochs.iter().enumerate() {
        assert_eq!(row.epoch, e as u64);
        assert_eq!(row.samples, 1797);
        assert_eq!(row.loss, 1.0);
        assert!(
            (row.accuracy - even / 1797.0).abs() < 1e-12,
            "{}",
            row.accuracy
        );
        assert!(row.wall_s >= row.compute_s + row.copy_s + row.wait_data_s);
        assert!(row.first_batch_s > 0.0 && row.gather_s > 0.0);
        assert_eq!(row.residency_end.fraction(), 1.0, "read whole by the end");
    }
    assert!(
        report.epochs[0].residency_start.fraction() < 1.0,
        "evicted before epoch 0"
    );
    let w = report.warmup.expect("three epochs give a split");
    // Epoch 0 against the later epoch of median time (the slower of two), every cause
    // against that one epoch; a loop in series stalls for each wait and each copy.
    let (e0, e1, e2) = (&report.epochs[0], &report.epochs[1], &report.epochs[2]);
    let steady = if e1.wall_s > e2.wall_s { e1 } else { e2 };
    assert_eq!(w.first_s, e0.wall_s);
    assert_eq!(w.steady_s, steady.wall_s);
    for r in [e0, e1, e2] {
        assert_eq!((r.stall_data_s, r.stall_copy_s), (r.wait_data_s, r.copy_s));
    }
    // The cold page cache is epoch 0's extra wait for data, the step's its extra compute.
    assert_eq!(w.cold_cache_s, e0.wait_data_s - steady.wait_data_s);
    assert_eq!(w.compute_s, e0.compute_s - steady.compute_s);
    assert_eq!(w.copy_s, e0.copy_s - steady.copy_s);
    assert_eq!(w.excess_s, e0.wall_s - steady.wall_s);
    let text = report.warmup_text();
    assert!(text.contains("unexplained"), "{text}");
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["epochs"].as_array().unwrap().len(), 3);
    assert_eq!(json["device"], "test loop");
}

#[test]
fn an_epoch_ended_early_reports_what_it_saw() {
    let ds = Arc::new(NpyDataset::open(DIGITS).unwrap());
    let mut loader = Loader::builder_shared(ds.clone())
        .batch_size(100)
        .workers(2)
        .build()
        .unwrap();
    let mut timer = EpochTimer::new(loader.epoch(0).unwrap(), ds.as_ref()).unwrap();
    for _ in 0..3 {
        let batch = timer.next().unwrap().unwrap();
        timer.record(0.5 * batch.len() as f64, 0, batch.len() as u64);
    }
    let row = timer.finish().unwrap();
    assert_eq!(row.samples, 300);
    assert_eq!(row.loss, 0.5);
    // The loader is whole again: the next epoch runs.
    assert_eq!(loader.epoch(1).unwrap().count(), 18);
}

#[test]
fn copies_overlapped_with_the_step_count_as_copy_time_but_not_as_a_stall() {
    use std::time::Duration;
    use stokehold::model::Metrics;
    use stokehold::report::EpochRow;
    use stokehold::report::LoopTimes;

    let ds = Arc::new(NpyDataset::open(DIGITS).unwrap());
    let mut loader = Loader::builder_shared(ds.clone())
        .batch_size(100)
        .build()
        .unwrap();
    let mut epoch = loader.epoch(0).unwrap();
    for b in epoch.by_ref() {
        b.unwrap();
    }
    let stats = epoch.stats();
    drop(epoch);
    let r = pagecache::residency(ds.as_ref()).unwrap();
    let times = LoopTimes {
        wall: Duration::from_secs(10),
        wait: Duration::from_secs(1),
        copy: Duration::from_secs(2),
        compute: Duration::from_secs(5),
        overlapped_copy: Duration::from_secs(3),
    };
    let row = EpochRow::of_loop(0, stats, Metrics::default(), times, 72, (r, r));
    assert_eq!((row.copy_s, row.stall_copy_s), (5.0, 2.0));
    assert_eq!((row.wait_data_s, row.stall_data_s), (1.0, 1.0));
}
