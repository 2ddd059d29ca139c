//! Lab: fault scenarios. Nodes killed, restarted on the same address, partitioned, links
//! flapping and lossy, while meshd waits for nodes or while the job runs. Each test asserts
//! what meshd promises (no partial or split launch, every node stops and names the cause,
//! no orphaned ranks, nothing hangs) and prints one `FIGURE` line with what it measured;
//! collect them with `cargo test --test lab_faults -- --nocapture`. Deadlines are generous:
//! the figures are for reports, never asserted.

mod lab;
use lab::Lab;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const TOKEN: (&str, &str) = ("MESHD_TOKEN", "faults");

/// Every rank writes one marker file when it starts: `L.<node addr>.<rank>.<round>.<pid>`
/// holding "RANK WORLD_SIZE RESTART NODE_ADDR START_NS", so a test can count launches.
const MARK: &str = "echo \"$RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT $MESHD_NODE_ADDR $(date +%s%N)\" \
                    > \"$FAULTS_DIR/L.$MESHD_NODE_ADDR.$RANK.$TORCHELASTIC_RESTART_COUNT.$$\"";

/// A scratch directory for launch markers, removed on drop.
struct Marks(PathBuf);

#[derive(Debug)]
struct Launch {
    rank: u32,
    world: u32,
    restart: u32,
    node: String,
    /// Wall-clock start of the rank.
    at: SystemTime,
}

impl Marks {
    fn new(name: &str) -> Marks {
        let d = std::env::temp_dir().join(format!("meshd-faults-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("marker dir");
        Marks(d)
    }

    fn dir(&self) -> String {
        self.0.display().to_string()
    }

    fn launches(&self) -> Vec<Launch> {
        let mut v: Vec<Launch> = std::fs::read_dir(&self.0)
            .expect("marker dir")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("L."))
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .filter_map(|s| {
                let f: Vec<&str> = s.split_whitespace().collect();
                let ns: u64 = f.get(4)?.parse().ok()?;
                Some(Launch {
                    rank: f[0].parse().ok()?,
                    world: f[1].parse().ok()?,
                    restart: f[2].parse().ok()?,
                    node: f[3].to_string(),
                    at: UNIX_EPOCH + Duration::from_nanos(ns),
                })
            })
            .collect();
        v.sort_by_key(|l| (l.restart, l.rank));
        v
    }

    fn clear(&self) {
        for e in std::fs::read_dir(&self.0).expect("marker dir").flatten() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

impl Drop for Marks {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `meshd run` arguments: every host listed, `nnodes` expected, the rank script `script`
/// (run by `sh -c` after the launch marker).
fn run_args(lab: &Lab, nnodes: &str, extra: &[&str], script: &str) -> Vec<String> {
    let script = format!("{MARK}; {script}");
    lab.meshd_run().nnodes(nnodes).flags(&["--grace", "1s"]).flags(extra).cmd(&["sh", "-c", &script])
}

fn spawn(lab: &mut Lab, i: usize, args: &[String], marks: &Marks) -> usize {
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let dir = marks.dir();
    lab.spawn(i, &a, &[TOKEN, ("FAULTS_DIR", &dir)])
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// Time from `from` to the last (or first) rank start among `launches`.
fn launch_delay(launches: &[Launch], from: SystemTime, last: bool) -> Duration {
    let at = launches.iter().map(|l| l.at);
    let t = if last { at.max() } else { at.min() };
    t.and_then(|t| t.duration_since(from).ok()).unwrap_or_default()
}

/// Seconds of the day at which meshd logged the first line containing `needle` (its log
/// lines start with an RFC 3339 UTC time, `2026-01-02T03:04:05.678901Z`).
fn log_secs(err: &str, needle: &str) -> Option<f64> {
    let line = err.lines().find(|l| l.contains(needle))?;
    let t = line.split_whitespace().next()?.split_once('T')?.1.trim_end_matches('Z');
    let mut f = t.split(':');
    let (h, m, s): (f64, f64, f64) =
        (f.next()?.parse().ok()?, f.next()?.parse().ok()?, f.next()?.parse().ok()?);
    Some(h * 3600.0 + m * 60.0 + s)
}

/// Time between two log lines of one meshd (`from` first), if both are there.
fn log_span(err: &str, from: &str, to: &str) -> Option<Duration> {
    let (a, b) = (log_secs(err, from)?, log_secs(err, to)?);
    let d = if b >= a { b - a } else { b + 86_400.0 - a };
    Some(Duration::from_secs_f64(d))
}

/// Waits until no process is left in host `i`'s namespace (bounded); false if some remain.
fn namespace_empties(lab: &Lab, i: usize, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if lab.pids(i).is_empty() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    lab.pids(i).is_empty()
}

fn ps(pids: &[i32]) -> String {
    pids.iter()
        .map(|p| {
            let c = std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default();
            format!("{p}: {}", c.replace('\0', " "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Waits (at most 40 s) until `n` rank launches are marked; the caller asserts on them.
fn wait_for_launches(marks: &Marks, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(40);
    while marks.launches().len() < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Asserts exactly one launch of `world` ranks, all in round `restart`, one per rank.
fn assert_one_launch(launches: &[Launch], world: u32, restart: u32) {
    let mut ranks: Vec<u32> = launches.iter().filter(|l| l.restart == restart).map(|l| l.rank).collect();
    ranks.sort();
    assert_eq!(ranks, (0..world).collect::<Vec<_>>(), "exactly one launch of every rank: {launches:?}");
    for l in launches.iter().filter(|l| l.restart == restart) {
        assert_eq!(l.world, world, "WORLD_SIZE consistent: {launches:?}");
    }
}

/// Scenario 1: A node SIGKILLed while the others wait for it: nobody launches a partial job; at the
/// rendezvous deadline every waiting node fails, naming the node that never answered.
#[test]
fn node_killed_during_rendezvous_no_partial_launch_and_timeout_names_it() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("rdzv-kill");
    // Four nodes expected, three started: the rendezvous cannot complete.
    let args = run_args(&lab, "4", &["--rdzv-timeout", "12s"], "true");
    let start = Instant::now();
    let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &marks)).collect();
    std::thread::sleep(Duration::from_secs(3));
    lab.crash(2); // 198.19.0.19, mid-rendezvous
    let mut took = Duration::ZERO;
    for (i, &k) in ks.iter().enumerate().take(2) {
        let (code, out, err) = lab.wait(k, Duration::from_secs(40));
        took = took.max(start.elapsed());
        assert!(code.is_some(), "host {i} must not hang past its deadline:\n{err}");
        assert_eq!(code, Some(1), "host {i} must exit 1 (a timed-out rendezvous):\n{out}\n{err}");
        // They waited for the missing nodes until their deadline, not less.
        assert!(start.elapsed() >= Duration::from_secs(11), "host {i} gave up early:\n{err}");
        assert!(
            err.contains("rendezvous timed out")
                && (err.contains("never answered") || err.contains("198.19.0.19:29400 stopped answering"))
                && err.contains("198.19.0.19"),
            "host {i} must name the node that died:\n{err}"
        );
    }
    assert!(marks.launches().is_empty(), "no partial job: {:?}", marks.launches());
    eprintln!(
        "FIGURE 1 rdzv-kill: no launch; survivors exited at {} after start (--rdzv-timeout 12s), naming 198.19.0.19",
        secs(took)
    );
}

/// Scenario 2: meshd (only meshd, not its ranks) SIGKILLed on a worker while the job runs: every
/// other node stops its ranks and exits 1 naming the node, and the killed meshd's ranks do
/// not outlive it (no orphans on any host).
#[test]
fn meshd_killed_during_job_stops_everyone_and_leaves_no_orphans() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("job-kill");
    // `sleep` is a grandchild of meshd here (sh forks it), as Python's workers would be.
    let args = run_args(&lab, "3", &["--nproc-per-node", "2", "--rdzv-timeout", "60s"], "sleep 60; true");
    let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &marks)).collect();
    wait_for_launches(&marks, 6);
    assert_eq!(marks.launches().len(), 6, "the job must start: {:?}", marks.launches());
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    lab.signal(ks[2], libc::SIGKILL); // meshd on 198.19.0.19
    let _ = lab.wait(ks[2], Duration::from_secs(5)); // reaped: only its ranks could remain
    let mut last = Duration::ZERO;
    for (i, &k) in ks.iter().enumerate().take(2) {
        let (code, _, err) = lab.wait(k, Duration::from_secs(30));
        last = last.max(t.elapsed());
        assert_eq!(code, Some(1), "host {i} must fail, not hang:\n{err}");
        assert!(
            err.contains("198.19.0.19")
                && (err.contains("stopped answering")
                    || err.contains("job stopped by")
                    || err.contains("left the mesh")),
            "host {i} must name the dead node:\n{err}"
        );
    }
    for i in 0..3 {
        assert!(
            namespace_empties(&lab, i, Duration::from_secs(10)),
            "host {i}: processes outlived the job:\n{}",
            ps(&lab.pids(i))
        );
    }
    eprintln!("FIGURE 2 job-kill: meshd SIGKILL on a worker -> both others exited {}", secs(last));
}

/// Scenario 3: A 2|1 partition while the nodes wait: neither side launches (a fixed-size roster needs
/// every member's acknowledgement); once healed, one job of the right size starts.
#[test]
fn partition_2_1_during_rendezvous_no_split_launch_then_one_job_after_heal() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("rdzv-part");
    // Host 1 (198.19.0.7, the would-be master) alone; hosts 0 and 2 together.
    lab.partition(1, &[0, 2]);
    lab.partition(0, &[1]);
    lab.partition(2, &[1]);
    let args = run_args(&lab, "3", &["--nproc-per-node", "2", "--rdzv-timeout", "60s"], "sleep 1");
    let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &marks)).collect();
    std::thread::sleep(Duration::from_secs(6));
    assert!(marks.launches().is_empty(), "no launch while partitioned: {:?}", marks.launches());
    for (i, &k) in ks.iter().enumerate() {
        assert!(!lab.exited(k), "host {i} must keep waiting while partitioned");
    }
    let healed = SystemTime::now();
    for i in 0..3 {
        lab.heal(i);
    }
    for (i, &k) in ks.iter().enumerate() {
        let (code, out, err) = lab.wait(k, Duration::from_secs(60));
        assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
    }
    let launches = marks.launches();
    assert_one_launch(&launches, 6, 0);
    eprintln!(
        "FIGURE 3 rdzv-partition: no launch in 6 s of partition; heal -> all 6 ranks started {}",
        secs(launch_delay(&launches, healed, true))
    );
}

/// Scenario 4a: meshd killed and started again on the same host and port while the others wait: the
/// new process (new node id, same address) joins, the dead one is not counted, and one
/// job of three distinct nodes starts.
#[test]
fn node_restarted_on_same_address_during_rendezvous_forms_one_job() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("rdzv-restart");
    let args = run_args(&lab, "3", &["--rdzv-timeout", "60s"], "sleep 1");
    let a = spawn(&mut lab, 0, &args, &marks);
    let b = spawn(&mut lab, 1, &args, &marks);
    std::thread::sleep(Duration::from_secs(3));
    lab.signal(b, libc::SIGKILL); // the master-to-be (198.19.0.7) dies mid-rendezvous...
    let _ = lab.wait(b, Duration::from_secs(5));
    let restarted = SystemTime::now();
    let b2 = spawn(&mut lab, 1, &args, &marks); // ...and comes back on the same address
    let c = spawn(&mut lab, 2, &args, &marks);
    let res: Vec<_> = [a, b2, c].into_iter().map(|k| lab.wait(k, Duration::from_secs(60))).collect();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}\nall hosts:\n{res:#?}");
    }
    let fresh_err = &res[1].2;
    let launches = marks.launches();
    assert_one_launch(&launches, 3, 0);
    let mut nodes: Vec<&str> = launches.iter().map(|l| l.node.as_str()).collect();
    nodes.sort();
    assert_eq!(nodes, ["198.19.0.19", "198.19.0.30", "198.19.0.7"], "one rank per host: {launches:?}");
    eprintln!(
        "FIGURE 4a rdzv-restart-same-addr: restarted meshd's join -> roster agreed {}; restart (process start) -> all ranks up {}",
        secs(log_span(fresh_err, "joining:", "roster agreed").unwrap_or_default()),
        secs(launch_delay(&launches, restarted, true))
    );
}

/// Scenario 4b: With --max-restarts 1, meshd SIGKILLed on a worker mid-job and started again at
/// once on the same address: the others stop round 0, the new process joins round 1 and
/// the job completes everywhere.
#[test]
fn node_restarted_on_same_address_during_job_rejoins_with_max_restarts() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("job-restart");
    let script = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 60; fi; echo ROUND=$TORCHELASTIC_RESTART_COUNT";
    let args = run_args(&lab, "3", &["--max-restarts", "1", "--rdzv-timeout", "60s"], script);
    let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &marks)).collect();
    wait_for_launches(&marks, 3);
    assert_eq!(marks.launches().len(), 3, "round 0 must start: {:?}", marks.launches());
    let killed = SystemTime::now();
    lab.signal(ks[2], libc::SIGKILL);
    let _ = lab.wait(ks[2], Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(500));
    let fresh = spawn(&mut lab, 2, &args, &marks);
    for (i, k) in [(0, ks[0]), (1, ks[1]), (2, fresh)] {
        let (code, out, err) = lab.wait(k, Duration::from_secs(60));
        assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
        assert!(out.contains("ROUND=1"), "host {i} must run round 1:\n{out}\n{err}");
    }
    let launches = marks.launches();
    assert_one_launch(&launches, 3, 1);
    let round1: Vec<Launch> = launches.into_iter().filter(|l| l.restart == 1).collect();
    eprintln!(
        "FIGURE 4b job-restart-same-addr: SIGKILL -> round 1 running everywhere {} (restart 0.5 s after the kill)",
        secs(launch_delay(&round1, killed, true))
    );
}

/// Runs a 6 s job on every host and flaps host 2's eth1 for `down` a second after it
/// started: (exit code and stderr per host, time from the flap to the last exit).
fn flap_job(lab: &mut Lab, marks: &Marks, down: Duration) -> (Vec<(Option<i32>, String)>, Duration) {
    marks.clear();
    let args = run_args(lab, "3", &["--rdzv-timeout", "60s"], "sleep 6");
    let ks: Vec<usize> = (0..3).map(|i| spawn(lab, i, &args, marks)).collect();
    wait_for_launches(marks, 3);
    assert_eq!(marks.launches().len(), 3, "the job must start: {:?}", marks.launches());
    std::thread::sleep(Duration::from_secs(1));
    let t = Instant::now();
    lab.flap(2, down);
    let mut res = Vec::new();
    let mut last = Duration::ZERO;
    for k in ks {
        let (code, _, err) = lab.wait(k, Duration::from_secs(60));
        last = last.max(t.elapsed());
        res.push((code, err));
    }
    (res, last)
}

/// Scenario 5: eth1 of one host down then up while the job runs. A flap shorter than failure
/// detection is ridden out; a longer one tears the job down on every node, each naming a
/// node that stopped answering. Either way: every node exits (no hang), all agree, no
/// processes are left behind.
#[test]
fn link_flap_during_job_is_survived_or_torn_down_cleanly() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("flap");
    let mut figures = Vec::new();
    let ms = Duration::from_millis;
    for down in [ms(300), ms(800), ms(1500), ms(4000)] {
        let (res, took) = flap_job(&mut lab, &marks, down);
        for (i, (code, err)) in res.iter().enumerate() {
            assert!(code.is_some(), "flap {down:?}: host {i} hung:\n{err}");
        }
        let survived = res.iter().all(|(c, _)| *c == Some(0));
        if !survived {
            for (i, (code, err)) in res.iter().enumerate() {
                assert_ne!(*code, Some(0), "flap {down:?}: host {i} succeeded while others failed:\n{err}");
                assert!(
                    err.contains("stopped answering")
                        || err.contains("job stopped by")
                        || err.contains("left the mesh"),
                    "flap {down:?}: host {i} must say why:\n{err}"
                );
            }
        }
        for i in 0..3 {
            assert!(namespace_empties(&lab, i, Duration::from_secs(10)), "host {i}: leftovers");
        }
        if down >= Duration::from_secs(4) {
            assert!(!survived, "a 4 s cut is far past failure detection: the job must stop");
        }
        figures.push(format!(
            "{} down: {} (all exited {} after the flap began)",
            secs(down),
            if survived { "survived" } else { "torn down" },
            secs(took)
        ));
    }
    eprintln!("FIGURE 5 link-flap: {}", figures.join("; "));
}

/// Scenario 6: Random loss on every host's eth1. Up to 10 % of packets (what the failure detector is
/// tuned for) the job forms and completes everywhere; at 20 % it either completes or stops
/// cleanly everywhere (a live node may be declared dead), never hangs or launches twice.
/// Figures: rendezvous time (start -> last rank started) against no loss. `FAULTS_LOSS=5,20`
/// picks other rates.
#[test]
fn random_packet_loss_job_still_forms_and_completes() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("loss");
    let args = run_args(&lab, "3", &["--rdzv-timeout", "90s"], "sleep 2");
    let mut figures = Vec::new();
    let plan: Vec<u32> = std::env::var("FAULTS_LOSS")
        .ok()
        .map(|v| v.split(',').filter_map(|p| p.parse().ok()).collect())
        .unwrap_or_else(|| vec![0, 5, 10, 20]);
    for percent in plan {
        marks.clear();
        for i in 0..3 {
            lab.loss(i, percent);
        }
        let t0 = SystemTime::now();
        let t = Instant::now();
        let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &marks)).collect();
        let res: Vec<(Option<i32>, String, String)> =
            ks.into_iter().map(|k| lab.wait(k, Duration::from_secs(90))).collect();
        let total = t.elapsed();
        let launches = marks.launches();
        let completed = res.iter().all(|(c, _, _)| *c == Some(0));
        for (i, (code, out, err)) in res.iter().enumerate() {
            assert!(code.is_some(), "{percent}% loss, host {i} hung:\n{out}\n{err}");
            // Up to 10 % loss is what the failure detector is tuned for: no false verdicts.
            if percent <= 10 {
                assert_eq!(*code, Some(0), "{percent}% loss, host {i}:\n{out}\n{err}");
            } else if !completed {
                // Beyond it a live node may be declared dead: then the job must stop
                // everywhere, saying so, like for a real death.
                assert_ne!(*code, Some(0), "{percent}% loss: host {i} succeeded while others failed:\n{err}");
                assert!(
                    err.contains("stopped answering")
                        || err.contains("job stopped by")
                        || err.contains("left the mesh"),
                    "{percent}% loss, host {i} must say why:\n{err}"
                );
            }
        }
        if completed {
            assert_one_launch(&launches, 3, 0);
        } else {
            assert!(launches.len() <= 3, "{percent}% loss: at most one launch: {launches:?}");
        }
        let collective =
            if res.iter().all(|(_, _, e)| e.contains("collective: nccl")) { "nccl" } else { "tunnel" };
        // Slowest node's join -> roster agreed, and join -> preflight passed.
        let span = |to: &str| {
            res.iter().filter_map(|(_, _, e)| log_span(e, "joining:", to)).max().unwrap_or_default()
        };
        figures.push(format!(
            "{percent}%: join->roster {}, join->preflight passed {}, start->last rank up {}, {} in {} (collective {collective})",
            secs(span("roster agreed")),
            secs(span("preflight passed")),
            secs(launch_delay(&launches, t0, true)),
            if completed { "completed" } else { "FAILED (false death)" },
            secs(total)
        ));
    }
    eprintln!("FIGURE 6 packet-loss: {}", figures.join("; "));
}

/// The store under 5 % packet loss on every host (tests/python/store_check.py): a
/// `store_set` returns only once every node has the value, and concurrent sets of one key
/// end with the same value on all three hosts.
#[test]
fn store_sets_are_everywhere_and_agree_under_packet_loss() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    for i in 0..3 {
        lab.loss(i, 5);
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/store_check.py");
    let args = lab
        .meshd_run()
        .flags(&["--nproc-per-node", "2", "--rdzv-timeout", "90s"])
        .cmd(&["/usr/bin/python3", script]);
    let res = lab.run_on_all(&args, &[TOKEN, ("STORE_CHECK_FILL", "0")], Duration::from_secs(180));
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        assert_eq!(out.matches("STORE OK").count(), 2, "host {i}:\n{out}\n{err}");
    }
}

/// Scenario 7: The master (lowest eth1 address: host 1, 198.19.0.7) crashes while the job runs:
/// every other node stops its ranks and exits 1 within seconds, naming the master.
#[test]
fn master_killed_during_job_stops_everyone_naming_it() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("master-kill");
    let args = run_args(&lab, "3", &["--nproc-per-node", "2", "--rdzv-timeout", "60s"], "sleep 60; true");
    let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &marks)).collect();
    wait_for_launches(&marks, 6);
    let launches = marks.launches();
    assert_eq!(launches.len(), 6, "the job must start: {launches:?}");
    assert!(launches.iter().any(|l| l.rank == 0 && l.node == "198.19.0.7"), "rank 0 on the master");
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    lab.crash(1);
    let mut last = Duration::ZERO;
    for i in [0, 2] {
        let (code, _, err) = lab.wait(ks[i], Duration::from_secs(30));
        last = last.max(t.elapsed());
        assert_eq!(code, Some(1), "host {i} must fail, not hang:\n{err}");
        assert!(
            err.contains("198.19.0.7") && err.contains("stopped answering"),
            "host {i} must name the dead master:\n{err}"
        );
        assert!(namespace_empties(&lab, i, Duration::from_secs(10)), "host {i}: ranks outlived meshd");
    }
    eprintln!("FIGURE 7 master-kill: master crash -> both others exited {}", secs(last));
}

/// Regression: the preflight's TCP connects (up to 2 s each when SYNs are dropped) used to
/// block the mesh actor, so a node that was still dialling answered no membership probe and
/// the others declared it dead, stopped before launch, and left it launching alone. Here
/// hosts 1 and 2 drop host 0's TCP SYNs: host 0 dials for 2 s while the others are done; the
/// job must still run everywhere (in tunnel mode, with the failed pairs named).
#[test]
fn slow_preflight_connects_do_not_get_a_node_declared_dead() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("slow-dial");
    for i in [1, 2] {
        let rules = format!(
            "table inet mdsyn {{\n chain input {{\n type filter hook input priority 0; policy accept;\n \
             ip saddr {} tcp flags == syn drop\n }}\n}}\n",
            lab.hosts[0].eth1
        );
        lab.nft(i, &rules);
    }
    let args = run_args(&lab, "3", &["--rdzv-timeout", "60s"], "sleep 2");
    let t = Instant::now();
    let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &marks)).collect();
    for (i, k) in ks.into_iter().enumerate() {
        let (code, out, err) = lab.wait(k, Duration::from_secs(60));
        assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
        assert!(err.contains("collective: tunnel"), "host {i} must fall back to the tunnel:\n{err}");
        assert!(err.contains("198.19.0.30 -> "), "host {i} must name the failed pairs:\n{err}");
    }
    assert_one_launch(&marks.launches(), 3, 0);
    eprintln!("FIGURE 8 slow-preflight-dial: job completed on all 3 in {}", secs(t.elapsed()));
}

/// A meshd that does not run for most of a second (here SIGSTOP for 0.9 s, twice, as a node whose
/// CPUs its ranks or another tenant take, or a VM paused by its host) is slow, not dead: when
/// it runs again it refutes the suspicion and the job completes everywhere. With suspicions
/// of 0.4-0.8 s (before) the others declared it dead and stopped the job (CI, 2 cores, 4
/// nodes x 2 torch ranks); a node silent for good is still declared dead (scenario 2).
#[test]
fn a_meshd_paused_for_most_of_a_second_is_not_declared_dead() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let marks = Marks::new("pause");
    let args = run_args(&lab, "3", &["--rdzv-timeout", "60s"], "sleep 7; true");
    let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &marks)).collect();
    wait_for_launches(&marks, 3);
    assert_eq!(marks.launches().len(), 3, "the job must start: {:?}", marks.launches());
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..2 {
        lab.signal(ks[2], libc::SIGSTOP); // meshd on 198.19.0.19; its rank keeps running
        std::thread::sleep(Duration::from_millis(900));
        lab.signal(ks[2], libc::SIGCONT);
        std::thread::sleep(Duration::from_millis(1500));
    }
    for (i, &k) in ks.iter().enumerate() {
        let (code, _, err) = lab.wait(k, Duration::from_secs(30));
        assert_eq!(code, Some(0), "host {i}: a paused node was taken for dead:\n{err}");
        assert!(!err.contains("stopped answering"), "host {i}:\n{err}");
    }
    assert_one_launch(&marks.launches(), 3, 0);
    eprintln!("FIGURE 9 pause: meshd on a worker stopped twice for 0.9 s; the job completed everywhere");
}
