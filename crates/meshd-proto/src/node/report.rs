//! What a waiting node says: the progress line, the running-job block, and the timeout
//! message. The core knows the membership side; the IO adds what only it knows (listed
//! peers that never answered, names that never resolved, authentication refusals).

use crate::meta::NodeState;
use std::time::Duration;

/// The state of a rendezvous wait, as words are made from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitReport {
    /// Restart round waited for.
    pub restart: u32,
    /// Candidates present (this node included).
    pub present: usize,
    /// `--nnodes` MIN.
    pub min: u32,
    /// `--nnodes` MAX.
    pub max: u32,
    /// With MIN < MAX: how long without a newcomer before starting.
    pub settle: Duration,
    /// How long this wait may last in all.
    pub timeout: Duration,
    /// The candidates' addresses ("10.0.0.1 (this node)").
    pub members: Vec<String>,
    /// Members of this run that answered but cannot join, each with why.
    pub disagreeing: Vec<String>,
    /// Members of this run that were present and went away ("10.0.0.3:29400 left").
    pub gone: Vec<String>,
}

impl WaitReport {
    /// "waiting for nodes: 2/4 present; no answer yet from ...; why...; auth...".
    /// `missing` are listed peers that never answered, `auth` one word per refusal.
    pub fn progress_line(&self, missing: &[String], auth: &[String]) -> String {
        let mut line =
            format!("waiting for nodes: {}/{} present", self.present, nnodes_text(self.min, self.max));
        if self.min < self.max && self.present >= self.min as usize {
            line.push_str(&format!(", starting once no newcomer arrived for {:?}", self.settle));
        }
        if !missing.is_empty() {
            line.push_str(&format!("; no answer yet from {}", missing.join(", ")));
        }
        for why in &self.disagreeing {
            line.push_str(&format!("; {why}"));
        }
        for a in auth {
            line.push_str(&format!("; {a}"));
        }
        line
    }

    /// Why the rendezvous did not finish. `auth` are whole clauses ("10.0.0.9 answered but
    /// failed authentication: ..."), `missing` the listed peers that never answered (with
    /// the UDP `port` to check), `unresolved` the names that never resolved.
    pub fn timeout_message(
        &self,
        auth: &[String],
        missing: &[String],
        port: u16,
        unresolved: &[String],
    ) -> String {
        let mut msg = format!(
            "rendezvous timed out after {}: {} of {} {} present",
            human(self.timeout),
            self.present,
            nnodes_text(self.min, self.max),
            if self.min == 1 && self.max == 1 { "node" } else { "nodes" }
        );
        if !self.members.is_empty() {
            msg.push_str(&format!(" ({})", self.members.join(", ")));
        }
        for why in &self.disagreeing {
            msg.push_str(&format!("; {why}"));
        }
        for a in auth {
            msg.push_str(&format!("; {a}"));
        }
        if !missing.is_empty() {
            msg.push_str(&format!(
                "; never answered: {} (is meshd running there, and UDP {port} open?)",
                missing.join(", ")
            ));
        }
        if !unresolved.is_empty() {
            msg.push_str(&format!("; never resolved: {}", unresolved.join(", ")));
        }
        if !self.gone.is_empty() {
            msg.push_str(&format!(
                "; present earlier, then gone: {} (did meshd stop there?)",
                self.gone.join(", ")
            ));
        }
        msg
    }
}

/// `N` or `MIN:MAX`, as `--nnodes` spells it.
pub fn nnodes_text(min: u32, max: u32) -> String {
    if min == max { min.to_string() } else { format!("{min}:{max}") }
}

/// The state of a node in words.
pub fn state_word(s: NodeState) -> &'static str {
    match s {
        NodeState::Waiting => "waiting",
        NodeState::Running => "running",
        NodeState::Done => "done",
        NodeState::Failed => "failed",
    }
}

/// `300s`, `1.5s`, `5m`: a duration as the flags spell it.
pub fn human(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 60.0 && s % 60.0 == 0.0 {
        format!("{}m", s / 60.0)
    } else {
        format!("{}s", (s * 1000.0).round() / 1000.0)
    }
}
