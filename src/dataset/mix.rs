//! Several datasets with the same columns, mixed by weight: each epoch takes a fixed
//! share of its samples from each (a pretraining mixture of web text, code and books,
//! say), as Megatron-LM's blended datasets, MosaicML Streaming's stream proportions and
//! LitData's combined datasets do.

use std::sync::Arc;

use super::{Column, Concat, Dataset, MappedFile};
use crate::error::{Error, Result};
use crate::permutation::Permutation;
use crate::util::{fold, mix};

/// `parts` mixed by `weights`: an epoch of `samples` samples, of which part `p` gives
/// its share `weights[p] / sum(weights)` (rounded, the shares summing to `samples`;
/// [`Mix::takes`] says how many).
///
/// A part is drawn in shuffled orders of its own, a new one each time through it: a
/// part that gives `take` samples an epoch and holds `n` serves each of them
/// `take / n` times an epoch (whole passes), and the rest of the take runs on across
/// epochs, through passes of their own, so that a part giving fewer samples than it
/// holds (downsampled) serves, over the next epochs, all of its samples before any
/// again. (An epoch whose rest crosses from one pass into the next may hold a sample
/// from both.) A part whose share rounds to less than one sample gives none. Which
/// sample of which part
/// position `i` of epoch `e` is ([`Mix::source`]) is a pure function of the seed, `e`
/// and `i`, like the loader's order, so epochs resume exactly and shard across ranks as
/// over any dataset.
///
/// Positions `0..takes[0]` are part 0's draws, the next `takes[1]` part 1's, and so on:
/// a loader's shuffle ([`Shuffle::Full`](crate::Shuffle::Full)) spreads them over the
/// epoch, so that every stretch of batches holds the parts in their shares. A part
/// gathers its draws of epoch `e` as its own epoch `e` (random token windows are that
/// epoch's), and a loader plans its storage reads from the parts' files as over a
/// [`Concat`] of them.
///
/// ```
/// # fn main() -> stokehold::Result<()> {
/// use std::sync::Arc;
/// use stokehold::{Dataset, Mix, NpyDataset, Subset};
///
/// let digits: Arc<dyn Dataset> =
///     Arc::new(NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?);
/// let small = Arc::new(Subset::new(digits.clone(), 0..100)?);
/// let mix = Mix::new(vec![digits, small], &[3.0, 1.0], Some(2000), 7)?;
/// assert_eq!(mix.takes(), [1500, 500]); // the 100 samples five times an epoch
/// let (part, sample) = mix.source(0, 1700).unwrap();
/// assert_eq!(part, 1);
/// assert!(sample < 100);
/// # Ok(())
/// # }
/// ```
pub struct Mix {
    parts: Concat,
    /// Samples each part gives an epoch.
    takes: Vec<u64>,
    /// `ends[p]`: the samples of parts `0..=p` in an epoch.
    ends: Vec<u64>,
    seed: u64,
}

impl Mix {
    /// `parts` mixed by `weights` (one each, finite, `>= 0`, not all 0), `samples` an
    /// epoch (`None`: as many as the parts hold together), the parts' orders drawn
    /// from `seed`.
    ///
    /// # Errors
    /// [`Error::Config`] for no parts, a weight count other than the part count, a
    /// weight that is negative or not finite, weights that are all 0, an epoch of no
    /// samples, a part with a share of the epoch and no sample to give, or a part whose
    /// columns differ from the first part's (name, type or shape), naming both.
    pub fn new(
        parts: Vec<Arc<dyn Dataset>>,
        weights: &[f64],
        samples: Option<u64>,
        seed: u64,
    ) -> Result<Mix> {
        if parts.is_empty() {
            return Err(Error::Config("a mix needs a part at least".into()));
        }
        if weights.len() != parts.len() {
            return Err(Error::Config(format!(
                "a mix of {} parts was given {} weights",
                parts.len(),
                weights.len()
            )));
        }
        if let Some((p, w)) = weights
            .iter()
            .enumerate()
            .find(|(_, w)| !w.is_finite() || **w < 0.0)
        {
            return Err(Error::Config(format!(
                "weight {w} of part {p} of a mix: weights are finite and >= 0"
            )));
        }
        if !weights.iter().any(|&w| w > 0.0) {
            return Err(Error::Config(
                "a mix whose weights are all 0 takes no sample".into(),
            ));
        }
        let parts = Concat::named(parts, "mix")?;
        let samples = samples.unwrap_or_else(|| parts.len());
        if samples == 0 || samples > MAX_SAMPLES {
            return Err(Error::Config(format!(
                "a mix of {samples} samples an epoch: between 1 and 2^53"
            )));
        }
        let takes = apportion(weights, samples);
        if let Some(p) = (0..takes.len()).find(|&p| takes[p] > 0 && parts.parts()[p].is_empty()) {
            return Err(Error::Config(format!(
                "part {p} of a mix has no samples to give its {} an epoch (weight {})",
                takes[p], weights[p]
            )));
        }
        let ends = takes
            .iter()
            .scan(0u64, |sum, &t| {
                *sum += t;
                Some(*sum)
            })
            .collect();
        Ok(Mix {
            parts,
            takes,
            ends,
            seed,
        })
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[Arc<dyn Dataset>] {
        self.parts.parts()
    }

    /// How many samples each part gives an epoch.
    pub fn takes(&self) -> &[u64] {
        &self.takes
    }

    /// Which part position `index` of `epoch` is drawn from, and which of its samples
    /// it is; `None` for an index `>= len()`.
    pub fn source(&self, epoch: u64, index: u64) -> Option<(usize, u64)> {
        let p = self.ends.partition_point(|&end| end <= index);
        let take = *self.takes.get(p)?;
        let k = index - (self.ends[p] - take);
        let n = self.parts.parts()[p].len();
        // Whole passes through the part first, each in an order of its epoch's own; then
        // the rest of the take, whose draws run on across epochs through orders of their
        // own, so that epochs take the part's other samples before any again.
        let whole = take / n * n;
        let base = mix(mix(self.seed ^ 0x6d69_7874_7572_6573) ^ mix(p as u64 + 1));
        let (key, at) = match k < whole {
            true => (mix(mix(base ^ epoch) ^ (k / n)), k % n),
            false => {
                let drawn = u128::from(epoch) * u128::from(take - whole) + u128::from(k - whole);
                let pass = (drawn / u128::from(n)) as u64;
                (
                    mix(mix(!base ^ pass) ^ u64::MAX),
                    (drawn % u128::from(n)) as u64,
                )
            }
        };
        Some((p, Permutation::new(n, key).apply(at)))
    }

    /// Position `index` of `epoch` as a sample of the concatenation of the parts.
    fn joined(&self, epoch: u64, index: u64) -> Result<u64> {
        match self.source(epoch, index) {
            Some((p, sample)) => Ok(self.parts.start(p) + sample),
            None => Err(Error::OutOfRange {
                index,
                len: self.len(),
            }),
        }
    }
}

/// The most samples a mix's epoch may have: its shares are computed in `f64`, exact
/// for integers up to 2^53.
const MAX_SAMPLES: u64 = 1 << 53;

/// `total` (at most [`MAX_SAMPLES`]) split in the shares `weights` (finite, `>= 0`, not
/// all 0) by largest remainders: each part gets the floor of its quota, then the parts
/// with the largest fractions (the first of equal ones) one more each until the parts
/// sum to `total`. A part of weight 0 gets 0, as may one whose share is below a sample.
fn apportion(weights: &[f64], total: u64) -> Vec<u64> {
    // Relative to the largest, so that the sum of weights near f64::MAX stays finite.
    let largest = weights.iter().copied().fold(0.0, f64::max);
    let weights: Vec<f64> = weights.iter().map(|w| w / largest).collect();
    let sum: f64 = weights.iter().sum();
    let quotas: Vec<f64> = weights.iter().map(|w| w / sum * total as f64).collect();
    let mut takes: Vec<u64> = quotas
        .iter()
        .map(|q| (q.floor() as u64).min(total))
        .collect();
    // Largest fraction first; the first part of equal fractions first.
    let mut by_fraction: Vec<usize> = (0..weights.len()).filter(|&p| weights[p] > 0.0).collect();
    by_fraction.sort_by(|&a, &b| {
        let fraction = |p: usize| quotas[p] - quotas[p].floor();
        fraction(b).total_cmp(&fraction(a)).then(a.cmp(&b))
    });
    let mut given: u64 = takes.iter().sum();
    // Rounding leaves the floors within a few samples of `total`, either side.
    for &p in by_fraction.iter().cycle() {
        if given >= total {
            break;
        }
        takes[p] += 1;
        given += 1;
    }
    for &p in by_fraction.iter().rev().cycle() {
        if given <= total {
            break;
        }
        if takes[p] > 0 {
            takes[p] -= 1;
            given -= 1;
        }
    }
    takes
}

impl Dataset for Mix {
    /// Covers the parts (as a [`Concat`] of them does), each part's share of an epoch
    /// and the seed of their orders.
    fn same_every_epoch(&self) -> bool {
        false
    }

    fn fingerprint(&self) -> u64 {
        fold(
            [self.parts.fingerprint(), self.seed]
                .into_iter()
                .chain(self.takes.iter().copied()),
        )
    }

    fn len(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    fn columns(&self) -> &[Column] {
        self.parts.columns()
    }

    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        let joined = indices
            .iter()
            .map(|&i| self.joined(epoch, i))
            .collect::<Result<Vec<_>>>()?;
        self.parts.gather(epoch, &joined, out)
    }

    fn files(&self) -> Vec<MappedFile<'_>> {
        self.parts.files()
    }

    /// A mix's positions hold other samples each epoch, and a grouped shuffle sorts by
    /// lengths fixed for all epochs: parts with lengths are an error, others `None`.
    ///
    /// # Errors
    /// [`Error::Config`] where the parts give their samples' lengths.
    fn lengths(&self) -> Result<Option<Vec<u32>>> {
        match self.parts.lengths()? {
            None => Ok(None),
            Some(_) => Err(Error::Config(
                "a mix holds other samples at each position every epoch, and a grouped \
                 shuffle sorts by lengths fixed for all epochs: shuffle a mix fully"
                    .into(),
            )),
        }
    }

    fn locate(&self, epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        if let Ok(joined) = self.joined(epoch, index) {
            self.parts.locate(epoch, joined, each);
        }
    }
}

impl std::fmt::Debug for Mix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mix")
            .field("parts", &self.parts.parts().len())
            .field("takes", &self.takes)
            .field("columns", &self.columns())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::counting::part;

    fn values(m: &Mix, epoch: u64) -> Vec<u16> {
        let indices: Vec<u64> = (0..m.len()).collect();
        let mut out = vec![0u8; 2 * indices.len()];
        m.gather(epoch, &indices, &mut [&mut out[..]]).unwrap();
        out.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    #[test]
    fn shares_follow_the_weights_and_sum_to_the_epoch() {
        assert_eq!(apportion(&[0.7, 0.3], 10), [7, 3]);
        assert_eq!(apportion(&[1.0, 1.0, 1.0], 10), [4, 3, 3]);
        assert_eq!(apportion(&[1.0, 0.0, 1.0], 5), [3, 0, 2]);
        assert_eq!(apportion(&[1e-9, 1.0], 3), [0, 3]);
        assert_eq!(apportion(&[2.0], MAX_SAMPLES), [MAX_SAMPLES]);
        assert_eq!(apportion(&[1.0, 1.0], MAX_SAMPLES), [1 << 52, 1 << 52]);
        // Weights whose sum passes f64::MAX keep their shares.
        assert_eq!(apportion(&[1.7e308, 1e308, 1e300], 27), [17, 10, 0]);
        for total in [1u64, 7, 1000, 123_457] {
            let takes = apportion(&[0.5, 0.25, 0.125, 0.125, 1e-3], total);
            assert_eq!(takes.iter().sum::<u64>(), total);
        }
    }

    #[test]
    fn each_epoch_takes_each_part_share_and_runs_on_through_its_samples() {
        // Part 0 (100 samples) gives 30 an epoch: 10 epochs hold each 3 times, and each
        // pass of 100 draws holds each sample once. Part 1 (7 samples) gives 20 an epoch.
        let m = Mix::new(
            vec![part(1000, 100, "t"), part(5000, 7, "t")],
            &[3.0, 2.0],
            Some(50),
            9,
        )
        .unwrap();
        assert_eq!((m.len(), m.takes()), (50, &[30, 20][..]));
        // Each run of `n` draws in `drawn` holds samples `first..first + n` once.
        let passes = |drawn: &[u16], n: usize, first: u16| {
            for pass in drawn.chunks_exact(n) {
                let mut sorted = pass.to_vec();
                sorted.sort_unstable();
                assert_eq!(sorted, (first..first + n as u16).collect::<Vec<u16>>());
            }
        };
        let (mut drawn0, mut rest1) = (Vec::new(), Vec::new());
        for epoch in 0..10 {
            let v = values(&m, epoch);
            assert!(v[..30].iter().all(|&x| (1000..1100).contains(&x)), "{v:?}");
            assert!(v[30..].iter().all(|&x| (5000..5007).contains(&x)), "{v:?}");
            drawn0.extend_from_slice(&v[..30]);
            // 20 draws of 7 samples: two whole passes, then 6 of the rest.
            passes(&v[30..44], 7, 5000);
            rest1.extend_from_slice(&v[44..]);
            for (i, &x) in v.iter().enumerate() {
                let (p, s) = m.source(epoch, i as u64).unwrap();
                assert_eq!(x, [1000, 5000][p] + s as u16);
            }
        }
        passes(&drawn0, 100, 1000);
        // The rests of 10 epochs: 60 draws, 8 passes of the 7 samples and 4 draws.
        passes(&rest1, 7, 5000);
        // Passes are shuffled anew: the first two differ in order.
        assert_ne!(drawn0[..100], drawn0[100..200]);
        assert_eq!(m.source(0, 50), None);
        let mut out = [0u8; 2];
        let e = m.gather(0, &[50], &mut [&mut out[..]]).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { index: 50, len: 50 }), "{e}");
    }

    #[test]
    fn the_draws_are_the_seeds() {
        let make = |seed| {
            Mix::new(
                vec![part(0, 500, "t"), part(0, 500, "t")],
                &[1.0, 1.0],
                None,
                seed,
            )
        };
        let (a, b, c) = (make(1).unwrap(), make(1).unwrap(), make(2).unwrap());
        assert_eq!(a.len(), 1000);
        assert_eq!(values(&a, 3), values(&b, 3));
        assert_ne!(values(&a, 3), values(&c, 3));
        assert_ne!(values(&a, 3), values(&a, 4));
        // The two parts are drawn in orders of their own.
        assert_ne!(values(&a, 0)[..500], values(&a, 0)[500..]);
    }

    #[test]
    fn files_and_ranges_are_the_parts() {
        let m = Mix::new(
            vec![part(0, 10, "t"), part(0, 10, "t")],
            &[0.0, 1.0],
            Some(4),
            1,
        )
        .unwrap();
        assert_eq!(m.takes(), [0, 4]);
        let mut at = Vec::new();
        m.locate(2, 3, &mut |f, off, len| at.push((f, off, len)));
        let (p, s) = m.source(2, 3).unwrap();
        assert_eq!(p, 1);
        // Both test parts call their one range file 0; the second part's is file 0 of
        // its own, numbered after the first part's none.
        assert_eq!(at, [(0, 2 * s as usize, 2)]);
        m.locate(2, 4, &mut |f, off, len| at.push((f, off, len)));
        assert_eq!(at.len(), 1);
    }

    #[test]
    fn bad_mixes_are_refused_by_name() {
        let err = |parts, weights: &[f64], samples| {
            Mix::new(parts, weights, samples, 0)
                .unwrap_err()
                .to_string()
        };
        let two = || vec![part(0, 3, "t"), part(0, 3, "t")];
        assert!(err(two(), &[1.0], None).contains("2 parts was given 1 weights"));
        assert!(err(two(), &[1.0, -1.0], None).contains("weight -1 of part 1"));
        assert!(err(two(), &[1.0, f64::NAN], None).contains("of part 1"));
        assert!(err(two(), &[0.0, 0.0], None).contains("all 0"));
        assert!(err(two(), &[1.0, 1.0], Some(0)).contains("0 samples an epoch"));
        let e = err(two(), &[1.0, 1.0], Some(u64::MAX));
        assert!(e.contains("between 1 and 2^53"), "{e}");
        assert!(err(Vec::new(), &[], None).contains("a mix needs a part"));
        let e = err(vec![part(0, 3, "t"), part(0, 0, "t")], &[1.0, 1.0], Some(4));
        assert!(
            e.contains("part 1 of a mix has no samples to give its 2"),
            "{e}"
        );
        let e = err(vec![part(0, 3, "t"), part(0, 3, "u")], &[1.0, 1.0], None);
        assert!(
            e.contains("part 1 of a mix has the columns [u uint16 []]"),
            "{e}"
        );
        // Lengths would change every epoch: a grouped shuffle cannot sort by them.
        let m = Mix::new(vec![part(1, 3, "t")], &[1.0], None, 0).unwrap();
        assert!(m
            .lengths()
            .unwrap_err()
            .to_string()
            .contains("shuffle a mix fully"));
        let m = Mix::new(vec![part(0, 3, "t")], &[1.0], None, 0).unwrap();
        assert_eq!(m.lengths().unwrap(), None);
    }
}
