//! The ring over the data plane (AEAD datagrams on meshd's one UDP port), 3 nodes in this
//! process on loopback: results exact, the plane (not QUIC streams) serving, a node that
//! sends over QUIC streams beside nodes that send datagrams, and junk datagrams from a
//! stranger changing nothing.

mod hostile;
mod lab;

use meshd::collective::{CollectiveBuffer, RingNet};
use meshd::mesh::MeshConfig;
use meshd::proto::reduce::{DType, ReduceOp};
use meshd::transport::auth::Token;
use std::sync::Arc;
use std::time::Duration;

const PORTS: [u16; 3] = [29811, 29812, 29813];

/// Random bytes with the QUIC fixed bit clear (what the socket hands the plane), sent to
/// every node from an address that is no member, until `stop`.
fn junk(stop: Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut sent = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let mut d = [0u8; 1200];
            for b in d.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            // Half of them look like plane datagrams of lane 0 exactly.
            d[0] = if sent % 2 == 0 { 0x22 } else { d[0] & 0x3F };
            d[1] = 0;
            for p in PORTS {
                let _ = sock.send_to(&d, ("127.0.0.1", p));
            }
            sent += 1;
            std::thread::sleep(Duration::from_micros(200));
        }
        sent
    })
}

async fn node(port: u16) -> Result<(), String> {
    // Three plane lanes on two nodes, one on the third: a sender uses the lanes both
    // ends run (3 between the first two, 1 to and from the third).
    let lanes = if port == PORTS[2] { 1 } else { 3 };
    let mut node = meshd::Node::spawn(meshd::NodeConfig::new(MeshConfig {
        plane_lanes: std::num::NonZeroUsize::new(lanes),
        ..lab::library::mesh(&PORTS, port, "plane-test")
    }))
    .await
    .map_err(|e| e.to_string())?;
    let plane = node.transport().plane().cloned().ok_or("the plane is on by default")?;
    let roster = node.roster().await.map_err(|e| e.to_string())?;
    let rank = roster.node_rank(node.id()).ok_or("in the roster")?;
    let mut ring: RingNet = node.ring().ok_or("the ring")?;
    let next = roster.members[(rank + 1) % roster.members.len()].addr;
    let want_lanes = lanes.min(if next.port() == PORTS[2] { 1 } else { 3 });
    ring.join_timeout = Duration::from_secs(30);
    let work = tokio::spawn(async move {
        let check = move |got: &[u8], want: &dyn Fn(usize) -> i32, what: &str| -> Result<(), String> {
            match got
                .chunks_exact(4)
                .enumerate()
                .find(|(i, c)| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want(*i))
            {
                None => Ok(()),
                Some((i, c)) => Err(format!("node {rank}, {what}: element {i} is {c:?}, want {}", want(i))),
            }
        };
        // Odd length, small chunks: many plane messages, the last one short.
        ring.chunk_bytes = std::num::NonZeroUsize::new(48 << 10).ok_or("not zero")?;
        let len: usize = 250_007;
        let mut a: Vec<u8> =
            (0..len).flat_map(|i| ((i % 1000) as i32 * (rank as i32 + 1)).to_le_bytes()).collect();
        ring.allreduce(1, &mut a, DType::I32, ReduceOp::Sum).await.map_err(|e| e.to_string())?;
        check(&a, &|i| (i % 1000) as i32 * 6, "1 MB sum")?;
        // Chunks of 1 MiB (each many datagrams), on a CollectiveBuffer, three times.
        ring.chunk_bytes = std::num::NonZeroUsize::new(1 << 20).ok_or("not zero")?;
        let mut lent = CollectiveBuffer::from_vec(
            (0..(12usize << 20) / 4).flat_map(|i| ((i % 7) as i32 - rank as i32).to_le_bytes()).collect(),
        );
        for (op, k) in [(2u64, 1i32), (3, 3), (4, 9)] {
            ring.allreduce_buffer(op, &mut lent, DType::I32, ReduceOp::Sum)
                .await
                .map_err(|e| e.to_string())?;
            let got = lent.try_as_mut().ok_or("buffer still lent")?.to_vec();
            // Each round triples every element: 3 nodes hold the same values after round 1.
            let base = |i: usize| 3 * (i % 7) as i32 - 3;
            check(&got, &|i| base(i) * k, &format!("12 MiB sum, round {op}"))?;
        }
        if plane.ready_lanes(next) != want_lanes {
            return Err(format!(
                "node {rank}: {} plane lanes to {next}, want {want_lanes}",
                plane.ready_lanes(next)
            ));
        }
        let served = ring.served();
        if served.streams != 0 || served.datagrams != 4 {
            return Err(format!("node {rank}: {served:?}: the plane should have served all four"));
        }
        // Rank 1 sends over QUIC streams now; its neighbours still send datagrams.
        ring.use_plane = rank != 1;
        let mut m: Vec<u8> =
            (0..300_001usize).flat_map(|i| ((i as i32) ^ (rank as i32 * 77)).to_le_bytes()).collect();
        ring.allreduce(5, &mut m, DType::I32, ReduceOp::Max).await.map_err(|e| e.to_string())?;
        check(&m, &|i| [0, 77, 154].iter().map(|r| (i as i32) ^ r).max().unwrap_or(0), "max, mixed paths")?;
        let served = ring.served();
        let want = if rank == 1 { (4, 1) } else { (5, 0) };
        if (served.datagrams, served.streams) != want {
            return Err(format!("node {rank}: {served:?}, want {want:?}"));
        }
        ring.barrier(6).await.map_err(|e| e.to_string())?;
        // A segment far past what the next node's credit (plane::RING_WINDOW) and a lane's
        // queue hold (64 chunks of 32 KiB): each node's sends wait for credit while it
        // must keep reading and granting, or the ring deadlocks.
        ring.use_plane = true;
        ring.chunk_bytes = std::num::NonZeroUsize::new(32 << 10).ok_or("not zero")?;
        // A debug build on a busy machine may take a while over the buffer before a
        // neighbour's first byte: the operation's own timeout below bounds the wait.
        ring.join_timeout = Duration::from_secs(110);
        // Built and checked on a blocking thread (a debug build is slow over 48 MiB).
        let r = rank as i32;
        let mut huge = tokio::task::spawn_blocking(move || -> Vec<u8> {
            let mut v = Vec::with_capacity(48 << 20);
            for i in 0..(48usize << 20) / 4 {
                v.extend_from_slice(&((i % 5) as i32 * (r + 1)).to_le_bytes());
            }
            v
        })
        .await
        .map_err(|e| e.to_string())?;
        tokio::time::timeout(
            Duration::from_secs(120),
            ring.allreduce(7, &mut huge, DType::I32, ReduceOp::Sum),
        )
        .await
        .map_err(|_| format!("node {rank}: 48 MiB allreduce on the plane hung"))?
        .map_err(|e| e.to_string())?;
        let huge = tokio::task::spawn_blocking(move || {
            check(&huge, &|i| (i % 5) as i32 * 6, "48 MiB sum past the credit")
        });
        huge.await.map_err(|e| e.to_string())??;
        if ring.served().datagrams != if rank == 1 { 5 } else { 6 } {
            return Err(format!("node {rank}: {:?}: the 48 MiB sum went by streams", ring.served()));
        }
        // An average of floats on a CollectiveBuffer: the plane's driver reduces and copies
        // the chunks into the buffer as their datagrams open, and the ring divides the
        // last reduce-scatter step's chunks once.
        ring.chunk_bytes = std::num::NonZeroUsize::new(1 << 20).ok_or("not zero")?;
        let before = plane.counters().applied;
        let mut avg = CollectiveBuffer::from_vec(
            (0..(6usize << 20) / 4 + 3)
                .flat_map(|i| ((i % 9) as f32 * (rank as f32 + 1.0)).to_le_bytes())
                .collect(),
        );
        ring.allreduce_buffer(8, &mut avg, DType::F32, ReduceOp::Avg).await.map_err(|e| e.to_string())?;
        // The result reads at once; the transport may still hold the last chunks it sent
        // (until the next node acknowledges them), and lets go of them soon after.
        if let Some((i, c)) = avg
            .as_slice()
            .chunks_exact(4)
            .enumerate()
            .find(|(i, c)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != (i % 9) as f32 * 2.0)
        {
            return Err(format!("node {rank}, f32 average: element {i} is {c:?}, want {}", (i % 9) * 2));
        }
        let lent = tokio::time::Instant::now();
        while avg.try_as_mut().is_none() {
            if lent.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "node {rank}: {} loans of the buffer held 30 s after the average",
                    avg.loans()
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let applied = plane.counters().applied - before;
        if applied < (6 << 20) / 3 {
            return Err(format!(
                "node {rank}: the plane's driver applied only {applied} bytes of the average as they arrived"
            ));
        }
        Ok::<_, String>(plane.counters())
    });
    // The node's actor answers its peers while the ring runs.
    let counters = work.await.map_err(|e| e.to_string())??;
    node.finish().await.map_err(|e| e.to_string())?;
    if counters.messages == 0 || counters.opened == 0 {
        return Err(format!("node on port {port}: plane counters {counters:?}"));
    }
    if counters.unknown_source == 0 {
        return Err(format!("node on port {port}: the stranger's datagrams were not seen: {counters:?}"));
    }
    // The ring's own traffic never meets the per-peer budget.
    if counters.over_budget != 0 || counters.held_peak > meshd::transport::plane::PEER_BUDGET as u64 / 2 {
        return Err(format!("node on port {port}: the ring met the plane's budget: {counters:?}"));
    }
    Ok(())
}

#[test]
fn ring_over_the_data_plane_is_exact_and_ignores_strangers() {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let junk = junk(stop.clone());
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime");
    let results = rt.block_on(async {
        let tasks: Vec<_> = PORTS.iter().map(|&p| tokio::spawn(node(p))).collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(tokio::time::timeout(Duration::from_secs(120), t).await);
        }
        out
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = junk.join().expect("junk thread");
    assert!(sent > 0);
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => panic!("node {i}: {e}"),
            Ok(Err(e)) => panic!("node {i} panicked: {e}"),
            Err(_) => panic!("node {i} hung"),
        }
    }
}

/// A job of 3 nodes where one turned the plane off (`MESHD_PLANE=0`): every collective of
/// the client's checks comes out right, the node before it and the node itself send over
/// QUIC streams, the third node sends datagrams, and each job says which path served.
#[test]
fn a_node_without_the_plane_gets_quic_streams_and_the_job_runs() {
    use std::process::{Command, Stdio};
    let base = 29821u16;
    let peers: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", base + i)).collect();
    let peers = peers.join(",");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/collectives_check.py");
    let children: Vec<_> = (0..3u16)
        .map(|i| {
            let port = (base + i).to_string();
            Command::new(env!("CARGO_BIN_EXE_meshd"))
                .args(["run", "--nnodes", "3", "--peers", &peers, "--port", &port, "--nproc-per-node", "1"])
                .args(["--rdzv-timeout", "60s", "--", "/usr/bin/python3", script])
                .env("MESHD_TOKEN", "loopback-plane")
                .env("MESHD_PLANE", if i == 2 { "0" } else { "1" })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn meshd")
        })
        .collect();
    let mut said = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().expect("output");
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "node {i} failed:\n{stdout}\n{stderr}");
        assert!(stdout.contains("COLLECTIVES OK"), "node {i}:\n{stdout}\n{stderr}");
        let line = stderr
            .lines()
            .find_map(|l| l.split("ring collectives to the next node: ").nth(1))
            .unwrap_or_else(|| panic!("node {i} does not say which path served:\n{stderr}"))
            .to_string();
        said.push(line);
    }
    assert!(said[2].starts_with("QUIC streams"), "the node without the plane: {said:?}");
    let datagrams = said.iter().filter(|l| l.starts_with("data plane: datagrams")).count();
    let streams = said.iter().filter(|l| l.starts_with("QUIC streams")).count();
    assert_eq!((datagrams, streams), (1, 2), "{said:?}");
}

/// Issue 29.4, in one process: a member holding the token sends, with its real plane keys,
/// 16 MiB messages it never finishes and then whole 1 MiB messages of an operation nobody
/// runs. What the node's plane holds for it never passes the per-peer budget, datagrams
/// past it are refused (unacknowledged), at most `MAX_OPEN_PER_PEER` messages are open,
/// and once the member's connection is gone the plane holds nothing of it.
#[test]
fn a_members_plane_messages_are_held_within_its_budget_and_released_when_it_goes() {
    use meshd::transport::plane::{MAX_OPEN_PER_PEER, PEER_BUDGET};
    use meshd::transport::{Transport, TransportConfig};
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let mut cfg = TransportConfig::new(meshd_proto::NodeId::from_u128(0xfeed_0001), 0);
        cfg.bind = "127.0.0.1".parse().expect("ip");
        cfg.token = Some(Token::new("plane-budget"));
        let (victim, _events) = Transport::bind(cfg).expect("bind");
        let plane = victim.plane().cloned().expect("the plane is on by default");
        let to = victim.local_addr();
        let member =
            hostile::join_as_member(to, &Token::new("plane-budget"), "budget-test").await.expect("joins");
        let from = to_ip(member.raw.local_addr().expect("addr"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let member = Arc::new(member);
        let m = member.clone();
        let max_held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let max_open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (mh, mo, p) = (max_held.clone(), max_open.clone(), plane.clone());
        let sent = tokio::task::spawn_blocking(move || {
            let mut f = hostile::Forger::new(&m.conn, 0);
            let mut sent = 0u64;
            let mut send = |d: Vec<u8>| {
                while let Err(e) = m.raw.send_to(&d, to) {
                    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "send: {e}");
                    std::thread::sleep(Duration::from_micros(50));
                }
                sent += 1;
                // Paced (the node's socket queue is not what this test is about), watched.
                if sent % 64 == 0 {
                    std::thread::sleep(Duration::from_millis(2));
                    let (held, open) = p.held(from);
                    mh.fetch_max(held, std::sync::atomic::Ordering::Relaxed);
                    mo.fetch_max(open, std::sync::atomic::Ordering::Relaxed);
                }
            };
            let payload = vec![0xA5u8; 1472];
            let mut seq = 0;
            // Six 16 MiB messages, every fragment but the last.
            for _ in 0..6 {
                let total = 16u64 << 20;
                let frag = f.fragment_len(seq, total, 1472) as u64;
                let mut off = 0;
                while off + frag < total {
                    send(f.data(seq, total, off, &payload[..frag as usize]));
                    off += frag;
                }
                seq += 1;
            }
            // 80 whole 1 MiB messages of an operation nobody runs.
            for _ in 0..80 {
                let total = (1u64 << 20) + 16;
                let frag = f.fragment_len(seq, total, 1472) as u64;
                let mut off = 0;
                while off < total {
                    let len = frag.min(total - off) as usize;
                    send(f.data(seq, total, off, &payload[..len]));
                    off += len as u64;
                }
                seq += 1;
            }
            sent
        })
        .await
        .expect("member");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (held, open) = plane.held(from);
        let c = plane.counters();
        let max_held = max_held.load(std::sync::atomic::Ordering::Relaxed).max(held);
        let max_open = max_open.load(std::sync::atomic::Ordering::Relaxed).max(open);
        eprintln!(
            "FIGURE plane-budget: {sent} datagrams from a member; held at most {max_held} bytes (budget \
             {PEER_BUDGET}), {max_open} messages open at most; counters {c:?}"
        );
        assert!(c.opened + c.over_budget > sent / 2, "the member's datagrams must arrive: {c:?}");
        assert!(max_held <= PEER_BUDGET && c.held_peak <= PEER_BUDGET as u64, "held {max_held}: {c:?}");
        assert!(
            max_held > PEER_BUDGET / 4,
            "the node held little of what it acknowledged: {max_held}: {c:?}"
        );
        assert!(c.over_budget > 1000, "past the budget, datagrams must be refused: {c:?}");
        assert!(max_open <= MAX_OPEN_PER_PEER);
        // The member goes: its open messages and unclaimed ones are dropped with its links.
        member.conn.close(0u32.into(), b"");
        let t = std::time::Instant::now();
        while plane.held(from) != (0, 0) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "still held after the member left: {:?}",
                plane.held(from)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// The address the node sees a local member at (it connects to 127.0.0.1 from 0.0.0.0).
fn to_ip(from: std::net::SocketAddr) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], from.port()))
}
