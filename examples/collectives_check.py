"""Checks meshd's collectives from every rank; prints `COLLECTIVES OK rank=R` on success.

    meshd run --nnodes 3 --peers ... --nproc-per-node 2 -- python3 examples/collectives_check.py
"""
import array
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import meshd  # noqa: E402

c = meshd.connect()
rank, world = c.rank, c.world_size

# array.array of float64: sum of (rank + 1) over all ranks, odd length
n = 1001
a = array.array("d", [rank + 1.0] * n)
c.allreduce(a, op="sum")
want = world * (world + 1) / 2
assert all(x == want for x in a), (a[:3], want)

# int64 max and min
b = array.array("q", [rank] * 7)
c.allreduce(b, op="max")
assert list(b) == [world - 1] * 7, list(b)
b = array.array("q", [rank + 10] * 3)
c.allreduce(b, op="min")
assert list(b) == [10] * 3, list(b)

used = []  # what the run exercised besides the standard library: said in the OK line
try:
    import numpy as np

    # Larger than the 4 MiB from which meshd splits the local phase over threads (and its
    # 1 MiB slices), odd length.
    big = np.arange(1_500_001, dtype=np.float32) % 251 + rank
    c.allreduce(big, op="sum")
    assert (big == (np.arange(1_500_001, dtype=np.float32) % 251) * world + want - world).all(), big[:3]
    x = np.full(12345, rank, dtype=np.float32)
    c.allreduce(x, op="avg")
    assert np.allclose(x, (world - 1) / 2), x[:3]
    # Large enough that the ring lends its chunks to QUIC: the average still divides by
    # every rank of the job, not by the nodes.
    z = np.full(1_000_003, rank, dtype=np.float32)
    c.allreduce(z, op="avg")
    assert np.allclose(z, (world - 1) / 2), z[:3]
    y = np.arange(5, dtype=np.int32) * (rank + 1)
    c.allreduce(y)
    assert (y == np.arange(5, dtype=np.int32) * (world * (world + 1) // 2)).all(), y
    used.append("numpy")
except ImportError:
    pass

try:
    import torch

    t = torch.full((1000,), float(rank), dtype=torch.bfloat16)
    c.allreduce(t, op="max")
    assert (t == float(world - 1)).all(), t[:3]
    h = torch.ones(77, dtype=torch.float16)
    c.allreduce(h, op="sum")
    assert (h == float(world)).all(), h[:3]
    # The host buffer CUDA tensors are staged through (no GPU here: the helper itself):
    # one per dtype and size, reused, and pageable where CUDA cannot pin.
    g = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    s1 = meshd._staging(g)
    assert s1.shape == (12,) and s1.dtype == torch.float32 and s1.is_contiguous(), s1
    assert meshd._staging(g.clone()) is s1, "same dtype and size: the same buffer"
    assert meshd._staging(g.double()) is not s1, "another dtype: another buffer"
    s1.copy_(g.reshape(-1))
    c.allreduce(s1, op="sum")
    assert (s1.view(g.shape) == g * world).all(), s1
    # A view at an offset into a larger tensor: only its own elements change.
    whole = torch.zeros(10, dtype=torch.int64)
    part = whole[3:7]
    part.fill_(rank + 1)
    c.allreduce(part, op="sum")
    assert whole.tolist() == [0, 0, 0] + [world * (world + 1) // 2] * 4 + [0, 0, 0], whole
    used.append("torch-" + torch.__version__.split("+")[0])
except ImportError:
    pass

# broadcast from the last rank: byte-exact
payload = bytearray(os.urandom(37)) if rank == world - 1 else bytearray(37)
c.broadcast(payload, root=world - 1)
c.store_set(f"bcast-{rank}", bytes(payload))
c.barrier()
first = c.store_get("bcast-0", timeout=30)
assert first == bytes(payload), "ranks disagree on the broadcast"

# store across ranks and nodes
c.store_set(f"hello-{rank}", f"from {rank}")
for r in range(world):
    assert c.store_get(f"hello-{r}", timeout=30) == f"from {r}".encode()
try:
    c.store_get("never-set", timeout=0.2)
    raise AssertionError("store_get of a missing key must time out")
except meshd.MeshdError as e:
    assert "not set" in str(e), e

c.barrier()
print(f"COLLECTIVES OK rank={rank} world={world} in_place={c.in_place} used={','.join(used) or 'stdlib'}", flush=True)
