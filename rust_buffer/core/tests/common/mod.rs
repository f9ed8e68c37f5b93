#![allow(dead_code)]
use std::sync::Arc;

use arpo_buffer::{Config, Item, Store};

pub type TestStore = Store<Vec<u8>>;

/// An item with `n_tokens` tokens, one blob of `blob_len` bytes and a version.
pub fn item(version: i64, n_tokens: usize, blob_len: usize) -> Arc<Item<Vec<u8>>> {
    Arc::new(Item::new(
        (0..n_tokens as i32).collect(),
        vec![-0.5; n_tokens],
        vec![0],
        vec![1.0],
        version,
        vec![vec![7u8; blob_len]],
        b"meta".to_vec(),
    ))
}

pub fn store(max_bytes: u64, fresh: usize, replay: usize) -> TestStore {
    Store::new(Config {
        max_bytes,
        fresh_capacity: fresh,
        replay_capacity: replay,
        seed: Some(1),
    })
    .unwrap()
}
