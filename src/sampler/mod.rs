//! The order of samples in each epoch: a pure function of
//! `(seed, epoch, rank, world_size)`, never of worker count, timing or machine. One
//! input more for block shuffle when its block size is left to the loader: the default
//! block is about 1 MiB of rows, so it depends on the row width in bytes (give
//! `block_rows` to make the order independent of it). A grouped shuffle depends on the
//! samples' lengths too, and on its group (left to the loader: 64 steps of the batch
//! and world size).
//!
//! [`Order`] turns a dataset length, a [`Shuffle`], a [`Shard`] and a batch size into
//! [`EpochOrder`]s, which compute the sample at any position directly (no table): a
//! loader resumed at batch `k` computes batch `k` without replaying the ones before.
//! The one exception is [`Shuffle::Grouped`], whose epochs sort runs of their
//! positions by length: each epoch computes its order once, a table of 8 bytes a sample.

use std::sync::Arc;

mod shard;

pub use crate::permutation::Permutation;
pub use shard::{Shard, ShardTail};

use crate::error::{Error, Result};
use crate::util::{fold, mix};

/// The version of the epochs' orders for a given seed (the permutation's round
/// function, the block order), in the fingerprints: a state saved by a version that
/// ordered epochs otherwise is refused rather than resumed into other samples.
const ORDERS: u64 = 2;

/// The key of `epoch`'s permutation under `seed`.
const fn epoch_key(seed: u64, epoch: u64) -> u64 {
    mix(mix(seed ^ 0x7374_6f6b_6572) ^ epoch.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// How samples are ordered within an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Shuffle {
    /// File order, every epoch.
    None,
    /// A new uniform-looking permutation of all samples each epoch, from `(seed, epoch)`.
    Full {
        /// The seed.
        seed: u64,
    },
    /// Quasi-random: the order of blocks of `block_rows` consecutive rows is shuffled,
    /// then rows are shuffled within each window of `window` consecutive (shuffled)
    /// blocks. A cold first epoch then reads a few blocks at a time, near-sequentially,
    /// instead of jumping over the whole file for every sample.
    Block {
        /// The seed.
        seed: u64,
        /// Rows per block; `0` lets the loader pick about 1 MiB of rows.
        block_rows: u64,
        /// Blocks whose rows are mixed together.
        window: u64,
    },
    /// Length-grouped, for variable-length samples ([`Documents`](crate::Documents)): a
    /// full shuffle, then each run of `group` consecutive positions sorted by the
    /// samples' lengths, longest first (ties keep their shuffled order). The samples of
    /// a training step, consecutive positions whichever ranks take them, then have
    /// similar lengths, so little of a batch is padding. Needs the samples' lengths
    /// ([`Dataset::lengths`](crate::Dataset::lengths)).
    Grouped {
        /// The seed.
        seed: u64,
        /// Positions sorted together; `0` lets the loader pick 64 training steps
        /// (`64 * batch_size * world_size`). Give it to resume elastically on another
        /// world size or batch size (it is part of the global order).
        group: u64,
    },
}

impl Shuffle {
    /// The orders [`named`](Shuffle::named) knows.
    pub const NAMES: [&'static str; 4] = ["full", "block", "grouped", "none"];

    /// The order called `name` (`full`, `block` with the default block size, `grouped`
    /// with the default group, `none`) under `seed`.
    ///
    /// # Errors
    /// [`Error::Config`] for any other name.
    pub fn named(name: &str, seed: u64) -> Result<Shuffle> {
        match name {
            "full" => Ok(Shuffle::Full { seed }),
            "block" => Ok(Shuffle::block(seed)),
            "grouped" => Ok(Shuffle::Grouped { seed, group: 0 }),
            "none" => Ok(Shuffle::None),
            _ => Err(Error::Config(format!(
                "shuffle {name:?}: expected full, block, grouped or none"
            ))),
        }
    }

    /// Block shuffle with the loader's default block size (about 1 MiB of rows) and a
    /// window of 16 blocks.
    pub const fn block(seed: u64) -> Shuffle {
        Shuffle::Block {
            seed,
            block_rows: 0,
            window: 16,
        }
    }
}

/// The samples' lengths a [`Shuffle::Grouped`] order sorts by, with their fingerprint.
#[derive(Clone)]
struct Lengths {
    of: Arc<[u32]>,
    fingerprint: u64,
}

impl PartialEq for Lengths {
    fn eq(&self, other: &Lengths) -> bool {
        self.of.len() == other.of.len() && self.fingerprint == other.fingerprint
    }
}

impl Eq for Lengths {}

impl std::fmt::Debug for Lengths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Lengths({} samples, {:#x})",
            self.of.len(),
            self.fingerprint
        )
    }
}

/// The per-rank batching of epochs of a dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    len: u64,
    shuffle: Shuffle,
    shard: Shard,
    batch_size: u64,
    drop_last: bool,
    /// The samples' lengths, for a grouped shuffle.
    lengths: Option<Lengths>,
    /// The dataset's [`fingerprint`](crate::Dataset::fingerprint) (0: none).
    dataset: u64,
}

impl Order {
    /// The order of a dataset of `len` samples.
    ///
    /// # Errors
    /// [`Error::Config`] for `len == 0`, `batch_size == 0`, a block shuffle with zero
    /// rows per block or a zero window, a grouped shuffle (it needs the lengths:
    /// [`Order::with_lengths`]), or a shard that leaves this rank no batch.
    pub fn new(
        len: u64,
        shuffle: Shuffle,
        shard: Shard,
        batch_size: u64,
        drop_last: bool,
    ) -> Result<Order> {
        if let Shuffle::Grouped { .. } = shuffle {
            return Err(Error::Config(
                "a grouped shuffle sorts by the samples' lengths: this dataset has none \
                 (variable-length documents have)"
                    .into(),
            ));
        }
        if len == 0 {
            return Err(Error::Config("the dataset is empty".into()));
        }
        if batch_size == 0 {
            return Err(Error::Config("batch size must be at least 1".into()));
        }
        if let Shuffle::Block {
            block_rows, window, ..
        } = shuffle
        {
            if block_rows == 0 || window == 0 {
                return Err(Error::Config(
                    "block shuffle needs block_rows >= 1 and window >= 1".into(),
                ));
            }
        }
        let order = Order {
            len,
            shuffle,
            shard,
            batch_size,
            drop_last,
            lengths: None,
            dataset: 0,
        };
        if order.batches() == 0 {
            return Err(Error::Config(format!(
                "rank {} of {} gets {} of {len} samples: no {} batch of {batch_size}",
                shard.rank(),
                shard.world_size(),
                order.samples(),
                if drop_last { "full" } else { "single" },
            )));
        }
        Ok(order)
    }

    /// The order of a dataset whose samples have `lengths` (in tokens, say), which a
    /// [`Shuffle::Grouped`] sorts by; any other shuffle ignores them.
    ///
    /// # Errors
    /// As [`Order::new`], and for a grouped shuffle with `group == 0`.
    pub fn with_lengths(
        lengths: Arc<[u32]>,
        shuffle: Shuffle,
        shard: Shard,
        batch_size: u64,
        drop_last: bool,
    ) -> Result<Order> {
        let len = lengths.len() as u64;
        // The batches do not depend on the shuffle: the rest is checked as for any.
        let base = match shuffle {
            Shuffle::Grouped { .. } => Shuffle::None,
            other => other,
        };
        let mut order = Order::new(len, base, shard, batch_size, drop_last)?;
        if let Shuffle::Grouped { group: 0, .. } = shuffle {
            return Err(Error::Config("a grouped shuffle needs group >= 1".into()));
        }
        let fingerprint = fold(lengths.iter().map(|&l| u64::from(l)));
        order.shuffle = shuffle;
        order.lengths = Some(Lengths {
            of: lengths,
            fingerprint,
        });
        Ok(order)
    }

    /// A non-zero fingerprint of everything the order depends on (the version of the
    /// ordering algorithms included): equal fingerprints
    /// give equal epochs.
    pub fn fingerprint(&self) -> u64 {
        let tail = match self.shard.tail() {
            ShardTail::Pad => 1,
            ShardTail::Drop => 2,
        };
        let shard = [
            self.shard.rank(),
            self.shard.world_size(),
            tail,
            self.batch_size,
            u64::from(self.drop_last),
        ];
        fold(self.global_parts().chain(shard))
    }

    /// A non-zero fingerprint of the epochs' global order alone (dataset length, shuffle
    /// and seed; for a grouped shuffle, its group and the samples' lengths): the same
    /// for every rank, world size and batch size, which an elastic resume
    /// ([`LoaderBuilder::resume_elastic`](crate::LoaderBuilder::resume_elastic)) may
    /// change. (A loader that picks a grouped shuffle's group from the batch and world
    /// size changes it with them: give the group to resume elastically.)
    pub fn global_fingerprint(&self) -> u64 {
        fold(self.global_parts())
    }

    /// The [`fingerprint`](crate::Dataset::fingerprint) of the dataset this order is
    /// over (0: not known).
    pub fn dataset_fingerprint(&self) -> u64 {
        self.dataset
    }

    /// This order over a dataset whose [`fingerprint`](crate::Dataset::fingerprint) is
    /// `fingerprint`: both of the order's fingerprints cover it (0 leaves them as
    /// without).
    pub fn for_dataset(mut self, fingerprint: u64) -> Order {
        self.dataset = fingerprint;
        self
    }

    fn global_parts(&self) -> impl Iterator<Item = u64> {
        let (kind, seed, rows, window) = match self.shuffle {
            Shuffle::None => (1, 0, 0, 0),
            Shuffle::Full { seed } => (2, seed, 0, 0),
            Shuffle::Block {
                seed,
                block_rows,
                window,
            } => (3, seed, block_rows, window),
            Shuffle::Grouped { seed, group } => {
                let lengths = self.lengths.as_ref().map_or(0, |l| l.fingerprint);
                (4, seed, group, lengths)
            }
        };
        let dataset = (self.dataset != 0).then_some(self.dataset);
        [self.len, kind, seed, rows, window, ORDERS]
            .into_iter()
            .chain(dataset)
    }

    /// Samples per epoch in the whole dataset.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// Always false: an empty order is refused by [`Order::new`].
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shuffle.
    pub const fn shuffle(&self) -> Shuffle {
        self.shuffle
    }

    /// The shard.
    pub const fn shard(&self) -> Shard {
        self.shard
    }

    /// The batch size.
    pub const fn batch_size(&self) -> u64 {
        self.batch_size
    }

    /// Samples this rank sees per epoch (before `drop_last`).
    pub const fn samples(&self) -> u64 {
        self.shard.samples(self.len)
    }

    /// Batches per epoch on this rank.
    pub const fn batches(&self) -> u64 {
        self.batches_of(self.samples())
    }

    /// Whether one epoch on this rank covers every sample of the dataset: one shard, and
    /// no sample dropped by the shard's tail rule or `drop_last` (what a device cache
    /// filled by one epoch needs).
    pub const fn is_whole(&self) -> bool {
        self.shard.world_size() == 1
            && self.samples() == self.len
            && self.batches() * self.batch_size >= self.len
    }

    /// Batches of `samples` samples on this rank (the last one short unless
    /// `drop_last`).
    const fn batches_of(&self, samples: u64) -> u64 {
        if self.drop_last {
            samples / self.batch_size
        } else {
            samples.div_ceil(self.batch_size)
        }
    }

    /// The order of `epoch`.
    pub fn epoch(&self, epoch: u64) -> EpochOrder {
        self.epoch_from(epoch, 0)
    }

    /// The order of the rest of `epoch` after its first `start` positions of the global
    /// order were taken (by ranks of another world size or batch size, say): this rank
    /// takes interleaved positions of what is left, `start + i * world + rank`, with
    /// its own batch size and tail. `start` at or past the end leaves no batch.
    pub fn epoch_from(&self, epoch: u64, start: u64) -> EpochOrder {
        let kind = match self.shuffle {
            Shuffle::None => Kind::Sequential,
            Shuffle::Full { seed } => {
                Kind::Full(Permutation::new(self.len, epoch_key(seed, epoch)))
            }
            Shuffle::Block {
                seed,
                block_rows,
                window,
            } => Kind::Block(BlockOrder::new(
                self.len,
                block_rows,
                window,
                epoch_key(seed, epoch),
            )),
            Shuffle::Grouped { seed, group } => Kind::Grouped(Arc::new(Lazy {
                lengths: self.lengths.clone().expect("made with lengths"),
                group,
                key: epoch_key(seed, epoch),
                order: std::sync::OnceLock::new(),
            })),
        };
        EpochOrder {
            order: self.clone(),
            epoch,
            kind,
            start: start.min(self.len),
        }
    }
}

/// The order of one epoch on one rank.
#[derive(Debug, Clone)]
pub struct EpochOrder {
    order: Order,
    epoch: u64,
    kind: Kind,
    /// Positions of the global order taken before this rank's batches start.
    start: u64,
}

#[derive(Debug, Clone)]
enum Kind {
    Sequential,
    Full(Permutation),
    Block(BlockOrder),
    /// The epoch's whole global order, computed on first use (an epoch order made only
    /// for its counts, such as a [`LoaderState`](crate::LoaderState)'s, never sorts).
    Grouped(Arc<Lazy>),
}

/// A grouped epoch's global order, and what it is computed from.
#[derive(Debug)]
struct Lazy {
    lengths: Lengths,
    group: u64,
    key: u64,
    order: std::sync::OnceLock<Box<[u64]>>,
}

impl Lazy {
    fn get(&self) -> &[u64] {
        self.order
            .get_or_init(|| grouped(&self.lengths.of, self.group, self.key))
    }
}

/// The global order of a grouped epoch: the permutation of `key`, each run of `group`
/// positions then sorted by length, longest first (a stable sort: ties keep their
/// shuffled order).
fn grouped(lengths: &[u32], group: u64, key: u64) -> Box<[u64]> {
    let n = lengths.len() as u64;
    let mut order: Vec<u64> = (0..n).collect();
    Permutation::new(n, key).apply_in_place(&mut order);
    let group = usize::try_from(group).unwrap_or(usize::MAX);
    for run in order.chunks_mut(group) {
        run.sort_by_key(|&s| std::cmp::Reverse(lengths[s as usize]));
    }
    order.into()
}

impl EpochOrder {
    /// The shuffle this epoch follows.
    pub fn shuffle(&self) -> Shuffle {
        self.order.shuffle
    }

    /// The fingerprint of the dataset the epoch is over ([`Order::dataset_fingerprint`]).
    pub fn dataset_fingerprint(&self) -> u64 {
        self.order.dataset
    }

    /// The epoch number.
    pub const fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The sample at `position` of the epoch's global order (all ranks).
    ///
    /// # Panics
    /// If `position >= len`.
    #[inline]
    pub fn global(&self, position: u64) -> u64 {
        assert!(
            position < self.order.len,
            "position {position} past the epoch"
        );
        match &self.kind {
            Kind::Sequential => position,
            Kind::Full(p) => p.apply(position),
            Kind::Block(b) => b.index(position),
            Kind::Grouped(t) => t.get()[position as usize],
        }
    }

    /// The global position of this rank's `i`-th sample (wrapped into what is left of
    /// the epoch for padding).
    #[inline]
    fn position(&self, i: u64) -> u64 {
        let left = self.order.len - self.start;
        self.start + self.order.shard.global_position(i, left)
    }

    /// This rank's `i`-th sample of the epoch.
    ///
    /// # Panics
    /// If `i >= samples()`.
    #[inline]
    pub fn sample(&self, i: u64) -> u64 {
        assert!(i < self.samples(), "sample {i} past the epoch");
        self.global(self.position(i))
    }

    /// Samples per batch (the last batch may hold fewer).
    pub const fn batch_size(&self) -> u64 {
        self.order.batch_size
    }

    /// Positions of the global order taken before this rank's batches start (0 unless
    /// the epoch was resumed elastically).
    pub const fn start(&self) -> u64 {
        self.start
    }

    /// Samples this rank sees in the epoch (before `drop_last`).
    pub const fn samples(&self) -> u64 {
        self.order.shard.samples(self.order.len - self.start)
    }

    /// Batches in the epoch.
    pub const fn batches(&self) -> u64 {
        self.order.batches_of(self.samples())
    }

    /// Samples the epoch's batches hold: [`samples`](EpochOrder::samples), less what
    /// `drop_last` leaves out.
    pub const fn items(&self) -> u64 {
        let whole = self.batches() * self.order.batch_size;
        if whole < self.samples() {
            whole
        } else {
            self.samples()
        }
    }

    /// Positions of the global order taken once every rank has had `batch` batches of
    /// the epoch (as data-parallel steps do): what an elastic resume starts after. After
    /// the last batch, the whole epoch (what a tail or `drop_last` left out included).
    pub fn taken(&self, batch: u64) -> u64 {
        if batch >= self.batches() {
            return self.order.len;
        }
        let per_batch = self
            .order
            .batch_size
            .saturating_mul(self.order.shard.world_size());
        self.start
            .saturating_add(batch.saturating_mul(per_batch))
            .min(self.order.len)
    }

    /// Samples in batch `b` (the last one may be short unless `drop_last`).
    ///
    /// # Panics
    /// If `b >= batches()`.
    pub fn batch_len(&self, b: u64) -> usize {
        assert!(b < self.batches(), "batch {b} past the epoch");
        let start = b * self.order.batch_size;
        (self.samples() - start).min(self.order.batch_size) as usize
    }

    /// Writes the sample indices of batch `b` into `out` (cleared first).
    ///
    /// # Panics
    /// If `b >= batches()`.
    pub fn batch(&self, b: u64, out: &mut Vec<u64>) {
        assert!(b < self.batches(), "batch {b} past the epoch");
        out.clear();
        let start = b * self.order.batch_size;
        out.extend((start..start + self.batch_len(b) as u64).map(|i| self.position(i)));
        match &self.kind {
            Kind::Sequential => {}
            Kind::Full(p) => p.apply_in_place(out),
            Kind::Block(o) => out.iter_mut().for_each(|x| *x = o.index(*x)),
            Kind::Grouped(t) => {
                let t = t.get();
                out.iter_mut().for_each(|x| *x = t[*x as usize]);
            }
        }
    }
}

/// Block shuffle: blocks of `rows` consecutive samples in a shuffled order, samples
/// shuffled within windows of `window` blocks. The one short block (when `len` is not a
/// multiple of the block size) is placed last within its window before the window's rows
/// are shuffled, so every position still maps in O(1).
#[derive(Debug, Clone)]
struct BlockOrder {
    rows: u64,
    window: u64,
    blocks: u64,
    /// Rows missing from the last block (0 when it is full).
    deficit: u64,
    /// Shuffled order of the blocks.
    block_perm: Permutation,
    /// Shuffled position of the last (possibly short) block.
    short_at: u64,
    key: u64,
}

impl BlockOrder {
    fn new(len: u64, rows: u64, window: u64, key: u64) -> BlockOrder {
        // Neither clamp changes the order (a block longer than the data, or a window
        // wider than all blocks, is one window either way); both keep `window * rows`
        // below `2 * len`, so no product overflows.
        let rows = rows.min(len);
        let blocks = len.div_ceil(rows);
        let window = window.min(blocks);
        let block_perm = Permutation::new(blocks, key);
        let short_at = block_perm.invert(blocks - 1);
        BlockOrder {
            rows,
            window,
            blocks,
            deficit: blocks * rows - len,
            block_perm,
            short_at,
            key,
        }
    }

    fn index(&self, p: u64) -> u64 {
        let span = self.window * self.rows;
        let short_window = self.short_at / self.window;
        let windows = self.blocks.div_ceil(self.window);
        let mut w = p / span;
        if w + 1 < windows && w + 1 > short_window && p >= (w + 1) * span - self.deficit {
            w += 1;
        }
        let start = w * span - if w > short_window { self.deficit } else { 0 };
        let first_block = w * self.window;
        let nblocks = self.window.min(self.blocks - first_block);
        let has_short = w == short_window;
        let rows_w = nblocks * self.rows - if has_short { self.deficit } else { 0 };
        let local = Permutation::new(rows_w, mix(self.key ^ mix(w + 1))).apply(p - start);
        let full = if has_short { nblocks - 1 } else { nblocks };
        if local < full * self.rows {
            let k = local / self.rows;
            let slot = if has_short && k >= self.short_at - first_block {
                k + 1
            } else {
                k
            };
            self.block_perm.apply(first_block + slot) * self.rows + local % self.rows
        } else {
            (self.blocks - 1) * self.rows + (local - full * self.rows)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(order: &Order, epoch: u64) -> Vec<u64> {
        let e = order.epoch(epoch);
        let mut v = Vec::new();
        let mut b = Vec::new();
        for k in 0..e.batches() {
            e.batch(k, &mut b);
            v.extend_from_slice(&b);
        }
        v
    }

    fn is_permutation(mut v: Vec<u64>, n: u64) -> bool {
        v.sort_unstable();
        v == (0..n).collect::<Vec<_>>()
    }

    #[test]
    fn grouped_epochs_are_shuffles_sorted_by_length_within_each_group() {
        let lengths: Arc<[u32]> = (0..1000u64).map(|i| (mix(i) % 500) as u32).collect();
        let grouped = |seed, group| {
            let s = Shuffle::Grouped { seed, group };
            Order::with_lengths(Arc::clone(&lengths), s, Shard::single(), 10, false).unwrap()
        };
        let o = grouped(1, 100);
        let (e0, e1) = (all(&o, 0), all(&o, 1));
        assert!(is_permutation(e0.clone(), 1000) && is_permutation(e1.clone(), 1000));
        assert_ne!(e0, e1, "epochs differ");
        assert_eq!(
            e0,
            all(&grouped(1, 100), 0),
            "a pure function of seed and epoch"
        );
        for run in e0.chunks(100) {
            let l: Vec<u32> = run.iter().map(|&s| lengths[s as usize]).collect();
            assert!(l.windows(2).all(|w| w[0] >= w[1]), "sorted within a group");
        }
        // Each run is the same set of samples as the full shuffle's run of that epoch.
        let full = Order::new(1000, Shuffle::Full { seed: 1 }, Shard::single(), 10, false);
        let f0 = all(&full.unwrap(), 0);
        for (g, f) in e0.chunks(100).zip(f0.chunks(100)) {
            let (mut g, mut f) = (g.to_vec(), f.to_vec());
            g.sort_unstable();
            f.sort_unstable();
            assert_eq!(g, f);
        }
        // Positions computed one by one agree with batches.
        let e = o.epoch(0);
        assert!((0..1000).all(|p| e.global(p) == e0[p as usize]));
        // The group, the seed and the lengths are part of the global order.
        let fp = |o: &Order| o.global_fingerprint();
        assert_ne!(fp(&grouped(1, 100)), fp(&grouped(1, 50)));
        assert_ne!(fp(&grouped(1, 100)), fp(&grouped(2, 100)));
        let other: Arc<[u32]> = lengths.iter().map(|&l| l + 1).collect();
        let s = Shuffle::Grouped {
            seed: 1,
            group: 100,
        };
        let o2 = Order::with_lengths(other, s, Shard::single(), 10, false).unwrap();
        assert_ne!(fp(&grouped(1, 100)), fp(&o2));
        // Without lengths, or with a zero group, there is no grouped order.
        assert!(Order::new(1000, s, Shard::single(), 10, false).is_err());
        let zero = Shuffle::Grouped { seed: 1, group: 0 };
        assert!(Order::with_lengths(lengths, zero, Shard::single(), 10, false).is_err());
    }

    #[test]
    fn block_shuffle_is_a_permutation() {
        for len in [1, 2, 7, 64, 100, 1000, 1001, 4097] {
            for rows in [1, 3, 16, 64, 5000] {
                for window in [1, 2, 5] {
                    let s = Shuffle::Block {
                        seed: len ^ rows,
                        block_rows: rows,
                        window,
                    };
                    let o = Order::new(len, s, Shard::single(), 7, false).unwrap();
                    for epoch in 0..3 {
                        assert!(
                            is_permutation(all(&o, epoch), len),
                            "len {len} rows {rows} window {window} epoch {epoch}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn block_shuffle_stays_local() {
        // Within any run of `rows * window` positions, reads touch at most a few windows.
        let (len, rows, window) = (100_000, 1000, 4);
        let s = Shuffle::Block {
            seed: 3,
            block_rows: rows,
            window,
        };
        let o = Order::new(len, s, Shard::single(), 100, false).unwrap();
        let v = all(&o, 0);
        let blocks: std::collections::HashSet<u64> = v[..4000].iter().map(|i| i / rows).collect();
        assert!(blocks.len() <= 8, "{} blocks touched", blocks.len());
        assert!(
            !is_permutation(v[..4000].to_vec(), 4000),
            "not shuffled at all"
        );
        // And the rows within each window are shuffled, not read in file order: of a
        // random order of 4 blocks' rows, about 1 in 4,000 follows its neighbour.
        let runs = v[..4000].windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(runs < 40, "{runs} of 4,000 rows follow their neighbour");
    }

    #[test]
    fn sequential_and_full() {
        let o = Order::new(10, Shuffle::None, Shard::single(), 4, false).unwrap();
        assert_eq!(all(&o, 5), (0..10).collect::<Vec<_>>());
        assert_eq!(o.batches(), 3);
        let o = Order::new(10, Shuffle::Full { seed: 1 }, Shard::single(), 4, true).unwrap();
        assert_eq!(o.batches(), 2);
        assert_eq!(all(&o, 0).len(), 8);
        let o = Order::new(1000, Shuffle::Full { seed: 1 }, Shard::single(), 10, false).unwrap();
        assert_ne!(all(&o, 0), all(&o, 1));
        assert!(is_permutation(all(&o, 1), 1000));
    }

    #[test]
    fn refuses_empty_work() {
        assert!(Order::new(0, Shuffle::None, Shard::single(), 4, false).is_err());
        assert!(Order::new(5, Shuffle::None, Shard::single(), 0, false).is_err());
        assert!(Order::new(5, Shuffle::None, Shard::single(), 8, true).is_err());
        let shard = Shard::new(3, 4).unwrap().with_tail(ShardTail::Drop);
        assert!(Order::new(3, Shuffle::None, shard, 1, false).is_err());
    }
}
