//! Reads of memory-mapped files that survive the file changing under them.
//!
//! When another process truncates a mapped file (regenerating it, copying over it), the
//! pages past its new end vanish from every mapping, and touching one raises `SIGBUS`,
//! which kills the process by default; a storage read error on a mapped page does the
//! same. Reads made through [`Watched::read`] instead:
//!
//! - check first that the file still has the length and modification time it had when
//!   it was opened (one `fstat`, at most every [`RECHECK`] per file so that small
//!   batches do not pay it each time), which catches a truncation or a rewrite before
//!   any page is touched;
//! - run with this thread's guard over the mapping: a `SIGBUS` inside it is handled by
//!   mapping a page of zeros over the faulting page, so the read completes, and is then
//!   reported as an error naming the file. The file stays marked as changed.
//! - check again afterwards that no read of the file faulted meanwhile: the page of zeros
//!   replaces the vanished one in the mapping, for every thread, so another thread's
//!   read of that page completes without a fault of its own. The handler marks the file
//!   as changed before it maps the zeros, so that read fails too.
//!
//! A `SIGBUS` anywhere else goes to the handler that was installed before (Rust's own
//! stack-overflow handler, Python's `faulthandler`...) or to the default action, so
//! nothing else changes.

use std::cell::Cell;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use crate::error::{Error, Result};

thread_local! {
    /// The address range this thread's current guarded read may fault in.
    static RANGE: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// Whether a page of that range faulted (an atomic, so that the compiler does not
    /// assume it unchanged across the read; the handler runs on this same thread).
    static FAULTED: AtomicBool = const { AtomicBool::new(false) };
    /// The flag of the file that range maps, which the handler sets (null: none).
    static MARK: Cell<*const AtomicBool> = const { Cell::new(std::ptr::null()) };
}

/// The `SIGBUS` action in place before ours, to pass faults that are not ours on to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
/// The page size, read once before the handler is installed (the handler itself calls
/// nothing but `mmap` and `sigaction`).
static PAGE: AtomicUsize = AtomicUsize::new(4096);
static INSTALL: Once = Once::new();

/// A three-argument (`SA_SIGINFO`) signal handler.
type Action = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);

/// Installs the handler once per process. If it cannot be installed, reads go
/// unguarded, as they would without this module.
fn install() {
    INSTALL.call_once(|| {
        PAGE.store(crate::util::page_size(), Ordering::Relaxed);
        // SAFETY: a zeroed `sigaction` is a valid value to be filled in; `sigaction`
        // writes the current action into `previous` and installs `action`, whose handler
        // has the three-argument signature that `SA_SIGINFO` promises.
        unsafe {
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) != 0 {
                return;
            }
            let _ = PREVIOUS.set(previous);
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as Action as libc::sighandler_t;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
        }
    });
}

/// The handler: a fault inside this thread's guarded range gets a page of zeros in
/// place of the vanished one and is noted; any other goes where it went before.
///
/// It only reads thread-locals without destructors (set before the guarded read
/// started), stores to an atomic, calls `mmap`, a system call, and `sigaction`.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: with SA_SIGINFO the kernel passes a valid `siginfo_t`; for a SIGBUS of a
    // fault (`si_code > 0`: BUS_ADRERR, BUS_MCEERR_*) it holds the faulting address. A
    // SIGBUS sent by `kill` or `raise` (`si_code <= 0`) holds the sender there instead,
    // and is never ours.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    let ours = code > 0
        && RANGE
            .try_with(|r| {
                let (start, end) = r.get();
                (start..end).contains(&addr)
            })
            .unwrap_or(false);
    if ours {
        let page = PAGE.load(Ordering::Relaxed);
        let at = addr & !(page - 1);
        // The file is marked before its page is replaced: a read on another thread that
        // sees the zeros then sees the mark when it checks, after its read.
        let mark = MARK.try_with(Cell::get).unwrap_or(std::ptr::null());
        // SAFETY: a non-null mark points to the flag of the file whose mapping this
        // thread's guarded read (still running: the fault is inside it) borrows, so it is
        // alive; an atomic store is async-signal-safe.
        if let Some(mark) = unsafe { mark.as_ref() } {
            mark.store(true, Ordering::SeqCst);
        }
        // SAFETY: `at` is the start of a page inside a read-only file mapping that the
        // guarded read holds alive; replacing that page with anonymous zeros changes
        // only what this mapping reads there, and `Watched` marks the file as changed so
        // that no later read trusts those bytes.
        let mapped = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            let _ = FAULTED.try_with(|f| f.store(true, Ordering::Relaxed));
            return;
        }
    }
    pass_on(sig, info, ctx);
}

/// Hands a fault that is not ours to the previous handler, or restores the default
/// action so that the faulting access, run again on return, ends the process as it
/// would have without this module (a SIGBUS sent, not a fault, is raised again: it
/// runs nothing again). A sent one the process ignored is ignored (a fault cannot be:
/// run again, it would fault for ever, so it ends the process as the kernel would).
fn pass_on(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: `info` is the kernel's (see `on_sigbus`).
    let sent = unsafe { (*info).si_code } <= 0;
    let ignored = PREVIOUS
        .get()
        .is_some_and(|p| p.sa_sigaction == libc::SIG_IGN);
    if sent && ignored {
        return;
    }
    let handler = PREVIOUS
        .get()
        .filter(|p| p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN);
    match handler {
        Some(p) if p.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: an SA_SIGINFO handler has this signature; it was installed by
            // whoever set it, for this signal.
            let f: Action = unsafe { std::mem::transmute(p.sa_sigaction) };
            f(sig, info, ctx);
        }
        Some(p) => {
            // SAFETY: as above, for a one-argument handler.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
            f(sig);
        }
        None => {
            // SAFETY: installs the default action, a valid zeroed-and-filled sigaction.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
            }
        }
    }
    if sent {
        // A handler that put the default action back (Rust's stack-overflow handler
        // does, for a fault not on a guard page) expects the access to run again and
        // fault; a sent signal runs nothing again, so it is raised anew.
        // SAFETY: reads the action into a zeroed sigaction; `raise` is async-signal-
        // safe, and the signal it sends waits until this handler returns.
        unsafe {
            let mut now: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut now);
            if now.sa_sigaction == libc::SIG_DFL {
                libc::raise(sig);
            }
        }
    }
}

/// What a guarded read that faulted says about the file.
pub(crate) const VANISHED: &str = "a page could not be read (the file shrank under the \
                                   mapping, or the storage returned an error)";

/// Runs `read` with this thread's guard over `range`: `Some` with its result, or `None`
/// if a page of `range` faulted (and read as zeros) meanwhile. A fault also sets `mark`
/// (the flag of the file `range` maps), from the handler, before the page is replaced.
pub(crate) fn guarded<R>(
    range: &[u8],
    mark: Option<&AtomicBool>,
    read: impl FnOnce() -> R,
) -> Option<R> {
    install();
    let start = range.as_ptr() as usize;
    let mark = mark.map_or(std::ptr::null(), |m| m as *const AtomicBool);
    // Put back as they were when this read ends, by return or by a panic of `read`
    // (which a caller may catch: a fault after that must not be taken as this read's).
    let _outer = Outer {
        range: RANGE.with(|r| r.replace((start, start + range.len()))),
        mark: MARK.with(|m| m.replace(mark)),
        faulted: FAULTED.with(|f| f.swap(false, Ordering::Relaxed)),
    };
    // The handler runs on this thread, between any two instructions of `read`: the
    // fences keep the guard's set-up before the read and its check after it.
    compiler_fence(Ordering::SeqCst);
    let out = read();
    compiler_fence(Ordering::SeqCst);
    let faulted = FAULTED.with(|f| f.load(Ordering::Relaxed));
    (!faulted).then_some(out)
}

/// The guard of an enclosing guarded read on this thread, put back on drop.
struct Outer {
    range: (usize, usize),
    mark: *const AtomicBool,
    faulted: bool,
}

impl Drop for Outer {
    fn drop(&mut self) {
        RANGE.with(|r| r.set(self.range));
        MARK.with(|m| m.set(self.mark));
        FAULTED.with(|f| f.store(self.faulted, Ordering::Relaxed));
        compiler_fence(Ordering::SeqCst);
    }
}

/// How often a watched file's metadata is checked again, at most.
pub(crate) const RECHECK: Duration = Duration::from_millis(1);

/// Nanoseconds since the first call in this process.
fn now_ns() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let origin = ORIGIN.get_or_init(Instant::now);
    u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A mapped file watched for changes: its length and modification time at open.
#[derive(Debug)]
pub(crate) struct Watched {
    path: PathBuf,
    file: File,
    len: u64,
    modified: Option<SystemTime>,
    changed: AtomicBool,
    /// When the metadata was last found unchanged ([`now_ns`]), 0 for never.
    checked: AtomicU64,
}

impl Watched {
    /// Watches `file`, just opened from `path`.
    ///
    /// # Errors
    /// [`Error::Io`] naming `path` if its metadata cannot be read.
    pub(crate) fn new(path: &Path, file: File) -> Result<Watched> {
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        Ok(Watched {
            path: path.to_path_buf(),
            len: meta.len(),
            modified: meta.modified().ok(),
            file,
            changed: AtomicBool::new(false),
            checked: AtomicU64::new(0),
        })
    }

    /// The file's length when it was opened.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The open file (to map it).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// The flag a fault in the file's mapping sets (see [`guarded`]): once set, every
    /// read of the file fails.
    pub(crate) fn mark(&self) -> &AtomicBool {
        &self.changed
    }

    fn changed(&self, how: String) -> Error {
        self.changed.store(true, Ordering::Release);
        Error::dataset(&self.path, format!("changed while it was mapped: {how}"))
    }

    /// Fails if an earlier read found the file changed.
    fn check_earlier(&self) -> Result<()> {
        match self.changed.load(Ordering::Acquire) {
            true => Err(self.changed("an earlier read found it changed".into())),
            false => Ok(()),
        }
    }

    /// Checks that the file is as it was opened.
    ///
    /// # Errors
    /// [`Error::Dataset`] naming the file if its length or modification time changed,
    /// now or in an earlier read.
    pub(crate) fn check(&self) -> Result<()> {
        self.check_earlier()?;
        let meta = self.file.metadata().map_err(|e| Error::io(&self.path, e))?;
        if meta.len() != self.len {
            return Err(self.changed(format!(
                "it had {} bytes and now has {} (another process truncated or rewrote it)",
                self.len,
                meta.len()
            )));
        }
        if meta.modified().ok() != self.modified {
            return Err(
                self.changed("it was modified by another process (its bytes may differ)".into())
            );
        }
        Ok(())
    }

    /// Runs `read` over `map` (this file's mapping) after [`check`](Watched::check)
    /// (unless it passed within [`RECHECK`]), guarded against pages that vanish meanwhile.
    ///
    /// # Errors
    /// [`Error::Dataset`] naming the file if it changed, or if a page of it could not be
    /// read (it shrank during the read, or the storage failed), in this read or in
    /// another thread's meanwhile.
    pub(crate) fn read<R>(&self, map: &[u8], read: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.check_recently()?;
        let out = guarded(map, Some(&self.changed), || read(map))
            .ok_or_else(|| self.changed(VANISHED.into()))?;
        // Another thread's fault may have replaced a page this read saw with zeros.
        self.check_earlier()?;
        Ok(out)
    }

    /// [`check`](Watched::check), unless it passed within [`RECHECK`]; an earlier
    /// failure is reported either way.
    ///
    /// # Errors
    /// As [`check`](Watched::check).
    pub(crate) fn check_recently(&self) -> Result<()> {
        let now = now_ns();
        let last = self.checked.load(Ordering::Relaxed);
        if last == 0 || now.saturating_sub(last) >= RECHECK.as_nanos() as u64 {
            self.check()?;
            self.checked.store(now.max(1), Ordering::Relaxed);
            Ok(())
        } else {
            self.check_earlier()
        }
    }

    /// A read of the file outside its mapping came back short: the file is in error
    /// from now on, as for a page that vanished.
    pub(crate) fn short_read(&self, offset: u64, wanted: usize, got: usize) -> Error {
        self.changed(format!(
            "{wanted} bytes at offset {offset} read back as {got} (it shrank)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_page_that_vanishes_is_an_error_not_a_signal() {
        let mut tmp = tempfile::NamedTempFile::new().unwrap();
        tmp.write_all(&vec![7u8; 64 << 10]).unwrap();
        let file = tmp.reopen().unwrap();
        // SAFETY: a read-only mapping of a test file; its truncation is the point.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        tmp.as_file().set_len(4096).unwrap();
        // The first page is still there; the others fault, and read as zeros.
        let sum = guarded(&map, None, || {
            map.iter().map(|&b| u64::from(b)).sum::<u64>()
        });
        assert_eq!(sum, None);
        // Pages before the new end read as before.
        let head = guarded(&map, None, || map[..4096].iter().all(|&b| b == 7));
        assert_eq!(head, Some(true));
    }

    #[test]
    fn a_page_another_thread_faulted_fails_this_threads_read_too() {
        const PAGE: usize = 4096;
        let mut tmp = tempfile::NamedTempFile::new().unwrap();
        tmp.write_all(&vec![7u8; 16 * PAGE]).unwrap();
        let watched = Watched::new(tmp.path(), tmp.reopen().unwrap()).unwrap();
        // SAFETY: as above.
        let map = unsafe { memmap2::Mmap::map(watched.file()) }.unwrap();
        let (inside, entered) = std::sync::mpsc::channel();
        let (faulted, after) = std::sync::mpsc::channel();
        let (read, done) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            let (watched, map, file) = (&watched, &map, tmp.as_file());
            // Both readers are inside their reads, their checks passed, when page 8
            // vanishes (as a storage error would make it) under the first, whose fault
            // maps zeros there; the second then reads those zeros, with no fault of its
            // own, while the first is still inside its read: only the handler's mark can
            // tell the second.
            let second = s.spawn(move || {
                let out = watched.read(map, |m| {
                    inside.send(()).unwrap();
                    after.recv().unwrap();
                    m[8 * PAGE]
                });
                read.send(()).unwrap();
                out
            });
            let first = s.spawn(move || {
                entered.recv().unwrap();
                watched.read(map, |m| {
                    file.set_len(PAGE as u64).unwrap();
                    let v = m[8 * PAGE];
                    faulted.send(()).unwrap();
                    done.recv().unwrap();
                    v
                })
            });
            let second = second.join().unwrap();
            assert!(
                second.is_err(),
                "a page of zeros was read as data: {second:?}"
            );
            assert!(first.join().unwrap().is_err());
        });
    }

    #[test]
    fn a_read_that_panics_leaves_no_guard_behind() {
        let mut tmp = tempfile::NamedTempFile::new().unwrap();
        tmp.write_all(&[1u8; 4096]).unwrap();
        // SAFETY: as above.
        let map = unsafe { memmap2::Mmap::map(tmp.as_file()) }.unwrap();
        let caught = std::panic::catch_unwind(|| guarded(&map, None, || panic!("in the read")));
        assert!(caught.is_err());
        assert_eq!(RANGE.with(Cell::get), (0, 0));
        assert!(MARK.with(Cell::get).is_null());
    }

    #[test]
    fn a_watched_file_reports_its_change_by_name() {
        let mut tmp = tempfile::NamedTempFile::new().unwrap();
        tmp.write_all(&vec![1u8; 32 << 10]).unwrap();
        let watched = Watched::new(tmp.path(), tmp.reopen().unwrap()).unwrap();
        // SAFETY: as above.
        let map = unsafe { memmap2::Mmap::map(watched.file()) }.unwrap();
        assert_eq!(watched.read(&map, |m| m.len()).unwrap(), 32 << 10);
        tmp.as_file().set_len(100).unwrap();
        std::thread::sleep(RECHECK);
        let err = watched.read(&map, |m| m[20_000]).unwrap_err().to_string();
        let name = tmp.path().display().to_string();
        assert!(err.starts_with(&name), "{err}");
        assert!(err.contains("had 32768 bytes and now has 100"), "{err}");
        // Restored to its length, it is still known to have changed.
        tmp.as_file().set_len(32 << 10).unwrap();
        assert!(watched.read(&map, |m| m[0]).is_err());
    }
}
