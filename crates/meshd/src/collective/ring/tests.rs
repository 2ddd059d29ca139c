use super::error::CollectiveError;
use super::progress::{Watch, watched};
use super::stash::{STASH_PER_PEER, Stash};
use meshd_proto::NodeId;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[test]
fn a_watch_measures_silence_not_the_whole_operation() {
    let t0 = Instant::now();
    let s = |n| t0 + Duration::from_secs(n);
    let mut w = Watch::new(Duration::from_secs(60), 0, t0);
    assert_eq!(w.every(), Duration::from_secs(15));
    assert!(!w.stalled(0, s(59)));
    // A byte at 59 s: the clock starts again.
    assert!(!w.stalled(1, s(59)));
    assert!(!w.stalled(1, s(118)));
    assert!(w.stalled(1, s(119)), "60 s without a byte");
    // Hours of steady progress never stall.
    let mut w = Watch::new(Duration::from_secs(60), 0, t0);
    for i in 1..1000 {
        assert!(!w.stalled(i, s(i * 15)));
    }
}

#[tokio::test]
async fn watched_ends_a_silent_wait_and_lets_a_moving_one_finish() {
    let count = std::sync::atomic::AtomicU64::new(0);
    let t = Instant::now();
    let silent = watched(std::future::pending::<()>(), || 0, Duration::from_millis(200)).await;
    assert!(silent.is_none());
    assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_millis(600));
    // Slower than the timeout in all, but never silent for it.
    let moving = async {
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        7
    };
    let got =
        watched(moving, || count.load(std::sync::atomic::Ordering::Relaxed), Duration::from_millis(200));
    assert_eq!(got.await, Some(7));
}

#[test]
fn a_stall_names_the_node_the_direction_and_the_operation() {
    let peer: SocketAddr = "198.19.0.7:29400".parse().expect("addr");
    let node = NodeId::from_u128(0x0a1b_2c3d_4e5f << 80);
    let e = CollectiveError::Stalled {
        peer,
        node: Some(node),
        op: 5,
        timeout: Duration::from_secs(60),
        sending: false,
    };
    assert_eq!(
        e.to_string(),
        format!(
            "no data from node {node} (198.19.0.7:29400) for 60s in collective operation #5: its link is up, but its collective stalled"
        )
    );
    let e = CollectiveError::Stalled {
        peer,
        node: None,
        op: (2 << 40) | 9,
        timeout: Duration::from_secs(1),
        sending: true,
    };
    assert_eq!(
        e.to_string(),
        "node 198.19.0.7:29400 took no data for 1s in collective operation #9 (restart round 2): its link is up, but its collective stalled"
    );
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[test]
fn stash_gives_each_stream_back_once_by_peer_and_operation() {
    let mut s = Stash::default();
    assert!(s.put(addr(1), 7, "a").is_none());
    assert!(s.put(addr(2), 7, "b").is_none());
    assert!(s.put(addr(1), 7, "c").is_none());
    assert_eq!(s.take(addr(1), 8), None);
    assert_eq!(s.take(addr(2), 7), Some("b"));
    assert_eq!(s.take(addr(2), 7), None);
    assert_eq!(s.take(addr(1), 7), Some("a"));
    assert_eq!(s.take(addr(1), 7), Some("c"));
    assert_eq!(s.take(addr(1), 7), None);
}

#[test]
fn stash_drops_a_peers_oldest_streams_beyond_its_share() {
    let mut s = Stash::default();
    // Streams of operations 0.. from one peer that no operation here asks for, and one
    // from another peer that must survive them.
    assert!(s.put(addr(2), 1000, 1000u64).is_none());
    let mut dropped = Vec::new();
    for op in 0..(STASH_PER_PEER as u64 + 5) {
        if let Some((old, t)) = s.put(addr(1), op, op) {
            assert_eq!(old, t);
            dropped.push(old);
        }
    }
    assert_eq!(dropped, vec![0, 1, 2, 3, 4], "the oldest go first");
    assert_eq!(s.take(addr(1), 4), None);
    assert_eq!(s.take(addr(1), 5), Some(5));
    assert_eq!(s.take(addr(1), STASH_PER_PEER as u64 + 4), Some(STASH_PER_PEER as u64 + 4));
    assert_eq!(s.take(addr(2), 1000), Some(1000));
}
