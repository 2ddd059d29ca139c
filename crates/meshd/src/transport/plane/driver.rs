//! A lane's driver: the task that owns the lane's plane [`Link`]s to the peers, seals and
//! sends, opens what the socket queued, runs the links' timers and reassembles messages,
//! which [`take_message`] hands on.

use super::budget::{self, Budget, BufferPool, MAX_OPEN_PER_PEER};
use super::{
    Claim, Cmd, DirectSink, MAX_MESSAGE, MESSAGE_HEADER, Plane, SILENCE, TAG_CREDIT, TAG_DATA, TAG_PROBE,
    TAG_RING_CREDIT, TAG_STREAM, lock, take_applied, take_message,
};
use crate::transport::canonical;
use crate::transport::socket::{DemuxSocket, LANE_BATCH, LANE_BUF, LaneSocket, PlaneBatch, Received};
use bytes::Bytes;
use meshd_proto::plane::incoming::SeqMap;
use meshd_proto::plane::keys::{EXPORTER_LABEL, LINK_NAME_CONTEXT, exporter_context};
use meshd_proto::plane::packet::link_id_of;
use meshd_proto::plane::{Event, Link, LinkConfig, LinkKeys, Offer, PlaneError};
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Receive calls one wakeup of a lane's own socket makes at most before the driver looks
/// at its other work (sends, timers).
const OWN_READS: usize = 8;

/// Receive buffers a lane keeps for reuse once the ring dropped every piece of them (4 MiB
/// of [`LANE_BUF`]s: a few chunks' worth, the churn between one ring step and the next).
const POOLED_BUFFERS: usize = 64;

struct Entry {
    conn: quinn::Connection,
    /// The name both ends derive alike from the connection (see [`best`]).
    name: u64,
    link: Link,
    /// What the plane holds for the peer's host (shared by its links and lanes).
    budget: Arc<Budget>,
    /// Data messages being reassembled, by message number (numbers of opened datagrams,
    /// as many as the link keeps open: the cheap hash of [`SeqMap`] serves).
    partial: SeqMap<Partial>,
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
    /// The sink that takes the message's bytes as they open, its claim and the operation,
    /// when its subscription has one and claimed it (see [`DirectSink`]).
    target: Option<(Arc<dyn DirectSink>, Claim, u64)>,
}

impl Partial {
    fn new(total_len: u64) -> Partial {
        Partial { pieces: Vec::new(), missing: total_len, target: None }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        // Messages that will never finish give their reservations back.
        for p in self.partial.values() {
            self.budget.close(p.missing);
        }
    }
}

pub(super) struct Driver {
    lane: u8,
    socket: Arc<DemuxSocket>,
    /// This lane's own socket in the port's group, when it has one.
    own: Option<Arc<LaneSocket>>,
    /// Receive buffers for `own`.
    rbufs: Vec<Vec<u8>>,
    /// Where `own`'s buffers come from and go back to once nothing holds them.
    pool: Arc<BufferPool>,
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
    /// The driver of lane `lane` over `socket` (and its `own` socket, when it has one).
    pub(super) fn new(
        lane: u8,
        socket: Arc<DemuxSocket>,
        own: Option<Arc<LaneSocket>>,
        max_datagram: usize,
        plane: Plane,
    ) -> Driver {
        Driver {
            lane,
            socket,
            own,
            rbufs: Vec::new(),
            pool: Arc::new(BufferPool::new(LANE_BUF, POOLED_BUFFERS)),
            got: Vec::new(),
            max_datagram,
            links: HashMap::new(),
            plane,
            buf: Vec::new(),
            fragments: Vec::new(),
        }
    }

    pub(super) async fn run(
        mut self,
        mut cmds: mpsc::UnboundedReceiver<Cmd>,
        mut batches: mpsc::Receiver<PlaneBatch>,
    ) {
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
        let peer = canonical(conn.remote_address());
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
            partial: SeqMap::default(),
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
                        applied: false,
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
        // Fragments of messages a sink claimed go to it now, while they are in cache.
        let mut applied = 0;
        for f in fragments.iter_mut().filter(|f| f.tag == TAG_DATA) {
            let e = &mut entries[f.entry];
            let p = e.partial.entry(f.seq).or_insert_with(|| Partial::new(f.total_len));
            if p.target.is_none() && p.pieces.is_empty() && f.offset == 0 && f.len >= MESSAGE_HEADER {
                // The message's first fragment: its header names the operation and the
                // transfer, so the subscription's sink (if any) can claim it.
                let head = &data[f.start..f.start + MESSAGE_HEADER];
                let op = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
                let id = u64::from_le_bytes(head[8..].try_into().unwrap_or_default());
                let payload = usize::try_from(f.total_len).unwrap_or(usize::MAX) - MESSAGE_HEADER;
                p.target = self
                    .plane
                    .sink(batch.from, op)
                    .and_then(|sink| sink.claim(id, payload).map(|claim| (sink, claim, op)));
            }
            let Some((sink, claim, _)) = &p.target else { continue };
            let offset = usize::try_from(f.offset).unwrap_or(usize::MAX);
            let skip = MESSAGE_HEADER.saturating_sub(offset).min(f.len);
            let at = offset.saturating_sub(MESSAGE_HEADER);
            if !sink.apply(claim, at, &data[f.start + skip..f.start + f.len]) {
                continue;
            }
            f.applied = true;
            applied += f.len as u64;
            e.budget.arrived(f.len as u64);
            p.missing = p.missing.saturating_sub(f.len as u64);
            if f.complete {
                if let Some(p) = e.partial.remove(&f.seq) {
                    e.budget.close(p.missing);
                    if let Some((_, claim, op)) = p.target {
                        take_applied(&self.plane, batch.from, op, claim, p.pieces);
                    }
                }
            }
        }
        if applied > 0 {
            fragments.retain(|f| !f.applied);
            lock(&self.plane.counters).applied += applied;
        }
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
            sources.push((g, budget::hold(own, &budget, None), true));
        }
        let spare = match keeper {
            Some(g) => {
                sources.push((g, budget::hold(data, &budget, Some(&self.pool)), false));
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
                let p = e.partial.entry(f.seq).or_insert_with(|| Partial::new(f.total_len));
                p.missing = p.missing.saturating_sub(f.len as u64);
                p.pieces.push((f.offset, piece));
                if f.complete {
                    if let Some(mut p) = e.partial.remove(&f.seq) {
                        e.budget.close(p.missing);
                        let pieces = std::mem::take(&mut p.pieces);
                        match p.target.take() {
                            Some((_, claim, op)) => take_applied(&self.plane, batch.from, op, claim, pieces),
                            None => take_message(&self.plane, batch.from, f.tag, pieces),
                        }
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
            // Every slot a kept buffer left empty gets a recycled one (not a fresh
            // allocation in `recv`).
            self.rbufs.resize_with(LANE_BATCH, Vec::new);
            for b in self.rbufs.iter_mut().filter(|b| b.capacity() < LANE_BUF) {
                *b = self.pool.take();
            }
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
                    self.receive(PlaneBatch { from: canonical(from), stride, data })
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
    /// Taken by its message's sink (see [`DirectSink`]): not held.
    applied: bool,
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
    matches!(tag, TAG_DATA | TAG_STREAM | TAG_CREDIT | TAG_RING_CREDIT)
}
