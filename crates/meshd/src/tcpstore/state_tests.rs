use super::*;

const A: ConnId = 1;
const B: ConnId = 2;
const C: ConnId = 3;
const CUR: Dialect = Dialect::Current;

fn k(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

fn st() -> State {
    State::new(StoreLimits::default())
}

fn ok(s: &mut State, conn: ConnId, req: Request) -> Outcome {
    s.handle(conn, CUR, req).expect("request refused")
}

fn reply(s: &mut State, conn: ConnId, req: Request) -> Option<Reply> {
    ok(s, conn, req).reply
}

#[test]
fn stoll_is_std_stoll() {
    assert_eq!(stoll(b"12"), Some(12));
    assert_eq!(stoll(b"  -3xyz"), Some(-3));
    assert_eq!(stoll(b"+4"), Some(4));
    assert_eq!(stoll(b"-9223372036854775808"), Some(i64::MIN));
    assert_eq!(stoll(b"9223372036854775807"), Some(i64::MAX));
    assert_eq!(stoll(b"9223372036854775808"), None);
    assert_eq!(stoll(b""), None);
    assert_eq!(stoll(b"abc"), None);
    assert_eq!(stoll(b"-"), None);
}

#[test]
fn set_get_add_delete_num_keys() {
    let mut s = st();
    assert_eq!(reply(&mut s, A, Request::Set { key: k("a"), value: k("1") }), None);
    assert_eq!(reply(&mut s, B, Request::Get { key: k("a") }), Some(Reply::Value(k("1"))));
    assert_eq!(reply(&mut s, B, Request::Add { key: k("a"), delta: 5 }), Some(Reply::Int(6)));
    assert_eq!(reply(&mut s, A, Request::Get { key: k("a") }), Some(Reply::Value(k("6"))));
    assert_eq!(reply(&mut s, A, Request::Add { key: k("n"), delta: -2 }), Some(Reply::Int(-2)));
    assert_eq!(reply(&mut s, A, Request::NumKeys), Some(Reply::Int(2)));
    assert_eq!(reply(&mut s, A, Request::DeleteKey { key: k("a") }), Some(Reply::Int(1)));
    assert_eq!(reply(&mut s, A, Request::DeleteKey { key: k("a") }), Some(Reply::Int(0)));
    assert_eq!(reply(&mut s, A, Request::NumKeys), Some(Reply::Int(1)));
    assert_eq!(s.bytes(), 3);
}

#[test]
fn get_of_a_missing_key_by_dialect() {
    let mut s = st();
    assert_eq!(reply(&mut s, A, Request::Get { key: k("x") }), Some(Reply::Value(vec![])));
    assert_eq!(s.handle(A, Dialect::Legacy, Request::Get { key: k("x") }), Err(Fault::MissingKey));
}

#[test]
fn add_on_text_and_overflow_refused() {
    let mut s = st();
    ok(&mut s, A, Request::Set { key: k("t"), value: k("hello") });
    assert_eq!(s.handle(A, CUR, Request::Add { key: k("t"), delta: 1 }), Err(Fault::NotAnInteger));
    ok(&mut s, A, Request::Set { key: k("m"), value: i64::MAX.to_string().into_bytes() });
    assert_eq!(s.handle(A, CUR, Request::Add { key: k("m"), delta: 1 }), Err(Fault::Overflow));
    assert_eq!(reply(&mut s, A, Request::Get { key: k("t") }), Some(Reply::Value(k("hello"))));
}

#[test]
fn compare_set_as_torch_answers() {
    let mut s = st();
    let cs = |e: &str, d: &str| Request::CompareSet { key: k("c"), expected: k(e), desired: k(d) };
    // Missing key, expected not empty: answers the expected value, sets nothing.
    assert_eq!(reply(&mut s, A, cs("x", "y")), Some(Reply::Value(k("x"))));
    assert_eq!(reply(&mut s, A, Request::NumKeys), Some(Reply::Int(0)));
    // Missing key, expected empty: sets.
    assert_eq!(reply(&mut s, A, cs("", "v1")), Some(Reply::Value(k("v1"))));
    // Mismatch: the current value, unchanged.
    assert_eq!(reply(&mut s, A, cs("nope", "v2")), Some(Reply::Value(k("v1"))));
    // Match: the new value.
    assert_eq!(reply(&mut s, A, cs("v1", "v2")), Some(Reply::Value(k("v2"))));
}

#[test]
fn wait_is_woken_when_all_its_keys_are_set() {
    let mut s = st();
    ok(&mut s, A, Request::Set { key: k("a"), value: k("1") });
    assert_eq!(reply(&mut s, B, Request::Wait { keys: vec![k("a")] }), Some(Reply::Byte(STOP_WAITING)));
    assert_eq!(reply(&mut s, B, Request::Wait { keys: vec![k("a"), k("b"), k("c")] }), None);
    assert_eq!(reply(&mut s, C, Request::Wait { keys: vec![k("b")] }), None);
    assert_eq!(s.waiting_connections(), 2);
    let out = ok(&mut s, A, Request::Set { key: k("b"), value: k("2") });
    assert_eq!(out.woken, vec![C]);
    let out = ok(&mut s, A, Request::Add { key: k("c"), delta: 1 });
    assert_eq!(out.woken, vec![B]);
    assert_eq!(s.waiting_connections(), 0);
    assert_eq!(s.registrations, 0);
    assert!(s.waiting.is_empty());
}

#[test]
fn every_setter_wakes() {
    for setter in [
        Request::Set { key: k("w"), value: k("1") },
        Request::Add { key: k("w"), delta: 1 },
        Request::Append { key: k("w"), value: k("1") },
        Request::MultiSet { pairs: vec![(k("z"), k("")), (k("w"), k("1"))] },
        Request::CompareSet { key: k("w"), expected: vec![], desired: k("1") },
    ] {
        let mut s = st();
        ok(&mut s, B, Request::Wait { keys: vec![k("w")] });
        assert_eq!(ok(&mut s, A, setter.clone()).woken, vec![B], "{setter:?}");
    }
    // The "lying" COMPARE_SET sets nothing and wakes nobody.
    let mut s = st();
    ok(&mut s, B, Request::Wait { keys: vec![k("w")] });
    let out = ok(&mut s, A, Request::CompareSet { key: k("w"), expected: k("x"), desired: k("1") });
    assert!(out.woken.is_empty());
}

#[test]
fn cancel_and_disconnect_forget_waits() {
    let mut s = st();
    ok(&mut s, B, Request::Wait { keys: vec![k("a")] });
    assert_eq!(reply(&mut s, B, Request::CancelWait), Some(Reply::Byte(WAIT_CANCELED)));
    ok(&mut s, C, Request::Wait { keys: vec![k("a"), k("a")] });
    s.drop_conn(C);
    assert!(ok(&mut s, A, Request::Set { key: k("a"), value: k("1") }).woken.is_empty());
    assert_eq!(s.registrations, 0);
    assert_eq!(s.waiting_connections(), 0);
}

#[test]
fn check_multi_get_append_list_keys() {
    let mut s = st();
    ok(&mut s, A, Request::MultiSet { pairs: vec![(k("b"), k("2")), (k("a"), k("1"))] });
    assert_eq!(reply(&mut s, A, Request::Check { keys: vec![k("a"), k("b")] }), Some(Reply::Byte(READY)));
    assert_eq!(reply(&mut s, A, Request::Check { keys: vec![k("a"), k("x")] }), Some(Reply::Byte(NOT_READY)));
    assert_eq!(
        reply(&mut s, A, Request::MultiGet { keys: vec![k("b"), k("x"), k("a")] }),
        Some(Reply::Values(vec![k("2"), vec![], k("1")]))
    );
    ok(&mut s, A, Request::Append { key: k("a"), value: k("23") });
    assert_eq!(reply(&mut s, A, Request::Get { key: k("a") }), Some(Reply::Value(k("123"))));
    assert_eq!(reply(&mut s, A, Request::ListKeys), Some(Reply::Keys(vec![k("a"), k("b")])));
}

#[test]
fn queues_push_pop_len_and_wake_one_popper() {
    let mut s = st();
    assert_eq!(reply(&mut s, A, Request::QueueLen { key: k("q") }), Some(Reply::Int(0)));
    assert_eq!(
        reply(&mut s, A, Request::QueuePop { key: k("q") }),
        Some(Reply::Popped { len_before: 0, value: None })
    );
    // Two blocked poppers (WAIT on the queue's name), one push: one wakes.
    ok(&mut s, B, Request::Wait { keys: vec![k("q")] });
    ok(&mut s, C, Request::Wait { keys: vec![k("q")] });
    assert_eq!(ok(&mut s, A, Request::QueuePush { key: k("q"), value: k("x") }).woken, vec![B]);
    assert_eq!(ok(&mut s, A, Request::QueuePush { key: k("q"), value: k("y") }).woken, vec![C]);
    assert_eq!(reply(&mut s, A, Request::QueueLen { key: k("q") }), Some(Reply::Int(2)));
    // A non-empty queue is ready for WAIT and CHECK; queues are not keys.
    assert_eq!(reply(&mut s, A, Request::Check { keys: vec![k("q")] }), Some(Reply::Byte(READY)));
    assert_eq!(reply(&mut s, A, Request::NumKeys), Some(Reply::Int(0)));
    assert_eq!(
        reply(&mut s, B, Request::QueuePop { key: k("q") }),
        Some(Reply::Popped { len_before: 2, value: Some(k("x")) })
    );
    assert_eq!(
        reply(&mut s, C, Request::QueuePop { key: k("q") }),
        Some(Reply::Popped { len_before: 1, value: Some(k("y")) })
    );
    assert_eq!(s.bytes(), 1);
}

#[test]
fn barrier_answers_when_world_size_arrived() {
    let mut s = st();
    let bar = || Request::Barrier { key: k("b"), world_size: 3 };
    assert_eq!(ok(&mut s, A, bar()), Outcome::default());
    assert_eq!(ok(&mut s, B, bar()), Outcome::default());
    let out = ok(&mut s, C, bar());
    assert_eq!(out.reply, Some(Reply::Byte(STOP_WAITING)));
    assert_eq!(out.woken, vec![A, B]);
    assert_eq!(reply(&mut s, A, Request::Get { key: k("b") }), Some(Reply::Value(k("3"))));
    assert_eq!(s.waiting_connections(), 0);
}

#[test]
fn limits_close_instead_of_growing() {
    let mut s = State::new(StoreLimits { max_keys: 2, max_bytes: 10, max_wait_registrations: 2 });
    ok(&mut s, A, Request::Set { key: k("a"), value: k("1234") });
    assert_eq!(s.handle(A, CUR, Request::Set { key: k("b"), value: k("123456") }), Err(Fault::StoreFull));
    ok(&mut s, A, Request::Set { key: k("b"), value: k("1") });
    assert_eq!(s.handle(A, CUR, Request::Set { key: k("c"), value: k("") }), Err(Fault::StoreFull));
    assert_eq!(s.handle(A, CUR, Request::Append { key: k("a"), value: k("1234") }), Err(Fault::StoreFull));
    assert_eq!(
        s.handle(B, CUR, Request::Wait { keys: vec![k("x"), k("y"), k("z")] }),
        Err(Fault::TooManyWaits)
    );
    // Overwriting frees what the old value held.
    ok(&mut s, A, Request::Set { key: k("a"), value: k("") });
    assert_eq!(s.bytes(), 3);
    s.clear();
    assert_eq!((s.num_keys(), s.bytes()), (0, 0));
}
