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
