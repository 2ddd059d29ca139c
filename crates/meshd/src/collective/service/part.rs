//! A local rank's part of a collective: its request, its buffer (sent, or read and written
//! in place), and whether it gave up.

use super::*;

pub(super) struct Part {
    pub(super) kind: Kind,
    pub(super) data: Data,
    pub(super) global: u32,
    pub(super) reply: oneshot::Sender<Result<Vec<u8>, String>>,
    /// Set when the rank gave up on this request (it timed out, or closed its connection):
    /// nothing is written into its buffer after that.
    pub(super) gave_up: Arc<GaveUp>,
}

/// Whether a rank gave up on its request. The lock is held for every write into the
/// rank's memory, so once [`GaveUp::set`] returned no write is in progress and none comes:
/// the client's connection is closed only then, and the Python client returns from a
/// timed-out call only once it saw that close.
#[derive(Debug, Default)]
pub(super) struct GaveUp(std::sync::Mutex<bool>);

impl GaveUp {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, bool> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the request abandoned, waiting for a write in progress to end.
    pub(super) fn set(&self) {
        *self.lock() = true;
    }

    pub(super) fn is_set(&self) -> bool {
        *self.lock()
    }
}

/// A rank's buffer: sent through the socket, or read and written in place.
pub(super) enum Data {
    Sent(Vec<u8>),
    InPlace(Remote),
}

impl Data {
    pub(super) fn len(&self) -> usize {
        match self {
            Data::Sent(v) => v.len(),
            Data::InPlace(r) => r.len,
        }
    }

    /// Copies `dst.len()` bytes from offset `off`.
    pub(super) fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), String> {
        match self {
            Data::Sent(v) => {
                dst.copy_from_slice(&v[off..off + dst.len()]);
                Ok(())
            }
            Data::InPlace(r) => cma::read(r, off, dst).map_err(|e| cma_error(r, &e)),
        }
    }
}

pub(super) fn cma_error(r: &Remote, e: &std::io::Error) -> String {
    format!("cannot access the {}-byte buffer at {:#x} in process {}: {e}", r.len, r.addr, r.pid)
}

pub(super) struct CollReq {
    pub(super) local: u32,
    pub(super) seq: u64,
    pub(super) part: Part,
}
