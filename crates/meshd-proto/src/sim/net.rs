//! The simulated network both simulators run on ([`Sim`](super::Sim) over membership cores,
//! [`NodeSim`](super::node::NodeSim) over whole nodes): virtual time, the queue of what
//! happens next, one-way latency, datagram loss and partitions.
//!
//! Virtual time only: the clock is a base [`Instant`] plus an offset that jumps from one
//! event to the next. The randomness is the simulator's own seeded [`Rng`], passed in at
//! each draw, so that a simulator decides the order of its draws and a seed replays.

use crate::id::NodeId;
use crate::rng::Rng;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

/// Something that happens at `at`; `seq` orders what happens at the same time by when it
/// was queued.
#[derive(Debug)]
struct Queued<K> {
    at: Duration,
    seq: u64,
    kind: K,
}

impl<K> PartialEq for Queued<K> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl<K> Eq for Queued<K> {}
impl<K> PartialOrd for Queued<K> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<K> Ord for Queued<K> {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// The network of `nodes` simulated nodes; `K` is what a simulator queues (deliveries,
/// wake-ups, IO results).
#[derive(Debug)]
pub(crate) struct Net<K> {
    base: Instant,
    now: Duration,
    queue: BinaryHeap<Reverse<Queued<K>>>,
    seq: u64,
    /// Partition group of every node (all equal when healed).
    group: Vec<usize>,
    latency: (Duration, Duration),
    loss: f64,
}

impl<K> Net<K> {
    /// A network of `nodes` with one-way latency drawn in `latency` and datagrams lost with
    /// probability `loss`.
    pub fn new(nodes: usize, latency: (Duration, Duration), loss: f64) -> Self {
        Net {
            base: Instant::now(),
            now: Duration::ZERO,
            queue: BinaryHeap::new(),
            seq: 0,
            group: vec![0; nodes],
            latency,
            loss,
        }
    }

    /// Simulated time since the start.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// The [`Instant`] of simulated time `d`.
    pub fn at(&self, d: Duration) -> Instant {
        self.base + d
    }

    /// The simulated time of a core's deadline `t` (never before now).
    pub fn since_start(&self, t: Instant) -> Duration {
        t.saturating_duration_since(self.base).max(self.now)
    }

    /// Queues `kind` for simulated time `at`.
    pub fn push(&mut self, at: Duration, kind: K) {
        self.seq += 1;
        self.queue.push(Reverse(Queued { at, seq: self.seq, kind }));
    }

    /// The next thing due by `end`, the clock moved to it; `None` when nothing is.
    pub fn next_by(&mut self, end: Duration) -> Option<(Duration, K)> {
        if self.queue.peek().is_none_or(|Reverse(q)| q.at > end) {
            return None;
        }
        let Reverse(q) = self.queue.pop()?;
        self.now = self.now.max(q.at);
        Some((q.at, q.kind))
    }

    /// Moves the clock to `end` (after [`Net::next_by`] found nothing more).
    pub fn reach(&mut self, end: Duration) {
        self.now = self.now.max(end);
    }

    /// Splits the network into groups; nodes in none form one more group together.
    pub fn partition(&mut self, groups: &[Vec<usize>]) {
        let mut group = vec![groups.len() + 1; self.group.len()];
        for (g, members) in groups.iter().enumerate() {
            for &i in members {
                if let Some(slot) = group.get_mut(i) {
                    *slot = g;
                }
            }
        }
        self.group = group;
    }

    /// Removes any partition.
    pub fn heal(&mut self) {
        self.group = vec![0; self.group.len()];
    }

    /// Whether `a` and `b` are on the same side of any partition.
    pub fn reachable(&self, a: usize, b: usize) -> bool {
        self.group[a] == self.group[b]
    }

    /// Whether the next datagram is lost (one draw from `rng`).
    pub fn lost(&self, rng: &mut Rng) -> bool {
        rng.unit() < self.loss
    }

    /// A one-way latency (one draw from `rng`).
    pub fn latency(&self, rng: &mut Rng) -> Duration {
        let (lo, hi) = self.latency;
        lo + hi.saturating_sub(lo).mul_f64(rng.unit())
    }
}

/// A simulator driven by [`Net`]'s clock: running for a while and running until something
/// holds are the same for both.
pub(crate) trait Driven {
    /// Simulated time since the start.
    fn sim_now(&self) -> Duration;
    /// The resolution of [`run_until`].
    fn check_interval(&self) -> Duration;
    /// Runs everything due by `end`.
    fn run_to(&mut self, end: Duration);
}

/// Runs `s` until `pred` holds (checked every `check_interval`) or `limit` of simulated time
/// passed; returns the time it took, or `None` on timeout.
pub(crate) fn run_until<S: Driven>(
    s: &mut S,
    limit: Duration,
    mut pred: impl FnMut(&S) -> bool,
) -> Option<Duration> {
    let start = s.sim_now();
    let end = start + limit;
    loop {
        if pred(s) {
            return Some(s.sim_now() - start);
        }
        if s.sim_now() >= end {
            return None;
        }
        let step = (s.sim_now() + s.check_interval()).min(end);
        s.run_to(step);
    }
}

/// A fresh random node id drawn from the simulator's seeded `rng` (high half first).
pub(crate) fn fresh_id(rng: &mut Rng) -> NodeId {
    NodeId::from_u128(((rng.next_u64() as u128) << 64) | rng.next_u64() as u128)
}

/// The part of a simulator's API that is the same for both: `$sim` has `nodes` (each with
/// `id` and `core: Option<_>`), `net: Net<_>`, a `run_to(end)` of its own, and a config in
/// field `$cfg` with `seed` and `check_interval`. Writes those methods and [`Driven`].
macro_rules! simulator_api {
    ($sim:ty, $cfg:ident) => {
        impl $sim {
            /// The seed this run replays from.
            pub fn seed(&self) -> u64 {
                self.$cfg.seed
            }

            /// Simulated time since the start.
            pub fn now(&self) -> Duration {
                self.net.now()
            }

            /// Number of nodes (running or not).
            pub fn len(&self) -> usize {
                self.nodes.len()
            }

            /// Whether the simulation has no nodes.
            pub fn is_empty(&self) -> bool {
                self.nodes.is_empty()
            }

            /// Current id of node `i` (the last one it ran with, if crashed).
            pub fn id(&self, i: usize) -> NodeId {
                self.nodes[i].id
            }

            /// Whether node `i` runs (started, not crashed, not finished).
            pub fn is_running(&self, i: usize) -> bool {
                self.nodes[i].core.is_some()
            }

            /// Splits the network: nodes in different groups cannot reach each other. Nodes
            /// in no group form one more group together.
            pub fn partition(&mut self, groups: &[Vec<usize>]) {
                self.net.partition(groups);
            }

            /// Removes any partition.
            pub fn heal(&mut self) {
                self.net.heal();
            }

            /// Runs for `d` of simulated time.
            pub fn run_for(&mut self, d: Duration) {
                let end = self.net.now() + d;
                self.run_to(end);
            }

            /// Runs until `pred` holds (checked every `check_interval`) or `limit` of
            /// simulated time has passed; returns the time it took, or `None` on timeout.
            pub fn run_until(
                &mut self,
                limit: Duration,
                pred: impl FnMut(&Self) -> bool,
            ) -> Option<Duration> {
                $crate::sim::net::run_until(self, limit, pred)
            }
        }

        impl $crate::sim::net::Driven for $sim {
            fn sim_now(&self) -> Duration {
                self.net.now()
            }

            fn check_interval(&self) -> Duration {
                self.$cfg.check_interval
            }

            fn run_to(&mut self, end: Duration) {
                <$sim>::run_to(self, end)
            }
        }
    };
}
pub(crate) use simulator_api;
