//! The environment of a rank: torchrun's variables, meshd's, and (under SLURM) the task
//! variables rewritten to describe meshd's ranks. Pure: the same roster gives the same
//! environment.

use super::*;

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
pub(super) fn set_env(env: &mut Vec<(String, String)>, k: &str, v: String) {
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

/// What a rank's environment needs under `--fault-tolerance node`.
#[derive(Clone, Debug)]
pub struct FtEnv {
    /// This node's replica group (its slot in the roster: stable for the node's life).
    pub group: usize,
    /// NUM_REPLICA_GROUPS: the most groups the job can have (`--nnodes` MAX).
    pub groups: u32,
    /// The node's TCPStore (meshd's, torchrun's agent store): MASTER_ADDR:MASTER_PORT.
    pub store: SocketAddr,
    /// TORCHFT_LIGHTHOUSE: the Lighthouse served by this node's meshd.
    pub lighthouse: Option<SocketAddr>,
    /// Restarts of this node's ranks so far (TORCHELASTIC_RESTART_COUNT).
    pub restarts: u32,
    /// MESHD_HOSTNAME: what the ranks' `gethostname` answers (meshd's preload library):
    /// torchft advertises `http://{gethostname()}:port` for its manager and checkpoint
    /// server, which must reach this node from the others ([`url_host`]).
    pub hostname: String,
}

/// `ip` as a URL's host: IPv6 in brackets (`http://{host}:{port}` must parse).
pub fn url_host(ip: std::net::IpAddr) -> String {
    match ip.to_canonical() {
        std::net::IpAddr::V4(v4) => v4.to_string(),
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// `--fault-tolerance node`: the rank's world is its own node (torchft's replica group, as a
/// per-group torchrun would give it), with the store hosted by meshd
/// (TORCHELASTIC_USE_AGENT_STORE=True, as torchrun's agent), plus torchft's variables.
/// Applied over [`rank_env`]'s result.
pub fn ft_rank_env(env: &mut Vec<(String, String)>, local_rank: u32, nproc: u32, ft: &FtEnv) {
    let local = local_rank.to_string();
    let world = nproc.to_string();
    let mut set = |k: &str, v: String| set_env(env, k, v);
    set("RANK", local.clone());
    set("WORLD_SIZE", world.clone());
    set("LOCAL_WORLD_SIZE", world.clone());
    set("GROUP_RANK", "0".into());
    set("NODE_RANK", "0".into());
    set("GROUP_WORLD_SIZE", "1".into());
    set("ROLE_RANK", local);
    set("ROLE_WORLD_SIZE", world);
    set("MASTER_ADDR", ft.store.ip().to_string());
    set("MASTER_PORT", ft.store.port().to_string());
    set("TORCHELASTIC_USE_AGENT_STORE", "True".into());
    set("TORCHELASTIC_RESTART_COUNT", ft.restarts.to_string());
    set("REPLICA_GROUP_ID", ft.group.to_string());
    set("NUM_REPLICA_GROUPS", ft.groups.to_string());
    if let Some(l) = ft.lighthouse {
        set("TORCHFT_LIGHTHOUSE", format!("http://{l}"));
    }
    set("MESHD_HOSTNAME", ft.hostname.clone());
    env.retain(|(k, _)| k != "MESHD_NCCL_UNIQUE_ID");
}
