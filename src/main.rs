//! The `stokehold` command: `train`, `gen`, `inspect`, `bench`. It parses arguments,
//! turns them into the library's configs and prints what the library returns.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use stokehold::bench::{self, BenchConfig};
use stokehold::cuda::PinnedKind;
use stokehold::device::DeviceChoice;
use stokehold::gen::{self, ClassificationSpec};
use stokehold::report::{self, write_json};
use stokehold::train::{self, TrainConfig};
use stokehold::Shuffle;

/// Keeps a GPU fed: a prefetching, shuffling loader over memory-mapped datasets.
#[derive(Parser)]
#[command(name = "stokehold", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train an MLP classifier for some epochs and explain where the time went.
    Train(TrainArgs),
    /// Write a learnable classification set (x.npy u8, y.npy i64), or a token stream.
    Gen(GenArgs),
    /// Print each .npy file's (Megatron .idx set's, .arrow table's input_ids) shape,
    /// dtype, rows, bytes and page-cache residency.
    Inspect {
        /// .npy, Megatron .idx or .arrow files, or directories of them.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Measure the loader against a bare gather (the roofline), warm and cold.
    Bench(BenchArgs),
}

/// `stokehold train`'s flags.
#[derive(clap::Args)]
struct TrainArgs {
    #[command(flatten)]
    loader: LoaderArgs,
    /// Epochs.
    #[arg(long, default_value_t = 5)]
    epochs: u64,
    /// Sample order (`grouped`, by length, is for documents, which `train` does not read).
    #[arg(long, default_value = "full", value_parser = ["full", "block", "none"])]
    shuffle: String,
    /// Seed of the order and the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where the training step runs.
    #[arg(long, default_value = "auto", value_parser = choice::<DeviceChoice>(&DeviceChoice::NAMES))]
    device: DeviceChoice,
    /// Hidden units (sets the compute per batch).
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Learning rate (0.1: datasets/digits reaches 90% within 10 epochs, and the
    /// default CIFAR-shaped set 99.9% in one).
    #[arg(long, default_value_t = 0.1)]
    lr: f32,
    /// Evict the dataset from the page cache before epoch 0.
    #[arg(long)]
    cold: bool,
    /// Pay the one-off costs (read the files ahead) before epoch 0.
    #[arg(long)]
    warmup: bool,
    /// Write every figure as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto, chrome://tracing) here.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// On CUDA, do not keep the dataset on the device after epoch 0.
    #[arg(long)]
    no_device_cache: bool,
    /// On CUDA, the loader's page-locked buffers: plain, or write-combined (faster
    /// for the host to write and for some PCIe copies, very slow to read back).
    #[arg(long, default_value = "plain", value_parser = choice::<PinnedKind>(&PinnedKind::NAMES))]
    pinned: PinnedKind,
}

/// `stokehold gen`'s flags.
#[derive(clap::Args)]
struct GenArgs {
    /// Output directory (classification) or file (with --tokens).
    #[arg(long)]
    out: PathBuf,
    /// Samples.
    #[arg(long, default_value_t = 200_000)]
    samples: u64,
    /// Shape of one sample, e.g. 3x32x32.
    #[arg(long, default_value = "3x32x32", value_parser = |s: &str| gen::parse_shape(s))]
    shape: std::vec::Vec<u64>,
    /// Classes.
    #[arg(long, default_value_t = 10)]
    classes: u32,
    /// Noise amplitude around each class prototype (0-255).
    #[arg(long, default_value_t = 96)]
    noise: u8,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write a raw u16 token stream of this many tokens to --out instead.
    #[arg(long)]
    tokens: Option<u64>,
    /// Vocabulary size of the token stream.
    #[arg(long, default_value_t = 50_257)]
    vocab: u32,
}

/// `stokehold bench`'s flags.
#[derive(clap::Args)]
struct BenchArgs {
    #[command(flatten)]
    loader: LoaderArgs,
    /// Write the figures as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Timed passes of each.
    #[arg(long, default_value_t = 11)]
    reps: usize,
    /// Skip the cold-cache epochs.
    #[arg(long)]
    no_cold: bool,
    /// Measure only this part: `cold` (a cold epoch with full and with block shuffle,
    /// and the storage's direct-I/O roofline).
    #[arg(long, value_parser = ["cold"])]
    only: Option<String>,
}

/// The dataset and loader flags `train` and `bench` share.
#[derive(Debug, Clone, clap::Args)]
struct LoaderArgs {
    /// Directory holding x.npy (u8) and y.npy (i64); made with `stokehold gen` if missing.
    #[arg(long, default_value = gen::DEFAULT_DATA)]
    data: PathBuf,
    /// Samples per batch.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Loader workers (for `bench`, also the roofline's threads).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Prefetch depth (default: about 32 MiB of batches).
    #[arg(long)]
    prefetch: Option<usize>,
    /// Bytes of page cache the loader may fill with the dataset (default: half the
    /// available memory); a larger dataset is streamed, 0 always streams.
    #[arg(long)]
    page_cache_budget: Option<u64>,
    /// Read streamed files through the page cache, not with direct I/O (`O_DIRECT`).
    #[arg(long)]
    no_direct_reads: bool,
}

/// A parser of one of `names` into the library's type of that name.
fn choice<T>(names: &'static [&'static str]) -> impl TypedValueParser<Value = T>
where
    T: std::str::FromStr + Clone + Send + Sync + 'static,
    T::Err: std::fmt::Debug,
{
    PossibleValuesParser::new(names).map(|s| s.parse::<T>().expect("a listed name parses"))
}

/// A bar on stderr for `len` samples (hidden off a terminal).
fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if !std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    let template = format!("{what} {{bar:30}} {{pos}}/{{len}} {{per_sec}} eta {{eta}}");
    bar.set_style(ProgressStyle::with_template(&template).expect("static template"));
    bar
}

/// Writes a classification set, drawing a bar.
fn classification(dir: &Path, spec: &ClassificationSpec) -> stokehold::Result<(PathBuf, PathBuf)> {
    let bar = progress(spec.samples, "gen");
    let written = gen::classification(dir, spec, &|n| bar.inc(n));
    bar.finish_and_clear();
    written
}

/// Makes the default classification set when `dir` is its missing directory.
fn ensure_dataset(dir: &Path) -> stokehold::Result<()> {
    if !gen::default_missing(dir) {
        return Ok(());
    }
    let spec = ClassificationSpec::default();
    let (n, shape, classes) = (spec.samples, &spec.shape, spec.classes);
    eprintln!(
        "making {} ({n} samples of {shape:?} u8, {classes} classes)",
        dir.display()
    );
    classification(dir, &spec).map(drop)
}

fn run(command: Command) -> stokehold::Result<ExitCode> {
    match command {
        Command::Train(a) => {
            ensure_dataset(&a.loader.data)?;
            let seed = a.seed;
            let config = TrainConfig {
                data: a.loader.data,
                epochs: a.epochs,
                batch: a.loader.batch,
                workers: a.loader.workers,
                prefetch: a.loader.prefetch,
                page_cache_budget: a.loader.page_cache_budget,
                direct_reads: !a.loader.no_direct_reads,
                shuffle: Shuffle::named(&a.shuffle, seed)?,
                device: a.device,
                hidden: a.hidden,
                lr: a.lr,
                cold: a.cold,
                warmup: a.warmup,
                seed,
                quiet: false,
                trace: a.trace,
                device_cache: !a.no_device_cache,
                pinned: a.pinned,
            };
            a.json.as_deref().map_or(Ok(()), report::check_output)?;
            let report = train::run(&config)?;
            let written = a.json.map_or(Ok(()), |path| write_json(&path, &report));
            emit(&train::summary(&report, &config));
            if let Some(e) = &report.trace_error {
                eprintln!("error: {e}");
            }
            let failed = report.diverged_at.is_some() || report.trace_error.is_some();
            written.map(|()| match failed {
                true => ExitCode::FAILURE,
                false => ExitCode::SUCCESS,
            })
        }
        Command::Gen(a) => match a.tokens {
            Some(n) => {
                let p = gen::token_stream(&a.out, n, a.vocab, a.seed)?;
                emit(&format!(
                    "wrote {} ({n} u16 tokens, vocab {})\n",
                    p.display(),
                    a.vocab
                ));
                Ok(ExitCode::SUCCESS)
            }
            None => {
                let spec = ClassificationSpec {
                    samples: a.samples,
                    shape: a.shape,
                    classes: a.classes,
                    noise: a.noise,
                    seed: a.seed,
                };
                let (x, y) = classification(&a.out, &spec)?;
                emit(&format!("wrote {} and {}\n", x.display(), y.display()));
                Ok(ExitCode::SUCCESS)
            }
        },
        Command::Inspect { paths } => {
            let (table, errors) = report::inspect(&paths);
            emit(&table);
            errors.iter().for_each(|e| eprintln!("error: {e}"));
            Ok(match errors.is_empty() {
                true => ExitCode::SUCCESS,
                false => ExitCode::FAILURE,
            })
        }
        Command::Bench(a) => {
            ensure_dataset(&a.loader.data)?;
            let cfg = BenchConfig {
                batch: a.loader.batch,
                workers: a.loader.workers,
                prefetch: a.loader.prefetch,
                reps: a.reps.max(1),
                seed: 0,
                cold: !a.no_cold,
                only_cold: a.only.is_some(),
                page_cache_budget: a.loader.page_cache_budget,
                direct_reads: !a.loader.no_direct_reads,
            };
            a.json.as_deref().map_or(Ok(()), report::check_output)?;
            let report = bench::measure(&a.loader.data, &cfg, &mut |line| eprintln!("{line}"))?;
            let written = a.json.map_or(Ok(()), |path| write_json(&path, &report));
            emit(&report.text());
            written.map(|()| ExitCode::SUCCESS)
        }
    }
}

/// Prints to stdout; a closed stdout (`| head`) is not an error: files come first.
fn emit(text: &str) {
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
}

fn main() -> ExitCode {
    // A file-size limit (`ulimit -f`) is then an error naming the file, not a kill.
    // SAFETY: setting a signal's disposition to "ignore" before any thread starts.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    match run(Cli::parse().command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_command_line_is_well_formed() {
        <super::Cli as clap::CommandFactory>::command().debug_assert();
    }
}
