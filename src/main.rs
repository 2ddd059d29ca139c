//! The `meshd` command: the same line on every node starts a multi-node job.
//!
//! Subcommands live in their own files; each parses its flags with clap and calls the
//! library (`meshd` crate). Errors reach the user as one line naming the cause.

mod bench;
mod common;
mod doctor;
mod env;
mod ifaces;
mod lighthouse;
mod run;
mod status;
mod token;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "meshd",
    version,
    about = "One identical command on every node starts a multi-node GPU job."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Join the mesh, agree on master and ranks, start CMD on every node, supervise.
    Run(run::Args),
    /// Same flags as run, no command: form the mesh, run the preflight, print one report.
    Doctor(doctor::Args),
    /// Benchmarks, identical on every node.
    #[command(subcommand)]
    Bench(bench::Which),
    /// Members of a running mesh: address, interface, GPUs, state, RTT, role, restarts.
    Status(status::Args),
    /// List interfaces; with --peers, show which one reaches each peer and the one meshd would choose.
    Ifaces(ifaces::Args),
    /// Print a fresh 128-bit random token, or write it to a private file (--file F, mode 0600).
    Token(token::Args),
    /// A torchft-compatible Lighthouse (torchft_lighthouse's flags) with one local decider.
    Lighthouse(lighthouse::Args),
}

/// Keep freed heap memory for reuse instead of handing it back to the kernel at once.
///
/// quinn copies every received datagram into a fresh allocation, and the ring holds a
/// chunk's pieces until it has reduced them. With glibc's adaptive thresholds the heap was
/// trimmed and grown again all the time, so a ring allreduce faulted in fresh pages for a
/// large share of the bytes it carried, most of them in quinn's receive copy
/// (docs/PERFORMANCE.md, "Where the CPU goes"). Up to 64 MiB of free heap is kept;
/// allocations of 8 MiB or more still come straight from the kernel.
///
/// glibc also opens a new arena (heap) for every thread that finds the others busy, up to
/// 8 per core, and each arena keeps its own free memory: over a long job meshd's RSS grew
/// well past the heap in use, spread over many arenas (docs/PERFORMANCE.md, "Memory over a
/// long job"). So arenas are capped at `workers` (the runtime's threads do nearly all of
/// meshd's allocation), unless the user set `MALLOC_ARENA_MAX` or `GLIBC_TUNABLES`
/// (`user_tuned`).
fn tune_allocator(workers: usize, user_tuned: bool) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before any other thread
    // exists.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 8 << 20);
        if !user_tuned {
            libc::mallopt(libc::M_ARENA_MAX, workers.clamp(2, 8) as libc::c_int);
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = (workers, user_tuned);
}

impl Cmd {
    /// The subcommand's network flags, when it has them.
    fn net_mut(&mut self) -> Option<&mut common::NetArgs> {
        match self {
            Cmd::Run(a) => Some(&mut a.job.net),
            Cmd::Doctor(a) => Some(&mut a.job.net),
            Cmd::Bench(bench::Which::Allreduce(a)) => Some(&mut a.job.net),
            Cmd::Status(a) => Some(a.net_mut()),
            Cmd::Ifaces(a) => Some(a.net_mut()),
            Cmd::Token(_) | Cmd::Lighthouse(_) => None,
        }
    }
}

fn main() -> ExitCode {
    // What ran in this process before meshd (cargo run, ip netns exec) is not meshd's CPU.
    meshd::job::mark_cpu_start();
    // The NCCL root child (see meshd::nccl_root): no runtime, no logging on stdout.
    if std::env::args().nth(1).as_deref() == Some("__nccl-root") {
        return ExitCode::from(meshd_nccl::serve_root_blocking().clamp(0, 255) as u8);
    }
    // Tunnel mode holds an open file per tunnelled connection at each end: the soft limit
    // (often 1024) goes up to the hard one, for meshd and the ranks it starts.
    let files = meshd::files::raise_limit();
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Where flags came from (the command line or the environment): clap knows, the
    // arguments are not scanned again.
    let mut sub = &matches;
    while let Some((_, m)) = sub.subcommand() {
        sub = m;
    }
    if let Some(net) = cli.cmd.net_mut() {
        net.note_sources(sub);
    }
    if let Cmd::Run(a) = &mut cli.cmd {
        a.note_dashdash(&std::env::args().collect::<Vec<_>>());
    }
    common::init_tracing();
    tracing::debug!("open-files limit {} (hard {})", files.soft, files.hard);
    // The environment meshd reads, read once (src/env.rs): the library reads none.
    let env = env::EnvConfig::from_env();
    // One worker per 8 cores, from 2 to 8: meshd shares the machine with the job's own
    // processes, but on a many-core GPU node the QUIC ring's lanes need cores of their own.
    let threads = env
        .threads
        .unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
            (cores / 8).clamp(2, 8)
        })
        .max(1);
    tune_allocator(threads, env.allocator_tuned);
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("meshd: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let res = rt.block_on(async {
        // Installed first and once: every wait of every command ends on SIGINT/SIGTERM.
        let installed = match &cli.cmd {
            // `run` forwards SIGUSR1/SIGUSR2 to its ranks and stops on --signals-to-handle.
            Cmd::Run(a) => match meshd::signals::parse_stops(&a.job.signals_to_handle) {
                Ok(stops) => meshd::signals::Signals::install_with(&stops, true),
                Err(e) => return Err(anyhow::anyhow!("{e}")),
            },
            _ => meshd::signals::Signals::install(),
        };
        let signals = match installed {
            Ok(s) => s,
            Err(e) => return Err(anyhow::anyhow!("cannot watch SIGINT/SIGTERM: {e}")),
        };
        if let Cmd::Run(a) = cli.cmd {
            // `run` stops its ranks on a signal itself, then exits 130/143.
            return run::main(a, signals, &env).await;
        }
        let mut sig = signals.clone();
        let work = async {
            match cli.cmd {
                Cmd::Ifaces(a) => ifaces::main(a, &env).await,
                Cmd::Status(a) => status::main(a, &env).await,
                Cmd::Doctor(a) => doctor::main(a, &env).await,
                Cmd::Bench(w) => bench::main(w, &env).await,
                Cmd::Token(a) => token::main(a),
                Cmd::Lighthouse(a) => lighthouse::main(a).await,
                Cmd::Run(_) => unreachable!("handled above"),
            }
        };
        tokio::select! {
            r = work => r,
            s = sig.recv() => {
                // No ranks here: dropping the work stops it (the NCCL root is killed on drop).
                eprintln!("meshd: {}", s.describe());
                Ok(ExitCode::from(s.exit_code()))
            }
        }
    });
    match res {
        Ok(code) => code,
        Err(e) => {
            eprintln!("meshd: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
