//! The job's socket directory: owner-only, unguessable, and swept when its meshd is gone.

use super::*;

/// A default socket path for this job: `sock` in a directory of its own
/// (`meshd-RUN-PORT-PID-RANDOM` in `runtime_dir`, which the CLI takes from
/// `$XDG_RUNTIME_DIR`, else `/tmp`; created owner-only by [`Service::start`]), so the socket
/// is never reachable by another user, not even between its creation and its chmod, and
/// another user cannot guess the name to create it first.
pub fn default_path(runtime_dir: &Path, run_id: &str, port: u16) -> PathBuf {
    let dir = runtime_dir;
    // The default run id already starts with `meshd-`: not twice.
    let run_id = run_id.strip_prefix("meshd-").unwrap_or(run_id);
    let safe: String = run_id.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(40).collect();
    let mut r = [0u8; 8];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut r).is_err() {
        // No system randomness: the time still makes the name unpredictable enough to not
        // be pre-created by chance, and an existing one is refused anyway.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        r = (t as u64).to_le_bytes();
    }
    let random: String = r.iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("meshd-{safe}-{port}-{}-{random}", std::process::id())).join("sock")
}

/// Removes this user's socket directories left by meshd processes that no longer exist (a
/// meshd killed with SIGKILL cannot remove its own). Returns how many it removed.
pub fn sweep_stale(base: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let Ok(entries) = std::fs::read_dir(base) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("meshd-") {
            continue;
        }
        // meshd-RUN-PORT-PID-RANDOM: the pid is the second field from the end, after 16 hex
        // digits (a name of another form, an older meshd's, is never touched).
        let mut fields = name.rsplit('-');
        let random = fields.next().unwrap_or_default();
        if random.len() != 16 || !random.chars().all(|c| c.is_ascii_hexdigit()) {
            continue;
        }
        let Some(pid) = fields.next().and_then(|p| p.parse::<i32>().ok()) else { continue };
        let Ok(m) = std::fs::symlink_metadata(e.path()) else { continue };
        if !m.is_dir() || m.uid() != me || pid <= 0 {
            continue;
        }
        // SAFETY: signal 0 only checks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            // The tunnel's socket and library live there too (tunnel mode).
            for f in ["sock", "tunnel", "libmeshd_preload.so"] {
                let _ = std::fs::remove_file(e.path().join(f));
            }
            if std::fs::remove_dir(e.path()).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

/// Creates `path`'s directory owner-only (0700) when it does not exist and returns it (to
/// remove it later). An existing directory named like [`default_path`]'s must be this
/// user's and owner-only: one made by someone else is refused.
pub(super) fn private_dir(path: &Path) -> std::io::Result<Option<PathBuf>> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let Some(dir) = path.parent() else { return Ok(None) };
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new().mode(0o700).create(dir)?;
            Ok(Some(dir.to_path_buf()))
        }
        Err(e) => Err(e),
        Ok(m) => {
            // SAFETY: geteuid has no preconditions and cannot fail.
            let me = unsafe { libc::geteuid() };
            let ours = m.is_dir() && m.uid() == me && m.mode() & 0o077 == 0;
            let named = dir.file_name().is_some_and(|n| n.to_string_lossy().starts_with("meshd-"));
            if named && !ours {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("{} exists and is not this user's owner-only directory", dir.display()),
                ));
            }
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{default_path, sweep_stale};
    use std::path::Path;

    #[test]
    fn socket_directory_names_meshd_once() {
        let pid = std::process::id();
        let dir = |run: &str| {
            default_path(Path::new("/tmp"), run, 29400)
                .parent()
                .and_then(|d| d.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let a = dir("meshd-0123456789ab");
        assert!(a.starts_with(&format!("meshd-0123456789ab-29400-{pid}-")), "{a}");
        assert!(dir("train-7").starts_with(&format!("meshd-train-7-29400-{pid}-")));
        assert!(default_path(Path::new("/tmp"), "meshd-x", 1).ends_with("sock"));
        // Unpredictable: another user cannot create it first.
        let random = |n: &str| n.rsplit('-').next().unwrap_or_default().to_string();
        assert_eq!(random(&a).len(), 16);
        assert_ne!(random(&a), random(&dir("meshd-0123456789ab")));
    }

    /// Issue 16: a SIGKILLed meshd's socket directory is removed by the next meshd of the
    /// same user; a live process's and another user's are kept.
    #[test]
    fn stale_socket_directories_of_gone_processes_are_swept() {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::temp_dir().join(format!("meshd-sweep-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).expect("base");
        // A pid that does not exist (above the kernel's pid_max default range is unusual:
        // take one that kill(0) says is gone).
        let dead = (4_000_000..4_100_000).find(|p| unsafe { libc::kill(*p, 0) } != 0).expect("a free pid");
        let stale = base.join(format!("meshd-run-29400-{dead}-00112233aabbccdd"));
        let live = base.join(format!("meshd-run-29400-{}-00112233aabbccdd", std::process::id()));
        let other = base.join("not-meshd-1-2-3");
        // An older meshd's name (no random part): its last number is a port, not a pid.
        let older = base.join("meshd-default-29400-1");
        for d in [&stale, &live, &other, &older] {
            std::fs::DirBuilder::new().mode(0o700).create(d).expect("mkdir");
        }
        // A tunnel-mode job's directory also holds the tunnel's socket and library.
        for f in ["sock", "tunnel", "libmeshd_preload.so"] {
            std::fs::write(stale.join(f), b"").expect("file");
        }
        assert_eq!(sweep_stale(&base), 1);
        assert!(!stale.exists() && live.exists() && other.exists() && older.exists());
        let _ = std::fs::remove_dir_all(&base);
    }
}
