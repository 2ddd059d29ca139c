//! Lab: a straggler of an earlier job with the same run id (an earlier `srun` step in the
//! same allocation, the same token) keeps sending `Abort` and `Done` for round 0 while a new
//! job runs on other nodes (issue 16, item 11). Lifecycle messages count only from the
//! roster of the round they name: the new job neither stops nor finishes early.

mod hostile;
mod lab;

use lab::Lab;
use meshd::mesh::stable_hash;
use meshd::proto::membership::{Delivery, Membership, MembershipConfig};
use meshd::proto::rendezvous::Message;
use meshd::proto::wire::Frame;
use meshd::proto::{NodeMeta, NodeState};
use meshd::transport::auth::Token;
use meshd::transport::{Transport, TransportConfig, TransportEvent};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[test]
fn a_straggler_of_an_earlier_job_neither_aborts_nor_finishes_the_new_one() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let job_hosts: Vec<SocketAddr> =
        [0, 1].iter().map(|i| format!("{}:29400", lab.hosts[*i].eth1).parse().expect("addr")).collect();
    // The straggler: host 2, the lab's token, the default run id, a job of its own under way.
    let straggler_addr: SocketAddr = format!("{}:29400", lab.hosts[2].eth1).parse().expect("addr");
    // The straggler: a member of the same run that says it is Running, driven by hand (the
    // membership core over a transport), sending Abort and Done of round 0 to the new job.
    let straggler = hostile::in_netns(&lab.hosts[2].ns, move || {
        hostile::rt().block_on(async move {
            let me = meshd::random_node_id();
            let run_hash = stable_hash(&[b"meshd-default"]);
            let mut tc = TransportConfig::new(me, 29400);
            tc.token = Some(Token::new("lab-default-token"));
            tc.run_hash = run_hash;
            let (transport, mut events) = Transport::bind(tc).expect("straggler transport");
            let meta = NodeMeta {
                gossip_addr: Some(straggler_addr),
                hostname: "straggler".into(),
                nproc: 1,
                run_hash,
                state: NodeState::Running,
                nnodes_min: 2,
                nnodes_max: 2,
                ..NodeMeta::default()
            };
            let mut members =
                Membership::new(me, straggler_addr, meta, MembershipConfig::default(), 7, Instant::now());
            members.add_seeds(&job_hosts, Instant::now());
            let end = Instant::now() + Duration::from_secs(12);
            let mut sent = 0u32;
            let mut next = Instant::now() + Duration::from_secs(2);
            while Instant::now() < end {
                while let Some(t) = members.poll_transmit() {
                    transport.send(t.to, &Frame::Gossip(t.msg), t.delivery == Delivery::Reliable);
                }
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
                        transport.send(*a, &Frame::Rdzv(abort), true);
                        transport.send(*a, &Frame::Rdzv(Message::Done { restart: 0 }), true);
                        sent += 1;
                    }
                    next = Instant::now() + Duration::from_millis(200);
                }
                let wake = members.poll_timeout().unwrap_or(next).min(next).max(Instant::now());
                tokio::select! {
                    ev = events.recv() => match ev {
                        Some(TransportEvent::Frame { from, frame: Frame::Gossip(m), .. }) => {
                            members.handle_message(from, m, Instant::now())
                        }
                        Some(_) => {}
                        None => break,
                    },
                    _ = tokio::time::sleep_until(wake.into()) => members.handle_timeout(Instant::now()),
                }
            }
            members.leave(Instant::now());
            while let Some(t) = members.poll_transmit() {
                transport.send(t.to, &Frame::Gossip(t.msg), t.delivery == Delivery::Reliable);
            }
            transport.shutdown().await;
            sent
        })
    });
    std::thread::sleep(Duration::from_secs(1));
    // The new job on hosts 0 and 1: runs 4 s, all ranks exit 0.
    let peers = format!("{},{}", lab.hosts[0].eth1, lab.hosts[1].eth1);
    let args = lab
        .meshd_run()
        .nnodes("2")
        .peers(&peers)
        .flags(&["--rdzv-timeout", "30s", "--nproc-per-node", "1"])
        .cmd(&["sh", "-c", "sleep 4; echo RANK $RANK DONE"]);
    let t = Instant::now();
    let ks: Vec<usize> = (0..2).map(|i| lab.spawn(i, &args, &[])).collect();
    let res = lab.wait_all(ks, Duration::from_secs(40));
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
