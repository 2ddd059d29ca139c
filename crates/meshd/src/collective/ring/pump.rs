//! The ring operation itself: lanes opened and accepted, a reader and a writer task per
//! lane, and the loop that follows `RingState`'s schedule over the buffer.

use super::*;

impl RingNet {
    pub(super) async fn run_ring<M: RingMemory>(
        &mut self,
        op_id: u64,
        buf: &mut M,
        dtype: DType,
        op: ReduceOp,
        divisor: usize,
    ) -> Result<(), CollectiveError> {
        let n = self.addrs.len();
        if buf.len() % dtype.size() != 0 {
            return Err(CollectiveError::Misaligned { len: buf.len(), dtype });
        }
        if n <= 1 {
            return Ok(());
        }
        if is_direct(n, buf.len()) {
            return self.run_direct(op_id, buf, Reduction { dtype, op, divisor }).await;
        }
        let plan =
            RingPlan::new(n, self.rank, buf.len() / dtype.size(), dtype.size(), self.chunk_bytes.get())?;
        let max_chunk = plan.chunk_bytes().max(dtype.size());
        let mut state = RingState::new(plan);
        let next = self.addrs[(self.rank + 1) % n];
        let prev = self.addrs[(self.rank + n - 1) % n];
        // More lanes than chunks per segment would carry nothing.
        let mut lanes = self.lanes.get().min(MAX_LANES).min(state.plan().chunk_count(0).max(1));
        // Chunks larger than the plane carries go over QUIC streams.
        let plane_out =
            if max_chunk <= crate::transport::plane::MAX_CHUNK { self.plane_to(next).await } else { None };
        let sends = match &plane_out {
            Some(plane) => {
                // The plane's own lanes (each a driver task), those both ends run.
                lanes = plane.ready_lanes(next).min(state.plan().chunk_count(0)).max(1);
                self.announce_plane(next, op_id).await?;
                Vec::new()
            }
            None => self.open_lanes(next, op_id, lanes).await?,
        };
        let recvs = self.accept_lanes(prev, op_id).await?;
        let plane_in = match (recvs.is_empty(), self.transport.plane()) {
            (false, _) => None,
            (true, Some(p)) => Some(p.clone()),
            (true, None) => {
                return Err(CollectiveError::Link {
                    peer: prev,
                    reason: "it sends by the data plane, which this node turned off (MESHD_PLANE=0)".into(),
                });
            }
        };
        {
            let mut served = self.served.lock().unwrap_or_else(|p| p.into_inner());
            if plane_out.is_some() {
                served.datagrams += 1;
            } else {
                served.streams += 1;
            }
        }

        let progress = Arc::new(Progress::default());
        let mut wtxs = Vec::with_capacity(lanes);
        let mut writers = Vec::with_capacity(lanes);
        for send in sends {
            let (wtx, wrx) = mpsc::channel::<(u64, Bytes)>(64);
            wtxs.push(wtx);
            writers.push(tokio::spawn(write_frames(send, wrx, next, progress.clone())));
        }
        let (rtx, mut rrx) = mpsc::channel::<Result<(u64, Chunk), CollectiveError>>(64);
        if let Some(plane) = plane_out {
            let credit = crate::collective::plane_ring::SendCredit::new(&plane, next, op_id);
            for lane in 0..lanes {
                let (wtx, wrx) = mpsc::channel::<(u64, Bytes)>(64);
                wtxs.push(wtx);
                writers.push(tokio::spawn(crate::collective::plane_ring::write_chunks(
                    credit.clone(),
                    lane,
                    wrx,
                    progress.clone(),
                    rtx.downgrade(),
                )));
            }
        }
        let mut readers: Vec<_> = recvs
            .into_iter()
            .map(|recv| tokio::spawn(read_frames(recv, rtx.clone(), prev, max_chunk, progress.clone())))
            .collect();
        let mut credit_in =
            plane_in.clone().map(|p| crate::collective::plane_ring::RecvCredit::new(p, prev, op_id));
        // The plane's driver reduces the reduce-scatter's chunks into the buffer as their
        // datagrams open, where the memory allows it (MESHD_PLANE_DIRECT=0: never).
        let sink = plane_in
            .as_ref()
            .filter(|_| crate::collective::plane_ring::direct_enabled())
            .and_then(|_| buf.shared_writer())
            .map(|w| crate::collective::plane_ring::RingSink::new(state.clone(), w, dtype, op));
        if let Some(plane) = plane_in {
            readers.push(tokio::spawn(crate::collective::plane_ring::read_chunks(
                plane,
                prev,
                op_id,
                rtx.clone(),
                max_chunk,
                progress.clone(),
                sink.clone(),
            )));
        }
        drop(rtx); // the channel closes when every reader has ended
        // The bytes received chunks go on as, made while applying them, by range start.
        let mut forwards: HashMap<usize, (std::ops::Range<usize>, Bytes)> = HashMap::new();
        // A chunk its lane's queue had no room for: (lane, transfer id, bytes).
        let mut pending: Option<(usize, u64, Bytes)> = None;
        // Received chunks whose range is still lent to the transport (being sent, or not
        // yet acknowledged), in arrival order: applied once the loan ends.
        let mut deferred: VecDeque<(u64, Chunk)> = VecDeque::new();
        let mut waited = 0usize;
        let released = buf.released();
        let how = Reduction { dtype, op, divisor };
        let writer_stopped = || CollectiveError::Link { peer: next, reason: "writer stopped".into() };
        // Applies a received chunk; with a direct sink, the range is the ring's meanwhile.
        let apply = |state: &mut RingState,
                     buf: &mut M,
                     forwards: &mut HashMap<usize, (std::ops::Range<usize>, Bytes)>,
                     id: u64,
                     chunk: &Chunk,
                     start: usize|
         -> Result<(), CollectiveError> {
            if let Some(s) = &sink {
                s.enter(start, matches!(chunk, Chunk::Applied { .. }))?;
            }
            let r = apply_received(state, buf, forwards, id, chunk, how);
            if let Some(s) = &sink {
                s.leave(start);
            }
            r
        };
        let started = Instant::now();
        let mut watch = Watch::new(self.progress_timeout, progress.total(), started);
        let mut check_at = tokio::time::Instant::now() + watch.every();
        let result = async {
            loop {
                // Hand every sendable chunk to its lane's writer while the queues take them.
                loop {
                    let (lane, id, bytes) = match pending.take() {
                        Some(p) => p,
                        None => match state.poll_send() {
                            // One contiguous buffer per chunk (forwarding quinn's received
                            // pieces, about a packet each, measured slower: docs/PERFORMANCE.md):
                            // what a received chunk became, or a node's own step-0 chunk.
                            Some(t) => {
                                let bytes = match forwards.remove(&t.range.start) {
                                    Some((range, bytes)) if range == t.range => bytes,
                                    _ => buf.send(t.range.clone()),
                                };
                                (t.chunk_index % lanes, t.id(), bytes)
                            }
                            None => break,
                        },
                    };
                    match wtxs[lane].try_send((id, bytes)) {
                        Ok(()) => {}
                        Err(mpsc::error::TrySendError::Full((id, bytes))) => {
                            pending = Some((lane, id, bytes));
                            break;
                        }
                        Err(mpsc::error::TrySendError::Closed(_)) => return Err(writer_stopped()),
                    }
                }
                if state.is_done() && pending.is_none() {
                    return Ok(());
                }
                // Wait for room on the full lane, for the next chunk from the previous node,
                // or for a loan to end, whichever comes first. Waiting for room alone
                // deadlocks the ring once a segment outgrows the queues and windows of a
                // link (about 144 MiB at 1 MiB chunks): every node would wait to send and
                // none would read. For the same reason a chunk whose range is still lent
                // is set aside rather than waited for: reading goes on.
                let blocked = pending.as_ref().map_or(0, |p| p.0);
                let receiving = state.recvs_left() > deferred.len();
                let waiting = pending.is_some() || receiving || !deferred.is_empty();
                tokio::select! {
                    permit = wtxs[blocked].reserve(), if pending.is_some() => {
                        let permit = permit.map_err(|_| writer_stopped())?;
                        if let Some((_, id, bytes)) = pending.take() {
                            permit.send((id, bytes));
                        }
                    }
                    msg = rrx.recv(), if state.recvs_left() > deferred.len() => {
                        let (id, chunk) = msg.ok_or_else(|| CollectiveError::Link {
                            peer: prev,
                            reason: "stream ended early".into(),
                        })??;
                        if let Some(c) = credit_in.as_mut() {
                            c.took(chunk.len())?;
                        }
                        let range = state.expect(id)?.range;
                        if buf.is_lent(&range) {
                            waited += 1;
                            deferred.push_back((id, chunk));
                        } else {
                            apply(&mut state, buf, &mut forwards, id, &chunk, range.start)?;
                        }
                    }
                    _ = released.notified(), if !deferred.is_empty() => {
                        for _ in 0..deferred.len() {
                            let Some((id, chunk)) = deferred.pop_front() else { break };
                            let range = state.expect(id)?.range;
                            if buf.is_lent(&range) {
                                deferred.push_back((id, chunk));
                            } else {
                                apply(&mut state, buf, &mut forwards, id, &chunk, range.start)?;
                            }
                        }
                    }
                    // Silence from the previous node (or, with only sends left, the next
                    // node taking nothing) for the progress timeout ends the operation.
                    _ = tokio::time::sleep_until(check_at), if waiting => {
                        check_at += watch.every();
                        let now = Instant::now();
                        // Until its first byte the previous node may still wait for its own
                        // previous node to join (a late rank's local work): a join wait.
                        if receiving && progress.received.load(Ordering::Relaxed) == 0 {
                            if now.saturating_duration_since(started) >= self.join_timeout {
                                return Err(CollectiveError::Timeout { peer: prev, op: op_id, timeout: self.join_timeout });
                            }
                            watch = Watch::new(self.progress_timeout, progress.total(), now);
                        } else if watch.stalled(progress.total(), now) {
                            return Err(if receiving {
                                self.stalled(prev, op_id, false)
                            } else {
                                self.stalled(next, op_id, true)
                            });
                        }
                    }
                    else => {
                        return Err(CollectiveError::Link { peer: prev, reason: "ring stalled: nothing to send or receive".into() });
                    }
                }
            }
        }
        .await;
        // From here on no driver writes the buffer: the caller has it back.
        if let Some(sink) = &sink {
            sink.close();
        }
        drop(wtxs);
        let mut w = Ok(());
        if matches!(result, Err(CollectiveError::Stalled { sending: true, .. })) {
            // The next node takes nothing: its writers would only wait out another timeout.
            // After other failures they send what they hold (the next node then reads why,
            // say a ring frame where it expected a direct contribution), watched as below.
            for writer in &writers {
                writer.abort();
            }
        }
        let sent = || progress.sent.load(Ordering::Relaxed);
        for mut writer in writers {
            if w.is_err() {
                writer.abort();
                continue;
            }
            w = match watched(&mut writer, sent, self.progress_timeout).await {
                Some(Ok(r)) => r,
                Some(Err(e)) if e.is_cancelled() => Ok(()),
                Some(Err(e)) => Err(CollectiveError::Link { peer: next, reason: e.to_string() }),
                None => {
                    writer.abort();
                    Err(self.stalled(next, op_id, true))
                }
            };
        }
        for reader in readers {
            reader.abort();
        }
        if waited > 0 {
            tracing::debug!(
                "ring operation {op_id}: {} waited for their range to come back from QUIC",
                crate::plural(waited as u64, "received chunk")
            );
        }
        result?;
        w
    }
}
