//! The TCPStore wire messages: a pure, bounded decoder of requests and the encoders of
//! replies (and of requests, for clients and tests). No IO here.
//!
//! Every size on the wire is a little-endian u64; a length is checked against its limit
//! as soon as it is read, before anything is allocated or awaited, so a peer that
//! announces 2^63 bytes is refused with the first 9 bytes of its message.

use std::fmt;

/// The first message of a torch 2.x connection: `0x00` then this u32 (little-endian).
pub const VALIDATE_MAGIC: u32 = 0x3C85_F7CE;

/// `WaitResponseType::STOP_WAITING` (WAIT and BARRIER answers, also sent late).
pub const STOP_WAITING: u8 = 0;
/// `WaitResponseType::WAIT_CANCELED` (the answer to CANCEL_WAIT).
pub const WAIT_CANCELED: u8 = 1;
/// `CheckResponseType::READY`.
pub const READY: u8 = 0;
/// `CheckResponseType::NOT_READY`.
pub const NOT_READY: u8 = 1;

/// Which numbering of the query types a connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// torch 2.x: opens with VALIDATE + [`VALIDATE_MAGIC`]; query types of
    /// [`current_type`].
    Current,
    /// torch 1.13: no handshake; SET=0 COMPARE_SET=1 GET=2 ADD=3 CHECK=4 WAIT=5
    /// GETNUMKEYS=6 WATCH_KEY=7 (not served) DELETE_KEY=8.
    Legacy,
}

/// Query type numbers of torch 2.x (`c10d::detail::QueryType`).
pub mod current_type {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const QUEUE_PUSH: u8 = 14;
    pub const QUEUE_POP: u8 = 15;
    pub const QUEUE_LEN: u8 = 16;
    pub const LIST_KEYS: u8 = 17;
    pub const BARRIER: u8 = 18;
}

/// Query type numbers of torch 1.13.
pub mod legacy_type {
    pub const SET: u8 = 0;
    pub const COMPARE_SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const ADD: u8 = 3;
    pub const CHECK: u8 = 4;
    pub const WAIT: u8 = 5;
    pub const GETNUMKEYS: u8 = 6;
    pub const WATCH_KEY: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
}

/// One decoded query. Keys and values are bytes (torch's keys are `std::string`s).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Ping(u32),
    Set { key: Vec<u8>, value: Vec<u8> },
    CompareSet { key: Vec<u8>, expected: Vec<u8>, desired: Vec<u8> },
    Get { key: Vec<u8> },
    Add { key: Vec<u8>, delta: i64 },
    Check { keys: Vec<Vec<u8>> },
    Wait { keys: Vec<Vec<u8>> },
    NumKeys,
    DeleteKey { key: Vec<u8> },
    Append { key: Vec<u8>, value: Vec<u8> },
    MultiGet { keys: Vec<Vec<u8>> },
    MultiSet { pairs: Vec<(Vec<u8>, Vec<u8>)> },
    CancelWait,
    QueuePush { key: Vec<u8>, value: Vec<u8> },
    QueuePop { key: Vec<u8> },
    QueueLen { key: Vec<u8> },
    ListKeys,
    Barrier { key: Vec<u8>, world_size: i64 },
}

/// What the decoder refuses; the connection is closed on any of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    UnknownType { dialect: Dialect, byte: u8 },
    KeyTooLong(u64),
    ValueTooLong(u64),
    TooManyKeys(u64),
    RequestTooLong,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::UnknownType { dialect, byte } => {
                write!(f, "unknown query type {byte} ({dialect:?} numbering)")
            }
            DecodeError::KeyTooLong(n) => write!(f, "key of {n} bytes is over the limit"),
            DecodeError::ValueTooLong(n) => write!(f, "value of {n} bytes is over the limit"),
            DecodeError::TooManyKeys(n) => write!(f, "{n} keys in one query is over the limit"),
            DecodeError::RequestTooLong => write!(f, "query is longer than the request limit"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// The decoder's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireLimits {
    pub max_key_len: usize,
    pub max_value_len: usize,
    pub max_keys_per_request: usize,
    /// The whole encoded query (MULTI_SET of many values is bounded by this).
    pub max_request_len: usize,
}

impl Default for WireLimits {
    fn default() -> Self {
        WireLimits {
            max_key_len: 64 * 1024,
            max_value_len: 64 * 1024 * 1024,
            max_keys_per_request: 128 * 1024,
            max_request_len: 80 * 1024 * 1024,
        }
    }
}

/// What one call of [`Decoder::decode`] found at the start of the buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// A whole query that took this many bytes.
    Request(Request, usize),
    /// The torch 2.x VALIDATE handshake (this many bytes; the dialect is now known).
    Handshake(usize),
    /// Not enough bytes: call again once the buffer holds at least this many.
    Incomplete(usize),
}

/// A connection's decoder: learns the dialect from the first bytes, then decodes queries.
#[derive(Clone, Debug)]
pub struct Decoder {
    dialect: Option<Dialect>,
    limits: WireLimits,
}

enum Stop {
    Need(usize),
    Bad(DecodeError),
}

impl From<DecodeError> for Stop {
    fn from(e: DecodeError) -> Stop {
        Stop::Bad(e)
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    max: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Stop> {
        let end = self.pos.checked_add(n).ok_or(Stop::Bad(DecodeError::RequestTooLong))?;
        if end > self.max {
            return Err(Stop::Bad(DecodeError::RequestTooLong));
        }
        if end > self.buf.len() {
            return Err(Stop::Need(end));
        }
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Stop> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u64(&mut self) -> Result<u64, Stop> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A u64 length, refused with `err` when over `max`, then that many bytes.
    fn sized(&mut self, max: usize, err: fn(u64) -> DecodeError) -> Result<Vec<u8>, Stop> {
        let n = self.u64()?;
        if n > max as u64 {
            return Err(Stop::Bad(err(n)));
        }
        Ok(self.take(n as usize)?.to_vec())
    }
}

impl Decoder {
    pub fn new(limits: WireLimits) -> Decoder {
        Decoder { dialect: None, limits }
    }

    /// The dialect, once the first bytes told it.
    pub fn dialect(&self) -> Option<Dialect> {
        self.dialect
    }

    /// Decodes what starts `buf`. The caller drops the consumed bytes and calls again.
    pub fn decode(&mut self, buf: &[u8]) -> Result<Decoded, DecodeError> {
        let dialect = match self.dialect {
            Some(d) => d,
            None => {
                let magic = VALIDATE_MAGIC.to_le_bytes();
                match buf {
                    [] => return Ok(Decoded::Incomplete(1)),
                    // A legacy SET also starts with 0, followed by its key length: one whose
                    // low bytes spell the magic is ~1 GB, far over any key limit.
                    [0, rest @ ..] if rest.len() < 4 && magic.starts_with(rest) => {
                        return Ok(Decoded::Incomplete(5));
                    }
                    [0, rest @ ..] if rest.len() >= 4 && rest[..4] == magic => {
                        self.dialect = Some(Dialect::Current);
                        return Ok(Decoded::Handshake(5));
                    }
                    _ => {
                        self.dialect = Some(Dialect::Legacy);
                        Dialect::Legacy
                    }
                }
            }
        };
        let mut c = Cursor { buf, pos: 0, max: self.limits.max_request_len };
        match self.parse(&mut c, dialect) {
            Ok(req) => Ok(Decoded::Request(req, c.pos)),
            Err(Stop::Need(n)) => Ok(Decoded::Incomplete(n)),
            Err(Stop::Bad(e)) => Err(e),
        }
    }

    fn parse(&self, c: &mut Cursor<'_>, dialect: Dialect) -> Result<Request, Stop> {
        let l = self.limits;
        let key = |c: &mut Cursor<'_>| c.sized(l.max_key_len, DecodeError::KeyTooLong);
        let value = |c: &mut Cursor<'_>| c.sized(l.max_value_len, DecodeError::ValueTooLong);
        let count = |c: &mut Cursor<'_>| -> Result<usize, Stop> {
            let n = c.u64()?;
            if n > l.max_keys_per_request as u64 {
                return Err(Stop::Bad(DecodeError::TooManyKeys(n)));
            }
            Ok(n as usize)
        };
        let keys = |c: &mut Cursor<'_>| -> Result<Vec<Vec<u8>>, Stop> {
            let n = count(c)?;
            // Grows as keys arrive: a count alone never reserves memory.
            let mut v = Vec::new();
            for _ in 0..n {
                v.push(key(c)?);
            }
            Ok(v)
        };
        let [t] = c.array::<1>()?;
        let unknown = Stop::Bad(DecodeError::UnknownType { dialect, byte: t });
        let op = match dialect {
            Dialect::Current => t,
            Dialect::Legacy => match t {
                legacy_type::SET => current_type::SET,
                legacy_type::COMPARE_SET => current_type::COMPARE_SET,
                legacy_type::GET => current_type::GET,
                legacy_type::ADD => current_type::ADD,
                legacy_type::CHECK => current_type::CHECK,
                legacy_type::WAIT => current_type::WAIT,
                legacy_type::GETNUMKEYS => current_type::GETNUMKEYS,
                legacy_type::DELETE_KEY => current_type::DELETE_KEY,
                _ => return Err(unknown),
            },
        };
        use current_type as q;
        Ok(match op {
            q::PING => Request::Ping(u32::from_le_bytes(c.array()?)),
            q::SET => Request::Set { key: key(c)?, value: value(c)? },
            q::COMPARE_SET => Request::CompareSet { key: key(c)?, expected: value(c)?, desired: value(c)? },
            q::GET => Request::Get { key: key(c)? },
            q::ADD => Request::Add { key: key(c)?, delta: i64::from_le_bytes(c.array()?) },
            q::CHECK => Request::Check { keys: keys(c)? },
            q::WAIT => Request::Wait { keys: keys(c)? },
            q::GETNUMKEYS => Request::NumKeys,
            q::DELETE_KEY => Request::DeleteKey { key: key(c)? },
            q::APPEND => Request::Append { key: key(c)?, value: value(c)? },
            q::MULTI_GET => Request::MultiGet { keys: keys(c)? },
            q::MULTI_SET => {
                let n = count(c)?;
                let mut pairs = Vec::new();
                for _ in 0..n {
                    pairs.push((key(c)?, value(c)?));
                }
                Request::MultiSet { pairs }
            }
            q::CANCEL_WAIT => Request::CancelWait,
            q::QUEUE_PUSH => Request::QueuePush { key: key(c)?, value: value(c)? },
            q::QUEUE_POP => Request::QueuePop { key: key(c)? },
            q::QUEUE_LEN => Request::QueueLen { key: key(c)? },
            q::LIST_KEYS => Request::ListKeys,
            q::BARRIER => Request::Barrier { key: key(c)?, world_size: i64::from_le_bytes(c.array()?) },
            // VALIDATE after the first message, or a number no torch sends.
            _ => return Err(unknown),
        })
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

fn put_keys(out: &mut Vec<u8>, keys: &[Vec<u8>]) {
    out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for k in keys {
        put_bytes(out, k);
    }
}

impl Request {
    /// The query type byte of this request in `dialect`; None where that dialect has no
    /// such query (torch 1.13 has no PING, APPEND, queues...).
    pub fn type_byte(&self, dialect: Dialect) -> Option<u8> {
        use current_type as q;
        let current = match self {
            Request::Ping(_) => q::PING,
            Request::Set { .. } => q::SET,
            Request::CompareSet { .. } => q::COMPARE_SET,
            Request::Get { .. } => q::GET,
            Request::Add { .. } => q::ADD,
            Request::Check { .. } => q::CHECK,
            Request::Wait { .. } => q::WAIT,
            Request::NumKeys => q::GETNUMKEYS,
            Request::DeleteKey { .. } => q::DELETE_KEY,
            Request::Append { .. } => q::APPEND,
            Request::MultiGet { .. } => q::MULTI_GET,
            Request::MultiSet { .. } => q::MULTI_SET,
            Request::CancelWait => q::CANCEL_WAIT,
            Request::QueuePush { .. } => q::QUEUE_PUSH,
            Request::QueuePop { .. } => q::QUEUE_POP,
            Request::QueueLen { .. } => q::QUEUE_LEN,
            Request::ListKeys => q::LIST_KEYS,
            Request::Barrier { .. } => q::BARRIER,
        };
        match dialect {
            Dialect::Current => Some(current),
            Dialect::Legacy => match current {
                q::SET => Some(legacy_type::SET),
                q::COMPARE_SET => Some(legacy_type::COMPARE_SET),
                q::GET => Some(legacy_type::GET),
                q::ADD => Some(legacy_type::ADD),
                q::CHECK => Some(legacy_type::CHECK),
                q::WAIT => Some(legacy_type::WAIT),
                q::GETNUMKEYS => Some(legacy_type::GETNUMKEYS),
                q::DELETE_KEY => Some(legacy_type::DELETE_KEY),
                _ => None,
            },
        }
    }

    /// Appends this query as a client sends it; false (nothing written) where `dialect`
    /// lacks it.
    pub fn encode(&self, dialect: Dialect, out: &mut Vec<u8>) -> bool {
        let Some(t) = self.type_byte(dialect) else { return false };
        out.push(t);
        match self {
            Request::Ping(n) => out.extend_from_slice(&n.to_le_bytes()),
            Request::Set { key, value }
            | Request::Append { key, value }
            | Request::QueuePush { key, value } => {
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet { key, expected, desired } => {
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => put_bytes(out, key),
            Request::Add { key, delta } => {
                put_bytes(out, key);
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                put_keys(out, keys)
            }
            Request::MultiSet { pairs } => {
                out.extend_from_slice(&(pairs.len() as u64).to_le_bytes());
                for (k, v) in pairs {
                    put_bytes(out, k);
                    put_bytes(out, v);
                }
            }
            Request::Barrier { key, world_size } => {
                put_bytes(out, key);
                out.extend_from_slice(&world_size.to_le_bytes());
            }
            Request::NumKeys | Request::CancelWait | Request::ListKeys => {}
        }
        true
    }
}

/// The torch 2.x handshake a client sends first.
pub fn encode_validate(out: &mut Vec<u8>) {
    out.push(current_type::VALIDATE);
    out.extend_from_slice(&VALIDATE_MAGIC.to_le_bytes());
}

/// One answer (or late STOP_WAITING) to a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// One response byte: STOP_WAITING, WAIT_CANCELED, READY, NOT_READY.
    Byte(u8),
    /// PING's nonce, echoed.
    Nonce(u32),
    /// ADD, GETNUMKEYS, DELETE_KEY, QUEUE_LEN: an i64.
    Int(i64),
    /// GET, COMPARE_SET: a u64 length then the bytes.
    Value(Vec<u8>),
    /// MULTI_GET: each value as in `Value`, no count.
    Values(Vec<Vec<u8>>),
    /// QUEUE_POP: the queue's length before the pop (i64), then the value when it was not
    /// empty.
    Popped { len_before: i64, value: Option<Vec<u8>> },
    /// LIST_KEYS: the count (i64), then each key as in `Value`.
    Keys(Vec<Vec<u8>>),
}

impl Reply {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Byte(b) => out.push(*b),
            Reply::Nonce(n) => out.extend_from_slice(&n.to_le_bytes()),
            Reply::Int(n) => out.extend_from_slice(&n.to_le_bytes()),
            Reply::Value(v) => put_bytes(out, v),
            Reply::Values(vs) => vs.iter().for_each(|v| put_bytes(out, v)),
            Reply::Popped { len_before, value } => {
                out.extend_from_slice(&len_before.to_le_bytes());
                if let Some(v) = value {
                    put_bytes(out, v);
                }
            }
            Reply::Keys(ks) => {
                out.extend_from_slice(&(ks.len() as i64).to_le_bytes());
                ks.iter().for_each(|k| put_bytes(out, k));
            }
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }
}

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
