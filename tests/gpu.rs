//! GPU checks on a real device. Each prints why it skips where no usable CUDA device is
//! found, and fails instead with `STOKEHOLD_REQUIRE_GPU=1` (the GPU run scripts set it); `tests/emulated.rs` runs the same checks on stokehold's CPU emulator of the
//! driver, everywhere.

mod common;
mod gpu_checks;

use stokehold::cuda::Cuda;
use stokehold::device::Device;

/// Runs `check` on the GPU, or prints why there is none.
fn on_gpu(check: impl FnOnce(Cuda)) {
    if let Some(c) = cuda() {
        check(c);
    }
}

fn cuda() -> Option<Cuda> {
    match Device::auto() {
        Device::Cuda(c) if c.name.contains("stokehold CUDA emulator") => {
            common::skip_gpu("the emulator is loaded, not a GPU");
            None
        }
        Device::Cuda(c) => {
            println!("GPU: {} (sm_{}{})", c.name, c.arch.0, c.arch.1);
            Some(c)
        }
        Device::Cpu { reason } => {
            common::skip_gpu(&reason.unwrap_or_default());
            None
        }
    }
}

#[test]
fn first_step_matches_the_cpu_backend() {
    on_gpu(gpu_checks::first_step_matches_the_cpu_backend);
}

#[test]
fn odd_shapes_match_the_cpu_backend() {
    on_gpu(gpu_checks::odd_shapes_match_the_cpu_backend);
}

#[test]
fn digits_reach_90_percent_on_the_gpu() {
    on_gpu(gpu_checks::digits_reach_90_percent_on_the_gpu);
}

#[test]
fn a_generated_set_reaches_95_percent_on_the_gpu() {
    on_gpu(|c| gpu_checks::a_generated_set_reaches_95_percent_on_the_gpu(c, 20_000, &[3, 32, 32]));
}

#[test]
fn the_device_cache_gives_the_same_epochs() {
    on_gpu(gpu_checks::the_device_cache_gives_the_same_epochs);
}

#[test]
fn overlapped_epochs_match_the_cpu_backend() {
    on_gpu(|c| gpu_checks::epochs_match_the_cpu_backend(c, false));
}

#[test]
fn serialised_epochs_match_the_cpu_backend() {
    on_gpu(|c| gpu_checks::epochs_match_the_cpu_backend(c, true));
}

#[test]
fn the_kernel_cache_survives_damage() {
    on_gpu(gpu_checks::the_kernel_cache_survives_damage);
}

#[test]
fn partial_and_failing_epochs() {
    on_gpu(gpu_checks::partial_and_failing_epochs);
}

#[test]
fn lent_batches_wait_for_their_consumers() {
    on_gpu(gpu_checks::lent_batches_wait_for_their_consumers);
}

#[test]
fn a_batch_used_on_another_threads_default_stream_waits_for_it() {
    on_gpu(gpu_checks::a_batch_used_on_another_threads_default_stream_waits_for_it);
}

#[test]
fn a_slot_wait_stops_for_its_interrupt_check() {
    on_gpu(gpu_checks::a_slot_wait_stops_for_its_interrupt_check);
}

#[test]
fn a_users_work_reads_cached_and_augmented_epochs_as_the_loader_gives_them() {
    on_gpu(gpu_checks::a_users_work_reads_cached_and_augmented_epochs_as_the_loader_gives_them);
}

#[test]
fn copies_overlapped_with_a_slow_step_are_no_stall() {
    on_gpu(gpu_checks::copies_overlapped_with_a_slow_step_are_no_stall);
}

#[test]
fn a_panic_while_an_epoch_is_captured_leaves_the_stream_usable() {
    on_gpu(gpu_checks::a_panic_while_an_epoch_is_captured_leaves_the_stream_usable);
}

#[test]
fn lent_batches_come_from_the_device_cache_as_the_loader_gives_them() {
    on_gpu(gpu_checks::lent_batches_come_from_the_device_cache_as_the_loader_gives_them);
}

#[test]
fn the_trainer_augments_on_the_device_as_the_workers_do() {
    on_gpu(gpu_checks::the_trainer_augments_on_the_device_as_the_workers_do);
}

#[test]
fn augmenting_on_the_device_matches_the_workers() {
    on_gpu(gpu_checks::augmenting_on_the_device_matches_the_workers);
}

#[test]
fn a_bad_label_is_an_error() {
    on_gpu(gpu_checks::a_bad_label_is_an_error);
}
