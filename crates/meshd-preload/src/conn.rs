//! `connect`: the swap, and the connect's outcome (meshd's status byte) as TCP reports it.
//!
//! The swap is immediate and local: a Unix socket, bound to the name that says what it
//! stands for ([`crate::ident`]), connects to meshd's tunnel socket, sends the padded
//! request ([`crate::wire::encode_padded_request`]), takes the TCP socket's options
//! ([`crate::opts`]) and its send buffer at the minimum, and is put in place of the
//! application's fd (`dup3`, `O_NONBLOCK` and `FD_CLOEXEC` kept). The far connect is
//! what takes time, and from there on the fd behaves as a TCP socket whose connect is in
//! progress: it polls not writable (meshd has not read the padding: the unread bytes fill
//! the minimal send buffer) until meshd has answered, and meshd writes its status byte
//! before it reads the padding, so once the fd polls writable (or hung up) the status is
//! there to read. A non-blocking `connect` returns `EINPROGRESS`; `SO_ERROR` answers 0
//! or the failure (once); a blocking one waits up to its `SO_SNDTIMEO` (then
//! `EINPROGRESS`, as the kernel's) or the tunnel's deadline (then `ETIMEDOUT`). The first
//! call that needs the outcome reads the status byte ([`settle`]): `SO_ERROR`, a read or
//! a write (which never see that byte), `connect` again (`EALREADY` while in progress, 0
//! once done, then `EISCONN`), `getpeername` (`ENOTCONN` until connected).

use std::ffi::{c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use crate::ident::{self, Addr, Identity};
use crate::opts;
use crate::sys::*;
use crate::table::{self, Phase, Slot};
use crate::wire::{self, status};
use crate::{Config, config};

/// The send buffer of the rank's end of its Unix socket when the application chose none.
/// A Unix socket's queue is bounded by the sender's buffer (208 KiB by default, not grown
/// as TCP's): 4 MiB, as TCP's `tcp_wmem`, capped by `net.core.wmem_max`.
pub const UNIX_SNDBUF: c_int = 4 << 20;

/// The outcome of a tunnelled socket's connect, as far as it is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Pending,
    Connected,
    /// Failed with `errno`; `told`: the application was told already.
    Failed {
        errno: c_int,
        told: bool,
    },
}

/// The destination of a `connect` call, when it is an IP address.
///
/// # Safety
/// `addr` must be valid for `len` bytes (the caller's contract with `connect`).
pub unsafe fn ip_destination(addr: *const c_void, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < 2 {
        return None;
    }
    // SAFETY: the caller's contract; at most 28 bytes, no more than `len`.
    let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), (len as usize).min(28)) };
    let a = Addr::from_sockaddr(bytes)?;
    let ip = if a.v6 {
        IpAddr::V6(Ipv6Addr::from(a.ip)).to_canonical()
    } else {
        IpAddr::V4(Ipv4Addr::new(a.ip[0], a.ip[1], a.ip[2], a.ip[3]))
    };
    Some(SocketAddr::new(ip, a.port))
}

/// Whether `fd` is a TCP socket.
pub fn is_tcp(fd: c_int) -> bool {
    get_int_opt(fd, SOL_SOCKET, SO_TYPE) == Some(SOCK_STREAM)
        && matches!(get_int_opt(fd, SOL_SOCKET, SO_PROTOCOL), Some(0) | Some(IPPROTO_TCP))
        && matches!(get_int_opt(fd, SOL_SOCKET, SO_DOMAIN), Some(AF_INET) | Some(AF_INET6))
}

/// What a tunnelled `fd` stands for (one real `getsockname`); `None` for any other fd.
pub fn identity_of(fd: c_int) -> Option<Identity> {
    let mut b = [0u8; 128];
    let n = sock_name(fd, &mut b)?;
    ident::decode(&b[..n])
}

/// Reads meshd's status byte without waiting: `Ok(Some(status))`, `Ok(None)` (not there
/// yet), `Err(errno)` (meshd closed without one, or the socket failed).
fn recv_status(fd: c_int) -> Result<Option<u8>, c_int> {
    let recv = real::recv().ok_or(ECONNRESET)?;
    let mut b = [0u8; 1];
    loop {
        // SAFETY: one writable byte.
        let n = unsafe { recv(fd, b.as_mut_ptr().cast(), 1, MSG_DONTWAIT) };
        match n {
            1 => return Ok(Some(b[0])),
            0 => return Err(ECONNRESET),
            _ if errno() == EINTR => continue,
            _ if errno() == EAGAIN => return Ok(None),
            _ => return Err(ECONNRESET),
        }
    }
}

/// The connect succeeded: the send buffer the socket keeps.
fn connected(fd: c_int, sndbuf: c_int) {
    let _ = set_int_opt(fd, SOL_SOCKET, SO_SNDBUF, if sndbuf > 0 { sndbuf } else { UNIX_SNDBUF });
}

fn outcome_of(p: Phase) -> Outcome {
    match p {
        Phase::Connected => Outcome::Connected,
        Phase::Failed { errno, told } => Outcome::Failed { errno, told },
        Phase::Pending | Phase::Consuming { .. } => Outcome::Pending,
    }
}

/// Reads the outcome of `fd`'s connect if it has arrived, without waiting. `slot`: the
/// socket's entry; a socket without one is connected (one known by its name only: its
/// connect completed where it was made).
pub fn try_settle(fd: c_int, slot: Option<&Slot>) -> Outcome {
    let Some(slot) = slot else { return Outcome::Connected };
    let me = pid();
    let mut spins = 0u32;
    loop {
        let s = slot.state();
        match table::phase(s) {
            Phase::Consuming { pid } if pid == me => {
                // Another thread is reading the byte (one non-blocking recv): bounded wait.
                spins += 1;
                if spins > 10_000 {
                    return Outcome::Pending;
                }
                table::spin();
            }
            Phase::Consuming { .. } => {
                // Forked while the parent's thread read the byte: the byte is the parent's
                // (its recv goes on, on the same socket); the peer still there says it was OK.
                let gone = poll_one(fd, 0, 0).is_ok_and(|r| r & POLLHUP != 0);
                let to =
                    if gone { Phase::Failed { errno: ECONNRESET, told: false } } else { Phase::Connected };
                slot.transition(s, to);
            }
            Phase::Pending => {
                if !slot.transition(s, Phase::Consuming { pid: me }) {
                    continue;
                }
                let now = slot.state();
                let to = match recv_status(fd) {
                    Ok(None) => Phase::Pending,
                    Ok(Some(status::OK)) => {
                        connected(fd, slot.sndbuf.load(Ordering::Acquire));
                        Phase::Connected
                    }
                    Ok(Some(st)) => Phase::Failed { errno: status_errno(st), told: false },
                    Err(e) => Phase::Failed { errno: e, told: false },
                };
                // Only this thread changes the phase now; others may set flags meanwhile.
                let mut cur = now;
                while !slot.transition(cur, to) {
                    cur = slot.state();
                }
                return outcome_of(to);
            }
            p => return outcome_of(p),
        }
    }
}

/// [`try_settle`], waiting for the status up to `until_ms` (the monotonic clock).
pub fn settle(fd: c_int, slot: &Slot, until_ms: u64) -> Outcome {
    wait_for(fd, until_ms, || try_settle(fd, Some(slot)))
}

/// The outcome of a connect the table had no room for: read here, waiting up to
/// `until_ms`, by the connect itself (nothing could read its status later).
fn settle_unlisted(fd: c_int, until_ms: u64) -> Outcome {
    wait_for(fd, until_ms, || match recv_status(fd) {
        Ok(None) => Outcome::Pending,
        Ok(Some(status::OK)) => {
            connected(fd, 0);
            Outcome::Connected
        }
        Ok(Some(st)) => Outcome::Failed { errno: status_errno(st), told: false },
        Err(e) => Outcome::Failed { errno: e, told: false },
    })
}

fn wait_for(fd: c_int, until_ms: u64, mut attempt: impl FnMut() -> Outcome) -> Outcome {
    loop {
        let o = attempt();
        let left = until_ms.saturating_sub(now_ms());
        if o != Outcome::Pending || left == 0 {
            return o;
        }
        match poll_one(fd, POLLIN, left.min(i32::MAX as u64) as c_int) {
            Ok(_) | Err(EINTR) => {}
            Err(_) => return attempt(),
        }
    }
}

/// Marks a failed connect as told; true for the one caller that does it.
pub fn tell(slot: Option<&Slot>) -> bool {
    let Some(slot) = slot else { return true };
    loop {
        let s = slot.state();
        match table::phase(s) {
            Phase::Failed { errno, told: false } => {
                if slot.transition(s, Phase::Failed { errno, told: true }) {
                    return true;
                }
                // A flag changed meanwhile (or another caller told): look again.
            }
            _ => return false,
        }
    }
}

/// Gives up on a pending connect: failed with `errno` (told), meshd's end let go.
fn give_up(fd: c_int, slot: Option<&Slot>, errno: c_int) {
    if let Some(slot) = slot {
        loop {
            let s = slot.state();
            if !matches!(table::phase(s), Phase::Pending)
                || slot.transition(s, Phase::Failed { errno, told: true })
            {
                break;
            }
        }
    }
    if let Some(f) = real::shutdown() {
        // SAFETY: shutting our socket down; meshd sees the rank gone.
        unsafe { f(fd, SHUT_RDWR) };
    }
}

fn unique() -> u64 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    (u64::from(pid()) << 32) | u64::from(NEXT.fetch_add(1, Ordering::Relaxed))
}

fn write_all(fd: c_int, buf: &[u8]) -> Result<(), c_int> {
    let write = real::write().ok_or(ECONNRESET)?;
    let mut sent = 0;
    while sent < buf.len() {
        let rest = &buf[sent..];
        // SAFETY: `rest` is a valid buffer of its length.
        let n = unsafe { write(fd, rest.as_ptr().cast(), rest.len()) };
        if n > 0 {
            sent += n as usize;
        } else if n == 0 || errno() != EINTR {
            return Err(ECONNRESET);
        }
    }
    Ok(())
}

/// A Unix socket connected to meshd with the request for `dest` sent, bound to `id`'s
/// name; `Err(errno)` as the application's connect reports it.
fn open_to_meshd(cfg: &Config, id: &Identity, dest: SocketAddr) -> Result<c_int, c_int> {
    static SAID: AtomicBool = AtomicBool::new(false);
    let Some((path, path_len)) = &cfg.path else {
        if !SAID.swap(true, Ordering::Relaxed) {
            say("MESHD_TUNNEL_PEERS is set but MESHD_TUNNEL is not: connections to other nodes are refused");
        }
        return Err(ECONNREFUSED);
    };
    let real_connect = real::connect().ok_or(ECONNREFUSED)?;
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
    // The name that says what this socket stands for (unique in the network namespace:
    // another socket of the same name makes bind fail, and the next number is tried).
    let mut bound = false;
    for _ in 0..16 {
        let (name, len) = ident::encode(id, unique());
        // SAFETY: a valid sockaddr_un of `len` bytes.
        if unsafe { bind(s, (&name as *const sockaddr_un).cast(), len) } == 0 {
            bound = true;
            break;
        }
        if errno() != EADDRINUSE {
            break;
        }
    }
    if !bound {
        return fail(EADDRNOTAVAIL); // as a TCP connect out of local ports
    }
    // meshd's socket is local: connecting and sending the request take no time unless
    // meshd is stuck; bounded all the same.
    let _ = set_timeout(s, SO_SNDTIMEO, cfg.timeout.min(Duration::from_secs(5)));
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
    if let Err(e) = write_all(s, &wire::encode_padded_request(dest)) {
        return fail(e);
    }
    // Not writable until meshd has answered and read the padding.
    let _ = set_int_opt(s, SOL_SOCKET, SO_SNDBUF, 1);
    Ok(s)
}

/// The address the socket `fd` was bound to, if the application bound it.
fn bound_addr(fd: c_int) -> Option<Addr> {
    let mut b = [0u8; 128];
    let n = sock_name(fd, &mut b)?;
    Addr::from_sockaddr(&b[..n]).filter(|a| !a.is_unbound())
}

/// Puts a tunnelled stream to `dest` in place of the TCP socket `fd`; `peer` is the
/// address as the application gave it. `Ok` when connected, `Err(errno)` otherwise
/// (`EINPROGRESS`: in progress).
pub fn tunnel(fd: c_int, dest: SocketAddr, peer: Addr, cfg: &Config) -> Result<(), c_int> {
    // A connected TCP socket stays one.
    let mut pb = [0u8; 128];
    if real::getpeername().is_some_and(|f| {
        let mut len = pb.len() as socklen_t;
        // SAFETY: a valid buffer and its length.
        unsafe { f(fd, pb.as_mut_ptr().cast(), &mut len) == 0 }
    }) {
        return Err(EISCONN);
    }
    let domain = get_int_opt(fd, SOL_SOCKET, SO_DOMAIN).unwrap_or(AF_INET);
    let nonblock = nonblocking(fd);
    // SAFETY: F_GETFD takes no argument.
    let cloexec = unsafe { fcntl(fd, F_GETFD) };
    let cloexec = if cloexec >= 0 && cloexec & FD_CLOEXEC != 0 { O_CLOEXEC } else { 0 };
    let sndtimeo = get_timeout(fd, SO_SNDTIMEO);
    let snap = opts::snapshot(fd, domain);
    let id = Identity { domain, peer, local: bound_addr(fd), opts: snap.emulated.clone() };
    let s = open_to_meshd(cfg, &id, dest)?;
    opts::apply(s, &snap);
    if nonblock {
        // SAFETY: fcntl on our own socket.
        unsafe {
            let fl = fcntl(s, F_GETFL);
            fcntl(s, F_SETFL, fl.max(0) | O_NONBLOCK);
        }
    }
    let cookie = socket_cookie(s);
    let sndbuf = snap.sndbuf.map_or(0, |v| v / 2);
    // Entered before the socket is in place, so no call on `fd` finds it unknown.
    let slot = cookie.and_then(|c| table::insert(c, Phase::Pending, &snap.emulated, sndbuf));
    // SAFETY: replaces the application's unconnected socket by ours at the same number.
    if unsafe { dup3(s, fd, cloexec) } < 0 {
        let e = errno();
        if let (Some(slot), Some(c)) = (slot, cookie) {
            table::remove(slot, c);
        }
        // SAFETY: our own socket.
        unsafe { close(s) };
        return Err(e);
    }
    // SAFETY: `s` is ours; `fd` now holds the socket.
    unsafe { close(s) };
    if nonblock && slot.is_some() {
        return Err(EINPROGRESS);
    }
    // A blocking connect waits, up to its SO_SNDTIMEO as the kernel's (then EINPROGRESS:
    // the connect goes on), and never past the tunnel's deadline. A socket the table had
    // no room for waits in any case: nothing else could read its status later.
    let app_limit = sndtimeo.filter(|t| *t < cfg.timeout && slot.is_some());
    let limit = app_limit.unwrap_or(cfg.timeout);
    let until = now_ms().saturating_add(limit.as_millis() as u64);
    let outcome = match slot {
        Some(slot) => settle(fd, slot, until),
        None => settle_unlisted(fd, until),
    };
    match outcome {
        Outcome::Connected => {
            if let Some(slot) = slot {
                slot.set_flags(table::flag::CONNECT_DONE);
            }
            Ok(())
        }
        Outcome::Failed { errno, .. } => {
            tell(slot);
            Err(errno)
        }
        Outcome::Pending if app_limit.is_some() => Err(EINPROGRESS),
        Outcome::Pending => {
            give_up(fd, slot, ETIMEDOUT);
            Err(ETIMEDOUT)
        }
    }
}

/// `connect` on a socket that is tunnelled already (the real `connect` refused an IP
/// address on a Unix socket), as TCP answers it: `EALREADY` while in progress, 0 when it
/// has just completed, `EISCONN` after that, the failure once; after a failure the
/// application may connect again. `None` when `fd` is not a tunnelled socket.
pub fn connect_again(fd: c_int, dest: SocketAddr, peer: Addr) -> Option<Result<(), c_int>> {
    let id = identity_of(fd)?;
    let Some(slot) = table::find_fd(fd) else { return Some(Err(EISCONN)) };
    Some(match try_settle(fd, Some(slot)) {
        Outcome::Pending => Err(EALREADY),
        Outcome::Connected => {
            // The kernel's first connect after the completion returns 0, later ones EISCONN.
            let before = slot.set_flags(table::flag::CONNECT_DONE);
            if before & table::flag::CONNECT_DONE == 0 { Ok(()) } else { Err(EISCONN) }
        }
        Outcome::Failed { errno, told: false } if tell(Some(slot)) => Err(errno),
        Outcome::Failed { .. } => fresh_connect(fd, id.domain, dest, peer),
    })
}

/// Connects a failed tunnelled socket anew: a new TCP socket in its place, then as any.
fn fresh_connect(fd: c_int, domain: c_int, dest: SocketAddr, peer: Addr) -> Result<(), c_int> {
    let nonblock = if nonblocking(fd) { SOCK_NONBLOCK } else { 0 };
    // SAFETY: F_GETFD takes no argument.
    let cloexec = unsafe { fcntl(fd, F_GETFD) };
    let cloexec = if cloexec >= 0 && cloexec & FD_CLOEXEC != 0 { O_CLOEXEC } else { 0 };
    // SAFETY: plain socket creation.
    let t = unsafe { socket(domain, SOCK_STREAM | SOCK_CLOEXEC | nonblock, 0) };
    if t < 0 {
        return Err(errno());
    }
    // SAFETY: replaces our failed socket by a new TCP one at the same number.
    let rc = unsafe { dup3(t, fd, cloexec) };
    let e = errno();
    // SAFETY: our own socket.
    unsafe { close(t) };
    if rc < 0 {
        return Err(e);
    }
    let cfg = config();
    if cfg.is_peer(dest.ip()) {
        return tunnel(fd, dest, peer, cfg);
    }
    let (b, n) = peer.to_sockaddr();
    let f = real::connect().ok_or(ECONNREFUSED)?;
    // SAFETY: a valid sockaddr of `n` bytes.
    if unsafe { f(fd, b.as_ptr().cast(), n as socklen_t) } == 0 { Ok(()) } else { Err(errno()) }
}

/// `getsockname`'s answer for a tunnelled socket: the address it was bound to, else this
/// node's address (`MESHD_NODE_ADDR`) with port 0, in the socket's own family.
pub fn local_name(id: &Identity) -> Addr {
    let v6 = id.domain == AF_INET6;
    let mut a = id.local.unwrap_or(Addr { v6, port: 0, ip: [0; 16], flowinfo: 0, scope: 0 });
    if a.ip == [0u8; 16] {
        match config().node {
            Some(IpAddr::V4(v4)) if v6 => a.ip = v4.to_ipv6_mapped().octets(),
            Some(IpAddr::V4(v4)) => a.ip[..4].copy_from_slice(&v4.octets()),
            Some(IpAddr::V6(ip)) if v6 => a.ip = ip.octets(),
            _ => {}
        }
    }
    a.v6 = v6;
    a
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_read_as_tcp_errors() {
        assert_eq!(status_errno(status::REFUSED), ECONNREFUSED);
        assert_eq!(status_errno(status::UNREACHABLE), EHOSTUNREACH);
        assert_eq!(status_errno(status::TIMED_OUT), ETIMEDOUT);
        assert_eq!(status_errno(200), ECONNRESET);
    }
}
