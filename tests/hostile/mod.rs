//! Attacker tools for tests/lab_hostile.rs: everything runs inside a lab namespace (a
//! thread that `setns`es into it) or on loopback, and every flood is bounded in rate and
//! time.
#![allow(dead_code)]

use meshd::transport::auth::{Role, Token};
use meshd_proto::NodeId;
use meshd_proto::wire::{self, AuthHello, PROTOCOL_VERSION};
use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs `f` on a new thread that has joined network namespace `ns` (created by the lab);
/// sockets it opens live there, so nothing it sends can leave the lab.
pub fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
        use std::os::fd::AsRawFd;
        // SAFETY: setns on a valid namespace fd; affects only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
}

/// A current-thread tokio runtime (for the attacker thread).
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// Small deterministic PRNG (xorshift64*).
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// Sends random datagrams (20..1400 bytes) to `to` at about `rate` per second for `dur`;
/// returns how many were sent.
pub fn flood(to: SocketAddr, rate: u32, dur: Duration, seed: u64) -> u64 {
    let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
    s.set_nonblocking(true).expect("nonblocking");
    let mut rng = Rng::new(seed);
    let mut buf = [0u8; 1400];
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < dur {
        // Pace: never ahead of rate * elapsed.
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        while sent < due {
            let len = 20 + (rng.next() % 1380) as usize;
            rng.fill(&mut buf[..len]);
            if s.send_to(&buf[..len], to).is_ok() {
                sent += 1;
            } else {
                // Socket buffer full: count it as not sent, try again later.
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
        // Drain whatever the victim answered (version negotiation, resets).
        let mut rb = [0u8; 2048];
        while s.recv_from(&mut rb).is_ok() {}
    }
    sent
}

/// The token's MAC would be checked by the server; the certificate is not.
#[derive(Debug)]
struct AnyCert(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("no TLS 1.2".into()))
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A quinn client configuration speaking meshd's ALPN, trusting any certificate.
pub fn client_endpoint_config() -> quinn::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    tls.alpn_protocols = vec![wire::ALPN.to_vec()];
    let qc = quinn::crypto::rustls::QuicClientConfig::try_from(tls).expect("quic tls");
    let mut cc = quinn::ClientConfig::new(Arc::new(qc));
    let mut tc = quinn::TransportConfig::default();
    tc.max_idle_timeout(Some(Duration::from_secs(20).try_into().expect("idle")));
    cc.transport_config(Arc::new(tc));
    cc
}

/// A quinn client endpoint speaking meshd's ALPN (must run inside a tokio runtime).
pub fn client_endpoint() -> quinn::Endpoint {
    let mut ep = quinn::Endpoint::client("0.0.0.0:0".parse().expect("addr")).expect("client endpoint");
    ep.set_default_client_config(client_endpoint_config());
    ep
}

/// A client's first message: its hello (with a fresh SPAKE2 message) and the exchange's
/// state, to finish once the server answered.
pub struct Attempt {
    /// The hello; a test may change fields before encoding it.
    pub hello: AuthHello,
    pake: Option<meshd::transport::auth::Pake>,
}

/// The hello an honest client with `token` sends first.
pub fn hello(token: &Token, node: NodeId, run_hash: u64) -> Attempt {
    let pake = token.start();
    let hello = AuthHello {
        version: PROTOCOL_VERSION,
        node,
        run_hash,
        mac: [0; 32],
        has_token: true,
        observed: None,
        lane: 0,
        pake: wire::PakeMessage::from_bytes(pake.message()),
    };
    Attempt { hello, pake: Some(pake) }
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut m = (body.len() as u16).to_be_bytes().to_vec();
    m.extend_from_slice(body);
    m
}

async fn read_framed(recv: &mut quinn::RecvStream) -> Result<Vec<u8>, String> {
    let mut len = [0u8; 2];
    recv.read_exact(&mut len).await.map_err(|e| e.to_string())?;
    let mut body = vec![0u8; u16::from_be_bytes(len) as usize];
    recv.read_exact(&mut body).await.map_err(|e| e.to_string())?;
    Ok(body)
}

/// Runs the client side of the authentication on a new connection's first stream: sends
/// `first` (an encoded hello), reads the server's hello, sends `confirm(answer)`, and waits
/// for the verdict (the server ends its stream when it accepts). Returns the server's hello,
/// or why there was none.
pub async fn exchange(
    conn: &quinn::Connection,
    first: &[u8],
    confirm: impl FnOnce(&AuthHello) -> Vec<u8>,
) -> Result<AuthHello, String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all(&framed(first)).await.map_err(|e| e.to_string())?;
    let answer: AuthHello = wire::decode(&read_framed(&mut recv).await?).map_err(|e| e.to_string())?;
    send.write_all(&framed(&confirm(&answer))).await.map_err(|e| e.to_string())?;
    let _ = send.finish();
    recv.read_to_end(0).await.map_err(|e| e.to_string())?;
    Ok(answer)
}

/// A client holding `token` authenticates (as an attacker would: it sends its confirmation
/// whether or not the server's verified, so the server decides). Returns the server's
/// hello, and the exact bytes sent (first message, confirmation) for replays.
pub async fn authenticate(
    conn: &quinn::Connection,
    attempt: Attempt,
) -> Result<(AuthHello, Vec<u8>, Vec<u8>), String> {
    let Attempt { hello, pake } = attempt;
    let first = wire::encode(&hello);
    let mut ex = [0u8; 32];
    conn.export_keying_material(&mut ex, meshd::transport::auth::EXPORTER_LABEL, b"").expect("exporter");
    let mut sent = Vec::new();
    let answer = exchange(conn, &first, |answer| {
        let bytes = |p: &Option<wire::PakeMessage>| p.map(|p| p.to_bytes()).unwrap_or([0; 33]);
        let msgs = (bytes(&hello.pake), bytes(&answer.pake));
        let t = meshd::transport::auth::Transcript {
            exporter: &ex,
            client: &hello.node.0,
            server: &answer.node.0,
            client_run: hello.run_hash,
            server_run: answer.run_hash,
            client_msg: &msgs.0,
            server_msg: &msgs.1,
        };
        let c = match pake.and_then(|p| p.finish(&msgs.1)) {
            Some(k) => k.confirm(Role::Client, &t).to_vec(),
            None => vec![0; 32],
        };
        sent = c.clone();
        c
    })
    .await?;
    Ok((answer, first, sent))
}

/// Sends `bytes` as they are on a new connection's first stream (no framing: for garbage
/// and oversized input) and reads the server's first answer, if any.
pub async fn send_hello(conn: &quinn::Connection, bytes: &[u8]) -> Result<AuthHello, String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all(bytes).await.map_err(|e| e.to_string())?;
    let _ = send.finish();
    wire::decode(&read_framed(&mut recv).await?).map_err(|e| e.to_string())
}

/// Why the server closed `conn`: (application code, reason), waiting up to `limit`.
pub async fn close_reason(conn: &quinn::Connection, limit: Duration) -> Option<(u64, String)> {
    match tokio::time::timeout(limit, conn.closed()).await {
        Ok(quinn::ConnectionError::ApplicationClosed(c)) => {
            Some((c.error_code.into_inner(), String::from_utf8_lossy(&c.reason).into_owned()))
        }
        Ok(other) => Some((u64::MAX, other.to_string())),
        Err(_) => None,
    }
}

/// Collects `n` real QUIC client Initial datagrams (distinct connection ids) by starting
/// `n` handshakes towards a socket of ours that never answers. Must run in a runtime.
pub async fn capture_initials(n: usize) -> Vec<Vec<u8>> {
    let hole = tokio::net::UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let to = hole.local_addr().expect("addr");
    let ep = client_endpoint();
    let mut pending = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    while out.len() < n {
        for _ in 0..64 {
            pending.push(ep.connect(to, "meshd").expect("connect"));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
        while let Ok(Ok((len, _))) = tokio::time::timeout_at(deadline, hole.recv_from(&mut buf)).await {
            let d = &buf[..len];
            // Long header: flags, version (4), dcid len, dcid.
            if len > 6 && d[0] & 0x80 != 0 {
                let cid = d[6..6 + (d[5] as usize).min(len - 6)].to_vec();
                if seen.insert(cid) {
                    out.push(d.to_vec());
                }
            }
            if out.len() >= pending.len() || out.len() >= n {
                break;
            }
        }
    }
    drop(pending);
    ep.close(0u32.into(), b"");
    out.truncate(n);
    out
}

/// VmRSS and VmHWM (KiB) of `pid`.
pub fn rss_kib(pid: u32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Median VmRSS (KiB) of `pid` over `n` samples 100 ms apart.
pub fn idle_rss(pid: u32, n: usize) -> u64 {
    let mut v: Vec<u64> = (0..n)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(100));
            rss_kib(pid).0
        })
        .collect();
    v.sort_unstable();
    v[n / 2]
}

/// Max VmRSS (KiB) of `pid`, sampled every 20 ms until `stop`.
pub fn max_rss_until(pid: u32, stop: Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut max = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            max = max.max(rss_kib(pid).0);
            std::thread::sleep(Duration::from_millis(20));
        }
        max
    })
}

/// The pid of the meshd process in namespace `ns`.
pub fn meshd_pid(ns: &str) -> Option<u32> {
    let out = std::process::Command::new("ip").args(["netns", "pids", ns]).output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "meshd"))
}

/// What [`push_unauthenticated`] managed.
#[derive(Debug, Default, Clone)]
pub struct PushStats {
    /// Connections attempted, and those that finished TLS.
    pub tried: usize,
    pub tls_ok: usize,
    /// Streams the victim let them open (all connections together).
    pub bidi: usize,
    pub uni: usize,
    /// Stream bytes the client's QUIC stack took (queued or sent), and UDP bytes sent.
    pub stream_bytes: u64,
    pub udp_bytes: u64,
    /// Datagrams handed to QUIC.
    pub datagrams: u64,
    /// How long the longest-lived connection was kept by the victim.
    pub held_max: Duration,
}

/// The most hostile unauthenticated client the victim's limits allow, `conns` times at
/// once from this host: each connection finishes TLS, never authenticates, opens every
/// stream the victim allows (up to 16 bidirectional and 128 unidirectional), keeps an
/// unfinished 1000-byte "hello" on its first stream (under the 1 KiB limit, so the victim
/// waits for the rest until its deadline), pushes data on every other stream and datagrams
/// at `dgram_rate` per second, until the victim closes it or `limit` passes. Stream data is
/// capped at `cap` bytes per connection and paced to `rate` bytes per second in all. Must
/// run in a runtime.
pub async fn push_unauthenticated(
    to: SocketAddr,
    conns: usize,
    limit: Duration,
    cap: u64,
    rate: u64,
    dgram_rate: u64,
) -> PushStats {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let ep = client_endpoint();
    let start = Instant::now();
    let pushed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let ep = ep.clone();
        let pushed = pushed.clone();
        tasks.push(tokio::spawn(async move {
            let mut st = PushStats { tried: 1, ..Default::default() };
            let Ok(Ok(c)) =
                tokio::time::timeout(Duration::from_secs(3), ep.connect(to, "meshd").expect("connect")).await
            else {
                return st;
            };
            st.tls_ok = 1;
            let t = Instant::now();
            let mut sends = Vec::new();
            while st.bidi < 16 {
                match tokio::time::timeout(Duration::from_millis(100), c.open_bi()).await {
                    Ok(Ok((s, _r))) => {
                        st.bidi += 1;
                        sends.push(s);
                    }
                    _ => break,
                }
            }
            while st.uni < 128 {
                match tokio::time::timeout(Duration::from_millis(100), c.open_uni()).await {
                    Ok(Ok(s)) => {
                        st.uni += 1;
                        sends.push(s);
                    }
                    _ => break,
                }
            }
            let mine = Arc::new(AtomicU64::new(0));
            let mut writers = Vec::new();
            for (i, mut s) in sends.into_iter().enumerate() {
                let (pushed, mine) = (pushed.clone(), mine.clone());
                writers.push(tokio::spawn(async move {
                    if i == 0 {
                        // The hello's length prefix claims the most the server accepts
                        // (1024) and 998 bytes follow: the server waits for the rest until
                        // its authentication deadline, the longest a hello can be held.
                        let mut first = [0u8; 1000];
                        first[..2].copy_from_slice(&1024u16.to_be_bytes());
                        let _ = s.write_all(&first).await;
                        mine.fetch_add(1000, Relaxed);
                        std::future::pending::<()>().await;
                    }
                    let chunk = vec![0xA5u8; 16 << 10];
                    while mine.load(Relaxed) < cap && start.elapsed() < limit {
                        // Pace: never ahead of `rate` bytes per second, all connections together.
                        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
                        if pushed.load(Relaxed) > due {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            continue;
                        }
                        match s.write(&chunk).await {
                            Ok(n) => {
                                mine.fetch_add(n as u64, Relaxed);
                                pushed.fetch_add(n as u64, Relaxed);
                            }
                            Err(_) => break,
                        }
                    }
                    std::future::pending::<()>().await
                }));
            }
            let c2 = c.clone();
            let dgrams = tokio::spawn(async move {
                let mut sent = 0u64;
                let t = Instant::now();
                while t.elapsed() < limit && c2.close_reason().is_none() {
                    let due = (t.elapsed().as_secs_f64() * dgram_rate as f64) as u64;
                    while sent < due {
                        let n = c2.max_datagram_size().unwrap_or(0).max(1);
                        if c2.send_datagram(vec![0x5Au8; n].into()).is_err() {
                            break;
                        }
                        sent += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                sent
            });
            let _ = tokio::time::timeout(limit.saturating_sub(t.elapsed()), c.closed()).await;
            st.held_max = t.elapsed();
            for w in writers {
                w.abort();
            }
            st.datagrams = dgrams.await.unwrap_or(0);
            st.stream_bytes = mine.load(Relaxed);
            st.udp_bytes = c.stats().udp_tx.bytes;
            c.close(0u32.into(), b"");
            st
        }));
    }
    let mut all = PushStats::default();
    for t in tasks {
        let s = t.await.expect("attacker connection");
        all.tried += s.tried;
        all.tls_ok += s.tls_ok;
        all.bidi += s.bidi;
        all.uni += s.uni;
        all.stream_bytes += s.stream_bytes;
        all.udp_bytes += s.udp_bytes;
        all.datagrams += s.datagrams;
        all.held_max = all.held_max.max(s.held_max);
    }
    ep.close(0u32.into(), b"");
    all
}

// ---- a member holding the token, and a spoofer, against the data plane -------------------

/// A member that holds the token: an authenticated main connection to a node, made from a
/// UDP socket whose clone (`raw`) sends crafted plane datagrams from the same address and
/// port. Must be used inside the runtime that made it.
pub struct Member {
    pub ep: quinn::Endpoint,
    pub conn: quinn::Connection,
    pub raw: UdpSocket,
}

/// Connects to `to` and authenticates with `token` as a new node of the run `run_id` (the
/// victim then registers the connection as a peer's and makes its plane links).
pub async fn join_as_member(to: SocketAddr, token: &Token, run_id: &str) -> Result<Member, String> {
    let socket = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
    let raw = socket.try_clone().map_err(|e| e.to_string())?;
    let runtime = quinn::default_runtime().ok_or("no runtime")?;
    let mut ep = quinn::Endpoint::new(quinn::EndpointConfig::default(), None, socket, runtime)
        .map_err(|e| e.to_string())?;
    ep.set_default_client_config(client_endpoint_config());
    let conn = ep.connect(to, "meshd").map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
    let run_hash = meshd::mesh::stable_hash(&[run_id.as_bytes()]);
    let node = NodeId::from_u128(0x5EED_0000_0000_0000_0000_0000_0000_0001);
    authenticate(&conn, hello(token, node, run_hash)).await?;
    Ok(Member { ep, conn, raw })
}

/// Seals plane datagrams as a member's end of its link on `lane` (it is the QUIC client:
/// its datagrams travel client to server), with the secret exported from its connection:
/// datagrams the victim opens and takes as the member's own.
pub struct Forger {
    key: meshd_proto::plane::keys::PacketKey,
    lane: u8,
    id: u64,
    pn: u64,
}

impl Forger {
    pub fn new(conn: &quinn::Connection, lane: u8) -> Forger {
        use meshd_proto::plane::keys::{EXPORTER_LABEL, PacketKey, exporter_context, link_id};
        let mut secret = [0u8; 32];
        conn.export_keying_material(&mut secret, EXPORTER_LABEL, &exporter_context(lane, true))
            .expect("exporter");
        Forger { key: PacketKey::from_secret(&secret), lane, id: link_id(&secret), pn: 0 }
    }

    /// Payload bytes of a full-size DATA fragment of a message of `total_len` bytes in a
    /// datagram of `size` bytes (a multiple of 8, as the plane's own sender cuts them).
    pub fn fragment_len(&self, seq: u64, total_len: u64, size: usize) -> usize {
        use meshd_proto::plane::frame::DataHeader;
        use meshd_proto::plane::packet::OVERHEAD;
        let h = DataHeader { seq, tag: 0, total_len, offset: 0 };
        (size - OVERHEAD - h.encoded_len()) / 8 * 8
    }

    /// The next datagram: one DATA fragment (message `seq`, ring data tag 0, `total_len`
    /// bytes in all, `payload` at `offset`).
    pub fn data(&mut self, seq: u64, total_len: u64, offset: u64, payload: &[u8]) -> Vec<u8> {
        use meshd_proto::plane::frame::DataHeader;
        use meshd_proto::plane::packet::{HEADER_LEN, Header, TAG_LEN};
        let h = DataHeader { seq, tag: 0, total_len, offset };
        let mut out = vec![0u8; HEADER_LEN + h.encoded_len() + payload.len() + TAG_LEN];
        let mut pos = HEADER_LEN;
        h.write(&mut out, &mut pos);
        out[pos..pos + payload.len()].copy_from_slice(payload);
        pos += payload.len();
        Header::write(false, self.lane, self.id, self.pn, &mut out);
        let (head, body) = out.split_at_mut(HEADER_LEN);
        let tag = self.key.seal(self.pn, head, &mut body[..pos - HEADER_LEN]);
        out[pos..].copy_from_slice(tag.as_ref());
        self.pn += 1;
        out
    }
}

/// Sends raw IPv4/UDP datagrams with the source address `src` (not this host's: a spoofer
/// off the path, which never sees what the victims answer) to each of `dsts` in turn, at
/// about `rate` datagrams per second in all, until `stop` or `limit`. `fill` writes each
/// payload (given the datagram's number) and returns its length. Returns the datagrams
/// sent and the seconds it sent for. Run it inside a lab namespace (`in_netns`).
pub fn spoof_flood(
    src: std::net::SocketAddrV4,
    dsts: &[std::net::SocketAddrV4],
    rate: u64,
    limit: Duration,
    stop: &std::sync::atomic::AtomicBool,
    mut fill: impl FnMut(u64, &mut [u8]) -> usize,
) -> (u64, f64) {
    const BATCH: usize = 64;
    const MAX: usize = 1472;
    // SAFETY: plain socket(2); the fd is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    let mut pkts = vec![[0u8; 28 + MAX]; BATCH];
    let mut lens = [0usize; BATCH];
    let mut names: Vec<libc::sockaddr_in> = vec![unsafe { std::mem::zeroed() }; BATCH];
    let start = Instant::now();
    let mut sent = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) && start.elapsed() < limit {
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        if sent >= due {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        let n = ((due - sent) as usize).min(BATCH);
        for i in 0..n {
            let k = sent + i as u64;
            let dst = dsts[(k % dsts.len() as u64) as usize];
            let len = fill(k, &mut pkts[i][28..]).min(MAX);
            let p = &mut pkts[i];
            let total = (28 + len) as u16;
            // IPv4 header (the kernel fills in the checksum and, when 0, the id).
            p[0] = 0x45;
            p[1] = 0;
            p[2..4].copy_from_slice(&total.to_be_bytes());
            p[4..8].copy_from_slice(&[0, 0, 0x40, 0]);
            p[8] = 64;
            p[9] = 17;
            p[10..12].copy_from_slice(&[0, 0]);
            p[12..16].copy_from_slice(&src.ip().octets());
            p[16..20].copy_from_slice(&dst.ip().octets());
            // UDP header, checksum 0 (none, allowed over IPv4).
            p[20..22].copy_from_slice(&src.port().to_be_bytes());
            p[22..24].copy_from_slice(&dst.port().to_be_bytes());
            p[24..26].copy_from_slice(&((8 + len) as u16).to_be_bytes());
            p[26..28].copy_from_slice(&[0, 0]);
            lens[i] = 28 + len;
            names[i].sin_family = libc::AF_INET as libc::sa_family_t;
            names[i].sin_addr.s_addr = u32::from_ne_bytes(dst.ip().octets());
        }
        let mut iovs: Vec<libc::iovec> =
            (0..n).map(|i| libc::iovec { iov_base: pkts[i].as_mut_ptr().cast(), iov_len: lens[i] }).collect();
        let mut msgs: Vec<libc::mmsghdr> = (0..n)
            .map(|i| {
                // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_name = (&mut names[i] as *mut libc::sockaddr_in).cast();
                m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as u32;
                m.msg_hdr.msg_iov = &mut iovs[i];
                m.msg_hdr.msg_iovlen = 1;
                m
            })
            .collect();
        // SAFETY: `msgs` holds `n` valid headers whose buffers live until the call returns.
        let r = unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr(), n as u32, 0) };
        if r > 0 {
            sent += r as u64;
        } else {
            // Buffers full: wait a little and pace again.
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    // SAFETY: our own fd.
    unsafe { libc::close(fd) };
    (sent, start.elapsed().as_secs_f64())
}

/// Like [`spoof_flood`], but as trains of `segment`-byte UDP datagrams sent with UDP GSO
/// from a socket bound (IP_TRANSPARENT) to the address `src` this host does not have: up
/// to 64 datagrams per send call, each its own datagram on the wire, so a flood of
/// 100,000 a second costs the sender little and every datagram reaches the victims' socket
/// (and meshd's demultiplexer) on its own. `fill` writes each datagram's payload (all
/// `segment` bytes). Returns the datagrams sent and the seconds it sent for.
pub fn spoof_flood_gso(
    src: std::net::SocketAddrV4,
    dsts: &[std::net::SocketAddrV4],
    segment: usize,
    rate: u64,
    limit: Duration,
    stop: &std::sync::atomic::AtomicBool,
    mut fill: impl FnMut(u64, &mut [u8]),
) -> (u64, f64) {
    use std::os::fd::FromRawFd;
    const TRAIN: usize = 64;
    // SAFETY: plain socket(2), setsockopt(2) and bind(2) on our own fd, which `from_raw_fd`
    // then owns.
    let sock = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let one: libc::c_int = 1;
        let on = (&one as *const libc::c_int).cast();
        let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        assert_eq!(libc::setsockopt(fd, libc::SOL_IP, libc::IP_TRANSPARENT, on, len), 0, "IP_TRANSPARENT");
        let seg = segment as libc::c_int;
        let segp = (&seg as *const libc::c_int).cast();
        assert_eq!(libc::setsockopt(fd, libc::SOL_UDP, libc::UDP_SEGMENT, segp, len), 0, "UDP_SEGMENT");
        let mut sa: libc::sockaddr_in = std::mem::zeroed();
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_port = src.port().to_be();
        sa.sin_addr.s_addr = u32::from_ne_bytes(src.ip().octets());
        let rc = libc::bind(fd, (&sa as *const libc::sockaddr_in).cast(), std::mem::size_of_val(&sa) as u32);
        assert_eq!(rc, 0, "bind {src}: {}", std::io::Error::last_os_error());
        UdpSocket::from_raw_fd(fd)
    };
    let mut train = vec![0u8; TRAIN * segment];
    let start = Instant::now();
    let mut sent = 0u64;
    let mut k = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) && start.elapsed() < limit {
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        if sent + TRAIN as u64 > due {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        for seg in train.chunks_mut(segment) {
            fill(sent, seg);
        }
        let dst = dsts[(k % dsts.len() as u64) as usize];
        k += 1;
        match sock.send_to(&train, dst) {
            Ok(_) => sent += TRAIN as u64,
            Err(_) => std::thread::sleep(Duration::from_micros(200)),
        }
    }
    (sent, start.elapsed().as_secs_f64())
}
