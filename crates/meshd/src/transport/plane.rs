//! The data plane's driver: one task per lane that owns the plane [`Link`]s to the peers,
//! seals and sends with GSO through the shared [`DemuxSocket`], opens what the socket
//! queued (GRO batches), runs the links' timers, and hands complete messages to whoever
//! subscribed to them (the ring, `collective::plane_ring`).
//!
//! A link is made for each authenticated connection to a peer, from the connection's TLS
//! exporter (label [`EXPORTER_LABEL`], context = lane and direction), so only the two ends
//! of that connection hold its keys. Both ends of a link may hold two connections for a
//! while (both connected at once, or one reconnected): each keeps a link per connection,
//! opens a datagram with the one its link id names, and sends on the one whose probe the
//! peer acknowledged and whose name is lowest.
//!
//! A message on the plane is `[op u64 LE][id u64 LE][payload]`; the plane link's tag says
//! whether it is data ([`TAG_DATA`]) or the probe each link sends first ([`TAG_PROBE`]),
//! whose acknowledgement proves that datagrams get through both ways. What the plane holds
//! for a peer (messages being reassembled, complete ones not taken yet) is bounded by its
//! [`budget`]: past it, datagrams are dropped unacknowledged.

mod budget;
pub mod streams;

use super::socket::{DemuxSocket, LANE_BATCH, LANE_BUF, LaneSocket, PlaneBatch, Received};
use budget::Budget;
pub use budget::{MAX_OPEN_PER_PEER, PEER_BUDGET};
use bytes::Bytes;
use meshd_proto::plane::link::{MAX_DATAGRAM, MIN_DATAGRAM};
use meshd_proto::plane::packet::link_id_of;
use meshd_proto::plane::{Event, Link, LinkConfig, LinkKeys, LinkStats, Offer, PlaneError};
use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

use meshd_proto::plane::keys::{EXPORTER_LABEL, LINK_NAME_CONTEXT, exporter_context};
/// Receive calls one wakeup of a lane's own socket makes at most before the driver looks
/// at its other work (sends, timers).
const OWN_READS: usize = 8;
/// Plane message tag of ring data.
pub const TAG_DATA: u64 = 0;
/// Plane message tag of a link's first message.
pub const TAG_PROBE: u64 = 1;
/// Plane message tag of a tunnel stream's bytes: `[receiver's stream id u64 LE][offset
/// u64 LE][bytes]` ([`streams`]).
pub const TAG_STREAM: u64 = 2;
/// Plane message tag of a tunnel stream's credit: `[sender's stream id u64 LE][the offset
/// it may send up to, u64 LE]` ([`streams`]).
pub const TAG_CREDIT: u64 = 3;
/// Bytes before the payload of a data message: op id and transfer id.
pub const MESSAGE_HEADER: usize = 16;
/// Operations whose messages are kept per peer before anyone asked for them: a neighbour
/// is at most one operation ahead; older ones belong to operations this node gave up on.
const UNCLAIMED_OPS_PER_PEER: usize = 4;
/// Largest ring chunk the plane carries: a node sends larger chunks over QUIC streams. A
/// message of it reserves twice its size of the peer's [`PEER_BUDGET`], so two fit.
pub const MAX_CHUNK: usize = 16 << 20;
/// Largest plane message this end accepts: a ring chunk and its header.
const MAX_MESSAGE: u64 = (MAX_CHUNK + MESSAGE_HEADER) as u64;
/// How long a ready link may have packets in flight with nothing acknowledged before it
/// counts as no longer getting through: it is no longer ready, and ring operations to the
/// peer use QUIC streams from the next one (the running one fails, naming the cause).
pub const SILENCE: Duration = Duration::from_secs(5);

/// A received data message: the transfer id and its payload, in order, as the pieces of
/// the receive batches it was opened in (never copied after the kernel's copy out).
pub type Delivery = (u64, Vec<Bytes>);

enum Cmd {
    AddLink { conn: quinn::Connection, client: bool },
    Send { to: SocketAddr, tag: u64, head: [u8; MESSAGE_HEADER], body: Bytes },
}

/// Counters of the plane, for diagnostics and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PlaneCounters {
    /// Datagrams that opened under some link's keys.
    pub opened: u64,
    /// Datagrams of a peer's link id that did not open (altered, replayed, too old), or
    /// whose link had just gone.
    pub refused: u64,
    /// Datagrams that opened but were dropped unacknowledged: a message could not open
    /// within the peer's budget ([`PEER_BUDGET`], [`MAX_OPEN_PER_PEER`]).
    pub over_budget: u64,
    /// The most bytes of receive buffers held for one peer at once.
    pub held_peak: u64,
    /// Bytes of fragments copied out of receive buffers they filled less than half of.
    pub copied: u64,
    /// Data messages delivered complete.
    pub messages: u64,
    /// Plane datagrams the socket dropped before any cryptography: no link of this node
    /// expects their link id from their address (strangers, spoofers).
    pub unknown_source: u64,
    /// Plane datagrams the socket dropped: the plane's queue was full.
    pub overflow: u64,
    /// Receive batches the socket queued (datagrams per batch: GRO at work).
    pub batches: u64,
}

#[derive(Default)]
struct Subs {
    /// (peer, op) -> where its messages go.
    open: HashMap<(SocketAddr, u64), mpsc::UnboundedSender<Delivery>>,
    /// Messages that came before anyone asked, per (peer, op), oldest op first.
    unclaimed: Vec<((SocketAddr, u64), Vec<Delivery>)>,
}

/// Most lanes a node's plane runs (each its own driver task, so its own core).
pub const MAX_PLANE_LANES: usize = 8;

/// Lanes when the configuration does not say: one per two of the runtime's worker threads
/// (each lane's driver seals, sends, receives and opens; the ring's reduction and quinn's
/// endpoint need workers too), at least one, at most [`MAX_PLANE_LANES`].
pub fn default_lanes() -> usize {
    let workers = tokio::runtime::Handle::try_current().map_or(1, |h| h.metrics().num_workers());
    (workers / 2).clamp(1, MAX_PLANE_LANES)
}

/// A handle on the node's data plane. Cheap to clone.
#[derive(Clone)]
pub struct Plane {
    /// One driver per lane.
    cmds: Vec<mpsc::UnboundedSender<Cmd>>,
    subs: Arc<Mutex<Subs>>,
    /// (peer, lane) of every link whose full-size probe the peer acknowledged.
    ready: Arc<Mutex<HashSet<(SocketAddr, u8)>>>,
    counters: Arc<Mutex<PlaneCounters>>,
    socket: Arc<DemuxSocket>,
    /// Each peer's sending links' counters per lane, as of the drivers' last look (every
    /// 500 ms).
    stats: Arc<Mutex<HashMap<(SocketAddr, u8), LinkStats>>>,
    /// What the plane holds for each peer host, all lanes together.
    budgets: Arc<Mutex<HashMap<IpAddr, Arc<Budget>>>>,
    /// The tunnel's byte streams on the plane.
    streams: Arc<streams::Streams>,
}

impl std::fmt::Debug for Plane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plane").finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Plane {
    /// Starts one driver per lane over `socket`, lane `l` reading what the socket queued
    /// in `batches[l]` (at most [`MAX_PLANE_LANES`] are used). Datagrams carry at most
    /// `max_datagram` bytes of UDP payload.
    ///
    /// `own`: the lanes' own sockets in the port's group ([`super::reuse`]), lane `l`'s
    /// at `l`; a lane without one sends on the shared socket and reads its queue only.
    pub fn start(
        socket: Arc<DemuxSocket>,
        batches: Vec<mpsc::Receiver<PlaneBatch>>,
        max_datagram: usize,
        own: Vec<LaneSocket>,
    ) -> Plane {
        let max_datagram = max_datagram.clamp(MIN_DATAGRAM, MAX_DATAGRAM);
        let mut cmds = Vec::new();
        let mut rxs = Vec::new();
        for _ in batches.iter().take(MAX_PLANE_LANES) {
            let (tx, rx) = mpsc::unbounded_channel();
            cmds.push(tx);
            rxs.push(rx);
        }
        let plane = Plane {
            cmds,
            subs: Arc::default(),
            ready: Arc::default(),
            counters: Arc::default(),
            socket: socket.clone(),
            stats: Arc::default(),
            budgets: Arc::default(),
            streams: Arc::default(),
        };
        let mut own = own.into_iter().map(Arc::new);
        for (lane, (cmd_rx, batches)) in rxs.into_iter().zip(batches).enumerate() {
            let driver = Driver {
                lane: lane as u8,
                socket: socket.clone(),
                own: own.next(),
                rbufs: Vec::new(),
                got: Vec::new(),
                max_datagram,
                links: HashMap::new(),
                plane: plane.clone(),
                buf: Vec::new(),
                fragments: Vec::new(),
            };
            tokio::spawn(driver.run(cmd_rx, batches));
        }
        plane
    }

    /// Lanes this node's plane runs.
    pub fn lanes(&self) -> usize {
        self.cmds.len()
    }

    /// Makes a link per lane for an authenticated connection (`client`: this end connected).
    pub fn add_link(&self, conn: quinn::Connection, client: bool) {
        for cmd in &self.cmds {
            let _ = cmd.send(Cmd::AddLink { conn: conn.clone(), client });
        }
    }

    /// Whether a link to `peer` had its full-size probe acknowledged: datagrams get
    /// through both ways.
    pub fn is_ready(&self, peer: SocketAddr) -> bool {
        self.ready_lanes(peer) > 0
    }

    /// Lanes `0..k` to `peer` whose probes the peer acknowledged (a peer that runs fewer
    /// lanes never answers on the others): the lanes a sender may use.
    pub fn ready_lanes(&self, peer: SocketAddr) -> usize {
        let peer = super::canonical(peer);
        let ready = lock(&self.ready);
        (0..self.lanes()).take_while(|&l| ready.contains(&(peer, l as u8))).count()
    }

    /// Waits up to `wait` for [`Plane::is_ready`].
    pub async fn wait_ready(&self, peer: SocketAddr, wait: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if self.is_ready(peer) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Queues transfer `id` of operation `op` for `to` on `lane` (modulo the lanes); the
    /// plane resends until it arrives. `payload` is not copied: the link holds it until
    /// the peer acknowledged every byte, and copies each fragment once, into the datagram
    /// it seals.
    pub fn send(&self, to: SocketAddr, lane: usize, op: u64, id: u64, payload: Bytes) -> Result<(), String> {
        self.send_tagged(to, lane, TAG_DATA, op, id, payload)
    }

    /// Queues the message `[a u64 LE][b u64 LE][payload]` of `tag` for `to` on `lane`
    /// (modulo the lanes), as [`Plane::send`].
    pub fn send_tagged(
        &self,
        to: SocketAddr,
        lane: usize,
        tag: u64,
        a: u64,
        b: u64,
        payload: Bytes,
    ) -> Result<(), String> {
        let mut head = [0u8; MESSAGE_HEADER];
        head[..8].copy_from_slice(&a.to_le_bytes());
        head[8..].copy_from_slice(&b.to_le_bytes());
        self.cmds[lane % self.cmds.len()]
            .send(Cmd::Send { to: super::canonical(to), tag, head, body: payload })
            .map_err(|_| "the data plane stopped".to_string())
    }

    /// The tunnel's byte streams on this plane.
    pub fn streams(&self) -> &Arc<streams::Streams> {
        &self.streams
    }

    /// The messages of operation `op` from `peer`, those that came already first.
    pub fn subscribe(&self, peer: SocketAddr, op: u64) -> mpsc::UnboundedReceiver<Delivery> {
        let key = (super::canonical(peer), op);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut subs = lock(&self.subs);
        if let Some(i) = subs.unclaimed.iter().position(|(k, _)| *k == key) {
            for d in subs.unclaimed.remove(i).1 {
                let _ = tx.send(d);
            }
        }
        subs.open.insert(key, tx);
        rx
    }

    /// Ends a subscription: later messages of the operation are dropped.
    pub fn unsubscribe(&self, peer: SocketAddr, op: u64) {
        lock(&self.subs).open.remove(&(super::canonical(peer), op));
    }

    /// The counters and estimates of the lane-0 link this node sends to `peer` on, as of
    /// at most half a second ago.
    pub fn link_stats(&self, peer: SocketAddr) -> Option<LinkStats> {
        self.lane_stats(peer, 0)
    }

    /// [`Plane::link_stats`] of `lane`.
    pub fn lane_stats(&self, peer: SocketAddr, lane: u8) -> Option<LinkStats> {
        lock(&self.stats).get(&(super::canonical(peer), lane)).cloned()
    }

    /// The counters so far, the socket's included.
    pub fn counters(&self) -> PlaneCounters {
        let mut c = lock(&self.counters).clone();
        for b in lock(&self.budgets).values() {
            c.over_budget += b.refused();
            c.held_peak = c.held_peak.max(b.peak() as u64);
        }
        let s = &self.socket.counters;
        c.unknown_source = s.plane_unknown.load(std::sync::atomic::Ordering::Relaxed);
        c.overflow = s.plane_overflow.load(std::sync::atomic::Ordering::Relaxed);
        c.batches = s.plane_batches.load(std::sync::atomic::Ordering::Relaxed);
        c
    }

    /// The budget of `peer`'s host, made on first use.
    fn budget(&self, peer: SocketAddr) -> Arc<Budget> {
        lock(&self.budgets).entry(peer.ip()).or_default().clone()
    }

    /// Bytes of receive buffers the plane holds for `peer`'s host now, and its messages
    /// partly received (for tests and diagnostics).
    pub fn held(&self, peer: SocketAddr) -> (usize, usize) {
        let peer = super::canonical(peer);
        lock(&self.budgets).get(&peer.ip()).map_or((0, 0), |b| (b.held(), b.open_messages()))
    }

    fn deliver(&self, from: SocketAddr, op: u64, d: Delivery) {
        let mut subs = lock(&self.subs);
        let key = (from, op);
        if let Some(tx) = subs.open.get(&key) {
            if tx.send(d).is_ok() {
                return;
            }
            // The subscriber went away without unsubscribing: drop its messages.
            subs.open.remove(&key);
            return;
        }
        if let Some((_, v)) = subs.unclaimed.iter_mut().find(|(k, _)| *k == key) {
            v.push(d);
            return;
        }
        subs.unclaimed.push((key, vec![d]));
        if subs.unclaimed.iter().filter(|(k, _)| k.0 == from).count() > UNCLAIMED_OPS_PER_PEER {
            if let Some(i) = subs.unclaimed.iter().position(|(k, _)| k.0 == from) {
                let ((_, old), _) = subs.unclaimed.remove(i);
                tracing::debug!(peer = %from, op = old, "dropped plane messages no operation asked for");
            }
        }
    }
}

/// One link: the connection it came from, the link, and messages being reassembled.
struct Entry {
    conn: quinn::Connection,
    /// The name both ends derive alike from the connection (see [`best`]).
    name: u64,
    link: Link,
    /// What the plane holds for the peer's host (shared by its links and lanes).
    budget: Arc<Budget>,
    /// Data messages being reassembled, by message number.
    partial: HashMap<u64, Partial>,
    last_heard: Option<Instant>,
    /// Whether the peer acknowledged the probe.
    probed: bool,
    /// Stopped getting through after it was ready: never ready again.
    silenced: bool,
    /// Used up its keys: removed at the next prune.
    dead: bool,
}

/// A data message being reassembled: its pieces so far (offset in the message, bytes) and
/// the bytes still missing (reserved in the peer's budget until they arrive).
struct Partial {
    pieces: Vec<(u64, Bytes)>,
    missing: u64,
}

impl Drop for Entry {
    fn drop(&mut self) {
        // Messages that will never finish give their reservations back.
        for p in self.partial.values() {
            self.budget.close(p.missing);
        }
    }
}

struct Driver {
    lane: u8,
    socket: Arc<DemuxSocket>,
    /// This lane's own socket in the port's group, when it has one.
    own: Option<Arc<LaneSocket>>,
    /// Receive buffers for `own`.
    rbufs: Vec<Vec<u8>>,
    got: Vec<Received>,
    max_datagram: usize,
    links: HashMap<SocketAddr, Vec<Entry>>,
    plane: Plane,
    buf: Vec<u8>,
    /// The DATA fragments of the receive batch being opened (kept for its allocation).
    fragments: Vec<Fragment>,
}

/// The two directions' secrets of `conn`'s plane link on `lane`, seen from this end
/// (docs/PROTOCOL.md, "The data plane", Keys).
fn link_keys(conn: &quinn::Connection, client: bool, lane: u8) -> Option<LinkKeys> {
    let mut c2s = [0u8; 32];
    let mut s2c = [0u8; 32];
    conn.export_keying_material(&mut c2s, EXPORTER_LABEL, &exporter_context(lane, true)).ok()?;
    conn.export_keying_material(&mut s2c, EXPORTER_LABEL, &exporter_context(lane, false)).ok()?;
    Some(LinkKeys::for_side(c2s, s2c, client))
}

impl Driver {
    async fn run(mut self, mut cmds: mpsc::UnboundedReceiver<Cmd>, mut batches: mpsc::Receiver<PlaneBatch>) {
        let mut prune = tokio::time::interval(Duration::from_millis(500));
        let own = self.own.clone();
        loop {
            let deadline = self
                .links
                .values()
                .flatten()
                .filter_map(|e| e.link.poll_timeout())
                .min()
                .map(tokio::time::Instant::from_std);
            tokio::select! {
                cmd = cmds.recv() => match cmd {
                    Some(Cmd::AddLink { conn, client }) => self.add_link(conn, client),
                    Some(Cmd::Send { to, tag, head, body }) => self.send(to, tag, &head, body),
                    None => return,
                },
                batch = batches.recv() => match batch {
                    Some(b) => {
                        self.receive(b);
                        // Take in whatever else is queued before answering.
                        while let Ok(b) = batches.try_recv() {
                            self.receive(b);
                        }
                    }
                    None => return,
                },
                r = async { match &own { Some(o) => o.readable().await, None => std::future::pending().await } }, if own.is_some() => {
                    if r.is_ok() {
                        self.read_own();
                    }
                }
                _ = async { tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)).await }, if deadline.is_some() => {
                    let now = Instant::now();
                    for e in self.links.values_mut().flatten() {
                        if e.link.poll_timeout().is_some_and(|t| t <= now) {
                            e.link.handle_timeout(now);
                        }
                    }
                }
                _ = prune.tick() => self.prune(),
            }
            if let Err(e) = self.flush().await {
                tracing::warn!("data plane send failed: {e}");
            }
        }
    }

    fn add_link(&mut self, conn: quinn::Connection, client: bool) {
        let peer = super::canonical(conn.remote_address());
        let Some(keys) = link_keys(&conn, client, self.lane) else {
            tracing::debug!(%peer, "no TLS keying material for a plane link");
            return;
        };
        let mut config = LinkConfig::new(keys, self.lane);
        config.max_datagram = self.max_datagram;
        config.max_message_len = MAX_MESSAGE;
        config.max_incoming_messages = MAX_OPEN_PER_PEER;
        let mut link = match Link::new(config, Instant::now()) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(%peer, "plane link: {e}");
                return;
            }
        };
        let mut name = [0u8; 8];
        if conn.export_keying_material(&mut name, EXPORTER_LABEL, LINK_NAME_CONTEXT).is_err() {
            tracing::debug!(%peer, "no TLS keying material for a plane link's name");
            return;
        }
        // The probe, a full-size datagram: its acknowledgement, the first thing heard
        // back, shows that datagrams of this size get through both ways (a path that
        // drops them leaves the link silent, and the ring on QUIC streams).
        let _ = link.send(TAG_PROBE, vec![0; self.max_datagram]);
        self.socket.add_route(link.recv_id(), peer, self.lane);
        let budget = self.plane.budget(peer);
        self.links.entry(peer).or_default().push(Entry {
            conn,
            name: u64::from_le_bytes(name),
            link,
            budget,
            partial: HashMap::new(),
            last_heard: None,
            probed: false,
            silenced: false,
            dead: false,
        });
    }

    fn send(&mut self, to: SocketAddr, tag: u64, head: &[u8], body: Bytes) {
        let Some(e) = self.links.get_mut(&to).and_then(|v| best(v)) else {
            tracing::debug!(peer = %to, "no plane link; message dropped");
            return;
        };
        if let Err(err) = e.link.send_parts(tag, head, body) {
            tracing::warn!(peer = %to, "plane send: {err}");
        }
    }

    /// Opens a receive batch in place, each datagram with the link its link id names, then
    /// hands its data fragments on as pieces of that one buffer (the plaintext is not
    /// copied again: the ring reduces straight from it). A buffer is kept only for the
    /// message that fills at least half of it; every other message's fragments are copied
    /// out into a buffer of their own size, so that no message keeps more than twice its
    /// bytes alive (see [`budget`]).
    ///
    /// Returns the batch's buffer when nothing keeps it (for the next receive).
    fn receive(&mut self, batch: PlaneBatch) -> Option<Vec<u8>> {
        let Some(entries) = self.links.get_mut(&batch.from) else { return Some(batch.data) };
        let now = Instant::now();
        let mut data = batch.data;
        let stride = batch.stride.max(1);
        let (mut opened, mut refused) = (0, 0);
        let fragments = &mut self.fragments;
        fragments.clear();
        for (i, datagram) in data.chunks_mut(stride).enumerate() {
            let Some(k) =
                link_id_of(datagram).and_then(|id| entries.iter().position(|e| e.link.recv_id() == id))
            else {
                // The socket let it through for a link that has gone since.
                refused += 1;
                continue;
            };
            let e = &mut entries[k];
            let budget = &e.budget;
            let base = datagram.as_ptr() as usize;
            let admit = |o: &Offer| admit(budget, o);
            match e.link.handle_datagram_admit(datagram, now, admit) {
                Ok(r) => {
                    opened += 1;
                    e.last_heard = Some(now);
                    let Some(r) = r.filter(|r| kept(r.tag)) else { continue };
                    fragments.push(Fragment {
                        entry: k,
                        tag: r.tag,
                        seq: r.seq,
                        offset: r.offset,
                        total_len: r.total_len,
                        start: i * stride + (r.data.as_ptr() as usize - base),
                        len: r.data.len(),
                        complete: r.complete,
                    });
                }
                // Authentic, from the peer: it is heard, its datagram resent later.
                Err(PlaneError::OverBudget) => {
                    e.budget.refuse();
                    e.last_heard = Some(now);
                }
                Err(_) => refused += 1,
            }
        }
        let mut c = lock(&self.plane.counters);
        c.opened += opened;
        c.refused += refused;
        drop(c);
        if fragments.is_empty() {
            return Some(data);
        }
        // The message with the most bytes here keeps the buffer if it fills half of it.
        let mut groups: Vec<((usize, u64), usize)> = Vec::new();
        for f in fragments.iter() {
            match groups.iter_mut().find(|(g, _)| *g == (f.entry, f.seq)) {
                Some((_, n)) => *n += f.len,
                None => groups.push(((f.entry, f.seq), f.len)),
            }
        }
        let keeper =
            groups.iter().max_by_key(|(_, n)| *n).filter(|(_, n)| 2 * n >= data.capacity()).map(|(g, _)| *g);
        let budget = entries[fragments[0].entry].budget.clone();
        let mut copied = 0;
        // Each message's bytes: its own copy (`true`), or the buffer itself (the keeper's).
        let mut sources: Vec<((usize, u64), Bytes, bool)> = Vec::with_capacity(groups.len());
        for &(g, n) in groups.iter().filter(|(g, _)| keeper != Some(*g)) {
            // A message with a small part of this buffer: its bytes, copied out.
            let mut own = Vec::with_capacity(n);
            for f in fragments.iter().filter(|f| (f.entry, f.seq) == g) {
                own.extend_from_slice(&data[f.start..f.start + f.len]);
            }
            copied += n as u64;
            sources.push((g, budget::hold(own, &budget), true));
        }
        let spare = match keeper {
            Some(g) => {
                sources.push((g, budget::hold(data, &budget), false));
                None
            }
            None => Some(data),
        };
        for (g, source, own) in sources {
            let Some(e) = entries.get_mut(g.0) else { continue };
            let mut at = 0;
            for f in fragments.iter().filter(|f| (f.entry, f.seq) == g) {
                let piece =
                    if own { source.slice(at..at + f.len) } else { source.slice(f.start..f.start + f.len) };
                at += f.len;
                e.budget.arrived(f.len as u64);
                let p = e
                    .partial
                    .entry(f.seq)
                    .or_insert_with(|| Partial { pieces: Vec::new(), missing: f.total_len });
                p.missing = p.missing.saturating_sub(f.len as u64);
                p.pieces.push((f.offset, piece));
                if f.complete {
                    if let Some(mut p) = e.partial.remove(&f.seq) {
                        e.budget.close(p.missing);
                        take_message(&self.plane, batch.from, f.tag, std::mem::take(&mut p.pieces));
                    }
                }
            }
        }
        if copied > 0 {
            lock(&self.plane.counters).copied += copied;
        }
        spare
    }

    /// Reads this lane's own socket (when it has one) until it is empty or a bound of
    /// batches was read, and opens each batch in the buffer it was received in.
    fn read_own(&mut self) {
        let Some(own) = self.own.clone() else { return };
        for _ in 0..OWN_READS {
            self.rbufs.resize_with(LANE_BATCH, Vec::new);
            let n = match own.recv(&mut self.rbufs, &mut self.got) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::debug!("plane lane {} socket: {e}", self.lane);
                    return;
                }
            };
            for i in 0..n {
                let Received { from, stride } = self.got[i];
                let mut data = std::mem::take(&mut self.rbufs[i]);
                let meta = quinn::udp::RecvMeta { addr: from, len: data.len(), stride, ..Default::default() };
                let kept = self.socket.sort(&mut data, from, stride, Some(usize::from(self.lane)), &meta);
                data.truncate(kept);
                let spare = if kept > 0 {
                    self.receive(PlaneBatch { from: super::canonical(from), stride, data })
                } else {
                    Some(data)
                };
                // A buffer nothing kept serves the next read.
                if let Some(b) = spare.filter(|b| b.capacity() >= LANE_BUF) {
                    self.rbufs[i] = b;
                }
            }
            if n < LANE_BATCH {
                return;
            }
        }
    }

    fn prune(&mut self) {
        let now = Instant::now();
        for (peer, entries) in self.links.iter_mut() {
            let silent = entries
                .iter()
                .any(|e| e.probed && e.link.unacknowledged_for(now).is_some_and(|d| d >= SILENCE));
            if !silent {
                continue;
            }
            // The probe got through once; datagrams no longer do (a middlebox, a path MTU
            // change). The path failed, not one connection: no link to the peer on this
            // lane is ready again (new connections make new links, with new probes).
            tracing::warn!(
                peer = %peer,
                lane = self.lane,
                "data plane datagrams to {peer} stopped getting through (nothing acknowledged for {}s); \
                 ring operations to it use QUIC streams from the next one",
                SILENCE.as_secs()
            );
            for e in entries.iter_mut() {
                e.probed = false;
                e.silenced = true;
            }
        }
        let socket = self.socket.clone();
        self.links.retain(|_, entries| {
            entries.retain(|e| {
                let alive = e.conn.close_reason().is_none() && !e.dead;
                if !alive {
                    socket.remove_route(e.link.recv_id());
                }
                alive
            });
            !entries.is_empty()
        });
        // Messages no operation asked for, from a peer this lane has no link to any more,
        // are never asked for (a peer that comes back is a new process with new operations).
        if self.lane == 0 {
            let links = &self.links;
            lock(&self.plane.subs).unclaimed.retain(|((peer, _), _)| links.contains_key(peer));
        }
        let lane = self.lane;
        let mut ready = lock(&self.plane.ready);
        ready.retain(|(peer, l)| {
            *l != lane || self.links.get(peer).is_some_and(|v| v.iter().any(|e| e.probed))
        });
        drop(ready);
        let mut stats = lock(&self.plane.stats);
        stats.retain(|(_, l), _| *l != lane);
        for (peer, entries) in self.links.iter_mut() {
            if let Some(e) = best(entries) {
                stats.insert((*peer, lane), e.link.stats());
            }
        }
    }

    /// Sends what every link has to send, one GSO batch at a time.
    async fn flush(&mut self) -> io::Result<()> {
        let gso = self.own.as_ref().map_or_else(|| self.socket.max_gso_segments(), |o| o.max_gso_segments());
        let max_segments = gso.min(65_507 / self.max_datagram.max(1)).max(1);
        let now = Instant::now();
        for (peer, entries) in self.links.iter_mut() {
            for e in entries.iter_mut() {
                while let Some(t) = e.link.poll_transmit(now, &mut self.buf, max_segments) {
                    loop {
                        let sent = match &self.own {
                            Some(own) => own.try_send(*peer, &self.buf[..t.len], t.segment_size),
                            None => self.socket.try_send_plane(*peer, &self.buf[..t.len], t.segment_size),
                        };
                        match sent {
                            Ok(()) => break,
                            Err(err) if err.kind() == io::ErrorKind::WouldBlock => match &self.own {
                                Some(own) => own.writable().await?,
                                None => self.socket.writable().await?,
                            },
                            // The peer's port is closed or the network is down: the
                            // link's loss recovery resends, as for any lost datagram.
                            Err(err) => {
                                tracing::debug!(%peer, "plane send: {err}");
                                break;
                            }
                        }
                    }
                }
                while let Some(ev) = e.link.poll_event() {
                    match ev {
                        Event::Delivered { tag: TAG_PROBE, .. } if !e.silenced => {
                            // The peer acknowledged the full-size probe: both directions work.
                            e.probed = true;
                            lock(&self.plane.ready).insert((*peer, self.lane));
                        }
                        // The message's bytes are dropped with it (a lent ring chunk's loan ends).
                        Event::Delivered { .. } => {}
                        Event::KeysExhausted => {
                            // Its keys cannot be made again from the same connection without
                            // reusing nonces: the link goes, and the ring uses QUIC streams.
                            tracing::warn!(%peer, "plane link used up its keys without a key update; dropped");
                            e.dead = true;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// The link to send on: one whose probe the peer acknowledged, and of those the one with
/// the lowest name. Both ends of two connections (both dialled at once, or one replacing
/// the other) derive the same names, so once both probes are acknowledged they send on the
/// same link, and every datagram from the peer opens with the first keys tried.
fn best(entries: &mut [Entry]) -> Option<&mut Entry> {
    let i = entries
        .iter()
        .enumerate()
        .max_by_key(|(_, e)| (e.probed, std::cmp::Reverse(e.name)))
        .map(|(i, _)| i)?;
    entries.get_mut(i)
}

/// A DATA fragment opened in a receive batch: where its plaintext lies in the batch.
struct Fragment {
    /// Which of the peer's links opened it.
    entry: usize,
    /// Its message's tag.
    tag: u64,
    seq: u64,
    offset: u64,
    total_len: u64,
    start: usize,
    len: usize,
    complete: bool,
}

/// Whether the peer's budget lets this end take a new fragment in: one of a data message
/// already open always (its first fragment opened it within the budget, which reserved
/// its bytes), the first of a data message if it can open within the budget; messages of
/// other tags are not kept (the probe).
fn admit(budget: &Budget, o: &Offer) -> bool {
    !kept(o.tag) || !o.opens || budget.open(o.total_len)
}

/// Whether messages of `tag` are kept and handed on (the probe is not).
fn kept(tag: u64) -> bool {
    matches!(tag, TAG_DATA | TAG_STREAM | TAG_CREDIT)
}

/// Hands a complete message on: its pieces in order, its header taken off; ring data to
/// its operation, a tunnel stream's to the stream.
fn take_message(plane: &Plane, from: SocketAddr, tag: u64, mut pieces: Vec<(u64, Bytes)>) {
    pieces.sort_unstable_by_key(|(offset, _)| *offset);
    let mut parts: Vec<Bytes> = pieces.into_iter().map(|(_, b)| b).filter(|b| !b.is_empty()).collect();
    let mut header = [0u8; MESSAGE_HEADER];
    let mut got = 0;
    let mut first = 0;
    while got < MESSAGE_HEADER {
        let Some(p) = parts.get_mut(first) else {
            tracing::debug!(peer = %from, "plane message of {got} bytes has no header; dropped");
            return;
        };
        let n = (MESSAGE_HEADER - got).min(p.len());
        header[got..got + n].copy_from_slice(&p[..n]);
        got += n;
        let _ = p.split_to(n);
        if p.is_empty() {
            first += 1;
        }
    }
    parts.drain(..first);
    let mut word = [0u8; 8];
    word.copy_from_slice(&header[..8]);
    let op = u64::from_le_bytes(word);
    word.copy_from_slice(&header[8..]);
    let id = u64::from_le_bytes(word);
    lock(&plane.counters).messages += 1;
    match tag {
        TAG_STREAM => plane.streams.data(from, op, id, parts),
        TAG_CREDIT => plane.streams.credit(from, op, id),
        _ => plane.deliver(from, op, (id, parts)),
    }
}
