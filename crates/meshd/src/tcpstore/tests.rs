//! The server over real loopback sockets, with a minimal Rust client.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use super::codec::{self, Dialect, Request};
use super::*;

const T: Duration = Duration::from_secs(5);

struct Client {
    s: TcpStream,
    dialect: Dialect,
}

impl Client {
    /// Connects as torch 2.x does: VALIDATE, then PING.
    async fn current(addr: SocketAddr) -> Client {
        let s = TcpStream::connect(addr).await.expect("connect");
        let mut c = Client { s, dialect: Dialect::Current };
        let mut hello = Vec::new();
        codec::encode_validate(&mut hello);
        c.s.write_all(&hello).await.expect("validate");
        c.send(Request::Ping(77)).await;
        assert_eq!(c.u32().await, 77);
        c
    }

    async fn legacy(addr: SocketAddr) -> Client {
        Client { s: TcpStream::connect(addr).await.expect("connect"), dialect: Dialect::Legacy }
    }

    async fn send(&mut self, req: Request) {
        let mut b = Vec::new();
        assert!(req.encode(self.dialect, &mut b));
        self.s.write_all(&b).await.expect("send");
    }

    async fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        timeout(T, self.s.read_exact(&mut b)).await.expect("answer in time").expect("answer");
        b
    }

    async fn u8(&mut self) -> u8 {
        self.bytes::<1>().await[0]
    }

    async fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes().await)
    }

    async fn i64(&mut self) -> i64 {
        i64::from_le_bytes(self.bytes().await)
    }

    async fn value(&mut self) -> Vec<u8> {
        let n = u64::from_le_bytes(self.bytes().await) as usize;
        let mut v = vec![0; n];
        timeout(T, self.s.read_exact(&mut v)).await.expect("value in time").expect("value");
        v
    }

    async fn get(&mut self, key: &str) -> Vec<u8> {
        self.send(Request::Get { key: key.into() }).await;
        self.value().await
    }

    async fn set(&mut self, key: &str, value: &str) {
        self.send(Request::Set { key: key.into(), value: value.into() }).await;
    }

    /// True when the server closed this connection (EOF or reset) within `T`.
    async fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        loop {
            match timeout(T, self.s.read(&mut b)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => {}
            }
        }
    }
}

async fn serve() -> TcpStoreHandle {
    serve_with(TcpStoreConfig::default()).await
}

async fn serve_with(config: TcpStoreConfig) -> TcpStoreHandle {
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    TcpStoreServer::bind_with(addr, config).await.expect("bind").spawn().expect("spawn")
}

/// Polls the stats until `f` holds (connection tasks end asynchronously).
async fn eventually(h: &TcpStoreHandle, f: impl Fn(&TcpStoreStats) -> bool) -> TcpStoreStats {
    let mut last = h.stats().await;
    for _ in 0..200 {
        if f(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        last = h.stats().await;
    }
    panic!("stats never matched: {last:?}");
}

#[tokio::test]
async fn one_map_for_every_connection_and_both_dialects() {
    let h = serve().await;
    let addr = h.local_addr();
    let mut a = Client::current(addr).await;
    let mut b = Client::current(addr).await;
    let mut old = Client::legacy(addr).await;
    a.set("/k", "v").await;
    assert_eq!(b.get("/k").await, b"v");
    assert_eq!(old.get("/k").await, b"v");
    old.send(Request::Add { key: "/n".into(), delta: 2 }).await;
    assert_eq!(old.i64().await, 2);
    a.send(Request::Add { key: "/n".into(), delta: 3 }).await;
    assert_eq!(a.i64().await, 5);
    b.send(Request::NumKeys).await;
    assert_eq!(b.i64().await, 2);
    assert_eq!(h.stats().await.connections, 3);
}

#[tokio::test]
async fn a_wait_is_answered_when_another_connection_sets() {
    let h = serve().await;
    let mut waiter = Client::current(h.local_addr()).await;
    let mut old = Client::legacy(h.local_addr()).await;
    let mut setter = Client::current(h.local_addr()).await;
    waiter.send(Request::Wait { keys: vec![b"/a".to_vec(), b"/b".to_vec()] }).await;
    old.send(Request::Wait { keys: vec![b"/b".to_vec()] }).await;
    eventually(&h, |s| s.waiting == 2).await;
    setter.set("/a", "1").await;
    setter.send(Request::Ping(1)).await;
    assert_eq!(setter.u32().await, 1);
    assert_eq!(h.stats().await.waiting, 2);
    setter.set("/b", "2").await;
    assert_eq!(waiter.u8().await, codec::STOP_WAITING);
    assert_eq!(old.u8().await, codec::STOP_WAITING);
    // A timed-out wait: CANCEL_WAIT answers WAIT_CANCELED and the connection goes on.
    waiter.send(Request::Wait { keys: vec![b"/never".to_vec()] }).await;
    waiter.send(Request::CancelWait).await;
    assert_eq!(waiter.u8().await, codec::WAIT_CANCELED);
    assert_eq!(waiter.get("/a").await, b"1");
    assert_eq!(h.stats().await.waiting, 0);
}

#[tokio::test]
async fn hostile_peers_are_closed_and_the_store_goes_on() {
    let h = serve().await;
    let addr = h.local_addr();
    let mut good = Client::current(addr).await;
    good.set("/kept", "yes").await;

    let mut hostile: Vec<Vec<u8>> = vec![
        // Garbage (an unknown legacy type).
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        // A bad magic: read as a 1.13 SET with an absurd key length.
        vec![0, 0xde, 0xad, 0xbe, 0xef, 0xff, 0xff, 0xff, 0xff],
        // A value length of 2^63 after a valid handshake.
        {
            let mut v =
                vec![0, 0xce, 0xf7, 0x85, 0x3c, codec::current_type::SET, 1, 0, 0, 0, 0, 0, 0, 0, b'k'];
            v.extend_from_slice(&(1u64 << 63).to_le_bytes());
            v
        },
        // Too many keys in a WAIT.
        {
            let mut v = vec![0, 0xce, 0xf7, 0x85, 0x3c, codec::current_type::WAIT];
            v.extend_from_slice(&u64::MAX.to_le_bytes());
            v
        },
        // An unknown 2.x type.
        vec![0, 0xce, 0xf7, 0x85, 0x3c, 99],
    ];
    for bytes in hostile.drain(..) {
        let mut s = Client::legacy(addr).await;
        s.s.write_all(&bytes).await.expect("write");
        assert!(s.closed().await, "not closed after {bytes:?}");
    }
    // ADD on a value that is not an integer closes that connection only.
    let mut adder = Client::current(addr).await;
    adder.send(Request::Add { key: "/kept".into(), delta: 1 }).await;
    assert!(adder.closed().await);
    // A truncated query, then the peer vanishes.
    let mut trunc = Client::current(addr).await;
    trunc.s.write_all(&[codec::current_type::SET, 10, 0, 0, 0, 0, 0, 0, 0, b'a']).await.expect("write");
    drop(trunc);
    // A peer that vanishes while it waits.
    let mut gone = Client::current(addr).await;
    gone.send(Request::Wait { keys: vec![b"/never".to_vec()] }).await;
    drop(gone);

    assert_eq!(good.get("/kept").await, b"yes");
    let s = eventually(&h, |s| s.connections == 1 && s.waiting == 0).await;
    assert_eq!(s.keys, 1);
}

#[tokio::test]
async fn connections_over_the_limit_are_refused() {
    let h = serve_with(TcpStoreConfig { max_connections: 2, ..TcpStoreConfig::default() }).await;
    let mut a = Client::current(h.local_addr()).await;
    let _b = Client::current(h.local_addr()).await;
    let mut c = Client::legacy(h.local_addr()).await;
    assert!(c.closed().await);
    drop(a.s.shutdown().await);
    drop(a);
    eventually(&h, |s| s.connections == 1).await;
    let mut d = Client::current(h.local_addr()).await;
    d.set("/x", "1").await;
    assert_eq!(d.get("/x").await, b"1");
}

#[tokio::test]
async fn clear_empties_the_store_and_closes_connections() {
    let h = serve().await;
    let mut a = Client::current(h.local_addr()).await;
    a.set("/k", "v").await;
    a.send(Request::QueuePush { key: "/q".into(), value: "x".into() }).await;
    a.send(Request::Ping(5)).await;
    assert_eq!(a.u32().await, 5);
    h.clear().await;
    assert!(a.closed().await);
    let mut b = Client::current(h.local_addr()).await;
    b.send(Request::NumKeys).await;
    assert_eq!(b.i64().await, 0);
    b.send(Request::QueueLen { key: "/q".into() }).await;
    assert_eq!(b.i64().await, 0);
    assert_eq!(h.stats().await.bytes, 0);
}

#[tokio::test]
async fn dropping_the_handle_closes_everything() {
    let h = serve().await;
    let addr = h.local_addr();
    let mut a = Client::current(addr).await;
    a.send(Request::Wait { keys: vec![b"/never".to_vec()] }).await;
    drop(h);
    assert!(a.closed().await);
    // The port is free again: a new server binds it (a restart with an empty store).
    let h = TcpStoreServer::bind(addr).await.expect("rebind").spawn().expect("spawn");
    let mut b = Client::current(h.local_addr()).await;
    b.send(Request::NumKeys).await;
    assert_eq!(b.i64().await, 0);
}

#[tokio::test]
async fn a_peer_that_never_reads_is_closed() {
    let h = serve_with(TcpStoreConfig { reply_queue: 4, ..TcpStoreConfig::default() }).await;
    let mut a = Client::current(h.local_addr()).await;
    a.send(Request::Set { key: "/big".into(), value: vec![7; 1 << 20] }).await;
    // 1 MiB answers, never read: the socket buffers fill (tens of MiB at most), then the
    // reply queue.
    let mut b = Vec::new();
    for _ in 0..200 {
        Request::Get { key: b"/big".to_vec() }.encode(Dialect::Current, &mut b);
    }
    let _ = a.s.write_all(&b).await;
    assert_eq!(eventually(&h, |s| s.connections == 0).await.keys, 1);
}

#[tokio::test]
async fn queued_answer_bytes_are_bounded() {
    // Many queued answers allowed, few bytes: big answers that are not read close it.
    let h = serve_with(TcpStoreConfig { reply_bytes: 8 << 20, ..TcpStoreConfig::default() }).await;
    let mut a = Client::current(h.local_addr()).await;
    a.send(Request::Set { key: "/big".into(), value: vec![7; 4 << 20] }).await;
    let mut b = Vec::new();
    for _ in 0..64 {
        Request::Get { key: b"/big".to_vec() }.encode(Dialect::Current, &mut b);
    }
    let _ = a.s.write_all(&b).await;
    assert_eq!(eventually(&h, |s| s.connections == 0).await.keys, 1);
    // A reader that keeps up gets every big answer.
    let mut r = Client::current(h.local_addr()).await;
    for _ in 0..8 {
        r.send(Request::Get { key: b"/big".to_vec() }).await;
        assert_eq!(r.value().await.len(), 4 << 20);
    }
}

#[tokio::test]
async fn serve_future_serves_until_dropped() {
    let server = TcpStoreServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
    let addr = server.local_addr().expect("addr");
    let task = tokio::spawn(server.serve());
    let mut a = Client::current(addr).await;
    a.send(Request::ListKeys).await;
    assert_eq!(a.i64().await, 0);
    task.abort();
    assert!(a.closed().await);
}
