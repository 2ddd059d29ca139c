//! The interposed reads, writes and `shutdown`.
//!
//! Before the C library's call: a tunnelled socket whose connect is still in progress is
//! settled first ([`before_io`]), so meshd's status byte is never read as data (only while
//! some connect of this process is unsettled does this look at the fd at all). After it: a
//! reset reads as a reset. A Unix socket has no RST: when meshd drops its end because the
//! tunnelled connection failed (the far end reset it, the far node or this node's meshd is
//! gone), the rank's reads see end of file and its writes `EPIPE`. meshd closes its end
//! before the application's own end of file only on a failure (on a clean end it
//! half-closes and waits for the application's), so a read that returns 0 on a tunnelled
//! socket whose peer is gone entirely (`POLLHUP`), and whose write side the application
//! did not shut down itself, is a reset: it returns -1 with `ECONNRESET`, as TCP does
//! after an RST, once; a write's first `EPIPE` there does the same. After an end of file
//! the application already read, a failure stays `EPIPE` (TCP's answer to an RST in
//! `CLOSE_WAIT`). These calls look at the fd only when the C library's returned 0 or
//! `EPIPE` (or `ECONNRESET`).

use std::ffi::{c_int, c_void};

use crate::conn::{self, Outcome};
use crate::sys::*;
use crate::table::{self, Phase, flag};

/// The entry of a tunnelled `fd` at an end of file or a failure: made for a socket known by
/// its name only (one inherited across `exec`), so its resets read as resets there too.
fn slot_at_end(fd: c_int) -> Option<&'static table::Slot> {
    table::find_fd(fd).or_else(|| {
        let id = conn::identity_of(fd)?;
        table::find_or_insert(socket_cookie(fd)?, &id.opts)
    })
}

/// Whether meshd's end of the Unix socket `fd` is gone entirely (closed, not half-closed).
fn peer_gone(fd: c_int) -> bool {
    poll_one(fd, 0, 0).is_ok_and(|r| r & POLLHUP != 0)
}

/// Before a read (`write` false) or a write on `fd`: `Err(-1)` (errno set) when the call
/// must not reach the socket: its connect is in progress (`EAGAIN` without waiting; a
/// blocking call waits for the outcome, up to the socket's own timeout as the kernel's)
/// or failed (the failure once, then `ENOTCONN` for reads, `EPIPE` for writes).
fn before_io(fd: c_int, dontwait: bool, write: bool) -> Result<(), isize> {
    if table::unsettled_count() == 0 {
        return Ok(());
    }
    table::sweep_now_and_then();
    let Some(slot) = table::find_fd(fd) else { return Ok(()) };
    let failed = |e: c_int| {
        set_errno(e);
        Err(-1)
    };
    match slot.phase() {
        Phase::Connected => return Ok(()),
        Phase::Failed { told: true, .. } => return failed(if write { EPIPE } else { ENOTCONN }),
        _ => {}
    }
    let blocking = !dontwait && !nonblocking(fd);
    let own = if blocking { get_timeout(fd, if write { SO_SNDTIMEO } else { SO_RCVTIMEO }) } else { None };
    let cfg = crate::config();
    let limit = own.filter(|t| *t < cfg.timeout).unwrap_or(cfg.timeout);
    let until = if blocking { now_ms().saturating_add(limit.as_millis() as u64) } else { 0 };
    match conn::settle(fd, slot, until) {
        Outcome::Connected => Ok(()),
        Outcome::Failed { errno, told: false } if conn::tell(Some(slot)) => failed(errno),
        Outcome::Failed { .. } => failed(if write { EPIPE } else { ENOTCONN }),
        Outcome::Pending if blocking && own.is_none_or(|t| t >= cfg.timeout) => {
            loop {
                let s = slot.state();
                if !matches!(table::phase(s), Phase::Pending)
                    || slot.transition(s, Phase::Failed { errno: ETIMEDOUT, told: true })
                {
                    break;
                }
            }
            failed(ETIMEDOUT)
        }
        Outcome::Pending => failed(EAGAIN),
    }
}

/// After a read-like call on `fd` returned `rc` (with `wanted` bytes room): an end of file
/// that is a reset becomes -1/`ECONNRESET` (see the module's doc); other ends of file are
/// remembered. Only a 0 or an error costs anything.
fn after_read(fd: c_int, rc: isize, wanted: usize) -> isize {
    if rc > 0 || wanted == 0 {
        return rc;
    }
    let saved = errno();
    let e = if rc < 0 { saved } else { 0 };
    if rc < 0 && e != ECONNRESET {
        return rc;
    }
    let reset = slot_at_end(fd).is_some_and(|slot| {
        if slot.state() & (flag::RESET_TOLD | flag::EOF_SEEN | flag::SHUT_WR) != 0 {
            return false;
        }
        if e == ECONNRESET || peer_gone(fd) {
            // A kernel ECONNRESET (meshd closed with the application's bytes unread) is
            // the one report; a 0 with meshd gone becomes it.
            let before = slot.set_flags(flag::RESET_TOLD);
            e == 0 && before & flag::RESET_TOLD == 0
        } else {
            slot.set_flags(flag::EOF_SEEN);
            false
        }
    });
    if reset {
        set_errno(ECONNRESET);
        return -1;
    }
    set_errno(saved);
    rc
}

/// After a write-like call on `fd` returned `rc`: the first `EPIPE` of a reset becomes
/// `ECONNRESET` (see the module's doc).
fn after_write(fd: c_int, rc: isize) -> isize {
    if rc >= 0 || errno() != EPIPE {
        return rc;
    }
    let first = slot_at_end(fd).is_some_and(|slot| {
        let before = slot.set_flags(flag::RESET_TOLD);
        before & (flag::RESET_TOLD | flag::EOF_SEEN | flag::SHUT_WR) == 0
    });
    if first {
        // The kernel's own ECONNRESET may be pending (meshd closed with bytes of ours
        // unread); this report is the one, as TCP's: reading SO_ERROR clears it.
        let _ = get_int_opt(fd, SOL_SOCKET, SO_ERROR);
    }
    set_errno(if first { ECONNRESET } else { EPIPE });
    rc
}

/// Sums the lengths of `n` iovecs (0 for a bad pointer or count).
///
/// # Safety
/// `iov` valid for `n` entries when not null.
unsafe fn iov_len(iov: *const iovec, n: c_int) -> usize {
    if iov.is_null() || n <= 0 {
        return 0;
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(iov, n as usize) }.iter().fold(0usize, |a, v| a.saturating_add(v.len))
}

macro_rules! call_real {
    ($name:ident, $($arg:expr),*) => {
        match real::$name() {
            // SAFETY: forwarding the caller's arguments to the C library's function.
            Some(f) => unsafe { f($($arg),*) },
            None => {
                set_errno(ENOSYS);
                -1
            }
        }
    };
}

macro_rules! before {
    ($fd:expr, $flags:expr, $write:expr) => {
        if let Err(rc) = before_io($fd, $flags & MSG_DONTWAIT != 0, $write) {
            return rc;
        }
    };
}

/// `read(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `read`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize {
    before!(fd, 0, false);
    after_read(fd, call_real!(read, fd, buf, n), n)
}

/// `__read_chk` (`read` under `_FORTIFY_SOURCE`), interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `__read_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, n: usize, room: usize) -> isize {
    before!(fd, 0, false);
    after_read(fd, call_real!(__read_chk, fd, buf, n, room), n)
}

/// `readv(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `readv`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, n: c_int) -> isize {
    before!(fd, 0, false);
    let rc = call_real!(readv, fd, iov, n);
    // SAFETY: the caller's contract.
    after_read(fd, rc, if rc == 0 { unsafe { iov_len(iov, n) } } else { 1 })
}

/// `recv(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `recv`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: usize, flags: c_int) -> isize {
    before!(fd, flags, false);
    after_read(fd, call_real!(recv, fd, buf, n, flags), n)
}

/// `__recv_chk`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `__recv_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    room: usize,
    flags: c_int,
) -> isize {
    before!(fd, flags, false);
    after_read(fd, call_real!(__recv_chk, fd, buf, n, room, flags), n)
}

/// `recvfrom(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `recvfrom`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    flags: c_int,
    addr: *mut c_void,
    len: *mut socklen_t,
) -> isize {
    before!(fd, flags, false);
    after_read(fd, call_real!(recvfrom, fd, buf, n, flags, addr, len), n)
}

/// `__recvfrom_chk`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `__recvfrom_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    room: usize,
    flags: c_int,
    addr: *mut c_void,
    len: *mut socklen_t,
) -> isize {
    before!(fd, flags, false);
    after_read(fd, call_real!(__recvfrom_chk, fd, buf, n, room, flags, addr, len), n)
}

/// `recvmsg(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `recvmsg`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> isize {
    before!(fd, flags, false);
    let rc = call_real!(recvmsg, fd, msg, flags);
    // SAFETY: the caller's contract: `msg` valid when not null.
    let wanted =
        if rc != 0 || msg.is_null() { 1 } else { unsafe { iov_len((*msg).iov, (*msg).iovlen as c_int) } };
    after_read(fd, rc, wanted)
}

/// `write(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `write`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: usize) -> isize {
    before!(fd, 0, true);
    after_write(fd, call_real!(write, fd, buf, n))
}

/// `writev(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `writev`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, n: c_int) -> isize {
    before!(fd, 0, true);
    after_write(fd, call_real!(writev, fd, iov, n))
}

/// `send(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `send`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: usize, flags: c_int) -> isize {
    before!(fd, flags, true);
    after_write(fd, call_real!(send, fd, buf, n, flags))
}

/// `sendto(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `sendto`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: usize,
    flags: c_int,
    addr: *const c_void,
    len: socklen_t,
) -> isize {
    before!(fd, flags, true);
    after_write(fd, call_real!(sendto, fd, buf, n, flags, addr, len))
}

/// `sendmsg(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `sendmsg`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> isize {
    before!(fd, flags, true);
    after_write(fd, call_real!(sendmsg, fd, msg, flags))
}

/// `shutdown(2)`, interposed: a tunnelled socket whose write side the application shut
/// down ends cleanly when meshd closes its end (no reset is reported).
///
/// # Safety
/// The caller's contract with `shutdown`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if how == SHUT_WR || how == SHUT_RDWR {
        if let Some(slot) = table::find_fd(fd) {
            slot.set_flags(flag::SHUT_WR);
        }
    }
    match real::shutdown() {
        // SAFETY: forwarding the caller's arguments.
        Some(f) => unsafe { f(fd, how) },
        None => -1,
    }
}
