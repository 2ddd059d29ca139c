//! Seed inputs for each target, encoded from real messages by the real encoders (the
//! `gen_seeds` binary writes them out), so the fuzzer starts from every variant.

use meshd_proto::membership::{MemberState, MemberStatus, Message as Gm, Update, UpdateKind};
use meshd_proto::meta::{IfaceAddr, NodeMeta, NodeState};
use meshd_proto::preflight::{NodeReport, TcpProbe, TcpTarget};
use meshd_proto::rendezvous::{Message as Rm, Roster, RosterMember};
use meshd_proto::ring::{Phase, transfer_id};
use meshd_proto::store::{StoreError, Version};
use meshd_proto::wire::{
    self, AuthHello, Frame, MemberRole, PROTOCOL_VERSION, Query, StatusMember, StatusReply, StoreMsg,
};
use meshd_proto::{NodeId, ring};
use std::net::SocketAddr;

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 29400)))
}

fn id(n: u128) -> NodeId {
    NodeId::from_u128(n.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
}

fn meta(n: u128) -> NodeMeta {
    NodeMeta {
        gossip_addr: Some(addr(&format!("198.19.0.{n}:29400"))),
        hostname: format!("gpu-{n}"),
        iface: "eth1".into(),
        addrs: vec![
            IfaceAddr { name: "eth0".into(), addr: "172.17.0.4".parse().expect("ip") },
            IfaceAddr { name: "eth1".into(), addr: format!("198.19.0.{n}").parse().expect("ip") },
            IfaceAddr { name: "ib0".into(), addr: "fe80::1".parse().expect("ip") },
        ],
        nproc: 8,
        gpus: 8,
        cuda_driver: 12080,
        nccl_version: 22203,
        meshd_version: "0.1.0".into(),
        cmd_hash: 0x1234_5678_9abc_def0,
        run_hash: 0xfeed_f00d,
        state: NodeState::Running,
        restarts: 1,
        nnodes_min: 2,
        nnodes_max: 4,
    }
}

fn updates() -> Vec<Update> {
    vec![
        Update {
            id: id(1),
            incarnation: 3,
            kind: UpdateKind::Alive { addr: addr("198.19.0.1:29400"), meta: meta(1) },
        },
        Update { id: id(2), incarnation: 1, kind: UpdateKind::Suspect { accuser: id(3) } },
        Update { id: id(4), incarnation: 7, kind: UpdateKind::Dead { accuser: id(1) } },
        Update { id: id(5), incarnation: 0, kind: UpdateKind::Left },
    ]
}

fn members() -> Vec<MemberState> {
    [MemberStatus::Alive, MemberStatus::Suspect, MemberStatus::Dead, MemberStatus::Left]
        .into_iter()
        .zip(1u128..)
        .map(|(status, n)| MemberState {
            id: id(n),
            addr: addr(&format!("198.19.0.{n}:29400")),
            meta: meta(n),
            incarnation: n as u64,
            status,
        })
        .collect()
}

fn roster() -> Roster {
    Roster {
        run_hash: 0xfeed_f00d,
        restart: 1,
        epoch: 42,
        master_port: 29500,
        members: (1..=3)
            .map(|n| RosterMember {
                id: id(n),
                addr: addr(&format!("198.19.0.{n}:29400")),
                nproc: 8,
                hostname: format!("gpu-{n}"),
            })
            .collect(),
    }
}

/// Every frame variant, as nodes send them.
pub fn frames() -> Vec<Frame> {
    let report = NodeReport {
        tcp: vec![TcpProbe {
            to: id(2),
            target: "198.19.0.2:41234".into(),
            ok: false,
            detail: "connection refused".into(),
            what: TcpTarget::EphemeralPort,
        }],
        cmd_hash: 7,
        cmd: "python train.py".into(),
        nproc: 8,
        gpus: 8,
        cuda_driver: 12080,
        nccl_version: 22203,
        mtu: 9000,
        iface: "eth1".into(),
        nccl_root: "198.19.0.1:41000".into(),
        nccl_note: String::new(),
    };
    vec![
        Frame::Gossip(Gm::Ping { from: id(1), seq: 9, target: id(2), updates: updates() }),
        Frame::Gossip(Gm::Ping { from: id(1), seq: 1, target: id(2), updates: vec![] }),
        Frame::Gossip(Gm::Ack { from: id(2), seq: 9, updates: updates() }),
        Frame::Gossip(Gm::PingReq {
            from: id(1),
            seq: 10,
            target: id(3),
            target_addr: addr("[fd00::3]:29400"),
            updates: vec![],
        }),
        Frame::Gossip(Gm::IndirectAck { from: id(2), seq: 10, target: id(3), updates: vec![] }),
        Frame::Gossip(Gm::Gossip { from: id(1), updates: updates() }),
        Frame::Gossip(Gm::SyncRequest { from: id(1), members: members() }),
        Frame::Gossip(Gm::SyncResponse { from: id(2), members: members() }),
        Frame::Rdzv(Rm::Propose(roster())),
        Frame::Rdzv(Rm::Ack { restart: 1, epoch: 42 }),
        Frame::Rdzv(Rm::Commit { restart: 1, epoch: 42 }),
        Frame::Rdzv(Rm::Abort {
            restart: 1,
            node: id(2),
            hostname: "gpu-2".into(),
            rank: Some(11),
            reason: "rank 11 exited with status 1".into(),
            cause: Some(Box::new(meshd_proto::rendezvous::RankFailure {
                host: "gpu-2".into(),
                rank: 11,
                status: 1,
                message: "ValueError: boom".into(),
                traceback: "Traceback (most recent call last):\n".into(),
                ..Default::default()
            })),
        }),
        Frame::Rdzv(Rm::Signal { restart: 1, signal: 10, hostname: "gpu-1".into() }),
        Frame::Rdzv(Rm::Done { restart: 1 }),
        Frame::Rdzv(Rm::PreflightHello { restart: 1, tcp_port: 41234, nccl_id: Some(vec![2; 128]) }),
        Frame::Rdzv(Rm::PreflightHello { restart: 1, tcp_port: 41235, nccl_id: None }),
        Frame::Rdzv(Rm::PreflightReport { restart: 1, report }),
        Frame::Store(StoreMsg::Set {
            restart: 1,
            key: "MASTER_ADDR".into(),
            value: b"198.19.0.1".to_vec(),
            version: Version { counter: 7, writer: id(3) },
        }),
        Frame::Store(StoreMsg::Ack {
            restart: 1,
            version: Version { counter: 7, writer: id(3) },
            refused: None,
        }),
        Frame::Store(StoreMsg::Ack {
            restart: 1,
            version: Version { counter: 8, writer: id(3) },
            refused: Some(StoreError::Full { held: 64 << 20, needed: 10, max: 64 << 20 }),
        }),
    ]
}

/// Inputs of the `frame` target: encoded frames (datagrams and stream bodies alike).
pub fn frame_inputs() -> Vec<Vec<u8>> {
    frames().iter().map(wire::encode).collect()
}

/// Inputs of the `handshake` target: a selector byte (0 hello, 1 query, 2 status reply)
/// then the encoded message.
pub fn handshake_inputs() -> Vec<Vec<u8>> {
    let hello = |observed: Option<SocketAddr>, has_token| AuthHello {
        version: PROTOCOL_VERSION,
        node: id(1),
        run_hash: 0xfeed_f00d,
        mac: [0xa5; 32],
        has_token,
        observed,
        lane: 0,
        pake: has_token.then_some(wire::PakeMessage { side: 0x53, point: [0x42; 32] }),
    };
    let reply = StatusReply {
        node: id(1),
        members: (1..=2)
            .map(|n| StatusMember {
                id: id(n),
                hostname: format!("gpu-{n}"),
                addr: addr(&format!("198.19.0.{n}:29400")),
                iface: "eth1".into(),
                gpus: 8,
                nproc: 8,
                state: NodeState::Waiting,
                health: MemberStatus::Alive,
                rtt_us: Some(180),
                role: if n == 1 { MemberRole::Master } else { MemberRole::Worker },
                restarts: 0,
            })
            .collect(),
    };
    let mut out = Vec::new();
    let mut with = |sel: u8, body: Vec<u8>| {
        let mut v = vec![sel];
        v.extend(body);
        out.push(v);
    };
    with(0, wire::encode(&hello(None, true)));
    with(0, wire::encode(&hello(Some(addr("198.19.0.9:40000")), true)));
    with(0, wire::encode(&hello(Some(addr("[fd00::9]:40000")), false)));
    with(1, wire::encode(&Query::Status));
    with(2, wire::encode(&reply));
    with(2, wire::encode(&StatusReply::default()));
    out
}

/// Inputs of the `ring` target: a plan (n, rank, elements, element size, chunk bytes;
/// see the target) followed by received chunk headers, here the ones a real sender sends.
pub fn ring_inputs() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (n, rank, len, elem_code, chunk) in
        [(2u8, 0u8, 1000u16, 2u8, 64u8), (3, 1, 37, 0, 8), (5, 4, 3, 3, 16)]
    {
        let elem = [1usize, 2, 4, 8][usize::from(elem_code)];
        let mut v = vec![n - 1, rank, (len >> 8) as u8, len as u8, elem_code, chunk];
        // The sender (rank - 1) sends exactly what this rank receives.
        if let Ok(plan) =
            ring::RingPlan::new(usize::from(n), usize::from(rank), usize::from(len), elem, usize::from(chunk))
        {
            for step in plan.steps() {
                for t in plan.recvs(&step) {
                    v.push(0); // record kind: raw header
                    v.extend(ring::encode_chunk_header(t.id(), t.range.len() as u32));
                }
            }
        }
        out.push(v);
    }
    // A few bare headers (unknown, duplicate, oversized).
    let mut v = vec![1, 0, 0, 16, 2, 8];
    for (id, len) in
        [(transfer_id(Phase::AllGather, 0, 0), 8u32), (0, 8), (0, 8), (0, 1 << 20), (u64::MAX, 0)]
    {
        v.push(0);
        v.extend(ring::encode_chunk_header(id, len));
    }
    out.push(v);
    out
}

/// Inputs of the `service` target: socket messages as the Python client sends them
/// (`[u32 BE header length][JSON header]`, the payload left out).
pub fn service_inputs() -> Vec<Vec<u8>> {
    [
        r#"{"op": "hello", "rank": 3}"#,
        r#"{"op": "hello", "rank": 0, "probe_addr": 140737488347136, "probe": "00112233445566778899aabbccddeeff"}"#,
        r#"{"op": "allreduce", "dtype": "float32", "reduce": "sum", "addr": 140737488347136, "len": 4096}"#,
        r#"{"op": "broadcast", "root": 0, "addr": 94000000000000, "len": 37}"#,
        r#"{"op": "allreduce", "dtype": "float32", "reduce": "sum", "nbytes": 4096}"#,
        r#"{"op": "allreduce", "dtype": "bfloat16", "reduce": "avg", "nbytes": 2}"#,
        r#"{"op": "broadcast", "root": 1, "nbytes": 64}"#,
        r#"{"op": "barrier"}"#,
        r#"{"op": "store_set", "key": "MASTER_ADDR", "nbytes": 10}"#,
        r#"{"op": "store_get", "key": "MASTER_ADDR", "timeout": 30.0}"#,
        r#"{"op": "frobnicate", "nbytes": 0}"#,
    ]
    .iter()
    .map(|h| {
        let mut v = (h.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(h.as_bytes());
        v
    })
    .collect()
}

/// An ACK frame of the received numbers `pns`, type byte first, as a receiver writes it.
fn plane_ack(pns: &[u64]) -> Vec<u8> {
    use meshd_proto::plane::ack::{AckState, MAX_ACK_FRAME_LEN};
    let now = std::time::Instant::now();
    let mut st = AckState::default();
    for &pn in pns {
        st.on_packet(pn, true, now, std::time::Duration::from_millis(1));
    }
    let mut out = vec![0u8; MAX_ACK_FRAME_LEN];
    let mut n = 0;
    st.write(now, &mut out, &mut n);
    out.truncate(n);
    out
}

/// A DATA frame of message `seq` (tag 0, `total` bytes), `len` bytes at `offset`.
fn plane_data(seq: u64, total: u64, offset: u64, len: usize) -> Vec<u8> {
    use meshd_proto::plane::frame::DataHeader;
    let h = DataHeader { seq, tag: 0, total_len: total, offset };
    let mut out = vec![0u8; h.encoded_len()];
    let mut pos = 0;
    h.write(&mut out, &mut pos);
    out.extend((0..len).map(|i| i as u8));
    out
}

/// The plaintexts a link's packets carry: DATA alone, an ACK and a PING, an ACK riding on a
/// message's last fragment, padding before DATA, an empty message.
fn plane_plaintexts() -> Vec<Vec<u8>> {
    use meshd_proto::plane::frame::{FRAME_PADDING, FRAME_PING};
    let ack = plane_ack(&[0, 1, 2, 5, 6, 9, 20, 21, 100]);
    let mut ping = ack.clone();
    ping.push(FRAME_PING);
    let mut riding = plane_ack(&[3]);
    riding.extend(plane_data(7, 3000, 2816, 184));
    let mut padded = vec![FRAME_PADDING; 3];
    padded.extend(plane_data(1, 1 << 20, 1024, 1024));
    vec![plane_data(0, 3000, 0, 1408), ack, ping, riding, padded, plane_data(2, 0, 0, 0)]
}

/// Inputs of the `plane_header` target: real datagrams' first bytes (both key phases, a
/// packet number past the 32-bit wrap) and a too-short one.
pub fn plane_header_inputs() -> Vec<Vec<u8>> {
    use meshd_proto::plane::packet::{Header, OVERHEAD};
    let mut out = Vec::new();
    for (phase, lane, id, pn) in [(false, 0, 0x0123_4567_89ab_cdef, 0), (true, 7, u64::MAX, (5 << 32) + 9)] {
        let mut d = vec![0u8; OVERHEAD + 8];
        Header::write(phase, lane, id, pn, &mut d);
        out.push(d);
    }
    out.push(vec![0x22, 0, 1, 2, 3]);
    out
}

/// Inputs of the `plane_frame` target: the plaintexts of real packets.
pub fn plane_frame_inputs() -> Vec<Vec<u8>> {
    plane_plaintexts()
}

/// Inputs of the `plane_ack` target: ACK frames after their type byte.
pub fn plane_ack_inputs() -> Vec<Vec<u8>> {
    [vec![0u64], vec![0, 1, 2, 5, 6, 9, 20, 21, 100], (0..64).map(|i| i * 3).collect::<Vec<_>>()]
        .iter()
        .map(|pns| plane_ack(pns)[1..].to_vec())
        .collect()
}

/// Inputs of the `plane_link` target: a budget policy byte, then records (kind, pn step,
/// length, plaintext): a message in fragments, in order and reordered, with ACKs, a
/// replay and a forgery among them.
pub fn plane_link_inputs() -> Vec<Vec<u8>> {
    let record = |kind: u8, step: u8, plain: &[u8]| {
        let mut v = vec![kind, step];
        v.extend((plain.len() as u16).to_be_bytes());
        v.extend_from_slice(plain);
        v
    };
    let frags = [plane_data(0, 3000, 0, 1408), plane_data(0, 3000, 1408, 1408), plane_data(0, 3000, 2816, 184)];
    let mut in_order = vec![0u8];
    for f in &frags {
        in_order.extend(record(0, 0, f));
    }
    let mut mixed = vec![0b0101_0101u8];
    mixed.extend(record(0, 1, &frags[2]));
    mixed.extend(record(0, 200, &frags[0]));
    mixed.extend(record(2, 0, &frags[0]));
    mixed.extend(record(1, 9, &frags[1]));
    mixed.extend(record(0, 0, &frags[1]));
    for p in plane_plaintexts() {
        mixed.extend(record(0, 3, &p));
    }
    vec![in_order, mixed]
}
