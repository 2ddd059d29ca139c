//! The job-wide store as the IO sees it: a relay. The store itself is the node core's
//! (`meshd_proto::node`, created at a round's launch, fed the roster members' store frames,
//! told who finished); a rank's `store_set` / `store_get` through the local service, and the
//! library handle's, become [`StoreRequest`]s to the actor, which hands them to the core as
//! `Input::Store` and sends the core's `Event::StoreReply` back on the request's channel.

use meshd_proto::node::{StoreAnswer, StoreCall};
use tokio::sync::{mpsc, oneshot};

/// One store request on its way to the node core.
#[derive(Debug)]
pub struct StoreRequest {
    /// The restart round it belongs to (a request of a round that is not running is
    /// answered at once: there is no store for it).
    pub round: u32,
    /// What it asks.
    pub call: StoreCall,
    /// Where the answer goes.
    pub reply: oneshot::Sender<StoreAnswer>,
}

/// Where store requests go (the actor).
pub type StoreSender = mpsc::Sender<StoreRequest>;

/// Store requests in flight to the actor at once, per node.
pub const MAX_IN_FLIGHT: usize = 4096;

/// Asks the store of round `round` through `to`; `None` when the node stopped.
pub async fn ask(to: &StoreSender, round: u32, call: StoreCall) -> Option<StoreAnswer> {
    let (reply, rx) = oneshot::channel();
    to.send(StoreRequest { round, call, reply }).await.ok()?;
    rx.await.ok()
}
