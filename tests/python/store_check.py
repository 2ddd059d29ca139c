"""Checks the job-wide store's guarantees from every rank; prints `STORE OK rank=R`.

- `store_set` returns only once every node holds the value: after rank 0's sets and a
  barrier, every rank reads every value without waiting (timeout 0);
- concurrent sets of one key end with the same value on every node: all ranks set the
  same keys at once, then compare what they read with an allreduce min/max;
- the store is bounded: filling it fails with an error that names the limit (skipped with
  STORE_CHECK_FILL=0: 64 MiB to every node is slow on a lossy link).
"""
import array
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import meshd  # noqa: E402

c = meshd.connect()
rank, world = c.rank, c.world_size

# 1. A set returns when every node has it: 40 values of 256 KiB, then read at once.
if rank == 0:
    for i in range(40):
        c.store_set(f"big-{i}", bytes([i % 251]) * (256 << 10))
c.barrier()
for i in range(40):
    try:
        v = c.store_get(f"big-{i}", timeout=0)
    except meshd.MeshdError as e:
        raise AssertionError(f"rank {rank}: big-{i} not here right after rank 0's set returned: {e}")
    assert v == bytes([i % 251]) * (256 << 10), f"rank {rank}: big-{i} differs"

# 2. Concurrent sets of one key: every rank writes its own rank, all at once.
rounds = 30
for r in range(rounds):
    c.barrier()
    c.store_set(f"race-{r}", str(rank))
c.barrier()
seen = [int(c.store_get(f"race-{r}", timeout=0)) for r in range(rounds)]
lo = array.array("q", seen)
hi = array.array("q", seen)
c.allreduce(lo, op="min")
c.allreduce(hi, op="max")
assert list(lo) == seen == list(hi), f"rank {rank}: nodes disagree: {seen} vs min {list(lo)} max {list(hi)}"
# Overwrites by one writer in sequence: the last one stays everywhere.
if rank == world - 1:
    for v in range(20):
        c.store_set("seq", str(v))
c.barrier()
assert c.store_get("seq", timeout=0) == b"19", f"rank {rank}: {c.store_get('seq', timeout=0)}"

# 3. The bound: 1 MiB values until the store (64 MiB) says it is full.
c.barrier()
if rank == 0 and os.environ.get("STORE_CHECK_FILL", "1") != "0":
    err = None
    for i in range(80):
        try:
            c.store_set(f"fill-{i}", bytes(1 << 20))
        except meshd.MeshdError as e:
            err = str(e)
            break
    assert err and "store full" in err and "limit" in err, err
    print(f"store refused: {err}", flush=True)
c.barrier()
print(f"STORE OK rank={rank} world={world}", flush=True)
