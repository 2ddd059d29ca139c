use super::*;

fn sim(nodes: usize, seed: u64, loss: f64) -> Sim {
    Sim::new(SimConfig { nodes, seed, loss, ..SimConfig::default() })
}

/// Starts all nodes and waits until everyone sees everyone alive.
fn converge(s: &mut Sim, limit: Duration) -> Duration {
    s.start_all();
    let t = s.run_until(limit, Sim::converged);
    match t {
        Some(t) => t,
        None => panic!("sim seed {}: {} nodes did not converge within {limit:?}", s.seed(), s.len()),
    }
}

#[test]
fn eight_nodes_converge() {
    let mut s = sim(8, 11, 0.0);
    let t = converge(&mut s, Duration::from_secs(5));
    assert!(t <= Duration::from_secs(1), "sim seed {}: {t:?}", s.seed());
    assert_eq!(s.false_verdicts(), 0, "sim seed {}", s.seed());
}

#[test]
fn sixty_four_nodes_converge() {
    let mut s = sim(64, 12, 0.0);
    let t = converge(&mut s, Duration::from_secs(10));
    assert!(t <= Duration::from_secs(2), "sim seed {}: {t:?}", s.seed());
}

#[test]
fn crashed_node_is_declared_dead_by_all() {
    let mut s = sim(32, 13, 0.0);
    converge(&mut s, Duration::from_secs(10));
    let victim = s.id(5);
    s.crash(5);
    let t = s.run_until(Duration::from_secs(20), |s| s.all_see_gone(victim));
    assert!(t.is_some(), "sim seed {}: crash not detected", s.seed());
    let downs = s.verdicts().iter().filter(|v| v.subject == victim).count();
    assert_eq!(downs, 31, "sim seed {}: every other node says Down once", s.seed());
    assert_eq!(s.false_verdicts(), 0, "sim seed {}", s.seed());
}

#[test]
fn no_false_verdicts_under_ten_percent_loss() {
    let mut s = sim(64, 14, 0.10);
    converge(&mut s, Duration::from_secs(20));
    s.run_for(Duration::from_secs(30));
    assert_eq!(s.false_verdicts(), 0, "sim seed {}: {:?}", s.seed(), s.verdicts());
    assert!(s.converged(), "sim seed {}", s.seed());
}

#[test]
fn partition_heals() {
    let mut s = sim(16, 15, 0.0);
    converge(&mut s, Duration::from_secs(10));
    let a: Vec<usize> = (0..8).collect();
    let b: Vec<usize> = (8..16).collect();
    s.partition(&[a, b]);
    let (x, y) = (s.id(1), s.id(9));
    let split = s.run_until(Duration::from_secs(30), |s| {
        s.core(1).and_then(|c| c.status(y)) == Some(MemberStatus::Dead)
            && s.core(9).and_then(|c| c.status(x)) == Some(MemberStatus::Dead)
    });
    assert!(split.is_some(), "sim seed {}: sides never split", s.seed());
    s.heal();
    let t = s.run_until(Duration::from_secs(60), Sim::converged);
    assert!(t.is_some(), "sim seed {}: partition never healed", s.seed());
}

#[test]
fn restarted_node_rejoins() {
    let mut s = sim(16, 16, 0.0);
    converge(&mut s, Duration::from_secs(10));
    let old = s.id(3);
    s.restart(3);
    let t = s.run_until(Duration::from_secs(30), |s| s.converged() && s.all_see_gone(old));
    assert!(t.is_some(), "sim seed {}: restarted node did not rejoin", s.seed());
    assert_eq!(s.false_verdicts(), 0, "sim seed {}", s.seed());
}

#[test]
fn restarted_seed_rejoins() {
    let mut s = sim(8, 17, 0.0);
    converge(&mut s, Duration::from_secs(10));
    s.restart(0);
    let t = s.run_until(Duration::from_secs(30), Sim::converged);
    assert!(t.is_some(), "sim seed {}: restarted seed did not rejoin", s.seed());
}

#[test]
fn same_seed_same_run() {
    let run = |seed| {
        let mut s = sim(8, seed, 0.1);
        s.start_all();
        s.run_for(Duration::from_secs(3));
        (s.stats(), s.events_processed())
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}

#[test]
#[ignore = "slow in debug builds; run with --release -- --ignored"]
fn thousand_nodes_converge_and_detect() {
    let mut s = sim(1000, 18, 0.0);
    converge(&mut s, Duration::from_secs(20));
    let victim = s.id(500);
    s.crash(500);
    let t = s.run_until(Duration::from_secs(30), |s| s.all_see_gone(victim));
    assert!(t.is_some(), "sim seed {}: crash not detected", s.seed());
    assert_eq!(s.false_verdicts(), 0, "sim seed {}", s.seed());
}
