use super::*;
use auth::Token;

/// A node of another protocol version (ALPN `meshd/1`) is named as such, not as a bare
/// TLS alert.
#[tokio::test]
async fn another_protocol_version_is_named() {
    let (server, _) =
        tls::configs_with_alpn(Arc::new(quinn::TransportConfig::default()), b"meshd/1").expect("old configs");
    let old = quinn::Endpoint::server(server, "127.0.0.1:0".parse().expect("addr")).expect("old endpoint");
    let to = old.local_addr().expect("addr");
    let accept = tokio::spawn(async move {
        if let Some(incoming) = old.accept().await {
            let _ = incoming.await;
        }
    });
    let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
    cfg.bind = "127.0.0.1".parse().expect("ip");
    let (t, _events) = Transport::bind(cfg).expect("bind");
    let err = t.probe(to).await.expect_err("the handshake must fail").to_string();
    assert!(err.contains("does not speak meshd/9") && err.contains("another meshd version"), "{err}");
    accept.abort();
}

/// Issue 16: whoever answers at a peer's address (a squatter on the port) without the
/// token gets nothing it could test token guesses against offline. It sees the client's
/// SPAKE2 message, fresh on every connection, and answers with its own and a made-up
/// confirmation; the client refuses it and sends no confirmation of its own.
#[tokio::test]
async fn a_squatter_gets_no_confirmation_and_nothing_repeatable() {
    let (server, _) = tls::configs(Arc::new(quinn::TransportConfig::default())).expect("configs");
    let squatter = quinn::Endpoint::server(server, "127.0.0.1:0".parse().expect("addr")).expect("endpoint");
    let to = squatter.local_addr().expect("addr");
    let seen = tokio::spawn(async move {
        let mut firsts = Vec::new();
        let mut after = Vec::new();
        for _ in 0..2 {
            let Some(incoming) = squatter.accept().await else { break };
            let Ok(conn) = incoming.await else { continue };
            let Ok((mut send, mut recv)) = conn.accept_bi().await else { continue };
            let Ok(first) = read_hello(&mut recv).await else { continue };
            // Answer as a node holding some other token would.
            let guess = Token::new("a guess").start();
            let mut h = first.clone();
            h.node = NodeId::from_u128(99);
            h.pake = wire::PakeMessage::from_bytes(guess.message());
            h.mac = [0x5a; 32];
            let _ = write_auth_message(&mut send, &wire::encode(&h)).await;
            // Whatever the client sends next (nothing: it refuses) until it closes.
            let rest = recv.read_to_end(4096).await;
            after.push(rest.map(|b| b.len()).map_err(|e| e.to_string()));
            firsts.push(first);
            let _ = conn.closed().await;
        }
        (firsts, after)
    });
    let (client, mut events) = loopback(1, Some("the real token"), 7);
    for _ in 0..2 {
        let err = client.probe(to).await.expect_err("the squatter must be refused").to_string();
        assert!(err.contains("different token"), "{err}");
    }
    let (firsts, after) =
        tokio::time::timeout(Duration::from_secs(10), seen).await.expect("in time").expect("task");
    assert_eq!(firsts.len(), 2);
    assert_ne!(firsts[0].pake, firsts[1].pake, "a fresh SPAKE2 message on every connection");
    assert_eq!(firsts[0].mac, [0; 32], "nothing keyed by the token in the first message");
    for a in &after {
        assert!(!matches!(a, Ok(n) if *n > 0), "the client sent its confirmation to a squatter: {a:?}");
    }
    let reason = auth_failed(&mut events).await;
    assert!(reason.contains("different token"), "{reason}");
}

/// Issue 29: a data connection (which raises no PeerUp) is taken only beside a live main
/// connection of the same node from the same address: a second "node 1" cannot slip in
/// through a lane. With the main connection, the lane is taken; a peer then holds at most
/// `MAX_CONNS_PER_ADDR` connections.
#[tokio::test]
async fn lanes_need_the_nodes_main_connection_and_connections_per_peer_are_capped() {
    let (server, _se) = loopback(2, Some("tok"), 7);
    let to = server.local_addr();
    let (client, _ce) = loopback(1, Some("tok"), 7);
    let err = connect(&client.inner, to, 3).await.expect_err("a lane alone").to_string();
    assert!(err.contains("without a live main connection"), "{err}");
    connect(&client.inner, to, 0).await.expect("main");
    connect(&client.inner, to, 3).await.expect("lane beside the main connection");
    let mut refused = None;
    for i in 0..guard::MAX_CONNS_PER_ADDR + 2 {
        if let Err(e) = connect(&client.inner, to, 0).await {
            refused = Some((i, e.to_string()));
            break;
        }
    }
    let (i, why) = refused.expect("a cap on connections per peer");
    assert_eq!(i, guard::MAX_CONNS_PER_ADDR - 2, "{why}");
    assert!(why.contains("connections from"), "{why}");
    assert_eq!(server.inner.authenticated.count(client.local_addr()), guard::MAX_CONNS_PER_ADDR);
}

fn loopback(node: u128, token: Option<&str>, run_hash: u64) -> (Transport, mpsc::Receiver<TransportEvent>) {
    let mut cfg = TransportConfig::new(NodeId::from_u128(node), 0);
    cfg.bind = "127.0.0.1".parse().expect("ip");
    cfg.token = token.map(Token::new);
    cfg.run_hash = run_hash;
    Transport::bind(cfg).expect("bind")
}

async fn auth_failed(events: &mut mpsc::Receiver<TransportEvent>) -> String {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), events.recv()).await {
            Ok(Some(TransportEvent::AuthFailed { reason, .. })) => return reason.to_string(),
            Ok(Some(_)) => {}
            _ => panic!("no AuthFailed event"),
        }
    }
}

/// Each end words a token refusal from its own side: the node without a token reads
/// that IT has none, not that the refusing peer has none.
#[tokio::test]
async fn token_refusals_read_right_on_both_ends() {
    let (with, mut with_events) = loopback(1, Some("t"), 7);
    let (without, _e) = loopback(2, None, 7);
    let err = without.probe(with.local_addr()).await.expect_err("refused").to_string();
    assert!(
        err.contains("refused this node: failed authentication: this node has no token; 127.0.0.1 has one"),
        "{err}"
    );
    let theirs = auth_failed(&mut with_events).await;
    assert!(theirs.starts_with("it has no token; this node has one"), "{theirs}");
    // And the other way round: a token where the refusing node has none.
    let (bare, mut bare_events) = loopback(3, None, 7);
    let err = with.probe(bare.local_addr()).await.expect_err("refused").to_string();
    assert!(err.contains("this node holds a token; 127.0.0.1 has none"), "{err}");
    assert!(auth_failed(&mut bare_events).await.starts_with("it holds a token; this node has none"));
    for t in [with, without, bare] {
        t.shutdown().await;
    }
}

fn store_frame(key: &str) -> Frame {
    Frame::Store(wire::StoreMsg::Set {
        restart: 0,
        version: meshd_proto::store::Version { counter: 1, writer: NodeId::from_u128(1) },
        key: key.into(),
        value: vec![7],
    })
}

/// The next store frame `events` delivers, with its key, within `within`.
async fn next_store(events: &mut mpsc::Receiver<TransportEvent>, within: Duration) -> Option<String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(TransportEvent::Frame {
                frame: Frame::Store(wire::StoreMsg::Set { key, .. }), ..
            })) => {
                return Some(key);
            }
            Ok(Some(_)) => {}
            _ => return None,
        }
    }
}

/// A UDP port nothing listens on (bound, then freed).
fn free_port() -> SocketAddr {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.local_addr().expect("addr")
}

/// Issue 17: control frames are never starved by data. The peer takes none of the
/// data streams opened to it (they stay parked, as for an operation it has not
/// started), until they hold every stream slot it grants and more than its connection
/// window in unread bytes; a control frame still arrives at once, because data travels
/// on data connections and the main connection is left to control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_frames_get_through_while_data_streams_are_parked() {
    let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
    cfg.bind = "127.0.0.1".parse().expect("ip");
    cfg.token = Some(Token::new("t"));
    cfg.run_hash = 7;
    cfg.send_timeout = Duration::from_millis(500);
    let (a, _a_events) = Transport::bind(cfg).expect("bind");
    let (b, mut b_events) = loopback(2, Some("t"), 7);
    let to = b.local_addr();
    // The main connection first, as a running node has it.
    a.send(to, &store_frame("before"), true);
    assert_eq!(next_store(&mut b_events, Duration::from_secs(5)).await.as_deref(), Some("before"));
    // Every stream slot b grants on the data connection, parked unread...
    let mut parked = Vec::new();
    for op in 0..guard::UNI_STREAMS as u64 {
        parked.push(a.open_data(to, op).await.expect("a data stream within the limit"));
    }
    // ...one more cannot be opened (and says why, in time, rather than waiting forever)...
    let t = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(15), a.open_data(to, 999))
        .await
        .expect("opening a data stream has a deadline")
        .expect_err("no stream slot left");
    assert!(err.to_string().contains("granted no data stream"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // ...and more unread bytes than the connection window: writers that block.
    let per = 4 << 20;
    let chunk = Bytes::from(vec![0u8; per]);
    let mut writers = Vec::new();
    for mut s in parked.drain(..(guard::RECEIVE_WINDOW as usize / per + 2)) {
        let c = chunk.clone();
        writers.push(tokio::spawn(async move {
            let _ = s.write_chunk(c).await;
            s
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(writers.iter().any(|w| !w.is_finished()), "the data connection's window is full");
    // Control frames still arrive promptly (each on a stream of its own: in any order).
    let t = Instant::now();
    for k in ["abort", "done"] {
        a.send(to, &store_frame(k), true);
    }
    let mut got = Vec::new();
    for _ in 0..2 {
        got.extend(next_store(&mut b_events, Duration::from_secs(3)).await);
    }
    got.sort();
    assert_eq!(got, ["abort", "done"]);
    assert!(t.elapsed() < Duration::from_secs(2), "control waited {:?}", t.elapsed());
    assert_eq!(a.undelivered(), 0);
    for w in writers {
        w.abort();
    }
    drop(parked);
    a.shutdown().await;
    b.shutdown().await;
}

/// A reliable frame to a peer that is not up yet is kept and retried with backoff,
/// not dropped: it arrives once the peer is there.
#[tokio::test]
async fn a_reliable_frame_waits_for_a_peer_that_comes_up_later() {
    let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
    cfg.bind = "127.0.0.1".parse().expect("ip");
    cfg.connect_timeout = Duration::from_millis(300);
    let (a, _e) = Transport::bind(cfg).expect("bind");
    let later = free_port();
    a.send(later, &store_frame("early"), true);
    // Several connect attempts fail meanwhile.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(a.queued(later), 1, "the frame is kept while the peer is unreachable");
    let mut cfg = TransportConfig::new(NodeId::from_u128(2), later.port());
    cfg.bind = "127.0.0.1".parse().expect("ip");
    let (b, mut b_events) = Transport::bind(cfg).expect("bind the peer late");
    assert_eq!(next_store(&mut b_events, Duration::from_secs(10)).await.as_deref(), Some("early"));
    assert_eq!((a.queued(later), a.undelivered()), (0, 0));
    a.shutdown().await;
    b.shutdown().await;
}

/// A frame that finally cannot be delivered is counted (and logged), not lost in
/// silence; one for a forgotten peer too.
#[tokio::test]
async fn undeliverable_frames_are_counted_at_the_horizon_or_when_forgotten() {
    let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
    cfg.bind = "127.0.0.1".parse().expect("ip");
    cfg.connect_timeout = Duration::from_millis(200);
    cfg.reliable_horizon = Duration::from_millis(800);
    let (a, _e) = Transport::bind(cfg).expect("bind");
    let nowhere = free_port();
    a.send(nowhere, &store_frame("lost"), true);
    a.send(nowhere, &store_frame("lost too"), true);
    assert_eq!(a.queued(nowhere), 2);
    let t = Instant::now();
    while a.undelivered() < 2 && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!((a.undelivered(), a.queued(nowhere)), (2, 0), "given up on at the horizon");
    assert!(t.elapsed() >= Duration::from_millis(700), "not before the horizon: {:?}", t.elapsed());
    let elsewhere = free_port();
    a.send(elsewhere, &store_frame("forgotten"), true);
    a.forget(elsewhere);
    assert_eq!((a.undelivered(), a.queued(elsewhere)), (3, 0));
    a.shutdown().await;
}

/// Frames for a peer that refuses this node (another token) can never be delivered:
/// they are counted at once, not retried until the horizon.
#[tokio::test]
async fn frames_for_a_peer_that_refuses_us_are_counted_at_once() {
    let (a, _a_events) = loopback(1, Some("t"), 7);
    let (b, mut b_events) = loopback(2, Some("another token"), 7);
    a.send(b.local_addr(), &store_frame("never"), true);
    let t = Instant::now();
    while a.undelivered() < 1 && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!((a.undelivered(), a.queued(b.local_addr())), (1, 0));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}: long before the 30 s horizon", t.elapsed());
    assert_eq!(next_store(&mut b_events, Duration::from_millis(200)).await, None);
    a.shutdown().await;
    b.shutdown().await;
}

/// Another run with the same token: the refusal names what separates runs.
#[tokio::test]
async fn another_run_says_to_give_each_job_its_own_run_id() {
    let (a, mut a_events) = loopback(1, Some("t"), 7);
    let (b, _e) = loopback(2, Some("t"), 8);
    let err = b.open_data(a.local_addr(), 1).await.expect_err("refused").to_string();
    assert!(err.contains("127.0.0.1 belongs to another job"), "{err}");
    assert!(err.contains("give each job its own --run-id"), "{err}");
    let here = auth_failed(&mut a_events).await;
    assert!(here.starts_with("it belongs to another job"), "{here}");
    assert!(!here.contains("command or peers"), "{here}");
    a.shutdown().await;
    b.shutdown().await;
}

/// `check_hello` is pure (config and hello in, refusal out): every refusal it can give,
/// with its close code.
#[test]
fn hellos_are_checked_without_a_connection() {
    let mut cfg = TransportConfig::new(NodeId::from_u128(1), 0);
    cfg.run_hash = 7;
    let ok = AuthHello {
        version: PROTOCOL_VERSION,
        node: NodeId::from_u128(2),
        run_hash: 7,
        mac: [0; 32],
        has_token: false,
        observed: None,
        lane: 0,
        pake: None,
    };
    assert!(check_hello(&cfg, &ok).is_ok());
    let code_in = |cfg: &TransportConfig, h: AuthHello| check_hello(cfg, &h).err().map(|(c, _)| c);
    let code = |h: AuthHello| code_in(&cfg, h);
    assert_eq!(code(AuthHello { version: PROTOCOL_VERSION - 1, ..ok.clone() }), Some(code::VERSION));
    assert_eq!(code(AuthHello { has_token: true, ..ok.clone() }), Some(code::AUTH), "a token we do not have");
    assert_eq!(code(AuthHello { run_hash: 8, ..ok.clone() }), Some(code::OTHER_RUN));
    assert_eq!(code(AuthHello { run_hash: 0, ..ok.clone() }), None, "a probe joins no run");
    assert_eq!(code(AuthHello { node: NodeId::from_u128(1), ..ok.clone() }), Some(code::PROTOCOL), "itself");
    assert_eq!(code(AuthHello { lane: MAX_LANES as u8, ..ok.clone() }), Some(code::PROTOCOL));
    assert_eq!(
        code(AuthHello { lane: 1, run_hash: 0, ..ok.clone() }),
        Some(code::PROTOCOL),
        "a probe has no lane"
    );
    let mut with_token = cfg.clone();
    with_token.token = Some(Token::new("t"));
    assert_eq!(code_in(&with_token, ok.clone()), Some(code::AUTH), "no token where one is needed");
    assert_eq!(
        code_in(&with_token, AuthHello { has_token: true, ..ok }),
        Some(code::PROTOCOL),
        "a token hello without its key exchange"
    );
}

/// Issue 33: a ring operation's credit starts at one window; the next node's grant raises
/// it across the plane, a lower grant (stale, reordered) changes nothing, a grant for
/// another operation touches no other, and dropping the registration unregisters it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_credit_travels_on_the_plane_and_only_rises() {
    let (a, _ea) = loopback(0xc1, None, 7);
    let (b, _eb) = loopback(0xc2, None, 7);
    // The main connection, then a data stream: the data connection and its plane links.
    connect(&a.inner, b.local_addr(), 0).await.expect("main");
    let _s = a.open_data(b.local_addr(), 1).await.expect("data connection");
    let (pa, pb) = (a.plane().expect("plane a").clone(), b.plane().expect("plane b").clone());
    assert!(pa.wait_ready(b.local_addr(), Duration::from_secs(10)).await, "a's plane to b");
    assert!(pb.wait_ready(a.local_addr(), Duration::from_secs(10)).await, "b's plane to a");

    let credit = pa.ring_credit(b.local_addr(), 42);
    let other = pa.ring_credit(b.local_addr(), 43);
    let mut granted = credit.granted();
    assert_eq!(*granted.borrow(), plane::RING_WINDOW);
    pb.grant_ring(a.local_addr(), 42, 3 * plane::RING_WINDOW).expect("grant");
    tokio::time::timeout(Duration::from_secs(5), granted.changed())
        .await
        .expect("the grant arrives")
        .expect("registered");
    assert_eq!(*granted.borrow(), 3 * plane::RING_WINDOW);
    assert_eq!(*other.granted().borrow(), plane::RING_WINDOW, "another operation's credit moved");
    // A stale grant, then a higher one: only the higher one counts.
    pb.grant_ring(a.local_addr(), 42, 2 * plane::RING_WINDOW).expect("grant");
    pb.grant_ring(a.local_addr(), 42, 4 * plane::RING_WINDOW).expect("grant");
    tokio::time::timeout(Duration::from_secs(5), async {
        while *granted.borrow() != 4 * plane::RING_WINDOW {
            assert!(*granted.borrow() >= 3 * plane::RING_WINDOW, "a credit went down");
            granted.changed().await.expect("registered");
        }
    })
    .await
    .expect("the higher grant arrives");
    drop(credit);
    assert!(granted.changed().await.is_err(), "dropping the credit unregisters it");
}
