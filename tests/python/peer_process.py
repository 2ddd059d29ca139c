"""Issue 29: meshd reads and writes only the memory of the process that connected its
socket (the kernel's SO_PEERCRED), never that of whoever holds the socket now.

Under `meshd run --nnodes 1 --nproc-per-node 1`: the rank connects to MESHD_SOCKET and
forks; the child, holding an inherited copy of the connection, sends hello with a probe
of its own memory and then an in-place allreduce of its own buffer. meshd would probe
the parent (the socket's peer) at the child's address, so it must answer in_place false
and refuse the in-place request; the parent's memory at that address must be unchanged.
Prints `PEER OK`.
"""
import ctypes
import json
import os
import socket
import struct
import sys
import time


def send(s, head, payload=b""):
    head = dict(head, nbytes=len(payload))
    h = json.dumps(head).encode()
    s.sendall(struct.pack(">I", len(h)) + h + payload)


def recv(s):
    n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
    head = json.loads(s.recv(n, socket.MSG_WAITALL))
    if head.get("nbytes"):
        s.recv(head["nbytes"], socket.MSG_WAITALL)
    return head


def addr(buf):
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(os.environ["MESHD_SOCKET"])
# Allocated before the fork: the same address in both processes, different contents after.
probe = bytearray(16)
buf = bytearray(4096)
pid = os.fork()
if pid == 0:
    probe[:] = os.urandom(16)
    buf[:] = b"\x07" * len(buf)
    send(s, {"op": "hello", "rank": 0, "probe_addr": addr(probe), "probe": probe.hex()})
    h = recv(s)
    assert h.get("ok") and h.get("in_place") is False, f"meshd probed the wrong process: {h}"
    send(s, {"op": "allreduce", "dtype": "int32", "reduce": "sum", "addr": addr(buf), "len": len(buf)})
    h = recv(s)
    assert not h.get("ok") and "probe" in h.get("error", ""), f"an in-place request was taken: {h}"
    os._exit(0)
s.close()
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child failed: {status}"
time.sleep(0.2)
assert probe == bytearray(16) and buf == bytearray(4096), "meshd wrote into the parent's memory"
print("PEER OK", flush=True)
