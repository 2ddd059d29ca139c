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
mod reuse;
pub mod socket;
mod tls;

mod accept;
mod bind;
mod config;
mod handshake;
mod query;
mod sender;
mod udp;

use accept::*;
pub use bind::udp_port_holder;
use bind::*;
pub use config::{CongestionControl, TransportConfig, UnknownCongestionControl};
use handshake::*;
pub use handshake::{AuthFailure, REFUSED_US, RefusedBy, auth_failure_text};
pub use query::{PathStats, ProbeInfo};
use sender::*;
use udp::*;

use auth::{Refusal, Role};
use bytes::Bytes;
use meshd_proto::NodeId;
use meshd_proto::wire::{
    self, AuthHello, Frame, MAX_LANES, PROTOCOL_VERSION, Query, StatusReply, TunnelReply,
};
use std::collections::HashMap;
use std::net::SocketAddr;
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
    /// The peer refused us or we refused it.
    #[error("{}", auth_failure_text(*.addr, .reason))]
    Auth {
        /// The peer.
        addr: SocketAddr,
        /// Who refused, and why.
        reason: AuthFailure,
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
        /// Who refused, and why.
        reason: AuthFailure,
    },
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

/// The tunnel's counters as `meshd status` gets them, read when a probe asks.
pub type TunnelCounters = Arc<dyn Fn() -> TunnelReply + Send + Sync>;

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
    tunnel_stats: Mutex<Option<TunnelCounters>>,
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
        let lanes = if cfg.plane { cfg.plane_lanes.clamp(1, plane::MAX_PLANE_LANES) } else { 0 };
        // quinn's socket, and one per plane lane where the kernel lets them share the port.
        let bound =
            reuse::bind(addr, if cfg.plane_sockets { lanes } else { 0 }).map_err(|e| bind_error(addr, e))?;
        if let Some(why) = &bound.fallback {
            tracing::debug!("the data plane shares quinn's socket: {why}");
        }
        let socket = bound.quic;
        set_socket_buffers(&socket, 16 << 20);
        let mut lane_sockets = Vec::new();
        for s in bound.lanes {
            set_socket_buffers(&s, 16 << 20);
            lane_sockets.push(socket::LaneSocket::new(s).map_err(|e| bind_error(addr, e))?);
        }
        let runtime =
            quinn::default_runtime().ok_or_else(|| TransportError::Tls("no async runtime".into()))?;
        // One socket for QUIC and the data plane, told apart by the QUIC fixed bit, which
        // meshd's endpoints therefore never grease (docs/PROTOCOL.md, "The data plane").
        ec.grease_quic_bit(false);
        let (plane_tx, plane_rx): (Vec<_>, Vec<_>) =
            (0..lanes).map(|_| tokio::sync::mpsc::channel(socket::PLANE_QUEUE)).unzip();
        let demux = Arc::new(socket::DemuxSocket::new(socket, plane_tx).map_err(|e| bind_error(addr, e))?);
        let plane_datagram = max_payload.map_or(if cfg.bind.is_ipv6() { 1452 } else { 1472 }, usize::from);
        if !lane_sockets.is_empty() {
            demux.set_lane_sockets();
        }
        let plane =
            cfg.plane.then(|| plane::Plane::start(demux.clone(), plane_rx, plane_datagram, lane_sockets));
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

fn existing(inner: &Inner, to: SocketAddr) -> Option<quinn::Connection> {
    let conns = lock(&inner.conns);
    conns.get(&to).filter(|(c, _)| c.close_reason().is_none()).map(|(c, _)| c.clone())
}

fn existing_lane(inner: &Inner, to: SocketAddr, lane: u8) -> Option<quinn::Connection> {
    let lanes = lock(&inner.lanes);
    lanes.get(&(to, lane)).filter(|(c, _)| c.close_reason().is_none()).map(|(c, _)| c.clone())
}

#[cfg(test)]
mod tests;
