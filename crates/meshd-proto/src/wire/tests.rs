use super::*;
use crate::rendezvous::{Message as Rm, Roster, RosterMember};
use crate::store::{StoreError, Version};

fn roster() -> Roster {
    Roster {
        run_hash: 7,
        restart: 0,
        epoch: 3,
        master_port: 29500,
        members: vec![RosterMember {
            id: NodeId::from_u128(1),
            addr: "198.19.0.7:29400".parse().expect("addr"),
            nproc: 2,
            hostname: "h1".into(),
        }],
    }
}

#[test]
fn frames_round_trip() {
    let frames = vec![
        Frame::Rdzv(Rm::Propose(roster())),
        Frame::Rdzv(Rm::Ack { restart: 0, epoch: 3 }),
        Frame::Rdzv(Rm::Commit { restart: 0, epoch: 3 }),
        Frame::Store(StoreMsg::Set {
            restart: 2,
            key: "MASTER_ADDR".into(),
            value: b"198.19.0.1".to_vec(),
            version: Version { counter: 41, writer: NodeId::from_u128(5) },
        }),
        Frame::Store(StoreMsg::Ack {
            restart: 2,
            version: Version { counter: 41, writer: NodeId::from_u128(5) },
            refused: Some(StoreError::Full { held: 1, needed: 2, max: 3 }),
        }),
    ];
    for f in frames {
        let bytes = encode(&f);
        let back: Frame = decode(&bytes).expect("decode");
        assert_eq!(back, f);
    }
    let hello = AuthHello {
        version: PROTOCOL_VERSION,
        node: NodeId::from_u128(9),
        run_hash: 1,
        mac: [7; 32],
        has_token: true,
        observed: Some("198.19.0.3:40000".parse().expect("addr")),
        lane: 3,
        pake: Some(PakeMessage { side: 0x53, point: [2; 32] }),
    };
    assert_eq!(decode::<AuthHello>(&encode(&hello)).expect("hello"), hello);
}

#[test]
fn truncated_frames_are_rejected_not_panicking() {
    let bytes = encode(&Frame::Rdzv(Rm::Propose(roster())));
    for cut in 0..bytes.len() {
        assert!(decode::<Frame>(&bytes[..cut]).is_err(), "prefix {cut} decoded");
    }
}

#[test]
fn trailing_and_oversized_are_rejected() {
    let mut bytes = encode(&Frame::Rdzv(Rm::Ack { restart: 0, epoch: 1 }));
    bytes.push(0);
    assert_eq!(decode::<Frame>(&bytes), Err(WireError::Trailing(1)));
    let huge = vec![0u8; MAX_FRAME + 1];
    assert_eq!(decode::<Frame>(&huge), Err(WireError::TooLarge(MAX_FRAME + 1)));
    assert!(check_len(((MAX_FRAME + 1) as u32).to_be_bytes()).is_err());
    assert_eq!(check_len(10u32.to_be_bytes()), Ok(10));
}

#[test]
fn unknown_variant_is_an_error() {
    // A variant index far past the end of the enum (a newer peer, or garbage).
    assert!(matches!(decode::<Frame>(&[0x7f, 0, 0]), Err(WireError::Malformed(_))));
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = crate::rng::Rng::new(0xfeed);
    for _ in 0..20_000 {
        let len = rng.below(64);
        let buf: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        let _ = decode::<Frame>(&buf);
        let _ = decode::<AuthHello>(&buf);
    }
}

#[test]
fn mutated_frames_never_panic() {
    let base = encode(&Frame::Rdzv(Rm::Propose(roster())));
    let mut rng = crate::rng::Rng::new(0xbeef);
    for _ in 0..20_000 {
        let mut b = base.clone();
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(b.len());
            b[i] = rng.next_u64() as u8;
        }
        let _ = decode::<Frame>(&b);
    }
}

#[test]
fn status_replies_round_trip_with_their_words() {
    use crate::membership::MemberStatus;
    let member = |n: u128, health, role| StatusMember {
        id: NodeId::from_u128(n),
        hostname: format!("gpu{n}"),
        addr: "198.19.0.7:29400".parse().expect("addr"),
        iface: "eth1".into(),
        gpus: 8,
        nproc: 8,
        state: crate::NodeState::Running,
        health,
        rtt_us: Some(180),
        role,
        restarts: 0,
    };
    let reply = StatusReply {
        node: NodeId::from_u128(1),
        members: vec![
            member(1, MemberStatus::Alive, MemberRole::Master),
            member(2, MemberStatus::Suspect, MemberRole::Worker),
            member(3, MemberStatus::Left, MemberRole::Waiting),
        ],
    };
    assert_eq!(decode::<StatusReply>(&encode(&reply)).expect("status"), reply);
    // `meshd status` prints these words; scripts and the lab tests read them.
    let words: Vec<String> =
        reply.members.iter().map(|m| format!("{} {} {}", m.state, m.health, m.role)).collect();
    assert_eq!(words, ["running alive master", "running suspect worker", "running left waiting"]);
    assert_eq!(MemberStatus::Dead.to_string(), "dead");
}
