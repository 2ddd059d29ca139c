//! torchft's own lighthouse tests (src/lighthouse.rs), ported to the sans-IO core, and the
//! quorum-id rule across deciders.

use super::*;

fn cfg(min_replicas: u64, join_timeout: Duration) -> LighthouseConfig {
    LighthouseConfig {
        min_replicas,
        join_timeout,
        heartbeat_timeout: Duration::from_secs(5),
        quorum_tick: Duration::from_millis(10),
        tag: DeciderTag::default(),
    }
}

fn member(id: &str) -> Member {
    Member { replica_id: id.to_string(), step: 1, world_size: 1, ..Member::default() }
}

/// Puts `id` among the participants (joined at `t`) without ticking, as torchft's tests
/// fill `State` by hand.
fn join(lh: &mut Lighthouse, id: &str, t: Instant) {
    lh.participants.insert(id.to_string(), Participant { joined: t, member: member(id) });
}

fn beat(lh: &mut Lighthouse, id: &str, t: Instant) {
    lh.heartbeats.insert(id.to_string(), t);
}

fn prev(lh: &mut Lighthouse, ids: &[&str]) {
    lh.prev_quorum = Some(Quorum { quorum_id: 1, participants: ids.iter().map(|i| member(i)).collect() });
}

/// Drains the outputs: the issued quorums with their answers.
fn quorums(lh: &mut Lighthouse) -> Vec<(Quorum, Vec<RequestId>)> {
    let mut v = Vec::new();
    while let Some(o) = lh.poll_output() {
        if let Output::Quorum { quorum, answers } = o {
            v.push((quorum, answers));
        }
    }
    v
}

fn ids(q: &Quorum) -> Vec<&str> {
    q.participants.iter().map(|p| p.replica_id.as_str()).collect()
}

#[test]
fn join_timeout() {
    let mut lh = Lighthouse::new(cfg(1, Duration::from_secs(3600)));
    let now = Instant::now();
    let d = lh.compute(now);
    assert!(d.participants.is_none(), "{}", d.reason);
    assert!(
        d.reason.contains(
            "New quorum not ready, only have 0 participants, need min_replicas 1 [0/0 participants healthy]"
        ),
        "{}",
        d.reason
    );
    for id in ["a", "b"] {
        join(&mut lh, id, now);
        beat(&mut lh, id, now);
    }
    // Every healthy replica participates.
    let d = lh.compute(now);
    assert!(d.participants.is_some(), "{}", d.reason);
    // A healthy replica that does not participate: wait for it.
    beat(&mut lh, "c", now);
    let d = lh.compute(now);
    assert!(d.participants.is_none(), "{}", d.reason);
    assert!(d.reason.contains("join timeout"), "{}", d.reason);
    // Past the join timeout, counted from the earliest participant.
    lh.participants.get_mut("a").expect("a").joined = now - Duration::from_secs(10 * 3600);
    let d = lh.compute(now);
    assert!(d.participants.is_some(), "{}", d.reason);
}

#[test]
fn heartbeats_expire() {
    let mut lh = Lighthouse::new(cfg(1, Duration::from_secs(3600)));
    let now = Instant::now();
    join(&mut lh, "a", now);
    beat(&mut lh, "a", now);
    let d = lh.compute(now);
    assert!(d.participants.is_some(), "{}", d.reason);
    assert!(d.reason.contains("[1/1 participants healthy][1 heartbeating]"), "{}", d.reason);
    // Expired heartbeat: not healthy.
    beat(&mut lh, "a", now - Duration::from_secs(10));
    let d = lh.compute(now);
    assert!(d.participants.is_none(), "{}", d.reason);
    assert!(d.reason.contains("[0/1 participants healthy][0 heartbeating]"), "{}", d.reason);
    // A healthy second participant: a quorum of it alone.
    join(&mut lh, "b", now);
    beat(&mut lh, "b", now);
    let d = lh.compute(now);
    let p = d.participants.expect("quorum");
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].replica_id, "b");
}

#[test]
fn fast_quorum_from_previous() {
    let mut lh = Lighthouse::new(cfg(1, Duration::from_secs(3600)));
    let now = Instant::now();
    assert!(lh.compute(now).participants.is_none());
    join(&mut lh, "a", now);
    beat(&mut lh, "a", now);
    beat(&mut lh, "b", now);
    // 1 of 2 healthy is not more than half.
    let d = lh.compute(now);
    assert!(d.participants.is_none(), "{}", d.reason);
    assert!(d.reason.contains("need at least half"), "{}", d.reason);
    // Every member of the previous quorum joined: fast quorum, half rule skipped.
    prev(&mut lh, &["a"]);
    let d = lh.compute(now);
    assert!(d.participants.is_some(), "{}", d.reason);
    assert!(d.reason.starts_with("Fast quorum found!"), "{}", d.reason);
    // A new participant comes along in a fast quorum.
    join(&mut lh, "b", now);
    let d = lh.compute(now);
    assert_eq!(d.participants.expect("quorum").len(), 2);
}

#[test]
fn fast_quorum_skips_min_replicas() {
    let mut lh = Lighthouse::new(cfg(3, Duration::from_secs(3600)));
    let now = Instant::now();
    join(&mut lh, "a", now);
    beat(&mut lh, "a", now);
    assert!(lh.compute(now).participants.is_none());
    prev(&mut lh, &["a"]);
    assert!(lh.compute(now).participants.is_some());
}

#[test]
fn shrink_only() {
    let mut lh = Lighthouse::new(cfg(1, Duration::from_secs(3600)));
    let now = Instant::now();
    prev(&mut lh, &["a", "b"]);
    join(&mut lh, "a", now);
    lh.participants.get_mut("a").expect("a").member.shrink_only = true;
    beat(&mut lh, "a", now);
    join(&mut lh, "c", now);
    beat(&mut lh, "c", now);
    let d = lh.compute(now);
    assert!(d.reason.contains("[shrink_only=true]"), "{}", d.reason);
    let p = d.participants.expect("quorum");
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].replica_id, "a");
}

#[test]
fn split_brain_half_rule() {
    let mut lh = Lighthouse::new(cfg(1, Duration::from_secs(3600)));
    let now = Instant::now();
    assert!(lh.compute(now).participants.is_none());
    join(&mut lh, "a", now);
    beat(&mut lh, "a", now);
    assert!(lh.compute(now).participants.is_some());
    beat(&mut lh, "b", now);
    let d = lh.compute(now);
    assert!(d.participants.is_none(), "{}", d.reason);
    assert!(
        d.reason.contains(
            "New quorum not ready, only have 1 participants, need at least half of 2 healthy workers \
             [1/1 participants healthy][2 heartbeating]"
        ),
        "{}",
        d.reason
    );
}

#[test]
fn replica_ids_compared_sorted() {
    let a = [member("1")];
    let b = [Member { address: "changed".into(), step: 7, ..member("1") }];
    assert!(same_replica_ids(&a, &b));
    assert!(!same_replica_ids(&a, &[member("2")]));
    assert!(!same_replica_ids(&a, &[member("1"), member("2")]));
}

/// Two requests through the public API, the quorum answers both, sorted by replica_id.
fn round(lh: &mut Lighthouse, now: Instant, first: u64, members: &[Member]) -> (Quorum, Vec<RequestId>) {
    for (i, m) in members.iter().enumerate() {
        lh.handle_quorum_request(now, RequestId(first + i as u64), m.clone()).expect("request");
    }
    let mut qs = quorums(lh);
    assert_eq!(qs.len(), 1, "one quorum: {qs:?}");
    qs.remove(0)
}

#[test]
fn commit_failures_bump_the_id() {
    let mut lh = Lighthouse::new(cfg(2, Duration::from_secs(1)));
    let now = Instant::now();
    for r in 0..2 {
        let (q, answers) = round(&mut lh, now, r * 10, &[member("replica1"), member("replica0")]);
        assert_eq!(q.quorum_id, compose_id(1, DeciderTag::default()));
        assert_eq!(ids(&q), ["replica0", "replica1"]);
        assert_eq!(answers, [RequestId(r * 10), RequestId(r * 10 + 1)]);
    }
    let failing = Member { commit_failures: 2, ..member("replica1") };
    let (q, _) = round(&mut lh, now, 100, &[member("replica0"), failing]);
    assert_eq!(q.quorum_id, compose_id(2, DeciderTag::default()));
    assert_eq!(q.participants[1].commit_failures, 2);
}

#[test]
fn join_during_shrink_requeues_the_joiner() {
    let mut lh = Lighthouse::new(cfg(2, Duration::from_secs(1)));
    let now = Instant::now();
    let m = |id: &str, step: i64, shrink_only: bool| Member { step, shrink_only, ..member(id) };
    let (q1, _) = round(&mut lh, now, 0, &[m("replica0", 1, false), m("replica1", 1, false)]);
    assert_eq!(ids(&q1), ["replica0", "replica1"]);

    // A joiner asks while the others shrink: it is left out and waits (re-queued).
    lh.handle_quorum_request(now, RequestId(10), m("joiner", 1, false)).expect("joiner");
    assert!(quorums(&mut lh).is_empty(), "the joiner alone is not a quorum");
    let (q2, answers) = round(&mut lh, now, 11, &[m("replica0", 2, true), m("replica1", 2, false)]);
    assert_eq!(ids(&q2), ["replica0", "replica1"]);
    assert_eq!(q2.participants[1].step, 2);
    assert_eq!(answers, [RequestId(11), RequestId(12)]);
    assert_eq!(lh.pending_requests(), 1);
    assert!(lh.participants.contains_key("joiner"), "re-queued");

    // Next round without shrink_only: the joiner's first request is answered too.
    let (q3, answers) = round(&mut lh, now, 20, &[m("replica0", 3, false), m("replica1", 3, false)]);
    assert_eq!(ids(&q3), ["joiner", "replica0", "replica1"]);
    assert_eq!(answers, [RequestId(10), RequestId(20), RequestId(21)]);
    assert!(q3.quorum_id > q2.quorum_id);
    assert_eq!(lh.pending_requests(), 0);
}

#[test]
fn join_timeout_through_ticks() {
    let mut lh = Lighthouse::new(cfg(1, Duration::from_millis(500)));
    let t0 = Instant::now();
    lh.handle_heartbeat(t0, "b");
    lh.handle_quorum_request(t0, RequestId(1), member("a")).expect("a");
    lh.handle_quorum_request(t0, RequestId(2), member("d")).expect("d");
    assert!(quorums(&mut lh).is_empty(), "waiting for b");
    let s = lh.status(t0);
    assert!(s.contains("waiting for 1 healthy but not participating stragglers"), "{s}");
    let mut t = t0;
    while t < t0 + Duration::from_millis(490) {
        t = lh.poll_timeout().expect("ticks while requests wait");
        lh.tick(t);
        assert!(quorums(&mut lh).is_empty());
    }
    lh.tick(t0 + Duration::from_millis(500));
    let q = quorums(&mut lh);
    assert_eq!(q.len(), 1);
    assert_eq!(ids(&q[0].0), ["a", "d"]);
}

#[test]
fn replica_gone_is_unhealthy_at_once() {
    let mut lh = Lighthouse::new(cfg(1, Duration::from_secs(3600)));
    let t0 = Instant::now();
    lh.handle_heartbeat(t0, "b");
    lh.handle_quorum_request(t0, RequestId(1), member("a")).expect("a");
    assert!(quorums(&mut lh).is_empty(), "1 of 2 healthy");
    lh.replica_gone(t0, "b");
    let q = quorums(&mut lh);
    assert_eq!(q.len(), 1, "b no longer counts");
    assert_eq!(q[0].1, [RequestId(1)]);
}

#[test]
fn cancelled_requests_are_not_answered_nor_requeued() {
    let mut lh = Lighthouse::new(cfg(2, Duration::from_secs(3600)));
    let t0 = Instant::now();
    lh.handle_quorum_request(t0, RequestId(1), member("a")).expect("a");
    lh.cancel_request(RequestId(1));
    // As in torchft, a stays a participant until the next quorum.
    lh.handle_quorum_request(t0, RequestId(2), member("b")).expect("b");
    let q = quorums(&mut lh);
    assert_eq!(ids(&q[0].0), ["a", "b"]);
    assert_eq!(q[0].1, [RequestId(2)]);
    assert_eq!(lh.pending_requests(), 0);
    assert_eq!(lh.handle_quorum_request(t0, RequestId(3), member("a")), Ok(()));
    assert_eq!(
        lh.handle_quorum_request(t0, RequestId(3), member("a")),
        Err(RequestError::Duplicate(RequestId(3)))
    );
}

#[test]
fn status_is_logged_when_it_changes() {
    let mut lh = Lighthouse::new(cfg(2, Duration::from_secs(3600)));
    let t0 = Instant::now();
    lh.handle_quorum_request(t0, RequestId(1), member("a")).expect("a");
    lh.tick(t0);
    lh.tick(t0);
    let logs: Vec<String> = std::iter::from_fn(|| lh.poll_output())
        .filter_map(|o| if let Output::Log(l) = o { Some(l) } else { None })
        .collect();
    assert_eq!(
        logs,
        ["Quorum status: New quorum not ready, only have 1 participants, need min_replicas 2 \
          [1/1 participants healthy][1 heartbeating][shrink_only=false]"]
    );
}

#[test]
fn tags_and_counters() {
    assert_eq!(DeciderTag::new(1023).map(DeciderTag::get), Some(1023));
    assert_eq!(DeciderTag::new(1024), None);
    assert_eq!(DeciderTag::from_low_bits(0xffff_0401).get(), 1);
    let t = DeciderTag::new(7).expect("tag");
    assert_eq!(compose_id(3, t), 3 * 1024 + 7);
    assert_eq!(id_counter(compose_id(3, t)), 3);
    assert_eq!(id_counter(-1), 0);
}

/// Decider A issues quorums and dies; B observes some of A's ids (not the last ones) and
/// takes over: B's ids are greater than every id it observed, and no id of B equals one of
/// A's, even the ones B never saw.
#[test]
fn ids_unique_and_increasing_across_a_hand_over() {
    let a_cfg = LighthouseConfig { tag: DeciderTag::new(5).expect("tag"), ..cfg(2, Duration::from_secs(1)) };
    let b_cfg =
        LighthouseConfig { tag: DeciderTag::new(900).expect("tag"), ..cfg(2, Duration::from_secs(1)) };
    let mut a = Lighthouse::new(a_cfg);
    let mut t = Instant::now();
    // Each round 6 s after the last: the previous joiner's heartbeat has expired.
    let step = Duration::from_secs(6);
    let mut a_ids = Vec::new();
    let mut next = 0;
    // A's quorums: membership changes every round (a different joiner each time).
    for r in 0..6 {
        t += step;
        let (q, _) = round(&mut a, t, next, &[member("x"), member(&format!("j{r}"))]);
        next += 10;
        a_ids.push(q.quorum_id);
    }
    assert!(a_ids.windows(2).all(|w| w[0] < w[1]), "{a_ids:?}");

    let mut b = Lighthouse::new(b_cfg);
    // B heard of A's first four ids only (in any order); A's last two died with it.
    for id in [a_ids[2], a_ids[0], a_ids[3], a_ids[1]] {
        b.observe_quorum_id(id);
    }
    let mut b_ids = Vec::new();
    for r in 0..6 {
        // The same list as A's last observed quorum first: B must still bump.
        let joiner = if r == 0 { "j3".to_string() } else { format!("k{r}") };
        t += step;
        let (q, _) = round(&mut b, t, next, &[member("x"), member(&joiner)]);
        next += 10;
        b_ids.push(q.quorum_id);
    }
    assert!(b_ids[0] > a_ids[3], "B's first id {} > observed {}", b_ids[0], a_ids[3]);
    assert!(b_ids.windows(2).all(|w| w[0] < w[1]), "{b_ids:?}");
    for id in &b_ids {
        assert!(!a_ids.contains(id), "B's {id} is one of A's {a_ids:?}");
        assert_eq!(id & 1023, 900);
    }
    // A partition: A (alive after all) and B both go on issuing; still never equal.
    for r in 0..20 {
        t += step;
        let (qa, _) = round(&mut a, t, next, &[member("x"), member(&format!("pa{r}"))]);
        let (qb, _) = round(&mut b, t, next + 5, &[member("x"), member(&format!("pb{r}"))]);
        next += 10;
        assert_ne!(qa.quorum_id, qb.quorum_id);
        assert!(!b_ids.contains(&qa.quorum_id));
        assert!(!a_ids.contains(&qb.quorum_id));
        a_ids.push(qa.quorum_id);
        b_ids.push(qb.quorum_id);
    }
    // Healed: A observes B's ids and overtakes them.
    let top = *b_ids.iter().max().expect("ids");
    a.observe_quorum_id(top);
    t += step;
    let (q, _) = round(&mut a, t, next, &[member("x"), member("healed")]);
    assert!(q.quorum_id > top);
}

#[test]
fn unchanged_list_keeps_the_id() {
    let mut lh = Lighthouse::new(cfg(1, Duration::from_secs(1)));
    let t = Instant::now();
    let (q1, _) = round(&mut lh, t, 0, &[member("a")]);
    let (q2, _) = round(&mut lh, t, 1, &[Member { step: 9, ..member("a") }]);
    assert_eq!(q1.quorum_id, q2.quorum_id);
    assert_eq!(q2.participants[0].step, 9);
}

#[test]
fn a_members_endpoints_are_its_manager_and_store() {
    let m = Member {
        address: "http://198.19.0.7:33981".into(),
        store_address: "198.19.0.7:39735".into(),
        ..Member::default()
    };
    let want: Vec<std::net::SocketAddr> =
        vec!["198.19.0.7:33981".parse().expect("addr"), "198.19.0.7:39735".parse().expect("addr")];
    assert_eq!(m.endpoints(), want);
    let v6 = Member {
        address: "https://[fd00::1]:80/x".into(),
        store_address: "vm:1".into(),
        ..Member::default()
    };
    assert_eq!(v6.endpoints(), vec!["[fd00::1]:80".parse::<std::net::SocketAddr>().expect("addr")]);
}
