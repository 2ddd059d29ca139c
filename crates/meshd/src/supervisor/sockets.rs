//! The TCP sockets of this network namespace (`/proc/net/tcp`, `/proc/net/tcp6`) and those a
//! process holds (`/proc/PID/fd`): what the tunnel's far end checks a port against
//! (`tunnel::listeners`) and what a cut shuts down (`supervisor::cut`).

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// One socket as a line of `/proc/net/tcp` or `/proc/net/tcp6` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketLine {
    /// Local address (IPv4-mapped addresses read as IPv4).
    pub local: (IpAddr, u16),
    /// Remote address (unspecified for a listener).
    pub remote: (IpAddr, u16),
    /// The kernel's TCP state (`0A` LISTEN, `01` ESTABLISHED, ...).
    pub state: u8,
    /// The socket's inode (its `socket:[N]` name in `/proc/PID/fd`).
    pub inode: u64,
}

/// TCP states of `/proc/net/tcp` (include/net/tcp_states.h).
pub const TCP_LISTEN: u8 = 0x0A;
/// TIME_WAIT: no process holds the socket any more.
pub const TCP_TIME_WAIT: u8 = 0x06;
/// CLOSE.
pub const TCP_CLOSE: u8 = 0x07;

/// Parses one line of `/proc/net/tcp` or `/proc/net/tcp6`.
/// Fields: `sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...`,
/// addresses as hex words in host byte order, the port in hex.
pub fn parse_socket(line: &str) -> Option<SocketLine> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() < 10 {
        return None;
    }
    let state = u8::from_str_radix(f[3], 16).ok()?;
    let inode = f[9].parse::<u64>().ok()?;
    Some(SocketLine { local: hex_addr(f[1])?, remote: hex_addr(f[2])?, state, inode })
}

/// `ADDR:PORT` in `/proc/net/tcp{,6}`'s hex.
fn hex_addr(field: &str) -> Option<(IpAddr, u16)> {
    let (addr, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    // Each 32-bit word is the kernel's memory read as a native-endian integer.
    let word = |s: &str| u32::from_str_radix(s, 16).ok().map(u32::to_ne_bytes);
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(addr)?)),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(addr.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(b)).to_canonical()
        }
        _ => return None,
    };
    Some((ip, port))
}

/// Every TCP socket of this network namespace.
pub fn sockets() -> Vec<SocketLine> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|s| s.lines().skip(1).filter_map(parse_socket).collect::<Vec<_>>())
        .collect()
}

/// The socket inodes among `pid`'s open files.
pub fn socket_inodes(pid: i32, out: &mut HashSet<u64>) {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return };
    for e in dir.flatten() {
        let Ok(link) = std::fs::read_link(e.path()) else { continue };
        let link = link.to_string_lossy();
        if let Some(n) = link.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
            if let Ok(n) = n.parse() {
                out.insert(n);
            }
        }
    }
}

/// The listening TCP sockets of this network namespace. Asked of the kernel by
/// `NETLINK_SOCK_DIAG` for the LISTEN state only, which walks the kernel's listening table
/// and nothing else; `/proc/net/tcp` walks every bucket of the established table, which
/// cost about 8 ms of CPU per read with a few hundred connections open (the tunnel's far
/// end asks once per connection). Falls back to `/proc/net/tcp{,6}` where sock_diag is not
/// there (a kernel without `inet_diag`, a sandbox).
pub fn listening() -> Vec<SocketLine> {
    match diag::listening() {
        Ok(v) => v,
        Err(e) => {
            tracing::debug!("sock_diag unavailable ({e}); reading /proc/net/tcp for listeners");
            sockets().into_iter().filter(|s| s.state == TCP_LISTEN).collect()
        }
    }
}

/// A `SOCK_DIAG_BY_FAMILY` dump of TCP listeners (linux/inet_diag.h, linux/sock_diag.h).
pub(crate) mod diag {
    use super::{SocketLine, TCP_LISTEN};
    use std::io;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// linux/sock_diag.h
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    /// `struct nlmsghdr`
    const NLMSG_HDR: usize = 16;
    /// `struct inet_diag_req_v2`: family, protocol, ext, pad, states, `inet_diag_sockid` (48).
    const REQ_LEN: usize = 8 + 48;
    /// `struct inet_diag_msg`: family, state, timer, retrans, sockid (48), expires, rqueue,
    /// wqueue, uid, inode.
    const MSG_LEN: usize = 4 + 48 + 20;
    /// Messages read at most per dump (a bound on a misbehaving kernel, not a real limit:
    /// one message per listener).
    const MAX_MESSAGES: usize = 1 << 20;

    pub fn listening() -> io::Result<Vec<SocketLine>> {
        // SAFETY: socket() has no memory arguments; the descriptor is owned below.
        let fd = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: socket() returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // A kernel that never answers must not hold the caller: 2 s per read at most.
        let tv = libc::timeval { tv_sec: 2, tv_usec: 0 };
        // SAFETY: tv outlives the call, and its size is passed.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        let mut out = Vec::new();
        for (seq, family) in [(1u32, libc::AF_INET as u8), (2, libc::AF_INET6 as u8)] {
            dump(&fd, seq, family, &mut out)?;
        }
        Ok(out)
    }

    /// The request for `family`'s TCP listeners.
    pub(crate) fn request(seq: u32, family: u8) -> Vec<u8> {
        let len = (NLMSG_HDR + REQ_LEN) as u32;
        let mut b = Vec::with_capacity(len as usize);
        b.extend_from_slice(&len.to_ne_bytes());
        b.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        b.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
        b.extend_from_slice(&seq.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_pid: the kernel fills it in
        b.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
        b.extend_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes()); // idiag_states
        b.resize(len as usize, 0); // inet_diag_sockid: any address, any port
        b
    }

    fn dump(fd: &OwnedFd, seq: u32, family: u8, out: &mut Vec<SocketLine>) -> io::Result<()> {
        let req = request(seq, family);
        // SAFETY: an all-zero sockaddr_nl is valid (pid 0: the kernel).
        let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: req and `to` outlive the call, and their sizes are passed.
        let sent = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                req.as_ptr().cast(),
                req.len(),
                0,
                (&to as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if sent != req.len() as isize {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 64 * 1024];
        let mut seen = 0usize;
        loop {
            // SAFETY: buf is valid for writes of its length.
            let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            match parse(&buf[..n as usize], seq, out)? {
                Parsed::Done => return Ok(()),
                Parsed::More(k) => seen += k,
            }
            if seen > MAX_MESSAGES {
                return Err(io::Error::other("sock_diag: the dump never ended"));
            }
        }
    }

    /// What one datagram of the dump held.
    #[derive(Debug, PartialEq, Eq)]
    pub(crate) enum Parsed {
        /// `NLMSG_DONE`: the dump is complete.
        Done,
        /// This many messages; more datagrams follow.
        More(usize),
    }

    /// Parses one datagram of answers to request `seq`, adding the TCP listeners it names.
    pub(crate) fn parse(mut b: &[u8], seq: u32, out: &mut Vec<SocketLine>) -> io::Result<Parsed> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, format!("sock_diag: {why}"));
        let u32_at = |b: &[u8], i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut k = 0;
        while b.len() >= NLMSG_HDR {
            let len = u32_at(b, 0) as usize;
            let kind = u16::from_ne_bytes([b[4], b[5]]);
            if len < NLMSG_HDR || len > b.len() {
                return Err(bad("a message's length runs past the datagram"));
            }
            let body = &b[NLMSG_HDR..len];
            if u32_at(b, 8) == seq {
                match kind as i32 {
                    libc::NLMSG_DONE => return Ok(Parsed::Done),
                    libc::NLMSG_ERROR => {
                        if body.len() < 4 {
                            return Err(bad("a short error message"));
                        }
                        let code = i32::from_ne_bytes([body[0], body[1], body[2], body[3]]);
                        if code != 0 {
                            return Err(io::Error::from_raw_os_error(-code));
                        }
                    }
                    _ if kind == SOCK_DIAG_BY_FAMILY && body.len() >= MSG_LEN => {
                        if let Some(s) = socket(body) {
                            out.push(s);
                        }
                    }
                    _ => {}
                }
            }
            k += 1;
            // NLMSG_ALIGN: messages start on 4-byte boundaries.
            let next = (len + 3) & !3;
            b = &b[next.min(b.len())..];
        }
        Ok(Parsed::More(k))
    }

    /// One `inet_diag_msg`, as the /proc reader would have given it.
    fn socket(m: &[u8]) -> Option<SocketLine> {
        let (family, state) = (m[0], m[1]);
        let port = |i: usize| u16::from_be_bytes([m[i], m[i + 1]]);
        let ip = |i: usize| -> Option<IpAddr> {
            match family as i32 {
                libc::AF_INET => Some(IpAddr::V4(Ipv4Addr::new(m[i], m[i + 1], m[i + 2], m[i + 3]))),
                libc::AF_INET6 => {
                    let b: [u8; 16] = m[i..i + 16].try_into().ok()?;
                    Some(IpAddr::V6(Ipv6Addr::from(b)).to_canonical())
                }
                _ => None,
            }
        };
        let inode = u32::from_ne_bytes([m[68], m[69], m[70], m[71]]) as u64;
        Some(SocketLine { local: (ip(8)?, port(4)), remote: (ip(24)?, port(6)), state, inode })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's sock_diag answer names the same listeners, with the same inodes, as
    /// `/proc/net/tcp{,6}`: IPv4, IPv6 and an IPv4-mapped address included.
    #[test]
    fn sock_diag_and_proc_agree_on_listeners() {
        let v4 = std::net::TcpListener::bind("127.0.0.1:0").expect("bind v4");
        let v6 = std::net::TcpListener::bind("[::1]:0").ok(); // no IPv6 in some sandboxes
        let proc_listeners = || -> Vec<SocketLine> {
            let mut v: Vec<_> = sockets().into_iter().filter(|s| s.state == TCP_LISTEN).collect();
            v.sort_by_key(|s| s.inode);
            v
        };
        let mut diag = diag::listening().expect("sock_diag (inet_diag) answers on this kernel");
        diag.sort_by_key(|s| s.inode);
        let procs = proc_listeners();
        // Other tests open and close listeners meanwhile: compare ours, and the overlap.
        let port4 = v4.local_addr().expect("addr").port();
        let ours = |v: &[SocketLine], port: u16| v.iter().find(|s| s.local.1 == port).copied();
        assert_eq!(ours(&diag, port4), ours(&procs, port4));
        assert_eq!(
            ours(&diag, port4).expect("our v4 listener").local.0,
            "127.0.0.1".parse::<IpAddr>().expect("ok")
        );
        if let Some(v6) = &v6 {
            let port6 = v6.local_addr().expect("addr").port();
            assert_eq!(ours(&diag, port6), ours(&procs, port6));
            assert!(ours(&diag, port6).is_some(), "our v6 listener");
        }
        for s in &diag {
            assert_eq!(s.state, TCP_LISTEN);
            if let Some(p) = procs.iter().find(|p| p.inode == s.inode) {
                assert_eq!(p, s, "the same socket read two ways");
            }
        }
        assert!(listening().iter().any(|s| s.local.1 == port4));
    }

    /// Datagrams that lie about their lengths, errors and a dump's end are read as such.
    #[test]
    fn sock_diag_answers_are_parsed_defensively() {
        let mut out = Vec::new();
        let hdr = |len: u32, kind: u16, seq: u32| {
            let mut b = Vec::new();
            b.extend_from_slice(&len.to_ne_bytes());
            b.extend_from_slice(&kind.to_ne_bytes());
            b.extend_from_slice(&0u16.to_ne_bytes());
            b.extend_from_slice(&seq.to_ne_bytes());
            b.extend_from_slice(&0u32.to_ne_bytes());
            b
        };
        // A length past the datagram, or shorter than a header.
        assert!(diag::parse(&hdr(4096, 20, 1), 1, &mut out).is_err());
        assert!(diag::parse(&hdr(8, 20, 1), 1, &mut out).is_err());
        // The end of the dump; another request's end is not ours.
        assert_eq!(
            diag::parse(&hdr(16, libc::NLMSG_DONE as u16, 1), 1, &mut out).expect("ok"),
            diag::Parsed::Done
        );
        assert_eq!(
            diag::parse(&hdr(16, libc::NLMSG_DONE as u16, 9), 1, &mut out).expect("ok"),
            diag::Parsed::More(1)
        );
        // An error names its errno.
        let mut e = hdr(20, libc::NLMSG_ERROR as u16, 1);
        e.extend_from_slice(&(-libc::EPERM).to_ne_bytes());
        let err = diag::parse(&e, 1, &mut out).expect_err("an error");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
        // A listener on 10.0.0.7:29500, inode 4242.
        let mut m = hdr(16 + 72, 20, 1);
        let mut body = vec![0u8; 72];
        body[0] = libc::AF_INET as u8;
        body[1] = TCP_LISTEN;
        body[4..6].copy_from_slice(&29500u16.to_be_bytes());
        body[8..12].copy_from_slice(&[10, 0, 0, 7]);
        body[68..72].copy_from_slice(&4242u32.to_ne_bytes());
        m.extend_from_slice(&body);
        assert_eq!(diag::parse(&m, 1, &mut out).expect("ok"), diag::Parsed::More(1));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].local, ("10.0.0.7".parse().expect("ok"), 29500));
        assert_eq!(out[0].inode, 4242);
        // A truncated body is skipped, not read past.
        let mut short = hdr(16 + 10, 20, 1);
        short.extend_from_slice(&[libc::AF_INET as u8; 10]);
        assert_eq!(diag::parse(&short, 1, &mut out).expect("ok"), diag::Parsed::More(1));
        assert_eq!(out.len(), 1);
        // The request is what the kernel expects: 72 bytes, LISTEN only.
        let r = diag::request(7, libc::AF_INET6 as u8);
        assert_eq!(r.len(), 72);
        assert_eq!(r[16], libc::AF_INET6 as u8);
        assert_eq!(u32::from_ne_bytes(r[20..24].try_into().expect("ok")), 1 << TCP_LISTEN);
    }
}
