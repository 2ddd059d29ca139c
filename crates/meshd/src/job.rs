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
    /// What a failure stops (`--fault-tolerance`): the whole job, or one node's replica group.
    pub fault_tolerance: core::FaultTolerance,
}

/// How a job ended on this node.
#[derive(Debug)]
pub struct JobOutcome {
    /// meshd's exit status.
    pub code: u8,
    /// One line saying what happened.
    pub message: String,
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
    let tunnel_host = crate::tunnel::Host::new(mesh.transport());
    let mut io = JobIo {
        cfg: cfg.clone(),
        run_id: run_id.to_string(),
        sig: signals.clone(),
        stop_seen: false,
        forwarded: signals.forwarded(),
        incoming,
        dirs,
        redirected,
        tunnel_host,
        mesh_started: Some(mesh.started()),
        round_began: Instant::now(),
        roster_at: Instant::now(),
        preflight_began: Instant::now(),
        round: None,
        store: None,
        transport: mesh.transport().clone(),
        addr: mesh.addr(),
        iface: mesh.choice().name.clone(),
        lighthouse: None,
        ft_launches: 0,
    };
    let core_cfg = crate::node::core_config(
        &mesh,
        &cfg.rdzv,
        cfg.rdzv_timeout,
        cfg.max_restarts,
        &cfg.preflight,
        cfg.fault_tolerance,
    );
    let node = core::Node::new(core_cfg, Instant::now());
    let nccl = NcclPolicy::make_unless(cfg.preflight.nccl_note.as_deref());
    let actor = Actor::new(mesh, node, nccl, cfg.preflight.connect_timeout);
    io.store = Some(actor.store_sender());
    if cfg.fault_tolerance == core::FaultTolerance::Node {
        io.lighthouse =
            Some(LighthouseServer::start(actor.lighthouse_sender()).await.map_err(MeshError::Lighthouse)?);
    }
    let o = actor.run(io).await?;
    Ok(JobOutcome { code: o.code, message: o.message })
}

/// torchft's Lighthouse API on this node's loopback (`--fault-tolerance node`): the ranks'
/// calls go to the node core, which relays them to the job's decider.
struct LighthouseServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl LighthouseServer {
    async fn start(
        calls: tokio::sync::mpsc::Sender<crate::lighthouse::LighthouseCall>,
    ) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        info!("torchft Lighthouse API on http://{addr} (TORCHFT_LIGHTHOUSE of this node's ranks)");
        let task = tokio::spawn(crate::lighthouse::serve(listener, calls));
        Ok(LighthouseServer { addr, task })
    }
}

impl Drop for LighthouseServer {
    fn drop(&mut self) {
        self.task.abort();
    }
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
    /// `--fault-tolerance node`: the replica group's TCPStore (stopped with the round).
    ft_store: Option<crate::tcpstore::TcpStoreHandle>,
    /// `--fault-tolerance node` without the tunnel: the preload library the ranks load
    /// (for `gethostname`; the tunnel holds its own).
    preload: Option<crate::tunnel::Preload>,
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
    tunnel_host: crate::tunnel::Host,
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
    /// `--fault-tolerance node`: the local Lighthouse API, and launches of this node's
    /// ranks so far (TORCHELASTIC_RESTART_COUNT is this node's own).
    lighthouse: Option<LighthouseServer>,
    ft_launches: u32,
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
        // A node admitted to a running job (`--fault-tolerance node`) ran no preflight of its
        // own: it takes the job's collective.
        let (passed, line) = if verdict.checks.is_empty() && roster.members.len() > 1 {
            ("the running job's", format!("{} (as the job was launched)", verdict.collective.name()))
        } else {
            ("preflight passed", verdict.collective_line())
        };
        // The QUIC ring serves meshd's client in tunnel mode too (MESHD_SOCKET stays set).
        if verdict.collective.uses_quic_ring() {
            info!(
                "{passed}; collective: {line}; ring over {} to the next node (MESHD_LANES), or the data plane where its link is ready",
                crate::plural(ring.lanes.get() as u64, "lane")
            );
        } else {
            info!("{passed}; collective: {line}");
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
        // `--fault-tolerance node`: this node's own store (torchrun's agent store) for its
        // replica group, reached by the other groups too (torchft's cross-group rendezvous).
        let ft = self.cfg.fault_tolerance == core::FaultTolerance::Node;
        let mut ft_store = None;
        if ft {
            match crate::tcpstore::TcpStoreServer::bind(SocketAddr::new(self.addr.ip(), 0))
                .await
                .and_then(|s| s.spawn())
            {
                Ok(h) => ft_store = Some(h),
                Err(e) => {
                    return Input::SpawnFailed(format!(
                        "cannot start the replica group's TCPStore on {}: {e}",
                        self.addr.ip()
                    ));
                }
            }
        }
        let ft_env = ft_store.as_ref().map(|s| FtEnv {
            group: node_rank,
            groups: self.cfg.rdzv.max_nodes.max(roster.members.len() as u32),
            store: s.local_addr(),
            lighthouse: self.lighthouse.as_ref().map(|l| l.addr),
            restarts: self.ft_launches,
            hostname: std::env::var("MESHD_HOSTNAME").unwrap_or_else(|_| url_host(self.addr.ip())),
        });
        if ft {
            self.ft_launches += 1;
        }
        let first = roster.first_global_rank(node_rank);
        let globals: Vec<u32> = (0..roster.members[node_rank].nproc).map(|l| first + l).collect();
        let round_dir = self.dirs.as_ref().map(|d| d.round(restart, &globals));
        let tunnel = (verdict.collective == Collective::Tunnel)
            .then(|| {
                self.tunnel_host.start_round(
                    roster,
                    node_rank,
                    &ft_store.iter().map(|s| s.local_addr().port()).collect::<Vec<_>>(),
                    svc.as_ref().map(|s| s.path()),
                    self.cfg.preload_lib.as_deref(),
                )
            })
            .flatten();
        // `--fault-tolerance node`: the ranks load meshd's preload library for `gethostname`
        // (MESHD_HOSTNAME), the tunnel's copy when there is one.
        let preload = match (&ft_env, &tunnel, svc.as_ref().and_then(|s| s.path().parent())) {
            (Some(_), None, Some(dir)) => {
                match crate::tunnel::Preload::write(dir, self.cfg.preload_lib.as_deref()) {
                    Ok(p) => Some(p),
                    Err(e) => {
                        warn!(
                            "cannot write meshd's preload library in {}: {e}; torchft's ranks advertise their host \
                         name, which other nodes may not reach",
                            dir.display()
                        );
                        None
                    }
                }
            }
            _ => None,
        };
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
                // The ranks inherit meshd's LD_PRELOAD: meshd's library goes first.
                let user_preload = std::env::var("LD_PRELOAD").ok();
                if let Some(t) = &tunnel {
                    env.extend(t.env(user_preload.as_deref()));
                } else if let Some(p) = &preload {
                    env.push(p.env(user_preload.as_deref()));
                }
                if let Some(id) = nccl_id {
                    env.push((
                        "MESHD_NCCL_UNIQUE_ID".into(),
                        id.iter().map(|b| format!("{b:02x}")).collect(),
                    ));
                }
                if let Some(f) = &ft_env {
                    ft_rank_env(&mut env, l, roster.members[node_rank].nproc, f);
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
            ft_store,
            preload,
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
        drop(r.ft_store.take());
        drop(r.preload.take());
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

    fn roster_changed(&mut self, roster: &Roster, me: NodeId) {
        let Some(r) = self.round.as_mut() else { return };
        if let Some(t) = r.tunnel.as_mut() {
            t.set_roster(roster, me);
        }
        if let Some(rank) = roster.node_rank(me) {
            r.node_rank = rank;
        }
        r.roster = roster.clone();
    }

    fn group_lost(&mut self, addr: std::net::SocketAddr, who: &str, abort: Option<core::AbortGroup>) {
        let (ip, who) = (addr.ip(), who.to_string());
        // Tunnelled connections are meshd's own to end: at once, here.
        let tunnelled =
            self.round.as_ref().and_then(|r| r.tunnel.as_ref()).map_or(0, |t| t.cut(ip, abort.as_ref()));
        if tunnelled > 0 {
            info!(
                "reset {} of this node's ranks with {who}{}, so that their collectives with it fail now, not at \
                 their timeout",
                crate::plural(tunnelled as u64, "tunnelled connection"),
                if abort.is_some() {
                    " (and with the other replica groups: the step is lost with it)"
                } else {
                    ""
                }
            );
        }
        tokio::task::spawn_blocking(move || {
            let root = std::process::id() as i32;
            let all = crate::supervisor::sockets::sockets();
            let mut inodes = supervisor::cut::sockets_to(&all, ip);
            let to_lost = inodes.len();
            if let Some(a) = &abort {
                inodes.extend(supervisor::cut::sockets_to_peers_except(&all, &a.peers, &a.keep));
            }
            let cut = supervisor::cut::cut_inodes(root, inodes);
            if cut.cut > 0 {
                let others = if abort.is_some() && cut.cut > to_lost {
                    " and of their process group with the other replica groups (the step is lost with it)"
                } else {
                    ""
                };
                info!(
                    "closed {} of this node's ranks to {who}{others}, so that their collectives with it fail \
                     now, not at their timeout",
                    crate::plural(cut.cut as u64, "TCP connection")
                );
            } else if cut.failed.is_empty() && tunnelled == 0 {
                info!("this node's ranks held no TCP connections to {who}");
            }
            if !cut.failed.is_empty() {
                warn!(
                    "could not close this node's ranks' connections to {who} ({}); their collectives with it \
                     end at their own timeout",
                    cut.failed.join("; ")
                );
            }
        });
    }

    /// Every node says why, once the ranks' last output is out.
    async fn round_failed(&mut self, _reason: &str, cause: Option<&RankFailure>, restarting: bool) {
        self.round = None;
        let Some(c) = cause else { return };
        supervisor::output::flush().await;
        eprint!("{}", cause::block(c, restarting));
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

pub mod cause;
mod env;
mod failure;
mod phases;

use env::set_env;
pub use env::{FtEnv, cross_check, ft_rank_env, rank_env, slurm_rank_env, url_host};
use failure::{describe_member, rank_failure, stalled};
use phases::Phases;
pub use phases::mark_cpu_start;

#[cfg(test)]
mod tests;
