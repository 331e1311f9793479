//! Small helpers every layer may use: a hash finaliser, byte counts as text,
//! whole-file writes.

use std::path::Path;

use crate::error::{Error, Result};

/// The splitmix64 finaliser: a fast, well-mixing bijection of `u64`.
#[inline]
pub(crate) const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Asks the CPU to start loading `bytes` (a row a gather copies next) into its caches:
/// the first line of each page it spans, whose page walk and memory access the
/// hardware's own prefetcher would not start (it does not cross pages). A hint only: it
/// reads nothing architecturally and cannot fault; nothing off x86-64.
#[inline(always)]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let start = bytes.as_ptr() as usize;
        let mut line = start;
        let end = start + bytes.len();
        while line < end {
            // SAFETY: a prefetch is a hint: it has no architectural effect and does not
            // fault, whatever the address; this one is inside `bytes`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
            // The next page's first byte.
            line = (line | 4095) + 1;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// A panic's message, where its payload is a string.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}

/// A non-zero hash of `parts`, for fingerprints of orders and datasets.
pub(crate) fn fold(parts: impl IntoIterator<Item = u64>) -> u64 {
    parts.into_iter().fold(0x006f_7264_6572u64, |h, v| {
        mix(h ^ mix(v.wrapping_add(0x9e37_79b9_7f4a_7c15)))
    }) | 1
}

/// Bytes as megabytes, with a decimal where the figure is small (`0.13 MB`, `616 MB`).
pub fn megabytes(bytes: u64) -> String {
    let mb = bytes as f64 / 1e6;
    if mb < 10.0 {
        format!("{mb:.2} MB")
    } else {
        format!("{mb:.0} MB")
    }
}

/// Writes `bytes` to `path` whole or not at all: into a temporary file beside it, synced,
/// then renamed over it. A crash or a full disk leaves the old file (or none), never a
/// truncated one; a temporary file that a killed process left is removed by the next
/// write to `path` (see `partial`).
///
/// # Errors
/// [`Error::Io`] naming `path`; the temporary file is removed.
pub fn write_whole(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let dest = destination(path);
    if let Some(fd) = descriptor(&dest) {
        // An inherited descriptor (`/dev/stdout`, `/dev/fd/3`): written through it, at its
        // offset and with its flags (a `>> log` appends), as the shell's redirection
        // would; opened again by name, a file would be written from its start.
        return inherited(fd)
            .and_then(|mut f| f.write_all(bytes))
            .map_err(|e| Error::io(path, e));
    }
    if std::fs::metadata(&dest).is_ok_and(|m| !m.is_file() && !m.is_dir()) {
        // A stream (`/dev/stdout`, a FIFO, `/dev/null`): written in place, as a shell
        // redirection would; renamed over, it would be replaced by a regular file.
        let written = std::fs::OpenOptions::new()
            .write(true)
            .open(&dest)
            .and_then(|mut f| f.write_all(bytes));
        return written.map_err(|e| Error::io(path, e));
    }
    // A symbolic link is written through: its target is replaced, not the link.
    let path = dest.as_path();
    let crate::partial::Claimed {
        path: tmp,
        mut file,
    } = crate::partial::claim(path).map_err(|e| Error::io(path, e))?;
    // The file it replaces keeps its mode and owner (a report kept private stays so).
    if let Ok(old) = std::fs::metadata(path) {
        use std::os::unix::fs::MetadataExt;
        let _ = file.set_permissions(old.permissions());
        let _ = std::os::unix::fs::fchown(&file, Some(old.uid()), Some(old.gid()));
    }
    let written = (|| {
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })?;
    // The rename itself made durable: a crash now cannot bring the old file back.
    let dir = crate::partial::directory(path);
    let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
    Ok(())
}

/// Where a write to `path` lands: `path`, or the file its symbolic links lead to (at
/// most 40 of them, as the kernel follows; a dangling link leads to the file it names).
/// A link to an open descriptor (`/dev/stdout`, `/proc/self/fd/1`) is not followed:
/// the descriptor is where the write goes ([`descriptor`]).
pub fn destination(path: &Path) -> std::path::PathBuf {
    let mut at = path.to_path_buf();
    for _ in 0..40 {
        if descriptor(&at).is_some() {
            break;
        }
        let is_link = std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink());
        let Some(target) = is_link.then(|| std::fs::read_link(&at).ok()).flatten() else {
            break;
        };
        at = match at.parent() {
            Some(dir) if target.is_relative() => dir.join(target),
            _ => target,
        };
    }
    at
}

/// The descriptor a path names, where it names one of this process's: `/dev/stdout`,
/// `/dev/stderr`, `/dev/fd/N`, `/proc/self/fd/N`, `/proc/thread-self/fd/N` and
/// `/proc/PID/fd/N` of this process's PID. The kernel's links there lead to what the
/// descriptor has open, which its link text does not always name (`pipe:[N]`, a file
/// since renamed or deleted), and opening it again starts a file at its beginning.
pub fn descriptor(path: &Path) -> Option<std::os::fd::RawFd> {
    let s = path.to_str()?;
    match s {
        "/dev/stdout" => return Some(1),
        "/dev/stderr" => return Some(2),
        _ => {}
    }
    let pid = format!("/proc/{}/fd/", std::process::id());
    let n = [
        "/dev/fd/",
        "/proc/self/fd/",
        "/proc/thread-self/fd/",
        pid.as_str(),
    ]
    .iter()
    .find_map(|dir| s.strip_prefix(dir))?;
    n.parse().ok()
}

/// A write handle on the inherited descriptor `fd` (a duplicate of it, sharing its
/// offset and flags), or why there is none: not open, or not open for writing.
fn inherited(fd: std::os::fd::RawFd) -> std::io::Result<std::fs::File> {
    // SAFETY: fcntl reads the descriptor table only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if flags & libc::O_ACCMODE == libc::O_RDONLY {
        return Err(std::io::Error::other("is open for reading only"));
    }
    // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor, owned by the file returned.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `dup` is a fresh descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(dup) })
}

/// Checks, before a long run, that a file can be written at `path` later: it names a
/// file (not a directory, nor a path ending in `/`), and its directory exists and takes
/// a new file; or, where `streams`, it is an existing stream, or an open descriptor of
/// this process ([`write_whole`] writes `/dev/stdout`, a FIFO in place).
///
/// # Errors
/// [`Error::Io`] naming `path` with the reason.
pub fn check_writable(path: &Path, streams: bool) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let dest = destination(path);
    if let Some(fd) = descriptor(&dest) {
        return match streams {
            true => inherited(fd).map(drop).map_err(|e| Error::io(path, e)),
            false => Err(Error::io(
                path,
                std::io::Error::other("is a descriptor, not a regular file"),
            )),
        };
    }
    let ends_in_slash = path.as_os_str().as_bytes().last() == Some(&b'/');
    if dest.is_dir() || ends_in_slash || dest.file_name().is_none() {
        let e = std::io::Error::other("is a directory, not a file");
        return Err(Error::io(path, e));
    }
    if std::fs::metadata(&dest).is_ok_and(|m| !m.is_file()) {
        // A stream: opening it now could block (a FIFO waits for its reader).
        return match streams {
            true => Ok(()),
            false => Err(Error::io(
                path,
                std::io::Error::other("is not a regular file"),
            )),
        };
    }
    // The directory takes a new file: the temporary file a write will make there, made
    // and removed now (a probe a killed process left is swept, not in the way).
    let probe = crate::partial::claim(&dest).map_err(|e| Error::io(path, e))?;
    let _ = std::fs::remove_file(&probe.path);
    Ok(())
}

/// A vector of `n` default values, or an error saying what `what` would have needed,
/// instead of the abort an ordinary allocation makes when memory runs out.
///
/// # Errors
/// [`Error::Alloc`] when the allocation fails or its byte size overflows.
pub fn zeroed<T: Clone + Default>(n: usize, what: &'static str) -> Result<Vec<T>> {
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| Error::Alloc {
        bytes,
        allocator: what,
        message: e.to_string(),
    })?;
    v.resize(n, T::default());
    Ok(v)
}

/// The system's page size (4096 where it cannot be read).
pub fn page_size() -> usize {
    // SAFETY: sysconf only reads system configuration.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// Runs `open` (an `open` or `dup` of a file); where it fails for want of file
/// descriptors (`EMFILE`), raises this process's soft limit on open files to its hard
/// limit (another thread may have done so meanwhile) and runs it again, once. A set of thousands of shards keeps a descriptor a file,
/// and many systems start processes at a soft limit of 1,024 under a hard one of
/// 524,288 or more; the Go runtime and the JVM raise it at start-up for the same reason.
/// Nothing is raised for a process that never reaches its limit.
///
/// # Errors
/// The error of `open`, the second one where the limit was raised.
pub(crate) fn with_room<T>(open: impl Fn() -> std::io::Result<T>) -> std::io::Result<T> {
    match open() {
        Err(e) if e.raw_os_error() == Some(libc::EMFILE) => {
            raise_open_files();
            open()
        }
        other => other,
    }
}

/// This process's soft and hard limits on open files (`RLIMIT_NOFILE`).
pub(crate) fn open_files_limit() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes the limits into `lim`, a valid `rlimit`.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0;
    ok.then_some((lim.rlim_cur, lim.rlim_max))
}

/// Raises the soft limit on open files to the hard one; whether it rose.
fn raise_open_files() -> bool {
    let Some((soft, hard)) = open_files_limit() else {
        return false;
    };
    if soft >= hard {
        return false;
    }
    let raised = libc::rlimit {
        rlim_cur: hard,
        rlim_max: hard,
    };
    // SAFETY: `setrlimit` reads `raised`, a valid `rlimit`; raising the soft limit up to
    // the hard one needs no privilege.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 }
}

#[cfg(test)]
mod tests {
    use super::{megabytes, mix, write_whole};

    #[test]
    fn megabytes_keep_two_decimals_below_ten() {
        assert_eq!(megabytes(130_000), "0.13 MB");
        assert_eq!(megabytes(616_000_000), "616 MB");
    }

    #[test]
    fn mix_is_a_bijection_on_a_sample() {
        let mut seen: Vec<u64> = (0..10_000).map(mix).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 10_000);
        assert_ne!(mix(1), 1);
    }

    #[test]
    fn a_whole_write_replaces_the_file_and_a_failed_one_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        std::fs::write(&path, "old").unwrap();
        // Kept private: the file that replaces it is too.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_whole(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary left"
        );
        let missing = dir.path().join("no/such/dir/out.json");
        let err = write_whole(&missing, b"x").unwrap_err().to_string();
        assert!(err.contains("no/such/dir/out.json"), "{err}");
    }
}
