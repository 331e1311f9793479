//! Every numbered example runs to its end and prints what its comments promise.
//!
//! The examples check their own claims with `assert!` (a resume that matches the
//! uninterrupted run, disjoint shards, a mixture's shares, augmented rows equal to their
//! samples); this test runs each one as a user would and looks for the line that says the
//! check passed. Examples 05 (on the CUDA emulator, `tests/emulated.rs`), 07, 08 (their
//! features' tests) and 09 (`tests/documents.rs`) are run where their set-up is.

mod common;

use std::process::Command;

/// Runs example `name` from the package root and returns its standard output.
///
/// # Panics
/// If the example fails, or is not built (`cargo test` builds the examples; `cargo test
/// --test examples` alone does not: `cargo build --examples` first).
fn run(name: &str) -> String {
    let exe = common::example(name);
    let out = Command::new(&exe)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}; `cargo test` builds the examples, or `cargo build --examples`",
                exe.display()
            )
        });
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "example {name} failed ({}):\n{text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The lines of `text` that contain `needle`.
fn lines_with<'a>(text: &'a str, needle: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.contains(needle)).collect()
}

#[test]
fn example_01_takes_every_digit_once_an_epoch() {
    let text = run("01_loader");
    let epochs = lines_with(&text, "8 batches, 1797 samples");
    assert_eq!(epochs.len(), 3, "{text}");
    // The labels counted over an epoch: the set's own counts, whatever the order.
    let counts = lines_with(
        &text,
        "labels 0-9: [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]",
    );
    assert_eq!(counts.len(), 3, "{text}");
    assert!(
        text.contains("loader state: LoaderState { epoch: 3, batch: 0"),
        "{text}"
    );
}

#[test]
fn example_02_resumes_exactly_and_elastically() {
    let text = run("02_resume");
    assert!(
        text.contains("resumed run matches the uninterrupted one: 25 + 29 = 54 batches"),
        "{text}"
    );
    assert!(text.contains("elastic restart on 3 ranks"), "{text}");
}

#[test]
fn example_03_shards_are_disjoint_and_cover_the_set() {
    let text = run("03_sharded");
    assert_eq!(
        lines_with(&text, "samples are disjoint and cover 1796").len(),
        2,
        "{text}"
    );
    assert_eq!(
        lines_with(&text, "ranks see all 1797 samples").len(),
        1,
        "{text}"
    );
}

#[test]
fn example_04_reads_each_window_where_it_starts() {
    // Token i of the example's file is i: a window read from where the dataset says it
    // starts holds the ids start, start + 1, ... (and the two epochs draw other starts).
    let text = run("04_tokens");
    let lines: Vec<&str> = text.lines().collect();
    let mut starts = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(start) = line.split("(starts at token ").nth(1) else {
            continue;
        };
        let start: u64 = start.trim_end_matches(')').parse().unwrap();
        let input = lines[i + 1]
            .split('[')
            .nth(1)
            .unwrap()
            .trim_end_matches(']');
        let ids: Vec<u64> = input.split(", ").map(|n| n.parse().unwrap()).collect();
        assert_eq!(ids, (start..start + 8).collect::<Vec<_>>(), "{text}");
        starts.push(start);
    }
    assert_eq!(starts.len(), 8, "{text}");
    assert_ne!(starts[..4], starts[4..], "{text}");
}

#[test]
fn example_06_trains_its_own_step_and_reports_the_warm_up() {
    let text = run("06_own_loop");
    let accuracy = text
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .filter_map(|l| l.split_whitespace().last()?.strip_suffix('%')?.parse().ok())
        .collect::<Vec<f64>>();
    assert_eq!(accuracy.len(), 5, "{text}");
    assert!(accuracy[4] > 85.0, "{text}");
    assert!(text.contains("setup before epoch 0:"), "{text}");
    assert!(text.contains("unexplained:"), "{text}");
}

#[test]
fn example_10_mixes_in_the_shares_it_asks_for() {
    let text = run("10_mix");
    let epochs = lines_with(&text, "windows per corpus [1200, 600, 200]");
    assert_eq!(epochs.len(), 2, "{text}");
}

#[test]
fn example_11_augments_as_the_augmenter_draws() {
    let text = run("11_augment");
    assert_eq!(lines_with(&text, "8 rows checked").len(), 2, "{text}");
    assert!(text.contains("column x: float32 [3, 32, 32]"), "{text}");
}
