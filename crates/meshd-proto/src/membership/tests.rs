//! Unit tests of the membership core: ordering rules, refutation, probing, join, bounds
//! and hostile input.

use super::*;
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

fn addr(n: u32) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + n)), 29400)
}

fn nid(n: u128) -> NodeId {
    NodeId::from_u128(n)
}

fn meta(n: u32) -> NodeMeta {
    NodeMeta { gossip_addr: Some(addr(n)), hostname: format!("node-{n}"), nproc: 8, ..NodeMeta::default() }
}

fn node(n: u32, now: Instant) -> Membership {
    Membership::new(nid(n as u128), addr(n), meta(n), MembershipConfig::default(), n as u64, now)
}

fn alive(n: u32, inc: u64) -> Update {
    Update { id: nid(n as u128), incarnation: inc, kind: UpdateKind::Alive { addr: addr(n), meta: meta(n) } }
}

fn suspect(n: u32, inc: u64, by: u32) -> Update {
    Update { id: nid(n as u128), incarnation: inc, kind: UpdateKind::Suspect { accuser: nid(by as u128) } }
}

fn dead(n: u32, inc: u64, by: u32) -> Update {
    Update { id: nid(n as u128), incarnation: inc, kind: UpdateKind::Dead { accuser: nid(by as u128) } }
}

fn gossip(from: u32, updates: Vec<Update>) -> Message {
    Message::Gossip { from: nid(from as u128), updates }
}

fn drain_transmits(m: &mut Membership) -> Vec<Transmit> {
    std::iter::from_fn(|| m.poll_transmit()).collect()
}

fn drain_events(m: &mut Membership) -> Vec<MemberEvent> {
    std::iter::from_fn(|| m.poll_event()).collect()
}

fn status(m: &Membership, n: u32) -> Option<(MemberStatus, u64)> {
    m.member(nid(n as u128)).map(|v| (v.status, v.incarnation))
}

/// Every update carried by the transmits, flattened.
fn carried(ts: &[Transmit]) -> Vec<Update> {
    let mut out = Vec::new();
    for t in ts {
        let mut msg = t.msg.clone();
        if let Some(u) = msg.updates_mut() {
            out.append(u);
        }
    }
    out
}

#[test]
fn incarnation_ordering_rules() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    a.handle_message(addr(2), gossip(2, vec![alive(2, 5)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Alive, 5)));
    // Older and equal Alive: ignored.
    a.handle_message(addr(2), gossip(2, vec![alive(2, 4)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Alive, 5)));
    // Suspect at an older incarnation: ignored; at the same: wins.
    a.handle_message(addr(3), gossip(3, vec![suspect(2, 4, 3)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Alive, 5)));
    a.handle_message(addr(3), gossip(3, vec![suspect(2, 5, 3)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Suspect, 5)));
    // Alive at the same incarnation does not clear a suspicion; a newer one does.
    a.handle_message(addr(2), gossip(2, vec![alive(2, 5)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Suspect, 5)));
    a.handle_message(addr(2), gossip(2, vec![alive(2, 6)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Alive, 6)));
    // Dead at an older incarnation: ignored; at the same: wins.
    a.handle_message(addr(3), gossip(3, vec![dead(2, 5, 3)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Alive, 6)));
    a.handle_message(addr(3), gossip(3, vec![dead(2, 6, 3)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Dead, 6)));
    // Suspect and same-incarnation Alive cannot resurrect; a newer Alive can.
    a.handle_message(addr(3), gossip(3, vec![suspect(2, 6, 3), alive(2, 6)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Dead, 6)));
    a.handle_message(addr(2), gossip(2, vec![alive(2, 7)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Alive, 7)));

    let events = drain_events(&mut a);
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| match e {
            MemberEvent::Up(_) => "up",
            MemberEvent::Updated(_) => "updated",
            MemberEvent::Suspect(_) => "suspect",
            MemberEvent::Down(_) => "down",
            MemberEvent::Left(_) => "left",
        })
        .collect();
    assert_eq!(kinds, ["up", "suspect", "updated", "down", "up"]);
}

#[test]
fn metadata_change_emits_updated_and_spreads() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    let mut b = node(2, t0);
    a.handle_message(addr(2), gossip(2, vec![alive(2, 0)]), t0);
    b.handle_message(addr(1), gossip(1, vec![alive(1, 0)]), t0);
    drain_events(&mut a);
    drain_transmits(&mut b);
    let mut m = meta(2);
    m.gpus = 8;
    b.set_meta(m.clone(), t0);
    assert_eq!(b.incarnation(), 1);
    b.handle_timeout(t0 + Duration::from_millis(1));
    let ts = drain_transmits(&mut b);
    assert!(!ts.is_empty(), "set_meta must trigger gossip");
    for t in ts {
        a.handle_message(addr(2), t.msg, t0);
    }
    let ev = drain_events(&mut a);
    assert!(
        ev.iter().any(|e| matches!(e, MemberEvent::Updated(v) if v.meta == m && v.incarnation == 1)),
        "{ev:?}"
    );
}

#[test]
fn refutes_suspicion_death_and_leave_claims() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    a.handle_message(addr(2), gossip(2, vec![alive(2, 0)]), t0);
    a.handle_message(addr(2), gossip(2, vec![suspect(1, 0, 2)]), t0);
    assert_eq!(a.incarnation(), 1);
    a.handle_message(addr(2), gossip(2, vec![dead(1, 7, 2)]), t0);
    assert_eq!(a.incarnation(), 8);
    let left = Update { id: nid(1), incarnation: 8, kind: UpdateKind::Left };
    a.handle_message(addr(2), gossip(2, vec![left]), t0);
    assert_eq!(a.incarnation(), 9);
    // Stale claims do not bump.
    a.handle_message(addr(2), gossip(2, vec![suspect(1, 3, 2)]), t0);
    assert_eq!(a.incarnation(), 9);
    assert_eq!(status(&a, 1), Some((MemberStatus::Alive, 9)));
    // The refutation goes out as Alive(9).
    a.handle_timeout(t0 + Duration::from_millis(1));
    let ups = carried(&drain_transmits(&mut a));
    assert!(ups.contains(&Update {
        id: nid(1),
        incarnation: 9,
        kind: UpdateKind::Alive { addr: addr(1), meta: meta(1) }
    }));
    // After a graceful leave, claims about us are no longer refuted.
    a.leave(t0);
    let inc = a.incarnation();
    a.handle_message(addr(2), gossip(2, vec![dead(1, inc, 2)]), t0);
    assert_eq!(a.incarnation(), inc);
    assert_eq!(status(&a, 1), Some((MemberStatus::Left, inc)));
}

#[test]
fn hostile_messages_never_panic() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    let me = nid(1);
    let junk = vec![
        // About unknown members: suspect/dead/left are ignored, not added.
        suspect(99, u64::MAX, 98),
        dead(98, u64::MAX, 97),
        Update { id: nid(97), incarnation: 0, kind: UpdateKind::Left },
        // About ourselves, with absurd incarnations.
        alive(1, u64::MAX),
        suspect(1, u64::MAX, 2),
        dead(1, u64::MAX, 2),
        alive(5, u64::MAX),
        suspect(5, u64::MAX, 5),
    ];
    a.handle_message(addr(9), gossip(9, junk), t0);
    assert_eq!(status(&a, 99), None);
    assert_eq!(status(&a, 98), None);
    assert_eq!(status(&a, 97), None);
    assert_eq!(a.incarnation(), u64::MAX);
    a.handle_message(addr(9), Message::Ack { from: nid(42), seq: 12345, updates: vec![] }, t0);
    a.handle_message(
        addr(9),
        Message::IndirectAck { from: nid(42), seq: 0, target: me, updates: vec![] },
        t0,
    );
    // Ping for someone else at our address: no ack.
    a.handle_message(addr(9), Message::Ping { from: nid(9), seq: 1, target: nid(1234), updates: vec![] }, t0);
    assert!(!drain_transmits(&mut a).iter().any(|t| matches!(t.msg, Message::Ack { .. })));
    // PingReq about ourselves: answered directly.
    a.handle_message(
        addr(9),
        Message::PingReq { from: nid(9), seq: 3, target: me, target_addr: addr(1), updates: vec![] },
        t0,
    );
    assert!(
        drain_transmits(&mut a)
            .iter()
            .any(|t| matches!(t.msg, Message::IndirectAck { seq: 3, .. }) && t.to == addr(9))
    );
    // Sync claiming we are dead at MAX, duplicates, and from ourselves.
    let st = |n: u32, status| MemberState {
        id: nid(n as u128),
        addr: addr(n),
        meta: meta(n),
        incarnation: u64::MAX,
        status,
    };
    let members = vec![
        st(1, MemberStatus::Dead),
        st(6, MemberStatus::Suspect),
        st(6, MemberStatus::Suspect),
        st(7, MemberStatus::Left),
        st(8, MemberStatus::Dead),
    ];
    a.handle_message(addr(1), Message::SyncRequest { from: me, members }, t0);
    assert_eq!(status(&a, 6), Some((MemberStatus::Suspect, u64::MAX)));
    assert_eq!(status(&a, 7), None);
    assert_eq!(status(&a, 8), None);
    // Oversized metadata is refused.
    let mut big = meta(10);
    big.hostname = "x".repeat(MAX_META + 1);
    let u = Update { id: nid(10), incarnation: 0, kind: UpdateKind::Alive { addr: addr(10), meta: big } };
    a.handle_message(addr(10), gossip(10, vec![u]), t0);
    assert_eq!(status(&a, 10), None);
    // Timers keep working afterwards.
    for i in 0..50 {
        a.handle_timeout(t0 + Duration::from_millis(100 * i));
        drain_transmits(&mut a);
    }
}

#[test]
fn member_table_is_bounded() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    let members: Vec<MemberState> = (2..(MAX_MEMBERS as u32 + 500))
        .map(|n| MemberState {
            id: nid(n as u128),
            addr: addr(n),
            meta: NodeMeta::default(),
            incarnation: 0,
            status: MemberStatus::Alive,
        })
        .collect();
    a.handle_message(addr(2), Message::SyncResponse { from: nid(2), members }, t0);
    assert_eq!(a.members().len(), MAX_MEMBERS);
    // The broadcast queue is keyed by member: also bounded.
    assert!(a.queued_updates() <= MAX_MEMBERS);
    // Our sync answer stays under the frame limit.
    a.handle_message(addr(3), Message::SyncRequest { from: nid(3), members: vec![] }, t0);
    let ts = drain_transmits(&mut a);
    let resp = ts.iter().find(|t| matches!(t.msg, Message::SyncResponse { .. })).expect("sync answered");
    assert!(wire::encode(&resp.msg).len() <= wire::MAX_FRAME);
}

#[test]
fn datagrams_respect_max_datagram() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    let ups: Vec<Update> = (2..400).map(|n| alive(n, 3)).collect();
    a.handle_message(addr(2), gossip(2, ups), t0);
    let mut t = t0;
    let mut sent = 0;
    for _ in 0..200 {
        t += Duration::from_millis(50);
        a.handle_timeout(t);
        for tr in drain_transmits(&mut a) {
            if tr.delivery == Delivery::Datagram {
                let len = wire::encode(&tr.msg).len();
                assert!(len <= MembershipConfig::default().max_datagram, "{len}");
                sent += 1;
            }
        }
    }
    assert!(sent > 50);
}

#[test]
fn join_by_push_pull() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    let mut b = node(2, t0);
    // Our own address among the seeds is ignored.
    a.add_seeds(&[addr(2), addr(1)], t0);
    let ts = drain_transmits(&mut a);
    assert_eq!(ts.len(), 1);
    assert_eq!(ts[0].to, addr(2));
    assert_eq!(ts[0].delivery, Delivery::Reliable);
    b.handle_message(addr(1), ts[0].msg.clone(), t0);
    for t in drain_transmits(&mut b) {
        assert_eq!(t.to, addr(1));
        a.handle_message(addr(2), t.msg, t0);
    }
    assert_eq!(a.alive().len(), 2);
    assert_eq!(b.alive().len(), 2);
    assert!(matches!(drain_events(&mut a).as_slice(), [MemberEvent::Up(v)] if v.id == nid(2)));
    assert!(matches!(drain_events(&mut b).as_slice(), [MemberEvent::Up(v)] if v.id == nid(1)));
}

#[test]
fn remote_dead_in_sync_becomes_suspicion() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    a.handle_message(addr(2), gossip(2, vec![alive(2, 0), alive(3, 0)]), t0);
    let members = vec![MemberState {
        id: nid(3),
        addr: addr(3),
        meta: meta(3),
        incarnation: 0,
        status: MemberStatus::Dead,
    }];
    a.handle_message(addr(2), Message::SyncResponse { from: nid(2), members }, t0);
    assert_eq!(status(&a, 3), Some((MemberStatus::Suspect, 0)));
}

/// Runs `a` alone (nobody answers) from `t0` to `until`, returning its events.
fn run_alone(a: &mut Membership, t0: Instant, until: Duration) -> Vec<(Duration, MemberEvent)> {
    let mut out = Vec::new();
    let mut now = t0;
    while now < t0 + until {
        let Some(next) = a.poll_timeout() else { break };
        now = next.max(now);
        a.handle_timeout(now);
        drain_transmits(a);
        out.extend(std::iter::from_fn(|| a.poll_event()).map(|e| (now - t0, e)));
    }
    out
}

#[test]
fn unanswered_probes_lead_to_suspect_then_dead() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    a.handle_message(addr(2), gossip(2, vec![alive(2, 0)]), t0);
    drain_events(&mut a);
    // First probe: a direct ping, then ping-reqs (none possible: no third member).
    let mut now = t0;
    let mut pinged = false;
    while !pinged {
        now = a.poll_timeout().expect("timer");
        a.handle_timeout(now);
        pinged = drain_transmits(&mut a)
            .iter()
            .any(|t| matches!(t.msg, Message::Ping { target, .. } if target == nid(2)) && t.to == addr(2));
    }
    let ev = run_alone(&mut a, now, Duration::from_secs(5));
    let suspect_at =
        ev.iter().find(|(_, e)| *e == MemberEvent::Suspect(nid(2))).map(|(t, _)| *t).expect("suspected");
    let down_at =
        ev.iter().find(|(_, e)| *e == MemberEvent::Down(nid(2))).map(|(t, _)| *t).expect("declared dead");
    let cfg = MembershipConfig::default();
    assert!(suspect_at <= cfg.probe_interval + Duration::from_millis(1));
    // Two members: log10 N < 1, no confirmations expected -> the minimum timeout.
    let min = cfg.probe_interval * cfg.suspicion_mult / 2;
    assert!(down_at - suspect_at >= min, "{down_at:?} {suspect_at:?}");
    assert!(down_at - suspect_at <= min + Duration::from_millis(1));
}

#[test]
fn ack_clears_probe_and_measures_rtt() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    let mut b = node(2, t0);
    a.handle_message(addr(2), gossip(2, vec![alive(2, 0)]), t0);
    for _ in 0..40 {
        let now = a.poll_timeout().expect("timer");
        a.handle_timeout(now);
        for t in drain_transmits(&mut a) {
            b.handle_message(addr(1), t.msg, now);
            for r in drain_transmits(&mut b) {
                a.handle_message(addr(2), r.msg, now + Duration::from_millis(3));
            }
        }
    }
    assert_eq!(status(&a, 2), Some((MemberStatus::Alive, 0)));
    assert_eq!(a.rtt(nid(2)), Some(Duration::from_millis(3)));
}

#[test]
fn suspicion_shrinks_with_confirmations() {
    let t0 = Instant::now();
    let mut s = Suspicion {
        start: t0,
        min: Duration::from_secs(1),
        max: Duration::from_secs(2),
        k: 3,
        accusers: BTreeSet::from([nid(1)]),
    };
    assert_eq!(s.deadline(), t0 + Duration::from_secs(2));
    assert!(!s.confirm(nid(1)), "the first accuser does not confirm itself");
    assert!(s.confirm(nid(2)));
    let one = s.deadline();
    assert!(one < t0 + Duration::from_secs(2) && one > t0 + Duration::from_secs(1));
    assert!(s.confirm(nid(3)));
    assert!(s.confirm(nid(4)));
    assert_eq!(s.deadline(), t0 + Duration::from_secs(1));
    assert!(!s.confirm(nid(5)), "bounded");
}

#[test]
fn indirect_probe_is_relayed() {
    let t0 = Instant::now();
    let mut relay = node(2, t0);
    relay.handle_message(
        addr(1),
        Message::PingReq { from: nid(1), seq: 77, target: nid(3), target_addr: addr(3), updates: vec![] },
        t0,
    );
    let ts = drain_transmits(&mut relay);
    let Some((seq, to)) = ts.iter().find_map(|t| match t.msg {
        Message::Ping { seq, target, .. } if target == nid(3) => Some((seq, t.to)),
        _ => None,
    }) else {
        panic!("no relayed ping: {ts:?}");
    };
    assert_eq!(to, addr(3));
    relay.handle_message(addr(3), Message::Ack { from: nid(3), seq, updates: vec![] }, t0);
    let ts = drain_transmits(&mut relay);
    assert!(ts.iter().any(|t| t.to == addr(1)
        && matches!(t.msg, Message::IndirectAck { seq: 77, target, .. } if target == nid(3))));
}

#[test]
fn leave_is_disseminated() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    let mut b = node(2, t0);
    a.handle_message(addr(2), gossip(2, vec![alive(2, 0)]), t0);
    b.handle_message(addr(1), gossip(1, vec![alive(1, 0)]), t0);
    drain_events(&mut b);
    a.leave(t0);
    for t in drain_transmits(&mut a) {
        b.handle_message(addr(1), t.msg, t0);
    }
    assert_eq!(drain_events(&mut b), vec![MemberEvent::Left(nid(1))]);
    assert_eq!(b.alive().len(), 1);
    assert!(a.alive().iter().all(|v| v.id != nid(1)));
}

#[test]
fn dead_members_are_forgotten_after_retention() {
    let t0 = Instant::now();
    let mut a = node(1, t0);
    a.handle_message(addr(2), gossip(2, vec![alive(2, 0), dead(2, 0, 3)]), t0);
    assert_eq!(status(&a, 2), Some((MemberStatus::Dead, 0)));
    let later = t0 + MembershipConfig::default().dead_retention + Duration::from_secs(2);
    a.handle_timeout(later);
    assert_eq!(status(&a, 2), None);
    assert_eq!(a.members().len(), 1);
}

#[test]
fn traffic_on_the_link_keeps_an_unanswering_member_alive_and_silence_still_kills() {
    // Probes go unanswered (their answers are stuck behind bulk data), but the driver keeps
    // seeing the member's traffic: it must not be declared dead. Once the traffic stops,
    // the usual suspect -> dead path runs.
    let t0 = Instant::now();
    let mut a = node(1, t0);
    a.handle_message(addr(2), gossip(2, vec![alive(2, 0)]), t0);
    drain_events(&mut a);
    let mut now = t0;
    let mut events = Vec::new();
    while now < t0 + Duration::from_secs(10) {
        now = a.poll_timeout().expect("timer").max(now);
        a.heard_from(nid(2), now);
        a.handle_timeout(now);
        drain_transmits(&mut a);
        events.extend(drain_events(&mut a));
    }
    assert!(
        !events.contains(&MemberEvent::Down(nid(2))),
        "declared dead while its link was busy: {events:?}"
    );
    assert!(status(&a, 2).is_some_and(|(s, _)| s.is_live()));
    // Silence from now on.
    let ev = run_alone(&mut a, now, Duration::from_secs(5));
    assert!(
        ev.iter().any(|(_, e)| *e == MemberEvent::Down(nid(2))),
        "never declared dead once silent: {ev:?}"
    );
    // Our own id is ignored.
    a.heard_from(nid(1), now);
}
