//! Single-threaded behaviour of the store: roles, capacities, budget, errors.
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use arpo_buffer::{check_invariants, Error, Item, SampleMode};
use common::{item, store};

const ZERO: Option<Duration> = Some(Duration::ZERO);

#[test]
fn nbytes_counts_every_field() {
    let it = Item::new(
        vec![1, 2, 3],
        vec![0.0; 2],
        vec![0],
        vec![1.0, 2.0],
        0,
        vec![vec![0u8; 10], vec![0u8; 5]],
        vec![1u8; 3],
    );
    assert_eq!(it.nbytes(), 4 * (3 + 2 + 1 + 2) + 15 + 3);
    let other = Item::new(
        vec![],
        vec![],
        vec![],
        vec![],
        0,
        Vec::<Vec<u8>>::new(),
        vec![],
    );
    assert_ne!(it.key(), other.key());
    assert_eq!(other.nbytes(), 0);
}

#[test]
fn take_group_is_fifo_and_all_or_nothing() {
    let s = store(1 << 30, 100, 8);
    let items: Vec<_> = (0..5).map(|v| item(v, 4, 10)).collect();
    for it in &items {
        s.put("a", Arc::clone(it)).unwrap();
    }
    assert!(matches!(s.take_group("a", 6, ZERO), Err(Error::Timeout(_))));
    assert_eq!(s.fresh_len("a").unwrap(), 5);
    let g = s.take_group("a", 3, ZERO).unwrap();
    let keys: Vec<_> = g.iter().map(|i| i.key()).collect();
    assert_eq!(keys, items[..3].iter().map(|i| i.key()).collect::<Vec<_>>());
    assert_eq!(s.fresh_len("a").unwrap(), 2);
    assert_eq!(
        s.bytes_used().unwrap(),
        items[3].nbytes() + items[4].nbytes()
    );
    assert_eq!(s.task_stats("a").unwrap().takes, 3);
    check_invariants(&s).unwrap();
}

#[test]
fn take_group_errors_and_timeouts() {
    let s = store(1 << 30, 4, 8);
    assert!(matches!(s.take_group("a", 0, None), Err(Error::Value(m)) if m.contains("n must")));
    assert!(
        matches!(s.take_group("a", 5, None), Err(Error::Value(m)) if m.contains("fresh_capacity"))
    );
    // Zero timeout on an unknown task: a timeout, and the task is not created.
    assert!(matches!(s.take_group("new", 1, ZERO), Err(Error::Timeout(m)) if m.contains("new")));
    assert!(s.tasks().unwrap().is_empty());
    let t0 = Instant::now();
    let err = s
        .take_group("new", 2, Some(Duration::from_millis(150)))
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)));
    assert!(t0.elapsed() >= Duration::from_millis(150));
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(s.tasks().unwrap(), vec!["new".to_string()]);
}

#[test]
fn fresh_capacity_evicts_oldest_of_that_task() {
    let s = store(1 << 30, 3, 8);
    let items: Vec<_> = (0..5).map(|v| item(v, 1, 1)).collect();
    for it in &items {
        s.put("a", Arc::clone(it)).unwrap();
    }
    s.put("b", item(9, 1, 1)).unwrap();
    let g = s.take_group("a", 3, ZERO).unwrap();
    assert_eq!(
        g.iter().map(|i| i.version()).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    assert_eq!(s.task_stats("a").unwrap().evictions, 2);
    assert_eq!(s.fresh_len("b").unwrap(), 1);
    check_invariants(&s).unwrap();
}

#[test]
fn replay_capacity_fifo_and_sampling_modes() {
    let s = store(1 << 30, 8, 3);
    let items: Vec<_> = (0..5).map(|v| item(v, 1, 1)).collect();
    for it in &items {
        s.add_success("a", Arc::clone(it), 1.0).unwrap();
    }
    assert_eq!(s.replay_len("a").unwrap(), 3);
    let newest = s.sample("a", 5, SampleMode::Newest, 1, None).unwrap();
    assert_eq!(
        newest.iter().map(|i| i.version()).collect::<Vec<_>>(),
        vec![4, 3, 2]
    );
    let uni = s.sample("a", 50, SampleMode::Uniform, 1, None).unwrap();
    assert_eq!(uni.len(), 50);
    assert!(uni.iter().all(|i| (2..5).contains(&i.version())));
    let filtered = s.sample("a", 20, SampleMode::Uniform, 1, Some(4)).unwrap();
    assert!(filtered.iter().all(|i| i.version() == 4));
    assert!(matches!(
        s.sample("a", 1, SampleMode::Uniform, 2, Some(4)),
        Err(Error::Value(m)) if m.contains("min_size=2") && m.contains("\"a\"")
    ));
    assert!(matches!(
        s.sample("zzz", 1, SampleMode::Uniform, 1, None),
        Err(Error::UnknownTask(t)) if t == "zzz"
    ));
    assert_eq!(s.task_stats("a").unwrap().samples, 3 + 50 + 20);
    check_invariants(&s).unwrap();
}

#[test]
fn priority_sampling_follows_priorities() {
    let s = store(1 << 30, 8, 8);
    let a = item(0, 1, 1);
    let b = item(0, 1, 1);
    let c = item(0, 1, 1);
    s.add_success("t", Arc::clone(&a), 1.0).unwrap();
    s.add_success("t", Arc::clone(&b), 3.0).unwrap();
    s.add_success("t", Arc::clone(&c), 0.0).unwrap();
    let draws = s
        .sample("t", 20_000, SampleMode::Priority, 1, None)
        .unwrap();
    let nb = draws.iter().filter(|i| i.key() == b.key()).count() as f64;
    let nc = draws.iter().filter(|i| i.key() == c.key()).count();
    assert_eq!(nc, 0, "a zero priority is never drawn");
    assert!((nb / 20_000.0 - 0.75).abs() < 0.02, "{nb}");
    // Update: now only c has weight.
    let n = s
        .update_priorities(
            "t",
            &[
                (a.key(), 0.0),
                (b.key(), 0.0),
                (c.key(), 2.0),
                (12345678, 1.0),
            ],
        )
        .unwrap();
    assert_eq!(n, 3);
    let draws = s.sample("t", 100, SampleMode::Priority, 1, None).unwrap();
    assert!(draws.iter().all(|i| i.key() == c.key()));
    s.update_priorities("t", &[(c.key(), 0.0)]).unwrap();
    assert!(matches!(
        s.sample("t", 1, SampleMode::Priority, 1, None),
        Err(Error::Value(m)) if m.contains("sum")
    ));
    assert!(matches!(
        s.update_priorities("t", &[(c.key(), f64::NAN)]),
        Err(Error::Value(m)) if m.contains("priorities[0]")
    ));
    assert!(matches!(
        s.add_success("t", item(0, 1, 1), -1.0),
        Err(Error::Value(m)) if m.contains("priority")
    ));
}

#[test]
fn same_seed_same_samples() {
    let run = || {
        let s = store(1 << 30, 8, 8);
        for v in 0..8 {
            s.add_success("t", item(v, 1, 1), 1.0 + v as f64).unwrap();
        }
        let u: Vec<i64> = s
            .sample("t", 30, SampleMode::Uniform, 1, None)
            .unwrap()
            .iter()
            .map(|i| i.version())
            .collect();
        let p: Vec<i64> = s
            .sample("t", 30, SampleMode::Priority, 1, None)
            .unwrap()
            .iter()
            .map(|i| i.version())
            .collect();
        (u, p)
    };
    assert_eq!(run(), run());
}

#[test]
fn byte_budget_evicts_oldest_across_tasks_and_roles() {
    let one = item(0, 0, 100).nbytes(); // 100 blob + 4 offsets + 4 rewards + 4 meta
    let s = store(one * 4, 100, 100);
    let a0 = item(0, 0, 100);
    s.put("a", Arc::clone(&a0)).unwrap();
    s.add_success("b", item(1, 0, 100), 1.0).unwrap();
    s.put("c", item(2, 0, 100)).unwrap();
    // Same item object twice: counted once per residency.
    s.add_success("a", Arc::clone(&a0), 1.0).unwrap();
    assert_eq!(s.bytes_used().unwrap(), 4 * one);
    s.put("d", item(3, 0, 100)).unwrap();
    assert_eq!(s.bytes_used().unwrap(), 4 * one);
    // The oldest residency (a0 in a's fresh queue) went, its replay copy stays.
    assert_eq!(s.fresh_len("a").unwrap(), 0);
    assert_eq!(s.replay_len("a").unwrap(), 1);
    s.put("d", item(4, 0, 100)).unwrap();
    assert_eq!(s.replay_len("b").unwrap(), 0);
    let st = s.stats().unwrap();
    assert_eq!(st.total.evictions, 2);
    assert_eq!(st.total.bytes, 4 * one);
    assert!(matches!(
        s.put("a", item(0, 0, 1000)),
        Err(Error::Value(m)) if m.contains("max_bytes")
    ));
    check_invariants(&s).unwrap();
}

#[test]
fn drop_older_than_removes_from_both_roles() {
    let s = store(1 << 30, 100, 100);
    for v in 0..6 {
        s.put("a", item(v, 2, 2)).unwrap();
        s.add_success("b", item(v, 2, 2), 1.0).unwrap();
    }
    assert_eq!(s.drop_older_than(4).unwrap(), 8);
    assert_eq!(s.fresh_len("a").unwrap(), 2);
    assert_eq!(s.replay_len("b").unwrap(), 2);
    let st = s.stats().unwrap();
    assert_eq!(st.total.dropped, 8);
    assert_eq!(st.total.min_version, Some(4));
    assert_eq!(st.total.max_version, Some(5));
    assert_eq!(s.drop_older_than(4).unwrap(), 0);
    check_invariants(&s).unwrap();
}

#[test]
fn fresh_head_is_the_oldest_fresh_item_in_arrival_order() {
    let s = store(1 << 30, 100, 100);
    assert_eq!(s.fresh_head("a").unwrap(), None);
    s.put("a", item(3, 2, 2)).unwrap();
    s.put("b", item(1, 2, 2)).unwrap();
    s.put("a", item(4, 2, 2)).unwrap();
    let (va, qa) = s.fresh_head("a").unwrap().unwrap();
    let (vb, qb) = s.fresh_head("b").unwrap().unwrap();
    assert_eq!((va, vb), (3, 1));
    assert!(qa < qb, "a's head arrived first");
    s.take_group("a", 1, Some(Duration::ZERO)).unwrap();
    assert_eq!(s.fresh_head("a").unwrap().unwrap().0, 4);
    s.add_success("c", item(0, 2, 2), 1.0).unwrap();
    assert_eq!(
        s.fresh_head("c").unwrap(),
        None,
        "replay items are not fresh"
    );
}

#[test]
fn remove_replay_takes_out_only_the_given_keys() {
    let s = store(1 << 30, 100, 100);
    let a = item(1, 2, 2);
    let b = item(2, 2, 2);
    let key_a = a.key();
    s.put("t", Arc::clone(&a)).unwrap();
    s.add_success("t", a, 1.0).unwrap();
    s.add_success("t", b, 1.0).unwrap();
    assert_eq!(s.remove_replay("t", &[key_a, 999_999]).unwrap(), 1);
    assert_eq!(s.replay_len("t").unwrap(), 1);
    assert_eq!(s.fresh_len("t").unwrap(), 1, "the fresh residency stays");
    assert_eq!(s.remove_replay("t", &[key_a]).unwrap(), 0);
    assert_eq!(s.stats().unwrap().total.dropped, 1);
    assert!(matches!(
        s.remove_replay("nope", &[1]),
        Err(Error::UnknownTask(_))
    ));
    check_invariants(&s).unwrap();
}

#[test]
fn wait_min_size_wakes_on_add() {
    let s = Arc::new(store(1 << 30, 8, 8));
    let s2 = Arc::clone(&s);
    let waiter =
        std::thread::spawn(move || s2.wait_min_size("t", 2, Some(Duration::from_secs(10))));
    std::thread::sleep(Duration::from_millis(50));
    s.add_success("t", item(0, 1, 1), 1.0).unwrap();
    s.add_success("t", item(1, 1, 1), 1.0).unwrap();
    waiter.join().unwrap().unwrap();
    assert!(matches!(
        s.wait_min_size("t", 3, ZERO),
        Err(Error::Timeout(m)) if m.contains("wait_min_size")
    ));
    assert!(
        matches!(s.wait_min_size("t", 9, None), Err(Error::Value(m)) if m.contains("replay_capacity"))
    );
}

#[test]
fn close_wakes_waiters_and_rejects_calls() {
    let s = Arc::new(store(1 << 30, 8, 8));
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || s.take_group("t", 2, None))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    s.close();
    for w in waiters {
        assert_eq!(w.join().unwrap().unwrap_err(), Error::Closed);
    }
    assert!(t0.elapsed() < Duration::from_millis(500));
    assert_eq!(s.put("t", item(0, 1, 1)), Err(Error::Closed));
    assert_eq!(s.bytes_used(), Err(Error::Closed));
    assert_eq!(s.tasks(), Err(Error::Closed));
    assert!(s.is_closed());
}

#[test]
fn config_is_validated() {
    use arpo_buffer::{Config, Store};
    for (cfg, field) in [
        (
            Config {
                max_bytes: 0,
                ..Config::default()
            },
            "max_bytes",
        ),
        (
            Config {
                fresh_capacity: 0,
                ..Config::default()
            },
            "fresh_capacity",
        ),
        (
            Config {
                replay_capacity: 0,
                ..Config::default()
            },
            "replay_capacity",
        ),
    ] {
        match Store::<Vec<u8>>::new(cfg) {
            Err(Error::Value(m)) => assert!(m.contains(field)),
            _ => panic!("{field} not rejected"),
        }
    }
    assert!("bogus".parse::<SampleMode>().is_err());
    assert_eq!("newest".parse::<SampleMode>().unwrap(), SampleMode::Newest);
}

#[test]
fn sample_refuses_a_k_it_cannot_allocate() {
    let s = store(1 << 30, 8, 8);
    s.add_success("t", item(0, 2, 2), 1.0).unwrap();
    for mode in [
        SampleMode::Uniform,
        SampleMode::Priority,
        SampleMode::Newest,
    ] {
        assert!(matches!(
            s.sample("t", 1 << 62, mode, 1, None),
            Err(Error::Value(m)) if m.contains("k = ") && m.contains("limit")
        ));
    }
    assert_eq!(
        s.sample("t", 3, SampleMode::Uniform, 1, None)
            .unwrap()
            .len(),
        3
    );
}
