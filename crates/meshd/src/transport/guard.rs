//! Limits that keep hostile input cheap: handshakes in progress (per source IP and in
//! total), stateless Retry when handshakes pile up, flow-control windows that stay tiny
//! until the peer's MAC verified, refusals logged once per (IP, reason) with a bounded
//! memory of what was said, and control frames read length-first so an oversized length
//! is refused before its body is read.

use meshd_proto::wire::{self, WireError};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use tracing::warn;

/// Handshakes (QUIC + authentication) in progress at once, from all sources.
pub const MAX_PENDING: usize = 1024;
/// Handshakes in progress at once from one IP address.
pub const MAX_PENDING_PER_IP: usize = 64;
/// Unvalidated handshakes in progress, from all sources, above which a new one must first
/// prove its source address with a stateless QUIC Retry (one extra round trip). Spoofed
/// sources cannot answer a Retry, so at most this many slots hold spoofed state.
pub const RETRY_ABOVE: usize = 32;
/// Handshakes in progress from one IP above which its next one gets a Retry.
pub const RETRY_ABOVE_PER_IP: usize = 8;
/// Distinct (IP, reason) refusals remembered for logging once; past this, refusals are
/// no longer logged (one line says so).
pub const MAX_LOGGED: usize = 4096;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts unauthenticated connections in progress.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

/// One admitted handshake; dropping it frees its place.
#[derive(Debug)]
pub struct Permit {
    gate: Arc<Gate>,
    ip: IpAddr,
}

/// Why a handshake was not admitted.
#[derive(Debug, PartialEq, Eq)]
pub enum Full {
    /// This IP already has [`MAX_PENDING_PER_IP`] handshakes in progress.
    Ip,
    /// [`MAX_PENDING`] handshakes are in progress.
    Total,
}

impl Gate {
    /// Admits a handshake from `ip`, or says which limit is reached.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Permit, Full> {
        let mut st = lock(&self.state);
        let (total, per_ip) = &mut *st;
        let n = per_ip.get(&ip).copied().unwrap_or(0);
        if n >= MAX_PENDING_PER_IP {
            return Err(Full::Ip);
        }
        if *total >= MAX_PENDING {
            return Err(Full::Total);
        }
        *total += 1;
        per_ip.insert(ip, n + 1);
        Ok(Permit { gate: self.clone(), ip })
    }

    /// Handshakes in progress now.
    pub fn pending(&self) -> usize {
        lock(&self.state).0
    }

    /// Whether a handshake from `ip` whose source address is not validated yet should get
    /// a stateless Retry first: when more than [`RETRY_ABOVE`] handshakes are in progress,
    /// or more than [`RETRY_ABOVE_PER_IP`] from `ip`. Without a flood neither holds, and
    /// connections cost no extra round trip.
    pub fn should_retry(&self, ip: IpAddr) -> bool {
        let st = lock(&self.state);
        st.0 >= RETRY_ABOVE || st.1.get(&ip).is_some_and(|n| *n >= RETRY_ABOVE_PER_IP)
    }
}

// ---- flow control before and after authentication ----------------------------------------

/// Connection receive window (stream bytes buffered from the peer, all streams together)
/// until the peer's MAC verified: the hello (at most 1 KiB) and the answer fit.
pub const PRE_AUTH_RECEIVE_WINDOW: u32 = 4 << 10;
/// Bidirectional streams the peer may open until it authenticated: the hello's.
pub const PRE_AUTH_BIDI_STREAMS: u32 = 1;
/// Unidirectional streams the peer may open until it authenticated: none.
pub const PRE_AUTH_UNI_STREAMS: u32 = 0;
/// Connection receive window once authenticated: bulk collective data needs windows large
/// enough that a stream is not capped at window / RTT on a fast link.
pub const RECEIVE_WINDOW: u32 = 64 << 20;
/// Per-stream receive window. A QUIC transport parameter, fixed for the connection's life
/// (quinn cannot raise it per connection); before authentication the connection window
/// ([`PRE_AUTH_RECEIVE_WINDOW`]) bounds every stream's bytes together, so it costs nothing.
pub const STREAM_RECEIVE_WINDOW: u32 = 16 << 20;
/// Unidirectional streams an authenticated peer may have open at once, per connection: on
/// a main connection, control frames only (each on a stream of its own, read at once); on
/// a data connection, a neighbour's ring data streams, a few per operation and at most one
/// operation ahead, plus those of operations this node gave up on (bounded by the ring's
/// stash, which drops a peer's oldest beyond its share). quinn keeps a
/// finished stream's receive state, with its reassembly queue, for reuse, up to this many
/// per connection, so a larger limit costs resident memory over a long job
/// (docs/PERFORMANCE.md, "Memory over a long job").
pub const UNI_STREAMS: u32 = 64;
/// Bidirectional streams an authenticated peer may have open at once on the data
/// connection that carries tunnel streams (data connection 1, in tunnel mode): one per TCP
/// connection a rank of that node holds to this node (Gloo: one per pair of ranks, NCCL:
/// bootstrap, proxy and its sockets per peer); the tunnel caps them at 1024 per peer too.
/// A stream beyond it waits for one to end (the tunnel's open times out and the application
/// sees ETIMEDOUT); the connection's receive window bounds their buffers together.
pub const TUNNEL_BIDI_STREAMS: u32 = 1024;
/// Bidirectional streams on every other authenticated connection (a main connection or
/// another data connection): none is used after the hello, a few are allowed.
pub const BIDI_STREAMS: u32 = 4;
/// Authenticated connections kept from one peer address (ip:port, one meshd) at once: its
/// main connection and its data connections, each possibly twice for a while (both ends
/// dialled at once, or one reconnected). One more is refused.
pub const MAX_CONNS_PER_ADDR: usize = 2 * (1 + wire::MAX_LANES);
/// Authenticated connections kept from one IP address at once (several meshds on one host,
/// as in loopback tests; a token holder opening ports one after another).
pub const MAX_CONNS_PER_IP: usize = 512;
/// Received QUIC datagrams buffered per connection (the oldest is dropped past it). Also a
/// transport parameter fixed for the connection's life, so it is small from the start: it
/// holds a few gossip datagrams (they are read as they come, and may be lost) and is more
/// than the largest datagram a 9000-byte MTU carries plus quinn's per-datagram overhead
/// (a datagram over the buffer closes the connection). Before authentication nothing
/// keeps them: [`discarding_datagrams`] reads and drops them.
pub const DATAGRAM_RECEIVE_BUFFER: usize = 16 << 10;

/// Sets `tc`'s limits to what an unauthenticated peer gets; [`open_up`] raises them on a
/// connection whose peer authenticated.
pub fn pre_auth_limits(tc: &mut quinn::TransportConfig) {
    tc.max_concurrent_uni_streams(PRE_AUTH_UNI_STREAMS.into())
        .max_concurrent_bidi_streams(PRE_AUTH_BIDI_STREAMS.into())
        .datagram_receive_buffer_size(Some(DATAGRAM_RECEIVE_BUFFER))
        .stream_receive_window(STREAM_RECEIVE_WINDOW.into())
        .receive_window(PRE_AUTH_RECEIVE_WINDOW.into());
}

/// Gives a connection whose peer's MAC verified the full windows and stream limits (the
/// peer learns them from MAX_DATA / MAX_STREAMS frames in the next packets); `lane` is the
/// connection's (0 the main connection): tunnel streams come on data connection 1.
pub fn open_up(conn: &quinn::Connection, lane: u8) {
    conn.set_receive_window(RECEIVE_WINDOW.into());
    conn.set_max_concurrent_uni_streams(UNI_STREAMS.into());
    let bidi = if lane == TUNNEL_LANE { TUNNEL_BIDI_STREAMS } else { BIDI_STREAMS };
    conn.set_max_concurrent_bi_streams(bidi.into());
}

/// The data connection that carries tunnel streams (and ring lane 0).
pub const TUNNEL_LANE: u8 = 1;

/// Every authenticated connection, by peer address, to bound how many one peer holds.
#[derive(Debug, Default)]
pub struct Conns {
    by_addr: Mutex<HashMap<SocketAddr, Vec<quinn::Connection>>>,
}

/// Which bound a new connection would pass.
#[derive(Debug, PartialEq, Eq)]
pub enum TooMany {
    /// [`MAX_CONNS_PER_ADDR`] from this address.
    Addr,
    /// [`MAX_CONNS_PER_IP`] from this IP.
    Ip,
}

impl Conns {
    /// Keeps `conn` from `addr`, unless the peer holds too many open already (closed ones
    /// are forgotten first).
    pub fn admit(&self, addr: SocketAddr, conn: &quinn::Connection) -> Result<(), TooMany> {
        let mut m = lock(&self.by_addr);
        m.retain(|_, v| {
            v.retain(|c| c.close_reason().is_none());
            !v.is_empty()
        });
        let here = m.get(&addr).map_or(0, Vec::len);
        if here >= MAX_CONNS_PER_ADDR {
            return Err(TooMany::Addr);
        }
        let ip = addr.ip().to_canonical();
        let from_ip: usize =
            m.iter().filter(|(a, _)| a.ip().to_canonical() == ip).map(|(_, v)| v.len()).sum();
        if from_ip >= MAX_CONNS_PER_IP {
            return Err(TooMany::Ip);
        }
        m.entry(addr).or_default().push(conn.clone());
        Ok(())
    }

    /// Open connections from `addr` now.
    pub fn count(&self, addr: SocketAddr) -> usize {
        lock(&self.by_addr).get(&addr).map_or(0, |v| v.iter().filter(|c| c.close_reason().is_none()).count())
    }
}

/// Reads and drops the datagrams of a connection whose peer is not authenticated yet, so
/// that none is held in its buffer (each would keep its whole received packet alive), until
/// the returned guard is dropped (at the end of the authentication exchange; an
/// authenticated peer sends datagrams only after it verified this node's answer).
pub fn drain_datagrams(conn: &quinn::Connection) -> Drain {
    let conn = conn.clone();
    Drain(tokio::spawn(async move { while conn.read_datagram().await.is_ok() {} }).abort_handle())
}

/// Stops [`drain_datagrams`] when dropped.
#[derive(Debug)]
pub struct Drain(tokio::task::AbortHandle);

impl Drop for Drain {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut st = lock(&self.gate.state);
        let (total, per_ip) = &mut *st;
        *total = total.saturating_sub(1);
        if let Some(n) = per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                per_ip.remove(&self.ip);
            }
        }
    }
}

/// Remembers which refusals were logged: once per (peer IP, reason), bounded.
#[derive(Debug, Default)]
pub struct LogOnce {
    seen: Mutex<(HashSet<(IpAddr, String)>, bool)>,
}

impl LogOnce {
    /// True the first time (`addr`'s IP, `reason`) is seen: the caller logs it then.
    pub fn first(&self, addr: SocketAddr, reason: &str) -> bool {
        let mut st = lock(&self.seen);
        let (seen, full) = &mut *st;
        let key = (addr.ip().to_canonical(), reason.to_string());
        if seen.contains(&key) {
            return false;
        }
        if seen.len() >= MAX_LOGGED {
            if !*full {
                *full = true;
                warn!("{MAX_LOGGED} different refusals logged; further ones are not");
            }
            return false;
        }
        seen.insert(key)
    }
}

/// A control stream could not be read to its end.
#[derive(Debug)]
pub enum ReadError {
    /// The stream ended or was reset (nothing to say).
    Stream,
    /// The peer broke the framing (the connection should be closed with this reason).
    Protocol(WireError),
}

/// Reads the length-prefixed frames of a control stream whose first byte was already
/// read, handing each body to `each`. A length over [`wire::MAX_FRAME`] is refused as
/// soon as its 4 bytes arrive, before its body is read; a body is buffered only as its
/// bytes arrive (no allocation by the claimed length).
pub async fn read_frames<F, Fut>(
    recv: &mut quinn::RecvStream,
    first: u8,
    mut each: F,
) -> Result<(), ReadError>
where
    F: FnMut(Vec<u8>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut prefix = [first, 0, 0, 0];
    let mut have = 1;
    loop {
        // The length prefix (the first frame's first byte came with the stream tag).
        while have < 4 {
            match recv.read(&mut prefix[have..]).await {
                Ok(Some(n)) => have += n,
                Ok(None) if have == 0 => return Ok(()),
                Ok(None) => return Err(ReadError::Protocol(WireError::Malformed("truncated length".into()))),
                Err(_) => return Err(ReadError::Stream),
            }
        }
        let n = wire::check_len(prefix).map_err(ReadError::Protocol)?;
        let mut body = Vec::new();
        while body.len() < n {
            match recv.read_chunk(n - body.len(), true).await {
                Ok(Some(c)) => body.extend_from_slice(&c.bytes),
                Ok(None) => {
                    return Err(ReadError::Protocol(WireError::Malformed(format!(
                        "stream ended after {} of {n} bytes",
                        body.len()
                    ))));
                }
                Err(_) => return Err(ReadError::Stream),
            }
        }
        each(body).await;
        have = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_limits_per_ip_and_in_total() {
        let g = Arc::new(Gate::default());
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let held: Vec<Permit> = (0..MAX_PENDING_PER_IP).map(|_| g.admit(a).expect("admit")).collect();
        assert_eq!(g.admit(a).expect_err("per-IP limit"), Full::Ip);
        assert_eq!(g.pending(), MAX_PENDING_PER_IP);
        drop(held);
        assert_eq!(g.pending(), 0);
        let mut all = Vec::new();
        for i in 0..MAX_PENDING {
            let ip = IpAddr::from([10, 1, (i / 250) as u8, (i % 250) as u8]);
            all.push(g.admit(ip).expect("admit"));
        }
        assert_eq!(g.admit("10.9.9.9".parse().expect("ip")).expect_err("total limit"), Full::Total);
        drop(all);
        assert!(g.admit(a).is_ok());
    }

    #[test]
    fn retry_only_when_handshakes_pile_up() {
        let g = Arc::new(Gate::default());
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let mut held: Vec<Permit> = Vec::new();
        while held.len() < RETRY_ABOVE_PER_IP {
            assert!(!g.should_retry(a), "no flood, no extra round trip");
            held.push(g.admit(a).expect("admit"));
        }
        assert!(g.should_retry(a), "over its per-IP share");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        assert!(!g.should_retry(b), "another address is not affected yet");
        for i in held.len()..RETRY_ABOVE {
            held.push(g.admit(IpAddr::from([10, 3, 0, i as u8])).expect("admit"));
        }
        assert!(g.should_retry(b), "too many in progress in all");
        drop(held);
        assert!(!g.should_retry(a) && !g.should_retry(b));
    }

    #[test]
    fn log_once_per_ip_and_reason_and_bounded() {
        let l = LogOnce::default();
        let a: SocketAddr = "10.0.0.1:1000".parse().expect("addr");
        let a2: SocketAddr = "10.0.0.1:1001".parse().expect("addr");
        assert!(l.first(a, "different token"));
        assert!(!l.first(a2, "different token"), "another port of the same host");
        assert!(l.first(a, "another reason"));
        for i in 0..MAX_LOGGED * 2 {
            l.first(SocketAddr::from(([10, 2, (i / 250) as u8, (i % 250) as u8], 1)), "x");
        }
        assert!(lock(&l.seen).0.len() <= MAX_LOGGED);
    }
}
