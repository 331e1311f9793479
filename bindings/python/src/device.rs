//! Device batches in Python: each column exports DLPack (and `__cuda_array_interface__`)
//! over a device slot lent by `stokehold::cuda::DeviceSlots`.
//!
//! `__dlpack__(stream=s)` makes the consumer's stream `s` wait for the batch's copy on
//! the device, and names `s` for the slot's release: once the batch, its columns and
//! every tensor made from them are gone, an event is recorded on `s`, and the slot is
//! copied into again only after it.

use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex};

use numpy::PyArray1;
use pyo3::exceptions::{PyBufferError, PyKeyError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use stokehold::cuda::{DeviceSlots, LentBatch, Reserved, StreamHandle, LEGACY_STREAM};
use stokehold::{Column, DType};

use crate::error;

/// DLPack's device type of CUDA memory (`kDLCUDA`).
const KDL_CUDA: i32 = 2;

/// The capsule's name while nobody has taken the tensor.
const DLTENSOR: &CStr = c"dltensor";

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// A tensor handed to a consumer, with what it points into: the shape, and the batch
/// (whose slot stays lent while this lives). `tensor` comes first, so a pointer to it
/// is a pointer to the whole.
#[repr(C)]
struct Managed {
    tensor: DLManagedTensor,
    shape: Vec<i64>,
    /// Let go as any other handle (`Held`): without the GIL if it is the last one, and
    /// leaked in a forked child, where CUDA cannot be used.
    batch: Held,
}

/// DLPack's deleter: frees the tensor and lets go of its batch.
unsafe extern "C" fn delete(tensor: *mut DLManagedTensor) {
    if !tensor.is_null() {
        // SAFETY: every tensor with this deleter is the first field of a `Managed`
        // leaked from a Box in `__dlpack__`, and the deleter is called once.
        drop(unsafe { Box::from_raw(tensor.cast::<Managed>()) });
    }
}

/// The capsule's destructor: a tensor nobody took (the capsule still named
/// "dltensor") is deleted; one a consumer took (renamed "used_dltensor") is the
/// consumer's to delete.
unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule, which is valid; the name check comes
    // before the pointer is read, so no exception is raised.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let p = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr());
            delete(p.cast::<DLManagedTensor>());
        }
    }
}

/// DLPack's code and bits of a column type.
fn dl_dtype(d: DType) -> DLDataType {
    let (code, bits) = match d {
        DType::Bool => (6, 8),
        DType::U8 => (1, 8),
        DType::I8 => (0, 8),
        DType::U16 => (1, 16),
        DType::I16 => (0, 16),
        DType::U32 => (1, 32),
        DType::I32 => (0, 32),
        DType::U64 => (1, 64),
        DType::I64 => (0, 64),
        DType::F16 => (2, 16),
        DType::F32 => (2, 32),
        DType::F64 => (2, 64),
    };
    DLDataType {
        code,
        bits,
        lanes: 1,
    }
}

/// The device side of a loader: its slots, lent one batch at a time.
pub(crate) type Slots = Arc<Mutex<DeviceSlots>>;

/// Waits for a free device slot and keeps it for this call's `lend`, with the GIL
/// released: called before a batch is taken from the epoch, so that a loop holding
/// every slot gets its error with the batch still in the epoch (each thread that takes
/// batches keeps its own slot). The wait stops every 20 ms (the slots' interrupt check)
/// to run Python's signal handlers, with the slots' lock let go; what they raise
/// (Ctrl-C's `KeyboardInterrupt`) leaves the batch in the epoch.
pub(crate) fn reserve(py: Python<'_>, slots: &Slots) -> PyResult<Reserved> {
    loop {
        let slots = Arc::clone(slots);
        match py.detach(move || slots.lock().unwrap_or_else(|e| e.into_inner()).reserve()) {
            Err(stokehold::Error::Interrupted) => py.check_signals()?,
            done => return done.map_err(error),
        }
    }
}

/// Waits for the copies still in flight (without the GIL): at an epoch's end, so that
/// a fault in its last copies is found in it.
pub(crate) fn drain(py: Python<'_>, slots: &Slots) -> stokehold::Result<()> {
    let slots = Arc::clone(slots);
    py.detach(move || slots.lock().unwrap_or_else(|e| e.into_inner()).drain())
}

/// Copies `batch` into the slot `reserved` keeps, or else a free slot of `slots`
/// (without the GIL: it may wait for one).
pub(crate) fn lend(
    py: Python<'_>,
    slots: &Slots,
    reserved: Option<Reserved>,
    batch: stokehold::HostBatch,
) -> stokehold::Result<Arc<LentBatch>> {
    let slots = Arc::clone(slots);
    let lent = py.detach(move || {
        let mut s = slots.lock().unwrap_or_else(|e| e.into_inner());
        match reserved {
            Some(r) => s.lend_reserved(r, batch),
            None => s.lend(batch),
        }
    });
    lent.map(Arc::new)
}

/// A device batch held by a Python object, let go without the GIL: the last handle of
/// the slots (the loader already gone) waits for the consumers' streams, whose work may
/// need the GIL (a host callback).
/// In a forked child (a DataLoader worker), where CUDA cannot be used, it is leaked
/// instead.
pub(crate) struct Held {
    batch: Option<Arc<LentBatch>>,
    /// The process the batch was lent in.
    pid: u32,
}

impl Held {
    pub(crate) fn new(batch: Arc<LentBatch>) -> Held {
        Held {
            batch: Some(batch),
            pid: std::process::id(),
        }
    }

    /// Fails in a forked child of the process the batch was lent in.
    fn here(&self) -> PyResult<()> {
        crate::forked(self.pid)
    }

    /// Another handle of the batch, of the process it was lent in.
    fn share(&self) -> Held {
        Held {
            batch: Some(Arc::clone(self)),
            pid: self.pid,
        }
    }
}

impl std::ops::Deref for Held {
    type Target = Arc<LentBatch>;

    fn deref(&self) -> &Arc<LentBatch> {
        self.batch
            .as_ref()
            .expect("a held batch is let go only when dropped")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut batch = self.batch.take();
        if std::process::id() != self.pid {
            std::mem::forget(batch);
            return;
        }
        // The last handle goes without the GIL where this thread holds it (the release
        // may wait for the device on a driver error). The GIL is never taken here: the
        // deleter of a tensor made from the batch runs on whatever thread frees it (an
        // autograd thread, holding a lock of its own), which must not wait for it.
        if batch.as_ref().is_some_and(|b| Arc::strong_count(b) == 1) && holds_gil() {
            Python::try_attach(|py| py.detach(|| drop(batch.take())));
        }
        drop(batch);
    }
}

/// Whether this thread holds the GIL (`PyGILState_Check`, exported by every CPython
/// since 3.4 though outside the limited API that pyo3's abi3 bindings declare).
fn holds_gil() -> bool {
    unsafe extern "C" {
        fn PyGILState_Check() -> std::ffi::c_int;
    }
    // SAFETY: reads this thread's own interpreter state; callable with or without
    // the GIL, from any thread, once the interpreter is initialised (a batch exists
    // only in a running interpreter).
    unsafe { PyGILState_Check() == 1 }
}

/// One batch on the device: a DLPack column per name, and the samples on the host.
#[pyclass(module = "stokehold._stokehold", name = "_DeviceBatch")]
pub(crate) struct DeviceBatch {
    pub(crate) batch: Held,
    pub(crate) columns: Arc<[Column]>,
}

#[pymethods]
impl DeviceBatch {
    /// Column `key` in device memory, shaped `(samples, *sample_shape)`.
    fn column(&self, key: &str) -> PyResult<DeviceArray> {
        self.batch.here()?;
        let c = self
            .columns
            .iter()
            .position(|c| c.name == key)
            .ok_or_else(|| {
                let names: Vec<&str> = self.columns.iter().map(|c| c.name.as_str()).collect();
                PyKeyError::new_err(format!("no column {key:?}; the columns are {names:?}"))
            })?;
        let col = &self.columns[c];
        let mut shape = vec![self.batch.len() as i64];
        shape.extend(col.shape.iter().map(|&d| d as i64));
        Ok(DeviceArray {
            batch: self.batch.share(),
            ptr: self.batch.column_ptr(c),
            dtype: col.dtype,
            shape,
            synced: Default::default(),
        })
    }

    /// The samples of the batch (global indices), a `uint64` array on the host.
    #[getter]
    fn indices<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        PyArray1::from_slice(py, self.batch.indices())
    }

    fn __len__(&self) -> usize {
        self.batch.len()
    }

    /// The epoch the batch belongs to.
    #[getter]
    fn epoch(&self) -> u64 {
        self.batch.epoch()
    }

    /// The batch's number in its epoch.
    #[getter]
    fn number(&self) -> u64 {
        self.batch.number()
    }

    /// The device slot it was copied into.
    #[getter]
    fn slot(&self) -> usize {
        self.batch.slot()
    }

    /// Waits on the host until the batch's copy is done (for code that reads the
    /// memory without naming a stream).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        self.batch.here()?;
        let batch = Arc::clone(&self.batch);
        py.detach(move || batch.synchronize()).map_err(error)
    }
}

/// One column of a device batch: exports DLPack for `torch.from_dlpack`,
/// `jax.dlpack.from_dlpack` and CuPy, and `__cuda_array_interface__`.
#[pyclass(module = "stokehold._stokehold", name = "_DeviceArray")]
pub(crate) struct DeviceArray {
    batch: Held,
    ptr: u64,
    dtype: DType,
    shape: Vec<i64>,
    /// Whether the host has waited for the batch's copy (for the array interface, which
    /// CuPy, Numba and `torch.as_tensor` probe, maybe many times).
    synced: std::sync::atomic::AtomicBool,
}

#[pymethods]
impl DeviceArray {
    /// The DLPack capsule of the column. `stream` is the consumer's CUDA stream: it
    /// waits for the batch's copy on the device, and the slot is reused only after it
    /// has run what is enqueued on it before the tensor is freed. `None` or 1 is the
    /// legacy default stream, 2 the per-thread default stream; -1 asks for no wait
    /// (the consumer orders itself; the release is recorded on the legacy stream).
    #[pyo3(signature = (stream=None, *, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.batch.here()?;
        // A producer may answer any `max_version` with the unversioned capsule.
        let _ = max_version;
        let device = (KDL_CUDA, self.batch.device() as i32);
        if dl_device.is_some_and(|d| d != device) {
            return Err(PyBufferError::new_err(format!(
                "a stokehold device batch lives on device {device:?} and cannot be exported \
                 to {dl_device:?}"
            )));
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "a stokehold device batch is exported without a copy (copy=True asked for one)",
            ));
        }
        match stream {
            None => self.wait(py, LEGACY_STREAM)?,
            // SAFETY: the legacy default stream is every context's, and never destroyed.
            Some(-1) => unsafe { self.batch.used_on(LEGACY_STREAM) },
            Some(s) if s > 0 => self.wait(py, s as StreamHandle)?,
            Some(s) => {
                return Err(PyBufferError::new_err(format!(
                    "stream {s}: give the consumer's CUDA stream (1 for the legacy default \
                     stream, 2 for the per-thread one, -1 for none; 0 is ambiguous)"
                )))
            }
        }
        let mut managed = Box::new(Managed {
            tensor: DLManagedTensor {
                dl_tensor: DLTensor {
                    data: self.ptr as *mut c_void,
                    device: DLDevice {
                        device_type: device.0,
                        device_id: device.1,
                    },
                    ndim: self.shape.len() as i32,
                    dtype: dl_dtype(self.dtype),
                    shape: std::ptr::null_mut(),
                    strides: std::ptr::null_mut(),
                    byte_offset: 0,
                },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete),
            },
            shape: self.shape.clone(),
            batch: self.batch.share(),
        });
        managed.tensor.dl_tensor.shape = managed.shape.as_mut_ptr();
        let tensor = Box::into_raw(managed).cast::<c_void>();
        // SAFETY: `tensor` points to a live `Managed` whose first field is the
        // `DLManagedTensor`; the capsule owns it until a consumer renames the capsule
        // and takes it (then the consumer calls `delete`), else its destructor deletes it.
        let capsule = unsafe {
            pyo3::ffi::PyCapsule_New(tensor, DLTENSOR.as_ptr(), Some(capsule_destructor))
        };
        if capsule.is_null() {
            // SAFETY: the capsule was not made, so nothing else owns the tensor.
            unsafe { delete(tensor.cast()) };
        }
        // SAFETY: a new reference, or null with the exception set.
        unsafe { Bound::from_owned_ptr_or_err(py, capsule) }
    }

    /// `(kDLCUDA, device ordinal)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (KDL_CUDA, self.batch.device() as i32)
    }

    /// The CUDA Array Interface (version 3). It names no stream: the host waits for the
    /// batch's copy before answering, and the slot's release is recorded on the legacy
    /// default stream (prefer DLPack, which orders the consumer's own stream on the
    /// device).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.batch.here()?;
        // SAFETY: the legacy default stream is every context's, and never destroyed.
        unsafe { self.batch.used_on(LEGACY_STREAM) };
        let d = PyDict::new(py);
        let shape: Vec<i64> = self.shape.clone();
        d.set_item("shape", pyo3::types::PyTuple::new(py, shape)?)?;
        d.set_item("typestr", self.dtype.descr())?;
        d.set_item("data", (self.ptr, false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        // The copy is done once the host has waited for it (once): no stream to name.
        if !self.synced.load(std::sync::atomic::Ordering::Acquire) {
            let batch = Arc::clone(&self.batch);
            py.detach(move || batch.synchronize()).map_err(error)?;
            self.synced
                .store(true, std::sync::atomic::Ordering::Release);
        }
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    /// The shape: `(samples, *sample_shape)`, a tuple, as a NumPy array's.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// The element type, a `numpy.dtype`, as a NumPy array's.
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("numpy")?
            .getattr("dtype")?
            .call1((self.dtype.name(),))
    }

    /// The device address of the first element.
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes of the column in this batch.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.shape.iter().product::<i64>() as u64 * self.dtype.size() as u64
    }

    /// The device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.batch.device()
    }
}

impl DeviceArray {
    /// Makes `stream` wait for the copy, without the GIL.
    fn wait(&self, py: Python<'_>, stream: StreamHandle) -> PyResult<()> {
        let batch = Arc::clone(&self.batch);
        // SAFETY: DLPack's `__dlpack__(stream=s)` contract: `s` is the consumer's live
        // stream on the batch's device (or 1, 2: the legacy and per-thread default
        // streams), used for the tensor and kept until the tensor, and so the batch
        // this export holds, is let go.
        py.detach(move || unsafe { batch.wait_on(stream) })
            .map_err(error)
    }
}
