//! The CUDA path without a GPU: the checks of `tests/gpu.rs`, `stokehold train` and
//! `stokehold bench` on the CUDA backend, and the CUDA example, run against stokehold's CPU
//! emulator of the CUDA driver and NVRTC (`tests/emu`).
//!
//! The emulator runs the real kernels (`kernels/mlp.cu`, built as host C++), with one
//! thread per stream, events ordered by record, and asynchronous copies that read their
//! pinned source when they run. It checks ordering, arguments and results, not speed:
//! figures measured on it mean nothing and none is reported.
//!
//! cudarc opens libcuda once per process, so each check runs in a child process (this
//! same test binary) started with the emulator on its library path. The emulator is built
//! with the system C++ compiler; where there is none, the tests say so and skip.

mod common;
mod gpu_checks;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, OnceLock};

use common::DIGITS;
use stokehold::cuda::Cuda;
use stokehold::device::Device;

const EMU: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/emu");
const CHILD: &str = "STOKEHOLD_EMU_CHILD";

fn cxx() -> String {
    std::env::var("STOKEHOLD_EMU_CXX").unwrap_or_else(|_| "c++".into())
}

/// Builds the emulator's two libraries once per run of this binary.
fn build() -> Result<PathBuf, String> {
    let cxx = cxx();
    if Command::new(&cxx).arg("--version").output().is_err() {
        return Err(format!(
            "no C++ compiler ({cxx}) to build the CUDA emulator"
        ));
    }
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("emu-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(&cxx)
            .args(["-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Werror"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "building the emulator failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let lib = dir.join("libcuda.so.1");
    run(&[
        "-o",
        lib.to_str().unwrap(),
        &format!("{EMU}/cuda.cpp"),
        "-ldl",
        "-lpthread",
    ]);
    let _ = std::fs::remove_file(dir.join("libcuda.so"));
    std::os::unix::fs::symlink("libcuda.so.1", dir.join("libcuda.so")).unwrap();
    run(&[
        &format!("-DEMU_PRELUDE=\"{EMU}/prelude.h\""),
        "-o",
        dir.join("libnvrtc.so").to_str().unwrap(),
        &format!("{EMU}/nvrtc.cpp"),
    ]);
    Ok(dir)
}

fn emulator() -> Option<&'static Path> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BUILT.get_or_init(build) {
        Ok(dir) => Some(dir),
        Err(reason) => skip(reason),
    }
}

/// Skips a check that cannot run here, saying why; under `STOKEHOLD_REQUIRE_EMULATOR=1`
/// (CI, which has a C++ compiler and its address sanitizer) fails instead, so that no
/// emulated check passes there by skipping.
fn skip<T>(reason: &str) -> Option<T> {
    if std::env::var_os("STOKEHOLD_REQUIRE_EMULATOR").is_some_and(|v| v == "1") {
        panic!("STOKEHOLD_REQUIRE_EMULATOR=1, but {reason}");
    }
    println!("skipping: {reason}");
    None
}

/// `cmd` with the emulator in place of libcuda and NVRTC, its own kernel cache, and
/// `jitter_us` of random delay before each device operation.
fn with_emulator<'a>(cmd: &'a mut Command, dir: &Path, jitter_us: u32) -> &'a mut Command {
    cmd.env("LD_LIBRARY_PATH", dir)
        .env("STOKEHOLD_NVRTC", dir.join("libnvrtc.so"))
        .env("STOKEHOLD_CACHE", dir.join("kernel-cache"))
        .env("TMPDIR", dir.join("tmp"))
        .env("STOKEHOLD_EMU_JITTER_US", jitter_us.to_string())
}

/// Runs `cmd` to its end and collects its output, or kills it after five minutes and
/// fails with what it printed: a hang in the emulator or the CUDA path is a failure,
/// not a stuck CI run.
fn output_within(cmd: &mut Command) -> Output {
    use std::io::Read;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    const LIMIT: Duration = Duration::from_secs(300);
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let (status, hung) = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break (status, false);
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            break (child.wait().unwrap(), true);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    };
    assert!(
        !hung,
        "killed after {LIMIT:?}: {:?}\n{}",
        cmd,
        shown(&output)
    );
    output
}

fn shown(out: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The address sanitizer's runtime, for checking the kernels' memory accesses; `None`
/// (with the reason printed) where the compiler has none.
fn asan_runtime() -> Option<PathBuf> {
    let out = Command::new(cxx())
        .arg("-print-file-name=libasan.so")
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if path.is_absolute() && path.exists() {
        Some(path)
    } else {
        skip(&format!("{} has no address sanitizer runtime", cxx()))
    }
}

/// How a child runs: its stream jitter, whether the kernels are built with the address
/// sanitizer (every device allocation is then bounds-checked), which host-to-device
/// copy, if any, faults on the device (from 1; 0 for none), and whether the stream
/// order goes unchecked (`STOKEHOLD_EMU_RACES=0`, for the checks made when work runs).
#[derive(Clone, Copy, Default)]
struct Mode {
    jitter_us: u32,
    asan: bool,
    faulting_copy: u32,
    unordered: bool,
}

/// Runs `check` on the emulated device: in the child, directly; in the parent, by
/// starting the child for test `name` and requiring that it ran and passed.
fn emulated(name: &str, jitter_us: u32, check: impl FnOnce(Cuda)) {
    let mode = Mode {
        jitter_us,
        ..Mode::default()
    };
    passes_in_child(name, mode, check);
}

/// [`emulated`] in any mode: the child ran test `name` and passed.
fn passes_in_child(name: &str, mode: Mode, check: impl FnOnce(Cuda)) {
    if let Some(out) = in_child(name, mode, check) {
        assert!(out.status.success(), "{name} failed on the emulator");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "{name} did not run in the child"
        );
    }
}

/// The child for test `name` must fail, saying `report` on stderr: a check of the
/// emulator's own checks.
fn fails_in_child(name: &str, mode: Mode, report: &str, check: impl FnOnce(Cuda)) {
    if let Some(out) = in_child(name, mode, check) {
        assert!(!out.status.success(), "{name}: the fault went unnoticed");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(report),
            "{name}: no {report:?} on stderr"
        );
    }
}

/// In the child: runs `check` and returns `None`. In the parent: starts the child for
/// test `name` and returns its output (`None` when the emulator cannot be had here).
fn in_child(name: &str, mode: Mode, check: impl FnOnce(Cuda)) -> Option<Output> {
    if std::env::var_os(CHILD).is_some() {
        let c = match Device::auto() {
            Device::Cuda(c) => c,
            Device::Cpu { reason } => panic!("the emulator did not load: {reason:?}"),
        };
        assert!(
            c.name.contains("stokehold CUDA emulator"),
            "not the emulator: {}",
            c.name
        );
        check(c);
        return None;
    }
    let dir = emulator()?;
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1");
    with_emulator(&mut cmd, dir, mode.jitter_us);
    if mode.faulting_copy > 0 {
        cmd.env(
            "STOKEHOLD_EMU_FAIL_HTOD_LATE",
            mode.faulting_copy.to_string(),
        );
    }
    if mode.unordered {
        cmd.env("STOKEHOLD_EMU_RACES", "0");
    }
    if mode.asan {
        let runtime = asan_runtime()?;
        cmd.env("LD_PRELOAD", runtime)
            .env("ASAN_OPTIONS", "detect_leaks=0")
            .env("STOKEHOLD_EMU_CXXFLAGS", "-fsanitize=address -g")
            // Kernels built with the sanitizer get their own cache.
            .env("STOKEHOLD_CACHE", dir.join("kernel-cache-asan"));
    }
    let out = output_within(&mut cmd);
    println!("{}", shown(&out));
    Some(out)
}

#[test]
fn the_kernels_stay_inside_their_buffers() {
    // The step (at odd shapes too), the device cache's scatter and gather, and a bad
    // label's early return,
    // with every device allocation bounds-checked by the address sanitizer.
    let name = "the_kernels_stay_inside_their_buffers";
    let mode = Mode {
        jitter_us: 20,
        asan: true,
        ..Mode::default()
    };
    passes_in_child(name, mode, |c| {
        gpu_checks::odd_shapes_match_the_cpu_backend(c.clone());
        gpu_checks::the_device_cache_gives_the_same_epochs(c.clone());
        gpu_checks::a_bad_label_is_an_error(c);
    });
}

/// `src` built by the emulated NVRTC as a cubin for the emulated device (sm_90) and
/// loaded into `c`'s context.
fn module(c: &Cuda, src: &str, name: &str) -> Arc<cudarc::driver::CudaModule> {
    let options = ["--gpu-architecture=sm_90".to_string()];
    let cubin = c.nvrtc.compile_cubin(src, name, &options).unwrap();
    c.ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
        .unwrap()
}

#[test]
fn the_address_sanitizer_catches_a_kernel_writing_past_its_buffer() {
    // The check above can fail: one float written past a 1000-float allocation.
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let name = "the_address_sanitizer_catches_a_kernel_writing_past_its_buffer";
    let mode = Mode {
        jitter_us: 0,
        asan: true,
        ..Mode::default()
    };
    fails_in_child(name, mode, "heap-buffer-overflow", |c| {
        let src = "extern \"C\" __global__ void past(float* x, int n) {\n\
                   int i = blockIdx.x * blockDim.x + threadIdx.x;\n\
                   if (i <= n) x[i] = 1.0f;\n}\n";
        let f = module(&c, src, "past.cu").load_function("past").unwrap();
        let stream = c.ctx.new_stream().unwrap();
        let mut x = stream.alloc_zeros::<f32>(1000).unwrap();
        let n = 1000i32;
        let mut l = stream.launch_builder(&f);
        l.arg(&mut x).arg(&n);
        // SAFETY: none: this kernel writes x[1000], past the allocation, on purpose.
        unsafe { l.launch(LaunchConfig::for_num_elems(1024)) }.unwrap();
        stream.synchronize().unwrap();
    });
}

#[test]
fn the_emulator_catches_a_kernel_using_freed_memory() {
    // Freed device memory stays poisoned a while: a kernel handed a pointer into it (a
    // stream that did not wait for another's free) is an error, not a read of stale heap.
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let name = "the_emulator_catches_a_kernel_using_freed_memory";
    fails_in_child(name, Mode::default(), "after it was freed", |c| {
        let src = "extern \"C\" __global__ void touch(float* x) { x[0] = 1.0f; }\n";
        let f = module(&c, src, "touch.cu").load_function("touch").unwrap();
        let stream = c.ctx.new_stream().unwrap();
        // SAFETY: none: the point is the use after the free.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(4096) }.unwrap();
        // SAFETY: as above.
        unsafe { cudarc::driver::result::free_sync(ptr) }.unwrap();
        let mut l = stream.launch_builder(&f);
        l.arg(&ptr);
        // SAFETY: none, as above.
        unsafe { l.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
        stream.synchronize().unwrap();
    });
}

/// A host function that holds its stream back 100 ms: the work after it runs late.
unsafe extern "C" fn late(_: *mut std::ffi::c_void) {
    std::thread::sleep(std::time::Duration::from_millis(100));
}

/// `n` pinned bytes, each 1, in the current context; never freed unless the caller
/// frees them (`result::free_host`).
fn pinned_ones(n: usize) -> &'static mut [u8] {
    // SAFETY: a fresh pinned allocation of `n` bytes, which nothing else refers to.
    let bytes = unsafe {
        let p = cudarc::driver::result::malloc_host(n, 0).unwrap();
        std::slice::from_raw_parts_mut(p.cast::<u8>(), n)
    };
    bytes.fill(1);
    bytes
}

#[test]
fn the_emulator_catches_a_pinned_buffer_written_before_its_copy_ran() {
    // The race a loader must never have: a pinned buffer refilled while its asynchronous
    // copy waits on the stream. Caught by the buffer's hash, whatever was written.
    use cudarc::driver::result;
    let name = "the_emulator_catches_a_pinned_buffer_written_before_its_copy_ran";
    let report = "after their cuMemcpyHtoDAsync was enqueued and before it ran";
    fails_in_child(name, Mode::default(), report, |c| {
        let stream = c.ctx.new_stream().unwrap();
        let dst = stream.alloc_zeros::<u8>(4096).unwrap();
        let bytes = pinned_ones(4096);
        // SAFETY: the host function takes no argument; the copy's source and destination
        // hold 4096 bytes. The write after it is the race under test.
        unsafe {
            result::stream::launch_host_function(stream.cu_stream(), late, std::ptr::null_mut())
                .unwrap();
            let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&dst, &stream);
            result::memcpy_htod_async(ptr, &bytes[..], stream.cu_stream()).unwrap();
        }
        bytes[7] = 2;
        stream.synchronize().unwrap();
    });
}

#[test]
fn the_emulator_finds_only_kernels_with_c_linkage() {
    // A real module names a kernel without `extern "C"` by its mangled name: looked up
    // by its plain name, it is not found. The emulator's must not be kinder.
    emulated("the_emulator_finds_only_kernels_with_c_linkage", 0, |c| {
        let src = "extern \"C\" {\n__global__ void in_block(float* x) { x[0] = 2.0f; }\n}\n\
                   __global__ void mangled(float* x) { x[0] = 1.0f; }\n\
                   extern \"C\" __global__ void plain(float* x) { x[0] = 3.0f; }\n";
        let module = module(&c, src, "linkage.cu");
        assert!(module.load_function("plain").is_ok());
        assert!(module.load_function("in_block").is_ok());
        let err = module.load_function("mangled").unwrap_err();
        assert!(format!("{err:?}").contains("NOT_FOUND"), "{err:?}");
    });
}

#[test]
fn the_emulator_holds_kernels_to_their_launch_bounds() {
    // A block larger than a kernel's `__launch_bounds__` does not launch on a GPU (too
    // many resources requested), and the kernel says how many threads it takes.
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    emulated(
        "the_emulator_holds_kernels_to_their_launch_bounds",
        0,
        |c| {
            let src = "extern \"C\" __global__ void __launch_bounds__(128, 2) small(float* x) {\n\
                   x[threadIdx.x] = 1.0f;\n}\n\
                   extern \"C\" __global__ void free_size(float* x) { x[threadIdx.x] = 2.0f; }\n";
            let module = module(&c, src, "bounds.cu");
            let stream = c.ctx.new_stream().unwrap();
            let mut x = stream.alloc_zeros::<f32>(1024).unwrap();
            let launch = |name: &str, threads: u32, x: &mut cudarc::driver::CudaSlice<f32>| {
                let f = module.load_function(name).unwrap();
                let mut l = stream.launch_builder(&f);
                l.arg(x);
                let cfg = LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: x holds 1024 floats, one a thread at most.
                unsafe { l.launch(cfg) }.map(|_| ())
            };
            let small = module.load_function("small").unwrap();
            assert_eq!(small.max_threads_per_block().unwrap(), 128);
            let err = launch("small", 256, &mut x).unwrap_err();
            assert!(
                format!("{err:?}").contains("LAUNCH_OUT_OF_RESOURCES"),
                "{err:?}"
            );
            launch("small", 128, &mut x).unwrap();
            launch("free_size", 1024, &mut x).unwrap();
            assert_eq!(stream.clone_dtoh(&x).unwrap()[..2], [2.0, 2.0]);
        },
    );
}

#[test]
fn the_emulator_catches_memory_used_before_its_stream_allocates_it() {
    // cuMemAllocAsync is ordered on its stream: another stream must wait for it. Without
    // cudarc's event tracking (the feeder turns it off), nothing makes it wait here. The
    // stream order says so when the copy is enqueued, however the two happen to run.
    let name = "the_emulator_catches_memory_used_before_its_stream_allocates_it";
    let report = "race: cuMemcpyHtoDAsync on stream";
    fails_in_child(name, Mode::default(), report, used_before_allocated);
}

#[test]
fn the_emulator_catches_memory_used_before_its_stream_allocates_it_when_it_runs() {
    // The same, with the stream order unchecked: the copy finds the memory not yet
    // allocated when it runs, stream a being busy zeroing 512 MB first.
    let name = "the_emulator_catches_memory_used_before_its_stream_allocates_it_when_it_runs";
    let report = "not yet allocated in stream order";
    let mode = Mode {
        unordered: true,
        ..Mode::default()
    };
    fails_in_child(name, mode, report, used_before_allocated);
}

/// Stream a allocates 4096 bytes (after zeroing 512 MB) that stream b copies into at
/// once, nothing ordering the two.
fn used_before_allocated(c: Cuda) {
    // SAFETY: none: the point is the missing order.
    unsafe { c.ctx.disable_event_tracking() };
    let (a, b) = (c.ctx.new_stream().unwrap(), c.ctx.new_stream().unwrap());
    let _busy = a.alloc_zeros::<u8>(512 << 20).unwrap();
    let mut x = a.alloc_zeros::<u8>(4096).unwrap();
    b.memcpy_htod(&[1u8; 4096], &mut x).unwrap();
    b.synchronize().unwrap();
    a.synchronize().unwrap();
}

/// The kernel of the stream-order checks: `out[0]` = the sum of `x[0..n]`.
const SUM: &str = "extern \"C\" __global__ void sum(const float* x, float* out, int n) {\n\
                   float s = 0.0f;\n\
                   for (int i = 0; i < n; ++i) s += x[i];\n\
                   out[0] = s;\n}\n";

/// How a second stream is ordered after the first's copy in [`copied_then_summed`].
#[derive(Clone, Copy)]
enum Order {
    /// Not at all.
    None,
    /// The host synchronises with the first stream.
    Host,
    /// The second stream waits for an event recorded after the copy.
    Event,
}

/// Copies 1024 ones into device memory on one stream, lets 50 ms pass (the copy is
/// long done), and sums them on another, ordered as `order` says; the sum read back.
fn copied_then_summed(c: &Cuda, order: Order) -> f32 {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let f = module(c, SUM, "sum.cu").load_function("sum").unwrap();
    // SAFETY: the streams are ordered by hand below (or, under test, not at all).
    unsafe { c.ctx.disable_event_tracking() };
    let (a, b) = (c.ctx.new_stream().unwrap(), c.ctx.new_stream().unwrap());
    let mut x = a.alloc_zeros::<f32>(1024).unwrap();
    let mut out = b.alloc_zeros::<f32>(1).unwrap();
    a.memcpy_htod(&[1.0f32; 1024], &mut x).unwrap();
    match order {
        Order::None => {}
        Order::Host => a.synchronize().unwrap(),
        Order::Event => b.wait(&a.record_event(None).unwrap()).unwrap(),
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    let n = 1024i32;
    let mut l = b.launch_builder(&f);
    l.arg(&x).arg(&mut out).arg(&n);
    // SAFETY: x holds 1024 floats and out one, as the kernel reads and writes.
    unsafe { l.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
    let sum = b.clone_dtoh(&out).unwrap()[0];
    a.synchronize().unwrap();
    sum
}

#[test]
fn the_emulator_catches_a_kernel_not_ordered_after_the_copy_it_reads() {
    // The copy ran 50 ms before the kernel was even launched, so the data is right; but
    // nothing orders the two, and a GPU may run them the other way round. The stream
    // order catches it on every run, not on the unlucky ones.
    let name = "the_emulator_catches_a_kernel_not_ordered_after_the_copy_it_reads";
    let report = "race: kernel sum on stream";
    fails_in_child(name, Mode::default(), report, |c| {
        copied_then_summed(&c, Order::None);
    });
}

#[test]
fn a_kernel_ordered_after_its_copy_by_an_event_or_the_host_passes() {
    // The check above without its fault: an event wait, or a host synchronisation.
    emulated(
        "a_kernel_ordered_after_its_copy_by_an_event_or_the_host_passes",
        0,
        |c| {
            assert_eq!(copied_then_summed(&c, Order::Event), 1024.0);
            assert_eq!(copied_then_summed(&c, Order::Host), 1024.0);
        },
    );
}

/// Copies 4096 pinned bytes to the device on a stream, then the first `second` of them
/// again, with `rewrite` writing one byte of both in between, after the host
/// synchronised with the stream if `synchronised`. The first copy is done by then
/// either way: a host function after it said so, which the emulator, as CUDA, does not
/// count as a synchronisation.
fn copied_twice(c: &Cuda, synchronised: bool, rewrite: bool, second: usize) {
    use cudarc::driver::result;
    use std::sync::atomic::{AtomicBool, Ordering};
    unsafe extern "C" fn done(flag: *mut std::ffi::c_void) {
        // SAFETY: `flag` is the AtomicBool below, alive until it is set and seen.
        unsafe { &*flag.cast::<AtomicBool>() }.store(true, Ordering::Release);
    }
    let stream = c.ctx.new_stream().unwrap();
    let dst = stream.alloc_zeros::<u8>(4096).unwrap();
    let bytes = pinned_ones(4096);
    let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&dst, &stream);
    let copied = AtomicBool::new(false);
    // SAFETY: the copies' source and destination hold 4096 bytes; the host writes the
    // source only as the test says. The host function gets the flag, which outlives it.
    unsafe {
        result::memcpy_htod_async(ptr, &bytes[..], stream.cu_stream()).unwrap();
        let flag = std::ptr::from_ref(&copied).cast_mut().cast();
        result::stream::launch_host_function(stream.cu_stream(), done, flag).unwrap();
    }
    while !copied.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
    if synchronised {
        stream.synchronize().unwrap();
    }
    if rewrite {
        bytes[7] = 2;
    }
    // SAFETY: as above.
    unsafe { result::memcpy_htod_async(ptr, &bytes[..second], stream.cu_stream()) }.unwrap();
    stream.synchronize().unwrap();
    // SAFETY: no copy reads the bytes any more, and they are not used after this.
    unsafe { result::free_host(bytes.as_mut_ptr().cast()) }.unwrap();
}

/// What the emulator says of a pinned buffer rewritten before its copy was seen done.
const REWRITTEN: &str = "race: the host rewrote the pinned bytes";

#[test]
fn the_emulator_catches_a_pinned_buffer_rewritten_before_its_copy_was_seen_done() {
    // A buffer refilled once its copy had run (a host function after it said so), but
    // before the host had synchronised with it: on a GPU the copy may still be reading
    // it. Caught when the buffer is copied again.
    let name = "the_emulator_catches_a_pinned_buffer_rewritten_before_its_copy_was_seen_done";
    fails_in_child(name, Mode::default(), REWRITTEN, |c| {
        copied_twice(&c, false, true, 4096)
    });
}

#[test]
fn the_emulator_catches_a_pinned_buffer_rewritten_then_copied_in_part() {
    // The same, copied again in part (as a short last batch is).
    let name = "the_emulator_catches_a_pinned_buffer_rewritten_then_copied_in_part";
    fails_in_child(name, Mode::default(), REWRITTEN, |c| {
        copied_twice(&c, false, true, 100)
    });
}

#[test]
fn a_pinned_buffer_rewritten_after_a_synchronisation_or_not_at_all_passes() {
    // The check above without its fault: the host synchronised first, or copies the
    // same bytes again.
    emulated(
        "a_pinned_buffer_rewritten_after_a_synchronisation_or_not_at_all_passes",
        0,
        |c| {
            copied_twice(&c, true, true, 4096);
            copied_twice(&c, false, false, 4096);
            copied_twice(&c, false, false, 100);
        },
    );
}

/// Zeroes 4096 bytes of new device memory and writes 1024 ones into them on stream
/// handle `writer` (from another thread if `elsewhere`), held back by a host function
/// ([`late`]) before the copy, and reads them back on `reader`, with nothing but CUDA's
/// implicit synchronisation of the default streams to order the two.
fn written_then_read(c: &Cuda, writer: usize, elsewhere: bool, reader: usize) -> Vec<f32> {
    use cudarc::driver::{result, sys};
    c.ctx.bind_to_thread().unwrap();
    // SAFETY: 4096 bytes, written and read below, never freed (the child ends).
    let ptr = unsafe { result::malloc_sync(4096) }.unwrap();
    let ones = vec![1.0f32; 1024];
    let write = || {
        c.ctx.bind_to_thread().unwrap();
        let s = writer as sys::CUstream;
        // SAFETY: the host function takes no argument; the copy's source and destination
        // hold 4096 bytes (the source is pageable: staged before the call returns).
        unsafe {
            result::memset_d8_async(ptr, 0, 4096, s).unwrap();
            result::stream::launch_host_function(s, late, std::ptr::null_mut()).unwrap();
            result::memcpy_htod_async(ptr, &ones, s).unwrap();
        }
    };
    if elsewhere {
        std::thread::scope(|t| {
            t.spawn(write);
        });
    } else {
        write();
    }
    let mut out = vec![0.0f32; 1024];
    let r = reader as sys::CUstream;
    // SAFETY: as above; the destination is pageable, so the copy is done when it returns.
    unsafe {
        result::memcpy_dtoh_async(&mut out, ptr, r).unwrap();
        result::stream::synchronize(r).unwrap();
    }
    out
}

/// A new stream of `c`: blocking (it synchronises with the legacy default stream) or not.
fn raw_stream(c: &Cuda, blocking: bool) -> usize {
    use cudarc::driver::result::stream::{create, StreamKind};
    c.ctx.bind_to_thread().unwrap();
    let kind = match blocking {
        true => StreamKind::Default,
        false => StreamKind::NonBlocking,
    };
    create(kind).unwrap() as usize
}

#[test]
fn the_legacy_stream_and_the_blocking_streams_wait_for_each_other() {
    // CUDA's implicit synchronisation: work on the legacy default stream comes after the
    // work enqueued before it on every blocking stream, every thread's per-thread
    // default stream included (which device slots rely on when a batch named on a
    // per-thread stream is released from another thread), and work on a blocking stream
    // after the legacy stream's.
    let name = "the_legacy_stream_and_the_blocking_streams_wait_for_each_other";
    emulated(name, 0, |c| {
        let ones = |v: Vec<f32>| v.iter().all(|&v| v == 1.0);
        let blocking = raw_stream(&c, true);
        assert!(ones(written_then_read(&c, blocking, false, 1)));
        assert!(ones(written_then_read(&c, 2, true, 1)));
        assert!(ones(written_then_read(&c, 1, false, blocking)));
        assert!(ones(written_then_read(&c, 1, true, 2)));
    });
}

#[test]
fn the_emulator_catches_a_legacy_stream_write_read_on_a_non_blocking_stream() {
    // Nor the other way round.
    let name = "the_emulator_catches_a_legacy_stream_write_read_on_a_non_blocking_stream";
    fails_in_child(name, Mode::default(), "race: cuMemcpyDtoHAsync", |c| {
        written_then_read(&c, 1, false, raw_stream(&c, false));
    });
}

#[test]
fn the_emulator_catches_a_non_blocking_stream_read_on_the_legacy_stream() {
    // A non-blocking stream does not synchronise with the legacy stream.
    let name = "the_emulator_catches_a_non_blocking_stream_read_on_the_legacy_stream";
    fails_in_child(name, Mode::default(), "race: cuMemcpyDtoHAsync", |c| {
        written_then_read(&c, raw_stream(&c, false), false, 1);
    });
}

#[test]
fn the_emulator_catches_two_threads_default_streams_unordered() {
    // Each thread has its own per-thread default stream: two are not one stream.
    let name = "the_emulator_catches_two_threads_default_streams_unordered";
    fails_in_child(name, Mode::default(), "race: cuMemcpyDtoHAsync", |c| {
        written_then_read(&c, 2, true, 2);
    });
}

#[test]
fn first_step_matches_the_cpu_backend() {
    emulated("first_step_matches_the_cpu_backend", 0, |c| {
        gpu_checks::first_step_matches_the_cpu_backend(c)
    });
}

#[test]
fn odd_shapes_match_the_cpu_backend() {
    emulated("odd_shapes_match_the_cpu_backend", 0, |c| {
        gpu_checks::odd_shapes_match_the_cpu_backend(c)
    });
}

#[test]
fn digits_reach_90_percent() {
    emulated("digits_reach_90_percent", 0, |c| {
        gpu_checks::digits_reach_90_percent_on_the_gpu(c)
    });
}

#[test]
fn a_generated_set_reaches_95_percent() {
    // Smaller than on a GPU (one channel of 16x16): the emulator runs the kernels one
    // thread at a time.
    emulated("a_generated_set_reaches_95_percent", 0, |c| {
        gpu_checks::a_generated_set_reaches_95_percent_on_the_gpu(c, 6_000, &[1, 16, 16])
    });
}

#[test]
fn the_device_cache_gives_the_same_epochs() {
    emulated("the_device_cache_gives_the_same_epochs", 50, |c| {
        gpu_checks::the_device_cache_gives_the_same_epochs(c)
    });
}

#[test]
fn overlapped_epochs_match_the_cpu_backend_under_jitter() {
    // Random delays before every device operation reorder the streams' progress
    // against each other and against the host: a missing wait shows as a difference.
    emulated(
        "overlapped_epochs_match_the_cpu_backend_under_jitter",
        200,
        |c| gpu_checks::epochs_match_the_cpu_backend(c, false),
    );
}

#[test]
fn serialised_epochs_match_the_cpu_backend() {
    emulated("serialised_epochs_match_the_cpu_backend", 50, |c| {
        gpu_checks::epochs_match_the_cpu_backend(c, true)
    });
}

#[test]
fn the_kernel_cache_survives_damage() {
    emulated("the_kernel_cache_survives_damage", 0, |c| {
        gpu_checks::the_kernel_cache_survives_damage(c)
    });
}

#[test]
fn partial_and_failing_epochs() {
    emulated("partial_and_failing_epochs", 50, |c| {
        gpu_checks::partial_and_failing_epochs(c)
    });
}

#[test]
fn lent_batches_wait_for_their_consumers() {
    emulated("lent_batches_wait_for_their_consumers", 50, |c| {
        gpu_checks::lent_batches_wait_for_their_consumers(c)
    });
}

#[test]
fn a_batch_used_on_another_threads_default_stream_waits_for_it() {
    emulated(
        "a_batch_used_on_another_threads_default_stream_waits_for_it",
        50,
        gpu_checks::a_batch_used_on_another_threads_default_stream_waits_for_it,
    );
}

#[test]
fn a_slot_wait_stops_for_its_interrupt_check() {
    emulated("a_slot_wait_stops_for_its_interrupt_check", 50, |c| {
        gpu_checks::a_slot_wait_stops_for_its_interrupt_check(c)
    });
}

#[test]
fn a_users_work_reads_cached_and_augmented_epochs_as_the_loader_gives_them() {
    emulated(
        "a_users_work_reads_cached_and_augmented_epochs_as_the_loader_gives_them",
        50,
        gpu_checks::a_users_work_reads_cached_and_augmented_epochs_as_the_loader_gives_them,
    );
}

#[test]
fn copies_overlapped_with_a_slow_step_are_no_stall() {
    emulated(
        "copies_overlapped_with_a_slow_step_are_no_stall",
        50,
        gpu_checks::copies_overlapped_with_a_slow_step_are_no_stall,
    );
}

#[test]
fn a_panic_while_an_epoch_is_captured_leaves_the_stream_usable() {
    emulated(
        "a_panic_while_an_epoch_is_captured_leaves_the_stream_usable",
        50,
        gpu_checks::a_panic_while_an_epoch_is_captured_leaves_the_stream_usable,
    );
}

#[test]
fn lent_batches_come_from_the_device_cache_as_the_loader_gives_them() {
    emulated(
        "lent_batches_come_from_the_device_cache_as_the_loader_gives_them",
        50,
        gpu_checks::lent_batches_come_from_the_device_cache_as_the_loader_gives_them,
    );
}

#[test]
fn the_trainer_augments_on_the_device_as_the_workers_do() {
    emulated(
        "the_trainer_augments_on_the_device_as_the_workers_do",
        50,
        gpu_checks::the_trainer_augments_on_the_device_as_the_workers_do,
    );
}

#[test]
fn augmenting_on_the_device_matches_the_workers() {
    emulated("augmenting_on_the_device_matches_the_workers", 50, |c| {
        gpu_checks::augmenting_on_the_device_matches_the_workers(c)
    });
}

#[test]
fn a_bad_label_is_an_error() {
    emulated("a_bad_label_is_an_error", 0, |c| {
        gpu_checks::a_bad_label_is_an_error(c)
    });
}

/// Batch `faulting` (from 0) of a loader's first epoch faults on the device while it is
/// copied into a device slot (the emulator's `STOKEHOLD_EMU_FAIL_HTOD_LATE`): the copy
/// was enqueued, and the context then fails every call, as after a fault on a GPU. The
/// error comes from a later lend, or from the drain at the end of the epoch, and names
/// the batch a resume must start from: the faulting one or the one before it (its copy
/// done, but the failure seen while waiting for it), never a later one, which would lose
/// the faulting batch. Nothing panics or hangs as the lost context's batches, slots and
/// loader are let go.
fn a_faulting_copy_loses_no_batch(c: Cuda, faulting: u64) {
    use std::collections::VecDeque;
    use stokehold::Error;

    let (_, mut loader, mut slots) = gpu_checks::digits_in_slots(&c, 6, 4);
    let mut epoch = loader.epoch(0).unwrap();
    // The two last batches stay lent, as a loop that overlaps its steps keeps them.
    let mut lent = VecDeque::new();
    let (err, given) = loop {
        let Some(batch) = epoch.next() else {
            break (slots.drain().unwrap_err(), None);
        };
        let batch = batch.unwrap();
        let number = batch.number();
        match slots.lend(batch) {
            Ok(b) => lent.push_back(b),
            Err(e) => break (e, Some(number)),
        }
        if lent.len() > 2 {
            lent.pop_front();
        }
    };
    // A lend's own failure loses the batch it was given; a CopyFailed, the one it names.
    let lost = match (&err, given) {
        (
            Error::CopyFailed {
                epoch: 0, batch, ..
            },
            _,
        ) => *batch,
        (Error::Cuda { .. }, Some(given)) => given,
        _ => panic!("not the fault's error: {err:?}"),
    };
    assert!(
        err.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{err}"
    );
    // The code is the driver's, and says the context is gone.
    assert_eq!(err.cuda_code(), Some(700), "{err:?}");
    assert!(err.context_lost(), "{err:?}");
    assert!(
        lost <= faulting && lost + 1 >= faulting,
        "batch {faulting} faulted, the error names {lost}: {err}"
    );
    // The context is lost for good: later calls are errors, not panics.
    if let Some(batch) = epoch.next() {
        assert!(slots.lend(batch.unwrap()).is_err());
    }
    assert!(slots.drain().is_err());
    drop((lent, epoch, slots));
    drop(loader);
}

/// [`a_faulting_copy_loses_no_batch`] in the child for test `name`, copy `copy` (from 1)
/// faulting.
fn with_a_faulting_copy(name: &str, copy: u32) {
    let mode = Mode {
        jitter_us: 200,
        faulting_copy: copy,
        ..Mode::default()
    };
    passes_in_child(name, mode, |c| {
        a_faulting_copy_loses_no_batch(c, u64::from(copy) - 1)
    });
}

#[test]
fn a_copy_that_faults_is_named_by_a_later_lend() {
    with_a_faulting_copy("a_copy_that_faults_is_named_by_a_later_lend", 3);
}

#[test]
fn a_copy_that_faults_last_is_named_by_the_drain() {
    // Digits in batches of 100: the 18th batch is the epoch's last.
    with_a_faulting_copy("a_copy_that_faults_last_is_named_by_the_drain", 18);
}

fn stokehold(dir: &Path, args: &[&str]) -> Output {
    stokehold_with(dir, None, args)
}

/// `stokehold args` on the emulator, with its own kernel cache when `cache` is given.
fn stokehold_with(dir: &Path, cache: Option<&Path>, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stokehold"));
    cmd.args(args);
    with_emulator(&mut cmd, dir, 20);
    if let Some(cache) = cache {
        cmd.env("STOKEHOLD_CACHE", cache);
    }
    let out = output_within(&mut cmd);
    assert!(out.status.success(), "stokehold {args:?}:\n{}", shown(&out));
    out
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn train_on_the_cuda_backend_matches_the_cpu_backend() {
    let Some(dir) = emulator() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (gpu, cpu, trace, warm) = (
        tmp.path().join("gpu.json"),
        tmp.path().join("cpu.json"),
        tmp.path().join("trace.json"),
        tmp.path().join("warm.json"),
    );
    let common = ["train", "--data", DIGITS, "--epochs", "3", "--batch", "128"];
    let cache = tmp.path().join("kernel-cache");
    let g = stokehold_with(
        dir,
        Some(&cache),
        &[
            &common[..],
            &["--device", "cuda", "--warmup", "--cold"],
            &["--json", warm.to_str().unwrap()],
        ]
        .concat(),
    );
    let shown_out = String::from_utf8_lossy(&g.stdout).into_owned();
    println!("{shown_out}");
    assert!(shown_out.contains("stokehold CUDA emulator"), "{shown_out}");
    for a in [
        &[
            "--device",
            "cuda",
            "--json",
            gpu.to_str().unwrap(),
            "--pinned",
            "write-combined",
        ][..],
        &["--device", "cpu", "--json", cpu.to_str().unwrap()][..],
    ] {
        stokehold_with(dir, Some(&cache), &[&common[..], a].concat());
    }
    let (g, c, w) = (json(&gpu), json(&cpu), json(&warm));
    // --warmup filled the device cache from the files before epoch 0, so every epoch of
    // that run read the device; it trains exactly as the others.
    assert!(
        w["setup"]["device_cache_fill_s"].as_f64().unwrap() > 0.0,
        "{}",
        w["setup"]
    );
    assert!(shown_out.contains("filled before epoch 0"), "{shown_out}");
    // The first run above compiled the kernels; this one read them from the disk cache.
    assert_eq!(g["setup"]["kernels_from_cache"], true, "{}", g["setup"]);
    assert!(shown_out.contains("(compiled)"), "{shown_out}");
    assert!(g["device"].as_str().unwrap().contains("emulator"));
    assert_eq!(g["config"]["pinned"], "WriteCombined", "{}", g["config"]);
    assert!(
        g["device_cache_bytes"].as_u64().unwrap() > 0,
        "digits fit the cache"
    );
    let epochs = |v: &serde_json::Value| v["epochs"].as_array().unwrap().clone();
    assert_eq!(
        (epochs(&g).len(), epochs(&c).len(), epochs(&w).len()),
        (3, 3, 3)
    );
    let pairs = epochs(&g).into_iter().zip(epochs(&c));
    for (a, b) in pairs.chain(epochs(&w).into_iter().zip(epochs(&c))) {
        let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert!(
            (la - lb).abs() <= 1e-3 * lb.abs(),
            "loss {la} on CUDA vs {lb} on the CPU"
        );
    }
    // Without the device cache every epoch goes through the feeder, and the trace holds
    // copy and compute spans on the streams' tracks for each of them.
    stokehold(
        dir,
        &[
            &common[..],
            &[
                "--device",
                "cuda",
                "--no-device-cache",
                "--trace",
                trace.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    let t = json(&trace);
    let events = t["traceEvents"].as_array().unwrap();
    let spans = |name: &str| events.iter().filter(|e| e["name"] == name).count();
    let batches = 3 * 1797usize.div_ceil(128);
    assert_eq!((spans("copy"), spans("compute")), (batches, batches));
    // The feeding thread's waits: for each batch, and for copies before their buffers go
    // back (but for the last few of each epoch, released after one stream sync).
    assert_eq!(spans("wait for data"), batches);
    let copy_waits = spans("wait for copy");
    assert!(copy_waits > 0 && copy_waits <= batches, "{copy_waits}");
    let tracks: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(
        ["copy", "compute", "feed"]
            .iter()
            .all(|t| tracks.contains(t)),
        "{tracks:?}"
    );
    // With the device cache, epoch 0 is fed from the host, and the later epochs gather on
    // the device: their spans are the device gather and the step, per batch.
    stokehold(
        dir,
        &[
            &common[..],
            &["--device", "cuda", "--trace", trace.to_str().unwrap()],
        ]
        .concat(),
    );
    let t = json(&trace);
    let events = t["traceEvents"].as_array().unwrap();
    let per_epoch = 1797usize.div_ceil(128);
    for (name, epoch, want) in [
        ("copy", 0, per_epoch),
        ("compute", 0, per_epoch),
        ("copy", 1, 0),
        ("device gather", 1, per_epoch),
        ("compute", 1, per_epoch),
        ("device gather", 2, per_epoch),
        ("compute", 2, per_epoch),
    ] {
        let got = events
            .iter()
            .filter(|e| e["name"] == name && e["args"]["epoch"] == epoch)
            .count();
        assert_eq!(got, want, "{name} spans in epoch {epoch}");
    }
}

#[test]
fn train_augments_on_the_device_and_from_the_device_cache_as_the_cpus_workers() {
    // `--crop`/`--flip` augment on the device on CUDA (the loader's batches, and so the
    // device cache, stay raw) and in the loader's workers on the CPU: the same draws per
    // sample and epoch, so the same losses, epoch after epoch. Epochs 1 and 2 come from
    // the device cache: a cache of augmented images, or draws of the wrong epoch, would
    // change them. Three CUDA runs take the three paths of a cached epoch: one CUDA
    // graph after epoch 0 filled the cache, a graph from the start with `--warmup`, and
    // batch by batch with `--trace`.
    let Some(dir) = emulator() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let path = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let common = [
        "train", "--data", DIGITS, "--epochs", "3", "--batch", "128", "--crop", "2", "--flip",
    ];
    let run = |device: &str, name: &str, extra: &[&str]| {
        let json_path = path(name);
        let args = [
            &common[..],
            &["--device", device, "--json", &json_path],
            extra,
        ]
        .concat();
        let out = stokehold(dir, &args);
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            json(Path::new(&json_path)),
        )
    };
    let (_, cpu) = run("cpu", "cpu.json", &[]);
    assert_eq!(cpu["augment_on"], "workers", "{cpu}");
    let trace = path("trace.json");
    let runs = [
        ("gpu.json", &[][..]),
        ("warm.json", &["--warmup"]),
        ("traced.json", &["--trace", &trace]),
    ];
    for (name, extra) in runs {
        let (text, g) = run("cuda", name, extra);
        assert!(
            text.contains("augment: x, a random crop (padding 2), a flip, drawn per sample on the GPU, after the copy or the gather from the device cache"),
            "{extra:?}: {text}"
        );
        assert!(g["device"].as_str().unwrap().contains("emulator"));
        assert_eq!(g["augment_on"], "device", "{g}");
        assert!(g["device_cache_bytes"].as_u64().unwrap() > 0, "{g}");
        assert!(
            g["setup"]["augment_kernel_s"].as_f64().unwrap() > 0.0,
            "{g}"
        );
        assert_eq!(
            (&g["config"]["crop"], &g["config"]["flip"]),
            (&2.into(), &true.into())
        );
        let epochs = |v: &serde_json::Value| v["epochs"].as_array().unwrap().clone();
        // From the device cache (no copies, no gathering): every epoch after the first,
        // and the first too when `--warmup` filled the cache before it.
        let first_cached = usize::from(extra.is_empty() || extra[0] != "--warmup");
        for e in &epochs(&g)[first_cached..] {
            assert_eq!(
                (e["copy_s"].as_f64(), e["gather_s"].as_f64()),
                (Some(0.0), Some(0.0)),
                "{extra:?}: {e}"
            );
        }
        assert_eq!((epochs(&g).len(), epochs(&cpu).len()), (3, 3), "{extra:?}");
        for (a, b) in epochs(&g).into_iter().zip(epochs(&cpu)) {
            let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
            // They agree to 1e-8 here; an epoch with other draws differs by 1e-4 or more.
            assert!(
                (la - lb).abs() <= 1e-6 * lb.abs(),
                "{extra:?}: epoch {}: loss {la} on CUDA vs {lb} on the CPU",
                a["epoch"]
            );
        }
    }
}

#[test]
fn bench_measures_its_gpu_figures_on_the_cuda_backend() {
    let Some(dir) = emulator() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let report = tmp.path().join("bench.json");
    let d = data.to_str().unwrap();
    stokehold(
        dir,
        &[
            "gen",
            "--out",
            d,
            "--samples",
            "2000",
            "--shape",
            "1x16x16",
            "--classes",
            "16",
        ],
    );
    stokehold(
        dir,
        &["bench", "--data", d, "--json", report.to_str().unwrap()],
    );
    let b = json(&report);
    let gpu = &b["gpu"];
    assert!(gpu["device"].as_str().unwrap().contains("emulator"), "{b}");
    for figure in [
        &gpu["h2d"]["bare_pinned_gb_s"],
        &gpu["h2d"]["bare_write_combined_gb_s"],
        &gpu["h2d"]["bare_pageable_gb_s"],
        &gpu["h2d"]["feeder_copy_gb_s"],
        &gpu["h2d"]["feeder_copy_write_combined_gb_s"],
        &gpu["h2d"]["bare_fresh_gb_s"],
        &gpu["overlap"]["overlapped_s"],
        &gpu["overlap"]["serialised_s"],
        &gpu["cache"][0]["cached_s"],
        &gpu["cache"][0]["uncached_s"],
        &gpu["cache"][1]["cached_s"],
        &gpu["cache"][1]["uncached_s"],
    ] {
        assert!(figure.as_f64().is_some_and(|v| v > 0.0), "{gpu}");
    }
    for (k, cache) in [(0, true), (1, false)] {
        let w = &gpu["warmup"][k];
        assert_eq!(w["device_cache"], cache, "{gpu}");
        assert!(w["ratio"].as_f64().is_some_and(|r| r > 0.0), "{gpu}");
    }
    // The device cache is measured with 1 worker and with the default 2.
    assert_eq!(gpu["cache"][0]["workers"], 1, "{gpu}");
    assert_eq!(gpu["cache"][1]["workers"], 2, "{gpu}");
    assert!(
        gpu["overlap"]["workers"].as_u64().is_some_and(|w| w >= 2),
        "{gpu}"
    );
}

#[test]
fn the_cuda_example_runs_a_users_kernel() {
    let Some(dir) = emulator() else { return };
    // Examples are built by `cargo test`, next to this binary's directory.
    let example = common::example("05_cuda_kernel");
    assert!(
        example.exists(),
        "{} is not built: `cargo test` builds the examples, or `cargo build --examples`",
        example.display()
    );
    let mut cmd = Command::new(&example);
    let out = output_within(with_emulator(&mut cmd, dir, 20));
    let text = shown(&out);
    println!("{text}");
    assert!(out.status.success(), "{text}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("stokehold CUDA emulator"), "{text}");
    // Epoch 0 fills the device cache; the kernel's counts of the later ones, read from
    // it, are checked by the example.
    for line in [
        "epoch 0 from the loader",
        "epoch 1 from the device cache",
        "epoch 2 from the device cache",
    ] {
        assert!(stdout.contains(line), "{line:?} missing: {text}");
    }
}

#[test]
fn train_stops_at_a_fault_on_the_device_with_its_error() {
    // A copy or a kernel that faults on the device (the first, and later ones): the
    // context is lost, and `stokehold train` exits 1 with the driver's error, without a
    // panic or a hang. A fault in an epoch leaves a JSON with the epochs before it and the
    // error; one before the first epoch (the first copies upload the model) does not.
    let Some(dir) = emulator() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let faults = [
        ("STOKEHOLD_EMU_FAIL_HTOD_LATE", "1", false),
        ("STOKEHOLD_EMU_FAIL_HTOD_LATE", "3", false),
        ("STOKEHOLD_EMU_FAIL_HTOD_LATE", "7", true),
        ("STOKEHOLD_EMU_FAULT_LAUNCH", "1", true),
        ("STOKEHOLD_EMU_FAULT_LAUNCH", "5", true),
        ("STOKEHOLD_EMU_FAULT_LAUNCH", "20", true),
    ];
    for (fault, n, in_an_epoch) in faults {
        let json = tmp.path().join(format!("run-{fault}-{n}.json"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_stokehold"));
        cmd.args([
            "train", "--data", DIGITS, "--epochs", "2", "--device", "cuda",
        ])
        .arg("--json")
        .arg(&json);
        with_emulator(&mut cmd, dir, 100).env(fault, n);
        let out = output_within(&mut cmd);
        let text = shown(&out);
        assert_eq!(out.status.code(), Some(1), "{fault}={n}: {text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{text}");
        assert!(err.contains("the CUDA context is lost"), "{text}");
        assert!(!err.contains("panicked"), "{text}");
        assert_eq!(json.exists(), in_an_epoch, "{fault}={n}: {text}");
        if !in_an_epoch {
            continue;
        }
        let report = self::json(&json);
        let error = report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{fault}={n}: {report}"
        );
        let ran = report["epochs"].as_array().unwrap().len();
        assert!(
            error.starts_with(&format!("epoch {ran}: ")),
            "{fault}={n}: {report}"
        );
        assert!(ran < 2, "{fault}={n}: {report}");
    }
}

#[test]
fn a_driver_without_nvrtc_falls_back_to_the_cpu_or_says_why() {
    // The common machine with a driver but no toolkit: libcuda and a device, no NVRTC.
    let Some(dir) = emulator() else { return };
    // A library path with the emulated libcuda alone.
    let tmp = tempfile::tempdir().unwrap();
    for lib in ["libcuda.so", "libcuda.so.1"] {
        std::os::unix::fs::symlink(dir.join("libcuda.so.1"), tmp.path().join(lib)).unwrap();
    }
    let run = |device: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_stokehold"));
        cmd.args([
            "train", "--data", DIGITS, "--epochs", "1", "--device", device,
        ]);
        with_emulator(&mut cmd, dir, 0)
            .env("LD_LIBRARY_PATH", tmp.path())
            .env("STOKEHOLD_NVRTC", tmp.path().join("no-such-libnvrtc.so"));
        output_within(&mut cmd)
    };
    let auto = run("auto");
    let text = shown(&auto);
    assert!(auto.status.success(), "{text}");
    let stdout = String::from_utf8_lossy(&auto.stdout);
    if !text.contains("NVRTC not found") {
        // Only where the run found an NVRTC elsewhere, and trained on the device.
        assert!(stdout.contains("device: cuda:0"), "{text}");
        println!("skipping: this machine has an NVRTC of its own\n{text}");
        return;
    }
    assert!(stdout.contains("device: cpu"), "{text}");
    let cuda = run("cuda");
    let text = shown(&cuda);
    assert_eq!(cuda.status.code(), Some(1), "{text}");
    let err = String::from_utf8_lossy(&cuda.stderr);
    assert!(
        err.contains("NVRTC not found") && err.contains("STOKEHOLD_NVRTC"),
        "{text}"
    );
    assert!(!err.contains("panicked"), "{text}");
}

#[test]
fn kernels_build_for_any_device_nvrtc_can_serve() {
    // The emulated device's compute capability and the architectures its NVRTC knows are
    // set per run; the driver loads a cubin for sm_XY on X.Z (Z >= Y) only, and PTX for
    // compute_XY on X.Y or newer, as a GPU's does.
    let Some(dir) = emulator() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // As NVRTC 12.8 lists them, with the Tegra 87 (Orin) and 101 (Thor).
    let archs = "75,80,86,87,89,90,100,101,120";
    let run = |cc: &str, nvrtc: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_stokehold"));
        cmd.args([
            "train", "--data", DIGITS, "--epochs", "1", "--device", "cuda",
        ]);
        let cache = tmp.path().join(format!("cache-{cc}"));
        with_emulator(&mut cmd, dir, 0)
            .env("STOKEHOLD_CACHE", &cache)
            .env("STOKEHOLD_EMU_CC", cc)
            .env("STOKEHOLD_EMU_NVRTC_ARCHS", archs)
            .env("STOKEHOLD_EMU_NVRTC_VERSION", nvrtc);
        let out = output_within(&mut cmd);
        let cached: Vec<String> = std::fs::read_dir(&cache)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        (out.status.code(), shown(&out), cached)
    };
    // sm_103 (B300), sm_121 and sm_88 with an NVRTC that lists none of them: a cubin for
    // sm_100, sm_120 and sm_86 (not the Tegra sm_101 or sm_87), which run there. The
    // NVRTC is newer than the driver, so no PTX could stand in: a cubin it must be.
    // (Asking NVRTC for the device's own architecture fails both ways.)
    for cc in ["10.3", "12.1", "8.8"] {
        let (code, text, cached) = run(cc, "12.9");
        assert_eq!(code, Some(0), "compute capability {cc}: {text}");
        assert!(
            cached.iter().any(|f| f.ends_with(".cubin")),
            "{cc}: {cached:?}"
        );
    }
    // A Tegra device NVRTC lists (Orin) gets its own cubin; one it does not (Thor, as
    // CUDA 13's sm_110), PTX for the newest Tegra architecture below it.
    let (code, text, _) = run("8.7", "12.9");
    assert_eq!(code, Some(0), "{text}");
    let (code, text, cached) = run("11.0", "12.8");
    assert_eq!(code, Some(0), "{text}");
    assert!(cached.iter().any(|f| f.ends_with(".ptx")), "{cached:?}");
    // A major this NVRTC does not know: PTX for the newest it knows, compiled forward.
    let (code, text, cached) = run("13.0", "12.8");
    assert_eq!(code, Some(0), "{text}");
    assert!(cached.iter().any(|f| f.ends_with(".ptx")), "{cached:?}");
    // Older than every architecture it builds for: an error that says so.
    let (code, text, _) = run("7.0", "12.8");
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("is sm_70, but NVRTC 12.8") && text.contains("builds for sm_75 and newer"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
}

#[test]
fn ptx_from_an_nvrtc_newer_than_the_driver_falls_back_to_the_cpu_or_says_why() {
    // No cubin can be built (STOKEHOLD_EMU_NO_CUBIN), and the PTX that could would come
    // from NVRTC 99.0 for a CUDA 12.8 driver, which cannot load it: --device auto trains
    // on the CPU saying so, --device cuda exits 1 with the reason.
    let Some(dir) = emulator() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let run = |device: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_stokehold"));
        cmd.args([
            "train", "--data", DIGITS, "--epochs", "1", "--device", device,
        ]);
        with_emulator(&mut cmd, dir, 0)
            .env("STOKEHOLD_CACHE", tmp.path().join("kernel-cache"))
            .env("STOKEHOLD_EMU_NO_CUBIN", "1");
        output_within(&mut cmd)
    };
    let auto = run("auto");
    let text = shown(&auto);
    assert!(auto.status.success(), "{text}");
    let out = String::from_utf8_lossy(&auto.stdout);
    assert!(out.contains("device: cpu"), "{text}");
    assert!(
        out.contains("newer than the driver's CUDA 12.8"),
        "the reason is shown: {text}"
    );
    let cuda = run("cuda");
    let text = shown(&cuda);
    assert_eq!(cuda.status.code(), Some(1), "{text}");
    let err = String::from_utf8_lossy(&cuda.stderr);
    assert!(err.contains("newer than the driver's CUDA 12.8"), "{text}");
    assert!(!err.contains("panicked"), "{text}");
}
