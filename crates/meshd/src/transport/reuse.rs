//! The node's UDP port as a group of sockets, one for quinn and one per plane lane, so
//! that the kernel hands each datagram to its reader: the data plane reads its own
//! datagrams (opened in place, without passing through quinn's endpoint or a copy into a
//! queue), and each lane's on its own socket (docs/PROTOCOL.md, "The data plane").
//!
//! The sockets share the port with `SO_REUSEPORT`, and a classic BPF program on the group
//! (`SO_ATTACH_REUSEPORT_CBPF`, no privilege needed) picks the socket from the datagram's
//! first bytes: a plane datagram (`first & 0xC0 == 0`) goes to the socket of lane
//! `1 + lane byte % lanes`, anything else to quinn's (index 0). A GRO batch goes where its
//! first datagram goes, so a reader still meets the other kind now and then (both flows
//! share one 5-tuple); the socket wrapper passes those on ([`super::socket`]).
//!
//! The port stays the node's alone as before: it is first bound by a socket without
//! `SO_REUSEPORT` (which fails if anyone holds it, and for port 0 picks a port nobody
//! holds), released, and bound at once by the group. A later socket without
//! `SO_REUSEPORT` (another meshd) is refused with `EADDRINUSE` as before. Where the kernel
//! refuses any step, the node runs one socket as before (plane datagrams split off from
//! quinn's receive path).

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd};

/// `SO_ATTACH_REUSEPORT_CBPF` (asm-generic; the libc crate does not export it for Linux).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "x86", target_arch = "arm"))]
const SO_ATTACH_REUSEPORT_CBPF: libc::c_int = 51;

/// The bound sockets: quinn's, then one per plane lane (empty when the group could not be
/// made).
#[derive(Debug)]
pub struct Bound {
    /// quinn's socket (every datagram, when `lanes` is empty).
    pub quic: UdpSocket,
    /// Lane `l`'s socket at `l`.
    pub lanes: Vec<UdpSocket>,
    /// Why the group could not be made, when it could not.
    pub fallback: Option<String>,
}

/// Binds `addr` for quinn and, when `lanes > 0`, a socket per plane lane in one steered
/// group; on a kernel that refuses the group, quinn's socket alone.
pub fn bind(addr: SocketAddr, lanes: usize) -> io::Result<Bound> {
    // An ephemeral port may be taken by someone else in the moment it is released: then
    // another one.
    let tries = if addr.port() == 0 { 4 } else { 1 };
    let mut last = None;
    for _ in 0..tries {
        match bind_once(addr, lanes) {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && addr.port() == 0 => last = Some(e),
            r => return r,
        }
    }
    Err(last.unwrap_or_else(|| io::Error::from(io::ErrorKind::AddrInUse)))
}

fn bind_once(addr: SocketAddr, lanes: usize) -> io::Result<Bound> {
    let first = UdpSocket::bind(addr)?;
    if lanes == 0 {
        return Ok(Bound { quic: first, lanes: Vec::new(), fallback: None });
    }
    let port = first.local_addr()?.port();
    let at = SocketAddr::new(addr.ip(), port);
    match group(at, lanes, first) {
        Ok((quic, lanes)) => Ok(Bound { quic, lanes, fallback: None }),
        Err((e, Some(first))) => Ok(Bound { quic: first, lanes: Vec::new(), fallback: Some(e.to_string()) }),
        // The port was released and could not be bound again (taken meanwhile).
        Err((e, None)) => Err(e),
    }
}

/// The group on `at` (the port `first` holds). On failure, the error and, when the port
/// was never released, `first` to run alone with.
fn group(
    at: SocketAddr,
    lanes: usize,
    first: UdpSocket,
) -> Result<(UdpSocket, Vec<UdpSocket>), (io::Error, Option<UdpSocket>)> {
    // What a kernel without any of it refuses, tried before the port is released.
    let probe = reuseport_socket(at).map_err(|e| (e, None::<UdpSocket>));
    let probe = match probe {
        Ok(p) => p,
        Err((e, _)) => return Err((e, Some(first))),
    };
    if let Err(e) = attach_steering(&probe, lanes) {
        return Err((e, Some(first)));
    }
    drop(probe);
    drop(first);
    let mut socks = Vec::with_capacity(lanes + 1);
    for _ in 0..=lanes {
        let s = reuseport_socket(at).and_then(|s| bind_fd(&s, at).map(|()| s));
        match s {
            Ok(s) => socks.push(s),
            Err(e) => {
                drop(socks);
                // Take the port back alone, as before the try.
                return match UdpSocket::bind(at) {
                    Ok(alone) => Err((e, Some(alone))),
                    Err(e) => Err((e, None)),
                };
            }
        }
    }
    if let Err(e) = attach_steering(&socks[0], lanes) {
        drop(socks);
        return match UdpSocket::bind(at) {
            Ok(alone) => Err((e, Some(alone))),
            Err(e) => Err((e, None)),
        };
    }
    let quic = socks.remove(0);
    Ok((quic, socks))
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

/// An unbound UDP socket of `at`'s family with `SO_REUSEPORT` set.
fn reuseport_socket(at: SocketAddr) -> io::Result<UdpSocket> {
    let family = if at.is_ipv6() { libc::AF_INET6 } else { libc::AF_INET };
    // SAFETY: socket() with constant arguments; the fd is owned by the UdpSocket at once.
    let fd = cvt(unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` is a fresh socket nobody else owns.
    let s = unsafe { UdpSocket::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // SAFETY: setsockopt on a socket we own, with a valid int and its size.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEPORT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })?;
    Ok(s)
}

/// bind(2) of `s` to `at`.
fn bind_fd(s: &UdpSocket, at: SocketAddr) -> io::Result<()> {
    // SAFETY: zeroed sockaddr_storage is a valid value; we fill the family's struct in it.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match at {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: bind with a valid sockaddr of `len` bytes.
    cvt(unsafe {
        libc::bind(s.as_raw_fd(), (&storage as *const libc::sockaddr_storage).cast(), len as libc::socklen_t)
    })
    .map(|_| ())
}

/// The steering program for `lanes` plane lanes (socket 0 is quinn's).
fn program(lanes: usize) -> [libc::sock_filter; 8] {
    let op = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter { code: code as u16, jt, jf, k };
    [
        // A = first byte of the UDP payload (the kernel pulls the UDP header first).
        op(libc::BPF_LD | libc::BPF_B | libc::BPF_ABS, 0, 0, 0),
        op(libc::BPF_ALU | libc::BPF_AND | libc::BPF_K, 0, 0, 0xC0),
        // A plane datagram: both top bits clear.
        op(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, 1, 0, 0),
        op(libc::BPF_RET | libc::BPF_K, 0, 0, 0),
        // A = lane byte (a datagram too short returns 0: quinn's, whose wrapper drops it).
        op(libc::BPF_LD | libc::BPF_B | libc::BPF_ABS, 0, 0, 1),
        op(libc::BPF_ALU | libc::BPF_MOD | libc::BPF_K, 0, 0, lanes as u32),
        op(libc::BPF_ALU | libc::BPF_ADD | libc::BPF_K, 0, 0, 1),
        op(libc::BPF_RET | libc::BPF_A, 0, 0, 0),
    ]
}

/// Attaches the steering program to `s`'s group.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "x86", target_arch = "arm"))]
fn attach_steering(s: &UdpSocket, lanes: usize) -> io::Result<()> {
    let mut prog = program(lanes.max(1));
    let fprog = libc::sock_fprog { len: prog.len() as u16, filter: prog.as_mut_ptr() };
    // SAFETY: setsockopt with a valid sock_fprog pointing at `prog`, alive for the call
    // (the kernel copies the program).
    cvt(unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_ATTACH_REUSEPORT_CBPF,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "x86", target_arch = "arm")))]
fn attach_steering(_: &UdpSocket, _: usize) -> io::Result<()> {
    Err(io::Error::other("no reuseport steering on this architecture"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn recv(s: &UdpSocket) -> Option<Vec<u8>> {
        s.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
        let mut b = [0u8; 64];
        s.recv_from(&mut b).ok().map(|(n, _)| b[..n].to_vec())
    }

    #[test]
    fn plane_datagrams_reach_their_lanes_socket_and_the_port_stays_ours() {
        let b = bind("127.0.0.1:0".parse().expect("addr"), 3).expect("bind");
        assert!(b.fallback.is_none(), "{:?}", b.fallback);
        assert_eq!(b.lanes.len(), 3);
        let to = b.quic.local_addr().expect("addr");
        for l in &b.lanes {
            assert_eq!(l.local_addr().expect("addr"), to);
        }
        let tx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        // QUIC-looking (fixed bit), a long header, plane datagrams of lanes 0..5, a 1-byte one.
        for d in [
            &[0x40u8, 1][..],
            &[0xC3, 2],
            &[0x21, 0, 9],
            &[0x21, 1, 9],
            &[0x20, 2, 9],
            &[0x20, 4, 9],
            &[0x20],
        ] {
            tx.send_to(d, to).expect("send");
        }
        let mut quic = Vec::new();
        while let Some(d) = recv(&b.quic) {
            quic.push(d);
        }
        assert_eq!(quic, vec![vec![0x40u8, 1], vec![0xC3, 2], vec![0x20]]);
        let lanes: Vec<Vec<Vec<u8>>> =
            b.lanes.iter().map(|s| std::iter::from_fn(|| recv(s)).collect()).collect();
        assert_eq!(lanes[0], vec![vec![0x21u8, 0, 9]]);
        assert_eq!(lanes[1], vec![vec![0x21u8, 1, 9], vec![0x20, 4, 9]]);
        assert_eq!(lanes[2], vec![vec![0x20u8, 2, 9]]);
        // Another process's plain bind of the port fails as before.
        let e = UdpSocket::bind(to).expect_err("the port is ours");
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
    }

    #[test]
    fn a_held_port_is_refused_and_no_lanes_means_one_plain_socket() {
        let held = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let e = bind(held.local_addr().expect("addr"), 2).expect_err("held");
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        let b = bind("127.0.0.1:0".parse().expect("addr"), 0).expect("bind");
        assert!(b.lanes.is_empty() && b.fallback.is_none());
    }
}
