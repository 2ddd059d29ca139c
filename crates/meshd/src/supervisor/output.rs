//! A rank's stdout and stderr on meshd's console and in its `--log-dir` files.
//!
//! [`LineSplitter`] turns the bytes a rank writes into what the console gets: every line
//! prefixed with `[rank N] `, complete lines kept whole, a progress bar's `\r` updates
//! forwarded as they come (the prefix after each `\r`, where a terminal keeps it), a
//! partial line forwarded once it has waited [`PARTIAL_WAIT`], and lines longer than
//! [`MAX_LINE`] split into pieces, each with the prefix, so meshd never holds more than
//! about one such piece per stream.
//!
//! Every write to the console and the log files is done by one writer thread fed by a
//! bounded channel: a stalled terminal or disk delays output (and, once the channel is
//! full, the ranks writing it), never meshd's runtime, its heartbeats or its teardown.
//! Each console piece is one write, and the thread keeps the ranks' lines apart
//! ([`Stream`]): a line one rank left open is ended before another rank's output.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{mpsc, oneshot};

/// Longest console line (bytes after the prefix); longer ones go out in pieces.
pub const MAX_LINE: usize = 64 * 1024;
/// How long a partial line (no `\n`, not ending in `\r`) waits for its end before the part
/// that came is forwarded.
pub const PARTIAL_WAIT: Duration = Duration::from_millis(100);
/// Bytes read from a rank's pipe at a time.
const READ_CHUNK: usize = 64 * 1024;
/// Writes queued for the writer thread before the ranks' pumps wait.
const QUEUE: usize = 32;

/// Where the console cursor of one rank's stream stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Col {
    /// At the start of a fresh line (nothing written, or after `\n`): text and `\n` need
    /// the prefix first.
    LineStart,
    /// After a `\r`: text needs the prefix first, a `\n` does not (`\r\n`).
    AfterCr,
    /// Inside a line that has its prefix.
    Mid,
}

/// Splits one rank stream's bytes into prefixed console output; pure (the caller supplies
/// the time), so it is tested without processes.
///
/// Every call returns the bytes to write to the console now, to be written in one write so
/// another rank's output cannot land inside them (empty: nothing to write).
#[derive(Debug)]
pub struct LineSplitter {
    prefix: Vec<u8>,
    max_line: usize,
    wait: Duration,
    /// Bytes held back: the current line's text since its last `\n` (or from its last
    /// `\r` on), at most `max_line` of it after every call.
    pending: Vec<u8>,
    /// When the oldest held byte came.
    since: Option<Instant>,
    col: Col,
    /// Bytes of the current console line after its prefix.
    len: usize,
}

impl LineSplitter {
    /// A splitter with [`MAX_LINE`] and [`PARTIAL_WAIT`].
    pub fn new(prefix: impl Into<Vec<u8>>) -> LineSplitter {
        LineSplitter::with_limits(prefix, MAX_LINE, PARTIAL_WAIT)
    }

    /// A splitter with the given longest line (at least 1) and partial-line wait.
    pub fn with_limits(prefix: impl Into<Vec<u8>>, max_line: usize, wait: Duration) -> LineSplitter {
        LineSplitter {
            prefix: prefix.into(),
            max_line: max_line.max(1),
            wait,
            pending: Vec::new(),
            since: None,
            col: Col::LineStart,
            len: 0,
        }
    }

    /// Whether the console line is open: the last output did not end in `\n`.
    pub fn line_open(&self) -> bool {
        self.col != Col::LineStart
    }

    /// Whether the next output continues the console line's text (starts without prefix).
    pub fn in_text(&self) -> bool {
        self.col == Col::Mid
    }

    /// Bytes held back, waiting for their line's end or for [`LineSplitter::deadline`].
    pub fn held(&self) -> usize {
        self.pending.len()
    }

    /// When [`LineSplitter::tick`] forwards the held partial line (None: nothing held).
    pub fn deadline(&self) -> Option<Instant> {
        if self.pending.is_empty() { None } else { self.since.map(|s| s + self.wait) }
    }

    /// Takes bytes the rank wrote at `now`. Forwards every complete line, everything if the
    /// bytes end in `\r` or `\n`, of a line with no end in sight pieces of `max_line`, and
    /// what has waited its time; holds the rest of the current line (from its last `\r` on).
    pub fn feed(&mut self, data: &[u8], now: Instant) -> Vec<u8> {
        let mut out = Vec::new();
        if data.is_empty() {
            return out;
        }
        if self.pending.is_empty() {
            self.since = Some(now);
        }
        self.pending.extend_from_slice(data);
        let cut = match self.pending.last() {
            Some(b'\n' | b'\r') => self.pending.len(),
            _ => match self.pending.iter().rposition(|&b| b == b'\n' || b == b'\r') {
                Some(i) if self.pending[i] == b'\n' => i + 1,
                // Keep a progress bar's `\rtext` together: forward what came before it.
                Some(i) => i,
                None => 0,
            },
        };
        if cut > 0 {
            let rest = self.pending.split_off(cut);
            let done = std::mem::replace(&mut self.pending, rest);
            self.render(&done, &mut out);
            // The held rest came after that line end, in this call.
            self.since = Some(now);
        }
        // A line with no end in sight: forward it in pieces, each ending its console line.
        // What is held from here on has no line end but perhaps a leading `\r`.
        while self.pending.len() > self.max_line {
            let k = utf8_cut(&self.pending, self.max_line).unwrap_or(self.max_line);
            let rest = self.pending.split_off(k);
            let piece = std::mem::replace(&mut self.pending, rest);
            self.render(&piece, &mut out);
            if self.col == Col::Mid {
                self.break_line(&mut out);
            }
            self.since = Some(now);
        }
        // A line that trickles in (a dot a second) goes out on time too.
        out.extend(self.tick(now));
        out
    }

    /// Forwards the held partial line if it has waited its time by `now`; it continues,
    /// without a new prefix, when the rest of its line comes.
    pub fn tick(&mut self, now: Instant) -> Vec<u8> {
        let mut out = Vec::new();
        if self.deadline().is_some_and(|d| now >= d) {
            let held = std::mem::take(&mut self.pending);
            self.render(&held, &mut out);
            self.since = None;
        }
        out
    }

    /// The stream ended: forwards what is held and ends an unfinished console line.
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.pending);
        self.render(&held, &mut out);
        self.since = None;
        if self.col != Col::LineStart {
            self.break_line(&mut out);
        }
        out
    }

    fn render(&mut self, mut seg: &[u8], out: &mut Vec<u8>) {
        out.reserve(seg.len() + self.prefix.len());
        while !seg.is_empty() {
            let i = seg.iter().position(|&b| b == b'\n' || b == b'\r').unwrap_or(seg.len());
            let (text, tail) = seg.split_at(i);
            self.text(text, out);
            match tail.first() {
                Some(b'\n') => {
                    if self.col == Col::LineStart {
                        out.extend_from_slice(&self.prefix);
                    }
                    out.push(b'\n');
                    self.col = Col::LineStart;
                    self.len = 0;
                }
                Some(_) => {
                    out.push(b'\r');
                    self.col = Col::AfterCr;
                    self.len = 0;
                }
                None => {}
            }
            seg = tail.get(1..).unwrap_or_default();
        }
    }

    /// Text without line ends; the prefix first where a line starts, a line end where the
    /// line is full.
    fn text(&mut self, mut t: &[u8], out: &mut Vec<u8>) {
        while !t.is_empty() {
            if self.col == Col::Mid && self.len >= self.max_line {
                self.break_line(out);
            }
            if self.col != Col::Mid {
                out.extend_from_slice(&self.prefix);
                self.col = Col::Mid;
            }
            let room = self.max_line - self.len;
            let k = if t.len() <= room {
                t.len()
            } else {
                match utf8_cut(t, room) {
                    Some(k) => k,
                    // The character does not fit on this line: it starts the next one.
                    None if self.len > 0 => {
                        self.break_line(out);
                        continue;
                    }
                    None => room,
                }
            };
            out.extend_from_slice(&t[..k]);
            self.len += k;
            t = &t[k..];
        }
    }

    fn break_line(&mut self, out: &mut Vec<u8>) {
        out.push(b'\n');
        self.col = Col::LineStart;
        self.len = 0;
    }
}

/// Where to cut `t` (longer than `at`) at or up to 3 bytes before `at`, but not before 1,
/// without splitting a UTF-8 character (None: no character starts there).
fn utf8_cut(t: &[u8], at: usize) -> Option<usize> {
    (at.saturating_sub(3).max(1)..=at).rev().find(|&k| t[k] & 0xC0 != 0x80)
}

/// The prefix of a rank's console lines.
fn prefix(rank: u32) -> String {
    format!("[rank {rank}] ")
}

/// What one splitter call gives the console, with where it leaves the rank's line.
#[derive(Debug)]
struct Piece {
    rank: u32,
    /// The bytes continue a line the rank left open (no prefix of their own).
    starts_in_text: bool,
    /// The bytes leave the rank's line open (no `\n` at their end).
    ends_open: bool,
    bytes: Vec<u8>,
}

/// One console stream (stdout or stderr) shared by the node's ranks: keeps their lines
/// apart when one rank's line is left open (a partial line, a progress bar's `\r`) and
/// another rank writes. The open line is ended first; when its rank goes on, the rest of
/// the line gets the prefix again (a `\r` brings its own, and a `\n` that would only end
/// the line is dropped).
#[derive(Debug, Default)]
struct Stream {
    /// The rank whose line is open on the console.
    open: Option<u32>,
    /// Ranks whose open line another rank's output ended.
    broken: Vec<u32>,
}

impl Stream {
    /// The bytes to write for `p`, in one write.
    fn frame(&mut self, p: &Piece) -> Vec<u8> {
        let mut out = Vec::with_capacity(p.bytes.len() + 24);
        if let Some(o) = self.open.filter(|&o| o != p.rank) {
            out.push(b'\n');
            self.broken.push(o);
        }
        let mut body = p.bytes.as_slice();
        if let Some(i) = self.broken.iter().position(|&r| r == p.rank) {
            self.broken.swap_remove(i);
            if let Some(rest) = body.strip_prefix(b"\n") {
                body = rest;
            } else if p.starts_in_text && !body.starts_with(b"\r") {
                out.extend_from_slice(prefix(p.rank).as_bytes());
            }
        }
        out.extend_from_slice(body);
        self.open = p.ends_open.then_some(p.rank);
        out
    }
}

#[derive(Debug)]
enum Msg {
    /// For meshd's stderr (true) or stdout.
    Console(bool, Piece),
    File(Arc<File>, Vec<u8>),
    /// Answered once every write queued before it is done.
    Sync(oneshot::Sender<()>),
}

/// The writer thread's queue, started on first use (None: no thread could be started; the
/// pumps write themselves then).
fn writer() -> Option<&'static mpsc::Sender<Msg>> {
    static WRITER: OnceLock<Option<mpsc::Sender<Msg>>> = OnceLock::new();
    WRITER
        .get_or_init(|| {
            let (tx, mut rx) = mpsc::channel::<Msg>(QUEUE);
            let spawned = std::thread::Builder::new().name("meshd-output".into()).spawn(move || {
                let mut con = Console::new();
                while let Some(m) = rx.blocking_recv() {
                    con.handle(m);
                }
            });
            match spawned {
                Ok(_) => Some(tx),
                Err(e) => {
                    tracing::warn!("cannot start the output thread ({e}): ranks' output is written inline");
                    None
                }
            }
        })
        .as_ref()
}

/// meshd's stdout and stderr as unbuffered files (duplicates of descriptors 1 and 2), so a
/// piece is one write(2) whatever it holds (std's stdout buffers up to a line end).
#[derive(Debug)]
struct Console {
    out: Option<File>,
    err: Option<File>,
    streams: [Stream; 2],
}

impl Console {
    fn new() -> Console {
        use std::os::fd::AsFd;
        let dup = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned().ok().map(File::from);
        Console {
            out: dup(std::io::stdout().as_fd()),
            err: dup(std::io::stderr().as_fd()),
            streams: Default::default(),
        }
    }

    /// Errors (a closed console, a full disk) lose output, never the job.
    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Console(is_err, p) => {
                let b = self.streams[usize::from(is_err)].frame(&p);
                if b.is_empty() {
                    return;
                }
                let _ = match (is_err, &mut self.out, &mut self.err) {
                    (false, Some(f), _) | (true, _, Some(f)) => f.write_all(&b),
                    (false, None, _) => write_std(&mut std::io::stdout().lock(), &b),
                    (true, _, None) => write_std(&mut std::io::stderr().lock(), &b),
                };
            }
            Msg::File(f, b) => {
                let _ = (&*f).write_all(&b);
            }
            Msg::Sync(done) => {
                let _ = done.send(());
            }
        }
    }
}

fn write_std(w: &mut impl Write, b: &[u8]) -> std::io::Result<()> {
    w.write_all(b)?;
    w.flush()
}

async fn send(m: Msg) {
    match writer() {
        Some(tx) => {
            let _ = tx.send(m).await;
        }
        // Without the thread the ranks' lines are not kept apart (no shared state).
        None => Console::new().handle(m),
    }
}

/// The last lines a rank wrote to stderr, for the root cause of a failure when the rank
/// wrote no error file: at most [`TAIL_LINES`] lines of at most [`TAIL_LINE`] bytes each.
#[derive(Debug, Default)]
pub struct Tail {
    lines: std::collections::VecDeque<Vec<u8>>,
    /// The current, unfinished line.
    open: Vec<u8>,
}

/// Lines a [`Tail`] keeps.
pub const TAIL_LINES: usize = 20;
/// Bytes of one line a [`Tail`] keeps (the rest of a longer line is dropped).
pub const TAIL_LINE: usize = 512;

impl Tail {
    /// Takes bytes the rank wrote (`\r` starts the line over, as a terminal shows it).
    pub fn feed(&mut self, data: &[u8]) {
        for &b in data {
            match b {
                b'\n' => {
                    let l = std::mem::take(&mut self.open);
                    if self.lines.len() == TAIL_LINES {
                        self.lines.pop_front();
                    }
                    self.lines.push_back(l);
                }
                b'\r' => self.open.clear(),
                _ if self.open.len() < TAIL_LINE => self.open.push(b),
                _ => {}
            }
        }
    }

    /// The kept lines, oldest first, with the unfinished one last.
    pub fn lines(&self) -> Vec<String> {
        let mut v: Vec<String> = self.lines.iter().map(|l| String::from_utf8_lossy(l).into_owned()).collect();
        if !self.open.is_empty() {
            v.push(String::from_utf8_lossy(&self.open).into_owned());
        }
        let skip = v.len().saturating_sub(TAIL_LINES);
        v.split_off(skip)
    }
}

/// When any rank of the node last wrote output (milliseconds since meshd started), for
/// `--stall-timeout`.
#[derive(Debug, Default)]
pub struct Activity(std::sync::atomic::AtomicU64);

fn epoch() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

impl Activity {
    /// Something happened now.
    pub fn touch(&self) {
        let ms = epoch().elapsed().as_millis() as u64;
        self.0.fetch_max(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// When something last happened.
    pub fn last(&self) -> Instant {
        epoch() + Duration::from_millis(self.0.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Where one rank stream goes.
#[derive(Debug, Clone)]
pub(super) struct Sink {
    /// To meshd's console, prefixed.
    pub console: bool,
    /// To this file, as it is (created, never appended to).
    pub file: Option<PathBuf>,
    /// Into this ring of last lines.
    pub tail: Option<Arc<std::sync::Mutex<Tail>>>,
    /// Marks the node's ranks as active.
    pub activity: Arc<Activity>,
}

/// Forwards one rank stream (stdout or stderr) to meshd's console, prefixed, and as it is
/// to the sink's file if given; returns once all of it has been written.
pub(super) async fn pump(mut src: impl AsyncRead + Unpin, rank: u32, is_err: bool, sink: Sink) {
    let file = sink
        .file
        .and_then(|p| std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(p).ok())
        .map(Arc::new);
    let mut split = LineSplitter::new(prefix(rank));
    let mut buf = vec![0u8; READ_CHUNK];
    // Whether the file's last byte is a line end (nothing written counts as one).
    let mut file_at_line_start = true;
    let mut done = false;
    while !done {
        let read = match split.deadline() {
            Some(d) => tokio::time::timeout_at(d.into(), src.read(&mut buf)).await.ok(),
            None => Some(src.read(&mut buf).await),
        };
        let starts_in_text = split.in_text();
        let bytes = match read {
            None => split.tick(Instant::now()),
            Some(Ok(0) | Err(_)) => {
                done = true;
                split.finish()
            }
            Some(Ok(n)) => {
                let data = &buf[..n];
                sink.activity.touch();
                if let Some(t) = &sink.tail {
                    t.lock().unwrap_or_else(|e| e.into_inner()).feed(data);
                }
                if let Some(f) = &file {
                    file_at_line_start = data.ends_with(b"\n");
                    send(Msg::File(f.clone(), data.to_vec())).await;
                }
                if sink.console { split.feed(data, Instant::now()) } else { Vec::new() }
            }
        };
        if !bytes.is_empty() && sink.console {
            let ends_open = split.line_open();
            send(Msg::Console(is_err, Piece { rank, starts_in_text, ends_open, bytes })).await;
        }
    }
    if let Some(f) = &file {
        if !file_at_line_start {
            send(Msg::File(f.clone(), b"\n".to_vec())).await;
        }
    }
    flush().await;
}

/// Returns once every write queued so far (console and files) is done.
pub async fn flush() {
    if let Some(tx) = writer() {
        let (done, written) = oneshot::channel();
        if tx.send(Msg::Sync(done)).await.is_ok() {
            let _ = written.await;
        }
    }
}

#[cfg(test)]
mod tests;
