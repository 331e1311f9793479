//! Several datasets with the same columns, served one after another: the shards of a
//! table (`data-00000-of-00004.arrow`, ...), or sets joined for one run.

use std::sync::Arc;

use super::{check_out, Column, Dataset, MappedFile};
use crate::error::{Error, Result};
use crate::util::fold;

/// The samples of `parts`, in order, renumbered from 0: sample `i` of the second part
/// is sample `parts[0].len() + i` of the whole.
///
/// Each part keeps its files, its storage ranges and its per-epoch samples, so a loader
/// over the whole plans its reads and shuffles across parts as over one dataset.
///
/// ```
/// # fn main() -> stokehold::Result<()> {
/// use std::sync::Arc;
/// use stokehold::{Concat, Dataset, NpyDataset};
///
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
/// let part = || -> stokehold::Result<Arc<dyn Dataset>> { Ok(Arc::new(NpyDataset::open(dir)?)) };
/// let twice = Concat::new(vec![part()?, part()?])?;
/// assert_eq!(twice.len(), 2 * 1797);
/// # Ok(())
/// # }
/// ```
pub struct Concat {
    parts: Vec<Arc<dyn Dataset>>,
    /// `ends[p]`: the samples of parts `0..=p`.
    ends: Vec<u64>,
    /// `files_before[p]`: the files of parts `0..p`, where part `p`'s are numbered from.
    files_before: Vec<usize>,
    /// `listed[k]`: where the parts' `k`th file is among [`files`](Dataset::files),
    /// which lists a mapping that several parts share (parts over one dataset) once:
    /// read ahead, counted and evicted once, not planned as two files.
    listed: Vec<usize>,
    /// The files listed: `(part, its file)`, each mapping at its first place.
    unique: Vec<(usize, usize)>,
}

impl Concat {
    /// `parts`, one after another.
    ///
    /// # Errors
    /// [`Error::Config`] for no parts, or a part whose columns differ from the first
    /// part's (name, type or shape), naming both.
    pub fn new(parts: Vec<Arc<dyn Dataset>>) -> Result<Concat> {
        Concat::named(parts, "concatenation")
    }

    /// [`Concat::new`], with the joined set called `what` in errors ("a mix").
    pub(crate) fn named(parts: Vec<Arc<dyn Dataset>>, what: &str) -> Result<Concat> {
        let Some(first) = parts.first() else {
            return Err(Error::Config(format!("a {what} needs a part at least")));
        };
        let describe = |c: &[Column]| {
            c.iter()
                .map(|c| format!("{} {} {:?}", c.name, c.dtype, c.shape))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if let Some((p, part)) = parts
            .iter()
            .enumerate()
            .find(|(_, part)| part.columns() != first.columns())
        {
            return Err(Error::Config(format!(
                "part {p} of a {what} has the columns [{}], part 0 [{}]",
                describe(part.columns()),
                describe(first.columns())
            )));
        }
        let (mut ends, mut files_before) = (Vec::new(), Vec::new());
        let (mut listed, mut unique) = (Vec::new(), Vec::new());
        let mut first = std::collections::HashMap::new();
        let mut samples = 0u64;
        for (p, part) in parts.iter().enumerate() {
            files_before.push(listed.len());
            samples = samples
                .checked_add(part.len())
                .ok_or_else(|| Error::Config(format!("a {what} of more than 2^64 samples")))?;
            for (f, file) in part.files().iter().enumerate() {
                let bytes = file.bytes();
                let at = *first
                    .entry((bytes.as_ptr() as usize, bytes.len()))
                    .or_insert_with(|| {
                        unique.push((p, f));
                        unique.len() - 1
                    });
                listed.push(at);
            }
            ends.push(samples);
        }
        Ok(Concat {
            parts,
            ends,
            files_before,
            listed,
            unique,
        })
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[Arc<dyn Dataset>] {
        &self.parts
    }

    /// The samples of the parts before part `p`: sample `i` of part `p` is sample
    /// `start(p) + i` of the whole.
    pub(crate) fn start(&self, p: usize) -> u64 {
        p.checked_sub(1).map_or(0, |q| self.ends[q])
    }

    /// The part holding sample `index`, and the sample's index in it.
    fn part_of(&self, index: u64) -> Option<(usize, u64)> {
        let p = self.ends.partition_point(|&end| end <= index);
        (p < self.parts.len()).then(|| (p, index - self.start(p)))
    }
}

impl Dataset for Concat {
    /// Covers the parts in order: each one's length and fingerprint.
    fn fingerprint(&self) -> u64 {
        fold(self.parts.iter().flat_map(|p| [p.len(), p.fingerprint()]))
    }

    fn same_every_epoch(&self) -> bool {
        self.parts.iter().all(|p| p.same_every_epoch())
    }

    fn len(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    fn columns(&self) -> &[Column] {
        self.parts[0].columns()
    }

    /// Gathers each run of consecutive samples that lie in one part with one call of
    /// that part's gather, straight into `out`.
    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        let columns = self.columns();
        check_out(columns, indices.len(), out)?;
        let mut located = Vec::with_capacity(indices.len());
        for &index in indices {
            let found = self.part_of(index).ok_or(Error::OutOfRange {
                index,
                len: self.len(),
            })?;
            located.push(found);
        }
        let mut local = Vec::new();
        let mut start = 0;
        while start < located.len() {
            let part = located[start].0;
            let run = located[start..].iter().take_while(|&&(p, _)| p == part);
            let end = start + run.count();
            local.clear();
            local.extend(located[start..end].iter().map(|&(_, i)| i));
            let mut rows: Vec<&mut [u8]> = out
                .iter_mut()
                .zip(columns)
                .map(|(o, c)| &mut o[start * c.row_bytes..end * c.row_bytes])
                .collect();
            self.parts[part].gather(epoch, &local, &mut rows)?;
            start = end;
        }
        Ok(())
    }

    fn files(&self) -> Vec<MappedFile<'_>> {
        let parts: Vec<_> = self.parts.iter().map(|p| p.files()).collect();
        self.unique.iter().map(|&(p, f)| parts[p][f]).collect()
    }

    /// The parts' lengths one after another; `None` if no part has any.
    ///
    /// # Errors
    /// [`Error::Config`] if some parts give lengths and others do not; whatever a part
    /// reports.
    fn lengths(&self) -> Result<Option<Vec<u32>>> {
        let mut all: Option<Vec<u32>> = None;
        for (p, part) in self.parts.iter().enumerate() {
            let lengths = part.lengths()?;
            if let Some(l) = &lengths {
                if l.len() as u64 != part.len() {
                    return Err(Error::Config(format!(
                        "part {p} of a concatenation gave {} lengths for {} samples",
                        l.len(),
                        part.len()
                    )));
                }
            }
            match (lengths, &mut all) {
                (Some(l), Some(all)) => all.extend(l),
                (Some(l), None) if p == 0 => all = Some(l),
                (None, None) => {}
                _ => {
                    return Err(Error::Config(format!(
                        "part {p} of a concatenation gives its samples' lengths and an \
                         earlier part does not, or the other way round"
                    )))
                }
            }
        }
        Ok(all)
    }

    fn locate(&self, epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        if let Some((p, local)) = self.part_of(index) {
            let before = self.files_before[p];
            self.parts[p].locate(epoch, local, &mut |f, offset, len| {
                // A file the part does not list is passed on as it is (past the list).
                let k = before + f;
                each(self.listed.get(k).copied().unwrap_or(k), offset, len)
            });
        }
    }
}

impl std::fmt::Debug for Concat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Concat")
            .field("parts", &self.parts.len())
            .field("samples", &self.len())
            .field("columns", &self.columns())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::counting::part;

    fn values(c: &Concat, indices: &[u64]) -> Vec<u16> {
        let mut out = vec![0u8; 2 * indices.len()];
        c.gather(0, indices, &mut [&mut out[..]]).unwrap();
        out.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    #[test]
    fn samples_follow_the_parts_in_order_in_any_gather() {
        let c = Concat::new(vec![
            part(100, 3, "t"),
            part(200, 0, "t"),
            part(300, 4, "t"),
        ])
        .unwrap();
        assert_eq!(c.len(), 7);
        assert_eq!(
            values(&c, &[0, 1, 2, 3, 4, 5, 6]),
            [100, 101, 102, 300, 301, 302, 303]
        );
        assert_eq!(
            values(&c, &[6, 0, 5, 5, 2, 3]),
            [303, 100, 302, 302, 102, 300]
        );
        let mut out = [0u8; 2];
        let e = c.gather(0, &[7], &mut [&mut out[..]]).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { index: 7, len: 7 }), "{e}");
        let mut at = Vec::new();
        c.locate(0, 4, &mut |f, off, len| at.push((f, off, len)));
        c.locate(0, 7, &mut |f, off, len| at.push((f, off, len)));
        assert_eq!(at, [(0, 2, 2)]);
        assert_eq!(c.lengths().unwrap(), Some(vec![0, 1, 2, 0, 1, 2, 3]));
    }

    #[test]
    fn parts_over_one_dataset_list_its_files_once() {
        use crate::dataset::{DType, NpyDataset, Subset};
        let dir = tempfile::tempdir().unwrap();
        let mut w =
            crate::gen::NpyWriter::create(dir.path().join("x.npy"), DType::U16, &[10]).unwrap();
        for (i, b) in w.data_mut().chunks_exact_mut(2).enumerate() {
            b.copy_from_slice(&(i as u16).to_le_bytes());
        }
        w.finish().unwrap();
        let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(dir.path().join("x.npy")).unwrap());
        let sub = |r| Arc::new(Subset::new(Arc::clone(&ds), r).unwrap()) as Arc<dyn Dataset>;
        let c = Concat::new(vec![sub(0..4), sub(6..10), part(1, 2, "x")]).unwrap();
        assert_eq!(c.files().len(), 1);
        assert_eq!(
            c.files()[0].bytes().as_ptr(),
            ds.files()[0].bytes().as_ptr()
        );
        // Sample 5 (the second part's second, the file's row 7) is located in file 0, where
        // the file itself locates row 7; the counting part's ranges stay past the list.
        let at = |i| {
            let mut at = Vec::new();
            c.locate(0, i, &mut |f, off, len| at.push((f, off, len)));
            at
        };
        let mut row7 = Vec::new();
        ds.locate(0, 7, &mut |f, off, len| row7.push((f, off, len)));
        assert_eq!(at(5), row7);
        assert_eq!(at(9), [(2, 2, 2)]);
        assert_eq!(values(&c, &[0, 5, 9]), [0, 7, 2]);
    }

    #[test]
    fn parts_must_agree() {
        let e = Concat::new(vec![part(1, 3, "t"), part(2, 3, "u")]).unwrap_err();
        assert!(
            e.to_string()
                .contains("part 1 of a concatenation has the columns [u uint16 []]"),
            "{e}"
        );
        assert!(Concat::new(Vec::new()).is_err());
        // Lengths from some parts only.
        let c = Concat::new(vec![part(1, 3, "t"), part(0, 3, "t")]).unwrap();
        assert!(c.lengths().unwrap_err().to_string().contains("part 1"));
        let c = Concat::new(vec![part(0, 3, "t"), part(0, 3, "t")]).unwrap();
        assert_eq!(c.lengths().unwrap(), None);
    }
}
