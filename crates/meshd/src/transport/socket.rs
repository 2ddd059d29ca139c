//! The node's one UDP socket, shared by quinn and the data plane (docs/PROTOCOL.md, "The
//! data plane").
//!
//! quinn's endpoint runs over [`DemuxSocket`] as its [`quinn::AsyncUdpSocket`]. Every
//! receive batch (GRO included) is split by the first byte of each datagram: QUIC packets
//! (fixed bit set; greasing is off on meshd's endpoints) stay in quinn's buffers, plane
//! datagrams go to the plane driver's bounded queue. A plane datagram from an address with
//! no authenticated plane link is dropped after one table lookup: no allocation, no reply.

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

/// Counters of what the socket did with plane datagrams.
#[derive(Debug, Default)]
pub struct SocketCounters {
    /// Plane datagrams handed to the plane queue.
    pub plane_queued: AtomicU64,
    /// Batches (receive calls' buffers, GRO included) those came in.
    pub plane_batches: AtomicU64,
    /// Plane datagrams from an address without an authenticated link: dropped.
    pub plane_unknown: AtomicU64,
    /// Plane datagrams dropped because the plane queue was full (or no plane runs).
    pub plane_overflow: AtomicU64,
}

/// The UDP socket quinn and the data plane share.
#[derive(Debug)]
pub struct DemuxSocket {
    io: tokio::net::UdpSocket,
    state: UdpSocketState,
    /// Addresses with an authenticated plane link, and how many links each has.
    routes: RwLock<HashMap<SocketAddr, usize>>,
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

    /// Lets plane datagrams from `addr` through (one more link there).
    pub fn add_route(&self, addr: SocketAddr) {
        let mut r = self.routes.write().unwrap_or_else(|p| p.into_inner());
        *r.entry(super::canonical(addr)).or_insert(0) += 1;
    }

    /// One link to `addr` fewer; its datagrams are dropped again once none is left.
    pub fn remove_route(&self, addr: SocketAddr) {
        let addr = super::canonical(addr);
        let mut r = self.routes.write().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = r.get_mut(&addr) {
            *n -= 1;
            if *n == 0 {
                r.remove(&addr);
            }
        }
    }

    fn routed(&self, addr: &SocketAddr) -> bool {
        let r = self.routes.read().unwrap_or_else(|p| p.into_inner());
        // Only the IPv4-mapped form needs converting; the lookup allocates nothing.
        r.contains_key(&super::canonical(*addr))
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
            if !self.routed(&m.addr) {
                self.counters.plane_unknown.fetch_add(plane_segments as u64, Ordering::Relaxed);
            } else if self.plane_tx.is_empty() {
                self.counters.plane_overflow.fetch_add(plane_segments as u64, Ordering::Relaxed);
            } else {
                // One batch per lane queue. A shorter segment can only be the batch's last
                // one: each batch of plane datagrams keeps the GSO rule.
                let queues = self.plane_tx.len();
                let mut batches: Vec<Option<Vec<u8>>> = vec![None; queues];
                let mut counts = vec![0u64; queues];
                for d in buf[..len].chunks(stride).filter(|d| meshd_proto::plane::is_plane_datagram(d[0])) {
                    let q = d.get(1).map_or(0, |&lane| usize::from(lane) % queues);
                    let cap = if queues == 1 { plane_segments * stride } else { len };
                    batches[q].get_or_insert_with(|| Vec::with_capacity(cap)).extend_from_slice(d);
                    counts[q] += 1;
                }
                for (q, data) in batches.into_iter().enumerate() {
                    let Some(data) = data else { continue };
                    let batch = PlaneBatch { from: super::canonical(m.addr), stride, data };
                    match self.plane_tx[q].try_send(batch) {
                        Ok(()) => {
                            self.counters.plane_batches.fetch_add(1, Ordering::Relaxed);
                            self.counters.plane_queued.fetch_add(counts[q], Ordering::Relaxed)
                        }
                        Err(_) => self.counters.plane_overflow.fetch_add(counts[q], Ordering::Relaxed),
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

    #[tokio::test]
    async fn plane_datagrams_leave_quic_stays_and_strangers_are_dropped() {
        let (tx, mut rx) = mpsc::channel(4);
        let std_sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let sock = Arc::new(DemuxSocket::new(std_sock, vec![tx]).expect("socket"));
        let to = sock.local_addr().expect("addr");
        let stranger = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let member = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        sock.add_route(member.local_addr().expect("addr"));

        // From a non-member: junk with the fixed bit clear is dropped; QUIC-looking bytes
        // still reach quinn.
        for i in 0..50u8 {
            stranger
                .send_to(
                    &[0x20, i, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
                    to,
                )
                .expect("send");
        }
        stranger.send_to(&[0x40, 9, 9, 9], to).expect("send");
        let (n, meta, storage) = recv_once(&sock).await;
        let quic: Vec<&[u8]> =
            (0..n).filter(|&i| meta[i].len > 0).map(|i| &storage[i][..meta[i].len]).collect();
        assert_eq!(quic, vec![&[0x40u8, 9, 9, 9][..]]);
        assert_eq!(sock.counters.plane_unknown.load(Ordering::Relaxed), 50);
        assert!(rx.try_recv().is_err(), "a stranger's datagram reached the plane");

        // From a member: the plane gets it, quinn does not.
        member.send_to(&[0x21, 0, 0, 0, 0, 7], to).expect("send");
        member.send_to(&[0x41, 1], to).expect("send");
        let mut got_quic = Vec::new();
        while got_quic.is_empty() {
            let (n, meta, storage) = recv_once(&sock).await;
            got_quic.extend((0..n).filter(|&i| meta[i].len > 0).map(|i| storage[i][..meta[i].len].to_vec()));
        }
        assert_eq!(got_quic, vec![vec![0x41u8, 1]]);
        let batch = rx.try_recv().expect("plane batch");
        assert_eq!(batch.data, vec![0x21, 0, 0, 0, 0, 7]);
        assert_eq!(batch.from, member.local_addr().expect("addr"));
    }

    #[tokio::test]
    async fn plane_datagrams_go_to_the_queue_of_their_lane() {
        let (tx0, mut rx0) = mpsc::channel(8);
        let (tx1, mut rx1) = mpsc::channel(8);
        let std_sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let sock = Arc::new(DemuxSocket::new(std_sock, vec![tx0, tx1]).expect("socket"));
        let to = sock.local_addr().expect("addr");
        let member = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        sock.add_route(member.local_addr().expect("addr"));
        // Lanes 0, 1, 2 and 3: even lanes to queue 0, odd ones to queue 1.
        for lane in 0..4u8 {
            member.send_to(&[0x20, lane, 9], to).expect("send");
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
        sock.add_route(member.local_addr().expect("addr"));
        for i in 0..20u8 {
            member.send_to(&[0x20, i], to).expect("send");
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
        sock.remove_route(member.local_addr().expect("addr"));
        assert!(!sock.routed(&member.local_addr().expect("addr")));
    }
}
