//! `meshd run`: the identical command on every node.

use crate::common::{self, NetArgs};
use anyhow::{Context, Result, bail};
use meshd::job::{self, JobConfig};
use meshd::mesh::{Mesh, MeshConfig, stable_hash};
use meshd::preflight::PreflightInput;
use meshd::proto::membership::MembershipConfig;
use meshd::proto::rendezvous::RdzvConfig;
use meshd::signals::Signals;
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub job: JobArgs,
    /// The command to start on every node, once per local process.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

/// Options shared by `run` and `doctor`.
#[derive(clap::Args, Debug)]
pub struct JobArgs {
    /// Nodes to wait for: N, or MIN:MAX (start once MIN are present and no newcomer arrived for --settle); default 1 without peers.
    #[arg(long, env = "SLURM_NNODES")]
    pub nnodes: Option<String>,
    /// Peers: host[:port],...  @FILE  dns:NAME (default: SLURM_JOB_NODELIST). Any one reachable member is enough.
    #[arg(long)]
    pub peers: Option<String>,
    /// Processes per node: a number, or auto (visible GPUs, else 1).
    #[arg(long, default_value = "auto")]
    pub nproc_per_node: String,
    /// Force the interface instead of choosing by probing.
    #[arg(long)]
    pub iface: Option<String>,
    /// Separates jobs on the same network (default: from SLURM_JOB_ID; never from the token).
    #[arg(long)]
    pub run_id: Option<String>,
    /// Re-rendezvous and restart all ranks up to N times after a failure.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Give up waiting for nodes after this long (300s, 5m, 1h).
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    pub rdzv_timeout: Duration,
    /// With --nnodes MIN:MAX: start after this long without a newcomer.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub settle: Duration,
    /// auto | nccl | quic | tunnel (MESHD_COLLECTIVE given to the ranks; tunnel: their TCP connections to other nodes go through meshd's UDP port).
    #[arg(long, default_value = "auto", value_parser = ["auto", "nccl", "quic", "tunnel"])]
    pub collective: String,
    /// Also write each rank's stdout/stderr to DIR/rankN.out and DIR/rankN.err.
    #[arg(long)]
    pub log_dir: Option<std::path::PathBuf>,
    /// Time between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub grace: Duration,
    #[command(flatten)]
    pub net: NetArgs,
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
            "--nnodes is required with SLURM_JOB_NODELIST (SLURM_NNODES is not set): pass --nnodes N, the \
             number of nodes of the job, or MIN:MAX"
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

/// Processes per node: a number, or (`auto`) the visible `gpus`, else 1.
pub fn nproc(spec: &str, gpus: u32) -> Result<u32> {
    if spec != "auto" {
        let n: u32 = spec
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .with_context(|| format!("--nproc-per-node {spec:?}: expected a positive number or auto"))?;
        return Ok(n);
    }
    Ok(gpus.max(1))
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

pub fn prepare(a: &JobArgs, cmd: &[String]) -> Result<Prepared> {
    let nnodes = &nnodes_or_default(
        a.nnodes.as_deref(),
        a.peers.as_deref(),
        std::env::var_os("SLURM_JOB_NODELIST").is_some(),
    )?;
    let (min, max) = parse_nnodes(nnodes)?;
    // GPUs through the CUDA driver (else /dev/nvidiaN): both `auto` and the preflight use it.
    let (gpus, cuda_driver) = match meshd_nccl::cuda_info() {
        Ok(c) => (c.devices, c.driver_version),
        Err(_) => (nproc_gpus(), 0),
    };
    let nproc = nproc(&a.nproc_per_node, gpus)?;
    let token = a.net.token_for(max)?;
    let (peers, unresolved) = common::peers(a.peers.as_deref(), a.net.port)?;
    if peers.is_empty() && unresolved.is_empty() && max > 1 {
        bail!("--nnodes {nnodes} needs --peers (or SLURM_JOB_NODELIST): at least one other node's address");
    }
    let cmd_hash = stable_hash(&cmd.iter().map(|s| s.as_bytes()).collect::<Vec<_>>());
    // The default run id depends on SLURM's job id only: never on the token (it reaches the
    // ranks' TORCHELASTIC_RUN_ID and the socket path; nothing derived from the token may be
    // published), nor on the peer list (nodes may each be given a different member to join
    // through), nor on the command (nodes started with different commands must meet, so that
    // the preflight can refuse the launch and say which node differs). Jobs with different
    // tokens are kept apart by authentication.
    let run_id = a.run_id.clone().unwrap_or_else(|| match std::env::var("SLURM_JOB_ID") {
        Ok(job) if !job.is_empty() => format!("meshd-slurm-{:012x}", stable_hash(&[job.as_bytes()]) >> 16),
        _ => "meshd-default".to_string(),
    });
    let (nccl_version, nccl_note) = match meshd_nccl::NcclLib::load() {
        Ok(lib) => {
            tracing::debug!("NCCL {} from {}", lib.version_string(), lib.path().display());
            (lib.version(), String::new())
        }
        Err(e) => {
            let (line, note) = nccl_missing(&e);
            tracing::info!("{line}");
            tracing::debug!("NCCL search: {e}");
            (0, note)
        }
    };

    let mesh = MeshConfig {
        node: meshd::random_node_id(),
        port: a.net.port,
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
            cmd: if cmd.is_empty() { "(none: doctor)".into() } else { show_cmd(cmd) },
            cmd_hash,
            nproc,
            gpus,
            cuda_driver,
            nccl_version,
            forced: (a.collective != "auto").then(|| a.collective.clone()),
            connect_timeout: Duration::from_secs(2),
            nccl_id: None,
            nccl_note,
        },
        grace: a.grace,
    };
    Ok(Prepared { mesh, job, run_id })
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

/// GPUs visible on this host (/dev/nvidiaN; CUDA_VISIBLE_DEVICES narrows it).
pub fn nproc_gpus() -> u32 {
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
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) if dev > 0 => {
            (v.split(',').filter(|s| !s.trim().is_empty() && s.trim() != "-1").count() as u32).min(dev)
        }
        _ => dev,
    }
}

pub async fn main(a: Args, signals: Signals) -> Result<ExitCode> {
    let p = prepare(&a.job, &a.cmd)?;
    let mut sig = signals.clone();
    let mut mesh = tokio::select! {
        m = Mesh::start(p.mesh) => m?,
        s = sig.recv() => {
            tracing::error!("{} while joining the mesh", s.describe());
            return Ok(ExitCode::from(s.exit_code()));
        }
    };
    let outcome = job::run(&mut mesh, &p.job, &p.run_id, &signals).await;
    mesh.shutdown().await;
    let outcome = outcome?;
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
    }
}
