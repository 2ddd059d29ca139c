//! The ring allreduce driver over the nodes' QUIC connections.
//!
//! For each operation, every node opens one unidirectional data stream to the next node in
//! roster order and reads the one the previous node opened. Frames on the stream are
//! `[transfer id u64][length u32][payload]`; which chunk to send or expect, and whether to
//! reduce or copy it, comes from the sans-IO `meshd_proto::ring::RingState`. A reader task
//! and a writer task keep both directions moving at once (a ring where every node blocks
//! writing would deadlock), while this task owns the buffer and the state.
//!
//! No wait on a neighbour is unbounded. Joining an operation (the neighbour's streams and
//! preambles, and its first byte of data, which it sends only once its own previous node
//! joined) has [`RingNet::join_timeout`]; after that, an operation fails when no byte
//! arrives from the previous node nor leaves for the next for [`RingNet::progress_timeout`]
//! ([`CollectiveError::Stalled`], naming the neighbour): a peer whose QUIC connection is up
//! (keep-alives answered, so membership sees it alive) but whose collective stalled ends the
//! operation with an error the ranks see, rather than hanging the job.

use super::buffer::CollectiveBuffer;
use crate::transport::{DataStream, Transport, TransportError};
use bytes::Bytes;
use meshd_proto::NodeId;
use meshd_proto::reduce::{DType, ReduceOp};
use meshd_proto::ring::{
    Action, CHUNK_HEADER_LEN, DIRECT_TRANSFER_ID, Reduction, RingError, RingPlan, RingState,
    decode_chunk_header, direct_reduce, encode_chunk_header, is_direct,
};
use meshd_proto::wire::MAX_LANES;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{Mutex, Notify, mpsc};

/// Bytes at the start of each ring data stream: its lane, then how many lanes the sender
/// uses for the operation.
const LANE_PREAMBLE: usize = 2;

/// Lanes when the configuration does not say: one per two runtime workers (each lane keeps
/// one task busy sending to the next node and one receiving from the previous), at least
/// one.
fn default_lanes() -> NonZeroUsize {
    let workers = tokio::runtime::Handle::try_current().map(|h| h.metrics().num_workers()).unwrap_or(1);
    NonZeroUsize::new((workers / 2).clamp(1, MAX_LANES)).unwrap_or(NonZeroUsize::MIN)
}

/// How a node runs its ring operations (the CLI fills it from `MESHD_LANES` and
/// `MESHD_RING_CHUNK`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingConfig {
    /// Lanes (QUIC connections) to the next node; `None`: one per two runtime workers.
    /// Values above `MAX_LANES` are capped.
    pub lanes: Option<NonZeroUsize>,
    /// Chunk size in bytes (the pipelining grain).
    pub chunk_bytes: NonZeroUsize,
    /// How long to wait for a neighbour to start an operation.
    pub join_timeout: Duration,
}

impl RingConfig {
    /// The chunk size when none is given: 1 MiB.
    pub const DEFAULT_CHUNK: NonZeroUsize = NonZeroUsize::new(1 << 20).expect("1 MiB is not zero");
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig { lanes: None, chunk_bytes: Self::DEFAULT_CHUNK, join_timeout: Duration::from_secs(300) }
    }
}

/// Data streams that arrived for an operation other than the one being run, oldest first.
///
/// A neighbour is at most one operation ahead (each operation needs every node's data), so
/// at most `MAX_LANES` streams per peer are waiting legitimately. Streams of an operation
/// this node never ran (it failed here before it started) would wait forever, and each
/// holds one of the connection's 64 concurrent streams (`transport`): after 64 of them the
/// peer could not open another. So a peer keeps at most [`STASH_PER_PEER`] streams, and the
/// oldest goes first.
#[derive(Debug)]
struct Stash<T> {
    waiting: VecDeque<(SocketAddr, u64, T)>,
}

/// Streams kept per peer: twice the most a neighbour one operation ahead can open.
const STASH_PER_PEER: usize = 2 * MAX_LANES;

impl<T> Default for Stash<T> {
    fn default() -> Self {
        Stash { waiting: VecDeque::new() }
    }
}

impl<T> Stash<T> {
    /// The oldest stream kept from `peer` for `op`.
    fn take(&mut self, peer: SocketAddr, op: u64) -> Option<T> {
        let i = self.waiting.iter().position(|(p, o, _)| *p == peer && *o == op)?;
        self.waiting.remove(i).map(|(_, _, t)| t)
    }

    /// Keeps a stream; returns the peer's oldest one (its operation and the stream, to be
    /// dropped) when the peer has more than [`STASH_PER_PEER`].
    fn put(&mut self, peer: SocketAddr, op: u64, t: T) -> Option<(u64, T)> {
        self.waiting.push_back((peer, op, t));
        if self.waiting.iter().filter(|(p, _, _)| *p == peer).count() <= STASH_PER_PEER {
            return None;
        }
        let i = self.waiting.iter().position(|(p, _, _)| *p == peer)?;
        self.waiting.remove(i).map(|(_, o, t)| (o, t))
    }
}

/// Collective failures.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The schedule rejected something (a peer sent an unexpected chunk, bad sizes).
    #[error("ring: {0}")]
    Ring(#[from] RingError),
    /// The link to a neighbour failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A neighbour's stream broke or closed early.
    #[error("ring link with {peer} broke: {reason}")]
    Link {
        /// The neighbour.
        peer: SocketAddr,
        /// What happened.
        reason: String,
    },
    /// A neighbour did not start the operation in time.
    #[error("node {peer} did not join collective operation {op} within {timeout:?}")]
    Timeout {
        /// The neighbour.
        peer: SocketAddr,
        /// The operation.
        op: u64,
        /// How long we waited.
        timeout: Duration,
    },
    /// The buffer has an incomplete element at its end.
    #[error("buffer of {len} bytes is not a whole number of {dtype} elements")]
    Misaligned {
        /// The buffer's length in bytes.
        len: usize,
        /// Its element type.
        dtype: DType,
    },
    /// Part of the buffer is still lent to the transport (an earlier operation's chunks
    /// being sent) where this one must write.
    #[error("ring: bytes {range:?} of the buffer are still being sent")]
    BufferLent {
        /// The bytes that could not be written.
        range: std::ops::Range<usize>,
    },
    /// A broadcast named a root that is not a node of the ring.
    #[error("broadcast root {root} is not a node (world {world})")]
    NoSuchRoot {
        /// The root asked for.
        root: usize,
        /// Nodes in the ring.
        world: usize,
    },
    /// The local reduction failed (an element type the operation does not support).
    #[error(transparent)]
    Reduce(#[from] meshd_proto::reduce::ReduceError),
    /// A neighbour's link is up but the operation moved no byte from it (or to it, when
    /// only sends are left) for `timeout`.
    #[error("{}", stalled_text(*.peer, *.node, *.op, *.timeout, *.sending))]
    Stalled {
        /// The neighbour.
        peer: SocketAddr,
        /// Its node id, when connected.
        node: Option<NodeId>,
        /// The operation.
        op: u64,
        /// How long nothing moved.
        timeout: Duration,
        /// Whether it was the neighbour taking our data that stalled (else: sending us its).
        sending: bool,
    },
}

/// The operation's sequence number and restart round, as the service numbers it.
fn op_name(op: u64) -> String {
    match op >> 40 {
        0 => format!("collective operation #{}", op & ((1 << 40) - 1)),
        r => format!("collective operation #{} (restart round {r})", op & ((1 << 40) - 1)),
    }
}

fn stalled_text(peer: SocketAddr, node: Option<NodeId>, op: u64, timeout: Duration, sending: bool) -> String {
    let who = match node {
        Some(n) => format!("node {n} ({peer})"),
        None => format!("node {peer}"),
    };
    if sending {
        format!(
            "{who} took no data for {timeout:?} in {}: its link is up, but its collective stalled",
            op_name(op)
        )
    } else {
        format!(
            "no data from {who} for {timeout:?} in {}: its link is up, but its collective stalled",
            op_name(op)
        )
    }
}

/// Bytes an operation moved on its links, counted by its reader and writer tasks: any
/// change is progress.
#[derive(Debug, Default)]
pub(super) struct Progress {
    received: AtomicU64,
    sent: AtomicU64,
}

impl Progress {
    pub(super) fn received(&self, n: usize) {
        self.received.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(super) fn sent(&self, n: usize) {
        self.sent.fetch_add(n as u64, Ordering::Relaxed);
    }

    fn total(&self) -> u64 {
        self.received.load(Ordering::Relaxed).wrapping_add(self.sent.load(Ordering::Relaxed))
    }
}

/// Watches a byte count for `timeout` without change. It is looked at every quarter of
/// the timeout, so a stall is found between 1 and 1.25 timeouts after the last byte (the
/// hot path only bumps a counter, never reads the clock).
#[derive(Debug)]
struct Watch {
    timeout: Duration,
    seen: u64,
    since: Instant,
}

impl Watch {
    fn new(timeout: Duration, count: u64, now: Instant) -> Self {
        Watch { timeout, seen: count, since: now }
    }

    /// How often to [`Watch::stalled`].
    fn every(&self) -> Duration {
        (self.timeout / 4).max(Duration::from_millis(1))
    }

    /// Whether `count` has not moved for the timeout as of `now`.
    fn stalled(&mut self, count: u64, now: Instant) -> bool {
        if count != self.seen {
            self.seen = count;
            self.since = now;
            return false;
        }
        now.saturating_duration_since(self.since) >= self.timeout
    }
}

/// Runs `fut` while `count` shows progress; `None` once it has not moved for `timeout`.
async fn watched<T>(
    fut: impl std::future::Future<Output = T>,
    count: impl Fn() -> u64,
    timeout: Duration,
) -> Option<T> {
    tokio::pin!(fut);
    let mut watch = Watch::new(timeout, count(), Instant::now());
    loop {
        tokio::select! {
            r = &mut fut => return Some(r),
            _ = tokio::time::sleep(watch.every()) => {
                if watch.stalled(count(), Instant::now()) {
                    return None;
                }
            }
        }
    }
}

/// Default of [`RingNet::progress_timeout`]: generous, since a node may be slowed by its
/// own ranks' work (the local gather of a huge tensor), but bounded.
pub const DEFAULT_PROGRESS_TIMEOUT: Duration = Duration::from_secs(60);

/// The nodes of a job, in ring (= roster) order, and the link state for ring operations.
#[derive(Debug)]
pub struct RingNet {
    transport: Transport,
    rank: usize,
    addrs: Vec<SocketAddr>,
    incoming: Arc<Mutex<mpsc::Receiver<DataStream>>>,
    stash: Stash<quinn::RecvStream>,
    /// Chunk size in bytes (pipelining grain).
    pub chunk_bytes: NonZeroUsize,
    /// Most lanes (QUIC connections) this node sends an operation's data over to the next
    /// node: chunk `c` of every segment travels on lane `c % lanes`. Each connection is
    /// driven by its own task, so lanes let a fast link use several cores.
    pub lanes: NonZeroUsize,
    /// How long to wait for a neighbour to start an operation: its streams, and its first
    /// byte of data (it sends that only once its own previous node started, so a late node
    /// delays the whole ring by as much).
    pub join_timeout: Duration,
    /// How long an operation may go, once the previous node sent its first byte, without a
    /// single byte from it or to the next one before it fails, naming the neighbour
    /// ([`CollectiveError::Stalled`]).
    /// It measures silence, not the whole operation: a huge tensor on a slow link is fine
    /// as long as bytes move.
    pub progress_timeout: Duration,
    /// Send chunks by the data plane where the next node's plane link works (else, and
    /// when `false`, over QUIC streams; `collective::plane_ring`).
    pub use_plane: bool,
    /// Which path carried this node's operations so far (shared: [`RingNet::served_handle`]).
    served: Arc<std::sync::Mutex<super::plane_ring::Served>>,
    /// Neighbours whose plane link was given [`plane_ring::PROBE_WAIT`](super::plane_ring::PROBE_WAIT) to hear back.
    probed: std::collections::HashSet<SocketAddr>,
}

impl RingNet {
    /// A ring over `addrs` (roster order) where this node is `rank`. `incoming` is the
    /// transport's data-stream receiver.
    pub fn new(
        transport: Transport,
        rank: usize,
        addrs: Vec<SocketAddr>,
        incoming: Arc<Mutex<mpsc::Receiver<DataStream>>>,
        config: &RingConfig,
    ) -> Self {
        RingNet {
            transport,
            rank,
            addrs,
            incoming,
            stash: Stash::default(),
            chunk_bytes: config.chunk_bytes,
            lanes: config.lanes.unwrap_or_else(default_lanes),
            join_timeout: config.join_timeout,
            progress_timeout: DEFAULT_PROGRESS_TIMEOUT,
            use_plane: true,
            served: Default::default(),
            probed: Default::default(),
        }
    }

    /// Which path carried this node's ring operations so far.
    pub fn served(&self) -> super::plane_ring::Served {
        *self.served.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counts behind [`RingNet::served`], readable after the ring moved into a task.
    pub fn served_handle(&self) -> Arc<std::sync::Mutex<super::plane_ring::Served>> {
        self.served.clone()
    }

    /// Number of nodes.
    pub fn world(&self) -> usize {
        self.addrs.len()
    }

    /// This node's position.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// QUIC's view of the link to the next node, if connected.
    pub fn next_link_stats(&self) -> Option<crate::transport::PathStats> {
        self.neighbour_stats(1)
    }

    /// QUIC's view of the link from the previous node, if connected.
    pub fn prev_link_stats(&self) -> Option<crate::transport::PathStats> {
        self.neighbour_stats(self.addrs.len().saturating_sub(1))
    }

    /// Path stats of the node `step` places after this one in the ring (none alone).
    fn neighbour_stats(&self, step: usize) -> Option<crate::transport::PathStats> {
        let n = self.addrs.len();
        (n > 1).then(|| self.transport.path_stats(self.addrs[(self.rank + step) % n])).flatten()
    }

    async fn stream_from(&mut self, peer: SocketAddr, op: u64) -> Result<quinn::RecvStream, CollectiveError> {
        if let Some(s) = self.stash.take(peer, op) {
            return Ok(s);
        }
        let deadline = tokio::time::Instant::now() + self.join_timeout;
        let incoming = self.incoming.clone();
        let mut incoming = incoming.lock().await;
        loop {
            let ds = tokio::time::timeout_at(deadline, incoming.recv())
                .await
                .map_err(|_| CollectiveError::Timeout { peer, op, timeout: self.join_timeout })?
                .ok_or_else(|| CollectiveError::Link { peer, reason: "transport stopped".into() })?;
            if ds.from == peer && ds.op == op {
                return Ok(ds.recv);
            }
            // Another operation's stream (a faster neighbour is ahead, or an operation
            // this node gave up on): keep it, and drop that peer's oldest kept stream when
            // it has too many.
            if let Some((old_op, _dropped)) = self.stash.put(ds.from, ds.op, ds.recv) {
                tracing::debug!(peer = %ds.from, op = old_op, "dropped a data stream no operation asked for");
            }
        }
    }

    /// The plane to send to `next` by, if this node runs one and its link to `next` is
    /// ready (given [`PROBE_WAIT`](super::plane_ring::PROBE_WAIT) once per neighbour).
    async fn plane_to(&mut self, next: SocketAddr) -> Option<crate::transport::plane::Plane> {
        let plane = self.transport.plane().filter(|_| self.use_plane)?.clone();
        if !plane.is_ready(next) && self.probed.insert(next) {
            plane.wait_ready(next, super::plane_ring::PROBE_WAIT).await;
        }
        plane.is_ready(next).then_some(plane)
    }

    /// Tells `next` that `op`'s chunks come by the data plane: one data stream holding
    /// only the plane preamble.
    async fn announce_plane(&self, next: SocketAddr, op: u64) -> Result<(), CollectiveError> {
        let link = |e: String| CollectiveError::Link { peer: next, reason: e };
        let mut s = self.transport.open_data_lane(next, op, 0).await?;
        s.write_all(&super::plane_ring::PREAMBLE).await.map_err(|e| link(e.to_string()))?;
        s.finish().map_err(|e| link(e.to_string()))?;
        Ok(())
    }

    /// Opens `lanes` data streams to `next` for `op`, each starting with its lane preamble.
    async fn open_lanes(
        &self,
        next: SocketAddr,
        op: u64,
        lanes: usize,
    ) -> Result<Vec<quinn::SendStream>, CollectiveError> {
        let mut sends = Vec::with_capacity(lanes);
        for lane in 0..lanes {
            let mut s = self.transport.open_data_lane(next, op, lane).await?;
            tokio::time::timeout(self.progress_timeout, s.write_all(&[lane as u8, lanes as u8]))
                .await
                .map_err(|_| self.stalled(next, op, true))?
                .map_err(|e| CollectiveError::Link { peer: next, reason: e.to_string() })?;
            sends.push(s);
        }
        Ok(sends)
    }

    /// The error of an operation whose link with `peer` stalled.
    fn stalled(&self, peer: SocketAddr, op: u64, sending: bool) -> CollectiveError {
        let node = self.transport.node_at(peer);
        CollectiveError::Stalled { peer, node, op, timeout: self.progress_timeout, sending }
    }

    /// The data streams `prev` opened for `op`, in lane order: as many as the first one's
    /// preamble announces, each named once.
    async fn accept_lanes(
        &mut self,
        prev: SocketAddr,
        op: u64,
    ) -> Result<Vec<quinn::RecvStream>, CollectiveError> {
        let link = |reason: String| CollectiveError::Link { peer: prev, reason };
        let mut slots: Vec<Option<quinn::RecvStream>> = Vec::new();
        let mut got = 0;
        loop {
            let mut recv = self.stream_from(prev, op).await?;
            let mut pre = [0u8; LANE_PREAMBLE];
            tokio::time::timeout(self.join_timeout, recv.read_exact(&mut pre))
                .await
                .map_err(|_| CollectiveError::Timeout { peer: prev, op, timeout: self.join_timeout })?
                .map_err(|e| link(format!("lane preamble: {e}")))?;
            if pre == super::plane_ring::PREAMBLE && slots.is_empty() {
                // No streams: the previous node sends this operation by the data plane.
                return Ok(Vec::new());
            }
            let (lane, total) = (pre[0] as usize, pre[1] as usize);
            if total == 0 || total > MAX_LANES || lane >= total {
                return Err(link(format!("bad lane preamble: lane {lane} of {total} (at most {MAX_LANES})")));
            }
            if slots.is_empty() {
                slots.resize_with(total, || None);
            } else if slots.len() != total {
                return Err(link(format!("lanes disagree: {total} announced after {}", slots.len())));
            }
            if slots[lane].replace(recv).is_some() {
                return Err(link(format!("lane {lane} opened twice")));
            }
            got += 1;
            if got == total {
                return Ok(slots.into_iter().flatten().collect());
            }
        }
    }

    /// In-place allreduce of `buf` (little-endian elements of `dtype`) across the nodes.
    /// `op` is applied as given (`Avg` divides by the number of nodes).
    ///
    /// Every chunk this node sends is first copied out of `buf` (QUIC keeps what it sends
    /// until it is acknowledged); [`RingNet::allreduce_buffer`] sends without those copies.
    pub async fn allreduce(
        &mut self,
        op_id: u64,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let n = self.addrs.len();
        self.run_ring(op_id, &mut Plain(buf), dtype, op, n).await
    }

    /// [`RingNet::allreduce`] of a [`CollectiveBuffer`], whose chunks go to the next node
    /// without being copied: lent to the transport, and written again only once the
    /// transport has dropped them. The same result, with less memory traffic; the largest
    /// collectives gain most (docs/PERFORMANCE.md).
    pub async fn allreduce_buffer(
        &mut self,
        op_id: u64,
        buf: &mut CollectiveBuffer,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let n = self.addrs.len();
        self.run_ring(op_id, buf, dtype, op, n).await
    }

    /// [`RingNet::allreduce_buffer`] where `Avg` divides by `divisor` rather than by the
    /// number of nodes: for buffers that already sum several ranks of a node.
    pub(crate) async fn allreduce_buffer_dividing(
        &mut self,
        op_id: u64,
        buf: &mut CollectiveBuffer,
        dtype: DType,
        op: ReduceOp,
        divisor: usize,
    ) -> Result<(), CollectiveError> {
        if self.addrs.len() <= 1 && op == ReduceOp::Avg {
            // No ring to divide where it completes a chunk: divide here.
            let len = buf.len();
            let bytes = buf.try_as_mut().ok_or(CollectiveError::BufferLent { range: 0..len })?;
            let divisor = u32::try_from(divisor).unwrap_or(u32::MAX);
            return Ok(meshd_proto::reduce::finish_avg(dtype, bytes, divisor)?);
        }
        self.run_ring(op_id, buf, dtype, op, divisor).await
    }

    async fn run_ring<M: RingMemory>(
        &mut self,
        op_id: u64,
        buf: &mut M,
        dtype: DType,
        op: ReduceOp,
        divisor: usize,
    ) -> Result<(), CollectiveError> {
        let n = self.addrs.len();
        if buf.len() % dtype.size() != 0 {
            return Err(CollectiveError::Misaligned { len: buf.len(), dtype });
        }
        if n <= 1 {
            return Ok(());
        }
        if is_direct(n, buf.len()) {
            return self.run_direct(op_id, buf, Reduction { dtype, op, divisor }).await;
        }
        let plan =
            RingPlan::new(n, self.rank, buf.len() / dtype.size(), dtype.size(), self.chunk_bytes.get())?;
        let max_chunk = plan.chunk_bytes().max(dtype.size());
        let mut state = RingState::new(plan);
        let next = self.addrs[(self.rank + 1) % n];
        let prev = self.addrs[(self.rank + n - 1) % n];
        // More lanes than chunks per segment would carry nothing.
        let mut lanes = self.lanes.get().min(MAX_LANES).min(state.plan().chunk_count(0).max(1));
        // Chunks larger than the plane carries go over QUIC streams.
        let plane_out =
            if max_chunk <= crate::transport::plane::MAX_CHUNK { self.plane_to(next).await } else { None };
        let sends = match &plane_out {
            Some(plane) => {
                // The plane's own lanes (each a driver task), those both ends run.
                lanes = plane.ready_lanes(next).min(state.plan().chunk_count(0)).max(1);
                self.announce_plane(next, op_id).await?;
                Vec::new()
            }
            None => self.open_lanes(next, op_id, lanes).await?,
        };
        let recvs = self.accept_lanes(prev, op_id).await?;
        let plane_in = match (recvs.is_empty(), self.transport.plane()) {
            (false, _) => None,
            (true, Some(p)) => Some(p.clone()),
            (true, None) => {
                return Err(CollectiveError::Link {
                    peer: prev,
                    reason: "it sends by the data plane, which this node turned off (MESHD_PLANE=0)".into(),
                });
            }
        };
        {
            let mut served = self.served.lock().unwrap_or_else(|p| p.into_inner());
            if plane_out.is_some() {
                served.datagrams += 1;
            } else {
                served.streams += 1;
            }
        }

        let progress = Arc::new(Progress::default());
        let mut wtxs = Vec::with_capacity(lanes);
        let mut writers = Vec::with_capacity(lanes);
        for send in sends {
            let (wtx, wrx) = mpsc::channel::<(u64, Bytes)>(64);
            wtxs.push(wtx);
            writers.push(tokio::spawn(write_frames(send, wrx, next, progress.clone())));
        }
        let (rtx, mut rrx) = mpsc::channel::<Result<(u64, Vec<Bytes>), CollectiveError>>(64);
        if let Some(plane) = plane_out {
            for lane in 0..lanes {
                let (wtx, wrx) = mpsc::channel::<(u64, Bytes)>(64);
                wtxs.push(wtx);
                writers.push(tokio::spawn(super::plane_ring::write_chunks(
                    plane.clone(),
                    next,
                    lane,
                    op_id,
                    wrx,
                    progress.clone(),
                    rtx.downgrade(),
                )));
            }
        }
        let mut readers: Vec<_> = recvs
            .into_iter()
            .map(|recv| tokio::spawn(read_frames(recv, rtx.clone(), prev, max_chunk, progress.clone())))
            .collect();
        if let Some(plane) = plane_in {
            readers.push(tokio::spawn(super::plane_ring::read_chunks(
                plane,
                prev,
                op_id,
                rtx.clone(),
                max_chunk,
                progress.clone(),
            )));
        }
        drop(rtx); // the channel closes when every reader has ended
        // The bytes received chunks go on as, made while applying them, by range start.
        let mut forwards: HashMap<usize, (std::ops::Range<usize>, Bytes)> = HashMap::new();
        // A chunk its lane's queue had no room for: (lane, transfer id, bytes).
        let mut pending: Option<(usize, u64, Bytes)> = None;
        // Received chunks whose range is still lent to the transport (being sent, or not
        // yet acknowledged), in arrival order: applied once the loan ends.
        let mut deferred: VecDeque<(u64, Vec<Bytes>)> = VecDeque::new();
        let mut waited = 0usize;
        let released = buf.released();
        let how = Reduction { dtype, op, divisor };
        let writer_stopped = || CollectiveError::Link { peer: next, reason: "writer stopped".into() };
        let started = Instant::now();
        let mut watch = Watch::new(self.progress_timeout, progress.total(), started);
        let mut check_at = tokio::time::Instant::now() + watch.every();
        let result = async {
            loop {
                // Hand every sendable chunk to its lane's writer while the queues take them.
                loop {
                    let (lane, id, bytes) = match pending.take() {
                        Some(p) => p,
                        None => match state.poll_send() {
                            // One contiguous buffer per chunk (forwarding quinn's received
                            // pieces, about a packet each, measured slower: docs/PERFORMANCE.md):
                            // what a received chunk became, or a node's own step-0 chunk.
                            Some(t) => {
                                let bytes = match forwards.remove(&t.range.start) {
                                    Some((range, bytes)) if range == t.range => bytes,
                                    _ => buf.send(t.range.clone()),
                                };
                                (t.chunk_index % lanes, t.id(), bytes)
                            }
                            None => break,
                        },
                    };
                    match wtxs[lane].try_send((id, bytes)) {
                        Ok(()) => {}
                        Err(mpsc::error::TrySendError::Full((id, bytes))) => {
                            pending = Some((lane, id, bytes));
                            break;
                        }
                        Err(mpsc::error::TrySendError::Closed(_)) => return Err(writer_stopped()),
                    }
                }
                if state.is_done() && pending.is_none() {
                    return Ok(());
                }
                // Wait for room on the full lane, for the next chunk from the previous node,
                // or for a loan to end, whichever comes first. Waiting for room alone
                // deadlocks the ring once a segment outgrows the queues and windows of a
                // link (about 144 MiB at 1 MiB chunks): every node would wait to send and
                // none would read. For the same reason a chunk whose range is still lent
                // is set aside rather than waited for: reading goes on.
                let blocked = pending.as_ref().map_or(0, |p| p.0);
                let receiving = state.recvs_left() > deferred.len();
                let waiting = pending.is_some() || receiving || !deferred.is_empty();
                tokio::select! {
                    permit = wtxs[blocked].reserve(), if pending.is_some() => {
                        let permit = permit.map_err(|_| writer_stopped())?;
                        if let Some((_, id, bytes)) = pending.take() {
                            permit.send((id, bytes));
                        }
                    }
                    msg = rrx.recv(), if state.recvs_left() > deferred.len() => {
                        let (id, parts) = msg.ok_or_else(|| CollectiveError::Link {
                            peer: prev,
                            reason: "stream ended early".into(),
                        })??;
                        let range = state.expect(id)?.range;
                        if buf.is_lent(&range) {
                            waited += 1;
                            deferred.push_back((id, parts));
                        } else {
                            apply_received(&mut state, buf, &mut forwards, id, &parts, how)?;
                        }
                    }
                    _ = released.notified(), if !deferred.is_empty() => {
                        for _ in 0..deferred.len() {
                            let Some((id, parts)) = deferred.pop_front() else { break };
                            if buf.is_lent(&state.expect(id)?.range) {
                                deferred.push_back((id, parts));
                            } else {
                                apply_received(&mut state, buf, &mut forwards, id, &parts, how)?;
                            }
                        }
                    }
                    // Silence from the previous node (or, with only sends left, the next
                    // node taking nothing) for the progress timeout ends the operation.
                    _ = tokio::time::sleep_until(check_at), if waiting => {
                        check_at += watch.every();
                        let now = Instant::now();
                        // Until its first byte the previous node may still wait for its own
                        // previous node to join (a late rank's local work): a join wait.
                        if receiving && progress.received.load(Ordering::Relaxed) == 0 {
                            if now.saturating_duration_since(started) >= self.join_timeout {
                                return Err(CollectiveError::Timeout { peer: prev, op: op_id, timeout: self.join_timeout });
                            }
                            watch = Watch::new(self.progress_timeout, progress.total(), now);
                        } else if watch.stalled(progress.total(), now) {
                            return Err(if receiving {
                                self.stalled(prev, op_id, false)
                            } else {
                                self.stalled(next, op_id, true)
                            });
                        }
                    }
                    else => {
                        return Err(CollectiveError::Link { peer: prev, reason: "ring stalled: nothing to send or receive".into() });
                    }
                }
            }
        }
        .await;
        drop(wtxs);
        let mut w = Ok(());
        if matches!(result, Err(CollectiveError::Stalled { sending: true, .. })) {
            // The next node takes nothing: its writers would only wait out another timeout.
            // After other failures they send what they hold (the next node then reads why,
            // say a ring frame where it expected a direct contribution), watched as below.
            for writer in &writers {
                writer.abort();
            }
        }
        let sent = || progress.sent.load(Ordering::Relaxed);
        for mut writer in writers {
            if w.is_err() {
                writer.abort();
                continue;
            }
            w = match watched(&mut writer, sent, self.progress_timeout).await {
                Some(Ok(r)) => r,
                Some(Err(e)) if e.is_cancelled() => Ok(()),
                Some(Err(e)) => Err(CollectiveError::Link { peer: next, reason: e.to_string() }),
                None => {
                    writer.abort();
                    Err(self.stalled(next, op_id, true))
                }
            };
        }
        for reader in readers {
            reader.abort();
        }
        if waited > 0 {
            tracing::debug!(
                "ring operation {op_id}: {} waited for their range to come back from QUIC",
                crate::plural(waited as u64, "received chunk")
            );
        }
        result?;
        w
    }
}

impl RingNet {
    /// A small allreduce in one hop ([`is_direct`]): this node's buffer goes to every other
    /// node at once, and each node reduces all of them in rank order itself.
    async fn run_direct<M: RingMemory>(
        &mut self,
        op_id: u64,
        buf: &mut M,
        how: Reduction,
    ) -> Result<(), CollectiveError> {
        let (n, len) = (self.addrs.len(), buf.len());
        // A copy, never a loan: this node overwrites its buffer as soon as it has every
        // contribution, without waiting for the others' ACKs.
        let mine = buf.copy(0..len);
        let mut writers = Vec::with_capacity(n - 1);
        for (i, &peer) in self.addrs.iter().enumerate() {
            if i == self.rank {
                continue;
            }
            let mut send = self.transport.open_data_lane(peer, op_id, 0).await?;
            // The stream a one-lane ring would open, holding one frame.
            let mut parts = [
                Bytes::from_static(&[0, 1]),
                Bytes::copy_from_slice(&encode_chunk_header(DIRECT_TRANSFER_ID, len as u32)),
                mine.clone(),
            ];
            let task = tokio::spawn(async move {
                send.write_all_chunks(&mut parts).await.map_err(|e| e.to_string())?;
                send.finish().map_err(|e| e.to_string())
            });
            writers.push((peer, task));
        }
        let mut contributions = Vec::with_capacity(n);
        for (i, &peer) in self.addrs.clone().iter().enumerate() {
            if i == self.rank {
                contributions.push(mine.clone());
                continue;
            }
            let mut recv = self.stream_from(peer, op_id).await?;
            // At most 64 KiB: all of it within the progress timeout.
            let got = tokio::time::timeout(self.progress_timeout, read_direct(&mut recv, len))
                .await
                .map_err(|_| self.stalled(peer, op_id, false))?
                .map_err(|reason| CollectiveError::Link { peer, reason })?;
            contributions.push(got);
        }
        let mut out = vec![0u8; len];
        direct_reduce(&contributions, how, &mut out)?;
        // A loan from an earlier, larger operation on this buffer ends at its ACK.
        let released = buf.released();
        while buf.is_lent(&(0..len)) {
            released.notified().await;
        }
        buf.overwrite(&out)?;
        for (peer, mut writer) in writers {
            let Ok(done) = tokio::time::timeout(self.progress_timeout, &mut writer).await else {
                writer.abort();
                return Err(self.stalled(peer, op_id, true));
            };
            done.map_err(|e| e.to_string())
                .and_then(|r| r)
                .map_err(|reason| CollectiveError::Link { peer, reason })?;
        }
        Ok(())
    }
}

/// Reads a direct contribution of `len` bytes: a one-lane preamble and one frame.
async fn read_direct(recv: &mut quinn::RecvStream, len: usize) -> Result<Bytes, String> {
    let mut pre = [0u8; LANE_PREAMBLE];
    recv.read_exact(&mut pre).await.map_err(|e| format!("direct contribution: {e}"))?;
    let mut head = [0u8; CHUNK_HEADER_LEN];
    recv.read_exact(&mut head).await.map_err(|e| format!("direct contribution: {e}"))?;
    // The id first: a ring frame (a node that did not go direct) is named as such.
    let (id, got) = decode_chunk_header(&head, usize::MAX).map_err(|e| e.to_string())?;
    if pre != [0, 1] || id != DIRECT_TRANSFER_ID {
        return Err(format!(
            "it sent ring transfer {id:#x}, not a direct contribution: does it run another meshd, or an allreduce of another size?"
        ));
    }
    if got != len {
        return Err(format!("it contributed {got} bytes to an allreduce of {len} bytes here"));
    }
    let mut data = vec![0u8; len];
    recv.read_exact(&mut data).await.map_err(|e| format!("direct contribution: {e}"))?;
    Ok(Bytes::from(data))
}

/// Accepts received transfer `id` and applies it to `buf` (whose range for it is not
/// lent), keeping the bytes that go on to the next node. `Avg` divides by `divisor`.
fn apply_received<M: RingMemory>(
    state: &mut RingState,
    buf: &mut M,
    forwards: &mut HashMap<usize, (std::ops::Range<usize>, Bytes)>,
    id: u64,
    parts: &[Bytes],
    how: Reduction,
) -> Result<(), CollectiveError> {
    let len = parts.iter().map(|p| p.len()).sum();
    let action = state.on_received(id, len)?;
    if let Some(bytes) = buf.apply(&action, parts, how)? {
        forwards.insert(action.range().start, (action.range(), bytes));
    }
    Ok(())
}

/// What the ring driver needs of the memory it reduces in: a plain slice (chunks sent are
/// copies) or a [`CollectiveBuffer`] (chunks sent are loans).
trait RingMemory {
    fn len(&self) -> usize;
    /// Whether part of `range` is lent to the transport (and must not be written yet).
    fn is_lent(&self, range: &std::ops::Range<usize>) -> bool;
    /// The bytes of `range` to send as they are (a node's own step-0 chunks).
    fn send(&self, range: std::ops::Range<usize>) -> Bytes;
    /// A copy of the bytes of `range`.
    fn copy(&self, range: std::ops::Range<usize>) -> Bytes;
    /// Applies `action` (its range is not lent) and returns the bytes to send on, if any.
    fn apply(
        &mut self,
        action: &Action,
        parts: &[Bytes],
        how: Reduction,
    ) -> Result<Option<Bytes>, CollectiveError>;
    /// Notified when a loan ends.
    fn released(&self) -> Arc<Notify>;
    /// Replaces the whole buffer's bytes with `src` (nothing of it is lent).
    fn overwrite(&mut self, src: &[u8]) -> Result<(), CollectiveError>;
}

/// A caller's slice: every chunk sent is a copy.
struct Plain<'a>(&'a mut [u8]);

impl RingMemory for Plain<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn is_lent(&self, _: &std::ops::Range<usize>) -> bool {
        false
    }
    fn send(&self, range: std::ops::Range<usize>) -> Bytes {
        self.copy(range)
    }
    fn copy(&self, range: std::ops::Range<usize>) -> Bytes {
        Bytes::copy_from_slice(&self.0[range])
    }
    fn apply(
        &mut self,
        action: &Action,
        parts: &[Bytes],
        how: Reduction,
    ) -> Result<Option<Bytes>, CollectiveError> {
        // Reduce or copy straight from the received pieces (no gathering copy), making
        // the bytes sent on in the same pass.
        Ok(action.apply_forward(self.0, parts, how)?.map(Bytes::from))
    }
    fn released(&self) -> Arc<Notify> {
        Arc::new(Notify::new()) // nothing is lent
    }
    fn overwrite(&mut self, src: &[u8]) -> Result<(), CollectiveError> {
        self.0.copy_from_slice(src);
        Ok(())
    }
}

impl RingMemory for CollectiveBuffer {
    fn len(&self) -> usize {
        CollectiveBuffer::len(self)
    }
    fn is_lent(&self, range: &std::ops::Range<usize>) -> bool {
        CollectiveBuffer::is_lent(self, range)
    }
    fn send(&self, range: std::ops::Range<usize>) -> Bytes {
        self.lend(range)
    }
    fn copy(&self, range: std::ops::Range<usize>) -> Bytes {
        Bytes::copy_from_slice(&self.as_slice()[range])
    }
    fn apply(
        &mut self,
        action: &Action,
        parts: &[Bytes],
        how: Reduction,
    ) -> Result<Option<Bytes>, CollectiveError> {
        let range = action.range();
        let dst = self
            .range_mut(range.clone())
            .ok_or_else(|| CollectiveError::BufferLent { range: range.clone() })?;
        // In place; what goes on is a loan of the result (a partial sum until the
        // last reduce-scatter step, which the all-gather overwrites once the loan ends).
        action.apply_to(dst, parts, how)?;
        Ok((!matches!(action, Action::Copy { last: true, .. })).then(|| self.lend(range)))
    }
    fn released(&self) -> Arc<Notify> {
        CollectiveBuffer::released(self)
    }
    fn overwrite(&mut self, src: &[u8]) -> Result<(), CollectiveError> {
        let len = src.len();
        let dst = self.range_mut(0..len).ok_or(CollectiveError::BufferLent { range: 0..len })?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

impl RingNet {
    /// Copies `buf` of node `root` (roster order) into `buf` of every node, byte for byte,
    /// any length. Runs as a ring allreduce of wrapping 64-bit integer sums in which every
    /// other node contributes zeros, so it costs what an allreduce of that size costs.
    pub async fn broadcast(
        &mut self,
        op_id: u64,
        buf: &mut [u8],
        root: usize,
    ) -> Result<(), CollectiveError> {
        let n = self.addrs.len();
        if root >= n {
            return Err(CollectiveError::NoSuchRoot { root, world: n });
        }
        if n <= 1 {
            return Ok(());
        }
        let mut words = vec![0u8; buf.len().div_ceil(8) * 8];
        if self.rank == root {
            words[..buf.len()].copy_from_slice(buf);
        }
        self.allreduce(op_id, &mut words, DType::I64, ReduceOp::Sum).await?;
        buf.copy_from_slice(&words[..buf.len()]);
        Ok(())
    }

    /// Returns once every node has called `barrier` with this `op_id`.
    pub async fn barrier(&mut self, op_id: u64) -> Result<(), CollectiveError> {
        self.allreduce(op_id, &mut [0u8; 8], DType::I64, ReduceOp::Sum).await
    }

    /// The transport's own ceiling for a ring: every node streams `data` to the next node
    /// while reading as many bytes from the previous one, with no framing, no reduction and
    /// no copies. A ring allreduce of S bytes moves 2(n-1)/n x S per link, so compare its
    /// busbw with `data.len() / time` of this.
    ///
    /// Pass a buffer as large as the transfer, as a ring's is: repeating one small
    /// cache-resident block makes this ceiling higher than any real transfer of that size
    /// reaches (docs/PERFORMANCE.md, "The bare ring's buffer").
    pub async fn stream_ceiling(&mut self, op_id: u64, data: Vec<u8>) -> Result<Duration, CollectiveError> {
        let bytes = data.len();
        let data = Bytes::from(data); // no copy
        let n = self.addrs.len();
        if n <= 1 {
            return Ok(Duration::ZERO);
        }
        let next = self.addrs[(self.rank + 1) % n];
        let prev = self.addrs[(self.rank + n - 1) % n];
        let lanes = self.lanes.get().min(MAX_LANES);
        let start = tokio::time::Instant::now();
        let sends = self.open_lanes(next, op_id, lanes).await?;
        let recvs = self.accept_lanes(prev, op_id).await?;
        // Lane l sends the l-th of `lanes` contiguous parts, in 1 MiB writes.
        let part = bytes.div_ceil(lanes);
        let writers: Vec<_> = sends
            .into_iter()
            .enumerate()
            .map(|(l, mut send)| {
                let data = data.clone();
                tokio::spawn(async move {
                    let (mut off, end) = ((l * part).min(bytes), ((l + 1) * part).min(bytes));
                    while off < end {
                        let b = data.slice(off..end.min(off + (1 << 20)));
                        off += b.len();
                        send.write_chunk(b).await.map_err(|e| e.to_string())?;
                    }
                    send.finish().map_err(|e| e.to_string())
                })
            })
            .collect();
        let readers: Vec<_> = recvs
            .into_iter()
            .map(|mut recv| {
                tokio::spawn(async move {
                    let mut got = 0usize;
                    while let Some(c) = recv.read_chunk(usize::MAX, true).await.map_err(|e| e.to_string())? {
                        got += c.bytes.len();
                    }
                    Ok::<usize, String>(got)
                })
            })
            .collect();
        let mut got = 0usize;
        for reader in readers {
            got += reader
                .await
                .map_err(|e| CollectiveError::Link { peer: prev, reason: e.to_string() })?
                .map_err(|reason| CollectiveError::Link { peer: prev, reason })?;
        }
        if got != bytes {
            return Err(CollectiveError::Link {
                peer: prev,
                reason: format!("received {got} bytes of {bytes}"),
            });
        }
        for writer in writers {
            writer
                .await
                .map_err(|e| CollectiveError::Link { peer: next, reason: e.to_string() })?
                .map_err(|reason| CollectiveError::Link { peer: next, reason })?;
        }
        Ok(start.elapsed())
    }
}

async fn write_frames(
    mut send: quinn::SendStream,
    mut rx: mpsc::Receiver<(u64, Bytes)>,
    peer: SocketAddr,
    progress: Arc<Progress>,
) -> Result<(), CollectiveError> {
    let link = |e: String| CollectiveError::Link { peer, reason: e };
    while let Some((id, payload)) = rx.recv().await {
        let head = encode_chunk_header(id, payload.len() as u32);
        let n = head.len() + payload.len();
        let mut parts = [Bytes::copy_from_slice(&head), payload];
        send.write_all_chunks(&mut parts).await.map_err(|e| link(e.to_string()))?;
        progress.sent(n);
    }
    // Finishing is enough: quinn still delivers (and retransmits) a finished stream after
    // it is dropped. Waiting for the peer's ACK here would add its delayed-ACK timer
    // (25 ms) to every operation.
    send.finish().map_err(|e| link(e.to_string()))?;
    Ok(())
}

async fn read_frames(
    mut recv: quinn::RecvStream,
    tx: mpsc::Sender<Result<(u64, Vec<Bytes>), CollectiveError>>,
    peer: SocketAddr,
    max_chunk: usize,
    progress: Arc<Progress>,
) {
    loop {
        let mut head = [0u8; CHUNK_HEADER_LEN];
        match recv.read_exact(&mut head).await {
            Ok(()) => progress.received(CHUNK_HEADER_LEN),
            Err(quinn::ReadExactError::FinishedEarly(0)) => return,
            Err(e) => {
                let _ = tx.send(Err(CollectiveError::Link { peer, reason: e.to_string() })).await;
                return;
            }
        }
        let (id, len) = match decode_chunk_header(&head, max_chunk) {
            Ok(h) => h,
            Err(e) => {
                let _ = tx.send(Err(CollectiveError::Link { peer, reason: e.to_string() })).await;
                return;
            }
        };
        // Keep quinn's received pieces as they are (no copy): the reduction reads them in
        // place and the all-gather forwards them.
        let mut payload = Vec::new();
        let mut got = 0;
        while got < len {
            match recv.read_chunk(len - got, true).await {
                Ok(Some(c)) => {
                    got += c.bytes.len();
                    progress.received(c.bytes.len());
                    payload.push(c.bytes);
                }
                Ok(None) => {
                    let reason = format!("stream ended inside a {len}-byte chunk");
                    let _ = tx.send(Err(CollectiveError::Link { peer, reason })).await;
                    return;
                }
                Err(e) => {
                    let _ = tx.send(Err(CollectiveError::Link { peer, reason: e.to_string() })).await;
                    return;
                }
            }
        }
        if tx.send(Ok((id, payload))).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{CollectiveError, STASH_PER_PEER, Stash, Watch, watched};
    use meshd_proto::NodeId;
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    #[test]
    fn a_watch_measures_silence_not_the_whole_operation() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let mut w = Watch::new(Duration::from_secs(60), 0, t0);
        assert_eq!(w.every(), Duration::from_secs(15));
        assert!(!w.stalled(0, s(59)));
        // A byte at 59 s: the clock starts again.
        assert!(!w.stalled(1, s(59)));
        assert!(!w.stalled(1, s(118)));
        assert!(w.stalled(1, s(119)), "60 s without a byte");
        // Hours of steady progress never stall.
        let mut w = Watch::new(Duration::from_secs(60), 0, t0);
        for i in 1..1000 {
            assert!(!w.stalled(i, s(i * 15)));
        }
    }

    #[tokio::test]
    async fn watched_ends_a_silent_wait_and_lets_a_moving_one_finish() {
        let count = std::sync::atomic::AtomicU64::new(0);
        let t = Instant::now();
        let silent = watched(std::future::pending::<()>(), || 0, Duration::from_millis(200)).await;
        assert!(silent.is_none());
        assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_millis(600));
        // Slower than the timeout in all, but never silent for it.
        let moving = async {
            for _ in 0..8 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            7
        };
        let got =
            watched(moving, || count.load(std::sync::atomic::Ordering::Relaxed), Duration::from_millis(200));
        assert_eq!(got.await, Some(7));
    }

    #[test]
    fn a_stall_names_the_node_the_direction_and_the_operation() {
        let peer: SocketAddr = "198.19.0.7:29400".parse().expect("addr");
        let node = NodeId::from_u128(0x0a1b_2c3d_4e5f << 80);
        let e = CollectiveError::Stalled {
            peer,
            node: Some(node),
            op: 5,
            timeout: Duration::from_secs(60),
            sending: false,
        };
        assert_eq!(
            e.to_string(),
            format!(
                "no data from node {node} (198.19.0.7:29400) for 60s in collective operation #5: its link is up, but its collective stalled"
            )
        );
        let e = CollectiveError::Stalled {
            peer,
            node: None,
            op: (2 << 40) | 9,
            timeout: Duration::from_secs(1),
            sending: true,
        };
        assert_eq!(
            e.to_string(),
            "node 198.19.0.7:29400 took no data for 1s in collective operation #9 (restart round 2): its link is up, but its collective stalled"
        );
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn stash_gives_each_stream_back_once_by_peer_and_operation() {
        let mut s = Stash::default();
        assert!(s.put(addr(1), 7, "a").is_none());
        assert!(s.put(addr(2), 7, "b").is_none());
        assert!(s.put(addr(1), 7, "c").is_none());
        assert_eq!(s.take(addr(1), 8), None);
        assert_eq!(s.take(addr(2), 7), Some("b"));
        assert_eq!(s.take(addr(2), 7), None);
        assert_eq!(s.take(addr(1), 7), Some("a"));
        assert_eq!(s.take(addr(1), 7), Some("c"));
        assert_eq!(s.take(addr(1), 7), None);
    }

    #[test]
    fn stash_drops_a_peers_oldest_streams_beyond_its_share() {
        let mut s = Stash::default();
        // Streams of operations 0.. from one peer that no operation here asks for, and one
        // from another peer that must survive them.
        assert!(s.put(addr(2), 1000, 1000u64).is_none());
        let mut dropped = Vec::new();
        for op in 0..(STASH_PER_PEER as u64 + 5) {
            if let Some((old, t)) = s.put(addr(1), op, op) {
                assert_eq!(old, t);
                dropped.push(old);
            }
        }
        assert_eq!(dropped, vec![0, 1, 2, 3, 4], "the oldest go first");
        assert_eq!(s.take(addr(1), 4), None);
        assert_eq!(s.take(addr(1), 5), Some(5));
        assert_eq!(s.take(addr(1), STASH_PER_PEER as u64 + 4), Some(STASH_PER_PEER as u64 + 4));
        assert_eq!(s.take(addr(2), 1000), Some(1000));
    }
}
