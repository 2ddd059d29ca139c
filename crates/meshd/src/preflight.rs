//! The preflight's IO edges: the TCP listeners a node opens and the connects it makes
//! (the exchanges and the verdict are the `Node` core's, `meshd_proto::node`).

use meshd_proto::NodeId;
use meshd_proto::nccl_id::UniqueId;
use meshd_proto::node::{DialTarget, LocalFacts};
use meshd_proto::preflight::{TcpProbe, TcpTarget};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// What this node contributes besides its TCP findings.
#[derive(Clone, Debug, Default)]
pub struct PreflightInput {
    /// The facts the core compares across the roster (command, processes, GPUs, versions,
    /// `--collective` when forced); the interface's (`iface`, `mtu`) and `tunnel` are the
    /// mesh's, set when the core starts.
    pub facts: LocalFacts,
    /// How long one TCP connect may take.
    pub connect_timeout: Duration,
    /// The NCCL unique id this node created (the master only).
    pub nccl_id: Option<Vec<u8>>,
    /// Why there is no id, when the master has none.
    pub nccl_note: Option<String>,
}

/// The MASTER_PORT a round offers on `ip`: `wanted` (`--master-port`) when it is free
/// there, else a free port (bound and released), else torchrun's default 29500. The one
/// place every round, job or library, gets it from.
pub fn master_port(ip: IpAddr, wanted: Option<u16>) -> u16 {
    let free = |p: u16| std::net::TcpListener::bind(SocketAddr::new(ip, p)).ok()?.local_addr().ok();
    wanted.filter(|p| free(*p).is_some()).or_else(|| free(0).map(|a| a.port())).unwrap_or(29500)
}

/// MTU of `iface` (0 if unknown).
pub fn mtu(iface: &str) -> u32 {
    std::fs::read_to_string(format!("/sys/class/net/{iface}/mtu"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

async fn accept_forever(l: TcpListener) {
    while let Ok((s, _)) = l.accept().await {
        drop(s);
    }
}

/// The preflight's listeners (the ephemeral port, and MASTER_PORT on the master); they
/// accept until dropped, which is at the end of the round's preflight.
#[derive(Debug, Default)]
pub struct Listeners(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Listeners {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// The preflight's listener could not be bound on the chosen address. The io error is part
/// of the message, not a source (the report prints one line).
#[derive(Debug, thiserror::Error)]
#[error("preflight listener on {ip}: {error}")]
pub struct ListenerError {
    /// The chosen interface's address.
    pub ip: IpAddr,
    /// Why.
    pub error: std::io::Error,
}

/// Binds node `me`'s preflight listener on `ip` (and MASTER_PORT when `master_port` is given, on
/// the master). Returns its port, the listeners, and this node's own failures (MASTER_PORT
/// taken); `Err` when not even the ephemeral listener can be bound.
pub async fn bind(
    me: NodeId,
    ip: IpAddr,
    master_port: Option<u16>,
) -> Result<(u16, Listeners, Vec<TcpProbe>), ListenerError> {
    let io = |error: std::io::Error| ListenerError { ip, error };
    let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await.map_err(io)?;
    let port = listener.local_addr().map_err(io)?.port();
    let mut tasks = Listeners(vec![tokio::spawn(accept_forever(listener))]);
    let mut problems = Vec::new();
    if let Some(mp) = master_port {
        match TcpListener::bind(SocketAddr::new(ip, mp)).await {
            Ok(l) => tasks.0.push(tokio::spawn(accept_forever(l))),
            Err(e) => problems.push(TcpProbe {
                to: me,
                target: format!("{ip}:{mp}"),
                ok: false,
                detail: format!("MASTER_PORT {mp} cannot be bound on the master: {e}"),
                what: TcpTarget::MasterPort,
            }),
        }
    }
    Ok((port, tasks, problems))
}

async fn dial(to: NodeId, addr: SocketAddr, what: TcpTarget, limit: Duration) -> TcpProbe {
    let res = tokio::time::timeout(limit, TcpStream::connect(addr)).await;
    let (ok, detail) = match res {
        Ok(Ok(_)) => (true, String::new()),
        Ok(Err(e)) => (false, e.to_string()),
        Err(_) => (false, format!("no answer within {limit:?} (packets dropped?)")),
    };
    TcpProbe { to, target: addr.to_string(), ok, detail, what }
}

/// Dials every target in parallel (each bounded by `limit`), and the NCCL id's root when
/// an id is given (`master`: the id's owner). Returns the results in target order, the
/// NCCL root probe last, and the root's address as decoded here.
pub async fn dial_all(
    targets: Vec<DialTarget>,
    nccl_id: Option<Vec<u8>>,
    master: Option<NodeId>,
    limit: Duration,
) -> (Vec<TcpProbe>, Option<String>) {
    let mut set = tokio::task::JoinSet::new();
    for (i, t) in targets.into_iter().enumerate() {
        set.spawn(async move { (i, dial(t.to, t.addr, t.what, limit).await) });
    }
    let root = nccl_id
        .as_ref()
        .and_then(|b| <[u8; 128]>::try_from(b.as_slice()).ok())
        .and_then(|b| UniqueId(b).root());
    if let (Some(root), Some(master_id)) = (root, master) {
        set.spawn(async move {
            // NCCL's root is probed the way that is safe on every NCCL version.
            let r = tokio::task::spawn_blocking(move || crate::nccl_root::probe_root(root, limit)).await;
            let (ok, detail) = match r {
                Ok(Ok(())) => (true, String::new()),
                Ok(Err(e)) => (false, e.to_string()),
                Err(e) => (false, e.to_string()),
            };
            let p =
                TcpProbe { to: master_id, target: root.to_string(), ok, detail, what: TcpTarget::NcclRoot };
            (usize::MAX, p)
        });
    }
    let mut done = Vec::new();
    while let Some(r) = set.join_next().await {
        if let Ok(x) = r {
            done.push(x);
        }
    }
    done.sort_by_key(|(i, _)| *i);
    (done.into_iter().map(|(_, p)| p).collect(), root.map(|r| r.to_string()))
}
