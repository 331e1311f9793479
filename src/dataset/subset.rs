//! A contiguous range of another dataset's samples: a hold-out split, or one device's
//! part of a dataset (burn's `DataLoader::slice`).

use std::ops::Range;
use std::sync::Arc;

use super::{Column, Dataset, MappedFile};
use crate::error::{Error, Result};
use crate::util::fold;

/// Samples `range` of another dataset, renumbered from 0.
///
/// Sample `i` of the subset is sample `range.start + i` of the dataset it was cut from,
/// with the same bytes, files and storage ranges, so a loader over a subset plans its
/// reads and reads its rows straight from storage exactly as over the whole set.
///
/// ```
/// # fn main() -> stokehold::Result<()> {
/// use stokehold::{Dataset, NpyDataset, Subset};
///
/// let digits = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
/// let n = digits.len();
/// let digits: std::sync::Arc<dyn Dataset> = std::sync::Arc::new(digits);
/// let train = Subset::new(digits.clone(), 0..n - 297)?;
/// let held_out = Subset::new(digits, n - 297..n)?;
/// assert_eq!((train.len(), held_out.len()), (1500, 297));
/// # Ok(())
/// # }
/// ```
pub struct Subset {
    inner: Arc<dyn Dataset>,
    start: u64,
    len: u64,
}

impl Subset {
    /// Samples `range` of `inner`.
    ///
    /// # Errors
    /// [`Error::Config`] for a range that is empty, reversed or past the dataset's end.
    pub fn new(inner: Arc<dyn Dataset>, range: Range<u64>) -> Result<Subset> {
        if range.start >= range.end || range.end > inner.len() {
            return Err(Error::Config(format!(
                "samples {}..{} of a dataset of {}: a subset needs a non-empty range inside it",
                range.start,
                range.end,
                inner.len()
            )));
        }
        Ok(Subset {
            inner,
            start: range.start,
            len: range.end - range.start,
        })
    }

    /// The samples of the dataset it was cut from.
    pub fn range(&self) -> Range<u64> {
        self.start..self.start + self.len
    }
}

impl Dataset for Subset {
    /// Covers where the range starts in the dataset it was cut from, and that dataset.
    fn fingerprint(&self) -> u64 {
        fold([self.start, self.inner.len(), self.inner.fingerprint()])
    }

    fn same_every_epoch(&self) -> bool {
        self.inner.same_every_epoch()
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn columns(&self) -> &[Column] {
        self.inner.columns()
    }

    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        let shifted = indices
            .iter()
            .map(|&i| match i < self.len {
                true => Ok(i + self.start),
                false => Err(Error::OutOfRange {
                    index: i,
                    len: self.len,
                }),
            })
            .collect::<Result<Vec<u64>>>()?;
        self.inner.gather(epoch, &shifted, out)
    }

    fn files(&self) -> Vec<MappedFile<'_>> {
        self.inner.files()
    }

    fn lengths(&self) -> Result<Option<Vec<u32>>> {
        let (start, len) = (self.start as usize, self.len as usize);
        match self.inner.lengths()? {
            None => Ok(None),
            Some(l) => match l.get(start..start + len) {
                Some(part) => Ok(Some(part.to_vec())),
                None => Err(Error::Config(format!(
                    "the dataset gave {} lengths for {} samples",
                    l.len(),
                    self.inner.len()
                ))),
            },
        }
    }

    fn locate(&self, epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        if index < self.len {
            self.inner.locate(epoch, index + self.start, each);
        }
    }
}

impl std::fmt::Debug for Subset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subset")
            .field("range", &self.range())
            .field("columns", &self.inner.columns())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::DType;

    /// Sample `i` is the byte `i`, in one u8 column.
    struct Bytes(Vec<Column>, u64);

    impl Dataset for Bytes {
        fn len(&self) -> u64 {
            self.1
        }
        fn columns(&self) -> &[Column] {
            &self.0
        }
        fn gather(&self, _: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
            for (k, &i) in indices.iter().enumerate() {
                if i >= self.1 {
                    return Err(Error::OutOfRange {
                        index: i,
                        len: self.1,
                    });
                }
                out[0][k] = i as u8;
            }
            Ok(())
        }
        fn locate(&self, _: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
            each(0, index as usize, 1);
        }
    }

    fn bytes(n: u64) -> Arc<dyn Dataset> {
        let column = Column {
            name: "b".into(),
            dtype: DType::U8,
            shape: vec![],
            row_bytes: 1,
        };
        Arc::new(Bytes(vec![column], n))
    }

    #[test]
    fn samples_are_the_range_renumbered_from_zero() {
        let s = Subset::new(bytes(100), 40..50).unwrap();
        assert_eq!(s.len(), 10);
        let mut out = [0u8; 3];
        s.gather(0, &[0, 9, 4], &mut [&mut out[..]]).unwrap();
        assert_eq!(out, [40, 49, 44]);
        let mut at = Vec::new();
        s.locate(0, 2, &mut |f, off, len| at.push((f, off, len)));
        s.locate(0, 10, &mut |f, off, len| at.push((f, off, len)));
        assert_eq!(at, [(0, 42, 1)]);
    }

    #[test]
    fn indices_past_the_subset_and_bad_ranges_are_errors() {
        let s = Subset::new(bytes(100), 40..50).unwrap();
        let mut out = [0u8; 1];
        let e = s.gather(0, &[10], &mut [&mut out[..]]).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { index: 10, len: 10 }), "{e}");
        for (start, end) in [(5, 5), (6, 5), (90, 101)] {
            let e = Subset::new(bytes(100), start..end).unwrap_err();
            assert!(e.to_string().contains("subset"), "{e}");
        }
    }
}
