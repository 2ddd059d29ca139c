//! The round's other nodes as the tunnel routes and serves them, live (a node joining the
//! running job), and the peers file the ranks' preload library reads them from.

use meshd_proto::NodeId;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

/// The round's other nodes as the tunnel serves them: replaced while the round runs when
/// a node joins the running job (`--fault-tolerance node`, [`Tunnel::set_roster`](super::Tunnel::set_roster)).
#[derive(Debug, Default)]
pub(super) struct Routes {
    /// Their addresses on the chosen interface -> their meshd.
    pub(super) to: HashMap<IpAddr, SocketAddr>,
    /// Members whose streams are served: id -> roster address.
    pub(super) members: HashMap<NodeId, IpAddr>,
}

pub(super) type LiveRoutes = Arc<std::sync::RwLock<Routes>>;

pub(super) fn read_routes(r: &LiveRoutes) -> std::sync::RwLockReadGuard<'_, Routes> {
    r.read().unwrap_or_else(|p| p.into_inner())
}

/// `ips`, sorted, comma-separated (`MESHD_TUNNEL_PEERS` and the peers file).
pub(super) fn peer_list<'a>(ips: impl Iterator<Item = &'a IpAddr>) -> String {
    let mut v: Vec<IpAddr> = ips.copied().collect();
    v.sort();
    v.iter().map(|ip| ip.to_string()).collect::<Vec<_>>().join(",")
}

/// Writes the peers file whole (a temporary file renamed over it, owner-only): a rank that
/// reads it at the same moment sees the old list or the new one.
pub(super) fn write_peers_file(path: &Path, peers: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
    f.write_all(peers.as_bytes())?;
    drop(f);
    std::fs::rename(&tmp, path)
}
