//! GPT-style language-model batches from a flat token stream.
//!
//! ```text
//! cargo run --example 04_tokens
//! ```
//!
//! Tokenised corpora are often one long file of `uint16` token ids (`train.bin`, as in
//! nanoGPT). [`TokenDataset`] maps such a file and serves windows of `seq_len + 1`
//! tokens: `w[..seq_len]` is the model's input and `w[1..]` its next-token target.

use std::sync::Arc;

use stokehold::{DType, Dataset, Loader, Shuffle, TokenDataset, Windows};

fn main() -> stokehold::Result<()> {
    // A toy corpus in a temporary directory (deleted when `dir` is dropped, at the end).
    // Token `i` has id `i`, so each window's first id is also its offset in the stream.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("train.bin");
    let tokens: Vec<u8> = (0..60_000u16).flat_map(u16::to_le_bytes).collect();
    std::fs::write(&path, tokens).expect("writing the token file");

    let seq_len = 8;

    // Random windows: every epoch draws a fresh start offset for each window from
    // (seed, epoch, window), as GPT pretraining loops do. An epoch has as many windows as
    // cutting the stream end to end would give: (tokens - 1) / seq_len.
    let ds = Arc::new(TokenDataset::open_bin(
        &path,
        DType::U16,
        seq_len,
        Windows::Random { seed: 1 },
    )?);
    println!(
        "{} tokens, seq_len {seq_len}: {} windows of {} tokens per epoch",
        ds.tokens(),
        ds.len(),
        seq_len + 1
    );

    // The windows are already random, so the loader need not shuffle them. An `Arc` of a
    // dataset is a dataset too: we keep `ds` to ask it where windows start.
    let mut loader = Loader::builder(Arc::clone(&ds))
        .batch_size(32)
        .shuffle(Shuffle::None)
        .workers(2)
        .build()?;

    for epoch in 0..2 {
        println!("\nepoch {epoch}:");
        for batch in loader.epoch(epoch)?.take(2) {
            let batch = batch?;
            // One column, "tokens": batch.len() windows of seq_len + 1 ids each.
            let ids: &[u16] = batch.column(0)?;
            for (k, w) in ids.chunks_exact(seq_len + 1).take(2).enumerate() {
                let (input, target) = (&w[..seq_len], &w[1..]);
                let window = batch.indices()[k];
                println!(
                    "  batch {}, window {window} (starts at token {})",
                    batch.number(),
                    ds.window_start(epoch, window)
                );
                println!("    input  {input:?}");
                println!("    target {target:?}");
                assert_eq!(input[0] as u64, ds.window_start(epoch, window));
            }
        }
        // Leaving the loop early is fine: dropping the epoch's iterator stops the workers
        // and returns every buffer.
    }

    // The same file cut end to end: window i starts at token i * seq_len.
    let consecutive = TokenDataset::open_bin(&path, DType::U16, seq_len, Windows::Consecutive)?;
    let starts: Vec<u64> = (0..4).map(|i| consecutive.window_start(0, i)).collect();
    println!("\nWindows::Consecutive starts: {starts:?} ...");
    Ok(())
}
