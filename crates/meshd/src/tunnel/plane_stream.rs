//! A tunnelled connection's bytes on the data plane (docs/PROTOCOL.md, "The TCP tunnel",
//! bytes on the data plane): an ordered byte stream with receiver flow control over plane
//! messages, while the connection's QUIC stream keeps its opening, its end and its reset.
//!
//! Each end registers a stream id on its plane ([`crate::transport::plane::streams`]) and
//! offers it, with the window it grants, in the connection's handshake. Each direction's
//! sender then chooses: when the receiver offered an id and the plane to it is ready, it
//! writes the mode byte [`MODE_PLANE`] on the QUIC stream and sends the bytes as plane
//! messages `[receiver's id][offset][bytes]` (one per read of the local socket, at most
//! [`super::BLOCK`]), never past the receiver's credit; at its end of file it writes the
//! stream's length (u64 LE) on the QUIC stream and finishes it. Otherwise it writes
//! [`MODE_STREAM`] and the bytes follow on the QUIC stream as before. The receiver puts
//! the plane's messages in order, writes them to its local socket, and grants credit
//! (`[sender's id][offset it may send up to]`) as its application reads.
//!
//! A failure on either side resets the QUIC stream as before; a reader that sees bytes
//! past its credit, overlapping ones, or a length that does not match treats it as a
//! failure. A sender whose plane link to the peer stopped getting through
//! ([`crate::transport::plane::SILENCE`]) resets the connection: bytes sent on the plane
//! cannot be moved to the QUIC stream after the fact.

use super::{BLOCK, MIN_READ, TunnelStats, write_all_chunks};
use crate::transport::plane::streams::{Inbox, Registration};
use crate::transport::plane::{Plane, TAG_CREDIT, TAG_STREAM};
use bytes::{Bytes, BytesMut};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First byte of a direction's bytes on the QUIC stream: they follow there.
pub const MODE_STREAM: u8 = 0;
/// First byte of a direction's bytes on the QUIC stream: they travel on the plane, and the
/// stream's length (u64 LE) follows here at its end.
pub const MODE_PLANE: u8 = 1;
/// Length of an offer: the stream id (u64 LE, 0: not on the plane) and the window the
/// receiver grants at first (u32 LE).
pub const OFFER_LEN: usize = 12;
/// The window a receiver grants: bytes its peer may send beyond what the local
/// application read. A window's worth per connection is what the plane holds for it at
/// most (and twice that in receive buffers, by the plane's budget rule).
pub const WINDOW: u32 = 8 << 20;
/// How often a sender waiting for credit looks whether its plane link still gets through.
const CHECK: Duration = Duration::from_millis(250);

/// What one end offers the other in the handshake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offer {
    /// The id the peer's plane messages for this end carry (0: this end takes no bytes
    /// on the plane).
    pub id: u64,
    /// Bytes the peer may send before this end grants more.
    pub window: u32,
}

impl Offer {
    /// The offer's wire form.
    pub fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..].copy_from_slice(&self.window.to_le_bytes());
        b
    }

    /// Reads an offer from its wire form.
    pub fn decode(b: &[u8; OFFER_LEN]) -> Offer {
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[..8]);
        let mut w = [0u8; 4];
        w.copy_from_slice(&b[8..]);
        Offer { id: u64::from_le_bytes(id), window: u32::from_le_bytes(w) }
    }
}

/// One end's plane side of a tunnelled connection: its registration, and the peer's offer.
pub struct Way {
    /// This node's plane.
    pub plane: Plane,
    /// The peer's meshd.
    pub peer: SocketAddr,
    /// This end's stream id: registered as long as the connection lives.
    _reg: Registration,
    /// This end's window.
    pub window: u32,
    /// What the peer offered.
    pub theirs: Offer,
}

/// An end registered before the handshake: what it offers, and what arrives for it.
pub struct Mine {
    plane: Plane,
    peer: SocketAddr,
    reg: Registration,
    inbox: Inbox,
}

impl Mine {
    /// Registers an end for bytes from `peer` (before offering it), when the plane runs.
    pub fn register(plane: Option<&Plane>, peer: SocketAddr) -> Option<Mine> {
        let plane = plane?.clone();
        let (reg, inbox) = plane.streams().register(peer);
        Some(Mine { plane, peer, reg, inbox })
    }

    /// What this end offers.
    pub fn offer(&self) -> Offer {
        Offer { id: self.reg.id(), window: WINDOW }
    }

    /// The end once the peer's offer is known.
    pub fn with(self, theirs: Offer) -> (Way, Inbox) {
        let Mine { plane, peer, reg, inbox } = self;
        (Way { plane, peer, _reg: reg, window: WINDOW, theirs }, inbox)
    }
}

impl Way {
    /// Whether this end sends its bytes on the plane: the peer takes them there and the
    /// plane to it is ready.
    pub fn sends_on_plane(&self) -> bool {
        self.theirs.id != 0 && self.theirs.window > 0 && self.plane.is_ready(self.peer)
    }

    fn lane(&self) -> usize {
        (self.theirs.id as usize) % self.plane.ready_lanes(self.peer).max(1)
    }
}

/// The offer of an end registered as `mine` (none: an offer of id 0).
pub fn offer(mine: Option<&Mine>) -> Offer {
    mine.map_or(Offer::default(), Mine::offer)
}

/// Sends the local socket's bytes on the plane until its end of file (then the length on
/// `send`, which is finished), within the peer's credit. `Err` on any failure.
pub async fn up<R: AsyncRead + Unpin>(
    r: &mut R,
    send: &mut quinn::SendStream,
    way: &Way,
    credits: &mut tokio::sync::watch::Receiver<u64>,
    stats: &TunnelStats,
) -> Result<(), ()> {
    let lane = way.lane();
    let to = way.theirs.id;
    let mut credit = u64::from(way.theirs.window);
    let mut sent = 0u64;
    let mut buf = BytesMut::with_capacity(BLOCK);
    loop {
        // Wait for room: the peer's credit, while the plane still gets through and the
        // peer did not stop the connection.
        while credit <= sent {
            tokio::select! {
                changed = credits.changed() => {
                    changed.map_err(|_| ())?;
                    credit = credit.max(*credits.borrow_and_update());
                }
                _ = send.stopped() => return Err(()),
                _ = tokio::time::sleep(CHECK) => {
                    if !way.plane.is_ready(way.peer) {
                        return Err(());
                    }
                }
            }
        }
        if buf.capacity() - buf.len() < MIN_READ {
            buf = BytesMut::with_capacity(BLOCK);
        }
        let room = (credit - sent).min((buf.capacity() - buf.len()) as u64);
        match (&mut *r).take(room).read_buf(&mut buf).await {
            Ok(0) => {
                send.write_all(&sent.to_le_bytes()).await.map_err(|_| ())?;
                return send.finish().map_err(|_| ());
            }
            Ok(n) => {
                stats.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
                stats.plane_out.fetch_add(n as u64, Ordering::Relaxed);
                way.plane
                    .send_tagged(way.peer, lane, TAG_STREAM, to, sent, buf.split().freeze())
                    .map_err(|_| ())?;
                sent += n as u64;
                // Credit that came meanwhile, without waiting.
                if credits.has_changed().unwrap_or(false) {
                    credit = credit.max(*credits.borrow_and_update());
                }
            }
            Err(_) => return Err(()),
        }
    }
}

/// Writes the peer's plane bytes to the local socket in order, granting credit as they
/// are written, until the length the peer gave on `recv` is reached (then `w` is shut
/// down for writing). `Err` on any failure or breach of the rules.
pub async fn down<W: AsyncWrite + Unpin>(
    w: &mut W,
    recv: &mut quinn::RecvStream,
    way: &Way,
    data: &mut tokio::sync::mpsc::UnboundedReceiver<crate::transport::plane::streams::StreamData>,
    stats: &TunnelStats,
) -> Result<(), ()> {
    let window = u64::from(way.window);
    let lane = way.lane();
    let mut granted = window;
    let mut next = 0u64;
    // Messages that came before the bytes ahead of them, by offset.
    let mut ahead: BTreeMap<u64, Vec<Bytes>> = BTreeMap::new();
    let mut total: Option<u64> = None;
    let mut trailer = [0u8; 8];
    let mut got = 0;
    // The plane to the peer was seen ready (a receiver's own link may become ready a
    // round trip after the sender's); once it is not any more, nothing more will come.
    let mut seen_ready = false;
    let mut check = tokio::time::interval(CHECK);
    loop {
        if total == Some(next) {
            // Every byte arrived, and none may come after the length.
            return if ahead.is_empty() { w.shutdown().await.map_err(|_| ()) } else { Err(()) };
        }
        tokio::select! {
            m = data.recv() => {
                let (offset, parts) = m.ok_or(())?;
                let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
                let end = offset.checked_add(len).ok_or(())?;
                if offset < next || end > granted || total.is_some_and(|t| end > t) {
                    return Err(());
                }
                if ahead.insert(offset, parts).is_some() {
                    return Err(());
                }
                while let Some(mut parts) = ahead.remove(&next) {
                    let n: u64 = parts.iter().map(|p| p.len() as u64).sum();
                    stats.bytes_in.fetch_add(n, Ordering::Relaxed);
                    stats.plane_in.fetch_add(n, Ordering::Relaxed);
                    write_all_chunks(w, &mut parts).await.map_err(|_| ())?;
                    next += n;
                    if let Some((&o, _)) = ahead.first_key_value() {
                        if o < next {
                            return Err(()); // overlapping messages
                        }
                    }
                }
                // Grant more once half the window was read.
                if granted - next <= window / 2 && total.is_none() {
                    granted = next + window;
                    way.plane.send_tagged(way.peer, lane, TAG_CREDIT, way.theirs.id, granted, Bytes::new()).map_err(|_| ())?;
                }
            }
            r = recv.read(&mut trailer[got..]), if total.is_none() => match r {
                Ok(Some(n)) => {
                    got += n;
                    if got == trailer.len() {
                        let t = u64::from_le_bytes(trailer);
                        if t < next || ahead.last_key_value().is_some_and(|(&o, p)| o + p.iter().map(|b| b.len() as u64).sum::<u64>() > t) {
                            return Err(());
                        }
                        total = Some(t);
                    }
                }
                // The end without a length, or a reset.
                Ok(None) | Err(_) => return Err(()),
            },
            _ = check.tick() => {
                let ready = way.plane.is_ready(way.peer);
                if seen_ready && !ready {
                    return Err(());
                }
                seen_ready |= ready;
            }
        }
    }
}
