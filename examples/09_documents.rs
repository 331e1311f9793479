//! Variable-length documents (fine-tuning sets, conversations), read in place from a
//! Megatron indexed dataset and batched by length.
//!
//! ```text
//! cargo run --release --example 09_documents
//! ```
//!
//! Megatron-LM's `tools/preprocess_data.py` writes a tokenised corpus as `prefix.bin`
//! (every document's tokens, back to back) and `prefix.idx` (each document's length and
//! place). [`Documents`] maps both and serves each document as a row of `max_len`
//! tokens padded with `pad`, plus its length in column `"len"`. A model cuts each batch
//! to its longest row; with a full shuffle a batch's rows have any length, so much of
//! what is left is still padding. [`Shuffle::Grouped`] sorts runs of the shuffled order
//! by length, so that each batch holds documents of similar lengths. For pretraining,
//! [`Packed`] serves the same files with no padding at all: the documents back to back,
//! cut into windows, with each token's position in its document.

use std::path::Path;

use stokehold::{Dataset, Documents, Loader, Packed, Shuffle, Windows};

/// Writes `lengths.len()` documents as Megatron-Core's `IndexedDatasetBuilder` does:
/// `uint16` tokens in `prefix.bin`; in `prefix.idx` a header, then the `int32` lengths,
/// the `int64` byte offsets and the `int64` document indices.
fn write_megatron(prefix: &Path, lengths: &[u32]) -> std::io::Result<()> {
    let (mut bin, mut offsets) = (Vec::new(), Vec::new());
    for (d, &n) in lengths.iter().enumerate() {
        offsets.push(bin.len() as i64);
        bin.extend((0..n).flat_map(|t| ((d as u32 * 7 + t) as u16).to_le_bytes()));
    }
    let n = lengths.len() as u64;
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes()); // version
    idx.push(8); // dtype code 8: uint16
    idx.extend(n.to_le_bytes());
    idx.extend((n + 1).to_le_bytes());
    idx.extend(lengths.iter().flat_map(|&l| (l as i32).to_le_bytes()));
    idx.extend(offsets.iter().flat_map(|o| o.to_le_bytes()));
    idx.extend((0..=n as i64).flat_map(i64::to_le_bytes));
    std::fs::write(prefix.with_extension("bin"), bin)?;
    std::fs::write(prefix.with_extension("idx"), idx)
}

/// One epoch: the tokens a model sees once each batch is cut to its longest row, and
/// how many of them are padding.
fn epoch(loader: &mut Loader, epoch: u64) -> stokehold::Result<(u64, u64)> {
    let (mut seen, mut padding) = (0u64, 0u64);
    for batch in loader.epoch(epoch)? {
        let batch = batch?;
        let lens = batch.column_named::<i64>("len")?;
        let width = lens.iter().copied().max().unwrap_or(0) as u64;
        seen += width * lens.len() as u64;
        padding += lens.iter().map(|&l| width - l as u64).sum::<u64>();
    }
    Ok((seen, padding))
}

fn main() -> stokehold::Result<()> {
    // 20,000 documents of 16 to about 4,000 tokens, most of them short (a long tail, as
    // in instruction sets).
    let lengths: Vec<u32> = (0..20_000u64)
        .map(|i| {
            let u = (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as f64 / (1u64 << 24) as f64;
            (16.0 / (1.0 - u * 0.996)) as u32
        })
        .collect();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let prefix = dir.path().join("sft_text_document");
    write_megatron(&prefix, &lengths).expect("writing the dataset");

    let (max_len, batch_size) = (2048, 32);
    let docs = Documents::open_megatron(&prefix, max_len, 0)?;
    println!(
        "{} documents, {} tokens, the longest {}; {} longer than max_len {max_len} are cut",
        docs.len(),
        docs.tokens(),
        docs.longest(),
        docs.truncated()
    );

    // 1. A full shuffle, then 2. grouped by length (by default 64 batches sorted together).
    for (name, shuffle) in [
        ("full shuffle", Shuffle::Full { seed: 0 }),
        ("grouped", Shuffle::named("grouped", 0)?),
    ] {
        let mut loader = Loader::builder(Documents::open_megatron(&prefix, max_len, 0)?)
            .batch_size(batch_size)
            .shuffle(shuffle)
            .build()?;
        let (seen, padding) = epoch(&mut loader, 0)?;
        println!(
            "{name:>12}: {seen:>10} tokens in batches cut to their longest row, {:.1}% padding",
            100.0 * padding as f64 / seen as f64
        );
    }

    // 3. Packed: the documents back to back in windows of max_len inputs (and one more
    //    token, the last target); no padding, and long documents are split, not cut.
    //    Column "positions" restarts at 0 where a document starts.
    let packed = Packed::open_megatron(&prefix, max_len, Windows::Consecutive)?;
    let (corpus, documents) = (packed.tokens(), packed.documents());
    let mut loader = Loader::builder(packed)
        .batch_size(batch_size)
        .shuffle(Shuffle::Full { seed: 0 })
        .build()?;
    let (mut seen, mut starts) = (0u64, 0u64);
    for batch in loader.epoch(0)? {
        let positions = batch?.column_named::<i32>("positions")?.to_vec();
        for window in positions.chunks_exact(max_len + 1) {
            seen += max_len as u64;
            starts += window[..max_len].iter().filter(|&&p| p == 0).count() as u64;
        }
    }
    println!(
        "{:>12}: {seen:>10} tokens in windows of {max_len}, no padding; {starts} of the \
         {documents} documents' starts marked ({} tokens left at the end)",
        "packed",
        corpus - seen
    );

    // 4. A batch, cut to its longest row: what goes to the model.
    let mut loader = Loader::builder(docs)
        .batch_size(4)
        .shuffle(Shuffle::Grouped { seed: 0, group: 40 })
        .build()?;
    let batch = loader.epoch(0)?.nth(3).expect("a fourth batch")?;
    let (tokens, lens) = (batch.column::<u16>(0)?, batch.column_named::<i64>("len")?);
    let width = *lens.iter().max().expect("rows") as usize;
    println!(
        "\nbatch 3: documents {:?} of lengths {lens:?}, cut to ({}, {width}) of ({}, {max_len}):",
        batch.indices(),
        lens.len(),
        lens.len()
    );
    for (row, &len) in tokens.chunks_exact(max_len).zip(lens) {
        let row = &row[..width];
        println!("  {:?} ... {:?}", &row[..3], &row[len as usize - 1..]);
    }
    Ok(())
}
