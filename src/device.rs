//! Choosing where the training step runs: CUDA when it is all there (libcuda, a device,
//! NVRTC, kernels the driver can load), else the CPU with the reason.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::Trainer;
use crate::cpu::CpuTrainer;
use crate::cuda::{self, Cuda, CudaTrainer, KernelOrigin, Kernels, PinnedAlloc, PinnedKind};
use crate::error::{Error, Result};
use crate::loader::{BatchLayout, HostAlloc};
use crate::model::{Mlp, Normalize};

/// What the user asked for (`--device auto|cuda|cpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum DeviceChoice {
    /// CUDA when libcuda, a device and NVRTC are all there; the CPU otherwise.
    #[default]
    Auto,
    /// CUDA, or an error saying what is missing.
    Cuda,
    /// The CPU backend.
    Cpu,
}

impl DeviceChoice {
    /// Every choice, by name.
    pub const NAMES: [&'static str; 3] = ["auto", "cuda", "cpu"];
}

impl FromStr for DeviceChoice {
    type Err = Error;

    /// `auto`, `cuda` or `cpu`.
    fn from_str(s: &str) -> Result<DeviceChoice> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cuda" => Ok(DeviceChoice::Cuda),
            "cpu" => Ok(DeviceChoice::Cpu),
            _ => Err(Error::Config(format!(
                "device {s:?}: expected auto, cuda or cpu"
            ))),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = *self as usize;
        f.write_str(DeviceChoice::NAMES[i])
    }
}

/// Where the training step runs.
#[derive(Debug, Clone)]
pub enum Device {
    /// A CUDA device.
    Cuda(Cuda),
    /// The CPU backend; `reason` says why CUDA is not used, when it was not asked away.
    Cpu {
        /// Why not CUDA ("no libcuda found", ...), or `None` when the CPU was asked for.
        reason: Option<String>,
    },
}

impl Device {
    /// CUDA if it is usable, otherwise the CPU with the reason. Never fails, never panics.
    pub fn auto() -> Device {
        match cuda::probe() {
            Ok(c) => Device::Cuda(c),
            Err(reason) => Device::Cpu {
                reason: Some(reason),
            },
        }
    }

    /// The device for a choice.
    ///
    /// # Errors
    /// [`Error::Cuda`] with the reason when CUDA is asked for and not usable.
    pub fn select(choice: DeviceChoice) -> Result<Device> {
        match choice {
            DeviceChoice::Auto => Ok(Device::auto()),
            DeviceChoice::Cpu => Ok(Device::Cpu { reason: None }),
            DeviceChoice::Cuda => cuda::probe().map(Device::Cuda).map_err(Error::cuda),
        }
    }

    /// A short description: the GPU's name, or `cpu`.
    pub fn name(&self) -> String {
        match self {
            Device::Cuda(c) => format!("cuda:0 ({}, sm_{}{})", c.name, c.arch.0, c.arch.1),
            Device::Cpu { .. } => format!("cpu ({} threads)", rayon::current_num_threads()),
        }
    }

    /// Why the CPU runs where CUDA could have been used.
    pub fn fallback_reason(&self) -> Option<&str> {
        match self {
            Device::Cpu { reason } => reason.as_deref(),
            Device::Cuda(_) => None,
        }
    }
}

/// A backend ready to make trainers: the device, its kernels, and what getting them
/// cost.
pub struct Backend {
    device: Device,
    kernels: Option<Kernels>,
    /// Creating the CUDA context (zero on the CPU).
    pub context: Duration,
    /// Compiling the kernels or reading them from the disk cache (zero on the CPU).
    pub kernels_load: Duration,
    /// Whether the kernels came from the disk cache.
    pub kernels_from_cache: bool,
}

impl Backend {
    /// The backend for `choice`: the device, and on CUDA its kernels. With
    /// [`DeviceChoice::Auto`], kernels the driver cannot load (an NVRTC newer than the
    /// driver, say) mean the CPU, with the reason.
    ///
    /// # Errors
    /// [`Error::Cuda`] when CUDA is asked for and not usable, or its kernels do not load.
    pub fn open(choice: DeviceChoice) -> Result<Backend> {
        let cpu = |reason| Backend {
            device: Device::Cpu { reason },
            kernels: None,
            context: Duration::ZERO,
            kernels_load: Duration::ZERO,
            kernels_from_cache: false,
        };
        let c = match Device::select(choice)? {
            Device::Cuda(c) => c,
            Device::Cpu { reason } => return Ok(cpu(reason)),
        };
        let t = Instant::now();
        match Kernels::load(&c) {
            Ok(k) => Ok(Backend {
                kernels_load: t.elapsed(),
                kernels_from_cache: matches!(k.origin, KernelOrigin::Cached { .. }),
                context: c.context_time,
                kernels: Some(k),
                device: Device::Cuda(c),
            }),
            Err(e) if choice == DeviceChoice::Auto => Ok(cpu(Some(format!(
                "{} is there, but its kernels are not: {e}",
                c.name
            )))),
            Err(e) => Err(e),
        }
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether its trainers augment on the device
    /// ([`Trainer::augment_on_device`]): on CUDA; the CPU's loader augments in its
    /// workers.
    pub fn augments_on_device(&self) -> bool {
        matches!(self.device, Device::Cuda(_))
    }

    /// The host allocator the loader's buffers should come from: page-locked memory of
    /// `kind` on CUDA, `None` (the loader's default) on the CPU.
    pub fn allocator(&self, kind: PinnedKind) -> Option<Arc<dyn HostAlloc>> {
        match &self.device {
            Device::Cuda(c) => Some(Arc::new(PinnedAlloc::new(Arc::clone(&c.ctx), kind))),
            Device::Cpu { .. } => None,
        }
    }

    /// A trainer of `mlp` (inputs normalised by `norm`) on batches of `layout`, reading
    /// inputs from column `columns.0` and labels from `columns.1`.
    ///
    /// # Errors
    /// [`Error::Config`] for columns the model cannot read; [`Error::Cuda`] when device
    /// memory or streams cannot be had.
    pub fn trainer(
        &self,
        mlp: Mlp,
        norm: Normalize,
        layout: &BatchLayout,
        columns: (usize, usize),
    ) -> Result<Box<dyn Trainer>> {
        Ok(match (&self.device, &self.kernels) {
            (Device::Cuda(c), Some(k)) => Box::new(CudaTrainer::new(
                c.clone(),
                k.clone(),
                &mlp,
                norm,
                layout,
                columns,
                4,
            )?),
            _ => Box::new(CpuTrainer::new(mlp, norm, layout, columns, 3)?),
        })
    }
}
