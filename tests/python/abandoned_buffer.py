"""Issue 29: nothing is written into memory a rank abandoned.

Run by `meshd run --nnodes 1 --nproc-per-node 2`: local rank 0 calls allreduce on an
in-place buffer with a 1 s client timeout and gives up; local rank 1 calls the same
allreduce 3 s later. Rank 0 then fills the buffer it gave up on with a sentinel (as a
user's `except MeshdError:` would fill it with a checkpoint) and checks, after rank 1's
call has come and gone, that every byte is still the sentinel. Rank 1 must get a clear
error naming the rank that gave up, not a result. Prints `ABANDONED OK` on each rank.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import meshd  # noqa: E402

rank = int(os.environ["LOCAL_RANK"])
n = 1 << 20
buf = bytearray(b"\x01" * n)
if rank == 0:
    c = meshd.Client(timeout=1.0)
    assert c.in_place, "the test needs in-place buffers (process_vm_writev)"
    try:
        c.allreduce(buf, op="sum", dtype="int32")
        raise SystemExit("rank 0's allreduce must time out")
    except meshd.MeshdError as e:
        assert "did not answer 'allreduce'" in str(e), e
    buf[:] = b"\xab" * n  # the sentinel: what the user keeps in this memory now
    time.sleep(6)  # rank 1 calls at 3 s; a write-back would land by then
    bad = sum(1 for b in buf if b != 0xAB)
    assert bad == 0, f"{bad} bytes of the abandoned buffer were overwritten"
else:
    c = meshd.Client(timeout=30.0)
    time.sleep(3)
    try:
        c.allreduce(buf, op="sum", dtype="int32")
        raise SystemExit("rank 1's allreduce must fail: rank 0 gave up on it")
    except meshd.MeshdError as e:
        assert "rank 0 gave up on it" in str(e), e
print("ABANDONED OK", flush=True)
