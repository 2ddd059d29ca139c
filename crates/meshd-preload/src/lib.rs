//! `libmeshd_preload.so`: loaded into every rank (`LD_PRELOAD`) when a job runs in tunnel
//! mode, it hands the TCP connections a rank opens to other roster nodes to the node's
//! meshd, which carries them over its authenticated QUIC connections (docs/PROTOCOL.md,
//! "The TCP tunnel"). The program is not to notice: the fd behaves as the TCP socket it
//! was, as far as the C library's calls can tell.
//!
//! `connect(fd, addr)` for an `AF_INET`/`AF_INET6` TCP socket whose address is one of
//! `MESHD_TUNNEL_PEERS` (the other roster nodes' addresses) does not reach the network:
//! a new Unix stream socket connects to `MESHD_TUNNEL` (meshd's tunnel socket), sends the
//! destination and takes the place of `fd` (`dup3`); meshd's one status byte says whether
//! the far connect succeeded. Everything else goes to the real `connect` untouched.
//!
//! - [`conn`]: the swap, and the connect's outcome as TCP reports it (`EINPROGRESS` for a
//!   non-blocking socket, which polls writable once the outcome is known, `SO_ERROR`,
//!   `SO_SNDTIMEO` for a blocking one); a refusal reads as `ECONNREFUSED`, a peer that
//!   cannot be reached as `EHOSTUNREACH`, no answer as `ETIMEDOUT`; never a hang.
//! - [`ident`]: a tunnelled socket is known by its Unix socket's own name, which says what
//!   it stands for: `dup`'d fds and fds inherited by children (also across `exec`) are
//!   tunnelled sockets too.
//! - [`opts`]: options set before `connect` are carried to the Unix socket (timeouts,
//!   buffers, keep-alive, ...) or emulated (TCP and IP options read back what was set).
//! - [`names`]: `getpeername` (the destination), `getsockname` (the bound address or this
//!   node's, `MESHD_NODE_ADDR`), `getsockopt`/`setsockopt`.
//! - [`io`]: reads and writes never see the status byte, and a reset reads as a reset.
//! - [`host`]: `gethostname` answers `MESHD_HOSTNAME` when meshd sets it
//!   (`--fault-tolerance node`: torchft advertises `http://{gethostname()}:port`, which must
//!   reach this node from the others).
//! - [`table`]: the process's lock-free entries of its tunnelled sockets (no lock a child
//!   forked while another thread held it could wait on).
//! - [`wire`]: the tunnel socket's requests and status bytes. [`sys`]: the C library.
//!
//! No dependencies but the C library, which [`sys`] declares itself: meshd's build script
//! compiles this crate with `rustc` alone (`panic=abort`). Nothing here panics on input,
//! and nothing waits on another thread: the configuration and the C library's functions
//! are read once at load (a constructor, before any thread exists), the table is atomics.

mod conn;
mod host;
mod ident;
mod io;
mod names;
mod opts;
mod sys;
mod table;
mod wire;

pub use conn::status_errno;
pub use sys::{iovec, msghdr};
pub use wire::{
    MAGIC, PAD, REQUEST_LEN, VERSION, VERSION_PADDED, decode_request, encode_padded_request, encode_request,
    parse_peers, status,
};

use std::net::IpAddr;
use std::sync::OnceLock;
use std::time::Duration;

use sys::{AF_UNIX, sockaddr_un, socklen_t};

/// What the ranks' environment says (read once, at load).
#[derive(Debug)]
pub struct Config {
    /// `MESHD_TUNNEL`, as a ready `sockaddr_un` and its length.
    pub path: Option<(sockaddr_un, socklen_t)>,
    pub peers: Vec<IpAddr>,
    /// `MESHD_TUNNEL_PEERS_FILE` (NUL-terminated): the roster's other nodes as meshd keeps
    /// them while the job runs (a node that joins later is added), read by [`Config::is_peer`]
    /// for a destination that `peers` does not list.
    pub peers_file: Option<Vec<u8>>,
    /// `MESHD_HOSTNAME`: what `gethostname` answers ([`host`]), when set.
    pub hostname: Option<Vec<u8>>,
    /// This node's address (`getsockname` of a tunnelled fd).
    pub node: Option<IpAddr>,
    /// The longest a connect waits for meshd's answer (`MESHD_TUNNEL_TIMEOUT_MS`, 30 s).
    pub timeout: Duration,
    pub debug: bool,
}

impl std::fmt::Debug for sockaddr_un {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let end = self.sun_path.iter().position(|b| *b == 0).unwrap_or(self.sun_path.len());
        write!(f, "sockaddr_un({:?})", String::from_utf8_lossy(&self.sun_path[..end]))
    }
}

impl Config {
    fn from_env() -> Config {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let path = var("MESHD_TUNNEL").and_then(|p| {
            let bytes = p.as_bytes();
            if bytes.len() >= 108 {
                return None;
            }
            let mut a = sockaddr_un { sun_family: AF_UNIX as u16, sun_path: [0; 108] };
            a.sun_path[..bytes.len()].copy_from_slice(bytes);
            Some((a, (2 + bytes.len() + 1) as socklen_t))
        });
        Config {
            path,
            peers: var("MESHD_TUNNEL_PEERS").map(|s| parse_peers(&s)).unwrap_or_default(),
            peers_file: var("MESHD_TUNNEL_PEERS_FILE").filter(|p| !p.contains('\0')).map(|p| {
                let mut b = p.into_bytes();
                b.push(0);
                b
            }),
            hostname: var("MESHD_HOSTNAME").map(String::into_bytes),
            node: var("MESHD_NODE_ADDR").and_then(|s| s.parse::<IpAddr>().ok()),
            timeout: var("MESHD_TUNNEL_TIMEOUT_MS")
                .and_then(|s| s.parse().ok())
                .map(Duration::from_millis)
                .unwrap_or(Duration::from_secs(30)),
            debug: var("MESHD_TUNNEL_DEBUG").is_some_and(|v| v != "0"),
        }
    }
}

impl Config {
    /// Whether a connect to `ip` goes through meshd: `ip` is another roster node's address,
    /// in the environment's list or (a node that joined the running job since the rank
    /// started) in meshd's peers file. Loopback never is.
    pub fn is_peer(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        if self.peers.contains(&ip) {
            return true;
        }
        if ip.is_loopback() || ip.is_unspecified() || self.path.is_none() {
            return false;
        }
        self.peers_file.as_deref().is_some_and(|f| sys::file_lists(f, ip))
    }
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// The configuration (read at load by [`init`]; read here if a call came first).
pub fn config() -> &'static Config {
    CONFIG.get_or_init(Config::from_env)
}

/// Runs at load, before the program's threads: resolves the C library's functions and
/// reads the environment, so neither takes a lock later.
extern "C" fn init() {
    sys::real::resolve_all();
    // The unit tests set their own configuration (a fake meshd).
    #[cfg(not(test))]
    let _ = config();
}

#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = init;

#[cfg(test)]
mod tests;
