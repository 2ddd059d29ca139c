//! `--fault-tolerance node` on whole simulated nodes: a failure stops no more than its own
//! replica group, a lost node is dropped, a replacement joins the running job in the lost
//! node's slot, and too few groups stop the job everywhere (several seeds each).

use super::*;
use crate::node::{FaultTolerance, OutcomeKind};

const SEEDS: std::ops::Range<u64> = 1..9;

fn ft(n: usize, min: u32, seed: u64, ranks: Duration) -> NodeSimConfig {
    NodeSimConfig {
        nodes: n,
        seed,
        rdzv: RdzvConfig { min_nodes: min, max_nodes: n as u32, ..RdzvConfig::default() },
        max_restarts: 2,
        ranks: Ranks::Exit0(ranks),
        fault_tolerance: FaultTolerance::Node,
        ..NodeSimConfig::default()
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// Starts every node and waits until each launched once.
fn launched(s: &mut NodeSim) -> Duration {
    let n = s.len();
    s.start_all();
    let t = s.run_until(secs(30.0), |s| s.launches().len() >= n);
    assert!(t.is_some(), "seed {}: the job did not launch: {:?}", s.seed(), s.launches());
    s.run_for(secs(0.1));
    s.now()
}

fn failure(i: usize) -> Input {
    let cause = RankFailure { status: 3, host: format!("gpu-node-{i:04}"), ..RankFailure::default() };
    Input::RankFailed {
        rank: Some(0),
        reason: format!("rank 0 on node {i} exited 3"),
        cause: Some(Box::new(cause)),
    }
}

#[test]
fn a_failed_rank_restarts_its_own_node_only() {
    for seed in SEEDS {
        let mut s = NodeSim::new(ft(3, 2, seed, secs(10.0)));
        launched(&mut s);
        s.input(1, failure(1));
        s.run_until(secs(60.0), |s| s.all_ended()).expect("the job ends");
        let stops: Vec<usize> = s.stops().iter().map(|x| x.node).collect();
        assert_eq!(stops, vec![1], "seed {seed}: only node 1 stops its ranks");
        let per_node = |i| s.launches().iter().filter(|l| l.node == i).count();
        assert_eq!((per_node(0), per_node(1), per_node(2)), (1, 2, 1), "seed {seed}: {:?}", s.launches());
        for e in s.outcomes() {
            assert_eq!(e.outcome.code, 0, "seed {seed}: node {} {:?}", e.node, e.outcome);
        }
        assert_eq!(s.outcomes().len(), 3, "seed {seed}");
        // Nodes that finished were not lost groups: nobody cut connections.
        assert!((0..3).all(|i| s.groups_lost(i).is_empty()), "seed {seed}");
    }
}

#[test]
fn a_node_out_of_restarts_leaves_and_the_others_finish() {
    for seed in SEEDS {
        let mut cfg = ft(3, 2, seed, secs(10.0));
        cfg.max_restarts = 0;
        let mut s = NodeSim::new(cfg);
        launched(&mut s);
        s.input(2, failure(2));
        s.run_until(secs(60.0), |s| s.all_ended()).expect("the job ends");
        let code = |i| s.outcomes().iter().find(|e| e.node == i).map(|e| e.outcome.code);
        assert_eq!(
            (code(0), code(1), code(2)),
            (Some(0), Some(0), Some(3)),
            "seed {seed}: {:?}",
            s.outcomes()
        );
        assert_eq!(s.stops().iter().map(|x| x.node).collect::<Vec<_>>(), vec![2], "seed {seed}");
    }
}

#[test]
fn a_dead_node_is_dropped_and_the_others_train_on() {
    for seed in SEEDS {
        let mut s = NodeSim::new(ft(3, 2, seed, secs(15.0)));
        launched(&mut s);
        s.crash(2);
        s.run_until(secs(60.0), |s| s.outcomes().len() >= 2).expect("the survivors end");
        assert!(s.stops().is_empty(), "seed {seed}: no survivor stopped its ranks: {:?}", s.stops());
        // Each survivor is told once to end its ranks' connections to the dead node.
        for i in 0..2 {
            assert_eq!(s.groups_lost(i), &[node_addr(2)], "seed {seed}: node {i}");
        }
        for e in s.outcomes() {
            assert!(e.node < 2, "seed {seed}");
            assert_eq!((e.outcome.code, &e.outcome.kind), (0, &OutcomeKind::Success), "seed {seed}");
        }
    }
}

#[test]
fn fewer_than_min_groups_stop_the_job_everywhere() {
    for seed in SEEDS {
        let mut s = NodeSim::new(ft(3, 3, seed, secs(30.0)));
        let t0 = launched(&mut s);
        s.crash(0);
        s.run_until(secs(60.0), |s| s.outcomes().len() >= 2).expect("the survivors end");
        let mut stopped: Vec<usize> = s.stops().iter().map(|x| x.node).collect();
        stopped.sort();
        assert_eq!(stopped, vec![1, 2], "seed {seed}");
        for e in s.outcomes() {
            assert_eq!(e.outcome.code, 1, "seed {seed}: {:?}", e.outcome);
            assert!(
                e.outcome.message.contains("replica groups remain"),
                "seed {seed}: {}",
                e.outcome.message
            );
            assert!(e.at - t0 < secs(10.0), "seed {seed}: ended {:?} after the crash", e.at - t0);
        }
    }
}

#[test]
fn a_replacement_joins_the_running_job_in_the_lost_nodes_slot() {
    for seed in SEEDS {
        let mut s = NodeSim::new(ft(3, 2, seed, secs(20.0)));
        launched(&mut s);
        let lost = 1;
        let slot = s.launches().iter().find(|l| l.node == lost).and_then(|l| l.roster.node_rank(l.id));
        s.crash(lost);
        // Declared dead, then a new process (new id) at the same address.
        s.run_for(secs(6.0));
        s.restart(lost);
        let joined = s.run_until(secs(20.0), |s| s.launches().iter().filter(|l| l.node == lost).count() >= 2);
        assert!(joined.is_some(), "seed {seed}: the replacement did not launch: {:?}", s.launches());
        let l = s.launches().iter().rfind(|l| l.node == lost).expect("launch");
        assert_eq!(
            l.roster.node_rank(l.id),
            slot,
            "seed {seed}: it takes the lost node's slot: {:?}",
            l.roster
        );
        assert_eq!(l.roster.members.len(), 3, "seed {seed}");
        // The survivors were told of the joiner (their tunnels let it in).
        for i in (0..3).filter(|i| *i != lost) {
            let told = s.rosters_changed(i).iter().any(|r| r.members.iter().any(|m| m.id == l.id));
            assert!(told, "seed {seed}: node {i} was told the new roster: {:?}", s.rosters_changed(i));
        }
        s.run_until(secs(60.0), |s| s.all_ended()).expect("the job ends");
        assert!(s.stops().is_empty(), "seed {seed}: nobody stopped: {:?}", s.stops());
        assert_eq!(s.outcomes().len(), 3, "seed {seed}");
        for e in s.outcomes() {
            assert_eq!(e.outcome.code, 0, "seed {seed}: node {} {:?}", e.node, e.outcome);
        }
    }
}

/// The lighthouse under faults: every node's "ranks" ask a quorum per step and heartbeat;
/// returns every answer as (node, step, quorum) after checking that each step's live
/// askers were answered within `limit` of asking.
struct Steps {
    answers: Vec<(usize, u64, crate::lighthouse::Quorum)>,
}

fn member(i: usize, life: u64, step: u64) -> crate::lighthouse::Member {
    crate::lighthouse::Member {
        replica_id: format!("group{i}:{life}"),
        address: format!("http://10.0.{i}.1:5000"),
        store_address: format!("10.0.{i}.1:6000"),
        step: step as i64,
        world_size: 2,
        ..Default::default()
    }
}

/// A node's request ids grow, as meshd's actor numbers them (the decider takes a smaller one
/// for a stale resend): step `step`'s first request, then its `k`-th again.
fn req_of(step: u64, k: u64) -> u64 {
    step * 1000 + k
}

fn step_of(req: u64) -> u64 {
    req / 1000
}

/// Runs `steps` quorum steps on the nodes still running; `fault(s, step, mid)` is called
/// before each step's requests (`mid` false) and right after they went out (`mid` true: in
/// the middle of the quorum).
fn quorum_steps(s: &mut NodeSim, steps: u64, mut fault: impl FnMut(&mut NodeSim, u64, bool)) -> Steps {
    let mut answers = Vec::new();
    // Managers heartbeat from their start, before their first quorum request.
    for _ in 0..5 {
        let live: Vec<usize> = (0..s.len()).filter(|&i| s.is_running(i)).collect();
        for i in live {
            s.input(i, Input::LhHeartbeat { replica_id: member(i, 1, 0).replica_id });
        }
        s.run_for(secs(0.1));
    }
    for step in 0..steps {
        fault(s, step, false);
        let live: Vec<usize> = (0..s.len()).filter(|&i| s.is_running(i)).collect();
        let seen: Vec<usize> = (0..s.len()).map(|i| s.lh_answers(i).len()).collect();
        for &i in &live {
            s.input(i, Input::LhQuorum { req: req_of(step, 0), member: member(i, 1, step) });
        }
        fault(s, step, true);
        let t0 = s.now();
        let answered =
            |s: &NodeSim, i: usize| s.lh_answers(i)[seen[i]..].iter().any(|a| step_of(a.1) == step);
        let mut again: u64 = 0;
        loop {
            let alive: Vec<usize> = live.iter().copied().filter(|&i| s.is_running(i)).collect();
            if alive.iter().all(|&i| answered(s, i)) {
                break;
            }
            assert!(
                s.now() - t0 < secs(15.0),
                "seed {}: step {step}: no quorum for {:?} within 15 s",
                s.seed(),
                alive.iter().filter(|&&i| !answered(s, i)).collect::<Vec<_>>()
            );
            // Groups that have their quorum go on, as torchft's would (their next step's
            // request): after a partition healed, the other side's groups join with them,
            // not with groups that are waiting no more.
            if s.now() - t0 >= secs(1.5) * (again as u32 + 1) {
                again += 1;
                let going_on: Vec<usize> = alive.iter().copied().filter(|&i| answered(s, i)).collect();
                for i in going_on {
                    s.input(i, Input::LhQuorum { req: req_of(step, again), member: member(i, 1, step) });
                }
            }
            for &i in &alive {
                s.input(i, Input::LhHeartbeat { replica_id: member(i, 1, 0).replica_id });
            }
            s.run_for(secs(0.1));
        }
        for (i, from) in seen.iter().enumerate() {
            for a in &s.lh_answers(i)[*from..] {
                answers.push((i, step_of(a.1), a.2.clone()));
            }
        }
    }
    Steps { answers }
}

/// One participant list per quorum id, and each node's ids increasing (strictly when its
/// participants changed).
fn check_quorums(seed: u64, st: &Steps) {
    let mut by_id: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    for (i, step, q) in &st.answers {
        let ids: Vec<String> = q.participants.iter().map(|m| m.replica_id.clone()).collect();
        let first = by_id.entry(q.quorum_id).or_insert_with(|| ids.clone());
        assert_eq!(
            first, &ids,
            "seed {seed}: quorum {} names two participant lists (node {i}, step {step})",
            q.quorum_id
        );
        assert!(
            q.participants.iter().any(|m| m.replica_id == member(*i, 1, 0).replica_id),
            "seed {seed}: node {i} answered with a quorum without itself"
        );
    }
    for i in 0..8 {
        let mine: Vec<&crate::lighthouse::Quorum> =
            st.answers.iter().filter(|a| a.0 == i).map(|a| &a.2).collect();
        for w in mine.windows(2) {
            assert!(w[1].quorum_id >= w[0].quorum_id, "seed {seed}: node {i}: quorum id went down: {:?}", w);
            let ids = |q: &crate::lighthouse::Quorum| -> Vec<String> {
                q.participants.iter().map(|m| m.replica_id.clone()).collect()
            };
            if ids(w[1]) != ids(w[0]) {
                assert!(w[1].quorum_id > w[0].quorum_id, "seed {seed}: node {i}: new participants, same id");
            }
        }
    }
}

use std::collections::BTreeMap;

fn ft_lh(n: usize, seed: u64, loss: f64) -> NodeSim {
    let mut cfg = ft(n, 2, seed, secs(600.0));
    cfg.loss = loss;
    // meshd gives the lighthouse --nnodes MIN as its min_replicas.
    cfg.lighthouse = crate::lighthouse::LighthouseConfig {
        min_replicas: 2,
        join_timeout: secs(1.0),
        ..Default::default()
    };
    NodeSim::new(cfg)
}

/// The decider's node (first live member in roster order) is the roster's slot 0 at first.
fn decider(s: &NodeSim) -> usize {
    let l = &s.launches()[0];
    let id = l.roster.members[0].id;
    (0..s.len()).find(|&i| s.id(i) == id).expect("decider")
}

#[test]
fn lighthouse_quorums_are_identical_and_ids_increase_when_the_decider_dies_mid_quorum() {
    let only: Option<u64> = std::env::var("MESHD_SIM_SEED").ok().and_then(|s| s.parse().ok());
    for seed in (1..21).filter(|s| only.is_none_or(|o| o == *s)) {
        let mut s = ft_lh(4, seed, 0.0);
        launched(&mut s);
        let d = decider(&s);
        let st = quorum_steps(&mut s, 6, |s, step, mid| {
            if step == 2 && mid {
                s.crash(d);
            }
        });
        check_quorums(seed, &st);
        let last: Vec<&(usize, u64, crate::lighthouse::Quorum)> =
            st.answers.iter().filter(|a| a.1 == 5).collect();
        assert_eq!(last.len(), 3, "seed {seed}: the 3 survivors were answered at the last step");
        assert_eq!(last[0].2.participants.len(), 3, "seed {seed}: the dead group left the quorum");
        let before = st.answers.iter().filter(|a| a.1 == 1).map(|a| a.2.quorum_id).max().unwrap_or(0);
        assert!(last[0].2.quorum_id > before, "seed {seed}: ids grew across the hand-over");
    }
}

/// The decider dies and its replacement (a new node at the same address) takes its slot,
/// the first in roster order: it becomes the decider, and every group, its own included,
/// is answered with the same quorums.
#[test]
fn a_replacement_in_the_deciders_slot_decides_and_is_answered() {
    for seed in 1..21 {
        let mut s = ft_lh(3, seed, 0.0);
        launched(&mut s);
        let d = decider(&s);
        let st = quorum_steps(&mut s, 8, |s, step, mid| {
            if step == 2 && mid {
                s.crash(d);
            }
            if step == 4 && !mid {
                s.restart(d);
                let admitted =
                    s.run_until(secs(20.0), |s| s.launches().iter().filter(|l| l.node == d).count() >= 2);
                assert!(admitted.is_some(), "seed {}: the replacement was not admitted", s.seed());
            }
        });
        check_quorums(seed, &st);
        let last: Vec<&(usize, u64, crate::lighthouse::Quorum)> =
            st.answers.iter().filter(|a| a.1 == 7).collect();
        assert_eq!(last.len(), 3, "seed {seed}: all 3 groups answered at the last step: {last:?}");
        assert!(
            last.iter().all(|a| a.2.participants.len() == 3),
            "seed {seed}: the replacement is in: {last:?}"
        );
    }
}

#[test]
fn lighthouse_quorums_hold_under_datagram_loss_and_a_partition() {
    let only: Option<u64> = std::env::var("MESHD_SIM_SEED").ok().and_then(|s| s.parse().ok());
    for seed in (1..21).filter(|s| only.is_none_or(|o| o == *s)) {
        let mut s = ft_lh(5, seed, 0.05);
        launched(&mut s);
        let st = quorum_steps(&mut s, 6, |s, step, mid| {
            if step == 1 && !mid {
                s.partition(&[vec![0, 1, 2], vec![3, 4]]);
            }
            if step == 3 && !mid {
                s.heal();
            }
        });
        check_quorums(seed, &st);
    }
}

/// Every live node's answer to its request of `step` (asked at `t0`): how long each took.
fn answered_within(s: &NodeSim, from: &[usize], step: u64, t0: Duration) -> Vec<(usize, Duration, usize)> {
    from.iter()
        .filter_map(|&i| {
            s.lh_answers(i)
                .iter()
                .find(|a| step_of(a.1) == step)
                .map(|a| (i, a.0 - t0, a.2.participants.len()))
        })
        .collect()
}

/// The roll call: a worker's node dies (SIGKILL: no word from it) between two steps; the
/// survivors' next quorum forms without it well within torchft's 1 s join timeout and
/// before the mesh declares the node dead (a suspicion period, 1-2 s).
#[test]
fn a_dead_groups_node_misses_the_roll_call_and_the_quorum_forms_without_waiting() {
    for seed in 1..21 {
        let mut s = ft_lh(4, seed, 0.0);
        launched(&mut s);
        let d = decider(&s);
        let victim = (0..4).find(|&i| i != d).expect("a worker");
        let mut t_ask = Duration::ZERO;
        quorum_steps(&mut s, 4, |s, step, mid| {
            if step == 2 && !mid {
                s.crash(victim);
                t_ask = s.now();
            }
        });
        let survivors: Vec<usize> = (0..4).filter(|&i| i != victim).collect();
        let took = answered_within(&s, &survivors, 2, t_ask);
        assert_eq!(took.len(), 3, "seed {seed}: every survivor answered: {took:?}");
        for (i, t, n) in &took {
            assert_eq!(*n, 3, "seed {seed}: node {i}: the dead group left the quorum");
            assert!(*t < secs(0.7), "seed {seed}: node {i} waited {t:?} for a quorum without the dead group");
        }
    }
}

/// The roll call leaves out no live group: a group whose ranks ask half a second after the
/// others (a slower step) has a meshd that answers, and the quorum waits for it as torchft's
/// join timeout says.
#[test]
fn a_slow_but_live_group_answers_the_roll_call_and_is_in_the_quorum() {
    for seed in 1..21 {
        let mut s = ft_lh(4, seed, 0.0);
        launched(&mut s);
        quorum_steps(&mut s, 2, |_, _, _| {});
        let slow = 3;
        for i in 0..3 {
            s.input(i, Input::LhQuorum { req: req_of(2, 0), member: member(i, 1, 2) });
        }
        for _ in 0..5 {
            for i in 0..4 {
                s.input(i, Input::LhHeartbeat { replica_id: member(i, 1, 0).replica_id });
            }
            s.run_for(secs(0.1));
        }
        s.input(slow, Input::LhQuorum { req: req_of(2, 0), member: member(slow, 1, 2) });
        s.run_for(secs(2.0));
        for i in 0..4 {
            let a = s.lh_answers(i).iter().find(|a| step_of(a.1) == 2);
            let n = a.map(|a| a.2.participants.len());
            assert_eq!(n, Some(4), "seed {seed}: node {i}: all 4 groups in the quorum: {a:?}");
        }
    }
}
