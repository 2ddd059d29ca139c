//! The node's one UDP socket, shared by quinn and the data plane (docs/PROTOCOL.md, "The
//! data plane").
//!
//! quinn's endpoint runs over [`DemuxSocket`] as its [`quinn::AsyncUdpSocket`]. Every
//! receive batch (GRO included) is split by the first byte of each datagram: QUIC packets
//! (fixed bit set; greasing is off on meshd's endpoints) stay in quinn's buffers, plane
//! datagrams go to the plane driver's bounded queue. A plane datagram goes there only if
//! its link id is one a link of this node expects, from the address that link's peer has:
//! any other (a stranger's, or a spoofer's with a member's address but not the id, which
//! it never sees) is dropped after one table lookup, before it is copied or queued: no
//! allocation, no cryptography, no reply, and no room taken from the member's real
//! datagrams in the queue.

use meshd_proto::plane::packet::link_id_of;
use quinn::udp::{RecvMeta, Transmit, UdpSocketState};
use std::collections::HashMap;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll, ready};
use tokio::io::Interest;
use tokio::sync::mpsc;

/// Receive batches the plane queue holds before it drops: with GRO a batch is at most
/// 64 KiB, so the queue holds at most 16 MiB, whatever arrives.
pub const PLANE_QUEUE: usize = 256;

/// Receive calls one `poll_recv` makes while every datagram it read was the plane's, before
/// it yields to quinn's endpoint driver anyway (a flood must not hold it forever).
const MAX_PLANE_ONLY_READS: usize = 32;

/// Plane datagrams from one address, back to back: every `stride` bytes one datagram (the
/// last may be shorter), as GRO hands them over.
#[derive(Debug)]
pub struct PlaneBatch {
    /// Where they came from (canonical form).
    pub from: SocketAddr,
    /// Size of each datagram but the last.
    pub stride: usize,
    /// The datagrams.
    pub data: Vec<u8>,
}

/// Where the plane datagrams of one link id go.
#[derive(Debug, Clone, Copy)]
struct Route {
    /// The only address they may come from.
    addr: SocketAddr,
    /// The lane whose queue takes them.
    lane: u8,
    /// Links with this id (two only if two ids ever collided).
    links: usize,
}

/// Counters of what the socket did with plane datagrams.
#[derive(Debug, Default)]
pub struct SocketCounters {
    /// Plane datagrams handed to the plane queue.
    pub plane_queued: AtomicU64,
    /// Batches (receive calls' buffers, GRO included) those came in.
    pub plane_batches: AtomicU64,
    /// Plane datagrams whose link id no link expects from their address: dropped.
    pub plane_unknown: AtomicU64,
    /// Plane datagrams dropped because the plane queue was full (or no plane runs).
    pub plane_overflow: AtomicU64,
}

/// The UDP socket quinn and the data plane share.
#[derive(Debug)]
pub struct DemuxSocket {
    io: tokio::net::UdpSocket,
    state: UdpSocketState,
    /// The link id of every authenticated plane link this node receives on: the peer's
    /// address, the lane (queue) its datagrams go to, and how many links have that id.
    routes: RwLock<HashMap<u64, Route>>,
    /// One queue per plane lane (datagrams of lane `l` go to queue `l % len`).
    plane_tx: Vec<mpsc::Sender<PlaneBatch>>,
    /// What happened to plane datagrams.
    pub counters: SocketCounters,
}

impl DemuxSocket {
    /// Wraps a bound socket. Plane datagrams from routed addresses go to the queue of
    /// their lane in `plane_tx` (the lane byte modulo the queues); with no queue, every
    /// plane datagram is dropped.
    pub fn new(socket: std::net::UdpSocket, plane_tx: Vec<mpsc::Sender<PlaneBatch>>) -> io::Result<Self> {
        socket.set_nonblocking(true)?;
        let state = UdpSocketState::new((&socket).into())?;
        Ok(DemuxSocket {
            io: tokio::net::UdpSocket::from_std(socket)?,
            state,
            routes: RwLock::new(HashMap::new()),
            plane_tx,
            counters: SocketCounters::default(),
        })
    }

    /// Lets plane datagrams of link id `id` from `addr` through, to the queue of `lane`.
    pub fn add_route(&self, id: u64, addr: SocketAddr, lane: u8) {
        let mut r = self.routes.write().unwrap_or_else(|p| p.into_inner());
        let route = r.entry(id).or_insert(Route { addr: super::canonical(addr), lane, links: 0 });
        route.links += 1;
    }

    /// One link of id `id` fewer; its datagrams are dropped again once none is left.
    pub fn remove_route(&self, id: u64) {
        let mut r = self.routes.write().unwrap_or_else(|p| p.into_inner());
        if let Some(route) = r.get_mut(&id) {
            route.links -= 1;
            if route.links == 0 {
                r.remove(&id);
            }
        }
    }

    /// Sends `contents` to `to` as datagrams of `segment_size` bytes (one GSO send).
    pub fn try_send_plane(&self, to: SocketAddr, contents: &[u8], segment_size: usize) -> io::Result<()> {
        let transmit = Transmit {
            destination: to,
            ecn: None,
            contents,
            segment_size: (contents.len() > segment_size).then_some(segment_size),
            src_ip: None,
        };
        self.io.try_io(Interest::WRITABLE, || self.state.send((&self.io).into(), &transmit))
    }

    /// Waits until the socket may take a send again.
    pub async fn writable(&self) -> io::Result<()> {
        self.io.writable().await
    }

    /// Most datagrams one send may carry.
    pub fn max_gso_segments(&self) -> usize {
        self.state.max_gso_segments()
    }

    /// Splits the first `n` received buffers: plane datagrams leave (queued or dropped),
    /// QUIC datagrams are moved together at the front of their buffer. Returns whether any
    /// QUIC bytes are left for quinn.
    fn split(&self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta], n: usize) -> bool {
        let mut any_quic = false;
        let queues = self.plane_tx.len();
        for (buf, m) in bufs.iter_mut().zip(meta.iter_mut()).take(n) {
            let stride = m.stride.max(1);
            let len = m.len.min(buf.len());
            let plane_segments =
                buf[..len].chunks(stride).filter(|d| meshd_proto::plane::is_plane_datagram(d[0])).count();
            if plane_segments == 0 {
                any_quic |= len > 0;
                continue;
            }
            let segments = len.div_ceil(stride);
            if queues == 0 {
                self.counters.plane_overflow.fetch_add(plane_segments as u64, Ordering::Relaxed);
            } else {
                let from = super::canonical(m.addr);
                let routes = self.routes.read().unwrap_or_else(|p| p.into_inner());
                // The queue each segment goes to, if any link expects it (one lookup per
                // run of segments of one link id: a GRO batch is mostly one link's).
                let mut last: Option<(u64, Option<usize>)> = None;
                let mut queue_of = |d: &[u8]| -> Option<usize> {
                    let id = link_id_of(d)?;
                    if let Some((_, q)) = last.filter(|(l, _)| *l == id) {
                        return q;
                    }
                    let q = routes.get(&id).filter(|r| r.addr == from).map(|r| usize::from(r.lane) % queues);
                    last = Some((id, q));
                    q
                };
                let mut counts = [0usize; super::plane::MAX_PLANE_LANES];
                let mut unknown = 0u64;
                for d in buf[..len].chunks(stride).filter(|d| meshd_proto::plane::is_plane_datagram(d[0])) {
                    match queue_of(d) {
                        Some(q) => counts[q.min(counts.len() - 1)] += 1,
                        None => unknown += 1,
                    }
                }
                if unknown > 0 {
                    self.counters.plane_unknown.fetch_add(unknown, Ordering::Relaxed);
                }
                // One batch per lane queue, of exactly its datagrams' size (the plane counts
                // what it keeps by allocation). A shorter segment can only be the batch's
                // last one: each batch of plane datagrams keeps the GSO rule.
                let mut batches: Vec<Option<Vec<u8>>> = vec![None; queues];
                for d in buf[..len].chunks(stride).filter(|d| meshd_proto::plane::is_plane_datagram(d[0])) {
                    let Some(q) = queue_of(d) else { continue };
                    let q = q.min(counts.len() - 1);
                    batches[q]
                        .get_or_insert_with(|| Vec::with_capacity(counts[q] * stride))
                        .extend_from_slice(d);
                }
                drop(routes);
                for (q, data) in batches.into_iter().enumerate() {
                    let Some(data) = data else { continue };
                    let batch = PlaneBatch { from, stride, data };
                    match self.plane_tx[q].try_send(batch) {
                        Ok(()) => {
                            self.counters.plane_batches.fetch_add(1, Ordering::Relaxed);
                            self.counters.plane_queued.fetch_add(counts[q] as u64, Ordering::Relaxed)
                        }
                        Err(_) => self.counters.plane_overflow.fetch_add(counts[q] as u64, Ordering::Relaxed),
                    };
                }
            }
            // Keep the QUIC datagrams, in order, at the front.
            let mut kept = 0;
            for s in 0..segments {
                let start = s * stride;
                let end = (start + stride).min(len);
                if meshd_proto::plane::is_plane_datagram(buf[start]) {
                    continue;
                }
                if start != kept {
                    buf.copy_within(start..end, kept);
                }
                kept += end - start;
            }
            m.len = kept;
            any_quic |= kept > 0;
        }
        any_quic
    }
}

impl quinn::AsyncUdpSocket for DemuxSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn quinn::UdpPoller>> {
        Box::pin(Poller(self))
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.io.try_io(Interest::WRITABLE, || self.state.send((&self.io).into(), transmit))
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut plane_only = 0;
        loop {
            ready!(self.io.poll_recv_ready(cx))?;
            let Ok(n) = self.io.try_io(Interest::READABLE, || self.state.recv((&self.io).into(), bufs, meta))
            else {
                continue;
            };
            if self.split(bufs, meta, n) {
                return Poll::Ready(Ok(n));
            }
            plane_only += 1;
            if plane_only >= MAX_PLANE_ONLY_READS {
                // Every length is 0 now: quinn reads nothing from them.
                return Poll::Ready(Ok(n));
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.io.local_addr()
    }

    fn may_fragment(&self) -> bool {
        self.state.may_fragment()
    }

    fn max_transmit_segments(&self) -> usize {
        self.state.max_gso_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.state.gro_segments()
    }
}

/// Tells quinn when the shared socket may take a send again.
#[derive(Debug)]
struct Poller(Arc<DemuxSocket>);

impl quinn::UdpPoller for Poller {
    fn poll_writable(self: Pin<&mut Self>, cx: &mut Context) -> Poll<io::Result<()>> {
        self.0.io.poll_send_ready(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quinn::AsyncUdpSocket;

    async fn recv_once(sock: &Arc<DemuxSocket>) -> (usize, Vec<RecvMeta>, Vec<Vec<u8>>) {
        let mut storage = vec![vec![0u8; 65_536]; 4];
        let mut meta = vec![RecvMeta::default(); 4];
        let mut bufs: Vec<IoSliceMut> = storage.iter_mut().map(|b| IoSliceMut::new(b)).collect();
        let recv = std::future::poll_fn(|cx| sock.poll_recv(cx, &mut bufs, &mut meta));
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), recv)
            .await
            .expect("something received")
            .expect("recv");
        drop(bufs);
        (n, meta, storage)
    }

    /// A plane datagram's bytes of link `id` on `lane` (not sealed: the socket opens nothing).
    fn plane(id: u64, lane: u8, tail: u8) -> Vec<u8> {
        use meshd_proto::plane::packet::{Header, OVERHEAD};
        let mut d = vec![tail; OVERHEAD + 4];
        Header::write(false, lane, id, 0, &mut d);
        d
    }

    #[tokio::test]
    async fn plane_datagrams_leave_quic_stays_and_strangers_and_spoofers_are_dropped() {
        let (tx, mut rx) = mpsc::channel(4);
        let std_sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let sock = Arc::new(DemuxSocket::new(std_sock, vec![tx]).expect("socket"));
        let to = sock.local_addr().expect("addr");
        let stranger = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let member = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        sock.add_route(7, member.local_addr().expect("addr"), 0);

        // From a non-member, even with the member's link id: dropped; QUIC-looking bytes
        // still reach quinn.
        for i in 0..50u8 {
            stranger.send_to(&plane(if i % 2 == 0 { 7 } else { u64::from(i) }, 0, i), to).expect("send");
        }
        stranger.send_to(&[0x40, 9, 9, 9], to).expect("send");
        let (n, meta, storage) = recv_once(&sock).await;
        let quic: Vec<&[u8]> =
            (0..n).filter(|&i| meta[i].len > 0).map(|i| &storage[i][..meta[i].len]).collect();
        assert_eq!(quic, vec![&[0x40u8, 9, 9, 9][..]]);
        assert_eq!(sock.counters.plane_unknown.load(Ordering::Relaxed), 50);
        assert!(rx.try_recv().is_err(), "a stranger's datagram reached the plane");

        // From the member's address: other link ids (a spoofer's guesses), a datagram of
        // an older plane version and one too short to hold an id are dropped; its own link
        // id goes to the plane, QUIC to quinn.
        member.send_to(&plane(8, 0, 1), to).expect("send");
        let mut v1 = plane(7, 0, 2);
        v1[0] = 0x20;
        member.send_to(&v1, to).expect("send");
        member.send_to(&plane(7, 0, 3)[..20], to).expect("send");
        member.send_to(&plane(7, 0, 4), to).expect("send");
        member.send_to(&[0x41, 1], to).expect("send");
        let mut got_quic = Vec::new();
        while got_quic.is_empty() {
            let (n, meta, storage) = recv_once(&sock).await;
            got_quic.extend((0..n).filter(|&i| meta[i].len > 0).map(|i| storage[i][..meta[i].len].to_vec()));
        }
        assert_eq!(got_quic, vec![vec![0x41u8, 1]]);
        let batch = rx.try_recv().expect("plane batch");
        assert_eq!(batch.data, plane(7, 0, 4));
        assert_eq!(batch.data.capacity(), batch.data.len(), "a batch is allocated to its size");
        assert_eq!(batch.from, member.local_addr().expect("addr"));
        assert!(rx.try_recv().is_err(), "only the member's own link id passes");
        assert_eq!(sock.counters.plane_unknown.load(Ordering::Relaxed), 53);
    }

    #[tokio::test]
    async fn plane_datagrams_go_to_the_queue_of_their_links_lane() {
        let (tx0, mut rx0) = mpsc::channel(8);
        let (tx1, mut rx1) = mpsc::channel(8);
        let std_sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let sock = Arc::new(DemuxSocket::new(std_sock, vec![tx0, tx1]).expect("socket"));
        let to = sock.local_addr().expect("addr");
        let member = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        // Links of lanes 0, 1, 2 and 3: even lanes to queue 0, odd ones to queue 1.
        for lane in 0..4u8 {
            sock.add_route(100 + u64::from(lane), member.local_addr().expect("addr"), lane);
        }
        for lane in 0..4u8 {
            member.send_to(&plane(100 + u64::from(lane), lane, 9), to).expect("send");
        }
        member.send_to(&[0x40], to).expect("send");
        let mut quic = 0;
        while quic == 0 {
            let (n, meta, _) = recv_once(&sock).await;
            quic += (0..n).filter(|&i| meta[i].len > 0).count();
        }
        let mut lanes = [Vec::new(), Vec::new()];
        while let Ok(b) = rx0.try_recv() {
            lanes[0].extend(b.data.chunks(b.stride).map(|d| d[1]));
        }
        while let Ok(b) = rx1.try_recv() {
            lanes[1].extend(b.data.chunks(b.stride).map(|d| d[1]));
        }
        assert_eq!(lanes, [vec![0, 2], vec![1, 3]]);
    }

    #[tokio::test]
    async fn a_full_plane_queue_drops_instead_of_growing() {
        let (tx, _rx) = mpsc::channel(2);
        let std_sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let sock = Arc::new(DemuxSocket::new(std_sock, vec![tx]).expect("socket"));
        let to = sock.local_addr().expect("addr");
        let member = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let from = member.local_addr().expect("addr");
        sock.add_route(5, from, 0);
        sock.add_route(5, from, 0);
        for i in 0..20u8 {
            member.send_to(&plane(5, 0, i), to).expect("send");
        }
        member.send_to(&[0x40], to).expect("send");
        let mut quic = 0;
        while quic == 0 {
            let (n, meta, _) = recv_once(&sock).await;
            quic += (0..n).filter(|&i| meta[i].len > 0).count();
        }
        let c = &sock.counters;
        assert_eq!(c.plane_queued.load(Ordering::Relaxed) + c.plane_overflow.load(Ordering::Relaxed), 20);
        assert!(c.plane_overflow.load(Ordering::Relaxed) >= 18 - 2 * 4, "{c:?}");
        // Two links had the id: it stays routed until both are gone.
        sock.remove_route(5);
        assert!(sock.routes.read().expect("lock").contains_key(&5));
        sock.remove_route(5);
        assert!(!sock.routes.read().expect("lock").contains_key(&5));
    }
}
