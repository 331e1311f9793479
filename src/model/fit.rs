//! Fitting a classifier's data-dependent settings: input normalisation and class count.

use super::Normalize;
use crate::dataset::{DType, NpyDataset};
use crate::error::{Error, Result};

/// What a classifier over `ds` needs from the data: the input normalisation (from the
/// first 512 samples of column 0) and the number of classes (largest label of column 1,
/// read straight from its file, plus one).
///
/// # Errors
/// [`Error::Dataset`] naming the file when there is no `int64` label column or a label
/// is negative.
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
    if labels.dtype() != DType::I64 || labels.row_bytes() != 8 {
        return Err(Error::dataset(
            labels.path(),
            "labels must be one int64 per sample",
        ));
    }
    let max = labels
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
        .try_fold(0i64, |m, l| if l < 0 { Err(l) } else { Ok(m.max(l)) })
        .map_err(|l| Error::dataset(labels.path(), format!("negative label {l}")))?;
    let sample = inputs.rows().min(512) as usize * inputs.row_bytes();
    Ok((
        Normalize::fit(&inputs.data()[..sample]),
        (max + 1).max(2) as usize,
    ))
}
