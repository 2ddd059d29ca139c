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
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

use meshd_proto::plane::keys::{EXPORTER_LABEL, exporter_context};
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
/// Message buffers kept for reuse.
const POOL: usize = 64;

/// A received data message: the transfer id and its payload.
pub type Delivery = (u64, Bytes);

enum Cmd {
    AddLink { conn: quinn::Connection, client: bool },
    Send { to: SocketAddr, message: Vec<u8> },
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
}

#[derive(Default)]
struct Subs {
    /// (peer, op) -> where its messages go.
    open: HashMap<(SocketAddr, u64), mpsc::UnboundedSender<Delivery>>,
    /// Messages that came before anyone asked, per (peer, op), oldest op first.
    unclaimed: Vec<((SocketAddr, u64), Vec<Delivery>)>,
}

/// A handle on the node's data plane. Cheap to clone.
#[derive(Clone)]
pub struct Plane {
    cmd: mpsc::UnboundedSender<Cmd>,
    subs: Arc<Mutex<Subs>>,
    ready: Arc<Mutex<HashMap<SocketAddr, bool>>>,
    counters: Arc<Mutex<PlaneCounters>>,
    socket: Arc<DemuxSocket>,
    /// Message buffers the links handed back, for the next sends.
    pool: Arc<Mutex<Vec<Vec<u8>>>>,
    /// Received messages' buffers the ring dropped, for the next messages.
    received: Arc<Mutex<Vec<Vec<u8>>>>,
    /// Each peer's sending link's counters, as of the driver's last look (every 500 ms).
    stats: Arc<Mutex<HashMap<SocketAddr, LinkStats>>>,
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
    /// Starts the driver over `socket`, reading what it queued from `batches`. Datagrams
    /// carry at most `max_datagram` bytes of UDP payload.
    pub fn start(
        socket: Arc<DemuxSocket>,
        batches: mpsc::Receiver<PlaneBatch>,
        max_datagram: usize,
    ) -> Plane {
        let max_datagram = max_datagram.clamp(MIN_DATAGRAM, MAX_DATAGRAM);
        let (cmd, cmd_rx) = mpsc::unbounded_channel();
        let plane = Plane {
            cmd,
            subs: Arc::default(),
            ready: Arc::default(),
            counters: Arc::default(),
            socket: socket.clone(),
            pool: Arc::default(),
            received: Arc::default(),
            stats: Arc::default(),
        };
        let driver =
            Driver { socket, max_datagram, links: HashMap::new(), plane: plane.clone(), buf: Vec::new() };
        tokio::spawn(driver.run(cmd_rx, batches));
        plane
    }

    /// Makes a link for an authenticated connection (`client`: this end connected).
    pub fn add_link(&self, conn: quinn::Connection, client: bool) {
        let _ = self.cmd.send(Cmd::AddLink { conn, client });
    }

    /// Whether a link to `peer` had its full-size probe acknowledged: datagrams get
    /// through both ways.
    pub fn is_ready(&self, peer: SocketAddr) -> bool {
        lock(&self.ready).get(&super::canonical(peer)).copied().unwrap_or(false)
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

    /// Queues transfer `id` of operation `op` for `to`; the plane resends until it arrives.
    pub fn send(&self, to: SocketAddr, op: u64, id: u64, payload: &[u8]) -> Result<(), String> {
        // A buffer a link handed back: written again rather than allocated and faulted in.
        let mut message = lock(&self.pool).pop().unwrap_or_default();
        message.reserve(MESSAGE_HEADER + payload.len());
        message.extend_from_slice(&op.to_le_bytes());
        message.extend_from_slice(&id.to_le_bytes());
        message.extend_from_slice(payload);
        self.cmd
            .send(Cmd::Send { to: super::canonical(to), message })
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

    /// The counters and estimates of the link this node sends to `peer` on, as of at most
    /// half a second ago.
    pub fn link_stats(&self, peer: SocketAddr) -> Option<LinkStats> {
        lock(&self.stats).get(&super::canonical(peer)).cloned()
    }

    /// The counters so far, the socket's included.
    pub fn counters(&self) -> PlaneCounters {
        let mut c = lock(&self.counters).clone();
        let s = &self.socket.counters;
        c.unknown_source = s.plane_unknown.load(std::sync::atomic::Ordering::Relaxed);
        c.overflow = s.plane_overflow.load(std::sync::atomic::Ordering::Relaxed);
        c
    }

    /// A buffer of `len` bytes for a message being received: one the ring gave back if
    /// it is large enough, its old bytes left in place (every byte of a message arrives
    /// exactly once before it is handed on), else a new one.
    fn message_buffer(&self, len: usize) -> Vec<u8> {
        let mut buf = lock(&self.received).pop().filter(|b| b.capacity() >= len).unwrap_or_default();
        if buf.len() >= len {
            buf.truncate(len);
        } else {
            buf.resize(len, 0);
        }
        buf
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

/// A received message's buffer, back to the pool when the ring drops the message (a
/// fresh 1 MiB buffer per chunk costs a page fault per 4 KiB and a memset).
struct Recycled {
    buf: Vec<u8>,
    pool: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let mut pool = lock(&self.pool);
        if pool.len() < POOL {
            pool.push(std::mem::take(&mut self.buf));
        }
    }
}

/// One link: the connection it came from, the link, and messages being reassembled.
struct Entry {
    conn: quinn::Connection,
    link: Link,
    /// Message number -> its bytes so far.
    partial: HashMap<u64, Vec<u8>>,
    last_heard: Option<Instant>,
    /// Whether the peer acknowledged the probe.
    probed: bool,
    /// Used up its keys: removed at the next prune.
    dead: bool,
}

struct Driver {
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
                    Some(Cmd::Send { to, message }) => self.send(to, message),
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
        let Some(keys) = link_keys(&conn, client, 0) else {
            tracing::debug!(%peer, "no TLS keying material for a plane link");
            return;
        };
        let mut config = LinkConfig::new(keys, 0);
        config.max_datagram = self.max_datagram;
        config.max_message_len = MAX_MESSAGE;
        let mut link = match Link::new(config, Instant::now()) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(%peer, "plane link: {e}");
                return;
            }
        };
        // The probe, a full-size datagram: its acknowledgement, the first thing heard
        // back, shows that datagrams of this size get through both ways (a path that
        // drops them leaves the link silent, and the ring on QUIC streams).
        let _ = link.send(TAG_PROBE, vec![0; self.max_datagram]);
        self.socket.add_route(peer);
        self.links.entry(peer).or_default().push(Entry {
            conn,
            link,
            partial: HashMap::new(),
            last_heard: None,
            probed: false,
            dead: false,
        });
    }

    fn send(&mut self, to: SocketAddr, message: Vec<u8>) {
        let Some(e) = self.links.get_mut(&to).and_then(|v| best(v)) else {
            tracing::debug!(peer = %to, "no plane link; message dropped");
            return;
        };
        if let Err(err) = e.link.send(TAG_DATA, message) {
            tracing::warn!(peer = %to, "plane send: {err}");
        }
    }

    fn receive(&mut self, batch: PlaneBatch) {
        let Some(entries) = self.links.get_mut(&batch.from) else { return };
        let now = Instant::now();
        let mut data = batch.data;
        let (mut opened, mut refused) = (0, 0);
        for datagram in data.chunks_mut(batch.stride.max(1)) {
            match open_with(entries, datagram, now, &self.plane, batch.from) {
                Ok(()) => opened += 1,
                Err(_) => refused += 1,
            }
        }
        let mut c = lock(&self.plane.counters);
        c.opened += opened;
        c.refused += refused;
        drop(c);
    }

    fn prune(&mut self) {
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
        let mut ready = lock(&self.plane.ready);
        ready.retain(|peer, _| self.links.get(peer).is_some_and(|v| v.iter().any(|e| e.probed)));
        drop(ready);
        let mut stats = lock(&self.plane.stats);
        stats.clear();
        for (peer, entries) in self.links.iter_mut() {
            if let Some(e) = best(entries) {
                stats.insert(*peer, e.link.stats());
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
                        Event::Delivered { tag: TAG_PROBE, .. } => {
                            // The peer acknowledged the full-size probe: both directions work.
                            e.probed = true;
                            lock(&self.plane.ready).insert(*peer, true);
                        }
                        Event::Delivered { mut buffer, .. } => {
                            let mut pool = lock(&self.plane.pool);
                            if pool.len() < POOL {
                                buffer.clear();
                                pool.push(buffer);
                            }
                        }
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

/// The link whose probe the peer acknowledged and that last heard from it (the newest if
/// none did).
fn best(entries: &mut [Entry]) -> Option<&mut Entry> {
    let i = entries.iter().enumerate().max_by_key(|(i, e)| (e.probed, e.last_heard, *i)).map(|(i, _)| i)?;
    entries.get_mut(i)
}

/// Opens `datagram` with whichever of the peer's links holds its keys and takes in what
/// it carries.
fn open_with(
    entries: &mut [Entry],
    datagram: &mut [u8],
    now: Instant,
    plane: &Plane,
    from: SocketAddr,
) -> Result<(), PlaneError> {
    let n = entries.len();
    let mut last = PlaneError::Auth;
    for (k, e) in entries.iter_mut().enumerate() {
        // A failed open leaves the buffer unspecified: every try but the last opens a copy
        // (two links to one peer exist only while a connection is being replaced).
        let mut copy;
        let target: &mut [u8] = if k + 1 == n {
            &mut *datagram
        } else {
            copy = datagram.to_vec();
            &mut copy
        };
        match e.link.handle_datagram(target, now) {
            Ok(r) => {
                e.last_heard = Some(now);
                if let Some(r) = r {
                    take_fragment(&mut e.partial, plane, from, &r);
                }
                return Ok(());
            }
            Err(err) => last = err,
        }
    }
    Err(last)
}

/// Copies a fragment into its message (the one copy of the plaintext) and hands the
/// message on once complete.
fn take_fragment(partial: &mut HashMap<u64, Vec<u8>>, plane: &Plane, from: SocketAddr, r: &Received<'_>) {
    if r.tag != TAG_DATA {
        return;
    }
    let msg = partial.entry(r.seq).or_insert_with(|| plane.message_buffer(r.total_len as usize));
    let start = r.offset as usize;
    if let Some(dst) = msg.get_mut(start..start + r.data.len()) {
        dst.copy_from_slice(r.data);
    }
    if !r.complete {
        return;
    }
    let Some(msg) = partial.remove(&r.seq) else { return };
    if msg.len() < MESSAGE_HEADER {
        tracing::debug!(peer = %from, "plane message of {} bytes has no header; dropped", msg.len());
        return;
    }
    let mut word = [0u8; 8];
    word.copy_from_slice(&msg[..8]);
    let op = u64::from_le_bytes(word);
    word.copy_from_slice(&msg[8..16]);
    let id = u64::from_le_bytes(word);
    let payload =
        Bytes::from_owner(Recycled { buf: msg, pool: plane.received.clone() }).slice(MESSAGE_HEADER..);
    lock(&plane.counters).messages += 1;
    plane.deliver(from, op, (id, payload));
}
