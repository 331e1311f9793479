//! Packed documents: the documents of an indexed dataset concatenated and cut into
//! windows, each token with its position in its document, checked against the
//! concatenation computed here (fixtures in `tests/fixtures/npy`, as for
//! `tests/documents.rs`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use stokehold::{Dataset, Error, Loader, LoaderState, Packed, Shuffle, Windows};

mod common;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/npy");

fn fx(name: &str) -> PathBuf {
    Path::new(FIXTURES).join(name)
}

/// The documents' tokens back to back, and each token's position in its document.
fn concatenation(docs: &[Vec<i64>]) -> (Vec<i64>, Vec<i32>) {
    let tokens = docs.iter().flatten().copied().collect();
    let positions = docs.iter().flat_map(|d| 0..d.len() as i32).collect();
    (tokens, positions)
}

/// The fixtures' documents (as `tests/documents.rs` describes them), tokens mapped by
/// `f`.
fn fixture_docs(f: impl Fn(i64) -> i64) -> Vec<Vec<i64>> {
    [5, 0, 12, 3, 40, 1]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| f(100 * i as i64 + j)).collect())
        .collect()
}

/// Window `index` of `epoch` of `ds`, gathered alone: its tokens as `i64` and positions.
fn window(ds: &Packed, epoch: u64, index: u64) -> (Vec<i64>, Vec<i32>) {
    let c = ds.columns();
    let (mut t, mut p) = (vec![0u8; c[0].row_bytes], vec![0u8; c[1].row_bytes]);
    ds.gather(epoch, &[index], &mut [&mut t, &mut p]).unwrap();
    let w = c[0].dtype.size();
    let tokens = t
        .chunks_exact(w)
        .map(|b| c[0].dtype.read_i64(b).unwrap())
        .collect();
    let positions = p
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (tokens, positions)
}

/// Checks every window of `ds` in `epochs` against the concatenation of `docs`.
fn check_windows(ds: &Packed, docs: &[Vec<i64>], epochs: std::ops::Range<u64>, what: &str) {
    let (tokens, positions) = concatenation(docs);
    let n = ds.seq_len() + 1;
    assert_eq!(ds.tokens(), tokens.len() as u64, "{what}");
    for epoch in epochs {
        for i in 0..ds.len() {
            let s = ds.window_start(epoch, i) as usize;
            let want = (tokens[s..s + n].to_vec(), positions[s..s + n].to_vec());
            assert_eq!(
                window(ds, epoch, i),
                want,
                "{what}: window {i} of epoch {epoch}"
            );
        }
    }
}

#[test]
fn every_layout_packs_to_the_concatenation_with_positions() {
    let seed = Windows::Random { seed: 5 };
    for windows in [Windows::Consecutive, seed] {
        let ds = Packed::open_megatron(fx("megatron_u16"), 7, windows).unwrap();
        // 61 tokens: (61 - 1) / 7 windows of 8 tokens, the last target at token 56.
        assert_eq!((ds.len(), ds.documents(), ds.longest()), (8, 6, 40));
        let names: Vec<&str> = ds.columns().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["tokens", "positions"]);
        assert_eq!(ds.columns()[1].shape, [8]);
        check_windows(&ds, &fixture_docs(|t| t), 0..3, "megatron_u16");
        let ds = Packed::open_megatron(fx("fairseq_u32"), 5, windows).unwrap();
        check_windows(&ds, &fixture_docs(|t| t * 100_000), 0..2, "fairseq_u32");
        let ds = Packed::open_megatron(fx("megatron_i32.idx"), 3, windows).unwrap();
        check_windows(&ds, &fixture_docs(|t| t * 70000 - 5), 0..2, "megatron_i32");
        let hf = fx("../arrow/hf_stream.arrow");
        let ds = Packed::open_arrow(&hf, "input_ids", 9, windows).unwrap();
        check_windows(&ds, &fixture_docs(|t| t), 0..2, "hf_stream.arrow");
        let empty = fx("../arrow/empty_batches.arrow");
        let ds = Packed::open_arrow(&empty, "input_ids", 6, windows).unwrap();
        check_windows(&ds, &fixture_docs(|t| t), 0..2, "empty_batches.arrow");
        let ds = Packed::open_arrow(fx("../arrow/mixed_file.arrow"), "tokens", 4, windows).unwrap();
        check_windows(&ds, &fixture_docs(|t| t), 0..2, "mixed_file.arrow");
        for offsets in ["docs_offsets.npy", "docs_offsets_u32.npy"] {
            let ds = Packed::open_npy(fx("docs_tokens.npy"), fx(offsets), 11, windows).unwrap();
            check_windows(&ds, &fixture_docs(|t| t), 0..2, offsets);
        }
    }
    // The first window, written out: document 0 (5 tokens), the empty document 1, then
    // document 2 from its start.
    let ds = Packed::open_megatron(fx("megatron_u16"), 7, Windows::Consecutive).unwrap();
    let (tokens, positions) = window(&ds, 0, 0);
    assert_eq!(tokens, [0, 1, 2, 3, 4, 200, 201, 202]);
    assert_eq!(positions, [0, 1, 2, 3, 4, 0, 1, 2]);
}

#[test]
fn documents_stored_out_of_order_pack_in_index_order() {
    let dir = tempfile::tempdir().unwrap();
    let docs = common::random_documents(300, 200, 77);
    let wide: Vec<Vec<i64>> = docs
        .iter()
        .map(|d| d.iter().map(|&t| i64::from(t)).collect())
        .collect();
    for reversed in [false, true] {
        let prefix = common::write_megatron(dir.path(), &docs, reversed);
        for windows in [Windows::Consecutive, Windows::Random { seed: 1 }] {
            let ds = Packed::open_megatron(&prefix, 64, windows).unwrap();
            check_windows(&ds, &wide, 0..2, &format!("reversed {reversed}"));
        }
    }
}

#[test]
fn bad_packing_settings_and_short_sets_are_errors_naming_the_file() {
    let open = |seq_len| Packed::open_megatron(fx("megatron_u16"), seq_len, Windows::Consecutive);
    for seq_len in [0, usize::MAX] {
        assert!(
            matches!(open(seq_len), Err(Error::Config(m)) if m.contains("seq_len")),
            "{seq_len}"
        );
    }
    // 61 tokens make one window of 61 (seq_len 60), none of 62.
    assert_eq!(open(60).unwrap().len(), 1);
    let err = open(61).unwrap_err();
    let Error::Dataset { path, .. } = &err else {
        panic!("{err}");
    };
    assert!(path.ends_with("megatron_u16.bin"), "{err}");
    assert!(
        err.to_string().contains("6 documents hold 61 tokens"),
        "{err}"
    );
    // A bad index is refused as for padded documents.
    let err = Packed::open_megatron(fx("megatron_bad_pointer"), 4, Windows::Consecutive);
    let err = err.unwrap_err();
    assert!(
        err.to_string().contains("megatron_bad_pointer.idx"),
        "{err}"
    );
    assert!(err.to_string().contains("lies outside"), "{err}");
    let err = Packed::open_npy(
        fx("docs_tokens.npy"),
        fx("docs_bad_falling.npy"),
        4,
        Windows::Consecutive,
    );
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("docs_bad_falling.npy"));
}

#[test]
fn files_cut_after_opening_are_errors_not_signals() {
    let dir = tempfile::tempdir().unwrap();
    for ext in ["bin", "idx"] {
        let to = dir.path().join(format!("d.{ext}"));
        std::fs::copy(fx(&format!("megatron_u16.{ext}")), to).unwrap();
    }
    let ds = Packed::open_megatron(dir.path().join("d"), 7, Windows::Consecutive).unwrap();
    let bin = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("d.bin"))
        .unwrap();
    bin.set_len(10).unwrap();
    let (mut t, mut p) = (vec![0u8; 8 * 16], vec![0u8; 8 * 32]);
    let err = ds.gather(0, &[0, 7], &mut [&mut t, &mut p]).unwrap_err();
    assert!(err.to_string().contains("d.bin"), "{err}");
    let err = ds.gather(0, &[8], &mut [&mut t, &mut p]).unwrap_err();
    assert!(
        matches!(err, Error::OutOfRange { index: 8, len: 8 }),
        "{err}"
    );
    // An index cut short before a shuffled epoch's order is made from it.
    std::fs::copy(fx("megatron_u16.bin"), dir.path().join("d.bin")).unwrap();
    let ds = Packed::open_megatron(dir.path().join("d"), 7, Windows::Consecutive)
        .unwrap()
        .shuffle_documents(1);
    let idx = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("d.idx"))
        .unwrap();
    idx.set_len(40).unwrap();
    let err = ds.gather(0, &[0], &mut [&mut t, &mut p]).unwrap_err();
    assert!(err.to_string().contains("d.idx"), "{err}");
}

/// Every window of one epoch of `loader`, by index: tokens and positions.
fn epoch_windows(
    loader: &mut Loader,
    epoch: u64,
    stop_after: Option<usize>,
) -> Vec<(u64, Vec<u16>, Vec<i32>)> {
    let n = loader.dataset().columns()[0].shape[0] as usize;
    let mut out = Vec::new();
    let it = loader.epoch(epoch).unwrap();
    for batch in it.take(stop_after.unwrap_or(usize::MAX)) {
        let batch = batch.unwrap();
        let tokens = batch.column_named::<u16>("tokens").unwrap();
        let positions = batch.column_named::<i32>("positions").unwrap();
        for (k, &i) in batch.indices().iter().enumerate() {
            let row = k * n..(k + 1) * n;
            out.push((i, tokens[row.clone()].to_vec(), positions[row].to_vec()));
        }
    }
    out
}

#[test]
fn loader_epochs_stream_shuffle_and_resume_packed_windows() {
    let dir = tempfile::tempdir().unwrap();
    let docs = common::random_documents(1500, 3000, 0x9e37_79b9_7f4a_7c15);
    let prefix = common::write_megatron(dir.path(), &docs, false);
    let windows = Windows::Random { seed: 9 };
    // Documents in stored order, then shuffled per epoch.
    for shuffled in [false, true] {
        let open = || {
            let ds = Packed::open_megatron(&prefix, 1024, windows).unwrap();
            match shuffled {
                true => ds.shuffle_documents(11),
                false => ds,
            }
        };
        let build = |budget: Option<u64>| {
            let mut b = Loader::builder(open())
                .batch_size(16)
                .shuffle(Shuffle::Full { seed: 3 })
                .workers(2);
            if let Some(bytes) = budget {
                b = b.page_cache_budget(bytes);
            }
            b.build().unwrap()
        };
        let reference = open();
        // Warm, then streamed under a zero page-cache budget.
        for budget in [None, Some(0)] {
            let mut loader = build(budget);
            for epoch in 0..2 {
                let order = |k: u64| reference.document_order(epoch).map_or(k, |o| o.apply(k));
                let wide: Vec<Vec<i64>> = (0..docs.len() as u64)
                    .map(|k| {
                        docs[order(k) as usize]
                            .iter()
                            .map(|&t| i64::from(t))
                            .collect()
                    })
                    .collect();
                let (tokens, positions) = concatenation(&wide);
                let got = epoch_windows(&mut loader, epoch, None);
                assert_eq!(got.len() as u64, reference.len());
                let mut seen = HashSet::new();
                for (i, t, p) in &got {
                    assert!(seen.insert(*i), "window {i} twice");
                    let s = reference.window_start(epoch, *i) as usize;
                    let want: Vec<u16> = tokens[s..s + 1025].iter().map(|&x| x as u16).collect();
                    assert_eq!(t, &want, "window {i} of epoch {epoch}, shuffled {shuffled}");
                    assert_eq!(p, &positions[s..s + 1025], "window {i}'s positions");
                }
            }
        }
        // Stopped after 10 batches and resumed from the state: the rest of the epoch.
        let mut loader = build(None);
        let whole = epoch_windows(&mut loader, 1, None);
        let head = epoch_windows(&mut loader, 1, Some(10));
        let state: LoaderState = loader.state();
        let mut resumed = build(None);
        resumed.resume(state).unwrap();
        let tail = epoch_windows(&mut resumed, 1, None);
        assert_eq!([head, tail].concat(), whole, "shuffled {shuffled}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any documents (empty ones included), any window length, stored in order or not:
    /// each window is the concatenation's, with its positions.
    #[test]
    fn any_documents_pack_to_their_concatenation(
        lens in prop::collection::vec(0usize..40, 1..30),
        seq_len in 1usize..50,
        reversed in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let docs: Vec<Vec<u16>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (1000 * i + j) as u16).collect())
            .collect();
        let total: usize = lens.iter().sum();
        prop_assume!(total > seq_len);
        let dir = tempfile::tempdir().unwrap();
        let prefix = common::write_megatron(dir.path(), &docs, reversed);
        let wide: Vec<Vec<i64>> = docs
            .iter()
            .map(|d| d.iter().map(|&t| i64::from(t)).collect())
            .collect();
        for windows in [Windows::Consecutive, Windows::Random { seed }] {
            let ds = Packed::open_megatron(&prefix, seq_len, windows).unwrap();
            prop_assert_eq!(ds.len(), ((total - 1) / seq_len) as u64);
            prop_assert!(ds.document_order(0).is_none());
            check_windows(&ds, &wide, 0..2, "random documents");
            // Shuffled: each epoch's windows are those of its own order's concatenation.
            let ds = ds.shuffle_documents(seed);
            for epoch in 0..3 {
                let order = ds.document_order(epoch).unwrap();
                let docs: Vec<Vec<i64>> = (0..wide.len() as u64)
                    .map(|k| wide[order.apply(k) as usize].clone())
                    .collect();
                check_windows(&ds, &docs, epoch..epoch + 1, "shuffled documents");
            }
        }
    }
}

/// The documents one epoch of consecutive windows holds, cut where positions are 0:
/// all whole but the last, which may be cut short.
fn documents_in_windows(ds: &Packed, epoch: u64) -> Vec<Vec<i64>> {
    let mut docs: Vec<Vec<i64>> = Vec::new();
    for i in 0..ds.len() {
        let (tokens, positions) = window(ds, epoch, i);
        // Each window's first token is the previous one's last.
        let skip = usize::from(i > 0);
        for (&t, &p) in tokens.iter().zip(&positions).skip(skip) {
            match docs.last_mut() {
                Some(doc) if p != 0 => {
                    assert_eq!(p as usize, doc.len(), "positions count on in a document");
                    doc.push(t);
                }
                _ => {
                    assert_eq!(p, 0, "a document starts at position 0");
                    docs.push(vec![t]);
                }
            }
        }
    }
    docs
}

#[test]
fn shuffled_documents_come_whole_once_an_epoch_in_another_order_each_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let docs = common::random_documents(400, 60, 0x5eed);
    let prefix = common::write_megatron(dir.path(), &docs, true);
    let wide: Vec<Vec<i64>> = docs
        .iter()
        .map(|d| d.iter().map(|&t| i64::from(t)).collect())
        .filter(|d: &Vec<i64>| !d.is_empty())
        .collect();
    let stored = Packed::open_megatron(&prefix, 64, Windows::Consecutive).unwrap();
    let in_stored_order = documents_in_windows(&stored, 0);
    let ds = Packed::open_megatron(&prefix, 64, Windows::Consecutive)
        .unwrap()
        .shuffle_documents(7);
    let mut orders = Vec::new();
    for epoch in 0..3 {
        let got = documents_in_windows(&ds, epoch);
        // Every document once and whole, but the last one an epoch reaches, which may
        // be cut short, and those past it.
        let (last, whole) = got.split_last().unwrap();
        let mut left = wide.clone();
        for doc in whole {
            let at = left.iter().position(|d| d == doc);
            left.swap_remove(at.unwrap_or_else(|| panic!("epoch {epoch}: {doc:?} is no document")));
        }
        assert!(
            left.iter().any(|d| d.starts_with(last)),
            "epoch {epoch}: the last one"
        );
        let short: usize = left.iter().map(Vec::len).sum::<usize>() - last.len();
        assert!(
            short < 65,
            "epoch {epoch}: {short} tokens left out, less than a window"
        );
        assert_ne!(got, in_stored_order, "epoch {epoch} is not in stored order");
        assert!(!orders.contains(&got), "epoch {epoch} repeats an order");
        orders.push(got);
    }
    // The same seed, the same orders.
    let again = Packed::open_megatron(&prefix, 64, Windows::Consecutive)
        .unwrap()
        .shuffle_documents(7);
    assert_eq!(documents_in_windows(&again, 1), orders[1]);
}

#[test]
#[should_panic(expected = "window 20 of 20")]
fn a_window_past_the_end_has_no_start() {
    // 61 tokens in windows of 4: 20 windows, the last starting at token 57.
    let ds = Packed::open_megatron(fx("megatron_i32.idx"), 3, Windows::Consecutive).unwrap();
    assert_eq!((ds.len(), ds.window_start(0, 19)), (20, 57));
    ds.window_start(0, 20);
}
