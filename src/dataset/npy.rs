//! NumPy `.npy` files (format versions 1.0, 2.0 and 3.0) over a read-only memory map.
//!
//! Everything about a file is checked when it is opened: magic, version, header,
//! dtype, order, shape, and that the file holds exactly the bytes the header promises.
//! After that, reading a row is a bounds-checked `memcpy` from the mapping.

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::guard::Watched;

use super::DType;
use crate::error::{Error, NpyProblem, Result};

const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// What a `.npy` header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyHeader {
    /// Format version, `(1, 0)`, `(2, 0)` or `(3, 0)`.
    pub version: (u8, u8),
    /// The element type.
    pub dtype: DType,
    /// The array's shape; the first axis is the sample axis.
    pub shape: Vec<u64>,
    /// Where the data starts in the file.
    pub data_offset: u64,
}

impl NpyHeader {
    /// Number of samples: the first axis.
    pub fn rows(&self) -> u64 {
        self.shape[0]
    }

    /// Bytes of one sample: the product of the other axes times the element size.
    pub fn row_bytes(&self) -> u64 {
        self.shape[1..].iter().product::<u64>() * self.dtype.size() as u64
    }

    /// Parses the header at the start of `bytes` (the file's beginning).
    ///
    /// # Errors
    /// The [`NpyProblem`] that makes the header unreadable.
    pub fn parse(bytes: &[u8]) -> std::result::Result<NpyHeader, NpyProblem> {
        if bytes.len() < 8 || &bytes[..6] != MAGIC {
            return Err(NpyProblem::BadMagic);
        }
        let version = (bytes[6], bytes[7]);
        let (len_bytes, utf8) = match version {
            (1, 0) => (2, false),
            (2, 0) => (4, false),
            (3, 0) => (4, true),
            (major, minor) => return Err(NpyProblem::Version(major, minor)),
        };
        let start = 8 + len_bytes;
        let header_len = match bytes.get(8..start) {
            Some(b) if len_bytes == 2 => u16::from_le_bytes([b[0], b[1]]) as usize,
            Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize,
            None => return Err(NpyProblem::Header("file ends inside the header".into())),
        };
        let text = bytes
            .get(start..start + header_len)
            .ok_or_else(|| NpyProblem::Header("file ends inside the header".into()))?;
        let text = if utf8 {
            std::str::from_utf8(text).map_err(|e| NpyProblem::Header(format!("not UTF-8: {e}")))?
        } else {
            if !text.is_ascii() {
                return Err(NpyProblem::Header(
                    "not ASCII (version 1.0/2.0 header)".into(),
                ));
            }
            // SAFETY-free: ASCII is valid UTF-8.
            std::str::from_utf8(text).map_err(|e| NpyProblem::Header(e.to_string()))?
        };
        let dict = parse_dict(text)?;
        let descr = dict.descr.ok_or_else(|| missing("descr"))?;
        let fortran = dict.fortran_order.ok_or_else(|| missing("fortran_order"))?;
        let shape = dict.shape.ok_or_else(|| missing("shape"))?;
        let dtype = parse_descr(descr)?;
        // Fortran order lays out the same bytes as C order where at most one dimension
        // is over 1 (a 1-d token stream that `open_memmap(fortran_order=True)` wrote).
        if fortran && shape.iter().filter(|&&d| d > 1).count() > 1 {
            return Err(NpyProblem::FortranOrder);
        }
        if shape.is_empty() {
            return Err(NpyProblem::ZeroDim);
        }
        let header = NpyHeader {
            version,
            dtype,
            shape,
            data_offset: (start + header_len) as u64,
        };
        header.data_bytes()?;
        Ok(header)
    }

    /// Total bytes of the data, checked for overflow, as is the size of one row (which
    /// a zero first dimension would otherwise hide).
    fn data_bytes(&self) -> std::result::Result<u64, NpyProblem> {
        let fits = |dims: &[u64]| {
            dims.iter()
                .try_fold(self.dtype.size() as u64, |acc, &d| acc.checked_mul(d))
                .filter(|&b| b <= isize::MAX as u64)
        };
        fits(&self.shape[1..])
            .and_then(|_| fits(&self.shape))
            .ok_or_else(|| NpyProblem::Overflow(shape_string(&self.shape)))
    }
}

fn missing(key: &str) -> NpyProblem {
    NpyProblem::Header(format!("key '{key}' is missing"))
}

/// Formats a shape the way NumPy prints it: `(3,)`, `(2, 8, 8)`.
pub fn shape_string(shape: &[u64]) -> String {
    match shape {
        [one] => format!("({one},)"),
        _ => {
            let parts: Vec<String> = shape.iter().map(u64::to_string).collect();
            format!("({})", parts.join(", "))
        }
    }
}

fn parse_descr(descr: Value) -> std::result::Result<DType, NpyProblem> {
    let s = match descr {
        Value::Str(s) => s,
        Value::List => return Err(NpyProblem::DType("structured (a list of fields)".into())),
        other => {
            return Err(NpyProblem::Header(format!(
                "descr is {other:?}, not a string"
            )))
        }
    };
    let (order, code) = match s.chars().next() {
        Some(c @ ('<' | '>' | '|' | '=')) => (c, &s[1..]),
        _ => ('=', s.as_str()),
    };
    let dtype = match code {
        "b1" | "?" => DType::Bool,
        "u1" | "B" => DType::U8,
        "i1" | "b" => DType::I8,
        "u2" => DType::U16,
        "i2" => DType::I16,
        "u4" => DType::U32,
        "i4" => DType::I32,
        "u8" => DType::U64,
        "i8" => DType::I64,
        "f2" | "e" => DType::F16,
        "f4" => DType::F32,
        "f8" => DType::F64,
        "O" | "O8" | "O4" => return Err(NpyProblem::DType(format!("{s:?} (Python objects)"))),
        _ => return Err(NpyProblem::DType(format!("{s:?}"))),
    };
    if dtype.size() > 1 && (order == '>' || (order == '=' && cfg!(target_endian = "big"))) {
        return Err(NpyProblem::BigEndian(s));
    }
    Ok(dtype)
}

/// A value in the header dictionary.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<u64>),
    /// A list (a structured dtype's field list); its content is not kept.
    List,
}

#[derive(Default)]
struct Dict {
    descr: Option<Value>,
    fortran_order: Option<bool>,
    shape: Option<Vec<u64>>,
}

/// Parses the Python dict literal NumPy writes:
/// `{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`.
fn parse_dict(text: &str) -> std::result::Result<Dict, NpyProblem> {
    let mut p = Parser {
        s: text.trim_end_matches(['\n', ' ', '\0']).as_bytes(),
        i: 0,
    };
    let mut dict = Dict::default();
    p.expect(b'{')?;
    loop {
        p.skip_ws();
        if p.eat(b'}') {
            break;
        }
        let key = match p.value()? {
            Value::Str(k) => k,
            other => return Err(p.err(&format!("dictionary key {other:?} is not a string"))),
        };
        p.skip_ws();
        p.expect(b':')?;
        let value = p.value()?;
        match key.as_str() {
            "descr" => dict.descr = Some(value),
            "fortran_order" => match value {
                Value::Bool(b) => dict.fortran_order = Some(b),
                other => return Err(p.err(&format!("fortran_order is {other:?}"))),
            },
            "shape" => match value {
                Value::Tuple(t) => dict.shape = Some(t),
                other => return Err(p.err(&format!("shape is {other:?}, not a tuple"))),
            },
            other => return Err(p.err(&format!("unexpected key '{other}'"))),
        }
        p.skip_ws();
        if !p.eat(b',') {
            p.skip_ws();
            p.expect(b'}')?;
            break;
        }
    }
    p.skip_ws();
    if p.i != p.s.len() {
        return Err(p.err("text after the closing brace"));
    }
    Ok(dict)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn err(&self, what: &str) -> NpyProblem {
        NpyProblem::Header(format!("{what} (at byte {})", self.i))
    }

    fn skip_ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> std::result::Result<(), NpyProblem> {
        self.skip_ws();
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.err(&format!("expected '{}'", c as char)))
        }
    }

    fn value(&mut self) -> std::result::Result<Value, NpyProblem> {
        self.skip_ws();
        match self.s.get(self.i) {
            Some(&q @ (b'\'' | b'"')) => {
                self.i += 1;
                let start = self.i;
                while self.i < self.s.len() && self.s[self.i] != q {
                    if self.s[self.i] == b'\\' {
                        return Err(self.err("escapes in strings are not supported"));
                    }
                    self.i += 1;
                }
                if self.i == self.s.len() {
                    return Err(self.err("unterminated string"));
                }
                let s = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
                self.i += 1;
                Ok(Value::Str(s))
            }
            Some(b'(') => {
                self.i += 1;
                let mut dims = Vec::new();
                loop {
                    self.skip_ws();
                    if self.eat(b')') {
                        break;
                    }
                    let start = self.i;
                    while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
                        self.i += 1;
                    }
                    if start == self.i {
                        return Err(self.err("shape entries must be non-negative integers"));
                    }
                    let digits = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
                    let d = digits
                        .parse::<u64>()
                        .map_err(|_| NpyProblem::Overflow(format!("dimension {digits}")))?;
                    // NumPy writes Python ints; older writers append `L` to longs.
                    self.eat(b'L');
                    dims.push(d);
                    self.skip_ws();
                    if !self.eat(b',') {
                        self.expect(b')')?;
                        break;
                    }
                }
                Ok(Value::Tuple(dims))
            }
            Some(b'[') => {
                // A structured dtype's field list: skip to the matching bracket.
                let mut depth = 0usize;
                while let Some(&c) = self.s.get(self.i) {
                    self.i += 1;
                    match c {
                        b'[' | b'(' => depth += 1,
                        b']' | b')' => {
                            depth -= 1;
                            if depth == 0 {
                                return Ok(Value::List);
                            }
                        }
                        _ => {}
                    }
                }
                Err(self.err("unterminated list"))
            }
            _ => {
                for (word, v) in [("True", true), ("False", false)] {
                    if self.s[self.i..].starts_with(word.as_bytes()) {
                        self.i += word.len();
                        return Ok(Value::Bool(v));
                    }
                }
                Err(self.err("expected a string, a tuple, True or False"))
            }
        }
    }
}

/// A `.npy` array mapped read-only into memory.
#[derive(Debug)]
pub struct NpyArray {
    path: PathBuf,
    header: NpyHeader,
    map: Mmap,
    watched: Watched,
}

impl NpyArray {
    /// Opens and validates `path`.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be opened or mapped, [`Error::Npy`] naming the
    /// file and the problem if it is not a `.npy` file stokehold reads.
    pub fn open(path: impl AsRef<Path>) -> Result<NpyArray> {
        let path = path.as_ref();
        let (watched, map) = super::open_mapped(path, || Error::npy(path, NpyProblem::BadMagic))?;
        let header = NpyHeader::parse(&map).map_err(|p| Error::npy(path, p))?;
        let expected = header.data_bytes().map_err(|p| Error::npy(path, p))?;
        let actual = (map.len() as u64).saturating_sub(header.data_offset);
        if actual < expected {
            return Err(Error::npy(path, NpyProblem::Truncated { expected, actual }));
        }
        if actual > expected {
            return Err(Error::npy(
                path,
                NpyProblem::TrailingBytes {
                    extra: actual - expected,
                },
            ));
        }
        Ok(NpyArray {
            path: path.to_path_buf(),
            header,
            map,
            watched,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header.
    pub fn header(&self) -> &NpyHeader {
        &self.header
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.header.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[u64] {
        &self.header.shape
    }

    /// Number of samples (the first axis).
    pub fn rows(&self) -> u64 {
        self.header.rows()
    }

    /// Bytes per sample.
    pub fn row_bytes(&self) -> usize {
        self.header.row_bytes() as usize
    }

    /// The array's data bytes (C order, little-endian), straight from the mapping.
    ///
    /// If another process truncates the file meanwhile, touching a vanished page raises
    /// `SIGBUS`; [`read`](NpyArray::read) turns that into an error.
    pub fn data(&self) -> &[u8] {
        &self.map[self.header.data_offset as usize..]
    }

    /// Runs `read` over the data bytes, first checking that the file is unchanged since
    /// it was opened, and guarded against its pages vanishing during the read (another
    /// process truncating the file). Loader gathers read this way.
    ///
    /// # Errors
    /// [`Error::Dataset`] naming the file if it changed (length or modification time) or
    /// a page of it could not be read; the array then stays in error.
    pub fn read<R>(&self, read: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let offset = self.header.data_offset as usize;
        self.watched.read(&self.map, |map| read(&map[offset..]))
    }

    /// The watched file and its mapping, for a dataset built on this array.
    pub(crate) fn into_parts(self) -> (Watched, Mmap) {
        (self.watched, self.map)
    }

    /// The whole mapping, header included (for page-cache residency and advice).
    pub fn mapping(&self) -> &Mmap {
        &self.map
    }

    /// The open file behind the mapping, watched for changes.
    pub(crate) fn watched(&self) -> &Watched {
        &self.watched
    }

    /// The bytes of sample `index`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if `index >= rows()`.
    pub fn row(&self, index: u64) -> Result<&[u8]> {
        let rb = self.row_bytes();
        if index >= self.rows() {
            return Err(Error::OutOfRange {
                index,
                len: self.rows(),
            });
        }
        let start = index as usize * rb;
        Ok(&self.data()[start..start + rb])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(dict: &str, version: u8) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.extend_from_slice(&[version, 0]);
        if version == 1 {
            v.extend_from_slice(&(dict.len() as u16).to_le_bytes());
        } else {
            v.extend_from_slice(&(dict.len() as u32).to_le_bytes());
        }
        v.extend_from_slice(dict.as_bytes());
        v
    }

    #[test]
    fn parses_what_numpy_writes() {
        let h = NpyHeader::parse(&header(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }   \n",
            1,
        ))
        .unwrap();
        assert_eq!(h.dtype, DType::F32);
        assert_eq!(h.shape, vec![3, 4]);
        assert_eq!(h.row_bytes(), 16);
        let h = NpyHeader::parse(&header(
            "{'descr': '|u1', 'fortran_order': False, 'shape': (7,), }\n",
            3,
        ))
        .unwrap();
        assert_eq!(
            (h.dtype, h.shape.as_slice(), h.version),
            (DType::U8, &[7u64][..], (3, 0))
        );
    }

    #[test]
    fn rejects_bad_headers() {
        let p = |d: &str| NpyHeader::parse(&header(d, 1)).unwrap_err();
        assert_eq!(
            p("{'descr': '>f4', 'fortran_order': False, 'shape': (3,), }"),
            NpyProblem::BigEndian(">f4".into())
        );
        assert_eq!(
            p("{'descr': '<f4', 'fortran_order': True, 'shape': (3, 4), }"),
            NpyProblem::FortranOrder
        );
        // One dimension over 1: the same bytes in either order.
        for (shape, want) in [
            ("(3,)", &[3u64][..]),
            ("(1, 5)", &[1, 5]),
            ("(4, 1, 1)", &[4, 1, 1]),
        ] {
            let d = format!("{{'descr': '<f4', 'fortran_order': True, 'shape': {shape}, }}");
            let h = NpyHeader::parse(&header(&d, 1)).unwrap();
            assert_eq!(h.shape, want, "{shape}");
        }
        assert_eq!(
            p("{'descr': '<f4', 'fortran_order': False, 'shape': (), }"),
            NpyProblem::ZeroDim
        );
        assert!(matches!(
            p("{'descr': '|O', 'fortran_order': False, 'shape': (3,), }"),
            NpyProblem::DType(_)
        ));
        assert!(matches!(
            p("{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (3,), }"),
            NpyProblem::DType(_)
        ));
        assert!(matches!(p("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999, 999999), }"), NpyProblem::Overflow(_)));
        assert!(matches!(
            p("{'descr': '<f4', 'shape': (3,), }"),
            NpyProblem::Header(_)
        ));
        assert!(matches!(
            p("{'descr': '<f4' 'fortran_order': False}"),
            NpyProblem::Header(_)
        ));
        assert!(matches!(p("garbage"), NpyProblem::Header(_)));
        // Zero rows must not hide a row size that overflows.
        assert!(matches!(
            p("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 4294967296, 4294967296), }"),
            NpyProblem::Overflow(_)
        ));
        assert_eq!(
            NpyHeader::parse(b"\x93NUMPX\x01\x00"),
            Err(NpyProblem::BadMagic)
        );
        assert_eq!(
            NpyHeader::parse(b"\x93NUMPY\x04\x00"),
            Err(NpyProblem::Version(4, 0))
        );
        assert!(matches!(
            NpyHeader::parse(b"\x93NUMPY\x01\x00\xff\x00{"),
            Err(NpyProblem::Header(_))
        ));
    }

    #[test]
    fn shape_strings() {
        assert_eq!(shape_string(&[3]), "(3,)");
        assert_eq!(shape_string(&[2, 8, 8]), "(2, 8, 8)");
    }
}
