//! A server of torch.distributed's TCPStore wire protocol, so that meshd can host a node's
//! store the way torchrun's agent does (`TORCHELASTIC_USE_AGENT_STORE=True`): ranks and
//! torchft's Manager connect with `TCPStore(host, port, is_master=False)`, Gloo's
//! rendezvous runs over it, other nodes' groups connect to it too.
//!
//! Tested with torch 2.15.0 (PyPI; libuv client) and Debian's torch 1.13.0a0
//! (tests/tcpstore_torch.rs). The source of truth is PyTorch's C++:
//! `torch/csrc/distributed/c10d/TCPStore.cpp`, `TCPStoreBackend.{hpp,cpp}`,
//! `TCPStoreLibUvBackend.cpp`; the numbers below were also checked against what the real
//! clients send.
//!
//! # The protocol
//!
//! A byte stream per connection; no framing besides the fields. Every size (`u64`) and
//! integer (`i64`, `u32`) is little-endian; a `bytes` is a u64 length then the bytes. A
//! query is one type byte and its fields; some queries have no answer.
//!
//! torch 2.x opens with `VALIDATE` (`0x00`, u32 `0x3C85F7CE`), then `PING` (u32 nonce, the
//! pid; the answer echoes it). Its query types, with their fields -> answer:
//!
//! | # | query | fields | answer |
//! |---|-------|--------|--------|
//! | 1 | SET | key, value | none |
//! | 2 | COMPARE_SET | key, expected, desired | bytes: the value now (see [`state`]) |
//! | 3 | GET | key | bytes (empty for a missing key) |
//! | 4 | ADD | key, i64 | i64: the sum (the value is kept as decimal text) |
//! | 5 | CHECK | u64 n, n keys | u8: 0 READY, 1 NOT_READY |
//! | 6 | WAIT | u64 n, n keys | u8 0 STOP_WAITING, now or once every key is set |
//! | 7 | GETNUMKEYS | | i64 |
//! | 8 | DELETE_KEY | key | i64: 1 deleted, 0 missing |
//! | 9 | APPEND | key, value | none |
//! | 10 | MULTI_GET | u64 n, n keys | n bytes |
//! | 11 | MULTI_SET | u64 n, n (key, value) | none |
//! | 12 | CANCEL_WAIT | | u8 1 WAIT_CANCELED (a STOP_WAITING may come first) |
//! | 13 | PING | u32 | u32, the same |
//! | 14 | QUEUE_PUSH | key, value | none |
//! | 15 | QUEUE_POP | key | i64 length before, then bytes if it was not 0 |
//! | 16 | QUEUE_LEN | key | i64 |
//! | 17 | LIST_KEYS | | i64 n, n bytes |
//! | 18 | BARRIER | key, i64 world size | u8 0 STOP_WAITING once that many arrived |
//!
//! torch 1.13 sends no handshake and numbers its queries differently: SET 0, COMPARE_SET 1,
//! GET 2, ADD 3, CHECK 4, WAIT 5, GETNUMKEYS 6, WATCH_KEY 7 (not served: 1.13's Python has
//! no `watch_key`), DELETE_KEY 8, with the same fields and answers. Each 1.13 `TCPStore`
//! opens a second, silent connection (its watch-key callback client). The dialect is told
//! by the first bytes ([`codec::Decoder`]): `0x00` + the magic is 2.x; anything else is
//! 1.13 (a 1.13 SET also starts with `0x00`, then a key length that the magic would make
//! ~1 GB). The client adds the `/` key prefix itself (`set("k")` sends `/k`); a blocking
//! `get` is WAIT then GET; a blocking `queue_pop` is WAIT on the queue's name then
//! QUEUE_POP; a timed-out wait (2.x) sends CANCEL_WAIT.
//!
//! A request torch's server answers with an exception (ADD on a value that is not an
//! integer, GET of a missing key on a 1.13 connection) closes the connection here too;
//! so do an unknown type, a length over a limit, and a full store ([`state::Fault`]).
//!
//! # The server
//!
//! One actor task owns the listener, the [`state::State`] and a `JoinSet` of connection
//! tasks. A connection task decodes its queries and sends them to the actor (a bounded
//! channel, so a fast sender waits); the actor answers through the connection's bounded
//! reply queue (bounded in answers and in bytes) and closes a connection whose queue is
//! full (a peer that does not read).
//! Dropping the [`TcpStoreHandle`] aborts the actor, which aborts every connection.
//! [`TcpStoreHandle::clear`] empties the store and closes every connection, for a new
//! restart of the node's ranks (dropping the handle and binding again does the same).

pub mod codec;
pub mod state;

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::{AbortHandle, JoinHandle, JoinSet};
use tracing::{debug, warn};

use codec::{Decoded, Decoder, Dialect, Reply, Request, STOP_WAITING, WireLimits};
use state::{ConnId, State, StoreLimits};

/// The server's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpStoreConfig {
    /// Connections open at once; one more is accepted and closed at once.
    pub max_connections: usize,
    /// Answers queued for one connection; a peer that lets more pile up is closed.
    pub reply_queue: usize,
    /// Bytes of answers queued for one connection (past what its socket took); a peer that
    /// lets more pile up is closed. One answer is always queued, whatever its size (it is
    /// bounded by the store's own size).
    pub reply_bytes: usize,
    pub wire: WireLimits,
    pub store: StoreLimits,
}

impl Default for TcpStoreConfig {
    fn default() -> Self {
        TcpStoreConfig {
            max_connections: 1024,
            reply_queue: 1024,
            reply_bytes: 128 * 1024 * 1024,
            wire: WireLimits::default(),
            store: StoreLimits::default(),
        }
    }
}

/// A bound TCPStore server, not yet serving.
#[derive(Debug)]
pub struct TcpStoreServer {
    listener: TcpListener,
    config: TcpStoreConfig,
}

/// What the store holds, for tests and status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpStoreStats {
    pub keys: usize,
    pub bytes: usize,
    pub connections: usize,
    pub waiting: usize,
}

enum Control {
    Clear(oneshot::Sender<()>),
    Stats(oneshot::Sender<TcpStoreStats>),
}

enum Event {
    Request { conn: ConnId, dialect: Dialect, req: Request },
}

/// A serving store. Dropping it stops the server and closes its connections.
#[derive(Debug)]
pub struct TcpStoreHandle {
    addr: SocketAddr,
    control: mpsc::Sender<Control>,
    task: JoinHandle<()>,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks one) with the default limits.
    pub async fn bind(addr: SocketAddr) -> io::Result<TcpStoreServer> {
        Self::bind_with(addr, TcpStoreConfig::default()).await
    }

    pub async fn bind_with(addr: SocketAddr, config: TcpStoreConfig) -> io::Result<TcpStoreServer> {
        Ok(TcpStoreServer { listener: TcpListener::bind(addr).await?, config })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until the future is dropped (no clear; see [`TcpStoreServer::spawn`]).
    pub async fn serve(self) {
        let (_tx, rx) = mpsc::channel(1);
        Actor::new(self.config).run(self.listener, rx).await
    }

    /// Serves on a task of the current runtime.
    pub fn spawn(self) -> io::Result<TcpStoreHandle> {
        let addr = self.listener.local_addr()?;
        let (control, rx) = mpsc::channel(8);
        let span = tracing::debug_span!("tcpstore", %addr);
        let task = tokio::spawn(tracing::Instrument::instrument(
            Actor::new(self.config).run(self.listener, rx),
            span,
        ));
        Ok(TcpStoreHandle { addr, control, task })
    }
}

impl TcpStoreHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Empties the store (keys, queues, waits) and closes every connection.
    pub async fn clear(&self) {
        let (tx, rx) = oneshot::channel();
        if self.control.send(Control::Clear(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    pub async fn stats(&self) -> TcpStoreStats {
        let (tx, rx) = oneshot::channel();
        if self.control.send(Control::Stats(tx)).await.is_err() {
            return TcpStoreStats::default();
        }
        rx.await.unwrap_or_default()
    }
}

impl Drop for TcpStoreHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Conn {
    replies: mpsc::Sender<Vec<u8>>,
    /// Bytes in `replies` not yet written (the connection task subtracts).
    queued: Arc<AtomicUsize>,
    abort: AbortHandle,
}

struct Actor {
    config: TcpStoreConfig,
    state: State,
    conns: HashMap<ConnId, Conn>,
    next: ConnId,
}

impl Actor {
    fn new(config: TcpStoreConfig) -> Actor {
        Actor { config, state: State::new(config.store), conns: HashMap::new(), next: 0 }
    }

    async fn run(mut self, listener: TcpListener, mut control: mpsc::Receiver<Control>) {
        let (events_tx, mut events) = mpsc::channel::<Event>(256);
        let mut tasks: JoinSet<ConnId> = JoinSet::new();
        let mut control_open = true;
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        if self.conns.len() >= self.config.max_connections {
                            debug!(%peer, "connection refused: {} open", self.conns.len());
                            continue;
                        }
                        let id = self.next;
                        self.next += 1;
                        let (tx, rx) = mpsc::channel(self.config.reply_queue);
                        let queued = Arc::new(AtomicUsize::new(0));
                        let abort = tasks.spawn(connection(
                            id,
                            stream,
                            Replies { rx, queued: queued.clone() },
                            events_tx.clone(),
                            self.config.wire,
                        ));
                        debug!(%peer, conn = id, "connected");
                        self.conns.insert(id, Conn { replies: tx, queued, abort });
                    }
                    Err(e) => {
                        // EMFILE and friends: wait a little instead of spinning.
                        warn!("accept failed: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                },
                Some(Event::Request { conn, dialect, req }) = events.recv() => {
                    self.request(conn, dialect, req);
                }
                Some(done) = tasks.join_next() => {
                    if let Ok(id) = done {
                        self.close(id);
                    }
                }
                c = control.recv(), if control_open => match c {
                    Some(Control::Clear(done)) => {
                        self.state.clear();
                        for (_, c) in self.conns.drain() {
                            c.abort.abort();
                        }
                        let _ = done.send(());
                    }
                    Some(Control::Stats(tx)) => {
                        let _ = tx.send(TcpStoreStats {
                            keys: self.state.num_keys(),
                            bytes: self.state.bytes(),
                            connections: self.conns.len(),
                            waiting: self.state.waiting_connections(),
                        });
                    }
                    None => control_open = false,
                },
            }
        }
    }

    fn close(&mut self, id: ConnId) {
        if let Some(c) = self.conns.remove(&id) {
            c.abort.abort();
            debug!(conn = id, "closed");
        }
        self.state.drop_conn(id);
    }

    fn send(&mut self, id: ConnId, reply: &Reply) {
        let Some(c) = self.conns.get(&id) else { return };
        let bytes = reply.to_bytes();
        let queued = c.queued.load(Ordering::Acquire);
        let over = queued > 0 && queued.saturating_add(bytes.len()) > self.config.reply_bytes;
        c.queued.fetch_add(bytes.len(), Ordering::AcqRel);
        if over || c.replies.try_send(bytes).is_err() {
            debug!(conn = id, "closing: its answers are not read");
            self.close(id);
        }
    }

    fn request(&mut self, conn: ConnId, dialect: Dialect, req: Request) {
        // A request that was in flight when its connection closed.
        if !self.conns.contains_key(&conn) {
            return;
        }
        match self.state.handle(conn, dialect, req) {
            Ok(out) => {
                if let Some(r) = &out.reply {
                    self.send(conn, r);
                }
                let stop = Reply::Byte(STOP_WAITING);
                for w in out.woken {
                    self.send(w, &stop);
                }
            }
            Err(fault) => {
                debug!(conn, "closing: {fault}");
                self.close(conn);
            }
        }
    }
}

/// A connection's answers, and the count of their bytes the actor bounds.
struct Replies {
    rx: mpsc::Receiver<Vec<u8>>,
    queued: Arc<AtomicUsize>,
}

/// One connection: decodes queries to the actor and writes its answers; returns its id when
/// either side ends (the peer closed, a bad query, the actor dropped its reply queue).
async fn connection(
    id: ConnId,
    stream: TcpStream,
    mut replies: Replies,
    events: mpsc::Sender<Event>,
    limits: WireLimits,
) -> ConnId {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let read = async {
        let mut dec = Decoder::new(limits);
        let mut buf = BytesMut::with_capacity(4096);
        let mut need = 1;
        loop {
            while buf.len() < need {
                // Reads at most what the pending query still needs, 64 KiB at a time.
                buf.reserve((need - buf.len()).clamp(4096, 64 * 1024));
                match rd.read_buf(&mut buf).await {
                    Ok(0) => {
                        debug!(conn = id, pending = buf.len(), "peer closed");
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        debug!(conn = id, "read failed: {e}");
                        return;
                    }
                }
            }
            loop {
                match dec.decode(&buf) {
                    Ok(Decoded::Incomplete(n)) => {
                        need = n;
                        break;
                    }
                    Ok(Decoded::Handshake(n)) => buf.advance(n),
                    Ok(Decoded::Request(req, n)) => {
                        buf.advance(n);
                        let dialect = dec.dialect().unwrap_or(Dialect::Current);
                        if events.send(Event::Request { conn: id, dialect, req }).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        debug!(conn = id, "closing: {e}");
                        return;
                    }
                }
            }
        }
    };
    let write = async {
        while let Some(b) = replies.rx.recv().await {
            if let Err(e) = wr.write_all(&b).await {
                debug!(conn = id, "write failed: {e}");
                return;
            }
            replies.queued.fetch_sub(b.len(), Ordering::AcqRel);
        }
        let _ = wr.shutdown().await;
    };
    tokio::select! {
        _ = read => {}
        _ = write => {}
    }
    id
}

#[cfg(test)]
mod tests;
