"""meshd's Python client against a stand-in meshd that goes silent (no job needed).

- A call whose reply never comes raises MeshdError after the client's timeout (from
  MESHD_TIMEOUT, or Client(timeout=)), naming the request and the setting, instead of
  blocking forever; the connection is then closed and later calls say why at once.
- A store_get waits its own timeout (plus a margin) even when that is longer than the
  client's timeout.
- A meshd that dies mid-call (the socket reset or closed) raises MeshdError too.
- A bad MESHD_TIMEOUT is refused with the cause.
Prints `TIMEOUT OK` when all hold.
"""
import json
import os
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import meshd  # noqa: E402
import stand_in  # noqa: E402  (tests/python, beside this script)


def reply(conn, head, body=b""):
    head = dict(head, nbytes=len(body))
    h = json.dumps(head).encode()
    conn.sendall(struct.pack(">I", len(h)) + h + body)


def serve(conn):
    """Answers hello; a store_get after 1.5 s; never answers a barrier; closes on allreduce."""
    with conn:
        for head in stand_in.requests(conn):
            op = head["op"]
            if op == "hello":
                reply(conn, {"ok": True, "world": 1, "local_world": 1})
            elif op == "store_get":
                time.sleep(1.5)
                reply(conn, {"ok": True}, b"late value")
            elif op == "allreduce":
                return  # meshd gone mid-call
            # barrier: silence


path = stand_in.listen(serve)
os.environ["MESHD_IN_PLACE"] = "0"

# The environment's timeout, a silent meshd.
os.environ["MESHD_TIMEOUT"] = "1"
c = meshd.Client(path, rank=0, world_size=1)
assert c.timeout == 1.0, c.timeout
t0 = time.monotonic()
try:
    c.barrier()
    raise SystemExit("a silent meshd must not block forever")
except meshd.MeshdError as e:
    took = time.monotonic() - t0
    msg = str(e)
    assert 0.9 <= took < 5, took
    assert "did not answer 'barrier' for 1 s" in msg and "MESHD_TIMEOUT" in msg, msg
try:
    c.barrier()
    raise SystemExit("a connection out of step must not be used again")
except meshd.MeshdError as e:
    assert "did not answer 'barrier'" in str(e), e

# store_get waits its own timeout beyond the client's.
c = meshd.Client(path, rank=0, world_size=1, timeout=0.5)
assert c.store_get("k", timeout=2.0) == b"late value"
assert c._sock.gettimeout() == 0.5, "the client's timeout is back after the call"

# A meshd that closes the connection mid-call.
try:
    c.allreduce(bytearray(8))
    raise SystemExit("a closed connection must raise")
except meshd.MeshdError as e:
    assert "closed the connection" in str(e) or "lost meshd" in str(e), e

# 0 waits forever (no timeout on the socket); a bad value is refused with the cause.
os.environ["MESHD_TIMEOUT"] = "0"
assert meshd.Client(path, rank=0, world_size=1).timeout is None
os.environ["MESHD_TIMEOUT"] = "soon"
try:
    meshd.Client(path, rank=0, world_size=1)
    raise SystemExit("a bad MESHD_TIMEOUT must be refused")
except meshd.MeshdError as e:
    assert "MESHD_TIMEOUT='soon' is not a number" in str(e), e
del os.environ["MESHD_TIMEOUT"]
assert meshd.Client(path, rank=0, world_size=1).timeout == meshd.DEFAULT_TIMEOUT
print("TIMEOUT OK")
