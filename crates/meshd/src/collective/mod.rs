//! Collectives that need only meshd's one UDP port: the inter-node ring allreduce
//! ([`ring`]) and the node-local service that ranks reach through `MESHD_SOCKET`
//! ([`service`]), whose socket requests [`request`] parses; the job-wide key-value store's
//! task ([`store`]) runs inside the service.

pub mod buffer;
pub mod cma;
pub mod plane_ring;
pub mod request;
pub mod ring;
pub mod service;
pub mod store;

pub use buffer::CollectiveBuffer;
pub use ring::{CollectiveError, RingNet};
pub use service::{Service, ServiceConfig};
pub use store::StorePeers;
