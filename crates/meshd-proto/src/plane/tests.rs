//! Two links over a simulated network: seeded loss, duplication, reordering, a bottleneck
//! with a drop-tail queue, virtual time. No sockets.

use super::packet::{HEADER_LEN, Header, OVERHEAD, expand_pn};
use super::*;
use crate::rng::Rng;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

fn keys(seed: u8) -> (LinkKeys, LinkKeys) {
    let a = [seed; 32];
    let b = [seed.wrapping_add(1); 32];
    (LinkKeys { send: a, recv: b }, LinkKeys { send: b, recv: a })
}

#[derive(Clone, Copy)]
struct NetConfig {
    loss: f64,
    dup: f64,
    /// One-way propagation delay.
    delay: Duration,
    /// Extra random delay up to this, which reorders.
    jitter: Duration,
    /// Bottleneck rate in bytes per second.
    rate: f64,
    /// Longest queueing delay at the bottleneck before drop-tail.
    queue: Duration,
}

impl NetConfig {
    fn lossy(loss: f64) -> NetConfig {
        NetConfig {
            loss,
            dup: 0.01,
            delay: Duration::from_micros(200),
            jitter: Duration::from_micros(10),
            rate: 1.25e9,
            queue: Duration::from_millis(2),
        }
    }
}

/// One direction of the network.
struct Wire {
    cfg: NetConfig,
    busy_until: Instant,
    /// (delivery time, sequence for stable order) -> datagram
    queue: BTreeMap<(Instant, u64), Vec<u8>>,
    n: u64,
}

impl Wire {
    fn new(cfg: NetConfig, now: Instant) -> Wire {
        Wire { cfg, busy_until: now, queue: BTreeMap::new(), n: 0 }
    }

    fn push(&mut self, rng: &mut Rng, now: Instant, d: &[u8]) {
        if rng.unit() < self.cfg.loss {
            return;
        }
        let start = self.busy_until.max(now);
        if start.duration_since(now) > self.cfg.queue {
            return; // drop-tail at the bottleneck
        }
        self.busy_until = start + Duration::from_secs_f64(d.len() as f64 / self.cfg.rate);
        let copies = if rng.unit() < self.cfg.dup { 2 } else { 1 };
        for _ in 0..copies {
            let jitter = self.cfg.jitter.mul_f64(rng.unit());
            self.n += 1;
            self.queue.insert((self.busy_until + self.cfg.delay + jitter, self.n), d.to_vec());
        }
    }

    fn next_at(&self) -> Option<Instant> {
        self.queue.keys().next().map(|k| k.0)
    }

    fn pop_due(&mut self, now: Instant) -> Option<Vec<u8>> {
        let (&k, _) = self.queue.iter().next()?;
        (k.0 <= now).then(|| self.queue.remove(&k)).flatten()
    }
}

/// What one end has received of the other's messages.
#[derive(Default)]
struct Sink {
    msgs: HashMap<u64, (Vec<u8>, Vec<bool>, bool)>,
}

impl Sink {
    fn take(&mut self, r: &Received<'_>) {
        let (buf, seen, done) = self
            .msgs
            .entry(r.tag)
            .or_insert_with(|| (vec![0; r.total_len as usize], vec![false; r.total_len as usize], false));
        assert!(!*done, "message {} delivered after it completed", r.tag);
        let off = r.offset as usize;
        for (i, b) in r.data.iter().enumerate() {
            assert!(!seen[off + i], "byte {} of message {} delivered twice", off + i, r.tag);
            seen[off + i] = true;
            buf[off + i] = *b;
        }
        if r.complete {
            assert!(seen.iter().all(|s| *s), "message {} complete with holes", r.tag);
            *done = true;
        }
    }
}

struct Sim {
    now: Instant,
    rng: Rng,
    links: [Link; 2],
    wires: [Wire; 2],
    sinks: [Sink; 2],
    delivered: [Vec<u64>; 2],
    /// Every datagram each end sent, in order: (phase, full packet number).
    sent_pns: [Vec<(bool, u64)>; 2],
    /// (window before, window after) at every congestion event of end 0.
    backoffs: Vec<(u64, u64)>,
    buf: Vec<u8>,
}

impl Sim {
    fn new(seed: u64, net: NetConfig, tweak: impl Fn(&mut LinkConfig)) -> Sim {
        let now = Instant::now();
        let (ka, kb) = keys(seed as u8);
        let mut ca = LinkConfig::new(ka, 0);
        let mut cb = LinkConfig::new(kb, 0);
        tweak(&mut ca);
        tweak(&mut cb);
        Sim {
            now,
            rng: Rng::new(seed),
            links: [Link::new(ca, now).expect("config"), Link::new(cb, now).expect("config")],
            wires: [Wire::new(net, now), Wire::new(net, now)],
            sinks: [Sink::default(), Sink::default()],
            delivered: [Vec::new(), Vec::new()],
            sent_pns: [Vec::new(), Vec::new()],
            backoffs: Vec::new(),
            buf: Vec::new(),
        }
    }

    fn flush(&mut self, i: usize) {
        loop {
            let before = self.links[i].stats();
            let Some(t) = self.links[i].poll_transmit(self.now, &mut self.buf, 16) else { break };
            assert!(t.segment_size <= 1452 || t.segment_size <= self.buf.len());
            for seg in self.buf[..t.len].chunks(t.segment_size) {
                let h = Header::parse(seg).expect("own datagram parses");
                let largest = self.sent_pns[i].last().map(|p| p.1);
                self.sent_pns[i].push((h.phase, expand_pn(largest, h.truncated_pn)));
                self.wires[i].push(&mut self.rng, self.now, seg);
            }
            let after = self.links[i].stats();
            if i == 0 && after.window < before.window {
                self.backoffs.push((before.window, after.window));
            }
        }
    }

    fn step(&mut self) {
        for i in 0..2 {
            self.flush(i);
        }
        let next = [
            self.wires[0].next_at(),
            self.wires[1].next_at(),
            self.links[0].poll_timeout(),
            self.links[1].poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(next) = next else { return };
        self.now = self.now.max(next);
        for w in 0..2 {
            let to = 1 - w;
            while let Some(mut d) = self.wires[w].pop_due(self.now) {
                let before = self.links[to].stats();
                match self.links[to].handle_datagram(&mut d, self.now) {
                    Ok(Some(r)) => self.sinks[to].take(&r),
                    Ok(None) => {}
                    Err(PlaneError::Replayed(_)) => {} // the network duplicated it
                    Err(e) => panic!("datagram refused: {e}"),
                }
                let after = self.links[to].stats();
                if to == 0 && after.window < before.window {
                    self.backoffs.push((before.window, after.window));
                }
            }
        }
        for i in 0..2 {
            if self.links[i].poll_timeout().is_some_and(|t| t <= self.now) {
                let before = self.links[i].stats();
                self.links[i].handle_timeout(self.now);
                let after = self.links[i].stats();
                if i == 0 && after.window < before.window {
                    self.backoffs.push((before.window, after.window));
                }
            }
            while let Some(e) = self.links[i].poll_event() {
                match e {
                    Event::Delivered { tag, .. } => self.delivered[i].push(tag),
                    Event::KeysExhausted => panic!("keys exhausted"),
                }
            }
        }
    }

    /// Runs until every message is delivered both ways, or `limit` of virtual time passes.
    fn run(&mut self, expect: [&HashMap<u64, Vec<u8>>; 2], limit: Duration) {
        let start = self.now;
        loop {
            let done = (0..2).all(|i| {
                self.delivered[i].len() == expect[i].len()
                    && self.sinks[1 - i].msgs.values().filter(|m| m.2).count() == expect[i].len()
            });
            if done {
                break;
            }
            assert!(
                self.now - start < limit,
                "not done after {limit:?}: {:?} / {:?}",
                self.links[0].stats(),
                self.links[1].stats()
            );
            self.step();
        }
        for (i, sent) in expect.iter().enumerate() {
            for (tag, data) in sent.iter() {
                let got = &self.sinks[1 - i].msgs[tag];
                assert!(got.0 == *data, "message {tag} from end {i} arrived altered");
            }
            let mut d = self.delivered[i].clone();
            d.sort_unstable();
            d.dedup();
            assert_eq!(d.len(), self.delivered[i].len(), "a message reported delivered twice");
            assert_eq!(d.len(), sent.len());
        }
    }
}

fn queue_messages(
    sim: &mut Sim,
    end: usize,
    count: u64,
    max_len: usize,
    tag_base: u64,
) -> HashMap<u64, Vec<u8>> {
    let mut rng = Rng::new(tag_base ^ 0xabcdef);
    let mut out = HashMap::new();
    for t in 0..count {
        let len = rng.below(max_len + 1);
        let data: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        if t % 2 == 1 {
            // Every other message as a head and a shared body, split anywhere.
            let h = rng.below(len.min(sender::MAX_HEAD) + 1);
            let body = bytes::Bytes::copy_from_slice(&data[h..]);
            sim.links[end].send_parts(tag_base + t, &data[..h], body).expect("queued");
        } else {
            sim.links[end].send(tag_base + t, data.clone()).expect("queued");
        }
        out.insert(tag_base + t, data);
    }
    out
}

fn exactly_once(loss: f64, seed: u64) -> Sim {
    let mut sim = Sim::new(seed, NetConfig::lossy(loss), |_| {});
    let mut a = queue_messages(&mut sim, 0, 60, 200_000, 1000);
    sim.links[0].send(999, Vec::new()).expect("an empty message is a message");
    a.insert(999, Vec::new());
    let b = queue_messages(&mut sim, 1, 20, 20_000, 5000);
    sim.run([&a, &b], Duration::from_secs(60));
    sim
}

#[test]
fn every_message_arrives_once_and_intact_at_1_percent_loss() {
    for seed in [1, 2, 3] {
        let sim = exactly_once(0.01, seed);
        let s = sim.links[0].stats();
        assert!(s.sender.lost > 0 && s.sender.retransmitted > 0, "seed {seed}: {s:?}");
    }
}

#[test]
fn every_message_arrives_once_and_intact_at_10_percent_loss() {
    for seed in [4, 5] {
        let sim = exactly_once(0.10, seed);
        let s = sim.links[0].stats();
        assert!(s.sender.lost > 100, "seed {seed}: {s:?}");
        assert!(
            sim.links[1].stats().duplicate_fragments > 0,
            "duplication and spurious resends were exercised"
        );
    }
}

#[test]
fn window_backs_off_on_loss_and_grows_without_it() {
    let net = NetConfig { loss: 0.0, dup: 0.0, jitter: Duration::ZERO, ..NetConfig::lossy(0.0) };
    let mut clean = Sim::new(9, net, |_| {});
    let initial = clean.links[0].stats().window;
    let a = queue_messages(&mut clean, 0, 5, 400_000, 1);
    clean.run([&a, &HashMap::new()], Duration::from_secs(10));
    let grown = clean.links[0].stats();
    assert!(grown.window > 4 * initial, "window {} from {initial}", grown.window);

    // Plain CUBIC (no random-loss tolerance) takes every loss round as congestion.
    let mut lossy = Sim::new(9, NetConfig::lossy(0.02), |c| c.tolerate_random_loss = false);
    let a = queue_messages(&mut lossy, 0, 20, 400_000, 1);
    lossy.run([&a, &HashMap::new()], Duration::from_secs(30));
    let s = lossy.links[0].stats();
    assert!(s.sender.congestion_events > 0);
    assert!(!lossy.backoffs.is_empty());
    for (before, after) in &lossy.backoffs {
        assert!(after < before);
    }
    assert!(s.window < grown.window, "lossy {} clean {}", s.window, grown.window);
}

#[test]
fn random_loss_without_a_queue_costs_little_throughput_when_tolerated() {
    let goodput = |loss: f64, tolerate: bool| {
        let net = NetConfig { loss, dup: 0.0, jitter: Duration::ZERO, ..NetConfig::lossy(0.0) };
        let mut sim = Sim::new(77, net, |c| c.tolerate_random_loss = tolerate);
        let a = queue_messages(&mut sim, 0, 16, 1 << 20, 1);
        let bytes: usize = a.values().map(Vec::len).sum();
        let start = sim.now;
        sim.run([&a, &HashMap::new()], Duration::from_secs(60));
        bytes as f64 / (sim.now - start).as_secs_f64()
    };
    let clean = goodput(0.0, true);
    let tolerant = goodput(0.01, true);
    let plain = goodput(0.01, false);
    assert!(tolerant > 0.5 * clean, "1% loss: {tolerant} against {clean} B/s clean");
    assert!(plain < tolerant, "plain CUBIC backs off on random loss: {plain} against {tolerant}");
}

#[test]
fn a_bottleneck_queue_makes_the_window_settle_instead_of_grow_forever() {
    let net = NetConfig {
        loss: 0.0,
        dup: 0.0,
        rate: 1.25e8,
        queue: Duration::from_micros(500),
        ..NetConfig::lossy(0.0)
    };
    let mut sim = Sim::new(21, net, |_| {});
    let a = queue_messages(&mut sim, 0, 40, 500_000, 1);
    sim.run([&a, &HashMap::new()], Duration::from_secs(30));
    let s = sim.links[0].stats();
    assert!(s.sender.congestion_events > 0, "drop-tail losses reduce the window: {s:?}");
    // Bandwidth-delay product plus the queue: 125 MB/s * (0.4 ms + 0.5 ms) ~ 112 KB.
    assert!(s.window < 1_000_000, "window {}", s.window);
}

/// Two ends of one link on `lane`, made at `now` with keys from `seed`.
fn links(seed: u8, lane: u8, now: Instant) -> (Link, Link) {
    let (ka, kb) = keys(seed);
    let a = Link::new(LinkConfig::new(ka, lane), now).expect("config");
    let b = Link::new(LinkConfig::new(kb, lane), now).expect("config");
    (a, b)
}

fn one_datagram(seed: u8) -> (Link, Link, Vec<u8>, Instant) {
    let now = Instant::now();
    let (mut a, b) = links(seed, 2, now);
    a.send(7, vec![0x5a; 3000]).expect("queued");
    let mut buf = Vec::new();
    let t = a.poll_transmit(now, &mut buf, 1).expect("a datagram");
    buf.truncate(t.len);
    (a, b, buf, now)
}

#[test]
fn a_replayed_datagram_is_refused_and_changes_nothing() {
    let (_a, mut b, d, now) = one_datagram(1);
    let mut first = d.clone();
    let r = b.handle_datagram(&mut first, now).expect("opens").expect("a fragment");
    assert_eq!((r.tag, r.offset), (7, 0));
    let before = format!("{b:?}");
    let mut again = d.clone();
    assert_eq!(b.handle_datagram(&mut again, now), Err(PlaneError::Replayed(0)));
    assert_eq!(format!("{b:?}"), before);
}

#[test]
fn forged_garbled_and_foreign_datagrams_change_nothing() {
    let (_a, mut b, d, now) = one_datagram(3);
    let before = format!("{b:?}");
    // Every single-bit flip, in the header, the ciphertext and the tag.
    for bit in 0..d.len() * 8 {
        let mut g = d.clone();
        g[bit / 8] ^= 1 << (bit % 8);
        assert!(b.handle_datagram(&mut g, now).is_err(), "bit {bit}");
        assert_eq!(format!("{b:?}"), before, "bit {bit} changed state");
    }
    // Random bytes behind a valid header, and a datagram sealed under other keys.
    let mut rng = Rng::new(77);
    for _ in 0..200 {
        let mut g = d.clone();
        for x in &mut g[HEADER_LEN..] {
            *x = rng.next_u64() as u8;
        }
        assert_eq!(b.handle_datagram(&mut g, now), Err(PlaneError::Auth));
    }
    // Another link's datagram is refused by its id, before any AEAD work; with this link's
    // id written in, its tag does not verify.
    let (_x, _y, mut foreign, _) = one_datagram(99);
    assert!(matches!(b.handle_datagram(&mut foreign.clone(), now), Err(PlaneError::UnknownLink(_))));
    foreign[2..10].copy_from_slice(&b.recv_id().to_be_bytes());
    assert_eq!(b.handle_datagram(&mut foreign, now), Err(PlaneError::Auth));
    assert_eq!(b.handle_datagram(&mut d[..10].to_vec(), now), Err(PlaneError::Short(10)));
    let mut other_lane = d.clone();
    other_lane[1] = 3;
    assert_eq!(b.handle_datagram(&mut other_lane, now), Err(PlaneError::WrongLane { got: 3, want: 2 }));
    assert_eq!(format!("{b:?}"), before);
    // And the genuine datagram still opens afterwards.
    let mut good = d.clone();
    assert!(b.handle_datagram(&mut good, now).expect("opens").is_some());
}

#[test]
fn a_refused_fragment_is_not_acknowledged_and_arrives_once_when_resent() {
    let mut now = Instant::now();
    let (mut a, mut b) = links(8, 0, now);
    // b has a packet in flight to a, which a acknowledges on its (one-fragment) message.
    b.send(2, vec![1; 64]).expect("queued");
    let mut buf = Vec::new();
    let t = b.poll_transmit(now, &mut buf, 1).expect("b's datagram");
    a.handle_datagram(&mut buf[..t.len], now).expect("opens");
    assert!(b.stats().in_flight > 0);
    a.send(5, vec![3; 100]).expect("queued");
    let t = a.poll_transmit(now, &mut buf, 1).expect("a's datagram");
    let mut offered = Vec::new();
    let r = b.handle_datagram_admit(&mut buf[..t.len], now, |o| {
        offered.push(*o);
        false
    });
    assert_eq!(r, Err(PlaneError::OverBudget));
    assert_eq!(offered, [Offer { tag: 5, seq: 0, offset: 0, len: 100, total_len: 100, opens: true }]);
    assert_eq!(b.stats().in_flight, 0, "the ACK the refused datagram carried was taken in");
    assert_eq!(b.stats().packets_received, 0, "the refused datagram was not recorded");
    now += Duration::from_millis(20);
    assert_eq!(b.poll_transmit(now, &mut buf, 1), None, "nothing to acknowledge");
    // a resends (its probe timeout), and now b takes it: exactly once.
    let mut got = Vec::new();
    for _ in 0..100 {
        now += Duration::from_millis(5);
        a.handle_timeout(now);
        while let Some(t) = a.poll_transmit(now, &mut buf, 1) {
            if let Some(r) = b.handle_datagram(&mut buf[..t.len], now).expect("opens") {
                got.push((r.tag, r.data.len(), r.complete));
            }
        }
        while let Some(t) = b.poll_transmit(now, &mut buf, 1) {
            let _ = a.handle_datagram(&mut buf[..t.len], now);
        }
    }
    assert_eq!(got, [(5, 100, true)]);
    assert_eq!(a.stats().in_flight, 0, "acknowledged once taken");
}

#[test]
fn keys_update_and_traffic_continues_across_updates() {
    let mut sim = Sim::new(31, NetConfig::lossy(0.02), |c| c.rekey_after = 300);
    let a = queue_messages(&mut sim, 0, 40, 100_000, 1);
    let b = queue_messages(&mut sim, 1, 10, 10_000, 100);
    sim.run([&a, &b], Duration::from_secs(60));
    let (sa, sb) = (sim.links[0].stats(), sim.links[1].stats());
    assert!(sa.send_key_updates >= 5, "{sa:?}");
    assert_eq!(sb.recv_key_updates, sa.send_key_updates, "the peer followed every update");
    // Packet numbers strictly increase, so none repeats under any key, and each key seals
    // about `rekey_after` packets (more only while waiting for the peer's ack of the phase).
    for pns in &sim.sent_pns {
        assert!(pns.windows(2).all(|w| w[1].1 == w[0].1 + 1), "numbers are consecutive");
        let mut run = 0;
        for w in pns.windows(2) {
            run = if w[1].0 == w[0].0 { run + 1 } else { 0 };
            assert!(run < 2 * 300, "a key sealed {run} packets");
        }
    }
}

#[test]
fn a_side_that_only_acknowledges_still_updates_its_keys() {
    // The receiver sends nothing but ACKs, which nobody acknowledges: its PING after each
    // update is what lets it update again instead of running into AES-GCM's limit.
    let mut sim = Sim::new(33, NetConfig::lossy(0.01), |c| c.rekey_after = 40);
    let a = queue_messages(&mut sim, 0, 30, 100_000, 1);
    sim.run([&a, &HashMap::new()], Duration::from_secs(60));
    let (sa, sb) = (sim.links[0].stats(), sim.links[1].stats());
    let acks_sent = sb.sender.packets_sent;
    assert!(acks_sent > 10 * 40, "{sb:?}");
    assert!(
        sb.send_key_updates >= acks_sent / 40 / 2,
        "{} updates in {acks_sent} packets",
        sb.send_key_updates
    );
    assert_eq!(sa.recv_key_updates, sb.send_key_updates);
}

#[test]
fn gso_batches_are_full_segments_then_at_most_one_short_one() {
    let now = Instant::now();
    let (mut a, mut b) = links(5, 0, now);
    // 1452 - 30 (header, tag) - 7 (DATA: type, seq, tag, 2-byte total and offset) = 1415,
    // down to a multiple of 8.
    let frag = 1408;
    let msg: Vec<u8> = (0..5 * frag + 17).map(|i| (i % 251) as u8).collect();
    a.send(1, msg.clone()).expect("queued");
    let mut buf = Vec::new();
    let t = a.poll_transmit(now, &mut buf, 64).expect("a batch");
    assert_eq!(t.segment_size, OVERHEAD + 7 + frag);
    assert_eq!(t.segments(), 6);
    assert_eq!(t.len, 5 * t.segment_size + OVERHEAD + 7 + 17, "the tail fragment ends the batch");
    let mut got = vec![0u8; msg.len()];
    for seg in buf[..t.len].chunks_mut(t.segment_size) {
        assert!(is_plane_datagram(seg[0]));
        let r = b.handle_datagram(seg, now).expect("opens").expect("data");
        assert_eq!(r.offset % 8, 0, "fragments never split an 8-byte element");
        got[r.offset as usize..r.offset as usize + r.data.len()].copy_from_slice(r.data);
    }
    assert_eq!(got, msg);
}

/// A one-fragment message queued behind a long one being sent goes out in the next
/// datagram, ahead of the long one's remaining fragments (which then resume where they
/// were), and both arrive whole: a credit or a tunnelled connection's notification does
/// not wait for megabytes of another transfer on the same link.
#[test]
fn a_short_message_goes_ahead_of_the_rest_of_a_long_one() {
    let now = Instant::now();
    let (mut a, mut b) = links(9, 0, now);
    let long: Vec<u8> = (0..40 * 1408).map(|i| (i % 251) as u8).collect();
    let short = vec![0xee; 48];
    let first = a.send(1, long.clone()).expect("queued");
    let mut buf = Vec::new();
    let mut order = Vec::new();
    let mut got_long = vec![0u8; long.len()];
    let mut got_short = Vec::new();
    let mut deliver =
        |b: &mut Link, buf: &mut Vec<u8>, t: Transmit, order: &mut Vec<(u64, u64)>, now: Instant| {
            for seg in buf[..t.len].chunks_mut(t.segment_size) {
                let r = b.handle_datagram(seg, now).expect("opens").expect("data");
                order.push((r.seq, r.offset));
                if r.seq == first {
                    got_long[r.offset as usize..r.offset as usize + r.data.len()].copy_from_slice(r.data);
                } else {
                    got_short.extend_from_slice(r.data);
                }
            }
        };
    // Three fragments of the long message go, then the short one is queued.
    let t = a.poll_transmit(now, &mut buf, 3).expect("a batch");
    deliver(&mut b, &mut buf, t, &mut order, now);
    let second = a.send(2, short.clone()).expect("queued");
    let t = a.poll_transmit(now, &mut buf, 1).expect("a datagram");
    deliver(&mut b, &mut buf, t, &mut order, now);
    assert_eq!(order.last(), Some(&(second, 0)), "the short message goes next: {order:?}");
    // The rest, with the receiver's ACKs fed back (the window) and time moving (the pacer).
    let mut now = now;
    let mut acks = Vec::new();
    for _ in 0..1000 {
        if order.len() == 41 {
            break;
        }
        now += Duration::from_millis(1);
        while let Some(t) = a.poll_transmit(now, &mut buf, 8) {
            deliver(&mut b, &mut buf, t, &mut order, now);
        }
        while let Some(t) = b.poll_transmit(now, &mut acks, 8) {
            for seg in acks[..t.len].chunks_mut(t.segment_size) {
                a.handle_datagram(seg, now).expect("an ACK opens");
            }
        }
    }
    let long_offsets: Vec<u64> = order.iter().filter(|(s, _)| *s == first).map(|(_, o)| *o).collect();
    assert_eq!(
        long_offsets,
        (0..40).map(|i| i * 1408).collect::<Vec<u64>>(),
        "the long one resumes in order"
    );
    assert_eq!(got_long, long);
    assert_eq!(got_short, short);
    assert_eq!(order.len(), 41, "every fragment once: {order:?}");
}

#[test]
fn fragments_with_smaller_headers_are_padded_into_the_batch() {
    let now = Instant::now();
    let (mut a, mut b) = links(6, 0, now);
    // A 4-byte tag makes message 0's DATA header 3 bytes longer than message 1's.
    // Both cut into 1408-byte fragments: 1452 - 30 - 10 = 1412 and 1452 - 30 - 7 = 1415,
    // down to multiples of 8.
    let frag = 1408;
    a.send(1 << 20, vec![7; 3 * frag]).expect("queued");
    a.send(1, vec![9; 2 * frag]).expect("queued");
    let mut buf = Vec::new();
    let t = a.poll_transmit(now, &mut buf, 64).expect("a batch");
    assert_eq!((t.segment_size, t.len), (OVERHEAD + 10 + frag, 5 * (OVERHEAD + 10 + frag)));
    let mut bytes = [0usize; 2];
    for seg in buf[..t.len].chunks_mut(t.segment_size) {
        let r = b.handle_datagram(seg, now).expect("opens").expect("data");
        assert!(r.data.iter().all(|x| *x == if r.tag == 1 { 9 } else { 7 }));
        bytes[(r.tag == 1) as usize] += r.data.len();
    }
    assert_eq!(bytes, [3 * frag, 2 * frag]);
}

#[test]
fn bad_configuration_is_refused_with_its_cause() {
    let now = Instant::now();
    let mut c = LinkConfig::new(keys(1).0, 0);
    c.max_datagram = 500;
    assert!(matches!(Link::new(c.clone(), now), Err(PlaneError::Config(m)) if m.contains("max_datagram")));
    c.max_datagram = 1452;
    c.rekey_after = 1 << 23;
    assert!(matches!(Link::new(c, now), Err(PlaneError::Config(m)) if m.contains("rekey_after")));
}

/// Seal and open throughput of one core, in place, at the datagram sizes of MTU 1500 and
/// 9000. `cargo test --release -p meshd-proto plane_crypto_throughput -- --ignored --nocapture`
#[test]
#[ignore = "a benchmark: run in release with --ignored --nocapture"]
fn plane_crypto_throughput() {
    use super::keys::PacketKey;
    let key = PacketKey::from_secret(&[9; 32]);
    let header = [0x20u8, 0, 0, 0, 0, 0];
    for payload in [1452 - 22, 8952 - 22] {
        let n = (500_000_000 / payload) as u64;
        let mut buf = vec![0x33u8; payload + 16];
        // Best of 5 for each, so that other work on the machine inflates the figure less.
        let (mut seal, mut open) = (f64::MAX, f64::MAX);
        for _ in 0..5 {
            let t = Instant::now();
            for pn in 0..n {
                let tag = key.seal(pn, &header, &mut buf[..payload]);
                buf[payload..].copy_from_slice(tag.as_ref());
            }
            seal = seal.min(t.elapsed().as_secs_f64());
            // Open the same sealed datagram n times from a pristine copy: the copy back is
            // part of the figure, as a receive buffer's fill would be.
            let sealed = buf.clone();
            let mut ok = 0u64;
            let t = Instant::now();
            for _ in 0..n {
                buf.copy_from_slice(&sealed);
                ok += key.open(n - 1, &header, &mut buf).is_some() as u64;
            }
            open = open.min(t.elapsed().as_secs_f64());
            assert_eq!(ok, n);
        }
        let gb = (n * payload as u64) as f64 / 1e9;
        println!(
            "payload {payload} B: seal {:.2} GB/s, open (with a copy) {:.2} GB/s per core",
            gb / seal,
            gb / open
        );
    }
}

/// CPU seconds this thread has used (user + system), from /proc on Linux: a figure that
/// other work on a shared machine inflates far less than wall time.
fn thread_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    // After the command name: state is field 3, utime 14 and stime 15 (1-based, man 5 proc).
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// Both ends of a link on one core, no loss, real clock: 1 GiB through `poll_transmit`,
/// `handle_datagram` and the ACKs back. What a core spends per byte in the plane itself,
/// crypto included, without a socket.
/// `cargo test --release -p meshd-proto plane_link_throughput -- --ignored --nocapture`
#[test]
#[ignore = "a benchmark: run in release with --ignored --nocapture"]
fn plane_link_throughput() {
    for (max_datagram, _rep) in [1452, 8952].into_iter().flat_map(|m| (0..3).map(move |r| (m, r))) {
        let now = Instant::now();
        let (ka, kb) = keys(42);
        let mut ca = LinkConfig::new(ka, 0);
        ca.max_datagram = max_datagram;
        let mut cb = LinkConfig::new(kb, 0);
        cb.max_datagram = max_datagram;
        let mut a = Link::new(ca, now).expect("config");
        let mut b = Link::new(cb, now).expect("config");
        let total: usize = 1 << 30;
        let msg = 4 << 20;
        // The application's buffers, touched once and recycled through `Delivered`.
        let mut queued = 0usize;
        let mut tag = 0u64;
        for _ in 0..16 {
            a.send(tag, vec![tag as u8 | 1; msg]).expect("queued");
            queued += msg;
            tag += 1;
        }
        let (mut abuf, mut bbuf) = (Vec::new(), Vec::new());
        let mut received = 0usize;
        let mut checksum = 0u64;
        let start = Instant::now();
        let cpu0 = thread_cpu_seconds();
        while received < total {
            let now = Instant::now();
            a.handle_timeout(now);
            while let Some(t) = a.poll_transmit(now, &mut abuf, 64) {
                for seg in abuf[..t.len].chunks_mut(t.segment_size) {
                    if let Some(r) = b.handle_datagram(seg, now).expect("opens") {
                        received += r.data.len();
                        checksum = checksum.wrapping_add(u64::from(r.data[r.data.len() - 1]));
                    }
                }
            }
            while let Some(t) = b.poll_transmit(now, &mut bbuf, 64) {
                for seg in bbuf[..t.len].chunks_mut(t.segment_size) {
                    a.handle_datagram(seg, now).expect("opens");
                }
            }
            while let Some(e) = a.poll_event() {
                if let Event::Delivered { .. } = e {
                    if queued < total {
                        a.send(tag, vec![tag as u8 | 1; msg]).expect("queued");
                        queued += msg;
                        tag += 1;
                    }
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let cpu = thread_cpu_seconds().zip(cpu0).map_or(f64::NAN, |(b, a)| b - a);
        println!(
            "max_datagram {max_datagram}: {:.2} GB/s wall, {:.2} CPU s/GB for both ends ({} packets, window {} B, checksum {checksum})",
            total as f64 / secs / 1e9,
            cpu / (total as f64 / 1e9),
            a.stats().sender.packets_sent,
            a.stats().window,
        );
    }
}

/// Goodput of one direction in the simulator (virtual time, so the figure does not depend
/// on this machine): 1.25 GB/s bottleneck, 0.4 ms RTT, 2 ms of queue, at several random
/// loss rates. What loss-based congestion control gives up to random loss.
/// `cargo test --release -p meshd-proto plane_goodput_under_loss -- --ignored --nocapture`
#[test]
#[ignore = "a measurement: run in release with --ignored --nocapture"]
fn plane_goodput_under_loss() {
    for (loss, tolerate) in [0.0, 0.001, 0.01].into_iter().flat_map(|l| [(l, true), (l, false)]) {
        let net = NetConfig { loss, dup: 0.0, jitter: Duration::ZERO, ..NetConfig::lossy(0.0) };
        let mut sim = Sim::new(77, net, |c| c.tolerate_random_loss = tolerate);
        let a = queue_messages(&mut sim, 0, 64, 2 << 20, 1);
        let bytes: usize = a.values().map(Vec::len).sum();
        let start = sim.now;
        sim.run([&a, &HashMap::new()], Duration::from_secs(600));
        let secs = (sim.now - start).as_secs_f64();
        let s = sim.links[0].stats();
        println!(
            "loss {:.1}%, tolerate_random_loss {tolerate}: {:.3} GB/s goodput, window {} B at the end, {} congestion events, {} lost",
            loss * 100.0,
            bytes as f64 / secs / 1e9,
            s.window,
            s.sender.congestion_events,
            s.sender.lost
        );
    }
}

/// Two flows from two links share one drop-tail bottleneck for `secs` of virtual time;
/// returns the bytes each delivered. `cfg[i]` sets flow i's random-loss tolerance.
fn share_bottleneck(tolerant: [bool; 2], net: NetConfig, secs: f64) -> [u64; 2] {
    let t0 = Instant::now();
    let mut rng = Rng::new(4242);
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for (i, tol) in tolerant.iter().enumerate() {
        let (ka, kb) = keys(10 + 2 * i as u8);
        let mut ca = LinkConfig::new(ka, 0);
        ca.tolerate_random_loss = *tol;
        let mut cb = LinkConfig::new(kb, 0);
        cb.tolerate_random_loss = *tol;
        senders.push(Link::new(ca, t0).expect("config"));
        receivers.push(Link::new(cb, t0).expect("config"));
    }
    // The forward path is shared; ACKs come back over an uncongested path.
    let mut forward = Wire::new(net, t0);
    let mut back: BTreeMap<(Instant, u64), (usize, Vec<u8>)> = BTreeMap::new();
    let mut owner: HashMap<u64, usize> = HashMap::new();
    let mut got = [0u64; 2];
    let mut now = t0;
    let mut buf = Vec::new();
    let mut n = 0u64;
    let end = t0 + Duration::from_secs_f64(secs);
    while now < end {
        for i in 0..2 {
            while senders[i].queued_bytes() < 4 << 20 {
                senders[i].send(n, vec![i as u8; 256 << 10]).expect("queued");
                n += 1;
            }
            while let Some(t) = senders[i].poll_transmit(now, &mut buf, 16) {
                for seg in buf[..t.len].chunks(t.segment_size) {
                    let before = forward.n;
                    forward.push(&mut rng, now, seg);
                    for k in before + 1..=forward.n {
                        owner.insert(k, i);
                    }
                }
            }
            while let Some(t) = receivers[i].poll_transmit(now, &mut buf, 16) {
                for seg in buf[..t.len].chunks(t.segment_size) {
                    n += 1;
                    back.insert((now + net.delay, n), (i, seg.to_vec()));
                }
            }
            while senders[i].poll_event().is_some() {}
        }
        let next = [forward.next_at(), back.keys().next().map(|k| k.0)]
            .into_iter()
            .chain((0..2).flat_map(|i| [senders[i].poll_timeout(), receivers[i].poll_timeout()]))
            .flatten()
            .min();
        let Some(next) = next else { break };
        now = now.max(next);
        while let Some((&k, _)) = forward.queue.iter().next() {
            if k.0 > now {
                break;
            }
            let mut d = forward.queue.remove(&k).expect("present");
            let i = owner.remove(&k.1).expect("owner");
            if let Some(r) = receivers[i].handle_datagram(&mut d, now).expect("opens") {
                got[i] += r.data.len() as u64;
            }
        }
        while let Some((&k, _)) = back.iter().next() {
            if k.0 > now {
                break;
            }
            let (i, mut d) = back.remove(&k).expect("present");
            senders[i].handle_datagram(&mut d, now).expect("opens");
        }
        for i in 0..2 {
            for l in [&mut senders[i], &mut receivers[i]] {
                if l.poll_timeout().is_some_and(|t| t <= now) {
                    l.handle_timeout(now);
                }
            }
        }
    }
    got
}

#[test]
fn a_loss_tolerant_flow_leaves_a_plain_cubic_flow_its_share() {
    for queue_us in [200, 2000] {
        let net = NetConfig {
            loss: 0.0,
            dup: 0.0,
            jitter: Duration::ZERO,
            rate: 1.25e8,
            queue: Duration::from_micros(queue_us),
            delay: Duration::from_micros(200),
        };
        let plain = share_bottleneck([false, false], net, 2.0);
        let mixed = share_bottleneck([true, false], net, 2.0);
        println!("queue {queue_us} us: plain vs plain {plain:?}, tolerant vs plain {mixed:?}");
        let total = mixed[0] + mixed[1];
        assert!(total as f64 > 0.8 * 1.25e8 * 2.0, "the bottleneck stays busy: {mixed:?}");
        assert!(3 * mixed[1] >= total, "the plain CUBIC flow keeps a third: {mixed:?}");
    }
}
