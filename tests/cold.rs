//! Planned storage reads (issue 13): the plan changes what storage does, never the
//! batches; streaming keeps the page cache the loader fills small; the report says what
//! was read.

use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;
use stokehold::gen::{self, ClassificationSpec};
use stokehold::pagecache::{self, storage_read_bytes};
use stokehold::testing::skip_cold;
use stokehold::{
    DType, Dataset, EpochStats, HostBatch, Loader, NpyDataset, Shuffle, Storage, TokenDataset,
};

/// Storage figures are per process (`/proc/self/io`): the tests here take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// A directory for a test's files beside the build (a real file system, where `/tmp`
/// may be tmpfs, whose pages cannot be evicted).
fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// A CIFAR-shaped set of `samples` rows of 3,080 bytes.
fn dataset(dir: &Path, samples: u64) -> Arc<dyn Dataset> {
    let spec = ClassificationSpec {
        samples,
        ..ClassificationSpec::default()
    };
    gen::classification(dir, &spec, &|_| {}).unwrap();
    Arc::new(NpyDataset::open_xy(dir).unwrap())
}

/// A batch's bytes, both columns.
fn bytes(b: &HostBatch) -> Vec<u8> {
    [b.bytes(0), b.bytes(1)].concat()
}

/// Every batch's bytes, in order, from a cold page cache when `cold`.
fn epoch_bytes(loader: &mut Loader, epoch: u64, cold: bool) -> Vec<Vec<u8>> {
    if cold {
        pagecache::evict(loader.dataset().as_ref()).unwrap();
    }
    let it = loader.epoch(epoch).unwrap();
    it.map(|b| bytes(&b.unwrap())).collect()
}

/// A loader of `ds` that streams every file (budget 0), batches of 64, two workers,
/// with direct reads when `direct`.
fn loader(ds: &Arc<dyn Dataset>, shuffle: Shuffle, direct: bool) -> Loader {
    Loader::builder_shared(Arc::clone(ds))
        .batch_size(64)
        .workers(2)
        .shuffle(shuffle)
        .direct_reads(direct)
        .page_cache_budget(0)
        .build()
        .unwrap()
}

/// [`dataset`], where storage figures can be had: evicting works (not on tmpfs, for
/// one) and `/proc/self/io` says what was read; `None`, saying so, elsewhere.
fn measured(dir: &Path, samples: u64) -> Option<Arc<dyn Dataset>> {
    let ds = dataset(dir, samples);
    measurable(ds.as_ref()).then_some(ds)
}

/// Whether storage figures can be had for `ds` here (see [`measured`]); says so if not.
fn measurable(ds: &dyn Dataset) -> bool {
    let yes = evicts(ds) && storage_read_bytes().is_some();
    if !yes {
        skip_cold("no eviction or no /proc/self/io here");
    }
    yes
}

/// The bytes an epoch read from storage, where [`measurable`] said they are counted.
fn read(stats: &EpochStats) -> f64 {
    stats
        .bytes_read
        .expect("/proc/self/io counts this process's reads, the test checked") as f64
}

/// [`dataset`], where evicting works (not on tmpfs, for one); `None`, saying so,
/// elsewhere.
fn evictable(dir: &Path, samples: u64) -> Option<Arc<dyn Dataset>> {
    let ds = dataset(dir, samples);
    if !evicts(ds.as_ref()) {
        skip_cold("the page cache cannot be evicted on this file system");
        return None;
    }
    Some(ds)
}

/// Whether evicting works here (not on tmpfs, for one): the figures need it.
fn evicts(ds: &dyn Dataset) -> bool {
    pagecache::evict(ds).unwrap();
    pagecache::residency(ds).unwrap().fraction() < 0.1
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]

    #[test]
    fn the_plan_never_changes_the_batches(budget in prop_oneof![Just(0u64), 0u64..8 << 20, Just(u64::MAX)], block in any::<bool>(), direct in any::<bool>(), seed in 0u64..4) {
        let _turn = turn();
        let dir = tempdir();
        let ds = dataset(dir.path(), 2000);
        let shuffle = match block {
            true => Shuffle::block(seed),
            false => Shuffle::Full { seed },
        };
        let build = |plan: bool| {
            Loader::builder_shared(Arc::clone(&ds))
                .batch_size(37)
                .workers(2)
                .shuffle(shuffle)
                .plan_reads(plan)
                .direct_reads(direct)
                .page_cache_budget(budget)
                .build()
                .unwrap()
        };
        let want = epoch_bytes(&mut build(false), 1, false);
        let mut planned = build(true);
        prop_assert!(epoch_bytes(&mut planned, 1, true) == want);
        // Warm now (or streamed again): the same.
        prop_assert!(epoch_bytes(&mut planned, 1, false) == want);
    }
}

/// Runs one epoch of `loader`, checks it delivered `samples` and streamed, and returns
/// the share of `file` left in the page cache.
fn streamed_then_resident(
    loader: &mut Loader,
    samples: usize,
    file: stokehold::MappedFile<'_>,
) -> f64 {
    let mut it = loader.epoch(0).unwrap();
    let n = it.by_ref().map(|b| b.unwrap().len()).sum::<usize>();
    assert_eq!(n, samples);
    assert_eq!(it.stats().storage, Storage::Streaming);
    drop(it);
    let resident = pagecache::file_residency(file).unwrap();
    eprintln!("{} of {} pages resident", resident.resident, resident.pages);
    resident.fraction()
}

#[test]
fn streaming_keeps_the_page_cache_it_fills_small() {
    let _turn = turn();
    let dir = tempdir();
    let Some(ds) = evictable(dir.path(), 20_000) else {
        return;
    };
    let mut loader = Loader::builder_shared(Arc::clone(&ds))
        .batch_size(16)
        .workers(2)
        .page_cache_budget(0)
        .build()
        .unwrap();
    // The planned window is 64 batches of 16 rows, two or three pages each: a few MB of
    // a 62 MB set stay behind (of x.npy, with the direct reads none at all).
    assert!(streamed_then_resident(&mut loader, 20_000, ds.files()[0]) < 0.25);
}

#[test]
fn a_cold_epoch_reports_what_storage_read() {
    let _turn = turn();
    let dir = tempdir();
    let Some(ds) = measured(dir.path(), 5000) else {
        return;
    };
    let mut loader = Loader::builder_shared(Arc::clone(&ds)).build().unwrap();
    let mut it = loader.epoch(0).unwrap();
    let rows: usize = it.by_ref().map(|b| b.unwrap().len()).sum();
    let stats = it.stats();
    assert_eq!(stats.storage, Storage::Warming);
    let used = rows as f64 * 3080.0;
    let amplification = read(&stats) / used;
    assert!(
        (0.9..=1.5).contains(&amplification),
        "read {} bytes for {used}",
        read(&stats)
    );
    drop(it);
    let mut it = loader.epoch(1).unwrap();
    it.by_ref().for_each(|b| drop(b.unwrap()));
    assert_eq!(it.stats().storage, Storage::Warm);
}

#[test]
fn a_shared_dataset_says_where_its_rows_live() {
    // The loader holds an `Arc<dyn Dataset>`: `locate` must reach the files through it,
    // or the planner asks for nothing.
    let dir = tempdir();
    let ds = dataset(dir.path(), 100);
    let mut ranges = Vec::new();
    ds.locate(0, 5, &mut |f, offset, len| ranges.push((f, offset, len)));
    assert_eq!(ranges.len(), 2, "one range per column: {ranges:?}");
    assert_eq!((ranges[0].0, ranges[0].2), (0, 3072));
    assert_eq!((ranges[1].0, ranges[1].2), (1, 8));
}

/// One cold epoch of `ds` streamed (budget 0) with direct reads under `shuffle`, against
/// the same epoch read through the page cache: whether the batches were the same, and
/// the read amplification. `None` where direct reads of single rows cannot be had (no
/// io_uring), under a full shuffle.
fn streamed_directly(ds: &Arc<dyn Dataset>, shuffle: Shuffle) -> Option<(bool, f64)> {
    let mut direct = loader(ds, shuffle, true);
    if matches!(shuffle, Shuffle::Full { .. }) && !direct.direct_reads() {
        return None;
    }
    let want = epoch_bytes(&mut loader(ds, shuffle, false), 2, true);
    pagecache::evict(ds.as_ref()).unwrap();
    let mut it = direct.epoch(2).unwrap();
    let got: Vec<Vec<u8>> = it.by_ref().map(|b| bytes(&b.unwrap())).collect();
    let stats = it.stats();
    assert_eq!(stats.storage, Storage::Streaming);
    let rows = ds.len() as f64 * 3080.0;
    Some((got == want, read(&stats) / rows))
}

/// Checks that less than the share `most` of `file`'s pages is in the page cache.
fn resident_at_most(file: stokehold::MappedFile<'_>, most: f64) {
    let resident = pagecache::file_residency(file).unwrap();
    assert!(
        resident.fraction() < most,
        "{} of {} pages of {} resident",
        resident.resident,
        resident.pages,
        file.path().display()
    );
}

#[test]
fn direct_reads_deliver_the_rows_read_no_more_and_leave_nothing_behind() {
    let _turn = turn();
    let dir = tempdir();
    let Some(ds) = measured(dir.path(), 20_000) else {
        return;
    };
    let Some((same, amplification)) = streamed_directly(&ds, Shuffle::Full { seed: 3 }) else {
        skip_cold("no io_uring here (may be turned off by the kernel)");
        return;
    };
    assert!(same, "direct reads changed the batches");
    // Rows of 3,072 bytes read in 512-byte sectors (7 of them) or whole pages: the
    // issue's bound is 1.5; through the page cache this was 2.2.
    assert!(amplification <= 1.5, "read {amplification:.2}x the rows");
    // Nothing of x.npy stays in the page cache; the labels were read through it.
    resident_at_most(ds.files()[0], 0.01);
}

#[test]
fn a_file_truncated_under_direct_reads_is_an_error_naming_it() {
    // Rows read by the workers (full shuffle), and windows read by the planner (block).
    for shuffle in [Shuffle::Full { seed: 1 }, Shuffle::block(2)] {
        let _turn = turn();
        let dir = tempdir();
        let ds = dataset(dir.path(), 3000);
        let mut loader = Loader::builder_shared(Arc::clone(&ds))
            .batch_size(64)
            .workers(2)
            .shuffle(shuffle)
            .page_cache_budget(0)
            .build()
            .unwrap();
        // Another job rewrites the file in place: first it truncates it.
        let x = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("x.npy"))
            .unwrap();
        x.set_len(3000 * 3072 / 2).unwrap();
        let err = loader.epoch(0).unwrap().find_map(|b| b.err()).unwrap();
        let msg = err.to_string();
        assert!(msg.contains("x.npy: changed while it was mapped"), "{msg}");
    }
}

#[test]
fn a_streamed_block_shuffle_drops_the_pages_between_its_rows() {
    // Rank 0 of 2 takes every other row of each window: a block shuffle reads the
    // window's blocks whole, the other rank's rows with them, and must drop those too.
    let _turn = turn();
    let dir = tempdir();
    let Some(ds) = evictable(dir.path(), 40_000) else {
        return;
    };
    let mut loader = Loader::builder_shared(Arc::clone(&ds))
        .batch_size(64)
        .workers(2)
        .shuffle(Shuffle::block(5))
        .shard(stokehold::Shard::new(0, 2).unwrap())
        .page_cache_budget(0)
        .build()
        .unwrap();
    // What stays is the last planned window (64 batches) with its blocks: a fraction of
    // the 123 MB set, not the half the other rank's rows make up.
    assert!(streamed_then_resident(&mut loader, 20_000, ds.files()[0]) < 0.3);
}

#[test]
fn a_streamed_block_shuffle_reads_its_windows_once_and_leaves_nothing_behind() {
    let _turn = turn();
    let dir = tempdir();
    let Some(ds) = measured(dir.path(), 20_000) else {
        return;
    };
    if stokehold::testing::direct_align(ds.files()[0].path()).is_none() {
        skip_cold("no O_DIRECT on this file system");
        return;
    }
    let (same, amplification) = streamed_directly(&ds, Shuffle::block(9)).unwrap();
    assert!(same, "window reads changed the batches");
    // Each window's blocks read once, in extents of whole pages (the bound is
    // 1.2); read piecemeal as batches asked, or twice, this would be far above.
    assert!(amplification <= 1.2, "read {amplification:.2}x the rows");
    // Read into the loader's own buffers: nothing of either file is left in the page
    // cache (through it, the last planned windows stayed).
    for f in ds.files() {
        resident_at_most(f, 0.01);
    }
}

#[test]
fn window_reads_leave_what_was_cached_to_the_page_cache() {
    // Half of x.npy resident as the epoch starts (a set just written, larger than the
    // budget): its rows are copied from there, and only the other half is read.
    let _turn = turn();
    let dir = tempdir();
    let Some(ds) = measured(dir.path(), 20_000) else {
        return;
    };
    let want = epoch_bytes(&mut loader(&ds, Shuffle::block(4), false), 0, false);
    pagecache::evict(ds.as_ref()).unwrap();
    let x = ds.files()[0];
    let half = x.bytes().len() / 2;
    let mut head = vec![0u8; half];
    std::io::Read::read_exact(&mut std::fs::File::open(x.path()).unwrap(), &mut head).unwrap();
    // With the kernel's read-ahead, somewhat more than half, once its reads are in.
    let mut uncached = 1.0 - pagecache::file_residency(x).unwrap().fraction();
    for _ in 0..100 {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let now = 1.0 - pagecache::file_residency(x).unwrap().fraction();
        if now == uncached {
            break;
        }
        uncached = now;
    }
    let mut windowed = loader(&ds, Shuffle::block(4), true);
    let mut it = windowed.epoch(0).unwrap();
    let got: Vec<Vec<u8>> = it.by_ref().map(|b| bytes(&b.unwrap())).collect();
    assert!(got == want, "the batches changed");
    let read = read(&it.stats()) / x.bytes().len() as f64;
    assert!(
        (read - uncached).abs() < 0.1,
        "read {read:.2}x of x.npy, {uncached:.2} of it not cached"
    );
}

#[test]
fn window_reads_resume_and_shard_as_the_mapped_path_does() {
    // A resumed epoch starts its plan mid-epoch; a shard reads its windows' blocks with
    // the other rank's rows in them. Either way the batches are the mapping's.
    let _turn = turn();
    let dir = tempdir();
    let ds = dataset(dir.path(), 6000);
    for (rank, start) in [(0, 0), (1, 0), (0, 37), (1, 20)] {
        let build = |plan: bool| {
            Loader::builder_shared(Arc::clone(&ds))
                .batch_size(32)
                .workers(2)
                .shuffle(Shuffle::block(rank))
                .shard(stokehold::Shard::new(rank, 2).unwrap())
                .plan_reads(plan)
                .page_cache_budget(0)
                .resume(stokehold::LoaderState::new(1, start))
                .build()
                .unwrap()
        };
        let want = epoch_bytes(&mut build(false), 1, false);
        let got = epoch_bytes(&mut build(true), 1, true);
        assert_eq!(want.len(), 3000 / 32 + 1 - start as usize);
        assert!(got == want, "rank {rank} from batch {start}");
    }
}

#[test]
fn random_token_windows_in_file_order_are_read_row_by_row() {
    // Random windows are scattered whatever the shuffle: streamed in file order, each
    // is read in its own sectors (about 1.25x its 2,050 bytes), not as the pages around
    // it (4 to 8 KiB each, 2 to 4x).
    let _turn = turn();
    let dir = tempdir();
    let path = gen::token_stream(dir.path().join("t.bin"), 64 << 20, 50_257, 1).unwrap();
    let windows = stokehold::Windows::Random { seed: 3 };
    let tokens = TokenDataset::open_bin(&path, DType::U16, 1024, windows).unwrap();
    let ds: Arc<dyn Dataset> = Arc::new(tokens);
    if !measurable(ds.as_ref()) {
        return;
    }
    // In 4 KiB sectors a window costs one or two of them whichever way it is read.
    if stokehold::testing::direct_align(&path).is_none_or(|a| a > 512) {
        skip_cold("direct reads here are not in 512-byte sectors");
        return;
    }
    let build = |plan: bool| {
        Loader::builder_shared(Arc::clone(&ds))
            .batch_size(32)
            .workers(2)
            .shuffle(Shuffle::None)
            .plan_reads(plan)
            .page_cache_budget(0)
            .build()
            .unwrap()
    };
    let mut planned = build(true);
    if !planned.direct_reads() {
        skip_cold("no io_uring here (may be turned off by the kernel)");
        return;
    }
    let want: Vec<Vec<u8>> = build(false)
        .epoch(1)
        .unwrap()
        .map(|b| b.unwrap().bytes(0).to_vec())
        .collect();
    pagecache::evict(ds.as_ref()).unwrap();
    let mut it = planned.epoch(1).unwrap();
    let got: Vec<Vec<u8>> = it.by_ref().map(|b| b.unwrap().bytes(0).to_vec()).collect();
    assert!(got == want, "the batches changed");
    let rows = ds.len() as f64 * 2050.0;
    let amplification = read(&it.stats()) / rows;
    assert!(amplification <= 1.5, "read {amplification:.2}x the windows");
}

/// A dataset with a bug of its own: its `locate` panics, or its `gather` of any batch
/// past its first 100 rows; the rest is the inner dataset's.
/// The third field counts the calls of `locate`.
struct Broken(Arc<dyn Dataset>, Bug, std::sync::atomic::AtomicUsize);

impl Broken {
    fn new(ds: Arc<dyn Dataset>, bug: Bug) -> Broken {
        Broken(ds, bug, Default::default())
    }
}

#[derive(PartialEq)]
enum Bug {
    Locate,
    Gather,
    /// `locate` also names a file past those `files` lists (as `Concat` may).
    Unlisted,
}

impl Dataset for Broken {
    fn len(&self) -> u64 {
        self.0.len()
    }
    fn columns(&self) -> &[stokehold::Column] {
        self.0.columns()
    }
    fn gather(&self, epoch: u64, indices: &[u64], out: &mut [&mut [u8]]) -> stokehold::Result<()> {
        let broken = self.1 == Bug::Gather && indices.iter().any(|&i| i >= 100);
        assert!(!broken, "gather is broken");
        self.0.gather(epoch, indices, out)
    }
    fn files(&self) -> Vec<stokehold::MappedFile<'_>> {
        self.0.files()
    }
    fn locate(&self, epoch: u64, index: u64, at: &mut dyn FnMut(usize, usize, usize)) {
        self.2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(self.1 != Bug::Locate, "locate({index}) is broken");
        if self.1 == Bug::Unlisted {
            at(self.0.files().len(), 0, 8);
        }
        self.0.locate(epoch, index, at)
    }
}

#[test]
fn a_dataset_whose_locate_panics_is_read_from_its_mapping() {
    let _turn = turn();
    let dir = tempdir();
    let Some(ds) = evictable(dir.path(), 3000) else {
        return;
    };
    let broken = Arc::new(Broken::new(Arc::clone(&ds), Bug::Locate));
    let calls = Arc::clone(&broken);
    let broken: Arc<dyn Dataset> = broken;
    // Resumed mid-epoch, streamed (budget 0) in file order: the plan asks `locate`
    // where the rows are on the thread starting the epoch.
    let build = |ds: &Arc<dyn Dataset>, resume| {
        Loader::builder_shared(Arc::clone(ds))
            .batch_size(64)
            .workers(2)
            .shuffle(Shuffle::None)
            .page_cache_budget(0)
            .resume(resume)
            .build()
            .unwrap()
    };
    let state = stokehold::LoaderState::new(1, 5);
    let mut want = build(&ds, state);
    let want = epoch_bytes(&mut want, 1, false);
    let mut loader = build(&broken, state);
    pagecache::evict(broken.as_ref()).unwrap();
    let got: Vec<Vec<u8>> = loader
        .epoch(1)
        .unwrap()
        .map(|b| bytes(&b.unwrap()))
        .collect();
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the batches differ");
    assert_eq!(loader.state().epoch, 2);
    // The plan did ask (and met the panic), so the fallback is what read the batches.
    assert!(
        calls.2.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "locate never called"
    );
}

#[test]
fn a_roofline_over_a_panicking_dataset_fails_its_pass_and_does_not_hang() {
    use stokehold::bench::{self, BenchConfig, Roofline};
    let digits = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(digits).unwrap());
    let broken: Arc<dyn Dataset> = Arc::new(Broken::new(ds, Bug::Gather));
    let layout = Loader::builder_shared(Arc::clone(&broken))
        .batch_size(64)
        .build()
        .unwrap()
        .layout()
        .clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let roofline = Roofline::new(broken, &layout, 2).unwrap();
        let indices: Arc<[u64]> = (0..1797).collect();
        // Twice: a thread whose gather panicked still takes passes.
        let passes: Vec<_> = (0..2)
            .map(|_| roofline.pass(0, Arc::clone(&indices)))
            .collect();
        let _ = tx.send(passes);
    });
    let passes = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the roofline's pass hangs");
    for p in passes {
        let err = p.unwrap_err().to_string();
        assert!(err.contains("panicked: gather is broken"), "{err}");
    }
    // No timed pass: refused, not a panic on an empty list of figures.
    let ds: Arc<dyn Dataset> = Arc::new(NpyDataset::open(digits).unwrap());
    let cfg = BenchConfig {
        reps: 0,
        ..BenchConfig::default()
    };
    let err = bench::run(ds, &cfg).unwrap_err().to_string();
    assert!(err.contains("at least one timed pass"), "{err}");
}

/// The `VmFlags` of this process's mapping that holds `addr` (`/proc/self/smaps`).
fn vm_flags(addr: usize) -> String {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = (a..b).contains(&addr);
                continue;
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.to_string();
            }
        }
    }
    panic!("no mapping holds {addr:#x}");
}

#[test]
fn a_planned_epoch_gives_the_mappings_their_read_around_back() {
    // The planner turns read-around off (`MADV_RANDOM`: `rr` in VmFlags) while it plans
    // every read; a later epoch with no plan must not fault one page at a time.
    let _turn = turn();
    let dir = tempdir();
    let Some(ds) = evictable(dir.path(), 3000) else {
        return;
    };
    let x = ds.files()[0].bytes().as_ptr() as usize;
    assert!(!vm_flags(x).contains(" rr"), "{}", vm_flags(x));
    let mut loader = loader(&ds, Shuffle::block(4), false);
    pagecache::evict(ds.as_ref()).unwrap();
    let mut it = loader.epoch(0).unwrap();
    it.next().unwrap().unwrap();
    // Mid-epoch, the plan holds.
    let during = vm_flags(x);
    it.by_ref().for_each(|b| drop(b.unwrap()));
    assert_eq!(it.stats().storage, Storage::Streaming);
    drop(it);
    // The planner leaves within a millisecond of the epoch's end.
    let start = std::time::Instant::now();
    while vm_flags(x).contains(" rr") && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(during.contains(" rr"), "not planned: {during}");
    assert!(!vm_flags(x).contains(" rr"), "{}", vm_flags(x));
}

#[test]
fn every_shard_of_a_streamed_set_is_read_directly() {
    // Two shards, each with its images and labels: the rows of the second shard's
    // images are as long as the first's, so both are read with O_DIRECT under a full
    // shuffle, and neither fills the page cache.
    let _turn = turn();
    let (a, b) = (tempdir(), tempdir());
    let parts = vec![dataset(a.path(), 2000), dataset(b.path(), 2000)];
    if !parts.iter().all(|p| evicts(p.as_ref())) {
        skip_cold("the page cache cannot be evicted on this file system");
        return;
    }
    let ds: Arc<dyn Dataset> = Arc::new(stokehold::Concat::new(parts).unwrap());
    let mut direct = loader(&ds, Shuffle::Full { seed: 1 }, true);
    if !direct.direct_reads() {
        skip_cold("no io_uring here");
        return;
    }
    pagecache::evict(ds.as_ref()).unwrap();
    let mut it = direct.epoch(0).unwrap();
    let n: usize = it.by_ref().map(|b| b.unwrap().len()).sum();
    assert_eq!(n, 4000);
    assert_eq!(it.stats().storage, Storage::Streaming);
    drop(it);
    let files = ds.files();
    assert_eq!(files.len(), 4);
    for k in [0, 2] {
        let r = pagecache::file_residency(files[k]).unwrap();
        assert_eq!(r.resident, 0, "{}: {r}", files[k].path().display());
    }
}

#[test]
fn a_row_in_a_file_not_listed_is_left_out_of_the_plan() {
    // The plan still streams the listed files (their pages dropped behind), where a
    // panic on the unlisted index used to leave the whole epoch unplanned.
    let _turn = turn();
    let dir = tempdir();
    let Some(ds) = evictable(dir.path(), 20_000) else {
        return;
    };
    let odd: Arc<dyn Dataset> = Arc::new(Broken::new(Arc::clone(&ds), Bug::Unlisted));
    let mut loader = Loader::builder_shared(odd)
        .batch_size(16)
        .workers(2)
        .page_cache_budget(0)
        .direct_reads(false)
        .build()
        .unwrap();
    pagecache::evict(ds.as_ref()).unwrap();
    assert!(streamed_then_resident(&mut loader, 20_000, ds.files()[0]) < 0.25);
}
