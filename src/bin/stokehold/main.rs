//! The `stokehold` command: `train`, `gen`, `inspect`, `bench`. It parses arguments,
//! turns them into the library's configs and prints what the library returns.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use stokehold::bench::{self, BenchConfig};
use stokehold::device::DeviceChoice;
use stokehold::gen::{self, ClassificationSpec};
use stokehold::report::{self, write_json};
use stokehold::train::{self, TrainConfig};
use stokehold::Shuffle;

mod args;

use args::{Cli, Command};

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

/// Makes the default classification set when `dir` is its missing directory (once,
/// whatever other runs find it missing at the same time).
fn ensure_dataset(dir: &Path) -> stokehold::Result<()> {
    if !gen::default_missing(dir) {
        return Ok(());
    }
    let spec = ClassificationSpec::default();
    let (n, shape, classes) = (spec.samples, &spec.shape, spec.classes);
    say(&format!(
        "making {} ({n} samples of {shape:?} u8, {classes} classes)",
        dir.display()
    ));
    let bar = progress(spec.samples, "gen");
    let made = gen::default_set(dir, &|n| bar.inc(n));
    bar.finish_and_clear();
    if !made? {
        say(&format!(
            "{} was made meanwhile by another run",
            dir.display()
        ));
    }
    Ok(())
}

fn run(command: Command) -> stokehold::Result<ExitCode> {
    match command {
        Command::Train(a) => {
            // Output paths are refused before any work, making the default set included.
            a.json.as_deref().map_or(Ok(()), report::check_output)?;
            a.trace
                .as_deref()
                .map_or(Ok(()), report::check_trace_output)?;
            if let (Some(json), Some(trace)) = (&a.json, &a.trace) {
                if report::same_output(json, trace) {
                    return Err(stokehold::Error::Config(format!(
                        "--json and --trace both name {}: one would replace the other",
                        json.display()
                    )));
                }
            }
            // CUDA asked for where there is no driver: said before the default set is made.
            if let Some(why) = (a.device == DeviceChoice::Cuda)
                .then(stokehold::cuda::driver_missing)
                .flatten()
            {
                return Err(stokehold::Error::cuda(why));
            }
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
                crop: a.crop,
                flip: a.flip,
            };
            let report = train::run(&config)?;
            let written = a.json.map_or(Ok(()), |path| write_json(&path, &report));
            emit(&train::summary(&report, &config));
            for e in [&report.error, &report.trace_error].into_iter().flatten() {
                say(&format!("error: {e}"));
            }
            let failed = report.diverged_at.is_some()
                || report.trace_error.is_some()
                || report.error.is_some();
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
            errors.iter().for_each(|e| say(&format!("error: {e}")));
            Ok(match errors.is_empty() {
                true => ExitCode::SUCCESS,
                false => ExitCode::FAILURE,
            })
        }
        Command::Bench(a) => {
            a.json.as_deref().map_or(Ok(()), report::check_output)?;
            ensure_dataset(&a.loader.data)?;
            let cfg = BenchConfig {
                batch: a.loader.batch,
                workers: a.loader.workers,
                prefetch: a.loader.prefetch,
                reps: a.reps as usize,
                seed: 0,
                cold: !a.no_cold,
                only_cold: a.only.is_some(),
                page_cache_budget: a.loader.page_cache_budget,
                direct_reads: !a.loader.no_direct_reads,
            };
            let report = bench::measure(&a.loader.data, &cfg, &mut |line| say(line))?;
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

/// Prints a line to stderr; a closed stderr (`2>&1 | head`) is not an error either
/// (`eprintln!` would panic on it).
fn say(line: &str) {
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{line}\n").as_bytes());
}

fn main() -> ExitCode {
    // A file-size limit (`ulimit -f`) is then an error naming the file, not a kill.
    // SAFETY: setting a signal's disposition to "ignore" before any thread starts.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    match run(Cli::parse().command) {
        Ok(code) => code,
        Err(e) => {
            say(&format!("error: {e}"));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_command_line_is_well_formed() {
        <super::args::Cli as clap::CommandFactory>::command().debug_assert();
    }
}
