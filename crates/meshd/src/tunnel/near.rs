//! The near end: ranks' requests on the tunnel socket.

use super::pipe::{Ends, pipe};
use super::{
    Budget, Conns, LiveRoutes, TunnelConfig, TunnelStats, decode_request, plane_stream, read_routes, wire,
};
use crate::transport::{TUNNEL_REQUEST_LEN, Transport};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tracing::debug;

/// How long a rank has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the near end waits for the far end's status (it includes the far end's 10 s
/// connect timeout).
const STATUS_TIMEOUT: Duration = Duration::from_secs(15);

/// Send buffer of meshd's end of a rank's Unix socket (the rank's end gets the same from
/// the preload library). A Unix socket's queue is bounded by its sender's buffer, 208 KiB
/// by default, and does not grow as TCP's does (to `tcp_wmem`'s 4 MiB); at the default a
/// 1 MiB Gloo message takes five writes and five wakeups of each side. Capped by
/// `net.core.wmem_max` (no privilege asked).
const UNIX_SNDBUF: libc::c_int = 4 << 20;

/// The near end: ranks' requests on the tunnel socket.
pub(super) struct Near {
    pub(super) cfg: Arc<TunnelConfig>,
    pub(super) routes: LiveRoutes,
    pub(super) conns: Arc<Conns>,
    /// The data plane, when tunnelled bytes may use it.
    pub(super) plane: Option<crate::transport::plane::Plane>,
    pub(super) transport: Transport,
    pub(super) stats: Arc<TunnelStats>,
    pub(super) budget: Arc<Budget>,
    /// Connections this node's ranks hold to each other node.
    pub(super) per_peer: std::sync::Mutex<HashMap<SocketAddr, Arc<Semaphore>>>,
}

impl Near {
    /// Accepts ranks' connections until the round's tunnel is dropped; every connection's
    /// task is in `tasks`, so they all end with it. An accept error (EMFILE: the process is
    /// out of open files) is waited out, never the end of the loop.
    pub(super) async fn serve(self, listener: UnixListener) {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        let near = Arc::new(self);
        let mut tasks = tokio::task::JoinSet::new();
        let mut errors = crate::files::AcceptErrors::new("the tunnel's socket");
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            };
            let s = match accepted {
                Ok((s, _)) => {
                    errors.ok();
                    s
                }
                Err(e) => {
                    tokio::time::sleep(errors.failed(&e)).await;
                    continue;
                }
            };
            // The directory is owner-only already; the kernel's word on the peer as well.
            if s.peer_cred().map(|c| c.uid()).ok() != Some(me) {
                continue;
            }
            let near = near.clone();
            tasks.spawn(async move { near.one(s).await });
        }
    }

    fn peer_slots(&self, node: SocketAddr) -> Arc<Semaphore> {
        let mut m = self.per_peer.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(node).or_insert_with(|| Arc::new(Semaphore::new(self.cfg.per_peer))).clone()
    }

    async fn one(&self, mut s: UnixStream) {
        let stats = &*self.stats;
        let mut request = [0u8; TUNNEL_REQUEST_LEN];
        if !matches!(tokio::time::timeout(REQUEST_TIMEOUT, s.read_exact(&mut request)).await, Ok(Ok(_))) {
            return;
        }
        let padded = request[..2] == wire::MAGIC && request[2] == wire::VERSION_PADDED;
        if padded {
            request[2] = wire::VERSION;
        }
        let fail = |status: u8, why: String| {
            stats.failed.fetch_add(1, Ordering::Relaxed);
            debug!("tunnel: {why}");
            status
        };
        let Some(dest) = decode_request(&request) else {
            let _ = s.write_all(&[fail(wire::status::FAILED, "malformed request from a rank".into())]).await;
            return;
        };
        let route = read_routes(&self.routes).to.get(&dest.ip().to_canonical()).copied();
        let Some(node) = route else {
            let _ = s
                .write_all(&[fail(wire::status::UNREACHABLE, format!("{dest} is not another roster node"))])
                .await;
            return;
        };
        let Ok(peer_permit) = self.peer_slots(node).try_acquire_owned() else {
            let why =
                format!("{dest}: this node's ranks hold {} tunnelled connections to it", self.cfg.per_peer);
            let _ = s.write_all(&[fail(wire::status::REFUSED, why)]).await;
            return;
        };
        let Some(file_permit) = self.budget.try_take() else {
            let why = format!(
                "{dest}: this node holds {} tunnelled connections, all its open files allow (ulimit -n)",
                self.budget.capacity()
            );
            crate::files::warn_once_out_of_files(&why);
            let _ = s.write_all(&[fail(wire::status::REFUSED, why)]).await;
            return;
        };
        // This end's plane stream is registered before it is offered: nothing the far end
        // sends on the plane can come before it.
        let mine = plane_stream::Mine::register(self.plane.as_ref(), node);
        let opened = async {
            let (mut send, mut recv) =
                self.transport.open_tunnel(node, &request).await.map_err(|e| e.to_string())?;
            send.write_all(&plane_stream::offer(mine.as_ref()).encode()).await.map_err(|e| e.to_string())?;
            let mut st = [0u8; 1];
            recv.read_exact(&mut st).await.map_err(|e| e.to_string())?;
            let mut theirs = [0u8; plane_stream::OFFER_LEN];
            if st[0] == wire::status::OK {
                recv.read_exact(&mut theirs).await.map_err(|e| e.to_string())?;
            }
            Ok::<_, String>((send, recv, st[0], plane_stream::Offer::decode(&theirs)))
        };
        let (send, recv, theirs) = match tokio::time::timeout(STATUS_TIMEOUT, opened).await {
            Ok(Ok((send, recv, wire::status::OK, theirs))) => (send, recv, theirs),
            Ok(Ok((_, _, st, _))) => {
                let _ = s.write_all(&[fail(st, format!("{dest}: the far end answered status {st}"))]).await;
                return;
            }
            Ok(Err(e)) => {
                let _ = s.write_all(&[fail(wire::status::UNREACHABLE, format!("{dest}: {e}"))]).await;
                return;
            }
            Err(_) => {
                let _ =
                    s.write_all(&[fail(wire::status::TIMED_OUT, format!("{dest}: no answer in time"))]).await;
                return;
            }
        };
        if s.write_all(&[wire::status::OK]).await.is_err() {
            return; // the rank gave up (its deadline): dropping the streams resets them
        }
        // The status first, then the padding: when the rank's socket polls writable, its
        // status byte is there to read.
        let mut pad = [0u8; wire::PAD];
        if padded && !matches!(tokio::time::timeout(REQUEST_TIMEOUT, s.read_exact(&mut pad)).await, Ok(Ok(_)))
        {
            return;
        }
        stats.opened.fetch_add(1, Ordering::Relaxed);
        set_sndbuf(&s, UNIX_SNDBUF);
        let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
        let (r, w) = s.into_split();
        let (registered, cut) = self.conns.register(node.ip(), dest);
        // A failure closes the socket at once, without the half-close a dropped write half
        // would send first: the rank then sees its peer gone (the preload library's reset,
        // see its doc), not an end of file.
        let ends = Ends { closed: Some(fd), cut };
        let way = mine.map(|m| m.with(theirs));
        pipe(r, w, (send, recv), way, stats, ends, tokio::net::unix::OwnedWriteHalf::forget).await;
        drop((registered, peer_permit, file_permit));
    }
}

/// Sets `SO_SNDBUF` (best effort: the kernel caps it at `net.core.wmem_max`).
fn set_sndbuf(s: &impl std::os::fd::AsRawFd, bytes: libc::c_int) {
    // SAFETY: setsockopt on a socket we hold, with a valid int and its size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}
