//! The GPU checks, shared by `tests/gpu.rs` (a real GPU, skipped without one) and
//! `tests/emulated.rs` (stokehold's CPU emulator of the driver, everywhere).

use std::sync::Arc;

use stokehold::cpu::CpuTrainer;
use stokehold::cuda::{Cuda, CudaTrainer, Kernels, PinnedAlloc, PinnedKind};
use stokehold::gen::{self, ClassificationSpec};
use stokehold::model::{step, Metrics, Mlp, MlpConfig, Normalize, Workspace};
use stokehold::Trainer;
use stokehold::{Dataset, HostAlloc, Loader, NpyDataset, Shuffle};

use crate::common::DIGITS;

/// A loader of `batch`-sample batches over `ds` with 2 workers, gathering into pinned
/// memory of `c`'s context, as the CUDA trainer's loader does.
pub fn pinned_loader(c: &Cuda, ds: &Arc<dyn Dataset>, batch: usize) -> stokehold::LoaderBuilder {
    Loader::builder_shared(Arc::clone(ds))
        .batch_size(batch)
        .workers(2)
        .allocator(Arc::new(PinnedAlloc::new(
            Arc::clone(&c.ctx),
            PinnedKind::Plain,
        )))
}

/// The largest absolute difference between two weight vectors, element by element.
fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

fn setup(
    c: &Cuda,
    dir: &std::path::Path,
    batch: usize,
    hidden: usize,
    lr: f32,
) -> (Loader, Mlp, Normalize, Kernels) {
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(dir).unwrap());
    let loader = pinned_loader(c, &ds, batch)
        .shuffle(Shuffle::Full { seed: 2 })
        .build()
        .unwrap();
    let inputs = ds.columns()[0].row_bytes;
    let probe: Vec<u64> = (0..ds.len().min(512)).collect();
    let mut x = vec![0u8; probe.len() * inputs];
    let mut y = vec![0u8; probe.len() * 8];
    ds.gather(0, &probe, &mut [&mut x, &mut y]).unwrap();
    let mlp = Mlp::new(MlpConfig {
        inputs,
        hidden,
        classes: 10,
        lr,
        seed: 5,
    })
    .unwrap();
    let kernels = Kernels::load(c).unwrap();
    println!(
        "kernels: {:?}, load {:?}",
        kernels.origin, kernels.load_time
    );
    (loader, mlp, Normalize::fit(&x), kernels)
}

pub fn first_step_matches_the_cpu_backend(c: Cuda) {
    first_step_matches_with(c, 128, 64);
}

/// Shapes off the kernels' tiles: a hidden width that is not a multiple of 4 (the scalar
/// paths), one just over a tile, and batches that end mid-tile.
pub fn odd_shapes_match_the_cpu_backend(c: Cuda) {
    for (batch, hidden) in [(100, 10), (200, 70), (33, 3), (100, 12)] {
        println!("batch {batch}, hidden {hidden}");
        first_step_matches_with(c.clone(), batch, hidden);
    }
}

fn first_step_matches_with(c: Cuda, batch_size: usize, hidden: usize) {
    let (mut loader, mlp, norm, kernels) = setup(&c, DIGITS.as_ref(), batch_size, hidden, 0.1);
    let layout = loader.layout().clone();
    let mut gpu = CudaTrainer::new(c, kernels, &mlp, norm, &layout, (0, 1), 2).unwrap();
    let batch = loader.epoch(0).unwrap().next().unwrap().unwrap();
    let gm = gpu.step_once(&batch).unwrap();
    let mut cpu = mlp.clone();
    let mut ws = Workspace::new(&mlp.config, batch_size).unwrap();
    let mut cm = Metrics::default();
    let x: &[u8] = batch.column(0).unwrap();
    let y: &[i64] = batch.column(1).unwrap();
    step(&mut cpu, &mut ws, norm, x, y, batch.indices(), &mut cm).unwrap();
    let rel = (gm.loss_sum - cm.loss_sum).abs() / cm.loss_sum.abs().max(1e-6);
    println!("loss: gpu {} cpu {}", gm.loss_sum, cm.loss_sum);
    assert!(
        rel < 1e-4,
        "loss differs: gpu {} cpu {}",
        gm.loss_sum,
        cm.loss_sum
    );
    // Argmax near-ties may round differently (another summation order): allow one.
    assert!(
        gm.correct.abs_diff(cm.correct) <= 1,
        "correct {} vs {}",
        gm.correct,
        cm.correct
    );
    let g = gpu.weights().unwrap();
    for (name, a, b) in [
        ("w1", &g.w1, &cpu.w1),
        ("b1", &g.b1, &cpu.b1),
        ("w2", &g.w2, &cpu.w2),
        ("b2", &g.b2, &cpu.b2),
    ] {
        let worst = a
            .iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
            .fold(0f32, f32::max);
        println!("{name}: worst relative difference {worst:e}");
        assert!(worst < 1e-3, "{name} differs by {worst}");
    }
}

pub fn digits_reach_90_percent_on_the_gpu(c: Cuda) {
    let (mut loader, mlp, norm, kernels) = setup(&c, DIGITS.as_ref(), 64, 64, 0.1);
    let layout = loader.layout().clone();
    let mut gpu = CudaTrainer::new(c, kernels, &mlp, norm, &layout, (0, 1), 4).unwrap();
    let mut acc = 0.0;
    for epoch in 0..10 {
        let out = gpu
            .train_epoch_with(loader.epoch(epoch).unwrap(), &mut |_, _| {})
            .unwrap();
        acc = out.metrics.accuracy();
        println!(
            "epoch {epoch}: acc {acc:.3} loss {:.4} copy {:?} compute {:?}",
            out.metrics.loss(),
            out.stages.copy,
            out.stages.compute
        );
    }
    assert!(acc >= 0.9, "accuracy {acc}");
    assert_eq!(
        loader.free_buffers(),
        loader.buffers(),
        "every pinned buffer came back"
    );
}

pub fn a_generated_set_reaches_95_percent_on_the_gpu(c: Cuda, samples: u64, shape: &[u64]) {
    let dir = tempfile::tempdir().unwrap();
    let spec = ClassificationSpec {
        samples,
        shape: shape.to_vec(),
        ..ClassificationSpec::default()
    };
    gen::classification(dir.path(), &spec, &|_| {}).unwrap();
    let (mut loader, mlp, norm, kernels) = setup(&c, dir.path(), 256, 64, 0.05);
    let layout = loader.layout().clone();
    let cpu_check = CpuTrainer::new(mlp.clone(), norm, &layout, (0, 1), 2);
    assert!(cpu_check.is_ok());
    let mut gpu = CudaTrainer::new(c, kernels, &mlp, norm, &layout, (0, 1), 4).unwrap();
    let mut acc = 0.0;
    for epoch in 0..3 {
        acc = gpu
            .train_epoch_with(loader.epoch(epoch).unwrap(), &mut |_, _| {})
            .unwrap()
            .metrics
            .accuracy();
    }
    assert!(acc >= 0.95, "accuracy {acc}");
}

pub fn the_device_cache_gives_the_same_epochs(c: Cuda) {
    let run = |cached: bool| {
        let (mut loader, mlp, norm, kernels) = setup(&c, DIGITS.as_ref(), 64, 32, 0.1);
        let layout = loader.layout().clone();
        let mut t = CudaTrainer::new(c.clone(), kernels, &mlp, norm, &layout, (0, 1), 3).unwrap();
        if cached {
            let bytes = t.enable_device_cache(&loader, 0.5).unwrap();
            assert!(bytes.is_some(), "digits fit on any GPU");
        }
        let first = t
            .train_epoch_with(loader.epoch(0).unwrap(), &mut |_, _| {})
            .unwrap();
        assert_eq!(t.cache_filled(), cached);
        let cached_epoch = |t: &mut CudaTrainer, loader: &mut Loader, e: u64| match cached {
            true => t
                .train_epoch_cached(&loader.order().epoch(e), &mut |_, _| {})
                .unwrap(),
            false => t
                .train_epoch_with(loader.epoch(e).unwrap(), &mut |_, _| {})
                .unwrap(),
        };
        let second = cached_epoch(&mut t, &mut loader, 1);
        // A cache enabled again replaces the first, with the graph captured for it
        // (the first's graph read buffers freed with it).
        if cached {
            t.enable_device_cache(&loader, 0.5).unwrap();
        }
        t.train_epoch_with(loader.epoch(2).unwrap(), &mut |_, _| {})
            .unwrap();
        assert_eq!(t.cache_filled(), cached);
        let fourth = cached_epoch(&mut t, &mut loader, 3);
        let metrics = [first.metrics, second.metrics, fourth.metrics];
        (metrics, t.weights().unwrap())
    };
    let ([a0, a1, a3], aw) = run(false);
    let ([b0, b1, b3], bw) = run(true);
    println!("uncached {a1:?}\ncached   {b1:?}");
    assert_eq!((a0.correct, a1.correct), (b0.correct, b1.correct));
    assert_eq!(
        a3.correct, b3.correct,
        "the epoch after the cache was replaced"
    );
    for (a, b) in [(a1, b1), (a3, b3)] {
        assert!((a.loss_sum - b.loss_sum).abs() <= 1e-6 * a.loss_sum.abs().max(1.0));
    }
    let worst = largest_difference(&aw.w1, &bw.w1);
    assert!(worst < 1e-5, "weights differ by {worst}");

    // A resumed epoch (elastic here, after 5 batches) lacks rows: it must not fill the
    // cache, and `Trainer::train` sends a pending resume through the loader.
    let (mut loader, mlp, norm, kernels) = setup(&c, DIGITS.as_ref(), 64, 32, 0.1);
    let layout = loader.layout().clone();
    let mut t = CudaTrainer::new(c, kernels, &mlp, norm, &layout, (0, 1), 3).unwrap();
    t.enable_device_cache(&loader, 0.5).unwrap();
    let saved = {
        let mut it = loader.epoch(0).unwrap();
        for _ in 0..5 {
            it.next().unwrap().unwrap();
        }
        it.state()
    };
    loader.resume_elastic(saved).unwrap();
    let part = t.train(&mut loader, 0, &mut |_, _| {}).unwrap();
    assert_eq!(part.metrics.samples, 1797 - 5 * 64);
    assert!(!t.cache_filled(), "a partial epoch filled the device cache");
    t.train(&mut loader, 1, &mut |_, _| {}).unwrap();
    assert!(t.cache_filled());
    let at = stokehold::LoaderState {
        batch: 3,
        ..loader.state()
    };
    loader.resume(at).unwrap();
    let rest = t.train(&mut loader, 2, &mut |_, _| {}).unwrap();
    assert_eq!(
        rest.metrics.samples,
        1797 - 3 * 64,
        "the cache replayed a resumed epoch"
    );
    // A cached epoch moves the loader's state past it, as a loader's epoch does: a
    // checkpoint taken after it resumes with the next epoch, not this one again.
    assert_eq!(loader.state().epoch, 3);
    let whole = t.train(&mut loader, 3, &mut |_, _| {}).unwrap();
    assert_eq!(whole.metrics.samples, 1797);
    let after = loader.state();
    assert_eq!((after.epoch, after.batch, after.taken), (4, 0, 0));
    // An epoch the loader would refuse (a resume is pending for a later one) is refused
    // before any step: the weights stay as they were.
    let before = t.weights().unwrap();
    let later = stokehold::LoaderState {
        epoch: 6,
        batch: 2,
        ..after
    };
    loader.resume(later).unwrap();
    let pending = loader.state();
    let err = t
        .train(&mut loader, 4, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("resumes epoch 6 at batch 2: epoch 4 cannot be served whole"),
        "{err}"
    );
    assert_eq!(
        t.weights().unwrap().w1,
        before.w1,
        "trained on a refused epoch"
    );
    assert_eq!(loader.state(), pending);
}

/// Three epochs of digits through the feeder (overlapped, or serialised on one stream)
/// against the CPU backend on the same batches: the same loss and accuracy per epoch and
/// the same weights. A batch that reached the step before its copy finished, or a pinned
/// buffer refilled while its copy was in flight, would show here.
///
/// The CPU's float sums differ from the device's in their last bits, so that comparison
/// allows 1e-3; overlapped, the run is also held to a serialised one with the same
/// kernels on the same batches, to 1e-9: the overlap may change when work runs, never
/// what it computes.
pub fn epochs_match_the_cpu_backend(c: Cuda, serial: bool) {
    let (mut loader, mlp, norm, kernels) = setup(&c, DIGITS.as_ref(), 64, 32, 0.1);
    let layout = loader.layout().clone();
    let mut twin = match serial {
        true => None,
        false => {
            let k = kernels.clone();
            let mut t = CudaTrainer::new(c.clone(), k, &mlp, norm, &layout, (0, 1), 3).unwrap();
            t.set_serial(true).unwrap();
            Some(t)
        }
    };
    let mut gpu = CudaTrainer::new(c, kernels, &mlp, norm, &layout, (0, 1), 3).unwrap();
    gpu.set_serial(serial).unwrap();
    let mut cpu = CpuTrainer::new(mlp.clone(), norm, &layout, (0, 1), 2).unwrap();
    for epoch in 0..3 {
        let g = gpu
            .train_epoch_with(loader.epoch(epoch).unwrap(), &mut |_, _| {})
            .unwrap()
            .metrics;
        if let Some(t) = &mut twin {
            let s = t
                .train_epoch_with(loader.epoch(epoch).unwrap(), &mut |_, _| {})
                .unwrap()
                .metrics;
            let rel = (g.loss_sum - s.loss_sum).abs() / s.loss_sum.abs().max(1e-6);
            assert!(
                rel < 1e-9 && (g.correct, g.samples) == (s.correct, s.samples),
                "epoch {epoch}: overlapped {g:?} vs serialised {s:?}"
            );
        }
        let h = cpu
            .train_epoch(loader.epoch(epoch).unwrap())
            .unwrap()
            .metrics;
        println!("epoch {epoch}: gpu {g:?}\n         cpu {h:?}");
        assert_eq!(g.samples, h.samples);
        let rel = (g.loss_sum - h.loss_sum).abs() / h.loss_sum.abs().max(1e-6);
        assert!(
            rel < 1e-3,
            "epoch {epoch}: loss {} vs {}",
            g.loss_sum,
            h.loss_sum
        );
        assert!(
            g.correct.abs_diff(h.correct) <= h.samples / 100,
            "epoch {epoch}: correct {} vs {}",
            g.correct,
            h.correct
        );
    }
    let (gw, cw) = (gpu.weights().unwrap(), cpu.model().clone());
    for (name, a, b) in [("w1", &gw.w1, &cw.w1), ("w2", &gw.w2, &cw.w2)] {
        let worst = largest_difference(a, b);
        println!("{name}: worst difference {worst:e}");
        assert!(worst < 1e-2, "{name} differs by {worst}");
    }
    if let Some(t) = &twin {
        let sw = t.weights().unwrap();
        for (name, a, b) in [("w1", &gw.w1, &sw.w1), ("w2", &gw.w2, &sw.w2)] {
            let worst = largest_difference(a, b);
            assert!(worst < 1e-6, "{name}: overlapped vs serialised by {worst}");
        }
    }
    assert_eq!(
        loader.free_buffers(),
        loader.buffers(),
        "every pinned buffer came back"
    );
}

/// A label outside the classes is flagged on the device and comes back, at the end of the
/// epoch, as the same error as the CPU backend's (which also knows the sample); the
/// loader is left whole.
pub fn a_bad_label_is_an_error(c: Cuda) {
    let dir = tempfile::tempdir().unwrap();
    crate::common::write_bad_label_set(dir.path());
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(dir.path()).unwrap());
    let mut loader = pinned_loader(&c, &ds, 16)
        .shuffle(Shuffle::None)
        .build()
        .unwrap();
    let mlp = Mlp::new(MlpConfig {
        inputs: 4,
        hidden: 8,
        classes: 10,
        lr: 0.1,
        seed: 1,
    })
    .unwrap();
    let norm = Normalize {
        mean: 128.0,
        inv_std: 1.0 / 64.0,
    };
    let kernels = Kernels::load(&c).unwrap();
    let layout = loader.layout().clone();
    let mut cpu = CpuTrainer::new(mlp.clone(), norm, &layout, (0, 1), 2).unwrap();
    let mut gpu = CudaTrainer::new(c, kernels, &mlp, norm, &layout, (0, 1), 2).unwrap();
    for (trainer, sample) in [
        (&mut cpu as &mut dyn Trainer, Some(123)),
        (&mut gpu as &mut dyn Trainer, None),
    ] {
        let err = trainer.train(&mut loader, 0, &mut |_, _| {}).unwrap_err();
        println!("{err}");
        assert!(
            err.to_string().contains("label 42 is outside 0..10"),
            "{err}"
        );
        match err {
            stokehold::Error::Label {
                label: 42,
                classes: 10,
                sample: s,
            } => assert_eq!(s, sample),
            e => panic!("not a label error: {e}"),
        }
        assert_eq!(loader.free_buffers(), loader.buffers());
    }
}

/// The kernel cache: compiled on the first load, read on the second; a truncated or
/// foreign cache file is compiled afresh and replaced, never an error.
pub fn the_kernel_cache_survives_damage(c: Cuda) {
    use stokehold::cuda::KernelOrigin;
    let dir = tempfile::tempdir().unwrap();
    let first = Kernels::load_from(&c, dir.path()).unwrap();
    assert!(
        matches!(first.origin, KernelOrigin::Compiled { .. }),
        "{:?}",
        first.origin
    );
    let second = Kernels::load_from(&c, dir.path()).unwrap();
    assert!(
        matches!(second.origin, KernelOrigin::Cached { .. }),
        "{:?}",
        second.origin
    );
    let file = std::path::PathBuf::from(first.origin.cache());
    let whole = std::fs::read(&file).unwrap();
    for damaged in [
        &whole[..whole.len() / 2],
        &b"\x7fELF\x02\x01 not a cubin"[..],
        b"",
    ] {
        std::fs::write(&file, damaged).unwrap();
        let k = Kernels::load_from(&c, dir.path()).unwrap();
        assert!(
            matches!(k.origin, KernelOrigin::Compiled { .. }),
            "{:?}",
            k.origin
        );
        assert_eq!(
            std::fs::read(&file).unwrap(),
            whole,
            "the cache file is whole again"
        );
    }
}

/// Epochs that are not whole: a resumed epoch trains on the rest and leaves the device
/// cache unfilled (a whole epoch then fills it); a sharded order gets no cache; an error
/// from the work on a batch ends the epoch with every pinned buffer back, and the next
/// epoch runs.
pub fn partial_and_failing_epochs(c: Cuda) {
    use stokehold::cuda::Feeder;
    use stokehold::{Error, Shard};
    let (mut loader, mlp, norm, kernels) = setup(&c, DIGITS.as_ref(), 64, 16, 0.1);
    let layout = loader.layout().clone();
    let mut t = CudaTrainer::new(c.clone(), kernels, &mlp, norm, &layout, (0, 1), 3).unwrap();
    assert!(t.enable_device_cache(&loader, 0.5).unwrap().is_some());
    {
        let mut it = loader.epoch(0).unwrap();
        for _ in 0..5 {
            it.next().unwrap().unwrap();
        }
    }
    // A loader resumed where that one stopped: epoch 0 from batch 5.
    let state = loader.state();
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(DIGITS).unwrap());
    let mut loader = pinned_loader(&c, &ds, 64)
        .shuffle(Shuffle::Full { seed: 2 })
        .resume(state)
        .build()
        .unwrap();
    let out = t
        .train_epoch_with(loader.epoch(0).unwrap(), &mut |_, _| {})
        .unwrap();
    assert_eq!(out.metrics.samples, 1797 - 5 * 64);
    assert!(!t.cache_filled(), "a resumed epoch must not fill the cache");
    t.train_epoch_with(loader.epoch(1).unwrap(), &mut |_, _| {})
        .unwrap();
    assert!(t.cache_filled(), "a whole epoch fills it");
    let cached = t
        .train_epoch_cached(&loader.order().epoch(2), &mut |_, _| {})
        .unwrap();
    assert_eq!(cached.metrics.samples, 1797);
    // An epoch of another loader of the same layout (the digits twice over) would
    // gather past the cache's rows: refused before any kernel.
    let twice: Arc<dyn Dataset> =
        Arc::new(stokehold::Concat::new(vec![Arc::clone(&ds), Arc::clone(&ds)]).unwrap());
    let mut other = pinned_loader(&c, &twice, 64).build().unwrap();
    let err = t
        .train_epoch_cached(&other.order().epoch(2), &mut |_, _| {})
        .unwrap_err();
    assert!(err.to_string().contains("past its 1797 rows"), "{err}");
    // So would one of the same dataset in larger batches, past the batch buffer.
    let larger = pinned_loader(&c, &ds, 128).build().unwrap();
    let err = t
        .train_epoch_cached(&larger.order().epoch(2), &mut |_, _| {})
        .unwrap_err();
    assert!(err.to_string().contains("batches of 128 samples"), "{err}");
    // The cache still serves its own loader's epochs.
    let cached = t
        .train_epoch_cached(&loader.order().epoch(3), &mut |_, _| {})
        .unwrap();
    assert_eq!(cached.metrics.samples, 1797);
    // Nor does a fresh cache fill from it: its epoch holds more samples than the rows.
    let mut fresh = CudaTrainer::new(
        c.clone(),
        setup(&c, DIGITS.as_ref(), 64, 16, 0.1).3,
        &mlp,
        norm,
        &layout,
        (0, 1),
        3,
    )
    .unwrap();
    assert!(fresh.enable_device_cache(&loader, 0.5).unwrap().is_some());
    fresh
        .train_epoch_with(other.epoch(0).unwrap(), &mut |_, _| {})
        .unwrap();
    assert!(
        !fresh.cache_filled(),
        "another loader's epoch filled the cache"
    );

    let mut feeder = Feeder::new(&c, &layout, 3).unwrap();
    // The trainer and the feeder turn cudarc's event tracking off on context objects of
    // their own: slices a user makes through `c.ctx` keep it.
    assert!(c.ctx.is_event_tracking());
    let mut seen = 0;
    let err = feeder
        .run_epoch(
            loader.epoch(3).unwrap(),
            &mut |_| {
                seen += 1;
                if seen == 4 {
                    Err(Error::Config("the work failed".into()))
                } else {
                    Ok(())
                }
            },
            &mut |_, _| {},
        )
        .unwrap_err();
    assert!(err.to_string().contains("the work failed"), "{err}");
    assert_eq!(
        loader.free_buffers(),
        loader.buffers(),
        "buffers back after an error"
    );
    let next = feeder
        .run_epoch(loader.epoch(4).unwrap(), &mut |_| Ok(()), &mut |_, _| {})
        .unwrap();
    assert_eq!(next.samples, 1797);
    assert_eq!(loader.free_buffers(), loader.buffers());
    // A panic in the work goes on to the caller once the streams are settled: every
    // buffer is back, and the feeder and the loader work on.
    let mut calls = 0;
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut work = |_: &stokehold::cuda::DeviceBatch| {
            calls += 1;
            assert!(calls < 4, "the work panicked");
            Ok(())
        };
        feeder.run_epoch(loader.epoch(5).unwrap(), &mut work, &mut |_, _| {})
    }));
    assert!(panicked.is_err());
    assert_eq!(loader.free_buffers(), loader.buffers());
    let after = feeder
        .run_epoch(loader.epoch(6).unwrap(), &mut |_| Ok(()), &mut |_, _| {})
        .unwrap();
    assert_eq!(after.samples, 1797);
    // Another loader's batches (an evaluation loader with twice the batch) would run
    // past the feeder's slots: refused, through either way in.
    let mut wide = pinned_loader(&c, &ds, 128).build().unwrap();
    let err = feeder
        .run_epoch(wide.epoch(0).unwrap(), &mut |_| Ok(()), &mut |_, _| {})
        .unwrap_err();
    assert!(err.to_string().contains("another loader's layout"), "{err}");
    let batch = wide.epoch(0).unwrap().next().unwrap().unwrap();
    let err = feeder.feed_one(&batch, |_| Ok(())).unwrap_err();
    assert!(err.to_string().contains("another loader's layout"), "{err}");
    let err = t
        .train_epoch_with(wide.epoch(1).unwrap(), &mut |_, _| {})
        .unwrap_err();
    assert!(err.to_string().contains("another loader's layout"), "{err}");
    drop(batch);

    let sharded = Loader::builder_shared(ds)
        .batch_size(64)
        .shard(Shard::new(1, 2).unwrap())
        .build()
        .unwrap();
    assert_eq!(t.enable_device_cache(&sharded, 0.5).unwrap(), None);
    assert!(!t.cache_filled());
}

/// A host function for a stream: sleeps 3 ms, so that the stream's next work runs late.
unsafe extern "C" fn slow(_: *mut std::ffi::c_void) {
    std::thread::sleep(std::time::Duration::from_millis(3));
}

/// The digits in batches of 100 (a full shuffle by `seed`) and `n` device slots for
/// them.
pub fn digits_in_slots(
    c: &Cuda,
    seed: u64,
    n: usize,
) -> (Arc<dyn Dataset>, Loader, stokehold::cuda::DeviceSlots) {
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(DIGITS).unwrap());
    let loader = pinned_loader(c, &ds, 100)
        .shuffle(Shuffle::Full { seed })
        .build()
        .unwrap();
    let slots = stokehold::cuda::DeviceSlots::new(&c.ctx, loader.layout(), n).unwrap();
    (ds, loader, slots)
}

/// Each batch's samples against the rows of column 0 its consumer read back from its
/// slot (into `back`, the copy synchronised): a slot overwritten before its consumer
/// read it, or read before its copy landed, shows.
fn read_back_rows(ds: &Arc<dyn Dataset>, seen: &[(Vec<u64>, Box<dyn stokehold::HostMemory>)]) {
    let row = ds.columns()[0].row_bytes;
    for (indices, back) in seen {
        let mut x = vec![0u8; indices.len() * row];
        let mut y = vec![0u8; indices.len() * ds.columns()[1].row_bytes];
        ds.gather(0, indices, &mut [&mut x, &mut y]).unwrap();
        // SAFETY: `back` holds at least this many bytes, written by the synchronised copy.
        let back = unsafe { std::slice::from_raw_parts(back.as_ptr(), x.len()) };
        assert!(x == back, "a slot was overwritten or read too early");
    }
}

/// Batches used on a consumer thread's per-thread default stream (DLPack's `stream=2`)
/// and dropped on the loop's thread, whose own per-thread stream is another: the next
/// copy into the slot must still wait for the consumer's read, which its release,
/// recorded on the legacy stream (after every blocking stream's work), makes it do. One
/// slot, so that every copy reuses it; each read held back by a host function.
pub fn a_batch_used_on_another_threads_default_stream_waits_for_it(c: Cuda) {
    use cudarc::driver::{result, sys};
    use stokehold::cuda::{LentBatch, PER_THREAD_STREAM};
    use stokehold::HostMemory;

    let (ds, mut loader, mut slots) = digits_in_slots(&c, 8, 1);
    let layout = loader.layout().clone();
    let pinned = PinnedAlloc::new(Arc::clone(&c.ctx), PinnedKind::Plain);
    let row = layout.columns()[0].row_bytes;
    let (to_consumer, lent) = std::sync::mpsc::channel::<(LentBatch, Box<dyn HostMemory>)>();
    let (to_loop, used) = std::sync::mpsc::channel::<LentBatch>();
    let ctx = Arc::clone(&c.ctx);
    let consumer = std::thread::spawn(move || {
        ctx.bind_to_thread().unwrap();
        let stream = PER_THREAD_STREAM as sys::CUstream;
        let mut seen = Vec::new();
        for (batch, back) in lent {
            // SAFETY: the stream outlives the batch (a default stream, or one this
            // check keeps until after the batch is dropped).
            unsafe { batch.wait_on(PER_THREAD_STREAM) }.unwrap();
            let n = batch.len() * row;
            // SAFETY: the host function takes no argument; the copy writes `n` bytes of
            // the slot (the batch's rows of column 0) into `back` (at least `n` bytes),
            // read only after this stream is synchronised below, and kept until then.
            unsafe {
                result::stream::launch_host_function(stream, slow, std::ptr::null_mut()).unwrap();
                let dst = std::slice::from_raw_parts_mut(back.as_ptr(), n);
                result::memcpy_dtoh_async(dst, batch.column_ptr(0), stream).unwrap();
            }
            seen.push((batch.indices().to_vec(), back));
            to_loop.send(batch).unwrap();
        }
        // SAFETY: this thread's per-thread default stream, in its current context.
        unsafe { result::stream::synchronize(stream) }.unwrap();
        seen
    });
    for batch in loader.epoch(0).unwrap() {
        let batch = slots.lend(batch.unwrap()).unwrap();
        let back = pinned.alloc(batch.len() * row).unwrap();
        to_consumer.send((batch, back)).unwrap();
        // Released here, on another thread than its consumer's.
        drop(used.recv().unwrap());
    }
    drop(to_consumer);
    let seen = consumer.join().unwrap();
    read_back_rows(&ds, &seen);
    assert_eq!(seen.len() as u64, loader.batches());
}

/// Lent batches on a consumer stream of their own, released at once while the consumer
/// still has work on them queued: each batch read back on the consumer's stream (behind
/// a delay) holds its rows, so no slot was copied into before the consumer was done
/// with it, and no read ran before its copy. Then: a thread holding every slot gets an
/// error, not a hang; a batch used on another thread is waited for.
pub fn lent_batches_wait_for_their_consumers(c: Cuda) {
    use cudarc::driver::result;

    let (ds, mut loader, mut slots) = digits_in_slots(&c, 4, 2);
    let layout = loader.layout().clone();
    let consumer = c.ctx.new_stream().unwrap();
    let handle = consumer.cu_stream() as usize;
    let pinned = PinnedAlloc::new(Arc::clone(&c.ctx), PinnedKind::Plain);
    let mut seen = Vec::new();
    let started = std::time::Instant::now();
    for (i, batch) in loader.epoch(0).unwrap().enumerate() {
        // Every other batch, the copy runs late (a read that did not wait for it sees
        // the slot's old rows); the others, the consumer's read runs late (a slot
        // copied into again before it sees a later batch's rows).
        let late = |stream: &cudarc::driver::CudaStream| {
            // SAFETY: the host function takes no argument.
            unsafe {
                result::stream::launch_host_function(stream.cu_stream(), slow, std::ptr::null_mut())
            }
            .unwrap()
        };
        if i % 2 == 1 {
            late(slots.stream());
        }
        let lent = slots.lend(batch.unwrap()).unwrap();
        // SAFETY: the stream outlives the batch (a default stream, or one this
        // check keeps until after the batch is dropped).
        unsafe { lent.wait_on(handle) }.unwrap();
        let x = lent.column_ptr(0);
        let n = lent.len() * layout.columns()[0].row_bytes;
        // Pinned, so that the read-back is asynchronous (into pageable memory it would
        // wait for the consumer stream, and order everything).
        let back = pinned.alloc(n).unwrap();
        if i % 2 == 0 {
            late(&consumer);
        }
        // SAFETY: the copy writes `n` bytes of the slot (the batch's rows of column 0)
        // into `back` (at least `n` bytes), which is read only after the consumer
        // stream is synchronised below, and lives until then (kept in `seen`).
        unsafe {
            let dst = std::slice::from_raw_parts_mut(back.as_ptr(), n);
            result::memcpy_dtoh_async(dst, x, consumer.cu_stream()).unwrap();
        }
        seen.push((lent.indices().to_vec(), back));
        drop(lent);
    }
    consumer.synchronize().unwrap();
    read_back_rows(&ds, &seen);
    assert_eq!(seen.len() as u64, loader.batches());
    // The copies' device time, every copy seen complete once drained: some, and within
    // the epoch's wall time; read through the clock too, without the slots.
    let clock = slots.copy_clock();
    slots.drain().unwrap();
    let (copied, wall) = (slots.copy_time(), started.elapsed());
    assert!(
        copied > std::time::Duration::ZERO && copied < wall,
        "{copied:?} of {wall:?}"
    );
    assert_eq!(clock.elapsed(), copied);

    // Both slots held on this thread: the third batch is an error within seconds.
    let mut epoch = loader.epoch(1).unwrap();
    let a = slots.lend(epoch.next().unwrap().unwrap()).unwrap();
    let b = slots.lend(epoch.next().unwrap().unwrap()).unwrap();
    let err = slots.lend(epoch.next().unwrap().unwrap()).unwrap_err();
    assert!(
        matches!(err, stokehold::Error::SlotsExhausted { slots: 2 }),
        "{err}"
    );
    // One of them used on another thread, dropped there later: the next lend waits for it.
    drop(a);
    let c2 = slots.lend(epoch.next().unwrap().unwrap()).unwrap();
    let (used, on) = std::sync::mpsc::channel();
    let dropping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let dropped = Arc::clone(&dropping);
    let elsewhere = std::thread::spawn(move || {
        // SAFETY: the stream outlives the batch (a default stream, or one this
        // check keeps until after the batch is dropped).
        unsafe { b.wait_on(stokehold::cuda::LEGACY_STREAM) }.unwrap();
        used.send(()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1500));
        dropping.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(b);
    });
    on.recv().unwrap();
    let d = slots.lend(epoch.next().unwrap().unwrap()).unwrap();
    assert!(
        dropped.load(std::sync::atomic::Ordering::SeqCst),
        "a slot was lent while its batch was still held on another thread"
    );
    elsewhere.join().unwrap();
    drop((c2, d));
    // A thread whose current context is another one (none here; PyTorch's device)
    // finds it again after each call: the CUDA runtime takes its device from it.
    let none = || result::ctx::get_current().unwrap().is_none();
    // SAFETY: unbinds this thread's context; each call below binds its own.
    unsafe { result::ctx::set_current(std::ptr::null_mut()) }.unwrap();
    let e = slots.lend(epoch.next().unwrap().unwrap()).unwrap();
    assert!(none(), "lend left its context current");
    // SAFETY: the stream outlives the batch (a default stream, or one this
    // check keeps until after the batch is dropped).
    unsafe { e.wait_on(stokehold::cuda::LEGACY_STREAM) }.unwrap();
    assert!(none(), "wait_on left its context current");
    e.synchronize().unwrap();
    assert!(none(), "synchronize left its context current");
    drop(e);
    assert!(none(), "a release left its context current");
    slots.drain().unwrap();
    assert!(none(), "drain left its context current");
    // The slots dropped before the batch they lent, then the batch (the slots' memory,
    // events and stream go with the last of them).
    let f = slots.lend(epoch.next().unwrap().unwrap()).unwrap();
    drop(slots);
    assert!(none(), "dropping the slots left their context current");
    drop(f);
    assert!(
        none(),
        "dropping their last batch left their context current"
    );
    let probed = stokehold::cuda::probe_driver(0).unwrap();
    assert!(none(), "probe_driver left its context current");
    // cudarc's context binds itself when its last handle goes: KeepCurrent undoes it.
    let current = stokehold::cuda::KeepCurrent::new();
    drop(probed);
    drop(current);
    assert!(none(), "KeepCurrent did not put the thread's context back");
}

/// `DeviceSlots::reserve`'s wait for a slot stops when its interrupt check says so
/// (Python's Ctrl-C), with nothing taken: the wait goes on at the next call and the
/// batch it was for comes next; a wait cut into pieces for slots held on this thread
/// still ends in `SlotsExhausted`.
pub fn a_slot_wait_stops_for_its_interrupt_check(c: Cuda) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;
    use stokehold::cuda::{DeviceSlots, LEGACY_STREAM};

    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(DIGITS).unwrap());
    let mut loader = pinned_loader(&c, &ds, 100).build().unwrap();
    let layout = loader.layout().clone();
    // Two slots, and the count of their interrupt checks.
    let two_slots = || {
        let mut slots = DeviceSlots::new(&c.ctx, &layout, 2).unwrap();
        let checks = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&checks);
        // Every fifth check (about 100 ms of waiting) stops the wait.
        slots.interrupt_with(move || counted.fetch_add(1, Ordering::AcqRel) % 5 == 4);
        (slots, checks)
    };
    let (mut slots, checks) = two_slots();
    let mut epoch = loader.epoch(0).unwrap();
    let a = slots.lend(epoch.next().unwrap().unwrap()).unwrap();
    let b = slots.lend(epoch.next().unwrap().unwrap()).unwrap();
    // Both used on a thread that keeps them until told: no slot comes back meanwhile.
    let (used, go) = (mpsc::channel(), mpsc::channel::<()>());
    let keeper = std::thread::spawn(move || {
        // SAFETY: the stream outlives the batch (a default stream, or one this
        // check keeps until after the batch is dropped).
        unsafe { a.wait_on(LEGACY_STREAM) }.unwrap();
        // SAFETY: the stream outlives the batch (a default stream, or one this
        // check keeps until after the batch is dropped).
        unsafe { b.wait_on(LEGACY_STREAM) }.unwrap();
        used.0.send(()).unwrap();
        let told = go.1.recv_timeout(Duration::from_secs(20));
        drop((a, b));
        told.is_ok()
    });
    used.1.recv().unwrap();
    let err = slots.reserve().unwrap_err();
    assert!(matches!(err, stokehold::Error::Interrupted), "{err}");
    assert!(checks.load(Ordering::Acquire) >= 5);
    go.0.send(()).unwrap();
    let mut again = 0;
    let reserved = loop {
        match slots.reserve() {
            Ok(r) => break r,
            Err(stokehold::Error::Interrupted) if again < 1000 => again += 1,
            Err(e) => panic!("the wait after the slots came back: {e}"),
        }
    };
    assert!(keeper.join().unwrap(), "the wait was not interrupted");
    // Nothing was taken from the epoch: the batch the wait was for comes next, into
    // the reserved slot.
    let third = slots
        .lend_reserved(reserved, epoch.next().unwrap().unwrap())
        .unwrap();
    assert_eq!(third.number(), 2);
    // Both slots held here now, but these slots' batches were handed to another
    // thread: batches lent and not yet used there (a queue to a training thread that
    // dropped its last batch before its step) are not called a deadlock.
    let fourth = slots.lend(epoch.next().unwrap().unwrap()).unwrap();
    for _ in 0..15 {
        let err = slots.reserve().unwrap_err();
        assert!(matches!(err, stokehold::Error::Interrupted), "{err}");
    }
    drop((third, fourth, epoch));
    slots.drain().unwrap();
    // Slots whose batches never left this thread: waits cut into pieces of about
    // 100 ms still end in the error after the grace, instead of each starting it anew.
    // Each reservation is its own (two threads taking batches keep one each), and
    // one dropped unused frees its slot.
    let (mut slots, _) = two_slots();
    let mut epoch = loader.epoch(1).unwrap();
    let (first, second) = (slots.reserve().unwrap(), slots.reserve().unwrap());
    drop(first);
    let third = slots.reserve().unwrap();
    let held: Vec<_> = [second, third]
        .into_iter()
        .map(|r| {
            slots
                .lend_reserved(r, epoch.next().unwrap().unwrap())
                .unwrap()
        })
        .collect();
    assert_eq!(held[0].number() + 1, held[1].number());
    let mut pieces = 0;
    let err = loop {
        match slots.reserve() {
            Err(stokehold::Error::Interrupted) if pieces < 200 => pieces += 1,
            Err(e) => break e,
            Ok(_) => panic!("a slot while both are held"),
        }
    };
    assert!(
        matches!(err, stokehold::Error::SlotsExhausted { slots: 2 }),
        "{err}"
    );
    assert!(pieces >= 2, "the wait was not cut into pieces ({pieces})");
    drop(held);
    slots.drain().unwrap();
}

/// A user's own work on a [`Feeder`](stokehold::cuda::Feeder) with the device cache and
/// the augmentation on the device (`enable_device_cache`, `augment_on_device`, `feed`):
/// every batch it reads back is, byte for byte, the batch a loader augmenting in its
/// workers gives, in the epoch that fills the cache and in the cached ones, batch by
/// batch and replayed as one CUDA graph (where the work is called only to capture it,
/// and captured again after the augmentation is replaced).
pub fn a_users_work_reads_cached_and_augmented_epochs_as_the_loader_gives_them(c: Cuda) {
    use cudarc::driver::result;
    use stokehold::cuda::Feeder;
    use stokehold::{Augment, HostMemory};

    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(DIGITS).unwrap());
    let augment = Augment::new("x", 5).crop(3).flip(true);
    let build = |b: stokehold::LoaderBuilder| b.shuffle(Shuffle::Full { seed: 4 }).build().unwrap();
    for replay in [false, true] {
        let host = Loader::builder_shared(Arc::clone(&ds)).batch_size(64);
        let mut host = build(host.augment(augment.clone()));
        let mut raw = build(pinned_loader(&c, &ds, 64));
        let mut feeder = Feeder::new(&c, raw.layout(), 3).unwrap();
        let augmenter = augment.bind(ds.columns()).unwrap();
        feeder.augment_on_device(&augmenter).unwrap();
        assert!(feeder.enable_device_cache(&raw, 0.5).unwrap().is_some());
        feeder.replay_cached_epochs(replay);
        let layout = feeder.work_layout().clone();
        assert_eq!(&layout, host.layout());
        let n = raw.order().batches() as usize;
        let pinned = PinnedAlloc::new(Arc::clone(&c.ctx), PinnedKind::Plain);
        let back: Vec<Box<dyn HostMemory>> = (0..n)
            .map(|_| pinned.alloc(layout.bytes()).unwrap())
            .collect();
        let mut calls = 0;
        for e in 0..4 {
            if e == 2 {
                // A new augmentation drops the graph: the next cached epoch captures anew.
                feeder.augment_on_device(&augmenter).unwrap();
            }
            let fed = feeder
                .feed(
                    &mut raw,
                    e,
                    &mut |db| {
                        calls += 1;
                        let to = &back[db.number() as usize];
                        // SAFETY: the pinned buffer holds a whole batch of the layout, and
                        // nothing else touches it until `feed` returns (it waits for the
                        // device at the epoch's end).
                        let to = unsafe { std::slice::from_raw_parts_mut(to.as_ptr(), to.len()) };
                        let (from, s) = (db.column_ptr(0), db.stream().cu_stream());
                        // SAFETY: the batch's columns are one allocation of the layout's
                        // bytes from column 0; the copy is on the stream the batch is on.
                        unsafe { result::memcpy_dtoh_async(&mut to[..layout.bytes()], from, s) }?;
                        Ok(())
                    },
                    &mut |_, _| {},
                )
                .unwrap();
            assert_eq!(fed.cached, e > 0, "epoch {e}");
            assert_eq!(fed.batches as usize, n);
            for (b, batch) in host.epoch(e).unwrap().enumerate() {
                let batch = batch.unwrap();
                // SAFETY: written by the copies `feed` waited for.
                let got = unsafe { std::slice::from_raw_parts(back[b].as_ptr(), layout.bytes()) };
                for (j, col) in layout.columns().iter().enumerate() {
                    let part = |bytes: &[u8]| {
                        bytes[layout.offset(j)..][..batch.len() * col.row_bytes].to_vec()
                    };
                    assert!(
                        part(got) == part(batch.as_bytes()),
                        "replay {replay}, epoch {e}, batch {b}, column {}",
                        col.name
                    );
                }
            }
        }
        // Replayed, the work ran for epoch 0, once more for the capture after it, and for
        // the capture in epoch 2; epochs 1 and 3 were one launch each.
        assert_eq!(calls, if replay { 3 * n } else { 4 * n }, "replay {replay}");
    }
}

/// The trainer's augmentation on the device (`CudaTrainer::augment_with`) trains as the
/// loader's workers' does: epoch 0 through the loader fills the device cache with the
/// raw images; later epochs, gathered from it, are augmented by their own draws (epoch
/// 1 as one CUDA graph, 2 and 4 traced, batch by batch), a resumed epoch by its
/// batches' own, a single step too.
/// An augmentation the model cannot read, or bound to other columns, is refused.
pub fn the_trainer_augments_on_the_device_as_the_workers_do(c: Cuda) {
    use stokehold::{Augment, LoaderState};

    let augment = Augment::new("x", 9).crop(2).flip(true);
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(DIGITS).unwrap());
    let (_, mlp, norm, kernels) = setup(&c, DIGITS.as_ref(), 64, 32, 0.1);
    let build = |b: stokehold::LoaderBuilder| b.shuffle(Shuffle::Full { seed: 2 }).build().unwrap();
    let mut host = build(pinned_loader(&c, &ds, 64).augment(augment.clone()));
    let mut raw = build(pinned_loader(&c, &ds, 64));
    let trainer = |layout: &stokehold::BatchLayout| {
        CudaTrainer::new(c.clone(), kernels.clone(), &mlp, norm, layout, (0, 1), 3).unwrap()
    };
    let (mut workers, mut device) = (trainer(host.layout()), trainer(raw.layout()));
    let augmenter = augment.bind(ds.columns()).unwrap();
    println!(
        "augment kernel: {:?}",
        device.augment_with(&augmenter).unwrap()
    );
    assert_eq!(device.augmenter().unwrap().augment(), &augment);
    assert!(device.enable_device_cache(&raw, 0.5).unwrap().is_some());
    assert!(workers.enable_device_cache(&host, 0.5).unwrap().is_none());
    let same = |a: Metrics, b: Metrics, what: &str| {
        assert_eq!((a.samples, a.correct), (b.samples, b.correct), "{what}");
        assert!(
            (a.loss_sum - b.loss_sum).abs() <= 1e-6 * a.loss_sum.abs().max(1.0),
            "{what}: loss {} by the workers' augmentation, {} by the device's",
            a.loss_sum,
            b.loss_sum
        );
    };
    // Epoch 0 fills the cache; 1 and 2 come from it, 2 traced (batch by batch); 3 is
    // resumed at batch 5 (through the loader); 4 comes from the cache again.
    for e in 0..5 {
        if e == 2 {
            let path = tempfile::NamedTempFile::new().unwrap().into_temp_path();
            device.set_trace(Arc::new(
                stokehold::telemetry::Trace::create(&path).unwrap(),
            ));
        }
        if e == 3 {
            for l in [&mut host, &mut raw] {
                let at = LoaderState {
                    batch: 5,
                    ..l.state()
                };
                l.resume(at).unwrap();
            }
        }
        let a = workers.train(&mut host, e, &mut |_, _| {}).unwrap();
        let b = device.train(&mut raw, e, &mut |_, _| {}).unwrap();
        same(a.metrics, b.metrics, &format!("epoch {e}"));
        assert!(device.cache_filled());
        // The cache serves every whole epoch after the first: no copies.
        let cached = ![0, 3].contains(&e);
        assert_eq!(b.stages.copy.is_zero(), cached, "epoch {e}: {:?}", b.stages);
    }
    let (aw, bw) = (workers.weights().unwrap(), device.weights().unwrap());
    let worst = largest_difference(&aw.w1, &bw.w1);
    assert!(worst < 1e-5, "weights differ by {worst}");

    // One step on one batch, augmented the same way.
    let first = |l: &mut Loader| l.epoch(7).unwrap().nth(3).unwrap().unwrap();
    let (hb, rb) = (first(&mut host), first(&mut raw));
    let (a, b) = (
        workers.step_once(&hb).unwrap(),
        device.step_once(&rb).unwrap(),
    );
    same(a, b, "step_once");

    // Refused: a float32 column the model cannot read, an augmenter of other columns.
    let mut other = trainer(raw.layout());
    let normalised = augment.clone().normalize(&[0.5], &[0.25]);
    let refused = [
        normalised.bind(ds.columns()).unwrap(),
        augment.bind(&ds.columns()[..1]).unwrap(),
    ];
    for augmenter in refused {
        match other.augment_with(&augmenter) {
            Err(stokehold::Error::Config(m)) => println!("refused: {m}"),
            Err(e) => panic!("another error than Config: {e}"),
            Ok(_) => panic!("augment_with took {augmenter:?}"),
        }
    }
}

/// Augmenting on the device (`DeviceSlots::augmented`, `kernels/augment.cu`) writes the
/// same bytes as the loader's workers do on the CPU: a normalised `float32` column
/// (channels first) and a `uint8` one (channels last, from the same file), every column
/// of every batch of two epochs.
/// `n` images of 3 x 20 x 18 bytes (`x.npy`, noise) and their `int64` labels
/// (`y.npy`, five times the index), in `dir`.
fn noise_images(dir: &std::path::Path, n: u64) -> Arc<dyn Dataset> {
    use stokehold::gen::NpyWriter;
    use stokehold::DType;

    let mut x = NpyWriter::create(dir.join("x.npy"), DType::U8, &[n, 3, 20, 18]).unwrap();
    for (i, b) in x.data_mut().iter_mut().enumerate() {
        *b = ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8;
    }
    x.finish().unwrap();
    let mut y = NpyWriter::create(dir.join("y.npy"), DType::I64, &[n]).unwrap();
    for (i, out) in y.data_mut().chunks_exact_mut(8).enumerate() {
        out.copy_from_slice(&(i as i64 * 5).to_le_bytes());
    }
    y.finish().unwrap();
    Arc::new(NpyDataset::open(dir).unwrap())
}

/// Each column of a lent batch, read back on `stream` after it waited for the copy.
fn lent_columns(
    lent: &stokehold::cuda::LentBatch,
    stream: &cudarc::driver::CudaStream,
) -> Vec<Vec<u8>> {
    use cudarc::driver::result;

    // SAFETY: the stream outlives the batch (a default stream, or one this
    // check keeps until after the batch is dropped).
    unsafe { lent.wait_on(stream.cu_stream() as usize) }.unwrap();
    let columns = lent.layout().columns().iter().enumerate();
    let back = columns
        .map(|(k, col)| {
            let mut back = vec![0u8; lent.len() * col.row_bytes];
            // SAFETY: column k of the slot holds the batch's rows; `back` as many
            // bytes, pageable, so the copy is complete when the sync returns.
            unsafe { result::memcpy_dtoh_async(&mut back, lent.column_ptr(k), stream.cu_stream()) }
                .unwrap();
            back
        })
        .collect();
    stream.synchronize().unwrap();
    back
}

/// Whether `columns` (a lent batch's, read back) hold the bytes of host batch `want`.
fn same_rows(columns: &[Vec<u8>], want: &stokehold::HostBatch) -> bool {
    let layout = want.layout();
    let bytes = want.as_bytes();
    columns
        .iter()
        .enumerate()
        .all(|(k, c)| *c == bytes[layout.offset(k)..layout.offset(k) + c.len()])
}

pub fn augmenting_on_the_device_matches_the_workers(c: Cuda) {
    use cudarc::driver::result;
    use stokehold::cuda::DeviceSlots;
    use stokehold::Augment;

    let dir = tempfile::tempdir().unwrap();
    let ds = noise_images(dir.path(), 150);
    let augments = [
        Augment::new("x", 3)
            .crop(4)
            .flip(true)
            .fill(7)
            .normalize(&[0.49, 0.48, 0.45], &[0.25, 0.24, 0.26]),
        Augment::new("x", 4).crop(2).flip(true).channels_last(true),
    ];
    for augment in augments {
        let build = |b: stokehold::LoaderBuilder| {
            b.batch_size(32)
                .shuffle(Shuffle::Full { seed: 6 })
                .build()
                .unwrap()
        };
        let mut host = build(Loader::builder_shared(Arc::clone(&ds)).augment(augment.clone()));
        let mut raw = build(pinned_loader(&c, &ds, 32));
        let augmenter = augment.bind(ds.columns()).unwrap();
        // From a thread with no current context (another device's, in PyTorch): it is
        // put back after the kernel's build and the slots' allocations.
        // SAFETY: unbinds this thread's context; each call binds its own.
        unsafe { result::ctx::set_current(std::ptr::null_mut()) }.unwrap();
        let mut slots = DeviceSlots::augmented(&c, raw.layout(), 3, &augmenter).unwrap();
        assert!(
            result::ctx::get_current().unwrap().is_none(),
            "DeviceSlots::augmented left its context current"
        );
        println!("augment kernel: {:?}", slots.augment_origin());
        assert_eq!(
            slots.augmenter().unwrap().columns(),
            host.layout().columns()
        );
        let consumer = c.ctx.new_stream().unwrap();
        for epoch in 0..2 {
            let mut want = host.epoch(epoch).unwrap();
            let mut batches = 0;
            for batch in raw.epoch(epoch).unwrap() {
                let lent = slots.lend(batch.unwrap()).unwrap();
                let expected = want.next().unwrap().unwrap();
                assert_eq!(lent.indices(), expected.indices());
                assert!(
                    same_rows(&lent_columns(&lent, &consumer), &expected),
                    "epoch {epoch} batch {batches}: the device's augmentation differs from \
                     the workers'"
                );
                batches += 1;
            }
            assert!(want.next().is_none());
            assert_eq!(batches, raw.batches());
        }
        slots.drain().unwrap();
    }
    // An augmenter bound to other columns (a label of two values) is refused: its
    // sizes would not match the slots'.
    let mut other = ds.columns().to_vec();
    other[1].shape = vec![2];
    other[1].row_bytes = 16;
    let wrong = Augment::new("x", 0).bind(&other).unwrap();
    let raw = pinned_loader(&c, &ds, 32).build().unwrap();
    match DeviceSlots::augmented(&c, raw.layout(), 2, &wrong) {
        Err(e) => assert!(e.to_string().contains("other columns"), "{e}"),
        Ok(_) => panic!("slots for an augmenter of other columns"),
    }
}

/// Device slots with a device cache (`DeviceSlots::enable_device_cache`): the batches
/// lent while it fills are scattered into it, and those of later epochs, from batches of
/// indices only (`Loader::epoch_indices`), are gathered there, as they are, or augmented
/// on the device: every column of every batch equals a loader reading the files (and
/// augmenting in its workers), over four epochs, one resumed in its middle, with a batch
/// of one epoch held while the next is lent, and every batch of the filling epoch
/// overwritten by its consumer at once (the cache keeps the rows the loader gave).
pub fn lent_batches_come_from_the_device_cache_as_the_loader_gives_them(c: Cuda) {
    use cudarc::driver::result;
    use stokehold::cuda::DeviceSlots;
    use stokehold::{Augment, Shard};

    let dir = tempfile::tempdir().unwrap();
    let ds = noise_images(dir.path(), 150);
    let larger = tempfile::tempdir().unwrap();
    let other = noise_images(larger.path(), 300);
    let consumer = c.ctx.new_stream().unwrap();
    let build = |b: stokehold::LoaderBuilder| {
        b.batch_size(32)
            .shuffle(Shuffle::Full { seed: 3 })
            .build()
            .unwrap()
    };
    for augment in [None, Some(Augment::new("x", 3).crop(4).flip(true))] {
        let reference = Loader::builder_shared(Arc::clone(&ds));
        let mut host = build(match &augment {
            Some(a) => reference.augment(a.clone()),
            None => reference,
        });
        let mut raw = build(pinned_loader(&c, &ds, 32));
        let mut slots = match &augment {
            Some(a) => {
                let augmenter = a.bind(ds.columns()).unwrap();
                DeviceSlots::augmented(&c, raw.layout(), 3, &augmenter).unwrap()
            }
            None => DeviceSlots::new(&c.ctx, raw.layout(), 3).unwrap(),
        };
        // A batch of indices only needs a filled cache: refused, and the slots go on.
        let early = raw.epoch_indices(0).unwrap().next().unwrap().unwrap();
        let err = slots.lend(early).unwrap_err();
        assert!(
            err.to_string().contains("cache filled, and it is not"),
            "{err}"
        );
        let bytes = slots.enable_device_cache(&c, &raw, 0.5).unwrap();
        assert_eq!(bytes, Some(150 * (3 * 20 * 18 + 8)));
        let flag = slots.cache_filled_flag();
        // A batch of another loader, whose samples reach past the cached rows: refused
        // before the kernels would write outside the cache.
        let mut wider = build(pinned_loader(&c, &other, 32).shuffle(Shuffle::None));
        let last = wider.epoch(0).unwrap().nth(8).unwrap().unwrap();
        let err = slots.lend(last).unwrap_err();
        assert!(err.to_string().contains("another loader"), "{err}");
        let mut held = None;
        for epoch in 0..4u64 {
            let mut want = host.epoch(epoch).unwrap();
            let from = match epoch {
                // Epoch 3 resumes after its first two batches.
                3 => {
                    let state = {
                        let mut it = raw.epoch_indices(3).unwrap();
                        it.next().unwrap().unwrap();
                        it.next().unwrap().unwrap();
                        it.state()
                    };
                    raw.resume(state).unwrap();
                    want.next().unwrap().unwrap();
                    want.next().unwrap().unwrap();
                    2
                }
                _ => 0,
            };
            let filled = slots.cache_filled();
            assert_eq!(filled, epoch > 0, "epoch {epoch}");
            // The shared flag, read without the slots, says the same.
            assert_eq!(flag.load(std::sync::atomic::Ordering::Acquire), filled);
            let count = raw.batches();
            let batches = match filled {
                true => raw.epoch_indices(epoch).unwrap(),
                false => raw.epoch(epoch).unwrap(),
            };
            let mut n = from;
            for batch in batches {
                let batch = batch.unwrap();
                assert_eq!(batch.is_indices_only(), filled);
                let lent = slots.lend(batch).unwrap();
                let expected = want.next().unwrap().unwrap();
                assert_eq!((lent.number(), lent.indices()), (n, expected.indices()));
                if filled {
                    assert!(
                        same_rows(&lent_columns(&lent, &consumer), &expected),
                        "epoch {epoch} batch {n} (augmented: {}): the slot differs from the \
                         loader's batch",
                        augment.is_some()
                    );
                } else {
                    // The consumer writes to the batch in place (its arrays are
                    // writeable) as soon as its copy is done: the rows scattered into the
                    // cache must not see it (the later epochs, from the cache, show it).
                    let cu = consumer.cu_stream();
                    // SAFETY: the stream outlives the batch (a default stream, or one this
                    // check keeps until after the batch is dropped).
                    unsafe { lent.wait_on(cu as usize) }.unwrap();
                    for k in 0..lent.layout().columns().len() {
                        let len = lent.len() * lent.layout().columns()[k].row_bytes;
                        // SAFETY: column k of the slot holds `len` bytes, lent to this
                        // consumer, whose stream waited for the copy.
                        unsafe { result::memset_d8_async(lent.column_ptr(k), 0xa5, len, cu) }
                            .unwrap();
                    }
                }
                // The cache fills with the first epoch's last batch.
                let last = n + 1 == count;
                assert_eq!(
                    slots.cache_filled(),
                    filled || last,
                    "epoch {epoch} batch {n}"
                );
                if epoch == 1 && n == 1 {
                    held = Some((lent, expected));
                }
                n += 1;
            }
            assert!(want.next().is_none());
            assert_eq!(n, count);
            slots.drain().unwrap();
            if let (2, Some((lent, expected))) = (epoch, held.take()) {
                // Epoch 1's batch, held while epoch 2's were gathered: as it was.
                assert!(same_rows(&lent_columns(&lent, &consumer), &expected));
            }
        }
        // Enabled again, the cache starts empty.
        assert!(flag.load(std::sync::atomic::Ordering::Acquire));
        assert!(slots.enable_device_cache(&c, &raw, 0.5).unwrap().is_some());
        assert!(!slots.cache_filled());
        assert!(!flag.load(std::sync::atomic::Ordering::Acquire));
        // Where one epoch does not cover every row, or the loader augments, there is none.
        let sharded = pinned_loader(&c, &ds, 32)
            .shard(Shard::new(1, 2).unwrap())
            .build()
            .unwrap();
        assert_eq!(slots.enable_device_cache(&c, &sharded, 0.5).unwrap(), None);
        let dropping = build(pinned_loader(&c, &ds, 32).drop_last(true));
        assert_eq!(slots.enable_device_cache(&c, &dropping, 0.5).unwrap(), None);
        let crop = Augment::new("x", 3).crop(2);
        let augmenting = build(pinned_loader(&c, &ds, 32).augment(crop));
        assert_eq!(
            slots.enable_device_cache(&c, &augmenting, 0.5).unwrap(),
            None
        );
        assert!(slots.cache_bytes().is_none());
    }
}

/// A panic out of a user's work while a cached epoch is captured as a CUDA graph ends
/// the capture before it goes on to the caller: the compute stream is not left
/// capturing, and the same epoch, fed again, captures, replays and serves every batch.
pub fn a_panic_while_an_epoch_is_captured_leaves_the_stream_usable(c: Cuda) {
    use stokehold::cuda::Feeder;

    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(DIGITS).unwrap());
    let mut loader = pinned_loader(&c, &ds, 64)
        .shuffle(Shuffle::Full { seed: 4 })
        .build()
        .unwrap();
    let n = loader.order().batches() as usize;
    let mut feeder = Feeder::new(&c, loader.layout(), 3).unwrap();
    assert!(feeder.enable_device_cache(&loader, 0.5).unwrap().is_some());
    feeder.replay_cached_epochs(true);
    let mut calls = 0usize;
    let mut feed = |feeder: &mut Feeder, loader: &mut Loader, e: u64, panic_at: usize| {
        feeder.feed(
            loader,
            e,
            &mut |_| {
                calls += 1;
                assert!(calls != panic_at, "the work panicked at call {calls}");
                Ok(())
            },
            &mut |_, _| {},
        )
    };
    // The epoch that fills the cache captures a cached epoch's work after its last
    // batch: its work's call n + 1 is the capture's first.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        feed(&mut feeder, &mut loader, 0, n + 1)
    }));
    assert!(panicked.is_err(), "the work did not panic");
    assert!(feeder.cache_filled());
    for e in [1, 2] {
        let fed = feed(&mut feeder, &mut loader, e, usize::MAX).unwrap();
        assert!(fed.cached, "epoch {e}");
        assert_eq!((fed.batches as usize, fed.samples), (n, 1797), "epoch {e}");
    }
    // Epoch 1 captured anew (its work called once a batch), epoch 2 replayed the graph.
    assert_eq!(calls, n + 1 + n);

    // A work that fails in the capture after the filling epoch: the error says that the
    // epoch ran whole (its state is past it), and only its capture failed.
    let mut feeder = Feeder::new(&c, loader.layout(), 3).unwrap();
    assert!(feeder.enable_device_cache(&loader, 0.5).unwrap().is_some());
    feeder.replay_cached_epochs(true);
    let mut calls = 0usize;
    let err = feeder
        .feed(
            &mut loader,
            3,
            &mut |_| {
                calls += 1;
                match calls > n {
                    true => Err(stokehold::Error::Config("not capturable".into())),
                    false => Ok(()),
                }
            },
            &mut |_, _| {},
        )
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("epoch 3 ran whole") && text.contains("not capturable"),
        "{text}"
    );
    assert_eq!(loader.state().epoch, 4);
}

/// The step's stall for copies is the compute stream's idle time while they ran: behind
/// a slow step (3 ms a batch), each copy runs while the batches before it are worked on,
/// and only the first batch's keeps the step waiting.
pub fn copies_overlapped_with_a_slow_step_are_no_stall(c: Cuda) {
    use cudarc::driver::result;
    use stokehold::cuda::Feeder;

    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(DIGITS).unwrap());
    let mut loader = pinned_loader(&c, &ds, 64).build().unwrap();
    let mut feeder = Feeder::new(&c, loader.layout(), 3).unwrap();
    let mut slow_step = |db: &stokehold::cuda::DeviceBatch| {
        // SAFETY: the host function takes no argument.
        unsafe {
            result::stream::launch_host_function(
                db.stream().cu_stream(),
                slow,
                std::ptr::null_mut(),
            )
        }?;
        Ok(())
    };
    let fed = feeder
        .run_epoch(loader.epoch(0).unwrap(), &mut slow_step, &mut |_, _| {})
        .unwrap();
    assert!(fed.copy > std::time::Duration::ZERO, "{fed:?}");
    // The first batch's copy and a little slack for the clocks' rounding.
    let first = fed.copy / fed.batches as u32 * 4;
    assert!(fed.stall_copy <= first, "{fed:?}");
    assert!(
        fed.compute >= std::time::Duration::from_millis(3 * fed.batches),
        "{fed:?}"
    );
    // With no step at all, how much of the stream's idle time the copies cause depends
    // on how fast the host enqueues (on the emulator, often slower than the copies): it
    // is no more than the copies took, with a little slack for the clocks' rounding.
    let idle = feeder
        .run_epoch(loader.epoch(1).unwrap(), &mut |_| Ok(()), &mut |_, _| {})
        .unwrap();
    let slack = std::time::Duration::from_micros(5) * idle.batches as u32;
    assert!(idle.stall_copy <= idle.copy + slack, "{idle:?}");
}
