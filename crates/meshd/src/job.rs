//! `meshd run`'s job loop: rendezvous, spawn the local ranks with torchrun's environment,
//! supervise, and stop everything everywhere when any part fails.
//!
//! Failure paths, each ending every rank on every node within seconds:
//! - a local rank exits non-zero: this node broadcasts `Abort` and stops its ranks;
//! - an `Abort` arrives: stop local ranks;
//! - a roster member is declared dead: broadcast `Abort`; one that leaves gracefully before
//!   saying `Done` is blamed only if no `Abort` follows within [`LEFT_GRACE`] (a node that
//!   got an `Abort` leaves at once, and its `Left` may overtake that `Abort` to us);
//! - SIGINT/SIGTERM: broadcast `Abort`, stop, exit 130/143 (never restarted).
//!
//! Success: every local rank exited 0, this node says `Done` (repeated until every member
//! said it too), and exits 0 once every roster member is done.

use crate::collective::RingNet;
use crate::collective::service::{self, Service, ServiceConfig};
use crate::mesh::{Mesh, MeshError, MeshInput};
use crate::nccl_root::NcclRoot;
use crate::preflight::{self, PreflightInput};
use crate::signals::{Signals, Stop};
use crate::supervisor::{self, RankSpec, Supervisor};
use meshd_proto::membership::MemberEvent;
use meshd_proto::rendezvous::{Message, RdzvConfig, Roster};
use meshd_proto::{NodeId, NodeState};
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tracing::{error, info, warn};

/// What `meshd run` was asked to do.
#[derive(Clone, Debug)]
pub struct JobConfig {
    /// The command and its arguments.
    pub cmd: Vec<String>,
    /// Processes per node.
    pub nproc: u32,
    /// Restarts allowed after a failure.
    pub max_restarts: u32,
    /// Rendezvous sizes and timing.
    pub rdzv: RdzvConfig,
    /// Give up waiting for nodes after this.
    pub rdzv_timeout: Duration,
    /// Per-rank log files.
    pub log_dir: Option<PathBuf>,
    /// What the preflight compares (and `--collective` when forced).
    pub preflight: PreflightInput,
    /// SIGTERM to SIGKILL.
    pub grace: Duration,
}

/// How a job ended on this node.
#[derive(Debug)]
pub struct JobOutcome {
    /// meshd's exit status.
    pub code: u8,
    /// One line saying what happened.
    pub message: String,
}

/// A free TCP port on `ip` (bound then released: MASTER_PORT).
pub fn free_tcp_port(ip: IpAddr) -> std::io::Result<u16> {
    Ok(TcpListener::bind(SocketAddr::new(ip, 0))?.local_addr()?.port())
}

/// The environment of one rank: torchrun's variables plus meshd's.
#[allow(clippy::too_many_arguments)]
pub fn rank_env(
    roster: &Roster,
    node_rank: usize,
    local_rank: u32,
    iface: &str,
    node_addr: IpAddr,
    run_id: &str,
    max_restarts: u32,
    collective: &str,
    user_has: &dyn Fn(&str) -> bool,
) -> Vec<(String, String)> {
    let me = &roster.members[node_rank];
    let master = &roster.members[0];
    let global = roster.first_global_rank(node_rank) + local_rank;
    let world = roster.world_size();
    let mut env: Vec<(String, String)> = vec![
        ("RANK".into(), global.to_string()),
        ("LOCAL_RANK".into(), local_rank.to_string()),
        ("WORLD_SIZE".into(), world.to_string()),
        ("LOCAL_WORLD_SIZE".into(), me.nproc.to_string()),
        ("GROUP_RANK".into(), node_rank.to_string()),
        ("NODE_RANK".into(), node_rank.to_string()),
        ("GROUP_WORLD_SIZE".into(), roster.members.len().to_string()),
        ("ROLE_NAME".into(), "default".into()),
        ("ROLE_RANK".into(), global.to_string()),
        ("ROLE_WORLD_SIZE".into(), world.to_string()),
        ("MASTER_ADDR".into(), master.addr.ip().to_string()),
        ("MASTER_PORT".into(), roster.master_port.to_string()),
        ("TORCHELASTIC_RUN_ID".into(), run_id.to_string()),
        ("TORCHELASTIC_RESTART_COUNT".into(), roster.restart.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS".into(), max_restarts.to_string()),
        ("MESHD_IFACE".into(), iface.to_string()),
        ("MESHD_NODE_ADDR".into(), node_addr.to_string()),
        ("MESHD_COLLECTIVE".into(), collective.to_string()),
    ];
    let defaults = [
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".to_string(), true),
        ("OMP_NUM_THREADS", "1".to_string(), me.nproc > 1),
        // `=eth1`: NCCL's exact-name match, so eth10 is never taken for eth1.
        ("NCCL_SOCKET_IFNAME", format!("={iface}"), true),
        ("GLOO_SOCKET_IFNAME", iface.to_string(), true),
    ];
    for (k, v, when) in defaults {
        if when && !user_has(k) {
            env.push((k.into(), v));
        }
    }
    env
}

/// How long a roster member's graceful leave (without `Done`) waits for the `Abort` that
/// usually explains it before the member itself is blamed.
pub const LEFT_GRACE: Duration = Duration::from_secs(2);

enum Failure {
    /// A failure that may be restarted.
    Job(String),
    /// A signal: stop, never restart.
    Signal(String, u8),
}

/// The outcome of a stop request that came while no rank ran.
fn stopped(s: Stop, when: &str) -> JobOutcome {
    JobOutcome { code: s.exit_code(), message: format!("{} {when}", s.describe()) }
}

/// Runs the job on this node until it ends everywhere. Every wait also ends on a stop
/// request from `signals` (exit 130 for SIGINT, 143 for SIGTERM, after stopping the ranks).
pub async fn run(
    mesh: &mut Mesh,
    cfg: &JobConfig,
    run_id: &str,
    signals: &Signals,
) -> Result<JobOutcome, MeshError> {
    let mut sig = signals.clone();
    let mut restart = 0u32;
    // Bulk data streams of the QUIC ring, shared by every restart round's service.
    let incoming = std::sync::Arc::new(tokio::sync::Mutex::new(
        mesh.transport()
            .take_data_streams()
            .ok_or_else(|| MeshError::Iface("data streams already taken".into()))?,
    ));
    // Tunnel mode: peers' tunnel streams, and the counters, shared by every round.
    let tunnel_in = crate::tunnel::incoming(mesh.transport());
    let tunnel_stats = std::sync::Arc::new(crate::tunnel::TunnelStats::default());
    loop {
        let master_port = free_tcp_port(mesh.addr().ip()).unwrap_or(29500);
        let roster = tokio::select! {
            r = mesh.rendezvous(restart, cfg.rdzv.clone(), master_port, cfg.rdzv_timeout) => r?,
            s = sig.recv() => {
                let when = if restart > 0 { format!("while waiting for nodes (restart round {restart})") } else { "while waiting for nodes".into() };
                return Ok(stopped(s, &when));
            }
        };
        restart = roster.restart;
        mesh.set_master(roster.master().map(|m| m.id));
        let Some(node_rank) = roster.node_rank(mesh.node()) else {
            return Ok(JobOutcome { code: 1, message: "not part of the agreed roster".into() });
        };
        let master = &roster.members[0];
        info!(
            "roster agreed: {}, world size {}, master {} ({}), this node is node rank {node_rank}{}",
            crate::plural(roster.members.len() as u64, "node"),
            roster.world_size(),
            master.addr.ip(),
            master.hostname,
            if restart > 0 { format!(", restart {restart}") } else { String::new() }
        );
        let preflight = tokio::select! {
            r = preflight_round(mesh, &roster, &cfg.preflight) => r,
            s = sig.recv() => {
                // Tell the others, so that none of them launches without this node.
                let reason = format!("{} on {} during the preflight", s.describe(), describe_member(&roster, mesh.node()));
                abort(mesh, &roster, None, &reason);
                let linger = Instant::now() + Duration::from_millis(300);
                while mesh.next(Some(linger)).await.is_some_and(|i| !matches!(i, MeshInput::Tick)) {}
                return Ok(JobOutcome { code: s.exit_code(), message: reason });
            }
        };
        let (outcome, nccl_root) = match preflight {
            Ok(v) => v,
            Err(MeshError::Aborted(reason)) => {
                // Tell the others, so that none of them launches without this node, and keep
                // answering a moment so the message gets out.
                abort(mesh, &roster, None, &reason);
                let linger = Instant::now() + Duration::from_millis(400);
                while mesh.next(Some(linger)).await.is_some_and(|i| !matches!(i, MeshInput::Tick)) {}
                return Ok(JobOutcome { code: 1, message: format!("job stopped before launch: {reason}") });
            }
            Err(e) => return Err(e),
        };
        let verdict = outcome.verdict;
        for c in verdict.checks.iter().filter(|c| !c.ok) {
            if c.name == "tcp" && verdict.ok {
                // Said once, in words, by the warning below; the errors at debug.
                tracing::debug!("preflight {}: {}", c.name, c.detail);
            } else if c.fatal {
                error!("preflight {}: {}", c.name, c.detail);
            } else {
                warn!("preflight {}: {}", c.name, c.detail);
            }
        }
        if !verdict.ok {
            let failed: Vec<String> = verdict
                .checks
                .iter()
                .filter(|c| !c.ok && c.fatal)
                .map(|c| format!("{} {}", c.name, c.detail))
                .collect();
            let forced_nccl = cfg.preflight.forced.as_deref() == Some("nccl");
            let why = if failed.is_empty() && forced_nccl {
                "--collective nccl was forced but TCP between the nodes fails".to_string()
            } else {
                failed.join("; ")
            };
            finish_together(mesh, &roster, Duration::from_secs(3)).await;
            return Ok(JobOutcome { code: 1, message: format!("launch refused by the preflight: {why}") });
        }
        let user_has = |k: &str| std::env::var_os(k).is_some();
        let iface = mesh.choice().name.clone();
        let addrs: Vec<SocketAddr> = roster.members.iter().map(|m| m.addr).collect();
        let ring = RingNet::new(mesh.transport().clone(), node_rank, addrs.clone(), incoming.clone());
        if let Some(w) = verdict.tcp_warning(&iface) {
            warn!("{w}");
        }
        // The QUIC ring serves meshd's client in tunnel mode too (MESHD_SOCKET stays set).
        if verdict.collective == "quic" || verdict.collective == "tunnel" {
            info!(
                "preflight passed; collective: {}; ring over {} to the next node (MESHD_LANES)",
                verdict.collective_line(),
                crate::plural(ring.lanes as u64, "lane")
            );
        } else {
            info!("preflight passed; collective: {}", verdict.collective_line());
        }
        let svc_cfg = ServiceConfig {
            path: service::default_path(run_id, mesh.addr().port()),
            local_world: roster.members[node_rank].nproc,
            first_global: roster.first_global_rank(node_rank),
            world: roster.world_size(),
            restart,
            others: addrs.iter().copied().filter(|a| *a != mesh.addr()).collect(),
        };
        let svc = match Service::start(svc_cfg.clone(), ring, mesh.transport().clone()) {
            Ok(s) => Some(s),
            Err(e) => {
                warn!(
                    "cannot start the local service at {}: {e}; MESHD_SOCKET is not set",
                    svc_cfg.path.display()
                );
                None
            }
        };
        let mut tunnel = (verdict.collective == "tunnel")
            .then(|| {
                crate::tunnel::start_for_round(
                    &roster,
                    node_rank,
                    svc.as_ref().map(|s| s.path()),
                    mesh.transport(),
                    tunnel_in.as_ref(),
                    &tunnel_stats,
                )
            })
            .flatten();
        let ranks: Vec<RankSpec> = (0..roster.members[node_rank].nproc)
            .map(|l| {
                let mut env = rank_env(
                    &roster,
                    node_rank,
                    l,
                    &iface,
                    mesh.addr().ip(),
                    run_id,
                    cfg.max_restarts,
                    &verdict.collective,
                    &user_has,
                );
                if let Some(s) = &svc {
                    env.push(("MESHD_SOCKET".into(), s.path().display().to_string()));
                }
                if let Some(t) = &tunnel {
                    env.extend(t.env(std::env::var("LD_PRELOAD").ok().as_deref()));
                }
                if let Some(id) = &outcome.nccl_id {
                    env.push((
                        "MESHD_NCCL_UNIQUE_ID".into(),
                        id.iter().map(|b| format!("{b:02x}")).collect(),
                    ));
                }
                RankSpec { global: roster.first_global_rank(node_rank) + l, local: l, env }
            })
            .collect();
        if let Some(d) = &cfg.log_dir {
            if let Err(e) = std::fs::create_dir_all(d) {
                warn!("cannot create --log-dir {}: {e}; logging to the console only", d.display());
            }
        }
        let failure = match Supervisor::spawn(&cfg.cmd, &ranks, cfg.log_dir.as_deref()).await {
            Ok(mut sup) => {
                mesh.set_state(NodeState::Running, restart);
                let f = supervise(mesh, &roster, &mut sup, svc.as_ref(), &mut sig).await;
                sup.stop(cfg.grace).await;
                if let Some(t) = tunnel.take() {
                    crate::tunnel::report(t.stats());
                }
                drop(svc);
                drop(nccl_root);
                f
            }
            Err(e) => {
                let reason =
                    format!("node {} ({}): {e}", roster.members[node_rank].hostname, mesh.addr().ip());
                abort(mesh, &roster, None, &reason);
                Some(Failure::Job(reason))
            }
        };
        match failure {
            None => {
                return Ok(JobOutcome {
                    code: 0,
                    message: match roster.world_size() {
                        1 => "job finished: the rank exited 0".to_string(),
                        n => format!("job finished: all {n} ranks exited 0"),
                    },
                });
            }
            Some(Failure::Signal(m, code)) => return Ok(JobOutcome { code, message: m }),
            Some(Failure::Job(m)) if restart < cfg.max_restarts => {
                restart += 1;
                let left = cfg.max_restarts - restart;
                warn!(
                    "{m}; restart round {restart} of {}: restarting all ranks on every node ({left} {} left after this one)",
                    cfg.max_restarts,
                    if left == 1 { "restart" } else { "restarts" }
                );
                mesh.set_state(NodeState::Waiting, restart);
                mesh.set_master(None);
            }
            Some(Failure::Job(m)) => {
                mesh.set_state(NodeState::Failed, restart);
                return Ok(JobOutcome { code: 1, message: format!("job failed: {m}") });
            }
        }
    }
}

/// The preflight of one round; the master first creates the round's NCCL id in a root
/// process that must outlive every rank's init (keep the returned [`NcclRoot`] until the
/// round ends).
pub async fn preflight_round(
    mesh: &mut Mesh,
    roster: &Roster,
    input: &PreflightInput,
) -> Result<(preflight::Outcome, Option<NcclRoot>), MeshError> {
    let mut pin = input.clone();
    let is_master = roster.master().map(|m| m.id) == Some(mesh.node());
    let root = if is_master && pin.nccl_note.is_empty() {
        match NcclRoot::spawn(&mesh.choice().name, Duration::from_secs(20)).await {
            Ok(r) => {
                pin.nccl_id = Some(r.id.clone());
                Some(r)
            }
            Err(e) => {
                warn!("no NCCL unique id: {e}");
                pin.nccl_note = e;
                None
            }
        }
    } else {
        None
    };
    let outcome = preflight::run(mesh, roster, &pin, Duration::from_secs(20)).await?;
    Ok((outcome, root))
}

/// Says `Done` and waits (bounded) until every roster member said it too, so that no node
/// leaves while another still needs its last message.
pub async fn finish_together(mesh: &mut Mesh, roster: &Roster, limit: Duration) {
    let deadline = Instant::now() + limit;
    let me = mesh.node();
    let mut done: BTreeSet<NodeId> = [me].into_iter().collect();
    let everyone: BTreeSet<NodeId> = roster.members.iter().map(|m| m.id).collect();
    mesh.broadcast(roster, Message::Done { restart: roster.restart });
    let mut resend = Instant::now() + Duration::from_millis(300);
    while done != everyone && Instant::now() < deadline {
        match mesh.next(Some(resend.min(deadline))).await {
            None => return,
            Some(MeshInput::Rdzv(from, Message::Done { restart }))
                if restart == roster.restart && everyone.contains(&from) =>
            {
                done.insert(from);
            }
            Some(MeshInput::Member(MemberEvent::Down(id) | MemberEvent::Left(id))) => {
                done.insert(id);
            }
            Some(MeshInput::Tick) => {
                mesh.broadcast(roster, Message::Done { restart: roster.restart });
                resend = Instant::now() + Duration::from_millis(300);
            }
            _ => {}
        }
    }
    // Keep answering a moment so our last Done reaches everyone.
    let linger = Instant::now() + Duration::from_millis(400);
    while mesh.next(Some(linger)).await.is_some_and(|i| !matches!(i, MeshInput::Tick)) {}
}

fn abort(mesh: &mut Mesh, roster: &Roster, rank: Option<u32>, reason: &str) {
    let me = mesh.node();
    let hostname = roster.members.iter().find(|m| m.id == me).map(|m| m.hostname.clone()).unwrap_or_default();
    let msg =
        Message::Abort { restart: roster.restart, node: me, hostname, rank, reason: reason.to_string() };
    mesh.broadcast(roster, msg);
    mesh.set_state(NodeState::Failed, roster.restart);
}

fn describe_member(roster: &Roster, id: NodeId) -> String {
    roster
        .members
        .iter()
        .find(|m| m.id == id)
        .map(|m| format!("node {} ({})", if m.hostname.is_empty() { "?" } else { &m.hostname }, m.addr.ip()))
        .unwrap_or_else(|| format!("node {id}"))
}

async fn supervise(
    mesh: &mut Mesh,
    roster: &Roster,
    sup: &mut Supervisor,
    svc: Option<&Service>,
    sig: &mut Signals,
) -> Option<Failure> {
    let me = mesh.node();
    let here = describe_member(roster, me);
    let mut done: BTreeSet<NodeId> = BTreeSet::new();
    let mut local_done = false;
    let mut resend = Instant::now();
    let everyone: BTreeSet<NodeId> = roster.members.iter().map(|m| m.id).collect();
    // A member that left without saying Done, and when to blame it if no Abort comes.
    let mut left: Option<(NodeId, Instant)> = None;
    loop {
        if let Some((id, at)) = left {
            if done.contains(&id) {
                left = None;
            } else if Instant::now() >= at {
                let reason = format!("{} left the mesh before the job finished", describe_member(roster, id));
                error!("{reason}; stopping the job on every node");
                abort(mesh, roster, None, &reason);
                return Some(Failure::Job(reason));
            }
        }
        if local_done && done == everyone {
            if everyone.len() == 1 {
                return None;
            }
            // Keep answering a moment so our last Done reaches everyone.
            let linger = Instant::now() + Duration::from_millis(600);
            mesh.broadcast(roster, Message::Done { restart: roster.restart });
            while mesh.next(Some(linger)).await.is_some_and(|i| !matches!(i, MeshInput::Tick)) {}
            return None;
        }
        let mut tick = if local_done {
            resend + Duration::from_millis(500)
        } else {
            Instant::now() + Duration::from_secs(3600)
        };
        if let Some((_, at)) = left {
            tick = tick.min(at);
        }
        tokio::select! {
            exit = sup.next_exit(), if !local_done => {
                match exit {
                    Some(e) if e.status.success() && sup.running() == 0 => {
                        local_done = true;
                        done.insert(me);
                        mesh.set_state(NodeState::Done, roster.restart);
                        mesh.broadcast(roster, Message::Done { restart: roster.restart });
                        resend = Instant::now();
                    }
                    Some(e) if e.status.success() => {}
                    Some(e) => {
                        let reason = format!("rank {} (local rank {}) on {here} {}", e.global, e.local, supervisor::describe(&e.status));
                        error!("{reason}; stopping the job on every node");
                        abort(mesh, roster, Some(e.global), &reason);
                        return Some(Failure::Job(reason));
                    }
                    None => {}
                }
            }
            input = mesh.next(Some(tick)) => {
                match input {
                    None => return Some(Failure::Job("the mesh transport stopped".into())),
                    // Lifecycle messages count only from this round's roster: a straggler of an
                    // earlier job with the same run id (an earlier srun step) neither stops
                    // this one nor, with its Done, keeps it from finishing.
                    Some(MeshInput::Rdzv(from, Message::Abort { restart, reason, .. })) if restart == roster.restart && everyone.contains(&from) => {
                        error!("job stopped by {}: {reason}", describe_member(roster, from));
                        mesh.set_state(NodeState::Failed, roster.restart);
                        return Some(Failure::Job(reason));
                    }
                    Some(MeshInput::Rdzv(from, Message::Done { restart })) if restart == roster.restart && everyone.contains(&from) => {
                        done.insert(from);
                    }
                    Some(MeshInput::Rdzv(from, m @ Message::Propose(_))) => mesh.defer(from, m),
                    Some(MeshInput::Store(_, m)) => {
                        if let Some(s) = svc {
                            s.remote_store(m, roster.restart);
                        }
                    }
                    Some(MeshInput::Member(MemberEvent::Left(id))) if everyone.contains(&id) && !done.contains(&id) && left.is_none() => {
                        // Usually a node stopping on an Abort that is still on its way here.
                        info!(
                            "{} left the mesh before saying it was done; waiting up to {:?} for its reason before stopping the job",
                            describe_member(roster, id),
                            LEFT_GRACE
                        );
                        left = Some((id, Instant::now() + LEFT_GRACE));
                    }
                    Some(MeshInput::Member(MemberEvent::Down(id))) if everyone.contains(&id) && !done.contains(&id) => {
                        let reason = format!("{} stopped answering (declared dead by the mesh)", describe_member(roster, id));
                        error!("{reason}; stopping the job on every node");
                        abort(mesh, roster, None, &reason);
                        return Some(Failure::Job(reason));
                    }
                    Some(MeshInput::Tick) if local_done => {
                        mesh.broadcast(roster, Message::Done { restart: roster.restart });
                        resend = Instant::now();
                    }
                    _ => {}
                }
            }
            s = sig.recv() => {
                let reason = format!("{} on {here}", s.describe());
                abort(mesh, roster, None, &reason);
                return Some(Failure::Signal(reason, s.exit_code()));
            }
        }
    }
}

#[cfg(test)]
mod tests;
