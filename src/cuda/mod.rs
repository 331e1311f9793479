//! The CUDA backend. Everything here compiles on any machine: libcuda and NVRTC are
//! opened at run time, and [`probe`] finds out whether they are there before anything
//! touches them (cudarc panics when libcuda is missing).

mod augment;
mod cache;
mod feeder;
pub(crate) mod kernels;
mod lease;
pub(crate) mod nvrtc;
mod pinned;
mod resident;
mod slot_cache;
mod step;
mod trainer;

use std::sync::Arc;

use cudarc::driver::{CudaStream, DriverError};

pub use augment::{packed, AUGMENT};
pub use cudarc::driver::CudaContext;
pub use feeder::{DeviceBatch, FeedStats, Feeder};
pub use kernels::{build_arch, KernelOrigin, Kernels};
pub use lease::{
    CopyClock, DeviceSlots, LentBatch, Reserved, StreamHandle, LEGACY_STREAM, PER_THREAD_STREAM,
};
pub use nvrtc::Nvrtc;
pub use pinned::{PinnedAlloc, PinnedKind};
pub use trainer::CudaTrainer;

/// A usable CUDA device: its context, NVRTC, and what it is.
#[derive(Debug, Clone)]
pub struct Cuda {
    /// The context on device 0.
    pub ctx: Arc<CudaContext>,
    /// NVRTC, for compiling kernels.
    pub nvrtc: Arc<Nvrtc>,
    /// The device's name.
    pub name: String,
    /// Compute capability.
    pub arch: (i32, i32),
    /// The CUDA version the driver supports (`cuDriverGetVersion`), e.g. `(13, 0)`.
    pub driver: (i32, i32),
    /// How long creating the context took (a warm-up cost).
    pub context_time: std::time::Duration,
}

/// Whether the dynamic loader finds libcuda. cudarc panics on its first driver call
/// without it, and its own probe exists only in its `dynamic-loading` mode, so stokehold
/// asks the loader itself: this works whichever way cudarc was built (loading at run
/// time, or linked, as candle's `cuda` feature has it). Cheap, before any context is
/// made: a first answer for a command asked for CUDA that has other work to do first.
pub fn driver_present() -> bool {
    driver_missing().is_none()
}

/// Why libcuda does not load ([`driver_present`]), or `None` where it does: not found,
/// or found and refused by the dynamic loader (a missing dependency, another
/// architecture), with the loader's own words.
pub fn driver_missing() -> Option<String> {
    let mut refused = None;
    for name in ["libcuda.so", "libcuda.so.1"] {
        // SAFETY: opening libcuda runs its initialisers, which have no preconditions;
        // cudarc opens the same library for its first call.
        match unsafe { libloading::Library::new(name) } {
            Ok(_) => return None,
            // The loader's own words (`dlerror`, the error's source): a refusal unless the
            // file is not there. A failure it gave no words for is taken as not there.
            Err(e @ libloading::Error::DlOpen { .. }) => {
                let why = std::error::Error::source(&e).map(|s| s.to_string());
                if let Some(why) = why.filter(|w| !w.contains("No such file")) {
                    refused = Some(why);
                }
            }
            Err(_) => {}
        }
    }
    Some(match refused {
        Some(why) => format!("libcuda does not load: {why}"),
        None => "no libcuda found (looked for libcuda.so and libcuda.so.1)".into(),
    })
}

/// Runs `f`, turning a panic into `Err` with its message, and printing nothing: cudarc
/// panics when a libcuda it finds is broken (a symbol missing, say), and the probe's
/// answer is then one line of reason, not a backtrace.
fn quietly<R>(f: impl FnOnce() -> R + std::panic::UnwindSafe) -> Result<R, String> {
    // One swap of the process's hook at a time: two probes at once would otherwise put
    // back each other's silent hook, and the first hook would be lost.
    static SWAP: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = SWAP.lock().unwrap_or_else(|e| e.into_inner());
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(f);
    std::panic::set_hook(hook);
    r.map_err(|p| crate::util::panic_message(p.as_ref()))
}

/// Captures what `enqueue` puts on `stream` into a CUDA graph (this thread's capture
/// mode) and instantiates it. The capture is ended whatever happens, so that the
/// stream is never left capturing: on an error of `enqueue` or the driver, and on a
/// panic out of `enqueue` (a user's work), which goes on to the caller once the capture
/// is ended.
///
/// # Errors
/// `enqueue`'s error, else the driver's; an empty capture is an error naming `what`.
pub(crate) fn capture_graph(
    stream: &Arc<CudaStream>,
    what: &str,
    enqueue: impl FnOnce() -> crate::error::Result<()>,
) -> crate::error::Result<cudarc::driver::CudaGraph> {
    use cudarc::driver::sys;
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    stream.begin_capture(mode)?;
    let enqueued = std::panic::catch_unwind(std::panic::AssertUnwindSafe(enqueue));
    // An error a drop left in the context would make cudarc return before ending it.
    take_left_error(stream.context());
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    let enqueued = enqueued.unwrap_or_else(|p| std::panic::resume_unwind(p));
    enqueued?;
    graph?.ok_or_else(|| crate::error::Error::cuda(format!("the captured {what} is empty")))
}

/// Takes an error a drop left in `ctx`: cudarc keeps it for the next call, which
/// returns it without doing its work, so a wait made next would return at once.
pub(crate) fn take_left_error(ctx: &CudaContext) {
    let _ = ctx.check_err();
}

/// Waits until the work enqueued in `ctx` so far has run or failed: before host memory
/// it may read is reused or freed. Straight through the driver, as [`wait_event`]: an
/// error a drop left in the context (which cudarc's own `synchronize` would return
/// first, without waiting) neither skips the wait nor is taken from the next call.
///
/// # Errors
/// The driver's error, once the wait is done (a fault's sticky error, say).
pub(crate) fn settle(ctx: &CudaContext) -> std::result::Result<(), DriverError> {
    use cudarc::driver::result;
    // SAFETY: `ctx` is alive (borrowed); making it current touches no memory of ours.
    unsafe { result::ctx::set_current(ctx.cu_ctx()) }?;
    result::ctx::synchronize()
}

/// Waits on the host for `event`, whatever error another thread leaves in its context
/// meanwhile: cudarc's own `synchronize` first returns (and clears) such an error, and
/// then does not wait. For waits that guard memory about to be reused or freed.
///
/// # Errors
/// The driver's error, once the wait is done.
pub(crate) fn wait_event(
    ctx: &CudaContext,
    event: &cudarc::driver::CudaEvent,
) -> std::result::Result<(), DriverError> {
    use cudarc::driver::result;
    // SAFETY: `ctx` is alive (borrowed); making it current touches no memory of ours.
    unsafe { result::ctx::set_current(ctx.cu_ctx()) }?;
    // SAFETY: the event is alive (borrowed) and of that context.
    unsafe { result::event::synchronize(event.cu_event()) }
}

/// [`wait_event`] for everything enqueued on `stream`.
///
/// # Errors
/// The driver's error, once the wait is done.
pub(crate) fn wait_stream(stream: &CudaStream) -> std::result::Result<(), DriverError> {
    use cudarc::driver::result;
    // SAFETY: the stream's context is alive (the stream holds it); making it current
    // touches no memory of ours.
    unsafe { result::ctx::set_current(stream.context().cu_ctx()) }?;
    // SAFETY: the stream is alive (borrowed) and of that context.
    unsafe { result::stream::synchronize(stream.cu_stream()) }
}

/// Puts the calling thread's current CUDA context back when dropped.
///
/// cudarc makes a context current (binds it) before each of its calls, and leaves it
/// so. A thread that works with another device must find its own context again: the
/// CUDA runtime takes its current device from the current context (PyTorch's
/// `torch.cuda.current_device()`, and where a bare `device="cuda"` allocates).
/// stokehold makes one at the start of each call that code of another library's thread
/// may make (probing a device, building device slots, lending, releasing and waiting on
/// device batches, pinned allocations) and when its device objects are dropped. Make
/// one yourself around cudarc calls of your own made from such a thread:
///
/// ```no_run
/// # fn f(ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Result<(), cudarc::driver::DriverError> {
/// let _current = stokehold::cuda::KeepCurrent::new();
/// let stream = ctx.new_stream()?; // makes `ctx` current
/// # Ok(()) }
/// // Dropped here: the thread's context before `new` is current again.
/// ```
///
/// It puts back what was current, not a context that the code between dropped for good:
/// keep the handle of a context current on the thread alive past the guard. Without a
/// usable libcuda it does nothing. It stays on the thread that made it (it is not
/// `Send`).
#[derive(Debug)]
#[must_use = "the context is put back when this is dropped"]
pub struct KeepCurrent(Option<cudarc::driver::sys::CUcontext>);

impl Default for KeepCurrent {
    fn default() -> KeepCurrent {
        KeepCurrent::new()
    }
}

impl KeepCurrent {
    /// Notes the thread's current context (none before the driver is initialised; `None`
    /// where the driver will not say, or cannot be loaded).
    pub fn new() -> KeepCurrent {
        use cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_INITIALIZED;
        if !driver_usable() {
            return KeepCurrent(None);
        }
        match cudarc::driver::result::ctx::get_current() {
            Ok(current) => KeepCurrent(Some(current.unwrap_or(std::ptr::null_mut()))),
            Err(e) if e.0 == CUDA_ERROR_NOT_INITIALIZED => KeepCurrent(Some(std::ptr::null_mut())),
            Err(_) => KeepCurrent(None),
        }
    }
}

/// The device a bare `cuda` means for the calling thread: the device of its current
/// context (PyTorch's current device, once it has used CUDA: `torch.cuda.set_device`
/// then any CUDA call), else `LOCAL_RANK` where it names a visible device (torchrun's
/// process per GPU, each seeing them all), else 0.
pub fn default_device() -> usize {
    use cudarc::driver::{result, sys};
    if !driver_usable() {
        return 0;
    }
    if let Ok(Some(_)) = result::ctx::get_current() {
        let mut device: sys::CUdevice = 0;
        // SAFETY: writes the current context's device (its ordinal) into `device`.
        let rc = unsafe { sys::cuCtxGetDevice(&mut device) };
        if let (sys::CUresult::CUDA_SUCCESS, Ok(d)) = (rc, usize::try_from(device)) {
            return d;
        }
    }
    let local: Option<usize> = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok());
    let visible = || {
        result::init().ok()?;
        usize::try_from(result::device::get_count().ok()?).ok()
    };
    match (local, local.and_then(|_| visible())) {
        (Some(rank), Some(count)) if rank < count => rank,
        _ => 0,
    }
}

/// Whether cudarc's driver calls can be made: libcuda is there and has what cudarc loads
/// (cudarc panics at its first call otherwise). Asked once.
fn driver_usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| {
        driver_present() && quietly(cudarc::driver::result::ctx::get_current).is_ok()
    })
}

/// A [`KeepCurrent`] made in the `drop` of a value holding it as its last field, so that
/// it puts the context back after the value's other fields (which bind theirs) are gone.
/// `Send` and `Sync`, so that the value stays so.
#[derive(Debug)]
pub(crate) struct Restore {
    _current: KeepCurrent,
}

impl Restore {
    /// Notes the thread's current context now.
    pub(crate) fn now() -> Restore {
        Restore {
            _current: KeepCurrent::new(),
        }
    }
}

// SAFETY: a `Restore` is made in a `drop` and dropped at its end, on the same thread: it
// never crosses threads, and it offers nothing to call while shared.
unsafe impl Send for Restore {}
// SAFETY: as above.
unsafe impl Sync for Restore {}

impl Drop for KeepCurrent {
    fn drop(&mut self) {
        let Some(was) = self.0 else { return };
        let now = cudarc::driver::result::ctx::get_current()
            .ok()
            .flatten()
            .unwrap_or(std::ptr::null_mut());
        if now != was {
            // SAFETY: `was` was this thread's current context (or none, null) when the
            // call began; a context current on a thread is not destroyed under it by
            // the libraries that made it so (PyTorch keeps its primary contexts).
            let _ = unsafe { cudarc::driver::result::ctx::set_current(was) };
        }
    }
}

/// The driver's side of a device: its context, the CUDA version the driver supports,
/// and how long the context took (what [`probe`] finds before it looks for NVRTC).
#[derive(Debug, Clone)]
pub struct Driver {
    /// The context on the device.
    pub ctx: Arc<CudaContext>,
    /// `cuDriverGetVersion`, e.g. `(13, 0)`.
    pub version: (i32, i32),
    /// How long creating the context took.
    pub context_time: std::time::Duration,
}

/// Looks for libcuda and device `ordinal`, and makes its (primary) context: all that
/// copies to the device need, without NVRTC.
///
/// # Errors
/// A one-line reason: "no libcuda found", "no CUDA device: ...".
pub fn probe_driver(ordinal: usize) -> Result<Driver, String> {
    if let Some(why) = driver_missing() {
        return Err(why);
    }
    // Making the context makes it current: the caller's (another library's, on another
    // device) is put back.
    let _current = KeepCurrent::new();
    let start = std::time::Instant::now();
    let ctx = quietly(|| CudaContext::new(ordinal))
        .map_err(|m| format!("no CUDA device: loading the driver failed: {m}"))?
        .map_err(|e| format!("no CUDA device {ordinal}: {e}"))?;
    let context_time = start.elapsed();
    let mut version = 0;
    // SAFETY: libcuda is loaded and initialised (a context exists); the call writes one
    // int.
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    if status != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "the CUDA driver cannot tell its version: {status:?}"
        ));
    }
    Ok(Driver {
        ctx,
        version: (version / 1000, version % 1000 / 10),
        context_time,
    })
}

/// Looks for libcuda, device 0 and NVRTC, in that order.
///
/// # Errors
/// A one-line reason: "no libcuda found", "no CUDA device: ...", "NVRTC not found:
/// looked for ...".
pub fn probe() -> Result<Cuda, String> {
    probe_device(0)
}

/// [`probe`] for device `ordinal`.
///
/// # Errors
/// As [`probe`].
pub fn probe_device(ordinal: usize) -> Result<Cuda, String> {
    // A failure below drops the context's last handle, which binds it.
    let _current = KeepCurrent::new();
    let Driver {
        ctx,
        version: driver,
        context_time,
    } = probe_driver(ordinal)?;
    let nvrtc = Nvrtc::load()?;
    let name = ctx.name().unwrap_or_else(|_| "unknown CUDA device".into());
    let arch = ctx
        .compute_capability()
        .map_err(|e| format!("CUDA device without a compute capability: {e}"))?;
    if arch.0 < 6 {
        return Err(format!(
            "{name} has compute capability {}.{}: stokehold's kernels need 6.0 or newer",
            arch.0, arch.1
        ));
    }
    let archs = nvrtc.supported_archs();
    if let Some(&oldest) = archs.iter().min() {
        if arch < oldest {
            return Err(format!(
                "{name} is sm_{}{}, but NVRTC {}.{} ({}) builds for sm_{}{} and newer: point \
                 STOKEHOLD_NVRTC at an older NVRTC",
                arch.0,
                arch.1,
                nvrtc.version().0,
                nvrtc.version().1,
                nvrtc.path(),
                oldest.0,
                oldest.1
            ));
        }
    }
    Ok(Cuda {
        ctx,
        nvrtc: Arc::new(nvrtc),
        name,
        arch,
        driver,
        context_time,
    })
}
