"""meshd's Python client at exit and across fork, against a stand-in meshd (no job needed).

- At exit, the DDP hook's thread is stopped while the interpreter can still run it: one
  waiting for a reply that never comes is woken (its connection shut down) after the
  grace period, ends, and says nothing about a failed allreduce.
- A forked child may not use its parent's connection: connect() and every call raise
  MeshdError saying why, and the parent's connection still works.
Prints `EXIT-FORK OK` when all hold.
"""
import json
import os
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import torch  # noqa: E402

import meshd  # noqa: E402
import meshd.torch as mt  # noqa: E402
import stand_in  # noqa: E402  (tests/python, beside this script)


def serve(conn):
    """Answers hello and barrier; never answers an allreduce."""
    with conn:
        for head in stand_in.requests(conn):
            if head["op"] == "allreduce":
                continue
            reply = json.dumps({"ok": True, "world": 2, "local_world": 2, "nbytes": 0}).encode()
            conn.sendall(struct.pack(">I", len(reply)) + reply)


path = stand_in.listen(serve)
os.environ.update(MESHD_SOCKET=path, RANK="0", WORLD_SIZE="2", MESHD_IN_PLACE="0")

# Fork: the child refuses, the parent goes on.
c = meshd.connect()
c.barrier()
pid = os.fork()
if pid == 0:
    ok = 0
    for f in (meshd.connect, c.barrier):
        try:
            f()
        except meshd.MeshdError as e:
            ok += "fork" in str(e) and str(os.getpid()) in str(e)
    os._exit(0 if ok == 2 else 1)
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"forked child: status {status}"
c.barrier()  # the child closed only its copy of the socket

# Exit with an allreduce in flight that meshd never answers.
hung = meshd.Client(path)
fut = mt._get_worker().submit(hung, lambda: hung.allreduce(torch.zeros(4), op="avg"))
time.sleep(0.2)
assert not fut.done()
t = time.monotonic()
mt._EXIT_GRACE = 0.3
w = mt._worker
mt._shutdown()
took = time.monotonic() - t
assert not w._thread.is_alive(), "the hook's thread must have ended"
assert 0.3 <= took < 3, took
assert fut.done()
try:
    fut.wait()
    raise SystemExit("the interrupted allreduce must fail its future")
except RuntimeError as e:
    assert "closed the connection" in str(e), e
c.barrier()  # other connections are untouched
print(f"EXIT-FORK OK stopped_in={took:.2f}s", flush=True)
