//! A dataset for the unit tests of datasets built over others (no file behind it).

use std::sync::Arc;

use super::{Column, DType, Dataset};
use crate::error::{Error, Result};

/// `n` samples in one `u16` column: sample `i` is `base + i`, in file 0's bytes
/// `2 * i..2 * i + 2` (as `locate` says; no file is mapped). It gives lengths (`i`)
/// where `base > 0`.
pub(crate) struct Counting {
    base: u16,
    n: u64,
    columns: Vec<Column>,
}

/// A [`Counting`] dataset whose column is called `name`.
pub(crate) fn part(base: u16, n: u64, name: &str) -> Arc<dyn Dataset> {
    let columns = vec![Column {
        name: name.into(),
        dtype: DType::U16,
        shape: vec![],
        row_bytes: 2,
    }];
    Arc::new(Counting { base, n, columns })
}

impl Dataset for Counting {
    fn len(&self) -> u64 {
        self.n
    }
    fn columns(&self) -> &[Column] {
        &self.columns
    }
    fn gather(&self, _: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        for (k, &i) in indices.iter().enumerate() {
            if i >= self.n {
                return Err(Error::OutOfRange {
                    index: i,
                    len: self.n,
                });
            }
            let v = self.base.wrapping_add(i as u16);
            out[0][2 * k..2 * k + 2].copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }
    fn lengths(&self) -> Result<Option<Vec<u32>>> {
        Ok((self.base > 0).then(|| (0..self.n as u32).collect()))
    }
    fn locate(&self, _: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        each(0, 2 * index as usize, 2);
    }
}
