//! Flags and helpers shared by several subcommands.

use anyhow::{Context, Result, bail};
use clap::Args;
use meshd::peers::PeerSpec;
use meshd::transport::auth::Token;
use std::net::SocketAddr;

/// Where meshd listens and how it authenticates.
#[derive(Args, Debug, Clone)]
pub struct NetArgs {
    /// The ONE UDP port meshd uses between nodes.
    #[arg(long, default_value_t = 29400)]
    pub port: u16,
    /// Shared secret: only nodes holding it can join.
    #[arg(long, env = "MESHD_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Read the shared secret from a file (mode 0600; `meshd token --file F` makes one).
    #[arg(long, alias = "token_file", conflicts_with = "token")]
    pub token_file: Option<String>,
    /// Allow a multi-node mesh without a token: anyone who reaches the UDP port can join,
    /// read the mesh, start or stop the job.
    #[arg(long)]
    pub insecure: bool,
    /// `--port` was given on the command line (not the default): from clap's value source.
    #[arg(skip)]
    pub port_given: bool,
    /// The token came from `--token` on the command line (visible in `ps`), not from
    /// MESHD_TOKEN: from clap's value source.
    #[arg(skip)]
    pub token_on_command_line: bool,
}

impl NetArgs {
    /// Notes where `--port` and `--token` came from, as clap parsed them into `m` (the
    /// matches of the subcommand that holds these flags).
    pub fn note_sources(&mut self, m: &clap::ArgMatches) {
        use clap::parser::ValueSource::CommandLine;
        self.port_given = m.value_source("port") == Some(CommandLine);
        self.token_on_command_line = m.value_source("token") == Some(CommandLine);
    }

    /// The token for a mesh of `max_nodes`: a multi-node mesh without one is refused unless
    /// `--insecure` says so.
    pub fn token_for(&self, max_nodes: u32) -> Result<Option<Token>> {
        let token = self.token()?;
        if token.is_none() && max_nodes > 1 && !self.insecure {
            bail!(
                "a multi-node mesh needs a token, so that only your nodes can join, see it, or start and stop \
                 the job: make one with `meshd token --file ~/.meshd-token`, copy the file to every node, and \
                 pass --token-file ~/.meshd-token (or MESHD_TOKEN) on each; --insecure runs without one"
            );
        }
        Ok(token)
    }

    /// The token from --token, MESHD_TOKEN or --token-file.
    pub fn token(&self) -> Result<Option<Token>> {
        if let Some(f) = &self.token_file {
            check_private(f)?;
            let s = std::fs::read_to_string(f).with_context(|| format!("cannot read --token-file {f}"))?;
            if s.trim().is_empty() {
                bail!("--token-file {f} is empty");
            }
            return Ok(Some(Token::new(&s)));
        }
        if self.token.is_some() && self.token_on_command_line {
            tracing::warn!(
                "--token on the command line is visible to every user of this machine (ps, /proc); \
                 prefer --token-file F (mode 0600) or the MESHD_TOKEN variable"
            );
        }
        match &self.token {
            Some(t) if t.trim().is_empty() => bail!("--token / MESHD_TOKEN is empty"),
            Some(t) => Ok(Some(Token::new(t))),
            None => Ok(None),
        }
    }
}

/// Refuses a token file that others may read, as ssh refuses such a private key.
fn check_private(path: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read --token-file {path}"))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        bail!(
            "--token-file {path} can be read by other users (mode {mode:04o}): the token would let them join \
             and control the job; run `chmod 600 {path}`"
        );
    }
    Ok(())
}

/// Resolved peer entries: (label as listed, address).
pub type Listed = Vec<(String, SocketAddr)>;

/// `--peers` from the flag or SLURM_STEP_NODELIST / SLURM_JOB_NODELIST, parsed and resolved: the addresses, and
/// the entries that did not resolve yet (the mesh keeps trying them: DNS may lag behind a
/// node's start) or must be re-resolved (`dns:` names).
pub fn peers(flag: Option<&str>, port: u16, slurm_nodelist: Option<&str>) -> Result<(Listed, Vec<PeerSpec>)> {
    let text = match flag {
        Some(p) => p.to_string(),
        // Inside a step, the step's nodes (SLURM_STEP_NODELIST), not the allocation's.
        None => match slurm_nodelist {
            Some(list) => meshd::peers::expand_hostlist(list)?.join(","),
            None => return Ok((Vec::new(), Vec::new())),
        },
    };
    let specs = meshd::peers::parse(&text)?;
    let mut addrs = Vec::new();
    let mut later = Vec::new();
    for spec in specs {
        let (found, errors) = meshd::peers::resolve(std::slice::from_ref(&spec), port);
        for e in &errors {
            tracing::warn!("cannot resolve peer {e} yet; trying again in the background");
        }
        if !errors.is_empty() || matches!(spec, PeerSpec::Dns { .. }) {
            later.push(spec);
        }
        for a in found {
            if !addrs.contains(&a) {
                addrs.push(a);
            }
        }
    }
    Ok((addrs, later))
}

/// `--peers` resolved once, for commands that do not wait (`ifaces`, `status`): an entry
/// that does not resolve is an error naming it when nothing else resolved.
pub fn peers_now(
    flag: Option<&str>,
    port: u16,
    slurm_nodelist: Option<&str>,
) -> Result<Vec<(String, SocketAddr)>> {
    let (addrs, later) = peers(flag, port, slurm_nodelist)?;
    let never: Vec<PeerSpec> = later.into_iter().filter(|s| matches!(s, PeerSpec::Host { .. })).collect();
    if addrs.is_empty() && !never.is_empty() {
        let (_, errors) = meshd::peers::resolve(&never, port);
        bail!("none of the listed peers resolved: {}", errors.join("; "));
    }
    Ok(addrs)
}

pub fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("MESHD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
