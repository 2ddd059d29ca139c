//! What a peer sends before and outside the authenticated frames: the `AuthHello` of the
//! connection's first stream (read with a 1 KiB bound, decoded before the MAC is checked),
//! and on probe connections the `Query` (64-byte bound) and the `StatusReply` that
//! `meshd status` decodes. The first input byte picks the message.
//!
//! Checks `meshd_fuzz::check_wire` for each, and: a hello that decodes allocated nothing
//! at all (a fixed-size struct: an unauthenticated peer cannot make a node allocate) and
//! re-encodes within the 1 KiB bound; a query is a single byte.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshd_fuzz::check_wire;
use meshd_proto::wire::{self, AuthHello, Query, StatusReply};

/// What the transport reads of a hello (`read_to_end(1024)`) and of a query.
const HELLO_MAX: usize = 1024;
const QUERY_MAX: usize = 64;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else { return };
    match sel % 3 {
        0 if body.len() <= HELLO_MAX => {
            if let Some((hello, heap)) = check_wire::<AuthHello>(body) {
                assert_eq!(heap.allocs, 0, "decoding {hello:?} allocated");
                assert!(wire::encode(&hello).len() <= HELLO_MAX);
            }
        }
        1 if body.len() <= QUERY_MAX => {
            if let Some((q, _)) = check_wire::<Query>(body) {
                assert_eq!(wire::encode(&q).len(), 1);
            }
        }
        2 => {
            let _ = check_wire::<StatusReply>(body);
        }
        _ => {}
    }
});
