//! The local service socket (`MESHD_SOCKET`, reached by any process of the node's user):
//! `[u32 BE header length][JSON header]`, parsed by `collective/request.rs`. The payload
//! itself is not parsed (its size is), so inputs stop after the header.
//!
//! Checks: a header length above the bound is refused before anything is allocated; a
//! header that parses announces a payload within `MAX_PAYLOAD`; every request is judged
//! without panicking, within bounds (store keys and values, broadcast roots, a
//! `store_get` wait that `Duration::from_secs_f64` accepts); an in-place buffer is
//! non-null, within `MAX_PAYLOAD`, does not wrap and comes without a payload; a hello's
//! probe round-trips through its hex form; and a parsed request, written back as the
//! Python client would write it, parses to the same request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshd_fuzz::request::{
    InPlace, Kind, MAX_HEADER, MAX_PAYLOAD, MAX_STORE_WAIT_S, PROBE_LEN, Request, header_len, parse_header,
    parse_in_place, parse_probe, parse_request,
};
use meshd_proto::wire::{MAX_STORE_KEY, MAX_STORE_VALUE};
use serde_json::{Value, json};
use std::time::Duration;

/// World size the requests are judged against.
const WORLD: u32 = 16;

/// The header a client sends for `r` (the form `python/meshd` uses).
fn render(r: &Request, nbytes: usize) -> Option<Value> {
    Some(match r {
        Request::Hello { rank } => json!({"op": "hello", "rank": rank, "nbytes": nbytes}),
        Request::Collective(Ok(Kind::AllReduce(d, o))) => {
            json!({"op": "allreduce", "dtype": d.name(), "reduce": o.name(), "nbytes": nbytes})
        }
        Request::Collective(Ok(Kind::Broadcast(root))) => {
            json!({"op": "broadcast", "root": root, "nbytes": nbytes})
        }
        Request::Collective(Ok(Kind::Barrier)) => json!({"op": "barrier", "nbytes": nbytes}),
        Request::StoreSet(Ok(key)) => json!({"op": "store_set", "key": key, "nbytes": nbytes}),
        Request::StoreGet { key, timeout } => {
            json!({"op": "store_get", "key": key, "timeout": timeout, "nbytes": nbytes})
        }
        Request::Unknown(op) if !op.is_empty() => json!({"op": op, "nbytes": nbytes}),
        _ => return None,
    })
}

fn check(r: &Request, nbytes: usize) {
    match r {
        Request::Collective(Ok(Kind::Broadcast(root))) => assert!(*root < WORLD),
        Request::StoreSet(Ok(key)) => {
            assert!(!key.is_empty() && key.len() <= MAX_STORE_KEY && nbytes <= MAX_STORE_VALUE)
        }
        Request::StoreGet { timeout, .. } => {
            assert!((0.0..=MAX_STORE_WAIT_S).contains(timeout), "timeout {timeout}");
            let _ = Duration::from_secs_f64(*timeout);
        }
        Request::Unknown(op) => {
            assert!(!matches!(
                op.as_str(),
                "hello" | "allreduce" | "broadcast" | "barrier" | "store_set" | "store_get"
            ))
        }
        _ => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((prefix, head)) = data.split_first_chunk::<4>() else { return };
    let n = match header_len(*prefix) {
        Ok(n) => n,
        Err(_) => {
            assert!(u32::from_be_bytes(*prefix) as usize > MAX_HEADER);
            return;
        }
    };
    assert!(n <= MAX_HEADER);
    // The service reads exactly n header bytes; take what the input has.
    let head = &head[..n.min(head.len())];
    let Ok((v, nbytes)) = parse_header(head) else { return };
    assert!(nbytes <= MAX_PAYLOAD);
    let r = parse_request(&v, nbytes, WORLD);
    check(&r, nbytes);
    if let Ok(Some(InPlace { addr, len })) = parse_in_place(&v, nbytes) {
        assert!(addr != 0 && len <= MAX_PAYLOAD && addr.checked_add(len as u64).is_some() && nbytes == 0);
        let back = json!({"addr": addr, "len": len});
        assert_eq!(parse_in_place(&back, 0), Ok(Some(InPlace { addr, len })));
    }
    if let Some((addr, bytes)) = parse_probe(&v) {
        assert!(addr != 0 && bytes.len() == PROBE_LEN);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(parse_probe(&json!({"probe_addr": addr, "probe": hex})), Some((addr, bytes)));
    }
    if let Some(back) = render(&r, nbytes) {
        let bytes = serde_json::to_vec(&back).expect("json");
        let (v2, n2) = parse_header(&bytes).expect("a rendered header parses");
        assert_eq!(n2, nbytes);
        match (parse_request(&v2, n2, WORLD), &r) {
            // serde_json's default float parsing may land one ulp off.
            (Request::StoreGet { key: k2, timeout: t2 }, Request::StoreGet { key, timeout }) => {
                assert_eq!(&k2, key);
                assert!((t2 - timeout).abs() <= timeout.abs() * 1e-15, "{t2} != {timeout}");
            }
            (r2, r) => assert_eq!(&r2, r, "{back}"),
        }
    }
});
