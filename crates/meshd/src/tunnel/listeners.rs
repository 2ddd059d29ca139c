//! Which TCP ports the tunnel's far end may connect to: only ports on which a process of
//! this job listens on the node's roster address (or on a wildcard address that covers it).
//! Everything else on the node (sshd, a notebook server, the Docker API, another user's
//! service) stays out of reach of the token holders, as the firewall meant it to be.
//!
//! "A process of this job" is a descendant of meshd (its ranks, what they started, and the
//! NCCL id's root process): meshd is the child subreaper of its descendants
//! (`supervisor::orphans`), so a rank's daemonized children stay in the tree. A listener
//! is found by asking the kernel's sock_diag for LISTEN sockets (`supervisor::sockets::
//! listening`; `/proc/net/tcp{,6}` where that is missing): local address, port, the
//! socket's inode; and its owner by the `socket:[inode]` links in `/proc/PID/fd` of those
//! processes. Inodes found to be the job's are remembered, so Gloo's many connections to
//! one listener cost one scan.
//!
//! The kernel hands a connection to `addr:port` to a listener bound to exactly `addr` when
//! there is one, else to one bound to the wildcard address; every listener the kernel could
//! pick must be the job's (SO_REUSEPORT lets several share a port).

use crate::supervisor::orphans::tree;
use crate::supervisor::sockets::{TCP_LISTEN, listening, parse_socket, socket_inodes};
use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Mutex;

/// A listening TCP socket as `/proc/net/tcp{,6}` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listener {
    /// Local address it is bound to (IPv4-mapped addresses read as IPv4).
    pub ip: IpAddr,
    /// Local port.
    pub port: u16,
    /// The socket's inode (its `socket:[N]` name in `/proc/PID/fd`).
    pub inode: u64,
}

/// What a far end decides about a destination port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortCheck {
    /// A process of the job listens there: connect.
    Job,
    /// Nothing listens there (the kernel would refuse it too).
    NotListening,
    /// Something outside the job listens there: refused.
    Outside,
}

/// Parses one line of `/proc/net/tcp` or `/proc/net/tcp6`; `Some` only for LISTEN sockets.
pub fn parse_line(line: &str) -> Option<Listener> {
    let s = parse_socket(line).filter(|s| s.state == TCP_LISTEN)?;
    Some(Listener { ip: s.local.0, port: s.local.1, inode: s.inode })
}

/// The listeners the kernel could hand a connection to `ip:port` to: those bound to `ip`
/// exactly when there are any, else those bound to the wildcard of `ip`'s family (an IPv6
/// wildcard socket takes IPv4 connections too, unless IPV6_V6ONLY; counted either way, to
/// err on the side of refusing).
pub fn candidates(all: &[Listener], ip: IpAddr, port: u16) -> Vec<Listener> {
    let ip = ip.to_canonical();
    let on_port = all.iter().filter(|l| l.port == port);
    let exact: Vec<Listener> = on_port.clone().filter(|l| l.ip == ip).copied().collect();
    if !exact.is_empty() {
        return exact;
    }
    on_port
        .filter(|l| match (l.ip, ip) {
            (IpAddr::V4(a), IpAddr::V4(_)) => a.is_unspecified(),
            (IpAddr::V6(a), _) => a.is_unspecified(),
            (IpAddr::V4(_), IpAddr::V6(_)) => false,
        })
        .copied()
        .collect()
}

/// The listening sockets of this network namespace.
fn listeners() -> Vec<Listener> {
    listening().into_iter().map(|s| Listener { ip: s.local.0, port: s.local.1, inode: s.inode }).collect()
}

/// Decides which ports a far end serves (see the module doc). One per node and round.
#[derive(Debug)]
pub struct JobPorts {
    root: i32,
    with_root: bool,
    /// Listening sockets found to be the job's.
    known: Mutex<HashSet<u64>>,
}

impl JobPorts {
    /// Ports of `root`'s descendants (meshd's pid: its ranks and helpers); `with_root`
    /// counts `root`'s own listeners too (a test process that plays both parts).
    pub fn new(root: i32, with_root: bool) -> JobPorts {
        JobPorts { root, with_root, known: Mutex::new(HashSet::new()) }
    }

    /// Whether the far end may connect to `ip:port`. Reads /proc: call it off the runtime's
    /// worker threads for a burst (`spawn_blocking`).
    pub fn check(&self, ip: IpAddr, port: u16) -> PortCheck {
        let wanted = candidates(&listeners(), ip, port);
        if wanted.is_empty() {
            return PortCheck::NotListening;
        }
        let lock = || self.known.lock().unwrap_or_else(|p| p.into_inner());
        if wanted.iter().all(|l| lock().contains(&l.inode)) {
            return PortCheck::Job;
        }
        let mut inodes = HashSet::new();
        for pid in tree(self.root, self.with_root) {
            socket_inodes(pid, &mut inodes);
        }
        if wanted.iter().all(|l| inodes.contains(&l.inode)) {
            lock().extend(wanted.iter().map(|l| l.inode));
            PortCheck::Job
        } else {
            PortCheck::Outside
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_endian = "little")]
    fn proc_net_tcp_lines_parse() {
        // 127.0.0.1:8080 listening, inode 12345 (x86: host byte order words).
        let v4 = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0";
        assert_eq!(
            parse_line(v4),
            Some(Listener { ip: "127.0.0.1".parse().expect("ip"), port: 8080, inode: 12345 })
        );
        // The same socket connected (state 01): not a listener.
        assert_eq!(parse_line(&v4.replacen(" 0A ", " 01 ", 1)), None);
        // ::1 port 22 and the IPv4-mapped 198.19.0.7 port 29500.
        let v6 = "   0: 00000000000000000000000001000000:0016 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1 0000000000000000 100 0 0 10 0";
        assert_eq!(parse_line(v6), Some(Listener { ip: "::1".parse().expect("ip"), port: 22, inode: 777 }));
        let mapped = "   1: 0000000000000000FFFF0000070013C6:733C 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 778 1 0000000000000000 100 0 0 10 0";
        assert_eq!(
            parse_line(mapped),
            Some(Listener { ip: "198.19.0.7".parse().expect("ip"), port: 0x733C, inode: 778 })
        );
        for bad in ["", "sl local rem st", "0: zz:1F90 0:0 0A a b c d e 1"] {
            assert_eq!(parse_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_kernels_choice_of_listener_is_what_is_checked() {
        let l = |ip: &str, port, inode| Listener { ip: ip.parse().expect("ip"), port, inode };
        let all = [l("0.0.0.0", 22, 1), l("198.19.0.7", 29500, 2), l("0.0.0.0", 29500, 3), l("::", 80, 4)];
        let ip: IpAddr = "198.19.0.7".parse().expect("ip");
        // The exact address wins over the wildcard.
        assert_eq!(candidates(&all, ip, 29500), vec![all[1]]);
        assert_eq!(candidates(&all, ip, 22), vec![all[0]]);
        // An IPv6 wildcard socket takes IPv4 connections too.
        assert_eq!(candidates(&all, ip, 80), vec![all[3]]);
        assert!(candidates(&all, ip, 81).is_empty());
        assert!(candidates(&all, "fd00::1".parse().expect("ip"), 22).is_empty());
    }

    /// A listener of this process counts only when the process itself is the root that is
    /// asked for; a port nobody listens on is named as such.
    #[test]
    fn listeners_are_attributed_to_their_process() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let ip: IpAddr = "127.0.0.1".parse().expect("ip");
        let me = std::process::id() as i32;
        assert_eq!(JobPorts::new(me, true).check(ip, port), PortCheck::Job);
        assert_eq!(JobPorts::new(me, false).check(ip, port), PortCheck::Outside);
        drop(l);
        assert_eq!(JobPorts::new(me, true).check(ip, port), PortCheck::NotListening);
    }
}
