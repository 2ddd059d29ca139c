//! What this node knows about the other members: kept up to date from membership events,
//! so that a thousand-node rendezvous does not copy the whole membership table on every
//! change.

use crate::id::NodeId;
use crate::membership::MemberEvent;
use crate::meta::{NodeMeta, NodeState};
use crate::rendezvous::Candidate;
use std::collections::BTreeMap;
use std::net::SocketAddr;

/// A live member as the rendezvous and its reports need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Peer {
    pub addr: SocketAddr,
    pub hostname: String,
    pub nproc: u32,
    pub run_hash: u64,
    pub state: NodeState,
    pub restarts: u32,
    pub nnodes: (u32, u32),
}

impl Peer {
    fn from_meta(addr: SocketAddr, meta: &NodeMeta) -> Peer {
        Peer {
            addr: meta.gossip_addr.unwrap_or(addr),
            hostname: meta.hostname.clone(),
            nproc: meta.nproc,
            run_hash: meta.run_hash,
            state: meta.state,
            restarts: meta.restarts,
            nnodes: (meta.nnodes_min, meta.nnodes_max),
        }
    }
}

/// Live members (this node included) and those of this run that went away.
#[derive(Debug)]
pub(super) struct View {
    me: NodeId,
    pub live: BTreeMap<NodeId, Peer>,
    /// Members that were live and then died (`true`) or left (`false`), with their address.
    pub gone: BTreeMap<NodeId, (SocketAddr, u64, bool)>,
    /// Set on every change; the round clears it when it looked.
    pub dirty: bool,
}

/// Members gone from the view that are remembered for the timeout message.
const MAX_GONE: usize = 1024;

impl View {
    pub fn new(me: NodeId, addr: SocketAddr, meta: &NodeMeta) -> View {
        let mut live = BTreeMap::new();
        live.insert(me, Peer::from_meta(addr, meta));
        View { me, live, gone: BTreeMap::new(), dirty: true }
    }

    pub fn set_own(&mut self, meta: &NodeMeta) {
        if let Some(p) = self.live.get_mut(&self.me) {
            let addr = p.addr;
            *p = Peer::from_meta(addr, meta);
            self.dirty = true;
        }
    }

    pub fn apply(&mut self, ev: &MemberEvent) {
        match ev {
            MemberEvent::Up(v) | MemberEvent::Updated(v) if v.id != self.me => {
                self.gone.remove(&v.id);
                self.live.insert(v.id, Peer::from_meta(v.addr, &v.meta));
                self.dirty = true;
            }
            MemberEvent::Down(id) | MemberEvent::Left(id) if *id != self.me => {
                if let Some(p) = self.live.remove(id) {
                    if self.gone.len() < MAX_GONE {
                        self.gone.insert(*id, (p.addr, p.run_hash, matches!(ev, MemberEvent::Down(_))));
                    }
                    self.dirty = true;
                }
            }
            _ => {}
        }
    }

    /// Live members of run `run_hash` other than this node.
    pub fn others(&self, run_hash: u64) -> impl Iterator<Item = (&NodeId, &Peer)> {
        self.live.iter().filter(move |(id, p)| **id != self.me && p.run_hash == run_hash)
    }

    /// Live members of this run waiting in round `restart`, this node included.
    pub fn candidates(&self, run_hash: u64, restart: u32) -> Vec<Candidate> {
        self.live
            .iter()
            .filter(|(_, p)| p.run_hash == run_hash && p.state == NodeState::Waiting && p.restarts == restart)
            .map(|(id, p)| Candidate { id: *id, addr: p.addr, nproc: p.nproc, hostname: p.hostname.clone() })
            .collect()
    }

    /// Whether `id` is live.
    pub fn is_live(&self, id: NodeId) -> bool {
        self.live.contains_key(&id)
    }
}
