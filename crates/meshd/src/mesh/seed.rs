//! Where a node starts from: the interface it announces when the peer list names no other
//! node, and the names that did not resolve yet.
//!
//! The most common way to write the identical command points every node at one well-known
//! member, the head node, the head included (`--peers head`). On the head the list names
//! only itself; its listed address says which interface the others will use, so that is the
//! one it announces. Loopback is for single-node jobs only: a multi-node node on loopback
//! announces 127.0.0.1 and the others, dialling it, reach themselves.

use crate::interfaces::{Choice, IfaceKind, Interface, PeerReach};
use crate::peers::{self, PeerSpec};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;
use tokio::sync::mpsc;

/// The interface of a node whose peer list names no other node, or why there is none.
///
/// - a single-node job: loopback;
/// - `--nnodes` above 1 and this node's own non-loopback address listed: the seed the
///   others join, on the interface that holds that address;
/// - otherwise (nothing listed, or only loopback): `Err` with what was listed, what is local
///   and what to pass.
pub fn alone(
    ifs: &[Interface],
    reach: &[PeerReach],
    single_node: bool,
    max_nodes: u32,
) -> Result<Choice, NoSeed> {
    if single_node {
        return Ok(Choice {
            name: ifs
                .iter()
                .find(|i| i.kind == IfaceKind::Loopback)
                .map(|i| i.name.clone())
                .unwrap_or_else(|| "lo".into()),
            addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
            reason: "single-node job: loopback".into(),
        });
    }
    let listed_self = reach.iter().filter(|r| r.is_self && !r.addr.ip().is_loopback()).find_map(|r| {
        ifs.iter().find(|i| i.has(r.addr.ip())).map(|i| (i.name.clone(), r.addr.ip(), r.peer.clone()))
    });
    if let Some((name, addr, label)) = listed_self {
        let named = if label == addr.to_string() { String::new() } else { format!(" ({label})") };
        return Ok(Choice {
            name,
            addr,
            reason: format!(
                "the peer list names this node's address {addr}{named} and no other node: this node is \
                 the seed the others join through"
            ),
        });
    }
    let listed: Vec<String> = reach
        .iter()
        .map(|r| {
            if r.peer == r.addr.ip().to_string() {
                r.addr.to_string()
            } else {
                format!("{} ({})", r.peer, r.addr)
            }
        })
        .collect();
    let local: Vec<String> = ifs
        .iter()
        .filter(|i| i.kind != IfaceKind::Loopback)
        .flat_map(|i| i.addrs.iter().map(move |a| format!("{} {}", i.name, a.ip)))
        .collect();
    let listed = if listed.is_empty() { "nothing".to_string() } else { listed.join(", ") };
    let local = if local.is_empty() { "none but loopback".to_string() } else { local.join(", ") };
    Err(NoSeed { max_nodes, listed, local })
}

/// A multi-node job whose peer list gives this node nothing to start from: no other node,
/// no address of its own that the others could reach.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "--nnodes {max_nodes} needs other nodes, but the peer list names no other node and no address of \
     this node that they could reach (listed: {listed}; this node's addresses: {local}). Give every node \
     the same --peers with at least one node's address on the network that connects the nodes (this \
     node's own is fine: it becomes the seed), or --iface NAME; for a job on this machine alone, \
     pass --nnodes 1"
)]
pub struct NoSeed {
    /// `--nnodes` (its maximum).
    pub max_nodes: u32,
    /// What the peer list named, in words.
    pub listed: String,
    /// This node's addresses, in words.
    pub local: String,
}

/// Backoff between tries of names that did not resolve: DNS for a fresh instance or a
/// Kubernetes pod can take seconds to appear.
pub const RESOLVE_FIRST: Duration = Duration::from_millis(250);
/// The longest wait between two tries.
pub const RESOLVE_MAX: Duration = Duration::from_secs(4);

/// Tries `specs` again with backoff until every one resolved (`dns:` names are re-resolved
/// for the life of the mesh: records appear one by one as pods become ready). Each new
/// address goes to `tx` with its label; the task ends when the receiver is dropped.
pub fn spawn_resolver(specs: Vec<PeerSpec>, port: u16, tx: mpsc::Sender<Vec<(String, SocketAddr)>>) {
    if specs.is_empty() {
        return;
    }
    tokio::spawn(async move {
        let mut pending = specs;
        let mut delay = RESOLVE_FIRST;
        let mut seen: Vec<SocketAddr> = Vec::new();
        while !pending.is_empty() {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = tx.closed() => return,
            }
            delay = (delay * 2).min(RESOLVE_MAX);
            let Some(results) = resolve_each(pending.clone(), port).await else { return };
            let mut still = Vec::new();
            for (spec, (addrs, errors)) in pending.into_iter().zip(results) {
                let fresh: Vec<(String, SocketAddr)> =
                    addrs.into_iter().filter(|(_, a)| !seen.contains(a)).collect();
                seen.extend(fresh.iter().map(|(_, a)| *a));
                let keep = matches!(spec, PeerSpec::Dns { .. }) || !errors.is_empty();
                if !fresh.is_empty() && tx.send(fresh).await.is_err() {
                    return;
                }
                if keep {
                    still.push(spec);
                }
            }
            pending = still;
        }
    });
}

/// Resolves each entry on its own (addresses and errors per entry, in order), off the
/// runtime's threads (getaddrinfo blocks). `None` if the blocking task failed.
pub async fn resolve_each(
    specs: Vec<PeerSpec>,
    port: u16,
) -> Option<Vec<(Vec<(String, SocketAddr)>, Vec<String>)>> {
    tokio::task::spawn_blocking(move || {
        specs.iter().map(|s| peers::resolve(std::slice::from_ref(s), port)).collect::<Vec<_>>()
    })
    .await
    .ok()
}

/// The label of an entry as messages show it (`dns:NAME` or the host).
pub fn label(spec: &PeerSpec) -> String {
    match spec {
        PeerSpec::Host { host, .. } => host.clone(),
        PeerSpec::Dns { name, .. } => format!("dns:{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interfaces::IfaceAddress;

    fn iface(name: &str, ip: &str, kind: IfaceKind) -> Interface {
        Interface {
            name: name.into(),
            addrs: vec![IfaceAddress { ip: ip.parse().expect("ip"), prefix: 24 }],
            mtu: Some(1500),
            up: true,
            kind,
        }
    }

    fn lab_host() -> Vec<Interface> {
        vec![
            iface("lo", "127.0.0.1", IfaceKind::Loopback),
            iface("eth0", "198.18.0.4", IfaceKind::Private),
            iface("eth1", "198.19.0.25", IfaceKind::Private),
        ]
    }

    fn reach(peer: &str, addr: &str, is_self: bool) -> PeerReach {
        PeerReach {
            peer: peer.into(),
            addr: format!("{addr}:29400").parse().expect("addr"),
            route: None,
            is_self,
            answered: None,
            observed: None,
        }
    }

    #[test]
    fn the_head_node_listed_alone_announces_its_listed_address_not_loopback() {
        let c = alone(&lab_host(), &[reach("198.19.0.25", "198.19.0.25", true)], false, 6).expect("seed");
        assert_eq!(c.name, "eth1");
        assert_eq!(c.addr, "198.19.0.25".parse::<IpAddr>().expect("ip"));
        assert!(c.reason.contains("seed"), "{}", c.reason);
        // By name, too.
        let c = alone(&lab_host(), &[reach("head-node", "198.19.0.25", true)], false, 6).expect("seed");
        assert_eq!(c.name, "eth1");
        assert!(c.reason.contains("head-node"), "{}", c.reason);
    }

    #[test]
    fn loopback_only_for_a_single_node_job() {
        let c = alone(&lab_host(), &[], true, 1).expect("single");
        assert!(c.addr.is_loopback());
        let c = alone(&lab_host(), &[reach("198.19.0.25", "198.19.0.25", true)], true, 1).expect("single");
        assert!(c.addr.is_loopback());
    }

    #[test]
    fn nothing_usable_listed_says_what_was_listed_what_is_local_and_what_to_pass() {
        let e = alone(&lab_host(), &[reach("localhost", "127.0.0.1", true)], false, 3)
            .expect_err("no seed")
            .to_string();
        assert!(e.contains("--nnodes 3 needs other nodes"), "{e}");
        assert!(e.contains("localhost (127.0.0.1:29400)"), "{e}");
        assert!(e.contains("eth1 198.19.0.25") && e.contains("eth0 198.18.0.4"), "{e}");
        assert!(e.contains("--nnodes 1") && e.contains("--iface"), "{e}");
        let e = alone(&lab_host(), &[], false, 2).expect_err("nothing listed").to_string();
        assert!(e.contains("listed: nothing"), "{e}");
    }
}
