//! Hostile input: what reaches meshd's one UDP port (garbage, replayed and truncated
//! packets, half-open handshakes, oversized hellos and frames, replayed authentication)
//! and its local socket (another user). Each case shows that memory stays bounded, the
//! rightful job still runs, and a refusal is logged once, with its reason, never with the
//! token. Figures are printed with `FIGURE` (`cargo test --test lab_hostile -- --nocapture`).
//!
//! Network safety: attackers run in threads that joined a lab namespace (or on loopback);
//! floods are bounded in rate and time.

mod hostile;
mod lab;

use hostile::*;
use lab::{Lab, meshd, serial};
use meshd::transport::auth::Token;
use meshd::transport::{Transport, TransportConfig, TransportEvent};
use meshd_proto::NodeId;
use meshd_proto::wire::{self, Frame, StoreMsg};
use std::alloc::{GlobalAlloc, Layout, System};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// ---- allocation accounting for the in-process cases -------------------------------------

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static BIGGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        BIGGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: same layout contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: p came from System.alloc with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Resets the peak and biggest-allocation marks; returns the live bytes now.
fn mark() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    BIGGEST.store(0, Ordering::Relaxed);
    live
}

// ---- in-process log capture ---------------------------------------------------------------

static LOGS: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;
impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        LOGS.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_writer(|| LogWriter)
            .with_ansi(false)
            .with_env_filter("info")
            .try_init();
    });
}

fn logs() -> String {
    String::from_utf8_lossy(&LOGS.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
}

// ---- in-process transport cases (loopback, no root needed) --------------------------------

const TOKEN: &str = "hostile-token-Zq81xLm";
const RUN: u64 = 0x5eed_0f4a_1100;

fn node(n: u128) -> NodeId {
    NodeId::from_u128(0xfeed_0000 + n)
}

async fn transport(n: u128) -> (Transport, tokio::sync::mpsc::Receiver<TransportEvent>) {
    let mut cfg = TransportConfig::new(node(n), 0);
    cfg.bind = "127.0.0.1".parse().expect("ip");
    cfg.token = Some(Token::new(TOKEN));
    cfg.run_hash = RUN;
    Transport::bind(cfg).expect("bind")
}

/// Waits for a Store frame with `key` on `events`.
async fn got_store(events: &mut tokio::sync::mpsc::Receiver<TransportEvent>, key: &str) -> bool {
    let wait = async {
        while let Some(ev) = events.recv().await {
            if let TransportEvent::Frame { frame: Frame::Store(StoreMsg::Set { key: k, .. }), .. } = ev {
                if k == key {
                    return true;
                }
            }
        }
        false
    };
    tokio::time::timeout(Duration::from_secs(10), wait).await.unwrap_or(false)
}

fn store(key: &str) -> Frame {
    let version = meshd_proto::store::Version { counter: 1, writer: node(1) };
    Frame::Store(StoreMsg::Set { restart: 0, key: key.into(), value: b"v".to_vec(), version })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// Case 2 (application level): the authentication is bound to its connection's TLS
/// exporter and to fresh SPAKE2 messages, so the exact bytes that authenticated one
/// connection are refused on another.
#[test]
fn auth_hello_replayed_on_another_connection_is_refused() {
    let _g = serial();
    capture_logs();
    let log0 = logs().len();
    runtime().block_on(async {
        let (victim, _ev) = transport(1).await;
        let to = victim.local_addr();
        let ep = client_endpoint();
        let token = Token::new(TOKEN);
        let a = ep.connect(to, "meshd").expect("connect").await.expect("handshake a");
        let answer = authenticate(&a, hello(&token, node(50), RUN)).await;
        assert!(answer.is_ok(), "the honest hello must authenticate: {answer:?}");
        let (_, first, confirm) = answer.expect("recorded");
        // The same bytes on a second connection (another TLS session).
        let b = ep.connect(to, "meshd").expect("connect").await.expect("handshake b");
        let replay = exchange(&b, &first, |_| confirm.clone()).await;
        let reason = close_reason(&b, Duration::from_secs(5)).await;
        eprintln!("FIGURE replayed-hello: answer {replay:?}, closed with {reason:?}");
        assert!(replay.is_err(), "a replayed hello must not be answered");
        assert_eq!(reason, Some((1, "different token".to_string())), "refused as authentication failure");
        // The first connection is unaffected, and a fresh honest one still works.
        assert!(a.close_reason().is_none(), "the original connection stays up");
        let c = ep.connect(to, "meshd").expect("connect").await.expect("handshake c");
        assert!(authenticate(&c, hello(&token, node(51), RUN)).await.is_ok());
        // A wrong token from 50 new source ports: refused each time, logged once.
        let wrong = Token::new("wrong-token-Kd02");
        let mut refused = 0;
        for i in 0..50 {
            let ep2 = client_endpoint();
            let d = ep2.connect(to, "meshd").expect("connect").await.expect("handshake");
            let _ = authenticate(&d, hello(&wrong, node(100 + i), RUN)).await;
            if close_reason(&d, Duration::from_secs(5)).await == Some((1, "different token".into())) {
                refused += 1;
            }
            ep2.close(0u32.into(), b"");
        }
        let l = logs()[log0..].to_string();
        let lines = l.lines().filter(|x| x.contains("different token")).count();
        eprintln!(
            "FIGURE wrong-token-from-new-ports: {refused} of 50 refused; log lines about \"different token\" \
             (replay + 50 wrong-token connections): {lines}"
        );
        assert_eq!(refused, 50);
        assert_eq!(lines, 1, "one line per peer and reason, not per connection:\n{l}");
        assert!(!l.contains(TOKEN) && !l.contains("wrong-token-Kd02"), "token in the logs:\n{l}");
        ep.close(0u32.into(), b"");
    });
}

/// Case 5: an oversized hello (> 1 KiB) and, from an authenticated peer, a frame whose
/// length exceeds the 4 MiB bound: the connection is closed with a clear reason, logged
/// once, nothing near the claimed size is allocated, and the node keeps working.
#[test]
fn oversized_hello_and_frame_close_the_connection_with_a_reason() {
    let _g = serial();
    capture_logs();
    runtime().block_on(async {
        let (victim, mut events) = transport(2).await;
        let (honest, _hev) = transport(3).await;
        let to = victim.local_addr();
        let ep = client_endpoint();
        let token = Token::new(TOKEN);

        // A 2 KiB hello.
        let c = ep.connect(to, "meshd").expect("connect").await.expect("handshake");
        let r = send_hello(&c, &vec![7u8; 2048]).await;
        let why = close_reason(&c, Duration::from_secs(5)).await;
        eprintln!("FIGURE oversized-hello: answer {r:?}, closed with {why:?}");
        assert_eq!(why, Some((4, "hello larger than 1024 bytes".to_string())));

        // Authenticated, then a 5 MiB length prefix followed by 1 MiB of its body, 20 times.
        let live0 = mark();
        let mut closes = Vec::new();
        for _ in 0..20 {
            let c = ep.connect(to, "meshd").expect("connect").await.expect("handshake");
            authenticate(&c, hello(&token, node(60), RUN)).await.expect("auth");
            let mut s = c.open_uni().await.expect("uni");
            let mut body = (5u32 << 20).to_be_bytes().to_vec();
            body.extend(std::iter::repeat_n(0xAB, 1 << 20));
            let _ = s.write_all(&body).await;
            closes.push(close_reason(&c, Duration::from_secs(5)).await);
        }
        let (peak, biggest) = (PEAK.load(Ordering::Relaxed) - live0, BIGGEST.load(Ordering::Relaxed));
        eprintln!(
            "FIGURE oversized-frame: 20 connections each claimed 5 MiB and sent 1 MiB; closed with {:?}; \
             process peak live heap +{} KiB, biggest single allocation {} KiB (client side included)",
            closes[0],
            peak >> 10,
            biggest >> 10
        );
        for c in &closes {
            assert_eq!(
                *c,
                Some((
                    4,
                    "broke the framing: frame of 5242880 bytes exceeds the 4194304-byte limit".to_string()
                ))
            );
        }
        assert!(biggest < (4 << 20), "an allocation of {biggest} bytes: the claimed length was trusted");
        assert!(peak < (256 << 20), "peak heap grew by {peak} bytes");

        // The node keeps working: an honest peer's frame arrives.
        honest.send(to, &store("after-attack"), true);
        assert!(got_store(&mut events, "after-attack").await, "the victim stopped receiving frames");
        let l = logs();
        let lines = l.lines().filter(|x| x.contains("broke the framing")).count();
        let hello_lines = l.lines().filter(|x| x.contains("hello larger than 1024 bytes")).count();
        eprintln!(
            "FIGURE oversized-frame: {lines} log line(s) for 20 refusals; oversized hello: {hello_lines}"
        );
        assert_eq!(lines, 1, "logged once per peer:\n{l}");
        assert_eq!(hello_lines, 1, "{l}");
        assert!(!l.contains(TOKEN), "token in the logs");
        ep.close(0u32.into(), b"");
    });
}

/// Lanes (extra connections for bulk data): a lane number over the limit and a probe that
/// claims a lane are refused with the reason; an authenticated lane is answered with its
/// number and does not count as the peer's connection (no PeerUp, not in `connected`).
#[test]
fn lane_hellos_out_of_bounds_are_refused() {
    let _g = serial();
    runtime().block_on(async {
        let (victim, _events) = transport(4).await;
        let to = victim.local_addr();
        let ep = client_endpoint();
        let token = Token::new(TOKEN);
        let lane_hello = |lane: u8, run: u64| {
            let mut h = hello(&token, node(70), run);
            h.hello.lane = lane;
            h
        };

        let c = ep.connect(to, "meshd").expect("connect").await.expect("handshake");
        let _ = authenticate(&c, lane_hello(wire::MAX_LANES as u8, RUN)).await;
        let why = close_reason(&c, Duration::from_secs(5)).await;
        assert_eq!(why, Some((4, "lane 16 is not allowed (a probe has none; at most 16)".to_string())));

        let c = ep.connect(to, "meshd").expect("connect").await.expect("handshake");
        let _ = authenticate(&c, lane_hello(1, 0)).await;
        let why = close_reason(&c, Duration::from_secs(5)).await;
        assert_eq!(why, Some((4, "lane 1 is not allowed (a probe has none; at most 16)".to_string())));

        // Issue 29: a lane alone (no main connection of that node from that address) is
        // refused: a lane raises no PeerUp, so a second "node 70" must not slip in.
        let c = ep.connect(to, "meshd").expect("connect").await.expect("handshake");
        let _ = authenticate(&c, lane_hello(2, RUN)).await;
        let why = close_reason(&c, Duration::from_secs(5)).await;
        assert!(
            why.as_ref().is_some_and(|(code, w)| *code == 4 && w.contains("without a live main connection")),
            "{why:?}"
        );
        // Beside the node's main connection, from the same address, it is taken.
        let main = ep.connect(to, "meshd").expect("connect").await.expect("handshake");
        authenticate(&main, lane_hello(0, RUN)).await.expect("main connection accepted");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c = ep.connect(to, "meshd").expect("connect").await.expect("handshake");
        let (answer, _, _) = authenticate(&c, lane_hello(2, RUN)).await.expect("lane accepted");
        assert_eq!(answer.lane, 2, "the answer names the lane");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            victim.connected().len(),
            1,
            "only the main connection is a peer: {:?}",
            victim.connected()
        );
        assert!(c.close_reason().is_none(), "the lane stays open");
        ep.close(0u32.into(), b"");
    });
}

// ---- lab cases ------------------------------------------------------------------------------

const LAB_TOKEN: &str = "lab-hostile-token-P7v3Qw";
const PY: &str = "/usr/bin/python3";
/// Victim (host 0, 198.19.0.30) and attacker (host 3, 198.19.0.44).
const VICTIM: &str = "198.19.0.30:29400";

fn job_script(iters: u32) -> String {
    format!(
        "import sys, time, array\nsys.path.insert(0, '{}/python')\nimport meshd\nc = meshd.connect()\n\
         t = time.time()\nfor i in range({iters}):\n    a = array.array('f', [1.0]) * 262144\n    \
         c.allreduce(a)\n    assert a[0] == c.world_size and a[-1] == c.world_size, a[0]\nc.barrier()\n\
         print(f'HOSTILE-JOB-OK rank={{c.rank}} allreduce_secs={{time.time() - t:.2f}}')\n",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// `meshd run` of the 3-node job: hosts 0, 1 and 2 (host 3 is the attacker's).
fn job_run(lab: &Lab) -> lab::MeshdRun {
    let peers = lab.hosts[..3].iter().map(|h| h.eth1.clone()).collect::<Vec<_>>().join(",");
    lab.meshd_run().nnodes("3").peers(&peers)
}

/// Starts host `i`'s meshd of the 3-node job (hosts 0, 1, 2) running `script`.
fn spawn_job_node(lab: &mut Lab, i: usize, script: &str) -> usize {
    let args =
        job_run(lab).flags(&["--nproc-per-node", "1", "--rdzv-timeout", "90s"]).cmd(&[PY, "-c", script]);
    lab.spawn(i, &args, &[("MESHD_TOKEN", LAB_TOKEN)])
}

/// Starts the 3-node job on hosts 0, 1, 2 (in that order, `gap` apart).
fn start_job(lab: &mut Lab, script: &str, gap: Duration) -> Vec<usize> {
    (0..3)
        .map(|i| {
            if i > 0 {
                std::thread::sleep(gap);
            }
            spawn_job_node(lab, i, script)
        })
        .collect()
}

/// Samples the victim's memory until it exits: (VmRSS at start, max VmRSS, last VmHWM), KiB.
fn sample_rss(ns: String) -> std::thread::JoinHandle<(u64, u64, u64)> {
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        let pid = loop {
            if let Some(p) = meshd_pid(&ns) {
                break p;
            }
            assert!(Instant::now() < deadline, "no meshd in {ns}");
            std::thread::sleep(Duration::from_millis(10));
        };
        std::thread::sleep(Duration::from_millis(300));
        let first = rss_kib(pid).0;
        let (mut max_rss, mut hwm) = (first, 0);
        loop {
            let (r, h) = rss_kib(pid);
            if r == 0 && h == 0 {
                break;
            }
            max_rss = max_rss.max(r);
            hwm = hwm.max(h);
            std::thread::sleep(Duration::from_millis(50));
        }
        (first, max_rss, hwm)
    })
}

struct JobResult {
    secs: f64,
    rss: (u64, u64, u64),
    victim_err: String,
}

fn finish_job(
    lab: &mut Lab,
    ks: Vec<usize>,
    t: Instant,
    rss: std::thread::JoinHandle<(u64, u64, u64)>,
) -> JobResult {
    let mut all_out = String::new();
    let mut victim_err = String::new();
    let res: Vec<_> = ks.into_iter().map(|k| lab.wait(k, Duration::from_secs(100))).collect();
    let everything: String =
        res.iter().enumerate().map(|(i, (c, o, e))| format!("---- host {i}: {c:?}\n{o}{e}")).collect();
    for (i, (code, out, err)) in res.into_iter().enumerate() {
        assert_eq!(code, Some(0), "host {i} job failed:\n{everything}");
        assert!(out.contains("HOSTILE-JOB-OK"), "host {i}:\n{out}\n{err}");
        assert!(!err.contains("panicked"), "host {i} panicked:\n{err}");
        if i == 0 {
            victim_err = err.clone();
        }
        all_out.push_str(&out);
        all_out.push_str(&err);
    }
    let secs = t.elapsed().as_secs_f64();
    let rss = rss.join().expect("sampler");
    assert!(!all_out.contains(LAB_TOKEN), "the token appears in a log:\n{all_out}");
    JobResult { secs, rss, victim_err }
}

/// The victim's side of an attack on a forming job: host 0's node, started alone.
struct Victim {
    /// The job's script (`job_script(30)`), for the other hosts' nodes.
    script: String,
    /// When the victim started.
    t: Instant,
    /// The victim's memory, sampled until it exits ([`sample_rss`]).
    rss: std::thread::JoinHandle<(u64, u64, u64)>,
    /// The victim's child.
    k0: usize,
    /// Where it listens ([`VICTIM`]).
    addr: SocketAddr,
}

/// Starts the victim (host 0's node of the 3-node job) alone, sampling its memory, and
/// gives it 500 ms, so it is listening when the attack starts.
fn start_victim(lab: &mut Lab) -> Victim {
    let script = job_script(30);
    let t = Instant::now();
    let rss = sample_rss(lab.hosts[0].ns.clone());
    let k0 = spawn_job_node(lab, 0, &script);
    std::thread::sleep(Duration::from_millis(500));
    let addr: SocketAddr = VICTIM.parse().expect("addr");
    Victim { script, t, rss, k0, addr }
}

fn lines_about(log: &str, what: &str) -> Vec<String> {
    log.lines().filter(|l| l.contains(what)).map(String::from).collect()
}

/// Case 3: 20k random datagrams/s for 5 s at the victim's port while the 3-node job runs.
#[test]
fn garbage_flood_at_the_port_does_not_stop_the_job() {
    lab_or_skip!();
    let _g = serial();
    let mut lab = Lab::new(4);
    let script = job_script(30);

    let t = Instant::now();
    let rss = sample_rss(lab.hosts[0].ns.clone());
    let ks = start_job(&mut lab, &script, Duration::ZERO);
    let base = finish_job(&mut lab, ks, t, rss);

    let t = Instant::now();
    let victim: SocketAddr = VICTIM.parse().expect("addr");
    let flooder = in_netns(&lab.hosts[3].ns, move || flood(victim, 20_000, Duration::from_secs(5), 7));
    let rss = sample_rss(lab.hosts[0].ns.clone());
    let ks = start_job(&mut lab, &script, Duration::ZERO);
    let sent = flooder.join().expect("flooder");
    let hit = finish_job(&mut lab, ks, t, rss);

    let about = lines_about(&hit.victim_err, "198.19.0.44");
    eprintln!(
        "FIGURE flood: {sent} random datagrams in 5 s from 198.19.0.44 to {VICTIM}; job {:.1} s without, {:.1} s with; \
         victim meshd VmRSS start {} KiB, max {} KiB, VmHWM {} KiB (without flood: max {} KiB, VmHWM {} KiB); \
         victim log lines about the attacker: {}",
        base.secs,
        hit.secs,
        hit.rss.0,
        hit.rss.1,
        hit.rss.2,
        base.rss.1,
        base.rss.2,
        about.len()
    );
    assert!(sent > 50_000, "the flood must really happen ({sent} sent)");
    assert!(hit.rss.2 < base.rss.2 + 128 * 1024, "victim memory grew: {:?} vs {:?}", hit.rss, base.rss);
    assert!(about.len() <= 1, "garbage must not be logged per packet:\n{about:?}");
    assert!(hit.secs < base.secs + 60.0, "job under flood took {:.1} s", hit.secs);
}

/// Case 4: 2,000 real QUIC Initials that never finish plus 100 clients that complete TLS
/// and never authenticate, from one host, while the job forms.
#[test]
fn half_open_handshakes_are_bounded_and_the_job_still_forms() {
    lab_or_skip!();
    let _g = serial();
    let mut lab = Lab::new(4);
    let Victim { script, t, rss, k0, addr: victim } = start_victim(&mut lab);
    let attacker = in_netns(&lab.hosts[3].ns, move || {
        rt().block_on(async move {
            let ep = client_endpoint();
            // 100 clients that finish TLS but never send the hello: how long until the
            // victim closes each?
            let mut tasks = Vec::new();
            for _ in 0..100 {
                let ep = ep.clone();
                tasks.push(tokio::spawn(async move {
                    let t = Instant::now();
                    match ep.connect(victim, "meshd").expect("connect").await {
                        Ok(c) => {
                            let why = close_reason(&c, Duration::from_secs(20)).await;
                            (true, t.elapsed(), format!("{why:?}"))
                        }
                        Err(e) => (false, t.elapsed(), e.to_string()),
                    }
                }));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            // 2,000 Initials of real handshakes (captured towards a black hole here).
            let initials = capture_initials(2000).await;
            let s = tokio::net::UdpSocket::bind("0.0.0.0:0").await.expect("bind");
            let t = Instant::now();
            for (i, d) in initials.iter().enumerate() {
                let _ = s.send_to(d, victim).await;
                if i % 100 == 99 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            let sent_in = t.elapsed();
            let mut results = Vec::new();
            for t in tasks {
                results.push(t.await.expect("client"));
            }
            ep.close(0u32.into(), b"");
            (initials.len(), sent_in, results)
        })
    });
    std::thread::sleep(Duration::from_millis(700));
    let mut ks = vec![k0];
    for i in 1..3 {
        ks.push(spawn_job_node(&mut lab, i, &script));
    }
    let (n_initials, sent_in, results) = attacker.join().expect("attacker");
    let hit = finish_job(&mut lab, ks, t, rss);

    let tls_ok: Vec<_> = results.iter().filter(|r| r.0).collect();
    let refused = results.iter().filter(|r| !r.0).count();
    let max_close = tls_ok.iter().map(|r| r.1).max().unwrap_or_default();
    let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
    for r in &results {
        *kinds.entry(r.2.clone()).or_default() += 1;
    }
    let about = lines_about(&hit.victim_err, "198.19.0.44");
    eprintln!(
        "FIGURE half-open: {n_initials} Initials sent in {sent_in:?} + 100 TLS-only clients from 198.19.0.44; \
         {} finished TLS (closed by the victim after at most {max_close:?}), {refused} refused; outcomes {kinds:?}; \
         job {:.1} s; victim VmRSS start {} KiB, max {} KiB, VmHWM {} KiB; victim log lines about the attacker: {about:?}",
        tls_ok.len(),
        hit.secs,
        hit.rss.0,
        hit.rss.1,
        hit.rss.2
    );
    assert!(n_initials >= 1900, "only {n_initials} Initials captured");
    for r in &tls_ok {
        assert!(r.1 < Duration::from_secs(15), "an unauthenticated connection lived {:?}: {}", r.1, r.2);
    }
    assert!(tls_ok.len() <= meshd::transport::guard::MAX_PENDING_PER_IP, "per-IP bound not applied");
    assert!(about.len() <= 3, "refusals must be logged once:\n{about:?}");
    assert!(hit.rss.2 < 256 * 1024, "victim VmHWM {} KiB", hit.rss.2);
}

/// What unauthenticated clients may add to the victim's RSS (KiB): 64 connections'
/// pre-authentication state (each a 4 KiB receive window, one stream, a drained datagram
/// buffer, QUIC and TLS state) plus allocator slack.
const PRE_AUTH_RSS_BOUND_KIB: u64 = 8 * 1024;

/// Issue 16.1, memory before authentication: from the attacker host, as many connections
/// as the per-IP cap admits (80 tried), each finishing TLS and never authenticating,
/// opening every stream it may, pushing stream data (up to 64 MiB each, 256 MiB/s in all)
/// and full-size datagrams (200/s each), and holding until the victim drops it. The
/// victim's RSS stays within [`PRE_AUTH_RSS_BOUND_KIB`] of idle; then the 3-node job forms
/// on the same nodes.
#[test]
fn unauthenticated_clients_cannot_make_meshd_buffer_their_data() {
    lab_or_skip!();
    let _g = serial();
    let mut lab = Lab::new(4);
    let script = job_script(10);
    let t = Instant::now();
    let k0 = spawn_job_node(&mut lab, 0, &script);
    let ns = lab.hosts[0].ns.clone();
    let pid = loop {
        if let Some(p) = meshd_pid(&ns) {
            break p;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no meshd in {ns}");
        std::thread::sleep(Duration::from_millis(10));
    };
    std::thread::sleep(Duration::from_millis(1500));
    let idle = idle_rss(pid, 10);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = max_rss_until(pid, stop.clone());
    let victim: SocketAddr = VICTIM.parse().expect("addr");
    let attacker = in_netns(&lab.hosts[3].ns, move || {
        rt().block_on(push_unauthenticated(victim, 80, Duration::from_secs(5), 64 << 20, 256 << 20, 200))
    });
    let st = attacker.join().expect("attacker");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let max = sampler.join().expect("sampler");
    let after = rss_kib(pid).0;
    // The same nodes still form the job.
    let rss = sample_rss(ns.clone());
    let mut ks = vec![k0];
    for i in 1..3 {
        ks.push(spawn_job_node(&mut lab, i, &script));
    }
    let job = finish_job(&mut lab, ks, t, rss);
    eprintln!(
        "FIGURE pre-auth-memory: {} connections tried from 198.19.0.44, {} finished TLS, held up to {:?}; \
         streams opened: {} bidi, {} uni; stream bytes taken by the attacker's QUIC {} KiB, UDP bytes sent {} KiB, \
         datagrams {}; victim VmRSS idle {idle} KiB, max during the attack {max} KiB (+{} KiB, bound +{} KiB), \
         after {after} KiB; then the job formed and completed ({:.1} s from the first node's start)",
        st.tried,
        st.tls_ok,
        st.held_max,
        st.bidi,
        st.uni,
        st.stream_bytes >> 10,
        st.udp_bytes >> 10,
        st.datagrams,
        max.saturating_sub(idle),
        PRE_AUTH_RSS_BOUND_KIB,
        job.secs
    );
    assert!(st.tls_ok >= 60, "the attack must really happen: {st:?}");
    assert!(st.tls_ok <= meshd::transport::guard::MAX_PENDING_PER_IP, "per-IP bound not applied: {st:?}");
    assert!(st.datagrams > 10_000, "the datagrams must really be sent: {st:?}");
    assert!(
        max <= idle + PRE_AUTH_RSS_BOUND_KIB,
        "unauthenticated clients grew the victim's RSS by {} KiB (idle {idle} KiB, max {max} KiB): {st:?}",
        max - idle
    );
}

/// Issue 16.2, handshake slots: host 3 sends real QUIC Initials (captured, distinct
/// connection ids) from 127 addresses whose replies it drops (198.19.0.128/25 on its eth1,
/// nft drops everything to them: spoofed sources), 3,000 a second to each of the three job
/// hosts: without source validation each victim's 1,024 handshake slots (held 3 s each, so
/// freed at about 340 a second) are taken again as soon as they free up.
/// Meanwhile the 3-node job forms, host 2's meshd is killed, and a new meshd started there
/// with the same command joins; the job completes restart round 1 on every node.
#[test]
fn spoofed_initials_do_not_lock_out_joins_or_a_replacement() {
    lab_or_skip!();
    let _g = serial();
    let mut lab = Lab::new(4);
    let attacker_ns = lab.hosts[3].ns.clone();
    for a in 128..255 {
        let o = std::process::Command::new("ip")
            .args(["-n", &attacker_ns, "addr", "add", &format!("198.19.0.{a}/24"), "dev", "eth1"])
            .output()
            .expect("ip addr add");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    lab.nft(
        3,
        "table inet mdspoof {\n chain input {\n type filter hook input priority -20; policy accept;\n \
         ip daddr 198.19.0.128/25 drop\n }\n}\n",
    );
    let victims: Vec<SocketAddr> =
        lab.hosts[..3].iter().map(|h| format!("{}:29400", h.eth1).parse().expect("addr")).collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let flooding = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooding2 = flooding.clone();
    let flooder = in_netns(&attacker_ns, move || {
        let initials = rt().block_on(capture_initials(12_000));
        flooding2.store(true, Ordering::Relaxed);
        let socks: Vec<std::net::UdpSocket> = (128..255)
            .map(|a| std::net::UdpSocket::bind(format!("198.19.0.{a}:0")).expect("bind spoofed source"))
            .collect();
        let (rate, t) = (9000.0, Instant::now());
        let mut sent = 0usize;
        // Bounded: 9,000 Initials a second (3,000 per victim), at most 60 s.
        while !stop2.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(60) {
            let due = (t.elapsed().as_secs_f64() * rate) as usize;
            while sent < due {
                let d = &initials[(sent / 3) % initials.len()];
                let _ = socks[sent % socks.len()].send_to(d, victims[sent % 3]);
                sent += 1;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        (initials.len(), sent, t.elapsed())
    });
    // Let the flood fill the slots first.
    let t = Instant::now();
    while !flooding.load(Ordering::Relaxed) {
        assert!(t.elapsed() < Duration::from_secs(60), "no Initials captured");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(4));
    let dir = format!("/tmp/meshd-retry-{}", std::process::id());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("marker dir");
    let script = format!(
        "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then touch {dir}/formed.$RANK; sleep 60; fi; \
         echo REPLACED count=$TORCHELASTIC_RESTART_COUNT"
    );
    let args = job_run(&lab)
        .flags(&["--max-restarts", "1", "--grace", "1s", "--rdzv-timeout", "40s"])
        .cmd(&["sh", "-c", &script]);
    let env = [("MESHD_TOKEN", LAB_TOKEN)];
    let t = Instant::now();
    let ks: Vec<usize> = (0..3).map(|i| lab.spawn(i, &args, &env)).collect();
    let formed = loop {
        let n = (0..3).filter(|r| std::path::Path::new(&format!("{dir}/formed.{r}")).exists()).count();
        if n == 3 {
            break Some(t.elapsed());
        }
        if t.elapsed() > Duration::from_secs(45) || ks.iter().any(|k| lab.exited(*k)) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut replaced = None;
    let mut outs = Vec::new();
    if formed.is_some() {
        lab.crash(2);
        std::thread::sleep(Duration::from_secs(1));
        let t2 = Instant::now();
        let fresh = lab.spawn(2, &args, &env);
        for k in ks.into_iter().take(2).chain([fresh]) {
            outs.push(lab.wait(k, Duration::from_secs(60)));
        }
        replaced = Some(t2.elapsed());
    } else {
        for k in ks {
            outs.push(lab.wait(k, Duration::from_secs(1)));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (captured, sent, dur) = flooder.join().expect("flooder");
    let _ = std::fs::remove_dir_all(&dir);
    let ok = outs.iter().filter(|(c, o, _)| *c == Some(0) && o.contains("REPLACED count=1")).count();
    let full: usize = outs.iter().map(|(_, _, e)| lines_about(e, "handshakes in progress").len()).sum();
    eprintln!(
        "FIGURE spoofed-initials: {sent} Initials ({captured} distinct) in {dur:.1?} from 127 spoofed addresses to \
         the 3 job hosts; job formed under the flood after {formed:?}; host 2 killed, the new meshd started \
         there joined and all ended restart round 1 {replaced:?} after its start; nodes done with round 1: {ok}/3; \
         \"handshakes in progress\" refusal lines logged: {full}"
    );
    let everything: String =
        outs.iter().enumerate().map(|(i, (c, o, e))| format!("---- node {i}: {c:?}\n{o}{e}")).collect();
    assert!(sent as f64 > 9000.0 * dur.as_secs_f64() * 0.9, "the flood must really happen ({sent} sent)");
    assert!(formed.is_some(), "the job did not form under the flood:\n{everything}");
    assert_eq!(ok, 3, "the replacement did not join:\n{everything}");
    // Without Retry (before this change): formed after 1.2 s, the replacement's round took
    // 20.8 s, and every victim logged full handshake slots for each spoofed address.
    assert!(formed < Some(Duration::from_secs(5)), "forming took {formed:?}");
    assert!(replaced < Some(Duration::from_secs(10)), "the replacement took {replaced:?}");
    assert_eq!(full, 0, "spoofed sources filled the handshake slots:\n{everything}");
    assert!(!everything.contains(LAB_TOKEN), "the token appears in a log");
}

/// Case 2 (network): a real authenticated session (`meshd status` through a UDP relay in
/// the attacker's namespace) is recorded, then replayed to the victim as-is, from another
/// port, and truncated, while the job forms and runs.
#[test]
fn recorded_session_replayed_and_truncated_is_ignored() {
    lab_or_skip!();
    let _g = serial();
    let mut lab = Lab::new(4);
    let Victim { script, t, rss, k0, addr: victim } = start_victim(&mut lab);
    // The relay: 198.19.0.44:29400 <-> victim, recording what the client sends.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let relay = in_netns(&lab.hosts[3].ns, move || {
        use std::net::UdpSocket;
        let front = UdpSocket::bind("198.19.0.44:29400").expect("bind relay");
        let back = UdpSocket::bind("198.19.0.44:0").expect("bind upstream");
        front.set_read_timeout(Some(Duration::from_millis(5))).expect("timeout");
        back.set_read_timeout(Some(Duration::from_millis(5))).expect("timeout");
        let mut client: Option<SocketAddr> = None;
        let mut recorded: Vec<Vec<u8>> = Vec::new();
        let mut answers = 0usize;
        let mut buf = vec![0u8; 65536];
        while !stop2.load(Ordering::Relaxed) {
            if let Ok((n, from)) = front.recv_from(&mut buf) {
                client = Some(from);
                recorded.push(buf[..n].to_vec());
                let _ = back.send_to(&buf[..n], victim);
            }
            if let Ok((n, _)) = back.recv_from(&mut buf) {
                answers += 1;
                if let Some(c) = client {
                    let _ = front.send_to(&buf[..n], c);
                }
            }
        }
        // Replay: the same 4-tuple, then another port, then truncated copies.
        let other = UdpSocket::bind("198.19.0.44:0").expect("bind");
        let mut sent = 0usize;
        for round in 0..3 {
            for d in &recorded {
                let s = if round == 1 { &other } else { &back };
                let _ = s.send_to(d, victim);
                sent += 1;
                for cut in [1usize, 5, 20, d.len() / 2, d.len().saturating_sub(1)] {
                    if cut > 0 && cut < d.len() {
                        let _ = s.send_to(&d[..cut], victim);
                        sent += 1;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        (recorded.len(), answers, sent)
    });
    // The real session through the relay.
    let st = lab.spawn(
        3,
        &[meshd(), "status", "--peers", "198.19.0.44:29400", "--json"],
        &[("MESHD_TOKEN", LAB_TOKEN)],
    );
    let (sc, sout, serr) = lab.wait(st, Duration::from_secs(20));
    stop.store(true, Ordering::Relaxed);
    let mut ks = vec![k0];
    for i in 1..3 {
        ks.push(spawn_job_node(&mut lab, i, &script));
    }
    let (recorded, answers, replayed) = relay.join().expect("relay");
    let hit = finish_job(&mut lab, ks, t, rss);
    let about = lines_about(&hit.victim_err, "198.19.0.44");
    eprintln!(
        "FIGURE replay: status through the relay exit {sc:?}; recorded {recorded} client datagrams ({answers} answers); \
         replayed {replayed} datagrams (as-is, other port, truncated); job {:.1} s; victim VmRSS start {} KiB, \
         max {} KiB, VmHWM {} KiB; victim log lines about the attacker: {about:?}",
        hit.secs, hit.rss.0, hit.rss.1, hit.rss.2
    );
    assert_eq!(sc, Some(0), "the recorded session must be real:\n{sout}\n{serr}");
    assert!(recorded >= 3, "too few datagrams recorded");
    assert!(about.len() <= 1, "replays must not be logged per packet:\n{about:?}");
    assert!(!serr.contains(LAB_TOKEN) && !sout.contains(LAB_TOKEN));
    assert!(hit.rss.2 < 256 * 1024, "victim VmHWM {} KiB", hit.rss.2);
}

/// Case 6: the local service socket refuses another user (EACCES); file and directory are
/// owner-only.
#[test]
fn local_socket_refuses_another_user() {
    lab_or_skip!();
    let _g = serial();
    let mut lab = Lab::new(1);
    let script = format!(
        "d=$(dirname \"$MESHD_SOCKET\"); stat -c 'SOCK %a %U' \"$MESHD_SOCKET\"; stat -c 'DIR %a %U' \"$d\"; \
         setpriv --reuid=65534 --regid=65534 --clear-groups {PY} -c '\
import os, socket\n\
s = socket.socket(socket.AF_UNIX)\n\
try:\n    s.connect(os.environ[\"MESHD_SOCKET\"]); print(\"NOBODY CONNECTED\")\n\
except OSError as e:\n    print(\"NOBODY errno\", e.errno, e.strerror)'; \
         {PY} -c 'import sys; sys.path.insert(0, \"{}/python\"); import meshd; c = meshd.connect(); c.barrier(); print(\"OWNER OK\")'",
        env!("CARGO_MANIFEST_DIR")
    );
    let k = lab.spawn(
        0,
        &[meshd(), "run", "--nnodes", "1", "--peers", "198.19.0.30", "--", "sh", "-c", &script],
        &[("MESHD_TOKEN", LAB_TOKEN)],
    );
    let (code, out, err) = lab.wait(k, Duration::from_secs(30));
    eprintln!("FIGURE local-socket: {}", out.lines().map(|l| l.trim()).collect::<Vec<_>>().join(" | "));
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("NOBODY errno 13"), "another user must get EACCES:\n{out}\n{err}");
    assert!(out.contains("SOCK 600 root"), "socket must be owner-only:\n{out}");
    assert!(out.contains("DIR 700 root"), "socket directory must be owner-only:\n{out}");
    assert!(out.contains("OWNER OK"), "the job's own processes still connect:\n{out}\n{err}");
}
