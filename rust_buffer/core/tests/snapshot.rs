//! Snapshot round trip, corruption and truncation.
mod common;

use std::sync::Arc;
use std::time::Duration;

use arpo_buffer::{check_invariants, Error, RestoreOptions, SampleMode, Store};
use common::{item, store, TestStore};

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("arpo-snap-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn filled() -> TestStore {
    let s = store(1 << 30, 16, 4);
    for v in 0..6 {
        s.put("a", item(v, 8, 32)).unwrap();
    }
    let shared = item(7, 3, 3);
    s.put("b", Arc::clone(&shared)).unwrap();
    s.add_success("b", Arc::clone(&shared), 2.5).unwrap();
    s.add_success("c", item(8, 1, 1), 0.5).unwrap();
    s.take_group("a", 2, Some(Duration::ZERO)).unwrap();
    s
}

#[test]
fn round_trip_keeps_everything() {
    let d = tmpdir("rt");
    let path = d.join("s.snap");
    let s = filled();
    s.snapshot(&path).unwrap();
    let r = TestStore::restore(&path, RestoreOptions::default()).unwrap();
    assert_eq!(r.stats().unwrap(), s.stats().unwrap());
    assert_eq!(r.bytes_used().unwrap(), s.bytes_used().unwrap());
    assert_eq!(
        r.config(),
        &arpo_buffer::Config {
            seed: None,
            ..s.config().clone()
        }
    );
    let a = s.take_group("a", 4, Some(Duration::ZERO)).unwrap();
    let b = r.take_group("a", 4, Some(Duration::ZERO)).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.key(), y.key());
        assert_eq!(x.tokens(), y.tokens());
        assert_eq!(x.logprobs(), y.logprobs());
        assert_eq!(x.blobs(), y.blobs());
        assert_eq!(x.metadata(), y.metadata());
        assert_eq!(x.version(), y.version());
    }
    // The shared item is one item after restore; priorities survive.
    let fresh_b = r.take_group("b", 1, Some(Duration::ZERO)).unwrap();
    let replay_b = r.sample("b", 1, SampleMode::Newest, 1, None).unwrap();
    assert!(Arc::ptr_eq(&fresh_b[0], &replay_b[0]));
    r.add_success("c", item(9, 1, 1), 0.0).unwrap();
    let p = r.sample("c", 10, SampleMode::Priority, 1, None).unwrap();
    assert!(p.iter().all(|i| i.version() == 8));
    // New keys never collide with restored ones.
    assert!(item(0, 0, 0).key() > a.iter().map(|i| i.key()).max().unwrap());
    check_invariants(&r).unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn restore_with_smaller_limits_evicts_oldest() {
    let d = tmpdir("small");
    let path = d.join("s.snap");
    let s = filled();
    s.snapshot(&path).unwrap();
    let r = TestStore::restore(
        &path,
        RestoreOptions {
            fresh_capacity: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(r.fresh_len("a").unwrap(), 2);
    let g = r.take_group("a", 2, Some(Duration::ZERO)).unwrap();
    assert_eq!(g[0].version(), 4);
    let budget = item(8, 1, 1).nbytes() + 1;
    let r = TestStore::restore(
        &path,
        RestoreOptions {
            max_bytes: Some(budget),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.bytes_used().unwrap() <= budget);
    check_invariants(&r).unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

fn restore_err(path: &std::path::Path) -> String {
    match TestStore::restore(path, RestoreOptions::default()) {
        Err(Error::Snapshot(m)) => m,
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("restored a bad snapshot"),
    }
}

#[test]
fn truncated_and_corrupted_snapshots_are_rejected() {
    let d = tmpdir("bad");
    let good = d.join("good.snap");
    filled().snapshot(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let bad = d.join("bad.snap");
    for cut in [0, 10, 31, 32, 100, bytes.len() - 1] {
        std::fs::write(&bad, &bytes[..cut]).unwrap();
        let m = restore_err(&bad);
        assert!(m.contains("truncated"), "{cut}: {m}");
    }
    for pos in [40, bytes.len() / 2, bytes.len() - 1] {
        let mut b = bytes.clone();
        b[pos] ^= 0x5a;
        std::fs::write(&bad, &b).unwrap();
        let m = restore_err(&bad);
        assert!(
            m.contains("corrupted") && m.contains("checksum"),
            "{pos}: {m}"
        );
    }
    let mut b = bytes.clone();
    b[0] = b'X';
    std::fs::write(&bad, &b).unwrap();
    assert!(restore_err(&bad).contains("magic"));
    let mut b = bytes.clone();
    b[20] ^= 1; // body_len, covered by the header checksum
    std::fs::write(&bad, &b).unwrap();
    assert!(restore_err(&bad).contains("header checksum"));
    assert!(restore_err(&d.join("missing.snap")).contains("cannot open"));
    // The good file is untouched and still restores.
    Store::<Vec<u8>>::restore(&good, RestoreOptions::default()).unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn failed_write_keeps_previous_snapshot() {
    let d = tmpdir("keep");
    let path = d.join("s.snap");
    let s = filled();
    s.snapshot(&path).unwrap();
    let before = std::fs::read(&path).unwrap();
    // A path whose parent does not exist cannot be written.
    let err = s.snapshot(d.join("nope").join("s.snap")).unwrap_err();
    assert!(matches!(err, Error::Snapshot(m) if m.contains("cannot write")));
    assert_eq!(std::fs::read(&path).unwrap(), before);
    let leftovers: Vec<_> = std::fs::read_dir(&d).unwrap().collect();
    assert_eq!(leftovers.len(), 1, "no temporary file left behind");
    std::fs::remove_dir_all(&d).unwrap();
}
