//! meshd's only contact with CUDA and NCCL. Everything is loaded at run time: this crate
//! builds with no CUDA toolkit and runs (returning errors, never panicking) with no GPU,
//! no NVIDIA driver and no libnccl.
//!
//! # What is used for what
//!
//! - **NCCL (`ncclGetVersion`, `ncclGetUniqueId`)**: called through `libc::dlopen`/`dlsym`
//!   on one exact file ([`NcclLib`]), *not* through cudarc. cudarc 0.19.10's NCCL loader
//!   keeps one process-global library, opens it only by bare names (`libnccl.so`,
//!   `libnccl.so.12`, ... but not `libnccl.so.2`, the name every real install and the PyPI
//!   wheel use), cannot be pointed at a path (`MESHD_NCCL_LIB`, a Python site-packages
//!   directory), and panics when the library or a symbol is missing. Two C functions with
//!   plain signatures are simpler and safer to call directly, and `load_from` can then say
//!   exactly which file failed and which symbol it lacked.
//! - **CUDA driver** ([`cuda_info`]): cudarc's dynamically loaded driver API (`cuInit`,
//!   `cuDriverGetVersion`, `cuDeviceGetCount`). Presence of `libcuda.so.1` is checked with
//!   `dlopen` first and every cudarc call is contained in `catch_unwind`.
//! - **Communicators**: `examples/nccl_comm.rs` forms one with cudarc's `Comm::from_rank`.
//!
//! # The unique id and its root
//!
//! `ncclGetUniqueId` starts NCCL's bootstrap root (a listening TCP socket and a thread) in
//! the calling process; it serves one communicator and dies with the process. NCCL latches
//! `NCCL_SOCKET_IFNAME` at its first call, so meshd runs [`serve_root_blocking`] in a
//! dedicated child process with that variable set (`meshd __nccl-root`), reads its
//! `NCCLID <hex>` line and keeps the child alive (its stdin open) until every rank has
//! initialised.
//!
//! Panics from cudarc are caught with `catch_unwind`, which needs the default
//! `panic = "unwind"`; do not build meshd with `panic = "abort"`.
//!
//! The id's bytes (hex form, root address) are plain code in `meshd_proto::nccl_id`,
//! re-exported here as [`UniqueId`]; the root probe is plain TCP in `meshd::nccl_root`.
//!
//! Modules (private; their items are re-exported): `lib_nccl` ([`NcclLib`]), `cuda`
//! ([`cuda_info`]), `root` ([`serve_root_blocking`]), `error` ([`NcclError`]).

mod cuda;
mod error;
mod lib_nccl;
mod root;

pub use cuda::{CudaInfo, cuda_info};
pub use error::{NcclError, nccl_result_name};
pub use lib_nccl::NcclLib;
pub use meshd_proto::nccl_id::{BadHex, UniqueId};
pub use root::serve_root_blocking;
