//! `meshd lighthouse` against the real torchft 0.2.0 (its Rust extension's LighthouseClient,
//! ManagerServer and ManagerClient) from the torch-2 venv, and beside torchft's own
//! `torchft_lighthouse`. Loopback only. Without `MESHD_TORCH2_PYTHON` the tests say loudly
//! that they skip (a failure with `MESHD_REQUIRE_TORCH2=1`), as the other torch-2 suites.
//! The Python side is tests/python/lighthouse_client.py.

mod torches;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;
use torches::Torch;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/lighthouse_client.py");

/// A lighthouse process, killed on drop.
struct Lighthouse {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    addr: String,
    /// `127.0.0.1:PORT`.
    sock: String,
}

impl Drop for Lighthouse {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Lighthouse {
    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// Reads `r`'s lines on a thread (so the pipe never fills) until one holds `needle`: the
/// text after it.
fn line_after(r: impl Read + Send + 'static, needle: &'static str) -> String {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if sent {
                continue;
            }
            if let Some(i) = line.find(needle) {
                let _ = tx.send(line[i + needle.len()..].trim().to_string());
                sent = true;
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("no line with {needle:?} within 60 s"))
}

fn meshd_lighthouse(min_replicas: u64, join_timeout_ms: u64) -> Lighthouse {
    start_lighthouse(&[
        "--min-replicas",
        &min_replicas.to_string(),
        "--join_timeout_ms",
        &join_timeout_ms.to_string(),
    ])
}

/// `meshd lighthouse --bind 127.0.0.1:0 FLAGS`, once it has printed its address.
fn start_lighthouse(flags: &[&str]) -> Lighthouse {
    let mut child = Command::new(env!("CARGO_BIN_EXE_meshd"))
        .args(["lighthouse", "--bind", "127.0.0.1:0"])
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start meshd lighthouse");
    let out = child.stdout.take().expect("stdout");
    let addr = line_after(out, "listening on ");
    let sock = addr.trim_start_matches("http://").to_string();
    Lighthouse { child, addr, sock }
}

/// torchft's own lighthouse (the venv's `torchft_lighthouse`), on a free loopback port.
fn torchft_lighthouse(t: &Torch, min_replicas: u64, join_timeout_ms: u64) -> Lighthouse {
    let bin = std::path::Path::new(&t.python).with_file_name("torchft_lighthouse");
    let mut child = Command::new(&bin)
        .args(["--bind", "127.0.0.1:0", "--min_replicas", &min_replicas.to_string()])
        .args(["--join_timeout_ms", &join_timeout_ms.to_string()])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    let err = child.stderr.take().expect("stderr");
    // "Lighthouse listening on: http://{hostname}:{port}"
    let url = line_after(err, "Lighthouse listening on: ");
    let port = url.rsplit(':').next().expect("port").to_string();
    let sock = format!("127.0.0.1:{port}");
    Lighthouse { child, addr: format!("http://{sock}"), sock }
}

/// Runs the Python helper: its last stdout line as JSON.
fn client(t: &Torch, args: &[&str]) -> Value {
    let out = Command::new(&t.python)
        .args(["-u", SCRIPT])
        .args(args)
        .envs(t.env())
        .stdin(Stdio::null())
        .output()
        .expect("run the python client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "client {args:?} failed: {}\n{stdout}\n{stderr}", out.status);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("client {args:?}: {e}: {stdout}\n{stderr}"))
}

fn torch() -> Option<Torch> {
    Torch::current(true)
}

fn ids(q: &Value) -> Vec<String> {
    q["participants"]
        .as_array()
        .unwrap_or_else(|| panic!("no participants: {q}"))
        .iter()
        .map(|p| p["replica_id"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn heartbeat_and_quorum_of_one() {
    let Some(t) = torch() else { return };
    let lh = meshd_lighthouse(1, 100);
    let out = client(&t, &["single", &lh.addr]);
    let q = &out["solo"];
    assert!(q.get("error").is_none(), "{out}");
    assert!(q["quorum_id"].as_i64().unwrap_or(0) > 0, "{q}");
    assert_eq!(ids(q), ["solo"]);
    let m = &q["participants"][0];
    assert_eq!(m["address"], "http://solo.example:1007");
    assert_eq!(m["store_address"], "solo.example:2007");
    assert_eq!(m["step"], 7);
    assert_eq!(m["world_size"], 2);
    assert_eq!(m["shrink_only"], false);
    assert!(q["created"][0].as_i64().unwrap_or(0) > 1_700_000_000, "created is set: {q}");
}

/// Two clients at once get the same quorum; torchft's own lighthouse gives the same
/// participants in the same shape.
#[test]
fn two_clients_same_quorum_as_torchft_lighthouse() {
    let Some(t) = torch() else { return };
    let ours = meshd_lighthouse(2, 100);
    let theirs = torchft_lighthouse(&t, 2, 100);
    let a = client(&t, &["pair", &ours.addr]);
    let b = client(&t, &["pair", &theirs.addr]);
    for out in [&a, &b] {
        assert!(out["a"].get("error").is_none() && out["b"].get("error").is_none(), "{out}");
        assert_eq!(out["a"]["quorum_id"], out["b"]["quorum_id"], "{out}");
        assert_eq!(out["a"]["participants"], out["b"]["participants"], "{out}");
        assert_eq!(out["a"]["created"], out["b"]["created"], "one quorum, one time: {out}");
        assert_eq!(ids(&out["a"]), ["rep_a", "rep_b"]);
    }
    assert_eq!(a["a"]["participants"], b["a"]["participants"], "meshd {a}\ntorchft {b}");
    // torchft counts 1, 2, ...; meshd's ids carry the decider's tag (0 here) in 10 low bits.
    assert_eq!(b["a"]["quorum_id"], 1);
    assert_eq!(a["a"]["quorum_id"], 1 << 10);
}

/// A long-poll nobody joins ends on the client's timeout; the lighthouse lives on. The
/// abandoned request's replica stays a participant while it is healthy, so the next pair
/// gets a quorum of it and one of them, and the other times out: exactly what torchft's
/// own lighthouse does, checked side by side.
#[test]
fn unmet_quorum_times_out_on_the_client_and_the_server_lives_on() {
    let Some(t) = torch() else { return };
    let run = |mut lh: Lighthouse| {
        let t = t.clone();
        std::thread::spawn(move || {
            let both = client(&t, &["abandon", &lh.addr]);
            let out = &both["timeout"];
            let err = out["error"].as_str().unwrap_or_else(|| panic!("no error: {out}")).to_string();
            assert!(err.contains("Timeout") || err.contains("DeadlineExceeded"), "{out}");
            let took = out["elapsed_s"].as_f64().unwrap_or(0.0);
            assert!((1.4..10.0).contains(&took), "timed out after {took} s: {out}");
            let pair = both["pair"].clone();
            assert!(lh.alive());
            let answered: Vec<Vec<String>> = ["a", "b"]
                .iter()
                .filter(|k| pair[**k].get("error").is_none())
                .map(|k| ids(&pair[*k]))
                .collect();
            (answered, pair)
        })
    };
    let ours = run(meshd_lighthouse(2, 100)).join().expect("meshd side");
    let theirs = run(torchft_lighthouse(&t, 2, 100)).join().expect("torchft side");
    for (answered, pair) in [&ours, &theirs] {
        assert_eq!(answered.len(), 1, "{pair}");
        assert_eq!(answered[0].len(), 2, "{pair}");
        assert_eq!(answered[0][0], "lonely", "{pair}");
    }
}

/// torchft's ManagerServer (the Rust manager every replica group's rank 0 runs) on meshd's
/// lighthouse: two groups, one quorum, the group behind heals from the one ahead.
#[test]
fn torchft_managers_form_a_quorum() {
    let Some(t) = torch() else { return };
    let lh = meshd_lighthouse(2, 100);
    let out = client(&t, &["managers", &lh.addr]);
    let (g0, g1) = (&out["g0"], &out["g1"]);
    assert!(g0.get("error").is_none() && g1.get("error").is_none(), "{out}");
    assert_eq!(g0["quorum_id"], g1["quorum_id"], "{out}");
    assert_eq!(g0["replica_ids"], serde_json::json!(["g0", "g1"]));
    assert_eq!((g0["replica_rank"].as_i64(), g1["replica_rank"].as_i64()), (Some(0), Some(1)), "{out}");
    assert_eq!(g0["replica_world_size"], 2);
    assert_eq!(g0["max_step"], 12);
    assert_eq!((g0["heal"].as_bool(), g1["heal"].as_bool()), (Some(true), Some(false)), "{out}");
    assert_eq!(g0["store_address"], "127.0.0.1:29601", "the store of the group ahead");
    assert!(g0["recover_src_manager_address"].as_str().unwrap_or_default().starts_with("http://127.0.0.1:"));
}

/// Garbage, an HTTP/1.1 request, a truncated HTTP/2 preface and a half-sent frame: each
/// connection is closed and the lighthouse still answers torchft afterwards.
#[test]
fn hostile_connections_do_not_kill_the_lighthouse() {
    let Some(t) = torch() else { return };
    let mut lh = meshd_lighthouse(1, 100);
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let mut half_frame = preface.to_vec();
    half_frame.extend_from_slice(&[0, 0, 12, 4, 0, 0, 0, 0, 0, 0, 3]); // SETTINGS, 12 bytes announced, 2 sent
    let junk: [(&str, Vec<u8>, bool); 5] = [
        ("garbage", b"\x00\xff\x13garbage\r\n\r\n\x00\x00\x00".to_vec(), true),
        ("http/1.1", b"GET /torchft.LighthouseService/Quorum HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), true),
        ("random", (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect(), true),
        ("truncated preface", preface[..10].to_vec(), false),
        ("half a frame", half_frame, false),
    ];
    for (what, bytes, wait_close) in junk {
        let mut s = TcpStream::connect(&lh.sock).expect("connect");
        let _ = s.write_all(&bytes);
        if wait_close {
            s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            let mut buf = [0u8; 1024];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                    Err(e) => panic!("{what}: the connection was not closed: {e}"),
                }
            }
        }
        drop(s); // the sender vanishes mid-frame
        assert!(lh.alive(), "after {what}");
    }
    let out = client(&t, &["single", &lh.addr]);
    assert_eq!(ids(&out["solo"]), ["solo"], "{out}");
    assert!(lh.alive());
}

/// No Python needed: torchft's flag spellings and ours, the listen line, a refused bad
/// flag, and a raw connection served.
#[test]
fn cli_takes_both_spellings_and_prints_its_address() {
    let mut lh = start_lighthouse(&[
        "--min_replicas",
        "2",
        "--join-timeout-ms",
        "50",
        "--heartbeat_timeout_ms",
        "1000",
        "--quorum-tick-ms",
        "20",
    ]);
    assert!(lh.addr.starts_with("http://127.0.0.1:"), "{}", lh.addr);
    let mut s = TcpStream::connect(&lh.sock).expect("connect");
    s.write_all(b"not http/2").expect("write");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut buf = [0u8; 64];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
    }
    assert!(lh.alive());
    let bad = Command::new(env!("CARGO_BIN_EXE_meshd"))
        .args(["lighthouse", "--bind", "127.0.0.1:0", "--quorum-tick-ms", "0", "--min-replicas", "1"])
        .output()
        .expect("run");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--quorum-tick-ms"), "{bad:?}");
    let missing = Command::new(env!("CARGO_BIN_EXE_meshd")).args(["lighthouse"]).output().expect("run");
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("--min-replicas"), "{missing:?}");
}
