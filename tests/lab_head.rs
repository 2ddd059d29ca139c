//! Lab: the identical command as users write it, every node pointed at one head node
//! (issue 15), and names that resolve late (issue 21). The lab's shape: eth0 198.18.0.4 on
//! every host (useless), eth1 the real network; the head is host 5 (198.19.0.25), which is
//! NOT the master (host 1, 198.19.0.7, has the lowest eth1 address).

mod lab;
use lab::{Lab, meshd};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const HEAD: usize = 5;
const TOKEN: (&str, &str) = ("MESHD_TOKEN", "lab-secret");
const RANK_LINE: &str =
    "echo ENV RANK=$RANK MASTER_ADDR=$MASTER_ADDR NODE_ADDR=$MESHD_NODE_ADDR WORLD=$WORLD_SIZE";

fn run_args<'a>(nnodes: &'a str, peers: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![meshd(), "run", "--nnodes", nnodes, "--peers", peers, "--rdzv-timeout", "60s"];
    v.extend_from_slice(extra);
    v.extend_from_slice(&["--nproc-per-node", "1", "--", "sh", "-c", RANK_LINE]);
    v
}

/// Every host ran, every rank saw the lowest eth1 address as master, ranks 0..n.
fn check_job(lab: &Lab, res: &[(Option<i32>, String, String)]) {
    let n = lab.hosts.len();
    let master =
        lab.hosts.iter().map(|h| h.eth1.parse::<std::net::Ipv4Addr>().expect("ip")).min().expect("hosts");
    let mut ranks = BTreeSet::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i} ({}) failed:\n{out}\n{err}", lab.hosts[i].eth1);
        let line = out
            .lines()
            .find(|l| l.contains("ENV RANK="))
            .unwrap_or_else(|| panic!("host {i}: no rank:\n{out}\n{err}"));
        assert!(line.contains(&format!("MASTER_ADDR={master} ")), "host {i}: {line}");
        assert!(line.contains(&format!("NODE_ADDR={} ", lab.hosts[i].eth1)), "host {i}: {line}");
        assert!(line.contains(&format!("WORLD={n}")), "host {i}: {line}");
        let rank: u32 = line
            .split("RANK=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|r| r.parse().ok())
            .expect("rank");
        ranks.insert(rank);
    }
    assert_eq!(ranks, (0..n as u32).collect::<BTreeSet<_>>());
}

#[test]
fn six_hosts_all_given_only_the_head_address() {
    lab_or_skip!();
    let mut lab = Lab::new(6);
    let head = lab.hosts[HEAD].eth1.clone();
    let res = lab.run_on_all(&run_args("6", &head, &[]), &[TOKEN], Duration::from_secs(90));
    check_job(&lab, &res);
    // The head said why it announced its eth1 address.
    assert!(res[HEAD].2.contains("seed"), "head's log:\n{}", res[HEAD].2);
}

#[test]
fn six_hosts_all_given_only_the_head_name() {
    lab_or_skip!();
    let mut lab = Lab::new(6);
    let head = lab.hosts[HEAD].eth1.clone();
    for i in 0..6 {
        lab.hosts_file(i, &format!("{head} head-node\n"));
    }
    let res = lab.run_on_all(&run_args("6", "head-node", &[]), &[TOKEN], Duration::from_secs(90));
    check_job(&lab, &res);
}

#[test]
fn the_head_starts_ten_seconds_after_the_others() {
    lab_or_skip!();
    let mut lab = Lab::new(6);
    let head = lab.hosts[HEAD].eth1.clone();
    let args = run_args("6", &head, &[]);
    let mut ks: Vec<usize> = (0..6).filter(|i| *i != HEAD).map(|i| lab.spawn(i, &args, &[TOKEN])).collect();
    std::thread::sleep(Duration::from_secs(10));
    let k_head = lab.spawn(HEAD, &args, &[TOKEN]);
    ks.insert(HEAD, k_head);
    let deadline = Instant::now() + Duration::from_secs(90);
    let res: Vec<_> =
        ks.into_iter().map(|k| lab.wait(k, deadline.saturating_duration_since(Instant::now()))).collect();
    check_job(&lab, &res);
}

/// Issue 21: a name that does not resolve at start is tried again, and the node whose only
/// other entry is that name does not fall back to loopback.
#[test]
fn a_head_name_that_appears_in_the_hosts_file_five_seconds_late() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let head = lab.hosts[1].eth1.clone();
    for i in 0..3 {
        lab.hosts_file(i, "# head-node is not published yet\n");
    }
    let args = run_args("3", "head-node", &[]);
    let ks: Vec<usize> = (0..3).map(|i| lab.spawn(i, &args, &[TOKEN])).collect();
    std::thread::sleep(Duration::from_secs(5));
    for i in 0..3 {
        lab.hosts_file(i, &format!("{head} head-node\n"));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let res: Vec<_> =
        ks.into_iter().map(|k| lab.wait(k, deadline.saturating_duration_since(Instant::now()))).collect();
    check_job(&lab, &res);
}

#[test]
fn doctor_and_bench_with_every_node_given_only_the_head_address() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let head = lab.hosts[2].eth1.clone();
    let doctor = [meshd(), "doctor", "--nnodes", "3", "--peers", &head, "--rdzv-timeout", "60s", "--json"];
    let res = lab.run_on_all(&doctor, &[TOKEN], Duration::from_secs(60));
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "doctor on host {i}:\n{out}\n{err}");
        let v: serde_json::Value =
            serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("host {i}: {e}: {out}"));
        assert_eq!(v["iface"], "eth1", "host {i}: {v}");
        assert_eq!(v["master"], "198.19.0.7", "host {i}: {v}");
        assert_eq!(v["ok"], true, "host {i}: {v}");
    }
    let bench = lab
        .meshd_bench()
        .peers(&head)
        .flags(&["--rdzv-timeout", "60s", "--size", "65536", "--iters", "3"])
        .args(&["--json"]);
    let res = lab.run_on_all(&bench, &[TOKEN], Duration::from_secs(60));
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "bench on host {i}:\n{out}\n{err}");
        let v: serde_json::Value =
            serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("host {i}: {e}: {out}"));
        assert_eq!(v["nodes"], 3, "host {i}: {v}");
        assert!(v["results"][0]["busbw_gbs"].as_f64().is_some_and(|b| b > 0.0), "host {i}: {v}");
    }
}

/// A peer list that gives a multi-node job nothing to start from is refused at once,
/// naming what was listed and what is local, instead of waiting on loopback.
#[test]
fn a_list_with_only_loopback_is_refused_with_what_to_pass() {
    lab_or_skip!();
    let mut lab = Lab::new(1);
    let (code, _, err) = lab.run(
        0,
        &[meshd(), "run", "--nnodes", "2", "--peers", "127.0.0.1", "--", "true"],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("listed: 127.0.0.1:29400"), "{err}");
    assert!(err.contains("eth1 198.19.0.30") && err.contains("--nnodes 1"), "{err}");
}

/// `meshd ifaces --peers HEAD` on the head itself names the interface the head will
/// announce (the one holding its listed address), as `meshd run` does.
#[test]
fn ifaces_on_the_head_names_the_seed_interface() {
    lab_or_skip!();
    let mut lab = Lab::new(2);
    let head = lab.hosts[0].eth1.clone();
    let (code, out, err) =
        lab.run(0, &[meshd(), "ifaces", "--json", "--peers", &head], Duration::from_secs(20));
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["chosen"]["name"], "eth1", "{v}");
    assert_eq!(v["chosen"]["addr"], head.as_str(), "{v}");
    assert!(v["reason"].as_str().is_some_and(|r| r.contains("seed")), "{v}");
    // On another host the same list is proven by the route to the head.
    let (code, out, err) =
        lab.run(1, &[meshd(), "ifaces", "--json", "--peers", &head], Duration::from_secs(20));
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["chosen"]["name"], "eth1", "{v}");
}

/// 16 hosts from one identical command, all pointed at one head: one job, every rank, the
/// master the lowest address. Prints how long formation took on each node (its launch line).
#[test]
fn sixteen_hosts_form_one_job_through_the_head() {
    lab_or_skip!();
    let mut lab = Lab::new(16);
    let head = lab.hosts[HEAD].eth1.clone();
    let t = Instant::now();
    let res = lab.run_on_all(&run_args("16", &head, &[]), &[TOKEN], Duration::from_secs(120));
    let took = t.elapsed();
    check_job(&lab, &res);
    let roster: Vec<f64> = res
        .iter()
        .filter_map(|(_, _, err)| {
            let l = err.lines().find(|l| l.contains("join and roster"))?;
            l.split("join and roster ").nth(1)?.split_whitespace().next()?.parse().ok()
        })
        .collect();
    let max = roster.iter().cloned().fold(0.0, f64::max);
    eprintln!(
        "FIGURE 16 hosts through the head: every node's join and roster <= {max:.3} s; all exited in {took:?}"
    );
}
