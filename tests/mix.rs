//! A mixture of datasets through the loader: each epoch holds every position once,
//! each part in its share, each row the sample `Mix::source` names (warm, streamed
//! from storage, on any worker count and on two ranks), and an epoch resumes exactly.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use stokehold::{DType, Dataset, Loader, LoaderState, Mix, Shard, Shuffle, TokenDataset, Windows};

const SEQ: usize = 64;

/// The token files: name, tokens, first token (token `i` is `first + i % 4096`).
const FILES: [(&str, usize, u16); 4] = [
    ("web.bin", 200_000, 0),
    ("code.bin", 40 * SEQ + 1, 10_000),
    ("books.bin", 30_000, 20_000),
    ("math.bin", 9_000, 30_000),
];

/// Writes [`FILES`] into `dir`, raw `uint16` tokens.
fn write(dir: &Path) {
    for (name, n, first) in FILES {
        let bytes: Vec<u8> = (0..n)
            .flat_map(|i| (first + (i % 4096) as u16).to_le_bytes())
            .collect();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// A mix of four token files (random windows), of which the second is upsampled (it
/// holds 40 windows) and the first downsampled.
fn parts(dir: &Path) -> Vec<Arc<dyn Dataset>> {
    let windows = Windows::Random { seed: 5 };
    let open = |path: &Path, w: Windows| -> Arc<dyn Dataset> {
        Arc::new(TokenDataset::open_bin(path, DType::U16, SEQ, w).unwrap())
    };
    FILES
        .iter()
        .enumerate()
        .map(|(k, (name, _, _))| open(&dir.join(name), windows.for_part(k)))
        .collect()
}

fn mix(dir: &Path) -> Mix {
    Mix::new(parts(dir), &[0.5, 0.25, 0.15, 0.1], Some(1000), 17).unwrap()
}

/// Every row of one epoch (or its first `stop_after` batches), by position.
fn rows(loader: &mut Loader, epoch: u64, stop_after: Option<usize>) -> Vec<(u64, Vec<u16>)> {
    let mut out = Vec::new();
    for batch in loader
        .epoch(epoch)
        .unwrap()
        .take(stop_after.unwrap_or(usize::MAX))
    {
        let batch = batch.unwrap();
        let tokens = batch.column::<u16>(0).unwrap();
        for (k, &i) in batch.indices().iter().enumerate() {
            out.push((i, tokens[k * (SEQ + 1)..(k + 1) * (SEQ + 1)].to_vec()));
        }
    }
    out
}

/// The row of position `i` of `epoch`: its part's sample, gathered from the part.
fn expected(m: &Mix, epoch: u64, i: u64) -> (usize, Vec<u16>) {
    let (p, s) = m.source(epoch, i).unwrap();
    let mut row = [0u8; 2 * (SEQ + 1)];
    m.parts()[p]
        .gather(epoch, &[s], &mut [&mut row[..]])
        .unwrap();
    (
        p,
        row.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect(),
    )
}

#[test]
fn a_mix_serves_each_part_its_share_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let reference = mix(dir.path());
    assert_eq!(reference.takes(), [500, 250, 150, 100]);
    let build = |workers: usize, budget: Option<u64>, shard: Shard| {
        let mut b = Loader::builder(mix(dir.path()))
            .batch_size(32)
            .shuffle(Shuffle::Full { seed: 3 })
            .shard(shard)
            .workers(workers);
        if let Some(bytes) = budget {
            b = b.page_cache_budget(bytes);
        }
        b.build().unwrap()
    };
    let mut first = None;
    for (workers, budget) in [(2, None), (1, None), (3, Some(0))] {
        let mut loader = build(workers, budget, Shard::single());
        for epoch in 0..3 {
            let got = rows(&mut loader, epoch, None);
            assert_eq!(got.len(), 1000);
            let mut seen = HashSet::new();
            let mut per_part = [0u64; 4];
            for (i, row) in &got {
                assert!(seen.insert(*i), "position {i} twice");
                let (p, want) = expected(&reference, epoch, *i);
                per_part[p] += 1;
                assert_eq!(
                    row, &want,
                    "position {i} of epoch {epoch}, {workers} workers"
                );
            }
            assert_eq!(per_part, [500, 250, 150, 100]);
            // The shuffle spreads the parts: the first 200 rows hold every part.
            let early: HashSet<usize> = got[..200]
                .iter()
                .map(|(i, _)| reference.source(epoch, *i).unwrap().0)
                .collect();
            assert_eq!(early.len(), 4, "epoch {epoch}");
            if epoch == 1 {
                match &first {
                    None => first = Some(got),
                    Some(f) => assert_eq!(f, &got, "{workers} workers, budget {budget:?}"),
                }
            }
        }
    }
    // Two ranks take every position of the epoch once between them.
    let mut both = Vec::new();
    for rank in 0..2 {
        let mut loader = build(2, None, Shard::new(rank, 2).unwrap());
        both.extend(rows(&mut loader, 1, None).into_iter().map(|(i, _)| i));
    }
    both.sort_unstable();
    assert_eq!(both, (0..1000).collect::<Vec<u64>>());
    // Stopped after 7 batches and resumed from the state: the rest of the epoch.
    let mut loader = build(2, None, Shard::single());
    let whole = rows(&mut loader, 2, None);
    let head = rows(&mut loader, 2, Some(7));
    let state: LoaderState = loader.state();
    let mut resumed = build(2, None, Shard::single());
    resumed.resume(state).unwrap();
    let tail = rows(&mut resumed, 2, None);
    assert_eq!([head, tail].concat(), whole);
}

#[test]
fn a_downsampled_part_serves_all_its_windows_before_any_again() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let m = mix(dir.path());
    // web.bin: (200,000 - 1) / 64 = 3124 windows, 500 an epoch: 6 epochs and 124.
    let n = m.parts()[0].len();
    assert_eq!(n, 3124);
    let mut drawn = Vec::new();
    for epoch in 0..7 {
        drawn.extend((0..500).map(|i| m.source(epoch, i).unwrap()));
    }
    let (first, next): (Vec<_>, Vec<_>) = drawn.iter().enumerate().partition(|(k, _)| *k < 3124);
    let first: HashSet<u64> = first
        .iter()
        .map(|(_, (p, s))| {
            assert_eq!(*p, 0);
            *s
        })
        .collect();
    assert_eq!(first.len(), 3124);
    let next: HashSet<u64> = next.iter().map(|(_, (_, s))| *s).collect();
    assert_eq!(next.len(), 3500 - 3124);
}

#[test]
fn a_state_over_the_same_files_opened_otherwise_is_refused() {
    // Each set below has the same length and the same files as the first, and serves
    // other samples at the same positions: a state saved over one must not resume the
    // rest of its epoch over another.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let web = dir.path().join("web.bin");
    let tokens = |w: Windows, seq: usize| -> Arc<dyn Dataset> {
        Arc::new(TokenDataset::open_bin(&web, DType::U16, seq, w).unwrap())
    };
    let random = |seed| Windows::Random { seed };
    let mixed = |weights: &[f64], seed| -> Arc<dyn Dataset> {
        Arc::new(Mix::new(parts(dir.path()), weights, Some(1000), seed).unwrap())
    };
    let joined = |order: [usize; 2]| -> Arc<dyn Dataset> {
        let p = parts(dir.path());
        Arc::new(stokehold::Concat::new(vec![p[order[0]].clone(), p[order[1]].clone()]).unwrap())
    };
    let cut = |start: u64| -> Arc<dyn Dataset> {
        Arc::new(stokehold::Subset::new(tokens(random(1), SEQ), start..start + 1000).unwrap())
    };
    type Set = Arc<dyn Dataset>;
    let pairs: Vec<(&str, Set, Set)> = vec![
        (
            "window seed",
            tokens(random(1), SEQ),
            tokens(random(2), SEQ),
        ),
        (
            "window kind",
            tokens(random(1), SEQ),
            tokens(Windows::Consecutive, SEQ),
        ),
        (
            "mix weights",
            mixed(&[0.5, 0.25, 0.15, 0.1], 17),
            mixed(&[0.4, 0.35, 0.15, 0.1], 17),
        ),
        (
            "mix seed",
            mixed(&[0.5, 0.25, 0.15, 0.1], 17),
            mixed(&[0.5, 0.25, 0.15, 0.1], 18),
        ),
        ("concat order", joined([2, 3]), joined([3, 2])),
        ("subset start", cut(0), cut(1000)),
    ];
    for (what, saved, other) in pairs {
        assert_eq!(saved.len(), other.len(), "{what}: the lengths must agree");
        let build = |ds: Arc<dyn Dataset>, resume: Option<LoaderState>| {
            let b = Loader::builder(ds).batch_size(10).shuffle(Shuffle::None);
            match resume {
                Some(s) => b.resume(s).build(),
                None => b.build(),
            }
        };
        let state = {
            let mut loader = build(saved.clone(), None).unwrap();
            let mut epoch = loader.epoch(0).unwrap();
            epoch.next().unwrap().unwrap();
            epoch.state()
        };
        assert!(
            build(saved, Some(state)).is_ok(),
            "{what}: the same set resumes"
        );
        let err = build(other.clone(), Some(state)).unwrap_err();
        assert!(err.to_string().contains("another order"), "{what}: {err}");
        let mut elastic = Loader::builder(other).batch_size(10).shuffle(Shuffle::None);
        elastic = elastic.resume_elastic(state);
        let err = elastic.build().unwrap_err();
        assert!(
            err.to_string().contains("another global order"),
            "{what}: {err}"
        );
    }
}

#[test]
fn datasets_say_whether_their_samples_change_each_epoch() {
    // A device cache keeps the rows one epoch read: a dataset that says its samples
    // stay must serve the same rows in every epoch, and one that says they change must
    // serve other rows (the cache refuses it).
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let web = dir.path().join("web.bin");
    let tokens = |w: Windows| -> Arc<dyn Dataset> {
        Arc::new(TokenDataset::open_bin(&web, DType::U16, SEQ, w).unwrap())
    };
    let random = Windows::Random { seed: 1 };
    let consecutive = Windows::Consecutive;
    let sets: Vec<(&str, Arc<dyn Dataset>, bool)> = vec![
        ("random windows", tokens(random), false),
        ("consecutive windows", tokens(consecutive), true),
        (
            "a mix",
            Arc::new(Mix::new(parts(dir.path()), &[0.5, 0.25, 0.15, 0.1], Some(1000), 3).unwrap()),
            false,
        ),
        (
            "consecutive parts joined",
            Arc::new(
                stokehold::Concat::new(vec![tokens(consecutive), tokens(consecutive)]).unwrap(),
            ),
            true,
        ),
        (
            "a random part joined",
            Arc::new(stokehold::Concat::new(vec![tokens(consecutive), tokens(random)]).unwrap()),
            false,
        ),
        (
            "a cut of consecutive windows",
            Arc::new(stokehold::Subset::new(tokens(consecutive), 10..200).unwrap()),
            true,
        ),
        (
            "a cut of random windows",
            Arc::new(stokehold::Subset::new(tokens(random), 10..200).unwrap()),
            false,
        ),
    ];
    for (what, ds, same) in sets {
        assert_eq!(ds.same_every_epoch(), same, "{what}");
        // Spread over the whole set, every part of a concatenation included.
        let indices: Vec<u64> = (0..ds.len())
            .step_by((ds.len() / 100).max(1) as usize)
            .collect();
        let row = ds.columns()[0].row_bytes;
        let rows = |epoch| {
            let mut out = vec![0u8; indices.len() * row];
            ds.gather(epoch, &indices, &mut [&mut out]).unwrap();
            out
        };
        assert_eq!(
            rows(0) == rows(1),
            same,
            "{what}: the rows of epochs 0 and 1"
        );
    }
}
