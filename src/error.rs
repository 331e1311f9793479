//! The crate's one error type.

use std::io;
use std::path::PathBuf;

use cudarc::driver::sys::CUresult;

/// `Result` with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in stokehold.
///
/// Errors about a file always name the file. Variants keep their underlying cause
/// reachable through [`std::error::Error::source`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system error while opening, mapping or advising a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A `.npy` file that stokehold cannot read; the problem says why.
    #[error("{path}: {problem}")]
    Npy {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: NpyProblem,
    },
    /// A dataset that cannot be assembled from otherwise valid files.
    #[error("{path}: {problem}")]
    Dataset {
        /// The file (or directory) at fault.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A builder or call argument that is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Rank and world size could not be read from the environment.
    #[error("shard from environment: {0}")]
    Shard(String),
    /// A sample index outside the dataset.
    #[error("sample index {index} is out of range for a dataset of {len} rows")]
    OutOfRange {
        /// The index asked for.
        index: u64,
        /// The dataset's length.
        len: u64,
    },
    /// A column read with an element type that does not match its dtype.
    #[error("column {column} holds {actual}, not {asked}")]
    DType {
        /// The column's name.
        column: String,
        /// Its dtype.
        actual: &'static str,
        /// The element type asked for.
        asked: &'static str,
    },
    /// A worker thread panicked while assembling a batch.
    #[error("worker {worker} panicked while assembling batch {batch} of epoch {epoch}: {message}")]
    WorkerPanic {
        /// The worker's number.
        worker: usize,
        /// The epoch.
        epoch: u64,
        /// The batch number within the epoch.
        batch: u64,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// The thread asking for the next batch holds every host buffer and released none
    /// for a second, and no batch of the loader was ever read or dropped on another
    /// thread: waiting would never end.
    #[error(
        "all {buffers} host buffers are held by the consumer; drop a batch before asking \
         for the next one, or raise `held` on the loader builder"
    )]
    PoolExhausted {
        /// The pool's size.
        buffers: usize,
    },
    /// Every device slot is lent to a batch still alive, none was released for a
    /// second, and no batch of the slots was ever used or dropped on another thread:
    /// waiting would never end.
    #[error(
        "all {slots} device slots are held by live batches; drop a batch (and the tensors \
         viewing it) before asking for the next one, or lend more slots (`held`)"
    )]
    SlotsExhausted {
        /// The slots.
        slots: usize,
    },
    /// The copy of an earlier batch to the device was not seen to complete: a later
    /// lend (or a drain) found the wait for it failing, and took no slot, its own batch
    /// going back to the pool. A fault on the device, in a copy or in any other work of
    /// the context, leaves every later call failing (CUDA's sticky errors): the batch
    /// named is the oldest whose copy was still in flight, so that a resume from it
    /// repeats at most one batch whose copy was done, and loses none.
    #[error("waiting for the copy of batch {batch} of epoch {epoch} to the device: {message}")]
    CopyFailed {
        /// The epoch of the batch whose copy failed.
        epoch: u64,
        /// Its number in the epoch.
        batch: u64,
        /// The driver's error code (`CUresult`), as in [`Error::Cuda`].
        code: Option<u32>,
        /// The driver's error.
        message: String,
    },
    /// An [`Epoch`](crate::Epoch) iterator was leaked (`mem::forget`) instead of
    /// dropped: the buffers it held never come back, so the loader refuses new epochs
    /// rather than wait for them forever.
    #[error(
        "the iterator of epoch {epoch} was leaked (mem::forget) with the buffers it held; \
         this loader cannot start another epoch: build a new one"
    )]
    EpochLeaked {
        /// The leaked epoch.
        epoch: u64,
    },
    /// A label outside the classifier's classes.
    #[error("label {label} is outside 0..{classes}{}", match sample { Some(s) => format!(" (sample {s})"), None => String::new() })]
    Label {
        /// The label.
        label: i64,
        /// The number of classes.
        classes: usize,
        /// The dataset index of the sample, when known.
        sample: Option<u64>,
    },
    /// The CUDA backend was asked for and is not available, or a CUDA call failed.
    /// [`context_lost`](Error::context_lost) tells whether the context can go on.
    #[error("CUDA: {message}")]
    Cuda {
        /// The driver's error code (`CUresult`, `700` for `CUDA_ERROR_ILLEGAL_ADDRESS`)
        /// when a driver call failed; `None` for a failure of another kind (no driver,
        /// NVRTC's log, no image for the device).
        code: Option<u32>,
        /// The driver's name for the error and its description, or what failed.
        message: String,
    },
    /// The loader's workers stopped without delivering a batch (a worker thread died).
    #[error("the loader's workers stopped without delivering batch {batch}")]
    WorkersStopped {
        /// The batch that never came.
        batch: u64,
    },
    /// A wait for a batch, or for a device slot, was stopped by its interrupt check
    /// ([`Epoch::interrupt_with`](crate::Epoch::interrupt_with),
    /// `cuda::DeviceSlots::interrupt_with`); the epoch goes on, and nothing was taken.
    #[error("the wait for a batch or a device slot was interrupted")]
    Interrupted,
    /// A host buffer could not be allocated.
    #[error("allocating a {bytes}-byte host buffer ({allocator}): {message}")]
    Alloc {
        /// Bytes asked for.
        bytes: usize,
        /// The allocator's name.
        allocator: &'static str,
        /// Why it failed.
        message: String,
    },
}

/// Why a `.npy` file was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NpyProblem {
    /// The file does not start with `\x93NUMPY`.
    #[error("not a .npy file (bad magic)")]
    BadMagic,
    /// A format version other than 1.0, 2.0 or 3.0.
    #[error("unsupported .npy format version {0}.{1}")]
    Version(u8, u8),
    /// The header is not the dictionary NumPy writes.
    #[error("header does not parse: {0}")]
    Header(String),
    /// `fortran_order: True`.
    #[error("Fortran-ordered arrays are not supported (save with np.ascontiguousarray)")]
    FortranOrder,
    /// A big-endian dtype such as `>f4`.
    #[error("big-endian dtype {0:?} is not supported (convert with arr.astype(arr.dtype.newbyteorder('<')))")]
    BigEndian(String),
    /// A dtype stokehold does not read: object, structured, string, complex...
    #[error("unsupported dtype {0}")]
    DType(String),
    /// A 0-d array (shape `()`): there is no sample axis.
    #[error("0-d array (shape ()): there is no sample axis")]
    ZeroDim,
    /// The shape's byte size does not fit in 64 bits.
    #[error("shape {0} overflows a 64-bit byte size")]
    Overflow(String),
    /// The file is shorter than its header says.
    #[error("truncated: the header promises {expected} data bytes, the file holds {actual}")]
    Truncated {
        /// Data bytes the header implies.
        expected: u64,
        /// Data bytes present.
        actual: u64,
    },
    /// Bytes past the end of the data.
    #[error("{extra} unexpected bytes past the end of the data")]
    TrailingBytes {
        /// How many.
        extra: u64,
    },
}

impl From<cudarc::driver::DriverError> for Error {
    /// A failed CUDA driver call, as [`Error::Cuda`] with the driver's name for the error
    /// and its description (`CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was
    /// encountered`), and for an error that loses the context
    /// ([`context_lost`](Error::context_lost)), a word saying so.
    fn from(e: cudarc::driver::DriverError) -> Self {
        let said = match (e.error_name(), e.error_string()) {
            (Ok(name), Ok(text)) if name != text => {
                format!("{}: {}", name.to_string_lossy(), text.to_string_lossy())
            }
            (Ok(name), _) => name.to_string_lossy().into_owned(),
            _ => format!("CUresult {}", e.0 as u32),
        };
        let message = match CONTEXT_LOST.contains(&e.0) {
            true => format!(
                "{said} (the CUDA context is lost: every later CUDA call in this process \
                 fails; resume in a new one)"
            ),
            false => said,
        };
        Error::Cuda {
            code: Some(e.0 as u32),
            message,
        }
    }
}

/// The driver's errors after which its context is unusable: a fault in a kernel or a
/// copy (CUDA's sticky errors, returned by every later call of the context), a context
/// destroyed or a driver shut down. Only a new process gets a working context.
const CONTEXT_LOST: [CUresult; 12] = [
    CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
    CUresult::CUDA_ERROR_LAUNCH_FAILED,
    CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION,
    CUresult::CUDA_ERROR_MISALIGNED_ADDRESS,
    CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE,
    CUresult::CUDA_ERROR_INVALID_PC,
    CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR,
    CUresult::CUDA_ERROR_ASSERT,
    CUresult::CUDA_ERROR_ECC_UNCORRECTABLE,
    CUresult::CUDA_ERROR_LAUNCH_TIMEOUT,
    CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED,
    CUresult::CUDA_ERROR_DEINITIALIZED,
];

impl Error {
    /// The [`Error::CopyFailed`] of batch `batch` of `epoch`, whose wait failed with
    /// `failed` (its driver code and message kept).
    pub(crate) fn copy_failed(epoch: u64, batch: u64, failed: Error) -> Self {
        let code = failed.cuda_code();
        let message = match failed {
            Error::Cuda { message, .. } => message,
            other => other.to_string(),
        };
        Error::CopyFailed {
            epoch,
            batch,
            code,
            message,
        }
    }

    /// An [`Error::Cuda`] that is no driver call's (`code: None`).
    pub fn cuda(message: impl Into<String>) -> Self {
        Error::Cuda {
            code: None,
            message: message.into(),
        }
    }

    /// The driver's error code (`CUresult`) of a failed CUDA call: [`Error::Cuda`] or
    /// [`Error::CopyFailed`] from the driver; `None` for any other error.
    pub fn cuda_code(&self) -> Option<u32> {
        match *self {
            Error::Cuda { code, .. } | Error::CopyFailed { code, .. } => code,
            _ => None,
        }
    }

    /// Whether the CUDA context is lost: a fault on the device (an illegal address in
    /// a kernel, a copy from a bad pointer), an uncorrectable ECC error, a destroyed
    /// context. The driver then fails every later call of the context, in this
    /// process, for every library sharing it (PyTorch's included): save what the
    /// loader's state says, and resume in a new process. Any other error (a full
    /// device, a bad argument, a file) leaves the context usable.
    pub fn context_lost(&self) -> bool {
        self.cuda_code()
            .is_some_and(|code| CONTEXT_LOST.iter().any(|&lost| lost as u32 == code))
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn npy(path: impl Into<PathBuf>, problem: NpyProblem) -> Self {
        Error::Npy {
            path: path.into(),
            problem,
        }
    }

    pub(crate) fn dataset(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Error::Dataset {
            path: path.into(),
            problem: problem.into(),
        }
    }
}
