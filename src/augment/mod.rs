//! Image augmentation: a random crop (pad, then cut back to size), a horizontal flip and
//! a per-channel normalisation of a `uint8` image column, drawn for each sample from
//! `(seed, epoch, sample)`.
//!
//! The draw is a pure function of those three numbers, like the epoch's order: a batch
//! is augmented the same way whatever the worker count, after an exact or an elastic
//! resume, on any rank, and on the CPU ([`Augmenter::apply`], in the loader's workers)
//! or on the GPU (`kernels/augment.cu`, after the copy of the raw bytes).
//!
//! - [`Augment`]: what to do (the column, the crop's padding, the flip, the mean and
//!   standard deviation), given to
//!   [`LoaderBuilder::augment`](crate::LoaderBuilder::augment).
//! - [`Augmenter`]: the same, checked against a dataset's columns: the image's geometry,
//!   the columns the batches then have, and the table that normalises a byte.
//! - [`Draw`]: one sample's crop offset and flip.

mod host;

use crate::dataset::{Column, DType};
use crate::error::{Error, Result};
use crate::util::mix;

/// The largest crop padding: a draw's offsets fit an `i16`.
pub const MAX_PAD: u32 = 4096;

/// What to do to an image column, drawn per sample from `(seed, epoch, sample)`.
///
/// Torchvision's usual CIFAR training transform (`RandomCrop(32, padding=4)`,
/// `RandomHorizontalFlip()`, `ToTensor()`, `Normalize(mean, std)`) is
///
/// ```
/// use stokehold::Augment;
///
/// let augment = Augment::new("x", 7)
///     .crop(4)
///     .flip(true)
///     .normalize(&[0.4914, 0.4822, 0.4465], &[0.2470, 0.2435, 0.2616]);
/// let d = augment.draw(0, 12);
/// assert!(d.dy.abs() <= 4 && d.dx.abs() <= 4);
/// assert_eq!(d, augment.draw(0, 12)); // the same sample, epoch and seed: the same draw
/// ```
///
/// The padding's pixels have the value [`fill`](Augment::fill) (0 by default), and are
/// normalised like the image's. Without [`normalize`](Augment::normalize) the column
/// stays `uint8`; with it, it becomes `float32`, `(v / 255 - mean[c]) / std[c]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Augment {
    column: String,
    seed: u64,
    pad: u32,
    flip: bool,
    fill: u8,
    channels_last: bool,
    normalize: Option<(Vec<f32>, Vec<f32>)>,
}

/// One sample's draw: output pixel `(y, x)` is input pixel `(y + dy, x' + dx)`, where
/// `x' = width - 1 - x` when `flip` and `x` otherwise, or the fill value where that
/// falls outside the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw {
    /// Rows the crop moves down, in `-pad..=pad`.
    pub dy: i32,
    /// Columns the crop moves right, in `-pad..=pad`.
    pub dx: i32,
    /// Whether the image is mirrored left to right.
    pub flip: bool,
}

impl Augment {
    /// Nothing done yet to column `column`, with draws from `seed`: add
    /// [`crop`](Augment::crop), [`flip`](Augment::flip), [`normalize`](Augment::normalize).
    pub fn new(column: impl Into<String>, seed: u64) -> Augment {
        Augment {
            column: column.into(),
            seed,
            pad: 0,
            flip: false,
            fill: 0,
            channels_last: false,
            normalize: None,
        }
    }

    /// A random crop: the image padded by `pad` pixels on every side, then cut back to its
    /// size at a random offset (0 for none, the default).
    pub fn crop(mut self, pad: u32) -> Self {
        self.pad = pad;
        self
    }

    /// A horizontal flip, with probability one half.
    pub fn flip(mut self, yes: bool) -> Self {
        self.flip = yes;
        self
    }

    /// The value of the padding's pixels (0 by default).
    pub fn fill(mut self, value: u8) -> Self {
        self.fill = value;
        self
    }

    /// Whether the images are stored `(height, width, channels)`, as PIL and Keras keep
    /// them, rather than `(channels, height, width)` (the default, PyTorch's).
    pub fn channels_last(mut self, yes: bool) -> Self {
        self.channels_last = yes;
        self
    }

    /// Normalise each channel to `(v / 255 - mean[c]) / std[c]`, as `float32`; one value
    /// serves every channel.
    pub fn normalize(mut self, mean: &[f32], std: &[f32]) -> Self {
        self.normalize = Some((mean.to_vec(), std.to_vec()));
        self
    }

    /// The column it augments.
    pub fn column(&self) -> &str {
        &self.column
    }

    /// The seed of its draws.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The draw for sample `sample` of epoch `epoch`. A padding over [`MAX_PAD`], which
    /// [`bind`](Self::bind) refuses, draws as [`MAX_PAD`].
    pub fn draw(&self, epoch: u64, sample: u64) -> Draw {
        let h = mix(
            mix(mix(self.seed ^ 0x6175_676d) ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                ^ mix(sample),
        );
        let pad = self.pad.min(MAX_PAD);
        let span = 2 * u64::from(pad) + 1;
        // Both offsets are below `span`, at most 8,193: they fit an `i32`.
        Draw {
            dy: ((h & 0xff_ffff) % span) as i32 - pad as i32,
            dx: ((h >> 24 & 0xff_ffff) % span) as i32 - pad as i32,
            flip: self.flip && h >> 63 == 1,
        }
    }

    /// Checks this against a dataset's `columns` and prepares it.
    ///
    /// # Errors
    /// [`Error::Config`] naming the column for: no column of that name; a column that is
    /// not `uint8`, or not an image (`(height, width)`, or `(channels, height, width)`,
    /// `(height, width, channels)` with [`channels_last`](Augment::channels_last)); a
    /// padding over [`MAX_PAD`]; a mean or standard deviation that is not one value or
    /// one a channel, or not finite, or a standard deviation that is not positive.
    pub fn bind(&self, columns: &[Column]) -> Result<Augmenter> {
        let refuse = |problem: String| {
            Error::Config(format!("augmenting column {:?}: {problem}", self.column))
        };
        let Some(index) = columns.iter().position(|c| c.name == self.column) else {
            let names: Vec<&str> = columns.iter().map(|c| c.name.as_str()).collect();
            return Err(refuse(format!(
                "the dataset has no such column (it has {names:?})"
            )));
        };
        let col = &columns[index];
        if col.dtype != DType::U8 {
            return Err(refuse(format!(
                "images are uint8, this column is {}",
                col.dtype
            )));
        }
        let dims: Vec<usize> = col.shape.iter().map(|&d| d as usize).collect();
        let (channels, height, width) = match (dims.as_slice(), self.channels_last) {
            ([h, w], _) => (1, *h, *w),
            ([c, h, w], false) => (*c, *h, *w),
            ([h, w, c], true) => (*c, *h, *w),
            _ => {
                let layout = match self.channels_last {
                    true => "(height, width, channels)",
                    false => "(channels, height, width)",
                };
                return Err(refuse(format!(
                    "an image is (height, width) or {layout} a sample, this column is {}",
                    crate::dataset::shape_string(&col.shape)
                )));
            }
        };
        if channels == 0 || height == 0 || width == 0 {
            return Err(refuse("its images are empty".into()));
        }
        let pixels = channels
            .checked_mul(height)
            .and_then(|p| p.checked_mul(width));
        if pixels != Some(col.row_bytes) {
            return Err(refuse(format!(
                "a sample of shape {} has {} bytes, not {}",
                crate::dataset::shape_string(&col.shape),
                col.row_bytes,
                pixels.map_or("a number that fits".to_string(), |p| p.to_string())
            )));
        }
        if self.pad > MAX_PAD {
            return Err(refuse(format!(
                "a crop pads by at most {MAX_PAD} pixels, not {}",
                self.pad
            )));
        }
        let table = match &self.normalize {
            None => None,
            Some((mean, std)) => Some(table(channels, mean, std).map_err(refuse)?),
        };
        let mut output = columns.to_vec();
        if table.is_some() {
            output[index].dtype = DType::F32;
            output[index].row_bytes = col.row_bytes * 4;
        }
        Ok(Augmenter {
            augment: self.clone(),
            inputs: columns.to_vec(),
            index,
            channels,
            height,
            width,
            table,
            columns: output,
        })
    }
}

/// `channels` tables of 256 values: `(v / 255 - mean[c]) / std[c]`, computed in `f64`.
fn table(channels: usize, mean: &[f32], std: &[f32]) -> std::result::Result<Vec<f32>, String> {
    let per = |v: &[f32], what: &str| match v.len() {
        1 => Ok(vec![v[0]; channels]),
        n if n == channels => Ok(v.to_vec()),
        n => Err(format!(
            "{n} values of {what} for {channels} channels (give one, or one a channel)"
        )),
    };
    let (mean, std) = (per(mean, "mean")?, per(std, "std")?);
    if let Some(m) = mean.iter().find(|m| !m.is_finite()) {
        return Err(format!("a mean of {m} is not a number"));
    }
    if let Some(s) = std.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
        return Err(format!(
            "a standard deviation of {s} is not a positive number"
        ));
    }
    let mut out = Vec::with_capacity(channels * 256);
    for (m, s) in mean.iter().zip(&std) {
        out.extend(
            (0..256).map(|v| ((f64::from(v) / 255.0 - f64::from(*m)) / f64::from(*s)) as f32),
        );
    }
    Ok(out)
}

/// An [`Augment`] checked against a dataset's columns.
#[derive(Debug, Clone)]
pub struct Augmenter {
    augment: Augment,
    inputs: Vec<Column>,
    index: usize,
    channels: usize,
    height: usize,
    width: usize,
    table: Option<Vec<f32>>,
    columns: Vec<Column>,
}

impl Augmenter {
    /// What it does.
    pub fn augment(&self) -> &Augment {
        &self.augment
    }

    /// The index of the column it augments.
    pub fn column(&self) -> usize {
        self.index
    }

    /// The dataset's columns it was bound to.
    pub fn inputs(&self) -> &[Column] {
        &self.inputs
    }

    /// The columns of its batches: the dataset's, the augmented one `float32` when it
    /// normalises.
    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    /// `(channels, height, width)` of one image.
    pub fn geometry(&self) -> (usize, usize, usize) {
        (self.channels, self.height, self.width)
    }

    /// Whether the images are `(height, width, channels)`.
    pub fn channels_last(&self) -> bool {
        self.augment.channels_last
    }

    /// The padding's value.
    pub fn fill(&self) -> u8 {
        self.augment.fill
    }

    /// The normalisation as one table of 256 `float32` a channel (a byte `v` of channel
    /// `c` becomes `table[c * 256 + v]`), or `None` when the column stays `uint8`.
    pub fn table(&self) -> Option<&[f32]> {
        self.table.as_deref()
    }

    /// The draws of the samples `indices` of `epoch`.
    pub fn draws(&self, epoch: u64, indices: &[u64]) -> Vec<Draw> {
        indices
            .iter()
            .map(|&i| self.augment.draw(epoch, i))
            .collect()
    }
}

#[cfg(test)]
mod tests;
