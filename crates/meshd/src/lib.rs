//! meshd: start a multi-node GPU job with one identical command on every node.
//!
//! This crate is the IO shell around the sans-IO core in `meshd-proto`. It reads no
//! environment variables of its own (the CLI passes them in its config structs); it reads
//! only what the ranks it starts inherit. It does not link CUDA or NCCL (`meshd-nccl`).
//! - [`interfaces`]: enumerate and classify interfaces, choose the one that reaches peers.
//! - [`transport`]: one quinn endpoint on one UDP port, token authentication bound to TLS.
//! - [`peers`]: the `--peers` syntax (`host[:port]` lists, `@file`, `dns:NAME`, SLURM).
//! - [`mesh`]: interface choice, the UDP port, background name resolution (the mesh's IO).
//! - [`node`]: the actor that owns the `Node` core over the transport, and the library
//!   handle ([`Node::spawn`]).
//! - [`lighthouse`]: a torchft-compatible Lighthouse (gRPC over h2) and its local decider.
//! - [`job`]: `meshd run`'s IO edges: ranks with torchrun's environment, stops, causes.
//! - [`preflight`]: the preflight's TCP listeners and dials.
//! - [`supervisor`]: spawning ranks with torchrun's environment, teardown.
//! - [`collective`]: the QUIC ring allreduce and the ranks' local service (`MESHD_SOCKET`).
//! - [`tunnel`]: the ranks' TCP connections to other nodes carried over meshd's QUIC.
//! - [`nccl_root`]: the NCCL root child process (`meshd __nccl-root`) and its probe.
//! - [`signals`]: SIGINT/SIGTERM watched once, so that every wait of a job ends on them.

pub mod collective;
pub mod files;
pub mod interfaces;
pub mod job;
pub mod lighthouse;
pub mod mesh;
pub mod nccl_root;
pub mod node;
pub mod peers;
pub mod preflight;
pub mod signals;
pub mod supervisor;
pub mod transport;
pub mod tunnel;

pub use meshd_proto as proto;
pub use meshd_proto::plural;
pub use node::{Node, NodeConfig, NodeHandle};

/// A fresh random node id (from the system's secure random source).
pub fn random_node_id() -> proto::NodeId {
    let mut b = [0u8; 16];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).is_err() {
        // No system randomness: time and pid still make ids unique, which is all ids need.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        return proto::NodeId::from_u128(t ^ ((std::process::id() as u128) << 64));
    }
    proto::NodeId(b)
}
