//! Page-locked host memory for the loader's buffer pool.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use super::{KeepCurrent, Restore};
use crate::error::{Error, Result};
use crate::loader::{HostAlloc, HostMemory};

/// Which kind of page-locked memory to allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum PinnedKind {
    /// Plain pinned memory (`cuMemHostAlloc` with `PORTABLE`): fast to write and read
    /// on the host, full-speed DMA. The default.
    #[default]
    Plain,
    /// Write-combined: fast for the host to write, very slow for it to read; only for
    /// buffers the host never reads back.
    WriteCombined,
}

impl PinnedKind {
    /// Every kind, by name.
    pub const NAMES: [&'static str; 2] = ["plain", "write-combined"];

    /// The `cuMemHostAlloc` flags of this kind (always portable: usable from any
    /// context's streams).
    pub(crate) fn flags(self) -> u32 {
        match self {
            PinnedKind::Plain => sys::CU_MEMHOSTALLOC_PORTABLE,
            PinnedKind::WriteCombined => {
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_WRITECOMBINED
            }
        }
    }
}

impl std::str::FromStr for PinnedKind {
    type Err = Error;

    /// `plain` or `write-combined`.
    fn from_str(s: &str) -> Result<PinnedKind> {
        match s {
            "plain" => Ok(PinnedKind::Plain),
            "write-combined" => Ok(PinnedKind::WriteCombined),
            _ => Err(Error::Config(format!(
                "pinned memory {s:?}: expected plain or write-combined"
            ))),
        }
    }
}

impl std::fmt::Display for PinnedKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(PinnedKind::NAMES[*self as usize])
    }
}

/// Allocates the loader's buffers as page-locked memory of a CUDA context.
#[derive(Debug)]
pub struct PinnedAlloc {
    ctx: Arc<CudaContext>,
    kind: PinnedKind,
    /// Set when dropped, and dropped last: the caller's context is current again once
    /// the context's handle (which binds it when it is the last) is gone.
    restore: Option<Restore>,
}

impl PinnedAlloc {
    /// An allocator of `kind` memory in `ctx`.
    pub fn new(ctx: Arc<CudaContext>, kind: PinnedKind) -> PinnedAlloc {
        PinnedAlloc {
            ctx,
            kind,
            restore: None,
        }
    }
}

impl Clone for PinnedAlloc {
    fn clone(&self) -> PinnedAlloc {
        PinnedAlloc::new(Arc::clone(&self.ctx), self.kind)
    }
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        self.restore = Some(Restore::now());
    }
}

struct Pinned {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
    /// Set when dropped, and dropped last: the caller's context is current again once
    /// the context's handle (which binds it when it is the last) is gone.
    restore: Option<Restore>,
}

// SAFETY: the allocation is owned by this value alone; the pointer is only handed out
// through `HostMemory`, whose users arrange exclusive access.
unsafe impl Send for Pinned {}
// SAFETY: as above.
unsafe impl Sync for Pinned {}

// SAFETY: `cuMemHostAlloc` returns page-aligned memory of the asked length, zero-filled
// in `alloc` below, freed only in `Drop`.
unsafe impl HostMemory for Pinned {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // `bind_to_thread` would also report (and clear) an error some other drop left in
        // the context, and this buffer would leak; make the context current directly.
        self.restore = Some(Restore::now());
        // SAFETY: the context outlives this buffer (we hold an Arc to it).
        if unsafe { result::ctx::set_current(self.ctx.cu_ctx()) }.is_ok() {
            // SAFETY: allocated by `malloc_host` in this context and freed once.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

impl HostAlloc for PinnedAlloc {
    fn name(&self) -> &'static str {
        match self.kind {
            PinnedKind::Plain => "pinned",
            PinnedKind::WriteCombined => "pinned-write-combined",
        }
    }

    fn alloc(&self, bytes: usize) -> Result<Box<dyn HostMemory>> {
        let err = |message: String| Error::Alloc {
            bytes,
            allocator: self.name(),
            message,
        };
        let _current = KeepCurrent::new();
        // SAFETY: the context is alive (we hold an Arc to it); see `Drop` for why not
        // `bind_to_thread`.
        unsafe { result::ctx::set_current(self.ctx.cu_ctx()) }.map_err(|e| err(e.to_string()))?;
        let flags = self.kind.flags();
        let len = bytes.max(1);
        // SAFETY: a plain allocation call; the result is checked below.
        let ptr = unsafe { result::malloc_host(len, flags) }.map_err(|e| err(e.to_string()))?;
        let ptr = ptr.cast::<u8>();
        if ptr.is_null() {
            return Err(err("cuMemHostAlloc returned null".into()));
        }
        // SAFETY: `ptr` points to `len` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Box::new(Pinned {
            ptr,
            len,
            ctx: Arc::clone(&self.ctx),
            restore: None,
        }))
    }
}
