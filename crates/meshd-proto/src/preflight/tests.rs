use super::*;
use crate::rendezvous::RosterMember;

fn roster(n: u128) -> Roster {
    Roster {
        run_hash: 1,
        restart: 0,
        epoch: 1,
        master_port: 29500,
        members: (1..=n)
            .map(|i| RosterMember {
                id: NodeId::from_u128(i),
                addr: format!("198.19.0.{i}:29400").parse().expect("addr"),
                nproc: 2,
                hostname: String::new(),
            })
            .collect(),
    }
}

fn report(n: u128, me: u128) -> NodeReport {
    NodeReport {
        tcp: (1..=n)
            .filter(|i| *i != me)
            .map(|i| TcpProbe {
                to: NodeId::from_u128(i),
                target: format!("198.19.0.{i}:40000"),
                ok: true,
                detail: String::new(),
                what: TcpTarget::EphemeralPort,
            })
            .collect(),
        cmd_hash: 7,
        cmd: "python train.py".into(),
        nproc: 2,
        gpus: 8,
        cuda_driver: 12080,
        nccl_version: 22703,
        mtu: 1500,
        iface: "eth1".into(),
        nccl_root: format!("198.19.0.{}:40001", if me == 1 { 1 } else { 0 }),
        nccl_note: String::new(),
    }
}

fn all(n: u128) -> BTreeMap<NodeId, NodeReport> {
    (1..=n).map(|i| (NodeId::from_u128(i), report(n, i))).collect()
}

#[test]
fn open_network_is_nccl() {
    let v = evaluate(&roster(3), &all(3), None, true);
    assert!(v.ok, "{v:?}");
    assert_eq!(v.collective, Collective::Nccl);
}

/// Issue 29: `--insecure` and the tunnel do not mix. Without a token, blocked TCP gives
/// `quic` (meshd's client and hook) and says why; a forced tunnel is refused.
#[test]
fn without_a_token_the_tunnel_is_never_chosen() {
    let mut reps = all(3);
    reps.get_mut(&NodeId::from_u128(2)).expect("r").tcp[1].ok = false;
    let v = evaluate(&roster(3), &reps, None, false);
    assert!(v.ok, "{v:?}");
    assert_eq!(v.collective, Collective::Quic);
    let t = v.checks.iter().find(|c| c.kind == CheckKind::Tunnel).expect("a tunnel check");
    assert!(!t.ok && !t.fatal && t.detail.contains("no token"), "{t:?}");
    let forced = evaluate(&roster(3), &all(3), Some(Collective::Tunnel), false);
    assert!(!forced.ok, "a forced tunnel without a token must not launch: {forced:?}");
    // TCP open, no token: nothing changes.
    let open = evaluate(&roster(3), &all(3), None, false);
    assert!(
        open.ok
            && open.collective == Collective::Nccl
            && open.checks.iter().all(|c| c.kind != CheckKind::Tunnel)
    );
}

#[test]
fn blocked_tcp_selects_the_tunnel_and_names_the_pair() {
    let mut reps = all(3);
    let r = reps.get_mut(&NodeId::from_u128(2)).expect("r");
    r.tcp[1].ok = false;
    r.tcp[1].detail = "timed out".into();
    let mut both = reps.clone();
    let r = both.get_mut(&NodeId::from_u128(3)).expect("r");
    r.tcp[1].ok = false;
    let v = evaluate(&roster(3), &both, None, true);
    assert_eq!(v.tcp_blocked, vec!["198.19.0.2 <-> 198.19.0.3".to_string()], "both ways: one pair");
    let mut back = all(3);
    back.get_mut(&NodeId::from_u128(3)).expect("r").tcp[1].ok = false;
    let v = evaluate(&roster(3), &back, None, true);
    assert_eq!(v.tcp_blocked, vec!["198.19.0.3 -> 198.19.0.2".to_string()], "one way keeps its direction");
    let v = evaluate(&roster(3), &reps, None, true);
    assert!(v.ok, "blocked TCP is not fatal: {v:?}");
    assert_eq!(v.collective, Collective::Tunnel, "auto: the ranks' TCP goes through meshd");
    let tcp = v.checks.iter().find(|c| c.kind == CheckKind::Tcp).expect("tcp");
    assert!(
        tcp.detail.contains("198.19.0.2 -> 198.19.0.3:40000 (198.19.0.3, ephemeral port)"),
        "{}",
        tcp.detail
    );
    assert!(tcp.detail.contains("open TCP"), "{}", tcp.detail);
    // One launch warning names each blocked pair once and both ways out.
    assert_eq!(v.tcp_blocked, vec!["198.19.0.2 -> 198.19.0.3".to_string()]);
    let w = v.tcp_warning("eth1").expect("a warning");
    assert!(w.contains("(198.19.0.2 -> 198.19.0.3)"), "{w}");
    assert!(w.contains("init_process_group") && w.contains("go through meshd's UDP port"), "{w}");
    assert!(w.contains("MESHD_COLLECTIVE=tunnel") && w.contains("static binaries"), "{w}");
    assert!(w.contains("open TCP 1024-65535 between the nodes on eth1"), "{w}");
    assert!(!w.contains('\n'), "one line: {w}");
    let c = v.conclusion();
    assert!(c.contains("go through meshd's UDP port (tunnel mode)"), "{c}");
    assert!(c.contains("TCP between nodes is blocked (198.19.0.2 -> 198.19.0.3)"), "{c}");
    assert!(v.collective_line().starts_with("tunnel (TCP between nodes is blocked"));
    // Forcing the QUIC collective keeps the old advice: Gloo/NCCL would hang.
    let q = evaluate(&roster(3), &reps, Some(Collective::Quic), true);
    assert_eq!(q.collective, Collective::Quic);
    let w = q.tcp_warning("eth1").expect("a warning");
    assert!(w.contains("init_process_group") && w.contains("will hang"), "{w}");
    assert!(w.contains("meshd.torch.allreduce_hook"), "{w}");
    let c = q.conclusion();
    assert!(c.contains("meshd's client and DDP hook will work"), "{c}");
    assert!(c.contains("Gloo/NCCL sockets directly will not: TCP between nodes is blocked"), "{c}");
    assert!(q.collective_line().starts_with("quic (TCP between nodes is blocked"));
    // Forcing the tunnel on an open network says so.
    let t = evaluate(&roster(3), &all(3), Some(Collective::Tunnel), true);
    assert!(t.ok && t.collective == Collective::Tunnel && t.tcp_warning("eth1").is_none());
    assert!(t.collective_line().starts_with("tunnel (forced by --collective"), "{}", t.collective_line());
    // An open network has no warning, and a verdict that says so.
    let open = evaluate(&roster(3), &all(3), None, true);
    assert_eq!(open.tcp_warning("eth1"), None);
    assert!(open.conclusion().starts_with("a job would work"), "{}", open.conclusion());
    // Forcing NCCL on a network where it cannot work is refused.
    assert!(!evaluate(&roster(3), &reps, Some(Collective::Nccl), true).ok);
}

#[test]
fn command_or_gpu_mismatch_is_fatal_and_says_who() {
    let mut reps = all(3);
    reps.get_mut(&NodeId::from_u128(3)).expect("r").cmd = "python train.py --epochs 4".into();
    let v = evaluate(&roster(3), &reps, None, true);
    assert!(!v.ok);
    let c = v.checks.iter().find(|c| c.kind == CheckKind::Command).expect("cmd");
    assert!(c.detail.contains("`python train.py --epochs 4` on 198.19.0.3"), "{}", c.detail);
    assert!(c.detail.contains("198.19.0.1, 198.19.0.2"), "{}", c.detail);
    let mut reps = all(3);
    reps.get_mut(&NodeId::from_u128(1)).expect("r").gpus = 4;
    assert!(!evaluate(&roster(3), &reps, None, true).ok);
}

#[test]
fn nccl_root_must_be_the_masters_address() {
    let v = evaluate(&roster(3), &all(3), None, true);
    let c = v.checks.iter().find(|c| c.kind == CheckKind::NcclId).expect("nccl id");
    assert!(c.ok, "{c:?}");
    let mut reps = all(3);
    reps.get_mut(&NodeId::from_u128(1)).expect("r").nccl_root = "198.18.0.4:5000".into();
    let v = evaluate(&roster(3), &reps, None, true);
    let c = v.checks.iter().find(|c| c.kind == CheckKind::NcclId).expect("nccl id");
    assert!(!c.ok && c.detail.contains("198.18.0.4:5000"), "{c:?}");
    let mut reps = all(3);
    let m = reps.get_mut(&NodeId::from_u128(1)).expect("r");
    m.nccl_root.clear();
    m.nccl_note = "libnccl not found".into();
    let v = evaluate(&roster(3), &reps, None, true);
    assert!(v.ok, "a missing NCCL is not fatal");
    // The collective is still nccl (TCP works), but the line says no id comes from meshd.
    assert_eq!(v.collective, Collective::Nccl);
    assert!(!v.nccl_id);
    assert!(v.collective_line().contains("no GPU or no libnccl on the master"), "{}", v.collective_line());
    assert!(
        evaluate(&roster(3), &all(3), None, true).collective_line().contains("MESHD_NCCL_UNIQUE_ID from")
    );
    assert!(v.checks.iter().any(|c| c.kind == CheckKind::NcclId && c.detail.contains("libnccl not found")));
}

#[test]
fn mtu_mismatch_only_warns_and_missing_report_is_fatal() {
    let mut reps = all(3);
    reps.get_mut(&NodeId::from_u128(1)).expect("r").mtu = 9000;
    let v = evaluate(&roster(3), &reps, None, true);
    assert!(v.ok);
    assert!(v.checks.iter().any(|c| c.kind == CheckKind::Mtu && !c.ok));
    let mut reps = all(3);
    reps.remove(&NodeId::from_u128(2));
    let v = evaluate(&roster(3), &reps, None, true);
    assert!(!v.ok);
    assert!(v.checks[0].detail.contains("198.19.0.2"));
}

#[test]
fn words_are_the_ones_ranks_logs_and_scripts_read() {
    let words: Vec<String> =
        [Collective::Nccl, Collective::Quic, Collective::Tunnel].iter().map(|c| c.to_string()).collect();
    assert_eq!(words, ["nccl", "quic", "tunnel"]);
    let targets: Vec<String> = [TcpTarget::EphemeralPort, TcpTarget::MasterPort, TcpTarget::NcclRoot]
        .iter()
        .map(|t| t.to_string())
        .collect();
    assert_eq!(targets, ["ephemeral port", "MASTER_PORT", "NCCL id root"]);
    // Tables pad them like strings.
    assert_eq!(format!("{:<7}|", Collective::Quic), "quic   |");
    assert!(Collective::Tunnel.uses_quic_ring() && Collective::Quic.uses_quic_ring());
    assert!(!Collective::Nccl.uses_quic_ring());
}
