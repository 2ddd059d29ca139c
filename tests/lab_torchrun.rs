//! Lab: meshd's rank environment diffed against torch 2's own torchrun. The same rank script
//! (tests/python/env_rank.py: a Gloo group from env://, an allreduce, then its whole
//! environment as JSON) runs on 3 hosts x 2 ranks under `python -m torch.distributed.run`
//! (c10d rendezvous, run inside each lab host) and under `meshd run`. What each launcher
//! set for a rank is what the rank saw that its launcher's own environment did not hold.
//! Every variable torchrun sets must be set by meshd with the same meaning; the values that
//! must differ are named below with the reason. Then the same for a rank that fails under
//! torch's `@record`: the error file it writes (TORCHELASTIC_ERROR_FILE) and the root cause
//! each launcher prints from it.

mod lab;
mod torches;
use lab::{Lab, meshd};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

type Env = BTreeMap<String, String>;

/// How meshd's value of a variable torchrun sets compares with torchrun's, rank by rank
/// (ranks matched by RANK).
#[derive(Clone, Copy, Debug)]
enum Rule {
    /// The same value.
    Same,
    /// The eth1 address of the host that runs rank 0 (who that is differs: torchrun orders
    /// nodes by its participants, meshd by address).
    Rank0Host,
    /// A TCP port on rank 0's host that each launcher chose free: the same on every rank.
    FreePort,
    /// The launcher's own per-rank file path: a different absolute `.json` path for every rank.
    PerRankFile,
    /// Differs on purpose: the value each launcher must give, and why.
    Differs { torchrun: &'static str, meshd: &'static str, why: &'static str },
}

/// Every variable torch 2.15's torchrun sets for a rank (c10d rendezvous, 2 ranks a node; in
/// local_elastic_agent.py, run.py, launcher/api.py and the error-file setup of
/// elastic/multiprocessing), with how meshd's must compare. A variable torchrun sets that is
/// not here fails the test, naming it.
const TORCHRUN_SETS: [(&str, Rule); 18] = [
    ("RANK", Rule::Same),
    ("LOCAL_RANK", Rule::Same),
    ("GROUP_RANK", Rule::Same),
    ("ROLE_RANK", Rule::Same),
    ("ROLE_NAME", Rule::Same),
    ("LOCAL_WORLD_SIZE", Rule::Same),
    ("WORLD_SIZE", Rule::Same),
    ("GROUP_WORLD_SIZE", Rule::Same),
    ("ROLE_WORLD_SIZE", Rule::Same),
    ("MASTER_ADDR", Rule::Rank0Host),
    ("MASTER_PORT", Rule::FreePort),
    // Both launchers are given the same id (--rdzv-id, --run-id).
    ("TORCHELASTIC_RUN_ID", Rule::Same),
    ("TORCHELASTIC_RESTART_COUNT", Rule::Same),
    ("TORCHELASTIC_MAX_RESTARTS", Rule::Same),
    (
        "TORCHELASTIC_USE_AGENT_STORE",
        Rule::Differs {
            torchrun: "True",
            meshd: "False",
            why: "torchrun's agent hosts the TCPStore at MASTER_ADDR:MASTER_PORT that the ranks join; meshd hosts \
                  none there, so rank 0 creates it, as torch does under any launcher without an agent store",
        },
    ),
    ("TORCHELASTIC_ERROR_FILE", Rule::PerRankFile),
    // torchrun's --signals-to-handle (the default list here), for a rank that starts processes
    // of its own with torch.distributed.elastic.
    ("TORCHELASTIC_SIGNALS_TO_HANDLE", Rule::Same),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", Rule::Same),
];

/// Set by torchrun only with more than one process a node and OMP_NUM_THREADS unset (both
/// here), compared as the others.
const OMP: (&str, Rule) = ("OMP_NUM_THREADS", Rule::Same);

/// The c10d rendezvous store's port on the master host (torchrun's --rdzv-endpoint).
const RDZV_PORT: &str = "29500";

/// What a launcher set for each rank: RANK -> (host index, variables the rank saw that the
/// launcher's environment `parent` did not hold, or held with another value).
fn set_by_launcher(res: &[(Option<i32>, String, String)], parent: &Env) -> BTreeMap<u32, (usize, Env)> {
    let mut ranks = BTreeMap::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        // Two ranks' prints can share a line (one rank's newline written after the other's
        // line): each marker starts one JSON object, read up to its own end.
        for line in out.lines().flat_map(|l| l.split("ENVRANK ").skip(1)) {
            let mut objects = serde_json::Deserializer::from_str(line).into_iter::<serde_json::Value>();
            let v = objects.next().expect("ENVRANK JSON").expect("ENVRANK JSON");
            let rank = v["rank"].as_u64().expect("rank") as u32;
            assert_eq!(v["world"], 6, "{line}");
            let env: Env = v["env"]
                .as_object()
                .expect("env")
                .iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .filter(|(k, v)| parent.get(k) != Some(v))
                .collect();
            assert!(ranks.insert(rank, (i, env)).is_none(), "rank {rank} reported twice");
        }
    }
    assert_eq!(ranks.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5], "every rank reports once");
    ranks
}

/// The environment `ip netns exec` hands a lab command: this test's own plus `extra`.
fn parent_env(extra: &[(&str, &str)]) -> Env {
    let mut env: Env = std::env::vars().collect();
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env
}

/// torchrun on every host: c10d rendezvous at the master host's eth1, which hosts its store
/// (`is_host`, since every lab host has the same host name), `--local-addr` its own eth1
/// address (else torchrun advertises the shared host name), Gloo on eth1 (else it takes
/// the address the host name resolves to). Returns (exit code, stdout, stderr) per host.
fn torchrun_on_all(
    lab: &mut Lab,
    python: &str,
    nproc: &str,
    run_id: &str,
    script_and_args: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> Vec<(Option<i32>, String, String)> {
    let n = lab.hosts.len().to_string();
    let master = lowest_eth1(lab);
    let endpoint = format!("{master}:{RDZV_PORT}");
    let ks: Vec<usize> = (0..lab.hosts.len())
        .map(|i| {
            let me = lab.hosts[i].eth1.clone();
            let is_host = format!("is_host={}", u8::from(me == master));
            let mut args =
                vec![python, "-m", "torch.distributed.run", "--nnodes", &n, "--nproc-per-node", nproc];
            args.extend(["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint, "--rdzv-id", run_id]);
            args.extend(["--rdzv-conf", &is_host, "--local-addr", &me, "--max-restarts", "0"]);
            args.extend_from_slice(extra);
            args.extend_from_slice(script_and_args);
            lab.spawn(i, &args, env)
        })
        .collect();
    ks.into_iter().map(|k| lab.wait(k, Duration::from_secs(180))).collect()
}

fn lowest_eth1(lab: &Lab) -> String {
    let mut a: Vec<std::net::Ipv4Addr> = lab.hosts.iter().map(|h| h.eth1.parse().expect("ip")).collect();
    a.sort();
    a[0].to_string()
}

on_torches!([torch2]
fn every_variable_torchrun_sets_for_a_rank_meshd_sets_with_the_same_meaning(t) {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/env_rank.py");
    let run_id = "envdiff-7c3";
    let mut tenv = t.env();
    // What a torchrun user on these hosts must set by hand (meshd sets it): Gloo's interface.
    tenv.push(("GLOO_SOCKET_IFNAME", "eth1".to_string()));
    let tenv: Vec<(&str, &str)> = tenv.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let started = std::time::Instant::now();
    let res = torchrun_on_all(&mut lab, &t.python, "2", run_id, &[script], &[], &tenv);
    let torchrun_took = started.elapsed();
    let torchrun = set_by_launcher(&res, &parent_env(&tenv));

    let mut menv = vec![("MESHD_TOKEN", "envdiff".to_string())];
    menv.extend(t.env());
    let menv: Vec<(&str, &str)> = menv.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let args = lab.meshd_run().flags(&["--nproc-per-node", "2", "--run-id", run_id]).cmd(&[&t.python, script]);
    let started = std::time::Instant::now();
    let res = lab.run_on_all(&args, &menv, Duration::from_secs(180));
    eprintln!("FIGURE torchrun job {torchrun_took:?}, meshd job {:?} ({})", started.elapsed(), t.label());
    let meshd_set = set_by_launcher(&res, &parent_env(&menv));

    // Every variable torchrun set is one this test knows (a new torch may add some).
    let rules: BTreeMap<&str, Rule> = TORCHRUN_SETS.into_iter().chain([OMP]).collect();
    let seen: BTreeSet<&str> = torchrun.values().flat_map(|(_, e)| e.keys().map(String::as_str)).collect();
    let unknown: Vec<&&str> = seen.iter().filter(|k| !rules.contains_key(**k)).collect();
    assert!(
        unknown.is_empty(),
        "torchrun ({}) sets {unknown:?} for its ranks, which meshd's rank environment does not cover: set them in \
         crates/meshd/src/job.rs or name them in TORCHRUN_SETS with the reason (and in README)",
        t.label()
    );
    let missing: Vec<&&str> = rules.keys().filter(|k| !seen.contains(**k)).collect();
    assert!(missing.is_empty(), "torchrun no longer sets {missing:?}: TORCHRUN_SETS is out of date");

    let rank0_host = |set: &BTreeMap<u32, (usize, Env)>| lab.hosts[set[&0].0].eth1.clone();
    let (t0, m0) = (rank0_host(&torchrun), rank0_host(&meshd_set));
    for (rank, (_, tr)) in &torchrun {
        let me = &meshd_set[rank].1;
        for (k, want) in tr {
            let got = me.get(k).unwrap_or_else(|| {
                panic!("rank {rank}: torchrun sets {k}={want}, meshd does not set it (meshd set: {me:?})")
            });
            match rules[k.as_str()] {
                Rule::Same => assert_eq!(got, want, "rank {rank}: {k}: meshd {got:?}, torchrun {want:?}"),
                Rule::Rank0Host => {
                    assert_eq!(want, &t0, "rank {rank}: torchrun's {k} is rank 0's host");
                    assert_eq!(got, &m0, "rank {rank}: meshd's {k} is rank 0's host");
                }
                Rule::FreePort => {
                    for (who, v, all) in [("torchrun", want, &torchrun), ("meshd", got, &meshd_set)] {
                        assert!(v.parse::<u16>().is_ok_and(|p| p > 0), "rank {rank}: {who}'s {k}={v:?}");
                        assert_eq!(v, &all[&0].1[k], "rank {rank}: {who}'s {k} is the same on every rank");
                    }
                }
                Rule::PerRankFile => {
                    for (who, v, all) in [("torchrun", want, &torchrun), ("meshd", got, &meshd_set)] {
                        assert!(v.starts_with('/') && v.ends_with(".json"), "rank {rank}: {who}'s {k}={v:?}");
                        let same = all.iter().filter(|(_, (_, e))| e.get(k) == Some(v)).count();
                        assert_eq!(same, 1, "rank {rank}: {who}'s {k}={v:?} is this rank's own");
                    }
                }
                Rule::Differs { torchrun: tv, meshd: mv, why } => {
                    assert_eq!(want, tv, "rank {rank}: torchrun's {k} ({why})");
                    assert_eq!(got, mv, "rank {rank}: meshd's {k} ({why})");
                }
            }
        }
    }
    // What meshd sets beyond torchrun: each named in README's rank environment.
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README");
    let extra: BTreeSet<&str> = meshd_set
        .values()
        .flat_map(|(_, e)| e.keys().map(String::as_str))
        .filter(|k| !rules.contains_key(k))
        .collect();
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let named = |k: &str| readme.match_indices(k).any(|(i, _)| {
        !readme[..i].ends_with(word) && !readme[i + k.len()..].starts_with(word)
    });
    let undocumented: Vec<&&str> = extra.iter().filter(|k| !named(k)).collect();
    assert!(undocumented.is_empty(), "meshd sets {undocumented:?} for its ranks, not named in README.md");
    eprintln!("meshd sets beyond torchrun: {extra:?}");
}
);

on_torches!([torch2]
/// A rank that raises under `@record` (1 node x 2 ranks, local rank 1 fails): torchrun's
/// error file and meshd's have the same shape and content, and meshd's root cause says
/// what torchrun's says (rank, local rank, exit code, time, the exception, the traceback
/// to its last frame). One node: the error file does not depend on the others, and
/// torchrun's surviving nodes would wait out its exit barrier (it does not stop them).
fn the_error_file_record_writes_and_the_root_cause_match_torchruns(t) {
    lab_or_skip!();
    let mut lab = Lab::new(1);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/record_fail.py");
    let dir = std::env::temp_dir().join(format!("meshd-lab-record-{}-{}", std::process::id(), t.variant));
    let _ = std::fs::remove_dir_all(&dir);
    let (tdir, mdir) = (dir.join("torchrun"), dir.join("meshd"));
    let (tdir_s, mdir_s) = (tdir.display().to_string(), mdir.display().to_string());
    let env = t.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let res = torchrun_on_all(&mut lab, &t.python, "2", "record-7c3", &[script], &["--log-dir", &tdir_s], &env);
    let (code, _, terr) = &res[0];
    assert_eq!(*code, Some(1), "torchrun exits with the failure:\n{terr}");
    let troot = terr.split("Root Cause (first observed failure):").nth(1).expect("torchrun's root cause");
    for want in ["rank      : 1 (local_rank: 1)", "exitcode  : 1", "error_file:", "in deepest_frame_qz"] {
        assert!(troot.contains(want), "torchrun's root cause has {want:?}:\n{troot}");
    }
    let tfile = find_error_file(&tdir);

    let mut menv = env.clone();
    menv.push(("MESHD_TOKEN", "record"));
    let args = [meshd(), "run", "--nnodes", "1", "--nproc-per-node", "2", "--run-id", "record-7c3"];
    let args = [&args[..], &["--log-dir", &mdir_s, "--", &t.python, script]].concat();
    let k = lab.spawn(0, &args, &menv);
    let (code, out, err) = lab.wait(k, Duration::from_secs(120));
    assert_eq!(code, Some(1), "the failed rank's status:\n{out}\n{err}");
    let block = err.split("meshd: root cause: ").nth(1).unwrap_or_else(|| panic!("no root cause:\n{err}"));
    // torchrun's root cause, field by field, in meshd's words.
    for want in [
        "rank 1 (local rank 1, node rank 0)",
        "exited with status 1 at 20",
        "ValueError: boom-5e2a on rank 1",
        "traceback (the rank's TORCHELASTIC_ERROR_FILE)",
        "in deepest_frame_qz",
        "raise ValueError(\"boom-5e2a on rank \" + os.environ[\"RANK\"])",
        "meshd: exit status 1",
    ] {
        assert!(block.contains(want), "meshd's root cause has {want:?}:\n{block}");
    }
    // The error file @record wrote, under each launcher: the same keys, the same message
    // and traceback (the same script), a Unix time.
    let read = |p: &std::path::Path| -> serde_json::Value {
        let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}: {text}", p.display()))
    };
    let (tv, mv) = (read(&tfile), read(&mdir.join("attempt_0/rank1.error.json")));
    let keys = |v: &serde_json::Value| -> Vec<String> {
        let m = &v["message"];
        let mut k: Vec<String> = m.as_object().expect("message object").keys().cloned().collect();
        k.extend(m["extraInfo"].as_object().expect("extraInfo").keys().map(|x| format!("extraInfo.{x}")));
        k
    };
    assert_eq!(keys(&tv), keys(&mv), "the same error-file shape:\n{tv}\n{mv}");
    assert_eq!(tv["message"]["message"], "ValueError: boom-5e2a on rank 1", "{tv}");
    assert_eq!(mv["message"]["message"], tv["message"]["message"]);
    let tb = |v: &serde_json::Value| v["message"]["extraInfo"]["py_callstack"].as_str().unwrap_or("").to_string();
    assert!(tb(&tv).contains("in deepest_frame_qz") && tb(&tv) == tb(&mv), "{}\n----\n{}", tb(&tv), tb(&mv));
    for v in [&tv, &mv] {
        let ts = v["message"]["extraInfo"]["timestamp"].as_str();
        assert!(ts.is_some_and(|s| s.parse::<u64>().is_ok()), "a Unix time: {v}");
    }
    // --log-dir's error.json: the same shape again, plus where the rank ran.
    let ej = read(&mdir.join("error.json"));
    assert_eq!(ej["message"]["message"], tv["message"]["message"], "{ej}");
    let at = (ej["rank"].as_u64(), ej["local_rank"].as_u64(), ej["exit_status"].as_u64());
    assert_eq!(at, (Some(1), Some(1), Some(1)), "{ej}");
    let _ = std::fs::remove_dir_all(&dir);
}
);

/// The one `error.json` under torchrun's `--log-dir` (`RUNID_*/attempt_0/LOCALRANK/error.json`).
fn find_error_file(dir: &std::path::Path) -> std::path::PathBuf {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == "error.json") {
                found.push(p);
            }
        }
    }
    assert_eq!(found.len(), 1, "one error file under torchrun's --log-dir {}: {found:?}", dir.display());
    found.remove(0)
}
