//! The data plane's driver: one task per node that owns the plane [`Link`]s to the peers,
//! seals and sends with GSO through the shared [`DemuxSocket`], opens what the socket
//! queued (GRO batches), runs the links' timers, and hands complete messages to whoever
//! subscribed to them (the ring, `collective::plane_ring`).
//!
//! A link is made for each authenticated connection to a peer, from the connection's TLS
//! exporter (label [`EXPORTER_LABEL`], context = lane and direction), so only the two ends
//! of that connection hold its keys. Both ends of a link may hold two connections for a
//! while (both connected at once, or one reconnected): each keeps a link per connection,
//! opens a datagram with the one whose keys fit, and sends on the one whose probe the peer
//! acknowledged and that last heard from it.
//!
//! A message on the plane is `[op u64 LE][id u64 LE][payload]`; the plane link's tag says
//! whether it is data ([`TAG_DATA`]) or the probe each link sends first ([`TAG_PROBE`]),
//! whose acknowledgement proves that datagrams get through both ways.

use super::socket::{DemuxSocket, PlaneBatch};
use bytes::Bytes;
use meshd_proto::plane::link::{MAX_DATAGRAM, MIN_DATAGRAM};
use meshd_proto::plane::{Event, Link, LinkConfig, LinkKeys, LinkStats, PlaneError, Received};
use std::collections::{HashMap, HashSet};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

use meshd_proto::plane::keys::{EXPORTER_LABEL, LINK_NAME_CONTEXT, exporter_context};
/// Plane message tag of ring data.
pub const TAG_DATA: u64 = 0;
/// Plane message tag of a link's first message.
pub const TAG_PROBE: u64 = 1;
/// Bytes before the payload of a data message: op id and transfer id.
pub const MESSAGE_HEADER: usize = 16;
/// Operations whose messages are kept per peer before anyone asked for them: a neighbour
/// is at most one operation ahead; older ones belong to operations this node gave up on.
const UNCLAIMED_OPS_PER_PEER: usize = 4;
/// Largest plane message this end accepts: a ring chunk and its header, with room.
const MAX_MESSAGE: u64 = 1 << 30;
/// How long a ready link may have packets in flight with nothing acknowledged before it
/// counts as no longer getting through: it is no longer ready, and ring operations to the
/// peer use QUIC streams from the next one (the running one fails, naming the cause).
pub const SILENCE: Duration = Duration::from_secs(5);

/// Datagrams in a row a peer's link must open, tried first, before it opens the next ones
/// in place rather than in a copy (see `open_with`).
const CONFIDENT: u32 = 64;

/// A received data message: the transfer id and its payload, in order, as the pieces of
/// the receive batches it was opened in (never copied after the kernel's copy out).
pub type Delivery = (u64, Vec<Bytes>);

enum Cmd {
    AddLink { conn: quinn::Connection, client: bool },
    Send { to: SocketAddr, head: [u8; MESSAGE_HEADER], body: Bytes },
}

/// Counters of the plane, for diagnostics and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PlaneCounters {
    /// Datagrams that opened under some link's keys.
    pub opened: u64,
    /// Datagrams from a routed address that no link of it could open.
    pub refused: u64,
    /// Data messages delivered complete.
    pub messages: u64,
    /// Plane datagrams the socket dropped: from an address without a plane link.
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
    pub fn start(
        socket: Arc<DemuxSocket>,
        batches: Vec<mpsc::Receiver<PlaneBatch>>,
        max_datagram: usize,
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
        };
        for (lane, (cmd_rx, batches)) in rxs.into_iter().zip(batches).enumerate() {
            let driver = Driver {
                lane: lane as u8,
                socket: socket.clone(),
                max_datagram,
                links: HashMap::new(),
                plane: plane.clone(),
                buf: Vec::new(),
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
        let mut head = [0u8; MESSAGE_HEADER];
        head[..8].copy_from_slice(&op.to_le_bytes());
        head[8..].copy_from_slice(&id.to_le_bytes());
        self.cmds[lane % self.cmds.len()]
            .send(Cmd::Send { to: super::canonical(to), head, body: payload })
            .map_err(|_| "the data plane stopped".to_string())
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
        let s = &self.socket.counters;
        c.unknown_source = s.plane_unknown.load(std::sync::atomic::Ordering::Relaxed);
        c.overflow = s.plane_overflow.load(std::sync::atomic::Ordering::Relaxed);
        c.batches = s.plane_batches.load(std::sync::atomic::Ordering::Relaxed);
        c
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
    /// Message number -> its pieces so far: (offset in the message, bytes).
    partial: HashMap<u64, Vec<(u64, Bytes)>>,
    last_heard: Option<Instant>,
    /// Datagrams in a row this link opened as the first one tried.
    streak: u32,
    /// Whether the peer acknowledged the probe.
    probed: bool,
    /// Stopped getting through after it was ready: never ready again.
    silenced: bool,
    /// Used up its keys: removed at the next prune.
    dead: bool,
}

struct Driver {
    lane: u8,
    socket: Arc<DemuxSocket>,
    max_datagram: usize,
    links: HashMap<SocketAddr, Vec<Entry>>,
    plane: Plane,
    buf: Vec<u8>,
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
                    Some(Cmd::Send { to, head, body }) => self.send(to, &head, body),
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
        self.socket.add_route(peer);
        self.links.entry(peer).or_default().push(Entry {
            conn,
            name: u64::from_le_bytes(name),
            link,
            partial: HashMap::new(),
            last_heard: None,
            streak: 0,
            probed: false,
            silenced: false,
            dead: false,
        });
    }

    fn send(&mut self, to: SocketAddr, head: &[u8], body: Bytes) {
        let Some(e) = self.links.get_mut(&to).and_then(|v| best(v)) else {
            tracing::debug!(peer = %to, "no plane link; message dropped");
            return;
        };
        if let Err(err) = e.link.send_parts(TAG_DATA, head, body) {
            tracing::warn!(peer = %to, "plane send: {err}");
        }
    }

    /// Opens a receive batch in place, then hands its fragments on as pieces of the one
    /// buffer (the plaintext is not copied again: the ring reduces straight from it).
    fn receive(&mut self, batch: PlaneBatch) {
        let Some(entries) = self.links.get_mut(&batch.from) else { return };
        let now = Instant::now();
        let mut data = batch.data;
        let stride = batch.stride.max(1);
        let (mut opened, mut refused) = (0, 0);
        let mut fragments = Vec::new();
        for (i, datagram) in data.chunks_mut(stride).enumerate() {
            match open_with(entries, datagram, now) {
                Ok(Some(mut f)) => {
                    opened += 1;
                    f.start += i * stride;
                    fragments.push(f);
                }
                Ok(None) => opened += 1,
                Err(_) => refused += 1,
            }
        }
        let mut c = lock(&self.plane.counters);
        c.opened += opened;
        c.refused += refused;
        drop(c);
        if fragments.is_empty() {
            return;
        }
        let data = Bytes::from(data);
        for f in fragments {
            let piece = data.slice(f.start..f.start + f.len);
            let Some(e) = entries.get_mut(f.entry) else { continue };
            e.partial.entry(f.seq).or_default().push((f.offset, piece));
            if f.complete {
                if let Some(pieces) = e.partial.remove(&f.seq) {
                    take_message(&self.plane, batch.from, pieces);
                }
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
        self.links.retain(|peer, entries| {
            entries.retain(|e| {
                let alive = e.conn.close_reason().is_none() && !e.dead;
                if !alive {
                    socket.remove_route(*peer);
                }
                alive
            });
            !entries.is_empty()
        });
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
        let max_segments = self.socket.max_gso_segments().min(65_507 / self.max_datagram.max(1)).max(1);
        let now = Instant::now();
        for (peer, entries) in self.links.iter_mut() {
            for e in entries.iter_mut() {
                while let Some(t) = e.link.poll_transmit(now, &mut self.buf, max_segments) {
                    loop {
                        match self.socket.try_send_plane(*peer, &self.buf[..t.len], t.segment_size) {
                            Ok(()) => break,
                            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                                self.socket.writable().await?
                            }
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
    seq: u64,
    offset: u64,
    start: usize,
    len: usize,
    complete: bool,
}

/// Opens `datagram` in place with whichever of the peer's links holds its keys and takes
/// in what it carries; returns the ring data fragment it carried, if any (`start` relative
/// to the datagram).
fn open_with(
    entries: &mut [Entry],
    datagram: &mut [u8],
    now: Instant,
) -> Result<Option<Fragment>, PlaneError> {
    let n = entries.len();
    // The link that last opened one is tried first: with both ends sending on the same link
    // (`best`), the first try opens it, and a failed AEAD open (a whole decryption) is rare.
    let first = (0..n).max_by_key(|&k| (entries[k].last_heard, std::cmp::Reverse(k))).unwrap_or(0);
    let order = std::iter::once(first).chain((0..n).filter(|&k| k != first));
    // Once the first link opened [`CONFIDENT`] in a row, it opens in place, without a copy:
    // a datagram of another link is then lost (and resent by its sender, opened by a copy).
    let confident = entries[first].streak >= CONFIDENT;
    let mut last = PlaneError::Auth;
    for (tried, k) in order.enumerate() {
        let e = &mut entries[k];
        if tried + 1 == n || (tried == 0 && confident) {
            return open_one(e, k, tried, datagram, now);
        }
        // A failed open leaves the buffer zeroed: every other try opens a copy (two links to
        // one peer exist while a connection is being replaced, or both nodes dialled at
        // once), which goes back into the batch once it opened.
        let mut copy = datagram.to_vec();
        match open_one(e, k, tried, &mut copy, now) {
            Ok(f) => {
                datagram.copy_from_slice(&copy);
                return Ok(f);
            }
            Err(err) => last = err,
        }
    }
    Err(last)
}

/// Opens `buf` in place with link `k` of the peer (the `tried`-th one tried) and keeps its
/// record: when it last heard, how many it opened in a row as the first one tried.
/// Returns the ring data fragment it carried, located within `buf`.
fn open_one(
    e: &mut Entry,
    k: usize,
    tried: usize,
    buf: &mut [u8],
    now: Instant,
) -> Result<Option<Fragment>, PlaneError> {
    let base = buf.as_ptr() as usize;
    match e.link.handle_datagram(buf, now) {
        Ok(r) => {
            e.last_heard = Some(now);
            e.streak = if tried == 0 { e.streak.saturating_add(1) } else { 1 };
            Ok(r.and_then(|r| fragment_at(k, base, &r)))
        }
        Err(err) => {
            e.streak = 0;
            Err(err)
        }
    }
}

/// The ring data fragment `r`, located within the datagram that starts at address `base`.
fn fragment_at(entry: usize, base: usize, r: &Received<'_>) -> Option<Fragment> {
    (r.tag == TAG_DATA).then(|| Fragment {
        entry,
        seq: r.seq,
        offset: r.offset,
        start: r.data.as_ptr() as usize - base,
        len: r.data.len(),
        complete: r.complete,
    })
}

/// Hands a complete message on: its pieces in order, its header taken off.
fn take_message(plane: &Plane, from: SocketAddr, mut pieces: Vec<(u64, Bytes)>) {
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
    plane.deliver(from, op, (id, parts));
}
