//! The training-step kernels: compiled by NVRTC once, cached on disk, loaded per run.

use std::path::PathBuf;
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
    /// `sgemm_strided`.
    pub sgemm: CudaFunction,
    /// `normalize_u8`.
    pub normalize: CudaFunction,
    /// `fill_rows`.
    pub fill_rows: CudaFunction,
    /// `relu`.
    pub relu: CudaFunction,
    /// `softmax_xent`.
    pub softmax_xent: CudaFunction,
    /// `relu_backward`.
    pub relu_backward: CudaFunction,
    /// `bias_sgd`.
    pub bias_sgd: CudaFunction,
    /// `scatter_rows` (device cache fill).
    pub scatter_rows: CudaFunction,
    /// `gather_rows` (device cache read).
    pub gather_rows: CudaFunction,
    /// How the PTX was obtained, and how long it took.
    pub origin: KernelOrigin,
    /// Loading the module into the context.
    pub load_time: Duration,
}

/// Where the PTX came from.
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

/// The cache directory: `$STOKER_CACHE`, else `$XDG_CACHE_HOME/stoker`, else
/// `~/.cache/stoker`, else the system temporary directory.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STOKER_CACHE") {
        return d.into();
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("stoker");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache/stoker");
    }
    std::env::temp_dir().join("stoker")
}

impl Kernels {
    /// Compiles (or loads from the cache) and loads the kernels into `cuda`'s context.
    ///
    /// # Errors
    /// [`Error::Cuda`] with NVRTC's log or the driver's error.
    pub fn load(cuda: &Cuda) -> Result<Kernels> {
        let arch = format!("--gpu-architecture=compute_{}{}", cuda.arch.0, cuda.arch.1);
        let options = vec![arch, "--use_fast_math".to_string(), "-lineinfo".to_string()];
        let (major, minor) = cuda.nvrtc.version();
        let key = fnv1a(&[
            SOURCE.as_bytes(),
            options.join(" ").as_bytes(),
            format!("nvrtc {major}.{minor}").as_bytes(),
        ]);
        let dir = cache_dir();
        let file = dir.join(format!("mlp-{key:016x}.ptx"));
        let t = Instant::now();
        let (ptx, origin) = match std::fs::read_to_string(&file) {
            Ok(ptx) if ptx.contains(".entry") => {
                let seconds = t.elapsed().as_secs_f64();
                let cache = file.display().to_string();
                (ptx, KernelOrigin::Cached { seconds, cache })
            }
            _ => {
                let ptx = cuda
                    .nvrtc
                    .compile(SOURCE, "mlp.cu", &options)
                    .map_err(Error::Cuda)?;
                let seconds = t.elapsed().as_secs_f64();
                // A cache that cannot be written only costs the next run a compile.
                let _ = std::fs::create_dir_all(&dir)
                    .and_then(|()| std::fs::write(file.with_extension("tmp"), &ptx))
                    .and_then(|()| std::fs::rename(file.with_extension("tmp"), &file));
                let cache = file.display().to_string();
                (ptx, KernelOrigin::Compiled { seconds, cache })
            }
        };
        let t = Instant::now();
        let cuda_err = |e: cudarc::driver::DriverError| Error::Cuda(e.to_string());
        let module = cuda.ctx.load_module(Ptx::from_src(ptx)).map_err(cuda_err)?;
        let f = |name: &str| module.load_function(name).map_err(cuda_err);
        Ok(Kernels {
            sgemm: f("sgemm_strided")?,
            normalize: f("normalize_u8")?,
            fill_rows: f("fill_rows")?,
            relu: f("relu")?,
            softmax_xent: f("softmax_xent")?,
            relu_backward: f("relu_backward")?,
            bias_sgd: f("bias_sgd")?,
            scatter_rows: f("scatter_rows")?,
            gather_rows: f("gather_rows")?,
            load_time: t.elapsed(),
            origin,
            module,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cache_key_is_stable() {
        // A changed hash would recompile every user's kernels once: keep it fixed.
        assert_eq!(super::fnv1a(&[b"a", b"b"]), super::fnv1a(&[b"a", b"b"]));
        assert_ne!(super::fnv1a(&[b"ab"]), super::fnv1a(&[b"a", b"b"]));
    }
}
