//! The page cache: how much of a dataset is resident (`mincore`), evicting it for a cold
//! start on purpose (`posix_fadvise(DONTNEED)`), and reading it ahead.
//!
//! The page cache is the loader's first-level cache: a warm epoch gathers from memory,
//! a cold one from storage. These calls let the crate measure and control which.

use std::fs::File;
use std::os::fd::AsRawFd;

use memmap2::{Advice, UncheckedAdvice};

use crate::dataset::guard::{guarded, VANISHED};
use crate::dataset::{Dataset, MappedFile};
use crate::error::{Error, Result};
use crate::util::page_size;

/// How much of some files is in the page cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Residency {
    /// Pages resident.
    pub resident: u64,
    /// Pages in all.
    pub pages: u64,
    /// Pages whose residency the kernel does not tell this process (counted in `pages`,
    /// not in `resident`): see [`residency_known`].
    pub unknown: u64,
}

impl Residency {
    /// Resident share, 0.0 to 1.0 (1.0 for nothing at all); pages of unknown residency
    /// count as not resident.
    pub fn fraction(&self) -> f64 {
        if self.pages == 0 {
            1.0
        } else {
            self.resident as f64 / self.pages as f64
        }
    }

    /// Adds up two residencies (of other files).
    fn add(self, other: Residency) -> Residency {
        Residency {
            resident: self.resident + other.resident,
            pages: self.pages + other.pages,
            unknown: self.unknown + other.unknown,
        }
    }
}

impl std::fmt::Display for Residency {
    /// The resident share as a whole percentage, rounded down ("100%" only when every
    /// page is); "?" when no page's residency is known, and a "?" after the share when
    /// some pages' is not.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = match self.unknown {
            0 => format!("{:.0}%", (100.0 * self.fraction()).floor()),
            u if u == self.pages => "?".to_string(),
            _ => format!("{:.0}%?", (100.0 * self.fraction()).floor()),
        };
        f.pad(&shown)
    }
}

/// Page-cache residency of one mapped file (all of it unknown where the kernel does
/// not tell, [`residency_known`]).
///
/// # Errors
/// [`Error::Io`] naming the file if `mincore` fails.
pub fn file_residency(file: MappedFile<'_>) -> Result<Residency> {
    if !residency_known(file) {
        let pages = file.bytes().len().div_ceil(page_size()) as u64;
        return Ok(Residency {
            resident: 0,
            pages,
            unknown: pages,
        });
    }
    // A GiB at a time: a byte a page of a terabyte file would be 256 MiB.
    const PIECE: usize = 1 << 30;
    let mut r = Residency::default();
    for at in (0..file.bytes().len()).step_by(PIECE) {
        let vec = resident_range(file, at, PIECE)?;
        r.resident += vec.iter().filter(|&&b| b & 1 != 0).count() as u64;
        r.pages += vec.len() as u64;
    }
    Ok(r)
}

/// Whether `mincore` tells this process which pages of `file` are cached. Since Linux
/// 5.0 it does only for a file the process owns or may write to (or with
/// `CAP_FOWNER`); for any other file it reports every page resident, to close a
/// page-cache side channel. A shared, read-only dataset of another user is such a file:
/// its residency is unknown, and the loader plans its reads as for cold data.
pub fn residency_known(file: MappedFile<'_>) -> bool {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if std::fs::metadata(file.path()).is_ok_and(|m| m.uid() == euid) {
        return true;
    }
    let Ok(path) = std::ffi::CString::new(file.path().as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: a NUL-terminated path, read only; faccessat writes nothing.
    let rc =
        unsafe { libc::faccessat(libc::AT_FDCWD, path.as_ptr(), libc::W_OK, libc::AT_EACCESS) };
    // Root may not write on a read-only mount, but its CAP_FOWNER still has the truth.
    rc == 0 || (euid == 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EROFS))
}

/// One byte per page of `file`'s mapping, bit 0 set where the page is resident: the
/// truth only where [`residency_known`] says so, which the caller asks first.
///
/// # Errors
/// [`Error::Io`] naming the file if `mincore` fails.
pub(crate) fn resident_pages(file: MappedFile<'_>) -> Result<Vec<u8>> {
    resident_range(file, 0, file.bytes().len())
}

/// As [`resident_pages`], for the pages of `len` bytes at `offset` (page-aligned).
///
/// # Errors
/// [`Error::Io`] naming the file if `mincore` fails.
pub(crate) fn resident_range(file: MappedFile<'_>, offset: usize, len: usize) -> Result<Vec<u8>> {
    let len = len.min(file.bytes().len().saturating_sub(offset));
    if len == 0 {
        return Ok(Vec::new());
    }
    let mut vec = vec![0u8; len.div_ceil(page_size())];
    // SAFETY: `offset` is page-aligned and `offset + len` within the live mapping of
    // `file` (page-aligned, as every mmap is), and `vec` has one byte per page of the
    // range, as mincore requires.
    let rc = unsafe {
        libc::mincore(
            file.bytes().as_ptr().add(offset) as *mut libc::c_void,
            len,
            vec.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(Error::io(file.path(), std::io::Error::last_os_error()));
    }
    Ok(vec)
}

/// Whether the page of `fd` at `offset` is in the page cache, asked with a one-byte read
/// that may not wait for storage (`preadv2` with `RWF_NOWAIT`: `EAGAIN` where it is not
/// cached), which the kernel answers whoever owns the file; `None` where it cannot say
/// (a kernel or file system without `RWF_NOWAIT`, a read error).
pub(crate) fn page_cached(fd: &File, offset: u64) -> Option<bool> {
    let mut byte = 0u8;
    let iov = libc::iovec {
        iov_base: (&mut byte as *mut u8).cast(),
        iov_len: 1,
    };
    // SAFETY: one iovec of one writable byte, which lives across the call.
    let n = unsafe {
        libc::preadv2(
            fd.as_raw_fd(),
            &iov,
            1,
            offset as libc::off_t,
            libc::RWF_NOWAIT,
        )
    };
    match n {
        0.. => Some(true),
        _ => match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EAGAIN) => Some(false),
            _ => None,
        },
    }
}

/// Bytes per `MADV_WILLNEED` call where the device does not say: the kernel reads at
/// most `max(read_ahead_kb, max_sectors_kb)` of its device per call and silently drops
/// the rest, and 128 KiB is within both on every machine.
pub(crate) const WILL_NEED_PIECE: usize = 128 << 10;

/// The most one `MADV_WILLNEED` call reads of `file`: the larger of its block device's
/// `read_ahead_kb` and `max_sectors_kb` (`/sys/dev/block/MAJ:MIN`, or the disk of a
/// partition), at least 128 KiB and at most 8 MiB. Larger pieces are fewer requests:
/// on a virtual disk each costs an exit to the hypervisor.
pub(crate) fn will_need_piece(file: &File) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = file.metadata() else {
        return WILL_NEED_PIECE;
    };
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let dir = std::path::PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let read_kb = |name: &str| -> Option<usize> {
        [
            dir.join("queue").join(name),
            dir.join("../queue").join(name),
        ]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse().ok())
    };
    let kb = read_kb("read_ahead_kb")
        .unwrap_or(0)
        .max(read_kb("max_sectors_kb").unwrap_or(0));
    (kb << 10).clamp(WILL_NEED_PIECE, 8 << 20)
}

/// Asks the kernel to read `len` bytes of `file` at `offset` (page-aligned) into the
/// page cache, without waiting (`madvise(MADV_WILLNEED)` on the mapping, in pieces of
/// at most `piece` bytes, [`will_need_piece`], which no read-ahead setting cuts short).
pub(crate) fn will_need(file: MappedFile<'_>, offset: usize, len: usize, piece: usize) {
    let end = (offset + len).min(file.bytes().len());
    let mut at = offset;
    while at < end {
        let n = piece.max(WILL_NEED_PIECE).min(end - at);
        // Advice only: a refusal leaves the read to the page fault.
        let _ = file.mapping().advise_range(Advice::WillNeed, at, n);
        at += n;
    }
}

/// Turns off the kernel's read-around on page faults in `file`'s mapping
/// (`madvise(MADV_RANDOM)`): with every read planned, a fault reads one page, not a
/// window of `read_ahead_kb`.
pub(crate) fn advise_random(file: MappedFile<'_>) {
    let _ = file.mapping().advise(Advice::Random);
}

/// Turns the kernel's read-around on page faults in `file`'s mapping back on
/// (`madvise(MADV_NORMAL)`), after [`advise_random`].
pub(crate) fn advise_normal(file: MappedFile<'_>) {
    let _ = file.mapping().advise(Advice::Normal);
}

/// Drops `len` bytes of `file` at `offset` (page-aligned) from this process's mapping
/// and from the page cache, as [`evict_file`] does for a whole file; `fd` is the file
/// open for reading.
pub(crate) fn drop_range(file: MappedFile<'_>, fd: &File, offset: usize, len: usize) {
    // A range that runs to the end of the file, in whole pages, may pass its end; the
    // mapping refuses advice past its length, and the fadvise below cannot drop pages
    // that are still mapped.
    let len = len.min(file.bytes().len().saturating_sub(offset));
    // SAFETY: as in `evict_file`: a read-only shared file mapping, whose pages fault the
    // same bytes back in on the next read.
    let _ = unsafe {
        file.mapping()
            .unchecked_advise_range(UncheckedAdvice::DontNeed, offset, len)
    };
    // SAFETY: a valid open descriptor; fadvise reads no memory of ours.
    unsafe {
        libc::posix_fadvise(
            fd.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        )
    };
}

/// Bytes this process has caused to be read from storage so far (`read_bytes` of
/// `/proc/self/io`, every thread included); `None` where the kernel does not say.
pub fn storage_read_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The page-cache budget of a loader built without one: half the memory available now
/// ([`available_memory`]), or half the room left in the process's memory cgroup
/// ([`cgroup_room`]) where that is less (a container limited to 32 GB on a 1 TB host);
/// unlimited where neither is known.
pub fn default_budget() -> u64 {
    match (available_memory(), cgroup_room()) {
        (Some(a), Some(c)) => a.min(c) / 2,
        (Some(m), None) | (None, Some(m)) => m / 2,
        (None, None) => u64::MAX,
    }
}

/// Room for the page cache left in this process's memory cgroup: its memory limit
/// (the tightest of its cgroup's and their ancestors') less the anonymous memory
/// charged to it. The page cache a process reads is charged to its cgroup and
/// reclaimed at that limit, however much memory the host has. `None` without a limit.
pub fn cgroup_room() -> Option<u64> {
    let procs = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_room_in(std::path::Path::new("/sys/fs/cgroup"), &procs)
}

/// [`cgroup_room`] with the cgroup file systems mounted at `root`, for the process whose
/// `/proc/PID/cgroup` is `procs`.
fn cgroup_room_in(root: &std::path::Path, procs: &str) -> Option<u64> {
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
    let stat = |text: &str, key: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
    };
    // No limit reads as a number near 2^63 (v1) or "max" (v2).
    let limited = |n: u64| (n < 1 << 60).then_some(n);
    let paths = procs.lines().filter_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        Some((controllers, path.trim_start_matches('/')))
    });
    // Inside a container without its own cgroup namespace, the path names the host's
    // view (`/docker/ID`) while the container's cgroup is mounted at the root itself.
    let own_dir = |base: std::path::PathBuf, path: &str, file: &str| {
        let named = base.join(path);
        match named.join(file).exists() {
            true => named,
            false => base,
        }
    };
    let mut v2 = None;
    for (controllers, path) in paths {
        if controllers.split(',').any(|c| c == "memory") {
            // cgroup v1: the memory controller's own hierarchy, whose statistics give
            // the limit over the ancestors too. Shared memory (`/dev/shm`, which
            // PyTorch's workers fill) is not reclaimed either.
            let dir = own_dir(root.join("memory"), path, "memory.stat");
            let text = read(dir.join("memory.stat"))?;
            let limit = limited(stat(&text, "hierarchical_memory_limit")?)?;
            let anon = stat(&text, "total_rss").or_else(|| stat(&text, "rss"))?;
            let shmem = stat(&text, "total_shmem").or_else(|| stat(&text, "shmem"));
            return Some(limit.saturating_sub(anon + shmem.unwrap_or(0)));
        }
        if controllers.is_empty() {
            v2 = Some(path);
        }
    }
    // cgroup v2: the unified hierarchy; the tightest `memory.max` up to the root.
    let own = own_dir(root.to_path_buf(), v2?, "memory.stat");
    let text = read(own.join("memory.stat"))?;
    let anon = stat(&text, "anon")? + stat(&text, "shmem").unwrap_or(0);
    let limit = own
        .ancestors()
        .take_while(|d| d.starts_with(root))
        .filter_map(|d| read(d.join("memory.max"))?.trim().parse().ok())
        .filter_map(limited)
        .min()?;
    Some(limit.saturating_sub(anon))
}

/// Memory the kernel reports as available for new work (`MemAvailable` of
/// `/proc/meminfo`), in bytes; `None` where it does not say.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Page-cache residency of every file of a dataset, summed.
///
/// # Errors
/// As [`file_residency`].
pub fn residency(dataset: &dyn Dataset) -> Result<Residency> {
    dataset
        .files()
        .into_iter()
        .try_fold(Residency::default(), |acc, f| {
            Ok(acc.add(file_residency(f)?))
        })
}

/// Drops a mapped file from the page cache: unmaps its pages from this process
/// (`madvise(DONTNEED)`, so they are no longer pinned by the mapping), writes back any
/// dirty ones (`fdatasync`), then asks the kernel to discard them
/// (`posix_fadvise(DONTNEED)`). Pages other processes map, or a file on tmpfs, may
/// stay; check with [`file_residency`].
///
/// # Errors
/// [`Error::Io`] naming the file.
pub fn evict_file(file: MappedFile<'_>) -> Result<()> {
    if !file.bytes().is_empty() {
        // SAFETY: the mapping is a read-only, shared file mapping: DONTNEED only drops its
        // page-table entries, and later reads fault the same file bytes back in, so no
        // reference into it sees its contents change.
        unsafe { file.mapping().unchecked_advise(UncheckedAdvice::DontNeed) }
            .map_err(|e| Error::io(file.path(), e))?;
    }
    let f = file.reopen().map_err(|e| Error::io(file.path(), e))?;
    // Dirty pages (a set written moments ago, not yet on disk) are not dropped: written
    // back first. Only advice follows, so a refusal (no fdatasync here) changes nothing.
    let _ = f.sync_data();
    // SAFETY: a valid open descriptor; fadvise reads no memory of ours.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(Error::io(
            file.path(),
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(())
}

/// Evicts every file of a dataset (see [`evict_file`]).
///
/// # Errors
/// As [`evict_file`].
pub fn evict(dataset: &dyn Dataset) -> Result<()> {
    dataset.files().into_iter().try_for_each(evict_file)
}

/// Reads a mapped file into the page cache: `madvise(WILLNEED)`, then one touch per page
/// so it is resident when this returns. Returns the bytes touched.
///
/// # Errors
/// [`Error::Io`] naming the file if the advice is refused; [`Error::Dataset`] naming
/// it if a page could not be read (another process truncated it, or a read error).
pub fn read_ahead_file(file: MappedFile<'_>) -> Result<u64> {
    if file.bytes().is_empty() {
        return Ok(0);
    }
    // Read-around on, whatever a planner set (`MADV_RANDOM` would make every touch
    // below a one-page read), and the file asked for a window ahead of the touches.
    file.mapping()
        .advise(Advice::Sequential)
        .map_err(|e| Error::io(file.path(), e))?;
    let piece = file
        .reopen()
        .map_or(WILL_NEED_PIECE, |f| will_need_piece(&f));
    let page = page_size();
    let bytes = file.bytes();
    // A fault marks the file (when watched) as changed, so that its later reads fail.
    let mark = file.watched().map(|w| w.mark());
    let touched = guarded(bytes, mark, || {
        let mut sum = 0u8;
        let mut asked = 0;
        for i in (0..bytes.len()).step_by(page) {
            if asked < bytes.len() && asked < i + READ_AHEAD {
                let n = READ_AHEAD.min(bytes.len() - asked);
                will_need(file, asked, n, piece);
                asked += n;
            }
            // Volatile so the touch is not optimised away.
            // SAFETY: `i < len`, inside the mapping.
            sum ^= unsafe { std::ptr::read_volatile(bytes.as_ptr().add(i)) };
        }
        std::hint::black_box(sum);
    });
    let _ = file.mapping().advise(Advice::Normal);
    touched.ok_or_else(|| Error::dataset(file.path(), VANISHED))?;
    Ok(bytes.len() as u64)
}

/// How far [`read_ahead_file`] asks for the file ahead of its touches.
const READ_AHEAD: usize = 64 << 20;

/// Reads every file of a dataset into the page cache (see [`read_ahead_file`]).
///
/// # Errors
/// As [`read_ahead_file`].
pub fn read_ahead(dataset: &dyn Dataset) -> Result<u64> {
    dataset
        .files()
        .into_iter()
        .try_fold(0, |acc, f| Ok(acc + read_ahead_file(f)?))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn the_room_in_a_memory_cgroup_is_its_tightest_limit_less_its_anonymous_memory() {
        let root = tempfile::tempdir().unwrap();
        let put = |path: &str, text: &str| {
            let p = root.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        // v2: a pod limited to 32 GB, its container unlimited within it.
        put("kubepods/pod1/memory.max", "34359738368\n");
        put("kubepods/pod1/ctr/memory.max", "max\n");
        put(
            "kubepods/pod1/ctr/memory.stat",
            "anon 4294967296\nfile 123\n",
        );
        let v2 = "0::/kubepods/pod1/ctr\n";
        assert_eq!(cgroup_room_in(root.path(), v2), Some(28 << 30));
        // No limit anywhere: none.
        put("free/memory.max", "max\n");
        put("free/memory.stat", "anon 1\n");
        assert_eq!(cgroup_room_in(root.path(), "0::/free\n"), None);
        // v1: the memory controller's hierarchy, its limit over the ancestors.
        put(
            "memory/job/memory.stat",
            "cache 5\nrss 7\nhierarchical_memory_limit 8589934592\ntotal_rss 1073741824\n",
        );
        let v1 = "4:memory:/job\n1:cpu:/\n0::/\n";
        assert_eq!(cgroup_room_in(root.path(), v1), Some(7 << 30));
        put(
            "memory/open/memory.stat",
            "hierarchical_memory_limit 9223372036854771712\n",
        );
        assert_eq!(cgroup_room_in(root.path(), "4:memory:/open\n"), None);
        // A container without a cgroup namespace: the path is the host's, its own cgroup
        // is at the root.
        let boxed = tempfile::tempdir().unwrap();
        std::fs::write(boxed.path().join("memory.max"), "2147483648\n").unwrap();
        std::fs::write(
            boxed.path().join("memory.stat"),
            "anon 0\nshmem 1073741824\n",
        )
        .unwrap();
        assert_eq!(
            cgroup_room_in(boxed.path(), "0::/docker/abc\n"),
            Some(1 << 30)
        );
        // Nothing to read (cgroups not mounted there): none.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(cgroup_room_in(empty.path(), "0::/elsewhere\n"), None);
    }

    #[test]
    fn a_range_in_whole_pages_past_the_end_of_the_file_is_dropped() {
        let page = page_size();
        // Beside the build (a real file system, where /tmp may be tmpfs).
        let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
        let dir = match target.is_dir() {
            true => target,
            false => std::env::temp_dir(),
        };
        let mut tmp = tempfile::NamedTempFile::new_in(dir).unwrap();
        tmp.write_all(&vec![3u8; 3 * page + 100]).unwrap();
        tmp.as_file().sync_all().unwrap();
        // SAFETY: a read-only mapping of a file this test owns.
        let map = unsafe { memmap2::Mmap::map(tmp.as_file()) }.unwrap();
        let file = MappedFile::new(tmp.path(), &map);
        assert_eq!(
            map.iter().map(|&b| u64::from(b)).sum::<u64>(),
            3 * (3 * page as u64 + 100)
        );
        let resident = |f| resident_range(f, 0, map.len()).unwrap();
        // SAFETY: a zeroed statfs is a valid value for statfs to fill in.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and a statfs to write.
        let rc = unsafe { libc::fstatfs(tmp.as_file().as_raw_fd(), &mut fs) };
        if rc != 0 || fs.f_type == libc::TMPFS_MAGIC || resident(file).iter().all(|&p| p & 1 == 0) {
            crate::testing::skip_cold(
                "the file's pages cannot be dropped from the page cache here",
            );
            return;
        }
        assert_eq!(page_cached(tmp.as_file(), page as u64), Some(true));
        drop_range(file, tmp.as_file(), 0, 4 * page);
        let left = resident(file).iter().filter(|&&p| p & 1 == 1).count();
        assert_eq!(left, 0, "pages still cached after the drop");
        // Asked with a read that may not wait, whoever owns the file: not cached.
        assert_eq!(page_cached(tmp.as_file(), page as u64), Some(false));
    }
}
