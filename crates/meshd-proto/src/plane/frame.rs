//! The frames inside a datagram's plaintext: an optional ACK, then an optional DATA frame
//! that runs to the end of the packet.
//!
//! ```text
//! DATA  0x10  seq (varint)  tag (varint)  total_len (varint)  offset (varint)  bytes...
//! ```
//!
//! `offset` is always encoded as wide as `total_len`, so every full fragment of a message
//! makes a datagram of exactly the link's size (what GSO needs). A PING frame (`0x01`, no
//! body) between the two makes a packet that carries no data ack-eliciting; PADDING bytes
//! (`0x00`) before DATA bring a datagram to its GSO batch's segment size.
//!
//! `seq` numbers the sender's messages 0, 1, 2...; `tag` is the application's name for the
//! message (the ring's op and chunk); `offset` places these bytes in it. A fragment is
//! always resent with the same `offset` and length, so the receiver can tell a copy of a
//! fragment it already has from new bytes.

use super::PlaneError;
use super::ack::{AckFrame, FRAME_ACK};
use super::packet::{get_varint, put_varint, put_varint_width, varint_len};

/// A byte of padding (before the DATA frame).
pub const FRAME_PADDING: u8 = 0x00;
/// Frame type byte of a PING frame.
pub const FRAME_PING: u8 = 0x01;
/// Frame type byte of a DATA frame.
pub const FRAME_DATA: u8 = 0x10;

/// A DATA frame's fields before its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// The sender's message number.
    pub seq: u64,
    /// The application's name for the message.
    pub tag: u64,
    /// The whole message's length in bytes.
    pub total_len: u64,
    /// Where this fragment's bytes go in the message.
    pub offset: u64,
}

impl DataHeader {
    /// Bytes the frame's header takes.
    pub fn encoded_len(&self) -> usize {
        1 + varint_len(self.seq) + varint_len(self.tag) + 2 * varint_len(self.total_len)
    }

    /// Writes the frame header at `out[*pos..]`.
    pub fn write(&self, out: &mut [u8], pos: &mut usize) {
        out[*pos] = FRAME_DATA;
        *pos += 1;
        put_varint(out, pos, self.seq);
        put_varint(out, pos, self.tag);
        put_varint(out, pos, self.total_len);
        put_varint_width(out, pos, self.offset, varint_len(self.total_len));
    }
}

/// The frames of one packet, borrowed from its plaintext.
#[derive(Debug, Clone, Copy)]
pub struct Frames<'a> {
    /// The ACK frame, if the packet carries one.
    pub ack: Option<AckFrame<'a>>,
    /// Whether a PING frame asked for an acknowledgement.
    pub ping: bool,
    /// The DATA frame's header and where its bytes start in the plaintext.
    pub data: Option<(DataHeader, usize)>,
}

/// Parses and checks a packet's plaintext without changing anything.
pub fn parse(plain: &[u8]) -> Result<Frames<'_>, PlaneError> {
    let mut pos = 0;
    let mut frames = Frames { ack: None, ping: false, data: None };
    if plain.first() == Some(&FRAME_ACK) {
        pos += 1;
        frames.ack = Some(AckFrame::parse(plain, &mut pos)?);
    }
    if plain.get(pos) == Some(&FRAME_PING) {
        pos += 1;
        frames.ping = true;
    }
    while plain.get(pos) == Some(&FRAME_PADDING) {
        pos += 1;
    }
    match plain.get(pos) {
        None => {}
        Some(&FRAME_DATA) => {
            pos += 1;
            let seq = get_varint(plain, &mut pos)?;
            let tag = get_varint(plain, &mut pos)?;
            let total_len = get_varint(plain, &mut pos)?;
            let offset = get_varint(plain, &mut pos)?;
            let len = (plain.len() - pos) as u64;
            if offset.checked_add(len).is_none_or(|end| end > total_len) {
                return Err(PlaneError::Malformed("DATA past its message's end"));
            }
            if len == 0 && total_len != 0 {
                return Err(PlaneError::Malformed("empty DATA fragment"));
            }
            frames.data = Some((DataHeader { seq, tag, total_len, offset }, pos));
        }
        Some(_) => return Err(PlaneError::Malformed("unknown frame type")),
    }
    if frames.ack.is_none() && !frames.ping && frames.data.is_none() {
        return Err(PlaneError::Malformed("packet without frames"));
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_frame_round_trips_and_bounds_are_checked() {
        let small = DataHeader { seq: 70, tag: 1 << 40, total_len: 100_000, offset: 0 };
        assert_eq!(small.encoded_len(), DataHeader { offset: 99_999, ..small }.encoded_len());
        let h = DataHeader { seq: 70, tag: 1 << 40, total_len: 100_000, offset: 99_990 };
        let mut buf = vec![0u8; h.encoded_len() + 10];
        let mut pos = 0;
        h.write(&mut buf, &mut pos);
        assert_eq!(pos, h.encoded_len());
        let f = parse(&buf).expect("parses");
        assert!(f.ack.is_none());
        assert_eq!(f.data, Some((h, pos)));
        buf.push(0);
        assert!(parse(&buf).is_err(), "one byte past the end");
        assert!(parse(&[]).is_err());
        assert!(parse(&[0x7f]).is_err());
    }
}
