//! Shared test datasets.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use stoker::{Column, DType, Dataset, HostAlloc, HostMemory, PlainAlloc};

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
    fn gather(&self, _epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> stoker::Result<()> {
        let (a, b) = out.split_at_mut(1);
        for (k, &i) in indices.iter().enumerate() {
            if Some(i) == self.fail_at {
                return Err(stoker::Error::OutOfRange { index: i, len: 0 });
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
    fn alloc(&self, bytes: usize) -> stoker::Result<Box<dyn HostMemory>> {
        self.counts.calls.fetch_add(1, Ordering::SeqCst);
        self.counts.bytes.fetch_add(bytes, Ordering::SeqCst);
        PlainAlloc.alloc(bytes)
    }
}
