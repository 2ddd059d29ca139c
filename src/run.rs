//! `meshd run`: the identical command on every node.

use crate::common::{self, NetArgs};
use crate::env::EnvConfig;
use anyhow::{Context, Result, bail};
use clap::ArgAction;
use clap::builder::BoolishValueParser;
use meshd::job::{self, JobConfig};
use meshd::mesh::{Mesh, MeshConfig, stable_hash};
use meshd::preflight::PreflightInput;
use meshd::proto::membership::MembershipConfig;
use meshd::proto::node::LocalFacts;
use meshd::proto::preflight::Collective;
use meshd::proto::rendezvous::RdzvConfig;
use meshd::signals::Signals;
use meshd::supervisor::{OutputSpec, StdStreams};
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub job: JobArgs,
    /// torchrun's -m: run the script as a Python module (`python -u -m MODULE ARGS`).
    #[arg(short = 'm', long, env = "PET_MODULE", value_parser = BoolishValueParser::new(), default_value_t = false, action = ArgAction::SetTrue)]
    pub module: bool,
    /// torchrun's --no-python: run the script directly, not through Python.
    #[arg(long, alias = "no_python", env = "PET_NO_PYTHON", value_parser = BoolishValueParser::new(), default_value_t = false, action = ArgAction::SetTrue)]
    pub no_python: bool,
    /// torchrun's --run-path: run the script as `__main__` in a fresh Python (the same as a script path here).
    #[arg(long, alias = "run_path", env = "PET_RUN_PATH", value_parser = BoolishValueParser::new(), default_value_t = false, action = ArgAction::SetTrue)]
    pub run_path: bool,
    /// The command to start on every node, once per local process: after `--` as given
    /// (`meshd run -- python train.py`), or torchrun's form without `--`, a Python script
    /// (a module with -m) and its arguments, run as `PYTHON -u SCRIPT ARGS`: the first of
    /// them ends meshd's options.
    #[arg(value_name = "CMD", trailing_var_arg = true, required = true)]
    pub cmd: Vec<String>,
    /// Whether CMD came after `--` (set from the raw arguments by [`Args::note_dashdash`]).
    #[arg(skip)]
    pub dashdash: bool,
}

impl Args {
    /// Notes whether CMD followed `--` in `argv` (the raw command line): CMD is the tail of
    /// it, so the word before that tail tells.
    pub fn note_dashdash<S: AsRef<str>>(&mut self, argv: &[S]) {
        let n = self.cmd.len();
        self.dashdash = argv.len() > n && argv[argv.len() - n - 1].as_ref() == "--";
    }
}

/// Options shared by `run` and `doctor`. Every multi-word flag is also accepted with
/// underscores (torchrun's spelling), and torchrun's flags also from their `PET_<NAME>`
/// variables (flag > variable > default), as Kubeflow's PyTorchJob sets them.
#[derive(clap::Args, Debug)]
pub struct JobArgs {
    /// Nodes to wait for: N, or MIN:MAX (start once MIN are present and no newcomer arrived for --settle); default: under SLURM the step's node count (SLURM_STEP_NUM_NODES, else SLURM_NNODES), else 1 without peers.
    #[arg(long, env = "PET_NNODES")]
    pub nnodes: Option<String>,
    /// Peers: host[:port],...  @FILE  dns:NAME (default: SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST). Any one reachable member is enough.
    #[arg(long)]
    pub peers: Option<String>,
    /// torchrun's rendezvous endpoint HOST[:PORT]: HOST is one more peer, reached on meshd's --port (the PORT, torchrun's TCP store port, is not used).
    #[arg(long, alias = "rdzv_endpoint", env = "PET_RDZV_ENDPOINT")]
    pub rdzv_endpoint: Option<String>,
    /// Processes per node: a number, auto (visible GPUs, else 1), gpu (visible GPUs) or cpu (CPU count, as torchrun).
    #[arg(long, alias = "nproc_per_node", env = "PET_NPROC_PER_NODE", default_value = "auto")]
    pub nproc_per_node: String,
    /// One node only: no peers, no token; an ephemeral UDP port unless --port is given (torchrun's --standalone).
    #[arg(long, env = "PET_STANDALONE", value_parser = BoolishValueParser::new(), default_value_t = false, action = ArgAction::SetTrue)]
    pub standalone: bool,
    /// Force the interface instead of choosing by probing.
    #[arg(long)]
    pub iface: Option<String>,
    /// Separates jobs on the same network (default: from SLURM_JOB_ID; never from the token); --rdzv-id is the same.
    #[arg(long, aliases = ["run_id", "rdzv-id", "rdzv_id"], env = "PET_RDZV_ID")]
    pub run_id: Option<String>,
    /// Re-rendezvous and restart all ranks up to N times after a failure (with --fault-tolerance node: each node restarts its own ranks up to N times).
    #[arg(long, alias = "max_restarts", env = "PET_MAX_RESTARTS", default_value_t = 0)]
    pub max_restarts: u32,
    /// job: any failure stops every rank on every node (and --max-restarts restarts them all). node: each node is one replica group (torchft): a failure restarts that node's ranks only, a lost node is dropped while the others go on, a node started later joins; the job stops only when fewer than MIN groups remain.
    #[arg(long, alias = "fault_tolerance", value_enum, default_value_t = FaultToleranceArg::Job)]
    pub fault_tolerance: FaultToleranceArg,
    /// Give up waiting for nodes after this long (300s, 5m, 1h).
    #[arg(long, alias = "rdzv_timeout", default_value = "300s", value_parser = parse_duration)]
    pub rdzv_timeout: Duration,
    /// With --nnodes MIN:MAX: start after this long without a newcomer.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub settle: Duration,
    /// auto | nccl | quic | tunnel (MESHD_COLLECTIVE given to the ranks; tunnel: their TCP connections to other nodes go through meshd's UDP port).
    #[arg(long, value_enum, default_value_t = CollectiveArg::Auto)]
    pub collective: CollectiveArg,
    /// Also write each rank's stdout/stderr to files under DIR.
    #[arg(long, alias = "log_dir", env = "PET_LOG_DIR")]
    pub log_dir: Option<std::path::PathBuf>,
    /// torchrun's --redirects: streams that go only to the log files, not the console: 0 none, 1 stdout, 2 stderr, 3 both; or per local rank (0:1,1:2).
    #[arg(short = 'r', long, env = "PET_REDIRECTS")]
    pub redirects: Option<String>,
    /// torchrun's --tee: streams that go to the console as well as the log files (same values as --redirects).
    #[arg(short = 't', long, env = "PET_TEE")]
    pub tee: Option<String>,
    /// Only these local ranks' output on the console (0,1); log files get every rank's.
    #[arg(long, alias = "local_ranks_filter", env = "PET_LOCAL_RANKS_FILTER")]
    pub local_ranks_filter: Option<String>,
    /// Time between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub grace: Duration,
    /// Signals that stop the job (torchrun's --signals-to-handle; SIGINT and SIGTERM always do). SIGUSR1/SIGUSR2 not listed are forwarded to every rank on every node.
    #[arg(long, alias = "signals_to_handle", env = "PET_SIGNALS_TO_HANDLE", default_value = meshd::signals::DEFAULT_STOPS)]
    pub signals_to_handle: String,
    /// Stop the job, printing the ranks' Python stacks, when no rank of a node wrote output or called meshd's local service for this long (exit status 124).
    #[arg(long, alias = "stall_timeout", value_parser = parse_duration)]
    pub stall_timeout: Option<Duration>,
    /// Fail a collective of meshd's QUIC ring, naming the node, when no byte moved between this node and a neighbour for this long (the ranks get the error).
    #[arg(long, default_value = "60s", value_parser = parse_positive_duration)]
    pub collective_timeout: Duration,
    /// The ranks' ROLE_NAME (torchrun's --role).
    #[arg(long, env = "PET_ROLE", default_value = "default")]
    pub role: String,
    /// torchrun's per-node flag: accepted, checked against the node rank meshd agreed on (a difference is a warning).
    #[arg(long, alias = "node_rank", env = "PET_NODE_RANK")]
    pub node_rank: Option<u32>,
    /// torchrun's per-node flag: accepted, checked against the master meshd agreed on (a difference is a warning).
    #[arg(long, alias = "master_addr", env = "PET_MASTER_ADDR")]
    pub master_addr: Option<String>,
    /// MASTER_PORT to use when it is free on the master (else a free one, with a warning naming both).
    #[arg(long, alias = "master_port", env = "PET_MASTER_PORT")]
    pub master_port: Option<u16>,
    /// torchrun's rendezvous backend: accepted and ignored (meshd is the rendezvous).
    #[arg(long, alias = "rdzv_backend", env = "PET_RDZV_BACKEND", hide = true)]
    pub rdzv_backend: Option<String>,
    /// torchrun's rendezvous configuration: accepted and ignored.
    #[arg(long, alias = "rdzv_conf", env = "PET_RDZV_CONF", hide = true)]
    pub rdzv_conf: Option<String>,
    /// torchrun's monitor interval: accepted and ignored (meshd learns of an exit at once).
    #[arg(long, alias = "monitor_interval", env = "PET_MONITOR_INTERVAL", hide = true)]
    pub monitor_interval: Option<String>,
    /// torchrun's start method: accepted and ignored (ranks are always separate processes).
    #[arg(long, alias = "start_method", env = "PET_START_METHOD", hide = true)]
    pub start_method: Option<String>,
    /// torchrun's local address: accepted and ignored (meshd proves which interface connects the nodes).
    #[arg(long, alias = "local_addr", env = "PET_LOCAL_ADDR", hide = true)]
    pub local_addr: Option<String>,
    #[command(flatten)]
    pub net: NetArgs,
}

/// [`parse_duration`], refusing zero (a deadline that always passed).
pub fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    parse_duration(s)
        .and_then(|d| if d.is_zero() { Err(format!("{s:?}: must be more than zero")) } else { Ok(d) })
}

/// Parses `300`, `300s`, `1500ms`, `5m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) =
        s.find(|c: char| !c.is_ascii_digit() && c != '.').map(|i| s.split_at(i)).unwrap_or((s, "s"));
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration (try 300s, 5m, 1h)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    };
    if !secs.is_finite() || !(0.0..=1e7).contains(&secs) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Parses `N` or `MIN:MAX`.
pub fn parse_nnodes(s: &str) -> Result<(u32, u32)> {
    let bad = || format!("--nnodes {s:?}: expected N or MIN:MAX with 1 <= MIN <= MAX");
    let (a, b) = s.split_once(':').unwrap_or((s, s));
    let min: u32 = a.trim().parse().ok().with_context(bad)?;
    let max: u32 = b.trim().parse().ok().with_context(bad)?;
    if min == 0 || max < min {
        bail!(bad());
    }
    Ok((min, max))
}

/// `--nnodes`, else (like torchrun) one node when no peer is listed; with peers it must be
/// given, and the error says what to pass.
pub fn nnodes_or_default(flag: Option<&str>, peers: Option<&str>, slurm_nodelist: bool) -> Result<String> {
    if let Some(n) = flag {
        return Ok(n.to_string());
    }
    match peers {
        None if !slurm_nodelist => Ok("1".into()),
        None => bail!(
            "--nnodes is required with SLURM's node list (neither SLURM_STEP_NUM_NODES nor SLURM_NNODES is \
             set): pass --nnodes N, the number of nodes of the job, or MIN:MAX"
        ),
        Some(p) => {
            let listed = if p.contains('@') || p.contains("dns:") {
                String::new()
            } else {
                let n = p.split(',').filter(|s| !s.trim().is_empty()).count();
                format!(
                    " (e.g. --nnodes {n} if the {} listed are the whole job)",
                    meshd::plural(n as u64, "peer")
                )
            };
            bail!(
                "--nnodes is required with --peers: pass --nnodes N, the number of nodes that must join \
                 before the job starts{listed}, or MIN:MAX"
            )
        }
    }
}

/// Processes per node: a number, `auto` (the visible `gpus`, else 1), `gpu` (the visible
/// GPUs; an error without any) or `cpu` (the CPU count, as torchrun's `os.cpu_count()`).
pub fn nproc(spec: &str, gpus: u32) -> Result<u32> {
    match spec {
        "auto" => return Ok(gpus.max(1)),
        "gpu" if gpus == 0 => {
            bail!("--nproc-per-node gpu: no GPU is visible on this node (try auto, cpu or N)")
        }
        "gpu" => return Ok(gpus),
        "cpu" => return Ok(cpu_count()),
        _ => {}
    }
    spec.parse()
        .ok()
        .filter(|n| *n > 0)
        .with_context(|| format!("--nproc-per-node {spec:?}: expected a positive number, auto, gpu or cpu"))
}

/// Logical CPUs online, as Python's `os.cpu_count()`.
fn cpu_count() -> u32 {
    // SAFETY: sysconf reads a system constant.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 { n as u32 } else { std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1) }
}

/// The host of torchrun's `--rdzv-endpoint HOST[:PORT]` (`[V6]:PORT` too) and its port.
pub fn endpoint_host(ep: &str) -> (String, Option<u16>) {
    let ep = ep.trim();
    if let Some(rest) = ep.strip_prefix('[') {
        if let Some((h, tail)) = rest.split_once(']') {
            return (h.to_string(), tail.strip_prefix(':').and_then(|p| p.parse().ok()));
        }
    }
    match ep.split_once(':') {
        Some((h, p)) if !p.contains(':') => (h.to_string(), p.parse().ok()),
        _ => (ep.to_string(), None),
    }
}

/// The peer list from `--peers` and torchrun's `--rdzv-endpoint` (its host, on meshd's port).
pub fn seed_list(peers: Option<&str>, endpoint: Option<&str>, port: u16) -> Option<String> {
    let ep = endpoint.filter(|e| !e.trim().is_empty()).map(|e| {
        let (host, p) = endpoint_host(e);
        match p {
            Some(p) if p != port => tracing::info!(
                "--rdzv-endpoint {e}: joining through {host} on meshd's UDP port {port} (the port {p} is \
                 torchrun's TCP store port; meshd has no separate one: pass --port {p} to use that)"
            ),
            _ => tracing::debug!("--rdzv-endpoint {e}: {host} is a seed peer on port {port}"),
        }
        if host.contains(':') { format!("[{host}]") } else { host }
    });
    match (peers, ep) {
        (Some(p), Some(e)) => Some(format!("{p},{e}")),
        (Some(p), None) => Some(p.to_string()),
        (None, e) => e,
    }
}

/// The Python that runs a script given torchrun's way: `MESHD_PYTHON`, else torchrun's
/// `PYTHON_EXEC`, else the `python3` (or `python`) beside meshd's own executable (meshd
/// installed into a virtual environment's `bin/`), else `python3` on PATH.
pub fn python(env: &EnvConfig) -> String {
    if let Some(p) = &env.python {
        return p.clone();
    }
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.to_path_buf())) {
        for name in ["python3", "python"] {
            let p = dir.join(name);
            if p.is_file() {
                return p.display().to_string();
            }
        }
    }
    "python3".into()
}

/// What every rank runs: `-- CMD` as given (with `-m`: `PYTHON -u -m CMD`), or torchrun's
/// form `SCRIPT ARGS` as `PYTHON -u SCRIPT ARGS` (`-m`: a module; `--no-python`: SCRIPT
/// itself; `--run-path`: as a script path).
pub fn command(a: &Args, python: &str) -> Result<Vec<String>> {
    let py = |m: bool, rest: &[String]| {
        let mut v = vec![python.to_string(), "-u".to_string()];
        if m {
            v.push("-m".into());
        }
        v.extend(rest.iter().cloned());
        v
    };
    if a.module && a.no_python {
        bail!("-m (--module) and --no-python cannot be used together: a module needs Python");
    }
    if a.run_path && a.module {
        bail!("--run-path and -m (--module) cannot be used together: --run-path takes a script path");
    }
    if a.cmd.is_empty() {
        bail!(
            "no command: give it after `--` (meshd run [OPTS] -- CMD ARGS) or, as with torchrun, a Python \
             script and its arguments (meshd run [OPTS] train.py --lr 3)"
        );
    }
    if !a.dashdash {
        return Ok(if a.no_python { a.cmd.clone() } else { py(a.module, &a.cmd) });
    }
    Ok(if a.module { py(true, &a.cmd) } else { a.cmd.clone() })
}

/// Everything `run` and `doctor` need, from the flags.
pub struct Prepared {
    pub mesh: MeshConfig,
    pub job: JobConfig,
    pub run_id: String,
}

/// Shell-like rendering of a command for messages (shortened).
pub fn show_cmd(cmd: &[String]) -> String {
    let s = cmd
        .iter()
        .map(|a| {
            if a.is_empty() || a.contains(|c: char| c.is_whitespace() || "'\"$`\\".contains(c)) {
                format!("'{}'", a.replace('\'', "'\\''"))
            } else {
                a.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    if s.chars().count() > 160 { format!("{}...", s.chars().take(157).collect::<String>()) } else { s }
}

/// `--fault-tolerance`: what a failure stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FaultToleranceArg {
    /// The whole job (torchrun's model).
    Job,
    /// One node's replica group (torchft's model).
    Node,
}

/// `--collective`: the preflight decides (`auto`), or one is forced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CollectiveArg {
    /// nccl when TCP between the nodes works, else tunnel.
    Auto,
    /// NCCL and Gloo as usual.
    Nccl,
    /// meshd's ring over its UDP port (the Python client and DDP hook).
    Quic,
    /// The ranks' TCP connections to other nodes go through meshd's UDP port.
    Tunnel,
}

impl CollectiveArg {
    /// The collective forced on the preflight, if any.
    pub fn forced(self) -> Option<Collective> {
        match self {
            CollectiveArg::Auto => None,
            CollectiveArg::Nccl => Some(Collective::Nccl),
            CollectiveArg::Quic => Some(Collective::Quic),
            CollectiveArg::Tunnel => Some(Collective::Tunnel),
        }
    }
}

pub fn prepare(a: &JobArgs, cmd: &[String], env: &EnvConfig) -> Result<Prepared> {
    for (flag, v, why) in [
        ("--rdzv-backend", &a.rdzv_backend, "meshd is the rendezvous"),
        ("--rdzv-conf", &a.rdzv_conf, "meshd's rendezvous takes --rdzv-timeout and --settle"),
        ("--monitor-interval", &a.monitor_interval, "meshd learns of a rank's exit at once"),
        ("--start-method", &a.start_method, "ranks are always separate processes"),
        ("--local-addr", &a.local_addr, "meshd proves which interface connects the nodes"),
    ] {
        if let Some(v) = v {
            tracing::debug!("{flag} {v} accepted and ignored: {why}");
        }
    }
    // Under SLURM, the step's node count and node list (srun -N2 in a 4-node allocation
    // runs on 2 nodes; srun --preserve-env leaves SLURM_NNODES at the allocation's).
    let slurm_nnodes = env.slurm.nnodes.clone();
    let mut port = a.net.port;
    let (nnodes, peer_text) = if a.standalone {
        if let Some(n) = a.nnodes.as_deref().filter(|n| parse_nnodes(n).ok() != Some((1, 1))) {
            bail!("--standalone runs one node: --nnodes {n} contradicts it (drop one of them)");
        }
        if a.peers.is_some() || a.rdzv_endpoint.is_some() {
            tracing::info!("--standalone: one node, the listed peers and --rdzv-endpoint are not contacted");
        }
        // As torchrun's standalone rendezvous: any free port, so several such jobs can share a
        // machine, unless --port says which.
        if !a.net.port_given {
            port = 0;
        }
        ("1".to_string(), None)
    } else {
        let peer_text = seed_list(a.peers.as_deref(), a.rdzv_endpoint.as_deref(), port);
        let nnodes = nnodes_or_default(
            a.nnodes.as_deref().or(slurm_nnodes.as_deref()),
            peer_text.as_deref(),
            env.slurm.nodelist.is_some(),
        )?;
        (nnodes, peer_text)
    };
    let nnodes = &nnodes;
    let (min, max) = parse_nnodes(nnodes)?;
    // GPUs through the CUDA driver (else /dev/nvidiaN): both `auto` and the preflight use it.
    let (gpus, cuda_driver) = match meshd_nccl::cuda_info() {
        Ok(c) => (c.devices, c.driver_version),
        Err(_) => (nproc_gpus(env.cuda_visible.as_deref()), 0),
    };
    let nproc = nproc(&a.nproc_per_node, gpus)?;
    let token = a.net.token_for(max)?;
    if token.is_none() && max > 1 && a.collective.forced() == Some(Collective::Tunnel) {
        bail!(
            "--collective tunnel needs a token: the tunnel lets the nodes' ranks reach each other's TCP \
             ports, and with --insecure anyone who reaches UDP port {port} could; make one with \
             `meshd token --file ~/.meshd-token` and pass --token-file on every node"
        );
    }
    let (peers, unresolved) = if a.standalone {
        (Vec::new(), Vec::new())
    } else {
        common::peers(peer_text.as_deref(), port, env.slurm.nodelist.as_deref())?
    };
    if peers.is_empty() && unresolved.is_empty() && max > 1 {
        bail!(
            "--nnodes {nnodes} needs --peers (or --rdzv-endpoint, or SLURM's node list): at least one other \
             node's address"
        );
    }
    let output = OutputSpec {
        redirects: parse_std_opt("--redirects", a.redirects.as_deref())?,
        tee: parse_std_opt("--tee", a.tee.as_deref())?,
        console_ranks: match a.local_ranks_filter.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
            None => None,
            Some(f) => {
                Some(f.split(',').map(|r| r.trim().parse::<u32>()).collect::<Result<Vec<u32>, _>>().map_err(
                    |_| anyhow::anyhow!("--local-ranks-filter {f:?}: expected local ranks like 0,1"),
                )?)
            }
        },
    };
    let cmd_hash = stable_hash(&cmd.iter().map(|s| s.as_bytes()).collect::<Vec<_>>());
    // The default run id depends on SLURM's job id only: never on the token (it reaches the
    // ranks' TORCHELASTIC_RUN_ID and the socket path; nothing derived from the token may be
    // published), nor on the peer list (nodes may each be given a different member to join
    // through), nor on the command (nodes started with different commands must meet, so that
    // the preflight can refuse the launch and say which node differs). Jobs with different
    // tokens are kept apart by authentication.
    let run_id = a.run_id.clone().unwrap_or_else(|| match &env.slurm.job_id {
        Some(job) => format!("meshd-slurm-{:012x}", stable_hash(&[job.as_bytes()]) >> 16),
        None => "meshd-default".to_string(),
    });
    // NCCL only where it can be used: GPUs visible, NCCL asked for, or a library named.
    // Elsewhere nothing is searched or loaded (libnccl is large; its search is not free).
    let wants_nccl = gpus > 0 || a.collective == CollectiveArg::Nccl || env.nccl_lib;
    let (nccl_version, nccl_note) = if !wants_nccl {
        tracing::debug!("no GPU visible: NCCL not looked for (MESHD_NCCL_UNIQUE_ID will not be set)");
        (0, Some("no GPU visible on the master: NCCL not loaded".to_string()))
    } else {
        match meshd_nccl::NcclLib::load() {
            Ok(lib) => {
                tracing::debug!("NCCL {} from {}", lib.version_string(), lib.path().display());
                (lib.version(), None)
            }
            Err(e) => {
                let (line, note) = nccl_missing(&e);
                tracing::info!("{line}");
                tracing::debug!("NCCL search: {e}");
                (0, Some(note))
            }
        }
    };

    let mesh = MeshConfig {
        node: meshd::random_node_id(),
        port,
        token,
        run_id: run_id.clone(),
        peers,
        unresolved,
        resolve_timeout: a.rdzv_timeout,
        min_nodes: min,
        max_nodes: max,
        iface: a.iface.clone(),
        nproc,
        cmd_hash,
        membership: MembershipConfig::default(),
        gso: env.gso,
        plane: env.plane,
        plane_lanes: env.lanes,
        cc: env.cc,
    };
    let job = JobConfig {
        cmd: cmd.to_vec(),
        nproc,
        max_restarts: a.max_restarts,
        rdzv: RdzvConfig {
            min_nodes: min,
            max_nodes: max,
            settle: a.settle,
            ack_timeout: Duration::from_secs(3),
        },
        rdzv_timeout: a.rdzv_timeout,
        log_dir: a.log_dir.clone(),
        preflight: PreflightInput {
            facts: LocalFacts {
                cmd: if cmd.is_empty() { "(none: doctor)".into() } else { show_cmd(cmd) },
                cmd_hash,
                nproc,
                gpus,
                cuda_driver,
                nccl_version,
                forced: a.collective.forced(),
                ..LocalFacts::default()
            },
            connect_timeout: Duration::from_secs(2),
            nccl_id: None,
            nccl_note,
        },
        grace: a.grace,
        role: a.role.clone(),
        expect_node_rank: a.node_rank,
        expect_master_addr: a.master_addr.clone(),
        master_port: a.master_port,
        output,
        stall_timeout: a.stall_timeout.filter(|d| !d.is_zero()),
        ring: env.ring(),
        preload_lib: env.preload_lib.clone(),
        runtime_dir: env.runtime_dir.clone(),
        collective_timeout: a.collective_timeout,
        signals_to_handle: a.signals_to_handle.clone(),
        fault_tolerance: match a.fault_tolerance {
            FaultToleranceArg::Job => meshd::proto::node::FaultTolerance::Job,
            FaultToleranceArg::Node => meshd::proto::node::FaultTolerance::Node,
        },
    };
    Ok(Prepared { mesh, job, run_id })
}

/// `--redirects` / `--tee`, when given.
fn parse_std_opt(flag: &str, v: Option<&str>) -> Result<StdStreams> {
    match v {
        None => Ok(StdStreams::default()),
        Some(v) => StdStreams::parse(v).map_err(|e| anyhow::anyhow!("{flag} {v:?}: {e}")),
    }
}

/// Without libnccl: the one INFO line (what is missing, what is not set because of it, how
/// to get it; the loader's whole search goes to debug) and the short note the preflight
/// shows.
pub fn nccl_missing(e: &meshd_nccl::NcclError) -> (String, String) {
    const GET: &str = "pip install nvidia-nccl-cu12, or MESHD_NCCL_LIB=/path/libnccl.so.2";
    let what = match e {
        meshd_nccl::NcclError::NotFound { .. } => "libnccl not found".to_string(),
        other => other.to_string(),
    };
    (
        format!(
            "{what}: MESHD_NCCL_UNIQUE_ID will not be set (ranks load their own NCCL); to get it: {GET} \
             (MESHD_LOG=debug shows where meshd looked)"
        ),
        format!("{what} ({GET})"),
    )
}

/// GPUs visible on this host (/dev/nvidiaN; `cuda_visible`, CUDA_VISIBLE_DEVICES, narrows it).
pub fn nproc_gpus(cuda_visible: Option<&str>) -> u32 {
    let dev = std::fs::read_dir("/dev")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    let name = e.file_name();
                    let name = name.to_string_lossy();
                    name.strip_prefix("nvidia")
                        .is_some_and(|r| !r.is_empty() && r.chars().all(|c| c.is_ascii_digit()))
                })
                .count() as u32
        })
        .unwrap_or(0);
    match cuda_visible {
        Some(v) if dev > 0 => {
            (v.split(',').filter(|s| !s.trim().is_empty() && s.trim() != "-1").count() as u32).min(dev)
        }
        _ => dev,
    }
}

/// The exit status of a `meshd run` whose rendezvous timed out (`--rdzv-timeout`): the node
/// core's outcome code, as torchrun exits 1 on a rendezvous timeout. Bad flags and setup
/// errors exit 2.
pub const RDZV_TIMEOUT_EXIT: u8 = 1;

pub async fn main(a: Args, signals: Signals, env: &EnvConfig) -> Result<ExitCode> {
    let cmd = command(&a, &python(env))?;
    tracing::debug!("command of every rank: {}", show_cmd(&cmd));
    let p = prepare(&a.job, &cmd, env)?;
    let mut sig = signals.clone();
    let mesh = tokio::select! {
        m = Mesh::start(p.mesh) => match m {
            Ok(m) => m,
            // No listed peer resolved in time: a rendezvous that timed out, with its code.
            Err(meshd::mesh::MeshError::Timeout(msg)) => {
                tracing::error!("rendezvous timed out: {msg}");
                return Ok(ExitCode::from(RDZV_TIMEOUT_EXIT));
            }
            Err(e) => return Err(e.into()),
        },
        s = sig.recv() => {
            tracing::error!("{} while joining the mesh", s.describe());
            return Ok(ExitCode::from(s.exit_code()));
        }
    };
    let outcome = job::run(mesh, &p.job, &p.run_id, &signals).await?;
    if outcome.code == 0 {
        tracing::info!("{}", outcome.message);
    } else {
        tracing::error!("{}", outcome.message);
    }
    Ok(ExitCode::from(outcome.code))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("300"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("300s"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("abc").is_err());
        assert!(parse_duration("1e300").is_err());
    }

    #[test]
    fn nnodes() {
        assert_eq!(parse_nnodes("3").expect("n"), (3, 3));
        assert_eq!(parse_nnodes("2:4").expect("range"), (2, 4));
        assert!(parse_nnodes("0").is_err());
        assert!(parse_nnodes("4:2").is_err());
        assert!(parse_nnodes("x").is_err());
    }

    #[test]
    fn nccl_missing_is_one_short_line() {
        let tried: Vec<String> =
            (0..12).map(|i| format!("dlopen(\"/some/long/path/{i}/libnccl.so.2\"): no")).collect();
        let (line, note) = nccl_missing(&meshd_nccl::NcclError::NotFound { tried });
        assert!(line.len() < 220, "{} chars: {line}", line.len());
        assert!(!line.contains("dlopen"), "the search is at debug: {line}");
        assert!(line.starts_with("libnccl not found: MESHD_NCCL_UNIQUE_ID will not be set"), "{line}");
        assert!(
            line.contains("pip install nvidia-nccl-cu12")
                && line.contains("MESHD_NCCL_LIB=/path/libnccl.so.2")
        );
        assert!(note.len() < 120 && note.contains("pip install nvidia-nccl-cu12"), "{note}");
    }

    #[test]
    fn nnodes_defaults_to_one_without_peers_and_says_what_to_pass_with_them() {
        assert_eq!(nnodes_or_default(None, None, false).expect("one node"), "1");
        assert_eq!(nnodes_or_default(Some("2:4"), Some("a,b"), false).expect("given"), "2:4");
        let e = nnodes_or_default(None, Some("10.0.0.2,10.0.0.34,10.0.0.7"), false)
            .expect_err("needs it")
            .to_string();
        assert!(e.contains("pass --nnodes N") && e.contains("e.g. --nnodes 3 if the 3 peers listed"), "{e}");
        let e = nnodes_or_default(None, None, true).expect_err("SLURM without SLURM_NNODES").to_string();
        assert!(e.contains("pass --nnodes N"), "{e}");
    }

    #[test]
    fn nproc_numbers() {
        assert_eq!(nproc("4", 0).expect("4"), 4);
        assert!(nproc("0", 0).is_err());
        assert!(nproc("many", 0).is_err());
        assert_eq!(nproc("auto", 8).expect("auto"), 8);
        assert_eq!(nproc("auto", 0).expect("auto"), 1);
        assert_eq!(nproc("gpu", 4).expect("gpu"), 4);
        assert!(nproc("gpu", 0).expect_err("no gpu").to_string().contains("no GPU"));
        assert_eq!(nproc("cpu", 0).expect("cpu"), cpu_count());
        assert!(cpu_count() >= 1);
    }

    #[derive(clap::Parser, Debug)]
    struct T {
        #[command(subcommand)]
        c: Sub,
    }

    #[derive(clap::Subcommand, Debug)]
    enum Sub {
        Run(Args),
    }

    /// A command line as the shell splits it -> the parsed `run` arguments.
    fn parse(line: &str) -> Result<Args, clap::Error> {
        use clap::Parser;
        let argv: Vec<&str> = std::iter::once("meshd").chain(line.split_whitespace()).collect();
        let Sub::Run(mut a) = T::try_parse_from(&argv)?.c;
        a.note_dashdash(&argv);
        Ok(a)
    }

    fn runs(line: &str) -> Vec<String> {
        let a = parse(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        command(&a, "/venv/bin/python3").unwrap_or_else(|e| panic!("{line}: {e}"))
    }

    #[test]
    fn a_torchrun_line_runs_unchanged() {
        let line = "run --nnodes=3 --nproc_per_node=2 --rdzv_id=job7 --rdzv_backend=c10d \
                    --rdzv_endpoint=head:29400 --max_restarts 2 --monitor_interval=5 --start_method spawn \
                    --role trainer --log_dir /tmp/l --redirects 3 --tee 0:3 --local_ranks_filter 0 \
                    train.py --lr 3 --epochs=2";
        let a = parse(line).expect("parses");
        assert_eq!(
            command(&a, "/venv/bin/python3").expect("cmd"),
            ["/venv/bin/python3", "-u", "train.py", "--lr", "3", "--epochs=2"]
        );
        let j = &a.job;
        assert_eq!(j.nnodes.as_deref(), Some("3"));
        assert_eq!(j.nproc_per_node, "2");
        assert_eq!(j.run_id.as_deref(), Some("job7"));
        assert_eq!(j.max_restarts, 2);
        assert_eq!(j.role, "trainer");
        assert_eq!(j.log_dir.as_deref(), Some(std::path::Path::new("/tmp/l")));
        assert_eq!(j.rdzv_backend.as_deref(), Some("c10d"));
        assert_eq!(j.local_ranks_filter.as_deref(), Some("0"));
        // The rendezvous endpoint's host is a seed peer, reached on meshd's own port.
        assert_eq!(seed_list(j.peers.as_deref(), j.rdzv_endpoint.as_deref(), 29400).as_deref(), Some("head"));
        assert_eq!(seed_list(Some("a,b"), Some("[fd00::1]:29500"), 29400).as_deref(), Some("a,b,[fd00::1]"));
        assert_eq!(endpoint_host("head"), ("head".to_string(), None));
        assert_eq!(endpoint_host("10.0.0.2:1234"), ("10.0.0.2".to_string(), Some(1234)));
        assert_eq!(endpoint_host("[::1]:29400"), ("::1".to_string(), Some(29400)));
        // Dashes and underscores alike; per-node flags are accepted.
        let a = parse("run --nproc-per-node 4 --node_rank 1 --master_addr 10.0.0.2 --master-port 29500 x.py")
            .expect("parses");
        assert_eq!(
            (a.job.node_rank, a.job.master_addr.as_deref(), a.job.master_port),
            (Some(1), Some("10.0.0.2"), Some(29500))
        );
    }

    #[test]
    fn script_module_no_python_and_dashdash_forms() {
        let py = "/venv/bin/python3";
        assert_eq!(runs("run --standalone -- python train.py --lr 3"), ["python", "train.py", "--lr", "3"]);
        assert_eq!(runs("run train.py"), [py, "-u", "train.py"]);
        // The first positional ends meshd's options: later flags are the script's.
        assert_eq!(runs("run train.py --nnodes 9 -- x"), [py, "-u", "train.py", "--nnodes", "9", "--", "x"]);
        assert_eq!(runs("run -m pkg.train --lr 3"), [py, "-u", "-m", "pkg.train", "--lr", "3"]);
        assert_eq!(runs("run --module -- pkg.train"), [py, "-u", "-m", "pkg.train"]);
        assert_eq!(runs("run --no_python ./train.sh a"), ["./train.sh", "a"]);
        assert_eq!(runs("run --no-python -- ./train.sh"), ["./train.sh"]);
        assert_eq!(runs("run --run_path /abs/train.py a"), [py, "-u", "/abs/train.py", "a"]);
        let a = parse("run -m --no-python x").expect("parses");
        assert!(command(&a, py).is_err());
        assert!(parse("run --nproc-per-node 2").is_err(), "a command is required");
        let e = parse("run --nproc-per-nod 2 -- true").expect_err("typo").to_string();
        assert!(e.contains("--nproc-per-node"), "{e}");
    }
}
