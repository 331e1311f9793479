//! Element types of dataset columns.

use std::fmt;

/// The element type of a column, as NumPy names it.
///
/// `F16` is carried as raw 2-byte values: stokehold copies it and never does arithmetic on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// `|b1`
    Bool,
    /// `|u1`
    U8,
    /// `|i1`
    I8,
    /// `<u2`
    U16,
    /// `<i2`
    I16,
    /// `<u4`
    U32,
    /// `<i4`
    I32,
    /// `<u8`
    U64,
    /// `<i8`
    I64,
    /// `<f2`, as raw bits
    F16,
    /// `<f4`
    F32,
    /// `<f8`
    F64,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// NumPy's name: `uint8`, `float32`...
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::U16 => "uint16",
            DType::I16 => "int16",
            DType::U32 => "uint32",
            DType::I32 => "int32",
            DType::U64 => "uint64",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    /// The little-endian `descr` NumPy writes for this type (`<f4`, `|u1`...).
    pub const fn descr(self) -> &'static str {
        match self {
            DType::Bool => "|b1",
            DType::U8 => "|u1",
            DType::I8 => "|i1",
            DType::U16 => "<u2",
            DType::I16 => "<i2",
            DType::U32 => "<u4",
            DType::I32 => "<i4",
            DType::U64 => "<u8",
            DType::I64 => "<i8",
            DType::F16 => "<f2",
            DType::F32 => "<f4",
            DType::F64 => "<f8",
        }
    }

    /// Every type, in the order declared.
    pub const ALL: [DType; 12] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
        DType::F16,
        DType::F32,
        DType::F64,
    ];

    /// The type NumPy calls `name` (`uint16`, `float32`...), as [`name`](DType::name)
    /// gives it.
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Whether the type is an integer type (bool excluded).
    pub const fn is_integer(self) -> bool {
        matches!(
            self,
            DType::U8
                | DType::I8
                | DType::U16
                | DType::I16
                | DType::U32
                | DType::I32
                | DType::U64
                | DType::I64
        )
    }

    /// Reads one element at `bytes[..self.size()]` as an `i64` (integers and bool only).
    ///
    /// Returns `None` for floating-point types or a slice that is too short.
    pub fn read_i64(self, bytes: &[u8]) -> Option<i64> {
        let b = bytes.get(..self.size())?;
        Some(match self {
            DType::Bool | DType::U8 => b[0] as i64,
            DType::I8 => b[0] as i8 as i64,
            DType::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            DType::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            DType::U32 => u32::from_le_bytes(b.try_into().ok()?) as i64,
            DType::I32 => i32::from_le_bytes(b.try_into().ok()?) as i64,
            DType::U64 => u64::from_le_bytes(b.try_into().ok()?) as i64,
            DType::I64 => i64::from_le_bytes(b.try_into().ok()?),
            DType::F16 | DType::F32 | DType::F64 => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type a column can be viewed as without copying.
///
/// Implemented for the primitive types matching each [`DType`]; `u16` also views
/// `float16` columns (as raw bits) and `u8` views `bool` columns.
///
/// # Safety (for the crate)
/// Every implementor is a plain integer or float type: any bit pattern is a valid value,
/// so a byte buffer of the right length and alignment can be viewed as a slice of it.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The Rust name, for error messages.
    const NAME: &'static str;
    /// Whether a column of `dtype` can be viewed as this type.
    fn accepts(dtype: DType) -> bool;
}

macro_rules! element {
    ($t:ty, $($d:ident),+) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const NAME: &'static str = stringify!($t);
            fn accepts(dtype: DType) -> bool {
                matches!(dtype, $(DType::$d)|+)
            }
        }
    };
}

element!(u8, U8, Bool);
element!(i8, I8);
element!(u16, U16, F16);
element!(i16, I16);
element!(u32, U32);
element!(i32, I32);
element!(u64, U64);
element!(i64, I64);
element!(f32, F32);
element!(f64, F64);
