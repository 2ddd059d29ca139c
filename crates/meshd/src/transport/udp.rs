//! The endpoint's UDP socket as quinn sees it: GSO batches capped to what the kernel
//! takes, payload sizes from the MTU, socket buffers.

use super::*;

/// The UDP socket with GSO batches capped at what one IP datagram can carry (64 KiB).
///
/// quinn batches up to 10 packets per `sendmsg`; with jumbo packets (8972 bytes) that is
/// 90 KB, the kernel answers EMSGSIZE, and quinn-udp silently drops the whole batch (it
/// expects EMSGSIZE only from MTU probes). The losses then look like an MTU black hole and
/// the path falls back to 1200-byte packets. Capping the segment count avoids both.
#[derive(Debug)]
pub(super) struct GsoCapped {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    max_segments: usize,
}

impl GsoCapped {
    pub(super) fn new(inner: Arc<dyn quinn::AsyncUdpSocket>, max_payload: u16, ipv6: bool) -> Self {
        // IPv4: 65535 minus IP and UDP headers; IPv6's payload length excludes its header.
        let limit = if ipv6 { 65_535 - 8 } else { 65_535 - 28 };
        let max_segments = (limit / max_payload.max(1) as usize).max(1);
        GsoCapped { inner, max_segments }
    }
}

impl quinn::AsyncUdpSocket for GsoCapped {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// The largest UDP payload an interface of MTU `mtu` carries, when it is above quinn's
/// default (1472 for IPv4); `None` for standard or smaller MTUs.
pub(super) fn max_udp_payload(mtu: u32, ipv6: bool) -> Option<u16> {
    let headers = if ipv6 { 48 } else { 28 };
    let payload = mtu.saturating_sub(headers).min(u16::MAX as u32 - 8) as u16;
    (payload > 1472).then_some(payload)
}

/// Large UDP socket buffers: bursts of a ring allreduce otherwise overflow the default
/// ~200 KiB and turn into loss. `SO_*BUFFORCE` (root) lifts the sysctl cap; without the
/// privilege the plain options still raise the buffers up to it.
pub(super) fn set_socket_buffers(socket: &std::net::UdpSocket, bytes: i32) {
    use std::os::fd::AsRawFd;
    let fd = socket.as_raw_fd();
    for (force, plain) in [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)] {
        for opt in [force, plain] {
            // SAFETY: setsockopt on a socket we own, with a valid pointer to an i32 and its size.
            let rc = unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&bytes as *const i32).cast(),
                    std::mem::size_of::<i32>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                break;
            }
        }
    }
}
