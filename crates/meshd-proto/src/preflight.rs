//! The preflight: what every node found out before launch, and the verdict.
//!
//! After the roster is agreed, every node opens a TCP listener on an ephemeral port of its
//! chosen interface (what NCCL and Gloo will need), tells the others its port, connects to
//! every other node's listener and to MASTER_ADDR:MASTER_PORT, and broadcasts a
//! [`NodeReport`]. [`evaluate`] turns all reports into the same [`Verdict`] on every node:
//! a launch goes ahead only if the command, process counts, GPU counts and versions agree;
//! blocked TCP does not stop it but selects tunnel mode (`MESHD_COLLECTIVE=tunnel`: the
//! ranks' TCP connections to other nodes travel through meshd's UDP port) and names the
//! pair that failed.

use crate::id::NodeId;
use crate::roster::Roster;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How the ranks of a job talk to other nodes: the value of `MESHD_COLLECTIVE`.
///
/// Displayed (and serialized by name, as in `meshd doctor --json`) in lowercase: `nccl`,
/// `quic`, `tunnel`. On the wire (postcard) it is the variant's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Collective {
    /// TCP works between the nodes: NCCL and Gloo as usual.
    Nccl,
    /// meshd's own ring over its UDP port (the Python client and DDP hook).
    Quic,
    /// The ranks' TCP connections to other nodes travel through meshd's UDP port.
    Tunnel,
}

impl Collective {
    /// The word ranks get in `MESHD_COLLECTIVE` and `--collective` takes.
    pub fn name(self) -> &'static str {
        match self {
            Collective::Nccl => "nccl",
            Collective::Quic => "quic",
            Collective::Tunnel => "tunnel",
        }
    }

    /// Whether meshd's QUIC ring serves the ranks (it does in tunnel mode too: the local
    /// service stays up).
    pub fn uses_quic_ring(self) -> bool {
        matches!(self, Collective::Quic | Collective::Tunnel)
    }
}

impl std::fmt::Display for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

/// What a [`TcpProbe`] dialled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum TcpTarget {
    /// The ephemeral-port listener every node opens (what NCCL and Gloo sockets need).
    EphemeralPort,
    /// MASTER_PORT on the master (the TCPStore's).
    MasterPort,
    /// The root address inside the master's NCCL unique id.
    NcclRoot,
}

impl std::fmt::Display for TcpTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            TcpTarget::EphemeralPort => "ephemeral port",
            TcpTarget::MasterPort => "MASTER_PORT",
            TcpTarget::NcclRoot => "NCCL id root",
        })
    }
}

/// One TCP attempt from the reporting node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpProbe {
    /// Target node.
    pub to: NodeId,
    /// What was dialled ("198.19.0.7:41234").
    pub target: String,
    /// Connected.
    pub ok: bool,
    /// Error text when not.
    pub detail: String,
    /// What kind of port.
    pub what: TcpTarget,
}

/// What one node reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NodeReport {
    /// TCP attempts made.
    pub tcp: Vec<TcpProbe>,
    /// Hash of the command line.
    pub cmd_hash: u64,
    /// The command line (shortened) for messages.
    pub cmd: String,
    /// Processes per node.
    pub nproc: u32,
    /// GPUs found through the CUDA driver.
    pub gpus: u32,
    /// CUDA driver version (0: none).
    pub cuda_driver: u32,
    /// NCCL version code (0: not loadable).
    pub nccl_version: u32,
    /// MTU of the chosen interface.
    pub mtu: u32,
    /// Chosen interface.
    pub iface: String,
    /// Root address of the NCCL unique id, as decoded by the master ("" without an id).
    pub nccl_root: String,
    /// Why there is no NCCL id, when there is none ("" otherwise).
    pub nccl_note: String,
}

impl NodeReport {
    /// The NCCL id's root address, when the master has an id (on the wire "" is none).
    pub fn nccl_root_addr(&self) -> Option<&str> {
        Some(self.nccl_root.as_str()).filter(|r| !r.is_empty())
    }

    /// Why the master has no NCCL id, when it said.
    pub fn nccl_missing(&self) -> Option<&str> {
        Some(self.nccl_note.as_str()).filter(|n| !n.is_empty())
    }
}

/// What a check of the report looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum CheckKind {
    /// Every roster node answered on meshd's port.
    Mesh,
    /// TCP between the nodes and to MASTER_PORT (what NCCL and Gloo need).
    Tcp,
    /// The command line agrees.
    Command,
    /// Processes per node agree.
    Processes,
    /// GPU counts agree.
    Gpus,
    /// CUDA driver versions agree.
    CudaDriver,
    /// NCCL versions agree.
    NcclVersion,
    /// The NCCL id's root is on the chosen interface.
    NcclId,
    /// MTUs agree (a warning).
    Mtu,
    /// Whether the tunnel may be used (it needs a token).
    Tunnel,
}

impl CheckKind {
    /// The check's name in reports and JSON.
    pub fn name(self) -> &'static str {
        match self {
            CheckKind::Mesh => "mesh",
            CheckKind::Tcp => "tcp",
            CheckKind::Command => "command",
            CheckKind::Processes => "processes per node",
            CheckKind::Gpus => "gpus",
            CheckKind::CudaDriver => "cuda driver",
            CheckKind::NcclVersion => "nccl version",
            CheckKind::NcclId => "nccl id",
            CheckKind::Mtu => "mtu",
            CheckKind::Tunnel => "tunnel",
        }
    }
}

impl std::fmt::Display for CheckKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// What it looks at.
    pub kind: CheckKind,
    /// Passed.
    pub ok: bool,
    /// What was found, in words (and what to do when it failed).
    pub detail: String,
    /// A failure that forbids the launch (a mismatch), as opposed to one that only selects
    /// the QUIC collective or is a warning.
    pub fatal: bool,
}

/// The verdict every node computes from the same reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Launch may go ahead.
    pub ok: bool,
    /// Nccl when every TCP path works, else Tunnel; or what `--collective` forced.
    pub collective: Collective,
    /// Every check.
    pub checks: Vec<Check>,
    /// Pairs of nodes between which a TCP connection failed, each once, in report order
    /// ("198.19.0.30 -> 198.19.0.19", or "198.19.0.30 <-> 198.19.0.19" when both ways
    /// failed): Gloo and NCCL sockets will not work there.
    pub tcp_blocked: Vec<String>,
    /// The master created an NCCL unique id (libnccl loaded there): ranks get
    /// MESHD_NCCL_UNIQUE_ID.
    pub nccl_id: bool,
    /// Nodes in the roster.
    pub nodes: usize,
}

impl Verdict {
    /// The one warning every node prints at launch when TCP between nodes is blocked:
    /// which pairs, what will hang, and the two ways out. `None` when TCP works.
    pub fn tcp_warning(&self, iface: &str) -> Option<String> {
        if self.tcp_blocked.is_empty() {
            return None;
        }
        if self.collective == Collective::Tunnel {
            return Some(format!(
                "TCP between nodes is blocked ({}): the ranks' TCP connections to other nodes \
                 (init_process_group(\"gloo\") or (\"nccl\"), the TCPStore, user sockets) go through \
                 meshd's UDP port instead (MESHD_COLLECTIVE=tunnel); programs that bypass the C \
                 library's connect() (static binaries, io_uring) cannot reach other nodes. For the \
                 direct path, open TCP 1024-65535 between the nodes on {iface}",
                self.tcp_blocked.join(", ")
            ));
        }
        Some(format!(
            "TCP between nodes is blocked ({}): a job that calls init_process_group(\"gloo\") or \
             (\"nccl\") will hang. Either use meshd's Python client or its DDP hook \
             meshd.torch.allreduce_hook (they need only meshd's UDP port; MESHD_COLLECTIVE={}), or \
             open TCP 1024-65535 between the nodes on {iface}",
            self.tcp_blocked.join(", "),
            self.collective
        ))
    }

    /// `doctor`'s last line: what will and will not work.
    pub fn conclusion(&self) -> String {
        if !self.ok {
            return "a job would NOT start: fix the FAIL lines above".into();
        }
        if !self.tcp_blocked.is_empty() && self.collective == Collective::Tunnel {
            return format!(
                "a job would start: the ranks' TCP connections to other nodes (Gloo, NCCL's sockets, the \
                 TCPStore, user code) go through meshd's UDP port (tunnel mode), and meshd's client and DDP \
                 hook work; TCP between nodes is blocked ({})",
                self.tcp_blocked.join(", ")
            );
        }
        if !self.tcp_blocked.is_empty() {
            return format!(
                "a job would start: meshd's client and DDP hook will work; jobs that use Gloo/NCCL sockets \
                 directly will not: TCP between nodes is blocked ({})",
                self.tcp_blocked.join(", ")
            );
        }
        "a job would work: TCP is open between the nodes (Gloo, NCCL) and so is meshd's UDP port \
         (meshd's client and DDP hook)"
            .into()
    }

    /// The collective as ranks will really get it, for the launch line and `doctor`.
    pub fn collective_line(&self) -> String {
        let tcp = if self.nodes == 1 { "one node" } else { "TCP open between the nodes" };
        match self.collective {
            Collective::Nccl if self.nccl_id => {
                format!("nccl ({tcp}; MESHD_NCCL_UNIQUE_ID from the master's libnccl)")
            }
            Collective::Nccl => format!(
                "nccl ({tcp}; no MESHD_NCCL_UNIQUE_ID: no GPU or no libnccl on the master; PyTorch's own \
                 NCCL or Gloo work as usual)"
            ),
            Collective::Quic if self.tcp_blocked.is_empty() => "quic (forced by --collective)".into(),
            Collective::Quic => "quic (TCP between nodes is blocked: only meshd's UDP port works)".into(),
            Collective::Tunnel if self.tcp_blocked.is_empty() => {
                "tunnel (forced by --collective: the ranks' TCP connections to other nodes go through meshd)"
                    .into()
            }
            Collective::Tunnel => {
                "tunnel (TCP between nodes is blocked: the ranks' TCP connections to other \
                                   nodes go through meshd's UDP port)"
                    .into()
            }
        }
    }
}

fn label(roster: &Roster, id: NodeId) -> String {
    roster
        .members
        .iter()
        .find(|m| m.id == id)
        .map(|m| m.addr.ip().to_string())
        .unwrap_or_else(|| id.to_string())
}

/// Checks that a per-node value agrees everywhere; lists who differs.
fn agree<T: PartialEq + std::fmt::Display>(
    roster: &Roster,
    reports: &BTreeMap<NodeId, NodeReport>,
    kind: CheckKind,
    fatal: bool,
    get: impl Fn(&NodeReport) -> T,
) -> Check {
    let mut groups: Vec<(T, Vec<String>)> = Vec::new();
    for m in &roster.members {
        let Some(r) = reports.get(&m.id) else { continue };
        let v = get(r);
        match groups.iter_mut().find(|(g, _)| *g == v) {
            Some((_, who)) => who.push(label(roster, m.id)),
            None => groups.push((v, vec![label(roster, m.id)])),
        }
    }
    if groups.len() <= 1 {
        let v = groups.first().map(|(v, _)| v.to_string()).unwrap_or_default();
        return Check { kind, ok: true, detail: format!("same on every node: {v}"), fatal };
    }
    let detail =
        groups.iter().map(|(v, who)| format!("{} on {}", v, who.join(", "))).collect::<Vec<_>>().join("; ");
    Check { kind, ok: false, detail: format!("differs: {detail}"), fatal }
}

/// Failed (from, to) connections as pairs of addresses, in node-rank order, each pair once:
/// "A <-> B" when both ways failed, else "A -> B" or "B -> A".
fn blocked_pairs(roster: &Roster, blocked: &std::collections::BTreeSet<(NodeId, NodeId)>) -> Vec<String> {
    let rank = |id: NodeId| roster.node_rank(id).unwrap_or(usize::MAX);
    let mut pairs: Vec<(usize, usize, NodeId, NodeId)> = blocked
        .iter()
        .map(|&(f, t)| if rank(f) <= rank(t) { (rank(f), rank(t), f, t) } else { (rank(t), rank(f), t, f) })
        .collect();
    pairs.sort();
    pairs.dedup();
    pairs
        .into_iter()
        .map(|(_, _, a, b)| {
            let (there, back) = (blocked.contains(&(a, b)), blocked.contains(&(b, a)));
            let (la, lb) = (label(roster, a), label(roster, b));
            match (there, back) {
                (true, true) if a != b => format!("{la} <-> {lb}"),
                (true, _) => format!("{la} -> {lb}"),
                _ => format!("{lb} -> {la}"),
            }
        })
        .collect()
}

/// Turns every node's report into the verdict. `forced` is `--collective nccl|quic|tunnel`;
/// `tunnel` says whether the tunnel may be used (the mesh has a token): without it, blocked
/// TCP gives `quic`, and a forced tunnel is refused.
pub fn evaluate(
    roster: &Roster,
    reports: &BTreeMap<NodeId, NodeReport>,
    forced: Option<Collective>,
    tunnel: bool,
) -> Verdict {
    let mut checks = Vec::new();
    let missing: Vec<String> =
        roster.members.iter().filter(|m| !reports.contains_key(&m.id)).map(|m| label(roster, m.id)).collect();
    checks.push(Check {
        kind: CheckKind::Mesh,
        ok: missing.is_empty(),
        detail: if missing.is_empty() {
            match roster.members.len() {
                1 => "the one node answered on meshd's UDP port".to_string(),
                n => format!("all {n} nodes answered on meshd's UDP port"),
            }
        } else {
            format!("no preflight report from {}", missing.join(", "))
        },
        fatal: true,
    });
    let mut failed = Vec::new();
    let mut blocked: std::collections::BTreeSet<(NodeId, NodeId)> = Default::default();
    let mut tried = 0;
    for (from, r) in reports {
        for p in &r.tcp {
            tried += 1;
            if !p.ok {
                blocked.insert((*from, p.to));
                failed.push(format!(
                    "{} -> {} ({}, {}): {}",
                    label(roster, *from),
                    p.target,
                    label(roster, p.to),
                    p.what,
                    p.detail
                ));
            }
        }
    }
    let tcp_ok = failed.is_empty();
    let tcp_blocked = blocked_pairs(roster, &blocked);
    checks.push(Check {
        kind: CheckKind::Tcp,
        ok: tcp_ok,
        detail: if tcp_ok && tried == 0 {
            "no other node: no TCP between nodes to check".to_string()
        } else if tcp_ok {
            format!(
                "{} between nodes (ephemeral ports, MASTER_PORT) all succeeded",
                crate::plural(tried as u64, "TCP connection")
            )
        } else {
            format!(
                "{} of {} failed: {}. NCCL and Gloo need TCP on ephemeral ports between \
                 every pair of nodes: open TCP 1024-65535 between the nodes; without that, meshd carries \
                 the ranks' TCP connections through its UDP port (tunnel mode)",
                failed.len(),
                crate::plural(tried as u64, "TCP connection"),
                failed.join("; ")
            )
        },
        fatal: false,
    });
    checks.push(agree(roster, reports, CheckKind::Command, true, |r| format!("`{}`", r.cmd)));
    checks.push(agree(roster, reports, CheckKind::Processes, true, |r| r.nproc));
    checks.push(agree(roster, reports, CheckKind::Gpus, true, |r| r.gpus));
    checks.push(agree(roster, reports, CheckKind::CudaDriver, true, |r| r.cuda_driver));
    checks.push(agree(roster, reports, CheckKind::NcclVersion, true, |r| r.nccl_version));
    if let Some(master) = roster.master() {
        if let Some(r) = reports.get(&master.id) {
            let ip = master.addr.ip().to_string();
            // No libnccl is not a failure: everything but MESHD_NCCL_UNIQUE_ID works, and
            // meshd said so once at start. The check passes and says what is missing.
            let (ok, detail) = match r.nccl_root_addr() {
                None => {
                    (true, format!("no NCCL unique id: {}", r.nccl_missing().unwrap_or("libnccl not loaded")))
                }
                Some(root) => {
                    let root_ip =
                        root.rsplit_once(':').map(|(h, _)| h.trim_matches(['[', ']'])).unwrap_or("");
                    if root_ip == ip {
                        (
                            true,
                            format!(
                                "root {root} is on the master's chosen interface (probed from every node in the tcp check)"
                            ),
                        )
                    } else {
                        (
                            false,
                            format!("root {root} is not the master's address {ip} on the chosen interface"),
                        )
                    }
                }
            };
            checks.push(Check { kind: CheckKind::NcclId, ok, detail, fatal: false });
        }
    }
    let mut mtu = agree(roster, reports, CheckKind::Mtu, false, |r| r.mtu);
    if !mtu.ok {
        mtu.detail.push_str(" (warning: mismatched MTUs can stall large transfers)");
    }
    checks.push(mtu);
    let multi = roster.members.len() > 1;
    let collective = match forced {
        Some(c) => c,
        None if tcp_ok => Collective::Nccl,
        None if tunnel => Collective::Tunnel,
        None => {
            checks.push(Check {
                kind: CheckKind::Tunnel,
                ok: false,
                detail:
                    "TCP between nodes is blocked and the mesh has no token: the tunnel, which would carry \
                         the ranks' TCP through meshd's UDP port, is off (without a token anyone who reaches \
                         that port could reach the ranks' ports); pass --token-file on every node for it"
                        .into(),
                fatal: false,
            });
            Collective::Quic
        }
    };
    if forced == Some(Collective::Tunnel) && !tunnel && multi {
        checks.push(Check {
            kind: CheckKind::Tunnel,
            ok: false,
            detail: "--collective tunnel needs a token (--token-file on every node): without one anyone who \
                     reaches meshd's UDP port could reach the ranks' ports"
                .into(),
            fatal: true,
        });
    }
    let nccl_impossible = forced == Some(Collective::Nccl) && !tcp_ok;
    let ok = !nccl_impossible && checks.iter().all(|c| c.ok || !c.fatal);
    let nccl_id =
        roster.master().and_then(|m| reports.get(&m.id)).is_some_and(|r| r.nccl_root_addr().is_some());
    Verdict { ok, collective, checks, tcp_blocked, nccl_id, nodes: roster.members.len() }
}

#[cfg(test)]
mod tests;
