"""Every TCPStore op of this torch, as a client (is_master=False), against a store that
something else serves (meshd's tcpstore server in tests/tcpstore_torch.rs).

    python tcpstore_ops.py HOST PORT          the whole check; prints "OK <torch version>"
    python tcpstore_ops.py setter HOST PORT   (internal) sets keys late, for the blocking get
"""
import datetime
import subprocess
import sys
import time

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=30)
V2 = int(torch.__version__.split(".")[0]) >= 2


def connect(host, port, timeout=TIMEOUT):
    kw = {"wait_for_workers": False}
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, **kw)


def expect_raise(f, what):
    try:
        f()
    except Exception as e:  # DistStoreError (2.x) or RuntimeError (1.13)
        return e
    raise AssertionError(f"{what}: no error")


def setter(host, port):
    s = connect(host, port)
    s.wait(["go"])
    time.sleep(0.5)
    s.set("late", "arrived")
    if hasattr(s, "queue_push"):
        time.sleep(0.3)
        s.queue_push("jobs", b"job-1")
    if hasattr(s, "barrier"):
        s.barrier("bar", 2)


def main(host, port):
    s = connect(host, port)
    base = s.num_keys()

    # set / get
    s.set("k", "v")
    assert s.get("k") == b"v", s.get("k")
    s.set("k", b"\x00\xffbin")
    assert s.get("k") == b"\x00\xffbin"
    s.set("empty", "")
    assert s.get("empty") == b""
    big = bytes(range(256)) * 4096  # 1 MiB
    s.set("big", big)
    assert s.get("big") == big

    # add: counts from nothing, keeps decimal text
    assert s.add("n", 5) == 5
    assert s.add("n", -7) == -2
    assert s.get("n") == b"-2"

    # compare_set, as torch's server answers it
    assert s.compare_set("cs", "", "first") == b"first"
    assert s.compare_set("cs", "wrong", "second") == b"first"
    assert s.compare_set("cs", "first", "second") == b"second"
    assert s.compare_set("cs-missing", "x", "y") == b"x"  # missing key: the expected value

    # num_keys counts the whole store (k, empty, big, n, cs)
    assert s.num_keys() == base + 5, (s.num_keys(), base)

    # delete_key
    assert s.delete_key("empty") is True
    assert s.delete_key("empty") is False
    assert s.num_keys() == base + 4

    # wait: present keys return, a missing one times out with an error
    s.wait(["k", "n"])
    s.wait(["k"], datetime.timedelta(seconds=5))
    t0 = time.monotonic()
    expect_raise(lambda: s.wait(["never"], datetime.timedelta(milliseconds=300)), "wait timeout")
    assert time.monotonic() - t0 < 10
    if not V2:
        # 1.13 sends no CANCEL_WAIT: a fresh client is the safe way on after a timeout.
        s = connect(host, port)
    assert s.get("k") == b"\x00\xffbin"  # the connection still works after a timeout

    # get blocks until another process sets the key
    p = subprocess.Popen([sys.executable, __file__, "setter", host, str(port)])
    s.set("go", "1")
    t0 = time.monotonic()
    assert s.get("late") == b"arrived"
    assert time.monotonic() - t0 >= 0.3, "get did not block"

    if hasattr(s, "check"):
        assert s.check(["k", "late"]) is True
        assert s.check(["k", "nope"]) is False
    if hasattr(s, "append"):
        s.append("ap", "ab")
        s.append("ap", "cd")
        assert s.get("ap") == b"abcd"
    if hasattr(s, "multi_set"):
        s.multi_set(["m1", "m2"], ["one", b"two"])
        assert s.multi_get(["m1", "m2", "k"]) == [b"one", b"two", b"\x00\xffbin"]
    if hasattr(s, "queue_push"):
        assert s.queue_len("q") == 0
        s.queue_push("q", "a")
        s.queue_push("q", b"b")
        assert s.queue_len("q") == 2
        assert s.queue_pop("q") == b"a"
        assert s.queue_pop("q", False) == b"b"
        expect_raise(lambda: s.queue_pop("q", False), "pop of an empty queue")
        assert s.queue_pop("jobs") == b"job-1"  # blocked until the setter pushed
    if hasattr(s, "list_keys"):
        keys = s.list_keys()
        for k in ["k", "n", "cs", "late", "go"]:
            assert k in keys, (k, keys)
    if hasattr(s, "barrier"):
        s.barrier("solo", 1)
        s.barrier("bar", 2, datetime.timedelta(seconds=20))  # with the setter process
    assert p.wait(timeout=60) == 0

    if hasattr(s, "clone"):
        c = s.clone()  # a second connection of the same store object
        assert c.get("k") == b"\x00\xffbin"
        c.set("from-clone", "1")
        assert s.get("from-clone") == b"1"

    # get of a missing key: the client waits first, so it times out
    short = connect(host, port)
    short.set_timeout(datetime.timedelta(milliseconds=300))  # 1.13 rounds a connect timeout to s
    expect_raise(lambda: short.get("absent"), "get of a missing key")

    # add on a value that is not an integer: the server drops that connection
    bad = connect(host, port)
    bad.set("text", "hello")
    expect_raise(lambda: bad.add("text", 1), "add on text")
    assert connect(host, port).get("text") == b"hello"

    # PrefixStore (torchft keeps its groups under one)
    pre = dist.PrefixStore("host:1234/torchft/0/1", s)
    pre.set("x", "y")
    assert pre.get("x") == b"y"
    assert s.get("host:1234/torchft/0/1/x") == b"y"
    assert pre.add("c", 2) == 2
    pre.wait(["x"])
    nested = dist.PrefixStore("inner", pre)
    nested.set("z", "1")
    assert s.get("host:1234/torchft/0/1/inner/z") == b"1"

    print("OK", torch.__version__, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "setter":
        setter(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[1], int(sys.argv[2]))
