//! The transport: one quinn endpoint per node on ONE UDP port, for everything.
//!
//! Connections are keyed by the peer's socket address. Each starts with an authentication
//! exchange on its first bidirectional stream ([`auth`]); until it succeeds not a single
//! frame from the peer is accepted. Frames then travel as QUIC datagrams (may be lost:
//! gossip probes) or one per unidirectional stream, length-prefixed (reliable).
//!
//! Control and bulk data never share a connection: a peer's main connection carries only
//! control frames (and probes' queries), while ring data streams and tunnelled TCP streams
//! travel on its *data connections* (lanes `1..`[`MAX_LANES`]). QUIC gives each connection
//! its own stream limits and flow-control windows, so data streams parked unread (an
//! operation this node has not started yet) can hold neither the stream slots nor the
//! window bytes that Abort, Done, store and gossip frames need (docs/PROTOCOL.md, "Control
//! and data").
//!
//! Sending never blocks the caller: each peer has an [`outbox`] drained by its own task,
//! which connects on demand, so a dead peer's connect timeout delays nobody else. Reliable
//! frames wait there, in order, through failed connects and sends (retried with backoff)
//! up to [`TransportConfig::reliable_horizon`]; one given up on is counted
//! ([`Transport::undelivered`]) and logged with the peer's name.

pub mod auth;
pub mod guard;
pub mod outbox;
pub mod plane;
pub mod socket;
mod tls;

use auth::{Refusal, Role, Token};
use bytes::Bytes;
use meshd_proto::NodeId;
use meshd_proto::wire::{
    self, AuthHello, Frame, MAX_LANES, PROTOCOL_VERSION, Query, StatusReply, TunnelReply,
};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc};
use tracing::{debug, warn};

/// Close codes carried in QUIC CONNECTION_CLOSE.
mod code {
    pub const BYE: u32 = 0;
    pub const AUTH: u32 = 1;
    pub const OTHER_RUN: u32 = 2;
    pub const VERSION: u32 = 3;
    pub const PROTOCOL: u32 = 4;
}

/// Transport settings.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// The one UDP port.
    pub port: u16,
    /// Address to bind (unspecified = all interfaces of that family).
    pub bind: IpAddr,
    /// Cluster secret; `None` = unauthenticated (still encrypted).
    pub token: Option<Token>,
    /// Hash of the run id; peers of another run are refused.
    pub run_hash: u64,
    /// This node.
    pub node: NodeId,
    /// UDP generic segmentation offload (some kernels mangle it; the CLI's `MESHD_GSO=0`).
    pub gso: bool,
    /// Congestion controller of every connection (the CLI's `MESHD_CC`).
    pub cc: CongestionControl,
    /// QUIC keep-alive.
    pub keep_alive: Duration,
    /// A silent connection is dropped after this.
    pub idle_timeout: Duration,
    /// Time allowed for connect + authentication.
    pub connect_timeout: Duration,
    /// MTU of the interface the cluster uses. Above 1500 (jumbo frames), QUIC's path MTU
    /// discovery may grow packets up to it: fewer, larger packets cost far less CPU per
    /// byte. Peers each advertise their own limit, so a mixed cluster stays safe.
    pub mtu: Option<u32>,
    /// How long a reliable frame is kept and retried while its peer cannot be reached or
    /// does not take it; then it is given up on, counted and logged. Longer than the
    /// membership's verdict on a silent peer, so that a frame is given up on only for a
    /// peer the protocols above already know is gone.
    pub reliable_horizon: Duration,
    /// Time allowed to open a stream and write one reliable frame on an established
    /// connection; past it the attempt is reset and retried.
    pub send_timeout: Duration,
    /// Run the data plane (AEAD datagrams on the same port for the ring's bulk data;
    /// `MESHD_PLANE=0` turns it off, and peers then use QUIC streams with this node).
    pub plane: bool,
    /// Lanes of the data plane, each its own driver task with its own keys (the CLI's
    /// `MESHD_LANES`; default [`plane::default_lanes`], at most
    /// [`plane::MAX_PLANE_LANES`]). A sender uses the lanes both ends run.
    pub plane_lanes: usize,
}

impl TransportConfig {
    /// Defaults for `node` on `port`.
    pub fn new(node: NodeId, port: u16) -> Self {
        TransportConfig {
            port,
            bind: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            token: None,
            run_hash: 0,
            node,
            gso: true,
            cc: CongestionControl::default(),
            keep_alive: Duration::from_millis(500),
            idle_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            mtu: None,
            plane: true,
            plane_lanes: plane::default_lanes(),
            reliable_horizon: Duration::from_secs(30),
            send_timeout: Duration::from_secs(10),
        }
    }
}

/// The congestion controller QUIC runs on every connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CongestionControl {
    /// CUBIC (quinn's default).
    #[default]
    Cubic,
    /// BBR (v1, as quinn implements it).
    Bbr,
    /// NewReno.
    NewReno,
}

impl CongestionControl {
    /// The name `MESHD_CC` takes: `cubic`, `bbr`, `newreno`.
    pub fn name(self) -> &'static str {
        match self {
            CongestionControl::Cubic => "cubic",
            CongestionControl::Bbr => "bbr",
            CongestionControl::NewReno => "newreno",
        }
    }
}

impl std::fmt::Display for CongestionControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CongestionControl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cubic" => Ok(CongestionControl::Cubic),
            "bbr" => Ok(CongestionControl::Bbr),
            "newreno" => Ok(CongestionControl::NewReno),
            other => Err(format!("unknown congestion control {other:?} (cubic, bbr or newreno)")),
        }
    }
}

/// QUIC's view of the path to one peer ([`Transport::path_stats`]).
#[derive(Clone, Copy, Debug)]
pub struct PathStats {
    /// The UDP payload size MTU discovery has reached.
    pub mtu: u16,
    /// Smoothed round-trip time.
    pub rtt: Duration,
    /// Packets sent on the path.
    pub sent_packets: u64,
    /// Packets declared lost.
    pub lost_packets: u64,
    /// Times the congestion window was cut.
    pub congestion_events: u64,
    /// UDP datagrams sent on the link (all its connections).
    pub tx_datagrams: u64,
    /// Send system calls they took (fewer per datagram = fuller GSO batches).
    pub tx_calls: u64,
    /// UDP datagrams received on the link.
    pub rx_datagrams: u64,
    /// ACK frames sent to the peer.
    pub acks_sent: u64,
    /// Open connections to the peer: the main one and its lanes (either end's).
    pub connections: usize,
}

/// Transport failures.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The UDP port could not be bound. The io error is part of the message, not a source
    /// (so an error chain prints it once).
    #[error("{}", bind_failure_text(*.addr, .error, .holder.as_deref()))]
    Bind {
        /// What we tried.
        addr: SocketAddr,
        /// Why it failed.
        error: std::io::Error,
        /// What holds the port, when it is in use and that could be found ("pid 12 (meshd)").
        holder: Option<String>,
    },
    /// TLS setup failed.
    #[error("TLS setup: {0}")]
    Tls(String),
    /// Could not reach or talk to the peer.
    #[error("peer {addr}: {reason}")]
    Peer {
        /// The peer.
        addr: SocketAddr,
        /// Why, in words.
        reason: String,
    },
    /// The peer refused us (`reason` starts with [`REFUSED_US`]) or we refused it.
    #[error("{}", auth_failure_text(*.addr, .reason))]
    Auth {
        /// The peer.
        addr: SocketAddr,
        /// Why, in words.
        reason: String,
    },
}

/// What the transport reports to its owner.
#[derive(Debug)]
pub enum TransportEvent {
    /// An authenticated peer sent a frame.
    Frame {
        /// Peer address (connection remote address).
        from: SocketAddr,
        /// Peer node id (authenticated).
        node: NodeId,
        /// The frame.
        frame: Frame,
    },
    /// A connection passed authentication.
    PeerUp {
        /// Peer address.
        addr: SocketAddr,
        /// Its node id.
        node: NodeId,
        /// The address the peer saw us come from (when we connected).
        observed: Option<SocketAddr>,
    },
    /// Authentication failed (either end refused).
    AuthFailed {
        /// Peer address.
        addr: SocketAddr,
        /// Why, in words.
        reason: String,
    },
}

/// What a probe learned.
#[derive(Clone, Debug)]
pub struct ProbeInfo {
    /// The peer's node id.
    pub node: NodeId,
    /// The address the peer saw us come from.
    pub observed: Option<SocketAddr>,
    /// Connect + authentication round trip.
    pub rtt: Duration,
}

/// One peer's outgoing frames and the wake-up of the task that sends them.
#[derive(Debug, Default)]
struct PeerQueue {
    outbox: Mutex<outbox::Outbox>,
    wake: Notify,
    /// Set when the peer is forgotten or the transport stops: the task ends.
    gone: AtomicBool,
    /// When a full queue was last logged (at most once a second per peer).
    full_logged: Mutex<Option<Instant>>,
}

/// The data connection (lane) that ring lane `lane` travels on: lanes are numbered from 1,
/// lane 0 being the peer's main connection, which carries control frames only.
fn data_connection(lane: usize) -> u8 {
    1 + (lane % (MAX_LANES - 1)) as u8
}

/// First byte of a unidirectional stream that carries bulk collective data rather than
/// control frames. Control streams start with a big-endian length below 4 MiB, so their
/// first byte is always 0x00.
pub const DATA_TAG: u8 = 0xD0;

/// First byte of a bidirectional stream that carries one tunnelled TCP connection (tunnel
/// mode, docs/PROTOCOL.md "The TCP tunnel"); the request follows, then the stream's bytes.
pub const TUNNEL_TAG: u8 = 0xD1;
/// Length of a tunnel request after the tag (the same request a rank sends meshd on its
/// tunnel socket: magic, version, family, port, address).
pub const TUNNEL_REQUEST_LEN: usize = 22;

/// A tunnelled TCP connection a peer asked for: connect to the destination, answer one
/// status byte on `send`, then copy both ways.
#[derive(Debug)]
pub struct TunnelStream {
    /// Peer address (connection remote address).
    pub from: SocketAddr,
    /// Peer node id.
    pub node: NodeId,
    /// The request (destination), undecoded.
    pub request: [u8; TUNNEL_REQUEST_LEN],
    /// The stream towards the peer.
    pub send: quinn::SendStream,
    /// The stream from the peer, positioned after the request.
    pub recv: quinn::RecvStream,
}

/// A bulk data stream opened by a peer for collective operation `op`.
#[derive(Debug)]
pub struct DataStream {
    /// Peer address (connection remote address).
    pub from: SocketAddr,
    /// Peer node id.
    pub node: NodeId,
    /// The operation it belongs to.
    pub op: u64,
    /// The stream, positioned after its header.
    pub recv: quinn::RecvStream,
}

/// Held while one task does something that others must not do at the same time.
type OneAtATime = Arc<tokio::sync::Mutex<()>>;

struct Inner {
    endpoint: quinn::Endpoint,
    cfg: TransportConfig,
    conns: Mutex<HashMap<SocketAddr, (quinn::Connection, NodeId)>>,
    queues: Mutex<HashMap<SocketAddr, Arc<PeerQueue>>>,
    /// Reliable frames given up on (queue full, peer unreachable past the horizon).
    undelivered: AtomicU64,
    /// Set by [`Transport::shutdown`]: senders stop retrying.
    closing: AtomicBool,
    events: mpsc::Sender<TransportEvent>,
    /// Refusals already logged (once per peer IP and reason, bounded).
    logged: guard::LogOnce,
    /// Handshakes in progress (bounded per source IP and in total).
    gate: Arc<guard::Gate>,
    /// The latest encoded [`StatusReply`], served to `meshd status` probes.
    status: Mutex<Bytes>,
    data_tx: mpsc::Sender<DataStream>,
    data_rx: Mutex<Option<mpsc::Receiver<DataStream>>>,
    tunnel_tx: mpsc::Sender<TunnelStream>,
    tunnel_rx: Mutex<Option<mpsc::Receiver<TunnelStream>>>,
    /// The running tunnel's counters, answered to `meshd status` ([`Query::Tunnel`]).
    tunnel_stats: Mutex<Option<Arc<crate::tunnel::TunnelStats>>>,
    /// Lane connections, opened by either end: (peer, lane 1..) -> connection.
    lanes: Mutex<HashMap<(SocketAddr, u8), (quinn::Connection, NodeId)>>,
    /// Every data connection while it is open, whichever end opened it: when both ends
    /// open a lane at once, `lanes` keeps one of the two, but the peer's data may come on
    /// the other, and its traffic is proof of life ([`Transport::rx_datagrams`]).
    data_links: Mutex<Vec<(SocketAddr, NodeId, quinn::Connection)>>,
    /// Held while a lane is being connected, so that two operations do not open it twice
    /// (one lock per peer and lane: a dead peer's connect timeout delays no other peer).
    lane_connect: Mutex<HashMap<(SocketAddr, u8), OneAtATime>>,
    /// The data plane, unless turned off.
    plane: Option<plane::Plane>,
    /// Every authenticated connection, to bound how many one peer holds.
    authenticated: guard::Conns,
}

/// A node's QUIC endpoint. Cheap to clone.
#[derive(Clone)]
pub struct Transport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport").field("local", &self.local_addr()).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these short locks cannot leave the maps inconsistent
    // (single insert/remove), so recover from poisoning.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The UDP socket with GSO batches capped at what one IP datagram can carry (64 KiB).
///
/// quinn batches up to 10 packets per `sendmsg`; with jumbo packets (8972 bytes) that is
/// 90 KB, the kernel answers EMSGSIZE, and quinn-udp silently drops the whole batch (it
/// expects EMSGSIZE only from MTU probes). The losses then look like an MTU black hole and
/// the path falls back to 1200-byte packets. Capping the segment count avoids both.
#[derive(Debug)]
struct GsoCapped {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    max_segments: usize,
}

impl GsoCapped {
    fn new(inner: Arc<dyn quinn::AsyncUdpSocket>, max_payload: u16, ipv6: bool) -> Self {
        // IPv4: 65535 minus IP and UDP headers; IPv6's payload length excludes its header.
        let limit = if ipv6 { 65_535 - 8 } else { 65_535 - 28 };
        let max_segments = (limit / max_payload.max(1) as usize).max(1);
        GsoCapped { inner, max_segments }
    }
}

impl quinn::AsyncUdpSocket for GsoCapped {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// The largest UDP payload an interface of MTU `mtu` carries, when it is above quinn's
/// default (1472 for IPv4); `None` for standard or smaller MTUs.
fn max_udp_payload(mtu: u32, ipv6: bool) -> Option<u16> {
    let headers = if ipv6 { 48 } else { 28 };
    let payload = mtu.saturating_sub(headers).min(u16::MAX as u32 - 8) as u16;
    (payload > 1472).then_some(payload)
}

/// Large UDP socket buffers: bursts of a ring allreduce otherwise overflow the default
/// ~200 KiB and turn into loss. `SO_*BUFFORCE` (root) lifts the sysctl cap; without the
/// privilege the plain options still raise the buffers up to it.
fn set_socket_buffers(socket: &std::net::UdpSocket, bytes: i32) {
    use std::os::fd::AsRawFd;
    let fd = socket.as_raw_fd();
    for (force, plain) in [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)] {
        for opt in [force, plain] {
            // SAFETY: setsockopt on a socket we own, with a valid pointer to an i32 and its size.
            let rc = unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&bytes as *const i32).cast(),
                    std::mem::size_of::<i32>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                break;
            }
        }
    }
}

/// IPv4-mapped IPv6 addresses compare as IPv4.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

impl Transport {
    /// Binds the endpoint and starts accepting. Must run inside a tokio runtime.
    pub fn bind(cfg: TransportConfig) -> Result<(Transport, mpsc::Receiver<TransportEvent>), TransportError> {
        let mut tc = quinn::TransportConfig::default();
        tc.keep_alive_interval(Some(cfg.keep_alive))
            .max_idle_timeout(quinn::IdleTimeout::try_from(cfg.idle_timeout).ok())
            .enable_segmentation_offload(cfg.gso)
            // Nodes start at about the same time, so the first Initial to a peer that is
            // not listening yet is lost; with quinn's default 333 ms initial RTT the
            // retransmit (and so the whole rendezvous) waits about a second. Cluster links
            // are sub-millisecond: start the estimate at 30 ms.
            .initial_rtt(Duration::from_millis(10))
            .send_window(64 << 20);
        // Every connection starts with tiny windows and stream limits (what authentication
        // needs) and gets the bulk-data ones only once the peer's MAC verified
        // (`guard::open_up`), on both ends.
        guard::pre_auth_limits(&mut tc);
        match cfg.cc {
            // quinn's default.
            CongestionControl::Cubic => {}
            CongestionControl::Bbr => {
                tc.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
            }
            CongestionControl::NewReno => {
                tc.congestion_controller_factory(Arc::new(quinn::congestion::NewRenoConfig::default()));
            }
        }
        // Jumbo frames: let MTU discovery probe up to the interface's MTU (it starts at
        // 1200 and backs off on loss, so a path that cannot carry them costs nothing).
        // quinn's black-hole detector takes any three bursts of lost full-size packets for an
        // MTU black hole and then drops to 1200-byte packets for a minute; in a bulk transfer
        // every congestion loss looks like that. Probe again after a second instead: the
        // search takes a few round trips, and 20% more packets per byte cost more.
        let mut ec = quinn::EndpointConfig::default();
        let mut md = quinn::MtuDiscoveryConfig::default();
        md.black_hole_cooldown(Duration::from_secs(1));
        let max_payload = cfg.mtu.and_then(|m| max_udp_payload(m, cfg.bind.is_ipv6()));
        if let Some(payload) = max_payload {
            md.upper_bound(payload);
            ec.max_udp_payload_size(payload).map_err(|e| TransportError::Tls(e.to_string()))?;
        }
        tc.mtu_discovery_config(Some(md));
        let (server, client) = tls::configs(Arc::new(tc))?;
        let addr = SocketAddr::new(cfg.bind, cfg.port);
        let socket = std::net::UdpSocket::bind(addr).map_err(|e| bind_error(addr, e))?;
        set_socket_buffers(&socket, 16 << 20);
        let runtime =
            quinn::default_runtime().ok_or_else(|| TransportError::Tls("no async runtime".into()))?;
        // One socket for QUIC and the data plane, told apart by the QUIC fixed bit, which
        // meshd's endpoints therefore never grease (docs/PROTOCOL.md, "The data plane").
        ec.grease_quic_bit(false);
        let lanes = if cfg.plane { cfg.plane_lanes.clamp(1, plane::MAX_PLANE_LANES) } else { 0 };
        let (plane_tx, plane_rx): (Vec<_>, Vec<_>) =
            (0..lanes).map(|_| tokio::sync::mpsc::channel(socket::PLANE_QUEUE)).unzip();
        let demux = Arc::new(socket::DemuxSocket::new(socket, plane_tx).map_err(|e| bind_error(addr, e))?);
        let plane_datagram = max_payload.map_or(if cfg.bind.is_ipv6() { 1452 } else { 1472 }, usize::from);
        let plane = cfg.plane.then(|| plane::Plane::start(demux.clone(), plane_rx, plane_datagram));
        let socket: Arc<dyn quinn::AsyncUdpSocket> = match max_payload {
            Some(payload) => Arc::new(GsoCapped::new(demux, payload, cfg.bind.is_ipv6())),
            None => demux,
        };
        let mut endpoint = quinn::Endpoint::new_with_abstract_socket(ec, Some(server), socket, runtime)
            .map_err(|e| bind_error(addr, e))?;
        endpoint.set_default_client_config(client);
        let (tx, rx) = mpsc::channel(4096);
        let (data_tx, data_rx) = mpsc::channel(256);
        let (tunnel_tx, tunnel_rx) = mpsc::channel(256);
        let inner = Arc::new(Inner {
            endpoint,
            cfg,
            conns: Mutex::new(HashMap::new()),
            queues: Mutex::new(HashMap::new()),
            undelivered: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            events: tx,
            logged: guard::LogOnce::default(),
            gate: Arc::new(guard::Gate::default()),
            status: Mutex::new(Bytes::from(wire::encode(&StatusReply::default()))),
            data_tx,
            data_rx: Mutex::new(Some(data_rx)),
            tunnel_tx,
            tunnel_rx: Mutex::new(Some(tunnel_rx)),
            tunnel_stats: Mutex::new(None),
            lanes: Mutex::new(HashMap::new()),
            data_links: Mutex::new(Vec::new()),
            lane_connect: Mutex::new(HashMap::new()),
            plane,
            authenticated: guard::Conns::default(),
        });
        tokio::spawn(accept_loop(inner.clone()));
        Ok((Transport { inner }, rx))
    }

    /// The data plane, unless this node turned it off ([`TransportConfig::plane`]).
    pub fn plane(&self) -> Option<&plane::Plane> {
        self.inner.plane.as_ref()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner
            .endpoint
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::new(self.inner.cfg.bind, self.inner.cfg.port))
    }

    /// Queues a frame for `to`; `reliable` uses a stream, else a datagram (falls back to a
    /// stream when too large). Never blocks. A reliable frame is kept and retried, in
    /// order, until a stream carried it or [`TransportConfig::reliable_horizon`] passed;
    /// one that cannot be kept (the peer's queue is full: [`outbox::MAX_QUEUED_FRAMES`],
    /// [`outbox::MAX_QUEUED_BYTES`]) or is given up on is counted in
    /// [`Transport::undelivered`] and logged, naming the peer. A datagram may be lost.
    pub fn send(&self, to: SocketAddr, frame: &Frame, reliable: bool) {
        let to = canonical(to);
        let bytes = Bytes::from(wire::encode(frame));
        let q = {
            let mut queues = lock(&self.inner.queues);
            queues
                .entry(to)
                .or_insert_with(|| {
                    let q = Arc::new(PeerQueue::default());
                    tokio::spawn(peer_sender(self.inner.clone(), to, q.clone()));
                    q
                })
                .clone()
        };
        let refused = {
            let mut o = lock(&q.outbox);
            if reliable {
                o.push_reliable(bytes, Instant::now()).err()
            } else {
                o.push_datagram(bytes);
                None
            }
        };
        match refused {
            None => q.wake.notify_one(),
            Some(full) => {
                self.inner.undelivered.fetch_add(1, Ordering::Relaxed);
                let mut logged = lock(&q.full_logged);
                if logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    *logged = Some(Instant::now());
                    warn!(
                        "peer {}: a reliable frame was not sent: {} ({} bytes) already wait for it \
                         (undelivered so far: {})",
                        peer_name(&self.inner, to),
                        crate::plural(full.frames as u64, "frame"),
                        full.bytes,
                        self.inner.undelivered.load(Ordering::Relaxed)
                    );
                }
            }
        }
    }

    /// Drops what waits to be sent to `to` (the peer left or was declared dead: its frames
    /// can no longer arrive) and stops its sender; a later [`Transport::send`] starts
    /// afresh. The reliable frames dropped count as undelivered (logged at debug level:
    /// the caller knows why).
    pub fn forget(&self, to: SocketAddr) {
        let to = canonical(to);
        let Some(q) = lock(&self.inner.queues).remove(&to) else { return };
        q.gone.store(true, Ordering::Relaxed);
        let n = lock(&q.outbox).clear();
        if n > 0 {
            self.inner.undelivered.fetch_add(n as u64, Ordering::Relaxed);
            debug!(peer = %to, "peer forgotten with {} unsent", crate::plural(n as u64, "reliable frame"));
        }
        q.wake.notify_one();
    }

    /// Reliable frames given up on since the transport started: refused by a full queue,
    /// not delivered within the horizon, or dropped by [`Transport::forget`].
    pub fn undelivered(&self) -> u64 {
        self.inner.undelivered.load(Ordering::Relaxed)
    }

    /// Reliable frames waiting to be sent to `to`.
    pub fn queued(&self, to: SocketAddr) -> usize {
        lock(&self.inner.queues).get(&canonical(to)).map_or(0, |q| lock(&q.outbox).reliable_len())
    }

    /// Connects to `to`, authenticates, and reports what the peer saw. The connection is
    /// kept for later sends.
    pub async fn probe(&self, to: SocketAddr) -> Result<ProbeInfo, TransportError> {
        let start = Instant::now();
        let (_, node, observed) = connect(&self.inner, canonical(to), 0).await?;
        Ok(ProbeInfo { node, observed, rtt: start.elapsed() })
    }

    /// Whether connections are authenticated by a token (the tunnel needs one).
    pub fn has_token(&self) -> bool {
        self.inner.cfg.token.is_some()
    }

    /// The receiver of incoming bulk data streams (once; later calls get `None`).
    pub fn take_data_streams(&self) -> Option<mpsc::Receiver<DataStream>> {
        lock(&self.inner.data_rx).take()
    }

    /// The receiver of tunnel streams peers open (once; later calls get `None`). Until it is
    /// taken, or while its queue is full, a peer's tunnel stream is reset.
    pub fn take_tunnel_streams(&self) -> Option<mpsc::Receiver<TunnelStream>> {
        lock(&self.inner.tunnel_rx).take()
    }

    /// Opens a tunnel stream to the meshd at `to` (on its first data connection: tunnelled
    /// bytes are bulk data) and sends `request`; the peer answers one status byte on the
    /// returned receive stream.
    pub async fn open_tunnel(
        &self,
        to: SocketAddr,
        request: &[u8; TUNNEL_REQUEST_LEN],
    ) -> Result<(quinn::SendStream, quinn::RecvStream), TransportError> {
        let to = canonical(to);
        let conn = self.data_conn(to, data_connection(0)).await?;
        let err = |reason: String| TransportError::Peer { addr: to, reason };
        let (mut send, recv) = conn.open_bi().await.map_err(|e| err(e.to_string()))?;
        let mut head = [0u8; 1 + TUNNEL_REQUEST_LEN];
        head[0] = TUNNEL_TAG;
        head[1..].copy_from_slice(request);
        send.write_all(&head).await.map_err(|e| err(e.to_string()))?;
        Ok((send, recv))
    }

    /// Opens a bulk data stream to `to` for collective operation `op` (ring lane 0).
    pub async fn open_data(&self, to: SocketAddr, op: u64) -> Result<quinn::SendStream, TransportError> {
        self.open_data_lane(to, op, 0).await
    }

    /// Opens a bulk data stream to `to` for operation `op` on ring lane `lane` (`0..`
    /// [`MAX_LANES`]). Data never travels on the peer's main connection, which is kept for
    /// control frames: ring lane `l` uses data connection `1 + l % (MAX_LANES - 1)`, an
    /// extra connection to the same peer (through the same UDP port), opened and
    /// authenticated on first use and kept. Each connection's packets are built, encrypted
    /// and decrypted by its own task, so several lanes spread one link's work over several
    /// cores.
    ///
    /// Opening waits for the peer to grant a stream (it may hold its limit of unread
    /// streams); that wait ends after [`TransportConfig::send_timeout`] with an error.
    pub async fn open_data_lane(
        &self,
        to: SocketAddr,
        op: u64,
        lane: usize,
    ) -> Result<quinn::SendStream, TransportError> {
        let to = canonical(to);
        if lane >= MAX_LANES {
            return Err(TransportError::Peer {
                addr: to,
                reason: format!("lane {lane} is over the {MAX_LANES}-lane limit"),
            });
        }
        let conn = self.data_conn(to, data_connection(lane)).await?;
        let timeout = self.inner.cfg.send_timeout;
        tokio::time::timeout(timeout, open_data_on(&conn, to, op)).await.map_err(|_| TransportError::Peer {
            addr: to,
            reason: format!(
                "it granted no data stream for operation {op} within {timeout:?} (it holds its limit of unread streams)"
            ),
        })?
    }

    /// The data connection `lane` (1..) to `to`, connected on first use.
    async fn data_conn(&self, to: SocketAddr, lane: u8) -> Result<quinn::Connection, TransportError> {
        if let Some(c) = existing_lane(&self.inner, to, lane) {
            return Ok(c);
        }
        let one = lock(&self.inner.lane_connect).entry((to, lane)).or_default().clone();
        let _one = one.lock().await;
        if let Some(c) = existing_lane(&self.inner, to, lane) {
            return Ok(c);
        }
        // The peer takes a data connection only beside a live main connection of this node.
        if existing(&self.inner, to).is_none() {
            connect(&self.inner, to, 0).await?;
        }
        Ok(connect(&self.inner, to, lane).await?.0)
    }

    /// Sets the tunnel counters `meshd status` probes are told.
    pub fn set_tunnel_stats(&self, stats: Option<Arc<crate::tunnel::TunnelStats>>) {
        *lock(&self.inner.tunnel_stats) = stats;
    }

    /// Asks the meshd at `to` for its tunnel counters (`None`: not in tunnel mode).
    pub async fn query_tunnel(&self, to: SocketAddr) -> Result<Option<TunnelReply>, TransportError> {
        let to = canonical(to);
        let conn = match existing(&self.inner, to) {
            Some(c) => c,
            None => connect(&self.inner, to, 0).await?.0,
        };
        let err = |reason: String| TransportError::Peer { addr: to, reason };
        let fut = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| err(e.to_string()))?;
            send.write_all(&wire::encode(&Query::Tunnel)).await.map_err(|e| err(e.to_string()))?;
            let _ = send.finish();
            let body = recv.read_to_end(1024).await.map_err(|e| err(e.to_string()))?;
            wire::decode::<Option<TunnelReply>>(&body).map_err(|e| err(format!("bad tunnel reply: {e}")))
        };
        tokio::time::timeout(self.inner.cfg.connect_timeout, fut)
            .await
            .map_err(|_| err("no tunnel answer in time".into()))?
    }

    /// Sets what `meshd status` probes are told.
    pub fn set_status(&self, reply: &StatusReply) {
        *lock(&self.inner.status) = Bytes::from(wire::encode(reply));
    }

    /// Asks the meshd at `to` for its view of the mesh (this transport must be a probe:
    /// run hash 0).
    pub async fn query_status(&self, to: SocketAddr) -> Result<StatusReply, TransportError> {
        let to = canonical(to);
        let conn = match existing(&self.inner, to) {
            Some(c) => c,
            None => connect(&self.inner, to, 0).await?.0,
        };
        let err = |reason: String| TransportError::Peer { addr: to, reason };
        let fut = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| err(e.to_string()))?;
            send.write_all(&wire::encode(&Query::Status)).await.map_err(|e| err(e.to_string()))?;
            let _ = send.finish();
            let body = recv.read_to_end(wire::MAX_FRAME).await.map_err(|e| err(e.to_string()))?;
            wire::decode::<StatusReply>(&body).map_err(|e| err(format!("bad status reply: {e}")))
        };
        tokio::time::timeout(self.inner.cfg.connect_timeout, fut)
            .await
            .map_err(|_| err("no status answer in time".into()))?
    }

    /// Incoming handshakes (QUIC + authentication) in progress now.
    pub fn pending_handshakes(&self) -> usize {
        self.inner.gate.pending()
    }

    /// Node ids of the currently connected, authenticated peers, by address.
    pub fn connected(&self) -> Vec<(SocketAddr, NodeId)> {
        lock(&self.inner.conns).iter().map(|(a, (_, n))| (*a, *n)).collect()
    }

    /// The node id of the authenticated peer at `addr` (its main connection, else a data
    /// connection), if connected.
    pub fn node_at(&self, addr: SocketAddr) -> Option<NodeId> {
        let addr = canonical(addr);
        if let Some((_, n)) = lock(&self.inner.conns).get(&addr) {
            return Some(*n);
        }
        lock(&self.inner.lanes).iter().find(|((a, _), _)| *a == addr).map(|(_, (_, n))| *n)
    }

    /// Round-trip time QUIC measured to `addr`, if connected.
    pub fn rtt(&self, addr: SocketAddr) -> Option<Duration> {
        lock(&self.inner.conns).get(&canonical(addr)).map(|(c, _)| c.rtt())
    }

    /// For each connected peer, the UDP datagrams its connection has received so far:
    /// when the count moves, the peer is alive and sending, whatever else is queued.
    /// Lanes count with their peer's main connection.
    pub fn rx_datagrams(&self) -> Vec<(NodeId, u64)> {
        let conns = lock(&self.inner.conns);
        let links = lock(&self.inner.data_links);
        conns
            .iter()
            .map(|(addr, (c, n))| {
                let on_lanes: u64 = links
                    .iter()
                    .filter(|(a, ln, _)| a == addr && ln == n)
                    .map(|(_, _, l)| l.stats().udp_rx.datagrams)
                    .sum();
                (*n, c.stats().udp_rx.datagrams + on_lanes)
            })
            .collect()
    }

    /// QUIC's view of the path to `addr`, if connected: the MTU discovery reached, packets
    /// sent and lost, and congestion events.
    pub fn path_stats(&self, addr: SocketAddr) -> Option<PathStats> {
        let addr = canonical(addr);
        let main = lock(&self.inner.conns).get(&addr).map(|(c, _)| c.stats())?;
        let mut p = PathStats::from(&main);
        // Counters add up over the link's lanes; MTU and RTT are the main connection's.
        let lanes = lock(&self.inner.lanes);
        for (c, _) in
            lanes.iter().filter(|((a, _), (c, _))| *a == addr && c.close_reason().is_none()).map(|(_, c)| c)
        {
            let l = PathStats::from(&c.stats());
            p.connections += 1;
            p.sent_packets += l.sent_packets;
            p.lost_packets += l.lost_packets;
            p.congestion_events += l.congestion_events;
            p.tx_datagrams += l.tx_datagrams;
            p.tx_calls += l.tx_calls;
            p.rx_datagrams += l.rx_datagrams;
            p.acks_sent += l.acks_sent;
        }
        Some(p)
    }

    /// Closes every connection and waits briefly for the close to be sent.
    pub async fn shutdown(&self) {
        self.inner.closing.store(true, Ordering::Relaxed);
        for q in lock(&self.inner.queues).values() {
            q.wake.notify_one();
        }
        self.inner.endpoint.close(code::BYE.into(), b"node stopping");
        let _ = tokio::time::timeout(Duration::from_millis(300), self.inner.endpoint.wait_idle()).await;
    }
}

/// Opens a data stream for operation `op` on `conn` and writes its header.
async fn open_data_on(
    conn: &quinn::Connection,
    to: SocketAddr,
    op: u64,
) -> Result<quinn::SendStream, TransportError> {
    let err = |reason: String| TransportError::Peer { addr: to, reason };
    let mut s = conn.open_uni().await.map_err(|e| err(e.to_string()))?;
    let mut head = [0u8; 9];
    head[0] = DATA_TAG;
    head[1..].copy_from_slice(&op.to_be_bytes());
    s.write_all(&head).await.map_err(|e| err(e.to_string()))?;
    Ok(s)
}

impl From<&quinn::ConnectionStats> for PathStats {
    fn from(s: &quinn::ConnectionStats) -> Self {
        PathStats {
            mtu: s.path.current_mtu,
            rtt: s.path.rtt,
            sent_packets: s.path.sent_packets,
            lost_packets: s.path.lost_packets,
            congestion_events: s.path.congestion_events,
            tx_datagrams: s.udp_tx.datagrams,
            tx_calls: s.udp_tx.ios,
            rx_datagrams: s.udp_rx.datagrams,
            acks_sent: s.frame_tx.acks,
            connections: 1,
        }
    }
}

/// "198.19.0.7:29400 (node 0a1b2c3d4e5f)", or the address alone when not connected.
fn peer_name(inner: &Inner, to: SocketAddr) -> String {
    match lock(&inner.conns).get(&to) {
        Some((_, node)) => format!("{to} (node {node})"),
        None => to.to_string(),
    }
}

/// Sends what `q` holds for `to`: datagrams first (they never wait), then reliable frames
/// in order, each on its own stream. A failed connect or send keeps the frame and tries
/// again after a backoff; frames older than the horizon are given up on and reported.
async fn peer_sender(inner: Arc<Inner>, to: SocketAddr, q: Arc<PeerQueue>) {
    let horizon = inner.cfg.reliable_horizon;
    let mut backoff = outbox::Backoff::default();
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut last_error = String::from("not tried yet");
    // Frames given up on but not logged yet, and when that was last logged.
    let mut unreported = 0u64;
    let mut reported: Option<Instant> = None;
    loop {
        if inner.closing.load(Ordering::Relaxed) || q.gone.load(Ordering::Relaxed) {
            let n = lock(&q.outbox).clear();
            if n > 0 {
                inner.undelivered.fetch_add(n as u64, Ordering::Relaxed);
                debug!(peer = %to, "transport stopping with {} unsent", crate::plural(n as u64, "reliable frame"));
            }
            return;
        }
        // Wait for something to send, or for the end of a backoff or the next expiry,
        // whichever is first (a wake-up meanwhile may be a stop: it is looked at above).
        let (empty, expiry) = {
            let o = lock(&q.outbox);
            (o.is_empty(), o.next_expiry(horizon))
        };
        match retry_at.filter(|r| *r > tokio::time::Instant::now()) {
            Some(r) => {
                let until = expiry.map_or(r, |e| r.min(e.into()));
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => {}
                    _ = q.wake.notified() => {}
                }
            }
            None if empty => q.wake.notified().await,
            None => {}
        }
        let expired = lock(&q.outbox).expire(Instant::now(), horizon);
        if expired > 0 {
            inner.undelivered.fetch_add(expired as u64, Ordering::Relaxed);
            unreported += expired as u64;
        }
        if unreported > 0 && reported.is_none_or(|t| t.elapsed() >= horizon) {
            warn!(
                "peer {}: gave up on {} after {horizon:?} ({last_error}); undelivered so far: {}",
                peer_name(&inner, to),
                crate::plural(unreported, "reliable frame"),
                inner.undelivered.load(Ordering::Relaxed)
            );
            unreported = 0;
            reported = Some(Instant::now());
        }
        if retry_at.is_some_and(|r| r > tokio::time::Instant::now())
            || lock(&q.outbox).is_empty()
            || inner.closing.load(Ordering::Relaxed)
            || q.gone.load(Ordering::Relaxed)
        {
            continue;
        }
        retry_at = None;
        // A peer that just started may have connected to us while our own attempt to reach
        // it was failing: its connection carries the frames.
        let conn = match existing(&inner, to) {
            Some(c) => c,
            None => match connect(&inner, to, 0).await {
                Ok((c, _, _)) => c,
                Err(e) => match existing(&inner, to) {
                    Some(c) => c,
                    None => {
                        last_error = e.to_string();
                        let mut o = lock(&q.outbox);
                        // Datagrams would be stale by the next attempt.
                        o.drop_datagrams();
                        if matches!(e, TransportError::Auth { .. }) {
                            // A refusal is final (another token, run or version) and was
                            // logged once already: frames for it can never be delivered.
                            let n = o.clear();
                            inner.undelivered.fetch_add(n as u64, Ordering::Relaxed);
                            debug!(peer = %to, error = %e, "refused: {} dropped", crate::plural(n as u64, "reliable frame"));
                        } else {
                            debug!(peer = %to, error = %e, "connect failed; frames kept");
                        }
                        drop(o);
                        retry_at = Some(tokio::time::Instant::now() + backoff.failed());
                        continue;
                    }
                },
            },
        };
        // Datagrams first, and again after every reliable frame: a probe must not wait
        // behind a burst of reliable frames.
        let mut failed = None;
        loop {
            let datagrams = lock(&q.outbox).take_datagrams();
            for d in datagrams {
                let res = if d.len() <= conn.max_datagram_size().unwrap_or(0) {
                    conn.send_datagram(d).map_err(|e| e.to_string())
                } else {
                    send_stream(&conn, &d, inner.cfg.send_timeout).await
                };
                if let Err(e) = res {
                    debug!(peer = %to, error = %e, "datagram not sent");
                }
            }
            let Some(frame) = lock(&q.outbox).front() else { break };
            match send_stream(&conn, &frame, inner.cfg.send_timeout).await {
                Ok(()) => {
                    lock(&q.outbox).sent();
                    backoff.reset();
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            if inner.closing.load(Ordering::Relaxed) || q.gone.load(Ordering::Relaxed) {
                break;
            }
        }
        if let Some(e) = failed {
            debug!(peer = %to, error = %e, "send failed; frame kept");
            last_error = e;
            retry_at = Some(tokio::time::Instant::now() + backoff.failed());
        }
    }
}

/// Sends one length-prefixed frame on a stream of its own, within `timeout` (opening the
/// stream waits while the peer holds its limit of unread streams; writing, while its window
/// is full). A stream not written whole is reset, so the peer never reads half a frame.
async fn send_stream(conn: &quinn::Connection, body: &[u8], timeout: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut s = tokio::time::timeout_at(deadline, conn.open_uni())
        .await
        .map_err(|_| format!("no stream granted within {timeout:?}"))?
        .map_err(|e| e.to_string())?;
    match tokio::time::timeout_at(deadline, s.write_all(&wire::frame_with_len(body))).await {
        Ok(Ok(())) => s.finish().map_err(|e| e.to_string()),
        Ok(Err(e)) => {
            let _ = s.reset(code::PROTOCOL.into());
            Err(e.to_string())
        }
        Err(_) => {
            let _ = s.reset(code::PROTOCOL.into());
            Err(format!("frame of {} bytes not taken within {timeout:?}", body.len()))
        }
    }
}

fn existing(inner: &Inner, to: SocketAddr) -> Option<quinn::Connection> {
    let conns = lock(&inner.conns);
    conns.get(&to).filter(|(c, _)| c.close_reason().is_none()).map(|(c, _)| c.clone())
}

fn existing_lane(inner: &Inner, to: SocketAddr, lane: u8) -> Option<quinn::Connection> {
    let lanes = lock(&inner.lanes);
    lanes.get(&(to, lane)).filter(|(c, _)| c.close_reason().is_none()).map(|(c, _)| c.clone())
}

fn my_hello(inner: &Inner, observed: Option<SocketAddr>, lane: u8, pake: &[u8], mac: [u8; 32]) -> AuthHello {
    let pake = wire::PakeMessage::from_bytes(pake);
    let cfg = &inner.cfg;
    AuthHello {
        version: PROTOCOL_VERSION,
        node: cfg.node,
        run_hash: cfg.run_hash,
        mac,
        has_token: cfg.token.is_some(),
        observed,
        lane,
        pake,
    }
}

fn exporter(conn: &quinn::Connection) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    conn.export_keying_material(&mut out, auth::EXPORTER_LABEL, b"").ok()?;
    Some(out)
}

/// Checks the peer's hello before the key confirmation; `Err((code, refusal))` says why it
/// is refused.
fn check_hello(inner: &Inner, h: &AuthHello) -> Result<(), (u32, Refusal)> {
    let cfg = &inner.cfg;
    if h.version != PROTOCOL_VERSION {
        return Err((code::VERSION, Refusal::Version(PROTOCOL_VERSION)));
    }
    match (&cfg.token, h.has_token) {
        (None, false) => {}
        (None, true) => return Err((code::AUTH, Refusal::UnexpectedToken)),
        (Some(_), false) => return Err((code::AUTH, Refusal::NoToken)),
        (Some(_), true) if h.pake.is_none() => {
            return Err((code::PROTOCOL, Refusal::Other("bad hello: malformed key exchange".into())));
        }
        (Some(_), true) => {}
    }
    // Run hash 0 is a probe (`meshd ifaces --peers`): it proves the token, joins no run.
    if h.run_hash != cfg.run_hash && h.run_hash != 0 && cfg.run_hash != 0 {
        return Err((code::OTHER_RUN, Refusal::OtherRun));
    }
    if h.node == cfg.node {
        return Err((code::PROTOCOL, Refusal::Itself));
    }
    if h.lane as usize >= MAX_LANES || (h.lane > 0 && h.run_hash == 0) {
        return Err((
            code::PROTOCOL,
            Refusal::Other(format!("lane {} is not allowed (a probe has none; at most {MAX_LANES})", h.lane)),
        ));
    }
    Ok(())
}

/// Closes `conn` with `why`'s close reason and reports it in this node's words; `peer_version`
/// is the version the peer announced (when it sent a hello).
fn refuse(
    inner: &Inner,
    conn: &quinn::Connection,
    code: u32,
    why: &Refusal,
    peer_version: u16,
) -> TransportError {
    let addr = canonical(conn.remote_address());
    conn.close(code.into(), why.wire().as_bytes());
    let reason = why.here(peer_version);
    report_auth_failure(inner, addr, &reason);
    TransportError::Auth { addr, reason }
}

/// The one message of a failed bind.
fn bind_failure_text(addr: SocketAddr, error: &std::io::Error, holder: Option<&str>) -> String {
    let port = addr.port();
    match (error.kind(), holder) {
        (std::io::ErrorKind::AddrInUse, Some(h)) => format!(
            "cannot bind UDP {addr}: {error}: UDP port {port} is held by {h} (another meshd? stop it, or \
             choose another port with --port)"
        ),
        (std::io::ErrorKind::AddrInUse, None) => format!(
            "cannot bind UDP {addr}: {error} (another meshd? stop it, or choose another port with --port)"
        ),
        _ => format!("cannot bind UDP {addr}: {error}"),
    }
}

fn bind_error(addr: SocketAddr, error: std::io::Error) -> TransportError {
    let holder =
        if error.kind() == std::io::ErrorKind::AddrInUse { udp_port_holder(addr.port()) } else { None };
    TransportError::Bind { addr, error, holder }
}

/// Who holds UDP `port`, best effort: the socket's inode from /proc/net/udp{,6}, then the
/// process with that socket among /proc/*/fd ("pid 1234 (python3)"). `None` when it cannot
/// be seen (another user's process, another network namespace).
pub fn udp_port_holder(port: u16) -> Option<String> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/udp", "/proc/net/udp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let Some(local) = f.get(1) else { continue };
            let p = local.rsplit_once(':').and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if p == Some(port) {
                if let Some(inode) = f.get(9).filter(|i| **i != "0") {
                    inodes.push(format!("socket:[{inode}]"));
                }
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    for proc in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = proc.file_name();
        let Some(pid) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else { continue };
        let Ok(fds) = std::fs::read_dir(proc.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else { continue };
            if inodes.iter().any(|i| target.as_os_str() == i.as_str()) {
                let comm = std::fs::read_to_string(proc.path().join("comm")).unwrap_or_default();
                return Some(format!("pid {pid} ({})", comm.trim()));
            }
        }
    }
    None
}

/// Words a refusal read from the peer (`it refused us: WIRE`) from this node's side.
fn reword_refusal(addr: SocketAddr, reason: &str) -> String {
    match reason.strip_prefix(REFUSED_US) {
        Some(w) => format!("{REFUSED_US}{}", Refusal::parse(w).there(addr.ip(), PROTOCOL_VERSION)),
        None => reason.to_string(),
    }
}

/// How a refusal by the peer starts, in [`TransportEvent::AuthFailed`] and
/// [`TransportError::Auth`] (what follows is written from this node's side).
pub const REFUSED_US: &str = "it refused us: ";

fn report_auth_failure(inner: &Inner, addr: SocketAddr, reason: &str) {
    // Once per peer IP and reason: a client that retries from new ports logs no more.
    if inner.logged.first(addr, reason) {
        warn!("{}", auth_failure_text(addr, reason));
    }
    let _ = inner.events.try_send(TransportEvent::AuthFailed { addr, reason: reason.to_string() });
}

/// "peer X refused this node: failed authentication: ..." or "peer X failed
/// authentication: ...", from a reason as carried in [`TransportError::Auth`].
pub fn auth_failure_text(addr: SocketAddr, reason: &str) -> String {
    match reason.strip_prefix(REFUSED_US) {
        Some(r) => format!("peer {addr} refused this node: failed authentication: {r}"),
        None => format!("peer {addr} failed authentication: {reason}"),
    }
}

/// Reads the peer's close reason, when the peer refused us.
fn refusal(e: &quinn::ConnectionError) -> Option<String> {
    match e {
        quinn::ConnectionError::ApplicationClosed(c) if c.error_code != code::BYE.into() => {
            Some(format!("{REFUSED_US}{}", String::from_utf8_lossy(&c.reason)))
        }
        _ => None,
    }
}

/// Largest message of the authentication exchange.
const MAX_HELLO: usize = 1024;

/// Reads one length-prefixed message (u16, big-endian) of the authentication exchange.
async fn read_auth_message(recv: &mut quinn::RecvStream) -> Result<Vec<u8>, String> {
    let lost = |e: quinn::ReadExactError| match e {
        quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(c)) => {
            refusal(&c).unwrap_or(c.to_string())
        }
        quinn::ReadExactError::FinishedEarly(_) => "bad hello: the stream ended early".to_string(),
        other => other.to_string(),
    };
    let mut len = [0u8; 2];
    recv.read_exact(&mut len).await.map_err(lost)?;
    let len = u16::from_be_bytes(len) as usize;
    if len > MAX_HELLO {
        return Err(format!("hello larger than {MAX_HELLO} bytes"));
    }
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await.map_err(lost)?;
    Ok(body)
}

async fn read_hello(recv: &mut quinn::RecvStream) -> Result<AuthHello, String> {
    let body = read_auth_message(recv).await?;
    wire::decode(&body).map_err(|e| format!("bad hello: {e}"))
}

/// Writes one length-prefixed message of the authentication exchange.
async fn write_auth_message(send: &mut quinn::SendStream, body: &[u8]) -> Result<(), String> {
    let mut m = Vec::with_capacity(2 + body.len());
    m.extend_from_slice(&(body.len().min(u16::MAX as usize) as u16).to_be_bytes());
    m.extend_from_slice(body);
    send.write_all(&m).await.map_err(|e| e.to_string())
}

/// A hello's SPAKE2 message as SPAKE2 reads it (zeros when it has none: only used with one).
fn pake_bytes(h: &AuthHello) -> [u8; 33] {
    h.pake.map(|p| p.to_bytes()).unwrap_or([0; 33])
}

/// The transcript both ends' confirmations cover (see [`auth`]); `msgs` are the client's
/// and the server's SPAKE2 messages ([`pake_bytes`]).
fn transcript<'a>(
    exporter: &'a [u8; 32],
    client: &'a AuthHello,
    server: &'a AuthHello,
    msgs: &'a ([u8; 33], [u8; 33]),
) -> auth::Transcript<'a> {
    auth::Transcript {
        exporter,
        client: &client.node.0,
        server: &server.node.0,
        client_run: client.run_hash,
        server_run: server.run_hash,
        client_msg: &msgs.0,
        server_msg: &msgs.1,
    }
}

/// Connects and authenticates; lane 0 registers the connection as the peer's, a lane above
/// 0 keeps it for bulk data only.
async fn connect(
    inner: &Arc<Inner>,
    to: SocketAddr,
    lane: u8,
) -> Result<(quinn::Connection, NodeId, Option<SocketAddr>), TransportError> {
    let peer_err = |reason: String| TransportError::Peer { addr: to, reason };
    let fut = async {
        let conn = inner
            .endpoint
            .connect(to, "meshd")
            .map_err(|e| peer_err(e.to_string()))?
            .await
            .map_err(|e| peer_err(handshake_failure(&e)))?;
        let _drain = guard::drain_datagrams(&conn);
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| peer_err(e.to_string()))?;
        let pake = inner.cfg.token.as_ref().map(|t| t.start());
        let mine = my_hello(inner, None, lane, pake.as_ref().map_or(&[][..], |p| p.message()), [0; 32]);
        write_auth_message(&mut send, &wire::encode(&mine)).await.map_err(peer_err)?;
        let refused = |reason: String| {
            if reason.starts_with(REFUSED_US) {
                let reason = reword_refusal(to, &reason);
                report_auth_failure(inner, to, &reason);
                TransportError::Auth { addr: to, reason }
            } else {
                peer_err(reason)
            }
        };
        let theirs = read_hello(&mut recv).await.map_err(refused)?;
        if let Err((code, why)) = check_hello(inner, &theirs) {
            return Err(refuse(inner, &conn, code, &why, theirs.version));
        }
        if theirs.lane != lane {
            let why = Refusal::Other(format!("it answered lane {} for lane {lane}", theirs.lane));
            return Err(refuse(inner, &conn, code::PROTOCOL, &why, theirs.version));
        }
        // The server proves it holds the token first; only then does this node confirm.
        let confirm = match (pake, exporter(&conn)) {
            (Some(p), Some(ex)) => {
                let msgs = (pake_bytes(&mine), pake_bytes(&theirs));
                let t = transcript(&ex, &mine, &theirs, &msgs);
                let key = p.finish(&msgs.1);
                match key.filter(|k| k.verify(Role::Server, &t, &theirs.mac)) {
                    Some(k) => k.confirm(Role::Client, &t),
                    None => {
                        return Err(refuse(
                            inner,
                            &conn,
                            code::AUTH,
                            &Refusal::DifferentToken,
                            theirs.version,
                        ));
                    }
                }
            }
            (Some(_), None) => return Err(peer_err("no TLS keying material".into())),
            (None, _) => [0; 32],
        };
        write_auth_message(&mut send, &confirm).await.map_err(peer_err)?;
        let _ = send.finish();
        // Accepted when the server ends its stream; a refusal closes the connection.
        match recv.read_to_end(0).await {
            Ok(_) => {}
            Err(quinn::ReadToEndError::Read(quinn::ReadError::ConnectionLost(c))) => {
                return Err(refused(refusal(&c).unwrap_or(c.to_string())));
            }
            Err(e) => return Err(peer_err(format!("bad end of the authentication: {e}"))),
        }
        Ok((conn, theirs.node, theirs.observed))
    };
    let (conn, node, observed) =
        tokio::time::timeout(inner.cfg.connect_timeout, fut).await.map_err(|_| {
            peer_err(format!(
                "no answer within {:?} (is meshd running there, and UDP {} open?)",
                inner.cfg.connect_timeout,
                to.port()
            ))
        })??;
    // The server proved the token: its streams and data may come now.
    guard::open_up(&conn, lane);
    let _ = inner.authenticated.admit(to, &conn);
    if lane == 0 {
        register(inner, conn.clone(), node, observed);
    } else {
        add_lane(inner, to, lane, &conn, node);
        tokio::spawn(read_bidi_streams(inner.clone(), conn.clone(), node));
        tokio::spawn(read_streams(inner.clone(), conn.clone(), node));
    }
    Ok((conn, node, observed))
}

/// What an authenticated incoming connection is.
enum Accepted {
    /// A node's connection to this one.
    Peer,
    /// A probe (`meshd ifaces`, `meshd status`).
    Probe,
    /// An extra connection for bulk data: its lane number.
    Lane(u8),
}

/// Words a failed QUIC handshake. TLS alert 120 (no_application_protocol) means the peer
/// does not speak this ALPN: another meshd protocol version.
fn handshake_failure(e: &quinn::ConnectionError) -> String {
    let alpn = |code: quinn::TransportErrorCode| code == quinn::TransportErrorCode::crypto(120);
    match e {
        quinn::ConnectionError::ConnectionClosed(c) if alpn(c.error_code) => format!(
            "QUIC handshake failed: it does not speak {} (another meshd version? run the same meshd on every node)",
            String::from_utf8_lossy(wire::ALPN)
        ),
        _ => format!("QUIC handshake failed: {e}"),
    }
}

async fn accept_loop(inner: Arc<Inner>) {
    while let Some(incoming) = inner.endpoint.accept().await {
        let from = canonical(incoming.remote_address());
        // Handshakes pile up (a flood, perhaps from spoofed addresses): a source must
        // first prove it receives our packets (stateless Retry) before it gets a slot.
        if !incoming.remote_address_validated() && inner.gate.should_retry(from.ip()) {
            if let Err(e) = incoming.retry() {
                e.into_incoming().refuse();
            }
            continue;
        }
        // Bounded state for handshakes that never finish: a few per source IP, a cap in
        // total; past it the attempt is refused at once (QUIC CONNECTION_REFUSED).
        let permit = match inner.gate.admit(from.ip()) {
            Ok(p) => p,
            Err(full) => {
                incoming.refuse();
                let why = match full {
                    guard::Full::Ip => {
                        format!("more than {} handshakes in progress from it", guard::MAX_PENDING_PER_IP)
                    }
                    guard::Full::Total => format!("more than {} handshakes in progress", guard::MAX_PENDING),
                };
                if inner.logged.first(from, &why) {
                    warn!("refusing connections from {}: {why}", from.ip());
                }
                continue;
            }
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            let fut = async {
                let conn = incoming.await.ok()?;
                let _drain = guard::drain_datagrams(&conn);
                let (mut send, mut recv) = conn.accept_bi().await.ok()?;
                // Oversized or malformed: say so; a lost connection: nothing to say.
                let malformed = |conn: &quinn::Connection, reason: String| {
                    if reason.starts_with("bad hello") || reason.starts_with("hello larger") {
                        refuse(&inner, conn, code::PROTOCOL, &Refusal::Other(reason), PROTOCOL_VERSION);
                    }
                };
                let theirs = match read_hello(&mut recv).await {
                    Ok(h) => h,
                    Err(reason) => {
                        malformed(&conn, reason);
                        return None;
                    }
                };
                if let Err((code, why)) = check_hello(&inner, &theirs) {
                    refuse(&inner, &conn, code, &why, theirs.version);
                    return None;
                }
                let observed = Some(canonical(conn.remote_address()));
                let pake = inner.cfg.token.as_ref().map(|t| t.start());
                let mut mine = my_hello(
                    &inner,
                    observed,
                    theirs.lane,
                    pake.as_ref().map_or(&[][..], |p| p.message()),
                    [0; 32],
                );
                let ex = exporter(&conn)?;
                let key = match pake {
                    Some(p) => match p.finish(&pake_bytes(&theirs)) {
                        Some(k) => Some(k),
                        None => {
                            malformed(&conn, "bad hello: malformed key exchange".into());
                            return None;
                        }
                    },
                    None => None,
                };
                if let Some(k) = &key {
                    let msgs = (pake_bytes(&theirs), pake_bytes(&mine));
                    mine.mac = k.confirm(Role::Server, &transcript(&ex, &theirs, &mine, &msgs));
                }
                write_auth_message(&mut send, &wire::encode(&mine)).await.ok()?;
                let confirm = match read_auth_message(&mut recv).await {
                    Ok(c) => c,
                    Err(reason) => {
                        // The client found this node's confirmation wrong and closed: it says
                        // why in its close reason.
                        if let Some(r) = reason.strip_prefix(REFUSED_US) {
                            let from = canonical(conn.remote_address());
                            let reason = reword_refusal(from, &format!("{REFUSED_US}{r}"));
                            report_auth_failure(&inner, from, &reason);
                        } else {
                            malformed(&conn, reason);
                        }
                        return None;
                    }
                };
                if let Some(k) = &key {
                    let msgs = (pake_bytes(&theirs), pake_bytes(&mine));
                    if !k.verify(Role::Client, &transcript(&ex, &theirs, &mine, &msgs), &confirm) {
                        refuse(&inner, &conn, code::AUTH, &Refusal::DifferentToken, theirs.version);
                        return None;
                    }
                }
                // Accepted: the end of this stream says so.
                send.finish().ok()?;
                let kind = if theirs.lane > 0 {
                    Accepted::Lane(theirs.lane)
                } else if theirs.run_hash == 0 && inner.cfg.run_hash != 0 {
                    Accepted::Probe
                } else {
                    Accepted::Peer
                };
                Some((conn, theirs.node, kind))
            };
            // Half-open or silent handshakes are dropped after the connect timeout.
            let done = tokio::time::timeout(inner.cfg.connect_timeout, fut).await;
            drop(permit);
            let done = match done {
                Ok(Some((conn, node, kind))) => admit(&inner, conn, node, kind),
                _ => None,
            };
            if let Some((conn, _, kind)) = &done {
                // The client proved the token: its streams and data may come now.
                guard::open_up(conn, if let Accepted::Lane(l) = kind { *l } else { 0 });
            }
            match done {
                // A probe gets its answer and nothing else: no frame of it is read.
                Some((conn, _, Accepted::Probe)) => serve_queries(&inner, conn).await,
                Some((conn, node, Accepted::Peer)) => register(&inner, conn, node, None),
                // A lane carries the peer's bulk data and tunnel streams only: it is not the
                // peer's connection for gossip and raises no PeerUp.
                // Kept so that this node may send on it too (either end may open streams).
                Some((conn, node, Accepted::Lane(lane))) => {
                    let from = canonical(conn.remote_address());
                    add_lane(&inner, from, lane, &conn, node);
                    tokio::spawn(read_bidi_streams(inner.clone(), conn.clone(), node));
                    read_streams(inner, conn, node).await
                }
                None => {}
            }
        });
    }
}

/// The bounds an authenticated incoming connection must pass before it is used: a data
/// connection only beside a live main connection of the same node from the same address
/// (a lane raises no PeerUp, so a second "node X" must not slip in through one), and no
/// more connections per peer than [`guard::MAX_CONNS_PER_ADDR`] / [`guard::MAX_CONNS_PER_IP`].
fn admit(
    inner: &Inner,
    conn: quinn::Connection,
    node: NodeId,
    kind: Accepted,
) -> Option<(quinn::Connection, NodeId, Accepted)> {
    let from = canonical(conn.remote_address());
    if let Accepted::Lane(lane) = kind {
        let main = lock(&inner.conns).get(&from).filter(|(c, _)| c.close_reason().is_none()).map(|(_, n)| *n);
        if main != Some(node) {
            let why = Refusal::Other(format!(
                "data connection {lane} without a live main connection of the same node from {from}"
            ));
            refuse(inner, &conn, code::PROTOCOL, &why, PROTOCOL_VERSION);
            return None;
        }
    }
    if let Err(e) = inner.authenticated.admit(from, &conn) {
        let why = match e {
            guard::TooMany::Addr => {
                format!("more than {} connections from {from}", guard::MAX_CONNS_PER_ADDR)
            }
            guard::TooMany::Ip => {
                format!("more than {} connections from {}", guard::MAX_CONNS_PER_IP, from.ip())
            }
        };
        refuse(inner, &conn, code::PROTOCOL, &Refusal::Other(why), PROTOCOL_VERSION);
        return None;
    }
    Some((conn, node, kind))
}

/// Answers a probe connection's queries (a few at most) until it closes or idles.
async fn serve_queries(inner: &Inner, conn: quinn::Connection) {
    for _ in 0..16 {
        let Ok(Ok((mut send, mut recv))) =
            tokio::time::timeout(inner.cfg.connect_timeout, conn.accept_bi()).await
        else {
            return;
        };
        let Ok(Ok(body)) = tokio::time::timeout(inner.cfg.connect_timeout, recv.read_to_end(64)).await else {
            return;
        };
        match wire::decode::<Query>(&body) {
            Ok(Query::Status) => {
                let reply = lock(&inner.status).clone();
                let _ = send.write_all(&reply).await;
                let _ = send.finish();
            }
            Ok(Query::Tunnel) => {
                let reply = lock(&inner.tunnel_stats).as_ref().map(|s| s.reply());
                let _ = send.write_all(&wire::encode(&reply)).await;
                let _ = send.finish();
            }
            Err(_) => {
                conn.close(code::PROTOCOL.into(), b"bad query");
                return;
            }
        }
    }
}

fn register(inner: &Arc<Inner>, conn: quinn::Connection, node: NodeId, observed: Option<SocketAddr>) {
    let addr = canonical(conn.remote_address());
    lock(&inner.conns).insert(addr, (conn.clone(), node));
    // Another node at the address (the peer restarted): its data connections belong to the
    // old process and lead nowhere; they are opened again when next needed. The same node
    // connecting again (both ends dialled at once, or the old connection failed) keeps
    // them: they may carry an operation or tunnelled connections now.
    lock(&inner.lanes).retain(|(a, _), (lane, n)| {
        let keep = *a != addr || *n == node;
        if !keep {
            lane.close(code::BYE.into(), b"peer restarted");
        }
        keep
    });
    // Authenticated: the plane link's keys may come from this connection now.
    if let Some(plane) = &inner.plane {
        plane.add_link(conn.clone(), conn.side().is_client());
    }
    let _ = inner.events.try_send(TransportEvent::PeerUp { addr, node, observed });
    tokio::spawn(read_datagrams(inner.clone(), conn.clone(), node));
    tokio::spawn(read_bidi_streams(inner.clone(), conn.clone(), node));
    tokio::spawn(read_streams(inner.clone(), conn, node));
}

/// Accepts the bidirectional streams an authenticated peer opens after the hello (on its
/// main connection or a data connection): tunnel streams (tag, request) go to
/// [`Transport::take_tunnel_streams`]; anything else, or a request that does not arrive
/// within the connect timeout, is reset.
async fn read_bidi_streams(inner: Arc<Inner>, conn: quinn::Connection, node: NodeId) {
    let from = canonical(conn.remote_address());
    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
        let inner = inner.clone();
        tokio::spawn(async move {
            let mut head = [0u8; 1 + TUNNEL_REQUEST_LEN];
            let read = tokio::time::timeout(inner.cfg.connect_timeout, recv.read_exact(&mut head)).await;
            if !matches!(read, Ok(Ok(()))) || head[0] != TUNNEL_TAG {
                let _ = send.reset(code::PROTOCOL.into());
                let _ = recv.stop(code::PROTOCOL.into());
                return;
            }
            let mut request = [0u8; TUNNEL_REQUEST_LEN];
            request.copy_from_slice(&head[1..]);
            if let Err(e) = inner.tunnel_tx.try_send(TunnelStream { from, node, request, send, recv }) {
                let mut t = e.into_inner();
                debug!(peer = %from, "tunnel stream refused: no tunnel service, or its queue is full");
                let _ = t.send.reset(code::PROTOCOL.into());
                let _ = t.recv.stop(code::PROTOCOL.into());
            }
        });
    }
}

async fn deliver(inner: &Inner, from: SocketAddr, node: NodeId, body: &[u8]) {
    match wire::decode::<Frame>(body) {
        Ok(frame) => {
            let _ = inner.events.send(TransportEvent::Frame { from, node, frame }).await;
        }
        Err(e) => debug!(peer = %from, error = %e, "dropping undecodable frame"),
    }
}

async fn read_datagrams(inner: Arc<Inner>, conn: quinn::Connection, node: NodeId) {
    let from = canonical(conn.remote_address());
    while let Ok(d) = conn.read_datagram().await {
        deliver(&inner, from, node, &d).await;
    }
}

async fn read_streams(inner: Arc<Inner>, conn: quinn::Connection, node: NodeId) {
    let from = canonical(conn.remote_address());
    loop {
        let mut recv = match conn.accept_uni().await {
            Ok(r) => r,
            Err(_) => break,
        };
        let inner = inner.clone();
        let conn = conn.clone();
        tokio::spawn(async move {
            let mut first = [0u8; 1];
            if recv.read_exact(&mut first).await.is_err() {
                return;
            }
            if first[0] == DATA_TAG {
                let mut op = [0u8; 8];
                if recv.read_exact(&mut op).await.is_ok() {
                    let ds = DataStream { from, node, op: u64::from_be_bytes(op), recv };
                    let _ = inner.data_tx.send(ds).await;
                }
                return;
            }
            let res = guard::read_frames(&mut recv, first[0], |body| {
                let inner = inner.clone();
                async move { deliver(&inner, from, node, &body).await }
            })
            .await;
            if let Err(guard::ReadError::Protocol(e)) = res {
                // A length over the limit is refused before its body is read.
                let reason = format!("broke the framing: {e}");
                conn.close(code::PROTOCOL.into(), reason.as_bytes());
                if inner.logged.first(from, &reason) {
                    warn!("peer {from} {reason}; connection closed");
                }
            }
        });
    }
    // Forget the connection if it is still the registered one.
    let mut conns = lock(&inner.conns);
    if conns.get(&from).is_some_and(|(c, _)| c.stable_id() == conn.stable_id()) {
        conns.remove(&from);
    }
    drop(conns);
    lock(&inner.data_links).retain(|(_, _, c)| c.stable_id() != conn.stable_id());
}

/// Keeps an authenticated data connection: as the one to send on for `(addr, lane)`, and
/// among the peer's links whose traffic counts as proof of life.
fn add_lane(inner: &Inner, addr: SocketAddr, lane: u8, conn: &quinn::Connection, node: NodeId) {
    lock(&inner.lanes).insert((addr, lane), (conn.clone(), node));
    lock(&inner.data_links).push((addr, node, conn.clone()));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node of another protocol version (ALPN `meshd/1`) is named as such, not as a bare
    /// TLS alert.
    #[tokio::test]
    async fn another_protocol_version_is_named() {
        let (server, _) = tls::configs_with_alpn(Arc::new(quinn::TransportConfig::default()), b"meshd/1")
            .expect("old configs");
        let old =
            quinn::Endpoint::server(server, "127.0.0.1:0".parse().expect("addr")).expect("old endpoint");
        let to = old.local_addr().expect("addr");
        let accept = tokio::spawn(async move {
            if let Some(incoming) = old.accept().await {
                let _ = incoming.await;
            }
        });
        let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
        cfg.bind = "127.0.0.1".parse().expect("ip");
        let (t, _events) = Transport::bind(cfg).expect("bind");
        let err = t.probe(to).await.expect_err("the handshake must fail").to_string();
        assert!(err.contains("does not speak meshd/6") && err.contains("another meshd version"), "{err}");
        accept.abort();
    }

    /// Issue 16: whoever answers at a peer's address (a squatter on the port) without the
    /// token gets nothing it could test token guesses against offline. It sees the client's
    /// SPAKE2 message, fresh on every connection, and answers with its own and a made-up
    /// confirmation; the client refuses it and sends no confirmation of its own.
    #[tokio::test]
    async fn a_squatter_gets_no_confirmation_and_nothing_repeatable() {
        let (server, _) = tls::configs(Arc::new(quinn::TransportConfig::default())).expect("configs");
        let squatter =
            quinn::Endpoint::server(server, "127.0.0.1:0".parse().expect("addr")).expect("endpoint");
        let to = squatter.local_addr().expect("addr");
        let seen = tokio::spawn(async move {
            let mut firsts = Vec::new();
            let mut after = Vec::new();
            for _ in 0..2 {
                let Some(incoming) = squatter.accept().await else { break };
                let Ok(conn) = incoming.await else { continue };
                let Ok((mut send, mut recv)) = conn.accept_bi().await else { continue };
                let Ok(first) = read_hello(&mut recv).await else { continue };
                // Answer as a node holding some other token would.
                let guess = Token::new("a guess").start();
                let mut h = first.clone();
                h.node = NodeId::from_u128(99);
                h.pake = wire::PakeMessage::from_bytes(guess.message());
                h.mac = [0x5a; 32];
                let _ = write_auth_message(&mut send, &wire::encode(&h)).await;
                // Whatever the client sends next (nothing: it refuses) until it closes.
                let rest = recv.read_to_end(4096).await;
                after.push(rest.map(|b| b.len()).map_err(|e| e.to_string()));
                firsts.push(first);
                let _ = conn.closed().await;
            }
            (firsts, after)
        });
        let (client, mut events) = loopback(1, Some("the real token"), 7);
        for _ in 0..2 {
            let err = client.probe(to).await.expect_err("the squatter must be refused").to_string();
            assert!(err.contains("different token"), "{err}");
        }
        let (firsts, after) =
            tokio::time::timeout(Duration::from_secs(10), seen).await.expect("in time").expect("task");
        assert_eq!(firsts.len(), 2);
        assert_ne!(firsts[0].pake, firsts[1].pake, "a fresh SPAKE2 message on every connection");
        assert_eq!(firsts[0].mac, [0; 32], "nothing keyed by the token in the first message");
        for a in &after {
            assert!(!matches!(a, Ok(n) if *n > 0), "the client sent its confirmation to a squatter: {a:?}");
        }
        let reason = auth_failed(&mut events).await;
        assert!(reason.contains("different token"), "{reason}");
    }

    /// Issue 29: a data connection (which raises no PeerUp) is taken only beside a live main
    /// connection of the same node from the same address: a second "node 1" cannot slip in
    /// through a lane. With the main connection, the lane is taken; a peer then holds at most
    /// `MAX_CONNS_PER_ADDR` connections.
    #[tokio::test]
    async fn lanes_need_the_nodes_main_connection_and_connections_per_peer_are_capped() {
        let (server, _se) = loopback(2, Some("tok"), 7);
        let to = server.local_addr();
        let (client, _ce) = loopback(1, Some("tok"), 7);
        let err = connect(&client.inner, to, 3).await.expect_err("a lane alone").to_string();
        assert!(err.contains("without a live main connection"), "{err}");
        connect(&client.inner, to, 0).await.expect("main");
        connect(&client.inner, to, 3).await.expect("lane beside the main connection");
        let mut refused = None;
        for i in 0..guard::MAX_CONNS_PER_ADDR + 2 {
            if let Err(e) = connect(&client.inner, to, 0).await {
                refused = Some((i, e.to_string()));
                break;
            }
        }
        let (i, why) = refused.expect("a cap on connections per peer");
        assert_eq!(i, guard::MAX_CONNS_PER_ADDR - 2, "{why}");
        assert!(why.contains("connections from"), "{why}");
        assert_eq!(server.inner.authenticated.count(client.local_addr()), guard::MAX_CONNS_PER_ADDR);
    }

    fn loopback(
        node: u128,
        token: Option<&str>,
        run_hash: u64,
    ) -> (Transport, mpsc::Receiver<TransportEvent>) {
        let mut cfg = TransportConfig::new(NodeId::from_u128(node), 0);
        cfg.bind = "127.0.0.1".parse().expect("ip");
        cfg.token = token.map(Token::new);
        cfg.run_hash = run_hash;
        Transport::bind(cfg).expect("bind")
    }

    async fn auth_failed(events: &mut mpsc::Receiver<TransportEvent>) -> String {
        loop {
            match tokio::time::timeout(Duration::from_secs(5), events.recv()).await {
                Ok(Some(TransportEvent::AuthFailed { reason, .. })) => return reason,
                Ok(Some(_)) => {}
                _ => panic!("no AuthFailed event"),
            }
        }
    }

    /// Each end words a token refusal from its own side: the node without a token reads
    /// that IT has none, not that the refusing peer has none.
    #[tokio::test]
    async fn token_refusals_read_right_on_both_ends() {
        let (with, mut with_events) = loopback(1, Some("t"), 7);
        let (without, _e) = loopback(2, None, 7);
        let err = without.probe(with.local_addr()).await.expect_err("refused").to_string();
        assert!(
            err.contains(
                "refused this node: failed authentication: this node has no token; 127.0.0.1 has one"
            ),
            "{err}"
        );
        let theirs = auth_failed(&mut with_events).await;
        assert!(theirs.starts_with("it has no token; this node has one"), "{theirs}");
        // And the other way round: a token where the refusing node has none.
        let (bare, mut bare_events) = loopback(3, None, 7);
        let err = with.probe(bare.local_addr()).await.expect_err("refused").to_string();
        assert!(err.contains("this node holds a token; 127.0.0.1 has none"), "{err}");
        assert!(auth_failed(&mut bare_events).await.starts_with("it holds a token; this node has none"));
        for t in [with, without, bare] {
            t.shutdown().await;
        }
    }

    fn store_frame(key: &str) -> Frame {
        Frame::Store(wire::StoreMsg::Set {
            restart: 0,
            version: meshd_proto::store::Version { counter: 1, writer: NodeId::from_u128(1) },
            key: key.into(),
            value: vec![7],
        })
    }

    /// The next store frame `events` delivers, with its key, within `within`.
    async fn next_store(events: &mut mpsc::Receiver<TransportEvent>, within: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Ok(Some(TransportEvent::Frame {
                    frame: Frame::Store(wire::StoreMsg::Set { key, .. }),
                    ..
                })) => {
                    return Some(key);
                }
                Ok(Some(_)) => {}
                _ => return None,
            }
        }
    }

    /// A UDP port nothing listens on (bound, then freed).
    fn free_port() -> SocketAddr {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        s.local_addr().expect("addr")
    }

    /// Issue 17: control frames are never starved by data. The peer takes none of the
    /// data streams opened to it (they stay parked, as for an operation it has not
    /// started), until they hold every stream slot it grants and more than its connection
    /// window in unread bytes; a control frame still arrives at once, because data travels
    /// on data connections and the main connection is left to control.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn control_frames_get_through_while_data_streams_are_parked() {
        let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
        cfg.bind = "127.0.0.1".parse().expect("ip");
        cfg.token = Some(Token::new("t"));
        cfg.run_hash = 7;
        cfg.send_timeout = Duration::from_millis(500);
        let (a, _a_events) = Transport::bind(cfg).expect("bind");
        let (b, mut b_events) = loopback(2, Some("t"), 7);
        let to = b.local_addr();
        // The main connection first, as a running node has it.
        a.send(to, &store_frame("before"), true);
        assert_eq!(next_store(&mut b_events, Duration::from_secs(5)).await.as_deref(), Some("before"));
        // Every stream slot b grants on the data connection, parked unread...
        let mut parked = Vec::new();
        for op in 0..guard::UNI_STREAMS as u64 {
            parked.push(a.open_data(to, op).await.expect("a data stream within the limit"));
        }
        // ...one more cannot be opened (and says why, in time, rather than waiting forever)...
        let t = Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(15), a.open_data(to, 999))
            .await
            .expect("opening a data stream has a deadline")
            .expect_err("no stream slot left");
        assert!(err.to_string().contains("granted no data stream"), "{err}");
        assert!(t.elapsed() < Duration::from_secs(5));
        // ...and more unread bytes than the connection window: writers that block.
        let per = 4 << 20;
        let chunk = Bytes::from(vec![0u8; per]);
        let mut writers = Vec::new();
        for mut s in parked.drain(..(guard::RECEIVE_WINDOW as usize / per + 2)) {
            let c = chunk.clone();
            writers.push(tokio::spawn(async move {
                let _ = s.write_chunk(c).await;
                s
            }));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(writers.iter().any(|w| !w.is_finished()), "the data connection's window is full");
        // Control frames still arrive promptly (each on a stream of its own: in any order).
        let t = Instant::now();
        for k in ["abort", "done"] {
            a.send(to, &store_frame(k), true);
        }
        let mut got = Vec::new();
        for _ in 0..2 {
            got.extend(next_store(&mut b_events, Duration::from_secs(3)).await);
        }
        got.sort();
        assert_eq!(got, ["abort", "done"]);
        assert!(t.elapsed() < Duration::from_secs(2), "control waited {:?}", t.elapsed());
        assert_eq!(a.undelivered(), 0);
        for w in writers {
            w.abort();
        }
        drop(parked);
        a.shutdown().await;
        b.shutdown().await;
    }

    /// A reliable frame to a peer that is not up yet is kept and retried with backoff,
    /// not dropped: it arrives once the peer is there.
    #[tokio::test]
    async fn a_reliable_frame_waits_for_a_peer_that_comes_up_later() {
        let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
        cfg.bind = "127.0.0.1".parse().expect("ip");
        cfg.connect_timeout = Duration::from_millis(300);
        let (a, _e) = Transport::bind(cfg).expect("bind");
        let later = free_port();
        a.send(later, &store_frame("early"), true);
        // Several connect attempts fail meanwhile.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert_eq!(a.queued(later), 1, "the frame is kept while the peer is unreachable");
        let mut cfg = TransportConfig::new(NodeId::from_u128(2), later.port());
        cfg.bind = "127.0.0.1".parse().expect("ip");
        let (b, mut b_events) = Transport::bind(cfg).expect("bind the peer late");
        assert_eq!(next_store(&mut b_events, Duration::from_secs(10)).await.as_deref(), Some("early"));
        assert_eq!((a.queued(later), a.undelivered()), (0, 0));
        a.shutdown().await;
        b.shutdown().await;
    }

    /// A frame that finally cannot be delivered is counted (and logged), not lost in
    /// silence; one for a forgotten peer too.
    #[tokio::test]
    async fn undeliverable_frames_are_counted_at_the_horizon_or_when_forgotten() {
        let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
        cfg.bind = "127.0.0.1".parse().expect("ip");
        cfg.connect_timeout = Duration::from_millis(200);
        cfg.reliable_horizon = Duration::from_millis(800);
        let (a, _e) = Transport::bind(cfg).expect("bind");
        let nowhere = free_port();
        a.send(nowhere, &store_frame("lost"), true);
        a.send(nowhere, &store_frame("lost too"), true);
        assert_eq!(a.queued(nowhere), 2);
        let t = Instant::now();
        while a.undelivered() < 2 && t.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!((a.undelivered(), a.queued(nowhere)), (2, 0), "given up on at the horizon");
        assert!(t.elapsed() >= Duration::from_millis(700), "not before the horizon: {:?}", t.elapsed());
        let elsewhere = free_port();
        a.send(elsewhere, &store_frame("forgotten"), true);
        a.forget(elsewhere);
        assert_eq!((a.undelivered(), a.queued(elsewhere)), (3, 0));
        a.shutdown().await;
    }

    /// Frames for a peer that refuses this node (another token) can never be delivered:
    /// they are counted at once, not retried until the horizon.
    #[tokio::test]
    async fn frames_for_a_peer_that_refuses_us_are_counted_at_once() {
        let (a, _a_events) = loopback(1, Some("t"), 7);
        let (b, mut b_events) = loopback(2, Some("another token"), 7);
        a.send(b.local_addr(), &store_frame("never"), true);
        let t = Instant::now();
        while a.undelivered() < 1 && t.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!((a.undelivered(), a.queued(b.local_addr())), (1, 0));
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}: long before the 30 s horizon", t.elapsed());
        assert_eq!(next_store(&mut b_events, Duration::from_millis(200)).await, None);
        a.shutdown().await;
        b.shutdown().await;
    }

    /// Another run with the same token: the refusal names what separates runs.
    #[tokio::test]
    async fn another_run_says_to_give_each_job_its_own_run_id() {
        let (a, mut a_events) = loopback(1, Some("t"), 7);
        let (b, _e) = loopback(2, Some("t"), 8);
        let err = b.open_data(a.local_addr(), 1).await.expect_err("refused").to_string();
        assert!(err.contains("127.0.0.1 belongs to another job"), "{err}");
        assert!(err.contains("give each job its own --run-id"), "{err}");
        let here = auth_failed(&mut a_events).await;
        assert!(here.starts_with("it belongs to another job"), "{here}");
        assert!(!here.contains("command or peers"), "{here}");
        a.shutdown().await;
        b.shutdown().await;
    }
}
