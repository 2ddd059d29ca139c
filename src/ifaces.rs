//! `meshd ifaces`: interfaces like ifconfig, and with --peers the proof of which one to use.

use crate::common::{self, NetArgs};
use anyhow::Result;
use meshd::interfaces::{self, PeerReach};
use meshd::transport::{Transport, TransportConfig, TransportError};
use serde_json::json;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Peers to check (host[:port],..., @FILE, dns:NAME); probes meshd where it runs.
    #[arg(long)]
    peers: Option<String>,
    /// Force an interface instead of choosing by probing.
    #[arg(long)]
    iface: Option<String>,
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
    let ifs = interfaces::list()?;
    let peers = common::peers_now(a.peers.as_deref(), a.net.port, env.slurm.nodelist.as_deref())?;
    let mut reach = interfaces::routes(&ifs, &peers, a.net.port);
    if reach.iter().any(|r| !r.is_self) {
        probe_all(&mut reach, &a.net, env).await?;
    }
    // Only this node listed (every node pointed at this head node): the listed address
    // says which interface the others will use, as `meshd run` announces it.
    let seed = (a.iface.is_none() && !reach.is_empty() && reach.iter().all(|r| r.is_self))
        .then(|| meshd::mesh::seed::alone(&ifs, &reach, false, 2).ok())
        .flatten();
    let proven = seed.is_some() || interfaces::proven(&reach, a.iface.as_deref());
    let choice = match seed {
        Some(c) => Ok(c),
        None => interfaces::choose(&ifs, &reach, a.iface.as_deref()),
    };
    // Without peers (and without --iface) nothing is proven: list the candidates instead.
    let unproven = (a.iface.is_none() && !proven).then(|| interfaces::unproven_text(&ifs));
    if a.json {
        let out = json!({
            "chosen": choice.as_ref().ok().map(|c| json!({"name": c.name, "addr": c.addr})),
            "proven": proven,
            "candidates": interfaces::candidates(&ifs).iter().map(|(n, a, k)| json!({
                "name": n, "addr": a, "kind": k.as_str(),
            })).collect::<Vec<_>>(),
            "reason": match (&unproven, &choice) {
                (Some(t), _) => t.clone(),
                (None, Ok(c)) => c.reason.clone(),
                (None, Err(e)) => e.to_string(),
            },
            "interfaces": ifs.iter().map(|i| json!({
                "name": i.name,
                "addrs": i.addrs.iter().map(|a| format!("{}/{}", a.ip, a.prefix)).collect::<Vec<_>>(),
                "mtu": i.mtu, "up": i.up, "kind": i.kind.as_str(),
            })).collect::<Vec<_>>(),
            "peers": reach.iter().map(|r| json!({
                "peer": r.peer, "addr": r.addr.to_string(), "self": r.is_self,
                "iface": r.route.as_ref().map(|x| x.0.clone()),
                "src": r.route.as_ref().map(|x| x.1.to_string()),
                "answered": r.answered, "observed": r.observed.map(|o| o.to_string()),
            })).collect::<Vec<_>>(),
        });
        println!("{out}");
    } else {
        for i in &ifs {
            let addrs: Vec<String> = i.addrs.iter().map(|a| format!("{}/{}", a.ip, a.prefix)).collect();
            println!(
                "{:<12} {:<5} mtu {:<6} {:<17} {}",
                i.name,
                if i.up { "up" } else { "down" },
                i.mtu.map(|m| m.to_string()).unwrap_or_else(|| "?".into()),
                i.kind.as_str(),
                addrs.join(" ")
            );
        }
        if !reach.is_empty() {
            println!();
            println!("{:<24} {:<10} {:<28} meshd", "peer", "via", "source address");
            for r in &reach {
                let (via, src) = match &r.route {
                    _ if r.is_self => ("(self)".to_string(), String::new()),
                    Some((n, s)) => (n.clone(), s.to_string()),
                    None => ("no route".to_string(), String::new()),
                };
                let ans = match (r.answered, r.observed) {
                    (Some(true), Some(o)) => format!("answered, saw us as {o}"),
                    (Some(true), None) => "answered".into(),
                    (Some(false), _) => "no answer".into(),
                    (None, _) => String::new(),
                };
                println!("{:<24} {:<10} {:<28} {}", r.addr.to_string(), via, src, ans);
            }
        }
        println!();
        match (&unproven, &choice) {
            (Some(t), _) => println!("{t}"),
            (None, Ok(c)) => println!("chosen: {} {} ({})", c.name, c.addr, c.reason),
            (None, Err(e)) => println!("no interface chosen: {e}"),
        }
    }
    Ok(if choice.is_ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Probes meshd at every listed peer in parallel from an ephemeral port.
async fn probe_all(reach: &mut [PeerReach], net: &NetArgs, env: &crate::env::EnvConfig) -> Result<()> {
    let mut cfg = TransportConfig::new(meshd::random_node_id(), 0);
    cfg.gso = env.gso;
    cfg.plane = env.plane.unwrap_or(true);
    cfg.cc = env.cc;
    cfg.token = net.token()?;
    cfg.connect_timeout = std::time::Duration::from_secs(2);
    let (t, _events) = Transport::bind(cfg)?;
    let mut tasks = Vec::new();
    for r in reach.iter() {
        let t = t.clone();
        let addr = r.addr;
        tasks.push(tokio::spawn(
            async move { if addr.port() == 0 { None } else { Some(t.probe(addr).await) } },
        ));
    }
    for (r, task) in reach.iter_mut().zip(tasks) {
        if r.is_self {
            continue;
        }
        match task.await.ok().flatten() {
            Some(Ok(info)) => {
                r.answered = Some(true);
                r.observed = info.observed.map(|o| o.ip());
            }
            // meshd is there but refused us (token): it answered all the same.
            Some(Err(TransportError::Auth { .. })) => r.answered = Some(true),
            _ => r.answered = Some(false),
        }
    }
    t.shutdown().await;
    Ok(())
}
