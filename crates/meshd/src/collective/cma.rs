//! Cross-memory attach: meshd reads a local rank's buffer and writes the result back in
//! place (`process_vm_readv` / `process_vm_writev`), one copy each way, instead of sending
//! the bytes through the Unix socket (two copies each way, plus meshd's own buffers).
//! MPI libraries move large intra-node messages the same way.
//!
//! The process is the socket peer's pid as the kernel reports it (`SO_PEERCRED`), never a
//! number the client sends, so a client can only point meshd at its own memory. The kernel
//! checks the access as it would for ptrace: same user, and under Yama's `ptrace_scope` 1
//! meshd must be an ancestor of the rank (`meshd run` is its parent). Where the kernel
//! refuses, the connection's hello probe fails and the client sends payloads instead.

use std::io;

/// A buffer in a local rank's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    /// The rank's process (from the socket's peer credentials).
    pub pid: i32,
    /// Start address in that process.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
}

fn transfer(r: &Remote, off: usize, local: *mut u8, n: usize, write: bool) -> io::Result<()> {
    if off.checked_add(n).is_none_or(|end| end > r.len) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "range outside the rank's buffer"));
    }
    let mut done = 0usize;
    while done < n {
        let left = n - done;
        let at =
            r.addr.checked_add((off + done) as u64).ok_or_else(|| io::Error::other("address overflow"))?;
        let liov = libc::iovec { iov_base: local.wrapping_add(done).cast(), iov_len: left };
        let riov = libc::iovec { iov_base: at as usize as *mut libc::c_void, iov_len: left };
        // SAFETY: `local..local + n` is memory we own (the callers pass a slice); the remote
        // range is checked by the kernel, which fails with EFAULT rather than touching
        // anything outside the other process's mappings.
        let got = unsafe {
            if write {
                libc::process_vm_writev(r.pid, &liov, 1, &riov, 1, 0)
            } else {
                libc::process_vm_readv(r.pid, &liov, 1, &riov, 1, 0)
            }
        };
        match got {
            -1 => {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "no bytes moved")),
            k => done += k as usize,
        }
    }
    Ok(())
}

/// Copies `dst.len()` bytes at offset `off` of the rank's buffer into `dst`.
pub fn read(r: &Remote, off: usize, dst: &mut [u8]) -> io::Result<()> {
    transfer(r, off, dst.as_mut_ptr(), dst.len(), false)
}

/// Copies `src` to offset `off` of the rank's buffer.
pub fn write(r: &Remote, off: usize, src: &[u8]) -> io::Result<()> {
    // process_vm_writev only reads the local side.
    transfer(r, off, src.as_ptr().cast_mut(), src.len(), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_this_process() {
        let pid = std::process::id() as i32;
        let mut theirs = vec![7u8; 100];
        let r = Remote { pid, addr: theirs.as_mut_ptr() as u64, len: theirs.len() };
        let mut mine = [0u8; 10];
        read(&r, 90, &mut mine).expect("read");
        assert_eq!(mine, [7; 10]);
        write(&r, 5, &[1, 2, 3]).expect("write");
        assert_eq!(&theirs[4..9], &[7, 1, 2, 3, 7]);
        assert!(read(&r, 95, &mut mine).is_err(), "past the end");
        assert!(write(&r, usize::MAX, &[1]).is_err(), "overflow");
    }

    #[test]
    fn unmapped_memory_is_an_error_not_a_crash() {
        let r = Remote { pid: std::process::id() as i32, addr: 8, len: 4096 };
        let err = read(&r, 0, &mut [0u8; 16]).expect_err("out of range");
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
    }
}
