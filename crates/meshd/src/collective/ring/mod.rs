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

use crate::collective::buffer::CollectiveBuffer;
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

mod direct;
mod error;
mod framing;
mod memory;
mod progress;
mod pump;
mod stash;
#[cfg(test)]
mod tests;

pub use error::CollectiveError;
use framing::{read_frames, write_frames};
use memory::{Plain, RingMemory, apply_received};
pub(super) use progress::Progress;
use progress::{Watch, watched};
use stash::Stash;

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

/// A chunk received from the previous node.
#[derive(Debug)]
pub(crate) enum Chunk {
    /// Its payload, in order.
    Parts(Vec<Bytes>),
    /// Already reduced into the buffer as its datagrams opened (the plane's direct sink,
    /// `plane_ring::RingSink`), except `rest`: (offset in the chunk, bytes), normally none.
    Applied { len: usize, rest: Vec<(usize, Bytes)> },
}

impl Chunk {
    /// Its payload's length in bytes.
    pub(crate) fn len(&self) -> usize {
        match self {
            Chunk::Parts(parts) => parts.iter().map(Bytes::len).sum(),
            Chunk::Applied { len, .. } => *len,
        }
    }
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
    served: Arc<std::sync::Mutex<crate::collective::plane_ring::Served>>,
    /// Neighbours whose plane link was given [`plane_ring::PROBE_WAIT`](crate::collective::plane_ring::PROBE_WAIT) to hear back.
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
    pub fn served(&self) -> crate::collective::plane_ring::Served {
        *self.served.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counts behind [`RingNet::served`], readable after the ring moved into a task.
    pub fn served_handle(&self) -> Arc<std::sync::Mutex<crate::collective::plane_ring::Served>> {
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
    /// ready (given [`PROBE_WAIT`](crate::collective::plane_ring::PROBE_WAIT) once per neighbour).
    async fn plane_to(&mut self, next: SocketAddr) -> Option<crate::transport::plane::Plane> {
        let plane = self.transport.plane().filter(|_| self.use_plane)?.clone();
        if !plane.is_ready(next) && self.probed.insert(next) {
            plane.wait_ready(next, crate::collective::plane_ring::PROBE_WAIT).await;
        }
        plane.is_ready(next).then_some(plane)
    }

    /// Tells `next` that `op`'s chunks come by the data plane: one data stream holding
    /// only the plane preamble.
    async fn announce_plane(&self, next: SocketAddr, op: u64) -> Result<(), CollectiveError> {
        let link = |e: String| CollectiveError::Link { peer: next, reason: e };
        let mut s = self.transport.open_data_lane(next, op, 0).await?;
        s.write_all(&crate::collective::plane_ring::PREAMBLE).await.map_err(|e| link(e.to_string()))?;
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
            if pre == crate::collective::plane_ring::PREAMBLE && slots.is_empty() {
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
