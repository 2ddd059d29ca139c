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
//!
//! Where the kernel lets the port be a group of sockets ([`super::reuse`]), each plane
//! lane reads its own datagrams from its own socket ([`LaneSocket`]) and opens them in the
//! buffer they were received in: nothing is copied or queued on the way. A receive batch
//! that also holds another reader's datagrams (GRO merges datagrams of one 5-tuple) is
//! sorted the same way from either side: QUIC datagrams found by a lane go to a short
//! queue that quinn's receive drains first, another lane's to that lane's queue.

use meshd_proto::plane::packet::link_id_of;
use quinn::udp::{RecvMeta, Transmit, UdpSocketState};
use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll, Waker, ready};
use tokio::io::Interest;
use tokio::sync::mpsc;

/// Receive batches the plane queue holds before it drops: with GRO a batch is at most
/// 64 KiB, so the queue holds at most 16 MiB, whatever arrives.
pub const PLANE_QUEUE: usize = 256;

/// Receive calls one `poll_recv` makes while every datagram it read was the plane's, before
/// it yields to quinn's endpoint driver anyway (a flood must not hold it forever).
const MAX_PLANE_ONLY_READS: usize = 32;

/// QUIC receive batches a lane found in its socket that wait for quinn's endpoint.
const QUIC_BACKLOG: usize = 64;

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
    /// QUIC datagrams a plane lane's socket received and passed on to quinn.
    pub quic_passed: AtomicU64,
    /// QUIC datagrams a plane lane's socket received and dropped (quinn's backlog full).
    pub quic_dropped: AtomicU64,
}

/// The UDP socket quinn and the data plane share.
#[derive(Debug)]
pub struct DemuxSocket {
    /// Registered for writability too: quinn polls for it around its sends, and a
    /// registration made only while waiting (as [`LaneSocket`]'s) measured one per send
    /// on the ring's QUIC streams, and a third slower.
    io: tokio::net::UdpSocket,
    state: UdpSocketState,
    /// The link id of every authenticated plane link this node receives on: the peer's
    /// address, the lane (queue) its datagrams go to, and how many links have that id.
    routes: RwLock<HashMap<u64, Route>>,
    /// One queue per plane lane (datagrams of lane `l` go to queue `l % len`).
    plane_tx: Vec<mpsc::Sender<PlaneBatch>>,
    /// QUIC datagrams the plane lanes' sockets received, for quinn's next receive.
    quic_backlog: Mutex<VecDeque<(Vec<u8>, RecvMeta)>>,
    /// quinn's endpoint task, woken when the backlog gets something.
    quic_waker: Mutex<Option<Waker>>,
    /// Whether plane lanes read sockets of their own (then the backlog is looked at).
    lane_sockets: std::sync::atomic::AtomicBool,
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
            quic_backlog: Mutex::new(VecDeque::new()),
            quic_waker: Mutex::new(None),
            lane_sockets: std::sync::atomic::AtomicBool::new(false),
            counters: SocketCounters::default(),
        })
    }

    /// Says that plane lanes read sockets of their own, which may pass QUIC datagrams on.
    pub fn set_lane_sockets(&self) {
        self.lane_sockets.store(true, Ordering::Relaxed);
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
        let transmit = gso_transmit(to, contents, segment_size);
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
            let len = m.len.min(buf.len());
            let stride = m.stride.max(1);
            m.len = self.sort(&mut buf[..len], m.addr, stride, None, m);
            any_quic |= m.len > 0;
        }
        any_quic
    }

    /// Sorts one receive batch (`len` bytes of datagrams of `stride` bytes, the last
    /// possibly shorter) read by quinn (`keep` `None`) or by the plane lane whose queue is
    /// `keep`: the reader's own datagrams are moved together at the front (in order; in
    /// place, without a copy when they are all its own), the others leave: plane
    /// datagrams that no link expects from `from` are dropped, other plane datagrams are
    /// copied to their lane's queue, QUIC datagrams a lane read to quinn's backlog. Returns
    /// the length kept. `meta` is the batch's (for quinn's backlog).
    pub fn sort(
        &self,
        buf: &mut [u8],
        from: SocketAddr,
        stride: usize,
        keep: Option<usize>,
        meta: &RecvMeta,
    ) -> usize {
        let len = buf.len();
        let queues = self.plane_tx.len();
        // The common cases first: all QUIC for quinn.
        if keep.is_none() && !buf.chunks(stride).any(|d| meshd_proto::plane::is_plane_datagram(d[0])) {
            return len;
        }
        let from = super::canonical(from);
        let routes = self.routes.read().unwrap_or_else(|p| p.into_inner());
        // The queue of each plane datagram, if any link expects it (one lookup per run of
        // datagrams of one link id: a GRO batch is mostly one link's).
        let mut last: Option<(u64, Option<usize>)> = None;
        let mut queue_of = |d: &[u8]| -> Option<usize> {
            let id = link_id_of(d)?;
            if let Some((_, q)) = last.filter(|(l, _)| *l == id) {
                return q;
            }
            let q = routes
                .get(&id)
                .filter(|r| r.addr == from && queues > 0)
                .map(|r| (usize::from(r.lane) % queues).min(super::plane::MAX_PLANE_LANES - 1));
            last = Some((id, q));
            q
        };
        let mut kept = 0;
        let (mut unknown, mut kept_plane) = (0u64, 0u64);
        let mut others: Vec<Option<(Vec<u8>, u64)>> = Vec::new();
        let mut quic_out: Option<Vec<u8>> = None;
        for start in (0..len).step_by(stride) {
            let end = (start + stride).min(len);
            let d = &buf[start..end];
            let mine = if meshd_proto::plane::is_plane_datagram(d[0]) {
                match queue_of(d) {
                    None => {
                        unknown += 1;
                        continue;
                    }
                    Some(q) if Some(q) == keep => {
                        kept_plane += 1;
                        true
                    }
                    Some(q) => {
                        if others.len() <= q {
                            others.resize_with(q + 1, || None);
                        }
                        let (v, k) = others[q].get_or_insert_with(|| (Vec::with_capacity(len), 0));
                        v.extend_from_slice(d);
                        *k += 1;
                        false
                    }
                }
            } else if keep.is_none() {
                true
            } else {
                quic_out.get_or_insert_with(|| Vec::with_capacity(len)).extend_from_slice(d);
                false
            };
            if mine {
                if start != kept {
                    buf.copy_within(start..end, kept);
                }
                kept += end - start;
            }
        }
        drop(routes);
        let c = &self.counters;
        if unknown > 0 && queues == 0 {
            // No plane runs: its datagrams have nowhere to go.
            c.plane_overflow.fetch_add(unknown, Ordering::Relaxed);
        } else if unknown > 0 {
            c.plane_unknown.fetch_add(unknown, Ordering::Relaxed);
        }
        if kept_plane > 0 {
            c.plane_batches.fetch_add(1, Ordering::Relaxed);
            c.plane_queued.fetch_add(kept_plane, Ordering::Relaxed);
        }
        for (q, o) in others.into_iter().enumerate() {
            let Some((data, k)) = o else { continue };
            // One batch per lane queue, of exactly its datagrams' size (the plane counts
            // what it keeps by allocation); a shorter datagram can only be the last.
            let mut data = data;
            data.shrink_to_fit();
            match self.plane_tx[q].try_send(PlaneBatch { from, stride, data }) {
                Ok(()) => {
                    c.plane_batches.fetch_add(1, Ordering::Relaxed);
                    c.plane_queued.fetch_add(k, Ordering::Relaxed)
                }
                Err(_) => c.plane_overflow.fetch_add(k, Ordering::Relaxed),
            };
        }
        if let Some(data) = quic_out {
            let n = data.len().div_ceil(stride) as u64;
            let mut m = *meta;
            m.len = data.len();
            m.stride = stride;
            let mut backlog = self.quic_backlog.lock().unwrap_or_else(|p| p.into_inner());
            if backlog.len() < QUIC_BACKLOG {
                backlog.push_back((data, m));
                drop(backlog);
                c.quic_passed.fetch_add(n, Ordering::Relaxed);
                if let Some(w) = self.quic_waker.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    w.wake();
                }
            } else {
                c.quic_dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
        kept
    }

    /// Moves what the lanes passed on into quinn's buffers; how many it filled.
    fn drain_backlog(&self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta]) -> usize {
        let mut backlog = self.quic_backlog.lock().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        while n < bufs.len().min(meta.len()) {
            let Some((data, m)) = backlog.pop_front() else { break };
            if data.len() > bufs[n].len() {
                self.counters.quic_dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            bufs[n][..data.len()].copy_from_slice(&data);
            meta[n] = m;
            n += 1;
        }
        n
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
        if self.lane_sockets.load(Ordering::Relaxed) {
            // Register before looking, so that a lane's push after the look wakes us.
            *self.quic_waker.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
            let n = self.drain_backlog(bufs, meta);
            if n > 0 {
                return Poll::Ready(Ok(n));
            }
        }
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

/// A plane lane's own socket in the port's group ([`super::reuse`]): its driver reads its
/// datagrams straight into buffers it then owns, and sends on it.
///
/// It is in the runtime's reactor for readability only. Registered for writability as
/// well (as `tokio::net::UdpSocket` is), it would wake a parked runtime worker each time
/// the kernel frees a sent batch's buffer space (`sock_wfree`: on veth as the bridge takes
/// the packet, on a NIC at transmit completion), for nothing: a send on a UDP socket
/// almost never waits. On the lab that was 45% of a plane ring's wake-ups
/// (docs/PERFORMANCE.md, "Wake-ups"). A send that would block registers a second
/// descriptor of the same socket for writability, for as long as it waits
/// ([`LaneSocket::writable`]).
#[derive(Debug)]
pub struct LaneSocket {
    io: tokio::io::unix::AsyncFd<std::net::UdpSocket>,
    state: UdpSocketState,
}

/// A receive batch read by [`LaneSocket::recv`]: where from, and the size of each
/// datagram but the last.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    /// The sender.
    pub from: SocketAddr,
    /// GRO's segment size (the whole length for a single datagram).
    pub stride: usize,
}

/// Receive buffers one [`LaneSocket::recv`] fills at most.
pub const LANE_BATCH: usize = 16;
/// Size of each receive buffer: the largest GRO batch.
pub const LANE_BUF: usize = 1 << 16;

impl LaneSocket {
    /// Wraps a bound socket (GSO and GRO as quinn sets them up).
    pub fn new(socket: std::net::UdpSocket) -> io::Result<LaneSocket> {
        socket.set_nonblocking(true)?;
        let state = UdpSocketState::new((&socket).into())?;
        // SAFETY: the socket owns its descriptor, which stays open (and the same) until
        // the `AsyncFd` drops it.
        let io = unsafe { tokio::io::unix::AsyncFd::register_with_interest(socket, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(LaneSocket { io, state })
    }

    /// Sends `contents` to `to` as datagrams of `segment_size` bytes (one GSO send)
    /// without waiting: `WouldBlock` when the socket is full.
    pub fn try_send(&self, to: SocketAddr, contents: &[u8], segment_size: usize) -> io::Result<()> {
        self.state.send(self.io.get_ref().into(), &gso_transmit(to, contents, segment_size))
    }

    /// Waits until the socket may take a send again, on a descriptor of it registered for
    /// writability only while it waits (registering reports a socket that is already
    /// writable at once, so no wake-up between the failed send and the wait is lost).
    pub async fn writable(&self) -> io::Result<()> {
        let dup = self.io.get_ref().try_clone()?;
        // SAFETY: as in `new`, for the duplicate this function owns.
        let fd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(dup, Interest::WRITABLE) }
            .map_err(|e| e.into_parts().1)?;
        fd.writable().await.map(drop)
    }

    /// Waits until something may be read.
    pub async fn readable(&self) -> io::Result<()> {
        self.io.readable().await.map(drop)
    }

    /// Most datagrams one send may carry.
    pub fn max_gso_segments(&self) -> usize {
        self.state.max_gso_segments()
    }

    /// Reads receive batches into `bufs` (each given [`LANE_BUF`] bytes of capacity; its
    /// length becomes what was read) without waiting; fills `got` with where each came
    /// from. `WouldBlock` when nothing is there.
    pub fn recv(&self, bufs: &mut [Vec<u8>], got: &mut Vec<Received>) -> io::Result<usize> {
        got.clear();
        self.io.try_io(Interest::READABLE, |s| recv_batches(s, bufs, got))
    }
}

/// `contents` for `to` as datagrams of `segment_size` bytes.
fn gso_transmit(to: SocketAddr, contents: &[u8], segment_size: usize) -> Transmit<'_> {
    Transmit {
        destination: to,
        ecn: None,
        contents,
        segment_size: (contents.len() > segment_size).then_some(segment_size),
        src_ip: None,
    }
}

/// recvmmsg(2) into the spare capacity of `bufs` (no `&mut [u8]` over memory the kernel
/// has not written: the iovecs are raw pointers, and each length is set to what it wrote).
fn recv_batches(
    io: &std::net::UdpSocket,
    bufs: &mut [Vec<u8>],
    got: &mut Vec<Received>,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    const CMSG: usize = 64;
    let n = bufs.len().min(LANE_BATCH);
    // SAFETY: plain-old-data structs, zeroed is a valid value for each.
    let mut names: [libc::sockaddr_storage; LANE_BATCH] = unsafe { std::mem::zeroed() };
    let mut iovs: [libc::iovec; LANE_BATCH] = unsafe { std::mem::zeroed() };
    let mut ctrl = [[0u64; CMSG / 8]; LANE_BATCH];
    let mut hdrs: [libc::mmsghdr; LANE_BATCH] = unsafe { std::mem::zeroed() };
    for i in 0..n {
        let b = &mut bufs[i];
        b.clear();
        b.reserve(LANE_BUF);
        iovs[i] = libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: b.capacity() };
        let h = &mut hdrs[i].msg_hdr;
        h.msg_name = (&mut names[i] as *mut libc::sockaddr_storage).cast();
        h.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        h.msg_iov = &mut iovs[i];
        h.msg_iovlen = 1;
        h.msg_control = ctrl[i].as_mut_ptr().cast();
        h.msg_controllen = CMSG as _;
    }
    // SAFETY: `n` valid mmsghdrs whose buffers (iovecs, names, control) live until return.
    let r = unsafe {
        libc::recvmmsg(
            io.as_raw_fd(),
            hdrs.as_mut_ptr(),
            n as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let r = r as usize;
    for i in 0..r {
        let len = hdrs[i].msg_len as usize;
        // SAFETY: the kernel wrote `len` bytes (at most the capacity) at the start.
        unsafe { bufs[i].set_len(len.min(bufs[i].capacity())) };
        let mut stride = len;
        let h = &hdrs[i].msg_hdr;
        // SAFETY: walking the control messages the kernel wrote into `ctrl[i]`.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(h);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == libc::UDP_GRO {
                    let v = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                    if v > 0 {
                        stride = v as usize;
                    }
                }
                c = libc::CMSG_NXTHDR(h, c);
            }
        }
        let from = match names[i].ss_family as libc::c_int {
            libc::AF_INET => {
                // SAFETY: the family says it is a sockaddr_in.
                let a = unsafe { &*(&names[i] as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
                SocketAddr::new(
                    std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)).into(),
                    u16::from_be(a.sin_port),
                )
            }
            libc::AF_INET6 => {
                // SAFETY: the family says it is a sockaddr_in6.
                let a =
                    unsafe { &*(&names[i] as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
                SocketAddr::V6(std::net::SocketAddrV6::new(
                    a.sin6_addr.s6_addr.into(),
                    u16::from_be(a.sin6_port),
                    a.sin6_flowinfo,
                    a.sin6_scope_id,
                ))
            }
            _ => SocketAddr::from(([0, 0, 0, 0], 0)),
        };
        got.push(Received { from, stride: stride.max(1) });
    }
    Ok(r)
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
    async fn a_lane_socket_registered_for_reads_only_still_sends_receives_and_waits_to_send() {
        let a = LaneSocket::new(std::net::UdpSocket::bind("127.0.0.1:0").expect("bind")).expect("socket");
        let b = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let to = b.local_addr().expect("addr");
        // A wait for room on a socket that has room ends at once (the second descriptor's
        // registration reports it), however often it is asked.
        for _ in 0..3 {
            tokio::time::timeout(std::time::Duration::from_secs(5), a.writable())
                .await
                .expect("a socket with room is writable at once")
                .expect("writable");
        }
        a.try_send(to, &[7u8; 300], 100).expect("send");
        let mut got = [0u8; 512];
        let mut lens = Vec::new();
        b.set_read_timeout(Some(std::time::Duration::from_secs(5))).expect("timeout");
        while lens.iter().sum::<usize>() < 300 {
            lens.push(b.recv(&mut got).expect("recv"));
        }
        assert!(lens.iter().all(|&n| n == 100 || n == 300), "{lens:?}");
        // Readability: nothing there is WouldBlock; a datagram wakes `readable` and is read.
        let (mut bufs, mut meta) = (vec![Vec::new(); LANE_BATCH], Vec::new());
        let err = a.recv(&mut bufs, &mut meta).expect_err("nothing to read");
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        b.send_to(&[1, 2, 3], a.io.get_ref().local_addr().expect("addr")).expect("send");
        tokio::time::timeout(std::time::Duration::from_secs(5), a.readable())
            .await
            .expect("woken")
            .expect("ok");
        let n = a.recv(&mut bufs, &mut meta).expect("recv");
        assert_eq!((n, &bufs[0][..], meta[0].from), (1, &[1u8, 2, 3][..], to));
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
