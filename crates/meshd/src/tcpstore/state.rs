//! The store itself: one map shared by every connection, the queues, and who waits for
//! which keys. Pure: the server's actor feeds it `(connection, request)` and sends what
//! it returns. Its answers follow torch's C++ servers (TCPStoreLibUvBackend.cpp for torch
//! 2.x connections, TCPStoreBackend.cpp for 1.13's); deviations are named where they are.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;

use super::codec::{Dialect, NOT_READY, READY, Reply, Request, STOP_WAITING, WAIT_CANCELED};

/// A connection, as the server numbers them.
pub type ConnId = u64;

/// The store's bounds (the wire's are in [`super::codec::WireLimits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    /// Keys in the map plus named queues.
    pub max_keys: usize,
    /// Bytes of keys and values held (map and queues).
    pub max_bytes: usize,
    /// Registrations of waiting connections on keys, all connections together.
    pub max_wait_registrations: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits { max_keys: 1 << 20, max_bytes: 1 << 30, max_wait_registrations: 1 << 20 }
    }
}

/// Why a request closes its connection (torch's servers close it on the same requests,
/// by an exception in the handler, except for the limits, which are ours).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// GET of a missing key on a torch 1.13 connection (`unordered_map::at` throws).
    MissingKey,
    /// ADD or BARRIER on a value `std::stoll` refuses.
    NotAnInteger,
    /// ADD or BARRIER past i64 (undefined in C++; refused here).
    Overflow,
    /// The store would pass `max_keys` or `max_bytes`.
    StoreFull,
    /// The waits would pass `max_wait_registrations`.
    TooManyWaits,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::MissingKey => "GET of a missing key (torch 1.13 connection)",
            Fault::NotAnInteger => "ADD/BARRIER on a value that is not an integer",
            Fault::Overflow => "ADD/BARRIER overflows i64",
            Fault::StoreFull => "the store is full (key or byte limit)",
            Fault::TooManyWaits => "too many waiting keys",
        })
    }
}

/// What a request produced: its answer (none for SET, APPEND, MULTI_SET, QUEUE_PUSH and a
/// WAIT that has to wait) and the connections whose waits it completed (each gets one
/// STOP_WAITING byte).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub reply: Option<Reply>,
    pub woken: Vec<ConnId>,
}

#[derive(Debug, Default)]
struct Waiter {
    /// Registrations not yet satisfied.
    left: usize,
    /// The keys it is registered on (with repeats, as torch counts them).
    keys: Vec<Vec<u8>>,
}

/// The shared store.
#[derive(Debug, Default)]
pub struct State {
    map: BTreeMap<Vec<u8>, Vec<u8>>,
    queues: BTreeMap<Vec<u8>, VecDeque<Vec<u8>>>,
    bytes: usize,
    waiting: HashMap<Vec<u8>, Vec<ConnId>>,
    waiters: HashMap<ConnId, Waiter>,
    registrations: usize,
    limits: StoreLimits,
}

/// `std::stoll` of the bytes: leading white space, an optional sign, at least one digit;
/// what follows the digits is ignored. None where stoll throws.
pub fn stoll(v: &[u8]) -> Option<i64> {
    let mut i = 0;
    while i < v.len() && matches!(v[i], b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r') {
        i += 1;
    }
    let neg = match v.get(i) {
        Some(b'-') => {
            i += 1;
            true
        }
        Some(b'+') => {
            i += 1;
            false
        }
        _ => false,
    };
    let start = i;
    let mut n: i64 = 0;
    while i < v.len() && v[i].is_ascii_digit() {
        let d = i64::from(v[i] - b'0');
        // Accumulate negatively so that i64::MIN parses.
        n = n.checked_mul(10)?.checked_sub(d)?;
        i += 1;
    }
    if i == start {
        return None;
    }
    if neg { Some(n) } else { n.checked_neg() }
}

impl State {
    pub fn new(limits: StoreLimits) -> State {
        State { limits, ..State::default() }
    }

    /// Keys in the map (what GETNUMKEYS answers).
    pub fn num_keys(&self) -> usize {
        self.map.len()
    }

    /// Bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Connections with a wait in progress.
    pub fn waiting_connections(&self) -> usize {
        self.waiters.len()
    }

    /// Forgets every key, queue and wait (a new restart of the ranks).
    pub fn clear(&mut self) {
        *self = State::new(self.limits);
    }

    /// A connection went away: its wait, if any, is forgotten.
    pub fn drop_conn(&mut self, conn: ConnId) {
        self.clear_wait(conn);
    }

    fn ready(&self, key: &[u8]) -> bool {
        self.map.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    fn clear_wait(&mut self, conn: ConnId) {
        let Some(w) = self.waiters.remove(&conn) else { return };
        for k in w.keys {
            let Some(list) = self.waiting.get_mut(&k) else { continue };
            if let Some(at) = list.iter().position(|c| *c == conn) {
                list.remove(at);
                self.registrations -= 1;
            }
            if list.is_empty() {
                self.waiting.remove(&k);
            }
        }
    }

    /// Registers `conn` as waiting for `keys` (a connection has one wait at a time: torch
    /// overwrites the count of an earlier one and leaves its registrations; here the earlier
    /// one is forgotten).
    fn register(&mut self, conn: ConnId, keys: Vec<Vec<u8>>) -> Result<(), Fault> {
        self.clear_wait(conn);
        if self.registrations.saturating_add(keys.len()) > self.limits.max_wait_registrations {
            return Err(Fault::TooManyWaits);
        }
        for k in &keys {
            self.waiting.entry(k.clone()).or_default().push(conn);
        }
        self.registrations += keys.len();
        self.waiters.insert(conn, Waiter { left: keys.len(), keys });
        Ok(())
    }

    /// A registration of `conn` on `key` was satisfied (already taken off `waiting`).
    fn satisfy(&mut self, conn: ConnId, key: &[u8], woken: &mut Vec<ConnId>) {
        self.registrations -= 1;
        if let Some(w) = self.waiters.get_mut(&conn) {
            if let Some(at) = w.keys.iter().position(|k| k == key) {
                w.keys.swap_remove(at);
            }
            w.left = w.left.saturating_sub(1);
            if w.left == 0 {
                self.waiters.remove(&conn);
                woken.push(conn);
            }
        }
    }

    /// `key` was set: every registration on it is satisfied.
    fn wake_all(&mut self, key: &[u8], woken: &mut Vec<ConnId>) {
        if let Some(list) = self.waiting.remove(key) {
            for conn in list {
                self.satisfy(conn, key, woken);
            }
        }
    }

    /// A value was pushed on queue `key`: registrations are satisfied in order until one
    /// wait completes (torch wakes one popper per push).
    fn wake_one(&mut self, key: &[u8], woken: &mut Vec<ConnId>) {
        let before = woken.len();
        while woken.len() == before {
            let Some(list) = self.waiting.get_mut(key) else { return };
            if list.is_empty() {
                self.waiting.remove(key);
                return;
            }
            let conn = list.remove(0);
            if list.is_empty() {
                self.waiting.remove(key);
            }
            self.satisfy(conn, key, woken);
        }
    }

    fn charge(&self, add_keys: usize, old: usize, new: usize) -> Result<usize, Fault> {
        let bytes = self.bytes - old + new;
        let keys = self.map.len() + self.queues.len() + add_keys;
        if bytes > self.limits.max_bytes || keys > self.limits.max_keys {
            return Err(Fault::StoreFull);
        }
        Ok(bytes)
    }

    /// Sets `key` to `value` within the limits (no wake-ups).
    fn put(&mut self, key: &[u8], value: Vec<u8>) -> Result<(), Fault> {
        let (add, old) = match self.map.get(key) {
            Some(v) => (0, key.len() + v.len()),
            None => (1, 0),
        };
        self.bytes = self.charge(add, old, key.len() + value.len())?;
        self.map.insert(key.to_vec(), value);
        Ok(())
    }

    fn integer(&self, key: &[u8]) -> Result<Option<i64>, Fault> {
        match self.map.get(key) {
            None => Ok(None),
            Some(v) => stoll(v).map(Some).ok_or(Fault::NotAnInteger),
        }
    }

    /// Handles one request of `conn`.
    pub fn handle(&mut self, conn: ConnId, dialect: Dialect, req: Request) -> Result<Outcome, Fault> {
        let mut woken = Vec::new();
        let reply = match req {
            Request::Ping(n) => Some(Reply::Nonce(n)),
            Request::Set { key, value } => {
                self.put(&key, value)?;
                self.wake_all(&key, &mut woken);
                None
            }
            Request::MultiSet { pairs } => {
                // Applied in order, as torch does: a limit stops it part way.
                for (key, value) in pairs {
                    self.put(&key, value)?;
                    self.wake_all(&key, &mut woken);
                }
                None
            }
            Request::CompareSet { key, expected, desired } => {
                let answer = match self.map.get(&key) {
                    None if expected.is_empty() => {
                        self.put(&key, desired.clone())?;
                        // torch's libuv server also wakes waiters of the key when it was
                        // not set (the "lying" branch below); only a real set wakes here.
                        self.wake_all(&key, &mut woken);
                        desired
                    }
                    // torch answers the expected value for a missing key ("lying", its
                    // comment says) and sets nothing.
                    None => expected,
                    Some(cur) if *cur == expected => {
                        self.put(&key, desired.clone())?;
                        self.wake_all(&key, &mut woken);
                        desired
                    }
                    Some(cur) => cur.clone(),
                };
                Some(Reply::Value(answer))
            }
            Request::Get { key } => match (self.map.get(&key), dialect) {
                (Some(v), _) => Some(Reply::Value(v.clone())),
                // torch 2.x's libuv server answers an empty value; the classic server (and
                // 1.13's) throws and drops the connection. Clients WAIT before GET.
                (None, Dialect::Current) => Some(Reply::Value(Vec::new())),
                (None, Dialect::Legacy) => return Err(Fault::MissingKey),
            },
            Request::MultiGet { keys } => Some(Reply::Values(
                keys.iter().map(|k| self.map.get(k).cloned().unwrap_or_default()).collect(),
            )),
            Request::Add { key, delta } => {
                let sum = match self.integer(&key)? {
                    Some(old) => old.checked_add(delta).ok_or(Fault::Overflow)?,
                    None => delta,
                };
                self.put(&key, sum.to_string().into_bytes())?;
                self.wake_all(&key, &mut woken);
                Some(Reply::Int(sum))
            }
            Request::Check { keys } => {
                Some(Reply::Byte(if keys.iter().all(|k| self.ready(k)) { READY } else { NOT_READY }))
            }
            Request::Wait { keys } => {
                if keys.iter().all(|k| self.ready(k)) {
                    Some(Reply::Byte(STOP_WAITING))
                } else {
                    let missing: Vec<_> = keys.into_iter().filter(|k| !self.ready(k)).collect();
                    self.register(conn, missing)?;
                    None
                }
            }
            Request::CancelWait => {
                self.clear_wait(conn);
                Some(Reply::Byte(WAIT_CANCELED))
            }
            Request::NumKeys => Some(Reply::Int(self.map.len() as i64)),
            Request::DeleteKey { key } => {
                let n = match self.map.remove(&key) {
                    Some(v) => {
                        self.bytes -= key.len() + v.len();
                        1
                    }
                    None => 0,
                };
                Some(Reply::Int(n))
            }
            Request::Append { key, value } => {
                match self.map.get(&key) {
                    Some(_) => {
                        self.bytes = self.charge(0, 0, value.len())?;
                        if let Some(v) = self.map.get_mut(&key) {
                            v.extend_from_slice(&value);
                        }
                    }
                    None => self.put(&key, value)?,
                }
                self.wake_all(&key, &mut woken);
                None
            }
            Request::QueuePush { key, value } => {
                let new_queue = !self.queues.contains_key(&key);
                let add = if new_queue { key.len() } else { 0 };
                self.bytes = self.charge(usize::from(new_queue), 0, add + value.len())?;
                self.queues.entry(key.clone()).or_default().push_back(value);
                self.wake_one(&key, &mut woken);
                None
            }
            Request::QueuePop { key } => {
                let (len_before, value) = match self.queues.get_mut(&key) {
                    Some(q) => (q.len() as i64, q.pop_front()),
                    None => (0, None),
                };
                if let Some(v) = &value {
                    self.bytes -= v.len();
                }
                Some(Reply::Popped { len_before, value })
            }
            Request::QueueLen { key } => {
                Some(Reply::Int(self.queues.get(&key).map_or(0, |q| q.len() as i64)))
            }
            Request::ListKeys => Some(Reply::Keys(self.map.keys().cloned().collect())),
            Request::Barrier { key, world_size } => {
                let count = match self.integer(&key)? {
                    Some(n) => n.checked_add(1).ok_or(Fault::Overflow)?,
                    None => 1,
                };
                self.put(&key, count.to_string().into_bytes())?;
                if count >= world_size {
                    self.wake_all(&key, &mut woken);
                    Some(Reply::Byte(STOP_WAITING))
                } else {
                    self.register(conn, vec![key])?;
                    None
                }
            }
        };
        Ok(Outcome { reply, woken })
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
