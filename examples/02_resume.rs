//! Resuming mid-epoch: a job killed halfway through an epoch restarts with exactly the
//! batches it had not yet seen, in the same order.
//!
//! ```text
//! cargo run --example 02_resume
//! ```
//!
//! The order of every epoch is a pure function of `(seed, epoch, rank, world_size)`, so
//! a checkpoint only needs the loader's position: a [`LoaderState`], a few integers that
//! serialise to JSON next to the model weights. Step 5 resumes the same checkpoint
//! elastically, as a job restarted on three GPUs instead of one would.

use stokehold::{HostBatch, Loader, LoaderBuilder, LoaderState, NpyDataset, Shuffle};

const EPOCHS: u64 = 3;

/// Every loader in this example is built the same way: a resumed loader must use the
/// same dataset, batch size, shuffle and shard as the one that saved the state (the
/// worker count and prefetch depth may differ; they never change the order).
fn builder(workers: usize) -> stokehold::Result<LoaderBuilder> {
    let ds = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
    Ok(Loader::builder(ds)
        .batch_size(100)
        .shuffle(Shuffle::Full { seed: 2024 })
        .workers(workers))
}

/// What we compare: where a batch sits, which samples it holds, and their bytes.
#[derive(Debug, PartialEq)]
struct Seen {
    epoch: u64,
    number: u64,
    indices: Vec<u64>,
    pixels: Vec<u8>,
    labels: Vec<i64>,
}

fn seen(batch: &HostBatch) -> stokehold::Result<Seen> {
    Ok(Seen {
        epoch: batch.epoch(),
        number: batch.number(),
        indices: batch.indices().to_vec(),
        pixels: batch.column::<u8>(0)?.to_vec(),
        labels: batch.column::<i64>(1)?.to_vec(),
    })
}

fn main() -> stokehold::Result<()> {
    // 1. The reference: an uninterrupted run of three epochs.
    let mut reference = Vec::new();
    let mut loader = builder(2)?.build()?;
    for e in 0..EPOCHS {
        for batch in loader.epoch(e)? {
            reference.push(seen(&batch?)?);
        }
    }
    drop(loader);
    println!(
        "uninterrupted run: {} batches over {EPOCHS} epochs",
        reference.len()
    );

    // 2. The interrupted run: all of epoch 0, then 7 batches of epoch 1, then a crash.
    let mut before_crash = Vec::new();
    let checkpoint: String = {
        let mut loader = builder(2)?.build()?;
        for batch in loader.epoch(0)? {
            before_crash.push(seen(&batch?)?);
        }
        let mut it = loader.epoch(1)?;
        for batch in it.by_ref().take(7) {
            before_crash.push(seen(&batch?)?);
        }
        // `it.state()` is where a resumed loader should start: epoch 1, after 7 batches.
        // (`loader.state()` says the same once `it` is dropped.)
        let state = it.state();
        serde_json::to_string(&state).expect("a LoaderState serialises")
        // The loader and its worker threads are dropped here, as a crash would lose them.
    };
    println!(
        "crashed after {} batches, checkpoint: {checkpoint}",
        before_crash.len()
    );

    // 3. Restart: read the checkpoint, build a new loader (with a different worker count,
    //    to show it does not matter) and carry on from the saved epoch.
    let state: LoaderState = serde_json::from_str(&checkpoint).expect("a valid checkpoint");
    let mut loader = builder(3)?.resume(state).build()?;
    let mut after_restart = Vec::new();
    for e in state.epoch..EPOCHS {
        // The first call, with `state.epoch`, skips the batches already delivered; later
        // epochs are whole.
        let it = loader.epoch(e)?;
        println!("epoch {e}: {} batches left", it.len());
        for batch in it {
            after_restart.push(seen(&batch?)?);
        }
    }

    // 4. Before the crash + after the restart = the uninterrupted run, batch for batch.
    assert_eq!(before_crash[..], reference[..before_crash.len()]);
    assert_eq!(after_restart[..], reference[before_crash.len()..]);
    println!(
        "resumed run matches the uninterrupted one: {} + {} = {} batches, same samples, same bytes",
        before_crash.len(),
        after_restart.len(),
        reference.len()
    );

    // 5. Elastic: the job restarts as 3 ranks with batches of 64. Each rank resumes the
    //    same checkpoint; together they take the rest of epoch 1.
    let mut rest: Vec<u64> = Vec::new();
    for rank in 0..3 {
        let mut loader = builder(2)?
            .batch_size(64)
            .shard(stokehold::Shard::new(rank, 3)?)
            .resume_elastic(state)
            .build()?;
        for batch in loader.epoch(state.epoch)? {
            rest.extend_from_slice(batch?.indices());
        }
    }
    let mut left: Vec<u64> = reference
        .iter()
        .filter(|s| s.epoch == 1 && s.number >= state.batch)
        .flat_map(|s| s.indices.iter().copied())
        .collect();
    left.sort_unstable();
    rest.sort_unstable();
    let taken = rest.len();
    rest.dedup();
    assert_eq!(rest, left);
    println!(
        "elastic restart on 3 ranks of 64: the {} samples left of epoch 1, each taken \
         ({} repeated to even out the ranks' shares, as a sharded epoch pads)",
        rest.len(),
        taken - rest.len()
    );
    Ok(())
}
