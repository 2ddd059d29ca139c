//! The interposer in this test process (its functions are this binary's `connect`,
//! `read`, ...), against a fake meshd on a Unix socket that answers by destination port:
//! [`REFUSED_PORT`] refused, [`SLOW_PORT`] connected after [`SLOW`], [`SILENT_PORT`] no
//! answer, any other port connected at once, then an echo of the stream. No TCP packet
//! is sent: 127.0.0.2 is the "roster node", and the fake meshd answers for it.

use std::ffi::c_int;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::names::{connect, getpeername, getsockname, getsockopt, setsockopt};
use crate::sys::*;
use crate::{Config, wire};

const REFUSED_PORT: u16 = 1;
const SLOW_PORT: u16 = 2;
const SILENT_PORT: u16 = 3;
/// Connected, then meshd's end closes after 3 bytes (a failed tunnelled connection).
const DROP_PORT: u16 = 4;
const ECHO_PORT: u16 = 7;
const SLOW: Duration = Duration::from_millis(800);
const TCP_NODELAY: c_int = 1;
const TCP_KEEPIDLE: c_int = 4;

unsafe extern "C" {
    fn fork() -> c_int;
    fn waitpid(pid: c_int, status: *mut c_int, options: c_int) -> c_int;
    fn kill(pid: c_int, sig: c_int) -> c_int;
    fn _exit(code: c_int) -> !;
    fn dup(fd: c_int) -> c_int;
}

fn serve(mut s: UnixStream) {
    let mut req = [0u8; wire::REQUEST_LEN];
    if s.read_exact(&mut req).is_err() || req[2] != wire::VERSION_PADDED {
        return;
    }
    req[2] = wire::VERSION;
    let Some(dest) = wire::decode_request(&req) else { return };
    let status = match dest.port() {
        REFUSED_PORT => wire::status::REFUSED,
        SILENT_PORT => {
            std::thread::sleep(Duration::from_secs(20));
            return;
        }
        SLOW_PORT => {
            std::thread::sleep(SLOW);
            wire::status::OK
        }
        _ => wire::status::OK,
    };
    if s.write_all(&[status]).is_err() || status != wire::status::OK {
        return;
    }
    let mut pad = [0u8; wire::PAD];
    if s.read_exact(&mut pad).is_err() {
        return;
    }
    if dest.port() == DROP_PORT {
        let mut three = [0u8; 3];
        let _ = s.read_exact(&mut three);
        return;
    }
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if s.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

/// What `gethostname` answers in these tests (`MESHD_HOSTNAME`).
const HOSTNAME: &str = "198.19.0.7";

/// The peers file of these tests: one address of a node that "joined" after the start,
/// beside garbage meshd never writes. NUL-terminated, as the configuration holds it.
fn peers_file() -> Vec<u8> {
    let path = std::env::temp_dir().join(format!("meshd-preload-test-{}.peers", std::process::id()));
    std::fs::write(&path, "nonsense, 198.18.77.1,::ffff:198.18.77.2\n").expect("peers file");
    let mut b = path.to_str().expect("utf-8 path").as_bytes().to_vec();
    b.push(0);
    b
}

/// Starts the fake meshd and sets the configuration (once per test process).
fn setup() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("meshd-preload-test-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).expect("fake meshd socket");
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                std::thread::spawn(move || serve(s));
            }
        });
        let p = path.to_str().expect("utf-8 path").as_bytes();
        let mut a = sockaddr_un { sun_family: AF_UNIX as u16, sun_path: [0; 108] };
        a.sun_path[..p.len()].copy_from_slice(p);
        let cfg = Config {
            path: Some((a, (2 + p.len() + 1) as socklen_t)),
            peers: vec!["127.0.0.2".parse().expect("ip")],
            peers_file: Some(peers_file()),
            hostname: Some(HOSTNAME.as_bytes().to_vec()),
            node: Some("127.0.0.1".parse().expect("ip")),
            timeout: Duration::from_secs(10),
            debug: false,
        };
        assert!(crate::CONFIG.set(cfg).is_ok(), "the configuration was read before the tests set it");
    });
}

fn tcp_socket(flags: c_int) -> c_int {
    // SAFETY: plain socket creation.
    let fd = unsafe { socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | flags, 0) };
    assert!(fd >= 0, "socket: errno {}", errno());
    fd
}

fn sockaddr(port: u16) -> ([u8; 28], socklen_t) {
    let a: SocketAddr = SocketAddr::from(([127, 0, 0, 2], port));
    let mut b = [0u8; 28];
    b[..2].copy_from_slice(&(AF_INET as u16).to_ne_bytes());
    b[2..4].copy_from_slice(&a.port().to_be_bytes());
    b[4..8].copy_from_slice(&[127, 0, 0, 2]);
    (b, 16)
}

/// The interposed connect: 0, or the errno.
fn connect_to(fd: c_int, port: u16) -> c_int {
    let (b, n) = sockaddr(port);
    // SAFETY: a valid sockaddr_in.
    if unsafe { connect(fd, b.as_ptr().cast(), n) } == 0 { 0 } else { errno() }
}

fn so_error(fd: c_int) -> c_int {
    let mut v: c_int = -1;
    let mut len = 4 as socklen_t;
    // SAFETY: a valid int and its length.
    let rc = unsafe { getsockopt(fd, SOL_SOCKET, SO_ERROR, (&mut v as *mut c_int).cast(), &mut len) };
    assert_eq!(rc, 0, "getsockopt SO_ERROR: errno {}", errno());
    v
}

fn opt(fd: c_int, level: c_int, name: c_int) -> c_int {
    let mut v: c_int = -1;
    let mut len = 4 as socklen_t;
    // SAFETY: a valid int and its length.
    let rc = unsafe { getsockopt(fd, level, name, (&mut v as *mut c_int).cast(), &mut len) };
    assert_eq!(rc, 0, "getsockopt {level}/{name}: errno {}", errno());
    v
}

fn set(fd: c_int, level: c_int, name: c_int, v: c_int) -> c_int {
    // SAFETY: a valid int and its size.
    let rc = unsafe { setsockopt(fd, level, name, (&v as *const c_int).cast(), 4) };
    if rc == 0 { 0 } else { errno() }
}

/// `getpeername`: the port, or the errno.
fn peer_port(fd: c_int) -> Result<u16, c_int> {
    let mut b = [0u8; 28];
    let mut len = 28 as socklen_t;
    // SAFETY: a valid buffer and its length.
    if unsafe { getpeername(fd, b.as_mut_ptr().cast(), &mut len) } != 0 {
        return Err(errno());
    }
    assert_eq!((len, u16::from_ne_bytes([b[0], b[1]]) as c_int), (16, AF_INET), "an AF_INET peer");
    assert_eq!(&b[4..8], &[127, 0, 0, 2]);
    Ok(u16::from_be_bytes([b[2], b[3]]))
}

fn echo(fd: c_int, msg: &[u8]) -> Vec<u8> {
    // SAFETY: a valid buffer.
    let n = unsafe { crate::io::write(fd, msg.as_ptr().cast(), msg.len()) };
    assert_eq!(n, msg.len() as isize, "write: errno {}", errno());
    let mut got = Vec::new();
    let t = Instant::now();
    while got.len() < msg.len() && t.elapsed() < Duration::from_secs(10) {
        let mut b = [0u8; 256];
        let _ = poll_one(fd, POLLIN, 1000);
        // SAFETY: a valid buffer.
        let n = unsafe { crate::io::recv(fd, b.as_mut_ptr().cast(), b.len(), MSG_DONTWAIT) };
        if n > 0 {
            got.extend_from_slice(&b[..n as usize]);
        }
    }
    got
}

fn close_fd(fd: c_int) {
    // SAFETY: a socket of this test.
    unsafe { close(fd) };
}

const POLLOUT: i16 = 0x4;

#[test]
fn a_non_blocking_connect_is_in_progress_then_writable_and_so_error_tells_the_outcome() {
    setup();
    let fd = tcp_socket(SOCK_NONBLOCK);
    assert_eq!(connect_to(fd, ECHO_PORT), EINPROGRESS);
    let r = poll_one(fd, POLLOUT, 5000).expect("poll");
    assert!(r & POLLOUT != 0, "writable once connected: revents {r:#x}");
    assert_eq!(so_error(fd), 0);
    assert_eq!(peer_port(fd), Ok(ECHO_PORT));
    assert_eq!(echo(fd, b"hello"), b"hello", "the status byte is not data");
    assert_eq!(connect_to(fd, ECHO_PORT), 0, "the first connect after completion says 0");
    assert_eq!(connect_to(fd, ECHO_PORT), EISCONN, "later ones EISCONN");
    close_fd(fd);

    let fd = tcp_socket(SOCK_NONBLOCK);
    assert_eq!(connect_to(fd, REFUSED_PORT), EINPROGRESS);
    let r = poll_one(fd, POLLOUT, 5000).expect("poll");
    assert!(r != 0, "polls ready once refused");
    assert_eq!(so_error(fd), ECONNREFUSED);
    assert_eq!(so_error(fd), 0, "told once, as the kernel's SO_ERROR");
    assert_eq!(peer_port(fd), Err(ENOTCONN));
    close_fd(fd);
}

#[test]
fn while_meshd_has_not_answered_the_socket_is_not_writable_and_reads_see_no_status_byte() {
    setup();
    let fd = tcp_socket(SOCK_NONBLOCK);
    let t = Instant::now();
    assert_eq!(connect_to(fd, SLOW_PORT), EINPROGRESS);
    assert!(t.elapsed() < SLOW / 2, "connect returns at once: {:?}", t.elapsed());
    assert_eq!(poll_one(fd, POLLOUT | POLLIN, 200), Ok(0), "neither writable nor readable while in progress");
    assert_eq!(so_error(fd), 0, "no error while in progress");
    assert_eq!(peer_port(fd), Err(ENOTCONN));
    let mut b = [0u8; 8];
    // SAFETY: a valid buffer.
    let n = unsafe { crate::io::read(fd, b.as_mut_ptr().cast(), b.len()) };
    assert_eq!((n, errno()), (-1, EAGAIN));
    let r = poll_one(fd, POLLOUT, 5000).expect("poll");
    assert!(r & POLLOUT != 0 && t.elapsed() >= SLOW, "writable once answered: {r:#x} {:?}", t.elapsed());
    // A read, not SO_ERROR, settles it here: still no status byte in the data.
    assert_eq!(echo(fd, b"after"), b"after");
    assert_eq!(peer_port(fd), Ok(SLOW_PORT));
    close_fd(fd);
}

#[test]
fn a_blocking_connect_waits_and_honours_so_sndtimeo() {
    setup();
    let fd = tcp_socket(0);
    let t = Instant::now();
    assert_eq!(connect_to(fd, SLOW_PORT), 0);
    assert!(t.elapsed() >= SLOW, "waited for meshd's answer: {:?}", t.elapsed());
    assert_eq!(echo(fd, b"blocking"), b"blocking");
    close_fd(fd);

    let fd = tcp_socket(0);
    assert!(set_timeout(fd, SO_SNDTIMEO, Duration::from_millis(300)));
    let t = Instant::now();
    assert_eq!(
        connect_to(fd, SILENT_PORT),
        EINPROGRESS,
        "SO_SNDTIMEO ends a blocking connect as the kernel's"
    );
    let e = t.elapsed();
    assert!(e >= Duration::from_millis(250) && e < Duration::from_secs(5), "{e:?}");
    assert_eq!(connect_to(fd, SILENT_PORT), EALREADY, "still in progress");
    close_fd(fd);
}

#[test]
fn options_and_bind_before_connect_hold_after_it() {
    setup();
    let fd = tcp_socket(0);
    assert!(set_timeout(fd, SO_RCVTIMEO, Duration::from_millis(300)));
    assert_eq!(set(fd, IPPROTO_TCP, TCP_NODELAY, 1), 0);
    assert_eq!(set(fd, IPPROTO_TCP, TCP_KEEPIDLE, 17), 0);
    assert_eq!(set(fd, SOL_SOCKET, SO_KEEPALIVE, 1), 0);
    assert_eq!(set(fd, SOL_SOCKET, SO_SNDBUF, 100_000), 0);
    let sndbuf = opt(fd, SOL_SOCKET, SO_SNDBUF);
    // Bound to a port of its own first (as a program choosing its source address).
    let mut a = [0u8; 16];
    a[..2].copy_from_slice(&(AF_INET as u16).to_ne_bytes());
    a[4..8].copy_from_slice(&[127, 0, 0, 1]);
    // SAFETY: a valid sockaddr_in.
    assert_eq!(unsafe { bind(fd, a.as_ptr().cast(), 16) }, 0, "bind: errno {}", errno());
    let mut b = [0u8; 28];
    let mut len = 28 as socklen_t;
    // SAFETY: a valid buffer and its length.
    assert_eq!(unsafe { getsockname(fd, b.as_mut_ptr().cast(), &mut len) }, 0);
    let bound_port = u16::from_be_bytes([b[2], b[3]]);
    assert_ne!(bound_port, 0);

    assert_eq!(connect_to(fd, ECHO_PORT), 0);
    assert_eq!(opt(fd, IPPROTO_TCP, TCP_NODELAY), 1);
    assert_eq!(opt(fd, IPPROTO_TCP, TCP_KEEPIDLE), 17);
    assert_eq!(opt(fd, SOL_SOCKET, SO_KEEPALIVE), 1);
    assert_eq!(opt(fd, SOL_SOCKET, SO_SNDBUF), sndbuf, "the buffer the program chose");
    assert_eq!(opt(fd, SOL_SOCKET, SO_DOMAIN), AF_INET);
    assert_eq!(opt(fd, SOL_SOCKET, SO_PROTOCOL), IPPROTO_TCP);
    assert_eq!(opt(fd, SOL_SOCKET, SO_TYPE), SOCK_STREAM);
    assert_eq!(set(fd, IPPROTO_TCP, TCP_NODELAY, 0), 0);
    assert_eq!(opt(fd, IPPROTO_TCP, TCP_NODELAY), 0, "reads back what was set after the connect too");
    let mut len = 28 as socklen_t;
    // SAFETY: a valid buffer and its length.
    assert_eq!(unsafe { getsockname(fd, b.as_mut_ptr().cast(), &mut len) }, 0);
    assert_eq!((len, &b[4..8], u16::from_be_bytes([b[2], b[3]])), (16, &[127u8, 0, 0, 1][..], bound_port));

    // SO_RCVTIMEO set before the connect: a read times out.
    let t = Instant::now();
    let mut buf = [0u8; 4];
    // SAFETY: a valid buffer.
    let n = unsafe { crate::io::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
    let e = t.elapsed();
    assert_eq!((n, errno()), (-1, EAGAIN), "recv times out");
    assert!(e >= Duration::from_millis(250) && e < Duration::from_secs(5), "{e:?}");
    close_fd(fd);
}

#[test]
fn dup_d_fds_and_a_socket_known_only_by_its_name_are_tcp_sockets() {
    setup();
    let fd = tcp_socket(0);
    assert_eq!(set(fd, IPPROTO_TCP, TCP_NODELAY, 1), 0);
    assert_eq!(connect_to(fd, ECHO_PORT), 0);
    // SAFETY: duplicating our socket.
    let d = unsafe { dup(fd) };
    assert!(d >= 0);
    assert_eq!(peer_port(d), Ok(ECHO_PORT));
    assert_eq!(opt(d, SOL_SOCKET, SO_DOMAIN), AF_INET);
    assert_eq!(set(d, IPPROTO_TCP, TCP_NODELAY, 0), 0);
    assert_eq!(opt(fd, IPPROTO_TCP, TCP_NODELAY), 0, "one socket, whichever fd");
    // As a process that inherited the fd across exec knows it: by its name only.
    let cookie = socket_cookie(fd).expect("cookie");
    crate::table::remove(crate::table::find(cookie).expect("entry"), cookie);
    assert_eq!(peer_port(d), Ok(ECHO_PORT));
    assert_eq!(opt(d, IPPROTO_TCP, TCP_NODELAY), 1, "as it was at the swap: in the name");
    assert_eq!(set(d, IPPROTO_TCP, TCP_NODELAY, 0), 0);
    assert_eq!(opt(fd, IPPROTO_TCP, TCP_NODELAY), 0);
    assert_eq!(echo(d, b"dup"), b"dup");
    close_fd(d);
    close_fd(fd);
}

/// Many threads connecting through the tunnel and setting options while the process
/// forks: every child, which uses the interposer at once, exits (bounded).
#[test]
fn a_child_forked_while_threads_use_the_interposer_does_not_hang() {
    setup();
    let shared = tcp_socket(0);
    assert_eq!(connect_to(shared, ECHO_PORT), 0);
    static STOP: AtomicBool = AtomicBool::new(false);
    let workers: Vec<_> = (0..6)
        .map(|k| {
            std::thread::spawn(move || {
                while !STOP.load(Ordering::Relaxed) {
                    if k % 2 == 0 {
                        let _ = set(shared, IPPROTO_TCP, TCP_NODELAY, 1);
                        let _ = opt(shared, IPPROTO_TCP, TCP_NODELAY);
                        let _ = peer_port(shared);
                    } else {
                        let fd = tcp_socket(SOCK_NONBLOCK);
                        let _ = connect_to(fd, ECHO_PORT);
                        let _ = set(fd, IPPROTO_TCP, TCP_NODELAY, 1);
                        let _ = poll_one(fd, POLLOUT, 1000);
                        let _ = so_error(fd);
                        close_fd(fd);
                    }
                }
            })
        })
        .collect();
    let mut hung = 0;
    for _ in 0..40 {
        // SAFETY: the child only calls the interposer and _exit.
        let child = unsafe { fork() };
        assert!(child >= 0, "fork: errno {}", errno());
        if child == 0 {
            let ok = set(shared, IPPROTO_TCP, TCP_NODELAY, 1) == 0
                && opt(shared, IPPROTO_TCP, TCP_NODELAY) == 1
                && peer_port(shared) == Ok(ECHO_PORT)
                && {
                    let fd = tcp_socket(0);
                    let ok = connect_to(fd, ECHO_PORT) == 0;
                    close_fd(fd);
                    ok
                };
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { _exit(if ok { 0 } else { 1 }) };
        }
        let t = Instant::now();
        let mut status = 0;
        loop {
            // SAFETY: our child; WNOHANG.
            let r = unsafe { waitpid(child, &mut status, 1) };
            if r == child {
                assert_eq!(status, 0, "the child's calls failed (status {status:#x})");
                break;
            }
            if t.elapsed() > Duration::from_secs(10) {
                // SAFETY: our child.
                unsafe {
                    kill(child, 9);
                    waitpid(child, &mut status, 0);
                }
                hung += 1;
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    STOP.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("worker");
    }
    close_fd(shared);
    assert_eq!(hung, 0, "children hung after fork");
}

/// meshd drops a tunnelled connection (closes without a half-close first): the read says
/// ECONNRESET once, then end of file; also for a socket known only by its name.
#[test]
fn a_dropped_tunnel_reads_as_a_reset_also_by_name_only() {
    setup();
    for by_name in [false, true] {
        let fd = tcp_socket(0);
        assert_eq!(connect_to(fd, DROP_PORT), 0);
        if by_name {
            let cookie = socket_cookie(fd).expect("cookie");
            crate::table::remove(crate::table::find(cookie).expect("entry"), cookie);
        }
        // SAFETY: a valid buffer.
        assert_eq!(unsafe { crate::io::write(fd, b"abc".as_ptr().cast(), 3) }, 3);
        let mut b = [0u8; 8];
        assert!(poll_one(fd, POLLIN, 5000).is_ok_and(|r| r != 0));
        // meshd's end is gone once it polls hung up.
        let t = Instant::now();
        while !poll_one(fd, 0, 0).is_ok_and(|r| r & POLLHUP != 0) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        // SAFETY: a valid buffer.
        let n = unsafe { crate::io::read(fd, b.as_mut_ptr().cast(), b.len()) };
        assert_eq!((n, errno()), (-1, ECONNRESET), "by name only: {by_name}");
        // SAFETY: a valid buffer.
        let n = unsafe { crate::io::read(fd, b.as_mut_ptr().cast(), b.len()) };
        assert_eq!(n, 0, "then end of file");
        close_fd(fd);
    }
}

#[test]
fn a_node_that_joined_later_is_a_peer_through_the_file_and_loopback_never_is() {
    setup();
    let cfg = crate::config();
    let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
    assert!(cfg.is_peer(ip("127.0.0.2")), "the environment's list");
    assert!(cfg.is_peer(ip("198.18.77.1")), "listed in the file");
    assert!(cfg.is_peer(ip("198.18.77.2")), "an IPv4-mapped entry reads as IPv4");
    assert!(cfg.is_peer(ip("::ffff:198.18.77.1")), "an IPv4-mapped destination too");
    assert!(!cfg.is_peer(ip("198.18.77.3")), "not listed");
    assert!(!cfg.is_peer(ip("127.0.0.3")), "loopback is never looked up");
    assert!(!crate::sys::file_lists(b"/nonexistent/meshd-peers\0", ip("198.18.77.1")), "no file: nobody");
    assert!(!crate::sys::file_lists(b"/no/nul", ip("198.18.77.1")), "a path without its NUL is refused");
}

#[test]
fn gethostname_answers_meshd_s_name_as_glibc_would() {
    setup();
    let mut buf = [0x55 as std::ffi::c_char; 64];
    // SAFETY: a valid buffer of its length.
    assert_eq!(unsafe { crate::host::gethostname(buf.as_mut_ptr(), buf.len()) }, 0);
    // SAFETY: gethostname wrote a NUL-terminated string into `buf`.
    let got = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    assert_eq!(got.to_str().expect("utf-8"), HOSTNAME);
    // Too small a buffer: ENAMETOOLONG, as glibc.
    // SAFETY: as above.
    assert_eq!(unsafe { crate::host::gethostname(buf.as_mut_ptr(), HOSTNAME.len()) }, -1);
    assert_eq!(errno(), ENAMETOOLONG);
    // The fortified entry honours the smaller of the two lengths.
    // SAFETY: as above.
    assert_eq!(unsafe { crate::host::__gethostname_chk(buf.as_mut_ptr(), 64, 4) }, -1);
    // SAFETY: as above.
    assert_eq!(unsafe { crate::host::__gethostname_chk(buf.as_mut_ptr(), 64, 64) }, 0);
}
