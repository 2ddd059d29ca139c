//! Tests against a real libnccl when `MESHD_NCCL_LIB` is set (CI:
//! `MESHD_REQUIRE_NCCL=1 MESHD_NCCL_LIB=$(scripts/fetch-nccl.sh)`), and the error paths
//! that need no NCCL, no GPU and no driver.
//!
//! Child processes are this test binary itself, re-run with `MESHD_NCCL_TEST_CHILD=root`
//! and the filter `child_entry`: that test then calls `serve_root_blocking` and exits.

use meshd::nccl_root::probe_root;
use meshd_nccl::{NcclError, NcclLib, UniqueId, cuda_info};
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "MESHD_NCCL_TEST_CHILD";

/// The library to test with, or `None` after a loud SKIPPED line. Panics when
/// `MESHD_REQUIRE_NCCL` is set but `MESHD_NCCL_LIB` is not.
fn nccl_lib_path(test: &str) -> Option<PathBuf> {
    match std::env::var_os("MESHD_NCCL_LIB").filter(|v| !v.is_empty()) {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            let msg = format!("SKIPPED {test}: MESHD_NCCL_LIB not set (run scripts/fetch-nccl.sh)");
            // Straight to fd 2, not eprintln!: the harness captures the print macros of
            // passing tests, and this line must be seen.
            let _ = writeln!(std::io::stderr(), "\n*** {msg} ***");
            let required =
                std::env::var("MESHD_REQUIRE_NCCL").map(|v| !v.is_empty() && v != "0").unwrap_or(false);
            assert!(!required, "MESHD_REQUIRE_NCCL is set but MESHD_NCCL_LIB is not: {msg}");
            None
        }
    }
}

/// Child side: `serve_root_blocking` in a process of its own. A no-op in the parent.
#[test]
fn child_entry() {
    if std::env::var(CHILD_ENV).as_deref() == Ok("root") {
        let code = meshd_nccl::serve_root_blocking();
        std::process::exit(code);
    }
}

/// Starts this binary as a root server child with extra environment.
fn spawn_root_child(envs: &[(&str, Option<&str>)]) -> Child {
    let exe = std::env::current_exe().expect("own test binary");
    let mut cmd = Command::new(exe);
    cmd.args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "root")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in envs {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd.spawn().expect("spawn root child")
}

/// Reads the child's stdout until a `NCCLID `/`NCCLERR ` line (other lines, such as the
/// test harness's, are skipped). Times out after 30 s.
fn protocol_line(child: &mut Child) -> String {
    let stdout = child.stdout.take().expect("stdout piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // Here the harness's unterminated "test child_entry ... " precedes the line;
            // meshd's own child prints nothing before it.
            if let Some(i) = line.find("NCCLID ").or_else(|| line.find("NCCLERR ")) {
                let _ = tx.send(line[i..].to_owned());
                break;
            }
        }
        // Keep draining so the child never blocks on a full pipe.
    });
    rx.recv_timeout(Duration::from_secs(30)).expect("child printed NCCLID/NCCLERR within 30 s")
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn check_root(root: Option<SocketAddr>) -> SocketAddr {
    let root = root.expect("root decodes to an IPv4/IPv6 address");
    assert_ne!(root.port(), 0, "root port must be nonzero: {root}");
    assert!(!root.ip().is_unspecified(), "root address unspecified: {root}");
    root
}

#[test]
fn real_nccl_version_unique_id_and_probe() {
    let Some(path) = nccl_lib_path("real_nccl_version_unique_id_and_probe") else { return };
    let lib = NcclLib::load_from(&path).expect("load MESHD_NCCL_LIB");
    assert!(lib.version() > 0);
    assert!(lib.version_string().starts_with("2."), "{}", lib.version_string());
    assert!(lib.path().is_absolute());
    // load() honours MESHD_NCCL_LIB.
    let via_env = NcclLib::load().expect("load() with MESHD_NCCL_LIB set");
    assert_eq!(via_env.version(), lib.version());

    let id = UniqueId(lib.unique_id().expect("ncclGetUniqueId"));
    let root = check_root(id.root());
    eprintln!(
        "NCCL {} ({}) at {}: id root {root}",
        lib.version_string(),
        lib.version(),
        lib.path().display()
    );
    // The root lives as long as this process: probing (several times) must keep it alive.
    for _ in 0..3 {
        probe_root(root, Duration::from_secs(5)).expect("probe root");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Each call gives a fresh root and a fresh magic.
    let id2 = UniqueId(lib.unique_id().expect("second ncclGetUniqueId"));
    assert!(!id.same_as(&id2));
    let back = UniqueId::from_hex(&id.to_hex()).expect("hex");
    assert!(back.same_as(&id));
}

#[test]
fn real_serve_root_child_lifecycle() {
    let Some(path) = nccl_lib_path("real_serve_root_child_lifecycle") else { return };
    let p = path.to_string_lossy().into_owned();
    let mut child = spawn_root_child(&[("MESHD_NCCL_LIB", Some(&p))]);
    let line = protocol_line(&mut child);
    let hex = line.strip_prefix("NCCLID ").unwrap_or_else(|| panic!("child failed: {line}"));
    assert_eq!(hex.len(), 256);
    let id = UniqueId::from_hex(hex).expect("hex from child");
    let root = check_root(id.root());
    eprintln!("serve_root_blocking child: root {root}");
    probe_root(root, Duration::from_secs(5)).expect("probe child's root");
    probe_root(root, Duration::from_secs(5)).expect("root still alive after a probe");
    // Still alive while stdin is open.
    std::thread::sleep(Duration::from_millis(200));
    assert!(child.try_wait().expect("try_wait").is_none(), "child exited before stdin closed");
    drop(child.stdin.take());
    let st = wait_exit(&mut child, Duration::from_secs(10));
    assert!(st.success(), "child exit status {st}");
    // The root died with the child.
    assert!(probe_root(root, Duration::from_secs(2)).is_err(), "root still reachable after child exit");
}

fn root_with_ifname(path: &Path, ifname: &str) -> SocketAddr {
    let p = path.to_string_lossy().into_owned();
    let mut child = spawn_root_child(&[("MESHD_NCCL_LIB", Some(&p)), ("NCCL_SOCKET_IFNAME", Some(ifname))]);
    let line = protocol_line(&mut child);
    let hex = line.strip_prefix("NCCLID ").unwrap_or_else(|| panic!("child failed: {line}"));
    let root = check_root(UniqueId::from_hex(hex).expect("hex").root());
    probe_root(root, Duration::from_secs(5)).expect("probe");
    drop(child.stdin.take());
    assert!(wait_exit(&mut child, Duration::from_secs(10)).success());
    root
}

#[test]
fn real_socket_ifname_lo_gives_loopback_root() {
    let Some(path) = nccl_lib_path("real_socket_ifname_lo_gives_loopback_root") else { return };
    for ifname in ["lo", "=lo"] {
        let root = root_with_ifname(&path, ifname);
        eprintln!("NCCL_SOCKET_IFNAME={ifname}: root {root}");
        assert_eq!(root.ip(), IpAddr::V4(Ipv4Addr::LOCALHOST), "NCCL_SOCKET_IFNAME={ifname}");
    }
}

/// A fake site-packages holding `nvidia/nccl/lib/libnccl.so.2 -> lib`.
fn fake_site_packages(base: &Path, lib: &Path) -> PathBuf {
    let sp = base.join("lib/python3.99/site-packages");
    let dir = sp.join("nvidia/nccl/lib");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let link = dir.join("libnccl.so.2");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(lib, &link).expect("symlink");
    sp
}

/// load() without MESHD_NCCL_LIB, in a child; returns the id's root or the error line.
fn load_in_child(envs: &[(&str, Option<&str>)]) -> Result<SocketAddr, String> {
    let mut all: Vec<(&str, Option<&str>)> = vec![("MESHD_NCCL_LIB", None)];
    all.extend_from_slice(envs);
    let mut child = spawn_root_child(&all);
    let line = protocol_line(&mut child);
    drop(child.stdin.take());
    let st = wait_exit(&mut child, Duration::from_secs(10));
    match line.strip_prefix("NCCLID ") {
        Some(hex) => {
            assert!(st.success());
            Ok(check_root(UniqueId::from_hex(hex).expect("hex").root()))
        }
        None => Err(line),
    }
}

#[test]
fn real_load_finds_python_wheel_layouts() {
    let Some(path) = nccl_lib_path("real_load_finds_python_wheel_layouts") else { return };
    let lib = std::path::absolute(&path).expect("absolute");
    let base = std::env::temp_dir().join(format!("meshd-nccl-venv-{}", std::process::id()));
    let sp = fake_site_packages(&base.join("venv"), &lib);
    let venv = base.join("venv").to_string_lossy().into_owned();
    // $VIRTUAL_ENV/lib/python3*/site-packages
    let r = load_in_child(&[("VIRTUAL_ENV", Some(&venv)), ("CONDA_PREFIX", None)]);
    assert!(r.is_ok(), "VIRTUAL_ENV layout not found: {r:?}");
    // $CONDA_PREFIX likewise
    let r = load_in_child(&[("VIRTUAL_ENV", None), ("CONDA_PREFIX", Some(&venv))]);
    assert!(r.is_ok(), "CONDA_PREFIX layout not found: {r:?}");
    // python3's sys.path (PYTHONPATH adds an entry)
    let sp_s = sp.to_string_lossy().into_owned();
    let r = load_in_child(&[("VIRTUAL_ENV", None), ("CONDA_PREFIX", None), ("PYTHONPATH", Some(&sp_s))]);
    assert!(r.is_ok(), "sys.path layout not found: {r:?}");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn serve_root_reports_errors_as_ncclerr() {
    let mut child = spawn_root_child(&[("MESHD_NCCL_LIB", Some("/nonexistent/libnccl.so.2"))]);
    let line = protocol_line(&mut child);
    assert!(line.starts_with("NCCLERR "), "{line}");
    assert!(line.contains("/nonexistent/libnccl.so.2"), "{line}");
    let st = wait_exit(&mut child, Duration::from_secs(10));
    assert_eq!(st.code(), Some(1));
}

#[test]
fn load_without_env_searches_everywhere_or_finds_one() {
    // Whatever this host has, load() must answer (not hang, not panic) and, when it finds
    // nothing, list every place it tried. Done in a child so the environment can differ.
    let mut child = spawn_root_child(&[("MESHD_NCCL_LIB", None), ("VIRTUAL_ENV", Some("/nonexistent-venv"))]);
    let line = protocol_line(&mut child);
    eprintln!("load() without MESHD_NCCL_LIB: {line}");
    if let Some(msg) = line.strip_prefix("NCCLERR ") {
        for needle in [
            "libnccl not found",
            "MESHD_NCCL_LIB",
            "libnccl.so.2",
            "python3",
            "/nonexistent-venv",
            "CONDA_PREFIX",
            "pip install nvidia-nccl-cu12",
        ] {
            assert!(msg.contains(needle), "missing {needle:?} in {msg}");
        }
        assert_eq!(wait_exit(&mut child, Duration::from_secs(10)).code(), Some(1));
    } else {
        drop(child.stdin.take());
        assert!(wait_exit(&mut child, Duration::from_secs(10)).success());
    }
}

#[test]
fn load_from_nonexistent_path_is_a_clean_error() {
    let e = NcclLib::load_from(Path::new("/nonexistent/dir/libnccl.so.2")).expect_err("must fail");
    assert!(matches!(e, NcclError::NoSuchFile { .. }), "{e:?}");
    assert!(e.to_string().contains("/nonexistent/dir/libnccl.so.2: no such file"), "{e}");
}

/// The path of the libc this process runs on, from /proc/self/maps.
fn libc_path() -> PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("/libc.so") || p.contains("/libc-"))
        .map(PathBuf::from)
        .expect("libc in /proc/self/maps")
}

#[test]
fn load_from_non_nccl_library_names_missing_symbol() {
    let libc = libc_path();
    let e = NcclLib::load_from(&libc).expect_err("libc is not NCCL");
    assert!(matches!(e, NcclError::MissingSymbol { symbol: "ncclGetVersion", .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("ncclGetVersion") && msg.contains("is not libnccl"), "{msg}");
}

#[test]
fn load_from_non_library_file_is_a_clean_error() {
    let dir = std::env::temp_dir().join(format!("meshd-nccl-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let f = dir.join("libnccl.so.2");
    std::fs::write(&f, b"not an ELF file").expect("write");
    let e = NcclLib::load_from(&f).expect_err("garbage is not a library");
    assert!(matches!(e, NcclError::Open { .. }), "{e:?}");
    eprintln!("{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cuda_info_never_panics() {
    match cuda_info() {
        Ok(info) => eprintln!("CUDA driver {} with {} device(s)", info.driver_version, info.devices),
        Err(e) => {
            eprintln!("cuda_info: {e}");
            let driver_present = {
                // SAFETY: plain dlopen probe of the driver library.
                let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
                !h.is_null()
            };
            if !driver_present {
                assert!(matches!(e, NcclError::NoDriver { .. }), "{e:?}");
                assert!(
                    e.to_string().starts_with("libcuda.so.1 not found: no NVIDIA driver on this host"),
                    "{e}"
                );
            }
        }
    }
    // Twice: the second call must behave the same (no poisoned state).
    let _ = cuda_info();
}

/// A loopback TCP port that is bound but not listening (connects are refused, and the
/// kernel cannot hand it out as an ephemeral source port meanwhile).
fn bound_not_listening() -> (std::os::fd::OwnedFd, SocketAddr) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket/bind/getsockname on a fresh descriptor owned by the OwnedFd.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket");
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut sa: libc::sockaddr_in = std::mem::zeroed();
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_addr.s_addr = u32::from(Ipv4Addr::LOCALHOST).to_be();
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        assert_eq!(libc::bind(fd, (&raw const sa).cast(), len), 0, "bind");
        let mut out: libc::sockaddr_in = std::mem::zeroed();
        let mut olen = len;
        assert_eq!(libc::getsockname(fd, (&raw mut out).cast(), &mut olen), 0, "getsockname");
        (owned, SocketAddr::from((Ipv4Addr::LOCALHOST, u16::from_be(out.sin_port))))
    }
}

#[test]
fn probe_of_closed_port_fails_cleanly() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    probe_root(addr, Duration::from_secs(2)).expect("probe of a listening socket");
    drop(l);
    let (_fd, closed) = bound_not_listening();
    let e = probe_root(closed, Duration::from_secs(2)).expect_err("nothing listens there");
    assert_eq!(e.root, closed, "{e:?}");
    assert!(e.to_string().contains(&closed.to_string()), "{e}");
}

/// Issue 24: finding libnccl starts no interpreter (a pyenv shim or a conda on network
/// storage can take seconds to start): a `python3` on PATH that records being run is never
/// run, and a wheel's library in the venv of that `python3` is still found.
#[test]
fn load_starts_no_interpreter_and_finds_the_venv_of_python3_on_path() {
    let base = std::env::temp_dir().join(format!("meshd-nccl-nopy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let venv = base.join("venv");
    std::fs::create_dir_all(venv.join("bin")).expect("mkdir");
    std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").expect("cfg");
    let marker = base.join("python-was-run");
    let py = venv.join("bin/python3");
    std::fs::write(&py, format!("#!/bin/sh\ntouch {}\nexec /usr/bin/python3 \"$@\"\n", marker.display()))
        .expect("py");
    std::fs::set_permissions(&py, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let path = format!("{}:/usr/bin:/bin", venv.join("bin").display());
    let env = [
        ("MESHD_NCCL_LIB", None),
        ("VIRTUAL_ENV", None),
        ("CONDA_PREFIX", None),
        ("PYTHONPATH", None),
        ("PATH", Some(path.as_str())),
    ];
    let r = load_in_child(&env);
    assert!(!marker.exists(), "load() ran python3");
    // With a wheel's library in that venv, it is found (still without running python3).
    if let Some(lib) = nccl_lib_path("load_starts_no_interpreter_and_finds_the_venv_of_python3_on_path") {
        let lib = std::path::absolute(&lib).expect("absolute");
        let sp = venv.join("lib/python3.99/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&sp).expect("mkdir");
        std::os::unix::fs::symlink(&lib, sp.join("libnccl.so.2")).expect("symlink");
        let r = load_in_child(&env);
        assert!(r.is_ok(), "the venv of python3 on PATH was not searched: {r:?}");
        assert!(!marker.exists(), "load() ran python3");
    } else {
        assert!(r.is_err(), "{r:?}");
    }
    let _ = std::fs::remove_dir_all(&base);
}
