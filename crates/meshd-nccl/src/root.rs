//! The bootstrap root, served from a dedicated child process (`meshd::nccl_root` spawns it
//! and probes it).

use crate::{NcclLib, UniqueId};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;

/// Body of `meshd __nccl-root`: loads NCCL ([`NcclLib::load`]), gets a unique id (starting
/// the bootstrap root in this process, on the interface `NCCL_SOCKET_IFNAME` names), prints
/// exactly one line `NCCLID <256 hex>` to stdout and flushes, then blocks until stdin reaches
/// EOF (the parent closed it or died) and returns 0. On failure prints
/// `NCCLERR <one line message>` and returns 1.
///
/// The parent must hand the child a pipe as stdin (`/dev/null` means an immediate EOF, and
/// the root would die at once) and keep its write end open until every rank has
/// initialised. Before NCCL is called, file descriptor 1 is pointed at stderr for the rest
/// of the process, so NCCL's own log lines (`NCCL_DEBUG` writes to stdout by default)
/// cannot mix with the protocol line, which goes to the original stdout. NCCL may log to
/// stderr (e.g. a `wrong magic` warning for each of meshd's root probes on NCCL < 2.27).
pub fn serve_root_blocking() -> i32 {
    let mut out = protocol_stdout();
    let result = NcclLib::load().and_then(|lib| lib.unique_id().map(|b| (lib, UniqueId(b))));
    match result {
        Ok((_lib, id)) => {
            if writeln!(out, "NCCLID {}", id.to_hex()).and_then(|()| out.flush()).is_err() {
                return 1;
            }
            drop(out);
            // Keep the process (and NCCL's root thread) alive until stdin closes.
            let mut stdin = std::io::stdin().lock();
            let mut buf = [0u8; 256];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            0
        }
        Err(e) => {
            let msg = e.to_string().replace(['\n', '\r'], " ");
            let _ = writeln!(out, "NCCLERR {msg}").and_then(|()| out.flush());
            1
        }
    }
}

/// A writer on the original stdout, with fd 1 redirected to stderr from now on. Falls back
/// to plain stdout if the descriptors cannot be duplicated.
fn protocol_stdout() -> Box<dyn Write> {
    let _ = std::io::stdout().flush();
    // SAFETY: dup/dup2 on the process's standard descriptors; the new fd is owned by the
    // returned File only.
    unsafe {
        let saved = libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3);
        if saved < 0 {
            return Box::new(std::io::stdout());
        }
        if libc::dup2(2, 1) < 0 {
            libc::close(saved);
            return Box::new(std::io::stdout());
        }
        Box::new(File::from_raw_fd(saved))
    }
}
