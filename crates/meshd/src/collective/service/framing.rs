//! The socket's framing: `[u32 BE header length][JSON header][payload]`.

use super::*;

/// Reads one message; the payload goes into `spare` (the previous reply's buffer, so a
/// rank that sends the same bucket again and again costs no fresh allocation).
pub(super) async fn read_msg<R: AsyncRead + Unpin>(
    s: &mut R,
    spare: Vec<u8>,
) -> std::io::Result<Option<(Value, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match s.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = request::header_len(len).map_err(std::io::Error::other)?;
    let mut head = vec![0u8; n];
    s.read_exact(&mut head).await?;
    let (v, nbytes) = request::parse_header(&head).map_err(std::io::Error::other)?;
    let mut payload = spare;
    payload.clear();
    payload.reserve(nbytes);
    while payload.len() < nbytes {
        let left = (nbytes - payload.len()) as u64;
        if (&mut *s).take(left).read_buf(&mut payload).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(Some((v, payload)))
}

/// Payloads up to this size go in the same write as their header.
pub(super) const SMALL_PAYLOAD: usize = 64 << 10;

pub(super) async fn write_msg<W: AsyncWrite + Unpin>(
    s: &mut W,
    head: Value,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut head = head;
    head["nbytes"] = json!(payload.len());
    let h = serde_json::to_vec(&head).map_err(std::io::Error::other)?;
    let small = payload.len() <= SMALL_PAYLOAD;
    let mut out = Vec::with_capacity(4 + h.len() + if small { payload.len() } else { 0 });
    out.extend_from_slice(&(h.len() as u32).to_be_bytes());
    out.extend_from_slice(&h);
    if small {
        out.extend_from_slice(payload);
    }
    s.write_all(&out).await?;
    if !small {
        s.write_all(payload).await?;
    }
    s.flush().await
}
