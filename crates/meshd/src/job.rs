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
use meshd_proto::rendezvous::{Message, RankFailure, RdzvConfig, Roster};
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
    /// ROLE_NAME of every rank (torchrun's `--role`).
    pub role: String,
    /// `--node-rank` of an old torchrun line: checked against the agreed node rank.
    pub expect_node_rank: Option<u32>,
    /// `--master-addr` of an old torchrun line: checked against the agreed master.
    pub expect_master_addr: Option<String>,
    /// MASTER_PORT to use when it is free on the master (`--master-port`).
    pub master_port: Option<u16>,
    /// Console routing of the ranks' output (`--redirects`, `--tee`, `--local-ranks-filter`).
    pub output: supervisor::OutputSpec,
    /// Stop the job, with the ranks' Python stacks, when no rank of this node wrote output
    /// or called the local service for this long (`--stall-timeout`).
    pub stall_timeout: Option<Duration>,
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
    // Under SLURM, srun started ONE task per node (meshd): its ranks would inherit that
    // task's SLURM_PROCID, SLURM_NTASKS, ... and tools that trust SLURM take those for
    // their ranks. Rewritten to describe meshd's ranks (slurm_rank_env).
    if user_has("SLURM_JOB_ID") || user_has("SLURM_PROCID") {
        env.extend(slurm_rank_env(roster, node_rank, local_rank));
    }
    env
}

/// Sets `k` in `env`, replacing an earlier value.
fn set_env(env: &mut Vec<(String, String)>, k: &str, v: String) {
    match env.iter_mut().find(|(a, _)| a == k) {
        Some(e) => e.1 = v,
        None => env.push((k.to_string(), v)),
    }
}

/// Warnings for an old torchrun line's per-node flags that disagree with what the nodes
/// agreed on (`--node-rank`, `--master-addr`, `--master-port`): each names both values.
pub fn cross_check(
    flag_node_rank: Option<u32>,
    flag_master_addr: Option<&str>,
    flag_master_port: Option<u16>,
    roster: &Roster,
    node_rank: usize,
) -> Vec<String> {
    let mut w = Vec::new();
    if let Some(n) = flag_node_rank {
        if n as usize != node_rank {
            w.push(format!(
                "--node-rank {n} disagrees with the node rank the nodes agreed on, {node_rank} (node ranks follow \
                 the nodes' addresses; meshd needs no --node-rank: drop it)"
            ));
        }
    }
    let master = &roster.members[0];
    if let Some(a) = flag_master_addr.filter(|a| !a.trim().is_empty()) {
        let host = a.trim().trim_start_matches('[').trim_end_matches(']');
        let ip = master.addr.ip();
        let same = host.parse::<IpAddr>().map(|h| h == ip).unwrap_or_else(|_| {
            use std::net::ToSocketAddrs;
            (host, 0).to_socket_addrs().map(|mut it| it.any(|s| s.ip() == ip)).unwrap_or(false)
                || (!master.hostname.is_empty() && host.eq_ignore_ascii_case(&master.hostname))
        });
        if !same {
            w.push(format!(
                "--master-addr {a} disagrees with the master the nodes agreed on, {ip} ({}): MASTER_ADDR is {ip} \
                 (meshd needs no --master-addr: drop it)",
                if master.hostname.is_empty() { "?" } else { &master.hostname }
            ));
        }
    }
    if let Some(p) = flag_master_port {
        if p != roster.master_port {
            w.push(format!(
                "--master-port {p} was not free on the master: MASTER_PORT is {} instead",
                roster.master_port
            ));
        }
    }
    w
}

/// SLURM's task variables for one rank, as if srun had started one task per rank (issue
/// 18.5). Under `srun --ntasks-per-node=1 meshd run`, ranks inherit meshd's task variables:
/// SLURM_PROCID = the node's task (0..nodes), SLURM_NTASKS = nodes, SLURM_LOCALID = 0 on
/// every rank, SLURM_NTASKS_PER_NODE = 1. Lightning's SLURMEnvironment (which scripts pass
/// explicitly for auto-requeue, bypassing the TorchElastic detection) reads its ranks and
/// world size from them, submitit and many scripts read SLURM_PROCID: every rank of a node
/// would claim the same global rank. Rewritten, not removed: removed, those readers fail
/// (KeyError, Lightning's "--ntasks not supported") instead of working. SLURM_NODEID
/// indexes SLURM_(STEP_)NODELIST, which becomes the node addresses in node-rank order: the
/// master first, where Lightning's SLURMEnvironment takes MASTER_ADDR from (it does not
/// read MASTER_ADDR). Job-level variables (SLURM_JOB_ID, SLURM_JOB_NODELIST, ...) stay.
pub fn slurm_rank_env(roster: &Roster, node_rank: usize, local_rank: u32) -> Vec<(String, String)> {
    let me = &roster.members[node_rank];
    let first = roster.first_global_rank(node_rank);
    let global = (first + local_rank).to_string();
    let world = roster.world_size().to_string();
    let nodes = roster.members.len().to_string();
    let node = node_rank.to_string();
    let local = local_rank.to_string();
    // SLURM's compressed counts: `2(x3)`, `1,2(x2)`.
    let mut runs: Vec<(u32, usize)> = Vec::new();
    for m in &roster.members {
        match runs.last_mut() {
            Some((n, k)) if *n == m.nproc => *k += 1,
            _ => runs.push((m.nproc, 1)),
        }
    }
    let per_node = runs
        .iter()
        .map(|(n, k)| if *k == 1 { n.to_string() } else { format!("{n}(x{k})") })
        .collect::<Vec<_>>()
        .join(",");
    let nodelist = roster.members.iter().map(|m| m.addr.ip().to_string()).collect::<Vec<_>>().join(",");
    let gtids = (first..first + me.nproc).map(|r| r.to_string()).collect::<Vec<_>>().join(",");
    [
        ("SLURM_PROCID", global.clone()),
        ("SLURM_STEP_PROCID", global),
        ("SLURM_LOCALID", local.clone()),
        ("SLURM_STEP_LOCALID", local),
        ("SLURM_NODEID", node.clone()),
        ("SLURM_STEP_NODEID", node),
        ("SLURM_NTASKS", world.clone()),
        ("SLURM_NPROCS", world.clone()),
        ("SLURM_STEP_NUM_TASKS", world),
        ("SLURM_NTASKS_PER_NODE", me.nproc.to_string()),
        ("SLURM_TASKS_PER_NODE", per_node.clone()),
        ("SLURM_STEP_TASKS_PER_NODE", per_node),
        ("SLURM_NNODES", nodes.clone()),
        ("SLURM_STEP_NUM_NODES", nodes),
        ("SLURM_NODELIST", nodelist.clone()),
        ("SLURM_STEP_NODELIST", nodelist),
        ("SLURM_GTIDS", gtids),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// How long a roster member's graceful leave (without `Done`) waits for the `Abort` that
/// usually explains it before the member itself is blamed.
pub const LEFT_GRACE: Duration = Duration::from_secs(2);

enum Failure {
    /// A failure that may be restarted (with the failed rank's details when a rank failed).
    Job(String, Option<Box<RankFailure>>),
    /// A signal: stop, never restart.
    Signal(String, u8),
}

/// When each launch phase of a round began and ended on this node.
struct Phases {
    /// Round 0 only: when the mesh started and when it had its interface and port.
    mesh: Option<(Instant, Instant)>,
    round_began: Instant,
    roster_at: Instant,
    preflight_began: Instant,
    spawn_began: Instant,
    spawned_at: Instant,
}

impl Phases {
    /// "started 2 ranks 0.14 s after meshd started: interface 0.002 s, join and roster
    /// 0.120 s, preflight 0.010 s, spawn 0.003 s; meshd CPU 0.031 s": which phase is slow.
    fn line(&self, ranks: usize, restart: u32) -> String {
        let s = |a: Instant, b: Instant| format!("{:.3} s", b.saturating_duration_since(a).as_secs_f64());
        let mut parts = Vec::new();
        let (from, what) = match self.mesh {
            Some((started, bound)) => {
                parts.push(format!("interface {}", s(started, bound)));
                parts.push(format!("join and roster {}", s(bound, self.roster_at)));
                (started, "meshd started".to_string())
            }
            None => {
                parts.push(format!("roster {}", s(self.round_began, self.roster_at)));
                (self.round_began, format!("restart round {restart} began"))
            }
        };
        parts.push(format!("preflight {}", s(self.preflight_began, self.spawn_began)));
        parts.push(format!("spawn {}", s(self.spawn_began, self.spawned_at)));
        format!(
            "started {} {} after {what}: {}; meshd CPU {:.3} s",
            crate::plural(ranks as u64, "rank"),
            s(from, self.spawned_at),
            parts.join(", "),
            cpu_seconds()
        )
    }
}

/// CPU time (user + system) of this process, in seconds, as the kernel counts it.
fn process_cpu() -> f64 {
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is always valid.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// The process's CPU time when meshd started (see [`mark_cpu_start`]), in microseconds.
static CPU_AT_START_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Records the CPU time already spent when meshd starts. A process keeps its CPU counts
/// across `exec`, so whatever ran before in the same process (`cargo run` builds, then execs
/// meshd; `ip netns exec` execs it) would otherwise count as meshd's. Call first in `main`.
pub fn mark_cpu_start() {
    CPU_AT_START_US.store((process_cpu() * 1e6) as u64, std::sync::atomic::Ordering::Relaxed);
}

/// CPU time (user + system) meshd used since [`mark_cpu_start`].
fn cpu_seconds() -> f64 {
    let start = CPU_AT_START_US.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6;
    (process_cpu() - start).max(0.0)
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
    // Per-round files: error files always, output files with --log-dir (or --redirects).
    let redirected = cfg.output.redirects_any() && cfg.log_dir.is_none();
    let dirs = match cause::LogDirs::new(cfg.log_dir.as_deref(), redirected) {
        Ok(d) => {
            if redirected {
                info!("output kept off the console by --redirects goes to {}", d.base().display());
            }
            Some(d)
        }
        Err(e) => {
            warn!(
                "cannot create a directory for the ranks' error files: {e}; TORCHELASTIC_ERROR_FILE is not set"
            );
            None
        }
    };
    // Tunnel mode: peers' tunnel streams, and the counters, shared by every round.
    let tunnel_in = crate::tunnel::incoming(mesh.transport());
    let tunnel_stats = std::sync::Arc::new(crate::tunnel::TunnelStats::default());
    loop {
        let master_port = cfg
            .master_port
            .filter(|p| TcpListener::bind(SocketAddr::new(mesh.addr().ip(), *p)).is_ok())
            .or_else(|| free_tcp_port(mesh.addr().ip()).ok())
            .unwrap_or(29500);
        let round_began = Instant::now();
        let roster = tokio::select! {
            r = mesh.rendezvous(restart, cfg.rdzv.clone(), master_port, cfg.rdzv_timeout) => r?,
            s = sig.recv() => {
                let when = if restart > 0 { format!("while waiting for nodes (restart round {restart})") } else { "while waiting for nodes".into() };
                return Ok(stopped(s, &when));
            }
        };
        restart = roster.restart;
        let roster_at = Instant::now();
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
        let flags = (cfg.expect_node_rank, cfg.expect_master_addr.as_deref(), cfg.master_port);
        for w in cross_check(flags.0, flags.1, flags.2, &roster, node_rank) {
            warn!("{w}");
        }
        let preflight_began = Instant::now();
        let preflight = tokio::select! {
            r = preflight_round(mesh, &roster, &cfg.preflight) => r,
            s = sig.recv() => {
                // Tell the others, so that none of them launches without this node.
                let reason = format!("{} on {} during the preflight", s.describe(), describe_member(&roster, mesh.node()));
                abort(mesh, &roster, None, &reason, None);
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
                abort(mesh, &roster, None, &reason, None);
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
                "preflight passed; collective: {}; ring over {} to the next node (MESHD_LANES), or the data plane where its link is ready",
                verdict.collective_line(),
                crate::plural(ring.lanes as u64, "lane")
            );
        } else {
            info!("preflight passed; collective: {}", verdict.collective_line());
        }
        let activity = std::sync::Arc::new(supervisor::output::Activity::default());
        let svc_cfg = ServiceConfig {
            path: service::default_path(run_id, mesh.addr().port()),
            local_world: roster.members[node_rank].nproc,
            first_global: roster.first_global_rank(node_rank),
            world: roster.world_size(),
            restart,
            peers: crate::collective::StorePeers {
                me: roster.members[node_rank].id,
                others: roster
                    .members
                    .iter()
                    .filter(|m| m.id != roster.members[node_rank].id)
                    .cloned()
                    .collect(),
            },
            activity: Some(activity.clone()),
        };
        let served = ring.served_handle();
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
        let first = roster.first_global_rank(node_rank);
        let globals: Vec<u32> = (0..roster.members[node_rank].nproc).map(|l| first + l).collect();
        let round_dir = dirs.as_ref().map(|d| d.round(restart, &globals));
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
                if cfg.role != "default" {
                    set_env(&mut env, "ROLE_NAME", cfg.role.clone());
                }
                // As torchrun: each rank's own error file, for torch's @record.
                if let Some(d) = &round_dir {
                    set_env(
                        &mut env,
                        "TORCHELASTIC_ERROR_FILE",
                        cause::error_file(d, first + l).display().to_string(),
                    );
                }
                // Python dumps every thread's stack on SIGABRT (what --stall-timeout sends) and
                // on a crash; under --log-dir, PyTorch's NCCL flight recorder dumps there on a
                // collective timeout.
                let mut defaults =
                    vec![("PYTHONUNBUFFERED", "1".to_string()), ("PYTHONFAULTHANDLER", "1".to_string())];
                if let Some(d) = round_dir.as_ref().filter(|_| dirs.as_ref().is_some_and(|d| d.user)) {
                    defaults.push(("TORCH_NCCL_DUMP_ON_TIMEOUT", "1".into()));
                    defaults.push(("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000".into()));
                    defaults
                        .push(("TORCH_FR_DUMP_TEMP_FILE", d.join("nccl_trace_rank_").display().to_string()));
                }
                for (k, v) in defaults {
                    if !user_has(k) {
                        env.push((k.into(), v));
                    }
                }
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
        let files = dirs.as_ref().is_some_and(|d| d.user) || redirected;
        let round_out = supervisor::RoundOutput {
            dir: round_dir.clone().filter(|_| files),
            spec: cfg.output.clone(),
            activity: Some(activity.clone()),
        };
        let spawn_began = Instant::now();
        let failure = match Supervisor::spawn(&cfg.cmd, &ranks, &round_out).await {
            Ok(mut sup) => {
                mesh.set_state(NodeState::Running, restart);
                let phases = Phases {
                    mesh: (restart == 0).then(|| mesh.started()),
                    round_began,
                    roster_at,
                    preflight_began,
                    spawn_began,
                    spawned_at: Instant::now(),
                };
                info!("{}", phases.line(ranks.len(), restart));
                let f = supervise(
                    mesh,
                    &roster,
                    &mut sup,
                    svc.as_ref(),
                    &mut sig,
                    round_dir.as_deref(),
                    cfg.stall_timeout,
                )
                .await;
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
                abort(mesh, &roster, None, &reason, None);
                Some(Failure::Job(reason, None))
            }
        };
        if let Some(Failure::Job(_, Some(c))) = &failure {
            // Every node says why, once the ranks' last output is out.
            supervisor::output::flush().await;
            eprint!("{}", cause::block(c));
            if let Some(d) = dirs.as_ref().filter(|d| d.user) {
                // Written whole then renamed: nodes sharing the directory write the same file.
                let p = d.base().join("error.json");
                let tmp = d.base().join(format!(".error.json.{}", std::process::id()));
                if let Err(e) =
                    std::fs::write(&tmp, cause::error_json(c)).and_then(|_| std::fs::rename(&tmp, &p))
                {
                    warn!("cannot write {}: {e}", p.display());
                }
            }
        }
        let served = *served.lock().unwrap_or_else(|p| p.into_inner());
        if served != Default::default() {
            info!("ring collectives to the next node: {}", served.line());
        }
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
            Some(Failure::Job(m, _)) if restart < cfg.max_restarts => {
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
            Some(Failure::Job(m, c)) => {
                mesh.set_state(NodeState::Failed, restart);
                let code = c.map_or(1, |c| c.status);
                return Ok(JobOutcome { code, message: format!("job failed: {m}") });
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

fn abort(mesh: &mut Mesh, roster: &Roster, rank: Option<u32>, reason: &str, cause: Option<Box<RankFailure>>) {
    let me = mesh.node();
    let hostname = roster.members.iter().find(|m| m.id == me).map(|m| m.hostname.clone()).unwrap_or_default();
    let msg = Message::Abort {
        restart: roster.restart,
        node: me,
        hostname,
        rank,
        reason: reason.to_string(),
        cause,
    };
    mesh.broadcast(roster, msg);
    mesh.set_state(NodeState::Failed, roster.restart);
}

/// The details of a local rank that failed: where it ran, how it ended, and why (its error
/// file, else its last stderr lines).
fn rank_failure(
    mesh: &Mesh,
    roster: &Roster,
    e: &supervisor::RankExit,
    tail: &[String],
    round_dir: Option<&std::path::Path>,
) -> RankFailure {
    let me = mesh.node();
    let node_rank = roster.node_rank(me).unwrap_or(0);
    let mut f = RankFailure {
        host: roster.members.get(node_rank).map(|m| m.hostname.clone()).unwrap_or_default(),
        addr: mesh.addr().ip().to_string(),
        node_rank: node_rank as u32,
        rank: e.global,
        local_rank: e.local,
        exit: supervisor::describe(&e.status),
        status: cause::exit_status(&e.status),
        time: cause::now_unix(),
        ..Default::default()
    };
    let file = round_dir.map(|d| cause::error_file(d, e.global)).unwrap_or_default();
    cause::explain(&mut f, &file, tail);
    f
}

/// This node's ranks stalled: each gets SIGABRT (with PYTHONFAULTHANDLER=1, Python prints
/// every thread's stack to stderr, then dies), and their last stderr lines become the root
/// cause. Exit status 124, as `timeout`'s.
async fn stalled(
    mesh: &Mesh,
    roster: &Roster,
    sup: &mut Supervisor,
    t: Duration,
    round_dir: Option<&std::path::Path>,
) -> RankFailure {
    let ranks: Vec<(u32, u32, i32)> = sup.ranks().to_vec();
    warn!(
        "no rank wrote output or called meshd for {t:?} (--stall-timeout): sending SIGABRT to {} for their Python stacks",
        crate::plural(ranks.len() as u64, "rank")
    );
    sup.signal_all(libc::SIGABRT);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while sup.running() > 0 {
        match tokio::time::timeout_at(deadline, sup.next_exit()).await {
            Ok(Some(_)) => {}
            _ => break,
        }
    }
    let me = mesh.node();
    let node_rank = roster.node_rank(me).unwrap_or(0);
    let mut stacks = String::new();
    for (g, _, _) in &ranks {
        stacks.push_str(&format!("rank {g}:\n"));
        for l in sup.tail(*g) {
            stacks.push_str("  ");
            stacks.push_str(&l);
            stacks.push('\n');
        }
    }
    let (g, l) = ranks.first().map(|r| (r.0, r.1)).unwrap_or_default();
    let _ = round_dir;
    RankFailure {
        host: roster.members.get(node_rank).map(|m| m.hostname.clone()).unwrap_or_default(),
        addr: mesh.addr().ip().to_string(),
        node_rank: node_rank as u32,
        rank: g,
        local_rank: l,
        exit: format!("stalled: no output or meshd call for {t:?}"),
        status: 124,
        time: cause::now_unix(),
        message: format!(
            "job stalled on {}",
            roster.members.get(node_rank).map(|m| m.hostname.as_str()).unwrap_or("?")
        ),
        traceback: cause::keep_end(stacks.trim_end(), cause::MAX_TRACEBACK),
        source: "stall".into(),
    }
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
    round_dir: Option<&std::path::Path>,
    stall_timeout: Option<Duration>,
) -> Option<Failure> {
    let me = mesh.node();
    let mut forwarded = sig.forwarded();
    let activity = sup.activity();
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
                abort(mesh, roster, None, &reason, None);
                return Some(Failure::Job(reason, None));
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
        let stall_at = stall_timeout.map(|t| activity.last() + t);
        tokio::select! {
            _ = tokio::time::sleep_until(stall_at.unwrap_or_else(Instant::now).into()), if stall_at.is_some() && !local_done => {
                let t = stall_timeout.unwrap_or_default();
                if activity.last().elapsed() < t {
                    continue;
                }
                let c = Box::new(stalled(mesh, roster, sup, t, round_dir).await);
                let reason = format!("{}: no rank on {here} wrote output or called meshd for {t:?} (--stall-timeout)", c.message);
                error!("{reason}; stopping the job on every node");
                abort(mesh, roster, Some(c.rank), &reason, Some(c.clone()));
                return Some(Failure::Job(reason, Some(c)));
            }
            n = async { match forwarded.as_mut() { Some(f) => f.recv().await.ok(), None => std::future::pending().await } } => {
                if let Some(n) = n {
                    info!("{} received: forwarding it to every rank on every node", crate::signals::signal_name(n));
                    sup.signal_all(n);
                    let hostname = roster.members.iter().find(|m| m.id == me).map(|m| m.hostname.clone()).unwrap_or_default();
                    mesh.broadcast(roster, Message::Signal { restart: roster.restart, signal: n, hostname });
                }
            }
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
                        let c = Box::new(rank_failure(mesh, roster, &e, &sup.tail(e.global), round_dir));
                        abort(mesh, roster, Some(e.global), &reason, Some(c.clone()));
                        return Some(Failure::Job(reason, Some(c)));
                    }
                    None => {}
                }
            }
            input = mesh.next(Some(tick)) => {
                // Store sets stop waiting for a member that left (the job stops on it anyway).
                if let (Some(s), Some(MeshInput::Member(MemberEvent::Left(id) | MemberEvent::Down(id)))) = (svc, &input) {
                    s.member_gone(*id);
                }
                match input {
                    None => return Some(Failure::Job("the mesh transport stopped".into(), None)),
                    // Lifecycle messages count only from this round's roster: a straggler of an
                    // earlier job with the same run id (an earlier srun step) neither stops
                    // this one nor, with its Done, keeps it from finishing.
                    Some(MeshInput::Rdzv(from, Message::Abort { restart, reason, cause, .. })) if restart == roster.restart && everyone.contains(&from) => {
                        error!("job stopped by {}: {reason}", describe_member(roster, from));
                        mesh.set_state(NodeState::Failed, roster.restart);
                        return Some(Failure::Job(reason, cause));
                    }
                    Some(MeshInput::Rdzv(from, Message::Done { restart })) if restart == roster.restart && everyone.contains(&from) => {
                        done.insert(from);
                        // Its ranks all exited: none of them reads the store again.
                        if let Some(s) = svc {
                            s.member_gone(from);
                        }
                    }
                    // Only the signals meshd forwards: a peer cannot make ranks die this way.
                    Some(MeshInput::Rdzv(from, Message::Signal { restart, signal, .. }))
                        if restart == roster.restart
                            && everyone.contains(&from)
                            && [libc::SIGUSR1, libc::SIGUSR2].contains(&signal) =>
                    {
                        info!(
                            "{} from {}: forwarding it to this node's ranks",
                            crate::signals::signal_name(signal),
                            describe_member(roster, from)
                        );
                        if !local_done {
                            sup.signal_all(signal);
                        }
                    }
                    Some(MeshInput::Rdzv(from, m @ Message::Propose(_))) => mesh.defer(from, m),
                    Some(MeshInput::Store(from, m)) if everyone.contains(&from) => {
                        if let Some(s) = svc {
                            s.remote_store(from, m);
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
                        abort(mesh, roster, None, &reason, None);
                        return Some(Failure::Job(reason, None));
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
                abort(mesh, roster, None, &reason, None);
                return Some(Failure::Signal(reason, s.exit_code()));
            }
        }
    }
}

pub mod cause;

#[cfg(test)]
mod tests;
