//! Faults and plain mistakes end in a clear error naming the file (exit 1) or a correct
//! run: never a signal, a panic, a hang, or a truncated output file (issue 10).

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::DIGITS;

fn stokehold(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args(args)
        .output()
        .expect("the stokehold binary runs")
}

/// `stokehold gen --out OUT` with `extra` flags.
fn gen(out: &Path, extra: &[&str]) -> Output {
    stokehold(&[&["gen", "--out", out.to_str().unwrap()][..], extra].concat())
}

/// Exit 1 with `needle` in the message: no signal, no panic.
fn fails_with(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), None, "killed by a signal: {err}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(needle), "{needle:?} not in: {err}");
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_file_size_limit_while_generating_is_an_error_and_leaves_no_partial_file() {
    // `ulimit -f` stands in for a full disk: the space is reserved before the mapping is
    // filled, so the write fails up front (EFBIG here, ENOSPC on a full disk).
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("set");
    let script = format!(
        "ulimit -f 64; exec {} gen --out {} --samples 100000 --shape 3x8x8",
        env!("CARGO_BIN_EXE_stokehold"),
        out_dir.display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    fails_with(&out, "x.npy");
    assert_eq!(
        files_in(&out_dir),
        Vec::<String>::new(),
        "nothing left behind"
    );
}

#[test]
fn a_trace_that_cannot_be_written_keeps_the_table_and_the_json() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, json) = (dir.path().join("t.json"), dir.path().join("r.json"));
    // About 200 KB of spans against a 32 KB file size limit; the report fits.
    let script = format!(
        "ulimit -f 64; exec {} train --data {DIGITS} --device cpu --epochs 2 --batch 16 \
         --trace {} --json {}",
        env!("CARGO_BIN_EXE_stokehold"),
        trace.display(),
        json.display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    fails_with(&out, "t.json: File too large");
    assert!(String::from_utf8_lossy(&out.stdout).contains("epoch  wall s"));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(report["trace_error"].as_str().unwrap().contains("t.json"));
    assert_eq!(
        files_in(dir.path()),
        ["r.json"],
        "no partial trace left behind"
    );
}

#[test]
fn sizes_that_overflow_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("d");
    let out = gen(&d, &["--samples", "18446744073709551615", "--shape", "1"]);
    fails_with(&out, "too large");
    assert!(!d.exists(), "the directory was made for a set refused");
    let t = dir.path().join("t.bin");
    let out = gen(&t, &["--tokens", "9223372036854775808"]);
    fails_with(&out, "overflow");
    assert!(!t.exists());
    // A shape of more axes than NumPy reads (its header would pass format 1.0's size).
    let axes = vec!["1"; 22_000].join("x");
    let out = gen(&d, &["--samples", "1", "--shape", &axes]);
    fails_with(&out, "NumPy reads at most 64");
}

#[test]
fn two_writers_of_one_dataset_both_end_well() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("d");
    let args = [
        "gen",
        "--out",
        d.to_str().unwrap(),
        "--samples",
        "20000",
        "--shape",
        "3x16x16",
    ];
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_stokehold"))
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    for mut c in [a, b] {
        assert!(c.wait().unwrap().success());
    }
    assert_eq!(files_in(&d), ["x.npy", "y.npy"]);
    let ds = stokehold::NpyDataset::open(&d).unwrap();
    assert_eq!(stokehold::Dataset::len(&ds), 20000);
}

#[test]
fn an_unwritable_json_path_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("no/such/dir/r.json");
    let out = train_cpu(
        Path::new(DIGITS),
        &["--epochs", "1", "--json", json.to_str().unwrap()],
    );
    fails_with(&out, "no/such/dir/r.json");
    assert!(out.stdout.is_empty(), "refused before the run");
    let trace = dir.path().join("no/trace.json");
    let out = train_cpu(
        Path::new(DIGITS),
        &["--epochs", "1", "--trace", trace.to_str().unwrap()],
    );
    fails_with(&out, "no/trace.json");
    // Before the default set is made, too (616 MB written for nothing).
    let out = Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .current_dir(dir.path())
        .args(["train", "--device", "cpu", "--json", "no/such/r.json"])
        .output()
        .unwrap();
    fails_with(&out, "no/such/r.json");
    assert!(
        !dir.path().join("data").exists(),
        "the default set was made"
    );
}

#[test]
fn a_closed_stdout_still_writes_the_json_and_does_not_panic() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args([
            "train",
            "--data",
            DIGITS,
            "--epochs",
            "2",
            "--device",
            "cpu",
            "--json",
            json.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader went away, as `| head -0` does
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["epochs"].as_array().unwrap().len(), 2);
}

#[test]
fn gen_tokens_goes_through_a_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t.bin");
    let out = gen(&t, &["--tokens", "1000", "--vocab", "100"]);
    assert!(out.status.success());
    assert_eq!(std::fs::metadata(&t).unwrap().len(), 2000);
    assert_eq!(files_in(dir.path()), ["t.bin"]);
    // A size limit leaves the old file alone and no temporary.
    let script = format!(
        "ulimit -f 4; exec {} gen --out {} --tokens 1000000",
        env!("CARGO_BIN_EXE_stokehold"),
        t.display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    fails_with(&out, "t.bin");
    assert_eq!(
        std::fs::metadata(&t).unwrap().len(),
        2000,
        "the old file is whole"
    );
    assert_eq!(files_in(dir.path()), ["t.bin"]);
}

#[test]
fn the_command_line_names_bad_choices() {
    let out = stokehold(&["train", "--device", "gpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("auto"));
    let out = stokehold(&["train", "--shuffle", "random"]);
    assert_eq!(out.status.code(), Some(2));
    // Flags that would be ignored together are refused (exit 2, naming them).
    let out = stokehold(&["bench", "--no-cold", "--only", "cold"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-cold"));
    let out = stokehold(&["gen", "--out", "/nonexistent/d", "--vocab", "100"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tokens"));
    for flag in ["--samples", "--shape", "--classes", "--noise"] {
        let value = if flag == "--shape" { "1x2" } else { "5" };
        let out = stokehold(&[
            "gen",
            "--out",
            "/nonexistent/t",
            "--tokens",
            "9",
            flag,
            value,
        ]);
        assert_eq!(out.status.code(), Some(2), "{flag}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(flag) && err.contains("--tokens"),
            "{flag}: {err}"
        );
    }
}

/// A copy of datasets/digits in `dir`.
fn digits_in(dir: &Path) {
    for f in ["x.npy", "y.npy"] {
        std::fs::copy(format!("{DIGITS}/{f}"), dir.join(f)).unwrap();
    }
}

fn train_cpu(data: &Path, extra: &[&str]) -> Output {
    let args = [
        &["train", "--data", data.to_str().unwrap(), "--device", "cpu"][..],
        extra,
    ]
    .concat();
    stokehold(&args)
}

#[test]
fn a_dataset_file_that_is_not_a_regular_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    digits_in(dir.path());
    let x = dir.path().join("x.npy");
    std::fs::remove_file(&x).unwrap();
    // A FIFO would block the open forever.
    assert!(Command::new("mkfifo").arg(&x).status().unwrap().success());
    let out = train_cpu(dir.path(), &["--epochs", "1"]);
    fails_with(&out, "x.npy: is a FIFO, not a regular file");
    std::fs::remove_file(&x).unwrap();
    std::fs::create_dir(&x).unwrap();
    fails_with(
        &train_cpu(dir.path(), &["--epochs", "1"]),
        "x.npy: is a directory",
    );
    std::fs::remove_dir(&x).unwrap();
    std::os::unix::fs::symlink(dir.path().join("gone.npy"), &x).unwrap();
    fails_with(
        &train_cpu(dir.path(), &["--epochs", "1"]),
        "x.npy: a dangling symbolic link",
    );
    let out = stokehold(&["inspect", x.to_str().unwrap()]);
    fails_with(&out, "dangling");
}

#[test]
fn a_dataset_truncated_between_epochs_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    digits_in(dir.path());
    let ds = stokehold::NpyDataset::open_xy(dir.path()).unwrap();
    let mut loader = stokehold::Loader::builder(ds)
        .batch_size(100)
        .build()
        .unwrap();
    assert_eq!(loader.epoch(0).unwrap().filter(|b| b.is_ok()).count(), 18);
    // Another job rewrites the file in place: first it truncates it.
    let x = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("x.npy"))
        .unwrap();
    x.set_len(4096).unwrap();
    let err = loader.epoch(1).unwrap().find_map(|b| b.err()).unwrap();
    let msg = err.to_string();
    assert!(msg.contains("x.npy: changed while it was mapped"), "{msg}");
    // Grown back to its length, it is still refused: its bytes are not the ones opened.
    x.set_len(std::fs::metadata(format!("{DIGITS}/x.npy")).unwrap().len())
        .unwrap();
    let err = loader.epoch(2).unwrap().find_map(|b| b.err()).unwrap();
    let msg = err.to_string();
    assert!(msg.contains("x.npy: changed while it was mapped"), "{msg}");
}

#[test]
fn a_dataset_truncated_while_training_stops_the_command_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("set");
    let made = gen(&data, &["--samples", "20000", "--shape", "3x32x32"]);
    assert!(made.status.success());
    let mut child = Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args(["train", "--device", "cpu", "--epochs", "100000", "--data"])
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let x = std::fs::OpenOptions::new()
        .write(true)
        .open(data.join("x.npy"))
        .unwrap();
    x.set_len(1 << 20).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("train went on with a truncated dataset");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    fails_with(
        &child.wait_with_output().unwrap(),
        "x.npy: changed while it was mapped",
    );
}

#[test]
fn train_reads_x_and_y_whatever_else_the_directory_holds() {
    let dir = tempfile::tempdir().unwrap();
    digits_in(dir.path());
    // An unrelated array of another length.
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/npy/good_1d.npy"
    );
    std::fs::copy(fixture, dir.path().join("other.npy")).unwrap();
    let out = train_cpu(dir.path(), &["--epochs", "1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1797 samples of 72 bytes"));
}

#[test]
fn a_label_far_beyond_the_samples_is_named_with_its_row() {
    let dir = tempfile::tempdir().unwrap();
    digits_in(dir.path());
    let y = dir.path().join("y.npy");
    let mut bytes = std::fs::read(&y).unwrap();
    let at = bytes.len() - 8 * (1797 - 5); // row 5
    bytes[at..at + 8].copy_from_slice(&1_000_000_000_000i64.to_le_bytes());
    std::fs::write(&y, &bytes).unwrap();
    let out = train_cpu(dir.path(), &["--epochs", "1"]);
    fails_with(&out, "label 1000000000000 at row 5");
    bytes[at..at + 8].copy_from_slice(&i64::MAX.to_le_bytes());
    std::fs::write(&y, &bytes).unwrap();
    fails_with(&train_cpu(dir.path(), &["--epochs", "1"]), "at row 5");
}

/// A zero-filled `.npy` file of `descr` and `shape`.
fn write_npy(path: &Path, descr: &str, shape: &[usize], item: usize) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let dims = match dims.len() {
        1 => format!("{},", dims[0]),
        _ => dims.join(", "),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({dims}), }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + shape.iter().product::<usize>() * item, 0);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn column_type_errors_name_the_file_and_count_elements() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
    write_npy(&x, "<f4", &[10, 64], 4);
    write_npy(&y, "<i8", &[10], 8);
    fails_with(
        &train_cpu(dir.path(), &["--epochs", "1"]),
        "x.npy: inputs must be uint8 values; this file holds 64 float32 per sample",
    );
    write_npy(&x, "|u1", &[10, 64], 1);
    write_npy(&y, "<i4", &[10], 4);
    fails_with(
        &train_cpu(dir.path(), &["--epochs", "1"]),
        "y.npy: labels must be one int64 per sample; this file holds 1 int32 per sample",
    );
    write_npy(&y, "<i8", &[10, 2], 8);
    fails_with(
        &train_cpu(dir.path(), &["--epochs", "1"]),
        "y.npy: labels must be one int64 per sample; this file holds 2 int64 per sample",
    );
}

#[test]
fn sizes_from_flags_are_capped_or_refused() {
    let data = Path::new(DIGITS);
    // Once an abort (a 2^40-entry pool) and an out-of-memory kill (a 10^8-row batch):
    // now capped at the 8 batches and 1797 rows an epoch has.
    for flags in [
        ["--prefetch", "1099511627776"],
        ["--batch", "100000000"],
        ["--workers", "1000"],
    ] {
        let out = train_cpu(data, &[&["--epochs", "1"][..], &flags].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{flags:?}: {err}");
    }
    let out = train_cpu(data, &["--epochs", "1", "--workers", "1000"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("batch 256, 8 workers"));
    fails_with(
        &train_cpu(data, &["--epochs", "1", "--workers", "4096"]),
        "4096 workers: at most 1024",
    );
}

#[test]
fn a_huge_model_is_refused_not_aborted() {
    let data = Path::new(DIGITS);
    let out = train_cpu(data, &["--epochs", "1", "--hidden", "100000000"]);
    fails_with(&out, "lower --hidden");
}

#[test]
fn a_diverged_run_says_so_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let out = train_cpu(
        Path::new(DIGITS),
        &[
            "--epochs",
            "2",
            "--lr",
            "1e30",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("diverged"));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["diverged_at"], 0);
}

#[test]
fn zero_epochs_say_so() {
    let out = train_cpu(Path::new(DIGITS), &["--epochs", "0"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("no epochs run"));
}

#[test]
fn a_broken_libcuda_falls_back_in_one_line_without_a_backtrace() {
    // A libcuda.so.1 that loads but exports nothing: cudarc panics on its first call.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("empty.c");
    std::fs::write(&src, "int stokehold_not_cuda(void) { return 0; }\n").unwrap();
    let lib = dir.path().join("libcuda.so.1");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status();
    if !built.is_ok_and(|s| s.success()) {
        eprintln!("skipped: no C compiler to build a fake libcuda");
        return;
    }
    std::fs::copy(&lib, dir.path().join("libcuda.so")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args(["train", "--data", DIGITS, "--epochs", "1"])
        .env("LD_LIBRARY_PATH", dir.path())
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
    let reason = stdout.lines().find(|l| l.contains("CPU backend:")).unwrap();
    assert!(reason.contains("no CUDA device"), "{stdout}");
}

#[test]
fn a_libcuda_the_loader_refuses_is_named_with_the_loaders_words() {
    // A libcuda.so.1 that is no shared object at all (a truncated copy, say): found, and
    // refused, which is not "no libcuda found".
    let dir = tempfile::tempdir().unwrap();
    for name in ["libcuda.so", "libcuda.so.1"] {
        std::fs::write(dir.path().join(name), b"not an ELF file").unwrap();
    }
    let run = |device: &str| {
        Command::new(env!("CARGO_BIN_EXE_stokehold"))
            .args([
                "train", "--data", DIGITS, "--epochs", "1", "--device", device,
            ])
            .env("LD_LIBRARY_PATH", dir.path())
            .output()
            .unwrap()
    };
    let auto = run("auto");
    let stdout = String::from_utf8_lossy(&auto.stdout);
    assert!(
        auto.status.success(),
        "{}",
        String::from_utf8_lossy(&auto.stderr)
    );
    // The loader's own words name the file and what is wrong with it.
    let reason = stdout.lines().find(|l| l.contains("CPU backend:")).unwrap();
    assert!(reason.contains("libcuda does not load: "), "{stdout}");
    assert!(
        reason.contains("libcuda.so") && reason.contains(dir.path().to_str().unwrap()),
        "{stdout}"
    );
    let cuda = run("cuda");
    let stderr = String::from_utf8_lossy(&cuda.stderr);
    assert_eq!(cuda.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("libcuda does not load: "), "{stderr}");
}

#[test]
fn output_and_data_paths_that_are_not_utf8_work() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let odd = |name: &[u8]| dir.path().join(std::ffi::OsStr::from_bytes(name));
    let data = odd(b"digits\xff");
    std::fs::create_dir(&data).unwrap();
    digits_in(&data);
    let (json, trace) = (odd(b"r\xfe.json"), odd(b"t\xff.json"));
    let out = Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args(["train", "--device", "cpu", "--epochs", "1"])
        .arg("--data")
        .arg(&data)
        .arg("--json")
        .arg(&json)
        .arg("--trace")
        .arg(&trace)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let named = report["config"]["data"].as_str().unwrap();
    assert!(named.ends_with("digits\u{fffd}"), "{named}");
    assert!(trace.exists());
}

#[test]
fn a_sigbus_sent_to_the_process_is_not_swallowed_by_the_guard() {
    // The guard catches faults inside its own reads; a SIGBUS sent with `kill` (no
    // fault: its `si_addr` is the sender) ends the process as it would without it.
    let mut child = Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args([
            "train", "--data", DIGITS, "--device", "cpu", "--epochs", "1000000",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Long enough for the first gathers (which install the guard).
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: sends a signal to the child this test spawned and still holds.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGBUS) }, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the SIGBUS sent was swallowed: the process ran on");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}");
}
