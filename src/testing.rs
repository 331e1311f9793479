//! Internals that stokehold's own tests and GPU scripts check, exposed here alone: they
//! are not part of the API and may change in any release.

pub use crate::cuda::kernels::{cache_dir, compile_options, elf_complete, SOURCE};
pub use crate::cuda::nvrtc::candidates as nvrtc_candidates;

/// The alignment the loader's direct reads of the file at `path` use (offsets and
/// lengths), or `None` where it cannot be read with `O_DIRECT` (tmpfs, for one).
pub fn direct_align(path: &std::path::Path) -> Option<u64> {
    crate::loader::direct_align(path)
}
