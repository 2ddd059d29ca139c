//! What a waiting node says: who never answered, who answered but cannot join (and why),
//! and the timeout message that separates them.

use super::Mesh;
use meshd_proto::NodeId;
use meshd_proto::NodeState;
use meshd_proto::membership::MemberStatus;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

impl Mesh {
    /// Which listed peers never answered (not members in any state, not this node), for
    /// progress lines and timeouts. A member that answered is never listed here, whatever
    /// its run, round or health.
    pub fn missing_peers(&self) -> Vec<String> {
        let members = self.membership.members();
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
            .filter(|(_, a)| *a != self.addr && !answered(a))
            .filter(|(_, a)| {
                !(a.port() == self.addr.port()
                    && (a.ip().is_loopback() || self.ifs.iter().any(|i| i.has(a.ip()))))
            })
            .map(|(l, a)| if l == &a.ip().to_string() { a.to_string() } else { format!("{l} ({a})") })
            .collect()
    }

    /// Members of this run that answered but cannot join this round, each with why:
    /// another `--nnodes`, another restart round, already running.
    pub(super) fn disagreeing(&self, restart: u32) -> Vec<(NodeId, String)> {
        let mine = nnodes_text(self.cfg.min_nodes, self.cfg.max_nodes);
        self.membership
            .alive()
            .into_iter()
            .filter(|m| m.id != self.cfg.node && m.meta.run_hash == self.run_hash)
            .filter_map(|m| {
                let who = m.meta.gossip_addr.unwrap_or(m.addr).ip();
                let theirs = nnodes_text(m.meta.nnodes_min, m.meta.nnodes_max);
                let why = if theirs != mine {
                    format!("{who} was started with --nnodes {theirs}, this node with --nnodes {mine}")
                } else if m.meta.state != NodeState::Waiting {
                    format!("{who} is {} (a job of this run is under way there)", state_word(m.meta.state))
                } else if m.meta.restarts != restart {
                    format!("{who} is in restart round {}, this node in {restart}", m.meta.restarts)
                } else {
                    return None;
                };
                Some((m.id, why))
            })
            .collect()
    }

    /// Why a rendezvous did not finish: who is present, who answered but cannot join (and
    /// why), who failed authentication (and why), who never answered, which names never
    /// resolved. A present node is never listed as missing.
    pub(super) fn timeout_message(
        &self,
        timeout: Duration,
        restart: u32,
        present: usize,
        (min, max): (u32, u32),
        auth: &BTreeMap<IpAddr, String>,
        auth_overflow: usize,
    ) -> String {
        let mut msg = format!(
            "rendezvous timed out after {}: {present} of {} {} present",
            human(timeout),
            nnodes_text(min, max),
            if min == 1 && max == 1 { "node" } else { "nodes" }
        );
        let members: Vec<String> = self
            .candidates()
            .iter()
            .map(|c| {
                if c.id == self.cfg.node {
                    format!("{} (this node)", c.addr.ip())
                } else {
                    c.addr.ip().to_string()
                }
            })
            .collect();
        if !members.is_empty() {
            msg.push_str(&format!(" ({})", members.join(", ")));
        }
        let mut why: BTreeMap<NodeId, String> = self.nnodes_named.clone();
        why.extend(self.disagreeing(restart));
        for why in why.values() {
            msg.push_str(&format!("; {why}"));
        }
        for (a, r) in auth {
            match r.strip_prefix(crate::transport::REFUSED_US) {
                Some(r) => msg.push_str(&format!("; {a} answered and refused this node: {r}")),
                None => msg.push_str(&format!("; {a} answered but failed authentication: {r}")),
            }
        }
        if auth_overflow > 0 {
            msg.push_str(&format!(
                "; and {} more from other addresses",
                crate::plural(auth_overflow as u64, "refusal")
            ));
        }
        let missing: Vec<String> = self
            .missing_peers()
            .into_iter()
            .filter(|m| !auth.keys().any(|a| m.contains(&a.to_string())))
            .collect();
        if !missing.is_empty() {
            msg.push_str(&format!(
                "; never answered: {} (is meshd running there, and UDP {} open?)",
                missing.join(", "),
                self.addr.port()
            ));
        }
        if !self.unresolved.is_empty() {
            msg.push_str(&format!("; never resolved: {}", self.unresolved.join(", ")));
        }
        // Nodes of this run that were there and went silent (a meshd that died) or left.
        let gone: Vec<String> = self
            .membership
            .members()
            .into_iter()
            .filter(|m| m.id != self.cfg.node && m.meta.run_hash == self.run_hash)
            .filter(|m| matches!(m.status, MemberStatus::Dead | MemberStatus::Left))
            .map(|m| {
                let how = if m.status == MemberStatus::Dead { "stopped answering" } else { "left" };
                format!("{} {how}", m.meta.gossip_addr.unwrap_or(m.addr))
            })
            .collect();
        if !gone.is_empty() {
            msg.push_str(&format!(
                "; present earlier, then gone: {} (did meshd stop there?)",
                gone.join(", ")
            ));
        }
        msg
    }
}

/// `N` or `MIN:MAX`, as `--nnodes` spells it.
pub(super) fn nnodes_text(min: u32, max: u32) -> String {
    if min == max { min.to_string() } else { format!("{min}:{max}") }
}

fn state_word(s: NodeState) -> &'static str {
    match s {
        NodeState::Waiting => "waiting",
        NodeState::Running => "running",
        NodeState::Done => "done",
        NodeState::Failed => "failed",
    }
}

/// `300s`, `1.5s`, `5m`: a duration as the flags spell it.
fn human(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 60.0 && s % 60.0 == 0.0 {
        format!("{}m", s / 60.0)
    } else {
        format!("{}s", (s * 1000.0).round() / 1000.0)
    }
}
