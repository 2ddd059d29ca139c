//! Forms an NCCL communicator the way a meshd-launched rank would, and all-reduces a small
//! f32 buffer: reads MESHD_NCCL_UNIQUE_ID (256 hex), RANK, WORLD_SIZE, LOCAL_RANK, uses
//! cudarc's `Comm::from_rank` on device LOCAL_RANK.
//!
//! Run one process per GPU, e.g. on one node with two GPUs:
//! ```text
//! exec 3< <(cargo run -q -p meshd-nccl --example nccl_root)   # keeps the root alive
//! read -r _ ID <&3
//! for r in 0 1; do MESHD_NCCL_UNIQUE_ID=$ID RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
//!     cargo run -q -p meshd-nccl --example nccl_comm & done; wait
//! ```
//! The root and every rank must load the same NCCL version. cudarc opens libnccl by bare
//! names (`libnccl.so`, not `libnccl.so.2`), so when it cannot find one, this example
//! creates a shim directory holding `libnccl.so -> $MESHD_NCCL_LIB` (or the library
//! `NcclLib::load` finds) and re-executes itself with that directory on `LD_LIBRARY_PATH`.
//!
//! Exit codes: 0 ok, 1 no CUDA driver / GPU / NCCL, 2 bad environment, 3 NCCL or CUDA failed.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

fn env_usize(name: &str, default: Option<usize>) -> Result<usize, String> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map_err(|_| format!("{name}={v:?} is not a number")),
        Err(_) => default.ok_or_else(|| format!("{name} is not set")),
    }
}

/// Makes `libnccl.so` -> `lib` visible to cudarc by re-executing with LD_LIBRARY_PATH.
/// Returns only on failure.
fn reexec_with_shim(lib: &Path) -> String {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let dir = std::env::temp_dir().join(format!("meshd-nccl-shim-{uid}-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return format!("cannot create {}: {e}", dir.display());
    }
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    if let Err(e) = std::os::unix::fs::symlink(lib, &link) {
        return format!("cannot create {}: {e}", link.display());
    }
    let mut ld = dir.clone().into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|v| !v.is_empty()) {
        ld.push(":");
        ld.push(old);
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return format!("cannot find own executable: {e}"),
    };
    let e = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", ld)
        .env("MESHD_NCCL_SHIMMED", &dir)
        .exec();
    format!("re-exec failed: {e}")
}

fn run() -> Result<(), (u8, String)> {
    let bad_env = |m: String| (2, m);
    let hex = std::env::var("MESHD_NCCL_UNIQUE_ID")
        .map_err(|_| bad_env("MESHD_NCCL_UNIQUE_ID is not set".into()))?;
    let id = meshd_nccl::UniqueId::from_hex(&hex).map_err(|e| bad_env(e.to_string()))?;
    let rank = env_usize("RANK", None).map_err(bad_env)?;
    let world = env_usize("WORLD_SIZE", None).map_err(bad_env)?;
    let local_rank = env_usize("LOCAL_RANK", Some(0)).map_err(bad_env)?;
    if rank >= world {
        return Err(bad_env(format!("RANK {rank} >= WORLD_SIZE {world}")));
    }
    println!("rank {rank}/{world} (local {local_rank}): root {:?}", id.root());

    // cudarc must open the same libnccl the root uses: $MESHD_NCCL_LIB when set, else
    // whatever cudarc finds, else what NcclLib::load() finds (through a shim).
    let explicit = std::env::var_os("MESHD_NCCL_LIB").filter(|v| !v.is_empty()).map(PathBuf::from);
    if std::env::var_os("MESHD_NCCL_SHIMMED").is_none() {
        // SAFETY: is_culib_present only tries dlopen on cudarc's candidate names.
        let cudarc_finds = unsafe { cudarc::nccl::sys::is_culib_present() };
        let target = match explicit {
            Some(p) => Some(p),
            None if cudarc_finds => None,
            None => Some(meshd_nccl::NcclLib::load().map_err(|e| (1, e.to_string()))?.path().to_path_buf()),
        };
        if let Some(lib) = target {
            println!("exposing {} to cudarc as libnccl.so", lib.display());
            return Err((1, reexec_with_shim(&lib)));
        }
    }
    let v = std::panic::catch_unwind(cudarc::nccl::result::get_nccl_version)
        .map_err(|_| (1, "cudarc cannot load libnccl (see the panic above)".to_owned()))?
        .map_err(|e| (3, format!("ncclGetVersion failed: ncclResult_t {}", e.0 as i64)))?;
    println!("cudarc loaded NCCL {v}");

    let info = meshd_nccl::cuda_info().map_err(|e| (1, format!("no CUDA driver: {e}")))?;
    println!("CUDA driver {} with {} device(s)", info.driver_version, info.devices);
    if local_rank >= info.devices as usize {
        return Err((1, format!("LOCAL_RANK {local_rank} but only {} CUDA device(s)", info.devices)));
    }

    let out = std::panic::catch_unwind(move || -> Result<Vec<f32>, (u8, String)> {
        use cudarc::driver::CudaContext;
        use cudarc::nccl::{Comm, Id, ReduceOp};
        let cuda = |what: &str, e: cudarc::driver::DriverError| (3, format!("{what}: {e:?}"));
        let ctx = CudaContext::new(local_rank).map_err(|e| cuda("CudaContext::new", e))?;
        let stream = ctx.default_stream();
        let internal = id.0.map(|b| b as std::ffi::c_char);
        // NcclError's Debug hides the code: report the number.
        let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal))
            .map_err(|e| (3, format!("Comm::from_rank failed: ncclResult_t {}", e.0 as i64)))?;
        let host = vec![(rank + 1) as f32; 8];
        let mut buf = stream.clone_htod(&host).map_err(|e| cuda("clone_htod", e))?;
        comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum)
            .map_err(|e| (3, format!("all_reduce failed: ncclResult_t {}", e.0 as i64)))?;
        stream.synchronize().map_err(|e| cuda("synchronize", e))?;
        stream.clone_dtoh(&buf).map_err(|e| cuda("clone_dtoh", e))
    });
    let result = match out {
        Ok(r) => r?,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            return Err((3, format!("cudarc panicked: {}", msg.unwrap_or_default())));
        }
    };
    let expected = (world * (world + 1) / 2) as f32;
    println!("rank {rank}: all_reduce(sum) = {result:?} (expected {expected} each)");
    if result.iter().all(|&x| x == expected) { Ok(()) } else { Err((3, "wrong all-reduce result".into())) }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, msg)) => {
            eprintln!("nccl_comm: {msg}");
            ExitCode::from(code)
        }
    }
}
