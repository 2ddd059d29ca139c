//! `meshd lighthouse`: a torchft-compatible Lighthouse with one local decider, a drop-in for
//! torchft's `torchft_lighthouse` (the same flags, spelled either way).

use anyhow::{Context, Result, bail};
use meshd::lighthouse::{LocalDecider, serve};
use meshd_proto::lighthouse::LighthouseConfig;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to serve gRPC on (torchft's default port is 29510).
    #[arg(long, default_value = "[::]:29510")]
    pub bind: String,
    /// Replica groups needed for a new quorum (a fast quorum of the previous members needs none).
    #[arg(long = "min-replicas", alias = "min_replicas")]
    pub min_replicas: u64,
    /// How long healthy stragglers are waited for before a quorum is issued without them.
    #[arg(long = "join-timeout-ms", alias = "join_timeout_ms", default_value_t = 60_000)]
    pub join_timeout_ms: u64,
    /// A replica group without a heartbeat for this long is no longer healthy.
    #[arg(long = "heartbeat-timeout-ms", alias = "heartbeat_timeout_ms", default_value_t = 5_000)]
    pub heartbeat_timeout_ms: u64,
    /// How often the quorum is checked while requests wait.
    #[arg(long = "quorum-tick-ms", alias = "quorum_tick_ms", default_value_t = 100)]
    pub quorum_tick_ms: u64,
}

pub async fn main(a: Args) -> Result<ExitCode> {
    if a.quorum_tick_ms == 0 {
        bail!("--quorum-tick-ms must be at least 1");
    }
    let cfg = LighthouseConfig {
        min_replicas: a.min_replicas,
        join_timeout: Duration::from_millis(a.join_timeout_ms),
        heartbeat_timeout: Duration::from_millis(a.heartbeat_timeout_ms),
        quorum_tick: Duration::from_millis(a.quorum_tick_ms),
        ..LighthouseConfig::default()
    };
    let listener = tokio::net::TcpListener::bind(&a.bind)
        .await
        .with_context(|| format!("cannot listen on {}", a.bind))?;
    let addr = listener.local_addr().context("the listener's address")?;
    println!("meshd lighthouse listening on http://{addr}");
    let _ = std::io::stdout().flush();
    tracing::info!(
        "lighthouse on {addr}: min_replicas {}, join timeout {:?}, heartbeat timeout {:?}, tick {:?}",
        cfg.min_replicas,
        cfg.join_timeout,
        cfg.heartbeat_timeout,
        cfg.quorum_tick
    );
    serve(listener, LocalDecider::spawn(cfg)).await;
    Ok(ExitCode::SUCCESS)
}
