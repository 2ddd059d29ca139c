//! The TCP tunnel (tunnel mode): the TCP connections a rank opens to another roster node
//! travel over meshd's authenticated QUIC connection to that node, so an unmodified job
//! (`init_process_group("gloo")`, TCPStore, user sockets) runs where only meshd's UDP port
//! is open between the nodes.
//!
//! Near end: `libmeshd_preload.so` (crates/meshd-preload, embedded in this binary and
//! written next to the job's sockets) interposes `connect()` in every rank; a connect to a
//! roster node's address becomes a connection to this node's tunnel socket (a Unix socket in
//! the job's owner-only directory, same user only) carrying a 22-byte request (the
//! destination). meshd opens a bidirectional QUIC stream to the destination node's meshd
//! ([`Transport::open_tunnel`]), which connects to the destination locally and answers one
//! status byte; the rank gets that status (ok, or an errno), then both meshds copy bytes
//! both ways: on the QUIC stream, or as the data plane's datagrams where it is ready
//! ([`plane_stream`]: opening, end and reset stay on the QUIC stream). End of stream is passed on as a half-close (`shutdown(SHUT_WR)` / QUIC FIN),
//! a failure as a reset (QUIC RESET_STREAM, TCP RST on the far end; the rank's Unix socket
//! is closed without a half-close first, which the preload library reports to the rank as
//! ECONNRESET).
//!
//! Far end ([`far`]): a peer's tunnel stream is served only when it comes from a roster
//! member's own address, for this node's roster address, on a port where a process of this
//! job listens ([`listeners`]); anything else is refused and logged once per peer and reason.
//! Both ends cap the connections one peer may hold ([`far::MAX_PER_PEER`]) and share the
//! node's open files ([`Budget`]); a round's tasks, and every connection they carry, end
//! with the round's [`Tunnel`].

mod far;
pub mod listeners;
mod plane_stream;

use crate::transport::{TUNNEL_REQUEST_LEN, Transport, TunnelStream};
use bytes::{Bytes, BytesMut};
use meshd_proto::NodeId;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::sync::{Mutex, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

/// `libmeshd_preload.so`, built from crates/meshd-preload by build.rs.
pub const PRELOAD: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libmeshd_preload.so"));

/// The request's wire: crates/meshd-preload's own file, compiled here too (that crate
/// cannot be a dependency: it exports `connect`). On the tunnel socket a request comes
/// marked [`wire::VERSION_PADDED`] and is forwarded to the far end as [`wire::VERSION`].
#[path = "../../meshd-preload/src/wire.rs"]
#[allow(dead_code)] // the library's side (padded requests, its peers variable) unused here
mod wire;

const _: () = assert!(TUNNEL_REQUEST_LEN == wire::REQUEST_LEN);

/// QUIC stream error code of a tunnelled connection that failed (reset).
const RESET: u32 = 1;
/// How long a rank has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the near end waits for the far end's status (it includes the far end's 10 s
/// connect timeout).
const STATUS_TIMEOUT: Duration = Duration::from_secs(15);
/// Open files kept out of the tunnel's [`Budget`]: the ranks' pipes, the service's
/// clients, /proc reads, quinn's socket.
const RESERVED_FILES: usize = 64;
/// The block a local socket's bytes are read into, then lent to quinn read by read: one
/// allocation per block, not per read.
const BLOCK: usize = 1 << 20;
/// The least room a read gets in the block.
const MIN_READ: usize = 64 << 10;
/// quinn's received chunks (about one packet each) written with one `writev`.
const MAX_CHUNKS: usize = 256;
/// Send buffer of meshd's end of a rank's Unix socket (the rank's end gets the same from
/// the preload library). A Unix socket's queue is bounded by its sender's buffer, 208 KiB
/// by default, and does not grow as TCP's does (to `tcp_wmem`'s 4 MiB); at the default a
/// 1 MiB Gloo message takes five writes and five wakeups of each side. Capped by
/// `net.core.wmem_max` (no privilege asked).
const UNIX_SNDBUF: libc::c_int = 4 << 20;

/// Writes every byte of `chunks` to `w`, as many chunks per call as the socket takes.
async fn write_all_chunks<W: AsyncWrite + Unpin>(w: &mut W, chunks: &mut [Bytes]) -> std::io::Result<()> {
    use bytes::Buf;
    let mut first = 0;
    while first < chunks.len() {
        let slices: Vec<std::io::IoSlice<'_>> =
            chunks[first..].iter().map(|c| std::io::IoSlice::new(c)).collect();
        let mut n = w.write_vectored(&slices).await?;
        drop(slices);
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let c = &mut chunks[first];
            if n >= c.len() {
                n -= c.len();
                first += 1;
            } else {
                c.advance(n);
                n = 0;
            }
        }
        while first < chunks.len() && chunks[first].is_empty() {
            first += 1;
        }
    }
    Ok(())
}

pub use wire::{decode_request, encode_request};

/// Counters of one node's tunnel (both ends), for the end-of-job line and `meshd status`.
#[derive(Debug, Default)]
pub struct TunnelStats {
    /// Connections this node's ranks opened through the tunnel (established).
    pub opened: AtomicU64,
    /// Connections of this node's ranks that failed (refused, unreachable, timed out).
    pub failed: AtomicU64,
    /// Connections peers' ranks opened to this node through their tunnels (established).
    pub served: AtomicU64,
    /// Peers' tunnel streams this node refused (not a member, not the job's port, a cap).
    pub refused: AtomicU64,
    /// Tunnelled connections open now (both ends).
    pub active: AtomicU64,
    /// Bytes sent into the tunnel (to other nodes).
    pub bytes_out: AtomicU64,
    /// Bytes received from the tunnel (from other nodes).
    pub bytes_in: AtomicU64,
}

impl TunnelStats {
    /// The counters as `meshd status` gets them.
    pub fn reply(&self) -> meshd_proto::wire::TunnelReply {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        meshd_proto::wire::TunnelReply {
            opened: g(&self.opened),
            failed: g(&self.failed),
            served: g(&self.served),
            active: g(&self.active),
            bytes_out: g(&self.bytes_out),
            bytes_in: g(&self.bytes_in),
        }
    }

    /// One line: connections and bytes.
    pub fn line(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "{} opened by this node's ranks ({} failed), {} served for other nodes ({} refused), {} open; {:.1} MiB sent, {:.1} MiB received",
            crate::plural(g(&self.opened), "tunnelled connection"),
            g(&self.failed),
            g(&self.served),
            g(&self.refused),
            g(&self.active),
            g(&self.bytes_out) as f64 / (1 << 20) as f64,
            g(&self.bytes_in) as f64 / (1 << 20) as f64,
        )
    }
}

/// The far end's queue of peers' tunnel streams, taken from the transport once and shared
/// by every restart round's [`Tunnel`].
pub type Incoming = Arc<Mutex<mpsc::Receiver<TunnelStream>>>;

/// Takes the transport's tunnel streams (once per transport).
pub fn incoming(t: &Transport) -> Option<Incoming> {
    t.take_tunnel_streams().map(|r| Arc::new(Mutex::new(r)))
}

/// What one round's tunnel needs.
#[derive(Clone, Debug)]
pub struct TunnelConfig {
    /// The job's owner-only socket directory (the local service's).
    pub dir: PathBuf,
    /// Every other roster node: its address on the chosen interface -> its meshd.
    pub routes: HashMap<IpAddr, SocketAddr>,
    /// Roster members whose tunnel streams this node serves: id -> roster address (a
    /// stream must come from that address).
    pub members: HashMap<NodeId, IpAddr>,
    /// This node's roster address: the only destination served for peers.
    pub local_ip: IpAddr,
    /// The process whose descendants are the job (meshd itself): the far end connects only
    /// to ports they listen on ([`listeners::JobPorts`]).
    pub job_root: i32,
    /// Count `job_root`'s own listeners as the job's (a test process playing both parts).
    pub job_root_itself: bool,
    /// meshd's own listeners on this node's roster address that peers' ranks may reach
    /// (`--fault-tolerance node`: the replica group's TCPStore, which the other groups use
    /// for torchft's cross-group rendezvous).
    pub own_ports: Vec<u16>,
    /// Tunnelled connections one other node may hold with this one, each way
    /// ([`far::MAX_PER_PEER`] in a job).
    pub per_peer: usize,
    /// Tunnelled connections this node holds at most, both ends together; `None`: what its
    /// open files allow ([`Budget::for_this_process`]).
    pub files: Option<usize>,
    /// The preload library the ranks load, when the user gave one (the CLI's
    /// `MESHD_PRELOAD_LIB`); else meshd writes its embedded copy to `dir`.
    pub preload_lib: Option<PathBuf>,
    /// Whether tunnelled bytes may travel on the data plane where it runs
    /// ([`plane_stream`]; `MESHD_PLANE=0` turns the plane off altogether).
    pub plane: bool,
}

/// The round's other nodes as the tunnel serves them: replaced while the round runs when
/// a node joins the running job (`--fault-tolerance node`, [`Tunnel::set_roster`]).
#[derive(Debug, Default)]
struct Routes {
    /// Their addresses on the chosen interface -> their meshd.
    to: HashMap<IpAddr, SocketAddr>,
    /// Members whose streams are served: id -> roster address.
    members: HashMap<NodeId, IpAddr>,
}

type LiveRoutes = Arc<std::sync::RwLock<Routes>>;

fn read_routes(r: &LiveRoutes) -> std::sync::RwLockReadGuard<'_, Routes> {
    r.read().unwrap_or_else(|p| p.into_inner())
}

/// The tunnelled connections open now, at both ends, so that those with a lost node (and,
/// after a lost quorum, those with the other replica groups) can be ended at once
/// ([`Tunnel::cut`]) rather than at the ranks' own timeouts.
#[derive(Debug, Default)]
struct Conns {
    next: AtomicU64,
    open: std::sync::Mutex<HashMap<u64, Conn>>,
}

#[derive(Debug)]
struct Conn {
    /// The other node's roster address.
    peer: IpAddr,
    /// The listening end: the destination the rank connected to (on the peer at the near
    /// end, on this node at the far end).
    listener: SocketAddr,
    /// Ends the connection as a failure (both sides reset).
    cut: tokio::sync::oneshot::Sender<()>,
}

/// A registered connection; dropping it unregisters it.
struct ConnGuard {
    conns: Arc<Conns>,
    id: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.id);
    }
}

impl Conns {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Conn>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(self: &Arc<Self>, peer: IpAddr, listener: SocketAddr) -> (ConnGuard, Cut) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let conn = Conn { peer: peer.to_canonical(), listener: canonical(listener), cut: tx };
        self.lock().insert(id, conn);
        (ConnGuard { conns: self.clone(), id }, rx)
    }

    /// Ends every connection `which(peer, listener)` picks; how many.
    fn cut(&self, which: impl Fn(IpAddr, SocketAddr) -> bool) -> usize {
        let mut open = self.lock();
        let ids: Vec<u64> =
            open.iter().filter(|(_, c)| which(c.peer, c.listener)).map(|(id, _)| *id).collect();
        ids.iter()
            .filter_map(|id| open.remove(id))
            .map(|c| c.cut.send(()).is_ok())
            .filter(|sent| *sent)
            .count()
    }
}

/// A connection's cut signal (see [`Conns`]).
type Cut = tokio::sync::oneshot::Receiver<()>;

/// What ends a piped connection besides its two sides: meshd's cut, and at the near end the
/// rank's socket closed entirely (see [`pipe`]).
struct Ends {
    closed: Option<std::os::fd::RawFd>,
    cut: Cut,
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// A running tunnel; dropping it stops it and removes its socket, peers file and library.
#[derive(Debug)]
pub struct Tunnel {
    socket: PathBuf,
    peers_file: PathBuf,
    lib: Preload,
    peers: String,
    local_ip: IpAddr,
    routes: LiveRoutes,
    conns: Arc<Conns>,
    tasks: Vec<JoinHandle<()>>,
    stats: Arc<TunnelStats>,
    budget: Arc<Budget>,
}

/// The open files the tunnel may use on this node, both ends together: one for each
/// tunnelled connection at each end (the rank's Unix socket at the near end, the TCP
/// connection at the far end). Past it a connection is refused at once (the rank sees
/// ECONNREFUSED, and Gloo and TCPStore retry) rather than failing some other part of meshd
/// with EMFILE.
#[derive(Debug)]
pub struct Budget {
    slots: Arc<Semaphore>,
    capacity: usize,
}

impl Budget {
    /// A budget of `capacity` connections.
    pub fn new(capacity: usize) -> Budget {
        Budget { slots: Arc::new(Semaphore::new(capacity)), capacity }
    }

    /// What this process can hold: its open-files limit, less the files open now and
    /// [`RESERVED_FILES`].
    pub fn for_this_process() -> Budget {
        let limit = crate::files::limit().soft;
        let open = crate::files::open_now().unwrap_or(32);
        Budget::new(limit.saturating_sub(open + RESERVED_FILES).max(8))
    }

    fn try_take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_owned().ok()
    }

    /// Connections it holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Tunnel {
    /// Binds the tunnel socket in `cfg.dir`, writes the preload library there and serves
    /// both ends.
    pub fn start(
        cfg: TunnelConfig,
        transport: Transport,
        incoming: Incoming,
        stats: Arc<TunnelStats>,
    ) -> std::io::Result<Tunnel> {
        let socket = cfg.dir.join("tunnel");
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)?;
        std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let lib = Preload::write(&cfg.dir, cfg.preload_lib.as_deref())?;
        let peers = peer_list(cfg.routes.keys());
        let peers_file = cfg.dir.join("tunnel-peers");
        write_peers_file(&peers_file, &peers)?;
        let routes: LiveRoutes =
            Arc::new(std::sync::RwLock::new(Routes { to: cfg.routes.clone(), members: cfg.members.clone() }));
        let conns = Arc::new(Conns::default());
        let budget = Arc::new(cfg.files.map_or_else(Budget::for_this_process, Budget::new));
        let local_ip = cfg.local_ip;
        let plane = transport.plane().filter(|_| cfg.plane).cloned();
        let far = Arc::new(far::Far {
            plane: plane.clone(),
            ports: Arc::new(listeners::JobPorts::new(cfg.job_root, cfg.job_root_itself)),
            cfg: Arc::new(cfg),
            routes: routes.clone(),
            conns: conns.clone(),
            stats: stats.clone(),
            budget: budget.clone(),
            logged: Default::default(),
            per_peer: Default::default(),
        });
        let near = Near {
            plane,
            cfg: far.cfg.clone(),
            routes: routes.clone(),
            conns: conns.clone(),
            transport,
            stats: stats.clone(),
            budget: budget.clone(),
            per_peer: Default::default(),
        };
        let tasks = vec![tokio::spawn(near.serve(listener)), tokio::spawn(far::far(incoming, far))];
        Ok(Tunnel { socket, peers_file, lib, peers, local_ip, routes, conns, tasks, stats, budget })
    }

    /// The running job's roster changed (`--fault-tolerance node`: a node joined in a lost
    /// node's slot or a new one): its address is routed and its streams served from now on,
    /// and the ranks' preload library finds it in the peers file.
    pub fn set_roster(&mut self, roster: &meshd_proto::rendezvous::Roster, me: NodeId) {
        let others = || roster.members.iter().filter(|m| m.id != me);
        let routes = Routes {
            to: others().map(|m| (m.addr.ip().to_canonical(), m.addr)).collect(),
            members: others().map(|m| (m.id, m.addr.ip().to_canonical())).collect(),
        };
        let peers = peer_list(routes.to.keys());
        *self.routes.write().unwrap_or_else(|p| p.into_inner()) = routes;
        if peers != self.peers {
            if let Err(e) = write_peers_file(&self.peers_file, &peers) {
                warn!(
                    "tunnel: cannot write {}: {e}; the ranks' connections to nodes that joined since they started \
                     will not go through the tunnel",
                    self.peers_file.display()
                );
            }
            debug!("tunnel: peers now {peers}");
            self.peers = peers;
        }
    }

    /// Ends, as failures (the ranks see their connections reset), the tunnelled connections
    /// with `lost`, and with `abort`'s peers except those whose listening end is one of its
    /// `keep` endpoints (the quorum's managers and stores). Returns how many.
    pub fn cut(&self, lost: IpAddr, abort: Option<&meshd_proto::node::AbortGroup>) -> usize {
        let lost = lost.to_canonical();
        let peers: Vec<IpAddr> =
            abort.map(|a| a.peers.iter().map(|p| p.to_canonical()).collect()).unwrap_or_default();
        let keep: Vec<SocketAddr> =
            abort.map(|a| a.keep.iter().copied().map(canonical).collect()).unwrap_or_default();
        self.conns.cut(|peer, listener| peer == lost || (peers.contains(&peer) && !keep.contains(&listener)))
    }

    /// This node's roster address (the far end's only destination).
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// Tunnelled connections this node can hold (both ends together).
    pub fn capacity(&self) -> usize {
        self.budget.capacity()
    }

    /// The ranks' environment: `LD_PRELOAD` (the library first, then `user_preload`),
    /// `MESHD_TUNNEL`, `MESHD_TUNNEL_PEERS`, `MESHD_TUNNEL_PEERS_FILE`.
    pub fn env(&self, user_preload: Option<&str>) -> Vec<(String, String)> {
        vec![
            self.lib.env(user_preload),
            ("MESHD_TUNNEL".into(), self.socket.display().to_string()),
            ("MESHD_TUNNEL_PEERS".into(), self.peers.clone()),
            ("MESHD_TUNNEL_PEERS_FILE".into(), self.peers_file.display().to_string()),
        ]
    }

    /// The preload library the ranks load.
    pub fn preload(&self) -> &Preload {
        &self.lib
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<TunnelStats> {
        &self.stats
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.peers_file);
    }
}

/// `ips`, sorted, comma-separated (`MESHD_TUNNEL_PEERS` and the peers file).
fn peer_list<'a>(ips: impl Iterator<Item = &'a IpAddr>) -> String {
    let mut v: Vec<IpAddr> = ips.copied().collect();
    v.sort();
    v.iter().map(|ip| ip.to_string()).collect::<Vec<_>>().join(",")
}

/// Writes the peers file whole (a temporary file renamed over it, owner-only): a rank that
/// reads it at the same moment sees the old list or the new one.
fn write_peers_file(path: &Path, peers: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
    f.write_all(peers.as_bytes())?;
    drop(f);
    std::fs::rename(&tmp, path)
}

/// The preload library (`libmeshd_preload.so`) as the ranks load it; dropping it removes
/// the copy meshd wrote. The tunnel's ranks load it, and so do the ranks of
/// `--fault-tolerance node` (for `gethostname`, crates/meshd-preload's `host`).
#[derive(Debug)]
pub struct Preload {
    path: PathBuf,
    wrote: bool,
}

impl Preload {
    /// Where the ranks load the library from: `given` when set, else the embedded bytes
    /// written to `dir` (owner-only), else (when `dir` is on a noexec mount, where the
    /// dynamic loader cannot map it) `libmeshd_preload.so` next to the meshd executable.
    pub fn write(dir: &Path, given: Option<&Path>) -> std::io::Result<Preload> {
        if let Some(p) = given {
            return Ok(Preload { path: p.to_path_buf(), wrote: false });
        }
        if noexec(dir) {
            if let Some(beside) = std::env::current_exe()
                .ok()
                .map(|e| e.with_file_name("libmeshd_preload.so"))
                .filter(|p| p.exists())
            {
                return Ok(Preload { path: beside, wrote: false });
            }
            warn!(
                "{} is on a noexec mount: the ranks cannot load meshd's preload library from there; set \
                 MESHD_PRELOAD_LIB, or XDG_RUNTIME_DIR to a directory that allows it",
                dir.display()
            );
        }
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let lib = dir.join("libmeshd_preload.so");
        let _ = std::fs::remove_file(&lib);
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o500).open(&lib)?;
        f.write_all(PRELOAD)?;
        Ok(Preload { path: lib, wrote: true })
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `LD_PRELOAD` for the ranks: the library first, then `user_preload`.
    pub fn env(&self, user_preload: Option<&str>) -> (String, String) {
        let lib = self.path.display().to_string();
        let preload = match user_preload.filter(|p| !p.trim().is_empty()) {
            Some(u) => format!("{lib}:{u}"),
            None => lib,
        };
        ("LD_PRELOAD".into(), preload)
    }
}

impl Drop for Preload {
    fn drop(&mut self) {
        if self.wrote {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn noexec(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: statvfs writes into a zeroed struct of the right type; `c` is NUL-terminated.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        libc::statvfs(c.as_ptr(), &mut s) == 0 && s.f_flag & libc::ST_NOEXEC != 0
    }
}

/// The near end: ranks' requests on the tunnel socket.
struct Near {
    cfg: Arc<TunnelConfig>,
    routes: LiveRoutes,
    conns: Arc<Conns>,
    /// The data plane, when tunnelled bytes may use it.
    plane: Option<crate::transport::plane::Plane>,
    transport: Transport,
    stats: Arc<TunnelStats>,
    budget: Arc<Budget>,
    /// Connections this node's ranks hold to each other node.
    per_peer: std::sync::Mutex<HashMap<SocketAddr, Arc<Semaphore>>>,
}

impl Near {
    /// Accepts ranks' connections until the round's tunnel is dropped; every connection's
    /// task is in `tasks`, so they all end with it. An accept error (EMFILE: the process is
    /// out of open files) is waited out, never the end of the loop.
    async fn serve(self, listener: UnixListener) {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        let near = Arc::new(self);
        let mut tasks = tokio::task::JoinSet::new();
        let mut errors = crate::files::AcceptErrors::new("the tunnel's socket");
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            };
            let s = match accepted {
                Ok((s, _)) => {
                    errors.ok();
                    s
                }
                Err(e) => {
                    tokio::time::sleep(errors.failed(&e)).await;
                    continue;
                }
            };
            // The directory is owner-only already; the kernel's word on the peer as well.
            if s.peer_cred().map(|c| c.uid()).ok() != Some(me) {
                continue;
            }
            let near = near.clone();
            tasks.spawn(async move { near.one(s).await });
        }
    }

    fn peer_slots(&self, node: SocketAddr) -> Arc<Semaphore> {
        let mut m = self.per_peer.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(node).or_insert_with(|| Arc::new(Semaphore::new(self.cfg.per_peer))).clone()
    }

    async fn one(&self, mut s: UnixStream) {
        let stats = &*self.stats;
        let mut request = [0u8; TUNNEL_REQUEST_LEN];
        if !matches!(tokio::time::timeout(REQUEST_TIMEOUT, s.read_exact(&mut request)).await, Ok(Ok(_))) {
            return;
        }
        let padded = request[..2] == wire::MAGIC && request[2] == wire::VERSION_PADDED;
        if padded {
            request[2] = wire::VERSION;
        }
        let fail = |status: u8, why: String| {
            stats.failed.fetch_add(1, Ordering::Relaxed);
            debug!("tunnel: {why}");
            status
        };
        let Some(dest) = decode_request(&request) else {
            let _ = s.write_all(&[fail(wire::status::FAILED, "malformed request from a rank".into())]).await;
            return;
        };
        let route = read_routes(&self.routes).to.get(&dest.ip().to_canonical()).copied();
        let Some(node) = route else {
            let _ = s
                .write_all(&[fail(wire::status::UNREACHABLE, format!("{dest} is not another roster node"))])
                .await;
            return;
        };
        let Ok(peer_permit) = self.peer_slots(node).try_acquire_owned() else {
            let why =
                format!("{dest}: this node's ranks hold {} tunnelled connections to it", self.cfg.per_peer);
            let _ = s.write_all(&[fail(wire::status::REFUSED, why)]).await;
            return;
        };
        let Some(file_permit) = self.budget.try_take() else {
            let why = format!(
                "{dest}: this node holds {} tunnelled connections, all its open files allow (ulimit -n)",
                self.budget.capacity()
            );
            crate::files::warn_once_out_of_files(&why);
            let _ = s.write_all(&[fail(wire::status::REFUSED, why)]).await;
            return;
        };
        // This end's plane stream is registered before it is offered: nothing the far end
        // sends on the plane can come before it.
        let mine = plane_stream::Mine::register(self.plane.as_ref(), node);
        let opened = async {
            let (mut send, mut recv) =
                self.transport.open_tunnel(node, &request).await.map_err(|e| e.to_string())?;
            send.write_all(&plane_stream::offer(mine.as_ref()).encode()).await.map_err(|e| e.to_string())?;
            let mut st = [0u8; 1];
            recv.read_exact(&mut st).await.map_err(|e| e.to_string())?;
            let mut theirs = [0u8; plane_stream::OFFER_LEN];
            if st[0] == wire::status::OK {
                recv.read_exact(&mut theirs).await.map_err(|e| e.to_string())?;
            }
            Ok::<_, String>((send, recv, st[0], plane_stream::Offer::decode(&theirs)))
        };
        let (send, recv, theirs) = match tokio::time::timeout(STATUS_TIMEOUT, opened).await {
            Ok(Ok((send, recv, wire::status::OK, theirs))) => (send, recv, theirs),
            Ok(Ok((_, _, st, _))) => {
                let _ = s.write_all(&[fail(st, format!("{dest}: the far end answered status {st}"))]).await;
                return;
            }
            Ok(Err(e)) => {
                let _ = s.write_all(&[fail(wire::status::UNREACHABLE, format!("{dest}: {e}"))]).await;
                return;
            }
            Err(_) => {
                let _ =
                    s.write_all(&[fail(wire::status::TIMED_OUT, format!("{dest}: no answer in time"))]).await;
                return;
            }
        };
        if s.write_all(&[wire::status::OK]).await.is_err() {
            return; // the rank gave up (its deadline): dropping the streams resets them
        }
        // The status first, then the padding: when the rank's socket polls writable, its
        // status byte is there to read.
        let mut pad = [0u8; wire::PAD];
        if padded && !matches!(tokio::time::timeout(REQUEST_TIMEOUT, s.read_exact(&mut pad)).await, Ok(Ok(_)))
        {
            return;
        }
        stats.opened.fetch_add(1, Ordering::Relaxed);
        set_sndbuf(&s, UNIX_SNDBUF);
        let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
        let (r, w) = s.into_split();
        let (registered, cut) = self.conns.register(node.ip(), dest);
        // A failure closes the socket at once, without the half-close a dropped write half
        // would send first: the rank then sees its peer gone (the preload library's reset,
        // see its doc), not an end of file.
        let ends = Ends { closed: Some(fd), cut };
        let way = mine.map(|m| m.with(theirs));
        pipe(r, w, (send, recv), way, stats, ends, tokio::net::unix::OwnedWriteHalf::forget).await;
        drop((registered, peer_permit, file_permit));
    }
}

/// How often a near end whose rank stopped sending checks whether the rank closed its
/// socket entirely.
const HANGUP_CHECK: Duration = Duration::from_millis(500);

/// Whether the peer of the Unix socket `fd` closed it entirely (POLLHUP: both directions
/// shut; a half-close shows only POLLRDHUP).
fn hung_up(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
    // SAFETY: poll on one valid pollfd with a zero timeout.
    unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLHUP != 0 }
}

/// Sets `SO_SNDBUF` (best effort: the kernel caps it at `net.core.wmem_max`).
fn set_sndbuf(s: &impl std::os::fd::AsRawFd, bytes: libc::c_int) {
    // SAFETY: setsockopt on a socket we hold, with a valid int and its size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// SO_LINGER 0: closing `tcp` sends RST instead of FIN (tokio deprecates `set_linger`
/// because a positive linger blocks on drop; 0 never does).
fn reset_on_close(tcp: &TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt on a socket we hold, with a valid linger struct and its size.
    unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// Copies both ways between a local stream and a QUIC stream pair until both directions
/// ended. End of file becomes a half-close on the other side; a failure on either side
/// resets the other (`abort` takes the local write half; the read half, dropped last,
/// closes the socket). Each direction starts with its mode byte: its bytes follow on the
/// QUIC stream, or travel on the data plane (`way`, [`plane_stream`]) where the sender
/// chose that.
///
/// `closed`, at the near end, is the rank's socket: once the rank stopped sending, it is
/// checked every [`HANGUP_CHECK`] for a full close (`close()`, not `shutdown(SHUT_WR)`):
/// then nothing more can reach the rank, so the stream's receive side is stopped (the far
/// application's next write is reset, as TCP answers data for a closed socket) and the
/// connection's files are freed, instead of being held until the far application closes.
///
/// `ends.cut` fires when meshd ends the connection ([`Tunnel::cut`]): a failure, as above.
async fn pipe<R, W>(
    mut r: R,
    mut w: W,
    quic: (quinn::SendStream, quinn::RecvStream),
    way: Option<(plane_stream::Way, crate::transport::plane::streams::Inbox)>,
    stats: &TunnelStats,
    ends: Ends,
    abort: impl FnOnce(W),
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Ends { closed, mut cut } = ends;
    let (mut send, mut recv) = quic;
    stats.active.fetch_add(1, Ordering::Relaxed);
    let (way, inbox) = way.unzip();
    let (mut credits, mut data) = inbox.map(|i| (i.credit, i.data)).unzip();
    let failed = {
        let up = async {
            if let (Some(way), Some(credits)) =
                (way.as_ref().filter(|w| w.sends_on_plane()), credits.as_mut())
            {
                send.write_all(&[plane_stream::MODE_PLANE]).await.map_err(|_| ())?;
                return plane_stream::up(&mut r, &mut send, way, credits, stats).await;
            }
            send.write_all(&[plane_stream::MODE_STREAM]).await.map_err(|_| ())?;
            // Each read fills the rest of the block and is lent to quinn as it is (no copy
            // into its send buffer); a new block only when little room is left.
            let mut buf = BytesMut::with_capacity(BLOCK);
            loop {
                if buf.capacity() - buf.len() < MIN_READ {
                    buf = BytesMut::with_capacity(BLOCK);
                }
                match r.read_buf(&mut buf).await {
                    Ok(0) => return send.finish().map_err(|_| ()),
                    Ok(n) => {
                        stats.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
                        send.write_chunk(buf.split().freeze()).await.map_err(|_| ())?;
                    }
                    Err(_) => return Err(()),
                }
            }
        };
        let down = async {
            let mut mode = [0u8; 1];
            recv.read_exact(&mut mode).await.map_err(|_| ())?;
            match (mode[0], way.as_ref(), data.as_mut()) {
                (plane_stream::MODE_STREAM, _, _) => {}
                (plane_stream::MODE_PLANE, Some(way), Some(data)) => {
                    return plane_stream::down(&mut w, &mut recv, way, data, stats).await;
                }
                _ => return Err(()),
            }
            // quinn's received chunks (about one packet each) go to the socket as they are,
            // as many as are ready with one writev: no copy, and no write per packet.
            let mut chunks = vec![Bytes::new(); MAX_CHUNKS];
            loop {
                match recv.read_chunks(&mut chunks).await {
                    Ok(Some(k)) => {
                        let n: usize = chunks[..k].iter().map(Bytes::len).sum();
                        stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                        write_all_chunks(&mut w, &mut chunks[..k]).await.map_err(|_| ())?;
                    }
                    Ok(None) => return w.shutdown().await.map_err(|_| ()),
                    Err(_) => return Err(()),
                }
            }
        };
        tokio::pin!(up, down);
        let (mut up_done, mut down_done, mut uncut) = (false, false, false);
        let mut hangup = tokio::time::interval(HANGUP_CHECK);
        loop {
            tokio::select! {
                c = &mut cut, if !uncut => {
                    if c.is_ok() { break true; }
                    uncut = true; // the registry is gone: nobody can cut any more
                }
                res = &mut up, if !up_done => {
                    if res.is_err() { break true; }
                    up_done = true;
                }
                res = &mut down, if !down_done => {
                    if res.is_err() { break true; }
                    down_done = true;
                }
                _ = hangup.tick(), if up_done && closed.is_some() => {
                    if closed.is_some_and(hung_up) {
                        break true;
                    }
                }
            }
            if up_done && down_done {
                break false;
            }
        }
    };
    if failed {
        let _ = send.reset(RESET.into());
        let _ = recv.stop(RESET.into());
        abort(w);
    }
    stats.active.fetch_sub(1, Ordering::Relaxed);
    drop(r);
}

/// What every round's tunnel on a node shares: the transport, the far end's queue of peers'
/// tunnel streams (taken from the transport once), the counters.
#[derive(Debug)]
pub struct Host {
    transport: Transport,
    incoming: Option<Incoming>,
    stats: Arc<TunnelStats>,
}

impl Host {
    /// Takes `transport`'s tunnel streams.
    pub fn new(transport: &Transport) -> Host {
        Host { transport: transport.clone(), incoming: incoming(transport), stats: Arc::default() }
    }

    /// Starts the tunnel of one round of `roster` on node `node_rank`, next to the local
    /// service's socket `service_socket` (in the job's owner-only directory); peers' ranks
    /// may reach meshd's own listeners `own_ports` too. Says why when it cannot (the ranks
    /// then run without it, and their connections to other nodes fail). `preload_lib`: the
    /// library the user gave ([`TunnelConfig::preload_lib`]).
    pub fn start_round(
        &self,
        roster: &meshd_proto::rendezvous::Roster,
        node_rank: usize,
        own_ports: &[u16],
        service_socket: Option<&Path>,
        preload_lib: Option<&Path>,
    ) -> Option<Tunnel> {
        start_for_round(roster, node_rank, own_ports, service_socket, preload_lib, self)
    }
}

fn start_for_round(
    roster: &meshd_proto::rendezvous::Roster,
    node_rank: usize,
    own_ports: &[u16],
    service_socket: Option<&Path>,
    preload_lib: Option<&Path>,
    host: &Host,
) -> Option<Tunnel> {
    let (transport, stats) = (&host.transport, &host.stats);
    let me = roster.members.get(node_rank)?;
    let (Some(dir), Some(incoming)) = (service_socket.and_then(Path::parent), host.incoming.as_ref()) else {
        warn!("tunnel mode, but no local service directory: the ranks' connections to other nodes will fail");
        return None;
    };
    let cfg = TunnelConfig {
        dir: dir.to_path_buf(),
        routes: roster
            .members
            .iter()
            .filter(|m| m.id != me.id)
            .map(|m| (m.addr.ip().to_canonical(), m.addr))
            .collect(),
        members: roster
            .members
            .iter()
            .filter(|m| m.id != me.id)
            .map(|m| (m.id, m.addr.ip().to_canonical()))
            .collect(),
        local_ip: me.addr.ip().to_canonical(),
        preload_lib: preload_lib.map(Path::to_path_buf),
        plane: true,
        job_root: std::process::id() as i32,
        job_root_itself: false,
        own_ports: own_ports.to_vec(),
        per_peer: far::MAX_PER_PEER,
        files: None,
    };
    match Tunnel::start(cfg, transport.clone(), incoming.clone(), stats.clone()) {
        Ok(t) => {
            let counters = stats.clone();
            transport.set_tunnel_stats(Some(Arc::new(move || counters.reply())));
            info!(
                "tunnel: the ranks' TCP connections to {} go through meshd (LD_PRELOAD {}); peers reach only \
                 ports this job's ranks listen on here; up to {} tunnelled connections (open files); \
                 the tunnelled fds behave as TCP sockets except to epoll registrations made before \
                 connect, io_uring, raw syscalls, sendfile/splice and SO_PEERCRED (docs/PROTOCOL.md, \
                 \"What cannot be made invisible\")",
                t.peers,
                t.lib.path().display(),
                t.capacity()
            );
            Some(t)
        }
        Err(e) => {
            warn!(
                "cannot start the tunnel in {}: {e}; the ranks' connections to other nodes will fail",
                dir.display()
            );
            None
        }
    }
}

/// Logs the counters once a round ends, with the CPU meshd and its finished ranks used so
/// far (what a tunnelled byte costs: compare runs by CPU per MiB, not only by time).
pub fn report(stats: &TunnelStats) {
    let cpu = |who: i32| {
        // SAFETY: getrusage fills the struct it is given; both `who`s are valid.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::getrusage(who, &mut u) } != 0 {
            return 0.0;
        }
        let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
        t(u.ru_utime) + t(u.ru_stime)
    };
    info!(
        "tunnel: {}; CPU so far: meshd {:.2} s, finished ranks {:.2} s",
        stats.line(),
        cpu(libc::RUSAGE_SELF),
        cpu(libc::RUSAGE_CHILDREN)
    );
}

#[cfg(test)]
mod tests;
