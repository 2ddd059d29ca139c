use super::*;

const P: &str = "[r] ";

fn s(b: Vec<u8>) -> String {
    String::from_utf8(b).expect("utf-8")
}

#[test]
fn complete_lines_are_prefixed_and_kept_whole() {
    let t = Instant::now();
    let mut sp = LineSplitter::new(P);
    assert_eq!(s(sp.feed(b"a\nb\n", t)), "[r] a\n[r] b\n");
    assert_eq!(s(sp.feed(b"hel", t)), "");
    assert_eq!(sp.held(), 3);
    assert_eq!(s(sp.feed(b"lo\nwor", t)), "[r] hello\n");
    assert_eq!(s(sp.feed(b"ld\n", t)), "[r] world\n");
    assert_eq!(s(sp.feed(b"\nx\r\n", t)), "[r] \n[r] x\r\n");
    assert_eq!(s(sp.finish()), "");
}

#[test]
fn a_line_ending_in_cr_goes_out_at_once_with_the_prefix_after_each_cr() {
    let t = Instant::now();
    let mut sp = LineSplitter::new(P);
    assert_eq!(s(sp.feed(b"step 1\r", t)), "[r] step 1\r");
    assert_eq!(s(sp.feed(b"step 2\r", t)), "[r] step 2\r");
    assert_eq!(s(sp.feed(b"step 3\rstep 4\r", t)), "[r] step 3\r[r] step 4\r");
    assert_eq!(sp.deadline(), None);
    assert_eq!(s(sp.feed(b"\n", t)), "\n");
    assert_eq!(s(sp.feed(b"next\n", t)), "[r] next\n");
}

#[test]
fn a_partial_line_waits_then_goes_out_and_continues_without_a_second_prefix() {
    let t = Instant::now();
    let mut sp = LineSplitter::new(P);
    assert_eq!(s(sp.feed(b"Loading", t)), "");
    assert_eq!(sp.deadline(), Some(t + PARTIAL_WAIT));
    assert_eq!(s(sp.feed(b"...", t + Duration::from_millis(60))), "");
    assert_eq!(s(sp.tick(t + Duration::from_millis(99))), "");
    assert_eq!(s(sp.tick(t + PARTIAL_WAIT)), "[r] Loading...");
    assert_eq!(sp.deadline(), None);
    assert_eq!(s(sp.feed(b" done\n", t + Duration::from_secs(1))), " done\n");
    assert_eq!(s(sp.feed(b"half", t + Duration::from_secs(2))), "");
    assert_eq!(s(sp.finish()), "[r] half\n");
}

#[test]
fn a_line_that_trickles_in_goes_out_on_time() {
    let t = Instant::now();
    let ms = |n| t + Duration::from_millis(n);
    let mut sp = LineSplitter::new(P);
    assert_eq!(s(sp.feed(b"working", t)), "");
    assert_eq!(s(sp.feed(b".", ms(50))), "");
    assert_eq!(s(sp.feed(b".", ms(100))), "[r] working..");
    assert_eq!(s(sp.feed(b".", ms(150))), "");
    assert_eq!(s(sp.feed(b".", ms(200))), "");
    assert_eq!(s(sp.feed(b".", ms(250))), "...");
    assert_eq!(s(sp.feed(b" ok\n", ms(300))), " ok\n");
}

#[test]
fn tqdm_style_updates_keep_their_leading_cr_with_their_text() {
    let t = Instant::now();
    let ms = |n| t + Duration::from_millis(n);
    let mut sp = LineSplitter::new(P);
    assert_eq!(s(sp.feed(b"\r 10%|#", t)), "");
    assert_eq!(s(sp.tick(ms(100))), "\r[r]  10%|#");
    // The next update pushes the one before it out; the newest waits its time.
    assert_eq!(s(sp.feed(b"\r 20%|##", ms(150))), "");
    assert_eq!(s(sp.feed(b"\r 30%|###", ms(180))), "\r[r]  20%|##");
    assert_eq!(sp.deadline(), Some(ms(280)));
    assert_eq!(s(sp.tick(ms(280))), "\r[r]  30%|###");
    assert_eq!(s(sp.feed(b"\r100%|####\n", ms(300))), "\r[r] 100%|####\n");
}

#[test]
fn the_stream_end_ends_the_console_line() {
    let t = Instant::now();
    let mut sp = LineSplitter::new(P);
    assert_eq!(s(sp.finish()), "");
    assert_eq!(s(sp.feed(b"step 5\r", t)), "[r] step 5\r");
    assert_eq!(s(sp.finish()), "\n");
}

#[test]
fn long_lines_go_out_in_pieces_each_with_the_prefix() {
    let t = Instant::now();
    let mut sp = LineSplitter::with_limits(P, 8, PARTIAL_WAIT);
    // A complete line longer than the limit.
    assert_eq!(s(sp.feed(b"abcdefghij\n", t)), "[r] abcdefgh\n[r] ij\n");
    // A line with no end: pieces go out, at most the limit is held.
    assert_eq!(s(sp.feed(b"0123456789abcdefghij", t)), "[r] 01234567\n[r] 89abcdef\n");
    assert_eq!(sp.held(), 4);
    assert_eq!(s(sp.feed(b"klmn", t)), "");
    assert_eq!(s(sp.feed(b"o", t)), "[r] ghijklmn\n");
    assert_eq!(s(sp.feed(b"\n", t)), "[r] o\n");
    // A line exactly as long as the limit is not split.
    assert_eq!(s(sp.feed(b"abcdefgh\n", t)), "[r] abcdefgh\n");
    // A partial line forwarded by the timer counts toward its line's length.
    assert_eq!(s(sp.feed(b"abcde", t)), "");
    assert_eq!(s(sp.tick(t + PARTIAL_WAIT)), "[r] abcde");
    assert_eq!(s(sp.feed(b"fghijk\n", t + PARTIAL_WAIT)), "fgh\n[r] ijk\n");
}

#[test]
fn pieces_do_not_split_a_utf8_character() {
    let t = Instant::now();
    let mut sp = LineSplitter::with_limits(P, 4, PARTIAL_WAIT);
    assert_eq!(s(sp.feed("aaaé€b\n".as_bytes(), t)), "[r] aaa\n[r] é\n[r] €b\n");
}

fn piece(rank: u32, starts_in_text: bool, ends_open: bool, b: &str) -> Piece {
    Piece { rank, starts_in_text, ends_open, bytes: b.as_bytes().to_vec() }
}

#[test]
fn another_rank_does_not_write_into_an_open_line() {
    let mut st = Stream::default();
    let f = |st: &mut Stream, p: Piece| String::from_utf8(st.frame(&p)).expect("utf-8");
    // A partial line, then another rank's line: the partial one is ended first and its
    // rest gets the prefix again.
    assert_eq!(f(&mut st, piece(0, false, true, "[rank 0] Loading")), "[rank 0] Loading");
    assert_eq!(f(&mut st, piece(1, false, false, "[rank 1] hi\n")), "\n[rank 1] hi\n");
    assert_eq!(f(&mut st, piece(0, true, false, "... done\n")), "[rank 0] ... done\n");
    // The same rank goes on in its own line.
    assert_eq!(f(&mut st, piece(0, false, true, "[rank 0] a")), "[rank 0] a");
    assert_eq!(f(&mut st, piece(0, true, false, "b\n")), "b\n");
    // A progress bar left at `\r`: kept on its line; its closing `\n` is not an empty line.
    assert_eq!(f(&mut st, piece(0, false, true, "[rank 0] step 1\r")), "[rank 0] step 1\r");
    assert_eq!(f(&mut st, piece(1, false, true, "[rank 1] x\n[rank 1] y")), "\n[rank 1] x\n[rank 1] y");
    assert_eq!(f(&mut st, piece(0, false, true, "[rank 0] step 2\r")), "\n[rank 0] step 2\r");
    assert_eq!(f(&mut st, piece(1, true, false, "z\n")), "\n[rank 1] z\n");
    assert_eq!(f(&mut st, piece(0, false, true, "\r[rank 0] step 3")), "\r[rank 0] step 3");
    // A `\r` that goes on after its line was ended brings its own prefix.
    assert_eq!(f(&mut st, piece(1, false, true, "[rank 1] w")), "\n[rank 1] w");
    assert_eq!(f(&mut st, piece(0, true, true, "\r[rank 0] step 4")), "\n\r[rank 0] step 4");
    assert_eq!(f(&mut st, piece(1, true, false, "!\n")), "\n[rank 1] !\n");
    assert_eq!(f(&mut st, piece(0, false, false, "\n")), "");
    assert_eq!(f(&mut st, piece(1, false, false, "[rank 1] end\n")), "[rank 1] end\n");
}

#[test]
fn the_tail_keeps_the_last_lines_bounded() {
    let mut t = Tail::default();
    for i in 0..30 {
        t.feed(format!("line {i}\n").as_bytes());
    }
    t.feed(b"progress 1\rprogress 2");
    let l = t.lines();
    assert_eq!(l.len(), TAIL_LINES);
    assert_eq!(l[0], "line 11");
    assert_eq!(l[TAIL_LINES - 2], "line 29");
    assert_eq!(l[TAIL_LINES - 1], "progress 2");
    let mut t = Tail::default();
    t.feed(&vec![b'x'; 10 * TAIL_LINE]);
    t.feed(b"\n");
    assert_eq!(t.lines()[0].len(), TAIL_LINE);
}

#[test]
fn a_huge_line_is_held_at_most_max_line_at_a_time() {
    let t = Instant::now();
    let mut sp = LineSplitter::new(P);
    let chunk = vec![b'a'; READ_CHUNK];
    let mut out = Vec::new();
    for _ in 0..64 {
        out.extend(sp.feed(&chunk, t));
        assert!(sp.held() <= MAX_LINE, "held {}", sp.held());
    }
    out.extend(sp.feed(b"\n", t));
    let lines: Vec<&[u8]> = out.split(|&b| b == b'\n').filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), 64 * READ_CHUNK / MAX_LINE);
    for l in &lines {
        assert!(l.starts_with(P.as_bytes()));
        assert!(l.len() <= P.len() + MAX_LINE);
    }
    let payload: usize = lines.iter().map(|l| l.len() - P.len()).sum();
    assert_eq!(payload, 64 * READ_CHUNK);
}
