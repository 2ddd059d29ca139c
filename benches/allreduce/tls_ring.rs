//! The encrypted-TCP yardstick for meshd's ring: a ring allreduce (reduce-scatter then
//! allgather, float32 sum) where each node sends to its next node and receives from its
//! previous one over one TCP connection each way, TLS 1.3 with rustls (the `ring` provider,
//! the crypto meshd's QUIC and data plane use), TLS13_AES_128_GCM_SHA256 only; or the
//! same ring over plaintext TCP.
//!
//! The bench binary runs one rank of it when started with
//! `--tls-ring-worker RANK ADDRS BYTES ITERS CERT_DIR|plain` (ADDRS: every node's address,
//! comma separated, in rank order; CERT_DIR holds `cert.der` and `key.der`, written by
//! [`CertDir::new`] in the parent: one self-signed certificate that every client trusts,
//! so the handshake is a real one, verified, and every record is sealed with AES-128-GCM).
//! It prints one JSON line: busbw, CPU seconds per GB one link carried (the definition
//! `meshd bench allreduce` uses) and peak RSS.

use anyhow::{Context, Result, bail, ensure};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConnection, ServerConnection, StreamOwned};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The ring's TCP port on every node (each lab host is its own network namespace).
pub const PORT: u16 = 29610;
/// The name in the certificate, which every client asks for.
const SERVER_NAME: &str = "tls-ring.lab";
/// Received bytes are reduced in pieces of this size while the rest still arrives.
const SEGMENT: usize = 1 << 20;

/// A self-signed certificate and its key, written where every lab namespace can read them
/// (the namespaces share the filesystem); removed on drop.
#[derive(Debug)]
pub struct CertDir(PathBuf);

impl CertDir {
    pub fn new() -> Result<CertDir> {
        let dir = std::env::temp_dir().join(format!("meshd-tls-ring-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let ck = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()])?;
        std::fs::write(dir.join("cert.der"), ck.cert.der())?;
        std::fs::write(dir.join("key.der"), ck.signing_key.serialize_der())?;
        Ok(CertDir(dir))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for CertDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

type Tx = Box<dyn Write + Send>;
type Rx = Box<dyn Read + Send>;

/// One rank: the arguments after `--tls-ring-worker`. Prints its JSON line; exit code 1
/// (with the reason on stderr) on any failure, a wrong result included.
pub fn worker(args: &[String]) -> i32 {
    match run(args) {
        Ok(line) => {
            println!("{line}");
            0
        }
        Err(e) => {
            eprintln!("tls ring worker: {e:#}");
            1
        }
    }
}

fn run(args: &[String]) -> Result<serde_json::Value> {
    let [rank, addrs, bytes, iters, mode] = args else {
        bail!("usage: --tls-ring-worker RANK ADDRS BYTES ITERS CERT_DIR|plain");
    };
    let rank: usize = rank.parse()?;
    let addrs: Vec<&str> = addrs.split(',').collect();
    let n = addrs.len();
    ensure!(n >= 2 && rank < n, "rank {rank} of {n} nodes");
    let elems = bytes.parse::<usize>()?.max(4 * n) / 4;
    let iters: u32 = iters.parse()?;

    let (to_next, from_prev) = connect(rank, &addrs)?;
    let (mut tx, mut rx, suite): (Tx, Rx, String) = if mode == "plain" {
        (Box::new(to_next), Box::new(from_prev), "plaintext".into())
    } else {
        tls(to_next, from_prev, Path::new(mode))?
    };
    let mut ring = |buf: &mut [u8], scratch: &mut [u8]| allreduce(buf, rank, n, &mut tx, &mut rx, scratch);

    // Every node contributes rank + 1: check the sum once before timing, as meshd's bench does.
    let mut buf: Vec<u8> = ((rank + 1) as f32).to_le_bytes().repeat(elems);
    let mut scratch = vec![0u8; SEGMENT];
    ring(&mut buf, &mut scratch)?;
    let want = (n * (n + 1) / 2) as f32;
    if let Some(bad) = buf.chunks_exact(4).position(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want)
    {
        bail!("wrong allreduce result at element {bad} of {elems}: expected {want}");
    }
    // A tiny allreduce so that every node starts timing together.
    ring(&mut vec![0u8; 4 * n], &mut scratch)?;
    let (t, cpu) = (Instant::now(), cpu_seconds());
    for _ in 0..iters {
        ring(&mut buf, &mut scratch)?;
    }
    let (secs, cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - cpu);
    let time_s = secs / iters.max(1) as f64;
    let factor = 2.0 * (n as f64 - 1.0) / n as f64;
    let link_gb = (elems * 4) as f64 * factor / 1e9;
    let alg = (elems * 4) as f64 / time_s / 1e9;
    Ok(serde_json::json!({
        "rank": rank, "nodes": n, "suite": suite, "bytes": elems * 4, "iters": iters, "time_s": time_s,
        "algbw_gbs": alg, "busbw_gbs": alg * factor, "cpu_s_per_gb": cpu / (link_gb * iters.max(1) as f64),
        "peak_rss_mib": peak_rss_kib() as f64 / 1024.0,
    }))
}

/// One TCP connection to the next node and one from the previous node.
fn connect(rank: usize, addrs: &[&str]) -> Result<(TcpStream, TcpStream)> {
    let n = addrs.len();
    let listener = TcpListener::bind(("0.0.0.0", PORT)).context("listen")?;
    let next = addrs[(rank + 1) % n];
    let deadline = Instant::now() + Duration::from_secs(30);
    // The next node may not listen yet: retry until it does.
    let to_next = loop {
        match TcpStream::connect((next, PORT)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e).with_context(|| format!("connect to {next}:{PORT}")),
        }
    };
    let (from_prev, _) = listener.accept().context("accept")?;
    to_next.set_nodelay(true)?;
    from_prev.set_nodelay(true)?;
    Ok((to_next, from_prev))
}

/// rustls's `ring` provider with one cipher suite, TLS13_AES_128_GCM_SHA256.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256];
    Arc::new(p)
}

/// TLS 1.3 on both connections: this node is the client of its next node and the server of
/// its previous one. Both handshakes run at once: one after the other, every node would wait
/// in its client handshake for a next node that waits in its own.
fn tls(mut to_next: TcpStream, mut from_prev: TcpStream, dir: &Path) -> Result<(Tx, Rx, String)> {
    let cert = CertificateDer::from(std::fs::read(dir.join("cert.der")).context("cert.der")?);
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(std::fs::read(dir.join("key.der"))?));
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone())?;
    let client = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut server = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)?;
    // The previous node only sends: no session tickets to resume with.
    server.send_tls13_tickets = 0;
    let mut c = ClientConnection::new(Arc::new(client), ServerName::try_from(SERVER_NAME)?.to_owned())?;
    let mut s = ServerConnection::new(Arc::new(server))?;
    std::thread::scope(|sc| -> io::Result<()> {
        let h = sc.spawn(|| -> io::Result<()> {
            while s.is_handshaking() {
                s.complete_io(&mut from_prev)?;
            }
            Ok(())
        });
        while c.is_handshaking() {
            c.complete_io(&mut to_next)?;
        }
        h.join().unwrap_or_else(|_| Err(io::Error::other("server handshake panicked")))
    })
    .context("TLS handshake")?;
    let suite = c.negotiated_cipher_suite().map(|s| s.suite());
    ensure!(
        suite == Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
            && s.negotiated_cipher_suite().map(|s| s.suite()) == suite,
        "negotiated {suite:?}"
    );
    let suite = format!("{:?}", suite.expect("checked above"));
    Ok((Box::new(StreamOwned::new(c, to_next)), Box::new(StreamOwned::new(s, from_prev)), suite))
}

/// Ring allreduce of `buf` (float32 sum), in place: n - 1 reduce-scatter steps, then n - 1
/// allgather steps; in each, chunk `send` goes to the next node while chunk `recv` arrives
/// from the previous one.
fn allreduce(
    buf: &mut [u8],
    rank: usize,
    n: usize,
    tx: &mut Tx,
    rx: &mut Rx,
    scratch: &mut [u8],
) -> Result<()> {
    let elems = buf.len() / 4;
    // Chunk i (taken mod n) as a byte range, on element boundaries.
    let chunk = |i: usize| {
        let i = i % n;
        i * elems / n * 4..(i + 1) * elems / n * 4
    };
    for s in 0..n - 1 {
        step(buf, chunk(rank + n - s), chunk(rank + 2 * n - s - 1), tx, rx, scratch, true)?;
    }
    // Node r now holds the sum of chunk r + 1.
    for s in 0..n - 1 {
        step(buf, chunk(rank + 1 + n - s), chunk(rank + n - s), tx, rx, scratch, false)?;
    }
    Ok(())
}

/// Sends `buf[send]` on a scoped thread while this one receives into `buf[recv]`, adding
/// to it (`reduce`) one segment at a time, or overwriting it.
fn step(
    buf: &mut [u8],
    send: Range<usize>,
    recv: Range<usize>,
    tx: &mut Tx,
    rx: &mut Rx,
    scratch: &mut [u8],
    reduce: bool,
) -> Result<()> {
    let (out, into) = split(buf, send, recv);
    std::thread::scope(|sc| {
        let h = sc.spawn(move || -> io::Result<()> {
            tx.write_all(out)?;
            tx.flush()
        });
        let r = if reduce {
            into.chunks_mut(SEGMENT).try_for_each(|seg| -> io::Result<()> {
                let got = &mut scratch[..seg.len()];
                rx.read_exact(got)?;
                add_f32(seg, got)
            })
        } else {
            rx.read_exact(into)
        };
        let w = h.join().unwrap_or_else(|_| Err(io::Error::other("sender panicked")));
        r.context("receive from the previous node")?;
        w.context("send to the next node")
    })
}

/// `buf[send]` to read and `buf[recv]` to write, two disjoint ranges.
fn split(buf: &mut [u8], send: Range<usize>, recv: Range<usize>) -> (&[u8], &mut [u8]) {
    if send.start < recv.start {
        let (lo, hi) = buf.split_at_mut(recv.start);
        (&lo[send], &mut hi[..recv.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(send.start);
        (&hi[..send.len()], &mut lo[recv])
    }
}

/// `dst[i] += src[i]` over little-endian float32s, with meshd's own reduction kernel (the
/// one its ring uses), so that no yardstick pays for a slower loop than meshd does.
pub fn add_f32(dst: &mut [u8], src: &[u8]) -> io::Result<()> {
    meshd_proto::reduce::reduce_into(
        meshd_proto::reduce::DType::F32,
        meshd_proto::reduce::ReduceOp::Sum,
        dst,
        src,
    )
    .map_err(|e| io::Error::other(format!("reduce: {e}")))
}

/// CPU seconds (user + system) this process has used, as `meshd bench allreduce` counts.
pub fn cpu_seconds() -> f64 {
    let ru = rusage();
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Peak resident set size, KiB.
pub fn peak_rss_kib() -> i64 {
    rusage().ru_maxrss
}

fn rusage() -> libc::rusage {
    // SAFETY: getrusage only writes the struct we pass; RUSAGE_SELF is always valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru
}
