//! Copying a tunnelled connection's bytes both ways, and how it ends.

use super::conns::Cut;
use super::{TunnelStats, plane_stream};
use bytes::{Bytes, BytesMut};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// QUIC stream error code of a tunnelled connection that failed (reset).
pub(super) const RESET: u32 = 1;

/// The block a local socket's bytes are read into, then lent to quinn read by read: one
/// allocation per block, not per read.
pub(super) const BLOCK: usize = 1 << 20;
/// The least room a read gets in the block.
pub(super) const MIN_READ: usize = 64 << 10;
/// quinn's received chunks (about one packet each) written with one `writev`.
const MAX_CHUNKS: usize = 256;

/// Writes every byte of `chunks` to `w`, as many chunks per call as the socket takes.
pub(super) async fn write_all_chunks<W: AsyncWrite + Unpin>(
    w: &mut W,
    chunks: &mut [Bytes],
) -> std::io::Result<()> {
    use bytes::Buf;
    let mut first = 0;
    while first < chunks.len() {
        let slices: Vec<std::io::IoSlice<'_>> =
            chunks[first..].iter().map(|c| std::io::IoSlice::new(c)).collect();
        let mut n = w.write_vectored(&slices).await?;
        drop(slices);
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let c = &mut chunks[first];
            if n >= c.len() {
                n -= c.len();
                first += 1;
            } else {
                c.advance(n);
                n = 0;
            }
        }
        while first < chunks.len() && chunks[first].is_empty() {
            first += 1;
        }
    }
    Ok(())
}

/// What ends a piped connection besides its two sides: meshd's cut, and at the near end the
/// rank's socket closed entirely (see [`pipe`]).
pub(super) struct Ends {
    pub(super) closed: Option<std::os::fd::RawFd>,
    pub(super) cut: Cut,
}

/// How often a near end whose rank stopped sending checks whether the rank closed its
/// socket entirely.
const HANGUP_CHECK: Duration = Duration::from_millis(500);

/// Whether the peer of the Unix socket `fd` closed it entirely (POLLHUP: both directions
/// shut; a half-close shows only POLLRDHUP).
fn hung_up(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
    // SAFETY: poll on one valid pollfd with a zero timeout.
    unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLHUP != 0 }
}

/// SO_LINGER 0: closing `tcp` sends RST instead of FIN (tokio deprecates `set_linger`
/// because a positive linger blocks on drop; 0 never does).
pub(super) fn reset_on_close(tcp: &TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt on a socket we hold, with a valid linger struct and its size.
    unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// Copies both ways between a local stream and a QUIC stream pair until both directions
/// ended. End of file becomes a half-close on the other side; a failure on either side
/// resets the other (`abort` takes the local write half; the read half, dropped last,
/// closes the socket). Each direction starts with its mode byte: its bytes follow on the
/// QUIC stream, or travel on the data plane (`way`, [`plane_stream`]) where the sender
/// chose that.
///
/// `closed`, at the near end, is the rank's socket: once the rank stopped sending, it is
/// checked every [`HANGUP_CHECK`] for a full close (`close()`, not `shutdown(SHUT_WR)`):
/// then nothing more can reach the rank, so the stream's receive side is stopped (the far
/// application's next write is reset, as TCP answers data for a closed socket) and the
/// connection's files are freed, instead of being held until the far application closes.
///
/// `ends.cut` fires when meshd ends the connection ([`Tunnel::cut`](super::Tunnel::cut)): a failure, as above.
pub(super) async fn pipe<R, W>(
    mut r: R,
    mut w: W,
    quic: (quinn::SendStream, quinn::RecvStream),
    way: Option<(plane_stream::Way, crate::transport::plane::streams::Inbox)>,
    stats: &TunnelStats,
    ends: Ends,
    abort: impl FnOnce(W),
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Ends { closed, mut cut } = ends;
    let (mut send, mut recv) = quic;
    stats.active.fetch_add(1, Ordering::Relaxed);
    let (way, inbox) = way.unzip();
    let (mut credits, mut data) = inbox.map(|i| (i.credit, i.data)).unzip();
    let failed = {
        let up = async {
            if let (Some(way), Some(credits)) =
                (way.as_ref().filter(|w| w.sends_on_plane()), credits.as_mut())
            {
                send.write_all(&[plane_stream::MODE_PLANE]).await.map_err(|_| ())?;
                return plane_stream::up(&mut r, &mut send, way, credits, stats).await;
            }
            send.write_all(&[plane_stream::MODE_STREAM]).await.map_err(|_| ())?;
            // Each read fills the rest of the block and is lent to quinn as it is (no copy
            // into its send buffer); a new block only when little room is left.
            let mut buf = BytesMut::with_capacity(BLOCK);
            loop {
                if buf.capacity() - buf.len() < MIN_READ {
                    buf = BytesMut::with_capacity(BLOCK);
                }
                match r.read_buf(&mut buf).await {
                    Ok(0) => return send.finish().map_err(|_| ()),
                    Ok(n) => {
                        stats.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
                        send.write_chunk(buf.split().freeze()).await.map_err(|_| ())?;
                    }
                    Err(_) => return Err(()),
                }
            }
        };
        let down = async {
            let mut mode = [0u8; 1];
            recv.read_exact(&mut mode).await.map_err(|_| ())?;
            match (mode[0], way.as_ref(), data.as_mut()) {
                (plane_stream::MODE_STREAM, _, _) => {}
                (plane_stream::MODE_PLANE, Some(way), Some(data)) => {
                    return plane_stream::down(&mut w, &mut recv, way, data, stats).await;
                }
                _ => return Err(()),
            }
            // quinn's received chunks (about one packet each) go to the socket as they are,
            // as many as are ready with one writev: no copy, and no write per packet.
            let mut chunks = vec![Bytes::new(); MAX_CHUNKS];
            loop {
                match recv.read_chunks(&mut chunks).await {
                    Ok(Some(k)) => {
                        let n: usize = chunks[..k].iter().map(Bytes::len).sum();
                        stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                        write_all_chunks(&mut w, &mut chunks[..k]).await.map_err(|_| ())?;
                    }
                    Ok(None) => return w.shutdown().await.map_err(|_| ()),
                    Err(_) => return Err(()),
                }
            }
        };
        tokio::pin!(up, down);
        let (mut up_done, mut down_done, mut uncut) = (false, false, false);
        let mut hangup = tokio::time::interval(HANGUP_CHECK);
        loop {
            tokio::select! {
                c = &mut cut, if !uncut => {
                    if c.is_ok() { break true; }
                    uncut = true; // the registry is gone: nobody can cut any more
                }
                res = &mut up, if !up_done => {
                    if res.is_err() { break true; }
                    up_done = true;
                }
                res = &mut down, if !down_done => {
                    if res.is_err() { break true; }
                    down_done = true;
                }
                _ = hangup.tick(), if up_done && closed.is_some() => {
                    if closed.is_some_and(hung_up) {
                        break true;
                    }
                }
            }
            if up_done && down_done {
                break false;
            }
        }
    };
    if failed {
        let _ = send.reset(RESET.into());
        let _ = recv.stop(RESET.into());
        abort(w);
    }
    stats.active.fetch_sub(1, Ordering::Relaxed);
    drop(r);
}
