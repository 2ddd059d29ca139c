//! How a rank's output reaches meshd's console, through the real binary on loopback (one
//! node, no lab): progress bars that update with `\r` show as they update, and a line with
//! no end is forwarded in pieces without meshd holding it.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

fn meshd(port: u16, opts: &[&str], script: &str) -> Child {
    let peer = format!("127.0.0.1:{port}");
    Command::new(env!("CARGO_BIN_EXE_meshd"))
        .args(["run", "--nnodes", "1", "--peers", &peer])
        .args(["--port", &port.to_string()])
        .args(opts)
        .args(["--", "sh", "-c", script])
        .env("MESHD_TOKEN", "output-test")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn meshd")
}

/// What one read of meshd's stdout returned, and when.
type Chunks = Arc<Mutex<Vec<(Instant, Vec<u8>)>>>;

/// Reads `src` to its end in a thread, recording every read with its time.
fn record(mut src: impl Read + Send + 'static) -> (Chunks, JoinHandle<()>) {
    let chunks: Chunks = Arc::default();
    let c = chunks.clone();
    let t = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match src.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => c.lock().expect("lock").push((Instant::now(), buf[..n].to_vec())),
            }
        }
    });
    (chunks, t)
}

fn drain(mut src: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = src.read_to_string(&mut s);
        s
    })
}

/// Waits for meshd to end (killing it after `limit`); its exit status success.
fn finish(mut child: Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait().map(|s| s.success()).unwrap_or(false)
}

/// When the bytes read so far first contained `needle`.
fn arrival(chunks: &[(Instant, Vec<u8>)], needle: &str) -> Option<Instant> {
    let mut seen = Vec::new();
    for (t, c) in chunks {
        seen.extend_from_slice(c);
        if String::from_utf8_lossy(&seen).contains(needle) {
            return Some(*t);
        }
    }
    None
}

#[test]
fn progress_bar_updates_reach_the_console_as_the_rank_writes_them() {
    let logs = std::env::temp_dir().join(format!("meshd-output-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&logs);
    let mut child = meshd(
        29750,
        &["--nproc-per-node", "1", "--log-dir", &logs.display().to_string()],
        r#"for i in 1 2 3 4 5; do printf "step $i\r"; sleep 0.4; done; echo; echo done"#,
    );
    let (chunks, reader) = record(child.stdout.take().expect("stdout"));
    let stderr = drain(child.stderr.take().expect("stderr"));
    let ok = finish(child, Duration::from_secs(60));
    let _ = reader.join();
    let stderr = stderr.join().unwrap_or_default();
    let chunks = chunks.lock().expect("lock").clone();
    let all: Vec<u8> = chunks.iter().flat_map(|(_, c)| c.iter().copied()).collect();
    let all = String::from_utf8_lossy(&all);
    assert!(ok, "meshd failed:\n{all}\n{stderr}");
    // The rank writes step 1 and step 5 1.6 s apart: the first must not wait for the last
    // (before, nothing showed until the line's `\n`, all at once).
    let first = arrival(&chunks, "step 1").expect("step 1");
    let last = arrival(&chunks, "step 5").expect("step 5");
    eprintln!("step 1 came {:?} before step 5", last.duration_since(first));
    assert!(
        last.duration_since(first) >= Duration::from_millis(800),
        "step 1 came only {:?} before step 5:\n{all:?}",
        last.duration_since(first)
    );
    // The prefix follows each `\r`, so a terminal shows it with every update.
    assert!(
        all.contains(
            "[rank 0] step 1\r[rank 0] step 2\r[rank 0] step 3\r[rank 0] step 4\r[rank 0] step 5\r\n[rank 0] done\n"
        ),
        "{all:?}"
    );
    // The log file gets what the rank wrote, as it wrote it.
    let file = std::fs::read(logs.join("attempt_0/rank0.out")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&logs);
    assert_eq!(String::from_utf8_lossy(&file), "step 1\rstep 2\rstep 3\rstep 4\rstep 5\r\ndone\n");
}

fn vm_rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

#[test]
fn a_line_with_no_end_is_forwarded_in_pieces_without_meshd_holding_it() {
    const SIZE: usize = 20_000_000;
    const PREFIX: &str = "[rank 0] ";
    let mut child = meshd(
        29751,
        &["--nproc-per-node", "1"],
        &format!(r"echo ready; sleep 1; head -c {SIZE} /dev/zero | tr '\0' a; sleep 0.5; echo; echo done"),
    );
    let pid = child.id();
    let (chunks, reader) = record(child.stdout.take().expect("stdout"));
    let stderr = drain(child.stderr.take().expect("stderr"));
    // meshd's memory from the rank's first line (before the long one) to its end.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut base = None;
    let mut peak = 0;
    while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        let started = chunks.lock().expect("lock").iter().any(|(_, c)| c.windows(5).any(|w| w == b"ready"));
        if let (true, Some(rss)) = (started, vm_rss_kib(pid)) {
            base.get_or_insert(rss);
            peak = peak.max(rss);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let ok = finish(child, Duration::from_secs(1));
    let _ = reader.join();
    let stderr = stderr.join().unwrap_or_default();
    let all: Vec<u8> = chunks.lock().expect("lock").iter().flat_map(|(_, c)| c.iter().copied()).collect();
    assert!(ok, "meshd failed:\n{stderr}");
    let base = base.expect("meshd's RSS while the rank ran");
    eprintln!("meshd VmRSS: {base} KiB before the long line, at most {peak} KiB");
    // Holding the line would take at least its 20 MB (before, read_until's buffer and its
    // prefixed copy took twice that).
    assert!(peak - base < 12 * 1024, "meshd's RSS grew from {base} KiB to {peak} KiB");
    let lines: Vec<&[u8]> = all.split(|&b| b == b'\n').filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.first().copied(), Some(b"[rank 0] ready".as_slice()));
    assert_eq!(lines.last().copied(), Some(b"[rank 0] done".as_slice()));
    let pieces = &lines[1..lines.len() - 1];
    let mut total = 0;
    for p in pieces {
        let body = p.strip_prefix(PREFIX.as_bytes()).expect("every piece has the prefix");
        assert!(body.len() <= 64 * 1024, "a piece of {} bytes", body.len());
        assert!(body.iter().all(|&b| b == b'a'));
        total += body.len();
    }
    assert_eq!(total, SIZE);
    assert!(pieces.len() >= SIZE / (64 * 1024), "{} pieces", pieces.len());
}

#[test]
fn a_line_left_open_by_one_rank_is_not_written_into_by_another() {
    // Rank 0 leaves "Loading" open for 0.8 s (forwarded after 0.1 s); rank 1 writes a
    // line meanwhile.
    let mut child = meshd(
        29752,
        &["--nproc-per-node", "2"],
        r#"if [ "$RANK" = 0 ]; then printf Loading; sleep 0.8; echo " done"; else sleep 0.4; echo hi; fi"#,
    );
    let (chunks, reader) = record(child.stdout.take().expect("stdout"));
    let stderr = drain(child.stderr.take().expect("stderr"));
    let ok = finish(child, Duration::from_secs(60));
    let _ = reader.join();
    let stderr = stderr.join().unwrap_or_default();
    let all: Vec<u8> = chunks.lock().expect("lock").iter().flat_map(|(_, c)| c.iter().copied()).collect();
    let all = String::from_utf8_lossy(&all).into_owned();
    assert!(ok, "meshd failed:\n{all}\n{stderr}");
    assert!(all.lines().all(|l| l.starts_with("[rank ")), "{all:?}");
    assert!(all.lines().any(|l| l == "[rank 1] hi"), "{all:?}");
    let rank0: String = all.lines().filter_map(|l| l.strip_prefix("[rank 0] ")).collect();
    assert_eq!(rank0, "Loading done", "{all:?}");
}
