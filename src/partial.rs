//! Temporary files beside their destination, for writes that land whole or not at all.
//!
//! A writer fills `.NAME.PID.N.partial` beside `NAME` and renames it into place; an
//! error or a drop removes it. A process killed meanwhile (Ctrl-C while `stokehold
//! train` makes its default set, the OOM killer) removes nothing, and a name with its
//! process id would never be reused: each such file (the default set's is 600 MB) would
//! stay, hidden. So each writer holds an exclusive `flock` on its file while it lives,
//! and a new writer to the same destination first removes the siblings whose lock it can
//! take: their writers are gone (the kernel drops a lock with its process). A lock is
//! what marks a live writer, not a process id, which another process, or the same
//! number on another machine sharing the directory, may hold.
//!
//! Where the file system has no `flock` (some FUSE mounts), the writer goes on without
//! one and nothing there is swept.

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

/// Creates a temporary file for `dest`, `.NAME.PID.N.partial` in its directory, after
/// removing the ones there that no live writer holds.
///
/// # Errors
/// The error of creating the file.
pub(crate) fn claim(dest: &Path) -> std::io::Result<Claimed> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    sweep(dest, &name);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dest.with_file_name(format!(".{name}.{}.{n}.partial", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
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

/// Removes the temporary files of `dest` (named `name`) whose writer is gone: those
/// whose lock can be taken. Errors leave a file where it is.
fn sweep(dest: &Path, name: &str) {
    let dir = match dest.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!(".{name}.");
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(n) = file_name.to_str() else {
            continue;
        };
        if !(n.starts_with(&prefix) && n.ends_with(".partial")) {
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
        // Left by a writer that was killed: nobody holds its lock.
        std::fs::write(dir.path().join(".x.npy.4000000.0.partial"), b"old").unwrap();
        // Another destination's, and a name that is not a temporary file: kept.
        std::fs::write(dir.path().join(".y.npy.4000000.0.partial"), b"y").unwrap();
        std::fs::write(dir.path().join(".x.npy.notes"), b"n").unwrap();
        let live = claim(&dest).unwrap();
        let names = partials(dir.path());
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names.contains(&".y.npy.4000000.0.partial".to_string()));
        assert!(dir.path().join(".x.npy.notes").exists());
        // A second writer to the same destination leaves the first one's file alone.
        let second = claim(&dest).unwrap();
        assert!(live.path.exists());
        assert_ne!(second.path, live.path);
        drop(live);
        // Its writer gone (the lock with it), the next writer sweeps it.
        let third = claim(&dest).unwrap();
        let names = partials(dir.path());
        assert_eq!(names.len(), 3, "{names:?}");
        assert!(second.path.exists() && third.path.exists());
    }
}
