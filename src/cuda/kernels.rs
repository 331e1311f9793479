//! The training-step kernels: compiled by NVRTC once, cached on disk, loaded per run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::Cuda;
use crate::error::{Error, Result};

/// The CUDA C source of the step.
pub const SOURCE: &str = include_str!("../../kernels/mlp.cu");

/// The kernels of `kernels/mlp.cu`, loaded.
#[derive(Debug, Clone)]
pub struct Kernels {
    /// The module.
    pub module: Arc<CudaModule>,
    /// `forward_partial`: the first product, split over the inputs.
    pub forward: CudaFunction,
    /// `row_tail`: per sample, the hidden layer, logits, loss and gradients.
    pub tail: CudaFunction,
    /// `update`: the SGD step of every weight.
    pub update: CudaFunction,
    /// `scatter_rows` (device cache fill).
    pub scatter_rows: CudaFunction,
    /// `gather_rows` (device cache read).
    pub gather_rows: CudaFunction,
    /// How the PTX was obtained, and how long it took.
    pub origin: KernelOrigin,
    /// Loading the module into the context.
    pub load_time: Duration,
}

/// Where the compiled image came from.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum KernelOrigin {
    /// Compiled by NVRTC now (and written to the cache).
    Compiled {
        /// Compile time.
        seconds: f64,
        /// The cache file written.
        cache: String,
    },
    /// Read from the on-disk cache.
    Cached {
        /// Read time.
        seconds: f64,
        /// The cache file.
        cache: String,
    },
}

/// FNV-1a, 64-bit: a hash that is the same on every run and machine.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The cache directory: `$STOKEHOLD_CACHE`, else `$XDG_CACHE_HOME/stokehold`, else
/// `~/.cache/stokehold`, else the system temporary directory.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STOKEHOLD_CACHE") {
        return d.into();
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("stokehold");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache/stokehold");
    }
    std::env::temp_dir().join("stokehold")
}

/// Whether `bytes` is a whole 64-bit ELF file: the magic, and at least as long as its
/// header says (the end of its section or program header table, whichever is last: the
/// program headers in NVRTC's cubins), so that a truncated cache file is compiled afresh
/// rather than handed to the driver.
pub fn elf_complete(bytes: &[u8]) -> bool {
    if bytes.len() < 64 || !bytes.starts_with(b"\x7fELF\x02\x01") {
        return false;
    }
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
    let u16_at = |o: usize| u16::from_le_bytes(bytes[o..o + 2].try_into().expect("2 bytes"));
    let table_end = |off: usize, size: usize, count: usize| {
        u64_at(off).saturating_add(u64::from(u16_at(size)) * u64::from(u16_at(count)))
    };
    let end = table_end(0x28, 0x3A, 0x3C).max(table_end(0x20, 0x36, 0x38));
    end <= bytes.len() as u64
}

/// A compiled image for the driver: a cubin's bytes, or PTX text.
fn image(bytes: Vec<u8>, cubin: bool) -> Ptx {
    if cubin {
        Ptx::from_binary(bytes)
    } else {
        Ptx::from_src(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// NVRTC's options for [`SOURCE`]: a cubin for the real architecture `sm_XY` when
/// `cubin`, else PTX for the virtual `compute_XY`.
pub fn compile_options(arch: (i32, i32), cubin: bool) -> Vec<String> {
    let (maj, min) = arch;
    let arch = if cubin {
        format!("--gpu-architecture=sm_{maj}{min}")
    } else {
        format!("--gpu-architecture=compute_{maj}{min}")
    };
    vec![arch, "--use_fast_math".to_string(), "-lineinfo".to_string()]
}

/// The integrated (Tegra: Jetson, DRIVE, Thor) architectures: their cubins run on the
/// same architecture only, and neither their cubins nor their PTX are built for another
/// kind of GPU.
const TEGRA: [(i32, i32); 6] = [(5, 3), (6, 2), (7, 2), (8, 7), (10, 1), (11, 0)];

/// The architecture NVRTC builds for a device of compute capability `device`, given the
/// real architectures it `supported` (empty: it cannot say; the device's own is tried):
/// - a cubin (`cubin`): the newest of them with the device's major and a minor no
///   higher, since a cubin for `sm_XY` runs on `X.Z` for any `Z >= Y` (an `sm_100` cubin
///   on an `sm_103` device whose NVRTC does not know `sm_103`); on a Tegra device, its
///   own only, and never a Tegra one elsewhere;
/// - PTX: the newest no newer than the device (Tegra ones for Tegra devices only),
///   which the driver compiles forward (for a device newer than every architecture
///   NVRTC knows).
///
/// `None` when there is none: the device is older than every architecture NVRTC builds
/// for, or (for a cubin) of an architecture it cannot build a runnable one for.
pub fn build_arch(device: (i32, i32), supported: &[(i32, i32)], cubin: bool) -> Option<(i32, i32)> {
    if supported.is_empty() {
        return Some(device);
    }
    let tegra = TEGRA.contains(&device);
    supported
        .iter()
        .copied()
        .filter(|arch| tegra || !TEGRA.contains(arch))
        .filter(|&(major, minor)| match (cubin, tegra) {
            (true, true) => (major, minor) == device,
            (true, false) => major == device.0 && minor <= device.1,
            (false, _) => (major, minor) <= device,
        })
        .max()
}

impl Kernels {
    /// Compiles (or loads from the cache in [`cache_dir`]) and loads the kernels into
    /// `cuda`'s context.
    ///
    /// # Errors
    /// [`Error::Cuda`] with NVRTC's log or the driver's error.
    pub fn load(cuda: &Cuda) -> Result<Kernels> {
        Self::load_from(cuda, &cache_dir())
    }

    /// [`load`](Kernels::load) with the compiled images cached in `dir`.
    ///
    /// A cubin that runs on the device first ([`build_arch`]), PTX if that cannot be built or
    /// loaded. A cached image the driver rejects (damaged, or from another driver) is
    /// deleted and compiled afresh, once.
    ///
    /// # Errors
    /// As [`load`](Kernels::load): the last error met.
    pub fn load_from(cuda: &Cuda, dir: &Path) -> Result<Kernels> {
        load_program(cuda, dir, &MLP, Self::from_image)
    }

    fn from_image(cuda: &Cuda, ptx: Ptx, origin: KernelOrigin) -> Result<Kernels> {
        let t = Instant::now();
        let module = cuda.ctx.load_module(ptx)?;
        let f = |name: &str| module.load_function(name).map_err(Error::from);
        Ok(Kernels {
            forward: f("forward_partial")?,
            tail: f("row_tail")?,
            update: f("update")?,
            scatter_rows: f("scatter_rows")?,
            gather_rows: f("gather_rows")?,
            load_time: t.elapsed(),
            origin,
            module,
        })
    }
}

/// A CUDA C source of `kernels/`, and the name its compiled images are cached under.
#[derive(Debug, Clone, Copy)]
pub struct Program {
    /// The source.
    pub source: &'static str,
    /// Its name (`mlp`: `mlp.cu`, cached as `mlp-<hash>.cubin`).
    pub name: &'static str,
}

/// The training step's kernels.
pub const MLP: Program = Program {
    source: SOURCE,
    name: "mlp",
};

/// Compiles `program` (or reads it from the cache in `dir`) and hands the image to
/// `load`: a cubin that runs on the device first ([`build_arch`]), PTX if that cannot be built
/// or loaded. A cached image the driver rejects (damaged, or from another driver) is
/// deleted and compiled afresh, once.
///
/// # Errors
/// [`Error::Cuda`] with NVRTC's log or the driver's error: the last one met.
pub(crate) fn load_program<T>(
    cuda: &Cuda,
    dir: &Path,
    program: &Program,
    load: impl Fn(&Cuda, Ptx, KernelOrigin) -> Result<T>,
) -> Result<T> {
    let mut last = None;
    for cubin in [true, false] {
        for attempt in 0..2 {
            let (image, origin) = match compiled(cuda, dir, program, cubin) {
                Ok(found) => found,
                Err(e) => {
                    last = Some(e);
                    break;
                }
            };
            match load(cuda, image, origin.clone()) {
                Ok(k) => return Ok(k),
                // Another image would fail the same way, and the cache is not to blame.
                Err(e) if the_context_failed(&e) => return Err(e),
                Err(e) => {
                    last = Some(e);
                    if attempt == 0 && matches!(origin, KernelOrigin::Cached { .. }) {
                        let _ = std::fs::remove_file(origin.cache());
                        continue;
                    }
                    break;
                }
            }
        }
    }
    Err(last.unwrap_or_else(|| Error::cuda("no kernel image could be built")))
}

/// Whether loading an image failed for the context, not the image: a fault's sticky
/// error, a context that is gone, or a full device. Another image would fail the same
/// way, and the cache is not to blame. (Any other failure may be the image's: damaged,
/// for another architecture, PTX too new for the driver.)
fn the_context_failed(e: &Error) -> bool {
    const OUT_OF_MEMORY: u32 = cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32;
    e.context_lost() || e.cuda_code() == Some(OUT_OF_MEMORY)
}

/// The compiled image (a cubin that runs on the device, or PTX), from the
/// cache or from NVRTC.
fn compiled(
    cuda: &Cuda,
    dir: &Path,
    program: &Program,
    cubin: bool,
) -> Result<(Ptx, KernelOrigin)> {
    let archs = cuda.nvrtc.supported_archs();
    let Some(arch) = build_arch(cuda.arch, &archs, cubin) else {
        let (major, minor) = cuda.nvrtc.version();
        let known: Vec<String> = archs.iter().map(|(a, b)| format!("sm_{a}{b}")).collect();
        return Err(Error::cuda(format!(
            "NVRTC {major}.{minor} cannot build {} that runs on sm_{}{} (it builds for {})",
            if cubin { "a cubin" } else { "PTX" },
            cuda.arch.0,
            cuda.arch.1,
            known.join(", ")
        )));
    };
    if !cubin && cuda.nvrtc.version() > cuda.driver {
        // PTX from a newer NVRTC names a PTX ISA the driver cannot JIT
        // (CUDA_ERROR_UNSUPPORTED_PTX_VERSION): say so instead of trying.
        return Err(Error::cuda(format!(
            "NVRTC {}.{} is newer than the driver's CUDA {}.{}: its PTX would not load, \
             and no cubin could be used (point STOKEHOLD_NVRTC at an NVRTC no newer than \
             the driver, or update the driver)",
            cuda.nvrtc.version().0,
            cuda.nvrtc.version().1,
            cuda.driver.0,
            cuda.driver.1
        )));
    }
    let options = compile_options(arch, cubin);
    let (major, minor) = cuda.nvrtc.version();
    let key = fnv1a(&[
        program.source.as_bytes(),
        options.join(" ").as_bytes(),
        format!("nvrtc {major}.{minor}").as_bytes(),
    ]);
    let file = dir.join(format!(
        "{}-{key:016x}.{}",
        program.name,
        if cubin { "cubin" } else { "ptx" }
    ));
    let file_name = format!("{}.cu", program.name);
    let t = Instant::now();
    let cache = file.display().to_string();
    if let Ok(bytes) = std::fs::read(&file) {
        let ok = if cubin {
            elf_complete(&bytes)
        } else {
            !bytes.contains(&0) && bytes.windows(6).any(|w| w == b".entry")
        };
        if ok {
            let seconds = t.elapsed().as_secs_f64();
            return Ok((image(bytes, cubin), KernelOrigin::Cached { seconds, cache }));
        }
    }
    let bytes = if cubin {
        cuda.nvrtc
            .compile_cubin(program.source, &file_name, &options)
    } else {
        cuda.nvrtc
            .compile(program.source, &file_name, &options)
            .map(String::into_bytes)
    }
    .map_err(Error::cuda)?;
    let seconds = t.elapsed().as_secs_f64();
    // A temporary name of our own, renamed into place: concurrent writers never
    // expose a half-written file. A cache that cannot be written only costs the next
    // run a compile.
    let tmp = file.with_extension(format!(
        "{}.{:?}.tmp",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, &bytes))
        .and_then(|()| std::fs::rename(&tmp, &file));
    let _ = std::fs::remove_file(&tmp);
    Ok((
        image(bytes, cubin),
        KernelOrigin::Compiled { seconds, cache },
    ))
}

impl KernelOrigin {
    /// The cache file.
    pub fn cache(&self) -> &str {
        match self {
            KernelOrigin::Compiled { cache, .. } | KernelOrigin::Cached { cache, .. } => cache,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_architecture_built_for_runs_on_the_device() {
        // As NVRTC 12.8 lists them (Tegra ones among them: 87 Orin, 101 Thor).
        let known = [
            (7, 5),
            (8, 0),
            (8, 6),
            (8, 7),
            (8, 9),
            (9, 0),
            (10, 0),
            (10, 1),
            (12, 0),
        ];
        let cubin = |device| super::build_arch(device, &known, true);
        let ptx = |device| super::build_arch(device, &known, false);
        assert_eq!(cubin((9, 0)), Some((9, 0)));
        assert_eq!(cubin((8, 6)), Some((8, 6)));
        // A cubin runs on newer minors of its major, never on another major, and a
        // Tegra one (sm_101 Thor) never on a B300 (sm_103).
        assert_eq!(cubin((8, 9)), Some((8, 9)));
        assert_eq!(cubin((10, 3)), Some((10, 0)));
        assert_eq!(cubin((12, 1)), Some((12, 0)));
        assert_eq!(cubin((13, 0)), None);
        // A Tegra device gets its own cubin or PTX; a desktop one no Tegra PTX.
        assert_eq!(cubin((8, 7)), Some((8, 7)));
        assert_eq!(cubin((11, 0)), None);
        assert_eq!(ptx((11, 0)), Some((10, 1)));
        assert_eq!(ptx((8, 8)), Some((8, 6)));
        // A device newer than all it knows: PTX for the newest.
        assert_eq!(ptx((13, 0)), Some((12, 0)));
        // Older than all it knows: nothing.
        assert_eq!((cubin((6, 1)), ptx((6, 1))), (None, None));
        // NVRTC that cannot say: the device's own.
        assert_eq!(super::build_arch((12, 0), &[], true), Some((12, 0)));
    }

    #[test]
    fn a_truncated_or_foreign_cubin_is_not_complete() {
        let mut elf = vec![0u8; 200];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x28..0x30].copy_from_slice(&72u64.to_le_bytes()); // section headers at 72
        elf[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes()); // of 64 bytes
        elf[0x3C..0x3E].copy_from_slice(&2u16.to_le_bytes()); // two: ends at 200
        assert!(super::elf_complete(&elf));
        assert!(!super::elf_complete(&elf[..199]));
        assert!(!super::elf_complete(&elf[..40]));
        assert!(!super::elf_complete(
            b"not an elf file at all, but long enough to be read......."
        ));
    }

    #[test]
    fn the_cache_key_is_stable() {
        // A changed hash would recompile every user's kernels once: keep it fixed.
        // FNV-1a 64 of the parts, each followed by 0xff (the standard one of "a" is
        // 0xaf63dc4c8601ec8c, which the separator changes).
        assert_eq!(super::fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(super::fnv1a(&[b"a", b"b"]), 0xd2b3_7181_9297_f98a);
        assert_ne!(super::fnv1a(&[b"ab"]), super::fnv1a(&[b"a", b"b"]));
    }
}
