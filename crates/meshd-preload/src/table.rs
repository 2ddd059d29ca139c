//! What this process knows of its tunnelled sockets beyond their names: where their
//! connect stands, what a reset must know, and the emulated options set after the swap.
//!
//! One fixed table of atomic slots keyed by the socket's cookie (so every fd of a socket
//! finds the same entry), open addressing, no lock: nothing here ever waits on another
//! thread, so a child forked while another thread was in the middle of an update never
//! blocks on it (it sees the slot as the fork left it). Sockets are not told to close;
//! when the table fills up, the entries of sockets no fd of this process holds any more
//! are swept (by the cookies of the fds in `/proc/self/fd`), once their entry is old
//! enough that its connect cannot still be putting the socket in place.

use std::ffi::c_int;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};

use crate::opts::EMULATED;
use crate::sys::{now_ms, socket_cookie};

/// Slots: tunnelled sockets one process can know at once.
pub const SLOTS: usize = 4096;
/// A slot being filled in.
const RESERVED: u64 = u64::MAX;
/// A freed slot (lookups go on past it; inserts reuse it).
const TOMB: u64 = u64::MAX - 1;
/// An entry younger than this is never swept.
const SWEEP_MIN_AGE_MS: u64 = 2000;

/// Where a socket's connect stands (the low byte of [`Slot::state`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Connected (also what a socket known only by its name is taken to be).
    Connected,
    /// meshd's status byte has not been read yet.
    Pending,
    /// A thread of process `pid` is reading the status byte.
    Consuming { pid: u32 },
    /// The connect failed with `errno`; `told`: the application was told.
    Failed { errno: c_int, told: bool },
}

/// Flags of a tunnelled socket ([`Slot::state`] bits 16..).
pub mod flag {
    /// The application shut its write side down.
    pub const SHUT_WR: u64 = 1 << 16;
    /// The application read an end of file.
    pub const EOF_SEEN: u64 = 1 << 17;
    /// The application was told of a reset.
    pub const RESET_TOLD: u64 = 1 << 18;
    /// The application's `connect` returned success (a later one says `EISCONN`).
    pub const CONNECT_DONE: u64 = 1 << 20;
}

const TOLD: u64 = 1 << 19;
const PHASE_MASK: u64 = 0xff;

fn encode(p: Phase, flags: u64) -> u64 {
    let flags = flags & !(PHASE_MASK | (0xff << 8) | TOLD | (0xffff_ffff << 32));
    flags
        | match p {
            Phase::Connected => 0,
            Phase::Pending => 1,
            Phase::Consuming { pid } => 2 | (u64::from(pid) << 32),
            Phase::Failed { errno, told } => 3 | ((errno as u64 & 0xff) << 8) | if told { TOLD } else { 0 },
        }
}

pub fn phase(state: u64) -> Phase {
    match state & PHASE_MASK {
        1 => Phase::Pending,
        2 => Phase::Consuming { pid: (state >> 32) as u32 },
        3 => Phase::Failed { errno: ((state >> 8) & 0xff) as c_int, told: state & TOLD != 0 },
        _ => Phase::Connected,
    }
}

/// Whether a state still needs the application's attention (its connect's outcome unread).
fn unsettled(state: u64) -> bool {
    matches!(phase(state), Phase::Pending | Phase::Consuming { .. } | Phase::Failed { told: false, .. })
}

/// One tunnelled socket.
#[derive(Debug)]
pub struct Slot {
    cookie: AtomicU64,
    state: AtomicU64,
    born_ms: AtomicU64,
    /// The `SO_SNDBUF` value to set when the connect completes.
    pub sndbuf: AtomicI32,
    /// [`EMULATED`]'s values.
    pub opts: [AtomicI32; EMULATED.len()],
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            cookie: AtomicU64::new(0),
            state: AtomicU64::new(0),
            born_ms: AtomicU64::new(0),
            sndbuf: AtomicI32::new(0),
            opts: [const { AtomicI32::new(0) }; EMULATED.len()],
        }
    }

    pub fn state(&self) -> u64 {
        self.state.load(Ordering::Acquire)
    }

    pub fn phase(&self) -> Phase {
        phase(self.state())
    }

    /// Moves from exactly `from` to phase `to` (keeping the flags); false if the state
    /// changed meanwhile. Keeps [`unsettled_count`] an upper bound of the unsettled slots.
    pub fn transition(&self, from: u64, to: Phase) -> bool {
        let new = encode(to, from);
        let (was, now) = (unsettled(from), unsettled(new));
        if now && !was {
            UNSETTLED.fetch_add(1, Ordering::AcqRel);
        }
        let ok = self.state.compare_exchange(from, new, Ordering::AcqRel, Ordering::Acquire).is_ok();
        // Settled now, or the increment above was for nothing.
        if (ok && was && !now) || (!ok && now && !was) {
            UNSETTLED.fetch_sub(1, Ordering::AcqRel);
        }
        ok
    }

    /// Sets `bits` (of [`flag`]); the state before.
    pub fn set_flags(&self, bits: u64) -> u64 {
        self.state.fetch_or(bits & !(PHASE_MASK | (0xff << 8) | TOLD | (0xffff_ffff << 32)), Ordering::AcqRel)
    }
}

static TABLE: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];
/// Slots in use (reserved or holding a cookie).
static USED: AtomicUsize = AtomicUsize::new(0);
/// At least the number of slots whose connect outcome the application has not read: while
/// it is 0, reads and writes do not look at their fd.
static UNSETTLED: AtomicUsize = AtomicUsize::new(0);
static LAST_SWEEP_MS: AtomicU64 = AtomicU64::new(0);

pub fn any() -> bool {
    USED.load(Ordering::Acquire) != 0
}

pub fn unsettled_count() -> usize {
    UNSETTLED.load(Ordering::Acquire)
}

fn start(cookie: u64) -> usize {
    (cookie.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 52) as usize % SLOTS
}

/// The entry of the socket with `cookie`.
pub fn find(cookie: u64) -> Option<&'static Slot> {
    if cookie == 0 || cookie >= TOMB || !any() {
        return None;
    }
    let s = start(cookie);
    for i in 0..SLOTS {
        let slot = &TABLE[(s + i) % SLOTS];
        match slot.cookie.load(Ordering::Acquire) {
            0 => return None,
            c if c == cookie => return Some(slot),
            _ => {}
        }
    }
    None
}

/// The entry of `fd`'s socket.
pub fn find_fd(fd: c_int) -> Option<&'static Slot> {
    if !any() {
        return None;
    }
    find(socket_cookie(fd)?)
}

/// A new entry for `cookie` in `phase` with `opts`; `None` when the table is full (after a
/// sweep). Entries are inserted once per socket, by the connect that made it (or, for a
/// socket known only by its name, by the first call that needs one: see [`find_or_insert`]).
pub fn insert(cookie: u64, phase: Phase, opts: &[i32], sndbuf: c_int) -> Option<&'static Slot> {
    if cookie == 0 || cookie >= TOMB {
        return None;
    }
    if USED.load(Ordering::Acquire) >= SLOTS * 3 / 4 {
        sweep();
    }
    let s = start(cookie);
    for i in 0..SLOTS {
        let slot = &TABLE[(s + i) % SLOTS];
        let c = slot.cookie.load(Ordering::Acquire);
        if (c == 0 || c == TOMB)
            && slot.cookie.compare_exchange(c, RESERVED, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            USED.fetch_add(1, Ordering::AcqRel);
            let state = encode(phase, 0);
            if unsettled(state) {
                // Counted before it shows: a child forked in between over-counts, never under.
                UNSETTLED.fetch_add(1, Ordering::AcqRel);
            }
            slot.state.store(state, Ordering::Release);
            slot.born_ms.store(now_ms(), Ordering::Release);
            slot.sndbuf.store(sndbuf, Ordering::Release);
            for (k, o) in slot.opts.iter().enumerate() {
                o.store(opts.get(k).copied().unwrap_or(0), Ordering::Release);
            }
            slot.cookie.store(cookie, Ordering::Release);
            return Some(slot);
        }
    }
    None
}

/// The entry of `cookie`, made (connected, with `opts`) if there is none.
pub fn find_or_insert(cookie: u64, opts: &[i32]) -> Option<&'static Slot> {
    find(cookie).or_else(|| insert(cookie, Phase::Connected, opts, 0))
}

/// Frees `slot` if it still holds `cookie`.
pub fn remove(slot: &Slot, cookie: u64) {
    if slot.cookie.compare_exchange(cookie, TOMB, Ordering::AcqRel, Ordering::Acquire).is_ok() {
        if unsettled(slot.state()) {
            UNSETTLED.fetch_sub(1, Ordering::AcqRel);
        }
        USED.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Frees the entries of sockets no fd of this process holds (at most once a second).
fn sweep() {
    sweep_every(1000);
}

/// A sweep at most every 10 s, while some connect is unsettled: an application that
/// closes a socket whose connect it never waited for leaves no reads and writes paying
/// for it for long.
pub fn sweep_now_and_then() {
    sweep_every(10_000);
}

fn sweep_every(interval_ms: u64) {
    let now = now_ms();
    let last = LAST_SWEEP_MS.load(Ordering::Acquire);
    if now.saturating_sub(last) < interval_ms
        || LAST_SWEEP_MS.compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire).is_err()
    {
        return;
    }
    let Some(live) = live_cookies() else { return };
    sweep_with(&live, now);
}

/// Frees the entries older than [`SWEEP_MIN_AGE_MS`] whose cookie is not in `live`.
fn sweep_with(live: &[u64], now: u64) {
    for slot in TABLE.iter() {
        let c = slot.cookie.load(Ordering::Acquire);
        if c == 0 || c >= TOMB || live.contains(&c) {
            continue;
        }
        if now.saturating_sub(slot.born_ms.load(Ordering::Acquire)) >= SWEEP_MIN_AGE_MS {
            remove(slot, c);
        }
    }
}

/// The cookies of the sockets this process's fds hold.
fn live_cookies() -> Option<Vec<u64>> {
    let dir = std::fs::read_dir("/proc/self/fd").ok()?;
    Some(
        dir.flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<c_int>().ok()))
            .filter_map(socket_cookie)
            .collect(),
    )
}

/// Another thread of this process or a parent before a fork may be mid-way in a slot;
/// bounded waiting only.
pub fn spin() {
    std::thread::yield_now();
}

#[cfg(test)]
mod tests {
    use super::*;

    // Cookies far above any real socket's (the kernel counts from 1), distinct per test:
    // the table is the process's, shared by the tests running at once.
    const BASE: u64 = 0x7000_0000_0000_0000;

    #[test]
    fn states_round_trip_and_keep_flags() {
        for p in [
            Phase::Connected,
            Phase::Pending,
            Phase::Consuming { pid: 4_000_000 },
            Phase::Failed { errno: 111, told: false },
            Phase::Failed { errno: 110, told: true },
        ] {
            let s = encode(p, flag::SHUT_WR | flag::RESET_TOLD);
            assert_eq!(phase(s), p);
            assert_eq!(
                s & (flag::SHUT_WR | flag::RESET_TOLD | flag::EOF_SEEN),
                flag::SHUT_WR | flag::RESET_TOLD
            );
        }
        assert!(unsettled(encode(Phase::Pending, 0)) && !unsettled(encode(Phase::Connected, 0)));
        assert!(unsettled(encode(Phase::Failed { errno: 1, told: false }, 0)));
        assert!(!unsettled(encode(Phase::Failed { errno: 1, told: true }, 0)));
    }

    #[test]
    fn entries_are_found_by_cookie_and_transitions_are_exclusive() {
        let c = BASE + 1;
        let slot = insert(c, Phase::Pending, &[1, 2], 4096).expect("room");
        assert!(std::ptr::eq(find(c).expect("found"), slot));
        assert_eq!(slot.opts[0].load(Ordering::Relaxed), 1);
        assert_eq!(slot.opts[1].load(Ordering::Relaxed), 2);
        assert_eq!(slot.opts[2].load(Ordering::Relaxed), 0);
        assert!(unsettled_count() >= 1);
        let s = slot.state();
        assert!(slot.transition(s, Phase::Consuming { pid: 1 }));
        assert!(!slot.transition(s, Phase::Connected), "a stale state loses");
        slot.set_flags(flag::SHUT_WR);
        let s = slot.state();
        assert!(slot.transition(s, Phase::Connected));
        assert_eq!(slot.phase(), Phase::Connected);
        assert!(slot.state() & flag::SHUT_WR != 0, "flags survive transitions");
        remove(slot, c);
        assert!(find(c).is_none());
        assert!(
            find(0).is_none() && find(TOMB).is_none() && insert(RESERVED, Phase::Connected, &[], 0).is_none()
        );
    }

    #[test]
    fn colliding_cookies_probe_past_freed_slots() {
        // Cookies with the same start slot: the second lives past the first; freeing the
        // first leaves the second findable.
        let a = BASE + 0x100;
        let mut b = a + 1;
        while start(b) != start(a) {
            b += 1;
        }
        let sa = insert(a, Phase::Connected, &[], 0).expect("room");
        let sb = insert(b, Phase::Connected, &[], 0).expect("room");
        assert!(!std::ptr::eq(sa, sb));
        remove(sa, a);
        assert!(std::ptr::eq(find(b).expect("past the freed slot"), sb));
        remove(sb, b);
    }

    #[test]
    fn a_sweep_frees_old_entries_of_closed_sockets_only() {
        // `live` is an open socket's: a sweep another test's calls make meanwhile (the
        // interposer's, by this process's real fds) keeps it too.
        // SAFETY: plain socket creation; closed below.
        let fd = unsafe { crate::sys::socket(crate::sys::AF_INET, crate::sys::SOCK_STREAM, 0) };
        let live = socket_cookie(fd).expect("a socket's cookie");
        let (dead, young) = (BASE + 0x201, BASE + 0x202);
        for c in [live, dead, young] {
            insert(c, Phase::Pending, &[], 0).expect("room");
        }
        for c in [live, dead] {
            find(c).expect("entry").born_ms.store(1, Ordering::Release);
        }
        let now = now_ms().max(SWEEP_MIN_AGE_MS + 2);
        sweep_with(&[live], now);
        assert!(find(live).is_some(), "an open socket keeps its entry");
        assert!(find(dead).is_none(), "a closed one's is freed");
        assert!(find(young).is_some(), "a young entry is never swept");
        for c in [live, young] {
            remove(find(c).expect("entry"), c);
        }
        // SAFETY: our own socket.
        unsafe { crate::sys::close(fd) };
    }
}
