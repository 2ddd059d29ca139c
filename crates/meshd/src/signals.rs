//! SIGINT and SIGTERM (and the other signals `--signals-to-handle` names), watched once for
//! the whole process; SIGUSR1 and SIGUSR2, unless named there, are for the ranks: they are
//! handed to [`Signals::forwarded`] and meshd goes on.
//!
//! Every wait of a job (membership, rendezvous, preflight, restart rounds, supervision,
//! the grace for a node that left) selects on [`Signals::recv`]. The handlers are installed
//! once, at start, so a signal that arrives between two waits is not lost: it is kept and
//! the next wait ends at once. (A `tokio::signal::ctrl_c()` created inside each `select!`
//! would replace the default action for the whole process and then see only the signals
//! that arrive while that one select is polled: between waits Ctrl-C did nothing.)

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// A stop request from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// SIGINT (Ctrl-C): exit status 130.
    Interrupt,
    /// SIGTERM: exit status 143.
    Terminate,
    /// Another signal named by `--signals-to-handle` (SIGHUP, SIGQUIT, ...): 128 + its number.
    Other(i32),
}

impl Stop {
    /// The exit status a shell gives a process ended by this signal.
    pub fn exit_code(self) -> u8 {
        match self {
            Stop::Interrupt => 130,
            Stop::Terminate => 143,
            Stop::Other(n) => (128 + n).clamp(1, 255) as u8,
        }
    }

    /// The signal's name.
    pub fn name(self) -> &'static str {
        match self {
            Stop::Interrupt => "SIGINT",
            Stop::Terminate => "SIGTERM",
            Stop::Other(n) => signal_name(n),
        }
    }

    /// What happened, in words: `interrupted (SIGINT)` or `stopped (SIGTERM)`.
    pub fn describe(self) -> &'static str {
        match self {
            Stop::Interrupt => "interrupted (SIGINT)",
            Stop::Terminate => "stopped (SIGTERM)",
            Stop::Other(n) => match n {
                libc::SIGHUP => "stopped (SIGHUP)",
                libc::SIGQUIT => "stopped (SIGQUIT)",
                libc::SIGUSR1 => "stopped (SIGUSR1)",
                libc::SIGUSR2 => "stopped (SIGUSR2)",
                _ => "stopped by a signal",
            },
        }
    }
}

/// The signals `--signals-to-handle` may name, with their numbers.
pub const NAMED: [(&str, i32); 6] = [
    ("SIGTERM", libc::SIGTERM),
    ("SIGINT", libc::SIGINT),
    ("SIGHUP", libc::SIGHUP),
    ("SIGQUIT", libc::SIGQUIT),
    ("SIGUSR1", libc::SIGUSR1),
    ("SIGUSR2", libc::SIGUSR2),
];

/// torchrun's default `--signals-to-handle`.
pub const DEFAULT_STOPS: &str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

/// A signal's name (`SIGUSR1`), or `signal` when not one of [`NAMED`].
pub fn signal_name(n: i32) -> &'static str {
    NAMED.iter().find(|(_, v)| *v == n).map_or("signal", |(k, _)| k)
}

/// A `--signals-to-handle` entry that names no signal meshd handles.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--signals-to-handle: {0:?} is not one of SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2")]
pub struct UnknownSignal(pub String);

/// Parses `--signals-to-handle` (`SIGTERM,SIGINT,SIGHUP,SIGQUIT`; `TERM` and numbers too).
/// SIGINT and SIGTERM always stop meshd (its contract: 130, 143), listed or not.
pub fn parse_stops(s: &str) -> Result<Vec<i32>, UnknownSignal> {
    let mut v = vec![libc::SIGINT, libc::SIGTERM];
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let up = part.to_ascii_uppercase();
        let name = if up.starts_with("SIG") { up } else { format!("SIG{up}") };
        let n = NAMED
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, n)| *n)
            .or_else(|| part.parse::<i32>().ok().filter(|n| NAMED.iter().any(|(_, v)| v == n)))
            .ok_or_else(|| UnknownSignal(part.to_string()))?;
        if !v.contains(&n) {
            v.push(n);
        }
    }
    Ok(v)
}

/// The process's stop requests. Cheap to clone; every clone sees the same signals.
#[derive(Clone, Debug)]
pub struct Signals {
    rx: watch::Receiver<Option<Stop>>,
    /// SIGUSR1/SIGUSR2 received for the ranks (not in the stop list).
    fwd: Option<tokio::sync::broadcast::Sender<i32>>,
}

impl Signals {
    /// Installs the SIGINT and SIGTERM handlers (call once, inside the runtime).
    pub fn install() -> std::io::Result<Signals> {
        Signals::install_with(&[libc::SIGINT, libc::SIGTERM], false)
    }

    /// Installs handlers for the signals in `stops` (SIGINT and SIGTERM always), and, with
    /// `forward`, for SIGUSR1 and SIGUSR2 not in `stops`: those go to [`Signals::forwarded`].
    pub fn install_with(stops: &[i32], forward: bool) -> std::io::Result<Signals> {
        let mut watched: Vec<(i32, tokio::signal::unix::Signal)> = Vec::new();
        let mut all: Vec<i32> = vec![libc::SIGINT, libc::SIGTERM];
        all.extend(stops.iter().copied().filter(|s| ![libc::SIGINT, libc::SIGTERM].contains(s)));
        if forward {
            all.extend([libc::SIGUSR1, libc::SIGUSR2].into_iter().filter(|s| !stops.contains(s)));
        }
        for n in all {
            watched.push((n, signal(SignalKind::from_raw(n))?));
        }
        let (tx, rx) = watch::channel(None);
        let fwd = forward.then(|| tokio::sync::broadcast::channel::<i32>(16).0);
        let fwd_tx = fwd.clone();
        let stops: Vec<i32> = stops.to_vec();
        tokio::spawn(async move {
            loop {
                let polls = watched.iter_mut().map(|(n, s)| {
                    let n = *n;
                    Box::pin(async move { s.recv().await.map(|_| n) })
                });
                let (got, _, _) = futures_select_all(polls).await;
                let Some(n) = got else { return };
                let stop = match n {
                    libc::SIGINT => Stop::Interrupt,
                    libc::SIGTERM => Stop::Terminate,
                    n if stops.contains(&n) => Stop::Other(n),
                    n => {
                        if let Some(f) = &fwd_tx {
                            let _ = f.send(n);
                        }
                        continue;
                    }
                };
                // The first signal decides the exit status; later ones change nothing.
                tx.send_if_modified(|cur| {
                    if cur.is_none() {
                        *cur = Some(stop);
                        true
                    } else {
                        false
                    }
                });
            }
        });
        Ok(Signals { rx, fwd })
    }

    /// Signals that never fire (library users who handle signals themselves, tests).
    pub fn none() -> Signals {
        let (tx, rx) = watch::channel(None);
        // Keep the sender alive forever so that `recv` pends instead of ending.
        std::mem::forget(tx);
        Signals { rx, fwd: None }
    }

    /// A receiver of the SIGUSR1/SIGUSR2 meshd received for the ranks (None: not watched).
    pub fn forwarded(&self) -> Option<tokio::sync::broadcast::Receiver<i32>> {
        self.fwd.as_ref().map(|f| f.subscribe())
    }

    /// The stop request received so far, if any.
    pub fn received(&self) -> Option<Stop> {
        *self.rx.borrow()
    }

    /// Waits for a stop request (at once if one already came).
    pub async fn recv(&mut self) -> Stop {
        loop {
            if let Some(s) = *self.rx.borrow_and_update() {
                return s;
            }
            if self.rx.changed().await.is_err() {
                // The watcher task is gone (runtime shutting down): nothing will come.
                std::future::pending::<()>().await;
            }
        }
    }
}

/// The first of `futs` to finish: (its output, its index, the rest), as
/// `futures::future::select_all`, without the dependency.
async fn futures_select_all<F: std::future::Future + Unpin>(
    futs: impl IntoIterator<Item = F>,
) -> (F::Output, usize, Vec<F>) {
    let mut futs: Vec<F> = futs.into_iter().collect();
    std::future::poll_fn(move |cx| {
        for i in 0..futs.len() {
            if let std::task::Poll::Ready(o) = std::pin::Pin::new(&mut futs[i]).poll(cx) {
                let rest = std::mem::take(&mut futs);
                return std::task::Poll::Ready((o, i, rest));
            }
        }
        std::task::Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_signal_that_came_between_waits_ends_the_next_wait() {
        let (tx, rx) = watch::channel(None);
        let mut s = Signals { rx, fwd: None };
        tx.send_replace(Some(Stop::Terminate));
        // Nobody was waiting when it came: the next wait still sees it, at once.
        let got = tokio::time::timeout(std::time::Duration::from_secs(1), s.recv()).await;
        assert_eq!(got.ok(), Some(Stop::Terminate));
        assert_eq!(s.received(), Some(Stop::Terminate));
        assert_eq!(Stop::Terminate.exit_code(), 143);
        assert_eq!(Stop::Interrupt.exit_code(), 130);
        assert_eq!(Stop::Other(libc::SIGHUP).exit_code(), 129);
        assert_eq!(Stop::Other(libc::SIGHUP).name(), "SIGHUP");
    }

    #[test]
    fn signals_to_handle_parse_like_torchrun() {
        let v = parse_stops(DEFAULT_STOPS).expect("default");
        assert_eq!(v, [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT]);
        let v = parse_stops("SIGUSR1, hup").expect("names");
        assert_eq!(v, [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1, libc::SIGHUP]);
        assert!(parse_stops("SIGKILL").is_err());
    }

    #[tokio::test]
    async fn no_signal_no_wakeup() {
        let mut s = Signals::none();
        let got = tokio::time::timeout(std::time::Duration::from_millis(50), s.recv()).await;
        assert!(got.is_err(), "recv must pend without a signal");
    }
}
