use super::*;
use meshd_proto::rendezvous::RosterMember;

fn roster() -> Roster {
    let m = |id: u128, ip: &str, nproc| RosterMember {
        id: NodeId::from_u128(id),
        addr: format!("{ip}:29400").parse().expect("addr"),
        nproc,
        hostname: format!("h{id}"),
    };
    Roster {
        run_hash: 1,
        restart: 2,
        epoch: 1,
        master_port: 29511,
        members: vec![m(5, "198.19.0.7", 2), m(1, "198.19.0.19", 2), m(9, "198.19.0.30", 2)],
    }
}

fn get<'a>(env: &'a [(String, String)], k: &str) -> Option<&'a str> {
    env.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str())
}

#[test]
fn torchrun_environment_of_a_middle_rank() {
    let r = roster();
    let env = rank_env(&r, 1, 1, "eth1", "198.19.0.19".parse().expect("ip"), "run-x", 3, "nccl", &|_| false);
    let want = [
        ("RANK", "3"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "6"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("GROUP_RANK", "1"),
        ("NODE_RANK", "1"),
        ("GROUP_WORLD_SIZE", "3"),
        ("ROLE_NAME", "default"),
        ("ROLE_RANK", "3"),
        ("ROLE_WORLD_SIZE", "6"),
        ("MASTER_ADDR", "198.19.0.7"),
        ("MASTER_PORT", "29511"),
        ("TORCHELASTIC_RUN_ID", "run-x"),
        ("TORCHELASTIC_RESTART_COUNT", "2"),
        ("TORCHELASTIC_MAX_RESTARTS", "3"),
        ("TORCHELASTIC_USE_AGENT_STORE", "False"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        ("OMP_NUM_THREADS", "1"),
        ("NCCL_SOCKET_IFNAME", "=eth1"),
        ("GLOO_SOCKET_IFNAME", "eth1"),
        ("MESHD_IFACE", "eth1"),
        ("MESHD_NODE_ADDR", "198.19.0.19"),
        ("MESHD_COLLECTIVE", "nccl"),
    ];
    for (k, v) in want {
        assert_eq!(get(&env, k), Some(v), "{k}");
    }
}

#[test]
fn user_settings_win_and_single_process_keeps_omp() {
    let mut r = roster();
    r.members[0].nproc = 1;
    let user = |k: &str| k == "NCCL_SOCKET_IFNAME" || k == "TORCH_NCCL_ASYNC_ERROR_HANDLING";
    let env = rank_env(&r, 0, 0, "eth1", "198.19.0.7".parse().expect("ip"), "r", 0, "quic", &user);
    assert_eq!(get(&env, "NCCL_SOCKET_IFNAME"), None);
    assert_eq!(get(&env, "TORCH_NCCL_ASYNC_ERROR_HANDLING"), None);
    assert_eq!(get(&env, "OMP_NUM_THREADS"), None, "one process per node: OMP untouched");
    assert_eq!(get(&env, "GLOO_SOCKET_IFNAME"), Some("eth1"));
    assert_eq!(get(&env, "RANK"), Some("0"));
    assert_eq!(get(&env, "WORLD_SIZE"), Some("5"));
}

#[test]
fn global_ranks_form_a_permutation() {
    let r = roster();
    let mut seen = Vec::new();
    for n in 0..r.members.len() {
        for l in 0..r.members[n].nproc {
            let env =
                rank_env(&r, n, l, "eth1", "127.0.0.1".parse().expect("ip"), "r", 0, "nccl", &|_| false);
            seen.push(get(&env, "RANK").expect("rank").parse::<u32>().expect("num"));
        }
    }
    seen.sort();
    assert_eq!(seen, (0..6).collect::<Vec<_>>());
}

#[test]
fn torchrun_per_node_flags_are_cross_checked_naming_both_values() {
    let r = roster();
    // Agreeing flags: no warning (the master by address or by host name).
    assert!(cross_check(Some(1), Some("198.19.0.7"), Some(29511), &r, 1).is_empty());
    assert!(cross_check(None, Some("h5"), None, &r, 1).is_empty());
    let w = cross_check(Some(0), Some("10.9.9.9"), Some(29500), &r, 2);
    assert_eq!(w.len(), 3, "{w:?}");
    assert!(w[0].contains("--node-rank 0") && w[0].contains(", 2 "), "{}", w[0]);
    assert!(w[1].contains("--master-addr 10.9.9.9") && w[1].contains("198.19.0.7"), "{}", w[1]);
    assert!(w[2].contains("--master-port 29500") && w[2].contains("29511"), "{}", w[2]);
}

#[test]
fn under_slurm_ranks_get_task_variables_of_their_own() {
    let mut r = roster();
    r.members[0].nproc = 1;
    let slurm = |k: &str| k == "SLURM_JOB_ID";
    let env = rank_env(&r, 1, 1, "eth1", "198.19.0.19".parse().expect("ip"), "r", 0, "nccl", &slurm);
    let want = [
        ("SLURM_PROCID", "2"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_NTASKS", "5"),
        ("SLURM_NPROCS", "5"),
        ("SLURM_STEP_NUM_TASKS", "5"),
        ("SLURM_NTASKS_PER_NODE", "2"),
        ("SLURM_TASKS_PER_NODE", "1,2(x2)"),
        ("SLURM_NNODES", "3"),
        ("SLURM_NODELIST", "198.19.0.7,198.19.0.19,198.19.0.30"),
        ("SLURM_GTIDS", "1,2"),
    ];
    for (k, v) in want {
        assert_eq!(get(&env, k), Some(v), "{k}");
    }
    assert_eq!(get(&env, "SLURM_PROCID"), get(&env, "RANK"));
    // Outside SLURM nothing SLURM-like appears (Lightning would detect a SLURM job).
    let env = rank_env(&r, 1, 1, "eth1", "198.19.0.19".parse().expect("ip"), "r", 0, "nccl", &|_| false);
    assert!(env.iter().all(|(k, _)| !k.starts_with("SLURM_")), "{env:?}");
}

#[test]
fn fault_tolerance_node_gives_each_node_a_world_of_its_own() {
    let r = roster();
    let mut env =
        rank_env(&r, 2, 1, "eth1", "198.19.0.30".parse().expect("ip"), "run-x", 3, "nccl", &|_| false);
    env.push(("MESHD_NCCL_UNIQUE_ID".into(), "00".into()));
    let ft = FtEnv {
        group: 2,
        groups: 8,
        store: "198.19.0.30:40001".parse().expect("addr"),
        lighthouse: Some("127.0.0.1:40002".parse().expect("addr")),
        restarts: 1,
        hostname: url_host("198.19.0.30".parse().expect("ip")),
    };
    ft_rank_env(&mut env, 1, 2, &ft);
    let want = [
        ("RANK", "1"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("GROUP_RANK", "0"),
        ("NODE_RANK", "0"),
        ("GROUP_WORLD_SIZE", "1"),
        ("ROLE_RANK", "1"),
        ("ROLE_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "198.19.0.30"),
        ("MASTER_PORT", "40001"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", "1"),
        ("REPLICA_GROUP_ID", "2"),
        ("NUM_REPLICA_GROUPS", "8"),
        ("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:40002"),
        ("MESHD_HOSTNAME", "198.19.0.30"),
        ("GLOO_SOCKET_IFNAME", "eth1"),
    ];
    for (k, v) in want {
        assert_eq!(get(&env, k), Some(v), "{k}");
    }
    assert_eq!(get(&env, "MESHD_NCCL_UNIQUE_ID"), None, "each group makes its own NCCL id");
    let names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
    let mut dedup = names.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(names.len(), dedup.len(), "every variable once: {names:?}");
}

#[test]
fn a_url_host_is_the_address_with_ipv6_in_brackets() {
    assert_eq!(url_host("198.19.0.30".parse().expect("ip")), "198.19.0.30");
    assert_eq!(url_host("::ffff:198.19.0.30".parse().expect("ip")), "198.19.0.30");
    assert_eq!(url_host("fd00::30".parse().expect("ip")), "[fd00::30]");
}
