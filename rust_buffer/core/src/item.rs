//! The immutable item (one trajectory) and the blob abstraction.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A binary payload kept by reference (PNG screenshots, metadata).
///
/// The store never copies blobs: it only needs to read their bytes (for the
/// byte budget and snapshots). A Rust user can take `Vec<u8>`, `Box<[u8]>` or
/// `Arc<[u8]>`; the Python binding uses a handle on the caller's `bytes`
/// object, so sampling returns the very object that was inserted.
pub trait Blob: AsRef<[u8]> + Send + Sync + 'static {
    /// Builds a blob from bytes read back from a snapshot.
    fn from_vec(bytes: Vec<u8>) -> Self;
}

impl Blob for Vec<u8> {
    fn from_vec(bytes: Vec<u8>) -> Self {
        bytes
    }
}

impl Blob for Box<[u8]> {
    fn from_vec(bytes: Vec<u8>) -> Self {
        bytes.into_boxed_slice()
    }
}

impl Blob for Arc<[u8]> {
    fn from_vec(bytes: Vec<u8>) -> Self {
        bytes.into()
    }
}

/// Process-wide source of item keys: every item built in this process gets a
/// distinct key. `Relaxed` is enough: only uniqueness matters, not ordering
/// with respect to other memory. Restoring a snapshot raises it above every
/// restored key (`fetch_max`) so new keys never collide with restored ones.
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

pub(crate) fn reserve_keys_above(key: u64) {
    NEXT_KEY.fetch_max(key.saturating_add(1), Ordering::Relaxed);
}

/// One trajectory: token ids, behaviour log-probs, per-turn offsets,
/// reward(s), the policy version that produced it, blobs and metadata.
///
/// Immutable once built; shared between fresh queue, replay buffer, samples
/// and snapshots as `Arc<Item<B>>`.
#[derive(Debug)]
pub struct Item<B = Vec<u8>> {
    key: u64,
    tokens: Box<[i32]>,
    logprobs: Box<[f32]>,
    offsets: Box<[i32]>,
    rewards: Box<[f32]>,
    version: i64,
    blobs: Box<[B]>,
    metadata: B,
    nbytes: u64,
}

impl<B: Blob> Item<B> {
    /// Builds an item and gives it a fresh process-wide unique key.
    pub fn new(
        tokens: Vec<i32>,
        logprobs: Vec<f32>,
        offsets: Vec<i32>,
        rewards: Vec<f32>,
        version: i64,
        blobs: Vec<B>,
        metadata: B,
    ) -> Self {
        let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        Self::with_key(
            key, tokens, logprobs, offsets, rewards, version, blobs, metadata,
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn with_key(
        key: u64,
        tokens: Vec<i32>,
        logprobs: Vec<f32>,
        offsets: Vec<i32>,
        rewards: Vec<f32>,
        version: i64,
        blobs: Vec<B>,
        metadata: B,
    ) -> Self {
        let arrays = 4 * (tokens.len() + logprobs.len() + offsets.len() + rewards.len());
        let blob_bytes: usize = blobs.iter().map(|b| b.as_ref().len()).sum();
        let nbytes = (arrays + blob_bytes + metadata.as_ref().len()) as u64;
        Item {
            key,
            tokens: tokens.into_boxed_slice(),
            logprobs: logprobs.into_boxed_slice(),
            offsets: offsets.into_boxed_slice(),
            rewards: rewards.into_boxed_slice(),
            version,
            blobs: blobs.into_boxed_slice(),
            metadata,
            nbytes,
        }
    }
}

impl<B> Item<B> {
    /// The unique key, assigned at construction.
    pub fn key(&self) -> u64 {
        self.key
    }
    /// Token ids of the whole trajectory.
    pub fn tokens(&self) -> &[i32] {
        &self.tokens
    }
    /// Behaviour log-probability per sampled token.
    pub fn logprobs(&self) -> &[f32] {
        &self.logprobs
    }
    /// Start offset of each turn in `tokens`.
    pub fn offsets(&self) -> &[i32] {
        &self.offsets
    }
    /// Reward(s) of the trajectory.
    pub fn rewards(&self) -> &[f32] {
        &self.rewards
    }
    /// Policy version that produced the trajectory.
    pub fn version(&self) -> i64 {
        self.version
    }
    /// Binary payloads (PNG screenshots), in insertion order.
    pub fn blobs(&self) -> &[B] {
        &self.blobs
    }
    /// Small metadata bytes.
    pub fn metadata(&self) -> &B {
        &self.metadata
    }
    /// Bytes charged to the budget: `4 * (tokens + logprobs + offsets + rewards)`
    /// + blob lengths + metadata length.
    pub fn nbytes(&self) -> u64 {
        self.nbytes
    }
}
