//! `meshd run`'s IO edges: the ranks of each round with torchrun's environment, the local
//! service and tunnel beside them, their exits, stalls and stops, and the root cause
//! printed when a rank failed. The protocol (rendezvous, preflight, Done, Abort, restart
//! rounds) is the `Node` core's (`meshd_proto::node`); the actor ([`crate::node`]) runs
//! both.
//!
//! Failure paths, each ending every rank on every node within seconds:
//! - a local rank exits non-zero: this node broadcasts `Abort` and stops its ranks;
//! - an `Abort` arrives: stop local ranks;
//! - a roster member is declared dead: broadcast `Abort`; one that leaves gracefully before
//!   saying `Done` is blamed only if no `Abort` follows within the core's left grace (a
//!   node that got an `Abort` leaves at once, and its `Left` may overtake that `Abort`);
//! - SIGINT/SIGTERM: broadcast `Abort`, stop, exit 130/143 (never restarted).
//!
//! Success: every local rank exited 0, this node says `Done` (repeated until every member
//! said it too), and exits 0 once every roster member is done.

use crate::collective::RingNet;
use crate::collective::service::{self, Service, ServiceConfig};
use crate::mesh::{Mesh, MeshError};
use crate::node::actor::{Actor, NcclPolicy};
use crate::node::edge::{Edge, Wake};
use crate::preflight::PreflightInput;
use crate::signals::Signals;
use crate::supervisor::{self, RankSpec, Supervisor};
use crate::transport::DataStream;
use meshd_proto::NodeId;
use meshd_proto::node::{self as core, Input};
use meshd_proto::preflight::{Collective, Verdict};
use meshd_proto::rendezvous::{RankFailure, RdzvConfig, Roster};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
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
    /// The QUIC ring's lanes and chunk size (`MESHD_LANES`, `MESHD_RING_CHUNK`).
    pub ring: crate::collective::RingConfig,
    /// The tunnel's preload library, when the user gave one (`MESHD_PRELOAD_LIB`).
    pub preload_lib: Option<PathBuf>,
    /// Where the job's owner-only socket directory goes (`$XDG_RUNTIME_DIR`, else `/tmp`).
    pub runtime_dir: PathBuf,
    /// A collective of the QUIC ring fails when no byte moved to or from a neighbour for
    /// this long (`--collective-timeout`; [`RingNet::progress_timeout`]).
    pub collective_timeout: Duration,
    /// `--signals-to-handle` as given: the ranks' TORCHELASTIC_SIGNALS_TO_HANDLE, as torchrun
    /// sets it (read by torch.distributed.elastic when a rank starts processes itself).
    pub signals_to_handle: String,
}

/// How a job ended on this node.
#[derive(Debug)]
pub struct JobOutcome {
    /// meshd's exit status.
    pub code: u8,
    /// One line saying what happened.
    pub message: String,
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
        // torchrun's agent hosts the TCPStore at MASTER_ADDR:MASTER_PORT ("True"); meshd does
        // not, so rank 0 must create it: torch reads only "True" as the agent's store.
        ("TORCHELASTIC_USE_AGENT_STORE".into(), "False".into()),
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

/// Runs the job on this node until it ends everywhere, then leaves the mesh. Every wait
/// also ends on a stop request from `signals` (exit 130 for SIGINT, 143 for SIGTERM, after
/// stopping the ranks).
pub async fn run(
    mesh: Mesh,
    cfg: &JobConfig,
    run_id: &str,
    signals: &Signals,
) -> Result<JobOutcome, MeshError> {
    // Bulk data streams of the QUIC ring, shared by every restart round's service.
    let incoming = Arc::new(tokio::sync::Mutex::new(
        mesh.transport().take_data_streams().ok_or(MeshError::DataStreamsTaken)?,
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
    let tunnel_stats = Arc::new(crate::tunnel::TunnelStats::default());
    let mut io = JobIo {
        cfg: cfg.clone(),
        run_id: run_id.to_string(),
        sig: signals.clone(),
        stop_seen: false,
        forwarded: signals.forwarded(),
        incoming,
        dirs,
        redirected,
        tunnel_in,
        tunnel_stats,
        mesh_started: Some(mesh.started()),
        round_began: Instant::now(),
        roster_at: Instant::now(),
        preflight_began: Instant::now(),
        round: None,
        store: None,
        transport: mesh.transport().clone(),
        addr: mesh.addr(),
        iface: mesh.choice().name.clone(),
    };
    let master_port = io.round_began(mesh.addr().ip());
    let core_cfg = crate::node::core_config(
        &mesh,
        &cfg.rdzv,
        cfg.rdzv_timeout,
        cfg.max_restarts,
        &cfg.preflight,
        master_port,
    );
    let node = core::Node::new(core_cfg, Instant::now());
    let nccl = NcclPolicy::make_unless(cfg.preflight.nccl_note.as_deref());
    let actor = Actor::new(mesh, node, nccl, cfg.preflight.connect_timeout);
    io.store = Some(actor.store_sender());
    let o = actor.run(io).await?;
    Ok(JobOutcome { code: o.code, message: o.message })
}

/// One launched round on this node.
struct Round {
    roster: Roster,
    node_rank: usize,
    here: String,
    sup: Option<Supervisor>,
    svc: Option<Service>,
    tunnel: Option<crate::tunnel::Tunnel>,
    round_dir: Option<PathBuf>,
    /// Which path (data plane or QUIC streams) carried the ring's collectives.
    served: Arc<std::sync::Mutex<crate::collective::plane_ring::Served>>,
    /// Every local rank exited 0.
    local_done: bool,
}

/// The job's IO edges, driven by the actor.
pub(crate) struct JobIo {
    cfg: JobConfig,
    run_id: String,
    sig: Signals,
    /// A stop request was handed to the core (later ones change nothing).
    stop_seen: bool,
    forwarded: Option<tokio::sync::broadcast::Receiver<i32>>,
    incoming: Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<DataStream>>>,
    dirs: Option<cause::LogDirs>,
    redirected: bool,
    tunnel_in: Option<crate::tunnel::Incoming>,
    tunnel_stats: Arc<crate::tunnel::TunnelStats>,
    /// Round 0 only: when the mesh started and when it had its interface and port.
    mesh_started: Option<(Instant, Instant)>,
    round_began: Instant,
    roster_at: Instant,
    preflight_began: Instant,
    round: Option<Round>,
    /// Where the ranks' store requests go (the actor, to the node core); set by [`run`].
    store: Option<crate::collective::StoreSender>,
    transport: crate::transport::Transport,
    addr: SocketAddr,
    iface: String,
}

impl Edge for JobIo {
    /// A round begins: MASTER_PORT to offer (`--master-port` when free on this node).
    fn round_began(&mut self, ip: IpAddr) -> u16 {
        self.round_began = Instant::now();
        crate::preflight::master_port(ip, self.cfg.master_port)
    }

    fn roster_agreed(&mut self, roster: &Roster, me: NodeId) {
        self.roster_at = Instant::now();
        self.preflight_began = Instant::now();
        let Some(node_rank) = roster.node_rank(me) else { return };
        let master = &roster.members[0];
        info!(
            "roster agreed: {}, world size {}, master {} ({}), this node is node rank {node_rank}{}",
            crate::plural(roster.members.len() as u64, "node"),
            roster.world_size(),
            master.addr.ip(),
            master.hostname,
            if roster.restart > 0 { format!(", restart {}", roster.restart) } else { String::new() }
        );
        let flags = (self.cfg.expect_node_rank, self.cfg.expect_master_addr.as_deref(), self.cfg.master_port);
        for w in cross_check(flags.0, flags.1, flags.2, roster, node_rank) {
            warn!("{w}");
        }
    }

    fn verdict(&mut self, _roster: Option<&Roster>, verdict: &Verdict) {
        for c in verdict.checks.iter().filter(|c| !c.ok) {
            if c.kind == meshd_proto::preflight::CheckKind::Tcp && verdict.ok {
                // Said once, in words, by the warning at launch; the errors at debug.
                tracing::debug!("preflight {}: {}", c.kind, c.detail);
            } else if c.fatal {
                error!("preflight {}: {}", c.kind, c.detail);
            } else {
                warn!("preflight {}: {}", c.kind, c.detail);
            }
        }
    }

    /// Starts the round's service, tunnel and ranks.
    async fn launch(
        &mut self,
        mesh: &Mesh,
        roster: &Roster,
        verdict: &Verdict,
        nccl_id: Option<&[u8]>,
    ) -> Input {
        let me = mesh.node();
        let Some(node_rank) = roster.node_rank(me) else {
            return Input::SpawnFailed("not part of the agreed roster".into());
        };
        let restart = roster.restart;
        // The ranks inherit meshd's environment: a variable the user set there wins.
        let user_has = |k: &str| std::env::var_os(k).is_some();
        let iface = self.iface.clone();
        let addrs: Vec<SocketAddr> = roster.members.iter().map(|m| m.addr).collect();
        let mut ring = RingNet::new(
            self.transport.clone(),
            node_rank,
            addrs.clone(),
            self.incoming.clone(),
            &self.cfg.ring,
        );
        ring.progress_timeout = self.cfg.collective_timeout;
        if let Some(w) = verdict.tcp_warning(&iface) {
            warn!("{w}");
        }
        // The QUIC ring serves meshd's client in tunnel mode too (MESHD_SOCKET stays set).
        if verdict.collective.uses_quic_ring() {
            info!(
                "preflight passed; collective: {}; ring over {} to the next node (MESHD_LANES), or the data plane where its link is ready",
                verdict.collective_line(),
                crate::plural(ring.lanes.get() as u64, "lane")
            );
        } else {
            info!("preflight passed; collective: {}", verdict.collective_line());
        }
        let activity = Arc::new(supervisor::output::Activity::default());
        let Some(store) = self.store.clone() else {
            return Input::SpawnFailed("the local service has no store relay".into());
        };
        let svc_cfg = ServiceConfig {
            path: service::default_path(&self.cfg.runtime_dir, &self.run_id, self.addr.port()),
            local_world: roster.members[node_rank].nproc,
            first_global: roster.first_global_rank(node_rank),
            world: roster.world_size(),
            restart,
            store: store.clone(),
            activity: Some(activity.clone()),
        };
        let served = ring.served_handle();
        let svc = match Service::start(svc_cfg.clone(), ring) {
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
        let round_dir = self.dirs.as_ref().map(|d| d.round(restart, &globals));
        let tunnel = (verdict.collective == Collective::Tunnel)
            .then(|| {
                crate::tunnel::start_for_round(
                    roster,
                    node_rank,
                    svc.as_ref().map(|s| s.path()),
                    self.cfg.preload_lib.as_deref(),
                    &self.transport,
                    self.tunnel_in.as_ref(),
                    &self.tunnel_stats,
                )
            })
            .flatten();
        let ranks: Vec<RankSpec> = (0..roster.members[node_rank].nproc)
            .map(|l| {
                let mut env = rank_env(
                    roster,
                    node_rank,
                    l,
                    &iface,
                    self.addr.ip(),
                    &self.run_id,
                    self.cfg.max_restarts,
                    verdict.collective.name(),
                    &user_has,
                );
                if self.cfg.role != "default" {
                    set_env(&mut env, "ROLE_NAME", self.cfg.role.clone());
                }
                set_env(&mut env, "TORCHELASTIC_SIGNALS_TO_HANDLE", self.cfg.signals_to_handle.clone());
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
                if let Some(d) = round_dir.as_ref().filter(|_| self.dirs.as_ref().is_some_and(|d| d.user)) {
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
                    // The ranks inherit meshd's LD_PRELOAD: the tunnel's library goes first.
                    env.extend(t.env(std::env::var("LD_PRELOAD").ok().as_deref()));
                }
                if let Some(id) = nccl_id {
                    env.push((
                        "MESHD_NCCL_UNIQUE_ID".into(),
                        id.iter().map(|b| format!("{b:02x}")).collect(),
                    ));
                }
                RankSpec { global: first + l, local: l, env }
            })
            .collect();
        let files = self.dirs.as_ref().is_some_and(|d| d.user) || self.redirected;
        let round_out = supervisor::RoundOutput {
            dir: round_dir.clone().filter(|_| files),
            spec: self.cfg.output.clone(),
            activity: Some(activity.clone()),
        };
        let spawn_began = Instant::now();
        let here = describe_member(roster, me);
        let mut round = Round {
            roster: roster.clone(),
            node_rank,
            here,
            sup: None,
            svc,
            tunnel,
            round_dir,
            served,
            local_done: false,
        };
        let input = match Supervisor::spawn(&self.cfg.cmd, &ranks, &round_out).await {
            Ok(sup) => {
                round.sup = Some(sup);
                let phases = Phases {
                    mesh: if restart == 0 { self.mesh_started.take() } else { None },
                    round_began: self.round_began,
                    roster_at: self.roster_at,
                    preflight_began: self.preflight_began,
                    spawn_began,
                    spawned_at: Instant::now(),
                };
                info!("{}", phases.line(ranks.len(), restart));
                Input::RanksSpawned
            }
            Err(e) => Input::SpawnFailed(e.to_string()),
        };
        self.round = Some(round);
        input
    }

    /// Stops the round's ranks (SIGTERM, grace, SIGKILL) and what ran beside them.
    async fn stop(&mut self) {
        let Some(mut r) = self.round.take() else { return };
        if let Some(s) = r.sup.as_mut() {
            s.stop(self.cfg.grace).await;
        }
        if let Some(t) = r.tunnel.take() {
            crate::tunnel::report(t.stats());
        }
        drop(r.svc.take());
        let served = *r.served.lock().unwrap_or_else(|p| p.into_inner());
        if served != Default::default() {
            info!("ring collectives to the next node: {}", served.line());
        }
        // Kept for the cause's error file path.
        self.round = Some(Round { sup: None, ..r });
    }

    fn forward(&mut self, signal: i32, from: Option<&str>) {
        let name = crate::signals::signal_name(signal);
        match from {
            None => info!("{name} received: forwarding it to every rank on every node"),
            Some(who) => info!("{name} from {who}: forwarding it to this node's ranks"),
        }
        if let Some(s) = self.round.as_ref().and_then(|r| r.sup.as_ref()) {
            s.signal_all(signal);
        }
    }

    /// Every node says why, once the ranks' last output is out.
    async fn round_failed(&mut self, _reason: &str, cause: Option<&RankFailure>, _restarting: bool) {
        self.round = None;
        let Some(c) = cause else { return };
        supervisor::output::flush().await;
        eprint!("{}", cause::block(c));
        if let Some(d) = self.dirs.as_ref().filter(|d| d.user) {
            // Written whole then renamed: nodes sharing the directory write the same file.
            let p = d.base().join("error.json");
            let tmp = d.base().join(format!(".error.json.{}", std::process::id()));
            if let Err(e) = std::fs::write(&tmp, cause::error_json(c)).and_then(|_| std::fs::rename(&tmp, &p))
            {
                warn!("cannot write {}: {e}", p.display());
            }
        }
    }

    /// The next rank exit, stall, forwarded signal or stop request.
    async fn next(&mut self) -> Wake {
        let stall_t = self.cfg.stall_timeout;
        let (sup, activity) = match self.round.as_mut() {
            Some(r) if !r.local_done => {
                let act = r.sup.as_ref().map(|s| s.activity());
                (r.sup.as_mut(), act)
            }
            _ => (None, None),
        };
        let stall_at = stall_t.zip(activity.as_ref()).map(|(t, a)| a.last() + t);
        let running = sup.is_some();
        let exit = async {
            match sup {
                Some(s) => s.next_exit().await,
                None => std::future::pending().await,
            }
        };
        let fwd = async {
            match self.forwarded.as_mut() {
                Some(f) if running => f.recv().await.ok(),
                _ => std::future::pending().await,
            }
        };
        let stop = async {
            if self.stop_seen {
                std::future::pending::<()>().await;
            }
            self.sig.recv().await
        };
        tokio::select! {
            s = stop => {
                self.stop_seen = true;
                Wake::Input(Input::Stop { what: s.describe().to_string(), code: s.exit_code() })
            }
            Some(n) = fwd => Wake::Input(Input::Signal(n)),
            e = exit => self.on_exit(e),
            _ = tokio::time::sleep_until(stall_at.unwrap_or_else(Instant::now).into()), if stall_at.is_some() => {
                let t = stall_t.unwrap_or_default();
                if activity.is_some_and(|a| a.last().elapsed() < t) {
                    return Wake::Nothing;
                }
                // Handled by the actor outside its select (`stalled` waits for the ranks'
                // stacks, and must not be dropped halfway by another input).
                Wake::Stalled(t)
            }
        }
    }

    /// This node's ranks stalled for `t`: their stacks, then the failure.
    async fn on_stall(&mut self, t: Duration) -> Option<Input> {
        let r = self.round.as_mut()?;
        let sup = r.sup.as_mut()?;
        let c = stalled(self.addr, &r.roster, r.node_rank, sup, t).await;
        r.local_done = true;
        let reason = format!(
            "{}: no rank on {} wrote output or called meshd for {t:?} (--stall-timeout)",
            c.message, r.here
        );
        Some(Input::RankFailed { rank: Some(c.rank), reason, cause: Some(Box::new(c)) })
    }
}

impl JobIo {
    fn on_exit(&mut self, e: Option<supervisor::RankExit>) -> Wake {
        let Some(r) = self.round.as_mut() else { return Wake::Nothing };
        let Some(sup) = r.sup.as_ref() else { return Wake::Nothing };
        match e {
            Some(e) if e.status.success() && sup.running() == 0 => {
                r.local_done = true;
                Wake::Input(Input::RanksExited)
            }
            Some(e) if e.status.success() => Wake::Nothing,
            Some(e) => {
                let reason = format!(
                    "rank {} (local rank {}) on {} {}",
                    e.global,
                    e.local,
                    r.here,
                    supervisor::describe(&e.status)
                );
                let c = rank_failure(
                    self.addr,
                    &r.roster,
                    r.node_rank,
                    &e,
                    &sup.tail(e.global),
                    r.round_dir.as_deref(),
                );
                r.local_done = true;
                Wake::Input(Input::RankFailed { rank: Some(e.global), reason, cause: Some(Box::new(c)) })
            }
            None => Wake::Nothing,
        }
    }
}

/// The details of a local rank that failed: where it ran, how it ended, and why (its error
/// file, else its last stderr lines).
fn rank_failure(
    addr: SocketAddr,
    roster: &Roster,
    node_rank: usize,
    e: &supervisor::RankExit,
    tail: &[String],
    round_dir: Option<&std::path::Path>,
) -> RankFailure {
    let mut f = RankFailure {
        host: roster.members.get(node_rank).map(|m| m.hostname.clone()).unwrap_or_default(),
        addr: addr.ip().to_string(),
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
    addr: SocketAddr,
    roster: &Roster,
    node_rank: usize,
    sup: &mut Supervisor,
    t: Duration,
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
    RankFailure {
        host: roster.members.get(node_rank).map(|m| m.hostname.clone()).unwrap_or_default(),
        addr: addr.ip().to_string(),
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

pub mod cause;

#[cfg(test)]
mod tests;
