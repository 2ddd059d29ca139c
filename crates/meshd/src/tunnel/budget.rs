//! The open files the tunnel may use.

use std::sync::Arc;
use tokio::sync::Semaphore;

/// Open files kept out of the tunnel's [`Budget`]: the ranks' pipes, the service's
/// clients, /proc reads, quinn's socket.
const RESERVED_FILES: usize = 64;

/// The open files the tunnel may use on this node, both ends together: one for each
/// tunnelled connection at each end (the rank's Unix socket at the near end, the TCP
/// connection at the far end). Past it a connection is refused at once (the rank sees
/// ECONNREFUSED, and Gloo and TCPStore retry) rather than failing some other part of meshd
/// with EMFILE.
#[derive(Debug)]
pub struct Budget {
    slots: Arc<Semaphore>,
    capacity: usize,
}

impl Budget {
    /// A budget of `capacity` connections.
    pub fn new(capacity: usize) -> Budget {
        Budget { slots: Arc::new(Semaphore::new(capacity)), capacity }
    }

    /// What this process can hold: its open-files limit, less the files open now and
    /// [`RESERVED_FILES`].
    pub fn for_this_process() -> Budget {
        let limit = crate::files::limit().soft;
        let open = crate::files::open_now().unwrap_or(32);
        Budget::new(limit.saturating_sub(open + RESERVED_FILES).max(8))
    }

    pub(super) fn try_take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_owned().ok()
    }

    /// Connections it holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}
