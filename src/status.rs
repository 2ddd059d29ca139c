//! `meshd status`: the members of a running mesh, as one of its nodes sees them.

use crate::common::{self, NetArgs};
use anyhow::{Result, bail};
use meshd::proto::wire::{MemberRole, StatusMember};
use meshd::transport::{Transport, TransportConfig};
use serde_json::json;
use std::net::SocketAddr;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Nodes to ask (the first that answers is used); default: the meshd on this host.
    #[arg(long)]
    peers: Option<String>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    net: NetArgs,
}

impl Args {
    /// Its network flags.
    pub fn net_mut(&mut self) -> &mut NetArgs {
        &mut self.net
    }
}

pub async fn main(a: Args, env: &crate::env::EnvConfig) -> Result<ExitCode> {
    let mut targets: Vec<(String, SocketAddr)> =
        common::peers_now(a.peers.as_deref(), a.net.port, env.slurm.nodelist.as_deref())?;
    if targets.is_empty() {
        targets.push(("this host".into(), SocketAddr::from(([127, 0, 0, 1], a.net.port))));
    }
    let mut cfg = TransportConfig::new(meshd::random_node_id(), 0);
    cfg.token = a.net.token()?;
    cfg.gso = env.gso;
    cfg.plane = env.plane.unwrap_or(true);
    cfg.cc = env.cc;
    let (t, _events) = Transport::bind(cfg)?;
    let mut errors = Vec::new();
    let mut reply = None;
    for (label, addr) in &targets {
        match t.query_status(*addr).await {
            Ok(r) => {
                reply = Some((addr, r));
                break;
            }
            Err(e) => errors.push(format!("{label}: {e}")),
        }
    }
    // Tunnel counters, when the node runs in tunnel mode (an older meshd does not answer).
    let tunnel = match &reply {
        Some((addr, _)) => t.query_tunnel(**addr).await.ok().flatten(),
        None => None,
    };
    t.shutdown().await;
    let Some((from, mut r)) = reply else {
        bail!("no running meshd answered: {}", errors.join("; "));
    };
    in_rank_order(&mut r.members);
    if a.json {
        let members: Vec<_> = r
            .members
            .iter()
            .map(|m| {
                json!({
                    "id": m.id.to_string(), "host": m.hostname, "addr": m.addr.ip().to_string(), "port": m.addr.port(),
                    "iface": m.iface, "gpus": m.gpus, "nproc": m.nproc,
                    "state": m.state, "health": m.health,
                    "rtt_ms": m.rtt_us.map(|u| u as f64 / 1000.0), "role": m.role, "restarts": m.restarts,
                })
            })
            .collect();
        let tunnel = tunnel.map(|u| {
            json!({
                "opened": u.opened, "failed": u.failed, "served": u.served, "active": u.active,
                "bytes_out": u.bytes_out, "bytes_in": u.bytes_in,
            })
        });
        println!("{}", json!({ "from": from.to_string(), "members": members, "tunnel": tunnel }));
    } else {
        println!("members of the mesh as seen by {from}, in node-rank order:");
        print!("{}", table(&r.members, a.net.port));
        if let Some(u) = tunnel {
            println!(
                "tunnel (on {from}): {} opened by its ranks ({} failed), {} served for other nodes, {} open; {:.1} MiB sent, {:.1} MiB received",
                meshd::plural(u.opened, "connection"),
                u.failed,
                u.served,
                u.active,
                u.bytes_out as f64 / (1 << 20) as f64,
                u.bytes_in as f64 / (1 << 20) as f64
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Node-rank order: the master first, then the other roster members by address (as node
/// ranks are assigned), then members that are waiting for a roster, by address.
pub fn in_rank_order(members: &mut [StatusMember]) {
    let role = |m: &StatusMember| match m.role {
        MemberRole::Master => 0,
        MemberRole::Worker => 1,
        MemberRole::Waiting => 2,
    };
    members.sort_by_key(|m| (role(m), m.addr.ip(), m.addr.port()));
}

/// The human table: address (with the port only when it is not meshd's `port`), host name,
/// and the flags' words (`nproc`).
pub fn table(members: &[StatusMember], port: u16) -> String {
    let mut out = format!(
        "{:<22} {:<16} {:<8} {:<5} {:<6} {:<8} {:<8} {:<9} {:<8} restarts\n",
        "address", "host", "iface", "gpus", "nproc", "state", "health", "rtt", "role"
    );
    for m in members {
        let addr = if m.addr.port() == port { m.addr.ip().to_string() } else { m.addr.to_string() };
        out.push_str(&format!(
            "{:<22} {:<16} {:<8} {:<5} {:<6} {:<8} {:<8} {:<9} {:<8} {}\n",
            addr,
            if m.hostname.is_empty() { "-" } else { &m.hostname },
            m.iface,
            m.gpus,
            m.nproc,
            m.state,
            m.health,
            m.rtt_us.map(|u| format!("{:.2} ms", u as f64 / 1000.0)).unwrap_or_else(|| "-".into()),
            m.role,
            m.restarts
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshd::proto::membership::MemberStatus;
    use meshd::proto::{NodeId, NodeState};

    fn member(id: u128, addr: &str, role: MemberRole, host: &str) -> StatusMember {
        StatusMember {
            id: NodeId::from_u128(id),
            hostname: host.into(),
            addr: addr.parse().expect("addr"),
            iface: "eth1".into(),
            gpus: 8,
            nproc: 2,
            state: if role == MemberRole::Waiting { NodeState::Waiting } else { NodeState::Running },
            health: MemberStatus::Alive,
            rtt_us: Some(210),
            role,
            restarts: 0,
        }
    }

    #[test]
    fn rows_in_node_rank_order_with_hosts_and_the_flags_words() {
        let mut m = vec![
            member(1, "198.19.0.30:29400", MemberRole::Worker, "gpu3"),
            member(2, "198.19.0.50:29400", MemberRole::Waiting, "gpu9"),
            member(3, "198.19.0.19:29400", MemberRole::Worker, "gpu2"),
            member(4, "198.19.0.7:29400", MemberRole::Master, "gpu1"),
            member(5, "198.19.0.9:29400", MemberRole::Waiting, ""),
        ];
        in_rank_order(&mut m);
        let order: Vec<String> = m.iter().map(|m| m.addr.ip().to_string()).collect();
        assert_eq!(order, ["198.19.0.7", "198.19.0.19", "198.19.0.30", "198.19.0.9", "198.19.0.50"]);
        let t = table(&m, 29400);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains(" nproc ") && !lines[0].contains("procs"), "{}", lines[0]);
        assert!(lines[0].contains(" host ") && !lines[0].contains(" node "), "{}", lines[0]);
        assert!(lines[1].starts_with("198.19.0.7 ") && lines[1].contains(" gpu1 "), "{}", lines[1]);
        // The words `meshd status` always showed, aligned under their headers.
        let col = |line: &str, word: &str| line.find(&format!(" {word} ")).map(|i| i + 1);
        assert_eq!(col(lines[1], "running"), col(lines[0], "state"), "{t}");
        assert_eq!(col(lines[1], "alive"), col(lines[0], "health"), "{t}");
        assert_eq!(col(lines[1], "master"), col(lines[0], "role"), "{t}");
        assert_eq!(col(lines[4], "waiting"), col(lines[0], "state"), "{t}");
        assert!(!t.contains(&NodeId::from_u128(4).to_string()), "no internal ids: {t}");
        assert!(lines[4].contains(" - "), "no host name: {}", lines[4]);
        // `--json` keeps the words too.
        let j = json!({ "state": m[0].state, "health": m[0].health, "role": m[0].role });
        assert_eq!(j.to_string(), r#"{"health":"alive","role":"master","state":"running"}"#);
        // Another port than meshd's is shown.
        assert!(table(&m, 29500).contains("198.19.0.7:29400"));
    }
}
