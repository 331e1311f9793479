//! Data-parallel training: each rank (process, usually one per GPU) loads its own part of
//! every epoch.
//!
//! ```text
//! cargo run --example 03_sharded                          # simulates 4 ranks
//! RANK=1 WORLD_SIZE=4 cargo run --example 03_sharded      # as torchrun would launch it
//! ```
//!
//! All ranks compute the same shuffled order of the epoch (from the shared seed) and rank
//! `r` of `n` takes positions `r, r + n, r + 2n, ...` of it. No communication is needed.
//! When the dataset does not divide evenly, the tail rule decides:
//! - `ShardTail::Pad` (the default): every rank gets `ceil(len / n)` samples, the few
//!   missing ones repeat the start of the order (as PyTorch's `DistributedSampler`);
//! - `ShardTail::Drop`: every rank gets `floor(len / n)`, the tail is left out.
//!
//! Either way every rank runs the same number of steps, so collective ops never hang.

use std::collections::HashSet;

use stokehold::{Dataset, Loader, NpyDataset, Shard, ShardTail, Shuffle};

const DIGITS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");

/// The dataset indices rank `shard` sees in `epoch`, in order, through a real loader.
fn rank_samples(shard: Shard, epoch: u64) -> stokehold::Result<Vec<u64>> {
    let mut loader = Loader::builder(NpyDataset::open(DIGITS)?)
        .batch_size(64)
        .shuffle(Shuffle::Full { seed: 11 }) // the same seed on every rank
        .shard(shard)
        .workers(1)
        .build()?;
    let mut samples = Vec::new();
    for batch in loader.epoch(epoch)? {
        samples.extend_from_slice(batch?.indices());
    }
    Ok(samples)
}

fn main() -> stokehold::Result<()> {
    let n = NpyDataset::open(DIGITS)?.len();

    // torchrun (RANK/WORLD_SIZE), Slurm (SLURM_PROCID/SLURM_NTASKS) or Open MPI
    // (OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE); with none set, rank 0 of 1.
    let from_env = Shard::from_env()?;
    // (`from_env` cannot tell "no launcher" from a launcher's world of 1; both mean
    // this process is alone, and then we simulate a world of 4 instead.)
    let shards: Vec<Shard> = if from_env.world_size() > 1 {
        println!(
            "launched as rank {} of {}",
            from_env.rank(),
            from_env.world_size()
        );
        vec![from_env]
    } else {
        println!("no launcher variables: simulating 4 ranks in this process");
        (0..4)
            .map(|r| Shard::new(r, 4))
            .collect::<stokehold::Result<_>>()?
    };
    let world = shards[0].world_size();
    println!("dataset: {n} samples, world size {world}\n");

    for tail in [ShardTail::Pad, ShardTail::Drop] {
        println!("{tail:?}:");
        for &shard in &shards {
            let samples = rank_samples(shard.with_tail(tail), 0)?;
            println!(
                "  rank {}: {} samples per epoch, first {:?}",
                shard.rank(),
                samples.len(),
                &samples[..5]
            );
        }
    }

    println!();
    // The check needs every rank's samples. Since the order is a pure function of
    // (seed, epoch, rank, world size), one process can compute them all.
    for epoch in 0..2 {
        let mut all = HashSet::new();
        let mut total = 0;
        for rank in 0..world {
            let shard = Shard::new(rank, world)?.with_tail(ShardTail::Drop);
            let samples = rank_samples(shard, epoch)?;
            assert_eq!(samples.len() as u64, n / world, "rank {rank}: equal shares");
            total += samples.len();
            all.extend(samples);
        }
        assert_eq!(all.len(), total, "epoch {epoch}: two ranks share a sample");
        assert_eq!(all.len() as u64, world * (n / world));
        println!(
            "Drop, epoch {epoch}: the {world} ranks' samples are disjoint and cover {} = {world} x floor({n} / {world}) samples ({} left out)",
            all.len(),
            n - all.len() as u64
        );
    }

    // With Pad the shards overlap by the padding, and together cover every sample.
    let mut all = HashSet::new();
    let mut total = 0;
    for rank in 0..world {
        let samples = rank_samples(Shard::new(rank, world)?, 0)?;
        total += samples.len();
        all.extend(samples);
    }
    assert_eq!(all.len() as u64, n);
    println!(
        "Pad,  epoch 0: the {world} ranks see all {n} samples, {} of them twice (padding)",
        total - all.len()
    );
    Ok(())
}
