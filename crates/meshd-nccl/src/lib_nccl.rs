//! Finding and opening libnccl with `dlopen`, and its two calls meshd needs.

use crate::NcclError;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `ncclResult_t ncclGetVersion(int *version)`.
type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
/// `ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId)` (128 bytes).
type GetUniqueIdFn = unsafe extern "C" fn(*mut u8) -> c_int;

/// How long the Python interpreter may take to list its `sys.path`.
const PYTHON_TIMEOUT: Duration = Duration::from_secs(5);
/// The file the PyPI wheels (`nvidia-nccl-cu12`, `-cu13`) install, relative to site-packages.
const WHEEL_REL: &str = "nvidia/nccl/lib/libnccl.so.2";

/// An opened libnccl: its path, its version and its `ncclGetUniqueId`.
///
/// The library is never closed (`dlclose`): a bootstrap root started by
/// [`NcclLib::unique_id`] runs code from it for the rest of the process.
#[derive(Debug, Clone)]
pub struct NcclLib {
    path: PathBuf,
    version: u32,
    get_unique_id: GetUniqueIdFn,
}

impl NcclLib {
    /// Finds and opens libnccl. Search order:
    /// 1. `$MESHD_NCCL_LIB` (a path to libnccl.so.2): when set, only that file is tried and
    ///    its own error is returned (a wrong explicit path is not papered over);
    /// 2. the dynamic loader's usual paths: `dlopen("libnccl.so.2")`, then `"libnccl.so"`;
    /// 3. the active Python's `nvidia/nccl/lib` (`python3`'s `import nvidia.nccl` and every
    ///    `sys.path` entry, 5 s timeout);
    /// 4. `$VIRTUAL_ENV` and `$CONDA_PREFIX` `lib/python3*/site-packages/nvidia/nccl/lib`.
    ///
    /// The error lists every place tried, in words.
    pub fn load() -> Result<NcclLib, NcclError> {
        if let Some(p) = std::env::var_os("MESHD_NCCL_LIB").filter(|p| !p.is_empty()) {
            return Self::load_from(Path::new(&p));
        }
        let mut tried = vec!["$MESHD_NCCL_LIB (not set)".to_owned()];

        for name in [c"libnccl.so.2", c"libnccl.so"] {
            match dlopen(name) {
                Ok(handle) => {
                    let shown = PathBuf::from(name.to_string_lossy().into_owned());
                    match Self::from_handle(handle, shown, true) {
                        Ok(lib) => return Ok(lib),
                        Err(e) => tried.push(format!("dlopen({name:?}): {e}")),
                    }
                }
                Err(reason) => tried.push(format!("dlopen({name:?}): {reason}")),
            }
        }

        let mut candidates: Vec<PathBuf> = Vec::new();
        match python_dirs() {
            Ok((pkg_dirs, sys_path)) => {
                for d in &pkg_dirs {
                    candidates.push(d.join("lib/libnccl.so.2"));
                }
                for d in &sys_path {
                    candidates.push(d.join(WHEEL_REL));
                }
                tried.push(format!(
                    "python3 (import nvidia.nccl: {}; {} sys.path entries searched for {WHEEL_REL})",
                    if pkg_dirs.is_empty() { "not installed".to_owned() } else { format!("{pkg_dirs:?}") },
                    sys_path.len()
                ));
            }
            Err(why) => tried.push(format!("python3 sys.path: {why}")),
        }
        for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
            match std::env::var_os(var).filter(|v| !v.is_empty()) {
                None => tried.push(format!("${var} (not set)")),
                Some(prefix) => {
                    let found = site_packages(Path::new(&prefix));
                    tried.push(format!(
                        "${var}={}: {} site-packages searched for {WHEEL_REL}",
                        Path::new(&prefix).display(),
                        found.len()
                    ));
                    candidates.extend(found.into_iter().map(|sp| sp.join(WHEEL_REL)));
                }
            }
        }

        let mut seen = std::collections::HashSet::new();
        for c in candidates {
            if !seen.insert(c.clone()) || !c.is_file() {
                continue;
            }
            match Self::load_from(&c) {
                Ok(lib) => return Ok(lib),
                Err(e) => tried.push(e.to_string()),
            }
        }
        Err(NcclError::NotFound { tried })
    }

    /// Opens exactly this file (relative paths are made absolute, so `dlopen` does not
    /// search for them). Errors: no such file, `dlopen` failure, missing NCCL symbol.
    pub fn load_from(path: &Path) -> Result<NcclLib, NcclError> {
        let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        if !abs.is_file() {
            return Err(NcclError::NoSuchFile { path: abs });
        }
        let c = CString::new(abs.as_os_str().as_bytes()).map_err(|_| NcclError::Open {
            path: abs.clone(),
            reason: "path contains a NUL byte".to_owned(),
        })?;
        let handle = dlopen(&c).map_err(|reason| NcclError::Open { path: abs.clone(), reason })?;
        Self::from_handle(handle, abs, false)
    }

    /// Resolves the symbols of an opened library and asks its version. With
    /// `resolve_path`, the real file is found with `dladdr` (for libraries opened by name).
    fn from_handle(handle: *mut c_void, shown: PathBuf, resolve_path: bool) -> Result<Self, NcclError> {
        let get_version = dlsym(handle, c"ncclGetVersion")
            .ok_or_else(|| NcclError::MissingSymbol { path: shown.clone(), symbol: "ncclGetVersion" })?;
        let get_unique_id = dlsym(handle, c"ncclGetUniqueId")
            .ok_or_else(|| NcclError::MissingSymbol { path: shown.clone(), symbol: "ncclGetUniqueId" })?;
        let path = if resolve_path { dladdr_file(get_version).unwrap_or(shown) } else { shown };

        // SAFETY: the symbol is libnccl's `ncclResult_t ncclGetVersion(int*)`; transmuting a
        // non-null data pointer from dlsym to a C function pointer is how dlsym is used.
        let get_version: GetVersionFn =
            unsafe { std::mem::transmute::<*mut c_void, GetVersionFn>(get_version) };
        // SAFETY: as above, `ncclResult_t ncclGetUniqueId(ncclUniqueId*)`, the id being 128
        // bytes with alignment 1 (`char internal[128]`).
        let get_unique_id: GetUniqueIdFn =
            unsafe { std::mem::transmute::<*mut c_void, GetUniqueIdFn>(get_unique_id) };

        let mut v: c_int = 0;
        // SAFETY: ncclGetVersion writes one int through a valid pointer; it starts no threads
        // and reads no environment (NCCL_SOCKET_IFNAME stays unlatched).
        let rc = unsafe { get_version(&mut v) };
        if rc != 0 {
            return Err(NcclError::Nccl { call: "ncclGetVersion", code: rc });
        }
        let version = u32::try_from(v).unwrap_or(0);
        Ok(Self { path, version, get_unique_id })
    }

    /// The file this library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `NCCL_VERSION_CODE`, e.g. 22703 for 2.27.3 (1000*major+100*minor+patch before 2.9).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The version as "major.minor.patch", e.g. "2.27.3".
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }

    /// Calls `ncclGetUniqueId` in THIS process. NCCL then latches its bootstrap interface
    /// (`NCCL_SOCKET_IFNAME` as it is now) and starts the bootstrap root (a listening TCP
    /// socket and a thread) that lives as long as this process and serves one communicator.
    pub fn unique_id(&self) -> Result<[u8; 128], NcclError> {
        let mut id = [0u8; 128];
        // SAFETY: ncclGetUniqueId writes exactly sizeof(ncclUniqueId) = 128 bytes.
        let rc = unsafe { (self.get_unique_id)(id.as_mut_ptr()) };
        if rc != 0 {
            return Err(NcclError::Nccl { call: "ncclGetUniqueId", code: rc });
        }
        Ok(id)
    }
}

/// Formats an `NCCL_VERSION_CODE`.
pub(crate) fn version_string(code: u32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

/// The last `dlerror()` text.
fn dlerror_text() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call
    // on this thread; it is copied at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown dlopen error".to_owned()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// `dlopen(name, RTLD_NOW | RTLD_LOCAL)`. The handle is never closed.
pub(crate) fn dlopen(name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: a valid C string; running the library's initialisers is the point.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() { Err(dlerror_text()) } else { Ok(h) }
}

/// `dlsym`, `None` when absent.
fn dlsym(handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: handle comes from a successful dlopen that is never closed.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if p.is_null() { None } else { Some(p) }
}

/// The file holding `addr` (via `dladdr`).
fn dladdr_file(addr: *mut c_void) -> Option<PathBuf> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: info is a valid out-parameter; dli_fname, when set, points to the loader's
    // NUL-terminated name of a library that stays loaded.
    unsafe {
        if libc::dladdr(addr as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let name: *const c_char = info.dli_fname;
        let s = CStr::from_ptr(name).to_bytes();
        Some(PathBuf::from(std::ffi::OsStr::from_bytes(s)))
    }
}

/// Asks `python3` for its `nvidia.nccl` package directories and its `sys.path`.
fn python_dirs() -> Result<(Vec<PathBuf>, Vec<PathBuf>), String> {
    const SCRIPT: &str = "import sys\n\
        for p in sys.path:\n    print('P', p)\n\
        try:\n    import nvidia.nccl as m\n    for p in list(getattr(m, '__path__', [])):\n        print('N', p)\n\
        except Exception:\n    pass\n";
    let mut cmd = Command::new("python3");
    cmd.env_remove("MESHD_TOKEN");
    cmd.arg("-c").arg(SCRIPT).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
    // A meshd killed (SIGKILL) during the probe must not leave python3 behind. The thread
    // that forks waits for the child below, so the signal cannot fire early.
    // A meshd that died before the prctl sends no signal: the child then gives up.
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl and getppid are async-signal-safe; nothing else runs between fork and
    // exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot run python3: {e}"))?;
    let mut stdout = child.stdout.take().ok_or("no stdout pipe")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + PYTHON_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = reader.join();
                return Err(format!("python3 timed out after {} s", PYTHON_TIMEOUT.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("waiting for python3: {e}")),
        }
    };
    let out = reader.join().map_err(|_| "reader thread failed".to_owned())?;
    if !status.success() {
        return Err(format!("python3 exited with {status}"));
    }
    let (mut pkg, mut path) = (Vec::new(), Vec::new());
    for line in out.lines() {
        if let Some(p) = line.strip_prefix("N ") {
            pkg.push(PathBuf::from(p));
        } else if let Some(p) = line.strip_prefix("P ") {
            if !p.is_empty() {
                path.push(PathBuf::from(p));
            }
        }
    }
    Ok((pkg, path))
}

/// `PREFIX/lib/python3*/site-packages` directories that exist.
fn site_packages(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(prefix.join("lib")) {
        for e in rd.flatten() {
            if e.file_name().as_bytes().starts_with(b"python3") {
                let sp = e.path().join("site-packages");
                if sp.is_dir() {
                    out.push(sp);
                }
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_strings() {
        assert_eq!(version_string(22703), "2.27.3");
        assert_eq!(version_string(23007), "2.30.7");
        assert_eq!(version_string(2804), "2.8.4");
    }
}
