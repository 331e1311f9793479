//! Variable-length documents: Megatron indexed datasets, `.npy` tokens with offsets,
//! Arrow list columns and MDS array columns, read in place, padded to `max_len`,
//! through the loader (fixtures in `tests/fixtures/npy`, written by
//! `python3 tests/fixtures/make_npy.py`, and in `tests/fixtures/{arrow,mds}`, written by
//! the formats' own writers).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use stokehold::{Dataset, Documents, Error, Loader, Shuffle, Windows};

mod common;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/npy");

fn fx(name: &str) -> PathBuf {
    Path::new(FIXTURES).join(name)
}

/// The fixtures' documents: 5, 0, 12, 3, 40 and 1 tokens, token `j` of document `i`
/// being `100 * i + j`.
fn docs() -> Vec<Vec<i64>> {
    [5, 0, 12, 3, 40, 1]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| 100 * i as i64 + j).collect())
        .collect()
}

/// Every sample of `ds` in file order through a loader with batches of 4: each row's
/// tokens as `i64` (read with `tok`) and its length.
fn rows(ds: Documents, tok: fn(&stokehold::HostBatch) -> Vec<i64>) -> Vec<(Vec<i64>, i64)> {
    let width = ds.max_len();
    let mut loader = Loader::builder(ds)
        .batch_size(4)
        .shuffle(Shuffle::None)
        .build()
        .unwrap();
    let mut out = Vec::new();
    for batch in loader.epoch(0).unwrap() {
        let batch = batch.unwrap();
        let tokens = tok(&batch);
        let lens = batch.column_named::<i64>("len").unwrap();
        for (k, &len) in lens.iter().enumerate() {
            out.push((tokens[k * width..(k + 1) * width].to_vec(), len));
        }
    }
    out
}

fn u16_tokens(b: &stokehold::HostBatch) -> Vec<i64> {
    let t = b.column_named::<u16>("tokens").unwrap();
    t.iter().map(|&x| i64::from(x)).collect()
}

fn i32_tokens(b: &stokehold::HostBatch) -> Vec<i64> {
    let t = b.column_named::<i32>("tokens").unwrap();
    t.iter().map(|&x| i64::from(x)).collect()
}

/// What a row of `doc` should hold: its first `max_len` tokens, then `pad`.
fn expected(doc: &[i64], max_len: usize, pad: i64) -> (Vec<i64>, i64) {
    let keep = doc.len().min(max_len);
    let mut row = doc[..keep].to_vec();
    row.resize(max_len, pad);
    (row, keep as i64)
}

#[test]
fn a_megatron_dataset_is_read_in_place_padded_and_cut() {
    // A multimodal index (a mode byte a sequence) of text only reads as any other.
    for name in [
        "megatron_u16",
        "megatron_u16.idx",
        "megatron_u16.bin",
        "megatron_text_modes",
    ] {
        let ds = Documents::open_megatron(fx(name), 16, 7).unwrap();
        assert_eq!(ds.len(), 6);
        assert_eq!((ds.tokens(), ds.longest(), ds.truncated()), (61, 40, 1));
        let names: Vec<&str> = ds.columns().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["tokens", "len"]);
        assert_eq!(ds.columns()[0].shape, [16]);
        assert_eq!(ds.length(4).unwrap(), 40);
        let got = rows(ds, u16_tokens);
        let want: Vec<_> = docs().iter().map(|d| expected(d, 16, 7)).collect();
        assert_eq!(got, want, "{name}");
    }
}

fn u32_tokens(b: &stokehold::HostBatch) -> Vec<i64> {
    let t = b.column_named::<u32>("tokens").unwrap();
    t.iter().map(|&x| i64::from(x)).collect()
}

#[test]
fn a_fairseq_dataset_is_told_apart_by_its_length() {
    let ds = Documents::open_megatron(fx("fairseq_u32"), 16, 9).unwrap();
    assert_eq!((ds.len(), ds.dtype()), (6, stokehold::DType::U32));
    let want: Vec<_> = docs()
        .iter()
        .map(|d| {
            let d: Vec<i64> = d.iter().map(|t| t * 100_000).collect();
            expected(&d, 16, 9)
        })
        .collect();
    assert_eq!(rows(ds, u32_tokens), want);
}

#[test]
fn int32_megatron_tokens_and_npy_offsets_give_the_same_rows() {
    // Sequences are the samples, whatever the document indices group.
    let ds = Documents::open_megatron(fx("megatron_i32"), 8, -1).unwrap();
    let want: Vec<_> = docs()
        .iter()
        .map(|d| {
            let d: Vec<i64> = d.iter().map(|t| t * 70000 - 5).collect();
            expected(&d, 8, -1)
        })
        .collect();
    assert_eq!(rows(ds, i32_tokens), want);
    for offsets in ["docs_offsets.npy", "docs_offsets_u32.npy"] {
        let ds = Documents::open_npy(fx("docs_tokens.npy"), fx(offsets), 50, 0).unwrap();
        assert_eq!((ds.len(), ds.truncated()), (6, 0));
        let want: Vec<_> = docs().iter().map(|d| expected(d, 50, 0)).collect();
        assert_eq!(rows(ds, i32_tokens), want, "{offsets}");
    }
}

fn arrow(name: &str) -> PathBuf {
    Path::new(FIXTURES).join("../arrow").join(name)
}

fn i8_tokens(b: &stokehold::HostBatch) -> Vec<i64> {
    let t = b.column_named::<i8>("tokens").unwrap();
    t.iter().map(|&x| i64::from(x)).collect()
}

#[test]
fn arrow_list_columns_are_read_in_place() {
    // As Hugging Face `datasets` writes a tokenised table: the stream format, record
    // batches of 4 rows, `input_ids` a list<int32> between other columns.
    let ds = Documents::open_arrow(arrow("hf_stream.arrow"), "input_ids", 16, 7).unwrap();
    assert_eq!(
        (ds.len(), ds.dtype(), ds.tokens()),
        (6, stokehold::DType::I32, 61)
    );
    assert_eq!(ds.files().len(), 1);
    let want: Vec<_> = docs().iter().map(|d| expected(d, 16, 7)).collect();
    assert_eq!(rows(ds, i32_tokens), want);
    let ds = Documents::open_arrow(arrow("hf_stream.arrow"), "attention_mask", 50, 0).unwrap();
    let ones: Vec<_> = docs()
        .iter()
        .map(|d| expected(&vec![1; d.len()], 50, 0))
        .collect();
    assert_eq!(rows(ds, i8_tokens), ones);
    // The file format, a large_list<uint16> after a struct, a dictionary, a string view,
    // a dense union and a null column, in record batches of 3 rows.
    let ds = Documents::open_arrow(arrow("mixed_file.arrow"), "tokens", 16, 7).unwrap();
    assert_eq!(ds.dtype(), stokehold::DType::U16);
    assert_eq!(rows(ds, u16_tokens), want);
    // Metadata version V4, a dense and a sparse union (each with a validity buffer then)
    // before the column.
    let ds = Documents::open_arrow(arrow("v4_unions.arrow"), "input_ids", 16, 7).unwrap();
    assert_eq!(rows(ds, i32_tokens), want);
    // Hugging Face's fixed-length sequences (a fixed_size_list<int32>[8], each document
    // cut or padded with 0 to 8), in record batches of 4 rows: served padded or cut.
    let fixed: Vec<Vec<i64>> = docs()
        .iter()
        .map(|d| {
            d.iter()
                .copied()
                .chain(std::iter::repeat(0))
                .take(8)
                .collect()
        })
        .collect();
    for max_len in [16, 5] {
        let ds = Documents::open_arrow(arrow("hf_fixed.arrow"), "input_ids", max_len, 7).unwrap();
        assert_eq!((ds.len(), ds.tokens()), (6, 48));
        let want: Vec<_> = fixed.iter().map(|d| expected(d, max_len, 7)).collect();
        assert_eq!(rows(ds, i32_tokens), want, "max_len {max_len}");
    }
    let packed = stokehold::Packed::open_arrow(
        arrow("hf_fixed.arrow"),
        "input_ids",
        7,
        Windows::Consecutive,
    )
    .unwrap();
    assert_eq!(packed.len(), 6);
    // Empty record batches among the others, and a struct nested 60 deep before the
    // column (pyarrow writes no deeper than 64; stokehold reads as deep).
    for name in ["empty_batches.arrow", "deep_struct.arrow"] {
        let ds = Documents::open_arrow(arrow(name), "input_ids", 16, 7).unwrap();
        assert_eq!(rows(ds, i32_tokens), want, "{name}");
    }
}

#[test]
fn bad_arrow_files_are_errors_naming_the_file() {
    for (name, column, problem) in [
        (
            "hf_stream.arrow",
            "labels",
            r#"no column "labels"; its columns are "text", "input_ids", "attention_mask""#,
        ),
        (
            "hf_stream.arrow",
            "text",
            r#"column "text" is not a list of integers"#,
        ),
        (
            "mixed_file.arrow",
            "meta",
            r#"column "meta" is not a list of integers"#,
        ),
        ("bad_floats.arrow", "input_ids", "is not a list of integers"),
        (
            "bad_compressed.arrow",
            "input_ids",
            "compressed record batches",
        ),
        (
            "bad_nulls.arrow",
            "input_ids",
            "has 1 null rows and 0 null tokens",
        ),
        (
            "bad_not_arrow.arrow",
            "input_ids",
            "not an Arrow IPC stream or file",
        ),
        ("bad_cut.arrow", "input_ids", "the end of the file"),
    ] {
        let err = Documents::open_arrow(arrow(name), column, 16, 0).unwrap_err();
        refused(err, name, problem);
    }
    // pyarrow pads a sliced batch's values to 8 bytes: record batch 0's 20 int8 masks
    // (documents of 5, 0, 12 and 3 tokens) take 24. A last offset moved into that
    // padding would serve it as tokens (pyarrow's own `validate(full=True)` refuses it).
    let mut bytes = std::fs::read(arrow("hf_stream.arrow")).unwrap();
    let offsets: Vec<u8> = [0i32, 5, 5, 17, 20]
        .iter()
        .flat_map(|o| o.to_le_bytes())
        .collect();
    let found: Vec<usize> = bytes
        .windows(offsets.len())
        .enumerate()
        .filter(|(_, w)| *w == offsets.as_slice())
        .map(|(at, _)| at)
        .collect();
    // input_ids' offsets, then attention_mask's.
    assert_eq!(found.len(), 2, "{found:?}");
    bytes[found[1] + 16..found[1] + 20].copy_from_slice(&23i32.to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let padded = dir.path().join("padded.arrow");
    std::fs::write(&padded, &bytes).unwrap();
    let err = Documents::open_arrow(&padded, "attention_mask", 50, 0).unwrap_err();
    refused(err, "padded.arrow", "record batch 0");
    // The same offsets into the int32 ids (80 bytes, no padding) are read as written.
    assert!(Documents::open_arrow(&padded, "input_ids", 50, 0).is_ok());
}

fn mds(name: &str) -> PathBuf {
    Path::new(FIXTURES).join("../mds").join(name)
}

fn u8_tokens(b: &stokehold::HostBatch) -> Vec<i64> {
    let t = b.column_named::<u8>("tokens").unwrap();
    t.iter().map(|&x| i64::from(x)).collect()
}

#[test]
fn mds_array_columns_are_read_in_place() {
    // As `streaming.MDSWriter` writes them (tests/fixtures/make_mds.py): the documents
    // but the empty one, with an int, a str and another array column, in two shards.
    let docs: Vec<Vec<i64>> = docs().into_iter().filter(|d| !d.is_empty()).collect();
    let want: Vec<_> = docs.iter().map(|d| expected(d, 16, 7)).collect();
    let shards = [("shard.00000.mds", 0..3), ("shard.00001.mds", 3..5)];
    for (shard, range) in shards.clone() {
        let ds = Documents::open_mds(mds("mds_tokens").join(shard), "tokens", 16, 7).unwrap();
        assert_eq!(
            (ds.len(), ds.dtype()),
            (range.len() as u64, stokehold::DType::U16)
        );
        assert_eq!(rows(ds, u16_tokens), want[range.clone()], "{shard}");
        let ds = Documents::open_mds(mds("mds_tokens").join(shard), "mask", 50, 0).unwrap();
        let ones: Vec<_> = docs[range]
            .iter()
            .map(|d| expected(&vec![1; d.len()], 50, 0))
            .collect();
        assert_eq!(rows(ds, u8_tokens), ones, "{shard}");
    }
    // LLM Foundry's concatenated windows: a fixed shape, so fixed-size samples.
    let ds = Documents::open_mds(mds("mds_windows/shard.00000.mds"), "tokens", 8, 0).unwrap();
    let stream: Vec<i64> = docs.concat();
    let windows: Vec<_> = stream.chunks_exact(8).map(|w| (w.to_vec(), 8)).collect();
    assert_eq!((ds.len(), ds.dtype()), (7, stokehold::DType::I32));
    assert_eq!(rows(ds, i32_tokens), windows);
    // A plain `ndarray` column: each sample names its type (int64 here) before its shape.
    let dynamic = mds("mds_dynamic/shard.00000.mds");
    let ds = Documents::open_mds(&dynamic, "tokens", 16, 7).unwrap();
    assert_eq!((ds.len(), ds.dtype()), (5, stokehold::DType::I64));
    let i64_tokens = |b: &stokehold::HostBatch| b.column_named::<i64>("tokens").unwrap().to_vec();
    assert_eq!(rows(ds, i64_tokens), want);
    // A sample of another type than the first's is refused, naming the sample.
    let mut bytes = std::fs::read(&dynamic).unwrap();
    let third = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    assert_eq!(bytes[third + 4], 65, "sample 2 starts with int64's code");
    bytes[third + 4] = 33;
    let dir = tempfile::tempdir().unwrap();
    let mixed = dir.path().join("mixed.mds");
    std::fs::write(&mixed, &bytes).unwrap();
    let err = Documents::open_mds(&mixed, "tokens", 16, 7).unwrap_err();
    refused(err, "mixed.mds", "sample 2");
    // Packed, each shard: its documents back to back.
    let packed = stokehold::Packed::open_mds(
        mds("mds_tokens/shard.00000.mds"),
        "tokens",
        7,
        Windows::Consecutive,
    )
    .unwrap();
    assert_eq!((packed.tokens(), packed.len()), (20, 2));
    let c = packed.columns();
    let (mut t, mut p) = (vec![0u8; 2 * c[0].row_bytes], vec![0u8; 2 * c[1].row_bytes]);
    packed.gather(0, &[0, 1], &mut [&mut t, &mut p]).unwrap();
    let got: Vec<i64> = t
        .chunks_exact(2)
        .map(|b| i64::from(u16::from_le_bytes([b[0], b[1]])))
        .collect();
    let first: Vec<i64> = docs[..3].concat();
    assert_eq!(got, [&first[0..8], &first[7..15]].concat());
}

#[test]
fn mds_bytes_columns_are_read_with_the_type_given() {
    // LLM Foundry's older token columns: each sample's int64 values as raw bytes.
    use stokehold::{DType, Packed};
    let docs: Vec<Vec<i64>> = docs().into_iter().filter(|d| !d.is_empty()).collect();
    let shard = mds("mds_bytes/shard.00000.mds");
    let ds = Documents::open_mds_bytes(&shard, "tokens", DType::I64, 16, 7).unwrap();
    assert_eq!((ds.len(), ds.dtype()), (5, DType::I64));
    let i64_tokens = |b: &stokehold::HostBatch| b.column_named::<i64>("tokens").unwrap().to_vec();
    let want: Vec<_> = docs.iter().map(|d| expected(d, 16, 7)).collect();
    assert_eq!(rows(ds, i64_tokens), want);
    let packed =
        Packed::open_mds_bytes(&shard, "tokens", DType::I64, 7, Windows::Consecutive).unwrap();
    assert_eq!(packed.tokens(), docs.concat().len() as u64);
    // An array column read with its own type, as without one.
    let ds = Documents::open_mds_bytes(
        mds("mds_tokens/shard.00000.mds"),
        "tokens",
        DType::U16,
        16,
        7,
    )
    .unwrap();
    assert_eq!(rows(ds, u16_tokens), want[..3]);
    for (name, dtype, problem) in [
        (
            "mds_bytes/shard.00000.mds",
            None,
            r#"column "tokens" is encoded as "bytes": give the integer type"#,
        ),
        (
            "mds_bytes/shard.00000.mds",
            Some(DType::F32),
            "give the integer type",
        ),
        (
            "mds_tokens/shard.00000.mds",
            Some(DType::I64),
            r#"column "tokens" holds uint16 values ("ndarray:uint16"), and int64 was asked for"#,
        ),
        (
            "mds_bytes_cut/shard.00000.mds",
            Some(DType::I64),
            "sample 2: its array lies outside the sample",
        ),
    ] {
        let err = match dtype {
            Some(d) => Documents::open_mds_bytes(mds(name), "tokens", d, 16, 0).unwrap_err(),
            None => Documents::open_mds(mds(name), "tokens", 16, 0).unwrap_err(),
        };
        refused(err, "shard.00000.mds", problem);
    }
}

#[test]
fn bad_mds_shards_are_errors_naming_the_file() {
    let tokens = "mds_tokens/shard.00000.mds";
    for (name, column, problem) in [
        (
            tokens,
            "labels",
            r#"no column "labels"; its columns are ["id", "mask", "text", "tokens"]"#,
        ),
        (
            tokens,
            "text",
            r#"column "text" is encoded as "str", not as an array of integers"#,
        ),
        (
            "mds_zstd/shard.00000.mds.zstd",
            "tokens",
            "a zstd-compressed shard: decompress it",
        ),
        ("mds_tokens/index.json", "tokens", "not an MDS shard"),
    ] {
        let err = Documents::open_mds(mds(name), column, 16, 0).unwrap_err();
        refused(err, name.rsplit('/').next().unwrap(), problem);
    }
    // Cut short, and a sample offset changed.
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(mds(tokens)).unwrap();
    let path = dir.path().join("cut.mds");
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    let err = Documents::open_mds(&path, "tokens", 16, 0).unwrap_err();
    refused(err, "cut.mds", "offsets rise");
    // A layout version streaming has not written.
    let key = br#""version": 2"#;
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    let mut v3 = bytes.clone();
    v3[at + key.len() - 1] = b'3';
    let path = dir.path().join("v3.mds");
    std::fs::write(&path, &v3).unwrap();
    let err = Documents::open_mds(&path, "tokens", 16, 0).unwrap_err();
    refused(
        err,
        "v3.mds",
        "an MDS shard of version 3: stokehold reads version 2",
    );
    // Shards of streaming's other codecs are named as such (by their magic).
    for (codec, magic) in [
        ("gzip", &b"\x1f\x8b\x08\x00"[..]),
        ("bz2", b"BZh9"),
        ("snappy", b"\xff\x06\x00\x00sNaPpY"),
    ] {
        let mut packed = magic.to_vec();
        packed.extend_from_slice(&bytes[..64]);
        let path = dir.path().join(format!("{codec}.mds"));
        std::fs::write(&path, &packed).unwrap();
        let err = Documents::open_mds(&path, "tokens", 16, 0).unwrap_err();
        refused(
            err,
            &format!("{codec}.mds"),
            &format!("a {codec}-compressed shard"),
        );
    }
    let mut bent = bytes.clone();
    bent[12] = bent[12].wrapping_add(1); // sample 2 starts a byte late: its sizes shift
    let path = dir.path().join("bent.mds");
    std::fs::write(&path, &bent).unwrap();
    let err = Documents::open_mds(&path, "tokens", 16, 0).unwrap_err();
    refused(
        err,
        "bent.mds",
        "sample 2: its array lies outside the sample",
    );
}

/// The error of opening a bad fixture, which must name `file` and say `problem`.
fn refused(err: Error, file: &str, problem: &str) {
    let Error::Dataset { path, .. } = &err else {
        panic!("{file}: not a dataset error: {err}");
    };
    assert!(path.ends_with(file), "{err} names {}", path.display());
    assert!(err.to_string().contains(problem), "{file}: {err}");
}

#[test]
fn bad_megatron_indexes_are_errors_naming_the_file() {
    for (name, problem) in [
        ("megatron_bad_magic", "not a Megatron or fairseq index"),
        ("megatron_bad_version", "version 2"),
        ("megatron_bad_float", "token type code 7"),
        (
            "megatron_bad_cut",
            "60 bytes, which fits neither layout for its header's 6 sequences",
        ),
        (
            "megatron_bad_pointer",
            "document 5 (1 tokens at byte 200) lies outside",
        ),
        ("megatron_bad_documents", "document index 2 is 3"),
        (
            "megatron_bad_modes",
            "a multimodal index: sequence 2 has mode 1, not text",
        ),
    ] {
        let err = Documents::open_megatron(fx(name), 16, 0).unwrap_err();
        refused(err, &format!("{name}.idx"), problem);
    }
    // A missing half names itself.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fx("megatron_u16.idx"), dir.path().join("half.idx")).unwrap();
    let err = Documents::open_megatron(dir.path().join("half"), 16, 0).unwrap_err();
    assert!(
        matches!(&err, Error::Io { path, .. } if path.ends_with("half.bin")),
        "{err}"
    );
    // A `.bin` that is not whole tokens.
    std::fs::write(dir.path().join("half.bin"), [0u8; 123]).unwrap();
    let err = Documents::open_megatron(dir.path().join("half"), 16, 0).unwrap_err();
    refused(
        err,
        "half.bin",
        "not a whole number of 2-byte uint16 tokens",
    );
}

#[test]
fn bad_offsets_are_errors_naming_the_file() {
    for (name, problem) in [
        ("docs_bad_falling.npy", "offset 2 is 4"),
        ("docs_bad_past.npy", "offset 2 is 62"),
        (
            "docs_bad_2d.npy",
            "a document offset list is a 1-d integer array",
        ),
        ("docs_bad_empty.npy", "no offsets"),
    ] {
        let err = Documents::open_npy(fx("docs_tokens.npy"), fx(name), 16, 0).unwrap_err();
        refused(err, name, problem);
    }
    let err = Documents::open_npy(fx("good_v1_float32.npy"), fx("docs_offsets.npy"), 16, 0);
    refused(
        err.unwrap_err(),
        "good_v1_float32.npy",
        "the documents' token stream is a 1-d integer array",
    );
}

#[test]
fn bad_settings_are_config_errors() {
    let open = |max_len, pad| Documents::open_megatron(fx("megatron_u16"), max_len, pad);
    for (max_len, pad, problem) in [
        (0, 0, "max_len 0"),
        (usize::MAX, 0, "out of range"),
        (16, -1, "pad -1 does not fit the uint16 tokens"),
        (16, 65536, "pad 65536"),
    ] {
        match open(max_len, pad) {
            Err(Error::Config(m)) => assert!(m.contains(problem), "{m}"),
            other => panic!("{max_len} {pad}: {other:?}"),
        }
    }
    assert!(open(16, 65535).is_ok());
}

#[test]
fn a_token_file_cut_after_opening_is_an_error_not_a_signal() {
    let dir = tempfile::tempdir().unwrap();
    for ext in ["bin", "idx"] {
        let to = dir.path().join(format!("d.{ext}"));
        std::fs::copy(fx(&format!("megatron_u16.{ext}")), to).unwrap();
    }
    let ds = Documents::open_megatron(dir.path().join("d"), 64, 0).unwrap();
    let bin = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("d.bin"))
        .unwrap();
    bin.set_len(10).unwrap();
    let mut tokens = vec![0u8; 6 * 128];
    let mut lens = vec![0u8; 6 * 8];
    let err = ds
        .gather(0, &[0, 1, 2, 3, 4, 5], &mut [&mut tokens, &mut lens])
        .unwrap_err();
    assert!(err.to_string().contains("d.bin"), "{err}");
    let err = ds
        .gather(0, &[6], &mut [&mut tokens, &mut lens])
        .unwrap_err();
    assert!(
        matches!(err, Error::OutOfRange { index: 6, len: 6 }),
        "{err}"
    );
}

/// A set of `n` documents of pseudo-random lengths up to 3000 `uint16` tokens, written
/// as a Megatron dataset under `dir`; returns its prefix and the documents.
fn write_megatron(dir: &Path, n: usize) -> (PathBuf, Vec<Vec<u16>>) {
    let docs = common::random_documents(n, 3000, 0x9e37_79b9_7f4a_7c15);
    (common::write_megatron(dir, &docs, false), docs)
}

#[test]
fn shuffled_and_streamed_epochs_serve_each_document_once_and_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (prefix, docs) = write_megatron(dir.path(), 1500);
    let max_len = 2048;
    let check = |loader: &mut Loader, epoch: u64, cold: bool| {
        // Evicted where eviction works (not on tmpfs): the epoch then streams.
        let evicted = cold && {
            let ds = loader.dataset().as_ref();
            stokehold::pagecache::evict(ds).unwrap();
            stokehold::pagecache::residency(ds).unwrap().fraction() < 0.5
        };
        if cold && !evicted {
            stokehold::testing::skip_cold("the page cache cannot be evicted here: not streamed");
        }
        let mut seen = HashSet::new();
        let mut it = loader.epoch(epoch).unwrap();
        for batch in it.by_ref() {
            let batch = batch.unwrap();
            let tokens = batch.column_named::<u16>("tokens").unwrap();
            let lens = batch.column_named::<i64>("len").unwrap();
            for (k, &i) in batch.indices().iter().enumerate() {
                assert!(seen.insert(i), "document {i} twice");
                let d = &docs[i as usize];
                let keep = d.len().min(max_len);
                let row = &tokens[k * max_len..(k + 1) * max_len];
                assert_eq!(lens[k], keep as i64);
                assert_eq!(&row[..keep], &d[..keep], "document {i}");
                assert!(
                    row[keep..].iter().all(|&t| t == 0),
                    "document {i}'s padding"
                );
            }
        }
        assert_eq!(seen.len(), docs.len());
        if evicted {
            assert_eq!(it.stats().storage, stokehold::Storage::Streaming);
        }
    };
    // Warm, then streamed under a zero page-cache budget (planned reads through the page
    // cache: padded rows are not the ranges `locate` gives, so never direct reads).
    for budget in [None, Some(0)] {
        let mut b = Loader::builder(Documents::open_megatron(&prefix, max_len, 0).unwrap())
            .batch_size(64)
            .shuffle(Shuffle::Full { seed: 3 })
            .workers(2);
        if let Some(bytes) = budget {
            b = b.page_cache_budget(bytes);
        }
        let mut loader = b.build().unwrap();
        for epoch in 0..2 {
            check(&mut loader, epoch, budget.is_some());
        }
    }
}

/// The share of a batch's tokens that is padding once the batch is cut to its longest
/// row (what a model pays), over an epoch.
fn padding(loader: &mut Loader, epoch: u64) -> f64 {
    let (mut pad, mut total) = (0i64, 0i64);
    for batch in loader.epoch(epoch).unwrap() {
        let lens = batch.unwrap().column_named::<i64>("len").unwrap().to_vec();
        let width = lens.iter().copied().max().unwrap_or(0);
        pad += lens.iter().map(|&l| width - l).sum::<i64>();
        total += width * lens.len() as i64;
    }
    pad as f64 / total.max(1) as f64
}

#[test]
fn a_grouped_shuffle_batches_similar_lengths_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let (prefix, docs) = write_megatron(dir.path(), 1500);
    let open = || Documents::open_megatron(&prefix, 2048, 0).unwrap();
    let build = |shuffle, shard: stokehold::Shard| {
        Loader::builder(open())
            .batch_size(32)
            .shard(shard)
            .shuffle(shuffle)
            .build()
            .unwrap()
    };
    let single = stokehold::Shard::single();
    let grouped = Shuffle::Grouped {
        seed: 5,
        group: 320,
    };
    let mut full = build(Shuffle::Full { seed: 5 }, single);
    let mut by_length = build(grouped, single);
    let (f, g) = (padding(&mut full, 0), padding(&mut by_length, 0));
    println!("padding: full shuffle {f:.3}, grouped {g:.3}");
    assert!(g < f / 4.0, "grouped {g} against full {f}");
    // Each document once per epoch, epochs differ.
    let ids = |loader: &mut Loader, epoch| -> Vec<u64> {
        let it = loader.epoch(epoch).unwrap();
        it.flat_map(|b| b.unwrap().indices().to_vec()).collect()
    };
    let (a, b) = (ids(&mut by_length, 1), ids(&mut by_length, 2));
    assert_ne!(a, b);
    let mut sorted = a.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..docs.len() as u64).collect::<Vec<_>>());
    // An exact resume.
    let state = {
        let mut it = by_length.epoch(3).unwrap();
        it.nth(7).unwrap().unwrap();
        it.state()
    };
    let mut resumed = Loader::builder(open())
        .batch_size(32)
        .shuffle(grouped)
        .resume(state)
        .build()
        .unwrap();
    let rest = ids(&mut resumed, 3);
    assert_eq!(rest, ids(&mut by_length, 3)[8 * 32..]);
    // An elastic one: two ranks take 5 batches each, three ranks take the rest.
    let shard = |rank, world| stokehold::Shard::new(rank, world).unwrap();
    let mut taken = Vec::new();
    let mut saved = None;
    for rank in 0..2 {
        let mut loader = build(grouped, shard(rank, 2));
        let mut it = loader.epoch(4).unwrap();
        for _ in 0..5 {
            taken.extend_from_slice(it.next().unwrap().unwrap().indices());
        }
        saved = Some(it.state());
    }
    for rank in 0..3 {
        let mut loader = Loader::builder(open())
            .batch_size(32)
            .shard(shard(rank, 3))
            .shuffle(grouped)
            .resume_elastic(saved.unwrap())
            .build()
            .unwrap();
        taken.extend(ids(&mut loader, 4));
    }
    // Each document taken, none lost; the three new ranks pad their 1,180 documents
    // left to 3 x 394, with 2 documents taken again, and take nothing else twice.
    taken.sort_unstable();
    let again = taken.len() - docs.len();
    taken.dedup();
    let want: Vec<u64> = (0..docs.len() as u64).collect();
    assert!(taken == want, "a document lost");
    assert_eq!(again, 2, "documents taken twice beyond the padding");
    // Fixed-size samples have no lengths to group by.
    let digits = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let npy = stokehold::NpyDataset::open(digits).unwrap();
    let err = Loader::builder(npy).shuffle(grouped).build().err().unwrap();
    assert!(err.to_string().contains("has none"), "{err}");
}

#[test]
fn example_09_cuts_the_padding_by_grouping() {
    let example = Path::new(&std::env::current_exe().unwrap())
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples/09_documents");
    assert!(
        example.exists(),
        "{} is not built: `cargo test` builds the examples, or `cargo build --examples`",
        example.display()
    );
    let out = std::process::Command::new(&example).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let share = |name: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap();
        let pct = line
            .rsplit(", ")
            .next()
            .unwrap()
            .trim_end_matches("% padding");
        pct.parse().unwrap_or_else(|_| panic!("{line}"))
    };
    let (full, grouped) = (share("full shuffle:"), share("grouped:"));
    assert!(grouped < full / 2.0, "{text}");
    // Packed: every token but a tail shorter than a window, and (nearly) every
    // document's start marked in the positions.
    let packed = text.lines().find(|l| l.contains("packed:")).unwrap();
    let numbers: Vec<u64> = packed
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    let [seen, window, starts, documents, left] = numbers[..] else {
        panic!("{packed}");
    };
    assert_eq!((window, documents), (2048, 20_000), "{packed}");
    assert!(left <= window && seen % window == 0, "{packed}");
    assert!(
        starts <= documents && starts > documents * 99 / 100,
        "{packed}"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// An Arrow file or an MDS shard (array or bytes columns) with bytes changed or cut short anywhere opens or
    /// is refused, and one that opens serves its rows (or errors): never a panic.
    #[test]
    fn damaged_arrow_and_mds_files_never_panic(
        name in proptest::sample::select(vec![
            "arrow/hf_stream.arrow",
            "arrow/mixed_file.arrow",
            "arrow/hf_fixed.arrow",
            "mds/mds_tokens/shard.00000.mds",
            "mds/mds_windows/shard.00000.mds",
            "mds/mds_dynamic/shard.00000.mds",
            "mds/mds_bytes/shard.00000.mds",
        ]),
        edits in proptest::collection::vec((0usize..5000, proptest::num::u8::ANY), 1..6),
        cut in proptest::option::of(0usize..5000),
    ) {
        let mut bytes = std::fs::read(Path::new(FIXTURES).join("..").join(name)).unwrap();
        for (at, value) in edits {
            let n = bytes.len();
            bytes[at % n] = value;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut % (bytes.len() + 1));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("damaged");
        std::fs::write(&path, &bytes).unwrap();
        let column = if name.ends_with("hf_stream.arrow") { "input_ids" } else { "tokens" };
        let mds = name.ends_with(".mds");
        // The bytes shard's int64 values, read with their type given.
        let raw = name.contains("mds_bytes").then_some(stokehold::DType::I64);
        let documents = match (mds, raw) {
            (true, Some(d)) => Documents::open_mds_bytes(&path, column, d, 64, 0),
            (true, None) => Documents::open_mds(&path, column, 64, 0),
            (false, _) => Documents::open_arrow(&path, column, 64, 0),
        };
        if let Ok(ds) = documents {
            let n = ds.len().min(64);
            let mut tokens = vec![0u8; 64 * 64 * ds.dtype().size()];
            let mut lens = vec![0u8; 64 * 8];
            let all: Vec<u64> = (0..n).collect();
            let _ = ds.gather(0, &all, &mut [&mut tokens, &mut lens]);
            let packed = match (mds, raw) {
                (true, Some(d)) => {
                    stokehold::Packed::open_mds_bytes(&path, column, d, 4, Windows::Consecutive)
                }
                (true, None) => stokehold::Packed::open_mds(&path, column, 4, Windows::Consecutive),
                (false, _) => stokehold::Packed::open_arrow(&path, column, 4, Windows::Consecutive),
            };
            if let Ok(p) = packed {
                let n = p.len().min(64);
                let width = p.columns()[0].row_bytes;
                let (mut t, mut q) = (vec![0u8; 64 * width], vec![0u8; 64 * 20]);
                let all: Vec<u64> = (0..n).collect();
                let _ = p.gather(0, &all, &mut [&mut t, &mut q]);
            }
        }
    }
}

#[test]
fn shards_concatenated_stream_shuffle_and_group_as_one_set() {
    let dir = tempfile::tempdir().unwrap();
    let (mut parts, mut all) = (Vec::new(), Vec::new());
    for k in 0..3 {
        let shard = dir.path().join(format!("s{k}"));
        std::fs::create_dir(&shard).unwrap();
        let docs = common::random_documents(400, 700, 11 + k);
        let prefix = common::write_megatron(&shard, &docs, k == 1);
        let part: std::sync::Arc<dyn Dataset> =
            std::sync::Arc::new(Documents::open_megatron(prefix, 512, 0).unwrap());
        parts.push(part);
        all.extend(docs);
    }
    let set = std::sync::Arc::new(stokehold::Concat::new(parts).unwrap());
    assert_eq!((set.len(), set.files().len()), (1200, 6));
    for (shuffle, budget) in [
        (Shuffle::Full { seed: 1 }, Some(0)),
        (Shuffle::Grouped { seed: 2, group: 64 }, None),
    ] {
        let mut b = Loader::builder(set.clone())
            .batch_size(16)
            .shuffle(shuffle)
            .workers(2);
        if let Some(bytes) = budget {
            b = b.page_cache_budget(bytes);
        }
        let mut loader = b.build().unwrap();
        let mut seen = HashSet::new();
        for batch in loader.epoch(0).unwrap() {
            let batch = batch.unwrap();
            let tokens = batch.column_named::<u16>("tokens").unwrap();
            let lens = batch.column_named::<i64>("len").unwrap();
            for (k, &i) in batch.indices().iter().enumerate() {
                assert!(seen.insert(i), "document {i} twice");
                let d = &all[i as usize];
                let keep = d.len().min(512);
                assert_eq!(lens[k], keep as i64);
                assert_eq!(&tokens[k * 512..k * 512 + keep], &d[..keep], "document {i}");
            }
        }
        assert_eq!(seen.len(), 1200);
    }
}

#[test]
fn fingerprints_cover_the_column_and_how_documents_become_rows() {
    use stokehold::{LoaderState, Packed};
    let hf = arrow("hf_stream.arrow");
    let docs = |column, max_len, pad| Documents::open_arrow(&hf, column, max_len, pad).unwrap();
    let base = docs("input_ids", 8, 0).fingerprint();
    assert_eq!(base, docs("input_ids", 8, 0).fingerprint());
    for (what, other) in [
        ("the column", docs("attention_mask", 8, 0).fingerprint()),
        ("max_len", docs("input_ids", 4, 0).fingerprint()),
        ("pad", docs("input_ids", 8, -1).fingerprint()),
    ] {
        assert_ne!(base, other, "{what} is not in the fingerprint");
    }
    let packed = |column| {
        Packed::open_arrow(&hf, column, 4, Windows::Random { seed: 1 })
            .unwrap()
            .fingerprint()
    };
    assert_ne!(packed("input_ids"), packed("attention_mask"));
    // As many samples either way (a mask has a token for each id): a state saved over
    // one column is refused by a loader over the other, not resumed into its rows.
    let loader = |column| {
        let ds = Packed::open_arrow(&hf, column, 4, Windows::Random { seed: 1 }).unwrap();
        Loader::builder(ds)
            .batch_size(2)
            .shuffle(Shuffle::Full { seed: 0 })
    };
    let state: LoaderState = {
        let mut l = loader("input_ids").build().unwrap();
        let mut it = l.epoch(0).unwrap();
        it.next().unwrap().unwrap();
        it.state()
    };
    let err = loader("attention_mask").resume(state).build().unwrap_err();
    assert!(err.to_string().contains("another order"), "{err}");
    let mds_bytes = |dtype| {
        stokehold::Documents::open_mds_bytes(
            mds("mds_bytes/shard.00000.mds"),
            "tokens",
            dtype,
            16,
            0,
        )
        .unwrap()
        .fingerprint()
    };
    assert_ne!(
        mds_bytes(stokehold::DType::I64),
        mds_bytes(stokehold::DType::U64)
    );
}
