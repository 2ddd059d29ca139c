//! One end of a plane link fed datagrams a member holding the link's keys could send:
//! fuzzer-chosen frames sealed with the peer's real key and link id, some of them altered,
//! replayed, of another link or another key phase, in a fuzzer-chosen packet-number order,
//! with the application's budget (`handle_datagram_admit`) refusing some new fragments.
//!
//! Input: byte 0 picks which offers the budget refuses; then records of
//! `[kind][pn step][plaintext length u16 BE][plaintext]`.
//!
//! Checks:
//! - no panic, whatever arrives;
//! - a refused datagram (any error but the budget's) changes nothing in the link;
//! - every byte of every message reaches the application at most once, inside its message,
//!   and `complete` is reported exactly when the last missing byte arrived;
//! - the link never has more messages partly received than it allows;
//! - what the link sends back opens under its own key and parses, and its ACKs name only
//!   packets the link accepted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshd_proto::plane::frame;
use meshd_proto::plane::keys::{PacketKey, link_id};
use meshd_proto::plane::packet::{HEADER_LEN, Header, TAG_LEN};
use meshd_proto::plane::ranges::RangeSet;
use meshd_proto::plane::{Link, LinkConfig, LinkKeys, PlaneError};
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

const OURS: [u8; 32] = [1; 32];
const THEIRS: [u8; 32] = [2; 32];
const MAX_OPEN: usize = 8;

/// Seals `plain` as the peer would: header (phase, lane 0, `id`, `pn`), ciphertext, tag.
fn seal(key: &PacketKey, phase: bool, id: u64, pn: u64, plain: &[u8]) -> Vec<u8> {
    let mut d = vec![0u8; HEADER_LEN + plain.len() + TAG_LEN];
    Header::write(phase, 0, id, pn, &mut d);
    d[HEADER_LEN..HEADER_LEN + plain.len()].copy_from_slice(plain);
    let (head, body) = d.split_at_mut(HEADER_LEN);
    let tag = key.seal(pn, head, &mut body[..plain.len()]);
    d[HEADER_LEN + plain.len()..].copy_from_slice(tag.as_ref());
    d
}

fuzz_target!(|data: &[u8]| {
    let Some((&policy, mut rest)) = data.split_first() else { return };
    let start = Instant::now();
    let mut cfg = LinkConfig::new(LinkKeys { send: OURS, recv: THEIRS }, 0);
    cfg.max_incoming_messages = MAX_OPEN;
    cfg.max_message_len = 1 << 20;
    let Ok(mut link) = Link::new(cfg, start) else { return };
    let theirs = PacketKey::from_secret(&THEIRS);
    let ours = PacketKey::from_secret(&OURS);
    let id = link_id(&THEIRS);
    let mut pn = 0u64;
    let mut sent: Vec<Vec<u8>> = Vec::new();
    let mut accepted: BTreeSet<u32> = BTreeSet::new();
    let mut delivered: HashMap<u64, (u64, RangeSet, u64, bool)> = HashMap::new();
    let mut offers = 0u32;
    let mut buf = Vec::new();
    let mut now = start;
    while let Some((head, tail)) = rest.split_first_chunk::<4>() {
        let [kind, step, hi, lo] = *head;
        let len = usize::from(u16::from_be_bytes([hi, lo])).min(tail.len()).min(1400);
        let (plain, more) = tail.split_at(len);
        rest = more;
        now += Duration::from_micros(u64::from(step) * 50);
        // Mostly forward, sometimes back (reordering), now and then far ahead.
        pn = match step {
            0..=191 => pn + 1 + u64::from(step % 4),
            192..=254 => pn.saturating_sub(u64::from(step % 32)),
            255 => pn + 5000,
        };
        let mut d = match kind % 5 {
            1 => {
                let mut d = seal(&theirs, false, id, pn, plain);
                let at = usize::from(step) % d.len();
                d[at] ^= 1 << (kind % 8);
                d
            }
            2 if !sent.is_empty() => sent[usize::from(step) % sent.len()].clone(),
            3 => seal(&theirs, false, id ^ 1, pn, plain),
            4 => seal(&theirs, true, id, pn, plain),
            _ => seal(&theirs, false, id, pn, plain),
        };
        sent.push(d.clone());
        let before = format!("{link:?}");
        let truncated = u32::from_be_bytes([d[10], d[11], d[12], d[13]]);
        let res = link.handle_datagram_admit(&mut d, now, |_| {
            offers += 1;
            (policy >> (offers % 8)) & 1 == 0
        });
        match res {
            Err(PlaneError::OverBudget) => {}
            Err(_) => assert_eq!(format!("{link:?}"), before, "a refused datagram changed the link"),
            Ok(r) => {
                accepted.insert(truncated);
                if let Some(r) = r {
                    let (tag, got, total, done) =
                        delivered.entry(r.seq).or_insert((r.tag, RangeSet::default(), r.total_len, false));
                    assert_eq!((*tag, *total), (r.tag, r.total_len), "a message changed its tag or length");
                    assert!(!*done, "bytes of message {} after it completed", r.seq);
                    let range = r.offset..r.offset + r.data.len() as u64;
                    assert!(range.end <= r.total_len, "{range:?} past {}", r.total_len);
                    assert!(!got.overlaps(range.clone()), "bytes {range:?} of message {} twice", r.seq);
                    got.insert(range);
                    let have = got.iter_rev().map(|g| g.end - g.start).sum::<u64>();
                    assert_eq!(r.complete, have == r.total_len, "complete misreported");
                    *done = r.complete;
                }
            }
        }
        let open = delivered.values().filter(|(_, g, _, done)| !done && !g.is_empty()).count();
        assert!(open <= MAX_OPEN, "{open} messages open");
        // What the link answers opens under its own key and acknowledges only what it took.
        while let Some(t) = link.poll_transmit(now, &mut buf, 4) {
            for seg in buf[..t.len].chunks_mut(t.segment_size) {
                let h = Header::parse(seg).expect("own header");
                let (hd, body) = seg.split_at_mut(HEADER_LEN);
                let plain = ours.open(u64::from(h.truncated_pn), hd, body).expect("own datagram opens");
                let f = frame::parse(plain).expect("own frames parse");
                if let Some(a) = f.ack {
                    for r in a.ranges() {
                        for n in r {
                            assert!(accepted.contains(&(n as u32)), "ACK of {n}, never taken");
                        }
                    }
                }
            }
        }
    }
});
