//! Choosing where the training step runs: CUDA when it is all there, else the CPU.

use crate::cuda::{self, Cuda};
use crate::error::{Error, Result};

/// What the user asked for (`--device auto|cuda|cpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
pub enum DeviceChoice {
    /// CUDA when libcuda, a device and NVRTC are all there; the CPU otherwise.
    #[default]
    Auto,
    /// CUDA, or an error saying what is missing.
    Cuda,
    /// The CPU backend.
    Cpu,
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
            DeviceChoice::Cuda => cuda::probe().map(Device::Cuda).map_err(Error::Cuda),
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
