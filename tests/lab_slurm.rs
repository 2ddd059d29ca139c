//! Lab: meshd under SLURM's `srun` (issue 18.5; examples/slurm/train.sbatch). No SLURM here:
//! each host's meshd gets the task environment srun sets for
//! `srun -N3 --ntasks-per-node=1 meshd run ...` inside a 4-node allocation `gpu[01-02,07,09]`
//! (variables and values as slurmstepd and env_array_for_step set them), and the node names
//! resolve through each host's /etc/hosts, as on a cluster. meshd is given neither
//! `--peers` nor `--nnodes`: both come from the step's variables.

mod lab;
use lab::{Lab, meshd};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const NAMES: [&str; 3] = ["gpu01", "gpu02", "gpu07"];
const VARS: &str = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE NODE_RANK MASTER_ADDR SLURM_PROCID SLURM_LOCALID \
                    SLURM_NODEID SLURM_NTASKS SLURM_NPROCS SLURM_NTASKS_PER_NODE SLURM_STEP_NUM_TASKS \
                    SLURM_TASKS_PER_NODE SLURM_NODELIST SLURM_JOB_ID";

/// The environment srun gives task `i` (one task per node) of step 0 of job 4242, run on
/// the first three nodes of the allocation (`preserve_env`: run with `srun --preserve-env`).
fn srun_env(i: usize, preserve_env: bool) -> Vec<(String, String)> {
    let v = |k: &str, x: &str| (k.to_string(), x.to_string());
    let mut env = vec![
        v("SLURM_JOB_ID", "4242"),
        v("SLURM_JOBID", "4242"),
        v("SLURM_JOB_NAME", "train"),
        v("SLURM_JOB_PARTITION", "gpu"),
        v("SLURM_CLUSTER_NAME", "lab"),
        v("SLURM_SUBMIT_HOST", "login1"),
        v("SLURM_SUBMIT_DIR", "/tmp"),
        // The allocation: srun leaves these (SLURM_NODELIST too, from the batch step).
        v("SLURM_JOB_NODELIST", "gpu[01-02,07,09]"),
        v("SLURM_NODELIST", "gpu[01-02,07,09]"),
        v("SLURM_JOB_NUM_NODES", "4"),
        v("SLURM_JOB_CPUS_PER_NODE", "2(x4)"),
        // The step.
        v("SLURM_STEP_ID", "0"),
        v("SLURM_STEPID", "0"),
        v("SLURM_STEP_NODELIST", "gpu[01-02,07]"),
        v("SLURM_STEP_NUM_NODES", "3"),
        v("SLURM_STEP_NUM_TASKS", "3"),
        v("SLURM_STEP_TASKS_PER_NODE", "1(x3)"),
        v("SLURM_NNODES", "3"),
        v("SLURM_NTASKS", "3"),
        v("SLURM_NPROCS", "3"),
        v("SLURM_NTASKS_PER_NODE", "1"),
        v("SLURM_TASKS_PER_NODE", "1(x3)"),
        v("SLURM_CPUS_ON_NODE", "2"),
        v("SLURM_LAUNCH_NODE_IPADDR", "198.19.0.30"),
        v("SLURM_SRUN_COMM_HOST", "198.19.0.30"),
        v("SLURM_SRUN_COMM_PORT", "41234"),
        v("SLURM_STEP_LAUNCHER_PORT", "41234"),
        // The task (slurmstepd).
        v("SLURM_PROCID", &i.to_string()),
        v("SLURM_LOCALID", "0"),
        v("SLURM_NODEID", &i.to_string()),
        v("SLURM_GTIDS", &i.to_string()),
        v("SLURMD_NODENAME", NAMES[i]),
        v("SLURM_TOPOLOGY_ADDR", NAMES[i]),
        v("SLURM_TASK_PID", "4711"),
        v("MESHD_TOKEN", "lab-slurm-token"),
    ];
    if preserve_env {
        // `srun --preserve-env` (-E): SLURM_NNODES, SLURM_NTASKS and SLURM_TASKS_PER_NODE
        // keep the batch step's values, the allocation's.
        for (k, x) in [
            ("SLURM_NNODES", "4"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NPROCS", "4"),
            ("SLURM_TASKS_PER_NODE", "1(x4)"),
        ] {
            env.retain(|(a, _)| a != k);
            env.push(v(k, x));
        }
    }
    env
}

/// Starts the step: meshd on every host with srun's variables, hostlist names in /etc/hosts
/// (gpu09, the allocation's fourth node, resolves nowhere: it runs no task of this step).
/// Returns every rank's printed variables and each host's stderr.
fn run_step(lab: &mut Lab, preserve_env: bool) -> (Vec<BTreeMap<String, String>>, Vec<String>) {
    let hosts: String =
        NAMES.iter().zip(&lab.hosts).map(|(n, h)| format!("{} {n}.cluster {n}\n", h.eth1)).collect();
    for i in 0..3 {
        lab.hosts_file(i, &hosts);
    }
    let script = format!(
        "printf 'ENV'; for v in {VARS}; do eval printf \"' %s=%s'\" $v \\\"\\${{$v}}\\\"; done; echo"
    );
    let args =
        [meshd(), "run", "--nproc-per-node", "2", "--rdzv-timeout", "60s", "--", "sh", "-c", script.as_str()];
    let ks: Vec<usize> = (0..3)
        .map(|i| {
            let env = srun_env(i, preserve_env);
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            lab.spawn(i, &args, &env)
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let mut ranks = Vec::new();
    let mut errs = Vec::new();
    for (i, k) in ks.into_iter().enumerate() {
        let (code, out, err) = lab.wait(k, deadline.saturating_duration_since(std::time::Instant::now()));
        assert_eq!(code, Some(0), "host {i} ({}) failed:\n{out}\n{err}", NAMES[i]);
        for l in out.lines().filter_map(|l| l.split_once("] ENV ")).map(|(_, kv)| kv) {
            ranks.push(
                l.split_whitespace()
                    .filter_map(|p| p.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            );
        }
        errs.push(err);
    }
    (ranks, errs)
}

/// The job forms from the step's compressed hostlist alone: `--nnodes` from the step's node
/// count, `--peers` from SLURM_STEP_NODELIST (names resolved through /etc/hosts), never the
/// allocation's gpu09.
#[test]
fn an_srun_step_forms_the_job_from_its_hostlist_names() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let (ranks, errs) = run_step(&mut lab, false);
    let got: BTreeSet<u32> = ranks.iter().map(|r| r["RANK"].parse().expect("rank")).collect();
    assert_eq!(got, (0..6).collect::<BTreeSet<_>>(), "{ranks:?}");
    assert_eq!(ranks.len(), 6, "every rank once: {ranks:?}");
    for r in &ranks {
        assert_eq!(r["WORLD_SIZE"], "6", "{r:?}");
        assert_eq!(r["MASTER_ADDR"], "198.19.0.7", "{r:?}");
    }
    for (i, e) in errs.iter().enumerate() {
        assert!(!e.contains("gpu09"), "host {i} looked for the allocation's gpu09, not in its step:\n{e}");
    }
}

/// Under srun, ranks inherit srun's task variables (one task per node: SLURM_PROCID = the
/// node's task, SLURM_NTASKS = nodes), which Lightning's SLURMEnvironment (chosen whenever
/// a script passes it, e.g. for auto-requeue) reads as its ranks. meshd rewrites them to
/// describe its ranks as if srun had started one task per rank.
#[test]
fn ranks_see_slurm_task_variables_that_match_their_ranks() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let (ranks, _) = run_step(&mut lab, false);
    assert_eq!(ranks.len(), 6, "{ranks:?}");
    let nodes: BTreeMap<&str, &str> =
        ranks.iter().map(|r| (r["NODE_RANK"].as_str(), r["MASTER_ADDR"].as_str())).collect();
    assert_eq!(nodes.len(), 3);
    for r in &ranks {
        assert_eq!(r["SLURM_PROCID"], r["RANK"], "{r:?}");
        assert_eq!(r["SLURM_LOCALID"], r["LOCAL_RANK"], "{r:?}");
        assert_eq!(r["SLURM_NODEID"], r["NODE_RANK"], "{r:?}");
        assert_eq!(r["SLURM_NTASKS"], "6", "{r:?}");
        assert_eq!(r["SLURM_NPROCS"], "6", "{r:?}");
        assert_eq!(r["SLURM_STEP_NUM_TASKS"], "6", "{r:?}");
        assert_eq!(r["SLURM_NTASKS_PER_NODE"], "2", "{r:?}");
        assert_eq!(r["SLURM_TASKS_PER_NODE"], "2(x3)", "{r:?}");
        assert_eq!(r["SLURM_JOB_ID"], "4242", "job-level variables stay: {r:?}");
        // Lightning's SLURMEnvironment takes MASTER_ADDR from SLURM_NODELIST's first entry:
        // the node addresses in node-rank order, the master first.
        let first = r["SLURM_NODELIST"].split(',').next().expect("nodelist");
        assert_eq!(first, r["MASTER_ADDR"], "{r:?}");
        assert_eq!(r["SLURM_NODELIST"].split(',').count(), 3, "{r:?}");
    }
}

/// `srun --preserve-env` leaves SLURM_NNODES at the allocation's 4: `--nnodes` must come
/// from SLURM_STEP_NUM_NODES (3), or meshd waits for a fourth node until --rdzv-timeout.
#[test]
fn an_srun_preserve_env_step_waits_for_the_step_nodes_only() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let (ranks, _) = run_step(&mut lab, true);
    assert_eq!(ranks.len(), 6, "{ranks:?}");
    assert!(ranks.iter().all(|r| r["WORLD_SIZE"] == "6"), "{ranks:?}");
}
