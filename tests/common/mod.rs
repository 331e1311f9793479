//! Shared test datasets.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use stokehold::{Column, DType, Dataset, HostAlloc, HostMemory, PlainAlloc};

/// `n` samples; column 0 holds the index as `u64`, column 1 holds `3 * index` as `u32`.
/// `fail_at` makes gather fail on that index, `panic_at` panics on it.
pub struct Synth {
    pub n: u64,
    pub fail_at: Option<u64>,
    pub panic_at: Option<u64>,
    columns: Vec<Column>,
}

impl Synth {
    pub fn new(n: u64) -> Synth {
        Synth {
            n,
            fail_at: None,
            panic_at: None,
            columns: vec![
                Column {
                    name: "id".into(),
                    dtype: DType::U64,
                    shape: vec![],
                    row_bytes: 8,
                },
                Column {
                    name: "triple".into(),
                    dtype: DType::U32,
                    shape: vec![],
                    row_bytes: 4,
                },
            ],
        }
    }
}

impl Dataset for Synth {
    fn len(&self) -> u64 {
        self.n
    }
    fn columns(&self) -> &[Column] {
        &self.columns
    }
    fn gather(&self, _epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> stokehold::Result<()> {
        let (a, b) = out.split_at_mut(1);
        for (k, &i) in indices.iter().enumerate() {
            if Some(i) == self.fail_at {
                return Err(stokehold::Error::OutOfRange { index: i, len: 0 });
            }
            if Some(i) == self.panic_at {
                panic!("synthetic panic at sample {i}");
            }
            a[0][k * 8..k * 8 + 8].copy_from_slice(&i.to_le_bytes());
            b[0][k * 4..k * 4 + 4].copy_from_slice(&((3 * i) as u32).to_le_bytes());
        }
        Ok(())
    }
}

/// Counts allocations made through it (clones share the counts).
#[derive(Default, Clone)]
pub struct CountingAlloc {
    pub counts: Arc<Counts>,
}

#[derive(Default)]
pub struct Counts {
    pub calls: AtomicUsize,
    pub bytes: AtomicUsize,
}

impl HostAlloc for CountingAlloc {
    fn name(&self) -> &'static str {
        "counting"
    }
    fn alloc(&self, bytes: usize) -> stokehold::Result<Box<dyn HostMemory>> {
        self.counts.calls.fetch_add(1, Ordering::SeqCst);
        self.counts.bytes.fetch_add(bytes, Ordering::SeqCst);
        PlainAlloc.alloc(bytes)
    }
}

/// The digits set shipped with the crate.
pub const DIGITS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");

/// Writes a 300-sample set to `dir` (`x.npy`: 300 x 4 u8, `y.npy`: i64 labels `i % 10`)
/// whose sample 123 has the label 42, outside 10 classes.
pub fn write_bad_label_set(dir: &std::path::Path) {
    use stokehold::gen::NpyWriter;
    let mut x = NpyWriter::create(dir.join("x.npy"), DType::U8, &[300, 4]).unwrap();
    x.data_mut()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8);
    x.finish().unwrap();
    let mut y = NpyWriter::create(dir.join("y.npy"), DType::I64, &[300]).unwrap();
    for (i, out) in y.data_mut().chunks_exact_mut(8).enumerate() {
        let label: i64 = if i == 123 { 42 } else { (i % 10) as i64 };
        out.copy_from_slice(&label.to_le_bytes());
    }
    y.finish().unwrap();
}

/// Whether a GPU check may skip: not with `STOKEHOLD_REQUIRE_GPU=1`, which the GPU run
/// scripts (`.ci/gpu/`) set so that a run on a GPU machine cannot pass by skipping.
pub fn gpu_required() -> bool {
    std::env::var("STOKEHOLD_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// Prints why a GPU check skips, or fails it when a GPU is required.
///
/// # Panics
/// When [`gpu_required`].
pub fn skip_gpu(reason: &str) {
    assert!(
        !gpu_required(),
        "STOKEHOLD_REQUIRE_GPU=1, but this GPU check would skip: {reason}"
    );
    println!("skipping GPU test: {reason}");
}

/// Where `cargo test` builds example `name`: beside this test binary's directory.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("target/<profile>/deps");
    deps.parent()
        .expect("target/<profile>")
        .join("examples")
        .join(name)
}

/// Runs example `name` (built with `--features features`) and returns the accuracy its
/// last line ends with (`epoch 9: loss 0.38 accuracy 0.925`).
///
/// # Panics
/// If the example is not built, fails, or prints no accuracy.
pub fn example_accuracy(name: &str, features: &str) -> f64 {
    let example = example(name);
    // With `--test X` alone cargo does not build examples: `.ci/run` builds them first.
    let out = std::process::Command::new(&example)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}; build it with `cargo build --features {features} --example {name}`",
                example.display()
            )
        });
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .last()
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {text}"))
}

/// The first batch of `batch` windows of 8 + 1 tokens, in file order, of the llm.c
/// fixture (token `i` of the file is `i`). The loader is gone; the batch holds its
/// buffer.
pub fn llmc_tokens(batch: usize) -> stokehold::HostBatch {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/npy/llmc_gpt2.bin"
    );
    let ds =
        stokehold::TokenDataset::open_bin(path, DType::U16, 8, stokehold::Windows::Consecutive)
            .unwrap();
    let mut loader = stokehold::Loader::builder(ds)
        .batch_size(batch)
        .shuffle(stokehold::Shuffle::None)
        .build()
        .unwrap();
    let first = loader.epoch(0).unwrap().next().unwrap().unwrap();
    first
}

/// `n` documents of pseudo-random lengths below `longest` (empty ones among them) and
/// pseudo-random `uint16` tokens, from `seed` (not 0).
pub fn random_documents(n: usize, longest: u64, seed: u64) -> Vec<Vec<u16>> {
    let mut x = seed;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|_| {
            let len = (next() % longest) as usize;
            (0..len).map(|_| next() as u16).collect()
        })
        .collect()
}

/// Writes `docs` as a Megatron indexed dataset of `uint16` tokens, `dir/set.bin` and
/// `dir/set.idx` (one document index per sequence), synced so that eviction can drop
/// the pages; returns the prefix. `reversed` stores the documents' tokens in the `.bin`
/// last first, so that the index's pointers fall (a valid set, not back to back).
pub fn write_megatron(
    dir: &std::path::Path,
    docs: &[Vec<u16>],
    reversed: bool,
) -> std::path::PathBuf {
    let n = docs.len();
    let mut pointers = vec![0i64; n];
    let mut bin = Vec::new();
    let order: Vec<usize> = match reversed {
        true => (0..n).rev().collect(),
        false => (0..n).collect(),
    };
    for i in order {
        pointers[i] = bin.len() as i64;
        bin.extend(docs[i].iter().flat_map(|t| t.to_le_bytes()));
    }
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(8);
    idx.extend((n as u64).to_le_bytes());
    idx.extend((n as u64 + 1).to_le_bytes());
    idx.extend(docs.iter().flat_map(|d| (d.len() as i32).to_le_bytes()));
    idx.extend(pointers.iter().flat_map(|p| p.to_le_bytes()));
    idx.extend((0..=n as i64).flat_map(|k| k.to_le_bytes()));
    for (ext, bytes) in [("bin", bin), ("idx", idx)] {
        let mut f = std::fs::File::create(dir.join(format!("set.{ext}"))).unwrap();
        std::io::Write::write_all(&mut f, &bytes).unwrap();
        f.sync_all().unwrap();
    }
    dir.join("set")
}
