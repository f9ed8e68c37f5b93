//! The only crate that knows about Python: bindings of `arpo-buffer` as `arpo._buffer`.
use pyo3::prelude::*;

#[pymodule(gil_used = false)]
fn _buffer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
