//! meshd's sans-IO protocol core.
//!
//! Nothing in this crate touches a socket, a clock or a thread: every state machine takes
//! `now` and its inputs as arguments and is drained through `poll_*` methods, in the style
//! of `quinn-proto`. That makes the same code run inside the `meshd` driver (tokio + quinn),
//! inside the seeded simulator (`sim`) with a thousand nodes in one process, and inside a
//! library user's own transport.
//!
//! Modules:
//! - [`id`]: node identity (random, never an address: every GPU host has the same eth0).
//! - [`rng`]: a small seeded PRNG so runs can be replayed from a printed seed.
//! - [`meta`]: what a node says about itself (interfaces, GPUs, versions, job hash, state).
//! - [`wire`]: the versioned, size-bounded postcard frames that travel between nodes.
//! - [`codec`]: the codec under [`wire`] (postcard, decoding bounded in size, length
//!   prefixes), a leaf the cores that only need sizes and bytes use.
//! - [`membership`]: SWIM-style gossip membership with suspicion and rejoin.
//! - [`preflight`]: what each node checked before launch, and the common verdict.
//! - [`rendezvous`]: election of the master and the roster every node acknowledges.
//! - [`node`]: one node's whole job lifecycle (membership, rounds, preflight, launch, Done,
//!   Abort, restarts) as one state machine.
//! - [`plane`]: the AEAD datagram data plane's per-link core (keys, acks, loss, congestion).
//! - [`store`]: the job-wide key-value store: versioned, acknowledged, bounded.
//! - [`ring`]: the ring allreduce schedule (segments, chunks, transfer ids) and the
//!   [`ring::Reduction`] every chunk is applied with.
//! - [`reduce`]: the element-wise reduction kernels (f32, f16, bf16, integers).
//! - [`nccl_id`]: the NCCL unique id's bytes: hex form and the root address inside it.
//! - [`lighthouse`]: torchft's Lighthouse quorum rules (replica groups of a fault-tolerant
//!   job), with quorum ids unique across deciders.
//! - [`sim`]: a deterministic network simulator over the real membership and node cores.

pub mod codec;
pub mod id;
pub mod job_msg;
pub mod lighthouse;
pub mod membership;
pub mod meta;
pub mod nccl_id;
pub mod node;
pub mod plane;
pub mod preflight;
pub mod reduce;
pub mod rendezvous;
pub mod ring;
pub mod rng;
pub mod roster;
pub mod sim;
pub mod store;
pub mod wire;

pub use id::NodeId;
pub use meta::{NodeMeta, NodeState};

/// `n` and `noun`, the noun in the plural unless `n` is 1: `plural(1, "node")` is
/// "1 node", `plural(3, "process")` is "3 processes".
pub fn plural(n: impl Into<u64>, noun: &str) -> String {
    let n: u64 = n.into();
    if n == 1 {
        return format!("1 {noun}");
    }
    let consonant_y =
        noun.strip_suffix('y').and_then(|r| r.chars().last()).is_some_and(|c| !"aeiou".contains(c));
    if consonant_y {
        format!("{n} {}ies", &noun[..noun.len() - 1])
    } else if ["s", "x", "ch", "sh"].iter().any(|e| noun.ends_with(e)) {
        format!("{n} {noun}es")
    } else {
        format!("{n} {noun}s")
    }
}

#[cfg(test)]
mod plural_tests {
    #[test]
    fn plurals() {
        assert_eq!(super::plural(1u32, "node"), "1 node");
        assert_eq!(super::plural(0u32, "node"), "0 nodes");
        assert_eq!(super::plural(3u64, "process"), "3 processes");
        assert_eq!(super::plural(2u32, "retry"), "2 retries");
        assert_eq!(super::plural(2u32, "key"), "2 keys");
    }
}
