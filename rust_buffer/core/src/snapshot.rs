//! Snapshots: a versioned, checksummed file with the whole store.
//!
//! # Format (version 1, all integers little-endian)
//!
//! ```text
//! header (32 bytes)
//!   0  magic      b"ARPOSNAP"
//!   8  version    u32 = 1
//!  12  flags      u32 = 0
//!  16  body_len   u64
//!  24  body_crc   u32   crc32 (IEEE) of the body
//!  28  header_crc u32   crc32 of bytes 0..28
//! body
//!   max_bytes u64, fresh_capacity u64, replay_capacity u64, next_seq u64
//!   n_tasks u32, then per task:
//!     name (u32 len + UTF-8), n_counters u32 (= 5), counters u64 x 5
//!       (inserts, takes, samples, evictions, dropped)
//!     n_fresh u64, entries; n_replay u64, entries
//!   entry: seq u64, priority f64, tag u8
//!     tag 0: item inline: key u64, version i64, tokens (u64 n + i32 x n),
//!            logprobs (u64 n + f32 x n), offsets (u64 n + i32 x n),
//!            rewards (u64 n + f32 x n), n_blobs u64, blobs (u64 len + bytes),
//!            metadata (u64 len + bytes)
//!     tag 1: the item with this key was written earlier: key u64
//! ```
//!
//! An item resident more than once (fresh and replay, or in two tasks) is
//! written once and restored as one shared item.
//!
//! # Consistency and durability
//!
//! Writing takes each task's state with one atomic load (a consistent view of
//! that task; tasks are captured one after the other, not at one instant),
//! then encodes outside any lock while inserts and samples go on. The file is
//! written to a temporary file in the same directory, fsynced, renamed over
//! the target and the directory fsynced: a reader sees the old snapshot or the
//! new one, never a mix. There is no log between snapshots: a crash loses every
//! change made after the last completed snapshot (new items, takes, evictions,
//! priority updates), and items taken after it come back as fresh on restore.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::item::{reserve_keys_above, Blob, Item};
use crate::store::{Config, Slot, Store};

const MAGIC: &[u8; 8] = b"ARPOSNAP";
/// Format version written by this build (and the only one it reads).
pub const FORMAT_VERSION: u32 = 1;
const HEADER_LEN: u64 = 32;
const N_COUNTERS: u32 = 5;

/// Settings that override the snapshot's own when restoring (`None` keeps
/// the value stored in the snapshot).
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    /// Byte budget of the restored store; oldest items are evicted to fit.
    pub max_bytes: Option<u64>,
    /// Fresh capacity per task; the oldest fresh items are evicted to fit.
    pub fresh_capacity: Option<usize>,
    /// Replay capacity per task; the oldest replay items are evicted to fit.
    pub replay_capacity: Option<usize>,
    /// Sampler seed (snapshots do not store one).
    pub seed: Option<u64>,
}

struct Sink<W: Write> {
    inner: W,
    crc: crc32fast::Hasher,
    len: u64,
}

impl<W: Write> Sink<W> {
    fn bytes(&mut self, b: &[u8]) -> io::Result<()> {
        self.crc.update(b);
        self.len += b.len() as u64;
        self.inner.write_all(b)
    }
    fn u8(&mut self, v: u8) -> io::Result<()> {
        self.bytes(&[v])
    }
    fn u32(&mut self, v: u32) -> io::Result<()> {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> io::Result<()> {
        self.bytes(&v.to_le_bytes())
    }
    fn blob(&mut self, b: &[u8]) -> io::Result<()> {
        self.u64(b.len() as u64)?;
        self.bytes(b)
    }
    fn array<const N: usize, T: Copy>(
        &mut self,
        values: &[T],
        to_le: impl Fn(T) -> [u8; N],
    ) -> io::Result<()> {
        self.u64(values.len() as u64)?;
        let mut buf = Vec::with_capacity(values.len() * N);
        for &v in values {
            buf.extend_from_slice(&to_le(v));
        }
        self.bytes(&buf)
    }
}

fn write_item<W: Write, B: Blob>(out: &mut Sink<W>, item: &Item<B>) -> io::Result<()> {
    out.u64(item.key())?;
    out.u64(item.version() as u64)?;
    out.array(item.tokens(), i32::to_le_bytes)?;
    out.array(item.logprobs(), f32::to_le_bytes)?;
    out.array(item.offsets(), i32::to_le_bytes)?;
    out.array(item.rewards(), f32::to_le_bytes)?;
    out.u64(item.blobs().len() as u64)?;
    for blob in item.blobs() {
        out.blob(blob.as_ref())?;
    }
    out.blob(item.metadata().as_ref())
}

/// Removes the temporary file unless the snapshot completed.
struct TmpFile {
    path: PathBuf,
    keep: bool,
}

impl Drop for TmpFile {
    fn drop(&mut self) {
        if !self.keep {
            let _ = fs::remove_file(&self.path);
        }
    }
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl<B: Blob> Store<B> {
    /// Writes a snapshot of the whole store to `path`, atomically (see the
    /// module docs). Inserts, takes and samples may run meanwhile.
    pub fn snapshot(&self, path: impl AsRef<Path>) -> Result<()> {
        if self.is_closed() {
            return Err(Error::Closed);
        }
        let path = path.as_ref();
        self.write_snapshot(path)
            .map_err(|e| Error::Snapshot(format!("cannot write snapshot {}: {e}", path.display())))
    }

    fn write_snapshot(&self, path: &Path) -> io::Result<()> {
        // The rename below replaces whatever `path` names: refuse anything but a regular
        // file (a FIFO or a device node would be replaced by a regular file).
        match std::fs::symlink_metadata(path) {
            Ok(meta) if !meta.file_type().is_file() => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "the target exists and is not a regular file (give a new path or a \
                     regular file to replace)",
                ));
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let views = self.views();
        let next_seq = self.next_seq();
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let file_name = path
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?
            .to_string_lossy()
            .into_owned();
        let tmp = TmpFile {
            path: dir.join(format!(
                ".{file_name}.tmp-{}-{}",
                std::process::id(),
                TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
            )),
            keep: false,
        };
        let file = File::create(&tmp.path)?;
        let mut out = Sink {
            inner: BufWriter::with_capacity(1 << 20, file),
            crc: crc32fast::Hasher::new(),
            len: 0,
        };
        out.inner.write_all(&[0u8; HEADER_LEN as usize])?;
        let config = self.config();
        out.u64(config.max_bytes)?;
        out.u64(config.fresh_capacity as u64)?;
        out.u64(config.replay_capacity as u64)?;
        out.u64(next_seq)?;
        out.u32(views.len() as u32)?;
        let mut written: HashSet<u64> = HashSet::new();
        for (name, state, counters) in &views {
            out.u32(name.len() as u32)?;
            out.bytes(name.as_bytes())?;
            out.u32(N_COUNTERS)?;
            for c in counters {
                out.u64(*c)?;
            }
            for queue in [&state.fresh, &state.replay] {
                out.u64(queue.len() as u64)?;
                for slot in queue.iter() {
                    out.u64(slot.seq)?;
                    out.bytes(&slot.priority.to_le_bytes())?;
                    let key = slot.item.key();
                    if written.insert(key) {
                        out.u8(0)?;
                        write_item(&mut out, &slot.item)?;
                    } else {
                        out.u8(1)?;
                        out.u64(key)?;
                    }
                }
            }
        }
        let (body_len, body_crc) = (out.len, out.crc.finalize());
        let mut file = out.inner.into_inner().map_err(|e| e.into_error())?;
        let mut header = Vec::with_capacity(HEADER_LEN as usize);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        header.extend_from_slice(&body_len.to_le_bytes());
        header.extend_from_slice(&body_crc.to_le_bytes());
        let header_crc = crc32fast::hash(&header);
        header.extend_from_slice(&header_crc.to_le_bytes());
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&header)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp.path, path)?;
        let mut tmp = tmp;
        tmp.keep = true;
        // Make the rename itself durable; not every filesystem allows it.
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Loads a snapshot written by [`Store::snapshot`] into a new store.
    ///
    /// Fails with [`Error::Snapshot`] (and a reason) if the file is missing,
    /// truncated, corrupted or of another format version; nothing is built in
    /// that case. Keys, versions, priorities, the order of every queue and the
    /// stats counters are restored; residencies beyond the (possibly
    /// overridden) capacities or byte budget are evicted oldest first.
    pub fn restore(path: impl AsRef<Path>, options: RestoreOptions) -> Result<Self> {
        let path = path.as_ref();
        let fail =
            |reason: String| Error::Snapshot(format!("snapshot {}: {reason}", path.display()));
        // Only a regular file: a FIFO would block the open (or the read) forever.
        match std::fs::metadata(path) {
            Ok(m) if !m.is_file() => return Err(fail("not a regular file".into())),
            Err(e) => return Err(fail(format!("cannot open: {e}"))),
            Ok(_) => {}
        }
        let file = File::open(path).map_err(|e| fail(format!("cannot open: {e}")))?;
        let file_len = file
            .metadata()
            .map_err(|e| fail(format!("cannot stat: {e}")))?
            .len();
        if file_len < HEADER_LEN {
            return Err(fail(format!(
                "truncated: the file has {file_len} bytes, the header alone needs {HEADER_LEN}"
            )));
        }
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut header = [0u8; HEADER_LEN as usize];
        reader
            .read_exact(&mut header)
            .map_err(|e| fail(format!("cannot read the header: {e}")))?;
        if &header[0..8] != MAGIC {
            return Err(fail("not an arpo replay-store snapshot (bad magic)".into()));
        }
        let u32_at = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap());
        if crc32fast::hash(&header[..28]) != u32_at(28) {
            return Err(fail("corrupted: header checksum mismatch".into()));
        }
        let version = u32_at(8);
        if version != FORMAT_VERSION {
            return Err(fail(format!(
                "unsupported format version {version} (this build reads version {FORMAT_VERSION})"
            )));
        }
        let body_len = u64::from_le_bytes(header[16..24].try_into().unwrap());
        let body_crc = u32_at(24);
        let actual = file_len - HEADER_LEN;
        if actual < body_len {
            return Err(fail(format!(
                "truncated: the header announces a body of {body_len} bytes, the file has {actual}"
            )));
        }
        if actual > body_len {
            return Err(fail(format!(
                "corrupted: {} unexpected bytes after the body",
                actual - body_len
            )));
        }
        let mut src = Source {
            inner: reader,
            crc: crc32fast::Hasher::new(),
            left: body_len,
        };
        let parsed = parse_body::<B, _>(&mut src);
        // Decide on the checksum first: a corrupted file often parses wrongly.
        let _ = io::copy(
            &mut (&mut src.inner).take(src.left),
            &mut HashWriter(&mut src.crc),
        );
        let crc = src.crc.clone().finalize();
        if crc != body_crc {
            return Err(fail(format!(
                "corrupted: body checksum mismatch (crc32 {crc:08x}, header says {body_crc:08x})"
            )));
        }
        let body = parsed.map_err(|e| fail(format!("malformed body: {e}")))?;
        if src.left != 0 {
            return Err(fail(format!(
                "malformed body: {} bytes left after the last task",
                src.left
            )));
        }
        let config = Config {
            max_bytes: options.max_bytes.unwrap_or(body.config.max_bytes),
            fresh_capacity: options.fresh_capacity.unwrap_or(body.config.fresh_capacity),
            replay_capacity: options
                .replay_capacity
                .unwrap_or(body.config.replay_capacity),
            seed: options.seed,
        };
        let store = Store::new(config)?;
        reserve_keys_above(body.max_key);
        for task in body.tasks {
            store.restore_task(&task.name, task.fresh, task.replay, task.counters);
        }
        store.bump_seq(body.next_seq);
        store.finish_restore();
        Ok(store)
    }
}

struct HashWriter<'a>(&'a mut crc32fast::Hasher);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct Source<R: Read> {
    inner: R,
    crc: crc32fast::Hasher,
    left: u64,
}

type ParseResult<T> = std::result::Result<T, String>;

impl<R: Read> Source<R> {
    fn bytes(&mut self, n: u64, what: &str) -> ParseResult<Vec<u8>> {
        if n > self.left {
            return Err(format!(
                "{what} needs {n} bytes but only {} are left in the body",
                self.left
            ));
        }
        let mut buf = vec![0u8; n as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| format!("reading {what}: {e}"))?;
        self.crc.update(&buf);
        self.left -= n;
        Ok(buf)
    }
    fn fixed<const N: usize>(&mut self, what: &str) -> ParseResult<[u8; N]> {
        Ok(self.bytes(N as u64, what)?.try_into().unwrap())
    }
    fn u8(&mut self, what: &str) -> ParseResult<u8> {
        Ok(self.fixed::<1>(what)?[0])
    }
    fn u32(&mut self, what: &str) -> ParseResult<u32> {
        Ok(u32::from_le_bytes(self.fixed(what)?))
    }
    fn u64(&mut self, what: &str) -> ParseResult<u64> {
        Ok(u64::from_le_bytes(self.fixed(what)?))
    }
    fn array<const N: usize, T>(
        &mut self,
        what: &str,
        from_le: impl Fn([u8; N]) -> T,
    ) -> ParseResult<Vec<T>> {
        let n = self.u64(what)?;
        let len = n
            .checked_mul(N as u64)
            .ok_or_else(|| format!("{what}: length {n} overflows"))?;
        let raw = self.bytes(len, what)?;
        Ok(raw
            .chunks_exact(N)
            .map(|c| from_le(c.try_into().unwrap()))
            .collect())
    }
    fn blob(&mut self, what: &str) -> ParseResult<Vec<u8>> {
        let n = self.u64(what)?;
        self.bytes(n, what)
    }
}

struct ParsedTask<B> {
    name: String,
    counters: [u64; 5],
    fresh: Vec<Slot<B>>,
    replay: Vec<Slot<B>>,
}

struct ParsedBody<B> {
    config: Config,
    next_seq: u64,
    max_key: u64,
    tasks: Vec<ParsedTask<B>>,
}

fn parse_body<B: Blob, R: Read>(src: &mut Source<R>) -> ParseResult<ParsedBody<B>> {
    let usize_of = |v: u64, what: &str| {
        usize::try_from(v).map_err(|_| format!("{what} {v} does not fit this machine"))
    };
    let max_bytes = src.u64("max_bytes")?;
    let fresh_capacity = usize_of(src.u64("fresh_capacity")?, "fresh_capacity")?;
    let replay_capacity = usize_of(src.u64("replay_capacity")?, "replay_capacity")?;
    let next_seq = src.u64("next_seq")?;
    let n_tasks = src.u32("task count")?;
    let mut items: HashMap<u64, Arc<Item<B>>> = HashMap::new();
    let mut tasks = Vec::new();
    let mut max_key = 0;
    for t in 0..n_tasks {
        let name_len = src.u32("task name length")?;
        let name = String::from_utf8(src.bytes(u64::from(name_len), "task name")?)
            .map_err(|_| format!("task #{t}: name is not UTF-8"))?;
        let n_counters = src.u32("counter count")?;
        if n_counters != N_COUNTERS {
            return Err(format!(
                "task {name:?}: {n_counters} counters, expected {N_COUNTERS}"
            ));
        }
        let mut counters = [0u64; 5];
        for c in &mut counters {
            *c = src.u64("counter")?;
        }
        let mut queues: [Vec<Slot<B>>; 2] = [Vec::new(), Vec::new()];
        for queue in &mut queues {
            let n = src.u64("queue length")?;
            let mut last_seq = None;
            for _ in 0..n {
                let seq = src.u64("sequence number")?;
                if last_seq.is_some_and(|l| l >= seq) {
                    return Err(format!("task {name:?}: sequence numbers not increasing"));
                }
                last_seq = Some(seq);
                let priority = f64::from_le_bytes(src.fixed("priority")?);
                if !(priority.is_finite() && priority >= 0.0) {
                    return Err(format!("task {name:?}: invalid priority {priority}"));
                }
                let item = match src.u8("entry tag")? {
                    0 => {
                        let item = Arc::new(parse_item::<B, R>(src)?);
                        max_key = max_key.max(item.key());
                        items.insert(item.key(), Arc::clone(&item));
                        item
                    }
                    1 => {
                        let key = src.u64("item key")?;
                        Arc::clone(
                            items
                                .get(&key)
                                .ok_or_else(|| format!("reference to unknown item key {key}"))?,
                        )
                    }
                    tag => return Err(format!("unknown entry tag {tag}")),
                };
                queue.push(Slot {
                    item,
                    seq,
                    priority,
                });
            }
        }
        let [fresh, replay] = queues;
        tasks.push(ParsedTask {
            name,
            counters,
            fresh,
            replay,
        });
    }
    Ok(ParsedBody {
        config: Config {
            max_bytes,
            fresh_capacity,
            replay_capacity,
            seed: None,
        },
        next_seq,
        max_key,
        tasks,
    })
}

fn parse_item<B: Blob, R: Read>(src: &mut Source<R>) -> ParseResult<Item<B>> {
    let key = src.u64("item key")?;
    let version = src.u64("version")? as i64;
    let tokens = src.array("tokens", i32::from_le_bytes)?;
    let logprobs = src.array("logprobs", f32::from_le_bytes)?;
    let offsets = src.array("offsets", i32::from_le_bytes)?;
    let rewards = src.array("rewards", f32::from_le_bytes)?;
    let n_blobs = src.u64("blob count")?;
    let mut blobs = Vec::new();
    for _ in 0..n_blobs {
        blobs.push(B::from_vec(src.blob("blob")?));
    }
    let metadata = B::from_vec(src.blob("metadata")?);
    Ok(Item::with_key(
        key, tokens, logprobs, offsets, rewards, version, blobs, metadata,
    ))
}
