//! SIGINT and SIGTERM, watched once for the whole process.
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
}

impl Stop {
    /// The exit status a shell gives a process ended by this signal.
    pub fn exit_code(self) -> u8 {
        match self {
            Stop::Interrupt => 130,
            Stop::Terminate => 143,
        }
    }

    /// The signal's name.
    pub fn name(self) -> &'static str {
        match self {
            Stop::Interrupt => "SIGINT",
            Stop::Terminate => "SIGTERM",
        }
    }

    /// What happened, in words: `interrupted (SIGINT)` or `stopped (SIGTERM)`.
    pub fn describe(self) -> &'static str {
        match self {
            Stop::Interrupt => "interrupted (SIGINT)",
            Stop::Terminate => "stopped (SIGTERM)",
        }
    }
}

/// The process's stop requests. Cheap to clone; every clone sees the same signals.
#[derive(Clone, Debug)]
pub struct Signals {
    rx: watch::Receiver<Option<Stop>>,
}

impl Signals {
    /// Installs the SIGINT and SIGTERM handlers (call once, inside the runtime).
    pub fn install() -> std::io::Result<Signals> {
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            loop {
                let stop = tokio::select! {
                    s = int.recv() => s.map(|_| Stop::Interrupt),
                    s = term.recv() => s.map(|_| Stop::Terminate),
                };
                let Some(stop) = stop else { return };
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
        Ok(Signals { rx })
    }

    /// Signals that never fire (library users who handle signals themselves, tests).
    pub fn none() -> Signals {
        let (tx, rx) = watch::channel(None);
        // Keep the sender alive forever so that `recv` pends instead of ending.
        std::mem::forget(tx);
        Signals { rx }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_signal_that_came_between_waits_ends_the_next_wait() {
        let (tx, rx) = watch::channel(None);
        let mut s = Signals { rx };
        tx.send_replace(Some(Stop::Terminate));
        // Nobody was waiting when it came: the next wait still sees it, at once.
        let got = tokio::time::timeout(std::time::Duration::from_secs(1), s.recv()).await;
        assert_eq!(got.ok(), Some(Stop::Terminate));
        assert_eq!(s.received(), Some(Stop::Terminate));
        assert_eq!(Stop::Terminate.exit_code(), 143);
        assert_eq!(Stop::Interrupt.exit_code(), 130);
    }

    #[tokio::test]
    async fn no_signal_no_wakeup() {
        let mut s = Signals::none();
        let got = tokio::time::timeout(std::time::Duration::from_millis(50), s.recv()).await;
        assert!(got.is_err(), "recv must pend without a signal");
    }
}
