//! The per-peer sender: control frames queued per peer, sent in order on streams or as
//! datagrams, retried until the horizon.

use super::*;

/// "198.19.0.7:29400 (node 0a1b2c3d4e5f)", or the address alone when not connected.
pub(super) fn peer_name(inner: &Inner, to: SocketAddr) -> String {
    match lock(&inner.conns).get(&to) {
        Some((_, node)) => format!("{to} (node {node})"),
        None => to.to_string(),
    }
}

/// Sends what `q` holds for `to`: datagrams first (they never wait), then reliable frames
/// in order, each on its own stream. A failed connect or send keeps the frame and tries
/// again after a backoff; frames older than the horizon are given up on and reported.
pub(super) async fn peer_sender(inner: Arc<Inner>, to: SocketAddr, q: Arc<PeerQueue>) {
    let horizon = inner.cfg.reliable_horizon;
    let mut backoff = outbox::Backoff::default();
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut last_error = String::from("not tried yet");
    // Frames given up on but not logged yet, and when that was last logged.
    let mut unreported = 0u64;
    let mut reported: Option<Instant> = None;
    loop {
        if inner.closing.load(Ordering::Relaxed) || q.gone.load(Ordering::Relaxed) {
            let n = lock(&q.outbox).clear();
            if n > 0 {
                inner.undelivered.fetch_add(n as u64, Ordering::Relaxed);
                debug!(peer = %to, "transport stopping with {} unsent", crate::plural(n as u64, "reliable frame"));
            }
            return;
        }
        // Wait for something to send, or for the end of a backoff or the next expiry,
        // whichever is first (a wake-up meanwhile may be a stop: it is looked at above).
        let (empty, expiry) = {
            let o = lock(&q.outbox);
            (o.is_empty(), o.next_expiry(horizon))
        };
        match retry_at.filter(|r| *r > tokio::time::Instant::now()) {
            Some(r) => {
                let until = expiry.map_or(r, |e| r.min(e.into()));
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => {}
                    _ = q.wake.notified() => {}
                }
            }
            None if empty => q.wake.notified().await,
            None => {}
        }
        let expired = lock(&q.outbox).expire(Instant::now(), horizon);
        if expired > 0 {
            inner.undelivered.fetch_add(expired as u64, Ordering::Relaxed);
            unreported += expired as u64;
        }
        if unreported > 0 && reported.is_none_or(|t| t.elapsed() >= horizon) {
            warn!(
                "peer {}: gave up on {} after {horizon:?} ({last_error}); undelivered so far: {}",
                peer_name(&inner, to),
                crate::plural(unreported, "reliable frame"),
                inner.undelivered.load(Ordering::Relaxed)
            );
            unreported = 0;
            reported = Some(Instant::now());
        }
        if retry_at.is_some_and(|r| r > tokio::time::Instant::now())
            || lock(&q.outbox).is_empty()
            || inner.closing.load(Ordering::Relaxed)
            || q.gone.load(Ordering::Relaxed)
        {
            continue;
        }
        retry_at = None;
        // A peer that just started may have connected to us while our own attempt to reach
        // it was failing: its connection carries the frames.
        let conn = match existing(&inner, to) {
            Some(c) => c,
            None => match connect(&inner, to, 0).await {
                Ok((c, _, _)) => c,
                Err(e) => match existing(&inner, to) {
                    Some(c) => c,
                    None => {
                        last_error = e.to_string();
                        let mut o = lock(&q.outbox);
                        // Datagrams would be stale by the next attempt.
                        o.drop_datagrams();
                        if matches!(e, TransportError::Auth { .. }) {
                            // A refusal is final (another token, run or version) and was
                            // logged once already: frames for it can never be delivered.
                            let n = o.clear();
                            inner.undelivered.fetch_add(n as u64, Ordering::Relaxed);
                            debug!(peer = %to, error = %e, "refused: {} dropped", crate::plural(n as u64, "reliable frame"));
                        } else {
                            debug!(peer = %to, error = %e, "connect failed; frames kept");
                        }
                        drop(o);
                        retry_at = Some(tokio::time::Instant::now() + backoff.failed());
                        continue;
                    }
                },
            },
        };
        // Datagrams first, and again after every reliable frame: a probe must not wait
        // behind a burst of reliable frames.
        let mut failed = None;
        loop {
            let datagrams = lock(&q.outbox).take_datagrams();
            for d in datagrams {
                let res = if d.len() <= conn.max_datagram_size().unwrap_or(0) {
                    conn.send_datagram(d).map_err(|e| e.to_string())
                } else {
                    send_stream(&conn, &d, inner.cfg.send_timeout).await
                };
                if let Err(e) = res {
                    debug!(peer = %to, error = %e, "datagram not sent");
                }
            }
            let Some(frame) = lock(&q.outbox).front() else { break };
            match send_stream(&conn, &frame, inner.cfg.send_timeout).await {
                Ok(()) => {
                    lock(&q.outbox).sent();
                    backoff.reset();
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            if inner.closing.load(Ordering::Relaxed) || q.gone.load(Ordering::Relaxed) {
                break;
            }
        }
        if let Some(e) = failed {
            debug!(peer = %to, error = %e, "send failed; frame kept");
            last_error = e;
            retry_at = Some(tokio::time::Instant::now() + backoff.failed());
        }
    }
}

/// Sends one length-prefixed frame on a stream of its own, within `timeout` (opening the
/// stream waits while the peer holds its limit of unread streams; writing, while its window
/// is full). A stream not written whole is reset, so the peer never reads half a frame.
pub(super) async fn send_stream(
    conn: &quinn::Connection,
    body: &[u8],
    timeout: Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut s = tokio::time::timeout_at(deadline, conn.open_uni())
        .await
        .map_err(|_| format!("no stream granted within {timeout:?}"))?
        .map_err(|e| e.to_string())?;
    match tokio::time::timeout_at(deadline, s.write_all(&wire::frame_with_len(body))).await {
        Ok(Ok(())) => s.finish().map_err(|e| e.to_string()),
        Ok(Err(e)) => {
            let _ = s.reset(code::PROTOCOL.into());
            Err(e.to_string())
        }
        Err(_) => {
            let _ = s.reset(code::PROTOCOL.into());
            Err(format!("frame of {} bytes not taken within {timeout:?}", body.len()))
        }
    }
}
