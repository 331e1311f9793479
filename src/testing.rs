//! Internals that stokehold's own tests and GPU scripts check, exposed here alone: they
//! are not part of the API and may change in any release.

pub use crate::cuda::kernels::{cache_dir, compile_options, elf_complete, SOURCE};
pub use crate::cuda::nvrtc::candidates as nvrtc_candidates;
