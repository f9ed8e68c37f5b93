//! `Item`: an immutable trajectory whose arrays are exposed as read-only numpy
//! views and whose blobs are the caller's own objects, kept by reference.
//!
//! A blob is `bytes`, a `zmq.Frame`, or a read-only, C-contiguous memoryview
//! whose underlying object is `bytes` or a `zmq.Frame`. Anything else (a
//! bytearray, a numpy array, an mmap, a writable memoryview) is rejected: its
//! memory could change or go away while the store reads it.

use std::ffi::c_void;
use std::sync::Arc;

use arpo_buffer::{Blob, Item};
use numpy::npyffi::{self, npy_intp, NpyTypes, PY_ARRAY_API};
use numpy::prelude::*;
use numpy::{Element, PyArray1, PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray};
use pyo3::basic::CompareOp;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyInt, PyMemoryView, PyTuple, PyType};

use crate::errors::value_error;

/// A Python object whose bytes the store holds without copying them.
///
/// `ptr`/`len` are read once from the object's buffer, and the buffer export
/// is released right away (so dropping a `PyBlob` never needs the GIL: the
/// store drops items with the GIL released). The memory stays valid and
/// unchanged for as long as `owner` is alive, which this struct guarantees by
/// holding it:
///
/// - `bytes` is immutable and CPython never moves an object;
/// - a `zmq.Frame` owns a libzmq message whose data stays where it is until
///   the frame is deallocated (the data is inline in the frame object for
///   small messages, a heap block for larger ones); pyzmq exports it as
///   writable, but nothing writes to a frame it received, and a frame made
///   zero-copy over a mutable object carries pyzmq's own rule (do not modify
///   the object while the frame is in use);
/// - for a memoryview, `owner` is the object it views (`bytes` or a
///   `zmq.Frame`), held separately from the view, so releasing the view
///   (`memoryview.release()`) cannot free the memory.
///
/// Reading the bytes needs no GIL, so the store may read blobs (snapshots)
/// with the GIL released.
pub struct PyBlob {
    /// The object given (returned by `Item.blobs`).
    obj: Py<PyAny>,
    /// The object that owns the memory, when it is not `obj` (a memoryview's base).
    _owner: Option<Py<PyAny>>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointed-to bytes are immutable and owned by `obj`/`_owner`
// (`Py<T>`, itself Send + Sync); see the struct docs.
unsafe impl Send for PyBlob {}
// SAFETY: as above; shared reads of immutable memory.
unsafe impl Sync for PyBlob {}

/// `zmq.Frame`, once `zmq` has been imported by someone (this module never
/// imports it: without pyzmq there are no frames to accept).
fn zmq_frame_type(py: Python<'_>) -> PyResult<Option<Bound<'_, PyType>>> {
    static FRAME: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    if let Some(t) = FRAME.get(py) {
        return Ok(Some(t.bind(py).clone()));
    }
    let modules = PyModule::import(py, "sys")?.getattr("modules")?;
    let Some(zmq) = modules.cast::<PyDict>()?.get_item("zmq")? else {
        return Ok(None);
    };
    let Ok(frame) = zmq.getattr("Frame") else {
        return Ok(None);
    };
    let frame = frame.cast_into::<PyType>().map_err(PyErr::from)?;
    let _ = FRAME.set(py, frame.clone().unbind());
    Ok(Some(frame))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

impl PyBlob {
    pub fn new(bytes: &Bound<'_, PyBytes>) -> Self {
        let data = bytes.as_bytes();
        PyBlob {
            ptr: data.as_ptr(),
            len: data.len(),
            obj: bytes.clone().into_any().unbind(),
            _owner: None,
        }
    }

    /// Blob `index` of an item: `bytes`, a `zmq.Frame` or a read-only
    /// memoryview of one of them (see the struct docs), kept by reference.
    pub fn from_object(blob: &Bound<'_, PyAny>, index: usize) -> PyResult<Self> {
        if let Ok(bytes) = blob.cast::<PyBytes>() {
            return Ok(PyBlob::new(bytes));
        }
        let py = blob.py();
        let frame_type = zmq_frame_type(py)?;
        let is_frame = |o: &Bound<'_, PyAny>| -> PyResult<bool> {
            match &frame_type {
                Some(t) => o.is_instance(t),
                None => Ok(false),
            }
        };
        let view = blob.cast::<PyMemoryView>().ok();
        let owner = match view {
            Some(mv) => {
                let base = mv.getattr("obj").map_err(|e| {
                    value_error(format!(
                        "blobs[{index}] is a memoryview that cannot be read: {e}"
                    ))
                })?;
                if !(base.is_instance_of::<PyBytes>() || is_frame(&base)?) {
                    return Err(value_error(format!(
                        "blobs[{index}] is a memoryview of a {}: only views of bytes or of a \
                         zmq.Frame are kept by reference (their memory cannot change); pass \
                         bytes(blob) to store a copy",
                        type_name(&base)
                    )));
                }
                Some(base)
            }
            None if is_frame(blob)? => None,
            None => {
                return Err(value_error(format!(
                    "blobs[{index}] must be bytes, a zmq.Frame or a read-only memoryview of \
                     one, got {}: pass bytes(blob) to store a copy",
                    type_name(blob)
                )))
            }
        };
        // A simple (contiguous, untyped) export, released right away with the
        // GIL held: the pointer stays valid through `owner` (see the struct
        // docs), and nothing is left to release when the blob is dropped.
        let mut raw = std::mem::MaybeUninit::<ffi::Py_buffer>::uninit();
        // SAFETY: `blob` is a live object; on success `raw` is initialised.
        if unsafe { ffi::PyObject_GetBuffer(blob.as_ptr(), raw.as_mut_ptr(), ffi::PyBUF_SIMPLE) }
            != 0
        {
            let e = PyErr::fetch(py);
            return Err(value_error(format!(
                "blobs[{index}] cannot be read as contiguous bytes: {e}"
            )));
        }
        // SAFETY: initialised by the successful call above.
        let mut raw = unsafe { raw.assume_init() };
        let (ptr, len, readonly) = (raw.buf as *const u8, raw.len as usize, raw.readonly != 0);
        // SAFETY: releases the export obtained above, once.
        unsafe { ffi::PyBuffer_Release(&mut raw) };
        if view.is_some() && !readonly {
            return Err(value_error(format!(
                "blobs[{index}] is a writable memoryview: its content could change under the \
                 store; pass view.toreadonly() (a view of bytes or a zmq.Frame) or bytes(view)"
            )));
        }
        Ok(PyBlob {
            obj: blob.clone().unbind(),
            _owner: owner.map(Bound::unbind),
            ptr,
            len,
        })
    }

    pub fn object<'py>(&self, py: Python<'py>) -> &Bound<'py, PyAny> {
        self.obj.bind(py)
    }
}

impl AsRef<[u8]> for PyBlob {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            // An empty buffer's pointer may be null (an empty zmq message).
            return &[];
        }
        // SAFETY: see the struct docs.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Blob for PyBlob {
    /// Used by restore: makes a new `bytes` object (one copy).
    fn from_vec(bytes: Vec<u8>) -> Self {
        Python::attach(|py| PyBlob::new(&PyBytes::new(py, &bytes)))
    }
}

pub type CoreItem = Item<PyBlob>;

/// One trajectory: token ids, behaviour log-probs, per-turn offsets,
/// reward(s), policy version, blobs and metadata. Immutable.
#[pyclass(frozen, weakref, name = "Item", module = "arpo_buffer")]
pub struct PyItem {
    pub inner: Arc<CoreItem>,
}

/// Array input before copying: either already owned, or a view of a
/// C-contiguous numpy array (copied later with the GIL released).
enum Input<'py, T: Element> {
    Owned(Vec<T>),
    View(PyReadonlyArray1<'py, T>),
}

/// Array copies at least this large are made with the GIL released.
const DETACH_COPY_BYTES: usize = 1 << 20;

/// A slice that may cross into `Python::detach`: the numpy arrays it points
/// into are kept alive (and borrowed read-only) by the caller's `Input`s.
struct RawSlice<T>(*const T, usize);
// SAFETY: only read inside `detach` while the owning arrays are alive.
unsafe impl<T> Send for RawSlice<T> {}

impl<T: Copy> RawSlice<T> {
    fn to_vec(&self) -> Vec<T> {
        // SAFETY: see the type docs; an empty array has a dangling but
        // aligned pointer, which `from_raw_parts` accepts for length 0.
        unsafe { std::slice::from_raw_parts(self.0, self.1) }.to_vec()
    }
}

impl<T: Element + Copy> Input<'_, T> {
    fn raw(&self) -> Option<RawSlice<T>> {
        match self {
            Input::View(a) => a.as_slice().ok().map(|s| RawSlice(s.as_ptr(), s.len())),
            Input::Owned(_) => None,
        }
    }
    fn finish(self, raw: Option<Vec<T>>) -> Vec<T> {
        match (self, raw) {
            (_, Some(v)) => v,
            (Input::Owned(v), None) => v,
            (Input::View(a), None) => a.as_array().to_vec(),
        }
    }
}

/// Reads one array field: a 1-D numpy array of exactly the dtype `T`, or a
/// sequence (or, with `scalar_ok`, a single number) converted element-wise.
fn array_field<'py, T: Element + Copy>(
    field: &str,
    obj: &Bound<'py, PyAny>,
    dtype_name: &str,
    scalar_ok: bool,
    from_seq: impl Fn(&Bound<'py, PyAny>) -> PyResult<Vec<T>>,
) -> PyResult<Input<'py, T>> {
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(value_error(format!(
                "{field} must be a 1-D array, got ndim={} (shape {:?})",
                arr.ndim(),
                arr.shape()
            )));
        }
        if !arr.dtype().is_equiv_to(&numpy::dtype::<T>(py)) {
            return Err(value_error(format!(
                "{field} must have dtype {dtype_name}, got {}: convert with \
                 .astype(np.{dtype_name})",
                arr.dtype()
            )));
        }
        let typed = arr.cast::<PyArray1<T>>().map_err(PyErr::from)?;
        return Ok(Input::View(typed.try_readonly().map_err(|e| {
            value_error(format!("{field}: cannot read the array: {e}"))
        })?));
    }
    if scalar_ok && (obj.is_instance_of::<PyFloat>() || obj.is_instance_of::<PyInt>()) {
        return from_seq(&PyTuple::new(py, [obj])?.into_any()).map(Input::Owned);
    }
    from_seq(obj).map(Input::Owned).map_err(|e| {
        value_error(format!(
            "{field} must be a 1-D numpy {dtype_name} array or a sequence of numbers: {e}"
        ))
    })
}

fn blob_list(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<PyBlob>> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    if obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<pyo3::types::PyString>()
        || obj.is_instance_of::<PyMemoryView>()
        || zmq_frame_type(obj.py())?.is_some_and(|t| obj.is_instance(&t).unwrap_or(false))
    {
        return Err(value_error(format!(
            "blobs must be a sequence of blobs, got a single {}: wrap it as (blob,)",
            type_name(obj)
        )));
    }
    let iter = obj.try_iter().map_err(|_| {
        value_error(format!(
            "blobs must be a sequence of bytes / zmq.Frame / read-only memoryview objects, \
             got {}",
            type_name(obj)
        ))
    })?;
    let mut blobs = Vec::new();
    for (i, b) in iter.enumerate() {
        blobs.push(PyBlob::from_object(&b?, i)?);
    }
    Ok(blobs)
}

/// A read-only numpy array over `data`, which lives inside `owner`'s item;
/// the array's `base` is `owner`, which keeps the item alive.
fn view<'py, T: Element>(owner: &Bound<'py, PyItem>, data: &[T]) -> PyResult<Bound<'py, PyAny>> {
    let py = owner.py();
    let mut dims = [data.len() as npy_intp];
    // SAFETY: `data` is owned by `owner.inner` (immutable, never reallocated)
    // and `owner` becomes the array's base object, so the memory outlives the
    // array. Flags 0 = not writeable; numpy computes contiguity/alignment.
    unsafe {
        let ptr = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, NpyTypes::PyArray_Type),
            T::get_dtype(py).into_dtype_ptr(),
            1,
            dims.as_mut_ptr(),
            std::ptr::null_mut(),
            data.as_ptr() as *mut c_void,
            0,
            std::ptr::null_mut(),
        );
        if ptr.is_null() {
            return Err(PyErr::fetch(py));
        }
        let array = Bound::from_owned_ptr(py, ptr);
        // Steals the reference it is given.
        if PY_ARRAY_API.PyArray_SetBaseObject(
            py,
            ptr as *mut npyffi::PyArrayObject,
            owner.clone().into_ptr(),
        ) < 0
        {
            return Err(PyErr::fetch(py));
        }
        Ok(array)
    }
}

impl PyItem {
    pub fn wrap(py: Python<'_>, inner: Arc<CoreItem>) -> PyResult<Bound<'_, PyItem>> {
        Bound::new(py, PyItem { inner })
    }
}

#[pymethods]
impl PyItem {
    #[new]
    #[pyo3(
        signature = (tokens, logprobs, offsets, rewards, version, blobs=None, metadata=None),
        text_signature = "(tokens, logprobs, offsets, rewards, version, blobs=(), metadata=b'')"
    )]
    #[allow(clippy::too_many_arguments)] // mirrors the Python signature
    fn new(
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        logprobs: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        rewards: &Bound<'_, PyAny>,
        version: &Bound<'_, PyAny>,
        blobs: Option<&Bound<'_, PyAny>>,
        metadata: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let ints = |o: &Bound<'_, PyAny>| o.extract::<Vec<i32>>();
        let floats = |o: &Bound<'_, PyAny>| o.extract::<Vec<f32>>();
        let tokens = array_field("tokens", tokens, "int32", false, ints)?;
        let logprobs = array_field("logprobs", logprobs, "float32", false, floats)?;
        let offsets = array_field("offsets", offsets, "int32", false, ints)?;
        let rewards = array_field("rewards", rewards, "float32", true, floats)?;
        if version.is_instance_of::<pyo3::types::PyBool>() {
            return Err(value_error("version must be an int, got bool"));
        }
        let version: i64 = version.extract().map_err(|e| {
            value_error(format!("version must be an int (the policy version): {e}"))
        })?;
        let blobs = blob_list(blobs)?;
        let metadata = match metadata {
            None => PyBlob::new(&PyBytes::new(py, b"")),
            Some(m) => PyBlob::new(m.cast::<PyBytes>().map_err(|_| {
                value_error(format!(
                    "metadata must be bytes, got {}",
                    m.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                ))
            })?),
        };
        // Copy the arrays out of numpy; large arrays with the GIL released. Small
        // ones (a trajectory's tokens are tens of KB, a few microseconds to copy)
        // keep the GIL: a hand-off would cost more than the copy.
        let raws = (tokens.raw(), logprobs.raw(), offsets.raw(), rewards.raw());
        let len = |n: Option<usize>| n.unwrap_or(0);
        let size = 4
            * (len(raws.0.as_ref().map(|r| r.1))
                + len(raws.1.as_ref().map(|r| r.1))
                + len(raws.2.as_ref().map(|r| r.1))
                + len(raws.3.as_ref().map(|r| r.1)));
        let copy = move || {
            (
                raws.0.map(|r| r.to_vec()),
                raws.1.map(|r| r.to_vec()),
                raws.2.map(|r| r.to_vec()),
                raws.3.map(|r| r.to_vec()),
            )
        };
        let copies = if size >= DETACH_COPY_BYTES {
            py.detach(copy)
        } else {
            copy()
        };
        let (tokens, offsets) = (tokens.finish(copies.0), offsets.finish(copies.2));
        if let Some((i, &o)) = offsets
            .iter()
            .enumerate()
            .find(|&(_, &o)| o < 0 || o as usize > tokens.len())
        {
            return Err(value_error(format!(
                "offsets[{i}] = {o} is outside [0, {}] (the item has {} tokens): offsets \
                 index or count the item's own tokens",
                tokens.len(),
                tokens.len()
            )));
        }
        let item = Item::new(
            tokens,
            logprobs.finish(copies.1),
            offsets,
            rewards.finish(copies.3),
            version,
            blobs,
            metadata,
        );
        Ok(PyItem {
            inner: Arc::new(item),
        })
    }

    /// Unique key, assigned at construction.
    #[getter]
    fn key(&self) -> u64 {
        self.inner.key()
    }

    /// Token ids (read-only int32 view).
    #[getter]
    fn tokens<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let data = slf.get().inner.tokens();
        view(slf, data)
    }

    /// Behaviour log-probs (read-only float32 view).
    #[getter]
    fn logprobs<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let data = slf.get().inner.logprobs();
        view(slf, data)
    }

    /// Per-turn offsets (read-only int32 view).
    #[getter]
    fn offsets<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let data = slf.get().inner.offsets();
        view(slf, data)
    }

    /// Reward(s) (read-only float32 view).
    #[getter]
    fn rewards<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let data = slf.get().inner.rewards();
        view(slf, data)
    }

    /// Policy version that produced the trajectory.
    #[getter]
    fn version(&self) -> i64 {
        self.inner.version()
    }

    /// The blobs: the very objects given at construction (`bytes` after a restore).
    #[getter]
    fn blobs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.blobs().iter().map(|b| b.object(py)))
    }

    /// The metadata `bytes` object given at construction.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        // Metadata is only ever made from `bytes` (construction and restore).
        Ok(self.inner.metadata().object(py).cast::<PyBytes>()?.clone())
    }

    /// Bytes charged to the store's budget per residency.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.nbytes()
    }

    fn __repr__(&self) -> String {
        let it = &self.inner;
        format!(
            "Item(key={}, version={}, tokens={}, blobs={}, nbytes={})",
            it.key(),
            it.version(),
            it.tokens().len(),
            it.blobs().len(),
            it.nbytes()
        )
    }

    /// Items compare equal when they are the same item (same key).
    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> PyResult<Py<PyAny>> {
        let py = other.py();
        let Ok(other) = other.cast::<PyItem>() else {
            return Ok(py.NotImplemented());
        };
        let same = self.inner.key() == other.get().inner.key();
        match op {
            CompareOp::Eq => Ok(same.into_pyobject(py)?.to_owned().into_any().unbind()),
            CompareOp::Ne => Ok((!same).into_pyobject(py)?.to_owned().into_any().unbind()),
            _ => Ok(py.NotImplemented()),
        }
    }

    fn __hash__(&self) -> u64 {
        self.inner.key()
    }
}
