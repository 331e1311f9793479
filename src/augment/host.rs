//! Augmentation on the CPU: what the loader's workers do to each gathered batch.

use super::{Augmenter, Draw};
use crate::error::{Error, Result};

impl Augmenter {
    /// Writes the batch `input` (the dataset's columns as gathered, `indices.len()` rows
    /// each) into `out` (this augmenter's [`columns`](Augmenter::columns)): the augmented
    /// column cropped, flipped and normalised sample by sample with the draws of
    /// `(epoch, indices[k])`, the other columns copied.
    ///
    /// # Errors
    /// [`Error::Config`] when `input` or `out` does not have one slice per column, each
    /// long enough for the rows.
    pub fn apply(
        &self,
        epoch: u64,
        indices: &[u64],
        input: &[&[u8]],
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        let n = indices.len();
        let cols = &self.columns;
        let short = |what: &str| {
            Error::Config(format!(
                "augment: the {what} does not hold {n} rows of the {} columns",
                cols.len()
            ))
        };
        if input.len() != cols.len() || out.len() != cols.len() {
            return Err(short("batch"));
        }
        for (c, (col, raw)) in cols.iter().zip(&self.inputs).enumerate() {
            let in_row = raw.row_bytes;
            if input[c].len() < n * in_row {
                return Err(short("input"));
            }
            if out[c].len() < n * col.row_bytes {
                return Err(short("output"));
            }
            if c != self.index {
                out[c][..n * in_row].copy_from_slice(&input[c][..n * in_row]);
            }
        }
        let (src, dst) = (input[self.index], &mut *out[self.index]);
        let image = self.channels * self.height * self.width;
        match &self.table {
            None => {
                for (k, &i) in indices.iter().enumerate() {
                    let d = self.augment.draw(epoch, i);
                    let (from, to) = (&src[k * image..][..image], &mut dst[k * image..][..image]);
                    self.image(from, to, d, |_| |v| v);
                }
            }
            Some(table) => {
                let lut = |c: usize| -> &[f32; 256] {
                    table[c * 256..][..256]
                        .try_into()
                        .expect("a table of 256 values a channel")
                };
                let by = |c: usize| {
                    let t = lut(c);
                    move |v: u8| t[v as usize]
                };
                let mut row = Vec::new();
                for (k, &i) in indices.iter().enumerate() {
                    let d = self.augment.draw(epoch, i);
                    let from = &src[k * image..][..image];
                    let to = &mut dst[k * image * 4..][..image * 4];
                    // SAFETY: every bit pattern is a valid `f32`, and `align_to_mut` keeps
                    // the middle part aligned and inside `to`.
                    let (head, floats, _) = unsafe { to.align_to_mut::<f32>() };
                    if head.is_empty() && floats.len() == image {
                        self.image(from, floats, d, by);
                    } else {
                        // An output the loader did not lay out, not 4-byte aligned.
                        row.resize(image, 0.0f32);
                        self.image(from, &mut row, d, by);
                        for (o, f) in to.chunks_exact_mut(4).zip(&row) {
                            o.copy_from_slice(&f.to_ne_bytes());
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// One image: `src` (bytes) into `dst` with draw `d`; `map(c)` converts a byte of
    /// channel `c`.
    fn image<T: Copy, F: Fn(u8) -> T>(
        &self,
        src: &[u8],
        dst: &mut [T],
        d: Draw,
        map: impl Fn(usize) -> F,
    ) {
        let (c, h, w) = (self.channels, self.height, self.width);
        let fill = self.augment.fill;
        let source = |y: usize| -> Option<usize> {
            let sy = y as i64 + i64::from(d.dy);
            (0..h as i64).contains(&sy).then_some(sy as usize)
        };
        if !self.augment.channels_last {
            for ch in 0..c {
                let f = map(ch);
                for y in 0..h {
                    let to = &mut dst[(ch * h + y) * w..][..w];
                    match source(y) {
                        None => to.fill(f(fill)),
                        Some(sy) => row(&src[(ch * h + sy) * w..][..w], d, to, f(fill), &f),
                    }
                }
            }
            return;
        }
        let maps: Vec<F> = (0..c).map(&map).collect();
        for y in 0..h {
            let to = &mut dst[y * w * c..][..w * c];
            let from = source(y).map(|sy| &src[sy * w * c..][..w * c]);
            for x in 0..w {
                let sx = match d.flip {
                    true => (w - 1 - x) as i64,
                    false => x as i64,
                } + i64::from(d.dx);
                let pixel = from.filter(|_| (0..w as i64).contains(&sx));
                for (ch, f) in maps.iter().enumerate() {
                    to[x * c + ch] = f(pixel.map_or(fill, |p| p[sx as usize * c + ch]));
                }
            }
        }
    }
}

/// One row of one channel: `dst[x] = f(src[x' + dx])`, with `x'` mirrored when the draw
/// flips, and `fill` where that falls outside the row.
fn row<T: Copy>(src: &[u8], d: Draw, dst: &mut [T], fill: T, f: &impl Fn(u8) -> T) {
    let w = dst.len() as i64;
    let dx = i64::from(d.dx);
    // The outputs whose source lies inside the row.
    let (lo, hi) = match d.flip {
        true => (dx, w + dx),
        false => (-dx, w - dx),
    };
    let lo = lo.clamp(0, w);
    let hi = hi.clamp(lo, w);
    let (lo, hi) = (lo as usize, hi as usize);
    dst[..lo].fill(fill);
    dst[hi..].fill(fill);
    if lo == hi {
        return;
    }
    let inside = &mut dst[lo..hi];
    if d.flip {
        // Outputs lo..hi read w - 1 - x + dx, falling from w - 1 - lo + dx.
        let first = (w - hi as i64 + dx) as usize;
        for (o, &v) in inside
            .iter_mut()
            .zip(src[first..first + hi - lo].iter().rev())
        {
            *o = f(v);
        }
    } else {
        let first = (lo as i64 + dx) as usize;
        for (o, &v) in inside.iter_mut().zip(&src[first..first + hi - lo]) {
            *o = f(v);
        }
    }
}
