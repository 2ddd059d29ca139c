//! The `--peers` syntax: `host[:port],...`, `@FILE` (one host a line), `dns:NAME` (every
//! A/AAAA record, re-resolved on each call), and SLURM's hostlists (`SLURM_STEP_NODELIST`,
//! else `SLURM_JOB_NODELIST`: [`slurm_nodelist`]).

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

/// One entry of a peer list, before resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerSpec {
    /// A host name or literal address, with an optional port.
    Host {
        /// Host name or address text.
        host: String,
        /// Port, if given.
        port: Option<u16>,
    },
    /// Every record of a DNS name (re-resolved when the list is resolved again).
    Dns {
        /// The name.
        name: String,
        /// Port, if given.
        port: Option<u16>,
    },
}

/// Errors in a peer list.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PeersError {
    /// An entry could not be parsed.
    #[error("bad peer entry {0:?}: {1}")]
    Bad(String, String),
    /// `@FILE` could not be read.
    #[error("cannot read peer file {0}: {1}")]
    File(String, String),
    /// A SLURM hostlist could not be expanded.
    #[error("bad SLURM hostlist {0:?}: {1}")]
    Hostlist(String, String),
}

fn split_port(s: &str) -> Result<(String, Option<u16>), String> {
    let bad_port = |p: &str| format!("port {p:?} is not a number from 1 to 65535");
    if let Some(rest) = s.strip_prefix('[') {
        // [v6]:port
        let (host, after) = rest.split_once(']').ok_or("missing ']'")?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| bad_port(p))?),
            None if after.is_empty() => None,
            None => return Err(format!("unexpected {after:?} after ']'")),
        };
        return Ok((host.to_string(), port));
    }
    if s.parse::<IpAddr>().is_ok() {
        return Ok((s.to_string(), None)); // bare IPv6 (or IPv4) literal
    }
    match s.rsplit_once(':') {
        Some((h, p)) => {
            Ok((h.to_string(), Some(p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| bad_port(p))?)))
        }
        None => Ok((s.to_string(), None)),
    }
}

/// Parses a `--peers` value. `@FILE` entries are read here.
pub fn parse(list: &str) -> Result<Vec<PeerSpec>, PeersError> {
    let mut out = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if let Some(path) = item.strip_prefix('@') {
            let text =
                std::fs::read_to_string(path).map_err(|e| PeersError::File(path.into(), e.to_string()))?;
            for line in
                text.lines().map(|l| l.split('#').next().unwrap_or("").trim()).filter(|l| !l.is_empty())
            {
                out.extend(parse(line)?);
            }
        } else if let Some(name) = item.strip_prefix("dns:") {
            let (name, port) = split_port(name).map_err(|e| PeersError::Bad(item.into(), e))?;
            out.push(PeerSpec::Dns { name, port });
        } else {
            let (host, port) = split_port(item).map_err(|e| PeersError::Bad(item.into(), e))?;
            if host.is_empty() || host.contains(char::is_whitespace) {
                return Err(PeersError::Bad(item.into(), "empty or blank host".into()));
            }
            out.push(PeerSpec::Host { host, port });
        }
    }
    Ok(out)
}

/// Resolves every entry to socket addresses (`default_port` where none was given).
/// Unresolvable names are returned as errors beside the addresses that did resolve:
/// any one reachable member is enough to join.
pub fn resolve(specs: &[PeerSpec], default_port: u16) -> (Vec<(String, SocketAddr)>, Vec<String>) {
    let mut addrs: Vec<(String, SocketAddr)> = Vec::new();
    let mut errors = Vec::new();
    for s in specs {
        let (label, host, port) = match s {
            PeerSpec::Host { host, port } => (host.clone(), host, port.unwrap_or(default_port)),
            PeerSpec::Dns { name, port } => (format!("dns:{name}"), name, port.unwrap_or(default_port)),
        };
        if let Ok(ip) = host.parse::<IpAddr>() {
            addrs.push((label, SocketAddr::new(ip, port)));
            continue;
        }
        match (host.as_str(), port).to_socket_addrs() {
            Ok(it) => {
                let mut found: Vec<SocketAddr> =
                    it.map(|a| SocketAddr::new(a.ip().to_canonical(), a.port())).collect();
                let any = !found.is_empty();
                if matches!(s, PeerSpec::Host { .. }) {
                    // A host name means one host: its first address that is not loopback
                    // (Debian's /etc/hosts maps the machine's own name to 127.0.1.1, which
                    // says nothing about the interface the others reach it on), else its first.
                    let pick = found.iter().position(|a| !a.ip().is_loopback()).unwrap_or(0);
                    found = found.get(pick).copied().into_iter().collect();
                }
                for a in found {
                    if !addrs.iter().any(|(_, x)| *x == a) {
                        addrs.push((label.clone(), a));
                    }
                }
                if !any {
                    errors.push(format!("{label}: no address"));
                }
            }
            Err(e) => errors.push(format!("{label}: {e}")),
        }
    }
    (addrs, errors)
}

/// The nodes of this SLURM step, for `--peers`' default: `SLURM_STEP_NODELIST` inside a step
/// (`srun`), else `SLURM_JOB_NODELIST` (the batch script itself, `salloc`). A step may use
/// only part of the allocation (`srun -N2` in a 4-node job), and srun leaves
/// `SLURM_JOB_NODELIST` at the allocation's nodes: meshd must not wait for, or join, nodes
/// that run no task of its step. Returns (variable name, value) of the first one set.
pub fn slurm_nodelist(get: impl Fn(&str) -> Option<String>) -> Option<(&'static str, String)> {
    ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"]
        .into_iter()
        .find_map(|k| get(k).filter(|v| !v.trim().is_empty()).map(|v| (k, v)))
}

/// The node count of this SLURM step, for `--nnodes`' default: `SLURM_STEP_NUM_NODES`
/// inside a step, else `SLURM_NNODES` (which `srun --preserve-env` leaves at the
/// allocation's count), else `SLURM_JOB_NUM_NODES`. Returns (variable name, value).
pub fn slurm_nnodes(get: impl Fn(&str) -> Option<String>) -> Option<(&'static str, String)> {
    ["SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"]
        .into_iter()
        .find_map(|k| get(k).filter(|v| !v.trim().is_empty()).map(|v| (k, v)))
}

/// Expands a SLURM hostlist (`gpu[01-03,07],login1`) into host names.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, PeersError> {
    let err = |m: &str| PeersError::Hostlist(list.to_string(), m.to_string());
    let mut out = Vec::new();
    // Split on commas that are not inside brackets.
    let mut depth = 0i32;
    let mut start = 0;
    let mut parts = Vec::new();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(err("unbalanced brackets"));
        }
    }
    if depth != 0 {
        return Err(err("unbalanced brackets"));
    }
    parts.push(&list[start..]);
    for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
        let Some(open) = part.find('[') else {
            out.push(part.to_string());
            continue;
        };
        let close = part.find(']').ok_or_else(|| err("missing ']'"))?;
        let (prefix, ranges, suffix) = (&part[..open], &part[open + 1..close], &part[close + 1..]);
        if suffix.contains('[') {
            return Err(err("more than one bracket group per host is not supported"));
        }
        for r in ranges.split(',') {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            let width = a.len();
            let lo: u64 = a.parse().map_err(|_| err("range bound is not a number"))?;
            let hi: u64 = b.parse().map_err(|_| err("range bound is not a number"))?;
            if hi < lo || hi - lo > 100_000 {
                return Err(err("range is reversed or too large"));
            }
            for n in lo..=hi {
                out.push(format!("{prefix}{n:0width$}{suffix}"));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_ports_v6_and_dns() {
        let p =
            parse("10.0.0.2, 10.0.0.34:29500,[fd00::1]:7,fd00::2,dns:workers.local,gpu-1").expect("parse");
        assert_eq!(p[0], PeerSpec::Host { host: "10.0.0.2".into(), port: None });
        assert_eq!(p[1], PeerSpec::Host { host: "10.0.0.34".into(), port: Some(29500) });
        assert_eq!(p[2], PeerSpec::Host { host: "fd00::1".into(), port: Some(7) });
        assert_eq!(p[3], PeerSpec::Host { host: "fd00::2".into(), port: None });
        assert_eq!(p[4], PeerSpec::Dns { name: "workers.local".into(), port: None });
        assert_eq!(p[5], PeerSpec::Host { host: "gpu-1".into(), port: None });
    }

    #[test]
    fn bad_entries_name_the_entry() {
        let e = parse("10.0.0.2:99999").expect_err("bad port");
        assert!(e.to_string().contains("10.0.0.2:99999"), "{e}");
        assert!(parse("[fd00::1").is_err());
        assert!(
            parse("@/nonexistent/peers.txt")
                .expect_err("file")
                .to_string()
                .contains("/nonexistent/peers.txt")
        );
    }

    #[test]
    fn peer_file_one_host_a_line() {
        let dir = std::env::temp_dir().join(format!("meshd-peers-{}", std::process::id()));
        std::fs::write(&dir, "10.0.0.1\n# comment\n\n10.0.0.2:1234 # trailing\n").expect("write");
        let p = parse(&format!("@{}", dir.display())).expect("parse");
        let _ = std::fs::remove_file(&dir);
        assert_eq!(p.len(), 2);
        assert_eq!(p[1], PeerSpec::Host { host: "10.0.0.2".into(), port: Some(1234) });
    }

    #[test]
    fn resolves_literals_with_default_port() {
        let (a, e) = resolve(&parse("127.0.0.1,[::1]:5").expect("parse"), 29400);
        assert!(e.is_empty());
        assert_eq!(a[0].1, "127.0.0.1:29400".parse().expect("addr"));
        assert_eq!(a[1].1, "[::1]:5".parse().expect("addr"));
    }

    #[test]
    fn slurm_hostlists() {
        assert_eq!(
            expand_hostlist("gpu[01-03,07],login1").expect("ok"),
            vec!["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
        );
        assert_eq!(expand_hostlist("n[8-10]-ib").expect("ok"), vec!["n8-ib", "n9-ib", "n10-ib"]);
        assert_eq!(expand_hostlist("single").expect("ok"), vec!["single"]);
        assert!(expand_hostlist("gpu[1-").is_err());
        assert!(expand_hostlist("gpu[5-1]").is_err());
        assert!(expand_hostlist("gpu[a-b]").is_err());
    }

    #[test]
    fn slurm_step_variables_win_over_the_allocation() {
        // srun -N3 in a 4-node allocation: the task environment srun sets.
        let step = |k: &str| {
            match k {
                "SLURM_JOB_NODELIST" => Some("gpu[01-02,07,09]"),
                "SLURM_STEP_NODELIST" => Some("gpu[01-02,07]"),
                "SLURM_JOB_NUM_NODES" => Some("4"),
                "SLURM_NNODES" => Some("4"), // as srun --preserve-env leaves it
                "SLURM_STEP_NUM_NODES" => Some("3"),
                _ => None,
            }
            .map(String::from)
        };
        assert_eq!(slurm_nodelist(step), Some(("SLURM_STEP_NODELIST", "gpu[01-02,07]".into())));
        assert_eq!(slurm_nnodes(step), Some(("SLURM_STEP_NUM_NODES", "3".into())));
        // The batch script itself (no step): the allocation.
        let batch = |k: &str| {
            match k {
                "SLURM_JOB_NODELIST" => Some("gpu[01-02,07,09]"),
                "SLURM_NNODES" => Some("4"),
                _ => None,
            }
            .map(String::from)
        };
        assert_eq!(slurm_nodelist(batch), Some(("SLURM_JOB_NODELIST", "gpu[01-02,07,09]".into())));
        assert_eq!(slurm_nnodes(batch), Some(("SLURM_NNODES", "4".into())));
        assert_eq!(slurm_nodelist(|_: &str| None), None);
        assert_eq!(slurm_nnodes(|_: &str| Some(" ".into())), None);
    }
}
