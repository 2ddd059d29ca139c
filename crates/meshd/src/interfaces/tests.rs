use super::*;

fn iface(name: &str, addrs: &[&str]) -> Interface {
    let addrs: Vec<IfaceAddress> = addrs
        .iter()
        .map(|a| {
            let (ip, p) = a.split_once('/').expect("cidr");
            IfaceAddress { ip: ip.parse().expect("ip"), prefix: p.parse().expect("prefix") }
        })
        .collect();
    let kind = classify(name, &addrs);
    Interface { name: name.into(), addrs, mtu: Some(1500), up: true, kind }
}

fn peer(p: &str, route: Option<(&str, &str)>) -> PeerReach {
    PeerReach {
        peer: p.into(),
        addr: format!("{p}:29400").parse().unwrap_or_else(|_| format!("[{p}]:29400").parse().expect("addr")),
        route: route.map(|(n, s)| (n.to_string(), s.parse().expect("ip"))),
        is_self: false,
        answered: None,
        observed: None,
    }
}

/// The seed's cloud host: eth0 a container bridge with the same address everywhere,
/// eth1 the private network.
fn seed_host() -> Vec<Interface> {
    vec![iface("eth0", &["172.17.0.4/16"]), iface("eth1", &["10.0.0.34/24"]), iface("lo", &["127.0.0.1/8"])]
}

#[test]
fn classify_kinds() {
    let k = |n: &str, a: &str| iface(n, &[a]).kind;
    assert_eq!(k("lo", "127.0.0.1/8"), IfaceKind::Loopback);
    assert_eq!(k("eth0", "172.17.0.4/16"), IfaceKind::ContainerBridge);
    assert_eq!(k("docker0", "192.168.1.1/24"), IfaceKind::ContainerBridge);
    assert_eq!(k("eth1", "10.0.0.34/24"), IfaceKind::Private);
    assert_eq!(k("eth1", "198.19.0.3/24"), IfaceKind::Private);
    assert_eq!(k("ens5", "3.4.5.6/20"), IfaceKind::Public);
    assert_eq!(k("eth2", "169.254.3.3/16"), IfaceKind::LinkLocal);
    assert_eq!(k("eth3", "fe80::1/64"), IfaceKind::LinkLocal);
    assert_eq!(k("eth4", "fd00::5/64"), IfaceKind::Private);
    assert_eq!(k("eth5", "2001:4860::8/64"), IfaceKind::Public);
    // A link-local address beside a private one does not demote the interface.
    assert_eq!(iface("eth1", &["fe80::1/64", "10.1.2.3/24"]).kind, IfaceKind::Private);
}

#[test]
fn seed_case_chooses_eth1_not_eth0() {
    let peers =
        vec![peer("10.0.0.2", Some(("eth1", "10.0.0.34"))), peer("10.0.0.77", Some(("eth1", "10.0.0.34")))];
    let c = choose(&seed_host(), &peers, None).expect("choice");
    assert_eq!(c.name, "eth1");
    assert_eq!(c.addr, "10.0.0.34".parse::<IpAddr>().expect("ip"));
    assert!(c.reason.contains("all 2 other peers"), "{}", c.reason);
}

#[test]
fn answers_outweigh_routes() {
    // Two private networks; the default route would send peer traffic via eth2, but meshd
    // only answered through eth1.
    let ifs = vec![iface("eth1", &["10.0.0.34/24"]), iface("eth2", &["192.168.5.5/24"])];
    let mut a = peer("10.0.0.2", Some(("eth1", "10.0.0.34")));
    a.answered = Some(true);
    let mut b = peer("192.168.5.9", Some(("eth2", "192.168.5.5")));
    b.answered = Some(false);
    let mut c = peer("192.168.5.10", Some(("eth2", "192.168.5.5")));
    c.answered = Some(false);
    let ch = choose(&ifs, &[a, b, c], None).expect("choice");
    assert_eq!(ch.name, "eth1");
    assert!(ch.reason.contains("no single interface"), "{}", ch.reason);
}

#[test]
fn self_in_list_is_skipped() {
    let mut me = peer("10.0.0.34", Some(("lo", "127.0.0.1")));
    me.is_self = true;
    let peers = vec![me, peer("10.0.0.2", Some(("eth1", "10.0.0.34")))];
    assert_eq!(choose(&seed_host(), &peers, None).expect("choice").name, "eth1");
}

#[test]
fn ipv6_peers_choose_the_v6_interface_and_address() {
    let ifs = vec![iface("eth0", &["172.17.0.4/16"]), iface("eth1", &["fe80::2/64", "fd00:19::3/64"])];
    let peers = vec![peer("fd00:19::8", Some(("eth1", "fd00:19::3")))];
    let c = choose(&ifs, &peers, None).expect("choice");
    assert_eq!((c.name.as_str(), c.addr), ("eth1", "fd00:19::3".parse().expect("ip")));
}

#[test]
fn no_peers_guesses_private_over_bridge_and_says_so() {
    let c = choose(&seed_host(), &[], None).expect("choice");
    assert_eq!(c.name, "eth1");
    assert!(c.reason.contains("no peers given"));
    let single = vec![iface("lo", &["127.0.0.1/8"]), iface("ens3", &["3.4.5.6/20"])];
    assert_eq!(choose(&single, &[], None).expect("choice").name, "ens3");
    let only_lo = vec![iface("lo", &["127.0.0.1/8"])];
    assert_eq!(choose(&only_lo, &[], None).expect("choice").name, "lo");
}

#[test]
fn without_peers_nothing_is_proven_and_every_candidate_is_listed() {
    let ifs = seed_host();
    assert!(!proven(&[], None));
    assert!(!proven(&[peer("10.0.0.2", Some(("eth1", "10.0.0.34")))], Some("eth1")), "forced is no proof");
    assert!(proven(&[peer("10.0.0.2", Some(("eth1", "10.0.0.34")))], None));
    let names: Vec<String> = candidates(&ifs).into_iter().map(|c| c.0).collect();
    assert_eq!(names, ["eth1", "eth0"], "loopback is no candidate");
    let t = unproven_text(&ifs);
    assert!(t.contains("eth1 10.0.0.34 (private), eth0 172.17.0.4 (container-bridge)"), "{t}");
    assert!(t.contains("`--peers` decides"), "{t}");
    assert!(!t.contains("chosen"), "{t}");
    let c = choose(&ifs, &[], None).expect("guess");
    assert!(c.reason.contains("unproven guess") && c.reason.contains("--peers decides"), "{}", c.reason);
}

#[test]
fn forced_iface_must_exist() {
    let c = choose(&seed_host(), &[], Some("eth0")).expect("forced");
    assert_eq!(c.name, "eth0");
    assert_eq!(c.reason, "forced by --iface");
    let e = choose(&seed_host(), &[], Some("ib0")).expect_err("missing");
    assert!(e.to_string().contains("ib0") && e.to_string().contains("eth1"), "{e}");
}

#[test]
fn no_route_anywhere_is_an_error_naming_peers() {
    let e = choose(&seed_host(), &[peer("10.9.9.9", None)], None).expect_err("no route");
    assert!(e.to_string().contains("10.9.9.9"));
}

#[test]
fn listing_this_host_works() {
    let ifs = list().expect("getifaddrs");
    assert!(ifs.iter().any(|i| i.kind == IfaceKind::Loopback && i.up));
    // The loopback route is resolved without sending anything.
    assert_eq!(route_source("127.0.0.1".parse().expect("ip")), Some("127.0.0.1".parse().expect("ip")));
}
