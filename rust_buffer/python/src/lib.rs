//! The only crate that knows about Python: bindings of `arpo-buffer` as
//! `arpo_buffer._native`, the compiled part of the `arpo_buffer` package
//! (`pyproject.toml` here; the package re-exports it with its exception classes).
//!
//! Every method extracts and validates its arguments first, then does the work
//! with the GIL released (`Python::detach`) where that pays: blocking waits, snapshots,
//! large copies; blocking calls wait in slices and
//! check for signals between them. Nothing here relies on the GIL for safety:
//! the store is thread-safe on its own, so free-threaded Python is fine.

use pyo3::prelude::*;

mod errors;
mod item;
mod store;

#[pymodule(gil_used = false)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SNAPSHOT_FORMAT_VERSION", arpo_buffer::FORMAT_VERSION)?;
    m.add_class::<item::PyItem>()?;
    m.add_class::<store::PyStore>()?;
    Ok(())
}
