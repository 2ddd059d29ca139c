//! One end of a plane link: keys, replay window, acknowledgements, the receiver's message
//! record and the sender, composed into the calls the IO makes.
//!
//! The IO's loop, per lane:
//! - a datagram arrives whose first byte [`is_plane_datagram`](super::is_plane_datagram):
//!   [`Link::handle_datagram`] opens it in place and returns the fragment's bytes, borrowed
//!   from the datagram, for the application to consume (reduce) before the buffer is reused;
//! - after a receive batch, and whenever the application queued messages or a timer fired:
//!   [`Link::poll_transmit`] until it returns `None`, each time sending `buf[..len]` as
//!   datagrams of `segment_size` bytes (one GSO send);
//! - sleep until [`Link::poll_timeout`], then [`Link::handle_timeout`];
//! - drain [`Link::poll_event`] for delivered messages.

use super::PlaneError;
use super::ack::AckState;
use super::frame::{self, FRAME_PADDING, FRAME_PING};
use super::incoming::{Incoming, Verdict};
use super::keys::{DEFAULT_REKEY_AFTER, LinkKeys, RecvKeys, SendKeys};
use super::packet::{HEADER_LEN, Header, OVERHEAD, TAG_LEN, expand_pn};
use super::replay::ReplayWindow;
use super::sender::{Event, Sender, SenderStats};
use std::time::{Duration, Instant};

/// Smallest datagram a link may use: enough for a full ACK frame and QUIC's minimum path MTU.
pub const MIN_DATAGRAM: usize = 1200;
/// Most bytes one `poll_transmit` batch takes (a UDP GSO send is one IP datagram's worth).
pub const MAX_BATCH: usize = 65_535;
/// Most padding added to fit a datagram into a GSO batch.
const MAX_PADDING: usize = 32;
/// Largest UDP payload over IPv4.
pub const MAX_DATAGRAM: usize = 65_507;

/// How a link is set up.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// The two directions' secrets.
    pub keys: LinkKeys,
    /// The lane this link serves; datagrams of another lane are refused.
    pub lane: u8,
    /// UDP payload size of a full datagram (path MTU minus IP and UDP headers: 1452 for
    /// IPv6 at MTU 1500, 1472 for IPv4; 8952 or 8972 at 9000).
    pub max_datagram: usize,
    /// RTT assumed until the first sample.
    pub initial_rtt: Duration,
    /// Longest this end waits before acknowledging, and the most it expects the peer to.
    pub max_ack_delay: Duration,
    /// Packets sealed under one key before a key update starts (at most
    /// [`DEFAULT_REKEY_AFTER`], half of AES-GCM's limit).
    pub rekey_after: u64,
    /// Largest message the peer may send, in bytes.
    pub max_message_len: u64,
    /// Messages the peer may have partly delivered at once.
    pub max_incoming_messages: usize,
    /// Whether loss without a standing queue and under 2% of packets leaves the congestion
    /// window alone (see [`Sender::is_congestive`]); `false` is plain CUBIC, which halves
    /// throughput at well under 1% random loss on a fast path.
    pub tolerate_random_loss: bool,
}

impl LinkConfig {
    /// Defaults for datacenter links: 1452-byte datagrams, 1 ms initial RTT, 1 ms ack delay.
    pub fn new(keys: LinkKeys, lane: u8) -> LinkConfig {
        LinkConfig {
            keys,
            lane,
            max_datagram: 1452,
            initial_rtt: Duration::from_millis(1),
            max_ack_delay: Duration::from_millis(1),
            rekey_after: DEFAULT_REKEY_AFTER,
            max_message_len: 1 << 32,
            max_incoming_messages: 256,
            tolerate_random_loss: true,
        }
    }
}

/// A batch of sealed datagrams in the caller's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Bytes of the buffer used.
    pub len: usize,
    /// Size of each datagram; the last may be shorter (the GSO rule).
    pub segment_size: usize,
}

impl Transmit {
    /// Datagrams in the batch.
    pub fn segments(&self) -> usize {
        self.len.div_ceil(self.segment_size)
    }
}

/// A fragment of a message, borrowed from the datagram it arrived in.
#[derive(Debug, PartialEq, Eq)]
pub struct Received<'a> {
    /// The application's name for the message.
    pub tag: u64,
    /// The link's number for the message.
    pub seq: u64,
    /// Where `data` goes in the message.
    pub offset: u64,
    /// The message's length.
    pub total_len: u64,
    /// The bytes, seen by the application exactly once.
    pub data: &'a [u8],
    /// Whether this fragment completed the message.
    pub complete: bool,
}

/// Counters and estimates of one link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkStats {
    /// The sending direction's counters.
    pub sender: SenderStats,
    /// Datagrams opened and accepted.
    pub packets_received: u64,
    /// Fragments that arrived again and were dropped.
    pub duplicate_fragments: u64,
    /// Congestion window in bytes.
    pub window: u64,
    /// Bytes in flight.
    pub in_flight: u64,
    /// Smoothed RTT.
    pub rtt: Duration,
    /// Key updates this end made.
    pub send_key_updates: u64,
    /// Key updates the peer made.
    pub recv_key_updates: u64,
}

/// A new DATA fragment, offered to the application before the link takes the datagram in
/// ([`Link::handle_datagram_admit`]): what it would have to hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// The application's name for the message.
    pub tag: u64,
    /// The link's number for the message.
    pub seq: u64,
    /// Where the fragment's bytes go in the message.
    pub offset: u64,
    /// The fragment's bytes.
    pub len: u64,
    /// The message's length.
    pub total_len: u64,
    /// Whether this is the first fragment of the message to arrive (the message opens).
    pub opens: bool,
}

/// One end of a plane link.
#[derive(Debug)]
pub struct Link {
    lane: u8,
    send_id: u64,
    recv_id: u64,
    max_datagram: usize,
    max_ack_delay: Duration,
    rekey_after: u64,
    send_keys: SendKeys,
    recv_keys: RecvKeys,
    replay: ReplayWindow,
    acks: AckState,
    incoming: Incoming,
    sender: Sender,
    packets_received: u64,
    duplicate_fragments: u64,
    exhausted: bool,
}

impl Link {
    /// A link set up from `config` at `now`.
    pub fn new(config: LinkConfig, now: Instant) -> Result<Link, PlaneError> {
        if !(MIN_DATAGRAM..=MAX_DATAGRAM).contains(&config.max_datagram) {
            return Err(PlaneError::Config(format!(
                "max_datagram {} is outside {MIN_DATAGRAM}..={MAX_DATAGRAM}",
                config.max_datagram
            )));
        }
        if config.rekey_after == 0 || config.rekey_after > DEFAULT_REKEY_AFTER {
            return Err(PlaneError::Config(format!(
                "rekey_after {} is outside 1..={DEFAULT_REKEY_AFTER}",
                config.rekey_after
            )));
        }
        if config.initial_rtt.is_zero() || config.max_incoming_messages == 0 {
            return Err(PlaneError::Config("initial_rtt and max_incoming_messages must be above 0".into()));
        }
        Ok(Link {
            lane: config.lane,
            send_id: config.keys.send_id(),
            recv_id: config.keys.recv_id(),
            max_datagram: config.max_datagram,
            max_ack_delay: config.max_ack_delay,
            rekey_after: config.rekey_after,
            send_keys: SendKeys::new(config.keys.send),
            recv_keys: RecvKeys::new(config.keys.recv),
            replay: ReplayWindow::default(),
            acks: AckState::default(),
            incoming: Incoming::new(config.max_incoming_messages, config.max_message_len),
            sender: Sender::new(
                now,
                config.max_datagram,
                config.initial_rtt,
                config.max_ack_delay,
                config.tolerate_random_loss,
            ),
            packets_received: 0,
            duplicate_fragments: 0,
            exhausted: false,
        })
    }

    /// Queues a message for the peer under the application's `tag` (below 2^62). The link
    /// owns `data` until the peer acknowledged all of it ([`Event::Delivered`]). Returns the
    /// message's number on this link.
    pub fn send(&mut self, tag: u64, data: Vec<u8>) -> Result<u64, PlaneError> {
        self.sender.queue(tag, data)
    }

    /// Queues the message `head` then `body` (head at most
    /// [`MAX_HEAD`](super::sender::MAX_HEAD) bytes): the body is shared, not copied, and
    /// held until the peer acknowledged all of it. Returns the message's number.
    pub fn send_parts(&mut self, tag: u64, head: &[u8], body: bytes::Bytes) -> Result<u64, PlaneError> {
        self.sender.queue_parts(tag, head, body)
    }

    /// Bytes queued or in flight, not yet acknowledged: what the application may use to
    /// stop queueing.
    pub fn queued_bytes(&self) -> u64 {
        self.sender.queued_bytes()
    }

    /// Seals up to `max_segments` datagrams back to back into `buf` (grown as needed,
    /// never shrunk), honouring the congestion window and the pacer; ACKs go out whenever
    /// due. `None` when nothing may be sent now.
    pub fn poll_transmit(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
        max_segments: usize,
    ) -> Option<Transmit> {
        let mut len = 0;
        let mut segment_size = 0;
        for _ in 0..max_segments.max(1) {
            // After the first, every datagram of a batch must be `segment_size` bytes (the
            // last may be shorter), and a batch stays under UDP's 64 KiB.
            let limit = if segment_size == 0 { self.max_datagram } else { segment_size };
            if len + limit > MAX_BATCH {
                break;
            }
            if buf.len() < len + limit {
                buf.resize(len + limit, 0);
            }
            let pad_to = (segment_size > 0).then_some(segment_size);
            let Some(size) = self.build(now, &mut buf[len..len + limit], pad_to) else { break };
            if segment_size == 0 {
                segment_size = size;
            }
            len += size;
            if size < segment_size {
                break;
            }
        }
        (len > 0).then_some(Transmit { len, segment_size })
    }

    /// Builds one datagram into `out` (its length is the most the datagram may take);
    /// returns its size. A data datagram a few bytes short of `pad_to` is padded to it, so
    /// that fragments of messages whose DATA headers differ in size share a GSO batch.
    fn build(&mut self, now: Instant, out: &mut [u8], pad_to: Option<usize>) -> Option<usize> {
        if self.exhausted {
            return None;
        }
        let updates = self.send_keys.updates();
        self.send_keys.maybe_update(self.rekey_after, self.sender.next_pn());
        if self.send_keys.updates() != updates {
            self.sender.request_ping();
        }
        if !self.send_keys.can_seal() {
            self.exhausted = true;
            self.sender.push_event(Event::KeysExhausted);
            return None;
        }
        let limit = out.len();
        let plan = self.sender.next_plan(now, limit);
        let ping = plan.is_none() && self.sender.wants_ping();
        if plan.is_none() && !ping && !self.acks.wants_ack(now) {
            return None;
        }
        let mut pos = HEADER_LEN;
        if let Some(p) = &plan {
            let bare = OVERHEAD + p.header.encoded_len() + p.len;
            if self.acks.pending() && self.acks.frame_len(now) <= limit - bare {
                self.acks.write(now, out, &mut pos);
            }
            let size = pos - HEADER_LEN + bare;
            if let Some(target) = pad_to.filter(|t| *t > size && *t - size <= MAX_PADDING) {
                out[pos..pos + target - size].fill(FRAME_PADDING);
                pos += target - size;
            }
            p.header.write(out, &mut pos);
            self.sender.copy_payload(p, &mut out[pos..pos + p.len]);
            pos += p.len;
        } else {
            if self.acks.frame_len(now) + 1 + OVERHEAD > limit {
                return None;
            }
            self.acks.write(now, out, &mut pos);
            if ping {
                out[pos] = FRAME_PING;
                pos += 1;
            }
        }
        let pn = self.sender.next_pn();
        Header::write(self.send_keys.phase(), self.lane, self.send_id, pn, out);
        let (header, body) = out.split_at_mut(HEADER_LEN);
        let plain_len = pos - HEADER_LEN;
        let tag = self.send_keys.seal(pn, header, &mut body[..plain_len]);
        body[plain_len..plain_len + TAG_LEN].copy_from_slice(tag.as_ref());
        let size = pos + TAG_LEN;
        self.sender.on_sent(now, size, plan.as_ref(), ping);
        Some(size)
    }

    /// The link id of the datagrams this end opens ([`packet::link_id_of`](super::packet::link_id_of)).
    pub fn recv_id(&self) -> u64 {
        self.recv_id
    }

    /// Opens a plane datagram in place and takes in what it carries. A datagram that does
    /// not open (another link's id, wrong keys, altered, replayed, too old, wrong lane)
    /// changes nothing here and costs at most one failed AEAD open (none for another
    /// link's id). On success, returns the DATA fragment it carried, unless this end had it
    /// already.
    pub fn handle_datagram<'a>(
        &mut self,
        datagram: &'a mut [u8],
        now: Instant,
    ) -> Result<Option<Received<'a>>, PlaneError> {
        self.handle_datagram_admit(datagram, now, |_| true)
    }

    /// [`handle_datagram`](Self::handle_datagram), asking `admit` first whether a new DATA
    /// fragment may be taken in (the application's memory budget): a datagram whose
    /// fragment it refuses is dropped as if lost, unacknowledged and not recorded, so the
    /// sender resends it later (and its loss recovery slows down); only the ACK frame it
    /// carries is taken in, since the peer's acknowledgements of this end's packets hold
    /// whatever this end holds. Refused: [`PlaneError::OverBudget`]. `admit` is called at
    /// most once, after every check that could refuse the datagram otherwise.
    pub fn handle_datagram_admit<'a>(
        &mut self,
        datagram: &'a mut [u8],
        now: Instant,
        admit: impl FnOnce(&Offer) -> bool,
    ) -> Result<Option<Received<'a>>, PlaneError> {
        let header = Header::parse(datagram)?;
        if header.link_id != self.recv_id {
            return Err(PlaneError::UnknownLink(header.link_id));
        }
        if header.lane != self.lane {
            return Err(PlaneError::WrongLane { got: header.lane, want: self.lane });
        }
        let pn = expand_pn(self.replay.largest(), header.truncated_pn);
        self.replay.check(pn)?;
        let choice = self.recv_keys.choose(header.phase, pn).ok_or(PlaneError::Auth)?;
        let key = self.recv_keys.key(choice).ok_or(PlaneError::Auth)?;
        let (head, body) = datagram.split_at_mut(HEADER_LEN);
        let plain: &'a [u8] = key.open(pn, head, body).ok_or(PlaneError::Auth)?;
        let frames = frame::parse(plain)?;
        if let Some(ack) = &frames.ack {
            self.sender.check_ack(ack)?;
        }
        let verdict = match &frames.data {
            Some((h, start)) => Some(self.incoming.check(h, (plain.len() - start) as u64)?),
            None => None,
        };
        if let (Some((h, start)), Some(v @ (Verdict::Opens | Verdict::Continues))) = (&frames.data, verdict) {
            let offer = Offer {
                tag: h.tag,
                seq: h.seq,
                offset: h.offset,
                len: (plain.len() - start) as u64,
                total_len: h.total_len,
                opens: v == Verdict::Opens,
            };
            if !admit(&offer) {
                if let Some(ack) = &frames.ack {
                    self.take_ack(ack, now);
                }
                return Err(PlaneError::OverBudget);
            }
        }
        // Everything below changes state; everything above could refuse the datagram.
        self.replay.insert(pn);
        self.recv_keys.commit(choice, pn);
        self.packets_received += 1;
        self.acks.on_packet(pn, frames.ping || frames.data.is_some(), now, self.max_ack_delay);
        if let Some(ack) = &frames.ack {
            self.take_ack(ack, now);
        }
        let (Some((h, start)), Some(verdict)) = (frames.data, verdict) else { return Ok(None) };
        if verdict == Verdict::Duplicate {
            self.duplicate_fragments += 1;
            return Ok(None);
        }
        let data = &plain[start..];
        let complete = self.incoming.commit(&h, data.len() as u64);
        Ok(Some(Received {
            tag: h.tag,
            seq: h.seq,
            offset: h.offset,
            total_len: h.total_len,
            data,
            complete,
        }))
    }

    /// Takes in the peer's acknowledgements (checked by `check_ack`).
    fn take_ack(&mut self, ack: &super::ack::AckFrame<'_>, now: Instant) {
        self.sender.on_ack(ack, now);
        if let Some(l) = self.sender.largest_acked() {
            self.send_keys.on_acked(l);
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) should next run (or `poll_transmit`
    /// be tried again: an ACK or a paced packet is due).
    pub fn poll_timeout(&self) -> Option<Instant> {
        match (self.sender.poll_timeout(), self.acks.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs the timers due at `now` (loss detection, probe timeout, pacing release). Call
    /// `poll_transmit` afterwards.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.sender.handle_timeout(now);
    }

    /// How long this end's packets have been in flight with nothing acknowledged (`None`
    /// with nothing in flight).
    pub fn unacknowledged_for(&self, now: Instant) -> Option<Duration> {
        self.sender.unacknowledged_for(now)
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.sender.poll_event()
    }

    /// Counters and estimates.
    pub fn stats(&self) -> LinkStats {
        LinkStats {
            sender: self.sender.stats().clone(),
            packets_received: self.packets_received,
            duplicate_fragments: self.duplicate_fragments,
            window: self.sender.window(),
            in_flight: self.sender.in_flight(),
            rtt: self.sender.rtt().get(),
            send_key_updates: self.send_keys.updates(),
            recv_key_updates: self.recv_keys.updates(),
        }
    }

    /// The key phase of the next packet this end seals, and how many went out under the
    /// current key (for tests and diagnostics).
    pub fn send_key_state(&self) -> (bool, u64) {
        (self.send_keys.phase(), self.send_keys.sealed())
    }
}
