//! The authentication handshake on a new connection: the hellos, the PAKE's key
//! confirmation, the refusals and their wording, both halves (connecting and accepting).

use super::*;

pub(super) fn my_hello(
    inner: &Inner,
    observed: Option<SocketAddr>,
    lane: u8,
    pake: &[u8],
    mac: [u8; 32],
) -> AuthHello {
    let pake = wire::PakeMessage::from_bytes(pake);
    let cfg = &inner.cfg;
    AuthHello {
        version: PROTOCOL_VERSION,
        node: cfg.node,
        run_hash: cfg.run_hash,
        mac,
        has_token: cfg.token.is_some(),
        observed,
        lane,
        pake,
    }
}

pub(super) fn exporter(conn: &quinn::Connection) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    conn.export_keying_material(&mut out, auth::EXPORTER_LABEL, b"").ok()?;
    Some(out)
}

/// Checks the peer's hello before the key confirmation; `Err((code, refusal))` says why it
/// is refused.
pub(super) fn check_hello(cfg: &TransportConfig, h: &AuthHello) -> Result<(), (u32, Refusal)> {
    if h.version != PROTOCOL_VERSION {
        return Err((code::VERSION, Refusal::Version(PROTOCOL_VERSION)));
    }
    match (&cfg.token, h.has_token) {
        (None, false) => {}
        (None, true) => return Err((code::AUTH, Refusal::UnexpectedToken)),
        (Some(_), false) => return Err((code::AUTH, Refusal::NoToken)),
        (Some(_), true) if h.pake.is_none() => {
            return Err((code::PROTOCOL, Refusal::Other("bad hello: malformed key exchange".into())));
        }
        (Some(_), true) => {}
    }
    // Run hash 0 is a probe (`meshd ifaces --peers`): it proves the token, joins no run.
    if h.run_hash != cfg.run_hash && h.run_hash != 0 && cfg.run_hash != 0 {
        return Err((code::OTHER_RUN, Refusal::OtherRun));
    }
    if h.node == cfg.node {
        return Err((code::PROTOCOL, Refusal::Itself));
    }
    if h.lane as usize >= MAX_LANES || (h.lane > 0 && h.run_hash == 0) {
        return Err((
            code::PROTOCOL,
            Refusal::Other(format!("lane {} is not allowed (a probe has none; at most {MAX_LANES})", h.lane)),
        ));
    }
    Ok(())
}

/// Who refused whom when an authentication failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusedBy {
    /// This node refused the peer.
    ThisNode,
    /// The peer refused this node (its close reason, reworded from this node's side).
    Peer,
}

/// A failed authentication: who refused, and why in this node's words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthFailure {
    /// Who refused.
    pub by: RefusedBy,
    /// Why, written from this node's side.
    pub words: String,
}

impl std::fmt::Display for AuthFailure {
    /// The words, after [`REFUSED_US`] when the peer refused.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.by {
            RefusedBy::Peer => write!(f, "{REFUSED_US}{}", self.words),
            RefusedBy::ThisNode => f.write_str(&self.words),
        }
    }
}

/// How a refusal by the peer starts when an [`AuthFailure`] is written out.
pub const REFUSED_US: &str = "it refused us: ";

/// Why a message of the authentication exchange could not be read.
#[derive(Debug)]
pub(super) enum HelloError {
    /// What came is no hello (malformed, too large, cut short): the peer is told so.
    Malformed(String),
    /// The peer closed the connection with a refusal: its close reason, as sent.
    Refused(String),
    /// The connection or the stream failed: nobody to tell.
    Lost(String),
}

impl std::fmt::Display for HelloError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HelloError::Malformed(w) | HelloError::Lost(w) => f.write_str(w),
            HelloError::Refused(w) => write!(f, "{REFUSED_US}{w}"),
        }
    }
}

/// Closes `conn` with `why`'s close reason and reports it in this node's words; `peer_version`
/// is the version the peer announced (when it sent a hello).
pub(super) fn refuse(
    inner: &Inner,
    conn: &quinn::Connection,
    code: u32,
    why: &Refusal,
    peer_version: u16,
) -> TransportError {
    let addr = canonical(conn.remote_address());
    conn.close(code.into(), why.wire().as_bytes());
    let reason = AuthFailure { by: RefusedBy::ThisNode, words: why.here(peer_version) };
    report_auth_failure(inner, addr, &reason);
    TransportError::Auth { addr, reason }
}

/// The refusal `wire` (a close reason of the peer at `addr`) from this node's side.
pub(super) fn peer_refusal(addr: SocketAddr, wire: &str) -> AuthFailure {
    AuthFailure { by: RefusedBy::Peer, words: Refusal::parse(wire).there(addr.ip(), PROTOCOL_VERSION) }
}

pub(super) fn report_auth_failure(inner: &Inner, addr: SocketAddr, reason: &AuthFailure) {
    // Once per peer IP and reason: a client that retries from new ports logs no more.
    if inner.logged.first(addr, &reason.to_string()) {
        warn!("{}", auth_failure_text(addr, reason));
    }
    let _ = inner.events.try_send(TransportEvent::AuthFailed { addr, reason: reason.clone() });
}

/// "peer X refused this node: failed authentication: ..." or "peer X failed
/// authentication: ...".
pub fn auth_failure_text(addr: SocketAddr, reason: &AuthFailure) -> String {
    match reason.by {
        RefusedBy::Peer => format!("peer {addr} refused this node: failed authentication: {}", reason.words),
        RefusedBy::ThisNode => format!("peer {addr} failed authentication: {}", reason.words),
    }
}

/// The peer's close reason, when the peer refused us.
pub(super) fn refusal(e: &quinn::ConnectionError) -> Option<String> {
    match e {
        quinn::ConnectionError::ApplicationClosed(c) if c.error_code != code::BYE.into() => {
            Some(String::from_utf8_lossy(&c.reason).into_owned())
        }
        _ => None,
    }
}

/// What a lost connection means for the exchange: the peer's refusal, or just lost.
fn lost(c: &quinn::ConnectionError) -> HelloError {
    refusal(c).map_or_else(|| HelloError::Lost(c.to_string()), HelloError::Refused)
}

/// Largest message of the authentication exchange.
pub(super) const MAX_HELLO: usize = 1024;

/// Reads one length-prefixed message (u16, big-endian) of the authentication exchange.
pub(super) async fn read_auth_message(recv: &mut quinn::RecvStream) -> Result<Vec<u8>, HelloError> {
    let failed = |e: quinn::ReadExactError| match e {
        quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(c)) => lost(&c),
        quinn::ReadExactError::FinishedEarly(_) => {
            HelloError::Malformed("bad hello: the stream ended early".to_string())
        }
        other => HelloError::Lost(other.to_string()),
    };
    let mut len = [0u8; 2];
    recv.read_exact(&mut len).await.map_err(failed)?;
    let len = u16::from_be_bytes(len) as usize;
    if len > MAX_HELLO {
        return Err(HelloError::Malformed(format!("hello larger than {MAX_HELLO} bytes")));
    }
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await.map_err(failed)?;
    Ok(body)
}

pub(super) async fn read_hello(recv: &mut quinn::RecvStream) -> Result<AuthHello, HelloError> {
    let body = read_auth_message(recv).await?;
    wire::decode(&body).map_err(|e| HelloError::Malformed(format!("bad hello: {e}")))
}

/// Writes one length-prefixed message of the authentication exchange.
pub(super) async fn write_auth_message(
    send: &mut quinn::SendStream,
    body: &[u8],
) -> Result<(), quinn::WriteError> {
    let mut m = Vec::with_capacity(2 + body.len());
    m.extend_from_slice(&(body.len().min(u16::MAX as usize) as u16).to_be_bytes());
    m.extend_from_slice(body);
    send.write_all(&m).await
}

/// A hello's SPAKE2 message as SPAKE2 reads it (zeros when it has none: only used with one).
pub(super) fn pake_bytes(h: &AuthHello) -> [u8; 33] {
    h.pake.map(|p| p.to_bytes()).unwrap_or([0; 33])
}

/// The transcript both ends' confirmations cover (see [`auth`]); `msgs` are the client's
/// and the server's SPAKE2 messages ([`pake_bytes`]).
pub(super) fn transcript<'a>(
    exporter: &'a [u8; 32],
    client: &'a AuthHello,
    server: &'a AuthHello,
    msgs: &'a ([u8; 33], [u8; 33]),
) -> auth::Transcript<'a> {
    auth::Transcript {
        exporter,
        client: &client.node.0,
        server: &server.node.0,
        client_run: client.run_hash,
        server_run: server.run_hash,
        client_msg: &msgs.0,
        server_msg: &msgs.1,
    }
}

/// Connects and authenticates; lane 0 registers the connection as the peer's, a lane above
/// 0 keeps it for bulk data only.
pub(super) async fn connect(
    inner: &Arc<Inner>,
    to: SocketAddr,
    lane: u8,
) -> Result<(quinn::Connection, NodeId, Option<SocketAddr>), TransportError> {
    let peer_err = |reason: String| TransportError::Peer { addr: to, reason };
    let fut = async {
        let conn = inner
            .endpoint
            .connect(to, "meshd")
            .map_err(|e| peer_err(e.to_string()))?
            .await
            .map_err(|e| peer_err(handshake_failure(&e)))?;
        let _drain = guard::drain_datagrams(&conn);
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| peer_err(e.to_string()))?;
        let pake = inner.cfg.token.as_ref().map(|t| t.start());
        let mine = my_hello(inner, None, lane, pake.as_ref().map_or(&[][..], |p| p.message()), [0; 32]);
        write_auth_message(&mut send, &wire::encode(&mine)).await.map_err(|e| peer_err(e.to_string()))?;
        let refused = |e: HelloError| match e {
            HelloError::Refused(wire) => {
                let reason = peer_refusal(to, &wire);
                report_auth_failure(inner, to, &reason);
                TransportError::Auth { addr: to, reason }
            }
            other => peer_err(other.to_string()),
        };
        let theirs = read_hello(&mut recv).await.map_err(refused)?;
        if let Err((code, why)) = check_hello(&inner.cfg, &theirs) {
            return Err(refuse(inner, &conn, code, &why, theirs.version));
        }
        if theirs.lane != lane {
            let why = Refusal::Other(format!("it answered lane {} for lane {lane}", theirs.lane));
            return Err(refuse(inner, &conn, code::PROTOCOL, &why, theirs.version));
        }
        // The server proves it holds the token first; only then does this node confirm.
        let confirm = match (pake, exporter(&conn)) {
            (Some(p), Some(ex)) => {
                let msgs = (pake_bytes(&mine), pake_bytes(&theirs));
                let t = transcript(&ex, &mine, &theirs, &msgs);
                let key = p.finish(&msgs.1);
                match key.filter(|k| k.verify(Role::Server, &t, &theirs.mac)) {
                    Some(k) => k.confirm(Role::Client, &t),
                    None => {
                        return Err(refuse(
                            inner,
                            &conn,
                            code::AUTH,
                            &Refusal::DifferentToken,
                            theirs.version,
                        ));
                    }
                }
            }
            (Some(_), None) => return Err(peer_err("no TLS keying material".into())),
            (None, _) => [0; 32],
        };
        write_auth_message(&mut send, &confirm).await.map_err(|e| peer_err(e.to_string()))?;
        let _ = send.finish();
        // Accepted when the server ends its stream; a refusal closes the connection.
        match recv.read_to_end(0).await {
            Ok(_) => {}
            Err(quinn::ReadToEndError::Read(quinn::ReadError::ConnectionLost(c))) => {
                return Err(refused(lost(&c)));
            }
            Err(e) => return Err(peer_err(format!("bad end of the authentication: {e}"))),
        }
        Ok((conn, theirs.node, theirs.observed))
    };
    let (conn, node, observed) =
        tokio::time::timeout(inner.cfg.connect_timeout, fut).await.map_err(|_| {
            peer_err(format!(
                "no answer within {:?} (is meshd running there, and UDP {} open?)",
                inner.cfg.connect_timeout,
                to.port()
            ))
        })??;
    // The server proved the token: its streams and data may come now.
    guard::open_up(&conn, lane);
    let _ = inner.authenticated.admit(to, &conn);
    if lane == 0 {
        register(inner, conn.clone(), node, observed);
    } else {
        add_lane(inner, to, lane, &conn, node);
        tokio::spawn(read_bidi_streams(inner.clone(), conn.clone(), node));
        tokio::spawn(read_streams(inner.clone(), conn.clone(), node));
    }
    Ok((conn, node, observed))
}

/// What an authenticated incoming connection is.
pub(super) enum Accepted {
    /// A node's connection to this one.
    Peer,
    /// A probe (`meshd ifaces`, `meshd status`).
    Probe,
    /// An extra connection for bulk data: its lane number.
    Lane(u8),
}

/// Words a failed QUIC handshake. TLS alert 120 (no_application_protocol) means the peer
/// does not speak this ALPN: another meshd protocol version.
pub(super) fn handshake_failure(e: &quinn::ConnectionError) -> String {
    let alpn = |code: quinn::TransportErrorCode| code == quinn::TransportErrorCode::crypto(120);
    match e {
        quinn::ConnectionError::ConnectionClosed(c) if alpn(c.error_code) => format!(
            "QUIC handshake failed: it does not speak {} (another meshd version? run the same meshd on every node)",
            String::from_utf8_lossy(wire::ALPN)
        ),
        _ => format!("QUIC handshake failed: {e}"),
    }
}
