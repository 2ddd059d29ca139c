//! What only the IO knows about a wait: which listed peers never answered, which names
//! never resolved, and who failed authentication. The core's
//! [`WaitReport`](meshd_proto::node::WaitReport) words the rest.

use super::Mesh;
use crate::transport::{AuthFailure, RefusedBy};
use meshd_proto::membership::MemberView;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

/// Authentication refusals named in a rendezvous timeout message.
pub const MAX_AUTH_REPORTED: usize = 16;

/// Authentication refusals by peer IP (an attacker retrying from new ports is one entry),
/// bounded: the timeout message names a few and counts the rest.
#[derive(Debug, Default)]
pub struct AuthRefusals {
    last: BTreeMap<IpAddr, AuthFailure>,
    overflow: usize,
}

impl AuthRefusals {
    /// Records a refusal from `addr`.
    pub fn record(&mut self, addr: SocketAddr, reason: AuthFailure) {
        if self.last.len() < MAX_AUTH_REPORTED || self.last.contains_key(&addr.ip()) {
            self.last.insert(addr.ip(), reason);
        } else {
            self.overflow += 1;
        }
    }

    /// One short clause per refusing address, for a progress line.
    pub fn words(&self) -> Vec<String> {
        self.last
            .iter()
            .map(|(a, r)| {
                // The keyword only ("different token"); the full reason was logged once.
                let r = &r.words;
                format!("{a} failed authentication ({})", r.split(':').next().unwrap_or(r))
            })
            .collect()
    }

    /// Whole clauses, for the timeout message.
    pub fn clauses(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .last
            .iter()
            .map(|(a, r)| match r.by {
                RefusedBy::Peer => format!("{a} answered and refused this node: {}", r.words),
                RefusedBy::ThisNode => format!("{a} answered but failed authentication: {}", r.words),
            })
            .collect();
        if self.overflow > 0 {
            v.push(format!(
                "and {} more from other addresses",
                crate::plural(self.overflow as u64, "refusal")
            ));
        }
        v
    }

    /// Whether `peer` (a listed entry's words) is one of the refusing addresses.
    fn names(&self, peer: &str) -> bool {
        self.last.keys().any(|a| peer.contains(&a.to_string()))
    }
}

impl Mesh {
    /// Which listed peers never answered (not members in any state, not this node), for
    /// progress lines and timeouts. A member that answered is never listed here, whatever
    /// its run, round or health.
    pub fn missing_peers(&self, members: &[MemberView]) -> Vec<String> {
        let answered = |a: &SocketAddr| {
            members.iter().any(|m| {
                m.id != self.cfg.node
                    && (m.meta.gossip_addr == Some(*a)
                        || m.addr == *a
                        || (a.port() == m.meta.gossip_addr.map_or(m.addr.port(), |g| g.port())
                            && m.meta.addrs.iter().any(|x| x.addr == a.ip())))
            })
        };
        self.cfg
            .peers
            .iter()
            .filter(|(_, a)| *a != self.addr() && !answered(a))
            .filter(|(_, a)| {
                !(a.port() == self.addr().port()
                    && (a.ip().is_loopback() || self.ifs.iter().any(|i| i.has(a.ip()))))
            })
            .map(|(l, a)| if l == &a.ip().to_string() { a.to_string() } else { format!("{l} ({a})") })
            .collect()
    }

    /// Listed peers that never answered and did not fail authentication either.
    pub(crate) fn silent_peers(&self, members: &[MemberView], auth: &AuthRefusals) -> Vec<String> {
        self.missing_peers(members).into_iter().filter(|m| !auth.names(m)).collect()
    }
}
