"""Issue 29: the tunnel under a low open-files limit (run by `prlimit --nofile=128 meshd run
--collective tunnel` on 2 nodes x 2 ranks behind the one-port firewall).

The ranks of node 1 listen, accept and close each connection at once (holding no file for
it). Each rank of node 0 opens 75 connections
to them through the tunnel and holds them: 150 in all, more than meshd's 128 files allow.
Every attempt must end at once, connected or refused (ECONNREFUSED), never hang or fail
otherwise; at least one connects and at least one is refused. Then all are closed and one
more connection must succeed within 10 s: meshd still accepts. Prints `FDS OK rank=R ok=N refused=M`.
"""
import errno
import os
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import meshd  # noqa: E402

PER_RANK = 75
c = meshd.connect()
rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
node = int(os.environ["GROUP_RANK"])
me = os.environ["MESHD_NODE_ADDR"]
ok = refused = 0
if node == 1:
    server = socket.socket()
    server.bind((me, 0))
    server.listen(512)

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    c.store_set(f"fds/listen{local}", f"{me}:{server.getsockname()[1]}")
    c.barrier()  # every rank of node 0 has closed what it held
else:
    host, port = c.store_get(f"fds/listen{local}", timeout=60).decode().rsplit(":", 1)
    held = []
    t0 = time.time()
    for _ in range(PER_RANK):
        s = socket.socket()
        s.settimeout(20)
        try:
            s.connect((host, int(port)))
            held.append(s)
            ok += 1
        except ConnectionRefusedError as e:
            assert e.errno == errno.ECONNREFUSED, e
            refused += 1
            s.close()
    took = time.time() - t0
    assert took < 30, f"{PER_RANK} connects took {took:.1f} s"
    for s in held:
        s.close()
    # The other local rank's connections hold this node's budget too: wait for it to
    # close them, then give meshd up to 10 s to free the files (each close crosses the
    # tunnel to the far end and back on a loaded machine).
    c.barrier()
    deadline = time.time() + 10
    while True:
        # meshd still accepts: one more connection.
        try:
            s = socket.create_connection((host, int(port)), timeout=20)
            break
        except ConnectionRefusedError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    assert s.getpeername() == (host, int(port)), s.getpeername()
    s.close()
c.barrier()  # node 0 is done; node 1's ranks stop listening only now
buf = bytearray(struct.pack("<qq", ok, refused))
c.allreduce(buf, op="sum", dtype="int64")
total_ok, total_refused = struct.unpack("<qq", buf)
assert total_ok >= 1 and total_refused >= 1, f"ok={total_ok} refused={total_refused}: the cap was never reached or nothing connected"
assert total_ok + total_refused == 2 * PER_RANK, (total_ok, total_refused)
print(f"FDS OK rank={rank} ok={total_ok} refused={total_refused}", flush=True)
