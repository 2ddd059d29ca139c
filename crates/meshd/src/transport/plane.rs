//! The data plane's driver: one task per lane (`driver`) that owns the plane
//! [`Link`](meshd_proto::plane::Link)s to the peers, seals and sends with GSO through the
//! shared [`DemuxSocket`], opens what the socket queued (GRO batches), runs the links'
//! timers, and hands complete messages to whoever subscribed to them (the ring,
//! `collective::plane_ring`).
//!
//! A link is made for each authenticated connection to a peer, from the connection's TLS
//! exporter (label [`EXPORTER_LABEL`](meshd_proto::plane::keys::EXPORTER_LABEL), context =
//! lane and direction), so only the two ends of that connection hold its keys. Both ends
//! of a link may hold two connections for a while (both connected at once, or one
//! reconnected): each keeps a link per connection, opens a datagram with the one its link
//! id names, and sends on the one whose probe the peer acknowledged and whose name is
//! lowest.
//!
//! A message on the plane is `[op u64 LE][id u64 LE][payload]`; the plane link's tag says
//! whether it is data ([`TAG_DATA`]) or the probe each link sends first ([`TAG_PROBE`]),
//! whose acknowledgement proves that datagrams get through both ways. What the plane holds
//! for a peer (messages being reassembled, complete ones not taken yet) is bounded by its
//! [`budget`]: past it, datagrams are dropped unacknowledged.

mod budget;
mod driver;
pub mod streams;

use super::socket::{DemuxSocket, LaneSocket, PlaneBatch};
use budget::Budget;
pub use budget::{MAX_OPEN_PER_PEER, PEER_BUDGET};
use bytes::Bytes;
use driver::Driver;
use meshd_proto::plane::LinkStats;
use meshd_proto::plane::link::{MAX_DATAGRAM, MIN_DATAGRAM};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

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
/// Plane message tag of a ring operation's credit: `[operation id u64 LE][payload bytes
/// of its chunks the sender may have sent in all, u64 LE]` ([`RING_WINDOW`]).
pub const TAG_RING_CREDIT: u64 = 4;
/// Payload bytes of a ring operation's chunks a node may send on the plane to the next
/// node before the next node granted more: the next node grants another window beyond
/// what its ring took once less than half a window is left. What a peer's ring has not
/// taken yet, held by the plane, is so bounded by about this (and a chunk per lane),
/// not by the peer's receive budget.
pub const RING_WINDOW: u64 = 8 << 20;
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

/// A received data message.
#[derive(Debug)]
pub enum Delivery {
    /// The transfer id and its payload, in order, as the pieces of the receive batches it
    /// was opened in (never copied after the kernel's copy out).
    Parts(u64, Vec<Bytes>),
    /// A message whose subscription's [`DirectSink`] claimed it: the sink took its bytes
    /// as each datagram opened, except `rest` (payload offset, bytes: what it could not
    /// take, in no particular order; normally none). `len` is the payload's length.
    Applied { id: u64, len: usize, rest: Vec<(usize, Bytes)> },
}

/// Where a subscription's messages may go as their datagrams open, instead of being held
/// until complete: the ring reduces each datagram's bytes straight into its buffer while
/// they are still in cache. Called from a lane's driver.
pub trait DirectSink: Send + Sync {
    /// Whether the sink takes the bytes of message `id`, of `len` payload bytes, itself:
    /// its claim, or `None` (the message is then delivered as [`Delivery::Parts`]). A
    /// sink claims an id at most once.
    fn claim(&self, id: u64, len: usize) -> Option<Claim>;
    /// Takes `bytes` at payload offset `offset` of a claimed message (each byte once).
    /// `false` when it cannot (misaligned, out of range, the operation ended): the bytes
    /// are then kept and delivered in [`Delivery::Applied`]'s `rest`.
    fn apply(&self, claim: &Claim, offset: usize, bytes: &[u8]) -> bool;
}

/// A message a [`DirectSink`] claimed: its transfer id and where its payload goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// The transfer id.
    pub id: u64,
    /// Where the payload starts in the sink's memory.
    pub start: usize,
    /// The payload's length.
    pub len: usize,
    /// The sink's own note on the message (what to do with its bytes).
    pub kind: u8,
}

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
    /// Bytes of fragments a subscription's sink took as they opened (never held).
    pub applied: u64,
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
    /// (peer, op) -> the subscription's sink, where it has one.
    sinks: HashMap<(SocketAddr, u64), Arc<dyn DirectSink>>,
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
    /// (next node, op) -> the credit it granted this node's ring operation sending to it.
    ring_credits: Arc<Mutex<RingCredits>>,
}

/// (next node, op) -> the credit it granted this node's ring operation sending to it.
type RingCredits = HashMap<(SocketAddr, u64), tokio::sync::watch::Sender<u64>>;

/// What a ring operation may send on the plane to the next node: the credit it granted
/// ([`RING_WINDOW`] at first). Dropping it ends the operation's registration.
pub struct RingCredit {
    plane: Plane,
    key: (SocketAddr, u64),
    granted: tokio::sync::watch::Receiver<u64>,
}

impl RingCredit {
    /// The credit: payload bytes the operation may have sent in all. `changed()` wakes
    /// on a new grant.
    pub fn granted(&self) -> tokio::sync::watch::Receiver<u64> {
        self.granted.clone()
    }
}

impl std::fmt::Debug for RingCredit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingCredit")
            .field("key", &self.key)
            .field("granted", &*self.granted.borrow())
            .finish()
    }
}

impl Drop for RingCredit {
    fn drop(&mut self) {
        lock(&self.plane.ring_credits).remove(&self.key);
    }
}

impl std::fmt::Debug for Plane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plane").finish_non_exhaustive()
    }
}

/// Raises a credit to `upto`, waking its watchers only when it grew: credits only grow (a
/// stale or reordered grant changes nothing).
fn raise_credit(credit: &tokio::sync::watch::Sender<u64>, upto: u64) {
    credit.send_if_modified(|c| {
        let grew = upto > *c;
        *c = (*c).max(upto);
        grew
    });
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
            ring_credits: Arc::default(),
        };
        let mut own = own.into_iter().map(Arc::new);
        for (lane, (cmd_rx, batches)) in rxs.into_iter().zip(batches).enumerate() {
            let driver = Driver::new(lane as u8, socket.clone(), own.next(), max_datagram, plane.clone());
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

    /// Registers ring operation `op`'s sending to `next`: the credit `next` grants it.
    pub fn ring_credit(&self, next: SocketAddr, op: u64) -> RingCredit {
        let key = (super::canonical(next), op);
        let (tx, granted) = tokio::sync::watch::channel(RING_WINDOW);
        lock(&self.ring_credits).insert(key, tx);
        RingCredit { plane: self.clone(), key, granted }
    }

    /// Grants `prev`'s ring operation `op` credit up to `upto` payload bytes in all.
    pub fn grant_ring(&self, prev: SocketAddr, op: u64, upto: u64) -> Result<(), String> {
        self.send_tagged(prev, 0, TAG_RING_CREDIT, op, upto, Bytes::new())
    }

    /// A ring credit from `from`: raises the registered operation's credit (a credit of an
    /// operation this node is not sending, or one below what it has, changes nothing).
    fn ring_granted(&self, from: SocketAddr, op: u64, upto: u64) {
        if let Some(tx) = lock(&self.ring_credits).get(&(from, op)) {
            raise_credit(tx, upto);
        }
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

    /// [`Plane::subscribe`], with a sink that may take the messages' bytes as their
    /// datagrams open (messages that came before are delivered as they were).
    pub fn subscribe_direct(
        &self,
        peer: SocketAddr,
        op: u64,
        sink: Arc<dyn DirectSink>,
    ) -> mpsc::UnboundedReceiver<Delivery> {
        let rx = self.subscribe(peer, op);
        lock(&self.subs).sinks.insert((super::canonical(peer), op), sink);
        rx
    }

    /// The sink of `(from, op)`'s subscription, if it has one.
    fn sink(&self, from: SocketAddr, op: u64) -> Option<Arc<dyn DirectSink>> {
        lock(&self.subs).sinks.get(&(from, op)).cloned()
    }

    /// Ends a subscription: later messages of the operation are dropped.
    pub fn unsubscribe(&self, peer: SocketAddr, op: u64) {
        let key = (super::canonical(peer), op);
        let mut subs = lock(&self.subs);
        subs.open.remove(&key);
        subs.sinks.remove(&key);
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
            subs.sinks.remove(&key);
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
/// Hands a complete message on: its pieces in order, its header taken off; ring data to
/// its operation, a tunnel stream's to the stream.
/// A complete message that a sink claimed (see [`DirectSink`]): delivered with what the
/// sink could not take, by payload offset (the message's header is not part of it).
fn take_applied(plane: &Plane, from: SocketAddr, op: u64, claim: Claim, pieces: Vec<(u64, Bytes)>) {
    let rest = pieces
        .into_iter()
        .filter_map(|(offset, mut b)| {
            let offset = usize::try_from(offset).ok()?;
            let payload = match offset.checked_sub(MESSAGE_HEADER) {
                Some(at) => at,
                None => {
                    let _ = b.split_to((MESSAGE_HEADER - offset).min(b.len()));
                    0
                }
            };
            (!b.is_empty()).then_some((payload, b))
        })
        .collect();
    lock(&plane.counters).messages += 1;
    plane.deliver(from, op, Delivery::Applied { id: claim.id, len: claim.len, rest });
}

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
        TAG_RING_CREDIT => plane.ring_granted(from, op, id),
        _ => plane.deliver(from, op, Delivery::Parts(id, parts)),
    }
}
