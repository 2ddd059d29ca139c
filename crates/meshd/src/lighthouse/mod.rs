//! A torchft-compatible Lighthouse: torchft 0.2.0's managers and `LighthouseClient` talk to
//! it as to torchft's own `torchft_lighthouse`.
//!
//! Two halves joined by a channel, so that the decision can move elsewhere:
//!
//! - [`serve`] (the gRPC edge, [`grpc`]) turns each `torchft.LighthouseService` RPC into a
//!   [`LighthouseCall`] on an `mpsc` channel, and a Quorum call's answer back into gRPC.
//!   It keeps no quorum state.
//! - [`LocalDecider::spawn`] starts the task that owns the sans-IO core
//!   ([`meshd_proto::lighthouse::Lighthouse`]): it reads the calls, ticks the core at its
//!   `poll_timeout`, and answers each waiting Quorum call when a quorum names it.
//!
//! The seam: whoever holds the channel's receiving end decides. A distributed lighthouse
//! puts its own task there (forwarding calls to the mesh's one decider, tagging each
//! decider's ids with [`meshd_proto::lighthouse::DeciderTag`], feeding it the ids others
//! issued with `observe_quorum_id`, and `replica_gone` from the mesh's failure detection),
//! and rewrites each requester's advertised `address` with [`rewrite_host`] before it
//! enters the core: torchft advertises `http://{gethostname()}:port`, which other hosts
//! may not resolve (or resolve to themselves).

pub mod grpc;
pub mod proto;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::SystemTime;

use meshd_proto::lighthouse::{Lighthouse, LighthouseConfig, Member, Output, Quorum, RequestId};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tracing::{Instrument, debug, info};

pub use grpc::ServerLimits;

/// One RPC, as the gRPC edge hands it to the decider.
#[derive(Debug)]
pub enum LighthouseCall {
    /// A Quorum long-poll: answer on `reply` once a quorum holds `member`'s replica. The
    /// member is as received (its `address` not rewritten). Dropping `reply` unanswered
    /// fails the RPC (UNAVAILABLE); the edge drops the receiver when the client goes away
    /// or its deadline passes (`reply.is_closed()` then says so).
    Quorum {
        /// The requester, as torchft's `QuorumMember`.
        member: Member,
        /// Where the answer goes.
        reply: oneshot::Sender<Answer>,
    },
    /// A Heartbeat: the replica is alive (no answer needed).
    Heartbeat {
        /// The replica.
        replica_id: String,
    },
    /// From the owner, not from gRPC: the mesh's failure detection says the replica's node
    /// is gone, so it is unhealthy at once (instead of after the heartbeat timeout).
    ReplicaGone {
        /// The replica.
        replica_id: String,
    },
    /// From the owner, not from gRPC: a quorum id another decider issued; this one's next
    /// ids are greater (`meshd_proto::lighthouse` explains the rule).
    ObserveQuorumId(i64),
}

/// A Quorum call's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The quorum.
    pub quorum: Quorum,
    /// When the decider issued it (torchft's `Quorum.created`): the same for every
    /// participant of one quorum.
    pub created: SystemTime,
}

/// How many calls may wait for the decider: past that the edge waits too (backpressure).
pub const CALL_QUEUE: usize = 1024;

/// Serves torchft's `LighthouseService` (Quorum, Heartbeat) on `listener` with the default
/// [`ServerLimits`], sending every RPC to `calls`. Runs until dropped or until `calls`
/// closes; never returns an error (a bad connection is closed and logged at debug).
pub async fn serve(listener: TcpListener, calls: mpsc::Sender<LighthouseCall>) {
    grpc::serve(listener, calls, ServerLimits::default()).await
}

/// The task that owns one local quorum core (see the module's doc).
#[derive(Debug)]
pub struct LocalDecider {
    core: Lighthouse,
    /// Waiting Quorum calls by the request id given to the core.
    waiting: BTreeMap<RequestId, oneshot::Sender<Answer>>,
    next_id: u64,
}

impl LocalDecider {
    /// Starts the decider on the current tokio runtime; it ends when every sender of the
    /// returned channel is dropped.
    pub fn spawn(cfg: LighthouseConfig) -> mpsc::Sender<LighthouseCall> {
        let (tx, rx) = mpsc::channel(CALL_QUEUE);
        let span = tracing::info_span!("lighthouse", tag = cfg.tag.get());
        let me = LocalDecider { core: Lighthouse::new(cfg), waiting: BTreeMap::new(), next_id: 0 };
        tokio::spawn(me.run(rx).instrument(span));
        tx
    }

    async fn run(mut self, mut rx: mpsc::Receiver<LighthouseCall>) {
        loop {
            let deadline = self.core.poll_timeout().map(tokio::time::Instant::from_std);
            tokio::select! {
                call = rx.recv() => match call {
                    Some(call) => self.handle(call),
                    None => return,
                },
                _ = async { if let Some(d) = deadline { tokio::time::sleep_until(d).await } }, if deadline.is_some() => {
                    self.forget_abandoned();
                    self.core.tick(std::time::Instant::now());
                }
            }
            self.drain();
        }
    }

    fn handle(&mut self, call: LighthouseCall) {
        let now = std::time::Instant::now();
        match call {
            LighthouseCall::Heartbeat { replica_id } => self.core.handle_heartbeat(now, &replica_id),
            LighthouseCall::ReplicaGone { replica_id } => self.core.replica_gone(now, &replica_id),
            LighthouseCall::ObserveQuorumId(id) => self.core.observe_quorum_id(id),
            LighthouseCall::Quorum { member, reply } => {
                self.next_id += 1;
                let id = RequestId(self.next_id);
                info!("Received quorum request for replica {}", member.replica_id);
                self.waiting.insert(id, reply);
                // Ids are fresh, so the core cannot refuse this one as a duplicate.
                if let Err(e) = self.core.handle_quorum_request(now, id, member) {
                    debug!("quorum request refused: {e}");
                    self.waiting.remove(&id);
                }
            }
        }
    }

    /// Calls whose client went away: the core no longer answers nor re-queues them.
    fn forget_abandoned(&mut self) {
        let core = &mut self.core;
        self.waiting.retain(|id, reply| {
            let open = !reply.is_closed();
            if !open {
                core.cancel_request(*id);
            }
            open
        });
    }

    fn drain(&mut self) {
        while let Some(out) = self.core.poll_output() {
            match out {
                Output::Log(line) => info!("{line}"),
                Output::Quorum { quorum, answers } => {
                    let answer = Answer { quorum, created: SystemTime::now() };
                    for id in answers {
                        if let Some(reply) = self.waiting.remove(&id) {
                            let _ = reply.send(answer.clone());
                        }
                    }
                }
            }
        }
    }
}

/// `url` with its host replaced by `ip` (`http://name:1234` -> `http://10.0.0.7:1234`,
/// IPv6 in brackets); the scheme, port and path are kept. A string that is not
/// `scheme://host[:port][/...]` comes back unchanged.
pub fn rewrite_host(url: &str, ip: IpAddr) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    if scheme.is_empty() || !scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b)) {
        return url.to_string();
    }
    let (authority, path) = match rest.find(['/', '?', '#']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    // Userinfo is kept as it is (torchft sends none).
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let port = if let Some(v6) = hostport.strip_prefix('[') {
        match v6.split_once(']') {
            Some((_, "")) => None,
            Some((_, p)) if p.starts_with(':') => Some(&p[1..]),
            _ => return url.to_string(),
        }
    } else {
        match hostport.rsplit_once(':') {
            Some((h, _)) if h.contains(':') => return url.to_string(), // unbracketed IPv6
            Some((_, p)) => Some(p),
            None => None,
        }
    };
    let host_len = hostport.len() - port.map_or(0, |p| p.len() + 1);
    if host_len == 0
        || hostport == "[]"
        || port.is_some_and(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return url.to_string();
    }
    let host = match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    };
    let mut out = format!("{scheme}://");
    if let Some(u) = userinfo {
        out.push_str(u);
        out.push('@');
    }
    out.push_str(&host);
    if let Some(p) = port {
        out.push(':');
        out.push_str(p);
    }
    out.push_str(path);
    out
}

#[cfg(test)]
mod tests;
