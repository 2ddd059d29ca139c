"""One rank, one node: in-place requests meshd cannot serve are refused with their cause,
and the service keeps working. Prints `IN-PLACE OK` on success.

    meshd run --nnodes 1 -- python3 examples/in_place_check.py
"""
import array
import json
import os
import socket
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import meshd  # noqa: E402

c = meshd.connect()
assert c.in_place, "meshd could not read this process's memory (ptrace_scope 2 or 3?)"


def refused(head, payload=b"", why=""):
    try:
        c._call(head, payload)
    except meshd.MeshdError as e:
        assert why in str(e), (why, str(e))
        return
    raise AssertionError(f"{head} was accepted")


ar = {"op": "allreduce", "dtype": "float32", "reduce": "sum"}
# An address this process has not mapped: meshd names the buffer and the errno.
refused(dict(ar, addr=8, len=64), why="cannot access the 64-byte buffer at 0x8")
# An address and a payload both, a null or wrapping range, a missing length.
refused(dict(ar, addr=4096, len=4), b"\0\0\0\0", why="carries no payload")
refused(dict(ar, addr=0, len=4), why="addr must be")
refused(dict(ar, addr=2**64 - 8, len=64), why="wraps")
refused(dict(ar, addr=4096), why="needs len")

# A probe at an address meshd cannot read: no in-place buffers for that connection (and
# meshd says once, at info level, that buffers go through the socket).
raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
raw.connect(os.environ["MESHD_SOCKET"])
hello = json.dumps({"op": "hello", "rank": c.rank, "probe_addr": 8, "probe": "00" * 16}).encode()
raw.sendall(struct.pack(">I", len(hello)) + hello)
(n,) = struct.unpack(">I", raw.recv(4, socket.MSG_WAITALL))
reply = json.loads(raw.recv(n, socket.MSG_WAITALL))
assert reply["ok"] and reply["in_place"] is False, reply
raw.close()

# A second connection that skipped the probe may not name addresses.
os.environ["MESHD_IN_PLACE"] = "0"
plain = meshd.Client()
assert not plain.in_place
try:
    plain._call(dict(ar, addr=4096, len=4))
    raise AssertionError("accepted an address without the probe")
except meshd.MeshdError as e:
    assert "probe" in str(e), e
plain.close()

# Still serving: an in-place allreduce of one rank is the identity.
a = array.array("f", [1.5] * 100_001)
c.allreduce(a)
assert list(a) == [1.5] * 100_001
print("IN-PLACE OK", flush=True)
