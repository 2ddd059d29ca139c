//! The network lab: N hosts as Linux network namespaces, shaped like GPU cloud instances.
//!
//! Every host has `eth0` 198.18.0.4/16 (the SAME address everywhere, default route via
//! 198.18.0.1 where nobody answers: the container bridge) and `eth1` 198.19.0.X/24 on one
//! shared bridge, X deliberately not in host order. The far ends of all veths live in one
//! "hub" namespace, never in the root namespace, so nothing a test sends can leave the lab.
//! A [`Lab`] deletes its namespaces and kills their processes on drop (panics included);
//! leftovers of a killed test process are swept by the next lab.
//!
//! Needs root and iproute2 (`ip`), and `nft` for firewalls. Without root the lab panics
//! with a clear message unless `MESHD_LAB_SKIP=1` says to skip on purpose.
#![allow(dead_code)]

pub mod library;
pub mod torchft;

use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// eth1 host byte of host i: not in host order, so host 0 is not the master.
pub const ETH1_OCTETS: [u8; 20] =
    [30, 7, 19, 44, 12, 25, 3, 50, 41, 9, 61, 17, 38, 55, 22, 71, 14, 66, 33, 80];
pub const ETH0_ADDR: &str = "198.18.0.4";

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn sh(args: &[&str]) -> Output {
    Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"))
}

fn must(args: &[&str]) {
    let o = sh(args);
    assert!(o.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
}

/// At the start of a lab test: returns from it (after saying why) when the lab cannot run
/// and skipping was asked for (`MESHD_LAB_SKIP=1`); panics, naming the cause, otherwise.
#[macro_export]
macro_rules! lab_or_skip {
    () => {
        if !lab::available() {
            return;
        }
    };
}

/// Returns false (after saying why) when the lab cannot run and skipping was asked for.
pub fn available() -> bool {
    let root = unsafe { libc::geteuid() } == 0;
    let ip = Command::new("ip").arg("-V").output().is_ok();
    if root && ip {
        return true;
    }
    let why = if !root { "not root" } else { "no `ip` (iproute2)" };
    if std::env::var("MESHD_LAB_SKIP").as_deref() == Ok("1") {
        eprintln!("LAB TEST SKIPPED ({why}; MESHD_LAB_SKIP=1)");
        return false;
    }
    panic!("the network lab needs root and iproute2 ({why}); set MESHD_LAB_SKIP=1 to skip on purpose");
}

/// A lab of hosts. Dropping it removes everything it made.
pub struct Lab {
    pub prefix: String,
    pub hub: String,
    pub hosts: Vec<Host>,
    children: Vec<Child>,
}

/// One lab host (a network namespace).
#[derive(Clone)]
pub struct Host {
    pub ns: String,
    pub index: usize,
    /// eth1 address (None for a host without eth1).
    pub eth1: String,
}

fn sweep_stale() {
    let out = sh(&["ip", "netns", "list"]);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix("mdlab") else { continue };
        let pid: i32 = rest.split('-').nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        if pid > 0 && unsafe { libc::kill(pid, 0) } != 0 {
            kill_ns_procs(name);
            let _ = sh(&["ip", "netns", "del", name]);
        }
    }
    // Per-namespace /etc files of labs whose test process is gone.
    if let Ok(dir) = std::fs::read_dir("/etc/netns") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Some(rest) = name.strip_prefix("mdlab") else { continue };
            let pid: i32 = rest.split('-').nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
            if pid > 0 && unsafe { libc::kill(pid, 0) } != 0 {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

fn kill_ns_procs(ns: &str) {
    let out = sh(&["ip", "netns", "pids", ns]);
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        if let Ok(p) = pid.parse::<i32>() {
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }
}

impl Lab {
    /// `n` hosts, all with eth0 and eth1.
    pub fn new(n: usize) -> Lab {
        sweep_stale();
        let k = COUNTER.fetch_add(1, Ordering::SeqCst);
        let prefix = format!("mdlab-{}-{k}", std::process::id());
        let hub = format!("{prefix}-hub");
        let mut lab =
            Lab { prefix: prefix.clone(), hub: hub.clone(), hosts: Vec::new(), children: Vec::new() };
        must(&["ip", "netns", "add", &hub]);
        must(&["ip", "-n", &hub, "link", "add", "br1", "type", "bridge"]);
        must(&["ip", "-n", &hub, "link", "set", "br1", "up"]);
        for i in 0..n {
            lab.add_host(i, true);
        }
        lab
    }

    fn add_host(&mut self, i: usize, with_eth1: bool) {
        let ns = format!("{}-h{i}", self.prefix);
        must(&["ip", "netns", "add", &ns]);
        let host = Host { ns: ns.clone(), index: i, eth1: format!("198.19.0.{}", ETH1_OCTETS[i]) };
        self.hosts.push(host);
        must(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        // eth0: same address everywhere, its far end alone in the hub (an isolated bridge).
        let e0 = format!("h{i}e0");
        must(&[
            "ip", "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &e0, "netns", &self.hub,
        ]);
        must(&["ip", "-n", &ns, "addr", "add", &format!("{ETH0_ADDR}/16"), "dev", "eth0"]);
        must(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
        must(&["ip", "-n", &self.hub, "link", "set", &e0, "up"]);
        must(&["ip", "-n", &ns, "route", "add", "default", "via", "198.18.0.1", "dev", "eth0"]);
        if with_eth1 {
            let e1 = format!("h{i}e1");
            must(&[
                "ip", "-n", &ns, "link", "add", "eth1", "type", "veth", "peer", "name", &e1, "netns",
                &self.hub,
            ]);
            must(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("198.19.0.{}/24", ETH1_OCTETS[i]),
                "dev",
                "eth1",
            ]);
            must(&["ip", "-n", &ns, "link", "set", "eth1", "up"]);
            must(&["ip", "-n", &self.hub, "link", "set", &e1, "master", "br1"]);
            must(&["ip", "-n", &self.hub, "link", "set", &e1, "up"]);
        }
    }

    /// Sets the MTU of every host's eth1 and of the bridge ports (jumbo frames: 9000).
    pub fn set_mtu(&self, mtu: u32) {
        let m = mtu.to_string();
        for h in &self.hosts {
            must(&["ip", "-n", &self.hub, "link", "set", &format!("h{}e1", h.index), "mtu", &m]);
            must(&["ip", "-n", &h.ns, "link", "set", "eth1", "mtu", &m]);
        }
    }

    /// Comma list of every host's eth1 address.
    pub fn peers(&self) -> String {
        self.hosts.iter().map(|h| h.eth1.clone()).collect::<Vec<_>>().join(",")
    }

    /// Starts `args` in host `i`'s namespace; killed at teardown if still running.
    pub fn spawn<S: AsRef<str>>(&mut self, i: usize, args: &[S], envs: &[(&str, &str)]) -> usize {
        let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[i].ns]).args(&args);
        // A multi-node mesh needs a token (or --insecure), as users run it: meshd gets the
        // lab's unless the test gives its own.
        if args.first() == Some(&meshd()) && !envs.iter().any(|(k, _)| *k == "MESHD_TOKEN") {
            c.env("MESHD_TOKEN", "lab-default-token");
        }
        for (k, v) in envs {
            c.env(k, v);
        }
        let child = c
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {args:?}: {e}"));
        self.children.push(child);
        self.children.len() - 1
    }

    /// Waits for child `k` (from [`Lab::spawn`]) up to `limit`; kills it past that.
    pub fn wait(&mut self, k: usize, limit: Duration) -> (Option<i32>, String, String) {
        let deadline = Instant::now() + limit;
        let child = &mut self.children[k];
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let timed_out = Instant::now() > deadline;
        let out = std::mem::replace(child, Command::new("true").spawn().expect("true"))
            .wait_with_output()
            .expect("output");
        let code = if timed_out { None } else { out.status.code() };
        if std::env::var("MESHD_LAB_VERBOSE").is_ok() {
            eprintln!(
                "---- child {k} ({}) code {code:?}\n{}{}",
                self.hosts.get(k).map(|h| h.ns.as_str()).unwrap_or("?"),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        (code, String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
    }

    /// Starts the same `args` on every host at once (the identical command) and waits for
    /// each, bounded by `limit`: (exit code, stdout, stderr) per host, in host order.
    pub fn run_on_all<S: AsRef<str>>(
        &mut self,
        args: &[S],
        envs: &[(&str, &str)],
        limit: Duration,
    ) -> Vec<(Option<i32>, String, String)> {
        let ks: Vec<usize> = (0..self.hosts.len()).map(|i| self.spawn(i, args, envs)).collect();
        let deadline = Instant::now() + limit;
        ks.into_iter().map(|k| self.wait(k, deadline.saturating_duration_since(Instant::now()))).collect()
    }

    /// Starts the same `meshd run` line on every host (`--nnodes` all of them, `--peers`
    /// every host, `--rdzv-timeout 60s`, then `extra`, `--` and `cmd`) with the token
    /// `lab-secret`; returns (exit code, stdout, stderr) each, in host order.
    pub fn run_everywhere(
        &mut self,
        extra: &[&str],
        cmd: &[&str],
        limit: Duration,
    ) -> Vec<(Option<i32>, String, String)> {
        let args = self.meshd_run().flags(&["--rdzv-timeout", "60s"]).flags(extra).cmd(cmd);
        self.run_on_all(&args, &[("MESHD_TOKEN", "lab-secret")], limit)
    }

    /// `meshd run` for this lab: `--nnodes` every host and `--peers` every host's eth1,
    /// unless the builder says otherwise.
    pub fn meshd_run(&self) -> MeshdRun {
        MeshdRun {
            bin: meshd().to_string(),
            sub: &["run"],
            nnodes: self.hosts.len().to_string(),
            peers: Some(self.peers()),
            flags: Vec::new(),
        }
    }

    /// `meshd bench allreduce` for this lab, as [`Lab::meshd_run`]; end it with
    /// [`MeshdRun::args`] (no `--`).
    pub fn meshd_bench(&self) -> MeshdRun {
        MeshdRun { sub: &["bench", "allreduce"], ..self.meshd_run() }
    }

    /// Waits for each child of `ks` (from [`Lab::spawn`]) in turn, each up to `limit`:
    /// (exit code, stdout, stderr) per child, in the order of `ks`.
    pub fn wait_all(
        &mut self,
        ks: impl IntoIterator<Item = usize>,
        limit: Duration,
    ) -> Vec<(Option<i32>, String, String)> {
        ks.into_iter().map(|k| self.wait(k, limit)).collect()
    }

    /// Sends `sig` to child `k` (a `meshd run`) and waits for it: it must exit with `code`
    /// within 1.5 s. Returns its stdout and stderr.
    pub fn stop_within_a_second(&mut self, k: usize, sig: i32, code: i32, what: &str) -> (String, String) {
        let t = Instant::now();
        self.signal(k, sig);
        let (got, out, err) = self.wait(k, Duration::from_secs(10));
        println!("FIGURE {what}: exit after {:?}", t.elapsed());
        assert!(t.elapsed() < Duration::from_millis(1500), "{what} took {:?}:\n{err}", t.elapsed());
        assert_eq!(got, Some(code), "{err}");
        (out, err)
    }

    /// Runs `args` in host `i` to completion (bounded by `limit`).
    pub fn run<S: AsRef<str>>(
        &mut self,
        i: usize,
        args: &[S],
        limit: Duration,
    ) -> (Option<i32>, String, String) {
        let k = self.spawn(i, args, &[]);
        self.wait(k, limit)
    }

    /// Sends a signal to child `k`'s process (the `ip netns exec` process execs the command).
    pub fn signal(&self, k: usize, sig: i32) {
        unsafe { libc::kill(self.children[k].id() as i32, sig) };
    }

    /// Kills every process in host `i`'s namespace (a host crash).
    pub fn crash(&self, i: usize) {
        kill_ns_procs(&self.hosts[i].ns);
    }

    /// Takes host `i`'s eth1 down or up (a link cut).
    pub fn link(&self, i: usize, up: bool) {
        must(&["ip", "-n", &self.hosts[i].ns, "link", "set", "eth1", if up { "up" } else { "down" }]);
    }

    /// In host `i`: drop all TCP and all UDP except `port` (NCCL's sockets fail; meshd works).
    pub fn firewall_only_udp(&self, i: usize, port: u16) {
        let rules = format!(
            "table inet mdlab {{\n chain input {{\n type filter hook input priority 0; policy accept;\n \
             iifname \"lo\" accept\n meta l4proto tcp drop\n udp dport != {port} udp sport != {port} drop\n }}\n}}\n"
        );
        self.nft(i, &rules);
    }

    /// Drops eth1 traffic between host `i` and the hosts in `others` (a partition).
    pub fn partition(&self, i: usize, others: &[usize]) {
        let nft_add =
            |what: &[&str]| must(&[&["ip", "netns", "exec", &self.hosts[i].ns, "nft", "add"], what].concat());
        for &j in others {
            let ip = &self.hosts[j].eth1;
            nft_add(&["table", "inet", "mdpart"]);
            nft_add(&["chain", "inet", "mdpart", "in", "{ type filter hook input priority 0; }"]);
            nft_add(&["rule", "inet", "mdpart", "in", "ip", "saddr", ip, "drop"]);
        }
    }

    /// Removes partitions made with [`Lab::partition`] in host `i`.
    pub fn heal(&self, i: usize) {
        let _ = sh(&["ip", "netns", "exec", &self.hosts[i].ns, "nft", "delete", "table", "inet", "mdpart"]);
    }

    /// Loads an nft ruleset (`nft -f -`) into host `i`'s namespace.
    pub fn nft(&self, i: usize, rules: &str) {
        let o = Command::new("ip")
            .args(["netns", "exec", &self.hosts[i].ns, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().expect("stdin").write_all(rules.as_bytes())?;
                c.wait()
            })
            .expect("nft");
        assert!(o.success(), "nft failed in {}:\n{rules}", self.hosts[i].ns);
    }

    /// Random loss: host `i` drops `percent`% of the packets arriving on its eth1 (nft
    /// `numgen random mod 100 < P`, inside host `i`'s namespace only). Applied to every host,
    /// every packet between two hosts is lost with that probability. 0 removes the rule;
    /// a new call replaces the old rate.
    pub fn loss(&self, i: usize, percent: u32) {
        let ns = &self.hosts[i].ns;
        let _ = sh(&["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "mdloss"]);
        if percent == 0 {
            return;
        }
        let rules = format!(
            "table inet mdloss {{\n chain input {{\n type filter hook input priority -10; policy accept;\n \
             iifname \"eth1\" numgen random mod 100 < {percent} drop\n }}\n}}\n"
        );
        self.nft(i, &rules);
    }

    /// A bottleneck: what reaches host `i` over eth1 passes a token bucket of `mbit` Mbit/s
    /// with a drop-tail queue of `queue_ms` milliseconds at that rate (tc `tbf` on the hub's
    /// end of host `i`'s link, egress toward host `i`). It sits in the network, not in a
    /// sender: senders see it only as delay and drops, as on a real path, and no local
    /// qdisc pushes back on their sockets. Only traffic *to* host `i` is limited; the lab's
    /// namespaces (and so the qdisc) go at teardown.
    pub fn rate_limit(&self, i: usize, mbit: u32, queue_ms: u32) {
        // Bytes per second; the bucket holds 2 ms of sending (at least 16 KiB, so a GSO
        // segment train of a few datagrams fits), the queue `queue_ms`.
        let rate = u64::from(mbit) * 1_000_000 / 8;
        let burst = (rate / 500).max(16 << 10);
        let limit = (rate * u64::from(queue_ms) / 1000).max(2 * burst);
        must(&[
            "ip",
            "netns",
            "exec",
            &self.hub,
            "tc",
            "qdisc",
            "replace",
            "dev",
            &format!("h{i}e1"),
            "root",
            "tbf",
            "rate",
            &format!("{mbit}mbit"),
            "burst",
            &burst.to_string(),
            "limit",
            &limit.to_string(),
        ]);
    }

    /// A link flap: host `i`'s eth1 goes down for `down`, then up again (blocks meanwhile).
    /// The address stays; the kernel restores the subnet route when the link comes back.
    pub fn flap(&self, i: usize, down: Duration) {
        self.link(i, false);
        std::thread::sleep(down);
        self.link(i, true);
    }

    /// Writes host `i`'s `/etc/hosts` (`ip netns exec` bind-mounts `/etc/netns/NS/hosts`
    /// over `/etc/hosts` for what it starts). Rewriting it later changes it in place (same
    /// file), so a running process sees new names appear, as when DNS catches up.
    pub fn hosts_file(&self, i: usize, text: &str) {
        let dir = format!("/etc/netns/{}", self.hosts[i].ns);
        std::fs::create_dir_all(&dir).expect("mkdir /etc/netns/NS");
        let body = format!("127.0.0.1 localhost\n{text}");
        std::fs::write(format!("{dir}/hosts"), body).expect("write hosts");
    }

    /// Processes living in host `i`'s namespace (orphaned ranks show up here).
    pub fn pids(&self, i: usize) -> Vec<i32> {
        let out = sh(&["ip", "netns", "pids", &self.hosts[i].ns]);
        String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect()
    }

    /// The pid of child `k` (from [`Lab::spawn`]): the command itself (`ip netns exec` execs it).
    pub fn pid(&self, k: usize) -> u32 {
        self.children[k].id()
    }

    /// Whether child `k` (from [`Lab::spawn`]) has exited, without waiting.
    pub fn exited(&mut self, k: usize) -> bool {
        matches!(self.children[k].try_wait(), Ok(Some(_)))
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for h in &self.hosts {
            kill_ns_procs(&h.ns);
            let _ = sh(&["ip", "netns", "del", &h.ns]);
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{}", h.ns));
        }
        let _ = sh(&["ip", "netns", "del", &self.hub]);
    }
}

/// A `meshd run` command line ([`Lab::meshd_run`]): `--nnodes`, `--peers`, more flags, then
/// `--` and the command every rank runs.
#[derive(Clone, Debug)]
pub struct MeshdRun {
    bin: String,
    sub: &'static [&'static str],
    nnodes: String,
    peers: Option<String>,
    flags: Vec<String>,
}

impl MeshdRun {
    /// Another meshd binary (an installed one) in place of the one under test.
    pub fn bin(mut self, bin: &str) -> Self {
        self.bin = bin.to_string();
        self
    }

    /// Another `--nnodes` (`N` or `MIN:MAX`).
    pub fn nnodes(mut self, n: &str) -> Self {
        self.nnodes = n.to_string();
        self
    }

    /// Other `--peers`.
    pub fn peers(mut self, peers: &str) -> Self {
        self.peers = Some(peers.to_string());
        self
    }

    /// More flags, in order.
    pub fn flags(mut self, flags: &[&str]) -> Self {
        self.flags.extend(flags.iter().map(|f| f.to_string()));
        self
    }

    /// The whole line: meshd, `run`, the flags, `--`, then `cmd`.
    pub fn cmd(&self, cmd: &[&str]) -> Vec<String> {
        self.args(&[&["--"], cmd].concat())
    }

    /// The whole line without `--`: meshd, the subcommand, the flags, then `tail` (a script
    /// and its arguments, as torchrun takes them, or more flags).
    pub fn args(&self, tail: &[&str]) -> Vec<String> {
        let mut v: Vec<String> =
            std::iter::once(self.bin.as_str()).chain(self.sub.iter().copied()).map(String::from).collect();
        v.extend(["--nnodes".to_string(), self.nnodes.clone()]);
        if let Some(p) = &self.peers {
            v.extend(["--peers".to_string(), p.clone()]);
        }
        v.extend(self.flags.iter().cloned());
        v.extend(tail.iter().map(|c| c.to_string()));
        v
    }
}

/// Owned environment pairs: `MESHD_TOKEN` = `token`, then `more` (a torch's `env()`
/// variables, say); [`env_refs`] lends them to [`Lab::spawn`] and [`Lab::run_on_all`].
pub fn token_env(
    token: &str,
    more: impl IntoIterator<Item = (&'static str, String)>,
) -> Vec<(&'static str, String)> {
    std::iter::once(("MESHD_TOKEN", token.to_string())).chain(more).collect()
}

/// `(name, value)` pairs as the lab's spawning functions take them.
pub fn env_refs<'a>(env: &'a [(&'a str, String)]) -> Vec<(&'a str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// A fresh directory `meshd-NAME-PID` under the temp dir with `text` written to its file
/// `file`: (the directory, the file's path).
pub fn script_in_temp(name: &str, file: &str, text: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("meshd-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let script = dir.join(file);
    std::fs::write(&script, text).expect("script");
    let path = script.display().to_string();
    (dir, path)
}

/// Tests of one binary that measure time or memory take this lock to run one at a time.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// For the lab benchmarks: whether to run now (`cargo bench` passes `--bench`; `cargo test
/// --all-targets` runs bench binaries without it) and the lab is available; `--NAME VALUE`
/// options are read with [`bench_opt`].
pub fn bench_mode(name: &str) -> bool {
    if !std::env::args().any(|a| a == "--bench") {
        println!("benchmark: run with `cargo bench --bench {name}` (as root)");
        return false;
    }
    available()
}

/// The value of `--NAME VALUE` on the command line, parsed, or `default`.
pub fn bench_opt<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Path of the meshd binary under test.
pub fn meshd() -> &'static str {
    env!("CARGO_BIN_EXE_meshd")
}

/// `meshd run` of one of the examples' Python scripts with `python` on every host of a lab
/// of `nnodes`: `nproc` ranks per host, the given `--collective`, then the script's own
/// arguments.
pub fn python_job(
    python: &str,
    peers: &str,
    nnodes: usize,
    nproc: usize,
    collective: &str,
    script: &str,
    args: &[&str],
) -> Vec<String> {
    let script = format!("{}/examples/{script}", env!("CARGO_MANIFEST_DIR"));
    let (nn, np) = (nnodes.to_string(), nproc.to_string());
    let mut v: Vec<String> = [meshd(), "run", "--nnodes", &nn, "--peers", peers, "--nproc-per-node", &np]
        .into_iter()
        .chain(["--collective", collective, "--", python, &script])
        .map(String::from)
        .collect();
    v.extend(args.iter().map(|a| a.to_string()));
    v
}
