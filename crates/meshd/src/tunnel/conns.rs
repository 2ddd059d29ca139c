//! The registry of open tunnelled connections, by which meshd cuts them.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The tunnelled connections open now, at both ends, so that those with a lost node (and,
/// after a lost quorum, those with the other replica groups) can be ended at once
/// ([`Tunnel::cut`](super::Tunnel::cut)) rather than at the ranks' own timeouts.
#[derive(Debug, Default)]
pub(super) struct Conns {
    next: AtomicU64,
    open: std::sync::Mutex<HashMap<u64, Conn>>,
}

#[derive(Debug)]
struct Conn {
    /// The other node's roster address.
    peer: IpAddr,
    /// The listening end: the destination the rank connected to (on the peer at the near
    /// end, on this node at the far end).
    listener: SocketAddr,
    /// Ends the connection as a failure (both sides reset).
    cut: tokio::sync::oneshot::Sender<()>,
}

/// A registered connection; dropping it unregisters it.
pub(super) struct ConnGuard {
    conns: Arc<Conns>,
    id: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.id);
    }
}

impl Conns {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Conn>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn register(self: &Arc<Self>, peer: IpAddr, listener: SocketAddr) -> (ConnGuard, Cut) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let conn = Conn { peer: peer.to_canonical(), listener: canonical(listener), cut: tx };
        self.lock().insert(id, conn);
        (ConnGuard { conns: self.clone(), id }, rx)
    }

    /// Ends every connection `which(peer, listener)` picks; how many.
    pub(super) fn cut(&self, which: impl Fn(IpAddr, SocketAddr) -> bool) -> usize {
        let mut open = self.lock();
        let ids: Vec<u64> =
            open.iter().filter(|(_, c)| which(c.peer, c.listener)).map(|(id, _)| *id).collect();
        ids.iter()
            .filter_map(|id| open.remove(id))
            .map(|c| c.cut.send(()).is_ok())
            .filter(|sent| *sent)
            .count()
    }
}

/// A connection's cut signal (see [`Conns`]).
pub(super) type Cut = tokio::sync::oneshot::Receiver<()>;

pub(super) fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}
