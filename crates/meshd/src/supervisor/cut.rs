//! Ending the job's TCP connections to a lost host, from outside the ranks.
//!
//! When a node dies without a word (power, kernel panic, a cut link), its peers' TCP
//! connections to it stay ESTABLISHED: nothing comes back to say otherwise, and a rank
//! blocked in a Gloo or NCCL-socket collective with it waits for the library's own timeout
//! (Gloo: 30 min by default, torchft's usual 60 s) before its fault tolerance can act.
//! meshd knows sooner (the mesh declares the node dead in about 2 s), and it ends those
//! connections itself, so that the ranks' blocked reads and writes fail at once and
//! torchft's next quorum forms without the dead group.
//!
//! How: the job's sockets connected to the lost host are found in `/proc/net/tcp{,6}`
//! (remote address, not LISTEN, not TIME_WAIT) and matched to their processes by the
//! `socket:[inode]` links in `/proc/PID/fd` of meshd's descendants. meshd duplicates each
//! such descriptor out of the rank (`pidfd_getfd`, which needs the ptrace access a parent
//! has over its children) and calls `shutdown(SHUT_RDWR)` on it: shutdown acts on the
//! socket the rank shares, so the rank's blocked `recv` returns end of file and its
//! `send` fails with EPIPE. Only the job's own connections are touched: another process's
//! connection to that host (an ssh session, a monitoring agent) is left alone.

use super::orphans::tree;
use super::sockets::{self, TCP_CLOSE, TCP_LISTEN, TCP_TIME_WAIT};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// What [`cut_connections_to`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Cut {
    /// Connections of the job to the host that were shut down.
    pub cut: usize,
    /// Processes whose connections were shut down.
    pub processes: usize,
    /// What could not be done, in words (a process's descriptor that could not be taken).
    pub failed: Vec<String>,
}

/// Whether a socket is a live connection (not a listener, not TIME_WAIT or CLOSE, which
/// no process holds any more).
fn live(s: &sockets::SocketLine) -> bool {
    ![TCP_LISTEN, TCP_TIME_WAIT, TCP_CLOSE].contains(&s.state) && s.inode != 0
}

/// The inodes of the live connections in `all` to `ip`.
pub fn sockets_to(all: &[sockets::SocketLine], ip: IpAddr) -> HashSet<u64> {
    let ip = ip.to_canonical();
    all.iter().filter(|s| live(s) && s.remote.0 == ip).map(|s| s.inode).collect()
}

/// The inodes of the live connections in `all` to any of `peers` whose ends are neither
/// of them in `keep` (the torchft groups' managers and stores: what the next quorum needs).
pub fn sockets_to_peers_except(
    all: &[sockets::SocketLine],
    peers: &[IpAddr],
    keep: &[SocketAddr],
) -> HashSet<u64> {
    let peers: Vec<IpAddr> = peers.iter().map(|p| p.to_canonical()).collect();
    let keep: Vec<(IpAddr, u16)> = keep.iter().map(|k| (k.ip().to_canonical(), k.port())).collect();
    all.iter()
        .filter(|s| live(s) && peers.contains(&s.remote.0))
        .filter(|s| !keep.contains(&s.remote) && !keep.contains(&s.local))
        .map(|s| s.inode)
        .collect()
}

/// `pid`'s descriptors that are sockets among `inodes`.
fn fds_of(pid: i32, inodes: &HashSet<u64>) -> Vec<RawFd> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    let mut fds = Vec::new();
    for e in dir.flatten() {
        let Ok(link) = std::fs::read_link(e.path()) else { continue };
        let link = link.to_string_lossy();
        let inode =
            link.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')).and_then(|n| n.parse().ok());
        if inode.is_some_and(|i: u64| inodes.contains(&i)) {
            if let Ok(fd) = e.file_name().to_string_lossy().parse() {
                fds.push(fd);
            }
        }
    }
    fds
}

/// A descriptor of `pid`'s, duplicated into this process.
fn take_fd(pid: i32, fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pidfd_open returned a descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&pidfd);
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in that process and flags.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, raw, fd, 0) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pidfd_getfd returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(got as RawFd) })
}

/// Shuts down every TCP connection that `root`'s descendants (the job's processes) hold
/// to any of `ips`. Reads /proc and makes syscalls: call it off the runtime's workers.
pub fn cut_connections_to(root: i32, ips: &[IpAddr]) -> Cut {
    let all = sockets::sockets();
    cut_inodes(root, ips.iter().flat_map(|ip| sockets_to(&all, *ip)).collect())
}

/// Shuts down the connections among `inodes` that `root`'s descendants hold.
pub fn cut_inodes(root: i32, inodes: HashSet<u64>) -> Cut {
    let mut cut = Cut::default();
    if inodes.is_empty() {
        return cut;
    }
    let mut done: HashSet<u64> = HashSet::new();
    let mut per_pid: HashMap<i32, usize> = HashMap::new();
    for pid in tree(root, false) {
        for fd in fds_of(pid, &inodes) {
            // The same socket in several processes (fork, dup) is shut down once; its
            // inode is read again to be sure the number still names it.
            let inode = fd_inode(pid, fd);
            if inode.is_none_or(|i| done.contains(&i)) {
                continue;
            }
            match take_fd(pid, fd) {
                Ok(own) => {
                    // SAFETY: shutdown on a descriptor we own; an error (ENOTCONN: it closed
                    // meanwhile) is harmless.
                    let r = unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&own), libc::SHUT_RDWR) };
                    if r == 0 {
                        done.extend(inode);
                        *per_pid.entry(pid).or_default() += 1;
                    }
                }
                Err(e) => cut.failed.push(format!("process {pid} fd {fd}: {e}")),
            }
        }
    }
    cut.cut = done.len();
    cut.processes = per_pid.len();
    cut
}

fn fd_inode(pid: i32, fd: RawFd) -> Option<u64> {
    let link = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()?;
    link.to_string_lossy().strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    /// A child's connection to a host is shut down from outside: its blocked read returns
    /// at once. A connection of this process (not a descendant) to the same host is left
    /// alone, as is the child's connection to another host.
    #[test]
    fn a_childs_connections_to_a_host_are_shut_down_and_others_are_left() {
        // 127.0.0.3: no other test's processes talk to it.
        let l = std::net::TcpListener::bind("127.0.0.3:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        // The child: connects, says so, and blocks reading; prints how the read ended.
        let script = format!(
            "import socket,sys,time\n\
             c=socket.create_connection(('127.0.0.3',{port}))\n\
             print('connected',flush=True)\n\
             t=time.time()\n\
             try:\n  d=c.recv(1); print('read', len(d), round(time.time()-t,2), flush=True)\n\
             except OSError as e: print('error', e.errno, flush=True)\n"
        );
        let mut child = std::process::Command::new("python3")
            .args(["-c", &script])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let (mut theirs, _) = l.accept().expect("accept");
        let mut mine = std::net::TcpStream::connect(("127.0.0.3", port)).expect("connect");
        let (mut mine_far, _) = l.accept().expect("accept");
        let mut out = child.stdout.take().expect("stdout");
        let mut buf = [0u8; 10];
        let n = out.read(&mut buf).expect("read");
        assert!(std::str::from_utf8(&buf[..n]).unwrap_or("").starts_with("connected"));
        // Another host: nobody's connection to it is counted.
        assert_eq!(
            cut_connections_to(std::process::id() as i32, &["127.0.0.4".parse().expect("ip")]),
            Cut::default()
        );
        let t = Instant::now();
        let cut = cut_connections_to(std::process::id() as i32, &["127.0.0.3".parse().expect("ip")]);
        assert_eq!((cut.cut, cut.processes), (1, 1), "{cut:?}");
        assert!(cut.failed.is_empty(), "{cut:?}");
        let mut rest = String::new();
        out.read_to_string(&mut rest).expect("read");
        let _ = child.wait();
        // The first read may have stopped short of "connected"'s newline.
        assert!(rest.trim_start().starts_with("read 0"), "the child's blocked read ended: {rest:?}");
        assert!(t.elapsed() < Duration::from_secs(5));
        // This process's own connection still works both ways.
        mine.write_all(b"x").expect("write");
        let mut b = [0u8; 1];
        mine_far.read_exact(&mut b).expect("read");
        mine_far.write_all(b"y").expect("write");
        mine.read_exact(&mut b).expect("read");
        assert_eq!(&b, b"y");
        // The child's far end saw the connection end too.
        theirs.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        assert_eq!(theirs.read(&mut b).expect("read"), 0);
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn only_live_connections_to_the_host_count() {
        let line = |st: &str, inode: u32| {
            format!(
                "   0: 0700C6C6:9C40 1E0013C6:7530 {st} 00000000:00000000 00:00000000 00000000     0        0 {inode} 1 0000000000000000 100 0 0 10 0"
            )
        };
        let all: Vec<_> = [line("01", 10), line("06", 11), line("0A", 12), line("08", 13)]
            .iter()
            .filter_map(|l| sockets::parse_socket(l))
            .collect();
        assert_eq!(all.len(), 4);
        let host: IpAddr = "198.19.0.30".parse().expect("ip");
        assert_eq!(sockets_to(&all, host), HashSet::from([10, 13]));
        assert!(sockets_to(&all, "198.19.0.7".parse().expect("ip")).is_empty());
        // To the peers, but not the managers' and stores' endpoints, either way round.
        let peers: [IpAddr; 1] = [host];
        assert_eq!(sockets_to_peers_except(&all, &peers, &[]), HashSet::from([10, 13]));
        let remote: SocketAddr = "198.19.0.30:30000".parse().expect("addr");
        assert!(sockets_to_peers_except(&all, &peers, &[remote]).is_empty());
        let local: SocketAddr = "198.198.0.7:40000".parse().expect("addr");
        assert!(sockets_to_peers_except(&all, &peers, &[local]).is_empty());
        let elsewhere: SocketAddr = "198.19.0.30:30001".parse().expect("addr");
        assert_eq!(sockets_to_peers_except(&all, &peers, &[elsewhere]).len(), 2);
    }
}
