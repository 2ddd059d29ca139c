//! The preload library the ranks load (`libmeshd_preload.so`): its embedded bytes, and
//! where they are written for the ranks.

use std::path::{Path, PathBuf};
use tracing::warn;

/// `libmeshd_preload.so`, built from crates/meshd-preload by build.rs.
pub const PRELOAD: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libmeshd_preload.so"));

/// The preload library (`libmeshd_preload.so`) as the ranks load it; dropping it removes
/// the copy meshd wrote. The tunnel's ranks load it, and so do the ranks of
/// `--fault-tolerance node` (for `gethostname`, crates/meshd-preload's `host`).
#[derive(Debug)]
pub struct Preload {
    path: PathBuf,
    wrote: bool,
}

impl Preload {
    /// Where the ranks load the library from: `given` when set, else the embedded bytes
    /// written to `dir` (owner-only), else (when `dir` is on a noexec mount, where the
    /// dynamic loader cannot map it) `libmeshd_preload.so` next to the meshd executable.
    pub fn write(dir: &Path, given: Option<&Path>) -> std::io::Result<Preload> {
        if let Some(p) = given {
            return Ok(Preload { path: p.to_path_buf(), wrote: false });
        }
        if noexec(dir) {
            if let Some(beside) = std::env::current_exe()
                .ok()
                .map(|e| e.with_file_name("libmeshd_preload.so"))
                .filter(|p| p.exists())
            {
                return Ok(Preload { path: beside, wrote: false });
            }
            warn!(
                "{} is on a noexec mount: the ranks cannot load meshd's preload library from there; set \
                 MESHD_PRELOAD_LIB, or XDG_RUNTIME_DIR to a directory that allows it",
                dir.display()
            );
        }
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let lib = dir.join("libmeshd_preload.so");
        let _ = std::fs::remove_file(&lib);
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o500).open(&lib)?;
        f.write_all(PRELOAD)?;
        Ok(Preload { path: lib, wrote: true })
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `LD_PRELOAD` for the ranks: the library first, then `user_preload`.
    pub fn env(&self, user_preload: Option<&str>) -> (String, String) {
        let lib = self.path.display().to_string();
        let preload = match user_preload.filter(|p| !p.trim().is_empty()) {
            Some(u) => format!("{lib}:{u}"),
            None => lib,
        };
        ("LD_PRELOAD".into(), preload)
    }
}

impl Drop for Preload {
    fn drop(&mut self) {
        if self.wrote {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn noexec(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: statvfs writes into a zeroed struct of the right type; `c` is NUL-terminated.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        libc::statvfs(c.as_ptr(), &mut s) == 0 && s.f_flag & libc::ST_NOEXEC != 0
    }
}
