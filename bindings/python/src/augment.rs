//! `augment=`: what the Python `stokehold.Augment` hands over, as a `stokehold::Augment`,
//! and its draws.

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

/// The fields of a Python `stokehold.Augment`, in the order its `_args()` gives them:
/// column, seed, crop, flip, fill, channels_last, mean, std.
#[derive(FromPyObject)]
pub(crate) struct Args(
    String,
    u64,
    u32,
    bool,
    u8,
    bool,
    Option<Vec<f32>>,
    Option<Vec<f32>>,
);

impl Args {
    /// The augmentation these fields describe.
    pub(crate) fn augment(self) -> stokehold::Augment {
        let Args(column, seed, crop, flip, fill, last, mean, std) = self;
        let mut a = stokehold::Augment::new(column, seed)
            .crop(crop)
            .flip(flip)
            .fill(fill)
            .channels_last(last);
        if let (Some(mean), Some(std)) = (mean, std) {
            a = a.normalize(&mean, &std);
        }
        a
    }
}

/// The draws of the samples `indices` of `epoch`: `(dy, dx, flip)` as three arrays
/// (`int32`, `int32`, `bool`).
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn _augment_draws<'py>(
    py: Python<'py>,
    args: Args,
    epoch: u64,
    indices: Vec<u64>,
) -> (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<bool>>,
) {
    let a = args.augment();
    let draws: Vec<stokehold::Draw> = indices.iter().map(|&i| a.draw(epoch, i)).collect();
    (
        draws
            .iter()
            .map(|d| d.dy)
            .collect::<Vec<_>>()
            .into_pyarray(py),
        draws
            .iter()
            .map(|d| d.dx)
            .collect::<Vec<_>>()
            .into_pyarray(py),
        draws
            .iter()
            .map(|d| d.flip)
            .collect::<Vec<_>>()
            .into_pyarray(py),
    )
}
