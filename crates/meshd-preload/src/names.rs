//! The interposed `connect`, `getpeername`, `getsockname`, `getsockopt` and `setsockopt`.
//!
//! Each calls the C library's function first and looks further only where its answer
//! could be a tunnelled socket's (a Unix socket's name, an option a Unix socket refuses,
//! an IP address refused by a Unix socket's `connect`): a TCP socket costs nothing more.
//! A tunnelled socket is known by its own name ([`crate::ident`]), whichever fd, process
//! or program holds it.

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;

use crate::conn::{self, Outcome};
use crate::ident::Addr;
use crate::opts;
use crate::sys::*;
use crate::table;

fn ret(r: Result<(), c_int>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

/// `connect(2)`, interposed: see [`crate::conn`].
///
/// # Safety
/// The caller's contract with `connect`: `addr` valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const c_void, len: socklen_t) -> c_int {
    // SAFETY: the caller's contract.
    let dest = unsafe { conn::ip_destination(addr, len) };
    let peer = dest.and_then(|_| {
        // SAFETY: as above; ip_destination read these bytes already.
        Addr::from_sockaddr(unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), (len as usize).min(28)) })
    });
    let cfg = crate::config();
    if let (Some(dest), Some(peer)) = (dest, peer) {
        if conn::is_tcp(fd) && cfg.is_peer(dest.ip()) {
            if cfg.debug {
                say(&format!("connect {dest} through meshd"));
            }
            let r = conn::tunnel(fd, dest, peer, cfg);
            if cfg.debug && r.is_err_and(|e| e != EINPROGRESS) {
                say(&format!("connect {dest}: errno {}", r.err().unwrap_or(0)));
            }
            return ret(r);
        }
    }
    let Some(f) = real::connect() else { return ret(Err(ECONNREFUSED)) };
    // SAFETY: forwarding the caller's arguments.
    let rc = unsafe { f(fd, addr, len) };
    if rc != 0 && errno() == EINVAL {
        if let (Some(dest), Some(peer)) = (dest, peer) {
            // A Unix socket refuses an IP address: a tunnelled socket connected again.
            if let Some(r) = conn::connect_again(fd, dest, peer) {
                return ret(r);
            }
            set_errno(EINVAL);
        }
    }
    rc
}

/// Copies `bytes` to a caller's (`addr`, `len`) pair as the kernel would (truncated to
/// `room`, the caller's `*len` before the call; `*len` set to the full size).
///
/// # Safety
/// `addr` valid for `room` bytes, `len` valid.
unsafe fn write_raw(bytes: &[u8], addr: *mut c_void, len: *mut socklen_t, room: socklen_t) -> c_int {
    if len.is_null() || (addr.is_null() && room > 0) {
        set_errno(EFAULT);
        return -1;
    }
    // SAFETY: the caller's contract: `len` valid, `addr` valid for `room` bytes.
    unsafe {
        let n = (room as usize).min(bytes.len());
        if n > 0 {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr.cast::<u8>(), n);
        }
        *len = bytes.len() as socklen_t;
    }
    0
}

/// `getpeername(2)`, interposed: a tunnelled socket's peer is its destination (as the
/// application gave it); `ENOTCONN` while its connect is in progress or after it failed.
///
/// # Safety
/// The caller's contract with `getpeername`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut c_void, len: *mut socklen_t) -> c_int {
    let Some(f) = real::getpeername() else { return ret(Err(ENOSYS)) };
    // SAFETY: the caller's contract.
    let room = if len.is_null() { 0 } else { unsafe { *len } };
    // SAFETY: forwarding the caller's arguments.
    let rc = unsafe { f(fd, addr, len) };
    let unix = rc == 0
        && !len.is_null()
        && (room < 2 || addr.is_null() || {
            // SAFETY: the kernel wrote at least the family (room >= 2).
            let fam = unsafe { std::ptr::read_unaligned(addr.cast::<u16>()) };
            fam as c_int == AF_UNIX
        });
    if !(unix || (rc != 0 && errno() == ENOTCONN)) {
        return rc;
    }
    let saved = errno();
    let Some(id) = conn::identity_of(fd) else {
        set_errno(saved);
        return rc;
    };
    if conn::try_settle(fd, table::find_fd(fd)) != Outcome::Connected {
        return ret(Err(ENOTCONN));
    }
    let (b, n) = id.peer.to_sockaddr();
    // SAFETY: the caller's contract.
    unsafe { write_raw(&b[..n], addr, len, room) }
}

/// `getsockname(2)`, interposed: a tunnelled socket's own address is what the application
/// bound it to, else this node's address (port 0: the local end of the stream is meshd's).
///
/// # Safety
/// The caller's contract with `getsockname`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut c_void, len: *mut socklen_t) -> c_int {
    if len.is_null() {
        let Some(f) = real::getsockname() else { return ret(Err(ENOSYS)) };
        // SAFETY: forwarding the caller's arguments (the kernel answers EFAULT).
        return unsafe { f(fd, addr, len) };
    }
    // SAFETY: `len` is valid (the caller's contract).
    let room = unsafe { *len };
    let mut b = [0u8; 128];
    let Some(n) = sock_name(fd, &mut b) else { return -1 };
    if let Some(id) = crate::ident::decode(&b[..n]) {
        let (a, n) = conn::local_name(&id).to_sockaddr();
        // SAFETY: the caller's contract.
        return unsafe { write_raw(&a[..n], addr, len, room) };
    }
    // SAFETY: the caller's contract.
    unsafe { write_raw(&b[..n], addr, len, room) }
}

fn is_unsupported(e: c_int) -> bool {
    e == ENOPROTOOPT || e == EOPNOTSUPP
}

/// `setsockopt(2)`, interposed: on a tunnelled socket, TCP and IP options (which a Unix
/// socket has not) are stored and read back by `getsockopt`; `SO_SNDBUF` set while the
/// connect is in progress is applied when it completes.
///
/// # Safety
/// The caller's contract with `setsockopt`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    let Some(f) = real::setsockopt() else { return ret(Err(ENOSYS)) };
    let int_val = || {
        // SAFETY: the caller's contract: `val` valid for `len` bytes (>= 4 checked).
        (!val.is_null() && len >= 4).then(|| unsafe { std::ptr::read_unaligned(val.cast::<c_int>()) })
    };
    if level == SOL_SOCKET && name == SO_SNDBUF && table::unsettled_count() > 0 {
        if let Some(slot) = table::find_fd(fd).filter(|s| conn::try_settle(fd, Some(s)) == Outcome::Pending) {
            let Some(v) = int_val() else { return ret(Err(EINVAL)) };
            slot.sndbuf.store(v.max(1), Ordering::Release);
            return 0;
        }
    }
    // SAFETY: forwarding the caller's arguments.
    let rc = unsafe { f(fd, level, name, val, len) };
    let e = errno();
    if rc == 0 || !is_unsupported(e) || !(level == SOL_SOCKET || opts::emulated_level(level)) {
        return rc;
    }
    let Some(id) = conn::identity_of(fd) else {
        set_errno(e);
        return rc;
    };
    if let Some(i) = opts::emulated(level, name) {
        let Some(v) = int_val() else { return ret(Err(EINVAL)) };
        if let Some(slot) = socket_cookie(fd).and_then(|c| table::find_or_insert(c, &id.opts)) {
            slot.opts[i].store(v, Ordering::Release);
        }
    }
    // Any other option TCP has and a Unix socket has not: accepted, without effect.
    0
}

/// Writes an `int` answer of `getsockopt` as the kernel does.
///
/// # Safety
/// `val` valid for `*len` bytes, `len` valid (the caller's contract with `getsockopt`).
unsafe fn write_int(v: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int {
    if val.is_null() || len.is_null() {
        return ret(Err(EFAULT));
    }
    // SAFETY: the caller's contract.
    unsafe {
        if (*len as i32) < 0 {
            return ret(Err(EINVAL));
        }
        let bytes = v.to_ne_bytes();
        let n = (*len as usize).min(bytes.len());
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), val.cast::<u8>(), n);
        *len = n as socklen_t;
    }
    0
}

/// `getsockopt(2)`, interposed: on a tunnelled socket, `SO_ERROR` answers the connect's
/// outcome (0 while in progress, the failure once), `SO_DOMAIN` and `SO_PROTOCOL` the TCP
/// socket's, and TCP and IP options what was set (see [`setsockopt`]).
///
/// # Safety
/// The caller's contract with `getsockopt`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let Some(f) = real::getsockopt() else { return ret(Err(ENOSYS)) };
    let settling = match name {
        SO_ERROR => table::any(),
        SO_SNDBUF => table::unsettled_count() > 0,
        _ => false,
    };
    if level == SOL_SOCKET && settling {
        if let Some(slot) = table::find_fd(fd) {
            let v = match (name, conn::try_settle(fd, Some(slot))) {
                (SO_ERROR, Outcome::Pending) => Some(0),
                (SO_ERROR, Outcome::Failed { errno, told: false }) if conn::tell(Some(slot)) => Some(errno),
                // Told once, as the kernel clears it.
                (SO_ERROR, Outcome::Failed { .. }) => Some(0),
                (SO_SNDBUF, Outcome::Pending) => {
                    let v = slot.sndbuf.load(Ordering::Acquire);
                    Some(if v > 0 { v } else { conn::UNIX_SNDBUF }.saturating_mul(2))
                }
                _ => None,
            };
            if let Some(v) = v {
                // SAFETY: the caller's contract.
                return unsafe { write_int(v, val, len) };
            }
        }
    }
    // SAFETY: the caller's contract.
    let room = if len.is_null() { 0 } else { unsafe { *len } };
    // SAFETY: forwarding the caller's arguments.
    let rc = unsafe { f(fd, level, name, val, len) };
    let e = errno();
    let maybe_ours = if rc == 0 {
        // A Unix socket's answer where a tunnelled one has a TCP socket's.
        level == SOL_SOCKET && matches!(name, SO_DOMAIN | SO_PROTOCOL) && room >= 4 && !val.is_null() && {
            // SAFETY: the kernel wrote an int (room >= 4).
            let v = unsafe { std::ptr::read_unaligned(val.cast::<c_int>()) };
            (name == SO_DOMAIN && v == AF_UNIX) || (name == SO_PROTOCOL && v == 0)
        }
    } else {
        opts::emulated_level(level) && is_unsupported(e)
    };
    if !maybe_ours {
        return rc;
    }
    let Some(id) = conn::identity_of(fd) else {
        set_errno(e);
        return rc;
    };
    if !len.is_null() {
        // SAFETY: the caller's contract.
        unsafe { *len = room };
    }
    let v = match (level, name) {
        (SOL_SOCKET, SO_DOMAIN) => id.domain,
        (SOL_SOCKET, _) => IPPROTO_TCP,
        _ => match opts::emulated(level, name) {
            Some(i) => match socket_cookie(fd).and_then(|c| table::find_or_insert(c, &id.opts)) {
                Some(slot) => slot.opts[i].load(Ordering::Acquire),
                None => id.opts.get(i).copied().unwrap_or(0),
            },
            None => 0,
        },
    };
    // SAFETY: the caller's contract.
    unsafe { write_int(v, val, len) }
}
