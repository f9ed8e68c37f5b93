//! Core benchmark of the store, without Python, to compare against the cost
//! seen through the binding (`benchmarks/bench_store.py`).
//!
//! Workload: items of 2,048 int32 tokens + 2,048 float32 log-probs + 8 blobs
//! of 200 KB (shared, as the binding shares Python `bytes`), 16 tasks.
//!
//!     PYO3_PYTHON=.venv/bin/python cargo bench -p arpo-buffer --bench store
//!
//! Short by design (about 20 s); run it alone on the machine.

use std::sync::Arc;
use std::time::Duration;

use arpo_buffer::{Config, Item, SampleMode, Store};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

const TASKS: usize = 16;
const TOKENS: usize = 2048;
const BLOBS: usize = 8;
const BLOB_LEN: usize = 200_000;
const GROUP: usize = 8;

type B = Arc<[u8]>;

struct Workload {
    tokens: Vec<i32>,
    logprobs: Vec<f32>,
    blobs: Vec<B>,
    names: Vec<String>,
}

impl Workload {
    fn new() -> Self {
        Workload {
            tokens: (0..TOKENS as i32).collect(),
            logprobs: vec![-0.5; TOKENS],
            blobs: (0..BLOBS).map(|i| vec![i as u8; BLOB_LEN].into()).collect(),
            names: (0..TASKS).map(|t| format!("task-{t}")).collect(),
        }
    }

    /// One item as an actor would hand it over: arrays copied, blobs shared.
    fn item(&self, version: i64) -> Arc<Item<B>> {
        Arc::new(Item::new(
            self.tokens.clone(),
            self.logprobs.clone(),
            vec![0, TOKENS as i32 / 2],
            vec![1.0],
            version,
            self.blobs.clone(),
            B::from(&b"{}"[..]),
        ))
    }
}

fn store(max_bytes: u64) -> Store<B> {
    Store::new(Config {
        max_bytes,
        fresh_capacity: 64,
        replay_capacity: 8,
        seed: Some(0),
    })
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let w = Workload::new();
    let item_bytes = w.item(0).nbytes();

    // Assert before timing: a group comes back whole, in order, blobs not copied.
    let s = store(1 << 34);
    for v in 0..GROUP as i64 {
        s.put(&w.names[0], w.item(v)).unwrap();
    }
    let g = s
        .take_group(&w.names[0], GROUP, Some(Duration::ZERO))
        .unwrap();
    assert_eq!(g.len(), GROUP);
    assert!(g.iter().enumerate().all(|(i, it)| it.version() == i as i64));
    assert!(Arc::ptr_eq(&g[0].blobs()[0], &w.blobs[0]));

    let mut group = c.benchmark_group("store");
    group
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);

    // put under a full byte budget: every put also evicts the oldest item.
    // Elements, not bytes: blobs are shared, never copied, so bytes/s says nothing.
    group.throughput(Throughput::Elements(1));
    let s = store(item_bytes * 200);
    let mut v = 0i64;
    group.bench_function("put (evicting, 16 tasks)", |b| {
        b.iter_batched(
            || {
                v += 1;
                (v as usize % TASKS, w.item(v))
            },
            |(t, item)| s.put(&w.names[t], item).unwrap(),
            BatchSize::SmallInput,
        )
    });

    // A whole group through the fresh queue: 8 puts then one take.
    group.throughput(Throughput::Elements(GROUP as u64));
    let s = store(1 << 34);
    let mut t = 0usize;
    group.bench_function("put x8 + take_group(8)", |b| {
        b.iter_batched(
            || (0..GROUP as i64).map(|v| w.item(v)).collect::<Vec<_>>(),
            |items| {
                t = (t + 1) % TASKS;
                for it in items {
                    s.put(&w.names[t], it).unwrap();
                }
                let g = s
                    .take_group(&w.names[t], GROUP, Some(Duration::ZERO))
                    .unwrap();
                assert_eq!(g.len(), GROUP);
                g
            },
            BatchSize::SmallInput,
        )
    });

    // Sampling 8 from a full replay buffer of each task.
    let s = store(1 << 34);
    for name in &w.names {
        for v in 0..8 {
            s.add_success(name, w.item(v), 1.0 + v as f64).unwrap();
        }
    }
    for (label, mode) in [
        ("sample(8, uniform)", SampleMode::Uniform),
        ("sample(8, newest)", SampleMode::Newest),
        ("sample(8, priority)", SampleMode::Priority),
    ] {
        let mut t = 0usize;
        group.bench_function(label, |b| {
            b.iter(|| {
                t = (t + 1) % TASKS;
                s.sample(&w.names[t], GROUP, mode, 1, None).unwrap()
            })
        });
    }
    group.bench_function("sample(8, uniform, min_version=4)", |b| {
        let mut t = 0usize;
        b.iter(|| {
            t = (t + 1) % TASKS;
            s.sample(&w.names[t], GROUP, SampleMode::Uniform, 1, Some(4))
                .unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
