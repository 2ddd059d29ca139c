//! Stand-in for `meshd __nccl-root`: prints `NCCLID <hex>` and keeps the NCCL bootstrap
//! root alive until stdin closes.
//!
//! `NCCL_SOCKET_IFNAME==eth1 cargo run -p meshd-nccl --example nccl_root`

fn main() {
    std::process::exit(meshd_nccl::serve_root_blocking());
}
