//! The store task: drives this node's [`meshd_proto::store::Store`] for one restart round.
//!
//! It owns the core (no lock): local ranks' `store_set` / `store_get`, copies and
//! acknowledgements from other nodes (handed over by the job loop, see
//! [`super::Service::remote_store`]) and members leaving ([`super::Service::member_gone`])
//! arrive here; the core's messages go out through the transport on reliable
//! streams (a copy the transport drops, for a full queue or a failed connect, is resent by
//! the core). A `store_set` is answered when every live member holds the value (or a newer
//! one of the same key), or with an error naming the members that did not acknowledge it
//! within the core's deadline or refused it.

use crate::transport::Transport;
use meshd_proto::NodeId;
use meshd_proto::rendezvous::RosterMember;
use meshd_proto::store::{SetFailure, SetId, Store, StoreConfig, StoreEvent};
use meshd_proto::wire::{Frame, StoreMsg};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{debug, warn};

/// Most `store_get` calls waiting at once; more are answered "not set" at once.
const MAX_WAITERS: usize = 65_536;

/// A request to the store task.
pub(super) enum StoreReq {
    /// A local rank's `store_set`: answered when the set completed, or with why not.
    Set(String, Vec<u8>, oneshot::Sender<Result<(), String>>),
    /// A local rank's `store_get`: the value, or `None` after the wait.
    Get(String, Duration, oneshot::Sender<Option<Vec<u8>>>),
    /// A store message from another node.
    Remote(NodeId, StoreMsg),
}

/// A pending `store_get`: deadline, where to answer.
type Waiter = (Instant, oneshot::Sender<Option<Vec<u8>>>);

/// Who the store copies to: this node and the other roster members.
#[derive(Clone, Debug)]
pub struct StorePeers {
    /// This node.
    pub me: NodeId,
    /// Every other member of the round's roster.
    pub others: Vec<RosterMember>,
}

impl StorePeers {
    fn name(&self, id: NodeId) -> String {
        match self.others.iter().find(|m| m.id == id) {
            Some(m) => format!("{} ({})", m.hostname, m.addr),
            None => format!("node {id}"),
        }
    }

    /// A failed set in words, members named by host and address.
    fn describe(&self, failure: &SetFailure) -> String {
        match failure {
            SetFailure::Unacknowledged(ids) => {
                let names: Vec<String> = ids.iter().map(|id| self.name(*id)).collect();
                format!("not acknowledged by {} within the store's deadline", names.join(", "))
            }
            SetFailure::Refused(r) => {
                let r: Vec<String> = r.iter().map(|(id, e)| format!("{}: {e}", self.name(*id))).collect();
                format!("refused by {}", r.join("; "))
            }
            SetFailure::Reset => failure.to_string(),
        }
    }
}

/// Runs the store of restart round `restart` until `rx` closes. `gone` holds the members
/// that left or finished: no set waits for them.
pub(super) async fn run(
    restart: u32,
    peers: StorePeers,
    cfg: StoreConfig,
    transport: Transport,
    mut rx: mpsc::Receiver<StoreReq>,
    mut gone: watch::Receiver<BTreeSet<NodeId>>,
) {
    let addrs: HashMap<NodeId, SocketAddr> = peers.others.iter().map(|m| (m.id, m.addr)).collect();
    let members: Vec<NodeId> = peers.others.iter().map(|m| m.id).collect();
    let mut core = Store::new(peers.me, restart, cfg);
    let mut sets: BTreeMap<SetId, oneshot::Sender<Result<(), String>>> = BTreeMap::new();
    let mut waiters: HashMap<String, Vec<Waiter>> = HashMap::new();
    let mut n_waiters = 0usize;
    loop {
        let next_wait = waiters.values().flatten().map(|w| w.0).min();
        let next_core = core.poll_timeout().map(Instant::from_std);
        let wake = [next_wait, next_core].into_iter().flatten().min();
        let sleep = async {
            match wake {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            req = rx.recv() => {
                let Some(req) = req else { return };
                let now = Instant::now().into_std();
                match req {
                    StoreReq::Set(key, value, done) => match core.set(key, value, members.iter().copied(), now) {
                        Ok(id) => {
                            sets.insert(id, done);
                        }
                        Err(e) => {
                            let _ = done.send(Err(e.to_string()));
                        }
                    },
                    StoreReq::Get(key, timeout, reply) => {
                        if let Some(v) = core.get(&key) {
                            let _ = reply.send(Some(v.to_vec()));
                        } else if n_waiters < MAX_WAITERS {
                            n_waiters += 1;
                            waiters.entry(key).or_default().push((Instant::now() + timeout, reply));
                        } else {
                            warn!("too many pending store_get calls");
                            let _ = reply.send(None);
                        }
                    }
                    StoreReq::Remote(from, msg) => core.handle_message(from, msg, now),
                }
            }
            Ok(()) = gone.changed() => {
                let ids: Vec<NodeId> = gone.borrow_and_update().iter().copied().collect();
                for id in ids {
                    core.member_gone(id);
                }
            }
            _ = sleep => core.handle_timeout(Instant::now().into_std()),
        }
        while let Some((to, msg)) = core.poll_transmit() {
            match addrs.get(&to) {
                Some(addr) => transport.send(*addr, &Frame::Store(msg), true),
                None => debug!("store message for {to}, not a member of this round: dropped"),
            }
        }
        while let Some(ev) = core.poll_event() {
            match ev {
                StoreEvent::SetDone(id) => {
                    if let Some(done) = sets.remove(&id) {
                        let _ = done.send(Ok(()));
                    }
                }
                StoreEvent::SetFailed(id, why) => {
                    let why = peers.describe(&why);
                    warn!("store_set failed: {why}");
                    if let Some(done) = sets.remove(&id) {
                        let _ = done.send(Err(why));
                    }
                }
                StoreEvent::Changed(key) => {
                    if let (Some(ws), Some(v)) = (waiters.remove(&key), core.get(&key)) {
                        n_waiters -= ws.len();
                        for (_, reply) in ws {
                            let _ = reply.send(Some(v.to_vec()));
                        }
                    }
                }
            }
        }
        let now = Instant::now();
        for ws in waiters.values_mut() {
            let (keep, expired): (Vec<Waiter>, Vec<Waiter>) =
                std::mem::take(ws).into_iter().partition(|w| w.0 > now);
            n_waiters -= expired.len();
            for (_, reply) in expired {
                let _ = reply.send(None);
            }
            *ws = keep;
        }
        waiters.retain(|_, ws| !ws.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshd_proto::store::StoreError;

    #[test]
    fn failures_name_members_by_host_and_address() {
        let member = |n: u128, host: &str, addr: &str| RosterMember {
            id: NodeId::from_u128(n),
            addr: addr.parse().expect("addr"),
            nproc: 1,
            hostname: host.into(),
        };
        let peers = StorePeers {
            me: NodeId::from_u128(1),
            others: vec![member(2, "gpu-2", "198.19.0.2:29400"), member(3, "gpu-3", "198.19.0.3:29400")],
        };
        let silent = SetFailure::Unacknowledged(vec![NodeId::from_u128(3), NodeId::from_u128(9)]);
        let text = peers.describe(&silent);
        assert!(text.starts_with("not acknowledged by gpu-3 (198.19.0.3:29400), node "), "{text}");
        let refused = SetFailure::Refused(vec![(NodeId::from_u128(2), StoreError::TooManyKeys { max: 7 })]);
        assert_eq!(
            peers.describe(&refused),
            "refused by gpu-2 (198.19.0.2:29400): store full: it holds 7 keys, the limit"
        );
    }
}
