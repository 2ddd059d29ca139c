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
//! - [`membership`]: SWIM-style gossip membership with suspicion and rejoin.
//! - [`preflight`]: what each node checked before launch, and the common verdict.
//! - [`rendezvous`]: election of the master and the roster every node acknowledges.
//! - [`sim`]: a deterministic network simulator over the real membership core.

pub mod id;
pub mod membership;
pub mod meta;
pub mod preflight;
pub mod reduce;
pub mod rendezvous;
pub mod ring;
pub mod rng;
pub mod sim;
pub mod wire;

pub use id::NodeId;
pub use meta::{NodeMeta, NodeState};
