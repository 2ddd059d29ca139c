//! The TCP tunnel (tunnel mode): the TCP connections a rank opens to another roster node
//! travel over meshd's authenticated QUIC connection to that node, so an unmodified job
//! (`init_process_group("gloo")`, TCPStore, user sockets) runs where only meshd's UDP port
//! is open between the nodes.
//!
//! Near end: `libmeshd_preload.so` (crates/meshd-preload, embedded in this binary and
//! written next to the job's sockets) interposes `connect()` in every rank; a connect to a
//! roster node's address becomes a connection to this node's tunnel socket (a Unix socket in
//! the job's owner-only directory, same user only) carrying a 22-byte request (the
//! destination). meshd opens a bidirectional QUIC stream to the destination node's meshd
//! ([`Transport::open_tunnel`]), which connects to the destination locally and answers one
//! status byte; the rank gets that status (ok, or an errno), then both meshds copy bytes
//! both ways: on the QUIC stream, or as the data plane's datagrams where it is ready
//! ([`plane_stream`]: opening, end and reset stay on the QUIC stream). End of stream is passed on as a half-close (`shutdown(SHUT_WR)` / QUIC FIN),
//! a failure as a reset (QUIC RESET_STREAM, TCP RST on the far end; the rank's Unix socket
//! is closed without a half-close first, which the preload library reports to the rank as
//! ECONNRESET).
//!
//! Far end ([`far`]): a peer's tunnel stream is served only when it comes from a roster
//! member's own address, for this node's roster address, on a port where a process of this
//! job listens ([`listeners`]); anything else is refused and logged once per peer and reason.
//! Both ends cap the connections one peer may hold ([`far::MAX_PER_PEER`]) and share the
//! node's open files ([`Budget`]); a round's tasks, and every connection they carry, end
//! with the round's [`Tunnel`].

mod far;
pub mod listeners;
mod plane_stream;

mod budget;
mod conns;
mod host;
mod near;
mod pipe;
mod preload;
mod routes;
mod stats;

use crate::transport::{TUNNEL_REQUEST_LEN, Transport};
use meshd_proto::NodeId;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

/// The request's wire: crates/meshd-preload's own file, compiled here too (that crate
/// cannot be a dependency: it exports `connect`). On the tunnel socket a request comes
/// marked [`wire::VERSION_PADDED`] and is forwarded to the far end as [`wire::VERSION`].
#[path = "../../meshd-preload/src/wire.rs"]
#[allow(dead_code)] // the library's side (padded requests, its peers variable) unused here
mod wire;

const _: () = assert!(TUNNEL_REQUEST_LEN == wire::REQUEST_LEN);

pub use wire::{decode_request, encode_request};

pub use budget::Budget;
use conns::{Conns, canonical};
pub use host::{Host, Incoming, incoming};
use near::Near;
use pipe::{BLOCK, Ends, MIN_READ, RESET, pipe, reset_on_close, write_all_chunks};
pub use preload::{PRELOAD, Preload};
use routes::{LiveRoutes, Routes, peer_list, read_routes, write_peers_file};
pub use stats::{TunnelStats, report};

/// What one round's tunnel needs.
#[derive(Clone, Debug)]
pub struct TunnelConfig {
    /// The job's owner-only socket directory (the local service's).
    pub dir: PathBuf,
    /// Every other roster node: its address on the chosen interface -> its meshd.
    pub routes: HashMap<IpAddr, SocketAddr>,
    /// Roster members whose tunnel streams this node serves: id -> roster address (a
    /// stream must come from that address).
    pub members: HashMap<NodeId, IpAddr>,
    /// This node's roster address: the only destination served for peers.
    pub local_ip: IpAddr,
    /// The process whose descendants are the job (meshd itself): the far end connects only
    /// to ports they listen on ([`listeners::JobPorts`]).
    pub job_root: i32,
    /// Count `job_root`'s own listeners as the job's (a test process playing both parts).
    pub job_root_itself: bool,
    /// meshd's own listeners on this node's roster address that peers' ranks may reach
    /// (`--fault-tolerance node`: the replica group's TCPStore, which the other groups use
    /// for torchft's cross-group rendezvous).
    pub own_ports: Vec<u16>,
    /// Tunnelled connections one other node may hold with this one, each way
    /// ([`far::MAX_PER_PEER`] in a job).
    pub per_peer: usize,
    /// Tunnelled connections this node holds at most, both ends together; `None`: what its
    /// open files allow ([`Budget::for_this_process`]).
    pub files: Option<usize>,
    /// The preload library the ranks load, when the user gave one (the CLI's
    /// `MESHD_PRELOAD_LIB`); else meshd writes its embedded copy to `dir`.
    pub preload_lib: Option<PathBuf>,
    /// Whether tunnelled bytes may travel on the data plane where it runs
    /// ([`plane_stream`]; `MESHD_PLANE=0` turns the plane off altogether).
    pub plane: bool,
}

/// A running tunnel; dropping it stops it and removes its socket, peers file and library.
#[derive(Debug)]
pub struct Tunnel {
    socket: PathBuf,
    peers_file: PathBuf,
    lib: Preload,
    peers: String,
    local_ip: IpAddr,
    routes: LiveRoutes,
    conns: Arc<Conns>,
    tasks: Vec<JoinHandle<()>>,
    stats: Arc<TunnelStats>,
    budget: Arc<Budget>,
}

impl Tunnel {
    /// Binds the tunnel socket in `cfg.dir`, writes the preload library there and serves
    /// both ends.
    pub fn start(
        cfg: TunnelConfig,
        transport: Transport,
        incoming: Incoming,
        stats: Arc<TunnelStats>,
    ) -> std::io::Result<Tunnel> {
        let socket = cfg.dir.join("tunnel");
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)?;
        std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let lib = Preload::write(&cfg.dir, cfg.preload_lib.as_deref())?;
        let peers = peer_list(cfg.routes.keys());
        let peers_file = cfg.dir.join("tunnel-peers");
        write_peers_file(&peers_file, &peers)?;
        let routes: LiveRoutes =
            Arc::new(std::sync::RwLock::new(Routes { to: cfg.routes.clone(), members: cfg.members.clone() }));
        let conns = Arc::new(Conns::default());
        let budget = Arc::new(cfg.files.map_or_else(Budget::for_this_process, Budget::new));
        let local_ip = cfg.local_ip;
        let plane = transport.plane().filter(|_| cfg.plane).cloned();
        let far = Arc::new(far::Far {
            plane: plane.clone(),
            ports: Arc::new(listeners::JobPorts::new(cfg.job_root, cfg.job_root_itself)),
            cfg: Arc::new(cfg),
            routes: routes.clone(),
            conns: conns.clone(),
            stats: stats.clone(),
            budget: budget.clone(),
            logged: Default::default(),
            per_peer: Default::default(),
        });
        let near = Near {
            plane,
            cfg: far.cfg.clone(),
            routes: routes.clone(),
            conns: conns.clone(),
            transport,
            stats: stats.clone(),
            budget: budget.clone(),
            per_peer: Default::default(),
        };
        let tasks = vec![tokio::spawn(near.serve(listener)), tokio::spawn(far::far(incoming, far))];
        Ok(Tunnel { socket, peers_file, lib, peers, local_ip, routes, conns, tasks, stats, budget })
    }

    /// The running job's roster changed (`--fault-tolerance node`: a node joined in a lost
    /// node's slot or a new one): its address is routed and its streams served from now on,
    /// and the ranks' preload library finds it in the peers file.
    pub fn set_roster(&mut self, roster: &meshd_proto::rendezvous::Roster, me: NodeId) {
        let others = || roster.members.iter().filter(|m| m.id != me);
        let routes = Routes {
            to: others().map(|m| (m.addr.ip().to_canonical(), m.addr)).collect(),
            members: others().map(|m| (m.id, m.addr.ip().to_canonical())).collect(),
        };
        let peers = peer_list(routes.to.keys());
        *self.routes.write().unwrap_or_else(|p| p.into_inner()) = routes;
        if peers != self.peers {
            if let Err(e) = write_peers_file(&self.peers_file, &peers) {
                warn!(
                    "tunnel: cannot write {}: {e}; the ranks' connections to nodes that joined since they started \
                     will not go through the tunnel",
                    self.peers_file.display()
                );
            }
            debug!("tunnel: peers now {peers}");
            self.peers = peers;
        }
    }

    /// Ends, as failures (the ranks see their connections reset), the tunnelled connections
    /// with `lost`, and with `abort`'s peers except those whose listening end is one of its
    /// `keep` endpoints (the quorum's managers and stores). Returns how many.
    pub fn cut(&self, lost: IpAddr, abort: Option<&meshd_proto::node::AbortGroup>) -> usize {
        let lost = lost.to_canonical();
        let peers: Vec<IpAddr> =
            abort.map(|a| a.peers.iter().map(|p| p.to_canonical()).collect()).unwrap_or_default();
        let keep: Vec<SocketAddr> =
            abort.map(|a| a.keep.iter().copied().map(canonical).collect()).unwrap_or_default();
        self.conns.cut(|peer, listener| peer == lost || (peers.contains(&peer) && !keep.contains(&listener)))
    }

    /// This node's roster address (the far end's only destination).
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// Tunnelled connections this node can hold (both ends together).
    pub fn capacity(&self) -> usize {
        self.budget.capacity()
    }

    /// The ranks' environment: `LD_PRELOAD` (the library first, then `user_preload`),
    /// `MESHD_TUNNEL`, `MESHD_TUNNEL_PEERS`, `MESHD_TUNNEL_PEERS_FILE`.
    pub fn env(&self, user_preload: Option<&str>) -> Vec<(String, String)> {
        vec![
            self.lib.env(user_preload),
            ("MESHD_TUNNEL".into(), self.socket.display().to_string()),
            ("MESHD_TUNNEL_PEERS".into(), self.peers.clone()),
            ("MESHD_TUNNEL_PEERS_FILE".into(), self.peers_file.display().to_string()),
        ]
    }

    /// The preload library the ranks load.
    pub fn preload(&self) -> &Preload {
        &self.lib
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<TunnelStats> {
        &self.stats
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.peers_file);
    }
}

#[cfg(test)]
mod tests;
