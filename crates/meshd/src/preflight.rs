//! The preflight's IO: TCP listeners and connects between the roster's nodes, the report
//! exchange, and the common verdict (computed by `meshd_proto::preflight::evaluate`).

use crate::mesh::{Mesh, MeshError, MeshInput};
use meshd_proto::NodeId;
use meshd_proto::membership::MemberEvent;
use meshd_proto::nccl_id::UniqueId;
use meshd_proto::preflight::{self, Collective, NodeReport, TcpProbe, TcpTarget, Verdict};
use meshd_proto::rendezvous::{Message, Roster};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};

/// What this node contributes besides its TCP findings.
#[derive(Clone, Debug, Default)]
pub struct PreflightInput {
    /// Command line (shortened) and its hash.
    pub cmd: String,
    /// Hash of the full command.
    pub cmd_hash: u64,
    /// Processes per node.
    pub nproc: u32,
    /// GPUs found.
    pub gpus: u32,
    /// CUDA driver version.
    pub cuda_driver: u32,
    /// NCCL version.
    pub nccl_version: u32,
    /// `--collective nccl|quic|tunnel` when forced.
    pub forced: Option<Collective>,
    /// How long one TCP connect may take.
    pub connect_timeout: Duration,
    /// The NCCL unique id this node created (the master only).
    pub nccl_id: Option<Vec<u8>>,
    /// Why there is no id, when the master has none.
    pub nccl_note: String,
}

/// The verdict and the NCCL id every rank gets.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The same on every node.
    pub verdict: Verdict,
    /// The master's NCCL unique id (128 bytes), if it has one.
    pub nccl_id: Option<Vec<u8>>,
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

async fn dial(to: NodeId, addr: SocketAddr, what: TcpTarget, limit: Duration) -> TcpProbe {
    let res = tokio::time::timeout(limit, TcpStream::connect(addr)).await;
    let (ok, detail) = match res {
        Ok(Ok(_)) => (true, String::new()),
        Ok(Err(e)) => (false, e.to_string()),
        Err(_) => (false, format!("no answer within {limit:?} (packets dropped?)")),
    };
    TcpProbe { to, target: addr.to_string(), ok, detail, what }
}

/// Runs the preflight for `roster` and returns the verdict (the same on every node).
pub async fn run(
    mesh: &mut Mesh,
    roster: &Roster,
    input: &PreflightInput,
    timeout: Duration,
) -> Result<Outcome, MeshError> {
    let me = mesh.node();
    let ip = mesh.addr().ip();
    let restart = roster.restart;
    let deadline = Instant::now() + timeout;
    let io = |error: std::io::Error| MeshError::PreflightListener { ip, error };
    let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await.map_err(io)?;
    let port = listener.local_addr().map_err(io)?.port();
    let mut tasks = vec![tokio::spawn(accept_forever(listener))];
    let is_master = roster.master().map(|m| m.id) == Some(me);
    let mut own_problem = None;
    if is_master {
        match TcpListener::bind(SocketAddr::new(ip, roster.master_port)).await {
            Ok(l) => tasks.push(tokio::spawn(accept_forever(l))),
            Err(e) => {
                own_problem =
                    Some(format!("MASTER_PORT {} cannot be bound on the master: {e}", roster.master_port))
            }
        }
    }
    let hello_id = if is_master { input.nccl_id.clone() } else { None };
    mesh.broadcast(roster, Message::PreflightHello { restart, tcp_port: port, nccl_id: hello_id });
    let mut nccl_id = if is_master { input.nccl_id.clone() } else { None };

    let others: Vec<_> = roster.members.iter().filter(|m| m.id != me).cloned().collect();
    let mut ports: BTreeMap<NodeId, u16> = BTreeMap::new();
    let mut reports: BTreeMap<NodeId, NodeReport> = BTreeMap::new();
    let mut aborted = None;
    let mut kept: Vec<MeshInput> = Vec::new();
    // Phase 1: everyone's listener port.
    while ports.len() < others.len() && Instant::now() < deadline && aborted.is_none() {
        match mesh.next(Some(deadline)).await {
            None => return Err(MeshError::Closed),
            Some(input) => handle(
                input,
                restart,
                roster,
                &mut ports,
                &mut reports,
                &mut nccl_id,
                &mut aborted,
                &mut kept,
                mesh,
            ),
        }
    }
    // Phase 2: dial every other node's ephemeral port and the master port, in parallel.
    let limit = input.connect_timeout;
    let mut dials: Vec<tokio::task::JoinHandle<TcpProbe>> = Vec::new();
    for m in &others {
        if let Some(p) = ports.get(&m.id) {
            dials.push(tokio::spawn(dial(
                m.id,
                SocketAddr::new(m.addr.ip(), *p),
                TcpTarget::EphemeralPort,
                limit,
            )));
        }
        if roster.master().map(|x| x.id) == Some(m.id) {
            dials.push(tokio::spawn(dial(
                m.id,
                SocketAddr::new(m.addr.ip(), roster.master_port),
                TcpTarget::MasterPort,
                limit,
            )));
        }
    }
    let root = nccl_id
        .as_ref()
        .and_then(|b| <[u8; 128]>::try_from(b.as_slice()).ok())
        .and_then(|b| UniqueId(b).root());
    if let (Some(root), Some(master)) = (root, roster.master()) {
        let master_id = master.id;
        dials.push(tokio::spawn(async move {
            // NCCL's root is probed the way that is safe on every NCCL version.
            let r = tokio::task::spawn_blocking(move || crate::nccl_root::probe_root(root, limit)).await;
            let (ok, detail) = match r {
                Ok(Ok(())) => (true, String::new()),
                Ok(Err(e)) => (false, e.to_string()),
                Err(e) => (false, e.to_string()),
            };
            TcpProbe { to: master_id, target: root.to_string(), ok, detail, what: TcpTarget::NcclRoot }
        }));
    }
    // Keep the mesh going while the connects run: a dropped SYN costs a second or more, and
    // a node that answers no probe meanwhile is declared dead by the others.
    let mut pending: tokio::task::JoinSet<(usize, Option<TcpProbe>)> = tokio::task::JoinSet::new();
    for (i, d) in dials.into_iter().enumerate() {
        pending.spawn(async move { (i, d.await.ok()) });
    }
    let mut done: Vec<(usize, TcpProbe)> = Vec::new();
    while !pending.is_empty() && aborted.is_none() {
        tokio::select! {
            d = pending.join_next() => {
                if let Some(Ok((i, Some(p)))) = d {
                    done.push((i, p));
                }
            }
            input = mesh.next(None) => match input {
                None => return Err(MeshError::Closed),
                Some(input) => {
                    handle(input, restart, roster, &mut ports, &mut reports, &mut nccl_id, &mut aborted, &mut kept, mesh)
                }
            },
        }
    }
    done.sort_by_key(|(i, _)| *i);
    let mut tcp: Vec<TcpProbe> = done.into_iter().map(|(_, p)| p).collect();
    if let Some(p) = own_problem {
        tcp.push(TcpProbe {
            to: me,
            target: format!("{ip}:{}", roster.master_port),
            ok: false,
            detail: p,
            what: TcpTarget::MasterPort,
        });
    }
    let mine = NodeReport {
        tcp,
        cmd_hash: input.cmd_hash,
        cmd: input.cmd.clone(),
        nproc: input.nproc,
        gpus: input.gpus,
        cuda_driver: input.cuda_driver,
        nccl_version: input.nccl_version,
        mtu: mtu(&mesh.choice().name),
        iface: mesh.choice().name.clone(),
        nccl_root: if is_master { root.map(|r| r.to_string()).unwrap_or_default() } else { String::new() },
        nccl_note: if is_master { input.nccl_note.clone() } else { String::new() },
    };
    reports.insert(me, mine.clone());
    mesh.broadcast(roster, Message::PreflightReport { restart, report: mine });
    // Phase 3: everyone's report.
    while reports.len() < roster.members.len() && Instant::now() < deadline && aborted.is_none() {
        match mesh.next(Some(deadline)).await {
            None => return Err(MeshError::Closed),
            Some(input) => handle(
                input,
                restart,
                roster,
                &mut ports,
                &mut reports,
                &mut nccl_id,
                &mut aborted,
                &mut kept,
                mesh,
            ),
        }
    }
    for t in tasks {
        t.abort();
    }
    mesh.put_back(kept);
    if let Some(reason) = aborted {
        return Err(MeshError::Aborted(reason));
    }
    Ok(Outcome { verdict: preflight::evaluate(roster, &reports, input.forced), nccl_id })
}

#[allow(clippy::too_many_arguments)]
fn handle(
    input: MeshInput,
    restart: u32,
    roster: &Roster,
    ports: &mut BTreeMap<NodeId, u16>,
    reports: &mut BTreeMap<NodeId, NodeReport>,
    nccl_id: &mut Option<Vec<u8>>,
    aborted: &mut Option<String>,
    kept: &mut Vec<MeshInput>,
    mesh: &mut Mesh,
) {
    let member = |id: NodeId| roster.node_rank(id).is_some();
    match input {
        MeshInput::Rdzv(from, Message::PreflightHello { restart: r, tcp_port, nccl_id: id })
            if r == restart && member(from) =>
        {
            ports.insert(from, tcp_port);
            if roster.master().map(|m| m.id) == Some(from) && id.as_ref().is_some_and(|b| b.len() == 128) {
                *nccl_id = id;
            }
        }
        MeshInput::Rdzv(from, Message::PreflightReport { restart: r, report })
            if r == restart && member(from) =>
        {
            reports.insert(from, report);
        }
        // Only the roster of this round may stop it: a straggler of an earlier job with the
        // same run id (an earlier srun step) must not.
        MeshInput::Rdzv(from, Message::Abort { restart: r, reason, .. }) if r == restart && member(from) => {
            *aborted = Some(reason)
        }
        // A faster node's ranks may already use the store: keep it for the job.
        s @ MeshInput::Store(..) => kept.push(s),
        MeshInput::Rdzv(from, m @ Message::Propose(_)) => mesh.defer(from, m),
        MeshInput::Member(MemberEvent::Down(id) | MemberEvent::Left(id)) if member(id) => {
            let who = roster
                .members
                .iter()
                .find(|m| m.id == id)
                .map(|m| m.addr.ip().to_string())
                .unwrap_or_default();
            *aborted = Some(format!("node {who} stopped answering during the preflight"));
        }
        _ => {}
    }
}
