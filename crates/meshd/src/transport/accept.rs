//! Accepting connections and reading what authenticated peers send: the accept loop
//! (Retry, handshake slots), the bounds a connection must pass, queries, and the frames,
//! data streams and tunnel streams of each connection.

use super::*;

pub(super) async fn accept_loop(inner: Arc<Inner>) {
    while let Some(incoming) = inner.endpoint.accept().await {
        let from = canonical(incoming.remote_address());
        // Handshakes pile up (a flood, perhaps from spoofed addresses): a source must
        // first prove it receives our packets (stateless Retry) before it gets a slot.
        if !incoming.remote_address_validated() && inner.gate.should_retry(from.ip()) {
            if let Err(e) = incoming.retry() {
                e.into_incoming().refuse();
            }
            continue;
        }
        // Bounded state for handshakes that never finish: a few per source IP, a cap in
        // total; past it the attempt is refused at once (QUIC CONNECTION_REFUSED).
        let permit = match inner.gate.admit(from.ip()) {
            Ok(p) => p,
            Err(full) => {
                incoming.refuse();
                let why = match full {
                    guard::Full::Ip => {
                        format!("more than {} handshakes in progress from it", guard::MAX_PENDING_PER_IP)
                    }
                    guard::Full::Total => format!("more than {} handshakes in progress", guard::MAX_PENDING),
                };
                if inner.logged.first(from, &why) {
                    warn!("refusing connections from {}: {why}", from.ip());
                }
                continue;
            }
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            let fut = async {
                let conn = incoming.await.ok()?;
                let _drain = guard::drain_datagrams(&conn);
                let (mut send, mut recv) = conn.accept_bi().await.ok()?;
                // Oversized or malformed: say so; a lost connection: nothing to say.
                let malformed = |conn: &quinn::Connection, e: HelloError| {
                    if let HelloError::Malformed(reason) = e {
                        refuse(&inner, conn, code::PROTOCOL, &Refusal::Other(reason), PROTOCOL_VERSION);
                    }
                };
                let theirs = match read_hello(&mut recv).await {
                    Ok(h) => h,
                    Err(reason) => {
                        malformed(&conn, reason);
                        return None;
                    }
                };
                if let Err((code, why)) = check_hello(&inner.cfg, &theirs) {
                    refuse(&inner, &conn, code, &why, theirs.version);
                    return None;
                }
                let observed = Some(canonical(conn.remote_address()));
                let pake = inner.cfg.token.as_ref().map(|t| t.start());
                let mut mine = my_hello(
                    &inner,
                    observed,
                    theirs.lane,
                    pake.as_ref().map_or(&[][..], |p| p.message()),
                    [0; 32],
                );
                let ex = exporter(&conn)?;
                let key = match pake {
                    Some(p) => match p.finish(&pake_bytes(&theirs)) {
                        Some(k) => Some(k),
                        None => {
                            malformed(
                                &conn,
                                HelloError::Malformed("bad hello: malformed key exchange".into()),
                            );
                            return None;
                        }
                    },
                    None => None,
                };
                if let Some(k) = &key {
                    let msgs = (pake_bytes(&theirs), pake_bytes(&mine));
                    mine.mac = k.confirm(Role::Server, &transcript(&ex, &theirs, &mine, &msgs));
                }
                write_auth_message(&mut send, &wire::encode(&mine)).await.ok()?;
                let confirm = match read_auth_message(&mut recv).await {
                    Ok(c) => c,
                    // The client found this node's confirmation wrong and closed: it says
                    // why in its close reason.
                    Err(HelloError::Refused(wire)) => {
                        let from = canonical(conn.remote_address());
                        report_auth_failure(&inner, from, &peer_refusal(from, &wire));
                        return None;
                    }
                    Err(e) => {
                        malformed(&conn, e);
                        return None;
                    }
                };
                if let Some(k) = &key {
                    let msgs = (pake_bytes(&theirs), pake_bytes(&mine));
                    if !k.verify(Role::Client, &transcript(&ex, &theirs, &mine, &msgs), &confirm) {
                        refuse(&inner, &conn, code::AUTH, &Refusal::DifferentToken, theirs.version);
                        return None;
                    }
                }
                // Accepted: the end of this stream says so.
                send.finish().ok()?;
                let kind = if theirs.lane > 0 {
                    Accepted::Lane(theirs.lane)
                } else if theirs.run_hash == 0 && inner.cfg.run_hash != 0 {
                    Accepted::Probe
                } else {
                    Accepted::Peer
                };
                Some((conn, theirs.node, kind))
            };
            // Half-open or silent handshakes are dropped after the connect timeout.
            let done = tokio::time::timeout(inner.cfg.connect_timeout, fut).await;
            drop(permit);
            let done = match done {
                Ok(Some((conn, node, kind))) => admit(&inner, conn, node, kind),
                _ => None,
            };
            if let Some((conn, _, kind)) = &done {
                // The client proved the token: its streams and data may come now.
                guard::open_up(conn, if let Accepted::Lane(l) = kind { *l } else { 0 });
            }
            match done {
                // A probe gets its answer and nothing else: no frame of it is read.
                Some((conn, _, Accepted::Probe)) => serve_queries(&inner, conn).await,
                Some((conn, node, Accepted::Peer)) => register(&inner, conn, node, None),
                // A lane carries the peer's bulk data and tunnel streams only: it is not the
                // peer's connection for gossip and raises no PeerUp.
                // Kept so that this node may send on it too (either end may open streams).
                Some((conn, node, Accepted::Lane(lane))) => {
                    let from = canonical(conn.remote_address());
                    add_lane(&inner, from, lane, &conn, node);
                    tokio::spawn(read_bidi_streams(inner.clone(), conn.clone(), node));
                    read_streams(inner, conn, node).await
                }
                None => {}
            }
        });
    }
}

/// The bounds an authenticated incoming connection must pass before it is used: a data
/// connection only beside a live main connection of the same node from the same address
/// (a lane raises no PeerUp, so a second "node X" must not slip in through one), and no
/// more connections per peer than [`guard::MAX_CONNS_PER_ADDR`] / [`guard::MAX_CONNS_PER_IP`].
pub(super) fn admit(
    inner: &Inner,
    conn: quinn::Connection,
    node: NodeId,
    kind: Accepted,
) -> Option<(quinn::Connection, NodeId, Accepted)> {
    let from = canonical(conn.remote_address());
    if let Accepted::Lane(lane) = kind {
        let main = lock(&inner.conns).get(&from).filter(|(c, _)| c.close_reason().is_none()).map(|(_, n)| *n);
        if main != Some(node) {
            let why = Refusal::Other(format!(
                "data connection {lane} without a live main connection of the same node from {from}"
            ));
            refuse(inner, &conn, code::PROTOCOL, &why, PROTOCOL_VERSION);
            return None;
        }
    }
    if let Err(e) = inner.authenticated.admit(from, &conn) {
        let why = match e {
            guard::TooMany::Addr => {
                format!("more than {} connections from {from}", guard::MAX_CONNS_PER_ADDR)
            }
            guard::TooMany::Ip => {
                format!("more than {} connections from {}", guard::MAX_CONNS_PER_IP, from.ip())
            }
        };
        refuse(inner, &conn, code::PROTOCOL, &Refusal::Other(why), PROTOCOL_VERSION);
        return None;
    }
    Some((conn, node, kind))
}

/// Answers a probe connection's queries (a few at most) until it closes or idles.
pub(super) async fn serve_queries(inner: &Inner, conn: quinn::Connection) {
    for _ in 0..16 {
        let Ok(Ok((mut send, mut recv))) =
            tokio::time::timeout(inner.cfg.connect_timeout, conn.accept_bi()).await
        else {
            return;
        };
        let Ok(Ok(body)) = tokio::time::timeout(inner.cfg.connect_timeout, recv.read_to_end(64)).await else {
            return;
        };
        match wire::decode::<Query>(&body) {
            Ok(Query::Status) => {
                let reply = lock(&inner.status).clone();
                let _ = send.write_all(&reply).await;
                let _ = send.finish();
            }
            Ok(Query::Tunnel) => {
                let reply = lock(&inner.tunnel_stats).as_ref().map(|counters| counters());
                let _ = send.write_all(&wire::encode(&reply)).await;
                let _ = send.finish();
            }
            Err(_) => {
                conn.close(code::PROTOCOL.into(), b"bad query");
                return;
            }
        }
    }
}

pub(super) fn register(
    inner: &Arc<Inner>,
    conn: quinn::Connection,
    node: NodeId,
    observed: Option<SocketAddr>,
) {
    let addr = canonical(conn.remote_address());
    lock(&inner.conns).insert(addr, (conn.clone(), node));
    // Another node at the address (the peer restarted): its data connections belong to the
    // old process and lead nowhere; they are opened again when next needed. The same node
    // connecting again (both ends dialled at once, or the old connection failed) keeps
    // them: they may carry an operation or tunnelled connections now.
    lock(&inner.lanes).retain(|(a, _), (lane, n)| {
        let keep = *a != addr || *n == node;
        if !keep {
            lane.close(code::BYE.into(), b"peer restarted");
        }
        keep
    });
    // Authenticated: the plane link's keys may come from this connection now.
    if let Some(plane) = &inner.plane {
        plane.add_link(conn.clone(), conn.side().is_client());
    }
    let _ = inner.events.try_send(TransportEvent::PeerUp { addr, node, observed });
    tokio::spawn(read_datagrams(inner.clone(), conn.clone(), node));
    tokio::spawn(read_bidi_streams(inner.clone(), conn.clone(), node));
    tokio::spawn(read_streams(inner.clone(), conn, node));
}

/// Accepts the bidirectional streams an authenticated peer opens after the hello (on its
/// main connection or a data connection): tunnel streams (tag, request) go to
/// [`Transport::take_tunnel_streams`]; anything else, or a request that does not arrive
/// within the connect timeout, is reset.
pub(super) async fn read_bidi_streams(inner: Arc<Inner>, conn: quinn::Connection, node: NodeId) {
    let from = canonical(conn.remote_address());
    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
        let inner = inner.clone();
        tokio::spawn(async move {
            let mut head = [0u8; 1 + TUNNEL_REQUEST_LEN];
            let read = tokio::time::timeout(inner.cfg.connect_timeout, recv.read_exact(&mut head)).await;
            if !matches!(read, Ok(Ok(()))) || head[0] != TUNNEL_TAG {
                let _ = send.reset(code::PROTOCOL.into());
                let _ = recv.stop(code::PROTOCOL.into());
                return;
            }
            let mut request = [0u8; TUNNEL_REQUEST_LEN];
            request.copy_from_slice(&head[1..]);
            if let Err(e) = inner.tunnel_tx.try_send(TunnelStream { from, node, request, send, recv }) {
                let mut t = e.into_inner();
                debug!(peer = %from, "tunnel stream refused: no tunnel service, or its queue is full");
                let _ = t.send.reset(code::PROTOCOL.into());
                let _ = t.recv.stop(code::PROTOCOL.into());
            }
        });
    }
}

pub(super) async fn deliver(inner: &Inner, from: SocketAddr, node: NodeId, body: &[u8]) {
    match wire::decode::<Frame>(body) {
        Ok(frame) => {
            let _ = inner.events.send(TransportEvent::Frame { from, node, frame }).await;
        }
        Err(e) => debug!(peer = %from, error = %e, "dropping undecodable frame"),
    }
}

pub(super) async fn read_datagrams(inner: Arc<Inner>, conn: quinn::Connection, node: NodeId) {
    let from = canonical(conn.remote_address());
    while let Ok(d) = conn.read_datagram().await {
        deliver(&inner, from, node, &d).await;
    }
}

pub(super) async fn read_streams(inner: Arc<Inner>, conn: quinn::Connection, node: NodeId) {
    let from = canonical(conn.remote_address());
    loop {
        let mut recv = match conn.accept_uni().await {
            Ok(r) => r,
            Err(_) => break,
        };
        let inner = inner.clone();
        let conn = conn.clone();
        tokio::spawn(async move {
            let mut first = [0u8; 1];
            if recv.read_exact(&mut first).await.is_err() {
                return;
            }
            if first[0] == DATA_TAG {
                let mut op = [0u8; 8];
                if recv.read_exact(&mut op).await.is_ok() {
                    let ds = DataStream { from, node, op: u64::from_be_bytes(op), recv };
                    let _ = inner.data_tx.send(ds).await;
                }
                return;
            }
            let res = guard::read_frames(&mut recv, first[0], |body| {
                let inner = inner.clone();
                async move { deliver(&inner, from, node, &body).await }
            })
            .await;
            if let Err(guard::ReadError::Protocol(e)) = res {
                // A length over the limit is refused before its body is read.
                let reason = format!("broke the framing: {e}");
                conn.close(code::PROTOCOL.into(), reason.as_bytes());
                if inner.logged.first(from, &reason) {
                    warn!("peer {from} {reason}; connection closed");
                }
            }
        });
    }
    // Forget the connection if it is still the registered one.
    let mut conns = lock(&inner.conns);
    if conns.get(&from).is_some_and(|(c, _)| c.stable_id() == conn.stable_id()) {
        conns.remove(&from);
    }
    drop(conns);
    lock(&inner.data_links).retain(|(_, _, c)| c.stable_id() != conn.stable_id());
}

/// Keeps an authenticated data connection: as the one to send on for `(addr, lane)`, and
/// among the peer's links whose traffic counts as proof of life.
pub(super) fn add_lane(inner: &Inner, addr: SocketAddr, lane: u8, conn: &quinn::Connection, node: NodeId) {
    lock(&inner.lanes).insert((addr, lane), (conn.clone(), node));
    lock(&inner.data_links).push((addr, node, conn.clone()));
}
