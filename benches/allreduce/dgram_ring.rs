//! The lean AEAD-datagram yardstick for meshd's data plane: the same ring allreduce as
//! `tls_ring.rs` (reduce-scatter then allgather, float32 sum, chunk `i` of a node's buffer
//! to its next node in each step), carried in AES-128-GCM datagrams (`ring`, the crypto the
//! plane uses) of the plane's size (the interface's MTU less 28 bytes of IPv4 and UDP
//! headers) on one UDP socket per node: sent with GSO (`UDP_SEGMENT`, up to 64 KB a call),
//! received with GRO (`UDP_GRO`), each payload copied once into its datagram and sealed in
//! place, opened in place and reduced (or copied) straight from the opened datagram. A
//! receiver grants credit (8 MiB ahead of what it consumed, as the plane's ring credit) and
//! only within the allreduce it is running. There is no loss recovery, congestion control,
//! pacing or key update: it is what the plane's datagrams cost with none of the plane's
//! reliability, the measure of the plane's own overhead (issue 33's "lean probe"). A lost
//! datagram fails the run ("no datagram for ...") instead of being resent; the lab loses
//! none.
//!
//! The bench binary runs one rank of it when started with
//! `--dgram-ring-worker RANK ADDRS BYTES ITERS MTU` and prints one JSON line with the
//! fields `tls_ring.rs` prints (CPU seconds per GB one link carried: the definition
//! `meshd bench allreduce` uses).

use anyhow::{Context, Result, bail, ensure};
use ring::aead::{AES_128_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use std::net::{SocketAddr, UdpSocket};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The ring's UDP port on every node (each lab host is its own network namespace).
pub const PORT: u16 = 29611;
/// Credit a receiver grants beyond what it consumed (the plane's `RING_WINDOW`).
const WINDOW: u64 = 8 << 20;
/// Kind byte, nonce counter (8), stream offset (8).
const HEADER: usize = 17;
const TAG: usize = 16;
const KIND_DATA: u8 = 1;
const KIND_CREDIT: u8 = 2;
/// A GSO send carries at most this many bytes and 64 datagrams.
const GSO_BYTES: usize = 65_000;
/// How long a wait for a datagram or for credit may last before the run fails.
const STALL: Duration = Duration::from_secs(30);
// Linux's `SOL_UDP` options (linux/udp.h).
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;

/// One rank: the arguments after `--dgram-ring-worker`. Prints its JSON line; exit code 1
/// (with the reason on stderr) on any failure, a wrong result included.
pub fn worker(args: &[String]) -> i32 {
    match run(args) {
        Ok(line) => {
            println!("{line}");
            0
        }
        Err(e) => {
            eprintln!("datagram ring worker: {e:#}");
            1
        }
    }
}

/// The buffer of the allreduce being run, as the receiving thread sees it.
#[derive(Clone, Copy)]
struct Armed {
    ptr: *mut u8,
    /// Where the allreduce's stream from the previous node starts (offsets run on across
    /// allreduces).
    base: u64,
    steps: usize,
    elems: usize,
}

// SAFETY: the pointer is only written through by the receiving thread, in ranges no send
// of the current step reads (see `Shared`), into a buffer that outlives that thread (`run`
// joins it before the buffers go, also after a failed allreduce).
unsafe impl Send for Armed {}

/// What the sending (main) thread and the receiving thread share.
struct Shared {
    armed: Mutex<Option<Armed>>,
    /// Steps of the armed allreduce received in full (released when one completes).
    done_steps: AtomicUsize,
    /// Credit this node granted the previous one, and the nonce counter of its grants.
    granted: AtomicU64,
    credit_nonce: AtomicU64,
    /// Credit the next node granted (stream offset the sender may send up to).
    credit: AtomicU64,
    failed: AtomicBool,
    /// Receive calls and datagrams received (GRO's batching).
    calls: AtomicU64,
    datagrams: AtomicU64,
    progress: (Mutex<()>, Condvar),
}

impl Shared {
    fn notify(&self) {
        let _g = self.progress.0.lock().unwrap_or_else(|p| p.into_inner());
        self.progress.1.notify_all();
    }

    /// Waits until `ok()` holds, the other thread failed, or nothing changed for `STALL`.
    fn wait(&self, what: &str, ok: impl Fn() -> bool) -> Result<()> {
        let start = Instant::now();
        let mut g = self.progress.0.lock().unwrap_or_else(|p| p.into_inner());
        while !ok() {
            if self.failed.load(Ordering::Acquire) {
                bail!("the receiving thread failed");
            }
            if start.elapsed() > STALL {
                bail!("no {what} for {STALL:?}");
            }
            g = self
                .progress
                .1
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }
}

/// Ring geometry: chunk `i` (mod n) of a buffer of `elems` float32s, as a byte range.
fn chunk(i: usize, n: usize, elems: usize) -> Range<usize> {
    let i = i % n;
    i * elems / n * 4..(i + 1) * elems / n * 4
}

/// The chunk node `rank` sends in step `s` of 2(n-1), and the one it receives.
fn send_chunk(rank: usize, n: usize, s: usize) -> usize {
    if s < n - 1 { rank + n - s } else { rank + 1 + n - (s - (n - 1)) }
}
fn recv_chunk(rank: usize, n: usize, s: usize) -> usize {
    if s < n - 1 { rank + 2 * n - s - 1 } else { rank + n - (s - (n - 1)) }
}

fn key() -> LessSafeKey {
    // A yardstick: one fixed key on every node; nonces differ by sender and stream offset.
    LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &[7u8; 16]).expect("a 16-byte AES key"))
}

fn nonce(sender: usize, kind: u8, ctr: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[0] = kind;
    n[1..4].copy_from_slice(&(sender as u32).to_be_bytes()[1..]);
    n[4..].copy_from_slice(&ctr.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

fn run(args: &[String]) -> Result<serde_json::Value> {
    let [rank, addrs, bytes, iters, mtu] = args else {
        bail!("usage: --dgram-ring-worker RANK ADDRS BYTES ITERS MTU");
    };
    let rank: usize = rank.parse()?;
    let addrs: Vec<&str> = addrs.split(',').collect();
    let n = addrs.len();
    ensure!(n >= 2 && rank < n, "rank {rank} of {n} nodes");
    let elems = bytes.parse::<usize>()?.max(4 * n) / 4;
    let iters: u32 = iters.parse()?;
    let datagram = mtu.parse::<usize>()?.saturating_sub(28);
    // Payloads of whole 16-byte blocks (float32s stay aligned to their datagram).
    let payload = (datagram.saturating_sub(HEADER + TAG)) / 16 * 16;
    ensure!(payload >= 64, "MTU {mtu} leaves {payload} bytes a datagram");
    let next: SocketAddr = format!("{}:{PORT}", addrs[(rank + 1) % n]).parse()?;
    let prev: SocketAddr = format!("{}:{PORT}", addrs[(rank + n - 1) % n]).parse()?;
    let sock = UdpSocket::bind(("0.0.0.0", PORT)).context("bind the datagram ring's port")?;
    setup(&sock)?;

    let shared = Shared {
        armed: Mutex::new(None),
        done_steps: AtomicUsize::new(0),
        credit: AtomicU64::new(0),
        granted: AtomicU64::new(0),
        credit_nonce: AtomicU64::new(0),
        failed: AtomicBool::new(false),
        calls: AtomicU64::new(0),
        datagrams: AtomicU64::new(0),
        progress: (Mutex::new(()), Condvar::new()),
    };
    let stop = AtomicBool::new(false);
    let mut ring = Ring {
        rank,
        n,
        payload,
        next,
        prev,
        sock: &sock,
        shared: &shared,
        stream: 0,
        rstream: 0,
        nonce: 0,
        key: key(),
    };
    // The buffers outlive the scope: the receiving thread may write into an armed one until
    // it is joined, also when an allreduce failed half-way.
    let mut buf: Vec<u8> = ((rank + 1) as f32).to_le_bytes().repeat(elems);
    let mut tiny = vec![0u8; 4 * n];
    std::thread::scope(|sc| -> Result<serde_json::Value> {
        let h = sc.spawn(|| {
            let r = receive(rank, n, prev, &sock, &shared, &stop);
            if r.is_err() {
                shared.failed.store(true, Ordering::Release);
                shared.notify();
            }
            r
        });
        let timed = (|| -> Result<serde_json::Value> {
            // Every node contributes rank + 1: check the sum once before timing.
            ring.allreduce(&mut buf)?;
            let want = (n * (n + 1) / 2) as f32;
            if let Some(bad) =
                buf.chunks_exact(4).position(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want)
            {
                bail!("wrong allreduce result at element {bad} of {elems}: expected {want}");
            }
            // A tiny allreduce so that every node starts timing together.
            ring.allreduce(&mut tiny)?;
            let (t, cpu) = (Instant::now(), super::tls_ring::cpu_seconds());
            for _ in 0..iters {
                ring.allreduce(&mut buf)?;
            }
            let (secs, cpu) = (t.elapsed().as_secs_f64(), super::tls_ring::cpu_seconds() - cpu);
            let time_s = secs / iters.max(1) as f64;
            let factor = 2.0 * (n as f64 - 1.0) / n as f64;
            let link_gb = (elems * 4) as f64 * factor / 1e9;
            let alg = (elems * 4) as f64 / time_s / 1e9;
            Ok(serde_json::json!({
                "rank": rank, "nodes": n, "suite": format!("AES-128-GCM datagrams of {datagram} B, GSO/GRO, no loss recovery"),
                "bytes": elems * 4, "iters": iters, "time_s": time_s,
                "algbw_gbs": alg, "busbw_gbs": alg * factor, "cpu_s_per_gb": cpu / (link_gb * iters.max(1) as f64),
                "peak_rss_mib": super::tls_ring::peak_rss_kib() as f64 / 1024.0,
                "datagrams_per_recv": shared.datagrams.load(Ordering::Relaxed) as f64 / shared.calls.load(Ordering::Relaxed).max(1) as f64,
            }))
        })();
        stop.store(true, Ordering::Release);
        let r = h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the receiving thread panicked")));
        match (timed, r) {
            (Err(e), Err(r)) => Err(e.context(format!("receiving: {r:#}"))),
            (Err(e), _) => Err(e),
            (Ok(_), Err(r)) => Err(r.context("receiving")),
            (Ok(v), Ok(())) => Ok(v),
        }
    })
}

/// Large socket buffers (as the plane's) and GRO on.
fn setup(sock: &UdpSocket) -> Result<()> {
    let fd = sock.as_raw_fd();
    let set = |level, opt, v: libc::c_int| {
        // SAFETY: setsockopt reads one c_int from a live local.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                (&v as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as u32,
            )
        }
    };
    for (force, plain) in [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)] {
        if set(libc::SOL_SOCKET, force, 32 << 20) != 0 {
            set(libc::SOL_SOCKET, plain, 32 << 20);
        }
    }
    ensure!(set(libc::SOL_UDP, UDP_GRO, 1) == 0, "UDP_GRO: {}", std::io::Error::last_os_error());
    sock.set_read_timeout(Some(Duration::from_millis(100)))?;
    Ok(())
}

struct Ring<'a> {
    rank: usize,
    n: usize,
    payload: usize,
    next: SocketAddr,
    prev: SocketAddr,
    sock: &'a UdpSocket,
    shared: &'a Shared,
    /// Stream offsets where the next allreduce starts: what this node sends, and what it
    /// receives (the chunks differ by an element where the buffer does not divide).
    stream: u64,
    rstream: u64,
    nonce: u64,
    key: LessSafeKey,
}

impl Ring<'_> {
    fn allreduce(&mut self, buf: &mut [u8]) -> Result<()> {
        let (n, rank) = (self.n, self.rank);
        let elems = buf.len() / 4;
        let steps = 2 * (n - 1);
        let base = self.stream;
        let total: u64 = (0..steps).map(|s| chunk(send_chunk(rank, n, s), n, elems).len() as u64).sum();
        let rtotal: u64 = (0..steps).map(|s| chunk(recv_chunk(rank, n, s), n, elems).len() as u64).sum();
        self.shared.done_steps.store(0, Ordering::Release);
        *self.shared.armed.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Armed { ptr: buf.as_mut_ptr(), base: self.rstream, steps, elems });
        // The previous node's first window of this allreduce (the receiving thread grants
        // the rest as it consumes).
        grant(self.shared, self.sock, self.prev, &self.key, rank, self.rstream + WINDOW.min(rtotal))?;
        self.rstream += rtotal;
        let ptr = buf.as_ptr();
        let mut at = base;
        let mut out = vec![0u8; GSO_BYTES + 2048];
        let per = self.payload + HEADER + TAG;
        let batch = (GSO_BYTES / per).clamp(1, 64);
        for s in 0..steps {
            // Chunk `send` is the one received in step s - 1: wait until it is all here.
            if s > 0 {
                self.shared.wait("datagram of the previous step", || {
                    self.shared.done_steps.load(Ordering::Acquire) >= s
                })?;
            }
            let range = chunk(send_chunk(rank, n, s), n, elems);
            // SAFETY: `range` is inside `buf`; the receiving thread writes only chunks of
            // steps not yet sent, never this one while it is sent (the ring's order).
            let data = unsafe { std::slice::from_raw_parts(ptr.add(range.start), range.len()) };
            for group in data.chunks(self.payload * batch) {
                let end = at + group.len() as u64;
                self.shared.wait("credit from the next node", || {
                    self.shared.credit.load(Ordering::Acquire) >= end
                })?;
                let mut len = 0;
                for piece in group.chunks(self.payload) {
                    let d = &mut out[len..len + HEADER + piece.len() + TAG];
                    d[0] = KIND_DATA;
                    d[1..9].copy_from_slice(&self.nonce.to_le_bytes());
                    d[9..17].copy_from_slice(&at.to_le_bytes());
                    let (head, rest) = d.split_at_mut(HEADER);
                    let (body, tag) = rest.split_at_mut(piece.len());
                    body.copy_from_slice(piece);
                    let t = self
                        .key
                        .seal_in_place_separate_tag(
                            nonce(rank, KIND_DATA, self.nonce),
                            Aad::from(&*head),
                            body,
                        )
                        .map_err(|_| anyhow::anyhow!("seal"))?;
                    tag.copy_from_slice(t.as_ref());
                    self.nonce += 1;
                    at += piece.len() as u64;
                    len += d.len();
                }
                send_gso(self.sock, self.next, &out[..len], per)?;
            }
        }
        ensure!(at == base + total, "sent {} of {total} bytes", at - base);
        self.stream = base + total;
        // Every step received: the buffer is whole.
        self.shared
            .wait("datagram of the last step", || self.shared.done_steps.load(Ordering::Acquire) >= steps)?;
        *self.shared.armed.lock().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(())
    }
}

/// One `sendmsg` of `data`: datagrams of `seg` bytes (the last may be shorter).
fn send_gso(sock: &UdpSocket, to: SocketAddr, data: &[u8], seg: usize) -> Result<()> {
    let SocketAddr::V4(to) = to else { bail!("IPv4 only") };
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_port = to.port().to_be();
    sa.sin_addr.s_addr = u32::from_ne_bytes(to.ip().octets());
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    let mut control = [0u64; 4];
    // SAFETY: msghdr and its control buffer are built from live locals of the right sizes.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_name = (&mut sa as *mut libc::sockaddr_in).cast();
        msg.msg_namelen = size_of::<libc::sockaddr_in>() as u32;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if data.len() > seg {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(size_of::<u16>() as u32) as usize;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_UDP;
            (*c).cmsg_type = UDP_SEGMENT;
            (*c).cmsg_len = libc::CMSG_LEN(size_of::<u16>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg as u16);
        }
        loop {
            let r = libc::sendmsg(sock.as_raw_fd(), &msg, 0);
            if r >= 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            // A full socket buffer: wait a moment (the ring's credit bounds what is queued).
            if matches!(e.raw_os_error(), Some(libc::ENOBUFS) | Some(libc::EAGAIN)) {
                std::thread::sleep(Duration::from_micros(50));
                continue;
            }
            return Err(e).context("sendmsg");
        }
    }
}

/// Grants the previous node credit up to stream offset `to` (called by the receiving thread
/// as it consumes, and by the main thread for an allreduce's first window when it arms it:
/// never both at once, as an allreduce is armed only once the last one was received).
fn grant(
    shared: &Shared,
    sock: &UdpSocket,
    prev: SocketAddr,
    key: &LessSafeKey,
    rank: usize,
    to: u64,
) -> Result<()> {
    let ctr = shared.credit_nonce.fetch_add(1, Ordering::SeqCst);
    let mut d = [0u8; HEADER + TAG];
    d[0] = KIND_CREDIT;
    d[1..9].copy_from_slice(&ctr.to_le_bytes());
    d[9..17].copy_from_slice(&to.to_le_bytes());
    let (head, tag) = d.split_at_mut(HEADER);
    let t = key
        .seal_in_place_separate_tag(nonce(rank, KIND_CREDIT, ctr), Aad::from(&*head), &mut [0u8; 0][..])
        .map_err(|_| anyhow::anyhow!("seal"))?;
    tag.copy_from_slice(t.as_ref());
    shared.granted.store(to, Ordering::SeqCst);
    sock.send_to(&d, prev).context("send credit")?;
    Ok(())
}

/// The receiving thread: opens the previous node's datagrams in place and reduces or copies
/// each straight into the armed buffer, grants credit as it consumes, and takes the next
/// node's credit. Ends when `stop` is set.
fn receive(
    rank: usize,
    n: usize,
    prev: SocketAddr,
    sock: &UdpSocket,
    shared: &Shared,
    stop: &AtomicBool,
) -> Result<()> {
    let key = key();
    let prev_rank = (rank + n - 1) % n;
    let next_rank = (rank + 1) % n;
    let mut buf = vec![0u8; 65_536];
    let mut got: Vec<u64> = Vec::new();
    let mut armed: Option<(Armed, Layout)> = None;
    // The base of the allreduce last received in full (the main thread may not have
    // disarmed it yet).
    let mut finished: Option<u64> = None;
    let mut complete = false;
    let mut last = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if complete {
            armed = None;
            complete = false;
        }
        // A newly armed allreduce: its layout (the main thread granted its first window).
        let take_armed = |armed: &mut Option<(Armed, Layout)>, got: &mut Vec<u64>| {
            if armed.is_some() {
                return;
            }
            let a = *shared.armed.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(a) = a.filter(|a| Some(a.base) != finished) {
                let mut layout = Vec::new();
                let mut off = a.base;
                for s in 0..a.steps {
                    let r = chunk(recv_chunk(rank, n, s), n, a.elems);
                    layout.push((off, r.clone(), s < n - 1));
                    off += r.len() as u64;
                }
                *got = vec![0; a.steps];
                *armed = Some((a, layout));
            }
        };
        take_armed(&mut armed, &mut got);
        let (len, seg) = match recv_gro(sock, &mut buf) {
            Ok(Some(x)) => x,
            Ok(None) => {
                if last.elapsed() > STALL {
                    bail!("no datagram for {STALL:?}");
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        last = Instant::now();
        shared.calls.fetch_add(1, Ordering::Relaxed);
        shared.datagrams.fetch_add(len.div_ceil(seg.max(1)) as u64, Ordering::Relaxed);
        for d in buf[..len].chunks_mut(seg.max(1)) {
            ensure!(d.len() >= HEADER + TAG, "a runt datagram of {} bytes", d.len());
            let ctr = u64::from_le_bytes(d[1..9].try_into().expect("8 bytes"));
            let off = u64::from_le_bytes(d[9..17].try_into().expect("8 bytes"));
            let kind = d[0];
            let (head, rest) = d.split_at_mut(HEADER);
            let sender = if kind == KIND_CREDIT { next_rank } else { prev_rank };
            let body = key
                .open_in_place(nonce(sender, kind, ctr), Aad::from(&*head), rest)
                .map_err(|_| anyhow::anyhow!("a datagram that does not open"))?;
            if kind == KIND_CREDIT {
                shared.credit.fetch_max(off, Ordering::AcqRel);
                shared.notify();
                continue;
            }
            // Data can come only within credit, granted after the arming: look again.
            take_armed(&mut armed, &mut got);
            let Some((a, layout)) = &armed else { bail!("data outside an allreduce") };
            let end = off + body.len() as u64;
            let granted = shared.granted.load(Ordering::SeqCst);
            ensure!(end <= granted, "data past the credit granted");
            let s = layout.partition_point(|(start, _, _)| *start <= off).checked_sub(1);
            let Some(s) = s else { bail!("data before the allreduce's stream") };
            let (start, range, reduce) = &layout[s];
            let at = range.start + (off - start) as usize;
            ensure!(at + body.len() <= range.end, "a datagram across steps");
            // SAFETY: `at..at + len` lies in chunk `range` of the armed buffer, which no send
            // reads while its step's data still arrives.
            let dst = unsafe { std::slice::from_raw_parts_mut(a.ptr.add(at), body.len()) };
            if *reduce {
                super::tls_ring::add_f32(dst, body)?;
            } else {
                dst.copy_from_slice(body);
            }
            got[s] += body.len() as u64;
            let consumed = a.base + got.iter().sum::<u64>();
            let stream_end = layout.last().map_or(a.base, |(o, r, _)| o + r.len() as u64);
            if granted < stream_end && granted - consumed.min(granted) < WINDOW / 2 {
                grant(shared, sock, prev, &key, rank, (consumed + WINDOW).min(stream_end))?;
            }
            let done =
                got.iter().zip(layout.iter()).take_while(|(g, (_, r, _))| **g == r.len() as u64).count();
            if done > shared.done_steps.load(Ordering::Acquire) {
                shared.done_steps.store(done, Ordering::Release);
                shared.notify();
                if done == a.steps {
                    finished = Some(a.base);
                    complete = true;
                    break;
                }
            }
        }
    }
    Ok(())
}

/// Each step of an allreduce as its receiver sees it: where its bytes start in the stream,
/// the chunk they fill, and whether they are added (reduce-scatter) or copied (allgather).
type Layout = Vec<(u64, Range<usize>, bool)>;

/// One `recvmsg`: `Some((bytes, segment size))` (a GRO batch of equal datagrams, the last
/// possibly shorter), `None` on the read timeout.
fn recv_gro(sock: &UdpSocket, buf: &mut [u8]) -> Result<Option<(usize, usize)>> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut control = [0u64; 8];
    // SAFETY: msghdr points at live locals; the control message is read within its length.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&control);
        let r = libc::recvmsg(sock.as_raw_fd(), &mut msg, 0);
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Ok(None),
                std::io::ErrorKind::Interrupted => Ok(None),
                _ => Err(e).context("recvmsg"),
            };
        }
        let len = r as usize;
        let mut seg = len;
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == UDP_GRO {
                seg = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>()) as usize;
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        Ok(Some((len, seg)))
    }
}
