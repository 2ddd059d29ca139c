//! Single-node checks of the core's requests and answers; the multi-node protocol is
//! tested in the simulator (`sim::node`).

use super::*;
use crate::membership::MembershipConfig;
use crate::rendezvous::RdzvConfig;

fn config(max_restarts: u32) -> NodeConfig {
    let addr: SocketAddr = "10.0.0.1:29400".parse().expect("address");
    NodeConfig {
        id: NodeId::from_u128(7),
        addr,
        meta: NodeMeta { hostname: "solo".into(), nproc: 2, run_hash: 42, ..NodeMeta::default() },
        seeds: vec![addr],
        membership: MembershipConfig::default(),
        rdzv: RdzvConfig { min_nodes: 1, max_nodes: 1, ..RdzvConfig::default() },
        rdzv_timeout: Duration::from_secs(30),
        preflight_timeout: Duration::from_secs(20),
        max_restarts,
        report: LocalFacts { nproc: 2, iface: "lo".into(), ..LocalFacts::default() },
        seed: 1,
        timing: Timing::default(),
        store: crate::store::StoreConfig::default(),
        fault_tolerance: Default::default(),
        lighthouse: Default::default(),
    }
}

/// The node's events but membership and log lines; a round's MASTER_PORT is answered on
/// the way (as the actor does).
fn events(n: &mut Node) -> Vec<Event> {
    let mut out = Vec::new();
    while let Some(e) = n.poll_event() {
        match e {
            Event::Member(_) | Event::Log(..) => {}
            Event::RoundBegan { restart } => {
                n.handle(Input::MasterPort { round: restart, port: 29500 }, Instant::now())
            }
            e => out.push(e),
        }
    }
    out
}

/// Runs a single node up to its launch; returns it and the time.
fn launched(max_restarts: u32) -> (Node, Instant) {
    let now = Instant::now();
    let mut n = Node::new(config(max_restarts), now);
    let ev = events(&mut n);
    assert!(
        matches!(&ev[..], [Event::RosterAgreed(_), Event::StartPreflight { master: true, .. }]),
        "{ev:?}"
    );
    n.handle(
        Input::PreflightReady {
            round: 0,
            tcp_port: 4000,
            nccl_id: None,
            nccl_note: Some("no nccl".into()),
            problems: vec![],
        },
        now,
    );
    let ev = events(&mut n);
    assert!(matches!(&ev[..], [Event::Dial { targets, .. }] if targets.is_empty()), "{ev:?}");
    n.handle(Input::Dialed { round: 0, probes: vec![], nccl_root: None }, now);
    let ev = events(&mut n);
    assert!(matches!(&ev[..], [Event::Preflight(_), Event::Launch { verdict, .. }] if verdict.ok), "{ev:?}");
    n.handle(Input::RanksSpawned, now);
    assert_eq!(n.meta().state, NodeState::Running);
    (n, now)
}

#[test]
fn one_node_runs_to_success() {
    let (mut n, now) = launched(0);
    n.handle(Input::RanksExited, now);
    let ev = events(&mut n);
    match &ev[..] {
        [Event::Finished(o)] => {
            assert_eq!((o.code, o.kind.clone()), (0, OutcomeKind::Success));
            assert_eq!(o.message, "job finished: all 2 ranks exited 0");
        }
        other => panic!("{other:?}"),
    }
    assert!(n.is_finished());
}

#[test]
fn a_failed_rank_restarts_the_round_then_fails_with_its_status() {
    let (mut n, now) = launched(1);
    let cause = RankFailure { status: 3, ..RankFailure::default() };
    n.handle(
        Input::RankFailed { rank: Some(1), reason: "rank 1 exited 3".into(), cause: Some(Box::new(cause)) },
        now,
    );
    assert_eq!(events(&mut n), vec![Event::StopRanks]);
    n.handle(Input::RanksStopped, now);
    let ev = events(&mut n);
    assert!(matches!(&ev[0], Event::RoundFailed { restart: 0, restarting: true, .. }), "{ev:?}");
    assert!(ev.iter().any(|e| matches!(e, Event::StartPreflight { .. })), "round 1 forms again: {ev:?}");
    assert_eq!(n.restart(), 1);
    n.handle(
        Input::PreflightReady { round: 1, tcp_port: 4001, nccl_id: None, nccl_note: None, problems: vec![] },
        now,
    );
    n.handle(Input::Dialed { round: 1, probes: vec![], nccl_root: None }, now);
    n.handle(Input::RanksSpawned, now);
    let _ = events(&mut n);
    n.handle(
        Input::RankFailed {
            rank: Some(0),
            reason: "rank 0 exited 3".into(),
            cause: Some(Box::new(RankFailure { status: 3, ..RankFailure::default() })),
        },
        now,
    );
    n.handle(Input::RanksStopped, now);
    let fin =
        events(&mut n).into_iter().find_map(|e| if let Event::Finished(o) = e { Some(o) } else { None });
    let o = fin.expect("finished after the last restart");
    assert_eq!((o.code, o.message.as_str()), (3, "job failed: rank 0 exited 3"));
}

#[test]
fn a_stop_while_waiting_ends_at_once_with_its_status() {
    let now = Instant::now();
    let mut cfg = config(0);
    cfg.rdzv = RdzvConfig { min_nodes: 2, max_nodes: 2, ..RdzvConfig::default() };
    let mut n = Node::new(cfg, now);
    let _ = events(&mut n);
    n.handle(Input::Stop { what: "interrupted (SIGINT)".into(), code: 130 }, now);
    let ev = events(&mut n);
    match &ev[..] {
        [Event::Finished(o)] => {
            assert_eq!((o.code, o.message.as_str()), (130, "interrupted (SIGINT) while waiting for nodes"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_lone_node_of_two_times_out_with_a_report() {
    let start = Instant::now();
    let mut cfg = config(0);
    cfg.rdzv = RdzvConfig { min_nodes: 2, max_nodes: 2, ..RdzvConfig::default() };
    cfg.rdzv_timeout = Duration::from_secs(5);
    let mut n = Node::new(cfg, start);
    let mut lines = Vec::new();
    let mut fin = None;
    // The core is driven by its own deadlines only; it must end by the timeout.
    for _ in 0..10_000 {
        let Some(t) = n.poll_timeout() else { break };
        n.handle_timeout(t);
        for e in std::iter::from_fn(|| n.poll_event()) {
            match e {
                Event::Waiting(r) => lines.push(r.progress_line(&[], &[])),
                Event::Finished(o) => fin = Some((t, o)),
                _ => {}
            }
        }
        if fin.is_some() {
            break;
        }
    }
    let (at, o) = fin.expect("timed out");
    assert_eq!(at.duration_since(start), Duration::from_secs(5));
    assert!(
        o.message.starts_with("rendezvous timed out after 5s: 1 of 2 nodes present (10.0.0.1 (this node))"),
        "{}",
        o.message
    );
    assert!(matches!(o.kind, OutcomeKind::TimedOut(_)));
    assert_eq!(lines.first().map(String::as_str), Some("waiting for nodes: 1/2 present"));
    assert_eq!(lines.len(), 1, "at 2 s, not again before 7 s: {lines:?}");
}

/// Issue 29: store frames reach the IO's store only from this round's roster members (from
/// their roster addresses, for this round): a stranger's, or one claiming this node's own
/// id, fills nothing, before the roster or after the launch.
#[test]
fn store_frames_from_outside_the_roster_are_dropped() {
    let set = |restart| crate::wire::StoreMsg::Set {
        restart,
        key: "k".into(),
        value: vec![0; 1 << 20],
        version: crate::store::Version { counter: 1, writer: NodeId::from_u128(9) },
    };
    let stranger: SocketAddr = "10.0.0.9:29400".parse().expect("address");
    let now = Instant::now();
    let mut early = Node::new(config(0), now);
    let frame = |node, restart| Input::Frame { from: stranger, node, frame: Frame::Store(set(restart)) };
    early.handle(frame(NodeId::from_u128(9), 0), now);
    let (mut n, now) = launched(0);
    for f in [frame(NodeId::from_u128(9), 0), frame(NodeId::from_u128(7), 0), frame(NodeId::from_u128(9), 1)]
    {
        n.handle(f, now);
    }
    for node in [&mut early, &mut n] {
        let stored: Vec<Event> =
            events(node).into_iter().filter(|e| matches!(e, Event::StoreReply { .. })).collect();
        assert!(stored.is_empty(), "{stored:?}");
    }
}

/// Issue 31: a library program's finish is an input of its own, not a faked pair of
/// rank events: said before the launch, the round counts as done as soon as it runs.
#[test]
fn a_finish_before_the_launch_ends_the_round_when_it_runs() {
    let now = Instant::now();
    let mut n = Node::new(config(0), now);
    n.handle(Input::Finish, now);
    let _ = events(&mut n);
    n.handle(
        Input::PreflightReady { round: 0, tcp_port: 4000, nccl_id: None, nccl_note: None, problems: vec![] },
        now,
    );
    n.handle(Input::Dialed { round: 0, probes: vec![], nccl_root: None }, now);
    assert!(events(&mut n).iter().any(|e| matches!(e, Event::Launch { .. })));
    n.handle(Input::RanksSpawned, now);
    let ev = events(&mut n);
    assert!(matches!(&ev[..], [Event::Finished(o)] if o.code == 0), "{ev:?}");
}

/// Issue 31: an IO answer carries the round that asked, and the core (not the driver) drops
/// one of an earlier round: a late bind failure or dial result of round 0 changes nothing
/// in round 1.
#[test]
fn an_io_answer_of_an_earlier_round_is_dropped() {
    let (mut n, now) = launched(1);
    n.handle(Input::RankFailed { rank: Some(0), reason: "rank 0 exited 3".into(), cause: None }, now);
    n.handle(Input::RanksStopped, now);
    let ev = events(&mut n);
    assert!(
        ev.iter().any(|e| matches!(e, Event::StartPreflight { roster, .. } if roster.restart == 1)),
        "{ev:?}"
    );
    // Round 0's answers, late: dropped.
    n.handle(Input::PreflightFailed { round: 0, why: "preflight listener: gone".into() }, now);
    n.handle(Input::Dialed { round: 0, probes: vec![], nccl_root: None }, now);
    assert_eq!(events(&mut n), vec![], "a stale answer is no input of round 1");
    // Round 1's own answers run it.
    n.handle(
        Input::PreflightReady { round: 1, tcp_port: 4001, nccl_id: None, nccl_note: None, problems: vec![] },
        now,
    );
    assert!(matches!(&events(&mut n)[..], [Event::Dial { round: 1, .. }]));
    n.handle(Input::Dialed { round: 1, probes: vec![], nccl_root: None }, now);
    let ev = events(&mut n);
    assert!(matches!(&ev[..], [Event::Preflight(_), Event::Launch { verdict, .. }] if verdict.ok), "{ev:?}");
}

/// Issue 31: one MASTER_PORT path. Every round, round 0 included, asks the IO for its port
/// (`RoundBegan`) and proposes no roster before the answer; the roster carries that port.
#[test]
fn every_round_asks_for_its_master_port_and_proposes_nothing_before() {
    let now = Instant::now();
    let mut n = Node::new(config(0), now);
    let ev: Vec<Event> = std::iter::from_fn(|| n.poll_event())
        .filter(|e| !matches!(e, Event::Member(_) | Event::Log(..)))
        .collect();
    assert_eq!(ev, vec![Event::RoundBegan { restart: 0 }]);
    n.handle_timeout(now + std::time::Duration::from_millis(500));
    assert!(n.poll_transmit().is_none() && n.roster().is_none(), "no roster without a port");
    // An answer for another round changes nothing.
    n.handle(Input::MasterPort { round: 3, port: 1 }, now);
    assert!(n.roster().is_none());
    n.handle(Input::MasterPort { round: 0, port: 29555 }, now);
    match &events(&mut n)[..] {
        [Event::RosterAgreed(r), Event::StartPreflight { .. }] => assert_eq!(r.master_port, 29555),
        other => panic!("{other:?}"),
    }
}
