//! `libmeshd_preload.so`: loaded into every rank (`LD_PRELOAD`) when a job runs in tunnel
//! mode, it hands the TCP connections a rank opens to other roster nodes to the node's
//! meshd, which carries them over its authenticated QUIC connections (docs/PROTOCOL.md,
//! "The TCP tunnel").
//!
//! `connect(fd, addr)` for an `AF_INET`/`AF_INET6` TCP socket whose address is one of
//! `MESHD_TUNNEL_PEERS` (the other roster nodes' addresses) does not reach the network:
//! it connects a new Unix stream socket to `MESHD_TUNNEL` (meshd's tunnel socket), sends
//! the destination, reads one status byte and, on success, puts that Unix socket in place
//! of `fd` (`dup3`, keeping `O_NONBLOCK` and `FD_CLOEXEC` as they were): the application's
//! fd now carries the stream. A refusal reads as `ECONNREFUSED`, a peer that cannot be
//! reached as `EHOSTUNREACH`, no answer as `ETIMEDOUT`; never a hang (a deadline bounds
//! every step). Everything else goes to the real `connect` untouched.
//!
//! On a tunnelled fd, `getpeername` answers the destination (the application's own
//! sockaddr), `getsockname` this node's address (`MESHD_NODE_ADDR`, in the socket's
//! family), `SO_DOMAIN` the socket's family before the swap, and `setsockopt`/`getsockopt`
//! at the `IPPROTO_TCP` level (`TCP_NODELAY`, keep-alive tuning) succeed without effect: a
//! Unix socket has no Nagle.
//!
//! A reset reads as a reset. A Unix socket has no RST: when meshd drops its end because the
//! tunnelled connection failed (the far end reset it, the far node or this node's meshd is
//! gone), the rank's reads see end of file and its writes `EPIPE`. meshd closes its end
//! before the application's own end of file only on a failure (on a clean end it
//! half-closes and waits for the application's), so a read that returns 0 on a tunnelled fd
//! whose peer is gone entirely (`POLLHUP`), and whose write side the application did not
//! shut down itself, is a reset: it returns -1 with `ECONNRESET`, as TCP does after an RST,
//! once; a write's first `EPIPE` there does the same. After an end of file the application
//! already read, a failure stays `EPIPE` (TCP's answer to an RST in `CLOSE_WAIT`).
//!
//! No dependencies but the C library, which this file declares itself: meshd's build
//! script compiles it with `rustc` alone (`panic=abort`). Nothing here panics on input;
//! shared state is behind a `OnceLock` and a `Mutex`.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
compile_error!("meshd-preload declares Linux x86_64/aarch64 constants by hand");

type socklen_t = u32;

const AF_UNIX: c_int = 1;
const AF_INET: c_int = 2;
const AF_INET6: c_int = 10;
const SOCK_STREAM: c_int = 1;
const SOCK_CLOEXEC: c_int = 0o2_000_000;
const SOL_SOCKET: c_int = 1;
const SO_TYPE: c_int = 3;
const SO_SNDBUF: c_int = 7;
const SO_ERROR: c_int = 4;
const SO_RCVTIMEO: c_int = 20;
const SO_SNDTIMEO: c_int = 21;
const SO_PROTOCOL: c_int = 38;
const SO_DOMAIN: c_int = 39;
const SO_COOKIE: c_int = 57;
const SHUT_WR: c_int = 1;
const SHUT_RDWR: c_int = 2;
const POLLHUP: i16 = 0x10;
const IPPROTO_TCP: c_int = 6;
const F_GETFD: c_int = 1;
const F_GETFL: c_int = 3;
const F_SETFL: c_int = 4;
const FD_CLOEXEC: c_int = 1;
const O_NONBLOCK: c_int = 0o4000;
const O_CLOEXEC: c_int = 0o2_000_000;
const EINTR: c_int = 4;
const ECONNREFUSED: c_int = 111;
const ETIMEDOUT: c_int = 110;
const EHOSTUNREACH: c_int = 113;
const ECONNRESET: c_int = 104;
const EPIPE: c_int = 32;

#[repr(C)]
struct sockaddr_in {
    sin_family: u16,
    sin_port: u16,
    sin_addr: [u8; 4],
    sin_zero: [u8; 8],
}

#[repr(C)]
struct sockaddr_in6 {
    sin6_family: u16,
    sin6_port: u16,
    sin6_flowinfo: u32,
    sin6_addr: [u8; 16],
    sin6_scope_id: u32,
}

#[repr(C)]
struct sockaddr_un {
    sun_family: u16,
    sun_path: [u8; 108],
}

#[repr(C)]
struct pollfd {
    fd: c_int,
    events: i16,
    revents: i16,
}

/// The C library's `struct iovec` (the interposed `readv`/`writev` take it).
#[repr(C)]
#[derive(Debug)]
pub struct iovec {
    base: *mut c_void,
    len: usize,
}

/// The C library's `struct msghdr` (the interposed `recvmsg`/`sendmsg` take it).
#[repr(C)]
#[derive(Debug)]
pub struct msghdr {
    name: *mut c_void,
    namelen: socklen_t,
    iov: *mut iovec,
    iovlen: usize,
    control: *mut c_void,
    controllen: usize,
    flags: c_int,
}

#[repr(C)]
struct timeval {
    tv_sec: i64,
    tv_usec: i64,
}

unsafe extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, ...) -> c_int;
    fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int;
    fn close(fd: c_int) -> c_int;
    fn poll(fds: *mut pollfd, n: u64, timeout: c_int) -> c_int;
    fn __errno_location() -> *mut c_int;
}

/// glibc's `RTLD_NEXT`: the next object after this one in the search order.
const RTLD_NEXT: *mut c_void = -1isize as *mut c_void;

// ---- The wire of the tunnel socket (meshd's `tunnel` module speaks the other end). ----

/// First bytes of a request on the tunnel socket.
pub const MAGIC: [u8; 2] = *b"MT";
/// Version of the request.
pub const VERSION: u8 = 1;
/// Request length: magic, version, family (4 or 6), port (u16 BE), address (16 bytes,
/// IPv4 as IPv4-mapped IPv6).
pub const REQUEST_LEN: usize = 22;

/// The one status byte meshd answers.
pub mod status {
    /// Connected: the stream follows.
    pub const OK: u8 = 0;
    /// The destination refused the connection (nothing listens there).
    pub const REFUSED: u8 = 1;
    /// The destination node cannot be reached (not a roster node, its meshd is gone).
    pub const UNREACHABLE: u8 = 2;
    /// No answer in time.
    pub const TIMED_OUT: u8 = 3;
    /// Any other failure (reset, limits).
    pub const FAILED: u8 = 4;
}

/// The request for `dest`.
pub fn encode_request(dest: SocketAddr) -> [u8; REQUEST_LEN] {
    let mut r = [0u8; REQUEST_LEN];
    r[..2].copy_from_slice(&MAGIC);
    r[2] = VERSION;
    let (family, ip) = match dest.ip() {
        IpAddr::V4(v4) => (4, v4.to_ipv6_mapped()),
        IpAddr::V6(v6) => (6, v6),
    };
    r[3] = family;
    r[4..6].copy_from_slice(&dest.port().to_be_bytes());
    r[6..22].copy_from_slice(&ip.octets());
    r
}

/// The destination of a request, or `None` when it is not one.
pub fn decode_request(r: &[u8; REQUEST_LEN]) -> Option<SocketAddr> {
    if r[..2] != MAGIC || r[2] != VERSION {
        return None;
    }
    let port = u16::from_be_bytes([r[4], r[5]]);
    let mut ip = [0u8; 16];
    ip.copy_from_slice(&r[6..22]);
    let ip = Ipv6Addr::from(ip);
    let ip = match r[3] {
        4 => IpAddr::V4(ip.to_ipv4_mapped()?),
        6 => IpAddr::V6(ip),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The errno an application sees for a status byte.
pub fn status_errno(s: u8) -> c_int {
    match s {
        status::REFUSED => ECONNREFUSED,
        status::UNREACHABLE => EHOSTUNREACH,
        status::TIMED_OUT => ETIMEDOUT,
        _ => ECONNRESET,
    }
}

/// `MESHD_TUNNEL_PEERS`: comma-separated addresses (IPv4-mapped IPv6 reads as IPv4);
/// what does not parse is skipped.
pub fn parse_peers(s: &str) -> Vec<IpAddr> {
    s.split(',').filter_map(|p| p.trim().parse::<IpAddr>().ok()).map(|ip| ip.to_canonical()).collect()
}

// ---- State ----

struct Config {
    /// `MESHD_TUNNEL`, as a ready `sockaddr_un` and its length.
    path: Option<(sockaddr_un, socklen_t)>,
    peers: Vec<IpAddr>,
    /// This node's address (`getsockname` of a tunnelled fd).
    node: Option<IpAddr>,
    timeout: Duration,
    debug: bool,
}

fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let path = var("MESHD_TUNNEL").and_then(|p| {
            let bytes = p.as_bytes();
            if bytes.len() >= 108 {
                return None;
            }
            let mut a = sockaddr_un { sun_family: AF_UNIX as u16, sun_path: [0; 108] };
            a.sun_path[..bytes.len()].copy_from_slice(bytes);
            Some((a, (2 + bytes.len() + 1) as socklen_t))
        });
        Config {
            path,
            peers: var("MESHD_TUNNEL_PEERS").map(|s| parse_peers(&s)).unwrap_or_default(),
            node: var("MESHD_NODE_ADDR").and_then(|s| s.parse::<IpAddr>().ok()),
            timeout: var("MESHD_TUNNEL_TIMEOUT_MS")
                .and_then(|s| s.parse().ok())
                .map(Duration::from_millis)
                .unwrap_or(Duration::from_secs(30)),
            debug: var("MESHD_TUNNEL_DEBUG").is_some_and(|v| v != "0"),
        }
    })
}

/// A tunnelled fd: the socket cookie (tells a closed and reused fd number from the socket
/// that was put there, and finds the socket under any fd number `dup` gave it), the
/// socket's domain before the swap, the address the application passed to `connect`, byte
/// for byte (what `getpeername` answers), and what a reset must know: whether the
/// application shut its write side down, read an end of file, or was told of a reset.
#[derive(Clone, Copy, Debug)]
struct Tunnelled {
    fd: c_int,
    cookie: u64,
    domain: c_int,
    peer: [u8; 28],
    peer_len: usize,
    shut_wr: bool,
    eof_seen: bool,
    reset_told: bool,
}

static TUNNELLED: Mutex<Vec<Tunnelled>> = Mutex::new(Vec::new());
static ANY_TUNNELLED: AtomicUsize = AtomicUsize::new(0);

fn tunnelled() -> std::sync::MutexGuard<'static, Vec<Tunnelled>> {
    TUNNELLED.lock().unwrap_or_else(|p| p.into_inner())
}

fn remember(t: Tunnelled) {
    let mut all = tunnelled();
    all.retain(|x| x.fd != t.fd);
    all.push(t);
    ANY_TUNNELLED.store(all.len(), Ordering::Release);
}

fn forget(fd: c_int) {
    let mut all = tunnelled();
    all.retain(|x| x.fd != fd);
    ANY_TUNNELLED.store(all.len(), Ordering::Release);
}

/// What `fd` was tunnelled as, if it still holds that socket. Lock-free while no fd was
/// ever tunnelled (a forked child never waits on a lock held at the fork for that).
fn tunnel_of(fd: c_int) -> Option<Tunnelled> {
    if ANY_TUNNELLED.load(Ordering::Acquire) == 0 {
        return None;
    }
    let t = tunnelled().iter().find(|x| x.fd == fd).copied()?;
    if socket_cookie(fd) == Some(t.cookie) {
        Some(t)
    } else {
        forget(fd);
        None
    }
}

/// Runs `f` on the entry of the socket `fd` holds (by cookie: any fd number of it), if it
/// was tunnelled. Lock-free while no fd was ever tunnelled. It runs on every end of file
/// a process reads, also in a child forked while another thread held the lock (which no
/// one would ever release there): it gives up after about a millisecond instead of waiting.
fn with_socket<T>(fd: c_int, f: impl FnOnce(&mut Tunnelled) -> T) -> Option<T> {
    if ANY_TUNNELLED.load(Ordering::Acquire) == 0 {
        return None;
    }
    let cookie = socket_cookie(fd)?;
    for _ in 0..1000 {
        match TUNNELLED.try_lock() {
            Ok(mut all) => return all.iter_mut().find(|x| x.cookie == cookie).map(f),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                return p.into_inner().iter_mut().find(|x| x.cookie == cookie).map(f);
            }
            Err(std::sync::TryLockError::WouldBlock) => std::thread::sleep(Duration::from_micros(1)),
        }
    }
    None
}

/// Whether meshd's end of the Unix socket `fd` is gone entirely (closed, not half-closed).
fn peer_gone(fd: c_int) -> bool {
    let mut p = pollfd { fd, events: 0, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    unsafe { poll(&mut p, 1, 0) == 1 && p.revents & POLLHUP != 0 }
}

/// After a read-like call on `fd` returned `rc` (with `wanted` bytes room): an end of file
/// that is a reset becomes -1/`ECONNRESET` (see the crate's doc); other ends of file are
/// remembered. Only a 0 or an error costs anything.
fn after_read(fd: c_int, rc: isize, wanted: usize) -> isize {
    if rc > 0 || wanted == 0 {
        return rc;
    }
    let saved = errno();
    let e = if rc < 0 { saved } else { 0 };
    if rc < 0 && e != ECONNRESET {
        return rc;
    }
    let reset = with_socket(fd, |t| {
        if t.reset_told || t.eof_seen || t.shut_wr {
            return false;
        }
        if e == ECONNRESET || peer_gone(fd) {
            // A kernel ECONNRESET (meshd closed with the application's bytes unread) is
            // the one report; a 0 with meshd gone becomes it.
            t.reset_told = true;
            e == 0
        } else {
            t.eof_seen = true;
            false
        }
    });
    if reset == Some(true) {
        set_errno(ECONNRESET);
        return -1;
    }
    set_errno(saved);
    rc
}

/// After a write-like call on `fd` returned `rc`: the first `EPIPE` of a reset becomes
/// `ECONNRESET` (see the crate's doc).
fn after_write(fd: c_int, rc: isize) -> isize {
    if rc >= 0 || errno() != EPIPE {
        return rc;
    }
    let reset = with_socket(fd, |t| {
        let first = !(t.reset_told || t.eof_seen || t.shut_wr);
        t.reset_told = true;
        first
    });
    if reset == Some(true) {
        // The kernel's own ECONNRESET may be pending (meshd closed with bytes of ours
        // unread); this report is the one, as TCP's: reading SO_ERROR clears it.
        let _ = get_int_opt(fd, SOL_SOCKET, SO_ERROR);
    }
    set_errno(if reset == Some(true) { ECONNRESET } else { EPIPE });
    rc
}

// ---- The real functions ----

type ConnectFn = unsafe extern "C" fn(c_int, *const c_void, socklen_t) -> c_int;
type NameFn = unsafe extern "C" fn(c_int, *mut c_void, *mut socklen_t) -> c_int;
type SetOptFn = unsafe extern "C" fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int;
type GetOptFn = unsafe extern "C" fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int;
type ReadFn = unsafe extern "C" fn(c_int, *mut c_void, usize) -> isize;
type WriteFn = unsafe extern "C" fn(c_int, *const c_void, usize) -> isize;
type ReadvFn = unsafe extern "C" fn(c_int, *const iovec, c_int) -> isize;
type RecvFn = unsafe extern "C" fn(c_int, *mut c_void, usize, c_int) -> isize;
type RecvFromFn =
    unsafe extern "C" fn(c_int, *mut c_void, usize, c_int, *mut c_void, *mut socklen_t) -> isize;
type RecvMsgFn = unsafe extern "C" fn(c_int, *mut msghdr, c_int) -> isize;
type SendFn = unsafe extern "C" fn(c_int, *const c_void, usize, c_int) -> isize;
type SendToFn = unsafe extern "C" fn(c_int, *const c_void, usize, c_int, *const c_void, socklen_t) -> isize;
type SendMsgFn = unsafe extern "C" fn(c_int, *const msghdr, c_int) -> isize;
type ShutdownFn = unsafe extern "C" fn(c_int, c_int) -> c_int;
type ReadChkFn = unsafe extern "C" fn(c_int, *mut c_void, usize, usize) -> isize;
type RecvChkFn = unsafe extern "C" fn(c_int, *mut c_void, usize, usize, c_int) -> isize;
type RecvFromChkFn =
    unsafe extern "C" fn(c_int, *mut c_void, usize, usize, c_int, *mut c_void, *mut socklen_t) -> isize;

/// Looks `name` (NUL-terminated) up after this library, once.
fn next(cache: &AtomicPtr<c_void>, name: &[u8]) -> *mut c_void {
    let p = cache.load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    // SAFETY: `name` is a NUL-terminated literal; dlsym is thread-safe.
    let p = unsafe { dlsym(RTLD_NEXT, name.as_ptr().cast()) };
    cache.store(p, Ordering::Release);
    p
}

macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static CACHE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
        let p = next(&CACHE, concat!($name, "\0").as_bytes());
        if p.is_null() {
            None
        } else {
            // SAFETY: dlsym returned the C library's function of that name, whose C
            // signature is `$ty`.
            Some(unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
        }
    }};
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno, always valid.
    unsafe { *__errno_location() = e };
}

fn errno() -> c_int {
    // SAFETY: as in set_errno.
    unsafe { *__errno_location() }
}

fn say(msg: &str) {
    let line = format!("meshd-preload[{}]: {msg}\n", std::process::id());
    if let Some(w) = real!("write", WriteFn) {
        // SAFETY: writing a valid buffer to stderr; a failure is ignored.
        let _ = unsafe { w(2, line.as_ptr().cast(), line.len()) };
    }
}

fn get_int_opt(fd: c_int, level: c_int, name: c_int) -> Option<c_int> {
    let f = real!("getsockopt", GetOptFn)?;
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: a valid int buffer and its length.
    let rc = unsafe { f(fd, level, name, (&mut v as *mut c_int).cast(), &mut len) };
    (rc == 0).then_some(v)
}

fn socket_cookie(fd: c_int) -> Option<u64> {
    let f = real!("getsockopt", GetOptFn)?;
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as socklen_t;
    // SAFETY: a valid u64 buffer and its length.
    let rc = unsafe { f(fd, SOL_SOCKET, SO_COOKIE, (&mut v as *mut u64).cast(), &mut len) };
    (rc == 0).then_some(v)
}

fn set_timeouts(fd: c_int, t: Duration) {
    let Some(f) = real!("setsockopt", SetOptFn) else { return };
    let tv = timeval { tv_sec: t.as_secs() as i64, tv_usec: t.subsec_micros() as i64 };
    for opt in [SO_RCVTIMEO, SO_SNDTIMEO] {
        // SAFETY: a valid timeval and its size.
        unsafe {
            f(
                fd,
                SOL_SOCKET,
                opt,
                (&tv as *const timeval).cast(),
                std::mem::size_of::<timeval>() as socklen_t,
            )
        };
    }
}

/// The destination of a `connect` call, when it is an IP address.
///
/// # Safety
/// `addr` must be valid for `len` bytes (the caller's contract with `connect`).
unsafe fn ip_destination(addr: *const c_void, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < 2 {
        return None;
    }
    // SAFETY: at least 2 readable bytes; read unaligned (a sockaddr may be any buffer).
    let family = unsafe { std::ptr::read_unaligned(addr.cast::<u16>()) } as c_int;
    match family {
        AF_INET if len as usize >= std::mem::size_of::<sockaddr_in>() => {
            // SAFETY: len covers a sockaddr_in.
            let a = unsafe { std::ptr::read_unaligned(addr.cast::<sockaddr_in>()) };
            Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(a.sin_addr)), u16::from_be(a.sin_port)))
        }
        AF_INET6 if len as usize >= std::mem::size_of::<sockaddr_in6>() => {
            // SAFETY: len covers a sockaddr_in6.
            let a = unsafe { std::ptr::read_unaligned(addr.cast::<sockaddr_in6>()) };
            let ip = Ipv6Addr::from(a.sin6_addr).to_canonical();
            Some(SocketAddr::new(ip, u16::from_be(a.sin6_port)))
        }
        _ => None,
    }
}

/// Reads exactly `buf.len()` bytes before `deadline` (the socket has SO_RCVTIMEO).
fn read_full(fd: c_int, buf: &mut [u8], deadline: Instant) -> Result<(), c_int> {
    let read = real!("read", ReadFn).ok_or(ECONNRESET)?;
    let mut got = 0;
    while got < buf.len() {
        let rest = &mut buf[got..];
        // SAFETY: `rest` is a valid writable buffer of its length.
        let n = unsafe { read(fd, rest.as_mut_ptr().cast(), rest.len()) };
        if n > 0 {
            got += n as usize;
        } else if n == 0 {
            return Err(ECONNRESET);
        } else if errno() != EINTR || Instant::now() > deadline {
            return Err(if errno() == EINTR { ETIMEDOUT } else { errno() });
        }
    }
    Ok(())
}

fn write_full(fd: c_int, buf: &[u8], deadline: Instant) -> Result<(), c_int> {
    let write = real!("write", WriteFn).ok_or(ECONNRESET)?;
    let mut sent = 0;
    while sent < buf.len() {
        let rest = &buf[sent..];
        // SAFETY: `rest` is a valid buffer of its length.
        let n = unsafe { write(fd, rest.as_ptr().cast(), rest.len()) };
        if n > 0 {
            sent += n as usize;
        } else if n < 0 && (errno() != EINTR || Instant::now() > deadline) {
            return Err(errno());
        }
    }
    Ok(())
}

/// Asks meshd for a stream to `dest` and puts it in place of `fd`; `peer` is the address
/// as the application gave it. `Err(errno)` on failure.
fn tunnel(fd: c_int, dest: SocketAddr, peer: &[u8], cfg: &Config) -> Result<(), c_int> {
    static SAID: AtomicBool = AtomicBool::new(false);
    let Some((path, path_len)) = &cfg.path else {
        if !SAID.swap(true, Ordering::Relaxed) {
            say("MESHD_TUNNEL_PEERS is set but MESHD_TUNNEL is not: connections to other nodes are refused");
        }
        return Err(ECONNREFUSED);
    };
    let real_connect = real!("connect", ConnectFn).ok_or(ECONNREFUSED)?;
    let deadline = Instant::now() + cfg.timeout;
    // SAFETY: plain socket creation.
    let s = unsafe { socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0) };
    if s < 0 {
        return Err(errno());
    }
    let fail = |e: c_int| {
        // SAFETY: `s` is our own socket, closed once.
        unsafe { close(s) };
        Err(e)
    };
    set_timeouts(s, cfg.timeout);
    // A Unix socket's queue is bounded by the sender's buffer (208 KiB by default, not
    // grown as TCP's): 4 MiB, as TCP's `tcp_wmem`, capped by `net.core.wmem_max`.
    if let Some(f) = real!("setsockopt", SetOptFn) {
        let v: c_int = 4 << 20;
        // SAFETY: a valid int and its size.
        unsafe {
            f(
                s,
                SOL_SOCKET,
                SO_SNDBUF,
                (&v as *const c_int).cast(),
                std::mem::size_of::<c_int>() as socklen_t,
            )
        };
    }
    // SAFETY: `path` is a valid sockaddr_un of `path_len` bytes.
    if unsafe { real_connect(s, (path as *const sockaddr_un).cast(), *path_len) } != 0 {
        let e = errno();
        if !SAID.swap(true, Ordering::Relaxed) {
            say(&format!(
                "cannot reach meshd's tunnel socket (MESHD_TUNNEL): errno {e}; connections to other nodes are refused"
            ));
        }
        return fail(ECONNREFUSED);
    }
    if let Err(e) = write_full(s, &encode_request(dest), deadline) {
        return fail(if e == 0 { ECONNRESET } else { e });
    }
    let mut st = [0u8; 1];
    if let Err(e) = read_full(s, &mut st, deadline) {
        // EAGAIN/EWOULDBLOCK: SO_RCVTIMEO expired.
        return fail(if e == 11 { ETIMEDOUT } else { e });
    }
    if st[0] != status::OK {
        return fail(status_errno(st[0]));
    }
    set_timeouts(s, Duration::ZERO);
    // The application's fd keeps its flags: O_NONBLOCK lives on the open file (set it on
    // the Unix socket), FD_CLOEXEC on the descriptor (dup3's flag).
    // SAFETY: fcntl on fds this call holds.
    unsafe {
        let fl = fcntl(fd, F_GETFL);
        if fl >= 0 && fl & O_NONBLOCK != 0 {
            let mine = fcntl(s, F_GETFL);
            fcntl(s, F_SETFL, mine.max(0) | O_NONBLOCK);
        }
    }
    // SAFETY: as above.
    let cloexec = unsafe { fcntl(fd, F_GETFD) };
    let flags = if cloexec >= 0 && cloexec & FD_CLOEXEC != 0 { O_CLOEXEC } else { 0 };
    let cookie = socket_cookie(s);
    let domain = get_int_opt(fd, SOL_SOCKET, SO_DOMAIN).unwrap_or(AF_INET);
    // SAFETY: replaces the application's unconnected socket by ours at the same number.
    if unsafe { dup3(s, fd, flags) } < 0 {
        let e = errno();
        return fail(e);
    }
    // SAFETY: `s` is ours; `fd` now holds the socket.
    unsafe { close(s) };
    if let Some(cookie) = cookie {
        let mut t = Tunnelled {
            fd,
            cookie,
            domain,
            peer: [0; 28],
            peer_len: peer.len().min(28),
            shut_wr: false,
            eof_seen: false,
            reset_told: false,
        };
        t.peer[..t.peer_len].copy_from_slice(&peer[..t.peer_len]);
        remember(t);
    }
    Ok(())
}

/// Whether `fd` is a TCP socket.
fn is_tcp(fd: c_int) -> bool {
    get_int_opt(fd, SOL_SOCKET, SO_TYPE) == Some(SOCK_STREAM)
        && matches!(get_int_opt(fd, SOL_SOCKET, SO_PROTOCOL), Some(0) | Some(IPPROTO_TCP))
        && matches!(get_int_opt(fd, SOL_SOCKET, SO_DOMAIN), Some(AF_INET) | Some(AF_INET6))
}

/// `connect(2)`, interposed.
///
/// # Safety
/// The caller's contract with `connect`: `addr` valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const c_void, len: socklen_t) -> c_int {
    // SAFETY: the caller's contract.
    let dest = unsafe { ip_destination(addr, len) };
    if let Some(dest) = dest {
        let cfg = config();
        if cfg.peers.contains(&dest.ip()) && is_tcp(fd) {
            if cfg.debug {
                say(&format!("connect {dest} through meshd"));
            }
            // SAFETY: the caller's contract: `addr` is valid for `len` bytes (at least the
            // sockaddr ip_destination read).
            let peer = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), (len as usize).min(28)) };
            return match tunnel(fd, dest, peer, cfg) {
                Ok(()) => 0,
                Err(e) => {
                    if cfg.debug {
                        say(&format!("connect {dest}: errno {e}"));
                    }
                    set_errno(e);
                    -1
                }
            };
        }
    }
    // A reused fd number is told apart by its socket cookie: nothing to forget here (and
    // no lock on the path of every other connect).
    match real!("connect", ConnectFn) {
        // SAFETY: forwarding the caller's arguments.
        Some(f) => unsafe { f(fd, addr, len) },
        None => {
            set_errno(ECONNREFUSED);
            -1
        }
    }
}

/// Writes `a` to a caller's (`addr`, `len`) pair as the kernel would (truncated to the
/// buffer, `*len` set to the full size).
///
/// # Safety
/// `addr` valid for `*len` bytes, `len` valid.
unsafe fn write_name(a: SocketAddr, addr: *mut c_void, len: *mut socklen_t) -> c_int {
    let mut buf = [0u8; 28];
    let full = match a {
        SocketAddr::V4(v4) => {
            let s = sockaddr_in {
                sin_family: AF_INET as u16,
                sin_port: v4.port().to_be(),
                sin_addr: v4.ip().octets(),
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in is 16 plain bytes, buf holds 28.
            unsafe { std::ptr::write_unaligned(buf.as_mut_ptr().cast(), s) };
            std::mem::size_of::<sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let s = sockaddr_in6 {
                sin6_family: AF_INET6 as u16,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: v6.ip().octets(),
                sin6_scope_id: 0,
            };
            // SAFETY: sockaddr_in6 is 28 plain bytes.
            unsafe { std::ptr::write_unaligned(buf.as_mut_ptr().cast(), s) };
            std::mem::size_of::<sockaddr_in6>()
        }
    };
    // SAFETY: the caller's contract.
    unsafe { write_raw(&buf[..full], addr, len) }
}

/// Copies `bytes` to a caller's (`addr`, `len`) pair as the kernel would.
///
/// # Safety
/// `addr` valid for `*len` bytes, `len` valid.
unsafe fn write_raw(bytes: &[u8], addr: *mut c_void, len: *mut socklen_t) -> c_int {
    if len.is_null() {
        set_errno(14); // EFAULT
        return -1;
    }
    // SAFETY: the caller's contract: `len` valid, `addr` valid for `*len` bytes.
    unsafe {
        let room = (*len as usize).min(bytes.len());
        if !addr.is_null() {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr.cast::<u8>(), room);
        }
        *len = bytes.len() as socklen_t;
    }
    0
}

/// `getpeername(2)`, interposed: a tunnelled fd's peer is its destination.
///
/// # Safety
/// The caller's contract with `getpeername`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut c_void, len: *mut socklen_t) -> c_int {
    if let Some(t) = tunnel_of(fd) {
        // SAFETY: the caller's contract.
        return unsafe { write_raw(&t.peer[..t.peer_len], addr, len) };
    }
    match real!("getpeername", NameFn) {
        // SAFETY: forwarding the caller's arguments.
        Some(f) => unsafe { f(fd, addr, len) },
        None => -1,
    }
}

/// `getsockname(2)`, interposed: a tunnelled fd's own address is this node's (port 0
/// when unknown: the local end of the stream is meshd's).
///
/// # Safety
/// The caller's contract with `getsockname`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut c_void, len: *mut socklen_t) -> c_int {
    if let Some(t) = tunnel_of(fd) {
        // In the socket's own family (an AF_INET6 socket gets an IPv4-mapped address).
        let ip = match (config().node, t.domain) {
            (Some(IpAddr::V4(v4)), AF_INET6) => IpAddr::V6(v4.to_ipv6_mapped()),
            (Some(ip), _) => ip,
            (None, AF_INET6) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            (None, _) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        };
        // SAFETY: the caller's contract.
        return unsafe { write_name(SocketAddr::new(ip, 0), addr, len) };
    }
    match real!("getsockname", NameFn) {
        // SAFETY: forwarding the caller's arguments.
        Some(f) => unsafe { f(fd, addr, len) },
        None => -1,
    }
}

/// `setsockopt(2)`, interposed: TCP-level options on a tunnelled fd succeed and do nothing.
///
/// # Safety
/// The caller's contract with `setsockopt`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if level == IPPROTO_TCP && tunnel_of(fd).is_some() {
        return 0;
    }
    match real!("setsockopt", SetOptFn) {
        // SAFETY: forwarding the caller's arguments.
        Some(f) => unsafe { f(fd, level, name, val, len) },
        None => -1,
    }
}

/// `getsockopt(2)`, interposed: TCP-level options of a tunnelled fd read as 0, and its
/// domain as the destination's family.
///
/// # Safety
/// The caller's contract with `getsockopt`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let fake = if level == IPPROTO_TCP || (level == SOL_SOCKET && name == SO_DOMAIN) {
        tunnel_of(fd).map(|t| if level == IPPROTO_TCP { 0 } else { t.domain })
    } else {
        None
    };
    if let Some(v) = fake {
        if val.is_null() || len.is_null() {
            set_errno(14);
            return -1;
        }
        // SAFETY: the caller's contract: `len` valid, `val` valid for `*len` bytes.
        unsafe {
            let bytes = v.to_ne_bytes();
            let room = (*len as usize).min(bytes.len());
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), val.cast::<u8>(), room);
            *len = room as socklen_t;
        }
        return 0;
    }
    match real!("getsockopt", GetOptFn) {
        // SAFETY: forwarding the caller's arguments.
        Some(f) => unsafe { f(fd, level, name, val, len) },
        None => -1,
    }
}

/// Sums the lengths of `n` iovecs (0 for a bad pointer or count).
///
/// # Safety
/// `iov` valid for `n` entries when not null.
unsafe fn iov_len(iov: *const iovec, n: c_int) -> usize {
    if iov.is_null() || n <= 0 {
        return 0;
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(iov, n as usize) }.iter().fold(0usize, |a, v| a.saturating_add(v.len))
}

macro_rules! call_real {
    ($name:literal, $ty:ty, $($arg:expr),*) => {
        match real!($name, $ty) {
            // SAFETY: forwarding the caller's arguments to the C library's function.
            Some(f) => unsafe { f($($arg),*) },
            None => {
                set_errno(38); // ENOSYS
                -1
            }
        }
    };
}

/// `read(2)`, interposed: see [`after_read`].
///
/// # Safety
/// The caller's contract with `read`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize {
    after_read(fd, call_real!("read", ReadFn, fd, buf, n), n)
}

/// `__read_chk` (`read` under `_FORTIFY_SOURCE`), interposed: see [`after_read`].
///
/// # Safety
/// The caller's contract with `__read_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, n: usize, room: usize) -> isize {
    after_read(fd, call_real!("__read_chk", ReadChkFn, fd, buf, n, room), n)
}

/// `readv(2)`, interposed: see [`after_read`].
///
/// # Safety
/// The caller's contract with `readv`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, n: c_int) -> isize {
    let rc = call_real!("readv", ReadvFn, fd, iov, n);
    // SAFETY: the caller's contract.
    after_read(fd, rc, if rc == 0 { unsafe { iov_len(iov, n) } } else { 1 })
}

/// `recv(2)`, interposed: see [`after_read`].
///
/// # Safety
/// The caller's contract with `recv`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: usize, flags: c_int) -> isize {
    after_read(fd, call_real!("recv", RecvFn, fd, buf, n, flags), n)
}

/// `__recv_chk`, interposed: see [`after_read`].
///
/// # Safety
/// The caller's contract with `__recv_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    room: usize,
    flags: c_int,
) -> isize {
    after_read(fd, call_real!("__recv_chk", RecvChkFn, fd, buf, n, room, flags), n)
}

/// `recvfrom(2)`, interposed: see [`after_read`].
///
/// # Safety
/// The caller's contract with `recvfrom`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    flags: c_int,
    addr: *mut c_void,
    len: *mut socklen_t,
) -> isize {
    after_read(fd, call_real!("recvfrom", RecvFromFn, fd, buf, n, flags, addr, len), n)
}

/// `__recvfrom_chk`, interposed: see [`after_read`].
///
/// # Safety
/// The caller's contract with `__recvfrom_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    room: usize,
    flags: c_int,
    addr: *mut c_void,
    len: *mut socklen_t,
) -> isize {
    after_read(fd, call_real!("__recvfrom_chk", RecvFromChkFn, fd, buf, n, room, flags, addr, len), n)
}

/// `recvmsg(2)`, interposed: see [`after_read`].
///
/// # Safety
/// The caller's contract with `recvmsg`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> isize {
    let rc = call_real!("recvmsg", RecvMsgFn, fd, msg, flags);
    // SAFETY: the caller's contract: `msg` valid when not null.
    let wanted =
        if rc != 0 || msg.is_null() { 1 } else { unsafe { iov_len((*msg).iov, (*msg).iovlen as c_int) } };
    after_read(fd, rc, wanted)
}

/// `write(2)`, interposed: see [`after_write`].
///
/// # Safety
/// The caller's contract with `write`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: usize) -> isize {
    after_write(fd, call_real!("write", WriteFn, fd, buf, n))
}

/// `writev(2)`, interposed: see [`after_write`].
///
/// # Safety
/// The caller's contract with `writev`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, n: c_int) -> isize {
    after_write(fd, call_real!("writev", ReadvFn, fd, iov, n))
}

/// `send(2)`, interposed: see [`after_write`].
///
/// # Safety
/// The caller's contract with `send`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: usize, flags: c_int) -> isize {
    after_write(fd, call_real!("send", SendFn, fd, buf, n, flags))
}

/// `sendto(2)`, interposed: see [`after_write`].
///
/// # Safety
/// The caller's contract with `sendto`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: usize,
    flags: c_int,
    addr: *const c_void,
    len: socklen_t,
) -> isize {
    after_write(fd, call_real!("sendto", SendToFn, fd, buf, n, flags, addr, len))
}

/// `sendmsg(2)`, interposed: see [`after_write`].
///
/// # Safety
/// The caller's contract with `sendmsg`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> isize {
    after_write(fd, call_real!("sendmsg", SendMsgFn, fd, msg, flags))
}

/// `shutdown(2)`, interposed: a tunnelled socket whose write side the application shut
/// down ends cleanly when meshd closes its end (no reset is reported).
///
/// # Safety
/// The caller's contract with `shutdown`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if how == SHUT_WR || how == SHUT_RDWR {
        with_socket(fd, |t| t.shut_wr = true);
    }
    match real!("shutdown", ShutdownFn) {
        // SAFETY: forwarding the caller's arguments.
        Some(f) => unsafe { f(fd, how) },
        None => -1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for d in ["198.19.0.7:29500", "[fd00::7]:40000", "10.0.0.1:1"] {
            let d: SocketAddr = d.parse().expect("addr");
            assert_eq!(decode_request(&encode_request(d)), Some(d));
        }
        let mut bad = encode_request("10.0.0.1:1".parse().expect("addr"));
        bad[2] = 9;
        assert_eq!(decode_request(&bad), None);
        let mut bad = encode_request("10.0.0.1:1".parse().expect("addr"));
        bad[3] = 5;
        assert_eq!(decode_request(&bad), None);
        // Family 4 with an address that is not IPv4-mapped.
        let mut bad = encode_request("[fd00::7]:1".parse().expect("addr"));
        bad[3] = 4;
        assert_eq!(decode_request(&bad), None);
    }

    #[test]
    fn peers_parse_and_skip_garbage() {
        assert_eq!(
            parse_peers("198.19.0.7, ::ffff:198.19.0.19,nonsense,,fd00::1"),
            vec![
                "198.19.0.7".parse::<IpAddr>().expect("ip"),
                "198.19.0.19".parse().expect("ip"),
                "fd00::1".parse().expect("ip")
            ]
        );
    }

    #[test]
    fn statuses_read_as_tcp_errors() {
        assert_eq!(status_errno(status::REFUSED), ECONNREFUSED);
        assert_eq!(status_errno(status::UNREACHABLE), EHOSTUNREACH);
        assert_eq!(status_errno(status::TIMED_OUT), ETIMEDOUT);
        assert_eq!(status_errno(200), ECONNRESET);
    }
}
