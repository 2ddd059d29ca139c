//! What a failed or stalled local rank left: where it ran, how it ended, its error file
//! or last stderr lines, or its stack.

use super::*;

/// The details of a local rank that failed: where it ran, how it ended, and why (its error
/// file, else its last stderr lines).
pub(super) fn rank_failure(
    addr: SocketAddr,
    roster: &Roster,
    node_rank: usize,
    e: &supervisor::RankExit,
    tail: &[String],
    round_dir: Option<&std::path::Path>,
) -> RankFailure {
    let mut f = RankFailure {
        host: roster.members.get(node_rank).map(|m| m.hostname.clone()).unwrap_or_default(),
        addr: addr.ip().to_string(),
        node_rank: node_rank as u32,
        rank: e.global,
        local_rank: e.local,
        exit: supervisor::describe(&e.status),
        status: cause::exit_status(&e.status),
        time: cause::now_unix(),
        ..Default::default()
    };
    let file = round_dir.map(|d| cause::error_file(d, e.global)).unwrap_or_default();
    cause::explain(&mut f, &file, tail);
    f
}

/// This node's ranks stalled: each gets SIGABRT (with PYTHONFAULTHANDLER=1, Python prints
/// every thread's stack to stderr, then dies), and their last stderr lines become the root
/// cause. Exit status 124, as `timeout`'s.
pub(super) async fn stalled(
    addr: SocketAddr,
    roster: &Roster,
    node_rank: usize,
    sup: &mut Supervisor,
    t: Duration,
) -> RankFailure {
    let ranks: Vec<(u32, u32, i32)> = sup.ranks().to_vec();
    warn!(
        "no rank wrote output or called meshd for {t:?} (--stall-timeout): sending SIGABRT to {} for their Python stacks",
        crate::plural(ranks.len() as u64, "rank")
    );
    sup.signal_all(libc::SIGABRT);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while sup.running() > 0 {
        match tokio::time::timeout_at(deadline, sup.next_exit()).await {
            Ok(Some(_)) => {}
            _ => break,
        }
    }
    let mut stacks = String::new();
    for (g, _, _) in &ranks {
        stacks.push_str(&format!("rank {g}:\n"));
        for l in sup.tail(*g) {
            stacks.push_str("  ");
            stacks.push_str(&l);
            stacks.push('\n');
        }
    }
    let (g, l) = ranks.first().map(|r| (r.0, r.1)).unwrap_or_default();
    RankFailure {
        host: roster.members.get(node_rank).map(|m| m.hostname.clone()).unwrap_or_default(),
        addr: addr.ip().to_string(),
        node_rank: node_rank as u32,
        rank: g,
        local_rank: l,
        exit: format!("stalled: no output or meshd call for {t:?}"),
        status: 124,
        time: cause::now_unix(),
        message: format!(
            "job stalled on {}",
            roster.members.get(node_rank).map(|m| m.hostname.as_str()).unwrap_or("?")
        ),
        traceback: cause::keep_end(stacks.trim_end(), cause::MAX_TRACEBACK),
        source: meshd_proto::rendezvous::FailureSource::Stall,
    }
}

pub(super) fn describe_member(roster: &Roster, id: NodeId) -> String {
    roster
        .members
        .iter()
        .find(|m| m.id == id)
        .map(|m| format!("node {} ({})", if m.hostname.is_empty() { "?" } else { &m.hostname }, m.addr.ip()))
        .unwrap_or_else(|| format!("node {id}"))
}
