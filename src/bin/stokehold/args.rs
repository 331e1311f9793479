//! The command line: `stokehold`'s subcommands and their flags, parsed by clap.

use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use stokehold::cuda::PinnedKind;
use stokehold::device::DeviceChoice;
use stokehold::gen;

/// Keeps a GPU fed: a prefetching, shuffling loader over memory-mapped datasets.
#[derive(Parser)]
#[command(name = "stokehold", version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Train an MLP classifier for some epochs and explain where the time went.
    Train(TrainArgs),
    /// Write a learnable classification set (x.npy u8, y.npy i64), or a token stream.
    Gen(GenArgs),
    /// Print each .npy file's (Megatron .idx set's, .arrow table's input_ids, .mds shard's
    /// tokens) shape, dtype, rows, bytes and page-cache residency.
    Inspect {
        /// .npy, Megatron .idx, .arrow or .mds files, or directories of them.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Measure the loader against a bare gather (the roofline), warm and cold.
    Bench(BenchArgs),
}

/// `stokehold train`'s flags.
#[derive(clap::Args)]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    pub(crate) loader: LoaderArgs,
    /// Epochs.
    #[arg(long, default_value_t = 5)]
    pub(crate) epochs: u64,
    /// Sample order (`grouped`, by length, is for documents, which `train` does not read).
    #[arg(long, default_value = "full", value_parser = ["full", "block", "none"])]
    pub(crate) shuffle: String,
    /// Seed of the order and the weights.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Where the training step runs.
    #[arg(long, default_value = "auto", value_parser = choice::<DeviceChoice>(&DeviceChoice::NAMES))]
    pub(crate) device: DeviceChoice,
    /// Hidden units (sets the compute per batch).
    #[arg(long, default_value_t = 64)]
    pub(crate) hidden: usize,
    /// Learning rate (0.1: datasets/digits reaches 90% within 10 epochs, and the
    /// default CIFAR-shaped set 99.9% in one).
    #[arg(long, default_value_t = 0.1)]
    pub(crate) lr: f32,
    /// Evict the dataset from the page cache before epoch 0.
    #[arg(long)]
    pub(crate) cold: bool,
    /// Pay the one-off costs (read the files ahead) before epoch 0.
    #[arg(long)]
    pub(crate) warmup: bool,
    /// Write every figure as JSON here.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto, chrome://tracing) here.
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// On CUDA, do not keep the dataset on the device after epoch 0.
    #[arg(long)]
    pub(crate) no_device_cache: bool,
    /// On CUDA, the loader's page-locked buffers: plain, or write-combined (faster
    /// for the host to write and for some PCIe copies, very slow to read back).
    #[arg(long, default_value = "plain", value_parser = choice::<PinnedKind>(&PinnedKind::NAMES))]
    pub(crate) pinned: PinnedKind,
    /// Augment x with a random crop: pad each image by this many pixels, then cut it back
    /// to size at an offset drawn per sample and epoch (torchvision's `RandomCrop(32,
    /// padding=4)` is `--crop 4`). On CUDA done on the GPU, after the copy or the gather
    /// from the device cache (which keeps the raw images); on the CPU in the loader's
    /// workers.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=stokehold::augment::MAX_PAD as i64))]
    pub(crate) crop: u32,
    /// Augment x with a horizontal flip of half the images, drawn per sample and epoch.
    #[arg(long)]
    pub(crate) flip: bool,
}

/// `stokehold gen`'s flags.
#[derive(clap::Args)]
pub(crate) struct GenArgs {
    /// Output directory (classification) or file (with --tokens).
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Samples.
    #[arg(long, conflicts_with = "tokens", default_value_t = 200_000)]
    pub(crate) samples: u64,
    /// Shape of one sample, e.g. 3x32x32.
    #[arg(long, conflicts_with = "tokens", default_value = "3x32x32", value_parser = |s: &str| gen::parse_shape(s))]
    pub(crate) shape: std::vec::Vec<u64>,
    /// Classes.
    #[arg(long, conflicts_with = "tokens", default_value_t = 10)]
    pub(crate) classes: u32,
    /// Noise amplitude around each class prototype (0-255).
    #[arg(long, conflicts_with = "tokens", default_value_t = 96)]
    pub(crate) noise: u8,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Write a raw u16 token stream of this many tokens to --out instead (the
    /// classification set's flags are then refused).
    #[arg(long)]
    pub(crate) tokens: Option<u64>,
    /// Vocabulary size of the token stream.
    #[arg(long, default_value_t = 50_257, requires = "tokens")]
    pub(crate) vocab: u32,
}

/// `stokehold bench`'s flags.
#[derive(clap::Args)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    pub(crate) loader: LoaderArgs,
    /// Write the figures as JSON here.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Timed passes of each (1 or more).
    #[arg(long, default_value_t = 11, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) reps: u32,
    /// Skip the cold-cache epochs.
    #[arg(long)]
    pub(crate) no_cold: bool,
    /// Measure only this part: `cold` (a cold epoch with full and with block shuffle,
    /// and the storage's direct-I/O roofline).
    #[arg(long, value_parser = ["cold"], conflicts_with_all = ["no_cold", "reps"])]
    pub(crate) only: Option<String>,
}

/// The dataset and loader flags `train` and `bench` share.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct LoaderArgs {
    /// Directory holding x.npy (u8) and y.npy (i64); made with `stokehold gen` if missing.
    #[arg(long, default_value = gen::DEFAULT_DATA)]
    pub(crate) data: PathBuf,
    /// Samples per batch.
    #[arg(long, default_value_t = 256)]
    pub(crate) batch: usize,
    /// Loader workers (for `bench`, also the roofline's threads).
    #[arg(long, default_value_t = 2)]
    pub(crate) workers: usize,
    /// Prefetch depth (default: about 32 MiB of batches).
    #[arg(long)]
    pub(crate) prefetch: Option<usize>,
    /// Bytes of page cache the loader may fill with the dataset (default: half the
    /// available memory, or of the memory cgroup's room where that is less); a larger
    /// dataset is streamed, 0 always streams.
    #[arg(long)]
    pub(crate) page_cache_budget: Option<u64>,
    /// Read streamed files through the page cache, not with direct I/O (`O_DIRECT`).
    #[arg(long)]
    pub(crate) no_direct_reads: bool,
}

/// A parser of one of `names` into the library's type of that name.
fn choice<T>(names: &'static [&'static str]) -> impl TypedValueParser<Value = T>
where
    T: std::str::FromStr + Clone + Send + Sync + 'static,
    T::Err: std::fmt::Debug,
{
    PossibleValuesParser::new(names).map(|s| s.parse::<T>().expect("a listed name parses"))
}
