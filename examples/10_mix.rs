//! A pretraining mixture: several token corpora read at set proportions.
//!
//! ```text
//! cargo run --example 10_mix
//! ```
//!
//! Language models are pretrained on a mixture (web text, code, math...) whose shares
//! are chosen, not those of the corpora's sizes. [`Mix`] joins datasets with the same
//! columns by weight: each epoch takes each corpus's share, a small corpus repeated, a
//! large one in part (the rest in the next epochs), and says where each sample came
//! from, so a loop can log each corpus's loss.

use std::sync::Arc;

use stokehold::{DType, Dataset, Loader, Mix, Shuffle, TokenDataset, Windows};

fn main() -> stokehold::Result<()> {
    // Three toy corpora in a temporary directory (deleted at the end): corpus k's token
    // ids are 10,000 k and up, so a window tells which corpus it came from.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let seq_len = 16;
    let corpora = [("web", 40_000u16), ("code", 8_000), ("math", 1_000)];
    let mut parts: Vec<Arc<dyn Dataset>> = Vec::new();
    for (k, (name, tokens)) in corpora.iter().enumerate() {
        let path = dir.path().join(format!("{name}.bin"));
        let ids: Vec<u8> = (0..*tokens)
            .flat_map(|i| (10_000 * k as u16 + i % 10_000).to_le_bytes())
            .collect();
        std::fs::write(&path, ids).expect("writing a corpus");
        // Random windows from another seed for each corpus.
        let windows = Windows::Random { seed: 1 }.for_part(k);
        let ds = TokenDataset::open_bin(&path, DType::U16, seq_len, windows)?;
        println!("{name:>5}: {:>5} windows", ds.len());
        parts.push(Arc::new(ds));
    }

    // 60% web, 30% code, 10% math, over epochs of 2,000 windows: web is downsampled
    // (2,499 windows, 1,200 an epoch), code and math upsampled.
    let mix = Arc::new(Mix::new(parts, &[0.6, 0.3, 0.1], Some(2_000), 7)?);
    println!("takes an epoch: {:?}", mix.takes());

    // A full shuffle spreads each corpus over the whole epoch.
    let mut loader = Loader::builder(Arc::clone(&mix))
        .batch_size(64)
        .shuffle(Shuffle::Full { seed: 7 })
        .workers(2)
        .build()?;
    for epoch in 0..2 {
        let mut per_corpus = [0u64; 3];
        let mut first_batch = [0u64; 3];
        for batch in loader.epoch(epoch)? {
            let batch = batch?;
            let ids: &[u16] = batch.column(0)?;
            for (w, &i) in ids.chunks_exact(seq_len + 1).zip(batch.indices()) {
                let (corpus, _sample) = mix.source(epoch, i).expect("a position of the epoch");
                // The window's own ids say the same.
                assert_eq!(usize::from(w[0] / 10_000), corpus);
                per_corpus[corpus] += 1;
                if batch.number() == 0 {
                    first_batch[corpus] += 1;
                }
            }
        }
        println!("epoch {epoch}: windows per corpus {per_corpus:?}, first batch {first_batch:?}");
    }

    // Web's 2,499 windows run on across epochs: the first two epochs' 2,400 draws are
    // 2,400 different windows, and the third epoch's first 99 the last of them.
    let web: std::collections::HashSet<u64> = (0..2)
        .flat_map(|e| (0..1_200).map(move |i| (e, i)))
        .map(|(e, i)| mix.source(e, i).expect("a web position").1)
        .collect();
    println!(
        "web windows drawn in epochs 0 and 1: {} different",
        web.len()
    );
    assert_eq!(web.len(), 2_400);
    Ok(())
}
