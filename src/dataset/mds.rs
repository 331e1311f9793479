//! MosaicML Streaming (MDS) shards, read in place: one column of NumPy arrays of
//! integers (LLM Foundry's `tokens`), a sample's array being one document.
//!
//! A shard (`shard.00000.mds`, as `streaming.MDSWriter` writes it) is a little-endian
//! `u32` sample count `n`, `n + 1` `u32` sample offsets (bytes from the file's start),
//! the writer's configuration as JSON, then the samples. A sample starts with one `u32`
//! size per column of variable size, then holds each column's bytes, in the order of
//! `column_names`. An `ndarray:<dtype>` column's bytes are a shape header (a byte
//! `ndim << 2 | k`, then `ndim` sizes of `2^k` bytes each) and the values; an
//! `ndarray:<dtype>:<shape>` column's, the values alone; a plain `ndarray` column's, a
//! type code byte, then the shape header and the values (each sample naming its type);
//! a `bytes` column's, raw bytes (older LLM Foundry sets keep their `int64` tokens so),
//! whose type the reader is told.

use super::arrow::u32_at;
use super::DType;

/// The writer's configuration in a shard (its other keys are not needed here).
#[derive(serde::Deserialize)]
struct Config {
    version: u64,
    format: String,
    column_names: Vec<String>,
    column_encodings: Vec<String>,
    column_sizes: Vec<Option<u64>>,
}

/// Where each sample of a shard keeps one column's array.
#[derive(Debug, Clone)]
pub(super) struct Column {
    /// Samples in the shard.
    pub(super) samples: u64,
    /// The element type.
    pub(super) dtype: DType,
    /// Columns of variable size: each sample starts with their `u32` sizes.
    variable: usize,
    /// The bytes of the fixed-size columns before this one in a sample.
    fixed_before: u64,
    /// The variable columns before this one: their sizes are the first at a sample's
    /// start (this one's, if variable, the next).
    variable_before: usize,
    /// The elements of a fixed shape, or `None` where each sample has its own size.
    elements: Option<u64>,
    /// A `bytes` column: each sample's values are its bytes, with no shape header.
    raw: bool,
    /// A plain `ndarray` column: each sample's array starts with its type's code, which
    /// must be `dtype`'s in every sample.
    coded: bool,
}

/// The element types of a plain `ndarray` column's type codes (streaming's `NDArray`:
/// 8 bits times the width in bytes, plus 1 for a signed type), integers only.
fn coded_dtype(code: u8) -> Option<DType> {
    Some(match code {
        8 => DType::U8,
        9 => DType::I8,
        16 => DType::U16,
        17 => DType::I16,
        32 => DType::U32,
        33 => DType::I32,
        64 => DType::U64,
        65 => DType::I64,
        _ => return None,
    })
}

/// The type code of `dtype` in a plain `ndarray` column ([`coded_dtype`]'s inverse).
fn dtype_code(dtype: DType) -> Option<u8> {
    [8, 9, 16, 17, 32, 33, 64, 65]
        .into_iter()
        .find(|&c| coded_dtype(c) == Some(dtype))
}

/// The `u32` at byte `at`.
fn word(bytes: &[u8], at: u64) -> Option<u64> {
    u32_at(bytes, usize::try_from(at).ok()?).map(u64::from)
}

/// The first bytes of a zstd frame: a shard `streaming` keeps compressed
/// (`shard.00000.mds.zstd`).
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// The version of the shard layout `streaming` writes (its `MDSWriter`'s `version`).
const VERSION: u64 = 2;

/// The first of the `count + 1` `u32` byte offsets that follow the `u32` count at the
/// start of `bytes` (the table an MDS shard and a LitData chunk start with) that falls
/// below the one before it or passes the end of `bytes`, as `(k, offset)`; `None` where
/// they rise within the file.
pub(super) fn falling_offset(bytes: &[u8], count: u64) -> Option<(u64, u64)> {
    let mut last = 0;
    (0..=count)
        .map(|k| (k, word(bytes, 4 + 4 * k).unwrap_or(0)))
        .find(|&(_, at)| {
            let falls = at < last || at > bytes.len() as u64;
            last = at;
            falls
        })
}

/// Reads the shard `bytes`' layout and column `name`'s place in its samples, checking
/// the sample offsets (they rise, from the end of the configuration to the end of the
/// file). `dtype` is the type of a `bytes` column's values, and must be an array
/// column's own type where given.
///
/// # Errors
/// What is wrong, for a file that is not an MDS shard, a missing column (the message
/// lists those there are), a column that is not an array of integers, a `bytes` column
/// without an integer `dtype`, and an array column of another type than `dtype`.
pub(super) fn column(bytes: &[u8], name: &str, dtype: Option<DType>) -> Result<Column, String> {
    if bytes.starts_with(&ZSTD_MAGIC) {
        return Err(
            "a zstd-compressed shard: decompress it (as streaming does on download, \
                    `zstd -d`) and read the .mds"
                .into(),
        );
    }
    // streaming's other codecs, by their magic (brotli has none): said where the
    // bytes do not read as a shard (a shard's sample count could start so).
    let codec = [
        (&b"\x1f\x8b\x08"[..], "gzip"),
        (b"BZh", "bz2"),
        (b"\xff\x06\x00\x00sNaPpY", "snappy"),
    ]
    .into_iter()
    .find(|(magic, _)| bytes.starts_with(magic));
    shard_column(bytes, name, dtype).map_err(|e| match codec {
        Some((_, codec)) => format!(
            "a {codec}-compressed shard: decompress it (as streaming does on download) \
             and read the .mds"
        ),
        None => e,
    })
}

/// [`column`] of a shard that is not zstd-compressed.
fn shard_column(bytes: &[u8], name: &str, dtype: Option<DType>) -> Result<Column, String> {
    let len = bytes.len() as u64;
    let not = |why: String| format!("not an MDS shard: {why}");
    let samples = word(bytes, 0).ok_or_else(|| not(format!("{len} bytes")))?;
    let table = 4 + 4 * (samples + 1);
    let first = word(bytes, 4)
        .filter(|_| table <= len)
        .ok_or_else(|| not(format!("{samples} samples need {table} bytes of offsets")))?;
    let config = bytes
        .get(table as usize..usize::try_from(first).unwrap_or(usize::MAX))
        .ok_or_else(|| not(format!("the first sample starts at byte {first}")))?;
    let config: Config = serde_json::from_slice(config)
        .map_err(|e| not(format!("its configuration is not the writer's JSON ({e})")))?;
    let columns = config.column_names.len();
    if config.version != VERSION {
        return Err(format!(
            "an MDS shard of version {}: stokehold reads version {VERSION}",
            config.version
        ));
    }
    if config.format != "mds"
        || config.column_encodings.len() != columns
        || config.column_sizes.len() != columns
    {
        return Err(not(format!(
            "format {:?} with {columns} column names, {} encodings, {} sizes",
            config.format,
            config.column_encodings.len(),
            config.column_sizes.len()
        )));
    }
    if let Some((k, at)) = falling_offset(bytes, samples) {
        return Err(format!(
            "sample offset {k} is {at}: offsets rise, from the end of the configuration \
             ({first}) to the end of the file ({len}) at most"
        ));
    }
    let Some(c) = config.column_names.iter().position(|n| n == name) else {
        return Err(format!(
            "no column {name:?}; its columns are {:?}",
            config.column_names
        ));
    };
    let encoding = &config.column_encodings[c];
    let sizes = &config.column_sizes;
    let variable_before = sizes[..c].iter().filter(|s| s.is_none()).count();
    let fixed_before = sizes[..c]
        .iter()
        .flatten()
        .try_fold(0u64, |a, &s| a.checked_add(s))
        .ok_or_else(|| not("column sizes overflow".into()))?;
    let layout = |dtype, elements, raw| Column {
        samples,
        dtype,
        variable: sizes.iter().filter(|s| s.is_none()).count(),
        fixed_before,
        variable_before,
        elements,
        raw,
        coded: false,
    };
    if encoding == "bytes" {
        return match dtype {
            Some(d) if d.is_integer() && sizes[c].is_none() => Ok(layout(d, None, true)),
            Some(d) if d.is_integer() => {
                Err(not(format!("column {name:?} (bytes) has a fixed size")))
            }
            _ => Err(format!(
                "column {name:?} is encoded as \"bytes\": give the integer type of its \
                 values (int64 for the token columns older LLM Foundry versions wrote)"
            )),
        };
    }
    if encoding == "ndarray" && sizes[c].is_none() {
        // Each sample names its type: the first's is the column's, every other sample's
        // must be the same (checked as the documents are scanned).
        let mut column = layout(DType::U8, None, false);
        column.coded = true;
        let code = (samples > 0)
            .then(|| column.start(bytes, 0))
            .flatten()
            .and_then(|at| bytes.get(usize::try_from(at).ok()?).copied());
        column.dtype = match (code.and_then(coded_dtype), code, dtype) {
            (Some(d), _, Some(asked)) if asked != d => {
                return Err(format!(
                    "column {name:?} holds {d} values (\"ndarray\", by its first sample), \
                     and {asked} was asked for"
                ))
            }
            (Some(d), ..) => d,
            (None, None, Some(asked)) => asked,
            (None, code, _) => {
                return Err(format!(
                    "column {name:?} is encoded as \"ndarray\" and its first sample holds \
                     no array of integers (type code {})",
                    code.map_or("missing".into(), |c| c.to_string())
                ))
            }
        };
        return Ok(column);
    }
    let parts: Vec<&str> = encoding.split(':').collect();
    let asked = dtype;
    let dtype = match parts[..] {
        ["ndarray", dtype, ..] if parts.len() <= 3 => DType::from_name(dtype),
        _ => None,
    }
    .filter(|d| d.is_integer())
    .ok_or_else(|| {
        format!(
            "column {name:?} is encoded as {encoding:?}, not as an array of integers \
             (ndarray:<integer type>)"
        )
    })?;
    let elements = match parts.get(2) {
        None => None,
        Some(shape) => Some(
            shape
                .split(',')
                .try_fold(1u64, |n, d| n.checked_mul(d.parse().ok()?))
                .ok_or_else(|| format!("column {name:?}: bad shape in {encoding:?}"))?,
        ),
    };
    let fixed = elements.and_then(|n| n.checked_mul(dtype.size() as u64));
    if fixed.is_some() != sizes[c].is_some() || (fixed.is_some() && fixed != sizes[c]) {
        return Err(not(format!(
            "column {name:?} ({encoding:?}) has size {:?}",
            sizes[c]
        )));
    }
    match asked {
        Some(asked) if asked != dtype => Err(format!(
            "column {name:?} holds {dtype} values ({encoding:?}), and {asked} was asked for"
        )),
        _ => Ok(layout(dtype, elements, false)),
    }
}

impl Column {
    /// Sample `i`'s array: its first value's byte in the shard and its length in
    /// elements. `None` where the shard does not hold it (a size or a header that
    /// passes its sample, a shape that does not match the values).
    pub(super) fn extent(&self, bytes: &[u8], i: usize) -> Option<(u64, u64)> {
        let start = word(bytes, 4 + 4 * i as u64)?;
        let end = word(bytes, 4 + 4 * (i as u64 + 1))?;
        let size = |j: usize| word(bytes, start.checked_add(4 * j as u64)?);
        let mut at = self.start(bytes, i)?;
        let width = self.dtype.size() as u64;
        let (values, count) = match self.elements {
            Some(n) => (at, n),
            None => {
                // This column is variable: its size is the next one after those before.
                let bytes_len = size(self.variable_before)?;
                if self.raw {
                    // Raw bytes: a whole number of values.
                    (bytes_len % width == 0).then_some((at, bytes_len / width))?
                } else if self.coded {
                    // Its type's code first, the column's.
                    let code = *bytes.get(usize::try_from(at).ok()?)?;
                    (Some(code) == dtype_code(self.dtype)).then_some(())?;
                    at = at.checked_add(1)?;
                    self.array(bytes, at, bytes_len.checked_sub(1)?)?
                } else {
                    self.array(bytes, at, bytes_len)?
                }
            }
        };
        let last = values.checked_add(count.checked_mul(width)?)?;
        (last <= end).then_some((values, count))
    }

    /// The first byte of sample `i`'s bytes of this column, `None` where the shard does
    /// not hold it.
    fn start(&self, bytes: &[u8], i: usize) -> Option<u64> {
        let start = word(bytes, 4 + 4 * i as u64)?;
        let size = |j: usize| word(bytes, start.checked_add(4 * j as u64)?);
        let mut at = start.checked_add(4 * self.variable as u64)?;
        at = at.checked_add(self.fixed_before)?;
        for j in 0..self.variable_before {
            at = at.checked_add(size(j)?)?;
        }
        Some(at)
    }

    /// An `ndarray` sample's values, `bytes_len` bytes at `at` with their shape header
    /// first: the first value's byte and the elements, `None` where the header does not
    /// match the size.
    fn array(&self, bytes: &[u8], at: u64, bytes_len: u64) -> Option<(u64, u64)> {
        let width = self.dtype.size() as u64;
        let head = *bytes.get(usize::try_from(at).ok()?)?;
        let (ndim, k) = (u64::from(head >> 2), head & 3);
        let shape = (at + 1, 1u64 << k);
        let mut n = 1u64;
        for d in 0..ndim {
            let b = bytes.get(usize::try_from(shape.0 + d * shape.1).ok()?..)?;
            let b = b.get(..shape.1 as usize)?;
            let mut v = [0u8; 8];
            v[..b.len()].copy_from_slice(b);
            n = n.checked_mul(u64::from_le_bytes(v))?;
        }
        let header = 1 + ndim * shape.1;
        if ndim == 0 || header.checked_add(n.checked_mul(width)?)? != bytes_len {
            return None;
        }
        Some((at.checked_add(header)?, n))
    }
}
