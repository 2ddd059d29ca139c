//! Lab: membership over real QUIC between 6 namespaced hosts.

mod lab;
use lab::{Lab, meshd};
use std::time::{Duration, Instant};

/// Host i is told only about host (i+1) % n: a chain, no host knows everyone.
fn spawn_chain(lab: &mut Lab, extra: &[&str], cmd: &[&str]) -> Vec<usize> {
    let n = lab.hosts.len();
    let nn = n.to_string();
    (0..n)
        .map(|i| {
            let peer = lab.hosts[(i + 1) % n].eth1.clone();
            let mut args = vec![meshd(), "run", "--nnodes", &nn, "--peers", &peer, "--rdzv-timeout", "60s"];
            args.extend_from_slice(extra);
            args.push("--");
            args.extend_from_slice(cmd);
            lab.spawn(i, &args, &[("MESHD_TOKEN", "members")])
        })
        .collect()
}

#[test]
fn six_hosts_each_knowing_one_member_converge_and_see_everyone() {
    lab_or_skip!();
    let mut lab = Lab::new(6);
    let ks = spawn_chain(&mut lab, &[], &["sleep", "4"]);
    std::thread::sleep(Duration::from_secs(2));
    // Every host's meshd knows all 6, alive, though each was given one address.
    for i in 0..6 {
        let q = lab.spawn(i, &[meshd(), "status", "--json"], &[("MESHD_TOKEN", "members")]);
        let (code, out, err) = lab.wait(q, Duration::from_secs(10));
        assert_eq!(code, Some(0), "host {i}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
        let alive =
            v["members"].as_array().expect("members").iter().filter(|m| m["health"] == "alive").count();
        assert_eq!(alive, 6, "host {i} sees: {v}");
    }
    for (i, k) in ks.into_iter().enumerate() {
        let (code, _, err) = lab.wait(k, Duration::from_secs(30));
        assert_eq!(code, Some(0), "host {i}: {err}");
    }
}

#[test]
fn killed_host_is_declared_dead_by_every_other() {
    lab_or_skip!();
    let mut lab = Lab::new(6);
    let ks = spawn_chain(&mut lab, &["--grace", "1s"], &["sleep", "60"]);
    std::thread::sleep(Duration::from_secs(4));
    let t = Instant::now();
    lab.crash(3); // 198.19.0.44
    for (i, k) in ks.into_iter().enumerate() {
        if i == 3 {
            continue;
        }
        let (code, _, err) = lab.wait(k, Duration::from_secs(30));
        assert_eq!(code, Some(1), "host {i}:\n{err}");
        assert!(
            err.contains("198.19.0.44")
                && (err.contains("stopped answering") || err.contains("job stopped by")),
            "host {i} must learn that 198.19.0.44 died:\n{err}"
        );
    }
    eprintln!("FIGURE 6-host kill-to-all-exited: {:?}", t.elapsed());
}

#[test]
fn partition_heals_and_everyone_is_back() {
    lab_or_skip!();
    let mut lab = Lab::new(6);
    // The job runs until a file-less marker: the first round sleeps, the restarted round ends.
    let script = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 60; fi; echo BACK world=$WORLD_SIZE";
    let ks = spawn_chain(&mut lab, &["--max-restarts", "1", "--grace", "1s"], &["sh", "-c", script]);
    std::thread::sleep(Duration::from_secs(4));
    // Cut {0,1,2} from {3,4,5}: each side declares the other dead and stops round 0.
    for i in 0..3 {
        lab.partition(i, &[3, 4, 5]);
    }
    for i in 3..6 {
        lab.partition(i, &[0, 1, 2]);
    }
    std::thread::sleep(Duration::from_secs(6));
    for i in 0..6 {
        lab.heal(i);
    }
    // After healing, the halves find each other again and the restarted job runs on all 6.
    for (i, k) in ks.into_iter().enumerate() {
        let (code, out, err) = lab.wait(k, Duration::from_secs(60));
        assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
        assert!(out.contains("BACK world=6"), "host {i}:\n{out}\n{err}");
    }
}
