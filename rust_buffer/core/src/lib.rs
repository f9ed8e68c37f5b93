//! arpo-buffer: a concurrent replay store keyed by task, for reinforcement
//! learning with groups (GRPO) and replay of past successes (ARPO).
//!
//! Per task the store holds
//! * a **fresh queue** (FIFO) of trajectories waiting to be trained on, from
//!   which [`Store::take_group`] removes a complete group of `n` items at once
//!   (all or nothing), blocking with a timeout until one is available;
//! * a **replay buffer** of successes (FIFO with a capacity), sampled uniformly,
//!   newest first or by priority ([`Store::sample`]), optionally only among
//!   items of a recent enough policy version.
//!
//! Capacity is bounded per task (counts) and in total (bytes, oldest evicted
//! first across tasks). Inserts and samples are lock-free; see the `store`
//! module source for the invariants. [`Store::snapshot`] writes the store to a
//! checksummed file while it keeps working; [`Store::restore`] reads it back.
//!
//! The store is generic over the blob type `B` ([`Blob`]), so an embedding can
//! keep its own buffers (the Python binding keeps the caller's `bytes` objects
//! and never copies them).
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use arpo_buffer::{Config, Item, SampleMode, Store};
//!
//! let store: Store<Vec<u8>> = Store::new(Config {
//!     max_bytes: 1 << 20,
//!     fresh_capacity: 64,
//!     replay_capacity: 8,
//!     seed: Some(0),
//! })
//! .unwrap();
//! for version in 0..4 {
//!     let item = Item::new(
//!         vec![1, 2, 3],          // token ids
//!         vec![-0.5, -0.1, -0.2], // behaviour log-probs
//!         vec![0],                // turn offsets
//!         vec![1.0],              // reward
//!         version,                // policy version
//!         vec![b"png bytes".to_vec()],
//!         Vec::new(),             // metadata
//!     );
//!     store.put("task-a", Arc::new(item)).unwrap();
//! }
//! let group = store.take_group("task-a", 4, Some(Duration::ZERO)).unwrap();
//! assert_eq!(group.len(), 4);
//! assert_eq!(store.fresh_len("task-a").unwrap(), 0);
//!
//! // Keep the best one as a success and replay it later.
//! store.add_success("task-a", Arc::clone(&group[3]), 1.0).unwrap();
//! let replayed = store.sample("task-a", 2, SampleMode::Uniform, 1, Some(3)).unwrap();
//! assert!(replayed.iter().all(|item| item.version() == 3));
//! assert_eq!(store.bytes_used().unwrap(), group[3].nbytes());
//! ```

mod error;
mod item;
mod rng;
mod snapshot;
mod store;

pub use error::{Error, Result};
pub use item::{Blob, Item};
pub use snapshot::{RestoreOptions, FORMAT_VERSION};
pub use store::{
    check_invariants, Config, Role, SampleMode, Store, StoreStats, TaskStats, MAX_SAMPLE,
};
