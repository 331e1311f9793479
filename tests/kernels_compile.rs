//! `kernels/mlp.cu` and `kernels/augment.cu` through the real NVRTC, for the architectures stokehold supports. NVRTC
//! needs no GPU, so this runs wherever the library is found (`.ci/run` fetches it from
//! PyPI when it can); elsewhere it prints why it skips.

mod common;

use stokehold::cuda::Nvrtc;
use stokehold::testing::{compile_options, elf_complete, SOURCE};

/// The kernels every build must export (what `Kernels::load` looks up).
const ENTRIES: [&str; 5] = [
    "forward_partial",
    "row_tail",
    "update",
    "scatter_rows",
    "gather_rows",
];

fn nvrtc() -> Option<Nvrtc> {
    match Nvrtc::load() {
        Ok(n) => {
            println!(
                "NVRTC {:?} from {}, builtins {:?}",
                n.version(),
                n.path(),
                n.builtins()
            );
            // NVRTC 13.0 finds its builtins only on the loader's path: stokehold loads them
            // from NVRTC's own directory (CI runs this with a pip NVRTC 13.0, no
            // LD_LIBRARY_PATH).
            let (major, minor) = n.version();
            let dir = std::path::Path::new(n.path()).parent();
            let beside = dir.map(|d| d.join(format!("libnvrtc-builtins.so.{major}.{minor}")));
            if beside.as_ref().is_some_and(|p| p.exists()) {
                assert!(
                    n.builtins().is_some(),
                    "builtins beside {} not loaded",
                    n.path()
                );
            }
            Some(n)
        }
        Err(reason) => {
            // CI names the NVRTC it fetched: one that then fails to load is a failure.
            if let Some(named) = std::env::var_os("STOKEHOLD_NVRTC") {
                panic!("STOKEHOLD_NVRTC={named:?} did not load: {reason}");
            }
            common::skip_gpu(&format!("the NVRTC compile check: {reason}"));
            None
        }
    }
}

#[test]
fn the_kernels_compile_to_cubin_for_every_supported_architecture() {
    let Some(nv) = nvrtc() else { return };
    // Every architecture this NVRTC builds for, from Pascal (the oldest stokehold accepts).
    let archs: Vec<(i32, i32)> = nv
        .supported_archs()
        .into_iter()
        .filter(|a| *a >= (6, 0))
        .collect();
    println!("architectures: {archs:?}");
    assert!(
        archs.contains(&(9, 0)),
        "NVRTC {:?} without sm_90",
        nv.version()
    );
    for arch in archs {
        let cubin = nv
            .compile_cubin(SOURCE, "mlp.cu", &compile_options(arch, true))
            .unwrap_or_else(|e| panic!("sm_{}{}: {e}", arch.0, arch.1));
        // Whole as the kernel cache checks it, and a truncated copy not.
        let (maj, min) = arch;
        assert!(elf_complete(&cubin), "sm_{maj}{min}: not a whole ELF");
        assert!(!elf_complete(&cubin[..cubin.len() - 1]), "sm_{maj}{min}");
        for name in ENTRIES {
            assert!(
                cubin.windows(name.len()).any(|w| w == name.as_bytes()),
                "sm_{}{}: {name} missing from the cubin",
                arch.0,
                arch.1
            );
        }
    }
}

#[test]
fn the_kernels_compile_to_ptx_with_every_entry() {
    let Some(nv) = nvrtc() else { return };
    let ptx = nv
        .compile(SOURCE, "mlp.cu", &compile_options((9, 0), false))
        .unwrap();
    for name in ENTRIES {
        assert!(
            ptx.contains(&format!(".entry {name}(")),
            "{name} missing from the PTX"
        );
    }
}

#[test]
fn the_augmentation_kernel_compiles_for_every_supported_architecture() {
    let Some(nv) = nvrtc() else { return };
    let src = stokehold::cuda::AUGMENT.source;
    for arch in nv.supported_archs().into_iter().filter(|a| *a >= (6, 0)) {
        let cubin = nv
            .compile_cubin(src, "augment.cu", &compile_options(arch, true))
            .unwrap_or_else(|e| panic!("sm_{}{}: {e}", arch.0, arch.1));
        assert!(
            elf_complete(&cubin),
            "sm_{}{}: not a whole ELF",
            arch.0,
            arch.1
        );
        assert!(cubin.windows(14).any(|w| w == b"augment_images"));
    }
    let ptx = nv
        .compile(src, "augment.cu", &compile_options((9, 0), false))
        .unwrap();
    assert!(
        ptx.contains(".entry augment_images("),
        "augment_images missing from the PTX"
    );
}

#[test]
fn a_broken_kernel_reports_the_compiler_log() {
    let Some(nv) = nvrtc() else { return };
    let err = nv
        .compile(
            "extern \"C\" __global__ void k(float* x) { x[0] = undeclared; }",
            "broken.cu",
            &compile_options((9, 0), false),
        )
        .unwrap_err();
    assert!(err.contains("broken.cu"), "{err}");
    assert!(err.contains("undeclared"), "{err}");
}
