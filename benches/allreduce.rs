//! Allreduce benchmark on the lab (3 hosts unless `--hosts N`), side by side in one run:
//! meshd's QUIC ring (`meshd bench allreduce`), a ring allreduce over TLS 1.3 TCP
//! (rustls, AES-128-GCM) and the same ring over plaintext TCP (`allreduce/tls_ring.rs`, run
//! by this binary itself on each host), the same ring again in lean AES-128-GCM datagrams
//! without loss recovery (`allreduce/dgram_ring.rs`: the data plane's yardstick, what its
//! datagrams cost without its reliability), PyTorch Gloo's allreduce (launched by meshd run)
//! directly over TCP, one TCP stream (iperf3) between two of the hosts, and last the same
//! Gloo job behind the one-port firewall on every host, through meshd's tunnel.
//! meshd's ring runs twice at the large size, on the data plane's datagrams and on QUIC
//! streams (`--plane both`). The last lines are the ratios issue 22's goals are stated in:
//! data plane / AES-TCP ring, data plane / Gloo, QUIC streams / Gloo.
//! Run as root: `cargo bench --bench allreduce` (`-- --size BYTES` to change 64 MiB,
//! `-- --mtu 9000` for jumbo frames on the lab's eth1, `-- --hosts 8` for a bigger lab,
//! `-- --ring-only` for meshd's ring and the TCP rings alone: no Gloo, client or iperf3).

#[path = "allreduce/dgram_ring.rs"]
mod dgram_ring;
#[path = "../tests/lab/mod.rs"]
mod lab;
#[path = "allreduce/tls_ring.rs"]
mod tls_ring;

use lab::{Lab, meshd};
use std::time::Duration;

fn field(line: &str, key: &str) -> Option<f64> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(key)).and_then(|v| v.parse().ok())
}

/// Timed allreduces of the TCP rings: as many as meshd's bench times at the large size
/// (`--iters 3`, 3 rounds).
const TCP_RING_ITERS: u32 = 9;

/// The TCP ring on every host of `lab` (`certs`: TLS with them, or plaintext): one JSON
/// line per host that finished.
fn tcp_ring(lab: &mut Lab, size: usize, certs: Option<&tls_ring::CertDir>) -> Vec<serde_json::Value> {
    let exe = std::env::current_exe().expect("the bench binary's path");
    let exe = exe.to_str().expect("a UTF-8 path");
    let (peers, size, iters) = (lab.peers(), size.to_string(), TCP_RING_ITERS.to_string());
    let mode = certs.map(|c| c.path().to_str().expect("a UTF-8 path")).unwrap_or("plain");
    let ks: Vec<usize> = (0..lab.hosts.len())
        .map(|i| {
            let rank = i.to_string();
            lab.spawn(i, &[exe, "--tls-ring-worker", &rank, &peers, &size, &iters, mode], &[])
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    ks.into_iter()
        .filter_map(|k| {
            let (code, out, err) = lab.wait(k, deadline.saturating_duration_since(std::time::Instant::now()));
            if code != Some(0) {
                println!("TCP ring ({mode}) failed ({code:?}): {err}");
            }
            serde_json::from_str::<serde_json::Value>(out.trim()).ok()
        })
        .collect()
}

/// The lean AEAD-datagram ring on every host of `lab` (datagrams of `mtu` less 28 bytes):
/// one JSON line per host that finished.
fn dgram_ring(lab: &mut Lab, size: usize, mtu: u32) -> Vec<serde_json::Value> {
    let exe = std::env::current_exe().expect("the bench binary's path");
    let exe = exe.to_str().expect("a UTF-8 path");
    let (peers, size, iters, mtu) =
        (lab.peers(), size.to_string(), TCP_RING_ITERS.to_string(), mtu.to_string());
    let ks: Vec<usize> = (0..lab.hosts.len())
        .map(|i| {
            let rank = i.to_string();
            lab.spawn(i, &[exe, "--dgram-ring-worker", &rank, &peers, &size, &iters, &mtu], &[])
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    ks.into_iter()
        .filter_map(|k| {
            let (code, out, err) = lab.wait(k, deadline.saturating_duration_since(std::time::Instant::now()));
            if code != Some(0) {
                println!("datagram ring failed ({code:?}): {err}");
            }
            serde_json::from_str::<serde_json::Value>(out.trim()).ok()
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // One rank of the TCP ring, started by `tcp_ring` in a lab host.
    if let Some(i) = args.iter().position(|a| a == "--tls-ring-worker") {
        std::process::exit(tls_ring::worker(&args[i + 1..]));
    }
    // One rank of the lean datagram ring, started by `dgram_ring` in a lab host.
    if let Some(i) = args.iter().position(|a| a == "--dgram-ring-worker") {
        std::process::exit(dgram_ring::worker(&args[i + 1..]));
    }
    if !lab::bench_mode(env!("CARGO_CRATE_NAME")) {
        return;
    }
    let size: usize = lab::bench_opt("--size", 64 << 20);
    let sz = size.to_string();
    let mtu: u32 = lab::bench_opt("--mtu", 1500);
    let hosts: usize = lab::bench_opt("--hosts", 3).clamp(2, lab::ETH1_OCTETS.len());
    let nn = hosts.to_string();
    let mut lab = Lab::new(hosts);
    if mtu != 1500 {
        lab.set_mtu(mtu);
    }
    let peers = lab.peers();
    println!(
        "allreduce benchmark: {hosts} lab hosts, eth1 MTU {mtu}, float32, {size} bytes (busbw = algbw x 2(n-1)/n)"
    );

    // 1. meshd's ring over QUIC, at `size` and at 8 bytes (small-message latency).
    let ring = |lab: &mut Lab, size: &str, iters: &str, ceiling: bool| -> Vec<serde_json::Value> {
        let mut args = vec![
            meshd(),
            "bench",
            "allreduce",
            "--json",
            "--nnodes",
            &nn,
            "--peers",
            &peers,
            "--size",
            size,
            "--iters",
            iters,
        ];
        if ceiling {
            args.extend(["--ceiling", "--plane", "both"]);
        }
        lab.run_on_all(&args, &[("MESHD_LOG", "warn")], Duration::from_secs(300))
            .into_iter()
            .filter_map(|(code, out, err)| {
                if code != Some(0) {
                    println!("meshd bench failed: {err}");
                }
                serde_json::from_str::<serde_json::Value>(out.trim()).ok()
            })
            .collect()
    };
    let big = ring(&mut lab, &sz, "3", true);
    let meshd_bus: Vec<f64> = big.iter().filter_map(|v| v["results"][0]["busbw_gbs"].as_f64()).collect();
    let ceiling: Vec<f64> = big.iter().filter_map(|v| v["ceiling_gbs"].as_f64()).collect();
    let meshd_cpu: Vec<f64> = big.iter().filter_map(|v| v["results"][0]["cpu_s_per_gb"].as_f64()).collect();
    let served: Vec<&str> = big.iter().filter_map(|v| v["results"][0]["served"].as_str()).collect();
    let streams_bus: Vec<f64> = big.iter().filter_map(|v| v["results"][1]["busbw_gbs"].as_f64()).collect();
    let streams_cpu: Vec<f64> = big.iter().filter_map(|v| v["results"][1]["cpu_s_per_gb"].as_f64()).collect();
    let meshd_rss: Vec<f64> = big.iter().filter_map(|v| v["peak_rss_mib"].as_f64()).collect();
    let mean = |v: &[f64]| if v.is_empty() { None } else { Some(v.iter().sum::<f64>() / v.len() as f64) };
    let show = |x: Option<f64>| x.map(|x| format!("{x:.3}")).unwrap_or_else(|| "n/a".into());
    println!(
        "meshd ring, {size} bytes: {served:?}: busbw {} GB/s, {} CPU s/GB per link; QUIC streams: busbw {} GB/s, {} CPU s/GB per link; meshd peak RSS {} MiB (one process, both paths)",
        show(mean(&meshd_bus)),
        show(mean(&meshd_cpu)),
        show(mean(&streams_bus)),
        show(mean(&streams_cpu)),
        meshd_rss.iter().copied().reduce(f64::max).map(|r| format!("{r:.0}")).unwrap_or_else(|| "n/a".into())
    );
    let plane: Vec<String> = big
        .iter()
        .filter_map(|v| {
            let p = &v["plane"];
            Some(format!(
                "{}/{} lost, {} congestion events, window {} B",
                p["lost"].as_u64()?,
                p["packets_sent"].as_u64()?,
                p["congestion_events"].as_u64()?,
                p["window"].as_u64()?
            ))
        })
        .collect();
    println!("data plane links to the next node (whole run): {plane:?}");

    // 2. The same allreduce as a ring over TCP, TLS 1.3 AES-128-GCM, then plaintext.
    let certs = tls_ring::CertDir::new().expect("a self-signed certificate in the temp dir");
    let tls = tcp_ring(&mut lab, size, Some(&certs));
    let plain = tcp_ring(&mut lab, size, None);
    let pick = |v: &[serde_json::Value], key: &str| -> Vec<f64> {
        v.iter().filter_map(|j| j[key].as_f64()).collect()
    };
    let (tls_bus, plain_bus) = (pick(&tls, "busbw_gbs"), pick(&plain, "busbw_gbs"));
    for (name, rows) in [("TLS 1.3 AES-128-GCM", &tls), ("plaintext", &plain)] {
        let rss = pick(rows, "peak_rss_mib");
        println!(
            "TCP ring, {name}, {size} bytes, {} of {hosts} ranks ({:?}): busbw {} GB/s, {} CPU s/GB per link, peak RSS {} MiB",
            rows.len(),
            rows.first().and_then(|j| j["suite"].as_str()).unwrap_or("n/a"),
            show(mean(&pick(rows, "busbw_gbs"))),
            show(mean(&pick(rows, "cpu_s_per_gb"))),
            rss.iter().copied().reduce(f64::max).map(|r| format!("{r:.0}")).unwrap_or_else(|| "n/a".into()),
        );
    }
    let ratio = |a: &[f64], b: &[f64]| match (mean(a), mean(b)) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "n/a".into(),
    };
    // 2b. The same allreduce in lean AEAD datagrams (no loss recovery): what the data
    //     plane's datagrams cost without the plane's reliability.
    let lean = dgram_ring(&mut lab, size, mtu);
    let (lean_bus, lean_cpu) = (pick(&lean, "busbw_gbs"), pick(&lean, "cpu_s_per_gb"));
    println!(
        "lean datagram ring, {size} bytes, {} of {hosts} ranks ({}): busbw {} GB/s, {} CPU s/GB per link, peak RSS {} MiB, {} datagrams per receive call",
        lean.len(),
        lean.first().and_then(|j| j["suite"].as_str()).unwrap_or("n/a"),
        show(mean(&lean_bus)),
        show(mean(&lean_cpu)),
        pick(&lean, "peak_rss_mib")
            .iter()
            .copied()
            .reduce(f64::max)
            .map(|r| format!("{r:.0}"))
            .unwrap_or_else(|| "n/a".into()),
        show(mean(&pick(&lean, "datagrams_per_recv"))),
    );
    println!(
        "data plane / lean datagram ring (this run): CPU s/GB {} (goal at most 2), busbw {}",
        ratio(&meshd_cpu, &lean_cpu),
        ratio(&meshd_bus, &lean_bus)
    );
    if std::env::args().any(|a| a == "--ring-only") {
        println!(
            "busbw ratios: data plane / AES-TCP ring {}, QUIC streams / AES-TCP ring {}, data plane / plaintext TCP ring {}",
            ratio(&meshd_bus, &tls_bus),
            ratio(&streams_bus, &tls_bus),
            ratio(&meshd_bus, &plain_bus)
        );
        return;
    }
    let ceiling_cpu: Vec<f64> = big.iter().filter_map(|v| v["ceiling_cpu_s_per_gb"].as_f64()).collect();
    let mtus: Vec<u64> = big.iter().filter_map(|v| v["path"]["mtu"].as_u64()).collect();
    // Each node's ring / bare ring ratio per round (the bare ring runs between rounds).
    let mut ratios: Vec<f64> = big
        .iter()
        .filter_map(|v| v["ceiling_ratios"].as_array())
        .flat_map(|a| a.iter().filter_map(|r| r.as_f64()))
        .collect();
    ratios.sort_by(f64::total_cmp);
    let meshd_lat: Vec<f64> =
        ring(&mut lab, "8", "50", false).iter().filter_map(|v| v["results"][0]["time_s"].as_f64()).collect();

    // `meshd run` of one of the examples' Python benchmarks on every host.
    let py_job = |nproc: usize, collective: &str, script: &str| -> Vec<String> {
        lab::python_job("/usr/bin/python3", &peers, hosts, nproc, collective, script, &["--size", &sz])
    };
    // 3. Gloo (PyTorch), one process per host, launched by meshd run.
    let gloo = py_job(1, "auto", "gloo_allreduce_bench.py");
    let gloo: Vec<&str> = gloo.iter().map(String::as_str).collect();
    let (mut gloo_bus, mut gloo_lat, mut gloo_time) = (Vec::new(), Vec::new(), Vec::new());
    for (_, out, _) in lab.run_on_all(&gloo, &[("MESHD_LOG", "warn")], Duration::from_secs(300)) {
        for l in out.lines().filter(|l| l.contains("GLOO ")) {
            match field(l, "bytes=") {
                Some(b) if b <= 8.0 => gloo_lat.extend(field(l, "time_s=")),
                Some(_) => {
                    gloo_bus.extend(field(l, "busbw_gbs="));
                    gloo_time.extend(field(l, "time_s="));
                }
                None => {}
            }
        }
    }

    // 4. The path ranks use: meshd's Python client, 2 ranks per host, buffers read and
    //    written in place (the default) and sent through the socket (MESHD_IN_PLACE=0).
    let client = py_job(2, "quic", "client_allreduce_bench.py");
    let client: Vec<&str> = client.iter().map(String::as_str).collect();
    let mut client_time = Vec::new();
    for in_place in ["1", "0"] {
        let mut times = Vec::new();
        let env = [("MESHD_LOG", "warn"), ("MESHD_IN_PLACE", in_place)];
        for (code, out, err) in lab.run_on_all(&client, &env, Duration::from_secs(300)) {
            if code != Some(0) {
                println!("client bench failed: {err}");
            }
            times.extend(out.lines().filter(|l| l.contains("CLIENT ")).filter_map(|l| field(l, "time_s=")));
        }
        client_time.push(times);
    }

    // 5. One TCP stream (iperf3) host 0 -> host 1.
    let server = lab.spawn(1, &["iperf3", "-s", "-1"], &[]);
    std::thread::sleep(Duration::from_millis(500));
    let (_, out, _) =
        lab.run(0, &["iperf3", "-c", &lab.hosts[1].eth1.clone(), "-t", "3", "-J"], Duration::from_secs(30));
    let _ = lab.wait(server, Duration::from_secs(10));
    let tcp = serde_json::from_str::<serde_json::Value>(&out)
        .ok()
        .and_then(|v| v["end"]["sum_received"]["bits_per_second"].as_f64())
        .map(|b| b / 8e9);

    // 6. Gloo again, behind the one-port firewall on every host: the preflight picks tunnel
    //    mode and Gloo's TCP connections travel through meshd's QUIC connections.
    for i in 0..hosts {
        lab.firewall_only_udp(i, 29400);
    }
    let (mut tun_bus, mut tun_lat, mut tun_time) = (Vec::new(), Vec::new(), Vec::new());
    for (code, out, err) in lab.run_on_all(&gloo, &[("MESHD_LOG", "info")], Duration::from_secs(300)) {
        if code != Some(0) || !err.contains("collective: tunnel") {
            println!("Gloo through the tunnel failed ({code:?}): {err}");
        }
        for l in out.lines().filter(|l| l.contains("GLOO ")) {
            match field(l, "bytes=") {
                Some(b) if b <= 8.0 => tun_lat.extend(field(l, "time_s=")),
                Some(_) => {
                    tun_bus.extend(field(l, "busbw_gbs="));
                    tun_time.extend(field(l, "time_s="));
                }
                None => {}
            }
        }
    }

    println!("{:<34} {:>12} {:>16}", "", "busbw GB/s", "8-byte time (us)");
    println!("{:<34} {:>12} {:>16}", "meshd ring, data plane", show(mean(&meshd_bus)), "");
    // 8 bytes go direct, over QUIC streams.
    println!(
        "{:<34} {:>12} {:>16}",
        "meshd ring, QUIC streams",
        show(mean(&streams_bus)),
        show(mean(&meshd_lat).map(|t| t * 1e6))
    );
    println!("{:<34} {:>12} {:>16}", "bare quinn ring (per link)", show(mean(&ceiling)), "");
    println!("{:<34} {:>12} {:>16}", "TCP ring, TLS 1.3 AES-128-GCM", show(mean(&tls_bus)), "");
    println!("{:<34} {:>12} {:>16}", "TCP ring, plaintext", show(mean(&plain_bus)), "");
    println!(
        "{:<34} {:>12} {:>16}",
        "PyTorch Gloo (TCP)",
        show(mean(&gloo_bus)),
        show(mean(&gloo_lat).map(|t| t * 1e6))
    );
    println!(
        "{:<34} {:>12} {:>16}",
        "PyTorch Gloo through the tunnel",
        show(mean(&tun_bus)),
        show(mean(&tun_lat).map(|t| t * 1e6))
    );
    println!("{:<34} {:>12} {:>16}", "one TCP stream, iperf3 (GB/s)", show(tcp), "");
    let ms = |v: &[f64]| mean(v).map(|t| format!("{:.1} ms", t * 1e3)).unwrap_or_else(|| "n/a".into());
    println!(
        "{size}-byte allreduce: meshd ring (bench, 1 buffer per host) {}; Python client, {hosts} hosts x 2 ranks: in place {}, through the socket {}; Gloo (1 rank per host) {}",
        ms(&big.iter().filter_map(|v| v["results"][0]["time_s"].as_f64()).collect::<Vec<_>>()),
        ms(&client_time[0]),
        ms(&client_time[1]),
        ms(&gloo_time),
    );
    println!(
        "CPU seconds per GB carried per link: meshd ring on the data plane {}, on QUIC streams {}, bare quinn ring {}, TCP ring with TLS {}, plaintext {}; QUIC payload reached {:?} B",
        show(mean(&meshd_cpu)),
        show(mean(&streams_cpu)),
        show(mean(&ceiling_cpu)),
        show(mean(&pick(&tls, "cpu_s_per_gb"))),
        show(mean(&pick(&plain, "cpu_s_per_gb"))),
        mtus
    );
    if let (Some(m), Some(s), Some(c)) = (mean(&meshd_bus), mean(&streams_bus), mean(&ceiling)) {
        println!("meshd ring / bare quinn ring: data plane {:.2}, QUIC streams {:.2}", m / c, s / c);
    }
    if !ratios.is_empty() {
        println!(
            "meshd ring on QUIC streams / bare quinn ring, per node and round: median {:.2}, range {:.2}-{:.2} ({} rounds)",
            ratios[ratios.len() / 2],
            ratios[0],
            ratios[ratios.len() - 1],
            ratios.len()
        );
    }
    if let (Some(m), Some(g)) = (mean(&meshd_bus), mean(&gloo_bus)) {
        println!("meshd / Gloo busbw ratio: {:.2}", m / g);
    }
    if let (Some(t), Some(m), Some(g)) = (mean(&tun_bus), mean(&meshd_bus), mean(&gloo_bus)) {
        println!(
            "Gloo through the tunnel: {:.2}x meshd's ring, {:.2}x Gloo direct ({} per allreduce)",
            t / m,
            t / g,
            ms(&tun_time)
        );
    }
    println!(
        "goals' busbw ratios (this run): data plane / AES-TCP ring {}, data plane / Gloo {}, QUIC streams / Gloo {} (data plane / plaintext TCP ring {})",
        ratio(&meshd_bus, &tls_bus),
        ratio(&meshd_bus, &gloo_bus),
        ratio(&streams_bus, &gloo_bus),
        ratio(&meshd_bus, &plain_bus)
    );
}
