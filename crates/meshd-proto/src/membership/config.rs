//! Tuning of the membership protocol and the fixed bounds on its state.

use crate::codec as wire;
use std::time::Duration;

/// Most members (any status, self included) a node keeps; beyond it new ids are refused
/// unless a Dead/Left entry can be evicted.
pub const MAX_MEMBERS: usize = 10_000;
/// Largest encoded metadata accepted from a peer.
pub const MAX_META: usize = 8 * 1024;
/// Largest full-state sync message we build (the wire refuses frames over 4 MiB).
pub const MAX_SYNC_BYTES: usize = wire::MAX_FRAME - 64 * 1024;

pub(super) const MAX_SEEDS: usize = 64;
pub(super) const MAX_RELAYS: usize = 1024;
pub(super) const MAX_TRANSMITS: usize = 16 * 1024;
/// Most stale-update corrections answered to one message.
pub(super) const MAX_CORRECTIONS: usize = 8;
pub(super) const MAX_EVENTS: usize = 4 * MAX_MEMBERS;
/// Lambda in "each update is sent lambda * log N times".
pub(super) const RETRANSMIT_MULT: u32 = 4;
/// Independent confirmations that bring a suspicion down to its minimum timeout.
pub(super) const MAX_CONFIRMATIONS: usize = 3;
/// Bytes of a datagram left free for the transport's frame wrapper.
pub(super) const DATAGRAM_SLACK: usize = 8;
/// Delay of the first sync after joining; the next two double it.
pub(super) const JOIN_RESYNC: Duration = Duration::from_millis(250);
pub(super) const JOIN_RESYNCS: u32 = 3;
/// Dead/Left entries are checked for expiry at most this often.
pub(super) const REAP_EVERY: Duration = Duration::from_secs(1);

/// Tuning of the membership protocol. The defaults target a LAN: a crash known everywhere
/// within seconds, and no false verdicts under datagram loss (the `sim_report` example
/// measures both; its figures are in RELIABILITY.md).
#[derive(Clone, Debug, PartialEq)]
pub struct MembershipConfig {
    /// Period of the failure detector: one member is probed per period.
    pub probe_interval: Duration,
    /// Wait for a direct ack before asking others to probe indirectly.
    pub probe_timeout: Duration,
    /// Members asked to probe indirectly when the direct probe times out.
    pub indirect_probes: usize,
    /// Period of push gossip (only sent while there are updates to disseminate).
    pub gossip_interval: Duration,
    /// Members each push gossip round goes to.
    pub gossip_fanout: usize,
    /// Suspicion timeout multiplier (Lifeguard): `mult x max(1, log10 N) x probe_interval`.
    pub suspicion_mult: u32,
    /// Period of full-state push-pull with a random member (scaled up over 32 members) and
    /// of the rejoin attempt towards seeds and dead members that are not alive.
    pub sync_interval: Duration,
    /// How long Dead and Left members stay in the table (and in syncs) before forgotten.
    pub dead_retention: Duration,
    /// Largest encoded [`Message`] sent with [`Delivery::Datagram`].
    pub max_datagram: usize,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            probe_interval: Duration::from_millis(400),
            probe_timeout: Duration::from_millis(150),
            indirect_probes: 3,
            gossip_interval: Duration::from_millis(100),
            gossip_fanout: 3,
            // 2.0 s for a suspicion without confirmations, 1.0 s with all of them: a
            // node starved of CPU for a second (2 cores, 8 ranks importing torch) refutes
            // in time; at 2 (0.4-0.8 s) such a node was declared dead and the job stopped.
            suspicion_mult: 5,
            sync_interval: Duration::from_secs(10),
            dead_retention: Duration::from_secs(120),
            max_datagram: 1100,
        }
    }
}

impl MembershipConfig {
    /// The same configuration with values that would make the core spin or never send
    /// anything raised to workable minimums.
    pub(super) fn sanitized(mut self) -> Self {
        let ms = Duration::from_millis;
        self.probe_interval = self.probe_interval.max(ms(10));
        self.probe_timeout = self.probe_timeout.min(self.probe_interval);
        self.gossip_interval = self.gossip_interval.max(ms(1));
        self.sync_interval = self.sync_interval.max(ms(100));
        self.suspicion_mult = self.suspicion_mult.max(1);
        self.max_datagram = self.max_datagram.max(256);
        self
    }
}
