//! Temporary files beside their destination, for writes that land whole or not at all.
//!
//! A writer fills `.NAME.HOST.PID.N.partial` beside `NAME` and renames it into place, or
//! removes it on an error (`util::write_whole`, the trace's writer, the generator's
//! `Partial` when dropped). A process killed meanwhile (Ctrl-C while `stokehold
//! train` makes its default set, the OOM killer) removes nothing, and a name with its
//! process id would never be reused: each such file (the default set's is 600 MB) would
//! stay, hidden. So each writer holds an exclusive `flock` on its file while it lives,
//! and a new writer to the same destination first removes the siblings of its own host
//! whose lock it can take: their writers are gone (the kernel drops a lock with its
//! process). A lock is what marks a live writer, not a process id, which another
//! process may have taken since.
//!
//! Only this host's files are swept: a network file system may grant `flock` locally
//! (NFS mounted `nolock` or `local_lock=flock`, Lustre's `localflock`), so another
//! machine's live writer could look gone. Where the file system has no `flock` at all
//! (some FUSE mounts), the writer goes on without one and nothing there is swept.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A temporary file beside a destination, open for reading and writing, and locked
/// for as long as `file` (or a clone of it) stays open.
pub(crate) struct Claimed {
    /// The temporary file's path.
    pub(crate) path: PathBuf,
    /// The open file; its lock goes with its last clone.
    pub(crate) file: File,
}

/// Creates a temporary file for `dest`, `.NAME.HOST.PID.N.partial` in its directory,
/// after removing this host's there that no live writer holds.
///
/// # Errors
/// The error of creating the file.
pub(crate) fn claim(dest: &Path) -> std::io::Result<Claimed> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let host = host();
    sweep(dest, &name, &host);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let path = dest.with_file_name(format!(".{name}.{host}.{pid}.{n}.partial"));
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
        {
            // A name a gone process of the same id left where the sweep could not
            // tell (no locks here, a container restarted with its pid): the next one.
            Err(e) if e.kind() == ErrorKind::AlreadyExists && n < u64::MAX => continue,
            opened => opened?,
        };
        match lock(&file) {
            // Another writer's sweep took it between the create and the lock, and will
            // remove it: take another name.
            Err(e) if e.kind() == ErrorKind::WouldBlock => continue,
            // Swept before the lock: the name is no longer this file.
            Ok(true) if !same_file(&path, &file) => continue,
            _ => return Ok(Claimed { path, file }),
        }
    }
}

/// This machine's name, as a file name's part (`unknown` where it cannot be read).
fn host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its length; gethostname writes at most that much.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match (rc, end) {
        (0, 1..) => String::from_utf8_lossy(&buf[..end]).replace(['/', '\0'], "_"),
        _ => "unknown".into(),
    }
}

/// Takes `file`'s exclusive lock without waiting: `Ok(true)` if taken, `Ok(false)` where
/// the file system has no locks, `WouldBlock` if another open file holds it.
fn lock(file: &File) -> std::io::Result<bool> {
    // SAFETY: a valid open descriptor; flock reads and writes no memory of ours.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.kind() {
        ErrorKind::WouldBlock => Err(e),
        _ => Ok(false),
    }
}

/// Whether `path` still names the open `file`.
fn same_file(path: &Path, file: &File) -> bool {
    match (std::fs::symlink_metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Whether `file_name` is a temporary file of destination `name` on `host`:
/// `.NAME.HOST.PID.N.partial`, the host matched whole (host names may hold dots).
fn left_by(file_name: &str, name: &str, host: &str) -> bool {
    let Some(mid) = file_name
        .strip_prefix('.')
        .and_then(|f| f.strip_prefix(name))
        .and_then(|f| f.strip_prefix('.'))
        .and_then(|f| f.strip_suffix(".partial"))
    else {
        return false;
    };
    let mut parts = mid.rsplitn(3, '.');
    let numbers = parts
        .by_ref()
        .take(2)
        .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    numbers && parts.next() == Some(host)
}

/// The directory `dest` is in: its parent, or `.` for a bare file name.
pub(crate) fn directory(dest: &Path) -> &Path {
    match dest.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Removes the temporary files of `dest` (named `name`) that `host` (this machine) left
/// and whose writer is gone: those whose lock can be taken. Errors leave a file where
/// it is.
fn sweep(dest: &Path, name: &str, host: &str) {
    let Ok(entries) = std::fs::read_dir(directory(dest)) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(n) = file_name.to_str() else {
            continue;
        };
        if !left_by(n, name, host) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = File::open(&path) else {
            continue;
        };
        // Only a lock taken proves the writer gone; a file system without locks proves
        // nothing. The name must still be the file locked (not renamed into place and
        // replaced meanwhile).
        if matches!(lock(&file), Ok(true)) && same_file(&path, &file) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partials(dir: &Path) -> Vec<String> {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".partial"))
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_left_file_is_swept_and_a_live_one_kept() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("x.npy");
        let host = host();
        // Left by a writer of this host that was killed: nobody holds its lock.
        let left = format!(".x.npy.{host}.4000000.0.partial");
        std::fs::write(dir.path().join(&left), b"old").unwrap();
        // Another host's (its lock may not show here), another destination's, and a
        // name that is not a temporary file: kept.
        let elsewhere = format!(".x.npy.{host}.cluster.4000000.0.partial");
        std::fs::write(dir.path().join(&elsewhere), b"x").unwrap();
        let other = format!(".y.npy.{host}.4000000.0.partial");
        std::fs::write(dir.path().join(&other), b"y").unwrap();
        std::fs::write(dir.path().join(".x.npy.notes"), b"n").unwrap();
        let live = claim(&dest).unwrap();
        let names = partials(dir.path());
        assert_eq!(names.len(), 3, "{names:?}");
        assert!(names.contains(&other) && names.contains(&elsewhere) && !names.contains(&left));
        assert!(dir.path().join(".x.npy.notes").exists());
        // A second writer to the same destination leaves the first one's file alone.
        let second = claim(&dest).unwrap();
        assert!(live.path.exists());
        assert_ne!(second.path, live.path);
        drop(live);
        // Its writer gone (the lock with it), the next writer sweeps it.
        let third = claim(&dest).unwrap();
        let names = partials(dir.path());
        assert_eq!(names.len(), 4, "{names:?}");
        assert!(second.path.exists() && third.path.exists());
    }
}
