//! Lab: DDP's gradient paths behind the one-port firewall (all TCP and all UDP but meshd's
//! port dropped on every host), 3 hosts x 2 ranks, on both torches: gradient bucketing
//! (several buckets), `no_sync` accumulation, parameters some ranks leave unused in a step
//! (find_unused_parameters=True) and static_graph=True (tests/python/ddp_matrix.py). With
//! meshd's DDP hook (`--collective quic`) and with plain Gloo through the tunnel
//! (`--collective tunnel`), every rank must end with the same parameters, equal to the
//! job replayed in one process.

mod lab;
mod torches;
use lab::Lab;
use std::time::Duration;
use torches::Torch;

const CONFIGS: [&str; 2] = ["buckets+no_sync+unused", "static_graph"];

fn firewalled_lab() -> Lab {
    let lab = Lab::new(3);
    for i in 0..3 {
        lab.firewall_only_udp(i, 29400);
    }
    lab
}

/// `ddp_matrix.py --mode MODE` under `meshd run --collective COLLECTIVE`; checks every
/// configuration's lines of all six ranks.
fn ddp_matrix(t: &Torch, collective: &str, mode: &str) {
    let mut lab = firewalled_lab();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/ddp_matrix.py");
    let args = lab
        .meshd_run()
        .flags(&["--nproc-per-node", "2", "--collective", collective])
        .cmd(&[&t.python, script, "--mode", mode]);
    let mut env = vec![("MESHD_TOKEN", "ddp".to_string())];
    env.extend(t.env());
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let started = std::time::Instant::now();
    let res = lab.run_on_all(&args, &env, Duration::from_secs(240));
    eprintln!("FIGURE ddp_matrix {mode} over {collective}, {}: {:?}", t.label(), started.elapsed());
    let mut lines = Vec::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i} ({}):\n{out}\n{err}", t.label());
        assert!(err.contains(&format!("collective: {collective}")), "host {i}:\n{err}");
        lines.extend(out.lines().filter_map(|l| l.split_once("DDP-MATRIX ").map(|(_, r)| r.to_string())));
    }
    let field = |l: &str, k: &str| -> String {
        l.split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k} in {l}"))
            .to_string()
    };
    for cfg in CONFIGS {
        let of: Vec<&String> = lines.iter().filter(|l| field(l, "cfg") == cfg).collect();
        assert_eq!(of.len(), 6, "{cfg}: every rank reports: {lines:#?}");
        let digest = field(of[0], "params_sha256");
        for l in &of {
            assert_eq!(field(l, "world"), "6", "{l}");
            assert_eq!(field(l, "params_sha256"), digest, "{cfg}: parameters differ across ranks: {of:#?}");
            let buckets: u32 = field(l, "buckets").parse().expect("buckets");
            assert!(buckets > 1, "{cfg}: several gradient buckets: {l}");
            let diff: f64 = field(l, "ref_diff").parse().expect("ref_diff");
            assert!(diff < 1e-5, "{cfg}: the parameters the job must reach (replayed in one process): {l}");
            assert_eq!(field(l, "numpy"), if t.numpy { "True" } else { "False" }, "{l}");
            assert_eq!(field(l, "torch"), t.version, "{l}");
        }
    }
}

on_torches!([torch1_13, torch2, torch2_numpy]
fn ddp_with_buckets_no_sync_unused_parameters_and_static_graph_through_the_hook(t) {
    lab_or_skip!();
    ddp_matrix(t, "quic", "hook");
}
);

on_torches!([torch1_13, torch2]
fn ddp_with_buckets_no_sync_unused_parameters_and_static_graph_over_gloo_through_the_tunnel(t) {
    lab_or_skip!();
    ddp_matrix(t, "tunnel", "gloo");
}
);
