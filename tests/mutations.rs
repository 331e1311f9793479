//! Damaged files of every format stokehold reads: each fixture (written by the format's
//! own writer) has bytes overwritten, length fields set to extreme values, numbers of
//! its JSON index changed, or its end cut off, thousands of times over, and is then
//! opened and read whole. Whatever comes of it must be a value or an `Error`: never a
//! panic, an abort (an allocation sized by a damaged field) or a read outside a file
//! (which the mapping would answer with `SIGBUS`/`SIGSEGV`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use stokehold::{DType, Dataset, Documents, LitData, NpyDataset, Packed, TokenDataset, Windows};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

/// Damaged copies made of each case (`STOKEHOLD_MUTATION_ROUNDS` for a longer run).
fn rounds() -> usize {
    std::env::var("STOKEHOLD_MUTATION_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(150)
}

/// Opens a set in a directory holding the case's files.
type Open = fn(&Path) -> stokehold::Result<Box<dyn Dataset>>;

struct Case {
    name: &'static str,
    /// The fixtures copied into the set's directory (relative to `tests/fixtures`),
    /// each under its file name.
    files: &'static [&'static str],
    open: Open,
}

fn boxed<D: Dataset + 'static>(d: stokehold::Result<D>) -> stokehold::Result<Box<dyn Dataset>> {
    d.map(|d| Box::new(d) as Box<dyn Dataset>)
}

const RANDOM: Windows = Windows::Random { seed: 3 };

fn case(name: &'static str, files: &'static [&'static str], open: Open) -> Case {
    Case { name, files, open }
}

fn cases() -> Vec<Case> {
    vec![
        case("npy columns", &["npy/pair_x.npy", "npy/pair_y.npy"], |d| {
            boxed(NpyDataset::open_columns([
                d.join("pair_x.npy"),
                d.join("pair_y.npy"),
            ]))
        }),
        case("npy, format 2.0", &["npy/good_v2_int64.npy"], |d| {
            boxed(NpyDataset::open(d.join("good_v2_int64.npy")))
        }),
        case("npy, 3-d", &["npy/good_3d.npy"], |d| {
            boxed(NpyDataset::open(d.join("good_3d.npy")))
        }),
        case("npy token stream", &["npy/tokens_u16.npy"], |d| {
            boxed(TokenDataset::open_npy(d.join("tokens_u16.npy"), 7, RANDOM))
        }),
        case("llm.c token file", &["npy/llmc_gpt2.bin"], |d| {
            let path = d.join("llmc_gpt2.bin");
            boxed(TokenDataset::open_bin(
                path,
                DType::U16,
                8,
                Windows::Consecutive,
            ))
        }),
        case("llm.c LLaMA-3 token file", &["npy/llmc_llama3.bin"], |d| {
            let path = d.join("llmc_llama3.bin");
            boxed(TokenDataset::open_bin(path, DType::U32, 4, RANDOM))
        }),
        case(
            "Megatron documents",
            &["npy/megatron_u16.bin", "npy/megatron_u16.idx"],
            |d| boxed(Documents::open_megatron(d.join("megatron_u16"), 16, 0)),
        ),
        case(
            "Megatron packed",
            &["npy/megatron_i32.bin", "npy/megatron_i32.idx"],
            |d| boxed(Packed::open_megatron(d.join("megatron_i32"), 7, RANDOM)),
        ),
        case(
            "fairseq documents",
            &["npy/fairseq_u32.bin", "npy/fairseq_u32.idx"],
            |d| boxed(Documents::open_megatron(d.join("fairseq_u32"), 16, 9)),
        ),
        case(
            "npy documents",
            &["npy/docs_tokens.npy", "npy/docs_offsets.npy"],
            |d| {
                let (t, o) = (d.join("docs_tokens.npy"), d.join("docs_offsets.npy"));
                boxed(Documents::open_npy(t, o, 50, 0))
            },
        ),
        case(
            "npy packed",
            &["npy/docs_tokens.npy", "npy/docs_offsets_u32.npy"],
            |d| {
                let (t, o) = (d.join("docs_tokens.npy"), d.join("docs_offsets_u32.npy"));
                boxed(Packed::open_npy(t, o, 7, Windows::Consecutive))
            },
        ),
        case(
            "Arrow stream (Hugging Face)",
            &["arrow/hf_stream.arrow"],
            |d| {
                boxed(Documents::open_arrow(
                    d.join("hf_stream.arrow"),
                    "input_ids",
                    16,
                    7,
                ))
            },
        ),
        case(
            "Arrow stream, fixed-size lists",
            &["arrow/hf_fixed.arrow"],
            |d| {
                boxed(Documents::open_arrow(
                    d.join("hf_fixed.arrow"),
                    "input_ids",
                    16,
                    7,
                ))
            },
        ),
        case(
            "Arrow file, mixed columns",
            &["arrow/mixed_file.arrow"],
            |d| {
                boxed(Packed::open_arrow(
                    d.join("mixed_file.arrow"),
                    "tokens",
                    7,
                    RANDOM,
                ))
            },
        ),
        case(
            "Arrow, format v4 with unions",
            &["arrow/v4_unions.arrow"],
            |d| {
                boxed(Documents::open_arrow(
                    d.join("v4_unions.arrow"),
                    "input_ids",
                    16,
                    7,
                ))
            },
        ),
        case(
            "MDS array columns",
            &[
                "mds/mds_tokens/index.json",
                "mds/mds_tokens/shard.00000.mds",
            ],
            |d| {
                boxed(Documents::open_mds(
                    d.join("shard.00000.mds"),
                    "tokens",
                    16,
                    7,
                ))
            },
        ),
        case(
            "MDS array columns, windows",
            &[
                "mds/mds_windows/index.json",
                "mds/mds_windows/shard.00000.mds",
            ],
            |d| {
                boxed(Packed::open_mds(
                    d.join("shard.00000.mds"),
                    "tokens",
                    7,
                    RANDOM,
                ))
            },
        ),
        case(
            "MDS bytes columns",
            &["mds/mds_bytes/index.json", "mds/mds_bytes/shard.00000.mds"],
            |d| {
                let shard = d.join("shard.00000.mds");
                boxed(Packed::open_mds_bytes(
                    shard,
                    "tokens",
                    DType::I64,
                    7,
                    RANDOM,
                ))
            },
        ),
        case(
            "LitData token chunks",
            &[
                "litdata/litdata_u16/index.json",
                "litdata/litdata_u16/chunk-0-0.bin",
                "litdata/litdata_u16/chunk-0-1.bin",
                "litdata/litdata_u16/chunk-0-2.bin",
            ],
            |d| boxed(LitData::open(d)?.windows(7, Windows::Consecutive)),
        ),
    ]
}

/// Reads every sample of `ds` (at most the first and last 64), in two epochs, with every
/// other call a dataset asks of it.
fn read_whole(ds: &dyn Dataset) -> stokehold::Result<()> {
    let n = ds.len();
    let row: usize = ds.columns().iter().map(|c| c.row_bytes).sum();
    if row > 1 << 20 {
        // Rows the file's size backs (checked at open) cannot be this large here.
        panic!("rows of {row} bytes from files of a few KiB");
    }
    let _ = ds.lengths()?;
    let _ = ds.fingerprint();
    let files = ds.files().len();
    let picks: Vec<u64> = (0..n.min(64))
        .chain(n.saturating_sub(64).max(64)..n)
        .collect();
    for epoch in [0, 7] {
        for &i in &picks {
            let mut bufs: Vec<Vec<u8>> =
                ds.columns().iter().map(|c| vec![0; c.row_bytes]).collect();
            let mut out: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            ds.gather(epoch, &[i], &mut out)?;
            ds.locate(epoch, i, &mut |file, _, _| {
                assert!(file < files, "file {file} of {files}")
            });
        }
    }
    Ok(())
}

/// One way of damaging `bytes` (of a file named `name`), described.
fn damage(rng: &mut Xoshiro256PlusPlus, name: &str, bytes: &mut Vec<u8>) -> String {
    let len = bytes.len();
    let json = name.ends_with(".json");
    match rng.random_range(0..if json { 6 } else { 5 }) {
        0 if len > 0 => {
            // A few bytes of the header.
            let end = len.min(600);
            let mut what = Vec::new();
            for _ in 0..rng.random_range(1..5) {
                let (at, b) = (rng.random_range(0..end), rng.random::<u8>());
                bytes[at] = b;
                what.push(format!("[{at}]={b}"));
            }
            format!("{name}: header bytes {}", what.join(" "))
        }
        1 if len > 0 => {
            let at = rng.random_range(0..len);
            let b = rng.random::<u8>();
            bytes[at] = b;
            format!("{name}: byte [{at}]={b}")
        }
        2 => {
            let to = rng.random_range(0..len.max(1));
            bytes.truncate(to);
            format!("{name}: cut to {to} bytes")
        }
        3 | 4 if len >= 8 => {
            // A length or offset field: an aligned word set to an extreme.
            let wide = rng.random_bool(0.5);
            let width = if wide { 8 } else { 4 };
            let at = rng.random_range(0..len / width) * width;
            let values: [u64; 7] = [0, 1, u64::MAX, i64::MAX as u64, 1 << 31, 1 << 40, 0xffff];
            let v = values[rng.random_range(0..values.len())];
            if wide {
                bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
            } else {
                bytes[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
            }
            format!("{name}: {width}-byte word at {at} = {v:#x}")
        }
        5 => {
            // A number of the JSON index.
            let text = String::from_utf8_lossy(bytes).into_owned();
            let numbers: Vec<(usize, usize)> = text
                .char_indices()
                .filter(|&(i, c)| {
                    c.is_ascii_digit() && (i == 0 || !text.as_bytes()[i - 1].is_ascii_digit())
                })
                .map(|(i, _)| {
                    let end = text[i..]
                        .find(|c: char| !c.is_ascii_digit())
                        .map_or(text.len(), |e| i + e);
                    (i, end)
                })
                .collect();
            if numbers.is_empty() {
                return format!("{name}: unchanged");
            }
            let (start, end) = numbers[rng.random_range(0..numbers.len())];
            let by = [
                "0",
                "1",
                "18446744073709551615",
                "99999999999999999999999",
                "-1",
                "1e300",
            ][rng.random_range(0..6)];
            let was = text[start..end].to_string();
            *bytes = format!("{}{by}{}", &text[..start], &text[end..]).into_bytes();
            format!("{name}: number {was} at {start} = {by}")
        }
        _ => format!("{name}: unchanged"),
    }
}

fn copy_case(case: &Case, dir: &Path) -> Vec<PathBuf> {
    case.files
        .iter()
        .map(|f| {
            let from = Path::new(FIXTURES).join(f);
            let to = dir.join(from.file_name().unwrap());
            std::fs::copy(&from, &to).unwrap();
            to
        })
        .collect()
}

#[test]
fn damaged_files_of_every_format_are_errors_or_data_never_crashes() {
    let mut failures = Vec::new();
    let (mut opened, mut refused) = (0usize, 0usize);
    for (c, case) in cases().iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let files = copy_case(case, dir.path());
        // The undamaged set opens and reads: the damage is what fails.
        let ds = (case.open)(dir.path()).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        read_whole(ds.as_ref()).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        drop(ds);
        let originals: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(0x5eed + c as u64);
        for round in 0..rounds() {
            let k = rng.random_range(0..files.len());
            let mut bytes = originals[k].clone();
            let name = files[k].file_name().unwrap().to_string_lossy().into_owned();
            let what = damage(&mut rng, &name, &mut bytes);
            std::fs::write(&files[k], &bytes).unwrap();
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                let ds = (case.open)(dir.path())?;
                read_whole(ds.as_ref())
            }));
            match outcome {
                Ok(Ok(())) => opened += 1,
                Ok(Err(e)) => {
                    refused += 1;
                    let text = e.to_string();
                    // The damaged file, or a file it leads to (an index naming a
                    // missing chunk), not merely the set's directory.
                    let inside = format!("{}/", dir.path().display());
                    if !text.contains(&name) && !text.contains(&inside) {
                        failures.push(format!(
                            "{} round {round} ({what}): the error names no file: {text}",
                            case.name
                        ));
                    }
                }
                Err(panic) => {
                    let text = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    failures.push(format!(
                        "{} round {round} ({what}): panicked: {text}",
                        case.name
                    ));
                }
            }
            std::fs::write(&files[k], &originals[k]).unwrap();
        }
    }
    println!("{opened} damaged sets read, {refused} refused");
    assert!(
        refused > 0 && opened > 0,
        "{opened} read, {refused} refused"
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
