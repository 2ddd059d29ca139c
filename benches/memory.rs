//! meshd's memory over a long job on the 3-host lab: `meshd run` with the QUIC collective
//! and one rank per host; each rank makes `--ops` allreduces of `--size` bytes through the
//! Python client and reads its meshd's VmRSS at marks (20, 100, 300, 1000, ... ops).
//! Run as root: `cargo bench --bench memory [-- --ops 5000 --size 16777216 --mtu 9000]`.

#[path = "../tests/lab/mod.rs"]
mod lab;

use lab::Lab;
use std::time::Duration;

fn main() {
    if !lab::bench_mode(env!("CARGO_CRATE_NAME")) {
        return;
    }
    let ops: u64 = lab::bench_opt("--ops", 1000);
    let size: usize = lab::bench_opt("--size", 16 << 20);
    let mtu: u32 = lab::bench_opt("--mtu", 9000);
    let mut lab = Lab::new(3);
    if mtu != 1500 {
        lab.set_mtu(mtu);
    }
    let peers = lab.peers();
    println!("memory soak: 3 lab hosts x 1 rank, eth1 MTU {mtu}, {ops} allreduces of {size} bytes");
    let (ops_s, size_s) = (ops.to_string(), size.to_string());
    let job = lab::python_job(
        "/usr/bin/python3",
        &peers,
        3,
        1,
        "quic",
        "client_memory_soak.py",
        &["--ops", &ops_s, "--size", &size_s],
    );
    let args: Vec<&str> = job.iter().map(String::as_str).collect();
    // 6-11 allreduces of 16 MiB a second on the 2-core lab (MTU 1500 / 9000): allow 40 MiB/s.
    let limit = Duration::from_secs(120 + ops * size as u64 / (40 << 20));
    for (host, (code, out, err)) in
        lab.run_on_all(&args, &[("MESHD_LOG", "warn")], limit).into_iter().enumerate()
    {
        match out.lines().find(|l| l.contains("SOAK ")) {
            Some(l) if code == Some(0) => println!("host {host}: {}", l.trim()),
            _ => println!("host {host}: soak failed ({code:?}): {}", err.trim()),
        }
    }
}
