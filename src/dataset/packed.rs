//! Documents packed: concatenated and cut into training windows with no padding, each
//! token tagged with its position in its document, so that a model can keep attention
//! (and position encodings) inside documents.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use super::indexed::{Scan, Stored};
use super::{check_out, Column, DType, Dataset, MappedFile, Windows};
use crate::error::{Error, Result};
use crate::permutation::Permutation;
use crate::util::{fold, mix};

/// A reader of document places and lengths (see `Stored::with_extents`).
type Extent<'a> = &'a dyn Fn(u64) -> Option<(u64, u64)>;

/// Variable-length documents (the layouts [`Documents`](super::Documents) reads)
/// concatenated in their stored order and served as windows of `seq_len + 1` tokens,
/// like a [`TokenDataset`](super::TokenDataset): column `"tokens"` holds the window
/// (inputs `w[..seq_len]`, next-token targets `w[1..]`), column `"positions"` (`int32`,
/// the same shape) each token's position in its own document, 0 at a document's first
/// token.
///
/// This is sequence packing as GPT pretraining does it (nanoGPT, Megatron-LM), with
/// the document boundaries kept: `positions[:-1]` are the `position_ids` that
/// Hugging Face models and FlashAttention's variable-length kernels read for packed
/// batches (a 0 starts a sequence); a target `w[j + 1]` crosses into another document
/// where `positions[j + 1] == 0` (to mask it from the loss, as Megatron's
/// `eod_mask_loss` does).
///
/// Documents are concatenated in their stored order, or, after
/// [`shuffle_documents`](Packed::shuffle_documents), in another order each epoch (as
/// Megatron-LM's loader does), so that a document has other neighbours in each epoch's
/// windows; with `Windows::Random` each epoch also cuts the stream at other offsets. In
/// stored order, a token file that holds its documents back to back (offsets always
/// do; Megatron and fairseq tools write them so) needs no memory beyond the mappings;
/// otherwise each document's start is kept, 8 bytes a document. A shuffled order keeps
/// each document's start and place in that order, 16 bytes a document for each of the
/// two epochs last gathered, laid out by the epoch's first gather.
#[derive(Debug)]
pub struct Packed {
    stored: Stored,
    seq_len: usize,
    windows: Windows,
    scan: Scan,
    /// Each document's first token in the concatenation, where the token file does not
    /// hold them back to back (otherwise it follows from the index).
    starts: Option<Vec<u64>>,
    /// The first document's first byte in the token data: where the concatenation
    /// starts when it is stored back to back.
    first: u64,
    columns: Vec<Column>,
    /// The per-epoch document orders, where documents are shuffled.
    shuffled: Option<Shuffled>,
}

/// Documents in another order each epoch: the seed, and the latest epochs' slots.
#[derive(Debug)]
struct Shuffled {
    seed: u64,
    slots: Mutex<Vec<(u64, Slot)>>,
}

/// Where one epoch's order is laid out, by the first gather that needs it: the others
/// of that epoch wait for it (and those of another epoch do not).
type Slot = Arc<Mutex<Option<Arc<Order>>>>;

/// One epoch's order of documents, laid out for walking windows: the concatenation's
/// `k`-th document starts at its token `places[k].0` (and ends where the next starts,
/// the last at `tokens`) and at byte `places[k].1` of the token data.
#[derive(Debug)]
struct Order {
    places: Vec<(u64, u64)>,
    tokens: u64,
}

/// How many epochs' document orders are kept: the loader may still gather one epoch
/// while it starts the next.
const ORDERS_KEPT: usize = 2;

impl Packed {
    /// Packs a Megatron (or fairseq `mmap`) indexed dataset: `prefix.idx` and
    /// `prefix.bin`, as [`Documents::open_megatron`](super::Documents::open_megatron)
    /// opens them.
    ///
    /// # Errors
    /// As [`Documents::open_megatron`](super::Documents::open_megatron); also
    /// [`Error::Dataset`] naming the token file when the documents hold fewer than
    /// `seq_len + 1` tokens or one is longer than an `int32` position can count, and
    /// [`Error::Config`] for `seq_len == 0`.
    pub fn open_megatron(
        prefix: impl AsRef<Path>,
        seq_len: usize,
        windows: Windows,
    ) -> Result<Packed> {
        Self::build(Stored::megatron(prefix.as_ref())?, seq_len, windows)
    }

    /// Packs a 1-d integer `.npy` of tokens with a 1-d integer `.npy` of `n + 1` offsets
    /// into it, as [`Documents::open_npy`](super::Documents::open_npy) opens them.
    ///
    /// # Errors
    /// As [`Documents::open_npy`](super::Documents::open_npy), and as
    /// [`open_megatron`](Packed::open_megatron) for the windows.
    pub fn open_npy(
        tokens: impl AsRef<Path>,
        offsets: impl AsRef<Path>,
        seq_len: usize,
        windows: Windows,
    ) -> Result<Packed> {
        let stored = Stored::npy(tokens.as_ref(), offsets.as_ref())?;
        Self::build(stored, seq_len, windows)
    }

    /// Packs the list-of-integers column `column` of an Arrow IPC file (a Hugging Face
    /// `datasets` table's `input_ids`, say), as
    /// [`Documents::open_arrow`](super::Documents::open_arrow) opens it.
    ///
    /// # Errors
    /// As [`Documents::open_arrow`](super::Documents::open_arrow), and as
    /// [`open_megatron`](Packed::open_megatron) for the windows.
    pub fn open_arrow(
        path: impl AsRef<Path>,
        column: &str,
        seq_len: usize,
        windows: Windows,
    ) -> Result<Packed> {
        Self::build(Stored::arrow(path.as_ref(), column)?, seq_len, windows)
    }

    /// Packs the array column `column` of a MosaicML Streaming shard, as
    /// [`Documents::open_mds`](super::Documents::open_mds) opens it.
    ///
    /// # Errors
    /// As [`Documents::open_mds`](super::Documents::open_mds), and as
    /// [`open_megatron`](Packed::open_megatron) for the windows.
    pub fn open_mds(
        path: impl AsRef<Path>,
        column: &str,
        seq_len: usize,
        windows: Windows,
    ) -> Result<Packed> {
        Self::build(Stored::mds(path.as_ref(), column, None)?, seq_len, windows)
    }

    /// Packs column `column` of a MosaicML Streaming shard, its values `dtype`, as
    /// [`Documents::open_mds_bytes`](super::Documents::open_mds_bytes) opens it.
    ///
    /// # Errors
    /// As [`Documents::open_mds_bytes`](super::Documents::open_mds_bytes), and as
    /// [`open_megatron`](Packed::open_megatron) for the windows.
    pub fn open_mds_bytes(
        path: impl AsRef<Path>,
        column: &str,
        dtype: DType,
        seq_len: usize,
        windows: Windows,
    ) -> Result<Packed> {
        Self::build(
            Stored::mds(path.as_ref(), column, Some(dtype))?,
            seq_len,
            windows,
        )
    }

    fn build(stored: Stored, seq_len: usize, windows: Windows) -> Result<Packed> {
        Windows::check(seq_len)?;
        let scan = stored.scan(u64::MAX)?;
        let path = &stored.tokens.path;
        if scan.tokens <= seq_len as u64 {
            return Err(Error::dataset(
                path,
                format!(
                    "its {} documents hold {} tokens, fewer than one window of seq_len + 1 = {}",
                    stored.docs,
                    scan.tokens,
                    seq_len + 1
                ),
            ));
        }
        if scan.longest > i32::MAX as u64 {
            return Err(Error::dataset(
                path,
                format!(
                    "a document of {} tokens: positions are int32, so documents hold at \
                     most {} tokens",
                    scan.longest,
                    i32::MAX
                ),
            ));
        }
        let first = stored.extents(&[0])?[0].0;
        let starts = match scan.contiguous {
            true => None,
            false => {
                let mut next = 0u64;
                let all = stored.each_extent(0..stored.docs, |(_, len)| {
                    next += len;
                    next - len
                });
                Some(all?)
            }
        };
        let columns = vec![
            Column {
                name: "tokens".into(),
                dtype: stored.dtype,
                shape: vec![seq_len as u64 + 1],
                row_bytes: (seq_len + 1) * stored.dtype.size(),
            },
            Column {
                name: "positions".into(),
                dtype: DType::I32,
                shape: vec![seq_len as u64 + 1],
                row_bytes: (seq_len + 1) * 4,
            },
        ];
        Ok(Packed {
            stored,
            seq_len,
            windows,
            scan,
            starts,
            first,
            columns,
            shuffled: None,
        })
    }

    /// Concatenates the documents in another order each epoch, a permutation of them
    /// drawn from `(seed, epoch)`, instead of their stored order. A window's tokens then
    /// lie in several places of the token file where they lay in one; each epoch's
    /// first gather lays the order out (each document's start in it and place in the
    /// token file, 16 bytes a document, from a read of the whole index: about 5 ms for
    /// 200,000 documents here), and the two latest epochs' are kept.
    pub fn shuffle_documents(mut self, seed: u64) -> Packed {
        self.shuffled = Some(Shuffled {
            seed,
            slots: Mutex::default(),
        });
        self
    }

    /// The order of `epoch`'s documents, where they are shuffled
    /// ([`shuffle_documents`](Packed::shuffle_documents)): the concatenation's `k`-th
    /// document is `apply(k)`. `None` for the stored order.
    pub fn document_order(&self, epoch: u64) -> Option<Permutation> {
        let seed = self.shuffled.as_ref()?.seed;
        let key = mix(mix(seed ^ 0x646f_6373) ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        Some(Permutation::new(self.stored.docs, key))
    }

    /// `epoch`'s order of documents with their starts and places, laid out by its
    /// first caller; `None` for the stored order.
    ///
    /// # Errors
    /// [`Error::Dataset`] naming the index when it could not be read, or no longer
    /// holds the documents it held when checked.
    fn order(&self, epoch: u64) -> Result<Option<Arc<Order>>> {
        let (Some(shuffled), Some(permutation)) = (&self.shuffled, self.document_order(epoch))
        else {
            return Ok(None);
        };
        let slot = {
            let mut slots = shuffled
                .slots
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match slots.iter().find(|(e, _)| *e == epoch) {
                Some((_, slot)) => Arc::clone(slot),
                None => {
                    if slots.len() == ORDERS_KEPT {
                        slots.remove(0);
                    }
                    slots.push((epoch, Slot::default()));
                    Arc::clone(&slots[slots.len() - 1].1)
                }
            }
        };
        let mut laid = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(order) = &*laid {
            return Ok(Some(Arc::clone(order)));
        }
        let mut next = 0u64;
        let docs = (0..self.stored.docs).map(|k| permutation.apply(k));
        let places = self.stored.each_extent(docs, |(byte, len)| {
            next = next.saturating_add(len);
            (next - len, byte)
        })?;
        if next != self.scan.tokens {
            return Err(self.stored.index().changed());
        }
        let order = Arc::new(Order {
            places,
            tokens: next,
        });
        *laid = Some(Arc::clone(&order));
        Ok(Some(order))
    }

    /// Tokens in all documents: the length of the concatenation.
    pub fn tokens(&self) -> u64 {
        self.scan.tokens
    }

    /// Documents in the files.
    pub fn documents(&self) -> u64 {
        self.stored.docs
    }

    /// The longest document's length, in tokens.
    pub fn longest(&self) -> u64 {
        self.scan.longest
    }

    /// The window length minus one.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The token type.
    pub fn dtype(&self) -> DType {
        self.stored.dtype
    }

    /// The first token (in the concatenation) of window `index` in `epoch`.
    ///
    /// # Panics
    /// If `index >= len()` (its start would overflow or pass the concatenation).
    pub fn window_start(&self, epoch: u64, index: u64) -> u64 {
        assert!(index < self.len(), "window {index} of {}", self.len());
        self.windows
            .start(epoch, index, self.seq_len, self.scan.tokens)
    }

    /// The first token, in the concatenation of `order` (the stored order for
    /// `None`), of its `k`-th document.
    fn start(&self, extent: Extent<'_>, order: Option<&Order>, k: u64) -> Option<u64> {
        match (order, &self.starts) {
            (Some(order), _) => order.places.get(k as usize).map(|p| p.0),
            (None, Some(starts)) => starts.get(k as usize).copied(),
            (None, None) => {
                let byte = extent(k)?.0.checked_sub(self.first)?;
                Some(byte / self.stored.dtype.size() as u64)
            }
        }
    }

    /// The place and length of the `k`-th document of `order` (the stored order for
    /// `None`), as `extent` gives them.
    fn extent(&self, extent: Extent<'_>, order: Option<&Order>, k: u64) -> Option<(u64, u64)> {
        match order {
            Some(order) => {
                let k = usize::try_from(k).ok()?;
                let (start, byte) = *order.places.get(k)?;
                let end = order.places.get(k + 1).map_or(order.tokens, |p| p.0);
                Some((byte, end - start))
            }
            None => extent(k),
        }
    }

    /// Calls `piece(byte, tokens, position)` for each run of window `from`'s tokens
    /// (in the concatenation of `order`, the stored order for `None`) that lies in one
    /// document, in order: `tokens` tokens at `byte` of the token data, the first of
    /// them at `position` in its document. `None` if the index no longer holds the
    /// documents it held when checked.
    fn walk(
        &self,
        extent: Extent<'_>,
        order: Option<&Order>,
        from: u64,
        mut piece: impl FnMut(u64, u64, u64),
    ) -> Option<()> {
        // The document holding token `from`: the last one starting at or before it
        // (documents before it may be empty and start there too).
        let (mut lo, mut hi) = (0, self.stored.docs);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match self.start(extent, order, mid)? <= from {
                true => lo = mid,
                false => hi = mid,
            }
        }
        let width = self.stored.dtype.size() as u64;
        let (mut k, mut skip) = (lo, from.checked_sub(self.start(extent, order, lo)?)?);
        let mut left = self.seq_len as u64 + 1;
        while left > 0 {
            let (byte, len) = self.extent(extent, order, k)?;
            let take = len.checked_sub(skip)?.min(left);
            if take > 0 {
                piece(byte.checked_add(skip.checked_mul(width)?)?, take, skip);
            }
            left -= take;
            k += 1;
            skip = 0;
        }
        Some(())
    }
}

impl Dataset for Packed {
    /// Covers the windows, their length, the documents' order (stored, or shuffled
    /// and its seed) and the column read (an Arrow or MDS set's, and its type).
    fn fingerprint(&self) -> u64 {
        let [kind, seed] = self.windows.fingerprint_parts();
        let [shuffled, shuffle_seed] = self.shuffled.as_ref().map_or([0, 0], |s| [1, s.seed]);
        let key = self.stored.key;
        fold([kind, seed, self.seq_len as u64, shuffled, shuffle_seed, key])
    }

    fn same_every_epoch(&self) -> bool {
        self.windows == Windows::Consecutive && self.shuffled.is_none()
    }

    fn len(&self) -> u64 {
        Windows::count(self.seq_len, self.scan.tokens)
    }

    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> Result<()> {
        check_out(&self.columns, indices.len(), out)?;
        let len = self.len();
        if let Some(&index) = indices.iter().find(|&&i| i >= len) {
            return Err(Error::OutOfRange { index, len });
        }
        let order = self.order(epoch)?;
        let (tokens, positions) = out.split_at_mut(1);
        let rows = positions[0].chunks_exact_mut(self.columns[1].row_bytes);
        // The index first (the positions, and where each run of tokens is), then the
        // tokens: one guarded read of each file at a time.
        let mut pieces = Vec::with_capacity(indices.len());
        let walked = self.stored.with_extents(|extent| {
            for (row, &index) in rows.zip(indices) {
                let mut slots = row.chunks_exact_mut(4);
                let from = self.window_start(epoch, index);
                self.walk(extent, order.as_deref(), from, |byte, n, position| {
                    pieces.push((byte, n));
                    // The range first: `zip` takes no slot past its end.
                    for (p, slot) in (position..position + n).zip(slots.by_ref()) {
                        slot.copy_from_slice(&(p as i32).to_le_bytes());
                    }
                })?;
            }
            Some(())
        })?;
        walked.ok_or_else(|| self.stored.index().changed())?;
        let width = self.stored.dtype.size();
        let copied = self.stored.tokens.read(|m| {
            let data = &m[self.stored.data..];
            let mut at = 0;
            for &(byte, n) in &pieces {
                let bytes = n as usize * width;
                let from = usize::try_from(byte).ok()?;
                let src = data.get(from..from.checked_add(bytes)?)?;
                tokens[0][at..at + bytes].copy_from_slice(src);
                at += bytes;
            }
            Some(())
        })?;
        copied.ok_or_else(|| self.stored.tokens.changed())
    }

    fn files(&self) -> Vec<MappedFile<'_>> {
        self.stored.files()
    }

    /// The window's runs of bytes in the token file (one run where the documents are
    /// stored back to back); the positions are computed, and the index left out as for
    /// [`Documents`](super::Documents).
    fn locate(&self, epoch: u64, index: u64, each: &mut dyn FnMut(usize, usize, usize)) {
        if index >= self.len() {
            return;
        }
        let Ok(order) = self.order(epoch) else {
            return;
        };
        let width = self.stored.dtype.size() as u64;
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let from = self.window_start(epoch, index);
        let walked = self.stored.with_extents(|extent| {
            self.walk(extent, order.as_deref(), from, |byte, n, _| {
                match runs.last_mut() {
                    Some(last) if last.0.checked_add(last.1) == Some(byte) => last.1 += n * width,
                    _ => runs.push((byte, n * width)),
                }
            })
        });
        if let Ok(Some(())) = walked {
            for (byte, bytes) in runs {
                if let Some(at) = self.stored.data.checked_add(byte as usize) {
                    each(0, at, bytes as usize);
                }
            }
        }
    }
}
