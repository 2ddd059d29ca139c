//! Ordered byte streams over plane messages, for the tunnel (docs/PROTOCOL.md, "The TCP
//! tunnel", bytes on the data plane): the registry that routes a peer's stream messages
//! to the local end they name.
//!
//! Each end of a tunnelled connection that takes bytes on the plane registers a stream id
//! here before it tells the peer that id (over the connection's QUIC stream), so nothing
//! the peer sends can come before its registration. A message names the id of the end it
//! is for and is taken only from the peer that end registered with: a peer reaches its
//! own streams only. Two kinds arrive:
//! - data ([`super::TAG_STREAM`]): the bytes at an offset of the stream, for its reader;
//! - credit ([`super::TAG_CREDIT`]): how far the peer lets this end send.
//!
//! Messages for ids nobody registered (a stream that ended) are dropped and counted. What
//! waits in a registration's queue is bounded by the credit its reader grants, and in any
//! case by the plane's budget for the peer (`budget`): the pieces hold their buffers'
//! bytes in it until they are dropped.

use bytes::Bytes;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};

/// A stream's bytes as they arrived: their offset in the stream, and the pieces.
pub type StreamData = (u64, Vec<Bytes>);

struct Sink {
    data: mpsc::UnboundedSender<StreamData>,
    credit: watch::Sender<u64>,
}

/// The streams registered on one node's plane.
#[derive(Default)]
pub struct Streams {
    next: AtomicU64,
    sinks: Mutex<HashMap<(SocketAddr, u64), Sink>>,
    /// Messages for ids no stream has (any more).
    unknown: AtomicU64,
}

/// One end's registration: the id the peer's messages name. Dropping it unregisters the
/// id; later messages for it are dropped.
pub struct Registration {
    streams: Arc<Streams>,
    key: (SocketAddr, u64),
}

/// What the peer's messages for a registered end bring.
#[derive(Debug)]
pub struct Inbox {
    /// The stream's bytes from the peer, in the order the plane completed them (not
    /// necessarily the stream's order).
    pub data: mpsc::UnboundedReceiver<StreamData>,
    /// The highest offset the peer lets this end send up to (0 until it said).
    pub credit: watch::Receiver<u64>,
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams").field("registered", &lock(&self.sinks).len()).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("peer", &self.key.0).field("id", &self.key.1).finish()
    }
}

impl Registration {
    /// The id the peer's messages for this end carry (never 0).
    pub fn id(&self) -> u64 {
        self.key.1
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        lock(&self.streams.sinks).remove(&self.key);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Streams {
    /// Registers a new stream end that takes messages from `peer`.
    pub fn register(self: &Arc<Self>, peer: SocketAddr) -> (Registration, Inbox) {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let key = (crate::transport::canonical(peer), id);
        let (tx, data) = mpsc::unbounded_channel();
        let (ctx, credit) = watch::channel(0);
        lock(&self.sinks).insert(key, Sink { data: tx, credit: ctx });
        (Registration { streams: self.clone(), key }, Inbox { data, credit })
    }

    /// Stream messages no registration took, so far.
    pub fn unknown(&self) -> u64 {
        self.unknown.load(Ordering::Relaxed)
    }

    /// `from`'s bytes at `offset` of stream `id`.
    pub(super) fn data(&self, from: SocketAddr, id: u64, offset: u64, parts: Vec<Bytes>) {
        let sinks = lock(&self.sinks);
        match sinks.get(&(from, id)) {
            Some(s) if s.data.send((offset, parts)).is_ok() => {}
            _ => {
                self.unknown.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// `from` lets stream `id` send up to offset `max` (credits only grow).
    pub(super) fn credit(&self, from: SocketAddr, id: u64, max: u64) {
        let sinks = lock(&self.sinks);
        match sinks.get(&(from, id)) {
            Some(s) => super::raise_credit(&s.credit, max),
            None => {
                self.unknown.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
