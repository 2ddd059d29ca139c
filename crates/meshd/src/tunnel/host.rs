//! What every round's tunnel on a node shares, and starting one round's tunnel.

use super::{Tunnel, TunnelConfig, TunnelStats, far};
use crate::transport::{Transport, TunnelStream};
use std::path::Path;
use std::sync::Arc;
use tokio::sync::{Mutex, mpsc};
use tracing::{info, warn};

/// The far end's queue of peers' tunnel streams, taken from the transport once and shared
/// by every restart round's [`Tunnel`].
pub type Incoming = Arc<Mutex<mpsc::Receiver<TunnelStream>>>;

/// Takes the transport's tunnel streams (once per transport).
pub fn incoming(t: &Transport) -> Option<Incoming> {
    t.take_tunnel_streams().map(|r| Arc::new(Mutex::new(r)))
}

/// What every round's tunnel on a node shares: the transport, the far end's queue of peers'
/// tunnel streams (taken from the transport once), the counters.
#[derive(Debug)]
pub struct Host {
    transport: Transport,
    incoming: Option<Incoming>,
    stats: Arc<TunnelStats>,
}

impl Host {
    /// Takes `transport`'s tunnel streams.
    pub fn new(transport: &Transport) -> Host {
        Host { transport: transport.clone(), incoming: incoming(transport), stats: Arc::default() }
    }

    /// Starts the tunnel of one round of `roster` on node `node_rank`, next to the local
    /// service's socket `service_socket` (in the job's owner-only directory); peers' ranks
    /// may reach meshd's own listeners `own_ports` too. Says why when it cannot (the ranks
    /// then run without it, and their connections to other nodes fail). `preload_lib`: the
    /// library the user gave ([`TunnelConfig::preload_lib`]).
    pub fn start_round(
        &self,
        roster: &meshd_proto::rendezvous::Roster,
        node_rank: usize,
        own_ports: &[u16],
        service_socket: Option<&Path>,
        preload_lib: Option<&Path>,
    ) -> Option<Tunnel> {
        start_for_round(roster, node_rank, own_ports, service_socket, preload_lib, self)
    }
}

fn start_for_round(
    roster: &meshd_proto::rendezvous::Roster,
    node_rank: usize,
    own_ports: &[u16],
    service_socket: Option<&Path>,
    preload_lib: Option<&Path>,
    host: &Host,
) -> Option<Tunnel> {
    let (transport, stats) = (&host.transport, &host.stats);
    let me = roster.members.get(node_rank)?;
    let (Some(dir), Some(incoming)) = (service_socket.and_then(Path::parent), host.incoming.as_ref()) else {
        warn!("tunnel mode, but no local service directory: the ranks' connections to other nodes will fail");
        return None;
    };
    let cfg = TunnelConfig {
        dir: dir.to_path_buf(),
        routes: roster
            .members
            .iter()
            .filter(|m| m.id != me.id)
            .map(|m| (m.addr.ip().to_canonical(), m.addr))
            .collect(),
        members: roster
            .members
            .iter()
            .filter(|m| m.id != me.id)
            .map(|m| (m.id, m.addr.ip().to_canonical()))
            .collect(),
        local_ip: me.addr.ip().to_canonical(),
        preload_lib: preload_lib.map(Path::to_path_buf),
        plane: true,
        job_root: std::process::id() as i32,
        job_root_itself: false,
        own_ports: own_ports.to_vec(),
        per_peer: far::MAX_PER_PEER,
        files: None,
    };
    match Tunnel::start(cfg, transport.clone(), incoming.clone(), stats.clone()) {
        Ok(t) => {
            let counters = stats.clone();
            transport.set_tunnel_stats(Some(Arc::new(move || counters.reply())));
            info!(
                "tunnel: the ranks' TCP connections to {} go through meshd (LD_PRELOAD {}); peers reach only \
                 ports this job's ranks listen on here; up to {} tunnelled connections (open files); \
                 the tunnelled fds behave as TCP sockets except to epoll registrations made before \
                 connect, io_uring, raw syscalls, sendfile/splice and SO_PEERCRED (docs/PROTOCOL.md, \
                 \"What cannot be made invisible\")",
                t.peers,
                t.lib.path().display(),
                t.capacity()
            );
            Some(t)
        }
        Err(e) => {
            warn!(
                "cannot start the tunnel in {}: {e}; the ranks' connections to other nodes will fail",
                dir.display()
            );
            None
        }
    }
}
