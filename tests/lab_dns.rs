//! Lab: `--peers dns:NAME` against a real DNS server whose records appear one by one, as a
//! Kubernetes headless Service publishes pods when they become ready (issue 18.5;
//! examples/k8s/). dnsmasq (Debian's dnsmasq-base, installed by scripts/setup.sh) runs in
//! the lab's hub namespace on the lab network (198.19.0.53, the "cluster DNS") and serves
//! `workers.lab` from an --addn-hosts file that the test rewrites and SIGHUPs; every host's
//! /etc/resolv.conf points at it (`ip netns exec` bind-mounts /etc/netns/NS/resolv.conf).

mod lab;
use lab::Lab;
use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DNS_ADDR: &str = "198.19.0.53";

/// dnsmasq in the hub namespace, killed on drop (the namespace's deletion would not).
struct Dns {
    child: Child,
    hosts: std::path::PathBuf,
    dir: std::path::PathBuf,
}

impl Dns {
    fn start(lab: &Lab) -> Dns {
        let dnsmasq = ["/usr/sbin/dnsmasq", "/usr/bin/dnsmasq"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("dnsmasq is not installed: scripts/setup.sh installs dnsmasq-base (apt-get install dnsmasq-base)");
        let dir = std::env::temp_dir().join(format!("meshd-lab-dns-{}-{}", std::process::id(), lab.prefix));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let hosts = dir.join("workers.hosts");
        std::fs::write(&hosts, "198.19.0.254 probe.lab\n").expect("write hosts");
        let o = Command::new("ip")
            .args(["-n", &lab.hub, "addr", "add", &format!("{DNS_ADDR}/24"), "dev", "br1"])
            .output()
            .expect("ip");
        assert!(o.status.success(), "address for the DNS server: {}", String::from_utf8_lossy(&o.stderr));
        let child = Command::new("ip")
            .args(["netns", "exec", &lab.hub, dnsmasq])
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--user=root",
                "--pid-file",
                "--no-resolv",
                "--no-hosts",
                "--local=/lab/",
                "--bind-interfaces",
                &format!("--listen-address={DNS_ADDR}"),
                "--port=53",
                "--local-ttl=0",
                "--log-queries",
                "--log-facility=-",
            ])
            .arg(format!("--addn-hosts={}", hosts.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start dnsmasq");
        let dns = Dns { child, hosts, dir };
        for h in &lab.hosts {
            let d = format!("/etc/netns/{}", h.ns);
            std::fs::create_dir_all(&d).expect("mkdir /etc/netns/NS");
            std::fs::write(
                format!("{d}/resolv.conf"),
                format!("nameserver {DNS_ADDR}\noptions timeout:1 attempts:2\n"),
            )
            .expect("resolv.conf");
        }
        dns.wait_ready(lab);
        dns.publish(&[]);
        dns
    }

    /// Waits until dnsmasq answers with the probe record it was started with (before that,
    /// a SIGHUP could arrive before its handler is installed, and kill it).
    fn wait_ready(&self, lab: &Lab) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let o = Command::new("ip")
                .args(["netns", "exec", &lab.hosts[0].ns, "getent", "hosts", "probe.lab"])
                .output()
                .expect("getent");
            if String::from_utf8_lossy(&o.stdout).contains("198.19.0.254") {
                return;
            }
            assert!(Instant::now() < deadline, "dnsmasq in the hub did not answer within 10 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Replaces the records and tells dnsmasq (SIGHUP rereads --addn-hosts files).
    fn publish(&self, records: &[(&str, &str)]) {
        let text: String = records.iter().map(|(ip, name)| format!("{ip} {name}\n")).collect();
        let tmp = self.hosts.with_extension("tmp");
        std::fs::write(&tmp, text).expect("write records");
        std::fs::rename(&tmp, &self.hosts).expect("rename records");
        unsafe { libc::kill(self.child.id() as i32, libc::SIGHUP) };
        // dnsmasq rereads on its next loop turn; a short pause keeps the order of updates.
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        if let Ok(out) =
            std::mem::replace(&mut self.child, Command::new("true").spawn().expect("true")).wait_with_output()
        {
            if std::env::var("MESHD_LAB_VERBOSE").is_ok() {
                eprintln!("---- dnsmasq\n{}", String::from_utf8_lossy(&out.stderr));
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts `meshd run --nnodes 3 --peers dns:workers.lab` on the three hosts at once, then
/// publishes host i's record at `at[i]` seconds (the first before the start when
/// `at[0] == 0`); checks that the job forms and every rank of every host runs once, rank 0
/// on the lowest address. Returns when each host's meshd was seen to have exited.
fn dns_job(at: [u64; 3]) -> Vec<Duration> {
    let mut lab = Lab::new(3);
    let dns = Dns::start(&lab);
    let eth1: Vec<String> = lab.hosts.iter().map(|h| h.eth1.clone()).collect();
    let line = "echo ENV RANK=$RANK WORLD=$WORLD_SIZE MASTER_ADDR=$MASTER_ADDR NODE_ADDR=$MESHD_NODE_ADDR";
    let args = lab
        .meshd_run()
        .peers("dns:workers.lab")
        .flags(&["--rdzv-timeout", "90s", "--nproc-per-node", "2"])
        .cmd(&["sh", "-c", line]);
    let token = [("MESHD_TOKEN", "lab-dns-token")];
    let start = Instant::now();
    let published = |upto: usize| -> Vec<(&str, &str)> {
        eth1[..upto].iter().map(|a| (a.as_str(), "workers.lab")).collect()
    };
    let mut upto = at.iter().filter(|t| **t == 0).count();
    dns.publish(&published(upto));
    let ks: Vec<usize> = (0..3).map(|i| lab.spawn(i, &args, &token)).collect();
    let mut exited = vec![None; 3];
    let watch = |lab: &mut Lab, exited: &mut Vec<Option<Duration>>| {
        for (i, k) in ks.iter().enumerate() {
            if exited[i].is_none() && lab.exited(*k) {
                exited[i] = Some(start.elapsed());
            }
        }
    };
    while upto < 3 {
        let next = Duration::from_secs(at[upto]);
        while start.elapsed() < next {
            watch(&mut lab, &mut exited);
            std::thread::sleep(Duration::from_millis(50));
        }
        upto += 1;
        dns.publish(&published(upto));
        // What a pod's resolver sees now: every published record.
        let o = Command::new("ip")
            .args(["netns", "exec", &lab.hosts[2].ns, "getent", "ahostsv4", "workers.lab"])
            .output()
            .expect("getent");
        let seen: BTreeSet<&str> = std::str::from_utf8(&o.stdout)
            .unwrap_or("")
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        assert_eq!(seen.len(), upto, "at {:?} the resolver sees {seen:?}", start.elapsed());
    }
    let deadline = start + Duration::from_secs(90);
    while start.elapsed() < Duration::from_secs(90) && exited.iter().any(|e| e.is_none()) {
        watch(&mut lab, &mut exited);
        std::thread::sleep(Duration::from_millis(50));
    }
    let res: Vec<_> =
        ks.into_iter().map(|k| lab.wait(k, deadline.saturating_duration_since(Instant::now()))).collect();
    let master = eth1.iter().map(|a| a.parse::<std::net::Ipv4Addr>().expect("ip")).min().expect("hosts");
    let mut ranks = BTreeSet::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i} ({}) failed:\n{out}\n{err}", eth1[i]);
        for l in out.lines().filter(|l| l.contains("ENV RANK=")) {
            assert!(l.contains("WORLD=6 "), "host {i}: {l}");
            assert!(l.contains(&format!("MASTER_ADDR={master} ")), "host {i}: {l}");
            assert!(l.contains(&format!("NODE_ADDR={}", eth1[i])), "host {i}: {l}");
            let r: u32 = l
                .split("RANK=")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|r| r.parse().ok())
                .expect("rank");
            assert!(ranks.insert(r), "rank {r} ran twice");
        }
    }
    assert_eq!(ranks, (0..6).collect::<BTreeSet<_>>(), "every rank ran once");
    let exited: Vec<Duration> = exited.into_iter().map(|e| e.unwrap_or(Duration::MAX)).collect();
    eprintln!("dns: records at {at:?} s; meshd exited 0 at {exited:?}");
    exited
}

/// Three pods start at once; the headless Service's A records appear at 0, 8 and 16 s, as
/// pods become ready. Any one record is enough: the others join through the first.
#[test]
fn records_that_appear_one_by_one_form_the_job() {
    lab_or_skip!();
    dns_job([0, 8, 16]);
}

/// No record at all when the pods start (DNS lags behind them): every meshd keeps
/// re-resolving `dns:workers.lab` (every <= 4 s) and the job forms once records exist.
#[test]
fn no_record_at_start_then_one_by_one() {
    lab_or_skip!();
    let exited = dns_job([3, 6, 9]);
    assert!(
        exited.iter().all(|t| *t >= Duration::from_secs(3)),
        "a job formed before any record: {exited:?}"
    );
}
