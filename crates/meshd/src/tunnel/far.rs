//! The tunnel's far end: peers' tunnel streams, each a TCP connection one of their ranks
//! opens to this node.
//!
//! A stream is served only when all of these hold, and refused otherwise (the refusal is
//! logged once per peer and reason, and written by the stream's own task with a deadline,
//! so a peer that grants no stream credit delays nobody):
//! - its node id is a roster member of this round, and the QUIC connection it came on is
//!   from that member's roster address (a token holder that claims a member's id from
//!   elsewhere reaches nothing);
//! - the destination is this node's roster address, on a port where a process of this job
//!   listens ([`super::listeners`]): the tunnel serves the job, not the host;
//! - that peer holds fewer than [`MAX_PER_PEER`] tunnelled connections to this node, and
//!   the node has an open file to spare ([`super::Budget`]).

use super::listeners::{JobPorts, PortCheck};
use super::{Budget, TunnelConfig, TunnelStats, pipe, plane_stream, reset_on_close, wire};
use crate::transport::TunnelStream;
use crate::transport::guard::LogOnce;
use meshd_proto::NodeId;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, warn};

/// How long the far end tries to connect to the destination.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a refusal's status byte may take to leave (a peer that grants no stream
/// credit gets its stream reset instead).
const REFUSE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the near end's offer may take to follow its request (it is sent right behind
/// it; the near end gives up on an answer after 15 s).
const OFFER_TIMEOUT: Duration = Duration::from_secs(10);
/// Tunnelled connections one peer node may hold to this node at once. Gloo opens one per
/// pair of ranks (8 x 8 = 64 between two nodes of 8 ranks), plus the store's and the
/// user's own: far below it.
pub const MAX_PER_PEER: usize = 1024;

/// Why a stream is refused; its words are logged once per peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The node id is not a member of this round.
    NotMember,
    /// The node id is a member, but its roster address is not where the stream came from.
    WrongAddress { roster: std::net::IpAddr },
    /// The request does not decode.
    Malformed,
    /// The destination is not this node's roster address.
    NotThisNode(SocketAddr),
    /// Something outside the job listens on the destination port.
    NotTheJobs(u16),
    /// The peer holds its cap ([`MAX_PER_PEER`] in a job) of tunnelled connections here.
    PeerCap(usize),
    /// This node has no open file to spare.
    NodeCap(usize),
}

impl Refusal {
    /// The status byte the peer's rank gets.
    fn status(&self) -> u8 {
        match self {
            Refusal::NotTheJobs(_) | Refusal::PeerCap(_) | Refusal::NodeCap(_) => wire::status::REFUSED,
            _ => wire::status::UNREACHABLE,
        }
    }

    fn words(&self) -> String {
        match self {
            Refusal::NotMember => "it is not a roster member of this round".into(),
            Refusal::WrongAddress { roster } => {
                format!("it claims the node id of a roster member whose address is {roster}")
            }
            Refusal::Malformed => "its request does not decode".into(),
            Refusal::NotThisNode(d) => format!("its destination {d} is not this node's roster address"),
            Refusal::NotTheJobs(p) => format!(
                "no rank of this job listens on port {p} here (the tunnel reaches only the job's own ports)"
            ),
            Refusal::PeerCap(n) => format!("it already holds {n} tunnelled connections to this node"),
            Refusal::NodeCap(n) => {
                format!("this node holds {n} tunnelled connections, all its open files allow")
            }
        }
    }
}

/// The far end's state for one round.
pub(super) struct Far {
    pub cfg: Arc<TunnelConfig>,
    pub routes: super::LiveRoutes,
    pub conns: Arc<super::Conns>,
    /// The data plane, when tunnelled bytes may use it.
    pub plane: Option<crate::transport::plane::Plane>,
    pub stats: Arc<TunnelStats>,
    pub ports: Arc<JobPorts>,
    pub budget: Arc<Budget>,
    pub logged: LogOnce,
    /// Connections each peer holds here.
    pub per_peer: Mutex<HashMap<NodeId, Arc<Semaphore>>>,
}

impl Far {
    fn peer_slots(&self, node: NodeId) -> Arc<Semaphore> {
        let mut m = self.per_peer.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(node).or_insert_with(|| Arc::new(Semaphore::new(self.cfg.per_peer))).clone()
    }

    /// The checks that need no /proc: who asks, and for which address.
    fn admit(&self, t: &TunnelStream) -> Result<(SocketAddr, [OwnedSemaphorePermit; 2]), Refusal> {
        let roster_ip = super::read_routes(&self.routes).members.get(&t.node).copied();
        let roster_ip = roster_ip.ok_or(Refusal::NotMember)?;
        if roster_ip.to_canonical() != t.from.ip().to_canonical() {
            return Err(Refusal::WrongAddress { roster: roster_ip });
        }
        let dest = super::decode_request(&t.request).ok_or(Refusal::Malformed)?;
        if dest.ip().to_canonical() != self.cfg.local_ip.to_canonical() {
            return Err(Refusal::NotThisNode(dest));
        }
        let peer =
            self.peer_slots(t.node).try_acquire_owned().map_err(|_| Refusal::PeerCap(self.cfg.per_peer))?;
        let node = self.budget.try_take().ok_or(Refusal::NodeCap(self.budget.capacity()))?;
        Ok((dest, [peer, node]))
    }

    fn refused(&self, t: &TunnelStream, why: &Refusal) {
        self.stats.refused.fetch_add(1, Ordering::Relaxed);
        let words = why.words();
        if self.logged.first(t.from, &words) {
            warn!("tunnel: refusing {}'s connection: {words} (said once per peer and reason)", t.from);
        } else {
            debug!("tunnel: refusing {}'s connection: {words}", t.from);
        }
    }
}

/// Serves peers' tunnel streams until the round's tunnel is dropped; every stream's task
/// is in `tasks`, so they all end with it.
pub(super) async fn far(incoming: super::Incoming, far: Arc<Far>) {
    let mut incoming = incoming.lock().await;
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            t = incoming.recv() => match t {
                Some(t) => {
                    let far = far.clone();
                    tasks.spawn(async move { serve(t, &far).await });
                }
                None => break,
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    // The transport is gone: the streams end with their connections.
    while tasks.join_next().await.is_some() {}
}

async fn serve(mut t: TunnelStream, far: &Far) {
    let checked = match far.admit(&t) {
        Ok((dest, permits)) => {
            let ports = far.ports.clone();
            let port = dest.port();
            let ip = dest.ip();
            let own = far.cfg.own_ports.contains(&port);
            match tokio::task::spawn_blocking(
                move || if own { PortCheck::Job } else { ports.check(ip, port) },
            )
            .await
            {
                Ok(PortCheck::Job) => Ok((dest, permits)),
                Ok(PortCheck::NotListening) => Err(None),
                Ok(PortCheck::Outside) | Err(_) => Err(Some(Refusal::NotTheJobs(port))),
            }
        }
        Err(why) => Err(Some(why)),
    };
    let (dest, permits) = match checked {
        Ok(ok) => ok,
        Err(why) => {
            let status = match &why {
                Some(why) => {
                    far.refused(&t, why);
                    why.status()
                }
                // As the kernel would answer; nothing to log.
                None => wire::status::REFUSED,
            };
            refuse(t, status).await;
            return;
        }
    };
    // The near end's offer follows its request at once. It is read before the destination
    // is connected: a peer whose offer is late (or never comes) must not leave the job's
    // listener an accepted connection that ends without a byte, which it would read as an
    // empty stream closed cleanly.
    let mut theirs = [0u8; plane_stream::OFFER_LEN];
    if !matches!(tokio::time::timeout(OFFER_TIMEOUT, t.recv.read_exact(&mut theirs)).await, Ok(Ok(()))) {
        reset(&mut t);
        return;
    }
    let status = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(dest)).await {
        Ok(Ok(tcp)) => Ok(tcp),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Err(wire::status::REFUSED),
        Ok(Err(e)) => {
            debug!("tunnel: connect {dest} for {}: {e}", t.from);
            Err(wire::status::FAILED)
        }
        Err(_) => Err(wire::status::TIMED_OUT),
    };
    let tcp = match status {
        Ok(tcp) => tcp,
        Err(st) => {
            refuse(t, st).await;
            return;
        }
    };
    // The status with this end's offer; this end's plane stream is registered before it
    // is offered.
    let mine = plane_stream::Mine::register(far.plane.as_ref(), t.from);
    let mut answer = [0u8; 1 + plane_stream::OFFER_LEN];
    answer[0] = wire::status::OK;
    answer[1..].copy_from_slice(&plane_stream::offer(mine.as_ref()).encode());
    if tokio::time::timeout(REFUSE_TIMEOUT, t.send.write_all(&answer)).await.map_or(true, |r| r.is_err()) {
        // The near end cannot hear that the connection stands: the application's end is
        // reset (an RST, not the FIN of a clean close), and so is the stream.
        reset_on_close(&tcp);
        reset(&mut t);
        return;
    }
    let way = mine.map(|m| m.with(plane_stream::Offer::decode(&theirs)));
    let _ = tcp.set_nodelay(true);
    far.stats.served.fetch_add(1, Ordering::Relaxed);
    let (r, w) = tcp.into_split();
    let (registered, cut) = far.conns.register(t.from.ip(), dest);
    // A failure is passed on as TCP RST: linger 0, then close (without the FIN a dropped
    // write half would send first).
    let ends = super::Ends { closed: None, cut };
    pipe(r, w, (t.send, t.recv), way, &far.stats, ends, |w: tokio::net::tcp::OwnedWriteHalf| {
        reset_on_close(w.as_ref());
        w.forget();
    })
    .await;
    drop((registered, permits));
}

/// Resets both directions of a stream that will not be served.
fn reset(t: &mut TunnelStream) {
    let _ = t.send.reset(super::RESET.into());
    let _ = t.recv.stop(super::RESET.into());
}

/// Answers `status` and ends the stream; a peer that does not take the byte in time gets
/// the stream reset.
async fn refuse(mut t: TunnelStream, status: u8) {
    let sent = tokio::time::timeout(REFUSE_TIMEOUT, t.send.write_all(&[status])).await;
    if matches!(sent, Ok(Ok(()))) {
        let _ = t.send.finish();
    } else {
        reset(&mut t);
        return;
    }
    let _ = t.recv.stop(super::RESET.into());
}
