//! Why the UDP port could not be bound, in words: who holds it (from /proc).

use super::*;

/// The one message of a failed bind.
pub(super) fn bind_failure_text(addr: SocketAddr, error: &std::io::Error, holder: Option<&str>) -> String {
    let port = addr.port();
    match (error.kind(), holder) {
        (std::io::ErrorKind::AddrInUse, Some(h)) => format!(
            "cannot bind UDP {addr}: {error}: UDP port {port} is held by {h} (another meshd? stop it, or \
             choose another port with --port)"
        ),
        (std::io::ErrorKind::AddrInUse, None) => format!(
            "cannot bind UDP {addr}: {error} (another meshd? stop it, or choose another port with --port)"
        ),
        _ => format!("cannot bind UDP {addr}: {error}"),
    }
}

pub(super) fn bind_error(addr: SocketAddr, error: std::io::Error) -> TransportError {
    let holder =
        if error.kind() == std::io::ErrorKind::AddrInUse { udp_port_holder(addr.port()) } else { None };
    TransportError::Bind { addr, error, holder }
}

/// Who holds UDP `port`, best effort: the socket's inode from /proc/net/udp{,6}, then the
/// process with that socket among /proc/*/fd ("pid 1234 (python3)"). `None` when it cannot
/// be seen (another user's process, another network namespace).
pub fn udp_port_holder(port: u16) -> Option<String> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/udp", "/proc/net/udp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let Some(local) = f.get(1) else { continue };
            let p = local.rsplit_once(':').and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if p == Some(port) {
                if let Some(inode) = f.get(9).filter(|i| **i != "0") {
                    inodes.push(format!("socket:[{inode}]"));
                }
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    for proc in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = proc.file_name();
        let Some(pid) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else { continue };
        let Ok(fds) = std::fs::read_dir(proc.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else { continue };
            if inodes.iter().any(|i| target.as_os_str() == i.as_str()) {
                let comm = std::fs::read_to_string(proc.path().join("comm")).unwrap_or_default();
                return Some(format!("pid {pid} ({})", comm.trim()));
            }
        }
    }
    None
}
