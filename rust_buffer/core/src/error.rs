//! The store's error type: one variant per Python exception class of `arpo.errors`.

use std::fmt;

/// Everything that can go wrong in the store. The Python binding maps each
/// variant to one class of `arpo.errors` (see `rust_buffer/python`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// An argument has a wrong value; the message names the argument.
    Value(String),
    /// A blocking call did not complete within its timeout.
    Timeout(String),
    /// The store was closed; no further calls are accepted.
    Closed,
    /// A task id that the store has never seen.
    UnknownTask(String),
    /// A snapshot could not be written or read; the message gives the reason.
    Snapshot(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Value(m) | Error::Timeout(m) | Error::Snapshot(m) => f.write_str(m),
            Error::Closed => f.write_str("the replay store is closed"),
            Error::UnknownTask(t) => write!(
                f,
                "unknown task {t:?}: no item was ever put or added for it in this store"
            ),
        }
    }
}

impl std::error::Error for Error {}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, Error>;
