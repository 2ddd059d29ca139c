//! The sending direction: queued messages cut into fragments, packets in flight, loss
//! detection (RFC 9002 §6: packet threshold 3, time threshold 9/8 RTT, probe timeout),
//! retransmission of lost fragments in new packets, and the congestion window and pacer
//! that decide when the next packet may leave.

use super::PlaneError;
use super::ack::AckFrame;
use super::congestion::{Cubic, Pacer};
use super::frame::DataHeader;
use super::packet::{OVERHEAD, VARINT_MAX};
use super::rtt::Rtt;
use bytes::Bytes;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Fragment lengths (so offsets) are multiples of this: a fragment never splits an element
/// of up to 8 bytes, so the receiver can reduce each datagram's bytes on their own.
pub const FRAG_ALIGN: usize = 8;
/// Packets acknowledged after a packet for it to count as lost (RFC 9002 §6.1.1).
const PACKET_THRESHOLD: u64 = 3;
/// Probe packets sent when the probe timer fires.
const PROBES: u32 = 2;
/// Packets over which the loss rate is measured (twice this, in two halves): long enough
/// that one loss in a small window does not read as a high rate.
const LOSS_SPAN: u64 = 1000;
/// Backoff exponent cap for the probe timer.
const MAX_PTO_BACKOFF: u32 = 16;

/// One fragment of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragRef {
    /// The message's number.
    pub seq: u64,
    /// The fragment's index within it.
    pub index: u32,
}

#[derive(Debug, Clone)]
struct Sent {
    time: Instant,
    size: u32,
    /// `None` for a PING.
    frag: Option<FragRef>,
}

/// Longest head a message may have before its body (see [`Sender::queue_parts`]).
pub const MAX_HEAD: usize = 64;

#[derive(Debug)]
struct OutMsg {
    tag: u64,
    /// The message is `head` then `body`; `len` is both together.
    head: Vec<u8>,
    body: Bytes,
    len: usize,
    frag_len: usize,
    frags: u32,
    next_fresh: u32,
    acked: Vec<u64>,
    unacked: u32,
}

impl OutMsg {
    /// Copies the message's bytes `start..start + out.len()` into `out`.
    fn copy_to(&self, start: usize, out: &mut [u8]) {
        let end = start + out.len();
        let h = self.head.len();
        if start < h {
            let n = h.min(end) - start;
            out[..n].copy_from_slice(&self.head[start..start + n]);
            if end > h {
                out[n..].copy_from_slice(&self.body[..end - h]);
            }
        } else {
            out.copy_from_slice(&self.body[start - h..end - h]);
        }
    }

    fn is_acked(&self, index: u32) -> bool {
        self.acked[index as usize / 64] >> (index % 64) & 1 == 1
    }
}

/// Something the application should hear about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Every byte of the message `tag` (number `seq`) was acknowledged.
    Delivered {
        /// The application's name for the message.
        tag: u64,
        /// The link's number for it.
        seq: u64,
    },
    /// The sending key reached AES-GCM's usage limit without a key update (the peer never
    /// acknowledged the current phase): the link sends nothing more and must be replaced.
    KeysExhausted,
}

/// Counters of the sending direction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SenderStats {
    /// Packets sealed and handed to the IO.
    pub packets_sent: u64,
    /// Packets that carried a resent fragment.
    pub retransmitted: u64,
    /// Packets declared lost.
    pub lost: u64,
    /// Times the congestion window was reduced (at most one per round trip).
    pub congestion_events: u64,
    /// Probe timeouts that fired.
    pub ptos: u64,
    /// Loss events taken for random loss rather than congestion, so not reducing the window.
    pub random_loss_events: u64,
}

/// A fragment chosen to go out in the next packet.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Which fragment.
    pub frag: FragRef,
    /// Its DATA frame header.
    pub header: DataHeader,
    /// Its bytes' range within the message.
    pub start: usize,
    /// Its length.
    pub len: usize,
    /// Whether it is a copy of a fragment sent before.
    pub resend: bool,
}

/// The sending direction of a link.
#[derive(Debug)]
pub struct Sender {
    max_datagram: usize,
    max_ack_delay: Duration,
    msgs: VecDeque<Option<OutMsg>>,
    msg_base: u64,
    fresh: u64,
    /// Numbers of queued one-fragment messages not sent yet, in order: each goes out ahead
    /// of the rest of a longer message being sent (see [`next_fragment`](Self::next_fragment)).
    small: VecDeque<u64>,
    retransmit: VecDeque<FragRef>,
    sent: VecDeque<Option<Sent>>,
    sent_base: u64,
    next_pn: u64,
    in_flight: u64,
    queued_bytes: u64,
    largest_acked: Option<u64>,
    loss_time: Option<Instant>,
    last_eliciting: Option<Instant>,
    /// When an ACK last acknowledged something new, or data went in flight on an idle link.
    progress_at: Instant,
    pto_count: u32,
    probes: u32,
    pacing_until: Option<Instant>,
    ping: bool,
    tolerate_random_loss: bool,
    /// (acknowledged, lost) packets in the current and the previous span of
    /// [`LOSS_SPAN`] packets.
    round: (u64, u64),
    prev_round: (u64, u64),
    rtt: Rtt,
    cc: Cubic,
    pacer: Pacer,
    events: VecDeque<Event>,
    stats: SenderStats,
}

impl Sender {
    /// A sender of datagrams up to `max_datagram` bytes. `tolerate_random_loss`: see
    /// [`is_congestive`](Self::is_congestive).
    pub fn new(
        now: Instant,
        max_datagram: usize,
        initial_rtt: Duration,
        max_ack_delay: Duration,
        tolerate_random_loss: bool,
    ) -> Sender {
        let cc = Cubic::new(max_datagram);
        Sender {
            max_datagram,
            max_ack_delay,
            msgs: VecDeque::new(),
            msg_base: 0,
            fresh: 0,
            small: VecDeque::new(),
            retransmit: VecDeque::new(),
            sent: VecDeque::new(),
            sent_base: 0,
            next_pn: 0,
            in_flight: 0,
            queued_bytes: 0,
            largest_acked: None,
            loss_time: None,
            last_eliciting: None,
            progress_at: now,
            pto_count: 0,
            probes: 0,
            pacing_until: None,
            ping: false,
            tolerate_random_loss,
            round: (0, 0),
            prev_round: (0, 0),
            rtt: Rtt::new(initial_rtt),
            pacer: Pacer::new(now, cc.window(), initial_rtt, max_datagram),
            cc,
            events: VecDeque::new(),
            stats: SenderStats::default(),
        }
    }

    /// Queues a message; returns its number.
    pub fn queue(&mut self, tag: u64, data: Vec<u8>) -> Result<u64, PlaneError> {
        self.queue_parts(tag, &[], Bytes::from(data))
    }

    /// Queues the message `head` then `body` (a short head, at most [`MAX_HEAD`] bytes,
    /// copied; the body shared, not copied: each fragment is copied once, from it into
    /// the datagram being sealed). Returns its number.
    pub fn queue_parts(&mut self, tag: u64, head: &[u8], body: Bytes) -> Result<u64, PlaneError> {
        if tag > VARINT_MAX {
            return Err(PlaneError::TagTooLarge(tag));
        }
        if head.len() > MAX_HEAD {
            return Err(PlaneError::Config(format!(
                "a message head of {} bytes exceeds {MAX_HEAD}",
                head.len()
            )));
        }
        let seq = self.msg_base + self.msgs.len() as u64;
        let len = head.len() + body.len();
        let total = len as u64;
        let header = DataHeader { seq, tag, total_len: total, offset: total };
        let frag_len = (self.max_datagram - OVERHEAD - header.encoded_len()) / FRAG_ALIGN * FRAG_ALIGN;
        let frags = len.div_ceil(frag_len).max(1);
        let frags = u32::try_from(frags).map_err(|_| PlaneError::MessageTooLong {
            len: total,
            max: u64::from(u32::MAX) * frag_len as u64,
        })?;
        self.queued_bytes += total;
        if frags == 1 {
            self.small.push_back(seq);
        }
        self.msgs.push_back(Some(OutMsg {
            tag,
            head: head.to_vec(),
            body,
            len,
            frag_len,
            frags,
            next_fresh: 0,
            acked: vec![0; (frags as usize).div_ceil(64)],
            unacked: frags,
        }));
        Ok(seq)
    }

    fn msg(&self, seq: u64) -> Option<&OutMsg> {
        let i = usize::try_from(seq.checked_sub(self.msg_base)?).ok()?;
        self.msgs.get(i)?.as_ref()
    }

    fn msg_mut(&mut self, seq: u64) -> Option<&mut OutMsg> {
        let i = usize::try_from(seq.checked_sub(self.msg_base)?).ok()?;
        self.msgs.get_mut(i)?.as_mut()
    }

    /// Bytes of messages not yet fully acknowledged.
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes
    }

    /// The number the next packet will carry.
    pub fn next_pn(&self) -> u64 {
        self.next_pn
    }

    /// The largest packet number the peer acknowledged.
    pub fn largest_acked(&self) -> Option<u64> {
        self.largest_acked
    }

    /// The congestion window in bytes.
    pub fn window(&self) -> u64 {
        self.cc.window()
    }

    /// How long packets have been in flight with nothing acknowledged (`None` with nothing
    /// in flight): a path that stopped carrying datagrams shows here, whatever comes back.
    pub fn unacknowledged_for(&self, now: Instant) -> Option<Duration> {
        (self.in_flight > 0).then(|| now.saturating_duration_since(self.progress_at))
    }

    /// Bytes in flight.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// The RTT estimate.
    pub fn rtt(&self) -> &Rtt {
        &self.rtt
    }

    /// The counters.
    pub fn stats(&self) -> &SenderStats {
        &self.stats
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    pub(crate) fn push_event(&mut self, e: Event) {
        self.events.push_back(e);
    }

    /// The fragment to send next, and whether it is a resend: lost fragments first, then
    /// the oldest queued one-fragment message if a longer message is being sent ahead of
    /// it, then the next fresh fragment in order. A short message (a credit, a tunnelled
    /// connection's 48-byte notification, a small allreduce) so waits for at most one
    /// datagram of a bulk transfer on the same link, not for the rest of its megabytes:
    /// an application that waits for that message before it sends more would otherwise
    /// stall for the whole queue. The third value says the message goes ahead of a
    /// longer one.
    fn next_fragment(&self) -> Option<(FragRef, bool, bool)> {
        if let Some(f) =
            self.retransmit.iter().find(|f| self.msg(f.seq).is_some_and(|m| !m.is_acked(f.index)))
        {
            return Some((*f, true, false));
        }
        let end = self.msg_base + self.msgs.len() as u64;
        for seq in self.fresh.max(self.msg_base)..end {
            if let Some(m) = self.msg(seq) {
                if m.next_fresh < m.frags {
                    if m.next_fresh > 0 || m.frags > 1 {
                        if let Some(small) =
                            self.small.front().copied().filter(|&q| q > seq && self.unsent(q))
                        {
                            return Some((FragRef { seq: small, index: 0 }, false, true));
                        }
                    }
                    return Some((FragRef { seq, index: m.next_fresh }, false, false));
                }
            }
        }
        None
    }

    /// Whether message `seq` is queued and none of it was sent yet.
    fn unsent(&self, seq: u64) -> bool {
        self.msg(seq).is_some_and(|m| m.next_fresh == 0)
    }

    /// Whether a fragment waits to be sent (fresh or resent).
    pub fn has_data(&self) -> bool {
        self.next_fragment().is_some()
    }

    /// Picks the fragment for the next packet, if the window, the pacer and the queue allow
    /// one now and it fits in a datagram of `limit` bytes, and takes it off the queue: the
    /// caller sends it and calls [`on_sent`](Self::on_sent).
    pub fn next_plan(&mut self, now: Instant, limit: usize) -> Option<Plan> {
        // One-fragment messages that went (ahead, in order, or were dropped) leave the list.
        while self.small.front().is_some_and(|&q| !self.unsent(q)) {
            self.small.pop_front();
        }
        let (frag, resend, ahead) = self.next_fragment()?;
        if self.fragment_datagram_len(frag)? > limit {
            return None;
        }
        if self.probes == 0 {
            if self.in_flight + self.max_datagram as u64 > self.cc.window() {
                return None;
            }
            let mss = self.max_datagram;
            if let Some(t) = self.pacer.delay(now, mss as u64, self.cc.window(), self.rtt.get(), mss) {
                self.pacing_until = Some(t);
                return None;
            }
        }
        self.pacing_until = None;
        if resend {
            while let Some(f) = self.retransmit.pop_front() {
                if f == frag {
                    break;
                }
            }
        } else {
            // A message sent ahead of a longer one leaves the fresh fragments to resume
            // where they were.
            if !ahead {
                self.fresh = frag.seq;
            }
            if let Some(m) = self.msg_mut(frag.seq) {
                m.next_fresh += 1;
            }
        }
        let m = self.msg(frag.seq)?;
        let start = frag.index as usize * m.frag_len;
        let len = m.frag_len.min(m.len - start);
        let header = DataHeader { seq: frag.seq, tag: m.tag, total_len: m.len as u64, offset: start as u64 };
        Some(Plan { frag, header, start, len, resend })
    }

    /// Size of the datagram that carries fragment `f` and nothing else.
    fn fragment_datagram_len(&self, f: FragRef) -> Option<usize> {
        let m = self.msg(f.seq)?;
        let start = f.index as usize * m.frag_len;
        let len = m.frag_len.min(m.len - start);
        let header = DataHeader { seq: f.seq, tag: m.tag, total_len: m.len as u64, offset: 0 };
        Some(OVERHEAD + header.encoded_len() + len)
    }

    /// Copies the bytes of a planned fragment into `out` (`plan.len` bytes long).
    pub fn copy_payload(&self, plan: &Plan, out: &mut [u8]) {
        if let Some(m) = self.msg(plan.frag.seq) {
            m.copy_to(plan.start, &mut out[..plan.len]);
        }
    }

    /// Asks for an ack-eliciting packet even without data: after a key update, so that the
    /// peer's acknowledgement shows it holds the new key before the next one (a receiver
    /// that only sends ACKs would otherwise never learn that).
    pub fn request_ping(&mut self) {
        self.ping = true;
    }

    /// Whether the next packet without data should carry a PING.
    pub fn wants_ping(&self) -> bool {
        self.ping
    }

    /// Records that packet [`next_pn`](Self::next_pn) of `size` bytes went out, carrying
    /// `plan`, or a PING, or only an ACK.
    pub fn on_sent(&mut self, now: Instant, size: usize, plan: Option<&Plan>, ping: bool) {
        let pn = self.next_pn;
        self.next_pn += 1;
        self.stats.packets_sent += 1;
        let eliciting = plan.is_some() || ping;
        let entry = eliciting.then(|| {
            if plan.is_some_and(|p| p.resend) {
                self.stats.retransmitted += 1;
            }
            self.ping = false;
            if self.in_flight == 0 {
                self.progress_at = now;
            }
            self.in_flight += size as u64;
            self.last_eliciting = Some(now);
            self.pacer.on_sent(size as u64);
            self.probes = self.probes.saturating_sub(1);
            Sent { time: now, size: size as u32, frag: plan.map(|p| p.frag) }
        });
        // Packets that carry only an ACK are not tracked: nothing would acknowledge them.
        if entry.is_none() && self.sent.is_empty() {
            self.sent_base = pn + 1;
        } else {
            self.sent.push_back(entry);
        }
        debug_assert_eq!(self.sent_base + self.sent.len() as u64, self.next_pn);
    }

    /// Checks an ACK frame against what was sent, without changing anything.
    pub fn check_ack(&self, ack: &AckFrame<'_>) -> Result<(), PlaneError> {
        if ack.largest >= self.next_pn {
            return Err(PlaneError::AckOfUnsent(ack.largest));
        }
        Ok(())
    }

    /// Processes an ACK frame [`check_ack`](Self::check_ack) accepted.
    pub fn on_ack(&mut self, ack: &AckFrame<'_>, now: Instant) {
        let app_limited = !self.has_data() && self.in_flight < self.cc.window();
        let mut newly_acked = false;
        let mut largest_newly: Option<Sent> = None;
        for r in ack.ranges() {
            let lo = r.start.max(self.sent_base);
            let hi = r.end.min(self.sent_base + self.sent.len() as u64);
            for pn in (lo..hi).rev() {
                let Some(s) = self.sent[(pn - self.sent_base) as usize].take() else { continue };
                newly_acked = true;
                self.round.0 += 1;
                if pn == ack.largest {
                    largest_newly = Some(s.clone());
                }
                self.in_flight -= u64::from(s.size);
                self.cc.on_ack(now, s.time, u64::from(s.size), app_limited, self.rtt.get());
                if let Some(f) = s.frag {
                    self.fragment_acked(f);
                }
            }
        }
        if let Some(s) = largest_newly {
            let delay = ack.delay.min(self.max_ack_delay);
            self.rtt.update(now.saturating_duration_since(s.time), delay);
        }
        if self.largest_acked.is_none_or(|l| ack.largest > l) {
            self.largest_acked = Some(ack.largest);
        }
        if newly_acked {
            self.pto_count = 0;
            self.progress_at = now;
        }
        if self.round.0 + self.round.1 >= LOSS_SPAN {
            self.prev_round = std::mem::take(&mut self.round);
        }
        while self.retransmit.front().is_some_and(|f| self.msg(f.seq).is_none_or(|m| m.is_acked(f.index))) {
            self.retransmit.pop_front();
        }
        self.detect_lost(now);
        self.trim();
    }

    fn fragment_acked(&mut self, f: FragRef) {
        let Some(m) = self.msg_mut(f.seq) else { return };
        if m.is_acked(f.index) {
            return;
        }
        m.acked[f.index as usize / 64] |= 1 << (f.index % 64);
        m.unacked -= 1;
        if m.unacked > 0 {
            return;
        }
        let i = (f.seq - self.msg_base) as usize;
        let Some(m) = self.msgs[i].take() else { return };
        self.queued_bytes -= m.len as u64;
        self.events.push_back(Event::Delivered { tag: m.tag, seq: f.seq });
        while let Some(None) = self.msgs.front() {
            self.msgs.pop_front();
            self.msg_base += 1;
        }
        self.fresh = self.fresh.max(self.msg_base);
    }

    fn trim(&mut self) {
        while let Some(None) = self.sent.front() {
            self.sent.pop_front();
            self.sent_base += 1;
        }
    }

    /// Declares lost what the acknowledgements and the clock say is lost, resends its
    /// fragments, and tells the congestion controller once.
    fn detect_lost(&mut self, now: Instant) {
        self.loss_time = None;
        let Some(largest) = self.largest_acked else { return };
        let delay = self.rtt.loss_delay();
        let lost_before = now.checked_sub(delay);
        let mut lost_span: Option<(Instant, Instant)> = None;
        let end = (largest + 1).min(self.sent_base + self.sent.len() as u64);
        for pn in self.sent_base..end {
            let i = (pn - self.sent_base) as usize;
            let Some(s) = &self.sent[i] else { continue };
            let by_count = pn + PACKET_THRESHOLD <= largest;
            let by_time = lost_before.is_some_and(|t| s.time <= t);
            if !(by_count || by_time) {
                let at = s.time + delay;
                self.loss_time = Some(self.loss_time.map_or(at, |l| l.min(at)));
                continue;
            }
            let Some(s) = self.sent[i].take() else { continue };
            self.in_flight -= u64::from(s.size);
            self.stats.lost += 1;
            self.round.1 += 1;
            lost_span = Some(lost_span.map_or((s.time, s.time), |(a, b)| (a.min(s.time), b.max(s.time))));
            match s.frag {
                Some(f) if self.msg(f.seq).is_some_and(|m| !m.is_acked(f.index)) => {
                    self.retransmit.push_back(f);
                }
                Some(_) => {}
                None => self.ping = true,
            }
        }
        if let Some((first, last)) = lost_span {
            // Persistent congestion (RFC 9002 §7.6), approximated by the span of this batch
            // of losses: three probe timeouts' worth of sending all lost.
            let pc = (self.rtt.pto_base() + self.max_ack_delay) * 3;
            let persistent = self.rtt.has_sample() && last.duration_since(first) > pc;
            if !persistent && !self.is_congestive() {
                self.stats.random_loss_events += 1;
            } else {
                let before = self.cc.window();
                self.cc.on_congestion_event(now, last, persistent);
                if self.cc.window() < before {
                    self.stats.congestion_events += 1;
                }
            }
        }
        self.trim();
    }

    /// Whether the losses just detected mean congestion. Always, unless the link tolerates
    /// random loss; then only when a queue stands at the bottleneck or when more than 2% of
    /// the last 1000 to 2000 packets were lost (BBRv2's loss threshold: a policer drops
    /// without queueing). A queue stands when the latest RTT sample (the packets
    /// acknowledged as the loss is found, which queued behind whatever overflowed) exceeds
    /// the minimum by an eighth of it plus three datagrams' time at the current rate: TCP
    /// Veno's test of random against congestive loss (backlog above three packets), with a
    /// margin for jitter on short paths. Loss without either, such as 1% random loss on an
    /// otherwise idle path, leaves the window alone.
    pub fn is_congestive(&self) -> bool {
        if !self.tolerate_random_loss || !self.rtt.has_sample() {
            return true;
        }
        let (acked, lost) = (self.round.0 + self.prev_round.0, self.round.1 + self.prev_round.1);
        if lost * 50 > acked + lost {
            return true;
        }
        let queue = self.rtt.latest().saturating_sub(self.rtt.min());
        let three = self.rtt.get().mul_f64(3.0 * self.max_datagram as f64 / self.cc.window().max(1) as f64);
        queue > self.rtt.min() / 8 + three
    }

    fn pto_deadline(&self) -> Option<Instant> {
        if self.in_flight == 0 {
            return None;
        }
        let base = self.rtt.pto_base() + self.max_ack_delay;
        Some(self.last_eliciting? + base * (1u32 << self.pto_count.min(MAX_PTO_BACKOFF)))
    }

    /// When the loss or probe timer fires next, or the pacer lets a waiting packet go.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let timer = self.loss_time.or_else(|| self.pto_deadline());
        let pacing = self.pacing_until.filter(|_| self.has_data());
        match (timer, pacing) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs whatever timer is due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.pacing_until.is_some_and(|t| t <= now) {
            self.pacing_until = None;
        }
        if let Some(t) = self.loss_time {
            if t <= now {
                self.detect_lost(now);
            }
            return;
        }
        if self.pto_deadline().is_some_and(|t| t <= now) {
            self.pto_count += 1;
            self.stats.ptos += 1;
            self.probes = PROBES;
            // Probe with the oldest fragments still in flight: they stay in flight, and
            // whichever copy is acknowledged first counts.
            let oldest: Vec<FragRef> =
                self.sent.iter().flatten().filter_map(|s| s.frag).take(PROBES as usize).collect();
            if oldest.is_empty() {
                self.ping = true;
            }
            for f in oldest.into_iter().rev() {
                self.retransmit.push_front(f);
            }
            // The timer restarts from now even if no probe can be built.
            self.last_eliciting = Some(now);
        }
    }
}
