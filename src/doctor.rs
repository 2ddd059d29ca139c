//! `meshd doctor`: same flags as `run`, no command. Forms the mesh on every node, runs the
//! preflight, prints one report, and exits 0 when a job would work.

use crate::run::{self, JobArgs};
use anyhow::Result;
use meshd::{Node, NodeConfig};
use serde_json::json;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub job: JobArgs,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub async fn main(a: Args, env: &crate::env::EnvConfig) -> Result<ExitCode> {
    let p = run::prepare(&a.job, &[], env)?;
    let mut cfg = NodeConfig::new(p.mesh);
    cfg.rdzv = p.job.rdzv.clone();
    cfg.rdzv_timeout = p.job.rdzv_timeout;
    cfg.preflight = p.job.preflight.clone();
    cfg.make_nccl_id = true;
    let mut node = Node::spawn(cfg).await?;
    let iface = node.choice().clone();
    let result = node.verdict().await;
    // Every node says Done and waits for the others (the preflight's work is all there is).
    let end = node.finish().await;
    let (roster, verdict) = result?;
    end?;
    let master = roster.master().map(|m| m.addr.ip().to_string()).unwrap_or_default();
    if a.json {
        let checks: Vec<_> = verdict
            .checks
            .iter()
            .map(|c| json!({"name": c.kind.name(), "ok": c.ok, "detail": c.detail, "fatal": c.fatal}))
            .collect();
        println!(
            "{}",
            json!({
                "ok": verdict.ok, "iface": iface.name, "addr": iface.addr.to_string(), "master": master,
                "nodes": roster.members.iter().map(|m| m.addr.ip().to_string()).collect::<Vec<_>>(),
                "collective": verdict.collective, "checks": checks,
                "tcp_blocked": verdict.tcp_blocked, "verdict": verdict.conclusion(),
            })
        );
    } else {
        println!(
            "meshd doctor: {}, master {master}, this node {} on {} ({})",
            meshd::plural(roster.members.len() as u64, "node"),
            iface.addr,
            iface.name,
            iface.reason
        );
        for c in &verdict.checks {
            let mark = if c.ok {
                "ok  "
            } else if c.fatal {
                "FAIL"
            } else {
                "warn"
            };
            println!("  [{mark}] {:<20} {}", c.kind.name(), c.detail);
        }
        println!("collective: {}", verdict.collective_line());
        println!("{}", verdict.conclusion());
    }
    Ok(if verdict.ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
