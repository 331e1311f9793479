//! Backend selection never panics, and says why it falls back.

mod common;

use stokehold::device::{Device, DeviceChoice};
use stokehold::Error;

#[test]
fn auto_picks_cuda_or_says_why_not() {
    match Device::auto() {
        Device::Cuda(c) => {
            println!(
                "CUDA: {} sm_{}{}, NVRTC {:?}",
                c.name,
                c.arch.0,
                c.arch.1,
                c.nvrtc.version()
            );
            assert!(Device::select(DeviceChoice::Cuda).is_ok());
        }
        Device::Cpu { reason } => {
            let reason = reason.expect("auto gives a reason for the CPU");
            common::skip_gpu(&reason);
            assert!(
                reason.starts_with("no libcuda found")
                    || reason.starts_with("no CUDA device")
                    || reason.starts_with("NVRTC not found"),
                "{reason}"
            );
            // Asking for CUDA where there is none is an error with the same reason.
            match Device::select(DeviceChoice::Cuda) {
                Err(Error::Cuda {
                    code: None,
                    message,
                }) => assert_eq!(message, reason),
                other => panic!("expected a CUDA error, got {other:?}"),
            }
        }
    }
    let cpu = Device::select(DeviceChoice::Cpu).unwrap();
    assert!(cpu.fallback_reason().is_none());
    assert!(cpu.name().starts_with("cpu"));
}

#[test]
fn nvrtc_search_names_every_major_version() {
    let c = stokehold::testing::nvrtc_candidates();
    for name in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"] {
        assert!(c.iter().any(|p| p == name), "{name} not searched: {c:?}");
    }
}

#[test]
fn a_required_gpu_cannot_be_skipped() {
    // This file's first test, rerun with STOKEHOLD_REQUIRE_GPU=1: where it would skip (no
    // usable GPU), it fails instead, naming the variable; with a GPU it passes.
    if std::env::var_os("STOKEHOLD_REQUIRE_GPU").is_some() {
        return; // the child itself, or a GPU run: nothing more to check here
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["auto_picks_cuda_or_says_why_not", "--exact", "--nocapture"])
        .env("STOKEHOLD_REQUIRE_GPU", "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    match Device::auto() {
        Device::Cuda(_) => assert!(out.status.success(), "{text}"),
        Device::Cpu { .. } => {
            assert!(
                !out.status.success(),
                "a skip passed with the GPU required:\n{text}"
            );
            assert!(text.contains("STOKEHOLD_REQUIRE_GPU=1"), "{text}");
        }
    }
}
