//! `meshd bench allreduce`: the same line on every node runs the QUIC ring allreduce
//! across the mesh and prints an nccl-tests style table (size, time, algbw, busbw).

use crate::run::{self, JobArgs};
use anyhow::{Context, Result, bail};
use meshd::collective::plane_ring::Served;
use meshd::collective::{CollectiveBuffer, RingNet};
use meshd::proto::reduce::{DType, ReduceOp};
use meshd::{Node, NodeConfig};
use serde_json::json;
use std::process::ExitCode;
use std::time::Instant;

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
    /// With --ceiling: rounds of the largest size, each followed by one bare ring (so both
    /// see the same load); the per-round ratios are printed.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// QUIC connections this node sends over to the next node (default: MESHD_LANES, or
    /// one per two runtime threads). Both the ring and the bare ring use them.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=meshd_proto::wire::MAX_LANES as i64))]
    pub lanes: Option<u8>,
    /// Run the allreduce on a plain slice, copying each chunk it sends, instead of on a
    /// buffer whose chunks are lent to QUIC without copying: to measure what lending saves.
    #[arg(long)]
    pub copy: bool,
    /// Path of the ring's chunks: `auto` (the data plane where the next node's plane link
    /// works, else QUIC streams), `streams` (QUIC streams only), or `both` (each size
    /// twice in the same run, plane first, then streams).
    #[arg(long, default_value = "auto", value_parser = ["auto", "streams", "both"])]
    pub plane: String,
}

#[derive(Debug)]
struct Row {
    bytes: usize,
    iters: u32,
    time_s: f64,
    /// This process's CPU seconds (user + system) per GB one link carried.
    cpu_per_gb: f64,
    /// Packet batching on both links.
    batch: Batching,
    /// Which path carried the ring's chunks to the next node.
    served: String,
}

/// Snapshots of both ring links' QUIC counters.
type Links = (Option<meshd::transport::PathStats>, Option<meshd::transport::PathStats>);

fn links(ring: &RingNet) -> Links {
    (ring.next_link_stats(), ring.prev_link_stats())
}

/// Packet batching between two snapshots: UDP datagrams per send call to the next node
/// (GSO), and ACK frames sent back per datagram received from the previous node.
#[derive(Debug, Clone, Copy)]
struct Batching {
    tx_per_call: f64,
    acks_per_rx: f64,
}

/// `(a_after - a_before) / (b_after - b_before)`, from `(after, before)` pairs. Counters
/// summed over a link's connections go down when one of its lanes was closed or replaced
/// between the snapshots: NaN then (no figure), as when nothing was counted.
fn delta_ratio((a1, a0): (u64, u64), (b1, b0): (u64, u64)) -> f64 {
    match (a1.checked_sub(a0), b1.checked_sub(b0)) {
        (Some(a), Some(b)) if b > 0 => a as f64 / b as f64,
        _ => f64::NAN,
    }
}

fn batching(ring: &RingNet, before: Links) -> Batching {
    let (next, prev) = links(ring);
    let (tx_per_call, acks_per_rx) = match (before, next, prev) {
        ((Some(na), Some(pa)), Some(nb), Some(pb)) => (
            delta_ratio((nb.tx_datagrams, na.tx_datagrams), (nb.tx_calls, na.tx_calls)),
            delta_ratio((pb.acks_sent, pa.acks_sent), (pb.rx_datagrams, pa.rx_datagrams)),
        ),
        _ => (f64::NAN, f64::NAN),
    };
    Batching { tx_per_call, acks_per_rx }
}

/// The bare ring's bandwidth per link and CPU seconds per GB.
#[derive(Debug, Clone)]
struct Ceiling {
    gbs: f64,
    cpu_per_gb: f64,
    batch: Batching,
    /// Ring busbw / bare ring bandwidth, one per round.
    ratios: Vec<f64>,
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

/// This process's peak resident memory in MiB (every row of the run, the buffers included).
fn peak_rss_mib() -> f64 {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return f64::NAN;
    }
    ru.ru_maxrss as f64 / 1024.0
}

/// One timed measurement: wall seconds, CPU seconds and batching.
struct Timed {
    secs: f64,
    cpu: f64,
    batch: Batching,
}

/// One allreduce of `buf`: lending its chunks to QUIC, or with `copy` as a plain slice.
async fn allreduce(ring: &mut RingNet, op: u64, buf: &mut CollectiveBuffer, copy: bool) -> Result<()> {
    if copy {
        let slice = buf.try_as_mut().context("the buffer is still lent")?;
        ring.allreduce(op, slice, DType::F32, ReduceOp::Sum).await?;
    } else {
        ring.allreduce_buffer(op, buf, DType::F32, ReduceOp::Sum).await?;
    }
    Ok(())
}

/// `iters` allreduces of `buf`, started together on every node.
async fn timed_ring(
    ring: &mut RingNet,
    op: &mut u64,
    buf: &mut CollectiveBuffer,
    iters: u32,
    copy: bool,
) -> Result<Timed> {
    align(ring, op).await?;
    let (t, cpu, link) = (Instant::now(), cpu_seconds(), links(ring));
    for _ in 0..iters {
        *op += 1;
        allreduce(ring, *op, buf, copy).await?;
    }
    Ok(Timed { secs: t.elapsed().as_secs_f64(), cpu: cpu_seconds() - cpu, batch: batching(ring, link) })
}

/// The bare ring carrying `per_link` bytes per link, started together on every node.
async fn timed_ceiling(ring: &mut RingNet, op: &mut u64, per_link: usize) -> Result<Timed> {
    // As large as the transfer (not one small block sent again and again), so the bytes
    // come from memory as a ring's do.
    let data = vec![0x5au8; per_link];
    align(ring, op).await?;
    *op += 1;
    let (cpu, link) = (cpu_seconds(), links(ring));
    let t = ring.stream_ceiling(*op, data).await?;
    Ok(Timed { secs: t.as_secs_f64(), cpu: cpu_seconds() - cpu, batch: batching(ring, link) })
}

/// A tiny allreduce so that every node starts the next measurement at the same time.
async fn align(ring: &mut RingNet, op: &mut u64) -> Result<()> {
    let mut sync = [0u8; 8];
    *op += 1;
    ring.allreduce(*op, &mut sync, DType::I64, ReduceOp::Sum).await?;
    Ok(())
}

/// Which path served the operations between two readings of [`RingNet::served`].
fn served_since(before: Served, after: Served) -> String {
    Served { datagrams: after.datagrams - before.datagrams, streams: after.streams - before.streams }.line()
}

async fn sweep(
    mut ring: RingNet,
    sizes: Vec<usize>,
    iters: Option<u32>,
    ceiling: Option<u32>,
    copy: bool,
    paths: Vec<bool>,
) -> Result<(Vec<Row>, Option<Ceiling>)> {
    let n = ring.world();
    let rank = ring.rank();
    let mut op = 0u64;
    let mut rows = Vec::new();
    let mut ceil = None;
    let count = sizes.len();
    for (i, bytes) in sizes.into_iter().enumerate() {
        for &plane in &paths {
            ring.use_plane = plane;
            let before = ring.served();
            let elems = bytes / 4;
            let mut buf = CollectiveBuffer::zeroed(elems * 4);
            // Check the result once per size: every node contributes rank + 1.
            for c in buf.reset(elems * 4).chunks_exact_mut(4) {
                c.copy_from_slice(&((rank + 1) as f32).to_le_bytes());
            }
            op += 1;
            allreduce(&mut ring, op, &mut buf, copy).await?;
            let want = (n * (n + 1) / 2) as f32;
            if let Some(bad) = buf
                .as_slice()
                .chunks_exact(4)
                .position(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want)
            {
                bail!("wrong allreduce result at element {bad} of {elems} ({bytes} bytes): expected {want}");
            }
            let iters = iters.unwrap_or_else(|| {
                if bytes <= 1 << 20 { 20 } else { ((64usize << 20) / bytes).clamp(2, 20) as u32 }
            });
            let link_gb = (elems * 4 * 2 * (n - 1)) as f64 / n.max(1) as f64 / 1e9;
            // At the largest size, the bare ring runs between rounds of the real one, so both
            // see the same neighbours' load; each round gives one ratio.
            let rounds = match ceiling {
                Some(r) if i + 1 == count && n > 1 => r.max(1),
                _ => 1,
            };
            let (mut secs, mut cpu, mut batch) = (0.0, 0.0, None);
            let (mut c_secs, mut c_cpu, mut c_batch, mut ratios) = (0.0, 0.0, None, Vec::new());
            for _ in 0..rounds {
                let r = timed_ring(&mut ring, &mut op, &mut buf, iters, copy).await?;
                (secs, cpu) = (secs + r.secs, cpu + r.cpu);
                batch.get_or_insert(r.batch);
                if ceiling.is_some() && i + 1 == count && n > 1 {
                    let c = timed_ceiling(&mut ring, &mut op, (link_gb * 1e9) as usize).await?;
                    (c_secs, c_cpu) = (c_secs + c.secs, c_cpu + c.cpu);
                    c_batch.get_or_insert(c.batch);
                    ratios.push((link_gb * iters as f64 / r.secs) / (link_gb / c.secs));
                }
            }
            let total = iters * rounds;
            rows.push(Row {
                bytes: elems * 4,
                iters: total,
                time_s: secs / total as f64,
                cpu_per_gb: if n > 1 { cpu / (link_gb * total as f64) } else { 0.0 },
                batch: batch.expect("at least one round"),
                served: served_since(before, ring.served()),
            });
            if let Some(batch) = c_batch {
                let gb = link_gb * rounds as f64;
                ceil = Some(Ceiling { gbs: gb / c_secs, cpu_per_gb: c_cpu / gb, batch, ratios });
            }
        }
    }
    Ok((rows, ceil))
}

pub async fn main(which: Which, env: &crate::env::EnvConfig) -> Result<ExitCode> {
    let Which::Allreduce(a) = which;
    let mut p = run::prepare(&a.job, &["meshd-bench-allreduce".to_string()], env)?;
    // Asked to measure the data plane: run it whatever the interface's MTU.
    if a.plane == "both" && p.mesh.plane.is_none() {
        p.mesh.plane = Some(true);
    }
    // `--lanes` sets the data plane's lanes too.
    if let Some(l) = a.lanes.and_then(|l| std::num::NonZeroUsize::new(l.into())) {
        p.mesh.plane_lanes = Some(l);
    }
    let mut cfg = NodeConfig::new(p.mesh);
    cfg.rdzv = p.job.rdzv.clone();
    cfg.rdzv_timeout = p.job.rdzv_timeout;
    cfg.preflight = p.job.preflight.clone();
    cfg.make_nccl_id = true;
    cfg.ring = p.job.ring.clone();
    let mut node = Node::spawn(cfg).await?;
    let roster = node.roster().await?;
    let rank = roster.node_rank(node.id()).context("not in the roster")?;
    let addrs: Vec<_> = roster.members.iter().map(|m| m.addr).collect();
    let n = addrs.len();
    let mut ring: RingNet = node.ring().context("no roster")?;
    // clap takes 1..=MAX_LANES only.
    if let Some(l) = a.lanes.and_then(|l| std::num::NonZeroUsize::new(l.into())) {
        ring.lanes = l;
    }
    let lanes = ring.lanes.get();
    let sizes: Vec<usize> = match a.size {
        Some(s) => vec![s.max(4)],
        None => {
            std::iter::successors(Some(1024usize), |s| Some(s * 4)).take_while(|s| *s <= a.max_size).collect()
        }
    };
    let paths = match a.plane.as_str() {
        "streams" => vec![false],
        "both" => vec![true, false],
        _ => vec![true],
    };
    let task = tokio::spawn(sweep(ring, sizes, a.iters, a.ceiling.then_some(a.rounds), a.copy, paths));
    tokio::pin!(task);
    // The node's actor answers probes meanwhile; a member that dies ends the round.
    let (rows, ceiling) = tokio::select! {
        r = &mut task => r.context("bench task")??,
        (why, _) = node.failed() => bail!("{why} during the benchmark"),
    };
    let path = if n > 1 { node.transport().path_stats(addrs[(rank + 1) % n]) } else { None };
    let plane_counters = node.transport().plane().map(|p| p.counters());
    let plane =
        if n > 1 { node.transport().plane().and_then(|p| p.link_stats(addrs[(rank + 1) % n])) } else { None };
    // Lanes the plane sends on to the next node, and each one's packets sent.
    let plane_lanes: Vec<u64> = match node.transport().plane() {
        Some(p) if n > 1 => {
            let next = addrs[(rank + 1) % n];
            (0..p.ready_lanes(next))
                .map(|l| p.lane_stats(next, l as u8).map_or(0, |s| s.sender.packets_sent))
                .collect()
        }
        _ => Vec::new(),
    };
    node.finish().await?;
    let factor = if n > 1 { 2.0 * (n as f64 - 1.0) / n as f64 } else { 0.0 };
    if a.json {
        let results: Vec<_> = rows
            .iter()
            .map(|r| {
                let alg = r.bytes as f64 / r.time_s / 1e9;
                json!({"bytes": r.bytes, "iters": r.iters, "time_s": r.time_s, "algbw_gbs": alg, "busbw_gbs": alg * factor, "cpu_s_per_gb": r.cpu_per_gb, "served": r.served, "datagrams_per_send": r.batch.tx_per_call, "acks_per_datagram": r.batch.acks_per_rx})
            })
            .collect();
        println!(
            "{}",
            json!({"nodes": n, "rank": rank, "lanes": lanes, "chunks_sent": if a.copy { "copied" } else { "lent" }, "dtype": "float32", "op": "sum", "results": results, "ceiling_gbs": ceiling.as_ref().map(|c| c.gbs), "ceiling_cpu_s_per_gb": ceiling.as_ref().map(|c| c.cpu_per_gb), "ceiling_datagrams_per_send": ceiling.as_ref().map(|c| c.batch.tx_per_call), "ceiling_acks_per_datagram": ceiling.as_ref().map(|c| c.batch.acks_per_rx), "ceiling_ratios": ceiling.as_ref().map(|c| c.ratios.clone()),
                "plane_lane_packets": plane_lanes,
                "peak_rss_mib": peak_rss_mib(),
                "plane_datagrams": plane_counters.as_ref().map(|c| json!({"opened": c.opened, "refused": c.refused, "messages": c.messages, "unknown_source": c.unknown_source, "overflow": c.overflow, "batches": c.batches, "held_peak": c.held_peak, "copied": c.copied, "applied": c.applied})),
                "plane": plane.as_ref().map(|p| json!({"packets_sent": p.sender.packets_sent, "retransmitted": p.sender.retransmitted, "lost": p.sender.lost, "congestion_events": p.sender.congestion_events, "random_loss_events": p.sender.random_loss_events, "ptos": p.sender.ptos, "window": p.window, "rtt_us": p.rtt.as_micros() as u64})),
                "path": path.map(|p| json!({"mtu": p.mtu, "rtt_us": p.rtt.as_micros() as u64, "sent_packets": p.sent_packets, "lost_packets": p.lost_packets, "congestion_events": p.congestion_events, "connections": p.connections}))})
        );
    } else {
        println!(
            "# meshd ring allreduce: {}, this node rank {rank}, float32 sum, {} to the next node, chunks sent {}",
            meshd::plural(n as u64, "node"),
            meshd::plural(lanes as u64, "lane"),
            if a.copy { "as copies (--copy)" } else { "lent without copying" }
        );
        println!(
            "# {:>12} {:>10} {:>6} {:>12} {:>10} {:>10} {:>10} {:>8} {:>8}  served by",
            "size(B)", "count", "iters", "time(us)", "algbw", "busbw", "cpu(s/GB)", "dgm/send", "acks/dgm"
        );
        for r in &rows {
            let alg = r.bytes as f64 / r.time_s / 1e9;
            println!(
                "  {:>12} {:>10} {:>6} {:>12.1} {:>10.3} {:>10.3} {:>10.2} {:>8.1} {:>8.2}  {}",
                r.bytes,
                r.bytes / 4,
                r.iters,
                r.time_s * 1e6,
                alg,
                alg * factor,
                r.cpu_per_gb,
                r.batch.tx_per_call,
                r.batch.acks_per_rx,
                r.served
            );
        }
        println!(
            "# algbw, busbw in GB/s; busbw = algbw * 2(n-1)/n; cpu = this process's CPU seconds per GB one link carried; dgm/send = UDP datagrams per send call to the next node (GSO batching); acks/dgm = ACK frames sent back per datagram received (both QUIC counters: about 0 where the data plane served)"
        );
        if let Some(c) = ceiling {
            println!(
                "# bare QUIC ring (no framing, no reduction), per link: {:.3} GB/s, {:.2} CPU s/GB, {:.1} datagrams per send call, {:.2} ACKs per datagram received",
                c.gbs, c.cpu_per_gb, c.batch.tx_per_call, c.batch.acks_per_rx
            );
            let r: Vec<String> = c.ratios.iter().map(|r| format!("{r:.2}")).collect();
            println!("# ring busbw / bare ring, per round (interleaved): {}", r.join(" "));
        }
        if let Some(p) = path {
            println!(
                "# path to the next node: {}, UDP payload {} B (MTU discovery), rtt {} us, {} of {} packets lost, {}",
                meshd::plural(p.connections as u64, "connection"),
                p.mtu,
                p.rtt.as_micros(),
                p.lost_packets,
                p.sent_packets,
                meshd::plural(p.congestion_events, "congestion event")
            );
        }
        if let Some(p) = plane {
            println!(
                "# data plane link to the next node: {} of {} packets lost, {} retransmitted, {}, {}, window {} B, rtt {} us",
                p.sender.lost,
                p.sender.packets_sent,
                p.sender.retransmitted,
                meshd::plural(p.sender.congestion_events, "congestion event"),
                meshd::plural(p.sender.ptos, "probe timeout"),
                p.window,
                p.rtt.as_micros()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::delta_ratio;

    #[test]
    fn counters_that_went_backwards_give_no_figure_instead_of_a_panic() {
        assert_eq!(delta_ratio((130, 30), (60, 10)), 2.0);
        // A lane closed between the snapshots: its counts left the link's sums.
        assert!(delta_ratio((20, 30), (60, 10)).is_nan());
        assert!(delta_ratio((130, 30), (5, 10)).is_nan());
        assert!(delta_ratio((130, 30), (10, 10)).is_nan(), "nothing sent: no figure");
    }
}
