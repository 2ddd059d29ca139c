//! The gRPC edge: HTTP/2 (h2, no TLS, as torchft's tonic server) and gRPC's framing, by
//! hand for two unary methods.
//!
//! A gRPC request is a POST to `/package.Service/Method` with `content-type:
//! application/grpc`; its body is length-prefixed messages (1 byte "compressed" flag, 4
//! bytes big-endian length, the protobuf bytes). The answer is headers (`:status 200`,
//! the content type), one such message, then trailers with `grpc-status` and
//! `grpc-message`; an error is "trailers-only": one HEADERS frame that ends the stream.
//!
//! Everything a peer sends is bounded: connections, streams per connection, header list,
//! message size, the time to finish the handshake and to send a request's body, and the
//! time an idle connection is kept. A connection that breaks any of it is closed with a
//! debug log. Every connection's task is owned by [`serve`]'s `JoinSet` and every stream's
//! by its connection's, so nothing outlives its owner.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use h2::RecvStream;
use h2::server::SendResponse;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use prost::Message;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, warn};

use super::LighthouseCall;
use super::proto::{
    LighthouseHeartbeatRequest, LighthouseHeartbeatResponse, LighthouseQuorumRequest,
    LighthouseQuorumResponse, Quorum,
};

/// The bounds the server holds every peer to.
#[derive(Clone, Debug)]
pub struct ServerLimits {
    /// Largest request message (gRPC's own default is 4 MiB).
    pub max_message: usize,
    /// Open connections; one more is closed at once.
    pub max_connections: usize,
    /// Concurrent streams (RPCs) per connection.
    pub max_streams: u32,
    /// Largest header list of a request.
    pub max_header_list: u32,
    /// Time for a new connection to send the HTTP/2 preface and settings.
    pub handshake_timeout: Duration,
    /// Time for a request's body to arrive (and the longest RPC without `grpc-timeout`
    /// for Heartbeat; a Quorum long-poll without it waits as long as it takes, as in torchft).
    pub body_timeout: Duration,
    /// A connection with no stream open for this long is closed.
    pub idle_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_message: 4 << 20,
            max_connections: 256,
            max_streams: 128,
            max_header_list: 16 << 10,
            handshake_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(300),
        }
    }
}

/// gRPC status codes used here.
mod code {
    pub const OK: u32 = 0;
    pub const INVALID_ARGUMENT: u32 = 3;
    pub const DEADLINE_EXCEEDED: u32 = 4;
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    pub const UNIMPLEMENTED: u32 = 12;
    pub const UNAVAILABLE: u32 = 14;
}

/// A gRPC error: status code and message.
#[derive(Debug)]
struct Status {
    code: u32,
    message: String,
}

impl Status {
    fn new(code: u32, message: impl Into<String>) -> Status {
        Status { code, message: message.into() }
    }
}

/// Serves torchft's `LighthouseService` on `listener`, sending each RPC to `calls`; runs
/// until the task is dropped (which closes every connection) or `calls` closes.
pub async fn serve(listener: TcpListener, calls: mpsc::Sender<LighthouseCall>, limits: ServerLimits) {
    let limits = Arc::new(limits);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((sock, peer)) => match slots.clone().try_acquire_owned() {
                    Ok(slot) => {
                        let (calls, limits) = (calls.clone(), limits.clone());
                        conns.spawn(async move {
                            connection(sock, peer, calls, &limits).await;
                            drop(slot);
                        });
                    }
                    Err(_) => debug!(%peer, "lighthouse: {} connections open, one more closed", limits.max_connections),
                },
                Err(e) => {
                    // EMFILE and friends: the next accept may work once a connection closes.
                    warn!("lighthouse: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next() => {}
            _ = calls.closed() => return,
        }
    }
}

async fn connection(
    sock: TcpStream,
    peer: SocketAddr,
    calls: mpsc::Sender<LighthouseCall>,
    limits: &ServerLimits,
) {
    let _ = sock.set_nodelay(true);
    let mut builder = h2::server::Builder::new();
    builder
        .max_concurrent_streams(limits.max_streams)
        .max_header_list_size(limits.max_header_list)
        .max_send_buffer_size(1 << 20)
        .max_pending_accept_reset_streams(64)
        .max_local_error_reset_streams(Some(256));
    let mut conn =
        match tokio::time::timeout(limits.handshake_timeout, builder.handshake::<_, Bytes>(sock)).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return debug!(%peer, "lighthouse: not an HTTP/2 client: {e}"),
            Err(_) => {
                return debug!(%peer, "lighthouse: no HTTP/2 handshake within {:?}", limits.handshake_timeout);
            }
        };
    let mut streams = JoinSet::new();
    let idle = tokio::time::sleep(limits.idle_timeout);
    tokio::pin!(idle);
    loop {
        tokio::select! {
            req = conn.accept() => match req {
                None => break,
                Some(Err(e)) => {
                    debug!(%peer, "lighthouse: connection error: {e}");
                    break;
                }
                Some(Ok((req, respond))) => {
                    streams.spawn(rpc(req, respond, calls.clone(), limits.clone()));
                }
            },
            Some(_) = streams.join_next() => {
                if streams.is_empty() {
                    idle.as_mut().reset(Instant::now() + limits.idle_timeout);
                }
            }
            _ = &mut idle, if streams.is_empty() => {
                debug!(%peer, "lighthouse: connection idle for {:?}, closed", limits.idle_timeout);
                conn.graceful_shutdown();
                let _ = tokio::time::timeout(Duration::from_secs(1), poll_fn(|cx| conn.poll_closed(cx))).await;
                break;
            }
        }
    }
    // Dropping `streams` ends the RPCs still waiting (their client is gone with the
    // connection); the decider sees their answer channels close.
}

/// The methods served.
#[derive(Clone, Copy, Debug)]
enum Method_ {
    Quorum,
    Heartbeat,
}

async fn rpc(
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    calls: mpsc::Sender<LighthouseCall>,
    limits: ServerLimits,
) {
    let (parts, body) = req.into_parts();
    if parts.method != Method::POST {
        return plain(&mut respond, StatusCode::METHOD_NOT_ALLOWED);
    }
    let grpc = parts.headers.get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| {
        v == "application/grpc" || v.starts_with("application/grpc+") || v.starts_with("application/grpc;")
    });
    if !grpc {
        return plain(&mut respond, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }
    let method = match parts.uri.path() {
        "/torchft.LighthouseService/Quorum" => Method_::Quorum,
        "/torchft.LighthouseService/Heartbeat" => Method_::Heartbeat,
        other => {
            let s = Status::new(code::UNIMPLEMENTED, format!("unknown method {other}"));
            return send_status(&mut respond, &s);
        }
    };
    let deadline = match parts.headers.get("grpc-timeout").map(|v| parse_timeout(v.as_bytes())) {
        None => None,
        Some(Some(d)) => Some(Instant::now() + d),
        Some(None) => {
            return send_status(&mut respond, &Status::new(code::INVALID_ARGUMENT, "bad grpc-timeout"));
        }
    };
    let result = async {
        let body_deadline = Instant::now() + limits.body_timeout;
        let body_deadline = deadline.map_or(body_deadline, |d| d.min(body_deadline));
        let msg = match tokio::time::timeout_at(body_deadline, read_message(body, limits.max_message)).await {
            Ok(m) => m?,
            Err(_) => {
                return Err(Status::new(
                    code::DEADLINE_EXCEEDED,
                    "the request's body did not arrive in time",
                ));
            }
        };
        match method {
            Method_::Heartbeat => heartbeat(&msg, &calls).await,
            Method_::Quorum => quorum(&msg, &calls, deadline, &mut respond).await,
        }
    }
    .await;
    match result {
        Ok(bytes) => send_message(&mut respond, bytes),
        Err(s) => send_status(&mut respond, &s),
    }
}

async fn heartbeat(msg: &[u8], calls: &mpsc::Sender<LighthouseCall>) -> Result<Bytes, Status> {
    let req = LighthouseHeartbeatRequest::decode(msg)
        .map_err(|e| Status::new(code::INVALID_ARGUMENT, format!("undecodable heartbeat request: {e}")))?;
    calls
        .send(LighthouseCall::Heartbeat { replica_id: req.replica_id })
        .await
        .map_err(|_| Status::new(code::UNAVAILABLE, "the lighthouse's decider is gone"))?;
    Ok(LighthouseHeartbeatResponse {}.encode_to_vec().into())
}

async fn quorum(
    msg: &[u8],
    calls: &mpsc::Sender<LighthouseCall>,
    deadline: Option<Instant>,
    respond: &mut SendResponse<Bytes>,
) -> Result<Bytes, Status> {
    let req = LighthouseQuorumRequest::decode(msg)
        .map_err(|e| Status::new(code::INVALID_ARGUMENT, format!("undecodable quorum request: {e}")))?;
    let member = req.requester.ok_or_else(|| Status::new(code::INVALID_ARGUMENT, "missing requester"))?;
    let (tx, rx) = oneshot::channel();
    let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
    // A busy decider's full queue makes this wait, within the deadline too.
    match tokio::time::timeout_at(
        deadline.unwrap_or(far),
        calls.send(LighthouseCall::Quorum { member: member.into(), reply: tx }),
    )
    .await
    {
        Ok(Ok(())) => {}
        Ok(Err(_)) => return Err(Status::new(code::UNAVAILABLE, "the lighthouse's decider is gone")),
        Err(_) => return Err(Status::new(code::DEADLINE_EXCEEDED, "the lighthouse's decider is too busy")),
    }
    let answer = tokio::select! {
        a = rx => a.map_err(|_| Status::new(code::UNAVAILABLE, "the lighthouse's decider dropped the request"))?,
        _ = tokio::time::sleep_until(deadline.unwrap_or(far)) => {
            return Err(Status::new(code::DEADLINE_EXCEEDED, "no quorum within the request's timeout"));
        }
        r = poll_fn(|cx| respond.poll_reset(cx)) => {
            // The client cancelled (RST_STREAM): dropping `rx` tells the decider.
            return Err(Status::new(code::UNAVAILABLE, format!("cancelled by the client: {r:?}")));
        }
    };
    let quorum = Quorum::from_core(answer.quorum, answer.created);
    Ok(LighthouseQuorumResponse { quorum: Some(quorum) }.encode_to_vec().into())
}

/// Reads a unary request's body: exactly one uncompressed message of at most `max` bytes.
async fn read_message(mut body: RecvStream, max: usize) -> Result<Bytes, Status> {
    let mut buf = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| Status::new(code::INVALID_ARGUMENT, format!("request body: {e}")))?;
        let _ = body.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
        if buf.len() >= 5 {
            check_prefix(&buf[..5], max)?;
        }
        if buf.len() > max + 5 {
            return Err(Status::new(code::RESOURCE_EXHAUSTED, format!("request larger than {max} bytes")));
        }
    }
    if buf.len() < 5 {
        return Err(Status::new(code::INVALID_ARGUMENT, "no request message"));
    }
    let len = check_prefix(&buf[..5], max)?;
    let mut buf = buf.freeze();
    buf.advance(5);
    if buf.len() != len {
        return Err(Status::new(
            code::INVALID_ARGUMENT,
            format!("request body holds {} bytes after a {len}-byte message's prefix", buf.len()),
        ));
    }
    Ok(buf)
}

/// The message length a gRPC prefix announces, if acceptable.
fn check_prefix(prefix: &[u8], max: usize) -> Result<usize, Status> {
    match prefix[0] {
        0 => {}
        1 => return Err(Status::new(code::UNIMPLEMENTED, "compressed messages are not supported")),
        f => return Err(Status::new(code::INVALID_ARGUMENT, format!("bad message flag {f}"))),
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > max {
        return Err(Status::new(code::RESOURCE_EXHAUSTED, format!("message of {len} bytes, over {max}")));
    }
    Ok(len)
}

/// gRPC's `grpc-timeout`: up to 8 digits and a unit (H, M, S, m, u, n).
pub(crate) fn parse_timeout(v: &[u8]) -> Option<Duration> {
    let (unit, digits) = v.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

fn grpc_response() -> Response<()> {
    let mut r = Response::new(());
    *r.status_mut() = StatusCode::OK;
    r.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    r
}

fn send_message(respond: &mut SendResponse<Bytes>, msg: Bytes) {
    let mut framed = BytesMut::with_capacity(5 + msg.len());
    framed.put_u8(0);
    framed.put_u32(msg.len() as u32);
    framed.extend_from_slice(&msg);
    let sent = respond.send_response(grpc_response(), false).and_then(|mut s| {
        s.send_data(framed.freeze(), false)?;
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from(code::OK));
        s.send_trailers(trailers)
    });
    if let Err(e) = sent {
        debug!("lighthouse: answer not sent: {e}");
    }
}

/// A trailers-only error answer.
fn send_status(respond: &mut SendResponse<Bytes>, s: &Status) {
    debug!("lighthouse: RPC failed with status {}: {}", s.code, s.message);
    let mut r = grpc_response();
    r.headers_mut().insert("grpc-status", HeaderValue::from(s.code));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(&s.message)) {
        r.headers_mut().insert("grpc-message", v);
    }
    if let Err(e) = respond.send_response(r, true) {
        debug!("lighthouse: status not sent: {e}");
    }
}

/// A non-gRPC request: an HTTP status and nothing else.
fn plain(respond: &mut SendResponse<Bytes>, status: StatusCode) {
    let mut r = Response::new(());
    *r.status_mut() = status;
    if let Err(e) = respond.send_response(r, true) {
        debug!("lighthouse: answer not sent: {e}");
    }
}

/// `grpc-message`'s encoding: bytes outside printable ASCII, and `%`, as `%XX`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts() {
        assert_eq!(parse_timeout(b"100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_timeout(b"5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_timeout(b"2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_timeout(b"99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(parse_timeout(b"123456789S"), None);
        assert_eq!(parse_timeout(b"S"), None);
        assert_eq!(parse_timeout(b"10x"), None);
        assert_eq!(parse_timeout(b""), None);
        assert_eq!(parse_timeout(b"-1S"), None);
    }

    #[test]
    fn prefixes() {
        assert_eq!(check_prefix(&[0, 0, 0, 0, 3], 10).ok(), Some(3));
        assert_eq!(check_prefix(&[1, 0, 0, 0, 3], 10).err().map(|s| s.code), Some(code::UNIMPLEMENTED));
        assert_eq!(check_prefix(&[0, 0, 0, 0, 11], 10).err().map(|s| s.code), Some(code::RESOURCE_EXHAUSTED));
        assert_eq!(check_prefix(&[7, 0, 0, 0, 1], 10).err().map(|s| s.code), Some(code::INVALID_ARGUMENT));
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("no quorum: 100%\n"), "no quorum: 100%25%0A");
        assert_eq!(percent_encode("é"), "%C3%A9");
    }
}
