//! Finding and opening libnccl with `dlopen`, and its two calls meshd needs.

use crate::NcclError;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `ncclResult_t ncclGetVersion(int *version)`.
type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
/// `ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId)` (128 bytes).
type GetUniqueIdFn = unsafe extern "C" fn(*mut u8) -> c_int;

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
    /// 3. the Python environments' `nvidia/nccl/lib` (where `pip install nvidia-nccl-cu12`
    ///    puts it), found WITHOUT starting an interpreter (one start through a pyenv shim or a
    ///    conda on network storage can take seconds): `$PYTHONPATH`, `$VIRTUAL_ENV`,
    ///    `$CONDA_PREFIX`, the environment meshd itself was installed in, each `python3` on
    ///    `PATH` (its venv, or its installation's site- and dist-packages; pyenv's versions),
    ///    and the user site (`~/.local`). See [`python_site_dirs`].
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
        let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let sites = python_site_dirs(&SiteEnv {
            pythonpath: env("PYTHONPATH"),
            virtual_env: env("VIRTUAL_ENV"),
            conda_prefix: env("CONDA_PREFIX"),
            path: env("PATH"),
            home: env("HOME"),
            pyenv_root: env("PYENV_ROOT"),
            exe: std::env::current_exe().ok(),
        });
        for (what, dirs) in &sites {
            tried.push(format!("{what}: {} searched for {WHEEL_REL}", dirs.len()));
            candidates.extend(dirs.iter().map(|d| d.join(WHEEL_REL)));
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

/// Where Python environments live, as the process environment says.
#[derive(Debug, Default, Clone)]
pub(crate) struct SiteEnv {
    pub pythonpath: Option<std::ffi::OsString>,
    pub virtual_env: Option<std::ffi::OsString>,
    pub conda_prefix: Option<std::ffi::OsString>,
    pub path: Option<std::ffi::OsString>,
    pub home: Option<std::ffi::OsString>,
    pub pyenv_root: Option<std::ffi::OsString>,
    pub exe: Option<PathBuf>,
}

/// The site directories an interpreter would search, read from the file system alone,
/// grouped by where they came from (for the "tried" list). Only directories that exist.
pub(crate) fn python_site_dirs(env: &SiteEnv) -> Vec<(String, Vec<PathBuf>)> {
    let mut out: Vec<(String, Vec<PathBuf>)> = Vec::new();
    if let Some(pp) = &env.pythonpath {
        let dirs: Vec<PathBuf> = std::env::split_paths(pp).filter(|d| d.is_dir()).collect();
        out.push(("$PYTHONPATH".into(), dirs));
    }
    for (var, v) in [("VIRTUAL_ENV", &env.virtual_env), ("CONDA_PREFIX", &env.conda_prefix)] {
        match v {
            None => out.push((format!("${var} (not set)"), Vec::new())),
            Some(prefix) => out
                .push((format!("${var}={}", Path::new(prefix).display()), site_packages(Path::new(prefix)))),
        }
    }
    // The environment meshd was installed in (`pip install meshd-launcher`: PREFIX/bin/meshd).
    if let Some(prefix) = env.exe.as_deref().and_then(Path::parent).and_then(Path::parent) {
        out.push((format!("meshd's own environment {}", prefix.display()), site_packages(prefix)));
    }
    // Each python3 on PATH, resolved without running it.
    let mut prefixes: Vec<PathBuf> = Vec::new();
    if let Some(path) = &env.path {
        for dir in std::env::split_paths(path) {
            let py = dir.join("python3");
            if !py.exists() {
                continue;
            }
            if dir.ends_with("shims") {
                // pyenv: every installed version.
                let root = env
                    .pyenv_root
                    .as_ref()
                    .map(PathBuf::from)
                    .or_else(|| dir.parent().map(Path::to_path_buf))
                    .unwrap_or_default();
                if let Ok(rd) = std::fs::read_dir(root.join("versions")) {
                    prefixes.extend(rd.flatten().map(|e| e.path()));
                }
                continue;
            }
            // A venv: PREFIX/bin/python3 with PREFIX/pyvenv.cfg (python3 a symlink out of it).
            if let Some(prefix) = dir.parent().filter(|p| p.join("pyvenv.cfg").is_file()) {
                prefixes.push(prefix.to_path_buf());
                continue;
            }
            if let Some(prefix) =
                py.canonicalize().ok().as_deref().and_then(Path::parent).and_then(Path::parent)
            {
                prefixes.push(prefix.to_path_buf());
                // Debian and Ubuntu: pip's installs go to /usr/local.
                prefixes.push(prefix.join("local"));
            }
        }
    }
    prefixes.dedup();
    let on_path: Vec<PathBuf> = prefixes.iter().flat_map(|p| site_packages(p)).collect();
    out.push(("python3 on PATH (no interpreter started)".into(), on_path));
    if let Some(home) = &env.home {
        out.push(("the user site ~/.local".into(), site_packages(&Path::new(home).join(".local"))));
    }
    out
}

/// `PREFIX/lib/python3*/{site,dist}-packages` directories that exist.
fn site_packages(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(prefix.join("lib")) {
        for e in rd.flatten() {
            if e.file_name().as_bytes().starts_with(b"python3") {
                for sub in ["site-packages", "dist-packages"] {
                    let sp = e.path().join(sub);
                    if sp.is_dir() {
                        out.push(sp);
                    }
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

    /// A venv, a conda prefix and a Debian-style /usr/local found from the file system
    /// alone: the layouts `pip install nvidia-nccl-cu12` leaves.
    #[test]
    fn site_dirs_are_found_without_an_interpreter() {
        let base = std::env::temp_dir().join(format!("meshd-sites-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let venv = base.join("venv");
        std::fs::create_dir_all(venv.join("bin")).expect("mkdir");
        std::fs::create_dir_all(venv.join("lib/python3.12/site-packages")).expect("mkdir");
        std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").expect("cfg");
        std::fs::write(venv.join("bin/python3"), "").expect("py");
        let conda = base.join("conda");
        std::fs::create_dir_all(conda.join("lib/python3.11/site-packages")).expect("mkdir");
        let env = SiteEnv {
            path: Some(venv.join("bin").into_os_string()),
            conda_prefix: Some(conda.clone().into_os_string()),
            ..SiteEnv::default()
        };
        let all: Vec<PathBuf> = python_site_dirs(&env).into_iter().flat_map(|(_, d)| d).collect();
        assert!(all.contains(&venv.join("lib/python3.12/site-packages")), "{all:?}");
        assert!(all.contains(&conda.join("lib/python3.11/site-packages")), "{all:?}");
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn version_strings() {
        assert_eq!(version_string(22703), "2.27.3");
        assert_eq!(version_string(23007), "2.30.7");
        assert_eq!(version_string(2804), "2.8.4");
    }
}
