//! The node-local service ranks reach through `MESHD_SOCKET` (a Unix socket, owner-only).
//!
//! Hierarchical collectives: the local ranks of a node each hand their buffer to their
//! node's meshd; meshd reduces them locally, runs the inter-node QUIC ring once per node,
//! and hands the result back to every local rank. Ranks must issue collectives in the same
//! order (as with NCCL/Gloo); the k-th collective of every local rank forms operation k.
//!
//! Wire format on the socket (the Python client in `python/meshd` speaks it): each
//! message is `[u32 big-endian header length][JSON header][payload]`, the payload's length
//! given by the header's `nbytes`. Requests: `hello`, `allreduce`, `broadcast`, `barrier`,
//! `store_set`, `store_get`; replies carry `ok` and, on failure, `error` in words. The
//! parsing is in [`super::request`] (pure, fuzzed).

use super::buffer::CollectiveBuffer;
use super::cma::{self, Remote};
use super::request::{self, Kind, Request};
use super::ring::RingNet;
use super::store::{self, StoreSender};
use meshd_proto::node::{StoreAnswer, StoreCall};
use meshd_proto::reduce::{self, DType, ReduceOp};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, info};

mod client;
mod dir;
mod framing;
mod local;
mod part;
mod schedule;

pub use dir::{default_path, sweep_stale};
use part::CollReq;

/// Where and for whom the service runs.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// Socket path (MESHD_SOCKET).
    pub path: PathBuf,
    /// Processes on this node.
    pub local_world: u32,
    /// Global rank of local rank 0.
    pub first_global: u32,
    /// Total processes.
    pub world: u32,
    /// Restart round (separates operation ids and store values across restarts).
    pub restart: u32,
    /// Where the ranks' store requests go (the node core owns the store).
    pub store: StoreSender,
    /// Marked at every request and answer (a rank calling the service is not stalled).
    pub activity: Option<std::sync::Arc<crate::supervisor::output::Activity>>,
}

/// A running service; dropping it stops the tasks and removes the socket.
#[derive(Debug)]
pub struct Service {
    path: PathBuf,
    /// The socket's directory, when [`Service::start`] created it.
    dir: Option<PathBuf>,
    tasks: Vec<JoinHandle<()>>,
}

impl Service {
    /// Binds the socket (owner-only) and starts serving.
    pub fn start(cfg: ServiceConfig, ring: RingNet) -> std::io::Result<Service> {
        if let Some(base) = cfg.path.parent().and_then(Path::parent) {
            let n = sweep_stale(base);
            if n > 0 {
                tracing::debug!(
                    "removed {n} stale socket director{} of meshd processes that are gone",
                    if n == 1 { "y" } else { "ies" }
                );
            }
        }
        let dir = dir::private_dir(&cfg.path)?;
        let _ = std::fs::remove_file(&cfg.path);
        let listener = UnixListener::bind(&cfg.path)?;
        std::fs::set_permissions(&cfg.path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let (coll_tx, coll_rx) = mpsc::channel(1024);
        let tasks = vec![
            tokio::spawn(accept(listener, cfg.clone(), coll_tx)),
            tokio::spawn(schedule::collectives(cfg.clone(), ring, coll_rx)),
        ];
        Ok(Service { path: cfg.path, dir, tasks })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        let _ = std::fs::remove_file(&self.path);
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir(d);
        }
    }
}

async fn accept(listener: UnixListener, cfg: ServiceConfig, coll: mpsc::Sender<CollReq>) {
    let mut errors = crate::files::AcceptErrors::new("the local service's socket (MESHD_SOCKET)");
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                errors.ok();
                stream
            }
            // Out of open files (EMFILE) and the like: wait and accept again, never stop.
            Err(e) => {
                tokio::time::sleep(errors.failed(&e)).await;
                continue;
            }
        };
        let (cfg, coll) = (cfg.clone(), coll.clone());
        tokio::spawn(async move {
            if let Err(e) = client::client(stream, &cfg, coll).await {
                debug!("local client: {e}");
            }
        });
    }
}
