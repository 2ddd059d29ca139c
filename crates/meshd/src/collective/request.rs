//! The requests of the local service socket, parsed by pure functions.
//!
//! A message on the socket is `[u32 big-endian header length][JSON header][payload]`
//! (see [`super::service`]). Everything a local process controls before meshd acts on it
//! is decided here, without IO: the header length ([`header_len`]), the header itself and
//! the payload size it announces ([`parse_header`]), and what is asked ([`parse_request`]).
//!
//! This file names only `meshd_proto` and `serde_json` (no `crate::` paths): `fuzz/`
//! compiles it on its own, so fuzzing it does not build the QUIC stack.

use meshd_proto::reduce::{DType, ReduceOp};
use meshd_proto::wire::{MAX_STORE_KEY, MAX_STORE_VALUE};
use serde_json::Value;

/// Largest header accepted on the socket.
pub const MAX_HEADER: usize = 64 << 10;
/// Largest payload accepted (per call).
pub const MAX_PAYLOAD: usize = 4 << 30;
/// Longest a `store_get` may wait, seconds.
pub const MAX_STORE_WAIT_S: f64 = 86_400.0;

/// Why a request is refused; the rank reads these words in its error reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestError {
    /// The header length prefix is above [`MAX_HEADER`].
    HeaderTooLarge(usize),
    /// The header is no JSON object (the parser's words).
    BadHeader(String),
    /// The announced payload is above [`MAX_PAYLOAD`].
    PayloadTooLarge(u64),
    /// A `store_set` key or value outside the store's limits.
    StoreLimits,
    /// An allreduce's `dtype` or `reduce` is not known (the parser's words).
    BadArgument(String),
    /// A broadcast root that is no rank.
    NotARank {
        /// The root asked for.
        root: u64,
        /// The world size.
        world: u32,
    },
    /// An in-place buffer's `addr` is missing, zero or not an unsigned integer.
    BadAddress,
    /// An in-place request without `len`.
    NoLength,
    /// An in-place buffer above [`MAX_PAYLOAD`].
    BufferTooLarge(u64),
    /// `addr + len` overflows.
    Wraps,
    /// An in-place request that also carries a payload.
    InPlaceWithPayload,
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequestError::HeaderTooLarge(n) => write!(f, "header of {n} bytes is too large"),
            RequestError::BadHeader(e) => write!(f, "bad header: {e}"),
            RequestError::PayloadTooLarge(n) => write!(f, "payload of {n} bytes is too large"),
            RequestError::StoreLimits => {
                write!(f, "store keys are 1..{MAX_STORE_KEY} bytes, values at most {MAX_STORE_VALUE}")
            }
            RequestError::BadArgument(e) => f.write_str(e),
            RequestError::NotARank { root, world } => {
                write!(f, "broadcast root {root} is not a rank (world size {world})")
            }
            RequestError::BadAddress => f.write_str("addr must be a non-zero unsigned integer"),
            RequestError::NoLength => f.write_str("an in-place request needs len"),
            RequestError::BufferTooLarge(n) => write!(f, "buffer of {n} bytes is too large"),
            RequestError::Wraps => f.write_str("addr + len wraps around"),
            RequestError::InPlaceWithPayload => f.write_str("an in-place request carries no payload"),
        }
    }
}

impl std::error::Error for RequestError {}

/// What a collective request asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Kind {
    /// Allreduce of the payload's elements.
    AllReduce(DType, ReduceOp),
    /// The payload of global rank `root` to everyone.
    Broadcast(u32),
    /// Wait for every rank.
    Barrier,
}

/// One request, as far as it can be judged without the node's state.
#[derive(Clone, Debug, PartialEq)]
pub enum Request {
    /// `hello`: the sender's global rank (`u64::MAX` when missing).
    Hello {
        /// Claimed global rank.
        rank: u64,
    },
    /// `allreduce`, `broadcast` or `barrier`, or why its arguments are refused.
    Collective(Result<Kind, RequestError>),
    /// `store_set` of the payload under a key, or why it is refused.
    StoreSet(Result<String, RequestError>),
    /// `store_get`: a key and how long to wait for it (seconds, in `0..=MAX_STORE_WAIT_S`).
    StoreGet {
        /// The key.
        key: String,
        /// Seconds to wait.
        timeout: f64,
    },
    /// Anything else: the `op` given ("" when missing).
    Unknown(String),
}

/// The header length from a message's 4-byte prefix, refused above [`MAX_HEADER`] before
/// anything is allocated.
pub fn header_len(prefix: [u8; 4]) -> Result<usize, RequestError> {
    let n = u32::from_be_bytes(prefix) as usize;
    if n > MAX_HEADER {
        return Err(RequestError::HeaderTooLarge(n));
    }
    Ok(n)
}

/// Parses a JSON header; returns it with the payload length it announces (`nbytes`, 0
/// when missing), refused above [`MAX_PAYLOAD`].
pub fn parse_header(head: &[u8]) -> Result<(Value, usize), RequestError> {
    let v: Value = serde_json::from_slice(head).map_err(|e| RequestError::BadHeader(e.to_string()))?;
    let nbytes = v.get("nbytes").and_then(Value::as_u64).unwrap_or(0);
    match usize::try_from(nbytes) {
        Ok(n) if n <= MAX_PAYLOAD => Ok((v, n)),
        _ => Err(RequestError::PayloadTooLarge(nbytes)),
    }
}

/// What a header asks for; `nbytes` is the payload's length and `world` the number of
/// global ranks.
pub fn parse_request(req: &Value, nbytes: usize, world: u32) -> Request {
    let op = req.get("op").and_then(Value::as_str).unwrap_or("");
    match op {
        "hello" => Request::Hello { rank: req.get("rank").and_then(Value::as_u64).unwrap_or(u64::MAX) },
        "allreduce" | "broadcast" | "barrier" => Request::Collective(parse_kind(op, req, world)),
        "store_set" => {
            let key = req.get("key").and_then(Value::as_str).unwrap_or("");
            if key.is_empty() || key.len() > MAX_STORE_KEY || nbytes > MAX_STORE_VALUE {
                Request::StoreSet(Err(RequestError::StoreLimits))
            } else {
                Request::StoreSet(Ok(key.to_string()))
            }
        }
        "store_get" => {
            let key = req.get("key").and_then(Value::as_str).unwrap_or("").to_string();
            let timeout =
                req.get("timeout").and_then(Value::as_f64).unwrap_or(30.0).clamp(0.0, MAX_STORE_WAIT_S);
            Request::StoreGet { key, timeout }
        }
        other => Request::Unknown(other.to_string()),
    }
}

/// A buffer a local rank asks meshd to use in place (cross-memory attach): its address in
/// the rank's process and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlace {
    /// Start address in the rank's process.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
}

/// The in-place buffer a collective header names (`addr`, `len`), if any. Such a request
/// carries no payload (`nbytes` must be 0); the range must be non-null and not wrap.
pub fn parse_in_place(req: &Value, nbytes: usize) -> Result<Option<InPlace>, RequestError> {
    let Some(addr) = req.get("addr") else { return Ok(None) };
    let addr = addr.as_u64().filter(|a| *a != 0).ok_or(RequestError::BadAddress)?;
    let len = req.get("len").and_then(Value::as_u64).ok_or(RequestError::NoLength)?;
    let len =
        usize::try_from(len).ok().filter(|l| *l <= MAX_PAYLOAD).ok_or(RequestError::BufferTooLarge(len))?;
    if addr.checked_add(len as u64).is_none() {
        return Err(RequestError::Wraps);
    }
    if nbytes != 0 {
        return Err(RequestError::InPlaceWithPayload);
    }
    Ok(Some(InPlace { addr, len }))
}

/// Length of the probe a hello may carry to test cross-memory attach.
pub const PROBE_LEN: usize = 16;

/// The probe of a hello, if any: the address of `PROBE_LEN` bytes in the client and the
/// bytes meshd should find there (`probe_addr`, `probe` in hex).
pub fn parse_probe(req: &Value) -> Option<(u64, [u8; PROBE_LEN])> {
    let addr = req.get("probe_addr").and_then(Value::as_u64).filter(|a| *a != 0)?;
    let hex = req.get("probe").and_then(Value::as_str)?;
    if hex.len() != 2 * PROBE_LEN || !hex.is_ascii() {
        return None;
    }
    let mut bytes = [0u8; PROBE_LEN];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some((addr, bytes))
}

fn parse_kind(op: &str, req: &Value, world: u32) -> Result<Kind, RequestError> {
    match op {
        "allreduce" => {
            let dtype = DType::parse(req.get("dtype").and_then(Value::as_str).unwrap_or("float32"))
                .map_err(|e| RequestError::BadArgument(e.to_string()))?;
            let rop = ReduceOp::parse(req.get("reduce").and_then(Value::as_str).unwrap_or("sum"))
                .map_err(|e| RequestError::BadArgument(e.to_string()))?;
            Ok(Kind::AllReduce(dtype, rop))
        }
        "broadcast" => {
            let root = req.get("root").and_then(Value::as_u64).unwrap_or(0);
            if root >= u64::from(world) {
                return Err(RequestError::NotARank { root, world });
            }
            Ok(Kind::Broadcast(root as u32))
        }
        _ => Ok(Kind::Barrier),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn header_and_payload_bounds() {
        assert_eq!(header_len((MAX_HEADER as u32).to_be_bytes()), Ok(MAX_HEADER));
        assert!(header_len((MAX_HEADER as u32 + 1).to_be_bytes()).is_err());
        assert_eq!(parse_header(br#"{"op":"barrier"}"#).map(|h| h.1), Ok(0));
        assert_eq!(parse_header(br#"{"nbytes":4294967296}"#).map(|h| h.1), Ok(MAX_PAYLOAD));
        assert!(parse_header(br#"{"nbytes":4294967297}"#).is_err());
        assert!(parse_header(b"{").is_err());
    }

    #[test]
    fn requests() {
        let p = |v: Value, n| parse_request(&v, n, 4);
        assert_eq!(p(json!({"op": "hello", "rank": 3}), 0), Request::Hello { rank: 3 });
        assert_eq!(p(json!({"op": "hello"}), 0), Request::Hello { rank: u64::MAX });
        assert_eq!(
            p(json!({"op": "allreduce", "dtype": "bf16", "reduce": "avg"}), 8),
            Request::Collective(Ok(Kind::AllReduce(DType::BF16, ReduceOp::Avg)))
        );
        assert!(matches!(p(json!({"op": "allreduce", "dtype": "cheese"}), 8), Request::Collective(Err(_))));
        assert_eq!(p(json!({"op": "broadcast", "root": 3}), 0), Request::Collective(Ok(Kind::Broadcast(3))));
        assert!(matches!(p(json!({"op": "broadcast", "root": 4}), 0), Request::Collective(Err(_))));
        assert_eq!(p(json!({"op": "barrier"}), 0), Request::Collective(Ok(Kind::Barrier)));
        assert_eq!(p(json!({"op": "store_set", "key": "k"}), 1), Request::StoreSet(Ok("k".into())));
        assert!(matches!(p(json!({"op": "store_set", "key": ""}), 1), Request::StoreSet(Err(_))));
        assert!(matches!(
            p(json!({"op": "store_set", "key": "k"}), MAX_STORE_VALUE + 1),
            Request::StoreSet(Err(_))
        ));
        assert_eq!(
            p(json!({"op": "store_get", "key": "k", "timeout": -5}), 0),
            Request::StoreGet { key: "k".into(), timeout: 0.0 }
        );
        assert_eq!(
            p(json!({"op": "store_get", "key": "k", "timeout": 1e300}), 0),
            Request::StoreGet { key: "k".into(), timeout: MAX_STORE_WAIT_S }
        );
        assert_eq!(p(json!({"op": 7}), 0), Request::Unknown(String::new()));
    }

    #[test]
    fn in_place_buffers() {
        let ip = |v: Value, n| parse_in_place(&v, n);
        assert_eq!(ip(json!({"op": "allreduce"}), 8), Ok(None));
        assert_eq!(ip(json!({"addr": 4096, "len": 64}), 0), Ok(Some(InPlace { addr: 4096, len: 64 })));
        assert!(ip(json!({"addr": 0, "len": 64}), 0).is_err());
        assert!(ip(json!({"addr": -1, "len": 64}), 0).is_err());
        assert!(ip(json!({"addr": 4096}), 0).is_err());
        assert!(ip(json!({"addr": 4096, "len": MAX_PAYLOAD as u64 + 1}), 0).is_err());
        assert!(ip(json!({"addr": u64::MAX - 10, "len": 64}), 0).is_err());
        assert!(ip(json!({"addr": 4096, "len": 64}), 64).is_err(), "payload and address both");
    }

    #[test]
    fn probes() {
        let hex = "000102030405060708090a0b0c0d0eff";
        let want = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 255];
        assert_eq!(parse_probe(&json!({"probe_addr": 8, "probe": hex})), Some((8, want)));
        assert_eq!(parse_probe(&json!({"probe_addr": 8, "probe": &hex[2..]})), None);
        assert_eq!(parse_probe(&json!({"probe_addr": 8, "probe": "zz0102030405060708090a0b0c0d0eff"})), None);
        assert_eq!(parse_probe(&json!({"probe_addr": 8, "probe": "é0102030405060708090a0b0c0d0e0f"})), None);
        assert_eq!(parse_probe(&json!({"probe_addr": 0, "probe": hex})), None);
        assert_eq!(parse_probe(&json!({"probe": hex})), None);
    }
}
