//! Interfaces: enumerate, classify, and choose the one that really reaches every peer.
//!
//! Enumeration uses `if-addrs` (getifaddrs) plus `/sys/class/net` for MTU and state.
//! The choice is a pure function ([`choose`]) of the local interfaces and what was learned
//! about each peer: which local address the kernel's route uses toward it (a connected UDP
//! socket's local address; no packet is sent) and whether meshd answered there. A name is
//! never trusted: on GPU clouds `eth0` is a container bridge with the same address on every
//! instance, and the interface that connects instances is whichever one the routes to the
//! peers actually use.

use serde::Serialize;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// What kind of network an interface is on (informational; the choice is by proof).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IfaceKind {
    /// lo, 127.0.0.0/8, ::1.
    Loopback,
    /// docker0, virbr*, cni*, br-*, or Docker's default 172.17.0.0/16: useless between hosts.
    ContainerBridge,
    /// 169.254.0.0/16, fe80::/10 only.
    LinkLocal,
    /// RFC 1918, CGNAT 100.64/10, benchmark 198.18/15, ULA fc00::/7.
    Private,
    /// Anything else.
    Public,
}

impl IfaceKind {
    /// The kebab-case name used in output.
    pub fn as_str(self) -> &'static str {
        match self {
            IfaceKind::Loopback => "loopback",
            IfaceKind::ContainerBridge => "container-bridge",
            IfaceKind::LinkLocal => "link-local",
            IfaceKind::Private => "private",
            IfaceKind::Public => "public",
        }
    }
}

/// One address on an interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IfaceAddress {
    /// The address.
    pub ip: IpAddr,
    /// Prefix length.
    pub prefix: u8,
}

/// A local interface as `ifconfig` would show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Interface {
    /// Name (eth1).
    pub name: String,
    /// Its addresses.
    pub addrs: Vec<IfaceAddress>,
    /// MTU, if readable.
    pub mtu: Option<u32>,
    /// Administratively and operationally up.
    pub up: bool,
    /// Classification.
    pub kind: IfaceKind,
}

impl Interface {
    /// Whether `ip` is one of this interface's addresses.
    pub fn has(&self, ip: IpAddr) -> bool {
        self.addrs.iter().any(|a| a.ip == ip)
    }

    /// The first address of the same family as `like`, else the first IPv4, else any.
    pub fn addr_like(&self, like: Option<IpAddr>) -> Option<IpAddr> {
        let want_v6 = like.map(|ip| ip.is_ipv6());
        self.addrs
            .iter()
            .map(|a| a.ip)
            .filter(|ip| !is_link_local(*ip))
            .find(|ip| want_v6.is_none_or(|v6| ip.is_ipv6() == v6) && (want_v6.is_some() || ip.is_ipv4()))
            .or_else(|| self.addrs.first().map(|a| a.ip))
    }
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

fn addr_kind(ip: IpAddr) -> IfaceKind {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            if v4.is_loopback() {
                IfaceKind::Loopback
            } else if v4.is_link_local() {
                IfaceKind::LinkLocal
            } else if o[0] == 172 && o[1] == 17 {
                IfaceKind::ContainerBridge
            } else if v4.is_private()
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
                || (o[0] == 198 && (o[1] & 0xfe) == 18)
            {
                IfaceKind::Private
            } else {
                IfaceKind::Public
            }
        }
        IpAddr::V6(v6) => {
            if v6 == Ipv6Addr::LOCALHOST {
                IfaceKind::Loopback
            } else if is_link_local(ip) {
                IfaceKind::LinkLocal
            } else if (v6.segments()[0] & 0xfe00) == 0xfc00 {
                IfaceKind::Private
            } else {
                IfaceKind::Public
            }
        }
    }
}

/// Classifies an interface from its name and addresses.
pub fn classify(name: &str, addrs: &[IfaceAddress]) -> IfaceKind {
    const BRIDGES: [&str; 7] = ["docker", "virbr", "br-", "cni", "flannel", "cali", "veth"];
    if name == "lo" || addrs.iter().any(|a| a.ip.is_loopback()) {
        return IfaceKind::Loopback;
    }
    if BRIDGES.iter().any(|p| name.starts_with(p)) {
        return IfaceKind::ContainerBridge;
    }
    // The most useful address decides: a private or public one beats a link-local one.
    addrs
        .iter()
        .map(|a| addr_kind(a.ip))
        .min_by_key(|k| match k {
            IfaceKind::Private => 0,
            IfaceKind::Public => 1,
            IfaceKind::ContainerBridge => 2,
            IfaceKind::LinkLocal => 3,
            IfaceKind::Loopback => 4,
        })
        .unwrap_or(IfaceKind::LinkLocal)
}

fn sys_read(name: &str, file: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/{file}")).ok().map(|s| s.trim().to_string())
}

/// Enumerates this host's interfaces (those with at least one address).
pub fn list() -> std::io::Result<Vec<Interface>> {
    let mut by_name: BTreeMap<String, Vec<IfaceAddress>> = BTreeMap::new();
    for i in if_addrs::get_if_addrs()? {
        let (ip, prefix) = match &i.addr {
            if_addrs::IfAddr::V4(a) => (IpAddr::V4(a.ip), a.prefixlen),
            if_addrs::IfAddr::V6(a) => (IpAddr::V6(a.ip), a.prefixlen),
        };
        let addrs = by_name.entry(i.name.clone()).or_default();
        if !addrs.iter().any(|a| a.ip == ip) {
            addrs.push(IfaceAddress { ip, prefix });
        }
    }
    Ok(by_name
        .into_iter()
        .map(|(name, addrs)| {
            let mtu = sys_read(&name, "mtu").and_then(|s| s.parse().ok());
            let flags = sys_read(&name, "flags")
                .and_then(|s| u32::from_str_radix(s.trim_start_matches("0x"), 16).ok());
            let oper = sys_read(&name, "operstate");
            // IFF_UP = 1. Loopback reports operstate "unknown", so accept that too.
            let up = flags.is_none_or(|f| f & 1 == 1)
                && oper.as_deref().is_none_or(|s| s == "up" || s == "unknown");
            let kind = classify(&name, &addrs);
            Interface { name, addrs, mtu, up, kind }
        })
        .collect())
}

/// The local address the kernel would use to reach `peer` (no packet is sent: connecting a
/// UDP socket only consults the routing table).
pub fn route_source(peer: IpAddr) -> Option<IpAddr> {
    let bind: SocketAddr = match peer {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = UdpSocket::bind(bind).ok()?;
    s.connect(SocketAddr::new(peer, 9)).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}

/// What is known about reaching one listed peer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeerReach {
    /// The peer as the user wrote it.
    pub peer: String,
    /// The address it resolved to.
    pub addr: SocketAddr,
    /// Interface and source address the kernel routes through (None: no route).
    pub route: Option<(String, IpAddr)>,
    /// Whether the address belongs to this host (a node finds itself in the list).
    pub is_self: bool,
    /// Whether meshd answered there (None: not probed).
    pub answered: Option<bool>,
    /// The address the peer saw us come from, when it answered.
    pub observed: Option<IpAddr>,
}

/// Fills in the route and self fields for each listed peer.
/// A peer is this host when its address is ours and its port is `my_port` (several meshd
/// processes may share one host on different ports, as in loopback tests).
pub fn routes(ifaces: &[Interface], peers: &[(String, SocketAddr)], my_port: u16) -> Vec<PeerReach> {
    peers
        .iter()
        .map(|(peer, addr)| {
            let is_self = addr.port() == my_port
                && (addr.ip().is_loopback() || ifaces.iter().any(|i| i.has(addr.ip())));
            let route = route_source(addr.ip())
                .and_then(|src| ifaces.iter().find(|i| i.has(src)).map(|i| (i.name.clone(), src)));
            PeerReach { peer: peer.clone(), addr: *addr, route, is_self, answered: None, observed: None }
        })
        .collect()
}

/// The interface meshd uses, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Choice {
    /// Interface name.
    pub name: String,
    /// This node's address on it.
    pub addr: IpAddr,
    /// Why, in words.
    pub reason: String,
}

/// Why no interface could be chosen.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChoiceError {
    /// `--iface` names an interface that does not exist or has no address.
    #[error("--iface {0}: no such interface with an address on this host (have: {1})")]
    NoSuchIface(String, String),
    /// No listed peer has a route from this host.
    #[error("no route from this host to any listed peer ({0})")]
    NoRoute(String),
    /// No usable interface at all.
    #[error("no interface with an address is up")]
    NoInterface,
}

/// Chooses the interface: forced, else the one the routes to the peers use (peers that
/// answered weigh first), else a best guess when no peer is known.
pub fn choose(
    ifaces: &[Interface],
    peers: &[PeerReach],
    forced: Option<&str>,
) -> Result<Choice, ChoiceError> {
    let names = || ifaces.iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join(", ");
    if let Some(name) = forced {
        let i = ifaces
            .iter()
            .find(|i| i.name == name && !i.addrs.is_empty())
            .ok_or_else(|| ChoiceError::NoSuchIface(name.to_string(), names()))?;
        let like = peers.iter().find(|p| !p.is_self).map(|p| p.addr.ip());
        let addr = i.addr_like(like).ok_or(ChoiceError::NoInterface)?;
        return Ok(Choice { name: i.name.clone(), addr, reason: "forced by --iface".into() });
    }
    let others: Vec<&PeerReach> = peers.iter().filter(|p| !p.is_self).collect();
    if others.is_empty() {
        return guess(ifaces, !peers.is_empty());
    }
    // Score each interface: (peers that answered through it, peers routed through it).
    let mut score: BTreeMap<&str, (usize, usize, Vec<&str>, IpAddr)> = BTreeMap::new();
    for p in &others {
        let Some((name, src)) = &p.route else { continue };
        let e = score.entry(name.as_str()).or_insert((0, 0, Vec::new(), *src));
        e.1 += 1;
        if p.answered == Some(true) {
            e.0 += 1;
        }
        e.2.push(p.peer.as_str());
    }
    let unrouted: Vec<&str> = others.iter().filter(|p| p.route.is_none()).map(|p| p.peer.as_str()).collect();
    let Some((name, (answered, routed, via, src))) =
        score.iter().max_by_key(|(name, (a, r, _, _))| (*a, *r, std::cmp::Reverse(*name)))
    else {
        return Err(ChoiceError::NoRoute(unrouted.join(", ")));
    };
    let n = others.len();
    let probed = others.iter().filter(|p| p.answered.is_some()).count();
    let mut reason = if *routed == n {
        match n {
            1 => format!("the kernel routes to the other peer through {name}"),
            n => format!("the kernel routes to all {n} other peers through {name}"),
        }
    } else {
        format!(
            "{name} reaches {routed} of {} ({}); no single interface reaches all",
            crate::plural(n as u64, "other peer"),
            via.join(", ")
        )
    };
    if probed > 0 {
        reason.push_str(&format!("; meshd answered from {answered} of {probed} probed"));
    }
    if !unrouted.is_empty() {
        reason.push_str(&format!("; no route to {}", unrouted.join(", ")));
    }
    Ok(Choice { name: name.to_string(), addr: *src, reason })
}

/// No peers known: the best-looking interface, said to be a guess.
fn guess_rank(k: IfaceKind) -> u8 {
    match k {
        IfaceKind::Private => 0,
        IfaceKind::Public => 1,
        IfaceKind::ContainerBridge => 2,
        IfaceKind::LinkLocal => 3,
        IfaceKind::Loopback => 4,
    }
}

fn guess(ifaces: &[Interface], only_self: bool) -> Result<Choice, ChoiceError> {
    let best = ifaces
        .iter()
        .filter(|i| i.up && !i.addrs.is_empty())
        .min_by_key(|i| (guess_rank(i.kind), i.name.clone()))
        .ok_or(ChoiceError::NoInterface)?;
    let addr = best.addr_like(None).ok_or(ChoiceError::NoInterface)?;
    let why = if only_self { "the only listed peer is this host" } else { "no peers given" };
    Ok(Choice {
        name: best.name.clone(),
        addr,
        reason: format!(
            "{why}: nothing proves which interface reaches the other nodes; an unproven guess is the first \
             up {} interface (--peers decides)",
            best.kind.as_str()
        ),
    })
}

/// Whether [`choose`] rests on proof: other peers were listed (the kernel's routes to
/// them, and meshd's answers) and no interface was forced. Without peers it only guesses.
pub fn proven(peers: &[PeerReach], forced: Option<&str>) -> bool {
    forced.is_none() && peers.iter().any(|p| !p.is_self)
}

/// Interfaces that could carry a job between nodes (up, with an address, not loopback), in
/// the order a guess would take them: `(name, address, kind)`.
pub fn candidates(ifaces: &[Interface]) -> Vec<(String, IpAddr, IfaceKind)> {
    let mut c: Vec<&Interface> =
        ifaces.iter().filter(|i| i.up && !i.addrs.is_empty() && i.kind != IfaceKind::Loopback).collect();
    c.sort_by_key(|i| (guess_rank(i.kind), i.name.clone()));
    c.into_iter().filter_map(|i| Some((i.name.clone(), i.addr_like(None)?, i.kind))).collect()
}

/// What `meshd ifaces` says without peers: the candidates, and that `--peers` decides.
pub fn unproven_text(ifaces: &[Interface]) -> String {
    let c = candidates(ifaces);
    if c.is_empty() {
        return "no peers given, and no interface but loopback: a job can only run on this host".into();
    }
    let list: Vec<String> = c.iter().map(|(n, a, k)| format!("{n} {a} ({})", k.as_str())).collect();
    format!(
        "no peers given: nothing proves which interface reaches the other nodes. Candidates: {}. \
         `--peers` decides: meshd chooses the interface the routes to the listed peers take and proves \
         it by their answers (try `meshd ifaces --peers HOST,...`)",
        list.join(", ")
    )
}

#[cfg(test)]
mod tests;
