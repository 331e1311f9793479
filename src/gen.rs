//! Synthetic datasets: a learnable classification set (class prototypes plus noise) and
//! a token stream, written as files the loader reads. Large sets are written in parallel
//! straight into memory-mapped output files, so they never need to fit in RAM twice.

use std::path::{Path, PathBuf};

use memmap2::MmapMut;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{Rng, RngExt, SeedableRng};
use rayon::prelude::*;

use crate::dataset::{shape_string, DType};
use crate::error::{Error, Result};
use crate::partial::{self, Claimed};
use crate::util::mix;

/// The header of a version 1.0 `.npy` file holding a C-order array, padded so the data
/// starts at a multiple of 64 bytes, as NumPy does.
///
/// # Panics
/// If the header would exceed the 65,535 bytes of format 1.0 (a shape with thousands of
/// axes).
pub fn npy_header(dtype: DType, shape: &[u64]) -> Vec<u8> {
    let dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
        dtype.descr(),
        shape_string(shape)
    );
    let unpadded = 10 + dict.len() + 1;
    let total = unpadded.next_multiple_of(64);
    let header_len = total - 10;
    assert!(header_len <= u16::MAX as usize, "npy header too long");
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header_len as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.resize(total - 1, b' ');
    out.push(b'\n');
    out
}

/// The most axes an array written here may have: NumPy's own limit (`NPY_MAXDIMS`),
/// whose longest header fits format 1.0's 65,535 bytes many times over.
pub const MAX_AXES: usize = 64;

/// A file being written through a mutable memory map, under a temporary name of its own
/// beside its destination (so that two writers of one path never share it, and one a
/// killed process left is swept: see [`partial`](crate::partial)), with its space
/// reserved up front: a full disk is an error here, never a `SIGBUS` while the mapping
/// is filled (except on a file system that cannot reserve space, see [`reserve`]).
/// Renamed into place by [`finish`](Partial::finish); removed if dropped before that.
struct Partial {
    path: PathBuf,
    tmp: PathBuf,
    map: Option<MmapMut>,
    done: bool,
    /// The temporary file, whose lock marks it as being written until it is in place.
    file: std::fs::File,
}

impl Partial {
    fn create(path: &Path, len: u64) -> Result<Partial> {
        // Through a symbolic link to the file it names.
        let dest = crate::util::destination(path);
        let path = dest.as_path();
        let Claimed { path: tmp, file } = partial::claim(path).map_err(|e| Error::io(path, e))?;
        let mut partial = Partial {
            path: path.to_path_buf(),
            tmp,
            map: None,
            done: false,
            file,
        };
        let file = &partial.file;
        reserve(file, len).map_err(|e| Error::io(path, e))?;
        if len > 0 {
            // SAFETY: the file was just created by this process under a name of its own,
            // and its blocks are allocated: nothing else maps or resizes it while the
            // writer lives, and filling the mapping cannot fault on a full disk.
            let map = unsafe { MmapMut::map_mut(file) }.map_err(|e| Error::io(path, e))?;
            partial.map = Some(map);
        }
        Ok(partial)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.map.as_deref_mut().unwrap_or_default()
    }

    /// Writes the mapping's pages back to the file, and unmaps it.
    fn flush(&mut self) -> Result<()> {
        if let Some(map) = self.map.take() {
            map.flush().map_err(|e| Error::io(&self.path, e))?;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<PathBuf> {
        self.flush()?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(&self.path, e))?;
        self.done = true;
        Ok(self.path.clone())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.done {
            drop(self.map.take());
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Allocates `len` bytes of `file` on disk (`posix_fallocate`); where the file system
/// cannot (some FUSE and network file systems, ZFS before 2.2), only sets the length:
/// there, a disk that fills while the mapping is written still ends the process with
/// `SIGBUS`, as any program writing through a mapping would.
fn reserve(file: &std::fs::File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let Ok(n) = libc::off_t::try_from(len) else {
        return Err(std::io::Error::from_raw_os_error(libc::EFBIG));
    };
    if n == 0 {
        return Ok(());
    }
    // SAFETY: a valid open descriptor; the call reads and writes no memory of ours.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, n) } {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => file.set_len(len),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// An `.npy` file being written through a mutable memory map. It is written under a
/// temporary name and renamed into place by [`finish`](NpyWriter::finish), so a reader
/// never sees a half-written file; its space is reserved when it is created, and a
/// writer dropped unfinished removes its temporary file.
pub struct NpyWriter {
    file: Partial,
    offset: usize,
}

impl NpyWriter {
    /// Creates `path` for an array of `dtype` and `shape`.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file (no space left on the device, say);
    /// [`Error::Config`] if the size overflows, or for more than [`MAX_AXES`] axes.
    pub fn create(path: impl AsRef<Path>, dtype: DType, shape: &[u64]) -> Result<NpyWriter> {
        let path = path.as_ref();
        if shape.len() > MAX_AXES {
            return Err(Error::Config(format!(
                "{}: a shape of {} axes; NumPy reads at most {MAX_AXES}",
                path.display(),
                shape.len()
            )));
        }
        let header = npy_header(dtype, shape);
        let len = shape
            .iter()
            .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d))
            .and_then(|data| data.checked_add(header.len() as u64))
            .filter(|&len| usize::try_from(len).is_ok_and(|l| l <= isize::MAX as usize))
            .ok_or_else(|| {
                Error::Config(format!(
                    "{}: shape {} is too large to write",
                    path.display(),
                    shape_string(shape)
                ))
            })?;
        let mut file = Partial::create(path, len)?;
        file.bytes_mut()[..header.len()].copy_from_slice(&header);
        Ok(NpyWriter {
            file,
            offset: header.len(),
        })
    }

    /// The data bytes, to fill.
    pub fn data_mut(&mut self) -> &mut [u8] {
        let offset = self.offset;
        self.file.bytes_mut().get_mut(offset..).unwrap_or_default()
    }

    /// Writes the data to the file, still under its temporary name; after this,
    /// [`data_mut`](NpyWriter::data_mut) is empty. Writers of files that belong together
    /// flush them all before [`finish`](NpyWriter::finish)ing any, so that what can fail
    /// fails before any of them is in place.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file.
    pub fn flush(&mut self) -> Result<()> {
        self.file.flush()
    }

    /// Flushes and renames the file into place.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file.
    pub fn finish(self) -> Result<PathBuf> {
        self.file.finish()
    }
}

/// Where `stokehold train` and `bench` make their default dataset.
pub const DEFAULT_DATA: &str = "data/cifar";

/// Whether `dir` is [`DEFAULT_DATA`] and lacks its files: the command then makes it with
/// [`ClassificationSpec::default`]. Any other missing directory is left alone, so that
/// opening it fails with an error naming it, rather than 600 MB being generated into a
/// mistyped path.
pub fn default_missing(dir: &Path) -> bool {
    is_default(dir) && !(dir.join("x.npy").is_file() && dir.join("y.npy").is_file())
}

/// Whether `dir` names [`DEFAULT_DATA`], however spelt (`./data/cifar`, `data/cifar/`).
fn is_default(dir: &Path) -> bool {
    let named = dir
        .components()
        .filter(|c| *c != std::path::Component::CurDir);
    named.eq(Path::new(DEFAULT_DATA).components())
}

/// A sample shape such as `3x32x32` (or `3,32,32`).
///
/// # Errors
/// [`Error::Config`] naming the text when a dimension is not a number.
pub fn parse_shape(s: &str) -> Result<Vec<u64>> {
    s.split(['x', 'X', ','])
        .map(|d| d.trim().parse::<u64>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| Error::Config(format!("bad shape {s:?}: expected numbers such as 3x32x32")))
}

/// What [`classification`] writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassificationSpec {
    /// Samples.
    pub samples: u64,
    /// Shape of one sample, e.g. `[3, 32, 32]`.
    pub shape: Vec<u64>,
    /// Classes (at most 256).
    pub classes: u32,
    /// Noise amplitude: each byte is its class prototype plus a uniform value in
    /// `-noise..=noise`, clamped to 0..=255.
    pub noise: u8,
    /// Seed.
    pub seed: u64,
}

impl Default for ClassificationSpec {
    fn default() -> Self {
        ClassificationSpec {
            samples: 200_000,
            shape: vec![3, 32, 32],
            classes: 10,
            noise: 96,
            seed: 0,
        }
    }
}

/// Writes a learnable classification set to `dir/x.npy` (u8, `(samples, *shape)`) and
/// `dir/y.npy` (i64 labels): each class has a random prototype image and each sample is
/// its class's prototype plus uniform noise. Deterministic in the spec, whatever the
/// thread count. `progress(n)` is called, from any thread, as each run of `n` samples is
/// written. Returns the two paths.
///
/// # Errors
/// [`Error::Config`] for zero samples or classes, more than 256 classes or an empty
/// shape; [`Error::Io`] naming the file that could not be written.
pub fn classification(
    dir: impl AsRef<Path>,
    spec: &ClassificationSpec,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(PathBuf, PathBuf)> {
    let dir = dir.as_ref();
    let row = check_spec(spec)?;
    let _turn = DirLock::take(dir)?;
    write_classification(dir, spec, row, progress)
}

/// Makes the default set ([`ClassificationSpec::default`]) in `dir` unless it is there
/// once this process has its turn at the directory: of several runs that find it
/// missing at once (two `stokehold train` started together), one writes it and the
/// others then use it. Returns whether this call wrote it.
///
/// # Errors
/// As [`classification`].
pub fn default_set(dir: impl AsRef<Path>, progress: &(dyn Fn(u64) + Sync)) -> Result<bool> {
    let dir = dir.as_ref();
    let spec = ClassificationSpec::default();
    let row = check_spec(&spec)?;
    let _turn = DirLock::take(dir)?;
    if dir.join("x.npy").is_file() && dir.join("y.npy").is_file() {
        return Ok(false);
    }
    write_classification(dir, &spec, row, progress).map(|_| true)
}

/// An exclusive `flock` on the directory `DIR` itself, held while a set is written into
/// it: two writers of one directory take turns, so its `x.npy` and `y.npy` always come
/// from one of them. Where the file system has no locks, writers go on without.
struct DirLock(#[allow(dead_code)] Option<std::fs::File>);

impl DirLock {
    /// Makes `dir` if need be, and waits for its lock.
    fn take(dir: &Path) -> Result<DirLock> {
        use std::os::fd::AsRawFd;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let path = dir;
        let file = std::fs::File::open(dir).map_err(|e| Error::io(dir, e))?;
        loop {
            // SAFETY: flock on a descriptor this function owns; it reads no memory.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(DirLock(Some(file)));
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // No locks on this file system (some FUSE mounts).
                Some(libc::ENOLCK | libc::EOPNOTSUPP) => return Ok(DirLock(None)),
                _ => return Err(Error::io(path, e)),
            }
        }
    }
}

/// The bytes of one sample of `spec`, or why `spec` cannot be written: checked before
/// anything is made on disk.
fn check_spec(spec: &ClassificationSpec) -> Result<u64> {
    if spec.samples == 0 || spec.classes == 0 || spec.classes > 256 {
        return Err(Error::Config(
            "need at least one sample and 1 to 256 classes".into(),
        ));
    }
    let row = spec.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    let Some(row) = row.filter(|&r| r > 0 && !spec.shape.is_empty()) else {
        return Err(Error::Config(format!(
            "a sample needs a non-empty shape whose size fits 64 bits, got {}",
            shape_string(&spec.shape)
        )));
    };
    if spec.samples.checked_mul(row).is_none() || spec.samples.checked_mul(8).is_none() {
        return Err(Error::Config(format!(
            "{} samples of {row} bytes are too large: their size overflows 64 bits",
            spec.samples
        )));
    }
    Ok(row)
}

/// [`classification`], with `dir` made and its lock held.
fn write_classification(
    dir: &Path,
    spec: &ClassificationSpec,
    row: u64,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(PathBuf, PathBuf)> {
    let mut x_shape = vec![spec.samples];
    x_shape.extend_from_slice(&spec.shape);
    // Both files are sized (and their space reserved) before anything else is allocated.
    let mut x = NpyWriter::create(dir.join("x.npy"), DType::U8, &x_shape)?;
    let mut y = NpyWriter::create(dir.join("y.npy"), DType::I64, &[spec.samples])?;
    let row = row as usize;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(spec.seed);
    let prototype_bytes = row.checked_mul(spec.classes as usize).ok_or_else(|| {
        Error::Config(format!(
            "{} classes of samples of {row} bytes overflow memory",
            spec.classes
        ))
    })?;
    let mut prototypes: Vec<u8> = crate::util::zeroed(prototype_bytes, "class prototypes")?;
    rng.fill_bytes(&mut prototypes);
    let label = |i: u64| (mix(spec.seed ^ mix(i + 1)) % spec.classes as u64) as i64;

    const CHUNK: usize = 512;
    let noise = spec.noise as i32;
    x.data_mut()
        .par_chunks_mut(row * CHUNK)
        .zip(y.data_mut().par_chunks_mut(8 * CHUNK))
        .enumerate()
        .for_each(|(chunk, (xs, ys))| {
            let first = (chunk * CHUNK) as u64;
            let mut rng =
                Xoshiro256PlusPlus::seed_from_u64(mix(spec.seed ^ 0x006e_6f69_7365) ^ first);
            for (k, (xr, yr)) in xs
                .chunks_exact_mut(row)
                .zip(ys.chunks_exact_mut(8))
                .enumerate()
            {
                let c = label(first + k as u64);
                yr.copy_from_slice(&c.to_le_bytes());
                let proto = &prototypes[c as usize * row..(c as usize + 1) * row];
                for (out, &p) in xr.iter_mut().zip(proto) {
                    let v = p as i32 + rng.random_range(-noise..=noise);
                    *out = v.clamp(0, 255) as u8;
                }
            }
            progress((xs.len() / row) as u64);
        });
    // x.npy is put in place last, and an older one is removed first: whatever fails or
    // stops the process in between, x.npy is there only beside the y.npy written with it
    // (which is what `default_missing` looks for).
    x.flush()?;
    y.flush()?;
    // Where x.npy lands: through a symbolic link, its target (the link stays).
    let x_path = crate::util::destination(&dir.join("x.npy"));
    match std::fs::remove_file(&x_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&x_path, e)),
        _ => {}
    }
    let y = y.finish()?;
    let x = x.finish()?;
    Ok((x, y))
}

/// Writes `tokens` little-endian `u16` tokens below `vocab` to `path` (a raw `.bin`),
/// drawn from a seeded first-order chain (each token depends on the one before), so a
/// model has something to learn.
///
/// # Errors
/// [`Error::Config`] for `vocab` outside `2..=65536` or a size that overflows;
/// [`Error::Io`] naming the file. The file is written under a temporary name and renamed
/// into place: an interrupted run leaves no file that reads as valid.
pub fn token_stream(path: impl AsRef<Path>, tokens: u64, vocab: u32, seed: u64) -> Result<PathBuf> {
    let path = path.as_ref();
    if !(2..=65_536).contains(&vocab) {
        return Err(Error::Config("vocab must be in 2..=65536".into()));
    }
    let bytes = tokens.checked_mul(2).ok_or_else(|| {
        Error::Config(format!(
            "{}: {tokens} tokens of 2 bytes overflow a file size",
            path.display()
        ))
    })?;
    let mut file = Partial::create(path, bytes)?;
    let map = file.bytes_mut();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut prev = 0u32;
    for t in map.chunks_exact_mut(2) {
        // Mostly a fixed successor of the previous token, sometimes a random jump.
        let next = if rng.random_range(0..4u32) == 0 {
            rng.random_range(0..vocab)
        } else {
            (prev.wrapping_mul(31).wrapping_add(7)) % vocab
        };
        t.copy_from_slice(&(next as u16).to_le_bytes());
        prev = next;
    }
    file.finish()
}

#[cfg(test)]
mod tests {
    #[test]
    fn shapes_parse_and_bad_ones_are_named() {
        assert_eq!(super::parse_shape("3x32X32").unwrap(), vec![3, 32, 32]);
        assert_eq!(super::parse_shape("1,8").unwrap(), vec![1, 8]);
        let err = super::parse_shape("3xq").unwrap_err().to_string();
        assert!(err.contains("\"3xq\""), "{err}");
    }

    fn spec(seed: u64) -> super::ClassificationSpec {
        super::ClassificationSpec {
            samples: 100,
            shape: vec![4],
            classes: 3,
            noise: 8,
            seed,
        }
    }

    #[test]
    fn a_set_made_again_replaces_both_files() {
        let dir = tempfile::tempdir().unwrap();
        super::classification(dir.path(), &spec(1), &|_| {}).unwrap();
        let before = std::fs::read(dir.path().join("y.npy")).unwrap();
        super::classification(dir.path(), &spec(2), &|_| {}).unwrap();
        assert_ne!(std::fs::read(dir.path().join("y.npy")).unwrap(), before);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn a_set_that_fails_to_land_leaves_no_x_without_its_y() {
        let dir = tempfile::tempdir().unwrap();
        super::classification(dir.path(), &spec(1), &|_| {}).unwrap();
        // y.npy cannot be renamed over a directory that holds a file.
        std::fs::remove_file(dir.path().join("y.npy")).unwrap();
        std::fs::create_dir(dir.path().join("y.npy")).unwrap();
        std::fs::write(dir.path().join("y.npy/keep"), b"").unwrap();
        let err = super::classification(dir.path(), &spec(2), &|_| {}).unwrap_err();
        assert!(err.to_string().contains("y.npy"), "{err}");
        // The old x.npy is gone with the failed y.npy, so the pair reads as missing (and
        // is made again) instead of an old x beside a y of another spec; no temporary
        // file is left behind.
        assert!(!dir.path().join("x.npy").exists());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("y.npy")]);
    }

    #[test]
    fn files_behind_symbolic_links_are_written_through_them() {
        let dir = tempfile::tempdir().unwrap();
        let (set, store) = (dir.path().join("set"), dir.path().join("store"));
        std::fs::create_dir_all(&set).unwrap();
        std::fs::create_dir_all(&store).unwrap();
        for f in ["x.npy", "y.npy"] {
            std::os::unix::fs::symlink(store.join(f), set.join(f)).unwrap();
        }
        for seed in [1, 2] {
            super::classification(&set, &spec(seed), &|_| {}).unwrap();
            for f in ["x.npy", "y.npy"] {
                let meta = std::fs::symlink_metadata(set.join(f)).unwrap();
                assert!(meta.file_type().is_symlink(), "seed {seed}: {f} is no link");
                assert!(set.join(f).is_file(), "seed {seed}: {f} leads nowhere");
            }
        }
        crate::NpyDataset::open_xy(&set).unwrap();
    }

    #[test]
    fn the_default_set_is_named_however_its_path_is_spelt() {
        let default = |p: &str| super::is_default(std::path::Path::new(p));
        assert!(default("data/cifar") && default("./data/cifar") && default("data/cifar/"));
        assert!(!default("data/cifar10") && !default("other/data/cifar"));
        assert!(!default("/data/cifar") && !default("data"));
    }
}
