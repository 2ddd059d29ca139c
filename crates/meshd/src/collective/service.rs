//! The node-local service ranks reach through `MESHD_SOCKET` (a Unix socket, owner-only).
//!
//! Hierarchical collectives: the local ranks of a node each hand their buffer to their
//! node's meshd; meshd reduces them locally, runs the inter-node QUIC ring once per node,
//! and hands the result back to every local rank. Ranks must issue collectives in the same
//! order (as with NCCL/Gloo); the k-th collective of every local rank forms operation k.
//!
//! Wire format on the socket (the Python client in `python/meshd` speaks it): each
//! message is `[u32 big-endian header length][JSON header][payload]`, the payload's length
//! given by the header's `nbytes`. Requests: `hello`, `allreduce`, `broadcast`, `barrier`,
//! `store_set`, `store_get`; replies carry `ok` and, on failure, `error` in words. The
//! parsing is in [`super::request`] (pure, fuzzed).

use super::buffer::CollectiveBuffer;
use super::cma::{self, Remote};
use super::request::{self, Kind, Request};
use super::ring::RingNet;
use super::store::{self, StoreSender};
use meshd_proto::node::{StoreAnswer, StoreCall};
use meshd_proto::reduce::{self, DType, ReduceOp};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, info};

/// Where and for whom the service runs.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// Socket path (MESHD_SOCKET).
    pub path: PathBuf,
    /// Processes on this node.
    pub local_world: u32,
    /// Global rank of local rank 0.
    pub first_global: u32,
    /// Total processes.
    pub world: u32,
    /// Restart round (separates operation ids and store values across restarts).
    pub restart: u32,
    /// Where the ranks' store requests go (the node core owns the store).
    pub store: StoreSender,
    /// Marked at every request and answer (a rank calling the service is not stalled).
    pub activity: Option<std::sync::Arc<crate::supervisor::output::Activity>>,
}

/// A running service; dropping it stops the tasks and removes the socket.
#[derive(Debug)]
pub struct Service {
    path: PathBuf,
    /// The socket's directory, when [`Service::start`] created it.
    dir: Option<PathBuf>,
    tasks: Vec<JoinHandle<()>>,
}

struct Part {
    kind: Kind,
    data: Data,
    global: u32,
    reply: oneshot::Sender<Result<Vec<u8>, String>>,
    /// Set when the rank gave up on this request (it timed out, or closed its connection):
    /// nothing is written into its buffer after that.
    gave_up: Arc<GaveUp>,
}

/// Whether a rank gave up on its request. The lock is held for every write into the
/// rank's memory, so once [`GaveUp::set`] returned no write is in progress and none comes:
/// the client's connection is closed only then, and the Python client returns from a
/// timed-out call only once it saw that close.
#[derive(Debug, Default)]
struct GaveUp(std::sync::Mutex<bool>);

impl GaveUp {
    fn lock(&self) -> std::sync::MutexGuard<'_, bool> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the request abandoned, waiting for a write in progress to end.
    fn set(&self) {
        *self.lock() = true;
    }

    fn is_set(&self) -> bool {
        *self.lock()
    }
}

/// A rank's buffer: sent through the socket, or read and written in place.
enum Data {
    Sent(Vec<u8>),
    InPlace(Remote),
}

impl Data {
    fn len(&self) -> usize {
        match self {
            Data::Sent(v) => v.len(),
            Data::InPlace(r) => r.len,
        }
    }

    /// Copies `dst.len()` bytes from offset `off`.
    fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), String> {
        match self {
            Data::Sent(v) => {
                dst.copy_from_slice(&v[off..off + dst.len()]);
                Ok(())
            }
            Data::InPlace(r) => cma::read(r, off, dst).map_err(|e| cma_error(r, &e)),
        }
    }
}

fn cma_error(r: &Remote, e: &std::io::Error) -> String {
    format!("cannot access the {}-byte buffer at {:#x} in process {}: {e}", r.len, r.addr, r.pid)
}

struct CollReq {
    local: u32,
    seq: u64,
    part: Part,
}

/// A default socket path for this job: `sock` in a directory of its own
/// (`meshd-RUN-PORT-PID-RANDOM` in `runtime_dir`, which the CLI takes from
/// `$XDG_RUNTIME_DIR`, else `/tmp`; created owner-only by [`Service::start`]), so the socket
/// is never reachable by another user, not even between its creation and its chmod, and
/// another user cannot guess the name to create it first.
pub fn default_path(runtime_dir: &Path, run_id: &str, port: u16) -> PathBuf {
    let dir = runtime_dir;
    // The default run id already starts with `meshd-`: not twice.
    let run_id = run_id.strip_prefix("meshd-").unwrap_or(run_id);
    let safe: String = run_id.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(40).collect();
    let mut r = [0u8; 8];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut r).is_err() {
        // No system randomness: the time still makes the name unpredictable enough to not
        // be pre-created by chance, and an existing one is refused anyway.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        r = (t as u64).to_le_bytes();
    }
    let random: String = r.iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("meshd-{safe}-{port}-{}-{random}", std::process::id())).join("sock")
}

/// Removes this user's socket directories left by meshd processes that no longer exist (a
/// meshd killed with SIGKILL cannot remove its own). Returns how many it removed.
pub fn sweep_stale(base: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let Ok(entries) = std::fs::read_dir(base) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("meshd-") {
            continue;
        }
        // meshd-RUN-PORT-PID-RANDOM: the pid is the second field from the end, after 16 hex
        // digits (a name of another form, an older meshd's, is never touched).
        let mut fields = name.rsplit('-');
        let random = fields.next().unwrap_or_default();
        if random.len() != 16 || !random.chars().all(|c| c.is_ascii_hexdigit()) {
            continue;
        }
        let Some(pid) = fields.next().and_then(|p| p.parse::<i32>().ok()) else { continue };
        let Ok(m) = std::fs::symlink_metadata(e.path()) else { continue };
        if !m.is_dir() || m.uid() != me || pid <= 0 {
            continue;
        }
        // SAFETY: signal 0 only checks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            // The tunnel's socket and library live there too (tunnel mode).
            for f in ["sock", "tunnel", "libmeshd_preload.so"] {
                let _ = std::fs::remove_file(e.path().join(f));
            }
            if std::fs::remove_dir(e.path()).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

/// Creates `path`'s directory owner-only (0700) when it does not exist and returns it (to
/// remove it later). An existing directory named like [`default_path`]'s must be this
/// user's and owner-only: one made by someone else is refused.
fn private_dir(path: &Path) -> std::io::Result<Option<PathBuf>> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let Some(dir) = path.parent() else { return Ok(None) };
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new().mode(0o700).create(dir)?;
            Ok(Some(dir.to_path_buf()))
        }
        Err(e) => Err(e),
        Ok(m) => {
            // SAFETY: geteuid has no preconditions and cannot fail.
            let me = unsafe { libc::geteuid() };
            let ours = m.is_dir() && m.uid() == me && m.mode() & 0o077 == 0;
            let named = dir.file_name().is_some_and(|n| n.to_string_lossy().starts_with("meshd-"));
            if named && !ours {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("{} exists and is not this user's owner-only directory", dir.display()),
                ));
            }
            Ok(None)
        }
    }
}

impl Service {
    /// Binds the socket (owner-only) and starts serving.
    pub fn start(cfg: ServiceConfig, ring: RingNet) -> std::io::Result<Service> {
        if let Some(base) = cfg.path.parent().and_then(Path::parent) {
            let n = sweep_stale(base);
            if n > 0 {
                tracing::debug!(
                    "removed {n} stale socket director{} of meshd processes that are gone",
                    if n == 1 { "y" } else { "ies" }
                );
            }
        }
        let dir = private_dir(&cfg.path)?;
        let _ = std::fs::remove_file(&cfg.path);
        let listener = UnixListener::bind(&cfg.path)?;
        std::fs::set_permissions(&cfg.path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let (coll_tx, coll_rx) = mpsc::channel(1024);
        let tasks = vec![
            tokio::spawn(accept(listener, cfg.clone(), coll_tx)),
            tokio::spawn(collectives(cfg.clone(), ring, coll_rx)),
        ];
        Ok(Service { path: cfg.path, dir, tasks })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        let _ = std::fs::remove_file(&self.path);
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir(d);
        }
    }
}

async fn accept(listener: UnixListener, cfg: ServiceConfig, coll: mpsc::Sender<CollReq>) {
    let mut errors = crate::files::AcceptErrors::new("the local service's socket (MESHD_SOCKET)");
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                errors.ok();
                stream
            }
            // Out of open files (EMFILE) and the like: wait and accept again, never stop.
            Err(e) => {
                tokio::time::sleep(errors.failed(&e)).await;
                continue;
            }
        };
        let (cfg, coll) = (cfg.clone(), coll.clone());
        tokio::spawn(async move {
            if let Err(e) = client(stream, &cfg, coll).await {
                debug!("local client: {e}");
            }
        });
    }
}

/// Reads one message; the payload goes into `spare` (the previous reply's buffer, so a
/// rank that sends the same bucket again and again costs no fresh allocation).
async fn read_msg<R: AsyncRead + Unpin>(
    s: &mut R,
    spare: Vec<u8>,
) -> std::io::Result<Option<(Value, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match s.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = request::header_len(len).map_err(std::io::Error::other)?;
    let mut head = vec![0u8; n];
    s.read_exact(&mut head).await?;
    let (v, nbytes) = request::parse_header(&head).map_err(std::io::Error::other)?;
    let mut payload = spare;
    payload.clear();
    payload.reserve(nbytes);
    while payload.len() < nbytes {
        let left = (nbytes - payload.len()) as u64;
        if (&mut *s).take(left).read_buf(&mut payload).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(Some((v, payload)))
}

/// Payloads up to this size go in the same write as their header.
const SMALL_PAYLOAD: usize = 64 << 10;

async fn write_msg<W: AsyncWrite + Unpin>(s: &mut W, head: Value, payload: &[u8]) -> std::io::Result<()> {
    let mut head = head;
    head["nbytes"] = json!(payload.len());
    let h = serde_json::to_vec(&head).map_err(std::io::Error::other)?;
    let small = payload.len() <= SMALL_PAYLOAD;
    let mut out = Vec::with_capacity(4 + h.len() + if small { payload.len() } else { 0 });
    out.extend_from_slice(&(h.len() as u32).to_be_bytes());
    out.extend_from_slice(&h);
    if small {
        out.extend_from_slice(payload);
    }
    s.write_all(&out).await?;
    if !small {
        s.write_all(payload).await?;
    }
    s.flush().await
}

async fn client(s: UnixStream, cfg: &ServiceConfig, coll: mpsc::Sender<CollReq>) -> std::io::Result<()> {
    let mut seq = 0u64;
    let mut me: Option<(u32, u32)> = None; // (global, local)
    // The peer's pid from the kernel: the only process meshd reads or writes for it.
    let pid = s.peer_cred().ok().and_then(|c| c.pid());
    // Requests are read through a buffer: length, header and a small payload in one read.
    let (r, mut s) = s.into_split();
    let mut r = BufReader::with_capacity(request::MAX_HEADER + 4, r);
    let mut in_place = false;
    let mut spare = Vec::new();
    while let Some((req, payload)) = read_msg(&mut r, std::mem::take(&mut spare)).await? {
        if let Some(a) = &cfg.activity {
            a.touch();
        }
        let fail = |e: String| json!({"ok": false, "error": e});
        let (head, body): (Value, Vec<u8>) = match request::parse_request(&req, payload.len(), cfg.world) {
            Request::Hello { rank } => {
                let lo = cfg.first_global as u64;
                if rank < lo || rank >= lo + cfg.local_world as u64 {
                    (
                        fail(format!(
                            "rank {rank} is not a rank of this node (ranks {lo}..{})",
                            lo + cfg.local_world as u64
                        )),
                        vec![],
                    )
                } else {
                    me = Some((rank as u32, (rank - lo) as u32));
                    in_place = match (pid, request::parse_probe(&req)) {
                        (Some(pid), Some((addr, want))) => probe(pid, addr, want),
                        _ => false,
                    };
                    let hello = json!({"ok": true, "world": cfg.world, "local_world": cfg.local_world, "in_place": in_place});
                    (hello, vec![])
                }
            }
            Request::Collective(kind) => {
                let Some((global, local)) = me else {
                    write_msg(&mut s, fail("send hello first".into()), &[]).await?;
                    continue;
                };
                let data = match request::parse_in_place(&req, payload.len()) {
                    Ok(None) => Ok(Data::Sent(payload)),
                    Ok(Some(b)) => match pid {
                        Some(pid) if in_place => Ok(Data::InPlace(Remote { pid, addr: b.addr, len: b.len })),
                        _ => Err("in-place buffers need the cross-memory probe of hello to succeed; send the payload instead".to_string()),
                    },
                    Err(e) => Err(e),
                };
                match kind.and_then(|k| data.map(|d| (k, d))) {
                    Err(e) => (fail(e), vec![]),
                    Ok((kind, data)) => {
                        let (tx, rx) = oneshot::channel();
                        let gave_up = Arc::new(GaveUp::default());
                        let part = Part { kind, data, global, reply: tx, gave_up: gave_up.clone() };
                        seq += 1;
                        if coll.send(CollReq { local, seq, part }).await.is_err() {
                            (fail("the node's collective engine stopped".into()), vec![])
                        } else {
                            match until_hangup(rx, &mut r).await {
                                Some(Ok(Ok(data))) => (json!({"ok": true}), data),
                                Some(Ok(Err(e))) => (fail(e), vec![]),
                                Some(Err(_)) => {
                                    (fail("the collective was abandoned (job stopping?)".into()), vec![])
                                }
                                // The rank timed out or went away: its buffer is not ours to
                                // write any more. Closing the connection tells it so.
                                None => {
                                    gave_up.set();
                                    debug!("rank {global} gave up on its collective #{seq}");
                                    return Ok(());
                                }
                            }
                        }
                    }
                }
            }
            Request::StoreSet(Err(e)) => (fail(e), vec![]),
            Request::StoreSet(Ok(key)) => {
                let call = StoreCall::Set { key: key.clone(), value: payload };
                match store::ask(&cfg.store, cfg.restart, call).await {
                    Some(StoreAnswer::Set(Ok(()))) => (json!({"ok": true}), vec![]),
                    Some(StoreAnswer::Set(Err(e))) => (fail(format!("store_set of {key:?}: {e}")), vec![]),
                    _ => (fail(format!("store_set of {key:?}: the store stopped (job stopping?)")), vec![]),
                }
            }
            Request::StoreGet { key, timeout } => {
                let call = StoreCall::Get { key: key.clone(), wait: Duration::from_secs_f64(timeout) };
                match store::ask(&cfg.store, cfg.restart, call).await {
                    Some(StoreAnswer::Get(Some(v))) => (json!({"ok": true}), v),
                    _ => (fail(format!("store key {key:?} not set within {timeout} s")), vec![]),
                }
            }
            Request::Unknown(other) => (fail(format!("unknown request {other:?}")), vec![]),
        };
        write_msg(&mut s, head, &body).await?;
        if let Some(a) = &cfg.activity {
            a.touch();
        }
        spare = body;
    }
    Ok(())
}

/// Waits for `rx`, unless the client hangs up first (end of file or an error on its
/// connection: the Python client half-closes when its call times out): then `None`. Bytes
/// the client sent meanwhile stay unread for the next request.
async fn until_hangup<T, R: tokio::io::AsyncBufRead + Unpin>(
    rx: oneshot::Receiver<T>,
    r: &mut R,
) -> Option<Result<T, oneshot::error::RecvError>> {
    use tokio::io::AsyncBufReadExt;
    tokio::pin!(rx);
    tokio::select! {
        v = &mut rx => return Some(v),
        more = r.fill_buf() => match more {
            Ok(b) if !b.is_empty() => {}
            _ => return None,
        },
    }
    // The client sent more before its answer (not what the clients do): just wait.
    Some(rx.await)
}

/// Whether meshd can read the client's memory: the probe bytes must be found at the
/// address the client gave.
fn probe(pid: i32, addr: u64, want: [u8; request::PROBE_LEN]) -> bool {
    let r = Remote { pid, addr, len: want.len() };
    let mut got = [0u8; request::PROBE_LEN];
    match cma::read(&r, 0, &mut got) {
        Ok(()) if got == want => true,
        Ok(()) => {
            debug!("process {pid}: the probe bytes differ; buffers go through the socket");
            false
        }
        Err(e) => {
            // Once per meshd at info: the slower path should not go unnoticed.
            static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                debug!("process {pid}: cross-memory attach refused ({e}); buffers go through the socket");
            } else {
                info!(
                    "local ranks' buffers go through the socket (slower): the kernel refused meshd access to process {pid}'s memory ({e}); check /proc/sys/kernel/yama/ptrace_scope (0 or 1 allows it) and seccomp"
                );
            }
            false
        }
    }
}

fn describe(k: &Kind, len: usize) -> String {
    match k {
        Kind::AllReduce(d, o) => format!("allreduce {} {} of {len} bytes", d.name(), o.name()),
        Kind::Broadcast(r) => format!("broadcast from {r} of {len} bytes"),
        Kind::Barrier => "barrier".into(),
    }
}

async fn collectives(cfg: ServiceConfig, mut ring: RingNet, mut rx: mpsc::Receiver<CollReq>) {
    let n = cfg.local_world as usize;
    let mut slots: BTreeMap<u64, Vec<Option<Part>>> = BTreeMap::new();
    let mut next = 1u64;
    let mut work = Work::default();
    while let Some(req) = rx.recv().await {
        if req.seq < next || req.local as usize >= n || slots.len() > 4096 {
            let _ = req.part.reply.send(Err("collective out of order".into()));
            continue;
        }
        let slot = slots.entry(req.seq).or_insert_with(|| (0..n).map(|_| None).collect());
        slot[req.local as usize] = Some(req.part);
        while slots.get(&next).is_some_and(|s| s.iter().all(Option::is_some)) {
            let Some(parts) = slots.remove(&next) else { break };
            let parts: Vec<Part> = parts.into_iter().flatten().collect();
            let op_id = ((cfg.restart as u64) << 40) | next;
            run_one(&cfg, &mut ring, op_id, parts, &mut work).await;
            next += 1;
        }
    }
}

/// The node's memory for collectives, reused from one to the next (a training job reduces
/// the same buckets again and again: a fresh buffer each time costs a page fault per
/// 4 KiB). Two buffers, because the ring lends its chunks to QUIC and the last of them may
/// still be unacknowledged when the next collective starts; that one then takes the other.
#[derive(Debug, Default)]
struct Work {
    bufs: [CollectiveBuffer; 2],
    last: usize,
}

impl Work {
    /// A buffer of `len` bytes with nothing lent out (its contents are stale).
    fn next(&mut self, len: usize) -> &mut CollectiveBuffer {
        let i = if self.bufs[self.last].loans() == 0 { self.last } else { 1 - self.last };
        self.last = i;
        self.bufs[i].reset(len);
        &mut self.bufs[i]
    }

    /// The buffer the last collective ran in.
    fn last(&self) -> &[u8] {
        self.bufs[self.last].as_slice()
    }
}

async fn run_one(cfg: &ServiceConfig, ring: &mut RingNet, op_id: u64, parts: Vec<Part>, work: &mut Work) {
    let kind = parts[0].kind.clone();
    let len = parts[0].data.len();
    if let Some(gone) = parts.iter().find(|p| p.gave_up.is_set()) {
        let msg = format!(
            "collective #{} ({}) cannot complete on this node: rank {} gave up on it before every local \
             rank had called it (its call timed out or its connection closed)",
            op_id & ((1 << 40) - 1),
            describe(&kind, len),
            gone.global
        );
        tracing::warn!("{msg}");
        for p in parts {
            let _ = p.reply.send(Err(msg.clone()));
        }
        return;
    }
    if let Some(bad) = parts.iter().find(|p| p.kind != kind || p.data.len() != len) {
        let msg = format!(
            "local ranks disagree on collective #{}: rank {} calls {}, rank {} calls {}",
            op_id & ((1 << 40) - 1),
            parts[0].global,
            describe(&kind, len),
            bad.global,
            describe(&bad.kind, bad.data.len())
        );
        for p in parts {
            let _ = p.reply.send(Err(msg.clone()));
        }
        return;
    }
    let started = std::time::Instant::now();
    let result = reduce_parts(ring, op_id, &kind, &parts, work, cfg.world).await;
    let reduced = started.elapsed();
    if let Err(e) = &result {
        // The ranks raise it too; here it is on the node's log, where the job's end is read.
        tracing::warn!("collective #{} ({}) failed: {e}", op_id & ((1 << 40) - 1), describe(&kind, len));
    }
    let work = work.last();
    let written = match &result {
        Ok(out) => write_back(&parts, &work[..*out]),
        Err(_) => vec![Ok(()); parts.len()],
    };
    debug!(
        "collective #{}: {}: gathered, reduced and ring in {:?}, written back in {:?}",
        op_id & ((1 << 40) - 1),
        describe(&kind, len),
        reduced,
        started.elapsed() - reduced
    );
    for (p, w) in parts.into_iter().zip(written) {
        let reply = match (&result, p.data, w) {
            (Err(e), _, _) => Err(e.clone()),
            // The rank's own request buffer carries the reply (no fresh allocation).
            (Ok(out), Data::Sent(mut v), _) => {
                v.clear();
                v.extend_from_slice(&work[..*out]);
                Ok(v)
            }
            (Ok(_), Data::InPlace(_), w) => w.map(|()| Vec::new()),
        };
        let _ = p.reply.send(reply);
    }
}

/// Buffers from this size up are read, reduced and written back by several threads.
const PARALLEL_FROM: usize = 4 << 20;
/// Other local ranks' buffers are read and reduced this much at a time (stays in cache).
const SLICE: usize = 1 << 20;

/// Threads for the local phase of a `len`-byte collective (one per core, at most 8): the
/// local phase is memory-bound work that splits evenly, and a node with eight ranks has
/// four times the bytes of one with two to move (docs/PERFORMANCE.md, "Local ranks").
fn local_threads(len: usize) -> usize {
    if len < PARALLEL_FROM {
        return 1;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.min(8).min(len / SLICE).max(1)
}

/// Slices of a `len`-byte buffer for `threads` workers: page-aligned, so a multiple of
/// every element size.
fn slice_len(len: usize, threads: usize) -> usize {
    len.div_ceil(threads.max(1)).div_ceil(4096).max(1) * 4096
}

/// Runs the jobs, on scoped threads when there is more than one; results in job order.
fn on_threads<T: Send>(jobs: Vec<impl FnOnce() -> T + Send>) -> Vec<Result<T, String>> {
    if jobs.len() <= 1 {
        return jobs.into_iter().map(|j| Ok(j())).collect();
    }
    let run = move || {
        std::thread::scope(|s| {
            let handles: Vec<_> = jobs.into_iter().map(|j| s.spawn(j)).collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| "a local worker thread panicked".to_string()))
                .collect()
        })
    };
    // Blocking work: let the runtime move its other tasks off this worker meanwhile.
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
        _ => run(),
    }
}

/// `acc` = the local ranks' buffers reduced with `op`, read a slice at a time.
fn gather_local(parts: &[Part], acc: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), String> {
    let each = |off: usize, dst: &mut [u8]| -> Result<(), String> {
        parts[0].data.read(off, dst)?;
        let mut scratch = vec![0u8; SLICE.min(dst.len())];
        for p in &parts[1..] {
            for o in (0..dst.len()).step_by(SLICE) {
                let k = SLICE.min(dst.len() - o);
                p.data.read(off + o, &mut scratch[..k])?;
                reduce::reduce_into(dtype, op, &mut dst[o..o + k], &scratch[..k])
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    };
    let per = slice_len(acc.len(), local_threads(acc.len()));
    let each = &each;
    let jobs: Vec<_> = acc.chunks_mut(per).enumerate().map(|(i, dst)| move || each(i * per, dst)).collect();
    on_threads(jobs).into_iter().try_for_each(|r| r.and_then(|r| r))
}

/// Writes `result` into every in-place rank's buffer; one outcome per part (a rank that
/// died does not fail the others).
fn write_back(parts: &[Part], result: &[u8]) -> Vec<Result<(), String>> {
    if !parts.iter().any(|p| matches!(p.data, Data::InPlace(_))) {
        return vec![Ok(()); parts.len()];
    }
    let write = |off: usize, src: &[u8]| -> Vec<Result<(), String>> {
        parts
            .iter()
            .map(|p| match &p.data {
                Data::InPlace(r) => {
                    // Held while writing: a rank that gave up gets nothing written after.
                    let gave_up = p.gave_up.lock();
                    if *gave_up {
                        return Err(format!("rank {} gave up on this collective", p.global));
                    }
                    cma::write(r, off, src).map_err(|e| cma_error(r, &e))
                }
                Data::Sent(_) => Ok(()),
            })
            .collect()
    };
    let per = slice_len(result.len(), local_threads(result.len()));
    let write = &write;
    let jobs: Vec<_> = result.chunks(per).enumerate().map(|(i, src)| move || write(i * per, src)).collect();
    let per_slice = on_threads(jobs);
    let mut out = vec![Ok(()); parts.len()];
    for slice in per_slice {
        match slice {
            Ok(results) => {
                for (o, r) in out.iter_mut().zip(results) {
                    if o.is_ok() {
                        *o = r;
                    }
                }
            }
            Err(e) => out.iter_mut().for_each(|o| *o = Err(e.clone())),
        }
    }
    out
}

/// Reduces the local parts into the next of `work`'s buffers, runs the ring there, and
/// returns the result's length (the result is `work.last()[..len]`).
async fn reduce_parts(
    ring: &mut RingNet,
    op_id: u64,
    kind: &Kind,
    parts: &[Part],
    work: &mut Work,
    ranks: u32,
) -> Result<usize, String> {
    let len = parts[0].data.len();
    let (dtype, op, acc, out) = match kind {
        Kind::AllReduce(d, o) => {
            let acc = work.next(len);
            let ring_op = if *o == ReduceOp::Avg { ReduceOp::Sum } else { *o };
            let t = std::time::Instant::now();
            gather_local(parts, acc.try_as_mut().unwrap_or_default(), *d, ring_op)?;
            debug!(
                "local gather of {len} bytes from {} in {:?}",
                crate::plural(parts.len() as u64, "rank"),
                t.elapsed()
            );
            (*d, *o, acc, len)
        }
        // Broadcast as a byte-exact sum: the root's bytes plus zeros from everyone else,
        // as wrapping int64 additions (identity on the root's bits).
        Kind::Broadcast(root) => {
            let acc = work.next(len.div_ceil(8) * 8);
            let bytes = acc.try_as_mut().unwrap_or_default();
            bytes.fill(0);
            if let Some(p) = parts.iter().find(|p| p.global == *root) {
                p.data.read(0, &mut bytes[..len])?;
            }
            (DType::I64, ReduceOp::Sum, acc, len)
        }
        Kind::Barrier => {
            let acc = work.next(8);
            acc.try_as_mut().unwrap_or_default().fill(0);
            (DType::I64, ReduceOp::Sum, acc, 0)
        }
    };
    // An average divides the sum over every rank of the job (not every node) once, where
    // the ring completes each chunk, so all nodes spread the same divided bytes.
    ring.allreduce_buffer_dividing(op_id, acc, dtype, op, ranks as usize).await.map_err(|e| e.to_string())?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{default_path, sweep_stale};
    use std::path::Path;

    #[test]
    fn socket_directory_names_meshd_once() {
        let pid = std::process::id();
        let dir = |run: &str| {
            default_path(Path::new("/tmp"), run, 29400)
                .parent()
                .and_then(|d| d.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let a = dir("meshd-0123456789ab");
        assert!(a.starts_with(&format!("meshd-0123456789ab-29400-{pid}-")), "{a}");
        assert!(dir("train-7").starts_with(&format!("meshd-train-7-29400-{pid}-")));
        assert!(default_path(Path::new("/tmp"), "meshd-x", 1).ends_with("sock"));
        // Unpredictable: another user cannot create it first.
        let random = |n: &str| n.rsplit('-').next().unwrap_or_default().to_string();
        assert_eq!(random(&a).len(), 16);
        assert_ne!(random(&a), random(&dir("meshd-0123456789ab")));
    }

    /// Issue 16: a SIGKILLed meshd's socket directory is removed by the next meshd of the
    /// same user; a live process's and another user's are kept.
    #[test]
    fn stale_socket_directories_of_gone_processes_are_swept() {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::temp_dir().join(format!("meshd-sweep-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).expect("base");
        // A pid that does not exist (above the kernel's pid_max default range is unusual:
        // take one that kill(0) says is gone).
        let dead = (4_000_000..4_100_000).find(|p| unsafe { libc::kill(*p, 0) } != 0).expect("a free pid");
        let stale = base.join(format!("meshd-run-29400-{dead}-00112233aabbccdd"));
        let live = base.join(format!("meshd-run-29400-{}-00112233aabbccdd", std::process::id()));
        let other = base.join("not-meshd-1-2-3");
        // An older meshd's name (no random part): its last number is a port, not a pid.
        let older = base.join("meshd-default-29400-1");
        for d in [&stale, &live, &other, &older] {
            std::fs::DirBuilder::new().mode(0o700).create(d).expect("mkdir");
        }
        // A tunnel-mode job's directory also holds the tunnel's socket and library.
        for f in ["sock", "tunnel", "libmeshd_preload.so"] {
            std::fs::write(stale.join(f), b"").expect("file");
        }
        assert_eq!(sweep_stale(&base), 1);
        assert!(!stale.exists() && live.exists() && other.exists() && older.exists());
        let _ = std::fs::remove_dir_all(&base);
    }
}
