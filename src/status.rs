//! `meshd status`: the members of a running mesh, as one of its nodes sees them.

use crate::common::{self, NetArgs};
use anyhow::{Result, bail};
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

pub async fn main(a: Args) -> Result<ExitCode> {
    let mut targets: Vec<(String, SocketAddr)> = common::peers_now(a.peers.as_deref(), a.net.port)?;
    if targets.is_empty() {
        targets.push(("this host".into(), SocketAddr::from(([127, 0, 0, 1], a.net.port))));
    }
    let mut cfg = TransportConfig::new(meshd::random_node_id(), 0);
    cfg.token = a.net.token()?;
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
    t.shutdown().await;
    let Some((from, r)) = reply else {
        bail!("no running meshd answered: {}", errors.join("; "));
    };
    if a.json {
        let members: Vec<_> = r
            .members
            .iter()
            .map(|m| {
                json!({
                    "id": m.id.to_string(), "host": m.hostname, "addr": m.addr.ip().to_string(), "port": m.addr.port(),
                    "iface": m.iface, "gpus": m.gpus, "nproc": m.nproc,
                    "state": format!("{:?}", m.state).to_lowercase(), "health": m.health,
                    "rtt_ms": m.rtt_us.map(|u| u as f64 / 1000.0), "role": m.role, "restarts": m.restarts,
                })
            })
            .collect();
        println!("{}", json!({ "from": from.to_string(), "members": members }));
    } else {
        println!("members of the mesh as seen by {from}:");
        println!(
            "{:<22} {:<8} {:<12} {:<5} {:<6} {:<8} {:<8} {:<9} {:<8} restarts",
            "address", "iface", "node", "gpus", "procs", "state", "health", "rtt", "role"
        );
        for m in &r.members {
            println!(
                "{:<22} {:<8} {:<12} {:<5} {:<6} {:<8} {:<8} {:<9} {:<8} {}",
                m.addr.to_string(),
                m.iface,
                m.id.to_string(),
                m.gpus,
                m.nproc,
                format!("{:?}", m.state).to_lowercase(),
                m.health,
                m.rtt_us.map(|u| format!("{:.2} ms", u as f64 / 1000.0)).unwrap_or_else(|| "-".into()),
                m.role,
                m.restarts
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
