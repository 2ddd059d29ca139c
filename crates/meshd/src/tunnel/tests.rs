use super::*;
use crate::transport::TransportConfig;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::net::UnixStream;

#[test]
fn the_embedded_library_is_a_shared_object() {
    assert!(PRELOAD.len() > 1000 && PRELOAD.starts_with(b"\x7fELF"), "{} bytes", PRELOAD.len());
}

#[test]
fn requests_decode_like_the_preload_library_encodes_them() {
    let mut r = [0u8; TUNNEL_REQUEST_LEN];
    r[..3].copy_from_slice(b"MT\x01");
    r[3] = 4;
    r[4..6].copy_from_slice(&29500u16.to_be_bytes());
    r[6..22]
        .copy_from_slice(&"198.19.0.7".parse::<std::net::Ipv4Addr>().expect("ip").to_ipv6_mapped().octets());
    assert_eq!(decode_request(&r), Some("198.19.0.7:29500".parse().expect("addr")));
    assert_eq!(encode_request("198.19.0.7:29500".parse().expect("addr")), r);
    let v6: SocketAddr = "[fd00::7]:1".parse().expect("addr");
    assert_eq!(decode_request(&encode_request(v6)), Some(v6));
    r[2] = 2;
    assert_eq!(decode_request(&r), None);
}

/// Two nodes on loopback (127.0.0.1 and 127.0.0.2), each with its transport and tunnel.
struct Pair {
    a: Tunnel,
    b: Tunnel,
    dirs: Vec<PathBuf>,
    _transports: Vec<Transport>,
}

impl Drop for Pair {
    fn drop(&mut self) {
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

fn dir(name: &str) -> PathBuf {
    use std::os::unix::fs::DirBuilderExt;
    let d = std::env::temp_dir().join(format!("meshd-tunnel-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::DirBuilder::new().mode(0o700).create(&d).expect("test dir");
    d
}

fn pair(name: &str) -> Pair {
    pair_with(name, true)
}

/// A pair whose far end (b) counts the test process's listeners as the job's when
/// `b_listeners_are_the_jobs`, else as outside the job.
fn pair_with(name: &str, b_listeners_are_the_jobs: bool) -> Pair {
    let mut ts = Vec::new();
    for (n, ip) in [(1u128, "127.0.0.1"), (2, "127.0.0.2")] {
        let mut cfg = TransportConfig::new(NodeId::from_u128(n), 0);
        cfg.bind = ip.parse().expect("ip");
        cfg.run_hash = 7;
        let (t, events) = Transport::bind(cfg).expect("bind");
        // Keep the events flowing (nobody reads them here).
        tokio::spawn(async move {
            let mut events = events;
            while events.recv().await.is_some() {}
        });
        ts.push(t);
    }
    let (da, db) = (dir(&format!("{name}-a")), dir(&format!("{name}-b")));
    let cfg = |d: &PathBuf, me: usize| TunnelConfig {
        dir: d.clone(),
        routes: [(ts[1 - me].local_addr().ip(), ts[1 - me].local_addr())].into_iter().collect(),
        members: [(NodeId::from_u128(2 - me as u128), ts[1 - me].local_addr().ip())].into_iter().collect(),
        local_ip: ts[me].local_addr().ip(),
        preload_lib: None,
        // The test's own listeners play the ranks'.
        job_root: std::process::id() as i32,
        job_root_itself: me == 0 || b_listeners_are_the_jobs,
        own_ports: Vec::new(),
        per_peer: if me == 0 { 3 } else { 2 },
        files: None,
        plane: true,
    };
    let start = |d: &PathBuf, me: usize| {
        Tunnel::start(
            cfg(d, me),
            ts[me].clone(),
            incoming(&ts[me]).expect("incoming"),
            Arc::new(TunnelStats::default()),
        )
        .expect("tunnel")
    };
    let (a, b) = (start(&da, 0), start(&db, 1));
    Pair { a, b, dirs: vec![da, db], _transports: ts }
}

async fn open(p: &Pair, dest: SocketAddr) -> (UnixStream, u8) {
    let mut u = UnixStream::connect(&p.a.socket).await.expect("tunnel socket");
    u.write_all(&encode_request(dest)).await.expect("request");
    let mut st = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(20), u.read_exact(&mut st))
        .await
        .expect("in time")
        .expect("status");
    (u, st[0])
}

/// meshd's side: a stream with half-closes both ways, a refusal, a destination that is no
/// roster node, and a reset on the far end reaching the near end as the end of its socket.
#[tokio::test]
async fn loopback_tunnel_half_closes_refuses_and_resets() {
    let p = pair("mesh");
    let listener = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let dest = listener.local_addr().expect("addr");

    let (mut u, st) = open(&p, dest).await;
    assert_eq!(st, wire::status::OK);
    let (mut srv, _) = listener.accept().await.expect("accept");
    u.write_all(b"hello").await.expect("write");
    u.shutdown().await.expect("half-close");
    let mut got = Vec::new();
    srv.read_to_end(&mut got).await.expect("far end reads to the half-close");
    assert_eq!(got, b"hello");
    srv.write_all(b"world").await.expect("answer");
    drop(srv);
    let mut back = Vec::new();
    u.read_to_end(&mut back).await.expect("near end reads to the end");
    assert_eq!(back, b"world");

    // Nobody listens there: refused.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.2:0").expect("bind");
        l.local_addr().expect("addr")
    };
    assert_eq!(open(&p, closed).await.1, wire::status::REFUSED);
    // Not a roster node's address: unreachable, without any QUIC stream.
    assert_eq!(open(&p, "127.0.0.3:1".parse().expect("addr")).await.1, wire::status::UNREACHABLE);

    // The far application resets its connection: the near one's socket ends.
    let (mut u, st) = open(&p, dest).await;
    assert_eq!(st, wire::status::OK);
    let (srv, _) = listener.accept().await.expect("accept");
    reset_on_close(&srv);
    drop(srv);
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(10), u.read_to_end(&mut rest)).await.expect("no hang");
    assert!(end.is_err() || rest.is_empty(), "{end:?} {rest:?}");
    let a = p.a.stats();
    assert_eq!(a.opened.load(Ordering::Relaxed), 2, "{}", a.line());
    assert_eq!(a.failed.load(Ordering::Relaxed), 2, "{}", a.line());
    assert_eq!(p.b.stats().served.load(Ordering::Relaxed), 2, "{}", p.b.stats().line());
    assert_eq!(a.bytes_out.load(Ordering::Relaxed), 5);
    assert_eq!(a.bytes_in.load(Ordering::Relaxed), 5);
}

/// The far end serves the job, not the host: a port on which something outside the job
/// listens is refused (counted, and the connection never made), and a token holder that
/// claims a member's node id from another address reaches nothing.
#[tokio::test]
async fn the_far_end_refuses_ports_outside_the_job_and_ids_from_elsewhere() {
    let p = pair_with("outside", false);
    let listener = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let dest = listener.local_addr().expect("addr");
    assert_eq!(open(&p, dest).await.1, wire::status::REFUSED);
    assert_eq!(p.b.stats().refused.load(Ordering::Relaxed), 1, "{}", p.b.stats().line());
    assert_eq!(p.b.stats().served.load(Ordering::Relaxed), 0);
    let accepted = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
    assert!(accepted.is_err(), "the far end connected to a port outside the job");

    // An impostor at 127.0.0.3 with node a's id (1): authenticated, but not from a's
    // roster address.
    let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
    cfg.bind = "127.0.0.3".parse().expect("ip");
    cfg.run_hash = 7;
    let (imp, mut events) = Transport::bind(cfg).expect("bind");
    tokio::spawn(async move { while events.recv().await.is_some() {} });
    let b_addr = p._transports[1].local_addr();
    let (_send, mut recv) = imp.open_tunnel(b_addr, &encode_request(dest)).await.expect("stream");
    let mut st = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(10), recv.read_exact(&mut st))
        .await
        .expect("answer")
        .expect("byte");
    assert_eq!(st[0], wire::status::UNREACHABLE);
    assert_eq!(p.b.stats().refused.load(Ordering::Relaxed), 2, "{}", p.b.stats().line());
    assert!(tokio::time::timeout(Duration::from_millis(300), listener.accept()).await.is_err());
}

/// The far end connects to the destination only once the near end's offer (sent right
/// behind the request) is in: a late offer delays the connection, and a stream that ends
/// with half an offer is reset without the job's listener ever seeing a connection (which
/// it would read as an empty stream closed cleanly).
#[tokio::test]
async fn the_far_end_connects_only_after_the_near_ends_offer() {
    let p = pair("offer");
    let listener = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let dest = listener.local_addr().expect("addr");
    let b_addr = p._transports[1].local_addr();
    // Node a's own transport, as its near end would use it, but the offer held back.
    let (mut send, mut recv) =
        p._transports[0].open_tunnel(b_addr, &encode_request(dest)).await.expect("stream");
    let early = tokio::time::timeout(Duration::from_millis(700), listener.accept()).await;
    assert!(early.is_err(), "the far end connected before the offer came");
    send.write_all(&plane_stream::Offer::default().encode()).await.expect("offer");
    let (_srv, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .expect("connected")
        .expect("accept");
    let mut st = [0u8; 1 + plane_stream::OFFER_LEN];
    tokio::time::timeout(Duration::from_secs(10), recv.read_exact(&mut st))
        .await
        .expect("in time")
        .expect("answer");
    assert_eq!(st[0], wire::status::OK);

    // Half an offer, then the end of the stream: reset, and nothing connected.
    let (mut send, mut recv) =
        p._transports[0].open_tunnel(b_addr, &encode_request(dest)).await.expect("stream");
    send.write_all(&[0u8; plane_stream::OFFER_LEN / 2]).await.expect("half an offer");
    send.finish().expect("finish");
    let mut byte = [0u8; 1];
    let answer =
        tokio::time::timeout(Duration::from_secs(10), recv.read_exact(&mut byte)).await.expect("in time");
    assert!(answer.is_err(), "a stream without its offer is reset, not answered: {answer:?} {byte:?}");
    let late = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
    assert!(late.is_err(), "the far end connected for a stream without an offer");
}

/// The caps hold and free up: node a's ranks may hold 3 connections to b (a's near cap),
/// b serves 2 from a (b's far cap); past them a connect is refused at once, and once one
/// closes the next one connects.
#[tokio::test]
async fn per_peer_caps_refuse_at_once_and_free_up() {
    let p = pair("caps");
    let listener = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let dest = listener.local_addr().expect("addr");
    let (u1, s1) = open(&p, dest).await;
    let (_u2, s2) = open(&p, dest).await;
    assert_eq!((s1, s2), (wire::status::OK, wire::status::OK));
    assert_eq!(open(&p, dest).await.1, wire::status::REFUSED, "b's far cap of 2");
    assert_eq!(p.b.stats().refused.load(Ordering::Relaxed), 1, "{}", p.b.stats().line());
    // The refused stream's near permit is back: still 2 held of a's 3.
    drop(u1);
    let mut freed = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (u, st) = open(&p, dest).await;
        if st == wire::status::OK {
            freed = true;
            drop(u);
            break;
        }
    }
    assert!(freed, "a closed connection frees its place");
}

/// The preload library in a real process (python3, when present): a plain socket to the
/// other node goes through the tunnel (getpeername names the destination, TCP_NODELAY is
/// accepted), and a closed port is ECONNREFUSED at once.
#[tokio::test]
async fn the_preload_library_hands_connects_to_the_tunnel() {
    let python = "/usr/bin/python3";
    if !Path::new(python).exists() {
        eprintln!("SKIPPED: no {python}");
        return;
    }
    let p = pair("preload");
    let listener = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let dest = listener.local_addr().expect("addr");
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.2:0").expect("bind");
        l.local_addr().expect("addr")
    };
    // A second listener for the IPv6 socket's connection (accepted and dropped).
    let listener6 = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let dest6 = listener6.local_addr().expect("addr");
    let server6 = tokio::spawn(async move {
        let _ = listener6.accept().await;
    });
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.expect("read");
        s.write_all(&got.iter().rev().copied().collect::<Vec<u8>>()).await.expect("write");
    });
    let script = format!(
        r#"
import errno, socket, time
s = socket.create_connection(("127.0.0.2", {port}), timeout=10)
assert s.getpeername() == ("127.0.0.2", {port}), s.getpeername()
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.sendall(b"abc" * 1000)
s.shutdown(socket.SHUT_WR)
got = b""
while True:
    b = s.recv(65536)
    if not b:
        break
    got += b
assert got == (b"abc" * 1000)[::-1], len(got)
# A dual-stack socket to the IPv4-mapped address: tunnelled too, and its names stay IPv6.
s6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s6.settimeout(10)
s6.connect(("::ffff:127.0.0.2", {port6}))
assert s6.getpeername()[:2] == ("::ffff:127.0.0.2", {port6}), s6.getpeername()
assert s6.getsockname()[0] == "::ffff:127.0.0.1", s6.getsockname()
assert s6.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) == socket.AF_INET6
s6.close()
t = time.time()
try:
    socket.create_connection(("127.0.0.2", {closed}), timeout=10)
    raise SystemExit("connected to a closed port")
except ConnectionRefusedError as e:
    assert e.errno == errno.ECONNREFUSED
print("PRELOAD OK", round(time.time() - t, 3))
"#,
        port = dest.port(),
        port6 = dest6.port(),
        closed = closed.port()
    );
    let env = p.a.env(None);
    let out = tokio::process::Command::new(python)
        .args(["-c", &script])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("MESHD_NODE_ADDR", "127.0.0.1")
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), out).await.expect("no hang").expect("python3");
    let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && o.contains("PRELOAD OK"), "{o}\n{e}");
    server.await.expect("server");
    server6.await.expect("server6");
    let a = p.a.stats();
    assert_eq!(a.opened.load(Ordering::Relaxed), 2, "{}", a.line());
    assert_eq!(a.failed.load(Ordering::Relaxed), 1, "{}", a.line());
}

/// Runs `script` (python3, through the preload library of `p.a`); its stdout.
async fn python_through(p: &Pair, script: &str) -> Option<String> {
    let python = "/usr/bin/python3";
    if !Path::new(python).exists() {
        eprintln!("SKIPPED: no {python}");
        return None;
    }
    let env = p.a.env(None);
    let out = tokio::process::Command::new(python)
        .args(["-c", script])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("MESHD_NODE_ADDR", "127.0.0.1")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(40), out).await.expect("no hang").expect("python3");
    let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{o}\n{e}");
    Some(o.into_owned())
}

/// What the application sees when its tunnelled connection fails, through the preload
/// library, as over TCP after an RST: the first call fails with ECONNRESET, a later read
/// returns end of file and a later write EPIPE. `reader` reads (blocked in recv when the
/// failure comes), the writer streams until a send fails.
fn reset_script(port: u16) -> String {
    format!(
        r#"
import socket, sys
mode = sys.argv[1] if len(sys.argv) > 1 else "reader"
s = socket.create_connection(("127.0.0.2", {port}), timeout=30)
s.sendall(b"x" * 1000)
first = None
try:
    if mode == "reader":
        b = s.recv(65536)
        first = "eof %d" % len(b)
    else:
        while True:
            s.send(b"y" * 65536)
except OSError as e:
    first = "errno %d" % e.errno
later_recv = s.recv(10)
try:
    s.send(b"z")
    later_send = "ok"
except OSError as e:
    later_send = "errno %d" % e.errno
print("FIRST", first, "LATER_RECV", len(later_recv), "LATER_SEND", later_send, flush=True)
"#
    )
}

/// The far application resets its connection (RST): the application through the tunnel
/// reads ECONNRESET, then end of file, and a write then fails with EPIPE.
#[tokio::test]
async fn a_far_reset_reads_as_econnreset_through_the_preload_library() {
    let p = pair("reset");
    let listener = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let port = listener.local_addr().expect("addr").port();
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        let mut got = [0u8; 1000];
        s.read_exact(&mut got).await.expect("read");
        reset_on_close(&s);
    });
    let Some(out) = python_through(&p, &reset_script(port)).await else { return };
    server.await.expect("server");
    assert!(out.contains("FIRST errno 104 LATER_RECV 0 LATER_SEND errno 32"), "{out}");
}

/// The far node goes away (its meshd closes every QUIC connection, as a node that dies
/// loses them at the idle timeout) while the application is blocked reading, or writing:
/// its first failed call says ECONNRESET.
#[tokio::test]
async fn a_lost_far_node_reads_and_writes_as_econnreset_through_the_preload_library() {
    for mode in ["reader", "writer"] {
        let p = pair(&format!("lost-{mode}"));
        let listener = TcpListener::bind("127.0.0.2:0").await.expect("listen");
        let port = listener.local_addr().expect("addr").port();
        let far = p._transports[1].clone();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut got = [0u8; 1000];
            s.read_exact(&mut got).await.expect("read");
            tokio::time::sleep(Duration::from_millis(200)).await;
            far.shutdown().await;
            s
        });
        let script = reset_script(port)
            .replace("sys.argv[1] if len(sys.argv) > 1 else \"reader\"", &format!("{mode:?}"));
        let Some(out) = python_through(&p, &script).await else { return };
        drop(server.await.expect("server"));
        assert!(out.contains("FIRST errno 104 LATER_RECV 0 LATER_SEND errno 32"), "{mode}: {out}");
    }
}

/// Reads `u` to its end; whether it ended in time (a reset or an end of file).
async fn ends(u: &mut UnixStream) -> bool {
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), u.read_to_end(&mut rest)).await.is_ok()
}

/// `--fault-tolerance node`: the connections with a lost node are ended at once, at both
/// ends, and only those; after a lost quorum, also those with the other groups except the
/// ones to a kept endpoint (a manager, a store).
#[tokio::test]
async fn a_cut_ends_the_lost_nodes_connections_at_both_ends_and_keeps_what_it_must() {
    let p = pair("cut");
    let l1 = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let l2 = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let (d1, d2) = (l1.local_addr().expect("addr"), l2.local_addr().expect("addr"));
    let (mut u1, s1) = open(&p, d1).await;
    let (mut srv1, _) = l1.accept().await.expect("accept");
    let (mut u2, s2) = open(&p, d2).await;
    let (mut srv2, _) = l2.accept().await.expect("accept");
    assert_eq!((s1, s2), (wire::status::OK, wire::status::OK));

    // A lost node that is not b: nothing of a's is cut.
    assert_eq!(p.a.cut("127.0.0.9".parse().expect("ip"), None), 0);
    // After a lost quorum: b is one of the other groups, d2 is a kept endpoint (b's store).
    let abort =
        meshd_proto::node::AbortGroup { peers: vec!["127.0.0.2".parse().expect("ip")], keep: vec![d2] };
    assert_eq!(p.a.cut("127.0.0.9".parse().expect("ip"), Some(&abort)), 1, "d1 only");
    assert!(ends(&mut u1).await, "the rank's socket to d1 ends");
    let mut rest = Vec::new();
    let far =
        tokio::time::timeout(Duration::from_secs(5), srv1.read_to_end(&mut rest)).await.expect("in time");
    assert!(far.is_err() || rest.is_empty(), "the far application sees its connection end: {far:?}");
    // The kept one still carries bytes both ways.
    u2.write_all(b"ping").await.expect("write");
    let mut four = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(5), srv2.read_exact(&mut four))
        .await
        .expect("in time")
        .expect("read");
    assert_eq!(&four, b"ping");
    // b is lost: the rest goes, at b's far end too (b cuts what it serves for a).
    assert_eq!(p.b.cut("127.0.0.1".parse().expect("ip"), None), 1);
    assert!(ends(&mut u2).await, "the rank's socket to d2 ends");
    assert_eq!(p.a.cut("127.0.0.2".parse().expect("ip"), None), 0, "nothing left to cut");
}

/// A node that joins the running job (`--fault-tolerance node`) is served once the roster
/// says so, and the ranks' preload library finds its address in the peers file.
#[tokio::test]
async fn a_node_that_joins_the_running_job_is_let_in_and_listed() {
    let mut p = pair("join");
    let listener = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let dest = listener.local_addr().expect("addr");
    // b's roster without a: a's streams are refused ("not a member").
    let member = |id: u128, addr: SocketAddr| meshd_proto::rendezvous::RosterMember {
        id: NodeId::from_u128(id),
        addr,
        nproc: 1,
        hostname: String::new(),
    };
    let (a_addr, b_addr) = (p._transports[0].local_addr(), p._transports[1].local_addr());
    let mut roster = meshd_proto::rendezvous::Roster {
        run_hash: 7,
        restart: 0,
        epoch: 0,
        master_port: 0,
        members: vec![member(2, b_addr)],
    };
    p.b.set_roster(&roster, NodeId::from_u128(2));
    let mut u = UnixStream::connect(&p.a.socket).await.expect("tunnel socket");
    u.write_all(&encode_request(dest)).await.expect("request");
    let mut st = [0u8; 1];
    u.read_exact(&mut st).await.expect("status");
    assert_eq!(st[0], wire::status::UNREACHABLE, "not a member of b's roster");
    // a joins: served.
    roster.members.push(member(1, a_addr));
    roster.epoch += 1;
    p.b.set_roster(&roster, NodeId::from_u128(2));
    let mut u = UnixStream::connect(&p.a.socket).await.expect("tunnel socket");
    u.write_all(&encode_request(dest)).await.expect("request");
    u.read_exact(&mut st).await.expect("status");
    assert_eq!(st[0], wire::status::OK);
    // a's own list: a third node at 127.0.0.3 joins; its address is in a's peers file.
    roster.members.push(member(3, "127.0.0.3:9".parse().expect("addr")));
    p.a.set_roster(&roster, NodeId::from_u128(1));
    let file = std::fs::read_to_string(&p.a.peers_file).expect("peers file");
    assert_eq!(file, "127.0.0.2,127.0.0.3");
    let env = p.a.env(None);
    let listed = p.a.peers_file.display().to_string();
    assert!(env.iter().any(|(k, v)| k == "MESHD_TUNNEL_PEERS_FILE" && *v == listed), "{env:?}");
}

/// Writes `n` bytes of a pattern seeded by `seed` to `w` in uneven writes, then half-closes.
async fn write_pattern<W: AsyncWrite + Unpin>(mut w: W, n: usize, seed: u8) -> W {
    let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8 ^ seed).collect();
    let mut at = 0;
    let mut step = 1;
    while at < n {
        let k = step.min(n - at);
        w.write_all(&data[at..at + k]).await.expect("write");
        at += k;
        step = (step * 7 + 13) % 300_000 + 1;
    }
    w.shutdown().await.expect("half-close");
    w
}

/// Reads to the end of file and checks the pattern.
async fn read_pattern<R: AsyncRead + Unpin>(mut r: R, n: usize, seed: u8) -> R {
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), r.read_to_end(&mut got))
        .await
        .expect("no hang")
        .expect("read");
    assert_eq!(got.len(), n);
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8 ^ seed), "bytes out of order");
    r
}

/// Once the data plane is ready between the nodes, a tunnelled connection's bytes travel
/// on it both ways (more than a window's worth, so credit must come back), in order, with
/// half-closes; a far reset still reaches the near end.
#[tokio::test]
async fn bytes_travel_on_the_data_plane_in_order_with_half_closes() {
    let p = pair("plane");
    let listener = TcpListener::bind("127.0.0.2:0").await.expect("listen");
    let dest = listener.local_addr().expect("addr");
    // A first connection makes the data connection (and its plane links).
    let (u, st) = open(&p, dest).await;
    assert_eq!(st, wire::status::OK);
    let (srv, _) = listener.accept().await.expect("accept");
    drop((u, srv));
    let (ta, tb) = (&p._transports[0], &p._transports[1]);
    let (pa, pb) = (ta.plane().expect("plane a"), tb.plane().expect("plane b"));
    assert!(pa.wait_ready(tb.local_addr(), Duration::from_secs(10)).await, "a's plane to b");
    assert!(pb.wait_ready(ta.local_addr(), Duration::from_secs(10)).await, "b's plane to a");
    let before = (pa.counters().messages, pb.counters().messages);

    let n = 3 * plane_stream::WINDOW as usize + 12_345;
    let (u, st) = open(&p, dest).await;
    assert_eq!(st, wire::status::OK);
    let (srv, _) = listener.accept().await.expect("accept");
    let (ur, uw) = u.into_split();
    let (sr, sw) = srv.into_split();
    let (_, _, _, _) = tokio::join!(
        write_pattern(uw, n, 1),
        read_pattern(sr, n, 1),
        write_pattern(sw, n / 2, 2),
        read_pattern(ur, n / 2, 2)
    );
    let after = (pa.counters().messages, pb.counters().messages);
    assert!(after.0 > before.0 && after.1 > before.1, "no bytes on the plane: {before:?} {after:?}");
    // Both ends count those bytes as the data plane's (the end-of-round line says so).
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let (sa, sb) = (p.a.stats(), p.b.stats());
    assert!(g(&sa.plane_out) >= n as u64 && g(&sa.plane_in) >= (n / 2) as u64, "{}", sa.line());
    assert!(g(&sb.plane_in) >= n as u64 && g(&sb.plane_out) >= (n / 2) as u64, "{}", sb.line());
    assert!(g(&sa.plane_out) <= g(&sa.bytes_out) && g(&sb.plane_in) <= g(&sb.bytes_in), "{}", sa.line());

    // The far application resets: the near end's socket ends, plane or not.
    let (mut u, st) = open(&p, dest).await;
    assert_eq!(st, wire::status::OK);
    let (mut srv, _) = listener.accept().await.expect("accept");
    u.write_all(&[7; 100_000]).await.expect("write");
    let mut some = [0u8; 1000];
    srv.read_exact(&mut some).await.expect("far end reads");
    reset_on_close(&srv);
    drop(srv);
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(10), u.read_to_end(&mut rest)).await.expect("no hang");
    assert!(end.is_err() || rest.is_empty(), "{end:?} {rest:?}");
    // Nothing left registered once the connections ended.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(format!("{:?}", pa.streams()).contains("registered: 0"), "{:?}", pa.streams());
}

/// The counters' line says which path carried the bytes: all on the plane, all on QUIC
/// streams, or how much on the plane.
#[test]
fn the_line_says_how_much_the_data_plane_carried() {
    let s = TunnelStats::default();
    assert!(!s.line().contains("data plane"), "{}", s.line());
    s.bytes_out.store(3 << 20, Ordering::Relaxed);
    s.bytes_in.store(1 << 20, Ordering::Relaxed);
    assert!(
        s.line().ends_with("3.0 MiB sent, 1.0 MiB received (all on QUIC streams, none on the data plane)"),
        "{}",
        s.line()
    );
    s.plane_out.store(3 << 20, Ordering::Relaxed);
    s.plane_in.store(1 << 20, Ordering::Relaxed);
    assert!(s.line().ends_with("(all on the data plane)"), "{}", s.line());
    s.plane_out.store(1 << 20, Ordering::Relaxed);
    assert!(
        s.line().ends_with("(1.0 MiB sent and 1.0 MiB received on the data plane, the rest on QUIC streams)"),
        "{}",
        s.line()
    );
}
