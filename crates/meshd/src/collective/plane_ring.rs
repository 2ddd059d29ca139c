//! The ring's chunks over the data plane (`transport::plane`) instead of QUIC streams.
//!
//! The sending node decides, per operation: it uses the plane when its plane link to the
//! next node is ready (the peer acknowledged its full-size probe: datagrams get through
//! both ways and the next node runs the plane), and says so on the operation's first data stream with the preamble
//! [`PREAMBLE`] instead of a lane preamble; the stream carries nothing else. The receiving
//! node then takes the operation's chunks from the plane. A node that turned the plane off
//! never answers on it, so its neighbours use QUIC streams with it; a node whose link is
//! not ready after [`PROBE_WAIT`] does too.

use super::buffer::SharedWriter;
use super::ring::{Chunk, CollectiveError, Progress};
use crate::transport::plane::{Claim, Delivery, DirectSink, Plane};
use bytes::Bytes;
use meshd_proto::reduce::{DType, ReduceOp};
use meshd_proto::ring::{Phase, RingState};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::mpsc;

/// The data stream preamble that says "this operation's chunks come by the data plane":
/// a lane preamble of 0 lanes, which no meshd before the plane accepts.
pub const PREAMBLE: [u8; 2] = [0xFF, 0];

/// How long a ring waits, once per neighbour, for the plane link to hear back from it.
pub const PROBE_WAIT: Duration = Duration::from_millis(300);

/// Which path carried a ring's chunks, counted per operation sent.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// Operations whose chunks went by the data plane.
    pub datagrams: u64,
    /// Operations whose chunks went over QUIC streams.
    pub streams: u64,
}

impl Served {
    /// What a summary says: "data plane: datagrams", "QUIC streams", or both with counts.
    pub fn line(&self) -> String {
        match (self.datagrams, self.streams) {
            (0, 0) => "none (no ring operation sent)".to_string(),
            (_, 0) => "data plane: datagrams".to_string(),
            (0, _) => "QUIC streams".to_string(),
            (d, s) => format!(
                "data plane: datagrams for {}, QUIC streams for {}",
                crate::plural(d, "operation"),
                crate::plural(s, "operation")
            ),
        }
    }
}

/// Chunks the plane still holds: counted down as the plane drops each (once the next node
/// acknowledged all of it).
#[derive(Default)]
struct Outstanding {
    count: std::sync::atomic::AtomicUsize,
    done: tokio::sync::Notify,
}

/// A chunk as the plane holds it: the ring's bytes, counted in [`Outstanding`] until
/// dropped, and then as bytes sent (the operation's progress).
struct Tracked {
    bytes: Bytes,
    outstanding: Arc<Outstanding>,
    progress: Arc<Progress>,
}

impl AsRef<[u8]> for Tracked {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.progress.sent(self.bytes.len());
        if self.outstanding.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.outstanding.done.notify_one();
        }
    }
}

/// Hands the chunks the ring queues for `next` to the plane until the ring closes the
/// queue, then waits until the next node acknowledged every one: when the operation ends,
/// the plane holds none of its chunks (a lent range of the caller's buffer is the caller's
/// again; on QUIC streams, quinn may still hold one for a while). While chunks are
/// outstanding, a link that stops getting through (`plane::SILENCE`) ends the operation:
/// the error goes to `errors` (the ring's receive queue, which the ring reads while it
/// waits for chunks; weak, so that the queue still closes when its readers end) as well
/// as to the caller.
pub(super) async fn write_chunks(
    credit: Arc<SendCredit>,
    lane: usize,
    mut chunks: mpsc::Receiver<(u64, Bytes)>,
    progress: Arc<Progress>,
    errors: mpsc::WeakSender<Result<(u64, Chunk), CollectiveError>>,
) -> Result<(), CollectiveError> {
    let (plane, next, op) = (&credit.plane, credit.next, credit.op);
    let outstanding = Arc::new(Outstanding::default());
    let mut granted = credit.granted.granted();
    // A chunk taken from the ring that waits for the next node's credit.
    let mut held: Option<(u64, Bytes)> = None;
    let silent = || CollectiveError::Link {
        peer: next,
        reason: format!(
            "data plane datagrams to it stopped getting through (nothing acknowledged for {}s); \
             its next ring operations use QUIC streams",
            crate::transport::plane::SILENCE.as_secs()
        ),
    };
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut open = true;
    loop {
        // Within the credit (the lanes share it; each may pass it by the one chunk it
        // sends on the last credit it saw), a held chunk goes to the plane.
        if let Some((id, bytes)) = held.take_if(|_| credit.sent.load(Ordering::Acquire) < *granted.borrow()) {
            credit.sent.fetch_add(bytes.len() as u64, Ordering::AcqRel);
            outstanding.count.fetch_add(1, Ordering::AcqRel);
            let tracked = Bytes::from_owner(Tracked {
                bytes,
                outstanding: outstanding.clone(),
                progress: progress.clone(),
            });
            // Lent, not copied: the link copies each fragment once, into the datagram it
            // seals.
            plane
                .send(next, lane, op, id, tracked)
                .map_err(|reason| CollectiveError::Link { peer: next, reason })?;
        }
        let waiting = outstanding.count.load(Ordering::Acquire);
        if !open && waiting == 0 && held.is_none() {
            return Ok(());
        }
        if waiting > 0 && plane.ready_lanes(next) <= lane {
            if let Some(errors) = errors.upgrade() {
                let _ = errors.try_send(Err(silent()));
            }
            return Err(silent());
        }
        let done = outstanding.done.notified();
        tokio::select! {
            chunk = chunks.recv(), if open && held.is_none() => match chunk {
                Some(c) => held = Some(c),
                None => open = false,
            },
            // A new grant, or another lane's send (which may have used it up): look again.
            _ = granted.changed(), if held.is_some() => {}
            _ = done, if !open => {}
            _ = tick.tick() => {}
        }
    }
}

/// What an operation's writers (one per lane) may send to the next node: the credit it
/// grants ([`crate::transport::plane::RING_WINDOW`] at first) against the payload bytes
/// they handed to the plane, all lanes together.
pub(super) struct SendCredit {
    plane: Plane,
    next: SocketAddr,
    op: u64,
    granted: crate::transport::plane::RingCredit,
    sent: std::sync::atomic::AtomicU64,
}

impl SendCredit {
    pub(super) fn new(plane: &Plane, next: SocketAddr, op: u64) -> Arc<SendCredit> {
        Arc::new(SendCredit {
            plane: plane.clone(),
            next,
            op,
            granted: plane.ring_credit(next, op),
            sent: Default::default(),
        })
    }
}

/// The credit this node grants the previous node's sending of one operation: a window
/// beyond what the ring took from its receive queue, granted anew once less than half a
/// window is left. Counted where the ring takes a chunk, not where it drops the chunk's
/// pieces: a chunk whose range is still lent waits on the next node, which may wait on
/// this node's credit in turn (around the ring, a cycle).
pub(super) struct RecvCredit {
    plane: Plane,
    prev: SocketAddr,
    op: u64,
    taken: u64,
    granted: u64,
}

impl RecvCredit {
    pub(super) fn new(plane: Plane, prev: SocketAddr, op: u64) -> RecvCredit {
        RecvCredit { plane, prev, op, taken: 0, granted: crate::transport::plane::RING_WINDOW }
    }

    /// The ring took a chunk of `len` payload bytes.
    pub(super) fn took(&mut self, len: usize) -> Result<(), CollectiveError> {
        const WINDOW: u64 = crate::transport::plane::RING_WINDOW;
        self.taken += len as u64;
        if self.granted.saturating_sub(self.taken) < WINDOW / 2 {
            self.granted = self.taken + WINDOW;
            self.plane
                .grant_ring(self.prev, self.op, self.granted)
                .map_err(|reason| CollectiveError::Link { peer: self.prev, reason })?;
        }
        Ok(())
    }
}

/// Ends a subscription however its reader ends (the ring aborts readers when done).
struct Subscription {
    plane: Plane,
    peer: SocketAddr,
    op: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.plane.unsubscribe(self.peer, self.op);
    }
}

/// Whether the plane's driver may reduce ring chunks as their datagrams open
/// (`MESHD_PLANE_DIRECT=0` turns it off, read once).
pub(super) fn direct_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MESHD_PLANE_DIRECT").map_or(true, |v| v.trim() != "0"))
}

/// The ring's [`DirectSink`]: the plane's driver reduces each datagram of a reduce-scatter
/// chunk into the ring's buffer as it opens, or copies an all-gather chunk's, while its
/// bytes are in cache, instead of holding the receive buffer until the chunk is whole and
/// the ring applies it from there.
///
/// What keeps it sound: a chunk is claimed once, only as a chunk this operation receives,
/// and only while no loan covers its range; the ring touches a range it receives into
/// only once that chunk was delivered (it lends a range only after applying a chunk to it,
/// or its own step-0 segment, which it never receives into before that segment went
/// around the ring and was acknowledged), so between the claim and the delivery the
/// driver is the range's only user. A peer that breaks that order (a chunk of a later
/// step of the same range while one is being received, sent early by a faulty or hostile
/// node) cannot make two writers meet: a range is written by one side at a time (the
/// sink's `active` ranges: claimed by the driver, or entered by the ring for a chunk it
/// applies itself), and the ring fails the operation instead. And the ring
/// [`close`](RingSink::close)s the sink before it returns, which waits for an `apply` in
/// progress, so no driver writes the buffer once the caller has it back.
pub(crate) struct RingSink {
    /// The operation's schedule, as at its start: names each transfer id.
    plan: RingState,
    dtype: DType,
    op: ReduceOp,
    /// The buffer's writer until the ring ends (held for reading by every `apply`;
    /// dropped at the close, so that the caller's buffer is its own again at once).
    writer: RwLock<Option<SharedWriter>>,
    /// Transfer ids claimed so far, and the chunk ranges (by start) being written now.
    claims: Mutex<Claims>,
}

#[derive(Default)]
struct Claims {
    ids: HashSet<u64>,
    active: HashSet<usize>,
}

impl RingSink {
    pub(super) fn new(plan: RingState, writer: SharedWriter, dtype: DType, op: ReduceOp) -> Arc<RingSink> {
        Arc::new(RingSink {
            plan,
            dtype,
            op,
            writer: RwLock::new(Some(writer)),
            claims: Mutex::new(Claims::default()),
        })
    }

    fn claims(&self) -> std::sync::MutexGuard<'_, Claims> {
        self.claims.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ring is about to apply a chunk to the range starting at `start`: the one the
    /// driver reduced in place (`applied`: the driver's claim passes to the ring), or one
    /// it received whole, which no claim may cover. Fails when the range is someone
    /// else's: two chunks of one range at once, which no correct peer sends.
    pub(super) fn enter(&self, start: usize, applied: bool) -> Result<(), CollectiveError> {
        let mut c = self.claims();
        if applied == c.active.contains(&start) {
            c.active.insert(start);
            return Ok(());
        }
        Err(CollectiveError::Direct(format!(
            "a chunk for the bytes at {start} arrived while another chunk of the same bytes was being received"
        )))
    }

    /// The ring applied its chunk to the range starting at `start`: free for the next.
    pub(super) fn leave(&self, start: usize) {
        self.claims().active.remove(&start);
    }

    /// Ends the sink: once it returns, no `apply` runs or starts, and the sink no longer
    /// holds the buffer.
    pub(super) fn close(&self) {
        let writer = self.writer.write().unwrap_or_else(|p| p.into_inner()).take();
        drop(writer);
    }
}

impl DirectSink for RingSink {
    fn claim(&self, id: u64, len: usize) -> Option<Claim> {
        let writer = self.writer.read().unwrap_or_else(|p| p.into_inner());
        let t = self.plan.expect(id).ok()?;
        if t.range.len() != len || writer.as_ref().is_none_or(|w| w.is_lent(&t.range)) {
            return None;
        }
        let mut c = self.claims();
        if c.ids.contains(&id) || !c.active.insert(t.range.start) {
            return None;
        }
        c.ids.insert(id);
        drop(c);
        let kind = if t.phase == Phase::ReduceScatter { REDUCE } else { COPY };
        Some(Claim { id, start: t.range.start, len, kind })
    }

    fn apply(&self, claim: &Claim, offset: usize, bytes: &[u8]) -> bool {
        let size = self.dtype.size();
        let Some(end) = offset.checked_add(bytes.len()) else { return false };
        if offset % size != 0 || bytes.len() % size != 0 || end > claim.len {
            return false;
        }
        let writer = self.writer.read().unwrap_or_else(|p| p.into_inner());
        let Some(writer) = writer.as_ref() else { return false };
        // SAFETY: within the claimed chunk's range, which nothing else touches until the
        // chunk is delivered (see the type's comment), and the driver applies one
        // datagram's bytes at a time (the link hands each byte on once).
        let Some(dst) = (unsafe { writer.range_mut(claim.start + offset..claim.start + end) }) else {
            return false;
        };
        if claim.kind == COPY {
            dst.copy_from_slice(bytes);
            return true;
        }
        meshd_proto::reduce::reduce_into(self.dtype, self.op, dst, bytes).is_ok()
    }
}

/// [`Claim::kind`] of a reduce-scatter chunk: its bytes are reduced into the buffer.
const REDUCE: u8 = 0;
/// [`Claim::kind`] of an all-gather chunk: its bytes are copied over the buffer's.
const COPY: u8 = 1;

/// Passes the plane messages of `op` from `prev` to the ring as received chunks, counting
/// their bytes as progress (the ring's own watch ends a silent operation: the join timeout
/// before the first byte, the progress timeout after). A chunk over `max_chunk` bytes ends
/// the operation with an error. With a `sink`, the driver reduces reduce-scatter chunks
/// into the buffer as they arrive ([`RingSink`]).
pub(super) async fn read_chunks(
    plane: Plane,
    prev: SocketAddr,
    op: u64,
    out: mpsc::Sender<Result<(u64, Chunk), CollectiveError>>,
    max_chunk: usize,
    progress: Arc<Progress>,
    sink: Option<Arc<RingSink>>,
) {
    let mut rx: mpsc::UnboundedReceiver<Delivery> = match sink {
        Some(s) => plane.subscribe_direct(prev, op, s),
        None => plane.subscribe(prev, op),
    };
    let _sub = Subscription { plane, peer: prev, op };
    loop {
        let msg = match rx.recv().await {
            Some(d) => match match d {
                Delivery::Parts(id, parts) => (id, Chunk::Parts(parts)),
                Delivery::Applied { id, len, rest } => (id, Chunk::Applied { len, rest }),
            } {
                (id, chunk) if chunk.len() <= max_chunk => {
                    progress.received(chunk.len());
                    Ok((id, chunk))
                }
                (id, chunk) => {
                    let len = chunk.len();
                    Err(CollectiveError::Link {
                        peer: prev,
                        reason: format!("plane chunk {id:#x} of {len} bytes exceeds {max_chunk}"),
                    })
                }
            },
            None => Err(CollectiveError::Link { peer: prev, reason: "the data plane stopped".into() }),
        };
        let stop = msg.is_err();
        if out.send(msg).await.is_err() || stop {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_names_the_plane_that_served() {
        assert_eq!(Served { datagrams: 3, streams: 0 }.line(), "data plane: datagrams");
        assert_eq!(Served { datagrams: 0, streams: 2 }.line(), "QUIC streams");
        assert_eq!(
            Served { datagrams: 1, streams: 2 }.line(),
            "data plane: datagrams for 1 operation, QUIC streams for 2 operations"
        );
    }

    /// The direct sink reduces a reduce-scatter chunk and copies an all-gather chunk in
    /// place, takes only whole elements inside the chunk, claims each chunk once and only
    /// while no loan or other writer has its range, and lets go of the buffer when closed.
    #[test]
    fn the_ring_sink_writes_only_what_it_claimed_and_lets_go_when_closed() {
        use super::super::buffer::CollectiveBuffer;
        use meshd_proto::ring::RingPlan;
        let f32s = |v: &[u8]| {
            v.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>()
        };
        // 3 ranks, 3 segments of 32768 f32s, chunks of 64 KiB (2 per segment; large
        // enough to be lent, not copied, when sent).
        const CHUNK: usize = 64 << 10;
        let plan = RingPlan::new(3, 0, 3 * 32768, 4, CHUNK).expect("plan");
        let steps: Vec<_> = plan.steps().collect();
        let rs = plan.recvs(&steps[0]).next().expect("a reduce-scatter receive");
        let ag = plan.recvs(&steps[2]).next().expect("an all-gather receive");
        assert_eq!((rs.phase, ag.phase), (Phase::ReduceScatter, Phase::AllGather));
        let mut buf = CollectiveBuffer::from_vec(
            vec![1.0f32; 3 * 32768].iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
        let sink =
            RingSink::new(RingState::new(plan.clone()), buf.shared_writer(), DType::F32, ReduceOp::Sum);
        let twos: Vec<u8> = vec![2.0f32; CHUNK / 4].iter().flat_map(|x| x.to_le_bytes()).collect();

        // Wrong length, unknown id: no claim.
        assert!(sink.claim(rs.id(), 100).is_none());
        assert!(sink.claim(u64::MAX, CHUNK).is_none());
        let c = sink.claim(rs.id(), CHUNK).expect("claimed");
        assert!(sink.claim(rs.id(), CHUNK).is_none(), "a chunk is claimed once");
        // Whole elements inside the chunk only.
        assert!(!sink.apply(&c, 2, &twos[..8]));
        assert!(!sink.apply(&c, 0, &twos[..6]));
        assert!(!sink.apply(&c, CHUNK - 4, &twos[..8]));
        assert!(sink.apply(&c, 0, &twos[..CHUNK / 2]) && sink.apply(&c, CHUNK / 2, &twos[..CHUNK / 2]));
        let got = f32s(buf.slice(rs.range.clone()));
        assert!(got.iter().all(|&x| x == 3.0), "reduced in place: {got:?}");
        assert!(f32s(buf.slice(0..rs.range.start)).iter().all(|&x| x == 1.0), "nothing else written");
        // The range is the driver's until the ring takes the chunk over: a whole chunk of
        // it arriving meanwhile fails the operation.
        assert!(sink.enter(rs.range.start, false).is_err());
        sink.enter(rs.range.start, true).expect("the ring takes the claimed chunk over");
        sink.leave(rs.range.start);
        sink.enter(rs.range.start, false).expect("free once left");
        sink.leave(rs.range.start);

        // A lent range is not claimed; once the loan ends, an all-gather chunk copies.
        let loan = buf.lend(ag.range.clone());
        assert!(sink.claim(ag.id(), ag.range.len()).is_none());
        drop(loan);
        let sink2 = RingSink::new(RingState::new(plan), buf.shared_writer(), DType::F32, ReduceOp::Sum);
        let c = sink2.claim(ag.id(), ag.range.len()).expect("claimed once the loan ended");
        assert!(sink2.apply(&c, 0, &twos[..CHUNK]));
        assert!(f32s(buf.slice(ag.range.clone())).iter().all(|&x| x == 2.0), "copied in place");

        // Closed: nothing more is written or claimed, and the buffer is the caller's.
        sink.close();
        sink2.close();
        assert!(!sink2.apply(&c, 0, &twos[..8]));
        assert!(sink2.claim(plan_id_of_another(&steps), CHUNK).is_none());
        assert!(buf.try_as_mut().is_some(), "the sinks hold the buffer no longer");
    }

    /// A transfer id of the schedule not claimed in the test above.
    fn plan_id_of_another(steps: &[meshd_proto::ring::Step]) -> u64 {
        let plan = meshd_proto::ring::RingPlan::new(3, 0, 3 * 32768, 4, 64 << 10).expect("plan");
        plan.recvs(&steps[1]).next().expect("a receive").id()
    }
}
