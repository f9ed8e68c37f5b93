//! `ReplayStore`: the Python face of `arpo_buffer::Store`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arpo_buffer::{Config, Error, RestoreOptions, SampleMode, Store, TaskStats};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{to_pyerr, value_error};
use crate::item::{PyBlob, PyItem};

/// How long a blocked call sleeps with the GIL released before it checks for
/// signals (Ctrl-C) and sleeps again.
const SLICE: Duration = Duration::from_millis(100);

type CoreStore = Store<PyBlob>;

/// A concurrent replay store keyed by task (see the `arpo_buffer` package).
#[pyclass(frozen, weakref, name = "ReplayStore", module = "arpo_buffer")]
pub struct PyStore {
    inner: Arc<CoreStore>,
}

fn positive(field: &str, v: i64) -> PyResult<usize> {
    if v < 1 {
        return Err(value_error(format!("{field} must be >= 1, got {v}")));
    }
    Ok(v as usize)
}

fn non_negative(field: &str, v: i64) -> PyResult<usize> {
    if v < 0 {
        return Err(value_error(format!("{field} must be >= 0, got {v}")));
    }
    Ok(v as usize)
}

fn seed_arg(seed: Option<i128>) -> PyResult<Option<u64>> {
    seed.map(|s| {
        u64::try_from(s)
            .map_err(|_| value_error(format!("seed must be an int in [0, 2**64), got {s}")))
    })
    .transpose()
}

/// Parses a timeout in seconds into a deadline (`None`: wait forever).
fn deadline(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() || t < 0.0 => Err(value_error(format!(
            "timeout must be None or a number of seconds >= 0, got {t}"
        ))),
        Some(t) => Ok(Duration::try_from_secs_f64(t)
            .ok()
            .and_then(|d| Instant::now().checked_add(d))),
    }
}

/// Runs a blocking store call: first once without waiting and with the GIL
/// held (the common case, a group already there, costs no GIL hand-off), then
/// in slices with the GIL released, checking for signals between slices, until
/// it succeeds, fails otherwise or the deadline passes (the last slice's
/// timeout error is then returned).
fn blocking<T: Send>(
    py: Python<'_>,
    until: Option<Instant>,
    zero: bool,
    call: impl Fn(Option<Duration>) -> arpo_buffer::Result<T> + Sync,
) -> PyResult<T> {
    match call(Some(Duration::ZERO)) {
        Err(Error::Timeout(msg)) => {
            if zero {
                return Err(to_pyerr(Error::Timeout(msg)));
            }
        }
        other => return other.map_err(to_pyerr),
    }
    loop {
        let slice = if zero {
            Duration::ZERO
        } else {
            match until {
                None => SLICE,
                Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
            }
        };
        match py.detach(|| call(Some(slice))) {
            Err(Error::Timeout(msg)) => {
                let over = zero || until.is_some_and(|d| Instant::now() >= d);
                if over {
                    return Err(to_pyerr(Error::Timeout(msg)));
                }
                py.check_signals()?;
            }
            other => return other.map_err(to_pyerr),
        }
    }
}

fn items_to_list<'py>(
    py: Python<'py>,
    items: Vec<Arc<crate::item::CoreItem>>,
) -> PyResult<Bound<'py, PyList>> {
    let wrapped = items
        .into_iter()
        .map(|inner| PyItem::wrap(py, inner))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, wrapped)
}

fn stats_dict<'py>(py: Python<'py>, s: &TaskStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("fresh", s.fresh)?;
    d.set_item("replay", s.replay)?;
    d.set_item("items", s.fresh + s.replay)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("inserts", s.inserts)?;
    d.set_item("takes", s.takes)?;
    d.set_item("samples", s.samples)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("dropped", s.dropped)?;
    d.set_item("min_version", s.min_version)?;
    d.set_item("max_version", s.max_version)?;
    Ok(d)
}

impl PyStore {
    fn item_of(item: &Bound<'_, PyAny>) -> PyResult<Arc<crate::item::CoreItem>> {
        let item = item.cast::<PyItem>().map_err(|_| {
            value_error(format!(
                "item must be an arpo_buffer.Item, got {}",
                item.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        Ok(Arc::clone(&item.get().inner))
    }
}

#[pymethods]
impl PyStore {
    #[new]
    #[pyo3(signature = (max_bytes = 8 << 30, fresh_capacity = 4096, replay_capacity = 8, seed = None))]
    fn new(
        max_bytes: i64,
        fresh_capacity: i64,
        replay_capacity: i64,
        seed: Option<i128>,
    ) -> PyResult<Self> {
        let config = Config {
            max_bytes: positive("max_bytes", max_bytes)? as u64,
            fresh_capacity: positive("fresh_capacity", fresh_capacity)?,
            replay_capacity: positive("replay_capacity", replay_capacity)?,
            seed: seed_arg(seed)?,
        };
        Ok(PyStore {
            inner: Arc::new(Store::new(config).map_err(to_pyerr)?),
        })
    }

    /// Appends `item` to the fresh queue of `task`.
    fn put(&self, task: &str, item: &Bound<'_, PyAny>) -> PyResult<()> {
        let item = Self::item_of(item)?;
        // Microsecond calls keep the GIL: releasing and re-taking it costs more than
        // the call, and while another thread runs Python the re-take waits for the
        // interpreter's switch interval (5 ms). Nothing here blocks or copies blobs.
        self.inner.put(task, item).map_err(to_pyerr)
    }

    /// Takes the `n` oldest fresh items of `task` at once (FIFO order).
    #[pyo3(signature = (task, n, timeout = None))]
    fn take_group<'py>(
        &self,
        py: Python<'py>,
        task: &str,
        n: i64,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = positive("n", n)?;
        let zero = timeout == Some(0.0);
        let until = deadline(timeout)?;
        let items = blocking(py, until, zero, |t| self.inner.take_group(task, n, t))?;
        items_to_list(py, items)
    }

    /// Number of fresh items of `task` (0 for a task never seen).
    fn fresh_len(&self, task: &str) -> PyResult<usize> {
        self.inner.fresh_len(task).map_err(to_pyerr)
    }

    /// (version, sequence number) of the oldest fresh item of `task`, or None.
    fn fresh_head(&self, task: &str) -> PyResult<Option<(i64, u64)>> {
        self.inner.fresh_head(task).map_err(to_pyerr)
    }

    /// Appends `item` to the replay buffer of `task`.
    #[pyo3(signature = (task, item, priority = 1.0))]
    fn add_success(&self, task: &str, item: &Bound<'_, PyAny>, priority: f64) -> PyResult<()> {
        let item = Self::item_of(item)?;
        // A microsecond call: keeps the GIL (see `put`).
        self.inner
            .add_success(task, item, priority)
            .map_err(to_pyerr)
    }

    /// Samples from the replay buffer of `task`.
    #[pyo3(signature = (task, k, mode = "uniform", min_size = 1, min_version = None))]
    fn sample<'py>(
        &self,
        py: Python<'py>,
        task: &str,
        k: i64,
        mode: &str,
        min_size: i64,
        min_version: Option<i64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let k = non_negative("k", k)?;
        let min_size = positive("min_size", min_size)?;
        let mode: SampleMode = mode.parse().map_err(to_pyerr)?;
        // A microsecond call: keeps the GIL (see `put`).
        let items = self
            .inner
            .sample(task, k, mode, min_size, min_version)
            .map_err(to_pyerr)?;
        items_to_list(py, items)
    }

    /// Blocks until the replay buffer of `task` holds at least `n` items.
    #[pyo3(signature = (task, n, timeout = None))]
    fn wait_min_size(
        &self,
        py: Python<'_>,
        task: &str,
        n: i64,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let n = non_negative("n", n)?;
        let zero = timeout == Some(0.0);
        let until = deadline(timeout)?;
        blocking(py, until, zero, |t| self.inner.wait_min_size(task, n, t))
    }

    /// Sets priorities of replay items by key; returns how many were updated.
    fn update_priorities(
        &self,
        task: &str,
        keys: &Bound<'_, PyAny>,
        priorities: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let keys: Vec<u64> = keys.extract().map_err(|e| {
            value_error(format!(
                "keys must be a sequence of item keys (ints >= 0): {e}"
            ))
        })?;
        let priorities: Vec<f64> = priorities
            .extract()
            .map_err(|e| value_error(format!("priorities must be a sequence of floats: {e}")))?;
        if keys.len() != priorities.len() {
            return Err(value_error(format!(
                "keys and priorities must have the same length, got {} and {}",
                keys.len(),
                priorities.len()
            )));
        }
        let updates: Vec<(u64, f64)> = keys.into_iter().zip(priorities).collect();
        // A microsecond call: keeps the GIL (see `put`).
        self.inner
            .update_priorities(task, &updates)
            .map_err(to_pyerr)
    }

    /// Removes replay items of `task` by key; returns how many were removed.
    fn remove_replay(&self, task: &str, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys: Vec<u64> = keys.extract().map_err(|e| {
            value_error(format!(
                "keys must be a sequence of item keys (ints >= 0): {e}"
            ))
        })?;
        // A microsecond call: keeps the GIL (see `put`).
        self.inner.remove_replay(task, &keys).map_err(to_pyerr)
    }

    /// Number of items in the replay buffer of `task`.
    fn replay_len(&self, task: &str) -> PyResult<usize> {
        self.inner.replay_len(task).map_err(to_pyerr)
    }

    /// Removes items with `version < min_version` from every task and role.
    fn drop_older_than(&self, py: Python<'_>, min_version: i64) -> PyResult<usize> {
        py.detach(|| self.inner.drop_older_than(min_version))
            .map_err(to_pyerr)
    }

    /// Task ids, sorted.
    fn tasks(&self) -> PyResult<Vec<String>> {
        self.inner.tasks().map_err(to_pyerr)
    }

    /// Bytes of all resident items, counted once per residency.
    #[getter]
    fn bytes_used(&self) -> PyResult<u64> {
        self.inner.bytes_used().map_err(to_pyerr)
    }

    /// `{"total": {...}, "tasks": {task: {...}}}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.inner.stats()).map_err(to_pyerr)?;
        let tasks = PyDict::new(py);
        for (name, t) in &s.tasks {
            tasks.set_item(name, stats_dict(py, t)?)?;
        }
        let out = PyDict::new(py);
        out.set_item("total", stats_dict(py, &s.total)?)?;
        out.set_item("tasks", tasks)?;
        Ok(out)
    }

    /// Stats of one task.
    fn task_stats<'py>(&self, py: Python<'py>, task: &str) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.task_stats(task).map_err(to_pyerr)?;
        stats_dict(py, &s)
    }

    /// Writes a snapshot of the whole store to `path` (atomic replace).
    fn snapshot(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| self.inner.snapshot(&path)).map_err(to_pyerr)
    }

    /// Loads a store from a snapshot; `None` keeps the snapshot's settings.
    #[staticmethod]
    #[pyo3(signature = (path, max_bytes = None, fresh_capacity = None, replay_capacity = None, seed = None))]
    fn restore(
        path: PathBuf,
        max_bytes: Option<i64>,
        fresh_capacity: Option<i64>,
        replay_capacity: Option<i64>,
        seed: Option<i128>,
    ) -> PyResult<Self> {
        let options = RestoreOptions {
            max_bytes: max_bytes
                .map(|v| positive("max_bytes", v).map(|v| v as u64))
                .transpose()?,
            fresh_capacity: fresh_capacity
                .map(|v| positive("fresh_capacity", v))
                .transpose()?,
            replay_capacity: replay_capacity
                .map(|v| positive("replay_capacity", v))
                .transpose()?,
            seed: seed_arg(seed)?,
        };
        // Holds the GIL: every restored blob becomes a new `bytes` object.
        let store = Store::restore(&path, options).map_err(to_pyerr)?;
        Ok(PyStore {
            inner: Arc::new(store),
        })
    }

    /// Closes the store; later calls raise BufferClosed, waiters wake with it.
    fn close(&self) {
        self.inner.close();
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// The configuration: max_bytes, fresh_capacity, replay_capacity.
    #[getter]
    fn max_bytes(&self) -> u64 {
        self.inner.config().max_bytes
    }

    #[getter]
    fn fresh_capacity(&self) -> usize {
        self.inner.config().fresh_capacity
    }

    #[getter]
    fn replay_capacity(&self) -> usize {
        self.inner.config().replay_capacity
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> bool {
        self.inner.close();
        false
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "ReplayStore(max_bytes={}, fresh_capacity={}, replay_capacity={}, closed={})",
            c.max_bytes,
            c.fresh_capacity,
            c.replay_capacity,
            self.inner.is_closed()
        )
    }
}
