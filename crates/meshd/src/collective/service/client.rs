//! One local rank's session: hello (and the in-place probe), its collectives, its store
//! requests; a rank that hangs up abandons its request before any write into its memory.

use super::*;

use super::framing::{read_msg, write_msg};
use super::part::{Data, GaveUp, Part};

pub(super) async fn client(
    s: UnixStream,
    cfg: &ServiceConfig,
    coll: mpsc::Sender<CollReq>,
) -> std::io::Result<()> {
    let mut seq = 0u64;
    let mut me: Option<(u32, u32)> = None; // (global, local)
    // The peer's pid from the kernel: the only process meshd reads or writes for it.
    let pid = s.peer_cred().ok().and_then(|c| c.pid());
    // Requests are read through a buffer: length, header and a small payload in one read.
    let (r, mut s) = s.into_split();
    let mut r = BufReader::with_capacity(request::MAX_HEADER + 4, r);
    let mut in_place = false;
    let mut spare = Vec::new();
    while let Some((req, payload)) = read_msg(&mut r, std::mem::take(&mut spare)).await? {
        if let Some(a) = &cfg.activity {
            a.touch();
        }
        let fail = |e: String| json!({"ok": false, "error": e});
        let (head, body): (Value, Vec<u8>) = match request::parse_request(&req, payload.len(), cfg.world) {
            Request::Hello { rank } => {
                let lo = cfg.first_global as u64;
                if rank < lo || rank >= lo + cfg.local_world as u64 {
                    (
                        fail(format!(
                            "rank {rank} is not a rank of this node (ranks {lo}..{})",
                            lo + cfg.local_world as u64
                        )),
                        vec![],
                    )
                } else {
                    me = Some((rank as u32, (rank - lo) as u32));
                    in_place = match (pid, request::parse_probe(&req)) {
                        (Some(pid), Some((addr, want))) => probe(pid, addr, want),
                        _ => false,
                    };
                    let hello = json!({"ok": true, "world": cfg.world, "local_world": cfg.local_world, "in_place": in_place});
                    (hello, vec![])
                }
            }
            Request::Collective(kind) => {
                let Some((global, local)) = me else {
                    write_msg(&mut s, fail("send hello first".into()), &[]).await?;
                    continue;
                };
                let data = match request::parse_in_place(&req, payload.len()) {
                    Ok(None) => Ok(Data::Sent(payload)),
                    Ok(Some(b)) => match pid {
                        Some(pid) if in_place => Ok(Data::InPlace(Remote { pid, addr: b.addr, len: b.len })),
                        _ => Err("in-place buffers need the cross-memory probe of hello to succeed; send the payload instead".to_string()),
                    },
                    Err(e) => Err(e.to_string()),
                };
                match kind.map_err(|e| e.to_string()).and_then(|k| data.map(|d| (k, d))) {
                    Err(e) => (fail(e), vec![]),
                    Ok((kind, data)) => {
                        let (tx, rx) = oneshot::channel();
                        let gave_up = Arc::new(GaveUp::default());
                        let part = Part { kind, data, global, reply: tx, gave_up: gave_up.clone() };
                        seq += 1;
                        if coll.send(CollReq { local, seq, part }).await.is_err() {
                            (fail("the node's collective engine stopped".into()), vec![])
                        } else {
                            match until_hangup(rx, &mut r).await {
                                Some(Ok(Ok(data))) => (json!({"ok": true}), data),
                                Some(Ok(Err(e))) => (fail(e), vec![]),
                                Some(Err(_)) => {
                                    (fail("the collective was abandoned (job stopping?)".into()), vec![])
                                }
                                // The rank timed out or went away: its buffer is not ours to
                                // write any more. Closing the connection tells it so.
                                None => {
                                    gave_up.set();
                                    debug!("rank {global} gave up on its collective #{seq}");
                                    return Ok(());
                                }
                            }
                        }
                    }
                }
            }
            Request::StoreSet(Err(e)) => (fail(e.to_string()), vec![]),
            Request::StoreSet(Ok(key)) => {
                let call = StoreCall::Set { key: key.clone(), value: payload };
                match store::ask(&cfg.store, cfg.restart, call).await {
                    Some(StoreAnswer::Set(Ok(()))) => (json!({"ok": true}), vec![]),
                    Some(StoreAnswer::Set(Err(e))) => (fail(format!("store_set of {key:?}: {e}")), vec![]),
                    _ => (fail(format!("store_set of {key:?}: the store stopped (job stopping?)")), vec![]),
                }
            }
            Request::StoreGet { key, timeout } => {
                let call = StoreCall::Get { key: key.clone(), wait: Duration::from_secs_f64(timeout) };
                match store::ask(&cfg.store, cfg.restart, call).await {
                    Some(StoreAnswer::Get(Some(v))) => (json!({"ok": true}), v),
                    _ => (fail(format!("store key {key:?} not set within {timeout} s")), vec![]),
                }
            }
            Request::Unknown(other) => (fail(format!("unknown request {other:?}")), vec![]),
        };
        write_msg(&mut s, head, &body).await?;
        if let Some(a) = &cfg.activity {
            a.touch();
        }
        spare = body;
    }
    Ok(())
}

/// Waits for `rx`, unless the client hangs up first (end of file or an error on its
/// connection: the Python client half-closes when its call times out): then `None`. Bytes
/// the client sent meanwhile stay unread for the next request.
pub(super) async fn until_hangup<T, R: tokio::io::AsyncBufRead + Unpin>(
    rx: oneshot::Receiver<T>,
    r: &mut R,
) -> Option<Result<T, oneshot::error::RecvError>> {
    use tokio::io::AsyncBufReadExt;
    tokio::pin!(rx);
    tokio::select! {
        v = &mut rx => return Some(v),
        more = r.fill_buf() => match more {
            Ok(b) if !b.is_empty() => {}
            _ => return None,
        },
    }
    // The client sent more before its answer (not what the clients do): just wait.
    Some(rx.await)
}

/// Whether meshd can read the client's memory: the probe bytes must be found at the
/// address the client gave.
pub(super) fn probe(pid: i32, addr: u64, want: [u8; request::PROBE_LEN]) -> bool {
    let r = Remote { pid, addr, len: want.len() };
    let mut got = [0u8; request::PROBE_LEN];
    match cma::read(&r, 0, &mut got) {
        Ok(()) if got == want => true,
        Ok(()) => {
            debug!("process {pid}: the probe bytes differ; buffers go through the socket");
            false
        }
        Err(e) => {
            // Once per meshd at info: the slower path should not go unnoticed.
            static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                debug!("process {pid}: cross-memory attach refused ({e}); buffers go through the socket");
            } else {
                info!(
                    "local ranks' buffers go through the socket (slower): the kernel refused meshd access to process {pid}'s memory ({e}); check /proc/sys/kernel/yama/ptrace_scope (0 or 1 allows it) and seccomp"
                );
            }
            false
        }
    }
}
