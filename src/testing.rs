//! Internals that stokehold's own tests and GPU scripts check, exposed here alone: they
//! are not part of the API and may change in any release.

pub use crate::cuda::kernels::{cache_dir, compile_options, elf_complete, SOURCE};
pub use crate::cuda::nvrtc::candidates as nvrtc_candidates;

/// Says why a cold-data test measures nothing here (no eviction, no `O_DIRECT`, no
/// storage counters); with `STOKEHOLD_REQUIRE_COLD=1` (set by CI, whose machines have
/// them all), fails instead.
///
/// # Panics
/// With `STOKEHOLD_REQUIRE_COLD=1`.
pub fn skip_cold(why: &str) {
    if std::env::var_os("STOKEHOLD_REQUIRE_COLD").is_some_and(|v| v == "1") {
        panic!("{why}, and STOKEHOLD_REQUIRE_COLD=1 forbids skipping");
    }
    eprintln!("skipped: {why}");
}

/// The alignment the loader's direct reads of the file at `path` use (offsets and
/// lengths), or `None` where it cannot be read with `O_DIRECT` (tmpfs, for one).
pub fn direct_align(path: &std::path::Path) -> Option<u64> {
    crate::loader::direct_align(path)
}
