//! The C library as this crate sees it: the constants and structs it declares by hand (no
//! `libc` crate: meshd's build script compiles the library with rustc alone), the real
//! functions behind the interposed ones (`dlsym(RTLD_NEXT)`, resolved once at load), and
//! small wrappers that call only those real functions, never the interposed ones.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Duration;

#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
compile_error!("meshd-preload declares Linux x86_64/aarch64 constants by hand");

pub type socklen_t = u32;

pub const AF_UNIX: c_int = 1;
pub const AF_INET: c_int = 2;
pub const AF_INET6: c_int = 10;
pub const SOCK_STREAM: c_int = 1;
pub const SOCK_CLOEXEC: c_int = 0o2_000_000;
pub const SOCK_NONBLOCK: c_int = 0o4000;
pub const SOL_SOCKET: c_int = 1;
pub const SO_REUSEADDR: c_int = 2;
pub const SO_TYPE: c_int = 3;
pub const SO_ERROR: c_int = 4;
pub const SO_SNDBUF: c_int = 7;
pub const SO_RCVBUF: c_int = 8;
pub const SO_KEEPALIVE: c_int = 9;
pub const SO_OOBINLINE: c_int = 10;
pub const SO_PRIORITY: c_int = 12;
pub const SO_LINGER: c_int = 13;
pub const SO_RCVLOWAT: c_int = 18;
pub const SO_RCVTIMEO: c_int = 20;
pub const SO_SNDTIMEO: c_int = 21;
pub const SO_PROTOCOL: c_int = 38;
pub const SO_DOMAIN: c_int = 39;
pub const SO_COOKIE: c_int = 57;
pub const IPPROTO_IP: c_int = 0;
pub const IPPROTO_TCP: c_int = 6;
pub const IPPROTO_IPV6: c_int = 41;
pub const SHUT_WR: c_int = 1;
pub const SHUT_RDWR: c_int = 2;
pub const POLLIN: i16 = 0x1;
pub const POLLHUP: i16 = 0x10;
pub const F_GETFD: c_int = 1;
pub const F_GETFL: c_int = 3;
pub const F_SETFL: c_int = 4;
pub const FD_CLOEXEC: c_int = 1;
pub const O_NONBLOCK: c_int = 0o4000;
pub const O_CLOEXEC: c_int = 0o2_000_000;
pub const O_RDONLY: c_int = 0;
pub const MSG_DONTWAIT: c_int = 0x40;
pub const CLOCK_MONOTONIC: c_int = 1;

pub const EINTR: c_int = 4;
pub const EAGAIN: c_int = 11;
pub const EFAULT: c_int = 14;
pub const EINVAL: c_int = 22;
pub const ENAMETOOLONG: c_int = 36;
pub const EPIPE: c_int = 32;
pub const ENOSYS: c_int = 38;
pub const ENOPROTOOPT: c_int = 92;
pub const EOPNOTSUPP: c_int = 95;
pub const EADDRINUSE: c_int = 98;
pub const EADDRNOTAVAIL: c_int = 99;
pub const ECONNRESET: c_int = 104;
pub const EISCONN: c_int = 106;
pub const ENOTCONN: c_int = 107;
pub const ETIMEDOUT: c_int = 110;
pub const ECONNREFUSED: c_int = 111;
pub const EHOSTUNREACH: c_int = 113;
pub const EALREADY: c_int = 114;
pub const EINPROGRESS: c_int = 115;

/// `struct sockaddr_un`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct sockaddr_un {
    pub sun_family: u16,
    pub sun_path: [u8; 108],
}

#[repr(C)]
#[derive(Debug)]
pub struct pollfd {
    pub fd: c_int,
    pub events: i16,
    pub revents: i16,
}

/// The C library's `struct iovec` (the interposed `readv`/`writev` take it).
#[repr(C)]
#[derive(Debug)]
pub struct iovec {
    pub base: *mut c_void,
    pub len: usize,
}

/// The C library's `struct msghdr` (the interposed `recvmsg`/`sendmsg` take it).
#[repr(C)]
#[derive(Debug)]
pub struct msghdr {
    pub name: *mut c_void,
    pub namelen: socklen_t,
    pub iov: *mut iovec,
    pub iovlen: usize,
    pub control: *mut c_void,
    pub controllen: usize,
    pub flags: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct timeval {
    pub tv_sec: i64,
    pub tv_usec: i64,
}

#[repr(C)]
struct timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

unsafe extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    pub fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int;
    pub fn bind(fd: c_int, addr: *const c_void, len: socklen_t) -> c_int;
    pub fn fcntl(fd: c_int, cmd: c_int, ...) -> c_int;
    fn open(path: *const c_char, flags: c_int, ...) -> c_int;
    pub fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int;
    pub fn close(fd: c_int) -> c_int;
    pub fn poll(fds: *mut pollfd, n: u64, timeout: c_int) -> c_int;
    pub fn getpid() -> c_int;
    fn clock_gettime(clock: c_int, ts: *mut timespec) -> c_int;
    fn __errno_location() -> *mut c_int;
}

/// glibc's `RTLD_NEXT`: the next object after this one in the search order.
const RTLD_NEXT: *mut c_void = -1isize as *mut c_void;

/// Looks `name` (NUL-terminated) up after this library, once.
fn lookup(cache: &AtomicPtr<c_void>, name: &str) -> *mut c_void {
    let p = cache.load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    // SAFETY: `name` is a NUL-terminated literal; dlsym is thread-safe.
    let p = unsafe { dlsym(RTLD_NEXT, name.as_ptr().cast()) };
    cache.store(p, Ordering::Release);
    p
}

macro_rules! reals {
    ($($name:ident: $ty:ty),* $(,)?) => {
        /// The C library's functions of the names this library interposes.
        pub mod real {
            use super::*;
            struct Cache {
                $($name: AtomicPtr<c_void>,)*
            }
            static CACHE: Cache = Cache { $($name: AtomicPtr::new(std::ptr::null_mut()),)* };

            /// Resolves every function now (at load): no `dlsym`, and so no loader lock,
            /// later (a child forked while another thread held that lock would wait on it).
            pub fn resolve_all() {
                $(let _ = lookup(&CACHE.$name, concat!(stringify!($name), "\0"));)*
            }

            $(
                pub fn $name() -> Option<$ty> {
                    let p = lookup(&CACHE.$name, concat!(stringify!($name), "\0"));
                    // SAFETY: dlsym returned the C library's function of that name, whose C
                    // signature is `$ty`.
                    (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
                }
            )*
        }
    };
}

pub type ConnectFn = unsafe extern "C" fn(c_int, *const c_void, socklen_t) -> c_int;
pub type NameFn = unsafe extern "C" fn(c_int, *mut c_void, *mut socklen_t) -> c_int;
pub type SetOptFn = unsafe extern "C" fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int;
pub type GetOptFn = unsafe extern "C" fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int;
pub type ReadFn = unsafe extern "C" fn(c_int, *mut c_void, usize) -> isize;
pub type WriteFn = unsafe extern "C" fn(c_int, *const c_void, usize) -> isize;
pub type ReadvFn = unsafe extern "C" fn(c_int, *const iovec, c_int) -> isize;
pub type RecvFn = unsafe extern "C" fn(c_int, *mut c_void, usize, c_int) -> isize;
pub type RecvFromFn =
    unsafe extern "C" fn(c_int, *mut c_void, usize, c_int, *mut c_void, *mut socklen_t) -> isize;
pub type RecvMsgFn = unsafe extern "C" fn(c_int, *mut msghdr, c_int) -> isize;
pub type SendFn = unsafe extern "C" fn(c_int, *const c_void, usize, c_int) -> isize;
pub type SendToFn =
    unsafe extern "C" fn(c_int, *const c_void, usize, c_int, *const c_void, socklen_t) -> isize;
pub type SendMsgFn = unsafe extern "C" fn(c_int, *const msghdr, c_int) -> isize;
pub type ShutdownFn = unsafe extern "C" fn(c_int, c_int) -> c_int;
pub type GetHostnameFn = unsafe extern "C" fn(*mut c_char, usize) -> c_int;
pub type GetHostnameChkFn = unsafe extern "C" fn(*mut c_char, usize, usize) -> c_int;
pub type ReadChkFn = unsafe extern "C" fn(c_int, *mut c_void, usize, usize) -> isize;
pub type RecvChkFn = unsafe extern "C" fn(c_int, *mut c_void, usize, usize, c_int) -> isize;
pub type RecvFromChkFn =
    unsafe extern "C" fn(c_int, *mut c_void, usize, usize, c_int, *mut c_void, *mut socklen_t) -> isize;

reals! {
    connect: ConnectFn,
    getpeername: NameFn,
    getsockname: NameFn,
    setsockopt: SetOptFn,
    getsockopt: GetOptFn,
    read: ReadFn,
    write: WriteFn,
    readv: ReadvFn,
    writev: ReadvFn,
    recv: RecvFn,
    recvfrom: RecvFromFn,
    recvmsg: RecvMsgFn,
    send: SendFn,
    sendto: SendToFn,
    sendmsg: SendMsgFn,
    shutdown: ShutdownFn,
    __read_chk: ReadChkFn,
    __recv_chk: RecvChkFn,
    __recvfrom_chk: RecvFromChkFn,
    gethostname: GetHostnameFn,
    __gethostname_chk: GetHostnameChkFn,
}

pub fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno, always valid.
    unsafe { *__errno_location() = e };
}

pub fn errno() -> c_int {
    // SAFETY: as in set_errno.
    unsafe { *__errno_location() }
}

/// Milliseconds of the monotonic clock (the same clock in a forked child).
pub fn now_ms() -> u64 {
    let mut ts = timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec; CLOCK_MONOTONIC always exists.
    unsafe { clock_gettime(CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1000).saturating_add(ts.tv_nsec as u64 / 1_000_000)
}

pub fn pid() -> u32 {
    // SAFETY: getpid cannot fail.
    unsafe { getpid() as u32 }
}

/// Writes one line to stderr (through the real `write`).
pub fn say(msg: &str) {
    let line = format!("meshd-preload[{}]: {msg}\n", pid());
    if let Some(w) = real::write() {
        // SAFETY: writing a valid buffer to stderr; a failure is ignored.
        let _ = unsafe { w(2, line.as_ptr().cast(), line.len()) };
    }
}

/// `getsockopt` of up to 16 bytes into `buf`: the length the kernel wrote.
pub fn get_opt(fd: c_int, level: c_int, name: c_int, buf: &mut [u8; 16]) -> Option<usize> {
    let f = real::getsockopt()?;
    let mut len = buf.len() as socklen_t;
    // SAFETY: a valid buffer and its length.
    let rc = unsafe { f(fd, level, name, buf.as_mut_ptr().cast(), &mut len) };
    (rc == 0).then_some((len as usize).min(buf.len()))
}

pub fn get_int_opt(fd: c_int, level: c_int, name: c_int) -> Option<c_int> {
    let mut b = [0u8; 16];
    let n = get_opt(fd, level, name, &mut b)?;
    (n >= 4).then(|| c_int::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

pub fn set_opt(fd: c_int, level: c_int, name: c_int, val: &[u8]) -> bool {
    let Some(f) = real::setsockopt() else { return false };
    // SAFETY: a valid buffer and its length.
    unsafe { f(fd, level, name, val.as_ptr().cast(), val.len() as socklen_t) == 0 }
}

pub fn set_int_opt(fd: c_int, level: c_int, name: c_int, v: c_int) -> bool {
    set_opt(fd, level, name, &v.to_ne_bytes())
}

/// The socket's cookie: the kernel's id of the socket, the same under every fd number and
/// in every process that holds it, never reused while the machine runs.
pub fn socket_cookie(fd: c_int) -> Option<u64> {
    let mut b = [0u8; 16];
    let n = get_opt(fd, SOL_SOCKET, SO_COOKIE, &mut b)?;
    (n == 8).then(|| u64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
}

pub fn set_timeout(fd: c_int, opt: c_int, t: Duration) -> bool {
    let tv = timeval { tv_sec: t.as_secs() as i64, tv_usec: t.subsec_micros() as i64 };
    // SAFETY: timeval is 16 plain bytes.
    let bytes: [u8; 16] = unsafe { std::mem::transmute(tv) };
    set_opt(fd, SOL_SOCKET, opt, &bytes)
}

/// The socket's `SO_SNDTIMEO`/`SO_RCVTIMEO` (`None` when unset or unreadable).
pub fn get_timeout(fd: c_int, opt: c_int) -> Option<Duration> {
    let mut b = [0u8; 16];
    let n = get_opt(fd, SOL_SOCKET, opt, &mut b)?;
    if n < 16 {
        return None;
    }
    let sec = i64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    let usec = i64::from_ne_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
    let t = Duration::from_secs(sec.max(0) as u64) + Duration::from_micros(usec.clamp(0, 999_999) as u64);
    (!t.is_zero()).then_some(t)
}

/// Whether `fd` is in non-blocking mode (`O_NONBLOCK` on its open file).
pub fn nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL takes no argument.
    let fl = unsafe { fcntl(fd, F_GETFL) };
    fl >= 0 && fl & O_NONBLOCK != 0
}

/// `poll` for `events` on one fd, up to `ms` (-1: no limit): the revents, or `Err(errno)`.
pub fn poll_one(fd: c_int, events: i16, ms: c_int) -> Result<i16, c_int> {
    let mut p = pollfd { fd, events, revents: 0 };
    // SAFETY: one valid pollfd.
    match unsafe { poll(&mut p, 1, ms) } {
        n if n < 0 => Err(errno()),
        0 => Ok(0),
        _ => Ok(p.revents),
    }
}

/// The real `getsockname` of `fd` into a `sockaddr_un`-sized buffer: the bytes written.
pub fn sock_name(fd: c_int, buf: &mut [u8; 128]) -> Option<usize> {
    let f = real::getsockname()?;
    let mut len = buf.len() as socklen_t;
    // SAFETY: a valid buffer and its length.
    let rc = unsafe { f(fd, buf.as_mut_ptr().cast(), &mut len) };
    (rc == 0).then_some((len as usize).min(buf.len()))
}

/// Whether the file at `path` (NUL-terminated), a comma-separated list of addresses as
/// `MESHD_TUNNEL_PEERS`, lists `ip` (canonical). Reads at most 16 KiB (about a thousand
/// addresses) into the stack with the real `read`: no allocation, no lock.
pub fn file_lists(path: &[u8], ip: std::net::IpAddr) -> bool {
    if path.last() != Some(&0) {
        return false;
    }
    // SAFETY: a NUL-terminated path; O_RDONLY takes no mode.
    let fd = unsafe { open(path.as_ptr().cast(), O_RDONLY | O_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    let mut buf = [0u8; 16 << 10];
    let mut n = 0;
    if let Some(read) = real::read() {
        while n < buf.len() {
            let rest = &mut buf[n..];
            // SAFETY: `rest` is a valid buffer of its length.
            let r = unsafe { read(fd, rest.as_mut_ptr().cast(), rest.len()) };
            if r > 0 {
                n += r as usize;
            } else if r == 0 || errno() != EINTR {
                break;
            }
        }
    }
    // SAFETY: our own descriptor, closed once.
    unsafe { close(fd) };
    let Ok(text) = std::str::from_utf8(&buf[..n]) else { return false };
    text.split(',').filter_map(|p| p.trim().parse::<std::net::IpAddr>().ok()).any(|p| p.to_canonical() == ip)
}
