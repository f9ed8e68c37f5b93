//! The store: per-task fresh queues and replay buffers, byte budget, stats.
//!
//! # Concurrency design and invariants
//!
//! * **Task map.** `tasks` is an `ArcSwap` of an immutable `HashMap` from task
//!   id to `Arc<Task>`. Looking a task up is one atomic load (no lock). A new
//!   task is added by a compare-and-swap loop that copies the map; it runs once
//!   per task for the life of the store, and tasks are never removed, so an
//!   `Arc<Task>` obtained once stays the task's only instance.
//!
//! * **Per-task state.** Each task holds `ArcSwap<State>`; a `State` is an
//!   immutable value made of two persistent vectors (`imbl::Vector`, O(1)
//!   clone, O(log n) push/pop/split with structural sharing): the fresh FIFO
//!   and the replay FIFO, plus their byte totals. Readers (`sample`, `*_len`,
//!   `stats`, `snapshot`) take one atomic load and then work on a consistent
//!   view of both roles of that task, whatever writers do meanwhile. Writers
//!   (`put`, `add_success`, `take_group`, evictions, priority updates,
//!   `drop_older_than`) build the next `State` from the loaded one and publish
//!   it with `compare_and_swap`; on failure they retry from the value that won.
//!   The closure of an update has no side effect except drawing sequence
//!   numbers, so a retry is harmless. A guard on the loaded value keeps it
//!   alive for the whole attempt, so pointer comparison has no ABA problem.
//!   A successful take is therefore all-or-nothing: either the CAS publishes a
//!   state without the n oldest fresh items (and only this caller has them),
//!   or nothing changed. Writers of one task never touch another task's state.
//!
//! * **Sequence numbers.** Every residency (an item in the fresh queue or in the
//!   replay buffer of a task) gets a sequence number from `next_seq`, drawn
//!   inside the update closure after the state was loaded. Because a committed
//!   update's predecessor was committed before that load, sequence numbers are
//!   increasing along each task's vectors; lookups by sequence number are binary
//!   searches.
//!
//! * **Byte budget.** `bytes` counts the bytes of resident items. An inserter
//!   adds an item's bytes *before* publishing it, and whoever removes a
//!   residency from a state (the CAS winner) subtracts them *after*. Hence
//!   `bytes` is never below the true resident total, never underflows, and is
//!   exact whenever no call is in flight.
//!
//! * **Global eviction order.** `order` is a lock-free skip list (crossbeam) from
//!   sequence number to (task, role): its front is the oldest residency across
//!   all tasks. An inserter adds the entry right after publishing; every path
//!   that removes a residency also removes its entry. When `bytes` exceeds
//!   `max_bytes`, the inserter pops the front entry and removes that residency
//!   from its task (a CAS); an entry whose residency is already gone (taken,
//!   dropped, evicted by a concurrent caller) is skipped. One race is closed
//!   explicitly: a taker may remove a residency and look for its entry before
//!   the inserter has added it. So the inserter, after adding the entry, issues
//!   a `SeqCst` fence and checks that the residency is still in the task's
//!   state, and the remover issues a `SeqCst` fence between its state CAS and
//!   the entry removal; with both fences at least one of them sees the other,
//!   so no entry outlives its residency for long (no unbounded growth).
//!
//! * **Blocking waits** (`take_group`, `wait_min_size`) are the only place with
//!   a mutex: a per-task `Mutex<()>` + `Condvar` plus an atomic waiter count.
//!   A waiter takes the mutex, increments the count, fences (`SeqCst`) and
//!   re-checks its condition before waiting; a writer, after publishing, fences
//!   (`SeqCst`) and reads the count, and only if it is non-zero takes the mutex
//!   and notifies. Either the waiter's re-check sees the new state or the
//!   writer sees the waiter; and because the waiter holds the mutex from the
//!   re-check until `wait` releases it, the notification cannot fall in
//!   between: no lost wake-ups. Waits are also cut into slices of at most
//!   `WAIT_SLICE` so that deadlines and `close` are honoured even so. Inserts
//!   and samples never take the mutex when nobody waits.
//!
//! * **Close.** `closed` is set with `SeqCst` and then every task's waiters are
//!   notified under their mutex; waiters check `closed` after registering, so
//!   none sleeps through it.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use crossbeam_skiplist::SkipMap;
use imbl::Vector;

use crate::error::{Error, Result};
use crate::item::{Blob, Item};
use crate::rng::{entropy_seed, SplitMix64};

/// Longest single sleep of a blocked waiter before it re-checks its condition,
/// its deadline and `close`.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Configuration of a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Total budget over all resident items, in bytes (see [`Item::nbytes`]).
    /// When exceeded, the oldest residencies across all tasks are evicted.
    pub max_bytes: u64,
    /// Fresh items per task; a put beyond it evicts that task's oldest fresh item.
    pub fresh_capacity: usize,
    /// Replay items per task; an add beyond it evicts the oldest (FIFO).
    pub replay_capacity: usize,
    /// Seed of the sampler; `None` draws one from the clock.
    pub seed: Option<u64>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_bytes: 8 << 30,
            fresh_capacity: 4096,
            replay_capacity: 8,
            seed: None,
        }
    }
}

impl Config {
    /// Checks every field; the error names the field and the fix.
    pub fn validate(&self) -> Result<()> {
        if self.max_bytes == 0 {
            return Err(Error::Value("max_bytes must be >= 1 (bytes)".into()));
        }
        if self.fresh_capacity == 0 {
            return Err(Error::Value(
                "fresh_capacity must be >= 1 (items per task)".into(),
            ));
        }
        if self.replay_capacity == 0 {
            return Err(Error::Value(
                "replay_capacity must be >= 1 (items per task)".into(),
            ));
        }
        Ok(())
    }
}

/// The two roles an item can have in a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Waiting in the task's FIFO queue to be taken as part of a group.
    Fresh,
    /// In the task's replay buffer of successes.
    Replay,
}

/// How `sample` picks items from a replay buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleMode {
    /// `k` draws uniformly at random, with replacement.
    Uniform,
    /// The `min(k, eligible)` newest items, newest first, without replacement.
    Newest,
    /// `k` draws with replacement, each proportional to the item's priority.
    Priority,
}

impl FromStr for SampleMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "uniform" => Ok(SampleMode::Uniform),
            "newest" => Ok(SampleMode::Newest),
            "priority" => Ok(SampleMode::Priority),
            other => Err(Error::Value(format!(
                "mode must be \"uniform\", \"newest\" or \"priority\", got {other:?}"
            ))),
        }
    }
}

/// Counters and contents of one task (or of the whole store, summed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskStats {
    /// Items in the fresh queue.
    pub fresh: usize,
    /// Items in the replay buffer.
    pub replay: usize,
    /// Bytes of resident items (fresh + replay).
    pub bytes: u64,
    /// Successful `put` + `add_success` calls.
    pub inserts: u64,
    /// Items handed out by `take_group`.
    pub takes: u64,
    /// Items handed out by `sample`.
    pub samples: u64,
    /// Residencies removed by capacity (per task) or by the byte budget.
    pub evictions: u64,
    /// Residencies removed by `drop_older_than`.
    pub dropped: u64,
    /// Smallest policy version among resident items.
    pub min_version: Option<i64>,
    /// Largest policy version among resident items.
    pub max_version: Option<i64>,
}

impl TaskStats {
    fn absorb(&mut self, other: &TaskStats) {
        self.fresh += other.fresh;
        self.replay += other.replay;
        self.bytes += other.bytes;
        self.inserts += other.inserts;
        self.takes += other.takes;
        self.samples += other.samples;
        self.evictions += other.evictions;
        self.dropped += other.dropped;
        self.min_version = min_opt(self.min_version, other.min_version);
        self.max_version = max_opt(self.max_version, other.max_version);
    }
}

fn min_opt(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

fn max_opt(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, y) => x.or(y),
    }
}

/// Stats of the whole store: the sum and each task by name (sorted).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Sum over all tasks.
    pub total: TaskStats,
    /// One entry per task, sorted by task id.
    pub tasks: Vec<(String, TaskStats)>,
}

/// One residency: an item in one role of one task.
pub(crate) struct Slot<B> {
    pub(crate) item: Arc<Item<B>>,
    pub(crate) seq: u64,
    /// Sampling weight (replay role only; 0 for fresh).
    pub(crate) priority: f64,
}

impl<B> Clone for Slot<B> {
    fn clone(&self) -> Self {
        Slot {
            item: Arc::clone(&self.item),
            seq: self.seq,
            priority: self.priority,
        }
    }
}

/// Immutable value of one task's contents; replaced as a whole by CAS.
pub(crate) struct State<B> {
    pub(crate) fresh: Vector<Slot<B>>,
    pub(crate) replay: Vector<Slot<B>>,
    pub(crate) fresh_bytes: u64,
    pub(crate) replay_bytes: u64,
}

impl<B> Clone for State<B> {
    fn clone(&self) -> Self {
        State {
            fresh: self.fresh.clone(),
            replay: self.replay.clone(),
            fresh_bytes: self.fresh_bytes,
            replay_bytes: self.replay_bytes,
        }
    }
}

impl<B> State<B> {
    fn empty() -> Self {
        State {
            fresh: Vector::new(),
            replay: Vector::new(),
            fresh_bytes: 0,
            replay_bytes: 0,
        }
    }

    pub(crate) fn queue(&self, role: Role) -> &Vector<Slot<B>> {
        match role {
            Role::Fresh => &self.fresh,
            Role::Replay => &self.replay,
        }
    }

    fn queue_mut(&mut self, role: Role) -> (&mut Vector<Slot<B>>, &mut u64) {
        match role {
            Role::Fresh => (&mut self.fresh, &mut self.fresh_bytes),
            Role::Replay => (&mut self.replay, &mut self.replay_bytes),
        }
    }

    fn position(&self, role: Role, seq: u64) -> Option<usize> {
        self.queue(role).binary_search_by_key(&seq, |s| s.seq).ok()
    }
}

/// Monotone counters of one task.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) inserts: AtomicU64,
    pub(crate) takes: AtomicU64,
    pub(crate) samples: AtomicU64,
    pub(crate) evictions: AtomicU64,
    pub(crate) dropped: AtomicU64,
}

impl Counters {
    pub(crate) fn to_array(&self) -> [u64; 5] {
        [
            self.inserts.load(Ordering::Relaxed),
            self.takes.load(Ordering::Relaxed),
            self.samples.load(Ordering::Relaxed),
            self.evictions.load(Ordering::Relaxed),
            self.dropped.load(Ordering::Relaxed),
        ]
    }

    pub(crate) fn from_array(a: [u64; 5]) -> Self {
        Counters {
            inserts: AtomicU64::new(a[0]),
            takes: AtomicU64::new(a[1]),
            samples: AtomicU64::new(a[2]),
            evictions: AtomicU64::new(a[3]),
            dropped: AtomicU64::new(a[4]),
        }
    }
}

/// Wake-up channel of one task's blocked waiters (see module docs).
#[derive(Default)]
struct Signal {
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

enum WaitEnd {
    Closed,
    Timeout,
}

impl Signal {
    /// Called by writers after publishing a state: touches the mutex only if
    /// somebody waits.
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.wake_all();
        }
    }

    fn wake_all(&self) {
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        self.cv.notify_all();
    }

    /// Runs `attempt` until it returns `Some`, parking between attempts.
    fn wait_until<R>(
        &self,
        closed: &AtomicBool,
        deadline: Option<Instant>,
        mut attempt: impl FnMut() -> Option<R>,
    ) -> std::result::Result<R, WaitEnd> {
        loop {
            if let Some(r) = attempt() {
                return Ok(r);
            }
            if closed.load(Ordering::SeqCst) {
                return Err(WaitEnd::Closed);
            }
            let slice = match deadline {
                None => WAIT_SLICE,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(WaitEnd::Timeout);
                    }
                    left.min(WAIT_SLICE)
                }
            };
            let guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.waiters.fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            // Re-check while registered: a writer that published before our
            // registration is seen here; one that publishes after sees us.
            if let Some(r) = attempt() {
                self.waiters.fetch_sub(1, Ordering::SeqCst);
                return Ok(r);
            }
            if closed.load(Ordering::SeqCst) {
                self.waiters.fetch_sub(1, Ordering::SeqCst);
                return Err(WaitEnd::Closed);
            }
            let (guard, _) = self
                .cv
                .wait_timeout(guard, slice)
                .unwrap_or_else(PoisonError::into_inner);
            self.waiters.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
        }
    }
}

/// One task: its state, counters and waiters.
pub(crate) struct Task<B> {
    pub(crate) name: Arc<str>,
    pub(crate) state: ArcSwap<State<B>>,
    pub(crate) counters: Counters,
    signal: Signal,
}

impl<B: Blob> Task<B> {
    fn new(name: Arc<str>, state: State<B>, counters: Counters) -> Self {
        Task {
            name,
            state: ArcSwap::from_pointee(state),
            counters,
            signal: Signal::default(),
        }
    }

    /// The CAS loop of every writer: `f` computes the next state from the
    /// current one, or `None` to leave it unchanged (and return `None`).
    fn update<R>(&self, mut f: impl FnMut(&State<B>) -> Option<(State<B>, R)>) -> Option<R> {
        let mut current = self.state.load();
        loop {
            let (next, result) = f(&current)?;
            let previous = self.state.compare_and_swap(&*current, Arc::new(next));
            if Arc::ptr_eq(&*previous, &*current) {
                return Some(result);
            }
            current = previous;
        }
    }

    fn remove_seq(&self, role: Role, seq: u64) -> Option<Slot<B>> {
        self.update(|st| {
            let index = st.position(role, seq)?;
            let mut next = st.clone();
            let (queue, bytes) = next.queue_mut(role);
            let slot = queue.remove(index);
            *bytes -= slot.item.nbytes();
            Some((next, slot))
        })
    }

    fn stats(&self) -> TaskStats {
        let st = self.state.load();
        let [inserts, takes, samples, evictions, dropped] = self.counters.to_array();
        let versions = st
            .fresh
            .iter()
            .chain(st.replay.iter())
            .map(|s| s.item.version());
        TaskStats {
            fresh: st.fresh.len(),
            replay: st.replay.len(),
            bytes: st.fresh_bytes + st.replay_bytes,
            inserts,
            takes,
            samples,
            evictions,
            dropped,
            min_version: versions.clone().min(),
            max_version: versions.max(),
        }
    }
}

/// What a snapshot reads of one task: name, state, counters.
pub(crate) type TaskView<B> = (Arc<str>, Arc<State<B>>, [u64; 5]);

/// Entry of the global eviction order.
pub(crate) struct OrderEntry<B> {
    task: Arc<Task<B>>,
    role: Role,
}

/// Why a residency ended (for the counters).
#[derive(Clone, Copy)]
enum Removal {
    Taken,
    Evicted,
    Dropped,
}

/// Most items one `sample` call returns (it allocates the list up front).
pub const MAX_SAMPLE: usize = 1 << 24;

type TaskMap<B> = imbl::HashMap<Arc<str>, Arc<Task<B>>>;

/// The replay store keyed by task. See the crate docs for an example and the
/// module docs of `store` for the concurrency invariants.
pub struct Store<B: Blob = Vec<u8>> {
    config: Config,
    /// Task name -> task, replaced whole on a new task (copy-on-write). A persistent map:
    /// the copy shares all but O(log n) of its nodes, so adding the n-th task costs
    /// O(log n), not a copy of the n - 1 before it.
    tasks: ArcSwap<TaskMap<B>>,
    bytes: AtomicU64,
    order: SkipMap<u64, OrderEntry<B>>,
    next_seq: AtomicU64,
    seed: u64,
    rng_stream: AtomicU64,
    closed: AtomicBool,
}

impl<B: Blob> Store<B> {
    /// Builds an empty store.
    pub fn new(config: Config) -> Result<Self> {
        config.validate()?;
        let seed = config.seed.unwrap_or_else(entropy_seed);
        Ok(Store {
            config,
            tasks: ArcSwap::from_pointee(TaskMap::new()),
            bytes: AtomicU64::new(0),
            order: SkipMap::new(),
            next_seq: AtomicU64::new(0),
            seed,
            rng_stream: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        })
    }

    /// The configuration the store was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    fn task(&self, name: &str) -> Option<Arc<Task<B>>> {
        self.tasks.load().get(name).cloned()
    }

    fn known_task(&self, name: &str) -> Result<Arc<Task<B>>> {
        self.task(name)
            .ok_or_else(|| Error::UnknownTask(name.to_owned()))
    }

    fn task_or_create(&self, name: &str) -> Arc<Task<B>> {
        if let Some(task) = self.task(name) {
            return task;
        }
        let name: Arc<str> = name.into();
        let created = Arc::new(Task::new(
            Arc::clone(&name),
            State::empty(),
            Counters::default(),
        ));
        self.install_task(created)
    }

    /// Adds `task` to the map unless a task of that name exists; returns the
    /// instance that is in the map afterwards.
    pub(crate) fn install_task(&self, task: Arc<Task<B>>) -> Arc<Task<B>> {
        let mut current = self.tasks.load();
        loop {
            if let Some(existing) = current.get(&task.name) {
                return Arc::clone(existing);
            }
            let mut next = TaskMap::clone(&current);
            next.insert(Arc::clone(&task.name), Arc::clone(&task));
            let previous = self.tasks.compare_and_swap(&*current, Arc::new(next));
            if Arc::ptr_eq(&*previous, &*current) {
                return task;
            }
            current = previous;
        }
    }

    fn all_tasks(&self) -> Vec<Arc<Task<B>>> {
        let mut tasks: Vec<_> = self.tasks.load().values().cloned().collect();
        tasks.sort_by(|a, b| a.name.cmp(&b.name));
        tasks
    }

    /// Appends `item` to the fresh queue of `task` (created on first use).
    ///
    /// Beyond `fresh_capacity` the task's oldest fresh item is evicted; beyond
    /// `max_bytes` the oldest residencies across all tasks are evicted.
    pub fn put(&self, task: &str, item: Arc<Item<B>>) -> Result<()> {
        self.insert(task, item, Role::Fresh, 0.0)
    }

    /// Appends `item` to the replay buffer of `task` with a sampling priority.
    pub fn add_success(&self, task: &str, item: Arc<Item<B>>, priority: f64) -> Result<()> {
        check_priority("priority", priority)?;
        self.insert(task, item, Role::Replay, priority)
    }

    fn insert(&self, name: &str, item: Arc<Item<B>>, role: Role, priority: f64) -> Result<()> {
        self.check_open()?;
        let nbytes = item.nbytes();
        if nbytes > self.config.max_bytes {
            return Err(Error::Value(format!(
                "item of {nbytes} bytes is larger than max_bytes={}: raise max_bytes or store \
                 fewer or smaller blobs",
                self.config.max_bytes
            )));
        }
        let task = self.task_or_create(name);
        let capacity = match role {
            Role::Fresh => self.config.fresh_capacity,
            Role::Replay => self.config.replay_capacity,
        };
        // Reserve first: the counter never drops below the resident bytes.
        self.bytes.fetch_add(nbytes, Ordering::SeqCst);
        let (seq, evicted) = task
            .update(|st| {
                let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
                let mut next = st.clone();
                let (queue, bytes) = next.queue_mut(role);
                queue.push_back(Slot {
                    item: Arc::clone(&item),
                    seq,
                    priority,
                });
                *bytes += nbytes;
                let evicted = if queue.len() > capacity {
                    queue.pop_front().inspect(|old| *bytes -= old.item.nbytes())
                } else {
                    None
                };
                Some((next, (seq, evicted)))
            })
            .expect("an insert always produces a new state");
        if let Some(old) = evicted {
            self.released(&task, &old, Removal::Evicted);
        }
        self.order.insert(
            seq,
            OrderEntry {
                task: Arc::clone(&task),
                role,
            },
        );
        // Close the race with a remover that looked for the entry before it
        // existed (module docs, "Global eviction order").
        fence(Ordering::SeqCst);
        if task.state.load().position(role, seq).is_none() {
            self.order.remove(&seq);
        }
        task.counters.inserts.fetch_add(1, Ordering::Relaxed);
        task.signal.notify();
        self.enforce_budget();
        Ok(())
    }

    /// Bookkeeping after `slot` left a state by a CAS won by this thread.
    fn released(&self, task: &Task<B>, slot: &Slot<B>, why: Removal) {
        self.bytes.fetch_sub(slot.item.nbytes(), Ordering::SeqCst);
        fence(Ordering::SeqCst);
        self.order.remove(&slot.seq);
        let counter = match why {
            Removal::Taken => &task.counters.takes,
            Removal::Evicted => &task.counters.evictions,
            Removal::Dropped => &task.counters.dropped,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Evicts the oldest residencies across tasks until under budget.
    fn enforce_budget(&self) {
        while self.bytes.load(Ordering::SeqCst) > self.config.max_bytes {
            let Some(entry) = self.order.pop_front() else {
                break;
            };
            let seq = *entry.key();
            let OrderEntry { task, role } = entry.value();
            if let Some(slot) = task.remove_seq(*role, seq) {
                self.bytes.fetch_sub(slot.item.nbytes(), Ordering::SeqCst);
                task.counters.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Takes the `n` oldest fresh items of `task` at once (all or nothing).
    ///
    /// `timeout`: `None` waits until a group is available or the store is
    /// closed; `Some(Duration::ZERO)` does not block. Waiting on a task that
    /// has never been seen registers it (a group may arrive); with a zero
    /// timeout an unknown task is a timeout.
    pub fn take_group(
        &self,
        name: &str,
        n: usize,
        timeout: Option<Duration>,
    ) -> Result<Vec<Arc<Item<B>>>> {
        self.check_open()?;
        if n == 0 {
            return Err(Error::Value("n must be >= 1 (items per group)".into()));
        }
        if n > self.config.fresh_capacity {
            return Err(Error::Value(format!(
                "n={n} is larger than fresh_capacity={}: the group could never form; \
                 raise fresh_capacity",
                self.config.fresh_capacity
            )));
        }
        let task = match (timeout, self.task(name)) {
            (_, Some(task)) => task,
            (Some(t), None) if t.is_zero() => {
                return Err(timeout_error("take_group", name, n, 0));
            }
            (_, None) => self.task_or_create(name),
        };
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let attempt = || {
            task.update(|st| {
                if st.fresh.len() < n {
                    return None;
                }
                let mut next = st.clone();
                let rest = next.fresh.split_off(n);
                let taken = std::mem::replace(&mut next.fresh, rest);
                next.fresh_bytes -= taken.iter().map(|s| s.item.nbytes()).sum::<u64>();
                Some((next, taken))
            })
        };
        match task.signal.wait_until(&self.closed, deadline, attempt) {
            Ok(taken) => Ok(taken
                .into_iter()
                .map(|slot| {
                    self.released(&task, &slot, Removal::Taken);
                    slot.item
                })
                .collect()),
            Err(WaitEnd::Closed) => Err(Error::Closed),
            Err(WaitEnd::Timeout) => {
                let have = task.state.load().fresh.len();
                Err(timeout_error("take_group", name, n, have))
            }
        }
    }

    /// Number of fresh items of `task` (0 for a task never seen).
    pub fn fresh_len(&self, name: &str) -> Result<usize> {
        self.check_open()?;
        Ok(self.task(name).map_or(0, |t| t.state.load().fresh.len()))
    }

    /// Version and insertion sequence number of the oldest fresh item of
    /// `task` (the head of its FIFO, the first item `take_group` hands out);
    /// `None` when it has no fresh item or was never seen. Sequence numbers
    /// grow with every insert across all tasks, so they order heads of
    /// different tasks by arrival.
    pub fn fresh_head(&self, name: &str) -> Result<Option<(i64, u64)>> {
        self.check_open()?;
        Ok(self.task(name).and_then(|t| {
            t.state
                .load()
                .fresh
                .front()
                .map(|s| (s.item.version(), s.seq))
        }))
    }

    /// Number of items in the replay buffer of `task`.
    pub fn replay_len(&self, name: &str) -> Result<usize> {
        self.check_open()?;
        Ok(self.known_task(name)?.state.load().replay.len())
    }

    /// Samples `k` items from the replay buffer of `task`.
    ///
    /// Only items with `version >= min_version` are eligible (all if `None`).
    /// Fails with a value error if fewer than `min_size` (>= 1) are eligible.
    /// `Uniform` and `Priority` return exactly `k` items (with replacement);
    /// `Newest` returns the `min(k, eligible)` newest, newest first.
    pub fn sample(
        &self,
        name: &str,
        k: usize,
        mode: SampleMode,
        min_size: usize,
        min_version: Option<i64>,
    ) -> Result<Vec<Arc<Item<B>>>> {
        self.check_open()?;
        if min_size == 0 {
            return Err(Error::Value("min_size must be >= 1".into()));
        }
        if k > MAX_SAMPLE {
            return Err(Error::Value(format!(
                "k = {k} is above the limit of {MAX_SAMPLE} items per sample call \
                 (sample in several calls)"
            )));
        }
        let task = self.known_task(name)?;
        let st = task.state.load();
        let replay = &st.replay;
        let filtered: Option<Vec<&Slot<B>>> =
            min_version.map(|v| replay.iter().filter(|s| s.item.version() >= v).collect());
        let eligible = filtered.as_ref().map_or(replay.len(), Vec::len);
        let at = |i: usize| -> &Slot<B> {
            match &filtered {
                Some(f) => f[i],
                None => &replay[i],
            }
        };
        if eligible < min_size {
            let filter = min_version.map_or(String::new(), |v| format!(" with version >= {v}"));
            return Err(Error::Value(format!(
                "task {name:?} has {eligible} replay items{filter}, fewer than min_size={min_size} \
                 (replay_len={}): add successes first or wait with wait_min_size",
                replay.len()
            )));
        }
        let rng =
            || SplitMix64::for_stream(self.seed, self.rng_stream.fetch_add(1, Ordering::Relaxed));
        let out: Vec<Arc<Item<B>>> = match mode {
            SampleMode::Newest => (0..k.min(eligible))
                .map(|j| Arc::clone(&at(eligible - 1 - j).item))
                .collect(),
            SampleMode::Uniform => {
                let mut r = rng();
                (0..k)
                    .map(|_| Arc::clone(&at(r.below(eligible)).item))
                    .collect()
            }
            SampleMode::Priority => {
                let mut cumulative = Vec::with_capacity(eligible);
                let mut total = 0.0f64;
                for i in 0..eligible {
                    total += at(i).priority;
                    cumulative.push(total);
                }
                if total <= 0.0 || !total.is_finite() {
                    return Err(Error::Value(format!(
                        "task {name:?}: priorities of the {eligible} eligible replay items sum \
                         to {total}; priority sampling needs a positive finite sum"
                    )));
                }
                let mut r = rng();
                (0..k)
                    .map(|_| {
                        let u = r.unit() * total;
                        let i = cumulative.partition_point(|&c| c <= u).min(eligible - 1);
                        Arc::clone(&at(i).item)
                    })
                    .collect()
            }
        };
        task.counters
            .samples
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(out)
    }

    /// Blocks until the replay buffer of `task` holds at least `n` items.
    /// Same timeout rules as [`Store::take_group`].
    pub fn wait_min_size(&self, name: &str, n: usize, timeout: Option<Duration>) -> Result<()> {
        self.check_open()?;
        if n > self.config.replay_capacity {
            return Err(Error::Value(format!(
                "n={n} is larger than replay_capacity={}: the buffer could never hold it; \
                 raise replay_capacity",
                self.config.replay_capacity
            )));
        }
        let task = match (timeout, self.task(name)) {
            (_, Some(task)) => task,
            (_, None) if n == 0 => return Ok(()),
            (Some(t), None) if t.is_zero() => {
                return Err(timeout_error("wait_min_size", name, n, 0));
            }
            (_, None) => self.task_or_create(name),
        };
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let attempt = || (task.state.load().replay.len() >= n).then_some(());
        match task.signal.wait_until(&self.closed, deadline, attempt) {
            Ok(()) => Ok(()),
            Err(WaitEnd::Closed) => Err(Error::Closed),
            Err(WaitEnd::Timeout) => {
                let have = task.state.load().replay.len();
                Err(timeout_error("wait_min_size", name, n, have))
            }
        }
    }

    /// Sets the priority of replay items of `task` by key. Keys not in the
    /// replay buffer (evicted meanwhile, or never there) are skipped; returns
    /// the number of residencies updated.
    pub fn update_priorities(&self, name: &str, updates: &[(u64, f64)]) -> Result<usize> {
        self.check_open()?;
        for (i, &(_, p)) in updates.iter().enumerate() {
            check_priority(&format!("priorities[{i}]"), p)?;
        }
        let task = self.known_task(name)?;
        let by_key: HashMap<u64, f64> = updates.iter().copied().collect();
        let updated = task.update(|st| {
            if !st.replay.iter().any(|s| by_key.contains_key(&s.item.key())) {
                return None;
            }
            let mut next = st.clone();
            let mut count = 0;
            for slot in next.replay.iter_mut() {
                if let Some(&p) = by_key.get(&slot.item.key()) {
                    slot.priority = p;
                    count += 1;
                }
            }
            Some((next, count))
        });
        Ok(updated.unwrap_or(0))
    }

    /// Removes the replay items of `task` whose key is in `keys` (a buffered
    /// success the learner found it cannot train); keys not in the replay
    /// buffer are skipped. Returns the number of residencies removed.
    pub fn remove_replay(&self, name: &str, keys: &[u64]) -> Result<usize> {
        self.check_open()?;
        let task = self.known_task(name)?;
        let wanted: HashSet<u64> = keys.iter().copied().collect();
        let removed = task.update(|st| {
            let hit = |s: &Slot<B>| wanted.contains(&s.item.key());
            if !st.replay.iter().any(hit) {
                return None;
            }
            let mut next = st.clone();
            let (queue, bytes) = next.queue_mut(Role::Replay);
            let (gone, kept): (Vec<_>, Vec<_>) = queue.iter().cloned().partition(hit);
            *bytes -= gone.iter().map(|s| s.item.nbytes()).sum::<u64>();
            *queue = kept.into_iter().collect();
            Some((next, gone))
        });
        let removed = removed.unwrap_or_default();
        for slot in &removed {
            self.released(&task, slot, Removal::Dropped);
        }
        Ok(removed.len())
    }

    /// Removes every item with `version < min_version` from both roles of
    /// every task; returns the number of residencies removed.
    pub fn drop_older_than(&self, min_version: i64) -> Result<usize> {
        self.check_open()?;
        let mut total = 0;
        for task in self.all_tasks() {
            let removed = task.update(|st| {
                let old = |s: &Slot<B>| s.item.version() < min_version;
                if !st.fresh.iter().chain(st.replay.iter()).any(old) {
                    return None;
                }
                let mut next = st.clone();
                let mut removed = Vec::new();
                for role in [Role::Fresh, Role::Replay] {
                    let (queue, bytes) = next.queue_mut(role);
                    let (gone, kept): (Vec<_>, Vec<_>) = queue.iter().cloned().partition(old);
                    *bytes -= gone.iter().map(|s| s.item.nbytes()).sum::<u64>();
                    *queue = kept.into_iter().collect();
                    removed.extend(gone);
                }
                Some((next, removed))
            });
            for slot in removed.unwrap_or_default() {
                self.released(&task, &slot, Removal::Dropped);
                total += 1;
            }
        }
        Ok(total)
    }

    /// Task ids, sorted.
    pub fn tasks(&self) -> Result<Vec<String>> {
        self.check_open()?;
        Ok(self
            .all_tasks()
            .iter()
            .map(|t| t.name.to_string())
            .collect())
    }

    /// Bytes of all resident items, counted once per residency.
    pub fn bytes_used(&self) -> Result<u64> {
        self.check_open()?;
        Ok(self.bytes.load(Ordering::SeqCst))
    }

    /// Stats of one task.
    pub fn task_stats(&self, name: &str) -> Result<TaskStats> {
        self.check_open()?;
        Ok(self.known_task(name)?.stats())
    }

    /// Stats of every task and their sum.
    pub fn stats(&self) -> Result<StoreStats> {
        self.check_open()?;
        let mut out = StoreStats::default();
        for task in self.all_tasks() {
            let s = task.stats();
            out.total.absorb(&s);
            out.tasks.push((task.name.to_string(), s));
        }
        Ok(out)
    }

    /// Closes the store: every later call fails with [`Error::Closed`] and
    /// blocked waiters wake up with it. Idempotent.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        for task in self.all_tasks() {
            task.signal.wake_all();
        }
    }

    /// Whether [`Store::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    // ----- used by the snapshot module -----

    /// Per-task views for a snapshot: one atomic load per task.
    pub(crate) fn views(&self) -> Vec<TaskView<B>> {
        self.all_tasks()
            .into_iter()
            .map(|t| {
                (
                    Arc::clone(&t.name),
                    t.state.load_full(),
                    t.counters.to_array(),
                )
            })
            .collect()
    }

    pub(crate) fn next_seq(&self) -> u64 {
        self.next_seq.load(Ordering::SeqCst)
    }

    /// Installs a restored task into a store that nobody else uses yet, then
    /// applies this store's capacities (the byte budget is applied by
    /// [`Store::finish_restore`]).
    pub(crate) fn restore_task(
        &self,
        name: &str,
        fresh: Vec<Slot<B>>,
        replay: Vec<Slot<B>>,
        counters: [u64; 5],
    ) {
        let mut state = State::empty();
        let task = Arc::new(Task::new(
            name.into(),
            State::empty(),
            Counters::from_array(counters),
        ));
        let mut evicted = 0;
        for (role, slots, capacity) in [
            (Role::Fresh, fresh, self.config.fresh_capacity),
            (Role::Replay, replay, self.config.replay_capacity),
        ] {
            let skip = slots.len().saturating_sub(capacity);
            evicted += skip as u64;
            let (queue, bytes) = state.queue_mut(role);
            for slot in slots.into_iter().skip(skip) {
                *bytes += slot.item.nbytes();
                self.bytes.fetch_add(slot.item.nbytes(), Ordering::SeqCst);
                self.next_seq.fetch_max(slot.seq + 1, Ordering::SeqCst);
                self.order.insert(
                    slot.seq,
                    OrderEntry {
                        task: Arc::clone(&task),
                        role,
                    },
                );
                queue.push_back(slot);
            }
        }
        task.counters
            .evictions
            .fetch_add(evicted, Ordering::Relaxed);
        task.state.store(Arc::new(state));
        self.install_task(task);
    }

    pub(crate) fn bump_seq(&self, next_seq: u64) {
        self.next_seq.fetch_max(next_seq, Ordering::SeqCst);
    }

    pub(crate) fn finish_restore(&self) {
        self.enforce_budget();
    }
}

fn check_priority(field: &str, p: f64) -> Result<()> {
    if p.is_finite() && p >= 0.0 {
        Ok(())
    } else {
        Err(Error::Value(format!(
            "{field} must be a finite number >= 0, got {p}"
        )))
    }
}

fn timeout_error(op: &str, name: &str, n: usize, have: usize) -> Error {
    let what = if op == "take_group" {
        "fresh items"
    } else {
        "replay items"
    };
    Error::Timeout(format!(
        "{op} timed out: task {name:?} has {have} {what}, fewer than n={n}"
    ))
}

/// Checks a store's internal invariants (for tests): per-task byte totals,
/// sorted sequence numbers, and `bytes_used` equal to the sum of residencies.
/// Only meaningful when no call is in flight.
#[doc(hidden)]
pub fn check_invariants<B: Blob>(store: &Store<B>) -> std::result::Result<(), String> {
    let mut total = 0;
    let mut seqs = HashSet::new();
    for (name, st, _) in store.views() {
        for role in [Role::Fresh, Role::Replay] {
            let queue = st.queue(role);
            let sum: u64 = queue.iter().map(|s| s.item.nbytes()).sum();
            let recorded = match role {
                Role::Fresh => st.fresh_bytes,
                Role::Replay => st.replay_bytes,
            };
            if sum != recorded {
                return Err(format!("task {name}: {role:?} bytes {recorded} != {sum}"));
            }
            total += sum;
            let mut last = None;
            for s in queue.iter() {
                if last.is_some_and(|l| l >= s.seq) {
                    return Err(format!("task {name}: {role:?} seqs not increasing"));
                }
                last = Some(s.seq);
                seqs.insert(s.seq);
                if !store.order.contains_key(&s.seq) {
                    return Err(format!("task {name}: seq {} missing from order", s.seq));
                }
            }
        }
    }
    let counted = store.bytes.load(Ordering::SeqCst);
    if counted != total {
        return Err(format!("bytes_used {counted} != resident total {total}"));
    }
    let stale = store.order.len() - seqs.len();
    if stale != 0 {
        return Err(format!("{stale} stale entries in the eviction order"));
    }
    Ok(())
}
