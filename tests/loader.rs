//! Loader behaviour: order invariants (property tests), resumption, early drop,
//! failures, buffer bounds.

mod common;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{CountingAlloc, Synth};
use proptest::prelude::*;
use stokehold::{
    Dataset, Error, Loader, LoaderState, NpyArray, NpyDataset, Shard, ShardTail, Shuffle,
};

/// Every batch of an epoch, as index lists, checking that content matches indices.
fn epoch_indices(loader: &mut Loader, epoch: u64) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    for batch in loader.epoch(epoch).unwrap() {
        let batch = batch.unwrap();
        assert_eq!(batch.epoch(), epoch);
        let ids: &[u64] = batch.column(0).unwrap();
        let triples: &[u32] = batch.column(1).unwrap();
        assert_eq!(ids, batch.indices(), "column content follows the indices");
        for (&i, &t) in ids.iter().zip(triples) {
            assert_eq!(t as u64, 3 * i);
        }
        assert_eq!(batch.number(), out.len() as u64);
        out.push(batch.indices().to_vec());
    }
    out
}

fn shuffle_strategy() -> impl Strategy<Value = Shuffle> {
    prop_oneof![
        Just(Shuffle::None),
        any::<u64>().prop_map(|seed| Shuffle::Full { seed }),
        (any::<u64>(), 1u64..40, 1u64..5).prop_map(|(seed, block_rows, window)| {
            Shuffle::Block {
                seed,
                block_rows,
                window,
            }
        }),
    ]
}

#[derive(Debug, Clone)]
struct Setup {
    n: u64,
    batch: usize,
    workers: usize,
    prefetch: usize,
    drop_last: bool,
    world: u64,
    tail: ShardTail,
    shuffle: Shuffle,
    epoch: u64,
}

fn setup_strategy() -> impl Strategy<Value = Setup> {
    (
        1u64..600,
        1usize..40,
        1usize..5,
        1usize..6,
        any::<bool>(),
        1u64..5,
        prop_oneof![Just(ShardTail::Pad), Just(ShardTail::Drop)],
        shuffle_strategy(),
        0u64..1000,
    )
        .prop_map(
            |(n, batch, workers, prefetch, drop_last, world, tail, shuffle, epoch)| Setup {
                n,
                batch,
                workers,
                prefetch,
                drop_last,
                world,
                tail,
                shuffle,
                epoch,
            },
        )
}

fn build(s: &Setup, rank: u64, workers: usize) -> stokehold::Result<Loader> {
    Loader::builder(Synth::new(s.n))
        .batch_size(s.batch)
        .workers(workers)
        .prefetch(s.prefetch)
        .drop_last(s.drop_last)
        .shuffle(s.shuffle)
        .shard(Shard::new(rank, s.world).unwrap().with_tail(s.tail))
        .build()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn each_index_once_per_epoch_over_all_ranks(s in setup_strategy()) {
        let per_rank = match s.tail {
            ShardTail::Pad => s.n.div_ceil(s.world),
            ShardTail::Drop => s.n / s.world,
        };
        let mut counts: HashMap<u64, u64> = HashMap::new();
        let mut per_rank_sets = Vec::new();
        for rank in 0..s.world {
            let loader = build(&s, rank, s.workers);
            let expected_batches = if s.drop_last { per_rank / s.batch as u64 } else { per_rank.div_ceil(s.batch as u64) };
            let mut loader = match loader {
                Ok(l) => l,
                Err(Error::Config(_)) => { prop_assert_eq!(expected_batches, 0); return Ok(()); }
                Err(e) => panic!("{e}"),
            };
            prop_assert_eq!(loader.batches(), expected_batches);
            let batches = epoch_indices(&mut loader, s.epoch);
            prop_assert_eq!(batches.len() as u64, expected_batches);
            for (k, b) in batches.iter().enumerate() {
                let full = k + 1 < batches.len() || s.drop_last || per_rank % s.batch as u64 == 0;
                if full { prop_assert_eq!(b.len(), s.batch); }
            }
            let all: Vec<u64> = batches.concat();
            for &i in &all {
                prop_assert!(i < s.n);
                *counts.entry(i).or_default() += 1;
            }
            per_rank_sets.push(all);
        }
        let total: u64 = counts.values().sum();
        if !s.drop_last {
            prop_assert_eq!(total, per_rank * s.world);
            if s.tail == ShardTail::Drop {
                prop_assert!(counts.values().all(|&c| c == 1), "an index repeats");
            } else {
                // Every index at least once; repeats only for the padding.
                prop_assert_eq!(counts.len() as u64, s.n);
                let repeats: u64 = counts.values().map(|c| c - 1).sum();
                prop_assert_eq!(repeats, per_rank * s.world - s.n);
            }
        } else if s.tail == ShardTail::Drop {
            prop_assert!(counts.values().all(|&c| c == 1), "an index repeats");
        }
        if s.tail == ShardTail::Drop {
            // Shards are disjoint.
            let mut seen = std::collections::HashSet::new();
            for set in &per_rank_sets {
                for &i in set { prop_assert!(seen.insert(i), "index {} on two ranks", i); }
            }
        }
    }

    #[test]
    fn order_does_not_depend_on_workers(s in setup_strategy()) {
        let rank = s.world - 1;
        let (Ok(mut one), Ok(mut eight)) = (build(&s, rank, 1), build(&s, rank, 8)) else {
            return Ok(());
        };
        prop_assert_eq!(epoch_indices(&mut one, s.epoch), epoch_indices(&mut eight, s.epoch));
    }

    #[test]
    fn resume_yields_the_rest_of_the_epoch(s in setup_strategy(), cut in 0.0f64..1.0) {
        let rank = 0;
        let Ok(mut whole) = build(&s, rank, s.workers) else { return Ok(()); };
        let expected = epoch_indices(&mut whole, s.epoch);
        let k = ((expected.len() as f64) * cut) as usize;
        let mut first = build(&s, rank, s.workers).unwrap();
        let state = {
            let mut it = first.epoch(s.epoch).unwrap();
            for _ in 0..k { it.next().unwrap().unwrap(); }
            it.state()
        };
        prop_assert_eq!((state.epoch, state.batch), (s.epoch, k as u64));
        prop_assert_eq!(first.state(), state);
        // A new loader, built from the saved state (as after a restart).
        let json = serde_json::to_string(&state).unwrap();
        let state: LoaderState = serde_json::from_str(&json).unwrap();
        let mut resumed = Loader::builder(Synth::new(s.n))
            .batch_size(s.batch).workers(s.workers).prefetch(s.prefetch).drop_last(s.drop_last)
            .shuffle(s.shuffle).shard(Shard::new(rank, s.world).unwrap().with_tail(s.tail))
            .resume(state).build().unwrap();
        let it = resumed.epoch(s.epoch).unwrap();
        prop_assert_eq!(it.len(), expected.len() - k);
        let rest: Vec<Vec<u64>> = it.map(|b| b.unwrap().indices().to_vec()).collect();
        prop_assert_eq!(&rest[..], &expected[k..]);
        prop_assert_eq!((resumed.state().epoch, resumed.state().batch), (s.epoch + 1, 0));
        // The next epoch is whole again.
        prop_assert_eq!(resumed.epoch(s.epoch + 1).unwrap().len(), expected.len());
        // The same through `Loader::resume` on a loader already built (and used).
        let mut later = build(&s, rank, s.workers).unwrap();
        drop(later.epoch(s.epoch + 3).unwrap());
        later.resume(state).unwrap();
        prop_assert_eq!(later.state(), state);
        let rest: Vec<Vec<u64>> = later.epoch(s.epoch).unwrap().map(|b| b.unwrap().indices().to_vec()).collect();
        prop_assert_eq!(&rest[..], &expected[k..]);
    }
}

#[test]
fn epochs_differ_and_repeat_exactly() {
    for shuffle in [Shuffle::Full { seed: 5 }, Shuffle::block(5)] {
        let mk = || {
            Loader::builder(Synth::new(5000))
                .batch_size(100)
                .shuffle(shuffle)
                .workers(3)
                .build()
                .unwrap()
        };
        let mut a = mk();
        let e0 = epoch_indices(&mut a, 0);
        let e1 = epoch_indices(&mut a, 1);
        assert_ne!(e0, e1, "{shuffle:?}: two epochs in the same order");
        let mut b = mk();
        assert_eq!(
            epoch_indices(&mut b, 1),
            e1,
            "{shuffle:?}: not reproducible"
        );
    }
}

#[test]
fn early_drop_returns_every_buffer_and_the_next_epoch_works() {
    let mut loader = Loader::builder(Synth::new(10_000))
        .batch_size(10)
        .workers(4)
        .prefetch(6)
        .build()
        .unwrap();
    let buffers = loader.buffers();
    assert_eq!(buffers, 8);
    let kept = {
        let mut it = loader.epoch(0).unwrap();
        let kept = it.next().unwrap().unwrap();
        let _ = it.next().unwrap().unwrap();
        kept
    };
    // Dropping the epoch waited for the workers: all buffers but the one kept are back.
    assert_eq!(loader.free_buffers(), buffers - 1);
    drop(kept);
    assert_eq!(loader.free_buffers(), buffers);
    assert_eq!(epoch_indices(&mut loader, 1).len(), 1000);
    assert_eq!(loader.free_buffers(), buffers);
}

#[test]
fn a_read_error_reaches_the_consumer_and_ends_the_epoch() {
    let mut ds = Synth::new(1000);
    ds.fail_at = Some(517);
    let mut loader = Loader::builder(ds)
        .batch_size(10)
        .shuffle(Shuffle::None)
        .workers(3)
        .build()
        .unwrap();
    for epoch in 0..2 {
        let results: Vec<_> = loader
            .epoch(epoch)
            .unwrap()
            .map(|b| b.map(|b| b.len()))
            .collect();
        assert_eq!(results.len(), 52, "51 good batches, then the error");
        assert!(results[..51].iter().all(Result::is_ok));
        let err = results[51].as_ref().unwrap_err();
        assert!(matches!(err, Error::OutOfRange { index: 517, .. }), "{err}");
        assert_eq!(loader.free_buffers(), loader.buffers());
        // The state points at the failed batch, so a resume retries it.
        assert_eq!((loader.state().epoch, loader.state().batch), (epoch, 51));
    }
}

#[test]
fn a_worker_panic_is_an_error_not_a_hang() {
    let mut ds = Synth::new(1000);
    ds.panic_at = Some(3);
    let mut loader = Loader::builder(ds)
        .batch_size(10)
        .shuffle(Shuffle::Full { seed: 1 })
        .workers(2)
        .build()
        .unwrap();
    let results: Vec<_> = loader
        .epoch(0)
        .unwrap()
        .map(|b| b.map(|b| b.len()))
        .collect();
    let err = results.last().unwrap().as_ref().unwrap_err();
    match err {
        Error::WorkerPanic { message, .. } => assert!(message.contains("sample 3"), "{message}"),
        other => panic!("expected a worker panic, got {other}"),
    }
    // The workers survived: another epoch runs (and fails the same way).
    let again: Vec<_> = loader
        .epoch(1)
        .unwrap()
        .map(|b| b.map(|b| b.len()))
        .collect();
    let again = again.last().unwrap().as_ref().unwrap_err();
    assert!(
        matches!(again, Error::WorkerPanic { message, .. } if message.contains("sample 3")),
        "{again}"
    );
}

/// A loader of `n` samples in batches of 10 with a pool of two buffers and one worker.
fn two_buffers(n: u64) -> Loader {
    Loader::builder(Synth::new(n))
        .batch_size(10)
        .workers(1)
        .prefetch(1)
        .held(1)
        .build()
        .unwrap()
}

#[test]
fn a_training_thread_that_validates_between_epochs_is_not_a_deadlock() {
    let mut loader = two_buffers(40);
    let (tx, rx) = crossbeam_channel::unbounded::<stokehold::HostBatch>();
    let (validating, validation) = crossbeam_channel::bounded(1);
    let trainer = std::thread::spawn(move || {
        let mut seen = 0;
        for b in rx {
            seen += b.indices().len();
            drop(b);
            if seen == 40 {
                // Every batch of epoch 0 dropped, then a long validation: epoch 1's
                // batches wait unread in the queue meanwhile, holding every buffer.
                validating.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(1500));
            }
        }
        seen
    });
    for epoch in 0..2 {
        if epoch == 1 {
            // The loader starts the next epoch with every buffer back.
            validation.recv().unwrap();
        }
        for b in loader.epoch(epoch).unwrap() {
            tx.send(b.unwrap()).unwrap();
        }
    }
    drop(tx);
    assert_eq!(trainer.join().unwrap(), 80);
}

#[test]
fn holding_every_buffer_is_an_error_not_a_hang() {
    let mut loader = two_buffers(100);
    let mut it = loader.epoch(0).unwrap();
    let a = it.next().unwrap().unwrap();
    let b = it.next().unwrap().unwrap();
    let err = it.next().unwrap().unwrap_err();
    assert!(matches!(err, Error::PoolExhausted { buffers: 2 }), "{err}");
    // The error ends the epoch (a `collect()` must not loop on it) ...
    assert!(it.next().is_none());
    let state = it.state();
    drop(it);
    drop((a, b));
    assert_eq!((state.epoch, state.batch), (0, 2));
    // ... and the epoch resumes where it stopped.
    let mut resumed = Loader::builder(Synth::new(100))
        .batch_size(10)
        .resume(state)
        .build()
        .unwrap();
    let rest: Vec<u64> = resumed
        .epoch(0)
        .unwrap()
        .map(|b| b.unwrap().number())
        .collect();
    assert_eq!(rest, (2..10).collect::<Vec<_>>());
}

/// Epoch 0 of a loader with two buffers over `n` samples, each batch sent to a training
/// thread through a queue of `capacity` (`None`: unbounded) that reads it, then (after
/// dropping it, with `drop_first`) steps for longer than the deadlock grace: the batches
/// delivered, and the first sample of each the trainer saw.
fn fed_through_a_queue(n: u64, capacity: Option<usize>, drop_first: bool) -> (usize, Vec<u64>) {
    let mut loader = two_buffers(n);
    let (tx, rx) = match capacity {
        Some(c) => crossbeam_channel::bounded::<stokehold::HostBatch>(c),
        None => crossbeam_channel::unbounded(),
    };
    let trainer = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for batch in rx {
            seen.push(batch.column::<u64>(0).unwrap()[0]);
            let kept = (!drop_first).then_some(batch);
            std::thread::sleep(std::time::Duration::from_millis(1300));
            drop(kept);
        }
        seen
    });
    let mut delivered = 0;
    for batch in loader.epoch(0).unwrap() {
        tx.send(batch.unwrap()).unwrap();
        delivered += 1;
    }
    drop(tx);
    (delivered, trainer.join().unwrap())
}

#[test]
fn a_slow_consumer_fed_through_a_queue_is_not_a_deadlock() {
    // Two buffers: one in the training thread's step, one waiting in the queue, while
    // the loading thread asks for a third and waits longer than the deadlock grace.
    let (delivered, seen) = fed_through_a_queue(40, Some(1), false);
    assert_eq!((delivered, seen.len()), (4, 4));
}

#[test]
fn a_pool_the_memory_cannot_hold_is_refused_counting_its_pages() {
    // One-byte samples, a batch each, every batch prefetched: as many buffers as this
    // machine has KiB of memory. Their rows (256 bytes a buffer with its alignment)
    // take a quarter of the memory, but each buffer is a whole page, and holds its
    // sample's index: the pool needs four times the memory, and is refused.
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let memory = pages as u64 * page as u64;
    struct Bytes(u64, Vec<stokehold::Column>);
    impl stokehold::Dataset for Bytes {
        fn len(&self) -> u64 {
            self.0
        }
        fn columns(&self) -> &[stokehold::Column] {
            &self.1
        }
        fn gather(&self, _: u64, _: &[u64], out: &mut [&mut [u8]]) -> stokehold::Result<()> {
            out[0].fill(1);
            Ok(())
        }
    }
    let column = stokehold::Column {
        name: "b".into(),
        dtype: stokehold::DType::U8,
        shape: vec![],
        row_bytes: 1,
    };
    let err = Loader::builder(Bytes(memory / 1024, vec![column]))
        .batch_size(1)
        .prefetch(usize::MAX)
        .build()
        .unwrap_err();
    assert!(
        matches!(&err, stokehold::Error::Config(m) if m.contains("the buffer pool needs")),
        "{err}"
    );
}

#[test]
fn a_consumer_that_drops_its_batch_before_its_step_is_not_a_deadlock() {
    // The training thread copies each batch out and drops it, then steps: while it
    // steps, the batches queued for it hold both buffers, unread, and nothing is
    // released for longer than the deadlock grace; it will read and drop them.
    let (delivered, seen) = fed_through_a_queue(60, None, true);
    assert_eq!((delivered, seen.len()), (6, 6));
}

#[test]
fn a_canceller_wakes_a_thread_waiting_for_a_buffer_held_elsewhere() {
    // The loading thread waits for a buffer that the batches it sent keep (read here,
    // so it waits without a deadline); this thread, holding them, ends the epoch.
    let mut loader = two_buffers(100);
    let (tx, rx) = crossbeam_channel::unbounded::<stokehold::HostBatch>();
    let (give, canceller) = crossbeam_channel::bounded(1);
    std::thread::scope(|s| {
        let loading = s.spawn(|| {
            let mut epoch = loader.epoch(0).unwrap();
            give.send(epoch.canceller()).unwrap();
            let mut sent = 0;
            for batch in &mut epoch {
                match batch {
                    Ok(b) => tx.send(b).map(|()| sent += 1).unwrap(),
                    Err(e) => return (sent, Some(e), epoch.state()),
                }
            }
            (sent, None, epoch.state())
        });
        let cancel = canceller.recv().unwrap();
        let held: Vec<_> = (0..2).map(|_| rx.recv().unwrap()).collect();
        assert!(held.iter().all(|b| b.column::<u64>(0).is_ok()));
        std::thread::sleep(std::time::Duration::from_millis(200));
        cancel.cancel();
        let (sent, err, state) = loading.join().unwrap();
        assert_eq!(sent, 2);
        assert!(
            matches!(err, Some(Error::WorkersStopped { batch: 2 })),
            "{err:?}"
        );
        assert_eq!((state.epoch, state.batch), (0, 2));
    });
    // The loader goes on: the next epoch runs whole.
    assert_eq!(epoch_indices(&mut loader, 1).len(), 10);
}

#[test]
fn a_leaked_epoch_is_an_error_not_a_hang() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut loader = Loader::builder(Synth::new(1000))
            .batch_size(10)
            .workers(2)
            .prefetch(2)
            .held(1)
            .build()
            .unwrap();
        let mut it = loader.epoch(0).unwrap();
        let batch = it.next().unwrap().unwrap();
        std::mem::forget(it);
        drop(batch);
        let err = loader.epoch(1).unwrap_err();
        assert!(matches!(err, Error::EpochLeaked { epoch: 0 }), "{err}");
        // It stays refused, and dropping the loader joins its workers.
        assert!(loader.epoch(1).is_err());
        drop(loader);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(std::time::Duration::from_secs(30))
        .expect("the loader neither hangs nor panics after a leaked epoch");
}

#[test]
fn sizes_from_flags_are_capped_or_refused() {
    // Prefetch, workers and buffer rows are capped at what an epoch of 10 batches uses.
    let loader = Loader::builder(Synth::new(100))
        .batch_size(10)
        .workers(1000)
        .prefetch(1 << 40)
        .build()
        .unwrap();
    assert_eq!((loader.workers(), loader.prefetch()), (10, 10));
    // A batch far beyond the dataset: buffers for the 100 rows that exist, one batch.
    let mut loader = Loader::builder(Synth::new(100))
        .batch_size(1 << 40)
        .workers(2)
        .build()
        .unwrap();
    assert_eq!(loader.layout().batch_size(), 100);
    assert_eq!(loader.buffers(), 1 + 2);
    let lens: Vec<usize> = loader.epoch(0).unwrap().map(|b| b.unwrap().len()).collect();
    assert_eq!(lens, [100]);
    // What cannot be capped is refused, saying which value and why.
    let err = Loader::builder(Synth::new(100))
        .workers(5000)
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("5000 workers"), "{err}");
}

/// Rows of 1 GiB that are never read: a pool for them cannot fit in memory.
struct Wide(Vec<stokehold::Column>);

impl Dataset for Wide {
    fn len(&self) -> u64 {
        1 << 20
    }
    fn columns(&self) -> &[stokehold::Column] {
        &self.0
    }
    fn gather(&self, _: u64, _: &[u64], _: &mut [&mut [u8]]) -> stokehold::Result<()> {
        unreachable!("the loader is refused before any gather")
    }
}

#[test]
fn a_pool_larger_than_memory_is_refused_not_killed() {
    let wide = Wide(vec![stokehold::Column {
        name: "wide".into(),
        dtype: stokehold::DType::U8,
        shape: vec![1 << 30],
        row_bytes: 1 << 30,
    }]);
    let err = Loader::builder(wide)
        .batch_size(1 << 10)
        .workers(1)
        .prefetch(4)
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("the buffer pool needs"), "{err}");
    assert!(err.contains("bytes of memory"), "{err}");
}

#[test]
fn buffer_memory_is_allocated_once_and_bounded() {
    let alloc = CountingAlloc::default();
    let mut loader = Loader::builder(Synth::new(3000))
        .batch_size(64)
        .workers(3)
        .prefetch(5)
        .held(2)
        .allocator(Arc::new(alloc.clone()))
        .build()
        .unwrap();
    let per_batch = loader.layout().bytes();
    assert_eq!(alloc.counts.calls.load(Ordering::SeqCst), 7);
    assert_eq!(alloc.counts.bytes.load(Ordering::SeqCst), 7 * per_batch);
    assert_eq!(loader.pool_bytes(), 7 * per_batch);
    for epoch in 0..3 {
        // Hold two batches at a time, as a consumer overlapping copies would.
        let mut held = std::collections::VecDeque::new();
        for batch in loader.epoch(epoch).unwrap() {
            held.push_back(batch.unwrap());
            if held.len() > 2 {
                held.pop_front();
            }
        }
    }
    assert_eq!(
        alloc.counts.calls.load(Ordering::SeqCst),
        7,
        "no allocation after build"
    );
    assert!(per_batch >= 64 * 12, "layout holds a batch");
}

#[test]
fn dropping_the_loader_releases_everything() {
    let ds = Arc::new(Synth::new(1000));
    let mut loader = Loader::builder_shared(ds.clone())
        .batch_size(10)
        .workers(4)
        .build()
        .unwrap();
    let kept = {
        let mut it = loader.epoch(0).unwrap();
        it.next().unwrap().unwrap()
    };
    drop(loader);
    // Workers joined; their jobs and the loader's handle are gone.
    assert_eq!(Arc::strong_count(&ds), 1);
    // A batch may outlive its loader.
    assert_eq!(kept.len(), 10);
}

#[test]
fn bad_configurations_are_errors() {
    let b = || Loader::builder(Synth::new(10));
    // Each refused with a message that names what is wrong.
    let refused = |built: stokehold::Result<Loader>, says: &str| match built {
        Err(Error::Config(m)) => assert!(m.contains(says), "{m:?} does not say {says:?}"),
        Err(other) => panic!("not a configuration error: {other}"),
        Ok(_) => panic!("built, though {says:?}"),
    };
    refused(b().batch_size(0).build(), "batch size must be at least 1");
    refused(b().workers(0).build(), "workers must be at least 1");
    refused(b().prefetch(0).build(), "prefetch must be at least 1");
    refused(
        b().batch_size(11).drop_last(true).build(),
        "gets 10 of 10 samples: no full batch of 11",
    );
    let past = LoaderState::new(0, 99);
    refused(b().resume(past).build(), "batch 99 of epoch 0");
}

#[test]
fn a_resume_is_neither_lost_nor_misapplied() {
    let mk = |seed| {
        Loader::builder(Synth::new(100))
            .batch_size(10)
            .shuffle(Shuffle::Full { seed })
    };
    let mut saved = mk(1).build().unwrap();
    let state = {
        let mut it = saved.epoch(3).unwrap();
        it.next().unwrap().unwrap();
        it.state()
    };
    // Another seed means another order: refused, naming the cause.
    let err = mk(2).resume(state).build().unwrap_err();
    assert!(err.to_string().contains("another order"), "{err}");
    // Asking for an earlier epoch first would silently drop the resume: refused.
    let mut resumed = mk(1).resume(state).build().unwrap();
    assert!(matches!(resumed.epoch(0), Err(Error::Config(_))));
    // An epoch dropped before its first batch leaves the resume standing, as the
    // state still says.
    assert_eq!(resumed.epoch(3).unwrap().len(), 9);
    assert_eq!(resumed.state(), state);
    // So it does for a device cache asking whether it may serve the epoch whole.
    assert!(resumed.resumes(3) && resumed.can_serve(3).is_err());
    let mut rest = resumed.epoch(3).unwrap();
    assert_eq!(rest.len(), 9);
    assert_eq!(rest.next().unwrap().unwrap().number(), 1);
    drop(rest);
    // Once an epoch of it has delivered a batch, the resume is spent: the same epoch
    // again is whole.
    assert_eq!(resumed.epoch(3).unwrap().len(), 10);
    // A hand-made state (no fingerprint) is accepted.
    let mut manual = mk(2).resume(LoaderState::new(1, 4)).build().unwrap();
    assert_eq!(manual.epoch(1).unwrap().len(), 6);
    // In JSON, a misspelt key is an error: read as a missing `order`, it would turn
    // the check off.
    let json = serde_json::to_string(&state).unwrap();
    assert_eq!(serde_json::from_str::<LoaderState>(&json).unwrap(), state);
    let misspelt = json.replace("\"order\"", "\"ordr\"");
    let err = serde_json::from_str::<LoaderState>(&misspelt).unwrap_err();
    assert!(err.to_string().contains("ordr"), "{err}");
    // A start or a global order changed on its own would skip or repeat samples:
    // refused, exactly and elastically, naming why.
    for tampered in [
        LoaderState { start: 7, ..state },
        LoaderState {
            start: 7,
            taken: 8,
            ..state
        },
        LoaderState {
            global: state.global ^ 1,
            ..state
        },
    ] {
        let err = mk(1).resume(tampered).build().unwrap_err();
        assert!(
            err.to_string().contains("does not hold together"),
            "{tampered:?}: {err}"
        );
        if tampered.global == state.global {
            let err = mk(1).resume_elastic(tampered).build().unwrap_err();
            assert!(err.to_string().contains("does not hold together"), "{err}");
        }
    }
    // A batch set by hand resumes there (the positions taken follow from it).
    let mut at = mk(1)
        .resume(LoaderState { batch: 4, ..state })
        .build()
        .unwrap();
    assert_eq!(at.epoch(3).unwrap().len(), 6);
    assert_eq!(at.state().taken, 40);
}

#[test]
fn a_resume_at_the_end_of_its_epoch_is_spent_by_it() {
    let mk = || {
        Loader::builder(Synth::new(100))
            .batch_size(10)
            .shuffle(Shuffle::Full { seed: 1 })
    };
    // Saved after the epoch's last step, before the loop asked for the end.
    let state = {
        let mut saved = mk().build().unwrap();
        let mut it = saved.epoch(3).unwrap();
        for _ in 0..10 {
            it.next().unwrap().unwrap();
        }
        it.state()
    };
    assert_eq!((state.epoch, state.batch), (3, 10));
    let mut resumed = mk().resume(state).build().unwrap();
    assert!(resumed.resumes(3));
    assert_eq!(resumed.epoch(3).unwrap().count(), 0);
    // Nothing of it was left: the loader now stands where a whole epoch 3 leaves it.
    assert_eq!(resumed.state().epoch, 4);
    assert!(!resumed.resumes(3));
    assert!(resumed.can_serve(3).is_ok());
    assert_eq!(resumed.epoch(3).unwrap().len(), 10);
    assert!(resumed.epoch(2).is_ok());
}

#[test]
fn an_epoch_served_elsewhere_moves_the_state_past_it() {
    let mk = || {
        Loader::builder(Synth::new(100))
            .batch_size(10)
            .shuffle(Shuffle::Full { seed: 4 })
    };
    let mut loader = mk().build().unwrap();
    // A device cache served epoch 2 whole: a checkpoint now resumes epoch 3.
    loader.served(2).unwrap();
    let state = loader.state();
    assert_eq!((state.epoch, state.batch, state.taken), (3, 0, 0));
    let mut resumed = mk().resume(state).build().unwrap();
    assert_eq!(resumed.epoch(3).unwrap().len(), 10);
    // Part of epoch 5 was taken: it cannot be served whole, nor can an epoch before it.
    let part = {
        let mut it = loader.epoch(5).unwrap();
        it.next().unwrap().unwrap();
        it.state()
    };
    loader.resume(part).unwrap();
    for e in [4, 5] {
        assert!(loader.can_serve(e).is_err());
        let err = loader.served(e).unwrap_err();
        assert!(err.to_string().contains("resumes epoch 5"), "{err}");
    }
    assert_eq!(loader.state(), part, "a refused call changed the state");
    assert_eq!(loader.epoch(5).unwrap().len(), 9);
    // A leaked epoch is refused here as by `epoch`.
    assert!(loader.can_serve(6).is_ok());
    std::mem::forget(loader.epoch(6).unwrap());
    assert!(matches!(
        loader.can_serve(7),
        Err(Error::EpochLeaked { .. })
    ));
    assert!(matches!(loader.served(6), Err(Error::EpochLeaked { .. })));
}

#[test]
fn an_epoch_taken_to_its_count_and_dropped_is_whole() {
    // A loop that stops at `len()` never asks for the `None` after the last batch: the
    // epoch is whole all the same, and the state moves to the next one.
    let mut loader = Loader::builder(Synth::new(50))
        .batch_size(7)
        .workers(2)
        .build()
        .unwrap();
    let mut it = loader.epoch(3).unwrap();
    let n = it.len();
    let taken = it.by_ref().take(n).map(|b| b.unwrap().len()).sum::<usize>();
    assert_eq!(taken, 50);
    drop(it);
    let state = loader.state();
    assert_eq!((state.epoch, state.batch), (4, 0));
    // One that stops short is not.
    let mut it = loader.epoch(4).unwrap();
    it.next().unwrap().unwrap();
    drop(it);
    assert_eq!((loader.state().epoch, loader.state().batch), (4, 1));
}

#[test]
fn an_epoch_of_indices_reads_nothing_and_keeps_the_order_and_the_state() {
    let mk = |data: Synth| {
        Loader::builder(data)
            .batch_size(7)
            .workers(2)
            .shuffle(Shuffle::Full { seed: 9 })
    };
    let mut read = mk(Synth::new(50)).build().unwrap();
    // Any read of sample 0 or 1 fails: a batch of indices only never reads.
    let mut data = Synth::new(50);
    data.fail_at = Some(0);
    data.panic_at = Some(1);
    let mut indices = mk(data).build().unwrap();
    for e in [0, 3] {
        let mut a = read.epoch(e).unwrap();
        let mut b = indices.epoch_indices(e).unwrap();
        assert_eq!(a.len(), b.len());
        loop {
            match (a.next(), b.next()) {
                (Some(x), Some(y)) => {
                    let (x, y) = (x.unwrap(), y.unwrap());
                    assert!(!x.is_indices_only() && y.is_indices_only());
                    assert_eq!((x.number(), x.indices()), (y.number(), y.indices()));
                    assert_eq!(a.state(), b.state());
                }
                (None, None) => break,
                _ => panic!("the epochs have different lengths"),
            }
        }
        assert_eq!(a.state(), b.state());
    }
    // A resume works as for an epoch that reads, and a failing read still fails.
    let state = {
        let mut it = read.epoch(5).unwrap();
        it.next().unwrap().unwrap();
        it.next().unwrap().unwrap();
        it.state()
    };
    indices.resume(state).unwrap();
    let rest: Vec<u64> = indices
        .epoch_indices(5)
        .unwrap()
        .map(|b| b.unwrap().number())
        .collect();
    assert_eq!(rest, (2..8).collect::<Vec<u64>>());
    let failed = indices.epoch(6).unwrap().find_map(|b| b.err());
    assert!(failed.is_some(), "the dataset's reads fail");
}

#[test]
fn many_workers_over_files_run_an_epoch() {
    // Over 32 workers the planner's read-ahead (two batches a worker at the least) passes
    // its usual cap of 64 batches: it once made `build` panic on a set with files.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let mut loader = Loader::builder(NpyDataset::open(dir).unwrap())
        .batch_size(10)
        .workers(48)
        .build()
        .unwrap();
    assert_eq!(loader.workers(), 48);
    let mut seen: Vec<u64> = (loader.epoch(0).unwrap())
        .flat_map(|b| b.unwrap().indices().to_vec())
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..1797).collect::<Vec<_>>());
}

#[test]
fn digits_end_to_end() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let x = NpyArray::open(format!("{dir}/x.npy")).unwrap();
    let y = NpyArray::open(format!("{dir}/y.npy")).unwrap();
    let ds = NpyDataset::open(dir).unwrap();
    assert_eq!(ds.len(), 1797);
    assert_eq!(ds.columns()[0].name, "x");
    assert_eq!(ds.columns()[1].name, "y");
    let mut loader = Loader::builder(ds)
        .batch_size(100)
        .shuffle(Shuffle::Full { seed: 3 })
        .workers(2)
        .build()
        .unwrap();
    let mut seen = vec![0u32; 1797];
    let mut label_counts = [0u32; 10];
    for batch in loader.epoch(0).unwrap() {
        let batch = batch.unwrap();
        let pixels: &[u8] = batch.column_named("x").unwrap();
        let labels: &[i64] = batch.column_named("y").unwrap();
        assert!(batch.column::<f32>(0).is_err(), "dtype is checked");
        for (k, &i) in batch.indices().iter().enumerate() {
            seen[i as usize] += 1;
            assert_eq!(&pixels[k * 64..(k + 1) * 64], x.row(i).unwrap());
            assert_eq!(
                labels[k],
                i64::from_le_bytes(y.row(i).unwrap().try_into().unwrap())
            );
            label_counts[labels[k] as usize] += 1;
        }
    }
    assert!(seen.iter().all(|&c| c == 1));
    assert!(
        label_counts.iter().all(|&c| (170..=190).contains(&c)),
        "{label_counts:?}"
    );
}

/// Regressions from review: sizes and settings at the edges are errors or work, never
/// panics or undefined behaviour.
#[test]
fn extreme_settings_are_errors_or_work() {
    // A batch size near usize::MAX: buffers for the 10 rows there are, one batch.
    let mut huge = Loader::builder(Synth::new(10))
        .batch_size(usize::MAX - 300)
        .build()
        .unwrap();
    assert_eq!(
        huge.epoch(0)
            .unwrap()
            .map(|b| b.unwrap().len())
            .sum::<usize>(),
        10
    );
    let many = Loader::builder(Synth::new(100_000))
        .workers(40)
        .build()
        .unwrap();
    assert!(many.prefetch() >= 80);
    let mut wide = Loader::builder(Synth::new(1000))
        .batch_size(7)
        .shuffle(Shuffle::Block {
            seed: 1,
            block_rows: 2,
            window: u64::MAX,
        })
        .build()
        .unwrap();
    let mut all: Vec<u64> = epoch_indices(&mut wide, 0).concat();
    all.sort_unstable();
    assert_eq!(all, (0..1000).collect::<Vec<_>>());
    let capped = Loader::builder(Synth::new(10)).prefetch(usize::MAX).build();
    assert_eq!(capped.unwrap().prefetch(), 1);
    let overflow = Loader::builder(Synth::new(10)).held(usize::MAX).build();
    assert!(matches!(overflow, Err(Error::Config(_))));
}

#[test]
fn invalid_shards_do_not_deserialize() {
    assert!(serde_json::from_str::<Shard>(r#"{"rank":0,"world_size":0}"#).is_err());
    assert!(serde_json::from_str::<Shard>(r#"{"rank":5,"world_size":2}"#).is_err());
    let ok: Shard = serde_json::from_str(r#"{"rank":1,"world_size":2,"tail":"Drop"}"#).unwrap();
    assert_eq!(
        (ok.rank(), ok.world_size(), ok.tail()),
        (1, 2, ShardTail::Drop)
    );
}

#[test]
fn batches_held_by_another_thread_are_not_a_deadlock() {
    // A copy thread keeps each batch a while (as a DMA in flight would), so the
    // consumer side holds every buffer for a moment: not an error while batches come back.
    let mut loader = Loader::builder(Synth::new(200))
        .batch_size(20)
        .workers(2)
        .prefetch(2)
        .held(0)
        .build()
        .unwrap();
    let (tx, rx) = crossbeam_channel::unbounded::<stokehold::HostBatch>();
    let holder = std::thread::spawn(move || {
        for b in rx {
            std::thread::sleep(std::time::Duration::from_millis(100));
            drop(b);
        }
    });
    let mut n = 0;
    for batch in loader.epoch(0).unwrap() {
        tx.send(batch.unwrap()).unwrap();
        n += 1;
    }
    drop(tx);
    holder.join().unwrap();
    assert_eq!(n, 10);
}

#[test]
fn an_interrupt_check_stops_a_wait_and_the_epoch_goes_on() {
    let build = || {
        Loader::builder(Synth::new(200))
            .batch_size(20)
            .workers(1)
            .prefetch(1)
            .held(1)
            .build()
            .unwrap()
    };
    let want: Vec<Vec<u64>> = build()
        .epoch(0)
        .unwrap()
        .map(|b| b.unwrap().indices().to_vec())
        .collect();
    let mut loader = build();
    let mut epoch = loader.epoch(0).unwrap();
    // Both buffers read on another thread, which keeps them: no deadlock the loader can
    // call, so the wait for a third batch lasts as long as that thread keeps them.
    let kept = [
        epoch.next().unwrap().unwrap(),
        epoch.next().unwrap().unwrap(),
    ];
    let (go, wait) = crossbeam_channel::bounded::<()>(0);
    let keeper = std::thread::spawn(move || {
        assert!(kept.iter().all(|b| !b.bytes(0).is_empty()));
        wait.recv().unwrap();
    });
    let checks = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = Arc::clone(&checks);
    epoch.interrupt_with(move || counted.fetch_add(1, Ordering::Relaxed) >= 2);
    let err = epoch.next().unwrap().unwrap_err();
    assert!(matches!(err, stokehold::Error::Interrupted), "{err}");
    assert_eq!(checks.load(Ordering::Relaxed), 3);
    // Nothing was taken: once the buffers come back, the same batch comes next.
    assert_eq!(epoch.state().batch, 2);
    go.send(()).unwrap();
    keeper.join().unwrap();
    let rest: Vec<Vec<u64>> = epoch.map(|b| b.unwrap().indices().to_vec()).collect();
    assert_eq!(rest, want[2..]);
}

/// Records the thread (id and name) of every gather.
struct ThreadLog {
    inner: Synth,
    threads: std::sync::Mutex<std::collections::HashSet<(std::thread::ThreadId, String)>>,
}

impl Dataset for ThreadLog {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn columns(&self) -> &[stokehold::Column] {
        self.inner.columns()
    }
    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> stokehold::Result<()> {
        let me = std::thread::current();
        let name = me.name().unwrap_or("?").to_string();
        self.threads.lock().unwrap().insert((me.id(), name));
        self.inner.gather(epoch, indices, out)
    }
}

#[test]
fn the_roofline_keeps_its_threads_from_pass_to_pass() {
    let log = Arc::new(ThreadLog {
        inner: Synth::new(1000),
        threads: Default::default(),
    });
    let loader = Loader::builder_shared(log.clone())
        .batch_size(10)
        .build()
        .unwrap();
    let roofline = stokehold::bench::Roofline::new(log.clone(), loader.layout(), 2).unwrap();
    let indices: Arc<[u64]> = (0..1000).rev().collect::<Vec<u64>>().into();
    for epoch in 0..5 {
        roofline.pass(epoch, Arc::clone(&indices)).unwrap();
    }
    // Which of the two threads claims the batches is up to the scheduler (one may take
    // them all), but over five passes no thread beyond the first two ever gathers: a
    // roofline that started threads per pass would show new thread ids under old names.
    let threads = log.threads.lock().unwrap().clone();
    assert!(!threads.is_empty() && threads.len() <= 2, "{threads:?}");
    for (_, name) in &threads {
        assert!(
            name == "stokehold-roofline-0" || name == "stokehold-roofline-1",
            "{threads:?}"
        );
    }
    // A gather's error comes back from the pass.
    let mut failing = Synth::new(100);
    failing.fail_at = Some(42);
    let failing: Arc<dyn Dataset> = Arc::new(failing);
    let roofline = stokehold::bench::Roofline::new(failing, loader.layout(), 2).unwrap();
    let err = roofline
        .pass(0, (0..100).collect::<Vec<u64>>().into())
        .unwrap_err();
    assert!(matches!(err, Error::OutOfRange { index: 42, .. }), "{err}");
}

/// Global positions `from..to` of `epoch`'s order under `shuffle`: the samples there.
fn global_samples(n: u64, shuffle: Shuffle, epoch: u64, from: u64, to: u64) -> Vec<u64> {
    let order = stokehold::Order::new(n, shuffle, Shard::single(), 1, false).unwrap();
    let e = order.epoch(epoch);
    (from..to).map(|p| e.global(p)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn an_elastic_resume_takes_each_sample_left_once_over_the_new_ranks(
        s in setup_strategy(),
        cut in prop_oneof![Just(1.0f64), 0.0f64..1.0],
        world in 1u64..6,
        batch in 1usize..40,
        tail in prop_oneof![Just(ShardTail::Pad), Just(ShardTail::Drop)],
        drop_last in any::<bool>(),
        later in 0.0f64..1.0,
    ) {
        // Every old rank takes the same k batches, as data-parallel steps do.
        let Ok(probe) = build(&s, 0, 1) else { return Ok(()); };
        let k = (probe.batches() as f64 * cut) as u64;
        let mut taken = Vec::new();
        let mut state = LoaderState::default();
        for rank in 0..s.world {
            let mut old = build(&s, rank, 1).unwrap();
            let mut it = old.epoch(s.epoch).unwrap();
            for _ in 0..k { taken.extend_from_slice(it.next().unwrap().unwrap().indices()); }
            state = it.state();
        }
        // After the last batch the whole epoch counts as taken (a tail or drop_last
        // leaves some out): an elastic resume then has nothing left, as an exact one.
        let last = k == probe.batches();
        let at = if last { s.n } else { (k * s.batch as u64 * s.world).min(s.n) };
        prop_assert_eq!(state.taken, at);
        let mut want_taken = global_samples(s.n, s.shuffle, s.epoch, 0, at);
        want_taken.sort_unstable();
        taken.sort_unstable();
        taken.dedup();
        if last {
            prop_assert!(taken.iter().all(|i| want_taken.binary_search(i).is_ok()));
        } else {
            prop_assert_eq!(&taken, &want_taken, "the old ranks took a prefix of the global order");
        }

        // The new ranks: another world size, batch size, tail and drop_last.
        let new = |rank: u64| Loader::builder(Synth::new(s.n))
            .batch_size(batch).workers(2).drop_last(drop_last).shuffle(s.shuffle)
            .shard(Shard::new(rank, world).unwrap().with_tail(tail));
        // Built first: a configuration that leaves a new rank no batch is skipped whole.
        let Ok(loaders) = (0..world).map(|r| new(r).resume_elastic(state).build())
            .collect::<stokehold::Result<Vec<Loader>>>() else { return Ok(()); };
        let mut counts: HashMap<u64, u64> = HashMap::new();
        for (rank, mut resumed) in loaders.into_iter().enumerate() {
            let batches = epoch_indices(&mut resumed, s.epoch);
            for &i in batches.concat().iter() { *counts.entry(i).or_default() += 1; }
            prop_assert_eq!(resumed.state(), LoaderState { epoch: s.epoch + 1, batch: 0, start: 0, taken: 0, ..resumed.state() });
            // The epoch after is whole.
            prop_assert_eq!(resumed.epoch(s.epoch + 1).unwrap().len() as u64, resumed.batches());
            // A state saved inside the resumed epoch resumes exactly, on a new loader.
            if rank == 0 && !batches.is_empty() {
                let j = (batches.len() as f64 * later) as usize;
                let mut first = new(0).resume_elastic(state).build().unwrap();
                let mid = {
                    let mut it = first.epoch(s.epoch).unwrap();
                    for _ in 0..j { it.next().unwrap().unwrap(); }
                    it.state()
                };
                prop_assert_eq!((mid.start, mid.batch), (at, j as u64));
                let json = serde_json::to_string(&mid).unwrap();
                let mut again = new(0).resume(serde_json::from_str(&json).unwrap()).build().unwrap();
                let rest: Vec<Vec<u64>> = again.epoch(s.epoch).unwrap()
                    .map(|b| b.unwrap().indices().to_vec()).collect();
                prop_assert_eq!(&rest[..], &batches[j..]);
            }
        }
        let left = global_samples(s.n, s.shuffle, s.epoch, at, s.n);
        for i in &left {
            let c = counts.get(i).copied().unwrap_or(0);
            if tail == ShardTail::Pad && !drop_last {
                prop_assert!(c >= 1, "sample {} left out", i);
            }
        }
        prop_assert!(counts.keys().all(|i| left.contains(i)), "only samples left are taken");
        if tail == ShardTail::Drop {
            // Nothing pads: a sample taken twice is a bug, not a tail.
            prop_assert!(counts.iter().all(|(_, &c)| c == 1), "a sample taken twice: {:?}",
                counts.iter().filter(|(_, &c)| c > 1).collect::<Vec<_>>());
        }
        let rest = s.n - at;
        let per_rank = match tail { ShardTail::Pad => rest.div_ceil(world), ShardTail::Drop => rest / world };
        let per_rank = if drop_last { per_rank / batch as u64 * batch as u64 } else { per_rank };
        prop_assert_eq!(counts.values().sum::<u64>(), per_rank * world);
    }
}

#[test]
fn an_elastic_resume_refuses_another_global_order_or_an_old_state() {
    let b = |seed| {
        Loader::builder(Synth::new(100))
            .batch_size(10)
            .shuffle(Shuffle::Full { seed })
    };
    let mut first = b(1).build().unwrap();
    let state = {
        let mut it = first.epoch(0).unwrap();
        it.next().unwrap().unwrap();
        it.state()
    };
    let e = b(2).resume_elastic(state).build().unwrap_err().to_string();
    assert!(e.contains("another global order"), "{e}");
    let e = b(1)
        .resume_elastic(LoaderState::new(0, 1))
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("resume this one exactly"), "{e}");
    // Another batch size resumes elastically, not exactly.
    let e = b(1)
        .batch_size(20)
        .resume(state)
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("another order"), "{e}");
    let mut resumed = b(1).batch_size(20).resume_elastic(state).build().unwrap();
    assert_eq!(
        resumed.epoch(0).unwrap().len(),
        5,
        "90 samples left, in 20s"
    );
}
