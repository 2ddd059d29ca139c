//! Lab: the data plane against a member that holds the token and against an off-path
//! spoofer (issue 29, parts 4 and 6). A hostile member sends plane messages it never
//! finishes and messages no operation asks for: the victim holds at most its per-peer
//! budget of them. A spoofer floods two members with plane datagrams that carry the third
//! member's address: the ring keeps running on the plane. Figures are printed with
//! `FIGURE` (`cargo test --test lab_plane_hostile -- --nocapture`).
//!
//! Network safety: the attackers run in threads that joined a lab namespace; floods are
//! bounded in rate and time.

mod hostile;
mod lab;

use hostile::*;
use lab::Lab;
use meshd::transport::auth::Token;
use std::net::{SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const TOKEN: &str = "lab-plane-hostile-K2w9";

/// What the hostile member sent.
#[derive(Debug, Default)]
struct Sent {
    /// Datagrams of messages it never finished, and how many such messages it began.
    unfinished_datagrams: u64,
    unfinished_messages: u64,
    /// Datagrams of whole messages of operations nobody runs, and how many messages.
    unclaimed_datagrams: u64,
    unclaimed_messages: u64,
}

/// Sends `d` from the member's own address and port, waiting while the socket is full.
fn send(m: &Member, d: &[u8], to: SocketAddr) {
    loop {
        match m.raw.send_to(d, to) {
            Ok(_) => return,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_micros(50))
            }
            Err(e) => panic!("send: {e}"),
        }
    }
}

/// The hostile member's attack on `to`, paced at `rate` datagrams a second: for `each`,
/// the fragments of 16 MiB messages but their last one (never finished), then for `each`
/// whole 1 MiB messages of operations nobody runs.
fn attack(m: &Member, to: SocketAddr, rate: u64, each: Duration, need: u64) -> Sent {
    const SIZE: usize = 1472;
    let mut f = Forger::new(&m.conn, 0);
    let mut st = Sent::default();
    let start = Instant::now();
    let mut n = 0u64;
    // Never ahead of `rate`: sleeps once a millisecond's worth is ahead.
    let pace = |n: &mut u64| {
        *n += 1;
        let due = Duration::from_secs_f64(*n as f64 / rate as f64);
        if let Some(wait) = due.checked_sub(start.elapsed()).filter(|w| *w > Duration::from_millis(1)) {
            std::thread::sleep(wait);
        }
    };
    let mut seq = 0u64;
    let payload = vec![0xA5u8; SIZE];
    // Each kind goes on for `each`, and on a slow machine up to half as long again until
    // it has offered `need` datagrams.
    let going = |since: Instant, sent: u64| {
        let t = since.elapsed();
        t < each || (sent < need && t < each + each / 2)
    };
    // Unfinished: 16 MiB messages, every fragment but the last.
    while going(start, st.unfinished_datagrams) {
        let total = 16u64 << 20;
        let frag = f.fragment_len(seq, total, SIZE) as u64;
        let mut off = 0;
        st.unfinished_messages += 1;
        while off + frag < total && going(start, st.unfinished_datagrams) {
            let d = f.data(seq, total, off, &payload[..frag as usize]);
            send(m, &d, to);
            st.unfinished_datagrams += 1;
            off += frag;
            pace(&mut n);
        }
        seq += 1;
    }
    // Unclaimed: whole 1 MiB messages of three operations no node runs.
    let second = Instant::now();
    while going(second, st.unclaimed_datagrams) {
        let total = (1u64 << 20) + 16;
        let frag = f.fragment_len(seq, total, SIZE) as u64;
        let mut off = 0;
        while off < total {
            let len = frag.min(total - off) as usize;
            let mut p = payload[..len].to_vec();
            if off == 0 {
                p[..8].copy_from_slice(&(0xBAD0_0000u64 + seq % 3).to_le_bytes());
                p[8..16].copy_from_slice(&seq.to_le_bytes());
            }
            let d = f.data(seq, total, off, &p);
            send(m, &d, to);
            st.unclaimed_datagrams += 1;
            off += len as u64;
            pace(&mut n);
        }
        st.unclaimed_messages += 1;
        seq += 1;
    }
    st
}

/// The most a hostile member's plane messages may add to a node's RSS (KiB): the plane's
/// per-peer budget of held receive buffers (`transport::plane::PEER_BUDGET`, 64 MiB), the
/// lane's socket queue (16 MiB) and 16 MiB of allocator slack.
const MEMBER_RSS_BOUND_KIB: u64 = (64 + 16 + 16) * 1024;

/// Datagrams each kind of the member's attack offers at least (when the machine lets it
/// within half as long again): a quarter more than the per-peer budget, at about 1.4 KB a
/// datagram.
const NEED: u64 = (64 << 20) * 5 / 4 / 1400;

/// Issue 29.4: a member holding the token connects to host 0 while a 3-node job runs and
/// sends, from its own address and with its real plane keys, 16 MiB plane messages it
/// never finishes (every fragment but the last) for 4 s, then whole 1 MiB messages of
/// operations no node runs for 4 s (each up to 6 s on a machine too busy to offer [`NEED`]
/// datagrams in 4), about 30,000 datagrams a second (44 MB/s). The victim's RSS stays
/// within [`MEMBER_RSS_BOUND_KIB`] of idle (and grows, so the messages did arrive and were
/// held up to the budget); the job then ends normally everywhere.
#[test]
fn a_members_unfinished_and_unclaimed_plane_messages_stay_within_its_budget() {
    lab_or_skip!();
    let mut lab = Lab::new(4);
    let dir = format!("/tmp/meshd-plane-hostile-{}", std::process::id());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("marker dir");
    let script = format!("touch {dir}/formed.$RANK; sleep 20");
    let peers = lab.hosts[..3].iter().map(|h| h.eth1.clone()).collect::<Vec<_>>().join(",");
    let args = lab.meshd_run().nnodes("3").peers(&peers).cmd(&["sh", "-c", &script]);
    let env = [("MESHD_TOKEN", TOKEN), ("MESHD_LANES", "1")];
    let ks: Vec<usize> = (0..3).map(|i| lab.spawn(i, &args, &env)).collect();
    let t = Instant::now();
    while (0..3).any(|r| !std::path::Path::new(&format!("{dir}/formed.{r}")).exists()) {
        assert!(t.elapsed() < Duration::from_secs(30), "the job did not start");
        assert!(!ks.iter().any(|&k| lab.exited(k)), "a node ended before the job started");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = meshd_pid(&lab.hosts[0].ns).expect("victim meshd");
    let idle = idle_rss(pid, 10);
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = max_rss_until(pid, stop.clone());
    let victim: SocketAddr = format!("{}:29400", lab.hosts[0].eth1).parse().expect("addr");
    let attacker = in_netns(&lab.hosts[3].ns, move || {
        rt().block_on(async move {
            let token = Token::new(TOKEN);
            let m = join_as_member(victim, &token, "meshd-default").await.expect("member joins");
            // The victim makes its plane links once the connection is registered.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let m = Arc::new(m);
            let m2 = m.clone();
            let sent = tokio::task::spawn_blocking(move || {
                attack(&m2, victim, 30_000, Duration::from_secs(4), NEED)
            })
            .await
            .expect("attack");
            // Held a moment longer, then gone.
            tokio::time::sleep(Duration::from_millis(500)).await;
            m.conn.close(0u32.into(), b"");
            m.ep.wait_idle().await;
            sent
        })
    });
    let sent = attacker.join().expect("attacker");
    stop.store(true, Ordering::Relaxed);
    let max = sampler.join().expect("sampler");
    let after = rss_kib(pid).0;
    let done: Vec<_> = ks.into_iter().map(|k| lab.wait(k, Duration::from_secs(60))).collect();
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "FIGURE plane-member-memory: {} unfinished 16 MiB messages in {} datagrams, {} unclaimed 1 MiB messages in {} \
         datagrams, from one member to {victim}; victim VmRSS idle {idle} KiB, max during the attack {max} KiB \
         (+{} KiB, bound +{MEMBER_RSS_BOUND_KIB} KiB), after {after} KiB",
        sent.unfinished_messages,
        sent.unfinished_datagrams,
        sent.unclaimed_messages,
        sent.unclaimed_datagrams,
        max.saturating_sub(idle)
    );
    let everything: String =
        done.iter().enumerate().map(|(i, (c, o, e))| format!("---- host {i}: {c:?}\n{o}{e}")).collect();
    // The attack must happen: each kind alone offered more than the per-peer budget (64
    // MiB; about 1.4 KB a datagram), so a victim without one would have held more. (The
    // counts depend on the machine's load: 63,646 and 103,917 in a loaded run.)
    let offered_kib = |datagrams: u64| datagrams * 1400 / 1024;
    assert!(
        offered_kib(sent.unfinished_datagrams) > 64 * 1024
            && offered_kib(sent.unclaimed_datagrams) > 64 * 1024,
        "the attack must offer more than the budget: {sent:?}"
    );
    assert!(
        max <= idle + MEMBER_RSS_BOUND_KIB,
        "a member's plane messages grew the victim's RSS by {} KiB (idle {idle} KiB, max {max} KiB): {sent:?}",
        max - idle
    );
    // The victim did take and hold them (up to its budget): not a victim that ignores the member.
    assert!(
        max >= idle + 8 * 1024,
        "the victim held none of the member's messages: idle {idle} KiB, max {max} KiB"
    );
    for (i, (code, _, err)) in done.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{everything}");
        assert!(!err.contains("panicked"), "host {i} panicked:\n{everything}");
    }
    assert!(!everything.contains(TOKEN), "the token appears in a log");
}

/// Starts the 3 hosts' bench (`meshd bench allreduce --json`, hosts 0 to 2): 16 MiB
/// allreduces, `iters` times.
fn spawn_bench(lab: &mut Lab, iters: &str) -> Vec<usize> {
    let peers = lab.hosts[..3].iter().map(|h| h.eth1.clone()).collect::<Vec<_>>().join(",");
    let args = lab
        .meshd_bench()
        .nnodes("3")
        .peers(&peers)
        .flags(&["--size", "16777216", "--iters", iters])
        .args(&["--json"]);
    let env = [("MESHD_TOKEN", TOKEN)];
    (0..3).map(|i| lab.spawn(i, &args, &env)).collect()
}

/// Waits for the bench `ks`, each host's JSON; panics naming the host that failed.
fn wait_bench(lab: &mut Lab, ks: Vec<usize>, t: Instant, what: &str) -> (Vec<serde_json::Value>, f64) {
    let res: Vec<_> = ks.into_iter().map(|k| lab.wait(k, Duration::from_secs(180))).collect();
    let secs = t.elapsed().as_secs_f64();
    let everything: String =
        res.iter().enumerate().map(|(i, (c, o, e))| format!("---- host {i}: {c:?}\n{o}{e}")).collect();
    let mut out = Vec::new();
    for (i, (code, o, e)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "{what}: host {i} failed after {secs:.1} s:\n{everything}");
        assert!(!e.contains("stopped getting through"), "{what}: host {i} silenced a link:\n{everything}");
        assert!(!e.contains("panicked"), "{what}: host {i} panicked:\n{everything}");
        out.push(serde_json::from_str(o.trim()).expect("one JSON object"));
    }
    (out, secs)
}

/// How long the spoofer floods: longer than the plane's silence rule (`plane::SILENCE`, 5 s).
const FLOOD: Duration = Duration::from_secs(8);

/// Issue 29.6: while the 3 hosts' ring runs on the plane (16 MiB allreduces, about 18 s of them), a
/// fourth host sends plane-looking datagrams (the plane's first byte, lane 0, random bytes
/// behind them, 256 bytes) to hosts 0 and 2, 100,000 a second, every one with host 1's
/// address and port as its source (a socket bound to it with IP_TRANSPARENT, sending
/// trains of 64 with UDP GSO: an off-path spoofer, which never sees what the victims
/// answer, so never a link id). The ring keeps running on the
/// plane on every host: every operation is served by datagrams, none fails, no link is
/// silenced (`plane::SILENCE`); the spoofed datagrams are dropped at the socket, before
/// any copy or AES-GCM. The flood starts once the ring runs and lasts [`FLOOD`].
#[test]
fn a_spoof_flood_with_a_members_address_leaves_the_plane_serving() {
    lab_or_skip!();
    let mut lab = Lab::new(4);
    let spoofed: SocketAddrV4 = format!("{}:29400", lab.hosts[1].eth1).parse().expect("addr");
    let victims: Vec<SocketAddrV4> =
        [0, 2].iter().map(|&i| format!("{}:29400", lab.hosts[i].eth1).parse().expect("addr")).collect();
    // As many allreduces as take about 18 s on this machine now (measured without the
    // flood first): the flood must outlast the silence rule, whatever the machine's load.
    let t = Instant::now();
    let ks = spawn_bench(&mut lab, "5");
    let (calibration, calibration_secs) = wait_bench(&mut lab, ks, t, "without the flood");
    let per_op = calibration.iter().filter_map(|v| v["results"][0]["time_s"].as_f64()).fold(0.0, f64::max);
    // The flood starts once the ring runs (the nodes joined and probed their plane links).
    let startup = Duration::from_secs_f64((calibration_secs - 5.0 * per_op).clamp(1.0, 20.0) + 1.0);
    let iters = ((18.0 / per_op.max(1e-3)) as u64).clamp(10, 600).to_string();
    let t = Instant::now();
    let ks = spawn_bench(&mut lab, &iters);
    std::thread::sleep(startup);
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let flooder = in_netns(&lab.hosts[3].ns, move || {
        let mut rng = Rng::new(29);
        spoof_flood_gso(spoofed, &victims, 256, 100_000, FLOOD, &stop2, |_, d| {
            rng.fill(d);
            d[0] = meshd_proto::plane::packet::FIRST_BYTE;
            d[1] = 0;
        })
    });
    // The kernel's UDP counters of a host: datagrams received, and dropped for a full
    // socket buffer (what a flood faster than the reader would cost everyone's traffic).
    let udp = |lab: &Lab, i: usize| -> (u64, u64) {
        let o = std::process::Command::new("ip")
            .args(["netns", "exec", &lab.hosts[i].ns, "cat", "/proc/net/snmp"])
            .output()
            .expect("snmp");
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        let v: Vec<u64> = text
            .lines()
            .filter(|l| l.starts_with("Udp:"))
            .nth(1)
            .map(|l| l.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect())
            .unwrap_or_default();
        (v.first().copied().unwrap_or(0), v.get(4).copied().unwrap_or(0))
    };
    let waited = std::thread::spawn(move || (wait_bench(&mut lab, ks, t, "under the flood"), lab));
    let ((hit, secs), lab) = match waited.join() {
        Ok(r) => r,
        Err(e) => {
            stop.store(true, Ordering::Relaxed);
            std::panic::resume_unwind(e)
        }
    };
    let kernel: Vec<(u64, u64)> = (0..3).map(|i| udp(&lab, i)).collect();
    stop.store(true, Ordering::Relaxed);
    let (sent, flood_secs) = flooder.join().expect("flooder");
    let counter = |i: usize, k: &str| hit[i]["plane_datagrams"][k].as_u64().unwrap_or(u64::MAX);
    let figures: Vec<String> = (0..3)
        .map(|i| {
            format!(
                "host {i}: busbw {:.3} GB/s, refused {}, unknown {}, overflow {}, kernel received {} and dropped {} \
                 (socket buffer full)",
                hit[i]["results"][0]["busbw_gbs"].as_f64().unwrap_or(0.0),
                counter(i, "refused"),
                counter(i, "unknown_source"),
                counter(i, "overflow"),
                kernel[i].0,
                kernel[i].1
            )
        })
        .collect();
    let rate = sent as f64 / flood_secs;
    eprintln!(
        "FIGURE plane-spoof-flood: {sent} datagrams spoofed from {spoofed} in {flood_secs:.1} s ({rate:.0}/s) to \
         hosts 0 and 2; {iters} allreduces of 16 MiB in {secs:.1} s, the flood from {:.1} s on ({per_op:.3} s each \
         without); {}",
        startup.as_secs_f64(),
        figures.join("; ")
    );
    for (i, v) in hit.iter().enumerate() {
        assert_eq!(v["results"][0]["served"], "data plane: datagrams", "host {i}: {v}");
    }
    for i in [0, 2] {
        // Dropped at the socket by the link-id filter: no copy, no queue slot, no AES-GCM.
        assert!(
            counter(i, "unknown_source") > sent / 4,
            "host {i}: spoofed datagrams passed the socket ({sent} sent)"
        );
        assert!(counter(i, "refused") < 1000, "host {i}: spoofed datagrams reached AES-GCM");
        // The plane's queue drops no more of the member's real datagrams than on the host
        // nobody floods (which drops only when its driver falls behind on this machine).
        assert!(
            counter(i, "overflow") <= 1000 + 2 * counter(1, "overflow"),
            "host {i}: the plane's queue dropped real datagrams behind the flood"
        );
    }
    // Paced at 100k/s; on a machine whose cores the three hosts' ring already fills, the
    // flooder gets somewhat less.
    assert!(rate > 75_000.0, "the flood must really happen at about 100k/s ({rate:.0}/s)");
    // The flood ran its whole time while the ring ran, longer than the silence rule.
    assert!(flood_secs >= FLOOD.as_secs_f64() * 0.95, "the bench ended {flood_secs:.1} s into the flood");
    assert!(secs > startup.as_secs_f64() + flood_secs, "the ring ended before the flood");
}
