//! Chunk frames on a lane's stream: `[transfer id u64][length u32][payload]`.

use super::*;

pub(super) async fn write_frames(
    mut send: quinn::SendStream,
    mut rx: mpsc::Receiver<(u64, Bytes)>,
    peer: SocketAddr,
    progress: Arc<Progress>,
) -> Result<(), CollectiveError> {
    let link = |e: String| CollectiveError::Link { peer, reason: e };
    while let Some((id, payload)) = rx.recv().await {
        let head = encode_chunk_header(id, payload.len() as u32);
        let n = head.len() + payload.len();
        let mut parts = [Bytes::copy_from_slice(&head), payload];
        send.write_all_chunks(&mut parts).await.map_err(|e| link(e.to_string()))?;
        progress.sent(n);
    }
    // Finishing is enough: quinn still delivers (and retransmits) a finished stream after
    // it is dropped. Waiting for the peer's ACK here would add its delayed-ACK timer
    // (25 ms) to every operation.
    send.finish().map_err(|e| link(e.to_string()))?;
    Ok(())
}

pub(super) async fn read_frames(
    mut recv: quinn::RecvStream,
    tx: mpsc::Sender<Result<(u64, Chunk), CollectiveError>>,
    peer: SocketAddr,
    max_chunk: usize,
    progress: Arc<Progress>,
) {
    loop {
        let mut head = [0u8; CHUNK_HEADER_LEN];
        match recv.read_exact(&mut head).await {
            Ok(()) => progress.received(CHUNK_HEADER_LEN),
            Err(quinn::ReadExactError::FinishedEarly(0)) => return,
            Err(e) => {
                let _ = tx.send(Err(CollectiveError::Link { peer, reason: e.to_string() })).await;
                return;
            }
        }
        let (id, len) = match decode_chunk_header(&head, max_chunk) {
            Ok(h) => h,
            Err(e) => {
                let _ = tx.send(Err(CollectiveError::Link { peer, reason: e.to_string() })).await;
                return;
            }
        };
        // Keep quinn's received pieces as they are (no copy): the reduction reads them in
        // place and the all-gather forwards them.
        let mut payload = Vec::new();
        let mut got = 0;
        while got < len {
            match recv.read_chunk(len - got, true).await {
                Ok(Some(c)) => {
                    got += c.bytes.len();
                    progress.received(c.bytes.len());
                    payload.push(c.bytes);
                }
                Ok(None) => {
                    let reason = format!("stream ended inside a {len}-byte chunk");
                    let _ = tx.send(Err(CollectiveError::Link { peer, reason })).await;
                    return;
                }
                Err(e) => {
                    let _ = tx.send(Err(CollectiveError::Link { peer, reason: e.to_string() })).await;
                    return;
                }
            }
        }
        if tx.send(Ok((id, Chunk::Parts(payload)))).await.is_err() {
            return;
        }
    }
}
