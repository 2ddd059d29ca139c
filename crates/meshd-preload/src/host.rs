//! `gethostname`, interposed: when meshd sets `MESHD_HOSTNAME` (`--fault-tolerance node`),
//! the program's host name is this node's address on the chosen interface.
//!
//! Why: torchft advertises its manager and its HTTP checkpoint server as
//! `http://{socket.gethostname()}:port`, and the other replica groups connect there. On GPU
//! clouds every container's name resolves to its bridge address (the same on every
//! instance) or to nothing, and the lab's hosts share one name that resolves to loopback: a
//! group healing from a peer would fetch from itself, or from nowhere. The address (in
//! brackets for IPv6, as a URL's host needs it) reaches the node from every other one, and
//! through the tunnel too. Everything else is the C library's answer.

use std::ffi::{c_char, c_int};

use crate::sys::*;

/// Copies the configured name into `name` (`len` bytes) as glibc would: the name and its
/// NUL, or `ENAMETOOLONG` when it does not fit. `None`: no name is configured.
fn configured(name: *mut c_char, len: usize) -> Option<c_int> {
    let host = crate::config().hostname.as_deref()?;
    if name.is_null() {
        set_errno(EFAULT);
        return Some(-1);
    }
    if host.len() + 1 > len {
        set_errno(ENAMETOOLONG);
        return Some(-1);
    }
    // SAFETY: the caller's buffer holds `len` >= host.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(host.as_ptr(), name.cast::<u8>(), host.len());
        *name.add(host.len()) = 0;
    }
    Some(0)
}

/// `gethostname(2)`, interposed: see the module's doc.
///
/// # Safety
/// The caller's contract with `gethostname`: `name` valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gethostname(name: *mut c_char, len: usize) -> c_int {
    if let Some(rc) = configured(name, len) {
        return rc;
    }
    match real::gethostname() {
        // SAFETY: forwarding the caller's arguments.
        Some(f) => unsafe { f(name, len) },
        None => {
            set_errno(ENOSYS);
            -1
        }
    }
}

/// `__gethostname_chk` (`gethostname` under `_FORTIFY_SOURCE`), interposed.
///
/// # Safety
/// The caller's contract with `__gethostname_chk`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __gethostname_chk(name: *mut c_char, len: usize, room: usize) -> c_int {
    if let Some(rc) = configured(name, len.min(room)) {
        return rc;
    }
    match real::__gethostname_chk() {
        // SAFETY: forwarding the caller's arguments.
        Some(f) => unsafe { f(name, len, room) },
        None => {
            set_errno(ENOSYS);
            -1
        }
    }
}
