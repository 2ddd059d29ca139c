//! `meshd bench allreduce`: the same line on every node runs the QUIC ring allreduce
//! across the mesh and prints an nccl-tests style table (size, time, algbw, busbw).

use crate::run::{self, JobArgs};
use anyhow::{Context, Result, bail};
use meshd::collective::RingNet;
use meshd::mesh::{Mesh, MeshInput};
use meshd::proto::membership::MemberEvent;
use meshd::proto::reduce::{DType, ReduceOp};
use serde_json::json;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(clap::Subcommand, Debug)]
pub enum Which {
    /// Ring allreduce over QUIC (float32 sum), sizes from 1 KiB to 256 MiB.
    Allreduce(Args),
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub job: JobArgs,
    /// One size in bytes instead of the 1 KiB..256 MiB sweep.
    #[arg(long)]
    pub size: Option<usize>,
    /// Timed iterations per size (default: more for small sizes).
    #[arg(long)]
    pub iters: Option<u32>,
    /// Largest size of the sweep, in bytes.
    #[arg(long, default_value_t = 256 << 20)]
    pub max_size: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Also measure the bare QUIC ring (no framing, no reduction): the transport's ceiling.
    #[arg(long)]
    pub ceiling: bool,
}

#[derive(Debug)]
struct Row {
    bytes: usize,
    iters: u32,
    time_s: f64,
    /// This process's CPU seconds (user + system) per GB one link carried.
    cpu_per_gb: f64,
    /// UDP datagrams per send system call to the next node (GSO batching).
    batch: f64,
}

/// Datagrams per send call between two snapshots of the next link's stats.
fn batching(ring: &RingNet, before: Option<meshd::transport::PathStats>) -> f64 {
    match (before, ring.next_link_stats()) {
        (Some(a), Some(b)) if b.tx_calls > a.tx_calls => {
            (b.tx_datagrams - a.tx_datagrams) as f64 / (b.tx_calls - a.tx_calls) as f64
        }
        _ => f64::NAN,
    }
}

/// The bare ring's bandwidth per link and CPU seconds per GB.
#[derive(Debug, Clone, Copy)]
struct Ceiling {
    gbs: f64,
    cpu_per_gb: f64,
    batch: f64,
}

/// CPU seconds (user + system) this process has used. On a shared machine wall time
/// depends on the neighbours; CPU per byte much less so.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return f64::NAN;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

async fn sweep(
    mut ring: RingNet,
    sizes: Vec<usize>,
    iters: Option<u32>,
    ceiling: bool,
) -> Result<(Vec<Row>, Option<Ceiling>)> {
    let n = ring.world();
    let rank = ring.rank();
    let mut op = 0u64;
    let mut rows = Vec::new();
    let mut sync = vec![0u8; 8];
    for bytes in sizes {
        let elems = bytes / 4;
        let mut buf = vec![0u8; elems * 4];
        // Check the result once per size: every node contributes rank + 1.
        for c in buf.chunks_exact_mut(4) {
            c.copy_from_slice(&((rank + 1) as f32).to_le_bytes());
        }
        op += 1;
        ring.allreduce(op, &mut buf, DType::F32, ReduceOp::Sum).await?;
        let want = (n * (n + 1) / 2) as f32;
        if let Some(bad) =
            buf.chunks_exact(4).position(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want)
        {
            bail!("wrong allreduce result at element {bad} of {elems} ({bytes} bytes): expected {want}");
        }
        let iters = iters.unwrap_or_else(|| {
            if bytes <= 1 << 20 { 20 } else { ((64usize << 20) / bytes).clamp(2, 20) as u32 }
        });
        op += 1;
        ring.allreduce(op, &mut sync, DType::I64, ReduceOp::Sum).await?; // align the start
        let t = Instant::now();
        let cpu = cpu_seconds();
        let link = ring.next_link_stats();
        for _ in 0..iters {
            op += 1;
            ring.allreduce(op, &mut buf, DType::F32, ReduceOp::Sum).await?;
        }
        let link_gb = (elems * 4 * 2 * (n - 1)) as f64 / n.max(1) as f64 * iters as f64 / 1e9;
        let cpu_per_gb = if n > 1 { (cpu_seconds() - cpu) / link_gb } else { 0.0 };
        rows.push(Row {
            bytes: elems * 4,
            iters,
            time_s: t.elapsed().as_secs_f64() / iters as f64,
            cpu_per_gb,
            batch: batching(&ring, link),
        });
    }
    // The bare ring: the bytes one link carries in an allreduce of the largest size.
    let ceil = if ceiling && n > 1 {
        let largest = rows.last().map(|r| r.bytes).unwrap_or(0);
        let per_link = largest * 2 * (n - 1) / n;
        op += 1;
        ring.allreduce(op, &mut sync, DType::I64, ReduceOp::Sum).await?;
        op += 1;
        let cpu = cpu_seconds();
        let link = ring.next_link_stats();
        let t = ring.stream_ceiling(op, per_link).await?;
        let gb = per_link as f64 / 1e9;
        let batch = batching(&ring, link);
        Some(Ceiling { gbs: gb / t.as_secs_f64(), cpu_per_gb: (cpu_seconds() - cpu) / gb, batch })
    } else {
        None
    };
    Ok((rows, ceil))
}

pub async fn main(which: Which) -> Result<ExitCode> {
    let Which::Allreduce(a) = which;
    let p = run::prepare(&a.job, &["meshd-bench-allreduce".to_string()])?;
    let mut mesh = Mesh::start(p.mesh).await?;
    let incoming = mesh.transport().take_data_streams().context("data streams already taken")?;
    let master_port = meshd::job::free_tcp_port(mesh.addr().ip()).unwrap_or(29500);
    let roster = mesh.rendezvous(0, p.job.rdzv.clone(), master_port, p.job.rdzv_timeout).await?;
    mesh.set_master(roster.master().map(|m| m.id));
    let rank = roster.node_rank(mesh.node()).context("not in the roster")?;
    let addrs: Vec<_> = roster.members.iter().map(|m| m.addr).collect();
    let n = addrs.len();
    let ring = RingNet::new(
        mesh.transport().clone(),
        rank,
        addrs.clone(),
        std::sync::Arc::new(tokio::sync::Mutex::new(incoming)),
    );
    let sizes: Vec<usize> = match a.size {
        Some(s) => vec![s.max(4)],
        None => {
            std::iter::successors(Some(1024usize), |s| Some(s * 4)).take_while(|s| *s <= a.max_size).collect()
        }
    };
    let task = tokio::spawn(sweep(ring, sizes, a.iters, a.ceiling));
    tokio::pin!(task);
    // Keep the mesh alive (answer probes) while the ring runs; a dead member ends the bench.
    let (rows, ceiling) = loop {
        tokio::select! {
            r = &mut task => break r.context("bench task")??,
            input = mesh.next(None) => match input {
                Some(MeshInput::Member(MemberEvent::Down(id) | MemberEvent::Left(id))) if roster.node_rank(id).is_some() => {
                    bail!("node {id} stopped answering during the benchmark");
                }
                None => bail!("the mesh transport stopped"),
                _ => {}
            },
        }
    };
    let path = if n > 1 { mesh.transport().path_stats(addrs[(rank + 1) % n]) } else { None };
    meshd::job::finish_together(&mut mesh, &roster, Duration::from_secs(3)).await;
    mesh.shutdown().await;
    let factor = if n > 1 { 2.0 * (n as f64 - 1.0) / n as f64 } else { 0.0 };
    if a.json {
        let results: Vec<_> = rows
            .iter()
            .map(|r| {
                let alg = r.bytes as f64 / r.time_s / 1e9;
                json!({"bytes": r.bytes, "iters": r.iters, "time_s": r.time_s, "algbw_gbs": alg, "busbw_gbs": alg * factor, "cpu_s_per_gb": r.cpu_per_gb, "datagrams_per_send": r.batch})
            })
            .collect();
        println!(
            "{}",
            json!({"nodes": n, "rank": rank, "dtype": "float32", "op": "sum", "results": results, "ceiling_gbs": ceiling.map(|c| c.gbs), "ceiling_cpu_s_per_gb": ceiling.map(|c| c.cpu_per_gb), "ceiling_datagrams_per_send": ceiling.map(|c| c.batch),
                "path": path.map(|p| json!({"mtu": p.mtu, "rtt_us": p.rtt.as_micros() as u64, "sent_packets": p.sent_packets, "lost_packets": p.lost_packets, "congestion_events": p.congestion_events}))})
        );
    } else {
        println!("# meshd ring allreduce over QUIC: {n} nodes, this node rank {rank}, float32 sum");
        println!(
            "# {:>12} {:>10} {:>6} {:>12} {:>10} {:>10} {:>10} {:>8}",
            "size(B)", "count", "iters", "time(us)", "algbw", "busbw", "cpu(s/GB)", "dgm/send"
        );
        for r in &rows {
            let alg = r.bytes as f64 / r.time_s / 1e9;
            println!(
                "  {:>12} {:>10} {:>6} {:>12.1} {:>10.3} {:>10.3} {:>10.2} {:>8.1}",
                r.bytes,
                r.bytes / 4,
                r.iters,
                r.time_s * 1e6,
                alg,
                alg * factor,
                r.cpu_per_gb,
                r.batch
            );
        }
        println!(
            "# algbw, busbw in GB/s; busbw = algbw * 2(n-1)/n; cpu = this process's CPU seconds per GB one link carried; dgm/send = UDP datagrams per send call to the next node (GSO batching)"
        );
        if let Some(c) = ceiling {
            println!(
                "# bare QUIC ring (no framing, no reduction), per link: {:.3} GB/s, {:.2} CPU s/GB, {:.1} datagrams per send call",
                c.gbs, c.cpu_per_gb, c.batch
            );
        }
        if let Some(p) = path {
            println!(
                "# path to the next node: UDP payload {} B (MTU discovery), rtt {} us, {} of {} packets lost, {} congestion events",
                p.mtu,
                p.rtt.as_micros(),
                p.lost_packets,
                p.sent_packets,
                p.congestion_events
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
