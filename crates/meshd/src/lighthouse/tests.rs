//! The address rewrite, and the gRPC edge with a local decider through an h2 client on
//! loopback (the real torchft client is in tests/lighthouse_torchft.rs).

use super::proto::{
    LighthouseHeartbeatRequest, LighthouseQuorumRequest, LighthouseQuorumResponse, QuorumMember,
};
use super::*;
use bytes::Bytes;
use prost::Message;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[test]
fn rewrite_host_cases() {
    let v4 = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7));
    let v6 = IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1));
    assert_eq!(rewrite_host("http://host:1234", v4), "http://10.0.0.7:1234");
    assert_eq!(rewrite_host("http://host:1234", v6), "http://[fd00::1]:1234");
    assert_eq!(rewrite_host("http://[::1]:5", v4), "http://10.0.0.7:5");
    assert_eq!(rewrite_host("http://[::1]:5", v6), "http://[fd00::1]:5");
    assert_eq!(rewrite_host("http://[::1]", v4), "http://10.0.0.7");
    assert_eq!(rewrite_host("http://host", v4), "http://10.0.0.7");
    assert_eq!(rewrite_host("http://host:80/a/b?c", v4), "http://10.0.0.7:80/a/b?c");
    assert_eq!(rewrite_host("https://u@host:1", v4), "https://u@10.0.0.7:1");
    for garbage in [
        "",
        "host:1234",
        "://x",
        "http://",
        "http://:1",
        "http://h:",
        "http://h:x1",
        "http://[::1",
        "http://::1:5",
        "a b://h",
    ] {
        assert_eq!(rewrite_host(garbage, v4), garbage, "{garbage:?}");
    }
}

fn cfg(min_replicas: u64) -> LighthouseConfig {
    LighthouseConfig {
        min_replicas,
        join_timeout: Duration::from_millis(200),
        quorum_tick: Duration::from_millis(10),
        ..LighthouseConfig::default()
    }
}

async fn start(min_replicas: u64) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let calls = LocalDecider::spawn(cfg(min_replicas));
    (addr, tokio::spawn(serve(listener, calls)))
}

/// One unary call: (grpc-status, grpc-message, the response message's bytes).
async fn call(
    addr: SocketAddr,
    path: &str,
    body: Vec<u8>,
    timeout: Option<&str>,
) -> (String, String, Vec<u8>) {
    let sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut client, conn) = h2::client::handshake(sock).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = timeout {
        req = req.header("grpc-timeout", t);
    }
    let (resp, mut send) = client.send_request(req.body(()).expect("request"), false).expect("send");
    send.send_data(Bytes::from(body), true).expect("body");
    let resp = resp.await.expect("response");
    let headers = resp.headers().clone();
    let mut body = resp.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("data");
        let _ = body.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await.expect("trailers").unwrap_or_default();
    let get = |k: &str| {
        trailers.get(k).or(headers.get(k)).map(|v| v.to_str().unwrap_or("?").to_string()).unwrap_or_default()
    };
    let msg = if data.len() >= 5 { data[5..].to_vec() } else { Vec::new() };
    (get("grpc-status"), get("grpc-message"), msg)
}

fn framed(msg: &[u8]) -> Vec<u8> {
    let mut v = vec![0];
    v.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    v.extend_from_slice(msg);
    v
}

fn quorum_request(id: &str) -> Vec<u8> {
    let m = QuorumMember {
        replica_id: id.into(),
        address: format!("http://{id}:1"),
        step: 3,
        ..Default::default()
    };
    framed(&LighthouseQuorumRequest { requester: Some(m) }.encode_to_vec())
}

#[tokio::test]
async fn quorum_heartbeat_and_errors_over_h2() {
    let (addr, server) = start(2).await;
    let hb = framed(&LighthouseHeartbeatRequest { replica_id: "a".into() }.encode_to_vec());
    let (status, _, _) = call(addr, "/torchft.LighthouseService/Heartbeat", hb, Some("5S")).await;
    assert_eq!(status, "0");

    // Two requesters: the same quorum for both.
    let q = "/torchft.LighthouseService/Quorum";
    let (a, b) = tokio::join!(
        call(addr, q, quorum_request("a"), Some("10S")),
        call(addr, q, quorum_request("b"), Some("10S"))
    );
    assert_eq!((a.0.as_str(), b.0.as_str()), ("0", "0"), "{a:?} {b:?}");
    let qa = LighthouseQuorumResponse::decode(&a.2[..]).expect("decode").quorum.expect("quorum");
    let qb = LighthouseQuorumResponse::decode(&b.2[..]).expect("decode").quorum.expect("quorum");
    assert_eq!(qa, qb);
    assert_eq!(qa.participants.iter().map(|p| p.replica_id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    assert!(qa.created.is_some());

    // Alone with min_replicas 2 and a previous quorum of two: waits, then the deadline.
    let t = std::time::Instant::now();
    let (status, message, _) = call(addr, q, quorum_request("c"), Some("300m")).await;
    assert_eq!(status, "4", "{message}");
    assert!(t.elapsed() < Duration::from_secs(3));

    let (status, _, _) = call(addr, "/torchft.LighthouseService/Nope", framed(&[]), None).await;
    assert_eq!(status, "12");
    let (status, _, _) = call(addr, q, framed(&[0xff, 0xff, 0xff]), None).await;
    assert_eq!(status, "3");
    let mut compressed = quorum_request("a");
    compressed[0] = 1;
    let (status, _, _) = call(addr, q, compressed, None).await;
    assert_eq!(status, "12");
    let (status, _, _) = call(addr, q, vec![0, 0xff, 0, 0, 0], None).await;
    assert_eq!(status, "8");
    let (status, _, _) = call(addr, q, vec![0, 0], None).await;
    assert_eq!(status, "3");

    // Garbage, HTTP/1.1 and a truncated preface are closed; the server lives on.
    for junk in [&b"\x00\x01garbage\xff"[..], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n"] {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(junk).await.expect("write");
        if junk.starts_with(b"PRI") {
            drop(s); // half a preface, then gone
            continue;
        }
        let mut buf = [0u8; 256];
        let r = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(r.is_ok(), "junk connection {junk:?} not closed");
    }
    let hb = framed(&LighthouseHeartbeatRequest { replica_id: "a".into() }.encode_to_vec());
    let (status, _, _) = call(addr, "/torchft.LighthouseService/Heartbeat", hb, Some("5S")).await;
    assert_eq!(status, "0");
    server.abort();
}

/// A client that vanishes mid long-poll: its request is forgotten, not answered later
/// with a quorum that would hold a dead replica.
#[tokio::test]
async fn vanished_long_poll_is_forgotten() {
    let (tx, mut rx) = mpsc::channel(8);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(serve(listener, tx));
    let q = "/torchft.LighthouseService/Quorum";
    let client = tokio::spawn(call(addr, q, quorum_request("a"), Some("60S")));
    let Some(LighthouseCall::Quorum { member, mut reply }) = rx.recv().await else { panic!("no call") };
    assert_eq!(member.replica_id, "a");
    assert!(!reply.is_closed());
    client.abort(); // the connection closes
    tokio::time::timeout(Duration::from_secs(5), reply.closed())
        .await
        .expect("the edge dropped its receiver");
    server.abort();
}

/// The owner's inputs through the channel: an observed id raises the next one, a gone
/// replica no longer holds the quorum back.
#[tokio::test]
async fn owner_calls_reach_the_core() {
    let calls = LocalDecider::spawn(LighthouseConfig { join_timeout: Duration::from_secs(3600), ..cfg(1) });
    calls.send(LighthouseCall::ObserveQuorumId((41 << 10) | 3)).await.expect("send");
    calls.send(LighthouseCall::Heartbeat { replica_id: "b".into() }).await.expect("send");
    let (reply, mut rx) = oneshot::channel();
    let member = Member { replica_id: "a".into(), ..Member::default() };
    calls.send(LighthouseCall::Quorum { member, reply }).await.expect("send");
    // 1 of 2 healthy: no quorum until b is gone.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(rx.try_recv().is_err());
    calls.send(LighthouseCall::ReplicaGone { replica_id: "b".into() }).await.expect("send");
    let answer = tokio::time::timeout(Duration::from_secs(5), rx).await.expect("in time").expect("answer");
    assert_eq!(answer.quorum.quorum_id, 42 << 10);
    assert_eq!(answer.quorum.participants.len(), 1);
}
