//! Fitting a classifier's data-dependent settings: input normalisation and class count.

use super::Normalize;
use crate::dataset::{DType, NpyDataset};
use crate::error::{Error, Result};

/// Classes allowed whatever the sample count (more only with as many samples).
const MAX_CLASSES: u64 = 65_536;

/// What a classifier over `ds` needs from the data: the input normalisation (from the
/// first 512 samples of column 0) and the number of classes (largest label of column 1,
/// read straight from its file, plus one).
///
/// # Errors
/// [`Error::Dataset`] naming the file when the inputs are not `uint8` or there is no
/// `int64` label column (saying what the file holds instead), or naming
/// the row of a label that is negative or beyond both the sample count and 65,536.
pub fn fit_classifier(ds: &NpyDataset) -> Result<(Normalize, usize)> {
    let (inputs, labels) = match ds.arrays() {
        [x, y, ..] => (x, y),
        [x] => {
            return Err(Error::dataset(
                x.path(),
                "needs a second column of labels (y.npy)",
            ))
        }
        [] => return Err(Error::Config("a dataset needs at least one column".into())),
    };
    let holds = |a: &crate::dataset::NpyArray| {
        let per_row = a.row_bytes() / a.dtype().size();
        format!("this file holds {per_row} {} per sample", a.dtype())
    };
    if inputs.dtype() != DType::U8 {
        return Err(Error::dataset(
            inputs.path(),
            format!("inputs must be uint8 values; {}", holds(inputs)),
        ));
    }
    if labels.dtype() != DType::I64 || labels.row_bytes() != 8 {
        return Err(Error::dataset(
            labels.path(),
            format!("labels must be one int64 per sample; {}", holds(labels)),
        ));
    }
    // Classes are the largest label plus one: a label far beyond the samples (a stray
    // 10^12, or i64::MAX) would make a model of that many classes, so it is refused with
    // its row.
    let limit = labels.rows().max(MAX_CLASSES);
    let max = labels.read(|data| {
        let values = data.chunks_exact(8);
        let labels_of = values.map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")));
        let mut max = 0i64;
        for (row, l) in labels_of.enumerate() {
            if l < 0 || l as u64 >= limit {
                return Err(match l < 0 {
                    true => format!("negative label {l} at row {row}"),
                    false => format!(
                        "label {l} at row {row} is far beyond the {} samples: classes are \
                         the largest label plus one, and at most {limit} are allowed",
                        labels.rows()
                    ),
                });
            }
            max = max.max(l);
        }
        Ok(max)
    })?;
    let max = max.map_err(|problem| Error::dataset(labels.path(), problem))?;
    let sample = inputs.rows().min(512) as usize * inputs.row_bytes();
    let norm = inputs.read(|data| Normalize::fit(&data[..sample]))?;
    Ok((norm, (max + 1).max(2) as usize))
}
