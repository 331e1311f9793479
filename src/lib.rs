//! # stokehold
//!
//! Keeps a GPU fed: a prefetching, shuffling, multi-threaded loader over memory-mapped
//! datasets (NumPy `.npy` files, flat token streams, variable-length documents) that streams epochs of batches into
//! a fixed pool of host buffers.
//!
//! ```
//! use stokehold::{Loader, NpyDataset, Shard, Shuffle};
//! # fn main() -> stokehold::Result<()> {
//! let ds = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
//! let mut loader = Loader::builder(ds)
//!     .batch_size(256)
//!     .shuffle(Shuffle::Full { seed: 7 })
//!     .shard(Shard::from_env()?)
//!     .workers(2)
//!     .prefetch(4)
//!     .build()?;
//! for batch in loader.epoch(0)? {
//!     let batch = batch?;
//!     let (x, y) = (batch.column::<u8>(0)?, batch.column::<i64>(1)?);
//!     assert_eq!(x.len(), 64 * y.len());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! The order of every epoch is a pure function of `(seed, epoch, rank, world_size)`
//! (block shuffle's default block, about 1 MiB of rows, adds the row width in bytes; a
//! grouped shuffle adds the samples' lengths): never of the worker count or timing.
//! See [`sampler`] for the permutations and [`Loader`] for buffers, prefetch,
//! resumption and failure handling.

#![warn(missing_docs)]

// The layers, each importing only from those above it in this list (see the README's
// "Design in brief"):
// L0: error, util, partial (temporary files)
mod error;
mod partial;
mod permutation;
mod util;
// L1: the data, its order, the model's math
pub mod augment;
pub mod dataset;
pub mod gen;
pub mod model;
pub mod sampler;
// L2: reading it
pub mod interop;
pub mod loader;
pub mod pagecache;
// L3: what pipelines measure
pub mod telemetry;
// L4: the backends and their interface
mod backend;
pub mod cpu;
pub mod cuda;
// L5: choosing a backend; reports
pub mod device;
pub mod report;
// L6: the training job and the benchmarks
pub mod bench;
pub mod train;
// Not the API: what the crate's own tests check.
#[doc(hidden)]
pub mod testing;

pub use augment::{Augment, Augmenter, Draw};
pub use backend::Trainer;
pub use dataset::{
    Column, Concat, DType, Dataset, Documents, Element, LitData, MappedFile, Mix, NpyArray,
    NpyDataset, NpyHeader, Packed, Subset, TokenDataset, Windows,
};
pub use error::{Error, NpyProblem, Result};
pub use loader::{
    BatchLayout, BatchTiming, Canceller, Epoch, EpochStats, HostAlloc, HostBatch, HostMemory,
    Loader, LoaderBuilder, LoaderState, PlainAlloc, Startup, Storage, DEFAULT_HELD,
    DEFAULT_PREFETCH_BYTES, MAX_WORKERS,
};
pub use permutation::Permutation;
pub use sampler::{EpochOrder, Order, Shard, ShardTail, Shuffle};
pub use util::megabytes;
