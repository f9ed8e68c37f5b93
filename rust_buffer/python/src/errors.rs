//! The one place where store errors become Python exceptions.
//!
//! The classes are the package's own, defined in Python (`arpo_buffer/_errors.py`, where
//! multiple inheritance gives `BufferValueError` a `ValueError` base and so on); they are
//! imported once and cached. Nothing here imports anything outside `arpo_buffer`.

use arpo_buffer::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

struct Classes {
    value: Py<PyType>,
    timeout: Py<PyType>,
    closed: Py<PyType>,
    unknown_task: Py<PyType>,
    snapshot: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

fn classes(py: Python<'_>) -> PyResult<&Classes> {
    CLASSES.get_or_try_init(py, || {
        let m = py.import("arpo_buffer._errors")?;
        let get = |name: &str| -> PyResult<Py<PyType>> {
            Ok(m.getattr(name)?.cast_into::<PyType>()?.unbind())
        };
        Ok(Classes {
            value: get("BufferValueError")?,
            timeout: get("BufferTimeout")?,
            closed: get("BufferClosed")?,
            unknown_task: get("UnknownTask")?,
            snapshot: get("SnapshotError")?,
        })
    })
}

/// Maps every store error to its `arpo_buffer` class (the only mapping).
pub fn to_pyerr(err: Error) -> PyErr {
    Python::attach(|py| {
        let c = match classes(py) {
            Ok(c) => c,
            Err(import_error) => return import_error,
        };
        let msg = err.to_string();
        let class = match err {
            Error::Value(_) => &c.value,
            Error::Timeout(_) => &c.timeout,
            Error::Closed => &c.closed,
            Error::UnknownTask(_) => &c.unknown_task,
            Error::Snapshot(_) => &c.snapshot,
        };
        PyErr::from_type(class.bind(py).clone(), (msg,))
    })
}

/// A `BufferValueError` with `msg` (argument validation in the binding).
pub fn value_error(msg: impl Into<String>) -> PyErr {
    to_pyerr(Error::Value(msg.into()))
}
