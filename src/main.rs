//! The `stokehold` command: `gen`, `inspect`, `bench`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use stokehold::bench::{self, BenchConfig};
use stokehold::cuda::PinnedKind;
use stokehold::device::DeviceChoice;
use stokehold::gen::{self, ClassificationSpec};
use stokehold::train::TrainConfig;
use stokehold::{pagecache, Dataset, MappedFile, NpyArray, NpyDataset, Shuffle};

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
    Train {
        #[command(flatten)]
        loader: LoaderArgs,
        /// Epochs.
        #[arg(long, default_value_t = 5)]
        epochs: u64,
        /// Sample order.
        #[arg(long, value_enum, default_value_t = ShuffleArg::Full)]
        shuffle: ShuffleArg,
        /// Seed of the order and the weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Where the training step runs.
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
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
        #[arg(long, value_enum, default_value_t = PinnedKind::Plain)]
        pinned: PinnedKind,
    },
    /// Write a learnable classification set (x.npy u8, y.npy i64), or a token stream.
    Gen {
        /// Output directory (classification) or file (with --tokens).
        #[arg(long)]
        out: PathBuf,
        /// Samples.
        #[arg(long, default_value_t = 200_000)]
        samples: u64,
        /// Shape of one sample, e.g. 3x32x32.
        #[arg(long, default_value = "3x32x32", value_parser = parse_shape)]
        shape: Shape,
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
    },
    /// Print each .npy file's shape, dtype, rows, bytes and page-cache residency.
    Inspect {
        /// .npy files or directories of them.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Measure the loader against a bare gather (the roofline), warm and cold.
    Bench {
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
    },
}

/// The dataset and loader flags `train` and `bench` share.
#[derive(Debug, Clone, clap::Args)]
struct LoaderArgs {
    /// Directory holding x.npy (u8) and y.npy (i64); made with `stokehold gen` if missing.
    #[arg(long, default_value = DEFAULT_DATA)]
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
}

/// `--shuffle full|block|none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ShuffleArg {
    Full,
    Block,
    None,
}

/// A sample shape such as `3x32x32`.
#[derive(Debug, Clone)]
struct Shape(Vec<u64>);

fn parse_shape(s: &str) -> Result<Shape, String> {
    s.split(['x', 'X', ','])
        .map(|d| {
            d.trim()
                .parse::<u64>()
                .map_err(|_| format!("bad dimension {d:?} in {s:?}"))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Shape)
}

fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if !std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{what} {{bar:30}} {{pos}}/{{len}} {{per_sec}} eta {{eta}}"
        ))
        .expect("static template"),
    );
    bar
}

/// Where `train` and `bench` make their default dataset when `--data` is not given.
const DEFAULT_DATA: &str = "data/cifar";

/// Makes the default classification set unless it is already there. Any other missing
/// directory is left alone: opening it then fails with an error naming it, rather than
/// generating 600 MB into a mistyped path.
fn ensure_dataset(dir: &Path) -> stokehold::Result<()> {
    if dir != Path::new(DEFAULT_DATA) || dir.join("x.npy").is_file() && dir.join("y.npy").is_file()
    {
        return Ok(());
    }
    let spec = ClassificationSpec::default();
    eprintln!(
        "making {} ({} samples of {:?} u8, {} classes)",
        dir.display(),
        spec.samples,
        spec.shape,
        spec.classes
    );
    gen::classification(dir, &spec, &progress(spec.samples, "gen"))?;
    Ok(())
}

fn inspect(paths: &[PathBuf]) -> ExitCode {
    let mut failed = false;
    println!(
        "{:<40} {:>18} {:>8} {:>10} {:>12} {:>9}",
        "file", "shape", "dtype", "rows", "bytes", "resident"
    );
    let mut files = Vec::new();
    for p in paths {
        match std::fs::read_dir(p) {
            Ok(entries) => {
                let mut v: Vec<PathBuf> = entries
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|e| e == "npy"))
                    .collect();
                v.sort();
                if v.is_empty() {
                    eprintln!("error: {}: no .npy file in this directory", p.display());
                    failed = true;
                }
                files.extend(v);
            }
            Err(_) => files.push(p.clone()),
        }
    }
    for f in files {
        match NpyArray::open(&f) {
            Ok(a) => {
                let res = pagecache::file_residency(MappedFile::new(a.path(), a.mapping()))
                    .map(|r| format!("{:.0}%", 100.0 * r.fraction()))
                    .unwrap_or_else(|_| "?".into());
                println!(
                    "{:<40} {:>18} {:>8} {:>10} {:>12} {:>9}",
                    f.display(),
                    stokehold::dataset::shape_string(a.shape()),
                    a.dtype().name(),
                    a.rows(),
                    a.mapping().len(),
                    res
                );
            }
            Err(e) => {
                eprintln!("error: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn run_bench(data: &Path, json: Option<&Path>, cfg: BenchConfig) -> stokehold::Result<()> {
    ensure_dataset(data)?;
    let ds = NpyDataset::open(data)?;
    let fitted = stokehold::train::fit_classifier(&ds)?;
    let ds: Arc<dyn Dataset> = Arc::new(ds);
    eprintln!(
        "bench: {} samples, batch {}, {} workers, prefetch {}, {} reps{}",
        ds.len(),
        cfg.batch,
        cfg.workers,
        cfg.prefetch.map_or("default".into(), |p| p.to_string()),
        cfg.reps,
        if cfg.cold { ", then cold epochs" } else { "" }
    );
    let mut report = bench::run(Arc::clone(&ds), &cfg)?;
    let o = bench::overlap_cpu(Arc::clone(&ds), &cfg, fitted)?;
    println!(
        "CPU backend, hidden {}: overlapped epoch {:.3} s vs serialised {:.3} s ({:.2}x); gather/worker {:.3} s, copy {:.3} s, compute {:.3} s: {:.2}x the slowest stage",
        o.hidden, o.overlapped_s, o.serialised_s, o.speedup, o.gather_per_worker_s, o.copy_s, o.compute_s, o.overlapped_vs_slowest
    );
    report.cpu_overlap = Some(o);
    match stokehold::device::Device::auto() {
        stokehold::device::Device::Cuda(c) => {
            eprintln!("bench: GPU figures on {}", c.name);
            report.gpu = Some(bench::gpu::run(&c, ds, cfg.batch, cfg.workers)?);
        }
        stokehold::device::Device::Cpu { reason } => report.gpu_skipped = reason,
    }
    println!(
        "warm page cache, full shuffle, batch {}, {} threads:",
        cfg.batch, cfg.workers
    );
    println!(
        "  roofline (bare gather)  {:>10.0} samples/s  {:>6.2} GB/s  {:>6.0} us/batch gather",
        report.roofline.samples_per_s,
        report.roofline.gb_per_s,
        report.roofline.gather_us_per_batch
    );
    println!(
        "  loader                  {:>10.0} samples/s  {:>6.2} GB/s  {:>6.0} us/batch gather  = {:.1}% of roofline (median of paired runs), stalled on {:.0}% of batches",
        report.loader.samples_per_s,
        report.loader.gb_per_s,
        report.loader.gather_us_per_batch,
        100.0 * report.ratio,
        100.0 * report.loader.stalled_share
    );
    for c in &report.cold {
        println!(
            "cold cache, {:<5} shuffle: {:>7.2} s  {:>10.0} samples/s  (resident {:.0}% -> {:.0}%)",
            c.shuffle,
            c.seconds,
            c.samples_per_s,
            100.0 * c.residency_before.fraction(),
            100.0 * c.residency_after.fraction()
        );
    }
    match (&report.gpu, &report.gpu_skipped) {
        (Some(g), _) => {
            let h = &g.h2d;
            println!("GPU {}:", g.device);
            println!(
                "  H2D GB/s: bare pinned {:.1}, write-combined {:.1}, pageable {:.1}, freshly written pinned {:.1}",
                h.bare_pinned_gb_s,
                h.bare_write_combined_gb_s,
                h.bare_pageable_gb_s,
                h.bare_fresh_gb_s
            );
            println!(
                "  feeder copies {:.1} GB/s = {:.0}% of bare pinned, {:.0}% of freshly written (wall {:.1}); from write-combined buffers {:.1}",
                h.feeder_copy_gb_s,
                100.0 * h.feeder_vs_bare,
                100.0 * h.feeder_vs_fresh,
                h.feeder_wall_gb_s,
                h.feeder_copy_write_combined_gb_s
            );
            let o = &g.overlap;
            println!(
                "  overlap ({} workers, hidden {}): {:.3} s overlapped vs {:.3} s serialised; copy {:.3} s, compute {:.3} s, gather {:.3} s: {:.2}x the slowest stage",
                o.workers, o.hidden, o.overlapped_s, o.serialised_s, o.copy_s, o.compute_s, o.gather_s, o.overlapped_vs_slowest
            );
            for w in &g.warmup {
                println!(
                    "  warm-up paid first, {}: epoch 0 {:.3} s against a steady {:.3} s ({:.2}x)",
                    if w.device_cache {
                        "device cache"
                    } else {
                        "host path"
                    },
                    w.first_s,
                    w.steady_s,
                    w.ratio
                );
            }
            for c in &g.cache {
                println!(
                    "  device cache, {} worker(s): epoch {:.3} s from the host path, {:.3} s from the cache ({:.1}x)",
                    c.workers, c.uncached_s, c.cached_s, c.speedup
                );
            }
        }
        (None, Some(reason)) => println!("GPU figures skipped: {reason}"),
        (None, None) => {}
    }
    if let Some(path) = json {
        write_json(path, &report)?;
    }
    Ok(())
}

fn write_json(path: &Path, value: &impl serde::Serialize) -> stokehold::Result<()> {
    let text = serde_json::to_string_pretty(value).expect("reports serialise");
    std::fs::write(path, text + "\n").map_err(|e| stokehold::Error::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

fn run_train(config: TrainConfig, json: Option<&Path>) -> stokehold::Result<()> {
    ensure_dataset(&config.data)?;
    let report = stokehold::train::run(&config)?;
    println!("device: {}", report.device);
    if let Some(reason) = &report.fallback_reason {
        println!("  (CPU backend: {reason})");
    }
    if let Some(bytes) = report.device_cache_bytes {
        println!(
            "  device cache: {}, epochs after the first read from the GPU",
            stokehold::report::megabytes(bytes)
        );
    }
    println!(
        "data: {} ({} samples of {} bytes), batch {}, {} workers, {:?} shuffle, hidden {}\n",
        report.data,
        report.samples,
        report.bytes_per_sample,
        config.batch,
        config.workers,
        config.shuffle,
        config.hidden
    );
    print!("{}", report.table());
    println!();
    print!("{}", report.warmup_text());
    if let Some(path) = json {
        write_json(path, &report)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train {
            loader:
                LoaderArgs {
                    data,
                    batch,
                    workers,
                    prefetch,
                },
            epochs,
            shuffle,
            seed,
            device,
            hidden,
            lr,
            cold,
            warmup,
            json,
            trace,
            no_device_cache,
            pinned,
        } => run_train(
            TrainConfig {
                data,
                epochs,
                batch,
                workers,
                prefetch,
                shuffle: match shuffle {
                    ShuffleArg::Full => Shuffle::Full { seed },
                    ShuffleArg::Block => Shuffle::block(seed),
                    ShuffleArg::None => Shuffle::None,
                },
                device,
                hidden,
                lr,
                cold,
                warmup,
                seed,
                quiet: false,
                trace,
                device_cache: !no_device_cache,
                pinned,
            },
            json.as_deref(),
        ),
        Command::Inspect { paths } => return inspect(&paths),
        Command::Gen {
            out,
            samples,
            shape,
            classes,
            noise,
            seed,
            tokens,
            vocab,
        } => match tokens {
            Some(n) => gen::token_stream(&out, n, vocab, seed).map(|p| {
                println!("wrote {} ({n} u16 tokens, vocab {vocab})", p.display());
            }),
            None => {
                let spec = ClassificationSpec {
                    samples,
                    shape: shape.0,
                    classes,
                    noise,
                    seed,
                };
                gen::classification(&out, &spec, &progress(samples, "gen")).map(|(x, y)| {
                    println!("wrote {} and {}", x.display(), y.display());
                })
            }
        },
        Command::Bench {
            loader:
                LoaderArgs {
                    data,
                    batch,
                    workers,
                    prefetch,
                },
            json,
            reps,
            no_cold,
        } => run_bench(
            &data,
            json.as_deref(),
            BenchConfig {
                batch,
                workers,
                prefetch,
                reps: reps.max(1),
                seed: 0,
                cold: !no_cold,
            },
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
        let cli =
            Cli::try_parse_from(["stokehold", "gen", "--out", "d", "--shape", "1x8x8"]).unwrap();
        match cli.command {
            Command::Gen { shape, .. } => assert_eq!(shape.0, vec![1, 8, 8]),
            _ => panic!("parsed the wrong subcommand"),
        }
        assert!(Cli::try_parse_from(["stokehold", "gen", "--out", "d", "--shape", "3xq"]).is_err());
    }
}
