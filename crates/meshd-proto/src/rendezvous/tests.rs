use super::*;
use crate::rng::Rng;

fn cand(id: u128, addr: &str) -> Candidate {
    Candidate {
        id: NodeId::from_u128(id),
        addr: format!("{addr}:29400").parse().expect("addr"),
        nproc: 2,
        hostname: format!("h{id}"),
    }
}

fn cfg(min: u32, max: u32) -> RdzvConfig {
    RdzvConfig {
        min_nodes: min,
        max_nodes: max,
        settle: Duration::from_secs(2),
        ack_timeout: Duration::from_secs(1),
    }
}

/// Delivers every queued message among the cores until quiet; returns commits.
fn pump(nodes: &mut [Rendezvous], cands: &[Candidate], now: Instant) -> Vec<Option<Roster>> {
    let mut commits: Vec<Option<Roster>> = vec![None; nodes.len()];
    for _ in 0..100 {
        let mut moved = false;
        for i in 0..nodes.len() {
            while let Some(ev) = nodes[i].poll_event() {
                if let RdzvEvent::Committed(r) = ev {
                    commits[i] = Some(r);
                }
            }
            while let Some((to, msg)) = nodes[i].poll_transmit() {
                moved = true;
                let from = nodes[i].me;
                if let Some(j) = cands.iter().position(|c| c.addr == to) {
                    nodes[j].handle_message(from, msg, now);
                }
            }
        }
        if !moved {
            break;
        }
    }
    for i in 0..nodes.len() {
        while let Some(RdzvEvent::Committed(r)) = nodes[i].poll_event() {
            commits[i] = Some(r);
        }
    }
    commits
}

#[test]
fn master_is_lowest_address_not_lowest_id_and_all_agree() {
    let now = Instant::now();
    // ids deliberately in another order than addresses
    let cands = vec![cand(1, "198.19.0.30"), cand(2, "198.19.0.7"), cand(3, "198.19.0.12")];
    let mut nodes: Vec<_> = cands
        .iter()
        .map(|c| Rendezvous::new(c.id, 42, 0, cfg(3, 3), 30000 + c.id.as_u128() as u16, now))
        .collect();
    for n in nodes.iter_mut() {
        n.handle_candidates(cands.clone(), now);
    }
    let commits = pump(&mut nodes, &cands, now);
    let first = commits[0].clone().expect("node 0 committed");
    for c in &commits {
        assert_eq!(c.as_ref(), Some(&first));
    }
    let order: Vec<u128> = first.members.iter().map(|m| m.id.as_u128()).collect();
    assert_eq!(order, vec![2, 3, 1], "ranks follow address order");
    assert_eq!(first.master_port, 30002, "the master's own port is used");
    assert_eq!(first.world_size(), 6);
    assert_eq!(first.first_global_rank(2), 4);
}

#[test]
fn election_is_stable_under_permutation() {
    let now = Instant::now();
    let base = vec![
        cand(5, "198.19.0.30"),
        cand(9, "198.19.0.2"),
        cand(1, "198.19.0.200"),
        cand(4, "198.19.0.2"), // same address as 9 (can happen across NAT): id breaks the tie
    ];
    let mut rng = Rng::new(11);
    let mut seen = None;
    for _ in 0..50 {
        let mut c = base.clone();
        rng.shuffle(&mut c);
        let mut r = Rendezvous::new(NodeId::from_u128(4), 1, 0, cfg(4, 4), 1, now);
        r.handle_candidates(c, now);
        let order: Vec<NodeId> = r.candidates.iter().map(|c| c.id).collect();
        assert_eq!(*seen.get_or_insert(order.clone()), order);
    }
    let order = seen.expect("ran");
    assert_eq!(order[0], NodeId::from_u128(4));
    assert_eq!(order[1], NodeId::from_u128(9));
}

#[test]
fn fewer_than_min_never_proposes() {
    let now = Instant::now();
    let cands = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2")];
    let mut r = Rendezvous::new(NodeId::from_u128(1), 1, 0, cfg(3, 3), 1, now);
    r.handle_candidates(cands, now);
    r.handle_timeout(now + Duration::from_secs(100));
    assert!(r.poll_transmit().is_none());
    assert!(r.poll_event().is_none());
    assert_eq!(r.progress(), (2, 3, 3));
}

#[test]
fn min_max_waits_for_settle_then_starts_with_who_is_there() {
    let t0 = Instant::now();
    let cands = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2")];
    let mut nodes: Vec<_> = cands.iter().map(|c| Rendezvous::new(c.id, 1, 0, cfg(2, 4), 1, t0)).collect();
    for n in nodes.iter_mut() {
        n.handle_candidates(cands.clone(), t0);
    }
    assert!(pump(&mut nodes, &cands, t0).iter().all(Option::is_none));
    assert_eq!(nodes[0].poll_timeout(), Some(t0 + Duration::from_secs(2)));
    let t1 = t0 + Duration::from_secs(2);
    for n in nodes.iter_mut() {
        n.handle_timeout(t1);
    }
    let commits = pump(&mut nodes, &cands, t1);
    assert!(commits.iter().all(|c| c.as_ref().map(|r| r.members.len()) == Some(2)));
}

#[test]
fn single_node_commits_at_once() {
    let now = Instant::now();
    let mut r = Rendezvous::new(NodeId::from_u128(1), 1, 0, cfg(1, 1), 5, now);
    r.handle_candidates(vec![cand(1, "127.0.0.1")], now);
    assert!(matches!(r.poll_event(), Some(RdzvEvent::Committed(_))));
}

#[test]
fn lagging_member_holds_the_proposal_until_its_view_catches_up() {
    let now = Instant::now();
    let cands = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2"), cand(3, "198.19.0.3")];
    let mut nodes: Vec<_> = cands.iter().map(|c| Rendezvous::new(c.id, 1, 0, cfg(3, 3), 1, now)).collect();
    nodes[0].handle_candidates(cands.clone(), now);
    nodes[1].handle_candidates(cands.clone(), now);
    nodes[2].handle_candidates(cands[1..].to_vec(), now); // does not see node 1 yet
    let commits = pump(&mut nodes, &cands, now);
    assert!(commits.iter().all(Option::is_none), "no commit without every ack");
    nodes[2].handle_candidates(cands.clone(), now);
    let commits = pump(&mut nodes, &cands, now);
    assert!(commits.iter().all(Option::is_some));
}

#[test]
fn proposal_from_a_non_lowest_node_is_not_acknowledged() {
    let now = Instant::now();
    let cands = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2")];
    let mut r = Rendezvous::new(NodeId::from_u128(1), 1, 0, cfg(2, 2), 1, now);
    r.handle_candidates(cands.clone(), now);
    while r.poll_transmit().is_some() {}
    let bogus = Roster {
        run_hash: 1,
        restart: 0,
        epoch: 9,
        master_port: 1,
        members: vec![
            RosterMember { id: NodeId::from_u128(2), addr: cands[1].addr, nproc: 2, hostname: "x".into() },
            RosterMember { id: NodeId::from_u128(1), addr: cands[0].addr, nproc: 2, hostname: "y".into() },
        ],
    };
    r.handle_message(NodeId::from_u128(2), Message::Propose(bogus), now);
    assert!(r.poll_transmit().is_none());
}

#[test]
fn missing_ack_times_out_and_reproposes_with_new_epoch() {
    let now = Instant::now();
    let cands = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2")];
    let mut m = Rendezvous::new(NodeId::from_u128(1), 1, 0, cfg(2, 2), 1, now);
    m.handle_candidates(cands, now);
    let Some((_, Message::Propose(r1))) = m.poll_transmit() else { panic!("no proposal") };
    let later = now + Duration::from_secs(1);
    assert_eq!(m.poll_timeout(), Some(later));
    m.handle_timeout(later);
    let Some((_, Message::Propose(r2))) = m.poll_transmit() else { panic!("no re-proposal") };
    assert!(r2.epoch > r1.epoch);
    // A late ack for the old epoch does not commit.
    m.handle_message(NodeId::from_u128(2), Message::Ack { restart: 0, epoch: r1.epoch }, later);
    assert!(m.poll_event().is_none());
    m.handle_message(NodeId::from_u128(2), Message::Ack { restart: 0, epoch: r2.epoch }, later);
    assert!(matches!(m.poll_event(), Some(RdzvEvent::Committed(_))));
}

#[test]
fn other_run_or_round_is_ignored() {
    let now = Instant::now();
    let cands = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2")];
    let mut w = Rendezvous::new(NodeId::from_u128(2), 1, 1, cfg(2, 2), 1, now);
    w.handle_candidates(cands.clone(), now);
    let mk = |run_hash, restart| Roster {
        run_hash,
        restart,
        epoch: 1,
        master_port: 1,
        members: cands
            .iter()
            .map(|c| RosterMember { id: c.id, addr: c.addr, nproc: c.nproc, hostname: String::new() })
            .collect(),
    };
    w.handle_message(NodeId::from_u128(1), Message::Propose(mk(2, 1)), now);
    w.handle_message(NodeId::from_u128(1), Message::Propose(mk(1, 0)), now);
    assert!(w.poll_transmit().is_none());
    w.handle_message(NodeId::from_u128(1), Message::Propose(mk(1, 1)), now);
    assert!(matches!(w.poll_transmit(), Some((_, Message::Ack { restart: 1, epoch: 1 }))));
}

/// Issue 21: with MIN present and the settle time passed, a node that is not the proposer
/// kept returning the passed settle deadline from `poll_timeout`, and its driver spun on it
/// (a core's worth of CPU, and inputs never read, so the proposal never arrived). A
/// deadline fires once and is cleared: `poll_timeout` is always later than the last `now`.
#[test]
fn a_passed_deadline_fires_once_and_min_max_commits_with_three_of_four() {
    let t0 = Instant::now();
    let cands = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2"), cand(3, "198.19.0.3")];
    let mut nodes: Vec<_> = cands.iter().map(|c| Rendezvous::new(c.id, 1, 0, cfg(2, 4), 1, t0)).collect();
    for n in nodes.iter_mut() {
        n.handle_candidates(cands.clone(), t0);
    }
    // A driver that sleeps until each core's deadline and hands it `now` then.
    let mut now = t0;
    let mut commits = vec![None; 3];
    for _ in 0..20 {
        let next = nodes.iter().filter_map(Rendezvous::poll_timeout).min();
        let Some(next) = next else { break };
        assert!(next > now, "a deadline at or before the last `now` would spin its driver");
        now = next;
        for n in nodes.iter_mut() {
            if n.poll_timeout().is_some_and(|d| d <= now) {
                n.handle_timeout(now);
                assert!(n.poll_timeout().is_none_or(|d| d > now), "passed deadline returned again");
            }
        }
        for (i, c) in pump(&mut nodes, &cands, now).into_iter().enumerate() {
            if c.is_some() {
                commits[i] = c;
            }
        }
    }
    assert!(
        commits.iter().all(|c| c.as_ref().map(|r| r.members.len()) == Some(3)),
        "every node commits the 3-node roster: {commits:?}"
    );
    // Settled and committed: nothing left to wait for.
    assert!(nodes.iter().all(|n| n.poll_timeout().is_none()));
}

#[test]
fn a_settled_non_proposer_has_no_deadline_until_candidates_change() {
    let t0 = Instant::now();
    let cands = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2"), cand(3, "198.19.0.3")];
    let mut r = Rendezvous::new(NodeId::from_u128(2), 1, 0, cfg(2, 4), 1, t0);
    r.handle_candidates(cands.clone(), t0);
    let settle = r.poll_timeout().expect("settle deadline");
    r.handle_timeout(settle);
    assert_eq!(r.poll_timeout(), None, "the settle deadline fired; node 2 waits for node 1's proposal");
    // Handled late (the driver was busy): still fires once.
    let mut late = Rendezvous::new(NodeId::from_u128(2), 1, 0, cfg(2, 4), 1, t0);
    late.handle_candidates(cands.clone(), t0);
    late.handle_message(NodeId::from_u128(9), Message::Done { restart: 0 }, t0 + Duration::from_secs(60));
    assert_eq!(late.poll_timeout(), None);
    // A newcomer restarts the settle clock: a new deadline, in the future.
    let t1 = settle + Duration::from_secs(1);
    let mut more = cands;
    more.push(cand(4, "198.19.0.4"));
    r.handle_candidates(more[..3].to_vec(), t1);
    assert_eq!(r.poll_timeout(), None, "no change, no deadline");
    // Node 3 leaves and node 5 arrives: another set, so the clock restarts.
    let other = vec![more[0].clone(), more[1].clone(), cand(5, "198.19.0.5")];
    r.handle_candidates(other, t1);
    assert_eq!(r.poll_timeout(), Some(t1 + Duration::from_secs(2)));
}

/// Issue 16: a roster whose process counts overflow is never proposed nor acknowledged,
/// and a node refuses a roster that gives it another process count than its own.
#[test]
fn overflowing_or_misdescribing_rosters_are_refused_naming_the_node() {
    let now = Instant::now();
    let mut huge = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2")];
    huge[1].nproc = u32::MAX;
    let mut m = Rendezvous::new(NodeId::from_u128(1), 1, 0, cfg(2, 2), 1, now);
    m.handle_candidates(huge.clone(), now);
    assert!(m.poll_transmit().is_none(), "no proposal that overflows");
    let Some(RdzvEvent::Refused(why)) = m.poll_event() else { panic!("no refusal") };
    assert!(why.contains("198.19.0.2:29400") && why.contains(&u32::MAX.to_string()), "{why}");

    // A member is told it starts 64 processes; it advertises 2.
    let cands = vec![cand(1, "198.19.0.1"), cand(2, "198.19.0.2")];
    let mut w = Rendezvous::new(NodeId::from_u128(2), 1, 0, cfg(2, 2), 1, now);
    w.handle_candidates(cands.clone(), now);
    let mut members: Vec<RosterMember> = cands
        .iter()
        .map(|c| RosterMember { id: c.id, addr: c.addr, nproc: c.nproc, hostname: String::new() })
        .collect();
    members[1].nproc = 64;
    let roster = Roster { run_hash: 1, restart: 0, epoch: 1, master_port: 1, members: members.clone() };
    w.handle_message(NodeId::from_u128(1), Message::Propose(roster), now);
    assert!(w.poll_transmit().is_none(), "no ack for a roster that misdescribes this node");
    let Some(RdzvEvent::Refused(why)) = w.poll_event() else { panic!("no refusal") };
    assert!(why.contains("64 processes") && why.contains("starts 2"), "{why}");
    // Overflow in a proposal from the right master.
    members[1].nproc = 2;
    members[0].nproc = u32::MAX;
    let roster = Roster { run_hash: 1, restart: 0, epoch: 2, master_port: 1, members };
    w.handle_message(NodeId::from_u128(1), Message::Propose(roster.clone()), now);
    assert!(w.poll_transmit().is_none());
    assert_eq!(roster.world_size(), u32::MAX, "saturates instead of wrapping");
    assert_eq!(roster.first_global_rank(2), u32::MAX);
}
