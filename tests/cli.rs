//! The `stokehold` command end to end: inspect, gen, bench.

use std::process::Command;

use stokehold::{Dataset, NpyDataset};

fn stokehold(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args(args)
        .output()
        .expect("the stokehold binary runs")
}

/// `stokehold args`, which must succeed (its output shown where not); its stdout.
fn succeeds(args: &[&str]) -> String {
    let out = stokehold(args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "stokehold {args:?}:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The JSON a command wrote to `path`.
fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/npy/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn inspect_prints_good_files_and_fails_on_bad_ones() {
    let digits = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let text = succeeds(&["inspect", digits]);
    assert!(
        text.contains("(1797, 8, 8)") && text.contains("uint8"),
        "{text}"
    );
    assert!(text.contains("(1797,)") && text.contains("int64"), "{text}");

    let bad = fixture("bad_magic.npy");
    let out = stokehold(&["inspect", &fixture("good_v1_float32.npy"), &bad]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad_magic.npy") && err.contains("bad magic"),
        "{err}"
    );
    // The good file is still listed.
    assert!(String::from_utf8_lossy(&out.stdout).contains("float32"));

    // A Megatron indexed dataset, named by its index: 6 documents, the longest 40 tokens.
    let text = succeeds(&["inspect", &fixture("megatron_u16.idx")]);
    assert!(
        text.contains("(6, <=40)") && text.contains("uint16"),
        "{text}"
    );
    let out = stokehold(&["inspect", &fixture("megatron_bad_pointer.idx")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("megatron_bad_pointer.idx") && err.contains("lies outside"),
        "{err}"
    );

    // An Arrow table's input_ids; a table without one names the columns it has.
    let arrow = fixture("../arrow/hf_stream.arrow");
    let text = succeeds(&["inspect", &arrow]);
    assert!(
        text.contains("(6, <=40)") && text.contains("int32"),
        "{text}"
    );
    let out = stokehold(&["inspect", &fixture("../arrow/mixed_file.arrow")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains(r#"its columns are "meta""#), "{err}");

    // An MDS dataset's shards, listed from its directory: their tokens.
    let text = succeeds(&["inspect", &fixture("../mds/mds_tokens")]);
    assert!(
        text.contains("shard.00000.mds")
            && text.contains("(3, <=12)")
            && text.contains("(2, <=40)"),
        "{text}"
    );

    let out = stokehold(&["inspect", "/no/such/file.npy"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/file.npy"));
}

#[test]
fn gen_then_bench_writes_the_figures() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("set");
    let data_s = data.to_str().unwrap();
    succeeds(&[
        "gen",
        "--out",
        data_s,
        "--samples",
        "3000",
        "--shape",
        "3x8x8",
        "--classes",
        "4",
    ]);
    let ds = NpyDataset::open(&data).unwrap();
    assert_eq!(ds.len(), 3000);
    assert_eq!(ds.columns()[0].shape, vec![3, 8, 8]);
    let left: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "only x.npy and y.npy: {left:?}");

    let json = dir.path().join("bench.json");
    succeeds(&[
        "bench",
        "--data",
        data_s,
        "--json",
        json.to_str().unwrap(),
        "--reps",
        "1",
        "--batch",
        "64",
    ]);
    let report = read_json(&json);
    for path in ["/loader/samples_per_s", "/roofline/samples_per_s", "/ratio"] {
        let v = report.pointer(path).and_then(|v| v.as_f64());
        assert!(v.is_some_and(|v| v > 0.0), "{path} in {report}");
    }
    for shuffle in ["full", "block"] {
        for key in [
            "epoch_s",
            "samples_per_s",
            "bytes_read",
            "read_amplification",
        ] {
            let v = &report["cold"][shuffle][key];
            assert!(v.is_number(), "cold.{shuffle}.{key} in {report}");
        }
    }
    // The I/O roofline, or why not (a file system without direct I/O); each rate the
    // mean of its passes around the epoch it bounds.
    match report["io_roofline"].as_object() {
        Some(io) => {
            for (rate, passes) in [
                ("sequential_bytes_per_s", "sequential_passes"),
                ("random_iops", "random_passes"),
            ] {
                let passes: Vec<f64> = io[passes]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect();
                assert_eq!(passes.len(), 2, "io_roofline.{rate} in {report}");
                let mean = (passes[0] + passes[1]) / 2.0;
                let rate = io[rate].as_f64().unwrap();
                assert!(rate > 0.0 && (rate - mean).abs() <= 1e-9 * mean, "{report}");
            }
        }
        None => assert!(report["io_roofline_skipped"].is_string(), "{report}"),
    }

    let tokens = dir.path().join("t.bin");
    succeeds(&[
        "gen",
        "--out",
        tokens.to_str().unwrap(),
        "--tokens",
        "1000",
        "--vocab",
        "300",
    ]);
    assert_eq!(std::fs::metadata(&tokens).unwrap().len(), 2000);
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let out = stokehold(&["gen", "--out", "x", "--shape", "3xq"]);
    assert_eq!(out.status.code(), Some(2));
    let out = stokehold(&[
        "bench",
        "--data",
        &fixture("dir"),
        "--batch",
        "0",
        "--reps",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("batch size"));
}

#[test]
fn a_missing_data_directory_is_an_error_not_a_new_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("typo");
    let out = stokehold(&[
        "train",
        "--data",
        missing.to_str().unwrap(),
        "--epochs",
        "1",
        "--device",
        "cpu",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("typo"));
    assert!(!missing.exists(), "nothing was generated");
}

#[test]
fn digits_reach_90_percent_within_10_epochs_with_default_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("train.json");
    let digits = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let j = json.to_str().unwrap();
    succeeds(&[
        "train", "--data", digits, "--epochs", "10", "--device", "cpu", "--json", j,
    ]);
    let report = read_json(&json);
    let best = report["epochs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["accuracy"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(best >= 0.90, "best training accuracy {best} in 10 epochs");
}

#[test]
fn train_augments_x_when_asked_and_refuses_a_crop_too_large() {
    // The same seed with and without `--crop --flip`: the same order and weights, other
    // images, so other losses from the first batch on; the JSON and the summary say what
    // ran.
    let tmp = tempfile::tempdir().unwrap();
    let digits = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let run = |name: &str, extra: &[&str]| {
        let json = tmp.path().join(name);
        let args = [
            &[
                "train", "--data", digits, "--epochs", "2", "--device", "cpu",
            ][..],
            &["--json", json.to_str().unwrap()],
            extra,
        ]
        .concat();
        (succeeds(&args), read_json(&json))
    };
    let (plain_text, plain) = run("plain.json", &[]);
    let (text, augmented) = run("augmented.json", &["--crop", "1", "--flip"]);
    assert!(!plain_text.contains("augment:"), "{plain_text}");
    assert!(
        text.contains("augment: x, a random crop (padding 1), a flip, drawn per sample"),
        "{text}"
    );
    assert!(
        !text.contains("no device cache"),
        "the CPU has none: {text}"
    );
    assert_eq!(augmented["config"]["crop"], 1);
    assert_eq!(augmented["config"]["flip"], true);
    assert_eq!(plain["config"]["crop"], 0);
    // Only the augmentation differs: the seed, the shuffle and every other setting match.
    let rest = |r: &serde_json::Value| {
        let mut config = r["config"].as_object().unwrap().clone();
        config.remove("crop");
        config.remove("flip");
        config
    };
    assert!(rest(&plain).contains_key("seed"), "{}", plain["config"]);
    assert_eq!(rest(&plain), rest(&augmented));
    let loss = |r: &serde_json::Value| r["epochs"][0]["loss"].as_f64().unwrap();
    assert_ne!(loss(&plain), loss(&augmented));

    let out = stokehold(&["train", "--data", digits, "--crop", "4097"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("4097"));
}

/// `stokehold train` on the digits, on the CPU, for one epoch, with `extra` flags.
fn train_digits(extra: &[&str]) -> std::process::Output {
    let digits = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let mut args = vec![
        "train", "--data", digits, "--epochs", "1", "--device", "cpu",
    ];
    args.extend_from_slice(extra);
    stokehold(&args)
}

#[test]
fn outputs_go_through_links_into_streams_and_never_onto_each_other() {
    use std::os::unix::fs::FileTypeExt;
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    // A link is written through: its target gets the report, the link stays a link.
    std::fs::create_dir(dir.path().join("real")).unwrap();
    std::os::unix::fs::symlink("real/target.json", dir.path().join("link.json")).unwrap();
    let out = train_digits(&["--json", &at("link.json")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::symlink_metadata(at("link.json"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(read_json(&dir.path().join("real/target.json"))["epochs"].is_array());
    // A FIFO is written in place (its reader gets the report), not replaced by a file.
    let fifo = at("report.fifo");
    let c = std::ffi::CString::new(fifo.clone()).unwrap();
    // SAFETY: mkfifo reads the NUL-terminated path it is given.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    let out = train_digits(&["--json", &fifo]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&reader.join().unwrap()).unwrap();
    assert!(got["epochs"].is_array());
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    // Refused before any work, naming the path: a trace into a stream, both outputs
    // on one file (however spelt), a path ending in `/`.
    for (flags, says) in [
        (vec!["--trace", fifo.as_str()], "not a regular file"),
        (
            vec![
                "--json",
                &at("same.json"),
                "--trace",
                &at("real/../same.json"),
            ],
            "both name",
        ),
        (vec!["--json", &at("new.json/")], "is a directory"),
    ] {
        let out = train_digits(&flags);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
        assert!(
            !err.contains("epoch 0"),
            "{flags:?} refused after the work: {err}"
        );
    }
    assert!(!dir.path().join("same.json").exists());
}

#[test]
fn json_into_stdout_goes_through_the_descriptor_a_pipe_or_a_log_in_append() {
    // The first JSON value of `bytes` (the report; the table follows it).
    let report = |bytes: &[u8]| -> serde_json::Value {
        let mut values = serde_json::Deserializer::from_slice(bytes).into_iter();
        values.next().expect("a JSON value").expect("the report")
    };
    // Into a pipe (`| jq`): the report, then the table.
    let out = train_digits(&["--json", "/dev/stdout"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(report(&out.stdout)["epochs"].is_array(), "{text}");
    assert!(
        text.contains("epoch 0") || text.contains("one epoch only"),
        "{text}"
    );
    // Into a log opened for appending (`>> run.log`): what the log held stays, the
    // report and the table follow it.
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("run.log");
    std::fs::write(&log, "earlier lines\n").unwrap();
    let append = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    let digits = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let status = Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args([
            "train", "--data", digits, "--epochs", "1", "--device", "cpu",
        ])
        .args(["--json", "/dev/stdout"])
        .stdout(append)
        .status()
        .unwrap();
    assert!(status.success());
    // The JSON into stdout where stdout is the trace's file: one would replace the other.
    let trace = dir.path().join("trace.json");
    let out = Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args([
            "train", "--data", digits, "--epochs", "1", "--device", "cpu",
        ])
        .args(["--json", "/dev/stdout", "--trace", trace.to_str().unwrap()])
        .stdout(std::fs::File::create(&trace).unwrap())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("both name"), "{err}");
    let written = std::fs::read(&log).unwrap();
    let rest = written
        .strip_prefix(b"earlier lines\n".as_slice())
        .expect("the log kept");
    assert!(report(rest)["epochs"].is_array());
    assert!(String::from_utf8_lossy(rest).contains("device: cpu"));
    // A descriptor not open for writing is refused up front.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stokehold"));
    cmd.args([
        "train",
        "--data",
        digits,
        "--epochs",
        "1",
        "--json",
        "/dev/fd/0",
    ]);
    let out = cmd
        .stdin(std::fs::File::open(&log).unwrap())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("reading only") && !err.contains("epoch 0"),
        "{err}"
    );
}

#[test]
fn a_closed_stderr_is_no_panic() {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::process::Stdio;
    // The reader of stderr is gone before the error is printed (`2>&1 | head -0`): the
    // exit status still says what went wrong (1), not a panic's 101.
    let mut fds = [0; 2];
    // SAFETY: pipe writes two descriptors into the array it is given.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors were just made and are owned here only.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    let status = Command::new(env!("CARGO_BIN_EXE_stokehold"))
        .args(["train", "--data", "/nonexistent/set", "--device", "cpu"])
        .stdout(Stdio::null())
        .stderr(Stdio::from(write))
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(1));
}

#[test]
fn two_runs_writing_one_set_leave_a_matching_pair() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("set");
    let gen = |seed: &'static str| {
        let out = out.clone();
        std::thread::spawn(move || {
            let args = ["gen", "--out", out.to_str().unwrap(), "--samples", "64"];
            let rest = [
                "--shape",
                "4",
                "--classes",
                "3",
                "--noise",
                "0",
                "--seed",
                seed,
            ];
            stokehold(&[&args[..], &rest[..]].concat())
        })
    };
    let labels = |seed: u64| {
        let spec = stokehold::gen::ClassificationSpec {
            samples: 64,
            shape: vec![4],
            classes: 3,
            noise: 0,
            seed,
        };
        let d = tempfile::tempdir().unwrap();
        stokehold::gen::classification(d.path(), &spec, &|_| {}).unwrap();
        (
            std::fs::read(d.path().join("x.npy")).unwrap(),
            std::fs::read(d.path().join("y.npy")).unwrap(),
        )
    };
    let pairs = [labels(1), labels(2)];
    for _ in 0..20 {
        let (a, b) = (gen("1"), gen("2"));
        assert!(a.join().unwrap().status.success());
        assert!(b.join().unwrap().status.success());
        let got = (
            std::fs::read(out.join("x.npy")).unwrap(),
            std::fs::read(out.join("y.npy")).unwrap(),
        );
        assert!(pairs.contains(&got), "x.npy and y.npy come from two runs");
    }
}

/// Run as a user who neither owns the dataset nor may write to it (a shared set on a
/// cluster), `mincore` reports every page of it cached (Linux 5.0 on): its residency is
/// shown as unknown, and epochs are planned as for cold data, not taken as warm ones.
#[test]
fn a_dataset_of_another_user_has_unknown_residency() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipping: running a command as another user needs root");
        return;
    }
    let perms = |p: &std::path::Path, mode| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    let data = tempfile::tempdir().unwrap();
    perms(data.path(), 0o755);
    for f in ["x.npy", "y.npy"] {
        let to = data.path().join(f);
        std::fs::copy(
            format!("{}/datasets/digits/{f}", env!("CARGO_MANIFEST_DIR")),
            &to,
        )
        .unwrap();
        perms(&to, 0o644);
    }
    let out = tempfile::tempdir().unwrap();
    perms(out.path(), 0o777);
    let json = out.path().join("run.json");
    // The binary beside the data, where that user may run it (the checkout may be in a
    // directory of root's own).
    let bin = data.path().join("stokehold");
    std::fs::copy(env!("CARGO_BIN_EXE_stokehold"), &bin).unwrap();
    perms(&bin, 0o755);
    let as_nobody = |args: &[&str]| {
        let out = Command::new(&bin)
            .args(args)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}:\n{text}{err}");
        text
    };
    let dir = data.path().to_str().unwrap();
    let shown = as_nobody(&["inspect", dir]);
    let x = shown.lines().find(|l| l.contains("x.npy")).unwrap();
    assert!(x.trim_end().ends_with('?'), "{shown}");
    let args = ["train", "--data", dir, "--epochs", "2", "--json"];
    as_nobody(&[&args[..], &[json.to_str().unwrap()]].concat());
    let report = read_json(&json);
    for e in report["epochs"].as_array().unwrap() {
        let r = &e["residency_start"];
        assert!(r["pages"].as_u64().unwrap() > 0, "{e}");
        assert_eq!(r["unknown"], r["pages"], "{e}");
        assert_ne!(e["storage"], "warm", "{e}");
    }
}
