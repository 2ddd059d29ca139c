//! Collectives that need only meshd's one UDP port: the inter-node ring allreduce
//! ([`ring`]) and the node-local service that ranks reach through `MESHD_SOCKET`
//! ([`service`]), whose socket requests [`request`] parses; the service relays the ranks' store requests to
//! the node core, which owns the job-wide key-value store ([`store`]). [`buffer`] holds an operation's bytes and
//! lends chunks of them to QUIC without copying; [`cma`] reads and writes a rank's buffer
//! in place (cross-memory attach).

pub mod buffer;
pub mod cma;
pub mod plane_ring;
pub mod request;
pub mod ring;
pub mod service;
pub mod store;

pub use buffer::CollectiveBuffer;
pub use ring::{CollectiveError, RingConfig, RingNet};
pub use service::{Service, ServiceConfig};
pub use store::{StoreRequest, StoreSender};
