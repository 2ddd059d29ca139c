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
        s.run_until(secs(60.0), |s| s.all_ended()).expect("the job ends");
        assert!(s.stops().is_empty(), "seed {seed}: nobody stopped: {:?}", s.stops());
        assert_eq!(s.outcomes().len(), 3, "seed {seed}");
        for e in s.outcomes() {
            assert_eq!(e.outcome.code, 0, "seed {seed}: node {} {:?}", e.node, e.outcome);
        }
    }
}
