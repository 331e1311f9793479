//! A set of more files (200) than the process's soft limit on open files: the limit is raised
//! to the hard one and every window streams; where the hard limit is reached too, the
//! error names the file and the limit. Its own test binary: it changes the process's
//! limits.

use std::sync::Arc;

use stokehold::{Concat, DType, Dataset, Loader, Shuffle, TokenDataset, Windows};

const FILES: usize = 200;

fn limits() -> (u64, u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes into `lim`, a valid `rlimit`.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    (lim.rlim_cur, lim.rlim_max)
}

fn set_limits(soft: u64, hard: u64) {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: `setrlimit` reads `lim`, a valid `rlimit`; lowering needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

fn open_files() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

fn open_all(dir: &std::path::Path) -> stokehold::Result<Concat> {
    let parts = (0..FILES)
        .map(|k| {
            let path = dir.join(format!("shard-{k:04}.bin"));
            let windows = Windows::Consecutive;
            let ds = TokenDataset::open_bin(path, DType::U16, 8, windows)?;
            Ok(Arc::new(ds) as Arc<dyn Dataset>)
        })
        .collect::<stokehold::Result<Vec<_>>>()?;
    Concat::new(parts)
}

#[test]
fn more_shards_than_the_soft_limit_open_and_stream() {
    let (_, hard) = limits();
    // Three descriptors a streamed file, and room: 856, under the lowest hard limit
    // common today (1,024).
    if hard < 4 * FILES as u64 + 56 {
        eprintln!("skipped: the hard limit on open files, {hard}, is below what 200 shards need");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // 200 shards of 5 windows of 8 + 1 tokens: token `i` of shard `k` is `100 k + i`.
    for k in 0..FILES {
        let tokens: Vec<u8> = (0..41u16)
            .flat_map(|i| (100 * k as u16 + i).to_le_bytes())
            .collect();
        std::fs::write(dir.path().join(format!("shard-{k:04}.bin")), tokens).unwrap();
    }
    set_limits(open_files() + 64, hard);
    let set = open_all(dir.path()).unwrap();
    assert_eq!(
        limits(),
        (hard, hard),
        "the soft limit was raised to the hard one"
    );
    // Streamed from storage (a descriptor or two more a file), every window once.
    let mut loader = Loader::builder(set)
        .batch_size(32)
        .shuffle(Shuffle::Full { seed: 1 })
        .workers(2)
        .page_cache_budget(0)
        .build()
        .unwrap();
    let mut seen = vec![false; 5 * FILES];
    for batch in loader.epoch(0).unwrap() {
        let batch = batch.unwrap();
        let tokens = batch.column::<u16>(0).unwrap();
        for (row, &i) in tokens.chunks_exact(9).zip(batch.indices()) {
            let (k, w) = (i / 5, i % 5);
            let first = (100 * k + 8 * w) as u16;
            assert_eq!(row, (first..first + 9).collect::<Vec<u16>>(), "window {i}");
            assert!(
                !std::mem::replace(&mut seen[i as usize], true),
                "window {i} twice"
            );
        }
    }
    assert!(seen.iter().all(|&s| s));
    drop(loader);
    // A hard limit the set does not fit under: an error naming a shard and the limit.
    let low = open_files() + 64;
    set_limits(low, low);
    let err = open_all(dir.path()).unwrap_err().to_string();
    let shard = dir.path().join("shard-0").display().to_string();
    assert!(err.starts_with(&shard), "{err}");
    assert!(
        err.contains(&format!("its limit of {low} files open")),
        "{err}"
    );
}
