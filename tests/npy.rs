//! Integration tests over NumPy-written `.npy` fixtures (see `tests/fixtures/npy/README.md`;
//! regenerate with `python3 tests/fixtures/make_npy.py`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use stokehold::{DType, Dataset, Error, NpyArray, NpyDataset, NpyProblem, TokenDataset, Windows};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/npy/");

fn fx(name: &str) -> PathBuf {
    Path::new(FIXTURES).join(name)
}

const ALL_DTYPES: [(&str, DType); 12] = [
    ("bool", DType::Bool),
    ("uint8", DType::U8),
    ("int8", DType::I8),
    ("uint16", DType::U16),
    ("int16", DType::I16),
    ("uint32", DType::U32),
    ("int32", DType::I32),
    ("uint64", DType::U64),
    ("int64", DType::I64),
    ("float16", DType::F16),
    ("float32", DType::F32),
    ("float64", DType::F64),
];

/// IEEE half-precision bits of a small non-negative integer (exact for n < 2048).
fn f16_bits(n: u32) -> u16 {
    if n == 0 {
        return 0;
    }
    let e = 31 - n.leading_zeros(); // floor(log2 n)
    let mantissa = (n - (1 << e)) << (10 - e);
    (((e + 15) << 10) | mantissa) as u16
}

/// Little-endian bytes of the integer `v` stored as `dtype`.
fn le_bytes(dtype: DType, v: i64) -> Vec<u8> {
    match dtype {
        DType::Bool => vec![(v % 2) as u8],
        DType::U8 => vec![v as u8],
        DType::I8 => (v as i8).to_le_bytes().to_vec(),
        DType::U16 => (v as u16).to_le_bytes().to_vec(),
        DType::I16 => (v as i16).to_le_bytes().to_vec(),
        DType::U32 => (v as u32).to_le_bytes().to_vec(),
        DType::I32 => (v as i32).to_le_bytes().to_vec(),
        DType::U64 => (v as u64).to_le_bytes().to_vec(),
        DType::I64 => v.to_le_bytes().to_vec(),
        DType::F16 => f16_bits(v as u32).to_le_bytes().to_vec(),
        DType::F32 => (v as f32).to_le_bytes().to_vec(),
        DType::F64 => (v as f64).to_le_bytes().to_vec(),
    }
}

/// The data of the (5, 3) files: `arange(15)` cast to `dtype` (bool: `arange % 2`).
fn arange_bytes(dtype: DType, n: i64) -> Vec<u8> {
    (0..n).flat_map(|v| le_bytes(dtype, v)).collect()
}

/// Opens a broken fixture, checks the error is `Error::Npy` naming the file, returns the problem.
fn npy_problem(name: &str) -> NpyProblem {
    let path = fx(name);
    let result =
        catch_unwind(|| NpyArray::open(&path)).unwrap_or_else(|_| panic!("{name}: open panicked"));
    let err = match result {
        Ok(a) => panic!(
            "{name}: opened (shape {:?}, dtype {:?}), expected an error",
            a.shape(),
            a.dtype()
        ),
        Err(e) => e,
    };
    let msg = err.to_string();
    assert!(
        msg.contains(name),
        "{name}: message does not name the file: {msg}"
    );
    match err {
        Error::Npy { path: p, problem } => {
            assert_eq!(p, path, "{name}: error path");
            problem
        }
        other => panic!("{name}: expected Error::Npy, got {other:?}"),
    }
}

/// Gathers `indices` of `epoch` into one freshly allocated buffer per column.
fn gather(ds: &dyn Dataset, epoch: u64, indices: &[u64]) -> stokehold::Result<Vec<Vec<u8>>> {
    let mut bufs: Vec<Vec<u8>> = ds
        .columns()
        .iter()
        .map(|c| vec![0xAAu8; c.row_bytes * indices.len()])
        .collect();
    {
        let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        ds.gather(epoch, indices, &mut outs)?;
    }
    Ok(bufs)
}

fn u16s(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

// ------------------------------------------------------------------------------------
// Good files
// ------------------------------------------------------------------------------------

#[test]
fn f16_helper_matches_known_bits() {
    assert_eq!(f16_bits(1), 0x3c00);
    assert_eq!(f16_bits(2), 0x4000);
    assert_eq!(f16_bits(3), 0x4200);
    assert_eq!(f16_bits(14), 0x4b00);
}

#[test]
fn every_dtype_opens_with_exact_data() {
    for (name, dtype) in ALL_DTYPES {
        let file = format!("good_v1_{name}.npy");
        let a = NpyArray::open(fx(&file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(a.dtype(), dtype, "{file}");
        assert_eq!(a.shape(), &[5, 3], "{file}");
        assert_eq!(a.rows(), 5, "{file}");
        assert_eq!(a.row_bytes(), 3 * dtype.size(), "{file}");
        assert_eq!(a.header().version, (1, 0), "{file}");
        let expected = arange_bytes(dtype, 15);
        assert_eq!(a.data(), expected.as_slice(), "{file}: data bytes");
        let rb = a.row_bytes();
        for i in 0..5u64 {
            let row = a.row(i).unwrap_or_else(|e| panic!("{file} row {i}: {e}"));
            assert_eq!(
                row,
                &expected[i as usize * rb..(i as usize + 1) * rb],
                "{file} row {i}"
            );
        }
        assert!(
            matches!(a.row(5), Err(Error::OutOfRange { index: 5, len: 5 })),
            "{file}: row(5) = {:?}",
            a.row(5)
        );
        assert!(
            matches!(a.row(u64::MAX), Err(Error::OutOfRange { .. })),
            "{file}: row(u64::MAX)"
        );
    }
}

#[test]
fn format_versions_1_2_3() {
    for (file, version, dtype) in [
        ("good_v1_float32.npy", (1, 0), DType::F32),
        ("good_v2_float32.npy", (2, 0), DType::F32),
        ("good_v3_float32.npy", (3, 0), DType::F32),
        ("good_v2_int64.npy", (2, 0), DType::I64),
        ("good_v3_uint8.npy", (3, 0), DType::U8),
    ] {
        let a = NpyArray::open(fx(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(a.header().version, version, "{file}");
        assert_eq!(a.dtype(), dtype, "{file}");
        assert_eq!(a.shape(), &[5, 3], "{file}");
        assert_eq!(a.data(), arange_bytes(dtype, 15).as_slice(), "{file}");
        assert_eq!(
            a.row(4).unwrap(),
            &arange_bytes(dtype, 15)[12 * dtype.size()..],
            "{file}"
        );
    }
}

#[test]
fn one_dimensional() {
    let a = NpyArray::open(fx("good_1d.npy")).unwrap();
    assert_eq!(a.dtype(), DType::I32);
    assert_eq!(a.shape(), &[7]);
    assert_eq!(a.rows(), 7);
    assert_eq!(a.row_bytes(), 4);
    assert_eq!(a.data(), arange_bytes(DType::I32, 7).as_slice());
    assert_eq!(a.row(6).unwrap(), &6i32.to_le_bytes());
    assert!(matches!(
        a.row(7),
        Err(Error::OutOfRange { index: 7, len: 7 })
    ));
}

#[test]
fn three_dimensional() {
    let a = NpyArray::open(fx("good_3d.npy")).unwrap();
    assert_eq!(a.dtype(), DType::F64);
    assert_eq!(a.shape(), &[4, 2, 3]);
    assert_eq!(a.rows(), 4);
    assert_eq!(a.row_bytes(), 2 * 3 * 8);
    assert_eq!(a.data(), arange_bytes(DType::F64, 24).as_slice());
    let row2: Vec<u8> = (12..18).flat_map(|v| (v as f64).to_le_bytes()).collect();
    assert_eq!(a.row(2).unwrap(), row2.as_slice());
    assert!(matches!(
        a.row(4),
        Err(Error::OutOfRange { index: 4, len: 4 })
    ));
}

#[test]
fn zero_rows_array_opens() {
    let a = NpyArray::open(fx("good_zero_rows.npy")).unwrap();
    assert_eq!(a.dtype(), DType::F32);
    assert_eq!(a.shape(), &[0, 3]);
    assert_eq!(a.rows(), 0);
    assert_eq!(a.row_bytes(), 12);
    assert!(a.data().is_empty());
    assert!(matches!(
        a.row(0),
        Err(Error::OutOfRange { index: 0, len: 0 })
    ));
}

#[test]
fn zero_width_rows_array_opens() {
    let a = NpyArray::open(fx("good_zero_cols.npy")).unwrap();
    assert_eq!(a.dtype(), DType::F32);
    assert_eq!(a.shape(), &[3, 0]);
    assert_eq!(a.rows(), 3);
    assert_eq!(a.row_bytes(), 0);
    assert!(a.data().is_empty());
    assert_eq!(a.row(2).unwrap(), &[] as &[u8]);
    assert!(matches!(
        a.row(3),
        Err(Error::OutOfRange { index: 3, len: 3 })
    ));
}

// ------------------------------------------------------------------------------------
// Broken files
// ------------------------------------------------------------------------------------

#[test]
fn bad_magic() {
    assert!(matches!(npy_problem("bad_magic.npy"), NpyProblem::BadMagic));
}

#[test]
fn empty_file_is_bad_magic() {
    assert!(matches!(npy_problem("bad_empty.npy"), NpyProblem::BadMagic));
}

#[test]
fn unknown_version() {
    let p = npy_problem("bad_version.npy");
    assert!(matches!(p, NpyProblem::Version(9, 0)), "{p:?}");
}

#[test]
fn header_that_does_not_parse() {
    let p = npy_problem("bad_header.npy");
    assert!(matches!(p, NpyProblem::Header(_)), "{p:?}");
}

#[test]
fn file_cut_inside_header() {
    let p = npy_problem("bad_header_cut.npy");
    assert!(matches!(p, NpyProblem::Header(_)), "{p:?}");
    let p = npy_problem("bad_len_cut.npy");
    assert!(matches!(p, NpyProblem::Header(_)), "{p:?}");
}

#[test]
fn fortran_order() {
    let p = npy_problem("bad_fortran.npy");
    assert!(matches!(p, NpyProblem::FortranOrder), "{p:?}");
}

#[test]
fn big_endian() {
    let p = npy_problem("bad_big_endian.npy");
    assert!(
        matches!(&p, NpyProblem::BigEndian(d) if d == ">f4"),
        "{p:?}"
    );
}

#[test]
fn object_dtype() {
    let p = npy_problem("bad_object.npy");
    assert!(matches!(p, NpyProblem::DType(_)), "{p:?}");
}

#[test]
fn structured_dtype() {
    let p = npy_problem("bad_structured.npy");
    assert!(matches!(p, NpyProblem::DType(_)), "{p:?}");
}

#[test]
fn zero_dim() {
    let p = npy_problem("bad_zero_dim.npy");
    assert!(matches!(p, NpyProblem::ZeroDim), "{p:?}");
}

#[test]
fn shape_overflows_64_bits() {
    let p = npy_problem("bad_overflow.npy");
    assert!(matches!(p, NpyProblem::Overflow(_)), "{p:?}");
    let p = npy_problem("bad_overflow_dim.npy");
    assert!(matches!(p, NpyProblem::Overflow(_)), "{p:?}");
}

#[test]
fn shape_larger_than_file() {
    let p = npy_problem("bad_shape_too_big.npy");
    assert!(
        matches!(
            p,
            NpyProblem::Truncated {
                expected: 6000,
                actual: 60
            }
        ),
        "{p:?}"
    );
}

#[test]
fn truncated_data() {
    let p = npy_problem("bad_truncated.npy");
    assert!(
        matches!(
            p,
            NpyProblem::Truncated {
                expected: 60,
                actual: 56
            }
        ),
        "{p:?}"
    );
}

#[test]
fn trailing_bytes() {
    let p = npy_problem("bad_trailing.npy");
    assert!(matches!(p, NpyProblem::TrailingBytes { extra: 7 }), "{p:?}");
}

#[test]
fn missing_file_is_io_error_naming_it() {
    let path = fx("does_not_exist.npy");
    let err = NpyArray::open(&path).unwrap_err();
    assert!(err.to_string().contains("does_not_exist.npy"), "{err}");
    assert!(
        matches!(&err, Error::Io { path: p, .. } if *p == path),
        "{err:?}"
    );
}

#[test]
fn every_fixture_opens_or_errors_without_panicking() {
    let mut seen = 0;
    for entry in std::fs::read_dir(FIXTURES).unwrap() {
        let path = entry.unwrap().path();
        if !matches!(path.extension(), Some(e) if e == "npy") {
            continue;
        }
        seen += 1;
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let result =
            catch_unwind(|| NpyArray::open(&path)).unwrap_or_else(|_| panic!("{name}: panicked"));
        match result {
            Ok(a) => {
                assert!(!name.starts_with("bad_"), "{name} opened");
                assert_eq!(
                    a.data().len() as u64,
                    a.rows() * a.row_bytes() as u64,
                    "{name}"
                );
            }
            Err(e) => {
                assert!(name.starts_with("bad_"), "{name}: {e}");
                assert!(e.to_string().contains(&name), "{name}: {e}");
            }
        }
    }
    assert!(seen >= 40, "only {seen} fixtures found");
}

/// Checks that opening `bytes` (written to a temp file) never panics, that errors name
/// the file, and that an array that opens is self-consistent. Returns whether it opened.
fn opens_without_panic(dir: &Path, name: &str, bytes: &[u8]) -> bool {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let result = catch_unwind(AssertUnwindSafe(|| {
        NpyArray::open(&path).map(|a| {
            assert_eq!(a.data().len() as u64, a.rows() * a.row_bytes() as u64);
            for i in 0..a.rows() {
                assert_eq!(a.row(i).unwrap().len(), a.row_bytes());
            }
            assert!(a.row(a.rows()).is_err());
        })
    }))
    .unwrap_or_else(|_| panic!("{name}: panicked on {} bytes", bytes.len()));
    match result {
        Ok(()) => true,
        Err(e) => {
            assert!(e.to_string().contains(name), "{name}: {e}");
            false
        }
    }
}

#[test]
fn every_prefix_and_header_byte_corruption_is_handled() {
    let dir = tempfile::tempdir().unwrap();
    for file in [
        "good_v1_float32.npy",
        "good_v2_int64.npy",
        "good_v3_uint8.npy",
        "good_1d.npy",
    ] {
        let bytes = std::fs::read(fx(file)).unwrap();
        // Every strict prefix is an error, the whole file opens.
        for n in 0..bytes.len() {
            assert!(
                !opens_without_panic(dir.path(), "prefix.npy", &bytes[..n]),
                "{file}: a {n}-byte prefix opened"
            );
        }
        assert!(opens_without_panic(dir.path(), "prefix.npy", &bytes));
        // Any header byte replaced by any of a few values: no panic.
        let header_end = bytes.len() - NpyArray::open(fx(file)).unwrap().data().len();
        for i in 0..header_end {
            for v in [0u8, b' ', b'(', b')', b',', b'9', b'\'', b'[', 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] = v;
                opens_without_panic(dir.path(), "corrupt.npy", &b);
            }
        }
    }
}

// ------------------------------------------------------------------------------------
// NpyDataset
// ------------------------------------------------------------------------------------

#[test]
fn pair_dataset_columns_and_gather() {
    let ds = NpyDataset::open_columns([fx("pair_x.npy"), fx("pair_y.npy")]).unwrap();
    assert_eq!(ds.len(), 6);
    let cols = ds.columns();
    assert_eq!(cols.len(), 2);
    assert_eq!(cols[0].name, "pair_x");
    assert_eq!(cols[0].dtype, DType::U8);
    assert_eq!(cols[0].shape, vec![2, 2]);
    assert_eq!(cols[0].row_bytes, 4);
    assert_eq!(cols[1].name, "pair_y");
    assert_eq!(cols[1].dtype, DType::I64);
    assert_eq!(cols[1].shape, Vec::<u64>::new());
    assert_eq!(cols[1].row_bytes, 8);

    let indices = [5u64, 0, 3, 3, 1, 4, 2];
    let out = gather(&ds, 0, &indices).unwrap();
    let x: Vec<u8> = indices
        .iter()
        .flat_map(|&i| i as u8 * 4..i as u8 * 4 + 4)
        .collect();
    let y: Vec<u8> = indices
        .iter()
        .flat_map(|&i| (i as i64 * 1000 - 2500).to_le_bytes())
        .collect();
    assert_eq!(out[0], x);
    assert_eq!(out[1], y);
    // The epoch does not matter to a column dataset.
    assert_eq!(gather(&ds, 7, &indices).unwrap(), out);
    // No indices: nothing to do.
    assert_eq!(
        gather(&ds, 0, &[]).unwrap(),
        vec![Vec::<u8>::new(), Vec::new()]
    );
}

#[test]
fn single_file_dataset() {
    let ds = NpyDataset::open(fx("good_3d.npy")).unwrap();
    assert_eq!(ds.len(), 4);
    assert_eq!(ds.columns().len(), 1);
    assert_eq!(ds.columns()[0].name, "good_3d");
    assert_eq!(ds.columns()[0].shape, vec![2, 3]);
    assert_eq!(ds.columns()[0].row_bytes, 48);
    let out = gather(&ds, 0, &[3, 1]).unwrap();
    let expected: Vec<u8> = (18..24)
        .chain(6..12)
        .flat_map(|v| (v as f64).to_le_bytes())
        .collect();
    assert_eq!(out[0], expected);
}

#[test]
fn mismatched_lengths_name_the_short_file() {
    let err = NpyDataset::open_columns([fx("pair_x.npy"), fx("pair_y_short.npy")]).unwrap_err();
    assert!(err.to_string().contains("pair_y_short.npy"), "{err}");
    assert!(
        matches!(&err, Error::Dataset { path, .. } if path.ends_with("pair_y_short.npy")),
        "{err:?}"
    );
    // The other order: the message still names the short file.
    let err = NpyDataset::open_columns([fx("pair_y_short.npy"), fx("pair_x.npy")]).unwrap_err();
    assert!(matches!(err, Error::Dataset { .. }), "{err:?}");
    assert!(err.to_string().contains("pair_y_short.npy"), "{err}");
}

#[test]
fn two_columns_of_one_name_are_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("pair_x.npy");
    std::fs::copy(fx("pair_x.npy"), &other).unwrap();
    let err = NpyDataset::open_columns([fx("pair_x.npy"), other.clone()]).unwrap_err();
    assert!(
        matches!(&err, Error::Dataset { path, .. } if *path == other),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains("names its column \"pair_x\", as "), "{text}");
    assert!(
        text.contains(&fx("pair_x.npy").display().to_string()),
        "{text}"
    );
}

#[test]
fn broken_column_names_its_file() {
    let err = NpyDataset::open_columns([fx("pair_x.npy"), fx("bad_trailing.npy")]).unwrap_err();
    assert!(err.to_string().contains("bad_trailing.npy"), "{err}");
    assert!(
        matches!(
            &err,
            Error::Npy {
                problem: NpyProblem::TrailingBytes { extra: 7 },
                ..
            }
        ),
        "{err:?}"
    );
    let err = NpyDataset::open(fx("bad_fortran.npy")).unwrap_err();
    assert!(err.to_string().contains("bad_fortran.npy"), "{err}");
    assert!(
        matches!(
            &err,
            Error::Npy {
                problem: NpyProblem::FortranOrder,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn directory_dataset() {
    for ds in [
        NpyDataset::open_dir(fx("dir")).unwrap(),
        NpyDataset::open(fx("dir")).unwrap(),
    ] {
        assert_eq!(ds.len(), 4);
        let names: Vec<&str> = ds.columns().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["x", "y", "z_extra"]);
        let dtypes: Vec<DType> = ds.columns().iter().map(|c| c.dtype).collect();
        assert_eq!(dtypes, [DType::U8, DType::I64, DType::F32]);
        let row_bytes: Vec<usize> = ds.columns().iter().map(|c| c.row_bytes).collect();
        assert_eq!(row_bytes, [3, 8, 4]);
        assert_eq!(ds.columns()[0].shape, vec![3]);

        let indices = [3u64, 1, 2, 0, 3];
        let out = gather(&ds, 1, &indices).unwrap();
        let x: Vec<u8> = indices
            .iter()
            .flat_map(|&i| i as u8 * 3..i as u8 * 3 + 3)
            .collect();
        let y: Vec<u8> = indices
            .iter()
            .flat_map(|&i| (i as i64 + 10).to_le_bytes())
            .collect();
        let z: Vec<u8> = indices
            .iter()
            .flat_map(|&i| (i as f32 * 0.5).to_le_bytes())
            .collect();
        assert_eq!(out, vec![x, y, z]);
    }
}

#[test]
fn zero_row_dataset_is_an_error() {
    let err = NpyDataset::open(fx("good_zero_rows.npy")).unwrap_err();
    assert!(matches!(err, Error::Dataset { .. }), "{err:?}");
    assert!(err.to_string().contains("good_zero_rows.npy"), "{err}");
}

#[test]
fn gather_out_of_range_is_an_error() {
    let ds = NpyDataset::open_columns([fx("pair_x.npy"), fx("pair_y.npy")]).unwrap();
    for bad in [6u64, 7, u64::MAX] {
        let r = catch_unwind(AssertUnwindSafe(|| gather(&ds, 0, &[0, 2, bad])))
            .unwrap_or_else(|_| panic!("gather of index {bad} panicked"));
        assert!(
            matches!(r, Err(Error::OutOfRange { index, len: 6 }) if index == bad),
            "index {bad}: {r:?}"
        );
    }
    let ds = NpyDataset::open_dir(fx("dir")).unwrap();
    assert!(matches!(
        gather(&ds, 0, &[4]),
        Err(Error::OutOfRange { index: 4, len: 4 })
    ));
}

#[test]
fn gather_out_of_range_with_zero_width_rows_is_an_error() {
    // (3, 0): three samples of zero bytes. An index past the end is still out of range.
    let ds = NpyDataset::open(fx("good_zero_cols.npy")).unwrap();
    assert_eq!(ds.len(), 3);
    assert_eq!(ds.columns()[0].row_bytes, 0);
    assert_eq!(gather(&ds, 0, &[0, 2, 1]).unwrap(), vec![Vec::<u8>::new()]);
    let r = gather(&ds, 0, &[3]);
    assert!(
        matches!(r, Err(Error::OutOfRange { index: 3, len: 3 })),
        "{r:?}"
    );
}

#[test]
fn gather_with_wrong_outputs_is_an_error() {
    let ds = NpyDataset::open_columns([fx("pair_x.npy"), fx("pair_y.npy")]).unwrap();
    // One output slice for two columns.
    let mut x = vec![0u8; 8];
    let r = ds.gather(0, &[0, 1], &mut [x.as_mut_slice()]);
    assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
    // A slice too small for the rows asked for.
    let mut x = vec![0u8; 8];
    let mut y = vec![0u8; 8];
    let r = ds.gather(0, &[0, 1], &mut [x.as_mut_slice(), y.as_mut_slice()]);
    assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
}

// ------------------------------------------------------------------------------------
// TokenDataset
// ------------------------------------------------------------------------------------

fn check_consecutive(ds: &TokenDataset, seq_len: u64) {
    let len = ds.len();
    assert_eq!(len, 99 / seq_len);
    let cols = ds.columns();
    assert_eq!(cols.len(), 1);
    assert_eq!(cols[0].name, "tokens");
    assert_eq!(cols[0].dtype, DType::U16);
    assert_eq!(cols[0].shape, vec![seq_len + 1]);
    assert_eq!(cols[0].row_bytes, (seq_len as usize + 1) * 2);
    let indices: Vec<u64> = (0..len).rev().collect();
    let out = gather(ds, 0, &indices).unwrap();
    let windows = u16s(&out[0]);
    for (k, &i) in indices.iter().enumerate() {
        let w = &windows[k * (seq_len as usize + 1)..(k + 1) * (seq_len as usize + 1)];
        let expected: Vec<u16> = (i * seq_len..i * seq_len + seq_len + 1)
            .map(|t| t as u16)
            .collect();
        assert_eq!(w, expected.as_slice(), "window {i}");
    }
    let r = gather(ds, 0, &[len]);
    assert!(
        matches!(r, Err(Error::OutOfRange { index, len: l }) if index == len && l == len),
        "{r:?}"
    );
}

#[test]
fn token_bin_consecutive_windows() {
    for seq_len in [1usize, 8, 10, 33, 98, 99] {
        let ds = TokenDataset::open_bin(
            fx("tokens_u16.bin"),
            DType::U16,
            seq_len,
            Windows::Consecutive,
        )
        .unwrap();
        check_consecutive(&ds, seq_len as u64);
    }
}

#[test]
fn token_npy_consecutive_windows() {
    for seq_len in [1usize, 8, 10, 33, 98, 99] {
        let ds =
            TokenDataset::open_npy(fx("tokens_u16.npy"), seq_len, Windows::Consecutive).unwrap();
        check_consecutive(&ds, seq_len as u64);
    }
}

#[test]
fn token_npy_of_other_integer_type() {
    // good_1d.npy: int32 tokens 0..7; seq_len 3 gives (7 - 1) / 3 = 2 windows.
    let ds = TokenDataset::open_npy(fx("good_1d.npy"), 3, Windows::Consecutive).unwrap();
    assert_eq!(ds.len(), 2);
    assert_eq!(ds.columns()[0].dtype, DType::I32);
    let out = gather(&ds, 0, &[1, 0]).unwrap();
    let expected: Vec<u8> = [3i32, 4, 5, 6, 0, 1, 2, 3]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(out[0], expected);
}

/// All windows of an epoch, as token vectors; checks each is a run of consecutive
/// tokens lying inside the stream.
fn random_epoch(ds: &TokenDataset, epoch: u64, seq_len: usize) -> Vec<u16> {
    let indices: Vec<u64> = (0..ds.len()).collect();
    let out = gather(ds, epoch, &indices).unwrap();
    let tokens = u16s(&out[0]);
    let mut starts = Vec::new();
    for w in tokens.chunks_exact(seq_len + 1) {
        assert!(
            w[0] as usize + seq_len < 100,
            "window starts at {} and leaves the stream",
            w[0]
        );
        for k in 1..w.len() {
            assert_eq!(w[k], w[0] + k as u16, "window {w:?} is not contiguous");
        }
        starts.push(w[0]);
    }
    starts
}

#[test]
fn token_random_windows() {
    let seq_len = 8;
    for ds in [
        TokenDataset::open_npy(fx("tokens_u16.npy"), seq_len, Windows::Random { seed: 7 }).unwrap(),
        TokenDataset::open_bin(
            fx("tokens_u16.bin"),
            DType::U16,
            seq_len,
            Windows::Random { seed: 7 },
        )
        .unwrap(),
    ] {
        assert_eq!(ds.len(), 12);
        let epochs: Vec<Vec<u16>> = (0..6).map(|e| random_epoch(&ds, e, seq_len)).collect();
        // Deterministic per epoch.
        assert_eq!(random_epoch(&ds, 3, seq_len), epochs[3]);
        // Different epochs give different windows.
        for a in 0..epochs.len() {
            for b in a + 1..epochs.len() {
                assert_ne!(
                    epochs[a], epochs[b],
                    "epochs {a} and {b} have the same windows"
                );
            }
        }
        // Gathering a subset gives the same windows as the full epoch.
        let out = gather(&ds, 2, &[5, 11]).unwrap();
        let w = u16s(&out[0]);
        assert_eq!((w[0], w[seq_len + 1]), (epochs[2][5], epochs[2][11]));
        // The index range is the same as for consecutive windows.
        assert!(matches!(
            gather(&ds, 0, &[12]),
            Err(Error::OutOfRange { index: 12, len: 12 })
        ));
    }
    // Another seed gives other windows; the same seed the same.
    let a =
        TokenDataset::open_npy(fx("tokens_u16.npy"), seq_len, Windows::Random { seed: 7 }).unwrap();
    let b =
        TokenDataset::open_npy(fx("tokens_u16.npy"), seq_len, Windows::Random { seed: 8 }).unwrap();
    assert_ne!(random_epoch(&a, 0, seq_len), random_epoch(&b, 0, seq_len));
    // Windows as long as the stream allows: every start is 0 or 1.
    let ds = TokenDataset::open_bin(
        fx("tokens_u16.bin"),
        DType::U16,
        98,
        Windows::Random { seed: 1 },
    )
    .unwrap();
    assert_eq!(ds.len(), 1);
    for e in 0..20 {
        let starts = random_epoch(&ds, e, 98);
        assert!(starts[0] <= 1);
    }
}

#[test]
fn odd_length_token_file_names_the_file() {
    let err = TokenDataset::open_bin(fx("tokens_odd.bin"), DType::U16, 8, Windows::Consecutive)
        .unwrap_err();
    assert!(matches!(err, Error::Dataset { .. }), "{err:?}");
    assert!(err.to_string().contains("tokens_odd.bin"), "{err}");
}

#[test]
fn token_stream_errors() {
    // Too short for one window of seq_len + 1 tokens.
    let err = TokenDataset::open_bin(fx("tokens_u16.bin"), DType::U16, 100, Windows::Consecutive)
        .unwrap_err();
    assert!(matches!(err, Error::Dataset { .. }), "{err:?}");
    assert!(err.to_string().contains("tokens_u16.bin"), "{err}");
    let err =
        TokenDataset::open_npy(fx("tokens_u16.npy"), 100, Windows::Random { seed: 0 }).unwrap_err();
    assert!(matches!(err, Error::Dataset { .. }), "{err:?}");
    assert!(err.to_string().contains("tokens_u16.npy"), "{err}");
    // seq_len 0.
    let err = TokenDataset::open_bin(fx("tokens_u16.bin"), DType::U16, 0, Windows::Consecutive)
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    // A dtype tokens are not stored as.
    let err = TokenDataset::open_bin(fx("tokens_u16.bin"), DType::F32, 8, Windows::Consecutive)
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    // A 2-d array or a float array is not a token stream.
    for file in ["good_v1_int32.npy", "good_v1_float32.npy", "good_3d.npy"] {
        let err = TokenDataset::open_npy(fx(file), 2, Windows::Consecutive).unwrap_err();
        assert!(matches!(err, Error::Dataset { .. }), "{file}: {err:?}");
        assert!(err.to_string().contains(file), "{err}");
    }
    // A broken .npy reports its NpyProblem.
    let err = TokenDataset::open_npy(fx("bad_magic.npy"), 2, Windows::Consecutive).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Npy {
                problem: NpyProblem::BadMagic,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("bad_magic.npy"), "{err}");
    // A missing file.
    let err =
        TokenDataset::open_bin(fx("missing.bin"), DType::U16, 8, Windows::Consecutive).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("missing.bin"), "{err}");
}

#[test]
fn llmc_token_files_skip_their_header() {
    // llm.c GPT-2 (u16, tokens 0..100) reads exactly as the headerless stream does.
    for seq_len in [1usize, 8, 33, 99] {
        let ds = TokenDataset::open_bin(
            fx("llmc_gpt2.bin"),
            DType::U16,
            seq_len,
            Windows::Consecutive,
        )
        .unwrap();
        assert_eq!(ds.tokens(), 100);
        check_consecutive(&ds, seq_len as u64);
    }
    // llm.c LLaMA-3 (u32, tokens 0, 1000, ..., 99000).
    let ds =
        TokenDataset::open_bin(fx("llmc_llama3.bin"), DType::U32, 4, Windows::Consecutive).unwrap();
    assert_eq!(ds.tokens(), 100);
    let out = gather(&ds, 0, &[1]).unwrap();
    let expected: Vec<u8> = [4000u32, 5000, 6000, 7000, 8000]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(out[0], expected);
    // Each header names its token type; a headerless stream or a bad version names none.
    let named = |name: &str| TokenDataset::header_dtype(fx(name)).unwrap();
    assert_eq!(named("llmc_gpt2.bin"), Some(DType::U16));
    assert_eq!(named("llmc_llama3.bin"), Some(DType::U32));
    assert_eq!(named("llmc_bad_version.bin"), None);
    assert_eq!(named("tokens_u16.bin"), None);
    let err = TokenDataset::header_dtype(fx("missing.bin")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
}

#[test]
fn bad_llmc_token_files_are_errors_naming_the_file() {
    let cases = [
        ("llmc_bad_count.bin", DType::U16, "counts 120 tokens"),
        ("llmc_bad_version.bin", DType::U16, "version 3"),
        (
            "llmc_truncated.bin",
            DType::U16,
            "shorter than its 1024-byte header",
        ),
        (
            "llmc_gpt2.bin",
            DType::U32,
            "says uint16 tokens, uint32 were asked for",
        ),
        (
            "llmc_llama3.bin",
            DType::U16,
            "says uint32 tokens, uint16 were asked for",
        ),
    ];
    for (file, dtype, problem) in cases {
        let err = TokenDataset::open_bin(fx(file), dtype, 4, Windows::Consecutive).unwrap_err();
        assert!(matches!(err, Error::Dataset { .. }), "{file}: {err:?}");
        let text = err.to_string();
        assert!(
            text.contains(file) && text.contains(problem),
            "{file}: {text}"
        );
    }
}

fn litdata(name: &str) -> PathBuf {
    Path::new(FIXTURES).join("../litdata").join(name)
}

/// Every window of `ds` in epoch 0, as `i64` tokens.
fn all_windows(ds: &dyn Dataset) -> Vec<Vec<i64>> {
    let column = &ds.columns()[0];
    let all: Vec<u64> = (0..ds.len()).collect();
    let out = gather(ds, 0, &all).unwrap();
    out[0]
        .chunks_exact(column.row_bytes)
        .map(|row| {
            row.chunks_exact(column.dtype.size())
                .map(|t| column.dtype.read_i64(t).unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn litdata_token_chunks_are_read_in_place() {
    // As litgpt prepares pretraining data (tests/fixtures/make_litdata.py): items of 5,
    // 12, 3, 40 and 1 tokens (token j of item k is 100 k + j) in chunks of 20, 40 and 1.
    let items: Vec<Vec<i64>> = [5, 12, 3, 40, 1]
        .iter()
        .enumerate()
        .map(|(k, &n)| (0..n).map(|j| 100 * k as i64 + j).collect())
        .collect();
    let set = stokehold::LitData::open(litdata("litdata_u16")).unwrap();
    assert_eq!(
        (set.dtype(), set.tokens(), set.chunks().count()),
        (DType::U16, 61, 3)
    );
    // Windows of 8 (seq_len 7) cut each chunk on its own: 2 from the first chunk's 20
    // tokens, 5 from the second's 40, none from the third's 1.
    let ds = set.windows(7, Windows::Consecutive).unwrap();
    let chunk0: Vec<i64> = items[..3].concat();
    let want: Vec<Vec<i64>> = (0..2)
        .map(|i| chunk0[7 * i..7 * i + 8].to_vec())
        .chain((0..5).map(|i| items[3][7 * i..7 * i + 8].to_vec()))
        .collect();
    assert_eq!(all_windows(&ds), want);
    // numpy int32 tokens (no_header_numpy), one chunk, and the index.json path itself.
    let set = stokehold::LitData::open(litdata("litdata_i32/index.json")).unwrap();
    assert_eq!(set.dtype(), DType::I32);
    let ds = set.windows(60, Windows::Consecutive).unwrap();
    assert_eq!(all_windows(&ds), vec![items.concat()]);
}

#[test]
fn bad_litdata_sets_are_errors_naming_the_file() {
    let problem = |err: Error, file: &str, what: &str| {
        assert!(matches!(err, Error::Dataset { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(file) && text.contains(what), "{text}");
    };
    let err = stokehold::LitData::open(litdata("litdata_items")).unwrap_err();
    problem(err, "index.json", "optimized for the PyTreeLoader");
    let err = stokehold::LitData::open(litdata("missing")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    // An index.json that is a FIFO would block a plain read forever.
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("index.json");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.unwrap().success());
    let err = stokehold::LitData::open(dir.path()).unwrap_err();
    problem(err, "index.json", "is a FIFO, not a regular file");
    // Token counts that add up past 2^64.
    let index = std::fs::read_to_string(litdata("litdata_u16/index.json")).unwrap();
    let huge = index.replacen("\"dim\": 20", "\"dim\": 18446744073709551615", 1);
    assert_ne!(huge, index);
    std::fs::remove_file(&fifo).unwrap();
    std::fs::write(&fifo, huge).unwrap();
    let err = stokehold::LitData::open(dir.path()).unwrap_err();
    problem(err, "index.json", "add up past 2^64");
    // Encrypted chunks (LitData's `encryption`) would read as wrong item counts.
    let sealed = index.replacen(
        "\"encryption\": null",
        "\"encryption\": {\"algorithm\": \"fernet\", \"level\": \"chunk\"}",
        1,
    );
    assert_ne!(sealed, index);
    std::fs::write(&fifo, sealed).unwrap();
    let err = stokehold::LitData::open(dir.path()).unwrap_err();
    problem(err, "index.json", "its chunks are encrypted");
    let set = stokehold::LitData::open(litdata("litdata_u16")).unwrap();
    let err = set.windows(40, Windows::Consecutive).unwrap_err();
    problem(
        err,
        "chunk-0-0.bin",
        "no chunk holds a window of seq_len + 1 = 41",
    );
    for seq_len in [0, usize::MAX] {
        let err = set.windows(seq_len, Windows::Consecutive).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
    }
    // A chunk changed after optimizing: cut short, an offset bent, another item count.
    let dir = tempfile::tempdir().unwrap();
    let copy = |name: &str, edit: &dyn Fn(&mut Vec<u8>)| {
        for f in [
            "index.json",
            "chunk-0-0.bin",
            "chunk-0-1.bin",
            "chunk-0-2.bin",
        ] {
            let mut bytes = std::fs::read(litdata("litdata_u16").join(f)).unwrap();
            if f == name {
                edit(&mut bytes);
            }
            std::fs::write(dir.path().join(f), bytes).unwrap();
        }
        stokehold::LitData::open(dir.path())
            .unwrap()
            .windows(7, Windows::Consecutive)
            .unwrap_err()
    };
    let err = copy("chunk-0-1.bin", &|b| b.truncate(b.len() - 2));
    problem(err, "chunk-0-1.bin", "item offset 1 is 92");
    let err = copy("chunk-0-0.bin", &|b| b[8] = b[8].wrapping_add(200));
    problem(err, "chunk-0-0.bin", "item offset 1 is 230");
    let err = copy("chunk-0-1.bin", &|b| b[0] = 2);
    problem(
        err,
        "chunk-0-1.bin",
        "holds 2 items, and its index.json counts 1",
    );
    let err = copy("index.json", &|b| {
        let text = String::from_utf8(b.clone()).unwrap();
        *b = text.replace("\"dim\": 40", "\"dim\": 41").into_bytes();
    });
    problem(
        err,
        "chunk-0-1.bin",
        "holds 40 tokens, and its index.json counts 41",
    );
    // A chunk named by a path, not a file name of the set's directory.
    let index = std::fs::read_to_string(litdata("litdata_u16/index.json")).unwrap();
    let escape = dir.path().join("escape");
    std::fs::create_dir(&escape).unwrap();
    let bent = index.replace("\"chunk-0-1.bin\"", "\"../chunk-0-1.bin\"");
    std::fs::write(escape.join("index.json"), bent).unwrap();
    let err = stokehold::LitData::open(&escape).unwrap_err();
    problem(
        err,
        "index.json",
        "chunk \"../chunk-0-1.bin\" is not a file name",
    );
}

#[test]
fn random_windows_differ_between_the_parts_of_a_set() {
    // Equal chunks of a LitData set (or shards packed each on its own) are not cut at
    // the same offsets: each later part draws from another seed.
    let random = Windows::Random { seed: 4 };
    assert_eq!(random.for_part(0), random);
    assert_ne!(random.for_part(1), random);
    assert_ne!(random.for_part(1), random.for_part(2));
    assert_eq!(Windows::Consecutive.for_part(3), Windows::Consecutive);
    // Two copies of one stream as parts 0 and 1: their windows start elsewhere.
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("t.bin");
    let bytes: Vec<u8> = (0..4000u16).flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(&raw, bytes).unwrap();
    let part = |k: usize| TokenDataset::open_bin(&raw, DType::U16, 16, random.for_part(k)).unwrap();
    let (a, b) = (part(0), part(1));
    let starts = |ds: &TokenDataset| {
        (0..ds.len())
            .map(|i| ds.window_start(0, i))
            .collect::<Vec<_>>()
    };
    assert_ne!(starts(&a), starts(&b));
}
