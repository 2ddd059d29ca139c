//! Lab: a straggler of an earlier job with the same run id (an earlier `srun` step in the
//! same allocation, the same token) keeps sending `Abort` and `Done` for round 0 while a new
//! job runs on other nodes (issue 16, item 11). Lifecycle messages count only from the
//! roster of the round they name: the new job neither stops nor finishes early.

mod hostile;
mod lab;

use lab::{Lab, meshd};
use meshd::mesh::{Mesh, MeshConfig};
use meshd::proto::NodeState;
use meshd::proto::membership::MembershipConfig;
use meshd::proto::rendezvous::Message;
use meshd::transport::auth::Token;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[test]
fn a_straggler_of_an_earlier_job_neither_aborts_nor_finishes_the_new_one() {
    if !lab::available() {
        return;
    }
    let mut lab = Lab::new(3);
    let job_hosts: Vec<SocketAddr> =
        [0, 1].iter().map(|i| format!("{}:29400", lab.hosts[*i].eth1).parse().expect("addr")).collect();
    let seeds: Vec<(String, SocketAddr)> = job_hosts.iter().map(|a| (a.ip().to_string(), *a)).collect();
    // The straggler: host 2, the lab's token, the default run id, a job of its own under way.
    let straggler = hostile::in_netns(&lab.hosts[2].ns, move || {
        hostile::rt().block_on(async move {
            let mut mesh = Mesh::start(MeshConfig {
                node: meshd::random_node_id(),
                port: 29400,
                token: Some(Token::new("lab-default-token")),
                run_id: "meshd-default".into(),
                peers: seeds,
                unresolved: Vec::new(),
                resolve_timeout: Duration::from_secs(10),
                min_nodes: 2,
                max_nodes: 2,
                iface: None,
                nproc: 1,
                cmd_hash: 0,
                membership: MembershipConfig::default(),
                gso: true,
                cc: Default::default(),
            })
            .await
            .expect("straggler mesh");
            mesh.set_state(NodeState::Running, 0);
            let me = mesh.node();
            let end = Instant::now() + Duration::from_secs(12);
            let mut sent = 0u32;
            let mut next = Instant::now() + Duration::from_secs(2);
            while Instant::now() < end {
                if Instant::now() >= next {
                    for a in &job_hosts {
                        let abort = Message::Abort {
                            restart: 0,
                            node: me,
                            hostname: "straggler".into(),
                            rank: Some(0),
                            reason: "STRAGGLER of an earlier job stops everything".into(),
                            cause: None,
                        };
                        mesh.send(*a, abort);
                        mesh.send(*a, Message::Done { restart: 0 });
                        sent += 1;
                    }
                    next = Instant::now() + Duration::from_millis(200);
                }
                let _ = mesh.next(Some(next.min(end))).await;
            }
            mesh.shutdown().await;
            sent
        })
    });
    std::thread::sleep(Duration::from_secs(1));
    // The new job on hosts 0 and 1: runs 4 s, all ranks exit 0.
    let peers = format!("{},{}", lab.hosts[0].eth1, lab.hosts[1].eth1);
    let args = [
        meshd(),
        "run",
        "--nnodes",
        "2",
        "--peers",
        &peers,
        "--rdzv-timeout",
        "30s",
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        "sleep 4; echo RANK $RANK DONE",
    ];
    let t = Instant::now();
    let ks: Vec<usize> = (0..2).map(|i| lab.spawn(i, &args, &[])).collect();
    let res: Vec<_> = ks.into_iter().map(|k| lab.wait(k, Duration::from_secs(40))).collect();
    let took = t.elapsed();
    let sent = straggler.join().expect("straggler thread");
    assert!(sent > 10, "the straggler sent {sent} rounds of Abort and Done");
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i} must not be stopped by the straggler:\n{out}\n{err}");
        assert!(out.contains("DONE"), "host {i}'s rank ran to its end:\n{out}\n{err}");
        assert!(!err.contains("STRAGGLER"), "host {i} took the straggler's Abort:\n{err}");
    }
    assert!(took >= Duration::from_secs(4), "the straggler's Done must not end the job early: {took:?}");
    eprintln!("FIGURE straggler: {sent} rounds of Abort+Done ignored; job took {took:?}");
}
