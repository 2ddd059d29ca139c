//! Lab: when only meshd's UDP port is open, jobs still train through the QUIC ring: with
//! `--collective quic`, and in tunnel mode (what auto picks there), where MESHD_SOCKET and
//! meshd's client stay available beside the tunnel.

mod lab;
mod torches;
use lab::Lab;
use std::time::Duration;
use torches::Torch;

fn firewalled_lab() -> Lab {
    let lab = Lab::new(3);
    for i in 0..3 {
        lab.firewall_only_udp(i, 29400);
    }
    lab
}

fn run3(lab: &mut Lab, t: &Torch, collective: &str, cmd: &[&str]) -> Vec<(Option<i32>, String, String)> {
    let cmd = [&[t.python.as_str()][..], cmd].concat();
    let args = lab.meshd_run().flags(&["--nproc-per-node", "2", "--collective", collective]).cmd(&cmd);
    let mut env = vec![("MESHD_TOKEN", "quic".to_string())];
    env.extend(t.env());
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    lab.run_on_all(&args, &env, Duration::from_secs(180))
}

/// `mode`: the collective the ranks must get (`quic` forced, or `tunnel` chosen by the
/// preflight).
fn check_training(res: &[(Option<i32>, String, String)], ddp: bool, mode: &str) {
    let mut digests = Vec::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        assert!(err.contains(&format!("collective: {mode}")), "the preflight must choose {mode}:\n{err}");
        for l in out.lines().filter(|l| l.contains("QUIC-TRAIN")) {
            assert!(
                l.contains("world=6")
                    && l.contains(&format!("collective={mode}"))
                    && l.contains(&format!("ddp={}", if ddp { "True" } else { "False" })),
                "{l}"
            );
            digests.push(
                l.split("params_sha256=")
                    .nth(1)
                    .and_then(|s| s.split_whitespace().next())
                    .expect("digest")
                    .to_string(),
            );
        }
    }
    assert_eq!(digests.len(), 6, "every rank reports");
    assert!(digests.iter().all(|d| *d == digests[0]), "parameters differ: {digests:?}");
}

on_torches!([torch1_13, torch2]
fn training_loop_averages_gradients_over_quic_behind_a_one_port_firewall(t) {
    lab_or_skip!();
    let mut lab = firewalled_lab();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/train_quic.py");
    // auto: the preflight picks the tunnel; meshd's client works beside it.
    check_training(&run3(&mut lab, t, "auto", &[script, "--steps", "10"]), false, "tunnel");
}
);

on_torches!([torch1_13, torch2]
fn ddp_hook_averages_gradients_over_quic_behind_a_one_port_firewall(t) {
    lab_or_skip!();
    let mut lab = firewalled_lab();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/train_quic.py");
    check_training(&run3(&mut lab, t, "quic", &[script, "--steps", "10", "--ddp"]), true, "quic");
}
);

on_torches!([torch1_13, torch2]
/// meshd's client from every rank (examples/collectives_check.py: stdlib buffers, numpy
/// arrays where numpy is importable, torch tensors), in place and through the socket.
fn collectives_store_and_barrier_across_firewalled_hosts(t) {
    lab_or_skip!();
    let mut lab = firewalled_lab();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/collectives_check.py");
    // Buffers read and written in place (the default), then sent through the socket, with
    // the ring's data spread over 3 lanes (connections) per link in 64 KiB chunks.
    for (in_place, want, lanes, chunk) in
        [("1", "in_place=True", "1", "1048576"), ("0", "in_place=False", "3", "65536")]
    {
        let py = t.python.as_str();
        let args = lab.meshd_run().flags(&["--nproc-per-node", "2"]).cmd(&[py, script]);
        let mut env = vec![
            ("MESHD_TOKEN", "quic".to_string()),
            ("MESHD_IN_PLACE", in_place.to_string()),
            ("MESHD_LANES", lanes.to_string()),
            ("MESHD_RING_CHUNK", chunk.to_string()),
        ];
        env.extend(t.env());
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        for (i, (code, out, err)) in lab.run_on_all(&args, &env, Duration::from_secs(180)).iter().enumerate()
        {
            assert_eq!(*code, Some(0), "host {i}, MESHD_IN_PLACE={in_place}:\n{out}\n{err}");
            assert_eq!(out.matches("COLLECTIVES OK").count(), 2, "host {i}:\n{out}\n{err}");
            assert_eq!(out.matches(want).count(), 2, "host {i}:\n{out}\n{err}");
            // What the ranks' buffers were: numpy arrays only where numpy is importable.
            let used = format!("used={}torch-{}", if t.numpy { "numpy," } else { "" }, t.version);
            let mut oks = out.lines().filter(|l| l.contains("COLLECTIVES OK"));
            assert!(oks.all(|l| l.ends_with(&used)), "host {i}: every rank {used} ({}):\n{out}", t.label());
            let over = if lanes == "1" {
                "ring over 1 lane to".to_string()
            } else {
                format!("ring over {lanes} lanes to")
            };
            assert!(err.contains(&over), "host {i}:\n{err}");
        }
    }
}
);

#[test]
fn bench_allreduce_checks_results_and_interleaves_the_bare_ring_over_lanes() {
    lab_or_skip!();
    let mut lab = firewalled_lab();
    let args = lab
        .meshd_bench()
        .flags(&["--max-size", "1048576", "--iters", "2", "--ceiling", "--rounds", "2", "--lanes", "3"])
        .args(&["--json"]);
    let res = lab.run_on_all(&args, &[("MESHD_TOKEN", "bench")], Duration::from_secs(120));
    let mut ranks = Vec::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
        ranks.push(v["rank"].as_u64().expect("rank"));
        let results = v["results"].as_array().expect("results");
        // 1 KiB, 4 KiB, ..., 1 MiB: each size was checked before it was timed.
        let sizes: Vec<u64> = results.iter().filter_map(|r| r["bytes"].as_u64()).collect();
        assert_eq!(sizes, [1024, 4096, 16384, 65536, 262144, 1048576], "{out}");
        assert!(results.iter().all(|r| r["busbw_gbs"].as_f64().is_some_and(|b| b > 0.0)), "{out}");
        // The largest size ran in 2 rounds of 2, each followed by one bare ring.
        assert_eq!(results[5]["iters"], 4, "{out}");
        let ratios = v["ceiling_ratios"].as_array().expect("ceiling_ratios");
        assert_eq!(ratios.len(), 2, "{out}");
        assert!(ratios.iter().all(|r| r.as_f64().is_some_and(|r| r > 0.0 && r.is_finite())), "{out}");
        assert!(v["ceiling_gbs"].as_f64().is_some_and(|c| c > 0.0), "{out}");
        // Three data connections to the next node and the main one (control only), all
        // through the firewall's one UDP port.
        assert_eq!(v["lanes"], 3, "{out}");
        assert_eq!(v["path"]["connections"], 4, "{out}");
    }
    ranks.sort();
    assert_eq!(ranks, [0, 1, 2]);
}
