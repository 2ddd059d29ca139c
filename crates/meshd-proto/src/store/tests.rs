use super::*;
use crate::rng::Rng;
use crate::wire::{self, Frame};

fn id(n: u128) -> NodeId {
    NodeId::from_u128(n)
}

fn cfg() -> StoreConfig {
    StoreConfig::default()
}

/// A network of stores: messages in flight are delivered in a seeded random order, some
/// duplicated, some lost; timers fire when nothing is in flight.
struct Net {
    ids: Vec<NodeId>,
    nodes: Vec<Store>,
    flight: Vec<(NodeId, NodeId, StoreMsg)>,
    events: Vec<Vec<StoreEvent>>,
    rng: Rng,
    now: Instant,
    loss: f64,
    dup: f64,
    /// Messages to these nodes vanish (a dead node that nobody declared dead yet).
    dead: BTreeSet<NodeId>,
}

impl Net {
    fn new(n: usize, seed: u64, now: Instant) -> Net {
        let ids: Vec<NodeId> = (1..=n as u128).map(|i| id(i * 0x1000 + 7)).collect();
        // A long deadline: with 30 % loss each way, 10 s of resends can fail (rarely) and
        // the convergence property is about delivery order, not about giving up.
        let long = StoreConfig { set_deadline: Duration::from_secs(120), ..cfg() };
        let nodes = ids.iter().map(|i| Store::new(*i, 0, long.clone())).collect();
        Net {
            ids,
            nodes,
            flight: Vec::new(),
            events: vec![Vec::new(); n],
            rng: Rng::new(seed),
            now,
            loss: 0.0,
            dup: 0.0,
            dead: BTreeSet::new(),
        }
    }

    fn idx(&self, n: NodeId) -> usize {
        self.ids.iter().position(|i| *i == n).expect("known node")
    }

    fn set(&mut self, i: usize, key: &str, value: &[u8]) -> SetId {
        let members = self.ids.clone();
        let sid = self.nodes[i].set(key.into(), value.to_vec(), members, self.now).expect("set");
        self.collect();
        sid
    }

    /// Moves every queued transmit into flight and every event into `events`.
    fn collect(&mut self) {
        for i in 0..self.nodes.len() {
            let from = self.ids[i];
            while let Some((to, msg)) = self.nodes[i].poll_transmit() {
                // Every message goes through the real codec.
                let bytes = wire::encode(&Frame::Store(msg));
                let Ok(Frame::Store(msg)) = wire::decode::<Frame>(&bytes) else { panic!("round trip") };
                self.flight.push((from, to, msg));
            }
            while let Some(ev) = self.nodes[i].poll_event() {
                self.events[i].push(ev);
            }
        }
    }

    /// Delivers one random message in flight (or fires the earliest timer); false when
    /// nothing is left to do.
    fn step(&mut self) -> bool {
        if self.flight.is_empty() {
            let Some(t) = self.nodes.iter().filter_map(Store::poll_timeout).min() else { return false };
            self.now = self.now.max(t);
            for n in &mut self.nodes {
                n.handle_timeout(self.now);
            }
            self.collect();
            return true;
        }
        let k = self.rng.below(self.flight.len());
        let (from, to, msg) = self.flight.swap_remove(k);
        if self.rng.unit() < self.dup {
            self.flight.push((from, to, msg.clone()));
        }
        if self.dead.contains(&to) || self.rng.unit() < self.loss {
            return true;
        }
        let j = self.idx(to);
        self.nodes[j].handle_message(from, msg, self.now);
        self.collect();
        true
    }

    fn run(&mut self) {
        for _ in 0..1_000_000 {
            if !self.step() {
                return;
            }
        }
        panic!("the network never went quiet");
    }

    fn done(&self, i: usize, sid: SetId) -> bool {
        self.events[i].contains(&StoreEvent::SetDone(sid))
    }
}

#[test]
fn a_lone_node_completes_at_once_and_reads_its_value() {
    let now = Instant::now();
    let mut s = Store::new(id(1), 0, cfg());
    let sid = s.set("k".into(), b"v".to_vec(), [id(1)], now).expect("set");
    assert_eq!(s.get("k"), Some(&b"v"[..]));
    assert_eq!(s.poll_event(), Some(StoreEvent::Changed("k".into())));
    assert_eq!(s.poll_event(), Some(StoreEvent::SetDone(sid)));
    assert_eq!(s.poll_transmit(), None);
    assert_eq!(s.poll_timeout(), None);
}

#[test]
fn a_set_completes_only_after_every_member_acknowledged_and_holds_the_value() {
    let now = Instant::now();
    let mut net = Net::new(4, 1, now);
    let sid = net.set(0, "MASTER_ADDR", b"198.19.0.1");
    assert!(!net.done(0, sid));
    assert_eq!(net.flight.len(), 3, "one copy per other member");
    // Deliver the copies but not yet all the acks: no completion.
    while net.flight.iter().any(|(_, _, m)| matches!(m, StoreMsg::Set { .. })) {
        let k = net.flight.iter().position(|(_, _, m)| matches!(m, StoreMsg::Set { .. })).expect("a set");
        let (from, to, msg) = net.flight.swap_remove(k);
        let j = net.idx(to);
        net.nodes[j].handle_message(from, msg, now);
        net.collect();
    }
    assert_eq!(net.flight.len(), 3, "one ack per member");
    for _ in 0..2 {
        net.step();
    }
    assert!(!net.done(0, sid), "two of three acks");
    net.step();
    assert!(net.done(0, sid));
    for n in &net.nodes {
        assert_eq!(n.get("MASTER_ADDR"), Some(&b"198.19.0.1"[..]));
    }
    for i in 1..4 {
        assert_eq!(net.events[i], vec![StoreEvent::Changed("MASTER_ADDR".into())]);
    }
    assert_eq!(net.nodes[0].poll_timeout(), None, "nothing left to resend");
}

/// Every node sets the same keys at once; whatever the delivery order, duplicates or
/// loss, every node ends with the value of the highest version, and every set completes.
#[test]
fn concurrent_sets_converge_under_random_order_duplicates_and_loss() {
    for seed in 0..300u64 {
        let now = Instant::now();
        let mut rng = Rng::new(seed ^ 0xabcd);
        let n = 2 + rng.below(5);
        let mut net = Net::new(n, seed, now);
        net.dup = 0.2;
        net.loss = if seed % 3 == 0 { 0.3 } else { 0.0 };
        let mut sets = Vec::new();
        for round in 0..3 {
            for i in 0..n {
                if rng.unit() < 0.7 {
                    let key = format!("k{}", rng.below(2));
                    let value = format!("v{round}-{i}");
                    sets.push((i, net.set(i, &key, value.as_bytes())));
                }
            }
            // Let a random part of the traffic through before the next round of sets, so
            // later sets are made with partial knowledge.
            for _ in 0..rng.below(20) {
                net.step();
            }
        }
        net.run();
        for (i, sid) in &sets {
            assert!(net.done(*i, *sid), "seed {seed}: set {sid:?} of node {i} incomplete");
        }
        for key in ["k0", "k1"] {
            let first = (net.nodes[0].version(key), net.nodes[0].get(key).map(<[u8]>::to_vec));
            for (i, node) in net.nodes.iter().enumerate() {
                let this = (node.version(key), node.get(key).map(<[u8]>::to_vec));
                assert_eq!(this, first, "seed {seed}: node {i} diverges on {key}");
            }
        }
    }
}

/// A set made after seeing a value beats it everywhere, even from a lower node id.
#[test]
fn a_later_set_wins_over_the_value_it_saw_whatever_the_ids() {
    let now = Instant::now();
    let mut net = Net::new(3, 5, now);
    // node 2 has the highest id; it writes first, several times to raise its counter.
    for v in 0..5 {
        net.set(2, "k", format!("old{v}").as_bytes());
    }
    net.run();
    let seen = net.nodes[0].version("k").expect("replicated");
    let sid = net.set(0, "k", b"new");
    assert!(net.nodes[0].version("k").expect("set") > seen);
    net.run();
    assert!(net.done(0, sid));
    for n in &net.nodes {
        assert_eq!(n.get("k"), Some(&b"new"[..]));
    }
}

#[test]
fn an_older_copy_is_acknowledged_but_not_applied() {
    let now = Instant::now();
    let mut s = Store::new(id(1), 0, cfg());
    let newer = Version { counter: 9, writer: id(3) };
    let older = Version { counter: 9, writer: id(2) };
    s.handle_message(
        id(3),
        StoreMsg::Set { restart: 0, key: "k".into(), value: b"a".to_vec(), version: newer },
        now,
    );
    assert_eq!(s.poll_event(), Some(StoreEvent::Changed("k".into())));
    s.handle_message(
        id(2),
        StoreMsg::Set { restart: 0, key: "k".into(), value: b"b".to_vec(), version: older },
        now,
    );
    assert_eq!(s.get("k"), Some(&b"a"[..]));
    assert_eq!(s.poll_event(), None, "no change to report");
    let acks: Vec<_> = std::iter::from_fn(|| s.poll_transmit()).collect();
    assert_eq!(
        acks,
        vec![
            (id(3), StoreMsg::Ack { restart: 0, version: newer, refused: None }),
            (id(2), StoreMsg::Ack { restart: 0, version: older, refused: None }),
        ]
    );
    // The next local set is numbered past what it saw.
    s.set("k".into(), b"c".to_vec(), [], now).expect("set");
    assert_eq!(s.version("k"), Some(Version { counter: 10, writer: id(1) }));
}

#[test]
fn lost_copies_are_resent_with_bounded_backoff_until_acknowledged() {
    let t0 = Instant::now();
    let mut s = Store::new(id(1), 0, cfg());
    let sid = s.set("k".into(), b"v".to_vec(), [id(1), id(2)], t0).expect("set");
    assert!(matches!(s.poll_transmit(), Some((to, StoreMsg::Set { .. })) if to == id(2)));
    let mut resends = Vec::new();
    let mut now = t0;
    while let Some(t) = s.poll_timeout() {
        assert!(t > now, "the timer moves forward");
        now = t;
        s.handle_timeout(now);
        if let Some((_, msg)) = s.poll_transmit() {
            resends.push((now - t0, msg));
        }
        if resends.len() == 5 {
            break;
        }
    }
    let at: Vec<Duration> = resends.iter().map(|r| r.0).collect();
    let ms = |v: u64| Duration::from_millis(v);
    assert_eq!(at, vec![ms(200), ms(600), ms(1400), ms(3000), ms(5000)], "doubling, capped at 2 s");
    let (_, copy) = resends.pop().expect("a resend");
    // The copy finally arrives: the peer acknowledges, the set completes.
    let mut peer = Store::new(id(2), 0, cfg());
    peer.handle_message(id(1), copy, now);
    let (to, ack) = peer.poll_transmit().expect("ack");
    assert_eq!(to, id(1));
    s.handle_message(id(2), ack.clone(), now);
    assert_eq!(s.poll_event(), Some(StoreEvent::Changed("k".into())));
    assert_eq!(s.poll_event(), Some(StoreEvent::SetDone(sid)));
    assert_eq!(s.poll_timeout(), None);
    // A duplicate ack changes nothing.
    s.handle_message(id(2), ack, now);
    assert_eq!(s.poll_event(), None);
}

#[test]
fn a_member_that_never_answers_fails_the_set_by_name_at_the_deadline() {
    let now = Instant::now();
    let mut net = Net::new(3, 9, now);
    net.dead.insert(net.ids[2]);
    let sid = net.set(0, "k", b"v");
    net.run();
    let expect = StoreEvent::SetFailed(sid, SetFailure::Unacknowledged(vec![net.ids[2]]));
    assert_eq!(net.events[0].last(), Some(&expect));
    assert_eq!(net.now - now, Duration::from_secs(120));
    let text = SetFailure::Unacknowledged(vec![net.ids[2]]).to_string();
    assert!(text.contains(&net.ids[2].to_string()), "{text}");
    assert_eq!(net.nodes[1].get("k"), Some(&b"v"[..]), "the live member has it");
}

#[test]
fn a_member_reported_gone_is_no_longer_waited_for_nor_copied_to() {
    let now = Instant::now();
    let mut net = Net::new(3, 11, now);
    let gone = net.ids[2];
    net.dead.insert(gone);
    let sid = net.set(0, "k", b"v");
    // Deliver to the live member only; the set still waits for the dead one.
    while !net.flight.is_empty() {
        net.step();
    }
    assert!(!net.done(0, sid));
    assert_eq!(net.nodes[0].unacknowledged(sid), vec![gone]);
    net.nodes[0].member_gone(gone);
    net.collect();
    assert!(net.done(0, sid));
    let sid2 = net.set(0, "k2", b"w");
    assert!(net.flight.iter().all(|(_, to, _)| *to != gone), "no copy to a gone member");
    net.run();
    assert!(net.done(0, sid2));
}

#[test]
fn messages_of_another_round_are_ignored_and_resending_bridges_a_late_reset() {
    let now = Instant::now();
    let mut a = Store::new(id(1), 1, cfg());
    let mut b = Store::new(id(2), 0, cfg());
    let sid = a.set("k".into(), b"v".to_vec(), [id(2)], now).expect("set");
    let (_, copy) = a.poll_transmit().expect("copy");
    b.handle_message(id(1), copy, now);
    assert_eq!(b.get("k"), None, "round 1's value in round 0");
    assert_eq!(b.poll_transmit(), None, "not acknowledged");
    // A stale ack of round 0 with the same version does not complete round 1's set.
    let v = a.version("k").expect("version");
    a.handle_message(id(2), StoreMsg::Ack { restart: 0, version: v, refused: None }, now);
    assert!(!std::iter::from_fn(|| a.poll_event()).any(|e| e == StoreEvent::SetDone(sid)));
    b.reset(1);
    let t = a.poll_timeout().expect("resend timer");
    a.handle_timeout(t);
    let (_, copy) = a.poll_transmit().expect("resent copy");
    b.handle_message(id(1), copy, t);
    assert_eq!(b.get("k"), Some(&b"v"[..]));
    let (_, ack) = b.poll_transmit().expect("ack");
    a.handle_message(id(2), ack, t);
    assert_eq!(a.poll_event(), Some(StoreEvent::SetDone(sid)));
}

#[test]
fn reset_empties_the_store_and_fails_pending_sets() {
    let now = Instant::now();
    let mut s = Store::new(id(1), 0, cfg());
    let sid = s.set("k".into(), b"v".to_vec(), [id(2)], now).expect("set");
    s.reset(1);
    assert_eq!(s.restart(), 1);
    assert!(s.is_empty());
    assert_eq!(s.bytes(), 0);
    assert_eq!(s.poll_transmit(), None, "round 0's copies are not sent");
    assert_eq!(s.poll_event(), Some(StoreEvent::SetFailed(sid, SetFailure::Reset)));
    assert_eq!(s.poll_event(), None);
    assert_eq!(s.poll_timeout(), None);
}

#[test]
fn local_sets_beyond_a_bound_fail_naming_it_and_change_nothing() {
    let now = Instant::now();
    let small = StoreConfig { max_keys: 2, max_bytes: 100, max_pending_bytes: 60, ..cfg() };
    let mut s = Store::new(id(1), 0, small);
    let err = |s: &mut Store, k: &str, v: usize| s.set(k.into(), vec![0; v], [], now).expect_err("refused");
    assert_eq!(err(&mut s, "", 1), StoreError::EmptyKey);
    let long = "x".repeat(MAX_STORE_KEY + 1);
    assert_eq!(
        s.set(long, vec![], [], now),
        Err(StoreError::KeyTooLong { len: MAX_STORE_KEY as u64 + 1, max: MAX_STORE_KEY as u64 })
    );
    assert!(err(&mut s, "k", MAX_STORE_VALUE + 1).to_string().contains("exceeds the 1048576-byte limit"));
    s.set("a".into(), vec![0; 49], [], now).expect("50 bytes");
    s.set("b".into(), vec![0; 9], [], now).expect("60 bytes");
    // Replacing a value counts only the difference.
    s.set("a".into(), vec![0; 89], [], now).expect("exactly 100 bytes");
    assert_eq!(s.bytes(), 100);
    assert_eq!(err(&mut s, "b", 10), StoreError::Full { held: 100, needed: 1, max: 100 });
    let e = err(&mut s, "c", 0);
    assert_eq!(e, StoreError::TooManyKeys { max: 2 });
    assert_eq!(e.to_string(), "store full: it holds 2 keys, the limit");
    assert_eq!(s.get("b"), Some(&[0u8; 9][..]));
    assert_eq!((s.len(), s.bytes()), (2, 100));
    // Pending bytes: a set that waits for a member holds its bytes until acknowledged.
    s.set("b".into(), vec![1; 5], [id(2)], now).expect("6 bytes pending");
    let busy = s.set("a".into(), vec![1; 59], [id(2)], now).expect_err("busy");
    assert_eq!(busy, StoreError::Busy { pending: 6, max: 60 });
    assert_eq!(s.get("a"), Some(&[0u8; 89][..]), "a refused set changes nothing");
}

#[test]
fn a_copy_beyond_a_members_bound_is_refused_in_its_ack_and_fails_the_set() {
    let now = Instant::now();
    let mut a = Store::new(id(1), 0, cfg());
    let mut b = Store::new(id(2), 0, StoreConfig { max_bytes: 10, ..cfg() });
    let mut c = Store::new(id(3), 0, cfg());
    let sid = a.set("key".into(), vec![7; 20], [id(2), id(3)], now).expect("set");
    while let Some((to, msg)) = a.poll_transmit() {
        let peer = if to == id(2) { &mut b } else { &mut c };
        peer.handle_message(id(1), msg, now);
        let (_, ack) = peer.poll_transmit().expect("ack");
        a.handle_message(to, ack, now);
    }
    assert_eq!(b.get("key"), None);
    assert_eq!(c.get("key"), Some(&[7u8; 20][..]));
    let refusal = StoreError::Full { held: 0, needed: 23, max: 10 };
    let events: Vec<_> = std::iter::from_fn(|| a.poll_event()).collect();
    assert_eq!(events.last(), Some(&StoreEvent::SetFailed(sid, SetFailure::Refused(vec![(id(2), refusal)]))));
    let text = SetFailure::Refused(vec![(id(2), StoreError::TooManyKeys { max: 5 })]).to_string();
    assert!(text.contains(&id(2).to_string()) && text.contains("5 keys"), "{text}");
    assert_eq!(a.poll_timeout(), None, "a refusal is an answer: no resend");
}

#[test]
fn a_hostile_copy_is_refused_not_stored() {
    let now = Instant::now();
    let mut s = Store::new(id(1), 0, cfg());
    let v1 = Version { counter: 1, writer: id(9) };
    let big = StoreMsg::Set { restart: 0, key: "k".into(), value: vec![0; MAX_STORE_VALUE + 1], version: v1 };
    s.handle_message(id(9), big, now);
    assert!(s.is_empty());
    let (_, ack) = s.poll_transmit().expect("ack");
    assert!(matches!(ack, StoreMsg::Ack { refused: Some(StoreError::ValueTooLarge { .. }), .. }));
    let empty = StoreMsg::Set { restart: 0, key: String::new(), value: vec![], version: v1 };
    s.handle_message(id(9), empty, now);
    assert!(matches!(
        s.poll_transmit(),
        Some((_, StoreMsg::Ack { refused: Some(StoreError::EmptyKey), .. }))
    ));
    // An ack for a set nobody made, or from a node nobody waits for, is ignored.
    s.handle_message(id(9), StoreMsg::Ack { restart: 0, version: v1, refused: None }, now);
    let sid = s.set("k".into(), b"v".to_vec(), [id(2)], now).expect("set");
    let v = s.version("k").expect("version");
    s.handle_message(id(9), StoreMsg::Ack { restart: 0, version: v, refused: None }, now);
    assert_eq!(s.unacknowledged(sid), vec![id(2)]);
    assert_eq!(v.counter, 1, "refused copies do not move the clock");
    while s.poll_transmit().is_some() {}
    let version = Version { counter: u64::MAX, writer: id(9) };
    // Issue 29: a copy numbered u64::MAX (it would beat every later set of its key, on
    // every node, for good) is refused, and the key stays settable.
    let top = StoreMsg::Set { restart: 0, key: "t".into(), value: b"x".to_vec(), version };
    s.handle_message(id(9), top, now);
    assert_eq!(s.get("t"), None);
    assert!(matches!(
        s.poll_transmit(),
        Some((_, StoreMsg::Ack { refused: Some(StoreError::VersionTooFar { counter: u64::MAX, .. }), .. }))
    ));
    s.set("t".into(), b"y".to_vec(), [], now).expect("the key is not frozen");
    assert_eq!(s.get("t"), Some(&b"y"[..]));
    // The largest honest step is kept, and a later local set still beats it.
    let far = Version { counter: s.version("t").expect("v").counter + MAX_COUNTER_STEP, writer: id(9) };
    s.handle_message(
        id(9),
        StoreMsg::Set { restart: 0, key: "t".into(), value: b"z".to_vec(), version: far },
        now,
    );
    assert_eq!(s.get("t"), Some(&b"z"[..]));
    s.set("t".into(), b"w".to_vec(), [], now).expect("set after a far copy");
    assert_eq!(s.get("t"), Some(&b"w"[..]));
}

/// Issue 29: a version is tied to its sender. A copy that names another node as its writer
/// (a token holder writing a key "as" a member) is neither kept nor acknowledged.
#[test]
fn a_copy_naming_another_writer_is_dropped() {
    let now = Instant::now();
    let mut s = Store::new(id(1), 0, cfg());
    let forged = Version { counter: 5, writer: id(2) };
    let msg = StoreMsg::Set { restart: 0, key: "k".into(), value: b"evil".to_vec(), version: forged };
    s.handle_message(id(9), msg.clone(), now);
    assert_eq!(s.get("k"), None);
    assert!(s.poll_transmit().is_none(), "no acknowledgement for a forgery");
    s.handle_message(id(2), msg, now);
    assert_eq!(s.get("k"), Some(&b"evil"[..]), "from its writer it is kept");
}

/// Whatever a peer sends (any round, version, key, size, acks for anything), the store
/// never panics, stays within its bounds, and its byte count matches what it holds.
#[test]
fn random_hostile_messages_keep_the_bounds_and_the_accounting() {
    let small = StoreConfig { max_keys: 8, max_bytes: 4096, max_pending_bytes: 2048, ..cfg() };
    for seed in 0..200u64 {
        let mut rng = Rng::new(seed);
        let mut now = Instant::now();
        let mut s = Store::new(id(1), 1, small.clone());
        for _ in 0..300 {
            now += Duration::from_millis(rng.below(500) as u64);
            let key = match rng.below(4) {
                0 => String::new(),
                1 => "x".repeat(MAX_STORE_KEY + rng.below(3)),
                _ => format!("k{}", rng.below(12)),
            };
            let value = vec![rng.next_u64() as u8; rng.below(1500)];
            let version = Version { counter: rng.next_u64() % 50, writer: id(rng.below(4) as u128) };
            let restart = rng.below(3) as u32;
            match rng.below(5) {
                0 => {
                    let _ = s.set(key, value, [id(2), id(3)], now);
                }
                1 => s.handle_message(id(2), StoreMsg::Ack { restart, version, refused: None }, now),
                2 => s.handle_timeout(now),
                3 => s.member_gone(id(rng.below(4) as u128)),
                _ => s.handle_message(
                    id(rng.below(4) as u128),
                    StoreMsg::Set { restart, key, value, version },
                    now,
                ),
            }
            while s.poll_transmit().is_some() {}
            while s.poll_event().is_some() {}
            let held: usize = s.entries.iter().map(|(k, e)| k.len() + e.value.len()).sum();
            assert_eq!(s.bytes(), held, "seed {seed}");
            assert!(s.len() <= 8 && s.bytes() <= 4096, "seed {seed}");
            let pending: usize = s.pending.values().map(Pending::bytes).sum();
            assert_eq!(s.pending_bytes, pending, "seed {seed}");
            assert!(pending <= 2048, "seed {seed}");
            assert_eq!(s.by_version.len(), s.pending.len(), "seed {seed}");
        }
    }
}
