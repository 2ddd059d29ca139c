//! The one-hop allreduce of small buffers: every node sends its buffer to every other.

use super::*;

impl RingNet {
    /// A small allreduce in one hop ([`is_direct`]): this node's buffer goes to every other
    /// node at once, and each node reduces all of them in rank order itself.
    pub(super) async fn run_direct<M: RingMemory>(
        &mut self,
        op_id: u64,
        buf: &mut M,
        how: Reduction,
    ) -> Result<(), CollectiveError> {
        let (n, len) = (self.addrs.len(), buf.len());
        // A copy, never a loan: this node overwrites its buffer as soon as it has every
        // contribution, without waiting for the others' ACKs.
        let mine = buf.copy(0..len);
        let mut writers = Vec::with_capacity(n - 1);
        for (i, &peer) in self.addrs.iter().enumerate() {
            if i == self.rank {
                continue;
            }
            let mut send = self.transport.open_data_lane(peer, op_id, 0).await?;
            // The stream a one-lane ring would open, holding one frame.
            let mut parts = [
                Bytes::from_static(&[0, 1]),
                Bytes::copy_from_slice(&encode_chunk_header(DIRECT_TRANSFER_ID, len as u32)),
                mine.clone(),
            ];
            let task = tokio::spawn(async move {
                send.write_all_chunks(&mut parts).await.map_err(|e| e.to_string())?;
                send.finish().map_err(|e| e.to_string())
            });
            writers.push((peer, task));
        }
        let mut contributions = Vec::with_capacity(n);
        for (i, &peer) in self.addrs.clone().iter().enumerate() {
            if i == self.rank {
                contributions.push(mine.clone());
                continue;
            }
            let mut recv = self.stream_from(peer, op_id).await?;
            // At most 64 KiB: all of it within the progress timeout.
            let got = tokio::time::timeout(self.progress_timeout, read_direct(&mut recv, len))
                .await
                .map_err(|_| self.stalled(peer, op_id, false))?
                .map_err(|reason| CollectiveError::Link { peer, reason })?;
            contributions.push(got);
        }
        let mut out = vec![0u8; len];
        direct_reduce(&contributions, how, &mut out)?;
        // A loan from an earlier, larger operation on this buffer ends at its ACK.
        let released = buf.released();
        while buf.is_lent(&(0..len)) {
            released.notified().await;
        }
        buf.overwrite(&out)?;
        for (peer, mut writer) in writers {
            let Ok(done) = tokio::time::timeout(self.progress_timeout, &mut writer).await else {
                writer.abort();
                return Err(self.stalled(peer, op_id, true));
            };
            done.map_err(|e| e.to_string())
                .and_then(|r| r)
                .map_err(|reason| CollectiveError::Link { peer, reason })?;
        }
        Ok(())
    }
}

/// Reads a direct contribution of `len` bytes: a one-lane preamble and one frame.
pub(super) async fn read_direct(recv: &mut quinn::RecvStream, len: usize) -> Result<Bytes, String> {
    let mut pre = [0u8; LANE_PREAMBLE];
    recv.read_exact(&mut pre).await.map_err(|e| format!("direct contribution: {e}"))?;
    let mut head = [0u8; CHUNK_HEADER_LEN];
    recv.read_exact(&mut head).await.map_err(|e| format!("direct contribution: {e}"))?;
    // The id first: a ring frame (a node that did not go direct) is named as such.
    let (id, got) = decode_chunk_header(&head, usize::MAX).map_err(|e| e.to_string())?;
    if pre != [0, 1] || id != DIRECT_TRANSFER_ID {
        return Err(format!(
            "it sent ring transfer {id:#x}, not a direct contribution: does it run another meshd, or an allreduce of another size?"
        ));
    }
    if got != len {
        return Err(format!("it contributed {got} bytes to an allreduce of {len} bytes here"));
    }
    let mut data = vec![0u8; len];
    recv.read_exact(&mut data).await.map_err(|e| format!("direct contribution: {e}"))?;
    Ok(Bytes::from(data))
}
