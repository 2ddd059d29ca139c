//! Lab: the `meshd` that `pip install meshd-launcher` (or `pip install .`) puts on a venv's
//! PATH runs a 2-host job (issue 18.1). scripts/wheel-check.sh builds the wheel, installs it into a fresh venv and runs
//! this test with `MESHD_WHEEL_BIN` set to the venv's `bin/meshd`; without it the test is
//! skipped, loudly (a plain `cargo test` has no wheel to test).
//!
//! The job runs with PATH = the venv's bin and /usr/bin:/bin only (no cargo, no target/),
//! and every rank checks that `meshd` on its PATH is the venv's and that `import meshd`
//! in the venv's python is the wheel's client.

mod lab;
use lab::Lab;
use std::time::Duration;

fn wheel_bin() -> Option<String> {
    match std::env::var("MESHD_WHEEL_BIN") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!(
                "\n*** WHEEL TEST SKIPPED: MESHD_WHEEL_BIN is not set. scripts/wheel-check.sh builds the \
                 wheel, installs it into a fresh venv and runs this test with MESHD_WHEEL_BIN=<venv>/bin/meshd ***\n"
            );
            None
        }
    }
}

#[test]
fn two_hosts_run_a_job_with_the_venv_meshd() {
    let Some(bin) = wheel_bin() else { return };
    lab_or_skip!();
    let venv_bin = std::path::Path::new(&bin).parent().expect("venv bin dir").display().to_string();
    assert!(std::path::Path::new(&bin).is_file(), "MESHD_WHEEL_BIN={bin} is not a file");
    let mut lab = Lab::new(2);
    let path = format!("{venv_bin}:/usr/bin:/bin");
    // Each rank: which meshd its PATH finds, where the venv's python imports meshd from.
    let script = "echo \"WHEEL rank=$RANK world=$WORLD_SIZE meshd=$(command -v meshd) \
                  client=$(python -c 'import meshd, os; print(os.path.dirname(meshd.__file__))')\"";
    let args = lab
        .meshd_run()
        .bin(&bin)
        .flags(&["--rdzv-timeout", "60s", "--nproc-per-node", "2"])
        .cmd(&["sh", "-c", script]);
    let env = [("PATH", path.as_str()), ("MESHD_TOKEN", "wheel-lab-token")];
    let res = lab.run_on_all(&args, &env, Duration::from_secs(90));
    let mut ranks = Vec::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i} failed:\n{out}\n{err}");
        for line in out.lines().filter(|l| l.contains("WHEEL rank=")) {
            assert!(line.contains("world=4 "), "host {i}: {line}");
            assert!(
                line.contains(&format!("meshd={bin} ")),
                "host {i}: meshd on PATH is not the venv's: {line}"
            );
            let venv = std::path::Path::new(&venv_bin).parent().expect("venv").display().to_string();
            assert!(line.contains(&format!("client={venv}/")), "host {i}: client not from the venv: {line}");
            let rank: u32 = line
                .split("rank=")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|r| r.parse().ok())
                .expect("rank");
            ranks.push(rank);
        }
    }
    ranks.sort();
    assert_eq!(ranks, vec![0, 1, 2, 3], "every rank ran once:\n{res:?}");
}
