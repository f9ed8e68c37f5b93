//! Multi-threaded stress tests: exactly-once delivery through take_group,
//! eviction under the byte budget, concurrent take/sample/insert on one task.
mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use arpo_buffer::{check_invariants, Error, SampleMode};
use common::{item, store};

#[test]
fn every_item_is_taken_exactly_once() {
    const WRITERS: usize = 4;
    const PER_WRITER: usize = 2_000;
    const GROUP: usize = 4;
    let s = Arc::new(store(1 << 40, 1 << 20, 8));
    let taken = Arc::new(Mutex::new(Vec::new()));
    let total_groups = WRITERS * PER_WRITER / GROUP;
    let groups_left = Arc::new(AtomicUsize::new(total_groups));
    let mut handles = Vec::new();
    for w in 0..WRITERS {
        let s = Arc::clone(&s);
        handles.push(thread::spawn(move || {
            let mut keys = Vec::new();
            for i in 0..PER_WRITER {
                let it = item((w * PER_WRITER + i) as i64, 4, 8);
                keys.push(it.key());
                s.put("shared", it).unwrap();
            }
            keys
        }));
    }
    let mut takers = Vec::new();
    for _ in 0..3 {
        let (s, taken, left) = (Arc::clone(&s), Arc::clone(&taken), Arc::clone(&groups_left));
        takers.push(thread::spawn(move || loop {
            // Claim a group before waiting for it, so no taker waits forever.
            if left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_err()
            {
                return;
            }
            let g = s
                .take_group("shared", GROUP, Some(Duration::from_secs(30)))
                .unwrap();
            assert_eq!(g.len(), GROUP);
            taken.lock().unwrap().extend(g.iter().map(|i| i.key()));
        }));
    }
    let mut put_keys = HashSet::new();
    for h in handles {
        put_keys.extend(h.join().unwrap());
    }
    for t in takers {
        t.join().unwrap();
    }
    let taken = taken.lock().unwrap();
    let unique: HashSet<_> = taken.iter().copied().collect();
    assert_eq!(taken.len(), WRITERS * PER_WRITER);
    assert_eq!(unique, put_keys);
    assert_eq!(s.fresh_len("shared").unwrap(), 0);
    assert_eq!(s.bytes_used().unwrap(), 0);
    check_invariants(&s).unwrap();
}

#[test]
fn byte_budget_holds_under_concurrent_inserts() {
    let one = item(0, 16, 1000).nbytes();
    let budget = one * 50;
    let s = Arc::new(store(budget, 1 << 20, 1 << 20));
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let s = Arc::clone(&s);
            thread::spawn(move || {
                for i in 0..3_000 {
                    let task = format!("task-{}", (t * 7 + i) % 16);
                    if i % 3 == 0 {
                        s.add_success(&task, item(i as i64, 16, 1000), 1.0).unwrap();
                    } else {
                        s.put(&task, item(i as i64, 16, 1000)).unwrap();
                    }
                    if i % 5 == 0 {
                        let _ = s.take_group(&task, 1, Some(Duration::ZERO));
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let used = s.bytes_used().unwrap();
    assert!(used <= budget, "{used} > {budget}");
    // Every insert either is resident, was taken, or was evicted.
    let st = s.stats().unwrap();
    let resident = (st.total.fresh + st.total.replay) as u64;
    assert_eq!(st.total.inserts, 12_000);
    assert_eq!(resident + st.total.takes + st.total.evictions, 12_000);
    assert_eq!(used, resident * one);
    check_invariants(&s).unwrap();
}

#[test]
fn take_sample_insert_on_one_task_concurrently() {
    let s = Arc::new(store(1 << 24, 64, 16));
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for w in 0..2 {
        let (s, stop) = (Arc::clone(&s), Arc::clone(&stop));
        handles.push(thread::spawn(move || {
            let mut i = 0i64;
            while !stop.load(Ordering::Relaxed) {
                s.put("t", item(i, 8, 64)).unwrap();
                if i % 4 == w {
                    s.add_success("t", item(i, 8, 64), 1.0 + (i % 3) as f64)
                        .unwrap();
                }
                i += 1;
            }
        }));
    }
    {
        let (s, stop) = (Arc::clone(&s), Arc::clone(&stop));
        handles.push(thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match s.take_group("t", 4, Some(Duration::from_millis(50))) {
                    Ok(g) => assert_eq!(g.len(), 4),
                    Err(Error::Timeout(_)) => {}
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }
    for mode in [
        SampleMode::Uniform,
        SampleMode::Newest,
        SampleMode::Priority,
    ] {
        let (s, stop) = (Arc::clone(&s), Arc::clone(&stop));
        handles.push(thread::spawn(move || {
            let mut ok = 0;
            while !stop.load(Ordering::Relaxed) {
                match s.sample("t", 4, mode, 1, Some(10)) {
                    Ok(items) => {
                        assert!(items.iter().all(|i| i.version() >= 10));
                        ok += 1;
                    }
                    Err(Error::Value(_)) | Err(Error::UnknownTask(_)) => {}
                    Err(e) => panic!("{e}"),
                }
                if ok % 64 == 0 {
                    let keys: Vec<_> = s
                        .sample("t", 2, SampleMode::Newest, 1, None)
                        .map(|v| v.iter().map(|i| (i.key(), 2.0)).collect())
                        .unwrap_or_default();
                    s.update_priorities("t", &keys).unwrap_or(0);
                }
            }
            assert!(ok > 0, "{mode:?} never sampled");
        }));
    }
    thread::sleep(Duration::from_millis(700));
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    assert!(s.fresh_len("t").unwrap() <= 64);
    assert!(s.replay_len("t").unwrap() <= 16);
    check_invariants(&s).unwrap();
}

#[test]
fn snapshot_while_inserting_restores_a_consistent_store() {
    let dir = std::env::temp_dir().join(format!("arpo-stress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("store.snap");
    let s = Arc::new(store(1 << 30, 1 << 16, 64));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let (s, stop) = (Arc::clone(&s), Arc::clone(&stop));
            thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    s.put(&format!("t{w}"), item(i, 32, 256)).unwrap();
                    s.add_success(&format!("t{w}"), item(i, 32, 256), 1.0)
                        .unwrap();
                    i += 1;
                }
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(50));
    for _ in 0..3 {
        s.snapshot(&path).unwrap();
        let r = arpo_buffer::Store::<Vec<u8>>::restore(&path, Default::default()).unwrap();
        check_invariants(&r).unwrap();
        assert!(r.stats().unwrap().total.fresh > 0);
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
