//! Lab: the frameworks people launch, unmodified, under `meshd run` on 3 hosts x 2 ranks
//! (torch 2 from PyPI with numpy: both frameworks need it), on the open network and behind
//! the one-port firewall (tunnel mode): a PyTorch Lightning `Trainer(strategy="ddp",
//! accelerator="cpu", devices=2, num_nodes=3)` script and a Hugging Face Accelerate
//! `Accelerator()` script (tests/python/lightning_job.py, accelerate_job.py). Every rank
//! must report the job's world size and its own rank, and every rank the same final weights.
//! On the open network meshd runs as `srun --ntasks-per-node=1 meshd run` would start it
//! (SLURM's task variables of one task per node): Lightning must still take the job from
//! torchrun's variables (TorchElasticEnvironment), and its SLURMEnvironment, for scripts
//! that pass it, must read meshd's ranks from the rewritten SLURM variables.

mod lab;
mod torches;
use lab::Lab;
use std::collections::BTreeMap;
use std::time::Duration;
use torches::Torch;

/// SLURM's variables for task `i` of `srun -N3 --ntasks-per-node=1 meshd run ...` (job
/// 4242; as tests/lab_slurm.rs sets them, fewer): what the ranks would inherit unrewritten.
fn srun_env(i: usize) -> Vec<(&'static str, String)> {
    let mut env: Vec<(&'static str, String)> = [
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_JOB_NAME", "train"),
        ("SLURM_JOB_NODELIST", "gpu[01-02,07]"),
        ("SLURM_JOB_NUM_NODES", "3"),
        ("SLURM_STEP_NODELIST", "gpu[01-02,07]"),
        ("SLURM_NODELIST", "gpu[01-02,07]"),
        ("SLURM_STEP_NUM_NODES", "3"),
        ("SLURM_STEP_NUM_TASKS", "3"),
        ("SLURM_NNODES", "3"),
        ("SLURM_NTASKS", "3"),
        ("SLURM_NPROCS", "3"),
        ("SLURM_NTASKS_PER_NODE", "1"),
        ("SLURM_TASKS_PER_NODE", "1(x3)"),
        ("SLURM_LOCALID", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.to_string()))
    .collect();
    env.extend([
        ("SLURM_PROCID", i.to_string()),
        ("SLURM_NODEID", i.to_string()),
        ("SLURM_GTIDS", i.to_string()),
    ]);
    env
}

/// Runs `script` with `t` on every host (`--collective auto`), each host with `per_host(i)`
/// added to its environment; returns every rank's `TAG` line as its `k=v` fields.
fn run_framework(
    t: &Torch,
    firewall: bool,
    script: &str,
    tag: &str,
    per_host: &dyn Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<BTreeMap<String, String>> {
    let mut lab = Lab::new(3);
    if firewall {
        for i in 0..3 {
            lab.firewall_only_udp(i, 29400);
        }
    }
    let script = format!("{}/tests/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let args = lab
        .meshd_run()
        .flags(&["--nproc-per-node", "2", "--rdzv-timeout", "120s"])
        .cmd(&[&t.python, "-W", "ignore", &script]);
    let started = std::time::Instant::now();
    let ks: Vec<usize> = (0..3)
        .map(|i| {
            let env = lab::token_env("frameworks", t.env().into_iter().chain(per_host(i)));
            lab.spawn(i, &args, &lab::env_refs(&env))
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(420);
    let mut ranks = Vec::new();
    for (i, k) in ks.into_iter().enumerate() {
        let (code, out, err) = lab.wait(k, deadline.saturating_duration_since(std::time::Instant::now()));
        assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
        let want =
            if firewall { "collective: tunnel (TCP between nodes is blocked" } else { "collective: nccl" };
        assert!(err.contains(want), "host {i}: {want}:\n{err}");
        for l in out.lines().filter_map(|l| l.split_once(&format!("{tag} ")).map(|(_, r)| r)) {
            ranks.push(
                l.split_whitespace()
                    .filter_map(|f| f.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .chain([("host".to_string(), i.to_string())])
                    .collect::<BTreeMap<_, _>>(),
            );
        }
    }
    eprintln!(
        "FIGURE {tag} on 3 hosts x 2 ({}, {}): {:?}",
        if firewall { "one-port firewall" } else { "open network" },
        t.label(),
        started.elapsed()
    );
    assert_eq!(ranks.len(), 6, "every rank reports: {ranks:#?}");
    let mut seen: Vec<u32> = ranks.iter().map(|r| r["rank"].parse().expect("rank")).collect();
    seen.sort();
    assert_eq!(seen, [0, 1, 2, 3, 4, 5], "every rank once: {ranks:#?}");
    for r in &ranks {
        assert_eq!(r["world"], "6", "every rank saw the job's world size: {r:?}");
        assert_eq!(r["params_sha256"], ranks[0]["params_sha256"], "final weights differ: {ranks:#?}");
    }
    ranks
}

/// Node ranks in meshd follow eth1 addresses: host 0 (.30) is node 2, host 1 (.7) node 0,
/// host 2 (.19) node 1.
const NODE_OF_HOST: [u32; 3] = [2, 0, 1];

fn check_lightning(ranks: &[BTreeMap<String, String>]) {
    for r in ranks {
        assert_eq!(r["env"], "TorchElasticEnvironment", "Lightning's cluster environment: {r:?}");
        // 384 samples over 6 ranks in batches of 16, 2 epochs.
        assert_eq!(r["steps"], "8", "{r:?}");
        let (rank, local, node): (u32, u32, u32) = (
            r["rank"].parse().expect("rank"),
            r["local"].parse().expect("local"),
            r["node"].parse().expect("node"),
        );
        let host: usize = r["host"].parse().expect("host");
        assert_eq!(node, NODE_OF_HOST[host], "{r:?}");
        assert_eq!(rank, node * 2 + local, "{r:?}");
    }
}

on_torches!([torch2_numpy]
fn lightning_ddp_trains_on_three_hosts_under_srun_leftovers(t) {
    lab_or_skip!();
    let ranks = run_framework(t, false, "lightning_job.py", "LIGHTNING", &srun_env);
    check_lightning(&ranks);
    // SLURMEnvironment (a script passing it explicitly) reads meshd's rewritten variables.
    for r in &ranks {
        assert_eq!(r.get("slurm_world").map(String::as_str), Some("6"), "{r:?}");
        assert_eq!(r["slurm_rank"], r["rank"], "{r:?}");
        assert_eq!(r["slurm_local"], r["local"], "{r:?}");
        assert_eq!(r["slurm_node"], r["node"], "{r:?}");
    }
}
);

on_torches!([torch2_numpy]
fn lightning_ddp_trains_on_three_hosts_behind_a_one_port_firewall(t) {
    lab_or_skip!();
    let ranks = run_framework(t, true, "lightning_job.py", "LIGHTNING", &|_| Vec::new());
    check_lightning(&ranks);
    assert!(ranks.iter().all(|r| !r.contains_key("slurm_world")), "no SLURM here: {ranks:#?}");
}
);

/// Accelerate on CPU-only nodes: `Accelerator()` distributes only when told the devices are
/// CPUs (ACCELERATE_USE_CPU=1, what `accelerate launch --cpu` sets; under torchrun it runs
/// each rank alone otherwise, as under meshd).
fn accelerate_cpu(_: usize) -> Vec<(&'static str, String)> {
    vec![("ACCELERATE_USE_CPU", "1".to_string())]
}

fn check_accelerate(ranks: &[BTreeMap<String, String>]) {
    for r in ranks {
        assert_eq!(r["type"], "DistributedType.MULTI_CPU", "{r:?}");
        // 384 samples over 6 ranks in batches of 16, 2 epochs.
        assert_eq!(r["steps"], "8", "{r:?}");
        let host: usize = r["host"].parse().expect("host");
        let (rank, local): (u32, u32) =
            (r["rank"].parse().expect("rank"), r["local"].parse().expect("local"));
        assert_eq!(rank, NODE_OF_HOST[host] * 2 + local, "{r:?}");
    }
}

on_torches!([torch2_numpy]
fn accelerate_trains_on_three_hosts(t) {
    lab_or_skip!();
    check_accelerate(&run_framework(t, false, "accelerate_job.py", "ACCELERATE", &accelerate_cpu));
}
);

on_torches!([torch2_numpy]
fn accelerate_trains_on_three_hosts_behind_a_one_port_firewall(t) {
    lab_or_skip!();
    check_accelerate(&run_framework(t, true, "accelerate_job.py", "ACCELERATE", &accelerate_cpu));
}
);
