use super::*;

fn all_requests() -> Vec<Request> {
    let k = |s: &str| s.as_bytes().to_vec();
    vec![
        Request::Ping(0x1234_5678),
        Request::Set { key: k("/a"), value: k("v") },
        Request::CompareSet { key: k("/a"), expected: vec![], desired: k("x") },
        Request::Get { key: k("/a") },
        Request::Add { key: k("/c"), delta: -7 },
        Request::Check { keys: vec![k("/a"), k("/b")] },
        Request::Wait { keys: vec![k("/a")] },
        Request::NumKeys,
        Request::DeleteKey { key: k("/a") },
        Request::Append { key: k("/a"), value: k("zz") },
        Request::MultiGet { keys: vec![k("/a"), k("")] },
        Request::MultiSet { pairs: vec![(k("/a"), k("1")), (k("/b"), vec![0, 255])] },
        Request::CancelWait,
        Request::QueuePush { key: k("/q"), value: k("x") },
        Request::QueuePop { key: k("/q") },
        Request::QueueLen { key: k("/q") },
        Request::ListKeys,
        Request::Barrier { key: k("/b"), world_size: 2 },
    ]
}

fn current_decoder() -> Decoder {
    let mut d = Decoder::new(WireLimits::default());
    let mut hello = Vec::new();
    encode_validate(&mut hello);
    assert_eq!(d.decode(&hello), Ok(Decoded::Handshake(5)));
    assert_eq!(d.dialect(), Some(Dialect::Current));
    d
}

#[test]
fn bytes_recorded_from_torch_2_15() {
    // VALIDATE + PING as torch 2.15 sends them on connect, then set('k', 'v').
    let wire = [
        0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 0x3b, 0x15, 0x00, 0x00, 0x01, 2, 0, 0, 0, 0, 0, 0, 0, b'/', b'k',
        1, 0, 0, 0, 0, 0, 0, 0, b'v',
    ];
    let mut d = Decoder::new(WireLimits::default());
    assert_eq!(d.decode(&wire), Ok(Decoded::Handshake(5)));
    assert_eq!(d.decode(&wire[5..]), Ok(Decoded::Request(Request::Ping(0x153b), 5)));
    assert_eq!(
        d.decode(&wire[10..]),
        Ok(Decoded::Request(Request::Set { key: b"/k".to_vec(), value: b"v".to_vec() }, 20))
    );
}

#[test]
fn bytes_recorded_from_torch_1_13() {
    // get('zz') from torch 1.13: WAIT (5) on one key, then GET (2); no handshake.
    let wire = [
        5, 1, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, b'/', b'z', b'z', 2, 3, 0, 0, 0, 0, 0, 0, 0, b'/',
        b'z', b'z',
    ];
    let mut d = Decoder::new(WireLimits::default());
    assert_eq!(d.decode(&wire), Ok(Decoded::Request(Request::Wait { keys: vec![b"/zz".to_vec()] }, 20)));
    assert_eq!(d.dialect(), Some(Dialect::Legacy));
    assert_eq!(d.decode(&wire[20..]), Ok(Decoded::Request(Request::Get { key: b"/zz".to_vec() }, 12)));
}

#[test]
fn legacy_set_starting_with_zero_is_not_a_handshake() {
    let mut wire = Vec::new();
    assert!(Request::Set { key: b"/k".to_vec(), value: b"v".to_vec() }.encode(Dialect::Legacy, &mut wire));
    assert_eq!(wire[0], 0);
    let mut d = Decoder::new(WireLimits::default());
    // One byte alone could still be either.
    assert_eq!(d.decode(&wire[..1]), Ok(Decoded::Incomplete(5)));
    assert_eq!(
        d.decode(&wire),
        Ok(Decoded::Request(Request::Set { key: b"/k".to_vec(), value: b"v".to_vec() }, wire.len()))
    );
    assert_eq!(d.dialect(), Some(Dialect::Legacy));
}

#[test]
fn every_request_round_trips_and_every_prefix_is_incomplete() {
    for req in all_requests() {
        for dialect in [Dialect::Current, Dialect::Legacy] {
            let mut wire = Vec::new();
            if !req.encode(dialect, &mut wire) {
                assert_eq!(dialect, Dialect::Legacy, "{req:?}");
                continue;
            }
            let mut d = match dialect {
                Dialect::Current => current_decoder(),
                Dialect::Legacy => {
                    let mut d = Decoder::new(WireLimits::default());
                    // Teach it the dialect with a legacy NUMKEYS first.
                    assert_eq!(d.decode(&[6]), Ok(Decoded::Request(Request::NumKeys, 1)));
                    d
                }
            };
            for cut in 0..wire.len() {
                match d.decode(&wire[..cut]) {
                    Ok(Decoded::Incomplete(n)) => assert!(n > cut && n <= wire.len(), "{req:?} cut {cut}"),
                    other => panic!("{req:?} cut at {cut}: {other:?}"),
                }
            }
            // With a following query in the buffer, only the first is consumed.
            let mut two = wire.clone();
            two.push(wire[0]);
            assert_eq!(d.decode(&two), Ok(Decoded::Request(req.clone(), wire.len())));
        }
    }
}

#[test]
fn absurd_lengths_are_refused_before_their_bytes_arrive() {
    let mut d = current_decoder();
    let mut wire = vec![current_type::SET];
    wire.extend_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(d.decode(&wire), Err(DecodeError::KeyTooLong(u64::MAX)));

    let mut d = current_decoder();
    let mut wire = vec![current_type::SET, 1, 0, 0, 0, 0, 0, 0, 0, b'k'];
    wire.extend_from_slice(&(1u64 << 40).to_le_bytes());
    assert_eq!(d.decode(&wire), Err(DecodeError::ValueTooLong(1 << 40)));

    let mut d = current_decoder();
    let mut wire = vec![current_type::MULTI_GET];
    wire.extend_from_slice(&(1u64 << 62).to_le_bytes());
    assert_eq!(d.decode(&wire), Err(DecodeError::TooManyKeys(1 << 62)));
}

#[test]
fn request_limit_bounds_a_multi_set() {
    let limits = WireLimits { max_request_len: 100, ..WireLimits::default() };
    let mut d = Decoder::new(limits);
    assert_eq!(d.decode(&[0, 0xce, 0xf7, 0x85, 0x3c]), Ok(Decoded::Handshake(5)));
    let pairs = (0..10).map(|i| (vec![i; 4], vec![i; 8])).collect();
    let mut wire = Vec::new();
    Request::MultiSet { pairs }.encode(Dialect::Current, &mut wire);
    assert_eq!(d.decode(&wire), Err(DecodeError::RequestTooLong));
}

#[test]
fn unknown_types_are_refused() {
    let mut d = current_decoder();
    assert_eq!(d.decode(&[19]), Err(DecodeError::UnknownType { dialect: Dialect::Current, byte: 19 }));
    // VALIDATE again after the handshake.
    let mut d = current_decoder();
    assert!(d.decode(&[0, 0xce, 0xf7, 0x85, 0x3c]).is_err());
    // torch 1.13's WATCH_KEY is not served, nor 2.x's numbers past 8 on a 1.13 connection.
    for b in [7u8, 9, 13, 200] {
        let mut d = Decoder::new(WireLimits::default());
        assert_eq!(d.decode(&[b]), Err(DecodeError::UnknownType { dialect: Dialect::Legacy, byte: b }));
    }
}

#[test]
fn replies_encode_as_torch_reads_them() {
    assert_eq!(Reply::Byte(STOP_WAITING).to_bytes(), vec![0]);
    assert_eq!(Reply::Byte(WAIT_CANCELED).to_bytes(), vec![1]);
    assert_eq!(Reply::Nonce(0x0102_0304).to_bytes(), vec![4, 3, 2, 1]);
    assert_eq!(Reply::Int(-1).to_bytes(), vec![0xff; 8]);
    assert_eq!(Reply::Value(b"ab".to_vec()).to_bytes(), vec![2, 0, 0, 0, 0, 0, 0, 0, b'a', b'b']);
    assert_eq!(
        Reply::Values(vec![vec![], b"x".to_vec()]).to_bytes(),
        vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, b'x']
    );
    assert_eq!(Reply::Popped { len_before: 0, value: None }.to_bytes(), vec![0; 8]);
    let mut popped = vec![2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0];
    popped.push(b'v');
    assert_eq!(Reply::Popped { len_before: 2, value: Some(b"v".to_vec()) }.to_bytes(), popped);
    let mut keys = vec![1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0];
    keys.extend_from_slice(b"/k");
    assert_eq!(Reply::Keys(vec![b"/k".to_vec()]).to_bytes(), keys);
}
