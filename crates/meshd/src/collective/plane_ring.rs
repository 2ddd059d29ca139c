//! The ring's chunks over the data plane (`transport::plane`) instead of QUIC streams.
//!
//! The sending node decides, per operation: it uses the plane when its plane link to the
//! next node is ready (the peer acknowledged its full-size probe: datagrams get through
//! both ways and the next node runs the plane), and says so on the operation's first data stream with the preamble
//! [`PREAMBLE`] instead of a lane preamble; the stream carries nothing else. The receiving
//! node then takes the operation's chunks from the plane. A node that turned the plane off
//! never answers on it, so its neighbours use QUIC streams with it; a node whose link is
//! not ready after [`PROBE_WAIT`] does too.

use super::ring::{CollectiveError, Progress};
use crate::transport::plane::{Delivery, Plane};
use bytes::Bytes;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
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
    errors: mpsc::WeakSender<Result<(u64, Vec<Bytes>), CollectiveError>>,
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

/// Passes the plane messages of `op` from `prev` to the ring as received chunks, counting
/// their bytes as progress (the ring's own watch ends a silent operation: the join timeout
/// before the first byte, the progress timeout after). A chunk over `max_chunk` bytes ends
/// the operation with an error.
pub(super) async fn read_chunks(
    plane: Plane,
    prev: SocketAddr,
    op: u64,
    out: mpsc::Sender<Result<(u64, Vec<Bytes>), CollectiveError>>,
    max_chunk: usize,
    progress: Arc<Progress>,
) {
    let mut rx: mpsc::UnboundedReceiver<Delivery> = plane.subscribe(prev, op);
    let _sub = Subscription { plane, peer: prev, op };
    loop {
        let msg = match rx.recv().await {
            Some((id, parts)) => match parts.iter().map(|p| p.len()).sum::<usize>() {
                len if len <= max_chunk => {
                    progress.received(len);
                    Ok((id, parts))
                }
                len => Err(CollectiveError::Link {
                    peer: prev,
                    reason: format!("plane chunk {id:#x} of {len} bytes exceeds {max_chunk}"),
                }),
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
}
