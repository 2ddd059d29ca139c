"""The tunnel's interposer is invisible to plain Python sockets (lab_tunnel.rs runs this).

Under `meshd run --collective tunnel` on two nodes, one rank each: every rank serves on
its node's address (an echo port; a port whose accept queue is full, so a connect to it
stays in progress until meshd's far end gives up; a port for "done") and checks, against
the other node through the tunnel:

- rcvtimeo:    SO_RCVTIMEO set before connect makes a recv time out (EAGAIN);
- options:     SO_KEEPALIVE, TCP_KEEPIDLE, TCP_NODELAY, SO_SNDBUF and bind set before
               connect read back after it (getsockname: the bound address and port);
- nonblocking: connect returns EINPROGRESS, poll sees the socket writable, SO_ERROR is 0
               for a listening port and ECONNREFUSED for a closed one; while meshd has not
               answered the socket is not writable and getpeername says ENOTCONN;
- timeout:     socket.create_connection(timeout=1) works, and gives up after its second;
- asyncio:     open_connection under wait_for works, is refused, and times out on time;
- dup:         socket.fromfd and os.dup'd fds answer getpeername with the TCP destination,
               take TCP_NODELAY and share it;
- exec:        a child program that inherits the fd sees a TCP socket too;
- fork:        children forked while other threads connect and set options don't hang.

Prints "CHECK <name> ok" per check and "SOCKETS OK" at the end; any failure raises (the
exit code is non-zero). Every wait is bounded; a watchdog ends a stuck run.
TUNNEL_SOCKETS_ONLY=rcvtimeo,fork_while_busy (function names) runs only those.
"""
import asyncio
import errno
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time

ECHO, FULL, DONE, CLOSED = 29611, 29612, 29613, 29619
me = os.environ["MESHD_NODE_ADDR"]
peers = [p for p in os.environ.get("MESHD_TUNNEL_PEERS", "").split(",") if p]
assert len(peers) == 1, f"two nodes expected: MESHD_TUNNEL_PEERS={peers}"
peer = peers[0]
done = threading.Event()
current = ["start"]


def watchdog(seconds):
    """Ends the run if check `current[0]` takes longer than `seconds`; cancel() it after."""
    name = current[0]

    def fire():
        print(f"WATCHDOG: check {name} still running after {seconds} s", flush=True)
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


def check(name):
    current[0] = name
    print(f"CHECK {name} ok", flush=True)


def listener(port, backlog=16):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((me, port))
    s.listen(backlog)
    return s


def serve_echo(srv):
    def one(c):
        with c:
            while True:
                try:
                    b = c.recv(65536)
                except OSError:
                    return
                if not b:
                    return
                c.sendall(b)

    while True:
        c, _ = srv.accept()
        threading.Thread(target=one, args=(c,), daemon=True).start()


def serve_done(srv):
    c, _ = srv.accept()
    c.close()
    done.set()


def roundtrip(s, data=b"ping"):
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        b = s.recv(65536)
        assert b, f"end of file after {len(got)} bytes"
        got += b
    assert got == data, (got, data)


def wait_for_peer():
    """The other rank serves once it has started: connect until not refused (bounded)."""
    deadline = time.time() + 90
    while True:
        try:
            s = socket.create_connection((peer, ECHO), timeout=10)
            roundtrip(s)
            s.close()
            return
        except ConnectionRefusedError:
            assert time.time() < deadline, "the other rank never served"
            time.sleep(0.2)


def rcvtimeo():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 500_000))
    s.connect((peer, ECHO))
    t = time.time()
    try:
        s.recv(1)
        raise AssertionError("recv returned without data or timeout")
    except BlockingIOError as e:
        assert e.errno == errno.EAGAIN, e
    took = time.time() - t
    assert 0.3 <= took < 5, f"SO_RCVTIMEO 0.5 s: the recv took {took:.2f} s"
    s.close()
    check("rcvtimeo")


def options():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 17)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 262144)
    sndbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    s.bind((me, 0))
    port = s.getsockname()[1]
    s.connect((peer, ECHO))
    got = (
        s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
        s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
        s.getsockname(),
        s.getpeername(),
    )
    assert got == (1, 17, 1, sndbuf, (me, port), (peer, ECHO)), got
    roundtrip(s)
    s.close()
    check("options")


def so_error(s):
    return s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)


def nonblocking():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    rc = s.connect_ex((peer, ECHO))
    assert rc == errno.EINPROGRESS, f"connect_ex: {rc} ({os.strerror(rc)}), not EINPROGRESS"
    p = select.poll()
    p.register(s, select.POLLOUT)
    ev = p.poll(20_000)
    assert ev and ev[0][1] & select.POLLOUT, ev
    assert so_error(s) == 0
    s.setblocking(True)
    roundtrip(s)
    s.close()

    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    rc = s.connect_ex((peer, CLOSED))
    assert rc == errno.EINPROGRESS, f"connect_ex: {rc} ({os.strerror(rc)}), not EINPROGRESS"
    assert select.select([], [s], [], 20)[1], "never ready"
    e = so_error(s)
    assert e == errno.ECONNREFUSED, f"SO_ERROR {e} ({os.strerror(e)}), not ECONNREFUSED"
    s.close()

    # Nobody accepts: in progress until meshd's far end gives up (seconds).
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    rc = s.connect_ex((peer, FULL))
    assert rc == errno.EINPROGRESS, f"connect_ex: {rc} ({os.strerror(rc)}), not EINPROGRESS"
    p = select.poll()
    p.register(s, select.POLLOUT)
    assert p.poll(500) == [], "writable while the connect is in progress"
    assert so_error(s) == 0
    try:
        s.getpeername()
        raise AssertionError("getpeername answered while in progress")
    except OSError as e:
        assert e.errno == errno.ENOTCONN, e
    s.close()
    check("nonblocking")


def timeout():
    s = socket.create_connection((peer, ECHO), timeout=1)
    roundtrip(s)
    s.close()
    t = time.time()
    try:
        socket.create_connection((peer, FULL), timeout=1)
        raise AssertionError("connected to a port nobody accepts on")
    except TimeoutError:
        pass
    took = time.time() - t
    assert 0.8 <= took < 4, f"create_connection(timeout=1) gave up after {took:.2f} s"
    check("timeout")


def asyncio_check():
    async def main():
        r, w = await asyncio.wait_for(asyncio.open_connection(peer, ECHO), 10)
        w.write(b"a" * 100_000)
        await w.drain()
        got = await asyncio.wait_for(r.readexactly(100_000), 10)
        assert got == b"a" * 100_000
        w.close()
        await w.wait_closed()
        try:
            await asyncio.wait_for(asyncio.open_connection(peer, CLOSED), 10)
            raise AssertionError("connected to a closed port")
        except ConnectionRefusedError:
            pass
        t = time.time()
        try:
            await asyncio.wait_for(asyncio.open_connection(peer, FULL), 1)
            raise AssertionError("connected to a port nobody accepts on")
        except asyncio.TimeoutError:
            pass
        took = time.time() - t
        assert 0.8 <= took < 4, f"wait_for(open_connection, 1) gave up after {took:.2f} s"

    asyncio.run(main())
    check("asyncio")


CHILD = r"""
import socket, sys
fd, peer, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
s = socket.socket(fileno=fd)
assert s.family == socket.AF_INET, s.family
assert s.getpeername() == (peer, port), s.getpeername()
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
s.sendall(b"child")
assert s.recv(5) == b"child"
print("CHILD OK")
"""


def dup_and_exec():
    s = socket.create_connection((peer, ECHO), timeout=10)
    s.settimeout(None)  # the fd's O_NONBLOCK is its dups' too
    d = socket.fromfd(s.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    assert d.getpeername() == (peer, ECHO), d.getpeername()
    d.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1, "one socket, whichever fd"
    e = socket.socket(fileno=os.dup(s.fileno()))
    assert e.family == socket.AF_INET, e.family
    assert e.getpeername() == (peer, ECHO), e.getpeername()
    roundtrip(d, b"via the dup")
    check("dup")
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(e.fileno()), peer, str(ECHO)],
        pass_fds=[e.fileno()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "CHILD OK" in r.stdout, (r.returncode, r.stdout, r.stderr)
    roundtrip(s, b"still the parent's")
    for x in (s, d, e):
        x.close()
    check("exec")


def fork_while_busy():
    # Many tunnelled sockets open, and threads that use them (getpeername and getsockname
    # release the GIL, so they run while the main thread forks) or open new ones.
    held = [socket.create_connection((peer, ECHO), timeout=10) for _ in range(200)]
    shared = held[0]
    stop = threading.Event()

    def names(k):
        i = k
        while not stop.is_set():
            s = held[i % len(held)]
            i += 7
            s.getpeername()
            s.getsockname()
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)

    def connects(_):
        while not stop.is_set():
            c = socket.create_connection((peer, ECHO), timeout=10)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c.close()

    jobs = [names] * 6 + [connects] * 2
    threads = [threading.Thread(target=f, args=(k,), daemon=True) for k, f in enumerate(jobs)]
    for t in threads:
        t.start()
    hung = 0
    forks = 150
    for n in range(forks):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                shared.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ok = shared.getpeername() == (peer, ECHO)
                c = socket.create_connection((peer, ECHO), timeout=10)
                c.close()
                code = 0 if ok else 2
            finally:
                os._exit(code)
        deadline = time.time() + 15
        while True:
            wpid, status = os.waitpid(pid, os.WNOHANG)
            if wpid == pid:
                assert status == 0, f"the forked child failed: status {status:#x}"
                break
            if time.time() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                hung += 1
                break
            time.sleep(0.002)
        if hung:
            break  # one is enough to fail
    stop.set()
    for t in threads:
        t.join(20)
    for s in held:
        s.close()
    assert hung == 0, f"a forked child hung ({n + 1} forks in)"
    check("fork")


def main():
    echo = listener(ECHO)
    threading.Thread(target=serve_echo, args=(echo,), daemon=True).start()
    # A full accept queue: one connection waits in it, never accepted; later SYNs drop.
    full = listener(FULL, backlog=0)
    filler = socket.create_connection((me, FULL), timeout=10)
    done_srv = listener(DONE)
    threading.Thread(target=serve_done, args=(done_srv,), daemon=True).start()
    current[0] = "wait_for_peer"
    w = watchdog(100)
    wait_for_peer()
    w.cancel()
    checks = (rcvtimeo, options, nonblocking, timeout, asyncio_check, dup_and_exec, fork_while_busy)
    only = [c for c in os.environ.get("TUNNEL_SOCKETS_ONLY", "").split(",") if c]
    for f in checks:
        if only and f.__name__ not in only:
            continue
        current[0] = f.__name__
        w = watchdog(150 if f is fork_while_busy else 60)
        f()
        w.cancel()
    current[0] = "done"
    socket.create_connection((peer, DONE), timeout=10).close()
    assert done.wait(200), "the other rank never finished"
    filler.close()
    full.close()
    print("SOCKETS OK", flush=True)


main()
