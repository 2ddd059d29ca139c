//! The node's collectives in order: the k-th request of every local rank forms operation
//! k; the local parts are reduced, the ring runs once per node, results go back.

use super::*;

use super::local::{gather_local, write_back};
use super::part::{Data, Part};

pub(super) fn describe(k: &Kind, len: usize) -> String {
    match k {
        Kind::AllReduce(d, o) => format!("allreduce {} {} of {len} bytes", d.name(), o.name()),
        Kind::Broadcast(r) => format!("broadcast from {r} of {len} bytes"),
        Kind::Barrier => "barrier".into(),
    }
}

pub(super) async fn collectives(cfg: ServiceConfig, mut ring: RingNet, mut rx: mpsc::Receiver<CollReq>) {
    let n = cfg.local_world as usize;
    let mut slots: BTreeMap<u64, Vec<Option<Part>>> = BTreeMap::new();
    let mut next = 1u64;
    let mut work = Work::default();
    while let Some(req) = rx.recv().await {
        if req.seq < next || req.local as usize >= n || slots.len() > 4096 {
            let _ = req.part.reply.send(Err("collective out of order".into()));
            continue;
        }
        let slot = slots.entry(req.seq).or_insert_with(|| (0..n).map(|_| None).collect());
        slot[req.local as usize] = Some(req.part);
        while slots.get(&next).is_some_and(|s| s.iter().all(Option::is_some)) {
            let Some(parts) = slots.remove(&next) else { break };
            let parts: Vec<Part> = parts.into_iter().flatten().collect();
            let op_id = ((cfg.restart as u64) << 40) | next;
            run_one(&cfg, &mut ring, op_id, parts, &mut work).await;
            next += 1;
        }
    }
}

/// The node's memory for collectives, reused from one to the next (a training job reduces
/// the same buckets again and again: a fresh buffer each time costs a page fault per
/// 4 KiB). Two buffers, because the ring lends its chunks to QUIC and the last of them may
/// still be unacknowledged when the next collective starts; that one then takes the other.
#[derive(Debug, Default)]
pub(super) struct Work {
    bufs: [CollectiveBuffer; 2],
    last: usize,
}

impl Work {
    /// A buffer of `len` bytes with nothing lent out (its contents are stale).
    fn next(&mut self, len: usize) -> &mut CollectiveBuffer {
        let i = if self.bufs[self.last].loans() == 0 { self.last } else { 1 - self.last };
        self.last = i;
        self.bufs[i].reset(len);
        &mut self.bufs[i]
    }

    /// The buffer the last collective ran in.
    fn last(&self) -> &[u8] {
        self.bufs[self.last].as_slice()
    }
}

pub(super) async fn run_one(
    cfg: &ServiceConfig,
    ring: &mut RingNet,
    op_id: u64,
    parts: Vec<Part>,
    work: &mut Work,
) {
    let kind = parts[0].kind.clone();
    let len = parts[0].data.len();
    if let Some(gone) = parts.iter().find(|p| p.gave_up.is_set()) {
        let msg = format!(
            "collective #{} ({}) cannot complete on this node: rank {} gave up on it before every local \
             rank had called it (its call timed out or its connection closed)",
            op_id & ((1 << 40) - 1),
            describe(&kind, len),
            gone.global
        );
        tracing::warn!("{msg}");
        for p in parts {
            let _ = p.reply.send(Err(msg.clone()));
        }
        return;
    }
    if let Some(bad) = parts.iter().find(|p| p.kind != kind || p.data.len() != len) {
        let msg = format!(
            "local ranks disagree on collective #{}: rank {} calls {}, rank {} calls {}",
            op_id & ((1 << 40) - 1),
            parts[0].global,
            describe(&kind, len),
            bad.global,
            describe(&bad.kind, bad.data.len())
        );
        for p in parts {
            let _ = p.reply.send(Err(msg.clone()));
        }
        return;
    }
    let started = std::time::Instant::now();
    let result = reduce_parts(ring, op_id, &kind, &parts, work, cfg.world).await;
    let reduced = started.elapsed();
    if let Err(e) = &result {
        // The ranks raise it too; here it is on the node's log, where the job's end is read.
        tracing::warn!("collective #{} ({}) failed: {e}", op_id & ((1 << 40) - 1), describe(&kind, len));
    }
    let work = work.last();
    let written = match &result {
        Ok(out) => write_back(&parts, &work[..*out]),
        Err(_) => vec![Ok(()); parts.len()],
    };
    debug!(
        "collective #{}: {}: gathered, reduced and ring in {:?}, written back in {:?}",
        op_id & ((1 << 40) - 1),
        describe(&kind, len),
        reduced,
        started.elapsed() - reduced
    );
    for (p, w) in parts.into_iter().zip(written) {
        let reply = match (&result, p.data, w) {
            (Err(e), _, _) => Err(e.clone()),
            // The rank's own request buffer carries the reply (no fresh allocation).
            (Ok(out), Data::Sent(mut v), _) => {
                v.clear();
                v.extend_from_slice(&work[..*out]);
                Ok(v)
            }
            (Ok(_), Data::InPlace(_), w) => w.map(|()| Vec::new()),
        };
        let _ = p.reply.send(reply);
    }
}

/// Reduces the local parts into the next of `work`'s buffers, runs the ring there, and
/// returns the result's length (the result is `work.last()[..len]`).
pub(super) async fn reduce_parts(
    ring: &mut RingNet,
    op_id: u64,
    kind: &Kind,
    parts: &[Part],
    work: &mut Work,
    ranks: u32,
) -> Result<usize, String> {
    let len = parts[0].data.len();
    let (dtype, op, acc, out) = match kind {
        Kind::AllReduce(d, o) => {
            let acc = work.next(len);
            let ring_op = if *o == ReduceOp::Avg { ReduceOp::Sum } else { *o };
            let t = std::time::Instant::now();
            gather_local(parts, acc.try_as_mut().unwrap_or_default(), *d, ring_op)?;
            debug!(
                "local gather of {len} bytes from {} in {:?}",
                crate::plural(parts.len() as u64, "rank"),
                t.elapsed()
            );
            (*d, *o, acc, len)
        }
        // Broadcast as a byte-exact sum: the root's bytes plus zeros from everyone else,
        // as wrapping int64 additions (identity on the root's bits).
        Kind::Broadcast(root) => {
            let acc = work.next(len.div_ceil(8) * 8);
            let bytes = acc.try_as_mut().unwrap_or_default();
            bytes.fill(0);
            if let Some(p) = parts.iter().find(|p| p.global == *root) {
                p.data.read(0, &mut bytes[..len])?;
            }
            (DType::I64, ReduceOp::Sum, acc, len)
        }
        Kind::Barrier => {
            let acc = work.next(8);
            acc.try_as_mut().unwrap_or_default().fill(0);
            (DType::I64, ReduceOp::Sum, acc, 0)
        }
    };
    // An average divides the sum over every rank of the job (not every node) once, where
    // the ring completes each chunk, so all nodes spread the same divided bytes.
    ring.allreduce_buffer_dividing(op_id, acc, dtype, op, ranks as usize).await.map_err(|e| e.to_string())?;
    Ok(out)
}
