//! Socket options across the swap. Before the Unix socket takes the TCP socket's place, its
//! options are read back from the TCP socket: those a Unix socket has too (timeouts,
//! buffers, keep-alive, linger, priority, ...) are set on it, so they keep working (an
//! `SO_RCVTIMEO` set before `connect` still makes a `recv` time out); the TCP and IP ones,
//! which a Unix socket does not have, are emulated: `setsockopt` stores them,
//! `getsockopt` reads back what was set (or the TCP socket's value at the swap).

use std::ffi::c_int;
use std::sync::atomic::{AtomicI32, Ordering};

use crate::sys::{
    AF_INET6, IPPROTO_IP, IPPROTO_IPV6, IPPROTO_TCP, SO_KEEPALIVE, SO_LINGER, SO_OOBINLINE, SO_PRIORITY,
    SO_RCVBUF, SO_RCVLOWAT, SO_RCVTIMEO, SO_REUSEADDR, SO_SNDBUF, SO_SNDTIMEO, SOCK_CLOEXEC, SOCK_STREAM,
    SOL_SOCKET, close, get_int_opt, get_opt, set_opt, socket,
};

/// The TCP- and IP-level options a tunnelled socket emulates (all `int`-valued): their
/// values live in the socket's entry ([`crate::table`]) and, as they were at the swap, in
/// its name ([`crate::ident`]). Others at those levels are accepted and read as 0.
pub const EMULATED: [(c_int, c_int); 16] = [
    (IPPROTO_TCP, 1),   // TCP_NODELAY
    (IPPROTO_TCP, 4),   // TCP_KEEPIDLE
    (IPPROTO_TCP, 5),   // TCP_KEEPINTVL
    (IPPROTO_TCP, 6),   // TCP_KEEPCNT
    (IPPROTO_TCP, 18),  // TCP_USER_TIMEOUT
    (IPPROTO_TCP, 3),   // TCP_CORK
    (IPPROTO_TCP, 12),  // TCP_QUICKACK
    (IPPROTO_TCP, 2),   // TCP_MAXSEG
    (IPPROTO_TCP, 7),   // TCP_SYNCNT
    (IPPROTO_TCP, 8),   // TCP_LINGER2
    (IPPROTO_TCP, 10),  // TCP_WINDOW_CLAMP
    (IPPROTO_TCP, 25),  // TCP_NOTSENT_LOWAT
    (IPPROTO_IP, 1),    // IP_TOS
    (IPPROTO_IP, 2),    // IP_TTL
    (IPPROTO_IPV6, 26), // IPV6_V6ONLY
    (IPPROTO_IPV6, 67), // IPV6_TCLASS
];

/// Index of an emulated option.
pub fn emulated(level: c_int, name: c_int) -> Option<usize> {
    EMULATED.iter().position(|&(l, n)| l == level && n == name)
}

/// Whether options at `level` are emulated on a tunnelled socket.
pub fn emulated_level(level: c_int) -> bool {
    matches!(level, IPPROTO_TCP | IPPROTO_IP | IPPROTO_IPV6)
}

/// `SOL_SOCKET` options carried from the TCP socket to the Unix one as the bytes
/// `getsockopt` gave (`SO_SNDBUF`/`SO_RCVBUF` are handled apart: `getsockopt` reads them
/// doubled, and the Unix socket's defaults differ).
const CARRIED: [c_int; 8] =
    [SO_RCVTIMEO, SO_SNDTIMEO, SO_KEEPALIVE, SO_LINGER, SO_PRIORITY, SO_OOBINLINE, SO_REUSEADDR, SO_RCVLOWAT];

/// What is read from the TCP socket before the swap.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// [`CARRIED`]'s values, as `getsockopt` gave them.
    carried: Vec<(c_int, [u8; 16], usize)>,
    /// `SO_SNDBUF`/`SO_RCVBUF` as `getsockopt` read them, when the application changed
    /// them (they differ from a new TCP socket's).
    pub sndbuf: Option<c_int>,
    pub rcvbuf: Option<c_int>,
    /// [`EMULATED`]'s values.
    pub emulated: Vec<i32>,
}

/// A new TCP socket's `SO_SNDBUF` and `SO_RCVBUF` in `domain` (read once; no traffic).
fn tcp_defaults(domain: c_int) -> (c_int, c_int) {
    static DEFAULTS: [AtomicI32; 4] = [const { AtomicI32::new(0) }; 4];
    let k = if domain == AF_INET6 { 2 } else { 0 };
    let (s, r) = (DEFAULTS[k].load(Ordering::Relaxed), DEFAULTS[k + 1].load(Ordering::Relaxed));
    if s != 0 {
        return (s, r);
    }
    // SAFETY: plain socket creation; closed below.
    let fd = unsafe { socket(domain, SOCK_STREAM | SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return (-1, -1);
    }
    let s = get_int_opt(fd, SOL_SOCKET, SO_SNDBUF).unwrap_or(-1);
    let r = get_int_opt(fd, SOL_SOCKET, SO_RCVBUF).unwrap_or(-1);
    // SAFETY: our own socket.
    unsafe { close(fd) };
    DEFAULTS[k].store(s, Ordering::Relaxed);
    DEFAULTS[k + 1].store(r, Ordering::Relaxed);
    (s, r)
}

/// Reads the TCP socket `fd`'s options.
pub fn snapshot(fd: c_int, domain: c_int) -> Snapshot {
    let mut carried = Vec::new();
    for name in CARRIED {
        let mut b = [0u8; 16];
        if let Some(n) = get_opt(fd, SOL_SOCKET, name, &mut b) {
            carried.push((name, b, n));
        }
    }
    let (def_snd, def_rcv) = tcp_defaults(domain);
    let sndbuf = get_int_opt(fd, SOL_SOCKET, SO_SNDBUF).filter(|v| *v != def_snd);
    let rcvbuf = get_int_opt(fd, SOL_SOCKET, SO_RCVBUF).filter(|v| *v != def_rcv);
    let emulated = EMULATED.iter().map(|&(l, n)| get_int_opt(fd, l, n).unwrap_or(0)).collect();
    Snapshot { carried, sndbuf, rcvbuf, emulated }
}

/// Sets the carried options on the Unix socket `fd` (the timeouts last, so meshd's
/// request is not cut short by them: the caller sets them after the request).
pub fn apply(fd: c_int, s: &Snapshot) {
    for (name, b, n) in &s.carried {
        let _ = set_opt(fd, SOL_SOCKET, *name, &b[..*n]);
    }
    if let Some(r) = s.rcvbuf {
        // getsockopt reads the doubled value setsockopt stored.
        let _ = set_opt(fd, SOL_SOCKET, SO_RCVBUF, &(r / 2).to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_options_are_distinct_and_found() {
        for (i, &(l, n)) in EMULATED.iter().enumerate() {
            assert_eq!(emulated(l, n), Some(i));
            assert!(emulated_level(l));
        }
        assert_eq!(emulated(IPPROTO_TCP, 11), None, "TCP_INFO is not an int option");
        assert!(!emulated_level(SOL_SOCKET));
    }

    /// On a real TCP socket (created, never connected): what was set reads back in the
    /// snapshot; an untouched buffer size is not taken for one the application chose.
    #[test]
    fn a_snapshot_reads_what_was_set_on_the_tcp_socket() {
        use crate::sys::{AF_INET, set_int_opt, set_timeout};
        // SAFETY: plain socket creation; closed below.
        let fd = unsafe { socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0) };
        assert!(fd >= 0);
        let plain = snapshot(fd, AF_INET);
        assert_eq!((plain.sndbuf, plain.rcvbuf), (None, None));
        assert!(set_int_opt(fd, IPPROTO_TCP, 1, 1));
        assert!(set_int_opt(fd, IPPROTO_TCP, 4, 17));
        assert!(set_int_opt(fd, SOL_SOCKET, SO_KEEPALIVE, 1));
        assert!(set_int_opt(fd, SOL_SOCKET, SO_SNDBUF, 100_000));
        assert!(set_timeout(fd, SO_RCVTIMEO, std::time::Duration::from_millis(1500)));
        let s = snapshot(fd, AF_INET);
        assert_eq!(s.emulated[emulated(IPPROTO_TCP, 1).expect("nodelay")], 1);
        assert_eq!(s.emulated[emulated(IPPROTO_TCP, 4).expect("keepidle")], 17);
        assert_eq!(s.sndbuf, Some(200_000));
        let keep = s.carried.iter().find(|c| c.0 == SO_KEEPALIVE).expect("keepalive");
        assert_eq!(keep.1[0], 1);
        let rcvtimeo = s.carried.iter().find(|c| c.0 == SO_RCVTIMEO).expect("rcvtimeo");
        assert_eq!((rcvtimeo.2, rcvtimeo.1[0], rcvtimeo.1[8..10].to_vec()), (16, 1, vec![0x20, 0xa1]));
        // SAFETY: our own socket.
        unsafe { close(fd) };
    }
}
