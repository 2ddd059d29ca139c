//! The NCCL unique id's root process.
//!
//! `ncclGetUniqueId` starts the bootstrap root thread in the calling process and picks its
//! interface once, from NCCL_SOCKET_IFNAME, at the process's first NCCL call. So the master
//! runs it in a child (`meshd __nccl-root`) started with `NCCL_SOCKET_IFNAME==IFACE`; the
//! child prints the id and stays alive while its stdin pipe is open, which is as long as
//! this [`NcclRoot`] lives: the whole launch round, so every rank's init finds the root.
//!
//! The id is parsed with `meshd_proto::nccl_id` and its root probed here with plain TCP
//! ([`probe_root`]): this crate never links CUDA or NCCL; only the child does.

use meshd_proto::nccl_id::UniqueId;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

/// A running root: the id and the child that serves it.
#[derive(Debug)]
pub struct NcclRoot {
    /// The 128-byte unique id.
    pub id: Vec<u8>,
    _child: tokio::process::Child,
    _helper: Helper,
}

/// Unregisters the helper's pid when the root process is dropped (and killed).
#[derive(Debug)]
struct Helper(i32);

impl Drop for Helper {
    fn drop(&mut self) {
        crate::supervisor::orphans::unregister_helper(self.0);
    }
}

/// Why the NCCL root process gave no id. Io errors are part of the message, not a source
/// (the id's note prints one line).
#[derive(Debug, thiserror::Error)]
pub enum NcclRootError {
    /// meshd's own executable is not to be found.
    #[error("cannot find the meshd executable: {0}")]
    Exe(std::io::Error),
    /// The child could not be started.
    #[error("cannot start the NCCL root process: {0}")]
    Spawn(std::io::Error),
    /// The child has no stdout to read.
    #[error("no stdout from the NCCL root process")]
    NoStdout,
    /// The child said nothing in time.
    #[error("the NCCL root process gave no id within {0:?}")]
    Timeout(Duration),
    /// Its stdout could not be read.
    #[error("{0}")]
    Read(std::io::Error),
    /// It ended without a line.
    #[error("the NCCL root process exited without an id")]
    Exited,
    /// Its id does not parse.
    #[error("{0}")]
    BadId(String),
    /// NCCL's own error, as the child reported it.
    #[error("{0}")]
    Nccl(String),
}

impl NcclRoot {
    /// Starts `meshd __nccl-root` bound to `iface` and waits (bounded) for its id.
    pub async fn spawn(iface: &str, timeout: Duration) -> Result<NcclRoot, NcclRootError> {
        let exe = std::env::current_exe().map_err(NcclRootError::Exe)?;
        let mut cmd = tokio::process::Command::new(exe);
        // The token is meshd's alone: no child process sees it.
        cmd.env_remove("MESHD_TOKEN");
        cmd.arg("__nccl-root")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        // The root process inherits meshd's environment: the user's NCCL_SOCKET_IFNAME wins.
        if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
            cmd.env("NCCL_SOCKET_IFNAME", format!("={iface}"));
        }
        let mut child = cmd.spawn().map_err(NcclRootError::Spawn)?;
        let pid = child.id().map(|p| p as i32).unwrap_or(0);
        // meshd's own: not an orphan of a rank (crate::supervisor::orphans).
        crate::supervisor::orphans::register_helper(pid);
        let guard = Helper(pid);
        let stdout = child.stdout.take().ok_or(NcclRootError::NoStdout)?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(timeout, lines.next_line())
            .await
            .map_err(|_| NcclRootError::Timeout(timeout))?
            .map_err(NcclRootError::Read)?
            .ok_or(NcclRootError::Exited)?;
        if let Some(hex) = line.strip_prefix("NCCLID ") {
            let id = UniqueId::from_hex(hex.trim()).map_err(|e| NcclRootError::BadId(e.to_string()))?;
            Ok(NcclRoot { id: id.0.to_vec(), _child: child, _helper: guard })
        } else {
            Err(NcclRootError::Nccl(line.strip_prefix("NCCLERR ").unwrap_or(&line).to_string()))
        }
    }
}

/// TCP to an NCCL bootstrap root failed. The io error is part of the message, not a
/// source (so an error chain prints it once).
#[derive(Debug, thiserror::Error)]
#[error("NCCL bootstrap root {root} unreachable: {error}")]
pub struct RootProbeError {
    /// The root address.
    pub root: SocketAddr,
    /// The socket error.
    pub error: std::io::Error,
}

/// Eight bytes that are not a magic NCCL would use (ids carry a random magic; NCCL_COMM_ID
/// uses a fixed one that differs from this).
const PROBE_BYTES: [u8; 8] = *b"meshdprb";

/// Probes an NCCL bootstrap root safely on every NCCL version: connects, sends 8 bytes that
/// are not the magic (a bare connect+close kills the root before NCCL 2.27), then closes.
/// `Ok(())` when the TCP connection was established and the bytes were sent. Blocking: run
/// it where blocking is allowed (`spawn_blocking`).
pub fn probe_root(root: SocketAddr, timeout: Duration) -> Result<(), RootProbeError> {
    let err = |error| RootProbeError { root, error };
    let timeout = if timeout.is_zero() { Duration::from_millis(1) } else { timeout };
    let mut s = TcpStream::connect_timeout(&root, timeout).map_err(err)?;
    // A dead root on this host can "answer" through a TCP self-connect (the kernel picked
    // the freed port as our source port): that is no root.
    if s.local_addr().ok() == Some(root) {
        return Err(err(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connected to itself: nothing listens there",
        )));
    }
    s.set_write_timeout(Some(timeout)).map_err(err)?;
    s.set_nodelay(true).map_err(err)?;
    s.write_all(&PROBE_BYTES).map_err(err)?;
    let _ = s.shutdown(Shutdown::Both);
    Ok(())
}
